"""``vispec convert llamagen | lumina-mgpt``: official checkpoints as vispec pipeline folders (LlamaGen GPT + VQ as a
``LlamaGenPipeline``; Lumina-mGPT 2.0 + MoVQGAN as a ``UnifiedImagePipeline``)."""

from __future__ import annotations

import argparse
import math
import os
from typing import Optional

from vispec.checks import check_int
from vispec.cli.paths import check_output_folder

# LlamaGen's evaluation CFG per model size (GETTING_STARTED: 2.0 for B and L, 1.75 for XL and XXL, 1.65 for 3B)
LLAMAGEN_CFG = {"GPT-B": 2.0, "GPT-L": 2.0, "GPT-XL": 1.75, "GPT-XXL": 1.75, "GPT-3B": 1.65}
LLAMAGEN_T2I_CFG = 7.5  # autoregressive/sample/sample_t2i.py's --cfg-scale default


def _t5_config(folder: str):
    """The config of a T5 folder (``--text-encoder``), read before any weights."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError) as err:
        raise ValueError(f"--text-encoder {folder!r} holds no readable transformers config (config.json of a T5 "
                         f"model such as flan-t5-xl): {str(err).splitlines()[0]}") from None


def _load_text_encoder(folder: str, tokenizer_folder: str, caption_dim: int, config) -> tuple:
    """``(T5EncoderModel, tokenizer)`` from ``--text-encoder`` (and ``--tokenizer``); the encoder's width must be the
    GPT's ``caption_dim``."""
    from transformers import AutoTokenizer, T5EncoderModel

    width = getattr(config, "d_model", None)
    if width != caption_dim:
        raise ValueError(f"--text-encoder hidden size (d_model) is {width}, but the --gpt checkpoint takes caption "
                         f"features of {caption_dim} (its caption_dim; the official t2i checkpoints: FLAN-T5-XL, 2048)")
    try:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_folder, local_files_only=True)
    except (OSError, ValueError) as err:
        flag = "--tokenizer" if tokenizer_folder != folder else "--text-encoder"
        raise ValueError(f"no tokenizer could be read from {flag} {tokenizer_folder!r} (its tokenizer.json / "
                         f"spiece.model and tokenizer_config.json): {str(err).splitlines()[0]}") from None
    return T5EncoderModel.from_pretrained(folder, local_files_only=True).eval(), tokenizer


def _cmd_llamagen(args: argparse.Namespace) -> int:
    from vispec.decoding import DecodingConfig
    from vispec.models.llamagen_checkpoint import load_llamagen_gpt
    from vispec.models.llamagen_vq import load_llamagen_vq
    from vispec.pipelines import LlamaGenPipeline

    check_output_folder(args.out, "--out")
    if args.tokenizer is not None and args.text_encoder is None:
        raise ValueError("--tokenizer goes with --text-encoder (the T5 encoder whose tokenizer it is)")
    for flag, folder in (("--text-encoder", args.text_encoder), ("--tokenizer", args.tokenizer)):
        if folder is not None and not os.path.isdir(folder):
            raise ValueError(f"{flag} {folder!r} is not a folder")
    t5_config = None if args.text_encoder is None else _t5_config(args.text_encoder)
    overrides = {k: v for k, v in (("gpt_model", args.gpt_model), ("n_head", args.n_head), ("image_size", args.image_size),
                                   ("num_classes", args.num_classes), ("cls_token_num", args.cls_token_num)) if v is not None}
    gpt = load_llamagen_gpt(args.gpt, trust_pickle=args.trust_pickle, **overrides)
    text_encoder = tokenizer = None
    if args.text_encoder is not None:
        if gpt.config.model_type != "t2i":
            raise ValueError("--text-encoder is for caption-conditioned (t2i) checkpoints; --gpt is class-conditional (c2i)")
        text_encoder, tokenizer = _load_text_encoder(args.text_encoder, args.tokenizer or args.text_encoder,
                                                     gpt.config.caption_dim, t5_config)
    vq = load_llamagen_vq(args.vq, variant=args.vq_variant, trust_pickle=args.trust_pickle)
    if vq.config.num_vq_embeddings != gpt.config.vocab_size:
        raise ValueError(f"--vq codebook has {vq.config.num_vq_embeddings} codes but --gpt predicts {gpt.config.vocab_size} tokens")
    if not gpt.has_unconditional:
        guidance = 1.0
    elif gpt.config.model_type == "t2i":
        guidance = LLAMAGEN_T2I_CFG
    else:
        guidance = LLAMAGEN_CFG.get(args.gpt_model or "", 2.0)
    config = DecodingConfig(strategy="sjd", window=16, init="horizontal", guidance_scale=guidance)
    LlamaGenPipeline(transformer=gpt, vqvae=vq, decoding_config=config, text_encoder=text_encoder,
                     tokenizer=tokenizer).save_pretrained(args.out)
    extra = "" if text_encoder is None else \
        f", T5 encoder {sum(p.numel() for p in text_encoder.parameters()) / 1e6:.1f}M parameters"
    print(f"wrote {args.out} (GPT {sum(p.numel() for p in gpt.parameters()) / 1e6:.1f}M parameters, "
          f"{gpt.grid_size}x{gpt.grid_size} tokens, default CFG {guidance}{extra})")
    return 0


def resolution_base(ids: dict[int, int]) -> int:
    """The id of ``<reserved08800>`` (0 patches) from the resolution tokens a tokenizer has, which must be
    consecutive ids (the pipeline computes ``base + n``)."""
    if not ids:
        raise ValueError("the tokenizer has no resolution tokens <reserved{8800 + n:05d}> (Lumina-mGPT 2.0's size tokens)")
    bases = {token_id - n for n, token_id in ids.items()}
    if len(bases) != 1:
        raise ValueError(f"the tokenizer's resolution tokens <reserved{{8800 + n}}> do not have consecutive ids: "
                         f"{dict(sorted(ids.items())[:6])}")
    return bases.pop()


def check_size(size: int, unit: int, resolution_ids: dict[int, int], patch_size: Optional[int] = None) -> None:
    """``--size`` must be a multiple of ``unit`` (the resolution tokens' patch size, and once the MoVQGAN is read
    its downsampling too) with a resolution token for ``size // patch_size`` patches; a ``ValueError`` naming
    ``--size`` otherwise (not the pipeline's ``height``, which the user did not type)."""
    patch_size = patch_size or unit
    if size % unit:
        raise ValueError(f"--size must be a multiple of {unit} pixels (the resolution tokens' patch size"
                         f"{' and the MoVQGAN downsampling' if unit != patch_size else ''}), got {size}")
    if resolution_ids and size // patch_size not in resolution_ids:
        sizes = sorted(n * patch_size for n in resolution_ids if n > 0)
        known = f"{sizes[0]}..{sizes[-1]}" if sizes else "none"
        raise ValueError(f"--size {size}: the tokenizer has no resolution token for {size // patch_size} patches of "
                         f"{patch_size} pixels (sizes it has tokens for: {known})")


def _cmd_lumina(args: argparse.Namespace) -> int:
    import torch
    from transformers import AutoTokenizer

    from vispec.decoding import DecodingConfig
    from vispec.models.lumina_checkpoint import LuminaSpecialTokens, load_lumina_chameleon, read_lumina_config
    from vispec.models.movqgan import load_movqgan
    from vispec.pipelines import UnifiedImagePipeline

    check_output_folder(args.out, "--out")
    check_int("--image-token-offset", args.image_token_offset, minimum=0, hint=" (the vocabulary id of code 0)")
    check_int("--size", args.size, minimum=1, hint=" (the default image size in pixels)")
    for flag, folder in (("--checkpoint", args.checkpoint), ("--tokenizer", args.tokenizer)):
        if folder is not None and not os.path.isdir(folder):
            raise ValueError(f"{flag} {folder!r} is not a folder")
    read_lumina_config(args.checkpoint)  # config.json's fields checked first, in vispec's words (not the tokenizer's)
    tokenizer_dir = args.tokenizer or args.checkpoint
    try:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    except (OSError, ValueError) as err:
        raise ValueError(f"no tokenizer could be read from {tokenizer_dir} (pass --tokenizer FOLDER with its "
                         f"tokenizer.json / tokenizer_config.json): {str(err).splitlines()[0]}") from None
    special = LuminaSpecialTokens.from_vocab(tokenizer.get_vocab(), image_token_offset=args.image_token_offset)
    base = resolution_base(dict(special.resolution_ids))
    check_size(args.size, special.patch_size, dict(special.resolution_ids))
    dtype = None if args.dtype is None else getattr(torch, args.dtype)
    model = load_lumina_chameleon(args.checkpoint, dtype=dtype)
    vq = load_movqgan(args.movqgan, trust_pickle=args.trust_pickle)
    num_codes, downsample = vq.config.num_vq_embeddings, 2 ** (len(vq.config.block_out_channels) - 1)
    check_size(args.size, math.lcm(special.patch_size, downsample), dict(special.resolution_ids), special.patch_size)
    if special.image_token_offset + num_codes > model.config.vocab_size:
        raise ValueError(f"image tokens {special.image_token_offset}..{special.image_token_offset + num_codes - 1} "
                         f"(--image-token-offset + the MoVQGAN's {num_codes} codes) exceed the model's vocabulary "
                         f"({model.config.vocab_size})")
    top_k = special.image_top_k if special.image_top_k < num_codes else 0  # 0: top-k would keep every code
    decoding = DecodingConfig(strategy="mc-sjd", window=16, guidance_scale=special.cfg_scale, top_k=top_k,
                              temperature=special.temperature)
    pipe = UnifiedImagePipeline(
        transformer=model, tokenizer=tokenizer, vqvae=vq, decoding_config=decoding, family="chameleon",
        num_codes=num_codes, code_offset=special.image_token_offset, eol_id=special.end_of_row,
        image_start_id=special.image_start, image_end_ids=[special.image_end], resolution_token_base=base,
        resolution_unit=special.patch_size, downsample=downsample, prompt_template=special.prompt_template,
        prompt_suffix_ids=[] if special.separator is None else [special.separator], cfg_mode="image_start",
        default_height=args.size, default_width=args.size)
    pipe.layout(args.size, args.size)  # the default size fits the tokenizer's grid and resolution tokens
    pipe.save_pretrained(args.out)
    print(f"wrote {args.out} (Chameleon {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, "
          f"{num_codes} codes at ids {special.image_token_offset}.., {args.size}x{args.size} by default, CFG "
          f"{special.cfg_scale} from image start)")
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
    llamagen.add_argument("--text-encoder", default=None,
                          help="t2i checkpoints: the T5 folder (transformers format; FLAN-T5-XL for the official ones), "
                               "saved as text_encoder/ and tokenizer/ so the pipeline takes prompt=")
    llamagen.add_argument("--tokenizer", default=None, help="the T5 tokenizer folder (default: --text-encoder)")
    llamagen.add_argument("--trust-pickle", action="store_true",
                          help="allow checkpoints that pickle Python objects (official DDP files pickle their args); runs the pickle")
    llamagen.set_defaults(func=_cmd_llamagen)

    lumina = convert.add_parser("lumina-mgpt", help="Lumina-mGPT 2.0 checkpoint + MoVQGAN -> a UnifiedImagePipeline folder")
    lumina.add_argument("--checkpoint", required=True,
                        help="the released model folder (config.json + model*.safetensors, tokenizer files)")
    lumina.add_argument("--movqgan", required=True, help="the MoVQGAN checkpoint (movqgan_270M.ckpt)")
    lumina.add_argument("--out", required=True, help="output pipeline folder")
    lumina.add_argument("--tokenizer", default=None, help="tokenizer folder (default: --checkpoint)")
    lumina.add_argument("--image-token-offset", type=int, default=155000,
                        help="vocabulary id of code 0 (Lumina-mGPT 2.0: 155000)")
    lumina.add_argument("--size", type=int, default=768, help="default image size in pixels (default: %(default)s)")
    lumina.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                        help="cast the weights (default: as stored)")
    lumina.add_argument("--trust-pickle", action="store_true", help="allow a MoVQGAN file that pickles Python objects")
    lumina.set_defaults(func=_cmd_lumina)
