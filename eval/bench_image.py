"""``vispec bench image``: speed and quality of AR, SJD and MC-SJD on a LlamaGen pipeline (tiny-c2i by default).

Per method:

* speed at batch 1 (``latency_images`` images, one at a time): NFE, step compression against AR,
  latency per image, speed-up;
* speed and quality at ``batch_size``: images per second and mean per-image latency inside the
  batch, evaluator top-1 accuracy on the generated images (class adherence), and FID against
  held-out real crops, with the evaluator's penultimate features (torchmetrics
  ``FrechetInceptionDistance(feature=...)``; only comparable within this benchmark);
* peak memory (RSS on CPU, max allocated on CUDA).

Sampling noise: SJD and MC-SJD are exact, so their quality must match AR up to sampling noise. The row
``ar-reseed`` repeats AR with other seeds, and ``noise`` reports |FID(ar) - FID(ar-reseed)| and the
accuracy difference: the yardstick for differences between methods. ``real`` reports the evaluator
on held-out crops and the FID between two disjoint sets of held-out crops (the floor).
"""

from __future__ import annotations

import copy
import platform
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional

import torch

from vispec.eval.memory import PeakMemory

SEED_STRIDE = 1_000_003


@dataclass
class ImageBenchConfig:
    model: str = "tiny-c2i"
    methods: tuple[str, ...] = ("ar", "sjd", "mc-sjd")
    num_images: int = 1000
    batch_size: int = 32
    latency_images: int = 8
    real_images: int = 1000
    seed: int = 0
    guidance_scale: Optional[float] = None
    temperature: Optional[float] = None
    top_k: Optional[int] = None
    top_p: Optional[float] = None
    evaluator: Optional[str] = None  # defaults to the model folder's "evaluator" subfolder
    device: str = "cpu"
    extra: dict = field(default_factory=dict)


def _generate(pipe, method: str, labels: torch.Tensor, seeds: list[int], batch_size: int, cfg: ImageBenchConfig):
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


def _fid(evaluator, real: torch.Tensor, fake: torch.Tensor) -> float:
    from torchmetrics.image.fid import FrechetInceptionDistance

    from vispec.eval.evaluator import FIDFeatures

    metric = FrechetInceptionDistance(feature=FIDFeatures(copy.deepcopy(evaluator)))
    metric.set_dtype(torch.float64)  # casts the (copied) feature module too
    for lo in range(0, real.shape[0], 256):
        metric.update(real[lo : lo + 256], real=True)
    for lo in range(0, fake.shape[0], 256):
        metric.update(fake[lo : lo + 256], real=False)
    return float(metric.compute())


def run_image_bench(cfg: ImageBenchConfig, progress: Callable[[str], None] = print) -> dict:
    import os

    from vispec.eval.data import CropSampler
    from vispec.eval.evaluator import CropClassifier, classify_accuracy
    from vispec.models.checkpoints import diffusers_load_kwargs
    from vispec.pipelines import LlamaGenPipeline
    from vispec.pipelines.llamagen import resolve_model_path

    for name in ("num_images", "batch_size", "latency_images", "real_images"):
        if getattr(cfg, name) < 1:
            raise ValueError(f"{name} must be >= 1, got {getattr(cfg, name)}")
    folder = resolve_model_path(cfg.model)
    pipe = LlamaGenPipeline.from_pretrained(folder).to(cfg.device)
    pipe.set_progress_bar_config(disable=True)
    evaluator_path = cfg.evaluator or os.path.join(folder, "evaluator")
    if not os.path.isdir(evaluator_path):
        raise ValueError(f"no evaluator at {evaluator_path}: pass --evaluator (a CropClassifier folder)")
    evaluator = CropClassifier.from_pretrained(evaluator_path, **diffusers_load_kwargs()).eval()
    num_classes = pipe.transformer.config.num_classes
    methods = list(dict.fromkeys(("ar",) + tuple(cfg.methods)))
    for method in methods:
        pipe.decoding_config.parse(method)  # validate names before hours of work

    # real held-out crops: evaluator accuracy and the FID floor (two disjoint sets)
    held_out = CropSampler("eval")
    real_labels = torch.arange(2 * cfg.real_images) % num_classes
    real, _ = held_out.sample(2 * cfg.real_images, torch.Generator().manual_seed(cfg.seed + 7), labels=real_labels)
    real_a, real_b = real[: cfg.real_images], real[cfg.real_images :]
    real_stats = {"accuracy": classify_accuracy(evaluator, real_a, real_labels[: cfg.real_images]),
                  "fid_real_vs_real": _fid(evaluator, real_a, real_b), "images": cfg.real_images}
    progress(f"real held-out crops: accuracy {real_stats['accuracy']:.3f}, FID real vs real {real_stats['fid_real_vs_real']:.3f}")

    labels = torch.arange(cfg.num_images) % num_classes
    seeds = [cfg.seed * SEED_STRIDE + i for i in range(cfg.num_images)]
    results: dict[str, dict] = {}
    warm = pipe(class_labels=[0], decoding="sjd", output_type="latent")  # warm-up, not timed
    del warm
    for method in methods + ["ar-reseed"]:
        decoding = "ar" if method == "ar-reseed" else method
        row: dict = {}
        with PeakMemory(cfg.device) as memory:
            if method != "ar-reseed":
                progress(f"{method}: batch-1 latency on {cfg.latency_images} images ...")
                _, stats1, _ = _generate(pipe, decoding, labels[: cfg.latency_images], seeds[: cfg.latency_images], 1, cfg)
                row["nfe"] = sum(s["nfe"] for s in stats1) / len(stats1)
                row["latency_s"] = sum(s["latency_s"] for s in stats1) / len(stats1)
                row["images_per_s_batch1"] = 1.0 / row["latency_s"]
            run_seeds = [s + SEED_STRIDE // 2 for s in seeds] if method == "ar-reseed" else seeds
            progress(f"{method}: {cfg.num_images} images at batch {cfg.batch_size} ...")
            images, stats, wall = _generate(pipe, decoding, labels, run_seeds, cfg.batch_size, cfg)
        row.update(
            nfe_batched=sum(s["nfe"] for s in stats) / len(stats),
            latency_s_batched=sum(s["latency_s"] for s in stats) / len(stats),
            images_per_s=cfg.num_images / wall,
            accuracy=classify_accuracy(evaluator, images, labels),
            fid=_fid(evaluator, real_a, images),
            peak_mem_mb=memory.peak_mb,
        )
        if method == "ar-reseed":
            row = {k: row[k] for k in ("accuracy", "fid", "nfe_batched", "images_per_s", "peak_mem_mb")}
        results[method] = row
        progress(f"{method}: accuracy {row['accuracy']:.3f}, FID {row['fid']:.3f}")
    ar = results["ar"]
    for method in methods:
        row = results[method]
        row["step_compression"] = ar["nfe"] / row["nfe"]
        row["speedup"] = ar["latency_s"] / row["latency_s"]
        row["speedup_batched"] = row["images_per_s"] / ar["images_per_s"]
    noise = {"fid_ar_vs_ar_reseed": abs(ar["fid"] - results["ar-reseed"]["fid"]),
             "accuracy_ar_vs_ar_reseed": abs(ar["accuracy"] - results["ar-reseed"]["accuracy"])}
    sampling = pipe.decoding_config.sampling(guidance_scale=cfg.guidance_scale, temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p)
    config = {k: v for k, v in asdict(cfg).items() if k != "extra"}
    config.update(methods=methods, sampling=sampling.to_dict(), window=pipe.decoding_config.config.window,
                  fid_features="tiny-c2i evaluator penultimate layer (torchmetrics FrechetInceptionDistance)",
                  torch=torch.__version__, threads=torch.get_num_threads(), machine=platform.machine(),
                  device_name=torch.cuda.get_device_name() if cfg.device.startswith("cuda") else platform.processor() or "cpu")
    return {"config": config, "methods": results, "noise": noise, "real": real_stats}


def format_image_table(result: dict) -> str:
    header = (f"{'method':<14} {'nfe':>7} {'step x':>7} {'lat s':>7} {'speedup':>8} {'img/s@B':>8} {'x@B':>6} "
              f"{'acc':>6} {'FID':>8} {'MB':>6}")
    lines = [header, "-" * len(header)]
    for name, r in result["methods"].items():
        if name == "ar-reseed":
            lines.append(f"{name:<14} {'':>7} {'':>7} {'':>7} {'':>8} {r['images_per_s']:>8.2f} {'':>6} "
                         f"{r['accuracy']:>6.3f} {r['fid']:>8.3f} {r['peak_mem_mb']:>6.0f}")
            continue
        lines.append(f"{name:<14} {r['nfe']:>7.1f} {r['step_compression']:>7.2f} {r['latency_s']:>7.3f} {r['speedup']:>8.2f} "
                     f"{r['images_per_s']:>8.2f} {r['speedup_batched']:>6.2f} {r['accuracy']:>6.3f} {r['fid']:>8.3f} {r['peak_mem_mb']:>6.0f}")
    noise, real = result["noise"], result["real"]
    lines.append(f"noise (AR vs AR, other seeds): |dFID| {noise['fid_ar_vs_ar_reseed']:.3f}, |dacc| {noise['accuracy_ar_vs_ar_reseed']:.3f}; "
                 f"real held-out crops: acc {real['accuracy']:.3f}, FID real vs real {real['fid_real_vs_real']:.3f}")
    return "\n".join(lines)
