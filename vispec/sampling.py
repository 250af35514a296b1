"""The target distribution every decoder samples from and verifies against.

Plain AR decoding of a LlamaGen-style model draws each token from the *processed* distribution
(LlamaGen ``autoregressive/models/generate.py``; SJD, arXiv 2410.01699, §3):

1. classifier-free guidance on raw logits, conditional half first::

       l = l_u + s * (l_c - l_u)          (only while the position is inside ``cfg_interval``)

2. per-position logits processors (forced tokens, an allowed token range; see
   :mod:`vispec.processors`);
3. temperature ``l / T``, then top-k (ties at the k-th value are kept, as LlamaGen does), then
   top-p on the softmax of what is left (the smallest prefix of the sorted distribution whose mass
   reaches ``top_p``; the token that crosses the threshold is kept);
4. ``p = softmax(l)``; temperature 0 means greedy: ``p`` is one-hot on the first arg-max.

"Lossless" in vispec always means lossless with respect to exactly this ``p``.
:func:`process_logits` is the one definition; AR, SJD, MC-SJD and the exactness tests all call it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Callable, Optional

import torch
from torch import Tensor

from vispec.checks import check_int, check_number

PositionProcessor = Callable[[Tensor, Tensor], Tensor]
"""``f(logits [B, W, V], positions [B, W]) -> logits``: a per-position logits processor."""


@dataclass(frozen=True)
class SamplingConfig:
    """How raw model logits become the target distribution (see the module docstring).

    Args:
        temperature: ``T >= 0``; 0 means greedy decoding.
        top_k: keep the ``k`` largest logits; 0 disables. Must not exceed the vocabulary.
        top_p: nucleus mass in ``(0, 1]``; 1 disables.
        guidance_scale: CFG scale ``s``; 1 means no guidance (no unconditional branch is run).
        cfg_interval: LlamaGen's ``cfg_interval``: -1 guides every token; otherwise token ``t``
            (0-based) is guided while ``t <= cfg_interval + 1`` (LlamaGen's step ``i = t - 1``
            stops guidance once ``i > cfg_interval``; token 0 is always guided). The unconditional
            half is still computed afterwards, as in LlamaGen.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    guidance_scale: float = 1.0
    cfg_interval: int = -1

    def __post_init__(self) -> None:
        check_number("temperature", self.temperature, minimum=0, hint=" (0 means greedy)")
        check_int("top_k", self.top_k, minimum=0, hint=" (0 disables top-k)")
        check_number("top_p", self.top_p, minimum=0, maximum=1, exclusive_minimum=True, hint=" (1 disables top-p)")
        check_number("guidance_scale", self.guidance_scale, hint=" (1 means no guidance)")
        check_int("cfg_interval", self.cfg_interval, minimum=-1, hint=" (-1 guides every token)")

    @property
    def uses_guidance(self) -> bool:
        """True when an unconditional branch must be run (``guidance_scale != 1``)."""
        return self.guidance_scale != 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def check_vocab(self, vocab_size: int) -> None:
        """Raise if ``top_k`` cannot apply to a vocabulary of ``vocab_size`` tokens."""
        if self.top_k > vocab_size:
            raise ValueError(f"top_k={self.top_k} is larger than the vocabulary ({vocab_size} tokens); use 0 to disable top-k")

    def to_dict(self) -> dict:
        return asdict(self)


def guided_logits(
    cond: Tensor, uncond: Optional[Tensor], positions: Tensor, config: SamplingConfig
) -> Tensor:
    """CFG on raw logits: ``uncond + s * (cond - uncond)`` where guidance is active.

    ``cond``/``uncond``: ``[B, W, V]``; ``positions``: ``[B, W]`` image-token indices (for
    ``cfg_interval``). Raises if guidance is requested without an unconditional branch.
    """
    if not config.uses_guidance:
        return cond
    if uncond is None:
        raise ValueError(
            f"guidance_scale={config.guidance_scale} needs an unconditional branch, but the model returned none "
            "(use guidance_scale=1.0 or a model with a null condition)"
        )
    if uncond.shape != cond.shape:
        raise ValueError(f"unconditional logits have shape {tuple(uncond.shape)}, expected {tuple(cond.shape)}")
    guided = uncond + config.guidance_scale * (cond - uncond)
    if config.cfg_interval < 0:
        return guided
    active = (positions <= config.cfg_interval + 1).unsqueeze(-1)
    return torch.where(active, guided, cond)


def warp_logits(logits: Tensor, config: SamplingConfig) -> Tensor:
    """Temperature, top-k, top-p on the last dimension (any leading shape). Returns logits with
    ``-inf`` outside the kept set. Not used for temperature 0 (see :func:`process_logits`)."""
    logits = logits / config.temperature
    vocab = logits.shape[-1]
    if config.top_k > 0 and config.top_k < vocab:
        kth = torch.topk(logits, config.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if config.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        # drop a token when the mass *before* it already reaches top_p (keeps the crossing token)
        drop_sorted = (cumulative - sorted_logits.softmax(dim=-1)) >= config.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def process_logits(
    cond: Tensor,
    uncond: Optional[Tensor],
    positions: Tensor,
    config: SamplingConfig,
    processors: tuple[PositionProcessor, ...] = (),
) -> Tensor:
    """The processed target distribution ``p`` (module docstring), shape ``[B, W, V]``.

    Computed in float32 (float64 inputs stay float64). Raises ``ValueError`` on NaN logits.
    """
    probs, status = process_logits_status(cond, uncond, positions, config, processors)
    raise_status(status)
    return probs


STATUS_OK, STATUS_NAN, STATUS_ALL_MASKED = 0, 1, 2


def raise_status(status: "Tensor | int") -> None:
    """Raise the error a :func:`process_logits_status` status stands for (a tensor is read back from the device)."""
    worst = status if isinstance(status, int) else (int(status.max()) if status.numel() else STATUS_OK)
    if worst == STATUS_NAN:
        raise ValueError("logits contain NaN; the model produced invalid outputs")
    if worst == STATUS_ALL_MASKED:
        raise ValueError("every token was masked out at some position (all logits -inf after processing)")


def process_logits_status(
    cond: Tensor,
    uncond: Optional[Tensor],
    positions: Tensor,
    config: SamplingConfig,
    processors: tuple[PositionProcessor, ...] = (),
) -> tuple[Tensor, Tensor]:
    """:func:`process_logits` without reading anything back: ``(p, status)`` with ``status`` an int64
    scalar on the device (:data:`STATUS_OK`, :data:`STATUS_NAN` for NaN logits, :data:`STATUS_ALL_MASKED`
    when processing left no token), checked later with :func:`raise_status` at a synchronisation point."""
    if cond.dim() != 3:
        raise ValueError(f"logits must have shape [batch, window, vocab], got {tuple(cond.shape)}")
    if positions.shape != cond.shape[:2]:
        raise ValueError(f"positions must have shape {tuple(cond.shape[:2])}, got {tuple(positions.shape)}")
    config.check_vocab(cond.shape[-1])
    dtype = torch.float64 if cond.dtype == torch.float64 else torch.float32
    cond = cond.to(dtype)
    uncond = None if uncond is None else uncond.to(dtype)
    nan = torch.isnan(cond).any()
    if uncond is not None and config.uses_guidance:
        nan = nan | torch.isnan(uncond).any()
    logits = guided_logits(cond, uncond, positions, config)
    for processor in processors:
        logits = processor(logits, positions)
    if config.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).to(dtype), nan.long() * STATUS_NAN
    probs = warp_logits(logits, config).softmax(dim=-1)
    empty = torch.isnan(probs).any()
    return probs, torch.where(nan, STATUS_NAN, torch.where(empty, STATUS_ALL_MASKED, STATUS_OK))
