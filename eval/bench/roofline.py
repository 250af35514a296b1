"""The roofline report of ``vispec bench decoders`` and ``vispec bench image``: what the hardware allows a
speculative decoder, next to what it got.

A decoder that commits ``T`` tokens per verification pass (the accepted drafts plus one: the step compression
per pass) over windows of ``W`` rows is ``T`` times faster than AR only if a ``W``-row step costs what a one-row
step costs. It does not: a step's cost grows with its rows once the device's compute, not its memory traffic,
is the limit (a CPU core's fp32 knee is some tens of rows; an H100's bf16 knee some hundreds). With the
measured cost curve ``c(B, W) / c(B, 1)`` (batch ``B``, window ``W``, whole decode steps: forward,
verification and read-back) the best speed-up over AR a decode's passes allow is::

    bound = AR passes / sum over the decoder's passes of c(B, W_pass) / c(B, 1)

which for one fixed window is ``T / (c(B, W) / c(B, 1))`` (tokens per pass over relative cost), and for the
auto window or mixed windows (the last passes of a fixed window are narrower) weights each window by its
passes. Passes are batch passes: a batch runs until its slowest sample is done. The prefill (one pass on
either side) is left out. The measured speed-up over AR (same compile setting) divided by that bound is the
share of the roofline the decoder reached (``roofline_fraction``); the rest is what the decoder's own
overheads cost (or noise: a share above 1 says the bound's curve was measured pessimistically).

``c(B, 1)`` is the speculative decoder's one-row step (what the chooser compares against); AR's own step costs
something else (compiled AR reads nothing back; eager AR may cost more). Where the bench has timed AR
(``vispec bench decoders``' sweep: ``ar_step_s``, AR's timed rounds over its passes, the prefill included) the
bound compares the decoder's predicted time with AR's measured one::

    bound = AR passes x ar_step_s / (c(B, 1) x sum over the decoder's passes of c(B, W_pass) / c(B, 1))

i.e. the relative form above times ``ar_step_s / c(B, 1)`` (each clock with its own seconds); without an AR
timing the relative form is used as it is.

The curve is the window chooser's (:mod:`vispec.decoding.windows`): the step times it records in its
:class:`~vispec.decoding.windows.WindowStats`, at ``at`` cached tokens (the middle of the image: with a
cost linear in the cache length, the mean over a decode that advances evenly). Before a batch size's
warm-up a calibration decode (:func:`~vispec.decoding.windows.calibrate_step_costs`) runs every window of the
set at every cache length into the bench's ``WindowStats``, so the ``window="auto"`` contenders start from
it and the report reads it (extended by whatever the chooser measured in the timed rounds): one curve.
Windows between the measured ones (eager steps of a fixed window run the widths left near the end) are
interpolated linearly.

On a shared machine wall time measures the neighbours too, so the bench also measures CPU time
(``time.process_time`` of the process: every thread's CPU seconds) for every timed quantity: a second
calibration with the CPU clock gives the curve in CPU seconds (``cpu``), and the timed rounds are measured
on both clocks, so the speed-ups and the roofline shares come in both (``*_cpu`` keys). On CUDA the CPU
clock counts the host's work (launches and waits), not the device's.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, ClassVar, Hashable, Optional, Sequence

import torch

from vispec.decoding.windows import WindowStats, calibrate_step_costs, relative_step_costs

CALIBRATION_DECODES = 2  # per clock, batch size and compile setting


def calibration_spec(methods: list[str]) -> str:
    """The decoding spec whose step the calibration times: the first MC-SJD or SJD method (MC-SJD preferred), else
    MC-SJD (maximal coupling)."""
    from vispec.decoding import DecodingConfig

    configs = [DecodingConfig.parse(m) for m in methods]
    for strategy in ("mc-sjd", "sjd"):
        for config in configs:
            if config.strategy == strategy and config.rule.lossless:
                return DecodingConfig.parse(config, window="auto").name
    return "mc-sjd"


def calibrate(model: Any, condition: Any, num_tokens: int, stats: WindowStats, windows: list[int], spec: str, *,
              compile: bool, sampling: Any, seed: int, decodes: int = CALIBRATION_DECODES) -> tuple[Hashable, WindowStats]:
    """Calibrate ``stats`` (the chooser's, wall clock) and a new CPU-clock ``WindowStats``; returns the cost key and
    the CPU-clock stats."""
    cpu = WindowStats(clock=time.process_time)
    size = _batch_of(condition)
    key = None
    for target in (stats, cpu):
        gens = [torch.Generator().manual_seed(seed * 7919 + i) for i in range(size)]
        key = calibrate_step_costs(model, condition, num_tokens, target, windows, decoding=spec, compile=compile,
                                   sampling=sampling, generator=gens, decodes=decodes)
    return key, cpu


def _batch_of(condition: Any) -> int:
    from vispec.decoding.common import condition_size

    return condition_size(condition)


def curve_entry(stats: WindowStats, cpu: WindowStats, key: Hashable, at: int, batch: int, compiled: bool) -> dict:
    """The JSON form of one cost curve: relative costs by window on both clocks, and window 1's seconds."""
    from vispec.decoding.windows import cost_growth, predict_cost

    def one_step(s: WindowStats) -> Optional[float]:
        costs = s.step_costs.get(key, {})
        return predict_cost(costs[1], at, cost_growth(costs)) if costs.get(1) else None

    return {"batch_size": batch, "compile": compiled, "at": at,
            "relative_cost": {str(w): c for w, c in relative_step_costs(stats, key, at).items()},
            "relative_cost_cpu": {str(w): c for w, c in relative_step_costs(cpu, key, at).items()},
            "step_s": one_step(stats), "step_cpu_s": one_step(cpu)}


def relative_cost(curve: dict, window: int) -> Optional[float]:
    """``c(W) / c(1)`` from a curve ``{str(W): relative cost}``: measured, or linear between the nearest measured
    windows around ``W``; None outside the measured range."""
    points = sorted((int(w), c) for w, c in curve.items())
    for (w0, c0), (w1, c1) in zip(points, points[1:]):
        if w0 <= window <= w1:
            return c0 + (c1 - c0) * (window - w0) / (w1 - w0)
    return dict(points).get(window)


def bound(windows_total: dict, ar_passes: int, curve: dict) -> float:
    """The speed-up bound of a decoder's passes (module docstring): ``ar_passes`` over the passes' summed relative
    cost; NaN when a window's cost is unknown or there are no passes."""
    total = 0.0
    for window, passes in windows_total.items():
        cost = relative_cost(curve, int(window))
        if cost is None:
            return float("nan")
        total += passes * cost
    return ar_passes / total if total > 0 else float("nan")


def mean_relative_cost(windows_total: dict, curve: dict) -> float:
    """The pass-weighted mean relative cost of a decoder's windows (NaN if one is unknown)."""
    passes = sum(windows_total.values())
    costs = [relative_cost(curve, int(w)) for w in windows_total]
    if not passes or any(c is None for c in costs):
        return float("nan")
    return sum(n * c for n, c in zip(windows_total.values(), costs)) / passes


def roofline_fields(windows_total: dict, ar_passes: int, curve: dict, curve_cpu: dict, speedup: float,
                    speedup_cpu: float, tokens_per_pass: float, ar_step: tuple[Optional[float], Optional[float]] = (1.0, 1.0)
                    ) -> dict:
    """A row's roofline keys: ``tokens_per_pass``, ``relative_cost`` (pass-weighted), ``roofline_bound`` and
    ``roofline_fraction`` (measured speed-up over the bound), and the same on the CPU clock (``*_cpu``).
    ``ar_step``: AR's measured step over ``c(B, 1)`` on the wall and CPU clocks (module docstring; 1 where unknown)."""
    scale, scale_cpu = (r if r is not None and r > 0 else 1.0 for r in ar_step)
    wall = bound(windows_total, ar_passes, curve) * scale
    cpu = bound(windows_total, ar_passes, curve_cpu) * scale_cpu
    return {"tokens_per_pass": tokens_per_pass,
            "relative_cost": mean_relative_cost(windows_total, curve),
            "relative_cost_cpu": mean_relative_cost(windows_total, curve_cpu),
            "roofline_bound": wall, "roofline_fraction": speedup / wall if wall == wall else float("nan"),
            "roofline_bound_cpu": cpu, "roofline_fraction_cpu": speedup_cpu / cpu if cpu == cpu else float("nan")}


def tokens_per_pass(num_tokens: int, nfe: float) -> float:
    """Tokens committed per verification pass of a sample: ``(N - 1) / (NFE - 1)`` (the prefill commits token 0)."""
    return (num_tokens - 1) / (nfe - 1) if nfe > 1 else float("nan")


def ar_step_ratio(curve: dict) -> tuple[Optional[float], Optional[float]]:
    """AR's measured step over ``c(B, 1)`` on the wall and CPU clocks, from a curve entry (None where either is
    unknown)."""
    def ratio(ar: Optional[float], step: Optional[float]) -> Optional[float]:
        return ar / step if ar and step else None

    return ratio(curve.get("ar_step_s"), curve.get("step_s")), ratio(curve.get("ar_step_cpu_s"), curve.get("step_cpu_s"))


def format_curves(curves: list[dict], top: int = 8) -> list[str]:
    """One line per cost curve: ``c(B, W) / c(B, 1)`` by window, wall clock (CPU clock)."""
    lines = []
    for c in curves:
        cells = []
        for w, r in list(c["relative_cost"].items())[:top]:
            cpu = c["relative_cost_cpu"].get(w)
            cells.append(f"{w}:{r:.2f}" + (f"({cpu:.2f})" if cpu is not None else ""))
        step = f"{1e3 * c['step_s']:.2f} ms" if c.get("step_s") else "?"
        ar = f" (AR step {1e3 * c['ar_step_s']:.2f} ms)" if c.get("ar_step_s") else ""
        lines.append(f"  B={c['batch_size']:<3} {'compiled' if c['compile'] else 'eager':<8} c(1)={step:>10}{ar}  " + " ".join(cells))
    return lines


def _cell(value: Optional[float], fmt: str, width: int) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return f"{'-':>{width}}"
    return f"{value:{fmt}}".rjust(width)


def _percent(value: Optional[float], fmt: str, width: int) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return f"{'-':>{width}}"
    return f"{100 * value:{fmt}}%".rjust(width)


def format_roofline_table(rows: list[dict], curves: list[dict], at: int, title: str = "roofline") -> str:
    """The roofline table (module docstring): per row tokens per pass, relative cost, bound, measured speed-up and
    its share of the bound, on the wall clock and the CPU clock; the cost curves above it."""
    width = max([16] + [len(r["method"]) for r in rows])
    head = (f"{title}: c(B, W)/c(B, 1) of whole decode steps at {at} cached tokens, wall clock (CPU clock); "
            f"bound = AR passes / sum of the passes' relative costs (x AR's measured step / c(1) where AR was timed); % roof = measured speed-up over AR / bound")
    header = (f"{'B':>3} {'method':<{width}} {'mode':<8} {'tok/pass':>8} {'rel cost':>8} {'bound':>6} {'vs AR':>6} "
              f"{'% roof':>6} {'bound cpu':>9} {'vs AR cpu':>9} {'% roof cpu':>10}")
    lines = [head, *format_curves(curves), header, "-" * len(header)]
    last = None
    for r in rows:
        if last is not None and r["batch_size"] != last:
            lines.append("")
        last = r["batch_size"]
        lines.append(
            f"{r['batch_size']:>3} {r['method']:<{width}} {'compiled' if r.get('compile') else 'eager':<8} "
            f"{_cell(r.get('tokens_per_pass'), '.2f', 8)} {_cell(r.get('relative_cost'), '.2f', 8)} "
            f"{_cell(r.get('roofline_bound'), '.2f', 6)} {_cell(r.get('speedup_vs_ar'), '.2f', 6)} "
            f"{_cell(100 * r['roofline_fraction'] if r.get('roofline_fraction') is not None else None, '.0f', 6)} "
            f"{_cell(r.get('roofline_bound_cpu'), '.2f', 9)} {_cell(r.get('speedup_vs_ar_cpu'), '.2f', 9)} "
            f"{_cell(100 * r['roofline_fraction_cpu'] if r.get('roofline_fraction_cpu') is not None else None, '.0f', 10)}")
    return "\n".join(lines)


# ---- the cost curve the choosers see (--cost-curve) --------------------------------------------------------------
#
# ``measured`` (the default): the bench hands decodes the WindowStats its roofline calibration fills, and the shape
# chooser of ``auto`` measures (or loads from this machine's cache) its own curve. ``flat`` or a cost-curve file: the
# decodes get a :class:`PinnedStats`, whose curve no measurement changes (a measured step time mixed into a flat or
# GPU-recorded curve would make whatever ran look cheap), and the roofline calibrates a WindowStats of its own.


class _FixedSamples(list):
    """A cost label's step times that no measurement extends."""

    def append(self, value: Any) -> None:
        pass

    def extend(self, values: Any) -> None:
        pass

    def __delitem__(self, index: Any) -> None:
        pass


class _FixedCosts(dict):
    """One cost key's step times of a pinned curve: the curve's labels, and ``fallback`` for every other label (flat:
    1.0, so every window costs the same; a file: infinite, so what it has no cost for is never chosen)."""

    def __init__(self, costs: dict, fallback: list):
        super().__init__({label: _FixedSamples(samples) for label, samples in costs.items()})
        self.fallback = _FixedSamples(fallback)

    def get(self, label: Any, default: Any = None) -> list:
        samples = dict.get(self, label)
        return self.fallback if samples is None else samples

    def setdefault(self, label: Any, default: Any = None) -> list:
        return self.get(label)


@dataclass
class PinnedStats(WindowStats):
    """A :class:`~vispec.decoding.windows.WindowStats` whose every cost key holds ``starting_costs`` and nothing else:
    the choosers read them (no calibration, no cache file read or written) and their measurements are dropped.
    Acceptance rates are kept as usual."""

    fallback: tuple = ()
    measures_costs: ClassVar[bool] = False

    def costs(self, key: Hashable) -> dict:
        if key not in self.step_costs:
            self.step_costs[key] = _FixedCosts(self.starting_costs, list(self.fallback))
        return self.step_costs[key]


def flat_costs() -> dict:
    """Every shape's cost label (``ar``, ``chain:L``, ``tree:L`` of :func:`vispec.decoding.shapes.candidate_shapes`)
    and every window ``1, 2, 4, ..., 64`` of the window chooser at 1.0 seconds."""
    from vispec.decoding.shapes import candidate_shapes
    from vispec.decoding.windows import window_set

    labels = sorted({shape.cost_label for shape in candidate_shapes(64, 3, 3, every_tree=True)})
    return {**{label: [(0, 1.0)] for label in labels}, **{window: [(0, 1.0)] for window in window_set(64)}}


def chooser_stats(cost_curve: str) -> Optional[WindowStats]:
    """The WindowStats a bench hands its decodes under ``--cost-curve``: None for ``measured`` (the bench's own, which
    its roofline calibration fills), else a :class:`PinnedStats` of the flat curve or of the file's
    (:func:`vispec.eval.bench.configs.read_cost_curve`)."""
    if cost_curve == "measured":
        return None
    if cost_curve == "flat":
        return PinnedStats(starting_costs=flat_costs(), fallback=((0, 1.0),))
    from vispec.eval.bench.configs import read_cost_curve

    return PinnedStats(starting_costs=read_cost_curve(cost_curve), fallback=((0, math.inf),))


def cost_curve_note(cost_curve: str) -> str:
    """What the chooser table says of the curve the choosers saw."""
    if cost_curve == "measured":
        return "measured on this machine (the first auto decode calibrates it, or it is read from the step-costs cache)"
    if cost_curve == "flat":
        return ("FLAT (--cost-curve flat: every shape and window costs the same); predicted speed-ups are relative to "
                "that curve, not to this machine's")
    return (f"from {cost_curve} (--cost-curve; pinned, shapes it has no cost for are never chosen); predicted speed-ups "
            f"are relative to that curve, not to this machine's")


# ---- the shape chooser's report ------------------------------------------------------------------------------------


def chooses_shapes(config: Any) -> bool:
    """Whether a :class:`~vispec.decoding.DecodingConfig`'s decodes run the shape chooser (``auto``,
    ``sjd-pac:window=auto``)."""
    return config.strategy == "auto" or (config.strategy == "sjd-pac" and config.window == "auto")


def chooser_fields(decodes: Sequence[tuple[dict, dict]], measured: Optional[float]) -> dict:
    """A row's shape-chooser keys from its decodes' ``(stats.shapes, stats.chooser)``; empty when no decode reported
    shapes. ``shapes``: passes per shape label, summed (most used first); ``predicted_speedup``: the mean of the
    decodes' predictions (those without one ignored; None if none has one); ``measured_speedup``: the row's speed-up
    over AR (``measured``); ``prediction_error``: predicted / measured - 1 (None where either is unknown);
    ``chooser_calibrations``: decodes that measured the cost curve (their passes were the calibration's)."""
    shapes: Counter = Counter()
    predicted: list[float] = []
    calibrations = 0
    reported = False
    for passes, chooser in decodes:
        reported = reported or bool(passes)
        shapes.update(passes or {})
        value = (chooser or {}).get("predicted_speedup")
        if value is not None and math.isfinite(value):
            predicted.append(float(value))
        calibrations += bool((chooser or {}).get("calibrated"))
    if not reported:
        return {}
    mean = sum(predicted) / len(predicted) if predicted else None
    known = measured is not None and math.isfinite(measured) and measured > 0
    return {"shapes": dict(sorted(shapes.items(), key=lambda kv: (-kv[1], kv[0]))), "predicted_speedup": mean,
            "measured_speedup": measured if known else None,
            "prediction_error": mean / measured - 1 if mean is not None and known else None,
            "chooser_calibrations": calibrations}


def shapes_text(shapes: dict, top: int = 3) -> str:
    """The most used shapes with their share of passes, e.g. ``chain 16 62%, tree 64 K3 D3 30%, ar 8%``."""
    total = sum(shapes.values()) or 1
    common = sorted(shapes.items(), key=lambda kv: (-kv[1], kv[0]))[:top]
    return ", ".join(f"{label} {100 * n / total:.0f}%" for label, n in common) + (", ..." if len(shapes) > top else "")


def format_chooser_table(rows: list[dict], cost_curve: str, title: str = "shape chooser") -> str:
    """One line per row that reports shapes (:func:`chooser_fields`): predicted and measured speed-up over AR, the
    error, tokens per forward, the share of single-token passes, the roofline share and the top shapes; empty when no
    row has shapes."""
    rows = [r for r in rows if "shapes" in r]
    if not rows:
        return ""
    width = max([16] + [len(r["method"]) for r in rows])
    head = (f"{title}: cost curve {cost_curve_note(cost_curve)}. predicted: the chooser's speed-up over AR's passes on "
            f"that curve (mean over decodes); measured: wall clock over AR, same compile setting; error = predicted / "
            f"measured - 1 (beyond 10% on a quiet machine with the measured curve: the cost model is wrong)")
    header = (f"{'B':>3} {'method':<{width}} {'mode':<8} {'predicted':>9} {'measured':>8} {'error':>6} {'tok/fwd':>7} "
              f"{'1-token':>7} {'% roof':>6}  shapes (share of passes)")
    lines = [head, header, "-" * len(header)]
    for r in rows:
        line = (f"{r['batch_size']:>3} {r['method']:<{width}} {'compiled' if r.get('compile') else 'eager':<8} "
                f"{_cell(r.get('predicted_speedup'), '.2f', 9)} {_cell(r.get('measured_speedup'), '.2f', 8)} "
                f"{_percent(r.get('prediction_error'), '+.0f', 6)} {_cell(r.get('tokens_per_forward'), '.2f', 7)} "
                f"{_percent(r.get('single_token_passes'), '.1f', 7)} {_percent(r.get('roofline_fraction'), '.0f', 6)}  "
                f"{shapes_text(r['shapes'])}")
        if r.get("chooser_calibrations"):
            line += f"  [{r['chooser_calibrations']} decode(s) calibrated the curve]"
        lines.append(line)
    return "\n".join(lines)
