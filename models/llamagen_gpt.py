"""The LlamaGen GPT (Sun et al., "Autoregressive Model Beats Diffusion", arXiv 2406.06525).

A Llama-style decoder over VQ image tokens, state-dict compatible with the official
FoundationVision/LlamaGen ``autoregressive/models/gpt.py``:

* blocks ``x + attn(RMSNorm(x))``, ``h + ffn(RMSNorm(h))``; fused ``wqkv``, no biases; SwiGLU with
  hidden size ``find_multiple(int(2 * 4d / 3), multiple_of)``; untied ``output`` head;
* 2-D RoPE over the ``g x g`` token grid: the first half of each head's rotary pairs encodes the row,
  the second half the column (base 10000). The condition tokens get an all-zero cos/sin cache, which
  zeroes their queries and keys exactly as the official code does (RMSNorm and RoPE come from
  :mod:`vispec.models.layers`, shared with LLaDA);
* condition: a class table with ``num_classes + 1`` rows when ``class_dropout_prob > 0`` (the last
  row is the null class used for CFG), or caption features through ``cap_proj`` (fc1, tanh-GELU,
  fc2, no biases) with a learnt ``uncond_embedding`` as the null caption.

Training-style ``forward`` returns ``logits[:, cls_token_num - 1:]`` like the official model: output
``t`` predicts image token ``t``. Decoding goes through the :mod:`vispec.protocol` methods with a
ragged pointer KV cache: every sample keeps its own length, windows are written at each sample's own
offset, and rollback only moves that sample's pointer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.models.modeling_utils import ModelMixin
from diffusers.utils.accelerate_utils import apply_forward_hook
from torch import Tensor, nn

from vispec.checks import check_int
from vispec.models.checkpoints import CheckedFromPretrained
from vispec.models.layers import RMSNorm, apply_rope_interleaved, masked_attention, rope_cache_2d
from vispec.models.offload import weight_device
from vispec.protocol import WindowLogits, check_path, check_tree, keep_path, tree_ancestors, tree_depths, window_visibility

MAX_BLOCK_SIZE = 1 << 18
"""The most image tokens a model may declare (a 512 x 512 token grid; official LlamaGen models have 256 to
1,024): a larger ``block_size`` in an untrusted config would allocate its RoPE table before any check."""

# name -> (n_layer, n_head, dim). Official names from LlamaGen; GPT-mini is vispec's CPU-sized model.
GPT_CONFIGS: dict[str, dict[str, int]] = {
    "GPT-B": dict(n_layer=12, n_head=12, dim=768),
    "GPT-L": dict(n_layer=24, n_head=16, dim=1024),
    "GPT-XL": dict(n_layer=36, n_head=20, dim=1280),
    "GPT-XXL": dict(n_layer=48, n_head=24, dim=1536),
    "GPT-XXXL": dict(n_layer=48, n_head=40, dim=2560),
    "GPT-1B": dict(n_layer=22, n_head=32, dim=2048),
    "GPT-3B": dict(n_layer=24, n_head=32, dim=3200),
    "GPT-7B": dict(n_layer=32, n_head=32, dim=4096),
    "GPT-mini": dict(n_layer=4, n_head=8, dim=256),
}


def find_multiple(n: int, k: int) -> int:
    return n if n % k == 0 else n + k - (n % k)


def ffn_hidden_dim(dim: int, multiple_of: int, ffn_dim_multiplier: Optional[float]) -> int:
    hidden = int(2 * (4 * dim) / 3)
    if ffn_dim_multiplier is not None:
        hidden = int(ffn_dim_multiplier * hidden)
    return find_multiple(hidden, multiple_of)


class DropPath(nn.Module):
    """Stochastic depth per sample (training only)."""

    def __init__(self, p: float):
        super().__init__()
        self.p = p

    def forward(self, x: Tensor) -> Tensor:
        if not self.training or self.p == 0.0:
            return x
        keep = x.new_empty((x.shape[0],) + (1,) * (x.dim() - 1)).bernoulli_(1 - self.p)
        return x * keep / (1 - self.p)


class Attention(nn.Module):
    def __init__(self, dim: int, n_head: int, n_kv_head: int, attn_dropout_p: float, resid_dropout_p: float):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = n_head, n_kv_head, dim // n_head
        self.wqkv = nn.Linear(dim, (n_head + 2 * n_kv_head) * self.head_dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        self.attn_dropout_p = attn_dropout_p
        self.resid_dropout = nn.Dropout(resid_dropout_p)

    def project(self, x: Tensor, rope: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Queries ``[B, H, T, hd]``, keys and values ``[B, Hkv, T, hd]``, RoPE applied."""
        bsz, seqlen, _ = x.shape
        kv = self.n_kv_head * self.head_dim
        q, k, v = self.wqkv(x).split([self.n_head * self.head_dim, kv, kv], dim=-1)
        q = apply_rope_interleaved(q.view(bsz, seqlen, self.n_head, self.head_dim), rope)
        k = apply_rope_interleaved(k.view(bsz, seqlen, self.n_kv_head, self.head_dim), rope)
        return q.transpose(1, 2), k.transpose(1, 2), v.view(bsz, seqlen, self.n_kv_head, self.head_dim).transpose(1, 2)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor]) -> Tensor:
        """``mask``: bool ``[B, 1, Tq, Tk]`` (True = visible) or None for plain causal attention."""
        if self.n_kv_head != self.n_head:
            k = k.repeat_interleave(self.n_head // self.n_kv_head, dim=1)
            v = v.repeat_interleave(self.n_head // self.n_kv_head, dim=1)
        if mask is not None and not self.training and q.device.type == "cpu" and torch.compiler.is_compiling():
            out = masked_attention(q, k, v, mask)
        else:
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=mask is None, dropout_p=self.attn_dropout_p if self.training else 0.0
            )
        bsz, _, seqlen, _ = out.shape
        return self.resid_dropout(self.wo(out.transpose(1, 2).reshape(bsz, seqlen, -1)))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int, ffn_dropout_p: float):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.ffn_dropout = nn.Dropout(ffn_dropout_p)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(self.ffn_dropout(F.silu(self.w1(x)) * self.w3(x)))


class TransformerBlock(nn.Module):
    def __init__(self, dim, n_head, n_kv_head, hidden, norm_eps, attn_p, resid_p, ffn_p, drop_path):
        super().__init__()
        self.attention = Attention(dim, n_head, n_kv_head, attn_p, resid_p)
        self.feed_forward = FeedForward(dim, hidden, ffn_p)
        self.attention_norm = RMSNorm(dim, norm_eps)
        self.ffn_norm = RMSNorm(dim, norm_eps)
        self.drop_path = DropPath(drop_path)

    def forward(self, x: Tensor, rope: Tensor, mask: Optional[Tensor], cache: Optional["_LayerCache"] = None) -> Tensor:
        q, k, v = self.attention.project(self.attention_norm(x), rope)
        if cache is not None:
            k, v = cache.write(k, v)
        h = x + self.drop_path(self.attention.attend(q, k, v, mask))
        return h + self.drop_path(self.feed_forward(self.ffn_norm(h)))


class LabelEmbedder(nn.Module):
    """Class table; with ``dropout_prob > 0`` an extra last row is the null class (CFG)."""

    def __init__(self, num_classes: int, dim: int, dropout_prob: float):
        super().__init__()
        self.num_classes, self.dropout_prob = num_classes, dropout_prob
        self.embedding_table = nn.Embedding(num_classes + int(dropout_prob > 0), dim)

    @property
    def has_null(self) -> bool:
        return self.embedding_table.num_embeddings > self.num_classes

    def forward(self, labels: Tensor, drop: Optional[Tensor] = None) -> Tensor:
        if drop is not None:
            labels = torch.where(drop, torch.full_like(labels, self.num_classes), labels)
        return self.embedding_table(labels).unsqueeze(1)


class CaptionMLP(nn.Module):
    def __init__(self, in_features: int, dim: int):
        super().__init__()
        self.fc1 = nn.Linear(in_features, dim, bias=False)
        self.act = nn.GELU(approximate="tanh")
        self.fc2 = nn.Linear(dim, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.act(self.fc1(x)))


class CaptionEmbedder(nn.Module):
    """Caption features ``[B, T, caption_dim]`` -> ``[B, T, dim]``; ``uncond_embedding`` is the null caption.

    LlamaGen allocates 120 null-caption rows (its T5 length) whatever ``cls_token_num`` is.
    """

    def __init__(self, caption_dim: int, dim: int, dropout_prob: float, max_tokens: int = 120):
        super().__init__()
        self.dropout_prob = dropout_prob
        self.cap_proj = CaptionMLP(caption_dim, dim)
        self.register_buffer("uncond_embedding", torch.randn(max_tokens, caption_dim) / caption_dim**0.5)

    def null(self, batch: int, tokens: int) -> Tensor:
        return self.uncond_embedding[:tokens].unsqueeze(0).expand(batch, -1, -1)

    def forward(self, captions: Tensor, drop: Optional[Tensor] = None) -> Tensor:
        if drop is not None:
            captions = torch.where(drop[:, None, None], self.null(captions.shape[0], captions.shape[1]).to(captions), captions)
        return self.cap_proj(captions)


@dataclass
class LlamaGenCondition:
    """What a LlamaGen model is conditioned on: class labels (c2i) or caption features (t2i).

    ``caption_mask`` ``[B, T]`` marks real caption tokens (LlamaGen left-pads T5 features).
    """

    class_labels: Optional[Tensor] = None
    caption_embeds: Optional[Tensor] = None
    caption_mask: Optional[Tensor] = None

    @property
    def batch_size(self) -> int:
        source = self.class_labels if self.class_labels is not None else self.caption_embeds
        return 0 if source is None else int(source.shape[0])

    def select(self, index: Tensor) -> "LlamaGenCondition":
        """The conditions of samples ``index`` (requests entering a running batch)."""
        pick = lambda x: None if x is None else x[index.to(x.device)]  # noqa: E731
        return LlamaGenCondition(pick(self.class_labels), pick(self.caption_embeds), pick(self.caption_mask))


class _LayerCache:
    """One layer's slice of the cache, bound to the current window's write positions.

    Keys are written at ``(rows[r], positions[r, w])``; attention reads the first ``kv_len`` positions
    of ``read_rows`` (all rows when None), masked by position."""

    def __init__(self, k: Tensor, v: Tensor, rows: Tensor, positions: Tensor, kv_len: int, read_rows: Optional[Tensor]):
        self.k, self.v, self.rows, self.positions, self.kv_len, self.read_rows = k, v, rows, positions, kv_len, read_rows

    def write(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        # k: [R, Hkv, W, hd] -> cache[r, :, positions[r, w]] (advanced indices first: [R, W, Hkv, hd])
        self.k[self.rows, :, self.positions] = k.transpose(1, 2).to(self.k.dtype)
        self.v[self.rows, :, self.positions] = v.transpose(1, 2).to(self.v.dtype)
        keys, values = self.k[:, :, : self.kv_len], self.v[:, :, : self.kv_len]
        if self.read_rows is None:
            return keys, values
        return keys[self.read_rows], values[self.read_rows]


@dataclass
class LlamaGenDecodeState:
    """Fixed-capacity KV cache for a batch of ``B`` samples (``2B`` rows with guidance, conditional first).

    ``lengths[b]`` counts cached sequence positions of sample ``b`` (condition tokens included);
    ``last_window`` is the width of the most recent window, which ``rollback`` trims. ``validate``:
    check values that need a read-back from the device (decoders that build their own indices turn
    it off, so a decode step has no host synchronisation). ``slack``: the positions past the condition and the
    image that the cache keeps for a window (``prefill``'s ``window``; a sample's lengths never pass
    ``capacity - slack``).
    """

    keys: list[Tensor]  # per layer [R, Hkv, capacity, hd]
    values: list[Tensor]
    lengths: Tensor  # [B] long
    cond_mask: Optional[Tensor]  # [R, cls_token_num] bool, True = visible caption token
    guidance: bool
    last_window: int = 0
    validate: bool = True
    slack: int = 1

    @property
    def batch_size(self) -> int:
        return int(self.lengths.shape[0])

    @property
    def capacity(self) -> int:
        return int(self.keys[0].shape[2])

    def persistent_tensors(self) -> list[Tensor]:
        """The tensors this state keeps for a whole decode, which ``forward_window``/``rollback`` write in place
        (keys, values, lengths) or ``refill`` does (the caption mask): a compiled step's CUDA graph can replay only
        if they are static inputs (:func:`vispec.decoding.compiled.mark_persistent`)."""
        return [*self.keys, *self.values, self.lengths] + ([] if self.cond_mask is None else [self.cond_mask])

    def rows_lengths(self) -> Tensor:
        """Per-row cached lengths (duplicated for the unconditional half)."""
        return torch.cat([self.lengths, self.lengths]) if self.guidance else self.lengths

    def rows(self, index: Tensor) -> Tensor:
        """Cache rows of samples ``index`` (both halves with guidance)."""
        return torch.cat([index, index + self.batch_size]) if self.guidance else index


class LlamaGenGPT(CheckedFromPretrained, ModelMixin, ConfigMixin):
    """LlamaGen GPT (module docstring); implements :class:`vispec.protocol.SpeculativeARModel`."""

    _no_split_modules = ["TransformerBlock"]

    @register_to_config
    def __init__(
        self,
        vocab_size: int = 16384,
        dim: int = 768,
        n_layer: int = 12,
        n_head: int = 12,
        n_kv_head: Optional[int] = None,
        multiple_of: int = 256,
        ffn_dim_multiplier: Optional[float] = None,
        rope_base: float = 10000.0,
        norm_eps: float = 1e-5,
        initializer_range: float = 0.02,
        model_type: str = "c2i",
        num_classes: int = 1000,
        caption_dim: int = 2048,
        class_dropout_prob: float = 0.1,
        cls_token_num: int = 1,
        block_size: int = 256,
        token_dropout_p: float = 0.1,
        attn_dropout_p: float = 0.0,
        resid_dropout_p: float = 0.1,
        ffn_dropout_p: float = 0.1,
        drop_path_rate: float = 0.0,
    ):
        super().__init__()
        if model_type not in ("c2i", "t2i"):
            raise ValueError(f"model_type must be 'c2i' or 't2i', got {model_type!r}")
        if dim % n_head != 0 or (dim // n_head) % 4 != 0:
            raise ValueError(f"dim={dim} must split into n_head={n_head} heads whose size is a multiple of 4 (2-D RoPE)")
        n_kv_head = n_kv_head or n_head
        if n_head % n_kv_head != 0:
            raise ValueError(f"n_head={n_head} must be a multiple of n_kv_head={n_kv_head}")
        check_int("block_size", block_size, minimum=1, maximum=MAX_BLOCK_SIZE,
                  hint=" (image tokens of one image; the RoPE table and KV caches grow with it)")
        check_int("cls_token_num", cls_token_num, minimum=1, maximum=MAX_BLOCK_SIZE)
        grid = math.isqrt(block_size)
        if grid * grid != block_size:
            raise ValueError(f"block_size={block_size} must be a square number of image tokens (grid x grid)")
        if model_type == "c2i" and cls_token_num != 1:
            raise ValueError(f"class-conditional models use cls_token_num=1, got {cls_token_num}")
        self.grid_size = grid
        if model_type == "c2i":
            self.cls_embedding = LabelEmbedder(num_classes, dim, class_dropout_prob)
        else:
            self.cls_embedding = CaptionEmbedder(caption_dim, dim, class_dropout_prob)
        self.tok_embeddings = nn.Embedding(vocab_size, dim)
        self.tok_dropout = nn.Dropout(token_dropout_p)
        hidden = ffn_hidden_dim(dim, multiple_of, ffn_dim_multiplier)
        rates = torch.linspace(0, drop_path_rate, n_layer).tolist()
        self.layers = nn.ModuleList(
            TransformerBlock(dim, n_head, n_kv_head, hidden, norm_eps, attn_dropout_p, resid_dropout_p, ffn_dropout_p, r)
            for r in rates
        )
        self.norm = RMSNorm(dim, norm_eps)
        self.output = nn.Linear(dim, vocab_size, bias=False)
        # a plain attribute, not a buffer: it is not part of official state dicts
        self.freqs_cis = rope_cache_2d(grid, dim // n_head, rope_base, cls_token_num)
        self.apply(self._init_weights)
        nn.init.zeros_(self.output.weight)

    @classmethod
    def from_name(cls, name: str, **overrides) -> "LlamaGenGPT":
        """Build a named configuration (``GPT-B``, ``GPT-L``, ``GPT-XL``, ``GPT-XXL``, ``GPT-3B``, ...)."""
        if name not in GPT_CONFIGS:
            raise ValueError(f"unknown gpt_model {name!r}; expected one of {sorted(GPT_CONFIGS)}")
        return cls(**{**GPT_CONFIGS[name], **overrides})

    def _init_weights(self, module: nn.Module) -> None:
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=std)

    # ------------------------------------------------------------------ helpers
    @property
    def device(self) -> torch.device:
        """Where the model computes: its weights' device (cheaper than ModelMixin's walk over all modules, used
        per step), or accelerate's execution device while sequential offload parks the weights on ``meta``."""
        return weight_device(self.tok_embeddings, self.tok_embeddings.weight)

    @property
    def dtype(self) -> torch.dtype:
        return self.tok_embeddings.weight.dtype

    @property
    def image_vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def num_image_tokens(self) -> int:
        return self.config.block_size

    @property
    def has_unconditional(self) -> bool:
        """Whether a null condition exists (needed for classifier-free guidance)."""
        if self.config.model_type == "t2i":
            return True
        return self.cls_embedding.has_null

    def _rope(self, positions: Tensor) -> Tensor:
        table = self.freqs_cis.to(self.device)
        if self.freqs_cis.device != table.device:
            self.freqs_cis = table
        return table[positions.clamp(max=table.shape[0] - 1)]

    def _check_condition(self, condition: LlamaGenCondition) -> int:
        cfg = self.config
        if not isinstance(condition, LlamaGenCondition):
            raise ValueError(f"condition must be a LlamaGenCondition, got {type(condition).__name__}")
        if cfg.model_type == "c2i":
            labels = condition.class_labels
            if labels is None or condition.caption_embeds is not None:
                raise ValueError("a class-conditional model needs class_labels (and no caption_embeds)")
            if labels.dim() != 1 or labels.dtype not in (torch.int64, torch.int32):
                raise ValueError(f"class_labels must be a 1-D integer tensor, got shape {tuple(labels.shape)} dtype {labels.dtype}")
            if labels.numel() and (int(labels.min()) < 0 or int(labels.max()) >= cfg.num_classes):
                raise ValueError(f"class_labels must lie in [0, {cfg.num_classes}), got values in [{int(labels.min())}, {int(labels.max())}]")
            return int(labels.shape[0])
        caps = condition.caption_embeds
        if caps is None or condition.class_labels is not None:
            raise ValueError("a caption-conditioned model needs caption_embeds (and no class_labels)")
        if caps.dim() != 3 or caps.shape[1] != cfg.cls_token_num or caps.shape[2] != cfg.caption_dim:
            raise ValueError(
                f"caption_embeds must have shape [batch, {cfg.cls_token_num}, {cfg.caption_dim}], got {tuple(caps.shape)}"
            )
        if not torch.isfinite(caps).all():
            raise ValueError("caption_embeds contain NaN or inf")
        mask = condition.caption_mask
        if mask is not None and (mask.shape != caps.shape[:2] or mask.dtype != torch.bool):
            raise ValueError(f"caption_mask must be a bool tensor of shape {tuple(caps.shape[:2])}, got {tuple(mask.shape)} {mask.dtype}")
        return int(caps.shape[0])

    def _condition_embeddings(self, condition: LlamaGenCondition, drop: Optional[Tensor] = None) -> Tensor:
        if self.config.model_type == "c2i":
            return self.cls_embedding(condition.class_labels.to(self.device).long(), drop)
        return self.cls_embedding(condition.caption_embeds.to(self.device, self.dtype), drop)

    def _null_embeddings(self, batch: int) -> Tensor:
        if self.config.model_type == "c2i":
            labels = torch.full((batch,), self.config.num_classes, dtype=torch.long, device=self.device)
            return self.cls_embedding.embedding_table(labels).unsqueeze(1)
        return self.cls_embedding.cap_proj(self.cls_embedding.null(batch, self.config.cls_token_num).to(self.dtype))

    def _cond_key_mask(self, condition: LlamaGenCondition, rows: int) -> Optional[Tensor]:
        if condition.caption_mask is None:
            return None
        mask = condition.caption_mask.to(self.device)
        return mask.repeat(rows // mask.shape[0], 1)

    # ------------------------------------------------------------------ training-style forward
    def forward(
        self,
        input_ids: Tensor,
        condition: LlamaGenCondition,
        condition_drop: Optional[Tensor] = None,
    ) -> Tensor:
        """Teacher-forced logits ``[B, T + 1, V]``: output ``t`` predicts image token ``t``.

        ``input_ids``: ``[B, T]`` image tokens (``T <= block_size - 1``). ``condition_drop``: ``[B]``
        bool, replace the condition by the null condition. In training mode it defaults to LlamaGen's
        class dropout: each condition is dropped with probability ``class_dropout_prob`` (CFG training).
        """
        batch = self._check_condition(condition)
        if condition_drop is None and self.training and self.config.class_dropout_prob > 0:
            condition_drop = torch.rand(batch, device=self.device) < self.config.class_dropout_prob
        if input_ids.dim() != 2 or input_ids.shape[0] != batch or input_ids.shape[1] >= self.config.block_size:
            raise ValueError(
                f"input_ids must have shape [{batch}, T] with T < {self.config.block_size}, got {tuple(input_ids.shape)}"
            )
        cls = self.config.cls_token_num
        h = torch.cat([self._condition_embeddings(condition, condition_drop), self.tok_embeddings(input_ids)], dim=1)
        h = self.tok_dropout(h)
        seq = h.shape[1]
        rope = self._rope(torch.arange(seq, device=self.device))[None]
        mask = None
        key_mask = self._cond_key_mask(condition, batch)
        if key_mask is not None:
            causal = torch.ones(seq, seq, dtype=torch.bool, device=self.device).tril()
            visible = torch.ones(batch, seq, dtype=torch.bool, device=self.device)
            visible[:, :cls] = key_mask
            mask = (causal[None] & (visible[:, None, :] | torch.eye(seq, dtype=torch.bool, device=self.device)[None]))[:, None]
        for layer in self.layers:
            h = layer(h, rope, mask)
        return self.output(self.norm(h)).float()[:, cls - 1 :]

    # ------------------------------------------------------------------ decoding protocol
    def _condition_rows(self, condition: LlamaGenCondition, guidance: bool) -> tuple[Tensor, Optional[Tensor]]:
        """Embeddings ``[R, cls, d]`` of a checked condition (null condition appended with guidance) and its key mask."""
        batch = condition.batch_size
        if guidance and not self.has_unconditional:
            raise ValueError(
                "guidance_scale != 1 needs an unconditional branch, but this model has no null class "
                "(class_dropout_prob=0); use guidance_scale=1.0"
            )
        emb = self._condition_embeddings(condition)
        if guidance:
            emb = torch.cat([emb, self._null_embeddings(batch)])
        return emb, self._cond_key_mask(condition, emb.shape[0])

    @apply_forward_hook  # decoders call this, not forward: offload hooks must fire here too
    @torch.no_grad()
    def prefill(
        self, condition: LlamaGenCondition, *, guidance: bool, max_new_tokens: int, window: int = 1, validate: bool = True
    ) -> tuple[LlamaGenDecodeState, WindowLogits]:
        """Cache the condition tokens; return logits ``[B, 1, V]`` for image token 0.

        The cache holds ``cls_token_num + max_new_tokens + window`` positions. ``validate=False``: later
        calls check nothing that needs a device read-back (the caller keeps lengths within capacity)."""
        cfg = self.config
        batch = self._check_condition(condition)
        check_int("max_new_tokens", max_new_tokens, minimum=1, maximum=cfg.block_size)
        check_int("window", window, minimum=1)
        emb, cond_mask = self._condition_rows(condition, guidance)
        rows, cls = emb.shape[0], cfg.cls_token_num
        capacity = cls + max_new_tokens + window
        head_dim = cfg.dim // cfg.n_head
        n_kv = cfg.n_kv_head or cfg.n_head
        keys = [torch.zeros(rows, n_kv, capacity, head_dim, dtype=self.dtype, device=self.device) for _ in self.layers]
        values = [torch.zeros_like(k) for k in keys]
        state = LlamaGenDecodeState(keys, values, torch.zeros(batch, dtype=torch.long, device=self.device), cond_mask,
                                    guidance, validate=validate, slack=window)
        positions = torch.arange(cls, device=self.device)[None].expand(rows, -1)
        logits = self._run(state.keys, state.values, state.cond_mask, emb, positions, cls)
        state.lengths += cls
        return state, self._split(state, logits[:, -1:])

    @apply_forward_hook  # decoders call this, not forward: offload hooks must fire here too
    @torch.no_grad()
    def refill(self, state: LlamaGenDecodeState, index: Tensor, condition: LlamaGenCondition) -> WindowLogits:
        """Start new samples in slots ``index [k]`` of a running batch (continuous batching): cache their
        condition tokens there, reset their lengths, and return logits ``[k, 1, V]`` for their image token 0.
        The slots' old keys need no clearing: attention only reads positions a sample has written."""
        if self._check_condition(condition) != index.shape[0]:
            raise ValueError(f"condition has {condition.batch_size} samples for {index.shape[0]} slots")
        cls = self.config.cls_token_num
        index = index.to(self.device)
        emb, cond_mask = self._condition_rows(condition, state.guidance)
        rows = state.rows(index)
        if state.cond_mask is not None:
            state.cond_mask[rows] = cond_mask
        positions = torch.arange(cls, device=self.device)[None].expand(rows.shape[0], -1)
        logits = self._run(state.keys, state.values, None if state.cond_mask is None else state.cond_mask[rows], emb,
                           positions, cls, rows=rows)
        state.lengths[index] = cls
        return self._split(state, logits[:, -1:])

    @apply_forward_hook  # decoders call this, not forward: offload hooks must fire here too
    @torch.no_grad()
    def forward_window(self, state: LlamaGenDecodeState, tokens: Tensor, longest: Optional[int] = None,
                       parents: Optional[Tensor] = None) -> WindowLogits:
        """Append ``tokens [B, W]`` after each sample's cached prefix; logits ``[B, W, V]``. ``parents [B, W]``:
        the window is a token tree (:mod:`vispec.protocol`): tree attention mask, 2-D RoPE by depth.

        ``longest``: the most image tokens any sample has cached (a decoder that tracks lengths on the
        host passes it); attention then reads ``cls_token_num + longest + W`` positions. Without it, a
        validating state reads the longest length back from the device, and a non-validating one
        attends over every position a window of ``W`` can reach, ``capacity - slack + W`` (the condition, the
        whole image and the window), with a mask gathered by position: nothing is read back and shapes depend
        only on ``B``, ``W`` and the capacity, so the call compiles with ``torch.compile(fullgraph=True)`` (the
        logits then differ from the shorter read in float rounding). A decode whose cache has room for a
        64-row window thus runs its one-row passes over as many positions as AR's own cache holds."""
        if tokens.dim() != 2 or tokens.shape[0] != state.batch_size or tokens.shape[1] < 1:
            raise ValueError(f"tokens must have shape [{state.batch_size}, W>=1], got {tuple(tokens.shape)}")
        width = tokens.shape[1]
        cls = self.config.cls_token_num
        if longest is not None:
            kv_length = cls + longest + width
            if state.validate and int(state.lengths.max()) + width > kv_length:
                raise ValueError(f"longest={longest} is less than the longest sample's cached tokens")
        else:
            kv_length = int(state.lengths.max()) + width if state.validate else state.capacity - state.slack + width
        if kv_length > state.capacity:
            raise ValueError(f"window of {width} tokens overflows the cache (capacity {state.capacity})")
        tokens = tokens.to(self.device)
        ancestors = None
        if parents is not None:
            check_tree(parents, state.batch_size, width, state.validate)
            parents = parents.to(self.device)
            ancestors = tree_ancestors(torch.cat([parents, parents]) if state.guidance else parents)
        if state.guidance:
            tokens = torch.cat([tokens, tokens])
        positions = state.rows_lengths()[:, None] + torch.arange(width, device=self.device)
        logits = self._run(state.keys, state.values, state.cond_mask, self.tok_embeddings(tokens), positions, kv_length,
                           ancestors=ancestors)
        state.last_window = width
        return self._split(state, logits)

    def rollback(self, state: LlamaGenDecodeState, keep: Tensor, path: Optional[Tensor] = None) -> None:
        """Keep the first ``keep[b]`` tokens of the last window for each sample; after a tree window, the
        slots ``path[b, :keep[b]]`` (root first), whose keys and values move into place."""
        if keep.shape != state.lengths.shape:
            raise ValueError(f"keep must be a [{state.batch_size}] tensor, got shape {tuple(keep.shape)}")
        if state.validate and (int(keep.min()) < 0 or int(keep.max()) > state.last_window):
            raise ValueError(f"keep must be a [{state.batch_size}] tensor with values in [0, {state.last_window}]")
        if path is not None:
            check_path(path, state.batch_size, state.last_window, state.validate)
            path = path.to(self.device)
            keep_path((*state.keys, *state.values), state.rows_lengths(), torch.cat([path, path]) if state.guidance else path)
        state.lengths += keep.to(state.lengths)
        state.last_window = 0

    def truncate(self, state: LlamaGenDecodeState, keep: Tensor) -> None:
        """Keep at most the first ``keep[b]`` cached image tokens of each sample (the condition stays; a sample
        with fewer is left as it is), so the next window is written from there (used to rewrite committed
        tokens, :mod:`vispec.decoding.edits`)."""
        if keep.shape != state.lengths.shape:
            raise ValueError(f"keep must be a [{state.batch_size}] tensor, got shape {tuple(keep.shape)}")
        if state.validate and int(keep.min()) < 0:
            raise ValueError("keep must be a tensor of non-negative counts")
        state.lengths.copy_(torch.minimum(state.lengths, keep.to(state.lengths) + self.config.cls_token_num))
        state.last_window = 0

    def select(self, state: LlamaGenDecodeState, index: Tensor) -> LlamaGenDecodeState:
        """Keep only samples ``index`` (e.g. drop finished ones)."""
        index = index.to(self.device)
        rows = state.rows(index)
        return LlamaGenDecodeState(
            [k[rows] for k in state.keys],
            [v[rows] for v in state.values],
            state.lengths[index],
            None if state.cond_mask is None else state.cond_mask[rows],
            state.guidance,
            state.last_window,
            state.validate,
            state.slack,
        )

    def _split(self, state: LlamaGenDecodeState, logits: Tensor) -> WindowLogits:
        if not state.guidance:
            return WindowLogits(logits)
        cond, uncond = logits.chunk(2)
        return WindowLogits(cond, uncond)

    def _run(self, keys: list[Tensor], values: list[Tensor], cond_mask: Optional[Tensor], h: Tensor, positions: Tensor,
             kv_len: int, rows: Optional[Tensor] = None, ancestors: Optional[Tensor] = None) -> Tensor:
        """Run all layers on ``h [R, W, d]`` written at sequence ``positions [R, W]`` of cache ``rows`` (all by default).

        Attention reads cache positions ``< kv_len``: key ``t`` is visible to a query at position ``s``
        iff ``t <= s`` (and, for caption tokens, ``cond_mask``; a token always sees its own key). With
        ``ancestors [R, W, W]`` (a tree window, :func:`vispec.protocol.tree_ancestors`) a query sees the
        prefix and its ancestors in the window, and its RoPE position is ``prefix + depth``."""
        cls = self.config.cls_token_num
        read_rows = rows
        rows = torch.arange(h.shape[0], device=self.device) if rows is None else rows
        keys_at = torch.arange(kv_len, device=self.device)
        if ancestors is None:
            visible = keys_at[None, None, :] <= positions[:, :, None]
            rope_positions = positions
        else:
            visible = window_visibility(positions[:, 0], ancestors, kv_len)
            rope_positions = positions[:, :1] + tree_depths(ancestors)
        if cond_mask is not None:
            is_cond = keys_at[None, :] < cls
            cond_visible = cond_mask.gather(1, keys_at.clamp(max=cls - 1)[None].expand(h.shape[0], -1).contiguous())
            visible = visible & ((~is_cond | cond_visible)[:, None, :] | (keys_at[None, None, :] == positions[:, :, None]))
        mask = visible[:, None]
        rope = self._rope(rope_positions)
        for layer, k, v in zip(self.layers, keys, values):
            h = layer(h, rope, mask, _LayerCache(k, v, rows[:, None], positions, kv_len, read_rows))
        return self.output(self.norm(h)).float()
