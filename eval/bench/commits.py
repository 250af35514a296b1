"""Tokens committed per verification pass, per method: the histogram ``hist[k]`` = passes that committed exactly
``k`` tokens (``k = 0`` always 0; the prefill is no pass), summed over every decoded image, as decoders report it
(:attr:`vispec.outputs.DecodeStats.commits`; AR: every pass commits one token). ``vispec bench image`` and
``vispec bench decoders`` keep it in each method's row under :data:`KEY` (a list indexed by ``k``, trailing zeros
trimmed), derive their ``1-token`` column from it, print :func:`format_commits_table` (shares of passes in log2
bins) and draw :func:`commits_plot` (``<--plot stem>.commits.png``). Drawn with PIL (no plotting dependency).
"""

from __future__ import annotations

import math
import os
from typing import Iterable, Optional

KEY = "commits_per_pass"
BIN_LABELS = ("1", "2", "3-4", "5-8", "9-16", "17-32", "33-64", ">64")
COLOURS = ((0, 90, 170), (220, 110, 0), (0, 140, 60), (200, 30, 30), (130, 70, 180), (140, 90, 60), (210, 80, 160),
           (100, 100, 100), (150, 150, 0), (0, 160, 170))


def histogram(commits) -> list[int]:
    """``commits`` (a ``[B, W]`` or ``[W]`` tensor, or a list of per-sample lists indexed by ``k``) summed over
    the samples, as a list indexed by ``k`` with trailing zeros trimmed."""
    if hasattr(commits, "tolist"):
        commits = commits.tolist()
    rows = commits if commits and isinstance(commits[0], (list, tuple)) else [commits]
    return merge(rows)


def merge(histograms: Iterable[Optional[Iterable[int]]]) -> list[int]:
    """The sum of histograms of any lengths (trailing zeros trimmed); ``None`` entries count as empty."""
    total: list[int] = []
    for hist in histograms:
        for k, count in enumerate(hist or ()):
            if k == len(total):
                total.append(0)
            total[k] += int(count)
    while total and total[-1] == 0:
        total.pop()
    return total


def passes(hist: list[int]) -> int:
    return sum(hist)


def share(hist: list[int], k: int = 1) -> float:
    """The share of passes that committed exactly ``k`` tokens (NaN without passes)."""
    n = passes(hist)
    return (hist[k] if k < len(hist) else 0) / n if n else float("nan")


def mean_per_pass(hist: list[int]) -> float:
    """Mean tokens committed per pass (NaN without passes)."""
    n = passes(hist)
    return sum(k * c for k, c in enumerate(hist)) / n if n else float("nan")


def bin_of(k: int) -> int:
    """The index in :data:`BIN_LABELS` of ``k >= 1`` tokens: 1, 2, 3-4, 5-8, ..., 33-64, >64."""
    return min((k - 1).bit_length(), len(BIN_LABELS) - 1)


def binned(hist: list[int]) -> list[int]:
    """Pass counts per bin of :data:`BIN_LABELS` (``k = 0``, never reached, is left out)."""
    out = [0] * len(BIN_LABELS)
    for k, count in enumerate(hist):
        if k:
            out[bin_of(k)] += count
    return out


def method_histograms(result: dict) -> dict[str, list[int]]:
    """``{method: histogram}`` of a bench result: each row of ``result["methods"]`` that has one, or for a
    ``bench decoders`` batch sweep (``result["rows"]``) every row of a method merged (all batch sizes and
    compile settings decode the same images)."""
    if "rows" in result:
        out: dict[str, list[int]] = {}
        for row in result["rows"]:
            if KEY in row:
                out[row["method"]] = merge([out.get(row["method"]), row[KEY]])
        return out
    return {name: row[KEY] for name, row in result.get("methods", {}).items() if KEY in row}


def _reached(histograms: dict[str, list[int]]) -> list[int]:
    """The bins some method reaches (at least the first)."""
    counts = [binned(h) for h in histograms.values()]
    return [i for i in range(len(BIN_LABELS)) if i == 0 or any(c[i] for c in counts)]


def format_commits_table(result: dict) -> str:
    """One line per method: its passes, the share of passes in each reached bin of tokens committed, the mean
    tokens per pass. Empty when no method recorded a histogram."""
    histograms = method_histograms(result)
    if not histograms:
        return ""
    bins = _reached(histograms)
    width = max([18] + [len(name) for name in histograms])
    header = f"{'method':<{width}} {'passes':>9} " + " ".join(f"{BIN_LABELS[i]:>6}" for i in bins) + f" {'mean':>6}"
    lines = ["tokens committed per verification pass: share of passes (the prefill is no pass)", header, "-" * len(header)]
    for name, hist in histograms.items():
        n, counts = passes(hist), binned(hist)
        cells = " ".join(f"{counts[i] / n:>6.1%}" if n else f"{'-':>6}" for i in bins)
        lines.append(f"{name:<{width}} {n:>9} {cells} {mean_per_pass(hist):>6.2f}")
    return "\n".join(lines)


def commits_plot_path(path: str) -> str:
    """Where the histogram goes for ``--plot path``: ``<path stem>.commits.png``."""
    return os.path.splitext(path)[0] + ".commits.png"


def draw_commits_plot(result: dict, path: str, size: tuple[int, int] = (900, 600)) -> str:
    """A PNG at ``path``: grouped bars of the share of passes (y) per bin of tokens committed per pass (x, the
    reached bins of :data:`BIN_LABELS`), a colour per method with a legend (and its mean tokens per pass)."""
    from PIL import Image, ImageDraw

    histograms = method_histograms(result)
    if not histograms:
        raise ValueError(f"the result has no method with {KEY!r} to plot")
    bins = _reached(histograms)
    shares = {name: [binned(h)[i] / max(passes(h), 1) for i in bins] for name, h in histograms.items()}
    y_hi = max(0.1, math.ceil(max(max(s) for s in shares.values()) * 10) / 10)
    w, h = size
    left, right, top, bottom = 70, 30, 40, 60
    image = Image.new("RGB", size, "white")
    draw = ImageDraw.Draw(image)
    plot_w, plot_h = w - left - right, h - top - bottom

    def y_at(value: float) -> float:
        return top + (1 - value / y_hi) * plot_h

    for i in range(6):  # grid and y ticks
        value = y_hi * i / 5
        draw.line([(left, y_at(value)), (w - right, y_at(value))], fill=(230, 230, 230))
        draw.text((8, y_at(value) - 6), f"{value:.0%}", fill="black")
    draw.line([(left, h - bottom), (w - right, h - bottom)], fill="black")
    draw.line([(left, top), (left, h - bottom)], fill="black")
    group = plot_w / len(bins)
    bar = group * 0.8 / len(shares)
    for j, (name, values) in enumerate(shares.items()):
        colour = COLOURS[j % len(COLOURS)]
        for g, value in enumerate(values):
            if not value:
                continue
            x0 = left + g * group + group * 0.1 + j * bar
            draw.rectangle([x0, y_at(value), x0 + max(bar - 1, 1), h - bottom], fill=colour)
    for g, i in enumerate(bins):
        draw.text((left + (g + 0.5) * group - 3 * len(BIN_LABELS[i]), h - bottom + 6), BIN_LABELS[i], fill="black")
    draw.text((w // 2 - 90, h - 25), "tokens committed per pass", fill="black")
    draw.text((8, top - 20), "share of passes", fill="black")
    draw.text((w // 2 - 150, 8), "tokens committed per verification pass, per method", fill="black")
    labels = {name: f"{name} (mean {mean_per_pass(hist):.2f})" for name, hist in histograms.items()}
    legend_x = w - right - 20 - max(draw.textlength(label) for label in labels.values())  # wide enough for every label
    for j, (name, label) in enumerate(labels.items()):  # legend, top right
        y = top + 6 + 14 * j
        colour = COLOURS[j % len(COLOURS)]
        draw.rectangle([legend_x - 14, y + 2, legend_x - 6, y + 10], fill=colour)
        draw.text((legend_x, y), label, fill=colour)
    image.save(path)
    return path


def commits_plot(result: dict, path: str, size: tuple[int, int] = (900, 600)) -> str:
    """The histogram for ``--plot path``, written to :func:`commits_plot_path` (``<path stem>.commits.png``);
    returns that path."""
    return draw_commits_plot(result, commits_plot_path(path), size)
