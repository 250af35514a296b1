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

import time
from typing import Any, Optional

import torch
from torch import Tensor

from vispec.checks import check_int, check_number
from vispec.dllm.schedulers import UnmaskingScheduler, UnmaskNoise
from vispec.kernels.philox import GeneratorArg, per_sample_seeds
from vispec.outputs import UNDECIDED, DecodeOutput, DecodeProgress, DecodeStats, StepCallback, committed_view
from vispec.sampling import STATUS_NAN, STATUS_OK, raise_status

CACHES = ("none", "prefix", "dual")

_GUIDANCE_HINT = " (1 disables guidance; LLaDA's cfg_scale w is guidance_scale w + 1)"


class StopDecoding(Exception):
    """Raised by a step callback to end decoding early: :func:`decode` returns the canvas so far (the mask id
    where undecided), the statistics of the forwards run, and ``labels["interrupted"] = True``."""


def _config_id(model: Any, name: str) -> Optional[int]:
    value = getattr(getattr(model, "config", None), name, None)
    return None if value is None else int(value)


def check_decode_args(model: Any, input_ids: Tensor, attention_mask: Optional[Tensor], gen_length: int, block_length: int,
                      temperature: float, guidance_scale: float, cache: str, mask_token_id: Optional[int],
                      compile: bool = False) -> int:
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
    """

    def __init__(self, model: Any, prompt_len: int, key_mask: Optional[Tensor], guidance_scale: float, mask_id: int,
                 cache: str, compile: bool = False):
        self.model, self.prompt_len, self.key_mask = model, prompt_len, key_mask
        self.guidance_scale, self.mask_id, self.cache_mode = guidance_scale, mask_id, cache
        self.guided = guidance_scale != 1.0
        self.compile = compile
        self.kwargs = {"compile": True} if compile else {}
        self.cache = None
        self.cache_rows: Optional[Tensor] = None  # batch rows the cache holds, in order

    def _inputs(self, x: Tensor, rows: Optional[Tensor]) -> tuple[Tensor, Optional[Tensor]]:
        """Model inputs of batch ``rows`` (None: all rows) and their key mask (None: no padding)."""
        ids = x if rows is None else x[rows]
        mask = self.key_mask if rows is None or self.key_mask is None else self.key_mask[rows]
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
) -> DecodeOutput:
    """Decode ``gen_length`` tokens after each prompt (module docstring).

    Args:
        input_ids: ``[B, P]`` left-padded prompts; ``attention_mask [B, P]`` marks real tokens.
        scheduler: the unmasking policy; ``steps`` (total over blocks) is required by fixed-step ones.
        temperature: 0 for arg-max candidates, else float64 Gumbel-max sampling.
        guidance_scale: unsupervised CFG scale ``s >= 1``, ``ℓ = ℓ_u + s (ℓ_c - ℓ_u)``; 1 = off. LLaDA's
            ``cfg_scale = w`` is ``guidance_scale = w + 1``.
        cache: ``"none"``, ``"prefix"`` or ``"dual"``.
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

    Returns:
        :class:`vispec.outputs.DecodeOutput`: ``tokens [B, gen_length]``, per-row ``stats``, ``method`` (the
        scheduler's strategy name) and ``labels`` ``{"scheduler": class name, "cache": cache}``.
    """
    mask_id = check_decode_args(model, input_ids, attention_mask, gen_length, block_length, temperature, guidance_scale,
                                cache, mask_token_id, compile)
    eos_id = eos_token_id if eos_token_id is not None else _config_id(model, "eos_token_id")
    eot_id = eot_token_id if eot_token_id is not None else _config_id(model, "eot_token_id")
    for flag, name in ((early_stop_eos, "early_stop_eos"), (logits_eos_inf, "logits_eos_inf")):
        if flag and eos_id is None:
            raise ValueError(f"{name} needs an eos_token_id (the model config has none)")
    scheduler.set_timesteps(steps, gen_length, block_length)
    device = input_ids.device
    batch, prompt_len = input_ids.shape
    x = torch.cat([input_ids, torch.full((batch, gen_length), mask_id, dtype=torch.long, device=device)], dim=1)
    prompt_mask = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.to(device).bool()
    key_mask = torch.cat([prompt_mask, torch.ones(batch, gen_length, dtype=torch.bool, device=device)], dim=1)
    if bool(prompt_mask.all()):  # the one read-back about padding, before the loop: unpadded forwards take no mask
        key_mask = None
    seeds = per_sample_seeds(generator, batch, device)
    forward = _Forward(model, prompt_len, key_mask, float(guidance_scale), mask_id, cache, compile)
    nfe = torch.zeros(batch, dtype=torch.long, device=device)
    finished_at = torch.full((batch,), float("nan"), dtype=torch.float64)
    masks: Optional[tuple] = None
    start_time = time.perf_counter()
    global_step = 0
    interrupted = False
    nan = torch.zeros((), dtype=torch.bool, device=device)  # NaN logits seen in the current block (on the device)
    for block in range(gen_length // block_length):
        if interrupted:
            break
        start, end = prompt_len + block * block_length, prompt_len + (block + 1) * block_length
        masked_at_start = (x[:, start:end] == mask_id).sum(dim=1)
        step = 0
        while True:
            if step >= (scheduler.steps_per_block if scheduler.fixed_steps else block_length):
                break  # adaptive policies commit >= 1 token per step: block_length steps always suffice
            rows = (x[:, start:end] == mask_id).any(dim=1).nonzero().squeeze(1)
            if rows.numel() == 0:
                break
            logits = forward.block_logits(x, rows, start, end, first_step=step == 0 or forward.cache_rows is None)
            nan |= torch.isnan(logits).any()
            if logits_eos_inf:  # as LLaDA: EOS is gone from the logits, for the proposal and the confidence
                logits[..., eos_id] = float("-inf")
            if masks is None:
                masks = _token_masks(model, logits.shape[-1], mask_id, eos_id, eot_id, device, confidence_eos_eot_inf,
                                     suppress_mask_token)
            # noise keyed by the position in the generated canvas (not the padded prompt width)
            gen_positions = torch.arange(start - prompt_len, end - prompt_len, device=device)
            noise = UnmaskNoise(seeds[rows], gen_positions.expand(rows.numel(), -1), nfe[rows])
            out = scheduler.step(logits, step, x[rows, start:end], mask_token_id=mask_id, temperature=float(temperature),
                                 noise=noise, num_masked_at_block_start=masked_at_start[rows],
                                 proposal_mask=masks[0], confidence_mask=masks[1])
            x[rows, start:end] = out.prev_sample
            nfe[rows] += 1
            if early_stop_eos:
                _fill_after_eos(x, rows, prompt_len, eos_id, mask_id)
            done = rows[~(x[rows, prompt_len:] == mask_id).any(dim=1)]
            finished_at[done.cpu()] = time.perf_counter() - start_time
            step += 1
            global_step += 1
            if callback is not None:
                canvas = x[:, prompt_len:]
                decided = canvas != mask_id
                try:
                    edit = callback(DecodeProgress(
                        step=global_step - 1, num_committed=decided.sum(dim=1), tokens=committed_view(canvas, decided),
                        details={"block": block, "step_in_block": step - 1, "rows": rows.clone(),
                                 "transfer_index": out.transfer_index.clone()}))
                except StopDecoding:
                    interrupted = True
                    break
                if edit is not None:
                    _apply_edit(edit, x, prompt_len, mask_id, logits.shape[-1], forward)
        raise_status(torch.where(nan, STATUS_NAN, STATUS_OK))  # one read-back per block
    elapsed = time.perf_counter() - start_time
    finished_at = torch.where(torch.isnan(finished_at), torch.full_like(finished_at, elapsed), finished_at)
    tokens = x[:, prompt_len:]
    stats = DecodeStats(nfe=nfe.cpu(), tokens=count_tokens(tokens, eos_id, eot_id).cpu(), latency_s=finished_at)
    method = getattr(scheduler, "strategy", "") or type(scheduler).__name__
    labels = {"scheduler": type(scheduler).__name__, "cache": cache, **({"interrupted": True} if interrupted else {})}
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
