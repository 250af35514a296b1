"""Recursive rejection sampling of several candidates (:mod:`vispec.kernels.multi_verify`) is exact.

* The math, with no sampling: for small random rational ``p`` and ``q``, every candidate tuple is enumerated
  with its exact probability (drawn without replacement from ``q``, i.i.d. from ``q``, from a different ``q_i``
  per rank, or fixed one-hot candidates), the output law of the recursion is computed in exact rational
  arithmetic, and it equals ``p`` exactly. Negative controls in the same arithmetic (the residual not updated
  after a rejection; candidates drawn without replacement but verified against the unconditioned ``q``) are
  off by more than 1e-3 in total variation.
* The implementation against that recursion: :func:`without_replacement` gives the rational ``q_i`` to 1e-15,
  and :func:`rrs_reference` accepts at rank ``i`` exactly below the rational acceptance threshold (probed just
  below and just above it, after forced rejections of the earlier ranks); a per-row oracle in Python floats
  gives the same ranks and tokens, residual races included.
* Statistically, through keyed noise (:func:`rrs_noise`): many rows of one ``(p, q)``, candidates drawn without
  replacement with their own noise; the tokens pass a chi-square test against ``p`` and the acceptance rate is
  the exact one, while verification against the unconditioned ``q`` fails the same test.
* A row's result does not depend on the batch; every bad argument raises a ``ValueError`` naming it.
"""

from __future__ import annotations

import itertools
import math
import random
from fractions import Fraction

import pytest
import torch
from scipy import stats

from vispec.kernels import race
from vispec.kernels.multi_verify import rrs_noise, rrs_reference, without_replacement
from vispec.kernels.philox import Stream

# ---- exact rational oracle -------------------------------------------------------------------------------

Row = list  # a distribution over the vocabulary as a list of Fractions


def _rational_row(rng: random.Random, vocab: int, zeros: int = 0) -> Row:
    weights = [rng.randint(1, 12) for _ in range(vocab)]
    for v in rng.sample(range(vocab), zeros):
        weights[v] = 0
    total = sum(weights)
    return [Fraction(w, total) for w in weights]


def _one_hot(x: int, vocab: int) -> Row:
    return [Fraction(int(v == x)) for v in range(vocab)]


def _removed(q: Row, drawn: list[int]):
    """``q`` without the tokens ``drawn``, renormalised; None when nothing is left."""
    w = [Fraction(0) if v in drawn else x for v, x in enumerate(q)]
    total = sum(w)
    return [x / total for x in w] if total else None


def tuples_without_replacement(q: Row, ranks: int) -> list[tuple[Fraction, list[int], list[Row]]]:
    """``(probability, candidates, [q_1 .. q_k])`` of every ordered draw of up to ``ranks`` distinct tokens
    from ``q`` (a draw stops early, with fewer candidates, when ``q`` has no mass left)."""
    out = []

    def extend(prob, drawn, rows):
        q_i = _removed(q, drawn) if len(drawn) < ranks else None
        if q_i is None:
            out.append((prob, drawn, rows))
            return
        for v, w in enumerate(q_i):
            if w:
                extend(prob * w, drawn + [v], rows + [q_i])

    extend(Fraction(1), [], [])
    return out


def tuples_independent(rows: list[Row]) -> list[tuple[Fraction, list[int], list[Row]]]:
    """Every tuple of candidates ``x_i ~ q_i`` drawn independently (explicit rows, one per rank)."""
    supports = [[v for v, w in enumerate(q_i) if w] for q_i in rows]
    return [(math.prod((q_i[v] for q_i, v in zip(rows, xs)), start=Fraction(1)), list(xs), rows)
            for xs in itertools.product(*supports)]


def rrs_law(p: Row, candidates: list[int], rows: list[Row], update: bool = True) -> tuple[Row, Fraction, list[Fraction]]:
    """For fixed candidates with laws ``rows``: the exact law of the returned token, the probability that a
    candidate is accepted, and the acceptance thresholds ``min(1, r(x_i) / q_i(x_i))`` rank by rank. With
    ``update=False`` (a negative control) the residual is never updated after a rejection."""
    r = list(p)
    law, reach, thresholds = [Fraction(0)] * len(p), Fraction(1), []
    for x, q_i in zip(candidates, rows):
        a = min(Fraction(1), r[x] / q_i[x])
        thresholds.append(a)
        law[x] += reach * a
        reach *= 1 - a
        if update:
            residual = [max(Fraction(0), rv - qv) for rv, qv in zip(r, q_i)]
            mass = sum(residual)
            if mass:  # else r = q_i, every candidate is accepted and reach is 0
                r = [w / mass for w in residual]
    return [lv + reach * rv for lv, rv in zip(law, r)], 1 - reach, thresholds


def mixture_law(p: Row, tuples, update: bool = True, verify_against: Row | None = None) -> tuple[Row, Fraction]:
    """The output law and acceptance probability over the candidate tuples ``(probability, candidates, rows)``;
    ``verify_against``: verify every rank against this row instead of the candidate's own law (a negative control)."""
    law, accepted = [Fraction(0)] * len(p), Fraction(0)
    for prob, xs, rows in tuples:
        one, a, _ = rrs_law(p, xs, rows if verify_against is None else [verify_against] * len(xs), update)
        law = [lv + prob * ov for lv, ov in zip(law, one)]
        accepted += prob * a
    assert sum(prob for prob, _, _ in tuples) == 1
    return law, accepted


def tv(a: Row, b: Row) -> float:
    return float(sum(abs(x - y) for x, y in zip(a, b)) / 2)


def _case(vocab: int, ranks: int, seed: int) -> tuple[Row, Row, list[Row]]:
    """Random rational ``p`` and ``q`` (with zeros on some seeds) and ``ranks`` explicit rows."""
    rng = random.Random(1000 * vocab + 10 * ranks + seed)
    p = _rational_row(rng, vocab, zeros=seed % 2)
    q = _rational_row(rng, vocab, zeros=(seed // 2) % 2)
    rows = [_rational_row(rng, vocab, zeros=rng.randint(0, 2)) for _ in range(ranks)]
    return p, q, rows


EXACT_CASES = [(vocab, ranks, seed) for vocab in (5, 6) for ranks in (1, 2, 3, 4) for seed in (0, 3)]


@pytest.mark.parametrize("vocab,ranks,seed", EXACT_CASES)
def test_the_recursion_returns_p_exactly_for_every_kind_of_candidates(vocab, ranks, seed):
    p, q, rows = _case(vocab, ranks, seed)
    kinds = {
        "without replacement": tuples_without_replacement(q, ranks),
        "i.i.d. from q": tuples_independent([q] * ranks),
        "explicit rows": tuples_independent(rows),
    }
    for kind, tuples in kinds.items():
        law, _ = mixture_law(p, tuples)
        assert law == p, kind  # exact rational equality
        # negative control: no residual update after a rejection
        assert tv(mixture_law(p, tuples, update=False)[0], p) > 1e-3, kind
    # negative control: candidates drawn without replacement, verified against the unconditioned q
    if ranks >= 2:
        assert tv(mixture_law(p, kinds["without replacement"], verify_against=q)[0], p) > 1e-3

    # one-hot candidates (no distribution): every fixed tuple, repeats and tokens outside p's support included
    rng = random.Random(seed)
    fixed = [[rng.randrange(vocab) for _ in range(ranks)] for _ in range(20)] + [[0] * ranks]
    fixed.append([v for v in range(vocab) if p[v] == 0][:1] * ranks or [vocab - 1] * ranks)
    for xs in fixed:
        one_hot = [_one_hot(x, vocab) for x in xs]
        assert rrs_law(p, xs, one_hot)[0] == p, xs
        assert tv(rrs_law(p, xs, one_hot, update=False)[0], p) > 1e-3 or all(p[x] in (0, 1) for x in xs)


def test_a_draft_with_less_support_than_k_stops_early_and_stays_exact():
    p = [Fraction(w, 15) for w in (1, 2, 3, 4, 5)]
    q = [Fraction(0), Fraction(1, 3), Fraction(0), Fraction(2, 3), Fraction(0)]
    tuples = tuples_without_replacement(q, 4)
    assert {len(xs) for _, xs, _ in tuples} == {2}
    assert mixture_law(p, tuples)[0] == p


def _float_rows(rows: list[Row]) -> torch.Tensor:
    return torch.tensor([[float(x) for x in row] for row in rows], dtype=torch.float64)


@pytest.mark.parametrize("vocab,ranks,seed", [(5, 4, 0), (6, 3, 3), (6, 4, 1)])
def test_without_replacement_matches_the_rational_laws(vocab, ranks, seed):
    _, q, _ = _case(vocab, ranks, seed)
    tuples = tuples_without_replacement(q, ranks)
    candidates = torch.tensor([xs + [-1] * (ranks - len(xs)) for _, xs, _ in tuples])
    got = without_replacement(_float_rows([q]).expand(len(tuples), vocab), candidates)
    assert got.dtype == torch.float64 and got.shape == (len(tuples), ranks, vocab)
    for t, (_, xs, rows) in enumerate(tuples):
        for i, row in enumerate(rows):
            assert torch.allclose(got[t, i], _float_rows([row])[0], rtol=0, atol=1e-15)
    assert torch.allclose(got.sum(-1), torch.ones(len(tuples), ranks, dtype=torch.float64), rtol=0, atol=1e-15)


def test_without_replacement_never_gives_nan_when_nothing_is_left():
    q = torch.tensor([[0.0, 0.25, 0.0, 0.75], [0.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    got = without_replacement(q, torch.tensor([[3, 1, -1], [-1, -1, -1]]))
    assert not bool(got.isnan().any())
    assert torch.equal(got[0, 2], torch.zeros(4, dtype=torch.float64))  # q exhausted after two candidates
    assert torch.equal(got[1], torch.zeros(3, 4, dtype=torch.float64))
    assert torch.allclose(got[0, 1], torch.tensor([0.0, 1.0, 0.0, 0.0], dtype=torch.float64))



# ---- the implementation against the recursion, exactly ----------------------------------------------------


def _probes(p: Row, tuples) -> list[tuple[list[int], list[Row], list[float], int, bool]]:
    """Rows that reach rank ``i`` (the earlier ranks forced to reject, ``u_j`` above their thresholds) with
    ``u_i`` just below and just above the exact threshold: ``(candidates, rows, uniforms, i, accept_at_i)``."""
    out = []
    for _, xs, rows in tuples:
        thresholds = rrs_law(p, xs, rows)[2]
        for i, t in enumerate(thresholds):
            if i and thresholds[i - 1] == 1:
                break  # rank i is never reached
            before = [(1 + float(t_j)) / 2 for t_j in thresholds[:i]]
            after = [0.5] * (len(xs) - i - 1)
            if t > 0:
                out.append((xs, rows, before + [float(t) * (1 - 1e-9)] + after, i, True))
            if t < 1:
                out.append((xs, rows, before + [min(float(t) * (1 + 1e-9) + 1e-12, 1 - 1e-12)] + after, i, False))
    return out


@pytest.mark.parametrize("vocab,ranks,seed", [(5, 3, 0), (6, 4, 3), (6, 2, 1)])
@pytest.mark.parametrize("kind", ["without replacement", "explicit rows", "one-hot"])
def test_rrs_reference_accepts_exactly_below_the_rational_thresholds(vocab, ranks, seed, kind):
    p, q, rows = _case(vocab, ranks, seed)
    if kind == "without replacement":
        tuples = tuples_without_replacement(q, ranks)
    elif kind == "explicit rows":
        tuples = tuples_independent(rows)
    else:
        rng = random.Random(seed)
        tuples = [(1, xs, [_one_hot(x, vocab) for x in xs])
                  for xs in ([rng.randrange(vocab) for _ in range(ranks)] for _ in range(40))]
    probes = _probes(p, tuples)
    n = len(probes)

    def pad(xs, fill):
        return list(xs) + [fill] * (ranks - len(xs))

    candidates = torch.tensor([pad(xs, -1) for xs, _, _, _, _ in probes])
    uniforms = torch.tensor([pad(u, 0.5) for _, _, u, _, _ in probes], dtype=torch.float64)
    q_rows = None
    if kind != "one-hot":
        q_rows = torch.stack([_float_rows(pad(r, [Fraction(0)] * vocab)) for _, r, _, _, _ in probes])
    accepted, tokens = rrs_reference(_float_rows([p]).expand(n, vocab), q_rows, candidates, uniforms,
                                     torch.ones(n, vocab, dtype=torch.float64))
    probed = torch.tensor([i for _, _, _, i, _ in probes])
    expect = torch.tensor([e for _, _, _, _, e in probes])
    assert torch.equal(accepted == probed, expect)
    assert bool(((accepted[~expect] < 0) | (accepted[~expect] > probed[~expect])).all())
    hit = accepted >= 0
    assert torch.equal(tokens[hit], candidates[hit].gather(1, accepted[hit][:, None])[:, 0])


def _oracle_row(p: list[float], q_rows, xs: list[int], u: list[float], e: list[float]) -> tuple[int, int]:
    """One row in Python floats: the recursion with an unnormalised residual, then the race."""
    r = list(p)
    for i, x in enumerate(xs):
        if x < 0:
            break
        if q_rows is None:
            q_i = [float(v == x) for v in range(len(p))]
        else:
            total = sum(q_rows[i])
            q_i = [w / total for w in q_rows[i]]
        mass = sum(r)
        if u[i] * q_i[x] * mass < r[x]:
            return i, x
        residual = [max(0.0, rv - mass * qv) for rv, qv in zip(r, q_i)]
        if sum(residual) > 0:
            r = residual
    keys = [w / ev for w, ev in zip(r, e)]
    return -1, keys.index(max(keys))


@pytest.mark.parametrize("one_hot", [False, True])
def test_rrs_reference_matches_a_per_row_oracle(one_hot):
    gen = torch.Generator().manual_seed(11)
    rows, ranks, vocab = 300, 4, 7
    p = torch.softmax(torch.randn(rows, vocab, generator=gen, dtype=torch.float64) * 2, -1)
    p[torch.rand(rows, vocab, generator=gen) < 0.2] = 0.0
    p[:, 0] += 1e-3  # every row keeps some mass
    q = torch.softmax(torch.randn(rows, ranks, vocab, generator=gen, dtype=torch.float64) * 2, -1) * 3.0  # unnormalised
    counts = torch.randint(0, ranks + 1, (rows,), generator=gen)
    candidates = torch.randint(0, vocab, (rows, ranks), generator=gen)
    candidates[torch.arange(ranks)[None, :] >= counts[:, None]] = -1
    uniforms = torch.rand(rows, ranks, generator=gen, dtype=torch.float64)
    noise = torch.empty(rows, vocab, dtype=torch.float64).exponential_(generator=gen)
    accepted, tokens = rrs_reference(p, None if one_hot else q, candidates, uniforms, noise)
    assert accepted.dtype == tokens.dtype == torch.int64 and accepted.shape == tokens.shape == (rows,)
    for t in range(rows):
        want = _oracle_row(p[t].tolist(), None if one_hot else q[t].tolist(), candidates[t].tolist(),
                           uniforms[t].tolist(), noise[t].tolist())
        assert (int(accepted[t]), int(tokens[t])) == want, t
    assert 0 < int((accepted >= 0).sum()) < rows and int((accepted < 0).sum()) > 0


def test_one_candidate_is_the_single_draft_speculative_step():
    """K = 1 on the same keyed noise: accepted iff ``u q(d) < p(d)``, else the race over ``max(0, p - q)``."""
    gen = torch.Generator().manual_seed(2)
    rows, vocab = 500, 9
    p = torch.softmax(torch.randn(rows, vocab, generator=gen, dtype=torch.float64) * 2, -1)
    q = torch.softmax(torch.randn(rows, vocab, generator=gen, dtype=torch.float64) * 2, -1)
    drafts = torch.multinomial(q, 1, generator=gen)[:, 0]
    seeds, positions = torch.arange(rows) * 31 + 7, torch.arange(rows) % 50
    u, e = rrs_noise(seeds, positions, 1, vocab)
    accepted, tokens = rrs_reference(p, q[:, None], drafts[:, None], u, e)
    single_u = race.keyed_uniforms(seeds, positions, Stream.ACCEPT, 0)
    single = single_u.double() * q.gather(1, drafts[:, None])[:, 0] < p.gather(1, drafts[:, None])[:, 0]
    residual = race.keyed_race((p - q).clamp_min(0), seeds, positions, int(Stream.RESIDUAL), 0)
    assert torch.equal(accepted == 0, single)
    assert torch.equal(tokens, torch.where(single, drafts, residual))


# ---- keyed noise ------------------------------------------------------------------------------------------


def test_rrs_noise_keys():
    gen = torch.Generator().manual_seed(3)
    rows, vocab = 20, 13
    seeds = torch.randint(-(2**63), 2**63 - 1, (rows,), generator=gen)
    positions = torch.randint(0, 2**20, (rows,), generator=gen)
    draws = torch.randint(0, 5, (rows,), generator=gen)
    u, e = rrs_noise(seeds, positions, 6, vocab, draws)
    assert u.shape == (rows, 6) and e.shape == (rows, vocab) and u.dtype == e.dtype == torch.float32
    # rank 0 is the single-draft acceptance uniform, the exponentials the single-draft residual race's noise
    assert torch.equal(u[:, 0], race.keyed_uniforms(seeds, positions, Stream.ACCEPT, draws))
    assert torch.equal(e, race.eager_exponentials(seeds, positions, Stream.RESIDUAL, draws, vocab))
    # a rank's uniform does not depend on K; ranks, draws and positions all give fresh numbers
    assert torch.equal(rrs_noise(seeds, positions, 3, vocab, draws)[0], u[:, :3])
    assert rrs_noise(seeds, positions, 0, vocab, draws)[0].shape == (rows, 0)
    assert len(set(u.flatten().tolist())) == u.numel()
    assert not bool((rrs_noise(seeds, positions, 6, vocab, draws + 1)[0] == u).any())
    assert not bool((rrs_noise(seeds, positions + 1, 6, vocab, draws)[0] == u).any())
    assert bool(((u > 0) & (u < 1)).all()) and bool((e > 0).all())


def _draw_without_replacement(q: torch.Tensor, seeds, positions, draws, ranks: int) -> torch.Tensor:
    """Candidates drawn in order without replacement (Gumbel-top-k: the ``ranks`` largest ``q / E``), with the
    drafter's own keyed noise (``Stream.DRAFT``); ranks past ``q``'s support are -1."""
    keys = q / race.keyed_exponentials(seeds, positions, int(Stream.DRAFT), draws, q.shape[-1])
    top = keys.topk(ranks, dim=-1)
    return torch.where(top.values > 0, top.indices, torch.full_like(top.indices, -1))


def test_a_rows_result_does_not_depend_on_the_batch():
    gen = torch.Generator().manual_seed(5)
    rows, ranks, vocab = 48, 4, 11
    p = torch.softmax(torch.randn(rows, vocab, generator=gen, dtype=torch.float64) * 2, -1)
    q = torch.softmax(torch.randn(rows, vocab, generator=gen, dtype=torch.float64) * 2, -1)
    seeds = torch.randint(-(2**63), 2**63 - 1, (rows,), generator=gen)
    positions = torch.randint(0, 4096, (rows,), generator=gen)
    draws = torch.randint(0, 10, (rows,), generator=gen)
    counts = torch.randint(0, ranks + 1, (rows,), generator=gen)
    candidates = _draw_without_replacement(q, seeds, positions, draws, ranks)
    candidates[torch.arange(ranks)[None, :] >= counts[:, None]] = -1
    u, e = rrs_noise(seeds, positions, ranks, vocab, draws)
    batch = {"dense": rrs_reference(p, without_replacement(q, candidates), candidates, u, e),
             "one-hot": rrs_reference(p, None, candidates, u, e)}
    for j in range(rows):
        k, one = int(counts[j]), slice(j, j + 1)
        u_j, e_j = rrs_noise(seeds[one], positions[one], k, vocab, draws[one])  # alone, with its own K
        assert torch.equal(u_j, u[one, :k]) and torch.equal(e_j, e[one])
        alone = {"dense": rrs_reference(p[one], without_replacement(q[one], candidates[one, :k]), candidates[one, :k],
                                        u_j, e_j),
                 "one-hot": rrs_reference(p[one], None, candidates[one, :k], u_j, e_j)}
        for kind, result in batch.items():
            assert [int(x[j]) for x in result] == [int(x[0]) for x in alone[kind]], (kind, j)


# ---- statistics through keyed noise ------------------------------------------------------------------------

P_WEIGHTS = (6, 5, 1, 1, 1, 3)
Q_WEIGHTS = (6, 1, 5, 11, 1, 3)


def _chisquare(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs.double() / probs.double().sum() * float(counts.sum())
    return float(stats.chisquare(counts.double().numpy(), expected.numpy()).pvalue)


@pytest.mark.slow  # about 6 s per K: 200k rows of keyed noise
@pytest.mark.parametrize("ranks", [2, 3])
def test_tokens_follow_p_through_keyed_noise(ranks):
    n, vocab = 200_000, len(P_WEIGHTS)
    p_exact = [Fraction(w, sum(P_WEIGHTS)) for w in P_WEIGHTS]
    q_exact = [Fraction(w, sum(Q_WEIGHTS)) for w in Q_WEIGHTS]
    tuples = tuples_without_replacement(q_exact, ranks)
    rate = float(mixture_law(p_exact, tuples)[1])
    wrong_law = mixture_law(p_exact, tuples, verify_against=q_exact)[0]
    assert tv(wrong_law, p_exact) > 0.05  # the negative control is biased enough to be seen at this n

    p = torch.tensor([float(x) for x in p_exact], dtype=torch.float64)
    q = torch.tensor([float(x) for x in q_exact], dtype=torch.float64)
    seeds = torch.arange(n, dtype=torch.int64) * 1_000_003 + 17 * ranks
    positions = torch.arange(n, dtype=torch.int64) % 256
    candidates = _draw_without_replacement(q.expand(n, vocab), seeds, positions, 0, ranks)
    u, e = rrs_noise(seeds, positions, ranks, vocab)

    accepted, tokens = rrs_reference(p.expand(n, vocab), without_replacement(q.expand(n, vocab), candidates),
                                     candidates, u, e)
    assert _chisquare(torch.bincount(tokens, minlength=vocab), p) > 1e-3
    observed = float((accepted >= 0).double().mean())
    assert abs(observed - rate) < 4.5 * math.sqrt(rate * (1 - rate) / n), (observed, rate)

    # negative control: the same candidates verified against the unconditioned q at every rank
    _, wrong = rrs_reference(p.expand(n, vocab), q.expand(n, ranks, vocab), candidates, u, e)
    assert _chisquare(torch.bincount(wrong, minlength=vocab), p) < 1e-6
    assert _chisquare(torch.bincount(wrong, minlength=vocab), torch.tensor([float(x) for x in wrong_law])) > 1e-3


# ---- bad arguments ----------------------------------------------------------------------------------------


def _valid():
    return {"p": torch.full((3, 4), 0.25, dtype=torch.float64), "q": torch.full((3, 2, 4), 0.25),
            "candidates": torch.tensor([[0, 1], [2, -1], [-1, -1]]), "uniforms": torch.full((3, 2), 0.5),
            "exponentials": torch.ones(3, 4)}


def _with(name, value):
    args = _valid()
    args[name] = value(args[name]) if callable(value) else value
    return args


def _set(x, index, value):
    x = x.clone()
    x[index] = value
    return x


RRS_BAD = [
    ("p", lambda x: x[0]),
    ("p", lambda x: x.to(torch.int64)),
    ("p", lambda x: _set(x, (0, 1), -0.1)),
    ("p", lambda x: _set(x, (1, 1), float("nan"))),
    ("p", lambda x: _set(x, 2, 0.0)),
    ("q", lambda x: x[:, :1]),
    ("q", lambda x: x.to(torch.int64)),
    ("q", lambda x: _set(x, (0, 0, 3), -1.0)),
    ("q", lambda x: _set(x, (1, 0, 0), float("inf"))),
    ("candidates", lambda x: x.double()),
    ("candidates", lambda x: x[:2]),
    ("candidates", lambda x: x[:, 0]),
    ("candidates", lambda x: _set(x, (0, 1), 4)),
    ("candidates", lambda x: _set(x, (0, 1), -2)),
    ("candidates", lambda x: _set(x, (2, 1), 3)),  # a candidate after a -1
    ("uniforms", lambda x: x[:, :1]),
    ("uniforms", lambda x: x.to(torch.int64)),
    ("uniforms", lambda x: _set(x, (0, 0), 1.0)),
    ("uniforms", lambda x: _set(x, (1, 1), -0.5)),
    ("exponentials", lambda x: x[:, :3]),
    ("exponentials", lambda x: x.to(torch.int32)),
    ("exponentials", lambda x: _set(x, (0, 0), 0.0)),
    ("exponentials", lambda x: _set(x, (2, 3), float("nan"))),
]


@pytest.mark.parametrize("name,value", RRS_BAD)
def test_rrs_reference_rejects_bad_arguments(name, value):
    with pytest.raises(ValueError, match=rf"^{name}\b"):
        rrs_reference(**_with(name, value))


def test_a_candidate_outside_its_q_is_rejected():
    args = _valid()
    args["q"][0, 1] = torch.tensor([0.5, 0.0, 0.5, 0.0])  # candidates[0, 1] = 1 has no mass under q_2
    with pytest.raises(ValueError, match=r"^candidates\[0, 1\]"):
        rrs_reference(**args)
    args["q"] = None  # one-hot candidates: any token is fine
    rrs_reference(**args)


WITHOUT_BAD = [
    ("q", torch.ones(2, 2, 4), torch.tensor([[0], [1]])),
    ("q", torch.tensor([[1.0, -1.0, 1.0]]), torch.tensor([[0]])),
    ("q", torch.ones(1, 3, dtype=torch.int64), torch.tensor([[0]])),
    ("candidates", torch.ones(2, 3), torch.tensor([[0], [1], [2]])),
    ("candidates", torch.ones(2, 3), torch.tensor([[1, 1], [0, 2]])),  # a repeat: zero mass under q_2
    ("candidates", torch.tensor([[1.0, 0.0, 1.0]]), torch.tensor([[1]])),  # outside q's support
    ("candidates", torch.ones(1, 3), torch.tensor([[3]])),
    ("candidates", torch.ones(1, 3), torch.tensor([[0.0]])),
]


@pytest.mark.parametrize("name,q,candidates", WITHOUT_BAD)
def test_without_replacement_rejects_bad_arguments(name, q, candidates):
    with pytest.raises(ValueError, match=rf"^{name}\b"):
        without_replacement(q, candidates)


NOISE_BAD = [
    ("seeds", {"seeds": torch.zeros(2, 2, dtype=torch.int64)}),
    ("seeds", {"seeds": torch.zeros(2)}),
    ("positions", {"positions": torch.zeros(3, dtype=torch.int64)}),
    ("positions", {"positions": torch.zeros(2)}),
    ("num_candidates", {"num_candidates": -1}),
    ("num_candidates", {"num_candidates": 1.5}),
    ("num_candidates", {"num_candidates": True}),
    ("vocab", {"vocab": 0}),
    ("draws", {"draws": torch.zeros(3, dtype=torch.int64)}),
    ("draws", {"draws": -1}),
]


@pytest.mark.parametrize("name,change", NOISE_BAD)
def test_rrs_noise_rejects_bad_arguments(name, change):
    args = {"seeds": torch.zeros(2, dtype=torch.int64), "positions": torch.zeros(2, dtype=torch.int64),
            "num_candidates": 2, "vocab": 5}
    args.update(change)
    with pytest.raises(ValueError, match=rf"^{name}\b"):
        rrs_noise(**args)
