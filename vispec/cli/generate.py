"""``vispec generate image | text``: samples from a LlamaGen pipeline or a masked diffusion LM pipeline."""

from __future__ import annotations

import argparse
import os
import sys

from vispec.cli.args import add_config_args
from vispec.cli.paths import check_output_file
from vispec.cli.bench import STRATEGY_KNOBS, TEXT_FLAGS, TEXT_HELP


def _quiet(args: argparse.Namespace) -> None:
    if args.quiet:
        from diffusers.utils import logging as diffusers_logging

        diffusers_logging.disable_progress_bar()


# the pipeline kinds and the command that takes each
COMMANDS = {"LlamaGenPipeline": "vispec generate image", "MaskedDiffusionLMPipeline": "vispec generate text"}


def _load(pipeline_cls, name: str):
    """The pipeline ``name`` names, after checking its folder: the right kind of pipeline (a clear error naming
    the command for the kind it is, instead of diffusers' "expected [...] but only set() were passed"), every
    component folder present, weights that fit their configs (nothing allocated before that)."""
    from vispec.models.checkpoints import check_pipeline_folder
    from vispec.pipelines.embedded import resolve_model_path

    folder = resolve_model_path(name)
    check_pipeline_folder(folder, pipeline_cls.__name__, {kind: f"use `{command}`" for kind, command in COMMANDS.items()})
    return pipeline_cls.from_pretrained(folder)


def image_paths(out: str, num_images: int) -> list[str]:
    """Where ``generate image`` saves: ``out`` for one image, ``stem-i.ext`` for several."""
    if num_images == 1:
        return [out]
    stem, ext = os.path.splitext(out)
    return [f"{stem}-{i}{ext}" for i in range(num_images)]


def _cmd_image(args: argparse.Namespace) -> int:
    """Images in chunks of ``--batch-size`` (each chunk saved before the next starts: memory stays bounded and
    an interrupted run keeps its images); per-image generators make every image independent of its chunk."""
    import torch

    from vispec.pipelines import LlamaGenPipeline

    for flag, value in (("--num-images", args.num_images), ("--batch-size", args.batch_size)):
        if value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    check_output_file(args.out, "--out", image=True)
    _quiet(args)
    pipe = _load(LlamaGenPipeline, args.model)
    pipe.set_progress_bar_config(disable=args.quiet)
    paths = image_paths(args.out, args.num_images)
    for lo in range(0, args.num_images, args.batch_size):
        hi = min(lo + args.batch_size, args.num_images)
        generators = [torch.Generator().manual_seed(args.seed + i) for i in range(lo, hi)]
        out = pipe(class_labels=[args.class_label] * (hi - lo), guidance_scale=args.guidance_scale,
                   temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, decoding=args.decoding,
                   generator=generators, compile=args.compile, max_batch_size=args.max_batch_size)
        for path, image, stats in zip(paths[lo:hi], out.images, out.stats):
            image.save(path)
            print(f"{path}: {stats['method']} NFE {stats['nfe']} for {stats['tokens']} tokens "
                  f"({stats['tokens_per_forward']:.2f} tokens/forward), {stats['latency_s']:.2f} s", flush=True)
    return 0


def _cmd_text(args: argparse.Namespace) -> int:
    import torch

    from vispec.dllm import make_scheduler
    from vispec.pipelines import MaskedDiffusionLMPipeline

    _quiet(args)
    settings = {"threshold": {"threshold": args.threshold}, "factor": {"factor": args.factor},
                "entropy": {"gamma": args.entropy_bound}, "llada": {"remasking": args.remasking}}
    if args.strategy not in settings:
        raise ValueError(f"--strategy must be one of {tuple(settings)}, got {args.strategy!r}")
    if args.steps is not None and args.steps < 1:
        raise ValueError(f"--steps must be >= 1 (or left out: one step per token), got {args.steps}")
    scheduler = make_scheduler(args.strategy, **settings[args.strategy])
    pipe = _load(MaskedDiffusionLMPipeline, args.model)
    pipe.set_progress_bar_config(disable=args.quiet)
    out = pipe(prompt=args.prompt, strategy=scheduler, cache=args.cache, gen_length=args.gen_length,
               block_length=args.block_length, steps=args.steps, temperature=args.temperature,
               guidance_scale=args.guidance_scale, early_stop_eos=args.early_stop_eos,
               generator=torch.Generator().manual_seed(args.seed), compile=args.compile)
    stats = out.stats[0]
    print(out.texts[0])
    print(f"[{args.strategy} + {args.cache} cache: NFE {stats['nfe']} for {stats['tokens']} tokens "
          f"({stats['tokens_per_forward']:.2f} tokens/forward), {stats['latency_s']:.3f} s]", file=sys.stderr)
    return 0


def add_generate(sub: argparse._SubParsersAction) -> None:
    from vispec.eval.bench.text import TextBenchConfig

    generate = sub.add_parser("generate", help="generate samples").add_subparsers(dest="subcommand", metavar="KIND")
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
    image.add_argument("--batch-size", type=int, default=16,
                       help="images per pipeline call; each call's images are saved before the next starts "
                            "(the images do not depend on it: one keyed generator per image) (default: %(default)s)")
    image.add_argument("--max-batch-size", type=int, default=None,
                       help="stream each call's images through this many batch slots (continuous batching; "
                            "default: all of the call's images at once)")
    image.add_argument("--compile", action="store_true",
                       help="torch.compile each decode step (ar, sjd, mc-sjd; the first steps compile)")
    image.add_argument("--out", default="image.png",
                       help="image file (.png, .jpg, ...); several images: STEM-0.png, STEM-1.png, ... (default: %(default)s)")
    image.add_argument("--quiet", action="store_true", help="no progress bar")
    image.set_defaults(func=_cmd_image)

    text = generate.add_parser("text", help="text from a masked diffusion LM pipeline")
    text.add_argument("--model", default="tiny-mdlm", help="embedded model name or a pipeline folder (default: %(default)s)")
    text.add_argument("--prompt", required=True)
    text.add_argument("--strategy", default="threshold", help="llada, threshold, factor or entropy (default: %(default)s)")
    text.add_argument("--remasking", default="low_confidence", help="llada: low_confidence or random")
    text.add_argument("--cache", default="none", help="none, prefix or dual (default: %(default)s)")
    text.add_argument("--steps", type=int, default=None, help="llada: total steps (default: gen length)")
    text.add_argument("--temperature", type=float, default=0.0)
    text.add_argument("--guidance-scale", type=float, default=1.0, help="1 = off (LLaDA's cfg_scale w is w + 1)")
    text.add_argument("--seed", type=int, default=0)
    text.add_argument("--compile", action="store_true", help="torch.compile the block loop's forwards")
    text.add_argument("--quiet", action="store_true", help="no progress bar")
    add_config_args(text, TextBenchConfig, only=STRATEGY_KNOBS, help=TEXT_HELP, flags=TEXT_FLAGS)
    text.set_defaults(func=_cmd_text)
