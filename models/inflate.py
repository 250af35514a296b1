"""Function-preserving inflation: a trained LlamaGen GPT (or Chameleon) at a bigger model's cost (issue 33).

Speculative decoding trades one forward of ``W`` tokens for up to ``W`` forwards of one; whether that pays in
wall clock depends on how the forward's cost grows with ``W`` at the model's size (the roofline). A trained small
model has the acceptance rates worth measuring but not the cost; a randomly initialised big model has the cost but
meaningless acceptance. :func:`inflate` builds a bigger :class:`~vispec.models.llamagen_gpt.LlamaGenGPT` (a named
LlamaGen size, e.g. ``GPT-L``, or explicit sizes) that computes the same function as the trained one: the same
logits, hence the same tokens and the same acceptance, at the big model's FLOPs, bytes and KV-cache size. No weights
are shipped; the extra weights are drawn from a seeded generator when the model is built.

The construction (a source of width ``D``, ``L`` layers, ``H`` heads of size ``hd``, SwiGLU width ``F``, into
``D' >= D``, ``L' >= L``, ``F' >= F``):

* **Residual stream zero-padded.** Token and class embeddings get ``D' - D`` zero columns; every matrix that writes
  the residual stream (attention ``wo``, SwiGLU ``w2``) is the source block padded with zeros, so the padded channels
  of the hidden state stay exactly zero through every layer.
* **RMSNorm over the padded width.** With ``x' = [x, 0]``, ``mean(x'^2) = (D / D') mean(x^2)``. Taking
  ``eps' = eps D / D'`` gives ``rsqrt(mean(x'^2) + eps') = sqrt(D' / D) rsqrt(mean(x^2) + eps)``: the normalised
  real channels come out ``sqrt(D' / D)`` times the source's. That factor is folded into the input columns of the
  linear map each norm feeds (``wqkv`` after ``attention_norm``, ``w1`` and ``w3`` after ``ffn_norm``, the ``output``
  head after the final ``norm``): their source blocks are multiplied by ``sqrt(D / D')``. The norm weights stay
  the source's. (Folding instead of scaling the norm weight: the norm weight multiplies a value already rounded
  to the model's dtype, so in bfloat16 the scaled weight would add a second rounding per norm; folded, each weight is
  rounded once. Where ``D' / D`` is a power of 4 (tiny-c2i's 256 to GPT-L's 1024) the factor is a power of two and
  the folded weights are exact; the logits can still differ in the last bits, since the matrix products sum over
  ``D'`` terms in another blocking than over ``D``.)
* **Extra heads.** Heads keep the source's size ``hd`` (the 2-D RoPE table and the attention scale depend on it):
  the inflated model has ``H' = D' / hd`` heads. Heads ``H .. H'-1`` get random ``q/k/v`` rows and zero ``wo``
  columns, so they are computed (cost) and discarded (function). Grouped-query attention keeps the source's
  group size (query heads per key/value head), so every real query head still reads its own key/value head.
* **Wider SwiGLU.** ``w1`` and ``w3`` get ``F' - F`` random rows, ``w2`` zero columns for them.
* **Extra layers.** ``L' - L`` identity layers: random ``wqkv``, ``w1``, ``w3`` (norm weights one, as LlamaGen
  initialises them) and all-zero ``wo`` and ``w2``, so each adds exactly zero to the residual stream. The source
  layers sit at evenly spaced depths ``floor(i L' / L)``.
* **Kept**: the vocabulary and the output head's rows, the class table's rows (classes and the null class), the
  caption projection's input (t2i: ``fc1`` gets random rows, ``fc2`` is zero-padded), the null caption, the 2-D RoPE
  table and the image-token count.

Every weight that does not enter the function is drawn from ``N(0, initializer_range^2)`` (LlamaGen's init), never
left zero where zeros are not needed: the inflated model does the big model's arithmetic on realistic values.

**Head size.** LlamaGen's sizes use 64-dim heads (GPT-B: 12 x 64, GPT-L: 16 x 64, GPT-XL: 20 x 64). A source whose
head size differs (tiny-c2i: 4 heads of 64, so equal; a 32-dim source would get 32 heads of 32 for GPT-L) keeps its
own, which changes the head count, not the cost: the projections are ``D' x D'`` either way and attention reads and
writes ``D'`` channels per token (the FLOPs and the KV-cache bytes of the target); only the attention kernel's tile
shape differs. :attr:`InflationPlan.nominal_n_head` keeps the target's own head count and
:meth:`InflationPlan.describe` names both. A target width that the source head size does not divide is an error.

**Chameleon** (transformers' ``ChameleonForConditionalGeneration``, the unified adapter's Chameleon family: tiny-t2i,
tiny-edit) inflates the same way: ``q/k/v_proj``, ``gate/up_proj`` as ``wqkv``, ``w1/w3`` above; ``o_proj`` and
``down_proj`` zero-padded; the per-head query/key LayerNorms (over the head size) get weight one and bias zero for the
extra heads; biases, where the config has them, random on extra outputs and zero on residual channels; the VQ model
inside is copied. With ``swin_norm`` the RMSNorms sit on the sublayer outputs before the residual add (no linear
follows them), so there the ``sqrt(D / D')`` factor scales the norm weights instead, and the projections read the
residual stream unscaled. An explicit target without ``ffn_hidden`` keeps the source's MLP ratio.

In float32 the inflated model's logits equal the source's up to float rounding (the padded sums run over more terms,
the norm's mean divides by ``D'``): measured max 1.4e-5 (tiny-c2i@GPT-B) and 1.2e-5 (@GPT-L) over 4 images x 256 positions,
argmax equal everywhere. In bfloat16 the folded weights are rounded once more (unless the factor is a power of two)
and the products are blocked differently, so the logits match the bfloat16 source to bfloat16 tolerance: no further
from the float32 logits than twice bfloat16's own error (tested).

Function-preserving growth of networks: Chen, Goodfellow and Shlens, "Net2Net: Accelerating Learning via Knowledge
Transfer" (ICLR 2016, arXiv 1511.05641); for transformers, e.g. Wang et al., "Learning to Grow Pretrained Models for
Efficient Transformer Training" (LiGO, ICLR 2023, arXiv 2303.00980). LlamaGen: Sun et al., arXiv 2406.06525.
"""

from __future__ import annotations

import copy
import math
from dataclasses import asdict, dataclass
from typing import Any, Mapping, Optional, Union

import torch
from torch import Tensor

from vispec.checks import check_int
from vispec.models import offload
from vispec.models.checkpoints import build_on_meta
from vispec.models.llamagen_gpt import GPT_CONFIGS, LlamaGenGPT, ffn_hidden_dim

LLAMAGEN_MULTIPLE_OF = 256
"""The SwiGLU rounding of LlamaGen's named sizes (their ``multiple_of``): a named target's SwiGLU width is
``ffn_hidden_dim(dim, 256)``, e.g. 2048 for GPT-B, 2816 for GPT-L."""

TARGET_KEYS = ("dim", "n_layer", "n_head", "ffn_hidden")
"""The keys of an explicit target (each optional, :func:`inflate`)."""


class InflationError(ValueError):
    """A model or target :func:`inflate` cannot build (raised before any weight is made)."""


@dataclass(frozen=True)
class SourceSizes:
    """The sizes of a model to inflate, read from its config (:func:`source_sizes`). ``family``: ``"llamagen"`` or
    ``"chameleon"``; ``kv_in_config``: whether the config names its key/value heads (LlamaGen's ``n_kv_head`` may be
    None, meaning one per query head); ``swin_norm``: Chameleon's norm-after-sublayer variant."""

    family: str
    dim: int
    n_layer: int
    n_head: int
    n_kv_head: int
    ffn_hidden: int
    norm_eps: float
    kv_in_config: bool = True
    swin_norm: bool = False

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_head


def _get(config: Any, key: str, default: Any = None) -> Any:
    return config.get(key, default) if isinstance(config, Mapping) else getattr(config, key, default)


def source_sizes(config: Any) -> SourceSizes:
    """The :class:`SourceSizes` of a LlamaGen GPT config (a model's ``config`` or its ``config.json`` as a dict) or of
    a transformers Chameleon config (``ChameleonConfig`` or its ``config.json`` dict); InflationError for others."""
    if _get(config, "model_type") == "chameleon":
        if _get(config, "tie_word_embeddings", False):
            raise InflationError("a Chameleon with tied input and output embeddings cannot be inflated: the input table "
                                 "is zero-padded and the head gets the folded norm scale, so the two must differ")
        dim, heads = int(_get(config, "hidden_size")), int(_get(config, "num_attention_heads"))
        return SourceSizes("chameleon", dim, int(_get(config, "num_hidden_layers")), heads,
                           int(_get(config, "num_key_value_heads") or heads), int(_get(config, "intermediate_size")),
                           float(_get(config, "rms_norm_eps")), swin_norm=bool(_get(config, "swin_norm", False)))
    if _get(config, "dim") is None or _get(config, "model_type") not in ("c2i", "t2i"):
        raise InflationError("inflation applies to a LlamaGen GPT (vispec.models.llamagen_gpt) or a transformers Chameleon "
                             f"(ChameleonForConditionalGeneration); got a config with model_type {_get(config, 'model_type')!r}")
    dim, heads = int(_get(config, "dim")), int(_get(config, "n_head"))
    hidden = ffn_hidden_dim(dim, int(_get(config, "multiple_of")), _get(config, "ffn_dim_multiplier"))
    return SourceSizes("llamagen", dim, int(_get(config, "n_layer")), heads, int(_get(config, "n_kv_head") or heads),
                       hidden, float(_get(config, "norm_eps")), kv_in_config=_get(config, "n_kv_head") is not None)


def _default_ffn(config: Any, source: SourceSizes, dim: int) -> int:
    """An explicit target's SwiGLU width when it names none: LlamaGen's rule of the source config at width ``dim``
    (its ``multiple_of`` and ``ffn_dim_multiplier``); Chameleon: the source's ratio, ``ceil(F dim / D)``."""
    if source.family == "llamagen":
        return ffn_hidden_dim(dim, int(_get(config, "multiple_of")), _get(config, "ffn_dim_multiplier"))
    return -(-source.ffn_hidden * dim // source.dim)


@dataclass(frozen=True)
class InflationPlan:
    """The sizes of an inflated model, checked against its source (:func:`plan_inflation`).

    ``n_head`` / ``n_kv_head``: the heads the inflated model has (the source's head size ``head_dim``);
    ``nominal_n_head``: the target's own head count (differs when the target's head size is not the source's).
    ``layer_slots[i]``: the depth of source layer ``i``. ``norm_eps``: the source's ``eps * D / D'``.
    """

    target: str
    source: SourceSizes
    dim: int
    n_layer: int
    n_head: int
    n_kv_head: int
    ffn_hidden: int
    nominal_n_head: int
    norm_eps: float
    layer_slots: tuple[int, ...]

    @property
    def head_dim(self) -> int:
        return self.source.head_dim

    @property
    def norm_scale(self) -> float:
        """``sqrt(D / D')``, folded into the input columns of the linear maps after each norm."""
        return math.sqrt(self.source.dim / self.dim)

    def config_overrides(self) -> dict[str, Any]:
        """The :class:`LlamaGenGPT` constructor arguments that differ from the source's. The SwiGLU width is given
        through ``multiple_of = ffn_hidden`` (with ``ffn_dim_multiplier`` bringing LlamaGen's ``8 D' / 3`` below it
        where needed), so the saved config rebuilds exactly this width."""
        base = int(2 * (4 * self.dim) / 3)
        multiplier = None if base <= self.ffn_hidden else self.ffn_hidden / base
        overrides = dict(dim=self.dim, n_layer=self.n_layer, n_head=self.n_head,
                         n_kv_head=self.n_kv_head if self.source.kv_in_config else None,
                         norm_eps=self.norm_eps, multiple_of=self.ffn_hidden, ffn_dim_multiplier=multiplier)
        if ffn_hidden_dim(self.dim, self.ffn_hidden, multiplier) != self.ffn_hidden:  # a float edge case of int()
            raise InflationError(f"cannot express SwiGLU width {self.ffn_hidden} at dim {self.dim} in a LlamaGen config")
        return overrides

    def to_dict(self) -> dict[str, Any]:
        """The plan as JSON values (a benchmark's ``config.inflation``)."""
        return asdict(self)

    def describe(self) -> str:
        """One line: the sizes, and the head count when it differs from the target's own."""
        heads = f"{self.n_head} heads of {self.head_dim}"
        if self.nominal_n_head != self.n_head:
            heads += f" (the source's head size; {self.target} has {self.nominal_n_head} heads of {self.dim // self.nominal_n_head})"
        src = self.source
        return (f"{self.target}: width {self.dim}, {self.n_layer} layers, {heads}, SwiGLU {self.ffn_hidden}; "
                f"from width {src.dim}, {src.n_layer} layers, {src.n_head} heads, SwiGLU {src.ffn_hidden}")


def _target_sizes(target: Union[str, Mapping[str, int]], config: Any, source: SourceSizes) -> tuple[str, dict]:
    """``(label, {dim, n_layer, n_head, ffn_hidden})`` of a named or explicit target. An explicit target's missing
    ``dim`` and ``n_layer`` are the source's, ``n_head`` is ``dim / head size`` and ``ffn_hidden`` follows
    :func:`_default_ffn`."""
    if isinstance(target, str):
        if target not in GPT_CONFIGS:
            raise InflationError(f"target: unknown GPT config {target!r}; expected one of {sorted(GPT_CONFIGS)} "
                                 f"or a dict with keys from {TARGET_KEYS}")
        named = GPT_CONFIGS[target]
        return target, dict(named, ffn_hidden=ffn_hidden_dim(named["dim"], LLAMAGEN_MULTIPLE_OF, None))
    if not isinstance(target, Mapping):
        raise InflationError(f"target must be a GPT config name or a dict of sizes, got {type(target).__name__}")
    unknown = sorted(set(target) - set(TARGET_KEYS))
    if unknown or not target:
        raise InflationError(f"target: keys must be a non-empty subset of {TARGET_KEYS}, got {sorted(target)}")
    for key, value in target.items():
        check_int(f"target[{key!r}]", value, minimum=1)
    sizes = {"dim": source.dim, "n_layer": source.n_layer, **{k: int(v) for k, v in target.items()}}
    sizes.setdefault("ffn_hidden", _default_ffn(config, source, sizes["dim"]))
    sizes.setdefault("n_head", sizes["dim"] // source.head_dim if sizes["dim"] % source.head_dim == 0 else source.n_head)
    label = ", ".join(f"{k}={v}" for k, v in target.items())
    return f"custom ({label})", sizes


def plan_inflation(config: Any, target: Union[str, Mapping[str, int]]) -> InflationPlan:
    """Check ``target`` against a model's config (:func:`source_sizes`: LlamaGen GPT or Chameleon, the config object
    or its ``config.json`` as a dict) and return the inflated sizes; :class:`InflationError` when the target is
    unknown, smaller than the source in any size, or has a width the source's head size does not divide. Builds
    nothing."""
    source = source_sizes(config)
    label, sizes = _target_sizes(target, config, source)
    new_dim, new_layers, nominal_heads, new_hidden = sizes["dim"], sizes["n_layer"], sizes["n_head"], sizes["ffn_hidden"]
    for what, new, old in (("width (dim)", new_dim, source.dim), ("depth (n_layer)", new_layers, source.n_layer),
                           ("SwiGLU width (ffn_hidden)", new_hidden, source.ffn_hidden)):
        if new < old:
            raise InflationError(f"target {label}: {what} {new} is smaller than the source's {old}; inflation only grows "
                                 "a model")
    if new_dim % nominal_heads:
        raise InflationError(f"target {label}: dim {new_dim} does not split into n_head={nominal_heads} heads")
    head_dim = source.head_dim
    if new_dim % head_dim:
        raise InflationError(f"target {label}: dim {new_dim} is not a multiple of the source's head size {head_dim} "
                             "(heads keep the source's size: RoPE and the attention scale depend on it)")
    new_heads = new_dim // head_dim
    group = source.n_head // source.n_kv_head
    if new_heads % group:
        raise InflationError(f"target {label}: {new_heads} heads of {head_dim} do not split into groups of {group} "
                             "query heads per key/value head (the source's grouped-query attention)")
    return InflationPlan(
        target=label, source=source, dim=new_dim, n_layer=new_layers, n_head=new_heads, n_kv_head=new_heads // group,
        ffn_hidden=new_hidden, nominal_n_head=nominal_heads, norm_eps=source.norm_eps * source.dim / new_dim,
        layer_slots=tuple(i * new_layers // source.n_layer for i in range(source.n_layer)),
    )


# ------------------------------------------------------------------------------------------- size
LLAMAGEN_NULL_CAPTIONS = 120
"""The null-caption rows of a t2i LlamaGen GPT's ``uncond_embedding`` buffer (its T5 length, whatever ``cls_token_num``)."""


def parameter_count(config: Any, plan: Optional[InflationPlan] = None) -> int:
    """The parameters (and persistent buffers) of the transformer ``config`` describes (LlamaGen GPT or Chameleon, the
    config object or its ``config.json`` as a dict; :func:`source_sizes`), or of its inflation by ``plan``: plain
    arithmetic on the sizes, nothing built. A Chameleon's VQ model (copied as it is) is not counted."""
    source = source_sizes(config)
    sizes: Union[SourceSizes, InflationPlan] = source if plan is None else plan
    dim, hd, heads, kv, ffn = sizes.dim, sizes.head_dim, sizes.n_head, sizes.n_kv_head, sizes.ffn_hidden
    vocab = int(_get(config, "vocab_size"))
    # attention (q, k, v, o), SwiGLU (w1, w3, w2) and the two RMSNorms of a layer
    layer = (2 * heads + 2 * kv) * hd * dim + 3 * ffn * dim + 2 * dim
    if source.family == "chameleon":
        layer += 2 * (heads + kv) * hd  # the per-head query/key LayerNorms (weight and bias)
        if _get(config, "attention_bias", False):
            layer += (heads + 2 * kv) * hd + dim
        if _get(config, "mlp_bias", False):
            layer += 2 * ffn + dim
        condition = 0
    elif _get(config, "model_type") == "c2i":
        rows = int(_get(config, "num_classes")) + int(float(_get(config, "class_dropout_prob", 0.1)) > 0)
        condition = rows * dim
    else:  # the caption projection (fc1, fc2) and the null caption
        caption = int(_get(config, "caption_dim"))
        condition = caption * dim + dim * dim + LLAMAGEN_NULL_CAPTIONS * caption
    return 2 * vocab * dim + condition + sizes.n_layer * layer + dim  # token table, head, final norm


def gib(count: int) -> str:
    """``count`` bytes in GiB, one decimal."""
    return f"{count / 2**30:.1f} GiB"


def approx_count(count: int) -> str:
    """``count`` in two significant digits: ``6.5e9``; below 10,000 as it is."""
    return str(count) if count < 10_000 else f"{count:.1e}".replace("e+0", "e").replace("e+", "e")


def check_inflation_memory(what: str, plan: InflationPlan, parameters: int, dtype: torch.dtype,
                           device: Union[str, torch.device]) -> None:
    """Refuse (:class:`InflationError` starting with ``what``, the argument that asked for the size) an inflated model
    whose ``parameters`` at ``dtype`` would not fit the memory available on ``device``
    (:func:`vispec.models.offload.available_memory`: free CUDA memory, the CPU's ``MemAvailable``); nothing is refused
    where that cannot be told."""
    need = parameters * torch.empty((), dtype=dtype).element_size()
    free = offload.available_memory(torch.device(device))
    if free is not None and need > free:
        raise InflationError(f"{what}: the inflated model ({plan.describe()}) has ~{approx_count(parameters)} parameters, "
                             f"{gib(need)} in {str(dtype).removeprefix('torch.')}, more than the {gib(free)} available on "
                             f"{device}; ask for a smaller target")


# ------------------------------------------------------------------------------------------- weights
class _Weights:
    """Builds the inflated tensors in float32 on the CPU from one seeded generator (the same model on any device),
    each cast to the model's dtype and device as soon as it is made."""

    def __init__(self, seed: int, std: float, dtype: torch.dtype, device: torch.device):
        self.generator = torch.Generator().manual_seed(seed)
        self.std, self.dtype, self.device = std, dtype, device

    def random(self, *shape: int) -> Tensor:
        return torch.empty(shape).normal_(0.0, self.std, generator=self.generator)

    def out(self, tensor: Tensor) -> Tensor:
        return tensor.to(device=self.device, dtype=self.dtype)

    def padded(self, source: Tensor, shape: tuple[int, ...], fill: str, scale: float = 1.0) -> Tensor:
        """``source`` (times ``scale``) in the leading corner of a ``shape`` tensor; the rest ``"zero"``, ``"one"``
        or ``"random"``."""
        if fill == "random":
            new = self.random(*shape)
        else:
            new = (torch.zeros if fill == "zero" else torch.ones)(shape)
        new[tuple(slice(0, n) for n in source.shape)] = source.detach().to("cpu", torch.float32) * scale
        return new

    def linear_in(self, source: Tensor, rows: int, cols: int, scale: float = 1.0) -> Tensor:
        """A linear map reading the residual stream: the source block (input columns times ``scale``), random
        elsewhere (its extra rows are extra outputs; its padded columns read zeros)."""
        return self.padded(source, (rows, cols), "random", scale)


def _qkv_parts(weight: Tensor, n_head: int, n_kv: int, head_dim: int) -> list[Tensor]:
    return list(weight.split([n_head * head_dim, n_kv * head_dim, n_kv * head_dim], dim=0))


def llamagen_state_dict(model: LlamaGenGPT, plan: InflationPlan, seed: int) -> dict[str, Tensor]:
    """Every parameter and buffer of the inflated model (module docstring), in ``model``'s dtype and device."""
    cfg = model.config
    src = {k: v for k, v in model.state_dict().items()}
    make = _Weights(seed, float(cfg.initializer_range), model.dtype, model.device)
    dn, hd = plan.dim, plan.head_dim
    h, hn, kv, kvn = plan.source.n_head, plan.n_head, plan.source.n_kv_head, plan.n_kv_head
    fn = plan.ffn_hidden
    scale = plan.norm_scale
    out: dict[str, Tensor] = {}

    def put(name: str, tensor: Tensor) -> None:
        out[name] = make.out(tensor)

    put("tok_embeddings.weight", make.padded(src["tok_embeddings.weight"], (cfg.vocab_size, dn), "zero"))
    if cfg.model_type == "c2i":
        table = src["cls_embedding.embedding_table.weight"]
        put("cls_embedding.embedding_table.weight", make.padded(table, (table.shape[0], dn), "zero"))
    else:
        fc1 = src["cls_embedding.cap_proj.fc1.weight"]
        put("cls_embedding.cap_proj.fc1.weight", make.padded(fc1, (dn, fc1.shape[1]), "random"))
        put("cls_embedding.cap_proj.fc2.weight", make.padded(src["cls_embedding.cap_proj.fc2.weight"], (dn, dn), "zero"))
        put("cls_embedding.uncond_embedding", src["cls_embedding.uncond_embedding"].detach().to("cpu", torch.float32))
    source_at = {slot: i for i, slot in enumerate(plan.layer_slots)}
    for layer in range(plan.n_layer):
        new = f"layers.{layer}."
        if layer not in source_at:  # an identity layer: computed, adds exactly zero
            put(new + "attention.wqkv.weight", make.random((hn + 2 * kvn) * hd, dn))
            put(new + "attention.wo.weight", torch.zeros(dn, hn * hd))
            put(new + "feed_forward.w1.weight", make.random(fn, dn))
            put(new + "feed_forward.w3.weight", make.random(fn, dn))
            put(new + "feed_forward.w2.weight", torch.zeros(dn, fn))
            put(new + "attention_norm.weight", torch.ones(dn))
            put(new + "ffn_norm.weight", torch.ones(dn))
            continue
        old = f"layers.{source_at[layer]}."
        q, k, v = _qkv_parts(src[old + "attention.wqkv.weight"], h, kv, hd)
        parts = [make.linear_in(part, heads * hd, dn, scale) for part, heads in ((q, hn), (k, kvn), (v, kvn))]
        put(new + "attention.wqkv.weight", torch.cat(parts))
        put(new + "attention.wo.weight", make.padded(src[old + "attention.wo.weight"], (dn, hn * hd), "zero"))
        put(new + "feed_forward.w1.weight", make.linear_in(src[old + "feed_forward.w1.weight"], fn, dn, scale))
        put(new + "feed_forward.w3.weight", make.linear_in(src[old + "feed_forward.w3.weight"], fn, dn, scale))
        put(new + "feed_forward.w2.weight", make.padded(src[old + "feed_forward.w2.weight"], (dn, fn), "zero"))
        for norm in ("attention_norm.weight", "ffn_norm.weight"):
            put(new + norm, make.padded(src[old + norm], (dn,), "one"))
    put("norm.weight", make.padded(src["norm.weight"], (dn,), "one"))
    put("output.weight", make.linear_in(src["output.weight"], cfg.vocab_size, dn, scale))
    return out


def _chameleon_class() -> Optional[type]:
    try:
        from transformers import ChameleonForConditionalGeneration
    except ImportError:  # a transformers without Chameleon: nothing to inflate there
        return None
    return ChameleonForConditionalGeneration


def chameleon_state_dict(model: Any, plan: InflationPlan, seed: int) -> dict[str, Tensor]:
    """Every persistent tensor of the inflated ``ChameleonForConditionalGeneration`` (module docstring's Chameleon
    notes); the VQ model inside it is copied."""
    cfg = model.config
    src = model.state_dict()
    make = _Weights(seed, float(cfg.initializer_range), model.dtype, model.device)
    dn, hd, hn, kvn, fn = plan.dim, plan.head_dim, plan.n_head, plan.n_kv_head, plan.ffn_hidden
    swin = plan.source.swin_norm
    out: dict[str, Tensor] = {k: v.detach().clone() for k, v in src.items() if k.startswith("model.vqmodel.")}

    def put(name: str, tensor: Tensor) -> None:
        out[name] = make.out(tensor)

    put("model.embed_tokens.weight", make.padded(src["model.embed_tokens.weight"], (cfg.vocab_size, dn), "zero"))
    source_at = {slot: i for i, slot in enumerate(plan.layer_slots)}
    # the projections read the residual stream through input_layernorm / post_attention_layernorm (fold the norm
    # scale into them), or, with swin_norm, directly (those norms then sit on the sublayer outputs: scale their weight)
    fold = 1.0 if swin else plan.norm_scale
    shapes = {"q_proj": (hn * hd, dn), "k_proj": (kvn * hd, dn), "v_proj": (kvn * hd, dn), "o_proj": (dn, hn * hd),
              "gate_proj": (fn, dn), "up_proj": (fn, dn), "down_proj": (dn, fn)}
    writes_residual = ("o_proj", "down_proj")
    for layer in range(plan.n_layer):
        new = f"model.layers.{layer}."
        old = f"model.layers.{source_at[layer]}." if layer in source_at else None
        for part in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                     "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"):
            kind = part.split(".")[1]
            rows, cols = shapes[kind]
            biased = cfg.attention_bias if part.startswith("self_attn") else cfg.mlp_bias
            for leaf in ("weight", "bias") if biased else ("weight",):
                key = f"{part}.{leaf}"
                shape = (rows, cols) if leaf == "weight" else (rows,)
                if old is None:  # an identity layer: its sublayer outputs are zero
                    put(new + key, torch.zeros(shape) if kind in writes_residual else make.random(*shape))
                elif kind in writes_residual:
                    put(new + key, make.padded(src[old + key], shape, "zero"))
                elif leaf == "weight":
                    put(new + key, make.linear_in(src[old + key], rows, cols, fold))
                else:
                    put(new + key, make.padded(src[old + key], shape, "random"))
        for norm, heads in (("self_attn.q_norm", hn), ("self_attn.k_norm", kvn)):  # LayerNorm per head over hd
            for leaf, fill in (("weight", "one"), ("bias", "zero")):
                key = f"{norm}.{leaf}"
                base = torch.empty(0, hd) if old is None else src[old + key]
                put(new + key, make.padded(base, (heads, hd), fill))
        for norm in ("input_layernorm.weight", "post_attention_layernorm.weight"):
            base = torch.empty(0) if old is None else src[old + norm]
            put(new + norm, make.padded(base, (dn,), "one", plan.norm_scale if swin else 1.0))
    put("model.norm.weight", make.padded(src["model.norm.weight"], (dn,), "one"))
    put("lm_head.weight", make.linear_in(src["lm_head.weight"], cfg.vocab_size, dn, plan.norm_scale))
    return out


def _inflate_chameleon(model: Any, plan: InflationPlan, seed: int) -> Any:
    config = copy.deepcopy(model.config)
    for key, value in (("hidden_size", plan.dim), ("num_hidden_layers", plan.n_layer), ("num_attention_heads", plan.n_head),
                       ("num_key_value_heads", plan.n_kv_head), ("intermediate_size", plan.ffn_hidden),
                       ("rms_norm_eps", plan.norm_eps)):
        setattr(config, key, value)
    state = chameleon_state_dict(model, plan, seed)
    with torch.random.fork_rng(devices=[]):
        new = build_on_meta(type(model), config)
    new.load_state_dict(state, strict=True, assign=True)
    return new


def _inflate_llamagen(model: LlamaGenGPT, plan: InflationPlan, seed: int) -> LlamaGenGPT:
    state = llamagen_state_dict(model, plan, seed)
    # public keys only: diffusers' `_use_default_values` would reset the overridden ones to the class defaults
    config = {k: v for k, v in model.config.items() if not k.startswith("_")}
    with torch.random.fork_rng(devices=[]):  # the global RNG is not consumed
        new = build_on_meta(LlamaGenGPT, {**config, **plan.config_overrides()})
    new.load_state_dict(state, strict=True, assign=True)
    new.freqs_cis = model.freqs_cis.clone()  # same head size, grid and condition tokens: the same table
    return new


def inflate(model: Any, target: Union[str, Mapping[str, int]], seed: int = 0) -> Any:
    """A bigger model computing the same logits as ``model`` (module docstring).

    Args:
        model: a :class:`LlamaGenGPT` (c2i or t2i) or a transformers ``ChameleonForConditionalGeneration`` (the
            unified adapter's Chameleon family), with its weights on a device (not offloaded to ``meta``).
        target: a name from :data:`~vispec.models.llamagen_gpt.GPT_CONFIGS` (``"GPT-B"``, ``"GPT-L"``, ``"GPT-XL"``,
            ...; SwiGLU width as LlamaGen's, ``multiple_of=256``) or a dict with keys from :data:`TARGET_KEYS`
            (``dim``, ``n_layer``, ``n_head``, ``ffn_hidden``; missing ``dim`` / ``n_layer``: the source's, missing
            ``ffn_hidden``: the source config's SwiGLU rule at the new width, Chameleon: its width ratio). Heads keep
            the source's size; the target's ``n_head`` then only names the nominal head count (:class:`InflationPlan`).
        seed: the generator of the extra weights (a CPU ``torch.Generator``: the same model on every device).

    Returns a new model of ``model``'s class (``model`` is not changed) on its device and dtype, in its train/eval
    mode, with ``inflation`` set to the :class:`InflationPlan`. Raises :class:`InflationError` (a ``ValueError``)
    before building anything for another kind of model, an unknown or smaller target, a bad seed, or a target whose
    weights (:func:`parameter_count` at the model's dtype) would not fit the memory available on the model's device
    (:func:`check_inflation_memory`; the error names the target and both sizes in GiB).
    """
    chameleon = _chameleon_class()
    if not isinstance(model, LlamaGenGPT) and not (chameleon is not None and isinstance(model, chameleon)):
        raise InflationError("model must be a LlamaGenGPT (vispec.models.llamagen_gpt) or a transformers "
                             f"ChameleonForConditionalGeneration, got {type(model).__name__}")
    check_int("seed", seed, minimum=0, maximum=2**63 - 1)
    if any(p.device.type == "meta" for p in model.parameters()):
        raise InflationError("model has weights on the meta device (offloaded): inflate it before enabling offload")
    plan = plan_inflation(model.config, target)
    what = f"target {target!r}" if isinstance(target, str) else f"target {dict(target)}"
    copied = sum(v.numel() for k, v in model.state_dict().items() if k.startswith("model.vqmodel."))  # Chameleon's VQ
    check_inflation_memory(what, plan, parameter_count(model.config, plan) + copied, model.dtype, model.device)
    new = _inflate_llamagen(model, plan, seed) if isinstance(model, LlamaGenGPT) else _inflate_chameleon(model, plan, seed)
    new.train(model.training)
    new.requires_grad_(any(p.requires_grad for p in model.parameters()))
    new.inflation = plan
    return new


def inflation_note(source_name: str, plan: InflationPlan) -> str:
    """What a benchmark table says about an inflated model, e.g. ``tiny-c2i's logits at GPT-L cost (...)``."""
    return f"{source_name}'s logits at {plan.target} cost ({plan.describe()})"
