"""Semi-autoregressive block decoding of a masked diffusion LM, with optional block KV caches.

The canvas is ``x = [prompt ; mask^L]`` (prompts left-padded, ``attention_mask`` marking real
tokens). It is split into ``K = L / Lb`` blocks decoded left to right; inside a block, each step runs
the model, and the scheduler (:mod:`vispec.dllm.schedulers`) commits some masked positions of the
block. Fixed-step policies (LLaDA's quota) run ``steps / K`` steps per block; adaptive ones run until
the block has no mask left. Steps that would commit nothing because a row's block is already
complete are skipped (LLaDA's reference spends forwards on them when ``steps / K`` exceeds the
block's masks; the tokens are the same).

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

Every forward counts one NFE for every row it serves, the cache-refreshing full forward included.

Guidance is LLaDA's unsupervised CFG (the unconditional branch masks the prompt) in vispec's one
convention (:mod:`vispec.outputs`, as the image half): ``guidance_scale = s`` mixes
``ℓ = ℓ_u + s (ℓ_c - ℓ_u)`` and ``s = 1`` means no guidance (no unconditional branch is run). LLaDA's
``cfg_scale = w`` (``ℓ = ℓ_u + (w + 1)(ℓ_c - ℓ_u)``, ``w = 0`` off) is ``guidance_scale = w + 1``: the
same arithmetic, so LLaDA's ``cfg_scale=0.5`` and vispec's ``guidance_scale=1.5`` give the same tokens.
``early_stop_eos``: once a row commits EOS, its masked positions after that EOS become EOS and it
spends no more forwards on them.

Batching: all rows share the block index (so caches refresh together), but each row commits its own
positions, keeps its own noise (Philox keyed by its seed, position and forward count) and leaves the
forward as soon as its block is complete; a row's tokens are those it would get alone.

Rules that end rows early or move block boundaries (all off by default; they compose with each other,
with every policy and every cache, and keep every row's tokens and NFE those it gets alone):

* ``eotp=True``: end-of-text prediction (Learn2PD, arXiv 2509.25188; :mod:`vispec.dllm.early_commit`).
  After each step a row's canvas may be cut after an EOS; the dropped tail reads as EOS and is never
  computed again: each forward is only as wide as the longest surviving canvas among its rows, every
  row's own dropped positions are hidden from the keys (for a bidirectional model exactly a physical
  truncation: the positions before the cut keep their RoPE ids), cached K/V keep the same mask, and the
  blocks past a row's cut cost it nothing. The EOS predictions are read where the forward computed
  logits: the whole surviving canvas without a cache, at refreshes and under ``"prefix"`` / ``"dkv"``
  (whose steps compute every masked position), only the block on ``"dual"`` block steps.
* ``early_commit=ProphetRule(...)``: Prophet (arXiv 2508.19982). A row whose mean top-2 logit gap over
  its answer region clears the progress-dependent threshold commits all its masked positions (every
  block) to this forward's candidates and stops. It is judged only on forwards that computed every
  masked position of the row (no cache, ``"prefix"``, ``"dkv"``, refreshes; ``"dual"`` block steps only
  once nothing is masked past the block), so it adds no forward.
* ``adaptive_block=AdaptiveBlocks(...)``: AdaBlock (arXiv 2509.26432; :mod:`vispec.dllm.blocks`). Each
  row's next block ends at a confident delimiter predicted by the forward that starts it (a full forward:
  the cache refresh under a cache), else after ``block_length`` positions. Rows decode their ``r``-th
  blocks in round ``r`` and wait for each other between rounds, so refreshes stay shared; under
  ``"prefix"`` / ``"dual"`` the rows of each distinct block get their own copy of the cache and their own
  span forward (one forward per group; each still counts one NFE per row it serves).

:func:`decode` returns a :class:`vispec.outputs.DecodeOutput` like the image decoders
(:func:`vispec.decoding.decode`): ``tokens [B, gen_length]`` (the generated canvas, prompt excluded),
per-row :class:`vispec.outputs.DecodeStats` (NFE, tokens before the first EOS, EOS and EoT excluded:
spec §16.4, latency), ``method`` (the scheduler's strategy name) and ``labels`` (scheduler class and
cache). A step callback receives a :class:`vispec.outputs.DecodeProgress` after every forward; like
diffusers' ``LLaDA2Pipeline``, which applies a block its step-end callback returns, it may return an edit
(``{"tokens": canvas}`` and / or ``{"guidance_scale": s}``, :func:`decode`) or raise :class:`StopDecoding`
to end early with what is done. Logits with NaN raise ``ValueError`` at the end of their block (one
read-back per block) instead of leaving the canvas masked.

Model protocol: ``model(input_ids, attention_mask).logits`` (``[B, N, V]``) and ``model.config`` with
``mask_token_id`` (and ``eos_token_id``, ``eot_token_id``, ``vocab_size``, ``max_sequence_length``
when present); the caches also need ``compute_kv_cache`` / ``forward_span`` and a cache with
``select`` (:class:`vispec.models.llada.LLaDAModelLM`). ``attention_mask`` is None when no prompt
is padded (checked once, before the block loop: the forwards themselves read nothing back).

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
import time
from typing import Any, Optional

import torch
from torch import Tensor

from vispec.checks import check_int, check_number
from vispec.dllm.blocks import AdaptiveBlocks, to_canvas, window_index, window_logits, window_tokens
from vispec.dllm.early_commit import ProphetRule, end_of_text_cut, top2_gap, truncate
from vispec.dllm.schedulers import UnmaskingScheduler, UnmaskNoise
from vispec.kernels.philox import GeneratorArg, per_sample_seeds
from vispec.kernels.unmask import RowNoise, unmask_candidates
from vispec.outputs import UNDECIDED, DecodeOutput, DecodeProgress, DecodeStats, StepCallback, committed_view
from vispec.sampling import STATUS_NAN, STATUS_OK, raise_status

CACHES = ("none", "prefix", "dual", "dkv")

_GUIDANCE_HINT = " (1 disables guidance; LLaDA's cfg_scale w is guidance_scale w + 1)"


class StopDecoding(Exception):
    """Raised by a step callback to end decoding early: :func:`decode` returns the canvas so far (the mask id
    where undecided), the statistics of the forwards run, and ``labels["interrupted"] = True``."""


def _config_id(model: Any, name: str) -> Optional[int]:
    value = getattr(getattr(model, "config", None), name, None)
    return None if value is None else int(value)


def check_decode_args(model: Any, input_ids: Tensor, attention_mask: Optional[Tensor], gen_length: int, block_length: int,
                      temperature: float, guidance_scale: float, cache: str, mask_token_id: Optional[int],
                      compile: bool = False, cache_reload_steps: int = 8) -> int:
    """Validate :func:`decode`'s arguments (errors name the argument); returns the mask id."""
    if not isinstance(input_ids, Tensor) or input_ids.dim() != 2 or input_ids.shape[1] < 1 or input_ids.dtype != torch.long:
        raise ValueError(f"input_ids must be a LongTensor [batch, prompt_length >= 1], got "
                         f"{tuple(input_ids.shape) if isinstance(input_ids, Tensor) else type(input_ids).__name__}")
    if attention_mask is not None and tuple(attention_mask.shape) != tuple(input_ids.shape):
        raise ValueError(f"attention_mask must have the shape of input_ids {tuple(input_ids.shape)}, got {tuple(attention_mask.shape)}")
    check_int("gen_length", gen_length, minimum=1)
    check_int("block_length", block_length, minimum=1)
    if gen_length % block_length:
        raise ValueError(f"gen_length ({gen_length}) must be a multiple of block_length ({block_length})")
    check_number("temperature", temperature, minimum=0, hint=" (0 means arg-max candidates)")
    check_number("guidance_scale", guidance_scale, minimum=1, hint=_GUIDANCE_HINT)
    if cache not in CACHES:
        raise ValueError(f"cache must be one of {CACHES}, got {cache!r}")
    if cache != "none" and not hasattr(model, "compute_kv_cache"):
        raise ValueError(f"cache={cache!r} needs a model with compute_kv_cache/forward_span, got {type(model).__name__}")
    if not isinstance(compile, bool):
        raise ValueError(f"compile must be True or False, got {compile!r}")
    if compile and not hasattr(model, "compiled_core"):
        raise ValueError(f"compile=True needs a model with static, compilable forwards (compiled_core), "
                         f"got {type(model).__name__}")
    check_int("cache_reload_steps", cache_reload_steps, minimum=1,
              hint=" (cache='dkv': a full forward refreshes every cached K/V every that many steps of a block)")
    if cache == "dkv":
        if not hasattr(model, "forward_positions"):
            raise ValueError(f"cache='dkv' needs a model with compute_kv_cache/forward_positions, got {type(model).__name__}")
        if compile:
            raise ValueError("compile=True does not support cache='dkv': its set of recomputed positions changes size "
                             "every step (no static shapes); pass compile=False")
    mask_id = mask_token_id if mask_token_id is not None else _config_id(model, "mask_token_id")
    if mask_id is None:
        raise ValueError("mask_token_id is needed (the model config has none)")
    pad_id = _config_id(model, "pad_token_id")
    if pad_id is not None and pad_id == mask_id:
        raise ValueError(f"the model's pad_token_id equals mask_token_id ({mask_id}); padding would read as masks")
    context = _config_id(model, "max_sequence_length")
    if context is not None and input_ids.shape[1] + gen_length > context:
        raise ValueError(f"prompt length {input_ids.shape[1]} + gen_length {gen_length} exceeds the model's context "
                         f"of {context} tokens")
    return mask_id


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


def _token_masks(model: Any, vocab: int, mask_id: int, eos_id: Optional[int], eot_id: Optional[int], device: torch.device,
                 confidence_eos_eot_inf: bool, suppress_mask_token: bool) -> tuple[Optional[Tensor], Optional[Tensor]]:
    proposal = torch.zeros(vocab, dtype=torch.bool, device=device)
    real_vocab = _config_id(model, "vocab_size")
    if real_vocab is not None and real_vocab < vocab:
        proposal[real_vocab:] = True  # padded embedding columns belong to no token
    if suppress_mask_token and mask_id < vocab:
        proposal[mask_id] = True
    confidence = None
    if confidence_eos_eot_inf:
        ids = [i for i in (eos_id, eot_id) if i is not None]
        if not ids:
            raise ValueError("confidence_eos_eot_inf needs eos_token_id or eot_token_id")
        confidence = torch.zeros(vocab, dtype=torch.bool, device=device)
        confidence[ids] = True
    return (proposal if bool(proposal.any()) else None), confidence


@torch.no_grad()
def decode(
    model: Any,
    input_ids: Tensor,
    attention_mask: Optional[Tensor] = None,
    *,
    scheduler: UnmaskingScheduler,
    gen_length: int = 128,
    block_length: int = 128,
    steps: Optional[int] = None,
    temperature: float = 0.0,
    guidance_scale: float = 1.0,
    cache: str = "none",
    mask_token_id: Optional[int] = None,
    eos_token_id: Optional[int] = None,
    eot_token_id: Optional[int] = None,
    logits_eos_inf: bool = False,
    confidence_eos_eot_inf: bool = False,
    early_stop_eos: bool = False,
    suppress_mask_token: bool = True,
    generator: GeneratorArg = None,
    callback: Optional[StepCallback] = None,
    compile: bool = False,
    cache_reload_steps: int = 8,
    eotp: bool = False,
    early_commit: Optional[ProphetRule] = None,
    adaptive_block: Optional[AdaptiveBlocks] = None,
) -> DecodeOutput:
    """Decode ``gen_length`` tokens after each prompt (module docstring).

    Args:
        input_ids: ``[B, P]`` left-padded prompts; ``attention_mask [B, P]`` marks real tokens.
        scheduler: the unmasking policy; ``steps`` (total over blocks) is required by fixed-step ones.
        temperature: 0 for arg-max candidates, else float64 Gumbel-max sampling.
        guidance_scale: unsupervised CFG scale ``s >= 1``, ``ℓ = ℓ_u + s (ℓ_c - ℓ_u)``; 1 = off. LLaDA's
            ``cfg_scale = w`` is ``guidance_scale = w + 1``.
        cache: ``"none"``, ``"prefix"``, ``"dual"`` (Fast-dLLM) or ``"dkv"`` (dKV-Cache-Decode, module docstring).
        logits_eos_inf: never propose EOS. ``confidence_eos_eot_inf``: rank EOS/EoT proposals last.
        early_stop_eos: fill the masked positions after a committed EOS with EOS.
        suppress_mask_token: never propose the mask token (nor padded embedding columns).
        generator: one ``torch.Generator`` or a list with one per row.
        callback: ``callback(progress)`` after every forward, ``progress`` a :class:`vispec.outputs.DecodeProgress`:
            ``step`` (global), ``num_committed [B]`` (committed generated tokens per row), ``tokens [B, gen_length]``
            (the canvas, :data:`vispec.outputs.UNDECIDED` where still masked) and ``details`` with ``block``,
            ``step_in_block``, ``rows`` (batch rows that took part) and ``transfer_index [R, Lb]`` (all copies).
            It may return None or an edit, applied before the next forward: ``"tokens"``, a new canvas
            ``[B, gen_length]`` (committed tokens may change and undecided positions may be committed;
            :data:`~vispec.outputs.UNDECIDED` where still undecided; re-masking a committed position is an
            error), and ``"guidance_scale"`` (only when decoding started guided, ``!= 1``: the unconditional
            branch and its cache rows exist from the start). An edited earlier block reaches the cached K/V at the
            next cache refresh, as Fast-dLLM's approximation has it. Raising :class:`StopDecoding` ends decoding
            with what is done (``labels["interrupted"] = True``).
        compile: run the model's forwards through ``torch.compile(fullgraph=True)`` with static shapes
            (module docstring: every forward takes the whole batch; ``"prefix"`` spans are compiled with
            ``dynamic=True`` since they shrink block after block). The graphs are cached on the model: the
            first call compiles (about a minute per graph on a CPU), later calls reuse them. Tokens and NFE
            equal the eager loop's up to float rounding of the fused kernels. Eager (False) is the default.
            Not with ``cache="dkv"``.
        cache_reload_steps: ``cache="dkv"`` only (checked always): an integer ``R >= 1``; forward ``j`` of a
            block refreshes every cached K/V with a full forward when ``j % R == 0`` (the paper's
            ``cache_reloading_step``, 8 for LLaDA, 4 for Dream). ``R = 1`` is ``cache="none"``. Committed tokens
            that a callback edits are recomputed at the next forward under ``"dkv"``.
        eotp: end-of-text prediction (module docstring); needs an EOS id. Stats gain ``canvas_length`` (each
            row's surviving canvas) and labels ``"eotp": True``.
        early_commit: None or a :class:`vispec.dllm.early_commit.ProphetRule` (module docstring). Stats gain
            ``early_committed`` (1 where the rule finished the row), labels ``"early_commit": "prophet"``.
        adaptive_block: None or a :class:`vispec.dllm.blocks.AdaptiveBlocks` (module docstring; delimiter ids
            come from the tokenizer); ``block_length`` is the initial block size ``B`` (``gen_length`` stays a
            multiple of it, and fixed-step policies keep ``steps / (gen_length / block_length)`` steps per
            block). Stats gain ``blocks`` (blocks per row), labels ``"adaptive_block": True``; the callback's
            ``details`` gain ``block_start`` and ``block_end`` (``[R]`` generated positions) and ``block`` is the
            round. ``eotp`` and ``adaptive_block`` need ``compile=False`` (their shapes change step by step);
            ``adaptive_block`` cannot drive the Learn2PD policy (its filter reads ``block_length`` inputs).

    Returns:
        :class:`vispec.outputs.DecodeOutput`: ``tokens [B, gen_length]``, per-row ``stats``, ``method`` (the
        scheduler's strategy name) and ``labels`` ``{"scheduler": class name, "cache": cache}``.
    """
    mask_id = check_decode_args(model, input_ids, attention_mask, gen_length, block_length, temperature, guidance_scale,
                                cache, mask_token_id, compile, cache_reload_steps)
    eos_id = eos_token_id if eos_token_id is not None else _config_id(model, "eos_token_id")
    eot_id = eot_token_id if eot_token_id is not None else _config_id(model, "eot_token_id")
    for flag, name in ((early_stop_eos, "early_stop_eos"), (logits_eos_inf, "logits_eos_inf")):
        if flag and eos_id is None:
            raise ValueError(f"{name} needs an eos_token_id (the model config has none)")
    _check_rules(model, scheduler, eotp, early_commit, adaptive_block, eos_id, mask_id, gen_length, compile)
    scheduler.set_timesteps(steps, gen_length, block_length)
    device = input_ids.device
    batch, prompt_len = input_ids.shape
    x = torch.cat([input_ids, torch.full((batch, gen_length), mask_id, dtype=torch.long, device=device)], dim=1)
    prompt_mask = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.to(device).bool()
    key_mask = torch.cat([prompt_mask, torch.ones(batch, gen_length, dtype=torch.bool, device=device)], dim=1)
    if bool(prompt_mask.all()):  # the one read-back about padding, before the loop: unpadded forwards take no mask
        key_mask = None
    seeds = per_sample_seeds(generator, batch, device)
    forward = _Forward(model, prompt_len, key_mask, float(guidance_scale), mask_id, cache, compile, cache_reload_steps)
    loop = _BlockLoop(x, forward, scheduler, seeds, model=model, gen_length=gen_length, block_length=block_length,
                      temperature=temperature, mask_id=mask_id, eos_id=eos_id, eot_id=eot_id,
                      logits_eos_inf=logits_eos_inf, confidence_eos_eot_inf=confidence_eos_eot_inf,
                      suppress_mask_token=suppress_mask_token, early_stop_eos=early_stop_eos, callback=callback,
                      cuts=_Cuts(prompt_mask, gen_length) if eotp else None, early_commit=early_commit,
                      adaptive_block=adaptive_block)
    loop.run()
    return loop.output(scheduler, cache)


def _check_rules(model: Any, scheduler: UnmaskingScheduler, eotp: bool, early_commit: Optional[ProphetRule],
                 adaptive_block: Optional[AdaptiveBlocks], eos_id: Optional[int], mask_id: int, gen_length: int,
                 compile: bool) -> None:
    """Validate :func:`decode`'s ``eotp``, ``early_commit`` and ``adaptive_block`` (errors name the argument)."""
    if not isinstance(eotp, bool):
        raise ValueError(f"eotp must be True or False, got {eotp!r}")
    if eotp and eos_id is None:
        raise ValueError("eotp needs an eos_token_id (the model config has none)")
    if early_commit is not None:
        if not isinstance(early_commit, ProphetRule):
            raise ValueError(f"early_commit must be None or a ProphetRule, got {type(early_commit).__name__}")
        early_commit.check_length(gen_length)
    if adaptive_block is not None:
        if not isinstance(adaptive_block, AdaptiveBlocks):
            raise ValueError(f"adaptive_block must be None or an AdaptiveBlocks, got {type(adaptive_block).__name__}")
        adaptive_block.check_ids(_config_id(model, "vocab_size"), mask_id)
        if getattr(scheduler, "strategy", "") == "learn2pd":
            raise ValueError("adaptive_block cannot run with the learn2pd policy: its filter reads exactly "
                             "block_length confidences per block")
    if compile and (eotp or adaptive_block is not None):
        raise ValueError("compile=True needs static shapes; eotp (the canvas shrinks) and adaptive_block (blocks "
                         "change length) need compile=False")


class _Cuts:
    """End-of-text truncation state (:mod:`vispec.dllm.early_commit`): each row's canvas length, on the device
    and mirrored on the host (one read-back per forward), and the key mask that hides the dropped tails."""

    def __init__(self, prompt_mask: Tensor, gen_length: int):
        batch, self.prompt_len = prompt_mask.shape
        device = prompt_mask.device
        self.length = torch.full((batch,), gen_length, dtype=torch.long, device=device)
        self.host = torch.full((batch,), gen_length, dtype=torch.long)
        self.padded = ~prompt_mask.all(dim=1).cpu()
        self.visible = torch.cat([prompt_mask, torch.ones(batch, gen_length, dtype=torch.bool, device=device)], dim=1)
        self.positions = torch.arange(self.visible.shape[1], device=device)

    def width(self, rows_h: Tensor) -> int:
        """The forward's width: prompt plus the longest surviving canvas among ``rows_h``."""
        return self.prompt_len + int(self.host[rows_h].max())

    def key_mask(self, rows_h: Tensor, extent: int) -> Optional[Tensor]:
        """``[B, N]`` key mask for a forward of ``rows_h`` over ``extent`` keys, None when it would hide nothing
        (no padding, no row's canvas shorter than the keys), so an unpadded row alone takes the unmasked path."""
        if not bool((self.padded[rows_h] | (self.host[rows_h] + self.prompt_len < extent)).any()):
            return None
        return self.visible & (self.positions < self.prompt_len + self.length[:, None])

    def update(self, rows: Tensor, rows_h: Tensor, length: Tensor) -> None:
        self.length[rows] = length
        self.host[rows_h] = length.cpu()


class _BlockLoop:
    """One decode's state and its semi-autoregressive loop (:func:`decode`).

    Rounds: in round ``r`` every row decodes its ``r``-th block ``[start, end)`` (generated positions; fixed:
    ``[r Lb, (r + 1) Lb)`` for all rows; adaptive: from where its last block ended, AdaBlock's length) and rows
    wait for each other between rounds, so caches refresh together. Within a round, step ``i`` forwards every
    row whose block still has masks (one forward, or one per group of rows sharing a span when adaptive blocks
    run under the prefix / dual cache), lets the policy commit inside each row's block, then applies the
    optional rules: Prophet's early commit and end-of-text truncation.
    """

    def __init__(self, x: Tensor, forward: _Forward, scheduler: UnmaskingScheduler, seeds: Tensor, *, model: Any,
                 gen_length: int, block_length: int, temperature: float, mask_id: int, eos_id: Optional[int],
                 eot_id: Optional[int], logits_eos_inf: bool, confidence_eos_eot_inf: bool, suppress_mask_token: bool,
                 early_stop_eos: bool, callback: Optional[StepCallback], cuts: Optional[_Cuts],
                 early_commit: Optional[ProphetRule], adaptive_block: Optional[AdaptiveBlocks]):
        self.x, self.forward, self.scheduler, self.seeds, self.model = x, forward, scheduler, seeds, model
        self.gen_length, self.block_length, self.temperature = gen_length, block_length, float(temperature)
        self.mask_id, self.eos_id, self.eot_id = mask_id, eos_id, eot_id
        self.logits_eos_inf, self.confidence_eos_eot_inf = logits_eos_inf, confidence_eos_eot_inf
        self.suppress_mask_token, self.early_stop_eos, self.callback = suppress_mask_token, early_stop_eos, callback
        self.cuts, self.early_commit, self.adaptive = cuts, early_commit, adaptive_block
        batch, device = x.shape[0], x.device
        self.prompt_len = x.shape[1] - gen_length
        self.positions = torch.arange(gen_length, device=device)
        self.nfe = torch.zeros(batch, dtype=torch.long, device=device)
        self.finished_at = torch.full((batch,), float("nan"), dtype=torch.float64)
        self.masked_at_start = torch.zeros(batch, dtype=torch.long, device=device)
        self.starts = torch.zeros(batch, dtype=torch.long, device=device)  # each row's block, generated positions
        self.ends = torch.zeros(batch, dtype=torch.long, device=device)
        self.starts_h, self.ends_h = torch.zeros(batch, dtype=torch.long), torch.zeros(batch, dtype=torch.long)
        self.fixed_block: Optional[tuple[int, int]] = None  # the round's block when every row shares it
        self.splits: Optional[dict] = None  # (start, end) -> _Forward: adaptive blocks under prefix / dual caches
        self.early = torch.zeros(batch, dtype=torch.bool, device=device)  # rows Prophet finished
        self.blocks = torch.zeros(batch, dtype=torch.long, device=device)  # blocks decoded per row
        self.masks: Optional[tuple] = None
        self.nan = torch.zeros((), dtype=torch.bool, device=device)  # NaN logits seen so far (read once a round)
        self.global_step, self.interrupted, self.start_time = 0, False, time.perf_counter()

    # ------------------------------------------------------------------ rounds
    def run(self) -> None:
        index = 0
        while not self.interrupted and self._round(index):
            raise_status(torch.where(self.nan, STATUS_NAN, STATUS_OK))  # one read-back per round
            index += 1

    def _round(self, index: int) -> bool:
        """Round ``index`` (class docstring); False when there was nothing left to decode."""
        if self.adaptive is None:
            if index == self.gen_length // self.block_length:
                return False
            start = index * self.block_length
            self.fixed_block = (start, start + self.block_length)
            self.starts.fill_(start)
            self.ends.fill_(start + self.block_length)
            self.masked_at_start = (self.x[:, self.prompt_len + start: self.prompt_len + start + self.block_length]
                                    == self.mask_id).sum(dim=1)
            cap = self.scheduler.steps_per_block if self.scheduler.fixed_steps else self.block_length
        else:  # the next block starts where the last one ended; its end comes from the round's first forward
            self.starts, self.starts_h = self.ends.clone(), self.ends_h.clone()
            cap = self.scheduler.steps_per_block if self.scheduler.fixed_steps else self.gen_length
        self.splits = None
        ran = False
        for step in range(cap):  # adaptive policies commit >= 1 token per step: a block's width always suffices
            masked = self.x[:, self.prompt_len:] == self.mask_id
            if not (self.adaptive is not None and step == 0):  # adaptive: every row with masks starts a block
                masked &= (self.positions >= self.starts[:, None]) & (self.positions < self.ends[:, None])
            rows = masked.any(dim=1).nonzero().squeeze(1)
            if rows.numel() == 0:
                break
            ran = True
            for group, forward in self._groups(rows, step):
                self._advance(group, forward, step, index)
                if self.interrupted:
                    return True
        return ran or self.adaptive is None

    def _groups(self, rows: Tensor, step: int) -> list[tuple[Tensor, _Forward]]:
        """The forwards of a step: one for all ``rows``, or one per block when adaptive blocks split the cache."""
        if self.splits is None or step == 0:
            return [(rows, self.forward)]
        rows_h = rows.cpu()
        groups = []
        for (start, end), forward in self.splits.items():
            pick = (self.starts_h[rows_h] == start) & (self.ends_h[rows_h] == end)
            if bool(pick.any()):
                groups.append((rows[pick.to(rows.device)], forward))
        return groups

    def _split(self, rows: Tensor) -> None:
        """After the round's refreshing forward: rows with different blocks get separate prefix / dual caches."""
        rows_h = rows.cpu()
        keys = torch.stack([self.starts_h[rows_h], self.ends_h[rows_h]], dim=1).unique(dim=0).tolist()
        if len(keys) == 1:
            return
        self.splits = {}
        for start, end in keys:
            pick = (self.starts_h[rows_h] == start) & (self.ends_h[rows_h] == end)
            self.splits[(start, end)] = self.forward.split(rows[pick.to(rows.device)])
        self.forward.cache, self.forward.cache_rows = None, None  # the next round refreshes anyway

    # ------------------------------------------------------------------ one forward
    def _advance(self, rows: Tensor, forward: _Forward, step: int, index: int) -> None:
        """One forward for ``rows`` (sorted), the policy's commit in each row's block, and the rules."""
        P = self.prompt_len
        rows_h = rows.cpu() if self.cuts is not None or self.adaptive is not None else None
        choose_blocks = self.adaptive is not None and step == 0
        rules = self.cuts is not None or self.early_commit is not None or self.adaptive is not None
        logits, first = self._forward(rows, rows_h, forward, step, whole=rules)  # the rules read beyond the block
        canvas = self.x[rows, P:]
        masked = canvas == self.mask_id
        computed = (self.positions >= first) & (self.positions < first + logits.shape[1])
        candidates = confidence = None
        if self.cuts is not None or self.early_commit is not None or choose_blocks:
            candidates, confidence = self._candidates(logits, first, masked & computed, rows)
        if step == 0:
            self.blocks[rows] += 1
        if choose_blocks:
            self._choose_blocks(rows, rows_h, forward, masked, candidates, confidence)
        out, accepted, canvas = self._commit(logits, first, rows, rows_h, canvas, step)
        if self.cuts is not None:
            canvas = self._truncate(rows, rows_h, accepted, canvas, candidates, confidence)
            masked &= self.positions < self.cuts.length[rows][:, None]  # the dropped tail is no longer the row's
        if self.early_commit is not None:
            fire = self._prophet(logits, first, rows, masked, computed)
            fill = fire[:, None] & (canvas == self.mask_id)
            canvas = torch.where(fill, candidates, canvas)
            self.early[rows] |= fire
            if self.cuts is not None:  # an EOS among the early-committed tokens ends the canvas too
                canvas = self._truncate(rows, rows_h, fill, canvas, None, None)
        self.x[rows, P:] = canvas
        self.nfe[rows] += 1
        if self.early_stop_eos:
            _fill_after_eos(self.x, rows, P, self.eos_id, self.mask_id)
        done = rows[~(self.x[rows, P:] == self.mask_id).any(dim=1)]
        self.finished_at[done.cpu()] = time.perf_counter() - self.start_time
        self.global_step += 1
        if self.callback is not None:
            self._report(rows, out, step, index, logits.shape[-1])

    def _choose_blocks(self, rows: Tensor, rows_h: Tensor, forward: _Forward, masked: Tensor, candidates: Tensor,
                       confidence: Tensor) -> None:
        """AdaBlock (:meth:`AdaptiveBlocks.block_ends`) from the round's first, full forward: the rows' block ends,
        their masked counts (the quota policies' ``M``), and under the prefix / dual cache one cache per block."""
        L = self.gen_length
        cut = self.cuts.length[rows] if self.cuts is not None else torch.full_like(rows, L)
        ends = self.adaptive.block_ends(self.starts[rows], cut, L, self.block_length, candidates, confidence)
        self.ends[rows] = ends
        self.ends_h[rows_h] = ends.cpu()
        in_block = (self.positions >= self.starts[rows][:, None]) & (self.positions < ends[:, None])
        self.masked_at_start[rows] = (masked & in_block).sum(dim=1)
        if forward.cache_mode in ("prefix", "dual"):
            self._split(rows)

    def _forward(self, rows: Tensor, rows_h: Optional[Tensor], forward: _Forward, step: int,
                 whole: bool) -> tuple[Tensor, int]:
        """Logits ``[R, T, V]`` of the generated positions ``[first, first + T)`` and ``first``.

        ``whole``: everything the forward computes after the prompt (full forwards: the surviving canvas;
        prefix: from the block on; dual: the block; dKV: the canvas, zeros where a cached committed position
        was not recomputed), else the (fixed) block only. End-of-text truncation cuts the forward to the
        longest surviving canvas among ``rows`` and hides each row's own dropped tail from the keys.
        """
        P, N = self.prompt_len, self.x.shape[1]
        first_step = step == 0 or forward.cache_rows is None
        width = N if self.cuts is None else self.cuts.width(rows_h)
        span = not first_step and forward.cache_mode != "none"
        x_width = width
        if span and forward.cache_mode == "dkv" and forward.cache is not None:
            x_width = forward.cache.seq_len  # dKV compares the canvas with its cached tokens position by position
        if self.cuts is not None:
            extent = forward.cache.seq_len if span and forward.cache is not None else x_width
            forward.set_key_mask(self.cuts.key_mask(rows_h, extent))
        if self.adaptive is None:
            start, end = P + self.fixed_block[0], P + self.fixed_block[1]
        else:  # a span forward serves rows of one block (split forwards); a full forward needs only `whole`
            start, end = P + int(self.starts_h[rows_h[0]]), P + int(self.ends_h[rows_h[0]])
        if not whole:
            lo, hi = start, min(end, width)
        elif span and forward.cache_mode in ("prefix", "dual"):
            lo, hi = start, (width if forward.cache_mode == "prefix" else min(end, width))
        else:
            lo, hi = P, width
        logits = forward.block_logits(self.x[:, :x_width], rows, lo, hi, first_step=first_step)
        self.nan |= torch.isnan(logits).any()
        if self.logits_eos_inf:  # as LLaDA: EOS is gone from the logits, for the proposal and the confidence
            logits[..., self.eos_id] = float("-inf")
        if self.masks is None:
            self.masks = _token_masks(self.model, logits.shape[-1], self.mask_id, self.eos_id, self.eot_id,
                                      self.x.device, self.confidence_eos_eot_inf, self.suppress_mask_token)
        return logits, lo - P

    def _commit(self, logits: Tensor, first: int, rows: Tensor, rows_h: Optional[Tensor], canvas: Tensor,
                step: int) -> tuple[Any, Tensor, Tensor]:
        """The policy's step on each row's block window; returns its output, the ``[R, L]`` positions that count
        as accepted for end-of-text prediction, and the canvas after the commit."""
        L = self.gen_length
        if self.adaptive is None:
            width = self.block_length
        else:
            width = int((self.ends_h[rows_h] - self.starts_h[rows_h]).max())
        index, valid = window_index(self.starts[rows], self.ends[rows], width)
        local = None if self.adaptive is not None else self.fixed_block[0] - first
        if local is not None and local >= 0 and local + width <= logits.shape[1]:
            block = logits[:, local: local + width]  # every row shares the block: a view, no copy
        else:
            block = window_logits(logits, first, index, valid)
        sample = window_tokens(canvas, index, valid, filler=-1)  # -1: never the mask id, so never committed
        noise = UnmaskNoise(self.seeds[rows], index, self.nfe[rows])  # keyed by the generated position
        out = self.scheduler.step(block, step, sample, mask_token_id=self.mask_id, temperature=self.temperature,
                                  noise=noise, num_masked_at_block_start=self.masked_at_start[rows],
                                  proposal_mask=self.masks[0], confidence_mask=self.masks[1])
        written = to_canvas(valid, index, valid, L, False)
        canvas = torch.where(written, to_canvas(out.prev_sample, index, valid, L, -1), canvas)
        accepted = out.accepted if out.accepted is not None else out.transfer_index
        return out, to_canvas(accepted & valid, index, valid, L, False), canvas

    def _truncate(self, rows: Tensor, rows_h: Tensor, accepted: Tensor, canvas: Tensor, candidates: Optional[Tensor],
                  confidence: Optional[Tensor]) -> Tensor:
        """End-of-text prediction (:func:`end_of_text_cut`): the rows' new canvas lengths, and the canvas with the
        dropped tails set to EOS. Without ``candidates`` only an accepted EOS cuts."""
        masked = canvas == self.mask_id
        if candidates is None:
            masked, candidates, confidence = torch.zeros_like(masked), canvas, canvas.double()
        cut = end_of_text_cut(self.cuts.length[rows], accepted, canvas, masked, candidates, confidence, self.eos_id)
        self.cuts.update(rows, rows_h, cut)
        return truncate(canvas, cut, self.eos_id)

    def _candidates(self, logits: Tensor, first: int, want: Tensor, rows: Tensor) -> tuple[Tensor, Tensor]:
        """``[R, L]`` candidates and their confidences ``softmax(ℓ)[x̂]`` (float64) at the positions ``want``
        (``-1`` / ``-inf`` elsewhere), with the policy's noise keys, so they are the candidates the policy
        draws at those positions in this step."""
        width = logits.shape[1]
        flat = want[:, first: first + width].reshape(-1).nonzero().squeeze(1)
        b, j = flat // width, flat % width
        noise = None
        if self.temperature > 0:
            noise = RowNoise(self.seeds[rows][b], j + first, self.nfe[rows][b])
        cand = unmask_candidates(logits, self.temperature, None, self.masks[0], None, noise=noise, rows=flat)
        tokens = torch.full(want.shape, -1, dtype=torch.long, device=want.device)
        tokens[b, j + first] = cand.tokens
        confidence = torch.full(want.shape, float("-inf"), dtype=torch.float64, device=want.device)
        confidence[b, j + first] = cand.confidence
        return tokens, confidence

    def _prophet(self, logits: Tensor, first: int, rows: Tensor, masked: Tensor, computed: Tensor) -> Tensor:
        """``[R]`` rows whose answer region has converged (:class:`ProphetRule`)."""
        region = self.early_commit.region(masked) & computed
        b, j = region[:, first: first + logits.shape[1]].nonzero(as_tuple=True)
        gap = torch.zeros(region.shape, dtype=torch.float64, device=region.device)
        gap[b, j + first] = top2_gap(logits[b, j], self.masks[0])
        cut = self.cuts.length[rows] if self.cuts is not None else torch.full_like(rows, self.gen_length)
        return self.early_commit.fires(gap, region, masked, cut, computed.expand_as(masked))

    def _report(self, rows: Tensor, out: Any, step: int, index: int, vocab: int) -> None:
        """The step callback (:func:`decode`'s ``callback``), and its edit."""
        canvas = self.x[:, self.prompt_len:]
        decided = canvas != self.mask_id
        details = {"block": index, "step_in_block": step, "rows": rows.clone(),
                   "transfer_index": out.transfer_index.clone()}
        if self.adaptive is not None:
            details.update(block_start=self.starts[rows].clone(), block_end=self.ends[rows].clone())
        try:
            edit = self.callback(DecodeProgress(step=self.global_step - 1, num_committed=decided.sum(dim=1),
                                                tokens=committed_view(canvas, decided), details=details))
        except StopDecoding:
            self.interrupted = True
            return
        if edit is not None:
            _apply_edit(edit, self.x, self.prompt_len, self.mask_id, vocab, self.forward)
            for part in (self.splits or {}).values():
                part.guidance_scale = self.forward.guidance_scale

    # ------------------------------------------------------------------ result
    def output(self, scheduler: UnmaskingScheduler, cache: str) -> DecodeOutput:
        elapsed = time.perf_counter() - self.start_time
        finished_at = torch.where(torch.isnan(self.finished_at), torch.full_like(self.finished_at, elapsed),
                                  self.finished_at)
        tokens = self.x[:, self.prompt_len:]
        if self.cuts is not None:  # an edit may have touched a dropped tail: it reads as EOS
            tokens = truncate(tokens, self.cuts.length, self.eos_id)
        extra = {}
        labels = {"scheduler": type(scheduler).__name__, "cache": cache}
        if self.cuts is not None:
            extra["canvas_length"] = self.cuts.length.cpu()
            labels["eotp"] = True
        if self.early_commit is not None:
            extra["early_committed"] = self.early.long().cpu()
            labels["early_commit"] = "prophet"
        if self.adaptive is not None:
            extra["blocks"] = self.blocks.cpu()
            labels["adaptive_block"] = True
        if self.interrupted:
            labels["interrupted"] = True
        stats = DecodeStats(nfe=self.nfe.cpu(), tokens=count_tokens(tokens, self.eos_id, self.eot_id).cpu(),
                            latency_s=finished_at, extra=extra)
        method = getattr(scheduler, "strategy", "") or type(scheduler).__name__
        return DecodeOutput(tokens=tokens, stats=stats, method=method, labels=labels)


def _apply_edit(edit: Any, x: Tensor, prompt_len: int, mask_id: int, vocab: int, forward: _Forward) -> None:
    """Apply a step callback's edit (:func:`decode`'s ``callback``) to the canvas ``x`` and the guidance scale."""
    if not isinstance(edit, dict) or set(edit) - {"tokens", "guidance_scale"}:
        raise ValueError(f"a step callback returns None or a dict with 'tokens' and / or 'guidance_scale', got {edit!r}")
    if "guidance_scale" in edit:
        scale = check_number("guidance_scale", edit["guidance_scale"], minimum=1, hint=_GUIDANCE_HINT)
        if not forward.guided:
            raise ValueError("guidance_scale can change during decoding only when decoding started with guidance "
                             "(guidance_scale != 1): the unconditional branch is set up at the start")
        forward.guidance_scale = float(scale)
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


def _fill_after_eos(x: Tensor, rows: Tensor, prompt_len: int, eos_id: int, mask_id: int) -> None:
    """Early stop: masked positions after each row's first committed EOS become EOS."""
    canvas = x[rows, prompt_len:]
    is_eos = canvas == eos_id
    after = is_eos.long().cumsum(dim=1) - is_eos.long() > 0  # strictly after the first EOS
    x[rows, prompt_len:] = torch.where(after & (canvas == mask_id), torch.full_like(canvas, eos_id), canvas)


def count_tokens(sequences: Tensor, eos_id: Optional[int], eot_id: Optional[int]) -> Tensor:
    """Generated tokens per row before the first EOS, EOS and EoT excluded (spec ``dllm.md`` §16.4)."""
    keep = torch.ones_like(sequences, dtype=torch.bool)
    if eos_id is not None:
        keep &= (sequences == eos_id).long().cumsum(dim=1) == 0
    if eot_id is not None:
        keep &= sequences != eot_id
    return keep.sum(dim=1)
