"""Windows chosen by cost: the window of each pass maximises committed tokens per second.

A pass with window ``W`` over ``B`` batch slots whose longest sample has ``L`` cached tokens costs
``t(B, W, L)`` seconds and commits ``T(W)`` tokens per live sample (the accepted drafts plus one).
:class:`WindowChooser` runs the window with the best ``T(W) / t(B, W, L)`` from a small fixed set
(powers of two up to the largest, so compiled steps have few shapes). ``W = 1`` is plain AR
(``T = 1``; the decoder runs it without reading anything back, as AR does), and a wider window must
beat it by :attr:`ChooserSettings.margin`, so by its own measurements the chooser never runs a window
slower than AR.

* ``t(B, W, L)``: wall time of whole decode steps (forward, verification, the step's read-back),
  measured as the decoder runs them, kept per (device, dtype, compile, B) in a :class:`WindowStats`
  (the first step of a shape, which compiles or warms up, is dropped). Eager
  attention reads ``L`` cached tokens, so a step's cost grows with ``L``: the estimate at ``L`` is a
  robust line (:func:`robust_line`) through the window's samples once they span :data:`SPAN` positions;
  before, their median, scaled by the relative growth of the window whose samples span the most
  (windows are measured at different lengths, so unscaled medians would favour whichever ran first).
  Window-1 passes that read nothing back are timed as a run, up to the read-back that ends it.
* ``T(W)``: committed tokens per live sample per pass, measured while ``W`` runs a block of passes
  (drafts need passes to mature after the window changes: the first ``max(settle, W // maturity)``
  passes of a block that changes the window are not counted, the next :attr:`ChooserSettings.block` are),
  kept per decoding spec in the :class:`WindowStats`.
* The ramp: those first passes commit fewer tokens, ``S(from, W)`` per pass (:attr:`WindowStats.ramp_tokens`). A decode
  of few tokens spends much of itself ramping (GPT-L, 64 tokens, window 16: 8 of 14 passes), so windows
  are compared by the time to finish: a batch whose slowest sample lacks ``R`` tokens finishes at ``W``
  after ``r + (R - r S) / T`` passes, ``r`` the ramp passes still ahead (none if ``W`` is running and
  settled); the rate is ``R`` over that many passes' cost. Continuing a window costs no ramp, so the
  chooser does not switch for a small gain.

Exploration climbs: window 1 first, then the next wider window while it could beat the best so far:
its extra rows add tokens only for samples that accepted every draft of the widest measured window
(:attr:`WindowStats.all_accepted`), and it costs at least as much. So where speculation does not pay only one
block of window 2 is spent. Every :attr:`~ChooserSettings.refresh` passes the
neighbours of the best window are re-measured, if their last rate was within :attr:`~ChooserSettings.near` of the best;
each re-measurement that confirms the best doubles the interval.

Where the measurements say no window beats AR, a whole decode runs as plain AR
(:meth:`WindowChooser.prefers_ar`; every :attr:`~ChooserSettings.recheck`-th such decode runs the chooser).

Calibration (:func:`calibrate_step_costs`): a decode whose chooser runs a script of windows in turn
(:attr:`ChooserSettings.script`) measures ``t(B, W, L)`` of every window over the whole range of ``L`` into a
``WindowStats``; a chooser given those stats starts from the calibration, and :func:`relative_step_costs` reads
the same predictions as ``c(B, W) / c(B, 1)`` (the roofline report of ``vispec bench decoders | image``).

Measurements belong to one model, so they live in an explicit :class:`WindowStats` that its owner keeps
between decodes: a pipeline keeps one for its transformer (a new transformer starts a new one), and
:func:`vispec.decoding.decode` takes one (``window_stats=``; without it the measurements last one decode).
No decode writes process-wide state.

The window only decides which drafts a pass verifies; every verification stays exact, so the output
distribution is the AR one whatever the choices (tests/exactness/test_exactness.py runs the chooser). The tokens
a seed gives do depend on the choices, hence on the machine's timings and on the rest of the batch.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Hashable, Optional

import numpy as np

KEEP = 64
SPAN = 32  # cached-token range over which step times are fitted by a line rather than a median
#: Part of every cost curve's cache key (:func:`machine_fingerprint`) with vispec's version: raised by a change that
#: moves what a decode step costs, so curves measured before it are not read (2: compiled CPU steps with inductor's
#: C++ wrapper and fused attention, about 12% cheaper one-token steps on tiny-c2i; 3: compiled bfloat16 attention
#: with the keys as the left operand, no longer copying a cache sized for wider windows, models.layers.masked_attention;
#: 4: the shape chooser's curve holds the AR decoder's own pass, its yardstick, timed with the calibration,
#: vispec.decoding.shapes.AR_DECODER).
STEP_CODE_REVISION = 4


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
    """What a step time depends on besides the model, the window and the cache length."""
    param = next(model.parameters(), None) if hasattr(model, "parameters") else None
    where = (str(param.device), str(param.dtype)) if param is not None else ("?", "?")
    return (where, slots, compiled)


@dataclass(frozen=True)
class ChooserSettings:
    """How :class:`WindowChooser` explores (module docstring); part of a :class:`WindowStats`, so a test or a
    benchmark tunes one chooser's behaviour without touching any other."""

    block: int = 4  # counted passes per block, at least ...
    samples: int = 16  # ... and enough for this many sample-passes (a batch of 1 needs more passes for a mean)
    settle: int = 2  # uncounted passes at the start of a block, at least ... (0: none; the shape chooser then skips settling)
    maturity: int = 2  # ... and W // maturity (wide windows' drafts take longer to mature)
    margin: float = 0.03  # a wider window must beat window 1's rate by this share
    near: float = 0.8  # neighbours re-measured only if their rate was at least this share of the best
    refresh: int = 64  # passes between re-measuring neighbours of the best window (doubles on each confirmation)
    recheck: int = 8  # of the decodes handed to AR (prefers_ar), every recheck-th runs the chooser instead
    script: tuple[int, ...] = ()  # calibration (:func:`calibrate_step_costs`): these windows in turn, ``block`` passes each
    shape_script: tuple = ()  # the shape chooser (vispec.decoding.shapes.Shape): these shapes in turn, ``block`` passes each

    def __post_init__(self) -> None:
        for name in ("block", "samples", "maturity", "refresh", "recheck"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"ChooserSettings.{name} must be a positive int, got {getattr(self, name)!r}")
        if not isinstance(self.settle, int) or self.settle < 0:
            raise ValueError(f"ChooserSettings.settle must be an int >= 0, got {self.settle!r}")
        if not self.margin >= 0 or not 0 <= self.near <= 1:
            raise ValueError(f"ChooserSettings.margin must be >= 0 and near in [0, 1], got {self.margin!r}, {self.near!r}")
        if not isinstance(self.script, tuple) or any(not isinstance(w, int) or w < 1 for w in self.script):
            raise ValueError(f"ChooserSettings.script must be a tuple of windows >= 1, got {self.script!r}")
        if not isinstance(self.shape_script, tuple) or any(not hasattr(s, "rows") for s in self.shape_script):
            raise ValueError(f"ChooserSettings.shape_script must be a tuple of Shape, got {self.shape_script!r}")


@dataclass
class WindowStats:
    """The window chooser's measurements of one model's decodes (module docstring), kept by their owner.

    ``step_costs[cost key][W]``: ``(L, seconds)`` step times; ``tokens_per_pass[spec][W]``: committed tokens
    per live sample per pass; ``ramp_tokens[spec][(from, W)]``: the same over a block's settling passes
    (``from``: the window the drafts were made with, 0 when there were none: the decode's start, or after
    window 1, which keeps no drafts);
    ``all_accepted[spec][W]``: shares of samples that accepted every draft; ``ar_handovers[cost key]``:
    consecutive decodes run as plain AR (:meth:`WindowChooser.prefers_ar`); ``ar_timings[cost key]``: the shape
    chooser's decodes since the AR decoder's pass was last timed, ``ar_timings[(cost key, "interval")]`` how many are
    due before the next re-timing (:meth:`~vispec.decoding.shapes.ShapeChooser.needs_ar_decoder`), ``ar_timings[(cost key,
    "fixed-chain:L")]`` the decodes, with that chain the best, since one that ran it every pass was last timed
    (:meth:`~vispec.decoding.shapes.ShapeChooser.fixed_chain`); ``ar_handovers[(cost key, "fixed-chain")]``: decodes given a fixed chain since the
    chooser last ran. Each list keeps the last
    :data:`KEEP` values. ``starting_costs``: the step times ``{W: [(L, seconds), ...]}`` a cost key met for the
    first time starts from (a copy; by default none: measured from scratch). ``settings``: how the chooser
    explores (:class:`ChooserSettings`). ``clock``: what a step's seconds are (wall clock by default).

    :func:`calibrate_step_costs` fills ``step_costs`` directly (whole decode steps of every window at every cache
    length), so a chooser can start from a calibration and the roofline report (``vispec bench decoders``) reads
    the same numbers (:func:`relative_step_costs`)."""

    step_costs: dict[Hashable, dict[int, list[tuple[int, float]]]] = field(default_factory=dict)
    tokens_per_pass: dict[Hashable, dict[int, list[float]]] = field(default_factory=dict)
    ramp_tokens: dict[Hashable, dict[tuple[int, int], list[float]]] = field(default_factory=dict)
    all_accepted: dict[Hashable, dict[int, list[float]]] = field(default_factory=dict)
    ar_handovers: dict[Hashable, int] = field(default_factory=dict)
    ar_timings: dict[Hashable, int] = field(default_factory=dict)  # decodes since AR's pass was timed; intervals
    starting_costs: dict[int, list[tuple[int, float]]] = field(default_factory=dict)
    shape_rates: dict[Hashable, Any] = field(default_factory=dict)  # the shape chooser's pooled acceptance, by spec
    settings: ChooserSettings = field(default_factory=ChooserSettings)
    clock: Callable[[], float] = time.perf_counter  # seconds of a step: wall clock (time.process_time: CPU time)
    #: whether decodes' timings extend the curve (a pinned curve's subclass drops them: nothing to re-time there)
    measures_costs: ClassVar[bool] = True

    def costs(self, key: Hashable) -> dict[int, list[tuple[int, float]]]:
        """Step times of cost key ``key``, by window."""
        if key not in self.step_costs:
            self.step_costs[key] = {window: list(values) for window, values in self.starting_costs.items()}
        return self.step_costs[key]

    def acceptance(self, spec: Hashable) -> tuple[dict, dict, dict]:
        """``(tokens per pass, ramp tokens, all-accepted shares)`` of decoding spec ``spec``, by window."""
        for table in (self.tokens_per_pass, self.ramp_tokens, self.all_accepted):
            table.setdefault(spec, {})
        return self.tokens_per_pass[spec], self.ramp_tokens[spec], self.all_accepted[spec]


def _append(table: dict[int, list], window: int, value: Any) -> None:
    values = table.setdefault(window, [])
    values.append(value)
    del values[:-KEEP]


def depth_rates(hits: np.ndarray, tries: np.ndarray, prior: float, shrink: float) -> np.ndarray:
    """Acceptance rates per chain depth, smoothed down the depths: ``r_d = (hits_d + shrink r_{d-1}) / (tries_d +
    shrink)`` with ``r_{-1} = prior``, so an unmeasured depth borrows the deepest measured one's rate. The dLLM
    draft-length chooser (:mod:`vispec.dllm.draft_length`) estimates with it; the image half's shape chooser shrinks
    towards each depth's pooled tail instead (:meth:`vispec.decoding.shapes.ShapeRates.rates`: Jacobi drafts'
    acceptance rises after depth 1 and falls a row ahead)."""
    rates = np.empty(len(hits))
    previous = prior
    for d in range(len(hits)):
        previous = (hits[d] + shrink * previous) / (tries[d] + shrink)
        rates[d] = previous
    return rates


def robust_line(samples: list[tuple[int, float]], span: int = SPAN) -> Optional[tuple[float, float]]:
    """``(intercept, slope)`` of seconds against cache length, None if the samples span fewer than ``span`` positions
    (:data:`SPAN`). Robust to steps slowed by other work on the machine: the slope joins the medians of the shorter
    and the longer half of the samples (at least 0), the line passes through the medians of all."""
    ordered = sorted(samples)
    if ordered[-1][0] - ordered[0][0] < span:
        return None
    half = len(ordered) // 2
    low, high = ordered[:half], ordered[-half:]
    rise = statistics.median(t for _, t in high) - statistics.median(t for _, t in low)
    run = statistics.median(length for length, _ in high) - statistics.median(length for length, _ in low)
    slope = max(rise / run, 0.0) if run > 0 else 0.0
    return statistics.median(t for _, t in ordered) - slope * statistics.median(length for length, _ in ordered), slope


def cost_growth(costs: dict[Hashable, list[tuple[int, float]]]) -> float:
    """Relative growth ``g`` of step time per cached token (``t(L) = t(0) (1 + g L)``), pooled over every window's
    samples: each sample's time over its window's median time against its cache length minus the window's median
    length, through the robust line of :func:`robust_line`; that slope ``s`` is relative to the time at the median length
    ``m`` (the samples' median of their windows' median lengths), so ``g = s / (1 - s m)``. 0 until the pooled lengths
    span :data:`SPAN` positions. Pooling keeps one window's few, noisy samples from setting every window's slope."""
    points: list[tuple[int, float]] = []
    middles: list[float] = []
    for samples in costs.values():
        if len(samples) < 2:
            continue
        level = statistics.median(t for _, t in samples)
        middle = statistics.median(length for length, _ in samples)
        if level > 0:
            points.extend((length - middle, t / level - 1.0) for length, t in samples)
            middles.extend([middle] * len(samples))
    line = robust_line(points) if points else None
    if line is None:
        return 0.0
    slope, middle = line[1], statistics.median(middles)
    return slope / max(1.0 - slope * middle, 0.1)


def predict_cost(samples: list[tuple[int, float]], at: int, growth: float = 0.0) -> float:
    """A step's seconds at cache length ``at`` from ``(L, seconds)`` samples: their robust line
    (:func:`robust_line`) once they span :data:`SPAN` positions; before, their median scaled by
    ``1 + growth * L`` (``growth``: the relative slope of a window whose samples do span, 0 if none)."""
    line = robust_line(samples)
    if line is not None:
        return line[0] + line[1] * at
    return scaled_level(cost_level(samples), at, growth)


def cost_level(samples: list[tuple[int, float]]) -> tuple[float, float]:
    """``(median seconds, median cache length)`` of ``(L, seconds)`` samples: a cost curve's level where it has no line
    of its own."""
    return statistics.median(t for _, t in samples), statistics.median(length for length, _ in samples)


def scaled_level(level: tuple[float, float], at: int, growth: float) -> float:
    """The seconds of :func:`cost_level` ``level`` moved to cache length ``at`` along relative growth ``growth``
    (``t(L) = t(0) (1 + growth L)``)."""
    seconds, length = level
    return seconds * (1 + growth * at) / (1 + growth * length)


def hand_to_ar(stats: WindowStats, key: Hashable, growth: int = 1) -> bool:
    """A chooser that found no window (shape) beating AR hands the decode to AR: count it under cost key ``key``, and
    answer False (run the chooser after all, so its measurements stay fresh) every
    :attr:`~ChooserSettings.recheck`-th time. ``growth > 1``: the interval doubles after each such recheck, up to
    ``growth`` times :attr:`~ChooserSettings.recheck` (a recheck that confirmed the hand-over makes the next less
    needed; :func:`restart_rechecks` puts it back)."""
    handovers = stats.ar_handovers
    interval = handovers.get((key, "interval"), stats.settings.recheck)
    handovers[key] = handovers.get(key, 0) + 1
    if handovers[key] < interval:
        return True
    handovers[key] = 0
    if growth > 1:
        handovers[(key, "interval")] = min(2 * interval, growth * stats.settings.recheck)
    return False


def restart_rechecks(stats: WindowStats, key: Hashable) -> None:
    """The recheck interval of :func:`hand_to_ar` under ``key`` back to :attr:`~ChooserSettings.recheck`."""
    stats.ar_handovers.pop((key, "interval"), None)


class WindowChooser:
    """Picks each pass's window (module docstring): :meth:`choose` before the pass, :meth:`record` after it.

    Args:
        largest: the largest window.
        stats: the measurements to use and extend (:class:`WindowStats`; default: a new, empty one).
        key: the cost key (:func:`cost_key`); ``tokens_key``: what acceptance depends on (the decoding spec;
            default ``key``).
        clock: seconds, for step times (default: ``stats.clock``, the wall clock unless set).
        slots: the batch slots; step times are recorded only while every slot is live (a batch that
            sheds finished samples runs cheaper passes near its end, which would flatter the windows that
            ran then, as tokens are counted per live sample).

    (SJD-PAC's trees and the ``"auto"`` decoder choose among more shapes than windows:
    :mod:`vispec.decoding.shapes`.)
    """

    def __init__(self, largest: int, stats: Optional[WindowStats] = None, key: Hashable = "", tokens_key: Hashable = None,
                 clock: Optional[Callable[[], float]] = None, slots: Optional[int] = None):
        self.windows, self.key, self.slots = window_set(largest), key, slots
        self._live = slots
        self.stats = WindowStats() if stats is None else stats
        self.clock = self.stats.clock if clock is None else clock
        self._scripted = 0  # blocks run of settings.script
        self.settings = self.stats.settings
        self.costs = self.stats.costs(key)
        self.tokens, self.ramp, self.all_accepted = self.stats.acceptance(key if tokens_key is None else tokens_key)
        self.history: list[int] = []
        self.passes = 0
        self._current: Optional[int] = None
        self._left = 0  # passes left in the current block
        self._in_block = 0
        self._interval = self.settings.refresh
        self._next_refresh = self.settings.refresh
        self._refreshing: Optional[int] = None  # the best window while a neighbour is re-measured
        self._at = 0
        self._remaining: Optional[int] = None  # tokens the slowest live sample lacks (None: unbounded)
        self._from = 0  # the window the current block's drafts were made with (0: none)
        self._settle = 0
        self._run: list[int] = []  # unsynced passes since the last read-back: their cache lengths
        self._run_start: Optional[float] = None
        self._warm: set[int] = set(self.costs)  # windows whose first (compiling, warming) step is behind

    # ---- estimates ---------------------------------------------------------------------------------

    def expected_tokens(self, window: int) -> Optional[float]:
        """Measured committed tokens per live sample per pass at ``window`` (1 for AR), None if unmeasured."""
        if window == 1:
            return 1.0
        values = self.tokens.get(window)
        return statistics.fmean(values) if values else None

    def cost(self, window: int, at: int = 0, growth: Optional[float] = None) -> Optional[float]:
        """Seconds per step at ``window`` with ``at`` cached tokens, None if unmeasured."""
        samples = self.costs.get(window)
        return predict_cost(samples, at, self._growth() if growth is None else growth) if samples else None

    def _growth(self) -> float:
        """Relative growth of step time per cached token (:func:`cost_growth`)."""
        return cost_growth(self.costs)

    def rate(self, window: int, need: int, at: int = 0, growth: Optional[float] = None,
             remaining: Optional[int] = None) -> Optional[float]:
        """Tokens per second per live sample at ``window`` (a pass commits at most ``need`` tokens), over the
        ``remaining`` tokens of the slowest sample including the ramp still ahead (module docstring; None:
        the steady rate)."""
        tokens, cost = self.expected_tokens(window), self.cost(window, at, growth)
        if tokens is None or cost is None:
            return None
        steady = min(tokens, need)
        ramp_passes, ramp_tokens = self._ramp(window)
        if remaining is None or ramp_passes == 0 or remaining <= 0:
            return steady / cost
        ramp_tokens = min(ramp_tokens, steady)
        ramped = min(ramp_passes, remaining / ramp_tokens)
        passes = ramped + (remaining - ramped * ramp_tokens) / steady
        return remaining / (passes * cost)

    def _ramp(self, window: int) -> tuple[float, float]:
        """``(passes, tokens per pass)`` of the ramp still ahead if the next pass runs ``window``: the rest of
        the current block's settling passes, or a new block's; tokens measured for the same ``(from,
        window)``, else from no drafts, else 1 (a pass commits its sampled token; a ramp measured from
        another window's drafts says little about one from none)."""
        if window == 1:
            return 0, 1.0
        if window == self._current:
            passes, source = max(self._settle - self._in_block, 0), self._from
        else:
            passes, source = self._settle_passes(window), self._drafts_from()
        values = self.ramp.get((source, window)) or self.ramp.get((0, window))
        return passes, (statistics.fmean(values) if values else 1.0)

    def _settle_passes(self, window: int) -> int:
        return 0 if window == 1 else max(self.settings.settle, window // self.settings.maturity)

    def _drafts_from(self) -> int:
        """The window the drafts a new block starts from were made with (0: none)."""
        return self._current if self._current is not None and self._current > 1 else 0

    # ---- decisions ---------------------------------------------------------------------------------

    def choose(self, need: int, at: int = 0, live: int = 1, remaining: Optional[int] = None) -> int:
        """The window for the next pass; ``need``: the widest window any live sample can still use; ``at``:
        the longest cached length (eager steps cost more as it grows); ``live``: samples in the pass;
        ``remaining``: tokens the slowest live sample lacks (None: rates without the ramp)."""
        self._remaining = remaining
        candidates = [w for w in self.windows if w < need] + [round_up(need, self.windows)]
        if self._left <= 0 or self._current not in candidates:
            self._start_block(self._pick(candidates, need, at), live)
        self._left -= 1
        self.history.append(self._current)
        self._at, self._live = at, live
        if self._run_start is None:
            self._run_start = self.clock()
        return self._current

    def must_sync(self) -> bool:
        """Whether the pass just chosen needs a read-back even at window 1: its block ends (so the next
        choice sees its time), or its window's first step (compiling, warming) is to be left out."""
        return self._left <= 0 or self._current not in self._warm

    def prefers_ar(self, num_tokens: int) -> bool:
        """Whether a whole decode of ``num_tokens`` should run as plain AR: window 1 has the best measured
        rate at mid-decode and no unmeasured wider window could beat it (never while calibrating: ``settings.script``).
        AR's own steps are cheaper than
        the speculative decoder's window-1 passes, and no pass is spent exploring. Every
        :attr:`recheck`-th such decode (per cost key) runs the chooser instead, so measurements stay fresh."""
        if self.settings.script:
            return False
        at, growth = num_tokens // 2, self._growth()
        self._remaining = num_tokens  # a whole decode, from no drafts
        scores = {w: self._score(w, num_tokens, at, growth) for w in self.windows}
        if scores[1] is None:
            return False
        measured = [w for w in self.windows if scores[w] is not None]
        widest = max(measured)
        wider = next((w for w in self.windows if w > widest), None)
        if max(measured, key=lambda w: scores[w]) != 1 or (
                wider is not None and self._ceiling(widest, wider, num_tokens, at, growth) > scores[1]):
            return False
        return hand_to_ar(self.stats, self.key)

    def _score(self, window: int, need: int, at: int, growth: float) -> Optional[float]:
        rate = self.rate(window, need, at, growth, self._remaining)
        return None if rate is None else rate / (1 + self.settings.margin if window > 1 else 1)

    def _ceiling(self, window: int, wider: int, need: int, at: int, growth: float) -> float:
        """The best score ``wider`` could have, from ``window``'s measurements: its extra draft rows help only
        samples that accepted every draft of ``window``, by at most the extra rows, it costs at least what
        ``window`` costs, and its ramp is taken as free."""
        share = self.all_accepted.get(window)
        share = 1.0 if window == 1 else (statistics.fmean(share) if share else 1.0)
        tokens = min(self.expected_tokens(window) + share * (wider - window), need)
        return tokens / self.cost(window, at, growth) / (1 + self.settings.margin)

    def _pick(self, candidates: list[int], need: int, at: int) -> int:
        if self.settings.script:  # calibration: the scripted windows in turn (the widest candidate near the end)
            window = self.settings.script[self._scripted % len(self.settings.script)]
            self._scripted += 1
            return min(round_up(window, self.windows) if window <= self.windows[-1] else self.windows[-1], candidates[-1])
        growth = self._growth()
        scores = {w: self._score(w, need, at, growth) for w in candidates}
        if scores[1] is None:
            return 1
        if self._refreshing is not None:  # a re-measurement just ended: did it confirm the best?
            measured = [w for w in candidates if scores[w] is not None]
            if max(measured, key=lambda w: scores[w]) == self._refreshing:
                self._interval *= 2
            self._refreshing = None
            self._next_refresh = self.passes + self._interval
        measured = [w for w in candidates if scores[w] is not None]
        best = max(measured, key=lambda w: scores[w])
        at_best = candidates.index(best)
        widest = max(measured)
        wider = next((w for w in candidates if w > widest), None)
        if wider is not None and scores[wider] is None and self._ceiling(widest, wider, need, at, growth) > scores[best]:
            return wider  # climbing: the next wider window could beat the best so far
        if self.passes >= self._next_refresh:
            neighbours = [candidates[i] for i in (at_best + 1, at_best - 1) if 0 <= i < len(candidates) and i != at_best]
            close = [w for w in neighbours if scores[w] is None or scores[w] >= self.settings.near * scores[best]]
            if close:
                self._refreshing = best
                return close[self.passes // self._interval % len(close)]
            self._next_refresh = self.passes + self._interval
        return best

    def _start_block(self, window: int, live: int) -> None:
        """A block of ``window``: its settling passes (none if the window continues), then counted ones."""
        settle = 0 if window == self._current or self.settings.script else self._settle_passes(window)
        counted = self.settings.block if window == 1 or self.settings.script else max(
            self.settings.block, -(-self.settings.samples // max(live, 1)))
        self._from = self._from if window == self._current else self._drafts_from()
        self._current, self._left, self._in_block = window, settle + counted, 0
        self._settle = settle

    def record(self, window: int, num_accepted: list[int], widths: list[int], synced: bool = True) -> None:
        """After the pass: each live sample's accepted drafts and width; ``synced``: whether the pass ended
        with a read-back (then the time since the last read-back is the cost of the passes in between)."""
        self.passes += 1
        self._in_block += 1
        self._run.append(self._at)
        if synced:
            elapsed = self.clock() - self._run_start
            if window in self._warm and (self.slots is None or self._live == self.slots):
                per_pass = elapsed / len(self._run)
                for at in self._run:
                    _append(self.costs, window, (at, per_pass))
            self._warm.add(window)
            self._run, self._run_start = [], None
        full = [m + 1 for m, width in zip(num_accepted, widths) if width >= window]  # samples not cut short by N
        if window > 1 and full and self._in_block > self._settle:
            _append(self.tokens, window, statistics.fmean(full))
            _append(self.all_accepted, window, statistics.fmean(t == window for t in full))
        elif window > 1 and full:
            _append(self.ramp, (self._from, window), statistics.fmean(full))


# ---- calibration: the cost curve the chooser and the roofline report share ------------------------------------


def calibrate_step_costs(model: Any, condition: Any, num_tokens: int, stats: WindowStats, windows: list[int], *,
                         decoding: str = "mc-sjd", compile: bool = False, sampling: Any = None, generator: Any = None,
                         block: int = 4, decodes: int = 1) -> Hashable:
    """Measure whole decode steps of every window in ``windows`` into ``stats.step_costs`` (in ``stats.clock``'s
    seconds) and return their cost key (:func:`cost_key`; the slots are the condition's batch).

    ``decodes`` ``window="auto"`` decodes of ``num_tokens`` tokens whose chooser runs the windows in turn, ``block`` passes
    each (:attr:`ChooserSettings.script`), and records the step times as any chooser does: per pass, with its
    cached length, the first (compiling, warming) step of each window left out, window-1 passes timed as a run up
    to the read-back that ends it. The windows cycle through the whole decode, so every window is measured over
    the whole range of cache lengths and its robust line (:func:`predict_cost`) gives its cost at any length.
    Only the step times are shared with ``stats`` (the scripted decode's acceptance says nothing about a chosen
    window's), so a chooser using ``stats`` starts from the calibration and extends it. The step of ``decoding``
    (a ``sjd`` or ``mc-sjd`` spec; default MC-SJD, maximal coupling) is what is timed; the chooser keys its costs
    by device, dtype, batch slots and compile setting, not by the spec."""
    from vispec.checks import check_int
    from vispec.decoding import DecodingConfig, decode

    check_int("num_tokens", num_tokens, minimum=2)
    check_int("block", block, minimum=1)
    check_int("decodes", decodes, minimum=1)
    if not windows or any(not isinstance(w, int) or w < 1 for w in windows):
        raise ValueError(f"windows must be a non-empty list of ints >= 1, got {windows!r}")
    config = DecodingConfig.parse(DecodingConfig.parse(decoding), window="auto")
    if config.strategy not in ("sjd", "mc-sjd"):
        raise ValueError(f"decoding must be an sjd or mc-sjd spec, got {decoding!r}")
    script = WindowStats(step_costs=stats.step_costs, starting_costs=stats.starting_costs, clock=stats.clock,
                         settings=ChooserSettings(block=block, script=tuple(sorted(set(windows)))))
    for _ in range(decodes):  # the first step of a window is left out in the first decode only (the chooser's rule)
        out = decode(model, condition, num_tokens=num_tokens, sampling=sampling, decoding=config, generator=generator,
                     compile=compile, window_stats=script)
    return cost_key(model, int(out.tokens.shape[0]), compile)


def relative_step_costs(stats: WindowStats, key: Hashable, at: int) -> dict[int, float]:
    """``c(W, at) / c(1, at)`` for every window with measured steps under cost key ``key``: the seconds a chooser
    predicts for a step at ``at`` cached tokens (:func:`predict_cost` with :func:`cost_growth`, as
    :meth:`WindowChooser.cost`), over window 1's. Empty when window 1 is unmeasured."""
    costs = stats.step_costs.get(key, {})
    if not costs.get(1):
        return {}
    growth = cost_growth(costs)
    # windows in order; a curve that also holds the shape chooser's labels (str) lists them after the windows
    ordered = sorted(costs.items(), key=lambda item: (isinstance(item[0], str), item[0] if isinstance(item[0], int) else 0,
                                                     str(item[0])))
    seconds = {w: predict_cost(samples, at, growth) for w, samples in ordered if samples}
    return {w: s / seconds[1] for w, s in seconds.items()}


# ---- the cost curve on disk: a second process on the same machine starts from it ----------------------------------


def cost_cache_dir() -> Optional[str]:
    """Where measured cost curves are kept: ``$VISPEC_CACHE_DIR`` (``off``: nowhere), else
    ``$XDG_CACHE_HOME/vispec`` or ``~/.cache/vispec``; a folder ``step-costs`` below it."""
    import os

    root = os.environ.get("VISPEC_CACHE_DIR")
    if root is not None and root.strip().lower() in ("off", "0", "none", ""):
        return None
    if root is None:
        root = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "vispec")
    return os.path.join(root, "step-costs")


def machine_fingerprint(model: Any, key: Hashable) -> str:
    """What a cost curve depends on: the model's architecture (its config and parameter count, not its weights), the
    cost key (device, dtype, batch slots, compile setting, step kind), torch's and vispec's versions (and
    :data:`STEP_CODE_REVISION`), threads, and the processor. A hex digest, the cache file's name."""
    import hashlib
    import json
    import platform

    import torch

    config = getattr(model, "config", None)
    config = dict(config) if isinstance(config, dict) or hasattr(config, "items") else repr(config)
    params = sum(p.numel() for p in model.parameters()) if hasattr(model, "parameters") else 0
    processor = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as handle:
            processor = next((line.split(":", 1)[1].strip() for line in handle if line.startswith("model name")), processor)
    except OSError:
        pass
    if torch.cuda.is_available():
        processor += " / " + torch.cuda.get_device_name()
    from vispec.version import __version__

    text = json.dumps([type(model).__name__, config, params, repr(key), torch.__version__, torch.get_num_threads(),
                       processor, __version__, STEP_CODE_REVISION], sort_keys=True, default=str)
    return hashlib.sha1(text.encode()).hexdigest()[:20]


def weights_fingerprint(model: Any) -> str:
    """What acceptance rates depend on in a model: its class and its weights (names, shapes and up to 256 evenly
    spaced values of each parameter, read once, in float64). A hex digest; unlike :func:`machine_fingerprint` it
    changes with the weights (a retrained checkpoint accepts differently) and not with the machine."""
    import hashlib

    import torch

    digest = hashlib.sha1(type(model).__name__.encode())
    named = model.named_parameters() if hasattr(model, "named_parameters") else ()
    with torch.no_grad():
        for name, param in named:
            flat = param.detach().reshape(-1)
            picked = flat[:: max(flat.numel() // 256, 1)][:256].to("cpu", torch.float64)
            digest.update(f"{name}{tuple(param.shape)}".encode())
            digest.update(picked.numpy().tobytes())
    return digest.hexdigest()[:20]


def load_step_costs(stats: WindowStats, model: Any, key: Hashable) -> bool:
    """Fill ``stats``'s step times of cost key ``key`` from this machine's cache (:func:`cost_cache_dir`) where it
    has none yet; whether anything was loaded. A missing or unreadable file loads nothing."""
    import json
    import os

    folder = cost_cache_dir()
    if folder is None or stats.costs(key):
        return False
    path = os.path.join(folder, machine_fingerprint(model, key) + ".json")
    try:
        with open(path) as handle:
            data = json.load(handle)
        costs = {label: [(int(at), float(t)) for at, t in samples] for label, samples in data["costs"].items()}
    except (OSError, ValueError, KeyError, TypeError):
        return False
    stats.step_costs[key] = costs
    return bool(costs)


def save_step_costs(stats: WindowStats, model: Any, key: Hashable, *, minimum: int = 3) -> Optional[str]:
    """Write the step times of cost key ``key`` (labels with at least ``minimum`` samples) to this machine's cache;
    the file's path, None if caching is off or nothing was measured. Written atomically (a rename)."""
    import os

    folder = cost_cache_dir()
    costs = {str(label): samples for label, samples in stats.step_costs.get(key, {}).items() if len(samples) >= minimum}
    if folder is None or not costs:
        return None
    return write_json_atomically(os.path.join(folder, machine_fingerprint(model, key) + ".json"),
                                 {"key": repr(key), "costs": costs})


def write_json_atomically(path: str, payload: Any) -> str:
    """Write ``payload`` as JSON to ``path`` through a temporary file and a rename, so a reader in another process
    never sees half a file; its folder is made if missing. Returns ``path``."""
    import json
    import os
    import tempfile

    folder = os.path.dirname(path)
    os.makedirs(folder, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=folder, delete=False, suffix=".tmp") as handle:
        handle.write(json.dumps(payload))  # json.dump encodes in Python; dumps in C (5 ms against 0.3 for a rates file)
    os.replace(handle.name, path)
    return path
