"""dKV-Cache-Decode (Ma et al., arXiv 2505.15781): ``decode(..., cache="dkv", cache_reload_steps=R)`` and the
model's partial forward ``LLaDAModelLM.forward_positions``.

Delayed caching: a token's K/V are cached from the step after the one that commits it; masked positions are
recomputed at every step; forward ``j`` of a block is a full refresh when ``j % R == 0``.
"""

from __future__ import annotations

import pytest
import torch
from helpers import left_padded

from vispec.dllm import LLaDAScheduler, decode, make_scheduler
from vispec.eval.bench.text_tasks import get_task, split_items
from vispec.models.llada import LLaDAModelLM

MASK, PAD, EOS, EOT = 60, 0, 1, 2
ATOL = 1e-5


def tiny(n_layers: int = 2, **overrides) -> LLaDAModelLM:
    """Random tiny LLaDA (GQA, padded embedding, large init so that logits vary a lot)."""
    torch.manual_seed(0)
    kwargs = dict(d_model=32, n_heads=4, n_kv_heads=2, n_layers=n_layers, mlp_hidden_size=48, vocab_size=61,
                  embedding_size=64, max_sequence_length=96, rope_theta=10000.0, mask_token_id=MASK, eos_token_id=EOS,
                  eot_token_id=EOT, pad_token_id=PAD, bos_token_id=3, init_std=0.3)
    return LLaDAModelLM(**{**kwargs, **overrides}).eval()


@pytest.fixture(scope="module")
def model64():
    return tiny().to(torch.float64)  # float64: padded and unpadded rows agree to ~1e-15, arg-max ties cannot flip


@pytest.fixture(scope="module")
def pipe(tiny_mdlm):
    return tiny_mdlm  # conftest.py


@pytest.fixture(scope="module")
def arithmetic(pipe):
    items = split_items("arithmetic", "test", 8)
    ids, mask = pipe.prepare_input_ids(prompt=[item.prompt for item in items])
    assert not mask.all()  # mixed prompt lengths: left padding in the batch
    return items, ids, mask


def prompts(lengths=(7, 4, 5), seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(4, 60, (n,), generator=gen) for n in lengths]


def _mdlm(pipe, ids, mask, cache, strategy="llada", **kwargs):
    scheduler = make_scheduler(strategy)
    kwargs = dict(gen_length=32, block_length=8, steps=32 if scheduler.fixed_steps else None, cache=cache,
                  eos_token_id=pipe.tokenizer.eos_token_id, **kwargs)
    return decode(pipe.model, ids, mask, scheduler=scheduler, **kwargs)


# ----------------------------------------------------------------------------------------------- model level
def _padded_batch():
    gen = torch.Generator().manual_seed(1)
    a, b = torch.randint(4, 61, (12,), generator=gen), torch.randint(4, 61, (8,), generator=gen)
    a[7:] = MASK
    b[5:] = MASK
    return left_padded([a, b], PAD)


@pytest.mark.parametrize("logits_shift", [False, True])
def test_forward_positions_equals_the_full_forward_when_the_cache_is_current(logits_shift):
    m = tiny(logits_shift=logits_shift)
    ids, mask = _padded_batch()  # row 1: 4 pads, then 8 tokens
    with torch.no_grad():
        full = m(ids, mask).logits
    cache = m.compute_kv_cache(ids, mask).kv_cache
    before = cache.clone()
    index = torch.tensor([[8, 7, 9, 3, 6], [10, 0, 9, 8, 2]])  # any order; row 0's entry 3 is padding
    real = torch.tensor([[True, True, True, False, True], [True, True, True, True, True]])
    out = m.forward_positions(ids.gather(1, index), index, cache, query_mask=real).logits
    assert out.shape == (2, 5, 64) and out.dtype == torch.float32
    want = full.gather(1, index[..., None].expand(-1, -1, 64))
    known = real.clone()
    if logits_shift:  # the logits at p come from p - 1: NaN where p - 1 is not a real query (6, 8 and 2)
        known = torch.tensor([[True, True, True, False, False], [True, True, True, False, False]])
        assert torch.isnan(out[real & ~known]).all()
    torch.testing.assert_close(out[known], want[known], atol=ATOL, rtol=0)
    for layer in range(2):  # the recomputed K/V equal the cached ones (current cache); the padding wrote nothing
        torch.testing.assert_close(cache.keys[layer], before.keys[layer], atol=ATOL, rtol=0)
        assert torch.equal(cache.keys[layer][0, :, 3], before.keys[layer][0, :, 3])
        assert torch.equal(cache.values[layer][0, :, 3], before.values[layer][0, :, 3])


def test_forward_positions_writes_the_new_tokens_and_ignores_padding_queries():
    """Commit tokens, then query the masked and just-committed positions against the old cache: the fresh K/V
    of the queried positions replace the cached ones (one layer: layer-0 K/V depend on a position's own token
    only, so the unqueried cached entries are exact and the logits equal the full forward's)."""
    m = tiny(n_layers=1)
    ids, mask = _padded_batch()
    cache = m.compute_kv_cache(ids, mask).kv_cache
    new = ids.clone()
    new[0, 7], new[1, 9] = 5, 6  # committed after the cached forward
    index = torch.tensor([[7, 8, 9, 10, 11, 0], [8, 9, 10, 11, 2, 3]])  # row 0: 5 real; row 1: 4 real
    real = torch.arange(6) < torch.tensor([[5], [4]])
    query_ids = new.gather(1, index)
    query_ids[~real] = 17  # padding queries: their ids and K/V are never written
    pad_before = [cache.keys[0][0, :, 0].clone(), cache.keys[0][1, :, 2:4].clone()]
    out = m.forward_positions(query_ids, index, cache, query_mask=real).logits
    with torch.no_grad():
        full = m(new, mask).logits
    torch.testing.assert_close(out[real], full.gather(1, index[..., None].expand(-1, -1, 64))[real], atol=ATOL, rtol=0)
    assert torch.equal(cache.input_ids, new)  # written where real, untouched at the padding queries' positions
    assert torch.equal(cache.keys[0][0, :, 0], pad_before[0]) and torch.equal(cache.keys[0][1, :, 2:4], pad_before[1])
    fresh = m.compute_kv_cache(new, mask).kv_cache
    torch.testing.assert_close(cache.keys[0], fresh.keys[0], atol=ATOL, rtol=0)
    torch.testing.assert_close(cache.values[0], fresh.values[0], atol=ATOL, rtol=0)


def test_forward_positions_bad_input():
    m = tiny()
    ids, mask = _padded_batch()
    cache = m.compute_kv_cache(ids, mask).kv_cache
    index = torch.tensor([[7, 8], [9, 10]])
    cases = [
        (dict(query_index=torch.tensor([[7, 7], [9, 10]])), "distinct positions in \\[0, 12\\) within each row \\(rows \\[0\\]"),
        (dict(query_index=torch.tensor([[7, 8], [9, 12]])), "distinct positions"),
        (dict(query_index=torch.tensor([[7, -1], [9, 10]])), "distinct positions"),
        (dict(query_index=index[:, :1]), "query_index must be an integer tensor of shape \\(2, 2\\)"),
        (dict(query_index=index.float()), "query_index must be an integer tensor"),
        (dict(query_mask=torch.ones(2, 3, dtype=torch.bool)), "query_mask must be None or a tensor of shape"),
        (dict(cache="cache"), "cache must be a LLaDAKVCache"),
    ]
    for change, words in cases:
        args = {"query_index": index, "cache": cache, "query_mask": None, **change}
        with pytest.raises(ValueError, match=words):
            m.forward_positions(ids.gather(1, index), args["query_index"], args["cache"], query_mask=args["query_mask"])
    assert torch.equal(cache.input_ids, ids)  # refused before any work: nothing written
    with pytest.raises(ValueError, match="query_ids must have 2 rows"):
        m.forward_positions(ids[:1, :2], index[:1], cache)


# ----------------------------------------------------------------------------------------------- decoding
@pytest.mark.parametrize("strategy", ["llada", "threshold"])
def test_reloading_every_step_equals_cache_none(pipe, arithmetic, strategy):
    _, ids, mask = arithmetic
    ref = _mdlm(pipe, ids, mask, "none", strategy)
    out = _mdlm(pipe, ids, mask, "dkv", strategy, cache_reload_steps=1)
    assert torch.equal(out.tokens, ref.tokens) and torch.equal(out.stats.nfe, ref.stats.nfe)
    assert out.labels["cache"] == "dkv"


@pytest.mark.parametrize("logits_shift", [False, True])
def test_one_layer_model_is_exact_at_any_reload_interval(logits_shift):
    """Layer-0 K/V depend on a position's own token (and RoPE position) only: with one layer, the delayed cache
    holds exact K/V for every unqueried position, so dKV gives the cache-free tokens whatever R. This checks the
    bookkeeping: which positions are recomputed, their RoPE positions, padding, ragged rows, guidance and, for
    Dream-style ``logits_shift`` models, the position before each recomputed one."""
    m = tiny(n_layers=1, logits_shift=logits_shift).to(torch.float64)
    ids, mask = left_padded(prompts(), PAD)
    gens = lambda: [torch.Generator().manual_seed(10 + i) for i in range(3)]
    for strategy, steps in (("llada", 16), ("threshold", None), ("entropy", None)):
        kwargs = dict(steps=steps, gen_length=16, block_length=8, temperature=0.8, guidance_scale=1.5, early_stop_eos=True)
        ref = decode(m, ids, mask, scheduler=make_scheduler(strategy), generator=gens(), **kwargs)
        for reload_steps in (2, 100):
            out = decode(m, ids, mask, scheduler=make_scheduler(strategy), generator=gens(), cache="dkv",
                         cache_reload_steps=reload_steps, **kwargs)
            assert torch.equal(out.tokens, ref.tokens), (strategy, reload_steps)
            assert torch.equal(out.stats.nfe, ref.stats.nfe)


class _Recorder:
    """Wraps a model's refresh and partial forwards and records what they compute."""

    def __init__(self, model):
        self.model, self.calls = model, []
        self.config = model.config
        self.compute_kv_cache_inner, self.forward_positions_inner = model.compute_kv_cache, model.forward_positions

    def compute_kv_cache(self, ids, attention_mask=None, **kwargs):
        self.calls.append(("refresh", ids.clone(), None))
        return self.compute_kv_cache_inner(ids, attention_mask, **kwargs)

    def forward_positions(self, query_ids, query_index, cache, *, query_mask=None):
        self.calls.append(("partial", query_index.clone(), query_mask.clone()))
        return self.forward_positions_inner(query_ids, query_index, cache, query_mask=query_mask)

    def __call__(self, *args, **kwargs):
        raise AssertionError("cache='dkv' never runs the plain forward")


def test_delayed_caching_recomputes_the_masked_and_the_just_committed_positions(model64):
    """One row (no padding queries): forward j of a block refreshes when j % R == 0; otherwise it recomputes
    exactly the masked generated positions and those committed by the forward before it."""
    rec = _Recorder(model64)
    prompt = prompts()[0][None]  # 7 tokens
    canvases = []
    out = decode(rec, prompt, scheduler=LLaDAScheduler(), steps=16, gen_length=16, block_length=8, cache="dkv",
                 cache_reload_steps=3, callback=lambda p: canvases.append(p.tokens[0].clone()))
    assert out.stats.nfe.tolist() == [16] and len(rec.calls) == 16
    assert [kind for kind, _, _ in rec.calls] == ["refresh", "partial", "partial"] * 2 + ["refresh", "partial"] + \
        ["refresh", "partial", "partial"] * 2 + ["refresh", "partial"]
    undecided = torch.full((16,), -1)
    before = [undecided] + canvases  # the canvas before each forward
    for j, (kind, index, real) in enumerate(rec.calls):
        if kind == "refresh":
            continue
        masked = set((before[j] == -1).nonzero().squeeze(1).tolist())
        just_committed = set(((before[j - 1] == -1) & (before[j] != -1)).nonzero().squeeze(1).tolist())
        assert real.all() and set((index[0] - 7).tolist()) == masked | just_committed, j
        assert len(just_committed) == 1  # LLaDA: one token per step here


@pytest.mark.parametrize("strategy,settings,steps", [("llada", {}, 16), ("llada", dict(remasking="random"), 16),
                                                     ("threshold", dict(threshold=0.5), None),
                                                     ("factor", dict(factor=2.0), None), ("entropy", dict(gamma=2.0), None),
                                                     ("contiguous", dict(threshold=0.5), None)])
def test_batch_with_padding_and_guidance_equals_one_by_one(model64, strategy, settings, steps):
    """Ragged recomputed sets (rows commit different numbers of tokens and finish blocks at different steps):
    a row's tokens and NFE are those it gets alone."""
    rows = prompts()
    ids, mask = left_padded(rows, PAD)
    gens = lambda: [torch.Generator().manual_seed(10 + i) for i in range(len(rows))]
    kwargs = dict(steps=steps, gen_length=16, block_length=8, cache="dkv", cache_reload_steps=3, temperature=0.8,
                  guidance_scale=1.5, early_stop_eos=True)
    batched = decode(model64, ids, mask, scheduler=make_scheduler(strategy, **settings), generator=gens(), **kwargs)
    assert not (batched.tokens == MASK).any()
    for i, row in enumerate(rows):
        alone = decode(model64, row[None], scheduler=make_scheduler(strategy, **settings), generator=[gens()[i]], **kwargs)
        assert torch.equal(batched.tokens[i], alone.tokens[0]), (strategy, i)
        assert batched.stats.nfe[i] == alone.stats.nfe[0]


def test_logits_shift_model_batch_equals_one_by_one():
    """Dream-style logits_shift: the position before each recomputed one is recomputed too; still batch independent."""
    m = tiny(logits_shift=True).to(torch.float64)
    rows = prompts()
    ids, mask = left_padded(rows, PAD)
    gens = lambda: [torch.Generator().manual_seed(10 + i) for i in range(len(rows))]
    kwargs = dict(gen_length=16, block_length=8, cache="dkv", temperature=0.8, guidance_scale=1.5, early_stop_eos=True)
    batched = decode(m, ids, mask, scheduler=make_scheduler("threshold", threshold=0.5), generator=gens(), **kwargs)
    assert not (batched.tokens == MASK).any()
    for i, row in enumerate(rows):
        alone = decode(m, row[None], scheduler=make_scheduler("threshold", threshold=0.5), generator=[gens()[i]], **kwargs)
        assert torch.equal(batched.tokens[i], alone.tokens[0]) and batched.stats.nfe[i] == alone.stats.nfe[0], i


def test_tiny_mdlm_batch_equals_one_by_one_with_guidance(pipe, arithmetic):
    _, ids, mask = arithmetic
    ids, mask = ids[:3], mask[:3]  # prompt lengths 39, 39, 33 ids
    gens = lambda: [torch.Generator().manual_seed(s) for s in (4, 5, 6)]
    kwargs = dict(temperature=0.7, guidance_scale=1.5, early_stop_eos=True)
    batched = _mdlm(pipe, ids, mask, "dkv", "threshold", generator=gens(), **kwargs)
    for i in range(3):
        real = mask[i].bool()
        alone = _mdlm(pipe, ids[i, real][None], None, "dkv", "threshold", generator=[gens()[i]], **kwargs)
        assert torch.equal(batched.tokens[i], alone.tokens[0]) and batched.stats.nfe[i] == alone.stats.nfe[0], i


def test_default_reload_interval_on_tiny_mdlm_arithmetic(pipe, arithmetic):
    items, ids, mask = arithmetic
    task = get_task("arithmetic")
    rec = _Recorder(pipe.model)
    results = {}
    for cache, model in (("none", pipe.model), ("dkv", rec)):
        out = decode(model, ids, mask, scheduler=LLaDAScheduler(), gen_length=32, block_length=8, steps=32, cache=cache,
                     eos_token_id=pipe.tokenizer.eos_token_id)  # cache_reload_steps: the default, 8
        assert not (out.tokens == pipe.mask_token_id).any() and out.stats.nfe.tolist() == [32] * len(items)
        texts = pipe.decode_texts(out.tokens)
        results[cache] = sum(task.score(t, item)["flexible_extract"] for t, item in zip(texts, items)) / len(items)
    kinds = [kind for kind, _, _ in rec.calls]
    assert kinds == (["refresh"] + ["partial"] * 7) * 4  # 8 steps per block: one refresh at each block's start
    assert results["none"] >= 0.5 and abs(results["dkv"] - results["none"]) <= 0.25, results


def test_a_callback_edit_of_a_cached_token_is_recomputed_at_the_next_forward(model64):
    """An edited committed token differs from the token its cached K/V came from: the next forward recomputes it
    (then caches it), besides the masked and just-committed positions."""
    rec = _Recorder(model64)
    canvases, edited = [], []

    def edit(progress):
        canvases.append(progress.tokens[0].clone())
        if progress.step == 2:  # the token committed by forward 0 has been cached since forward 1
            tokens = progress.tokens.clone()
            position = int(((canvases[0] != -1)).nonzero()[0, 0])
            tokens[0, position] = 5 if tokens[0, position] != 5 else 6
            edited.append(position)
            canvases[-1] = tokens[0].clone()
            return {"tokens": tokens}

    out = decode(rec, prompts()[0][None], scheduler=LLaDAScheduler(), steps=8, gen_length=8, block_length=8, cache="dkv",
                 cache_reload_steps=100, callback=edit)
    assert not (out.tokens == MASK).any() and out.tokens[0, edited[0]] in (5, 6)
    kind, index, _ = rec.calls[3]
    masked = set((canvases[2] == -1).nonzero().squeeze(1).tolist())
    just_committed = set(((canvases[1] == -1) & (canvases[2] != -1)).nonzero().squeeze(1).tolist())
    assert kind == "partial" and set((index[0] - 7).tolist()) == masked | just_committed | {edited[0]}
    assert edited[0] not in set((rec.calls[4][1][0] - 7).tolist())  # cached again from then on


def test_bad_input(model64):
    p = prompts()[0][None]
    base = dict(scheduler=LLaDAScheduler(), gen_length=8, block_length=8, steps=8)
    for bad in (0, -1, 2.0, True, None, "8"):
        with pytest.raises(ValueError, match="cache_reload_steps must be an integer >= 1"):
            decode(model64, p, cache="dkv", cache_reload_steps=bad, **base)
    with pytest.raises(ValueError, match="compile=True does not support cache='dkv'"):
        decode(model64, p, cache="dkv", compile=True, **base)

    class Plain(torch.nn.Module):
        config = model64.config

        def forward(self, input_ids, attention_mask=None):
            raise AssertionError("not reached")

        compute_kv_cache = forward

    with pytest.raises(ValueError, match="forward_positions"):
        decode(Plain(), p, cache="dkv", **base)
