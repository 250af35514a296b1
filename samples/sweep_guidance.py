"""Choose tiny-c2i's default sampling settings: evaluator accuracy and FID per CFG scale.

    python samples/sweep_guidance.py --model out/tiny-c2i-pipeline --scales 1.5,2,3,4,5 --images 280

Sampling uses MC-SJD, which is exact, so the numbers are those of AR sampling at the same settings.
"""

from __future__ import annotations

import argparse
import os

import torch

from vispec.eval.bench.data import CropSampler
from vispec.eval.bench.evaluator import CropClassifier, classify_accuracy
from vispec.eval.bench.image import ImageBenchConfig, fid_score, generate_uint8
from vispec.pipelines import LlamaGenPipeline
from vispec.pipelines.llamagen import resolve_model_path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny-c2i")
    parser.add_argument("--scales", default="1.5,2,3,4,5")
    parser.add_argument("--temperatures", default="1.0")
    parser.add_argument("--images", type=int, default=280)
    args = parser.parse_args()
    folder = resolve_model_path(args.model)
    pipe = LlamaGenPipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    evaluator = CropClassifier.from_pretrained(os.path.join(folder, "evaluator")).eval()
    num_classes = pipe.transformer.config.num_classes
    labels = torch.arange(args.images) % num_classes
    real, _ = CropSampler("eval").sample(args.images, torch.Generator().manual_seed(7), labels=labels)
    print(f"{'cfg':>5} {'temp':>5} {'accuracy':>9} {'FID':>8} {'tokens/fwd':>10}")
    for temperature in (float(t) for t in args.temperatures.split(",")):
        for scale in (float(s) for s in args.scales.split(",")):
            cfg = ImageBenchConfig(guidance_scale=scale, temperature=temperature)
            images, stats, _ = generate_uint8(pipe, "mc-sjd", labels, list(range(args.images)), 70, cfg)
            tpf = sum(s["tokens_per_forward"] for s in stats) / len(stats)
            print(f"{scale:>5.2f} {temperature:>5.2f} {classify_accuracy(evaluator, images, labels):>9.3f} "
                  f"{fid_score(evaluator, real, images):>8.3f} {tpf:>10.2f}", flush=True)


if __name__ == "__main__":
    main()
