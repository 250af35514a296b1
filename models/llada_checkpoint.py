"""Loading official LLaDA checkpoint folders into :class:`LLaDAModelLM` without remote code.

An official folder (``GSAI-ML/LLaDA-8B-Instruct`` and friends) holds ``config.json`` (OLMo-style keys;
``auto_map``, ``architectures`` and other keys the architecture does not depend on are ignored),
sharded weights ``model-0000X-of-0000Y.safetensors`` and ``model.safetensors.index.json`` (or a single
``model.safetensors``). Settings the model does not implement (``block_type`` other than ``llama``,
biases, weight tying, ALiBi, QK-norm, logit scaling, ...) raise ``ValueError`` instead of loading into a
different network. Keys are checked strictly: missing, unexpected and mis-shaped keys are listed.
A vispec ``save_pretrained`` folder (``diffusion_pytorch_model.safetensors``) loads too.
"""

from __future__ import annotations

import json
import os
from typing import Any, Optional

import torch

from vispec.models.checkpoints import check_state_dict, diffusers_load_kwargs, read_checkpoint, safetensors_header
from vispec.models.llada import LLADA_8B_CONFIG, LLaDAModelLM

# config.json keys that map one to one onto LLaDAModelLM arguments
_DIRECT_KEYS = (
    "d_model", "n_heads", "n_layers", "vocab_size", "embedding_size", "max_sequence_length", "rope_theta",
    "rms_norm_eps", "mask_token_id", "eos_token_id", "eot_token_id", "pad_token_id", "bos_token_id",
    "logits_shift", "init_std",
)
_ID_KEYS = ("mask_token_id", "eos_token_id", "eot_token_id", "pad_token_id", "bos_token_id")
# settings the architecture depends on, with the only value implemented (absent = the implemented one)
_REQUIRED = {
    "block_type": "llama", "activation_type": "silu", "layer_norm_type": "rms", "rope": True, "alibi": False,
    "weight_tying": False, "include_bias": False, "include_qkv_bias": False, "attention_layer_norm": False,
    "input_emb_norm": False, "scale_logits": False, "block_group_size": 1,
}
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


def llada_kwargs_from_config(config: dict[str, Any], overrides: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """:class:`LLaDAModelLM` keyword arguments from an official ``config.json`` dict (unknown keys ignored).

    ``n_kv_heads: null`` means ``n_heads`` (or 1 with ``multi_query_attention``); ``mlp_hidden_size: null``
    means ``mlp_ratio * d_model``. Token ids the file omits (official configs have no ``eot_token_id``) are
    LLaDA-8B's when the vocabulary is the 8B's, else None. ``overrides`` win.
    """
    for key, wanted in _REQUIRED.items():
        if key in config and config[key] is not None and config[key] != wanted:
            raise ValueError(f"config.json sets {key}={config[key]!r}; LLaDAModelLM implements only {key}={wanted!r}")
    missing = [key for key in ("d_model", "n_heads", "n_layers", "vocab_size") if config.get(key) is None]
    if missing:
        raise ValueError(f"config.json lacks {missing}, needed to build the model")
    kwargs = {key: config[key] for key in _DIRECT_KEYS if config.get(key) is not None}
    kv_heads = config.get("n_kv_heads")
    kwargs["n_kv_heads"] = kv_heads if kv_heads is not None else 1 if config.get("multi_query_attention") else config["n_heads"]
    hidden = config.get("mlp_hidden_size")
    kwargs["mlp_hidden_size"] = int(hidden if hidden is not None else config.get("mlp_ratio", 4) * config["d_model"])
    if "embedding_size" not in kwargs:
        kwargs["embedding_size"] = config["vocab_size"]
    for name in _ID_KEYS:  # absent ids: LLaDA-8B's for its vocabulary, otherwise unknown
        if name not in kwargs:
            kwargs[name] = LLADA_8B_CONFIG[name] if config["vocab_size"] == LLADA_8B_CONFIG["vocab_size"] else None
    kwargs.update(overrides or {})
    if kwargs["mask_token_id"] is None:
        raise ValueError("config.json lacks mask_token_id (and the vocabulary is not LLaDA-8B's): pass mask_token_id=")
    return kwargs


def shard_files(folder: str) -> list[str]:
    """The safetensors files of an official folder, checked against ``model.safetensors.index.json`` from their
    headers alone (the index's ``weight_map`` must agree with the shards' contents)."""
    index_path = os.path.join(folder, INDEX_NAME)
    if not os.path.isfile(index_path):
        single = os.path.join(folder, SINGLE_NAME)
        if not os.path.isfile(single):
            raise ValueError(f"{folder} holds neither {INDEX_NAME} nor {SINGLE_NAME}")
        return [single]
    try:
        with open(index_path) as handle:
            weight_map = json.load(handle).get("weight_map")
    except (OSError, ValueError, AttributeError) as err:
        raise ValueError(f"{index_path} is not a readable shard index (corrupted?): {err}") from None
    if not isinstance(weight_map, dict) or not weight_map or not all(isinstance(v, str) for v in weight_map.values()):
        raise ValueError(f"{index_path} has no 'weight_map' of tensor name -> shard file")
    paths = []
    for shard in sorted(set(weight_map.values())):
        path = os.path.join(folder, shard)
        if not os.path.isfile(path):
            raise ValueError(f"{index_path} names shard {shard!r}, which is missing from {folder}")
        tensors = safetensors_header(path)[0]
        listed = {name for name, file in weight_map.items() if file == shard}
        if set(tensors) != listed:
            raise ValueError(
                f"shard {shard} disagrees with {INDEX_NAME}: in the shard only {sorted(set(tensors) - listed)[:10]}, "
                f"in the index only {sorted(listed - set(tensors))[:10]}"
            )
        paths.append(path)
    return paths


def read_sharded_safetensors(folder: str | os.PathLike) -> dict[str, torch.Tensor]:
    """All tensors of an official folder: the shards named by ``model.safetensors.index.json`` (whose
    ``weight_map`` must agree with the shards' contents), or a single ``model.safetensors``."""
    state_dict: dict[str, torch.Tensor] = {}
    for path in shard_files(os.fspath(folder)):
        state_dict.update(read_checkpoint(path)[0])
    return state_dict


def load_llada(path: str | os.PathLike, *, dtype: Optional[torch.dtype] = None, **overrides: Any) -> LLaDAModelLM:
    """An :class:`LLaDAModelLM` (eval mode) from an official folder or a vispec ``save_pretrained`` folder.

    Weights keep the checkpoint's dtype (bfloat16 for the official 8B) unless ``dtype`` is given; the model
    is built on the meta device and takes the loaded tensors, so memory holds one copy of the weights.
    ``overrides`` set config fields the folder lacks or gets wrong (``eot_token_id=126348``, ...).
    """
    folder = os.fspath(path)
    config_path = os.path.join(folder, "config.json")
    if not os.path.isfile(config_path):
        raise ValueError(f"{folder} is not a LLaDA checkpoint folder: config.json is missing")
    if os.path.isfile(os.path.join(folder, "diffusion_pytorch_model.safetensors")):
        model = LLaDAModelLM.from_pretrained(folder, **overrides, **diffusers_load_kwargs())
    else:
        with open(config_path) as handle:
            config = json.load(handle)
        kwargs = llada_kwargs_from_config(config, overrides)
        with torch.device("meta"):
            model = LLaDAModelLM(**kwargs)
        shapes = {}  # the files' shapes from their headers: a config that does not fit fails before any load
        for shard in shard_files(folder):
            shapes.update(safetensors_header(shard)[0])
        check_state_dict(model, shapes, folder)
        state_dict = read_sharded_safetensors(folder)
        model.load_state_dict(state_dict, strict=True, assign=True)
    if dtype is not None:
        model = torch.nn.Module.to(model, dtype=dtype)  # ModelMixin.to warns spuriously on dtype casts
    return model.eval()
