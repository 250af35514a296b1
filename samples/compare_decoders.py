"""Decode the same classes with AR, SJD and MC-SJD and compare tokens per forward pass.

    python samples/compare_decoders.py                                   # random-init GPT-mini
    python samples/compare_decoders.py --gpt c2i_B_256.pt --gpt-model GPT-B --vq vq_ds16_c2i.pt --out grid.png

With ``--gpt``/``--vq`` (official LlamaGen checkpoints) the decoded images are saved as a grid, one
row per decoder. Output of the first form: samples/compare_decoders.out.txt.
"""

from __future__ import annotations

import argparse

import torch

from vispec.decoding import DecodingConfig, decode
from vispec.models.llamagen_gpt import LlamaGenCondition, LlamaGenGPT
from vispec.sampling import SamplingConfig

METHODS = ["ar", "sjd-horizontal", "sjd-vertical", "mc-sjd-maximal", "mc-sjd-gumbel"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpt", help="official LlamaGen c2i checkpoint (.pt)")
    parser.add_argument("--gpt-model", default="GPT-B")
    parser.add_argument("--vq", help="official LlamaGen VQ checkpoint (.pt)")
    parser.add_argument("--classes", default="1,2,3,4")
    parser.add_argument("--cfg", type=float, default=2.0)
    parser.add_argument("--out", default=None, help="PNG grid (needs --vq)")
    args = parser.parse_args()

    if args.gpt:
        from vispec.models.llamagen_checkpoint import load_llamagen_gpt

        gpt = load_llamagen_gpt(args.gpt, gpt_model=args.gpt_model, trust_pickle=True)
    else:
        torch.manual_seed(0)
        gpt = LlamaGenGPT.from_name("GPT-mini", vocab_size=1024, num_classes=10).eval()
        torch.nn.init.normal_(gpt.output.weight, std=0.02)
    labels = torch.tensor([int(c) for c in args.classes.split(",")])
    sampling = SamplingConfig(guidance_scale=args.cfg)
    rows = []
    for method in METHODS:
        gens = [torch.Generator().manual_seed(i) for i in range(len(labels))]
        out = decode(gpt, LlamaGenCondition(class_labels=labels), num_tokens=gpt.num_image_tokens,
                     sampling=sampling, decoding=DecodingConfig.parse(method), generator=gens)
        print(f"{method:<16} NFE per image {out.stats.nfe.tolist()}  tokens/forward {out.stats.tokens_per_forward.mean():.2f}")
        rows.append(out.tokens)
    if args.vq and args.out:
        from PIL import Image

        from vispec.models.llamagen_vq import decode_tokens, load_llamagen_vq, to_uint8

        vq = load_llamagen_vq(args.vq)
        side = gpt.grid_size
        with torch.no_grad():
            images = [to_uint8(decode_tokens(vq, t.view(-1, side, side))) for t in rows]  # [B, 3, H, W] each
        grid = torch.cat([torch.cat(list(img), dim=2) for img in images], dim=1)  # rows = decoders
        Image.fromarray(grid.permute(1, 2, 0).numpy()).save(args.out)
        print(f"saved {args.out}")


if __name__ == "__main__":
    main()
