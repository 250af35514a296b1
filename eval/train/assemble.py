"""Assembling trained parts into the embedded ``tiny-c2i`` pipeline folder (package data).

Layout (a diffusers pipeline folder plus the evaluator and a model card)::

    models/pretrained/tiny-c2i/
        model_index.json, transformer/, vqvae/, decoding_config/   <- LlamaGenPipeline.from_pretrained
        evaluator/                                                 <- CropClassifier (accuracy, FID features)
        README.md                                                  <- training settings and metrics
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass

from diffusers import VQModel

from vispec.decoding import DecodingConfig
from vispec.models.checkpoints import diffusers_load_kwargs
from vispec.eval.data import CLASS_NAMES
from vispec.eval.evaluator import CropClassifier
from vispec.models.llamagen_gpt import LlamaGenGPT

WEIGHT_FILES = ("config.json", "diffusion_pytorch_model.safetensors")


@dataclass
class AssembleConfig:
    vq: str = "out/tiny-c2i/vqvae"
    gpt: str = "out/tiny-c2i/transformer"
    evaluator: str = "out/tiny-c2i/evaluator"
    out: str = "models/pretrained/tiny-c2i"
    guidance_scale: float = 3.0
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    window: int = 16
    init: str = "horizontal"


def _train_metrics(folder: str) -> dict:
    path = os.path.join(folder, "train_config.json")
    return json.load(open(path)) if os.path.exists(path) else {}


def assemble(cfg: AssembleConfig) -> dict:
    from vispec.pipelines import LlamaGenPipeline

    transformer = LlamaGenGPT.from_pretrained(cfg.gpt, **diffusers_load_kwargs()).eval()
    vqvae = VQModel.from_pretrained(cfg.vq, **diffusers_load_kwargs()).eval()
    evaluator = CropClassifier.from_pretrained(cfg.evaluator, **diffusers_load_kwargs()).eval()
    if vqvae.config.num_vq_embeddings != transformer.config.vocab_size:
        raise ValueError(f"VQ codebook ({vqvae.config.num_vq_embeddings}) != GPT vocabulary ({transformer.config.vocab_size})")
    decoding = DecodingConfig(strategy="mc-sjd", window=cfg.window, init=cfg.init, guidance_scale=cfg.guidance_scale,
                              temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p)
    if os.path.isdir(cfg.out):
        shutil.rmtree(cfg.out)
    LlamaGenPipeline(transformer=transformer, vqvae=vqvae, decoding_config=decoding).save_pretrained(cfg.out)
    evaluator.save_pretrained(os.path.join(cfg.out, "evaluator"))
    info = {name: _train_metrics(folder) for name, folder in (("vqvae", cfg.vq), ("transformer", cfg.gpt), ("evaluator", cfg.evaluator))}
    card = [
        "# tiny-c2i: vispec's embedded class-conditional LlamaGen model",
        "",
        f"64x64 crops of {len(CLASS_NAMES)} natural photos bundled with scikit-image; class = source photo:",
        ", ".join(f"{i} {n}" for i, n in enumerate(CLASS_NAMES)) + ".",
        "",
        f"- VQ tokenizer: LlamaGen VQ family at downsample 4 (16x16 tokens), cosine codebook of {vqvae.config.num_vq_embeddings} codes.",
        f"- GPT: LlamaGen architecture, {sum(p.numel() for p in transformer.parameters()) / 1e6:.2f}M parameters, "
        f"class dropout {transformer.config.class_dropout_prob}.",
        f"- Default sampling: CFG {cfg.guidance_scale}, temperature {cfg.temperature}, top-k {cfg.top_k}, top-p {cfg.top_p}; "
        f"decoding mc-sjd (window {cfg.window}).",
        "- Reproduce with samples/train_tiny_c2i.sh (seeded).",
        "",
        "## Training records",
        "```json",
        json.dumps(info, indent=2),
        "```",
    ]
    with open(os.path.join(cfg.out, "README.md"), "w") as handle:
        handle.write("\n".join(card) + "\n")
    return {"out": cfg.out, "files": sorted(os.listdir(cfg.out))}
