"""Training the tiny-c2i evaluator (:class:`vispec.eval.bench.evaluator.CropClassifier`) on training crops,
with its top-1 accuracy on held-out crops as the final metric."""

from __future__ import annotations

import os
import time

import torch
import torch.nn.functional as F

from vispec.eval.bench.data import CropSampler, to_model_range
from vispec.eval.bench.evaluator import CropClassifier, classify_accuracy
from vispec.eval.train.common import fit, warmup_cosine, write_record
from vispec.eval.train.configs import EvaluatorTrainConfig  # its home: torch-free, for the CLI (re-exported here)


def train_evaluator(cfg: EvaluatorTrainConfig) -> dict:
    cfg.validate()
    torch.manual_seed(cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed)
    train, held_out = CropSampler("train"), CropSampler("eval")
    model = CropClassifier(num_classes=train.num_classes, width=cfg.width, feature_dim=cfg.feature_dim).train()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    sched = warmup_cosine(opt, cfg.steps, warmup=100)
    os.makedirs(cfg.out, exist_ok=True)

    def step_loss(step: int):
        images, labels = train.sample(cfg.batch_size, gen)
        return F.cross_entropy(model(to_model_range(images)), labels, label_smoothing=0.05), None

    start = time.time()
    fit(model, opt, sched, cfg.steps, step_loss, out=cfg.out, desc="train evaluator", log_every=cfg.log_every, clip_norm=None)
    model.eval()
    eval_labels = torch.arange(cfg.eval_images) % held_out.num_classes
    images, labels = held_out.sample(cfg.eval_images, torch.Generator().manual_seed(cfg.seed + 1), labels=eval_labels)
    metrics = {"train_minutes": round((time.time() - start) / 60, 1), "held_out_accuracy": classify_accuracy(model, images, labels),
               "held_out_images": cfg.eval_images}
    model.save_pretrained(cfg.out)
    write_record(cfg.out, cfg, metrics)
    return metrics
