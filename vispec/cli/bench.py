"""``vispec bench decoders | image | text | kernels``: flags built from each benchmark's config dataclass.

Building the parser imports only the light config modules (:mod:`vispec.eval.bench.configs`,
:mod:`vispec.eval.bench.text`): torch, the models and the pipelines are imported when a benchmark runs, so
``vispec bench ... --help`` is instant."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from vispec.cli.args import add_config_args, config_from_args
from vispec.cli.paths import check_output_file

COST_CURVE_HELP = ("the step-cost curve the shape chooser (auto, sjd-pac:window=auto) and the auto window price passes "
                   "by: measured (this machine's, calibrated or read from the step-costs cache), flat (every shape and "
                   "window costs the same: what the chooser picks where a wide window costs what a narrow one does) or "
                   "PATH, a cost-curve JSON file as vispec keeps them in $VISPEC_CACHE_DIR/step-costs (e.g. recorded on a "
                   "GPU); flat and PATH are pinned (no measurement changes them) and the predicted speed-ups are then "
                   "relative to that curve (default: measured)")
DECODER_HELP = {
    "model": "named GPT config (GPT-mini, GPT-B, GPT-L, ...), randomly initialised, tiny-c2i (the embedded trained model), "
             "or tiny-c2i@GPT-L: tiny-c2i inflated to a GPT config's size (its logits at that model's cost)",
    "image_tokens": "tokens per image (a square number; tiny-c2i: at most 256)",
    "init_std": "std of the random weights (LlamaGen: 0.02)",
    "methods": "comma-separated decoding specs, e.g. ar,sjd,mc-sjd,mc-sjd:window=auto",
    "window": "window of the speculative specs that name none",
    "num_images": "images per method (a batch sweep: per measurement, at least one batch)",
    "batch_size": "batch size of the one-batch-size run (and of --compile without --batch-sizes)",
    "batch_sizes": "comma-separated batch sizes to sweep, interleaved timing rounds per size "
                   "(default: none, the one-batch-size run unless --compile)",
    "compile": "also time every method with torch.compile(fullgraph=True) decode steps (a batch sweep)",
    "rounds": "interleaved timing rounds of a batch sweep (medians are reported)",
    "threads": "torch threads (0: leave as is)",
    "cuda_graphs": "run the compiled decode steps as CUDA graphs (torch.compile mode reduce-overhead; needs --compile); "
                   "the result counts the steps inductor ran without a graph",
    "kernels": "also run `vispec bench kernels` (verification and unmasking kernels, GB/s and % of peak HBM bandwidth) at "
               "the model's vocabulary, into the same JSON and table",
    "cost_curve": COST_CURVE_HELP,
}
DISTRIBUTED_HELP = {
    "results_dir": "folder for every item's result, written as it finishes; a rerun with the same settings skips what "
                   "is there (shared storage for a multi-node run)",
    "num_processes": "the number of processes launched (torchrun --nproc_per_node x nodes); any other world size is an "
                     "error before work starts",
}
IMAGE_HELP = {
    "model": "embedded model or pipeline folder: a class-to-image LlamaGen pipeline (tiny-c2i) or a text-to-image "
             "UnifiedImagePipeline (tiny-t2i, or its folder models/pretrained/tiny-t2i); <model>@<GPT config> "
             "(tiny-c2i@GPT-L, tiny-t2i@GPT-B): its transformer inflated to that size, the same images at that cost",
    "methods": "decoding labels, e.g. ar,sjd,mc-sjd,sjd:window=4,mc-sjd+lantern,gsd,sd,sd+lantern,gad (sd and gad need "
               "a drafter: class-to-image only)",
    "num_images": "images per method for the quality metrics (accuracy and FID; text-to-image also CLIP score, on "
                  "held-out captions of both sizes, 64x64 and 64x96)",
    "latency_images": "images decoded one at a time for batch-1 latency",
    "noise_repeats": "extra AR runs with other seeds for the noise of FID and accuracy (text-to-image: and CLIP score)",
    "real_images": "held-out real images for FID (class-to-image: crops; text-to-image: scene renders)",
    "guidance_scale": "default: the pipeline's",
    "temperature": "default: the pipeline's",
    "top_k": "default: the pipeline's",
    "top_p": "default: the pipeline's",
    "evaluator": "CropClassifier folder, class-to-image models only (default: <model>/evaluator)",
    "clip": "CLIP folder (CLIPModel and CLIPProcessor) for CLIP score and FID features, text-to-image models only "
            "(default: <model>/clip)",
    "lantern_k": "comma-separated k values swept for every '+lantern' method",
    "lantern_delta": "comma-separated delta values swept for every '+lantern' method",
    "batch_sizes": "comma-separated batch sizes of a throughput sweep (images/s per batch size, interleaved rounds; "
                   "quality is measured once, at --batch-size: images do not depend on the batch) (default: none)",
    "compile": "also time the throughput sweep with torch.compile(fullgraph=True) decode steps, eager and compiled "
               "side by side (ar, sjd, mc-sjd; sd has no compiled rows; text-to-image models decode eagerly: eager "
               "rows only)",
    "rounds": "interleaved timing rounds of the throughput sweep (medians are reported)",
    "sweep_images": "images per measurement of the throughput sweep (rounded up to whole batches, at least one)",
    "cost_curve": COST_CURVE_HELP,
    **DISTRIBUTED_HELP,
}
TEXT_HELP = {
    "model": "embedded model name or a pipeline folder",
    "strategies": "comma-separated: llada, threshold, factor, entropy, contiguous, learn2pd (needs the model's filter), "
                  "editing (LLaDA2.1's token editing; block-causal models)",
    "settings": "comma-separated strategy[+rule...][@cache] (rules eotp, prophet, adablock, ssd[=K|=auto]; e.g. "
                "learn2pd+eotp@dual, llada+ssd=8, threshold+ssd=auto@dual, editing+ssd=auto@prefix); "
                "replaces the --strategies x --cache grid",
    "reference": "with --settings: run LLaDA's one-token baseline row too (the ratios NFE x and speedup need it)",
    "filter_threshold": "Learn2PD's acceptance threshold τ",
    "prophet_thresholds": "Prophet's top-2 logit-gap thresholds by progress thirds",
    "delimiters": "AdaBlock's delimiter tokens",
    "delimiter_threshold": "AdaBlock's delimiter confidence δ",
    "draft_length": "the ssd rule's canvases per verifying forward where a setting says only ssd",
    "caches": "comma-separated caches: none, prefix, dual, dkv",
    "tasks": "comma-separated: arithmetic, sort, reverse",
    "num_problems": "test problems per task",
    "batch_size": "the batched run's batch size (batch 1 always runs)",
    "batch_sizes": "comma-separated batch sizes of the batched runs, instead of --batch-size (batch 1 always runs), "
                   "e.g. 8,32: tokens/s at each and the batch-invariance check against batch 1",
    "threshold": "confidence threshold τ of the threshold and contiguous rules",
    "factor": "f of the factor rule",
    "entropy_bound": "entropy budget γ of the EB rule (nats)",
    "thresholds": "comma-separated τ values the threshold and contiguous rules run at, for their AUP curves "
                  "(default: --threshold alone)",
    "factors": "comma-separated f values the factor rule runs at (default: --factor alone)",
    "entropy_bounds": "comma-separated γ values the EB rule runs at (default: --entropy-bound alone)",
    "filter_thresholds": "comma-separated τ values learn2pd runs at (default: --filter-threshold alone)",
    "gen_length": "tokens to generate (default: the model's)",
    "block_length": "semi-AR block length (default: the model's)",
    "early_stop_eos": "keep decoding after EOS is committed",
    **DISTRIBUTED_HELP,
}
TEXT_FLAGS = {"caches": "--cache", "early_stop_eos": "--no-early-stop"}
# the unmasking knobs `generate text` shares with `bench text`
STRATEGY_KNOBS = ("threshold", "factor", "entropy_bound", "gen_length", "block_length", "early_stop_eos", "filter_threshold",
                  "prophet_thresholds", "delimiters", "delimiter_threshold", "draft_length")
KERNEL_HELP = {
    "rows": "rows per call",
    "vocab": "vocabulary sizes",
    "ops": "comma-separated: verify, unmask",
    "window": "rows per sample in a verification pass",
    "guidance_scale": "CFG scale fused into verification",
    "dtype": "logits dtype: float32, bfloat16 or float16",
    "device": "auto (cuda if available), cuda or cpu",
    "repeats": "timed calls per measurement (0: fit in --max-seconds)",
    "max_seconds": "time budget per measurement when --repeats is 0",
    "step_batch": "samples in the decoding-step shares (0: 32 on CUDA, 4 on CPU)",
    "peak_gbps": "device peak memory bandwidth (default: from the device name)",
    "compile_check": "skip the sm_80/sm_90 compile check on CPU",
    "step_shares": "skip the decoding-step shares (tiny-c2i and LlamaGen-B-sized forwards against verification)",
}


def _progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def split_specs(text: str, flag: str) -> tuple[str, ...]:
    """:func:`vispec.decoding.config.split_specs`, imported when a ``--methods`` flag is parsed (not for ``--help``)."""
    from vispec.decoding.config import split_specs as split

    return split(text, flag)


# bench name -> (module, config class, run function, table function)
BENCHES = {
    "decoders": ("vispec.eval.bench.decoders", "DecoderBenchConfig", "run_decoder_bench", "format_table"),
    "image": ("vispec.eval.bench.image", "ImageBenchConfig", "run_image_bench", "format_image_table"),
    "text": ("vispec.eval.bench.text", "TextBenchConfig", "run_text_bench", "format_text_table"),
    "kernels": ("vispec.eval.bench.kernels", "KernelBenchConfig", "run_kernel_bench", "format_kernel_table"),
}

# the benches with tqdm progress bars (on stderr, within each row or phase; --quiet turns them off): their run
# functions take progress_bar=None (a bar when stderr is a terminal) or False
BARS = ("image", "text", "kernels")

# bench name -> its plot function (the PNG goes next to --json unless --plot names it); image and decoders also
# (decoders: only) write the histogram of tokens committed per pass at <plot stem>.commits.png
PLOTS = {"image": "speed_fid_plot", "text": "accuracy_nfe_plot", "decoders": "commits_plot"}


def _cmd_bench(args: argparse.Namespace) -> int:
    """Run the benchmark named by the subcommand, print its table and write its JSON (and the image bench's plot).

    Output paths are checked before any work; the JSON is rewritten after every measured row or phase
    (marked ``"complete": false`` until the end), so an interrupted or failed run keeps what it measured."""
    from vispec.eval.bench.report import emit, write_partial

    check_output_file(args.json_path, "--json")
    plot = None
    if args.subcommand in PLOTS:
        plot = args.plot or (os.path.splitext(args.json_path)[0] + ".png" if args.json_path else None)
        check_output_file(plot, "--plot" if args.plot else "--plot (from --json)", image=True)
    module_name, config_name, run_name, table_name = BENCHES[args.subcommand]
    module = importlib.import_module(module_name)
    config = config_from_args(getattr(module, config_name), args)
    if hasattr(config, "validate"):  # the settings, before anything is loaded (the run checks them again)
        config.validate()
    written = []

    def partial(result: dict) -> None:
        write_partial(result, args.json_path)
        written.append(True)

    # None: a bar when stderr is a terminal
    extra = {"progress_bar": False if args.quiet else None} if args.subcommand in BARS else {}
    try:
        result = getattr(module, run_name)(config, progress=_progress, partial=partial if args.json_path else None, **extra)
    except BaseException as err:
        if written:
            err.add_note(f"the results measured so far are in {args.json_path}, marked \"complete\": false")
        raise
    if result is None:  # a process other than rank 0 of a distributed run: rank 0 reports
        return 0
    emit(getattr(module, table_name)(result), result, args.json_path)
    if plot:
        print(f"wrote {getattr(module, PLOTS[args.subcommand])(result, plot)}")
        commits = importlib.import_module("vispec.eval.bench.commits")
        if args.subcommand == "image" and commits.format_commits_table(result):  # speed_fid_plot's own condition
            print(f"wrote {commits.commits_plot_path(plot)}")
    return 0


def add_bench(sub: argparse._SubParsersAction) -> None:
    from vispec.eval.bench.configs import DecoderBenchConfig, ImageBenchConfig, KernelBenchConfig
    from vispec.eval.bench.text import TextBenchConfig

    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="subcommand", metavar="BENCH")
    specs = {"methods": split_specs}

    decoders = bench.add_parser("decoders", help="AR vs SJD vs MC-SJD on a LlamaGen GPT (random init or tiny-c2i), "
                                                "optionally swept over batch sizes, eager and compiled")
    add_config_args(decoders, DecoderBenchConfig, help=DECODER_HELP, splitters=specs)
    decoders.add_argument("--plot", default=None, help="histogram of tokens committed per pass: --plot PATH writes "
                                                       "<PATH stem>.commits.png (default: next to --json)")
    decoders.set_defaults(func=_cmd_bench)

    image = bench.add_parser("image", help="speed, accuracy and FID (text-to-image: and CLIP score) of the decoders on "
                                           "an image pipeline: class-to-image LlamaGen or text-to-image unified-token")
    add_config_args(image, ImageBenchConfig, help=IMAGE_HELP, splitters=specs)
    image.add_argument("--plot", default=None, help="speed-versus-FID PNG (default: next to --json), and the histogram "
                                                    "of tokens committed per pass at <PATH stem>.commits.png")
    image.set_defaults(func=_cmd_bench)

    text = bench.add_parser("text", help="accuracy and speed of unmasking strategies and caches on a masked diffusion LM")
    add_config_args(text, TextBenchConfig, help=TEXT_HELP, flags=TEXT_FLAGS)
    text.add_argument("--plot", default=None, help="accuracy-versus-NFE PNG, a panel per task (default: next to --json)")
    text.set_defaults(func=_cmd_bench)

    kernels = bench.add_parser("kernels", help="Triton verification/unmasking kernels against the PyTorch reference")
    add_config_args(kernels, KernelBenchConfig, help=KERNEL_HELP)
    kernels.set_defaults(func=_cmd_bench)
    for parser in (image, text, kernels):  # BARS
        parser.add_argument("--quiet", action="store_true",
                            help="no progress bars (there are none when stderr is not a terminal)")
    for parser in (decoders, image, text, kernels):
        parser.add_argument("--json", dest="json_path", default=None,
                            help="write the results as JSON to this file (rewritten after every measured row, "
                                 "\"complete\": false until the end)")
