"""Infilling: mask tokens placed inside the prompt are decoded with the generated canvas.

Dream's ``_sample`` (spec ``dllm.md`` §2; Dream's ``generation_utils.py``) decodes the whole sequence
``x = [prompt ; mask^L]``: its masked set is ``x == mask`` over every position, so a mask token the user puts in
the prompt is a candidate at every step and counts in the step's masked count ``M``. LLaDA's ``generate()`` (§1.3)
also ranks every masked position of ``x`` (``mask_index = x == mask``, confidence ``-inf`` only right of the
current block), so prompt masks are candidates from the first block on.

In :func:`vispec.dllm.decode` the prompt's mask tokens (real tokens, ``attention_mask == 1``, equal to the mask id)
are **part of the first block**: the first block's window is ``[the row's prompt masks ; block 0]``, in position
order, and every policy decides them there with the block's own rule:

* Dream (:class:`vispec.dllm.DreamScheduler`): with one block over the canvas this is Dream's ``_sample``
  exactly (``M`` counts the prompt masks too; with several blocks, the first block's ``M`` does).
* LLaDA's quota (:class:`vispec.dllm.LLaDAScheduler`): the first block's ``M`` is its masked positions plus the
  prompt's, so the quota ``n_i = ⌊M / s⌋ + 1[i < M mod s]`` fills both by the block's last step. **Difference from
  LLaDA's generate:** its quota counts the block's masks only, so every block commits as many positions as the block
  has masks while the prompt's masks compete for them; it ends with as many positions still masked as the prompt had
  masks (the least confident ones). vispec counts them so that everything is decoded; without prompt masks the two
  are the same.
* Adaptive policies (threshold, factor, entropy bound, contiguous) commit in that window until it has no mask left.

Guidance keeps LLaDA's ``prompt_index`` (the prompt's non-mask positions, fixed at the start): the unconditional
branch masks those, and shows the infilled positions as the conditional branch does (masked until decided).

Noise keys (Philox, :class:`vispec.dllm.UnmaskNoise`): prompt position ``p`` of a prompt of width ``P`` is keyed
``L + (P - 1 - p)`` (past every generated position; left padding does not change it), so a row's draws do not
depend on the batch.

Not supported with prompt masks (refused before any work, :func:`check_infill`): the prefix / dual / dKV caches
(they keep the prompt's K/V fixed), end-of-text prediction, Prophet's early commit, AdaBlock, Learn2PD (its filter
reads exactly ``block_length`` positions) and self-speculation; nor, for models whose logits are shifted (Dream: the
logits at ``p`` come from ``p - 1``), a mask as a row's first real token, which has no position before it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor


def prompt_masks(input_ids: Tensor, attention_mask: Optional[Tensor], mask_id: int) -> Tensor:
    """``[B, P]`` bool: the prompt's real tokens (``attention_mask == 1``) that are the mask token."""
    masks = input_ids == mask_id
    return masks if attention_mask is None else masks & attention_mask.to(masks.device).bool()


def check_infill(model: Any, input_ids: Tensor, attention_mask: Optional[Tensor], options: Any, scheduler: Any,
                 mask_id: int) -> None:
    """Refuse prompt masks under the rules that cannot decode them (module docstring), naming the option."""
    masks = prompt_masks(input_ids, attention_mask, mask_id)
    if not bool(masks.any()):
        return
    rows = masks.any(dim=1).nonzero().squeeze(1).tolist()
    what = f"input_ids rows {rows} contain the mask token {mask_id} (infilling)"
    refused = [(options.cache != "none", f"cache={options.cache!r}: the prefix / dual / dkv caches keep the prompt's "
                                         "K/V fixed; pass cache='none'"),
               (options.eotp, "eotp=True"), (options.early_commit is not None, "early_commit (Prophet)"),
               (options.adaptive_block is not None, "adaptive_block (AdaBlock)"),
               (getattr(options, "speculative", None) is not None, "speculative (self-speculation)"),
               (getattr(scheduler, "strategy", "") == "learn2pd",
                "the learn2pd policy (its filter reads exactly block_length positions)")]
    for bad, name in refused:
        if bad:
            raise ValueError(f"{what}, which is not supported with {name}")
    if getattr(getattr(model, "config", None), "logits_shift", False):
        real = torch.ones_like(masks) if attention_mask is None else attention_mask.to(masks.device).bool()
        first = real.long().cumsum(dim=1) == 1  # each row's first real token
        starts = (first & real & masks).any(dim=1).nonzero().squeeze(1).tolist()
        if starts:
            raise ValueError(f"input_ids rows {starts} start with the mask token {mask_id}: this model's logits are "
                             "shifted (Dream-style: position p is predicted at p - 1), so a mask at a row's first "
                             "real token has no prediction; put a real token (e.g. BOS) before it")


@dataclass
class PromptInfill:
    """The prompt's mask tokens of one decode, as slots ``[B, Q]`` (``Q`` the most masks in a row), in position order.

    Args:
        index: ``[B, Q]`` prompt positions (0 where the slot is unused).
        valid: ``[B, Q]`` bool, the slot holds a prompt mask.
        keys: ``[B, Q]`` noise position keys ``L + (P - 1 - p)`` (module docstring).
        slots: ``[B, P]`` bool, the prompt positions that were masks at the start (LLaDA's ``~prompt_index``).
        first: the lowest such position in the batch (the forwards of the first block return logits from there).
    """

    index: Tensor
    valid: Tensor
    keys: Tensor
    slots: Tensor
    first: int

    @classmethod
    def build(cls, input_ids: Tensor, attention_mask: Optional[Tensor], mask_id: int,
              gen_length: int) -> Optional["PromptInfill"]:
        """The slots of the prompt's masks, or None when no prompt has one (one read-back, before the loop)."""
        slots = prompt_masks(input_ids, attention_mask, mask_id)
        counts = slots.sum(dim=1)
        width = int(counts.max())
        if width == 0:
            return None
        P = input_ids.shape[1]
        positions = torch.arange(P, device=input_ids.device).expand_as(slots)
        order = torch.where(slots, positions, positions + P).argsort(dim=1)[:, :width]  # the masks first, in order
        index = positions.gather(1, order)
        valid = torch.arange(width, device=slots.device) < counts[:, None]
        index = torch.where(valid, index, torch.zeros_like(index))
        first = int(slots.any(dim=0).nonzero()[0])
        return cls(index, valid, gen_length + (P - 1 - index), slots, first)

    @property
    def width(self) -> int:
        return self.index.shape[1]

    def tokens(self, x: Tensor, rows: Tensor) -> Tensor:
        """``[R, Q]`` the slots' current tokens (``-1``, never committed, where unused)."""
        picked = x[rows].gather(1, self.index[rows])
        return torch.where(self.valid[rows], picked, torch.full_like(picked, -1))

    def masked(self, x: Tensor, mask_id: int) -> Tensor:
        """``[B]`` bool: rows with a prompt mask still undecided."""
        return ((x.gather(1, self.index) == mask_id) & self.valid).any(dim=1)

    def logits(self, logits: Tensor, lo: int, rows: Tensor) -> Tensor:
        """``[R, Q, V]`` the slots' logits from ``logits [R, T, V]`` of the positions ``[lo, lo + T)`` (zero where
        unused)."""
        valid = self.valid[rows]
        local = torch.where(valid, self.index[rows] - lo, torch.zeros_like(self.index[rows]))
        picked = logits[torch.arange(logits.shape[0], device=logits.device)[:, None], local]
        return picked.masked_fill(~valid[..., None], 0.0)

    def write(self, x: Tensor, rows: Tensor, tokens: Tensor) -> None:
        """Write ``tokens [R, Q]`` into the rows' used slots."""
        width = x.shape[1]
        target = torch.where(self.valid[rows], self.index[rows], torch.full_like(tokens, width))  # unused: a dump column
        padded = torch.cat([x[rows], x[rows][:, :1]], dim=1)
        x[rows] = padded.scatter(1, target, tokens.to(x.dtype))[:, :width]
