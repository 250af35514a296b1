"""The Triton kernel of recursive rejection sampling (:mod:`vispec.kernels.multi_verify_triton`) against the reference.

Kernels run in Triton's interpreter on CPU (``conftest.py`` sets ``TRITON_INTERPRET=1``); the compile check for
``GPUTarget("cuda", 90, 32)`` runs in a subprocess with the interpreter off.

Equality is bitwise: ``(accepted_rank, token)`` of the kernel equal those of :func:`rrs_reference` on every row.

* Injected noise (the launcher reads the very tensors :func:`rrs_noise` gives): equal in every case, by
  construction of the kernel (same float64 operations on the same values, sums in :func:`pairwise_sum`'s order).
  Random ``p``/``q``/candidates drawn without replacement with ``-1`` padding, ``K`` = 0 .. 4, vocabularies that
  are not a multiple of the tile, several tiles, one-hot candidates, rows whose draft has all its mass on a
  rejected candidate, rows that reject into a residual with no mass, race ties; the tile width and the rows'
  dtype and strides do not matter.
* Keyed noise generated in the kernel (:func:`rrs` with ``backend="triton"`` against ``backend="reference"``):
  equal on these cases too (ranks 4 and 5 use Philox block ``c0 = 1``). The one thing that could differ is the
  last bit of float32 ``log`` in the race's exponentials (numpy's in the interpreter, torch's in the reference),
  which matters only for race keys that agree to ~1e-7 (none here).
* The dispatch: ``backend="reference"`` is the explicit composition ``rrs_reference(p, without_replacement(q,
  candidates), candidates, *rrs_noise(...))``; every bad argument raises a ``ValueError`` naming it, on both
  backends.

The interpreter re-patches Triton on every nested jit call and runs Philox op by op, so the keyed cases are few
rows; the larger keyed comparison is marked ``slow``.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from vispec.kernels import race  # noqa: E402
from vispec.kernels.multi_verify import pairwise_sum, rrs, rrs_noise, rrs_reference, without_replacement  # noqa: E402
from vispec.kernels.multi_verify_triton import launch_rrs  # noqa: E402
from vispec.kernels.philox import Stream  # noqa: E402


def _case(rows: int, vocab: int, ranks: int, seed: int, *, dtype=torch.float32, one_hot: bool = False):
    """Random ``p`` (some zeros), ``q`` (some zeros) and candidates drawn from ``q`` in order without replacement
    (Gumbel-top-k with the drafter's keyed noise; ``one_hot``: drawn from ``p`` instead, so that one-hot
    candidates are accepted now and then), a random number of them per row (``-1`` padding), and keys."""
    gen = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(rows, vocab, generator=gen, dtype=torch.float64) * 2, -1)
    p[torch.rand(rows, vocab, generator=gen) < 0.2] = 0.0
    p[:, 0] += 1e-3  # every row keeps some mass
    q = torch.softmax(torch.randn(rows, vocab, generator=gen, dtype=torch.float64) * 2, -1) * 3.0  # unnormalised
    q[torch.rand(rows, vocab, generator=gen) < 0.3] = 0.0
    q[:, 1] += 1e-2
    seeds = torch.randint(-(2**63), 2**63 - 1, (rows,), generator=gen)
    positions = torch.randint(0, 2**20, (rows,), generator=gen)
    draws = torch.randint(0, 50, (rows,), generator=gen)
    keys = (p if one_hot else q) / race.keyed_exponentials(seeds, positions, int(Stream.DRAFT), draws, vocab)
    top = keys.topk(ranks, dim=-1)
    candidates = torch.where(top.values > 0, top.indices, torch.full_like(top.indices, -1))
    counts = torch.randint(0, ranks + 1, (rows,), generator=gen)
    counts[: min(rows, 2)] = ranks  # the first rows use every rank
    candidates[torch.arange(ranks)[None, :] >= counts[:, None]] = -1
    if rows > 2:  # a draft with all its mass on its first candidate, which p does not have: rejected for sure
        x = int(p[2].argmin())
        p[2, x] = 0.0
        q[2] = 0.0
        q[2, x] = 1.0
        candidates[2] = -1
        candidates[2, 0] = x
    return p.to(dtype), q.to(dtype), candidates, seeds, positions, draws


def _reference(p, q, candidates, u, e):
    return rrs_reference(p, None if q is None else without_replacement(q, candidates), candidates, u, e)


def _assert_equal(got, want):
    assert got[0].dtype == got[1].dtype == torch.int64
    assert torch.equal(got[0], want[0]), (got[0], want[0])
    assert torch.equal(got[1], want[1]), (got[1], want[1])


# ---- the summation order -------------------------------------------------------------------------------------


def test_pairwise_sum_is_the_padded_tree():
    x = torch.tensor([[1e16, 1.0, -1e16, 1.0, 3.0, 0.5, 0.25]], dtype=torch.float64)
    a, b, c, d, e, f, g = x[0].tolist()
    assert pairwise_sum(x).item() == ((a + b) + (c + d)) + ((e + f) + (g + 0.0))
    for vocab in (1, 2, 3, 5, 16, 37, 100):
        y = torch.rand(4, vocab, dtype=torch.float64, generator=torch.Generator().manual_seed(vocab))
        padded = torch.cat([y, torch.zeros(4, 128 - vocab, dtype=torch.float64)], -1)
        assert torch.equal(pairwise_sum(y), pairwise_sum(padded))  # the padding length does not matter
        torch.testing.assert_close(pairwise_sum(y), y.sum(-1), rtol=1e-15, atol=0)
    assert pairwise_sum(torch.zeros(3, 0, dtype=torch.float64)).shape == (3,)


# ---- injected noise: bitwise in every case ---------------------------------------------------------------------


@pytest.mark.parametrize("one_hot", [False, True], ids=["without-replacement", "one-hot"])
@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
def test_kernel_equals_reference_with_the_same_noise(ranks, one_hot):
    rows, vocab = 6, 37  # 2 tiles of 32: the vocabulary is not a multiple of the tile
    p, q, candidates, seeds, positions, draws = _case(rows, vocab, ranks, seed=ranks + 10 * one_hot, one_hot=one_hot)
    q = None if one_hot else q
    u, e = rrs_noise(seeds, positions, ranks, vocab, draws)
    u[1::2] = 1 - 2**-24  # odd rows reject wherever the threshold is below 1: residual updates, the race
    want = _reference(p, q, candidates, u, e)
    assert int((want[0] < 0).sum()) >= rows // 2
    _assert_equal(launch_rrs(p, q, candidates, uniforms=u, exponentials=e, block=32), want)


def test_tile_width_and_dtypes_do_not_change_the_result():
    rows, vocab, ranks = 4, 37, 3
    p, q, candidates, seeds, positions, draws = _case(rows, vocab, ranks, seed=5, dtype=torch.float64)
    u, e = rrs_noise(seeds, positions, ranks, vocab, draws)
    u[::2] = 1 - 2**-24
    want = _reference(p, q, candidates, u, e)
    for block in (16, 64):  # 3 tiles (a tile count that is not a power of two) and 1
        _assert_equal(launch_rrs(p, q, candidates, uniforms=u, exponentials=e, block=block), want)
    # rows stored in float32 (widened exactly to float64, as the reference does), as strided views
    p32, q32 = p.float(), q.float()
    _assert_equal(launch_rrs(torch.cat([p32, p32], -1)[:, :vocab], q32, candidates, uniforms=u, exponentials=e, block=64),
                  _reference(p32, q32, candidates, u, e))


def test_a_rejection_that_leaves_no_residual_mass_keeps_the_residual():
    """``u = 1`` (outside the keyed noise's range, so validation is off) rejects a candidate that carries all of
    ``p`` and of ``q``: the residual ``max(0, r - S q)`` is empty, the row keeps ``r`` and the race returns that
    token; with a tiny remainder of ``p`` elsewhere the residual is that remainder, and the race must find it."""
    vocab = 20
    p = torch.zeros(4, vocab, dtype=torch.float64)
    p[:, 7] = 0.5
    p[2:, 3] = 1e-300
    candidates = torch.tensor([[7, 2], [7, -1], [7, 2], [7, -1]])  # (2 has no weight left under q_2: not validated)
    q = torch.zeros(4, vocab, dtype=torch.float64)
    q[:, 7] = 1.0
    u = torch.ones(4, 2, dtype=torch.float64)
    e = torch.ones(4, vocab, dtype=torch.float64)
    for q_rows in (None, q):
        q_i = None if q_rows is None else without_replacement(q_rows, candidates, validate=False)
        want = rrs_reference(p, q_i, candidates, u, e, validate=False)
        assert want[0].tolist() == [-1] * 4 and want[1].tolist() == [7, 7, 3, 3]
        _assert_equal(launch_rrs(p, q_rows, candidates, uniforms=u, exponentials=e, block=16), want)


def test_race_ties_go_to_the_first_index_across_tiles():
    """No candidates (``K = 0``, or none in a row): the race samples ``p``; equal keys go to the first index."""
    vocab = 40
    p = torch.full((2, vocab), 0.25, dtype=torch.float64)
    e = torch.ones(2, vocab, dtype=torch.float64)
    e[1, :20] = 2.0  # row 1: the first maximal key is at 20, in the second tile
    for ranks in (0, 1):
        candidates = torch.full((2, ranks), -1)
        got = launch_rrs(p, None, candidates, uniforms=torch.zeros(2, ranks), exponentials=e, block=16)
        assert got[0].tolist() == [-1, -1] and got[1].tolist() == [0, 20]
        _assert_equal(got, rrs_reference(p, None, candidates, torch.zeros(2, ranks), e))
    keys = (torch.tensor([5, 6]), torch.tensor([7, 8]))  # keyed, K = 0
    _assert_equal(rrs(p, None, torch.zeros(2, 0, dtype=torch.int64), *keys, backend="triton"),
                  rrs(p, None, torch.zeros(2, 0, dtype=torch.int64), *keys, backend="reference"))


# ---- keyed noise generated in the kernel -------------------------------------------------------------------------


@pytest.mark.parametrize("one_hot", [False, True], ids=["without-replacement", "one-hot"])
def test_kernel_noise_is_rrs_noise(one_hot):
    """One-hot: six ranks, the first four on tokens ``p`` does not have (rejected for sure), the last two accepted
    with probability about 1/2 each: the outcome depends on the uniforms of ranks 4 and 5, words 0 and 1 of
    Philox block ``c0 = 1``."""
    rows, vocab, ranks = 6, 21, 6
    p, q, candidates, seeds, positions, draws = _case(rows, vocab, ranks, seed=3 + one_hot)
    if one_hot:
        q = None
        candidates[:, :] = torch.tensor([1, 4, 7, 10, 13, 16])
        p[:, [1, 4, 7, 10]] = 0.0
        p[:, 13] = p.sum(-1) - p[:, 13]
        p[:, 16] = p.sum(-1) - p[:, 16] - p[:, 13]
    args = (p, q, candidates, seeds, positions, draws)
    want = rrs(*args, backend="reference")
    got = rrs(*args, backend="triton", block=32)
    _assert_equal(got, want)
    if one_hot:
        assert set(want[0].tolist()) == {-1, 4, 5}


# ---- the dispatch ----------------------------------------------------------------------------------------------


def test_reference_dispatch_is_the_explicit_composition():
    rows, vocab, ranks = 40, 11, 4
    p, q, candidates, seeds, positions, draws = _case(rows, vocab, ranks, seed=7)
    u, e = rrs_noise(seeds, positions, ranks, vocab, draws)
    for q_base in (q, None):
        want = _reference(p, q_base, candidates, u, e)
        _assert_equal(rrs(p, q_base, candidates, seeds, positions, draws, backend="reference"), want)
        _assert_equal(rrs(p, q_base, candidates, seeds, positions, draws), want)  # auto: CPU tensors -> reference
    # one draw for every row
    u0, e0 = rrs_noise(seeds, positions, ranks, vocab, 3)
    _assert_equal(rrs(p, q, candidates, seeds, positions, 3, backend="reference"), _reference(p, q, candidates, u0, e0))


def _valid():
    return {"p": torch.full((3, 4), 0.25), "q_base": torch.tensor([[0.5, 0.5, 0.0, 0.0]] * 3),
            "candidates": torch.tensor([[0, 1], [1, -1], [-1, -1]]), "seeds": torch.tensor([1, 2, 3]),
            "positions": torch.tensor([4, 5, 6]), "draws": 0}


def _set(x, index, value):
    x = x.clone()
    x[index] = value
    return x


RRS_BAD = [
    ("p", {"p": torch.full((3,), 0.25)}),
    ("p", {"p": torch.ones(3, 4, dtype=torch.int64)}),
    ("p", {"p": _set(torch.full((3, 4), 0.25), (0, 1), -0.1)}),
    ("p", {"p": _set(torch.full((3, 4), 0.25), (1, 2), float("nan"))}),
    ("p", {"p": _set(torch.full((3, 4), 0.25), 2, 0.0)}),
    ("q_base", {"q_base": torch.ones(3, 5)}),
    ("q_base", {"q_base": torch.ones(3, 4, dtype=torch.int32)}),
    ("q_base", {"q_base": _set(torch.ones(3, 4), (0, 3), float("inf"))}),
    ("q_base", {"q_base": _set(torch.ones(3, 4), (2, 0), -1.0)}),
    ("candidates", {"candidates": torch.zeros(2, 2, dtype=torch.int64)}),
    ("candidates", {"candidates": torch.zeros(3, 2)}),
    ("candidates", {"candidates": torch.tensor([[0, 4], [1, -1], [-1, -1]])}),
    ("candidates", {"candidates": torch.tensor([[0, 1], [-1, 1], [-1, -1]])}),  # a candidate after a -1
    ("candidates", {"candidates": torch.tensor([[0, 0], [1, -1], [-1, -1]])}),  # a repeat
    ("candidates", {"candidates": torch.tensor([[0, 1], [2, -1], [-1, -1]])}),  # outside q_base's support
    ("seeds", {"seeds": torch.tensor([1, 2])}),
    ("seeds", {"seeds": torch.tensor([1.0, 2.0, 3.0])}),
    ("positions", {"positions": torch.tensor([[4, 5, 6]])}),
    ("positions", {"positions": [4, 5, 6]}),
    ("draws", {"draws": -1}),
    ("draws", {"draws": torch.tensor([0.0, 0.0, 0.0])}),
    ("block", {"block": 24}),
    ("block", {"block": 8}),
    ("backend", {"backend": "cuda"}),
]


@pytest.mark.parametrize("name,change", RRS_BAD, ids=[f"{n}-{i}" for i, (n, _) in enumerate(RRS_BAD)])
def test_rrs_rejects_bad_arguments_naming_them(name, change):
    for backend in ("reference", "triton"):
        args = dict(_valid(), backend=backend)
        args.update(change)
        p, q_base, candidates, seeds, positions, draws = (args.pop(k) for k in
                                                           ("p", "q_base", "candidates", "seeds", "positions", "draws"))
        with pytest.raises(ValueError, match=rf"^{name}\b"):
            rrs(p, q_base, candidates, seeds, positions, draws, **args)


def test_one_hot_candidates_need_no_draft_support():
    args = _valid()
    args["candidates"] = torch.tensor([[2, 3], [3, -1], [-1, -1]])  # outside q_base's support: fine without q
    for backend in ("reference", "triton"):
        got = rrs(args["p"], None, args["candidates"], args["seeds"], args["positions"], backend=backend)
        assert got[0].shape == got[1].shape == (3,)


# ---- slow: more keyed rows, and compilation for a real GPU -------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("one_hot", [False, True], ids=["without-replacement", "one-hot"])
def test_kernel_equals_reference_on_more_keyed_rows(one_hot):
    rows, vocab, ranks = 48, 150, 4
    p, q, candidates, seeds, positions, draws = _case(rows, vocab, ranks, seed=20 + one_hot, one_hot=one_hot)
    args = (p, None if one_hot else q, candidates, seeds, positions, draws)
    want = rrs(*args, backend="reference")
    assert 0 < int((want[0] >= 0).sum()) < rows
    _assert_equal(rrs(*args, backend="triton", block=64), want)


# Compiling for CUDA: tests/kernels/test_verify_kernels.py compiles every configuration of this kernel for sm_90.


# ---- realistic sizes on a GPU --------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("vocab", [16384, 32000])
@pytest.mark.parametrize("ranks", [1, 3])
def test_gpu_kernel_equals_reference_at_realistic_sizes(vocab, ranks):
    """256 rows on CUDA: with injected noise bitwise equal to the reference; with the keys (noise generated in
    the kernel) equal on all but near-ties of the race (the last bit of float32 ``log`` may differ)."""
    rows = 256
    p, q, candidates, seeds, positions, draws = _case(rows, vocab, ranks, seed=vocab + ranks)
    p, q, candidates, seeds, positions, draws = (t.cuda() for t in (p, q, candidates, seeds, positions, draws))
    u, e = rrs_noise(seeds, positions, ranks, vocab, draws)
    u[1::2] = 1 - 2**-24  # odd rows reject wherever the threshold is below 1: the residual and its race run
    want = _reference(p, q, candidates, u, e)
    _assert_equal(launch_rrs(p, q, candidates, uniforms=u, exponentials=e), want)
    keyed = [rrs(p, q, candidates, seeds, positions, draws, backend=backend) for backend in ("triton", "reference")]
    assert float((keyed[0][0] == keyed[1][0]).double().mean()) > 0.99
    assert float((keyed[0][1] == keyed[1][1]).double().mean()) > 0.99
