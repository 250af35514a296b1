"""``vispec bench image``: speed and quality of AR, SJD and MC-SJD on a LlamaGen pipeline (tiny-c2i by default).

Per method:

* speed at batch 1 (``latency_images`` images, one at a time): NFE, step compression against AR,
  latency per image, speed-up;
* speed and quality at ``batch_size``: images per second and mean per-image latency inside the
  batch, evaluator top-1 accuracy on the generated images (class adherence), and FID against
  held-out real crops, with the evaluator's penultimate features (torchmetrics
  ``FrechetInceptionDistance(feature=...)``; only comparable within this benchmark);
* peak memory (RSS on CPU, max allocated on CUDA).

Sampling noise: SJD and MC-SJD are exact, so their quality must match AR up to sampling noise. AR is
repeated ``noise_repeats`` more times with disjoint seeds (rows ``ar-reseed-k``); ``noise`` holds the
mean and standard deviation of FID and accuracy over the ``1 + noise_repeats`` AR runs and the
half-width of the 95% prediction interval for one further run at the same settings,
``t_{0.975, R} * sd * sqrt(1 + 1 / (R + 1))`` with ``R + 1`` AR runs. Each method's row gets its
distance from the AR mean in standard deviations (``fid_z``, ``accuracy_z``) and whether it lies
inside that interval (``fid_within_noise``, ``accuracy_within_noise``): the yardstick for
differences between methods. ``real`` reports the evaluator on held-out crops and the FID between
two disjoint sets of held-out crops (the floor).

Method labels follow :meth:`vispec.decoding.DecodingConfig.parse`; ``:window=N`` compares windows
(e.g. ``sjd:window=4``). A label may end in ``+rule`` for a lossy acceptance rule
(``mc-sjd+lantern:k=100,delta=0.1``, ``sd+lantern``; ``gsd`` is short for ``sjd+gsd``). A
``+lantern`` without options is swept over ``lantern_k x lantern_delta``. Lossy rows also report
the measured total-variation distance of a verification's output from the exact target (mean over
images of the per-image mean, and the max), and :func:`speed_fid_plot` draws step compression
against FID for every row (the speed/quality curve).
"""

from __future__ import annotations

import copy
import math
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional

import torch

from vispec.decoding import AcceptanceConfig, DecodingConfig
from vispec.eval.bench.memory import PeakMemory
from vispec.eval.bench.report import environment

SEED_STRIDE = 1_000_003
# AR re-seed k uses seeds + k * RESEED_OFFSET. torch's CPU generator keeps only the low 32 bits of a seed, so
# the offset must change them: k * RESEED_OFFSET < 2**32 for k <= 40, far from the benchmark seeds.
RESEED_OFFSET = 100_000_007
# two-sided 95% Student t quantiles t_{0.975, df}, df = 1..10 (beyond: the normal 1.96 is within 10%)
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228)


@dataclass
class ImageBenchConfig:
    model: str = "tiny-c2i"
    methods: tuple[str, ...] = ("ar", "sjd", "mc-sjd")
    num_images: int = 1000
    batch_size: int = 32
    latency_images: int = 16
    real_images: int = 1000
    noise_repeats: int = 3
    seed: int = 0
    guidance_scale: Optional[float] = None
    temperature: Optional[float] = None
    top_k: Optional[int] = None
    top_p: Optional[float] = None
    evaluator: Optional[str] = None  # defaults to the model folder's "evaluator" subfolder
    device: str = "cpu"
    lantern_k: tuple[int, ...] = (1000,)
    lantern_delta: tuple[float, ...] = (0.1,)
    extra: dict = field(default_factory=dict)


def expand_methods(methods: tuple[str, ...], lantern_k: tuple[int, ...], lantern_delta: tuple[float, ...]) -> list[str]:
    """Canonical specs (:attr:`DecodingConfig.name`), with every ``+lantern`` at its default settings swept
    over ``lantern_k x lantern_delta``."""
    out: list[str] = []
    for method in methods:
        config = DecodingConfig.parse(method)
        if config.rule == AcceptanceConfig(rule="lantern"):
            out += [DecodingConfig.parse(config, acceptance=f"lantern:k={k},delta={d}").name for k in lantern_k for d in lantern_delta]
        else:
            out.append(config.name)
    return list(dict.fromkeys(out))


def generate_uint8(pipe, method: str, labels: torch.Tensor, seeds: list[int], batch_size: int, cfg: ImageBenchConfig):
    """uint8 images, per-image stats, wall time."""
    from vispec.models.llamagen_vq import decode_tokens, to_uint8

    images, stats = [], []
    start = time.perf_counter()
    for lo in range(0, len(seeds), batch_size):
        hi = min(lo + batch_size, len(seeds))
        out = pipe(class_labels=labels[lo:hi], decoding=method, generator=[torch.Generator().manual_seed(s) for s in seeds[lo:hi]],
                   guidance_scale=cfg.guidance_scale, temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p,
                   output_type="latent")
        with torch.no_grad():
            images.append(to_uint8(decode_tokens(pipe.vqvae, out.images.to(pipe.device)).float()).cpu())
        stats += out.stats
    return torch.cat(images), stats, time.perf_counter() - start


def fid_score(evaluator, real: torch.Tensor, fake: torch.Tensor) -> float:
    from torchmetrics.image.fid import FrechetInceptionDistance

    from vispec.eval.bench.evaluator import FIDFeatures

    metric = FrechetInceptionDistance(feature=FIDFeatures(copy.deepcopy(evaluator)))
    metric.set_dtype(torch.float64)  # casts the (copied) feature module too
    for lo in range(0, real.shape[0], 256):
        metric.update(real[lo : lo + 256], real=True)
    for lo in range(0, fake.shape[0], 256):
        metric.update(fake[lo : lo + 256], real=False)
    return float(metric.compute())


def run_image_bench(cfg: ImageBenchConfig, progress: Callable[[str], None] = print) -> dict:
    import os

    from vispec.eval.bench.data import CropSampler
    from vispec.eval.bench.evaluator import CropClassifier, classify_accuracy
    from vispec.models.checkpoints import diffusers_load_kwargs
    from vispec.pipelines import LlamaGenPipeline
    from vispec.pipelines.llamagen import resolve_model_path

    for name in ("num_images", "batch_size", "latency_images", "real_images", "noise_repeats"):
        if getattr(cfg, name) < 1:
            raise ValueError(f"{name} must be >= 1, got {getattr(cfg, name)}")
    if cfg.noise_repeats > 40:
        raise ValueError(f"noise_repeats must be <= 40 (distinct 32-bit seeds), got {cfg.noise_repeats}")
    folder = resolve_model_path(cfg.model)
    pipe = LlamaGenPipeline.from_pretrained(folder).to(cfg.device)
    pipe.set_progress_bar_config(disable=True)
    evaluator_path = cfg.evaluator or os.path.join(folder, "evaluator")
    if not os.path.isdir(evaluator_path):
        raise ValueError(f"no evaluator at {evaluator_path}: pass --evaluator (a CropClassifier folder)")
    evaluator = CropClassifier.from_pretrained(evaluator_path, **diffusers_load_kwargs()).eval()
    num_classes = pipe.transformer.config.num_classes
    methods = expand_methods(("ar",) + tuple(cfg.methods), cfg.lantern_k, cfg.lantern_delta)
    for method in methods:  # validate names (and build LANTERN tables) before hours of work
        config = DecodingConfig.parse(method, base=pipe.decoding_config)
        if config.config.strategy == "sd" and pipe.drafter is None:
            raise ValueError(f"method {method!r} needs a drafter, but the pipeline {cfg.model!r} has none")
        pipe.acceptance_rule(config.rule)

    # real held-out crops: evaluator accuracy and the FID floor (two disjoint sets)
    held_out = CropSampler("eval")
    real_labels = torch.arange(2 * cfg.real_images) % num_classes
    real, _ = held_out.sample(2 * cfg.real_images, torch.Generator().manual_seed(cfg.seed + 7), labels=real_labels)
    real_a, real_b = real[: cfg.real_images], real[cfg.real_images :]
    real_stats = {"accuracy": classify_accuracy(evaluator, real_a, real_labels[: cfg.real_images]),
                  "fid_real_vs_real": fid_score(evaluator, real_a, real_b), "images": cfg.real_images}
    progress(f"real held-out crops: accuracy {real_stats['accuracy']:.3f}, FID real vs real {real_stats['fid_real_vs_real']:.3f}")

    labels = torch.arange(cfg.num_images) % num_classes
    seeds = [cfg.seed * SEED_STRIDE + i for i in range(cfg.num_images)]
    results: dict[str, dict] = {}
    warm = pipe(class_labels=[0], decoding="sjd", output_type="latent")  # warm-up, not timed
    del warm
    reseeds = [f"ar-reseed-{k}" for k in range(1, cfg.noise_repeats + 1)]
    for method in methods + reseeds:
        reseed = int(method.rsplit("-", 1)[1]) if method in reseeds else 0
        decoding = "ar" if reseed else method
        row: dict = {}
        with PeakMemory(cfg.device) as memory:
            if not reseed:
                progress(f"{method}: batch-1 latency on {cfg.latency_images} images ...")
                _, stats1, _ = generate_uint8(pipe, decoding, labels[: cfg.latency_images], seeds[: cfg.latency_images], 1, cfg)
                row["nfe"] = sum(s["nfe"] for s in stats1) / len(stats1)
                row["latency_s"] = sum(s["latency_s"] for s in stats1) / len(stats1)
                row["images_per_s_batch1"] = 1.0 / row["latency_s"]
            run_seeds = [s + reseed * RESEED_OFFSET for s in seeds]
            progress(f"{method}: {cfg.num_images} images at batch {cfg.batch_size} ...")
            images, stats, wall = generate_uint8(pipe, decoding, labels, run_seeds, cfg.batch_size, cfg)
        row.update(
            nfe_batched=sum(s["nfe"] for s in stats) / len(stats),
            latency_s_batched=sum(s["latency_s"] for s in stats) / len(stats),
            images_per_s=cfg.num_images / wall,
            accuracy=classify_accuracy(evaluator, images, labels),
            fid=fid_score(evaluator, real_a, images),
            peak_mem_mb=memory.peak_mb,
        )
        if "tv_mean" in stats[0]:  # images decoded without a measured verification carry NaN
            measured = [s for s in stats if not math.isnan(s["tv_mean"])]
            row["tv_mean"] = sum(s["tv_mean"] for s in measured) / len(measured) if measured else float("nan")
            row["tv_max"] = max(s["tv_max"] for s in measured) if measured else float("nan")
        if "drafter_nfe" in stats[0]:
            row["drafter_nfe_batched"] = sum(s["drafter_nfe"] for s in stats) / len(stats)
        if reseed:
            row = {k: row[k] for k in ("accuracy", "fid", "nfe_batched", "images_per_s", "peak_mem_mb")}
        results[method] = row
        progress(f"{method}: accuracy {row['accuracy']:.3f}, FID {row['fid']:.3f}")
    ar = results["ar"]
    noise = sampling_noise([results[m] for m in ["ar"] + reseeds])
    for method in methods:
        row = results[method]
        row["step_compression"] = ar["nfe"] / row["nfe"]
        row["speedup"] = ar["latency_s"] / row["latency_s"]
        row["speedup_batched"] = row["images_per_s"] / ar["images_per_s"]
        row["speedup_vs_compression"] = row["speedup"] / row["step_compression"]
        for metric in ("fid", "accuracy"):
            deviation = row[metric] - noise[f"{metric}_mean"]
            sd = noise[f"{metric}_sd"]
            row[f"{metric}_z"] = deviation / sd if sd > 0 else 0.0
            row[f"{metric}_within_noise"] = abs(deviation) <= noise[f"{metric}_interval"]
    sampling = pipe.decoding_config.sampling(guidance_scale=cfg.guidance_scale, temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p)
    config = {k: v for k, v in asdict(cfg).items() if k != "extra"}
    config.update(methods=methods, sampling=sampling.to_dict(), window=pipe.decoding_config.config.window,
                  fid_features="tiny-c2i evaluator penultimate layer (torchmetrics FrechetInceptionDistance)",
                  **environment(cfg.device))
    return {"config": config, "methods": results, "noise": noise, "real": real_stats}


def sampling_noise(ar_rows: list[dict]) -> dict:
    """Mean, sd and 95% prediction half-width of FID and accuracy over repeated AR runs (module docstring)."""
    runs = len(ar_rows)
    t = _T975[runs - 2] if runs - 1 <= len(_T975) else 1.96
    noise: dict = {"ar_runs": runs}
    for metric in ("fid", "accuracy"):
        values = torch.tensor([r[metric] for r in ar_rows], dtype=torch.float64)
        sd = float(values.std(unbiased=True))
        noise[f"{metric}_values"] = values.tolist()
        noise[f"{metric}_mean"] = float(values.mean())
        noise[f"{metric}_sd"] = sd
        noise[f"{metric}_interval"] = t * sd * (1 + 1 / runs) ** 0.5
    return noise


def format_image_table(result: dict) -> str:
    width = max([18] + [len(name) for name in result["methods"]])
    header = (f"{'method':<{width}} {'nfe':>7} {'step x':>7} {'lat s':>7} {'speedup':>8} {'sp/step':>7} {'img/s@B':>8} {'x@B':>6} "
              f"{'acc':>6} {'FID':>8} {'FID z':>6} {'TV mean':>8} {'TV max':>7} {'MB':>6}")
    lines = [header, "-" * len(header)]
    for name, r in result["methods"].items():
        if name.startswith("ar-reseed"):
            lines.append(f"{name:<{width}} {'':>7} {'':>7} {'':>7} {'':>8} {'':>7} {r['images_per_s']:>8.2f} {'':>6} "
                         f"{r['accuracy']:>6.3f} {r['fid']:>8.3f} {'':>6} {'':>8} {'':>7} {r['peak_mem_mb']:>6.0f}")
            continue
        tv = f"{r['tv_mean']:>8.4f} {r['tv_max']:>7.3f}" if "tv_mean" in r else f"{'0':>8} {'0':>7}"
        lines.append(f"{name:<{width}} {r['nfe']:>7.1f} {r['step_compression']:>7.2f} {r['latency_s']:>7.3f} {r['speedup']:>8.2f} "
                     f"{r['speedup_vs_compression']:>7.2f} {r['images_per_s']:>8.2f} {r['speedup_batched']:>6.2f} "
                     f"{r['accuracy']:>6.3f} {r['fid']:>8.3f} {r['fid_z']:>6.2f} {tv} {r['peak_mem_mb']:>6.0f}")
    noise, real = result["noise"], result["real"]
    lines.append(f"AR sampling noise over {noise['ar_runs']} runs: FID {noise['fid_mean']:.3f} +- {noise['fid_sd']:.3f} "
                 f"(95% interval +-{noise['fid_interval']:.3f}), accuracy {noise['accuracy_mean']:.3f} +- {noise['accuracy_sd']:.3f} "
                 f"(+-{noise['accuracy_interval']:.3f})")
    lines.append(f"real held-out crops: accuracy {real['accuracy']:.3f}, FID real vs real {real['fid_real_vs_real']:.3f}")
    return "\n".join(lines)


def speed_fid_plot(result: dict, path: str, size: tuple[int, int] = (900, 600)) -> str:
    """A PNG of step compression (x) against FID (y), one labelled point per method, with the AR
    sampling-noise band and the FID = 1.1 x AR line. Drawn with PIL (no plotting dependency)."""
    from PIL import Image, ImageDraw

    rows = {name: r for name, r in result["methods"].items() if not name.startswith("ar-reseed")}
    noise = result["noise"]
    xs = [r["step_compression"] for r in rows.values()]
    ys = [r["fid"] for r in rows.values()] + [noise["fid_mean"] * 1.1, noise["fid_mean"] - noise["fid_interval"]]
    x_lo, x_hi = 0.9, max(xs) * 1.1
    y_lo, y_hi = min(ys) * 0.95, max(ys) * 1.05
    w, h = size
    left, right, top, bottom = 70, 30, 30, 60
    image = Image.new("RGB", size, "white")
    draw = ImageDraw.Draw(image)

    def at(x: float, y: float) -> tuple[float, float]:
        return (left + (x - x_lo) / (x_hi - x_lo) * (w - left - right), top + (y_hi - y) / (y_hi - y_lo) * (h - top - bottom))

    band_top, band_bottom = noise["fid_mean"] + noise["fid_interval"], noise["fid_mean"] - noise["fid_interval"]
    draw.rectangle([at(x_lo, band_top), at(x_hi, band_bottom)], fill=(225, 235, 250))
    draw.line([at(x_lo, noise["fid_mean"] * 1.1), at(x_hi, noise["fid_mean"] * 1.1)], fill=(200, 60, 60), width=1)
    draw.text(at(x_lo, noise["fid_mean"] * 1.1), " FID = 1.1 x AR mean", fill=(200, 60, 60))
    draw.text(at(x_lo, band_top), " AR sampling noise (95%)", fill=(80, 110, 170))
    draw.line([(left, h - bottom), (w - right, h - bottom)], fill="black")
    draw.line([(left, top), (left, h - bottom)], fill="black")
    for i in range(6):
        x = x_lo + (x_hi - x_lo) * i / 5
        y = y_lo + (y_hi - y_lo) * i / 5
        px, _ = at(x, y_lo)
        _, py = at(x_lo, y)
        draw.text((px - 10, h - bottom + 5), f"{x:.2f}", fill="black")
        draw.text((5, py - 6), f"{y:.2f}", fill="black")
    draw.text((w // 2 - 120, h - 25), "step compression vs AR (forwards per image)", fill="black")
    draw.text((5, 5), "FID (tiny-c2i evaluator features)", fill="black")
    for name, r in rows.items():
        px, py = at(r["step_compression"], r["fid"])
        colour = (200, 80, 0) if "+" in name else (0, 110, 0)
        draw.ellipse([px - 4, py - 4, px + 4, py + 4], fill=colour)
        draw.text((px + 6, py - 6), name, fill=colour)
    image.save(path)
    return path
