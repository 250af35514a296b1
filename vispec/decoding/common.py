"""Shared pieces of the decoders: inputs, per-sample statistics, outputs."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Optional, Sequence, Union

import torch
from torch import Tensor

from vispec.kernels.philox import GeneratorArg, per_sample_seeds  # noqa: F401 (re-exported)

if TYPE_CHECKING:
    from vispec.protocol import SpeculativeARModel, WindowLogits
    from vispec.sampling import SamplingConfig

StepCallback = Callable[[int, Tensor, Tensor], None]
"""``f(step, num_committed [B], tokens [B, N])`` after every forward pass (progress bars, callbacks).

``tokens`` holds each sample's committed tokens in raster order and -1 where nothing is committed
yet; it is a copy, so changing it does not affect decoding."""


@dataclass
class DecodeStats:
    """Per-sample decoding statistics (tensors of shape ``[B]``).

    * ``nfe``: forward passes spent on the sample (the prefill included);
    * ``tokens``: tokens generated;
    * ``accepted_drafts``: drafts accepted over all verification passes;
    * ``latency_s``: wall time from the start of decoding until the sample finished;
    * ``tv_mean``, ``tv_max``: with a lossy acceptance rule, the mean and max total-variation
      distance of a verification's output distribution from the exact target (``None`` for exact
      decoders; :mod:`vispec.decoding.acceptance`).
    """

    nfe: Tensor
    tokens: Tensor
    accepted_drafts: Tensor
    latency_s: Tensor
    tv_mean: Optional[Tensor] = None
    tv_max: Optional[Tensor] = None

    @property
    def tokens_per_forward(self) -> Tensor:
        """Tokens per forward pass (= step compression against AR, which makes one per pass)."""
        return self.tokens.double() / self.nfe.double()

    @property
    def accepted_per_forward(self) -> Tensor:
        """Mean accepted draft tokens per verification pass (the prefill excluded)."""
        return self.accepted_drafts.double() / (self.nfe - 1).clamp_min(1).double()

    def summary(self) -> dict[str, float]:
        return {
            "nfe": float(self.nfe.double().mean()),
            "tokens": float(self.tokens.double().mean()),
            "tokens_per_forward": float(self.tokens_per_forward.mean()),
            "accepted_per_forward": float(self.accepted_per_forward.mean()),
            "latency_s": float(self.latency_s.mean()),
            **({} if self.tv_mean is None else {"tv_mean": float(self.tv_mean.nanmean()), "tv_max": float(self.tv_max.nan_to_num(0).max())}),
        }


@dataclass
class DecodeOutput:
    """Generated tokens ``[B, N]`` (raster order) and per-sample statistics."""

    tokens: Tensor
    stats: DecodeStats
    method: str = ""
    extra: dict = field(default_factory=dict)


def check_common(num_tokens: int, grid_width: int, model_vocab: int, max_tokens: Optional[int] = None) -> None:
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 1:
        raise ValueError(f"num_tokens must be an integer >= 1, got {num_tokens!r}")
    if max_tokens is not None and num_tokens > max_tokens:
        raise ValueError(f"num_tokens={num_tokens} exceeds the model's {max_tokens} image tokens")
    if isinstance(grid_width, bool) or not isinstance(grid_width, int) or grid_width < 1:
        raise ValueError(f"grid_width must be an integer >= 1, got {grid_width!r}")
    if model_vocab < 1:
        raise ValueError(f"model reports an empty vocabulary ({model_vocab})")


@dataclass
class DecodeStart:
    """What every decoder has after validating its inputs and running the prefill."""

    state: object
    logits: "WindowLogits"
    seeds: Tensor  # [B]
    clock: "Clock"
    vocab: int

    @property
    def batch(self) -> int:
        return int(self.logits.cond.shape[0])

    @property
    def device(self) -> torch.device:
        return self.logits.cond.device


def start_decoding(
    model: "SpeculativeARModel", condition, *, num_tokens: int, grid_width: int, sampling: "SamplingConfig",
    generator: GeneratorArg, window: int,
) -> DecodeStart:
    """Validate, prefill the condition (token 0's logits), start the clock and derive per-sample seeds."""
    vocab = model.image_vocab_size
    check_common(num_tokens, grid_width, vocab)
    sampling.check_vocab(vocab)
    state, logits = model.prefill(condition, guidance=sampling.uses_guidance, max_new_tokens=num_tokens, window=window)
    clock = Clock(logits.cond.device)
    seeds = per_sample_seeds(generator, int(logits.cond.shape[0]), logits.cond.device)
    return DecodeStart(state, logits, seeds, clock, vocab)


class SampleResults:
    """Per-sample outputs of a ragged-batch decoder in the caller's batch order, filled as samples finish.

    Decoders keep only their active samples (``ids`` are their positions in the caller's batch);
    :meth:`finish` stores the finished ones, :meth:`report_progress` builds the step callback's view.
    """

    def __init__(self, batch: int, num_tokens: int, device: torch.device):
        self.num_tokens = num_tokens
        self.tokens = torch.zeros(batch, num_tokens, dtype=torch.long, device=device)
        self.nfe = torch.ones(batch, dtype=torch.long)
        self.accepted = torch.zeros(batch, dtype=torch.long)
        self.latency = torch.zeros(batch, dtype=torch.float64)
        self.extra: dict[str, Tensor] = {}
        self.committed = torch.ones(batch, dtype=torch.long, device=device)

    def finish(self, done: Tensor, ids: Tensor, buf: Tensor, nfe: Tensor, accepted: Tensor, now: float, **extra: Tensor) -> None:
        """Store active samples ``done`` (indices into the active set): tokens, NFE, accepted drafts, latency."""
        at = ids[done]
        self.tokens[at] = buf[done, : self.num_tokens]
        cpu = at.cpu()
        self.nfe[cpu] = nfe[done].cpu()
        self.accepted[cpu] = accepted[done].cpu()
        self.latency[cpu] = now
        for name, values in extra.items():
            self.extra.setdefault(name, torch.zeros_like(self.nfe))[cpu] = values[done].cpu()

    def report_progress(self, callback: "StepCallback", step: int, ids: Tensor, n: Tensor, buf: Tensor) -> None:
        """Call ``callback`` with every sample's committed count and tokens (-1 where not committed)."""
        self.committed[ids] = n
        progress = self.tokens.clone()  # finished samples are already final there
        live = torch.arange(self.num_tokens, device=buf.device)[None, :] < n[:, None]
        progress[ids] = torch.where(live, buf[:, : self.num_tokens], torch.full_like(live, -1, dtype=torch.long))
        callback(step, self.committed.clone(), progress)

    def stats(self) -> DecodeStats:
        return DecodeStats(nfe=self.nfe, tokens=torch.full_like(self.nfe, self.num_tokens), accepted_drafts=self.accepted,
                           latency_s=self.latency)

    def output(self, method: str, rule, tv) -> DecodeOutput:
        """The decoder's result: a lossy ``rule``'s name is appended to ``method`` and ``tv``'s
        per-sample TV (a :class:`vispec.decoding.acceptance.TVTracker`, or ``None``) lands in the stats."""
        stats = self.stats()
        if tv is not None:
            stats.tv_mean, stats.tv_max = tv.result()
        name = method if rule.lossless else f"{method}+{rule.config.name}"
        return DecodeOutput(tokens=self.tokens, stats=stats, method=name, extra=dict(self.extra))


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
