"""Unified-token image models (Chameleon, Lumina-mGPT 2.0, Emu3, Janus) behind the decoder protocol.

These are decoder-only transformers whose one sequence holds text and image tokens. An image is laid out
(:class:`ImageLayout`) as ``prefix`` (image start, resolution tokens), then ``rows`` rows of ``cols``
codes each followed by an end-of-row token (Lumina-mGPT, Emu3; none for Janus), then ``suffix`` (image
end). vispec decodes only the rows: the decoder's vocabulary is the codes plus the end-of-row token
(``V = num_codes + 1``; the head's other rows are never sampled, so they are not computed), and the
end-of-row token is forced at the end of every row and masked elsewhere by a position processor
(:class:`vispec.processors.PeriodicForcedToken`). At a forced position the target is one-hot,
so any draft there is accepted or replaced by the forced token: every decoder stays exact.

:class:`UnifiedTokenModel` implements :class:`vispec.protocol.SpeculativeARModel` over a transformers
model through a :class:`Backbone` (how to embed prompt and image tokens, run the layers, and compute the
image logits; one per family in :mod:`vispec.models.unified_families`). Its cache (:class:`RaggedKVCache`)
is a transformers-compatible cache object of fixed capacity in which every row keeps its own length, so
samples advance at their own pace and roll back per sample; attention gets a 4-D mask built from those
lengths (transformers passes a 4-D mask through unchanged) and RoPE gets per-row position ids. The cache
is passed as ``cache=``, the argument transformers 5.24 introduced (it deprecates ``past_key_values=`` for
removal in 5.40), or as ``past_key_values=`` to a ``forward`` without a ``cache`` parameter (transformers
5.23; :func:`cache_keyword`).

Classifier-free guidance runs a doubled batch, conditional rows first; the unconditional rows have their
own prompt (:class:`UnifiedCondition`): only the image prefix (Lumina-mGPT: guidance starts at image
start), a negative prompt (Emu3), or the prompt with every token but BOS and image start replaced by pad
(Janus). Both halves are fed the same image tokens.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vispec.checks import check_int
from vispec.models.offload import materialized, module_device, run_offload_hook
from vispec.processors import PeriodicForcedToken
from vispec.protocol import WindowLogits, check_path, check_tree, keep_path, tree_ancestors, tree_depths, window_visibility

CFG_MODES = ("image_start", "negative", "pad")


@dataclass(frozen=True)
class ImageLayout:
    """Where an image's tokens sit in a unified model's sequence and vocabulary.

    Args:
        rows, cols: the code grid (``rows x cols`` codes).
        code_offset: the model vocabulary id of code 0 (codes are contiguous: ``code_offset + c``); ignored by
            models with a separate image head (Janus).
        num_codes: the VQ codebook size.
        eol_id: the end-of-row token's id, after every row; None when rows have no end token.
        prefix: ids that open the image after the prompt (image start, resolution tokens).
        suffix: ids that close it after the last row (image end, end of sequence).
    """

    rows: int
    cols: int
    num_codes: int
    code_offset: int = 0
    eol_id: Optional[int] = None
    prefix: tuple[int, ...] = ()
    suffix: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in ("rows", "cols", "num_codes"):
            check_int(name, getattr(self, name), minimum=1)
        check_int("code_offset", self.code_offset, minimum=0)
        if self.eol_id is not None:
            check_int("eol_id", self.eol_id, minimum=0)
        for name in ("prefix", "suffix"):
            ids = getattr(self, name)
            if not isinstance(ids, tuple) or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
                raise ValueError(f"{name} must be a tuple of non-negative token ids, got {ids!r}")

    @property
    def row_length(self) -> int:
        """Decoded tokens per row: the codes and the end-of-row token, if any."""
        return self.cols + (self.eol_id is not None)

    @property
    def num_tokens(self) -> int:
        """Tokens the decoder generates: every row with its end-of-row token."""
        return self.rows * self.row_length

    @property
    def vocab_size(self) -> int:
        """The decoder's vocabulary: the codes, then the end-of-row token (index ``num_codes``)."""
        return self.num_codes + (self.eol_id is not None)

    def processors(self) -> tuple[Callable[[Tensor, Tensor], Tensor], ...]:
        """Position processors: the end-of-row token forced at every row's end and masked elsewhere."""
        return () if self.eol_id is None else (PeriodicForcedToken(self.num_codes, self.row_length),)

    def check_tokens(self, name: str, tokens: Any, batch: int) -> Tensor:
        """``tokens`` (argument ``name``) as ``[batch, num_tokens]`` int64 decoder tokens of whole images, checked:
        codes in ``[0, num_codes)``, and with an end-of-row token exactly at every row's end."""
        if not isinstance(tokens, Tensor) or tokens.dtype.is_floating_point or tokens.dtype == torch.bool:
            got = f"{tokens.dtype} tensor" if isinstance(tokens, Tensor) else type(tokens).__name__
            raise ValueError(f"{name} must be an integer tensor of image tokens, got {got}")
        if tuple(tokens.shape) != (batch, self.num_tokens):
            raise ValueError(f"{name} must have shape [{batch}, {self.num_tokens}] ({self.rows} rows of {self.row_length} "
                             f"tokens per image), got {tuple(tokens.shape)}")
        tokens = tokens.long()
        rows = tokens.view(batch, self.rows, self.row_length)
        codes = rows[:, :, : self.cols]
        if bool(((codes < 0) | (codes >= self.num_codes)).any()):
            raise ValueError(f"{name}: codes must lie in [0, {self.num_codes}), got values in "
                             f"[{int(codes.min())}, {int(codes.max())}]")
        if self.eol_id is not None and not bool((rows[:, :, self.cols] == self.num_codes).all()):
            raise ValueError(f"{name}: every row must end with the end-of-row token ({self.num_codes} in decoder tokens)")
        return tokens

    def tokens_of_codes(self, codes: Tensor) -> Tensor:
        """Decoder tokens ``[B, num_tokens]`` of code grids ``[B, rows, cols]``: each row, then end of row if any."""
        if codes.dim() != 3 or tuple(codes.shape[1:]) != (self.rows, self.cols):
            raise ValueError(f"codes must have shape [B, {self.rows}, {self.cols}], got {tuple(codes.shape)}")
        if self.eol_id is None:
            return codes.reshape(codes.shape[0], -1).long()
        ends = torch.full((codes.shape[0], self.rows, 1), self.num_codes, dtype=torch.long, device=codes.device)
        return torch.cat([codes.long(), ends], dim=2).view(codes.shape[0], -1)

    def model_ids(self, tokens: Tensor) -> Tensor:
        """Decoder tokens (codes, ``num_codes`` for end of row) as the model's vocabulary ids."""
        ids = tokens + self.code_offset
        return ids if self.eol_id is None else torch.where(tokens == self.num_codes, self.eol_id, ids)

    def codes(self, tokens: Tensor) -> Tensor:
        """The ``[B, rows, cols]`` code grid of decoded tokens ``[B, num_tokens]`` (end-of-row tokens dropped;
        -1, an undecided token, stays -1)."""
        if tokens.dim() != 2 or tokens.shape[1] != self.num_tokens:
            raise ValueError(f"tokens must have shape [B, {self.num_tokens}], got {tuple(tokens.shape)}")
        return tokens.view(-1, self.rows, self.row_length)[:, :, : self.cols]

    def sequence(self, tokens: Tensor) -> Tensor:
        """The image's whole span in model ids: ``prefix``, the decoded rows, ``suffix`` (``[B, T]``)."""
        body = self.model_ids(tokens)
        prefix = torch.tensor(self.prefix, dtype=torch.long, device=tokens.device).expand(tokens.shape[0], -1)
        suffix = torch.tensor(self.suffix, dtype=torch.long, device=tokens.device).expand(tokens.shape[0], -1)
        return torch.cat([prefix, body, suffix], dim=1)


@dataclass
class UnifiedCondition:
    """Per sample, the conditional prompt and (for guidance) the unconditional one, as model token ids that end
    where the image's first row begins (the layout's prefix included). Build them with
    :meth:`UnifiedTokenModel.condition`."""

    prompts: list[Tensor]
    unconditional: list[Tensor] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.prompts:
            raise ValueError("a UnifiedCondition needs at least one prompt")
        for name, rows in (("prompts", self.prompts), ("unconditional", self.unconditional)):
            for row in rows:
                if not isinstance(row, Tensor) or row.dim() != 1 or row.numel() == 0 or row.dtype != torch.long:
                    raise ValueError(f"{name} must be non-empty 1-D LongTensors of token ids, got {row!r}")
        if self.unconditional and len(self.unconditional) != len(self.prompts):
            raise ValueError(f"unconditional has {len(self.unconditional)} prompts for {len(self.prompts)} prompts")

    @property
    def batch_size(self) -> int:
        return len(self.prompts)

    def select(self, index: Tensor) -> "UnifiedCondition":
        picked = [int(i) for i in index.tolist()]
        return UnifiedCondition([self.prompts[i] for i in picked], [self.unconditional[i] for i in picked]
                                if self.unconditional else [])


class RaggedKVCache:
    """A fixed-capacity key/value cache in which every row (a sample, or its unconditional twin) has its own
    length: transformers' attention layers call :meth:`update` with a window's keys and values, which are
    written at each row's :attr:`write_at` positions, and read the whole capacity back (the 4-D mask hides
    what a row has not written). Duck-typed to transformers' ``Cache`` (``update``)."""

    def __init__(self, layers: int, rows: int, heads: int, capacity: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device):
        self.keys = [torch.zeros(rows, heads, capacity, head_dim, dtype=dtype, device=device) for _ in range(layers)]
        self.values = [torch.zeros_like(k) for k in self.keys]
        self.write_at: Optional[Tensor] = None  # [R, W] cache positions of the window being run
        self.rows_index: Optional[Tensor] = None  # rows being run (refill), None: all

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2]

    def update(self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor]:
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        index = self.write_at[:, None, :, None].expand(-1, keys.shape[1], -1, keys.shape[3])
        if self.rows_index is not None:  # a refill: only some rows run
            k_rows, v_rows = keys[self.rows_index], values[self.rows_index]
            k_rows.scatter_(2, index, key_states.to(keys.dtype))
            v_rows.scatter_(2, index, value_states.to(values.dtype))
            keys[self.rows_index], values[self.rows_index] = k_rows, v_rows
            return k_rows, v_rows
        keys.scatter_(2, index, key_states.to(keys.dtype))
        values.scatter_(2, index, value_states.to(values.dtype))
        return keys, values

    def get_seq_length(self, layer_idx: int = 0) -> int:  # transformers asks only without position ids
        raise RuntimeError("RaggedKVCache has per-row lengths; pass position_ids")

    def select_rows(self, rows: Tensor) -> None:
        self.keys = [k[rows] for k in self.keys]
        self.values = [v[rows] for v in self.values]


@dataclass
class UnifiedDecodeState:
    """The decode state of :class:`UnifiedTokenModel`: the cache, each row's cached length and prompt length
    (rows: the samples, then their unconditional twins when ``guidance``)."""

    cache: RaggedKVCache
    lengths: Tensor  # [R] cached positions per row (prompt included)
    prompt_lengths: Tensor  # [R]
    guidance: bool
    validate: bool = True
    last_window: int = 0

    @property
    def batch_size(self) -> int:
        return self.lengths.shape[0] // (2 if self.guidance else 1)

    def rows(self, index: Tensor) -> Tensor:
        """Row ids of samples ``index`` (and their unconditional twins)."""
        return torch.cat([index, index + self.batch_size]) if self.guidance else index


def cache_keyword(body: nn.Module) -> str:
    """The keyword under which ``body`` takes its key/value cache: ``"cache"`` when its ``forward`` has that
    parameter (transformers >= 5.24, whose ``deprecate_kwarg`` maps ``past_key_values`` to it with a
    FutureWarning until its removal in 5.40), else ``"past_key_values"`` (transformers 5.23, custom bodies)."""
    return "cache" if "cache" in inspect.signature(body.forward).parameters else "past_key_values"


class Backbone:
    """How :class:`UnifiedTokenModel` runs one transformers model family.

    Args:
        body: the decoder stack, called as ``body(inputs_embeds=, position_ids=, attention_mask=, cache=,
            use_cache=True)`` (``past_key_values=`` instead of ``cache=`` when its ``forward`` has no ``cache``
            parameter: :func:`cache_keyword`) and returning ``last_hidden_state``.
        embed_prompt: model ids ``[B, T]`` -> embeddings.
        embed_image: decoder tokens ``[B, T]`` -> embeddings.
        image_head: hidden states ``[B, T, D]`` -> image logits ``[B, T, V]`` (codes, then end of row).
        config: the text config (``num_hidden_layers``, ``num_key_value_heads``, ``hidden_size``, ...).
        module: the model itself (device, dtype, parameters).
    """

    def __init__(self, body: nn.Module, embed_prompt: Callable[[Tensor], Tensor], embed_image: Callable[[Tensor], Tensor],
                 image_head: Callable[[Tensor], Tensor], config: Any, module: nn.Module,
                 image_embeddings: Callable[[], Tensor]):
        self.body, self.embed_prompt, self.embed_image, self.image_head = body, embed_prompt, embed_image, image_head
        self.config, self.module, self.image_embeddings = config, module, image_embeddings
        self.cache_keyword = cache_keyword(body)

    @property
    def geometry(self) -> tuple[int, int, int]:
        """``(layers, key/value heads, head dim)``."""
        cfg = self.config
        heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        return cfg.num_hidden_layers, getattr(cfg, "num_key_value_heads", None) or heads, head_dim


def _rows_of(weight: Tensor, ids: Tensor) -> Tensor:
    return weight.index_select(0, ids.to(weight.device))


def lm_head_backbone(module: nn.Module, body: nn.Module, embed: nn.Embedding, head: nn.Linear, config: Any,
                     layout: ImageLayout) -> Backbone:
    """A :class:`Backbone` for models whose image codes are ordinary vocabulary ids (Chameleon, Lumina-mGPT 2.0,
    Emu3): image tokens are embedded with the token embeddings, and the image logits are the LM head's rows
    of the codes and the end-of-row token."""
    if layout.eol_id is not None and layout.code_offset <= layout.eol_id < layout.code_offset + layout.num_codes:
        raise ValueError(f"eol_id {layout.eol_id} lies inside the code range [{layout.code_offset}, "
                         f"{layout.code_offset + layout.num_codes})")
    top = max(layout.code_offset + layout.num_codes, (layout.eol_id or 0) + 1)
    if top > embed.num_embeddings or top > head.out_features:
        raise ValueError(f"the layout's ids reach {top - 1}, beyond the model's vocabulary of {head.out_features}")
    ids = torch.arange(layout.vocab_size)
    ids = layout.model_ids(ids)

    def image_head(hidden: Tensor) -> Tensor:  # the head's rows, read through the offload hook if it parks them
        bias = None if head.bias is None else _rows_of(materialized(head, "bias"), ids)
        return F.linear(hidden, _rows_of(materialized(head), ids), bias)

    return Backbone(body, embed, lambda tokens: embed(layout.model_ids(tokens)), image_head, config, module,
                    lambda: _rows_of(materialized(embed), ids))


class _ImageEmbeddings:
    """``model.tok_embeddings.weight``: the image tokens' input embeddings (GSD's token distances)."""

    def __init__(self, backbone: Backbone):
        self._backbone = backbone

    @property
    def weight(self) -> Tensor:
        return self._backbone.image_embeddings()


def _fires_offload_hook(method: Callable) -> Callable:
    """Fire the wrapped transformer's offload hook before ``method`` (the decoders call these methods, which
    run the transformer's parts, never its ``forward``): under model offload it moves to its device every call."""
    @functools.wraps(method)
    def wrapper(self: "UnifiedTokenModel", *args: Any, **kwargs: Any) -> Any:
        run_offload_hook(self.model)
        return method(self, *args, **kwargs)

    return wrapper


class UnifiedTokenModel(nn.Module):
    """A unified-token transformers model as a :class:`vispec.protocol.SpeculativeARModel` (module docstring).

    Args:
        backbone: the family's :class:`Backbone` (:mod:`vispec.models.unified_families`).
        layout: the image layout (grid, ids, prefix).
        cfg_mode: how :meth:`condition` builds unconditional prompts: ``"image_start"`` (only the layout's
            prefix), ``"negative"`` (a negative prompt, empty by default) or ``"pad"`` (the prompt with every
            token but ``bos_id`` and the image-start token replaced by ``pad_id``).
        bos_id, pad_id: for ``"pad"``.
    """

    compilable = False  # decode(compile=True) refuses it: the transformers forward is not a static step

    def __init__(self, backbone: Backbone, layout: ImageLayout, cfg_mode: str = "image_start",
                 bos_id: Optional[int] = None, pad_id: Optional[int] = None):
        super().__init__()
        if cfg_mode not in CFG_MODES:
            raise ValueError(f"cfg_mode must be one of {CFG_MODES}, got {cfg_mode!r}")
        if cfg_mode == "pad" and pad_id is None:
            raise ValueError("cfg_mode 'pad' needs pad_id")
        self.model = backbone.module  # registered: .to(), .eval(), parameters() reach the wrapped model
        self.backbone, self.layout, self.cfg_mode, self.bos_id, self.pad_id = backbone, layout, cfg_mode, bos_id, pad_id
        self.tok_embeddings = _ImageEmbeddings(backbone)

    # ---- facts the decoders read ------------------------------------------------------------------------
    @property
    def image_vocab_size(self) -> int:
        return self.layout.vocab_size

    @property
    def num_image_tokens(self) -> int:
        return self.layout.num_tokens

    @property
    def grid_size(self) -> int:
        """Decoded tokens per row (codes and end of row): the width SJD's vertical initialisation uses."""
        return self.layout.row_length

    @property
    def position_processors(self) -> tuple:
        """Processors :func:`vispec.decoding.decode` applies with this model: the forced end-of-row token."""
        return self.layout.processors()

    @property
    def device(self) -> torch.device:
        """Where the model computes: its weights' device, or the offload hooks' execution device while
        sequential offload parks the weights on ``meta``."""
        return module_device(self.model)

    @property
    def max_positions(self) -> Optional[int]:
        """The transformer's context (its text config's ``max_position_embeddings``); None when it names none."""
        value = getattr(self.backbone.config, "max_position_embeddings", None)
        return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None

    def check_context(self, longest_prompt: int, num_tokens: int) -> None:
        """Raise a ValueError when a prompt of ``longest_prompt`` tokens (the image prefix included) and
        ``num_tokens`` image tokens need more positions than :attr:`max_positions`."""
        limit = self.max_positions
        if limit is not None and longest_prompt + num_tokens > limit:
            raise ValueError(f"a prompt of {longest_prompt} tokens (image prefix included) and {num_tokens} image tokens "
                             f"need {longest_prompt + num_tokens} positions, beyond the model's context of {limit} "
                             f"(max_position_embeddings)")

    def cache_bytes(self, rows: int, capacity: int) -> int:
        """Bytes of the key/value cache :meth:`prefill` allocates for ``rows`` rows (samples, and their
        unconditional twins under guidance) of ``capacity`` positions."""
        layers, heads, head_dim = self.backbone.geometry
        return 2 * layers * rows * heads * capacity * head_dim * self.dtype.itemsize

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    # ---- conditions ---------------------------------------------------------------------------------------
    def condition(self, prompt_ids: Sequence[Sequence[int]], negative_prompt_ids: Optional[Sequence[Sequence[int]]] = None,
                  *, add_prefix: bool = True, source: Optional[Tensor] = None) -> UnifiedCondition:
        """Conditional and unconditional prompts from tokenized prompts (one list of ids per sample). With
        ``add_prefix`` the layout's prefix (image start, resolution tokens) is appended to both; without, the
        ids must already end with it (transformers' Emu3 processor adds it).

        ``source``: an image-to-image request's source panel, decoder tokens ``[B, num_tokens]`` laid out as the
        decoded image (rows of codes, each ended by the end-of-row token when the layout has one), appended after
        the prefix in both branches: the dual-panel layout of Lumina-mGPT 2.0's image-to-image tasks, where the
        prefix declares twice the rows, the source fills the upper panel and the decoder writes the lower one.
        Guidance keeps it in the unconditional branch (which starts at image start, or holds the negative
        prompt or the padded prompt): only the text is dropped."""
        prompts = [self._ids("prompt_ids", p) for p in prompt_ids]
        prefix = torch.tensor(self.layout.prefix, dtype=torch.long)
        if add_prefix:
            prompts = [torch.cat([p, prefix]) for p in prompts]
        if self.cfg_mode == "image_start":
            if negative_prompt_ids is not None:
                raise ValueError("negative_prompt_ids need cfg_mode 'negative' (this model starts guidance at image start)")
            uncond = [prefix.clone() for _ in prompts]
        elif self.cfg_mode == "negative":
            negatives = [[] for _ in prompts] if negative_prompt_ids is None else list(negative_prompt_ids)
            if len(negatives) != len(prompts):
                raise ValueError(f"negative_prompt_ids has {len(negatives)} prompts for {len(prompts)} prompts")
            uncond = [self._ids("negative_prompt_ids", n, allow_empty=add_prefix) for n in negatives]
            uncond = [torch.cat([n, prefix]) if add_prefix else n for n in uncond]
        else:
            keep = [i for i in (self.bos_id, self.layout.prefix[0] if self.layout.prefix else None) if i is not None]
            uncond = [torch.where(torch.isin(p, torch.tensor(keep, dtype=torch.long)), p, self.pad_id) for p in prompts]
        if any(u.numel() == 0 for u in uncond):
            raise ValueError("an unconditional prompt is empty: give negative_prompt_ids or a layout prefix")
        if source is not None:
            panels = self.layout.model_ids(self.layout.check_tokens("source", source, len(prompts)).cpu())
            prompts = [torch.cat([p, panel]) for p, panel in zip(prompts, panels)]
            uncond = [torch.cat([u, panel]) for u, panel in zip(uncond, panels)]
        return UnifiedCondition(prompts, uncond)

    @staticmethod
    def _ids(name: str, ids: Any, allow_empty: bool = False) -> Tensor:
        if isinstance(ids, Tensor):
            if ids.dim() != 1 or ids.dtype.is_floating_point or ids.dtype == torch.bool:
                raise ValueError(f"{name} must be 1-D integer token ids per sample, got {ids.dtype} of shape {tuple(ids.shape)}")
            ids = ids.tolist()
        if not isinstance(ids, (list, tuple)) or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
            raise ValueError(f"{name} must hold one list of non-negative token ids per sample, got {ids!r}")
        if not ids and not allow_empty:
            raise ValueError(f"{name} has an empty prompt")
        return torch.tensor(ids, dtype=torch.long)

    # ---- the decoder protocol -----------------------------------------------------------------------------
    @_fires_offload_hook
    @torch.no_grad()
    def prefill(self, condition: UnifiedCondition, *, guidance: bool, max_new_tokens: int, window: int = 1,
                validate: bool = True) -> tuple[UnifiedDecodeState, WindowLogits]:
        """Cache every row's prompt; return logits ``[B, 1, V]`` for the first image token. The cache holds
        the longest prompt plus ``max_new_tokens + window`` positions."""
        rows_ids = self._rows(condition, guidance)
        check_int("max_new_tokens", max_new_tokens, minimum=1, maximum=self.layout.num_tokens)
        check_int("window", window, minimum=1)
        longest = max(r.numel() for r in rows_ids)
        self.check_context(longest, max_new_tokens)
        layers, heads, head_dim = self.backbone.geometry
        cache = RaggedKVCache(layers, len(rows_ids), heads, longest + max_new_tokens + window, head_dim, self.dtype,
                              self.device)
        lengths = torch.tensor([r.numel() for r in rows_ids], device=self.device)
        state = UnifiedDecodeState(cache, torch.zeros_like(lengths), lengths.clone(), guidance, validate)
        last = self._run_prompts(state, rows_ids, None)
        state.lengths = lengths
        return state, self._split(state, last)

    @_fires_offload_hook
    @torch.no_grad()
    def refill(self, state: UnifiedDecodeState, index: Tensor, condition: UnifiedCondition) -> WindowLogits:
        """Start new samples in slots ``index [k]`` (continuous batching): their prompts overwrite those rows'
        cache from position 0; returns logits ``[k, 1, V]`` for their first image token."""
        if condition.batch_size != index.shape[0]:
            raise ValueError(f"condition has {condition.batch_size} samples for {index.shape[0]} slots")
        rows_ids = self._rows(condition, state.guidance)
        longest = max(r.numel() for r in rows_ids)
        if longest + self.layout.num_tokens > state.cache.capacity:
            raise ValueError(f"a prompt of {longest} tokens does not fit the running batch's cache "
                             f"(capacity {state.cache.capacity}); decode it in another batch")
        rows = state.rows(index.to(self.device))
        lengths = torch.tensor([r.numel() for r in rows_ids], device=self.device)
        state.lengths[rows] = 0
        last = self._run_prompts(state, rows_ids, rows)
        state.lengths[rows] = lengths
        state.prompt_lengths[rows] = lengths
        k = index.shape[0]
        return WindowLogits(last[:k], last[k:] if state.guidance else None)

    @_fires_offload_hook
    @torch.no_grad()
    def forward_window(self, state: UnifiedDecodeState, tokens: Tensor, longest: Optional[int] = None,
                       parents: Optional[Tensor] = None) -> WindowLogits:
        """Append ``tokens [B, W]`` (decoder vocabulary) after each row's cached prefix; logits ``[B, W, V]``.
        Attention reads the whole capacity through the mask, so nothing is read back. ``parents [B, W]``: the
        window is a token tree (:mod:`vispec.protocol`): a 4-D tree mask, position ids by depth."""
        if tokens.dim() != 2 or tokens.shape[0] != state.batch_size or tokens.shape[1] < 1:
            raise ValueError(f"tokens must have shape [{state.batch_size}, W>=1], got {tuple(tokens.shape)}")
        width = tokens.shape[1]
        if state.validate and int(state.lengths.max()) + width > state.cache.capacity:
            raise ValueError(f"window of {width} tokens overflows the cache (capacity {state.cache.capacity})")
        tokens = tokens.to(self.device)
        ancestors = None
        if parents is not None:
            check_tree(parents, state.batch_size, width, state.validate)
            parents = parents.to(self.device)
            ancestors = tree_ancestors(torch.cat([parents, parents]) if state.guidance else parents)
        if state.guidance:
            tokens = torch.cat([tokens, tokens])
        positions = state.lengths[:, None] + torch.arange(width, device=self.device)
        hidden = self._run(state, self.backbone.embed_image(tokens), positions, None, ancestors)
        state.last_window = width
        return self._split(state, self.backbone.image_head(hidden).float())

    def rollback(self, state: UnifiedDecodeState, keep: Tensor, path: Optional[Tensor] = None) -> None:
        """Keep the first ``keep[b]`` tokens of the last window for each sample; after a tree window, the
        slots ``path[b, :keep[b]]`` (root first), whose keys and values move into place."""
        if keep.shape != (state.batch_size,):
            raise ValueError(f"keep must be a [{state.batch_size}] tensor, got shape {tuple(keep.shape)}")
        if state.validate and (int(keep.min()) < 0 or int(keep.max()) > state.last_window):
            raise ValueError(f"keep must hold values in [0, {state.last_window}]")
        if path is not None:
            check_path(path, state.batch_size, state.last_window, state.validate)
            path = path.to(self.device)
            keep_path((*state.cache.keys, *state.cache.values), state.lengths, torch.cat([path, path]) if state.guidance else path)
        keep = keep.to(state.lengths)
        state.lengths += torch.cat([keep, keep]) if state.guidance else keep
        state.last_window = 0

    def truncate(self, state: UnifiedDecodeState, keep: Tensor) -> None:
        """Keep at most the first ``keep[b]`` cached image tokens of each sample (its prompt stays)."""
        if keep.shape != (state.batch_size,):
            raise ValueError(f"keep must be a [{state.batch_size}] tensor, got shape {tuple(keep.shape)}")
        keep = keep.to(state.lengths)
        keep = torch.cat([keep, keep]) if state.guidance else keep
        state.lengths.copy_(torch.minimum(state.lengths, state.prompt_lengths + keep))
        state.last_window = 0

    def select(self, state: UnifiedDecodeState, index: Tensor) -> UnifiedDecodeState:
        """Keep only samples ``index``."""
        rows = state.rows(index.to(self.device))
        state.cache.select_rows(rows)
        return UnifiedDecodeState(state.cache, state.lengths[rows], state.prompt_lengths[rows], state.guidance,
                                  state.validate)

    # ---- internals ----------------------------------------------------------------------------------------
    def _rows(self, condition: UnifiedCondition, guidance: bool) -> list[Tensor]:
        if not isinstance(condition, UnifiedCondition):
            raise ValueError(f"condition must be a UnifiedCondition (UnifiedTokenModel.condition), got {type(condition).__name__}")
        if guidance and not condition.unconditional:
            raise ValueError("guidance needs unconditional prompts: build the condition with UnifiedTokenModel.condition")
        return list(condition.prompts) + (list(condition.unconditional) if guidance else [])

    def _run_prompts(self, state: UnifiedDecodeState, rows_ids: list[Tensor], rows: Optional[Tensor]) -> Tensor:
        """Run right-padded prompts into the cache (``rows``: the cache rows, None for all); the image logits
        at each prompt's last position ``[R, 1, V]``."""
        longest = max(r.numel() for r in rows_ids)
        pad = self.pad_id if self.pad_id is not None else 0
        ids = torch.full((len(rows_ids), longest), pad, dtype=torch.long)
        for i, r in enumerate(rows_ids):
            ids[i, : r.numel()] = r
        ids = ids.to(self.device)
        positions = torch.arange(longest, device=self.device)[None].expand(len(rows_ids), -1)
        hidden = self._run(state, self.backbone.embed_prompt(ids), positions, rows)
        last = torch.tensor([r.numel() - 1 for r in rows_ids], device=self.device)
        hidden = hidden.gather(1, last[:, None, None].expand(-1, 1, hidden.shape[-1]))
        return self.backbone.image_head(hidden).float()

    def _run(self, state: UnifiedDecodeState, embeds: Tensor, positions: Tensor, rows: Optional[Tensor],
             ancestors: Optional[Tensor] = None) -> Tensor:
        """Run the layers on ``embeds [R, W, D]`` written at cache ``positions [R, W]`` (also the RoPE positions);
        a query sees the cached positions below its own. With ``ancestors [R, W, W]`` (a tree window) a query
        sees the prefix and its ancestors, and its position id is ``prefix + depth``."""
        cache = state.cache
        cache.write_at, cache.rows_index = positions, rows
        if ancestors is None:
            slots = torch.arange(cache.capacity, device=self.device)
            visible = slots[None, None, :] <= positions[:, :, None]
            position_ids = positions
        else:
            visible = window_visibility(positions[:, 0], ancestors, cache.capacity)
            position_ids = positions[:, :1] + tree_depths(ancestors)
        mask = torch.zeros(visible.shape, dtype=embeds.dtype, device=self.device)
        mask = mask.masked_fill(~visible, torch.finfo(embeds.dtype).min)[:, None]
        out = self.backbone.body(inputs_embeds=embeds, position_ids=position_ids, attention_mask=mask,
                                 use_cache=True, **{self.backbone.cache_keyword: cache})
        cache.write_at = cache.rows_index = None
        return out.last_hidden_state

    @staticmethod
    def _split(state: UnifiedDecodeState, logits: Tensor) -> WindowLogits:
        if not state.guidance:
            return WindowLogits(logits)
        half = logits.shape[0] // 2
        return WindowLogits(logits[:half], logits[half:])
