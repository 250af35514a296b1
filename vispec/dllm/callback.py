"""What a step callback of :func:`vispec.dllm.decode` sees (:func:`report_progress`) and may do besides watching: stop
decoding (:class:`StopDecoding`) or return an edit of the canvas and the guidance scale (:func:`apply_edit`)."""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import Tensor

from vispec.checks import check_number
from vispec.dllm.caches import Guidance
from vispec.dllm.options import GUIDANCE_HINT
from vispec.outputs import UNDECIDED, DecodeProgress, committed_view


class StopDecoding(Exception):
    """Raised by a step callback to end decoding early: :func:`vispec.dllm.decode` returns the canvas so far (the
    mask id where undecided), the statistics of the forwards run, and ``labels["interrupted"] = True``."""


def report_progress(callback: Callable[[DecodeProgress], Any], step: int, answer: Tensor, decided: Tensor,
                    details: dict) -> tuple[Any, bool]:
    """Call a step callback with the answer canvas ``answer [B, L]`` (``decided``: its committed positions; the others
    read as undecided) and the step's ``details``; ``(edit, stopped)``: what it returned (None, or an edit for
    :func:`apply_edit`) and whether it raised :class:`StopDecoding`. The decoders' one way of reporting a step."""
    try:
        return callback(DecodeProgress(step=step, num_committed=decided.sum(dim=1), tokens=committed_view(answer, decided),
                                       details=details)), False
    except StopDecoding:
        return None, True


def apply_edit(edit: Any, x: Tensor, prompt_len: int, mask_id: int, vocab: int, guidance: Guidance) -> None:
    """Apply a step callback's edit (:func:`vispec.dllm.decode`'s ``callback``) to the canvas ``x`` and the guidance
    scale (shared by every cache of the decode)."""
    if not isinstance(edit, dict) or set(edit) - {"tokens", "guidance_scale"}:
        raise ValueError(f"a step callback returns None or a dict with 'tokens' and / or 'guidance_scale', got {edit!r}")
    if "guidance_scale" in edit:
        scale = check_number("guidance_scale", edit["guidance_scale"], minimum=1, hint=GUIDANCE_HINT)
        if not guidance.guided:
            raise ValueError("guidance_scale can change during decoding only when decoding started with guidance "
                             "(guidance_scale != 1): the unconditional branch is set up at the start")
        guidance.scale = float(scale)
    if "tokens" not in edit:
        return
    canvas = x[:, prompt_len:]
    tokens = edit["tokens"]
    if not isinstance(tokens, Tensor) or tokens.shape != canvas.shape or tokens.dtype != torch.long:
        got = f"{tuple(tokens.shape)} {tokens.dtype}" if isinstance(tokens, Tensor) else type(tokens).__name__
        raise ValueError(f"an edited canvas must be a LongTensor of shape {tuple(canvas.shape)}, got {got}")
    tokens = tokens.to(x.device)
    given = tokens != UNDECIDED
    bad = given & ((tokens < 0) | (tokens >= vocab) | (tokens == mask_id))
    if bool(bad.any()):
        raise ValueError(f"an edited canvas holds token ids outside [0, {vocab}) or the mask id {mask_id} "
                         f"(use {UNDECIDED} where a position stays undecided): {tokens[bad].unique().tolist()}")
    if bool(((canvas != mask_id) & ~given).any()):
        raise ValueError("an edited canvas may change committed tokens or commit undecided ones, not re-mask "
                         "committed positions")
    x[:, prompt_len:] = torch.where(given, tokens, canvas)
