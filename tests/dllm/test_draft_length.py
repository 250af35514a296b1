"""``speculative="auto"`` (vispec/dllm/draft_length.py): the draft length of every self-speculative round, chosen by
expected reference steps per second; the tokens stay the stepwise run's whatever it chooses."""

from __future__ import annotations

import pytest
import torch
from helpers import left_padded, tiny_llada, tiny_llada_prompts

from vispec.decoding.windows import WindowStats
from vispec.dllm import SelfSpeculation, decode, make_scheduler
from vispec.dllm.draft_length import EXPLORE, KEEP, DraftLengthChooser, model_costs, width_line
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
            for _ in range(1 + model_costs(model).settings.recheck)]
    handed = [out.labels["speculative"].get("stepwise", False) for out in runs]
    assert handed == [True] * (len(runs) - 1) + [False]  # the first times the stepwise steps; the last one rechecks
    for out in runs:
        assert torch.equal(out.tokens, ref.tokens)
    out = runs[0]
    assert out.stats.extra["steps"].tolist() == out.stats.extra["canvases"].tolist() == ref.stats.nfe.tolist()


def test_the_stepwise_steps_overrule_a_predicted_gain_over_k1_rounds():
    """The line compares draft lengths with k = 1 rounds, which cost more than the stepwise loop's steps: the best
    draft length must also beat the timed stepwise steps by the margin, else decodes run stepwise (every recheck-th
    speculating again); where it does, every recheck-th decode times the stepwise loop's steps again, the interval
    doubling."""
    stats, now = WindowStats(), [0.0]
    stats.clock = lambda: now[0]
    chooser = DraftLengthChooser(16, stats, key="k")
    _rounds(chooser, now, 40, rows=1, accept=0.97, seconds=lambda c: 1.0 + 0.001 * c)  # drafting predicted to pay
    assert chooser._best(1) != 0 and chooser.stepwise_cost(1) is None
    speed = chooser.best_speed(1)  # steps a second: about 12 (a round of 16 advances about 13 steps in ~1 s)
    assert 5 < speed < 20
    assert chooser.prefers_stepwise(1)  # no stepwise step timed: a stepwise decode runs, to time them
    for _ in range(3):
        chooser.record_step(1, 0.5 / speed)  # the stepwise loop runs twice the best draft length's steps a second
    assert chooser.stepwise_cost(1) == pytest.approx(0.5 / speed)
    recheck = stats.settings.recheck
    handed = [chooser.prefers_stepwise(1) for _ in range(recheck)]
    assert handed == [True] * (recheck - 1) + [False]  # drafting loses: stepwise, every recheck-th speculates
    for _ in range(3):
        chooser.record_step(1, 2.0 / speed)  # now at half its speed: drafting pays
    probes = [chooser.prefers_stepwise(1) for _ in range(recheck)]
    assert probes == [False] * (recheck - 1) + [True]  # speculate, every recheck-th times the stepwise loop again
    probes = [chooser.prefers_stepwise(1) for _ in range(2 * recheck)]
    assert probes == [False] * (2 * recheck - 1) + [True]  # the interval doubles after each probe
    chooser.record_step(1, 1.04 / speed)  # the median of nine: within the margin, drafting does not pay
    chooser.record_step(1, 1.04 / speed)
    chooser.record_step(1, 1.04 / speed)
    assert chooser.prefers_stepwise(1)
    for _ in range(KEEP):
        chooser.record_step(2, 1.0)
    assert len(stats.costs("k")["stepwise"]) == KEEP and chooser.stepwise_cost(1) == pytest.approx(0.5)  # scaled


def test_the_stepwise_cost_of_a_width_not_timed_comes_from_the_width_line():
    samples = [(1, 1.0), (1, 1.2), (1, 0.8), (2, 1.5), (3, 2.0), (4, 2.5), (4, 2.5), (5, 50.0)]
    line, floor = width_line(samples)
    assert line == pytest.approx((0.5, 0.5))  # width 5's outlier moves neither the slopes' median nor the intercept
    assert floor == pytest.approx(0.05 * 1.75)  # 5% of the median sample
    assert width_line([(3, 1.0), (3, 2.0)])[0] is None  # one width: no line
    chooser = DraftLengthChooser(16, WindowStats(), key="k")
    for rows, seconds in [(1, 1.0), (1, 1.0), (4, 2.5)]:
        chooser.record_step(rows, seconds)
    assert chooser.stepwise_cost(2) == pytest.approx(1.5)  # on the line through (1, 1.0) and (4, 2.5)


def test_a_confirmed_hand_over_rechecks_ever_less_often():
    stats, now = WindowStats(), [0.0]
    stats.clock = lambda: now[0]
    chooser = DraftLengthChooser(16, stats, key="k")
    _rounds(chooser, now, 12, rows=16, accept=0.3, seconds=lambda c: 0.01 * c)  # no draft length pays
    chooser.record_step(16, 0.05)  # the stepwise loop's steps (timed by a stepwise decode)
    recheck = stats.settings.recheck
    rechecks = [i for i in range(recheck * (1 + 2 + 4 + 8 + 8)) if not chooser.prefers_stepwise(16)]
    gaps = [b - a for a, b in zip([-1] + rechecks, rechecks)]
    assert gaps == [recheck, 2 * recheck, 4 * recheck, 8 * recheck, 8 * recheck]  # doubling, up to RECHECK_GROWTH


@pytest.mark.parametrize("cache", ["none", "dual"])
def test_a_handed_over_decode_times_its_steps_but_not_the_refreshes(cache):
    """A stepwise decode under ``"auto"`` records every step it takes (rows, seconds) for the chooser, except a block's
    refresh forward under a block cache: the rounds leave theirs out too (both sides pay it)."""
    model = tiny_llada()
    ids, mask = left_padded(tiny_llada_prompts(), 0)
    kwargs = dict(steps=24, gen_length=24, block_length=8, scheduler=make_scheduler("llada"), cache=cache)
    for decodes in range(1, 40):  # speculative until acceptance is measured (MIN_TRIES), then one times the steps
        steps = []
        out = decode(model, ids, mask, speculative="auto", callback=lambda p: steps.append(p.details), **kwargs)
        (key, costs), = model_costs(model).step_costs.items()
        if out.labels["speculative"].get("stepwise"):
            break
        assert "stepwise" not in costs and len(costs["round"]) > 0
    assert decodes > 1 and out.labels["speculative"]["stepwise"]
    timed = [d for d in steps if cache == "none" or d["step_in_block"] > 0]
    assert 0 < len(timed) < len(steps) or cache == "none"
    assert [rows for rows, _ in costs["stepwise"]] == [d["rows"].numel() for d in timed]
    assert all(seconds > 0 for _, seconds in costs["stepwise"])


def test_a_handed_over_block_causal_decode_times_all_but_each_blocks_first_step():
    """LLaDA2's layout under the prefix cache: a block's first forward also writes the previous block's K/V (the
    rounds' refresh), left out of the stepwise steps' times."""
    from test_llada2 import tiny_llada2

    model = tiny_llada2(4.0)
    ids = torch.randint(2, 99, (2, 6), generator=torch.Generator().manual_seed(0))
    kwargs = dict(gen_length=24, block_length=8, steps=12, scheduler=make_scheduler("llada"), cache="prefix")
    for _ in range(40):  # speculative until acceptance is measured (MIN_TRIES), then one times the steps
        steps = []
        out = decode(model, ids, None, speculative="auto", callback=lambda p: steps.append(p.details), **kwargs)
        if out.labels["speculative"].get("stepwise"):
            break
    assert out.labels["speculative"]["stepwise"]
    (key, costs), = model_costs(model).step_costs.items()
    later = [b for a, b in zip([None] + steps, steps) if a is not None and a["block"] == b["block"]]  # not firsts
    assert [rows for rows, _ in costs["stepwise"]] == [d["rows"].numel() for d in later]
    assert 0 < len(later) < len(steps)


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
