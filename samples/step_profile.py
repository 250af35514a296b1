"""Profile of one decode on tiny-c2i: aten ops, host read-backs and time per step, by decoder and batch size.

    python samples/step_profile.py [--batch-sizes 1,16] [--methods ar,sjd,mc-sjd] [--threads 1]

Ops are the profiler's aten events per forward pass; read-backs are counted by
``vispec.profiling.HostSyncCounter``; the time split is the profiler's self CPU time of the
model's layers (``aten::linear``, attention, norms) against everything else. Run it on two commits
to compare a change (the counts do not depend on machine load, the times do).
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter

import torch
from torch.profiler import ProfilerActivity, profile

from vispec.decoding import decode
from vispec.models.llamagen_gpt import LlamaGenCondition
from vispec.pipelines import LlamaGenPipeline
from vispec.profiling import HostSyncCounter
from vispec.sampling import SamplingConfig

FORWARD_OPS = ("aten::linear", "aten::addmm", "aten::mm", "aten::scaled_dot_product_attention", "aten::_scaled_dot_product",
               "aten::rsqrt", "aten::embedding")


def run(gpt, method: str, batch: int, tokens: int):
    condition = LlamaGenCondition(class_labels=torch.arange(batch) % 14)
    gens = [torch.Generator().manual_seed(i) for i in range(batch)]
    return decode(gpt, condition, num_tokens=tokens, sampling=SamplingConfig(guidance_scale=3.0), decoding=method,
                  generator=gens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-sizes", default="1,16")
    parser.add_argument("--methods", default="ar,sjd,mc-sjd")
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    gpt = LlamaGenPipeline.from_pretrained("vispec/tiny-c2i").transformer
    rows = []
    print(f"{'method':8} {'B':>3} {'passes':>6} {'ops/pass':>9} {'syncs/pass':>10} {'ms/pass':>8} {'forward %':>9}")
    for batch in map(int, args.batch_sizes.split(",")):
        for method in args.methods.split(","):
            run(gpt, method, batch, 16)  # warm-up
            with HostSyncCounter() as syncs:
                out = run(gpt, method, batch, args.tokens)
            passes = int(out.stats.nfe.max()) - 1
            start = time.perf_counter()
            run(gpt, method, batch, args.tokens)
            elapsed = time.perf_counter() - start
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                run(gpt, method, batch, args.tokens)
            events = [e for e in prof.events() if e.name.startswith("aten::")]
            names = Counter(e.name for e in events)
            total = sum(e.self_cpu_time_total for e in events)
            forward = sum(e.self_cpu_time_total for e in events if e.name.startswith(FORWARD_OPS))
            row = {"method": method, "batch": batch, "passes": passes, "ops_per_pass": len(events) / passes,
                   "syncs_per_pass": syncs.total / passes, "ms_per_pass": 1e3 * elapsed / passes,
                   "forward_share": forward / max(total, 1), "top_ops": names.most_common(8)}
            rows.append(row)
            print(f"{method:8} {batch:>3} {passes:>6} {row['ops_per_pass']:>9.0f} {row['syncs_per_pass']:>10.2f} "
                  f"{row['ms_per_pass']:>8.2f} {100 * row['forward_share']:>8.0f}%")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(rows, handle, indent=1)


if __name__ == "__main__":
    main()
