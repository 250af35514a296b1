"""What every image decoder does first: validate, prefill, derive per-sample seeds, sample token 0."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor

from vispec.checks import check_int
from vispec.kernels.philox import GeneratorArg, per_sample_seeds
from vispec.kernels.target import window_target
from vispec.kernels.verify import SampleRequest
from vispec.outputs import StepCallback
from vispec.protocol import SpeculativeARModel, WindowLogits
from vispec.sampling import PositionProcessor, SamplingConfig


@dataclass
class DecodeJob:
    """What every image decoder is asked besides the model, the condition and the decoding spec
    (:func:`vispec.decoding.decode` documents each field)."""

    num_tokens: int
    sampling: SamplingConfig
    generator: GeneratorArg = None
    processors: tuple[PositionProcessor, ...] = ()
    grid_width: Optional[int] = None
    callback: Optional[StepCallback] = None
    backend: str = "auto"


def resolve_grid_width(model: Any, num_tokens: int, grid_width: Optional[int], init: str = "horizontal") -> int:
    """The token grid's width: given, the model's ``grid_size``, or the side of a square ``num_tokens``."""
    if grid_width is not None:
        return grid_width
    if hasattr(model, "grid_size"):
        return int(model.grid_size)
    side = math.isqrt(num_tokens) if isinstance(num_tokens, int) and num_tokens > 0 else 0
    if side * side == num_tokens:
        return side
    if init == "vertical":
        raise ValueError(f"grid_width is needed for vertical initialisation of {num_tokens} tokens (not a square grid)")
    return num_tokens


@dataclass
class DecodeStart:
    """What every decoder has after validating its inputs and running the prefill."""

    state: Any
    logits: WindowLogits
    seeds: Tensor  # [B]
    clock: "Clock"
    vocab: int

    @property
    def batch(self) -> int:
        return int(self.logits.cond.shape[0])

    @property
    def device(self) -> torch.device:
        return self.logits.cond.device


def start_decoding(model: SpeculativeARModel, condition: Any, job: DecodeJob, *, window: int, grid_width: int) -> DecodeStart:
    """Validate, prefill the condition (token 0's logits), start the clock and derive per-sample seeds."""
    check_int("num_tokens", job.num_tokens, minimum=1)
    check_int("grid_width", grid_width, minimum=1)
    vocab = model.image_vocab_size
    if vocab < 1:
        raise ValueError(f"model reports an empty vocabulary ({vocab})")
    job.sampling.check_vocab(vocab)
    state, logits = model.prefill(condition, guidance=job.sampling.uses_guidance, max_new_tokens=job.num_tokens, window=window)
    clock = Clock(logits.cond.device)
    seeds = per_sample_seeds(job.generator, int(logits.cond.shape[0]), logits.cond.device)
    return DecodeStart(state, logits, seeds, clock, vocab)


def sample_tokens(logits: WindowLogits, position: Tensor, draws: Tensor, seeds: Tensor, job: DecodeJob,
                  validate: bool = False) -> Tensor:
    """``[B]`` tokens drawn from the processed target of ``logits [B, 1, V]``: the exponential race keyed
    by (seed, ``position [B]``, SAMPLE, ``draws [B]``)."""
    ones = torch.ones_like(position)
    target = window_target(logits.cond, logits.uncond, position[:, None], ones, seeds, job.sampling, job.processors,
                           backend=job.backend, validate=validate)
    return target.sample(SampleRequest(fresh=ones.bool(), fresh_draws=draws))[1]


def first_token(start: DecodeStart, job: DecodeJob) -> Tensor:
    """``[B]`` token 0 of every sample, from the prefill's logits (draw 0)."""
    zeros = torch.zeros(start.batch, dtype=torch.long, device=start.device)
    return sample_tokens(start.logits, zeros, zeros, start.seeds, job, validate=True)


class Clock:
    """Wall time since construction, synchronising CUDA so latencies are real."""

    def __init__(self, device: torch.device):
        self.device = device
        self._sync()
        self.start = time.perf_counter()

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def now(self) -> float:
        self._sync()
        return time.perf_counter() - self.start
