"""Triton kernel for dLLM unmasking statistics: one program per masked row, one pass over the vocabulary.

For row ``r`` with logits ``ℓ ∈ R^V`` (loaded in fp32 / bf16 / fp16 / fp64 and widened to float64)
the kernel walks the vocabulary in tiles of ``BLOCK`` entries and keeps, online,

* the proposal arg-max ``x̂ = argmax_v g_v`` with ``g_v = ℓ'_v`` at temperature 0 and
  ``g_v = ℓ'_v - T log(-log u_v)`` (LLaDA's float64 Gumbel-max, arXiv 2502.09992, evaluated in log
  space) otherwise, where ``ℓ'`` is ``ℓ`` with the proposal-masked tokens at ``-inf``. Ties go to
  the lowest index, like ``torch.argmax``: inside a tile through ``tl.max(..., return_indices=True)``,
  across tiles because a later tile must be strictly larger to win;
* the softmax statistics of ``p = softmax(ℓ)`` (no mask): running max ``m``, ``s = Σ_v e^{ℓ_v - m}``
  and ``w = Σ_v e^{ℓ_v - m} (ℓ_v - m)``. When the max moves from ``m`` to ``m'`` both sums are
  rescaled by ``α = e^{m - m'}``: ``s ← α s``, ``w ← α (w + s (m - m'))``;
* the two largest logits ``ℓ_(1) ≥ ℓ_(2)`` (as a multiset: a repeated maximum gives ``ℓ_(2) = ℓ_(1)``);
* with a confidence mask, a second running max / sum ``(m_c, s_c)`` over ``ℓ`` with the
  confidence-masked tokens at ``-inf``.

and then writes

* ``confidence = e^{ℓ_x̂ - m_c} / s_c = softmax(ℓ^c)[x̂]`` (``0`` when ``x̂`` itself is
  confidence-masked, since then ``ℓ^c_x̂ = -inf``);
* ``margin = p_(1) - p_(2) = (e^{ℓ_(1) - m} - e^{ℓ_(2) - m}) / s``;
* ``entropy H = -Σ p_v log p_v = m + log s - t / s`` with ``t = Σ e^{ℓ_v - m} ℓ_v``; the kernel keeps
  the shifted sum ``w = t - m s`` instead, so ``H = log s - w / s`` has no cancellation between
  ``m + log s`` and ``t / s`` when ``|m|`` is large (EB-Sampler's error proxy, arXiv 2505.24857).
  ``-inf`` logits contribute ``0`` to ``s`` and ``w`` (the ``0 · (-inf)`` of ``p log p`` is guarded,
  as the reference's ``nan_to_num``), and a row that is entirely ``-inf`` gets ``H = 0``.

These are exactly the quantities of :func:`vispec.kernels.unmask.unmask_candidates_reference`.
Gumbel noise either comes from counter-based Philox generated in the kernel
(:func:`vispec.kernels.philox_triton.tile_uniforms64` keyed by the row's seed, absolute position,
``Stream.UNMASK`` and draw, the numbers of :func:`vispec.kernels.philox.uniforms64`) or from an
injected ``[R, V]`` float64 tensor; nothing of size ``[R, V]`` is stored in the first mode.

Rows are read in place: the logits are a base pointer plus ``row_id * row_stride`` for a row-index
array, so the caller does not gather a copy of the masked rows (:func:`storage_rows` turns flat row
indices of any ``[..., V]`` view with unit last stride into such row ids).
"""

from __future__ import annotations

import math
import struct
from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from vispec.kernels.philox import Stream
from vispec.kernels.philox_triton import tile_uniforms64

# noise modes (the NOISE constexpr)
NOISE_NONE = 0  # temperature 0: plain arg-max
NOISE_KEYS = 1  # Philox float64 uniforms generated in the kernel from (seed, position, draw)
NOISE_UNIFORMS = 2  # injected [R, V] float64 uniforms

MIN_BLOCK = 16
MAX_BLOCK = 1024

_TL_LOGIT_TYPES = {torch.float32: "*fp32", torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float64: "*fp64"}


@triton.jit
def _unmask_rows_kernel(
    logits_ptr, row_ptr, stride_row, V,
    temp_bits, seed_ptr, pos_ptr, draw_ptr, stream,
    unif_ptr, stride_unif,
    proposal_mask_ptr, confidence_mask_ptr,
    tok_ptr, conf_ptr, margin_ptr, ent_ptr,
    NOISE: tl.constexpr, HAS_ROWS: tl.constexpr, PROPOSAL_MASK: tl.constexpr, CONFIDENCE_MASK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Program ``r`` handles row ``row_ptr[r]`` (``HAS_ROWS``; else row ``r``) of the ``[N, V]`` view ``logits_ptr``
    (row stride ``stride_row``).

    ``proposal_mask_ptr`` (``PROPOSAL_MASK``) and ``confidence_mask_ptr`` (``CONFIDENCE_MASK``) are ``[V]`` bool
    token masks. ``NOISE``: 0 arg-max, 1 in-kernel Philox (``seed/pos/draw_ptr[r]``, counter stream ``stream``),
    2 uniforms ``unif_ptr[r * stride_unif + v]``; ``temp_bits`` is the float64 temperature's bit pattern as an int64
    scalar when ``NOISE != 0`` (a scalar argument, not a one-element tensor made per call; scalar float arguments
    would be rounded to float32).
    """
    r = tl.program_id(0)
    r64 = r.to(tl.int64)
    if HAS_ROWS:
        row = tl.load(row_ptr + r)
    else:
        row = r64
    base = logits_ptr + row * stride_row
    lane = tl.arange(0, BLOCK)
    NEG_INF: tl.constexpr = float("-inf")

    if NOISE != 0:
        temperature = (tl.full([], 0, tl.int64) + temp_bits).to(tl.float64, bitcast=True)
    if NOISE == 1:
        seed = tl.load(seed_ptr + r)
        pos = tl.load(pos_ptr + r)
        draw = tl.load(draw_ptr + r)

    # softmax(ℓ): running max, Σ e^{ℓ-m}, Σ e^{ℓ-m}(ℓ-m); top-2 logits
    m = tl.full([], NEG_INF, tl.float64)
    s = tl.full([], 0.0, tl.float64)
    w = tl.full([], 0.0, tl.float64)
    top1 = tl.full([], NEG_INF, tl.float64)
    top2 = tl.full([], NEG_INF, tl.float64)
    # confidence softmax over the tokens the confidence mask leaves (only updated with CONFIDENCE_MASK)
    mc = tl.full([], NEG_INF, tl.float64)
    sc = tl.full([], 0.0, tl.float64)
    # proposal: running best score and its (lowest) index
    best = tl.full([], NEG_INF, tl.float64)
    best_idx = tl.full([], 0, tl.int32)

    for start in range(0, V, BLOCK):
        offs = start + lane
        inside = offs < V
        logit = tl.load(base + offs, mask=inside, other=NEG_INF).to(tl.float64)
        finite = logit != NEG_INF

        # top-2 of ℓ (multiset) and the running softmax statistics
        t1, i1 = tl.max(logit, axis=0, return_indices=True)
        t2 = tl.max(tl.where(lane == i1, NEG_INF, logit), axis=0)
        top2 = tl.maximum(tl.minimum(top1, t1), tl.maximum(top2, t2))
        top1 = tl.maximum(top1, t1)
        m_new = tl.maximum(m, t1)
        seen = m != NEG_INF  # then m_new is finite too
        alpha = tl.where(seen, tl.exp(m - m_new), 0.0)
        shift = tl.where(seen, m - m_new, 0.0)
        w = alpha * (w + s * shift)
        s = alpha * s
        d = tl.where(finite, logit - m_new, 0.0)
        e = tl.where(finite, tl.exp(d), 0.0)
        s += tl.sum(e, axis=0)
        w += tl.sum(e * d, axis=0)
        m = m_new

        if CONFIDENCE_MASK:
            conf_masked = tl.load(confidence_mask_ptr + offs, mask=inside, other=0)
            conf_logit = tl.where(conf_masked, NEG_INF, logit)
            tc = tl.max(conf_logit, axis=0)
            mc_new = tl.maximum(mc, tc)
            sc = tl.where(mc != NEG_INF, tl.exp(mc - mc_new), 0.0) * sc
            sc += tl.sum(tl.where(conf_logit != NEG_INF, tl.exp(conf_logit - mc_new), 0.0), axis=0)
            mc = mc_new
        if PROPOSAL_MASK:
            proposal = tl.where(tl.load(proposal_mask_ptr + offs, mask=inside, other=0), NEG_INF, logit)
        else:
            proposal = logit

        if NOISE == 0:
            score = proposal
        else:
            if NOISE == 1:
                u = tile_uniforms64(seed, start, pos, stream, draw, BLOCK)
            else:
                u = tl.load(unif_ptr + r64 * stride_unif + offs, mask=inside, other=0.5)
            score = proposal - temperature * tl.log(-tl.log(u))
        tbest, tidx = tl.max(score, axis=0, return_indices=True)
        better = tbest > best
        best_idx = tl.where(better, start + tidx, best_idx)
        best = tl.where(better, tbest, best)

    tok_logit = tl.load(base + best_idx).to(tl.float64)
    if CONFIDENCE_MASK:
        tok_logit_c = tl.where(tl.load(confidence_mask_ptr + best_idx), NEG_INF, tok_logit)
        confidence = tl.exp(tok_logit_c - mc) / sc
    else:
        confidence = tl.exp(tok_logit - m) / s
    margin = tl.exp(top1 - m) / s - tl.exp(top2 - m) / s
    entropy = tl.where(s > 0, tl.log(s) - w / s, 0.0)
    tl.store(tok_ptr + r, best_idx.to(tl.int64))
    tl.store(conf_ptr + r, confidence)
    tl.store(margin_ptr + r, margin)
    tl.store(ent_ptr + r, entropy)


def storage_rows(logits: Tensor, rows: Tensor) -> tuple[Tensor, int]:
    """Row ids and row stride addressing ``logits.reshape(-1, V)[rows]`` in ``logits``' own storage.

    ``logits`` is ``[..., V]`` with unit last stride; ``rows`` are flat (row-major) indices over
    ``logits.shape[:-1]``. Row ``k`` with multi-index ``(i_0, …, i_{n-1})`` starts at element
    ``Σ_j i_j stride_j`` of ``logits.data_ptr()``; with ``S = gcd`` of the leading strides this is
    row ``Σ_j i_j (stride_j / S)`` of a ``[N', V]`` view with row stride ``S``. So a slice such as
    ``logits[:, start:end]`` of a ``[B, L, V]`` tensor is read in place (``S = V``).

    When the leading dimensions collapse into one (each stride is the next one's times its size, as in any
    contiguous tensor), row ``k`` starts at ``k S`` with ``S`` the innermost leading stride: the ids are ``rows``
    themselves and nothing is computed on the device.
    """
    lead_shape = logits.shape[:-1]
    lead_strides = logits.stride()[:-1]
    kept = [(size, st) for size, st in zip(lead_shape, lead_strides) if size > 1]
    if all(outer == inner * size for (_, outer), (size, inner) in zip(kept, kept[1:])):
        return rows if rows.dtype == torch.int64 else rows.to(torch.int64), max(kept[-1][1], 1) if kept else 1
    stride = 0
    for size, st in kept:
        stride = math.gcd(stride, st)
    stride = max(stride, 1)
    ids = torch.zeros_like(rows, dtype=torch.int64)
    rest = rows if rows.dtype == torch.int64 else rows.to(torch.int64)
    for size, st in zip(reversed(lead_shape), reversed(lead_strides)):
        ids += (rest % size) * (st // stride)
        rest = rest // size
    return ids, stride


def default_block(vocab_size: int) -> int:
    """Tile width: the next power of two of ``V``, clamped to ``[MIN_BLOCK, MAX_BLOCK]``."""
    return max(MIN_BLOCK, min(MAX_BLOCK, triton.next_power_of_2(max(int(vocab_size), 1))))


def unmask_candidates_triton(
    logits: Tensor,
    rows: Optional[Tensor],
    temperature: float = 0.0,
    uniforms: Optional[Tensor] = None,
    seeds: Optional[Tensor] = None,
    positions: Optional[Tensor] = None,
    draws: Optional[Tensor] = None,
    proposal_mask: Optional[Tensor] = None,
    confidence_mask: Optional[Tensor] = None,
    block_size: Optional[int] = None,
    num_warps: int = 4,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Launch :func:`_unmask_rows_kernel` on rows ``rows`` of ``logits [..., V]`` (flat indices over the leading dims;
    ``None``: every row of ``[R, V]`` logits).

    Inputs are validated by :func:`vispec.kernels.unmask.unmask_candidates`; here only the layout is
    prepared, without device work besides the launch for contiguous logits, int64 keys and contiguous bool masks:
    the outputs are allocated uninitialised, the temperature goes in as a scalar and the masks as they are. At
    ``temperature > 0`` the noise is ``uniforms [R, V]`` (float64) when given, else the Philox keys ``seeds``,
    ``positions``, ``draws`` (``[R]`` int64). Returns ``(tokens, confidence, margin, entropy)``, each ``[R]``
    (int64, float64, float64, float64).
    """
    vocab = logits.shape[-1]
    device = logits.device
    n_rows = logits.shape[0] if rows is None else rows.numel()
    tokens = torch.empty(n_rows, dtype=torch.int64, device=device)
    confidence = torch.empty(n_rows, dtype=torch.float64, device=device)
    margin = torch.empty(n_rows, dtype=torch.float64, device=device)
    entropy = torch.empty(n_rows, dtype=torch.float64, device=device)
    if n_rows == 0:
        return tokens, confidence, margin, entropy
    if logits.dtype not in _TL_LOGIT_TYPES:
        raise ValueError(f"logits dtype must be one of {sorted(str(d) for d in _TL_LOGIT_TYPES)}, got {logits.dtype}")
    if rows is None and logits.dim() != 2:
        raise ValueError(f"logits must be [rows, vocab] without rows, got shape {tuple(logits.shape)}")
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    if rows is None:
        row_ids, row_stride = tokens, logits.stride(0)  # row r is program r (the pointer is unused)
    else:
        row_ids, row_stride = storage_rows(logits, rows)

    block = default_block(vocab) if block_size is None else int(block_size)
    if block < 2 or block & (block - 1):
        raise ValueError(f"block_size must be a power of two >= 2, got {block_size}")

    if temperature > 0 and uniforms is not None:
        noise_mode = NOISE_UNIFORMS
        uniforms = uniforms.to(torch.float64)
        if uniforms.stride(-1) != 1:
            uniforms = uniforms.contiguous()
    elif temperature > 0:
        noise_mode = NOISE_KEYS
    else:
        noise_mode = NOISE_NONE
    if noise_mode == NOISE_KEYS:
        seed_t, pos_t, draw_t = (x if x.dtype == torch.int64 and x.is_contiguous() and x.device == device
                                 else x.to(device=device, dtype=torch.int64).contiguous() for x in (seeds, positions, draws))
    else:
        seed_t = pos_t = draw_t = tokens  # unused int64 placeholders
    unif_t, unif_stride = (uniforms, uniforms.stride(0)) if noise_mode == NOISE_UNIFORMS else (confidence, 0)
    masks = [mask if mask is None or (mask.dtype == torch.bool and mask.is_contiguous() and mask.device == device)
             else mask.to(device=device, dtype=torch.bool).contiguous() for mask in (proposal_mask, confidence_mask)]

    _unmask_rows_kernel[(n_rows,)](
        logits, row_ids, row_stride, vocab,
        temperature_bits(temperature), seed_t, pos_t, draw_t, int(Stream.UNMASK),
        unif_t, unif_stride,
        *(tokens if mask is None else mask for mask in masks),  # unused placeholders where no mask is given
        tokens, confidence, margin, entropy,
        NOISE=noise_mode, HAS_ROWS=rows is not None, PROPOSAL_MASK=masks[0] is not None,
        CONFIDENCE_MASK=masks[1] is not None, BLOCK=block, num_warps=num_warps, enable_fp_fusion=False,
    )
    return tokens, confidence, margin, entropy


def temperature_bits(temperature: float) -> int:
    """The IEEE-754 bit pattern of ``float(temperature)`` as a signed int64 (the kernel's ``temp_bits``)."""
    return struct.unpack("<q", struct.pack("<d", float(temperature)))[0]


def compile_configs(block: int = MAX_BLOCK) -> list[tuple[str, object, dict[str, str], dict[str, object]]]:
    """Every constexpr configuration of :func:`_unmask_rows_kernel`, for ``triton.compile``.

    Each entry is ``(name, jit_fn, signature, constexprs)`` for
    ``triton.compile(triton.compiler.ASTSource(fn=jit_fn, signature=signature, constexprs=constexprs),
    target=GPUTarget(...))``: the three noise modes (arg-max, in-kernel Philox, injected uniforms)
    times each combination of token masks at tile width ``block`` (fp32 logits, row ids), the three
    modes on all rows (no row ids), the fully featured configuration with bf16 and fp16 logits, and the
    masked configurations at the narrowest tile ``MIN_BLOCK`` (the dispatch uses tile widths
    ``MIN_BLOCK .. MAX_BLOCK``; the width changes only the tile shape, not the code path).
    """
    def signature(logit_type: str) -> dict:
        return {
            "logits_ptr": logit_type, "row_ptr": "*i64", "stride_row": "i32", "V": "i32",
            "temp_bits": "i64", "seed_ptr": "*i64", "pos_ptr": "*i64", "draw_ptr": "*i64", "stream": "i32",
            "unif_ptr": "*fp64", "stride_unif": "i32",
            "proposal_mask_ptr": "*i1", "confidence_mask_ptr": "*i1",
            "tok_ptr": "*i64", "conf_ptr": "*fp64", "margin_ptr": "*fp64", "ent_ptr": "*fp64",
            "NOISE": "constexpr", "HAS_ROWS": "constexpr", "PROPOSAL_MASK": "constexpr", "CONFIDENCE_MASK": "constexpr",
            "BLOCK": "constexpr",
        }

    def consts(noise_mode: int, proposal: bool, confidence: bool, width: int, has_rows: bool = True) -> dict:
        return {"NOISE": noise_mode, "HAS_ROWS": has_rows, "PROPOSAL_MASK": proposal, "CONFIDENCE_MASK": confidence,
                "BLOCK": width}

    def mask_name(proposal: bool, confidence: bool) -> str:
        return ("_pmask" if proposal else "") + ("_cmask" if confidence else "")

    configs = []
    names = {NOISE_NONE: "argmax", NOISE_KEYS: "philox", NOISE_UNIFORMS: "uniforms"}
    both = ((False, False), (True, False), (False, True), (True, True))
    for noise_mode in (NOISE_NONE, NOISE_KEYS, NOISE_UNIFORMS):
        for proposal, confidence in both:
            configs.append((f"unmask_{names[noise_mode]}{mask_name(proposal, confidence)}_fp32_b{block}",
                            _unmask_rows_kernel, signature("*fp32"), consts(noise_mode, proposal, confidence, block)))
        configs.append((f"unmask_{names[noise_mode]}_all_rows_fp32_b{block}", _unmask_rows_kernel, signature("*fp32"),
                        consts(noise_mode, False, False, block, has_rows=False)))
    for logit_type in ("*bf16", "*fp16"):
        configs.append((f"unmask_philox_pmask_cmask_{logit_type[1:]}_b{block}", _unmask_rows_kernel, signature(logit_type),
                        consts(NOISE_KEYS, True, True, block)))
    if block != MIN_BLOCK:  # the narrowest tile the dispatch uses (small vocabularies)
        for noise_mode in (NOISE_NONE, NOISE_KEYS, NOISE_UNIFORMS):
            configs.append((f"unmask_{names[noise_mode]}_pmask_cmask_fp32_b{MIN_BLOCK}", _unmask_rows_kernel,
                            signature("*fp32"), consts(noise_mode, True, True, MIN_BLOCK)))
    return configs
