"""``vispec bench image``: speed and quality of AR, SJD and MC-SJD on an image pipeline: a class-to-image
LlamaGen pipeline (tiny-c2i, the default) or a text-to-image ``UnifiedImagePipeline`` (tiny-t2i). A model named
``<model>@<GPT config>`` (``tiny-c2i@GPT-L``; a LlamaGen or Chameleon transformer, e.g. ``tiny-t2i@GPT-B``) runs with
its transformer inflated to that size (:func:`vispec.models.inflate.inflate`: the same logits at the bigger model's
cost; drafters unchanged); the JSON's ``config.model_note`` and the line above the table say so.

What differs between the two lives in a task object (:mod:`vispec.eval.bench.image_tasks`: conditions,
generation, quality metrics, the real-image reference); this module runs the one algorithm on either.

Per method:

* speed at batch 1 (``latency_images`` images, one at a time): NFE, step compression against AR,
  latency per image, speed-up;
* speed and quality at ``batch_size``: images per second and mean per-image latency inside the
  batch, and the task's quality metrics. Class-to-image: evaluator top-1 accuracy on the generated
  images (class adherence) and FID against held-out real crops, with the evaluator's penultimate
  features. Text-to-image (held-out captions, 64x64 and 64x96): prompt-following ``accuracy`` of the
  scene checks (and ``accuracy_by_attribute``), ``clip_score`` against the captions, and FID against
  held-out real renders with the CLIP's image embeddings. FID is :func:`frechet_distance` (torchmetrics'
  formulas in float64) of these features, only comparable within this benchmark. Images are made and
  judged in units of ``batch_size`` (each image's features and checks are taken with its unit), and the
  metrics are computed from the per-image results in image order: the same bits on any number of
  processes (:mod:`vispec.eval.bench.distributed`) and after a resumed run (``results_dir``,
  :mod:`vispec.eval.bench.results`). Images per second are per process: images over the summed wall time of
  the units (generation and VQ decoding, not judging);
* peak memory (RSS on CPU, max allocated on CUDA).

Sampling noise: SJD and MC-SJD are exact, so their quality must match AR up to sampling noise. AR is
repeated ``noise_repeats`` more times with disjoint seeds (rows ``ar-reseed-k``); ``noise`` holds the
mean and standard deviation of each noise metric (the task's ``noise_metrics``: FID and accuracy, and
the CLIP score for text-to-image) over the ``1 + noise_repeats`` AR runs and the
half-width of the 95% prediction interval for one further run at the same settings,
``t_{0.975, R} * sd * sqrt(1 + 1 / (R + 1))`` with ``R + 1`` AR runs. Each method's row gets its
distance from the AR mean in standard deviations (``fid_z``, ``accuracy_z``, ``clip_score_z``) and whether it
lies inside that interval (``fid_within_noise``, ...): the yardstick for differences between methods.
``real`` reports the quality metrics of held-out real images (class-to-image: the evaluator on crops;
text-to-image: the scene checks, and the CLIP score with the true captions and with mismatched ones) and
the FID between two disjoint sets of real images (the floor).

Throughput sweep (``batch_sizes`` and/or ``compile``, as ``vispec bench decoders`` does it): per batch
size ``B`` every method (with ``compile``: eager and ``torch.compile(fullgraph=True)`` decode steps side
by side; ``sd`` runs its drafter eagerly and has no compiled rows) is decoded untimed first (warm-up and
compilation, repeated while a run still compiled a graph), then ``rounds`` interleaved rounds each
decode ``max(B, sweep_images)`` images (whole batches; text-to-image batches hold one size, so a size's
last batch may be short) through the pipeline and the VQ decoder. Unified-token (text-to-image) models
decode eagerly: with ``compile`` they get eager rows only. Rows
(``throughput``): median images per second and seconds per image, speed-up over AR with the same
compile setting and over eager AR (medians of per-round ratios). Quality (accuracy, FID, NFE, TV) is
measured once, at ``batch_size``, eager: every image has its own keyed noise, so the tokens a method
makes do not depend on the batch they run in (tested; the VQ decoder's batched convolutions may move a
pixel by 1/255), and compiling changes no token beyond float near-ties.

Throughput roofline (class-to-image; :mod:`vispec.eval.bench.roofline`): before each batch size's warm-up a
calibration decode per compile setting times whole decode steps of every window into the pipeline's own
:meth:`window_stats` (its auto-window chooser starts from them), and one more with the CPU clock; every round
is timed on both clocks too. Each throughput row gets ``tokens_per_pass``, ``relative_cost``,
``roofline_bound`` (AR batch passes over the method's batch passes weighted by ``c(B, W) / c(B, 1)``) and
``roofline_fraction`` (measured speed-up / bound), and ``*_cpu`` twins; ``result["roofline"]`` holds the curves.
The pipeline reports forwards per image, not windows per pass, so a fixed window's passes all count at its
window (the bound errs low) and the auto window gets no bound (``vispec bench decoders`` weights its passes).

Progress: a tqdm bar over every image the run decodes (disabled when stderr is not a terminal or with
``progress_bar=False``); ``partial(result)`` receives the result so far after every measured row.

Method labels follow :meth:`vispec.decoding.DecodingConfig.parse`; ``:window=N`` compares windows
(e.g. ``sjd:window=4``). A label may end in ``+rule`` for a lossy acceptance rule
(``mc-sjd+lantern:k=100,delta=0.1``, ``sd+lantern``; ``gsd`` is short for ``sjd+gsd``). A
``+lantern`` without options is swept over ``lantern_k x lantern_delta``. Lossy rows also report
the measured total-variation distance of a verification's output from the exact target (mean over
images of the per-image mean, and the max), and :func:`speed_fid_plot` draws step compression
against FID for every row (the speed/quality curve).

Tokens committed per pass (:mod:`vispec.eval.bench.commits`): each method's row keeps ``commits_per_pass``, the
passes of its batched run (every image; the prefill is no pass) per number of tokens committed, a list indexed by
that number; its ``1-token`` column is the share of passes committing one token, and a second table gives the
shares in log2 bins with the mean tokens per pass (:func:`speed_fid_plot` draws them too, ``<stem>.commits.png``).

Shape chooser (``auto``, ``sjd-pac:window=auto``; :mod:`vispec.decoding.shapes`), as ``vispec bench decoders`` reports
it (:func:`vispec.eval.bench.roofline.chooser_fields`): a method's row gets ``shapes``, ``predicted_speedup``,
``measured_speedup`` (its batch-1 ``speedup``), ``prediction_error``, ``chooser_calibrations`` and ``tokens_per_forward``
from its batch-1 latency decodes; a throughput row the same from its timed rounds (measured: ``speedup_vs_ar``), with
``tokens_per_forward`` and ``single_token_passes``. The pipelines' per-image stats do not carry a decode's shapes, so
those runs read them from :func:`vispec.decoding.decode`'s outputs (:func:`_recording_decodes`). A chooser table
follows the main table (and the throughput table). ``--cost-curve flat`` or a cost-curve file pins the curve the
pipeline's choosers see (:func:`vispec.eval.bench.roofline.chooser_stats`) and calibrates the roofline's apart.
"""

from __future__ import annotations

import contextlib
import copy
import math
import time
from dataclasses import asdict
from typing import Callable, Optional, Sequence

import torch

from vispec.decoding import AcceptanceConfig, DecodingConfig
from vispec.eval.bench.configs import ImageBenchConfig  # noqa: F401 - re-exported
from vispec.eval.bench.commits import KEY as COMMITS_KEY, commits_plot, format_commits_table, merge as merge_commits
from vispec.eval.bench.commits import share as commits_share
from vispec.eval.bench.memory import PeakMemory
from vispec.eval.bench.report import environment
from vispec.eval.bench import roofline
from vispec.eval.bench.distributed import Workers, one_process_seconds, open_store, run_units

SEED_STRIDE = 1_000_003
# AR re-seed k uses seeds + k * RESEED_OFFSET. torch's CPU generator keeps only the low 32 bits of a seed, so
# the offset must change them: k * RESEED_OFFSET < 2**32 for k <= 40, far from the benchmark seeds.
RESEED_OFFSET = 100_000_007
# two-sided 95% Student t quantiles t_{0.975, df}, df = 1..10 (beyond: the normal 1.96 is within 10%)
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228)


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


def generate_uint8(pipe, method: str, labels: torch.Tensor, seeds: list[int], batch_size: int, cfg: ImageBenchConfig,
                   compile: bool = False, tick: Optional[Callable[[int], None]] = None, tokens: Optional[list] = None):
    """Class-to-image: uint8 images, per-image stats, wall time; ``tick(n)`` after every batch of ``n`` images (the
    progress bar); ``tokens``: a list that receives each batch's image tokens ``[b, T]`` (CPU).
    (Text-to-image: :func:`vispec.eval.bench.image_tasks.generate_text_uint8`.)"""
    from vispec.models.llamagen_vq import decode_tokens, to_uint8

    images, stats = [], []
    start = time.perf_counter()
    for lo in range(0, len(seeds), batch_size):
        hi = min(lo + batch_size, len(seeds))
        out = pipe(class_labels=labels[lo:hi], decoding=method, generator=[torch.Generator().manual_seed(s) for s in seeds[lo:hi]],
                   guidance_scale=cfg.guidance_scale, temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p,
                   output_type="latent", compile=compile)
        with torch.no_grad():
            images.append(to_uint8(decode_tokens(pipe.vqvae, out.images.to(pipe.device)).float()).cpu())
        stats += out.stats
        if tokens is not None:
            tokens.append(out.images.cpu())
        if tick is not None:
            tick(hi - lo)
    if torch.device(pipe.device).type == "cuda":
        torch.cuda.synchronize(pipe.device)
    return torch.cat(images), stats, time.perf_counter() - start


def frechet_distance(real: torch.Tensor, fake: torch.Tensor) -> float:
    """Fréchet distance between Gaussians fitted to two feature sets ``[N, D]`` and ``[M, D]`` (Heusel et al. 2017),
    in float64, with torchmetrics' formulas (unbiased covariances, ``tr sqrt(Σ_r Σ_f)`` from the eigenvalues)::

        FID = |μ_r - μ_f|² + tr Σ_r + tr Σ_f - 2 Σ_k sqrt(λ_k(Σ_r Σ_f))

    The features are summed in their row order, so the same rows give the same bits."""
    if real.ndim != 2 or fake.ndim != 2 or real.shape[1] != fake.shape[1]:
        raise ValueError(f"features must be [N, D] and [M, D], got {tuple(real.shape)} and {tuple(fake.shape)}")
    if real.shape[0] < 2 or fake.shape[0] < 2:
        raise ValueError(f"FID needs at least two images per side, got {real.shape[0]} and {fake.shape[0]}")

    def moments(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = x.double().cpu()
        n = x.shape[0]
        total = x.sum(dim=0)
        mean = total / n
        cov = (x.t() @ x - n * torch.outer(mean, mean)) / (n - 1)
        return mean, cov

    mu_r, cov_r = moments(real)
    mu_f, cov_f = moments(fake)
    root_trace = torch.linalg.eigvals(cov_r @ cov_f).sqrt().real.sum()
    return float((mu_r - mu_f).square().sum() + cov_r.trace() + cov_f.trace() - 2 * root_trace)


def evaluator_features(evaluator64, images: torch.Tensor, batch: int = 256) -> torch.Tensor:
    """float64 penultimate features ``[N, D]`` of uint8 images through a float64 copy of the evaluator
    (:class:`~vispec.eval.bench.evaluator.FIDFeatures`), ``batch`` images at a time."""
    with torch.no_grad():
        return torch.cat([evaluator64(images[lo : lo + batch]).double().cpu() for lo in range(0, images.shape[0], batch)])


def fid_score(evaluator, real: torch.Tensor, fake: torch.Tensor) -> float:
    """Class-to-image FID of uint8 images with the evaluator's penultimate features (float64, a copy of the evaluator)."""
    from vispec.eval.bench.evaluator import FIDFeatures

    features = FIDFeatures(copy.deepcopy(evaluator).double())
    return frechet_distance(evaluator_features(features, real), evaluator_features(features, fake))


def _progress_bar(total: int, enabled: Optional[bool]):
    """diffusers' tqdm (``tqdm.auto``) over the images a run decodes; ``enabled=None``: only on a terminal."""
    from tqdm.auto import tqdm

    return tqdm(total=total, unit="img", desc="bench image", disable=None if enabled is None else not enabled, dynamic_ncols=True)


METRIC_LABELS = {"accuracy": "accuracy", "clip_score": "CLIP", "fid": "FID"}


def result_settings(cfg: ImageBenchConfig) -> dict:
    """What a stored image's result depends on (:class:`vispec.eval.bench.results.ResultStore`; the method is its group):
    not the image count (image ``i`` is the same in a longer run), the folder or the process count."""
    keep = ("model", "seed", "batch_size", "guidance_scale", "temperature", "top_k", "top_p", "evaluator", "clip")
    return {**{k: getattr(cfg, k) for k in keep}, "device": torch.device(cfg.device).type}


def _json_stats(stats: dict) -> dict:
    """A pipeline's per-image stats as JSON values (numbers, strings, booleans; ``commits``, the passes per
    number of tokens committed, as a list indexed by that number)."""
    out = {k: v for k, v in stats.items() if isinstance(v, (bool, int, float, str))}
    if stats.get("commits") is not None:
        commits = stats["commits"]
        out["commits"] = merge_commits([commits.tolist() if hasattr(commits, "tolist") else commits])
    return out


def commits_histogram(stats: list[dict]) -> Optional[list[int]]:
    """Passes per number of tokens committed (:mod:`vispec.eval.bench.commits`) summed over the images, or None
    when some image's stats do not carry ``commits``."""
    if not stats or not all("commits" in r for r in stats):
        return None
    return merge_commits(r["commits"] for r in stats)


def single_token_share(stats: list[dict]) -> float:
    """The share of passes (the prefill excluded) that committed one token: from the images' ``commits``
    histograms (every decoder, AR included) where they carry one; else from the speculative decoders'
    ``single_passes``, every pass where no draft was ever accepted (AR), NaN for decoders that count neither."""
    hist = commits_histogram(stats)
    if hist is not None:
        return commits_share(hist, 1)
    passes = sum(r["nfe"] - 1 for r in stats)
    if all("single_passes" in r for r in stats):
        return sum(r["single_passes"] for r in stats) / max(passes, 1)
    return 1.0 if all(r.get("accepted_per_forward", 0.0) == 0 for r in stats) else float("nan")


def _batched_row(task, records: list, conditions) -> dict:
    """A method's batched-run metrics from every image's stored result (rank 0)."""
    n = len(records)
    stats = [record for record, _ in records]
    wall = one_process_seconds(stats)  # one process making every image
    row = dict(nfe_batched=sum(r["nfe"] for r in stats) / n, latency_s_batched=sum(r["latency_s"] for r in stats) / n,
               images_per_s=n / wall, **task.quality_of(records, conditions),
               peak_mem_mb=max(r["peak_mem_mb"] for r in stats))
    if "tv_mean" in stats[0]:  # images decoded without a measured verification carry NaN
        measured = [r for r in stats if not math.isnan(r["tv_mean"])]
        row["tv_mean"] = sum(r["tv_mean"] for r in measured) / len(measured) if measured else float("nan")
        row["tv_max"] = max(r["tv_max"] for r in measured) if measured else float("nan")
    if "tv_bound" in stats[0]:  # the budgeted rule: TV moved and budgets, summed per image; binding share
        for key in ("tv_bound", "tv_budget", "budget_binding", "verifications"):
            values = [r[key] for r in stats if not math.isnan(r[key])]
            row[key] = sum(values) / len(values) if values else float("nan")
    row["single_token_passes"] = single_token_share(stats)
    hist = commits_histogram(stats)
    if hist is not None:
        row[COMMITS_KEY] = hist
    if "drafter_nfe" in stats[0]:
        row["drafter_nfe_batched"] = sum(r["drafter_nfe"] for r in stats) / n
    if "request_kept" in stats[0]:  # image-to-image: forwards by how much of the picture the edit keeps
        row["source_kept"] = sum(r["source_kept"] for r in stats) / n
        row["kept_bins"] = kept_bins(stats)
    return row


def kept_bins(stats: list[dict]) -> dict[str, dict[str, float]]:
    """Image-to-image rows: per bin of the requests' ``request_kept`` (:data:`~vispec.eval.bench.image_tasks.KEPT_BINS`),
    the images, their mean forwards and the mean fraction of the output equal to the source."""
    from vispec.eval.bench.image_tasks import kept_bin

    bins: dict[str, list[dict]] = {}
    for r in stats:
        bins.setdefault(kept_bin(r["request_kept"]), []).append(r)
    return {label: {"images": len(rows), "nfe": sum(r["nfe"] for r in rows) / len(rows),
                    "source_kept": sum(r["source_kept"] for r in rows) / len(rows)}
            for label, rows in sorted(bins.items())}


def format_kept_table(result: dict) -> str:
    """Image-to-image: step compression over AR (both at batch ``batch_size``) per bin of how much of the source the
    requested edit keeps, and the share of each method's output equal to the source; empty for other tasks."""
    rows = {name: r for name, r in result["methods"].items() if "kept_bins" in r and not name.startswith("ar-reseed")}
    if "ar" not in rows:
        return ""
    labels = list(rows["ar"]["kept_bins"])
    width = max([18] + [len(name) for name in rows])
    header = f"{'kept by the edit':<{width}} " + " ".join(f"{label:>10}" for label in labels) + f" {'kept out':>8}"
    images = f"{'images':<{width}} " + " ".join(f"{rows['ar']['kept_bins'][b]['images']:>10d}" for b in labels)
    lines = [header, "-" * len(header), images]
    for name, r in rows.items():
        cells = []
        for label in labels:
            mine, ar = r["kept_bins"].get(label), rows["ar"]["kept_bins"][label]
            cells.append(f"{ar['nfe'] / mine['nfe']:>9.2f}x" if mine else f"{'':>10}")
        lines.append(f"{name:<{width}} " + " ".join(cells) + f" {r['source_kept']:>8.1%}")
    lines.append("step compression over AR per bin of the fraction of source codes the true edit keeps (batched run); "
                 "kept out: the share of the output's codes equal to the source's")
    return "\n".join(lines)


@contextlib.contextmanager
def _recording_decodes(sink: list):
    """While active, every :func:`vispec.decoding.decode` (the pipelines import it when they decode) appends its
    ``(stats.shapes, stats.chooser)`` to ``sink``: a pipeline's per-image stats do not carry the shapes of its batch."""
    import vispec.decoding as decoding

    real = decoding.decode

    def recorded(*args, **kwargs):
        out = real(*args, **kwargs)
        sink.append((dict(out.stats.shapes), dict(out.stats.chooser)))
        return out

    decoding.decode = recorded
    try:
        yield sink
    finally:
        decoding.decode = real


def _pin_cost_curve(pipe, cost_curve: str):
    """``--cost-curve``: the WindowStats the roofline calibrates. ``measured``: the pipeline's own (its choosers start
    from the calibration); ``flat`` or a file: the pipeline's choosers get the pinned curve
    (:func:`vispec.eval.bench.roofline.chooser_stats`) and the roofline a WindowStats they never see."""
    import weakref

    from vispec.decoding.windows import WindowStats

    pinned = roofline.chooser_stats(cost_curve)
    if pinned is None:
        return pipe.window_stats()
    pipe._window_stats = (weakref.ref(pipe.transformer), pinned)  # what pipe.window_stats() returns for this transformer
    return WindowStats()


def run_image_bench(cfg: ImageBenchConfig, progress: Callable[[str], None] = print,
                    partial: Optional[Callable[[dict], None]] = None, progress_bar: Optional[bool] = None) -> Optional[dict]:
    """Run the benchmark (module docstring) on the task of ``cfg.model`` (class- or text-to-image, from its
    ``model_index.json``). ``progress(message)`` for phase lines, ``partial(result)`` after every measured row
    (the result so far, for an incremental JSON), ``progress_bar``: ``None`` = a bar when stderr is a terminal.

    Under ``torchrun`` (``num_processes``) every process makes and judges its share of each batched run, in
    units of ``batch_size`` images that do not depend on the process count (:mod:`vispec.eval.bench.distributed`);
    rank 0 measures batch-1 latency alone (the others wait), computes the metrics from every image's result
    and returns the result (the other ranks return None). With ``results_dir`` each image's result (tokens or
    image, evaluator features, stats) is stored as its batch finishes and a rerun makes only what is missing."""
    from vispec.eval.bench.image_tasks import load_task

    cfg.validate()
    workers = Workers.start(cfg.device, cfg.num_processes)
    if workers.distributed and cfg.sweep:
        raise ValueError("batch_sizes and compile (the throughput sweep) time a single process: run the sweep "
                         "without torchrun, or leave them out")
    cfg = copy.copy(cfg)
    cfg.device = str(workers.device)  # under torchrun on CUDA: this process's GPU
    task = load_task(cfg)  # checks the folder and the options before loading
    pipe = task.pipe
    roof_stats = _pin_cost_curve(pipe, cfg.cost_curve)
    methods = expand_methods(("ar",) + tuple(cfg.methods), cfg.lantern_k, cfg.lantern_delta)
    for method in methods:  # validate names (and build LANTERN tables) before hours of work
        task.check_method(method)
    store = open_store(workers, cfg.results_dir, result_settings(cfg))
    batch_sizes = tuple(dict.fromkeys(cfg.batch_sizes or (cfg.batch_size,))) if cfg.sweep else ()
    settings = (False, True) if cfg.compile else (False,)
    skipped = [m for m in methods if cfg.compile and not task.compilable(m)]
    main = workers.is_main
    if skipped and main:
        progress(f"--compile: {', '.join(skipped)} {task.compile_note}: eager throughput rows only")

    sampling = pipe.decoding_config.sampling(guidance_scale=cfg.guidance_scale, temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p)
    run_config = {k: v for k, v in asdict(cfg).items() if k != "extra"}
    run_config.update(methods=methods, sampling=sampling.to_dict(), window=pipe.decoding_config.window,
                      **task.run_config(), **environment(cfg.device), num_processes=workers.world_size)
    if cfg.sweep:
        run_config.update(batch_sizes=list(batch_sizes), compile_settings=["compiled" if c else "eager" for c in settings],
                          compile_skipped=skipped)
    reseeds = [f"ar-reseed-{k}" for k in range(1, cfg.noise_repeats + 1)]
    sweep_images = {b: b * math.ceil(max(b, cfg.sweep_images) / b) for b in batch_sizes}
    share = sum(len(unit) for unit in workers.my_units(cfg.num_images, cfg.batch_size))  # this process's images
    total = len(methods) * ((min(cfg.latency_images, cfg.num_images) if main else 0) + share) + len(reseeds) * share
    total += sum(n * (1 + cfg.rounds) * sum(1 for c in settings for m in methods if not (c and m in skipped))
                 for n in sweep_images.values())
    results: dict[str, dict] = {}
    chooser_decodes: dict[str, list] = {}  # per method: its batch-1 decodes' (shapes, chooser)
    real_stats: dict = {}
    throughput: list[dict] = []
    curves: list[dict] = []  # the roofline's cost curves, one per batch size and compile setting

    def snapshot() -> dict:
        """The result so far, in the final layout (``partial``)."""
        out = {"config": run_config, "methods": results, "real": real_stats}
        if cfg.sweep:
            out["throughput"] = throughput
        return out

    with _progress_bar(total, progress_bar if main else False) as bar:

        def say(message: str) -> None:
            if main:
                with bar.external_write_mode():  # clear the bar, print, redraw
                    progress(message)

        if workers.distributed:
            say(f"{workers.world_size} processes, each making every {workers.world_size}th batch of {cfg.batch_size} images")
        if main:  # real held-out images: their quality metrics and the FID floor (two disjoint sets)
            real_stats.update(task.real_stats(cfg.real_images))
            say(task.describe_real(real_stats))
            if partial:
                partial(snapshot())

        conditions = task.conditions(cfg.num_images)
        seeds = [cfg.seed * SEED_STRIDE + i for i in range(cfg.num_images)]
        task.warm_up()  # not timed
        for method in methods + reseeds:
            reseed = int(method.rsplit("-", 1)[1]) if method in reseeds else 0
            decoding = "ar" if reseed else method
            row: dict = {}
            latency_peak = 0.0
            if not reseed and main:  # alone: the other processes wait at the barrier below
                if roofline.chooses_shapes(DecodingConfig.parse(method, base=getattr(pipe, "decoding_config", None))):
                    # untimed: the first decode at a batch size measures the shape chooser's cost curve
                    say(f"{method}: chooser warm-up (untimed) ...")
                    from vispec.eval.bench.decoders import CHOOSER_WARMUP_RUNS

                    for attempt in range(CHOOSER_WARMUP_RUNS):  # again while a decode still calibrated
                        with _recording_decodes([]) as warm:
                            task.generate(decoding, conditions[:1], seeds[:1], 1)
                        if not any(chooser.get("calibrated") for _, chooser in warm):
                            break
                with PeakMemory(cfg.device) as memory, _recording_decodes(chooser_decodes.setdefault(method, [])):
                    say(f"{method}: batch-1 latency on {cfg.latency_images} images ...")
                    _, stats1, _ = task.generate(decoding, conditions[: cfg.latency_images], seeds[: cfg.latency_images], 1,
                                                 tick=bar.update)
                latency_peak = memory.peak_mb
                row["nfe"] = sum(s["nfe"] for s in stats1) / len(stats1)
                if any(shapes for shapes, _ in chooser_decodes[method]):
                    row["tokens_per_forward"] = sum(s["tokens_per_forward"] for s in stats1) / len(stats1)
                row["latency_s"] = sum(s["latency_s"] for s in stats1) / len(stats1)
                row["images_per_s_batch1"] = 1.0 / row["latency_s"]
            if not reseed:
                workers.barrier()
            run_seeds = [s + reseed * RESEED_OFFSET for s in seeds]
            say(f"{method}: {cfg.num_images} images at batch {cfg.batch_size} ...")

            def compute(unit: range) -> dict:
                part = slice(unit.start, unit.stop)
                with PeakMemory(cfg.device) as memory:
                    images, stats, kept, wall = task.generate_items(decoding, conditions[part], run_seeds[part],
                                                                    cfg.batch_size)
                judged = task.judge(images, conditions[part])
                common = {"unit_wall_s": wall, "unit_size": len(unit), "peak_mem_mb": memory.peak_mb}
                return {i: ({**_json_stats(stat), **judgement, **common}, {**tensors, **judged_tensors})
                        for i, stat, tensors, (judgement, judged_tensors) in zip(unit, stats, kept, judged)}

            records = run_units(workers, cfg.num_images, cfg.batch_size, compute, store, method, tick=bar.update)
            if records is None:
                continue
            row.update(_batched_row(task, records, conditions))
            row["peak_mem_mb"] = max(row["peak_mem_mb"], latency_peak)
            noise_metrics = [m for m in row if m in task.noise_metrics]  # in the task's row order
            if reseed:
                row = {k: row[k] for k in (*noise_metrics, "nfe_batched", "images_per_s", "peak_mem_mb")}
            results[method] = row
            say(f"{method}: " + ", ".join(f"{METRIC_LABELS.get(m, m)} {row[m]:.3f}" for m in noise_metrics))
            if partial:
                partial(snapshot())

        for batch in batch_sizes:
            throughput += _throughput_rows(task, cfg, methods, settings, skipped, batch, sweep_images[batch], say, bar, curves,
                                           roof_stats)
            if partial:
                partial(snapshot())

    if not main:
        return None
    ar = results["ar"]
    noise = sampling_noise([results[m] for m in ["ar"] + reseeds], task.noise_metrics)
    for method in methods:
        row = results[method]
        row["step_compression"] = ar["nfe"] / row["nfe"]
        row["speedup"] = ar["latency_s"] / row["latency_s"]
        row["speedup_batched"] = row["images_per_s"] / ar["images_per_s"]
        row["speedup_vs_compression"] = row["speedup"] / row["step_compression"]
        row.update(roofline.chooser_fields(chooser_decodes.get(method, []), row["speedup"]))
        for metric in task.noise_metrics:
            deviation = row[metric] - noise[f"{metric}_mean"]
            sd = noise[f"{metric}_sd"]
            row[f"{metric}_z"] = deviation / sd if sd > 0 else 0.0
            row[f"{metric}_within_noise"] = abs(deviation) <= noise[f"{metric}_interval"]
    result = {"config": run_config, "methods": results, "noise": noise, "real": real_stats}
    if cfg.sweep:
        result["throughput"] = throughput
        if curves:
            result["roofline"] = {"at": task.pipe.transformer.num_image_tokens // 2, "curves": curves,
                                  "calibration_spec": roofline.calibration_spec(methods),
                                  "decodes_per_clock": roofline.CALIBRATION_DECODES}
    return result


def _throughput_rows(task, cfg: ImageBenchConfig, methods: list[str], settings: tuple[bool, ...], skipped: list[str],
                     batch: int, images: int, say: Callable[[str], None], bar, curves: Optional[list] = None,
                     roof_stats=None) -> list[dict]:
    """One batch size of the throughput sweep (module docstring): warm-up, interleaved timed rounds, one row
    per method and compile setting (``task``: :class:`vispec.eval.bench.image_tasks.ImageTask`), with the roofline
    columns where the task's model has a cost curve (appended to ``curves``; ``roof_stats``: the WindowStats the
    roofline calibrates, default the pipeline's) and the shape chooser's keys where its decodes report shapes."""
    import statistics

    from vispec.eval.bench.decoders import CHOOSER_WARMUP_RUNS, WARMUP_RUNS, compiled_graph_count

    conditions = task.conditions(images)
    seeds = [cfg.seed * SEED_STRIDE + i for i in range(images)]
    contenders = [(m, c) for c in settings for m in methods if not (c and m in skipped)]
    name = lambda m, c: f"{m}{' (compiled)' if c else ''}"  # noqa: E731
    # the cost curve first (class-to-image): the auto window's chooser starts from it, the roofline report reads it
    roof_stats = task.pipe.window_stats() if roof_stats is None else roof_stats
    calibration = {c: cal for c in settings if c in {k for _, k in contenders}
                   if (cal := _calibrate(task, cfg, methods, batch, c, say, roof_stats)) is not None}
    passes: dict = {con: [] for con in contenders}  # per timed round: the batches' passes (max NFE - 1 of each batch)

    last_decodes: list = []  # (shapes, chooser) of the last run's decodes

    def run(method: str, compiled: bool, timed: bool = False) -> float:
        with _recording_decodes([]) as decodes:
            _, stats, wall = task.generate(method, conditions, seeds, batch, compile=compiled, tick=bar.update)
        last_decodes[:] = decodes
        if timed:
            passes[(method, compiled)] += [max(s["nfe"] for s in stats[lo: lo + batch]) - 1 for lo in range(0, len(stats), batch)]
            nfes[(method, compiled)] += [s["nfe"] for s in stats]
            timed_stats[(method, compiled)] += stats
            chooser_decodes[(method, compiled)] += decodes
        return wall

    nfes: dict = {con: [] for con in contenders}
    timed_stats: dict = {con: [] for con in contenders}  # every image's stats of the timed rounds
    chooser_decodes: dict = {con: [] for con in contenders}  # (shapes, chooser) of every decode of the timed rounds

    warmup: dict = {}
    for con in contenders:  # warm-up and compilation, untimed: again while a run still compiled a graph
        say(f"B={batch}: warm-up {name(*con)} ...")
        warmup[con] = []
        # the shape chooser: also while a run still measured its cost curve (a short image fits few shapes per decode)
        chooses = roofline.chooses_shapes(DecodingConfig.parse(con[0], base=getattr(task.pipe, "decoding_config", None)))
        for attempt in range(CHOOSER_WARMUP_RUNS if chooses else WARMUP_RUNS):
            if attempt:
                bar.total += images
                bar.refresh()
            graphs = compiled_graph_count()
            warmup[con].append(run(*con))
            if compiled_graph_count() == graphs and not any(chooser.get("calibrated") for _, chooser in last_decodes):
                break
    say(f"B={batch}: {cfg.rounds} timed round(s) of {len(contenders)} contenders, {images} image(s) each ...")
    round_s: dict = {con: [] for con in contenders}
    round_cpu_s: dict = {con: [] for con in contenders}  # time.process_time of the same rounds
    compiles = dict.fromkeys(contenders, 0)
    for _ in range(cfg.rounds):  # interleaved: A B C ... A B C ...
        for con in contenders:
            graphs = compiled_graph_count()
            start_cpu = time.process_time()
            round_s[con].append(run(*con, timed=True))
            round_cpu_s[con].append(time.process_time() - start_cpu)
            compiles[con] += compiled_graph_count() - graphs
    curve_of = {c: roofline.curve_entry(roof_stats, cpu, key, task.pipe.transformer.num_image_tokens // 2,
                                        batch, c) for c, (key, cpu) in calibration.items()}
    if curves is not None:
        curves.extend(curve_of.values())
    rows = []
    for method, compiled in contenders:
        times, cpu_times = round_s[(method, compiled)], round_cpu_s[(method, compiled)]
        same_ar, eager_ar = round_s[("ar", compiled)], round_s[("ar", False)]
        median = statistics.median(times)
        speedup = statistics.median(a / b for a, b in zip(same_ar, times))
        speedup_cpu = statistics.median(a / b for a, b in zip(round_cpu_s[("ar", compiled)], cpu_times))
        rows.append({
            "batch_size": batch, "method": method, "compile": compiled, "images": images, "rounds": len(times),
            "images_per_s": images / median, "s_per_image": median / images,
            "s_per_image_cpu": statistics.median(cpu_times) / images,
            "speedup_vs_ar": speedup, "speedup_vs_ar_cpu": speedup_cpu,
            "speedup_vs_eager_ar": statistics.median(a / b for a, b in zip(eager_ar, times)),
            "speedup_vs_eager_ar_cpu": statistics.median(a / b for a, b in zip(round_cpu_s[("ar", False)], cpu_times)),
            "round_s": times, "round_cpu_s": cpu_times, "warmup_s": warmup[(method, compiled)],
            "compiles_in_timed": compiles[(method, compiled)],
        })
        if compiled in curve_of:
            rows[-1].update(_roofline_fields(task, method, curve_of[compiled], passes[(method, compiled)],
                                             passes[("ar", compiled)], nfes[(method, compiled)], speedup, speedup_cpu))
        mine = timed_stats[(method, compiled)]
        if mine and all("tokens_per_forward" in s for s in mine):
            rows[-1]["tokens_per_forward"] = sum(s["tokens_per_forward"] for s in mine) / len(mine)
        if mine:
            rows[-1]["single_token_passes"] = single_token_share(mine)
        rows[-1].update(roofline.chooser_fields(chooser_decodes[(method, compiled)], speedup))
        say(f"B={batch} {name(method, compiled)}: {rows[-1]['images_per_s']:.2f} img/s, "
            f"{rows[-1]['speedup_vs_ar']:.2f}x AR{' (compiled)' if compiled else ''}")
    return rows


def _calibrate(task, cfg: ImageBenchConfig, methods: list[str], batch: int, compiled: bool, say: Callable[[str], None],
               stats=None):
    """The cost curve of a class-to-image pipeline's transformer at ``batch`` slots (:mod:`vispec.eval.bench.roofline`),
    into ``stats`` (default: the pipeline's own window statistics, its chooser's); ``None`` for models without a LlamaGen
    decode (their rows get no roofline columns)."""
    from vispec.decoding.windows import window_set
    from vispec.models.llamagen_gpt import LlamaGenCondition, LlamaGenGPT

    pipe = task.pipe
    if not isinstance(pipe.transformer, LlamaGenGPT):
        return None
    configs = [DecodingConfig.parse(m, base=pipe.decoding_config) for m in methods]
    fixed = [c.largest_window for c in configs if c.strategy != "ar" and c.window != "auto"]
    windows = window_set(max([int(pipe.decoding_config.largest_window)] + fixed))
    say(f"B={batch}: cost curve{' (compiled)' if compiled else ''}, windows {windows} ...")
    model = pipe.transformer
    labels = (torch.arange(batch) % int(model.config.num_classes)).to(pipe.device)
    sampling = pipe.decoding_config.sampling(guidance_scale=cfg.guidance_scale, temperature=cfg.temperature, top_k=cfg.top_k,
                                             top_p=cfg.top_p)
    return roofline.calibrate(model, LlamaGenCondition(class_labels=labels), model.num_image_tokens,
                              pipe.window_stats() if stats is None else stats, windows, roofline.calibration_spec(methods),
                              compile=compiled, sampling=sampling, seed=cfg.seed)


def _roofline_fields(task, method: str, curve: dict, passes: list[int], ar_passes: list[int], nfes: list[float],
                     speedup: float, speedup_cpu: float) -> dict:
    """A throughput row's roofline keys (:func:`vispec.eval.bench.roofline.roofline_fields`). The pipeline reports each
    image's forwards, not each pass's window, so a fixed window's passes are all taken at its window (the narrower
    last passes at the full width: the bound errs low) and the auto window's bound is not computed (NaN; ``vispec
    bench decoders`` has it)."""
    config = DecodingConfig.parse(method, base=task.pipe.decoding_config)
    num_tokens = task.pipe.transformer.num_image_tokens
    mean_nfe = sum(nfes) / len(nfes)
    if config.strategy == "ar":
        windows = {1: sum(passes)}
    elif config.strategy in ("sjd", "mc-sjd") and config.window != "auto":
        windows = {int(config.window): sum(passes)}
    else:  # auto, or a decoder whose passes are not windows of one model (sd, gad, sjd-pac trees)
        return {"tokens_per_pass": roofline.tokens_per_pass(num_tokens, mean_nfe), "relative_cost": float("nan"),
                "roofline_bound": float("nan"), "roofline_fraction": float("nan"), "roofline_bound_cpu": float("nan"),
                "roofline_fraction_cpu": float("nan")}
    return roofline.roofline_fields(windows, sum(ar_passes), curve["relative_cost"], curve["relative_cost_cpu"], speedup,
                                    speedup_cpu, roofline.tokens_per_pass(num_tokens, mean_nfe))


def sampling_noise(ar_rows: list[dict], metrics: Sequence[str] = ("fid", "accuracy")) -> dict:
    """Mean, sd and 95% prediction half-width of each of ``metrics`` (default FID and accuracy) over repeated AR
    runs (module docstring)."""
    runs = len(ar_rows)
    t = _T975[runs - 2] if runs - 1 <= len(_T975) else 1.96
    noise: dict = {"ar_runs": runs}
    for metric in metrics:
        values = torch.tensor([r[metric] for r in ar_rows], dtype=torch.float64)
        sd = float(values.std(unbiased=True))
        noise[f"{metric}_values"] = values.tolist()
        noise[f"{metric}_mean"] = float(values.mean())
        noise[f"{metric}_sd"] = sd
        noise[f"{metric}_interval"] = t * sd * (1 + 1 / runs) ** 0.5
    return noise


def _task_class(result: dict) -> type:
    """The task class of a result (its ``config["task"]``; results from before tasks are class-to-image)."""
    from vispec.eval.bench.image_tasks import TASKS, ClassImageTask

    return TASKS.get(result["config"].get("task", ClassImageTask.kind), ClassImageTask)


def format_image_table(result: dict) -> str:
    """One line per method (a CLIP column for text-to-image), the AR sampling noise and the real images."""
    clip = "clip_score" in _task_class(result).noise_metrics
    width = max([18] + [len(name) for name in result["methods"]])
    clip_head = f" {'CLIP':>6}" if clip else ""
    header = (f"{'method':<{width}} {'nfe':>7} {'step x':>7} {'1-tok':>6} {'lat s':>7} {'speedup':>8} {'sp/step':>7} {'img/s@B':>8} {'x@B':>6} "
              f"{'acc':>6}{clip_head} {'FID':>8} {'FID z':>6} {'TV mean':>8} {'TV max':>7} {'MB':>6}")
    lines = [header, "-" * len(header)]
    if result["config"].get("model_note"):  # an inflated model: whose logits, at which cost
        lines.insert(0, f"model: {result['config']['model_note']}")
    for name, r in result["methods"].items():
        score = f" {r['clip_score']:>6.2f}" if clip else ""
        if name.startswith("ar-reseed"):
            lines.append(f"{name:<{width}} {'':>7} {'':>7} {'':>6} {'':>7} {'':>8} {'':>7} {r['images_per_s']:>8.2f} {'':>6} "
                         f"{r['accuracy']:>6.3f}{score} {r['fid']:>8.3f} {'':>6} {'':>8} {'':>7} {r['peak_mem_mb']:>6.0f}")
            continue
        tv = f"{r['tv_mean']:>8.4f} {r['tv_max']:>7.3f}" if "tv_mean" in r else f"{'0':>8} {'0':>7}"
        lines.append(f"{name:<{width}} {r['nfe']:>7.1f} {r['step_compression']:>7.2f} {r['single_token_passes']:>6.1%} {r['latency_s']:>7.3f} {r['speedup']:>8.2f} "
                     f"{r['speedup_vs_compression']:>7.2f} {r['images_per_s']:>8.2f} {r['speedup_batched']:>6.2f} "
                     f"{r['accuracy']:>6.3f}{score} {r['fid']:>8.3f} {r['fid_z']:>6.2f} {tv} {r['peak_mem_mb']:>6.0f}")
    noise, real = result["noise"], result["real"]
    line = (f"AR sampling noise over {noise['ar_runs']} runs: FID {noise['fid_mean']:.3f} +- {noise['fid_sd']:.3f} "
            f"(95% interval +-{noise['fid_interval']:.3f}), accuracy {noise['accuracy_mean']:.3f} +- {noise['accuracy_sd']:.3f} "
            f"(+-{noise['accuracy_interval']:.3f})")
    if "clip_score_mean" in noise:
        line += (f", CLIP {noise['clip_score_mean']:.2f} +- {noise['clip_score_sd']:.2f} "
                 f"(+-{noise['clip_score_interval']:.2f})")
    lines.append(line)
    lines.append(_task_class(result).describe_real(real))
    chooser = roofline.format_chooser_table(
        [{**r, "method": name, "batch_size": 1, "compile": False} for name, r in result["methods"].items()],
        result["config"].get("cost_curve", "measured"), title="shape chooser (batch-1 latency runs)")
    if chooser:
        lines += ["", chooser]
    budget = format_budget_table(result)
    if budget:
        lines += ["", budget]
    kept = format_kept_table(result)
    if kept:
        lines += ["", kept]
    commits = format_commits_table(result)
    if commits:
        lines += ["", commits]
    if result.get("throughput"):
        lines += ["", format_throughput_table(result)]
    return "\n".join(lines)


def format_budget_table(result: dict) -> str:
    """The budgeted rule's rows (:mod:`vispec.decoding.budget`): the requested TV budget per verification next to the
    measured TV of a verification's output (mean, max), and per image the TV mass moved (``tv_bound``, summed over the
    verifications that decided a token), the summed budgets and the share of verifications where the budget bound;
    empty when no row used the rule."""
    rows = {name: r for name, r in result["methods"].items() if "tv_bound" in r}
    if not rows:
        return ""
    width = max([18] + [len(name) for name in rows])
    header = (f"{'budgeted rule':<{width}} {'budget':>7} {'TV mean':>8} {'TV max':>7} {'within':>6} {'moved/img':>9} "
              f"{'budget/img':>10} {'binding':>7}")
    lines = [header, "-" * len(header)]
    for name, r in rows.items():
        delta = DecodingConfig.parse(name).rule.budget_delta
        within = "yes" if not r["tv_max"] > delta + 1e-9 else "NO"
        lines.append(f"{name:<{width}} {delta:>7.3f} {r['tv_mean']:>8.4f} {r['tv_max']:>7.4f} {within:>6} {r['tv_bound']:>9.2f} "
                     f"{r['tv_budget']:>10.2f} {r['budget_binding']:>7.1%}")
    lines.append("budget: δ per verification (annealed rows get less); TV: measured per verification; moved/img: the TV mass "
                 "moved per image (its mean bounds the image distribution's TV from AR's, capped at 1)")
    return "\n".join(lines)


def format_throughput_table(result: dict) -> str:
    """The throughput sweep: one line per batch size, compile setting and method."""
    rows, config = result["throughput"], result["config"]
    width = max([18] + [len(row["method"]) for row in rows])
    head = (f"throughput: medians of {config['rounds']} interleaved round(s), speed-ups as medians of per-round time ratios; "
            f"quality above is per image, the same at every batch size")
    header = f"{'B':>4} {'method':<{width}} {'mode':<8} {'images':>6} {'img/s':>8} {'s/img':>8} {'vs AR':>6} {'vs eager AR':>11}"
    lines = [head, header, "-" * len(header)]
    last = None
    for row in rows:
        if last is not None and row["batch_size"] != last:
            lines.append("")
        last = row["batch_size"]
        line = (f"{row['batch_size']:>4} {row['method']:<{width}} {'compiled' if row['compile'] else 'eager':<8} {row['images']:>6} "
                f"{row['images_per_s']:>8.3f} {row['s_per_image']:>8.4f} {row['speedup_vs_ar']:>6.2f} {row['speedup_vs_eager_ar']:>11.2f}")
        if row["compiles_in_timed"]:
            line += f"  [compiled {row['compiles_in_timed']} graph(s) in timed runs]"
        lines.append(line)
    if config.get("compile_skipped"):
        lines.append(f"no compiled rows for {', '.join(config['compile_skipped'])} ({_task_class(result).compile_reason})")
    if result.get("roofline"):
        lines += ["", roofline.format_roofline_table(rows, result["roofline"]["curves"], result["roofline"]["at"],
                                                     title="throughput roofline")]
    chooser = roofline.format_chooser_table(rows, config.get("cost_curve", "measured"), title="throughput shape chooser")
    if chooser:
        lines += ["", chooser]
    return "\n".join(lines)


FAMILY_COLOURS = {"exact": (0, 110, 0), "budget": (20, 60, 200), "budget, annealed": (120, 40, 200),
                  "budget, neighbours": (0, 150, 170), "LANTERN": (200, 80, 0), "LANTERN++ (ratio)": (200, 0, 80),
                  "GSD": (150, 110, 0), "lumina": (110, 110, 110)}


def method_family(name: str) -> str:
    """The curve a method's point belongs to in :func:`speed_fid_plot`: ``exact``, the budgeted rule (plain, annealed,
    with codebook neighbours), LANTERN (``δ <= 1``), LANTERN++ (the ratio ``λ = δ > 1``), GSD or lumina."""
    rule = DecodingConfig.parse(name).rule
    if rule.rule == "budget":
        if rule.budget_neighbors:
            return "budget, neighbours"
        return "budget, annealed" if (rule.budget_decay, rule.budget_end) != (1.0, 1.0) else "budget"
    if rule.rule == "lantern":
        return "LANTERN++ (ratio)" if rule.lantern_delta > 1 else "LANTERN"
    return {"gsd": "GSD", "lumina": "lumina"}.get(rule.rule, "exact")


def speed_fid_plot(result: dict, path: str, size: tuple[int, int] = (900, 600), commits: bool = True) -> str:
    """A PNG of step compression (x) against FID (y, logarithmic when it spans more than 3x), one point per method,
    the points of a family (:func:`method_family`) joined in order of compression and coloured alike (a legend
    names them), with the AR sampling-noise band and the FID = 1.1 x AR line; the y label names the FID features
    (``config["fid_features"]``). With ``commits`` (and a result whose methods carry the histogram) also the histogram
    of tokens committed per pass next to it, ``<path stem>.commits.png`` (:func:`vispec.eval.bench.commits.commits_plot`).
    Drawn with PIL (no plotting dependency). Returns ``path``."""
    if commits and format_commits_table(result):
        commits_plot(result, path, size)
    from PIL import Image, ImageDraw

    rows = {name: r for name, r in result["methods"].items() if not name.startswith("ar-reseed") and "fid" in r}
    noise = result["noise"]
    xs = [r["step_compression"] for r in rows.values()]
    ys = [r["fid"] for r in rows.values()] + [noise["fid_mean"] * 1.1, noise["fid_mean"] - noise["fid_interval"]]
    x_lo, x_hi = 0.9, max(xs) * 1.1
    y_lo, y_hi = min(ys) * 0.95, max(ys) * 1.05
    log_y = y_hi / max(y_lo, 1e-9) > 3
    w, h = size
    left, right, top, bottom = 70, 30, 30, 60
    image = Image.new("RGB", size, "white")
    draw = ImageDraw.Draw(image)

    def scale_y(y: float) -> float:
        return math.log(max(y, 1e-9)) if log_y else y

    def at(x: float, y: float) -> tuple[float, float]:
        return (left + (x - x_lo) / (x_hi - x_lo) * (w - left - right),
                top + (scale_y(y_hi) - scale_y(y)) / (scale_y(y_hi) - scale_y(y_lo)) * (h - top - bottom))

    band_top, band_bottom = noise["fid_mean"] + noise["fid_interval"], noise["fid_mean"] - noise["fid_interval"]
    draw.rectangle([at(x_lo, band_top), at(x_hi, max(band_bottom, y_lo))], fill=(225, 235, 250))
    draw.line([at(x_lo, noise["fid_mean"] * 1.1), at(x_hi, noise["fid_mean"] * 1.1)], fill=(200, 60, 60), width=1)
    draw.text(at(x_lo, noise["fid_mean"] * 1.1), " FID = 1.1 x AR mean", fill=(200, 60, 60))
    draw.text(at(x_lo, band_top), " AR sampling noise (95%)", fill=(80, 110, 170))
    draw.line([(left, h - bottom), (w - right, h - bottom)], fill="black")
    draw.line([(left, top), (left, h - bottom)], fill="black")
    for i in range(6):
        x = x_lo + (x_hi - x_lo) * i / 5
        y = math.exp(scale_y(y_lo) + (scale_y(y_hi) - scale_y(y_lo)) * i / 5) if log_y else y_lo + (y_hi - y_lo) * i / 5
        px, _ = at(x, y_lo)
        _, py = at(x_lo, y)
        draw.text((px - 10, h - bottom + 5), f"{x:.2f}", fill="black")
        draw.text((5, py - 6), f"{y:.2f}", fill="black")
    draw.text((w // 2 - 120, h - 25), "step compression vs AR (forwards per image)", fill="black")
    features = result["config"].get("fid_features", "tiny-c2i evaluator features").split(" (")[0]
    draw.text((5, 5), f"FID ({features})" + (", log scale" if log_y else ""), fill="black")
    families: dict[str, list[tuple[float, float, str]]] = {}
    for name, r in rows.items():
        families.setdefault(method_family(name), []).append((r["step_compression"], r["fid"], name))
    for k, (family, points) in enumerate(sorted(families.items())):
        colour = FAMILY_COLOURS.get(family, (0, 0, 0))
        points.sort()
        if family != "exact" and len(points) > 1:
            draw.line([at(x, y) for x, y, _ in points], fill=colour, width=2)
        for x, y, name in points:
            px, py = at(x, y)
            draw.ellipse([px - 4, py - 4, px + 4, py + 4], fill=colour)
            label = name.split("+", 1)[1].split(":", 1)[-1] if family != "exact" else name.split(":")[0]
            draw.text((px + 6, py - 6), label, fill=colour)
        lx, ly = w - right - 190, top + 14 * k
        draw.rectangle([lx, ly + 3, lx + 8, ly + 11], fill=colour)
        draw.text((lx + 12, ly), family, fill=colour)
    image.save(path)
    return path
