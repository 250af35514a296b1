"""``vispec bench kernels``: the fixed per-call cost and asymptotic bandwidth fit (issue 33), and a CPU run that times
what decoders run (no read-backs in the timed call) and reports the per-call counts."""

from __future__ import annotations

import pytest

from vispec.eval.bench.kernels import KernelBenchConfig, fit_overhead, format_kernel_table, run_kernel_bench


def test_fit_recovers_overhead_and_bandwidth_from_synthetic_times():
    moved = [1e5, 1e6, 4e6, 3e7, 2.5e8]
    seconds = [20e-6 + b / 1.2e12 for b in moved]  # 20 us per call, 1200 GB/s
    fit = fit_overhead(moved, seconds)
    assert fit["overhead_us"] == pytest.approx(20.0, rel=1e-6)
    assert fit["asymptotic_gbps"] == pytest.approx(1200.0, rel=1e-6)
    assert fit["points"] == 5
    # noise around the line: least squares, not an interpolation of two points
    noisy = [s * (1 + e) for s, e in zip(seconds, (0.02, -0.02, 0.01, -0.01, 0.0))]
    assert fit_overhead(moved, noisy)["asymptotic_gbps"] == pytest.approx(1200.0, rel=0.02)


def test_fit_keeps_both_costs_non_negative_and_says_so():
    assert fit_overhead([1e5, 1e6, 4e6], [20e-6 + b / 1e12 for b in (1e5, 1e6, 4e6)])["bound"] is None
    flat = fit_overhead([1e5, 1e6, 1e7], [1e-3, 1e-3, 0.9e-3])  # time falls as bytes grow: fixed cost only
    assert flat["bound"] == "bandwidth" and flat["asymptotic_gbps"] is None
    assert flat["overhead_us"] == pytest.approx(2.9e3 / 3)  # the mean time
    # superlinear time (compute bound): the unconstrained intercept is negative, the fit passes through the origin
    moved = [1e6, 2e6, 4e6]
    steep = fit_overhead(moved, [1e-3, 3e-3, 9e-3])
    slope = sum(x * y for x, y in zip(moved, [1e-3, 3e-3, 9e-3])) / sum(x * x for x in moved)
    assert steep["bound"] == "overhead" and steep["overhead_us"] == 0.0
    assert steep["asymptotic_gbps"] == pytest.approx(1 / slope / 1e9)
    assert fit_overhead([1e6, 1e6], [1e-3, 2e-3]) == {"overhead_us": None, "asymptotic_gbps": None, "points": 2,
                                                      "bound": None}
    with pytest.raises(ValueError, match="same length"):
        fit_overhead([1.0, 2.0], [1.0])


def test_cpu_run_times_decoder_calls_and_reports_the_fit():
    cfg = KernelBenchConfig(rows=(4, 8), vocab=(32, 64), window=4, repeats=1, device="cpu", compile_check=False,
                            step_shares=False)
    lines = []
    result = run_kernel_bench(cfg, progress=lines.append)
    assert len(result["cells"]) == 8 and len(lines) == 8 and result["kernels_timed"] is False
    for cell in result["cells"]:
        ref = cell["reference"]
        assert ref["host_syncs"] == 0  # the timed call reads nothing back (validate=False, bytes counted after)
        assert ref["triton_launches"] == 0 and ref["aten_ops"] > 0 and ref["bytes"] > 0
    fits = {(f["op"], f["backend"]): f for f in result["fits"]}
    assert set(fits) == {("verify", "reference"), ("unmask", "reference")}
    for fit in fits.values():
        assert fit["points"] == 4 and fit["overhead_us"] >= 0 and fit["host_syncs"] == 0
        assert fit["asymptotic_peak_fraction"] is None  # no peak bandwidth on the CPU
    table = format_kernel_table(result)
    assert "overhead us" in table and "asym GB/s" in table and "aten ops" in table
    assert "unmask  reference" in table and "verify  reference" in table
