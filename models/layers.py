"""Layers the LlamaGen GPT and LLaDA share: RMSNorm, rotary position embeddings (RoPE) and masked attention.

* :class:`RMSNorm`: ``x / sqrt(mean(x²) + eps) * weight``, normalised in float32 and cast back before
  the weight (as LlamaGen and LLaDA/OLMo do).
* RoPE frequencies :func:`rope_inv_freq`: ``w_i = base^(-2i / dim)`` for ``i < dim / 2`` (float32).
  Two pairings of the rotated dimensions, both computed in float32 and cast back to the input dtype:

  - *interleaved* pairs ``(2i, 2i + 1)`` (LlamaGen, Meta Llama): :func:`rope_cache_2d` builds LlamaGen's
    2-D table over a ``g x g`` token grid (row angles in the first half of the pairs, column angles in
    the second; all-zero rows for the condition tokens) and :func:`apply_rope_interleaved` rotates;
  - *half-split* pairs ``(i, i + head_dim / 2)`` (LLaDA, GPT-NeoX): :func:`rope_cos_sin` gives
    ``cos``/``sin`` for integer positions and :func:`apply_rope_half` rotates,
    ``x' = x cos + rotate_half(x) sin``.
* :func:`masked_attention`: ``softmax(q k^T / sqrt(d) + log mask) v`` in plain tensor ops, for compiled CPU steps.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn


class RMSNorm(nn.Module):
    """Root-mean-square layer norm with a learnt scale (no bias, no mean subtraction)."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def rope_inv_freq(dim: int, base: float, device: Optional[torch.device] = None) -> Tensor:
    """``[dim // 2]`` float32 inverse frequencies ``base^(-2i / dim)`` of a rotary embedding over ``dim`` dimensions."""
    return 1.0 / (base ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim))


# ---------------------------------------------------------------------------- interleaved pairs (LlamaGen)
def rope_cache_2d(grid_size: int, head_dim: int, base: float, cls_token_num: int) -> Tensor:
    """``[cls_token_num + g*g, head_dim // 2, 2]`` (cos, sin) of LlamaGen's 2-D RoPE; zeros for the condition tokens.

    Each axis gets ``head_dim // 2`` dimensions: the first ``head_dim // 4`` pairs rotate by the token's
    row, the last ``head_dim // 4`` by its column (tokens in raster order)."""
    half = head_dim // 2
    inv_freq = rope_inv_freq(half, base)
    angles = torch.outer(torch.arange(grid_size).float(), inv_freq)  # [g, half // 2]
    grid = torch.cat(
        [angles[:, None, :].expand(-1, grid_size, -1), angles[None, :, :].expand(grid_size, -1, -1)], dim=-1
    )  # [g, g, half]: row angles then column angles
    cache = torch.stack([grid.cos(), grid.sin()], dim=-1).flatten(0, 1)
    return torch.cat([torch.zeros(cls_token_num, half, 2), cache])


def apply_rope_interleaved(x: Tensor, cache: Tensor) -> Tensor:
    """Rotate ``x [B, T, H, hd]`` by ``cache [B or 1, T, hd // 2, 2]`` (cos, sin) on pairs of adjacent dims."""
    pairs = x.float().reshape(*x.shape[:-1], -1, 2)
    cos, sin = cache[:, :, None, :, 0], cache[:, :, None, :, 1]
    out = torch.stack([pairs[..., 0] * cos - pairs[..., 1] * sin, pairs[..., 1] * cos + pairs[..., 0] * sin], dim=-1)
    return out.flatten(3).type_as(x)


# ---------------------------------------------------------------------------- half-split pairs (LLaDA)
def rope_cos_sin(positions: Tensor, head_dim: int, theta: float) -> tuple[Tensor, Tensor]:
    """``(cos, sin)`` of shape ``[B, T, head_dim]`` (float32) for integer ``positions [B, T]`` (half-split pairs)."""
    inv_freq = rope_inv_freq(head_dim, theta, positions.device)
    angles = positions.float()[..., None] * inv_freq  # [B, T, head_dim / 2]
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rope_half(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x [B, H, T, hd]`` (half-split pairs, as LLaDA / GPT-NeoX) by ``cos, sin [B, T, hd]``."""
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (xf * cos[:, None] + rotated * sin[:, None]).type_as(x)


def masked_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
    """``softmax(q kᵀ / sqrt(d), keys where mask is False left out) v`` for ``q [B, H, Tq, d]``, ``k, v [B, H, Tk, d]``
    and a bool ``mask`` broadcastable to ``[B, H, Tq, Tk]`` (True = visible; every query must see a key).

    What ``F.scaled_dot_product_attention`` computes, written as plain tensor ops so that ``torch.compile`` on CPU
    fuses it into the step's own C++ kernels. Through SDPA inductor calls ATen's CPU flash-attention kernel instead,
    whose blocking costs ~0.1 ms per call on a decode step's few query rows: on tiny-c2i's compiled AR step at batch
    16 that was a fifth of the step (``samples/ar_step_bench.py``). Official LlamaGen gets the same effect by running
    its compiled decode under ``sdp_kernel(enable_math=True)``. Results differ from SDPA's in float rounding only.

    In bfloat16 (and float16, which takes the same oneDNN path; measured in bfloat16 only) the scores are computed as
    ``(k qᵀ)ᵀ``: the same products, with the keys as the left operand. A decode whose cache has room for wider windows
    than the current one (``window=auto``) reads a prefix of each row's keys, a batch of matrices whose batch stride
    is the cache's capacity, and ATen's oneDNN batched product copies such an operand before multiplying; as the
    right operand of ``q kᵀ`` that copy is dear (one thread, 8 matrices of 273 keys in a 321-key cache, 16 query rows:
    102 µs against 44 in a cache of their own size), as the left operand of ``k qᵀ`` cheap (48 against 38). On
    tiny-c2i's compiled forward the 64-row cache's extra cost at 1-16 rows fell from 7-34% to 7-14%
    (``samples/window_cost.py --slack 64``); what remains is mostly the values' product ``p v``, whose strided right
    operand is still copied. float32 (a BLAS path with no copy) keeps ``q kᵀ``, which is faster there."""
    q = q * q.shape[-1] ** -0.5
    if q.dtype in (torch.bfloat16, torch.float16):
        scores = (k @ q.transpose(-2, -1)).transpose(-2, -1)
    else:
        scores = q @ k.transpose(-2, -1)
    return scores.masked_fill(~mask, float("-inf")).softmax(dim=-1).to(v.dtype) @ v
