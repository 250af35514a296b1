"""Windows chosen by cost: the window of each pass maximises committed tokens per second.

A pass with window ``W`` over ``B`` batch slots costs ``t(B, W)`` seconds and commits ``T(W)`` tokens
per live sample (the accepted drafts plus one). :class:`WindowChooser` runs the window with the best
``T(W) / t(B, W)`` from a small fixed set (powers of two up to the largest, so compiled steps have
few shapes); ``W = 1`` is plain AR (``T = 1``), so by its own measurements the chooser never runs a
window slower than AR.

* ``t(B, W)``: wall time of whole decode steps (forward, verification, the step's read-back), measured
  as the decoder runs them and kept per (model, device, dtype, compile, B) for the process
  (:data:`STEP_COSTS`, running medians; the first step of a shape, which compiles or warms up, is
  dropped).
* ``T(W)``: committed tokens per live sample per pass, measured while ``W`` runs for a block of
  :attr:`WindowChooser.block` consecutive passes (drafts need a few passes to mature, so the first
  :attr:`WindowChooser.settle` of a block are not counted), kept per (model, decoding spec) for the
  process (:data:`TOKENS_PER_PASS`). Windows without a measurement are tried first (largest first),
  and a neighbour of the best window is re-tried every :attr:`WindowChooser.refresh` passes.

The window only decides which drafts a pass verifies; every verification stays exact, so the output
distribution is the AR one whatever the choices (tests/test_exactness.py runs the chooser). The tokens
a seed gives do depend on the choices, hence on the machine's timings and on the rest of the batch.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from typing import Any, Callable, Hashable, Optional

STEP_COSTS: dict[Hashable, dict[int, list[float]]] = defaultdict(dict)
"""Step times in seconds, per cost key (:func:`cost_key`) and window (the last :data:`KEEP`)."""
TOKENS_PER_PASS: dict[Hashable, dict[int, list[float]]] = defaultdict(dict)
"""Committed tokens per live sample per pass, per (model, decoding spec) and window (the last :data:`KEEP`)."""
KEEP = 32


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


def _append(table: dict[int, list[float]], window: int, value: float) -> None:
    values = table.setdefault(window, [])
    values.append(value)
    del values[:-KEEP]


class WindowChooser:
    """Picks each pass's window (module docstring): :meth:`choose` before the pass, :meth:`record` after it.

    Args:
        largest: the largest window.
        key: the cost key (:func:`cost_key`); ``tokens_key``: what acceptance depends on (model, spec).
        costs, tokens: tables to use instead of the process-wide :data:`STEP_COSTS`, :data:`TOKENS_PER_PASS`.
        clock: seconds, for step times (``time.perf_counter``).
    """

    block = 6  # passes a window runs before the chooser decides again
    settle = 2  # first passes of a block left out of its token count
    refresh = 48  # passes between re-trying a neighbour of the best window

    def __init__(self, largest: int, key: Hashable, costs: Optional[dict] = None, tokens_key: Hashable = None,
                 tokens: Optional[dict] = None, clock: Callable[[], float] = time.perf_counter):
        self.windows, self.clock = window_set(largest), clock
        self.costs = (STEP_COSTS if costs is None else costs)[key]
        self.tokens = (TOKENS_PER_PASS if tokens is None else tokens)[tokens_key if tokens_key is not None else key]
        self.history: list[int] = []
        self.passes = 0
        self._current: Optional[int] = None
        self._left = 0  # passes left in the current block
        self._in_block = 0
        self._last_refresh = 0
        self._started = 0.0
        self._warm: set[int] = set(self.costs)  # windows whose first (compiling, warming) step is behind

    # ---- estimates ---------------------------------------------------------------------------------

    def expected_tokens(self, window: int) -> Optional[float]:
        """Measured committed tokens per live sample per pass at ``window`` (1 for AR), None if unmeasured."""
        if window == 1:
            return 1.0
        values = self.tokens.get(window)
        return statistics.fmean(values) if values else None

    def cost(self, window: int) -> Optional[float]:
        values = self.costs.get(window)
        return statistics.median(values) if values else None

    def rate(self, window: int, need: int) -> Optional[float]:
        """Tokens per second per live sample at ``window`` (a pass commits at most ``need`` tokens)."""
        tokens, cost = self.expected_tokens(window), self.cost(window)
        return None if tokens is None or cost is None else min(tokens, need) / cost

    # ---- decisions ---------------------------------------------------------------------------------

    def choose(self, need: int) -> int:
        """The window for the next pass; ``need``: the widest window any live sample can still use."""
        candidates = [w for w in self.windows if w < need] + [round_up(need, self.windows)]
        if self._left <= 0 or self._current not in candidates:
            self._start_block(self._pick(candidates, need))
        self._left -= 1
        self.history.append(self._current)
        self._started = self.clock()
        return self._current

    def _pick(self, candidates: list[int], need: int) -> int:
        unmeasured = [w for w in candidates if self.rate(w, need) is None]
        if unmeasured:
            return unmeasured[-1]  # largest first: it also shows how far drafts get accepted
        best = max(candidates, key=lambda w: self.rate(w, need))
        if self.passes - self._last_refresh >= self.refresh:
            self._last_refresh = self.passes
            at = candidates.index(best)
            return candidates[at + 1] if at + 1 < len(candidates) else candidates[max(at - 1, 0)]
        return best

    def _start_block(self, window: int) -> None:
        self._current, self._left, self._in_block = window, self.block, 0

    def record(self, window: int, num_accepted: list[int], widths: list[int]) -> None:
        """After the pass and its read-back: the step's time, and each live sample's accepted drafts and width."""
        elapsed = self.clock() - self._started
        if window in self._warm:
            _append(self.costs, window, elapsed)
        self._warm.add(window)
        self.passes += 1
        self._in_block += 1
        full = [m + 1 for m, width in zip(num_accepted, widths) if width >= window]  # samples not cut short by N
        if window > 1 and full and self._in_block > self.settle:
            _append(self.tokens, window, statistics.fmean(full))
