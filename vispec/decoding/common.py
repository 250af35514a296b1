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
    compile: bool = False
    max_batch_size: Optional[int] = None
    source: Optional[Tensor] = None  # [requests, num_tokens] source tokens for init="source" (IAD), -1: none


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
    logits: WindowLogits  # of the first ``batch`` requests
    seeds: Tensor  # [requests]: one per request, in the caller's order
    clock: "Clock"
    vocab: int
    condition: Any  # every request's condition
    requests: int

    @property
    def batch(self) -> int:
        return int(self.logits.cond.shape[0])

    @property
    def device(self) -> torch.device:
        return self.logits.cond.device


def condition_size(condition: Any) -> int:
    """How many samples a condition describes (its ``batch_size``)."""
    size = getattr(condition, "batch_size", None)
    if not isinstance(size, int):
        raise ValueError(f"condition must report its batch_size, got {type(condition).__name__}")
    return size


def select_condition(condition: Any, index: Tensor) -> Any:
    """The conditions of samples ``index`` (the condition's ``select`` method)."""
    if not hasattr(condition, "select"):
        raise ValueError(f"streaming requests through a batch needs condition.select(index); {type(condition).__name__} has none")
    return condition.select(index)


def start_decoding(model: SpeculativeARModel, condition: Any, job: DecodeJob, *, window: int, grid_width: int) -> DecodeStart:
    """Validate, prefill the first requests (token 0's logits), start the clock and derive every request's seed.

    With ``job.max_batch_size`` smaller than the number of requests, only the first ``max_batch_size``
    are prefilled; the rest wait for free slots (:class:`vispec.decoding.speculative.RaggedBatch`)."""
    check_int("num_tokens", job.num_tokens, minimum=1)
    check_int("grid_width", grid_width, minimum=1)
    if job.max_batch_size is not None:
        check_int("max_batch_size", job.max_batch_size, minimum=1)
    vocab = model.image_vocab_size
    if vocab < 1:
        raise ValueError(f"model reports an empty vocabulary ({vocab})")
    job.sampling.check_vocab(vocab)
    requests = condition_size(condition)
    first = condition
    if job.max_batch_size is not None and requests > job.max_batch_size:
        first = select_condition(condition, torch.arange(job.max_batch_size))
    state, logits = model.prefill(first, guidance=job.sampling.uses_guidance, max_new_tokens=job.num_tokens, window=window,
                                  validate=False)
    clock = Clock(logits.cond.device)
    seeds = per_sample_seeds(job.generator, requests, logits.cond.device)
    return DecodeStart(state, logits, seeds, clock, vocab, condition, requests)


def sample_tokens(logits: WindowLogits, position: Tensor, draws: Tensor, seeds: Tensor, job: DecodeJob,
                  validate: bool = False) -> tuple[Tensor, Tensor]:
    """``([B] tokens, status)``: tokens drawn from the processed target of ``logits [B, 1, V]`` by the
    exponential race keyed by (seed, ``position [B]``, SAMPLE, ``draws [B]``); ``status`` as
    :attr:`vispec.kernels.target.Target.status` (checked at the caller's synchronisation point)."""
    ones = torch.ones_like(position)
    target = window_target(logits.cond, logits.uncond, position[:, None], ones, seeds, job.sampling, job.processors,
                           backend=job.backend, validate=validate)
    return target.sample(SampleRequest(fresh=ones.bool(), fresh_draws=draws))[1], target.status


def first_token(logits: WindowLogits, seeds: Tensor, job: DecodeJob) -> tuple[Tensor, Tensor]:
    """``[B]`` token 0 of every sample from its prefill logits (draw 0), and the status."""
    zeros = torch.zeros(seeds.shape[0], dtype=torch.long, device=seeds.device)
    return sample_tokens(logits, zeros, zeros, seeds, job)


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
