"""``vispec convert llamagen``: official LlamaGen GPT + VQ checkpoints as a LlamaGenPipeline folder."""

from __future__ import annotations

import argparse

from vispec.cli.paths import check_output_folder

# LlamaGen's evaluation CFG per model size (GETTING_STARTED: 2.0 for B and L, 1.75 for XL and XXL, 1.65 for 3B)
LLAMAGEN_CFG = {"GPT-B": 2.0, "GPT-L": 2.0, "GPT-XL": 1.75, "GPT-XXL": 1.75, "GPT-3B": 1.65}


def _cmd_llamagen(args: argparse.Namespace) -> int:
    from vispec.decoding import DecodingConfig
    from vispec.models.llamagen_checkpoint import load_llamagen_gpt
    from vispec.models.llamagen_vq import load_llamagen_vq
    from vispec.pipelines import LlamaGenPipeline

    check_output_folder(args.out, "--out")
    overrides = {k: v for k, v in (("gpt_model", args.gpt_model), ("n_head", args.n_head), ("image_size", args.image_size),
                                   ("num_classes", args.num_classes), ("cls_token_num", args.cls_token_num)) if v is not None}
    gpt = load_llamagen_gpt(args.gpt, trust_pickle=args.trust_pickle, **overrides)
    vq = load_llamagen_vq(args.vq, variant=args.vq_variant, trust_pickle=args.trust_pickle)
    if vq.config.num_vq_embeddings != gpt.config.vocab_size:
        raise ValueError(f"--vq codebook has {vq.config.num_vq_embeddings} codes but --gpt predicts {gpt.config.vocab_size} tokens")
    guidance = LLAMAGEN_CFG.get(args.gpt_model or "", 2.0) if gpt.has_unconditional else 1.0
    config = DecodingConfig(strategy="sjd", window=16, init="horizontal", guidance_scale=guidance)
    LlamaGenPipeline(transformer=gpt, vqvae=vq, decoding_config=config).save_pretrained(args.out)
    print(f"wrote {args.out} (GPT {sum(p.numel() for p in gpt.parameters()) / 1e6:.1f}M parameters, "
          f"{gpt.grid_size}x{gpt.grid_size} tokens, default CFG {guidance})")
    return 0


def add_convert(sub: argparse._SubParsersAction) -> None:
    convert = sub.add_parser("convert", help="convert official checkpoints").add_subparsers(dest="subcommand", metavar="FAMILY")
    llamagen = convert.add_parser("llamagen", help="LlamaGen GPT + VQ checkpoints -> a LlamaGenPipeline folder")
    llamagen.add_argument("--gpt", required=True, help="GPT checkpoint (.pt, any official layout, or .safetensors)")
    llamagen.add_argument("--vq", required=True, help="VQ checkpoint (vq_ds16_*.pt)")
    llamagen.add_argument("--out", required=True, help="output pipeline folder")
    llamagen.add_argument("--gpt-model", default=None, help="GPT-B, GPT-L, GPT-XL, ... (read from the checkpoint's args if absent)")
    llamagen.add_argument("--n-head", type=int, default=None, help="head count, for GPT names vispec does not know")
    llamagen.add_argument("--image-size", type=int, default=None, help="image size (needed for raw checkpoints)")
    llamagen.add_argument("--num-classes", type=int, default=None)
    llamagen.add_argument("--cls-token-num", type=int, default=None)
    llamagen.add_argument("--vq-variant", default="VQ-16", help="VQ-16 or VQ-8")
    llamagen.add_argument("--trust-pickle", action="store_true",
                          help="allow checkpoints that pickle Python objects (official DDP files pickle their args); runs the pickle")
    llamagen.set_defaults(func=_cmd_llamagen)
