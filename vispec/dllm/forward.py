"""The model forwards of :func:`vispec.dllm.decode`: unsupervised guidance and the block KV caches.

:class:`_Forward` runs the model for the rows of the batch that the block loop (:mod:`vispec.dllm.loop`)
asks for, with the unconditional branch when guided (``ℓ = ℓ_u + s (ℓ_c - ℓ_u)``, the prompt masked), and
keeps the cache between the steps of a block.

Caches (Fast-dLLM, Wu et al., arXiv 2505.22618, §3.1; spec ``dllm.md`` §4.3):

* ``"none"``: every step is a full forward over the canvas;
* ``"prefix"``: the block's first step is a full forward that also caches every position's K/V;
  later steps forward ``x[block_start:]`` against the cached prefix;
* ``"dual"``: as ``prefix``, but later steps forward only the block, against the cached prefix *and*
  suffix (the masked future, stale within the block).

dKV-Cache-Decode (Ma et al., arXiv 2505.15781, spec ``dllm.md`` §11), ``cache="dkv"``: a committed
token's K/V are cached from the step *after* the one that commits it (delayed caching). Forward ``j`` of
a block (``j = 0, 1, ...``) is a full refresh when ``j % cache_reload_steps == 0`` (the first step of every
block, so also the first of the decode, and every ``cache_reload_steps`` steps after it); the other steps
forward only each row's masked and just-committed positions against the cached K/V of the rest. The
paper's LLaDA code also runs step ``j = 1`` in full because its cache is filled one step late; here the
step-0 refresh fills it, so step 1 is already a cached step. With ``logits_shift`` models (Dream-style:
the logits at ``p`` come from ``p - 1``) the position before each recomputed one is recomputed too. No
``compile=True`` (the recomputed set changes size every step).

Static, compiled forwards (``compile=True``, models with ``compiled_core``, as LLaDA): every forward of
the block loop runs through ``torch.compile(fullgraph=True)``, the graphs cached on the model (the
first call compiles, later calls with the same shapes reuse them). Shapes stay fixed within a decode:

* the forward always takes the whole batch (``[B, N]``, ``[2B, N]`` with guidance), not only the rows
  whose block still has masks; the finished rows' logits are discarded and they are not charged an
  NFE, so tokens and NFE are those of the eager loop (whose forwards drop finished rows);
* ``"none"``: one graph ``[B, N]``; ``"dual"``: the refresh ``[B, N]`` and the block ``[B, Lb]``, whose
  positions reach the model as an index tensor, so one graph serves every block;
* ``"prefix"``: the refresh is static, but the span ``x[:, start:]`` shrinks by ``Lb`` per block, so
  it is compiled with ``dynamic=True`` (one graph, symbolic length). Padding it to a fixed width
  instead would compute up to ``K - 1`` blocks of unused queries and change the matmul shapes, and
  so possibly the last bits of the logits, against the eager forward.
"""

from __future__ import annotations

import copy
from typing import Any, Optional

import torch
from torch import Tensor

_GUIDANCE_HINT = " (1 disables guidance; LLaDA's cfg_scale w is guidance_scale w + 1)"


def _config_id(model: Any, name: str) -> Optional[int]:
    value = getattr(getattr(model, "config", None), name, None)
    return None if value is None else int(value)


class _Forward:
    """Runs the model for a subset of rows (with the guidance branch) and keeps the block cache.

    ``key_mask`` is None when no row is padded. With ``compile`` every forward takes all rows (static
    shapes) through the model's compiled cores, and the rows' logits are picked afterwards.

    ``cache="dkv"`` (dKV-Cache-Decode, Ma et al., arXiv 2505.15781, spec ``dllm.md`` §11; :meth:`_dkv_logits`):
    forward ``j = 0, 1, ...`` of a block is a full refresh (:meth:`compute_kv_cache`, every position's K/V)
    when ``j % reload_steps == 0``, else a forward of each row's *uncached* generated positions only
    (:meth:`forward_positions`), whose fresh K/V then replace the cached ones. A position is uncached when it
    is masked or its token differs from the one its cached K/V were computed from (``cache.input_ids``):
    masked positions are always recomputed, and a token committed at forward ``j`` is recomputed once more at
    forward ``j + 1`` (its representation still moves in the step that commits it) and read from the cache
    afterwards: the paper's delayed caching. Committed tokens that a step callback edits are recomputed the
    same way.
    """

    def __init__(self, model: Any, prompt_len: int, key_mask: Optional[Tensor], guidance_scale: float, mask_id: int,
                 cache: str, compile: bool = False, reload_steps: int = 8):
        self.model, self.prompt_len, self.key_mask = model, prompt_len, key_mask
        self.guidance_scale, self.mask_id, self.cache_mode = guidance_scale, mask_id, cache
        self.guided = guidance_scale != 1.0
        self.compile = compile
        self.kwargs = {"compile": True} if compile else {}
        self.cache = None
        self.cache_rows: Optional[Tensor] = None  # batch rows the cache holds, in order
        self.reload_steps, self.forwards_in_block = reload_steps, 0  # cache="dkv" only

    def _inputs(self, x: Tensor, rows: Optional[Tensor]) -> tuple[Tensor, Optional[Tensor]]:
        """Model inputs of batch ``rows`` (None: all rows) and their key mask (None: no padding)."""
        ids = x if rows is None else x[rows]
        mask = self.key_mask if rows is None or self.key_mask is None else self.key_mask[rows]
        if mask is not None and mask.shape[1] != ids.shape[1]:
            mask = mask[:, : ids.shape[1]]  # x cut short: end-of-text truncation dropped its tail
        if self.guided:
            uncond = ids.clone()
            uncond[:, : self.prompt_len] = self.mask_id
            ids = torch.cat([ids, uncond])
            mask = None if mask is None else torch.cat([mask, mask])
        return ids, mask

    def _guide(self, logits: Tensor) -> Tensor:
        if not self.guided:
            return logits
        cond, uncond = logits.chunk(2)
        return uncond + self.guidance_scale * (cond - uncond)

    def _select_cache(self, rows: Tensor) -> None:
        """Keep the cache rows of ``rows`` (a subset of ``cache_rows``, same order)."""
        if self.cache_rows.numel() == rows.numel():
            return
        where = torch.searchsorted(self.cache_rows, rows)
        if self.guided:
            where = torch.cat([where, where + self.cache_rows.numel()])
        self.cache = self.cache.select(where)
        self.cache_rows = rows

    def split(self, rows: Tensor) -> "_Forward":
        """A forward of its own for ``rows`` (sorted, a subset of ``cache_rows``) holding a copy of their cache
        entries: with adaptive blocks rows have different spans, one forward per group of rows sharing one."""
        part = copy.copy(self)
        part._select_cache(rows)
        return part

    def set_key_mask(self, key_mask: Optional[Tensor]) -> None:
        """Replace the key mask ``[B, N]`` (True = visible; None: everything visible) and the cached rows'
        copy (cut to the cache's width): end-of-text truncation hides a row's dropped positions."""
        self.key_mask = key_mask
        if self.cache is None:
            return
        mask = None if key_mask is None else key_mask[self.cache_rows, : self.cache.seq_len]
        if mask is not None and self.guided:
            mask = torch.cat([mask, mask])
        self.cache.key_mask = mask

    def block_logits(self, x: Tensor, rows: Tensor, start: int, end: int, first_step: bool) -> Tensor:
        """Logits ``[R, end - start, V]`` of the block for batch ``rows`` (sorted)."""
        if not self.compile:
            return self._block_logits(x, rows, start, end, first_step)
        logits = self._block_logits(x, None, start, end, first_step)  # all rows: the shapes stay static
        return logits if rows.numel() == x.shape[0] else logits[rows]

    def _block_logits(self, x: Tensor, rows: Optional[Tensor], start: int, end: int, first_step: bool) -> Tensor:
        if self.cache_mode == "none":
            ids, mask = self._inputs(x, rows)
            return self._guide(self.model(ids, attention_mask=mask, **self.kwargs).logits[:, start:end])
        if self.cache_mode == "dkv":
            return self._dkv_logits(x, rows, start, end, first_step)
        if first_step:
            ids, mask = self._inputs(x, rows)
            out = self.model.compute_kv_cache(ids, attention_mask=mask, **self.kwargs)
            self.cache = out.kv_cache
            self.cache_rows = torch.arange(x.shape[0], device=x.device) if rows is None else rows
            return self._guide(out.logits[:, start:end])
        if rows is not None:
            self._select_cache(rows)
        ids, _ = self._inputs(x, rows)
        if self.cache_mode == "prefix":
            dynamic = {"dynamic": True} if self.compile else {}  # the span shrinks block after block
            logits = self.model.forward_span(ids[:, start:], start, self.cache, **self.kwargs, **dynamic).logits
            logits = logits[:, : end - start]
        else:
            logits = self.model.forward_span(ids[:, start:end], start, self.cache, **self.kwargs).logits
        return self._guide(logits)

    def _dkv_logits(self, x: Tensor, rows: Optional[Tensor], start: int, end: int, first_step: bool) -> Tensor:
        """dKV-Cache-Decode (class docstring): a full refresh, or a forward of the rows' uncached positions.

        The ragged per-row sets share one forward: each row's uncached positions come first (ascending), then
        the row is padded up to the largest count with some of its cached positions, whose queries write
        nothing and whose logits are dropped (:meth:`forward_positions`), so every row's cache and logits are
        the ones it gets alone. The block's committed positions that were not recomputed get zero logits
        (schedulers read the masked positions only, and those are always recomputed).
        """
        self.forwards_in_block = 0 if first_step else self.forwards_in_block + 1
        ids, mask = self._inputs(x, rows)
        if self.forwards_in_block % self.reload_steps == 0:
            out = self.model.compute_kv_cache(ids, attention_mask=mask)
            self.cache = out.kv_cache
            self.cache_rows = torch.arange(x.shape[0], device=x.device) if rows is None else rows
            return self._guide(out.logits[:, start:end])
        if rows is not None:
            self._select_cache(rows)
        shift = bool(getattr(getattr(self.model, "config", None), "logits_shift", False))
        index, real, wanted = _uncached_positions(ids, self.cache.input_ids, self.prompt_len, self.mask_id, shift)
        logits = self.model.forward_positions(ids.gather(1, index), index, self.cache, query_mask=real).logits
        return self._guide(_block_logits_from(logits, index, wanted, start, end))


def _uncached_positions(ids: Tensor, cache_ids: Tensor, prompt_len: int, mask_id: int,
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


def _block_logits_from(logits: Tensor, index: Tensor, wanted: Tensor, start: int, end: int) -> Tensor:
    """``[R, end - start, V]``: the queried logits ``[R, Q, V]`` at positions ``index`` placed into the block
    ``[start, end)`` where ``wanted``; the other block positions (committed, not recomputed) leave zeros."""
    width = end - start
    local = index - start
    slot = torch.where(wanted & (local >= 0) & (local < width), local, torch.full_like(local, width))  # width: dropped
    out = logits.new_zeros(logits.shape[0], width + 1, logits.shape[-1])
    out.scatter_(1, slot[..., None].expand_as(logits), logits)
    return out[:, :width]


def proposal_mask(model: Any, vocab: int, mask_id: int, device: torch.device, suppress_mask_token: bool = True) -> Tensor:
    """``[V]`` bool: the tokens never proposed as candidates, the padded embedding columns past the model's
    ``vocab_size`` and (``suppress_mask_token``) the mask token itself."""
    proposal = torch.zeros(vocab, dtype=torch.bool, device=device)
    real_vocab = _config_id(model, "vocab_size")
    if real_vocab is not None and real_vocab < vocab:
        proposal[real_vocab:] = True  # padded embedding columns belong to no token
    if suppress_mask_token and mask_id < vocab:
        proposal[mask_id] = True
    return proposal


def _token_masks(model: Any, vocab: int, mask_id: int, eos_id: Optional[int], eot_id: Optional[int], device: torch.device,
                 confidence_eos_eot_inf: bool, suppress_mask_token: bool) -> tuple[Optional[Tensor], Optional[Tensor]]:
    proposal = proposal_mask(model, vocab, mask_id, device, suppress_mask_token)
    confidence = None
    if confidence_eos_eot_inf:
        ids = [i for i in (eos_id, eot_id) if i is not None]
        if not ids:
            raise ValueError("confidence_eos_eot_inf needs eos_token_id or eot_token_id")
        confidence = torch.zeros(vocab, dtype=torch.bool, device=device)
        confidence[ids] = True
    return (proposal if bool(proposal.any()) else None), confidence
