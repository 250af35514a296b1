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
COMMANDS = {"LlamaGenPipeline": "vispec generate image", "UnifiedImagePipeline": "vispec generate image",
            "MaskedDiffusionLMPipeline": "vispec generate text"}


def _load(pipeline_cls, name: str):
    """The pipeline ``name`` names, after checking its folder: the right kind of pipeline (a clear error naming
    the command for the kind it is, instead of diffusers' "expected [...] but only set() were passed"), every
    component folder present, weights that fit their configs (nothing allocated before that). ``pipeline_cls``
    may be a tuple of accepted classes: the folder's own kind is loaded."""
    from vispec.models.checkpoints import check_pipeline_folder, pipeline_kind
    from vispec.pipelines.embedded import resolve_model_path

    folder = resolve_model_path(name)
    classes = pipeline_cls if isinstance(pipeline_cls, tuple) else (pipeline_cls,)
    found = pipeline_kind(folder)
    chosen = next((c for c in classes if c.__name__ == found), classes[0])
    check_pipeline_folder(folder, chosen.__name__, {kind: f"use `{command}`" for kind, command in COMMANDS.items()})
    return chosen.from_pretrained(folder)


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

    from vispec.pipelines import LlamaGenPipeline, UnifiedImagePipeline

    for flag, value in (("--num-images", args.num_images), ("--batch-size", args.batch_size)):
        if value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    check_output_file(args.out, "--out", image=True)
    from vispec.models.checkpoints import pipeline_kind
    from vispec.pipelines.embedded import resolve_model_path

    text = pipeline_kind(resolve_model_path(args.model)) == UnifiedImagePipeline.__name__
    _check_condition_flags(args, text)
    _quiet(args)
    pipe = _load((LlamaGenPipeline, UnifiedImagePipeline), args.model)
    pipe.set_progress_bar_config(disable=args.quiet)
    paths = image_paths(args.out, args.num_images)
    for lo in range(0, args.num_images, args.batch_size):
        hi = min(lo + args.batch_size, args.num_images)
        generators = [torch.Generator().manual_seed(args.seed + i) for i in range(lo, hi)]
        common = dict(guidance_scale=args.guidance_scale, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                      decoding=args.decoding, generator=generators, max_batch_size=args.max_batch_size)
        if text:
            out = pipe(prompt=[args.prompt] * (hi - lo), negative_prompt=args.negative_prompt, height=args.height,
                       width=args.width, **common)
        else:
            out = pipe(class_labels=[args.class_label] * (hi - lo), compile=args.compile, **common)
        for path, image, stats in zip(paths[lo:hi], out.images, out.stats):
            image.save(path)
            print(f"{path}: {stats['method']} NFE {stats['nfe']} for {stats['tokens']} tokens "
                  f"({stats['tokens_per_forward']:.2f} tokens/forward), {stats['latency_s']:.2f} s", flush=True)
    return 0


def _check_condition_flags(args: argparse.Namespace, text: bool) -> None:
    """A text-to-image folder takes --prompt (and --negative-prompt, --height, --width); a class-conditional one
    takes --class."""
    if text:
        if args.prompt is None or args.class_label is not None:
            raise ValueError(f"{args.model} is a text-to-image pipeline: pass --prompt (not --class)")
        if args.compile:
            raise ValueError("--compile is not supported for unified-token (text-to-image) models yet")
        return
    if args.class_label is None or args.prompt is not None:
        raise ValueError(f"{args.model} is a class-conditional pipeline: pass --class (not --prompt)")
    for flag, value in (("--negative-prompt", args.negative_prompt), ("--height", args.height), ("--width", args.width)):
        if value is not None:
            raise ValueError(f"{flag} applies to text-to-image pipelines; {args.model} is class-conditional")


def _cmd_text(args: argparse.Namespace) -> int:
    import torch

    from vispec.dllm import make_scheduler
    from vispec.eval.bench.text import RULES, TextBenchConfig
    from vispec.pipelines import MaskedDiffusionLMPipeline

    _quiet(args)
    settings = {"threshold": {"threshold": args.threshold}, "factor": {"factor": args.factor},
                "entropy": {"gamma": args.entropy_bound}, "llada": {"remasking": args.remasking},
                "contiguous": {"threshold": args.threshold}, "learn2pd": {"threshold": args.filter_threshold},
                "dream": {"alg": args.dream_alg}}
    if args.strategy not in settings:
        raise ValueError(f"--strategy must be one of {tuple(settings)}, got {args.strategy!r}")
    if args.steps is not None and args.steps < 1:
        raise ValueError(f"--steps must be >= 1 (or left out: one step per token), got {args.steps}")
    rules = [r for r in args.rules.split(",") if r] if args.rules else []
    unknown = [r for r in rules if r not in RULES]
    if unknown:
        raise ValueError(f"--rules must be comma-separated names from {RULES}, got {args.rules!r}")
    knobs = TextBenchConfig(filter_threshold=args.filter_threshold, prophet_thresholds=tuple(args.prophet_thresholds),
                            delimiters=tuple(args.delimiters), delimiter_threshold=args.delimiter_threshold)
    knobs.rule_options(set(rules), None)  # validates the rules' settings before the model loads
    scheduler = make_scheduler(args.strategy, **settings[args.strategy])
    pipe = _load(MaskedDiffusionLMPipeline, args.model)
    pipe.set_progress_bar_config(disable=args.quiet)
    out = pipe(prompt=args.prompt, strategy=scheduler, cache=args.cache, gen_length=args.gen_length,
               block_length=args.block_length, steps=args.steps, temperature=args.temperature,
               guidance_scale=args.guidance_scale, early_stop_eos=args.early_stop_eos,
               generator=torch.Generator().manual_seed(args.seed), compile=args.compile,
               cache_reload_steps=args.cache_reload_steps, **knobs.rule_options(set(rules), pipe.tokenizer))
    stats = out.stats[0]
    print(out.texts[0])
    name = "+".join([args.strategy] + rules)
    print(f"[{name} + {args.cache} cache: NFE {stats['nfe']} for {stats['tokens']} tokens "
          f"({stats['tokens_per_forward']:.2f} tokens/forward), {stats['latency_s']:.3f} s]", file=sys.stderr)
    return 0


def add_generate(sub: argparse._SubParsersAction) -> None:
    from vispec.eval.bench.text import TextBenchConfig

    generate = sub.add_parser("generate", help="generate samples").add_subparsers(dest="subcommand", metavar="KIND")
    image = generate.add_parser("image", help="class-conditional images from a LlamaGen pipeline")
    image.add_argument("--model", default="tiny-c2i", help="embedded model name or a pipeline folder (default: %(default)s)")
    image.add_argument("--class", dest="class_label", type=int, default=None, help="class id (class-conditional models)")
    image.add_argument("--prompt", default=None, help="the text (text-to-image models, e.g. a converted Lumina-mGPT 2.0)")
    image.add_argument("--negative-prompt", default=None, help="text-to-image models whose guidance takes one (Emu3)")
    image.add_argument("--height", type=int, default=None, help="text-to-image: pixels (default: the model's)")
    image.add_argument("--width", type=int, default=None, help="text-to-image: pixels (default: the model's)")
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
    text.add_argument("--strategy", default="threshold",
                      help="llada, threshold, factor, entropy, contiguous, learn2pd (needs the model's filter) or dream "
                           "(default: %(default)s)")
    text.add_argument("--remasking", default="low_confidence", help="llada: low_confidence or random")
    text.add_argument("--dream-alg", default="entropy", help="dream: origin, maskgit_plus, topk_margin or entropy")
    text.add_argument("--rules", default="", help="comma-separated: eotp (end-of-text prediction), prophet (early "
                                                   "commit), adablock (adaptive blocks)")
    text.add_argument("--cache", default="none", help="none, prefix, dual or dkv (default: %(default)s)")
    text.add_argument("--cache-reload-steps", type=int, default=8, help="dkv: full refresh every N forwards of a block")
    text.add_argument("--steps", type=int, default=None, help="llada: total steps (default: gen length)")
    text.add_argument("--temperature", type=float, default=0.0)
    text.add_argument("--guidance-scale", type=float, default=1.0, help="1 = off (LLaDA's cfg_scale w is w + 1)")
    text.add_argument("--seed", type=int, default=0)
    text.add_argument("--compile", action="store_true", help="torch.compile the block loop's forwards")
    text.add_argument("--quiet", action="store_true", help="no progress bar")
    add_config_args(text, TextBenchConfig, only=STRATEGY_KNOBS, help=TEXT_HELP, flags=TEXT_FLAGS)
    text.set_defaults(func=_cmd_text)
