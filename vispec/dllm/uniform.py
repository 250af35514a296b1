"""Uniform-corruption block diffusion in the block loop: the noise, the reference implementations' draws, the caches.

DiffusionGemma (transformers' ``DiffusionGemmaForBlockDiffusion``) is trained with *uniform* corruption: an undecided
canvas position holds a token drawn uniformly from the vocabulary, not a mask token. vispec's block loop keeps its
masked view of the canvas (a position is the mask id until a policy commits it; the adapter's mask id is a virtual id
past the vocabulary, :mod:`vispec.models.diffusion_gemma`) and the model adapter shows the denoiser, at every
undecided position, either the policy's *draft* for it (a provisional token, :attr:`vispec.dllm.UnmaskSchedulerOutput.
draft`: the DiffusionGemma rule's accepted samples, :mod:`vispec.dllm.gemma_rule`) or a fresh uniform token. Every
forward of a block draws fresh tokens (a block starts from a fully random canvas), as transformers' ``generate`` and
diffusers' ``DiffusionGemmaPipeline`` renoise after every step.

Two sources of randomness:

* **Counter-based** (the default, vispec's convention): the uniform token at generated position ``j`` for a row's
  ``f``-th forward is ``⌊w · V / 2^32⌋`` for the Philox word keyed by (row seed, ``j``, :attr:`~vispec.kernels.
  philox.Stream.INIT`, ``f``) (:func:`uniform_tokens`), so a row's tokens do not depend on the rest of the batch and
  need no stored state.
* **Shared** (:class:`SharedGenerator`, passed as ``generator=`` to :func:`vispec.dllm.decode`): one
  ``torch.Generator`` (or torch's global generator) drawn batch-wide, in the order and with the shapes the reference
  implementations draw: the initial canvas ``randint(0, V, [B, C])`` at a block's first forward, then per step the
  policy's samples (``multinomial`` over ``[B·C, V]``, the DiffusionGemma rule) and the renoise ``randint(0, V, [B,
  C])``. A row's tokens then depend on the batch (as theirs do), and a decode seeded like theirs returns their tokens:
  ``torch.manual_seed(s)`` before ``model.generate`` is ``SharedGenerator()`` after ``torch.manual_seed(s)``, and
  diffusers' ``generator=torch.Generator().manual_seed(s)`` is ``SharedGenerator(torch.Generator().manual_seed(s))``.
  Rows that have left the forward still get their draws (discarded), so every row's numbers sit where the
  references, which keep every row in every forward, draw them. ``torch.multinomial`` with one sample consumes one
  exponential per entry of its ``[N, V]`` input whatever the probabilities are (an exponential race), which is what
  makes drawing for absent rows with placeholder probabilities consume the stream exactly as the references do.

**The caches** (:data:`CANVAS_CACHES`; :func:`vispec.dllm.cache_modes.cache_class` picks them for a model with
``uniform_corruption = True``) run an encoder/decoder canvas model: a causal encoder whose K/V cache holds the prompt
and the finished canvases, and a decoder that denoises the current canvas against it (the protocol
:data:`MODEL_PROTOCOL`, :class:`vispec.models.diffusion_gemma.DiffusionGemmaLM`). Per decode they keep the current
canvas's drafts, the self-conditioning logits of each row's last step (:meth:`CanvasCache.after_step`, from the
policy's :attr:`~vispec.dllm.UnmaskSchedulerOutput.pred_logits`, else the raw logits) and the shared draws.
``"prefix"`` encodes every finished canvas once, for every row, in the reference's passes (the prompt, then one canvas
at a time), and a forward of fewer rows reads a row-selected copy; ``"dual"`` is the same (the decoder sees no
suffix); ``"none"`` reruns the encoder passes for the forward's rows before every decoder forward; ``"dkv"`` is
refused (the decoder recomputes the whole canvas from a self-conditioning input that changes every step, so there
are no per-token K/V to reuse). A forward returns the logits of the rows' current canvas only (the decoder never sees
later canvases), so the rules that read beyond the block judge what it computed.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

from vispec.checks import check_int
from vispec.dllm.caches import Guidance, NoCache
from vispec.kernels.philox import Stream, randint_below

MODEL_PROTOCOL = ("encode", "denoise", "new_cache", "select_cache_rows", "canvas_length", "vocab_size",
                  "conditioning_dtype")


def uniform_tokens(seeds: Tensor, positions: Tensor, draws: Tensor, vocab_size: int) -> Tensor:
    """``[R, W]`` counter-based uniform tokens in ``[0, vocab_size)`` (module docstring).

    Args:
        seeds: ``[R]`` the rows' int64 seeds; ``positions``: ``[R, W]`` generated positions; ``draws``: ``[R]`` the
            rows' forward counts (each forward of a position gets a fresh token).
    """
    return randint_below(seeds, positions, Stream.INIT, draws, vocab_size)


class SharedGenerator:
    """Draw a decode's randomness from one ``torch.Generator`` batch-wide, as transformers' / diffusers' reference
    implementations do (module docstring); pass it as ``generator=`` to :func:`vispec.dllm.decode`.

    Args:
        generator: a ``torch.Generator`` (diffusers' ``generator=``), or None for torch's global generator (what
            transformers' ``generate`` draws from).
    """

    def __init__(self, generator: Optional[torch.Generator] = None):
        if generator is not None and not isinstance(generator, torch.Generator):
            raise ValueError(f"generator must be a torch.Generator or None (torch's global generator), got "
                             f"{type(generator).__name__}")
        self.generator = generator
        self.batch: Optional[int] = None
        self.device: Optional[torch.device] = None

    def bind(self, batch: int, device: "torch.device | str") -> "SharedGenerator":
        """Serve a decode of ``batch`` rows on ``device`` (the shapes of the draws); the generator must live there."""
        self.batch = check_int("batch", batch, minimum=1)
        self.device = torch.device(device)
        if self.generator is not None and self.generator.device.type != self.device.type:
            raise ValueError(f"SharedGenerator's generator is on {self.generator.device}, the decode on {self.device}: "
                             "the reference draws on the model's device")
        return self

    def _bound(self) -> int:
        if self.batch is None:
            raise ValueError("SharedGenerator is not bound to a decode (vispec.dllm.decode binds it)")
        return self.batch

    def randint(self, high: int, width: int) -> Tensor:
        """``[B, width]`` tokens ``torch.randint(0, high, (B, width))`` for the whole batch."""
        return torch.randint(0, high, (self._bound(), width), device=self.device, generator=self.generator)

    def multinomial(self, probs: Tensor, rows: Tensor) -> Tensor:
        """``[R, W]`` one sample per position from ``probs [R, W, V]`` (float32, the batch ``rows``' part), drawn as
        ``torch.multinomial(p.view(-1, V), 1)`` over the whole batch ``[B, W, V]``; absent rows get uniform
        placeholder probabilities (their samples are discarded; the stream advances as the reference's)."""
        batch = self._bound()
        full = probs
        if rows.numel() != batch:  # rows are sorted and unique: fewer than the batch means some are absent
            full = torch.full((batch, *probs.shape[1:]), 1.0 / probs.shape[-1], dtype=probs.dtype, device=probs.device)
            full[rows] = probs
        samples = torch.multinomial(full.view(-1, probs.shape[-1]), num_samples=1, generator=self.generator)
        return samples.view(batch, probs.shape[1])[rows]

    def row_seeds(self) -> Tensor:
        """``[B]`` zero seeds: under a shared generator nothing is keyed by row."""
        return torch.zeros(self._bound(), dtype=torch.int64, device=self.device)


class CanvasCache(NoCache):
    """``cache="none"`` for uniform-corruption canvas models (module docstring): the encoder passes are rerun before
    every decoder forward. The base of their caches: per decode it holds the current canvas's drafts,
    self-conditioning logits and (with a :class:`SharedGenerator`) the drawn noise tokens."""

    mode = "none"
    keeps_prefix = False

    def __init__(self, model: Any, guidance: Guidance, key_mask: Optional[Tensor], compile: bool = False,
                 reload_steps: int = 8):
        super().__init__(model, guidance, key_mask, compile, reload_steps)
        self.block_start: Optional[int] = None
        self.encoded = 0  # tokens of x in the (kept) encoder cache
        self.seeds: Optional[Tensor] = None
        self.shared = None
        self.forwards: Optional[Tensor] = None  # [B] decoder forwards per row (the noise keys' draw index)
        self.noise: Optional[Tensor] = None  # [B, C] shared draws for the next forward
        self.draft: Optional[Tensor] = None  # [B, C] the policy's drafts (-1: none)
        self.conditioning: Optional[Tensor] = None  # [B, C, V] the next forward's self-conditioning logits
        self.last: Optional[tuple[Tensor, Tensor]] = None  # (rows, logits) of the last forward

    @classmethod
    def check_model(cls, model: Any) -> None:
        missing = [name for name in MODEL_PROTOCOL if not hasattr(model, name)]
        if missing:
            raise ValueError(f"the uniform-corruption caches need a canvas model with {'/'.join(MODEL_PROTOCOL)} "
                             f"(vispec.models.diffusion_gemma.DiffusionGemmaLM), {type(model).__name__} lacks {missing}")

    def use_noise(self, seeds: Tensor, shared: Any) -> None:
        self.seeds, self.shared = seeds, shared
        self.forwards = torch.zeros_like(seeds)

    # ------------------------------------------------------------------ the loop's entry point
    def logits(self, x: Tensor, rows: Tensor, step: int, block: tuple[int, int], width: int, whole: bool,
               key_mask=None) -> tuple[Tensor, int]:
        """The decoder's logits of the rows' current canvas ``block`` (only the canvas: ``whole`` cannot reach later
        canvases, which the decoder never sees), and the canvas start."""
        start, end = block
        if start != self.block_start:
            self._start_canvas(x, start)
        visible = self.key_mask if key_mask is None else key_mask(x.shape[1])
        canvas = x[rows, start:end]
        undecided = canvas == self.guidance.mask_id
        if self.shared is not None:
            noise = self.noise[rows]
        else:
            positions = torch.arange(start - self.prompt_len, end - self.prompt_len, device=x.device)
            noise = uniform_tokens(self.seeds[rows], positions.expand(rows.shape[0], -1), self.forwards[rows],
                                   self.model.vocab_size)
        draft = self.draft[rows]
        shown = torch.where(undecided, torch.where(draft >= 0, draft, noise), canvas)
        cache = self._prefix(x, rows, start)
        conditioning = None if step == 0 or self.conditioning is None else self.conditioning[rows]
        logits = self.model.denoise(shown, cache, None if visible is None else visible[rows, :end].bool(), start,
                                    conditioning)
        self.forwards[rows] += 1
        self.last = (rows, logits)
        return logits, start

    def after_step(self, rows: Tensor, out: Any) -> None:
        """Keep the step's self-conditioning logits and drafts for the rows' next forward; with a shared generator,
        draw the renoise tokens (after the policy's samples, as the references order them)."""
        _, logits = self.last
        predicted = logits if out.pred_logits is None else out.pred_logits
        if self.conditioning is None:
            self.conditioning = torch.zeros((self.draft.shape[0], *predicted.shape[1:]),
                                            dtype=self.model.conditioning_dtype, device=predicted.device)
        self.conditioning[rows] = predicted.to(self.conditioning.dtype)
        draft = getattr(out, "draft", None)
        self.draft[rows] = -1 if draft is None else draft
        if self.shared is not None:
            self.noise = self.shared.randint(self.model.vocab_size, self.model.canvas_length)

    # ------------------------------------------------------------------ pieces
    def _start_canvas(self, x: Tensor, start: int) -> None:
        """A new canvas (a round of the block loop): no drafts or self-conditioning yet; the kept encoder cache takes
        the finished canvases (every row, as ``generate``); a shared generator draws the initial canvas."""
        batch = x.shape[0]
        self.block_start = start
        self.draft = torch.full((batch, self.model.canvas_length), -1, dtype=torch.long, device=x.device)
        self.conditioning = None
        if self.keeps_prefix:
            if self.cache is None:
                self.cache, self.cache_rows = self.model.new_cache(), torch.arange(batch, device=x.device)
            self.encoded = self._encode(self.cache, x, None, self.encoded, start)
        if self.shared is not None:
            self.noise = self.shared.randint(self.model.vocab_size, self.model.canvas_length)

    def _seen(self, x: Tensor, rows: Optional[Tensor], end: int) -> Tensor:
        """``[R, end]`` bool: the real tokens among the first ``end`` (prompt padding is False)."""
        mask = self.key_mask if self.key_mask is not None else torch.ones_like(x, dtype=torch.bool)
        mask = mask[:, :end].bool()
        return mask if rows is None else mask[rows]

    def _encode(self, cache: Any, x: Tensor, rows: Optional[Tensor], encoded: int, start: int) -> int:
        """Encode ``x[rows, encoded:start]`` into ``cache`` in ``generate``'s passes (the prompt, then one canvas at a
        time); returns the new encoded length."""
        ids = x if rows is None else x[rows]
        while encoded < start:
            end = self.prompt_len if encoded == 0 else min(encoded + self.model.canvas_length, start)
            self.model.encode(ids[:, encoded:end], self._seen(x, rows, end), cache, encoded)
            encoded = end
        return encoded

    def _prefix(self, x: Tensor, rows: Tensor, start: int) -> Any:
        """The encoder cache of ``rows`` for a canvas at ``start``: re-encoded (``"none"``)."""
        cache = self.model.new_cache()
        self._encode(cache, x, rows, 0, start)
        return cache


class PrefixCanvasCache(CanvasCache):
    """``cache="prefix"``: each finished canvas is encoded once, for every row (module docstring); a forward of fewer
    rows reads a row-selected copy."""

    mode = "prefix"
    keeps_prefix = True

    def _prefix(self, x: Tensor, rows: Tensor, start: int) -> Any:
        return self.cache if rows.numel() == self.cache_rows.numel() else self.model.select_cache_rows(self.cache, rows)


class DualCanvasCache(PrefixCanvasCache):
    """``cache="dual"``: the prefix cache (the decoder sees no suffix to cache)."""

    mode = "dual"


class RefusedDKV(CanvasCache):
    """``cache="dkv"`` is refused (module docstring)."""

    mode = "dkv"

    @classmethod
    def check_model(cls, model: Any) -> None:
        raise ValueError("cache='dkv' reuses the K/V of committed tokens inside a block; a uniform-corruption decoder "
                         "recomputes the whole canvas from a self-conditioning input that changes every step, so there "
                         "are none to reuse: pass cache='prefix' (the exact encoder cache of finished canvases)")


CANVAS_CACHES = {cls.mode: cls for cls in (CanvasCache, PrefixCanvasCache, DualCanvasCache, RefusedDKV)}
