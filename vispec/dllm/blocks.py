"""The blocks of the semi-autoregressive loop: fixed blocks (LLaDA), AdaBlock's adaptive ones, and block windows.

The block loop (:mod:`vispec.dllm.loop`) asks a block-boundary provider where each row's block lies:
:class:`FixedBlocks` (LLaDA: round ``r`` decodes ``[r Lb, (r + 1) Lb)`` in every row) or :class:`AdaptiveBounds`
(AdaBlock, below: each row's block starts where its last one ended and its end comes from the forward that starts
it). Rows decode their ``r``-th blocks in round ``r`` and wait for each other between rounds, so cache refreshes
stay shared; under ``"prefix"`` / ``"dual"`` the rows of each distinct adaptive block get their own copy of the
cache and their own span forward (one forward per group; each still counts one NFE per row it serves).

**AdaBlock** (Lu et al., "AdaBlock-dLLM: Semantic-Aware Diffusion LLM Inference via Adaptive Block Size",
arXiv 2509.26432; spec ``dllm.md`` §9). A row's next block starts where its last one ended, at generated
position ``g``. The forward that starts the block is a full one (without a cache every forward is; with a
cache it is the cache-refreshing forward, which is also the block's first decoding step). From its
candidates ``x̂_j`` and confidences ``c_j = softmax(ℓ_j)[x̂_j]`` in the look-ahead window

    W = [g, g + min(⌊f·L⌋, c - g))          (f = window_fraction = 0.25, L = gen_length, c = canvas length)

with ``D = {j ∈ W masked : x̂_j ∈ delimiter_ids}``, the block is ``[g, j* + 1)`` with ``j* = argmax_{j∈D} c_j``
(ties: the lowest position) if ``c_{j*} ≥ δ`` (``threshold``, 0.3), else ``[g, g + min(B, c - g))`` with
``B`` the initial (``block_length``) size. ``c = L`` unless end-of-text prediction cut the canvas shorter
(:mod:`vispec.dllm.eotp`). The delimiter (a newline in the paper, id 198 in LLaDA's tokenizer) is
tokenizer-specific: there is no default.

A block window is a row's block as a ``[G, width]`` slab (``width`` the largest block among the rows); the
positions past a row's own block are *invalid*: they read as a non-mask filler for the policy, so it
commits nothing there, and are never written back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor

from vispec.checks import check_int, check_number
from vispec.dllm.caches import NoCache
from vispec.dllm.view import StepView


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


class FixedBlocks:
    """LLaDA's blocks (module docstring): round ``r`` decodes ``[r Lb, (r + 1) Lb)`` in every row.

    ``starts`` / ``ends`` ``[B]`` hold each row's block (generated positions) and ``masked_at_start [B]`` its masked
    positions when the block started (the quota policies' ``M``).
    """

    adaptive = False

    def __init__(self, batch: int, gen_length: int, block_length: int, mask_id: int, device: torch.device):
        self.gen_length, self.block_length, self.mask_id = gen_length, block_length, mask_id
        self.positions = torch.arange(gen_length, device=device)
        self.starts = torch.zeros(batch, dtype=torch.long, device=device)
        self.ends = torch.zeros(batch, dtype=torch.long, device=device)
        self.masked_at_start = torch.zeros(batch, dtype=torch.long, device=device)
        self.block = (0, block_length)  # the round's block, shared by every row

    def start_round(self, index: int, canvas: Tensor) -> bool:
        """Set round ``index``'s blocks from the canvas ``[B, L]``; False when there is no such round."""
        if index == self.gen_length // self.block_length:
            return False
        start = index * self.block_length
        self.block = (start, start + self.block_length)
        self.starts.fill_(start)
        self.ends.fill_(start + self.block_length)
        self.masked_at_start = (canvas[:, start: start + self.block_length] == self.mask_id).sum(dim=1)
        return True

    def steps(self, scheduler: Any) -> int:
        """Steps of a round: the policy's per-block budget, else as many as the block has positions (an adaptive
        policy commits at least one per step)."""
        return scheduler.steps_per_block if scheduler.fixed_steps else self.block_length

    def pending(self, masked: Tensor, step: int) -> Tensor:
        """``[B, L]`` the masked positions ``masked`` that this round's step decodes: those in the row's block."""
        return masked & (self.positions >= self.starts[:, None]) & (self.positions < self.ends[:, None])

    def span(self, rows_h: Optional[Tensor]) -> tuple[int, int]:
        """The block ``[start, end)`` (generated positions) a forward of ``rows`` computes."""
        return self.block

    def window(self, rows: Tensor, rows_h: Optional[Tensor]) -> tuple[Tensor, Tensor]:
        """The rows' blocks as windows: ``index [R, W]`` generated positions and ``valid [R, W]`` (:func:`window_index`)."""
        return window_index(self.starts[rows], self.ends[rows], self.block_length)

    def window_logits(self, logits: Tensor, first: int, index: Tensor, valid: Tensor) -> Tensor:
        """``[R, W, V]`` the window's logits from ``logits`` of the generated positions ``[first, first + T)``."""
        local = self.block[0] - first
        if local >= 0 and local + self.block_length <= logits.shape[1]:
            return logits[:, local: local + self.block_length]  # every row shares the block: a view, no copy
        return window_logits(logits, first, index, valid)

    def choose(self, view: StepView, cache: NoCache) -> None:
        """After a round's first forward: nothing to choose (the blocks are fixed)."""

    def groups(self, rows: Tensor, step: int, cache: NoCache) -> list[tuple[Tensor, NoCache]]:
        """The forwards of a step: one for all ``rows``."""
        return [(rows, cache)]

    def details(self, rows: Tensor) -> dict:
        return {}

    def report(self, extra: dict, labels: dict) -> None:
        """Fixed blocks add no statistics."""


class AdaptiveBounds(FixedBlocks):
    """AdaBlock's blocks (module docstring, :class:`AdaptiveBlocks`): each row's next block starts where its last one
    ended; its end comes from the round's first, full forward (:meth:`choose`)."""

    adaptive = True

    def __init__(self, rule: AdaptiveBlocks, batch: int, gen_length: int, block_length: int, mask_id: int,
                 device: torch.device):
        super().__init__(batch, gen_length, block_length, mask_id, device)
        self.rule = rule
        self.starts_h, self.ends_h = torch.zeros(batch, dtype=torch.long), torch.zeros(batch, dtype=torch.long)
        self.blocks = torch.zeros(batch, dtype=torch.long, device=device)  # blocks decoded per row
        self.splits: Optional[dict] = None  # (start, end) -> the cache of the rows decoding that block

    def start_round(self, index: int, canvas: Tensor) -> bool:
        self.starts, self.starts_h = self.ends.clone(), self.ends_h.clone()
        self.splits = None
        return True

    def steps(self, scheduler: Any) -> int:
        return scheduler.steps_per_block if scheduler.fixed_steps else self.gen_length

    def pending(self, masked: Tensor, step: int) -> Tensor:
        return masked if step == 0 else super().pending(masked, step)  # every row with masks starts a block

    def span(self, rows_h: Optional[Tensor]) -> tuple[int, int]:
        # a span forward serves rows of one block (split caches); a full forward needs only `whole`
        return int(self.starts_h[rows_h[0]]), int(self.ends_h[rows_h[0]])

    def window(self, rows: Tensor, rows_h: Optional[Tensor]) -> tuple[Tensor, Tensor]:
        width = int((self.ends_h[rows_h] - self.starts_h[rows_h]).max())
        return window_index(self.starts[rows], self.ends[rows], width)

    def window_logits(self, logits: Tensor, first: int, index: Tensor, valid: Tensor) -> Tensor:
        return window_logits(logits, first, index, valid)

    def choose(self, view: StepView, cache: NoCache) -> None:
        """AdaBlock (:meth:`AdaptiveBlocks.block_ends`) from the round's first, full forward: the rows' block ends,
        their masked counts (the quota policies' ``M``), and under the prefix / dual cache one cache per block."""
        rows = view.rows
        self.blocks[rows] += 1
        ends = self.rule.block_ends(self.starts[rows], view.cut, self.gen_length, self.block_length, view.candidates,
                                    view.confidence)
        self.ends[rows] = ends
        self.ends_h[view.rows_h] = ends.cpu()
        in_block = (self.positions >= self.starts[rows][:, None]) & (self.positions < ends[:, None])
        self.masked_at_start[rows] = (view.masked & in_block).sum(dim=1)
        if cache.splits_by_block:
            self.split(rows, cache)

    def split(self, rows: Tensor, cache: NoCache) -> None:
        """After the round's refreshing forward: rows with different blocks get separate prefix / dual caches."""
        rows_h = rows.cpu()
        keys = torch.stack([self.starts_h[rows_h], self.ends_h[rows_h]], dim=1).unique(dim=0).tolist()
        if len(keys) == 1:
            return
        self.splits = {}
        for start, end in keys:  # one cache per distinct block (not per row)
            pick = (self.starts_h[rows_h] == start) & (self.ends_h[rows_h] == end)
            self.splits[(start, end)] = cache.split(rows[pick.to(rows.device)])
        cache.release()  # the next round refreshes anyway

    def groups(self, rows: Tensor, step: int, cache: NoCache) -> list[tuple[Tensor, NoCache]]:
        """One forward for all ``rows``, or one per block when adaptive blocks split the cache."""
        if self.splits is None or step == 0:
            return [(rows, cache)]
        rows_h = rows.cpu()
        groups = []
        for (start, end), part in self.splits.items():
            pick = (self.starts_h[rows_h] == start) & (self.ends_h[rows_h] == end)
            if bool(pick.any()):
                groups.append((rows[pick.to(rows.device)], part))
        return groups

    def details(self, rows: Tensor) -> dict:
        return {"block_start": self.starts[rows].clone(), "block_end": self.ends[rows].clone()}

    def report(self, extra: dict, labels: dict) -> None:
        extra["blocks"] = self.blocks.cpu()
        labels["adaptive_block"] = True
