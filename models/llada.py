"""LLaDA, a masked diffusion language model (Nie et al., "Large Language Diffusion Models", arXiv 2502.09992).

A Llama-style Transformer *encoder* (the causal mask removed), state-dict compatible with the official
``GSAI-ML/LLaDA-8B-*`` checkpoints (``modeling_llada.py``, OLMo-derived, ``block_type="llama"``):

* blocks ``h = x + attn_out(Attn(RMSNorm(x)))``, ``y = h + ff_out(silu(ff_proj(z)) * up_proj(z))`` with
  ``z = RMSNorm(h)``; separate ``q_proj``/``k_proj``/``v_proj``; no biases; untied LM head;
* RoPE (base ``rope_theta``) on half-split pairs: dimension ``i`` pairs with ``i + head_dim / 2``,
  ``x' = x cos(p w) + rotate_half(x) sin(p w)``, ``w_i = rope_theta^(-2i / head_dim)``, in float32
  (RMSNorm and RoPE come from :mod:`vispec.models.layers`, shared with the LlamaGen GPT);
* grouped-query attention when ``n_kv_heads < n_heads`` (each key head serves ``n_heads / n_kv_heads``
  query heads);
* logits have ``embedding_size`` columns (the padded embedding width, >= ``vocab_size``) exactly like
  the original; columns ``>= vocab_size`` belong to no token. Parameter names are the official ones
  (``model.transformer.wte``, ``model.transformer.blocks.{i}.q_proj``, ..., ``model.transformer.ln_f``,
  ``model.transformer.ff_out``), so official state dicts load with no renaming.

**Forward contract** (every sampler uses it)::

    out = model(input_ids, attention_mask)    # input_ids [B, N]; attention_mask [B, N] (1 = real) or None
    out.logits                                # [B, N, embedding_size], float32

Padding is a real bidirectional key-padding mask (use left padding; pad id != mask id): padded keys are
hidden from every query. RoPE positions are ``cumsum(attention_mask) - 1`` clamped at 0, so a left-padded
row gives the same logits at its real tokens as the row alone. (The original remote code used absolute
positions and, before Oct 2025, ignored the mask; spec ``dllm.md`` §1.1.) With ``logits_shift=True``
(Dream-style models) output ``i`` holds the logits computed at position ``i - 1`` (output 0 keeps its own).

**Block KV cache** (Fast-dLLM, Wu et al., arXiv 2505.22618; spec ``dllm.md`` §4.3)::

    out = model.compute_kv_cache(x, attention_mask)      # one full forward: out.logits, out.kv_cache
    cache = out.kv_cache                                 # per layer K (RoPE applied) and V, all N positions
    # DualCache: forward only the block [s, e); prefix and suffix K/V come from the cache
    logits = model.forward_span(x[:, s:e], s, cache).logits                  # [B, e - s, V]
    # PrefixCache: forward the block and everything after it against the cached prefix
    logits = model.forward_span(x[:, s:], s, cache).logits

``forward_span`` writes the span's fresh K/V into ``cache`` at ``[s, e)`` (as the DualCache does in place)
and attends to ``cache[:, :N]`` (``use_suffix=True``) or ``cache[:, :e]`` (``use_suffix=False``: the span
ignores positions after it). Keys are stored after RoPE together with each row's positions, so rows keep
their own padding and positions (batch > 1 with different left padding is exact). With a cache computed
from the current sequence the span logits equal the full forward's; with a stale cache only the cached
positions' contributions are stale: the approximation Fast-dLLM makes on purpose. Refresh the cache (one
full forward, counted as an NFE) at block boundaries.

**Delayed cache** (dKV-Cache, Ma et al., arXiv 2505.15781; spec ``dllm.md`` §11): ``forward_positions``
computes an arbitrary per-row set of positions (ragged sets padded, the padding writing nothing) against
the cached K/V of all the others, writing the queried positions' fresh K/V into the cache first (with
``logits_shift`` the logits at ``p`` need ``p - 1`` queried too)::

    logits = model.forward_positions(ids.gather(1, index), index, cache, query_mask=real).logits  # [B, Q, V]

**Static, compilable forwards.** Each entry point (``forward``, ``compute_kv_cache``, ``forward_span``) checks
its arguments on the host (shapes, dtypes, ``start``; nothing read back from a tensor) and then runs a core,
``_full_core`` or ``_span_core``, that reads no tensor value on the host and branches only on shapes and
Python flags: no ``.item()``, no skipping an all-ones mask (a given ``attention_mask`` is always applied;
pass None when nothing is padded), and the span's positions enter as an index tensor, so ``start`` does not
shape the graph. With ``compile=True`` the entry points run the core through
``torch.compile(fullgraph=True)`` (:meth:`LLaDAModelLM.compiled_core`, cached on the model)::

    model(x, mask, compile=True)                                  # one graph per input shape
    model.forward_span(x[:, s:e], s, cache, compile=True)         # one graph for every block start
    model.forward_span(x[:, s:], s, cache, compile=True, dynamic=True)  # shrinking spans: symbolic length
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.models.modeling_utils import ModelMixin
from diffusers.utils import BaseOutput
from diffusers.utils.accelerate_utils import apply_forward_hook
from torch import Tensor, nn

from vispec.models.checkpoints import CheckedFromPretrained
from vispec.models.layers import RMSNorm, apply_rope_half, rope_cos_sin
from vispec.models.offload import weight_device

# The official GSAI-ML/LLaDA-8B-{Base,Instruct} configuration (spec dllm.md §1.1).
LLADA_8B_CONFIG: dict[str, object] = dict(
    d_model=4096, n_heads=32, n_kv_heads=32, n_layers=32, mlp_hidden_size=12288, vocab_size=126464,
    embedding_size=126464, max_sequence_length=4096, rope_theta=500000.0, rms_norm_eps=1e-5,
    mask_token_id=126336, eos_token_id=126081, eot_token_id=126348, pad_token_id=126081, bos_token_id=126080,
)


def position_ids_from_mask(attention_mask: Optional[Tensor], batch: int, length: int, device: torch.device) -> Tensor:
    """RoPE positions ``[B, N]``: ``cumsum(mask) - 1`` clamped at 0 (left padding invariant), else ``arange``."""
    if attention_mask is None:
        return torch.arange(length, device=device)[None].expand(batch, -1)
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def key_mask(attention_mask: Optional[Tensor]) -> Optional[Tensor]:
    """Bool key mask ``[B, N]`` (True = visible) from ``attention_mask`` (0/1 or bool), or None for None.

    An all-padding row sees every key (finite garbage instead of NaN). No value is read back: a given mask
    is always applied, even when it hides nothing (callers that know there is no padding pass None, as
    :func:`vispec.dllm.decode` does after one check before its block loop).
    """
    if attention_mask is None:
        return None
    mask = attention_mask.bool()
    return mask | ~mask.any(-1, keepdim=True)


class LLaDABlock(nn.Module):
    """One pre-norm encoder block with the official parameter names (module docstring)."""

    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int, hidden: int, eps: float, qkv_bias: bool = False):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, d_model // n_heads
        self.attn_norm = RMSNorm(d_model, eps)
        self.q_proj = nn.Linear(d_model, d_model, bias=qkv_bias)  # biases: Qwen2 / Dream (include_qkv_bias)
        self.k_proj = nn.Linear(d_model, n_kv_heads * self.head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(d_model, n_kv_heads * self.head_dim, bias=qkv_bias)
        self.attn_out = nn.Linear(d_model, d_model, bias=False)
        self.ff_norm = RMSNorm(d_model, eps)
        self.ff_proj = nn.Linear(d_model, hidden, bias=False)  # gate
        self.up_proj = nn.Linear(d_model, hidden, bias=False)
        self.ff_out = nn.Linear(hidden, d_model, bias=False)  # down

    def project(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Queries ``[B, H, T, hd]``, keys and values ``[B, Hkv, T, hd]``; RoPE applied to q and k."""
        bsz, length, _ = x.shape
        h = self.attn_norm(x)
        q = self.q_proj(h).view(bsz, length, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(h).view(bsz, length, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(h).view(bsz, length, self.n_kv_heads, self.head_dim).transpose(1, 2)
        return apply_rope_half(q, cos, sin), apply_rope_half(k, cos, sin), v

    def finish(self, x: Tensor, q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor]) -> Tensor:
        """Attention of ``q`` over ``k, v`` (``mask`` bool ``[B, 1, 1, Tk]``, True = visible), then the MLP."""
        if self.n_kv_heads != self.n_heads:
            k = k.repeat_interleave(self.n_heads // self.n_kv_heads, dim=1)
            v = v.repeat_interleave(self.n_heads // self.n_kv_heads, dim=1)
        att = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=False)
        h = x + self.attn_out(att.transpose(1, 2).reshape(x.shape))
        z = self.ff_norm(h)
        return h + self.ff_out(F.silu(self.ff_proj(z)) * self.up_proj(z))

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Optional[Tensor]) -> Tensor:
        q, k, v = self.project(x, cos, sin)
        return self.finish(x, q, k, v, mask)


class LLaDABackbone(nn.Module):
    """Holds ``transformer = {wte, blocks, ln_f, ff_out}`` so that names read ``model.transformer.*``."""

    def __init__(self, d_model, n_heads, n_kv_heads, n_layers, hidden, embedding_size, eps, qkv_bias=False):
        super().__init__()
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(embedding_size, d_model),
                blocks=nn.ModuleList(LLaDABlock(d_model, n_heads, n_kv_heads, hidden, eps, qkv_bias) for _ in range(n_layers)),
                ln_f=RMSNorm(d_model, eps),
                ff_out=nn.Linear(d_model, embedding_size, bias=False),
            )
        )


@dataclass
class LLaDAKVCache:
    """Per-layer keys (RoPE applied) and values of a full sequence, for block-cached decoding.

    ``keys[l]``, ``values[l]``: ``[B, n_kv_heads, N, head_dim]``. ``input_ids [B, N]`` are the tokens the
    entries come from (``forward_span`` writes its span into them too), ``positions [B, N]`` the RoPE
    positions and ``key_mask [B, N]`` (True = real token; None = no padding) the padding mask.
    """

    keys: list[Tensor]
    values: list[Tensor]
    input_ids: Tensor
    positions: Tensor
    key_mask: Optional[Tensor]

    @property
    def batch_size(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def seq_len(self) -> int:
        return int(self.input_ids.shape[1])

    def select(self, index: Tensor) -> "LLaDAKVCache":
        """Keep only rows ``index`` (e.g. drop finished sequences from the batch)."""
        index = index.to(self.input_ids.device)
        return LLaDAKVCache(
            [k[index] for k in self.keys], [v[index] for v in self.values], self.input_ids[index],
            self.positions[index], None if self.key_mask is None else self.key_mask[index],
        )

    def clone(self) -> "LLaDAKVCache":
        """An independent copy (``forward_span`` writes into the cache in place)."""
        return LLaDAKVCache(
            [k.clone() for k in self.keys], [v.clone() for v in self.values], self.input_ids.clone(),
            self.positions.clone(), None if self.key_mask is None else self.key_mask.clone(),
        )


@dataclass
class LLaDAOutput(BaseOutput):
    """``logits`` ``[B, T, embedding_size]`` float32; ``kv_cache`` only from :meth:`LLaDAModelLM.compute_kv_cache`."""

    logits: Tensor
    kv_cache: Optional[LLaDAKVCache] = None


class LLaDAModelLM(CheckedFromPretrained, ModelMixin, ConfigMixin):
    """LLaDA mask predictor (module docstring). Config fields use the official ``config.json`` names.

    Defaults are the LLaDA-8B configuration; token ids that are not None must lie below ``embedding_size``.
    ``include_qkv_bias=True`` adds biases to ``q_proj``/``k_proj``/``v_proj`` (Qwen2-derived models such as
    Dream, :mod:`vispec.models.dream_checkpoint`); LLaDA has none.
    """

    _no_split_modules = ["LLaDABlock"]
    compile_recompile_limit = 64  # per compiled core, while it runs (:meth:`compiled_core`)

    @register_to_config
    def __init__(
        self,
        d_model: int = 4096,
        n_heads: int = 32,
        n_kv_heads: Optional[int] = None,
        n_layers: int = 32,
        mlp_hidden_size: int = 12288,
        vocab_size: int = 126464,
        embedding_size: Optional[int] = 126464,
        max_sequence_length: int = 4096,
        rope_theta: float = 500000.0,
        rms_norm_eps: float = 1e-5,
        mask_token_id: int = 126336,
        eos_token_id: Optional[int] = 126081,
        eot_token_id: Optional[int] = 126348,
        pad_token_id: Optional[int] = 126081,
        bos_token_id: Optional[int] = 126080,
        logits_shift: bool = False,
        init_std: float = 0.02,
        include_qkv_bias: bool = False,
    ):
        super().__init__()
        n_kv_heads = n_kv_heads or n_heads
        if d_model % n_heads != 0 or (d_model // n_heads) % 2 != 0:
            raise ValueError(f"d_model={d_model} must split into n_heads={n_heads} heads of even size (RoPE pairs)")
        if n_heads % n_kv_heads != 0:
            raise ValueError(f"n_heads={n_heads} must be a multiple of n_kv_heads={n_kv_heads}")
        width = embedding_size or vocab_size
        if width < vocab_size:
            raise ValueError(f"embedding_size={embedding_size} must be at least vocab_size={vocab_size}")
        for name, value in [("mask_token_id", mask_token_id), ("eos_token_id", eos_token_id), ("eot_token_id", eot_token_id),
                            ("pad_token_id", pad_token_id), ("bos_token_id", bos_token_id)]:
            if value is not None and not 0 <= value < width:
                raise ValueError(
                    f"{name}={value} must lie in [0, {width}) (the embedding size); pass {name}= for this vocabulary"
                )
        if pad_token_id is not None and pad_token_id == mask_token_id:
            raise ValueError(f"pad_token_id must differ from mask_token_id (both {mask_token_id})")
        self.model = LLaDABackbone(d_model, n_heads, n_kv_heads, n_layers, mlp_hidden_size, width, rms_norm_eps,
                                   bool(include_qkv_bias))
        self.apply(self._init_weights)

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=self.config.init_std)

    # ------------------------------------------------------------------ helpers
    @property
    def device(self) -> torch.device:
        """Where the model computes: its weights' device (cheaper than ModelMixin's walk over all modules, used
        per step), or accelerate's execution device while sequential offload parks the weights on ``meta``."""
        wte = self.model.transformer.wte
        return weight_device(wte, wte.weight)

    @property
    def dtype(self) -> torch.dtype:
        return self.model.transformer.wte.weight.dtype

    @property
    def mask_token_id(self) -> int:
        return self.config.mask_token_id

    @property
    def head_dim(self) -> int:
        return self.config.d_model // self.config.n_heads

    def _check_ids(self, input_ids: Tensor, name: str, batch: Optional[int] = None) -> None:
        if not isinstance(input_ids, Tensor) or input_ids.dim() != 2 or input_ids.dtype not in (torch.int64, torch.int32):
            got = f"{tuple(input_ids.shape)} {input_ids.dtype}" if isinstance(input_ids, Tensor) else type(input_ids).__name__
            raise ValueError(f"{name} must be an integer tensor of shape [batch, length], got {got}")
        if batch is not None and input_ids.shape[0] != batch:
            raise ValueError(f"{name} must have {batch} rows (the cache's batch), got {input_ids.shape[0]}")
        if input_ids.shape[1] < 1:
            raise ValueError(f"{name} must hold at least one position, got shape {tuple(input_ids.shape)}")

    def _check_mask(self, attention_mask: Optional[Tensor], shape: torch.Size) -> Optional[Tensor]:
        """Shape check only (no read-back): ``attention_mask`` on the model's device, or None."""
        if attention_mask is None:
            return None
        if attention_mask.shape != shape:
            raise ValueError(f"attention_mask must have shape {tuple(shape)} like input_ids, got {tuple(attention_mask.shape)}")
        return attention_mask.to(self.device)

    def _rope(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        return rope_cos_sin(positions, self.head_dim, self.config.rope_theta)

    def _head(self, h: Tensor) -> Tensor:
        t = self.model.transformer
        return t.ff_out(t.ln_f(h)).float()

    # ------------------------------------------------------------------ full forward
    def forward(
        self, input_ids: Tensor, attention_mask: Optional[Tensor] = None, position_ids: Optional[Tensor] = None, *,
        compile: bool = False,
    ) -> LLaDAOutput:
        """Logits ``[B, N, embedding_size]`` (float32) for ``input_ids [B, N]`` (mask token at masked positions).

        ``attention_mask [B, N]``: 1/True for real tokens, 0/False for (left) padding, hidden from all queries.
        ``position_ids [B, N]`` override the RoPE positions (default ``cumsum(attention_mask) - 1``).
        ``compile``: run the static core through ``torch.compile(fullgraph=True)`` (:meth:`compiled_core`).
        """
        return self._full(input_ids, attention_mask, position_ids, keep_kv=False, compile=compile)

    @apply_forward_hook  # cached decoding calls this, not forward: offload hooks must fire here too
    @torch.no_grad()
    def compute_kv_cache(
        self, input_ids: Tensor, attention_mask: Optional[Tensor] = None, position_ids: Optional[Tensor] = None, *,
        compile: bool = False,
    ) -> LLaDAOutput:
        """One full forward returning ``logits`` (as :meth:`forward`) and ``kv_cache`` for :meth:`forward_span`."""
        return self._full(input_ids, attention_mask, position_ids, keep_kv=True, compile=compile)

    def _full(self, input_ids: Tensor, attention_mask: Optional[Tensor], position_ids: Optional[Tensor], keep_kv: bool,
              compile: bool) -> LLaDAOutput:
        self._check_ids(input_ids, "input_ids")
        input_ids = input_ids.to(self.device)
        attention_mask = self._check_mask(attention_mask, input_ids.shape)
        if position_ids is not None:
            if position_ids.shape != input_ids.shape:
                raise ValueError(
                    f"position_ids must have shape {tuple(input_ids.shape)} like input_ids, got {tuple(position_ids.shape)}"
                )
            position_ids = position_ids.to(self.device)
        core = self.compiled_core("_full_core") if compile else self._full_core
        logits, keys, values, positions, mask = core(input_ids, attention_mask, position_ids, keep_kv)
        cache = LLaDAKVCache(keys, values, input_ids.clone(), positions, mask) if keep_kv else None
        return LLaDAOutput(logits=logits, kv_cache=cache)

    def _full_core(
        self, input_ids: Tensor, attention_mask: Optional[Tensor], position_ids: Optional[Tensor], keep_kv: bool
    ) -> tuple[Tensor, list[Tensor], list[Tensor], Tensor, Optional[Tensor]]:
        """The full forward on checked inputs: static shapes, no host read-back (compilable with ``fullgraph``).

        Returns ``logits`` and, with ``keep_kv``, the per-layer K/V, the RoPE positions and the key mask.
        """
        bsz, length = input_ids.shape
        mask = key_mask(attention_mask)
        if position_ids is None:
            position_ids = position_ids_from_mask(attention_mask, bsz, length, input_ids.device)
        cos, sin = self._rope(position_ids)
        attn_mask = None if mask is None else mask[:, None, None, :]
        h = self.model.transformer.wte(input_ids)
        keys, values = [], []
        for block in self.model.transformer.blocks:
            q, k, v = block.project(h, cos, sin)
            if keep_kv:
                keys.append(k.contiguous())
                values.append(v.contiguous())
            h = block.finish(h, q, k, v, attn_mask)
        logits = self._head(h)
        if self.config.logits_shift:
            logits = torch.cat([logits[:, :1], logits[:, :-1]], dim=1)
        return logits, keys, values, (position_ids.clone() if keep_kv else position_ids), mask

    # ------------------------------------------------------------------ block-cached forward
    @apply_forward_hook  # cached decoding calls this, not forward: offload hooks must fire here too
    @torch.no_grad()
    def forward_span(self, span_ids: Tensor, start: int, cache: LLaDAKVCache, *, use_suffix: bool = True,
                     compile: bool = False, dynamic: bool = False) -> LLaDAOutput:
        """Logits ``[B, S, embedding_size]`` for positions ``[start, start + S)`` given ``span_ids [B, S]``.

        The span's queries attend to the cached K/V of positions ``[0, start)`` (and ``[start + S, N)`` with
        ``use_suffix``; DualCache) plus the span's fresh K/V, which are written into ``cache`` at the span's
        positions (in place). Padding and RoPE positions come from the cache, so every row keeps its own.
        With ``logits_shift`` the position before the span is recomputed too (from ``cache.input_ids``).

        The span's positions reach the core as an index tensor, not as slice bounds, so one graph serves
        every ``start`` (``compile=True``: :meth:`compiled_core`; ``dynamic=True`` compiles it with
        symbolic shapes, for spans whose length changes from call to call, as PrefixCache's do).
        """
        if not isinstance(cache, LLaDAKVCache):
            raise ValueError(f"cache must be a LLaDAKVCache from compute_kv_cache, got {type(cache).__name__}")
        self._check_ids(span_ids, "span_ids", cache.batch_size)
        width, total = span_ids.shape[1], cache.seq_len
        try:
            start = operator.index(start)
        except TypeError:
            raise ValueError(f"start must be an integer, got {type(start).__name__}") from None
        if start < 0 or start + width > total:
            raise ValueError(f"start must satisfy 0 <= start and start + span length ({width}) <= {total}, got {start}")
        end = start + width
        lo = start - 1 if self.config.logits_shift and start > 0 else start
        index = torch.arange(lo, end, device=self.device)
        core = self.compiled_core("_span_core", dynamic=dynamic) if compile else self._span_core
        span_ids = span_ids.to(self.device, cache.input_ids.dtype)
        logits = core(span_ids, index, start - lo, None if use_suffix else end, cache.input_ids,
                      cache.positions, cache.key_mask, cache.keys, cache.values)
        return LLaDAOutput(logits=logits)

    def _span_core(self, span_ids: Tensor, index: Tensor, offset: int, kv_end: Optional[int], cache_ids: Tensor,
                   positions: Tensor, mask: Optional[Tensor], keys: list[Tensor], values: list[Tensor]) -> Tensor:
        """The span forward on checked inputs: static shapes, no host read-back (compilable with ``fullgraph``).

        ``index [W]``: the positions computed (the span, after ``offset`` recomputed ones before it for
        ``logits_shift``); ``kv_end``: attend to cache positions ``[0, kv_end)`` (None: all). Writes the
        span's ids and K/V into the cache tensors in place.
        """
        span = index[offset:]
        cache_ids.index_copy_(1, span, span_ids)
        ids = cache_ids.index_select(1, index)
        cos, sin = self._rope(positions.index_select(1, index))
        attn_mask = None if mask is None else mask[:, None, None, :kv_end]
        h = self.model.transformer.wte(ids)
        for block, k_cache, v_cache in zip(self.model.transformer.blocks, keys, values):
            q, k, v = block.project(h, cos, sin)
            k_cache.index_copy_(2, span, k[:, :, offset:])
            v_cache.index_copy_(2, span, v[:, :, offset:])
            h = block.finish(h, q, k_cache[:, :, :kv_end], v_cache[:, :, :kv_end], attn_mask)
        logits = self._head(h)
        if self.config.logits_shift:
            logits = logits[:, :-1] if offset else torch.cat([logits[:, :1], logits[:, :-1]], dim=1)
        return logits

    # ------------------------------------------------------------------ delayed (dKV) cached forward
    @apply_forward_hook  # cached decoding calls this, not forward: offload hooks must fire here too
    @torch.no_grad()
    def forward_positions(self, query_ids: Tensor, query_index: Tensor, cache: LLaDAKVCache, *,
                          query_mask: Optional[Tensor] = None) -> LLaDAOutput:
        """Logits ``[B, Q, embedding_size]`` at the per-row positions ``query_index [B, Q]``, which hold ``query_ids``.

        The partial forward of dKV-Cache (Ma et al., "dKV-Cache: The Cache for Diffusion Language Models",
        arXiv 2505.15781; spec ``dllm.md`` §11). Row ``b`` computes only the positions
        ``P_b = {query_index[b, j] : query_mask[b, j]}``. In every layer ``l`` their fresh keys and values
        (RoPE at ``cache.positions[b, p]``) are first written into ``cache`` at ``P_b``, in place, and then
        the queries attend over all ``N`` cached positions, padding hidden by ``cache.key_mask``::

            K_l[b, :, p] <- k_l(h_l(p)),  V_l[b, :, p] <- v_l(h_l(p))          for p in P_b
            h_{l+1}(p) = block_l(h_l(p); softmax(q_l(p) K_l[b]^T / sqrt(d) + log m_b) V_l[b])

        so a queried position sees its own and the other queried positions' fresh K/V and the cached K/V
        of every other position; ``cache.input_ids`` at ``P_b`` become ``query_ids``. When the cached
        entries of the unqueried positions are current (computed from the present sequence), the logits equal
        the full forward's at ``P_b`` up to float rounding; stale entries make only their own contributions
        stale (dKV-Cache's approximation: decoded tokens' K/V barely change after the step that follows
        their decoding).

        Ragged query sets share one batch through ``query_mask [B, Q]`` (None: every entry is real):
        an entry with False is a padding query. Its logits are garbage and it writes nothing (the
        cache keeps its old K/V and id there), so no row's padding changes any row's cache or logits. Every
        entry, padding included, needs an index in ``[0, N)``, distinct within its row (give padding queries
        unqueried positions); this is checked with one host read-back. Shapes follow ``Q``, which changes
        from call to call: this entry point is eager only.

        With ``logits_shift`` (Dream-style) the logits at ``p >= 1`` come from the hidden state at ``p - 1``, as
        in :meth:`forward`: they are NaN for a query whose ``p - 1`` is not among the row's real queries (query
        ``p - 1`` too wherever the logits at ``p`` are wanted); position 0 keeps its own.
        """
        if not isinstance(cache, LLaDAKVCache):
            raise ValueError(f"cache must be a LLaDAKVCache from compute_kv_cache, got {type(cache).__name__}")
        self._check_ids(query_ids, "query_ids", cache.batch_size)
        shape, total = query_ids.shape, cache.seq_len
        if (not isinstance(query_index, Tensor) or query_index.shape != shape
                or query_index.dtype not in (torch.int64, torch.int32)):
            got = (f"{tuple(query_index.shape)} {query_index.dtype}" if isinstance(query_index, Tensor)
                   else type(query_index).__name__)
            raise ValueError(f"query_index must be an integer tensor of shape {tuple(shape)} like query_ids, got {got}")
        if shape[1] > total:
            raise ValueError(f"query_ids must hold at most the cache's {total} positions per row, got {shape[1]}")
        if query_mask is not None and (not isinstance(query_mask, Tensor) or query_mask.shape != shape):
            got = tuple(query_mask.shape) if isinstance(query_mask, Tensor) else type(query_mask).__name__
            raise ValueError(f"query_mask must be None or a tensor of shape {tuple(shape)} like query_ids, got {got}")
        index = query_index.to(self.device, torch.long)
        valid = None if query_mask is None else query_mask.to(self.device).bool()
        ordered = index.sort(dim=1).values
        bad = (ordered[:, 0] < 0) | (ordered[:, -1] >= total) | (ordered[:, 1:] == ordered[:, :-1]).any(dim=1)
        source = None
        if self.config.logits_shift:  # the column holding position p - 1 (p for p = 0), per query
            column = torch.full((index.shape[0], total + 1), -1, dtype=torch.long, device=index.device)
            real = torch.ones_like(index, dtype=torch.bool) if valid is None else valid
            columns = torch.arange(index.shape[1], device=index.device).expand_as(index)
            column.scatter_(1, torch.where(real, index, total).clamp(0, total), torch.where(real, columns, -1))
            source = column.gather(1, (index - 1).clamp(0, total))
            source = torch.where(index == 0, columns, source)
        if bool(bad.any()):
            raise ValueError(f"query_index must hold distinct positions in [0, {total}) within each row (rows "
                             f"{bad.nonzero().squeeze(1).tolist()} do not)")
        ids = query_ids.to(self.device, cache.input_ids.dtype)
        logits = self._positions_core(ids, index, valid, source, cache.input_ids, cache.positions, cache.key_mask,
                                      cache.keys, cache.values)
        return LLaDAOutput(logits=logits)

    def _positions_core(self, ids: Tensor, index: Tensor, valid: Optional[Tensor], source: Optional[Tensor],
                        cache_ids: Tensor, positions: Tensor, mask: Optional[Tensor], keys: list[Tensor],
                        values: list[Tensor]) -> Tensor:
        """:meth:`forward_positions` on checked inputs: gather the queries' RoPE positions, and per layer
        scatter their fresh K/V into the cache (old values where ``valid`` is False) before attending.
        ``source [B, Q]`` (``logits_shift`` only): the query column whose hidden state gives each query's logits
        (-1: none, NaN logits)."""
        written = ids if valid is None else torch.where(valid, ids, cache_ids.gather(1, index))
        cache_ids.scatter_(1, index, written)
        cos, sin = self._rope(positions.gather(1, index))
        attn_mask = None if mask is None else mask[:, None, None, :]
        keep = None if valid is None else valid[:, None, :, None]
        h = self.model.transformer.wte(ids)
        for block, k_cache, v_cache in zip(self.model.transformer.blocks, keys, values):
            q, k, v = block.project(h, cos, sin)
            where = index[:, None, :, None].expand(-1, k.shape[1], -1, k.shape[3])
            if keep is not None:
                k = torch.where(keep, k, k_cache.gather(2, where))
                v = torch.where(keep, v, v_cache.gather(2, where))
            k_cache.scatter_(2, where, k.to(k_cache.dtype))
            v_cache.scatter_(2, where, v.to(v_cache.dtype))
            h = block.finish(h, q, k_cache, v_cache, attn_mask)
        if source is None:
            return self._head(h)
        logits = self._head(h.gather(1, source.clamp(min=0)[..., None].expand(-1, -1, h.shape[-1])))
        return logits.masked_fill((source < 0)[..., None], float("nan"))

    # ------------------------------------------------------------------ torch.compile
    def compiled_core(self, name: str, dynamic: bool = False) -> Callable:
        """``torch.compile(core, fullgraph=True, dynamic=dynamic)`` of ``"_full_core"`` or ``"_span_core"``,
        cached on the model (repeated calls reuse the graphs; a new input shape compiles a new graph once).

        The cores read no tensor value on the host and branch only on shapes and Python flags, so
        ``fullgraph=True`` holds (any graph break raises). ``dynamic=False`` specialises on every shape;
        torch's per-function recompile limit (``torch._dynamo.config.recompile_limit``, 8 by default, a
        hard error with ``fullgraph``) is raised to :attr:`compile_recompile_limit` while a compiled core
        runs, so that many prompt lengths and batch sizes can each get their graph.
        """
        if name not in ("_full_core", "_span_core"):
            raise ValueError(f"name must be '_full_core' or '_span_core', got {name!r}")
        cores = self.__dict__.setdefault("_compiled_cores", {})
        key = (name, bool(dynamic))
        if key not in cores:
            compiled = torch.compile(getattr(self, name), fullgraph=True, dynamic=bool(dynamic))
            limit = self.compile_recompile_limit

            def run(*args, _compiled=compiled):
                with torch._dynamo.config.patch(recompile_limit=max(limit, torch._dynamo.config.recompile_limit)):
                    return _compiled(*args)

            cores[key] = run
        return cores[key]
