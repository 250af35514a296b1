"""The small protocol between model-agnostic decoders and AR image models.

A decoder never sees layers or caches. It asks the model to

* ``prefill(condition, guidance=..., max_new_tokens=N, window=L, validate=True) -> (state, logits)``:
  encode the condition (class label, caption, prompt) into a fresh fixed-capacity cache and return
  the logits that predict image token 0 (shape ``[B, 1, V]``). With ``validate=False`` later calls
  check nothing that needs a value read back from the device (the decoder keeps the invariants);
* ``forward_window(state, tokens [B, W], longest=None, parents=None) -> logits [B, W, V]``: append a
  window of ``W`` tokens per sample after that sample's cached prefix, with causal attention inside the
  window; output ``j`` predicts the token after window token ``j``. With ``parents [B, W]`` (long) the
  window is a tree (token trees, SpecInfer / Medusa / SJD-PAC): ``parents[b, j]`` is the slot token ``j``
  follows (``-1``: the cached prefix; always below ``j``), a token attends to the prefix and to its own
  ancestors (:func:`tree_ancestors`), and sits at position ``prefix + depth`` for the positional code;
  its key is still written at ``prefix + j``; Samples have their own prefix lengths
  (ragged). ``longest``: the most image tokens any sample has cached, when the caller tracks it on the
  host; without it a non-validating state attends over every position a window of ``W`` can reach (at most
  the whole capacity), so the call is static (no read-back, shapes fixed by ``B``, ``W`` and the capacity) and
  compiles with ``fullgraph=True``;
* ``rollback(state, keep [B], path=None)``: keep only the first ``keep[b]`` window tokens of the last
  window in sample ``b``'s cache (the rest is discarded, so the next window starts right after them).
  After a tree window, ``path [B, W]`` lists the kept slots root first (``path[b, :keep[b]]``, a
  root-to-node path); their keys and values move to ``prefix + 0 .. keep - 1`` (a gather in the window);
* ``refill(state, index [k], condition) -> logits [k, 1, V]``: start new samples in slots ``index``
  of a running batch (continuous batching): their condition is cached there and their lengths reset;
* ``select(state, index [B'])``: keep only the listed samples (finished samples leave the batch).

With classifier-free guidance the model runs a doubled batch internally (conditional half first)
and feeds both halves the same window tokens; it returns both halves as :class:`WindowLogits`.

Unified-token models (Emu3, Lumina-mGPT) need per-position logits processors (forced row-end
tokens, an allowed image-token range); decoders accept them as ``processors`` and pass absolute
image-token positions, see :mod:`vispec.processors`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Optional, Protocol, runtime_checkable

import torch
from torch import Tensor


@dataclass
class WindowLogits:
    """Raw logits of one forward: conditional half and (with guidance) unconditional half."""

    cond: Tensor  # [B, W, V]
    uncond: Optional[Tensor] = None  # [B, W, V] or None without guidance


@runtime_checkable
class SpeculativeARModel(Protocol):
    """What :mod:`vispec.decoding` needs from a model (see the module docstring)."""

    @property
    def image_vocab_size(self) -> int: ...

    def prefill(self, condition: Any, *, guidance: bool, max_new_tokens: int, window: int,
                validate: bool = True) -> tuple[Any, WindowLogits]: ...

    def forward_window(self, state: Any, tokens: Tensor, longest: Optional[int] = None,
                       parents: Optional[Tensor] = None) -> WindowLogits: ...

    def rollback(self, state: Any, keep: Tensor, path: Optional[Tensor] = None) -> None: ...

    def refill(self, state: Any, index: Tensor, condition: Any) -> WindowLogits: ...

    def select(self, state: Any, index: Tensor) -> Any: ...


# ---- token trees ---------------------------------------------------------------------------------------


def check_tree(parents: Tensor, batch: int, width: int, validate: bool) -> None:
    """``parents`` must be a long ``[batch, width]`` tensor with ``-1 <= parents[b, j] < j`` (the value
    check reads back, so only when ``validate``)."""
    if parents.shape != (batch, width) or parents.dtype != torch.long:
        raise ValueError(f"parents must be a long tensor of shape [{batch}, {width}], got {parents.dtype} "
                         f"{tuple(parents.shape)}")
    if validate:
        slot = torch.arange(width, device=parents.device)
        if bool(((parents < -1) | (parents >= slot)).any()):
            raise ValueError("parents[b, j] must lie in [-1, j - 1]: a slot follows the prefix or an earlier slot")


def tree_ancestors(parents: Tensor) -> Tensor:
    """``[..., W, W]`` bool: ``[i, j]`` is True iff slot ``j`` is slot ``i`` or one of its ancestors.

    ``parents [..., W]``: each slot's parent slot, ``-1`` for a root (one that follows the cached prefix);
    a chain (``parents[j] = j - 1``) gives the lower triangle, i.e. causal attention. Computed without a
    read-back in ``ceil(log2 W)`` boolean squarings of ``I + P`` (``P[i, j]``: ``j`` is ``i``'s parent),
    each doubling the path length covered, so shapes are static and the call compiles."""
    width = parents.shape[-1]
    slots = torch.arange(width, device=parents.device)
    reach = (parents[..., :, None] == slots) | (slots[:, None] == slots)  # one step up, or stay
    covered = 1
    while covered < width:
        reach = (reach.float() @ reach.float()) > 0
        covered *= 2
    return reach


def tree_depths(ancestors: Tensor) -> Tensor:
    """Each slot's depth below the prefix (``0`` for a root), from :func:`tree_ancestors`'s matrix."""
    return ancestors.sum(-1) - 1


def window_visibility(starts: Tensor, ancestors: Tensor, kv_len: int) -> Tensor:
    """``[R, W, kv_len]`` bool: cache position ``t`` is visible to window slot ``i`` of row ``r`` whose window
    starts at ``starts[r]``: every prefix position (``t < start``) and, inside the window, the slot's
    ancestors and itself. For a chain this is ``t <= start + i``."""
    rows, width = ancestors.shape[0], ancestors.shape[-1]
    keys = torch.arange(kv_len, device=starts.device)
    offset = keys[None, :] - starts[:, None]  # [R, K] slot of each key, if in the window
    in_window = (offset >= 0) & (offset < width)
    inside = ancestors.gather(2, offset.clamp(0, width - 1)[:, None, :].expand(rows, width, kv_len))
    return (offset < 0)[:, None, :] | (in_window[:, None, :] & inside)


def check_path(path: Tensor, batch: int, width: int, validate: bool) -> None:
    """``path`` must be a long ``[batch, width]`` tensor of window slots (the range check reads back, so only
    when ``validate``)."""
    if path.shape != (batch, width) or path.dtype != torch.long:
        raise ValueError(f"path must be a long tensor of shape [{batch}, {width}], got {path.dtype} {tuple(path.shape)}")
    if validate and bool(((path < 0) | (path >= width)).any()):
        raise ValueError(f"path must hold window slots in [0, {width - 1}]")


def keep_path(caches: Iterable[Tensor], starts: Tensor, path: Tensor) -> None:
    """Move a tree window's kept path into place in every ``[R, H, capacity, hd]`` cache tensor: row ``r``'s
    slot ``path[r, k]`` (cache position ``starts[r] + path[r, k]``) goes to ``starts[r] + k``."""
    rows = torch.arange(path.shape[0], device=path.device)[:, None]
    source = starts[:, None] + path
    target = starts[:, None] + torch.arange(path.shape[-1], device=path.device)
    for cache in caches:  # advanced indices first: [R, W, H, hd]; the right side is a copy, so overlaps are safe
        cache[rows, :, target] = cache[rows, :, source]
