"""LlamaGen VQ image tokenizer as a diffusers :class:`~diffusers.VQModel`.

LlamaGen (FoundationVision/LlamaGen, ``tokenizer/tokenizer_image/vq_model.py``) uses the
taming/LDM encoder-decoder with a cosine (L2-normalised) codebook. Its architecture is exactly the one
diffusers' ``VQModel`` builds from ``DownEncoderBlock2D``/``AttnDownEncoderBlock2D`` and
``AttnUpDecoderBlock2D``/``UpDecoderBlock2D`` blocks, so we only rename weights:

=====================================================  ==================================================
LlamaGen key (``vq_ds16_*.pt``, ``vq_ds8_*.pt``)        diffusers ``VQModel`` key
=====================================================  ==================================================
``encoder.conv_blocks.i.res.k.*``                       ``encoder.down_blocks.i.resnets.k.*``
``decoder.conv_blocks.j.res.k.*``                       ``decoder.up_blocks.j.resnets.k.*`` (same order)
``...res.k.nin_shortcut.*``                             ``...resnets.k.conv_shortcut.*``
``...attn.k.norm`` / ``.q`` / ``.k`` / ``.v``           ``...attentions.k.group_norm`` / ``.to_q`` / ...
``...attn.k.proj_out``                                  ``...attentions.k.to_out.0``
  (1x1-conv weights ``[out, in, 1, 1]``)                  (Linear weights ``[out, in]``, squeezed)
``{encoder,decoder}.mid.0`` / ``mid.1`` / ``mid.2``     ``mid_block.resnets.0`` / ``attentions.0`` / ``resnets.1``
``{encoder,decoder}.norm_out.*``                        ``conv_norm_out.*``
``encoder.conv_blocks.i.downsample.conv.*``             ``encoder.down_blocks.i.downsamplers.0.conv.*``
``decoder.conv_blocks.j.upsample.conv.*``               ``decoder.up_blocks.j.upsamplers.0.conv.*``
``quantize.embedding.weight``                           same name, rows L2-normalised (``codebook_l2_norm``)
``quantize.codebook_used``                              dropped (training statistic)
``conv_in``, ``conv_out``, ``quant_conv``,              unchanged
``post_quant_conv``, ``norm1/conv1/norm2/conv2``
=====================================================  ==================================================

The table was checked against a checkpoint written by the official code (``tests/data/llamagen``):
every key maps, none is left over, and LlamaGen's lowest-resolution level has one attention block per
res block (2 in the encoder, 3 in the decoder), which is what the diffusers attention blocks hold.
No deviation from the table given in the design brief was needed.

Why it is exact:

* the L2 normalisation LlamaGen applies to the codebook at every lookup is baked into the stored
  codebook, so diffusers' plain lookup returns the same vectors;
* LlamaGen's encoder index is ``argmax_j cos(z, e_j)``; with unit-norm ``e_j``,
  ``|z - e_j|^2 = |z|^2 + 1 - 2 z.e_j``, so diffusers' Euclidean ``argmin`` picks the same ``j``;
* LlamaGen's ``decode_code(indices, [B, C, h, w])`` = lookup, ``post_quant_conv``, decoder, which is
  ``VQModel.decode(indices, force_not_quantize=True, shape=(B, h, w, C))`` with ``lookup_from_codebook``.

Images are in ``[-1, 1]``; decoded images are nominally in that range but, as in LlamaGen, not clamped
(:func:`to_uint8` clamps with LlamaGen's ``clamp(127.5 * x + 128, 0, 255)``).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from diffusers import VQModel

from vispec.models.checkpoints import check_state_dict, read_llamagen_checkpoint
from vispec.models.offload import weight_device

__all__ = [
    "LLAMAGEN_VQ_VARIANTS",
    "llamagen_vq_config",
    "convert_llamagen_vq_state_dict",
    "read_llamagen_checkpoint",
    "load_llamagen_vq",
    "decode_tokens",
    "encode_to_tokens",
    "downsample_factor",
    "to_uint8",
]

# Channel multipliers of the encoder/decoder levels (LlamaGen ``encoder_ch_mult``/``decoder_ch_mult``).
LLAMAGEN_VQ_VARIANTS: dict[str, tuple[int, ...]] = {
    "VQ-16": (1, 1, 2, 2, 4),
    "VQ-8": (1, 2, 2, 4),
    "VQ-4": (1, 2, 4),  # vispec: the same family at downsample 4 (tiny-c2i: 64x64 -> 16x16)
}

# Keys a checkpoint file may nest its state dict under, in order of preference.

_RESNET_PARAM = re.compile(r"(norm1|conv1|norm2|conv2|nin_shortcut)\.(weight|bias)")
_ATTN_PARAM = re.compile(r"(norm|q|k|v|proj_out)\.(weight|bias)")
_ATTN_NAMES = {"norm": "group_norm", "q": "to_q", "k": "to_k", "v": "to_v", "proj_out": "to_out.0"}
_CONV_BLOCK = re.compile(r"conv_blocks\.(\d+)\.(res|attn)\.(\d+)\.(.+)")
_SAMPLER = re.compile(r"conv_blocks\.(\d+)\.(downsample|upsample)\.conv\.(weight|bias)")
_MID = re.compile(r"mid\.([012])\.(.+)")
_PLAIN = re.compile(r"(conv_in|conv_out|norm_out)\.(weight|bias)")


# --------------------------------------------------------------------------------------------- config
def llamagen_vq_config(
    variant: str = "VQ-16",
    *,
    codebook_size: int = 16384,
    codebook_embed_dim: int = 8,
    z_channels: int = 256,
    base_channels: int = 128,
) -> dict[str, Any]:
    """Keyword arguments of a diffusers ``VQModel`` with the LlamaGen ``variant`` architecture."""
    if variant not in LLAMAGEN_VQ_VARIANTS:
        allowed = ", ".join(repr(v) for v in LLAMAGEN_VQ_VARIANTS)
        raise ValueError(f"variant must be one of {allowed}; got {variant!r}")
    mult = LLAMAGEN_VQ_VARIANTS[variant]
    levels = len(mult)
    return {
        "in_channels": 3,
        "out_channels": 3,
        "down_block_types": ("DownEncoderBlock2D",) * (levels - 1) + ("AttnDownEncoderBlock2D",),
        "up_block_types": ("AttnUpDecoderBlock2D",) + ("UpDecoderBlock2D",) * (levels - 1),
        "block_out_channels": tuple(base_channels * m for m in mult),
        "layers_per_block": 2,
        "act_fn": "silu",
        "latent_channels": z_channels,
        "sample_size": 256,
        "num_vq_embeddings": codebook_size,
        "norm_num_groups": 32,
        "vq_embed_dim": codebook_embed_dim,
        "scaling_factor": 1.0,
        "norm_type": "group",
        "mid_block_add_attention": True,
        "lookup_from_codebook": True,
        "force_upcast": False,
    }


# ------------------------------------------------------------------------------------------ converter
def _rename_resnet_param(name: str) -> str | None:
    """``norm1.weight`` -> unchanged; ``nin_shortcut.bias`` -> ``conv_shortcut.bias``."""
    if _RESNET_PARAM.fullmatch(name) is None:
        return None
    return name.replace("nin_shortcut", "conv_shortcut")


def _rename_attn_param(name: str) -> str | None:
    """``q.weight`` -> ``to_q.weight``, ``proj_out.bias`` -> ``to_out.0.bias``, ``norm`` -> ``group_norm``."""
    match = _ATTN_PARAM.fullmatch(name)
    if match is None:
        return None
    return f"{_ATTN_NAMES[match.group(1)]}.{match.group(2)}"


def _rename_coder_key(side: str, rest: str) -> str | None:
    """Rename the part of an ``encoder.``/``decoder.`` key after its first dot; None if unknown."""
    blocks = "down_blocks" if side == "encoder" else "up_blocks"
    if (m := _PLAIN.fullmatch(rest)) is not None:
        layer = "conv_norm_out" if m.group(1) == "norm_out" else m.group(1)
        return f"{layer}.{m.group(2)}"
    if (m := _MID.fullmatch(rest)) is not None:
        if m.group(1) == "1":
            param = _rename_attn_param(m.group(2))
            return None if param is None else f"mid_block.attentions.0.{param}"
        param = _rename_resnet_param(m.group(2))
        index = 0 if m.group(1) == "0" else 1
        return None if param is None else f"mid_block.resnets.{index}.{param}"
    if (m := _CONV_BLOCK.fullmatch(rest)) is not None:
        level, kind, k, name = m.groups()
        param = _rename_resnet_param(name) if kind == "res" else _rename_attn_param(name)
        sub = "resnets" if kind == "res" else "attentions"
        return None if param is None else f"{blocks}.{level}.{sub}.{k}.{param}"
    if (m := _SAMPLER.fullmatch(rest)) is not None:
        level, kind, param = m.groups()
        if (kind == "downsample") != (side == "encoder"):
            return None
        sampler = "downsamplers" if kind == "downsample" else "upsamplers"
        return f"{blocks}.{level}.{sampler}.0.conv.{param}"
    return None


def _rename_key(key: str) -> str | None:
    """The diffusers name of a LlamaGen key; ``""`` for keys to drop; None when it cannot be mapped."""
    if key == "quantize.codebook_used":
        return ""
    if key == "quantize.embedding.weight":
        return key
    if re.fullmatch(r"(quant_conv|post_quant_conv)\.(weight|bias)", key):
        return key
    side, _, rest = key.partition(".")
    if side in ("encoder", "decoder"):
        renamed = _rename_coder_key(side, rest)
        return None if renamed is None else f"{side}.{renamed}"
    return None


_ATTN_LINEAR = re.compile(r"\.attentions\.\d+\.(to_q|to_k|to_v|to_out\.0)\.weight$")


def _is_attn_linear(new_key: str) -> bool:
    return _ATTN_LINEAR.search(new_key) is not None


def convert_llamagen_vq_state_dict(
    state_dict: Mapping[str, torch.Tensor], *, codebook_l2_norm: bool = True
) -> dict[str, torch.Tensor]:
    """Rename a LlamaGen VQ state dict to diffusers ``VQModel`` keys (see the module docstring).

    Attention 1x1-conv weights become Linear weights; with ``codebook_l2_norm`` the codebook rows are
    divided by their L2 norm (as LlamaGen does at every lookup). Raises ``ValueError`` listing every key
    that cannot be mapped.
    """
    converted: dict[str, torch.Tensor] = {}
    unknown: list[str] = []
    for key, value in state_dict.items():
        new_key = _rename_key(key)
        if new_key is None:
            unknown.append(key)
        elif new_key:
            converted[new_key] = _convert_value(new_key, value, codebook_l2_norm)
    if unknown:
        raise ValueError(f"cannot map {len(unknown)} LlamaGen VQ key(s): {sorted(unknown)}")
    return converted


def _convert_value(new_key: str, value: torch.Tensor, codebook_l2_norm: bool) -> torch.Tensor:
    if _is_attn_linear(new_key) and value.ndim == 4:
        return value.reshape(value.shape[0], value.shape[1])
    if new_key == "quantize.embedding.weight" and codebook_l2_norm:
        return F.normalize(value, p=2, dim=-1)
    return value


# ---------------------------------------------------------------------------------------- checkpoints
def _infer_config_args(state_dict: Mapping[str, torch.Tensor]) -> dict[str, int]:
    """Codebook size/dim, z_channels and base width read off the weights, where present."""
    shapes = {
        "quantize.embedding.weight": ("codebook_size", "codebook_embed_dim"),
        "encoder.conv_in.weight": ("base_channels",),
        "encoder.conv_out.weight": ("z_channels",),
    }
    inferred: dict[str, int] = {}
    for key, names in shapes.items():
        if key in state_dict:
            inferred.update(zip(names, state_dict[key].shape))
    return inferred


_CONFIG_ARGS = ("codebook_size", "codebook_embed_dim", "z_channels", "base_channels")


def load_llamagen_vq(
    path: str | os.PathLike,
    *,
    variant: str = "VQ-16",
    trust_pickle: bool = False,
    codebook_l2_norm: bool = True,
    **config_overrides: Any,
) -> VQModel:
    """Build a ``VQModel`` from an official LlamaGen VQ checkpoint (``vq_ds16_*.pt`` / ``vq_ds8_*.pt``).

    Codebook size/dim, ``z_channels`` and the base width are inferred from the weights;
    ``config_overrides`` may set those (``codebook_size=...``) or any ``VQModel`` keyword. The weights are
    loaded strictly: a ``ValueError`` lists missing, unexpected and mis-shaped keys
    (:func:`vispec.models.checkpoints.check_state_dict`). ``weights_only=False`` is accepted as a synonym of
    ``trust_pickle=True``. The model is returned in eval mode, in float32, on the CPU.
    """
    if "weights_only" in config_overrides:
        trust_pickle = trust_pickle or not config_overrides.pop("weights_only")
    raw = read_llamagen_checkpoint(path, trust_pickle=trust_pickle)
    state_dict = convert_llamagen_vq_state_dict(raw, codebook_l2_norm=codebook_l2_norm)
    args = {**_infer_config_args(raw), **{k: v for k, v in config_overrides.items() if k in _CONFIG_ARGS}}
    config = llamagen_vq_config(variant, **args)
    config.update({k: v for k, v in config_overrides.items() if k not in _CONFIG_ARGS})
    model = VQModel(**config)
    check_state_dict(model, state_dict, os.fspath(path), "the VQModel architecture")
    model.load_state_dict(state_dict, strict=True)
    return model.eval()


# ------------------------------------------------------------------------------------- token helpers
def _model_device_dtype(vq: VQModel) -> tuple[torch.device, torch.dtype]:
    """Where the VQ decoder computes (the offload hook's device while sequential offload parks weights on
    ``meta``) and its dtype."""
    weight = vq.post_quant_conv.weight
    return weight_device(vq.post_quant_conv, weight), weight.dtype


def _check_tokens(vq: VQModel, tokens: Any) -> None:
    if not isinstance(tokens, torch.Tensor):
        raise ValueError(f"tokens must be a torch.Tensor of shape [B, h, w]; got {type(tokens).__name__}")
    if tokens.ndim != 3:
        raise ValueError(f"tokens must have shape [B, h, w] (3 dims); got shape {tuple(tokens.shape)}")
    if tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool:
        raise ValueError(f"tokens must be an integer tensor (e.g. torch.long); got dtype {tokens.dtype}")
    size = vq.config.num_vq_embeddings
    if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= size):
        raise ValueError(
            f"tokens must lie in [0, {size}); got values in [{int(tokens.min())}, {int(tokens.max())}]"
        )


@torch.no_grad()
def decode_tokens(vq: VQModel, tokens: torch.Tensor) -> torch.Tensor:
    """Decode a token grid ``[B, h, w]`` to images ``[B, 3, 16h, 16w]`` (VQ-16) in ``[-1, 1]``.

    Same as LlamaGen ``decode_code(tokens, [B, C, h, w])``; the output is not clamped.
    """
    _check_tokens(vq, tokens)
    device, dtype = _model_device_dtype(vq)
    b, h, w = tokens.shape
    shape = (b, h, w, vq.config.vq_embed_dim)
    flat = tokens.reshape(-1).to(device=device, dtype=torch.long)
    if vq.config.lookup_from_codebook:
        return vq.decode(flat, force_not_quantize=True, shape=shape).sample
    quant = vq.quantize.get_codebook_entry(flat, shape).to(dtype)
    return vq.decode(quant, force_not_quantize=True).sample


def downsample_factor(vq: VQModel) -> int:
    """Pixels per code along each side: ``2 ** (levels - 1)`` (4 for VQ-4, 8 for VQ-8, 16 for VQ-16)."""
    return 2 ** (len(vq.config.block_out_channels) - 1)


def _check_images(vq: VQModel, images: Any) -> None:
    if not isinstance(images, torch.Tensor) or images.ndim != 4 or images.shape[1] != 3:
        shape = tuple(images.shape) if isinstance(images, torch.Tensor) else type(images).__name__
        raise ValueError(f"images must be a tensor of shape [B, 3, H, W]; got {shape}")
    if not images.dtype.is_floating_point:
        raise ValueError(f"images must be floating point in [-1, 1]; got dtype {images.dtype}")
    factor = downsample_factor(vq)
    if images.shape[2] % factor or images.shape[3] % factor:
        raise ValueError(f"images height and width must be multiples of {factor}; got {tuple(images.shape[2:])}")
    if images.numel() and (float(images.min()) < -1.001 or float(images.max()) > 1.001):
        raise ValueError(
            f"images must lie in [-1, 1]; got values in [{float(images.min()):.3f}, {float(images.max()):.3f}]"
        )


@torch.no_grad()
def encode_to_tokens(vq: VQModel, images: torch.Tensor) -> torch.Tensor:
    """Encode images ``[B, 3, H, W]`` in ``[-1, 1]`` to a token grid ``LongTensor[B, H/16, W/16]`` (VQ-16)."""
    _check_images(vq, images)
    device, dtype = _model_device_dtype(vq)
    latents = vq.encode(images.to(device=device, dtype=dtype)).latents
    _, _, (_, _, indices) = vq.quantize(latents)
    b, _, h, w = latents.shape
    return indices.reshape(b, h, w).long()


def to_uint8(images: torch.Tensor) -> torch.Tensor:
    """Map images in ``[-1, 1]`` to ``uint8`` with LlamaGen's ``clamp(127.5 * x + 128, 0, 255)`` (same layout)."""
    return torch.clamp(127.5 * images.float() + 128.0, 0, 255).to(torch.uint8)
