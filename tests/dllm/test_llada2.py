"""LLaDA2-style block diffusion in vispec: the block-causal loop with its exact prefix cache and the token-editing
policy give diffusers' ``LLaDA2Pipeline`` + ``BlockRefinementScheduler`` tokens, token for token, on a tiny random
LLaDA2-layout model (greedy, batch > 1, editing on and off, EOS early stop), through ``vispec.dllm.decode`` and through
vispec's pipeline handed diffusers' scheduler."""

from __future__ import annotations

import pytest
import torch
from diffusers import BlockRefinementScheduler, LLaDA2Pipeline
from helpers import tiny_llada

from vispec.dllm import SCHEDULERS, StopDecoding, TokenEditingScheduler, decode, from_block_refinement, make_scheduler
from vispec.models.llada2 import LLaDA2MoeModelLM
from vispec.pipelines.masked_diffusion_lm import MaskedDiffusionLMPipeline

MASK, EOS, PAD = 99, 1, 0


def tiny_llada2(sharpness: float, seed: int = 0) -> LLaDA2MoeModelLM:
    """A tiny random LLaDA2-layout model in float64 (so batch composition and cache shapes cannot flip an arg-max),
    its head scaled by ``sharpness`` so that confidences cross the thresholds, and the mask token's head row zero
    (never an arg-max: diffusers proposes it, vispec does not)."""
    torch.manual_seed(seed)
    model = LLaDA2MoeModelLM(
        vocab_size=100, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, num_experts=8, num_shared_experts=1, num_experts_per_tok=2, n_group=4,
        topk_group=2, moe_intermediate_size=16, first_k_dense_replace=1, mask_token_id=MASK, eos_token_id=EOS,
        pad_token_id=PAD, block_length=8, max_position_embeddings=256, initializer_range=0.3)
    with torch.no_grad():
        model.lm_head.weight.mul_(sharpness)
        model.lm_head.weight[MASK] = 0
        model.model.layers[1].mlp.gate.expert_bias.normal_(0, 0.1)
    return model.double().eval()


@pytest.fixture(scope="module")
def model():
    return tiny_llada2(4.0)


def prompts(batch: int, length: int, seed: int) -> torch.Tensor:
    return torch.randint(2, MASK, (batch, length), generator=torch.Generator().manual_seed(seed))


def diffusers_tokens(model, ids, *, batched: bool, **call) -> torch.Tensor:
    """``LLaDA2Pipeline`` on ``ids`` (the whole batch, or each row alone), its masks after EOS read as EOS (vispec's
    early stop writes EOS there)."""
    pipe = LLaDA2Pipeline(model=model, scheduler=BlockRefinementScheduler(block_length=8))
    pipe.set_progress_bar_config(disable=True)
    run = lambda x: pipe(input_ids=x, use_chat_template=False, mask_token_id=MASK, eos_token_id=EOS,  # noqa: E731
                         output_type="seq", **call).sequences
    out = run(ids) if batched else torch.cat([run(row[None]) for row in ids])
    return torch.where(out == MASK, EOS, out)


@pytest.mark.parametrize("editing_threshold", [0.5, None], ids=["editing", "no-editing"])
def test_decode_equals_llada2_pipeline_at_its_defaults(model, editing_threshold):
    """diffusers' call defaults (threshold 0.7, editing 0.5, max_post_steps 16, 32 steps, minimal_topk 1, EOS early
    stop, greedy) are TokenEditingScheduler's; the prompt (5 tokens) puts the first block inside the prompt and a tail
    after the answer."""
    ids = prompts(3, 5, seed=1)
    call = dict(gen_length=24, block_length=8, editing_threshold=editing_threshold)
    alone = diffusers_tokens(model, ids, batched=False, **call)
    scheduler = TokenEditingScheduler(editing_threshold=editing_threshold)
    for cache in ("none", "prefix"):
        out = decode(model, ids, None, scheduler=scheduler, gen_length=24, block_length=8, early_stop_eos=True,
                     cache=cache)
        assert torch.equal(out.tokens, alone), cache
        assert out.labels["attention"] == "block_causal" and out.method == "editing"
    assert (out.stats.extra["edits"] > 0).all() == (editing_threshold is not None)
    if editing_threshold is None:  # without edits diffusers' batch-wide stop rule changes nothing
        assert torch.equal(out.tokens, diffusers_tokens(model, ids, batched=True, **call))


@pytest.mark.parametrize("sharpness, seed, editing_threshold", [(4.0, 2, 0.8), (3.0, 5, 0.5), (4.0, 4, 0.8)])
def test_batches_equal_llada2_pipeline_batches_when_edits_settle(sharpness, seed, editing_threshold):
    """diffusers runs a batch until every row's rule stops it; vispec stops each row by its own rule. On these
    prompts every row edits (T2T) and its edits settle before the batch moves on, so the batches agree as well."""
    model = tiny_llada2(sharpness)
    ids = prompts(2, 5, seed)
    call = dict(gen_length=16, block_length=8, editing_threshold=editing_threshold, max_post_steps=4)
    out = decode(model, ids, None, scheduler=TokenEditingScheduler(editing_threshold=editing_threshold, max_post_steps=4),
                 gen_length=16, block_length=8, early_stop_eos=True, cache="prefix")
    assert (out.stats.extra["edits"] > 0).all()
    assert torch.equal(out.tokens, diffusers_tokens(model, ids, batched=True, **call))


def test_pipeline_takes_block_refinement_scheduler(model, tmp_path):
    """vispec's pipeline maps diffusers' scheduler (its config: block_length, num_inference_steps, threshold,
    editing_threshold, minimal_topk) onto the editing policy and gives LLaDA2Pipeline's tokens."""
    diffusers_scheduler = BlockRefinementScheduler(block_length=8, num_inference_steps=6, threshold=0.8,
                                                   editing_threshold=0.6, minimal_topk=2)
    mapped = from_block_refinement(diffusers_scheduler)
    assert dict(threshold=0.8, editing_threshold=0.6, num_inference_steps=6, minimal_topk=2, block_length=8,
                max_post_steps=16).items() <= dict(mapped.config).items()
    ids = prompts(2, 6, seed=4)
    expected = diffusers_tokens(model, ids, batched=False, gen_length=16, block_length=8, num_inference_steps=6,
                                threshold=0.8, editing_threshold=0.6, minimal_topk=2)
    pipe = MaskedDiffusionLMPipeline(model=model, tokenizer=None, scheduler=diffusers_scheduler)
    pipe.set_progress_bar_config(disable=True)
    assert isinstance(pipe.scheduler, TokenEditingScheduler)
    assert torch.equal(pipe(input_ids=ids, gen_length=16, cache="prefix").sequences, expected)  # block_length: the scheduler's
    pipe.save_pretrained(tmp_path / "pipe")  # the mapped policy saves and loads as a pipeline component
    again = MaskedDiffusionLMPipeline.from_pretrained(tmp_path / "pipe", dtype=torch.float64)
    again.set_progress_bar_config(disable=True)
    assert isinstance(again.scheduler, TokenEditingScheduler)
    assert torch.equal(again(input_ids=ids, gen_length=16).sequences, expected)
    # as strategy=, with LLaDA2Pipeline's call names overriding the scheduler's settings
    other = MaskedDiffusionLMPipeline(model=model, tokenizer=None, scheduler=make_scheduler("threshold"))
    other.set_progress_bar_config(disable=True)
    out = other(input_ids=ids, gen_length=16, block_length=8, strategy=BlockRefinementScheduler(), threshold=0.8,
                editing_threshold=0.6, num_inference_steps=6, minimal_topk=2)
    assert torch.equal(out.sequences, expected) and out.stats[0]["method"] == "editing"


def test_padded_rows_decode_as_they_do_alone(model):
    """Left-padded prompts of different lengths: each row's blocks start at its own first token, so its tokens and NFE
    are those it gets alone (diffusers aligns blocks to the padded batch instead)."""
    rows = [prompts(1, n, seed=n)[0] for n in (5, 9, 2)]
    width = max(len(r) for r in rows)
    ids = torch.full((3, width), PAD)
    mask = torch.zeros(3, width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r):], mask[i, width - len(r):] = r, 1
    scheduler = TokenEditingScheduler()
    batch = decode(model, ids, mask, scheduler=scheduler, gen_length=16, block_length=8, early_stop_eos=True,
                   cache="prefix")
    for i, r in enumerate(rows):
        alone = decode(model, r[None], None, scheduler=scheduler, gen_length=16, block_length=8, early_stop_eos=True)
        assert torch.equal(batch.tokens[i], alone.tokens[0]) and batch.stats.nfe[i] == alone.stats.nfe[0]


@pytest.mark.parametrize("strategy", ["threshold", "llada"])
def test_other_policies_and_sampling_run_block_causal(model, strategy):
    """Every policy drives the block-causal loop; the prefix cache is exact for them too; with temperature each row's
    Gumbel noise is its own (rows in a batch decode as alone)."""
    ids = prompts(2, 7, seed=6)
    kwargs = dict(steps=8) if strategy == "llada" else {}
    runs = {cache: decode(model, ids, None, scheduler=make_scheduler(strategy), gen_length=16, block_length=8,
                          cache=cache, **kwargs) for cache in ("none", "prefix")}
    assert torch.equal(runs["none"].tokens, runs["prefix"].tokens) and (runs["none"].tokens != MASK).all()
    gens = lambda: [torch.Generator().manual_seed(s) for s in (11, 12)]  # noqa: E731
    sampled = decode(model, ids, None, scheduler=TokenEditingScheduler(), gen_length=16, block_length=8,
                     temperature=1.0, generator=gens(), cache="prefix")
    second = decode(model, ids[1:], None, scheduler=TokenEditingScheduler(), gen_length=16, block_length=8,
                    temperature=1.0, generator=gens()[1:])
    assert torch.equal(sampled.tokens[1:], second.tokens)


def test_callback_sees_progress_edits_and_stops(model):
    ids = prompts(2, 5, seed=1)
    seen = []

    def fill_first(progress):  # commit the answer's first token to 7 after the first forward: both caches agree
        seen.append(progress)
        if progress.step == 0:
            tokens = progress.tokens.clone()
            tokens[:, 0] = 7
            return {"tokens": tokens}
        return None

    runs = [decode(model, ids, None, scheduler=TokenEditingScheduler(), gen_length=16, block_length=8, cache=cache,
                   callback=fill_first) for cache in ("none", "prefix")]
    assert torch.equal(runs[0].tokens, runs[1].tokens)
    assert "editing_transfer_index" in seen[0].details and seen[0].tokens.shape == (2, 16)

    def stop(progress):
        raise StopDecoding

    out = decode(model, ids, None, scheduler=TokenEditingScheduler(), gen_length=16, block_length=8, callback=stop)
    assert out.labels["interrupted"] and (out.tokens == MASK).any() and out.stats.nfe.tolist() == [1, 1]


def test_what_block_causal_decoding_does_not_take_is_refused(model):
    ids = prompts(1, 5, seed=1)
    editing = TokenEditingScheduler()
    for kwargs, match in [(dict(cache="dual"), "cache='dual' does not apply to a block-causal model"),
                          (dict(guidance_scale=2.0), "guidance_scale != 1"),
                          (dict(steps=4), "steps does not apply to the editing policy")]:
        with pytest.raises(ValueError, match=match):
            decode(model, ids, None, scheduler=editing, gen_length=16, block_length=8, **kwargs)
    masked = ids.clone()
    masked[0, 2] = MASK
    with pytest.raises(ValueError, match="prompt infilling is not supported"):
        decode(model, masked, None, scheduler=editing, gen_length=16, block_length=8)
    with pytest.raises(ValueError, match="beyond the model's max_position_embeddings"):
        decode(model, ids, None, scheduler=editing, gen_length=256, block_length=8)
    with pytest.raises(ValueError, match="editing policy .* needs a block-causal model .* strategy='threshold'"):
        decode(tiny_llada(), torch.tensor([[5, 6, 7]]), None, scheduler=editing, gen_length=8, block_length=8)


@pytest.mark.parametrize("kwargs, match", [
    (dict(threshold=0), "threshold must be"), (dict(editing_threshold=1.5), "editing_threshold must be"),
    (dict(max_post_steps=-1), "max_post_steps must be"), (dict(num_inference_steps=0), "num_inference_steps must be"),
    (dict(minimal_topk=0), "minimal_topk must be"), (dict(block_length=0), "block_length must be"),
])
def test_editing_policy_settings_are_checked(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TokenEditingScheduler(**kwargs)
    assert SCHEDULERS["editing"] is TokenEditingScheduler
