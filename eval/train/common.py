"""What the embedded-model trainers share: the learning-rate schedule, LlamaGen's AdamW, the training loop
(:func:`fit`; :func:`fit_sequences` for the GPTs, whose trainers differ only in the loss), training records, and
the checks of their settings.

Every trainer config has ``validate(name=field_name)``: each field checked before any work (no data made, no model
built, no folder written), a ``ValueError`` naming the field as ``name(field)`` says, which is the field itself in
Python and its flag (``--batch-size``) on the command line (:mod:`vispec.cli.train`). The trainers call it first.
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

from vispec.checks import check_int, check_number

# how a check calls a config field: the field itself (Python), or the flag that sets it (the command line)
Namer = Callable[[str], str]
MAX_SEED = 2**32 - 1  # numpy's and most tools' seed range; seeds offset by small counts stay in torch's

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


def field_name(field: str) -> str:
    """The default :data:`Namer`: errors name the config field itself."""
    return field


def check_fields(cfg: Any, name: Namer = field_name, *, counts: tuple[str, ...] = (), non_negative: tuple[str, ...] = (),
                 positive: tuple[str, ...] = (), non_negative_numbers: tuple[str, ...] = (),
                 fractions: tuple[str, ...] = ()) -> None:
    """Range checks of ``cfg``'s fields, each error naming ``name(field)``: ``counts`` integers >= 1, ``non_negative``
    integers >= 0 (0 usually meaning "off" or "the default"), ``positive`` finite numbers > 0,
    ``non_negative_numbers`` finite numbers >= 0, ``fractions`` probabilities in [0, 1)."""
    for field in counts:
        check_int(name(field), getattr(cfg, field), minimum=1)
    for field in non_negative:
        check_int(name(field), getattr(cfg, field), minimum=0)
    for field in positive:
        check_number(name(field), getattr(cfg, field), minimum=0, exclusive_minimum=True)
    for field in non_negative_numbers:
        check_number(name(field), getattr(cfg, field), minimum=0)
    for field in fractions:
        value = getattr(cfg, field)
        check_number(name(field), value, minimum=0, maximum=1)
        if value == 1:
            raise ValueError(f"{name(field)} must be a probability in [0, 1) (1 would drop every one), got {value!r}")


def check_common(cfg: Any, name: Namer = field_name) -> None:
    """The fields most trainers share, where ``cfg`` has them: ``out`` (a non-empty path), ``seed`` (in
    [0, :data:`MAX_SEED`]), ``steps``, ``batch_size`` and ``log_every`` (>= 1), ``lr`` (> 0) and ``weight_decay``
    (>= 0)."""
    if hasattr(cfg, "out") and (not isinstance(cfg.out, str) or not cfg.out):
        raise ValueError(f"{name('out')} must be a folder path, got {cfg.out!r}")
    if hasattr(cfg, "seed") and check_int(name("seed"), cfg.seed, minimum=0) > MAX_SEED:
        raise ValueError(f"{name('seed')} must be an integer in [0, {MAX_SEED}], got {cfg.seed}")
    check_fields(cfg, name, counts=tuple(f for f in ("steps", "batch_size", "log_every") if hasattr(cfg, f)),
                 positive=("lr",) if hasattr(cfg, "lr") else (),
                 non_negative_numbers=("weight_decay",) if hasattr(cfg, "weight_decay") else ())


def check_folder(cfg: Any, field: str, name: Namer = field_name, *, holds: str = "", what: str = "a folder") -> None:
    """``cfg.<field>`` must be an existing folder (holding the file ``holds``, when given); the error names
    ``name(field)``, the path and ``what`` was expected there. Nothing is looked up online."""
    path = getattr(cfg, field)
    if not isinstance(path, str) or not path:
        raise ValueError(f"{name(field)} must be {what}, got {path!r}")
    if not os.path.isdir(path):
        why = "is not a folder" if os.path.exists(path) else "does not exist"
        raise ValueError(f"{name(field)} {path!r} {why}; expected {what}")
    if holds and not os.path.isfile(os.path.join(path, holds)):
        raise ValueError(f"{name(field)} {path!r} has no {holds}; expected {what}")


def check_choice(cfg: Any, field: str, choices: tuple[str, ...], name: Namer = field_name) -> None:
    """``cfg.<field>`` must be one of ``choices``."""
    if getattr(cfg, field) not in choices:
        raise ValueError(f"{name(field)} must be one of {', '.join(choices)}, got {getattr(cfg, field)!r}")


def check_heads(cfg: Any, dim: str, heads: str, name: Namer = field_name, *, multiple: int = 2) -> None:
    """``cfg.<dim>`` must split into ``cfg.<heads>`` heads whose size is a multiple of ``multiple`` (RoPE rotates
    pairs; LlamaGen's 2-D RoPE needs 4)."""
    width, count = getattr(cfg, dim), getattr(cfg, heads)
    if width % count or (width // count) % multiple:
        raise ValueError(f"{name(dim)} ({width}) must split into {name(heads)} ({count}) heads whose size is a "
                         f"multiple of {multiple}")


def check_pipeline_name(cfg: Any, field: str, name: Namer = field_name) -> None:
    """``cfg.<field>`` must be an embedded model name or a local pipeline folder (nothing is downloaded)."""
    from vispec.pipelines.embedded import resolve_model_path

    try:
        resolve_model_path(getattr(cfg, field))
    except (ValueError, TypeError) as err:
        raise ValueError(f"{name(field)}: {err}") from None


def check_decoding_defaults(cfg: Any, name: Namer = field_name, *, strategy: str = "mc-sjd") -> None:
    """The sampling and window defaults an assembler stores in a pipeline (``guidance_scale``, ``temperature``,
    ``top_k``, ``top_p``, ``window``, ``init`` where present) as :class:`~vispec.decoding.DecodingConfig` checks
    them, the error naming ``name(field)``."""
    from vispec.decoding import DecodingConfig

    keys = [k for k in ("window", "init", "guidance_scale", "temperature", "top_k", "top_p") if hasattr(cfg, k)]
    try:
        DecodingConfig(strategy=strategy, **{k: getattr(cfg, k) for k in keys})
    except ValueError as err:
        message = str(err)
        field = next((k for k in keys if message.startswith(k)), None)
        if field is None:
            raise
        raise ValueError(name(field) + message[len(field):]) from None
