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

**Cost.** A round's seconds (drafting, the verifying forward and the verification; a block's refresh forward, which
the stepwise loop runs too, left out: :meth:`DraftLengthChooser.untimed`) against the canvases it forwarded,
``n`` rows times ``k`` (fewer where chains end at a block's end): a robust line (:func:`width_line`, Theil-Sen
through the median time of each canvas count: most rounds share one width, and a fit over raw rounds would take its
scatter for the slope), kept in a :class:`~vispec.decoding.windows.WindowStats` under the decode's cost key (model,
device, dtype, batch, cache), per model for the process (:func:`model_costs`), so later decodes of the model start
from it. Until it has two distinct widths measured the chooser explores: one round at each of :data:`EXPLORE`
(capped by the largest ``k``), narrow ones, since a wide round of a large batch costs many stepwise ones; wider
rounds' costs are the line's.

**Choice.** ``argmax_k n E[T_k] / t(n k)`` over :data:`CANDIDATES` up to the largest, re-scored every round (a few
numpy operations; rounds cost milliseconds at least), among the ``k`` whose rounds forward at most twice the canvases
of the widest round measured (the line is a fit, not a law: on a CPU 4 and 16 canvases may cost alike and 64 four
times more), if it beats ``k = 1`` by :data:`MARGIN` (else ``k = 1``: on a machine where canvases cost in
proportion, a few percent of predicted gain is noise, and a lost bet costs more); at round :data:`WIDER_EVERY` of a
decode, then 16, 32, ... (the interval doubling), the next larger ``k`` than the best runs once, so deeper rates
keep being measured at a cost that shrinks with the decode's length. Whether a decode drafts at all is decided
against the stepwise loop's steps (below).

**Against the stepwise loop.** A ``k = 1`` round costs more than a step of the stepwise loop (the drafting and
verification machinery runs even for one canvas), so a draft length that beats ``k = 1`` can still lose to the
stepwise loop: on tiny-llada2 (``editing@prefix``, batch 4) a chooser that compared with ``k = 1`` rounds only settled
on ``k = 2, 3`` and decoded 0.85x as fast as the stepwise loop. So the stepwise loop's own steps are timed too: a
stepwise decode under ``"auto"`` times each of its steps that is not a block's refresh (the forward, the policy's
step and the commit; :meth:`DraftLengthChooser.record_step`), kept under the cost key against the rows it
forwarded (a robust line again). Before a decode (:meth:`DraftLengthChooser.prefers_stepwise`), a draft length must
beat the stepwise step's speed, ``n / t_sw(n)``, by :data:`MARGIN`, else the decode runs the stepwise loop. Both sides
leave the refreshes out, so the comparison does not depend on the workload: whole decodes' seconds per step do (a
problem whose blocks finish on their refresh costs several times more per step than one that takes cached steps: on
tiny-mdlm, 4.5-9 ms a step over the test problems), and comparing them sent every decode stepwise where a fixed
``k = 4`` ran 10% faster. While a draft length beats ``k = 1`` rounds, decodes draft until :data:`MIN_TRIES` chains
have tried a first draft, or twice as many chains ran (before that, the prior's pull on the rates would decide: a few
rounds of a few decodes handed tiny-mdlm's ``threshold@dual`` to the stepwise loop on depth-1 counts of 5 in 6, and
the hand-over's rechecks, ever rarer, did not bring it back); where none does, no count could make drafting pay
(tiny-mdlm-long's blocks mostly end on their refresh step, so its chains seldom have a draft to try). The next
decode runs stepwise, to time its steps; whichever
mode runs, now and then a decode runs the other (every recheck-th at first, the interval doubling after each such
recheck up to :data:`RECHECK_GROWTH` times, so that a settled choice costs ever less to confirm), so both sides'
costs stay current.
"""

from __future__ import annotations

import statistics
import time
import weakref
from contextlib import contextmanager
from typing import Any, Callable, Hashable, Iterator, Optional

import numpy as np
from torch import Tensor

from vispec.decoding.windows import WindowStats, depth_rates, hand_to_ar, restart_rechecks

CANDIDATES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)
EXPLORE = (1, 2, 4)  # the first rounds' draft lengths, for the cost line (narrow: cheap at any batch size)
SHRINK = 4.0
PRIOR = 0.5  # the rate of a depth nothing has measured yet (depth 1 only; deeper ones borrow)
MARGIN = 0.1  # the predicted gain over k = 1 a longer draft must show
WIDER_EVERY = 8  # the first round that tries a larger k than the best; then rounds 16, 32, 64, ...
KEEP = 64  # cost samples kept, of rounds and of stepwise steps each
RECHECK_GROWTH = 8  # a hand-over's recheck interval grows from ChooserSettings.recheck to this many times it
MIN_TRIES = 32  # depth-1 tries pooled before a decode may run stepwise (a dozen decodes at batch 1, one at 16)
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


def width_line(samples: list[tuple[int, float]]) -> tuple[Optional[tuple[float, float]], float]:
    """``(intercept, slope)`` of seconds against width through the median time of each width (Theil-Sen: the median
    of the pairwise slopes, at least 0), so the common width, however many samples ran it, is one point among the
    others and cannot flatten the line; None before two widths are measured. And a floor for the line's values: 5% of
    the median sample (a line through noisy samples may cross zero). Plain Python: a few dozen samples of a few
    widths fit in tens of microseconds (numpy's per-call overhead made it ~150 us, a few percent of a small model's
    decode)."""
    if not samples:
        return None, 1e-9
    by_width: dict[int, list[float]] = {}
    for width, seconds in samples:
        by_width.setdefault(width, []).append(seconds)
    line = None
    if len(by_width) >= 2:
        widths = sorted(by_width)
        times = [statistics.median(by_width[w]) for w in widths]
        slopes = [(times[j] - times[i]) / (widths[j] - widths[i])
                  for i in range(len(widths)) for j in range(i + 1, len(widths))]
        slope = max(statistics.median(slopes), 0.0)
        line = (statistics.median(t - slope * w for w, t in zip(widths, times)), slope)
    return line, max(0.05 * statistics.median(t for _, t in samples), 1e-9)


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
        zeros = np.zeros((largest + 1, 2))  # depth d: (verified, tried); depth 0: the chains
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
        """The rounds' cost line (:func:`width_line`)."""
        return self._fitted()[0]

    def _fitted(self) -> tuple[Optional[tuple[float, float]], float]:
        """The rounds' line and floor, fitted again only when a round was recorded since (a round asks for it several
        times)."""
        state = (len(self.samples), self.samples[-1] if self.samples else None)  # a round recorded since?
        if self._fit is None or self._fit[0] != state:
            self._fit = (state, width_line(self.samples))
        return self._fit[1]

    def cost(self, canvases: np.ndarray) -> Optional[np.ndarray]:
        """Seconds of rounds forwarding ``canvases`` canvas rows (each entry), None before the line is known."""
        line, floor = self._fitted()
        if line is None:
            return None
        return np.maximum(line[0] + line[1] * np.asarray(canvases, dtype=float), floor)

    def stepwise_cost(self, rows: int) -> Optional[float]:
        """Seconds of a stepwise step of ``rows`` rows (a block's refresh excluded; :meth:`record_step`): the median of
        the steps of that many rows where at least three were timed, else the robust line through the widths timed,
        else the one width's median scaled in proportion; None before any step was timed."""
        samples = self.stats.costs(self.key).get("stepwise", [])
        same = [seconds for width, seconds in samples if width == rows]
        if len(same) >= 3:
            return float(np.median(same))
        line, floor = width_line(samples)
        if line is not None:
            return max(line[0] + line[1] * rows, floor)
        if not samples:
            return None
        return float(np.median([seconds for _, seconds in samples])) * rows / samples[0][0]

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
        return self._scored(rows)[1]

    def _scored(self, rows: int) -> tuple[np.ndarray, int]:
        """The predicted reference steps per second of every draft length for ``rows`` rows, and the index of the one
        to run (:meth:`_best`; the cost line is known)."""
        speed = rows * self.expected_steps() / self.cost(rows * np.asarray(self.lengths))
        widest = max(canvases for canvases, _ in self.samples)
        allowed = np.where(rows * np.asarray(self.lengths) > 2 * widest, 0.0, speed)  # the line is not stretched
        best = int(np.argmax(allowed))  # past twice the widest round measured: wider ones are reached by doubling
        return speed, (best if allowed[best] >= (1 + MARGIN) * allowed[0] else 0)  # k = 1 unless drafting clearly
        # pays: a predicted gain this small is within the line's error

    def prefers_stepwise(self, rows: int) -> bool:
        """Whether a whole decode of ``rows`` rows should run as the stepwise loop (module docstring, Against the
        stepwise loop): the cost line and acceptance are measured (:data:`MIN_TRIES` chains tried a first draft, or
        twice as many chains ran; sooner where drafting does not beat ``k = 1`` rounds even so), and no draft length's
        predicted steps per second beat the stepwise steps' by :data:`MARGIN` (the first decode after the exploring
        ones runs stepwise, to time them). Every :attr:`~vispec.decoding.windows.ChooserSettings.recheck`-th decode
        runs the other mode (as the image half's :func:`vispec.decoding.windows.hand_to_ar`, but with the interval
        doubling after each recheck, :meth:`_handed`), so both sides' costs stay current at a cost that shrinks."""
        if self.explore:  # (without a cost line there is an exploration)
            return False
        speed, best = self._scored(rows)
        measured = self.counts[1, 1] >= MIN_TRIES or self.counts[0, 1] >= 2 * MIN_TRIES
        if not measured and (self.counts[1, 1] == 0 or best > 0):
            return False  # acceptance barely measured, and a draft length may pay: the prior would decide
        stepwise = self.stepwise_cost(rows)
        if stepwise is None:  # time the stepwise steps: this decode costs what the stepwise run costs anyway
            return True
        if speed[best] < (1 + MARGIN) * rows / stepwise:
            return self._handed(self.key)
        restart_rechecks(self.stats, self.key)  # drafting pays: a later hand-over rechecks soon again
        return not self._handed((self.key, "probe"))  # every so often a decode times the stepwise loop's steps

    def best_speed(self, rows: int) -> float:
        """The predicted reference steps per second of ``rows`` rows' rounds at the draft length :meth:`_best`
        picks (the cost line is known)."""
        speed, best = self._scored(rows)
        return float(speed[best])

    def _handed(self, label: Hashable) -> bool:
        """Count a decode that :meth:`prefers_stepwise` would hand over (or, under ``(key, "probe")``, keep
        speculative) and answer True, except every ``interval``-th time, when the other mode runs
        (:func:`~vispec.decoding.windows.hand_to_ar` with growth): the interval starts at
        :attr:`~vispec.decoding.windows.ChooserSettings.recheck` and doubles after every recheck, up to
        :data:`RECHECK_GROWTH` times it. A recheck costs (a decode of the slower mode), and one that confirmed the
        choice makes the next less needed."""
        return hand_to_ar(self.stats, label, RECHECK_GROWTH)

    def record_step(self, rows: int, seconds: float) -> None:
        """A stepwise step (not a block's refresh) of ``rows`` rows took ``seconds``: the last :data:`KEEP` kept under
        the cost key (:meth:`stepwise_cost`)."""
        samples = self.stats.costs(self.key).setdefault("stepwise", [])
        samples.append((rows, seconds))
        del samples[:-KEEP]

    @contextmanager
    def untimed(self) -> Iterator[None]:
        """Leave the enclosed work out of the round's cost sample: a block's refresh forward, which a round runs when
        its exact canvas starts a block, costs what the stepwise loop's refresh costs, whatever the draft length (timed
        in, a round that happened to end a block would cost a full forward more than its canvases: on tiny-mdlm's
        ``threshold@dual`` such rounds made two canvases look three times one's cost, and every decode went
        stepwise)."""
        start = self.clock()
        try:
            yield
        finally:
            if self._start is not None:
                self._start += self.clock() - start

    def record(self, canvases: int, verified: Tensor, drafted: Tensor) -> None:
        """After the round: ``canvases`` forwarded; per row, the drafts ``verified`` of the ``drafted`` it had."""
        if self._start is not None and canvases > 0:
            self.samples.append((canvases, self.clock() - self._start))
            del self.samples[:-KEEP]
        self._start = None
        self.rounds += 1
        verified, drafted = verified.cpu().numpy()[None, :], drafted.cpu().numpy()[None, :]
        self.counts[0] += verified.size  # depth 0 (the exact canvas): every chain, verified by construction
        depth = np.arange(1, len(self.counts))[:, None]
        self.counts[1:, 0] += (verified >= depth).sum(axis=1)  # depth d verified: the chain verified d drafts or more
        self.counts[1:, 1] += ((verified >= depth - 1) & (drafted >= depth)).sum(axis=1)  # reached it and had it
