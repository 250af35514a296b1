"""Training the tiny-c2i GPT: a LlamaGen GPT over the VQ tokens of photo crops, class-conditional.

LlamaGen's objective: next-token cross-entropy over the 256 image tokens given the class token,
with class dropout (the label is replaced by the null class with probability 0.1) so that
classifier-free guidance works at sampling time. The token dataset is made once: random training
crops (scale jitter, flips) encoded by the trained VQ tokenizer.
"""

from __future__ import annotations

import os
import time

import torch
import torch.nn.functional as F
from diffusers import VQModel
from tqdm.auto import tqdm

from vispec.eval.bench.data import CropSampler, to_model_range
from vispec.eval.train.common import fit_sequences, write_record
from vispec.eval.train.configs import GPTTrainConfig  # its home: torch-free, for the CLI (re-exported here)
from vispec.models.checkpoints import diffusers_load_kwargs
from vispec.models.llamagen_gpt import LlamaGenCondition, LlamaGenGPT
from vispec.models.llamagen_vq import encode_to_tokens


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
