"""The model forwards of :func:`vispec.dllm.decode`: unsupervised guidance and one class per block cache.

Every cache answers one question for the block loop (:mod:`vispec.dllm.loop`), :meth:`NoCache.logits`: the logits
of some generated positions of some batch rows after the model saw the canvas. The classes differ in what they
forward and keep (Fast-dLLM, Wu et al., arXiv 2505.22618, §3.1; spec ``dllm.md`` §4.3):

* :class:`NoCache` (``cache="none"``): every step is a full forward over the canvas;
* :class:`PrefixCache` (``"prefix"``): the block's first step is a full forward that also caches every position's
  K/V; later steps forward ``x[block_start:]`` against the cached prefix;
* :class:`DualCache` (``"dual"``): as ``prefix``, but later steps forward only the block, against the cached prefix
  *and* suffix (the masked future, stale within the block);
* :class:`DKVCache` (``"dkv"``, dKV-Cache-Decode, Ma et al., arXiv 2505.15781, spec ``dllm.md`` §11): a committed
  token's K/V are cached from the step *after* the one that commits it (delayed caching). Forward ``j`` of a
  block (``j = 0, 1, ...``) is a full refresh when ``j % cache_reload_steps == 0`` (the first step of every block,
  so also the first of the decode, and every ``cache_reload_steps`` steps after it); the other steps forward only
  each row's masked and just-committed positions against the cached K/V of the rest. The paper's LLaDA code also
  runs step ``j = 1`` in full because its cache is filled one step late; here the step-0 refresh fills it, so
  step 1 is already a cached step. With ``logits_shift`` models (Dream-style: the logits at ``p`` come from
  ``p - 1``) the position before each recomputed one is recomputed too. No ``compile=True`` (the recomputed set
  changes size every step).

Guidance (:class:`Guidance`) is LLaDA's unsupervised CFG: the unconditional branch masks the prompt, and
``ℓ = ℓ_u + s (ℓ_c - ℓ_u)``; ``s = 1`` runs no unconditional branch.

Static, compiled forwards (``compile=True``, models with ``compiled_core``, as LLaDA): every forward runs through
``torch.compile(fullgraph=True)``, the graphs cached on the model (the first call compiles, later calls with the
same shapes reuse them). Shapes stay fixed within a decode:

* the forward always takes the whole batch (``[B, N]``, ``[2B, N]`` with guidance), not only the rows whose block
  still has masks; the finished rows' logits are discarded and they are not charged an NFE, so tokens and NFE are
  those of the eager loop (whose forwards drop finished rows);
* ``"none"``: one graph ``[B, N]``; ``"dual"``: the refresh ``[B, N]`` and the block ``[B, Lb]``, whose positions
  reach the model as an index tensor, so one graph serves every block;
* ``"prefix"``: the refresh is static, but the span ``x[:, start:]`` shrinks by ``Lb`` per block, so it is compiled
  with ``dynamic=True`` (one graph, symbolic length). Padding it to a fixed width instead would compute up to
  ``K - 1`` blocks of unused queries and change the matmul shapes, and so possibly the last bits of the logits,
  against the eager forward.
"""

from __future__ import annotations

import copy
from typing import Any, Callable, Optional

import torch
from torch import Tensor

KeyMask = Callable[[int], Optional[Tensor]]  # key mask [B, N] for a forward over that many keys (None: all visible)


class Guidance:
    """LLaDA's unsupervised classifier-free guidance (module docstring), shared by a decode's caches, so a step
    callback's new ``scale`` reaches every forward. ``guided`` is fixed at the start (the unconditional branch and
    its cache rows exist only when decoding starts guided). ``infill [B, P]`` (bool, or None): the prompt positions
    that were mask tokens at the start (:mod:`vispec.dllm.infill`); as LLaDA's ``prompt_index``, the unconditional
    branch keeps their current tokens and masks the rest of the prompt."""

    def __init__(self, scale: float, prompt_len: int, mask_id: int, infill: Optional[Tensor] = None):
        self.scale, self.prompt_len, self.mask_id = float(scale), prompt_len, mask_id
        self.guided = self.scale != 1.0
        self.infill = infill

    def inputs(self, ids: Tensor, mask: Optional[Tensor], rows: Optional[Tensor] = None) -> tuple[Tensor, Optional[Tensor]]:
        """The conditional rows (batch ``rows``; None: all), then (guided) the same rows with the prompt masked."""
        if not self.guided:
            return ids, mask
        uncond = ids.clone()
        if self.infill is None:
            uncond[:, : self.prompt_len] = self.mask_id
        else:
            keep = self.infill if rows is None else self.infill[rows]
            uncond[:, : self.prompt_len] = torch.where(keep, ids[:, : self.prompt_len], self.mask_id)
        return torch.cat([ids, uncond]), None if mask is None else torch.cat([mask, mask])

    def mix(self, logits: Tensor) -> Tensor:
        """``ℓ_u + s (ℓ_c - ℓ_u)`` from the stacked conditional and unconditional logits."""
        if not self.guided:
            return logits
        cond, uncond = logits.chunk(2)
        return uncond + self.scale * (cond - uncond)


class NoCache:
    """``cache="none"``: a full forward every step. The base of the caches: the loop's one entry point
    :meth:`logits`, the guidance, the key mask and (``compile``) the whole-batch static forwards.

    ``key_mask [B, N]`` is None when no row is padded. Subclasses keep ``cache`` (the model's K/V cache) and
    ``cache_rows`` (the batch rows it holds, in order) between the steps of a block.
    """

    mode = "none"
    splits_by_block = False  # later steps forward a per-block span: rows of different blocks need their own cache
    needs: tuple = ()

    def __init__(self, model: Any, guidance: Guidance, key_mask: Optional[Tensor], compile: bool = False,
                 reload_steps: int = 8):
        self.model, self.guidance, self.key_mask = model, guidance, key_mask
        self.prompt_len = guidance.prompt_len
        self.compile = compile
        self.kwargs = {"compile": True} if compile else {}
        self.reload_steps = reload_steps
        self.cache = None
        self.cache_rows: Optional[Tensor] = None

    @classmethod
    def check_model(cls, model: Any) -> None:
        """The model methods this cache calls (``ValueError`` naming the cache otherwise)."""
        if any(not hasattr(model, name) for name in cls.needs):
            raise ValueError(f"cache={cls.mode!r} needs a model with {'/'.join(cls.needs)}, got {type(model).__name__}")

    # ------------------------------------------------------------------ the loop's entry point
    def logits(self, x: Tensor, rows: Tensor, step: int, block: tuple[int, int], width: int, whole: bool,
               key_mask: Optional[KeyMask] = None) -> tuple[Tensor, int]:
        """Logits ``[R, T, V]`` of batch ``rows`` (sorted) at the positions ``[lo, lo + T)`` of ``x``, and ``lo``.

        ``block``: the rows' block ``[start, end)`` (positions of ``x``); ``width``: the canvas ends there for these
        rows (end-of-text prediction may cut it); ``whole``: the logits of every position the forward computes
        after the prompt, else of the block only; ``key_mask(extent)``: end-of-text prediction's key mask, which
        hides each row's dropped tail.
        """
        refresh = self.refreshes(step)
        x_width = self.input_width(width, refresh)
        if key_mask is not None:
            self.set_key_mask(key_mask(self.key_extent(x_width, refresh)))
        lo, hi = self.window(block, width, whole, refresh)
        x = x[:, :x_width]
        if not self.compile:
            return self.forward(x, rows, lo, hi, refresh), lo
        logits = self.forward(x, None, lo, hi, refresh)  # all rows: the shapes stay static
        return (logits if rows.numel() == x.shape[0] else logits[rows]), lo

    # ------------------------------------------------------------------ what a mode decides
    def refreshes(self, step: int) -> bool:
        """Whether this step's forward is a full one (over the whole canvas)."""
        return True

    def input_width(self, width: int, refresh: bool) -> int:
        return width

    def key_extent(self, x_width: int, refresh: bool) -> int:
        """How many keys the forward attends to (the cache's width on cached steps)."""
        return x_width

    def window(self, block: tuple[int, int], width: int, whole: bool, refresh: bool) -> tuple[int, int]:
        """``[lo, hi)``: the positions whose logits the forward returns."""
        return (self.prompt_len, width) if whole else (block[0], min(block[1], width))

    def forward(self, x: Tensor, rows: Optional[Tensor], lo: int, hi: int, refresh: bool) -> Tensor:
        ids, mask = self.inputs(x, rows)
        return self.guide(self.model(ids, attention_mask=mask, **self.kwargs).logits[:, lo:hi])

    # ------------------------------------------------------------------ shared pieces
    def guide(self, logits: Tensor) -> Tensor:
        return self.guidance.mix(logits)

    def inputs(self, x: Tensor, rows: Optional[Tensor]) -> tuple[Tensor, Optional[Tensor]]:
        """Model inputs of batch ``rows`` (None: all rows) and their key mask (None: no padding)."""
        ids = x if rows is None else x[rows]
        mask = self.key_mask if rows is None or self.key_mask is None else self.key_mask[rows]
        if mask is not None and mask.shape[1] != ids.shape[1]:
            mask = mask[:, : ids.shape[1]]  # x cut short: end-of-text truncation dropped its tail
        return self.guidance.inputs(ids, mask, rows)

    def set_key_mask(self, key_mask: Optional[Tensor]) -> None:
        """Replace the key mask ``[B, N]`` (True = visible; None: everything visible) and the cached rows' copy (cut
        to the cache's width): end-of-text truncation hides a row's dropped positions."""
        self.key_mask = key_mask
        if self.cache is None:
            return
        mask = None if key_mask is None else key_mask[self.cache_rows, : self.cache.seq_len]
        if mask is not None and self.guidance.guided:
            mask = torch.cat([mask, mask])
        self.cache.key_mask = mask

    def fill(self, x: Tensor, rows: Optional[Tensor], lo: int, hi: int) -> Tensor:
        """A full forward that caches every position's K/V for ``rows`` (None: all)."""
        ids, mask = self.inputs(x, rows)
        out = self.model.compute_kv_cache(ids, attention_mask=mask, **self.kwargs)
        self.cache = out.kv_cache
        self.cache_rows = torch.arange(x.shape[0], device=x.device) if rows is None else rows
        return self.guide(out.logits[:, lo:hi])

    def keep_rows(self, rows: Tensor) -> None:
        """Keep the cache rows of ``rows`` (a subset of ``cache_rows``, same order)."""
        if self.cache_rows.numel() == rows.numel():
            return
        where = torch.searchsorted(self.cache_rows, rows)
        if self.guidance.guided:
            where = torch.cat([where, where + self.cache_rows.numel()])
        self.cache = self.cache.select(where)
        self.cache_rows = rows

    def split(self, rows: Tensor) -> "NoCache":
        """A cache of its own for ``rows`` (sorted, a subset of ``cache_rows``) holding a copy of their entries: with
        adaptive blocks rows have different spans, one forward per group of rows sharing one."""
        part = copy.copy(self)
        part.keep_rows(rows)
        return part

    def release(self) -> None:
        """Drop the cached K/V (the next step refreshes)."""
        self.cache, self.cache_rows = None, None

    # ------------------------------------------------------------------ models with state of their own between steps
    def use_noise(self, seeds: Tensor, shared: Any) -> None:
        """The decode's row seeds ``[B]`` and :class:`~vispec.dllm.uniform.SharedGenerator` (or None), for models whose
        forward draws noise of its own (uniform corruption, :mod:`vispec.models.diffusion_gemma`); masked models draw
        none."""

    def after_step(self, rows: Tensor, out: Any) -> None:
        """After the policy's step on ``rows`` (its :class:`~vispec.dllm.UnmaskSchedulerOutput` ``out``): models with
        state between steps (self-conditioning, drafts) take it here; masked models keep none."""


class PrefixCache(NoCache):
    """``cache="prefix"`` (module docstring): later steps forward ``x[block_start:]`` against the cached prefix."""

    mode = "prefix"
    splits_by_block = True
    needs = ("compute_kv_cache", "forward_span")

    def refreshes(self, step: int) -> bool:
        return step == 0 or self.cache_rows is None

    def key_extent(self, x_width: int, refresh: bool) -> int:
        return x_width if refresh or self.cache is None else self.cache.seq_len

    def window(self, block: tuple[int, int], width: int, whole: bool, refresh: bool) -> tuple[int, int]:
        if whole and not refresh:
            return block[0], width  # the span reaches the canvas' end
        return super().window(block, width, whole, refresh)

    def forward(self, x: Tensor, rows: Optional[Tensor], lo: int, hi: int, refresh: bool) -> Tensor:
        if refresh:
            return self.fill(x, rows, lo, hi)
        if rows is not None:
            self.keep_rows(rows)
        return self.guide(self.span(self.inputs(x, rows)[0], lo, hi))

    def span(self, ids: Tensor, lo: int, hi: int) -> Tensor:
        dynamic = {"dynamic": True} if self.compile else {}  # the span shrinks block after block
        return self.model.forward_span(ids[:, lo:], lo, self.cache, **self.kwargs, **dynamic).logits[:, : hi - lo]


class DualCache(PrefixCache):
    """``cache="dual"`` (module docstring): later steps forward only the block, against the cached prefix and suffix."""

    mode = "dual"

    def window(self, block: tuple[int, int], width: int, whole: bool, refresh: bool) -> tuple[int, int]:
        return NoCache.window(self, block, width, whole and refresh, refresh)

    def span(self, ids: Tensor, lo: int, hi: int) -> Tensor:
        return self.model.forward_span(ids[:, lo:hi], lo, self.cache, **self.kwargs).logits


class DKVCache(NoCache):
    """``cache="dkv"``, dKV-Cache-Decode (module docstring).

    Forward ``j = 0, 1, ...`` of a block is a full refresh (``compute_kv_cache``, every position's K/V) when
    ``j % reload_steps == 0``, else a forward of each row's *uncached* generated positions only
    (``forward_positions``), whose fresh K/V then replace the cached ones. A position is uncached when it is masked
    or its token differs from the one its cached K/V were computed from (``cache.input_ids``): masked positions are
    always recomputed, and a token committed at forward ``j`` is recomputed once more at forward ``j + 1`` (its
    representation still moves in the step that commits it) and read from the cache afterwards: the paper's
    delayed caching. Committed tokens that a step callback edits are recomputed the same way.

    The ragged per-row sets share one forward: each row's uncached positions come first (ascending), then the row
    is padded up to the largest count with some of its cached positions, whose queries write nothing and whose
    logits are dropped, so every row's cache and logits are the ones it gets alone. The block's committed positions
    that were not recomputed get zero logits (schedulers read the masked positions only, and those are always
    recomputed).
    """

    mode = "dkv"
    needs = ("compute_kv_cache", "forward_positions")

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.forwards_in_block = 0

    def refreshes(self, step: int) -> bool:
        return step == 0 or self.cache_rows is None

    def input_width(self, width: int, refresh: bool) -> int:
        # dKV compares the canvas with its cached tokens position by position
        return width if refresh or self.cache is None else self.cache.seq_len

    def forward(self, x: Tensor, rows: Optional[Tensor], lo: int, hi: int, refresh: bool) -> Tensor:
        self.forwards_in_block = 0 if refresh else self.forwards_in_block + 1
        if self.forwards_in_block % self.reload_steps == 0:
            ids, mask = self.inputs(x, rows)
            out = self.model.compute_kv_cache(ids, attention_mask=mask)
            self.cache = out.kv_cache
            self.cache_rows = torch.arange(x.shape[0], device=x.device) if rows is None else rows
            return self.guide(out.logits[:, lo:hi])
        if rows is not None:
            self.keep_rows(rows)
        ids, _ = self.inputs(x, rows)
        shift = bool(getattr(getattr(self.model, "config", None), "logits_shift", False))
        index, real, wanted = uncached_positions(ids, self.cache.input_ids, self.prompt_len, self.guidance.mask_id, shift)
        logits = self.model.forward_positions(ids.gather(1, index), index, self.cache, query_mask=real).logits
        return self.guide(place_logits(logits, index, wanted, lo, hi))


CACHE_CLASSES = {cls.mode: cls for cls in (NoCache, PrefixCache, DualCache, DKVCache)}


def uncached_positions(ids: Tensor, cache_ids: Tensor, prompt_len: int, mask_id: int,
                       shift: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """``index [R, Q]``, ``real [R, Q]`` and ``wanted [R, Q]``: per row its uncached generated positions (masked, or
    a token other than the cached K/V's, ``cache_ids``) in ascending order, padded (``real`` False) to the largest
    count ``Q`` with distinct cached positions of the same row; ``wanted``: the uncached ones, whose logits are
    used. One read-back (``Q``). With ``shift`` (``logits_shift`` models: the logits at ``p`` come from ``p - 1``)
    the position before each uncached one is recomputed too (the last prompt position included), not wanted."""
    first = prompt_len - 1 if shift else prompt_len  # prompt_len >= 1
    region = ids[:, first:]
    stale = (region == mask_id) | (region != cache_ids[:, first: ids.shape[1]])  # the cache may be wider (cut x)
    needed = stale
    if shift:
        stale[:, 0] = False  # the last prompt token is recomputed only for the logits of the first generated one
        needed = stale.clone()
        needed[:, :-1] |= stale[:, 1:]
    count = needed.sum(dim=1)
    width = max(int(count.max()), 1)
    order = torch.argsort((~needed).to(torch.int8), dim=1, stable=True)[:, :width]  # needed first, each part ascending
    real = torch.arange(width, device=ids.device) < count[:, None]
    return order + first, real, real & stale.gather(1, order)


def place_logits(logits: Tensor, index: Tensor, wanted: Tensor, start: int, end: int) -> Tensor:
    """``[R, end - start, V]``: the queried logits ``[R, Q, V]`` at positions ``index`` placed into ``[start, end)``
    where ``wanted``; the other positions (committed, not recomputed) keep zeros."""
    width = end - start
    local = index - start
    slot = torch.where(wanted & (local >= 0) & (local < width), local, torch.full_like(local, width))  # width: dropped
    out = logits.new_zeros(logits.shape[0], width + 1, logits.shape[-1])
    out.scatter_(1, slot[..., None].expand_as(logits), logits)
    return out[:, :width]
