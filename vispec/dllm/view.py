"""What one forward of the block loop shows the rules that run after the policy's commit (:class:`StepView`), and the
one interface of those rules (:class:`AfterStep`): end-of-text prediction (:mod:`vispec.dllm.eotp`) and Prophet's
early commit (:mod:`vispec.dllm.prophet`).

Every tensor is laid out over the rows' generated canvas (``[R, L]``, position ``j`` = generated token ``j``);
positions the forward did not compute carry a candidate of ``-1`` and a confidence of ``-inf``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol

from torch import Tensor


@dataclass
class StepView:
    """One forward of the block loop for the batch rows ``rows`` (:mod:`vispec.dllm.loop`).

    Args:
        rows: ``[R]`` batch rows (sorted).
        logits: ``[R, T, V]`` logits of the generated positions ``[first, first + T)``.
        canvas: ``[R, L]`` the rows' generated canvas; after the commit, with this step's tokens (rules edit it).
        masked: ``[R, L]`` bool, the positions masked before the commit (end-of-text prediction narrows it to the
            surviving canvas).
        computed: ``[L]`` bool, the positions this forward computed.
        cut: ``[R]`` each row's canvas length (``L`` unless end-of-text prediction cut it).
        candidates, confidence: ``[R, L]`` this forward's candidates and ``softmax(ℓ)[x̂]`` (float64) at the masked
            positions it computed, with the policy's noise keys (None when no rule reads them).
        accepted: ``[R, L]`` bool, the positions this step committed that a learned filter accepted (every committed
            one for policies without a filter); set by the commit.
        rows_h: ``rows`` on the host (None unless a rule reads per-row host state).
        proposal_mask: ``[V]`` bool tokens never proposed (None: all may be).
    """

    rows: Tensor
    logits: Tensor
    first: int
    canvas: Tensor
    masked: Tensor
    computed: Tensor
    cut: Tensor
    rows_h: Optional[Tensor]
    candidates: Optional[Tensor] = None
    confidence: Optional[Tensor] = None
    accepted: Optional[Tensor] = None
    proposal_mask: Optional[Tensor] = None


class AfterStep(Protocol):
    """A rule that runs after every commit of the block loop, batched over the rows of the forward."""

    def after_step(self, view: StepView) -> None:
        """Read the forward and the commit; edit ``view.canvas`` (and the rule's own per-row state)."""

    def details(self, rows: Tensor) -> dict:
        """Entries of the step callback's ``details`` for ``rows``."""

    def report(self, extra: dict, labels: dict) -> None:
        """Add the rule's per-row statistics (``DecodeStats.extra``) and labels to a decode's output."""
