"""AdaBlock's adaptive block length (arXiv 2509.26432; spec dllm.md §9): ``decode(..., adaptive_block=...)``,
and all three rules together (end-of-text prediction, Prophet, AdaBlock) with every policy and cache.

tiny-mdlm has no newline token; its end-of-turn and digit tokens serve as delimiters here. A plain
reference loop (batch 1, no cache) is the yardstick; in a left-padded batch the rows have different block
boundaries, and each row's tokens and NFE must be those it gets alone, under every cache.
"""

from __future__ import annotations

import pytest
import torch

from vispec.dllm import ThresholdScheduler, decode, make_scheduler
from vispec.dllm.blocks import AdaptiveBlocks, to_canvas, window_index, window_logits, window_tokens
from vispec.dllm.prophet import ProphetRule

PROMPTS = ["sort the numbers : 5 3 9 3 1", "reverse the letters : k d m a", "how many marbles does she have ?",
           "sort the numbers : 4 1"]
DELIMITERS = (4, 10, 12)  # tiny-mdlm: <|eot_id|>, "5", "3"


@pytest.fixture(scope="module")
def pipe(tiny_mdlm):
    return tiny_mdlm  # conftest.py


def test_block_end_on_constructed_predictions():
    inf = float("-inf")
    rule = AdaptiveBlocks(delimiter_ids=(9, 4), threshold=0.3)
    # canvas of 16; window = min(floor(0.25 * 16) = 4, cut - start)
    candidates = torch.tensor([
        [9, 7, 4, 7, 9, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7],  # delimiters at 0 (0.5), 2 (0.6), 4 (0.9, outside the window)
        [7, 9, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7],  # a delimiter below δ: the default block
        [-1, -1, -1, -1, -1, -1, 7, 9, 9, 7, 7, 7, 7, 7, 7, 7],  # start 6: ties at 7 and 8 -> the lowest
        [-1] * 12 + [7, 7, 7, 7],  # start 12, canvas cut at 14: the default block stops at the cut
        [-1, -1, -1, -1, -1, -1, -1, -1, -1, -1, 4, 7, 7, 7, 7, 7],  # start 10: at the window's first position
    ])
    confidence = torch.tensor([
        [.5, .1, .6, .1, .9] + [.1] * 11,
        [.1, .29] + [.1] * 14,
        [inf] * 6 + [.1, .7, .7] + [.1] * 7,
        [inf] * 12 + [.1] * 4,
        [inf] * 10 + [.3] + [.1] * 5,
    ], dtype=torch.float64)
    starts = torch.tensor([0, 0, 6, 12, 10])
    cut = torch.tensor([16, 16, 16, 14, 16])
    ends = rule.block_ends(starts, cut, gen_length=16, block_length=8, candidates=candidates, confidence=confidence)
    assert ends.tolist() == [3, 8, 8, 14, 11]
    narrow = AdaptiveBlocks(delimiter_ids=(9,), window_fraction=0.125)  # window 2: position 2 is out of reach
    assert narrow.block_ends(starts[:1], cut[:1], 16, 8, candidates[:1], confidence[:1]).tolist() == [1]
    strict = AdaptiveBlocks(delimiter_ids=(9, 4), threshold=0.95)
    assert strict.block_ends(starts, cut, 16, 8, candidates, confidence).tolist() == [8, 8, 14, 14, 16]


def test_window_helpers():
    starts, ends = torch.tensor([1, 4]), torch.tensor([3, 8])
    index, valid = window_index(starts, ends, 4)
    assert index.tolist() == [[1, 2, 3, 4], [4, 5, 6, 7]] and valid.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1]]
    canvas = torch.arange(10)[None].repeat(2, 1)
    assert window_tokens(canvas, index, valid, -1).tolist() == [[1, 2, -1, -1], [4, 5, 6, 7]]
    assert to_canvas(torch.ones(2, 4, dtype=torch.long), index, valid, 10, 0).tolist() == [
        [0, 1, 1, 0, 0, 0, 0, 0, 0, 0], [0, 0, 0, 0, 1, 1, 1, 1, 0, 0]]
    logits = torch.arange(2 * 5 * 3, dtype=torch.float32).view(2, 5, 3)  # covers generated positions [2, 7)
    got = window_logits(logits, 2, index, valid)
    assert got[0, 0].tolist() == [0, 0, 0] and got[0, 1].tolist() == logits[0, 0].tolist()  # 1: not computed
    assert got[1, 3].tolist() == [0, 0, 0] and got[1, 2].tolist() == logits[1, 4].tolist()  # 7: not computed


class _Stub(torch.nn.Module):
    """Fixed logits per generated position (``table [L, V]``)."""

    def __init__(self, table, prompt_len):
        super().__init__()
        self.table, self.prompt_len = table, prompt_len
        self.config = type("C", (), dict(mask_token_id=60, eos_token_id=1, eot_token_id=None, pad_token_id=0,
                                         vocab_size=64, max_sequence_length=None))()

    def forward(self, input_ids, attention_mask=None):
        logits = torch.zeros(*input_ids.shape, 64)
        logits[:, self.prompt_len:] = self.table[: input_ids.shape[1] - self.prompt_len]
        return type("O", (), {"logits": logits})()


def test_blocks_end_at_confident_delimiters():
    """Delimiter 9 predicted at 2 (confidence 0.6) and 5 (0.4): blocks [0, 3) and [3, 6); then none in the
    4-position window, so blocks of B = 4 and a last one cut by the canvas end."""
    table = torch.zeros(16, 64)
    table[:, 7] = 2.0
    table[2, 9], table[5, 9] = 4.645, 3.834  # softmax 0.60 and 0.40 against 7 (2.0) and 62 zeros
    blocks = []
    out = decode(_Stub(table, 2), torch.tensor([[5, 6]]), scheduler=ThresholdScheduler(0.9), gen_length=16,
                 block_length=4, adaptive_block=AdaptiveBlocks(delimiter_ids=(9,)),
                 callback=lambda p: blocks.append((int(p.details["block_start"][0]), int(p.details["block_end"][0]))))
    assert sorted(set(blocks)) == [(0, 3), (3, 6), (6, 10), (10, 14), (14, 16)]
    assert out.stats.extra["blocks"].tolist() == [5] and out.stats.nfe.tolist() == [16]
    assert out.tokens[0, [2, 5]].tolist() == [9, 9] and out.labels["adaptive_block"] is True


@torch.no_grad()
def adablock_reference(model, prompt, *, gen_length, block_length, delimiters, delta=0.3, fraction=0.25, threshold=0.9):
    """AdaBlock written plainly (one unpadded prompt, no cache, the threshold rule): every block starts with
    a full forward whose float64 candidates choose the block's end, and that forward is its first step.
    Returns ``(tokens, forwards, blocks)``."""
    mask, vocab = model.config.mask_token_id, model.config.vocab_size
    x = torch.cat([prompt, torch.full((gen_length,), mask, dtype=torch.long)])
    p0, generated, forwards, blocks = len(prompt), 0, 0, []

    def predict():
        logits = model(x[None]).logits[0].double()
        proposal = logits.clone()
        proposal[:, mask] = float("-inf")
        proposal[:, vocab:] = float("-inf")
        cand = proposal.argmax(dim=-1)
        return cand, torch.softmax(logits, dim=-1).gather(-1, cand[:, None]).squeeze(-1)

    while generated < gen_length:
        cand, conf = predict()
        forwards += 1
        start = p0 + generated
        window = min(int(fraction * gen_length), gen_length - generated)
        found = [j for j in range(start, start + window) if x[j] == mask and int(cand[j]) in delimiters]
        best = max(found, key=lambda j: (float(conf[j]), -j)) if found else None
        if best is not None and conf[best] >= delta:
            size = best - start + 1
        else:
            size = min(block_length, gen_length - generated)
        end = start + size
        blocks.append((generated, generated + size))
        while True:
            masked = [j for j in range(start, end) if x[j] == mask]
            chosen = {j for j in masked if conf[j] >= threshold} | {max(masked, key=lambda j: (float(conf[j]), -j))}
            for j in chosen:
                x[j] = cand[j]
            if not any(x[j] == mask for j in range(start, end)):
                break
            cand, conf = predict()
            forwards += 1
        generated += size
    return x[p0:], forwards, blocks


def test_batch_of_one_equals_the_plain_loop(pipe):
    varied = set()
    for text in PROMPTS:
        ids, _ = pipe.prepare_input_ids(prompt=[text])
        expected, forwards, blocks = adablock_reference(pipe.model, ids[0], gen_length=32, block_length=8,
                                                        delimiters=DELIMITERS)
        seen = []
        out = decode(pipe.model, ids, scheduler=ThresholdScheduler(0.9), gen_length=32, block_length=8,
                     adaptive_block=AdaptiveBlocks(delimiter_ids=DELIMITERS),
                     callback=lambda p: seen.append((int(p.details["block_start"][0]), int(p.details["block_end"][0]))))
        assert out.tokens[0].tolist() == expected.tolist(), text
        assert out.stats.nfe.tolist() == [forwards]
        assert sorted(set(seen)) == blocks and out.stats.extra["blocks"].tolist() == [len(blocks)]
        varied |= {end - start for start, end in blocks}
    assert len(varied) >= 4  # the delimiters do move the boundaries


@pytest.mark.parametrize("cache", ["none", "prefix", "dual", "dkv"])
def test_no_delimiter_gives_the_fixed_blocks(pipe, cache):
    """A delimiter that is never predicted leaves every block at B: the tokens and NFE of fixed blocks."""
    ids, mask = pipe.prepare_input_ids(prompt=PROMPTS)
    for strategy, steps in (("threshold", None), ("llada", 16)):
        kw = dict(gen_length=32, block_length=8, steps=steps, cache=cache)
        fixed = decode(pipe.model, ids, mask, scheduler=make_scheduler(strategy), **kw)
        ada = decode(pipe.model, ids, mask, scheduler=make_scheduler(strategy), **kw,
                     adaptive_block=AdaptiveBlocks(delimiter_ids=(110,)))
        assert torch.equal(ada.tokens, fixed.tokens) and torch.equal(ada.stats.nfe, fixed.stats.nfe), strategy
        assert ada.stats.extra["blocks"].tolist() == [4] * 4


def _gens(n, base=40):
    return [torch.Generator().manual_seed(base + i) for i in range(n)]


@pytest.mark.parametrize("cache", ["none", "prefix", "dual", "dkv"])
@pytest.mark.parametrize("strategy,steps,temperature", [("llada", 32, 0.0), ("threshold", None, 0.8)])
def test_batch_with_padding_equals_one_by_one(pipe, tiny_mdlm64, cache, strategy, steps, temperature):
    """Rows get different block boundaries; under the prefix / dual cache each block group forwards its own
    span against its own copy of the cache."""
    ids, mask = pipe.prepare_input_ids(prompt=PROMPTS)
    kw = dict(gen_length=32, block_length=8, steps=steps, cache=cache, temperature=temperature,
              adaptive_block=AdaptiveBlocks(delimiter_ids=DELIMITERS))
    bounds = []
    batched = decode(tiny_mdlm64, ids, mask, scheduler=make_scheduler(strategy), generator=_gens(4),
                     callback=lambda p: bounds.append(p.details["block_end"].tolist()), **kw)
    assert any(len(set(b)) > 1 for b in bounds)  # rows in one forward with different blocks
    for i, text in enumerate(PROMPTS):
        alone_ids, _ = pipe.prepare_input_ids(prompt=[text])
        alone = decode(tiny_mdlm64, alone_ids, scheduler=make_scheduler(strategy), generator=[_gens(4)[i]], **kw)
        assert torch.equal(batched.tokens[i], alone.tokens[0]), (cache, strategy, i)
        assert batched.stats.nfe[i] == alone.stats.nfe[0]
        assert batched.stats.extra["blocks"][i] == alone.stats.extra["blocks"][0]


@pytest.mark.parametrize("cache", ["prefix", "dual"])
def test_threshold_with_caches_is_exact_when_each_block_takes_one_step(pipe, cache):
    """Each block starts with a full (cache-refreshing) forward: a policy that completes every block in its first
    step gives the cache-free tokens and NFE exactly, with adaptive blocks too."""
    ids, mask = pipe.prepare_input_ids(prompt=PROMPTS)
    kw = dict(gen_length=32, block_length=8, adaptive_block=AdaptiveBlocks(delimiter_ids=DELIMITERS))
    ref = decode(pipe.model, ids, mask, scheduler=ThresholdScheduler(1e-12), **kw)
    out = decode(pipe.model, ids, mask, scheduler=ThresholdScheduler(1e-12), cache=cache, **kw)
    assert torch.equal(out.tokens, ref.tokens) and torch.equal(out.stats.nfe, ref.stats.nfe)
    assert torch.equal(out.stats.nfe, out.stats.extra["blocks"])  # one forward per block


# (strategy, settings, steps, temperature, guidance_scale)
SETTINGS = [("llada", dict(), 32, 0.0, 1.0), ("threshold", dict(threshold=0.7), None, 0.8, 1.0),
            ("factor", dict(factor=2.0), None, 0.8, 1.5), ("entropy", dict(gamma=1.0), None, 0.0, 1.5),
            ("contiguous", dict(threshold=0.7), None, 0.8, 1.0)]


@pytest.mark.parametrize("cache", ["none", "prefix", "dual", "dkv"])
@pytest.mark.parametrize("strategy,settings,steps,temperature,guidance", SETTINGS)
def test_all_rules_together_batch_equals_one_by_one(pipe, tiny_mdlm64, cache, strategy, settings, steps, temperature,
                                                    guidance):
    """End-of-text prediction, Prophet and AdaBlock at once, with every policy and cache (guided too): each row
    of a left-padded batch gets its tokens and NFE alone."""
    ids, mask = pipe.prepare_input_ids(prompt=PROMPTS)
    kw = dict(gen_length=32, block_length=8, steps=steps, cache=cache, temperature=temperature, eotp=True,
              guidance_scale=guidance,
              early_commit=ProphetRule(thresholds=(20.0, 15.0, 10.0)),
              adaptive_block=AdaptiveBlocks(delimiter_ids=DELIMITERS))
    batched = decode(tiny_mdlm64, ids, mask, scheduler=make_scheduler(strategy, **settings), generator=_gens(4), **kw)
    assert set(batched.labels) == {"scheduler", "cache", "eotp", "early_commit", "adaptive_block"}
    assert not (batched.tokens == pipe.model.config.mask_token_id).any()
    for i, text in enumerate(PROMPTS):
        alone_ids, _ = pipe.prepare_input_ids(prompt=[text])
        alone = decode(tiny_mdlm64, alone_ids, scheduler=make_scheduler(strategy, **settings), generator=[_gens(4)[i]],
                       **kw)
        assert torch.equal(batched.tokens[i], alone.tokens[0]), (cache, strategy, i)
        assert batched.stats.nfe[i] == alone.stats.nfe[0]
        for name in ("canvas_length", "early_committed", "blocks"):
            assert batched.stats.extra[name][i] == alone.stats.extra[name][0], name


def test_bad_input(pipe):
    cases = [
        (dict(delimiter_ids=()), "delimiter_ids must be a non-empty tuple"),
        (dict(delimiter_ids=None), "delimiter_ids must be a non-empty tuple"),
        (dict(delimiter_ids=(4, -1)), "delimiter_ids must be an integer >= 0"),
        (dict(delimiter_ids=(True,)), "delimiter_ids must be an integer >= 0"),
        (dict(delimiter_ids=(4,), threshold=1.5), r"threshold must be a finite number in \[0, 1\]"),
        (dict(delimiter_ids=(4,), window_fraction=0.0), r"window_fraction must be a finite number in \(0, 1\]"),
        (dict(delimiter_ids=(4,), window_fraction=1.2), r"window_fraction must be a finite number in \(0, 1\]"),
    ]
    for kwargs, words in cases:
        with pytest.raises(ValueError, match=words):
            AdaptiveBlocks(**kwargs)
    assert AdaptiveBlocks(delimiter_ids=4).delimiter_ids == (4,)
    ids, _ = pipe.prepare_input_ids(prompt=PROMPTS[:1])
    kw = dict(scheduler=ThresholdScheduler(), gen_length=8, block_length=8)
    with pytest.raises(ValueError, match="adaptive_block must be None or an AdaptiveBlocks, got tuple"):
        decode(pipe.model, ids, adaptive_block=(4,), **kw)
    with pytest.raises(ValueError, match=r"delimiter_ids must be token ids in \[0, 111\) other than the mask id 5, "
                                         r"got 5"):
        decode(pipe.model, ids, adaptive_block=AdaptiveBlocks(delimiter_ids=(4, 5)), **kw)
    with pytest.raises(ValueError, match="got 111"):
        decode(pipe.model, ids, adaptive_block=AdaptiveBlocks(delimiter_ids=(111,)), **kw)
    with pytest.raises(ValueError, match="compile=True needs static shapes"):
        decode(pipe.model, ids, adaptive_block=AdaptiveBlocks(delimiter_ids=(4,)), compile=True, **kw)
    learned = ThresholdScheduler()
    learned.strategy = "learn2pd"  # stands for the Learn2PD policy, whose filter reads exactly block_length inputs
    with pytest.raises(ValueError, match="adaptive_block cannot run with the learn2pd policy"):
        decode(pipe.model, ids, adaptive_block=AdaptiveBlocks(delimiter_ids=(4,)), scheduler=learned,
               gen_length=8, block_length=8)
