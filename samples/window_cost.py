"""Cost of one forward pass against the Jacobi window width, on a LlamaGen pipeline (tiny-c2i by default).

    python samples/window_cost.py [--model tiny-c2i] [--repeats 200]

SJD-family speed-ups in wall clock are bounded by ``step_compression * t(1) / t(W)``: on a GPU a window of
16 tokens costs about what one token costs, on a 2-core CPU it does not. This prints ``t(W)`` per forward
(with CFG: two rows per image) so the bench numbers can be read against it.
"""

from __future__ import annotations

import argparse
import time

import torch

from vispec.models.llamagen_gpt import LlamaGenCondition
from vispec.pipelines import LlamaGenPipeline


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny-c2i")
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--widths", default="1,2,4,8,16,32")
    args = parser.parse_args()
    gpt = LlamaGenPipeline.from_pretrained(args.model).transformer
    guidance = gpt.has_unconditional
    print(f"{'W':>3} {'ms/forward':>11} {'x t(1)':>7}   (batch 1, CFG {'on' if guidance else 'off'}, {torch.get_num_threads()} threads)")
    base = None
    for width in (int(w) for w in args.widths.split(",")):
        state, _ = gpt.prefill(LlamaGenCondition(class_labels=torch.tensor([0])), guidance=guidance,
                               max_new_tokens=gpt.num_image_tokens, window=width)
        tokens = torch.zeros(1, width, dtype=torch.long)
        keep = torch.zeros(1, dtype=torch.long)
        with torch.no_grad():
            for _ in range(10):
                gpt.forward_window(state, tokens)
                gpt.rollback(state, keep)
            start = time.perf_counter()
            for _ in range(args.repeats):
                gpt.forward_window(state, tokens)
                gpt.rollback(state, keep)
        ms = (time.perf_counter() - start) / args.repeats * 1000
        base = base or ms
        print(f"{width:>3} {ms:>11.2f} {ms / base:>7.2f}")


if __name__ == "__main__":
    main()
