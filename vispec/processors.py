"""Per-position logits processors for multi-token windows.

transformers' ``LogitsProcessor`` sees one position per row (``[B, V]``); a Jacobi window needs every
window position processed with knowledge of its absolute index. A processor here is a callable
``f(logits [B, W, V], positions [B, W]) -> logits``, applied after CFG and before
temperature/top-k/top-p (visual-ar spec §2), for the target and therefore for every stored draft
distribution. ``positions`` are 0-based image-token indices (the token each row predicts).

Unified-token models need them: Lumina-mGPT and Emu3 force an end-of-line token after every image
row and only allow image tokens elsewhere (SJD's ``logit_processor_3dim.py`` does the same).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class AllowedTokenRange:
    """Only tokens in ``[low, high)`` may be generated (e.g. the image-token id range)."""

    low: int
    high: int

    def __post_init__(self) -> None:
        if not 0 <= self.low < self.high:
            raise ValueError(f"AllowedTokenRange needs 0 <= low < high, got low={self.low}, high={self.high}")

    def __call__(self, logits: Tensor, positions: Tensor) -> Tensor:
        if self.high > logits.shape[-1]:
            raise ValueError(f"AllowedTokenRange high={self.high} exceeds the vocabulary ({logits.shape[-1]})")
        ids = torch.arange(logits.shape[-1], device=logits.device)
        return logits.masked_fill((ids < self.low) | (ids >= self.high), float("-inf"))


@dataclass(frozen=True)
class PeriodicForcedToken:
    """Force ``token_id`` at every position ``p`` with ``p % period == period - 1``.

    With ``period = width + 1`` this is the end-of-line token after each image row (Lumina-mGPT,
    Emu3); elsewhere ``token_id`` is masked out.
    """

    token_id: int
    period: int

    def __post_init__(self) -> None:
        if self.period < 1 or self.token_id < 0:
            raise ValueError(f"PeriodicForcedToken needs token_id >= 0 and period >= 1, got {self.token_id}, {self.period}")

    def __call__(self, logits: Tensor, positions: Tensor) -> Tensor:
        if self.token_id >= logits.shape[-1]:
            raise ValueError(f"PeriodicForcedToken token_id={self.token_id} exceeds the vocabulary ({logits.shape[-1]})")
        forced = (positions % self.period == self.period - 1)[..., None]
        is_token = torch.arange(logits.shape[-1], device=logits.device) == self.token_id
        forced_logits = torch.where(is_token, 0.0, float("-inf")).to(logits.dtype)
        masked = logits.masked_fill(is_token, float("-inf"))
        return torch.where(forced, forced_logits.expand_as(logits), masked)
