"""Cost of one forward pass against the Jacobi window width, on a LlamaGen pipeline (tiny-c2i by default).

    python samples/window_cost.py [--model tiny-c2i] [--repeats 200] [--compile] [--batch 1] [--dtype bfloat16]
        [--slack 64]

SJD-family speed-ups in wall clock are bounded by ``step_compression * t(1) / t(W)``: on a GPU a window of
16 tokens costs about what one token costs, on a 2-core CPU it does not. This prints ``t(W)`` per forward
(with CFG: two rows per image), wall and CPU, so the bench numbers can be read against it; ``--compile`` runs
the forward as a compiled decode step does (``torch.compile(fullgraph=True)``, static shapes, attention over
the whole cache). The ``GFLOP/s`` column divides the window's multiply-adds (2 per weight per row, plus the
attention's over the cached positions) by the CPU time: where it stays flat as W grows, the forward is bound
by the machine's arithmetic, not by fixed per-call costs, and no decoder can make a wide window cheap there.
``--slack 64`` sizes the cache for a 64-row window whatever W is, as an ``auto`` decode does (its chooser may run
any window up to 64): attention then reads a strided prefix of a longer cache, which costs the compiled forward
more than the exact-size cache a fixed window gets.
"""

from __future__ import annotations

import argparse
import time

import torch

from vispec.decoding.compiled import compiled
from vispec.models.llamagen_gpt import LlamaGenCondition
from vispec.pipelines import LlamaGenPipeline


def window_pass(gpt, state, tokens):
    """One forward of ``tokens`` after the cached prefix, then roll the window back (a decode step's forward)."""
    out = gpt.forward_window(state, tokens)
    gpt.rollback(state, torch.zeros_like(state.lengths))
    return out.cond


def flops_per_row(gpt, keys: int) -> float:
    """Multiply-adds x 2 of one window row: every matrix weight once (embeddings excluded), and attention's
    ``q kᵀ`` and ``p v`` over ``keys`` cached positions in every layer."""
    cfg = gpt.config
    weights = sum(p.numel() for name, p in gpt.named_parameters() if p.dim() == 2 and "embedding" not in name)
    return 2.0 * (weights + cfg.n_layer * 2 * cfg.dim * keys)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny-c2i", help="tiny-c2i, tiny-c2i@GPT-B (inflated) or a pipeline folder")
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--widths", default="1,2,4,8,16,32")
    parser.add_argument("--batch", type=int, default=1, help="images per forward")
    parser.add_argument("--compile", action="store_true", help="time the compiled forward (as compile=True decodes)")
    parser.add_argument("--slack", type=int, default=0,
                        help="size the cache for a window of this many rows (at least W), as a decode whose chooser "
                             "may run wider windows does (auto: 64); default: each W's own")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="the model's weights and activations (bfloat16: AMX / AVX512-BF16 products where the CPU "
                             "has them)")
    args = parser.parse_args()
    if args.slack < 0:
        parser.error(f"--slack must be >= 0, got {args.slack}")
    for flag in ("repeats", "batch"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag} must be >= 1, got {getattr(args, flag)}")
    try:
        widths = [int(w) for w in args.widths.split(",")]
    except ValueError:
        parser.error(f"--widths must be a comma list of integers, got {args.widths!r}")
    if min(widths) < 1:
        parser.error(f"--widths must be >= 1, got {args.widths!r}")
    dtype = getattr(torch, args.dtype)
    if "@" in args.model:
        from vispec.models.inflate import inflate

        base, size = args.model.split("@", 1)
        gpt = torch.nn.Module.to(inflate(LlamaGenPipeline.from_pretrained(base).transformer, size, seed=0), dtype)
    else:
        gpt = LlamaGenPipeline.from_pretrained(args.model, dtype=dtype).transformer
    guidance = gpt.has_unconditional
    rows = args.batch * (2 if guidance else 1)
    run = compiled(window_pass) if args.compile else window_pass
    print(f"{'W':>3} {'ms wall':>8} {'ms CPU':>8} {'x t(1)':>7} {'GFLOP/s':>8}   (batch {args.batch}, CFG "
          f"{'on' if guidance else 'off'}: {rows} rows per token, {torch.get_num_threads()} threads, "
          f"{'compiled' if args.compile else 'eager'}, {args.dtype}"
          f"{f', cache sized for {args.slack}-row windows' if args.slack else ''})")
    base = None
    labels = torch.arange(args.batch) % max(gpt.config.num_classes, 1)
    for width in widths:
        state, _ = gpt.prefill(LlamaGenCondition(class_labels=labels), guidance=guidance,
                               max_new_tokens=gpt.num_image_tokens, window=max(width, args.slack),
                               validate=not args.compile)
        state.lengths += gpt.num_image_tokens // 2  # mid-image
        tokens = torch.zeros(args.batch, width, dtype=torch.long)
        with torch.no_grad():
            for _ in range(10):
                run(gpt, state, tokens)
            start, cpu = time.perf_counter(), time.process_time()
            for _ in range(args.repeats):
                run(gpt, state, tokens)
        ms = (time.perf_counter() - start) / args.repeats * 1000
        cpu_ms = (time.process_time() - cpu) / args.repeats * 1000
        keys = state.capacity - state.slack + width if args.compile else int(state.lengths.max()) + width
        gflops = rows * width * flops_per_row(gpt, keys) / (cpu_ms * 1e6)
        base = base or cpu_ms
        print(f"{width:>3} {ms:>8.2f} {cpu_ms:>8.2f} {cpu_ms / base:>7.2f} {gflops:>8.1f}")


if __name__ == "__main__":
    main()
