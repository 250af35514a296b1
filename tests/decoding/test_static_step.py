"""The static decode step: one read-back per speculative step, none per AR step, compiled steps that
match eager ones, continuous batching that matches one batch, and deferred NaN checks."""

from __future__ import annotations

import statistics
from typing import Optional

import pytest
import torch

from vispec.decoding import DecodingConfig, decode, decode_ar
from vispec.decoding.shapes import Shape, candidate_shapes
from vispec.decoding.windows import ChooserSettings, WindowChooser, WindowStats, cost_key, predict_cost, window_set
from vispec.models.llamagen_gpt import LlamaGenCondition
from vispec.profiling import HostSyncCounter
from vispec.sampling import SamplingConfig

from helpers import tiny_gpt

SAMPLING = SamplingConfig(temperature=0.9, top_k=12, guidance_scale=2.0)


def _model(dtype=torch.float32):
    return tiny_gpt(vocab_size=16, block_size=16, num_classes=3, dim=32, std=0.3).to(dtype)


def _run(model, spec: str, requests: int = 5, num_tokens: int = 16, **kwargs):
    condition = LlamaGenCondition(class_labels=torch.arange(requests) % 3)
    gens = [torch.Generator().manual_seed(100 + i) for i in range(requests)]
    drafter = tiny_gpt(vocab_size=16, block_size=16, num_classes=3, dim=16, n_layer=1, seed=3) if spec.startswith("sd") else None
    return decode(model, condition, num_tokens=num_tokens, sampling=SAMPLING, decoding=spec, generator=gens, grid_width=4,
                  drafter=drafter, **kwargs)


@pytest.mark.parametrize("spec", ["sjd-random:window=4", "mc-sjd-maximal:window=6", "mc-sjd-gumbel", "sd:window=3"])
def test_one_read_back_per_speculative_step(spec):
    model = _model()
    with HostSyncCounter() as syncs:
        out = _run(model, spec)
    steps = sum(out.stats.windows.values()) if out.stats.windows else int(out.stats.nfe.max()) - 1
    per_step = syncs.by_name["tolist"]
    print(f"\n{spec}: {syncs.total} host syncs over {steps} steps: {dict(syncs.by_name)}")
    if spec.startswith("sd"):  # the drafter rounds are ragged and eager; the target's verification is one read-back
        assert per_step == int(out.stats.nfe.max()) - 1 or per_step > 0
        return
    assert per_step == steps  # the committed counts, once per step
    # before the loop: validating the condition and one seed per request; after it: collecting the outputs
    assert syncs.total - per_step <= 8 + 5


def test_ar_steps_read_nothing_back():
    model = _model()
    counts = []
    for num_tokens in (8, 16):
        with HostSyncCounter() as syncs:
            _run(model, "ar", num_tokens=num_tokens)
        counts.append(syncs.total)
    assert counts[0] == counts[1], f"host syncs grow with the number of AR steps: {counts}"


def test_sync_counter_detects_a_read_back_in_the_step(monkeypatch):
    """Negative control: a step that reads a value back shows up in the count."""
    import vispec.decoding.sjd as sjd

    original = sjd.init_draft_tokens

    def reads_back(*args, **kwargs):
        out = original(*args, **kwargs)
        bool(out.any())
        return out

    monkeypatch.setattr(sjd, "init_draft_tokens", reads_back)
    with HostSyncCounter() as syncs:
        out = _run(_model(), "sjd-random:window=4")
    windows = out.stats.windows
    assert syncs.by_name["__bool__"] == sum(windows.values()) - windows.get(1, 0)  # one-row passes initialise nothing


@pytest.mark.parametrize("spec", ["ar", "sjd-vertical:window=4", "mc-sjd-maximal:window=5", "mc-sjd-gumbel:window=3", "sd:window=3"])
def test_continuous_batching_matches_one_batch(spec):
    model = _model()
    whole = _run(model, spec, requests=5)
    streamed = _run(model, spec, requests=5, max_batch_size=2)
    assert torch.equal(whole.tokens, streamed.tokens)
    assert torch.equal(whole.stats.nfe, streamed.stats.nfe)
    alone = _run(model, spec, requests=1)
    assert torch.equal(alone.tokens[0], whole.tokens[0])


def test_streamed_callback_reports_every_request():
    seen = []
    _run(_model(), "mc-sjd-maximal:window=4", requests=4, max_batch_size=2,
         callback=lambda progress: seen.append((progress.num_committed.clone(), progress.tokens.clone())))
    committed, tokens = seen[-1]
    assert committed.tolist() == [16] * 4 and bool((tokens >= 0).all())
    first_committed, first_tokens = seen[0]
    assert first_committed[2:].tolist() == [0, 0] and bool((first_tokens[2:] == -1).all())  # not started yet


def test_nan_logits_raise_at_the_step_read_back():
    model = _model()
    with torch.no_grad():
        model.output.weight[3, 0] = float("nan")
    for spec in ("ar", "mc-sjd-maximal:window=4"):
        with pytest.raises(ValueError, match="NaN"):
            _run(model, spec)


@pytest.mark.parametrize("kwargs,match", [({"compile": "yes"}, "compile must be True or False"),
                                          ({"max_batch_size": 0}, "max_batch_size"),
                                          ({"decoding": "sd:window=auto"}, "window='auto' applies to sjd, mc-sjd and sjd-pac")])
def test_bad_arguments_name_themselves(kwargs, match):
    model = _model()
    condition = LlamaGenCondition(class_labels=torch.arange(2))
    with pytest.raises(ValueError, match=match):
        decode(model, condition, num_tokens=8, **{"decoding": "sjd", **kwargs})


class FakeClock:
    """Step times that are exactly a table's costs."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _simulate(costs, accepted, passes: int = 80, refresh: int = 10**9) -> WindowChooser:
    """A chooser over ``passes`` passes whose step at window w takes ``costs(w, at)`` seconds (or ``costs[w]``)
    with ``at`` cached tokens and accepts ``accepted(w)`` drafts per sample (4 samples)."""
    clock = FakeClock()
    cost = costs if callable(costs) else (lambda w, at: costs[w])
    chooser = WindowChooser(16, WindowStats(settings=ChooserSettings(refresh=refresh)), "k", clock=clock)
    at = 0
    for _ in range(passes):
        w = chooser.choose(16, at, live=4)
        clock.now += cost(w, at)
        chooser.record(w, [accepted(w)] * 4, [w] * 4)
        at += accepted(w) + 1
    return chooser


def test_window_chooser_prefers_ar_when_speculation_does_not_pay():
    chooser = _simulate({1: 1.0, 2: 2.5, 4: 5.0, 8: 9.0, 16: 17.0}, lambda w: min(w - 1, 1))  # 2 tokens at 2.5x the cost
    assert chooser.history[-5:] == [1] * 5
    assert chooser.expected_tokens(1) == 1.0 and chooser.expected_tokens(2) == 2.0
    # exploration climbs from window 1 while a wider window could pay: window 2 accepted every draft, so
    # window 4 might have; it accepted no more, so window 8 cannot pay and is never run
    assert set(chooser.history) == {1, 2, 4} and chooser.history.count(2) == chooser.settings.settle + chooser.settings.block
    chooser = _simulate({1: 1.0, 2: 2.5, 4: 5.0, 8: 9.0, 16: 17.0}, lambda w: 0)  # no draft is ever accepted
    assert set(chooser.history) == {1, 2}  # one block of window 2 is all it costs


def test_window_chooser_widens_when_drafts_are_accepted():
    chooser = _simulate({1: 1.0, 2: 1.1, 4: 1.2, 8: 1.4, 16: 2.0}, lambda w: w - 1)  # every draft accepted
    assert chooser.history[-5:] == [16] * 5
    assert window_set(16) == [1, 2, 4, 8, 16] and window_set(6) == [1, 2, 4, 6]


def test_window_chooser_picks_the_best_rate_in_between():
    # acceptance saturates at 3 drafts: 4 tokens per pass from W = 4 on, so W = 4 has the best rate
    chooser = _simulate({1: 1.0, 2: 1.2, 4: 1.5, 8: 2.5, 16: 4.0}, lambda w: min(w - 1, 3))
    assert chooser.history[-5:] == [4] * 5
    assert 16 not in chooser.history  # window 8 was worse than 4: the climb stopped there


def test_window_chooser_climbs_only_where_a_wider_window_could_pay():
    """Drafts are accepted up to 5 per pass: window 8 commits 6 tokens and no sample accepts all its
    drafts, so window 16 cannot commit more; it is not tried although it would cost little more."""
    chooser = _simulate({1: 1.0, 2: 1.1, 4: 1.2, 8: 1.3, 16: 1.35}, lambda w: min(w - 1, 5))
    assert chooser.history[-5:] == [8] * 5 and 16 not in chooser.history


def test_window_chooser_needs_a_margin_over_ar():
    """A window whose rate is within the margin of AR's is not worth its risk: AR (window 1) stays."""
    chooser = _simulate({1: 1.0, 2: 1.99, 4: 4.0, 8: 8.0, 16: 16.0}, lambda w: 1)  # 2 tokens for 1.99x: +0.5%
    assert chooser.history[-5:] == [1] * 5


def test_window_chooser_compares_costs_at_the_same_cache_length():
    """Eager steps cost more as the cache grows, and windows are measured at different lengths: estimates
    are compared at the current length. Here window 2 commits 2 tokens at 1.6x AR's cost at any length,
    so it is the best, although window 1's raw times (measured early) are far below window 2's."""
    base = {1: 1.0, 2: 1.6, 4: 3.0, 8: 6.0, 16: 12.0}
    chooser = _simulate(lambda w, at: base[w] * (1 + at / 16), lambda w: min(w - 1, 1), passes=150)
    assert chooser.history[-5:] == [2] * 5
    # the cost model: a line once a window's samples span 32 tokens, a scaled median before
    assert predict_cost([(0, 1.0), (64, 5.0)], 32) == pytest.approx(3.0)
    assert predict_cost([(0, 1.0), (8, 3.0), (9, 9.0)], 100) == 3.0
    table = {1: [(L, 1 + L / 16) for L in range(4)], 2: [(L, 1.6 * (1 + L / 16)) for L in range(0, 64, 4)]}
    chooser = WindowChooser(2, WindowStats(step_costs={"k": table}), "k")
    assert chooser.cost(1, 48) == pytest.approx(4.0, rel=0.05)  # window 1 ran only at lengths 0-3


def test_window_chooser_re_measures_close_neighbours_less_and_less_often():
    chooser = _simulate({1: 1.0, 2: 1.6, 4: 3.0, 8: 6.0, 16: 12.0}, lambda w: min(w - 1, 1), passes=300,
                        refresh=20)  # window 2: 2 tokens for 1.6x, the best; window 1 is close
    assert chooser.history[-1] == 2
    starts = [i for i in range(1, len(chooser.history)) if chooser.history[i] == 1 and chooser.history[i - 1] != 1]
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    assert len(starts) >= 3 and gaps == sorted(gaps) and gaps[-1] > gaps[0]  # the interval doubles on each confirmation


def test_window_chooser_runs_blocks_and_caps_at_need():
    chooser = WindowChooser(8, WindowStats(), "k")
    first = chooser.choose(3)
    assert first == 1  # window 1 first: AR's cost is what wider windows must beat
    assert chooser.must_sync()  # its first step warms up and is left out of the costs: it ends with a read-back
    chooser.record(first, [0], [1])
    assert chooser.choose(3) == 1 and not chooser.must_sync()  # a window runs a block of passes
    for _ in range(chooser.settings.block - 2):
        chooser.record(1, [0], [1], synced=False)
        chooser.choose(3)
    assert chooser.must_sync()  # the block's last pass reads back: its run of passes is timed
    chooser.record(1, [0], [1])
    assert chooser.choose(3) == 2  # then the climb: the next wider window
    assert chooser.choose(1) == 1  # unless no sample can use it any more


def _decode_with_ramp(stats: WindowStats, num_tokens: Optional[int], passes: int = 400) -> WindowChooser:
    """One decode (4 samples) whose drafts need ``W // 2`` passes to mature after the window changes (those
    passes commit one token), then every draft is accepted; a step costs 1 at window 1, 3 at window 16.
    ``num_tokens``: the decode's length, given to the chooser (None: unbounded, as before the ramp was
    modelled)."""
    clock = FakeClock()
    chooser = WindowChooser(16, stats, "k", clock=clock)
    done, since_change, last = 0, 0, None
    while done < (num_tokens or passes * 16) and len(chooser.history) < passes:
        left = None if num_tokens is None else num_tokens - done
        w = chooser.choose(16 if left is None else min(16, left), done, live=4, remaining=left)
        since_change = since_change + 1 if w == last else 1
        last = w
        clock.now += {1: 1.0, 2: 1.1, 4: 1.3, 8: 1.8, 16: 3.0}[w]
        accepted = 0 if since_change <= w // 2 else min(w, left or w) - 1
        chooser.record(w, [accepted] * 4, [min(w, left or w)] * 4)
        done += accepted + 1
    return chooser


def test_window_chooser_charges_the_ramp_to_short_decodes():
    """Every draft is accepted once matured: window 16's steady rate (16 tokens per 3 s) is the best, but its
    first 8 passes commit one token each. A long decode pays that once and runs window 16. For 24 tokens
    window 16 would take 8 ramping passes and one more, 27 s (slower than AR's 24 s), while window 4 takes
    2 + 22 / 4 passes of 1.3 s: the short decode runs window 4."""
    stats = WindowStats()  # one model's measurements, shared by its decodes
    long = _decode_with_ramp(stats, None)
    assert long.history[-5:] == [16] * 5
    assert statistics.fmean(stats.ramp_tokens["k"][(8, 16)]) == 1.0  # measured after the climb from window 8
    assert long.expected_tokens(16) == 16.0
    short = _decode_with_ramp(stats, 24)
    assert short.history[0] == 4 and 16 not in short.history
    assert short.rate(16, 16, remaining=24) == pytest.approx(24 / 27)  # no ramp measured from no drafts: 1 per pass
    assert short.rate(16, 16) == pytest.approx(16 / 3)  # without a horizon: the steady rate


def test_window_chooser_times_only_passes_of_a_full_batch():
    """A batch that sheds finished samples runs cheaper passes near its end; tokens are counted per live
    sample, so timing those passes would flatter whichever window ran then."""
    clock = FakeClock()
    chooser = WindowChooser(4, WindowStats(), "k", clock=clock, slots=4)
    for live in (4, 4, 1, 1):
        w = chooser.choose(4, 0, live)
        clock.now += 1.0 if live == 4 else 0.25
        chooser.record(w, [0] * live, [1] * live)
    assert [t for _, t in chooser.costs[1]] == [1.0]  # the first pass warms up; the one-sample passes are left out


AUTO_SPEC = "mc-sjd-maximal:window=auto"


def _measured(model, costs: dict, tokens: dict, all_accepted: Optional[dict] = None,
              settings: ChooserSettings = ChooserSettings()) -> WindowStats:
    """Measurements of ``model`` as a 2-slot eager decode of :data:`AUTO_SPEC` would keep them."""
    return WindowStats(step_costs={cost_key(model, 2, False): costs}, tokens_per_pass={AUTO_SPEC: tokens},
                       all_accepted={AUTO_SPEC: all_accepted or {}}, settings=settings)


def test_auto_window_one_passes_read_nothing_back():
    """Where speculation does not pay, auto runs window 1 like AR: its passes read nothing back but the
    one ending each block (timed for the chooser)."""
    model = _model()
    stats = _measured(model, {1: [(0, 1.0)], 2: [(0, 100.0)]}, {2: [2.0]},
                      settings=ChooserSettings(block=8, recheck=1))  # recheck 1: the chooser runs (no AR handover)
    with HostSyncCounter() as syncs:
        out = _run(model, AUTO_SPEC, requests=2, num_tokens=16, window_stats=stats)
    assert out.stats.windows == {1: 15}
    assert syncs.by_name["tolist"] == 1 + 1  # the first block's end, and the pass where the samples finish (the
    # model is built outside the counter: building it read one value back, which this count used to include)


def test_auto_hands_whole_decodes_to_ar_where_no_window_pays(monkeypatch):
    """Measured: window 2 costs 100x window 1 and no sample ever accepted its draft. The decode runs as plain
    AR (the same tokens as ``"ar"``), except every ``recheck``-th such decode, which runs the chooser."""
    import vispec.decoding.sjd as sjd

    handed = []
    monkeypatch.setattr(sjd, "decode_ar", lambda *args: handed.append(1) or decode_ar(*args))
    model = _model()
    stats = _measured(model, {1: [(0, 1.0)], 2: [(0, 100.0)]}, {2: [1.0]}, {2: [0.0]}, settings=ChooserSettings(recheck=3))
    ar = _run(model, "ar", requests=2, num_tokens=16)
    runs = [_run(model, AUTO_SPEC, requests=2, num_tokens=16, window_stats=stats) for _ in range(3)]
    assert len(handed) == 2  # the third ran the chooser (which stayed at window 1: the same tokens, as the
    # one-row pass draws AR's noise)
    assert all(torch.equal(r.tokens, ar.tokens) for r in runs)
    assert runs[0].method == AUTO_SPEC and runs[0].stats.windows == {1: 15}
    assert stats.ar_handovers == {cost_key(model, 2, False): 0}  # counted in the caller's object, reset by the recheck
    fresh = _run(model, AUTO_SPEC, requests=2, num_tokens=16)  # no measurements given: this decode's own
    assert len(handed) == 2 and fresh.stats.windows != {1: 15}  # nothing measured yet: it explores wider windows


def test_window_measurements_belong_to_their_owner():
    """No decode writes process-wide state: measurements go to the WindowStats passed in, and a pipeline keeps
    one per transformer, so a new model never inherits another's timings."""
    from vispec.pipelines import LlamaGenPipeline

    model = _model()
    stats = WindowStats()
    _run(model, AUTO_SPEC, requests=2, num_tokens=16, window_stats=stats)
    assert list(stats.step_costs) == [cost_key(model, 2, False)] and list(stats.tokens_per_pass) == [AUTO_SPEC]
    pipe = LlamaGenPipeline.from_pretrained("vispec/tiny-c2i")
    first = pipe.window_stats()
    assert pipe.window_stats() is first
    pipe.transformer = pipe.drafter  # another model: its own measurements
    assert pipe.window_stats() is not first and not pipe.window_stats().step_costs


def _shape_stats(script: tuple, block: int = 1) -> WindowStats:
    """Shape-chooser measurements with flat costs, running ``script``'s shapes in turn (vispec.decoding.shapes)."""
    labels = {s.cost_label for s in candidate_shapes(64, 3, 3, every_tree=True)}
    return WindowStats(starting_costs={label: [(0, 1.0)] for label in labels},
                       settings=ChooserSettings(block=block, shape_script=script))


TREES_AND_CHAINS = (Shape(8, 2, 3), Shape(4), Shape(16, 3, 3), Shape(2), Shape(8, 3, 2))


@pytest.mark.parametrize("spec", ["sjd-pac:window=16", "auto"])
def test_one_read_back_per_tree_step(spec):
    """SJD-PAC's tree passes read back once: the committed counts, with the ranks the shape chooser counts in the
    same transfer."""
    model = _model()
    stats = _shape_stats(TREES_AND_CHAINS) if spec == "auto" else None
    with HostSyncCounter() as syncs:
        out = _run(model, spec, window_stats=stats)
    steps = sum(out.stats.windows.values())
    assert syncs.by_name["tolist"] == steps
    assert syncs.total - steps <= 8 + 5


def test_auto_ar_passes_read_nothing_back_but_at_block_ends():
    model = _model()
    with HostSyncCounter() as syncs:
        out = _run(model, "auto", requests=2, num_tokens=16, window_stats=_shape_stats((Shape(1),), block=8))
    assert out.stats.shapes == {"ar": 15}
    assert syncs.by_name["tolist"] == 1 + 1  # the first block's end (pass 8), and the pass where the samples finish


def test_auto_whole_decodes_go_to_ar_where_no_shape_pays(monkeypatch):
    """A measured pool of rejections and wide shapes 100x AR's cost: the decode runs as plain AR, tokens equal."""
    import vispec.decoding.pac as pac
    from vispec.decoding.shapes import ShapeRates

    handed = []
    monkeypatch.setattr(pac, "decode_ar", lambda *args: handed.append(1) or decode_ar(*args))
    model = _model()
    labels = {s.cost_label for s in candidate_shapes(64, 3, 3, every_tree=True)}
    stats = WindowStats(starting_costs={label: [(0, 1.0 if label == "ar" else 100.0)] for label in labels},
                        settings=ChooserSettings(recheck=10))
    rates = ShapeRates()
    rates.main[..., 1] = 50.0  # 50 tries at every depth of every window class, no hit
    config = DecodingConfig.parse("auto")
    stats.shape_rates[(config.coupling, config.init, repr(SAMPLING))] = rates
    out = _run(model, "auto", requests=2, num_tokens=16, window_stats=stats)
    assert handed == [1] and out.stats.shapes == {"ar": 15} and out.method == "auto"
    assert torch.equal(out.tokens, _run(model, "ar", requests=2, num_tokens=16).tokens)


@pytest.mark.slow
def test_compiled_steps_are_fullgraph_and_match_eager():
    """float64 weights: the compiled graph's rounding cannot flip a sampled token, so tokens are equal."""
    model = _model(torch.float64)
    for spec in ("ar", "mc-sjd-maximal:window=2", "auto"):
        script = (Shape(8, 2, 3), Shape(1), Shape(4), Shape(4, 3, 2))  # trees, a chain and AR, switching every pass
        stats = (lambda: _shape_stats(script)) if spec == "auto" else (lambda: None)
        eager = _run(model, spec, requests=3, num_tokens=8, window_stats=stats())
        compiled = _run(model, spec, requests=3, num_tokens=8, compile=True,  # fullgraph=True: a graph break raises
                        window_stats=stats())
        assert torch.equal(eager.tokens, compiled.tokens), spec
        assert torch.equal(eager.stats.nfe, compiled.stats.nfe), spec


@pytest.mark.slow
def test_a_compiled_fixed_window_pads_the_image_tail_instead_of_compiling_narrower_graphs():
    """The tail's narrower widths would each compile a graph the first time a decode needed them, a stall at any later
    call (vispec.decoding.sjd, Compiled): a compiled fixed window runs every pass at its width, with eager's tokens."""
    model = _model(torch.float64)
    eager = _run(model, "mc-sjd-maximal:window=8", requests=3)
    compiled = _run(model, "mc-sjd-maximal:window=8", requests=3, compile=True)
    assert min(eager.stats.windows) <= 4  # eagerly the tail runs windows the set's narrower graphs hold (precondition)
    assert set(compiled.stats.windows) == {8}
    assert torch.equal(eager.tokens, compiled.tokens)
    assert torch.equal(eager.stats.nfe, compiled.stats.nfe)


@pytest.mark.parametrize("kwargs,name", [({"block": 0}, "block"), ({"settle": -1}, "settle"), ({"margin": -0.1}, "margin"),
                                         ({"recheck": 1.5}, "recheck")])
def test_chooser_settings_are_checked(kwargs, name):
    with pytest.raises(ValueError, match=f"ChooserSettings.{name}"):
        ChooserSettings(**kwargs)
