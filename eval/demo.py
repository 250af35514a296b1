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

With the embedded ``tiny-t2i`` installed, a text-to-image section follows: held-out scene captions (compositions
never trained on) decoded by AR, SJD and MC-SJD, a grid (rows: decoders, columns: prompts), and per decoder
the prompt-following accuracy of the scene checks, the CLIP score with tiny-t2i's CLIP (beside the score
of the same images with mismatched captions), NFE, step compression and latency.

With the embedded ``tiny-edit`` installed, an image-to-image section follows: held-out scene edits decoded by AR,
MC-SJD, IAD (drafts copied from the source picture) and MC-SJD with source drafts, a grid and a table.

With the embedded ``tiny-mdlm`` installed, a text section follows: a few arithmetic word problems
solved by LLaDA's one-token-per-step baseline and by the threshold rule with DualCache (Fast-dLLM),
with accuracy, NFE, latency and the speed-up.
"""

from __future__ import annotations

import json
import os
import textwrap
import time

import torch
from PIL import Image, ImageDraw

from vispec.decoding import DecodingConfig
from vispec.eval.bench.decoders import ALL_METHODS, DecoderBenchConfig, format_table, run_decoder_bench

DEMO_CLASSES = (0, 3, 4, 8, 12, 13)
DEMO_LOSSY = "mc-sjd+budget:delta=0.3,decay=0.9,ratio=2.5"  # 4.09 tokens per pass, FID within AR noise (README)
DEMO_METHODS = ("ar", "sjd", "mc-sjd", "sjd-pac", DEMO_LOSSY)  # the last one is lossy within a budget (TV in the report)
RANDOM_CONFIG = DecoderBenchConfig(
    model="GPT-mini", vocab_size=1024, image_tokens=256, num_classes=10, init_std=0.02,
    methods=ALL_METHODS, window=16, num_images=2, batch_size=1, guidance_scale=2.0, seed=0,
)


def _grid(rows: list[list[Image.Image]], row_names: list[str], col_names: list[str], scale: int = 2,
          label_chars: int = 14) -> Image.Image:
    """Images in labelled rows and columns; each cell is as wide and tall as the largest image (scaled), an image
    sits at its own aspect ratio in the cell's top-left corner. Column names wrap at ``label_chars`` characters."""
    cell_w = max(image.size[0] for images in rows for image in images) * scale
    cell_h = max(image.size[1] for images in rows for image in images) * scale
    wrapped = [textwrap.wrap(name, label_chars) or [""] for name in col_names]
    left, top = 150, 8 + 12 * max(len(lines) for lines in wrapped)
    canvas = Image.new("RGB", (left + cell_w * len(col_names), top + cell_h * len(rows)), "white")
    draw = ImageDraw.Draw(canvas)
    for j, lines in enumerate(wrapped):
        for k, line in enumerate(lines):
            draw.text((left + j * cell_w + 4, 4 + 12 * k), line, fill="black")
    for i, (images, name) in enumerate(zip(rows, row_names)):
        draw.text((5, top + i * cell_h + cell_h // 2 - 6), name, fill="black")
        for j, image in enumerate(images):
            w, h = image.size
            canvas.paste(image.resize((w * scale, h * scale), Image.NEAREST), (left + j * cell_w, top + i * cell_h))
    return canvas


def run_tiny_c2i_demo(out_dir: str) -> dict:
    from vispec.eval.bench.data import CLASS_NAMES
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
        if "tv_mean" in stats[0]:
            methods[method].update(tv_mean=sum(s["tv_mean"] for s in stats) / len(stats), tv_max=max(s["tv_max"] for s in stats))
        if "tv_bound" in stats[0]:
            rule = DecodingConfig.parse(method).rule
            methods[method].update(tv_budget_requested=rule.budget_delta,
                                   tv_bound=sum(s["tv_bound"] for s in stats) / len(stats),
                                   budget_binding=sum(s["budget_binding"] for s in stats) / len(stats))
    for row in methods.values():
        row["step_compression"] = methods["ar"]["nfe"] / row["nfe"]
        row["speedup"] = methods["ar"]["latency_s"] / row["latency_s"]
    grid = _grid(rows, [methods[m]["decoder"].split(":")[0] for m in DEMO_METHODS], [CLASS_NAMES[c] for c in labels])
    grid_path = os.path.join(out_dir, "grid.png")
    grid.save(grid_path)
    sampling = pipe.decoding_config.sampling().to_dict()
    width = max(len("method"), *(len(methods[m]["decoder"]) for m in DEMO_METHODS))
    table = [f"{'method':<{width}} {'nfe':>7} {'step x':>7} {'latency s':>10} {'speedup':>8} {'budget':>7} {'TV mean':>8} {'TV max':>7}"]
    for m in DEMO_METHODS:
        r = methods[m]
        budget = f"{r['tv_budget_requested']:>7.3f}" if "tv_budget_requested" in r else f"{'-':>7}"
        tv = f"{r['tv_mean']:>8.4f} {r['tv_max']:>7.4f}" if "tv_mean" in r else f"{'exact':>8} {'exact':>7}"
        table.append(f"{r['decoder']:<{width}} {r['nfe']:>7.1f} {r['step_compression']:>7.2f} {r['latency_s']:>10.3f} "
                     f"{r['speedup']:>8.2f} {budget} {tv}")
    report = {"model": "vispec/tiny-c2i", "classes": {c: CLASS_NAMES[c] for c in labels}, "sampling": sampling,
              "window": pipe.decoding_config.window, "methods": methods, "grid": grid_path}
    print("\n".join(table))
    with open(os.path.join(out_dir, "report.md"), "w") as handle:
        handle.write("# vispec demo: tiny-c2i with AR, SJD, MC-SJD, SJD-PAC and budgeted MC-SJD\n\n")
        handle.write(f"Classes {', '.join(CLASS_NAMES[c] for c in labels)} at fixed seeds, batch 1, CPU; sampling {sampling}.\n\n")
        handle.write("SJD and MC-SJD are exact: each image differs from AR's, the distribution does not. "
                     "Budgeted MC-SJD is lossy within a budget: `budget` is the requested TV budget per verification, `TV mean` / "
                     "`TV max` the measured distance of a verification's output from the exact target (never above the budget).\n\n")
        handle.write("![grid](grid.png)\n\n```\n" + "\n".join(table) + "\n```\n")
    return report


DEMO_T2I_PROMPTS = 8
DEMO_T2I_METHODS = ("ar", "sjd", "mc-sjd", "sjd-pac")


def run_t2i_demo(out_dir: str) -> dict:
    """Held-out captions on tiny-t2i with AR, SJD and MC-SJD, one image at a time at fixed seeds (module docstring);
    writes ``t2i_grid.png`` and returns the report section."""
    from vispec.eval.bench.clip_score import clip_score, load_clip
    from vispec.eval.bench.scene_checks import check_images
    from vispec.eval.bench.scenes import SceneSampler
    from vispec.pipelines import UnifiedImagePipeline
    from vispec.pipelines.embedded import resolve_model_path

    pipe = UnifiedImagePipeline.from_pretrained("vispec/tiny-t2i")
    pipe.set_progress_bar_config(disable=True)
    clip = load_clip(os.path.join(resolve_model_path("vispec/tiny-t2i"), "clip"))
    scenes = SceneSampler("test", seed=0).sample(DEMO_T2I_PROMPTS).scenes
    prompts = [scene.caption for scene in scenes]
    pipe(prompts[0], height=scenes[0].height, width=scenes[0].width, decoding="sjd")  # warm-up, not timed
    rows, methods = [], {}
    for method in DEMO_T2I_METHODS:
        print(f"  {method}: {len(prompts)} prompts, one at a time ...", flush=True)
        images, stats = [], []
        for i, scene in enumerate(scenes):
            out = pipe(scene.caption, height=scene.height, width=scene.width, decoding=method, output_type="pt",
                       generator=torch.Generator().manual_seed(2000 + i))
            images.append(out.images[0] * 2 - 1)
            stats += out.stats
        rows.append([Image.fromarray(((x + 1) * 127.5).round().byte().permute(1, 2, 0).numpy()) for x in images])
        accuracy = check_images(images, prompts)["accuracy"]
        methods[method] = {
            "decoder": stats[0]["method"],
            "nfe": sum(s["nfe"] for s in stats) / len(stats),
            "latency_s": sum(s["latency_s"] for s in stats) / len(stats),
            "accuracy": accuracy["overall"],
            "accuracy_by_attribute": accuracy,
            "clip_score": clip_score(images, prompts, *clip),
            "clip_score_mismatched": clip_score(images, prompts[1:] + prompts[:1], *clip),
        }
    for row in methods.values():
        row["step_compression"] = methods["ar"]["nfe"] / row["nfe"]
        row["speedup"] = methods["ar"]["latency_s"] / row["latency_s"]
    grid_path = os.path.join(out_dir, "t2i_grid.png")
    _grid(rows, [methods[m]["decoder"].split(":")[0] for m in DEMO_T2I_METHODS], prompts, label_chars=20).save(grid_path)
    width = max(len("method"), *(len(methods[m]["decoder"]) for m in DEMO_T2I_METHODS))
    table = [f"{'method':<{width}} {'nfe':>7} {'step x':>7} {'latency s':>10} {'speedup':>8} {'checks':>7} "
             f"{'CLIP':>6} {'CLIP mismatched':>16}"]
    for m in DEMO_T2I_METHODS:
        r = methods[m]
        table.append(f"{r['decoder']:<{width}} {r['nfe']:>7.1f} {r['step_compression']:>7.2f} {r['latency_s']:>10.3f} "
                     f"{r['speedup']:>8.2f} {r['accuracy']:>7.3f} {r['clip_score']:>6.2f} {r['clip_score_mismatched']:>16.2f}")
    print("\n".join(table))
    return {"model": "vispec/tiny-t2i", "prompts": prompts, "sizes": [[s.height, s.width] for s in scenes],
            "sampling": pipe.decoding_config.sampling().to_dict(), "methods": methods, "grid": grid_path, "table": table}


def _t2i_report_md(t2i: dict) -> str:
    lines = ["\n## Text-to-image: tiny-t2i on held-out scene captions\n",
             f"{len(t2i['prompts'])} captions of compositions never trained on, one image each at fixed seeds, batch 1, CPU; "
             f"sampling {t2i['sampling']}. checks: the fraction of images whose every asked attribute (colour, shape, count, "
             "position, size) the scene checks find; CLIP: tiny-t2i's CLIP score with the true captions and with "
             "mismatched ones (each image against the next prompt). SJD and MC-SJD are exact: on so few images their "
             "scores differ from AR's by sampling noise (`vispec bench image --model tiny-t2i` measures it).\n",
             "![text-to-image grid](t2i_grid.png)\n", "```", *t2i["table"], "```"]
    return "\n".join(lines) + "\n"


DEMO_EDIT_PAIRS = 6
DEMO_EDIT_METHODS = ("ar", "mc-sjd", "iad", "mc-sjd:init=source")


def run_edit_demo(out_dir: str) -> dict:
    """Held-out scene edits on tiny-edit: AR, MC-SJD, and the decoders that draft from the source (IAD, MC-SJD with
    source drafts), one request at a time at fixed seeds; writes ``edit_grid.png`` (rows: source, true target,
    then each decoder) and returns the report section."""
    from vispec.eval.bench.scene_checks import check_images
    from vispec.eval.bench.scene_edits import EditSampler
    from vispec.pipelines import UnifiedImagePipeline

    pipe = UnifiedImagePipeline.from_pretrained("vispec/tiny-edit")
    pipe.set_progress_bar_config(disable=True)
    pairs = EditSampler("test", seed=0).sample(DEMO_EDIT_PAIRS)
    sources = [(p.source + 1) / 2 for p in pairs]
    captions = [p.target_caption for p in pairs]
    pipe(pairs[0].instruction, image=sources[0], decoding="sjd", output_type="latent")  # warm-up, not timed
    to_pil = lambda x: Image.fromarray(((x + 1) * 127.5).round().clamp(0, 255).byte().permute(1, 2, 0).numpy())  # noqa: E731
    rows = [[to_pil(p.source) for p in pairs], [to_pil(p.target) for p in pairs]]
    methods = {}
    for method in DEMO_EDIT_METHODS:
        print(f"  {method}: {len(pairs)} edits, one at a time ...", flush=True)
        images, stats = [], []
        for i, (pair, source) in enumerate(zip(pairs, sources)):
            out = pipe(pair.instruction, image=source, decoding=method, output_type="pt",
                       generator=torch.Generator().manual_seed(3000 + i))
            images.append(out.images[0] * 2 - 1)
            stats += out.stats
        rows.append([to_pil(x) for x in images])
        methods[method] = {"decoder": stats[0]["method"], "nfe": sum(s["nfe"] for s in stats) / len(stats),
                           "latency_s": sum(s["latency_s"] for s in stats) / len(stats),
                           "source_kept": sum(s["source_kept"] for s in stats) / len(stats),
                           "accuracy": check_images(images, captions)["accuracy"]["overall"]}
    for row in methods.values():
        row["step_compression"] = methods["ar"]["nfe"] / row["nfe"]
        row["speedup"] = methods["ar"]["latency_s"] / row["latency_s"]
    grid_path = os.path.join(out_dir, "edit_grid.png")
    names = ["source", "true edit"] + [methods[m]["decoder"].split(":guidance")[0] for m in DEMO_EDIT_METHODS]
    _grid(rows, names, [p.instruction for p in pairs], label_chars=20).save(grid_path)
    width = max(len("method"), *(len(methods[m]["decoder"]) for m in DEMO_EDIT_METHODS))
    table = [f"{'method':<{width}} {'nfe':>7} {'step x':>7} {'latency s':>10} {'speedup':>8} {'checks':>7} {'kept':>6}"]
    for m in DEMO_EDIT_METHODS:
        r = methods[m]
        table.append(f"{r['decoder']:<{width}} {r['nfe']:>7.1f} {r['step_compression']:>7.2f} {r['latency_s']:>10.3f} "
                     f"{r['speedup']:>8.2f} {r['accuracy']:>7.3f} {r['source_kept']:>6.1%}")
    print("\n".join(table))
    return {"model": "vispec/tiny-edit", "instructions": [p.instruction for p in pairs], "target_captions": captions,
            "sampling": pipe.decoding_config.sampling().to_dict(), "methods": methods, "grid": grid_path, "table": table}


def _edit_report_md(edit: dict) -> str:
    lines = ["\n## Image-to-image: tiny-edit on held-out scene edits\n",
             f"{len(edit['instructions'])} held-out edits (instruction and source picture), one at a time at fixed seeds, "
             f"batch 1, CPU; sampling {edit['sampling']}. checks: the fraction of edited pictures whose every attribute of "
             "the target caption the scene checks find (the edit and what must stay); kept: the share of output codes "
             "equal to the source's. IAD drafts each position from the source's code there (input-guided aggressive "
             "decoding); every decoder here is exact.\n",
             "![image-to-image grid](edit_grid.png)\n", "```", *edit["table"], "```"]
    return "\n".join(lines) + "\n"


DEMO_TEXT_PROBLEMS = 6
DEMO_LONG_PROBLEMS = 2  # per task: LLaDA's baseline spends 256 forwards on each


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
    rows, examples = {}, []
    for name, (scheduler, cache, early_stop, options) in settings.items():
        print(f"  {name}: {len(work)} problems, one at a time ...", flush=True)
        nfe = correct = 0
        start = time.perf_counter()
        for task, item in work:
            out = pipe(prompt=item.prompt, strategy=scheduler, cache=cache, early_stop_eos=early_stop, **options)
            nfe += out.stats[0]["nfe"]
            correct += task.score(out.texts[0], item)[task.metrics[0]]
            if cache == "dual":
                examples.append({"prompt": item.prompt, "answer": out.texts[0], "reference": item.answer})
        wall = time.perf_counter() - start
        rows[name] = {"nfe": nfe / len(work), "latency_s": wall / len(work), "accuracy": correct / len(work)}
    base = rows[next(iter(rows))]
    for row in rows.values():
        row["nfe_reduction"] = base["nfe"] / row["nfe"]
        row["speedup"] = base["latency_s"] / row["latency_s"]
    table = [f"{'setting':<40} {'accuracy':>8} {'nfe':>7} {'NFE x':>6} {'latency s':>10} {'speedup':>8}"]
    for name, r in rows.items():
        table.append(f"{name:<40} {r['accuracy']:>8.3f} {r['nfe']:>7.1f} {r['nfe_reduction']:>6.2f} {r['latency_s']:>10.3f} {r['speedup']:>8.2f}")
    print("\n".join(table))
    return {"model": model, "tasks": list(tasks), "gen_length": pipe.config.default_gen_length,
            "block_length": pipe.config.default_block_length, "settings": rows, "examples": examples, "table": table}


def run_random_model_demo() -> dict:
    print("  (tiny-c2i is not installed in this checkout: comparing decoders on a random-init GPT-mini;")
    print("   its step compression shows the machinery works, not what a trained model gets)")
    result = run_decoder_bench(RANDOM_CONFIG, progress=lambda msg: print("  " + msg, flush=True))
    print(format_table(result))
    return result


def _text_report_md(text: dict) -> str:
    lines = [f"\n## Masked diffusion LM: {text['model']} on {', '.join(text['tasks'])}\n",
             f"Test-split problems, batch 1, CPU, temperature 0, gen length {text['gen_length']}, block {text['block_length']}; "
             "accuracy is strict-match for arithmetic, exact match otherwise.\n",
             "```", *text["table"], "```", "", "Answers of the fast setting:", ""]
    for ex in text["examples"]:
        lines.append(f"- `{ex['prompt']}` -> `{ex['answer']}` (reference `{ex['reference']}`)")
    return "\n".join(lines) + "\n"


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
        print("vispec demo: text-to-image on tiny-t2i, AR vs SJD vs MC-SJD vs SJD-PAC", flush=True)
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
    print(f"report: {out_dir}/report.md, {out_dir}/report.json" + (f", {out_dir}/grid.png" if embedded else ""))
    return report
