r"""``speculative="auto"``: the draft length of every self-speculative round, by expected reference steps per second.

A round of self-speculation (:mod:`vispec.dllm.speculative`) with draft length ``k`` drafts ``k - 1`` steps from the
stale logits and verifies the ``k`` canvases of every live row in one forward. Its output is the stepwise run's for
*any* sequence of draft lengths (each canvas is kept only once proven), so ``k`` may change from round to round on
anything at all; this module picks it for speed, as the image half's shape chooser does
(:mod:`vispec.decoding.shapes`, Sequoia's hardware-aware choice, Chen et al. 2024, arXiv 2402.12374):

**Expected steps.** Let ``a_d`` be the probability that the ``d``-th draft of a chain is verified given the ``d - 1``
before it were. A round of draft length ``k`` advances ``E[T_k] = 1 + sum_{d=1}^{k-1} prod_{j<=d} a_j`` reference
steps per row. ``a_d`` is counted from the verified rounds of this decode (a chain that verified ``j`` drafts of the
``m`` it had: hits at depths ``1..j``, a miss at ``j + 1`` when ``j < m``), smoothed down the depths (depth ``d``'s
counts plus :data:`SHRINK` pseudo-observations of depth ``d - 1``'s rate), so an unmeasured depth borrows the
deepest measured one's rate, never a flattering prior.

**Cost.** A round's seconds (drafting, the verifying forward and the verification) against the canvases it forwarded,
``n`` rows times ``k`` (fewer where chains end at a block's end): the robust line of
:func:`vispec.decoding.windows.robust_line`, the image half's cost-curve machinery, kept in a
:class:`~vispec.decoding.windows.WindowStats` under the decode's cost key (model, device, dtype, batch, cache), so a
pipeline's later decodes start from it. Until it has two distinct widths measured the chooser explores: one round
at each of :data:`EXPLORE` (capped by the largest ``k``).

**Choice.** ``argmax_k n E[T_k] / t(n k)`` over :data:`CANDIDATES` up to the largest, re-scored every round (a few
numpy operations; rounds cost milliseconds at least); every :data:`WIDER_EVERY` rounds the next larger ``k`` than the
best runs once, so deeper rates keep being measured.
"""

from __future__ import annotations

import time
from typing import Callable, Hashable, Optional

import numpy as np
from torch import Tensor

from vispec.decoding.windows import WindowStats, depth_rates, robust_line

CANDIDATES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)
EXPLORE = (2, 8)  # the first rounds' draft lengths (then the largest), for the cost line and the rates
SHRINK = 4.0
PRIOR = 0.5  # the rate of a depth nothing has measured yet (depth 1 only; deeper ones borrow)
WIDER_EVERY = 8
KEEP = 64  # cost samples kept


class DraftLengthChooser:
    """Picks the draft length of every round (module docstring): :meth:`choose` before it, :meth:`record` after it.

    Args:
        largest: the largest draft length (``SelfSpeculation.max_draft_length``).
        stats: where the cost samples are kept (between decodes, by a pipeline), under ``key``.
        clock: the round's seconds (``stats.clock``: the wall clock unless set).
    """

    def __init__(self, largest: int, stats: Optional[WindowStats] = None, key: Hashable = ("dllm",),
                 clock: Optional[Callable[[], float]] = None):
        self.lengths = [k for k in CANDIDATES if k < largest] + [largest]
        self.stats = WindowStats() if stats is None else stats
        self.samples: list[tuple[int, float]] = self.stats.costs(key).setdefault("round", [])
        self.clock = clock or self.stats.clock or time.perf_counter
        self.counts = np.zeros((largest + 1, 2))  # depth d: (verified, tried)
        self.explore = [] if self._line() is not None else sorted({min(k, largest) for k in EXPLORE} | {largest})
        self.rounds = 0
        self.chosen: dict[int, int] = {}  # rounds per draft length
        self._start: Optional[float] = None

    # ---- estimates ------------------------------------------------------------------------------------------

    def rates(self) -> np.ndarray:
        """``a [largest + 1]`` (index ``d``; 0 unused), smoothed down the depths (module docstring)."""
        a = np.empty(len(self.counts))
        a[0] = 1.0
        a[1:] = depth_rates(self.counts[1:, 0], self.counts[1:, 1], PRIOR, SHRINK)
        return np.clip(a, 0.0, 0.999)

    def expected_steps(self) -> np.ndarray:
        """``E[T_k]`` for every ``k`` of :attr:`lengths`."""
        reach = np.cumprod(self.rates()[1:])  # the chain reaches depth d
        totals = np.concatenate([[1.0], 1.0 + np.cumsum(reach)])  # E[T_k] at index k - 1
        return totals[np.asarray(self.lengths) - 1]

    def _line(self) -> Optional[tuple[float, float]]:
        widths = {width for width, _ in self.samples}
        if len(widths) < 2:
            return None
        return robust_line(self.samples, span=1)

    def cost(self, canvases: np.ndarray) -> Optional[np.ndarray]:
        """Seconds of rounds forwarding ``canvases`` canvas rows (each entry), None before the line is known (at least
        5% of the median round: a line through noisy rounds may cross zero). The line is fitted once per call."""
        line = self._line()
        if line is None:
            return None
        floor = max(0.05 * float(np.median([t for _, t in self.samples])), 1e-9)
        return np.maximum(line[0] + line[1] * np.asarray(canvases, dtype=float), floor)

    # ---- decisions ------------------------------------------------------------------------------------------

    def choose(self, rows: int) -> int:
        """The draft length of the next round of ``rows`` live rows."""
        self._start = self.clock()
        if not self.explore and self._line() is None:  # the rounds so far forwarded one width only: explore again
            self.explore = sorted({min(k, self.lengths[-1]) for k in EXPLORE} | {self.lengths[-1]})
        if self.explore:
            k = self.explore.pop(0)
        else:
            steps = self.expected_steps()
            seconds = self.cost(rows * np.asarray(self.lengths))
            best = int(np.argmax(rows * steps / seconds))
            if self.rounds and self.rounds % WIDER_EVERY == 0 and best + 1 < len(self.lengths):
                best += 1  # the next larger one runs once: deeper rates stay measured
            k = self.lengths[best]
        self.chosen[k] = self.chosen.get(k, 0) + 1
        return k

    def record(self, canvases: int, verified: Tensor, drafted: Tensor) -> None:
        """After the round: ``canvases`` forwarded; per row, the drafts ``verified`` of the ``drafted`` it had."""
        if self._start is not None and canvases > 0:
            self.samples.append((canvases, self.clock() - self._start))
            del self.samples[:-KEEP]
        self._start = None
        self.rounds += 1
        verified, drafted = verified.cpu().numpy()[None, :], drafted.cpu().numpy()[None, :]
        depth = np.arange(1, len(self.counts))[:, None]
        self.counts[1:, 0] += (verified >= depth).sum(axis=1)  # depth d verified: the chain verified d drafts or more
        self.counts[1:, 1] += ((verified >= depth - 1) & (drafted >= depth)).sum(axis=1)  # reached it and had it
