r"""Triton kernel for recursive rejection sampling (RRS) of ``K`` sibling candidates: one program per row.

Computes, bit for bit, what :func:`vispec.kernels.multi_verify.rrs_reference` computes (module docstring of
:mod:`vispec.kernels.multi_verify`: the recursion, its proof and its arithmetic) in the two modes SJD-PAC uses:

* ``HAS_Q``: the candidates were drawn in order without replacement from one base row ``q [R, V]``;
  ``q_i`` (``q`` with ``x_1 .. x_{i-1}`` zeroed, renormalised, then normalised once more, exactly the values of
  ``rrs_reference(p, without_replacement(q, candidates), ...)``) is recomputed tile by tile and never stored;
* one-hot (``q=None``): ``q_i`` is one-hot on ``x_i``.

Program ``r`` loops over the ranks ``i = 0 .. K-1`` and, at each rank it reaches, over the vocabulary in tiles
of ``BLOCK`` entries. Nothing of size ``[R, K, V]`` or ``[R, V]`` is stored: the residual ``r_{i-1}`` of a tile is
*replayed* from ``p`` with the per-rank scalars kept in registers (``S_j = Σ r_{j-1}``, the two normalisers of
``q_j``, and whether rank ``j`` updated the residual), applying ``r ← max(0, r - S_j q_j)`` for each earlier
updating rank; that is the reference's elementwise arithmetic on the same float64 values, so the replayed
tile is bit-identical to the reference's ``r``. Per rank reached (no acceptance yet):

1. one pass: ``S = Σ r_{i-1}``, ``A = Σ q_masked`` (``q`` without the earlier candidates), ``r_{i-1}(x_i)`` and
   ``q_masked(x_i)``;
2. (``HAS_Q``) one pass: ``B = Σ q_masked / A``; ``q_i = (q_masked / A) / B`` (zero where a mass is zero);
3. the test ``u_i · q_i(x_i) · S < r_{i-1}(x_i)`` (float64, left to right);
4. on a rejection, one pass: does ``max(0, r_{i-1} - S · q_i)`` keep any mass (else the row keeps ``r_{i-1}``)?

and, when every candidate was rejected, a last pass: the race ``argmax_v r_K(v) / E_v`` (first maximal index,
as :func:`vispec.kernels.verify.race_argmax`).

Sums. A float sum depends on its order, so both sides use one order, :func:`vispec.kernels.multi_verify.pairwise_sum`:
the perfect binary tree over adjacent pairs of the row zero-padded to a power of two. A tile (``BLOCK`` a power
of two, tiles aligned) is a subtree of that tree, summed level by level with explicit elementwise adds
(not ``tl.sum``, whose order depends on the layout); the tile sums are merged by a binary counter that forms
exactly the upper levels of the same tree (:func:`_pass`). Every float op
is then the same IEEE operation on the same operands as in the reference (float64 ``+ - * /``, no FMA:
``enable_fp_fusion=False``), independent of ``BLOCK``, of ``num_warps`` and of the device.

Noise (``INJECTED`` off) is generated in the kernel from the row's keys as :func:`vispec.kernels.multi_verify.rrs_noise`
does: rank ``k``'s uniform is word ``k % 4`` of Philox block ``c0 = k // 4`` of ``(position, ACCEPT, draw)``
(bit for bit), the race's exponentials are :func:`vispec.kernels.philox_triton.tile_exponentials` of
``(position, RESIDUAL, draw)``, the single-draft residual race's noise of :mod:`vispec.kernels.verify_triton`.
The one thing not reproduced bit for bit is the float32 ``log`` inside ``E = -log u``: Triton's ``log`` (and, in
the interpreter, numpy's) may round differently from torch's in the last bit (as for every Triton race in
this package), so a residual race whose two best keys agree to ~1e-7 relative may pick differently. With
``INJECTED`` the kernel reads the uniforms ``[R, K]`` and exponentials ``[R, V]`` instead (float64), and
agrees with the reference bit for bit in every case.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from vispec.kernels.philox import Stream
from vispec.kernels.philox_triton import N_ROUNDS, u32, tile_exponentials, uniform_from_word

ACCEPT_STREAM: tl.constexpr = tl.constexpr(int(Stream.ACCEPT))
RESIDUAL_STREAM: tl.constexpr = tl.constexpr(int(Stream.RESIDUAL))
#: Levels of the binary counter that merges tile sums: up to ``2**STACK - 1`` tiles per row.
STACK: tl.constexpr = tl.constexpr(32)
#: Levels of the in-tile pairwise tree that are unrolled (``BLOCK <= 2**TREE_LEVELS``).
TREE_LEVELS: tl.constexpr = tl.constexpr(16)

MIN_BLOCK = 16  # tile_exponentials needs tiles of whole Philox blocks (4 entries); 16 keeps every arange legal
MAX_BLOCK = 1024  # the default tile width's cap (larger powers of two up to 2**TREE_LEVELS are accepted)

_TL_TYPES = {torch.float16: "*fp16", torch.bfloat16: "*bf16", torch.float32: "*fp32", torch.float64: "*fp64"}


# ---- one pass over a row -------------------------------------------------------------------------------------
# The work of a pass is in one jit function (:func:`_pass`, its mode a constexpr) rather than in small helpers
# called per tile: Triton's interpreter, which runs the tests on CPU, re-patches the language on every call of a
# nested jit function (milliseconds each).
#
# ``where(m > 0, x / where(m > 0, m, 1), 0)`` is the reference's ``_normalised`` (elementwise, or on a scalar).
# The per-rank scalars live in a ``[RANKS, 4]`` float64 table, columns ``(S_j, A_j, B_j, updated_j)``: ``S_j =
# Σ r_{j-1}``, ``A_j`` and ``B_j`` the two normalisers of ``q_j``, ``updated_j`` 1.0 when rank ``j`` replaced ``r``
# by its residual. ``max(where(lane == j, table, -inf))`` reads row ``j`` exactly.

SUMS: tl.constexpr = tl.constexpr(0)  # (Σ r, Σ q_masked) and (r(x), q_masked(x))
NORM: tl.constexpr = tl.constexpr(1)  # (Σ q_masked / A, 0)
RESIDUAL: tl.constexpr = tl.constexpr(2)  # does max(0, r - S q_i) keep any mass?
RACE: tl.constexpr = tl.constexpr(3)  # argmax r / E, first maximal index


@triton.jit
def _pass(p_row, q_row, c_row, V, upto, x, table, mass, q_mass, q_norm, seed, pos, draw, e_row,
          MODE: tl.constexpr, HAS_Q: tl.constexpr, INJECTED: tl.constexpr, RANKS: tl.constexpr,
          BLOCK: tl.constexpr):
    """One pass over the row's tiles with the residual ``r`` after ranks ``0 .. upto-1`` (replayed per tile from
    ``p`` and ``table``) and the draft row ``q_i`` of the rank whose candidate is ``x`` (normalisers ``q_mass``,
    ``q_norm``). Returns ``(totals [2], at [2], positive, best_idx)``, meaningful per ``MODE`` (above).

    Sums: two rows summed together in :func:`vispec.kernels.multi_verify.pairwise_sum`'s order. A tile (a power
    of two, aligned) is a subtree of its tree, summed level by level with elementwise adds of adjacent pairs (not
    ``tl.sum``, whose order depends on the layout); tile sums are merged by a binary counter: ``stack[l]`` holds
    the sum of the last complete run of ``2**l`` tiles and absorbs tile ``t`` while bit ``l`` of ``t`` is set (a
    merge, left run + right run, is a node of the upper levels of the same tree); at the end the pending runs
    are added right to left, each to the sum of those right of it, which starts at 0: the padded tree adds a run
    whose right sibling is padding to a zero subtree."""
    lane = tl.arange(0, BLOCK)
    lanes = tl.arange(0, RANKS)[:, None]
    levels = tl.arange(0, STACK)[:, None]
    n_tiles = (V + BLOCK - 1) // BLOCK
    stack = tl.full((STACK, 2), 0.0, tl.float64)
    at = tl.full((2,), float("-inf"), tl.float64)
    positive = tl.full((), 0.0, tl.float64)
    best = tl.full((), -1.0, tl.float64)
    best_idx = tl.full((), 0, tl.int64)
    for t in range(0, n_tiles):
        start = t * BLOCK
        offs = start + lane
        valid = offs < V
        r = tl.full((BLOCK,), 0.0, tl.float64)
        if MODE != NORM:
            r = tl.load(p_row + offs, mask=valid, other=0.0).to(tl.float64)
        q_base = tl.full((BLOCK,), 0.0, tl.float64)
        if HAS_Q:
            q_base = tl.load(q_row + offs, mask=valid, other=0.0).to(tl.float64)
        removed = offs < 0
        for j in range(0, upto):
            x_j = tl.load(c_row + j)
            if MODE != NORM:
                values = tl.max(tl.where(lanes == j, table, float("-inf")), axis=0)  # (S_j, A_j, B_j, updated_j)
                mass_norm_j, q_mass_updated_j = tl.split(tl.reshape(values, 2, 2))
                mass_j, q_norm_j = tl.split(mass_norm_j)
                q_mass_j, updated_j = tl.split(q_mass_updated_j)
                if updated_j > 0:  # r = max(0, r - S_j q_j)
                    if HAS_Q:
                        q_j = tl.where(removed, 0.0, q_base)
                        q_j = tl.where(q_mass_j > 0, q_j / tl.where(q_mass_j > 0, q_mass_j, 1.0), 0.0)
                        q_j = tl.where(q_norm_j > 0, q_j / tl.where(q_norm_j > 0, q_norm_j, 1.0), 0.0)
                    else:
                        q_j = tl.where(offs == x_j, 1.0, 0.0).to(tl.float64)
                    r = tl.maximum(r - mass_j * q_j, 0.0)
            removed = removed | (offs == x_j)
        q_masked = tl.where(removed, 0.0, q_base)
        if MODE == SUMS or MODE == NORM:
            if MODE == SUMS:
                pair = tl.trans(tl.join(r, q_masked))  # [2, BLOCK]
                at = tl.maximum(at, tl.max(tl.where(offs[None, :] == x, pair, float("-inf")), axis=1))
            else:
                q_once = tl.where(q_mass > 0, q_masked / tl.where(q_mass > 0, q_mass, 1.0), 0.0)
                pair = tl.trans(tl.join(q_once, r))  # r is 0 here
            for _ in tl.static_range(TREE_LEVELS):
                if pair.shape[1] > 1:
                    even, odd = tl.split(tl.reshape(pair, 2, pair.shape[1] // 2, 2))
                    pair = even + odd
            cur = tl.reshape(pair, 2)  # the tile's two sums
            level = 0
            while ((t >> level) & 1) != 0:
                cur = tl.max(tl.where(levels == level, stack, float("-inf")), axis=0) + cur
                level += 1
            stack = tl.where(levels == level, cur[None, :], stack)
        if MODE == RESIDUAL:
            if HAS_Q:
                q_i = tl.where(q_mass > 0, q_masked / tl.where(q_mass > 0, q_mass, 1.0), 0.0)
                q_i = tl.where(q_norm > 0, q_i / tl.where(q_norm > 0, q_norm, 1.0), 0.0)
            else:
                q_i = tl.where(offs == x, 1.0, 0.0).to(tl.float64)
            residual = tl.maximum(r - mass * q_i, 0.0)
            positive = tl.maximum(positive, tl.max(tl.where(residual > 0, 1.0, 0.0), axis=0).to(tl.float64))
        if MODE == RACE:
            if INJECTED:
                e = tl.load(e_row + offs, mask=valid, other=1.0).to(tl.float64)
            else:
                e = tile_exponentials(seed, start, pos, RESIDUAL_STREAM, draw, BLOCK).to(tl.float64)
            key = tl.where(valid, r / e, -1.0)
            tile_best = tl.max(key, axis=0)
            tile_idx = tl.argmax(key, axis=0).to(tl.int64) + start
            better = tile_best > best
            best_idx = tl.where(better, tile_idx, best_idx)
            best = tl.where(better, tile_best, best)
    totals = tl.full((2,), 0.0, tl.float64)
    if MODE == SUMS or MODE == NORM:
        level = 0
        while (n_tiles >> level) != 0:
            if ((n_tiles >> level) & 1) != 0:
                totals = tl.max(tl.where(levels == level, stack, float("-inf")), axis=0) + totals
            level += 1
    return totals, at, positive, best_idx


@triton.jit
def _rank_uniform(seed, rank, position, draw):
    """Rank ``rank``'s acceptance uniform: word ``rank % 4`` of Philox block ``c0 = rank // 4`` of
    ``(position, ACCEPT, draw)`` (:func:`vispec.kernels.race.words_for`), float32."""
    zero = tl.zeros((1,), dtype=tl.uint32)
    w0, w1, w2, w3 = tl.random.philox(seed, zero + u32(rank // 4), zero + u32(position), zero + u32(ACCEPT_STREAM),
                                      zero + u32(draw), N_ROUNDS)
    word = rank % 4
    w = tl.where(word == 0, w0, tl.where(word == 1, w1, tl.where(word == 2, w2, w3)))
    return tl.sum(uniform_from_word(w), axis=0)


@triton.jit
def _rrs_kernel(
    p_ptr, stride_p, q_ptr, stride_q, cand_ptr, stride_c,
    seed_ptr, pos_ptr, draw_ptr, u_ptr, stride_u, e_ptr, stride_e,
    rank_ptr, token_ptr, V, K,
    HAS_Q: tl.constexpr, INJECTED: tl.constexpr, RANKS: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    p_row = p_ptr + row * stride_p
    q_row = q_ptr + row * stride_q
    c_row = cand_ptr + row * stride_c
    e_row = e_ptr + row * stride_e
    lanes = tl.arange(0, RANKS)[:, None]
    columns = tl.arange(0, 4)[None, :]
    table = tl.full((RANKS, 4), 0.0, tl.float64)  # per-rank scalars (RANKS >= K), see above
    seed = tl.full((), 0, tl.int64)
    pos = tl.full((), 0, tl.int64)
    draw = tl.full((), 0, tl.int64)
    if not INJECTED:
        seed = tl.load(seed_ptr + row)
        pos = tl.load(pos_ptr + row)
        draw = tl.load(draw_ptr + row)
    zero = tl.full((), 0.0, tl.float64)
    accepted = tl.full((), -1, tl.int64)
    token = tl.full((), -1, tl.int64)

    for i in range(0, K):
        x = tl.load(c_row + i)
        if (x >= 0) & (accepted < 0):
            # pass 1: S = Σ r_{i-1}, A = Σ q_masked (q_base without the earlier candidates), r_{i-1}(x), q_masked(x)
            # (compiled Triton types every name, ``_`` included: each unused output gets its own name)
            sums, at, positive_1, token_1 = _pass(p_row, q_row, c_row, V, i, x, table, zero, zero, zero, seed, pos, draw,
                                                  e_row, SUMS, HAS_Q, INJECTED, RANKS, BLOCK)
            mass, q_mass = tl.split(sums)
            r_at, qm_at = tl.split(at)
            q_norm = zero
            q_at = tl.full((), 1.0, tl.float64)
            if HAS_Q:
                # pass 2: B = Σ q_masked / A (without_replacement's row, which rrs_reference normalises again)
                norms, at_2, positive_2, token_2 = _pass(p_row, q_row, c_row, V, i, x, table, mass, q_mass, zero, seed,
                                                         pos, draw, e_row, NORM, HAS_Q, INJECTED, RANKS, BLOCK)
                q_norm, zero_2 = tl.split(norms)
                q_at = tl.where(q_mass > 0, qm_at / tl.where(q_mass > 0, q_mass, 1.0), 0.0)
                q_at = tl.where(q_norm > 0, q_at / tl.where(q_norm > 0, q_norm, 1.0), 0.0)
            if INJECTED:
                u = tl.load(u_ptr + row * stride_u + i).to(tl.float64)
            else:
                u = _rank_uniform(seed, i, pos, draw).to(tl.float64)
            if u * q_at * mass < r_at:  # (u q_i(x)) S < r_{i-1}(x), as the reference
                accepted = tl.full((), 0, tl.int64) + i
                token = x
            else:
                # pass 3: does the residual max(0, r_{i-1} - S q_i) keep any mass? (else r is kept)
                sums_3, at_3, positive, token_3 = _pass(p_row, q_row, c_row, V, i, x, table, mass, q_mass, q_norm, seed,
                                                        pos, draw, e_row, RESIDUAL, HAS_Q, INJECTED, RANKS, BLOCK)
                values = tl.where(columns == 0, mass, tl.where(columns == 1, q_mass, tl.where(columns == 2, q_norm, positive)))
                table = tl.where(lanes == i, values, table)

    if accepted < 0:
        # every candidate rejected (or none): the race argmax_v r_K(v) / E_v, first maximal index
        sums_4, at_4, positive_4, token = _pass(p_row, q_row, c_row, V, K, -1, table, zero, zero, zero, seed, pos, draw,
                                                e_row, RACE, HAS_Q, INJECTED, RANKS, BLOCK)
    tl.store(rank_ptr + row, accepted)
    tl.store(token_ptr + row, token)


# ---- configurations and launcher ------------------------------------------------------------------------------


def _ranks(k: int) -> int:
    """Lanes of the per-rank registers: a power of two >= max(K, 2)."""
    return max(2, triton.next_power_of_2(max(int(k), 1)))


def default_block(vocab: int) -> int:
    """Tile width: the next power of two of ``V``, clamped to ``[MIN_BLOCK, MAX_BLOCK]`` (the result does not
    depend on it: module docstring)."""
    return max(MIN_BLOCK, min(MAX_BLOCK, triton.next_power_of_2(max(int(vocab), 1))))


def check_block(block: Optional[int], vocab: int) -> int:
    """``block`` (or :func:`default_block`) as an int, or a ``ValueError`` naming ``block``."""
    if block is None:
        return default_block(vocab)
    if isinstance(block, bool) or not isinstance(block, int) or block < MIN_BLOCK or block > 2 ** TREE_LEVELS.value \
            or block & (block - 1):
        raise ValueError(f"block must be a power of two in [{MIN_BLOCK}, {2 ** TREE_LEVELS.value}], got {block!r}")
    return block


def compile_configs() -> list[tuple[str, object, dict[str, str], dict[str, object]]]:
    """The configurations of :func:`_rrs_kernel` to check with ``triton.compile`` (see
    :func:`vispec.kernels.verify_triton.compile_configs`): with and without ``q`` times keyed or injected noise
    (fp32 rows, rank registers for ``K <= 4``, tile width ``MAX_BLOCK``); the rank registers for ``K <= 2`` and
    ``K <= 8``; fp64 and bf16 rows; the narrowest tile ``MIN_BLOCK`` with and without ``q``. (The rank register
    width, the row dtype and the tile width change only shapes and loads, not the code path.)"""
    def signature(dtype: str) -> dict[str, str]:
        return {"p_ptr": dtype, "stride_p": "i64", "q_ptr": dtype, "stride_q": "i64", "cand_ptr": "*i64", "stride_c": "i64",
                "seed_ptr": "*i64", "pos_ptr": "*i64", "draw_ptr": "*i64", "u_ptr": "*fp64", "stride_u": "i64",
                "e_ptr": "*fp64", "stride_e": "i64", "rank_ptr": "*i64", "token_ptr": "*i64", "V": "i32", "K": "i32",
                "HAS_Q": "constexpr", "INJECTED": "constexpr", "RANKS": "constexpr", "BLOCK": "constexpr"}

    variants = [(has_q, injected, 4, "*fp32", MAX_BLOCK) for has_q in (True, False) for injected in (False, True)]
    variants += [(True, False, ranks, "*fp32", MAX_BLOCK) for ranks in (2, 8)]
    variants += [(True, False, 4, dtype, MAX_BLOCK) for dtype in ("*fp64", "*bf16")]
    variants += [(has_q, False, 4, "*fp32", MIN_BLOCK) for has_q in (True, False)]
    configs = []
    for has_q, injected, ranks, dtype, block in variants:
        flags = {"HAS_Q": has_q, "INJECTED": injected, "RANKS": ranks, "BLOCK": block}
        name = f"rrs[{dtype[1:]},q={has_q},injected={injected},ranks={ranks},block={block}]"
        configs.append((name, _rrs_kernel, signature(dtype), flags))
    return configs


def _rows(x: Tensor) -> Tensor:
    """A ``[R, V]`` row tensor in a dtype the kernel loads, with unit last stride."""
    if x.dtype not in _TL_TYPES:
        x = x.to(torch.float64)
    return x if x.stride(-1) == 1 else x.contiguous()


def launch_rrs(p: Tensor, q: Optional[Tensor], candidates: Tensor, seeds: Optional[Tensor] = None,
               positions: Optional[Tensor] = None, draws: Optional[Tensor] = None, *,
               uniforms: Optional[Tensor] = None, exponentials: Optional[Tensor] = None,
               block: Optional[int] = None, num_warps: Optional[int] = None) -> tuple[Tensor, Tensor]:
    """``(accepted_rank [R], token [R])`` int64 for checked arguments (:func:`vispec.kernels.multi_verify.rrs`
    checks them): ``p [R, V]`` floating, ``q [R, V]`` floating base draft rows (candidates drawn without
    replacement) or ``None`` (one-hot candidates), ``candidates [R, K]`` int64 in ``[-1, V)``.

    Noise: the keys ``seeds``, ``positions``, ``draws`` (``[R]`` int64 each), or, all-or-nothing instead of the
    keys, ``uniforms [R, K]`` and ``exponentials [R, V]`` (any floating dtype, read as float64)."""
    rows, vocab = p.shape
    ranks = candidates.shape[1]
    device = p.device
    accepted = torch.full((rows,), -1, dtype=torch.int64, device=device)
    token = torch.full((rows,), -1, dtype=torch.int64, device=device)
    if rows == 0:
        return accepted, token
    block = check_block(block, vocab)
    p = _rows(p)
    q_arg = _rows(q) if q is not None else p
    # pointers the kernel does not read get a placeholder (an empty tensor's pointer may be null)
    float_placeholder = torch.zeros(1, dtype=torch.float64, device=device)
    candidates = candidates.to(device=device, dtype=torch.int64).contiguous() if ranks else accepted
    injected = uniforms is not None or exponentials is not None
    if injected:
        if uniforms is None or exponentials is None:
            raise ValueError("uniforms and exponentials must be given together (or neither: keyed noise)")
        u = uniforms.to(device=device, dtype=torch.float64).contiguous() if ranks else float_placeholder
        e = exponentials.to(device=device, dtype=torch.float64).contiguous()
        seeds = positions = draws = accepted
    else:
        seeds, positions, draws = (x.to(device=device, dtype=torch.int64).contiguous() for x in (seeds, positions, draws))
        u = e = float_placeholder
    _rrs_kernel[(rows,)](
        p, p.stride(0), q_arg, q_arg.stride(0), candidates, candidates.stride(0) if ranks else 0,
        seeds, positions, draws, u, u.stride(0) if injected and ranks else 0, e, e.stride(0) if injected else 0,
        accepted, token, vocab, ranks,
        HAS_Q=q is not None, INJECTED=injected, RANKS=_ranks(ranks), BLOCK=block,
        num_warps=num_warps or (8 if block >= 2048 else 4), enable_fp_fusion=False,
    )
    return accepted, token
