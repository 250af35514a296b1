"""Shared pieces of the embedded-model trainers: the learning-rate schedule and training records."""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict
from typing import Any

import torch


def warmup_cosine(optimizer: torch.optim.Optimizer, steps: int, warmup: int, floor: float = 0.0) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up over ``warmup`` steps, then cosine decay to ``floor`` times the base rate at ``steps``."""
    def factor(step: int) -> float:
        return min(1.0, (step + 1) / warmup) * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * step / steps)))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def gpt_optimizer(model: torch.nn.Module, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """LlamaGen's AdamW (betas 0.9 / 0.95): weight decay on matrices only, not on norms and biases."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.95))


def write_record(out: str, config: Any, metrics: dict) -> None:
    """``train_config.json``: the dataclass config and the final metrics, beside the saved weights."""
    with open(os.path.join(out, "train_config.json"), "w") as handle:
        json.dump({"config": asdict(config), "metrics": metrics}, handle, indent=2)
