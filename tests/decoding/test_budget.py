"""The budgeted acceptance rule (vispec.decoding.budget): its construction's claims, its exactness at δ = 0, its
reports, and certification check (b): every verification of a long run stays within its budget, a check that
LANTERN's dense-draft verifications fail (the negative control).

Check (a), the per-verification output law, is a statistical test: tests/exactness/test_budget_exactness.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats
from scipy.optimize import linprog

from helpers import tiny_gpt
from vispec.decoding import DecodingConfig, decode
from vispec.decoding.acceptance import AcceptanceConfig, AcceptanceRule
from vispec.decoding.neighbors import codebook_neighbors
from vispec.decoding.rules import build_rule
from vispec.decoding.budget import BudgetRule, BudgetVerification
from vispec.models.llamagen_gpt import LlamaGenCondition
from vispec.sampling import SamplingConfig

TOL = 1e-12


def _rows(rows: int, vocab: int, seed: int, scale: float = 2.0, keep: int = 0) -> torch.Tensor:
    """Random distributions; ``keep > 0`` zeroes all but the ``keep`` largest entries (a top-k support)."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=gen, dtype=torch.float64) * scale
    if keep:
        logits = logits.masked_fill(logits < logits.topk(keep, -1).values[:, -1:], float("-inf"))
    return torch.softmax(logits, -1)


def _one_hot(rows: int, vocab: int, seed: int) -> torch.Tensor:
    tokens = torch.randint(0, vocab, (rows,), generator=torch.Generator().manual_seed(seed))
    return torch.nn.functional.one_hot(tokens, vocab).double()


def _rule(delta: float, **options) -> BudgetRule:
    return BudgetRule(AcceptanceConfig(rule="budget", budget_delta=delta, **{f"budget_{k}": v for k, v in options.items()}))


def _tv(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return 0.5 * (a - b).abs().sum(-1)


@pytest.mark.parametrize("delta", [0.0, 0.01, 0.1, 0.4, 1.0])
@pytest.mark.parametrize("draft", ["dense", "one-hot"])
@pytest.mark.parametrize("ratio", [0.0, 1.5])
def test_relaxed_target_is_a_distribution_within_budget_on_the_support(delta, draft, ratio):
    """Claims (1) and (4): p̃ is a distribution on p's support with TV(p̃, p) = moved <= δ (and p̃ <= λ p)."""
    p = _rows(256, 16, seed=1, keep=6)
    q = _rows(256, 16, seed=2, scale=1.5) if draft == "dense" else _one_hot(256, 16, seed=2)
    relaxed = _rule(delta, ratio=ratio).relax(p, q)
    p_tilde = relaxed.p_tilde
    assert float(p_tilde.min()) >= 0 and torch.allclose(p_tilde.sum(-1), torch.ones(256, dtype=torch.float64), atol=TOL)
    assert float(p_tilde[p == 0].abs().max()) == 0.0, "mass moved onto a token the sampling filters removed"
    tv = _tv(p_tilde, p)
    assert float((tv - relaxed.moved).abs().max()) < TOL
    assert float(tv.max()) <= delta + TOL
    if ratio:
        assert float((p_tilde - ratio * p).max()) <= TOL
    if delta > 0:
        assert float(tv.max()) > 0  # it does relax


@pytest.mark.parametrize("draft", ["dense", "one-hot"])
@pytest.mark.parametrize("ratio", [0.0, 1.5])
def test_acceptance_gain_is_the_optimum_of_the_linear_program(draft, ratio):
    """Claim (2): Σ min(p̃, q) = Σ min(p, q) + min(δ, E, D), and no distribution on the support within δ of p (and
    below λ p) does better (scipy's LP solver, an independent computation)."""
    vocab, delta = 7, 0.15
    p = _rows(12, vocab, seed=3, keep=5)
    q = _rows(12, vocab, seed=4, scale=1.2) if draft == "dense" else _one_hot(12, vocab, seed=4)
    relaxed = _rule(delta, ratio=ratio).relax(p, q)
    gain = torch.minimum(relaxed.p_tilde, q).sum(-1)
    for i in range(p.shape[0]):
        # variables r (V), s = min(r, q) (V), t = |r - p| (V): maximise Σ s
        pi, qi = p[i].numpy(), q[i].numpy()
        eye, zero = np.eye(vocab), np.zeros((vocab, vocab))
        a_ub = np.block([[-eye, eye, zero], [zero, eye, zero],  # s <= r, s <= q
                         [eye, zero, -eye], [-eye, zero, -eye],  # |r - p| <= t
                         [np.zeros((1, vocab)), np.zeros((1, vocab)), 0.5 * np.ones((1, vocab))]])  # Σ t / 2 <= δ
        b_ub = np.concatenate([np.zeros(vocab), qi, pi, -pi, [delta]])
        a_eq = np.concatenate([np.ones(vocab), np.zeros(2 * vocab)])[None]
        bounds = [(0, ratio * pi[v] if ratio else (None if pi[v] > 0 else 0)) for v in range(vocab)] + [(0, None)] * (2 * vocab)
        best = linprog(-np.concatenate([np.zeros(vocab), np.ones(vocab), np.zeros(vocab)]), A_ub=a_ub, b_ub=b_ub,
                       A_eq=a_eq, b_eq=[1.0], bounds=bounds, method="highs")
        assert best.status == 0
        assert abs(float(gain[i]) + best.fun) < 1e-7, f"row {i}: rule {float(gain[i]):.6f}, LP optimum {-best.fun:.6f}"
    overlap = torch.minimum(p, q).sum(-1)
    room = (ratio - 1) * p if ratio else torch.where(p > 0, 1.0, 0.0)
    excess, deficit = (p - q).clamp_min(0).sum(-1), torch.minimum((q - p).clamp_min(0), room).sum(-1)
    assert torch.allclose(gain, overlap + torch.minimum(torch.full_like(excess, delta), torch.minimum(excess, deficit)), atol=TOL)


def test_output_distribution_of_the_mechanism_is_the_relaxed_target():
    """Claim (3), in closed form: accepted mass min(p̃, q) plus the rejected mass spread as (p̃ - q)_+ is p̃."""
    rule = _rule(0.2)
    for q in (_rows(64, 12, seed=6), _one_hot(64, 12, seed=6)):
        p = _rows(64, 12, seed=5, keep=8)
        assert torch.allclose(rule.output_distribution(p, q), rule.relax(p, q).p_tilde, atol=TOL)
        assert float(rule.output_tv(p, q).max()) <= 0.2 + TOL


def test_neighbor_moves_follow_codebook_edges_and_stay_within_budget():
    vocab, k, delta = 20, 3, 0.3
    codebook = torch.randn(vocab, 4, generator=torch.Generator().manual_seed(7))
    neighbors = codebook_neighbors(codebook, k)
    rule = build_rule(AcceptanceConfig(rule="budget", budget_delta=delta, budget_neighbors=k), codebook=codebook)
    p = _rows(128, vocab, seed=8, keep=12)
    for q in (_rows(128, vocab, seed=9), _one_hot(128, vocab, seed=9)):
        relaxed = rule.relax(p, q)
        change = relaxed.p_tilde - p
        assert float(relaxed.p_tilde.min()) >= 0 and float(_tv(relaxed.p_tilde, p).max()) <= delta + TOL
        assert float(relaxed.p_tilde[p == 0].abs().max()) == 0.0
        gained, lost = change > 1e-15, change < -1e-15
        assert not bool((gained & (q <= p)).any()) and not bool((lost & (p <= q)).any())  # only deficit gains, excess loses
        assert float(torch.where(lost, relaxed.p_tilde - q, 0).min()) >= -TOL  # no source drops below q
        for r, y in gained.nonzero().tolist():  # every gaining token has a losing codebook neighbour
            assert bool(lost[r, neighbors[y]].any())
    # a one-hot draft x gains min(δ, 1 - p(x), Σ_{z ∈ N(x)} p(z)) (from its own neighbours only)
    q = _one_hot(128, vocab, seed=10)
    x = q.argmax(-1)
    reach = p.gather(-1, neighbors[x]).sum(-1)
    want = torch.where(p.gather(-1, x[:, None]).squeeze(-1) > 0,
                       torch.minimum(torch.full_like(reach, delta), torch.minimum(1 - p.gather(-1, x[:, None]).squeeze(-1), reach)), 0)
    assert torch.allclose(rule.relax(p, q).moved, want, atol=TOL)


def test_row_budgets_anneal_along_the_window_and_the_image():
    rule = _rule(0.2, decay=0.5, end=0.25)
    slots, positions = torch.tensor([0, 1, 2, 0]), torch.tensor([0, 0, 0, 9])
    want = torch.tensor([0.2, 0.1, 0.05, 0.2 * 0.25], dtype=torch.float64)
    assert torch.allclose(rule.row_budgets(slots, positions, num_tokens=10), want)
    assert torch.allclose(rule.row_budgets(slots, positions, num_tokens=None), torch.tensor([0.2, 0.1, 0.05, 0.2], dtype=torch.float64))


def test_spec_grammar_and_bad_options():
    config = DecodingConfig.parse("mc-sjd+budget:delta=0.05,decay=0.9,ratio=2,neighbors=50")
    assert config.acceptance == "budget:delta=0.05,decay=0.9,ratio=2,neighbors=50"
    assert DecodingConfig.parse(config.name) == config
    assert DecodingConfig.parse("sjd+budget").acceptance == "budget:delta=0.1"
    # errors name the spec's keys (issue 47 item 9), not the config's fields (budget_delta, ...)
    for spec, words in [("mc-sjd+budget:delta=1.5", "'budget:delta=1.5': delta must"),
                        ("mc-sjd+budget:decay=0", "'budget:decay=0': decay must"),
                        ("mc-sjd+budget:end=-1", "'budget:end=-1': end must"),
                        ("mc-sjd+budget:neighbors=-2", "'budget:neighbors=-2': neighbors must"),
                        ("mc-sjd+budget:ratio=0.5", "'budget:ratio=0.5': ratio must"),
                        ("mc-sjd+budget:k=3", "unknown option"), ("sjd-pac+budget", "exact rule only")]:
        with pytest.raises(ValueError, match=words):
            DecodingConfig.parse(spec)
    with pytest.raises(ValueError, match="codebook"):
        build_rule("budget:neighbors=4")


def _small_model():
    return tiny_gpt(vocab_size=32, block_size=64, num_classes=5, std=0.6, seed=3)


@pytest.mark.parametrize("method", ["sjd-horizontal", "sjd-random", "mc-sjd-maximal", "mc-sjd-gumbel", "sd"])
def test_zero_budget_is_the_exact_rule_token_for_token(method):
    """Claim (5), certification check (c): at δ = 0 every decoder's tokens and forward counts equal the exact rule's."""
    model = _small_model()
    condition = LlamaGenCondition(class_labels=torch.arange(5))
    sampling = SamplingConfig(temperature=1.0, top_k=20, guidance_scale=2.0)
    drafter = tiny_gpt(vocab_size=32, block_size=64, num_classes=5, dim=16, n_layer=1, std=0.6, seed=9) if method == "sd" else None
    runs = [decode(model, condition, num_tokens=48, sampling=sampling, decoding=f"{method}{rule}", drafter=drafter,
                   generator=torch.Generator().manual_seed(4)) for rule in ("", "+budget:delta=0")]
    assert torch.equal(runs[0].tokens, runs[1].tokens)
    assert torch.equal(runs[0].stats.nfe, runs[1].stats.nfe)
    assert float(runs[1].stats.extra["tv_bound"].max()) == 0.0
    relaxed = decode(model, condition, num_tokens=48, sampling=sampling, decoding=f"{method}+budget:delta=0.2", drafter=drafter,
                     generator=torch.Generator().manual_seed(4))
    assert not torch.equal(relaxed.tokens, runs[0].tokens)  # the same seeds with a budget do change tokens


def test_decoders_report_the_budget_used():
    model = _small_model()
    condition = LlamaGenCondition(class_labels=torch.arange(5))
    sampling = SamplingConfig(temperature=1.0, top_k=20, guidance_scale=2.0)
    out = decode(model, condition, num_tokens=48, sampling=sampling, decoding="mc-sjd+budget:delta=0.1,decay=0.8",
                 generator=torch.Generator().manual_seed(4))
    extra = out.stats.extra
    assert bool((extra["tv_bound"] > 0).all()) and bool((extra["tv_bound"] <= extra["tv_budget"] + TOL).all())
    assert bool((extra["verifications"] <= 47).all()) and bool((extra["verifications"] > 0).all())
    assert bool(((extra["budget_binding"] >= 0) & (extra["budget_binding"] <= 1)).all())
    assert float(out.stats.tv_max.max()) <= 0.1 + TOL
    row = out.as_dicts()[0] if hasattr(out, "as_dicts") else out.stats.per_sample()[0]
    assert {"tv_bound", "tv_budget", "budget_binding", "verifications", "tv_mean", "tv_max"} <= set(row)
    exact = decode(model, condition, num_tokens=48, sampling=sampling, decoding="mc-sjd", generator=torch.Generator().manual_seed(4))
    assert "tv_bound" not in exact.stats.extra


# ---- certification check (b): every verification of a long run, deterministically ------------------------------

class Recorder:
    """Wraps a rule's per-verification binding to keep every verification's target rows, draft distributions and
    budgets (the rows that carry a draft)."""

    def __init__(self):
        self.p, self.q, self.budget, self.tokens = [], [], [], []

    def wrap(self, rule: AcceptanceRule) -> None:
        bind = rule.for_verification

        def recording(target, drafts, slots, num_tokens):
            bound = bind(target, drafts, slots, num_tokens)
            rows = ((drafts.tokens >= 0) & (target.row_sample >= 0)).nonzero().squeeze(1)
            p = target.probabilities()[rows]
            self.p.append(p.double())
            self.q.append(drafts.dense(rows, target.vocab, torch.float64))
            self.tokens.append(drafts.tokens[rows])
            if hasattr(bound, "relaxation"):
                self.budget.append(bound.relaxation.budget)
            else:
                self.budget.append(torch.full((rows.numel(),), rule.config.lantern_delta, dtype=torch.float64))
            return bound

        rule.for_verification = recording

    def rows(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return torch.cat(self.p), torch.cat(self.q), torch.cat(self.budget)


def budget_violations(rule: AcceptanceRule, p: torch.Tensor, q: torch.Tensor, budget: torch.Tensor) -> tuple[int, float]:
    """Check (b): ``(rows whose output TV exceeds their budget, the worst excess)`` by each rule's closed-form output
    distribution (budget rows: :meth:`BudgetRule.output_tv` at the row's own budget)."""
    tv = torch.cat([rule.output_tv(p[i:i + 512], q[i:i + 512], budget[i:i + 512]) if isinstance(rule, BudgetRule)
                    else rule.output_tv(p[i:i + 512], q[i:i + 512]) for i in range(0, p.shape[0], 512)])
    excess = tv - budget
    return int((excess > TOL).sum()), float(excess.max())


@pytest.fixture(scope="module")
def tiny_c2i():
    from vispec.pipelines import LlamaGenPipeline

    pipe = LlamaGenPipeline.from_pretrained("vispec/tiny-c2i")
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _long_run(pipe, spec: str, recorder: Recorder) -> int:
    """Two whole tiny-c2i images (256 tokens each) with ``spec``; returns the verifications recorded."""
    rule = build_rule(DecodingConfig.parse(spec).acceptance, codebook=pipe.codebook)
    recorder.wrap(rule)
    pipe(class_labels=[3, 12], decoding=spec, acceptance=rule, generator=[torch.Generator().manual_seed(s) for s in range(2)],
         output_type="latent")
    return sum(p.shape[0] for p in recorder.p)


@pytest.mark.parametrize("spec", ["mc-sjd+budget:delta=0.1", "mc-sjd+budget:delta=0.3,decay=0.8,end=0.5,ratio=2",
                                  "sjd+budget:delta=0.05,neighbors=16"])
def test_every_verification_of_a_long_run_stays_within_its_budget(tiny_c2i, spec):
    recorder = Recorder()
    count = _long_run(tiny_c2i, spec, recorder)
    p, q, budget = recorder.rows()
    rule = build_rule(DecodingConfig.parse(spec).acceptance, codebook=tiny_c2i.codebook)
    violations, worst = budget_violations(rule, p, q, budget)
    dense = int((q.max(-1).values < 1).sum())
    print(f"\n{spec}: {count} verifications ({dense} with dense drafts), {violations} over budget, worst excess {worst:.2e}")
    assert count > 800 and dense > 100
    assert violations == 0, f"{violations} verifications exceed their budget (worst by {worst:.3g})"


def test_negative_control_lantern_at_dense_drafts_fails_the_budget_check(tiny_c2i):
    recorder = Recorder()
    spec = "mc-sjd+lantern:k=20,delta=0.1"
    _long_run(tiny_c2i, spec, recorder)
    p, q, budget = recorder.rows()
    rule = build_rule(DecodingConfig.parse(spec).acceptance, codebook=tiny_c2i.codebook)
    violations, worst = budget_violations(rule, p, q, budget)
    print(f"\n{spec}: {violations} of {p.shape[0]} verifications over δ = 0.1, worst by {worst:.3f}")
    assert violations > 0, "the budget check cannot tell LANTERN's unbounded dense-draft verifications apart"


# ---- the drafts a verification tests are distributed as the q it tests them with -------------------------------

def randomized_pit(q: torch.Tensor, tokens: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """``F_q(x-) + V q(x)`` per row, ``V ~ U(0, 1)``: uniform on (0, 1) exactly when each draft ``x`` is drawn from
    its row's ``q`` given everything before (a probability integral transform for discrete laws)."""
    before = q.cumsum(-1).gather(-1, tokens[:, None]).squeeze(-1) - q.gather(-1, tokens[:, None]).squeeze(-1)
    jitter = torch.rand(tokens.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return before + jitter * q.gather(-1, tokens[:, None]).squeeze(-1)


def _drafts_pit(spec: str, monkeypatch=None) -> tuple[float, int]:
    model = _small_model()
    recorder = Recorder()
    rule = build_rule(DecodingConfig.parse(spec).acceptance)
    recorder.wrap(rule)
    condition = LlamaGenCondition(class_labels=torch.arange(5).repeat(4))
    decode(model, condition, num_tokens=48, sampling=SamplingConfig(temperature=1.0, top_k=20, guidance_scale=2.0),
           decoding=spec, acceptance=rule, generator=torch.Generator().manual_seed(6))
    q, tokens = torch.cat(recorder.q), torch.cat(recorder.tokens)
    dense = q.max(-1).values < 1
    u = randomized_pit(q[dense], tokens[dense])
    return float(stats.kstest(u.numpy(), "uniform").pvalue), int(dense.sum())


@pytest.mark.parametrize("spec", ["mc-sjd+budget:delta=0.3", "sjd+budget:delta=0.3", "mc-sjd-gumbel+budget:delta=0.3"])
def test_drafts_follow_the_distribution_they_are_verified_with(spec):
    """The exactness of each verification (claim 3) needs the draft to be drawn from the q it is tested with: MC-SJD's
    maximal coupling keeps a row's coupled output, distributed as p̃, so p̃ must be stored as the next q.
    Kolmogorov-Smirnov test of the drafts' randomized PIT under their q against U(0, 1)."""
    p_value, count = _drafts_pit(spec)
    print(f"\n{spec}: {count} dense drafts, KS p = {p_value:.3f}")
    assert count > 1500 and p_value > 1e-3


def test_negative_control_storing_p_as_the_next_q_fails_the_draft_check(monkeypatch):
    monkeypatch.setattr(BudgetVerification, "store_relaxed", lambda self, rows, out: None)
    p_value, count = _drafts_pit("mc-sjd+budget:delta=0.3")
    print(f"\nnegative control (P stored as the next q): {count} dense drafts, KS p = {p_value:.2e}")
    assert p_value < 1e-3


def test_compiled_residual_noise_is_the_eager_noise():
    """Every lossy rule samples its residual with :meth:`Target.race_noise`. Inside a compiled step that goes through
    the opaque keyed-noise op, as the exact rule's kernels do: inductor's own Philox (int64 overflow) drew other
    noise, so compiled LANTERN, GSD and budgeted decodes gave other tokens than eager ones."""
    from vispec.kernels.philox import Stream
    from vispec.kernels.target import window_target

    gen = torch.Generator().manual_seed(0)
    cond = torch.randn(2, 3, 32, generator=gen)
    positions = torch.arange(3).expand(2, 3) + 5
    target = window_target(cond, None, positions, torch.tensor([3, 2]), torch.tensor([2**40 + 7, 11]), SamplingConfig())
    rows = torch.tensor([0, 2, 4])
    stream, draws = torch.full_like(rows, int(Stream.RESIDUAL)), torch.tensor([1, 9, 2**33])
    compiled = torch.compile(lambda r, s, d: target.race_noise(r, s, d), dynamic=False)
    assert torch.equal(compiled(rows, stream, draws), target.race_noise(rows, stream, draws))
