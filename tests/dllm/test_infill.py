"""Infilling: mask tokens inside the prompt are decoded with the canvas (vispec.dllm.infill), as Dream's ``_sample`` and
LLaDA's ``generate()`` decode every masked position of the sequence."""

from __future__ import annotations

import pytest
import torch
from dllm_reference import llada_reference
from dream_infill_reference import dream_infill_sample
from dream_reference import dream_forward, random_dream_state, tiny_dream_config, write_dream_folder
from helpers import left_padded, tiny_text_pipeline, tiny_llada
from llada_infill_reference import llada_infill_reference

from vispec.dllm import (
    AdaptiveBlocks,
    ContiguousScheduler,
    DreamScheduler,
    LLaDAScheduler,
    ProphetRule,
    StopDecoding,
    ThresholdScheduler,
    decode,
)
from vispec.models.dream_checkpoint import load_dream_checkpoint

MASK, PAD, EOS, EOT = 60, 0, 1, 2
DREAM_MASK, DREAM_PAD = 60, 1


@pytest.fixture(scope="module")
def model():
    return tiny_llada()


@pytest.fixture(scope="module")
def dream_config():
    return tiny_dream_config()


@pytest.fixture(scope="module")
def dream_state(dream_config):
    return random_dream_state(dream_config)


@pytest.fixture(scope="module")
def dream(tmp_path_factory, dream_config, dream_state):
    return load_dream_checkpoint(write_dream_folder(tmp_path_factory.mktemp("dream") / "official", dream_state,
                                                   dream_config))


def with_masks(prompt: torch.Tensor, where, mask_id: int = MASK) -> torch.Tensor:
    out = prompt.clone()
    out[list(where)] = mask_id
    return out


def infill_prompts(mask_id: int = MASK) -> list[torch.Tensor]:
    """Prompts with masks in the middle, at the end, in a run, and none (the first token is never a mask: Dream)."""
    gen = torch.Generator().manual_seed(1)
    rows = [torch.randint(4, 60, (n,), generator=gen) for n in (7, 5, 9, 6)]
    return [with_masks(rows[0], [2], mask_id), with_masks(rows[1], [3, 4], mask_id),
            with_masks(rows[2], [1, 2, 3, 6], mask_id), rows[3]]


def whole(out, row: int = 0) -> torch.Tensor:
    return torch.cat([out.prompt_tokens[row], out.tokens[row]])


# ---------------------------------------------------------------------------- LLaDA's generate with prompt masks
@pytest.mark.parametrize("gen_length,block_length,steps", [(12, 12, 6), (12, 4, 6), (8, 4, 16)])
@pytest.mark.parametrize("cfg_scale", [0.0, 1.5])
def test_llada_quota_equals_the_reference_with_prompt_masks(model, gen_length, block_length, steps, cfg_scale):
    """Token for token at T = 0, prompt included; guidance keeps LLaDA's prompt_index (filled slots stay visible in
    the unconditional branch)."""
    for prompt in infill_prompts():
        expected = llada_infill_reference(model, prompt, steps=steps, gen_length=gen_length, block_length=block_length,
                                          mask_id=MASK, cfg_scale=cfg_scale)
        out = decode(model, prompt[None], scheduler=LLaDAScheduler(), steps=steps, gen_length=gen_length,
                     block_length=block_length, guidance_scale=cfg_scale + 1)
        assert torch.equal(whole(out), expected)
        assert not bool((whole(out) == MASK).any())


def test_llada_verbatim_leaves_as_many_masks_as_the_prompt_had(model):
    """Why vispec counts the prompt's masks in the first block's quota: LLaDA's code counts only the block's, so it
    ends with the prompt's number of masks still masked. Without prompt masks all three agree."""
    for prompt in infill_prompts():
        verbatim = llada_infill_reference(model, prompt, steps=8, gen_length=8, block_length=4, mask_id=MASK,
                                          count_prompt_masks=False)
        assert int((verbatim == MASK).sum()) == int((prompt == MASK).sum())
    plain = infill_prompts()[-1]
    out = decode(model, plain[None], scheduler=LLaDAScheduler(), steps=8, gen_length=8, block_length=4)
    verbatim = llada_infill_reference(model, plain, steps=8, gen_length=8, block_length=4, mask_id=MASK,
                                      count_prompt_masks=False)
    assert torch.equal(whole(out), verbatim)
    assert torch.equal(out.tokens[0], llada_reference(model, plain, steps=8, gen_length=8, block_length=4, mask_id=MASK))
    assert torch.equal(out.prompt_tokens[0], plain)


def test_prompt_masks_are_decided_in_the_first_block(model):
    prompt = infill_prompts()[2]
    slots = []

    def watch(progress):
        if progress.details["block"] == 0:
            slots.append(progress.details["transfer_index"].shape[1])

    out = decode(model, prompt[None], scheduler=LLaDAScheduler(), steps=6, gen_length=12, block_length=4,
                 callback=watch)
    assert set(slots) == {4}  # the callback's transfer_index stays the block's
    assert not bool((out.prompt_tokens == MASK).any())


# ---------------------------------------------------------------------------- Dream's _sample with prompt masks
@pytest.mark.parametrize("settings", [{}, {"top_p": 0.8, "top_k": 6}])
@pytest.mark.parametrize("alg", ["maskgit_plus", "topk_margin", "entropy"])
def test_dream_equals_dreams_sample_with_prompt_masks(dream, dream_config, dream_state, alg, settings):
    forward = lambda x, m4, idx: dream_forward(dream_state, dream_config, x, m4, idx)  # noqa: E731
    for prompt in infill_prompts(DREAM_MASK):
        out = decode(dream, prompt[None], scheduler=DreamScheduler(alg=alg, **settings), gen_length=12,
                     block_length=12, steps=5)
        ref = dream_infill_sample(forward, prompt[None], None, max_new_tokens=12, steps=5, mask_id=DREAM_MASK, alg=alg,
                                  never_propose=[DREAM_MASK], **settings)
        assert torch.equal(whole(out), ref[0]), (alg, settings)
        assert out.stats.nfe.tolist() == [5]


def test_dream_padded_batch_equals_dreams_sample_row_by_row(dream, dream_config, dream_state):
    forward = lambda x, m4, idx: dream_forward(dream_state, dream_config, x, m4, idx)  # noqa: E731
    rows = infill_prompts(DREAM_MASK)
    ids, mask = left_padded(rows, DREAM_PAD)
    out = decode(dream, ids, mask, scheduler=DreamScheduler(alg="entropy"), gen_length=10, block_length=10, steps=4)
    for i, row in enumerate(rows):
        alone = dream_infill_sample(forward, row[None], None, max_new_tokens=10, steps=4, mask_id=DREAM_MASK,
                                    alg="entropy", never_propose=[DREAM_MASK])
        pad = ids.shape[1] - len(row)
        assert torch.equal(whole(out, i)[pad:], alone[0]), i
        assert torch.equal(out.prompt_tokens[i, :pad], ids[i, :pad])  # padding untouched


def test_dream_refuses_a_mask_as_a_rows_first_real_token(dream):
    rows = [with_masks(torch.arange(10, 16), [0], DREAM_MASK), torch.arange(10, 18)]
    ids, mask = left_padded(rows, DREAM_PAD)
    with pytest.raises(ValueError, match=r"rows \[0\] start with the mask token .*shifted"):
        decode(dream, ids, mask, scheduler=DreamScheduler(), gen_length=8, block_length=8, steps=4)


# ---------------------------------------------------------------------------- batching, policies, edge cases
def seeded(count: int, seed: int = 7) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(seed + i) for i in range(count)]


@pytest.mark.parametrize("scheduler,settings", [
    (LLaDAScheduler, {"steps": 8}), (LLaDAScheduler, {"steps": 8, "temperature": 1.0}),
    (lambda: LLaDAScheduler("random"), {"steps": 8}), (lambda: ThresholdScheduler(0.5), {"temperature": 0.7}),
    (lambda: ContiguousScheduler(0.5), {}), (lambda: DreamScheduler(alg="entropy"), {"steps": 8, "temperature": 0.8}),
])
def test_a_padded_batch_equals_each_row_alone(model, scheduler, settings):
    """Each row keeps its own quota, noise keys (prompt slots keyed from the prompt's end) and NFE."""
    rows = infill_prompts()
    ids, mask = left_padded(rows, PAD)
    common = dict(gen_length=8, block_length=4, guidance_scale=1.5, **settings)
    out = decode(model, ids, mask, scheduler=scheduler(), generator=seeded(len(rows)), **common)
    for i, row in enumerate(rows):
        alone = decode(model, row[None], scheduler=scheduler(), generator=seeded(1, 7 + i), **common)
        pad = ids.shape[1] - len(row)
        assert torch.equal(out.prompt_tokens[i, pad:], alone.prompt_tokens[0]), i
        assert torch.equal(out.tokens[i], alone.tokens[0]), i
        assert out.stats.nfe[i] == alone.stats.nfe[0]
        assert not bool((whole(out, i) == MASK).any())


def test_a_prompt_of_masks_only_is_decoded_whole(model):
    out = decode(model, torch.full((1, 5), MASK), scheduler=ThresholdScheduler(0.9), gen_length=4, block_length=4)
    assert not bool((whole(out) == MASK).any()) and out.prompt_tokens.shape == (1, 5)


def test_adaptive_policy_fills_the_prompt_when_the_block_fills_first(model):
    """A row whose generated block is complete still steps until its prompt masks are decided."""
    prompt = infill_prompts()[2]
    out = decode(model, prompt[None], scheduler=ThresholdScheduler(0.01), gen_length=4, block_length=4)
    assert not bool((whole(out) == MASK).any())


def test_stopping_early_leaves_undecided_prompt_masks_masked(model):
    def stop(progress):
        raise StopDecoding

    prompt = infill_prompts()[2]
    out = decode(model, prompt[None], scheduler=LLaDAScheduler(), steps=8, gen_length=8, block_length=8,
                 callback=stop)
    assert out.labels["interrupted"] and int((out.prompt_tokens == MASK).sum()) <= 4
    assert torch.equal(out.prompt_tokens[0][prompt != MASK], prompt[prompt != MASK])


def test_padding_that_holds_the_mask_id_is_not_infilled(model):
    ids = torch.tensor([[MASK, MASK, 9, 10, 11]])
    mask = torch.tensor([[0, 0, 1, 1, 1]])
    out = decode(model, ids, mask, scheduler=LLaDAScheduler(), steps=4, gen_length=4, block_length=4)
    assert torch.equal(out.prompt_tokens, ids)


@pytest.mark.parametrize("options,name", [
    ({"cache": "prefix"}, "cache='prefix'"), ({"cache": "dual"}, "cache='dual'"), ({"cache": "dkv"}, "cache='dkv'"),
    ({"eotp": True}, "eotp"), ({"early_commit": ProphetRule()}, "early_commit"),
    ({"adaptive_block": AdaptiveBlocks(delimiter_ids=(7,))}, "adaptive_block"),
])
def test_rules_that_cannot_infill_are_refused_before_any_forward(model, options, name, monkeypatch):
    def no_forward(*args, **kwargs):
        raise AssertionError("a forward ran")

    monkeypatch.setattr(model, "forward", no_forward)
    prompt = infill_prompts()[0]
    with pytest.raises(ValueError, match=rf"rows \[0\] contain the mask token {MASK} \(infilling\).*{name}"):
        decode(model, prompt[None], scheduler=ThresholdScheduler(0.9), gen_length=8, block_length=4, **options)


# ---------------------------------------------------------------------------- the pipeline
def test_pipeline_returns_the_filled_prompt_and_its_text():
    pipe = tiny_text_pipeline()
    tokenizer = pipe.tokenizer
    prompt = f"sort the list {tokenizer.mask_token} two one"
    out = pipe(prompt=[prompt, "what is one plus two"], use_chat_template=False, strategy="llada",
               generator=seeded(2))
    ids, _ = pipe.prepare_input_ids(prompt=[prompt, "what is one plus two"], use_chat_template=False)
    slot = ids == tokenizer.mask_token_id
    assert int(slot.sum()) == 1 and out.prompt_sequences.shape == ids.shape
    assert torch.equal(out.prompt_sequences[~slot], ids[~slot]) and int(out.prompt_sequences[slot]) != tokenizer.mask_token_id
    assert tokenizer.mask_token not in out.full_texts[0]
    assert out.full_texts[0].startswith("sort the list") and "two one" in out.full_texts[0]
    assert out.full_texts[0].endswith(out.texts[0]) and out.full_texts[1].startswith("what is one plus two")
    sequences, texts = pipe(prompt=prompt, use_chat_template=False, strategy="llada", generator=seeded(1),
                            return_dict=False)
    assert torch.equal(sequences[0], out.sequences[0]) and texts[0] == out.texts[0]
