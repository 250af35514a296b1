"""vispec's policies inside diffusers' own dLLM pipelines (vispec.dllm.diffusers_scheduler): LLaDA2Pipeline and
DiffusionGemmaPipeline, unchanged, with VispecPolicyScheduler give vispec's own pipeline's tokens."""

from __future__ import annotations

import math
import warnings
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from vispec.dllm import DiffusionGemmaRule, ParallelDecodeFilter, SelfSpeculation, SharedGenerator, make_scheduler
from vispec.dllm.diffusers_scheduler import VispecPolicyScheduler
from vispec.pipelines import MaskedDiffusionLMPipeline

pytest.importorskip("transformers")
from diffusers import BlockRefinementScheduler, DiffusionGemmaPipeline, LLaDA2Pipeline  # noqa: E402
from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion  # noqa: E402

from vispec.models.diffusion_gemma import DiffusionGemmaLM  # noqa: E402

VOCAB, MASK_ID, BLOCK = 40, 39, 4
IDS = torch.tensor([[5, 6, 7, 8], [0, 0, 9, 10], [3, 4, 5, 6]])  # one prompt block (LLaDA2's blocks are absolute)
MASK = torch.tensor([[1] * 4, [0, 0, 1, 1], [1] * 4])


class TinyCausalLM(nn.Module):
    """A one-layer causal transformer in float64 with LLaDA2Pipeline's calling convention (``model(x, attention_mask=,
    position_ids=).logits``). Causal attention makes a position's logits independent of the positions after it, so
    LLaDA2Pipeline's forwards (the sequence up to the current block) and vispec's (the whole canvas) agree."""

    def __init__(self, hidden: int = 32, max_len: int = 64):
        super().__init__()
        self.config = SimpleNamespace(mask_token_id=MASK_ID, vocab_size=VOCAB)
        self.embed, self.pos = nn.Embedding(VOCAB, hidden), nn.Embedding(max_len, hidden)
        self.qkv, self.out, self.head = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden), nn.Linear(hidden, VOCAB)

    @property
    def device(self) -> torch.device:
        return self.head.weight.device

    def forward(self, input_ids, attention_mask=None, position_ids=None, **kwargs):
        n = input_ids.shape[1]
        h = self.embed(input_ids) + self.pos(torch.arange(n, device=input_ids.device))
        q, k, v = self.qkv(h).chunk(3, dim=-1)
        allowed = torch.ones(n, n, dtype=torch.bool, device=h.device).tril()[None]
        if attention_mask is not None:
            allowed = allowed & attention_mask.bool()[:, None, :]
        allowed = allowed | torch.eye(n, dtype=torch.bool, device=h.device)[None]  # padded queries see themselves
        scores = (q @ k.transpose(1, 2) / math.sqrt(q.shape[-1])).masked_fill(~allowed, float("-inf"))
        return SimpleNamespace(logits=3 * self.head(h + self.out(scores.softmax(-1) @ v)))


@pytest.fixture(scope="module")
def causal():
    torch.manual_seed(0)
    return TinyCausalLM().double().eval()


def vispec_pipe(model, policy):
    pipe = MaskedDiffusionLMPipeline(model=model, tokenizer=None, scheduler=policy)
    pipe.set_progress_bar_config(disable=True)
    return pipe


POLICIES = [("threshold", {"threshold": 0.5}), ("factor", {"factor": 2.0}), ("entropy", {"gamma": 0.5}),
            ("contiguous", {"threshold": 0.3}), ("llada", {}), ("learn2pd", {"threshold": 0.5})]


@pytest.mark.parametrize("strategy, settings", POLICIES)
def test_policy_inside_llada2_pipeline_equals_vispec(causal, strategy, settings):
    """LLaDA2Pipeline (greedy, batch 3 with a padded prompt, three blocks) driven by a vispec policy returns the tokens
    of vispec's own pipeline with that policy; the call's threshold is the policy's τ, as BlockRefinementScheduler's."""
    policy = make_scheduler(strategy, **settings)
    if strategy == "learn2pd":
        torch.manual_seed(1)
        policy.filter = ParallelDecodeFilter(block_length=BLOCK, hidden_size=8)
    scheduler = VispecPolicyScheduler.from_policy(policy, block_length=BLOCK)
    pipe = LLaDA2Pipeline(model=causal, scheduler=scheduler, tokenizer=None)
    pipe.set_progress_bar_config(disable=True)
    steps = {"num_inference_steps": BLOCK}
    reference = pipe(input_ids=IDS, attention_mask=MASK, gen_length=3 * BLOCK, mask_token_id=MASK_ID,
                     output_type="seq", threshold=settings.get("threshold", 0.7), **steps)
    out = vispec_pipe(causal, policy)(input_ids=IDS, attention_mask=MASK, gen_length=3 * BLOCK, block_length=BLOCK,
                                      early_stop_eos=False, **(steps if policy.fixed_steps else {}))
    assert torch.equal(reference.sequences, out.sequences)
    if strategy == "threshold":  # the pipeline's threshold= reaches the policy
        lower = pipe(input_ids=IDS, attention_mask=MASK, gen_length=3 * BLOCK, mask_token_id=MASK_ID, threshold=0.2,
                     output_type="seq", **steps)
        assert torch.equal(lower.sequences, vispec_pipe(causal, policy)(
            input_ids=IDS, attention_mask=MASK, gen_length=3 * BLOCK, block_length=BLOCK, early_stop_eos=False,
            threshold=0.2).sequences)


def tiny_diffusion_gemma() -> DiffusionGemmaForBlockDiffusion:
    torch.manual_seed(0)
    text = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, head_dim=16, global_head_dim=16, num_global_key_value_heads=1, sliding_window=8,
                max_position_embeddings=256, layer_types=["sliding_attention", "full_attention"], num_experts=4,
                top_k_experts=2, moe_intermediate_size=32)
    vision = dict(model_type="gemma4_vision", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=2, head_dim=8, position_embedding_size=64, patch_size=4)
    return DiffusionGemmaForBlockDiffusion(DiffusionGemmaConfig(text_config=text, vision_config=vision,
                                                                canvas_length=8)).eval()


class PromptTable:
    """A processor double for DiffusionGemmaPipeline: any prompt list gives the fixed, left-padded ids."""

    eos_token_id = None

    def apply_chat_template(self, messages, **kwargs):
        return {"input_ids": torch.tensor([[5, 6, 7, 8, 9, 11], [0, 0, 0, 9, 10, 12], [3, 4, 5, 6, 7, 8]]),
                "attention_mask": torch.tensor([[1] * 6, [0, 0, 0, 1, 1, 1], [1] * 6])}

    def batch_decode(self, sequences, skip_special_tokens=True):
        return [str(row.tolist()) for row in sequences]


@pytest.mark.parametrize("policy", [make_scheduler("threshold", threshold=0.5), make_scheduler("llada"),
                                    DiffusionGemmaRule(max_denoising_steps=8)], ids=["threshold", "llada", "gemma"])
def test_policy_inside_diffusion_gemma_pipeline_equals_vispec(policy):
    """DiffusionGemmaPipeline (uniform corruption, batch 3 with padding, two canvases, its stop rule off) driven by a
    vispec policy returns vispec's own pipeline's tokens with that policy and the same generator (SharedGenerator:
    the initial canvas and the renoising drawn batch-wide, as the pipeline does)."""
    lm = DiffusionGemmaLM(tiny_diffusion_gemma())
    pipe = DiffusionGemmaPipeline(model=lm, scheduler=VispecPolicyScheduler.from_policy(policy), processor=PromptTable())
    pipe.set_progress_bar_config(disable=True)
    prompts = PromptTable().apply_chat_template(None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.filterwarnings("ignore", message=".*torch.jit.script_method")
        reference = pipe(prompt=["a", "b", "c"], gen_length=16, num_inference_steps=8, confidence_threshold=None,
                         generator=torch.Generator().manual_seed(4), output_type="seq")
        out = vispec_pipe(lm, policy)(input_ids=prompts["input_ids"], attention_mask=prompts["attention_mask"],
                                      gen_length=16, block_length=8, cache="prefix", early_stop_eos=False,
                                      generator=SharedGenerator(torch.Generator().manual_seed(4)),
                                      **({"num_inference_steps": 8} if policy.strategy == "llada" else {}))
    assert torch.equal(reference.sequences, out.sequences)


def test_loop_control_matches_block_refinement():
    """check_eos_finished is BlockRefinementScheduler's rule (batched) on random cases, prompt EOS and undecided
    positions included; check_block_should_continue stops at the budget only for fixed-step policies."""
    generator = torch.Generator().manual_seed(0)
    for _ in range(40):
        cur_x = torch.randint(0, 6, (4, 10), generator=generator)  # 0: mask, 1: EOS
        sampled = torch.randint(0, 6, (4, 4), generator=generator)
        transfer = torch.rand(4, 4, generator=generator) < 0.5
        finished = torch.rand(4, generator=generator) < 0.3
        expected = BlockRefinementScheduler.check_eos_finished(cur_x, sampled, transfer, finished.clone(), 1, 0, 3)
        assert torch.equal(VispecPolicyScheduler.check_eos_finished(cur_x, sampled, transfer, finished, 1, 0, 3),
                           expected)
    none = torch.zeros(2, dtype=torch.bool)
    for strategy, at_budget in (("threshold", True), ("llada", False)):
        scheduler = VispecPolicyScheduler(strategy=strategy, block_length=BLOCK)
        scheduler.set_timesteps(BLOCK, block_length=BLOCK)
        assert scheduler.check_block_should_continue(BLOCK, True, False, none, 0, 16, none) is at_budget
        assert not scheduler.check_block_should_continue(1, False, True, torch.zeros(2, 4, dtype=torch.bool), 1, 16, none)
        assert not scheduler.check_block_should_continue(1, True, False, none, 0, 16, torch.ones(2, dtype=torch.bool))


def test_config_round_trip_and_refusals(tmp_path):
    """The scheduler saves and loads like diffusers' (strategy, policy settings, block length); what has no equivalent
    is refused by name."""
    scheduler = VispecPolicyScheduler(strategy="entropy", policy_config={"gamma": 0.3}, block_length=16)
    scheduler.save_config(tmp_path)
    loaded = VispecPolicyScheduler.from_pretrained(tmp_path)
    assert loaded.policy.config.gamma == 0.3 and loaded.config.block_length == 16
    with pytest.raises(ValueError, match="self-speculative"):
        VispecPolicyScheduler.from_policy(SelfSpeculation(4))
    with pytest.raises(ValueError, match="strategy must be one of"):
        VispecPolicyScheduler(strategy="block_refinement")
    with pytest.raises(ValueError, match=r"unknown setting\(s\) \['bogus'\] for strategy 'threshold'"):  # 47 item 17
        VispecPolicyScheduler(policy_config={"bogus": 1})
    scheduler.set_timesteps(4, block_length=4)
    logits, sample = torch.zeros(1, 4, VOCAB), torch.full((1, 4), MASK_ID)
    with pytest.raises(ValueError, match="top_k"):
        scheduler.step(logits, 0, sample, mask_token_id=MASK_ID, top_k=5)
    threshold = VispecPolicyScheduler(strategy="threshold")
    threshold.set_timesteps(4, block_length=4)
    with pytest.raises(ValueError, match="threshold"):
        threshold.step(logits, 0, sample, mask_token_id=MASK_ID, threshold=1.5)


@pytest.fixture(scope="module")
def tiny_llada2():
    pipe = MaskedDiffusionLMPipeline.from_pretrained("vispec/tiny-llada2")  # embedded: offline
    pipe.set_progress_bar_config(disable=True)
    return pipe


def test_llada2_pipeline_refuses_a_block_length_the_model_does_not_attend_over(tiny_llada2):
    """Issue 47 item 27: tiny-llada2 attends block-causally over blocks of 32 under LLaDA2Pipeline's 2-D mask. Blocks of
    16 (the scheduler's default or the call's) silently gave other tokens than vispec's pipeline; now set_timesteps
    refuses them before the first forward, naming block_length and both values. Blocks of 32 give vispec's tokens
    (diffusers leaves mask ids after an early-stopping EOS where vispec writes EOS)."""
    model, tokenizer = tiny_llada2.model, tiny_llada2.tokenizer
    prompt = tiny_llada2.prepare_input_ids(prompt=["what is 12 + 7 ?"])[0]
    forwards = []
    hook = model.register_forward_pre_hook(lambda module, args: forwards.append(1))
    try:
        for scheduler_length, call_length in ((16, None), (32, 16)):
            pipe = LLaDA2Pipeline(model=model, scheduler=VispecPolicyScheduler(block_length=scheduler_length), tokenizer=tokenizer)
            pipe.set_progress_bar_config(disable=True)
            with pytest.raises(ValueError, match=r"block_length=16 \(the pipeline's blocks\) differs from the model's "
                                                 r"block_length=32"):
                pipe(input_ids=prompt, gen_length=32, block_length=call_length, output_type="seq")
        assert not forwards, "the mismatch must be refused before any denoising step"
        pipe = LLaDA2Pipeline(model=model, scheduler=VispecPolicyScheduler(block_length=16), tokenizer=tokenizer)
        pipe.set_progress_bar_config(disable=True)
        theirs = pipe(input_ids=prompt, gen_length=64, block_length=32, threshold=0.7, output_type="seq").sequences
    finally:
        hook.remove()
    ours = tiny_llada2(input_ids=prompt, gen_length=64, block_length=32, strategy="threshold", threshold=0.7).sequences
    assert torch.equal(torch.where(theirs == tokenizer.mask_token_id, tokenizer.eos_token_id, theirs), ours)
    with pytest.raises(ValueError, match="block_length=16 .* block_length=32"):  # the check, called directly
        VispecPolicyScheduler().check_model(model, 16)


@pytest.mark.parametrize("strategy", ["editing", "gemma"])
def test_llada2_pipeline_refuses_what_vispecs_pipeline_refuses_on_a_bidirectional_model(strategy):
    """Issue 47 item 27: on tiny-mdlm (bidirectional) vispec's pipeline refuses the editing policy; inside LLaDA2Pipeline
    the scheduler now applies the same check (vispec.dllm.checks.check_policy_fits_model), with the same message, before
    any forward. DiffusionGemma's rule runs in vispec's pipeline on this model, and so it does inside LLaDA2Pipeline."""
    mdlm = MaskedDiffusionLMPipeline.from_pretrained("vispec/tiny-mdlm")
    mdlm.set_progress_bar_config(disable=True)
    ids, mask = mdlm.prepare_input_ids(prompt=["sort the numbers : 5 3 9 3 1"])
    pipe = LLaDA2Pipeline(model=mdlm.model, scheduler=VispecPolicyScheduler(strategy=strategy, block_length=32),
                          tokenizer=mdlm.tokenizer)
    pipe.set_progress_bar_config(disable=True)
    outcomes = []
    for run in (lambda: mdlm(input_ids=ids, attention_mask=mask, gen_length=32, block_length=32, strategy=strategy),
                lambda: pipe(input_ids=ids, attention_mask=mask, gen_length=32, output_type="seq")):
        try:
            run()
            outcomes.append(None)
        except ValueError as error:
            outcomes.append(str(error))
    assert outcomes[0] == outcomes[1]
    assert (outcomes[0] is not None) == (strategy == "editing")
    if strategy == "editing":
        assert "needs a block-causal model" in outcomes[1]
