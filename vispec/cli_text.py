"""The text half of the ``vispec`` command line: ``generate text`` and ``bench text``."""

from __future__ import annotations

import argparse
import sys


def _csv(flag: str, text: str) -> tuple[str, ...]:
    items = tuple(t.strip() for t in text.split(",") if t.strip())
    if not items:
        raise ValueError(f"{flag} is empty")
    return items


def _cmd_generate_text(args: argparse.Namespace) -> int:
    import torch

    from vispec.dllm import make_scheduler
    from vispec.pipelines import MaskedDiffusionLMPipeline

    if args.quiet:
        from diffusers.utils import logging as diffusers_logging

        diffusers_logging.disable_progress_bar()
    settings = {"threshold": {"threshold": args.threshold}, "factor": {"factor": args.factor},
                "entropy": {"gamma": args.entropy_bound}, "llada": {"remasking": args.remasking}}
    if args.strategy not in settings:
        raise ValueError(f"--strategy must be one of {tuple(settings)}, got {args.strategy!r}")
    scheduler = make_scheduler(args.strategy, **settings[args.strategy])
    pipe = MaskedDiffusionLMPipeline.from_pretrained(args.model)
    pipe.set_progress_bar_config(disable=args.quiet)
    out = pipe(prompt=args.prompt, strategy=scheduler, cache=args.cache, gen_length=args.gen_length,
               block_length=args.block_length, num_inference_steps=args.steps, temperature=args.temperature,
               guidance_scale=args.guidance_scale, early_stop_eos=not args.no_early_stop,
               generator=torch.Generator().manual_seed(args.seed))
    stats = out.stats[0]
    print(out.texts[0])
    print(f"[{args.strategy} + {args.cache} cache: NFE {stats['nfe']} for {stats['tokens']} tokens "
          f"({stats['tokens_per_forward']:.2f} tokens/forward), {stats['latency_s']:.3f} s]", file=sys.stderr)
    return 0


def _cmd_bench_text(args: argparse.Namespace) -> int:
    from vispec.eval.bench_decoders import emit
    from vispec.eval.bench_text import TextBenchConfig, format_text_table, run_text_bench

    cfg = TextBenchConfig(model=args.model, strategies=_csv("--strategies", args.strategies), caches=_csv("--cache", args.cache),
                          tasks=_csv("--tasks", args.tasks), num_problems=args.num_problems, batch_size=args.batch_size,
                          gen_length=args.gen_length, block_length=args.block_length, threshold=args.threshold,
                          factor=args.factor, entropy_bound=args.entropy_bound, early_stop_eos=not args.no_early_stop,
                          seed=args.seed, device=args.device)
    result = run_text_bench(cfg, progress=lambda msg: print(msg, file=sys.stderr, flush=True))
    emit(format_text_table(result), result, args.json_path)
    return 0


def _add_strategy_knobs(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--threshold", type=float, default=0.9, help="confidence threshold τ of the threshold rule")
    parser.add_argument("--factor", type=float, default=1.0, help="f of the factor rule")
    parser.add_argument("--entropy-bound", type=float, default=0.1, help="entropy budget γ of the EB rule (nats)")
    parser.add_argument("--gen-length", type=int, default=None, help="tokens to generate (default: the model's)")
    parser.add_argument("--block-length", type=int, default=None, help="semi-AR block length (default: the model's)")
    parser.add_argument("--no-early-stop", action="store_true", help="keep decoding after EOS is committed")


def add_generate_text(generate: argparse._SubParsersAction) -> None:
    text = generate.add_parser("text", help="text from a masked diffusion LM pipeline")
    text.add_argument("--model", default="tiny-mdlm", help="embedded model name or a pipeline folder (default: %(default)s)")
    text.add_argument("--prompt", required=True)
    text.add_argument("--strategy", default="threshold", help="llada, threshold, factor or entropy (default: %(default)s)")
    text.add_argument("--remasking", default="low_confidence", help="llada: low_confidence or random")
    text.add_argument("--cache", default="none", help="none, prefix or dual (default: %(default)s)")
    text.add_argument("--steps", type=int, default=None, help="llada: total steps (default: gen length)")
    text.add_argument("--temperature", type=float, default=0.0)
    text.add_argument("--guidance-scale", type=float, default=0.0)
    text.add_argument("--seed", type=int, default=0)
    text.add_argument("--quiet", action="store_true", help="no progress bar")
    _add_strategy_knobs(text)
    text.set_defaults(func=_cmd_generate_text)


def add_bench_text(bench: argparse._SubParsersAction) -> None:
    text = bench.add_parser("text", help="accuracy and speed of unmasking strategies and caches on a masked diffusion LM")
    text.add_argument("--model", default="tiny-mdlm", help="embedded model name or a pipeline folder (default: %(default)s)")
    text.add_argument("--strategies", default="llada,threshold,factor,entropy")
    text.add_argument("--cache", default="none,prefix,dual", help="comma-separated caches (default: %(default)s)")
    text.add_argument("--tasks", default="arithmetic,sort,reverse")
    text.add_argument("--num-problems", type=int, default=100, help="test problems per task")
    text.add_argument("--batch-size", type=int, default=16, help="the batched run's batch size (batch 1 always runs)")
    text.add_argument("--seed", type=int, default=0)
    text.add_argument("--device", default="cpu")
    text.add_argument("--json", dest="json_path", default=None)
    _add_strategy_knobs(text)
    text.set_defaults(func=_cmd_bench_text)
