"""Token edits from a step callback: rewrite committed image tokens mid-decode.

A step callback (``job.callback``) may return ``{"tokens": T}`` with ``T [R, N]`` laid out as the
:class:`~vispec.outputs.DecodeProgress` it was given: committed tokens, -1 (:data:`UNDECIDED`) where
nothing is committed. The image decoders then continue as if the edited tokens had been sampled: for
every sample whose committed tokens changed, first at position ``j``, the KV cache is rewound to ``j``
image tokens (the model's optional ``truncate(state, keep)``) and the edited tokens ``j .. c - 1``
(``c``: what was cached) are fed again in one forward, whose logits are discarded; drafts made from
the old prefix are dropped by the decoder. Every later token is sampled from the target given the
edited prefix, so the decode stays exact for that prefix.

An edit changes committed tokens only: undecided positions stay -1 (an AR decode advances all its
samples in step, so it cannot commit a token ahead of the others), and ids lie in ``[0, V)``.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

from vispec.outputs import UNDECIDED


def edited_tokens(edit: Any, given: Tensor, vocab: int) -> Optional[Tensor]:
    """The validated ``tokens`` of a callback's return value ``edit`` (None when it has none or changes
    nothing); ``given``: the ``[R, N]`` tokens the callback was shown."""
    if edit is None:
        return None
    if not isinstance(edit, dict) or set(edit) - {"tokens"}:
        raise ValueError(f"a step callback of an image decoder returns None or {{'tokens': tensor}}, got {edit!r}")
    tokens = edit["tokens"]
    if not isinstance(tokens, Tensor) or tokens.dtype.is_floating_point or tokens.dtype == torch.bool \
            or tokens.shape != given.shape:
        got = f"{tokens.dtype} tensor of shape {tuple(tokens.shape)}" if isinstance(tokens, Tensor) else type(tokens).__name__
        raise ValueError(f"edited tokens must be an integer tensor of shape {tuple(given.shape)}, got {got}")
    tokens = tokens.to(device=given.device, dtype=torch.long)
    undecided = given == UNDECIDED
    if not torch.equal(tokens == UNDECIDED, undecided):
        raise ValueError("edited tokens may change committed tokens only: positions shown as -1 (undecided) must stay "
                         "-1, and committed ones may not become -1")
    if bool(((tokens < 0) | (tokens >= vocab))[~undecided].any()):
        raise ValueError(f"edited tokens must be image token ids in [0, {vocab}) where committed")
    return None if torch.equal(tokens, given) else tokens


def first_change(new: Tensor, old: Tensor) -> Tensor:
    """Per row, the first position where ``new`` and ``old`` differ (their width where none does)."""
    differs = new != old
    width = torch.full((new.shape[0],), new.shape[1], dtype=torch.long, device=new.device)
    index = torch.arange(new.shape[1], device=new.device).expand_as(new)
    return torch.where(differs, index, width[:, None]).min(dim=1).values if new.shape[1] else width


def refeed(model: Any, state: Any, tokens: Tensor, cached: Tensor, keep: Tensor) -> None:
    """Rewind ``state`` to ``keep [B]`` cached image tokens per sample and feed ``tokens[b, keep[b] :
    cached[b]]`` again (one forward, logits discarded), so the cache holds the possibly edited
    ``tokens[b, : cached[b]]``. Samples with ``keep == cached`` are left as they are."""
    truncate = getattr(model, "truncate", None)
    if truncate is None:
        raise ValueError(f"{type(model).__name__} has no truncate(state, keep): it cannot rewind its cache, so a step "
                         f"callback cannot edit committed tokens")
    truncate(state, keep)
    span = cached - keep
    width = int(span.max()) if span.numel() else 0
    if width == 0:
        return
    at = (keep[:, None] + torch.arange(width, device=keep.device)).clamp(max=tokens.shape[1] - 1)
    model.forward_window(state, tokens.gather(1, at), int(keep.max()))
    model.rollback(state, span)
