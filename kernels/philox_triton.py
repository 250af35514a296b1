"""Philox noise inside Triton kernels, bit for bit the numbers of :mod:`vispec.kernels.philox`.

Counters are ``(c0, c1, c2, c3) = (vocabulary block, absolute position, stream, draw)`` under the
sample's 64-bit seed, as in the PyTorch module. One Philox evaluation yields four words; for a tile
of ``BLOCK`` vocabulary entries starting at a multiple of ``BLOCK`` we evaluate ``BLOCK / 4``
counters and interleave the words, so entry ``v`` is word ``v % 4`` of block ``v // 4`` (float64
noise: words ``2 (v % 2)`` and ``2 (v % 2) + 1`` of block ``v // 2``). Nothing of size
``[rows, vocab]`` is stored: MC-SJD's Gumbel coupling noise at an absolute position is recomputed
wherever it is needed.
"""

from __future__ import annotations

import triton
import triton.language as tl

N_ROUNDS: tl.constexpr = tl.constexpr(10)


@triton.jit
def u32(x):
    """Low 32 bits of an integer as uint32 (the PyTorch reference masks with ``& 0xFFFFFFFF``)."""
    return (tl.full((), 0, tl.int64) + x).to(tl.uint32)


@triton.jit
def uniform_from_word(x):
    """``((x >> 9) + 1/2) / 2**23`` in float32: strictly inside (0, 1)."""
    return ((x >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)


@triton.jit
def scalar_uniform(seed, position, stream, draw):
    """The uniform :func:`vispec.kernels.philox.uniforms` gives without a vocabulary (word 0, ``c0 = 0``)."""
    zero = tl.zeros((1,), dtype=tl.uint32)
    w0, w1, w2, w3 = tl.random.philox(seed, zero, zero + u32(position), zero + u32(stream), zero + u32(draw), N_ROUNDS)
    return tl.sum(uniform_from_word(w0), axis=0)


@triton.jit
def tile_words(seed, tile_start, position, stream, draw, BLOCK: tl.constexpr):
    """``[BLOCK]`` uint32 words for vocabulary entries ``tile_start + arange(BLOCK)`` (``tile_start % 4 == 0``)."""
    blocks = (tile_start // 4 + tl.arange(0, BLOCK // 4)).to(tl.uint32)
    zero = tl.zeros((BLOCK // 4,), dtype=tl.uint32)
    w0, w1, w2, w3 = tl.random.philox(seed, blocks, zero + u32(position), zero + u32(stream), zero + u32(draw), N_ROUNDS)
    return tl.interleave(tl.interleave(w0, w2), tl.interleave(w1, w3))


@triton.jit
def tile_uniforms(seed, tile_start, position, stream, draw, BLOCK: tl.constexpr):
    """``[BLOCK]`` float32 uniforms, one per vocabulary entry of the tile."""
    return uniform_from_word(tile_words(seed, tile_start, position, stream, draw, BLOCK))


@triton.jit
def tile_exponentials(seed, tile_start, position, stream, draw, BLOCK: tl.constexpr):
    """``[BLOCK]`` standard exponentials ``-log(u)`` (float32) for the exponential race."""
    return -tl.log(tile_uniforms(seed, tile_start, position, stream, draw, BLOCK))


@triton.jit
def tile_uniforms64(seed, tile_start, position, stream, draw, BLOCK: tl.constexpr):
    """``[BLOCK]`` float64 uniforms with 53 random bits (:func:`vispec.kernels.philox.uniforms64`)."""
    blocks = (tile_start // 2 + tl.arange(0, BLOCK // 2)).to(tl.uint32)
    zero = tl.zeros((BLOCK // 2,), dtype=tl.uint32)
    w0, w1, w2, w3 = tl.random.philox(seed, blocks, zero + u32(position), zero + u32(stream), zero + u32(draw), N_ROUNDS)
    high = tl.interleave(w0, w2).to(tl.uint64)
    low = tl.interleave(w1, w3).to(tl.uint64)
    bits = (high >> 5) * 67108864 + (low >> 6)
    return (bits.to(tl.float64) + 0.5) * 1.1102230246251565e-16


@triton.jit
def _vocab_noise_kernel(out_ptr, seed_ptr, pos_ptr, stream_ptr, draw_ptr, V, stride_row,
                        KIND: tl.constexpr, BLOCK: tl.constexpr):
    """Row ``r`` of ``out`` gets noise for every vocabulary entry (KIND 0: float32 uniforms,
    1: exponentials, 2: float64 uniforms, 3: raw words)."""
    row = tl.program_id(0)
    seed = tl.load(seed_ptr + row)
    pos = tl.load(pos_ptr + row)
    stream = tl.load(stream_ptr + row)
    draw = tl.load(draw_ptr + row)
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        if KIND == 0:
            vals = tile_uniforms(seed, start, pos, stream, draw, BLOCK)
        elif KIND == 1:
            vals = tile_exponentials(seed, start, pos, stream, draw, BLOCK)
        elif KIND == 2:
            vals = tile_uniforms64(seed, start, pos, stream, draw, BLOCK)
        else:
            vals = tile_words(seed, start, pos, stream, draw, BLOCK).to(tl.int64)
        tl.store(out_ptr + row * stride_row + offs, vals, mask=offs < V)


@triton.jit
def _scalar_uniform_kernel(out_ptr, seed_ptr, pos_ptr, stream_ptr, draw_ptr):
    row = tl.program_id(0)
    u = scalar_uniform(tl.load(seed_ptr + row), tl.load(pos_ptr + row), tl.load(stream_ptr + row), tl.load(draw_ptr + row))
    tl.store(out_ptr + row, u)


def compile_configs() -> list[tuple[str, object, dict[str, str], dict[str, object]]]:
    """The noise kernels' configurations for ``triton.compile`` (see :func:`vispec.kernels.verify_triton.compile_configs`)."""
    configs = []
    for kind, dtype in ((0, "fp32"), (1, "fp32"), (2, "fp64"), (3, "i64")):
        signature = {"out_ptr": f"*{dtype}", "seed_ptr": "*i64", "pos_ptr": "*i64", "stream_ptr": "*i64", "draw_ptr": "*i64",
                     "V": "i32", "stride_row": "i64", "KIND": "constexpr", "BLOCK": "constexpr"}
        configs.append((f"vocab_noise[kind={kind}]", _vocab_noise_kernel, signature, {"KIND": kind, "BLOCK": 1024}))
    signature = {"out_ptr": "*fp32", "seed_ptr": "*i64", "pos_ptr": "*i64", "stream_ptr": "*i64", "draw_ptr": "*i64"}
    configs.append(("scalar_uniform", _scalar_uniform_kernel, signature, {}))
    return configs
