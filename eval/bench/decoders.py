"""``vispec bench decoders``: AR, SJD (each initialisation) and MC-SJD (each coupling) side by side.

Two modes.

*One batch size* (the default): per method, mean NFE per image, mean accepted draft tokens per
verification pass, step compression (AR's NFE / the method's NFE), latency per image (time until
the image's last token, averaged), speed-up (AR latency / method latency), images per second and
peak memory (RSS on CPU, max allocated on CUDA), each method run once after the other.

*Batch sweep* (``--batch-sizes 1,4,16`` and/or ``--compile``): per batch size ``B``, every method
(with ``--compile``: every method eager and compiled, ``torch.compile(fullgraph=True)`` decode
steps) is timed the project's way: one process, a fixed thread count (``--threads``), every
contender decoded untimed first (warm-up, and compilation of its step shapes; repeated, up to
:data:`WARMUP_RUNS` times, while a run still compiled a graph), then
``--rounds`` rounds in which the contenders run interleaved (A B C ... A B C ...), each
measurement decoding ``max(B, num_images)`` images (rounded up to whole batches of ``B``).
Reported per row: the median images per second and seconds per image, the speed-up over AR with the
same compile setting and over eager AR (medians of the per-round ratios, so slow drifts of the
machine cancel), the step compression, host synchronisations per decode step
(:class:`vispec.profiling.HostSyncCounter` over one decode, divided by its steps; compiled steps run
with the counter suspended, see :func:`vispec.decoding.compiled.outside_torch_function_mode`), aten ops per step
(``torch.profiler`` events named ``aten::*``, nested ones included, over one decode) and the windows the
passes ran with (``stats.windows``). The sync and op counts come from separate untimed decodes run after
the timed rounds; a partial JSON holds a batch size's timed rows before they are counted (``None`` until then:
profiling is slow on a GPU machine, and a time limit must not lose the timings). A step is one decode pass
after the prefill: ``sum(stats.windows.values())``.

Models: a named GPT config (``GPT-mini``, ``GPT-B``, ``GPT-L``, ...) randomly initialised, or
``tiny-c2i``, the embedded trained class-conditional model (its vocabulary, classes and at most its
256 tokens; ``vocab_size``, ``num_classes`` and ``init_std`` are then ignored), or ``tiny-c2i@GPT-L``:
tiny-c2i inflated to GPT-L's size (:func:`vispec.models.inflate.inflate`; extra weights from ``seed``), the
trained model's logits (hence its tokens and acceptance) at GPT-L's cost; the JSON's ``config.model_note`` and
the line above the table say so.

A randomly initialised model has nearly uniform next-token distributions at LlamaGen's init scale
(std 0.02), where no drafting scheme can be accepted often; ``init_std`` scales the random weights
up to make distributions peaked, which is still no substitute for a trained model.

Roofline (:mod:`vispec.eval.bench.roofline`): before each batch size's warm-up a calibration decode per compile
setting times whole decode steps of every window of the set into the bench's :class:`WindowStats` (the auto
window's chooser starts from it), and a second one with the CPU clock. Every row then gets ``tokens_per_pass``
(committed tokens per verification pass, ``(N - 1) / (NFE - 1)``), ``relative_cost`` (its passes' mean
``c(B, W) / c(B, 1)`` at ``image_tokens // 2`` cached tokens), ``roofline_bound`` (AR passes over the passes'
summed relative cost: the speed-up the hardware allows those passes) and ``roofline_fraction`` (measured
speed-up over AR / bound), each also on the CPU clock (``*_cpu``), as the timed rounds are (``round_cpu_s``,
``speedup_vs_ar_cpu``, ...); ``result["roofline"]`` holds the curves. The one-batch-size run reports the same
(eager, its speed-up from latency; the CPU one from each method's total process time).

GPU (``--device cuda --dtype bfloat16 --compile``): verification runs the Triton kernels (``backend="auto"``
picks them for CUDA tensors); ``--cuda-graphs`` compiles the steps with ``mode="reduce-overhead"``
(:func:`vispec.decoding.compiled.cuda_graphs`; ``result["cuda_graphs"]`` counts the graphs inductor ran without
a CUDA graph, ``cudagraph_skips``, and keeps the reasons it logged, first seen in this run, ``skip_reasons``);
``--kernels`` adds ``vispec bench kernels`` at the model's vocabulary and the passes' row counts (GB/s and share of
peak HBM bandwidth) as ``result["kernels"]``, in the same JSON and printed table.

Tokens committed per pass (:mod:`vispec.eval.bench.commits`): every method's row (and every sweep row, over its
timed rounds) keeps ``commits_per_pass``, the passes per number of tokens committed (``stats.commits`` summed over
the decoded images, a list indexed by that number); the ``1-token`` column is its share of one-token passes, and a
second table gives the shares in log2 bins with the mean tokens per pass (:func:`commits_plot` draws them).

Shape chooser (``auto``, ``sjd-pac:window=auto``; :mod:`vispec.decoding.shapes`): every row whose decodes report
``stats.shapes`` also gets ``shapes`` (passes per shape, summed over the row's decodes), ``predicted_speedup`` (the
mean of the decodes' ``stats.chooser["predicted_speedup"]``), ``measured_speedup`` (the row's speed-up over AR with
the same compile setting), ``prediction_error`` (predicted / measured - 1) and ``chooser_calibrations``; a table under
the main one shows them with tokens per forward, the single-token share, the roofline share and the top shapes. Each
shape-choosing method gets an untimed decode per batch size first (the first one measures the chooser's cost curve).
``--cost-curve flat`` (or a cost-curve file, e.g. recorded on a GPU) hands the decodes a pinned curve instead
(:func:`vispec.eval.bench.roofline.chooser_stats`: every shape and window costs the same, or the file's costs;
no measurement changes it) and calibrates the roofline's curve apart, so the choosers never see measured costs; the
predicted speed-ups are then relative to that curve, the measured ones stay the wall clock's.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import Counter
from typing import Optional

import torch

from vispec.decoding.compiled import cuda_graphs, cudagraph_skip_reasons, cudagraph_skips, outside_torch_function_mode
from vispec.decoding import DecodingConfig, WindowStats, decode
from vispec.decoding.windows import window_set
from vispec.eval.bench import roofline
from vispec.eval.bench.configs import ALL_METHODS, TRAINED_MODELS, DecoderBenchConfig  # noqa: F401 - re-exported
from vispec.eval.bench.configs import split_inflated_name
from vispec.eval.bench.commits import KEY as COMMITS_KEY, format_commits_table, histogram, merge, share
from vispec.eval.bench.memory import PeakMemory
from vispec.eval.bench.report import environment
from vispec.eval.bench.roofline import format_roofline_table
from vispec.models.llamagen_gpt import LlamaGenCondition, LlamaGenGPT
from vispec.profiling import HostSyncCounter
from vispec.sampling import SamplingConfig

WARMUP_RUNS = 3  # at most, per contender and batch size: a warm-up run is repeated while it compiled a graph
CHOOSER_WARMUP_RUNS = 8  # at most, per shape-choosing method and batch size: repeated while a decode still calibrated


def decoding_config(method: str, window: int) -> DecodingConfig:
    """``method``'s config; ``window`` applies to speculative specs that name no window of their own."""
    config = DecodingConfig.parse(method)
    if config.strategy in ("sjd", "mc-sjd") and "window=" not in method.partition("+")[0]:
        config = DecodingConfig.parse(config, window=window)
    return config


def build_random_model(cfg: DecoderBenchConfig) -> LlamaGenGPT:
    torch.manual_seed(cfg.seed)
    model = LlamaGenGPT.from_name(
        cfg.model, vocab_size=cfg.vocab_size, block_size=cfg.image_tokens, num_classes=cfg.num_classes,
        initializer_range=cfg.init_std,
    )
    torch.nn.init.normal_(model.output.weight, std=cfg.init_std)  # LlamaGen zero-inits the head
    # nn.Module.to: diffusers' ModelMixin.to warns on every dtype cast (diffusers 0.42)
    return torch.nn.Module.to(model, device=cfg.device, dtype=getattr(torch, cfg.dtype)).eval()


def build_model(cfg: DecoderBenchConfig) -> LlamaGenGPT:
    """The named random-init GPT, an embedded trained model's transformer (``tiny-c2i``), or that transformer
    inflated to a GPT config's size (``tiny-c2i@GPT-L``: its logits at GPT-L cost, :func:`vispec.models.inflate.inflate`;
    the extra weights from ``cfg.seed``, built in float32 before the cast to ``cfg.dtype``)."""
    base, target = split_inflated_name(cfg.model)
    if base not in TRAINED_MODELS:
        return build_random_model(cfg)
    from vispec.pipelines import LlamaGenPipeline

    model = LlamaGenPipeline.from_pretrained(f"vispec/{base}").transformer
    if cfg.image_tokens > model.num_image_tokens:
        raise ValueError(f"image_tokens must be <= {model.num_image_tokens} for {cfg.model}, got {cfg.image_tokens}")
    if target is not None:
        from vispec.models.inflate import inflate

        model = inflate(model, target, seed=cfg.seed)
    return torch.nn.Module.to(model, device=cfg.device, dtype=getattr(torch, cfg.dtype)).eval()


def model_note(cfg: DecoderBenchConfig, model: LlamaGenGPT) -> Optional[str]:
    """What the table and JSON say about an inflated model (``tiny-c2i's logits at GPT-L cost (...)``), else None."""
    plan = getattr(model, "inflation", None)
    if plan is None:
        return None
    from vispec.models.inflate import inflation_note

    return inflation_note(split_inflated_name(cfg.model)[0], plan)


def _num_classes(model: LlamaGenGPT) -> int:
    return int(model.config.num_classes)


def _run_method(model, cfg: DecoderBenchConfig, method: str, sampling: SamplingConfig, window_stats: WindowStats) -> dict:
    decoding = decoding_config(method, cfg.window)
    device = torch.device(cfg.device)
    labels = torch.arange(cfg.num_images) % _num_classes(model)
    gens = [torch.Generator().manual_seed(cfg.seed * 100003 + i) for i in range(cfg.num_images)]
    nfe, accepted, latency = [], [], []
    single: Optional[list] = []  # only for decoders without a commits histogram
    commits: Optional[list[int]] = []  # passes per number of tokens committed (None: a decode did not count them)
    windows: Counter = Counter()
    decodes: list[tuple[dict, dict]] = []  # per decode: (stats.shapes, stats.chooser)
    with PeakMemory(device) as memory:
        start, start_cpu = time.perf_counter(), time.process_time()
        for lo in range(0, cfg.num_images, cfg.batch_size):
            hi = min(lo + cfg.batch_size, cfg.num_images)
            out = decode(
                model, LlamaGenCondition(class_labels=labels[lo:hi].to(device)), num_tokens=cfg.image_tokens,
                sampling=sampling, decoding=decoding, generator=gens[lo:hi], window_stats=window_stats,
            )
            nfe += out.stats.nfe.tolist()
            accepted += out.stats.accepted_per_forward.tolist()
            latency += out.stats.latency_s.tolist()
            windows.update(out.stats.windows)
            decodes.append((dict(out.stats.shapes), dict(out.stats.chooser)))
            commits = None if commits is None or out.stats.commits is None else merge([commits, histogram(out.stats.commits)])
            counted = out.stats.extra.get("single_passes", out.stats.nfe - 1 if out.method == "ar" else None)
            single = None if counted is None or single is None else single + counted.tolist()  # AR: every pass
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        total, total_cpu = time.perf_counter() - start, time.process_time() - start_cpu
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    if commits is not None:  # passes that committed one token, from the histogram (every decoder, AR included)
        single_share = share(commits, 1)
    else:  # NaN: not counted
        single_share = float("nan") if single is None else sum(single) / max(sum(nfe) - len(nfe), 1)
    row = {
        "nfe": mean(nfe),
        "accepted_per_forward": mean(accepted),
        "tokens_per_forward": cfg.image_tokens / mean(nfe),
        "single_token_passes": single_share,
        "latency_s": mean(latency),
        "images_per_s": cfg.num_images / total,
        "wall_s": total, "cpu_s": total_cpu,
        "windows_total": {int(w): n for w, n in sorted(windows.items(), reverse=True)},
        "peak_mem_mb": memory.peak_mb,
    }
    if commits is not None:
        row[COMMITS_KEY] = commits
    row["_decodes"] = decodes  # the shape chooser's report, once the speed-up is known (run_decoder_bench)
    return row


def _sampling(cfg: DecoderBenchConfig) -> SamplingConfig:
    return SamplingConfig(temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p, guidance_scale=cfg.guidance_scale)


def _base_config(cfg: DecoderBenchConfig, model: LlamaGenGPT, methods: list[str]) -> dict:
    config = {k: v for k, v in vars(cfg).items() if k != "extra"}
    if split_inflated_name(cfg.model)[0] in TRAINED_MODELS:  # the trained model's own sizes, not the random-init flags
        config.update(vocab_size=int(model.config.vocab_size), num_classes=_num_classes(model), init_std=None)
    if model_note(cfg, model):
        config.update(model_note=model_note(cfg, model), inflation=model.inflation.to_dict())
    config.update(methods=list(methods), parameters=sum(p.numel() for p in model.parameters()), **environment(cfg.device))
    return config


def calibration_windows(cfg: DecoderBenchConfig, methods: list[str]) -> list[int]:
    """The windows the cost curve covers: the set up to the widest fixed window of ``methods`` (at least ``window``)."""
    widest = [decoding_config(m, cfg.window).largest_window for m in methods
              if decoding_config(m, cfg.window).window != "auto" and decoding_config(m, cfg.window).strategy != "ar"]
    return window_set(max([cfg.window] + widest))


def _calibrate(model, cfg: DecoderBenchConfig, methods: list[str], batch: int, compiled: bool, sampling,
               window_stats: WindowStats, progress) -> tuple:
    """The cost curve of ``batch`` slots and one compile setting, into ``window_stats`` (wall clock, the chooser's)
    and a CPU-clock ``WindowStats`` (:func:`vispec.eval.bench.roofline.calibrate`)."""
    windows = calibration_windows(cfg, methods)
    progress(f"B={batch}: cost curve{' (compiled)' if compiled else ''}, windows {windows} ...")
    labels = (torch.arange(batch) % _num_classes(model)).to(cfg.device)
    with cuda_graphs(compiled and cfg.cuda_graphs):
        return roofline.calibrate(model, LlamaGenCondition(class_labels=labels), cfg.image_tokens, window_stats, windows,
                                  roofline.calibration_spec(methods), compile=compiled, sampling=sampling, seed=cfg.seed)


def _roofline_config(cfg: DecoderBenchConfig, methods: list[str], curves: list[dict]) -> dict:
    return {"at": cfg.image_tokens // 2, "calibration_spec": roofline.calibration_spec(methods),
            "windows": calibration_windows(cfg, methods), "decodes_per_clock": roofline.CALIBRATION_DECODES,
            "curves": curves}


def _kernel_report(cfg: DecoderBenchConfig, model: LlamaGenGPT, batch_sizes: tuple[int, ...], progress) -> dict:
    """``--kernels``: ``vispec bench kernels`` at this model's vocabulary and, on CUDA, at LlamaGen's 16384 (a small
    vocabulary's logits fit in a GPU's L2 cache, which says nothing about HBM bandwidth), on the verification passes' row counts
    (batch x window, and 2048 rows for the bandwidth ceiling), on this device and dtype."""
    from vispec.eval.bench.kernels import KernelBenchConfig, run_kernel_bench

    rows = tuple(sorted({b * cfg.window for b in batch_sizes} | {2048}))
    vocab = tuple(sorted({int(model.config.vocab_size)} | ({16384} if torch.device(cfg.device).type == "cuda" else set())))
    progress(f"kernels: verify and unmask, rows {list(rows)}, vocab {list(vocab)} ...")
    kcfg = KernelBenchConfig(rows=rows, vocab=vocab, window=cfg.window,
                             guidance_scale=cfg.guidance_scale if cfg.guidance_scale > 1 else 4.0, dtype=cfg.dtype,
                             device=cfg.device, max_seconds=1.0, compile_check=False, step_shares=False, seed=cfg.seed)
    return run_kernel_bench(kcfg, progress=progress)


def _chooser_and_roofline_stats(cfg: DecoderBenchConfig) -> tuple[WindowStats, WindowStats]:
    """``(the WindowStats handed to every decode, the one the roofline calibrates)``: one and the same with
    ``--cost-curve measured`` (the auto window's chooser starts from the calibration); with ``flat`` or a file the
    decodes get the pinned curve (:func:`vispec.eval.bench.roofline.chooser_stats`) and the roofline a WindowStats of
    its own, which no chooser sees."""
    pinned = roofline.chooser_stats(cfg.cost_curve)
    if pinned is None:
        stats = WindowStats()
        return stats, stats
    return pinned, WindowStats()


def _warm_up_choosers(model, cfg: DecoderBenchConfig, methods: list[str], sampling, window_stats: WindowStats,
                      progress) -> None:
    """Untimed decodes per shape-choosing method (``auto``, ``sjd-pac:window=auto``) and batch size of the run, until
    one no longer calibrates (at most :data:`CHOOSER_WARMUP_RUNS`): the first decodes at a batch size measure the shape
    chooser's cost curve (each shape that fits the image for a few passes), which the timed run must not include (the
    predicted speed-up leaves those passes out)."""
    sizes = sorted({cfg.batch_size if cfg.num_images >= cfg.batch_size else cfg.num_images}
                   | ({cfg.num_images % cfg.batch_size} - {0}))
    for method in methods:
        decoding = decoding_config(method, cfg.window)
        if not roofline.chooses_shapes(decoding):
            continue
        progress(f"{method}: chooser warm-up (untimed) ...")
        for size in sizes:
            labels = (torch.arange(size) % _num_classes(model)).to(cfg.device)
            for attempt in range(CHOOSER_WARMUP_RUNS):  # again while a decode still calibrated (a short image fits few shapes)
                gens = [torch.Generator().manual_seed(cfg.seed * 100003 + (7 + attempt) * 1_000_003 + i) for i in range(size)]
                out = decode(model, LlamaGenCondition(class_labels=labels), num_tokens=cfg.image_tokens, sampling=sampling,
                             decoding=decoding, generator=gens, window_stats=window_stats)
                if not out.stats.chooser.get("calibrated"):
                    break


def run_decoder_bench(cfg: DecoderBenchConfig, progress=print, partial=None) -> dict:
    """Run every method. One batch size: ``{"config": ..., "methods": {name: {...}}}``; a batch sweep
    (``batch_sizes`` or ``compile``): ``{"config": ..., "rows": [{...}, ...]}``, one row per batch size,
    compile setting and method (module docstring). ``partial(result)`` receives the result so far after
    every method (one batch size) or batch size (sweep), for an incremental JSON."""
    cfg.validate()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    if cfg.sweep:
        return _run_sweep(cfg, progress, partial)
    model = build_model(cfg)
    # window="auto" and the shape chooser: measurements of this model, kept across its decodes (--cost-curve flat or a
    # file: a pinned curve, and the roofline calibrates a WindowStats of its own)
    window_stats, roof_stats = _chooser_and_roofline_stats(cfg)
    sampling = _sampling(cfg)
    methods = list(dict.fromkeys(("ar",) + tuple(cfg.methods)))  # AR is the baseline
    # warm-up (allocator, kernels), not timed
    decode(model, LlamaGenCondition(class_labels=torch.zeros(1, dtype=torch.long, device=cfg.device)),
           num_tokens=min(cfg.image_tokens, 2 * cfg.window), sampling=sampling, decoding=DecodingConfig.parse("sjd", window=cfg.window))
    key, cpu_stats = _calibrate(model, cfg, methods, cfg.batch_size, False, sampling, roof_stats, progress)
    _warm_up_choosers(model, cfg, methods, sampling, window_stats, progress)
    results = {}
    for method in methods:
        progress(f"running {method} ...")
        results[method] = _run_method(model, cfg, method, sampling, window_stats)
        if partial:
            partial({"config": _base_config(cfg, model, methods),
                     "methods": {m: {k: v for k, v in r.items() if k != "_decodes"} for m, r in results.items()}})
    ar = results["ar"]
    curve = roofline.curve_entry(roof_stats, cpu_stats, key, cfg.image_tokens // 2, cfg.batch_size, False)
    ar_passes = sum(ar["windows_total"].values())
    for res in results.values():
        res["step_compression"] = ar["nfe"] / res["nfe"]
        res["speedup"] = ar["latency_s"] / res["latency_s"]
        res["speedup_cpu"] = ar["cpu_s"] / res["cpu_s"]
        res.update(roofline.roofline_fields(res["windows_total"], ar_passes, curve["relative_cost"], curve["relative_cost_cpu"],
                                            res["speedup"], res["speedup_cpu"], roofline.tokens_per_pass(cfg.image_tokens, res["nfe"])))
        res.update(roofline.chooser_fields(res.pop("_decodes"), res["speedup"]))
    result = {"config": _base_config(cfg, model, methods), "methods": {m: results[m] for m in methods if m in cfg.methods or m == "ar"},
              "roofline": _roofline_config(cfg, methods, [curve])}
    if cfg.kernels:
        result["kernels"] = _kernel_report(cfg, model, (cfg.batch_size,), progress)
    return result


# ---- batch sweep ---------------------------------------------------------------------------------


def compiled_graph_count() -> int:
    """Graphs dynamo has compiled so far in this process (to catch a compilation inside a timed run)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


class _Contender:
    """One (method, compile setting) at one batch size: its decodes and what they measured."""

    def __init__(self, model, cfg: DecoderBenchConfig, method: str, compiled: bool, batch: int, images: int, sampling,
                 window_stats: WindowStats):
        self.model, self.cfg, self.method, self.compiled, self.batch, self.images = model, cfg, method, compiled, batch, images
        self.window_stats = window_stats  # window="auto": the chooser's measurements of this model, across runs
        self.decoding = decoding_config(method, cfg.window)
        self.sampling = sampling
        self.device = torch.device(cfg.device)
        self.labels = (torch.arange(images) % _num_classes(model)).to(self.device)
        self.round_s: list[float] = []
        self.round_cpu_s: list[float] = []  # time.process_time of the same rounds
        self.latency: list[float] = []
        self.nfe: list[float] = []
        self.accepted: list[float] = []
        self.steps: list[int] = []
        self.windows: Counter = Counter()
        self.last_windows: dict = {}
        self.commits: Optional[list[int]] = []  # over the timed rounds; None: a decode did not count them
        self.decodes: list[tuple[dict, dict]] = []  # over the timed rounds: (stats.shapes, stats.chooser) per decode
        self.compiles_in_timed = 0

    def decode_batch(self, lo: int):
        hi = lo + self.batch
        gens = [torch.Generator().manual_seed(self.cfg.seed * 100003 + i) for i in range(lo, hi)]
        with cuda_graphs(self.compiled and self.cfg.cuda_graphs):
            return decode(self.model, LlamaGenCondition(class_labels=self.labels[lo:hi]), num_tokens=self.cfg.image_tokens,
                          sampling=self.sampling, decoding=self.decoding, generator=gens, compile=self.compiled,
                          window_stats=self.window_stats)

    def run(self) -> tuple[float, list, float]:
        """Every image once, in batches of ``batch``: (wall seconds, outputs, CPU seconds of the process)."""
        outs = []
        start, start_cpu = time.perf_counter(), time.process_time()
        for lo in range(0, self.images, self.batch):
            outs.append(self.decode_batch(lo))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - start, outs, time.process_time() - start_cpu

    def timed_round(self) -> None:
        graphs = compiled_graph_count()
        seconds, outs, cpu_seconds = self.run()
        self.compiles_in_timed += compiled_graph_count() - graphs
        self.round_s.append(seconds)
        self.round_cpu_s.append(cpu_seconds)
        for out in outs:
            self.nfe += out.stats.nfe.double().tolist()
            self.latency += out.stats.latency_s.double().tolist()
            if out.stats.accepted_drafts is not None:
                self.accepted += out.stats.accepted_per_forward.tolist()
            self.steps.append(sum(out.stats.windows.values()))
            self.windows.update(out.stats.windows)
            self.last_windows = dict(sorted(out.stats.windows.items(), reverse=True))
            self.decodes.append((dict(out.stats.shapes), dict(out.stats.chooser)))
            if self.commits is not None:
                self.commits = None if out.stats.commits is None else merge([self.commits, histogram(out.stats.commits)])

    def counts(self) -> tuple[float, float, dict]:
        """Host syncs per step and aten ops per step, each over one untimed decode of one batch."""
        with HostSyncCounter() as syncs, outside_torch_function_mode():
            out = self.decode_batch(0)
        sync_steps = max(sum(out.stats.windows.values()), 1)
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            out = self.decode_batch(0)
        ops = sum(1 for event in prof.events() if event.name.startswith("aten::"))
        op_steps = max(sum(out.stats.windows.values()), 1)
        return syncs.total / sync_steps, ops / op_steps, dict(syncs.by_name)


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def _run_sweep(cfg: DecoderBenchConfig, progress, partial=None) -> dict:
    model = build_model(cfg)
    window_stats, roof_stats = _chooser_and_roofline_stats(cfg)  # the choosers' measurements, the roofline's curve
    sampling = _sampling(cfg)
    methods = list(dict.fromkeys(("ar",) + tuple(cfg.methods)))
    settings = (False, True) if cfg.compile else (False,)
    batch_sizes = tuple(dict.fromkeys(cfg.batch_sizes or (cfg.batch_size,)))
    config = _base_config(cfg, model, methods)
    config.update(batch_sizes=list(batch_sizes), compile_settings=["compiled" if c else "eager" for c in settings])
    rows: list[dict] = []
    curves: list[dict] = []
    skips_before, reasons_before = cudagraph_skips(), len(cudagraph_skip_reasons())
    # first (seconds): a run cut short by a time limit keeps it in its partial JSON
    kernels = _kernel_report(cfg, model, batch_sizes, progress) if cfg.kernels else None

    def snapshot() -> dict:
        out = {"config": config, "rows": list(rows), "roofline": _roofline_config(cfg, methods, list(curves))}
        if cfg.cuda_graphs:
            out["cuda_graphs"] = {"mode": "reduce-overhead", "cudagraph_skips": cudagraph_skips() - skips_before,
                                  "skip_reasons": cudagraph_skip_reasons()[reasons_before:]}
        if kernels is not None:
            out["kernels"] = kernels
        return out

    if partial and kernels is not None:
        partial(snapshot())  # the kernel report is kept even if the first batch size is cut short
    for batch in batch_sizes:
        images = batch * math.ceil(max(batch, cfg.num_images) / batch)
        contenders = [_Contender(model, cfg, m, c, batch, images, sampling, window_stats) for c in settings for m in methods]
        # the cost curve first: the auto window's chooser starts from it, the roofline report reads it
        calibration = {c: _calibrate(model, cfg, methods, batch, c, sampling, roof_stats, progress) for c in settings}
        warmup = {}
        for con in contenders:  # warm-up and compilation, untimed: again while a run still compiles something
            progress(f"B={batch}: warm-up {con.method}{' (compiled)' if con.compiled else ''} ...")
            warmup[con] = []
            # the shape chooser: also while a run still measured its cost curve (a short image fits few shapes per decode)
            for _ in range(CHOOSER_WARMUP_RUNS if roofline.chooses_shapes(con.decoding) else WARMUP_RUNS):
                graphs = compiled_graph_count()
                seconds, outs, _ = con.run()
                warmup[con].append(seconds)
                if compiled_graph_count() == graphs and not any(out.stats.chooser.get("calibrated") for out in outs):
                    break
        progress(f"B={batch}: {cfg.rounds} timed round(s) of {len(contenders)} contenders, {images} image(s) each ...")
        for _ in range(cfg.rounds):  # interleaved: A B C ... A B C ...
            for con in contenders:
                con.timed_round()
        ar = {c.compiled: c for c in contenders if c.method == "ar"}
        curve = {}
        for c, (key, cpu_stats) in calibration.items():
            curve[c] = roofline.curve_entry(roof_stats, cpu_stats, key, cfg.image_tokens // 2, batch, c)
            # AR's own step (its rounds over its passes, the prefill included): c(1) is the speculative decoder's
            # one-row step, which costs something else; the bounds compare with AR's measured step (roofline)
            per_round = sum(ar[c].windows.values()) / max(len(ar[c].round_s), 1)
            curve[c].update(ar_step_s=_median(ar[c].round_s) / per_round, ar_step_cpu_s=_median(ar[c].round_cpu_s) / per_round)
            curves.append(curve[c])
        batch_rows: dict = {}
        for con in contenders:
            nfe = statistics.fmean(con.nfe)
            same_ar, eager_ar = ar[con.compiled], ar[False]
            speedup = _median([a / b for a, b in zip(same_ar.round_s, con.round_s)])
            speedup_cpu = _median([a / b for a, b in zip(same_ar.round_cpu_s, con.round_cpu_s)])
            batch_rows[con] = {
                "batch_size": batch, "method": con.method, "decoding": con.decoding.method, "compile": con.compiled,
                "images": images, "rounds": len(con.round_s),
                "images_per_s": images / _median(con.round_s), "s_per_image": _median(con.round_s) / images,
                "s_per_image_cpu": _median(con.round_cpu_s) / images,
                "speedup_vs_ar": speedup, "speedup_vs_ar_cpu": speedup_cpu,
                "speedup_vs_eager_ar": _median([a / b for a, b in zip(eager_ar.round_s, con.round_s)]),
                "speedup_vs_eager_ar_cpu": _median([a / b for a, b in zip(eager_ar.round_cpu_s, con.round_cpu_s)]),
                "step_compression": statistics.fmean(same_ar.nfe) / nfe,
                "nfe": nfe, "steps_per_decode": statistics.fmean(con.steps),
                "accepted_per_forward": statistics.fmean(con.accepted) if con.accepted else None,
                "latency_s": statistics.fmean(con.latency),
                "syncs_per_step": None, "syncs_by_name": None, "ops_per_step": None,  # counted below
                "windows": con.last_windows, "windows_total": dict(sorted(con.windows.items(), reverse=True)),
                "round_s": con.round_s, "round_cpu_s": con.round_cpu_s, "warmup_s": warmup[con],
                "compiles_in_timed": con.compiles_in_timed,
                **roofline.roofline_fields(con.windows, sum(same_ar.windows.values()), curve[con.compiled]["relative_cost"],
                                           curve[con.compiled]["relative_cost_cpu"], speedup, speedup_cpu,
                                           roofline.tokens_per_pass(cfg.image_tokens, nfe),
                                           roofline.ar_step_ratio(curve[con.compiled]) if con.method != "ar" else (1.0, 1.0)),
                **({COMMITS_KEY: con.commits} if con.commits is not None else {}),
                "tokens_per_forward": cfg.image_tokens / nfe,
                "single_token_passes": share(con.commits, 1) if con.commits else float("nan"),
                **roofline.chooser_fields(con.decodes, speedup),
            }
            rows.append(batch_rows[con])
        if partial:  # the timings before the counts: a run cut short while profiling (slow on a GPU) keeps them
            partial(snapshot())
        for con in contenders:
            progress(f"B={batch}: syncs and ops of {con.method}{' (compiled)' if con.compiled else ''} ...")
            syncs, ops, sync_names = con.counts()
            batch_rows[con].update(syncs_per_step=syncs, syncs_by_name=sync_names, ops_per_step=ops)
            if partial:
                partial(snapshot())
    return snapshot()


# ---- tables --------------------------------------------------------------------------------------


def _windows_text(windows: dict, top: int = 3) -> str:
    """The most used windows with their share of passes, e.g. ``16:92% 8:5% 4:2%``."""
    total = sum(windows.values()) or 1
    common = sorted(windows.items(), key=lambda kv: (-kv[1], -int(kv[0])))[:top]
    return " ".join(f"{w}:{100 * n / total:.0f}%" for w, n in common) + (" ..." if len(windows) > top else "")


def _count(value: Optional[float], digits: int) -> str:
    """A per-step count, or ``-`` where the run stopped before counting it."""
    return "-" if value is None else f"{value:.{digits}f}"


def format_sweep_table(result: dict) -> str:
    """The batch sweep's table: one line per batch size, compile setting and method."""
    c = result["config"]
    head = (f"{c['model']}, {c['image_tokens']} tokens, vocab {c['vocab_size']}, guidance {c['guidance_scale']}, "
            f"{c['threads']} thread(s), {c['device']} {c['dtype']}, torch {c['torch']}; medians of {c['rounds']} interleaved "
            f"round(s); speed-ups: medians of per-round time ratios")
    width = max([20] + [len(row["method"]) for row in result["rows"]])
    header = (f"{'B':>3} {'method':<{width}} {'mode':<8} {'img/s':>8} {'s/img':>8} {'vs AR':>6} {'vs eager AR':>11} "
              f"{'step x':>6} {'syncs/step':>10} {'ops/step':>8}  windows (share of passes)")
    lines = [head, header, "-" * len(header)]
    last = None
    for row in result["rows"]:
        if last is not None and row["batch_size"] != last:
            lines.append("")
        last = row["batch_size"]
        line = (f"{row['batch_size']:>3} {row['method']:<{width}} {'compiled' if row['compile'] else 'eager':<8} "
                f"{row['images_per_s']:>8.3f} {row['s_per_image']:>8.3f} {row['speedup_vs_ar']:>6.2f} "
                f"{row['speedup_vs_eager_ar']:>11.2f} {row['step_compression']:>6.2f} {_count(row['syncs_per_step'], 2):>10} "
                f"{_count(row['ops_per_step'], 0):>8}  {_windows_text(row['windows_total'])}")
        if row["compiles_in_timed"]:
            line += f"  [compiled {row['compiles_in_timed']} graph(s) in timed runs]"
        lines.append(line)
    return "\n".join(lines)


def format_table(result: dict) -> str:
    """A fixed-width table of a bench result (either mode), then the tokens committed per pass of each method
    (:func:`vispec.eval.bench.commits.format_commits_table`)."""
    commits = format_commits_table(result)
    main = format_sweep_table(result) if "rows" in result else _format_methods_table(result)
    note = result.get("config", {}).get("model_note")  # an inflated model: whose logits, at which cost
    parts = [main]
    chooser = format_chooser(result)
    if chooser:
        parts.append(chooser)
    if "roofline" in result:
        parts.append(format_roofline(result))
    if commits:
        parts.append(commits)
    if "kernels" in result:
        from vispec.eval.bench.kernels import format_kernel_table

        parts.append("kernels (vispec bench kernels at this model's vocabulary; on CUDA also 16384)\n" + format_kernel_table(result["kernels"]))
    return (f"model: {note}\n" if note else "") + "\n\n".join(parts)


def _rows_of(result: dict) -> list[dict]:
    """The sweep's rows, or the one-batch-size run's methods as rows (eager, their speed-up from latency)."""
    if "rows" in result:
        return result["rows"]
    batch = result.get("config", {}).get("batch_size", 1)
    return [{**r, "method": m, "batch_size": batch, "compile": False, "speedup_vs_ar": r.get("speedup"),
             "speedup_vs_ar_cpu": r.get("speedup_cpu")} for m, r in result["methods"].items()]


def format_chooser(result: dict) -> str:
    """The shape chooser's table (:func:`vispec.eval.bench.roofline.format_chooser_table`) of either mode; empty when no
    row ran the chooser (or SJD-PAC's fixed shape)."""
    return roofline.format_chooser_table(_rows_of(result), result.get("config", {}).get("cost_curve", "measured"))


def format_roofline(result: dict) -> str:
    """The roofline table of either mode (:func:`vispec.eval.bench.roofline.format_roofline_table`), and with
    ``--cuda-graphs`` the graphs inductor ran without a CUDA graph."""
    roof = result["roofline"]
    text = format_roofline_table(_rows_of(result), roof["curves"], roof["at"])
    if "cuda_graphs" in result:
        skips = result["cuda_graphs"]["cudagraph_skips"]
        text += (f"\nCUDA graphs (torch.compile mode {result['cuda_graphs']['mode']}): inductor ran compiled graphs without "
                 f"a CUDA graph {skips} time(s)" + (" (see vispec.decoding.compiled)" if skips else " (every compiled step is a CUDA graph)"))
        for reason in result["cuda_graphs"].get("skip_reasons", []):
            text += f"\n  skipped: {reason}"
    return text


def _format_methods_table(result: dict) -> str:
    """The one-batch-size table: one line per method."""
    cols = [("method", "{:<16}"), ("nfe", "{:>8.1f}"), ("acc/fwd", "{:>8.3f}"), ("step x", "{:>7.2f}"), ("1-token", "{:>8.1%}"),
            ("latency s", "{:>10.3f}"), ("speedup", "{:>8.2f}"), ("img/s", "{:>7.2f}"), ("peak MB", "{:>8.0f}")]
    keys = ["nfe", "accepted_per_forward", "step_compression", "single_token_passes", "latency_s", "speedup", "images_per_s",
            "peak_mem_mb"]
    header = " ".join(f"{name:<16}" if i == 0 else f"{name:>{len(fmt.format(0.0))}}" for i, (name, fmt) in enumerate(cols))
    lines = [header, "-" * len(header)]
    for method, res in result["methods"].items():
        cells = [cols[0][1].format(method)] + [fmt.format(res[k]) for (_, fmt), k in zip(cols[1:], keys)]
        lines.append(" ".join(cells))
    return "\n".join(lines)


def commits_plot(result: dict, path: str, size: tuple[int, int] = (900, 600)) -> str:
    """``--plot PATH``: the histogram of tokens committed per pass, one colour per method, at ``<PATH stem>.commits.png``
    (:func:`vispec.eval.bench.commits.commits_plot`); returns that path."""
    from vispec.eval.bench import commits

    return commits.commits_plot(result, path, size)
