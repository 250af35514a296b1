"""Training the tiny-c2i GPT: a LlamaGen GPT over the VQ tokens of photo crops, class-conditional.

LlamaGen's objective: next-token cross-entropy over the 256 image tokens given the class token,
with class dropout (the label is replaced by the null class with probability 0.1) so that
classifier-free guidance works at sampling time. The token dataset is made once: random training
crops (scale jitter, flips) encoded by the trained VQ tokenizer.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from diffusers import VQModel
from tqdm.auto import tqdm

from vispec.eval.bench.data import CropSampler, to_model_range
from vispec.eval.train.common import (Namer, check_common, check_fields, check_folder, check_heads, field_name,
                                      fit_sequences, write_record)
from vispec.models.checkpoints import diffusers_load_kwargs
from vispec.models.llamagen_gpt import LlamaGenCondition, LlamaGenGPT
from vispec.models.llamagen_vq import encode_to_tokens


@dataclass
class GPTTrainConfig:
    vq: str = "out/tiny-c2i/vqvae"
    out: str = "out/tiny-c2i/transformer"
    num_sequences: int = 25600
    steps: int = 1600
    batch_size: int = 32
    lr: float = 1e-3
    weight_decay: float = 0.05
    dim: int = 256
    n_layer: int = 4  # ~3.9M parameters: ~1.7 s per step of 32 x 256 tokens on 2 CPU cores (~45 min)
    n_head: int = 4
    class_dropout_prob: float = 0.1
    dropout: float = 0.0  # one pass over the data: regularisation only slows learning
    seed: int = 0
    log_every: int = 25

    def validate(self, name: Namer = field_name) -> None:
        """Every field, before any work (:mod:`vispec.eval.train.common`); ``vq`` must be a local VQ folder."""
        check_common(self, name)
        check_fields(self, name, counts=("num_sequences", "dim", "n_layer", "n_head"),
                     fractions=("class_dropout_prob", "dropout"))
        check_heads(self, "dim", "n_head", name, multiple=4)
        check_folder(self, "vq", name, holds="config.json", what="the VQ folder `vispec train vq` wrote")


@torch.no_grad()
def make_token_dataset(vq: VQModel, count: int, seed: int, batch: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tokens int16 [count, 256], labels [count])`` from random training crops."""
    sampler = CropSampler("train")
    gen = torch.Generator().manual_seed(seed)
    labels = torch.arange(count) % sampler.num_classes
    labels = labels[torch.randperm(count, generator=gen)]
    tokens = []
    for lo in tqdm(range(0, count, batch), desc="tokenise crops", mininterval=5):
        images, _ = sampler.sample(min(batch, count - lo), gen, labels=labels[lo : lo + batch])
        tokens.append(encode_to_tokens(vq, to_model_range(images)).flatten(1).to(torch.int16))
    return torch.cat(tokens), labels


def build_gpt(cfg: GPTTrainConfig, vocab_size: int, num_classes: int) -> LlamaGenGPT:
    return LlamaGenGPT(
        vocab_size=vocab_size, dim=cfg.dim, n_layer=cfg.n_layer, n_head=cfg.n_head, num_classes=num_classes,
        class_dropout_prob=cfg.class_dropout_prob, block_size=256, token_dropout_p=cfg.dropout,
        resid_dropout_p=cfg.dropout, ffn_dropout_p=cfg.dropout,
    )


def train_gpt(cfg: GPTTrainConfig) -> dict:
    cfg.validate()
    torch.manual_seed(cfg.seed)
    vq = VQModel.from_pretrained(cfg.vq, **diffusers_load_kwargs()).eval()
    os.makedirs(cfg.out, exist_ok=True)
    cache = os.path.join(cfg.out, f"tokens_{cfg.num_sequences}_{cfg.seed}.pt")
    if os.path.exists(cache):
        tokens, labels = torch.load(cache, weights_only=True).values()
    else:
        tokens, labels = make_token_dataset(vq, cfg.num_sequences, cfg.seed)
        torch.save({"tokens": tokens, "labels": labels}, cache)
    num_classes = int(labels.max()) + 1
    gpt = build_gpt(cfg, vq.config.num_vq_embeddings, num_classes).train()

    def next_token_loss(seq: torch.Tensor, labels: torch.Tensor, gen: torch.Generator):
        logits = gpt(seq[:, :-1], LlamaGenCondition(class_labels=labels))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), seq.reshape(-1)), None

    start = time.time()
    last = fit_sequences(gpt, tokens, labels, cfg, next_token_loss, desc="train gpt")
    gpt.eval()
    metrics = {"train_minutes": round((time.time() - start) / 60, 1), "final_loss": last["loss"],
               "parameters": sum(p.numel() for p in gpt.parameters())}
    gpt.save_pretrained(cfg.out)
    write_record(cfg.out, cfg, metrics)
    return metrics
