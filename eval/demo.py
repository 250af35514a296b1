"""``vispec demo``: the main job. Generate with AR, SJD, MC-SJD, SJD-PAC and budgeted MC-SJD, save a labelled grid and a report.

With the embedded ``tiny-c2i`` model installed: a few classes at fixed seeds per method, a comparison
grid PNG (rows: methods, columns: classes) and a report (Markdown + JSON) with NFE, step compression,
latency and speed-up per method. SJD, MC-SJD and SJD-PAC are exact: their images differ from AR's sample by
sample, but follow the same distribution. MC-SJD with the budgeted rule (:mod:`vispec.decoding.budget`) is lossy
within a budget: the report prints the requested per-verification TV budget next to the measured TV of a
verification's output from the exact target (mean and max), and the image's summed budget used.

Without it (a checkout whose models are not trained yet), the demo compares the decoders on a
randomly initialised GPT-mini and says so: such a model barely conditions on context, so its step
compression shows that the machinery works, not what a trained model gets.

With the embedded ``tiny-t2i`` installed, a text-to-image section follows: scene captions of compositions seen in
training, on new pictures (:data:`DEMO_SEED`: a stream no trainer draws from), decoded by AR, MC-SJD and SJD-PAC at
64x64, a grid (rows: decoders, columns: prompts), and per decoder the share of the scene checks passed (one judgement
per image and asked attribute; over the grid's pictures and more of the same stream decoded in batches, untimed, so
that its standard error is ~0.03) beside the strict rate (images passing all of theirs), the CLIP score with tiny-t2i's
CLIP (beside the score of the same images with mismatched captions), NFE, step compression and latency. Held-out
compositions (never trained on) are measured apart, with their own rate, by ``vispec bench image --model tiny-t2i``.

With the embedded ``tiny-edit`` installed, an image-to-image section follows: scene edits of the same kind (train
compositions, new pictures) decoded by AR, MC-SJD, IAD (drafts copied from the source picture) and MC-SJD with source
drafts, a grid and a table.

With the embedded ``tiny-mdlm`` installed, a text section follows: a few arithmetic word problems
solved by LLaDA's one-token-per-step baseline and by the threshold rule with DualCache (Fast-dLLM),
with accuracy, NFE, latency and the speed-up.

Timing: in every section the decoders run interleaved, round-robin over the same items (the order rotated by one
per item), so a machine that gets busier slows all of them alike. Each call is timed on the wall clock and on this
process's CPU clock; a speed-up is the median over items of AR's time over the decoder's (as the benches report
it), on both clocks, and the load average is printed beside each table. ``index.html`` in the output folder shows
the tables and the grids on one page.
"""

from __future__ import annotations

import html
import json
import os
import statistics
import textwrap
import time
from typing import Any, Callable, Sequence

import torch
from PIL import Image, ImageDraw

from vispec.decoding import DecodingConfig
from vispec.eval.bench.decoders import ALL_METHODS, DecoderBenchConfig, format_table, run_decoder_bench

DEMO_CLASSES = (0, 3, 8, 13)
DEMO_LOSSY = "mc-sjd+budget:delta=0.3,decay=0.9,ratio=2.5"  # 4.09 tokens per pass, FID within AR noise (README)
DEMO_METHODS = ("ar", "sjd", "mc-sjd", "sjd-pac", DEMO_LOSSY)  # the last one is lossy within a budget (TV in the report)
RANDOM_CONFIG = DecoderBenchConfig(
    model="GPT-mini", vocab_size=1024, image_tokens=256, num_classes=10, init_std=0.02,
    methods=ALL_METHODS, window=16, num_images=2, batch_size=1, guidance_scale=2.0, seed=0,
)


def interleaved(items: Sequence[Any], methods: Sequence[str], call: Callable[[str, int, Any], Any]) -> dict[str, dict]:
    """``call(method, index, item)`` for every item and method, round-robin: item ``i`` runs the methods in their order
    rotated by ``i``. Returns per method the results in item order and each call's wall and CPU seconds."""
    runs = {m: {"results": [None] * len(items), "wall": [0.0] * len(items), "cpu": [0.0] * len(items)} for m in methods}
    for i, item in enumerate(items):
        for k in range(len(methods)):
            method = methods[(i + k) % len(methods)]
            wall, cpu = time.perf_counter(), time.process_time()
            runs[method]["results"][i] = call(method, i, item)
            runs[method]["wall"][i] = time.perf_counter() - wall
            runs[method]["cpu"][i] = time.process_time() - cpu
    return runs


def timing(runs: dict[str, dict], reference: str) -> dict[str, dict]:
    """Per method: mean wall and CPU seconds per item, and the speed-ups over ``reference`` (median over items of
    the per-item ratios, each clock)."""
    out = {}
    for method, run in runs.items():
        base = runs[reference]
        out[method] = {
            "wall_s": statistics.fmean(run["wall"]), "cpu_s": statistics.fmean(run["cpu"]),
            "latency_s": statistics.fmean(run["wall"]),  # the name the report's JSON has always had for wall seconds
            "speedup_wall": statistics.median(b / t for b, t in zip(base["wall"], run["wall"])),
            "speedup_cpu": statistics.median(b / t for b, t in zip(base["cpu"], run["cpu"])),
        }
    return out


def load_note(before: float) -> str:
    """The one-minute load average at a section's start and end, against this machine's cores."""
    return f"load average {before:.2f} -> {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores"


def text_table(header: list[str], rows: list[list[str]]) -> list[str]:
    """Fixed-width lines: the first column left-aligned, the others right-aligned."""
    widths = [max(len(str(row[j])) for row in [header, *rows]) for j in range(len(header))]

    def line(row: list[str]) -> str:
        return " ".join(f"{cell:<{w}}" if j == 0 else f"{cell:>{w}}" for j, (cell, w) in enumerate(zip(row, widths)))

    return [line(header), *(line(row) for row in rows)]


TIMING_HEADER = ["wall s", "CPU s", "speed-up wall", "speed-up CPU"]


def checks_summary(checked: dict) -> dict:
    """``checks`` (the share of individual scene checks passed), the number ``made`` and its binomial standard error
    ``sqrt(p (1 - p) / made)``: with a dozen pictures (~40 checks) it is about 0.07, so exact decoders, which sample
    AR's distribution, can differ from AR by that much. ``checked`` is what
    :func:`~vispec.eval.bench.scene_checks.check_images` returned."""
    made, share = checked["made"], checked["checks"]
    return {"checks": share, "checks_made": made, "checks_se": (share * (1 - share) / made) ** 0.5 if made else None}


def checks_cell(row: dict) -> str:
    """``0.614 ±0.074``: a row's checks with their standard error (:func:`checks_summary`)."""
    return f"{row['checks']:.3f} ±{row['checks_se']:.3f}"


def timing_cells(row: dict) -> list[str]:
    return [f"{row['wall_s']:.3f}", f"{row['cpu_s']:.3f}", f"{row['speedup_wall']:.2f}", f"{row['speedup_cpu']:.2f}"]


def _grid(rows: list[list[Image.Image]], row_names: list[str], col_names: list[str], scale: int = 2,
          label_chars: int = 14) -> Image.Image:
    """Images in labelled rows and columns of equal cells, the column names (wrapped at ``label_chars`` characters)
    above them. A cell is as wide and tall as the largest image times ``scale``; each image is enlarged as far as it
    fits the cell at its own aspect ratio (nearest neighbour: the codes stay visible) and centred in it, so images of
    other shapes (text-to-image scenes of several sizes) leave only a thin even margin, not a blank corner."""
    cell_w = max(image.size[0] for images in rows for image in images) * scale
    cell_h = max(image.size[1] for images in rows for image in images) * scale
    wrapped = [textwrap.wrap(name, label_chars) or [""] for name in col_names]
    left, top = 150, 8 + 12 * max(len(lines) for lines in wrapped)
    canvas = Image.new("RGB", (left + cell_w * len(col_names), top + cell_h * len(rows)), "white")
    draw = ImageDraw.Draw(canvas)
    for j, lines in enumerate(wrapped):
        for k, line in enumerate(lines):
            x = left + j * cell_w + max(2, (cell_w - int(draw.textlength(line))) // 2)  # centred above its column
            draw.text((x, 4 + 12 * k), line, fill="black")
    for i, (images, name) in enumerate(zip(rows, row_names)):
        draw.text((5, top + i * cell_h + cell_h // 2 - 6), name, fill="black")
        for j, image in enumerate(images):
            w, h = image.size
            fit = min(cell_w / w, cell_h / h)
            size = (max(1, round(w * fit)), max(1, round(h * fit)))
            x, y = left + j * cell_w + (cell_w - size[0]) // 2, top + i * cell_h + (cell_h - size[1]) // 2
            canvas.paste(image.resize(size, Image.NEAREST), (x, y))
    return canvas


def run_tiny_c2i_demo(out_dir: str) -> dict:
    from vispec.eval.bench.data import CLASS_NAMES
    from vispec.pipelines import LlamaGenPipeline

    pipe = LlamaGenPipeline.from_pretrained("vispec/tiny-c2i")
    pipe.set_progress_bar_config(disable=True)
    labels = list(DEMO_CLASSES)
    pipe(class_labels=[0], decoding="sjd")  # warm-up, not timed
    print(f"  {', '.join(DEMO_METHODS)}: {len(labels)} images each, one at a time, interleaved ...", flush=True)
    load = os.getloadavg()[0]
    runs = interleaved(labels, DEMO_METHODS, lambda method, i, label: pipe(
        class_labels=[label], decoding=method, generator=[torch.Generator().manual_seed(1000 + label)]))
    clocks, note = timing(runs, "ar"), load_note(load)
    rows, methods = [], {}
    for method in DEMO_METHODS:
        outs = runs[method]["results"]
        images = [image for out in outs for image in out.images]
        stats = [s for out in outs for s in out.stats]
        rows.append(images)
        methods[method] = {
            "decoder": stats[0]["method"],
            "nfe": sum(s["nfe"] for s in stats) / len(stats),
            "accepted_per_forward": sum(s["accepted_per_forward"] for s in stats) / len(stats),
            **clocks[method],
        }
        if "tv_mean" in stats[0]:
            methods[method].update(tv_mean=sum(s["tv_mean"] for s in stats) / len(stats), tv_max=max(s["tv_max"] for s in stats))
        if "tv_bound" in stats[0]:
            rule = DecodingConfig.parse(method).rule
            methods[method].update(tv_budget_requested=rule.budget_delta,
                                   tv_bound=sum(s["tv_bound"] for s in stats) / len(stats),
                                   budget_binding=sum(s["budget_binding"] for s in stats) / len(stats))
    for row in methods.values():
        row["step_compression"] = methods["ar"]["nfe"] / row["nfe"]
    grid = _grid(rows, [methods[m]["decoder"].split(":")[0] for m in DEMO_METHODS], [CLASS_NAMES[c] for c in labels])
    grid_path = os.path.join(out_dir, "grid.png")
    grid.save(grid_path)
    sampling = pipe.decoding_config.sampling().to_dict()
    header = ["method", "nfe", "step x", *TIMING_HEADER, "budget", "TV mean", "TV max"]
    cells = []
    for m in DEMO_METHODS:
        r = methods[m]
        budget = f"{r['tv_budget_requested']:.3f}" if "tv_budget_requested" in r else "-"
        tv = [f"{r['tv_mean']:.4f}", f"{r['tv_max']:.4f}"] if "tv_mean" in r else ["exact", "exact"]
        cells.append([r["decoder"], f"{r['nfe']:.1f}", f"{r['step_compression']:.2f}", *timing_cells(r), budget, *tv])
    table = text_table(header, cells)
    report = {"model": "vispec/tiny-c2i", "classes": {c: CLASS_NAMES[c] for c in labels}, "sampling": sampling,
              "window": pipe.decoding_config.window, "methods": methods, "grid": grid_path, "load": note,
              "header": header, "rows": cells, "table": table}
    print("\n".join(table) + f"\n  ({note})")
    with open(os.path.join(out_dir, "report.md"), "w") as handle:
        handle.write("# vispec demo: tiny-c2i with AR, SJD, MC-SJD, SJD-PAC and budgeted MC-SJD\n\n")
        handle.write(f"Classes {', '.join(CLASS_NAMES[c] for c in labels)} at fixed seeds, batch 1, CPU; sampling {sampling}.\n\n")
        handle.write(C2I_TEXT + f" {TIMING_TEXT} ({note}).\n\n")
        handle.write("![grid](grid.png)\n\n```\n" + "\n".join(table) + "\n```\n")
    return report


C2I_TEXT = ("SJD, MC-SJD and SJD-PAC are exact: each image differs from AR's, the distribution does not. "
            "Budgeted MC-SJD is lossy within a budget: `budget` is the requested TV budget per verification, `TV mean` / "
            "`TV max` the measured distance of a verification's output from the exact target (never above the budget).")
TIMING_TEXT = ("Timings: the rows ran interleaved over the same items; seconds per item on the wall clock and on this "
               "process's CPU clock; speed-ups are medians over items of the first row's time over this row's, on each clock")


DEMO_T2I_PROMPTS = 12
#: Captions whose pictures the ``checks`` column judges: the first :data:`DEMO_T2I_PROMPTS` (timed, in the grid) and
#: the rest of the same stream decoded :data:`DEMO_T2I_CHECK_BATCH` at a time, untimed. With 12 pictures (~44 checks)
#: the binomial standard error is ~0.07, as large as the gaps the table would be read for; 60 pictures bring it to ~0.03.
DEMO_T2I_CHECKED = 60
DEMO_T2I_CHECK_BATCH = 16
DEMO_T2I_METHODS = ("ar", "mc-sjd", "sjd-pac")  # SJD runs in the class-to-image section
DEMO_T2I_SIZE = (64, 64)  # one size: the grid's columns are equal, with no gaps
DEMO_SEED = 10_000  # the scene and edit streams of the demo: the trainers draw from seeds 0 and 1


def run_t2i_demo(out_dir: str) -> dict:
    """Captions of trained compositions on new pictures (module docstring) on tiny-t2i with AR, MC-SJD and SJD-PAC, one
    image at a time at fixed seeds; writes ``t2i_grid.png`` and returns the report section."""
    from vispec.eval.bench.clip_score import clip_score, load_clip
    from vispec.eval.bench.scene_checks import check_images
    from vispec.eval.bench.scenes import SceneSampler
    from vispec.pipelines import UnifiedImagePipeline
    from vispec.pipelines.embedded import resolve_model_path

    pipe = UnifiedImagePipeline.from_pretrained("vispec/tiny-t2i")
    pipe.set_progress_bar_config(disable=True)
    clip = load_clip(os.path.join(resolve_model_path("vispec/tiny-t2i"), "clip"))
    checked_scenes = SceneSampler("train", seed=DEMO_SEED, sizes=(DEMO_T2I_SIZE,)).sample(
        max(DEMO_T2I_CHECKED, DEMO_T2I_PROMPTS)).scenes
    scenes = checked_scenes[:DEMO_T2I_PROMPTS]
    prompts = [scene.caption for scene in scenes]
    pipe(prompts[0], height=scenes[0].height, width=scenes[0].width, decoding="sjd")  # warm-up, not timed
    print(f"  {', '.join(DEMO_T2I_METHODS)}: {len(prompts)} prompts each, one at a time, interleaved ...", flush=True)
    load = os.getloadavg()[0]
    runs = interleaved(scenes, DEMO_T2I_METHODS, lambda method, i, scene: pipe(
        scene.caption, height=scene.height, width=scene.width, decoding=method, output_type="pt",
        generator=torch.Generator().manual_seed(2000 + i)))
    clocks, note = timing(runs, "ar"), load_note(load)
    more = checked_scenes[DEMO_T2I_PROMPTS:]
    if more:
        print(f"  checks: {len(more)} more pictures per decoder, {DEMO_T2I_CHECK_BATCH} at a time (not timed) ...",
              flush=True)
    rows, methods = [], {}
    for method in DEMO_T2I_METHODS:
        outs = runs[method]["results"]
        images = [out.images[0] * 2 - 1 for out in outs]
        stats = [s for out in outs for s in out.stats]
        rows.append([Image.fromarray(((x + 1) * 127.5).round().byte().permute(1, 2, 0).numpy()) for x in images])
        checked = check_images(images + _more_pictures(pipe, method, more, first=DEMO_T2I_PROMPTS),
                               [scene.caption for scene in checked_scenes])
        methods[method] = {
            "decoder": stats[0]["method"],
            "nfe": sum(s["nfe"] for s in stats) / len(stats),
            **checks_summary(checked),
            "accuracy": checked["accuracy"]["overall"],
            "accuracy_by_attribute": checked["accuracy"],
            "clip_score": clip_score(images, prompts, *clip),
            "clip_score_mismatched": clip_score(images, prompts[1:] + prompts[:1], *clip),
            **clocks[method],
        }
    for row in methods.values():
        row["step_compression"] = methods["ar"]["nfe"] / row["nfe"]
    grid_path = os.path.join(out_dir, "t2i_grid.png")
    _grid(rows, [methods[m]["decoder"].split(":")[0] for m in DEMO_T2I_METHODS], prompts, label_chars=20).save(grid_path)
    header = ["method", "nfe", "step x", *TIMING_HEADER, "checks", "strict", "CLIP", "CLIP mismatched"]
    cells = [[r["decoder"], f"{r['nfe']:.1f}", f"{r['step_compression']:.2f}", *timing_cells(r), checks_cell(r),
              f"{r['accuracy']:.3f}",
              f"{r['clip_score']:.2f}", f"{r['clip_score_mismatched']:.2f}"] for r in (methods[m] for m in DEMO_T2I_METHODS)]
    table = text_table(header, cells)
    print("\n".join(table) + f"\n  ({note})")
    return {"model": "vispec/tiny-t2i", "prompts": prompts, "sizes": [[s.height, s.width] for s in scenes],
            "checked_prompts": len(checked_scenes),
            "sampling": pipe.decoding_config.sampling().to_dict(), "methods": methods, "grid": grid_path, "load": note,
            "header": header, "rows": cells, "table": table}


def _more_pictures(pipe: Any, method: str, scenes: Sequence[Any], first: int) -> list[torch.Tensor]:
    """Pictures of ``scenes`` (all of one size) by ``method``, :data:`DEMO_T2I_CHECK_BATCH` at a time, scene ``i``
    with generator ``2000 + first + i`` (the timed run's seeds continued), in ``[-1, 1]``: the checks' extra sample."""
    images = []
    for at in range(0, len(scenes), DEMO_T2I_CHECK_BATCH):
        batch = scenes[at: at + DEMO_T2I_CHECK_BATCH]
        out = pipe([scene.caption for scene in batch], height=batch[0].height, width=batch[0].width, decoding=method,
                   output_type="pt", generator=[torch.Generator().manual_seed(2000 + first + at + k)
                                                for k in range(len(batch))])
        images.extend(image * 2 - 1 for image in out.images)
    return images


def _t2i_report_md(t2i: dict) -> str:
    lines = ["\n## Text-to-image: tiny-t2i on scene captions\n",
             f"{len(t2i['prompts'])} captions of compositions seen in training, on new pictures (a scene stream no trainer "
             "draws from), one image each at fixed seeds, batch 1, CPU; held-out compositions, never trained on, are "
             "measured apart with their own rate by `vispec bench image --model tiny-t2i`; "
             f"sampling {t2i['sampling']}. checks: the share of the scene checks passed (one judgement per image and "
             "attribute its caption asks for: colour, shape, count, position, size), ± its binomial standard error, "
             f"over {t2i.get('checked_prompts', len(t2i['prompts']))} pictures per decoder (the grid's and the next "
             "captions of the same stream, decoded in batches, untimed); strict: the share of those pictures "
             "passing every one of theirs; CLIP: tiny-t2i's CLIP score of the grid's pictures with the true captions and "
             "with mismatched ones (each image against the next prompt). MC-SJD and SJD-PAC are exact: their scores "
             "differ from AR's by sampling noise (`vispec bench image --model tiny-t2i` measures it). "
             f"{TIMING_TEXT} ({t2i['load']}).\n",
             "![text-to-image grid](t2i_grid.png)\n", "```", *t2i["table"], "```"]
    return "\n".join(lines) + "\n"


DEMO_EDIT_PAIRS = 6
DEMO_EDIT_METHODS = ("ar", "mc-sjd", "iad", "mc-sjd:init=source")


def run_edit_demo(out_dir: str) -> dict:
    """Scene edits on tiny-edit (train compositions, new pictures: module docstring): AR, MC-SJD, and the decoders that
    draft from the source (IAD, MC-SJD with source drafts), one request at a time at fixed seeds; writes ``edit_grid.png`` (rows: source, true target,
    then each decoder) and returns the report section."""
    from vispec.eval.bench.scene_checks import check_images
    from vispec.eval.bench.scene_edits import EditSampler
    from vispec.pipelines import UnifiedImagePipeline

    pipe = UnifiedImagePipeline.from_pretrained("vispec/tiny-edit")
    pipe.set_progress_bar_config(disable=True)
    pairs = EditSampler("train", seed=DEMO_SEED).sample(DEMO_EDIT_PAIRS)
    sources = [(p.source + 1) / 2 for p in pairs]
    captions = [p.target_caption for p in pairs]
    pipe(pairs[0].instruction, image=sources[0], decoding="sjd", output_type="latent")  # warm-up, not timed
    to_pil = lambda x: Image.fromarray(((x + 1) * 127.5).round().clamp(0, 255).byte().permute(1, 2, 0).numpy())  # noqa: E731
    rows = [[to_pil(p.source) for p in pairs], [to_pil(p.target) for p in pairs]]
    print(f"  {', '.join(DEMO_EDIT_METHODS)}: {len(pairs)} edits each, one at a time, interleaved ...", flush=True)
    load = os.getloadavg()[0]
    runs = interleaved(list(zip(pairs, sources)), DEMO_EDIT_METHODS, lambda method, i, job: pipe(
        job[0].instruction, image=job[1], decoding=method, output_type="pt", generator=torch.Generator().manual_seed(3000 + i)))
    clocks, note = timing(runs, "ar"), load_note(load)
    methods = {}
    for method in DEMO_EDIT_METHODS:
        outs = runs[method]["results"]
        images = [out.images[0] * 2 - 1 for out in outs]
        stats = [s for out in outs for s in out.stats]
        rows.append([to_pil(x) for x in images])
        checked = check_images(images, captions)
        methods[method] = {"decoder": stats[0]["method"], "nfe": sum(s["nfe"] for s in stats) / len(stats),
                           "source_kept": sum(s["source_kept"] for s in stats) / len(stats),
                           **checks_summary(checked), "accuracy": checked["accuracy"]["overall"], **clocks[method]}
    for row in methods.values():
        row["step_compression"] = methods["ar"]["nfe"] / row["nfe"]
    grid_path = os.path.join(out_dir, "edit_grid.png")
    names = ["source", "true edit"] + [methods[m]["decoder"].split(":guidance")[0] for m in DEMO_EDIT_METHODS]
    _grid(rows, names, [p.instruction for p in pairs], label_chars=20).save(grid_path)
    header = ["method", "nfe", "step x", *TIMING_HEADER, "checks", "strict", "kept"]
    cells = [[r["decoder"], f"{r['nfe']:.1f}", f"{r['step_compression']:.2f}", *timing_cells(r), checks_cell(r),
              f"{r['accuracy']:.3f}",
              f"{r['source_kept']:.1%}"] for r in (methods[m] for m in DEMO_EDIT_METHODS)]
    table = text_table(header, cells)
    print("\n".join(table) + f"\n  ({note})")
    return {"model": "vispec/tiny-edit", "instructions": [p.instruction for p in pairs], "target_captions": captions,
            "sampling": pipe.decoding_config.sampling().to_dict(), "methods": methods, "grid": grid_path, "load": note,
            "header": header, "rows": cells, "table": table}


def _edit_report_md(edit: dict) -> str:
    lines = ["\n## Image-to-image: tiny-edit on scene edits\n",
             f"{len(edit['instructions'])} edits of trained compositions on new pictures (instruction and source picture), "
             "one at a time at fixed seeds, "
             f"batch 1, CPU; sampling {edit['sampling']}. checks: the share of the scene checks of the target caption "
             "passed (the edit and what must stay, one judgement per picture and attribute asked), ± its binomial standard "
             "error; strict: the share of "
             "edited pictures passing every one of theirs; kept: the share of output codes "
             "equal to the source's. IAD drafts each position from the source's code there (input-guided aggressive "
             f"decoding); every decoder here is exact. {TIMING_TEXT} ({edit['load']}).\n",
             "![image-to-image grid](edit_grid.png)\n", "```", *edit["table"], "```"]
    return "\n".join(lines) + "\n"


DEMO_TEXT_PROBLEMS = 6
DEMO_LONG_PROBLEMS = 1  # per task: LLaDA's baseline spends 256 forwards on each


def _text_settings(long: bool) -> dict:
    """Demo settings: name -> (strategy or scheduler, cache, early stop at EOS, extra pipeline options). The first is
    LLaDA's baseline (one token per step, no cache, no early stop), the reference of the speed-ups."""
    from vispec.dllm import LLaDAScheduler, ThresholdScheduler

    settings = {"llada, 1 token/step (LLaDA's baseline)": (LLaDAScheduler(), "none", False, {})}
    if long:
        settings["learn2pd + EoTP + DualCache"] = ("learn2pd", "dual", False, {"eotp": True})
    else:
        settings["threshold 0.9 + DualCache + EOS stop"] = (ThresholdScheduler(threshold=0.9), "dual", True, {})
    return settings


def run_text_demo(model: str = "vispec/tiny-mdlm", tasks: tuple[str, ...] = ("arithmetic",),
                  problems: int = DEMO_TEXT_PROBLEMS) -> dict:
    """A few test-split problems per task solved by LLaDA's baseline (1 token per step, no cache, no early stop) and
    by a fast setting: tiny-mdlm, the threshold rule with DualCache (Fast-dLLM) and early stop at EOS; tiny-mdlm-long
    (gen length 256), Learn2PD with end-of-text prediction and DualCache. NFE, latency, accuracy, speed-ups."""
    from vispec.eval.bench.text_tasks import get_task, split_items
    from vispec.pipelines import MaskedDiffusionLMPipeline

    pipe = MaskedDiffusionLMPipeline.from_pretrained(model)
    pipe.set_progress_bar_config(disable=True)
    work = [(get_task(name), item) for name in tasks for item in split_items(name, "test", problems, seed=0)]
    settings = _text_settings(long=pipe.filter is not None)
    pipe(prompt=work[0][1].prompt, strategy="threshold")  # warm-up, not timed
    names = list(settings)
    print(f"  {' | '.join(names)}: {len(work)} problems each, one at a time, interleaved ...", flush=True)
    load = os.getloadavg()[0]

    def solve(name: str, i: int, job: tuple) -> Any:
        scheduler, cache, early_stop, options = settings[name]
        return pipe(prompt=job[1].prompt, strategy=scheduler, cache=cache, early_stop_eos=early_stop, **options)

    runs = interleaved(work, names, solve)
    clocks, note = timing(runs, names[0]), load_note(load)
    rows, examples = {}, []
    for name in names:
        outs = runs[name]["results"]
        correct = sum(task.score(out.texts[0], item)[task.metrics[0]] for out, (task, item) in zip(outs, work))
        if settings[name][1] == "dual":
            examples += [{"prompt": item.prompt, "answer": out.texts[0], "reference": item.answer}
                         for out, (task, item) in zip(outs, work)]
        rows[name] = {"nfe": sum(out.stats[0]["nfe"] for out in outs) / len(work), "accuracy": correct / len(work),
                      **clocks[name]}
    base = rows[names[0]]
    for row in rows.values():
        row["nfe_reduction"] = base["nfe"] / row["nfe"]
    header = ["setting", "accuracy", "nfe", "NFE x", *TIMING_HEADER]
    cells = [[name, f"{r['accuracy']:.3f}", f"{r['nfe']:.1f}", f"{r['nfe_reduction']:.2f}", *timing_cells(r)]
             for name, r in rows.items()]
    table = text_table(header, cells)
    print("\n".join(table) + f"\n  ({note})")
    return {"model": model, "tasks": list(tasks), "gen_length": pipe.config.default_gen_length,
            "block_length": pipe.config.default_block_length, "settings": rows, "examples": examples, "load": note,
            "header": header, "rows": cells, "table": table}


def run_random_model_demo() -> dict:
    print("  (tiny-c2i is not installed in this checkout: comparing decoders on a random-init GPT-mini;")
    print("   its step compression shows the machinery works, not what a trained model gets)")
    result = run_decoder_bench(RANDOM_CONFIG, progress=lambda msg: print("  " + msg, flush=True))
    print(format_table(result))
    return result


def _text_report_md(text: dict) -> str:
    lines = [f"\n## Masked diffusion LM: {text['model']} on {', '.join(text['tasks'])}\n",
             f"Test-split problems, batch 1, CPU, temperature 0, gen length {text['gen_length']}, block {text['block_length']}; "
             f"accuracy is strict-match for arithmetic, exact match otherwise. {TIMING_TEXT} ({text['load']}).\n",
             "```", *text["table"], "```", "", "Answers of the fast setting:", ""]
    for ex in text["examples"]:
        lines.append(f"- `{ex['prompt']}` -> `{ex['answer']}` (reference `{ex['reference']}`)")
    return "\n".join(lines) + "\n"


SECTIONS = (  # report key, title, grid file
    ("c2i", "Class-to-image: tiny-c2i", "grid.png"),
    ("t2i", "Text-to-image: tiny-t2i on held-out scene captions", "t2i_grid.png"),
    ("edit", "Image-to-image: tiny-edit on held-out scene edits", "edit_grid.png"),
    ("text", "Masked diffusion LM: tiny-mdlm", None),
    ("text_long", "Masked diffusion LM at gen length 256: tiny-mdlm-long", None),
)


def write_index(out_dir: str, sections: dict[str, dict]) -> str:
    """``index.html``: each section's table and grid on one page. A script marks on ``<body>`` how many images loaded
    (``data-images-loaded="ok/all"``) and how many tables have rows (``data-tables``), so a headless browser can check
    the page as a reader sees it."""
    parts = ["<!doctype html><html><head><meta charset='utf-8'><title>vispec demo</title><style>"
             "body{font-family:sans-serif;margin:2em;max-width:1400px} table{border-collapse:collapse;margin:1em 0}"
             "td,th{border:1px solid #ccc;padding:3px 8px;text-align:right} td:first-child,th:first-child{text-align:left}"
             "img{max-width:100%;image-rendering:pixelated}</style></head><body>",
             "<h1>vispec demo</h1>", f"<p>{html.escape(TIMING_TEXT)}.</p>"]
    for key, title, grid in SECTIONS:
        if key not in sections:
            continue
        section = sections[key]
        parts.append(f"<h2>{html.escape(title)}</h2><p>{html.escape(section.get('load', ''))}</p><table><thead><tr>")
        parts.append("".join(f"<th>{html.escape(str(cell))}</th>" for cell in section["header"]) + "</tr></thead><tbody>")
        for row in section["rows"]:
            parts.append("<tr>" + "".join(f"<td>{html.escape(str(cell))}</td>" for cell in row) + "</tr>")
        parts.append("</tbody></table>")
        if grid:
            parts.append(f"<img src='{grid}' alt='{html.escape(title)}'>")
    parts.append("<script>window.addEventListener('load',function(){var im=document.images,ok=0;"
                 "for(var i=0;i<im.length;i++){if(im[i].complete&&im[i].naturalWidth>0)ok++;}"
                 "document.body.dataset.imagesLoaded=ok+'/'+im.length;"
                 "document.body.dataset.tables=document.querySelectorAll('table tbody tr:first-child').length;});</script>")
    parts.append("</body></html>")
    path = os.path.join(out_dir, "index.html")
    with open(path, "w") as handle:
        handle.write("\n".join(parts) + "\n")
    return path


def run_demo(out_dir: str = "out/demo") -> dict:
    from vispec.pipelines.embedded import resolve_model_path

    def installed(name: str) -> bool:
        try:
            resolve_model_path(name)
            return True
        except ValueError:
            return False

    os.makedirs(out_dir, exist_ok=True)
    start = time.perf_counter()
    embedded = installed("vispec/tiny-c2i")
    print("vispec demo: AR vs SJD vs MC-SJD vs SJD-PAC" + (" on tiny-c2i" if embedded else ""), flush=True)
    report = run_tiny_c2i_demo(out_dir) if embedded else run_random_model_demo()
    if not embedded:
        with open(os.path.join(out_dir, "report.md"), "w") as handle:
            handle.write("# vispec demo: decoders on a random-init GPT-mini\n\n```\n" + format_table(report) + "\n```\n")
    if installed("vispec/tiny-t2i"):
        print("vispec demo: text-to-image on tiny-t2i, AR vs MC-SJD vs SJD-PAC", flush=True)
        report["t2i"] = run_t2i_demo(out_dir)
        with open(os.path.join(out_dir, "report.md"), "a") as handle:
            handle.write(_t2i_report_md(report["t2i"]))
    if installed("vispec/tiny-edit"):
        print("vispec demo: image-to-image on tiny-edit, AR and MC-SJD vs drafts copied from the source (IAD)", flush=True)
        report["edit"] = run_edit_demo(out_dir)
        with open(os.path.join(out_dir, "report.md"), "a") as handle:
            handle.write(_edit_report_md(report["edit"]))
    if installed("vispec/tiny-mdlm"):
        print("vispec demo: masked diffusion LM on tiny-mdlm, LLaDA baseline vs threshold + DualCache", flush=True)
        report["text"] = run_text_demo()
        with open(os.path.join(out_dir, "report.md"), "a") as handle:
            handle.write(_text_report_md(report["text"]))
    if installed("vispec/tiny-mdlm-long"):
        print("vispec demo: masked diffusion LM at gen length 256 on tiny-mdlm-long, LLaDA baseline vs Learn2PD + EoTP",
              flush=True)
        report["text_long"] = run_text_demo("vispec/tiny-mdlm-long", ("arithmetic", "sort", "reverse"), DEMO_LONG_PROBLEMS)
        with open(os.path.join(out_dir, "report.md"), "a") as handle:
            handle.write(_text_report_md(report["text_long"]))
    report["wall_s"] = time.perf_counter() - start
    with open(os.path.join(out_dir, "report.json"), "w") as handle:
        json.dump(report, handle, indent=2)
    sections = {key: report[key] for key in ("t2i", "edit", "text", "text_long") if key in report}
    if embedded:
        sections["c2i"] = report
    page = write_index(out_dir, sections)
    print(f"report: {out_dir}/report.md, {out_dir}/report.json" + (f", {out_dir}/grid.png" if embedded else ""))
    print(f"page: file://{os.path.abspath(page)} ({report['wall_s']:.0f} s)")
    return report
