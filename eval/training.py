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


def write_record(out: str, config: Any, metrics: dict) -> None:
    """``train_config.json``: the dataclass config and the final metrics, beside the saved weights."""
    with open(os.path.join(out, "train_config.json"), "w") as handle:
        json.dump({"config": asdict(config), "metrics": metrics}, handle, indent=2)
