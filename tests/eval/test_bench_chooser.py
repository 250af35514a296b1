"""The shape chooser's report in ``vispec bench decoders | image`` (shapes, predicted and measured speed-up, their
error) and ``--cost-curve measured | flat | PATH``: the curve the choosers see, pinned (vispec.eval.bench.roofline)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from vispec.cli import main
from vispec.decoding.shapes import Shape, ShapeChooser, candidate_shapes
from vispec.decoding.windows import WindowChooser, WindowStats, load_step_costs, relative_step_costs
from vispec.eval.bench import decoders, image, roofline
from vispec.eval.bench.configs import DecoderBenchConfig, ImageBenchConfig, read_cost_curve
from vispec.pipelines.embedded import resolve_model_path

GPT = ["--model", "GPT-mini", "--vocab-size", "64", "--num-classes", "4", "--image-tokens", "16", "--init-std", "0.5",
       "--window", "4", "--num-images", "1", "--threads", "1"]
TINY_C2I = ["--model", "tiny-c2i", "--image-tokens", "64", "--num-images", "2", "--threads", "1"]
DATA = "tests/data/llamagen"


def test_chooser_fields_sum_the_decodes_and_compare_with_the_measured_speedup():
    decodes = [({"chain 16": 6, "ar": 2}, {"predicted_speedup": 2.0, "calibrated": True}),
               ({"chain 16": 4, "tree 64 K3 D3": 8}, {"predicted_speedup": None, "calibrated": False}),
               ({"ar": 10}, {}),  # a decode handed to AR: no prediction
               ({"chain 16": 1}, {"predicted_speedup": 3.0, "calibrated": False})]
    fields = roofline.chooser_fields(decodes, 2.0)
    assert fields["shapes"] == {"ar": 12, "chain 16": 11, "tree 64 K3 D3": 8}  # most used first
    assert fields["predicted_speedup"] == 2.5 and fields["measured_speedup"] == 2.0
    assert fields["prediction_error"] == pytest.approx(0.25) and fields["chooser_calibrations"] == 1
    assert roofline.chooser_fields([({}, {}), ({}, {})], 1.0) == {}  # AR, SJD, MC-SJD: no shapes, no keys
    unknown = roofline.chooser_fields([({"ar": 3}, {})], float("nan"))
    assert unknown["predicted_speedup"] is None and unknown["measured_speedup"] is None and unknown["prediction_error"] is None
    assert roofline.shapes_text({"chain 16": 62, "tree 64 K3 D3": 30, "ar": 8}) == "chain 16 62%, tree 64 K3 D3 30%, ar 8%"
    assert roofline.shapes_text({"a": 4, "b": 3, "c": 2, "d": 1}) == "a 40%, b 30%, c 20%, ..."

    rows = [{"method": "ar", "batch_size": 1, "compile": False},
            {"method": "auto", "batch_size": 4, "compile": True, "tokens_per_forward": 3.2, "single_token_passes": 0.12,
             "roofline_fraction": 0.85, **fields}]
    table = roofline.format_chooser_table(rows, "measured")
    lines = table.splitlines()
    assert lines[0].startswith("shape chooser: cost curve measured on this machine") and len(lines) == 4
    cells = lines[3].split()
    assert cells[:9] == ["4", "auto", "compiled", "2.50", "2.00", "+25%", "3.20", "12.0%", "85%"]
    assert lines[3].endswith("[1 decode(s) calibrated the curve]") and "ar 39%, chain 16 35%" in lines[3]
    assert roofline.format_chooser_table(rows[:1], "measured") == ""
    assert "FLAT" in roofline.format_chooser_table(rows, "flat") and "relative to that curve" in roofline.format_chooser_table(rows, "flat")
    assert "from /gpu.json (--cost-curve" in roofline.format_chooser_table(rows, "/gpu.json")


def test_a_pinned_curve_is_what_the_choosers_see_and_nothing_changes_it():
    """``--cost-curve flat``: every shape label and window costs 1.0 under every cost key; no calibration, no cache
    read, no measurement added; a chooser with rates that grow with the window then runs the widest shape."""
    stats = roofline.chooser_stats("flat")
    assert roofline.chooser_stats("measured") is None
    labels = {s.cost_label for s in candidate_shapes(64, 3, 3, every_tree=True)}
    assert set(roofline.flat_costs()) == labels | {1, 2, 4, 8, 16, 32, 64}
    key = ("shapes", ("cpu", "torch.float32"), 1, False)
    chooser = ShapeChooser(candidate_shapes(64, 3, 3, every_tree=True), stats, key, "spec", slots=1, num_tokens=256)
    assert not chooser.calibrating and not chooser.calibrated
    assert not load_step_costs(stats, object(), key)
    assert chooser.cost(Shape(64), 100) == 1.0 and chooser.cost(Shape(1), 0) == 1.0
    assert chooser.cost(Shape(24), 5) == 1.0  # a window outside the set: flat too
    for c in range(chooser.pool.main.shape[0]):  # measured: wider windows accept more (Jacobi drafts refined longer),
        chooser.pool.main[c, 1:, :] = [70.0 + 4 * c, 100.0]  # 70% at window 1 ... 94% at window 64
    shape = chooser.choose([0], [0], need=255, at=0)
    assert shape.rows == 64, shape
    chooser.record(shape, [(0, 0)], [5], [[0, 0]], synced=True)
    chooser.record(chooser.choose([5], [0], need=250, at=5), [(5, 0)], [9], [[0, 0]], synced=True)
    assert {label: list(samples) for label, samples in stats.step_costs[key].items()} == roofline.flat_costs()
    assert chooser.predicted_speedup() > 1  # relative to the flat curve: the expected tokens per pass

    windows = WindowChooser(64, stats, key=("cpu", 1, False), slots=1)
    for _ in range(3):
        window = windows.choose(need=64)
        windows.record(window, [1], [window])
    assert windows.cost(64) == windows.cost(1) == 1.0 and len(stats.step_costs[("cpu", 1, False)][1]) == 1
    # the shape chooser's labels beside the windows: the relative costs still list the windows in order
    assert list(relative_step_costs(stats, ("cpu", 1, False), 0))[:7] == [1, 2, 4, 8, 16, 32, 64]
    mixed = WindowStats(step_costs={"k": {"chain:16": [(0, 2.0)], 16: [(0, 2.0)], 1: [(0, 1.0)], 2: [(0, 1.5)], "ar": [(0, 1.0)]}})
    assert list(relative_step_costs(mixed, "k", 0)) == [1, 2, 16, "ar", "chain:16"]


def test_a_cost_curve_file_is_read_as_the_cache_writes_it(tmp_path):
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps({"key": "('shapes', ('cuda:0', 'torch.bfloat16'), 8, True)",
                                "costs": {"ar": [[0, 0.01], [100, 0.012]], "chain:16": [[0, 0.011]], "tree:64": [[5, 0.02]]}}))
    costs = read_cost_curve(str(path))
    assert costs["ar"] == [(0, 0.01), (100, 0.012)] and costs["tree:64"] == [(5, 0.02)]
    assert costs[1] == costs["ar"] and costs[16] == costs["chain:16"] and 64 not in costs  # the window chooser's windows
    stats = roofline.chooser_stats(str(path))
    chooser = ShapeChooser(candidate_shapes(64, 3, 3, every_tree=True), stats, "key", "spec", slots=8, num_tokens=256)
    assert not chooser.calibrating  # a shape the file has no cost for is never chosen (an infinite cost), not measured
    assert chooser.cost(Shape(16), 0) == 0.011 and chooser.cost(Shape(32), 0) == float("inf")
    assert chooser.ar_yardstick(0) == pytest.approx(0.01)  # no ar-decoder label: the chooser's own AR pass
    path.write_text(json.dumps({"key": "k", "costs": {"ar": [[0, 0.01]], "ar-decoder": [[0, 0.008]]}}))
    timed = ShapeChooser(candidate_shapes(64, 3, 3, every_tree=True), roofline.chooser_stats(str(path)), "key", "spec",
                         slots=8, num_tokens=256)
    assert timed.has_ar_decoder and timed.ar_yardstick(0) == pytest.approx(0.008)  # a file recorded with the AR decoder's pass


@pytest.mark.parametrize("content, message", [
    (None, "cannot read it"),
    ("{not json", "is not valid JSON"),
    ('{"key": "k"}', 'has no "costs" object'),
    ('{"costs": {"ar": [[0, 1.0]], "chain:16": [[0, 1.0]], "warp:4": [[0, 1.0]]}}', "unknown cost label 'warp:4'"),
    ('{"costs": {"ar": [[0, 1.0]], "chain:1": [[0, 1.0]]}}', "unknown cost label 'chain:1'"),
    ('{"costs": {"ar": [[0, -1.0]]}}', "needs a non-empty list of [cached length >= 0, seconds > 0] pairs"),
    ('{"costs": {"ar": []}}', "needs a non-empty list"),
    ('{"costs": {"chain:16": [[0, 1.0]]}}', 'has no "ar" cost'),
])
def test_a_bad_cost_curve_fails_before_any_model_work_naming_the_flag(content, message, tmp_path, capsys, monkeypatch):
    path = tmp_path / "curve.json"
    if content is not None:
        path.write_text(content)
    for module, name in ((decoders, "build_model"), (decoders, "run_decoder_bench"), (image, "run_image_bench")):
        monkeypatch.setattr(module, name, lambda *args, **kwargs: pytest.fail("a model was built or a run started"))
    for bench in (["bench", "decoders", *GPT], ["bench", "image"]):
        capsys.readouterr()
        assert main([*bench, "--cost-curve", str(path)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("vispec: error: cost_curve (--cost-curve)"), err
        assert message in err[0] and str(path) in err[0]
    with pytest.raises(ValueError, match="--cost-curve"):
        DecoderBenchConfig(cost_curve="").validate()
    with pytest.raises(ValueError, match="--cost-curve"):
        ImageBenchConfig(cost_curve=str(path)).validate()


def test_bench_decoders_reports_the_chooser_in_json_and_table(tmp_path, capsys):
    """The default (measured) curve, a random GPT-mini: the auto row has the chooser's keys, AR's has none, and the
    table under the main one shows them."""
    path = tmp_path / "bench.json"
    assert main(["bench", "decoders", *GPT, "--methods", "ar,auto", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    result = json.loads(path.read_text())
    assert result["config"]["cost_curve"] == "measured"
    auto, ar = result["methods"]["auto"], result["methods"]["ar"]
    for key in ("shapes", "predicted_speedup", "measured_speedup", "prediction_error", "chooser_calibrations",
                "tokens_per_forward", "single_token_passes", "roofline_fraction"):
        assert key in auto, key
    assert "shapes" not in ar and "predicted_speedup" not in ar
    assert sum(auto["shapes"].values()) == sum(auto["windows_total"].values())  # every pass has a shape
    assert auto["measured_speedup"] == auto["speedup"]
    assert auto["chooser_calibrations"] == 0  # the warm-up measured the curve, untimed
    if auto["predicted_speedup"] is not None:
        assert auto["prediction_error"] == pytest.approx(auto["predicted_speedup"] / auto["speedup"] - 1)
    assert out.index("shape chooser: cost curve measured on this machine") < out.index("roofline:")
    line = next(line for line in out.splitlines() if line.split()[:3] == ["1", "auto", "eager"])
    assert "%" in line and next(iter(auto["shapes"])) in line


def test_bench_decoders_with_a_flat_curve_runs_wide_shapes(tmp_path, capsys):
    """``--cost-curve flat`` on the trained tiny-c2i: the chooser never calibrates, runs shapes wider than AR and the
    table says which curve it saw."""
    path = tmp_path / "flat.json"
    assert main(["bench", "decoders", *TINY_C2I, "--methods", "ar,auto", "--cost-curve", "flat", "--json", str(path)]) == 0
    captured = capsys.readouterr()
    assert "measuring this machine's step costs" not in captured.err
    assert "shape chooser: cost curve FLAT" in captured.out and "relative to that curve" in captured.out
    result = json.loads(path.read_text())
    auto = result["methods"]["auto"]
    assert result["config"]["cost_curve"] == "flat" and auto["chooser_calibrations"] == 0
    top = next(iter(auto["shapes"]))
    assert top != "ar" and int(top.split()[1]) >= 8, auto["shapes"]
    assert auto["predicted_speedup"] > 1  # flat: the expected tokens per pass
    assert result["roofline"]["curves"][0]["relative_cost"]["1"] == 1.0  # the roofline still measured its own curve


def test_bench_decoders_sweep_with_a_curve_file_runs_the_shape_it_makes_cheap(tmp_path, capsys):
    """A cost-curve file (as a GPU would record it) where the 64-row chain costs a tenth of every other shape: the batch
    sweep's auto row runs it most, the widest shape a 64-token image has room for."""
    curve = tmp_path / "gpu.json"
    costs = {label: [[0, 0.1 if label == "chain:64" else 1.0]] for label in roofline.flat_costs() if isinstance(label, str)}
    curve.write_text(json.dumps({"key": "recorded elsewhere", "costs": costs}))
    path = tmp_path / "sweep.json"
    assert main(["bench", "decoders", *TINY_C2I, "--num-images", "1", "--methods", "ar,auto", "--batch-sizes", "1",
                 "--rounds", "1", "--cost-curve", str(curve), "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"shape chooser: cost curve from {curve}" in out
    rows = {row["method"]: row for row in json.loads(path.read_text())["rows"]}
    auto = rows["auto"]
    assert max(auto["shapes"], key=auto["shapes"].get) == "chain 64", auto["shapes"]
    assert auto["measured_speedup"] == auto["speedup_vs_ar"] and auto["predicted_speedup"] > 1
    assert auto["tokens_per_forward"] == pytest.approx(64 / auto["nfe"]) and 0 <= auto["single_token_passes"] <= 1
    assert "shapes" not in rows["ar"] and rows["ar"]["tokens_per_forward"] == 1.0


def test_bench_image_reports_the_chooser_for_latency_and_throughput_rows(tmp_path, capsys):
    """The official-code test checkpoints converted (16 tokens), ``--cost-curve flat``: the auto method's row (from its
    batch-1 latency decodes) and its throughput row carry the chooser's keys; both tables are printed."""
    pipe = tmp_path / "pipe"
    assert main(["convert", "llamagen", "--gpt", f"{DATA}/c2i_tiny.pt", "--vq", f"{DATA}/vq16_tiny.pt", "--out", str(pipe),
                 "--n-head", "4", "--trust-pickle"]) == 0
    path = tmp_path / "image.json"
    evaluator = f"{resolve_model_path('tiny-c2i')}/evaluator"
    assert main(["bench", "image", "--model", str(pipe), "--evaluator", evaluator, "--methods", "ar,auto", "--num-images", "2",
                 "--batch-size", "2", "--latency-images", "1", "--real-images", "2", "--noise-repeats", "1",
                 "--batch-sizes", "2", "--rounds", "1", "--sweep-images", "2", "--cost-curve", "flat", "--quiet",
                 "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "shape chooser (batch-1 latency runs): cost curve FLAT" in out and "throughput shape chooser: cost curve FLAT" in out
    result = json.loads(path.read_text())
    auto = result["methods"]["auto"]
    keys = ("shapes", "predicted_speedup", "measured_speedup", "prediction_error", "tokens_per_forward", "single_token_passes")
    assert all(key in auto for key in keys) and auto["measured_speedup"] == auto["speedup"]
    assert sum(auto["shapes"].values()) == auto["nfe"] - 1  # one image at batch 1: every pass after the prefill
    assert "shapes" not in result["methods"]["ar"]
    row = next(r for r in result["throughput"] if r["method"] == "auto")
    assert all(key in row for key in keys) and row["measured_speedup"] == row["speedup_vs_ar"]
    assert not np.isnan(row["tokens_per_forward"])
