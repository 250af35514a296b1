"""The budgeted acceptance rule: relaxed verification whose output is never more than ``δ`` from the target.

A relaxed rule trades exactness for acceptance. LANTERN (:class:`~vispec.decoding.acceptance.LanternRule`) moves
mass onto the *sampled* draft, so its output depends on the draft and, for dense drafts (MC-SJD, draft models),
its distance from the target is not bounded by its ``δ`` (measured 0.34 at ``δ = 0.1`` on tiny-c2i). This rule
relaxes the *target* instead, before the draft is looked at, and then verifies exactly.

**Construction.** For one verification, with ``p`` the target (after temperature, top-k and top-p: its support
``S = {y : p(y) > 0}``), ``q`` the draft distribution (one-hot for an initialised draft) and a budget ``δ``::

    e = (p - q)_+                     excess of the target, E = Σ e
    d = min((q - p)_+, (λ - 1) p)     deficit inside the allowed support (p = 0 outside S), D = Σ d
    m = min(δ, E, D)                  the mass moved
    p̃ = p + m d / D - m e / E         (p̃ = p where m = 0)

with ``λ`` the optional ratio cap (``ratio``; none by default, ``λ = ∞``: ``d = (q - p)_+`` on ``S``), which keeps
``p̃ <= λ p``: no token's probability grows more than ``λ``-fold (LANTERN++'s closeness, here within the budget).

Then the draft ``x ~ q`` is kept iff ``u q(x) < p̃(x)``, and a rejection samples ``(p̃ - q)_+`` (speculative
sampling against ``p̃``; Leviathan et al. 2023, Theorem 1).

**Claims.** (1) ``p̃`` is a distribution on ``S`` with ``TV(p̃, p) = m <= δ`` and ``p̃ <= λ p``. (2) Among all
distributions ``r`` with ``TV(r, p) <= δ`` and ``r <= λ p`` (``r = 0`` outside ``S`` without a cap), ``p̃`` maximises the acceptance probability ``Σ min(r, q)``, which is
``Σ min(p, q) + min(δ, E, D)``. (3) One verification outputs exactly ``p̃``, whatever ``q`` is: the output's TV
from ``p`` is ``m <= δ`` for every draft distribution, dense or one-hot. (4) No token outside ``S`` is ever
output (``p̃`` and ``(p̃ - q)_+`` vanish there): the sampling filters are kept. (5) ``δ = 0`` is the exact rule.

**Proof.** (1) ``e`` and ``d`` live on disjoint tokens, ``m <= E`` and ``m <= D``: on excess tokens
``p̃ = p - m e / E >= p - e = q >= 0``; on deficit tokens ``p̃ = p + m d / D <= p + d <= min(q, λ p)``;
elsewhere ``p̃ = p``.
The mass added equals the mass removed (``m``), so ``Σ p̃ = 1`` and ``TV = m``; ``d = 0`` outside ``S``.
(2) Upper bound: for any ``r``, ``min(r, q) <= min(p, q) + (r - p)_+``, so ``Σ min(r, q) <= Σ min(p, q) + TV(r, p)
<= Σ min(p, q) + δ``; where ``q > p``, ``min(r, q) <= min(q, λ p) = p + d`` (``r = 0`` outside ``S``), so
``Σ min(r, q) <= Σ min(p, q) + D``; and ``Σ min(r, q) <= 1 = Σ min(p, q) + E``. Attained: on excess tokens
``p̃ >= q`` keeps ``min(p̃, q) = q = min(p, q)``; on deficit tokens ``min(p̃, q) = p̃ = p + m d / D``, a gain
of ``m`` in total. (3) Speculative sampling with acceptance ``min(1, p̃(x) / q(x))`` and residual
``(p̃ - q)_+`` outputs ``p̃`` exactly; ``p̃`` is a function of ``(p, q, δ)``, fixed before the draft is drawn,
so the argument holds as for the exact rule. It needs the draft to be drawn from the ``q`` it is tested with:
SJD's next drafts are fresh samples of ``p`` (stored ``q = p``), but MC-SJD's maximal coupling keeps each draft
row's coupled output, distributed as ``p̃``, as the next draft, so ``p̃`` is stored as its ``q``
(:meth:`BudgetVerification.store_relaxed`; storing ``p`` instead biases the next verification, a negative control
of tests/decoding/test_budget.py). (4), (5): ``p̃ = p`` when ``m = 0``.

**A whole image.** Building a coupling position by position, the law of the image is within
``E[Σ_t m_t] <= Σ_t δ_t`` of the AR law in total variation (the chain rule for TV), ``m_t`` being the mass moved
by the verification that decided position ``t``. Decoders report, per image, ``tv_bound = Σ_t m_t`` (its
expectation bounds the joint TV; it is capped at 1 only in reading), ``tv_budget = Σ_t δ_t`` (the worst case)
and ``budget_binding``, the share of those verifications where ``δ_t < min(E, D)`` (the budget, not the draft,
limited the move).

**Annealing** (COOL-SD, Li et al., AAAI 2026, arXiv 2601.09212: a relaxation that decreases along the window
moves the output less than a uniform one at the same speed). The budget of a verification is
``δ_t = δ decay^j (1 + (end - 1) t / (N - 1))`` for window row ``j`` (the ``j``-th draft of the window) and image
position ``t`` of ``N``. Both are fixed before the draft is drawn, so (3) holds per verification.

**Codebook neighbours** (``neighbors = k > 0``): mass may reach a deficit token ``y`` only from the ``k`` codebook
entries nearest to ``y`` (``N_k(y)``), so the output stays perceptually close to the target. The moves are a
proportional flow: ``y`` asks each ``z ∈ N_k(y)`` for ``a(y, z) = d(y) e(z) / Σ_{N_k(y)} e``; each ``z`` grants
``min(1, e(z) / A(z))`` of what it is asked in total (``A(z)``); all flows are then scaled by
``min(1, δ / F)`` (``F``, the total granted). Claims (1) and (3)-(5) hold as above (inflows stay within ``d``,
outflows within ``e``); (2) does not: a maximum flow along the same edges could move more.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from vispec.decoding.acceptance import AcceptanceConfig, AcceptanceRule
from vispec.kernels import verify
from vispec.kernels.target import Target
from vispec.kernels.verify import Drafts


@dataclass
class Relaxation:
    """One verification's relaxed targets, per row (float64): ``p_tilde [R, V]``, the mass ``moved [R]``
    (``= TV(p̃, p)``), the largest useful move ``available [R]`` (``min(E, D)``, or the neighbour flow's total) and
    the ``budget [R]`` each row had."""

    p_tilde: Tensor
    moved: Tensor
    available: Tensor
    budget: Tensor

    @property
    def binding(self) -> Tensor:
        """``[R]`` bool: the budget, not the draft, limited the move."""
        return self.budget < self.available


class BudgetRule(AcceptanceRule):
    """The budgeted rule (module docstring). ``neighbors [V, >= k]``: the codebook neighbour table, needed when
    ``config.budget_neighbors = k > 0``."""

    def __init__(self, config: AcceptanceConfig, neighbors: Optional[Tensor] = None):
        super().__init__(config)
        k = config.budget_neighbors
        if k and (neighbors is None or neighbors.dim() != 2 or neighbors.shape[1] < k):
            shape = None if neighbors is None else tuple(neighbors.shape)
            raise ValueError(f"budget neighbors={k} needs a codebook neighbour table [vocab, >= {k}], got {shape}")
        self.neighbors = neighbors[:, :k].long() if k else None

    @property
    def delta(self) -> float:
        return self.config.budget_delta

    def row_budgets(self, slots: Tensor, positions: Tensor, num_tokens: Optional[int]) -> Tensor:
        """``[R]`` float64 ``δ_t = δ decay^j (1 + (end - 1) t / (N - 1))`` for window rows ``slots`` (``j``) verifying
        image positions ``positions`` (``t``) of ``num_tokens`` (``N``; None: no image annealing)."""
        config = self.config
        budget = torch.full(slots.shape, config.budget_delta, dtype=torch.float64, device=slots.device)
        if config.budget_decay != 1.0:
            budget = budget * config.budget_decay ** slots.double()
        if config.budget_end != 1.0 and num_tokens is not None and num_tokens > 1:
            budget = budget * (1.0 + (config.budget_end - 1.0) * positions.double().clamp(0, num_tokens - 1) / (num_tokens - 1))
        return budget

    # ---- the construction ------------------------------------------------------------------------------------

    def relax(self, p: Tensor, q: Tensor, budget: Optional[Tensor] = None) -> Relaxation:
        """The relaxed targets of rows ``p, q [R, V]`` with budgets ``budget [R]`` (default ``δ``), in float64."""
        p64, q64 = _normalized(p), _normalized(q)
        if budget is None:
            budget = torch.full(p.shape[:1], self.delta, dtype=torch.float64, device=p.device)
        excess = (p64 - q64).clamp_min(0.0)
        deficit = torch.where(p64 > 0, (q64 - p64).clamp_min(0.0), torch.zeros_like(p64))
        if self.config.budget_ratio:  # p̃ <= λ p
            deficit = torch.minimum(deficit, (self.config.budget_ratio - 1.0) * p64)
        if self.neighbors is None:
            total_e, total_d = excess.sum(-1), deficit.sum(-1)
            available = torch.minimum(total_e, total_d)
            moved = torch.minimum(budget, available)
            inflow = deficit * (moved / total_d.clamp_min(1e-300))[:, None]
            outflow = excess * (moved / total_e.clamp_min(1e-300))[:, None]
        else:
            granted_in, granted_out = self._neighbor_flow(excess, deficit)
            available = granted_in.sum(-1)
            moved = torch.minimum(budget, available)
            scale = torch.where(available > 0, moved / available.clamp_min(1e-300), torch.zeros_like(moved))[:, None]
            inflow, outflow = granted_in * scale, granted_out * scale
        p_tilde = torch.where((moved > 0)[:, None], (p64 + inflow - outflow).clamp_min(0.0), p.double())
        return Relaxation(p_tilde, moved, available, budget)

    def _neighbor_flow(self, excess: Tensor, deficit: Tensor) -> tuple[Tensor, Tensor]:
        """The proportional flow along codebook-neighbour edges (module docstring): ``(inflow [R, V], outflow [R, V])``."""
        rows, vocab = excess.shape
        neighbors = self.neighbors.to(excess.device)  # [V, k]: the sources of each token
        k = neighbors.shape[1]
        flat = neighbors.reshape(1, -1).expand(rows, -1)
        source = excess.gather(-1, flat).view(rows, vocab, k)  # e(z) for z in N(y)
        reach = source.sum(-1, keepdim=True)
        asked = torch.where(reach > 0, deficit[..., None] * source / reach.clamp_min(1e-300), torch.zeros_like(source))
        demand = torch.zeros_like(excess).scatter_add_(-1, flat, asked.reshape(rows, -1))
        grant = torch.where(demand > excess, excess / demand.clamp_min(1e-300), torch.ones_like(demand))
        flow = asked * grant.gather(-1, flat).view(rows, vocab, k)
        outflow = torch.zeros_like(excess).scatter_add_(-1, flat, flow.reshape(rows, -1))
        return flow.sum(-1), outflow

    # ---- the rule on probability rows (every row with budget δ) ------------------------------------------------

    def accept(self, p: Tensor, drafts: Tensor, q: Tensor, u: Tensor, budget: Optional[Tensor] = None) -> Tensor:
        p_tilde = self.relax(p, q, budget).p_tilde
        at = drafts[:, None]
        return verify.speculative_test(u.double(), q.double().gather(-1, at).squeeze(-1), p_tilde.gather(-1, at).squeeze(-1))

    def residual_weights(self, p: Tensor, drafts: Optional[Tensor], q: Tensor, budget: Optional[Tensor] = None) -> Tensor:
        return verify.residual_weights(self.relax(p, q, budget).p_tilde, q.double())

    def output_distribution(self, p: Tensor, q: Tensor, budget: Optional[Tensor] = None,
                            p_tilde: Optional[Tensor] = None) -> Tensor:
        """``[R, V]`` what one verification outputs, from the mechanism (not from claim (3)): the accepted mass
        ``min(p̃, q)`` plus the rejected mass ``1 - Σ min(p̃, q)`` spread as ``(p̃ - q)_+`` normalised (``p_tilde``:
        already relaxed rows, else :meth:`relax` of ``p, q, budget``)."""
        p_tilde = _normalized(self.relax(p, q, budget).p_tilde if p_tilde is None else p_tilde)
        q64 = _normalized(q)
        accepted = torch.minimum(p_tilde, q64)
        residual = (p_tilde - q64).clamp_min(0.0)
        left = residual.sum(-1, keepdim=True)
        rejected = (1.0 - accepted.sum(-1, keepdim=True)).clamp_min(0.0)
        return accepted + torch.where(left > 0, rejected * residual / left.clamp_min(1e-300), torch.zeros_like(residual))

    def output_tv(self, p: Tensor, q: Tensor, budget: Optional[Tensor] = None) -> Tensor:
        """``[R]`` TV between the verification's output (:meth:`output_distribution`) and ``p`` (both normalised in
        float64: a float32 row's own rounding is not the rule's)."""
        return _tv(self.output_distribution(p, q, budget), p)

    def for_verification(self, target: Target, drafts: Drafts, slots: Tensor, num_tokens: Optional[int]) -> "BudgetVerification":
        return BudgetVerification(self, target, drafts, slots, num_tokens)


def _normalized(rows: Tensor) -> Tensor:
    rows = rows.double()
    return rows / rows.sum(-1, keepdim=True).clamp_min(1e-300)


def _tv(a: Tensor, b: Tensor) -> Tensor:
    """``[R]`` total variation between the rows of ``a`` and ``b``, each normalised in float64."""
    return 0.5 * (_normalized(a) - _normalized(b)).abs().sum(-1)


class BudgetVerification(AcceptanceRule):
    """The budgeted rule bound to one verification: each row's budget from its window slot and image position,
    and the relaxed targets of the rows with a draft, computed once for acceptance, residuals and reporting."""

    def __init__(self, rule: BudgetRule, target: Target, drafts: Drafts, slots: Tensor, num_tokens: Optional[int]):
        super().__init__(rule.config)
        self.rule = rule
        drafts = drafts.checked(target.num_rows, target.vocab, target.validate)
        self.rows = ((drafts.tokens >= 0) & (target.row_sample >= 0)).nonzero().squeeze(1)
        self.index = torch.full((target.num_rows,), -1, dtype=torch.long, device=target.device)
        self.index[self.rows] = torch.arange(self.rows.numel(), device=target.device)
        p = target.probabilities()
        self.p = p[self.rows]
        self.q = drafts.dense(self.rows, target.vocab, torch.float64)
        budget = rule.row_budgets(slots[self.rows], target.positions[self.rows], num_tokens)
        self.relaxation = rule.relax(self.p, self.q, budget)
        # sampling runs in p's dtype, as the exact rule's does: where nothing moved, p̃ is p to the bit
        self.p_tilde = self.relaxation.p_tilde.to(p.dtype)

    def _at(self, rows: Tensor) -> Tensor:
        index = self.index[rows]
        if bool((index < 0).any()):
            raise ValueError("rows without a draft have no relaxed target")
        return index

    def accept_drafts(self, target: Target, drafts: Drafts, draws: Tensor) -> Tensor:
        accepted = torch.zeros(target.num_rows, dtype=torch.bool, device=target.device)
        at = drafts.tokens[self.rows][:, None]
        accepted[self.rows] = verify.speculative_test(target.accept_uniforms(draws)[self.rows], self.q.gather(-1, at).squeeze(-1),
                                                      self.p_tilde.gather(-1, at).squeeze(-1))
        return accepted

    def rows_residual(self, target: Target, rows: Tensor, drafts: Drafts) -> Tensor:
        index = self._at(rows)
        return verify.residual_weights(self.p_tilde[index], self.q[index])

    def measure_tv(self, target: Target, rows: Tensor, drafts: Drafts) -> Tensor:
        """``[len(rows)]`` the TV of each row's output from its target: ``m``, the mass the relaxation moved (claim
        (3): the output is ``p̃`` and ``TV(p̃, p) = m``), read from the relaxation already made for these rows. It is
        the rule's own ``min(δ_t, min(E, D))`` in float64, so it never exceeds the budget the rule enforces (``δ_t <=
        δ``: the annealing factors are at most 1), where re-deriving it from the output distribution
        (:meth:`BudgetRule.output_tv`) adds float rounding (``0.10000000000000019`` at ``δ = 0.1``)."""
        return self.relaxation.moved[self._at(rows)]

    def store_relaxed(self, store_rows: Tensor, store_out: Tensor) -> None:
        """``store_out[store_rows[t]] = p̃_t`` for rows ``t`` with a draft and ``store_rows[t] >= 0``: MC-SJD's maximal
        coupling keeps a draft row's coupled output as the next draft, and that output is distributed as ``p̃``, so
        ``p̃`` (not ``p``) is the draft distribution the next verification must test it with."""
        keep = store_rows[self.rows] >= 0
        if bool(keep.any()):
            store_out[store_rows[self.rows][keep]] = self.p_tilde[keep].to(store_out.dtype)

    def used(self, num_rows: int) -> tuple[Tensor, Tensor, Tensor]:
        """``(moved, budget, binding)``, each ``[num_rows]`` (0 / False on rows without a draft)."""
        device = self.rows.device
        moved = torch.zeros(num_rows, dtype=torch.float64, device=device)
        budget = torch.zeros(num_rows, dtype=torch.float64, device=device)
        binding = torch.zeros(num_rows, dtype=torch.bool, device=device)
        moved[self.rows], budget[self.rows] = self.relaxation.moved, self.relaxation.budget
        binding[self.rows] = self.relaxation.binding
        return moved, budget, binding
