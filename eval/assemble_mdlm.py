"""Assembling a trained masked diffusion LM into the embedded ``tiny-mdlm`` pipeline folder (package data).

Layout (a diffusers pipeline folder plus a model card and the training log)::

    models/pretrained/tiny-mdlm/
        model_index.json, model/, tokenizer/, scheduler/   <- MaskedDiffusionLMPipeline.from_pretrained
        README.md                                          <- tasks, sizes, training settings and metrics
        logs/model.jsonl                                   <- the loss log
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass

from vispec.models.checkpoints import diffusers_load_kwargs


@dataclass
class MDLMAssembleConfig:
    trained: str = "out/tiny-mdlm"  # the folder `vispec train mdlm --out` wrote
    out: str = "models/pretrained/tiny-mdlm"
    gen_length: int = 0  # 0: the training answer length
    block_length: int = 8
    threshold: float = 0.9  # the default scheduler: Fast-dLLM's threshold rule


def assemble_mdlm(cfg: MDLMAssembleConfig) -> dict:
    from vispec.dllm import ThresholdScheduler
    from vispec.eval.text_tokenizer import load_text_tokenizer
    from vispec.models.llada import LLaDAModelLM
    from vispec.pipelines import MaskedDiffusionLMPipeline

    record = json.load(open(os.path.join(cfg.trained, "train_config.json")))
    gen_length = cfg.gen_length or record["config"]["answer_length"]
    if gen_length % cfg.block_length:
        raise ValueError(f"gen_length ({gen_length}) must be a multiple of block_length ({cfg.block_length})")
    model = LLaDAModelLM.from_pretrained(os.path.join(cfg.trained, "transformer"), **diffusers_load_kwargs()).eval()
    tokenizer = load_text_tokenizer(os.path.join(cfg.trained, "tokenizer"))
    pipe = MaskedDiffusionLMPipeline(model=model, tokenizer=tokenizer, scheduler=ThresholdScheduler(threshold=cfg.threshold),
                                     default_gen_length=gen_length, default_block_length=cfg.block_length)
    if os.path.isdir(cfg.out):
        shutil.rmtree(cfg.out)
    pipe.save_pretrained(cfg.out)
    os.makedirs(os.path.join(cfg.out, "logs"), exist_ok=True)
    shutil.copy(os.path.join(cfg.trained, "train_log.jsonl"), os.path.join(cfg.out, "logs", "model.jsonl"))
    c = model.config
    card = [
        "# tiny-mdlm: vispec's embedded masked diffusion LM",
        "",
        "A LLaDA-architecture mask predictor (bidirectional Llama blocks, RMSNorm, SwiGLU, RoPE, untied head) trained",
        "with LLaDA's SFT objective on vispec's synthetic task suite (vispec.eval.text_tasks): arithmetic word problems",
        "with worked solutions ending in `#### <answer>` (GSM8K format), sorting digits with repeats (tokens depend",
        "strongly on each other) and reversing letters (nearly independent tokens).",
        "",
        f"- Model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, d_model {c.d_model}, {c.n_layers} layers, "
        f"{c.n_heads} heads, MLP {c.mlp_hidden_size}, vocabulary {c.vocab_size} (word-level tokenizer, numbers as single tokens).",
        f"- Defaults: gen length {gen_length}, block length {cfg.block_length}, scheduler threshold {cfg.threshold} "
        "(pass strategy='llada' for the one-token-per-step baseline).",
        "- Reproduce with samples/train_tiny_mdlm.sh (seeded).",
        "",
        "## Training record",
        "```json",
        json.dumps(record, indent=2),
        "```",
    ]
    with open(os.path.join(cfg.out, "README.md"), "w") as handle:
        handle.write("\n".join(card) + "\n")
    return {"out": cfg.out, "files": sorted(os.listdir(cfg.out))}
