"""LLaDA2, a block-diffusion language model with a mixture-of-experts decoder (LLaDA 2.0 / 2.1 mini and flash).

Bie et al., "LLaDA2.0: Scaling Up Diffusion Language Models to 100B" (inclusionAI tech report, 2025) and
"LLaDA2.1: Speeding Up Text Diffusion via Token Editing" (arXiv 2602.08676). The network is the BailingMoe-v2 layout
(``model_type = "llada2_moe"``, ``inclusionAI/LLaDA2.0-mini``, ``LLaDA2.1-mini``): a pre-norm Transformer whose
parameter names and ``config.json`` keys are the official ones, so official state dicts load with no renaming
(:mod:`vispec.models.llada2_checkpoint` checks and loads them):

* ``model.word_embeddings`` → ``num_hidden_layers`` decoder layers → ``model.norm`` (RMSNorm) → ``lm_head``
  (untied), logits returned in float32;
* layer ``i``: ``h = x + dense(Attn(input_layernorm(x)))``, ``y = h + mlp(post_attention_layernorm(h))``;
* attention: one fused ``query_key_value`` projection to ``(H + 2 H_kv) · d`` (``d = head_dim``; grouped-query
  attention, each key head serving ``H / H_kv`` query heads), per-head RMSNorm of queries and keys
  (``query_layernorm`` / ``key_layernorm``, ``use_qk_norm``), then *partial* RoPE: only the first
  ``r = d · partial_rotary_factor`` dimensions of each head rotate (half-split pairs ``(i, i + r/2)``,
  ``w_i = rope_theta^(-2i/r)``, computed in float32), the other ``d - r`` pass through; scores scaled by ``d^-1/2``;
* MLP: the first ``first_k_dense_replace`` layers are dense SwiGLU (``down_proj(silu(gate_proj(z)) ⊙ up_proj(z))``);
  the others are sparse MoE blocks (below) plus ``num_shared_experts`` always-on shared experts
  (one SwiGLU of width ``moe_intermediate_size · num_shared_experts``).

**Routing** (DeepSeek-V3-style group-limited sigmoid gate, ``score_function = "sigmoid"``): for a token ``z``,
``s = σ(W_g z)`` over the ``E`` experts (float32); the selection scores ``s + b`` add the load-balancing
``expert_bias`` ``b`` (``moe_router_enable_expert_bias``); experts split into ``n_group`` groups, each group scored by
the sum of its two best selection scores, the best ``topk_group`` groups kept; the ``k = num_experts_per_tok`` best
experts among them are chosen, weighted by their *unbiased* ``s`` normalised to sum 1 (``norm_topk_prob``, for
``k > 1``) times ``routed_scaling_factor``:

    moe(z) = Σ_{e ∈ top-k} w_e · expert_e(z) + shared(z),   w_e = ρ · s_e / Σ_{e' ∈ top-k} s_e'

**Block-causal attention.** LLaDA2 is trained as a block-diffusion model: the sequence splits into blocks of
``block_length`` positions from position 0 and a query sees every key of its own block and of the blocks before it,
never one after. :meth:`LLaDA2MoeModelLM.forward` takes the attention pattern three ways:

* ``attention_mask`` 4-D ``[B or 1, 1, T, T]``: used as given, bool (True = attend) or additive float (0 / -inf), as
  the official ``generate`` builds it;
* ``attention_mask`` 2-D ``[B, T]`` (1 = real token, 0 = padding), as diffusers' ``LLaDA2Pipeline`` passes it: the
  block-causal pattern over blocks of ``config.block_length`` (counted by index from position 0) with the padded
  keys hidden;
* ``attention_mask=None``: the block-causal pattern with every key visible.

``config.block_length = None`` makes the 2-D / absent cases bidirectional instead. A query that would see no key (a
padded query in a block of padding) sees itself, so no row is NaN. ``position_ids`` default to ``0 … T - 1``.

**Exact block cache.** Under block-causal attention the hidden states of a finished block never depend on a later
block, so their keys and values can be cached exactly (:meth:`LLaDA2MoeModelLM.forward_cached` writes a span's K/V
into a :class:`LLaDA2KVCache` and attends over the cached prefix; :mod:`vispec.dllm.block_causal` uses it)::

    cache = model.new_kv_cache(batch, length)
    logits = model.forward_cached(ids[:, c:e], positions[:, c:e], cache, c, mask4).logits   # mask4 [B, 1, e - c, e]

**Precision.** Routing, RMSNorm and RoPE run in float32; the official code rounds ``cos``/``sin`` to the weights' dtype
before rotating, vispec rotates in float32 and casts back: in float32 the two agree to rounding, in bfloat16 they may
differ in the last bits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

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

# The official inclusionAI/LLaDA2.0-mini (and LLaDA2.1-mini) architecture keys, with the LLaDA2 token ids
# (mask <|mask|> 156895, EOS 156892; the padding id is the EOS id).
LLADA2_MINI_CONFIG: dict[str, object] = dict(
    vocab_size=157184, hidden_size=2048, intermediate_size=5120, num_hidden_layers=20, num_attention_heads=16,
    num_key_value_heads=4, head_dim=128, hidden_act="silu", use_qkv_bias=False, use_qk_norm=True, use_bias=False,
    rms_norm_eps=1e-6, max_position_embeddings=32768, rope_theta=600000.0, partial_rotary_factor=0.5,
    num_experts=256, num_shared_experts=1, num_experts_per_tok=8, n_group=8, topk_group=4, routed_scaling_factor=2.5,
    moe_intermediate_size=512, first_k_dense_replace=1, norm_topk_prob=True, score_function="sigmoid",
    moe_router_enable_expert_bias=True, mask_token_id=156895, eos_token_id=156892, pad_token_id=156892,
)


class LLaDA2MoeMLP(nn.Module):
    """SwiGLU ``down_proj(silu(gate_proj(z)) ⊙ up_proj(z))`` without biases (dense layers, experts, shared experts)."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LLaDA2MoeGate(nn.Module):
    """The group-limited sigmoid router (module docstring): ``weight [E, hidden]`` and the ``expert_bias [E]`` buffer."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, n_group: int, topk_group: int,
                 routed_scaling_factor: float, norm_topk_prob: bool, expert_bias: bool):
        super().__init__()
        self.num_experts, self.top_k, self.n_group, self.topk_group = num_experts, top_k, n_group, topk_group
        self.routed_scaling_factor, self.norm_topk_prob = float(routed_scaling_factor), bool(norm_topk_prob)
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        if expert_bias:
            self.register_buffer("expert_bias", torch.zeros(num_experts))
        else:
            self.expert_bias = None

    def forward(self, z: Tensor) -> tuple[Tensor, Tensor]:
        """``(experts [N, k], weights [N, k] float32)`` for tokens ``z [N, hidden]``."""
        scores = torch.sigmoid(F.linear(z.float(), self.weight.float()))
        choice = scores if self.expert_bias is None else scores + self.expert_bias.float()
        per_group = choice.view(z.shape[0], self.n_group, -1)
        group_score = per_group.topk(min(2, per_group.shape[-1]), dim=-1).values.sum(dim=-1)  # [N, n_group]
        groups = group_score.topk(self.topk_group, dim=-1).indices
        keep = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, groups, True)
        choice = choice.masked_fill(~keep.repeat_interleave(per_group.shape[-1], dim=1), float("-inf"))
        experts = choice.topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, experts)
        if self.norm_topk_prob and self.top_k > 1:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return experts, weights * self.routed_scaling_factor


class LLaDA2MoeSparseMoeBlock(nn.Module):
    """``gate``, ``experts.{e}`` and ``shared_experts`` (module docstring). Tokens are grouped by expert (one host
    read-back of the per-expert counts per layer and forward), so each expert runs once on its tokens."""

    def __init__(self, hidden_size: int, moe_intermediate_size: int, num_experts: int, num_shared_experts: Optional[int],
                 gate: LLaDA2MoeGate):
        super().__init__()
        self.gate = gate
        self.experts = nn.ModuleList(LLaDA2MoeMLP(hidden_size, moe_intermediate_size) for _ in range(num_experts))
        self.shared_experts = (LLaDA2MoeMLP(hidden_size, moe_intermediate_size * num_shared_experts)
                               if num_shared_experts else None)

    def forward(self, x: Tensor) -> Tensor:
        z = x.reshape(-1, x.shape[-1])
        experts, weights = self.gate(z)
        k = experts.shape[1]
        flat = experts.reshape(-1)
        order = flat.argsort(stable=True)  # (token, slot) pairs grouped by expert
        token = order // k
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        out = torch.zeros(z.shape, dtype=torch.float32, device=z.device)
        start = 0
        for expert, count in zip(self.experts, counts):
            if count:
                pick = order[start: start + count]
                rows = token[start: start + count]
                y = expert(z[rows]).float() * weights.reshape(-1)[pick, None]
                out.index_add_(0, rows, y)
                start += count
        out = out.to(x.dtype)
        if self.shared_experts is not None:
            out = out + self.shared_experts(z)
        return out.view(x.shape)


class LLaDA2MoeAttention(nn.Module):
    """Fused QKV projection, per-head QK RMSNorm, partial RoPE and the output ``dense`` (module docstring)."""

    def __init__(self, hidden_size: int, heads: int, kv_heads: int, head_dim: int, rotary_dim: int, eps: float,
                 qkv_bias: bool, out_bias: bool, qk_norm: bool):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.rotary_dim = heads, kv_heads, head_dim, rotary_dim
        self.query_key_value = nn.Linear(hidden_size, (heads + 2 * kv_heads) * head_dim, bias=qkv_bias)
        if qk_norm:
            self.query_layernorm = RMSNorm(head_dim, eps)
            self.key_layernorm = RMSNorm(head_dim, eps)
        else:
            self.query_layernorm = self.key_layernorm = None
        self.dense = nn.Linear(heads * head_dim, hidden_size, bias=out_bias)

    def rotate(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        if self.rotary_dim == self.head_dim:
            return apply_rope_half(x, cos, sin)
        return torch.cat([apply_rope_half(x[..., : self.rotary_dim], cos, sin), x[..., self.rotary_dim:]], dim=-1)

    def project(self, h: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Queries ``[B, H, T, d]``, keys and values ``[B, H_kv, T, d]`` (RoPE on queries and keys)."""
        bsz, length, _ = h.shape
        qkv = self.query_key_value(h).view(bsz, length, self.heads + 2 * self.kv_heads, self.head_dim)
        q, k, v = qkv.split([self.heads, self.kv_heads, self.kv_heads], dim=2)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if self.query_layernorm is not None:
            q, k = self.query_layernorm(q), self.key_layernorm(k)
        return self.rotate(q, cos, sin), self.rotate(k, cos, sin), v

    def attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor]) -> Tensor:
        """``dense(softmax(q kᵀ / √d + mask) v)`` with ``mask`` bool (True = attend) or additive, ``[B|1, 1, Tq, Tk]``."""
        if mask is not None and mask.dtype != torch.bool:
            mask = mask.to(q.dtype)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.kv_heads != self.heads)
        return self.dense(out.transpose(1, 2).reshape(q.shape[0], q.shape[2], -1))


class LLaDA2MoeDecoderLayer(nn.Module):
    """``input_layernorm``, ``attention``, ``post_attention_layernorm``, ``mlp`` (dense or sparse)."""

    def __init__(self, attention: LLaDA2MoeAttention, mlp: nn.Module, hidden_size: int, eps: float):
        super().__init__()
        self.input_layernorm = RMSNorm(hidden_size, eps)
        self.attention = attention
        self.post_attention_layernorm = RMSNorm(hidden_size, eps)
        self.mlp = mlp

    def finish(self, x: Tensor, q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor]) -> Tensor:
        h = x + self.attention.attend(q, k, v, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class LLaDA2MoeBackbone(nn.Module):
    """``word_embeddings``, ``layers``, ``norm``: the official ``model.*`` names."""

    def __init__(self, vocab_size: int, hidden_size: int, layers: list[LLaDA2MoeDecoderLayer], eps: float):
        super().__init__()
        self.word_embeddings = nn.Embedding(vocab_size, hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(hidden_size, eps)


@dataclass
class LLaDA2KVCache:
    """Per-layer keys (normed, RoPE applied) and values of every position, ``[B, H_kv, N, d]`` each, filled by
    :meth:`LLaDA2MoeModelLM.forward_cached` span by span."""

    keys: list[Tensor]
    values: list[Tensor]

    @property
    def batch_size(self) -> int:
        return int(self.keys[0].shape[0])

    @property
    def seq_len(self) -> int:
        return int(self.keys[0].shape[2])

    def select(self, rows: Tensor, length: Optional[int] = None) -> "LLaDA2KVCache":
        """A new cache of rows ``rows`` (repeats allowed: several canvases of one row each get a copy) and positions
        ``[0, length)`` (all when None); a forward that writes into it leaves this cache as it is."""
        end = self.seq_len if length is None else length
        return LLaDA2KVCache([k[rows, :, :end] for k in self.keys], [v[rows, :, :end] for v in self.values])


@dataclass
class LLaDA2Output(BaseOutput):
    """``logits`` ``[B, T, vocab_size]``, float32."""

    logits: Tensor


def block_causal_mask(query_index: Tensor, key_index: Tensor, block_length: Optional[int],
                      key_visible: Optional[Tensor] = None) -> Tensor:
    """Bool ``[B|1, 1, Tq, Tk]``: query ``i`` sees key ``j`` when ``j // Lb <= i // Lb`` (every key when
    ``block_length`` is None) and ``key_visible[b, j]``; a query always sees its own position (no empty row)."""
    allowed = torch.ones(query_index.shape[0], key_index.shape[0], dtype=torch.bool, device=query_index.device)
    if block_length is not None:
        allowed = (key_index[None, :] // block_length) <= (query_index[:, None] // block_length)
    allowed = allowed[None]
    if key_visible is not None:
        allowed = allowed & key_visible.to(allowed.device).bool()[:, None, :]
    allowed = allowed | (query_index[:, None] == key_index[None, :])[None]
    return allowed[:, None]


class LLaDA2MoeModelLM(CheckedFromPretrained, ModelMixin, ConfigMixin):
    """LLaDA2 block-diffusion mask predictor (module docstring). Config fields are the official ``config.json`` keys
    (defaults: LLaDA2.0-mini, :data:`LLADA2_MINI_CONFIG`), plus ``mask_token_id`` / ``eos_token_id`` (the ids LLaDA2's
    tokenizer uses) and ``block_length``, the block size of the attention a 2-D or absent mask implies.

    ``attention_layout = "block_causal"`` tells :func:`vispec.dllm.decode` to decode with
    :mod:`vispec.dllm.block_causal` (block-aligned canvas, exact prefix cache, the token-editing policy).
    """

    attention_layout = "block_causal"
    _no_split_modules = ["LLaDA2MoeDecoderLayer"]

    @register_to_config
    def __init__(
        self,
        vocab_size: int = 157184,
        hidden_size: int = 2048,
        intermediate_size: int = 5120,
        num_hidden_layers: int = 20,
        num_attention_heads: int = 16,
        num_key_value_heads: Optional[int] = 4,
        head_dim: Optional[int] = 128,
        hidden_act: str = "silu",
        use_qkv_bias: bool = False,
        use_qk_norm: bool = True,
        use_bias: bool = False,
        rms_norm_eps: float = 1e-6,
        max_position_embeddings: int = 32768,
        rope_theta: float = 600000.0,
        partial_rotary_factor: float = 0.5,
        num_experts: Optional[int] = 256,
        num_shared_experts: Optional[int] = 1,
        num_experts_per_tok: int = 8,
        n_group: int = 8,
        topk_group: int = 4,
        routed_scaling_factor: float = 2.5,
        moe_intermediate_size: Optional[int] = 512,
        first_k_dense_replace: int = 1,
        norm_topk_prob: bool = True,
        score_function: str = "sigmoid",
        moe_router_enable_expert_bias: bool = True,
        mask_token_id: int = 156895,
        eos_token_id: Optional[int] = 156892,
        pad_token_id: Optional[int] = 156892,
        block_length: Optional[int] = 32,
        initializer_range: float = 0.02,
    ):
        super().__init__()
        kv_heads = num_key_value_heads or num_attention_heads
        head_dim = head_dim or hidden_size // num_attention_heads
        rotary_dim = int(head_dim * partial_rotary_factor)
        self._check_config(vocab_size, num_attention_heads, kv_heads, head_dim, rotary_dim, hidden_act, num_experts,
                           num_experts_per_tok, n_group, topk_group, moe_intermediate_size, score_function,
                           mask_token_id, eos_token_id, pad_token_id, block_length, first_k_dense_replace)
        layers = []
        for index in range(num_hidden_layers):
            attention = LLaDA2MoeAttention(hidden_size, num_attention_heads, kv_heads, head_dim, rotary_dim,
                                           rms_norm_eps, use_qkv_bias, use_bias, use_qk_norm)
            if num_experts is None or index < first_k_dense_replace:
                mlp: nn.Module = LLaDA2MoeMLP(hidden_size, intermediate_size)
            else:
                gate = LLaDA2MoeGate(hidden_size, num_experts, num_experts_per_tok, n_group, topk_group,
                                     routed_scaling_factor, norm_topk_prob, moe_router_enable_expert_bias)
                mlp = LLaDA2MoeSparseMoeBlock(hidden_size, moe_intermediate_size, num_experts, num_shared_experts, gate)
            layers.append(LLaDA2MoeDecoderLayer(attention, mlp, hidden_size, rms_norm_eps))
        self.model = LLaDA2MoeBackbone(vocab_size, hidden_size, layers, rms_norm_eps)
        self.lm_head = nn.Linear(hidden_size, vocab_size, bias=False)
        self.rotary_dim, self.kv_heads, self.head_dim = rotary_dim, kv_heads, head_dim
        self.apply(self._init_weights)

    @staticmethod
    def _check_config(vocab_size, heads, kv_heads, head_dim, rotary_dim, hidden_act, num_experts, top_k, n_group,
                      topk_group, moe_intermediate_size, score_function, mask_token_id, eos_token_id, pad_token_id,
                      block_length, first_k_dense_replace) -> None:
        """Configurations the network cannot run raise ``ValueError`` naming the key."""
        if heads % kv_heads:
            raise ValueError(f"num_attention_heads={heads} must be a multiple of num_key_value_heads={kv_heads}")
        if rotary_dim < 2 or rotary_dim % 2 or rotary_dim > head_dim:
            raise ValueError(f"head_dim * partial_rotary_factor = {rotary_dim} must be an even number of rotated "
                             f"dimensions in [2, head_dim={head_dim}]")
        if hidden_act != "silu":
            raise ValueError(f"hidden_act={hidden_act!r}: LLaDA2MoeModelLM implements only 'silu'")
        if first_k_dense_replace < 0:
            raise ValueError(f"first_k_dense_replace must be >= 0, got {first_k_dense_replace}")
        if num_experts is not None:
            if score_function != "sigmoid":
                raise ValueError(f"score_function={score_function!r}: LLaDA2MoeModelLM implements only 'sigmoid'")
            if num_experts < 1 or n_group < 1 or num_experts % n_group:
                raise ValueError(f"num_experts={num_experts} must split into n_group={n_group} equal groups")
            if not 1 <= topk_group <= n_group:
                raise ValueError(f"topk_group={topk_group} must lie in [1, n_group={n_group}]")
            if not 1 <= top_k <= topk_group * (num_experts // n_group):
                raise ValueError(f"num_experts_per_tok={top_k} must lie in [1, topk_group * experts per group = "
                                 f"{topk_group * (num_experts // n_group)}]")
            if not moe_intermediate_size:
                raise ValueError("moe_intermediate_size is needed for the MoE layers (num_experts is set)")
        for name, value in (("mask_token_id", mask_token_id), ("eos_token_id", eos_token_id),
                            ("pad_token_id", pad_token_id)):
            if value is not None and not 0 <= value < vocab_size:
                raise ValueError(f"{name}={value} must lie in [0, vocab_size={vocab_size}); pass {name}= for this "
                                 "vocabulary")
        if pad_token_id is not None and pad_token_id == mask_token_id:
            raise ValueError(f"pad_token_id must differ from mask_token_id (both {mask_token_id})")
        if block_length is not None and (isinstance(block_length, bool) or not isinstance(block_length, int)
                                         or block_length < 1):
            raise ValueError(f"block_length must be None (bidirectional) or a positive integer, got {block_length!r}")

    def _init_weights(self, module: nn.Module) -> None:
        std = self.config.initializer_range
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, LLaDA2MoeGate):
            nn.init.normal_(module.weight, mean=0.0, std=std)

    # ------------------------------------------------------------------ helpers
    @property
    def device(self) -> torch.device:
        """Where the model computes: its embedding's device (accelerate's execution device under offload)."""
        emb = self.model.word_embeddings
        return weight_device(emb, emb.weight)

    @property
    def dtype(self) -> torch.dtype:
        return self.model.word_embeddings.weight.dtype

    @property
    def mask_token_id(self) -> int:
        return self.config.mask_token_id

    def _rope(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        return rope_cos_sin(positions, self.rotary_dim, self.config.rope_theta)

    def _check_ids(self, input_ids: Tensor, name: str) -> None:
        if not isinstance(input_ids, Tensor) or input_ids.dim() != 2 or input_ids.dtype not in (torch.int64, torch.int32):
            got = f"{tuple(input_ids.shape)} {input_ids.dtype}" if isinstance(input_ids, Tensor) else type(input_ids).__name__
            raise ValueError(f"{name} must be an integer tensor of shape [batch, length], got {got}")
        if input_ids.shape[1] < 1:
            raise ValueError(f"{name} must hold at least one position, got shape {tuple(input_ids.shape)}")

    def _check_positions(self, position_ids: Optional[Tensor], shape: torch.Size) -> Optional[Tensor]:
        if position_ids is None:
            return None
        if not isinstance(position_ids, Tensor) or position_ids.dtype.is_floating_point or position_ids.dim() != 2 \
                or position_ids.shape[1] != shape[1] or position_ids.shape[0] not in (1, shape[0]):
            got = tuple(position_ids.shape) if isinstance(position_ids, Tensor) else type(position_ids).__name__
            raise ValueError(f"position_ids must be an integer tensor [batch or 1, {shape[1]}], got {got}")
        return position_ids.to(self.device).expand(shape[0], -1)

    def _attention_mask(self, attention_mask: Optional[Tensor], shape: torch.Size) -> Tensor:
        """The 4-D mask of a full forward from the caller's mask (module docstring)."""
        bsz, length = shape
        index = torch.arange(length, device=self.device)
        if attention_mask is None:
            return block_causal_mask(index, index, self.config.block_length)
        if not isinstance(attention_mask, Tensor):
            raise ValueError(f"attention_mask must be None or a tensor, got {type(attention_mask).__name__}")
        mask = attention_mask.to(self.device)
        if mask.dim() == 2:
            if tuple(mask.shape) != (bsz, length):
                raise ValueError(f"a 2-D attention_mask must have shape {(bsz, length)} like input_ids, got "
                                 f"{tuple(mask.shape)}")
            return block_causal_mask(index, index, self.config.block_length, mask.bool())
        if mask.dim() == 4 and mask.shape[0] in (1, bsz) and mask.shape[1] == 1 and tuple(mask.shape[2:]) == (length, length):
            return mask
        raise ValueError(f"attention_mask must be None, 2-D [batch, {length}] (1 = real token) or 4-D "
                         f"[batch or 1, 1, {length}, {length}] (bool or additive), got {tuple(mask.shape)}")

    # ------------------------------------------------------------------ forwards
    def forward(self, input_ids: Tensor, attention_mask: Optional[Tensor] = None,
                position_ids: Optional[Tensor] = None) -> LLaDA2Output:
        """Logits ``[B, T, vocab_size]`` (float32) for ``input_ids [B, T]``; the masks as in the module docstring.
        ``position_ids [B or 1, T]`` default to ``0 … T - 1``. This forward keeps no cache (:meth:`forward_cached`
        does)."""
        self._check_ids(input_ids, "input_ids")
        input_ids = input_ids.to(self.device)
        mask = self._attention_mask(attention_mask, input_ids.shape)
        positions = self._check_positions(position_ids, input_ids.shape)
        if positions is None:
            positions = torch.arange(input_ids.shape[1], device=self.device)[None].expand(input_ids.shape[0], -1)
        return LLaDA2Output(logits=self._run(input_ids, positions, mask, None, 0, None))

    def new_kv_cache(self, batch: int, length: int) -> LLaDA2KVCache:
        """An empty :class:`LLaDA2KVCache` for ``batch`` rows of ``length`` positions (weights' dtype and device)."""
        shape = (batch, self.kv_heads, length, self.head_dim)
        layers = range(self.config.num_hidden_layers)
        return LLaDA2KVCache([torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in layers],
                             [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in layers])

    @apply_forward_hook  # cached decoding calls this, not forward: offload hooks must fire here too
    @torch.no_grad()
    def forward_cached(self, input_ids: Tensor, position_ids: Tensor, cache: LLaDA2KVCache, start: int,
                       attention_mask: Tensor, rows: Optional[Tensor] = None) -> LLaDA2Output:
        """Logits ``[R, S, vocab_size]`` of the span ``[start, start + S)`` given its ``input_ids [R, S]`` and RoPE
        ``position_ids [R, S]``, against the cached K/V of positions ``[0, start)``.

        The span's keys and values are written into ``cache`` at ``[start, start + S)`` (rows ``rows`` of the cache,
        all when None) in every layer before its queries attend over ``[0, start + S)`` under ``attention_mask``
        (bool ``[R, 1, S, start + S]``, True = attend). With the block-causal pattern and a cache filled from the
        blocks' final tokens this equals the full forward's logits of the span (module docstring)."""
        if not isinstance(cache, LLaDA2KVCache):
            raise ValueError(f"cache must be a LLaDA2KVCache from new_kv_cache, got {type(cache).__name__}")
        self._check_ids(input_ids, "input_ids")
        rows_count = cache.batch_size if rows is None else int(rows.shape[0])
        span = input_ids.shape[1]
        if input_ids.shape[0] != rows_count:
            raise ValueError(f"input_ids must have {rows_count} rows (the cache rows served), got {input_ids.shape[0]}")
        if isinstance(start, bool) or not isinstance(start, int) or start < 0 or start + span > cache.seq_len:
            raise ValueError(f"start must be an integer with 0 <= start and start + span ({span}) <= {cache.seq_len}, "
                             f"got {start!r}")
        positions = self._check_positions(position_ids, input_ids.shape)
        if positions is None:
            raise ValueError("position_ids are needed for a cached forward")
        want = (rows_count, 1, span, start + span)
        if not isinstance(attention_mask, Tensor) or attention_mask.dtype != torch.bool \
                or tuple(attention_mask.shape) not in (want, (1, *want[1:])):
            got = (f"{tuple(attention_mask.shape)} {attention_mask.dtype}" if isinstance(attention_mask, Tensor)
                   else type(attention_mask).__name__)
            raise ValueError(f"attention_mask must be a bool tensor of shape {want}, got {got}")
        logits = self._run(input_ids.to(self.device), positions, attention_mask.to(self.device), cache, start,
                           None if rows is None else rows.to(self.device))
        return LLaDA2Output(logits=logits)

    def _run(self, ids: Tensor, positions: Tensor, mask: Tensor, cache: Optional[LLaDA2KVCache], start: int,
             rows: Optional[Tensor]) -> Tensor:
        """The decoder on checked inputs; with ``cache``, write the span's K/V at ``[start, start + S)`` first."""
        cos, sin = self._rope(positions)
        h = self.model.word_embeddings(ids)
        end = start + ids.shape[1]
        for index, layer in enumerate(self.model.layers):
            q, k, v = layer.attention.project(layer.input_layernorm(h), cos, sin)
            if cache is not None:
                k, v = self._cached_kv(cache, index, k, v, start, end, rows)
            h = layer.finish(h, q, k, v, mask)
        return self.lm_head(self.model.norm(h)).float()

    @staticmethod
    def _cached_kv(cache: LLaDA2KVCache, index: int, k: Tensor, v: Tensor, start: int, end: int,
                   rows: Optional[Tensor]) -> tuple[Tensor, Tensor]:
        keys, values = cache.keys[index], cache.values[index]
        if rows is None:
            keys[:, :, start:end] = k
            values[:, :, start:end] = v
            return keys[:, :, :end], values[:, :, :end]
        keys[rows, :, start:end] = k
        values[rows, :, start:end] = v
        return keys[rows, :, :end], values[rows, :, :end]
