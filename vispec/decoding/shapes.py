r"""The shape of every pass, chosen by expected committed tokens per second: AR, an MC-SJD chain or an SJD-PAC tree.

``decoding="auto"`` (and ``"sjd-pac:window=auto"``) run every pass through one of these shapes
(:class:`Shape`), all on SJD-PAC's batch state (:mod:`vispec.decoding.pac`), so the decoder can switch between
them from one pass to the next:

* ``ar``: one row, the pending token alone; samples the next token as AR does
  (:func:`vispec.decoding.sjd.single_token_step`) and drops the drafts;
* ``chain L``: MC-SJD's maximal coupling over a chain of ``L`` rows (SJD-PAC's layout with a one-level tree);
* ``tree L K D``: SJD-PAC's tree, ``K`` candidates per node on the ``D - 1`` levels below the pending token,
  the main path continued as a chain to ``L`` slots (``M`` of them on the main path).

**Expected tokens** (Sequoia, Chen et al. 2024, arXiv 2402.12374: a tree's expected accepted tokens from *measured*
per-depth and per-rank acceptance rates). Let ``a_d`` be the probability that the main draft at depth ``d`` is accepted
given the path reached depth ``d - 1``, and ``s_k`` that the ``k``-th sibling is accepted given the main draft and
siblings ``1 .. k-1`` were rejected (recursive rejection sampling tests them in that order). A tree level ``d`` with
``K`` candidates continues the path with ``A_d = 1 - (1 - a_d) prod_{k<K} (1 - s_k)``; below the tree only the main
path continues, so

    E[T] = 1 + sum_{d=1}^{min(D, M) - 1} prod_{j<=d} A_j + sum_{d=D}^{M-1} prod_{j<=d} a_j

tokens are committed by a pass whose main path has ``M`` slots (the ``1``: the residual or bonus token; a chain is
``K = 1``, AR is ``E[T] = 1``). A Jacobi draft is not a drafter's guess of fixed quality: it improves with every pass
that recomputes it, and a rejection stales every draft after it (they were computed after the rejected token). So
``a_d`` depends on the window the decode runs, not only on the depth: wide windows' drafts at depth ``d`` have been
refined more often. The rates are therefore kept per *window class* (the rows ``L`` of the shapes that measured them:
1, 2, 4, ..., 64), like Sequoia's acceptance vectors per tree size, and a shape is scored with its own class's rates
(a class not yet measured borrows the nearest narrower one's: pessimistic, never flattering). Scores use the steady
state a shape reaches after a few passes of itself; the chooser keeps a shape for a block of passes, so the ramp
after a switch is amortised.

**Rates** are counted from *committed history only*: after a pass, for each sample, the depths its committed path
passed (accepted drafts) and the one where it ended (rejected: its token is the residual there), and at tree levels
which rank was accepted (read back with the committed counts, one read per pass: ``state["path_rank"]``). Counts are
pooled over the batch and over decodes (:class:`ShapeRates`, in the :class:`~vispec.decoding.windows.WindowStats` the
caller keeps, and on disk for the next process with the same weights and sampling: :func:`load_shape_rates`) and
smoothed: depth 1's rate is its counts with :data:`SHRINK` pseudo-observations of the prior, and a
deeper depth ``d``'s its counts with :data:`SHRINK` pseudo-observations of the class's pooled rate over depths ``d``
and below (itself shrunk towards depth ``d - 1``'s rate; a tail never reached takes it). A deep depth is reached only
when every draft above it was accepted, so its tries are few; the pooled tail gathers them, so a depth seen twice
cannot zero a window's prospects. Acceptance is not monotone in depth: on tiny-c2i (6 decodes per window, every pass
counted) window 16 accepts 0.43 at depth 1, 0.79-0.92 at depths 3-12 and 0.43 at depth 15, window 32 0.22 at depth
16 (a draft a row of 16 tokens ahead). Shrinking each depth towards the one above it dragged a briefly measured wide
window towards depth 1's rate (chain 16 estimated at 1.9-2.5 tokens a pass after a few dozen passes, 3.0 measured);
pooling every depth below 1 missed the fall (chain 32 at 5.1, 3.7 measured); the pooled tail estimates 2.21 / 3.09 /
3.83 tokens a pass for windows 8 / 16 / 32 against 2.18 / 3.03 / 3.74 measured, and within 3% of that from a tenth of
the counts. Per sample (a new request starts from none) the chooser keeps its accepted tests and the tests it
expected to be accepted under the pooled rates; their ratio, shrunk towards 1 by :data:`SAMPLE_SHRINK`
pseudo-tests, scales the sample's rates, so an easy image counts for more tokens than a hard one in the same batch.
The shrink is strong: a pass's acceptance is a noisy guide to the next one's, and every switch drops drafts or ramps
(tiny-c2i at batch 1, 12 images, every pass priced by a fixed table, ``samples/chooser_replay.py``: 4 pseudo-tests
ran 0.804 s an image, 0.751 over the later 6; 32 ran 0.745 and 0.707; no factor 0.759 and 0.733; the fixed
16-slot chain 0.697 and 0.705). Both decay by :data:`SAMPLE_DECAY` every pass, whatever its shape: they describe the part
of the image being decoded, and a sample that a hard stretch sent to AR (whose passes measure nothing) must come back
to the pooled rates, not stay in AR for the rest of the image on old evidence.

**Cost** of a pass: the cost curve ``t(B, L)`` of this model, batch slots, dtype, device and compile setting
(:mod:`vispec.decoding.windows`), one curve per cost label (``ar``, ``chain:L``, ``tree:L``: trees of the same rows
share one): each label's median step time at its samples' median cached length, scaled along the cached length by a
relative growth pooled over all labels. A sample is the clock from one read-back to the next over the passes in
between (the step, the read-back and the chooser's bookkeeping: what a pass costs in this loop), less the time spent
scoring candidates at a block start (the same for every shape; :meth:`ShapeChooser.predicted_speedup` adds it back).
Measured by the first decodes on a machine (the calibration: one untimed pass of every label, which compiles it, then
a timed block of each, AR's :data:`AR_BLOCKS` times as long; an AR block reads back once, at its end) and cached on
disk
(:func:`vispec.decoding.windows.load_step_costs`), so a second process starts from it. The same curve keeps the
AR decoder's own pass (:data:`AR_DECODER`: :func:`~vispec.decoding.ar.time_ar_passes` before the calibrating decode
and afresh before every :attr:`~ChooserSettings.recheck`-th decode that runs the chooser, and every decode handed to
AR; its last :data:`AR_KEEP` timings, as recent as a shape's last :data:`~vispec.decoding.windows.KEEP` passes), the
yardstick of the predicted speed-up and of the hand-over: the chooser's one-token pass costs more than the AR
decoder's, and a speed-up is over what the user would run instead.

**Settling and exploring.** The first passes after a switch to another window class (:func:`settle_passes`: about
a quarter of the window, the passes its drafts take to be refined from the old window's, or from none) are not
counted. A class's counts decay (:data:`POOL_DECAY` per counted pass: acceptance drifts over an image) only while
that class runs, so what a class measured stays its estimate until it runs again, over the decode and the next
ones. A class measured only briefly, or not at all, looks worse than it runs (it borrows a narrower class's rates),
so the choice alone would never try it: every
:attr:`~ChooserSettings.refresh` passes (the interval doubling each time, up to :data:`EXPLORE_CAP` refreshes, kept
with the pooled counts so that it runs over decodes) a chain runs a measuring block (:attr:`~ChooserSettings.samples`
sample-passes after its settling passes): one window class narrower or wider than the best-scoring chain, if with
every depth at the highest rate any class measured there it could beat the chosen shape; of the two, the class
measured longest ago. Chain scores over the window are unimodal (wider windows accept more tokens per pass at a cost
that grows faster), so climbing from the best chain finds the best window; a chain that could not pay even so is
never explored (at a large batch a wide chain costs many one-token steps).

**The ramp.** Settling passes commit fewer tokens than the steady state (on tiny-c2i at batch 1, 0.4-0.7 of the
steady state's extra tokens ``E[T] - 1``): their drafts were refined for another window. Each class keeps the extra
tokens its settling passes committed against those its steady state expected (:attr:`ShapeRates.ramp`, decaying like
its counts), whose ratio ``r`` (shrunk towards :data:`PRIOR_RAMP`) predicts a settling pass at ``1 + r (E[T] - 1)``.
A switch to another class is scored by the tokens per second at which it would finish the image: ``s`` settling
passes at the ramp, then the rest of the samples' tokens at the steady state (a 32-row chain settles for 9 passes:
scored on its steady state alone, a switch near the end of an image, or for a block of 4 passes, runs mostly ramp;
at an image's start a 64-row shape's 17 settling passes are a third of its passes). The predicted speed-up counts
settling passes at their ramp.

**Choice.** At the start of each block (:attr:`ChooserSettings.block` passes) the chooser scores every candidate
shape that fits, ``sum_b E_b[T] / t(B, L)`` over the live samples, and runs the best; a shape other than AR must
beat AR, and any other shape the current one, by :attr:`ChooserSettings.margin` (no switch for a small gain: a
switch to AR drops every draft). An AR block is :data:`AR_BLOCKS` blocks long: AR passes measure no acceptance, so
the scores would not change, and scoring every candidate costs a share of a one-token step. A shape of another
window class than the current one is scored with its ramp (above). A whole decode runs one chain every pass, without
choosing or recording, where such decodes' timed passes (:data:`FIXED_CHAIN`) make the best chain beat AR at mid-image
by :data:`HANDOVER_MARGIN` and every other shape (:meth:`ShapeChooser.fixed_chain`: the chooser's work between passes
is a share of a small model's pass), else plain AR (:func:`~vispec.decoding.ar.decode_ar`) unless a shape beats AR
by that margin (:meth:`ShapeChooser.prefers_ar`). Every :attr:`~ChooserSettings.recheck`-th such decode runs the
chooser instead, and its first block after the calibration is a measuring block of the best-scoring shape other than
AR, whose cost samples that block's timings replace: costs are medians of their last samples, and a shape the chooser stopped
running keeps the cost it was last timed at, so a calibration timed while the machine ran slow would otherwise keep
every later decode in AR (on a 2-core VM, a 16-row chain calibrated at 4.5 ms a pass ran at 2.6-3.0 later on).

**Exactness.** The choice before a pass is a function of the committed history (tokens, the ranks accepted on
committed paths, committed counts) and of step times, never of the noise of the pass about to run, nor of
verification outcomes at positions that were not committed (those are correlated with the drafts carried over).
Every shape's verification is exact given its drafts (SJD-PAC's argument, :mod:`vispec.decoding.pac`): each main
draft is distributed as the ``q`` recorded with it given the window it came from, and the siblings are a draw
without replacement from that ``q`` (drawn for the decode's widest tree; a pass with fewer siblings uses the first
ones, a prefix of the same sequential draw); switching shapes only decides which drafts the next pass verifies and
how many candidates each level gets. So the output is distributed as AR's whatever the choices.
tests/exactness/test_exactness.py certifies it with the chooser forced to change shape every pass.
"""

from __future__ import annotations

import functools
import gc
import math
from dataclasses import dataclass, field
from typing import Hashable, Optional, Sequence

import numpy as np

from vispec.decoding.windows import (KEEP, ChooserSettings, WindowStats, cost_cache_dir, cost_growth, cost_level,
                                     hand_to_ar, save_step_costs, scaled_level, window_set)

SHRINK = 4.0  # pseudo-observations of the prior in a smoothed rate (module docstring)
POOL_DECAY = 0.995  # the pooled counts decay per pass (a decode's acceptance drifts over the image)
SAMPLE_DECAY = 0.95  # a sample's own counts decay per pass (module docstring, Rates)
SAMPLE_SHRINK = 32.0  # pseudo-tests at the pooled rate in a sample's factor (module docstring, Rates)
PRIOR_DRAFT, PRIOR_SIBLING = 0.5, 0.2  # rates before anything was measured
MAX_DEPTH = 64
AR_BLOCKS = 4  # an AR block is this many blocks long (module docstring, Choice)
EXPLORE_CAP = 16  # the interval between measuring blocks doubles up to this many ChooserSettings.refresh
# a decode runs the chooser only where a shape beats AR by this share at mid-image; else plain AR (decode_ar). The
# chooser's own AR passes cost 5-13% more than decode_ar's on tiny-c2i (the batch state's bookkeeping), and it pays
# for settling ramps and measuring blocks: at tiny-c2i batch 4 a predicted 1.04x over AR measured 0.78x
HANDOVER_MARGIN = 0.15
#: timed passes between recomputations of the cost curve's pooled growth (cost_growth sorts every label's samples: ~2 ms
#: on a CPU, where a block start re-scored every 4-5 passes of ~10 ms)
GROWTH_EVERY = 64
#: the cost label of the AR decoder's own pass (:func:`vispec.decoding.ar.time_ar_passes`): the yardstick of the
#: predicted speed-up and of the hand-over to AR, not a shape the chooser runs
AR_DECODER = "ar-decoder"
#: the AR decoder's timings kept (a decode handed to AR gives one): a shape's cost is the median of its last KEEP
#: passes (about the last decode that ran it), so AR's must be as recent. Over KEEP decodes handed to AR, the median
#: priced AR at 1.8 ms a pass, timed while a 2-core VM ran slow, when the machine ran it at 1.1-1.2 ms again: chain
#: decodes predicted at 1.13-1.30x the AR decoder ran at 0.62-0.91x (docs/performance.md, "The yardstick re-timed too")
AR_KEEP = 8
#: the cost label of a decode that runs one chain of L rows every pass without choosing or recording, as
#: ``fixed-chain:L`` (:meth:`ShapeChooser.fixed_chain`): the chain's cost without the chooser's work between passes
FIXED_CHAIN = "fixed-chain"
#: the re-timing interval of the AR decoder's pass (ShapeChooser.needs_ar_decoder) grows from ChooserSettings.recheck
#: decodes to this many times it: a re-timing costs 33 AR passes, about 2% of the 8 decodes in between on tiny-c2i@GPT-B
#: at batch 1 (22 ms an AR pass, 4 s a decode)
RETIME_GROWTH = 4
CALIBRATION_BLOCK = 6  # passes per shape while calibrating (the first, compiling or warming up, is not timed)
PRIOR_RAMP = 0.5  # a settling pass's share of the steady state's extra tokens before any was measured (The ramp)


@dataclass(frozen=True, order=True)
class Shape:
    """A pass's shape (module docstring): ``rows`` L, ``branching`` K, ``levels`` D (``K = 1`` or ``D = 1``: a
    chain; ``L = 1``: AR)."""

    rows: int
    branching: int = 1
    levels: int = 1

    @property
    def is_ar(self) -> bool:
        return self.rows == 1

    @property
    def is_tree(self) -> bool:
        return self.rows > 1 and self.branching > 1 and self.levels > 1

    @functools.cached_property  # the chooser asks every pass
    def tree_slots(self) -> int:
        return sum(self.branching ** d for d in range(self.levels)) if self.is_tree else 1

    @functools.cached_property  # the chooser asks every pass
    def main(self) -> int:
        """Slots on the main path (the pending token included)."""
        return self.rows - (self.tree_slots - self.levels) if self.is_tree else self.rows

    @functools.cached_property  # the chooser asks every pass
    def label(self) -> str:
        """``ar``, ``chain 16``, ``tree 16 K3 D3``: how tables and histograms name it."""
        if self.is_ar:
            return "ar"
        return f"tree {self.rows} K{self.branching} D{self.levels}" if self.is_tree else f"chain {self.rows}"

    @functools.cached_property  # the chooser asks every pass
    def cost_label(self) -> str:
        """The cost curve it is priced by: ``ar``, ``chain:L`` or ``tree:L`` (trees of equal rows share one)."""
        return "ar" if self.is_ar else f"{'tree' if self.is_tree else 'chain'}:{self.rows}"


def _decoder_label(label: Hashable) -> bool:
    """Whether a cost label is a whole decode's pass (:data:`AR_DECODER`, :data:`FIXED_CHAIN`), not a chosen shape's."""
    return label == AR_DECODER or str(label).startswith(FIXED_CHAIN)


def fits(rows: int, branching: int, levels: int) -> bool:
    """Whether a tree of ``branching`` K and ``levels`` D fits in ``rows`` slots with a main path of ``D`` slots."""
    return sum(branching ** d for d in range(levels)) <= rows


def settle_passes(shape: Shape) -> int:
    """Passes of a new window class that do not count towards its rates: its drafts ramp up from the last window's
    (or from none) before the window's steady state shows (module docstring). ``ChooserSettings(settle=0)`` turns
    settling (and the ramp's scoring) off: every pass counts (the exactness certificate decides every pass)."""
    return 0 if shape.is_ar else 1 + shape.rows // 4


@functools.lru_cache(maxsize=None)
def fitting_rows(need: int) -> int:
    """The widest window worth running when the live samples can use at most ``need`` rows: the smallest of
    ``1, 2, 4, ...`` that holds them (compiled steps come in those shapes)."""
    return min((w for w in window_set(MAX_DEPTH) if w >= need), default=MAX_DEPTH)


def candidate_shapes(largest: int, tree_width: int, tree_depth: int, *, every_tree: bool) -> list[Shape]:
    """The shapes a chooser picks from: AR; for each window ``L`` of ``1, 2, 4, ..., largest``, the chain and
    (``every_tree``) every tree with ``2 <= K <= tree_width``, ``2 <= D <= tree_depth`` that fits, or (not
    ``every_tree``, ``sjd-pac:window=auto``) the deepest tree of ``tree_width`` that fits, a chain where none does."""
    shapes = [Shape(1)]
    for rows in window_set(largest)[1:]:
        if every_tree:
            shapes.append(Shape(rows))
            shapes += [Shape(rows, k, d) for k in range(2, tree_width + 1) for d in range(2, tree_depth + 1)
                       if fits(rows, k, d)]
        else:
            depth = max(d for d in range(1, tree_depth + 1) if fits(rows, tree_width, d))
            shapes.append(Shape(rows, tree_width, depth) if tree_width > 1 and depth > 1 else Shape(rows))
    return shapes


def calibration_shapes(shapes: Sequence[Shape]) -> list[Shape]:
    """One shape per cost label (module docstring): for trees, the one with the most tree slots."""
    best: dict[str, Shape] = {}
    for shape in shapes:
        held = best.get(shape.cost_label)
        if held is None or shape.tree_slots > held.tree_slots:
            best[shape.cost_label] = shape
    return sorted(best.values())


# ---- acceptance rates -------------------------------------------------------------------------------------------


def window_class(rows: int) -> int:
    """The index of the window class of ``rows`` (0 for 1, 1 for 2, ... 6 for 64; module docstring)."""
    return max(int(rows - 1).bit_length(), 0)


CLASSES = window_class(MAX_DEPTH) + 1


@dataclass
class ShapeRates:
    """Hit and try counts of committed-path acceptance (module docstring): ``main[c, d]`` for the main draft at depth
    ``d`` in passes of window class ``c``, ``sibling[k]`` for rank ``k`` (index 0 unused). Arrays ``[..., 2]``:
    (hits, tries)."""

    main: np.ndarray = field(default_factory=lambda: np.zeros((CLASSES, MAX_DEPTH, 2)))
    sibling: np.ndarray = field(default_factory=lambda: np.zeros((MAX_DEPTH, 2)))
    counted: int = 0  # counted passes over the pool's life
    last: np.ndarray = field(default_factory=lambda: np.full(CLASSES, -1))  # per class: ``counted`` at its last count
    passes: int = 0  # passes of every shape over the pool's life (the measuring schedule's clock)
    next_explore: Optional[int] = None  # ``passes`` at which the next measuring block is due (None: not yet set)
    explore_every: int = 0  # the current interval between measuring blocks (doubling up to EXPLORE_CAP refreshes)
    # per class: extra tokens (beyond the one every pass commits) of settling passes, and what the steady state expected
    ramp: np.ndarray = field(default_factory=lambda: np.zeros((CLASSES, 2)))
    home: Optional[str] = field(default=None, compare=False, repr=False)  # the file it is kept in (load_shape_rates)

    ARRAYS = ("main", "sibling", "last", "ramp")
    NUMBERS = ("counted", "passes", "next_explore", "explore_every")

    def to_json(self) -> dict:
        """Every count (what :meth:`from_json` reads back), as JSON-ready lists and numbers."""
        out = {name: np.round(getattr(self, name), 6).tolist() for name in self.ARRAYS}
        out.update({name: getattr(self, name) for name in self.NUMBERS})
        return out

    @classmethod
    def from_json(cls, data: dict) -> "ShapeRates":
        """The counts :meth:`to_json` wrote; a ``ValueError`` if any array has another shape than this version's."""
        rates = cls()
        for name in cls.ARRAYS:
            value = np.asarray(data[name], dtype=getattr(rates, name).dtype)
            if value.shape != getattr(rates, name).shape:
                raise ValueError(f"{name}: shape {value.shape}, expected {getattr(rates, name).shape}")
            setattr(rates, name, value)
        for name in cls.NUMBERS:
            value = data[name]
            setattr(rates, name, None if value is None else int(value))
        return rates

    def note_pass(self, shape: Shape) -> None:
        """Before a counted pass of ``shape``: its class's counts (and, for a tree, the siblings') decay by
        :data:`POOL_DECAY`, and the class is marked measured now. Only the class that runs decays: a class
        measured a while ago keeps its estimate until it runs again (module docstring, Settling and exploring)."""
        c = window_class(shape.rows)
        self.main[c] *= POOL_DECAY
        if shape.is_tree:
            self.sibling *= POOL_DECAY
        self.counted += 1
        self.last[c] = self.counted

    @property
    def measured(self) -> bool:
        return bool(self.main[..., 1].sum() >= 1)

    def note_ramp(self, shape: Shape, extra: float, expected: float) -> None:
        """After a settling pass of ``shape``: its live samples committed ``extra`` tokens beyond one each, where the
        class's steady state expected ``expected``; the class's ramp counts decay like its rates' counts."""
        c = window_class(shape.rows)
        self.ramp[c] = self.ramp[c] * POOL_DECAY + (extra, expected)

    def ramp_shares(self) -> np.ndarray:
        """``[CLASSES]``: a settling pass's share ``r`` of the steady state's extra tokens (module docstring, The
        ramp), shrunk towards :data:`PRIOR_RAMP`."""
        extra, expected = self.ramp[:, 0], self.ramp[:, 1]
        return np.clip((extra + SHRINK * PRIOR_RAMP) / (expected + SHRINK), 0.0, 1.0)

    def rates(self) -> tuple[np.ndarray, np.ndarray]:
        """``(a [CLASSES, MAX_DEPTH], s [MAX_DEPTH])``: per class, depth 1's rate shrunk towards the prior and every
        deeper depth ``d``'s towards the class's pooled rate over depths ``d`` and below (module docstring, Rates); a
        class with no tries takes the nearest narrower measured class's rates (the prior where none is)."""
        a = np.empty((CLASSES, MAX_DEPTH))
        hits, tries = self.main[..., 0], self.main[..., 1]
        tail_hits = np.cumsum(hits[:, ::-1], axis=1)[:, ::-1]  # [c, d]: hits at depths d and below
        tail_tries = np.cumsum(tries[:, ::-1], axis=1)[:, ::-1]
        previous = (hits[:, 1] + SHRINK * PRIOR_DRAFT) / (tries[:, 1] + SHRINK)
        a[:, :2] = previous[:, None]  # index 0 unused
        # a_d = (h_d + S tail_d) / (t_d + S) with tail_d = (H_d + S a_{d-1}) / (T_d + S): a_d = base_d + weight_d a_{d-1}
        base = (hits + SHRINK * tail_hits / (tail_tries + SHRINK)) / (tries + SHRINK)
        weight = SHRINK * SHRINK / ((tail_tries + SHRINK) * (tries + SHRINK))
        base, weight = base.T.copy(), weight.T.copy()  # [depth, class]: one contiguous row per step of the recursion
        for d in range(2, MAX_DEPTH):
            previous = base[d] + weight[d] * previous
            a[:, d] = previous
        seen = self.main[..., 1].sum(axis=1) > 0
        for c in range(CLASSES):
            if not seen[c]:
                narrower = [k for k in range(c) if seen[k]]
                if narrower:
                    a[c] = a[narrower[-1]]
        hits, tries = self.sibling[:, 0], self.sibling[:, 1]
        s = (hits + SHRINK * PRIOR_SIBLING) / (tries + SHRINK)
        return np.clip(a, 0.0, 0.99), np.clip(s, 0.0, 0.99)


def load_shape_rates(stats: WindowStats, model: object, spec: Hashable) -> Optional[str]:
    """Where ``stats`` holds no pooled rates for ``spec`` yet, start them from what earlier processes measured
    with the same weights and spec (``<cache>/acceptance/<digest>.json`` beside the cost curves,
    :func:`~vispec.decoding.windows.cost_cache_dir`; digest of :func:`~vispec.decoding.windows.weights_fingerprint`
    and ``spec``), so a second process does not spend its first images re-measuring every window; the file the
    pool is kept in (:meth:`ShapeChooser.finish` writes it), None when caching is off. A missing or unreadable
    file starts from empty counts. Acceptance is a property of the weights and the sampling, not of the machine;
    rates from committed history of earlier decodes keep every choice independent of the pass's noise."""
    import hashlib
    import json
    import os

    from vispec.decoding.windows import weights_fingerprint

    if spec in stats.shape_rates:
        return stats.shape_rates[spec].home
    folder = cost_cache_dir()
    if folder is None:
        stats.shape_rates[spec] = ShapeRates()
        return None
    name = hashlib.sha1(f"{weights_fingerprint(model)} {spec!r}".encode()).hexdigest()[:20]
    path = os.path.join(os.path.dirname(folder), "acceptance", name + ".json")
    try:
        with open(path) as handle:
            rates = ShapeRates.from_json(json.load(handle)["rates"])
    except (OSError, ValueError, KeyError, TypeError):
        rates = ShapeRates()
    rates.home = path
    stats.shape_rates[spec] = rates
    return path


def save_shape_rates(rates: ShapeRates, spec: Hashable) -> Optional[str]:
    """Write ``rates`` to the file :func:`load_shape_rates` gave it (atomically: a rename); the path, None if it
    has none."""
    from vispec.decoding.windows import write_json_atomically

    if rates.home is None:
        return None
    return write_json_atomically(rates.home, {"spec": repr(spec), "rates": rates.to_json()})


def expected_tokens(shape: Shape, main_rates: np.ndarray, sibling_rates: np.ndarray, width: np.ndarray) -> np.ndarray:
    """``E[T]`` per sample (module docstring) for ``main_rates [B, MAX_DEPTH]`` ``a_d`` (index ``d``; 0 unused),
    ``sibling_rates [B, MAX_DEPTH]`` ``s_k`` and each sample's ``width [B]``: the rows it can still use
    (``min(M, N - n)``)."""
    if shape.is_ar:
        return np.ones(main_rates.shape[0])
    a = main_rates[:, 1:shape.main]  # depths 1 .. M - 1
    reach = np.cumprod(a, axis=1)  # the main path reaches depth d
    if shape.is_tree:  # tree levels 1 .. D - 1: any of K candidates continues the path
        levels = min(shape.levels, shape.main) - 1
        miss_siblings = np.prod(1.0 - sibling_rates[:, 1:shape.branching], axis=1)
        tree = np.cumprod(1.0 - (1.0 - a[:, :levels]) * miss_siblings[:, None], axis=1)
        reach = np.concatenate([tree, reach[:, levels:]], axis=1)
    usable = np.arange(1, shape.main)[None, :] < width[:, None]
    return 1.0 + (reach * usable).sum(axis=1)


def expected_tokens_table(shapes: Sequence[Shape], class_rates: np.ndarray, sibling_rates: np.ndarray,
                          left: np.ndarray) -> np.ndarray:
    """``[S, len(shapes)]``: :func:`expected_tokens` of every shape at once, each with its window class's rates
    (``class_rates [S, CLASSES, MAX_DEPTH]``), ``sibling_rates [S, MAX_DEPTH]`` and the tokens each sample lacks,
    ``left [S]`` (a shape's usable width is ``min(left, M)``). The same sums in a few array operations: with
    ``C_c(m) = sum_{d<=m, d<left} prod_{j<=d} a_{c,j}`` (the main path's cumulative reach), a chain commits
    ``1 + C_c(M - 1)`` and a tree ``1 + sum_{d<=l, d<left} prod_{j<=d} A_j + C_c(M - 1) - C_c(l)``, ``l = min(D, M) - 1``
    (module docstring). Scoring the candidates one by one cost about 1.4 ms of numpy calls at every block start on a
    CPU, a share of a small model's pass."""
    layout = _table_layout(tuple(shapes))
    samples = class_rates.shape[0]
    reachable = np.arange(1, MAX_DEPTH)[None, :] < left[:, None]  # [S, MAX_DEPTH - 1]: depth d < left
    chain = np.zeros((samples, CLASSES, MAX_DEPTH))
    np.cumsum(np.cumprod(class_rates[:, :, 1:], axis=2) * reachable[:, None, :], axis=2, out=chain[:, :, 1:])
    tokens = 1.0 + chain[:, layout.classes, layout.mains - 1] - chain[:, layout.classes, layout.levels]
    for branching, index, levels in layout.trees:  # trees of K candidates: any of them continues the path
        miss = np.prod(1.0 - sibling_rates[:, 1:branching], axis=1)[:, None, None]
        top = int(levels.max())
        tree = np.cumprod(1.0 - (1.0 - class_rates[:, :, 1:top + 1]) * miss, axis=2) * reachable[:, None, :top]
        tokens[:, index] += np.cumsum(tree, axis=2)[:, layout.classes[index], levels - 1]
    return tokens


@dataclass(frozen=True)
class _TableLayout:
    classes: np.ndarray  # [n] each shape's window class
    mains: np.ndarray  # [n] its main path's slots M
    levels: np.ndarray  # [n] its tree levels below the root, min(D, M) - 1 (0 for a chain or AR)
    trees: tuple  # per branching K: (K, the trees' indices, their levels)


@functools.lru_cache(maxsize=64)
def _table_layout(shapes: tuple[Shape, ...]) -> _TableLayout:
    levels = np.array([min(s.levels, s.main) - 1 if s.is_tree else 0 for s in shapes], dtype=int)
    trees = []
    for branching in sorted({s.branching for s in shapes if s.is_tree}):
        index = np.array([i for i, s in enumerate(shapes) if s.is_tree and s.branching == branching], dtype=int)
        trees.append((branching, index, levels[index]))
    return _TableLayout(np.array([window_class(s.rows) for s in shapes], dtype=int),
                        np.array([s.main for s in shapes], dtype=int), levels, tuple(trees))


# ---- the chooser --------------------------------------------------------------------------------------------------


class ShapeChooser:
    """Picks each pass's shape (module docstring): :meth:`choose` before the pass, :meth:`record` after it.

    Args:
        shapes: the candidates (:func:`candidate_shapes`).
        stats: measurements kept by the caller between decodes (costs under ``key``, pooled rates under ``spec``).
        key: the cost key (device, dtype, slots, compile, and that the steps are SJD-PAC's).
        spec: what acceptance depends on (the decoding spec's name).
        slots: the batch slots; ``num_tokens``: ``N``.
    """

    def __init__(self, shapes: Sequence[Shape], stats: WindowStats, key: Hashable, spec: Hashable, slots: int,
                 num_tokens: int):
        usable = fitting_rows(num_tokens)  # no window wider than an image
        self.shapes = [s for s in shapes if s.rows <= usable]
        self.stats, self.key, self.slots, self.num_tokens = stats, key, slots, num_tokens
        self.settings: ChooserSettings = stats.settings
        self.costs = stats.costs(key)
        self.pool = stats.shape_rates.setdefault(spec, ShapeRates())
        self.spec, self._counted_at_start = spec, self.pool.counted
        self.sample_hits = np.zeros((slots, 2))  # per slot: (accepted tests, tests expected accepted under the pool)
        self.ids = [-2] * slots  # the request each slot's counts belong to
        self._pool_rates: Optional[tuple[np.ndarray, np.ndarray]] = None
        self.current: Optional[Shape] = None
        self.left = 0
        self.calibrating = [s for s in calibration_shapes(self.shapes) if not self.costs.get(s.cost_label)]
        self.calibrated = bool(self.calibrating)  # this decode measures the cost curve (then saves it: finish)
        self.warming = list(self.calibrating)  # first one pass of each (compiles, first runs), then the timed blocks
        self._collected = False
        if self.calibrated:
            import sys

            print(f"vispec: measuring this machine's step costs for {len(self.calibrating)} pass shapes (batch "
                  f"{slots}); kept in {cost_cache_dir() or 'this WindowStats only (VISPEC_CACHE_DIR=off)'}",
                  file=sys.stderr, flush=True)
        self._rates_checked = False  # whether the first block start looked for rates (_measure_rates)
        self._rates_only: set[Shape] = set()  # calibrating shapes whose cost is known: measured for rates only
        self._levels: dict[str, tuple[float, float]] = {}  # each cost label's level (cost), computed where missing
        self._growth: Optional[float] = None  # the curve's pooled growth (cost), recomputed every GROWTH_EVERY timings
        self._timed_since_growth = 0
        self._growth_basis = 0  # the curve's samples when the growth was last computed
        self._retimed: set[str] = set()  # labels timed since the last block start (their levels are recomputed then)
        self._stale = False  # counts changed since the rates were computed (refreshed at a block start)
        self._steady: Optional[float] = None  # the current pass's steady-state E[T] summed over its live samples
        self._calibrating_block = False
        self._settle = 0  # passes left before this block's passes count towards the rates
        self.passes = 0
        if self.pool.next_explore is None:  # the measuring schedule runs over the pool's decodes (_pick)
            self.pool.explore_every = self.settings.refresh
            self.pool.next_explore = self.pool.passes + self.settings.refresh
        self._exploring = False  # the current block measures a chain (_exploration)
        self._warming = False  # the current pass is a warming pass (_pick)
        self.predicted: list[tuple[float, float, float]] = []  # per pass: (expected tokens per batch slot, cost, AR cost)
        self._warm: set[str] = {label for label, samples in self.costs.items() if samples}
        self._run: list[int] = []
        self._run_start: Optional[float] = None
        self._at = 0
        self._live = slots
        self.clock = stats.clock
        self.pick_seconds = 0.0  # spent choosing (scoring candidates at block starts), this decode
        self._keep_curve = False  # timings to keep on disk (the AR decoder's, a recheck's re-timing): finish
        self._rechecking = False  # this decode rechecks a hand-over to AR (prefers_ar): its best shape is re-timed
        self._fresh: set[str] = set()  # cost labels whose next timing replaces their samples (_pick, record)
        self._run_picking = 0.0  # of it, in the current run
        self.handover_speedup = 1.0  # predicted for a decode given one chain (fixed_chain)
        self._fixed_fresh = False  # that decode times the chain afresh (note_fixed_chain)

    def warm_first(self, shapes: Sequence[Shape]) -> None:
        """Before the first pass: run one untimed pass of each of ``shapes`` first, the shapes this process has not
        compiled (where the cost curve came from disk, none was calibrated here): a compile of tens of seconds
        in the middle of a later, timed decode would be a stall the user sees and a cost sample far off the curve.
        Shapes already queued for the calibration's warming are there once."""
        for shape in shapes:
            if all(queued.cost_label != shape.cost_label for queued in self.warming):
                self.warming.append(shape)
            self._warm.discard(shape.cost_label)

    def may_run(self, shape: Shape) -> bool:
        """Whether a pass of ``shape`` can ever run in this decode: its cost is still to be measured (calibration) or
        finite. A pinned curve (``--cost-curve FILE``) prices the labels it lacks at infinity, so such shapes are
        never chosen, and a compiled decode does not compile them (:func:`vispec.decoding.pac.decode_pac`)."""
        if shape in self.calibrating:
            return True
        cost = self.cost(shape, 0)
        return cost is None or math.isfinite(cost)

    # ---- estimates ------------------------------------------------------------------------------------------

    def cost(self, shape: Shape, at: int) -> Optional[float]:
        """Seconds of a pass of ``shape`` at ``at`` cached tokens: its label's median step time at its samples' median
        cached length, scaled to ``at`` by the curve's relative growth per cached token ``g``, pooled over every label
        (:func:`~vispec.decoding.windows.cost_growth`; a label's own few samples would give wild lines). Computed
        once per block (:meth:`_refresh`), and only for the labels timed since; the growth once the passes timed
        since its last computation are as many as the samples it had then, at most :data:`GROWTH_EVERY` (often while
        the curve is young, a calibration's last shapes included): the chooser asks every pass, and pooling the curve
        costs more than a small model's pass on a CPU."""
        return self._label_cost(shape.cost_label, at)

    def _label_cost(self, label: str, at: int) -> Optional[float]:
        """:meth:`cost` of cost label ``label`` (the curve's growth recomputed first where due)."""
        if self._growth is None or self._timed_since_growth >= min(GROWTH_EVERY, max(self._growth_basis, 1)):
            curve = {key: samples for key, samples in self.costs.items() if not _decoder_label(key)}
            self._growth, self._timed_since_growth = cost_growth(curve), 0
            self._growth_basis = sum(len(samples) for samples in curve.values())
        if label not in self._levels:
            samples = self.costs.get(label)
            if not samples:
                return None
            self._levels[label] = cost_level(samples)
        return scaled_level(self._levels[label], at, self._growth)

    def ar_yardstick(self, at: int) -> Optional[float]:
        """Seconds of a pass of the AR decoder (:func:`~vispec.decoding.ar.decode_ar`) at ``at`` cached tokens, what
        every speed-up is over: its timed passes (:data:`AR_DECODER`, :meth:`note_ar_decoder`) where this curve has
        them, else the chooser's own one-token pass (a pinned curve without the label, or none timed yet). The
        chooser's one-token pass runs in SJD-PAC's batch state with the cache sized for the widest shape and its
        bookkeeping between passes: on tiny-c2i in bfloat16 it cost 1.4 ms where the AR decoder's cost 1.0, so a
        prediction against it overstated every speed-up by 40%."""
        return self._label_cost(AR_DECODER if self.has_ar_decoder else Shape(1).cost_label, at)

    @property
    def has_ar_decoder(self) -> bool:
        """Whether the curve holds the AR decoder's pass (a pinned curve's fallback for missing labels does not count)."""
        return AR_DECODER in self.costs and bool(self.costs[AR_DECODER])

    def needs_ar_decoder(self) -> bool:
        """Whether this decode should first time the AR decoder's pass (:func:`~vispec.decoding.ar.time_ar_passes`,
        then :meth:`note_ar_decoder` with ``fresh=True``), and counts this decode in the caller's
        :attr:`~vispec.decoding.windows.WindowStats.ar_timings`: it calibrates the curve, which has none yet (timed
        on the same machine state as the shapes' costs; a curve given as ``starting_costs`` is not mixed with a
        measurement), or the curve has it and :attr:`~ChooserSettings.recheck` decodes ran since it was last timed
        (decodes handed to AR time it as they run; the interval doubles after each re-timing, up to
        :data:`RETIME_GROWTH` times, and starts again at a decode handed to AR). The chooser's shapes are re-timed by
        every pass they run, the AR decoder's only by decodes handed to AR: timed once while the machine ran slow (on
        a 2-core VM the same AR decode took 0.29 s or 0.55 s a few seconds apart), it priced AR at 3.0-3.5 ms a pass
        where it ran at 1.2-2.6, and every later decode ran chains, at 0.77x the AR decoder over 29 images. Never on a
        pinned curve or under a shape script."""
        if self.settings.shape_script or not self.stats.measures_costs:
            return False
        if not self.has_ar_decoder:
            return self.calibrated
        timings = self.stats.ar_timings
        since = timings[self.key] = timings.get(self.key, 0) + 1
        interval = timings.get((self.key, "interval"), self.settings.recheck)
        if since < interval:
            return False
        timings[(self.key, "interval")] = min(2 * interval, RETIME_GROWTH * self.settings.recheck)
        return True

    def ar_timing_runs(self) -> tuple[int, int]:
        """``(runs, passes)`` of :func:`~vispec.decoding.ar.time_ar_passes` for :meth:`needs_ar_decoder`: four runs
        of 16 passes the first time, of 8 when re-timing (33 passes: about 1.6% of the 8 decodes in between on
        tiny-c2i at batch 1)."""
        return (4, 8) if self.has_ar_decoder else (4, 16)

    def note_ar_decoder(self, samples: Sequence[tuple[int, float]], fresh: bool = False) -> None:
        """Add ``(cached tokens, seconds per pass)`` timings of the AR decoder's pass (:func:`~vispec.decoding.ar.
        time_ar_passes`, or a decode handed to AR) to the curve, kept on disk with it (:meth:`finish`); ``fresh``:
        they replace the label's samples (a re-timing, :meth:`needs_ar_decoder`, as a recheck's re-timing of a shape
        replaces its samples); the last :data:`AR_KEEP` are kept. Restarts the count of :meth:`needs_ar_decoder`."""
        self._keep_decoder_timings(AR_DECODER, samples, fresh, self.key)
        if not fresh:  # a decode handed to AR: the choice may flip back, so the next re-timing comes soon
            self.stats.ar_timings.pop((self.key, "interval"), None)

    def pool_rates(self) -> tuple[np.ndarray, np.ndarray]:
        """The pool's ``(a [CLASSES, MAX_DEPTH], s [MAX_DEPTH])`` (:meth:`ShapeRates.rates`), computed once per block
        (:meth:`_refresh`; a pass's counts are in the pool at once, and in the estimates from the next block on)."""
        if self._pool_rates is None:
            self._pool_rates = self.pool.rates()
        return self._pool_rates

    def sample_factor(self, slots: Sequence[int]) -> np.ndarray:
        """``[S]`` each sample's accepted tests over those the pool's rates expected, shrunk towards 1 by
        :data:`SAMPLE_SHRINK` (module docstring, Rates)."""
        counts = self.sample_hits[np.asarray(slots, dtype=int)]
        return (counts[:, 0] + SAMPLE_SHRINK) / (counts[:, 1] + SAMPLE_SHRINK)

    def rates(self, shape: Shape, slots: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """``(a [S, MAX_DEPTH], s [S, MAX_DEPTH])`` for a pass of ``shape``: its window class's pooled rates, scaled
        by each sample's factor."""
        a, s = self.pool_rates()
        factor = self.sample_factor(slots)[:, None]
        return np.clip(a[window_class(shape.rows)][None, :] * factor, 0.0, 0.99), np.clip(s[None, :] * factor, 0.0, 0.99)

    def class_rates(self, slots: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """``(a [S, CLASSES, MAX_DEPTH], s [S, MAX_DEPTH])``: :meth:`rates` of every window class at once."""
        a, s = self.pool_rates()
        factor = self.sample_factor(slots)
        return (np.clip(a[None] * factor[:, None, None], 0.0, 0.99),
                np.clip(s[None, :] * factor[:, None], 0.0, 0.99))

    def scores(self, live: Sequence[int], n_host: Sequence[int], at: int, need: int) -> dict[Shape, float]:
        """Expected committed tokens per second of every candidate that fits and has a cost."""
        largest = fitting_rows(need)
        priced = [(shape, self.cost(shape, at)) for shape in self.shapes if shape.rows <= largest]
        priced = [(shape, cost) for shape, cost in priced if cost is not None]
        if not priced:
            return {}
        left = np.array([self.num_tokens - n_host[b] for b in live], dtype=float)
        tokens = expected_tokens_table([shape for shape, _ in priced], *self.class_rates(live), left).sum(axis=0)
        return {shape: float(total) / cost for (shape, cost), total in zip(priced, tokens)}

    # ---- decisions ------------------------------------------------------------------------------------------

    def prefers_ar(self) -> bool:
        """Whether a whole decode should run as plain AR: every cost is measured, the pool has rates, and no shape
        beats the AR decoder's pass (:meth:`ar_yardstick`) by :data:`HANDOVER_MARGIN` at mid-image (never while
        calibrating, nor in a decode :meth:`fixed_chain` keeps for the chooser; every
        :attr:`~ChooserSettings.recheck`-th such decode runs the chooser, so the rates stay fresh, and re-times its best
        shape: module docstring, Choice)."""
        if self.calibrating or self.settings.shape_script or not self.pool.measured or self._rechecking:
            return False
        scores, ar = self._handover_scores()
        if ar is None or max(scores.values()) > ar * (1 + HANDOVER_MARGIN):
            return False
        handed = hand_to_ar(self.stats, self.key)
        self._rechecking = not handed
        return handed

    def _handover_scores(self) -> tuple[dict[Shape, float], Optional[float]]:
        """Every shape's score at mid-image (:meth:`scores`) and the AR decoder's (AR's score at the AR decoder's pass,
        :meth:`ar_yardstick`, not the chooser's own one-token pass; None without one), what :meth:`fixed_chain` and
        :meth:`prefers_ar` decide a decode by."""
        middle = self.num_tokens // 2
        scores = self.scores(range(self.slots), [middle] * self.slots, middle, middle)
        ar = scores.get(Shape(1))
        if ar is not None:
            ar *= self.cost(Shape(1), middle) / self.ar_yardstick(middle)
        return scores, ar

    def fixed_chain(self) -> Optional[Shape]:
        """The chain a whole decode should run every pass, without choosing or recording (the chooser's loop with
        that shape fixed, :func:`~vispec.decoding.pac.decode_pac`), or None (the chooser, or AR: :meth:`prefers_ar`,
        decides). The best-scoring chain at mid-image is priced by such decodes' passes (``fixed-chain:L``,
        :meth:`note_fixed_chain`), which skip the chooser's work between passes: on tiny-c2i at batch 1 that work was
        0.3 ms of a 16-row chain's 4.4-5.1 ms pass (choosing, recording; 0.15 ms in MC-SJD's own loop), 7% of it. Such
        a decode is given the chain where it beats the AR decoder by :data:`HANDOVER_MARGIN` and every shape the
        chooser could run, except every :attr:`~ChooserSettings.recheck`-th time, when the chooser runs, so that its
        rates and costs stay fresh. A chain not timed that way, or not for :data:`RETIME_GROWTH` times
        ``recheck`` decodes (as long as the AR decoder may go untimed), gets one such decode, which times it afresh,
        where the chooser's own pass of it is at least level with the AR decoder. Never while calibrating, under a
        shape script or on a pinned curve (nothing is timed there); the caller asks for the maximal coupling only (its
        chain passes are MC-SJD's step; Gumbel's run SJD-PAC's). The tokens' law is the chooser's with that chain
        chosen every pass."""
        if self.calibrating or self.settings.shape_script or not self.pool.measured or not self.stats.measures_costs:
            return None
        middle = self.num_tokens // 2
        scores, ar = self._handover_scores()
        chains = {shape: score for shape, score in scores.items() if not shape.is_ar and not shape.is_tree}
        if not chains or ar is None:
            return None
        chain = max(chains, key=chains.get)
        label = f"{FIXED_CHAIN}:{chain.rows}"
        timings = self.stats.ar_timings
        since = timings[(self.key, label)] = timings.get((self.key, label), 0) + 1  # decodes since it was last timed
        stale = since > RETIME_GROWTH * self.settings.recheck
        decoder_cost = self._label_cost(label, middle) if self.costs.get(label) else None
        if not decoder_cost or stale:  # never timed, or not for as long as the AR decoder may go: one decode times it
            self.handover_speedup = chains[chain] / ar
            self._fixed_fresh = chains[chain] >= ar
            return chain if self._fixed_fresh else None
        decoder = chains[chain] * self.cost(chain, middle) / decoder_cost
        if decoder <= ar * (1 + HANDOVER_MARGIN) or decoder < max(scores.values()):
            return None
        self.handover_speedup = decoder / ar
        if hand_to_ar(self.stats, (self.key, FIXED_CHAIN)):
            return chain
        self._rechecking = True  # the chooser runs this decode (prefers_ar too says so), its best shape re-timed
        return None

    def note_fixed_chain(self, rows: int, samples: Sequence[tuple[int, float]]) -> None:
        """Add ``(cached tokens, seconds per pass)`` timings of a decode that ran a chain of ``rows`` every pass
        (:meth:`fixed_chain`) to the curve, kept on disk with it (:meth:`finish`); its last :data:`AR_KEEP`, as for
        the AR decoder. A decode given the chain to time it (never timed, or stale) replaces the old timings, as a
        re-timing of the AR decoder does."""
        label = f"{FIXED_CHAIN}:{rows}"
        self._keep_decoder_timings(label, samples, self._fixed_fresh, (self.key, label))

    def _keep_decoder_timings(self, label: str, samples: Sequence[tuple[int, float]], fresh: bool,
                              counter: Hashable) -> None:
        """A whole decode's timings under ``label`` (:data:`AR_DECODER`, :data:`FIXED_CHAIN`), kept with the curve:
        ``fresh`` ones replace the label's samples, the last :data:`AR_KEEP` stay; ``stats.ar_timings[counter]``, the
        decodes since the label was timed, restarts."""
        values = self.costs.setdefault(label, [])
        if fresh:
            del values[:]
        values.extend(samples)
        del values[:-AR_KEEP]
        self._levels.pop(label, None)
        self._keep_curve = True
        self.stats.ar_timings[counter] = 0

    def choose(self, n_host: Sequence[int], ids_host: Sequence[int], need: int, at: int) -> Shape:
        """The shape of the next pass; ``n_host``/``ids_host``: the slots' committed counts and requests (-1:
        idle), ``need``: the most rows any live sample can use, ``at``: the longest cached length."""
        for b, request in enumerate(ids_host):
            if request != self.ids[b]:  # a new request in this slot: its own counts start empty
                self.ids[b] = request
                self.sample_hits[b] = 0
        if self._run_start is None:  # the decode's first pass (after a read-back, record restarts the clock)
            self._run_start = self.clock()
        live = [b for b, i in enumerate(ids_host) if i >= 0]
        narrower = self.current is not None and self.current.rows > fitting_rows(need) and not self.settings.shape_script
        if self.left <= 0 or self.current is None or narrower:
            if not self._rates_checked:
                self._measure_rates()
            self._refresh()
            previous = self.current
            self._exploring = self._warming = False
            self._calibrating_block = bool(self.calibrating) and not self.settings.shape_script
            picking = self.clock()
            self.current = self._pick(live, n_host, need, at)
            picked = self.clock() - picking  # scoring every candidate: the chooser's, not the pass's (predicted_speedup)
            self.pick_seconds += picked
            self._run_picking += picked
            warming = self._warming
            changed = previous is None or window_class(previous.rows) != window_class(self.current.rows)
            self._settle = self._settling(self.current) if changed and not self.settings.shape_script else 0
            counted = max(self.settings.block, CALIBRATION_BLOCK) if self._calibrating_block else self.settings.block
            if self._calibrating_block and self.current in self._rates_only:  # its cost is known: a measuring block
                counted = self.settings.block
            if warming:  # one pass, not counted towards the rates (it ramps), nor timed (it compiles)
                self._settle, counted = 1, 0
            measuring = self._exploring or (self._calibrating_block and not warming and not self.current.is_ar)
            if measuring:  # a measuring block: enough sample-passes for a rate (a batch of 1 needs more passes)
                counted = max(counted, -(-self.settings.samples // max(len(live), 1)))
            if self.current.is_ar and not warming and not self.settings.shape_script:
                # AR passes count no acceptance, so the scores stay as they are: re-score seldom. While calibrating,
                # AR's cost is every shape's yardstick, and a few one-token passes are a few milliseconds: one
                # scheduler hiccup in them made AR 1.5x dearer than it ran, and a decode that then runs chains never
                # measures it again
                counted *= AR_BLOCKS
            self.left = self._settle + counted
        self.left -= 1
        self._settle -= 1
        self._at, self._live = at, len(live)
        cost, ar_cost = self.cost(self.current, at), self.ar_yardstick(at)
        if cost is not None and ar_cost is not None and live and self.current.is_ar:
            self.predicted.append((len(live) / self.slots, cost, ar_cost))
        elif cost is not None and ar_cost is not None and live:
            left = np.array([self.num_tokens - n_host[b] for b in live])
            tokens = expected_tokens(self.current, *self.rates(self.current, live), np.minimum(left, self.current.main))
            self._steady = total = float(tokens.sum())
            if self._settle >= 0:  # a settling pass: the ramp's share of the steady state's extra tokens
                total = len(live) + self.pool.ramp_shares()[window_class(self.current.rows)] * (total - len(live))
            self.predicted.append((total / self.slots, cost, ar_cost))
        return self.current

    def _measure_rates(self) -> None:
        """At the decode's first block start: where the pool has no rates yet (new weights or sampling, the cost
        curve from disk), every chain and tree runs a calibration block, whose passes count their acceptance.
        Judged by the prior alone a wide window rarely beats a cheap AR step, and AR passes measure nothing: the
        decode, and each one handed to AR after it, would stay in AR for good."""
        self._rates_checked = True
        if self.pool.measured or self.settings.shape_script:
            return
        rates_only = [s for s in calibration_shapes(self.shapes)
                      if not s.is_ar and s not in self.calibrating and self.may_run(s)]
        self._rates_only = set(rates_only)  # blocks of samples sample-passes (choose), not timed calibration blocks
        self.calibrating = sorted(self.calibrating + rates_only)
        if rates_only:
            import sys

            print(f"vispec: measuring acceptance for {len(rates_only)} pass shapes (new weights or sampling)",
                  file=sys.stderr, flush=True)

    def _settling(self, shape: Shape) -> int:
        """A switch's settling passes (:func:`settle_passes`); none with ``ChooserSettings(settle=0)``."""
        return settle_passes(shape) if self.settings.settle > 0 else 0

    def _refresh(self) -> None:
        """At a block start: the rates and the levels of the labels timed since the last block start are computed
        again from what the passes since counted and timed (the curve's growth every :data:`GROWTH_EVERY` timed
        passes, :meth:`cost`). Computed every pass they would cost a few milliseconds each (the pooled curve's
        medians, the rates' recursion over depths): more than a small model's pass on a CPU, and part of every
        pass's measured cost."""
        if self._stale:
            self._pool_rates, self._stale = None, False
        for label in self._retimed:
            self._levels.pop(label, None)
        self._retimed.clear()

    def _pick(self, live: list[int], n_host: Sequence[int], need: int, at: int) -> Shape:
        if self.settings.shape_script:  # forced: the scripted shapes in turn, whatever the samples need (tests)
            self._scripted = getattr(self, "_scripted", -1) + 1
            return self.settings.shape_script[self._scripted % len(self.settings.shape_script)]
        while self.warming:  # the first decode on a machine (or in a process): one untimed pass of each cost label
            shape = self.warming.pop(0)  # (compiles it) ...
            if shape.rows <= fitting_rows(need):
                self._warming = True
                return shape
        if self.calibrating and not self._collected:
            self._collected = True
            gc.collect()  # ... then the compiles' garbage goes, not during a timed block (counted as choosing) ...
        while self.calibrating:  # ... then each label for a timed block
            shape = self.calibrating.pop(0)
            if shape.rows <= fitting_rows(need):
                return shape
        steady = self.scores(live, n_host, at, need)
        if not steady:
            return Shape(1)
        if self._rechecking:  # once: the best non-AR shape runs a measuring block, timed afresh (module docstring)
            self._rechecking = False
            others = {shape: score for shape, score in steady.items() if not shape.is_ar}
            if others:
                shape = max(others, key=others.get)
                self._exploring = True
                self._fresh.add(shape.cost_label)
                return shape
        left = float(np.mean([self.num_tokens - n_host[b] for b in live])) if live else 0.0
        scores = self._with_ramps(steady, len(live), left, at)
        best = max(scores, key=scores.get)
        margin = 1 + self.settings.margin
        ar = scores.get(Shape(1))
        if ar is not None and not best.is_ar and scores[best] < ar * margin:
            best = Shape(1)
        current = self.current
        if current is not None and current in scores and best != current and scores[best] < scores[current] * margin:
            best = current
        pool = self.pool
        if current is not None and pool.passes >= pool.next_explore:
            pool.explore_every = min(2 * pool.explore_every, EXPLORE_CAP * self.settings.refresh)
            pool.next_explore = pool.passes + pool.explore_every
            explore = self._exploration(live, n_host, at, steady, best)
            if explore is not None:
                self._exploring = True
                return explore
        return best

    def _with_ramps(self, scores: dict[Shape, float], live: int, left: float, at: int) -> dict[Shape, float]:
        """``scores`` (steady-state tokens per second) with a switch's ramp (module docstring, The ramp). A shape of
        another window class than the current one, whose steady state commits ``E`` tokens a pass per live sample
        (its score times its cost over ``live``), commits ``R = 1 + r (E - 1)`` in each of its ``s`` settling
        passes; the ``left`` tokens a live sample lacks on average then take ``s' + (left - s' R) / E`` passes
        (``s' = min(s, left / R)``): scored ``live left / (passes cost)``. The current class scores ``E / cost``
        per sample, what this gives without settling passes."""
        current = None if self.current is None else window_class(self.current.rows)
        shares = self.pool.ramp_shares()
        out = {}
        for shape, score in scores.items():
            settle = self._settling(shape)
            c = window_class(shape.rows)
            if settle == 0 or c == current or live == 0 or left <= 0:
                out[shape] = score
                continue
            cost = self.cost(shape, at)
            steady = max(score * cost / live, 1.0)
            ramp = 1.0 + shares[c] * (steady - 1.0)
            settling = min(settle, left / ramp)
            passes = settling + (left - settling * ramp) / steady
            out[shape] = live * left / (passes * cost)
        return out

    def _exploration(self, live: list[int], n_host: Sequence[int], at: int, scores: dict[Shape, float],
                     best: Shape) -> Optional[Shape]:
        """The chain to run for a measuring block (module docstring, Settling and exploring), None if none could
        pay: the chains one window class narrower and wider than the best-scoring chain, not of the current
        shape's class nor ``best``'s (the shape chosen; ``scores``: every candidate's, as :meth:`scores` gave them
        for this pick), whose score under *optimistic* rates (each depth at the highest rate any measured class has
        there) beats ``best``'s; of them the class
        measured longest ago (the narrower on a tie). Climbing from the best chain finds the best window of a
        unimodal curve of chain scores, which a wide window briefly measured and under-estimated would hide."""
        score = scores[best]
        chains = {shape: value for shape, value in scores.items() if not shape.is_ar and not shape.is_tree}
        if not chains:
            return None
        top = window_class(max(chains, key=chains.get).rows)
        a, _ = self.pool_rates()
        seen = self.pool.main[..., 1].sum(axis=1) > 0
        optimistic = (a[seen] if seen.any() else a).max(axis=0)
        rates = np.broadcast_to(optimistic, (len(live), MAX_DEPTH))
        left = np.array([self.num_tokens - n_host[b] for b in live])
        options = []
        for shape in chains:
            c = window_class(shape.rows)
            if abs(c - top) != 1 or c in (window_class(self.current.rows), window_class(best.rows)):
                continue
            tokens = expected_tokens(shape, rates, np.zeros_like(rates), np.minimum(left, shape.main))
            if float(tokens.sum()) / self.cost(shape, at) > score:
                options.append((int(self.pool.last[c]), shape.rows, shape))
        return min(options)[2] if options else None

    def must_sync(self) -> bool:
        """Whether the AR pass just chosen needs a read-back: its block ends or its cost label is still cold (not every
        pass while calibrating either: a read-back per pass would make AR look dearer than it runs)."""
        return self.left <= 0 or self.current.cost_label not in self._warm

    # ---- measurements ---------------------------------------------------------------------------------------

    def record(self, shape: Shape, before: Sequence[tuple[int, int]], after: Sequence[int],
               ranks: Optional[Sequence[Sequence[int]]], synced: bool) -> None:
        """After a pass of ``shape``: ``before[b] = (n, request)`` per slot, ``after[b]`` the committed counts,
        ``ranks[b][d - 1]`` the rank accepted on the committed path at tree depth ``d`` (-1 past its end; None for
        AR and chain passes); ``synced``: the pass ended with a read-back (then the time since the last one is the
        cost of the passes in between)."""
        self._run.append(self._at)
        label = shape.cost_label
        if synced:
            elapsed = self.clock() - self._run_start - self._run_picking
            self._run_picking = 0.0
            if label in self._warm and self._live == self.slots:
                per_pass = elapsed / len(self._run)
                values = self.costs.setdefault(label, [])
                if label in self._fresh:  # a recheck's re-timing: the old samples go (module docstring)
                    self._fresh.discard(label)
                    del values[:]
                    self._keep_curve = True
                values.extend((at, per_pass) for at in self._run)
                del values[:-KEEP]
                self._retimed.add(label)
                self._timed_since_growth += len(self._run)
            self._warm.add(label)
            self._run = []
        self.passes += 1
        self.pool.passes += 1
        self.sample_hits *= SAMPLE_DECAY
        if not shape.is_ar and self._settle >= 0 and self._steady is not None:  # settling: the ramp's counts
            live = [b for b, (_, request) in enumerate(before) if request >= 0]
            extra = sum(after[b] - before[b][0] - 1 for b in live)
            self.pool.note_ramp(shape, float(extra), self._steady - len(live))
            self._stale = True
        self._steady = None
        if not shape.is_ar and self._settle < 0:  # a block's settling passes ramp from other drafts: not counted
            self.pool.note_pass(shape)
            expected = self.pool_rates()[0][window_class(shape.rows)]
            for b, ((n, request), n_after) in enumerate(zip(before, after)):
                if request >= 0:
                    path = ranks[b] if ranks is not None and shape.is_tree else ()
                    self._count(b, shape, n_after - n - 1, min(shape.main, self.num_tokens - n), path, expected)
            self._stale = True
        if synced:  # the next run's time starts here: the chooser's own work between passes is part of a pass's cost
            self._run_start = self.clock()

    def _count(self, b: int, shape: Shape, e: int, width: int, path: Sequence[int], expected: np.ndarray) -> None:
        """Add sample ``b``'s committed path (depth ``e``, ranks ``path``) to the pool's counts and its own
        (``expected``: the pool's rates of this pass's class, for the sample's factor)."""
        main, sibling, mine = self.pool.main[window_class(shape.rows)], self.pool.sibling, self.sample_hits[b]
        levels = shape.levels if shape.is_tree else 1
        for d in range(1, min(e + 1, width - 1) + 1):
            rank = path[d - 1] if d - 1 < len(path) and d < levels else 0
            hit = d <= e and rank == 0
            main[d, 1] += 1
            main[d, 0] += hit
            mine[0] += hit
            mine[1] += expected[d]
            if d < levels:  # siblings at a tree level: tested in rank order after the main draft
                tried = shape.branching - 1 if (d > e or rank < 0) else rank
                for k in range(1, tried + 1):
                    sibling[k, 1] += 1
                    sibling[k, 0] += d <= e and k == rank
            if d <= e and rank > 0:  # the path left the main path: what follows says nothing of main drafts
                return

    def finish(self, model: object) -> Optional[str]:
        """After the decode: keep the pooled rates on disk if this decode counted passes (:func:`save_shape_rates`),
        and the cost curve (:func:`~vispec.decoding.windows.save_step_costs`) if it measured it, timed the AR decoder
        or re-timed a shape for a recheck; the cost curve's path, None if it was not written."""
        if self.pool.counted > self._counted_at_start:
            save_shape_rates(self.pool, self.spec)
        if not self.calibrated and not self._keep_curve:
            return None
        return save_step_costs(self.stats, model, self.key)

    # ---- reporting ------------------------------------------------------------------------------------------

    def predicted_speedup(self) -> Optional[float]:
        """Predicted speed-up over the AR decoder: ``sum E c_AR / (sum c + choosing)`` over the passes, ``c_AR`` the AR
        decoder's pass at the pass's cached length (:meth:`ar_yardstick`), ``E`` the pass's expected tokens summed over
        its live samples per batch slot (AR commits one per slot a pass: a pass that carries finished slots, at a
        batch's ragged end, advances the batch less than its live samples' mean says); choosing: the seconds spent
        scoring candidates, which a pass's measured cost leaves out, so that a one-pass run at a block start does not
        look dearer than the shape runs. None when costs were not known."""
        if not self.predicted:
            return None
        tokens = sum(t * ar for t, _, ar in self.predicted)
        return tokens / (sum(c for _, c, _ in self.predicted) + self.pick_seconds)


__all__ = ["Shape", "ShapeChooser", "ShapeRates", "calibration_shapes", "candidate_shapes", "expected_tokens",
           "expected_tokens_table", "fits", "load_shape_rates", "save_shape_rates"]
