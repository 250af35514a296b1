"""The shape chooser's choices priced by a fixed cost curve: how close ``auto`` comes to the best fixed chain, without
the machine's noise.

On a shared 2-core machine the wall clock of a decode drifts by tens of percent within minutes, which hides the few
percent a chooser's policy wins or loses. Here every pass of ``auto`` costs what a fixed table says (the chooser's
clock advances by its shape's cost, so its own measurements are that table too), and each contender's seconds per
image are the sum of its passes' costs: ``auto``'s over the shapes it chose, a fixed ``mc-sjd:window=W`` chain's
forwards times the chain's cost, AR's 256 one-token passes. Decodes run eagerly (no compile: the costs are the
table's), one seeded image at a time, with a fresh ``WindowStats`` and no rates from disk, so the first images
include ``auto``'s calibration of the acceptance rates; the table gives every image and the later half apart.

    python samples/chooser_replay.py --images 12
    python samples/chooser_replay.py --images 12 --costs my-curve.json   # {"ar": 4.27, "chain:16": 8.65, ...} in ms

The default table is tiny-c2i at batch 1, compiled, on this project's 2-core CPU (2026-12-03): medians of the step
times an ``auto`` decode measured (``chain:L``, ``tree:L``), and AR's 4.27 ms from the slope of compiled
``decode_ar`` over 2 to 256 tokens (``auto``'s own 16-pass AR runs measured 3.7-5.6 ms).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from typing import Optional

TINY_C2I_B1_MS = {"ar": 4.27, "chain:2": 6.07, "chain:4": 7.16, "chain:8": 7.71, "chain:16": 8.65, "chain:32": 13.16,
                  "chain:64": 25.0, "tree:4": 8.44, "tree:8": 8.23, "tree:16": 10.47, "tree:32": 17.15,
                  "tree:64": 27.09}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny-c2i", help="an embedded class-to-image model (default tiny-c2i)")
    parser.add_argument("--images", type=int, default=12, help="images per contender, one at a time (default 12)")
    parser.add_argument("--chains", default="16", help="comma list of fixed MC-SJD windows to compare (default 16)")
    parser.add_argument("--costs", metavar="PATH", help="JSON {cost label: milliseconds} (default: tiny-c2i batch 1 "
                        "on this project's CPU, in this file)")
    parser.add_argument("--sample-shrink", type=float, metavar="K", help="pseudo-tests in a sample's factor "
                        "(vispec.decoding.shapes.SAMPLE_SHRINK, default the module's; 'inf' turns the factor off)")
    parser.add_argument("--json", metavar="PATH", help="write the results here")
    return parser


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.sample_shrink is not None and not args.sample_shrink > 0:
        parser.error(f"--sample-shrink must be a positive number or inf, got {args.sample_shrink}")
    if args.images < 1:
        parser.error(f"--images must be a positive integer, got {args.images}")
    try:
        args.chains = [int(w) for w in args.chains.split(",") if w.strip()]
    except ValueError:
        parser.error(f"--chains must be a comma list of windows, got {args.chains!r}")
    if not args.chains or any(w < 2 or w > 64 or w & (w - 1) for w in args.chains):
        parser.error(f"--chains must hold powers of two from 2 to 64, got {args.chains}")
    costs = dict(TINY_C2I_B1_MS)
    if args.costs:
        try:
            with open(args.costs) as handle:
                costs = {str(k): float(v) for k, v in json.load(handle).items()}
        except (OSError, ValueError, AttributeError) as err:
            parser.error(f"--costs {args.costs}: expected a JSON object of cost label to milliseconds ({err})")
    missing = sorted(set(TINY_C2I_B1_MS) - set(costs))
    if missing or any(v <= 0 for v in costs.values()):
        parser.error(f"--costs must give a positive cost for every label; missing or not positive: "
                     f"{missing or [k for k, v in costs.items() if v <= 0]}")
    args.costs = costs
    return args


def main(argv: Optional[list[str]] = None) -> dict:
    args = parse_args(argv)
    os.environ["VISPEC_CACHE_DIR"] = "off"  # no rates or costs from disk: the table is the whole cost model
    import numpy as np
    import torch

    from vispec.decoding import decode
    from vispec.decoding import shapes
    from vispec.decoding.windows import WindowStats
    from vispec.models.llamagen_gpt import LlamaGenCondition
    from vispec.pipelines import LlamaGenPipeline
    from vispec.sampling import SamplingConfig

    if args.sample_shrink is not None:
        shapes.SAMPLE_SHRINK = args.sample_shrink
    pipe = LlamaGenPipeline.from_pretrained(f"vispec/{args.model}")
    gpt = pipe.transformer.eval()
    sampling = SamplingConfig(**{k: getattr(pipe.decoding_config, k) for k in
                                 ("guidance_scale", "temperature", "top_k", "top_p", "cfg_interval")})
    seconds = {label: ms / 1000 for label, ms in args.costs.items()}
    clock = [0.0]

    class PricedChooser(shapes.ShapeChooser):
        def record(self, shape, before, after, ranks, synced):  # the pass took its table cost
            clock[0] += seconds[shape.cost_label]
            super().record(shape, before, after, ranks, synced)

        def note_fixed_chain(self, rows, samples):  # a decode that ran one chain throughout: priced as that chain
            super().note_fixed_chain(rows, [(at, seconds[f"chain:{rows}"]) for at, _ in samples])

        def sample_factor(self, slots):  # --sample-shrink inf: every sample at the pooled rates
            if shapes.SAMPLE_SHRINK == float("inf"):
                return np.ones(len(slots))
            return super().sample_factor(slots)

    def run(spec: str, stats: Optional[WindowStats]) -> list[tuple[float, dict]]:
        out_rows = []
        for k in range(args.images):
            start = clock[0]
            out = decode(gpt, LlamaGenCondition(class_labels=torch.tensor([k % gpt.config.num_classes])),
                         num_tokens=gpt.num_image_tokens, sampling=sampling, decoding=spec,
                         generator=[torch.Generator().manual_seed(k)], window_stats=stats)
            forwards = float(out.stats.nfe.float().mean())
            if spec == "auto":
                chooser = out.stats.chooser or {}
                handed = bool(chooser.get("handed_to_ar"))
                spent = clock[0] - start + (forwards - 1) * seconds["ar"] * handed  # a decode handed to plain AR
                if chooser.get("fixed_shape"):  # ... or one that ran one chain throughout (not recorded): priced so
                    spent = (forwards - 1) * seconds[f"chain:{chooser['fixed_shape'].split()[1]}"]
            else:
                spent = (forwards - 1) * seconds[f"chain:{spec.split('=')[1]}"]
            out_rows.append((spent, dict(out.stats.shapes or {})))
        return out_rows

    original = shapes.ShapeChooser
    shapes.ShapeChooser = PricedChooser
    import vispec.decoding.pac as pac

    pac.ShapeChooser = PricedChooser
    try:
        results = {"auto": run("auto", WindowStats(starting_costs={k: [(0, v)] for k, v in seconds.items()},
                                                   clock=lambda: clock[0]))}
    finally:
        shapes.ShapeChooser = pac.ShapeChooser = original
    for window in args.chains:
        results[f"mc-sjd:window={window}"] = run(f"mc-sjd:window={window}", None)
    ar = (gpt.num_image_tokens - 1) * seconds["ar"]
    half = args.images // 2
    report = {"model": args.model, "images": args.images, "costs_ms": args.costs, "ar_s_per_image": ar,
              "sample_shrink": shapes.SAMPLE_SHRINK, "rows": {}}
    print(f"{args.model}, batch 1, {args.images} images, passes priced by the table (AR {args.costs['ar']} ms a pass), "
          f"sample factor shrink {shapes.SAMPLE_SHRINK}")
    print(f"  {'contender':18s} {'s/img':>7s} {'later half':>10s} {'over AR':>8s} {'later half':>10s}")
    for name, rows in results.items():
        every = statistics.fmean(t for t, _ in rows)
        later = statistics.fmean(t for t, _ in rows[half:])
        passes: dict[str, int] = {}
        for _, counted in rows:
            for label, n in counted.items():
                passes[label] = passes.get(label, 0) + n
        report["rows"][name] = {"s_per_image": every, "later_half_s_per_image": later, "speedup_over_ar": ar / every,
                                "later_half_speedup_over_ar": ar / later, "per_image_s": [t for t, _ in rows],
                                "shapes": passes}
        print(f"  {name:18s} {every:7.3f} {later:10.3f} {ar / every:7.2f}x {ar / later:9.2f}x")
        if name == "auto":
            top = sorted(passes.items(), key=lambda kv: -kv[1])
            print("    auto's passes: " + ", ".join(f"{label} {n}" for label, n in top))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(report, handle, indent=1)
        print(f"wrote {args.json}")
    return report


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
