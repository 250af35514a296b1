"""Certification check (a) of the budgeted acceptance rule (vispec.decoding.budget): one verification's output is
distributed exactly as the relaxed target p̃, through the decoders' own verification (verify_window, the target's
keyed noise), for dense and one-hot drafts, with window and image annealing and with codebook neighbours.

Targets and drafts come from a tiny random GPT, enumerated: ``p`` is the processed target of position 1 after one
prefix token, ``q`` the target of the same position after another (a draft made on a stale prefix, as Jacobi and
MC-SJD drafts are). Each trial is one sample of a batch: a window of one draft ``x ~ q`` and its bonus row, with
its own seed. The outputs of the verification row are tested against p̃ with the G-test (log-likelihood ratio),
``n`` chosen for power 0.99 against TV 0.03 at level 1e-3 (tests/chi_square.py); cells expected below 5 pooled.

Negative control: the same test rejects a verification whose rejected rows resample p̃ itself instead of
``(p̃ - q)_+`` (so accepted drafts are counted twice).
"""

from __future__ import annotations

import pytest
import torch
from scipy import stats

import vispec.decoding.budget as budget_module
from chi_square import ALPHA, pooled_cells, required_samples
from helpers import exact_conditionals, tiny_gpt
from vispec.decoding.rules import build_rule
from vispec.decoding.speculative import MAXIMAL, verify_window
from vispec.kernels.target import window_target
from vispec.sampling import SamplingConfig

pytestmark = pytest.mark.slow

VOCAB = 12
SAMPLING = SamplingConfig(temperature=1.0, top_k=8, guidance_scale=2.0)
CODEBOOK = torch.randn(VOCAB, 3, generator=torch.Generator().manual_seed(5))
POSITION, NUM_TOKENS = 5, 8  # the verified image position, of an image of 8 tokens (image annealing)


@pytest.fixture(scope="module")
def targets():
    """``(p, q)``: position 1's target after two prefix tokens, the first pair (in token order) whose targets are
    0.3 to 0.7 apart in TV: a draft far enough from the target to relax, near enough to be accepted often."""
    model = tiny_gpt(vocab_size=VOCAB, block_size=4, num_classes=3, std=0.5, seed=2)
    seqs, conditionals = exact_conditionals(model, 1, 2, SAMPLING)
    after = conditionals[seqs[:, 1] == 0][:, 1]  # [V, V]: position 1's target after each first token
    for a in range(VOCAB):
        for b in range(VOCAB):
            if 0.3 < 0.5 * float((after[a] - after[b]).abs().sum()) < 0.7:
                return after[a], after[b]
    raise AssertionError("no pair of prefixes gives targets 0.3 to 0.7 apart")


def verify_many(rule, p: torch.Tensor, q: torch.Tensor, n: int, seed: int, slot: int) -> torch.Tensor:
    """``n`` independent verifications of a draft ``x ~ q`` against ``p`` in window row ``slot``: the outputs ``[n]``."""
    gen = torch.Generator().manual_seed(seed)
    width = slot + 2  # rows 0 .. slot - 1 carry accepted drafts (q = p, one-hot at a sure token is not needed)
    logits = torch.where(p > 0, p.log(), torch.full_like(p, float("-inf"))).float()
    cond = logits.expand(n, width, VOCAB).clone()
    drafts = torch.full((n, width), -1, dtype=torch.long)
    drafts[:, slot] = torch.multinomial(q.float(), n, replacement=True, generator=gen)
    dense_q = torch.zeros(n, width, VOCAB)
    dense_q[:, slot] = q.float()
    if slot:  # earlier rows: drafts that are always kept (q = p, drawn from p: accepted with probability 1)
        drafts[:, :slot] = torch.multinomial(p.float(), n * slot, replacement=True, generator=gen).view(n, slot)
        dense_q[:, :slot] = p.float()
    positions = POSITION - slot + torch.arange(width).expand(n, width)
    seeds = torch.randint(0, 2**62, (n,), generator=gen)
    plain = SamplingConfig(temperature=1.0)  # p is already processed
    target = window_target(cond, None, positions, torch.full((n,), width), seeds, plain, validate=False)
    num_drafts = torch.full((n,), slot + 1)
    verified = verify_window(target, rule, drafts, num_drafts, torch.full((n,), width), torch.ones(n, dtype=torch.long),
                             MAXIMAL, q=dense_q, q_dense=torch.ones(n, width, dtype=torch.bool), num_tokens=NUM_TOKENS)
    assert bool((verified.num_accepted >= slot).all()), "the earlier rows must keep their drafts"
    return verified.coupled[:, slot]


def g_test(outputs: torch.Tensor, law: torch.Tensor) -> tuple[float, float, float]:
    """``(G, p-value, empirical TV)`` of ``outputs`` against ``law``; a token outside ``law``'s support is a failure."""
    n = outputs.numel()
    counts = torch.bincount(outputs, minlength=VOCAB).double()
    assert float(counts[law == 0].sum()) == 0, "a verification output a token outside the relaxed target's support"
    counts, law = counts[law > 0], law[law > 0]
    ids = pooled_cells(law * n)
    cells = int(ids.max()) + 1
    observed = torch.zeros(cells, dtype=torch.float64).index_add_(0, ids, counts)
    expected = torch.zeros(cells, dtype=torch.float64).index_add_(0, ids, law * n)
    statistic, p_value = stats.power_divergence(observed.numpy(), expected.numpy(), lambda_="log-likelihood")
    return float(statistic), float(p_value), 0.5 * float((counts / n - law).abs().sum())


CASES = [  # (rule, draft, window row)
    ("budget:delta=0.1", "dense", 0),
    ("budget:delta=0.3", "one-hot", 0),
    ("budget:delta=0.4,decay=0.5,end=0.5", "dense", 2),
    ("budget:delta=0.3,neighbors=3", "dense", 0),
    ("budget:delta=0.3,ratio=10", "dense", 1),
]


def _case(targets, rule_name: str, draft: str, slot: int):
    p, q = targets
    if draft == "one-hot":  # the draft the stale target likes most, for certain
        q = torch.nn.functional.one_hot(q.argmax(), VOCAB).double()
    rule = build_rule(rule_name, codebook=CODEBOOK)
    budget = rule.row_budgets(torch.tensor([slot]), torch.tensor([POSITION]), NUM_TOKENS)
    relaxed = rule.relax(p[None], q[None], budget)
    return rule, p, q, relaxed


@pytest.mark.parametrize("rule_name,draft,slot", CASES)
def test_one_verification_outputs_the_relaxed_target(targets, rule_name, draft, slot):
    rule, p, q, relaxed = _case(targets, rule_name, draft, slot)
    law = relaxed.p_tilde[0]
    assert float(relaxed.moved[0]) > 0.02, "the case must actually relax"
    n = required_samples(law)
    outputs = verify_many(rule, p, q, n, seed=11, slot=slot)
    statistic, p_value, tv = g_test(outputs, law)
    tv_p = 0.5 * float((torch.bincount(outputs, minlength=VOCAB).double() / n - p).abs().sum())
    print(f"\n{rule_name} ({draft}, row {slot}): budget {float(relaxed.budget[0]):.3f}, moved {float(relaxed.moved[0]):.3f}; "
          f"n={n} G={statistic:.1f} p={p_value:.3f}; empirical TV from p̃ {tv:.4f}, from p {tv_p:.4f}")
    assert p_value > ALPHA, f"the output deviates from p̃ (p={p_value:.2e}, TV {tv:.4f})"
    if float(relaxed.moved[0]) >= 0.03:  # the same outputs tell p̃ from p: the rule did relax, and the test can see it
        assert g_test(outputs, p)[1] < ALPHA


def test_negative_control_resampling_the_relaxed_target_fails(targets, monkeypatch):
    rule, p, q, relaxed = _case(targets, "budget:delta=0.1", "dense", 0)
    law = relaxed.p_tilde[0]
    monkeypatch.setattr(budget_module.verify, "residual_weights", lambda p_tilde, q: p_tilde.clone())
    n = required_samples(law)
    outputs = verify_many(rule, p, q, n, seed=11, slot=0)
    statistic, p_value, tv = g_test(outputs, law)
    print(f"\nnegative control (rejections resample p̃): n={n} G={statistic:.1f} p={p_value:.2e} TV {tv:.4f}")
    assert p_value < ALPHA, "the G-test failed to detect a wrong residual"
