"""``vispec bench text`` counts speed as users expect: generated tokens only, per second, at several batch sizes; tokens
per forward; d3LLM's AUP per policy (with knob sweeps); and the batch-invariance check (each problem's text alone and
in a batch), which every greedy policy passes on the embedded model."""

from __future__ import annotations

import json
import math

import pytest

from vispec.cli import main
from vispec.eval.bench.text import TextBenchConfig, accuracy_under_parallelism, run_text_bench


def test_greedy_policies_are_batch_invariant_and_speed_is_generated_tokens():
    """Every greedy policy (the LLaDA reference, threshold, factor, entropy bound, contiguous; the dual cache) gives
    each problem the same text at batch 3 as alone; tokens/s is the problems' generated tokens over the pipeline
    calls' wall time; per-problem scores and AUP are reported."""
    cfg = TextBenchConfig(model="tiny-mdlm", settings=("threshold", "factor", "entropy", "contiguous", "threshold@dual"),
                          reference=True, tasks=("arithmetic",), num_problems=3, batch_sizes=(3,))
    result = run_text_bench(cfg, progress=lambda line: None, progress_bar=False)
    runs = result["runs"]
    batched = [r for r in runs if r["batch_size"] == 3]
    assert len(batched) == 6 and {r["strategy"] for r in batched} == {"llada", "threshold", "factor", "entropy",
                                                                      "contiguous"}
    for row in batched:
        assert row["batch_mismatches"] == [] and row["batch_invariant"] == 1.0, row
    for row in runs:
        assert row["tokens_per_s"] == pytest.approx(row["tokens"] * 3 / row["wall_s"])
        assert 0 < row["tokens"] <= 32 and row["tokens_per_forward"] == pytest.approx(row["tokens"] / row["nfe"])
        assert len(row["per_problem"]["strict_match"]) == 3
        assert row["strict_match"] == pytest.approx(sum(row["per_problem"]["strict_match"]) / 3)
    aup = {a["policy"]: a for a in result["aup"]}
    assert set(aup) == {"llada@none", "threshold+stop@none", "factor+stop@none", "entropy+stop@none",
                        "contiguous+stop@none", "threshold+stop@dual"}
    reference = next(r for r in runs if r["reference"] and r["batch_size"] == 1)
    assert aup["llada@none"]["aup"] == pytest.approx(reference["tokens_per_forward"] * 100 * reference["strict_match"])


def test_aup_is_d3llms_weighted_area():
    """AUP = rho_1 y_1 + trapezoids of y W(y) over TPF, W(y) = min(exp(-3 (1 - y / y_max)), 1), after dropping the
    points more than 5 below the least parallel one (d3LLM's definition)."""
    points = [(3.0, 74.0), (1.0, 80.0), (2.0, 78.0), (4.0, 76.0), (0.0, 90.0)]
    aup, used = accuracy_under_parallelism(points, y_max=82.0)
    w = lambda y: min(math.exp(-3 * (1 - y / 82.0)), 1.0)
    assert used == [(1.0, 80.0), (2.0, 78.0), (4.0, 76.0)]  # rho 0 and the point 6 below y_1 dropped
    assert aup == pytest.approx(1 * 80 + 0.5 * (2 - 1) * (78 * w(78) + 80 * w(80)) + 0.5 * (4 - 2) * (76 * w(76) + 78 * w(78)))
    flat, _ = accuracy_under_parallelism([(1.0, 50.0), (3.0, 50.0)], y_max=50.0)
    assert flat == pytest.approx(3 * 50.0)  # no accuracy lost: the area under the curve
    with pytest.raises(ValueError, match="y_max"):
        accuracy_under_parallelism(points, y_max=0.0)


def test_bench_text_knob_sweep_batch_sizes_and_tables(tmp_path, capsys):
    """``--thresholds`` runs the threshold rule at each τ (one AUP curve), ``--batch-sizes`` adds the batched runs;
    the tables show tok/s per batch size and AUP; bad sweep values are one-line errors."""
    path = tmp_path / "bench.json"
    assert main(["bench", "text", "--model", "tiny-mdlm", "--settings", "threshold", "--thresholds", "0.6,0.9",
                 "--tasks", "sort", "--num-problems", "2", "--batch-sizes", "2", "--json", str(path), "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "tok/s B=2" in out and "AUP" in out and "threshold:tau=0.6+stop@none" in out
    result = json.loads(path.read_text())
    swept = [(r["knob_value"], r["batch_size"]) for r in result["runs"] if r["strategy"] == "threshold"]
    assert swept == [(0.6, 1), (0.6, 2), (0.9, 1), (0.9, 2)]
    curve = next(a for a in result["aup"] if a["policy"] == "threshold+stop@none")
    assert sorted(p[2] for p in curve["points"]) == [0.6, 0.9] and curve["knob"] == "tau"
    assert main(["bench", "text", "--model", "tiny-mdlm", "--thresholds", "0.5,1.5"]) == 2
    assert "threshold must be" in capsys.readouterr().err
    assert main(["bench", "text", "--model", "tiny-mdlm", "--settings", "threshold", "--factors", "1,2"]) == 2
    assert "factors sweeps the knob of factor, which no setting runs" in capsys.readouterr().err
