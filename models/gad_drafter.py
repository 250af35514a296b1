"""A masked block drafter over VQ image tokens (bidirectional or causal), for GAD-style decoding.

Generalized Aggressive Decoding (GAD; Ge et al., "Lossless Acceleration for Seq2seq Generation with Aggressive
Decoding", arXiv 2205.10350) drafts a whole block of ``k`` tokens with one *non-autoregressive* forward and
lets the autoregressive target verify the block in one forward. This module is the drafter, MaskGIT-style
(Chang et al., arXiv 2202.04200): a Llama-style transformer *encoder* (no causal mask) over

    [class c] [the last C committed tokens x_{n-C} .. x_{n-1}] [MASK]_n .. [MASK]_{n+k-1}

whose output at mask ``i`` is a distribution ``q_i(.) = softmax(logits_i)`` over the image vocabulary for
position ``n + i`` given the class and the committed prefix alone. The ``k`` rows come from one forward, so
the drafts ``d_i ~ q_i`` are drawn independently of each other (no ``d_{<i}`` feedback): ``q_i`` models the
marginal ``p(x_{n+i} | x_{<n})`` of the target, which is what the training objective targets
(:mod:`vispec.eval.train.gad`). ``decoding="gad:passes=m"`` calls it ``m`` times per block instead, each pass with
the earlier passes' drafts as committed context (the block's first mask of a pass then models a conditional,
:mod:`vispec.decoding.gad`).

Design (sizes in :class:`GADDrafter`'s config):

* blocks, RMSNorm, SwiGLU, the class table with a null row for classifier-free guidance and LlamaGen's 2-D
  RoPE over the ``g x g`` grid are the LlamaGen GPT's (:mod:`vispec.models.llamagen_gpt`); every token keeps
  the RoPE angle of its *absolute* grid position (the class token gets the all-zero rotation), so a mask
  token knows which row and column it drafts;
* a learnt ``[MASK]`` embedding (row ``vocab_size`` of the token table);
* **local context** ``C = context``: only the last ``C`` committed tokens are encoded (raster order: ``C >= 2g``
  covers the two rows above the block). The input so has a fixed length ``1 + C + max_block`` whatever the
  prefix length, and the drafter needs no KV cache: each forward costs the same, from scratch. Slots before
  image token 0 and masks past the sample's block length ``k_b`` are hidden keys (ragged batches);
* **attention** (``attention``): ``"bidirectional"`` (above; GAD's and MaskGIT's encoder) or ``"causal"``, a
  *masked autoregressive* drafter: the input is the same, but every slot sees only the slots before it, the masks
  stand in for the unknown ``x_n .. x_{n+k-2}`` and row ``i`` is read at the slot of ``x_{n+i-1}``:

      [class c] x_0 .. x_{n-1} [MASK]_n .. [MASK]_{n+k-2}      row 0 read at x_{n-1}, row i >= 1 at [MASK]_{n+i-1}

  Row 0 is then exactly an AR GPT's next-token prediction, so a causal drafter warm-started from tiny-c2i's AR
  drafter (same blocks, :func:`vispec.eval.train.gad.warm_start_from_ar`) proposes the block's first token as well
  as draft-model decoding's drafter does, and training only has to teach the masks the later positions (rows
  ``i >= 1`` model marginals given ``x_{<n}``, as in the bidirectional drafter; a mask carries no content, so seeing
  the masks after it would tell it nothing). The prefix's hidden states do not depend on the masks, which lets the
  trainer pack many blocks of one sequence into one forward (:meth:`GADDrafter.forward_packed`) and train row 0 at
  every position of the sequence. A causal drafter reads the whole prefix (``context=0``) and keeps no KV cache:
  each forward encodes ``1 + N - 1 + max_block`` slots (a cache over the prefix, as the AR drafter's, would make
  it ``k`` rows per forward; not built);
* classifier-free guidance as in the target: with ``guidance=True`` :meth:`GADDrafter.propose` runs the
  conditional and null-class rows in one (doubled) forward and returns both halves as
  :class:`vispec.protocol.WindowLogits`; the decoder processes them exactly like the target's logits
  (:func:`vispec.kernels.target.window_target`: CFG, temperature, top-k, top-p) so ``q_i`` is a proper
  proposal for the processed target.

It is a diffusers ``ModelMixin`` / ``ConfigMixin`` (``save_pretrained`` / ``from_pretrained``: ``config.json``
and safetensors), the ``gad_drafter`` component of :class:`vispec.pipelines.LlamaGenPipeline`.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.models.modeling_utils import ModelMixin
from torch import Tensor, nn

from vispec.checks import check_int
from vispec.models.checkpoints import CheckedFromPretrained
from vispec.models.layers import RMSNorm, rope_cache_2d
from vispec.models.llamagen_gpt import LabelEmbedder, LlamaGenCondition, TransformerBlock, ffn_hidden_dim
from vispec.protocol import WindowLogits

MAX_TOKENS = 1 << 18  # as LlamaGen's MAX_BLOCK_SIZE: an untrusted config cannot size a huge RoPE table
ATTENTIONS = ("bidirectional", "causal")


class GADDrafter(CheckedFromPretrained, ModelMixin, ConfigMixin):
    """The masked block drafter (module docstring).

    Args:
        vocab_size: image vocabulary ``V`` (the target's); the token table has ``V + 1`` rows, the last one ``[MASK]``.
        dim, n_layer, n_head, multiple_of, rope_base, norm_eps, initializer_range: the encoder (LlamaGen blocks).
        num_classes, class_dropout_prob: the class table (``> 0``: a null row for classifier-free guidance).
        block_size: image tokens per image (a square ``g x g`` grid, the target's).
        context: ``C``, committed tokens the drafter sees before the block (``0``: all of them, ``block_size - 1``).
        max_block: the most masked positions one forward drafts (``k <= max_block``).
        attention: ``"bidirectional"`` or ``"causal"`` (module docstring; ``"causal"`` needs ``context=0``).
    """

    _no_split_modules = ["TransformerBlock"]

    @register_to_config
    def __init__(
        self,
        vocab_size: int = 1024,
        dim: int = 128,
        n_layer: int = 2,
        n_head: int = 4,
        multiple_of: int = 256,
        rope_base: float = 10000.0,
        norm_eps: float = 1e-5,
        initializer_range: float = 0.02,
        num_classes: int = 14,
        class_dropout_prob: float = 0.1,
        block_size: int = 256,
        context: int = 48,
        max_block: int = 16,
        attention: str = "bidirectional",
    ):
        super().__init__()
        check_int("vocab_size", vocab_size, minimum=1)
        check_int("dim", dim, minimum=1)
        check_int("n_layer", n_layer, minimum=1)
        check_int("n_head", n_head, minimum=1)
        check_int("num_classes", num_classes, minimum=1)
        check_int("block_size", block_size, minimum=2, maximum=MAX_TOKENS)
        check_int("context", context, minimum=0, maximum=block_size)
        check_int("max_block", max_block, minimum=1, maximum=block_size)
        if attention not in ATTENTIONS:
            raise ValueError(f"attention must be one of {ATTENTIONS}, got {attention!r}")
        if attention == "causal" and context != 0:
            raise ValueError(f"attention='causal' reads the whole prefix: context must be 0, got {context}")
        if dim % n_head != 0 or (dim // n_head) % 4 != 0:
            raise ValueError(f"dim={dim} must split into n_head={n_head} heads whose size is a multiple of 4 (2-D RoPE)")
        grid = math.isqrt(block_size)
        if grid * grid != block_size:
            raise ValueError(f"block_size={block_size} must be a square number of image tokens (grid x grid)")
        self.grid_size = grid
        self.cls_embedding = LabelEmbedder(num_classes, dim, class_dropout_prob)
        self.tok_embeddings = nn.Embedding(vocab_size + 1, dim)  # row vocab_size: [MASK]
        hidden = ffn_hidden_dim(dim, multiple_of, None)
        self.layers = nn.ModuleList(TransformerBlock(dim, n_head, n_head, hidden, norm_eps, 0.0, 0.0, 0.0, 0.0)
                                    for _ in range(n_layer))
        self.norm = RMSNorm(dim, norm_eps)
        self.output = nn.Linear(dim, vocab_size, bias=False)
        self.freqs_cis = rope_cache_2d(grid, dim // n_head, rope_base, 1)  # row 0: the class token (no rotation)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=initializer_range)
        nn.init.zeros_(self.output.weight)

    # ------------------------------------------------------------------ helpers
    @property
    def device(self) -> torch.device:
        return self.tok_embeddings.weight.device

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
    def context_size(self) -> int:
        """``C``: committed tokens encoded before the block."""
        return self.config.context or self.config.block_size - 1

    @property
    def has_unconditional(self) -> bool:
        return self.cls_embedding.has_null

    @property
    def causal(self) -> bool:
        """``attention="causal"``: every slot sees the slots before it only (module docstring)."""
        return self.config.attention == "causal"

    @property
    def mask_id(self) -> int:
        return self.config.vocab_size

    def _check(self, tokens: Tensor, num_prefix: Tensor, num_masked: Tensor, labels: Tensor, validate: bool) -> int:
        """Shapes and dtypes (no read-back); with ``validate`` also the values (reads them back)."""
        cfg = self.config
        for name, value in (("tokens", tokens), ("num_prefix", num_prefix), ("num_masked", num_masked), ("labels", labels)):
            if not isinstance(value, Tensor) or value.dtype not in (torch.int64, torch.int32):
                raise ValueError(f"{name} must be an integer tensor, got "
                                 f"{value.dtype if isinstance(value, Tensor) else type(value).__name__}")
        if tokens.dim() != 2 or tokens.shape[0] < 1:
            raise ValueError(f"tokens must have shape [batch, T] (image tokens by absolute position), got {tuple(tokens.shape)}")
        batch = tokens.shape[0]
        for name, value in (("num_prefix", num_prefix), ("num_masked", num_masked), ("labels", labels)):
            if value.shape != (batch,):
                raise ValueError(f"{name} must have shape [{batch}] (one per sample of tokens), got {tuple(value.shape)}")
        if validate:
            if int(labels.min()) < 0 or int(labels.max()) >= cfg.num_classes:
                raise ValueError(f"labels must lie in [0, {cfg.num_classes}), got values in [{int(labels.min())}, {int(labels.max())}]")
            if int(num_prefix.min()) < 1 or int(num_prefix.max()) > tokens.shape[1]:
                raise ValueError(f"num_prefix must lie in [1, {tokens.shape[1]}] (committed tokens, at most tokens' width), "
                                 f"got values in [{int(num_prefix.min())}, {int(num_prefix.max())}]")
            if int(num_masked.min()) < 0 or int(num_masked.max()) > cfg.max_block:
                raise ValueError(f"num_masked must lie in [0, {cfg.max_block}] (max_block), got values in "
                                 f"[{int(num_masked.min())}, {int(num_masked.max())}]")
            if int((num_prefix + num_masked).max()) > cfg.block_size:
                raise ValueError(f"num_prefix + num_masked must be at most block_size={cfg.block_size} (the block lies in the image)")
            if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= cfg.vocab_size):
                raise ValueError(f"tokens must lie in [0, {cfg.vocab_size}), got values in [{int(tokens.min())}, {int(tokens.max())}]")
        return batch

    # ------------------------------------------------------------------ forward
    def _encode(self, ids: Tensor, positions: Tensor, labels: Tensor, condition_drop: Optional[Tensor], mask: Tensor,
                rows: slice) -> Tensor:
        """Float logits of the slots ``rows`` of ``[class, ids]``: token ``ids [B, L]`` at image ``positions [B, L]``
        (RoPE row ``1 + position``, clamped into the grid; the class token gets row 0), attention ``mask``
        ``[B, 1, 1 or 1 + L, 1 + L]`` (True = visible)."""
        device = self.device
        h = torch.cat([self.cls_embedding(labels.to(device).long(), condition_drop), self.tok_embeddings(ids)], dim=1)
        table = self.freqs_cis.to(device)
        if table.device != self.freqs_cis.device:
            self.freqs_cis = table
        grid = positions.clamp(0, self.config.block_size - 1)
        rope = table[torch.cat([torch.zeros_like(positions[:, :1]), 1 + grid], dim=1)]
        for layer in self.layers:
            h = layer(h, rope, mask)
        return self.output(self.norm(h[:, rows])).float()

    def forward(self, tokens: Tensor, num_prefix: Tensor, num_masked: Tensor, labels: Tensor,
                condition_drop: Optional[Tensor] = None, validate: bool = True) -> Tensor:
        """Logits ``[B, max_block, V]`` (float32) of the masked positions ``num_prefix[b] + i``, ``i < max_block``.

        Args:
            tokens: ``[B, T]`` image tokens by absolute position; positions ``< num_prefix[b]`` are read (the last
                ``C`` of them), the rest are ignored.
            num_prefix: ``[B]`` committed tokens ``n_b >= 1``.
            num_masked: ``[B]`` masked positions ``k_b <= max_block`` (``n_b + k_b <= block_size``); rows ``i >= k_b``
                of the output are padding (their masks are hidden from every other token).
            labels: ``[B]`` class ids; ``condition_drop``: ``[B]`` bool, use the null class instead.
            validate: check the values too (reads them back; decoders that keep the invariants pass False).
        """
        batch = self._check(tokens, num_prefix, num_masked, labels, validate)
        cfg, device = self.config, self.device
        if condition_drop is not None:
            if condition_drop.shape != (batch,) or condition_drop.dtype != torch.bool:
                raise ValueError(f"condition_drop must be a bool tensor of shape [{batch}], got "
                                 f"{tuple(condition_drop.shape)} {condition_drop.dtype}")
            if not self.has_unconditional and validate and bool(condition_drop.any()):
                raise ValueError("condition_drop needs a null class, but this drafter has class_dropout_prob=0")
        tokens, num_prefix, num_masked = tokens.to(device), num_prefix.to(device).long(), num_masked.to(device).long()
        context, block = self.context_size, cfg.max_block
        # slots 0 .. C-1: positions n - C .. n - 1; slots C .. C + K - 1: masks for positions n .. n + K - 1
        offsets = torch.arange(-context, block, device=device)
        positions = num_prefix[:, None] + offsets[None, :]  # [B, C + K]
        is_prefix = offsets[None, :] < 0
        shown = num_masked - 1 if self.causal else num_masked  # causal: the last mask would stand in for x_{n+K-1}
        visible = (positions >= 0) & (is_prefix | (offsets[None, :] < shown[:, None]))
        read = positions.clamp(0, tokens.shape[1] - 1)
        ids = torch.where(is_prefix & visible, tokens.long().gather(1, read), torch.full_like(read, self.mask_id))
        keys = torch.cat([torch.ones_like(visible[:, :1]), visible], dim=1)  # the class token is always visible
        mask = keys[:, None, None, :]  # [B, 1, 1, 1 + C + K]: bidirectional, padding keys hidden
        if self.causal:  # the masks stand in for x_n .. x_{n+K-2}; row i is read at the slot of x_{n+i-1}
            order = torch.arange(keys.shape[1], device=device)
            mask = mask & (order[None, None, :, None] >= order[None, None, None, :])
        first = context if self.causal else 1 + context  # the slot of row 0
        return self._encode(ids, positions, labels, condition_drop, mask, rows=slice(first, first + block))

    def forward_packed(self, tokens: Tensor, starts: Tensor, labels: Tensor,
                       condition_drop: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
        """Training forward of a causal drafter: many blocks of one sequence in one pass (no values checked).

        The input is ``[class, x_0 .. x_{N-2}]`` followed by ``M`` groups of ``K - 1`` masks, group ``m`` standing in for
        ``x_{s_m} .. x_{s_m + K - 2}`` (``s = starts``); a prefix token sees the class and the tokens up to itself, a mask
        of group ``m`` the class, ``x_{<s_m}`` and its group's masks up to itself. Every output so
        is the one :meth:`forward` gives for the same block: returns ``(first [B, N - 1, V], rest [B, M, K - 1, V])``,
        ``first[:, t - 1]`` the block's first row for ``n = t`` (position ``t`` from ``x_{<t}``), ``rest[:, m, j]`` its row
        ``j + 1`` for ``n = s_m`` (position ``s_m + j + 1``; rows past the image are padding).

        Args:
            tokens: ``[B, N]`` image tokens, ``N <= block_size``.
            starts: ``[B, M]`` block starts ``1 <= s_m <= N - 1``.
            labels, condition_drop: as in :meth:`forward`.
        """
        if not self.causal:
            raise ValueError("forward_packed needs attention='causal' (a bidirectional drafter's prefix depends on its masks)")
        cfg, device = self.config, self.device
        tokens, starts = tokens.to(device).long(), starts.to(device).long()
        batch, num = tokens.shape
        width = cfg.max_block - 1
        prefix_pos = torch.arange(num - 1, device=device)
        mask_pos = starts[:, :, None] + torch.arange(width, device=device)  # [B, M, K-1]
        group = torch.arange(starts.shape[1], device=device)[:, None].expand(-1, width).reshape(-1)  # [M(K-1)]
        mask_pos = mask_pos.reshape(batch, -1)
        ids = torch.cat([tokens[:, :-1], torch.full_like(mask_pos, self.mask_id)], dim=1)
        positions = torch.cat([prefix_pos[None].expand(batch, -1), mask_pos], dim=1)  # [B, L - 1]
        # who sees whom: query rows and key columns over [class, prefix, masks]
        is_mask = torch.cat([torch.zeros(num - 1, dtype=torch.bool, device=device),
                             torch.ones(group.numel(), dtype=torch.bool, device=device)])
        slot_group = torch.cat([torch.full((num - 1,), -1, device=device), group])
        q_pos, k_pos = positions[:, :, None], positions[:, None, :]
        q_mask, k_mask = is_mask[None, :, None], is_mask[None, None, :]
        block_start = torch.cat([prefix_pos[None].expand(batch, -1) + 1, starts[:, group]], dim=1)[:, :, None]  # [B, L-1, 1]
        sees_prefix = ~k_mask & (k_pos < block_start)  # causal drafters read the whole prefix (context 0)
        sees_own_masks = q_mask & k_mask & (slot_group[None, :, None] == slot_group[None, None, :]) & (k_pos <= q_pos)
        body = sees_prefix | sees_own_masks  # [B, L-1, L-1]
        mask = torch.ones(batch, 1 + body.shape[1], 1 + body.shape[1], dtype=torch.bool, device=device)
        mask[:, 1:, 1:] = body
        mask[:, 0, 1:] = False  # the class token sees itself only
        out = self._encode(ids, positions, labels, condition_drop, mask[:, None], rows=slice(1, None))
        return out[:, : num - 1], out[:, num - 1 :].reshape(batch, starts.shape[1], width, -1)

    @torch.no_grad()
    def propose(self, tokens: Tensor, num_prefix: Tensor, num_masked: Tensor, condition: LlamaGenCondition, *,
                guidance: bool, validate: bool = True) -> WindowLogits:
        """One drafter forward for a block per sample: raw logits ``[B, max_block, V]`` of its masked positions,
        the conditional half and (``guidance=True``) the null-class half, computed as one doubled batch.

        ``condition``: a class-conditional :class:`~vispec.models.llamagen_gpt.LlamaGenCondition`;
        ``tokens``, ``num_prefix``, ``num_masked``, ``validate`` as in :meth:`forward`."""
        if not isinstance(condition, LlamaGenCondition) or condition.class_labels is None or condition.caption_embeds is not None:
            raise ValueError(f"condition must be a class-conditional LlamaGenCondition (class_labels), got "
                             f"{type(condition).__name__}")
        if guidance and not self.has_unconditional:
            raise ValueError("guidance needs an unconditional branch, but this drafter has no null class (class_dropout_prob=0)")
        labels = condition.class_labels
        self._check(tokens, num_prefix, num_masked, labels, validate=False)  # shapes first, before the doubled batch
        if not guidance:
            return WindowLogits(self(tokens, num_prefix, num_masked, labels, validate=validate))
        batch = tokens.shape[0]
        drop = torch.cat([torch.zeros(batch, dtype=torch.bool), torch.ones(batch, dtype=torch.bool)]).to(self.device)
        both = self(tokens.repeat(2, 1), num_prefix.repeat(2), num_masked.repeat(2), labels.repeat(2), drop, validate=validate)
        return WindowLogits(both[:batch], both[batch:])
