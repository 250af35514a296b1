"""Eager against compiled (``torch.compile(fullgraph=True)``, static shapes) block decoding on a masked diffusion LM.

    python samples/dllm_compile_speed.py [--model tiny-mdlm] [--rounds 7] [--threads 1] [--batch 1]

One process, a fixed thread count. Every cache mode (``none``, ``prefix``, ``dual``) is decoded once eagerly and
once compiled before timing (the compiled run compiles its graphs there, outside the timed region, and must
give the eager tokens). Then ``--rounds`` rounds each run every (cache, eager/compiled) pair once, interleaved
so that drifts of the machine hit both sides alike; the table gives the medians in seconds per sequence and
``eager / compiled`` (above 1: compiling pays).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

from vispec.dllm import decode, make_scheduler
from vispec.pipelines import MaskedDiffusionLMPipeline

PROMPTS = ["sort the numbers : 5 3 9 3 1", "reverse the letters : k d m a", "what is 12 + 7 ?", "what is 3 + 4 ?"]
CACHES = ("none", "prefix", "dual")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny-mdlm")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batch", type=int, default=1, help="prompts per decode (1 to 4)")
    parser.add_argument("--strategy", default="threshold", help="llada (one token per step), threshold, factor or entropy")
    parser.add_argument("--gen-length", type=int, default=32)
    parser.add_argument("--block-length", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    pipe = MaskedDiffusionLMPipeline.from_pretrained(args.model)
    ids, mask = pipe.prepare_input_ids(prompt=PROMPTS[: args.batch])
    batch = ids.shape[0]

    def run(cache: str, compile: bool):
        scheduler = make_scheduler(args.strategy)
        start = time.perf_counter()
        out = decode(pipe.model, ids, mask, scheduler=scheduler, gen_length=args.gen_length, block_length=args.block_length,
                     steps=args.gen_length if scheduler.fixed_steps else None, cache=cache, early_stop_eos=True,
                     eos_token_id=pipe.tokenizer.eos_token_id, compile=compile)
        return (time.perf_counter() - start) / batch, out

    nfe = {}
    for cache in CACHES:  # warm-up; the compiled run compiles here
        _, eager = run(cache, False)
        compile_s, compiled = run(cache, True)
        if not torch.equal(eager.tokens, compiled.tokens):
            raise SystemExit(f"cache={cache}: compiled tokens differ from eager")
        nfe[cache] = eager.stats.nfe.float().mean().item()
        print(f"warm-up {cache:>6}: compiled in {compile_s * batch:.1f} s, same tokens as eager", flush=True)
    times = {(cache, compile): [] for cache in CACHES for compile in (False, True)}
    for _ in range(args.rounds):
        for cache in CACHES:
            for compile in (False, True):
                times[cache, compile].append(run(cache, compile)[0])

    print(f"\n{args.model}, {args.strategy}, gen {args.gen_length} / block {args.block_length}, batch {batch}, "
          f"{args.threads} thread(s), torch {torch.__version__}, {platform.machine()}; medians of {args.rounds} rounds")
    print(f"{'cache':>6} {'NFE/seq':>8} {'eager s/seq':>12} {'compiled s/seq':>15} {'eager/compiled':>15}")
    for cache in CACHES:
        eager, compiled = statistics.median(times[cache, False]), statistics.median(times[cache, True])
        print(f"{cache:>6} {nfe[cache]:>8.1f} {eager:>12.4f} {compiled:>15.4f} {eager / compiled:>15.2f}")


if __name__ == "__main__":
    main()
