"""The per-image TV of lossy rules (``stats.tv_mean``, ``stats.tv_max``; vispec.decoding.acceptance.TVTracker), issue 47
item 8b: every verified row of every sample is measured, batched, so no image of a batch is left unmeasured (NaN),
and the budgeted rule's figure never exceeds the budget it enforces (not even by float rounding). The tracked values
are checked against a brute-force computation of each verified row's output distribution, by enumerating its drafts
through the rules' own acceptance and residual functions (not their closed forms)."""

from __future__ import annotations

import math

import pytest
import torch

from helpers import tiny_gpt
from vispec.decoding import decode
from vispec.decoding.acceptance import AcceptanceConfig, GSDRule, LanternRule, LuminaRule, TVTracker
from vispec.decoding.budget import BudgetRule
from vispec.decoding.neighbors import codebook_neighbors
from vispec.decoding.rules import build_rule
from vispec.models.llamagen_gpt import LlamaGenCondition
from vispec.sampling import SamplingConfig

SAMPLING = SamplingConfig(temperature=1.0, top_k=20, guidance_scale=2.0)


def _gens(count: int) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(seed) for seed in range(count)]


@pytest.mark.parametrize("batch", [8, 16])
@pytest.mark.parametrize("spec", ["mc-sjd+budget:delta=0.1", "sjd+budget:delta=0.1", "sd+budget:delta=0.1",
                                  "mc-sjd+budget:delta=0.1,decay=0.8,end=0.5,ratio=2"])
def test_budget_rule_measures_every_image_within_its_budget(batch, spec):
    """Batch 8 and 16 (the tracker measured the first draft row of at most 4 samples per pass: at batch 8 an image
    could end with no measurement, NaN): every image has a TV, and its max never exceeds δ, exactly (the budgeted
    rule's figure is the mass it moved, min(δ_t, min(E, D)); re-derived from the output distribution it read
    0.10000000000000019 at δ = 0.1)."""
    model = tiny_gpt(vocab_size=32, block_size=64, num_classes=5, std=0.6, seed=3)
    drafter = tiny_gpt(vocab_size=32, block_size=64, num_classes=5, dim=16, n_layer=1, std=0.6, seed=9) if spec.startswith("sd") else None
    condition = LlamaGenCondition(class_labels=torch.arange(batch) % 5)
    out = decode(model, condition, num_tokens=48, sampling=SAMPLING, decoding=spec, drafter=drafter, generator=_gens(batch))
    tv_mean, tv_max = out.stats.tv_mean, out.stats.tv_max
    assert tv_mean.shape == (batch,) and not bool(tv_mean.isnan().any()) and not bool(tv_max.isnan().any())
    assert float(tv_max.max()) <= 0.1, f"tv_max {tv_max.max().item()!r} exceeds δ = 0.1"
    assert bool((tv_mean <= tv_max).all()) and float(tv_max.min()) > 0
    assert all(not math.isnan(row["tv_max"]) and row["tv_max"] <= 0.1 for row in out.as_dicts())


# ---- the tracked figures against a brute-force per-row computation ------------------------------------------------

def _normalized(p: torch.Tensor) -> torch.Tensor:
    return p / p.sum()


def brute_force_tv(rule, p: torch.Tensor, q: torch.Tensor, sampling: SamplingConfig) -> float:
    """TV between one verification's output and its target ``p`` (``[V]``), by enumerating the drafts ``x ~ q``: kept
    with the rule's acceptance probability, else resampled from the rule's residual for ``x`` (token 0 when it has no
    mass, as the exponential race does), through the rules' own mechanism-level functions."""
    vocab = p.shape[0]
    p, q = p.double(), q.double()
    if isinstance(rule, BudgetRule):  # the rule relaxes and verifies the normalised rows
        p, q = _normalized(p), _normalized(q)
        target = rule.relax(p[None], q[None]).p_tilde[0]
    out = torch.zeros(vocab, dtype=torch.float64)
    for x in q.nonzero().squeeze(1).tolist():
        at = torch.tensor([x])
        if isinstance(rule, BudgetRule):
            accept = min(1.0, float(target[x] / q[x]))
            residual = (target - q).clamp_min(0.0)
        elif isinstance(rule, LanternRule):
            accept = min(1.0, float(rule.relaxed_probability(p[None], at[None])[0, 0] / q[x]))
            residual = rule.residual_weights(p[None], at, q[None])[0]
        elif isinstance(rule, GSDRule):
            p_group, q_group = rule._group_sums(p[None], q[None], at[None])
            accept = min(1.0, float(p_group[0, 0] / q_group[0, 0]))
            residual = rule.residual_weights(p[None], at, q[None])[0]
        else:  # Lumina-mGPT 2.0's rule
            accept = min(1.0, float(p[x] / max(float(q[x]), 1e-7)))
            residual = rule.rejection_distribution(p[None], q[None], sampling)[0]
        out[x] += q[x] * accept
        if accept < 1:
            spread = residual / residual.sum() if float(residual.sum()) > 0 else torch.nn.functional.one_hot(torch.tensor(0), vocab).double()
            out += q[x] * (1 - accept) * spread
    return 0.5 * float((out - p).abs().sum())


CASES = [("mc-sjd+budget:delta=0.1", 16), ("mc-sjd+lantern:k=40,delta=0.1", 48), ("sjd-random+lantern:k=30,delta=0.3", 48),
         ("sd+lantern:k=5,delta=2", 16), ("sjd-random+gsd:d_thr=40", 16), ("mc-sjd+gsd:half_width=3,p_thr=0.3,d_thr=60", 16),
         ("mc-sjd+lumina", 16), ("sd+lumina", 16)]


@pytest.mark.parametrize("spec, vocab", CASES, ids=[spec for spec, _ in CASES])
def test_tracked_tv_equals_a_brute_force_per_row_computation(spec, vocab, monkeypatch):
    """Batch 6 (beyond the old 4 samples per pass), 16 tokens: the tracker's per-image max and mean equal those of
    the brute-force TV of every verified row (rows ``j < D_b`` of every pass); LANTERN's cases reach 40 neighbours
    (its closed form reads them in growing prefixes), GSD's and Lumina's run dense and one-hot drafts."""
    model = tiny_gpt(vocab_size=vocab, block_size=16, num_classes=3, std=0.5, seed=1)
    drafter = tiny_gpt(vocab_size=vocab, block_size=16, num_classes=3, dim=16, n_layer=1, std=0.5, seed=2) if spec.startswith("sd") else None
    codebook = torch.randn(vocab, 6, generator=torch.Generator().manual_seed(5))
    sampling = SamplingConfig(temperature=1.0, top_k=vocab // 2, guidance_scale=1.5)
    rule = build_rule(spec.partition("+")[2], codebook=codebook, embeddings=model.tok_embeddings.weight)
    seen: list[tuple[int, float]] = []  # (image, brute-force TV) per verified row
    measure = TVTracker.measure

    def recording(self, target, bound, ids, num_drafts, width, drafts):
        p = target.probabilities()
        for b, d in enumerate(num_drafts.tolist()):
            for j in range(d):
                row = torch.tensor([b * width + j])
                seen.append((int(ids[b]), brute_force_tv(rule, p[row][0], drafts.dense(row, target.vocab, torch.float64)[0],
                                                         target.sampling)))
        return measure(self, target, bound, ids, num_drafts, width, drafts)

    monkeypatch.setattr(TVTracker, "measure", recording)
    batch = 6
    out = decode(model, LlamaGenCondition(class_labels=torch.arange(batch) % 3), num_tokens=16, sampling=sampling,
                 decoding=spec.partition("+")[0], acceptance=rule, drafter=drafter, generator=_gens(batch), grid_width=4)
    images = torch.tensor([image for image, _ in seen])
    tvs = torch.tensor([tv for _, tv in seen], dtype=torch.float64)
    assert images.unique().numel() == batch, "some image had no verified row: the case does not test the batch"
    want_max = torch.stack([tvs[images == b].max() for b in range(batch)])
    want_mean = torch.stack([tvs[images == b].mean() for b in range(batch)])
    assert float(want_max.max()) > 1e-3, "the case's rule does not relax"
    assert torch.allclose(out.stats.tv_max, want_max, rtol=0, atol=1e-9), (out.stats.tv_max, want_max)
    assert torch.allclose(out.stats.tv_mean, want_mean, rtol=0, atol=1e-9), (out.stats.tv_mean, want_mean)
    if spec.startswith("mc-sjd+budget"):
        assert float(out.stats.tv_max.max()) <= 0.1


# ---- the closed forms the tracker uses, on random rows ------------------------------------------------------------

def _rows(rows: int, vocab: int, seed: int, keep: int = 0, scale: float = 2.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=gen, dtype=torch.float64) * scale
    if keep:
        logits = logits.masked_fill(logits < logits.topk(keep, -1).values[:, -1:], float("-inf"))
    return logits.softmax(-1)


@pytest.mark.parametrize("k, delta", [(0, 0.1), (3, 0.1), (20, 0.05), (47, 0.3), (47, 1.0), (10, 2.0), (47, 4.0)])
def test_lantern_closed_form_equals_enumeration(k, delta):
    """LANTERN's output TV (:meth:`LanternRule.output_tv`, which reads neighbour prefixes of 16, 64, ... columns only
    for drafts a rejection can reach) equals the enumeration of every draft, for dense, top-k and one-hot drafts."""
    vocab = 48
    rule = LanternRule(AcceptanceConfig(rule="lantern", lantern_k=k, lantern_delta=delta),
                       codebook_neighbors(torch.randn(vocab, 5, generator=torch.Generator().manual_seed(k)), max(k, 1))[:, :k])
    p = _rows(24, vocab, seed=1, keep=30)
    one_hot = torch.nn.functional.one_hot(torch.randint(0, vocab, (24,), generator=torch.Generator().manual_seed(2)), vocab).double()
    for q in (_rows(24, vocab, seed=3), _rows(24, vocab, seed=4, keep=12, scale=0.5), one_hot, p):
        tv = rule.output_tv(p, q)
        want = torch.tensor([brute_force_tv(rule, p[i], q[i], SAMPLING) for i in range(24)], dtype=torch.float64)
        assert torch.allclose(tv, want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("half_width, d_thr", [(7, 0.5), (3, 6.0), (2, 100.0), (30, 6.0)])
def test_gsd_group_sums_from_sorted_ranks_equal_each_tokens_group(half_width, d_thr):
    """:meth:`GSDRule.all_group_sums` (every token's group from the sorted ranks, the embedding test from a table)
    equals :meth:`GSDRule._group_sums` of every token (the acceptance's own groups), with tied probabilities, a NaN
    embedding row (a token with no latent) and windows wider than the vocabulary; its table is the embedding test
    itself, pair by pair, at a threshold equal to some pairs' distance."""
    vocab = 40
    embeddings = torch.randn(vocab, 6, generator=torch.Generator().manual_seed(7))
    embeddings[11] = float("nan")
    rule = GSDRule(AcceptanceConfig(rule="gsd", gsd_half_width=half_width, gsd_p_thr=0.2, gsd_d_thr=d_thr), embeddings)
    p = _rows(16, vocab, seed=8, keep=25)
    p[:4] = _normalized_rows(p[:4].round(decimals=1))  # ties in the ranks
    q = _rows(16, vocab, seed=9)
    every = torch.arange(vocab).expand(16, vocab)
    for got, want in zip(rule.all_group_sums(p, q), rule._group_sums(p, q, every)):
        assert torch.allclose(got, want, rtol=0, atol=1e-14)
    a, b = torch.arange(vocab).repeat_interleave(vocab), torch.arange(vocab).repeat(vocab)
    distance = ((embeddings[b] - embeddings[a]) ** 2).sum(-1)
    for threshold in (d_thr, float(distance[distance.isfinite()][100])):
        exact = GSDRule(AcceptanceConfig(rule="gsd", gsd_d_thr=threshold), embeddings)
        assert torch.equal(exact.close_tokens(a, b), distance < threshold)


def _normalized_rows(rows: torch.Tensor) -> torch.Tensor:
    return rows / rows.sum(-1, keepdim=True)


def test_lumina_rule_is_measured_on_every_row():
    """Lumina's closed form was already per row: the tracker now feeds it every verified row (one call per pass)."""
    rule = LuminaRule(AcceptanceConfig(rule="lumina"))
    p, q = _rows(8, 12, seed=10, keep=6), _rows(8, 12, seed=11)
    want = torch.tensor([brute_force_tv(rule, p[i], q[i], SAMPLING) for i in range(8)], dtype=torch.float64)
    assert torch.allclose(rule.output_tv(p, q, SAMPLING), want, rtol=0, atol=1e-12)
