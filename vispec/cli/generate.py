"""``vispec generate image | text``: samples from a LlamaGen pipeline or a masked diffusion LM pipeline."""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING

from vispec.cli.args import add_config_args
from vispec.cli.paths import check_output_file
from vispec.cli.bench import STRATEGY_KNOBS, TEXT_FLAGS, TEXT_HELP

if TYPE_CHECKING:
    from vispec.eval.bench.distributed import Workers


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


def _image_kind(name: str) -> "str | None":
    """The pipeline class of the folder ``name`` names, refused (naming the command to use) when it is not an
    image pipeline: a text model gets "use `vispec generate text`", not a word about ``--class``."""
    from vispec.models.checkpoints import check_pipeline_folder, pipeline_kind
    from vispec.pipelines.embedded import resolve_model_path

    folder = resolve_model_path(name)
    kind = pipeline_kind(folder)
    if COMMANDS.get(kind, "vispec generate image") != "vispec generate image":
        check_pipeline_folder(folder, "LlamaGenPipeline", {k: f"use `{c}`" for k, c in COMMANDS.items()})
    return kind


def _takes_captions(name: str, kind: "str | None") -> bool:
    """Whether the image pipeline ``name`` is conditioned on captions (``--prompt``): a unified-token folder, or a
    LlamaGen text-to-image one (``transformer/config.json``'s ``model_type``; its T5 ``text_encoder`` then encodes
    the prompt, :meth:`vispec.pipelines.LlamaGenPipeline.encode_prompt`)."""
    import json

    from vispec.pipelines.embedded import resolve_model_path

    if kind != "LlamaGenPipeline":
        return True
    try:
        with open(os.path.join(resolve_model_path(name), "transformer", "config.json")) as handle:
            return json.load(handle).get("model_type") == "t2i"
    except (OSError, ValueError, AttributeError):
        return False  # the loader then says what is wrong with the folder


def image_paths(out: str, num_images: int) -> list[str]:
    """Where ``generate image`` saves: ``out`` for one image, ``stem-i.ext`` for several."""
    if num_images == 1:
        return [out]
    stem, ext = os.path.splitext(out)
    return [f"{stem}-{i}{ext}" for i in range(num_images)]


def _class_labels(args: argparse.Namespace, num_classes: int) -> list[int]:
    """Image ``i``'s class: ``--class all`` is class-balanced, ``i mod num_classes`` (as FID-50K sampling does)."""
    if args.class_label == "all":
        return [i % num_classes for i in range(args.num_images)]
    label = int(args.class_label)  # its form was checked before loading (_check_condition_flags)
    if not 0 <= label < num_classes:
        raise ValueError(f"--class must be in [0, {num_classes}) for {args.model}, got {label}")
    return [label] * args.num_images


def _cmd_image(args: argparse.Namespace) -> int:
    """Images in units of ``--batch-size`` (each saved before the next starts: memory stays bounded and an
    interrupted run keeps its images; a rerun skips units whose images all exist). Image ``i`` has a generator
    seeded ``--seed + i``, so it does not depend on its unit. Under torchrun each process makes every
    ``W``-th unit (:mod:`vispec.eval.bench.distributed`); ``--npz`` packs every image, in order, on rank 0."""
    import torch

    from vispec.eval.bench.distributed import Workers, on_main_first
    from vispec.eval.bench.report import atomic_write
    from vispec.pipelines import LlamaGenPipeline, UnifiedImagePipeline

    for flag, value in (("--num-images", args.num_images), ("--batch-size", args.batch_size)):
        if value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    check_output_file(args.out, "--out", image=True)
    if args.npz is not None:
        check_output_file(args.npz, "--npz")
        if not args.npz.endswith(".npz"):
            raise ValueError(f"--npz must name a .npz file, got {args.npz!r}")
    kind = _image_kind(args.model)
    text, unified = _takes_captions(args.model, kind), kind == UnifiedImagePipeline.__name__
    _check_condition_flags(args, text, unified)
    source = _source_image(args.image) if args.image is not None else None  # read before the model loads
    workers = Workers.start(args.device, args.num_processes)
    _quiet(args)
    on_main_first(workers, lambda: _image_run_record(args, workers))  # --resume's settings, before the model loads
    pipe = _load((LlamaGenPipeline, UnifiedImagePipeline), args.model).to(workers.device)
    pipe.set_progress_bar_config(disable=args.quiet or not workers.is_main)
    labels = None if text else _class_labels(args, pipe.transformer.config.num_classes)
    paths = image_paths(args.out, args.num_images)
    for unit in workers.my_units(args.num_images, args.batch_size):
        lo, hi = unit.start, unit.stop
        if args.resume and all(os.path.exists(p) for p in paths[lo:hi]):
            continue  # made by the run being resumed
        generators = [torch.Generator().manual_seed(args.seed + i) for i in range(lo, hi)]
        common = dict(guidance_scale=args.guidance_scale, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                      decoding=args.decoding, generator=generators, max_batch_size=args.max_batch_size)
        if unified:
            edit = {} if source is None else {"image": source}
            out = pipe(prompt=[args.prompt] * (hi - lo), negative_prompt=args.negative_prompt, height=args.height,
                       width=args.width, **edit, **common)
        elif text:  # LlamaGen text-to-image: its T5 text encoder encodes the prompt
            out = pipe(prompt=[args.prompt] * (hi - lo), compile=args.compile, **common)
        else:
            out = pipe(class_labels=labels[lo:hi], compile=args.compile, **common)
        for path, image, stats in zip(paths[lo:hi], out.images, out.stats):
            atomic_write(path, image.save)  # a file at `path` is always whole: --resume skips it
            print(f"{path}: {stats['method']} NFE {stats['nfe']} for {stats['tokens']} tokens "
                  f"({stats['tokens_per_forward']:.2f} tokens/forward), {stats['latency_s']:.2f} s", flush=True)
    workers.barrier()
    if args.npz is not None and workers.is_main:
        _write_npz(paths, args.npz)
    return 0


def _image_run_record(args: argparse.Namespace, workers: Workers) -> None:
    """``STEM.run.json`` beside the images: the settings they are made with. ``--resume`` keeps the images of a run
    with the same settings (and refuses other settings, naming them); without it the record is rewritten and
    every image made anew."""
    from vispec.eval.bench.results import settings_record

    keys = ("model", "class_label", "prompt", "negative_prompt", "height", "width", "image", "decoding", "seed",
            "guidance_scale", "temperature", "top_k", "top_p", "batch_size", "max_batch_size", "compile")
    settings = {k: getattr(args, k) for k in keys} | {"device": workers.device.type}
    path = os.path.splitext(args.out)[0] + ".run.json"
    if not args.resume:
        if os.path.exists(path):
            os.unlink(path)
        if args.num_images == 1:
            return  # one image: nothing to resume, no record beside it
    elif not os.path.exists(path) and any(os.path.exists(p) for p in image_paths(args.out, args.num_images)):
        raise ValueError(f"--resume: images exist at {args.out} but no {path} records the settings they were made "
                         "with; run without --resume to make them anew")
    else:
        read_run_record(path, "--resume", "run without --resume to make every image anew")
    settings_record(path, settings, "--out", args.out)


def read_run_record(path: str, flag: str, remedy: str) -> "dict | None":
    """The settings record at ``path`` (a JSON object), None when there is none; a file that is not one (cut short,
    edited by hand) is a ``ValueError`` naming it, ``flag`` and ``remedy``, instead of a bare JSON parser message."""
    import json

    if not os.path.exists(path):
        return None
    try:
        with open(path, encoding="utf-8") as handle:
            record = json.load(handle)
    except (ValueError, UnicodeDecodeError) as err:  # JSONDecodeError is a ValueError
        raise ValueError(f"{flag}: {path} (the settings of the earlier run) is not valid JSON ({err}); {remedy}") from None
    if not isinstance(record, dict):
        raise ValueError(f"{flag}: {path} (the settings of the earlier run) must hold a JSON object, got "
                         f"{type(record).__name__}; {remedy}")
    return record


def _write_npz(paths: list[str], npz: str) -> None:
    """Every image, in order, as ``arr_0`` uint8 ``[N, H, W, 3]``: the sample batch the ADM / LlamaGen FID
    evaluator reads."""
    import numpy as np
    from PIL import Image

    from vispec.eval.bench.report import atomic_write

    first = np.asarray(Image.open(paths[0]).convert("RGB"))
    array = np.empty((len(paths), *first.shape), dtype=np.uint8)
    for i, path in enumerate(paths):
        image = np.asarray(Image.open(path).convert("RGB"))
        if image.shape != first.shape:
            raise ValueError(f"--npz needs images of one size: {path} is {image.shape[:2]}, {paths[0]} {first.shape[:2]}")
        array[i] = image
    atomic_write(npz, lambda temporary: np.savez(temporary, arr_0=array))
    print(f"wrote {npz}: {array.shape[0]} images of {array.shape[1]}x{array.shape[2]}", flush=True)


def _source_image(path: str):
    """``--image``: the source image of an edit, as an RGB PIL image (every image of the run edits it)."""
    import PIL.Image

    if not os.path.isfile(path):
        raise ValueError(f"--image {path!r} is not a file")
    try:
        with PIL.Image.open(path) as image:
            return image.convert("RGB")
    except (OSError, ValueError) as err:
        raise ValueError(f"--image {path!r} could not be read as an image ({err})") from None


def _check_condition_flags(args: argparse.Namespace, text: bool, unified: bool = True) -> None:
    """A text-to-image folder takes --prompt (a unified-token one also --negative-prompt, --height, --width, --image);
    a class-conditional one takes --class."""
    if text:
        if args.prompt is None or args.class_label is not None:
            raise ValueError(f"{args.model} is a text-to-image pipeline: pass --prompt (not --class)")
        if unified and args.compile:
            raise ValueError("--compile is not supported for unified-token (text-to-image) models yet")
        if not unified:
            for flag, value in (("--negative-prompt", args.negative_prompt), ("--height", args.height),
                                ("--width", args.width), ("--image", args.image)):
                if value is not None:
                    raise ValueError(f"{flag} applies to unified-token pipelines; {args.model} is a LlamaGen "
                                     "text-to-image pipeline (its image size is fixed by the model)")
        return
    if args.class_label is None or args.prompt is not None:
        raise ValueError(f"{args.model} is a class-conditional pipeline: pass --class (not --prompt)")
    if args.class_label != "all" and not args.class_label.lstrip("-").isdigit():
        raise ValueError(f"--class must be a class id or 'all', got {args.class_label!r}")
    for flag, value in (("--negative-prompt", args.negative_prompt), ("--height", args.height), ("--width", args.width),
                        ("--image", args.image)):
        if value is not None:
            raise ValueError(f"{flag} applies to text-to-image pipelines; {args.model} is class-conditional")


def _cmd_text(args: argparse.Namespace) -> int:
    import torch

    from vispec.dllm import make_scheduler
    from vispec.eval.bench.text import TextBenchConfig, parse_rule
    from vispec.pipelines import MaskedDiffusionLMPipeline

    _quiet(args)
    settings = {"threshold": {"threshold": args.threshold}, "factor": {"factor": args.factor},
                "entropy": {"gamma": args.entropy_bound}, "llada": {"remasking": args.remasking},
                "contiguous": {"threshold": args.threshold}, "learn2pd": {"threshold": args.filter_threshold},
                "dream": {"alg": args.dream_alg}, "editing": {}}
    if args.strategy is not None and args.strategy not in settings:
        raise ValueError(f"--strategy must be one of {tuple(settings)} (or left out: the model's own policy), got "
                         f"{args.strategy!r}")
    if args.steps is not None and args.steps < 1:
        raise ValueError(f"--steps must be >= 1 (or left out: one step per token), got {args.steps}")
    if args.gen_length is not None and args.block_length is not None and (
            args.gen_length < 1 or args.block_length < 1 or args.gen_length % args.block_length):
        raise ValueError(f"--gen-length ({args.gen_length}) must be a positive multiple of --block-length "
                         f"({args.block_length})")
    rules = [r for r in args.rules.split(",") if r] if args.rules else []
    names = [parse_rule(rule, "--rules")[0] for rule in rules]
    if len(set(names)) != len(names):
        raise ValueError(f"--rules names a rule twice: {args.rules!r}")
    knobs = TextBenchConfig(filter_threshold=args.filter_threshold, prophet_thresholds=tuple(args.prophet_thresholds),
                            delimiters=tuple(args.delimiters), delimiter_threshold=args.delimiter_threshold,
                            draft_length=args.draft_length)
    knobs.rule_options(set(rules), None)  # validates the rules' settings before the model loads
    # None: the pipeline's own saved policy (tiny-llada2: LLaDA2's editing rule)
    scheduler = None if args.strategy is None else make_scheduler(args.strategy, **settings[args.strategy])
    if args.strategy is None:  # a knob of a named strategy is not silently dropped
        defaults = TextBenchConfig()
        for flag, value, default in (("--factor", args.factor, defaults.factor),
                                     ("--entropy-bound", args.entropy_bound, defaults.entropy_bound),
                                     ("--filter-threshold", args.filter_threshold, defaults.filter_threshold),
                                     ("--remasking", args.remasking, "low_confidence"),
                                     ("--dream-alg", args.dream_alg, "entropy")):
            if value != default:
                raise ValueError(f"{flag} sets a knob of a strategy: pass --strategy too (without it the model's own "
                                 "saved policy runs; --threshold applies to it where it has one)")
    prompts = _prompts(args)
    if prompts is not None:
        return _text_many(args, prompts, scheduler, knobs, rules)
    from vispec.eval.bench.report import check_device

    pipe = _load(MaskedDiffusionLMPipeline, args.model).to(check_device(args.device))
    pipe.set_progress_bar_config(disable=args.quiet)
    out = pipe(prompt=args.prompt, strategy=scheduler, generator=torch.Generator().manual_seed(args.seed),
               **_text_options(args, pipe, knobs, rules))
    stats = out.stats[0]
    print(out.texts[0])
    name = "+".join([_strategy_name(args, pipe)] + rules)
    print(f"[{name} + {args.cache} cache: NFE {stats['nfe']} for {stats['tokens']} tokens "
          f"({stats['tokens_per_forward']:.2f} tokens/forward), {stats['latency_s']:.3f} s]", file=sys.stderr)
    return 0


def _strategy_name(args: argparse.Namespace, pipe) -> str:
    """``--strategy``, or the name of the pipeline's own policy where it was left out."""
    if args.strategy is not None:
        return args.strategy
    return getattr(pipe.scheduler, "strategy", "") or type(pipe.scheduler).__name__


def _text_options(args: argparse.Namespace, pipe, knobs, rules: list) -> dict:
    """The pipeline keywords ``generate text`` passes besides the prompt, the strategy and the generator."""
    from vispec.eval.bench.text import TextBenchConfig

    # without --strategy the model's own policy runs: a --threshold given goes to it (refused where it has none)
    own = {"threshold": args.threshold} if args.strategy is None and args.threshold != TextBenchConfig().threshold else {}
    return dict(cache=args.cache, gen_length=args.gen_length, block_length=args.block_length, steps=args.steps, **own,
                temperature=args.temperature, guidance_scale=args.guidance_scale, early_stop_eos=args.early_stop_eos,
                compile=args.compile, cache_reload_steps=args.cache_reload_steps,
                **knobs.rule_options(set(rules), pipe.tokenizer))


def _prompts(args: argparse.Namespace) -> "list[str] | None":
    """``--prompts-file``'s prompts (one per line, blank lines skipped), None with ``--prompt``; checks the flags
    that go with each."""
    if (args.prompt is None) == (args.prompts_file is None):
        raise ValueError("pass exactly one of --prompt (one text) and --prompts-file (one prompt per line)")
    if args.prompts_file is None:
        for flag, value in (("--out", args.out), ("--results-dir", args.results_dir), ("--num-processes", args.num_processes)):
            if value is not None:
                raise ValueError(f"{flag} goes with --prompts-file (--prompt prints its one text)")
        return None
    if not os.path.isfile(args.prompts_file):
        raise ValueError(f"--prompts-file must be a text file with one prompt per line, got {args.prompts_file!r}")
    try:
        with open(args.prompts_file, encoding="utf-8") as handle:
            prompts = [line.rstrip("\n") for line in handle if line.strip()]
    except UnicodeDecodeError as err:
        raise ValueError(f"--prompts-file {args.prompts_file!r} is not UTF-8 text (byte {err.start}: "
                         f"{err.object[err.start:err.start + 1]!r}); save it as UTF-8") from None
    if not prompts:
        raise ValueError(f"--prompts-file {args.prompts_file!r} holds no prompt")
    if args.out is None or not args.out.endswith(".jsonl"):
        raise ValueError(f"--prompts-file needs --out FILE.jsonl (one JSON line per prompt), got {args.out!r}")
    check_output_file(args.out, "--out")
    if args.batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {args.batch_size}")
    return prompts


def _text_many(args: argparse.Namespace, prompts: list[str], scheduler, knobs, rules: list) -> int:
    """Every prompt of ``--prompts-file``, in units of ``--batch-size`` (prompt ``i`` with a generator seeded
    ``--seed + i``); under torchrun each process decodes every ``W``-th unit. Each prompt's result is stored in
    ``--results-dir`` (default ``OUT.parts``) as its unit finishes, a rerun decodes only what is missing, and rank 0
    writes ``--out``: one JSON line per prompt, in order (``index``, ``prompt``, ``text``, ``nfe``, ``tokens``)."""
    import json

    import torch

    from vispec.eval.bench.distributed import Workers, open_store, run_units
    from vispec.eval.bench.report import atomic_write
    from vispec.pipelines import MaskedDiffusionLMPipeline

    workers = Workers.start(args.device, args.num_processes)
    root = args.results_dir or args.out + ".parts"
    settings = _text_settings(args, prompts, scheduler, rules, workers.device.type)
    if workers.is_main:
        _check_text_record(args, root, settings)
    store = open_store(workers, root, settings)  # before the model loads: other settings are refused first
    pipe = _load(MaskedDiffusionLMPipeline, args.model).to(workers.device)
    pipe.set_progress_bar_config(disable=True)
    options = _text_options(args, pipe, knobs, rules)

    def compute(unit: range) -> dict:
        out = pipe(prompt=prompts[unit.start : unit.stop], strategy=scheduler,
                   generator=[torch.Generator().manual_seed(args.seed + i) for i in unit], **options)
        return {i: ({"index": i, "prompt": prompts[i], "text": text, "nfe": int(stats["nfe"]), "tokens": int(stats["tokens"])},
                    {"sequence": sequence})
                for i, text, stats, sequence in zip(unit, out.texts, out.stats, out.sequences)}

    def tick(n: int) -> None:
        if not args.quiet:
            print(f"[rank {workers.rank}] {n} prompt(s) done", file=sys.stderr, flush=True)

    records = run_units(workers, len(prompts), args.batch_size, compute, store, "text", tick=tick)
    if records is None:
        return 0
    def write(temporary: str) -> None:
        with open(temporary, "w", encoding="utf-8") as handle:
            for record, _ in records:
                handle.write(json.dumps(record, ensure_ascii=False) + "\n")

    atomic_write(args.out, write)
    nfe = sum(r["nfe"] for r, _ in records) / len(records)
    print(f"wrote {args.out}: {len(records)} prompts, mean NFE {nfe:.1f}", file=sys.stderr)
    return 0


def _text_settings(args: argparse.Namespace, prompts: list[str], scheduler, rules: list, device: str) -> dict:
    """What a ``--prompts-file`` run's results depend on, recorded in its results folder (``run.json``): the prompts
    (their number and SHA-256, so another file with other prompts is refused while a copy of the same file is
    not), the model, the strategy with its rules and knobs, the decoding options, the seed and the device."""
    import hashlib

    from vispec.cli.bench import STRATEGY_KNOBS

    digest = hashlib.sha256("\n".join(prompts).encode("utf-8")).hexdigest()
    keys = ("model", "seed", "batch_size", "cache", "cache_reload_steps", "steps", "temperature", "guidance_scale",
            "compile", *STRATEGY_KNOBS)
    return {"prompts": {"count": len(prompts), "sha256": digest},
            "strategy": "+".join([args.strategy or "(the model's own)"] + rules),
            "scheduler": None if scheduler is None else dict(scheduler.config), "device": device,
            **{k: getattr(args, k) for k in keys}}


def _check_text_record(args: argparse.Namespace, root: str, settings: dict) -> None:
    """Refuse, before any work, a results folder that holds the results of other settings (another prompts file,
    model or decoding): they would be returned as this run's. Names the settings that differ and the flag."""
    import json

    where = f"--results-dir {root!r}" if args.results_dir else f"--out {args.out!r} (its results folder {root!r})"
    remedy = f"delete {root} to start over"
    stored = read_run_record(os.path.join(root, "run.json"), where, remedy)
    settings = json.loads(json.dumps(settings))  # as it reads back: tuples are lists
    if stored is not None and stored != settings:
        keys = sorted(k for k in stored.keys() | settings.keys() if stored.get(k) != settings.get(k))
        raise ValueError(f"{where} holds the results of other settings (differing: {', '.join(keys)}); pass another "
                         f"--out (or --results-dir), or {remedy}")


def add_generate(sub: argparse._SubParsersAction) -> None:
    from vispec.eval.bench.text import TextBenchConfig

    generate = sub.add_parser("generate", help="generate samples").add_subparsers(dest="subcommand", metavar="KIND")
    image = generate.add_parser(
        "image", help="images: class-conditional (--class; LlamaGen pipelines, e.g. tiny-c2i) or text-to-image "
                      "(--prompt; unified-token pipelines, e.g. tiny-t2i or a converted Lumina-mGPT 2.0)",
        description="Images from a class-conditional LlamaGen pipeline (pass --class) or a text-to-image "
                    "unified-token pipeline (pass --prompt, optionally --negative-prompt, --height, --width).")
    image.add_argument("--model", default="tiny-c2i", help="embedded model name or a pipeline folder (default: %(default)s)")
    image.add_argument("--class", dest="class_label", default=None,
                       help="class id, or 'all': image i gets class i mod num_classes (class-balanced, as FID-50K "
                            "sampling) (class-conditional models)")
    image.add_argument("--prompt", default=None, help="the text (text-to-image models, e.g. a converted Lumina-mGPT 2.0)")
    image.add_argument("--negative-prompt", default=None, help="text-to-image models whose guidance takes one (Emu3)")
    image.add_argument("--height", type=int, default=None, help="text-to-image: pixels (default: the model's)")
    image.add_argument("--width", type=int, default=None, help="text-to-image: pixels (default: the model's)")
    image.add_argument("--image", default=None, metavar="PATH",
                       help="image-to-image (e.g. tiny-edit with --decoding iad): the source image every image of the "
                            "run edits; the output has its size")
    image.add_argument("--decoding", default=None,
                       help="ar, sjd[-init], mc-sjd[-coupling], sjd-pac, auto (each pass AR, a chain or a tree, whichever is "
                            "fastest here; exact), sd, gad, iad, optionally :window=..|auto and +budget[:delta=..] (within a "
                            "TV budget), +lantern[:k=..,delta=..] or +gsd (lossy); default: the pipeline's")
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
    image.add_argument("--npz", default=None,
                       help="also pack every image, in order, into this .npz (arr_0, uint8 [N, H, W, 3]: the ADM / "
                            "LlamaGen FID evaluator's sample batch)")
    image.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N; under torchrun on CUDA each process takes "
                                                      "cuda:LOCAL_RANK (default: %(default)s)")
    image.add_argument("--num-processes", type=int, default=None,
                       help="the processes launched (torchrun --nproc_per_node x nodes); any other world size is an "
                            "error before work starts")
    image.add_argument("--resume", action="store_true",
                       help="keep the images an earlier run with the same settings made (STEM.run.json records them) "
                            "and make only the missing batches; without it every image is made anew")
    image.add_argument("--quiet", action="store_true", help="no progress bar")
    image.set_defaults(func=_cmd_image)

    text = generate.add_parser("text", help="text from a masked diffusion LM pipeline")
    text.add_argument("--model", default="tiny-mdlm", help="embedded model name or a pipeline folder (default: %(default)s)")
    text.add_argument("--prompt", default=None, help="the prompt (prints its text)")
    text.add_argument("--prompts-file", default=None,
                      help="a text file with one prompt per line: decoded in batches (distributed under torchrun), "
                           "written to --out as JSON lines")
    text.add_argument("--out", default=None, help="--prompts-file: the .jsonl to write (one line per prompt, in order)")
    text.add_argument("--batch-size", type=int, default=16, help="--prompts-file: prompts per pipeline call")
    text.add_argument("--results-dir", default=None,
                      help="--prompts-file: where each prompt's result is stored as it finishes (a rerun skips them; "
                           "default: OUT.parts)")
    text.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default: %(default)s)")
    text.add_argument("--num-processes", type=int, default=None,
                      help="--prompts-file: the processes launched (torchrun); any other world size is an error")
    text.add_argument("--strategy", default=None,
                      help="llada, threshold, factor, entropy, contiguous, learn2pd (needs the model's filter), dream "
                           "or editing (LLaDA2's rule; block-causal models) (default: the model's own saved policy)")
    text.add_argument("--remasking", default="low_confidence", help="llada: low_confidence or random")
    text.add_argument("--dream-alg", default="entropy", help="dream: origin, maskgit_plus, topk_margin or entropy")
    text.add_argument("--rules", default="", help="comma-separated: eotp (end-of-text prediction), prophet (early "
                                                   "commit), adablock (adaptive blocks), ssd, ssd=K or ssd=auto "
                                                   "(exact self-speculative decoding, K canvases per forward or K "
                                                   "chosen per forward by cost: the same tokens as without it)")
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
