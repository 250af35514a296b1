"""Per-row blocks of the semi-autoregressive loop: AdaBlock's adaptive block length and block windows.

**AdaBlock** (Lu et al., "AdaBlock-dLLM: Semantic-Aware Diffusion LLM Inference via Adaptive Block Size",
arXiv 2509.26432; spec ``dllm.md`` §9). A row's next block starts where its last one ended, at generated
position ``g``. The forward that starts the block is a full one (without a cache every forward is; with a
cache it is the cache-refreshing forward, which is also the block's first decoding step). From its
candidates ``x̂_j`` and confidences ``c_j = softmax(ℓ_j)[x̂_j]`` in the look-ahead window

    W = [g, g + min(⌊f·L⌋, c - g))          (f = window_fraction = 0.25, L = gen_length, c = canvas length)

with ``D = {j ∈ W masked : x̂_j ∈ delimiter_ids}``, the block is ``[g, j* + 1)`` with ``j* = argmax_{j∈D} c_j``
(ties: the lowest position) if ``c_{j*} ≥ δ`` (``threshold``, 0.3), else ``[g, g + min(B, c - g))`` with
``B`` the initial (``block_length``) size. ``c = L`` unless end-of-text prediction cut the canvas shorter
(:mod:`vispec.dllm.early_commit`). The delimiter (a newline in the paper, id 198 in LLaDA's tokenizer) is
tokenizer-specific: there is no default.

A block window is a row's block as a ``[G, width]`` slab (``width`` the largest block among the rows); the
positions past a row's own block are *invalid*: they read as a non-mask filler for the policy, so it
commits nothing there, and are never written back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from vispec.checks import check_int, check_number


@dataclass(frozen=True)
class AdaptiveBlocks:
    """AdaBlock's adaptive block length (module docstring) for :func:`vispec.dllm.decode` (``adaptive_block=``).

    Args:
        delimiter_ids: token ids that end a semantic step (e.g. the tokenizer's newline id); required.
        threshold: ``δ`` in ``[0, 1]``, the confidence a delimiter candidate needs (0.3, the paper's LLaDA
            setting; 0.5 for Dream).
        window_fraction: ``f`` in ``(0, 1]``, the look-ahead window as a fraction of ``gen_length`` (0.25).
    """

    delimiter_ids: tuple
    threshold: float = 0.3
    window_fraction: float = 0.25

    def __post_init__(self):
        ids = self.delimiter_ids
        if isinstance(ids, int) and not isinstance(ids, bool):
            ids = (ids,)
        if not isinstance(ids, (tuple, list)) or not ids:
            raise ValueError(f"delimiter_ids must be a non-empty tuple of token ids (e.g. the tokenizer's newline id), "
                             f"got {self.delimiter_ids!r}")
        for token in ids:
            check_int("delimiter_ids", token, minimum=0)
        object.__setattr__(self, "delimiter_ids", tuple(ids))
        check_number("threshold", self.threshold, minimum=0, maximum=1)
        check_number("window_fraction", self.window_fraction, minimum=0, maximum=1, exclusive_minimum=True)

    def check_ids(self, vocab: Optional[int], mask_id: int) -> None:
        """The delimiters must be real tokens of the vocabulary, not the mask token."""
        for token in self.delimiter_ids:
            if (vocab is not None and token >= vocab) or token == mask_id:
                raise ValueError(f"adaptive_block.delimiter_ids must be token ids in [0, {vocab}) other than the mask "
                                 f"id {mask_id}, got {token}")

    def block_ends(self, starts: Tensor, cut: Tensor, gen_length: int, block_length: int, candidates: Tensor,
                   confidence: Tensor) -> Tensor:
        """``[G]`` exclusive block ends (generated positions) for blocks starting at ``starts [G]``.

        Args:
            cut: ``[G]`` canvas lengths (``gen_length`` unless end-of-text prediction cut them).
            candidates, confidence: ``[G, L]`` the block-starting forward's candidates and their confidences
                at the masked positions (``-1`` / ``-inf`` elsewhere).
        """
        pos = torch.arange(candidates.shape[1], device=candidates.device)
        remaining = cut - starts
        window = torch.clamp(remaining, max=int(self.window_fraction * gen_length))
        in_window = (pos >= starts[:, None]) & (pos < (starts + window)[:, None])
        ids = torch.tensor(self.delimiter_ids, dtype=candidates.dtype, device=candidates.device)
        delimiter = in_window & torch.isin(candidates, ids)
        scores = confidence.masked_fill(~delimiter, float("-inf"))
        best = scores.argmax(dim=1)  # ties: the first (lowest) position
        best_conf = scores.gather(1, best[:, None]).squeeze(1)
        default = starts + torch.clamp(remaining, max=block_length)
        return torch.where(best_conf >= self.threshold, best + 1, default)


def window_index(starts: Tensor, ends: Tensor, width: int) -> tuple[Tensor, Tensor]:
    """``index [G, width]`` (generated positions ``starts + k``) and ``valid [G, width]`` (``index < ends``)."""
    index = starts[:, None] + torch.arange(width, device=starts.device)
    return index, index < ends[:, None]


def window_logits(logits: Tensor, first: int, index: Tensor, valid: Tensor) -> Tensor:
    """``[G, width, V]`` logits of the window positions ``index`` from ``logits [G, T, V]``, which cover the
    generated positions ``[first, first + T)``; invalid or uncomputed positions get zero logits."""
    local = index - first
    inside = valid & (local >= 0) & (local < logits.shape[1])
    local = torch.where(inside, local, torch.zeros_like(local))
    picked = logits[torch.arange(logits.shape[0], device=logits.device)[:, None], local]  # no [G, width, V] index
    return picked.masked_fill(~inside[..., None], 0.0)


def window_tokens(canvas: Tensor, index: Tensor, valid: Tensor, filler: int) -> Tensor:
    """``[G, width]`` canvas tokens at ``index``, ``filler`` (a non-mask id) where invalid."""
    safe = torch.where(valid, index, torch.zeros_like(index))
    return torch.where(valid, canvas.gather(1, safe), torch.full_like(index, filler))


def to_canvas(values: Tensor, index: Tensor, valid: Tensor, length: int, fill) -> Tensor:
    """``[G, length]``: the window ``values [G, width]`` placed at their positions, ``fill`` elsewhere."""
    out = torch.full((values.shape[0], length + 1), fill, dtype=values.dtype, device=values.device)
    out.scatter_(1, torch.where(valid, index, torch.full_like(index, length)), values)  # invalid: the dump column
    return out[:, :length]
