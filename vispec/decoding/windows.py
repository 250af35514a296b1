"""Windows chosen by cost: the window of each pass maximises expected tokens per second.

A pass with window ``W`` over ``B`` batch slots costs ``t(B, W)`` seconds and commits, per live
sample, ``E[tokens | W] = 1 + sum_{j=1}^{W-1} P(m >= j)`` tokens, where ``m`` is the number of
accepted drafts. :class:`WindowChooser` picks ``argmax_W E[tokens | W] / t(B, W)`` over a small fixed
set of windows (powers of two up to the largest, so compiled steps have few shapes); ``W = 1`` is
plain AR, so a chosen window never loses to AR by its own estimates.

* ``t(B, W)``: the wall time of whole decode steps (forward, verification, the step's read-back),
  measured as the decoder runs them and kept per (model, device, dtype, compile, B) for the process
  (:data:`STEP_COSTS`); a window not measured yet is explored once, the first measurement of each
  shape (compilation, warm-up) is discarded, and measurements are running medians.
* ``P(m >= j)``: running counts over this decode of passes whose slot ``j`` existed and whose
  accepted run reached it; unexplored depths extrapolate the last measured ratio geometrically.

The window only decides which drafts a pass verifies; every verification stays exact, so the output
distribution is the AR one whatever the choices (tests/test_exactness.py runs the chooser).
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from typing import Any, Hashable, Optional

STEP_COSTS: dict[Hashable, dict[int, list[float]]] = defaultdict(dict)
"""Step times in seconds, per cost key and window (the last :data:`KEEP` measurements)."""
KEEP = 15
REFRESH_EVERY = 24  # passes between re-measuring a neighbouring window


def window_set(largest: int) -> list[int]:
    """``1, 2, 4, ...`` below ``largest``, then ``largest``."""
    out, w = [], 1
    while w < largest:
        out.append(w)
        w *= 2
    return out + [largest]


def round_up(width: int, windows: list[int]) -> int:
    """The smallest window of the set that holds ``width`` rows."""
    return next(w for w in windows if w >= width)


def cost_key(model: Any, slots: int, compiled: bool) -> Hashable:
    """What a step time depends on besides the window."""
    param = next(model.parameters(), None) if hasattr(model, "parameters") else None
    where = (str(param.device), str(param.dtype)) if param is not None else ("?", "?")
    return (type(model).__name__, id(model), where, slots, compiled)


class WindowChooser:
    """Picks each pass's window (module docstring); ``choose`` before the pass, ``record`` after it."""

    def __init__(self, largest: int, key: Hashable, costs: Optional[dict] = None):
        self.windows = window_set(largest)
        self.costs = (STEP_COSTS if costs is None else costs)[key]
        self.reached = [0] * (largest + 1)  # passes whose accepted run reached slot j
        self.tried = [0] * (largest + 1)  # passes in which slot j was verified
        self.passes = 0
        self.history: list[int] = []
        self._started: Optional[float] = None
        self._seen: set[int] = set()

    def expected_tokens(self, window: int) -> float:
        """``1 + sum_{j<W} P(m >= j)`` from the running counts."""
        total, last = 1.0, 0.6  # prior survival ratio for depths never verified
        survive = 1.0
        for j in range(1, window):
            if self.tried[j]:
                survive = self.reached[j] / self.tried[j]
                last = survive ** (1.0 / j) if survive > 0 else 0.0
            else:
                survive *= last
            total += survive
        return total

    def cost(self, window: int) -> Optional[float]:
        times = self.costs.get(window)
        return statistics.median(times) if times else None

    def choose(self, need: int) -> int:
        """The window for the next pass; ``need``: the widest window any live sample can use."""
        windows = [w for w in self.windows if w < need] + [round_up(need, self.windows)]
        unmeasured = [w for w in windows if self.cost(w) is None]
        if unmeasured:  # explore, largest first (it also measures deep acceptance)
            choice = unmeasured[-1]
        else:
            rates = {w: min(self.expected_tokens(w), need) / self.cost(w) for w in windows}
            choice = max(rates, key=rates.get)
            if self.passes and self.passes % REFRESH_EVERY == 0:  # re-measure a neighbour now and then
                at = windows.index(choice)
                choice = windows[at + 1] if at + 1 < len(windows) else windows[max(at - 1, 0)]
        self.history.append(choice)
        self._started = time.perf_counter()
        return choice

    def record(self, window: int, num_accepted: list[int], widths: list[int]) -> None:
        """After the pass (and its read-back): the step time and each live sample's accepted count and width."""
        elapsed = time.perf_counter() - self._started
        if window in self._seen or window in self.costs:
            self.costs.setdefault(window, []).append(elapsed)
            del self.costs[window][:-KEEP]
        self._seen.add(window)
        self.passes += 1
        for m, width in zip(num_accepted, widths):
            for j in range(1, width):
                self.tried[j] += 1
                self.reached[j] += m >= j
