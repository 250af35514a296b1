"""FID and evaluator accuracy of AR and MC-SJD over several disjoint seed sets (tiny-c2i by default).

    python samples/fid_noise.py --seed-sets 0,1,2,3 --methods ar,mc-sjd --num-images 1000 --json fid-noise.json

Both decoders target the same distribution, so the spread of each method's FID across seed sets is its sampling
noise, and the two sets of numbers must overlap. Seed set ``k`` uses per-image seeds ``i + k * 100000007``
(the same as ``vispec bench image``'s re-seeds).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch

from vispec.eval.bench.data import CropSampler
from vispec.eval.bench.evaluator import CropClassifier, classify_accuracy
from vispec.eval.bench.image import RESEED_OFFSET, ImageBenchConfig, fid_score, generate_uint8
from vispec.models.checkpoints import diffusers_load_kwargs
from vispec.pipelines import LlamaGenPipeline, resolve_model_path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny-c2i")
    parser.add_argument("--methods", default="ar,mc-sjd")
    parser.add_argument("--seed-sets", default="1,2,3")
    parser.add_argument("--num-images", type=int, default=1000)
    parser.add_argument("--real-images", type=int, default=1000)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    folder = resolve_model_path(args.model)
    pipe = LlamaGenPipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    evaluator = CropClassifier.from_pretrained(os.path.join(folder, "evaluator"), **diffusers_load_kwargs()).eval()
    classes = pipe.transformer.config.num_classes
    real_labels = torch.arange(2 * args.real_images) % classes  # the same real set as `vispec bench image --seed 0`
    real, _ = CropSampler("eval").sample(2 * args.real_images, torch.Generator().manual_seed(7), labels=real_labels)
    real = real[: args.real_images]
    labels = torch.arange(args.num_images) % classes
    cfg = ImageBenchConfig(model=args.model)
    results: dict = {}
    for method in args.methods.split(","):
        for k in (int(x) for x in args.seed_sets.split(",")):
            seeds = [i + k * RESEED_OFFSET for i in range(args.num_images)]
            images, _, _ = generate_uint8(pipe, method, labels, seeds, args.batch_size, cfg)
            row = {"fid": fid_score(evaluator, real, images), "accuracy": classify_accuracy(evaluator, images, labels)}
            results.setdefault(method, {})[k] = row
            print(f"{method} seed set {k}: FID {row['fid']:.3f}, accuracy {row['accuracy']:.3f}", flush=True)
    for method, rows in results.items():
        fids = [r["fid"] for r in rows.values()]
        sd = statistics.stdev(fids) if len(fids) > 1 else 0.0
        print(f"{method}: FID mean {statistics.mean(fids):.3f} sd {sd:.3f} over {len(fids)} seed sets")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"config": vars(args), "results": results}, handle, indent=2)


if __name__ == "__main__":
    main()
