"""The small protocol between model-agnostic decoders and AR image models.

A decoder never sees layers or caches. It asks the model to

* ``prefill(condition, guidance=..., max_new_tokens=N, window=L, validate=True) -> (state, logits)``:
  encode the condition (class label, caption, prompt) into a fresh fixed-capacity cache and return
  the logits that predict image token 0 (shape ``[B, 1, V]``). With ``validate=False`` later calls
  check nothing that needs a value read back from the device (the decoder keeps the invariants);
* ``forward_window(state, tokens [B, W], longest=None) -> logits [B, W, V]``: append a window of ``W``
  tokens per sample after that sample's cached prefix, with causal attention inside the window;
  output ``j`` predicts the token after window token ``j``. Samples have their own prefix lengths
  (ragged). ``longest``: the most image tokens any sample has cached, when the caller tracks it on the
  host; without it a non-validating state attends over the whole capacity, so the call is static
  (no read-back, shapes fixed by ``B``, ``W`` and the capacity) and compiles with ``fullgraph=True``;
* ``rollback(state, keep [B])``: keep only the first ``keep[b]`` window tokens of the last window in
  sample ``b``'s cache (the rest is discarded, so the next window starts right after them);
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
from typing import Any, Optional, Protocol, runtime_checkable

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

    def forward_window(self, state: Any, tokens: Tensor, longest: Optional[int] = None) -> WindowLogits: ...

    def rollback(self, state: Any, keep: Tensor) -> None: ...

    def refill(self, state: Any, index: Tensor, condition: Any) -> WindowLogits: ...

    def select(self, state: Any, index: Tensor) -> Any: ...
