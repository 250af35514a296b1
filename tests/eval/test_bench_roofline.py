"""The roofline report (vispec.eval.bench.roofline), the calibration the window chooser shares with it, the CUDA-graph
mode of compiled steps and the one-command GPU bench run on CPU."""

import itertools
import json
import math

import pytest
import torch

from vispec.decoding import decode
from vispec.decoding.compiled import CUDA_GRAPHS_MODE, compile_mode, compiled, cuda_graphs, cudagraph_skips
from vispec.decoding.windows import (ChooserSettings, WindowChooser, WindowStats, calibrate_step_costs, cost_key,
                                     relative_step_costs)
from vispec.eval.bench import roofline
from vispec.eval.bench.configs import DecoderBenchConfig
from vispec.models.llamagen_gpt import LlamaGenCondition
from helpers import tiny_gpt


def test_bound_weights_every_pass_by_its_relative_cost():
    curve = {"1": 1.0, "2": 1.2, "4": 1.5, "8": 2.5}
    assert roofline.relative_cost(curve, 4) == 1.5
    assert roofline.relative_cost(curve, 6) == pytest.approx(2.0)  # between measured windows: linear
    assert roofline.relative_cost(curve, 16) is None
    # one fixed window: tokens per pass / relative cost
    assert roofline.bound({4: 100}, 300, curve) == pytest.approx(3.0 / 1.5)
    # mixed windows (auto, or a fixed window's narrower last passes): AR passes / sum of relative costs
    assert roofline.bound({4: 80, 2: 10, 1: 10}, 255, curve) == pytest.approx(255 / (80 * 1.5 + 10 * 1.2 + 10))
    assert roofline.mean_relative_cost({4: 80, 2: 10, 1: 10}, curve) == pytest.approx((80 * 1.5 + 12 + 10) / 100)
    assert math.isnan(roofline.bound({16: 5}, 255, curve))
    fields = roofline.roofline_fields({4: 100}, 300, curve, {"1": 1.0, "4": 2.0}, speedup=1.8, speedup_cpu=1.2,
                                      tokens_per_pass=3.0)
    assert fields["roofline_bound"] == pytest.approx(2.0) and fields["roofline_fraction"] == pytest.approx(0.9)
    assert fields["roofline_bound_cpu"] == pytest.approx(1.5) and fields["roofline_fraction_cpu"] == pytest.approx(0.8)
    assert roofline.tokens_per_pass(256, 86.0) == pytest.approx(255 / 85)
    # AR's measured step 10% dearer than c(1) (wall) and 5% cheaper (CPU): the bound compares with AR's own time
    ratio = roofline.ar_step_ratio({"step_s": 0.010, "ar_step_s": 0.011, "step_cpu_s": 0.020, "ar_step_cpu_s": 0.019})
    assert ratio == pytest.approx((1.1, 0.95))
    scaled = roofline.roofline_fields({4: 100}, 300, curve, {"1": 1.0, "4": 2.0}, speedup=1.8, speedup_cpu=1.2,
                                      tokens_per_pass=3.0, ar_step=ratio)
    assert scaled["roofline_bound"] == pytest.approx(2.2) and scaled["roofline_bound_cpu"] == pytest.approx(1.425)
    assert roofline.ar_step_ratio({"step_s": 0.01}) == (None, None)  # no AR timing: the relative form


def test_scripted_chooser_runs_the_windows_in_turn_and_never_hands_over_to_ar():
    with pytest.raises(ValueError, match="ChooserSettings.script"):
        ChooserSettings(script=(0, 2))
    stats = WindowStats(settings=ChooserSettings(block=2, script=(1, 4, 16)))
    chooser = WindowChooser(16, stats, key="k")
    assert not chooser.prefers_ar(64)
    picked = []
    for _ in range(8):
        picked.append(chooser.choose(need=16))
        chooser.record(picked[-1], [0], [picked[-1]])
    assert picked == [1, 1, 4, 4, 16, 16, 1, 1]
    assert WindowChooser(16, stats, key="k").choose(need=3) == 1  # the script restarts per chooser, capped by need


def test_calibration_fills_the_choosers_costs_and_the_report_reads_them():
    """Every window of the set measured over the cache lengths, under the cost key a decode of that batch uses; a
    chooser of that key starts from them (no exploration of costs), and the report's relative costs are the
    chooser's predictions."""
    model = tiny_gpt(vocab_size=16, block_size=64, num_classes=3, dim=32, n_layer=1, std=0.3)
    ticks = itertools.count()
    stats = WindowStats(clock=lambda: float(next(ticks)))  # a deterministic clock
    condition = LlamaGenCondition(class_labels=torch.tensor([0, 1]))
    key = calibrate_step_costs(model, condition, 64, stats, [1, 2, 4], generator=[torch.Generator().manual_seed(i) for i in range(2)])
    assert key == cost_key(model, 2, False)
    costs = stats.step_costs[key]
    assert set(costs) == {1, 2, 4}
    assert all(max(L for L, _ in v) - min(L for L, _ in v) >= 16 for v in costs.values())  # spread over the decode
    assert not stats.tokens_per_pass  # only step times are shared
    chooser = WindowChooser(64, stats, key=key)
    assert all(chooser.cost(w, 32) is not None for w in (1, 2, 4))
    curve = relative_step_costs(stats, key, 32)
    assert curve[1] == 1.0 and curve[4] == pytest.approx(chooser.cost(4, 32) / chooser.cost(1, 32))
    with pytest.raises(ValueError, match="windows"):
        calibrate_step_costs(model, condition, 8, stats, [])
    with pytest.raises(ValueError, match="sjd or mc-sjd"):
        calibrate_step_costs(model, condition, 8, stats, [1, 2], decoding="sjd-pac")


def test_cuda_graph_mode_is_scoped_and_compiles_separately():
    assert compile_mode() == "default"
    with cuda_graphs():
        assert compile_mode() == CUDA_GRAPHS_MODE
        with cuda_graphs(False):  # does not turn an outer request off
            assert compile_mode() == CUDA_GRAPHS_MODE
        graph_step = compiled(decode)
    assert compile_mode() == "default"
    assert compiled(decode) is not graph_step and compiled(decode) is compiled(decode)
    assert cudagraph_skips() >= 0
    with pytest.raises(ValueError, match="add --compile"):
        DecoderBenchConfig(cuda_graphs=True).validate()


def test_bench_decoders_reports_the_roofline_in_json_and_table(tmp_path, capsys):
    from vispec.cli import main

    path = tmp_path / "bench.json"
    assert main(["bench", "decoders", "--model", "GPT-mini", "--vocab-size", "64", "--num-classes", "4", "--image-tokens", "16",
                 "--init-std", "0.5", "--methods", "ar,mc-sjd", "--window", "4", "--num-images", "1", "--threads", "1",
                 "--json", str(path)]) == 0
    result = json.loads(path.read_text())
    curve = result["roofline"]["curves"][0]
    assert result["roofline"]["at"] == 8 and set(curve["relative_cost"]) == {"1", "2", "4"} and curve["relative_cost"]["1"] == 1
    for method, row in result["methods"].items():
        for key in ("tokens_per_pass", "relative_cost", "roofline_bound", "roofline_fraction", "speedup_cpu", "cpu_s",
                    "roofline_bound_cpu", "roofline_fraction_cpu"):
            assert key in row, (method, key)
    assert result["methods"]["ar"]["roofline_bound"] == 1.0 and result["methods"]["ar"]["tokens_per_pass"] == 1.0
    table = capsys.readouterr().out
    assert "roofline: c(B, W)/c(B, 1)" in table and "% roof" in table and "% roof cpu" in table


@pytest.mark.slow
def test_the_gpu_command_runs_end_to_end_on_cpu(tmp_path, capsys, monkeypatch):
    """The GPU command's flags (compiled steps in CUDA-graph mode, the kernels report) on CPU: one JSON and one table
    with the sweep, the roofline (both clocks), the CUDA-graph skips (every compiled graph: CPU tensors) and the
    kernels' bandwidth cells. The model is a one-layer GPT of width 32 in GPT-mini's place (compiling is most of the
    test's time)."""
    from vispec.cli import main
    from vispec.eval.bench import decoders

    monkeypatch.setattr(decoders, "build_model", lambda cfg: tiny_gpt(vocab_size=64, block_size=16, num_classes=4, dim=32,
                                                                      n_layer=1, std=0.3).eval())
    path = tmp_path / "gpu.json"
    assert main(["bench", "decoders", "--model", "GPT-mini", "--vocab-size", "64", "--num-classes", "4", "--image-tokens", "4",
                 "--methods", "ar,mc-sjd", "--window", "2", "--num-images", "1", "--rounds", "1", "--threads", "1",
                 "--device", "cpu", "--dtype", "float32", "--compile", "--cuda-graphs", "--kernels", "--batch-sizes", "1",
                 "--json", str(path)]) == 0
    result = json.loads(path.read_text())
    assert "complete" not in result  # the final write (a partial one says "complete": false)
    assert {(r["method"], r["compile"]) for r in result["rows"]} == {("ar", False), ("mc-sjd", False), ("ar", True), ("mc-sjd", True)}
    assert [(c["batch_size"], c["compile"]) for c in result["roofline"]["curves"]] == [(1, False), (1, True)]
    for row in result["rows"]:
        assert len(row["round_cpu_s"]) == 1 and "speedup_vs_ar_cpu" in row and "roofline_fraction_cpu" in row
    assert result["config"]["cuda_graphs"] is True and result["cuda_graphs"]["mode"] == "reduce-overhead"
    assert result["cuda_graphs"]["cudagraph_skips"] > 0  # CPU tensors: inductor runs no CUDA graph
    assert result["cuda_graphs"]["skip_reasons"] == []  # inductor gives reasons for CUDA graphs only
    kernels = result["kernels"]
    assert {c["rows"] for c in kernels["cells"]} == {2, 2048} and {c["vocab"] for c in kernels["cells"]} == {64}
    assert kernels["kernels_timed"] is False and kernels["step_shares"] == {}
    table = capsys.readouterr().out
    assert "roofline" in table and "CUDA graphs" in table and "ref GB/s" in table
