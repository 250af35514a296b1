"""SBER-MoVQGAN (Lumina-mGPT 2.0's image tokenizer) as a diffusers :class:`~diffusers.VQModel`.

Lumina-mGPT 2.0 (Alpha-VLLM/Lumina-mGPT-2.0, ``lumina_mgpt/movqgan``, a copy of ai-forever/MoVQGAN whose
``modules/vqvae/*.py`` are byte-identical to the original) tokenizes images with the 270M MoVQGAN
(``movqgan/__init__.py`` ``MODELS["270M"]``: ``ch=256, ch_mult=[1, 2, 2, 4], num_res_blocks=2,
attn_resolutions=[32], resolution=256, z_channels=4, embed_dim=4, n_embed=16384``; downsample 8).

**It fits diffusers' MoVQ configuration** (``VQModel(norm_type="spatial")``, the Kandinsky 2.2 "movq")
exactly; only names change. Checked against ``movqgan/models/vqgan.py`` (``MOVQ``),
``modules/vqvae/vqvae_blocks.py`` (``Encoder``), ``modules/vqvae/movq_modules.py`` (``MOVQDecoder``,
``SpatialNorm``) and ``modules/vqvae/quantize.py`` (``VectorQuantizer2``) versus diffusers 0.42.1
``vq_model.py``/``vae.py``/``attention_processor.SpatialNorm`` (and the MoVQ key table in diffusers'
``scripts/convert_kandinsky_to_diffusers.py``):

* encoder: the taming encoder with plain GroupNorm(32, eps 1e-6), ``double_z=False``; attention after every
  res block of a level whose resolution is in ``attn_resolutions`` (for 270M only the lowest level, 32 px
  of 256) and in the mid block: ``DownEncoderBlock2D`` x3 + ``AttnDownEncoderBlock2D``; the stride-2 conv
  with (0, 1, 0, 1) zero padding is ``Downsample2D(padding=0)``;
* decoder: every norm is ``SpatialNorm(f, zq) = GroupNorm(f) * conv_y(zq) + conv_b(zq)`` with ``zq`` the
  *quantized* latent resized by nearest interpolation (``add_conv=False``: the MOVQ class never sets it);
  ``num_res_blocks + 1`` res blocks per level, attention at the same levels: ``AttnUpDecoderBlock2D`` +
  ``UpDecoderBlock2D`` x3 with ``norm_type="spatial"``. diffusers feeds the SpatialNorms ``latent_channels``
  (``z_channels``) wide codes while MoVQGAN's are ``embed_dim`` wide: both are 4, so the fit needs
  ``z_channels == embed_dim`` (checked);
* ``quant_conv``/``post_quant_conv`` are 1x1 convs; ``MOVQ.decode(quant)`` is
  ``decoder(post_quant_conv(quant), quant)``, which is ``VQModel.decode`` with ``norm_type="spatial"``;
* the quantizer is a plain (un-normalised) Euclidean codebook ``nn.Embedding(n_embed, embed_dim)``; the
  official ``decode_code`` is an embedding lookup, ``VQModel.decode(ids, force_not_quantize=True,
  shape=...)`` with ``lookup_from_codebook=True`` (which also lifts the official batch-size-1 limit).

==========================================================  ================================================
official key (``movqgan_270M.ckpt``)                         diffusers ``VQModel`` key
==========================================================  ================================================
``encoder.down.i.block.k.*`` (``nin_shortcut``)              ``encoder.down_blocks.i.resnets.k.*`` (``conv_shortcut``)
``encoder.down.i.attn.k.{norm,q,k,v,proj_out}``             ``encoder.down_blocks.i.attentions.k.{group_norm,to_q,to_k,to_v,to_out.0}``
  (1x1-conv weights ``[c, c, 1, 1]``)                         (Linear weights ``[c, c]``, squeezed)
``encoder.down.i.downsample.conv``                           ``encoder.down_blocks.i.downsamplers.0.conv``
``{enc,dec}oder.mid.block_1`` / ``attn_1`` / ``block_2``     ``mid_block.resnets.0`` / ``attentions.0`` / ``resnets.1``
``{enc,dec}oder.norm_out``                                   ``conv_norm_out``
``decoder.up.j.*`` (``j = 0`` is the full-resolution level)  ``decoder.up_blocks.{L-1-j}.*`` (lowest resolution first)
``decoder.up.j.upsample.conv``                               ``decoder.up_blocks.{L-1-j}.upsamplers.0.conv``
decoder ``norm1/norm2.{norm_layer,conv_y,conv_b}``            same names
decoder ``attn.k.norm.{norm_layer,conv_y,conv_b}``            ``attentions.k.spatial_norm.{norm_layer,conv_y,conv_b}``
``conv_in``, ``conv_out``, ``conv1``, ``conv2``, ``quant_conv``, ``post_quant_conv``, ``quantize.embedding``: unchanged
``loss.*`` (discriminator, LPIPS), ``ema_*`` (``LitEma`` shadows)   dropped: training state the official loader
                                                                   ignores (``load_state_dict(strict=False)``)
==========================================================  ================================================

Checkpoint files: the official ``get_movqgan_model`` does ``model.load_state_dict(torch.load(ckpt),
strict=False)``, so the released ``movqgan_270M.ckpt`` must hold the state dict raw (a nested one would load
nothing; inferred from the code, the file itself was not available); a Lightning training checkpoint nests
it under ``"state_dict"`` (``MOVQ.init_from_ckpt``). Both load here, through
:func:`vispec.models.checkpoints.read_checkpoint` (pickled objects are refused unless ``trust_pickle=True``).
Before renaming, the weights are checked against the official layout the config implies
(:func:`movqgan_official_shapes`), so missing, unexpected and mis-shaped keys are reported with the file's
own names. Images are in ``[-1, 1]``; decoded images are not clamped (Lumina's ``show_images`` clamps,
see :func:`movqgan_to_uint8`).
"""

from __future__ import annotations

import os
import re
import types
from collections.abc import Mapping
from typing import Any, Optional

import torch
from diffusers import VQModel

from vispec.models.checkpoints import check_state_dict, read_checkpoint
from vispec.models.llamagen_vq import decode_tokens, encode_to_tokens

__all__ = [
    "MOVQGAN_VARIANTS",
    "movqgan_config",
    "movqgan_official_shapes",
    "infer_movqgan_ddconfig",
    "convert_movqgan_state_dict",
    "drop_training_keys",
    "load_movqgan",
    "movqgan_decode",
    "movqgan_encode",
    "movqgan_to_uint8",
]

# ``ddconfig`` + codebook of the released models (ai-forever/MoVQGAN ``movqgan/__init__.py`` ``MODELS``; the
# same table is in Lumina-mGPT-2.0 ``lumina_mgpt/movqgan/__init__.py``). All: resolution 256, 3 -> 3 channels.
MOVQGAN_VARIANTS: dict[str, dict[str, Any]] = {
    "67M": {"ch": 128, "ch_mult": (1, 2, 2, 4), "num_res_blocks": 2, "attn_resolutions": (32,)},
    "102M": {"ch": 128, "ch_mult": (1, 2, 2, 4), "num_res_blocks": 4, "attn_resolutions": (32,)},
    "270M": {"ch": 256, "ch_mult": (1, 2, 2, 4), "num_res_blocks": 2, "attn_resolutions": (32,)},
}
_DEFAULTS: dict[str, Any] = {
    **MOVQGAN_VARIANTS["270M"], "resolution": 256, "in_channels": 3, "out_ch": 3, "z_channels": 4,
    "embed_dim": 4, "n_embed": 16384, "double_z": False,
}
_GROUPS = 32  # GroupNorm groups: official ``Normalize`` and diffusers' ``SpatialNorm`` both hard-code 32
_TRAINING_PREFIXES = ("loss.", "ema_")


# --------------------------------------------------------------------------------------------- config
def _ddconfig(**overrides: Any) -> dict[str, Any]:
    unknown = sorted(set(overrides) - set(_DEFAULTS))
    if unknown:
        raise ValueError(f"unknown MoVQGAN config field(s) {unknown}; expected some of {sorted(_DEFAULTS)}")
    dd = {**_DEFAULTS, **overrides}
    dd["ch_mult"] = tuple(int(m) for m in dd["ch_mult"])
    dd["attn_resolutions"] = tuple(int(r) for r in dd["attn_resolutions"])
    if not dd["ch_mult"]:
        raise ValueError("ch_mult must name at least one level; got ()")
    if dd["double_z"]:
        raise ValueError("double_z=True is not a MoVQGAN configuration (the quantizer takes z_channels): "
                         "use double_z=False")
    if dd["z_channels"] != dd["embed_dim"]:
        raise ValueError(
            f"z_channels ({dd['z_channels']}) must equal embed_dim ({dd['embed_dim']}): diffusers' spatial norms take "
            "latent_channels-wide codes, MoVQGAN's take embed_dim-wide ones (both 4 in the released models)")
    widths = [dd["ch"] * m for m in dd["ch_mult"]]
    if any(w % _GROUPS for w in widths):
        raise ValueError(f"every level width ch * ch_mult must be a multiple of {_GROUPS} (GroupNorm groups); "
                         f"got {widths}")
    return dd


def _attention_levels(dd: Mapping[str, Any]) -> list[bool]:
    """Whether level ``i`` (resolution ``resolution / 2**i``) has attention blocks (encoder and decoder alike)."""
    return [dd["resolution"] // 2**i in dd["attn_resolutions"] for i in range(len(dd["ch_mult"]))]


def movqgan_config(**ddconfig: Any) -> dict[str, Any]:
    """Keyword arguments of the diffusers ``VQModel`` that holds a MoVQGAN; the 270M model by default.

    Arguments are the official ``ddconfig`` fields plus the codebook (``ch``, ``ch_mult``, ``num_res_blocks``,
    ``attn_resolutions``, ``resolution``, ``in_channels``, ``out_ch``, ``z_channels``, ``embed_dim``,
    ``n_embed``); e.g. ``movqgan_config(ch=32, num_res_blocks=1, n_embed=64)`` for a tiny test model.
    """
    dd = _ddconfig(**ddconfig)
    attn = _attention_levels(dd)
    levels = len(dd["ch_mult"])
    return {
        "in_channels": dd["in_channels"],
        "out_channels": dd["out_ch"],
        "down_block_types": tuple("AttnDownEncoderBlock2D" if a else "DownEncoderBlock2D" for a in attn),
        "up_block_types": tuple("AttnUpDecoderBlock2D" if attn[i] else "UpDecoderBlock2D"
                                for i in reversed(range(levels))),
        "block_out_channels": tuple(dd["ch"] * m for m in dd["ch_mult"]),
        "layers_per_block": dd["num_res_blocks"],
        "act_fn": "silu",
        "latent_channels": dd["z_channels"],
        "sample_size": dd["resolution"],
        "num_vq_embeddings": dd["n_embed"],
        "norm_num_groups": _GROUPS,
        "vq_embed_dim": dd["embed_dim"],
        "scaling_factor": 1.0,
        "norm_type": "spatial",
        "mid_block_add_attention": True,
        "lookup_from_codebook": True,
        "force_upcast": False,
    }


# ------------------------------------------------------------------------------------ official layout
def _resnet(prefix: str, cin: int, cout: int, zq: Optional[int]) -> dict[str, tuple[int, ...]]:
    shapes = {}
    for norm, width in (("norm1", cin), ("norm2", cout)):
        shapes.update(_norm(f"{prefix}.{norm}", width, zq))
    shapes.update(_conv(f"{prefix}.conv1", cout, cin, 3))
    shapes.update(_conv(f"{prefix}.conv2", cout, cout, 3))
    if cin != cout:
        shapes.update(_conv(f"{prefix}.nin_shortcut", cout, cin, 1))
    return shapes


def _attn(prefix: str, width: int, zq: Optional[int]) -> dict[str, tuple[int, ...]]:
    shapes = _norm(f"{prefix}.norm", width, zq)
    for name in ("q", "k", "v", "proj_out"):
        shapes.update(_conv(f"{prefix}.{name}", width, width, 1))
    return shapes


def _norm(prefix: str, width: int, zq: Optional[int]) -> dict[str, tuple[int, ...]]:
    if zq is None:  # encoder: GroupNorm
        return {f"{prefix}.weight": (width,), f"{prefix}.bias": (width,)}
    return {f"{prefix}.norm_layer.weight": (width,), f"{prefix}.norm_layer.bias": (width,),
            **_conv(f"{prefix}.conv_y", width, zq, 1), **_conv(f"{prefix}.conv_b", width, zq, 1)}


def _conv(prefix: str, cout: int, cin: int, k: int) -> dict[str, tuple[int, ...]]:
    return {f"{prefix}.weight": (cout, cin, k, k), f"{prefix}.bias": (cout,)}


def movqgan_official_shapes(**ddconfig: Any) -> dict[str, tuple[int, ...]]:
    """Every key of an official MoVQGAN state dict (``MOVQ(ddconfig, n_embed, embed_dim)`` without loss or
    EMA) with its shape; same arguments as :func:`movqgan_config`."""
    dd = _ddconfig(**ddconfig)
    ch, mult, blocks, zq = dd["ch"], dd["ch_mult"], dd["num_res_blocks"], dd["embed_dim"]
    attn, levels = _attention_levels(dd), len(mult)
    shapes = _conv("encoder.conv_in", ch, dd["in_channels"], 3)
    width = ch
    for i in range(levels):
        for k in range(blocks):
            shapes.update(_resnet(f"encoder.down.{i}.block.{k}", width, ch * mult[i], None))
            width = ch * mult[i]
            if attn[i]:
                shapes.update(_attn(f"encoder.down.{i}.attn.{k}", width, None))
        if i != levels - 1:
            shapes.update(_conv(f"encoder.down.{i}.downsample.conv", width, width, 3))
    for side, norm in (("encoder", None), ("decoder", zq)):
        width = ch * mult[-1]
        shapes.update(_resnet(f"{side}.mid.block_1", width, width, norm))
        shapes.update(_attn(f"{side}.mid.attn_1", width, norm))
        shapes.update(_resnet(f"{side}.mid.block_2", width, width, norm))
    shapes.update(_norm("encoder.norm_out", width, None))
    shapes.update(_conv("encoder.conv_out", dd["z_channels"], width, 3))
    shapes.update(_conv("decoder.conv_in", width, dd["z_channels"], 3))
    for i in reversed(range(levels)):
        for k in range(blocks + 1):
            shapes.update(_resnet(f"decoder.up.{i}.block.{k}", width, ch * mult[i], zq))
            width = ch * mult[i]
            if attn[i]:
                shapes.update(_attn(f"decoder.up.{i}.attn.{k}", width, zq))
        if i != 0:
            shapes.update(_conv(f"decoder.up.{i}.upsample.conv", width, width, 3))
    shapes.update(_norm("decoder.norm_out", width, zq))
    shapes.update(_conv("decoder.conv_out", dd["out_ch"], width, 3))
    shapes["quantize.embedding.weight"] = (dd["n_embed"], dd["embed_dim"])
    shapes.update(_conv("quant_conv", dd["embed_dim"], dd["z_channels"], 1))
    shapes.update(_conv("post_quant_conv", dd["z_channels"], dd["embed_dim"], 1))
    return shapes


def _indices(state_dict: Mapping[str, torch.Tensor], pattern: str) -> list[int]:
    found = {int(m.group(1)) for key in state_dict if (m := re.match(pattern, key))}
    return sorted(found)


def infer_movqgan_ddconfig(state_dict: Mapping[str, torch.Tensor], resolution: int = 256) -> dict[str, Any]:
    """The ``ddconfig`` + codebook fields an official state dict implies, read from its shapes.

    ``attn_resolutions`` is expressed at the nominal ``resolution`` (256 for the released models): a level
    ``i`` with ``encoder.down.i.attn.*`` keys contributes ``resolution / 2**i``.
    """
    def shape(key: str) -> tuple[int, ...]:
        if key not in state_dict:
            raise ValueError(f"not an official MoVQGAN state dict: key {key!r} is missing (needed to infer the config)")
        return tuple(state_dict[key].shape)

    ch, in_channels = shape("encoder.conv_in.weight")[:2]
    levels = _indices(state_dict, r"encoder\.down\.(\d+)\.")
    if levels != list(range(len(levels))) or not levels:
        raise ValueError(f"not an official MoVQGAN state dict: encoder levels encoder.down.<i> are {levels}")
    mult = tuple(shape(f"encoder.down.{i}.block.0.conv1.weight")[0] // ch for i in levels)
    blocks = _indices(state_dict, r"encoder\.down\.0\.block\.(\d+)\.")
    n_embed, embed_dim = shape("quantize.embedding.weight")
    return {
        "ch": ch, "ch_mult": mult, "num_res_blocks": len(blocks), "resolution": resolution,
        "attn_resolutions": tuple(resolution // 2**i for i in levels
                                  if any(k.startswith(f"encoder.down.{i}.attn.") for k in state_dict)),
        "in_channels": in_channels, "out_ch": shape("decoder.conv_out.weight")[0],
        "z_channels": shape("decoder.conv_in.weight")[1], "embed_dim": embed_dim, "n_embed": n_embed,
    }


# ------------------------------------------------------------------------------------------ converter
_PARAM = r"(weight|bias)"
_RESNET_NAMES = {"norm1": "norm1", "conv1": "conv1", "norm2": "norm2", "conv2": "conv2",
                 "nin_shortcut": "conv_shortcut"}
_ATTN_NAMES = {"q": "to_q", "k": "to_k", "v": "to_v", "proj_out": "to_out.0"}
_SPATIAL = r"(?:norm_layer|conv_y|conv_b)\." + _PARAM
_LEVEL_BLOCK = re.compile(r"(down|up)\.(\d+)\.(block|attn)\.(\d+)\.(.+)")
_LEVEL_SAMPLER = re.compile(r"(down|up)\.(\d+)\.(downsample|upsample)\.conv\." + _PARAM)


def _rename_resnet(rest: str, spatial: bool) -> Optional[str]:
    """``norm1.weight`` / ``norm1.norm_layer.weight`` / ``nin_shortcut.bias`` ... -> diffusers resnet names."""
    norm = _SPATIAL if spatial else _PARAM
    m = re.fullmatch(r"(norm1|norm2)\." + norm + r"|(conv1|conv2|nin_shortcut)\." + _PARAM, rest)
    if m is None:
        return None
    name = m.group(1) or m.group(3)
    return _RESNET_NAMES[name] + rest[len(name):]


def _rename_attn(rest: str, spatial: bool) -> Optional[str]:
    """``norm.*`` -> ``group_norm.*`` (encoder) or ``spatial_norm.*`` (decoder); ``q`` -> ``to_q`` ..."""
    if (m := re.fullmatch(r"norm\." + (_SPATIAL if spatial else _PARAM), rest)) is not None:
        return ("spatial_norm" if spatial else "group_norm") + rest[len("norm"):]
    if (m := re.fullmatch(r"(q|k|v|proj_out)\." + _PARAM, rest)) is not None:
        return f"{_ATTN_NAMES[m.group(1)]}.{m.group(2)}"
    return None


def _rename_key(key: str, levels: int) -> Optional[str]:
    """The diffusers name of an official key (``levels``: decoder levels); None when it cannot be mapped."""
    if key == "quantize.embedding.weight" or re.fullmatch(r"(quant_conv|post_quant_conv)\." + _PARAM, key):
        return key
    side, _, rest = key.partition(".")
    if side not in ("encoder", "decoder"):
        return None
    spatial = side == "decoder"
    if re.fullmatch(r"(conv_in|conv_out)\." + _PARAM, rest):
        return key
    if rest.startswith("norm_out."):
        norm = rest[len("norm_out."):]
        return f"{side}.conv_norm_out.{norm}" if re.fullmatch(_SPATIAL if spatial else _PARAM, norm) else None
    if (m := re.fullmatch(r"mid\.(block_1|block_2|attn_1)\.(.+)", rest)) is not None:
        if m.group(1) == "attn_1":
            new = _rename_attn(m.group(2), spatial)
            return None if new is None else f"{side}.mid_block.attentions.0.{new}"
        new = _rename_resnet(m.group(2), spatial)
        return None if new is None else f"{side}.mid_block.resnets.{int(m.group(1)[-1]) - 1}.{new}"
    blocks, kind = ("down_blocks", "down") if side == "encoder" else ("up_blocks", "up")
    if (m := _LEVEL_SAMPLER.fullmatch(rest)) is not None:
        level, sampler, param = int(m.group(2)), m.group(3), m.group(4)
        if m.group(1) != kind or (sampler == "downsample") != (side == "encoder") or (spatial and level >= levels):
            return None
        return f"{side}.{blocks}.{_level_index(side, level, levels)}.{sampler}rs.0.conv.{param}"
    if (m := _LEVEL_BLOCK.fullmatch(rest)) is None or m.group(1) != kind or (spatial and int(m.group(2)) >= levels):
        return None
    resnet = m.group(3) == "block"
    new = _rename_resnet(m.group(5), spatial) if resnet else _rename_attn(m.group(5), spatial)
    index = _level_index(side, int(m.group(2)), levels)
    return None if new is None else f"{side}.{blocks}.{index}.{'resnets' if resnet else 'attentions'}.{m.group(4)}.{new}"


def _level_index(side: str, level: int, levels: int) -> int:
    """diffusers' block index of an official level: official decoder levels list full resolution first."""
    return level if side == "encoder" else levels - 1 - level


_ATTN_LINEAR = re.compile(r"\.attentions\.\d+\.(to_q|to_k|to_v|to_out\.0)\.weight$")


def drop_training_keys(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state_dict`` without the ``loss.*`` and ``ema_*`` entries a training checkpoint may carry."""
    return {k: v for k, v in state_dict.items() if not k.startswith(_TRAINING_PREFIXES)}


def convert_movqgan_state_dict(official: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename an official MoVQGAN state dict to diffusers ``VQModel`` keys (table in the module docstring).

    Attention 1x1-conv weights become Linear weights; ``loss.*``/``ema_*`` training entries are dropped.
    Raises ``ValueError`` listing every key that has no diffusers counterpart (e.g. the extra ``conv`` of
    a ``SpatialNorm(add_conv=True)``, or a ``quantize.used`` remap table, which diffusers cannot hold).
    """
    official = drop_training_keys(official)
    levels = len(_indices(official, r"decoder\.up\.(\d+)\."))
    converted: dict[str, torch.Tensor] = {}
    unknown: list[str] = []
    for key, value in official.items():
        new = _rename_key(key, levels)
        if new is None:
            unknown.append(key)
            continue
        if _ATTN_LINEAR.search(new) is not None and value.ndim == 4:
            value = value.reshape(value.shape[0], value.shape[1])
        converted[new] = value
    if unknown:
        raise ValueError(f"cannot map {len(unknown)} MoVQGAN key(s) to diffusers VQModel names: {sorted(unknown)[:20]}")
    return converted


# ---------------------------------------------------------------------------------------- checkpoints
def load_movqgan(path: str | os.PathLike, trust_pickle: bool = False, *, variant: Optional[str] = None,
                 **ddconfig: Any) -> VQModel:
    """A ``VQModel`` (eval mode, float32, CPU) from an official MoVQGAN checkpoint (``movqgan_270M.ckpt``).

    The config is read off the weights' shapes (:func:`infer_movqgan_ddconfig`), or taken from ``variant``
    (``"67M"``, ``"102M"``, ``"270M"``); ``ddconfig`` fields override either. The weights are checked against
    the official layout that config implies before renaming: a ``ValueError`` lists missing, unexpected and
    mis-shaped keys by their names in the file. ``trust_pickle=True`` lets files that pickle objects besides
    tensors load (it runs the pickle: only for files you trust).
    """
    source = os.fspath(path)
    raw = drop_training_keys(read_checkpoint(source, trust_pickle=trust_pickle)[0])
    if variant is not None:
        if variant not in MOVQGAN_VARIANTS:
            raise ValueError(f"variant must be one of {sorted(MOVQGAN_VARIANTS)} or None; got {variant!r}")
        dd = {**_DEFAULTS, **MOVQGAN_VARIANTS[variant], **ddconfig}
    else:
        dd = {**infer_movqgan_ddconfig(raw, int(ddconfig.get("resolution", 256))), **ddconfig}
    expected = {k: torch.empty(s, device="meta") for k, s in movqgan_official_shapes(**dd).items()}
    layout = types.SimpleNamespace(state_dict=lambda: expected)  # check_state_dict reads only .state_dict()
    check_state_dict(layout, raw, source, f"the official MoVQGAN layout (ch={dd['ch']}, ch_mult={list(dd['ch_mult'])}, "
                                           f"num_res_blocks={dd['num_res_blocks']}, n_embed={dd['n_embed']})")
    state_dict = convert_movqgan_state_dict(raw)
    model = VQModel(**movqgan_config(**dd))
    check_state_dict(model, state_dict, source, "the diffusers VQModel")
    model.load_state_dict(state_dict, strict=True)
    return model.eval()


# ------------------------------------------------------------------------------------- token helpers
def movqgan_decode(vq: VQModel, codes: torch.Tensor) -> torch.Tensor:
    """Codes ``LongTensor[B, h, w]`` in ``[0, n_embed)`` -> images ``float[B, 3, 8h, 8w]`` in ``[-1, 1]`` (not clamped).

    Lumina-mGPT 2.0's ``MOVQ.decode_code``: codebook lookup, ``post_quant_conv``, decoder conditioned on the
    looked-up codes (here for any batch size; the factor is ``2**(levels - 1)``, 8 for the released models).
    Image token ``t`` of Lumina-mGPT 2.0 is code ``t - 155000`` (row ends removed).
    """
    return decode_tokens(vq, codes)


def movqgan_encode(vq: VQModel, images: torch.Tensor) -> torch.Tensor:
    """Images ``[B, 3, H, W]`` in ``[-1, 1]`` -> codes ``LongTensor[B, H/8, W/8]`` (official ``MOVQ.encode`` indices:
    nearest codebook entry in Euclidean distance)."""
    return encode_to_tokens(vq, images)


def movqgan_to_uint8(images: torch.Tensor) -> torch.Tensor:
    """Images in ``[-1, 1]`` -> ``uint8`` as Lumina-mGPT 2.0 does (``inference_solver.py`` ``show_images``:
    ``((x + 1) * 127.5).round().clamp(0, 255)``), same layout."""
    return ((images.float() + 1) * 127.5).round().clamp(0, 255).to(torch.uint8)

