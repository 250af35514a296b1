"""The shape chooser of ``decoding="auto"`` and ``"sjd-pac:window=auto"`` (vispec/decoding/shapes.py): its spec, its
expected-token model, the rates it counts, its choices, its cost cache, and the decodes that run it. The joint-
distribution certificate with shapes switching every pass is in tests/exactness/test_exactness.py."""

from __future__ import annotations

import json
import os
import time

import numpy as np
import pytest
import torch
from helpers import TREE_LABELS, TREE_SAMPLING, tiny_gpt, tree_decode, tree_gpt

from vispec.decoding import DecodingConfig, decode
from vispec.decoding.ar import time_ar_passes
from vispec.decoding.common import DecodeJob
from vispec.decoding.shapes import (AR_BLOCKS, AR_DECODER, AR_KEEP, CALIBRATION_BLOCK, FIXED_CHAIN, CLASSES, HANDOVER_MARGIN, MAX_DEPTH,
                                    PRIOR_RAMP, RETIME_GROWTH, SAMPLE_DECAY, SHRINK, Shape, ShapeChooser, ShapeRates, calibration_shapes,
                                    candidate_shapes, expected_tokens, expected_tokens_table, load_shape_rates,
                                    settle_passes, window_class)
from vispec.decoding.windows import ChooserSettings, WindowStats
from vispec.models.llamagen_gpt import LlamaGenCondition

SAMPLING, LABELS, _run = TREE_SAMPLING, TREE_LABELS, tree_decode


@pytest.fixture(scope="module")
def model():
    return tree_gpt()


def _costs(**overrides) -> dict:
    """Step costs by cost label: ``ar`` 1, everything else as given (default: flat, 1)."""
    labels = {s.cost_label for s in candidate_shapes(64, 3, 3, every_tree=True)}
    return {label: [(0, float(overrides.get(label.replace(":", "_"), 1.0)))] for label in labels}


def test_spec_names_defaults_and_errors():
    auto = DecodingConfig.parse("auto")
    assert (auto.strategy, auto.window, auto.coupling, auto.tree_width, auto.tree_depth) == ("auto", "auto", "maximal", 3, 3)
    assert auto.name == "auto" and DecodingConfig.parse(auto.name) == auto
    small = DecodingConfig.parse("auto-gumbel:tree_width=2,tree_depth=2")
    assert small.name == "auto-gumbel:tree_width=2,tree_depth=2" and DecodingConfig.parse(small.name) == small
    assert DecodingConfig.parse("mc-sjd", base=auto).window == 16  # another strategy takes its own window back
    for spec, words in [("auto:window=8", "window must be 'auto'"), ("auto+lantern:k=3", "'auto' verifies with the exact"),
                        ("auto:tree_width=8", "the largest window 'auto' picks is 64"), ("auto:coupling=none", "coupling")]:
        with pytest.raises(ValueError, match=words):
            DecodingConfig.parse(spec)


def test_candidates_and_one_calibration_shape_per_cost_label():
    shapes = candidate_shapes(64, 3, 3, every_tree=True)
    assert Shape(1) in shapes and all(Shape(w) in shapes for w in (2, 4, 8, 16, 32, 64))
    assert Shape(4, 3, 2) in shapes and Shape(8, 2, 3) in shapes and Shape(16, 3, 3) in shapes
    assert Shape(8, 3, 3) not in shapes  # 13 tree slots do not fit 8 rows
    assert all(s.tree_slots <= s.rows for s in shapes)
    labels = calibration_shapes(shapes)
    assert len({s.cost_label for s in labels}) == len(labels) == 12  # ar, 6 chains, trees of 4 .. 64 rows
    assert Shape(16, 3, 3) in labels and Shape(4, 3, 2) in labels  # the widest tree of its rows
    assert Shape(16, 3, 3).main == 6 and Shape(16, 3, 3).label == "tree 16 K3 D3" and Shape(1).label == "ar"


def test_expected_tokens_of_a_chain_is_the_geometric_sum():
    """With the same rate ``a`` at every age: ``E[T] = 1 + a + ... + a^(W-1)``, cut at the rows a sample can use."""
    a = 0.6
    g = np.full((2, MAX_DEPTH), a)
    s = np.zeros((2, MAX_DEPTH))
    tokens = expected_tokens(Shape(8), g, s, np.array([8, 3]))
    assert tokens == pytest.approx([sum(a ** d for d in range(8)), 1 + a + a * a])
    assert expected_tokens(Shape(1), g, s, np.array([8, 3])).tolist() == [1.0, 1.0]


def test_expected_tokens_of_a_tree_matches_a_simulation_of_its_model():
    """Tree levels continue with any of K candidates (main rate a, siblings s_1, s_2 in turn); below the tree only an
    all-main path continues. Monte Carlo of that process agrees with the closed form."""
    a, s1, s2 = 0.55, 0.3, 0.2
    shape = Shape(16, 3, 3)  # main path of 6: tree levels 1, 2, then a chain to depth 5
    g = np.full((1, MAX_DEPTH), a)
    s = np.zeros((1, MAX_DEPTH))
    s[0, 1], s[0, 2] = s1, s2
    rng = np.random.default_rng(0)
    total, runs = 0, 200_000
    for _ in range(runs):
        tokens, main = 1, True
        for depth in range(1, shape.main):
            if depth < shape.levels:
                hit_main = rng.random() < a
                hit = hit_main or rng.random() < s1 or rng.random() < s2
                main = main and hit_main
            else:
                hit = main and rng.random() < a
            if not hit:
                break
            tokens += 1
        total += tokens
    assert expected_tokens(shape, g, s, np.array([16]))[0] == pytest.approx(total / runs, rel=0.01)


def test_rates_are_kept_per_window_class_and_deep_depths_shrink_towards_their_pooled_tail():
    """A wide window's drafts are refined more often, so its rates are its own. Depth 1 shrinks towards the prior, a
    deeper depth towards the class's pooled rate at it and below, not towards depth 1's lower rate: a depth seen
    twice, both rejected, does not zero the rates below it; a fall of acceptance deep in the window shows; depths
    never reached carry the last rate on. An unmeasured class borrows the nearest narrower one's."""
    rates = ShapeRates()
    rates.main[window_class(4), 1:4] = [30, 40]  # window 4: 3/4 accepted at depths 1-3
    rates.main[window_class(16), 1] = [20, 40]  # window 16: 1/2 at depth 1 ...
    rates.main[window_class(16), 2:10] = [18, 20]  # ... 9/10 at depths 2-9
    rates.main[window_class(16), 10] = [0, 2]  # depth 10 seen twice, both rejected
    rates.main[window_class(32), 1:14] = [9, 10]
    rates.main[window_class(32), 14:17] = [2, 10]  # window 32: 0.9 down to depth 13, then 0.2
    a, _ = rates.rates()
    first = (20 + 4 * 0.5) / 44
    assert a[window_class(4), 1] == pytest.approx((30 + 4 * 0.5) / 44) and a[window_class(16), 1] == pytest.approx(first)
    tail = (8 * 18 + 4 * first) / (8 * 20 + 2 + 4)  # depth 2's pooled tail (depths 2-10), shrunk towards depth 1
    assert a[window_class(16), 2] == pytest.approx((18 + 4 * tail) / 24) and a[window_class(16), 2] > 0.85
    assert 0.3 < a[window_class(16), 10] < a[window_class(16), 9]  # lower, not zero
    assert a[window_class(16), 30] == pytest.approx(a[window_class(16), 10])  # never reached
    assert a[window_class(32), 15] < 0.4 < 0.75 < a[window_class(32), 12]
    assert np.array_equal(a[window_class(8)], a[window_class(4)])  # not measured: window 4's
    assert window_class(1) == 0 and window_class(2) == 1 and window_class(64) == 6 and window_class(5) == 3


def _chooser(costs: dict, slots: int = 2, settings: ChooserSettings = ChooserSettings(block=1)) -> ShapeChooser:
    stats = WindowStats(starting_costs=costs, settings=settings)
    return ShapeChooser(candidate_shapes(64, 3, 3, every_tree=True), stats, "key", "spec", slots, 256)


def _teach(chooser: ShapeChooser, rate: float, passes: int = 200, shape: Shape = Shape(64)) -> None:
    """Feed the pool passes of ``shape`` whose committed paths accept each draft with probability ``rate``."""
    rng = np.random.default_rng(1)
    n = 1
    chooser._rates_checked = True  # taught here: no calibration blocks for rates (_measure_rates)
    for _ in range(passes):
        chooser.choose([n, n], [0, 1], need=16, at=n)
        e = 0
        while e < shape.main - 1 and rng.random() < rate:
            e += 1
        chooser.record(shape, [(n, 0), (n, 1)], [n + e + 1] * 2, None, synced=False)
        n = min(n + e + 1, 100)


def test_flat_costs_pick_a_wide_shape_and_a_costly_window_hands_over_to_ar():
    flat = _chooser(_costs(), settings=ChooserSettings(block=1, refresh=10**6))  # scoring only: no measuring blocks
    _teach(flat, 0.8)
    choice = flat.choose([10, 10], [0, 1], need=64, at=10)
    assert choice.rows == 64  # the most expected tokens when every pass costs the same
    costly = _chooser({label: [(0, 1.0 if label == "ar" else 10.0)] for label in _costs()})
    _teach(costly, 0.5)
    assert costly.choose([10, 10], [0, 1], need=64, at=10) == Shape(1)
    assert costly.prefers_ar()  # a whole decode goes to AR


@pytest.mark.parametrize("every_tree", [True, False])
def test_the_table_of_expected_tokens_is_expected_tokens_of_every_shape(every_tree):
    """All candidates scored at once (a block start's work) give what scoring each alone gives, with each shape's own
    window class's rates, for samples with few tokens left (narrower than the window) and many."""
    rng = np.random.default_rng(3)
    shapes = candidate_shapes(64, 3, 3, every_tree=every_tree)
    for samples in (1, 4):
        rates, siblings = rng.uniform(0, 0.99, (samples, CLASSES, MAX_DEPTH)), rng.uniform(0, 0.99, (samples, MAX_DEPTH))
        left = np.array([3, 100, 0, 40][:samples], dtype=float)
        table = expected_tokens_table(shapes, rates, siblings, left)
        for i, shape in enumerate(shapes):
            alone = expected_tokens(shape, rates[:, window_class(shape.rows)], siblings, np.minimum(left, shape.main))
            assert table[:, i] == pytest.approx(alone, rel=1e-12)


def test_the_yardstick_is_the_ar_decoders_pass_where_the_curve_holds_it(monkeypatch):
    """Speed-ups are over the AR decoder a user would run: with its pass timed at half the chooser's own one-token
    pass, a shape 20% faster than the latter is slower than the AR decoder (the decode goes to AR), and the predicted
    speed-up halves. Without the label, or where a pinned curve only falls back for it, the chooser's own AR pass is
    the yardstick. Only a calibrating decode times the AR decoder."""
    from vispec.eval.bench.roofline import PinnedStats

    chooser = _chooser(_costs(), settings=ChooserSettings(block=1, recheck=10**6))
    assert not chooser.has_ar_decoder and not chooser.needs_ar_decoder()  # starting costs: not calibrating
    _teach(chooser, 0.5, passes=20, shape=Shape(2))
    monkeypatch.setattr(chooser, "scores", lambda *a: {Shape(1): 1.0, Shape(2): 1.2})
    assert chooser.ar_yardstick(128) == pytest.approx(1.0) and chooser.prefers_ar() is False
    assert {ar for _, _, ar in chooser.predicted} == {1.0}  # each pass's (tokens, cost, AR's cost)
    chooser.note_ar_decoder([(0, 0.5), (10, 0.5), (20, 0.5)])
    assert chooser.has_ar_decoder and chooser.ar_yardstick(128) == pytest.approx(0.5)
    assert chooser.prefers_ar() is True
    chooser.predicted = []
    chooser.choose([3, 3], [0, 1], need=16, at=3)
    assert [ar for _, _, ar in chooser.predicted] == [0.5]  # so the predicted speed-up halves
    pinned = ShapeChooser(candidate_shapes(64, 3, 3, every_tree=True),
                          PinnedStats(starting_costs=_costs(), fallback=((0, float("inf")),)), "key", "spec", 2, 256)
    assert not pinned.has_ar_decoder and pinned.ar_yardstick(0) == pytest.approx(1.0) and not pinned.needs_ar_decoder()
    fresh = ShapeChooser(candidate_shapes(64, 3, 3, every_tree=True), WindowStats(), "key", "spec", 1, 256)
    assert fresh.calibrated and fresh.needs_ar_decoder()


def test_a_yardstick_timed_while_the_machine_ran_slow_is_re_timed(model, monkeypatch):
    """The AR decoder's pass timed at 3 s (the machine ran slow then) makes a 16-row chain look 2.5x faster than AR, so
    the chooser runs; every ``recheck``-th such decode times the AR decoder's pass afresh (at 1 s now), its samples
    replacing the stale ones, and the next decode goes to AR. Decodes handed to AR time it themselves: they restart
    the count, and only the last AR_KEEP timings count. While the chooser keeps running, the interval doubles up to
    RETIME_GROWTH times ``recheck``. A pinned curve is never re-timed."""
    import vispec.decoding.pac as pac
    from vispec.eval.bench.roofline import PinnedStats

    costs = {label: [(0, 1.0 if label == "ar" else 50.0)] for label in _costs()}
    costs.update({"chain:16": [(0, 6.0)], AR_DECODER: [(0, 3.0)] * 4})
    stats = WindowStats(starting_costs=costs, settings=ChooserSettings(block=1, recheck=3))

    def chooser() -> ShapeChooser:
        made = ShapeChooser(candidate_shapes(64, 3, 3, every_tree=True), stats, "key", "spec", 1, 256)
        made.pool.main[window_class(16), 1:16] = [80.0, 100.0]  # 0.8 a depth: about 4.9 tokens a chain-16 pass
        made._rates_checked = True
        return made

    due = [chooser().needs_ar_decoder() for _ in range(3)]
    assert due == [False, False, True] and chooser().prefers_ar() is False  # 4.9 / 6 s against 1 / 3 s
    first = chooser()
    first.note_ar_decoder([(at, 1.0) for at in (5, 13, 21, 29)], fresh=True)
    assert stats.costs("key")[AR_DECODER] == [(at, 1.0) for at in (5, 13, 21, 29)]  # the stale 3 s are gone
    assert chooser().prefers_ar() is True  # 4.9 / 6 s against 1 / 1 s
    assert stats.ar_timings["key"] == 0
    for _ in range(5):  # handed decodes time the AR decoder as they run: never due
        handed = chooser()
        assert not handed.needs_ar_decoder()
        handed.note_ar_decoder([(128, 1.0)])
    assert len(stats.costs("key")[AR_DECODER]) == AR_KEEP  # the last ones: as recent as a shape's cost
    chooser().note_ar_decoder([(128, 3.0)] * AR_KEEP)  # slow again: the chooser runs ...
    due = []
    for _ in range(3 + 6 + 12 + 12):
        made = chooser()
        due.append(made.needs_ar_decoder())
        if due[-1]:  # timed at 3 s again
            made.note_ar_decoder([(at, 3.0) for at in (5, 13, 21, 29)], fresh=True)
    assert [i + 1 for i, d in enumerate(due) if d] == [3, 9, 21, 33] and RETIME_GROWTH == 4  # after 3, 6, 12, 12 decodes
    pinned = PinnedStats(starting_costs=costs, fallback=((0, float("inf")),), settings=ChooserSettings(recheck=1))
    made = ShapeChooser(candidate_shapes(64, 3, 3, every_tree=True), pinned, "key", "spec", 1, 256)
    assert made.has_ar_decoder and not any(made.needs_ar_decoder() for _ in range(4))

    timed = []  # a decode re-times with time_ar_passes' shorter runs, then decodes as usual
    original = pac.time_ar_passes
    monkeypatch.setattr(pac, "time_ar_passes", lambda *a, **k: timed.append(k) or original(*a, **k))
    stats = WindowStats(settings=ChooserSettings(recheck=2))
    for _ in range(3):
        _run(model, "auto", window_stats=stats)
    assert timed == [{"runs": 4, "passes": 16}, {"runs": 4, "passes": 8}]  # the calibration, then the second decode after it
    assert len(next(iter(stats.step_costs.values()))[AR_DECODER]) == 4  # the re-timing's four runs alone


def test_a_chain_that_beats_ar_without_the_choosers_work_gets_the_whole_decode(monkeypatch):
    """The best chain at mid-image, priced by decodes that ran it every pass without choosing (``fixed-chain:L``),
    beats the AR decoder by HANDOVER_MARGIN where the chooser's pass of it does not: the decode runs that chain,
    except every ``recheck``-th, which runs the chooser (prefers_ar agrees, and the best shape is re-timed first).
    Never timed so, or not for RETIME_GROWTH x recheck decodes, it gets one decode, which times it afresh, where the
    chooser's own pass is at least level with AR. A tree that scores higher keeps the chooser; a pinned curve, a
    shape script or a calibration never fixes a chain."""
    from vispec.eval.bench.roofline import PinnedStats

    scores = {Shape(1): 1.0, Shape(16): 1.1, Shape(16, 3, 3): 0.9}
    costs = {**_costs(), FIXED_CHAIN + ":16": [(0, 0.8)]}  # 1.1 x 1.0 / 0.8 = 1.375 x AR's 1.0
    chooser = _chooser(costs, settings=ChooserSettings(block=1, recheck=3))
    _teach(chooser, 0.5, passes=20, shape=Shape(2))
    monkeypatch.setattr(chooser, "scores", lambda *a: dict(scores))
    assert 1.1 < 1 + HANDOVER_MARGIN and chooser.prefers_ar() is True  # the chooser's own chain would not pay
    assert [chooser.fixed_chain() for _ in range(2)] == [Shape(16), Shape(16)]
    assert chooser.handover_speedup == pytest.approx(1.375)
    assert chooser.fixed_chain() is None and chooser.prefers_ar() is False  # the third: a recheck runs the chooser
    stale = _chooser(costs, settings=ChooserSettings(block=1, recheck=3))  # timed 4 x 3 decodes ago: timed afresh
    _teach(stale, 0.5, passes=20, shape=Shape(2))
    monkeypatch.setattr(stale, "scores", lambda *a: dict(scores))
    stale.stats.ar_timings[("key", FIXED_CHAIN + ":16")] = RETIME_GROWTH * 3
    assert stale.fixed_chain() == Shape(16) and stale.handover_speedup == pytest.approx(1.1)
    stale.note_fixed_chain(16, [(128, 0.7)])
    assert stale.costs[FIXED_CHAIN + ":16"] == [(128, 0.7)]  # the old timing replaced
    assert stale.stats.ar_timings[("key", FIXED_CHAIN + ":16")] == 0

    fresh = _chooser(_costs())  # never timed: explored where the chooser's chain is level with AR
    _teach(fresh, 0.5, passes=20, shape=Shape(2))
    monkeypatch.setattr(fresh, "scores", lambda *a: dict(scores))
    assert fresh.fixed_chain() == Shape(16)
    monkeypatch.setattr(fresh, "scores", lambda *a: {**scores, Shape(16): 0.95})
    assert fresh.fixed_chain() is None
    treed = _chooser(costs)
    _teach(treed, 0.5, passes=20, shape=Shape(2))
    monkeypatch.setattr(treed, "scores", lambda *a: {**scores, Shape(16, 3, 3): 1.5})  # beats the decoder's 1.375
    assert treed.fixed_chain() is None

    pinned = ShapeChooser(candidate_shapes(64, 3, 3, every_tree=True), PinnedStats(starting_costs=costs), "key", "spec",
                          2, 256)
    scripted = _chooser(costs, settings=ChooserSettings(shape_script=(Shape(16),)))
    for other in (pinned, scripted):
        _teach(other, 0.5, passes=20, shape=Shape(2))
        monkeypatch.setattr(other, "scores", lambda *a: dict(scores))
        assert other.fixed_chain() is None
    calibrating = _chooser({})
    assert calibrating.calibrating and calibrating.fixed_chain() is None


def test_a_decode_given_one_chain_runs_it_every_pass_and_times_it(model, monkeypatch):
    """A decode given a chain runs it every pass without choosing or recording: its tokens and passes are
    ``mc-sjd:window=L``'s for the same generators, its report names the chain, and its passes' time is kept under
    ``fixed-chain:L`` with the curve. The Gumbel coupling never asks (its chains run SJD-PAC's step)."""
    asked = []
    monkeypatch.setattr(ShapeChooser, "fixed_chain", lambda self: asked.append(1) or Shape(4))
    monkeypatch.setattr(ShapeChooser, "choose", lambda *a: pytest.fail("a fixed chain chose"))
    monkeypatch.setattr(ShapeChooser, "record", lambda *a: pytest.fail("a fixed chain recorded"))
    stats = WindowStats()
    out = _run(model, "auto", window_stats=stats)
    fixed = _run(model, "mc-sjd:window=4")
    passes = sum(fixed.stats.windows.values())  # MC-SJD's eager loop narrows the image's last windows; auto pads them
    assert torch.equal(out.tokens, fixed.tokens) and torch.equal(out.stats.nfe, fixed.stats.nfe)
    assert out.stats.shapes == {"chain 4": passes} and out.stats.windows == {4: passes} and out.method == "auto"
    assert out.stats.chooser["fixed_shape"] == "chain 4" and not out.stats.chooser["handed_to_ar"]
    (costs,) = [c for key, c in stats.step_costs.items() if key[0] == "shapes"]
    assert len(costs[FIXED_CHAIN + ":4"]) == 1 and costs[FIXED_CHAIN + ":4"][0][1] > 0
    asked.clear()
    monkeypatch.undo()
    monkeypatch.setattr(ShapeChooser, "fixed_chain", lambda self: asked.append(1) or Shape(4))
    gumbel = _run(model, "auto-gumbel", window_stats=WindowStats())
    assert not asked and "fixed_shape" not in gumbel.stats.chooser


def test_the_ar_decoders_pass_is_timed_on_its_own_seeds_and_kept_with_the_curve(model):
    """time_ar_passes runs decode_ar's step: the caller's generators are not advanced, and it gives one timing per
    run of passes at increasing cached lengths; a calibrating auto decode keeps them under AR_DECODER."""
    generators = [torch.Generator().manual_seed(s) for s in range(2)]
    states = [g.get_state() for g in generators]
    job = DecodeJob(num_tokens=16, sampling=SAMPLING, generator=generators, grid_width=4)
    samples = time_ar_passes(model, LlamaGenCondition(class_labels=torch.tensor([0, 1])), job, time.perf_counter,
                             runs=3, passes=4)
    assert [at for at, _ in samples] == [3, 7, 11] and all(seconds > 0 for _, seconds in samples)
    assert all(torch.equal(g.get_state(), state) for g, state in zip(generators, states))
    stats = WindowStats()
    _run(model, "auto", window_stats=stats)
    (costs,) = stats.step_costs.values()
    assert len(costs[AR_DECODER]) == 4  # 16 tokens: four runs of 3 passes after the untimed one


def test_a_recheck_re_times_the_best_shape_so_a_stale_cost_does_not_keep_decodes_in_ar():
    """A 16-row chain calibrated at 6 s a pass (the machine ran slow then) loses to AR's 1 s, so decodes go to AR. The
    recheck decode (every ``recheck``-th) first runs that chain for a measuring block; its passes now take 2 s, and
    those timings replace the stale samples: the chain wins from then on, in this decode and at the next hand-over
    decision."""
    now = [0.0]
    costs = {label: [(0, 1.0 if label == "ar" else 50.0)] for label in _costs()}
    costs["chain:16"] = [(at, 6.0) for at in range(64)]  # a full set of samples: new ones alone would not move its median
    stats = WindowStats(starting_costs=costs, settings=ChooserSettings(block=1, recheck=2, refresh=10**6), clock=lambda: now[0])
    chooser = ShapeChooser(candidate_shapes(64, 3, 3, every_tree=True), stats, "key", "spec", 1, 256)
    chooser.pool.main[window_class(16), 1:16] = [80.0, 100.0]  # 0.8 a depth: about 4.9 tokens a chain-16 pass
    chooser._rates_checked = True
    assert chooser.prefers_ar() is True  # 4.9 / 6 s against AR's 1 / 1 s
    assert chooser.prefers_ar() is False  # the second such decode rechecks
    n, ran = 10, []
    for _ in range(40):
        shape = chooser.choose([n], [0], need=64, at=n)
        now[0] += 2.0 if shape == Shape(16) else 1.0 if shape.is_ar else 50.0
        chooser.record(shape, [(n, 0)], [n + (4 if shape == Shape(16) else 1)], None, synced=True)
        ran.append(shape)
    assert ran[0] == Shape(16) and set(ran) == {Shape(16)}
    assert chooser.cost(Shape(16), 10) == pytest.approx(2.0)  # the stale 6 s is gone
    assert not chooser.prefers_ar()  # the next decode runs the chooser


def test_a_decode_runs_the_chooser_only_where_a_shape_beats_ar_by_the_handover_margin(monkeypatch):
    """A shape 10% faster than AR at mid-image is not worth the chooser's own costs (its AR passes, ramps, measuring
    blocks): the decode goes to plain AR; 20% faster, the chooser runs."""
    chooser = _chooser(_costs(), settings=ChooserSettings(block=1, recheck=10**6))
    _teach(chooser, 0.5, passes=20, shape=Shape(2))
    for gain, handed in [(1.10, True), (1.20, False)]:
        assert 1.10 < 1 + HANDOVER_MARGIN < 1.20
        monkeypatch.setattr(chooser, "scores", lambda *a, gain=gain: {Shape(1): 1.0, Shape(2): gain})
        assert chooser.prefers_ar() is handed


def test_a_class_keeps_its_counts_while_others_run_and_is_explored_only_where_it_could_pay():
    """Counts decay only in the class that runs, so window 16's measurement survives 300 passes of window 4. Window 8,
    never measured, borrows window 4's poor rates (2 tokens a pass) and so is never chosen; but it neighbours the
    best chain (window 16) and, with window 16's rates at its depths, would beat it (chains of 8 rows cost what AR
    does, 16 rows twice that), so a measuring block runs it: ``samples`` sample-passes after its settling passes.
    Window 32, the other neighbour, costs 8 AR passes: it could not pay even so. With wide chains 50x an AR pass,
    nothing is explored, at a measuring opportunity every pass."""
    costs = {"ar": 1.0, "chain:2": 1.0, "chain:4": 1.0, "chain:8": 1.0, "chain:16": 2.0}
    chooser = _chooser({label: [(0, costs.get(label, 8.0))] for label in _costs()},
                       settings=ChooserSettings(block=1, refresh=64, samples=16))
    _teach(chooser, 0.9, passes=40, shape=Shape(16))
    kept = chooser.pool.main[window_class(16)].copy()
    chooser.settings, chooser.pool.next_explore = ChooserSettings(block=1), 10**9  # 300 passes of window 4 only
    _teach(chooser, 0.5, passes=300, shape=Shape(4))
    assert np.array_equal(chooser.pool.main[window_class(16)], kept)
    assert chooser.pool.last[window_class(4)] > chooser.pool.last[window_class(16)] > 0
    chooser.settings, chooser.pool.next_explore, chooser.left = ChooserSettings(block=1, samples=16), 0, 0
    explored = chooser.choose([10, 10], [0, 1], need=64, at=10)
    assert explored == Shape(8) and chooser._exploring
    assert chooser.left == settle_passes(explored) + 8 - 1  # 16 sample-passes of 2 samples, this pass taken
    assert chooser.pool.next_explore == chooser.pool.passes + 2 * 64  # the schedule doubles, over decodes too
    costly = _chooser({label: [(0, 1.0 if label in ("ar", "chain:2") else 50.0)] for label in _costs()},
                      settings=ChooserSettings(block=1, refresh=1))
    _teach(costly, 0.5, passes=20, shape=Shape(2))
    for _ in range(50):  # a measuring opportunity every pass
        costly.pool.next_explore = 0
        shape = costly.choose([10, 10], [0, 1], need=64, at=10)
        assert shape == Shape(2) and not costly._exploring  # 1.5 tokens for an AR pass's cost: no 50x chain can pay
        costly.record(shape, [(10, 0), (10, 1)], [11, 11], None, synced=False)


def test_a_switch_is_scored_with_its_ramp_and_its_settling_passes_are_predicted_at_it():
    """A settling pass of a new window class commits ``1 + r (E - 1)`` tokens (``r``: the class's ramp share, from the
    prior until its settling passes are counted); a switch to another class is scored by the tokens per second at which
    it would finish the image (its settling passes at the ramp, the rest at its steady state), the current class at its
    steady state."""
    costs = {label: [(0, 1.0 if label in ("ar", "chain:16") else 10.0)] for label in _costs()}
    chooser = _chooser(costs, slots=1, settings=ChooserSettings(block=1, refresh=10**6))
    rates = chooser.pool.main[window_class(16)]
    rates[1:16] = [9.0, 10.0]  # window 16 measured at 0.9 a depth
    shape = chooser.choose([10], [0], need=64, at=10)
    assert shape == Shape(16) and chooser._settle == settle_passes(shape) - 1  # a switch: this pass settles
    steady = float(expected_tokens(shape, *chooser.rates(shape, [0]), np.array([16]))[0])
    assert chooser.predicted[-1][0] == pytest.approx(1 + PRIOR_RAMP * (steady - 1))
    chooser.record(shape, [(10, 0)], [11], None, synced=False)  # the settling pass committed one token
    assert chooser.pool.ramp[window_class(16)].tolist() == pytest.approx([0.0, steady - 1])
    share = SHRINK * PRIOR_RAMP / (steady - 1 + SHRINK)
    assert chooser.pool.ramp_shares()[window_class(16)] == pytest.approx(share)
    scores = {Shape(16): steady, Shape(8): 2.0}  # tokens per second at cost 1 (window 8: 10, so 0.2 tokens a pass)
    settle, ramp = settle_passes(Shape(16)), 1 + share * (steady - 1)
    left = 100.0
    passes = settle + (left - settle * ramp) / steady
    chooser.current = Shape(4)
    assert chooser._with_ramps(scores, 1, left, 10)[Shape(16)] == pytest.approx(left / passes)
    near_end = chooser._with_ramps(scores, 1, 2.0, 10)[Shape(16)]  # 2 tokens left: the ramp alone finishes them
    assert near_end == pytest.approx(ramp) and near_end < left / passes < steady
    chooser.current = Shape(16)
    ramped = chooser._with_ramps(scores, 1, left, 10)
    assert ramped[Shape(16)] == steady and ramped[Shape(8)] < scores[Shape(8)]  # staying in the class costs no ramp


def test_rates_count_committed_paths_only():
    """A chain pass that commits 3 tokens (e = 2): depths 1, 2 accepted, depth 3 rejected; nothing past it counts. A
    tree pass whose path took rank 2 at depth 1: the main draft and rank 1 rejected there, rank 2 accepted, and the
    main drafts below a side node do not count."""
    chooser = _chooser(_costs(), slots=1, settings=ChooserSettings(block=1, shape_script=(Shape(8), Shape(8, 3, 2))))
    chooser.choose([1], [0], need=8, at=1)
    chooser.record(Shape(8), [(1, 0)], [4], None, synced=False)
    main = chooser.pool.main[window_class(8)]
    assert np.allclose(main[1:5], [[1, 1], [1, 1], [0, 1], [0, 0]])
    chooser.choose([4], [0], need=8, at=4)
    chooser.record(Shape(8, 3, 2), [(4, 0)], [6], [[2]], synced=False)  # e = 1 through rank 2
    main, kept = chooser.pool.main[window_class(8)], 0.995  # the first pass's counts have decayed once since
    assert np.allclose(main[1], [kept, kept + 1])  # this pass's main draft at depth 1 rejected
    assert chooser.pool.sibling[1].tolist() == pytest.approx([0, 1]) and chooser.pool.sibling[2].tolist() == pytest.approx([1, 1])
    assert np.allclose(main[2], [kept, kept])  # depth 2 lay below a side node: only the first pass's test
    hits, expected = chooser.sample_hits[0]
    assert hits == pytest.approx(2 * SAMPLE_DECAY) and expected > 0  # its own accepted tests (decayed once since)


def test_auto_decodes_report_shapes_and_their_prediction(model):
    stats = WindowStats(starting_costs=_costs(chain_2=1.1, chain_4=1.2, tree_4=1.25, chain_8=1.4, tree_8=1.5,
                                               chain_16=1.8, tree_16=1.9))
    out = _run(model, "auto", labels=LABELS * 2, seeds=range(10), window_stats=stats)
    passes = int(out.stats.nfe.max()) - 1
    assert sum(out.stats.shapes.values()) == sum(out.stats.windows.values()) == passes
    assert out.stats.commits.sum(1).tolist() == (out.stats.nfe - 1).tolist()
    assert out.method == "auto" and bool((out.tokens >= 0).all()) and bool((out.tokens < 8).all())
    assert out.stats.chooser["calibrated"] is False and out.stats.chooser["predicted_speedup"] > 0


@pytest.mark.parametrize("spec", ["auto", "auto-gumbel"])
def test_scripted_shapes_switch_every_pass_and_keep_outputs_independent_of_the_batch(model, spec):
    """Forced to change shape every pass (AR, chains, trees of both widths), every sample still gets the tokens it
    gets alone: the shapes depend on the script, the noise on the sample."""
    script = (Shape(4, 2, 2), Shape(1), Shape(8, 2, 3), Shape(2), Shape(16, 3, 3), Shape(4, 3, 2), Shape(8))
    runs = {}
    for labels, seeds in [(LABELS, range(5)), ([LABELS[3]], [3])]:
        stats = WindowStats(starting_costs=_costs(), settings=ChooserSettings(block=1, shape_script=script))
        runs[len(labels)] = _run(model, spec, labels=labels, seeds=seeds, window_stats=stats)
    batch, alone = runs[5], runs[1]
    assert len(batch.stats.shapes) >= 5
    assert torch.equal(alone.tokens[0], batch.tokens[3])


def test_tree_width_above_the_vocabulary_is_refused_before_the_prefill(model, monkeypatch):
    def no_prefill(*args, **kwargs):
        raise AssertionError("prefill ran before the check")

    monkeypatch.setattr(model, "prefill", no_prefill)
    with pytest.raises(ValueError, match="tree_width=9 exceeds the model's 8 image tokens"):
        _run(model, "sjd-pac:window=64,tree_width=9,tree_depth=2")


def test_the_cost_curve_is_measured_once_and_kept_on_disk(tmp_path, monkeypatch, capsys):
    """The first auto decodes on a machine calibrate (announced on stderr) and write the curve; once every shape is
    measured, a decode with fresh measurements (a new process) loads it instead of measuring again."""
    monkeypatch.setenv("VISPEC_CACHE_DIR", str(tmp_path))
    model = tiny_gpt(vocab_size=8, block_size=64, num_classes=3)
    calibrated = []
    for _ in range(8):  # 12 shapes of 7 to 15 passes each: a 64-token decode measures some of them
        out = decode(model, LlamaGenCondition(class_labels=torch.tensor(LABELS)), num_tokens=64, sampling=SAMPLING,
                     decoding="auto", generator=[torch.Generator().manual_seed(s) for s in range(5)],
                     window_stats=WindowStats())
        calibrated.append(out.stats.chooser["calibrated"])
    first_loaded = calibrated.index(False)
    assert calibrated[0] is True and first_loaded <= 6 and not any(calibrated[first_loaded:])
    assert "measuring this machine's step costs" in capsys.readouterr().err
    files = os.listdir(tmp_path / "step-costs")
    assert len(files) == 1 and files[0].endswith(".json")


def test_the_pooled_rates_are_kept_on_disk_per_weights_and_sampling(tmp_path, monkeypatch):
    """A new process (a fresh WindowStats) starts from the rates earlier decodes with the same weights and sampling
    counted, not from the prior; other weights or sampling start empty; an unreadable file starts empty (and is
    written again); ``VISPEC_CACHE_DIR=off`` keeps nothing."""
    monkeypatch.setenv("VISPEC_CACHE_DIR", str(tmp_path))
    model = tiny_gpt(vocab_size=8, block_size=64, num_classes=3)

    def run(stats):
        decode(model, LlamaGenCondition(class_labels=torch.tensor(LABELS)), num_tokens=64, sampling=SAMPLING,
               decoding="auto", generator=[torch.Generator().manual_seed(s) for s in range(5)], window_stats=stats)
        ((spec, rates),) = stats.shape_rates.items()
        return spec, rates

    spec, first = run(WindowStats())
    assert first.counted > 0 and first.home is not None and os.path.isfile(first.home)
    _, second = run(WindowStats())
    assert second.home == first.home and second.counted > first.counted  # it went on from the first's counts
    kept = ShapeRates.from_json(json.load(open(first.home))["rates"])
    assert kept.counted == second.counted and np.array_equal(kept.main, np.round(second.main, 6))
    other = tiny_gpt(vocab_size=8, block_size=64, num_classes=3, seed=1)
    assert load_shape_rates(WindowStats(), other, spec) not in (None, first.home)
    fresh = WindowStats()
    assert load_shape_rates(fresh, model, "another spec") != first.home and fresh.shape_rates["another spec"].counted == 0
    with open(first.home, "w") as handle:
        handle.write("{not json")
    _, again = run(WindowStats())
    assert 0 < again.counted < second.counted
    assert ShapeRates.from_json(json.load(open(first.home))["rates"]).counted == again.counted
    monkeypatch.setenv("VISPEC_CACHE_DIR", "off")
    assert load_shape_rates(WindowStats(), model, spec) is None


def test_calibration_runs_every_shape_once_before_timing_any_and_times_ar_without_read_backs():
    """The first decode on a machine runs one untimed pass of each cost label (compiling it), then a timed block of
    each, AR's (every shape's yardstick) AR_BLOCKS times as long; an AR block reads back once, at its end (a read-back
    per pass would make AR look dearer than it runs); a
    pass's cost is the clock from one read-back to the next, so the estimates are the passes' own."""
    now = [0.0]
    stats = WindowStats(clock=lambda: now[0])
    chooser = ShapeChooser(candidate_shapes(64, 3, 3, every_tree=True), stats, "k", "spec", slots=1, num_tokens=4096)
    labels = [s.cost_label for s in calibration_shapes(chooser.shapes)]
    seen, synced_passes, n = [], [], 0
    while chooser.calibrating:
        shape = chooser.choose([n], [0], 64, n)
        synced = not shape.is_ar or chooser.must_sync()
        now[0] += 0.001 * shape.rows * (1 + 3 * shape.is_tree)  # the pass's seconds on this clock
        chooser.record(shape, [(n, 0)], [n + 1], None, synced)
        seen.append(shape.cost_label)
        synced_passes.append(synced)
        n += 1
    assert seen[: len(labels)] == labels and sorted(set(seen)) == sorted(labels)
    timed_ar = [i for i in range(len(labels), len(seen)) if seen[i] == "ar"]
    assert len(timed_ar) == CALIBRATION_BLOCK * AR_BLOCKS and sum(synced_passes[i] for i in timed_ar) == 1
    assert chooser.cost(Shape(1), 0) == pytest.approx(0.001)
    assert chooser.cost(Shape(64), 0) == pytest.approx(0.064)
    assert chooser.cost(Shape(16, 3, 3), 0) == pytest.approx(0.064)


def test_a_pool_without_rates_measures_every_chain_and_tree_before_choosing():
    """Costs from disk, no rates (new weights or sampling): judged by the prior a wide chain never beats a cheap AR
    step (and AR passes measure nothing), so the decode's first blocks run every non-AR shape for ``samples``
    sample-passes after its settling passes, counting their acceptance; AR is not re-timed. A pool with rates
    skips them."""
    costs = {label: [(0, 1.0 if label == "ar" else 2.5)] for label in _costs()}
    chooser = _chooser(costs, slots=1, settings=ChooserSettings(block=1, samples=16))
    n, ran = 10, []  # every pass starts at token 10 of 256: always room for the widest window
    while len(ran) < 2000:
        shape = chooser.choose([n], [0], need=64, at=n)
        if not chooser._calibrating_block:  # chosen by score: the calibration is over
            break
        chooser.record(shape, [(n, 0)], [n + 2 if shape.rows > 1 else n + 1], None, synced=True)
        ran.append(shape)
    expected = [s for s in calibration_shapes(chooser.shapes) if not s.is_ar]
    assert sorted(set(ran)) == expected
    for shape in expected:
        assert ran.count(shape) in (16, settle_passes(shape) + 16)  # settling only after another window class
        assert chooser.pool.main[window_class(shape.rows), :, 1].sum() > 0
    measured = _chooser(costs, slots=1, settings=ChooserSettings(block=1, samples=16))
    measured.pool.main[window_class(2), 1] = [1.0, 2.0]
    measured.choose([0], [0], need=64, at=0)
    assert not measured.calibrating


def test_shapes_a_process_has_not_compiled_run_one_untimed_uncounted_pass_each_first():
    """With the cost curve from disk (no calibration here), the shapes ``warm_first`` names run one pass each before
    any chosen pass: each reads back (its compile stays out of the next pass's time) and adds no cost sample and no
    rate count; then the chooser picks as before."""
    now = [0.0]
    stats = WindowStats(starting_costs=_costs(), clock=lambda: now[0], settings=ChooserSettings(block=1))
    chooser = ShapeChooser(candidate_shapes(64, 3, 3, every_tree=True), stats, "k", "spec", slots=1, num_tokens=4096)
    assert not chooser.calibrating
    cold = [Shape(16), Shape(1), Shape(64, 3, 3)]
    chooser.warm_first(cold + [Shape(16)])
    seen, n = [], 0
    for _ in range(len(cold)):
        shape = chooser.choose([n], [0], 64, n)
        assert chooser.must_sync() or not shape.is_ar
        now[0] += 30.0  # a compile
        chooser.record(shape, [(n, 0)], [n + 2 if shape.rows > 1 else n + 1], None, synced=True)
        seen.append(shape)
        n += 2
    assert seen == cold and not chooser.warming
    assert chooser.pool.counted == 0 and chooser.pool.main[..., 1].sum() == 0
    assert all(len(stats.costs("k")[s.cost_label]) == 1 for s in cold)  # the starting sample only: no 30 s pass
    chooser.choose([n], [0], 64, n)
    assert not chooser._warming  # then chosen by score, as usual


@pytest.mark.parametrize("spec, words", [
    ("sjd-pac:tree_width=2,tree_depth=1000000", "tree_depth must be an integer in [1, 64]"),
    ("sjd-pac:tree_width=2,tree_depth=20000", "tree_depth must be an integer in [1, 64]"),
    ("mc-sjd:window=1000000000", "window must be an integer in [1, 4096]"),
    ("sjd-pac:window=1000000000", "window must be an integer in [1, 4096]"),
    ("sjd-pac:tree_width=100000", "tree_width must be an integer in [1, 4096]"),
])
def test_sizes_are_bounded_when_the_spec_is_parsed(spec, words):
    """Issue 47 items 1-2: a tree or window past any image is refused at once, naming the key (it ran for minutes, or
    reached the model and asked for terabytes)."""
    with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("]", r"\]")):
        DecodingConfig.parse(spec)
    with pytest.raises(ValueError, match="about 5001 digits"):
        DecodingConfig(strategy="sjd-pac", tree_depth=10**5000)


def test_shapes_a_pinned_curve_prices_at_infinity_are_neither_warmed_nor_measured():
    """A pinned curve (``--cost-curve FILE``) prices the labels it lacks at infinity: such shapes are never chosen, so
    a compiled decode must not compile them (``may_run`` filters ``warm_first``'s list) and the first decode's
    acceptance measurement skips them; priced shapes and shapes still to be calibrated may run."""
    from vispec.eval.bench.roofline import PinnedStats

    stats = PinnedStats(starting_costs={"ar": [(0, 1.0)], "chain:16": [(0, 2.0)]}, fallback=((0, float("inf")),),
                        settings=ChooserSettings(block=1, samples=4))
    chooser = ShapeChooser(candidate_shapes(64, 3, 3, every_tree=True), stats, "k", "spec", slots=1, num_tokens=4096)
    runnable = [s for s in calibration_shapes(chooser.shapes) if chooser.may_run(s)]
    assert runnable == [Shape(1), Shape(16)]
    n, ran = 10, set()
    for _ in range(200):
        shape = chooser.choose([n], [0], need=64, at=n)
        chooser.record(shape, [(n, 0)], [n + 2 if shape.rows > 1 else n + 1], None, synced=True)
        ran.add(shape)
    assert ran <= {Shape(1), Shape(16)}
    calibrating = ShapeChooser(candidate_shapes(64, 3, 3, every_tree=True), WindowStats(), "k", "spec", slots=1,
                               num_tokens=4096)
    assert all(calibrating.may_run(s) for s in calibration_shapes(calibrating.shapes))  # no curve yet: all measured
