"""The flat-row reference of :mod:`vispec.kernels.verify` against a per-row oracle written out below.

The oracle loops over rows and vocabulary entries in plain Python floats (float64, as the tensors
here), so every comparison is exact: same flags, same counts, same tokens.
"""

from __future__ import annotations

import pytest
import torch

from vispec.kernels.verify import (
    noise_race,
    Drafts,
    InjectedNoise,
    SampleRequest,
    accept_reference,
    first_rejection_reference,
    sample_from_weights,
    sample_reference,
)

# ---- the oracle: one row at a time -------------------------------------------------------------------


def _q_row(drafts: Drafts, t: int, vocab: int) -> list[float]:
    """Row ``t``'s draft distribution: the dense row it names, else one-hot on its draft."""
    if drafts.q is not None and int(drafts.q_index[t]) >= 0:
        return [float(x) for x in drafts.q[int(drafts.q_index[t])]]
    return [1.0 if v == int(drafts.tokens[t]) else 0.0 for v in range(vocab)]


def _race(weights: list[float], noise: list[float]) -> int:
    """First index of the largest ``w / E``."""
    keys = [w / e for w, e in zip(weights, noise)]
    return keys.index(max(keys))


def oracle_accept(p, drafts, u, real) -> list[bool]:
    out = []
    for t in range(p.shape[0]):
        d = int(drafts.tokens[t])
        out.append(bool(real[t]) and float(u[t]) * _q_row(drafts, t, p.shape[1])[d] < float(p[t, d]))
    return out


def oracle_first_rejection(accepted, row_start, num_drafts) -> list[int]:
    out = []
    for start, count in zip(row_start.tolist(), num_drafts.tolist()):
        m = 0
        while m < count and bool(accepted[start + m]):
            m += 1
        out.append(m)
    return out


def oracle_sample(p, residual, fresh, drafts, residual_noise, fresh_noise) -> tuple[list[int], list[int]]:
    """Row ``t`` races with noise row ``t`` of its kind (the reference's contract: noise is keyed per row)."""
    vocab = p.shape[1]
    res, fr = [-1] * p.shape[0], [-1] * p.shape[0]
    for t in range(p.shape[0]):
        p_row = [float(x) for x in p[t]]
        if bool(residual[t]):
            weights = [max(0.0, a - b) for a, b in zip(p_row, _q_row(drafts, t, vocab))]
            res[t] = _race(weights, residual_noise[t].tolist())
        if bool(fresh[t]):
            fr[t] = _race(p_row, fresh_noise[t].tolist())
    return res, fr


def _case(rows=40, vocab=9, dense_rows=5, seed=0):
    """float64 ``p`` rows and drafts: about half the rows on a dense ``q``, some rows without a draft."""
    gen = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(rows, vocab, generator=gen, dtype=torch.float64) * 2, -1)
    q = torch.softmax(torch.randn(dense_rows, vocab, generator=gen, dtype=torch.float64) * 2, -1)
    tokens = torch.randint(0, vocab, (rows,), generator=gen)
    tokens[::7] = -1
    q_index = torch.where(torch.rand(rows, generator=gen) < 0.5, torch.randint(0, dense_rows, (rows,), generator=gen), -1)
    return p, Drafts(tokens, q, q_index), gen


# ---- the reference equals the oracle ------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(4))
def test_accept_reference_is_the_speculative_test_per_row(seed):
    p, drafts, gen = _case(seed=seed)
    u = torch.rand(p.shape[0], generator=gen, dtype=torch.float64)
    real = (drafts.tokens >= 0) & (torch.rand(p.shape[0], generator=gen) < 0.9)  # some padding rows too
    for d in (drafts, Drafts(drafts.tokens)):  # dense q where q_index >= 0, and one-hot everywhere
        accepted = accept_reference(p, d, u, real)
        assert accepted.dtype == torch.bool and accepted.tolist() == oracle_accept(p, d, u, real)
        assert not bool(accepted[~real].any())
    assert 0 < int(accept_reference(p, drafts, u, real).sum()) < int(real.sum())  # not vacuous


def test_accept_reference_limits():
    p, drafts, gen = _case(seed=7)
    u = torch.rand(p.shape[0], generator=gen, dtype=torch.float64).clamp(1e-6, 1 - 1e-6)
    real = drafts.tokens >= 0
    rows = torch.arange(p.shape[0])
    same = Drafts(drafts.tokens, p, torch.where(real, rows, -1))  # q = p: min(1, p/q) = 1
    assert torch.equal(accept_reference(p, same, u, real), real)
    zero = p.clone()
    zero[rows, drafts.tokens.clamp_min(0)] = 0.0  # p(d) = 0: never accepted
    assert not bool(accept_reference(zero, drafts, u, real).any())


def test_first_rejection_reference_ragged():
    gen = torch.Generator().manual_seed(1)
    accepted = torch.rand(30, generator=gen) < 0.7
    row_start = torch.tensor([0, 4, 4, 9, 17, 25, 30])
    num_drafts = torch.tensor([3, 0, 5, 8, 1, 5, 0])  # 0 drafts (also at the very end), 1 draft, a full window
    m = first_rejection_reference(accepted, row_start, num_drafts)
    assert m.tolist() == oracle_first_rejection(accepted, row_start, num_drafts)
    assert len(set(m.tolist())) > 2  # not vacuous
    everything = torch.ones(30, dtype=torch.bool)
    assert torch.equal(first_rejection_reference(everything, row_start, num_drafts), num_drafts)
    assert first_rejection_reference(accepted, torch.tensor([3, 30]), torch.tensor([0, 0])).tolist() == [0, 0]
    empty = torch.zeros(0, dtype=torch.long)
    assert first_rejection_reference(accepted, empty, empty).shape == (0,)


@pytest.mark.parametrize("seed", range(4))
def test_sample_reference_races_per_row(seed):
    p, drafts, gen = _case(seed=seed)
    rows, vocab = p.shape
    has_draft = drafts.tokens >= 0
    residual = has_draft & (torch.rand(rows, generator=gen) < 0.6)
    fresh = torch.rand(rows, generator=gen) < 0.5
    noise = InjectedNoise(torch.empty(rows, vocab, dtype=torch.float64).exponential_(generator=gen),
                          torch.empty(rows, vocab, dtype=torch.float64).exponential_(generator=gen))
    for d in (drafts, Drafts(drafts.tokens)):
        res, fr = sample_reference(p, residual, fresh, d, noise_race(noise.residual, noise.fresh))
        expected = oracle_sample(p, residual, fresh, d, noise.residual, noise.fresh)
        assert (res.tolist(), fr.tolist()) == expected
        assert bool((res[~residual] == -1).all()) and bool((fr[~fresh] == -1).all())
        assert bool((res[residual] >= 0).all()) and bool((fr[fresh] >= 0).all())
        one_hot = residual & ((d.q_index < 0) if d.q is not None else has_draft)
        assert bool(one_hot.any()) and bool((res[one_hot] != d.tokens[one_hot]).all())  # max(0, p - 1) = 0 at the draft


def test_sample_reference_with_nothing_asked():
    p, drafts, _ = _case(rows=5)
    none = torch.zeros(5, dtype=torch.bool)
    noise = torch.ones_like(p)
    for residual, fresh in ((none, none), (None, None)):
        res, fr = sample_reference(p, residual, fresh, drafts, noise_race(noise, noise))
        assert res.tolist() == fr.tolist() == [-1] * 5


def test_sample_from_weights_never_picks_zero_weight():
    weights = torch.tensor([[0.0, 1e-30, 0.0, 0.0], [0.0, 0.0, 0.0, 2.0]])
    e = torch.full((2, 4), 1e-6)
    e[:, 1] = e[:, 3] = 50.0  # the zero-weight entries have the smallest noise: they would win any positive weight
    assert sample_from_weights(weights, e).tolist() == [1, 3]
    assert sample_from_weights(weights.double(), e.double()).tolist() == [1, 3]
    with pytest.raises(ValueError, match="exponentials must have shape"):
        sample_from_weights(weights, e[:, :3])


# ---- checked inputs name the argument ------------------------------------------------------------


def test_drafts_checked():
    tokens = torch.tensor([0, 3, -1], dtype=torch.int32)
    checked = Drafts(tokens).checked(3, 4, validate=True)
    assert checked.tokens.dtype == torch.int64 and checked.q is None
    q = torch.full((4, 2), 0.25).t()  # [2, 4], not row-contiguous
    checked = Drafts(tokens, q, torch.tensor([1, -1, 0])).checked(3, 4, validate=True)
    assert checked.q.stride(-1) == 1 and torch.equal(checked.q, q)
    assert Drafts(torch.tensor([0, 9, 1])).checked(3, 4, validate=False).tokens.tolist() == [0, 9, 1]  # unchecked range
    bad = [
        (Drafts(torch.tensor([0, 1])), "draft tokens must have shape"),
        (Drafts(torch.tensor([0.0, 1.0, 2.0])), "draft tokens must be an integer"),
        (Drafts(torch.tensor([0, 4, 1])), r"draft tokens must be < the vocabulary \(4\)"),
        (Drafts(tokens, q=q), "q and q_index"),
        (Drafts(tokens, q_index=torch.tensor([0, 0, 0])), "q and q_index"),
        (Drafts(tokens, torch.ones(2, 5), torch.tensor([0, 0, 0])), r"q must be \[rows, 4\]"),
        (Drafts(tokens, q, torch.tensor([0, 0])), "q_index must have shape"),
        (Drafts(tokens, q, torch.tensor([0, 2, 0])), "q_index refers to row 2 but q has 2 rows"),
    ]
    for drafts, message in bad:
        with pytest.raises(ValueError, match=message):
            drafts.checked(3, 4, validate=True)


def test_sample_request_checked():
    cpu = torch.device("cpu")
    checked = SampleRequest(fresh=torch.tensor([True, False, True])).checked(3, 4, cpu, validate=True)
    assert checked.residual.tolist() == [False] * 3 and checked.fresh_draws.tolist() == [0] * 3
    assert checked.fresh_stream.dtype == torch.int64 and checked.fresh_stream.shape == (3,)
    flags, out = torch.ones(3, dtype=torch.bool), torch.zeros(2, 4)
    bad = [
        (SampleRequest(residual=torch.ones(3)), "residual must be a bool tensor"),
        (SampleRequest(fresh=torch.ones(2, dtype=torch.bool)), "fresh must be a bool tensor"),
        (SampleRequest(residual=flags, residual_draws=torch.zeros(3)), "residual_draws must be an integer"),
        (SampleRequest(fresh=flags, fresh_draws=torch.zeros(2, dtype=torch.long)), "fresh_draws must have shape"),
        (SampleRequest(fresh=flags, fresh_stream=torch.zeros(2, dtype=torch.long)), "fresh_stream must have shape"),
        (SampleRequest(noise=InjectedNoise(torch.ones(3, 3), torch.ones(3, 4))), "residual noise must have shape"),
        (SampleRequest(noise=InjectedNoise(torch.ones(3, 4), torch.ones(2, 4))), "fresh noise must have shape"),
        (SampleRequest(store_rows=torch.zeros(3, dtype=torch.long)), "store_rows and store_out"),
        (SampleRequest(store_out=out), "store_rows and store_out"),
        (SampleRequest(store_rows=torch.zeros(2, dtype=torch.long), store_out=out), "store_rows must have shape"),
        (SampleRequest(store_rows=torch.zeros(3, dtype=torch.long), store_out=torch.zeros(2, 5)), r"store_out must be \[N, 4\]"),
        (SampleRequest(store_rows=torch.tensor([0, 2, -1]), store_out=out), "store_rows refers to row 2 but store_out has 2"),
    ]
    for request, message in bad:
        with pytest.raises(ValueError, match=message):
            request.checked(3, 4, cpu, validate=True)
