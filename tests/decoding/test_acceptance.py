"""Relaxed acceptance rules (LANTERN, GSD) and draft-model decoding: behaviour, bounds and errors.

Exactness of the rules at their exact settings (LANTERN k = 0 or δ = 0, GSD groups of one) and of
draft-model SD is certified by the joint-distribution test in tests/exactness/test_exactness.py.
"""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import tiny_gpt
from vispec.decoding import decode
from vispec.decoding.acceptance import AcceptanceConfig, AcceptanceRule, GSDRule, LanternRule, spec_number
from vispec.decoding.neighbors import codebook_neighbors
from vispec.decoding.rules import build_rule
from vispec.models.llamagen_gpt import LlamaGenCondition
from vispec.sampling import SamplingConfig


def _random_rows(rows: int, vocab: int, seed: int, scale: float = 2.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(rows, vocab, generator=gen, dtype=torch.float64) * scale, -1)


class IgnoresBudget(LanternRule):
    """Deliberately broken: absorbs all k neighbours whatever their mass (no TV budget)."""

    def _absorbed(self, p, tokens):
        neighbors, absorbed, _ = super()._absorbed(p, tokens)
        everything = torch.ones_like(absorbed)
        mass = p.gather(-1, neighbors.flatten(1)).view(neighbors.shape).sum(-1)
        return neighbors, everything, mass

    def _absorbed_prefix(self, p, r, x, p_at, q_at):  # the closed form's prefixes (output_tv): all k as well
        neighbors = self.neighbors.to(p.device)[x]
        return torch.full_like(r, neighbors.shape[1]), p[r[:, None], neighbors].sum(-1)


@pytest.mark.parametrize("delta", [0.02, 0.1, 0.3])
def test_lantern_tv_stays_within_the_budget_for_initialised_drafts(delta):
    """With one-hot drafts (SJD's initialised drafts, LANTERN's deterministic tree drafts) a verification
    outputs p with the absorbed mass moved onto the draft: TV = c_J <= δ."""
    vocab, k = 24, 6
    p = _random_rows(64, vocab, seed=1)
    codebook = torch.randn(vocab, 4, generator=torch.Generator().manual_seed(2))
    drafts = torch.randint(0, vocab, (64,), generator=torch.Generator().manual_seed(3))
    q = torch.nn.functional.one_hot(drafts, vocab).double()
    config = AcceptanceConfig(rule="lantern", lantern_k=k, lantern_delta=delta)
    neighbors = codebook_neighbors(codebook, k)
    tv = LanternRule(config, neighbors).output_tv(p, q)
    assert float(tv.max()) <= delta + 1e-12
    assert float(tv.max()) > 0  # the rule does relax
    broken = IgnoresBudget(config, neighbors).output_tv(p, q)  # negative control: the same check fails
    assert float(broken.max()) > delta


def test_output_tv_closed_form_matches_simulation():
    """The closed-form output distribution of one verification equals a Monte Carlo estimate."""
    vocab = 8
    gen = torch.Generator().manual_seed(0)
    p = _random_rows(1, vocab, seed=4, scale=1.5)
    codebook = torch.randn(vocab, 3, generator=gen)
    rules = [LanternRule(AcceptanceConfig(rule="lantern", lantern_k=4, lantern_delta=0.2), codebook_neighbors(codebook, 4)),
             GSDRule(AcceptanceConfig(rule="gsd", gsd_half_width=2, gsd_d_thr=100.0, gsd_p_thr=0.3), codebook)]
    for q in (_random_rows(1, vocab, seed=5, scale=1.5), torch.nn.functional.one_hot(torch.tensor([3]), vocab).double()):
        for rule in rules:
            n = 200_000
            drafts = torch.multinomial(q[0], n, replacement=True, generator=gen)
            P, Q = p.expand(n, vocab), q.expand(n, vocab)
            accepted = rule.accept(P, drafts, Q, torch.rand(n, generator=gen, dtype=torch.float64))
            weights = rule.residual_weights(P[~accepted], drafts[~accepted], Q[~accepted])
            out = drafts.clone()
            out[~accepted] = (weights / torch.empty_like(weights).exponential_(generator=gen)).argmax(-1)
            empirical = torch.bincount(out, minlength=vocab).double() / n
            tv_sim = 0.5 * float((empirical - p[0]).abs().sum())
            assert abs(tv_sim - float(rule.output_tv(p, q))) < 0.01, type(rule).__name__


def test_exact_settings_have_zero_output_tv():
    vocab = 16
    p, q = _random_rows(8, vocab, seed=6), _random_rows(8, vocab, seed=7)
    codebook = torch.randn(vocab, 4, generator=torch.Generator().manual_seed(8))
    for rule in (AcceptanceRule(), build_rule("lantern:k=0", codebook=codebook), build_rule("lantern:k=5,delta=0", codebook=codebook),
                 build_rule("gsd:d_thr=0", embeddings=codebook)):
        assert float(rule.output_tv(p, q).max()) < 1e-12


def test_lantern_relaxed_probability_and_lambda_mode():
    p = torch.tensor([[0.30, 0.05, 0.04, 0.20, 0.41]], dtype=torch.float64)
    neighbors = torch.tensor([[1, 2, 3, 4], [0, 2, 3, 4], [1, 0, 3, 4], [4, 0, 1, 2], [3, 0, 1, 2]])
    tokens = torch.tensor([[0]])
    tv_rule = LanternRule(AcceptanceConfig(rule="lantern", lantern_k=3, lantern_delta=0.1), neighbors)
    assert torch.allclose(tv_rule.relaxed_probability(p, tokens), torch.tensor([[0.39]], dtype=torch.float64))  # 0.05 + 0.04
    ratio_rule = LanternRule(AcceptanceConfig(rule="lantern", lantern_k=3, lantern_delta=1.2), neighbors)  # λ = 1.2
    assert torch.allclose(ratio_rule.relaxed_probability(p, tokens), torch.tensor([[0.35]], dtype=torch.float64))  # c ≤ 0.2 p
    # on rejection, the draft and the absorbed neighbours are zeroed before the residual
    weights = tv_rule.residual_weights(p, torch.tensor([0]), torch.nn.functional.one_hot(torch.tensor([0]), 5).double())
    assert torch.equal(weights[0, :3], torch.zeros(3, dtype=torch.float64)) and bool((weights[0, 3:] > 0).all())


def test_a_token_without_latent_is_never_relaxed_into():
    """A unified vocabulary's end-of-row token has no VQ latent (a NaN codebook / embedding row): it is nobody's
    neighbour, its own neighbours are itself, and no relaxed rule keeps it where the target gives it no mass.
    Negative control: a far-away finite row (the former stand-in) still gives it the nearest codes as
    neighbours, so LANTERN kept an end of row inside an image row."""
    vocab, eol = 12, 11
    gen = torch.Generator().manual_seed(10)
    codes = torch.randn(vocab - 1, 3, generator=gen)
    codebook = torch.cat([codes, torch.full((1, 3), float("nan"))])
    table = codebook_neighbors(codebook, 4)
    assert torch.equal(table[eol], torch.full((4,), eol)) and not bool((table[:eol] == eol).any())
    p = _random_rows(6, vocab, seed=11)
    p[:, eol] = 0.0
    p = p / p.sum(-1, keepdim=True)
    drafts = torch.full((6,), eol)
    q = torch.nn.functional.one_hot(drafts, vocab).double()
    for spec in ("lantern:k=4,delta=0.5", "lantern:k=4,delta=3"):
        rule = build_rule(spec, codebook=codebook)
        assert float(rule.relaxed_probability(p, drafts[:, None]).max()) == 0.0, spec
        assert not bool(rule.accept(p, drafts, q, torch.full((6,), 1e-9, dtype=torch.float64)).any()), spec
    gsd = build_rule("gsd:d_thr=1e9,p_thr=1", embeddings=codebook)
    assert not bool(gsd.accept(p, drafts, q, torch.full((6,), 1e-9, dtype=torch.float64)).any())
    far = build_rule("lantern:k=4,delta=0.5", codebook=torch.cat([codes, torch.full((1, 3), 1e4)]))
    assert float(far.relaxed_probability(p, drafts[:, None]).min()) > 0.0


def test_gsd_window_is_clamped_at_the_vocabulary_edges():
    p = _random_rows(3, 10, seed=9)
    rule = GSDRule(AcceptanceConfig(rule="gsd", gsd_half_width=4, gsd_p_thr=1.0, gsd_d_thr=1e9), torch.randn(10, 2))
    lowest = p.argmin(-1, keepdim=True)  # rank 0: the window may not wrap around to the top ranks
    members, member = rule.groups(p, lowest)
    ranks = p.argsort(-1).argsort(-1).gather(-1, members.flatten(1)).view(members.shape)
    assert bool((ranks[member] < 4).all())


def test_decoders_report_tv_for_lossy_rules_only():
    model = tiny_gpt(vocab_size=16, block_size=16, std=0.6)
    codebook = torch.randn(16, 4, generator=torch.Generator().manual_seed(0))
    condition = LlamaGenCondition(class_labels=torch.tensor([0, 1]))
    sampling = SamplingConfig(guidance_scale=2.0)
    exact = decode(model, condition, num_tokens=16, sampling=sampling, decoding="mc-sjd", generator=torch.Generator().manual_seed(0))
    assert exact.stats.tv_mean is None
    lossy = decode(model, condition, num_tokens=16, sampling=sampling, decoding="mc-sjd", acceptance="lantern:k=5,delta=0.2",
                   codebook=codebook, generator=torch.Generator().manual_seed(0))
    assert lossy.method.endswith("+lantern:k=5,delta=0.2")
    assert bool((lossy.stats.tv_mean >= 0).all()) and bool((lossy.stats.tv_max >= lossy.stats.tv_mean).all())


def test_draft_model_decoding_is_independent_of_the_batch():
    model = tiny_gpt(vocab_size=16, block_size=16, std=0.6)
    drafter = tiny_gpt(vocab_size=16, block_size=16, std=0.6, seed=5, dim=16, n_layer=1)
    sampling = SamplingConfig(guidance_scale=2.0, temperature=0.9, top_k=10)
    labels = torch.tensor([0, 1, 2, 1])
    batch = decode(model, LlamaGenCondition(class_labels=labels), num_tokens=16, sampling=sampling, decoding="sd:window=4",
                   drafter=drafter, generator=[torch.Generator().manual_seed(i) for i in range(4)])
    for i in (0, 3):
        alone = decode(model, LlamaGenCondition(class_labels=labels[i : i + 1]), num_tokens=16, sampling=sampling,
                       decoding="sd:window=4", drafter=drafter, generator=[torch.Generator().manual_seed(i)])
        assert torch.equal(alone.tokens[0], batch.tokens[i])
    assert bool((batch.stats.extra["drafter_nfe"] > 0).all()) and batch.method == "sd:window=4"


def test_bad_input_names_the_argument():
    codebook = torch.randn(16, 4)
    with pytest.raises(ValueError, match="lantern_k"):
        AcceptanceConfig(rule="lantern", lantern_k=-1)
    with pytest.raises(ValueError, match="'lantern': k=16 exceeds"):  # the spec's words (issue 47 item 9)
        build_rule("lantern:k=16", codebook=codebook)
    with pytest.raises(ValueError, match="'lantern:delta=-0.1': delta must be"):
        AcceptanceConfig.parse("lantern:delta=-0.1")
    with pytest.raises(ValueError, match="codebook"):
        build_rule("lantern")
    with pytest.raises(ValueError, match="acceptance rule"):
        AcceptanceConfig.parse("fancy")
    with pytest.raises(ValueError, match="unknown option"):
        AcceptanceConfig.parse("lantern:size=3")
    with pytest.raises(ValueError, match="embeddings"):
        build_rule("gsd")
    model = tiny_gpt(vocab_size=16, block_size=16)
    condition = LlamaGenCondition(class_labels=torch.tensor([0]))
    with pytest.raises(ValueError, match="drafter"):
        decode(model, condition, num_tokens=16, decoding="sd")
    with pytest.raises(ValueError, match="speculative decoder"):
        decode(model, condition, num_tokens=16, decoding="ar", acceptance="gsd")
    with pytest.raises(ValueError, match="vocabulary"):
        decode(model, condition, num_tokens=16, decoding="sd", drafter=tiny_gpt(vocab_size=8, block_size=16))


# ---- issue 47 items 5, 6, 9: a spec's name round-trips every legal value; errors name the spec's keys ----------
_UNIT = st.floats(min_value=0, max_value=1, allow_nan=False)
_CONFIGS = st.one_of(
    st.builds(lambda d, decay, end, ratio, k: AcceptanceConfig(rule="budget", budget_delta=d, budget_decay=decay,
                                                              budget_end=end, budget_ratio=ratio, budget_neighbors=k),
              _UNIT, st.floats(min_value=1e-12, max_value=1, allow_nan=False), _UNIT,
              st.one_of(st.just(0.0), st.floats(min_value=1, max_value=1e12, allow_nan=False)),
              st.integers(min_value=0, max_value=10**12)),
    st.builds(lambda k, d, n: AcceptanceConfig(rule="lantern", lantern_k=k, lantern_delta=d, lantern_normalize=n),
              st.integers(min_value=0, max_value=10**9), st.floats(min_value=0, max_value=1e6, allow_nan=False),
              st.booleans()),
    st.builds(lambda h, p, d: AcceptanceConfig(rule="gsd", gsd_half_width=h, gsd_p_thr=p, gsd_d_thr=d),
              st.integers(min_value=1, max_value=10**6), _UNIT, st.floats(min_value=0, max_value=1e6, allow_nan=False)),
    st.builds(lambda q, r: AcceptanceConfig(rule="lumina", lumina_q_clamp=q, lumina_reprocess=r), _UNIT, st.booleans()))


@settings(max_examples=200, deadline=None)
@given(config=_CONFIGS)
def test_a_rule_name_parses_back_to_the_same_config(config):
    assert AcceptanceConfig.parse(config.name) == config, config.name


def test_numbers_keep_their_value_in_a_name():
    assert AcceptanceConfig.parse("budget:neighbors=1000000").name == "budget:delta=0.1,neighbors=1000000"
    assert AcceptanceConfig.parse("budget:delta=0.123456789").budget_delta == 0.123456789
    assert AcceptanceConfig.parse(AcceptanceConfig.parse("budget:delta=0.123456789").name).budget_delta == 0.123456789
    assert [spec_number(v) for v in (0.1, 3, 1e-07, 0.123456789, 2.0)] == ["0.1", "3", "1e-07", "0.123456789", "2"]


@pytest.mark.parametrize("spec, words", [("budget:delta=2", "acceptance 'budget:delta=2': delta must be a finite number in"),
                                         ("budget:ratio=0.5", "ratio must be 0 (no cap)"),
                                         ("lantern:k=-1", "'lantern:k=-1': k must be an integer")])
def test_errors_name_the_specs_keys(spec, words):
    with pytest.raises(ValueError, match=re.escape(words)) as info:
        AcceptanceConfig.parse(spec)
    assert "budget_" not in str(info.value) and "lantern_" not in str(info.value)


def test_too_many_neighbours_are_refused_naming_the_rules_key():
    codebook = torch.randn(16, 4)
    with pytest.raises(ValueError, match=re.escape("acceptance 'budget': neighbors=2000 exceeds the 15 neighbours")):
        build_rule("budget:neighbors=2000", codebook=codebook)
    with pytest.raises(ValueError, match=re.escape("acceptance 'lantern': k=16 exceeds the 15 neighbours")):
        build_rule("lantern:k=16", codebook=codebook)
