"""Prophet's early commit: a row whose answer has converged commits every remaining mask at once and stops.

Prophet (Li et al., "Diffusion Language Models Know the Answer Before Decoding", arXiv 2508.19982; spec ``dllm.md``
§6). After a forward, with ``gap_j = ℓ_j,(1) - ℓ_j,(2)`` the top-2 logit gap (over the proposable vocabulary) and
``ḡ`` its mean over the row's *answer region*, the row commits every position it still has masked, each to its
candidate from this same forward (the arg-max at temperature 0; at ``T > 0`` the very Gumbel-max draw the policy
would take there in this step), and stops when ``ḡ ≥ τ(progress)``::

    τ(p) = thresholds[k]  with  k = #{ boundaries ≤ p }      (defaults 7.5 / 5.0 / 2.5 at p < 1/3, < 2/3, else)

The paper forces the words "The answer is" into the canvas to locate a 5-token answer region; vispec has
no such task-specific constraint, so:

* the answer region is the row's still-masked positions (before this step's commit; all of them, later
  blocks included, within its canvas), or, with ``answer_span=(a, b)``, its still-masked positions in
  ``[a, b)``; a row whose region is empty is not judged (with an answer span that is already decoded,
  decoding simply goes on);
* progress is the committed fraction of the row's canvas before the step, ``(c - #masked) / c``: for
  LLaDA's one-token-per-step schedule this is the paper's ``step / steps``, and it is defined for
  adaptive policies, which have no step budget.

The block loop runs it after every commit (:class:`EarlyCommit`, an :class:`vispec.dllm.view.AfterStep` rule). It is
judged only on forwards that computed every masked position of the row (no cache, ``"prefix"``, ``"dkv"``,
refreshes; ``"dual"`` block steps only once nothing is masked past the block), so it adds no forward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from vispec.checks import check_int, check_number
from vispec.dllm.eotp import EndOfText
from vispec.dllm.view import StepView


def top2_gap(logits: Tensor, proposal_mask: Optional[Tensor]) -> Tensor:
    """``[n]`` float64 ``ℓ_(1) - ℓ_(2)`` of ``logits [n, V]`` over the proposable tokens (``proposal_mask``
    excluded). With a single proposable token the gap is ``+inf`` (nothing competes with it)."""
    logits = logits.to(torch.float64)
    if proposal_mask is not None:
        logits = logits.masked_fill(proposal_mask, float("-inf"))
    top = logits.topk(2, dim=-1).values
    return top[:, 0] - top[:, 1]


@dataclass(frozen=True)
class ProphetRule:
    """Prophet's early-commit rule (module docstring) for :func:`vispec.dllm.decode` (``early_commit=``).

    Args:
        thresholds: gap thresholds ``τ`` in logit units (``>= 0``), one per progress interval; the
            paper's 7.5 / 5.0 / 2.5.
        boundaries: the interval boundaries, strictly increasing in ``(0, 1)``, one fewer than the
            thresholds; default ``(1/3, 2/3)`` (the paper's code writes 0.33 / 0.67).
        answer_span: ``(a, b)``: judge only the still-masked positions of the generated canvas ``[a, b)``
            (``0 <= a < b <= gen_length``); None (default): all of the row's still-masked positions.

    The rule is only evaluated on forwards that computed every masked position of the row (module
    docstring): every step without a cache and with the prefix or dKV cache,
    and with the dual cache the block's first (full, cache-refreshing) forward, plus any step whose row has
    no mask left outside the block. It adds no forward.
    """

    thresholds: tuple = (7.5, 5.0, 2.5)
    boundaries: tuple = (1 / 3, 2 / 3)
    answer_span: Optional[tuple] = None

    def __post_init__(self):
        for name in ("thresholds", "boundaries"):
            value = getattr(self, name)
            if not isinstance(value, (tuple, list)):
                raise ValueError(f"{name} must be a tuple of numbers, got {value!r}")
            object.__setattr__(self, name, tuple(value))
        if len(self.thresholds) != len(self.boundaries) + 1:
            raise ValueError(f"thresholds must have one entry more than boundaries (one per progress interval), got "
                             f"{len(self.thresholds)} thresholds and {len(self.boundaries)} boundaries")
        for t in self.thresholds:
            check_number("thresholds", t, minimum=0, hint=" (top-2 logit gaps)")
        for b in self.boundaries:
            check_number("boundaries", b, minimum=0, maximum=1, exclusive_minimum=True)
        if any(b1 >= b2 for b1, b2 in zip(self.boundaries, self.boundaries[1:])) or 1.0 in self.boundaries:
            raise ValueError(f"boundaries must be strictly increasing in (0, 1), got {self.boundaries}")
        if self.answer_span is not None:
            span = self.answer_span
            if not isinstance(span, (tuple, list)) or len(span) != 2:
                raise ValueError(f"answer_span must be None or a pair (start, end), got {span!r}")
            check_int("answer_span start", span[0], minimum=0)
            check_int("answer_span end", span[1], minimum=span[0] + 1)
            object.__setattr__(self, "answer_span", tuple(span))

    def check_length(self, gen_length: int) -> None:
        """``answer_span`` must lie within the generated canvas."""
        if self.answer_span is not None and self.answer_span[1] > gen_length:
            raise ValueError(f"early_commit.answer_span {self.answer_span} must lie within gen_length ({gen_length})")

    def threshold(self, progress: Tensor) -> Tensor:
        """``[G]`` ``τ(progress)``: ``thresholds[k]`` with ``k`` the number of boundaries ``<= progress``."""
        bounds = torch.tensor(self.boundaries, dtype=torch.float64, device=progress.device)
        taus = torch.tensor(self.thresholds, dtype=torch.float64, device=progress.device)
        return taus[torch.searchsorted(bounds, progress.to(torch.float64).contiguous(), right=True)]

    def region(self, masked: Tensor) -> Tensor:
        """``[G, L]`` bool answer region: the masked positions (within ``answer_span`` if given)."""
        if self.answer_span is None:
            return masked
        pos = torch.arange(masked.shape[1], device=masked.device)
        return masked & (pos >= self.answer_span[0]) & (pos < self.answer_span[1])

    def fires(self, gap: Tensor, region: Tensor, masked: Tensor, cut: Tensor, computed: Tensor) -> Tensor:
        """``[G]`` bool: the rows whose mean gap over ``region`` reaches ``τ(progress)``.

        Args:
            gap: ``[G, L]`` float64 top-2 logit gaps (read on ``region`` only).
            region: ``[G, L]`` bool answer region (:meth:`region`).
            masked: ``[G, L]`` bool, the row's masked positions before the step (within its canvas).
            cut: ``[G]`` canvas lengths; progress is ``(cut - #masked) / cut``.
            computed: ``[G, L]`` bool, positions this forward computed: a row is judged only when every
                masked position of it was computed (the commit needs their candidates).
        """
        count = region.sum(dim=1)
        mean = torch.where(region, gap, torch.zeros_like(gap)).sum(dim=1) / count.clamp_min(1)
        progress = (cut - masked.sum(dim=1)).to(torch.float64) / cut.clamp_min(1)
        judged = (count > 0) & ~(masked & ~computed).any(dim=1)
        return judged & (mean >= self.threshold(progress))


class EarlyCommit:
    """Prophet in the block loop (module docstring): judge each forward's rows, commit the rows that fire."""

    def __init__(self, rule: ProphetRule, batch: int, device: torch.device, mask_id: int,
                 eot: Optional[EndOfText] = None):
        self.rule, self.mask_id, self.eot = rule, mask_id, eot
        self.early = torch.zeros(batch, dtype=torch.bool, device=device)  # rows Prophet finished

    def fires(self, view: StepView) -> Tensor:
        """``[R]`` rows whose answer region has converged (:meth:`ProphetRule.fires`)."""
        region = self.rule.region(view.masked) & view.computed
        width = view.logits.shape[1]
        b, j = region[:, view.first: view.first + width].nonzero(as_tuple=True)
        gap = torch.zeros(region.shape, dtype=torch.float64, device=region.device)
        gap[b, j + view.first] = top2_gap(view.logits[b, j], view.proposal_mask)
        return self.rule.fires(gap, region, view.masked, view.cut, view.computed.expand_as(view.masked))

    def after_step(self, view: StepView) -> None:
        """The rows that fire commit every masked position to this forward's candidates; an EOS among them ends the
        canvas too (end-of-text prediction)."""
        fire = self.fires(view)
        fill = fire[:, None] & (view.canvas == self.mask_id)
        view.canvas = torch.where(fill, view.candidates, view.canvas)
        self.early[view.rows] |= fire
        if self.eot is not None:
            self.eot.cut_after(view, fill)

    def details(self, rows: Tensor) -> dict:
        return {}

    def report(self, extra: dict, labels: dict) -> None:
        extra["early_committed"] = self.early.long().cpu()
        labels["early_commit"] = "prophet"
