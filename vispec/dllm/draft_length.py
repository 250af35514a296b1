r"""``speculative="auto"``: the draft length of every self-speculative round, by expected reference steps per second.

A round of self-speculation (:mod:`vispec.dllm.speculative`) with draft length ``k`` drafts ``k - 1`` steps from the
stale logits and verifies the ``k`` canvases of every live row in one forward. Its output is the stepwise run's for
*any* sequence of draft lengths (each canvas is kept only once proven), so ``k`` may change from round to round on
anything at all; this module picks it for speed, as the image half's shape chooser does
(:mod:`vispec.decoding.shapes`, Sequoia's hardware-aware choice, Chen et al. 2024, arXiv 2402.12374):

**Expected steps.** Let ``a_d`` be the probability that the ``d``-th draft of a chain is verified given the ``d - 1``
before it were. A round of draft length ``k`` advances ``E[T_k] = 1 + sum_{d=1}^{k-1} prod_{j<=d} a_j`` reference
steps per row. ``a_d`` is counted from the verified rounds (a chain that verified ``j`` drafts of the ``m`` it had:
hits at depths ``1..j``, a miss at ``j + 1`` when ``j < m``), pooled over this model's decodes with the same policy
and settings (a decode is a few rounds: its own counts alone would leave the prior in charge), smoothed down the
depths (depth ``d``'s
counts plus :data:`SHRINK` pseudo-observations of depth ``d - 1``'s rate), so an unmeasured depth borrows the
deepest measured one's rate, never a flattering prior.

**Cost.** A round's seconds (drafting, the verifying forward and the verification) against the canvases it forwarded,
``n`` rows times ``k`` (fewer where chains end at a block's end): a robust line (Theil-Sen through the median time of
each canvas count: most rounds share one width, and a fit over raw rounds would take its scatter for the slope),
kept in a :class:`~vispec.decoding.windows.WindowStats` under the decode's cost key (model, device, dtype, batch,
cache), per model for the process (:func:`model_costs`), so later decodes of the model start from it. Until it has two
distinct widths measured the chooser explores: one round at each of :data:`EXPLORE` (capped by the largest ``k``),
narrow ones, since a wide round of a large batch costs many stepwise ones; wider rounds' costs are the line's.

**Choice.** ``argmax_k n E[T_k] / t(n k)`` over :data:`CANDIDATES` up to the largest, re-scored every round (a few
numpy operations; rounds cost milliseconds at least), among the ``k`` whose rounds forward at most twice the canvases
of the widest round measured (the line is a fit, not a law: on a CPU 4 and 16 canvases may cost alike and 64 four
times more), if it beats ``k = 1`` by :data:`MARGIN` (else ``k = 1``: on a machine where canvases cost in
proportion, a few percent of predicted gain is noise, and a lost bet costs more); at round :data:`WIDER_EVERY` of a
decode, then 16, 32, ... (the interval doubling), the next larger ``k`` than the best runs once, so deeper rates
keep being measured at a cost that shrinks with the decode's length. Where no ``k`` beats ``k = 1`` for a whole
decode's batch, :func:`vispec.dllm.decode` runs the stepwise loop instead
(:meth:`DraftLengthChooser.prefers_stepwise`): its steps cost less than ``k = 1`` rounds.

**Measured decodes.** The choice above compares draft lengths with ``k = 1`` *rounds*, which cost more than the
stepwise loop's steps (the drafting and verification machinery runs even for one canvas), so a draft length that
beats ``k = 1`` can still lose to the stepwise loop: on tiny-llada2 (``editing@prefix``, batch 4) the chooser settled
on ``k = 2, 3`` and decoded 0.85x as fast as the stepwise loop. So every ``"auto"`` decode also records its seconds per
reference step (the stepwise loop's steps, or the steps its rounds advanced; the batch's longest row) and its mode,
under the cost key (:meth:`DraftLengthChooser.record_decode`). Once speculative decodes are measured, one stepwise
decode measures the baseline (it costs what the user's stepwise run costs), and from then on a decode speculates only
while, among the last :data:`DECODES_KEPT` decodes, the speculative ones' median seconds per step are below the
stepwise ones' (measured, not predicted: no margin). Whichever mode runs, now and then a decode runs the other (every
recheck-th at first, the interval doubling after each such recheck up to :data:`RECHECK_GROWTH` times, so that a
settled choice costs ever less to confirm), so both stay among the recent decodes: a step's cost depends on the
workload (how many of its forwards are the cache refreshes), so the two are compared on decodes close in time.
"""

from __future__ import annotations

import time
import weakref
from typing import Any, Callable, Hashable, Optional

import numpy as np
from torch import Tensor

from vispec.decoding.windows import WindowStats, depth_rates, hand_to_ar, restart_rechecks

CANDIDATES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)
EXPLORE = (1, 2, 4)  # the first rounds' draft lengths, for the cost line (narrow: cheap at any batch size)
SHRINK = 4.0
PRIOR = 0.5  # the rate of a depth nothing has measured yet (depth 1 only; deeper ones borrow)
MARGIN = 0.1  # the predicted gain over k = 1 a longer draft must show
WIDER_EVERY = 8  # the first round that tries a larger k than the best; then rounds 16, 32, 64, ...
KEEP = 64  # cost samples kept
RECHECK_GROWTH = 8  # a hand-over's recheck interval grows from ChooserSettings.recheck to this many times it
DECODES_KEPT = 64  # the recent decodes whose seconds per step decide between the modes (both modes among them)
_MODEL_COSTS: "weakref.WeakKeyDictionary[Any, WindowStats]" = weakref.WeakKeyDictionary()


def model_chooser(model: Any, batch: int, device: Any, options: Any, scheduler: Any) -> DraftLengthChooser:
    """The chooser of a ``speculative="auto"`` decode of ``model`` (``options``: its
    :class:`~vispec.dllm.options.UnmaskingOptions`): costs kept per model (:func:`model_costs`) under the cost key
    (model class, device, batch, cache, guidance on or off), acceptance pooled under the policy and the settings that
    change it (the scheduler's config, cache, sampling or not, guidance scale, early stop)."""
    return DraftLengthChooser(
        options.speculative.max_draft_length, stats=model_costs(model),
        key=("dllm", type(model).__name__, str(device), batch, options.cache, options.guidance_scale != 1),
        rates_key=("dllm", repr(scheduler), options.cache, options.temperature > 0, options.guidance_scale,
                   options.early_stop_eos))


def model_costs(model: Any) -> WindowStats:
    """The round costs measured on ``model`` in this process, kept while the model lives (weakly referenced), so the
    next decode of the same model starts from them instead of exploring again: a decode of a few rounds would
    otherwise spend most of them measuring. Cost keys separate devices, batch sizes, caches and guidance."""
    try:
        return _MODEL_COSTS.setdefault(model, WindowStats())
    except TypeError:  # an object that cannot be weakly referenced: its decodes measure afresh
        return WindowStats()


class DraftLengthChooser:
    """Picks the draft length of every round (module docstring): :meth:`choose` before it, :meth:`record` after it.

    Args:
        largest: the largest draft length (``SelfSpeculation.max_draft_length``).
        stats: where the cost samples are kept between decodes (:func:`model_costs`), under ``key``.
        clock: the round's seconds (``stats.clock``: the wall clock unless set).
        rates_key: where the acceptance counts are pooled over decodes in ``stats`` (the policy and the settings
            that change how deep chains verify); None: this decode's own counts only.
    """

    def __init__(self, largest: int, stats: Optional[WindowStats] = None, key: Hashable = ("dllm",),
                 clock: Optional[Callable[[], float]] = None, rates_key: Optional[Hashable] = None):
        self.lengths = [k for k in CANDIDATES if k < largest] + [largest]
        self.stats, self.key = WindowStats() if stats is None else stats, key
        self.samples: list[tuple[int, float]] = self.stats.costs(key).setdefault("round", [])
        self._fit: Optional[tuple[Any, tuple]] = None  # (the samples' state, (line, floor)): _fitted's last answer
        self.clock = clock or self.stats.clock or time.perf_counter
        zeros = np.zeros((largest + 1, 2))  # depth d: (verified, tried)
        self.counts = zeros if rates_key is None else self.stats.shape_rates.setdefault((rates_key, largest), zeros)
        self.explore = [] if self._line() is not None else self._exploration()
        self.rounds, self.wider_at = 0, WIDER_EVERY
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

    def _exploration(self) -> list[int]:
        return sorted({min(k, self.lengths[-1]) for k in EXPLORE})

    def _line(self) -> Optional[tuple[float, float]]:
        """``(intercept, slope)`` through the median round time of each canvas count (Theil-Sen: the median of the
        pairwise slopes, at least 0), so the common width, however many rounds ran it, is one point among the
        others and cannot flatten the line. Fitted again only when a round was recorded since (a round asks for
        it several times, and a fit costs about a millisecond: 5% of a small model's round)."""
        return self._fitted()[0]

    def _fitted(self) -> tuple[Optional[tuple[float, float]], float]:
        """The line (:meth:`_line`) and the cost floor (:meth:`cost`) of the samples as they are now."""
        state = hash(tuple(self.samples))  # microseconds for KEEP samples
        if self._fit is not None and self._fit[0] == state:
            return self._fit[1]
        by_width: dict[int, list[float]] = {}
        for width, seconds in self.samples:
            by_width.setdefault(width, []).append(seconds)
        line = None
        if len(by_width) >= 2:
            widths = np.array(sorted(by_width), dtype=float)
            times = np.array([np.median(by_width[int(w)]) for w in widths])
            i, j = np.triu_indices(len(widths), 1)
            slope = max(float(np.median((times[j] - times[i]) / (widths[j] - widths[i]))), 0.0)
            line = (float(np.median(times - slope * widths)), slope)
        floor = max(0.05 * float(np.median([t for _, t in self.samples])), 1e-9) if self.samples else 1e-9
        self._fit = (state, (line, floor))
        return line, floor

    def cost(self, canvases: np.ndarray) -> Optional[np.ndarray]:
        """Seconds of rounds forwarding ``canvases`` canvas rows (each entry), None before the line is known (at least
        5% of the median round: a line through noisy rounds may cross zero)."""
        line, floor = self._fitted()
        if line is None:
            return None
        return np.maximum(line[0] + line[1] * np.asarray(canvases, dtype=float), floor)

    # ---- decisions ------------------------------------------------------------------------------------------

    def choose(self, rows: int) -> int:
        """The draft length of the next round of ``rows`` live rows."""
        self._start = self.clock()
        if not self.explore and self._line() is None:  # the rounds so far forwarded one width only: explore again
            self.explore = self._exploration()
        if self.explore:
            k = self.explore.pop(0)
        else:
            best = self._best(rows)
            if self.rounds >= self.wider_at:
                self.wider_at *= 2  # the interval doubles: the exploring rounds' cost shrinks to nothing
                best = min(best + 1, len(self.lengths) - 1)  # the next larger one runs once: deeper rates stay measured
            k = self.lengths[best]
        self.chosen[k] = self.chosen.get(k, 0) + 1
        return k

    def _best(self, rows: int) -> int:
        """The index in :attr:`lengths` of the fastest draft length for ``rows`` rows (the cost line is known)."""
        speed = rows * self.expected_steps() / self.cost(rows * np.asarray(self.lengths))
        widest = max(canvases for canvases, _ in self.samples)
        speed[rows * np.asarray(self.lengths) > 2 * widest] = 0.0  # the line is not stretched past twice the widest
        best = int(np.argmax(speed))  # round measured: wider ones are reached by doubling, each measured in its turn
        return best if speed[best] >= (1 + MARGIN) * speed[0] else 0  # k = 1 unless drafting clearly pays: a
        # predicted gain this small is within the line's error

    def prefers_stepwise(self, rows: int) -> bool:
        """Whether a whole decode of ``rows`` rows should run as the stepwise loop: the cost line and acceptance are
        measured and no draft length beats ``k = 1`` (whose rounds cost more than the stepwise loop's steps), or
        the measured speculative decodes have not beaten the stepwise ones (module docstring; the first decode
        after speculative ones are measured runs stepwise, to measure it). Every
        :attr:`~vispec.decoding.windows.ChooserSettings.recheck`-th such decode per cost key runs the chooser instead
        (as the image half's :func:`vispec.decoding.windows.hand_to_ar`, but with the interval doubling after each
        recheck, :meth:`_handed`), so the measurements stay fresh at a cost that shrinks."""
        if self.explore or self.counts[1, 1] == 0:
            return False
        if self._best(rows) == 0:
            return self._handed(self.key)
        speculative, stepwise = self.step_seconds(stepwise=False), self.step_seconds(stepwise=True)
        if stepwise is None:  # measure the baseline: this decode costs what the stepwise run costs anyway
            return True
        if speculative is None:  # the recent decodes hold no speculative one: measure it
            return False
        if speculative > stepwise:  # measured decodes: drafting has not paid (module docstring)
            return self._handed(self.key)
        restart_rechecks(self.stats, self.key)  # drafting pays: a later hand-over rechecks soon again
        return not self._handed((self.key, "probe"))  # every so often a decode probes the stepwise loop

    def _handed(self, label: Hashable) -> bool:
        """Count a decode that :meth:`prefers_stepwise` would hand over (or, under ``(key, "probe")``, keep
        speculative) and answer True, except every ``interval``-th time, when the other mode runs
        (:func:`~vispec.decoding.windows.hand_to_ar` with growth): the interval starts at
        :attr:`~vispec.decoding.windows.ChooserSettings.recheck` and doubles after every recheck, up to
        :data:`RECHECK_GROWTH` times it. A recheck costs (a decode of ``k = 1`` rounds, dearer than stepwise steps, or a
        stepwise one), and one that confirmed the choice makes the next less needed."""
        return hand_to_ar(self.stats, label, RECHECK_GROWTH)

    def record_decode(self, stepwise: bool, seconds: float, steps: int) -> None:
        """After a whole decode under this cost key: its ``seconds`` over the reference ``steps`` it advanced (the
        batch's longest row) and its mode (the stepwise loop, or self-speculative rounds), the last
        :data:`DECODES_KEPT` decodes in order."""
        if steps > 0:
            samples = self.stats.costs(self.key).setdefault("decodes", [])
            samples.append((int(stepwise), seconds / steps))
            del samples[:-DECODES_KEPT]

    def step_seconds(self, stepwise: bool) -> Optional[float]:
        """The median seconds per reference step of the recent decodes (:meth:`record_decode`) of one mode, None
        where they hold none."""
        samples = [per_step for mode, per_step in self.stats.costs(self.key).get("decodes", []) if mode == stepwise]
        return float(np.median(samples)) if samples else None

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
