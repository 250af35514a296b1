"""``vispec demo``: the main job. Generate with AR, SJD and MC-SJD, save a labelled grid and a report.

With the embedded ``tiny-c2i`` model installed: a few classes at fixed seeds per method, a comparison
grid PNG (rows: methods, columns: classes) and a report (Markdown + JSON) with NFE, step compression,
latency and speed-up per method. SJD and MC-SJD are exact: their images differ from AR's sample by
sample, but follow the same distribution.

Without it (a checkout whose models are not trained yet), the demo compares the decoders on a
randomly initialised GPT-mini and says so: such a model barely conditions on context, so its step
compression shows that the machinery works, not what a trained model gets.
"""

from __future__ import annotations

import json
import os
import time

import torch
from PIL import Image, ImageDraw

from vispec.eval.bench_decoders import ALL_METHODS, DecoderBenchConfig, format_table, run_decoder_bench

DEMO_CLASSES = (0, 3, 4, 8, 12, 13)
DEMO_METHODS = ("ar", "sjd", "mc-sjd")
RANDOM_CONFIG = DecoderBenchConfig(
    model="GPT-mini", vocab_size=1024, image_tokens=256, num_classes=10, init_std=0.02,
    methods=ALL_METHODS, window=16, num_images=2, batch_size=1, guidance_scale=2.0, seed=0,
)


def _grid(rows: list[list[Image.Image]], row_names: list[str], col_names: list[str], scale: int = 2) -> Image.Image:
    cell = rows[0][0].size[0] * scale
    left, top = 110, 22
    canvas = Image.new("RGB", (left + cell * len(col_names), top + cell * len(rows)), "white")
    draw = ImageDraw.Draw(canvas)
    for j, name in enumerate(col_names):
        draw.text((left + j * cell + 4, 5), name[:14], fill="black")
    for i, (images, name) in enumerate(zip(rows, row_names)):
        draw.text((5, top + i * cell + cell // 2 - 6), name, fill="black")
        for j, image in enumerate(images):
            canvas.paste(image.resize((cell, cell), Image.NEAREST), (left + j * cell, top + i * cell))
    return canvas


def run_tiny_c2i_demo(out_dir: str) -> dict:
    from vispec.eval.data import CLASS_NAMES
    from vispec.pipelines import LlamaGenPipeline

    pipe = LlamaGenPipeline.from_pretrained("vispec/tiny-c2i")
    pipe.set_progress_bar_config(disable=True)
    labels = list(DEMO_CLASSES)
    pipe(class_labels=[0], decoding="sjd")  # warm-up, not timed
    rows, methods = [], {}
    for method in DEMO_METHODS:
        print(f"  {method}: {len(labels)} images, one at a time ...", flush=True)
        images, stats = [], []
        for label in labels:
            out = pipe(class_labels=[label], decoding=method, generator=[torch.Generator().manual_seed(1000 + label)])
            images += out.images
            stats += out.stats
        rows.append(images)
        methods[method] = {
            "decoder": stats[0]["method"],
            "nfe": sum(s["nfe"] for s in stats) / len(stats),
            "latency_s": sum(s["latency_s"] for s in stats) / len(stats),
            "accepted_per_forward": sum(s["accepted_per_forward"] for s in stats) / len(stats),
        }
    for row in methods.values():
        row["step_compression"] = methods["ar"]["nfe"] / row["nfe"]
        row["speedup"] = methods["ar"]["latency_s"] / row["latency_s"]
    grid = _grid(rows, [methods[m]["decoder"] for m in DEMO_METHODS], [CLASS_NAMES[c] for c in labels])
    grid_path = os.path.join(out_dir, "grid.png")
    grid.save(grid_path)
    sampling = pipe.decoding_config.sampling().to_dict()
    table = [f"{'method':<16} {'nfe':>7} {'step x':>7} {'latency s':>10} {'speedup':>8}"]
    for m in DEMO_METHODS:
        r = methods[m]
        table.append(f"{r['decoder']:<16} {r['nfe']:>7.1f} {r['step_compression']:>7.2f} {r['latency_s']:>10.3f} {r['speedup']:>8.2f}")
    report = {"model": "vispec/tiny-c2i", "classes": {c: CLASS_NAMES[c] for c in labels}, "sampling": sampling,
              "window": pipe.decoding_config.config.window, "methods": methods, "grid": grid_path}
    print("\n".join(table))
    with open(os.path.join(out_dir, "report.md"), "w") as handle:
        handle.write("# vispec demo: tiny-c2i with AR, SJD and MC-SJD\n\n")
        handle.write(f"Classes {', '.join(CLASS_NAMES[c] for c in labels)} at fixed seeds, batch 1, CPU; sampling {sampling}.\n\n")
        handle.write("SJD and MC-SJD are exact: each image differs from AR's, the distribution does not.\n\n")
        handle.write("![grid](grid.png)\n\n```\n" + "\n".join(table) + "\n```\n")
    return report


def run_random_model_demo() -> dict:
    print("  (tiny-c2i is not installed in this checkout: comparing decoders on a random-init GPT-mini;")
    print("   its step compression shows the machinery works, not what a trained model gets)")
    result = run_decoder_bench(RANDOM_CONFIG, progress=lambda msg: print("  " + msg, flush=True))
    print(format_table(result))
    return result


def run_demo(out_dir: str = "out/demo") -> dict:
    from vispec.pipelines.llamagen import resolve_model_path

    os.makedirs(out_dir, exist_ok=True)
    start = time.perf_counter()
    try:
        resolve_model_path("vispec/tiny-c2i")
        embedded = True
    except ValueError:
        embedded = False
    print("vispec demo: AR vs SJD vs MC-SJD" + (" on tiny-c2i" if embedded else ""), flush=True)
    report = run_tiny_c2i_demo(out_dir) if embedded else run_random_model_demo()
    report["wall_s"] = time.perf_counter() - start
    with open(os.path.join(out_dir, "report.json"), "w") as handle:
        json.dump(report, handle, indent=2)
    if not embedded:
        with open(os.path.join(out_dir, "report.md"), "w") as handle:
            handle.write("# vispec demo: decoders on a random-init GPT-mini\n\n```\n" + format_table(report) + "\n```\n")
    print(f"report: {out_dir}/report.md, {out_dir}/report.json" + (f", {out_dir}/grid.png" if embedded else ""))
    return report
