"""The static decode step: one read-back per speculative step, none per AR step, compiled steps that
match eager ones, continuous batching that matches one batch, and deferred NaN checks."""

from __future__ import annotations

import pytest
import torch

from vispec.decoding import decode
from vispec.decoding.windows import WindowChooser, window_set
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
                                          ({"decoding": "sd:window=auto"}, "window='auto' applies to sjd and mc-sjd")])
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


def _simulate(costs: dict[int, float], accepted, passes: int = 80) -> WindowChooser:
    """A chooser over ``passes`` passes whose step at window w takes ``costs[w]`` seconds and accepts
    ``accepted(w)`` drafts per sample (4 samples)."""
    clock = FakeClock()
    chooser = WindowChooser(16, "k", {"k": {}}, tokens={"k": {}}, clock=clock)
    chooser.refresh = 10_000
    for _ in range(passes):
        w = chooser.choose(16)
        clock.now += costs[w]
        chooser.record(w, [accepted(w)] * 4, [w] * 4)
    return chooser


def test_window_chooser_prefers_ar_when_speculation_does_not_pay():
    chooser = _simulate({1: 1.0, 2: 2.5, 4: 5.0, 8: 9.0, 16: 17.0}, lambda w: min(w - 1, 1))  # 2 tokens at 2.5x the cost
    assert chooser.history[-5:] == [1] * 5
    assert chooser.expected_tokens(1) == 1.0 and chooser.expected_tokens(8) == 2.0
    assert set(chooser.history) == {1, 2, 4, 8, 16}  # each was measured before


def test_window_chooser_widens_when_drafts_are_accepted():
    chooser = _simulate({1: 1.0, 2: 1.1, 4: 1.2, 8: 1.4, 16: 2.0}, lambda w: w - 1)  # every draft accepted
    assert chooser.history[-5:] == [16] * 5
    assert window_set(16) == [1, 2, 4, 8, 16] and window_set(6) == [1, 2, 4, 6]


def test_window_chooser_picks_the_best_rate_in_between():
    # acceptance saturates at 3 drafts: 4 tokens per pass from W = 4 on, so W = 4 has the best rate
    chooser = _simulate({1: 1.0, 2: 1.2, 4: 1.5, 8: 2.5, 16: 4.0}, lambda w: min(w - 1, 3))
    assert chooser.history[-5:] == [4] * 5


def test_window_chooser_runs_blocks_and_caps_at_need():
    chooser = WindowChooser(8, "k", {"k": {}}, tokens={"k": {}})
    first = chooser.choose(3)
    assert first == 4  # the need rounded up to the set, tried first (largest first)
    chooser.record(first, [0], [3])
    assert chooser.choose(3) == 4  # a window runs a block of passes (its drafts mature)
    assert chooser.choose(1) == 1  # unless no sample can use it any more


@pytest.mark.slow
def test_compiled_steps_are_fullgraph_and_match_eager():
    """float64 weights: the compiled graph's rounding cannot flip a sampled token, so tokens are equal."""
    model = _model(torch.float64)
    for spec in ("ar", "mc-sjd-maximal:window=2"):
        eager = _run(model, spec, requests=3, num_tokens=8)
        compiled = _run(model, spec, requests=3, num_tokens=8, compile=True)  # fullgraph=True: a graph break raises
        assert torch.equal(eager.tokens, compiled.tokens), spec
        assert torch.equal(eager.stats.nfe, compiled.stats.nfe), spec
