"""Triton kernels for speculative verification and sampling from logits (SJD, MC-SJD, draft-model SD).

Rows are a flattened ragged batch: row ``t`` belongs to sample ``row_sample[t]`` (``-1``: padding,
skipped), and sample ``b``'s draft rows are ``row_start[b] .. row_start[b] + num_drafts[b] - 1``
(vLLM-style offsets; a padded ``[B, W]`` window is the case ``row_start[b] = b W``).

Each row's target ``p`` is the processed distribution of :func:`vispec.sampling.process_logits`,
computed on the fly from raw logits and never stored:

* guidance ``l = l_u + s (l_c - l_u)`` on rows whose position is at most ``guide_limit`` (``cfg_interval + 1``;
  every row when ``cfg_interval = -1``), else ``l = l_c``;
* greedy (``T = 0``): ``p`` is one-hot on the first arg-max of ``l``;
* otherwise ``w = l / T``, tokens below the row's top-k/top-p threshold ``tau[t]`` (computed by
  :func:`_threshold_kernel`) get ``-inf``, and ``p_v = exp(w_v - m) / s`` with the online
  log-sum-exp pair ``(m, s)`` of the row (``s = Σ_v exp(w_v - m)``).

Kernels (launched by the ``launch_*`` functions at the end of this module, which take tensors;
:class:`vispec.kernels.target.Target` dispatches to them):

* :func:`_threshold_kernel`: ``tau`` per row. Top-k: the k-th largest ``w`` (ties kept), by radix
  select over the order-preserving integer image of float32 (4 passes of 8-bit histograms);
  top-p: the smallest ``w`` value ``x`` whose strictly-larger mass ``Σ_{w_v > x} p_v`` is below
  ``top_p`` (the token that crosses the threshold is kept), by bisection over the same integer
  image on the renormalised top-k distribution (1 + 32 passes). No sort.
* :func:`_accept_kernel`: one pass: ``(m, s)`` (or the arg-max), ``p(d)`` at the draft token, and
  the speculative test ``u q(d) < p(d)`` (Leviathan et al. 2023; acceptance probability
  ``min(1, p/q)``). ``u`` is Philox noise keyed by (seed, position, ACCEPT, draw), or injected.
* :func:`_first_rejection_kernel`: per sample, the number of leading accepted drafts.
* :func:`_sample_kernel`: one pass: exponential races ``argmax_v w_v / E_v`` (``E ~ Exp(1)``) for
  the residual ``max(0, p - q)`` and/or a fresh sample from ``p``; optionally stores ``p`` (the
  next draft's ``q``). The noise is recomputed from Philox counters tile by tile, so MC-SJD's
  Gumbel coupling needs no ``[B, positions, V]`` table.

Draft distributions ``q`` are one-hot on the draft token (initialised drafts) or dense rows of a
``[Nq, V]`` tensor selected by ``q_index[t] >= 0``.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from vispec.kernels.philox import Stream
from vispec.kernels.philox_triton import scalar_uniform, tile_exponentials
from vispec.kernels.verify import Drafts, LogitRows, SampleRequest

ACCEPT_STREAM: tl.constexpr = tl.constexpr(int(Stream.ACCEPT))
RESIDUAL_STREAM: tl.constexpr = tl.constexpr(int(Stream.RESIDUAL))
MODE_RESIDUAL: tl.constexpr = tl.constexpr(1)
MODE_FRESH: tl.constexpr = tl.constexpr(2)
STATUS_NAN: tl.constexpr = tl.constexpr(1)
STATUS_NO_MASS: tl.constexpr = tl.constexpr(2)
LOWEST: tl.constexpr = tl.constexpr(-3.4028234663852886e38)  # lowest finite float32


@triton.jit
def _processed_tile(cond_row, uncond_row, offs, valid, guide, scale, temperature, tau,
                    HAS_UNCOND: tl.constexpr, GREEDY: tl.constexpr, HAS_TAU: tl.constexpr):
    """Processed logits of one vocabulary tile (``-inf`` outside the vocabulary and below ``tau``)."""
    logits = tl.load(cond_row + offs, mask=valid, other=0.0).to(tl.float32)
    if HAS_UNCOND:
        uncond = tl.load(uncond_row + offs, mask=valid, other=0.0).to(tl.float32)
        guided = uncond + scale * (logits - uncond)
        logits = tl.where(guide != 0, guided, logits)
    if not GREEDY:
        logits = logits / temperature
        if HAS_TAU:
            logits = tl.where(logits >= tau, logits, float("-inf"))
    return tl.where(valid, logits, float("-inf"))


@triton.jit
def _tile(cond_row, uncond_row, start, V, guide, scale, temperature, tau,
          HAS_UNCOND: tl.constexpr, GREEDY: tl.constexpr, HAS_TAU: tl.constexpr, BLOCK: tl.constexpr):
    """``(offs, valid, w)``: the vocabulary tile starting at ``start`` and its processed logits."""
    offs = start + tl.arange(0, BLOCK)
    valid = offs < V
    return offs, valid, _processed_tile(cond_row, uncond_row, offs, valid, guide, scale, temperature, tau,
                                        HAS_UNCOND, GREEDY, HAS_TAU)


@triton.jit
def _row_inputs(cond_ptr, uncond_ptr, stride_c, stride_u, guide_limit, pos_ptr, tau_ptr, row,
                HAS_UNCOND: tl.constexpr, HAS_TAU: tl.constexpr):
    """Row pointers, the row's guidance flag and its top-k/top-p threshold (``-inf``: none).

    Guidance applies where the row's position is at most ``guide_limit`` (``cfg_interval + 1``, or the
    largest int64 when every position is guided), so no per-row flag tensor is built per call."""
    guide = 0
    if HAS_UNCOND:
        guide = (tl.load(pos_ptr + row) <= guide_limit).to(tl.int32)
    tau = float("-inf")
    if HAS_TAU:
        tau = tl.load(tau_ptr + row)
    return cond_ptr + row * stride_c, uncond_ptr + row * stride_u, guide, tau


@triton.jit
def _online_lse(w, m, s):
    """One tile of the online log-sum-exp: ``(m, s)`` with ``s = Σ exp(w - m)``.

    ``m`` starts at the lowest finite float32 (not ``-inf``), so ``exp(m_old - m_new)`` is never
    ``exp(-inf + inf)``; ``exp(-inf - m) = 0`` drops masked entries. A row whose entries are all
    ``-inf`` ends with ``s = 0``."""
    new_m = tl.maximum(m, tl.max(w, axis=0))
    s = s * tl.exp(m - new_m) + tl.sum(tl.exp(w - new_m), axis=0)
    return new_m, s


@triton.jit
def _ordered_key(x):
    """Order-preserving int32 image of float32 (negative floats: flip the 31 value bits)."""
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton.jit
def _key_to_float(key):
    key32 = key.to(tl.int32)
    bits = tl.where(key32 < 0, key32 ^ 0x7FFFFFFF, key32)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _kth_largest_key(cond_row, uncond_row, guide, scale, temperature, V, k,
                     HAS_UNCOND: tl.constexpr, BLOCK: tl.constexpr):
    """Order key of the ``k``-th largest processed logit ``w = l / T`` by radix select.

    Keys are shifted to unsigned order (``key + 2**31``) and resolved 8 bits per pass, most
    significant first: each pass histograms the next digit of the entries that share the digits
    found so far, and keeps the largest digit ``b`` with at least ``k'`` entries at or above it
    (``k'`` = the rank still to find inside the current prefix). Four passes over the row, exact.
    """
    bins = tl.arange(0, 256)
    prefix = tl.full((), 0, tl.int64)
    remaining = tl.full((), 0, tl.int32) + k
    for digit_index in tl.static_range(4):
        shift = 24 - 8 * digit_index
        hist = tl.zeros((256,), dtype=tl.int32)
        for start in range(0, V, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            valid = offs < V
            w = _processed_tile(cond_row, uncond_row, offs, valid, guide, scale, temperature, 0.0,
                                HAS_UNCOND, False, False)
            ukey = _ordered_key(w).to(tl.int64) + 2147483648
            match = valid
            if digit_index > 0:
                match = match & ((ukey >> (shift + 8)) == (prefix >> (shift + 8)))
            hist += tl.histogram(((ukey >> shift) & 255).to(tl.int32), 256, mask=match)
        at_or_above = tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0) + hist
        digit = tl.max(tl.where(at_or_above >= remaining, bins, 0), axis=0)
        remaining -= tl.sum(tl.where(bins > digit, hist, 0), axis=0)
        prefix += digit.to(tl.int64) << shift
    return prefix - 2147483648


@triton.jit
def _threshold_kernel(
    cond_ptr, uncond_ptr, stride_c, stride_u, guide_limit, scale, temperature, pos_ptr, sample_ptr, tau_ptr,
    V, top_k, top_p,
    HAS_UNCOND: tl.constexpr, USE_TOP_K: tl.constexpr, USE_TOP_P: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    sample = tl.load(sample_ptr + row)
    if sample >= 0:
        cond_row, uncond_row, guide, _ = _row_inputs(cond_ptr, uncond_ptr, stride_c, stride_u, guide_limit, pos_ptr,
                                                     tau_ptr, row, HAS_UNCOND, False)
        tau_k = float("-inf")
        if USE_TOP_K:
            tau_k = _key_to_float(_kth_largest_key(cond_row, uncond_row, guide, scale, temperature, V, top_k,
                                                   HAS_UNCOND, BLOCK))
        tau = tau_k
        if USE_TOP_P:
            m = LOWEST
            s = 0.0
            for start in range(0, V, BLOCK):
                offs, valid, w = _tile(cond_row, uncond_row, start, V, guide, scale, temperature, tau_k, HAS_UNCOND, False, USE_TOP_K,
                                        BLOCK)
                m, s = _online_lse(w, m, s)
            # smallest key x with mass(w > x) < top_p is the key of the last kept token
            lo = tl.full((), -2147483648, tl.int64)
            hi = tl.full((), 2147483647, tl.int64)
            for _ in range(32):
                mid = lo + (hi - lo) // 2
                above = 0.0
                for start in range(0, V, BLOCK):
                    offs, valid, w = _tile(cond_row, uncond_row, start, V, guide, scale, temperature, tau_k, HAS_UNCOND, False, USE_TOP_K,
                                            BLOCK)
                    big = (_ordered_key(w).to(tl.int64) > mid) & (w > float("-inf"))
                    above += tl.sum(tl.where(big, tl.exp(w - m), 0.0), axis=0)
                ok = above / s < top_p
                hi = tl.where(ok, mid, hi)
                lo = tl.where(ok, lo, mid + 1)
            neg_inf_key = -2139095041  # _ordered_key(-inf)
            tau_p = tl.where(hi <= neg_inf_key, float("-inf"), _key_to_float(hi))
            tau = tl.maximum(tau_k, tau_p)
        tl.store(tau_ptr + row, tau)
    else:  # padding: no threshold (the output is allocated uninitialised)
        tl.store(tau_ptr + row, float("-inf"))


@triton.jit
def _accept_kernel(
    cond_ptr, uncond_ptr, stride_c, stride_u, guide_limit, scale, temperature, tau_ptr,
    draft_ptr, q_ptr, stride_q, q_index_ptr,
    sample_ptr, seed_ptr, pos_ptr, draw_ptr, uniform_ptr,
    accepted_ptr, m_ptr, s_ptr, amax_ptr, status_ptr,
    V,
    HAS_UNCOND: tl.constexpr, GREEDY: tl.constexpr, HAS_TAU: tl.constexpr, HAS_DENSE: tl.constexpr,
    INJECTED: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    sample = tl.load(sample_ptr + row)
    if sample >= 0:
        cond_row, uncond_row, guide, tau = _row_inputs(cond_ptr, uncond_ptr, stride_c, stride_u, guide_limit, pos_ptr,
                                                       tau_ptr, row, HAS_UNCOND, HAS_TAU)
        draft = tl.load(draft_ptr + row)
        m = LOWEST
        s = 0.0
        best = float("-inf")
        best_idx = tl.full((), 0, tl.int64)
        w_draft = float("-inf")
        nan_seen = 0
        for start in range(0, V, BLOCK):
            offs, valid, w = _tile(cond_row, uncond_row, start, V, guide, scale, temperature, tau, HAS_UNCOND, GREEDY, HAS_TAU,
                                    BLOCK)
            nan_seen = tl.maximum(nan_seen, tl.max((w != w).to(tl.int32), axis=0))
            w_draft = tl.maximum(w_draft, tl.max(tl.where(offs == draft, w, float("-inf")), axis=0))
            if GREEDY:
                tile_best = tl.max(w, axis=0)
                tile_idx = tl.argmax(w, axis=0).to(tl.int64) + start
                better = tile_best > best
                best_idx = tl.where(better, tile_idx, best_idx)
                best = tl.where(better, tile_best, best)
            else:
                m, s = _online_lse(w, m, s)
        if GREEDY:
            p_draft = tl.where(draft == best_idx, 1.0, 0.0)
            status = tl.where(nan_seen != 0, STATUS_NAN, 0)
        else:
            p_draft = tl.where(w_draft == float("-inf"), 0.0, tl.exp(w_draft - m) / s)
            status = tl.where(nan_seen != 0, STATUS_NAN, tl.where(s > 0.0, 0, STATUS_NO_MASS))
        accepted = 0
        if draft >= 0:
            if INJECTED:
                u = tl.load(uniform_ptr + row)
            else:
                u = scalar_uniform(tl.load(seed_ptr + sample), tl.load(pos_ptr + row), ACCEPT_STREAM,
                                   tl.load(draw_ptr + row))
            q_draft = 1.0
            if HAS_DENSE:
                q_row = tl.load(q_index_ptr + row)
                if q_row >= 0:
                    q_draft = tl.load(q_ptr + q_row * stride_q + draft).to(tl.float32)
            accepted = (u * q_draft < p_draft).to(tl.int32)
        tl.store(accepted_ptr + row, accepted != 0)
        tl.store(m_ptr + row, m)
        tl.store(s_ptr + row, s)
        tl.store(amax_ptr + row, best_idx)
        tl.store(status_ptr + row, status.to(tl.int8))
    else:  # padding: rejected, no mass, no problem (the outputs are allocated uninitialised)
        tl.store(accepted_ptr + row, tl.full((), 0, tl.int1))
        tl.store(m_ptr + row, float("-inf"))
        tl.store(s_ptr + row, 0.0)
        tl.store(amax_ptr + row, tl.full((), 0, tl.int64))
        tl.store(status_ptr + row, tl.full((), 0, tl.int8))


@triton.jit
def _first_rejection_kernel(accepted_ptr, row_start_ptr, num_drafts_ptr, out_ptr):
    """``out[b]`` = number of leading accepted rows among sample ``b``'s draft rows (no ``break``)."""
    b = tl.program_id(0)
    start = tl.load(row_start_ptr + b)
    count = tl.load(num_drafts_ptr + b)
    alive = 1
    leading = 0
    for j in range(0, count):
        alive = alive * tl.load(accepted_ptr + start + j).to(tl.int32)
        leading += alive
    tl.store(out_ptr + b, leading.to(tl.int64))


@triton.jit
def _race_update(key, start, best, best_idx):
    """Running ``(max, first arg-max)`` of race keys over tiles (strictly greater replaces)."""
    tile_best = tl.max(key, axis=0)
    tile_idx = tl.argmax(key, axis=0).to(tl.int64) + start
    better = tile_best > best
    return tl.where(better, tile_best, best), tl.where(better, tile_idx, best_idx)


@triton.jit
def _sample_kernel(
    cond_ptr, uncond_ptr, stride_c, stride_u, guide_limit, scale, temperature, tau_ptr,
    draft_ptr, q_ptr, stride_q, q_index_ptr,
    m_ptr, s_ptr, amax_ptr, residual_ptr, fresh_ptr,
    sample_ptr, seed_ptr, pos_ptr, residual_draw_ptr, fresh_stream_ptr, fresh_stream_all, fresh_draw_ptr,
    residual_noise_ptr, fresh_noise_ptr, stride_noise,
    store_ptr, probs_out_ptr, stride_out,
    residual_out_ptr, fresh_out_ptr,
    V,
    HAS_UNCOND: tl.constexpr, GREEDY: tl.constexpr, HAS_TAU: tl.constexpr, HAS_DENSE: tl.constexpr,
    INJECTED: tl.constexpr, STORE: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    sample = tl.load(sample_ptr + row)
    draft = tl.load(draft_ptr + row)
    # a residual needs a draft; the request's flags are bool rows
    mode = (tl.where(tl.load(residual_ptr + row) & (draft >= 0), MODE_RESIDUAL, 0)
            | tl.where(tl.load(fresh_ptr + row), MODE_FRESH, 0))
    dest = tl.full((), -1, tl.int64)
    if STORE:
        dest = tl.load(store_ptr + row)
    if (sample >= 0) & ((mode != 0) | (dest >= 0)):
        cond_row, uncond_row, guide, tau = _row_inputs(cond_ptr, uncond_ptr, stride_c, stride_u, guide_limit, pos_ptr,
                                                       tau_ptr, row, HAS_UNCOND, HAS_TAU)
        m = tl.load(m_ptr + row)
        s = tl.load(s_ptr + row)
        amax = tl.load(amax_ptr + row)
        q_row = tl.full((), -1, tl.int64)
        if HAS_DENSE:
            q_row = tl.load(q_index_ptr + row)
        seed = tl.load(seed_ptr + sample)
        pos = tl.load(pos_ptr + row)
        residual_draw = tl.load(residual_draw_ptr + row)
        fresh_stream = tl.full((), 0, tl.int64) + fresh_stream_all  # one stream for every row, or
        if fresh_stream_all < 0:  # -1: a stream per row
            fresh_stream = tl.load(fresh_stream_ptr + row)
        fresh_draw = tl.load(fresh_draw_ptr + row)
        best_r = -1.0
        idx_r = tl.full((), 0, tl.int64)
        best_f = -1.0
        idx_f = tl.full((), 0, tl.int64)
        for start in range(0, V, BLOCK):
            offs, valid, w = _tile(cond_row, uncond_row, start, V, guide, scale, temperature, tau, HAS_UNCOND, GREEDY, HAS_TAU,
                                    BLOCK)
            if GREEDY:
                p = tl.where(offs == amax, 1.0, 0.0)
            else:
                p = tl.where(w == float("-inf"), 0.0, tl.exp(w - m) / s)
            if (mode & MODE_RESIDUAL) != 0:
                q = tl.where(offs == draft, 1.0, 0.0)
                if HAS_DENSE:
                    if q_row >= 0:
                        q = tl.load(q_ptr + q_row * stride_q + offs, mask=valid, other=0.0).to(tl.float32)
                if INJECTED:
                    noise = tl.load(residual_noise_ptr + row * stride_noise + offs, mask=valid, other=1.0)
                else:
                    noise = tile_exponentials(seed, start, pos, RESIDUAL_STREAM, residual_draw, BLOCK)
                key = tl.where(valid, tl.maximum(p - q, 0.0) / noise, -1.0)
                best_r, idx_r = _race_update(key, start, best_r, idx_r)
            if (mode & MODE_FRESH) != 0:
                if INJECTED:
                    noise = tl.load(fresh_noise_ptr + row * stride_noise + offs, mask=valid, other=1.0)
                else:
                    noise = tile_exponentials(seed, start, pos, fresh_stream, fresh_draw, BLOCK)
                key = tl.where(valid, p / noise, -1.0)
                best_f, idx_f = _race_update(key, start, best_f, idx_f)
            if STORE:
                if dest >= 0:
                    tl.store(probs_out_ptr + dest * stride_out + offs, p, mask=valid)
        tl.store(residual_out_ptr + row, tl.where((mode & MODE_RESIDUAL) != 0, idx_r, -1))
        tl.store(fresh_out_ptr + row, tl.where((mode & MODE_FRESH) != 0, idx_f, -1))
    else:  # nothing asked of this row (or padding): -1 (the outputs are allocated uninitialised)
        tl.store(residual_out_ptr + row, tl.full((), -1, tl.int64))
        tl.store(fresh_out_ptr + row, tl.full((), -1, tl.int64))


def _signature(names_types: str) -> dict[str, str]:
    return dict(item.split(":") for item in names_types.split())


_TARGET_ARGS = "cond_ptr:*fp32 uncond_ptr:*fp32 stride_c:i64 stride_u:i64 guide_limit:i64 scale:fp32 temperature:fp32"
_DRAFT_ARGS = "draft_ptr:*i64 q_ptr:*fp32 stride_q:i64 q_index_ptr:*i64"


def compile_configs() -> list[tuple[str, object, dict[str, str], dict[str, object]]]:
    """Every kernel and constexpr configuration, as ``(name, kernel, signature, constexprs)`` for
    ``triton.compile(ASTSource(...), target=GPUTarget(...))`` (the compile tests and ``vispec bench kernels``)."""
    configs = []
    for dtype in ("fp32", "bf16"):
        target_args = _TARGET_ARGS.replace("cond_ptr:*fp32 uncond_ptr:*fp32", f"cond_ptr:*{dtype} uncond_ptr:*{dtype}")
        for has_uncond in (False, True):
            for use_k, use_p in ((True, False), (False, True), (True, True)):
                sig = _signature(f"{target_args} pos_ptr:*i64 sample_ptr:*i64 tau_ptr:*fp32 V:i32 top_k:i32 top_p:fp32 "
                                 "HAS_UNCOND:constexpr USE_TOP_K:constexpr USE_TOP_P:constexpr BLOCK:constexpr")
                consts = {"HAS_UNCOND": has_uncond, "USE_TOP_K": use_k, "USE_TOP_P": use_p, "BLOCK": 1024}
                configs.append((f"threshold[{dtype},uncond={has_uncond},k={use_k},p={use_p}]", _threshold_kernel, sig, consts))
            for greedy in (False, True):
                for has_tau in ((False,) if greedy else (False, True)):
                    for dense in (False, True):
                        for injected in (False, True):
                            flags = {"HAS_UNCOND": has_uncond, "GREEDY": greedy, "HAS_TAU": has_tau, "HAS_DENSE": dense,
                                     "INJECTED": injected, "BLOCK": 1024}
                            sig = _signature(
                                f"{target_args} tau_ptr:*fp32 {_DRAFT_ARGS} sample_ptr:*i64 seed_ptr:*i64 pos_ptr:*i64 "
                                "draw_ptr:*i64 uniform_ptr:*fp32 accepted_ptr:*i1 m_ptr:*fp32 s_ptr:*fp32 amax_ptr:*i64 "
                                "status_ptr:*i8 V:i32 " + " ".join(f"{k}:constexpr" for k in flags))
                            label = ",".join(f"{k.lower()}={v}" for k, v in flags.items() if k != "BLOCK")
                            configs.append((f"accept[{dtype},{label}]", _accept_kernel, sig, flags))
                            for store in (False, True):
                                sflags = dict(flags, STORE=store)
                                sig = _signature(
                                    f"{target_args} tau_ptr:*fp32 {_DRAFT_ARGS} m_ptr:*fp32 s_ptr:*fp32 amax_ptr:*i64 "
                                    "residual_ptr:*i1 fresh_ptr:*i1 sample_ptr:*i64 seed_ptr:*i64 pos_ptr:*i64 "
                                    "residual_draw_ptr:*i64 fresh_stream_ptr:*i64 fresh_stream_all:i32 fresh_draw_ptr:*i64 residual_noise_ptr:*fp32 "
                                    "fresh_noise_ptr:*fp32 stride_noise:i64 store_ptr:*i64 probs_out_ptr:*fp32 "
                                    "stride_out:i64 residual_out_ptr:*i64 fresh_out_ptr:*i64 V:i32 "
                                    + " ".join(f"{k}:constexpr" for k in sflags))
                                configs.append((f"sample[{dtype},{label},store={store}]", _sample_kernel, sig, sflags))
    configs.append(("first_rejection", _first_rejection_kernel,
                    _signature("accepted_ptr:*i1 row_start_ptr:*i64 num_drafts_ptr:*i64 out_ptr:*i64"), {}))
    return configs


# ---- launchers: tensors in, tensors out ------------------------------------------------------------
#
# A launch is the decode loop's hot path: each output is allocated uninitialised (the kernels write every row,
# padding included), flags go in as bool rows and come out as bool, guidance is decided from the positions in the
# kernel, and nothing is read back, so a launcher issues no device work besides its kernel.


def _num_warps(block: int) -> int:
    return 8 if block >= 2048 else 4


def _logit_args(rows: LogitRows) -> tuple:
    uncond = rows.uncond if rows.uncond is not None else rows.cond
    return (rows.cond, uncond, rows.cond.stride(0), uncond.stride(0), rows.guide_limit, float(rows.guidance_scale),
            float(rows.temperature))


def launch_threshold(rows: LogitRows) -> Tensor:
    """``tau [T]``: each row's top-k/top-p threshold on processed logits (``-inf`` on padding rows)."""
    count = rows.cond.shape[0]
    tau = torch.empty((count,), dtype=torch.float32, device=rows.cond.device)
    if count:
        _threshold_kernel[(count,)](
            *_logit_args(rows), rows.positions, rows.row_sample, tau, rows.vocab, rows.top_k, float(rows.top_p),
            HAS_UNCOND=rows.uncond is not None, USE_TOP_K=0 < rows.top_k < rows.vocab, USE_TOP_P=rows.top_p < 1.0,
            BLOCK=rows.block, num_warps=_num_warps(rows.block), enable_fp_fusion=False,
        )
    return tau


def launch_accept(rows: LogitRows, drafts: Drafts, draws: Tensor, uniforms: Optional[Tensor]) -> tuple[Tensor, tuple, Tensor]:
    """``(accepted [T] bool, (m, s, amax) row statistics for :func:`launch_sample`, status [T] int8)``.

    ``status`` is 1 on a row with NaN logits, 2 on a row left without probability mass."""
    count, device = rows.cond.shape[0], rows.cond.device
    accepted = torch.empty(count, dtype=torch.bool, device=device)
    m = torch.empty(count, dtype=torch.float32, device=device)
    s = torch.empty(count, dtype=torch.float32, device=device)
    amax = torch.empty(count, dtype=torch.int64, device=device)
    status = torch.empty(count, dtype=torch.int8, device=device)
    if count:
        q = drafts.q if drafts.q is not None else rows.cond
        q_index = drafts.q_index if drafts.q_index is not None else drafts.tokens
        u = m
        if uniforms is not None:
            u = uniforms if uniforms.dtype == torch.float32 and uniforms.is_contiguous() else uniforms.to(torch.float32).contiguous()
        _accept_kernel[(count,)](
            *_logit_args(rows), rows.tau if rows.tau is not None else m,
            drafts.tokens, q, q.stride(0), q_index,
            rows.row_sample, rows.seeds, rows.positions, draws, u,
            accepted, m, s, amax, status, rows.vocab,
            HAS_UNCOND=rows.uncond is not None, GREEDY=rows.greedy, HAS_TAU=rows.tau is not None,
            HAS_DENSE=drafts.q is not None, INJECTED=uniforms is not None, BLOCK=rows.block,
            num_warps=_num_warps(rows.block), enable_fp_fusion=False,
        )
    return accepted, (m, s, amax), status


def launch_first_rejection(accepted: Tensor, row_start: Tensor, num_drafts: Tensor) -> Tensor:
    """``[B]`` leading accepted rows of each sample's draft rows (``accepted`` bool; other dtypes are converted)."""
    out = torch.empty(num_drafts.shape[0], dtype=torch.int64, device=accepted.device)
    if out.numel():
        if accepted.dtype != torch.bool or not accepted.is_contiguous():
            accepted = accepted.to(torch.bool).contiguous()
        _first_rejection_kernel[(out.numel(),)](accepted, row_start, num_drafts, out, num_warps=1, enable_fp_fusion=False)
    return out


def launch_sample(rows: LogitRows, stats: tuple, request: SampleRequest, drafts: Drafts) -> tuple[Tensor, Tensor]:
    """``(residual_tokens [T], fresh_tokens [T])`` for a checked ``request``; ``stats`` from :func:`launch_accept`.

    The kernel samples a residual only on rows with a draft and nothing on padding rows, so ``request`` needs no
    masking here; ``request.fresh_stream`` is one :class:`~vispec.kernels.philox.Stream` or an int64 ``[T]``."""
    count, device = rows.cond.shape[0], rows.cond.device
    residual_out = torch.empty((count,), dtype=torch.int64, device=device)
    fresh_out = torch.empty((count,), dtype=torch.int64, device=device)
    if count == 0:
        return residual_out, fresh_out
    m, s, amax = stats
    q = drafts.q if drafts.q is not None else rows.cond
    q_index = drafts.q_index if drafts.q_index is not None else drafts.tokens
    residual, fresh = (flags if flags.is_contiguous() else flags.contiguous() for flags in (request.residual, request.fresh))
    per_row_stream = isinstance(request.fresh_stream, Tensor)
    injected = request.noise is not None
    residual_noise = request.noise.residual.to(torch.float32).contiguous() if injected else m
    fresh_noise = request.noise.fresh.to(torch.float32).contiguous() if injected else m
    store = request.store_rows is not None
    out = request.store_out if store else m
    _sample_kernel[(count,)](
        *_logit_args(rows), rows.tau if rows.tau is not None else m,
        drafts.tokens, q, q.stride(0), q_index,
        m, s, amax, residual, fresh,
        rows.row_sample, rows.seeds, rows.positions, request.residual_draws,
        request.fresh_stream if per_row_stream else request.fresh_draws, -1 if per_row_stream else int(request.fresh_stream),
        request.fresh_draws,
        residual_noise, fresh_noise, rows.vocab if injected else 0,
        request.store_rows if store else drafts.tokens, out, out.stride(0) if store else 0,
        residual_out, fresh_out, rows.vocab,
        HAS_UNCOND=rows.uncond is not None, GREEDY=rows.greedy, HAS_TAU=rows.tau is not None,
        HAS_DENSE=drafts.q is not None, INJECTED=injected, STORE=store, BLOCK=rows.block,
        num_warps=_num_warps(rows.block), enable_fp_fusion=False,
    )
    return residual_out, fresh_out
