"""End-of-text prediction (EoTP): a row's canvas is cut after an EOS and the tail is never computed again.

Learn2PD (Bao et al., "Learning to Parallel", arXiv 2509.25188; spec ``dllm.md`` §5.4). A row's canvas has a length
``c`` (initially ``L``); positions ``j >= c`` are dropped: they read as EOS in the output and are never computed
again. After each step (:meth:`EndOfText.after_step`, an :class:`vispec.dllm.view.AfterStep` rule):

* if the step committed an EOS at a position the policy *accepted* (Learn2PD's filter; every committed position for
  policies without one), ``c ← p + 1`` for the first such ``p``;
* otherwise, if still-masked positions predict EOS (their candidate is EOS), ``c ← q + 1`` for the one whose EOS
  confidence ``softmax(ℓ_q)[EOS]`` is highest (ties: the lowest position).

How the block loop runs it: each forward is only as wide as the longest surviving canvas among its rows
(:meth:`EndOfText.width`), every row's own dropped positions are hidden from the keys (:meth:`EndOfText.key_mask`;
for a bidirectional model exactly a physical truncation: the positions before the cut keep their RoPE ids), cached
K/V keep the same mask, and the blocks past a row's cut cost it nothing. The EOS predictions are read where the
forward computed logits: the whole surviving canvas without a cache, at refreshes and under ``"prefix"`` /
``"dkv"`` (whose steps compute every masked position), only the block on ``"dual"`` block steps. To the policy a
dropped position of the row's block reads as an EOS decided with probability 1 (:func:`decided_eos`), whether or not
the forward computed it, so a row decodes the same alone or in a batch.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
from torch import Tensor

from vispec.dllm.view import StepView


def end_of_text_cut(cut: Tensor, accepted: Tensor, tokens: Tensor, masked: Tensor, candidates: Tensor,
                    confidence: Tensor, eos_id: int) -> Tensor:
    """EoTP's new canvas length per row (module docstring), never longer than ``cut``.

    Args:
        cut: ``[G]`` current canvas lengths.
        accepted: ``[G, L]`` bool, the positions this step committed that count for EoTP (Learn2PD: those
            its filter accepted; other policies: every committed position).
        tokens: ``[G, L]`` the canvas after the step.
        masked: ``[G, L]`` bool, positions still masked after the step.
        candidates, confidence: ``[G, L]`` this forward's candidate and its confidence ``softmax(ℓ)[x̂]`` at the
            masked positions it computed (``-1`` / ``-inf`` elsewhere).
    """
    hit = accepted & (tokens == eos_id)
    first_hit = hit.to(torch.int8).argmax(dim=1)  # the first True (argmax returns the first maximum)
    predicted = masked & (candidates == eos_id)
    best = confidence.masked_fill(~predicted, float("-inf")).argmax(dim=1)
    new = torch.where(hit.any(dim=1), first_hit + 1, torch.where(predicted.any(dim=1), best + 1, cut))
    return torch.minimum(new, cut)


def truncate(canvas: Tensor, cut: Tensor, eos_id: int) -> Tensor:
    """``canvas [G, L]`` with every position ``j >= cut`` set to EOS (the dropped tail reads as EOS)."""
    dropped = torch.arange(canvas.shape[1], device=canvas.device) >= cut[:, None]
    return canvas.masked_fill(dropped, eos_id)


def decided_eos(block: Tensor, dropped: Tensor, eos_id: int) -> Tensor:
    """``block [G, W, V]`` with the window positions ``dropped [G, W]`` (past the row's canvas cut) set to logits
    that put probability 1 on EOS: a dropped position is decided, whether or not this forward happened to compute
    it (at batch > 1 it does for rows with a shorter canvas than the longest). Policies never commit there (the
    token is not the mask); Learn2PD's filter reads its confidence, which is then 1, as for an EOS the row has
    committed, independently of the batch's composition."""
    certain = torch.zeros_like(block[:1, :1])
    certain[..., eos_id] = 1e4  # softmax in float32: exactly one-hot
    return torch.where(dropped[..., None], certain, block)


class EndOfText:
    """EoTP's state (module docstring): each row's canvas length, on the device and mirrored on the host (one
    read-back per forward), and the key mask that hides the dropped tails."""

    def __init__(self, prompt_mask: Tensor, gen_length: int, eos_id: int, mask_id: int):
        batch, self.prompt_len = prompt_mask.shape
        device = prompt_mask.device
        self.gen_length, self.eos_id, self.mask_id = gen_length, eos_id, mask_id
        self.length = torch.full((batch,), gen_length, dtype=torch.long, device=device)
        self.host = torch.full((batch,), gen_length, dtype=torch.long)
        self.padded = ~prompt_mask.all(dim=1).cpu()
        self.visible = torch.cat([prompt_mask, torch.ones(batch, gen_length, dtype=torch.bool, device=device)], dim=1)
        self.positions = torch.arange(self.visible.shape[1], device=device)

    def width(self, rows_h: Tensor) -> int:
        """The forward's width: prompt plus the longest surviving canvas among ``rows_h``."""
        return self.prompt_len + int(self.host[rows_h].max())

    def key_mask(self, rows_h: Tensor) -> functools.partial:
        """The key mask of a forward of ``rows_h`` as a function of its number of keys (:meth:`visible_keys`)."""
        return functools.partial(self.visible_keys, rows_h)

    def visible_keys(self, rows_h: Tensor, extent: int) -> Optional[Tensor]:
        """``[B, N]`` key mask for a forward of ``rows_h`` over ``extent`` keys, None when it would hide nothing
        (no padding, no row's canvas shorter than the keys), so an unpadded row alone takes the unmasked path."""
        if not bool((self.padded[rows_h] | (self.host[rows_h] + self.prompt_len < extent)).any()):
            return None
        return self.visible & (self.positions < self.prompt_len + self.length[:, None])

    def mark_dropped(self, block: Tensor, index: Tensor, rows: Tensor, rows_h: Tensor) -> Tensor:
        """The policy's block logits ``[G, W, V]`` at window positions ``index [G, W]``, dropped ones decided EOS."""
        if not bool((self.host[rows_h] < self.gen_length).any()):
            return block
        return decided_eos(block, index >= self.length[rows][:, None], self.eos_id)

    def after_step(self, view: StepView) -> None:
        """Cut after an accepted EOS, else after the most confident EOS prediction; the dropped tail is no longer the
        row's (``view.masked`` narrows to the surviving canvas)."""
        self.cut_after(view, view.accepted, view.candidates, view.confidence)
        view.masked &= torch.arange(self.gen_length, device=view.masked.device) < view.cut[:, None]

    def cut_after(self, view: StepView, accepted: Tensor, candidates: Optional[Tensor] = None,
                  confidence: Optional[Tensor] = None) -> None:
        """Cut ``view``'s rows (:func:`end_of_text_cut`) and set their dropped tails to EOS. Without ``candidates``
        only an accepted EOS cuts (Prophet's early commit)."""
        canvas = view.canvas
        masked = canvas == self.mask_id
        if candidates is None:
            masked, candidates, confidence = torch.zeros_like(masked), canvas, canvas.double()
        cut = end_of_text_cut(self.length[view.rows], accepted, canvas, masked, candidates, confidence, self.eos_id)
        self.length[view.rows] = cut
        self.host[view.rows_h] = cut.cpu()
        view.canvas, view.cut = truncate(canvas, cut, self.eos_id), cut

    def finish(self, tokens: Tensor) -> Tensor:
        """The output canvas: an edit may have touched a dropped tail, which reads as EOS."""
        return truncate(tokens, self.length, self.eos_id)

    def details(self, rows: Tensor) -> dict:
        return {"canvas_length": self.length[rows].clone()}

    def report(self, extra: dict, labels: dict) -> None:
        extra["canvas_length"] = self.length.cpu()
        labels["eotp"] = True
