"""The ``vispec`` command line.

User errors (bad arguments, unreadable files) print one ``vispec: error: ...`` line and exit with
status 2; no traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
from typing import Optional, Sequence

from vispec.cli_text import add_bench_text, add_generate_text
from vispec.version import __version__


def _method_list(text: str) -> tuple[str, ...]:
    """``--methods a,b,c`` as a tuple; an empty list is a user error. A ``key=value`` item continues the
    previous label's options (``mc-sjd+lantern:k=10,delta=0.1`` stays one label)."""
    methods: list[str] = []
    for item in (m.strip() for m in text.split(",")):
        if not item:
            continue
        if methods and re.match(r"^[A-Za-z_]+=", item):
            methods[-1] += "," + item
        else:
            methods.append(item)
    methods = tuple(methods)
    if not methods:
        raise ValueError("--methods is empty")
    return methods


def _add_decoder_bench_args(parser: argparse.ArgumentParser) -> None:
    from vispec.eval.bench_decoders import ALL_METHODS, DecoderBenchConfig

    d = DecoderBenchConfig()
    parser.add_argument("--model", default=d.model, help="named GPT config, randomly initialised (default: %(default)s)")
    parser.add_argument("--vocab-size", type=int, default=d.vocab_size)
    parser.add_argument("--image-tokens", type=int, default=d.image_tokens, help="tokens per image (a square number)")
    parser.add_argument("--num-classes", type=int, default=d.num_classes)
    parser.add_argument("--init-std", type=float, default=d.init_std, help="std of the random weights (LlamaGen: 0.02)")
    parser.add_argument("--methods", default=",".join(ALL_METHODS), help="comma-separated (default: all)")
    parser.add_argument("--window", type=int, default=d.window)
    parser.add_argument("--num-images", type=int, default=d.num_images)
    parser.add_argument("--batch-size", type=int, default=d.batch_size)
    parser.add_argument("--guidance-scale", type=float, default=d.guidance_scale)
    parser.add_argument("--temperature", type=float, default=d.temperature)
    parser.add_argument("--top-k", type=int, default=d.top_k)
    parser.add_argument("--top-p", type=float, default=d.top_p)
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--device", default=d.device)
    parser.add_argument("--dtype", default=d.dtype)
    parser.add_argument("--json", dest="json_path", default=None, help="write the results as JSON to this file")


def _decoder_bench_config(args: argparse.Namespace):
    from vispec.eval.bench_decoders import DecoderBenchConfig

    methods = _method_list(args.methods)
    return DecoderBenchConfig(
        model=args.model, vocab_size=args.vocab_size, image_tokens=args.image_tokens, num_classes=args.num_classes,
        init_std=args.init_std, methods=methods, window=args.window, num_images=args.num_images,
        batch_size=args.batch_size, guidance_scale=args.guidance_scale, temperature=args.temperature,
        top_k=args.top_k, top_p=args.top_p, seed=args.seed, device=args.device, dtype=args.dtype,
    )


def _cmd_bench_decoders(args: argparse.Namespace) -> int:
    from vispec.eval.bench_decoders import emit, format_table, run_decoder_bench

    result = run_decoder_bench(_decoder_bench_config(args), progress=lambda msg: print(msg, file=sys.stderr))
    emit(format_table(result), result, args.json_path)
    return 0


def _cmd_bench_image(args: argparse.Namespace) -> int:
    from vispec.eval.bench_decoders import emit
    from vispec.eval.bench_image import ImageBenchConfig, format_image_table, run_image_bench, speed_fid_plot

    methods = _method_list(args.methods)
    cfg = ImageBenchConfig(model=args.model, methods=methods, num_images=args.num_images, batch_size=args.batch_size,
                           latency_images=args.latency_images, real_images=args.real_images,
                           noise_repeats=args.noise_repeats, seed=args.seed,
                           guidance_scale=args.guidance_scale, temperature=args.temperature, top_k=args.top_k,
                           top_p=args.top_p, evaluator=args.evaluator, device=args.device,
                           lantern_k=tuple(int(k) for k in args.lantern_k.split(",")),
                           lantern_delta=tuple(float(d) for d in args.lantern_delta.split(",")))
    result = run_image_bench(cfg, progress=lambda msg: print(msg, file=sys.stderr, flush=True))
    emit(format_image_table(result), result, args.json_path)
    plot = args.plot or (os.path.splitext(args.json_path)[0] + ".png" if args.json_path else None)
    if plot:
        print(f"wrote {speed_fid_plot(result, plot)}")
    return 0


def _cmd_bench_kernels(args: argparse.Namespace) -> int:
    from vispec.eval.bench_decoders import emit
    from vispec.eval.bench_kernels import KernelBenchConfig, format_kernel_table, run_kernel_bench

    cfg = KernelBenchConfig(rows=tuple(args.rows), vocab=tuple(args.vocab), window=args.window,
                            guidance_scale=args.guidance_scale, dtype=args.dtype, device=args.device, repeats=args.repeats,
                            max_seconds=args.max_seconds, step_batch=args.step_batch, peak_gbps=args.peak_gbps,
                            ops=tuple(_method_list(args.ops)), compile_check=not args.no_compile_check, seed=args.seed)
    result = run_kernel_bench(cfg, progress=lambda msg: print(msg, file=sys.stderr, flush=True))
    emit(format_kernel_table(result), result, args.json_path)
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from vispec.eval.demo import run_demo

    run_demo(out_dir=args.out)
    return 0


TRAINERS = {
    # name: (module, config class, train function, help)
    "vq": ("vispec.eval.train_vq", "VQTrainConfig", "train_vq", "the tiny-c2i VQ tokenizer"),
    "evaluator": ("vispec.eval.evaluator", "EvaluatorTrainConfig", "train_evaluator", "the tiny-c2i crop classifier (accuracy, FID features)"),
    "gpt": ("vispec.eval.train_gpt", "GPTTrainConfig", "train_gpt", "the tiny-c2i LlamaGen GPT (needs a trained VQ)"),
    "assemble": ("vispec.eval.assemble", "AssembleConfig", "assemble", "write the trained parts as the embedded tiny-c2i pipeline"),
    "drafter": ("vispec.eval.train_drafter", "DrafterTrainConfig", "train_drafter", "the tiny-c2i-drafter GPT, distilled from tiny-c2i's samples"),
    "assemble-drafter": ("vispec.eval.train_drafter", "DrafterAssembleConfig", "assemble_drafter", "add a trained drafter (and LANTERN's neighbour table) to a pipeline folder"),
    "mdlm": ("vispec.eval.train_mdlm", "MDLMTrainConfig", "train_mdlm", "the tiny-mdlm masked diffusion LM (task suite, tokenizer, SFT)"),
    "assemble-mdlm": ("vispec.eval.assemble_mdlm", "MDLMAssembleConfig", "assemble_mdlm", "write a trained mdlm as the embedded tiny-mdlm pipeline"),
}


def _add_dataclass_args(parser: argparse.ArgumentParser, config_cls: type) -> None:
    """One ``--flag`` per dataclass field (ints, floats, strings), defaulting to the field's default."""
    for f in dataclasses.fields(config_cls):
        default = f.default
        if isinstance(default, (bool, tuple)) or default is dataclasses.MISSING:
            continue
        parser.add_argument("--" + f.name.replace("_", "-"), type=type(default), default=default, help=f"(default: {default})")


def _cmd_train(args: argparse.Namespace) -> int:
    import importlib

    module, config_name, func_name, _ = TRAINERS[args.train]
    mod = importlib.import_module(module)
    config_cls = getattr(mod, config_name)
    names = {f.name for f in dataclasses.fields(config_cls)}
    config = config_cls(**{k: v for k, v in vars(args).items() if k in names})
    print(json.dumps(getattr(mod, func_name)(config), indent=2))
    return 0


# LlamaGen's evaluation CFG per model size (GETTING_STARTED: 2.0 for B and L, 1.75 for XL and XXL, 1.65 for 3B)
LLAMAGEN_CFG = {"GPT-B": 2.0, "GPT-L": 2.0, "GPT-XL": 1.75, "GPT-XXL": 1.75, "GPT-3B": 1.65}


def _cmd_convert_llamagen(args: argparse.Namespace) -> int:
    from vispec.decoding import DecodingConfig
    from vispec.models.llamagen_checkpoint import load_llamagen_gpt
    from vispec.models.llamagen_vq import load_llamagen_vq
    from vispec.pipelines import LlamaGenPipeline

    overrides = {k: v for k, v in (("gpt_model", args.gpt_model), ("n_head", args.n_head), ("image_size", args.image_size),
                                   ("num_classes", args.num_classes), ("cls_token_num", args.cls_token_num)) if v is not None}
    gpt = load_llamagen_gpt(args.gpt, trust_pickle=args.trust_pickle, **overrides)
    vq = load_llamagen_vq(args.vq, variant=args.vq_variant, trust_pickle=args.trust_pickle)
    if vq.config.num_vq_embeddings != gpt.config.vocab_size:
        raise ValueError(f"--vq codebook has {vq.config.num_vq_embeddings} codes but --gpt predicts {gpt.config.vocab_size} tokens")
    guidance = LLAMAGEN_CFG.get(args.gpt_model or "", 2.0) if gpt.has_unconditional else 1.0
    config = DecodingConfig(strategy="sjd", window=16, init="horizontal", guidance_scale=guidance)
    LlamaGenPipeline(transformer=gpt, vqvae=vq, decoding_config=config).save_pretrained(args.out)
    print(f"wrote {args.out} (GPT {sum(p.numel() for p in gpt.parameters()) / 1e6:.1f}M parameters, "
          f"{gpt.grid_size}x{gpt.grid_size} tokens, default CFG {guidance})")
    return 0


def _cmd_generate_image(args: argparse.Namespace) -> int:
    import torch

    from vispec.pipelines import LlamaGenPipeline

    if args.quiet:
        from diffusers.utils import logging as diffusers_logging

        diffusers_logging.disable_progress_bar()
    pipe = LlamaGenPipeline.from_pretrained(args.model)
    pipe.set_progress_bar_config(disable=args.quiet)
    if args.num_images < 1:
        raise ValueError(f"--num-images must be >= 1, got {args.num_images}")
    generators = [torch.Generator().manual_seed(args.seed + i) for i in range(args.num_images)]
    out = pipe(class_labels=[args.class_label] * args.num_images, guidance_scale=args.guidance_scale,
               temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, decoding=args.decoding,
               generator=generators)
    stem, ext = os.path.splitext(args.out)
    for i, (image, stats) in enumerate(zip(out.images, out.stats)):
        path = args.out if args.num_images == 1 else f"{stem}-{i}{ext or '.png'}"
        image.save(path)
        print(f"{path}: {stats['method']} NFE {stats['nfe']} for {stats['tokens']} tokens "
              f"({stats['tokens_per_forward']:.2f} tokens/forward), {stats['latency_s']:.2f} s")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vispec", description="Many tokens per forward pass for visual AR models and masked diffusion LMs.")
    parser.add_argument("--version", action="version", version=f"vispec {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", metavar="BENCH")
    decoders = bench.add_parser("decoders", help="AR vs SJD vs MC-SJD on a randomly initialised LlamaGen GPT")
    _add_decoder_bench_args(decoders)
    decoders.set_defaults(func=_cmd_bench_decoders)
    image_bench = bench.add_parser("image", help="speed, accuracy and FID of the decoders on a LlamaGen pipeline")
    image_bench.add_argument("--model", default="tiny-c2i", help="embedded model or pipeline folder (default: %(default)s)")
    image_bench.add_argument("--methods", default="ar,sjd,mc-sjd",
                             help="decoding labels, e.g. ar,sjd,mc-sjd,sjd:window=4,mc-sjd+lantern,gsd,sd,sd+lantern "
                                  "(default: %(default)s)")
    image_bench.add_argument("--num-images", type=int, default=1000, help="images per method for accuracy and FID")
    image_bench.add_argument("--batch-size", type=int, default=32)
    image_bench.add_argument("--latency-images", type=int, default=16, help="images decoded one at a time for batch-1 latency")
    image_bench.add_argument("--noise-repeats", type=int, default=3, help="extra AR runs with other seeds for the FID/accuracy noise")
    image_bench.add_argument("--real-images", type=int, default=1000, help="held-out real crops for FID")
    image_bench.add_argument("--seed", type=int, default=0)
    image_bench.add_argument("--guidance-scale", type=float, default=None)
    image_bench.add_argument("--temperature", type=float, default=None)
    image_bench.add_argument("--top-k", type=int, default=None)
    image_bench.add_argument("--top-p", type=float, default=None)
    image_bench.add_argument("--evaluator", default=None, help="CropClassifier folder (default: <model>/evaluator)")
    image_bench.add_argument("--device", default="cpu")
    image_bench.add_argument("--lantern-k", default="1000", help="comma-separated k values swept for every '+lantern' method")
    image_bench.add_argument("--lantern-delta", default="0.1", help="comma-separated delta values swept for every '+lantern' method")
    image_bench.add_argument("--plot", default=None, help="speed-versus-FID PNG (default: next to --json)")
    image_bench.add_argument("--json", dest="json_path", default=None)
    image_bench.set_defaults(func=_cmd_bench_image)
    add_bench_text(bench)
    kernels = bench.add_parser("kernels", help="Triton verification/unmasking kernels against the PyTorch reference")
    kernels.add_argument("--rows", type=int, nargs="+", default=[16, 128, 512, 2048], help="rows per call (default: %(default)s)")
    kernels.add_argument("--vocab", type=int, nargs="+", default=[8192, 16384, 126464], help="vocabulary sizes (default: %(default)s)")
    kernels.add_argument("--ops", default="verify,unmask", help="comma-separated: verify, unmask (default: %(default)s)")
    kernels.add_argument("--window", type=int, default=16, help="rows per sample in a verification pass")
    kernels.add_argument("--guidance-scale", type=float, default=4.0, help="CFG scale fused into verification")
    kernels.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="logits dtype")
    kernels.add_argument("--device", default="auto", help="auto (cuda if available), cuda or cpu")
    kernels.add_argument("--repeats", type=int, default=0, help="timed calls per measurement (0: fit in --max-seconds)")
    kernels.add_argument("--max-seconds", type=float, default=5.0, help="time budget per measurement when --repeats is 0")
    kernels.add_argument("--step-batch", type=int, default=0, help="samples in the decoding-step shares (0: 32 on CUDA, 4 on CPU)")
    kernels.add_argument("--peak-gbps", type=float, default=None, help="device peak memory bandwidth (default: from the device name)")
    kernels.add_argument("--no-compile-check", action="store_true", help="skip the sm_80/sm_90 compile check on CPU")
    kernels.add_argument("--seed", type=int, default=0)
    kernels.add_argument("--json", dest="json_path", default=None)
    kernels.set_defaults(func=_cmd_bench_kernels)
    train = sub.add_parser("train", help="train the embedded models (needs vispec[train])")
    trainers = train.add_subparsers(dest="train", metavar="MODEL")
    for name, (module, config_name, _, help_text) in TRAINERS.items():
        import importlib

        sub_parser = trainers.add_parser(name, help=help_text)
        _add_dataclass_args(sub_parser, getattr(importlib.import_module(module), config_name))
        sub_parser.set_defaults(func=_cmd_train)
    convert = sub.add_parser("convert", help="convert official checkpoints").add_subparsers(dest="convert", metavar="FAMILY")
    llamagen = convert.add_parser("llamagen", help="LlamaGen GPT + VQ checkpoints -> a LlamaGenPipeline folder")
    llamagen.add_argument("--gpt", required=True, help="GPT checkpoint (.pt, any official layout, or .safetensors)")
    llamagen.add_argument("--vq", required=True, help="VQ checkpoint (vq_ds16_*.pt)")
    llamagen.add_argument("--out", required=True, help="output pipeline folder")
    llamagen.add_argument("--gpt-model", default=None, help="GPT-B, GPT-L, GPT-XL, ... (read from the checkpoint's args if absent)")
    llamagen.add_argument("--n-head", type=int, default=None, help="head count, for GPT names vispec does not know")
    llamagen.add_argument("--image-size", type=int, default=None, help="image size (needed for raw checkpoints)")
    llamagen.add_argument("--num-classes", type=int, default=None)
    llamagen.add_argument("--cls-token-num", type=int, default=None)
    llamagen.add_argument("--vq-variant", default="VQ-16", help="VQ-16 or VQ-8")
    llamagen.add_argument("--trust-pickle", action="store_true",
                          help="allow checkpoints that pickle Python objects (official DDP files pickle their args); runs the pickle")
    llamagen.set_defaults(func=_cmd_convert_llamagen)
    generate = sub.add_parser("generate", help="generate samples").add_subparsers(dest="generate", metavar="KIND")
    image = generate.add_parser("image", help="class-conditional images from a LlamaGen pipeline")
    image.add_argument("--model", default="tiny-c2i", help="embedded model name or a pipeline folder (default: %(default)s)")
    image.add_argument("--class", dest="class_label", type=int, required=True)
    image.add_argument("--decoding", default=None,
                       help="ar, sjd[-init], mc-sjd[-coupling], sd, optionally +lantern[:k=..,delta=..] or +gsd (lossy); "
                            "default: the pipeline's")
    image.add_argument("--seed", type=int, default=0)
    image.add_argument("--num-images", type=int, default=1)
    image.add_argument("--guidance-scale", type=float, default=None)
    image.add_argument("--temperature", type=float, default=None)
    image.add_argument("--top-k", type=int, default=None)
    image.add_argument("--top-p", type=float, default=None)
    image.add_argument("--out", default="image.png")
    image.add_argument("--quiet", action="store_true", help="no progress bar")
    image.set_defaults(func=_cmd_generate_image)
    add_generate_text(generate)
    demo = sub.add_parser("demo", help="the main job: compare the decoders and write a report")
    demo.add_argument("--out", default="out/demo", help="report folder (default: %(default)s)")
    demo.set_defaults(func=_cmd_demo)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "func"):
        parser.print_help()
        return 2
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, OSError) as err:
        print(f"vispec: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
