"""What the embedded-model trainers share: the learning-rate schedule, LlamaGen's AdamW, the training loop
(:func:`fit`; :func:`fit_sequences` for the GPTs, whose trainers differ only in the loss) and training records.

The checks of their settings live in :mod:`vispec.eval.train.checks` (torch-free, for the CLI) and are re-exported
here; the configs themselves in :mod:`vispec.eval.train.configs`.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict
from typing import Any, Callable, Optional

import torch
from tqdm.auto import tqdm

from vispec.eval.train.checks import (MAX_SEED, Namer, check_choice, check_common, check_decoding_defaults,  # noqa: F401
                                      check_fields, check_folder, check_heads, check_pipeline_name, field_name)

# step_loss(step) -> (loss, extras): extras is None or a callable giving more log fields (called on logged steps only)
Extras = Optional[Callable[[], dict]]
StepLoss = Callable[[int], tuple[torch.Tensor, Extras]]


def warmup_cosine(optimizer: torch.optim.Optimizer, steps: int, warmup: int, floor: float = 0.0) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up over ``warmup`` steps, then cosine decay to ``floor`` times the base rate at ``steps``."""
    def factor(step: int) -> float:
        return min(1.0, (step + 1) / warmup) * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * step / steps)))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def adamw(model: torch.nn.Module, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """LlamaGen's (and LLaDA's) AdamW, betas 0.9 / 0.95: weight decay on matrices only, not on norms and biases."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.95))


def fit(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    steps: int,
    step_loss: StepLoss,
    *,
    out: str,
    desc: str,
    log_every: int,
    loss_name: str = "loss",
    clip_norm: Optional[float] = 1.0,
    after_step: Optional[Callable[[int], None]] = None,
) -> dict:
    """``steps`` optimiser steps on ``step_loss(step)`` (gradient clipping at ``clip_norm`` unless None;
    ``after_step(step)`` after each update). Every ``log_every`` steps and at the last one, a record
    ``{"step", loss_name, **extras(), "elapsed_s"}`` goes to ``out/train_log.jsonl``; returns the last one."""
    start = time.time()
    record: dict = {}
    with open(os.path.join(out, "train_log.jsonl"), "w") as log:
        bar = tqdm(range(steps), desc=desc, mininterval=5)
        for step in bar:
            loss, extras = step_loss(step)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if clip_norm is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip_norm)
            optimizer.step()
            scheduler.step()
            if after_step is not None:
                after_step(step)
            if step % log_every == 0 or step == steps - 1:
                record = {"step": step, loss_name: loss.item(), **(extras() if extras else {}),
                          "elapsed_s": round(time.time() - start, 1)}
                log.write(json.dumps(record) + "\n")
                log.flush()
                bar.set_postfix({k: f"{v:.3f}" if isinstance(v, float) else v for k, v in record.items()
                                 if k not in ("step", "elapsed_s")})
    return record


def fit_sequences(
    model: torch.nn.Module,
    tokens: torch.Tensor,
    labels: torch.Tensor,
    cfg: Any,
    sequence_loss: Callable[[torch.Tensor, torch.Tensor, torch.Generator], tuple[torch.Tensor, Extras]],
    *,
    desc: str,
    loss_name: str = "loss",
) -> dict:
    """The GPT trainers' loop: :func:`adamw`, 100 warm-up steps then cosine decay to 0.1, gradient clipping at 1,
    and each step ``cfg.batch_size`` sequences of ``tokens`` (with their ``labels``) drawn with replacement by a
    generator seeded ``cfg.seed + 1``, which ``sequence_loss(sequences, labels, generator)`` may draw from too.
    ``cfg`` has ``steps``, ``batch_size``, ``lr``, ``weight_decay``, ``seed``, ``log_every`` and ``out``."""
    optimizer = adamw(model, cfg.lr, cfg.weight_decay)
    scheduler = warmup_cosine(optimizer, cfg.steps, warmup=100, floor=0.1)
    gen = torch.Generator().manual_seed(cfg.seed + 1)

    def step_loss(step: int):
        pick = torch.randint(0, tokens.shape[0], (cfg.batch_size,), generator=gen)
        return sequence_loss(tokens[pick].long(), labels[pick], gen)

    return fit(model, optimizer, scheduler, cfg.steps, step_loss, out=cfg.out, desc=desc, log_every=cfg.log_every,
               loss_name=loss_name)


def write_record(out: str, config: Any, metrics: dict) -> None:
    """``train_config.json``: the dataclass config and the final metrics, beside the saved weights."""
    with open(os.path.join(out, "train_config.json"), "w") as handle:
        json.dump({"config": asdict(config), "metrics": metrics}, handle, indent=2)
