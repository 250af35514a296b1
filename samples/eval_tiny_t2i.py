"""A first look at tiny-t2i on held-out compositions: prompt-following accuracy (the scene checks), CLIP score with
tiny-clip, and step compression, per decoder. Usage (from the repository root, after samples/train_tiny_t2i.sh or
with the parts in out/tiny-t2i):

    python samples/eval_tiny_t2i.py --pipeline out/tiny-t2i/pipeline --clip out/tiny-t2i/clip --num-images 64
"""

from __future__ import annotations

import argparse
import time

import torch

from vispec.eval.bench.clip_score import clip_score, load_clip
from vispec.eval.bench.scene_checks import check_images
from vispec.eval.bench.scenes import SceneSampler
from vispec.pipelines import UnifiedImagePipeline


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pipeline", required=True)
    parser.add_argument("--clip", default=None)
    parser.add_argument("--num-images", type=int, default=64)
    parser.add_argument("--methods", default="ar,sjd,mc-sjd")
    parser.add_argument("--guidance-scale", type=float, default=None)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    pipe = UnifiedImagePipeline.from_pretrained(args.pipeline)
    pipe.set_progress_bar_config(disable=True)
    clip = load_clip(args.clip) if args.clip else None
    held_out = SceneSampler("test", seed=args.seed).sample(args.num_images)
    groups: dict = {}
    for i, scene in enumerate(held_out.scenes):
        groups.setdefault((scene.height, scene.width), []).append(i)
    for method in args.methods.split(","):
        images, captions, nfe, tokens, start = [], [], 0, 0, time.perf_counter()
        for (height, width), index in groups.items():
            prompts = [held_out.captions[i] for i in index]
            out = pipe(prompts, height=height, width=width, decoding=method, guidance_scale=args.guidance_scale,
                       generator=[torch.Generator().manual_seed(args.seed * 1000 + i) for i in index], output_type="pt")
            images += list(out.images * 2 - 1)
            captions += prompts
            nfe += sum(int(s["nfe"]) for s in out.stats)
            tokens += sum(int(s["tokens"]) for s in out.stats)
        seconds = time.perf_counter() - start
        accuracy = check_images(images, captions)["accuracy"]
        score = clip_score(images, captions, *clip) if clip else float("nan")  # a list: both sizes together
        print(f"{method:10s} step x {tokens / nfe:5.2f}  {seconds / len(images):6.3f} s/img  CLIP {score:6.2f}  "
              + "  ".join(f"{k} {v:.3f}" for k, v in accuracy.items()), flush=True)


if __name__ == "__main__":
    main()
