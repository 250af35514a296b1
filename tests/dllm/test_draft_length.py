"""``speculative="auto"`` (vispec/dllm/draft_length.py): the draft length of every self-speculative round, chosen by
expected reference steps per second; the tokens stay the stepwise run's whatever it chooses."""

from __future__ import annotations

import pytest
import torch
from helpers import left_padded, tiny_llada, tiny_llada_prompts

from vispec.decoding.windows import WindowStats
from vispec.dllm import SelfSpeculation, decode, make_scheduler
from vispec.dllm.draft_length import DECODES_KEPT, EXPLORE, DraftLengthChooser, model_costs
from vispec.eval.bench.text import parse_rule, parse_setting


def _rounds(chooser: DraftLengthChooser, now: list, rounds: int, rows: int, accept: float, seconds) -> list[int]:
    """Drive the chooser: each round verifies a share ``accept`` of every depth's drafts (deterministically: the
    chain verifies ``floor`` of its expected run), taking ``seconds(canvases)`` on the clock."""
    chosen = []
    for _ in range(rounds):
        k = chooser.choose(rows)
        chosen.append(k)
        run = 0
        while run < k - 1 and accept ** (run + 1) >= 0.5:  # the median chain of a geometric acceptance
            run += 1
        now[0] += seconds(rows * k)
        chooser.record(rows * k, torch.full((rows,), run), torch.full((rows,), k - 1))
    return chosen


@pytest.mark.parametrize("accept, seconds, best", [
    (0.97, lambda canvases: 1.0 + 0.001 * canvases, 16),  # a wide forward costs what a narrow one does: the largest
    (0.3, lambda canvases: 0.01 * canvases, 1),  # cost grows with the canvases and drafts fail: the stepwise step
])
def test_the_choice_follows_acceptance_and_cost(accept, seconds, best):
    now = [0.0]
    chooser = DraftLengthChooser(16, WindowStats(clock=lambda: now[0]))
    chosen = _rounds(chooser, now, 40, rows=2, accept=accept, seconds=seconds)
    assert chosen[: len(EXPLORE)] == sorted(EXPLORE)  # narrow exploration first (the cost line)
    steady = [k for i, k in enumerate(chosen[10:], start=10) if i not in (16, 32)]  # without those trying a larger k
    assert max(set(steady), key=steady.count) == best
    assert sum(chooser.chosen.values()) == 40


def test_rates_are_counted_from_verified_chains_and_smoothed_down_the_depths():
    chooser = DraftLengthChooser(8)
    chooser.record(0, torch.tensor([2, 0, 7]), torch.tensor([3, 3, 7]))  # verified 2 of 3, 0 of 3, 7 of 7
    hits, tries = chooser.counts[1:, 0], chooser.counts[1:, 1]
    assert hits.tolist()[:4] == [2, 2, 1, 1] and tries.tolist()[:4] == [3, 2, 2, 1]
    rates = chooser.rates()
    assert rates[1] == pytest.approx((2 + 4 * 0.5) / (3 + 4)) and 0 < rates[8] < 1


def test_a_second_decode_starts_from_the_kept_cost_line():
    stats, now = WindowStats(), [0.0]
    stats.clock = lambda: now[0]
    first = DraftLengthChooser(16, stats, key="k")
    _rounds(first, now, 6, rows=1, accept=0.9, seconds=lambda c: 1.0 + c)
    assert DraftLengthChooser(16, stats, key="k").explore == []


def test_a_models_decodes_share_the_cost_line_and_pool_acceptance_by_policy():
    """A decode is a few rounds: its successor starts from the kept cost line (no exploration) and from the pooled
    acceptance of the same policy and settings; another policy counts apart."""
    model = tiny_llada()
    assert model_costs(model) is model_costs(model) and model_costs(tiny_llada()) is not model_costs(model)
    stats, now = model_costs(model), [0.0]
    stats.clock = lambda: now[0]
    first = DraftLengthChooser(16, stats, key="k", rates_key="llada")
    _rounds(first, now, 12, rows=1, accept=0.9, seconds=lambda c: 1.0 + c)
    second = DraftLengthChooser(16, stats, key="k", rates_key="llada")
    assert second.explore == [] and second.counts is first.counts and second.counts[1, 1] > 0
    assert DraftLengthChooser(16, stats, key="k", rates_key="threshold").counts[1:].sum() == 0
    assert DraftLengthChooser(16, stats, key="k").counts[1:].sum() == 0  # no key: this decode's own counts


def test_auto_hands_a_decode_to_the_stepwise_loop_when_no_draft_pays_and_rechecks():
    """Where the kept line says every canvas costs in proportion and drafts rarely verify, a whole decode runs as the
    stepwise loop (its steps are cheaper than k = 1 rounds), with the stepwise tokens; every recheck-th such decode
    runs the chooser again."""
    model = tiny_llada()
    ids, mask = left_padded(tiny_llada_prompts(), 0)
    kwargs = dict(steps=24, gen_length=24, block_length=8, temperature=0.8, early_stop_eos=True)
    gens = lambda: [torch.Generator().manual_seed(10 + i) for i in range(3)]  # noqa: E731
    ref = decode(model, ids, mask, scheduler=make_scheduler("llada"), generator=gens(), **kwargs)
    first = decode(model, ids, mask, scheduler=make_scheduler("llada"), generator=gens(), speculative="auto", **kwargs)
    assert "stepwise" not in first.labels["speculative"]  # nothing measured yet: the chooser runs
    (key, costs), = model_costs(model).step_costs.items()
    costs["round"][:] = [(c, 0.01 * c) for c in (3, 6, 12, 24) for _ in range(4)]  # canvases cost in proportion
    (rates,) = model_costs(model).shape_rates.values()
    rates[1:] = [[1, 100]] * (len(rates) - 1)  # drafts verify 1% of the time
    runs = [decode(model, ids, mask, scheduler=make_scheduler("llada"), generator=gens(), speculative="auto", **kwargs)
            for _ in range(model_costs(model).settings.recheck)]
    handed = [out.labels["speculative"].get("stepwise", False) for out in runs]
    assert handed == [True] * (len(runs) - 1) + [False]  # the last one rechecks
    for out in runs:
        assert torch.equal(out.tokens, ref.tokens)
    out = runs[0]
    assert out.stats.extra["steps"].tolist() == out.stats.extra["canvases"].tolist() == ref.stats.nfe.tolist()


def test_measured_decodes_overrule_a_predicted_gain_that_the_stepwise_loop_beats():
    """The line compares draft lengths with k = 1 rounds, which cost more than the stepwise loop's steps: a predicted
    gain must also show in whole decodes' seconds per step against recent stepwise decodes, else decodes run
    stepwise (every recheck-th speculating again); where it shows, every recheck-th decode probes the stepwise loop."""
    stats, now = WindowStats(), [0.0]
    stats.clock = lambda: now[0]
    chooser = DraftLengthChooser(16, stats, key="k")
    _rounds(chooser, now, 12, rows=1, accept=0.97, seconds=lambda c: 1.0 + 0.001 * c)  # drafting predicted to pay
    assert chooser._best(1) != 0 and chooser.step_seconds(stepwise=False) is None
    assert chooser.prefers_stepwise(1)  # no stepwise decode measured: one runs, to measure the baseline
    chooser.record_decode(False, 3.0, 10)  # speculative decodes: 0.3 s a step, stepwise: 0.2 s
    chooser.record_decode(True, 2.0, 10)
    recheck = stats.settings.recheck
    handed = [chooser.prefers_stepwise(1) for _ in range(recheck)]
    assert handed == [True] * (recheck - 1) + [False]  # drafting lost: stepwise, every recheck-th speculates
    for _ in range(3):
        chooser.record_decode(False, 1.0, 10)  # now 0.1 s a step (median of the recent speculative decodes)
    assert chooser.step_seconds(stepwise=False) == pytest.approx(0.1)
    probes = [chooser.prefers_stepwise(1) for _ in range(recheck)]
    assert probes == [False] * (recheck - 1) + [True]  # drafting won: speculate, every recheck-th probes stepwise
    probes = [chooser.prefers_stepwise(1) for _ in range(2 * recheck)]
    assert probes == [False] * (2 * recheck - 1) + [True]  # the interval doubles after each probe
    for _ in range(DECODES_KEPT):  # only the recent decodes count: stepwise ones pushed out, measured again
        chooser.record_decode(False, 1.0, 10)
    assert chooser.step_seconds(stepwise=True) is None and chooser.prefers_stepwise(1)
    chooser.record_decode(True, 1.0, 0)  # a decode of no steps records nothing
    assert len(stats.costs("k")["decodes"]) == DECODES_KEPT


def test_a_confirmed_hand_over_rechecks_ever_less_often():
    stats, now = WindowStats(), [0.0]
    stats.clock = lambda: now[0]
    chooser = DraftLengthChooser(16, stats, key="k")
    _rounds(chooser, now, 12, rows=1, accept=0.3, seconds=lambda c: 0.01 * c)  # no draft length pays
    recheck = stats.settings.recheck
    rechecks = [i for i in range(recheck * (1 + 2 + 4 + 8 + 8)) if not chooser.prefers_stepwise(1)]
    gaps = [b - a for a, b in zip([-1] + rechecks, rechecks)]
    assert gaps == [recheck, 2 * recheck, 4 * recheck, 8 * recheck, 8 * recheck]  # doubling, up to RECHECK_GROWTH


def test_a_decode_records_its_seconds_per_step_and_mode():
    model = tiny_llada()
    ids, mask = left_padded(tiny_llada_prompts(), 0)
    kwargs = dict(steps=24, gen_length=24, block_length=8, scheduler=make_scheduler("llada"), speculative="auto")
    out = decode(model, ids, mask, **kwargs)
    (key, costs), = model_costs(model).step_costs.items()
    (mode, per_step), = costs["decodes"]
    assert mode == 0 and per_step > 0  # the first decode explores: speculative
    decode(model, ids, mask, **kwargs)
    assert len(costs["decodes"]) == 2 and out.stats.extra["steps"].max() > 0


@pytest.mark.parametrize("cache", ["none", "dual"])
@pytest.mark.parametrize("strategy,steps", [("llada", 24), ("threshold", None)])
def test_auto_equals_the_stepwise_run(cache, strategy, steps):
    model = tiny_llada()
    ids, mask = left_padded(tiny_llada_prompts(), 0)
    kwargs = dict(steps=steps, gen_length=24, block_length=8, temperature=0.8, cache=cache, guidance_scale=1.5,
                  early_stop_eos=True)
    gens = lambda: [torch.Generator().manual_seed(10 + i) for i in range(3)]  # noqa: E731
    ref = decode(model, ids, mask, scheduler=make_scheduler(strategy), generator=gens(), **kwargs)
    out = decode(model, ids, mask, scheduler=make_scheduler(strategy), generator=gens(), speculative="auto", **kwargs)
    assert torch.equal(out.tokens, ref.tokens)
    assert out.stats.extra["steps"].tolist() == ref.stats.nfe.tolist()
    rounds = out.labels["speculative"]["rounds_by_draft_length"]
    assert out.labels["speculative"]["draft_length"] == "auto" and sum(rounds.values()) >= 1
    assert set(rounds) <= set(range(1, 17))


def test_one_default_draft_length_and_errors_that_name_speculative():
    """Issue 47 items 12 and 26: a bare ``ssd`` (CLI, bench, lm-eval) and ``SelfSpeculation()`` mean the same k; a bad
    ``speculative=`` value is refused naming ``speculative``."""
    from vispec.dllm import UnmaskingOptions
    from vispec.eval.bench.text import TextBenchConfig

    assert TextBenchConfig().draft_length == SelfSpeculation().draft_length == 8
    for value in (0, -3, 10**9):
        with pytest.raises(ValueError, match="^speculative must be an integer in"):
            UnmaskingOptions(speculative=value)
    with pytest.raises(ValueError, match="speculative must be None, a draft length"):
        UnmaskingOptions(speculative="fast")
    assert UnmaskingOptions(speculative="auto").speculative == SelfSpeculation("auto")


def test_auto_in_the_spec_grammar_and_options():
    assert parse_rule("ssd=auto", "settings") == ("ssd", "auto")
    assert parse_setting("threshold+ssd=auto@dual") == ("threshold", ("ssd=auto",), "dual")
    assert SelfSpeculation("auto").auto and SelfSpeculation("auto", max_draft_length=32).max_draft_length == 32
    with pytest.raises(ValueError, match="or auto"):
        parse_rule("ssd=fast", "settings")
    with pytest.raises(ValueError, match="max_draft_length"):
        SelfSpeculation("auto", max_draft_length=0)
    with pytest.raises(ValueError, match="'auto'"):
        SelfSpeculation("fast")
