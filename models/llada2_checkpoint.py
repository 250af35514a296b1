"""Loading official LLaDA2 checkpoint folders (``inclusionAI/LLaDA2.0-mini``, ``LLaDA2.1-mini``, ...) into
:class:`~vispec.models.llada2.LLaDA2MoeModelLM` without remote code.

An official folder holds ``config.json`` (``model_type = "llada2_moe"``, the BailingMoe-v2 keys) and
``model-0000X-of-0000Y.safetensors`` with ``model.safetensors.index.json`` (whose ``weight_map`` must agree with the
shards) or a single ``model.safetensors``. vispec's parameter names *are* the official tensor names
(``model.word_embeddings.weight``, ``model.layers.{i}.attention.query_key_value.weight``, ``...mlp.gate.weight``,
``...mlp.gate.expert_bias``, ``...mlp.experts.{e}.gate_proj.weight``, ``...mlp.shared_experts.up_proj.weight``,
``model.norm.weight``, ``lm_head.weight``, ...), so the map is the identity; it is checked strictly from the shards'
headers before anything is read (missing, unexpected and mis-shaped tensors listed). The merged-expert layout of
dFactory's trainer (one ``mlp.experts.gate_proj`` tensor per layer) is refused with the way to split it.

``config.json`` keys map one to one onto the model's arguments (:data:`CONFIG_KEYS`). Settings the network does not
implement raise ``ValueError`` naming the key: ``model_type`` other than ``llada2_moe``, ``hidden_act`` other than
``silu``, ``score_function`` other than ``sigmoid``, ``rope_scaling``, ``tie_word_embeddings``, ``norm_head``,
``use_sliding_window``, a ``rotary_dim`` other than ``head_dim · partial_rotary_factor``. The switches of optional tensors a
config.json may omit (``use_bias``, ``use_qkv_bias``, ``use_qk_norm``, ``moe_router_enable_expert_bias``) are read from
the checkpoint (whether ``attention.dense.bias`` etc. are there). Keys the network does not
depend on (``auto_map``, ``architectures``, ``dtype`` / ``torch_dtype``, dropouts, ``router_dtype`` (routing runs in
float32), ``output_router_logits``, ``use_cache``, ...) are ignored. The official configs name no mask or EOS id:
for LLaDA2's vocabulary (157184 ids) they are ``<|mask|>`` 156895 and ``<|endoftext|>`` 156892, otherwise pass
``mask_token_id=`` / ``eos_token_id=``. ``block_length`` (the attention block a 2-D mask implies) defaults to 32, the
block size LLaDA2 decodes with.
"""

from __future__ import annotations

import json
import os
from typing import Any, Optional

import torch

from vispec.models.checkpoints import check_official_config, check_state_dict, diffusers_load_kwargs, safetensors_header
from vispec.models.llada2 import LLADA2_MINI_CONFIG, LLaDA2MoeModelLM
from vispec.models.llada_checkpoint import read_sharded_safetensors, shard_files

# config.json keys that are LLaDA2MoeModelLM arguments of the same name
CONFIG_KEYS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "head_dim", "hidden_act", "use_qkv_bias", "use_qk_norm", "use_bias", "rms_norm_eps", "max_position_embeddings",
    "rope_theta", "partial_rotary_factor", "num_experts", "num_shared_experts", "num_experts_per_tok", "n_group",
    "topk_group", "routed_scaling_factor", "moe_intermediate_size", "first_k_dense_replace", "norm_topk_prob",
    "score_function", "moe_router_enable_expert_bias", "pad_token_id", "initializer_range",
)
# LLaDA2MoeConfig's defaults for the keys a config.json may omit (the official remote code's)
_DEFAULTS = dict(num_key_value_heads=0, hidden_act="silu", use_qkv_bias=False, use_qk_norm=True, use_bias=True,
                 rms_norm_eps=1e-5, max_position_embeddings=16384, rope_theta=10000.0, partial_rotary_factor=0.5,
                 num_experts=16, num_shared_experts=0, num_experts_per_tok=2, n_group=8, topk_group=4,
                 routed_scaling_factor=2.5, first_k_dense_replace=0, norm_topk_prob=True, score_function="sigmoid",
                 moe_router_enable_expert_bias=True, initializer_range=0.02)
# settings the network depends on, with the only value implemented (absent = the implemented one)
_REQUIRED = {"hidden_act": "silu", "score_function": "sigmoid", "rope_scaling": None, "tie_word_embeddings": False,
             "norm_head": False, "use_sliding_window": False}
# switches whose tensors show in the checkpoint (config key -> a tensor name suffix)
_OPTIONAL_TENSORS = {"use_bias": "attention.dense.bias", "use_qkv_bias": "attention.query_key_value.bias",
                     "use_qk_norm": "attention.query_layernorm.weight",
                     "moe_router_enable_expert_bias": "mlp.gate.expert_bias"}
_SIZE_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
LLADA2_VOCAB_SIZE = 157184
LLADA2_MASK_ID, LLADA2_EOS_ID = 156895, 156892
DEFAULT_BLOCK_LENGTH = 32


def llada2_kwargs_from_config(config: dict[str, Any], overrides: Optional[dict[str, Any]] = None,
                              tensor_names: Optional[set] = None) -> dict[str, Any]:
    """:class:`LLaDA2MoeModelLM` keyword arguments from an official ``config.json`` dict (module docstring).

    ``tensor_names``: the checkpoint's tensor names. The switches of optional tensors a config.json may omit
    (``use_bias``, ``use_qkv_bias``, ``use_qk_norm``, ``moe_router_enable_expert_bias``) are then read from whether
    the tensors are there; otherwise they take the remote code's defaults."""
    check_official_config(config, "llada2_moe", "LLaDA2", _REQUIRED, _SIZE_KEYS,
                          ("num_key_value_heads", "head_dim", "num_experts", "moe_intermediate_size"), minimum=0)
    kwargs = {key: config[key] if config.get(key) is not None else _DEFAULTS.get(key) for key in CONFIG_KEYS}
    kwargs = {key: value for key, value in kwargs.items() if value is not None}
    kwargs["num_key_value_heads"] = kwargs.get("num_key_value_heads") or config["num_attention_heads"]  # 0: MHA
    kwargs["head_dim"] = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    rotary = config.get("rotary_dim")
    wanted_rotary = int(kwargs["head_dim"] * kwargs["partial_rotary_factor"])
    if rotary is not None and rotary != wanted_rotary:
        raise ValueError(f"config.json sets rotary_dim={rotary!r}, but head_dim * partial_rotary_factor = "
                         f"{wanted_rotary}: LLaDA2MoeModelLM rotates head_dim * partial_rotary_factor dimensions")
    if not config.get("num_experts"):
        kwargs["num_experts"] = None if "num_experts" in config else kwargs["num_experts"]
    kwargs["moe_intermediate_size"] = config.get("moe_intermediate_size")
    for key, suffix in _OPTIONAL_TENSORS.items():
        if config.get(key) is None and tensor_names is not None:
            kwargs[key] = any(name.endswith(suffix) for name in tensor_names)
    llada2_vocab = config["vocab_size"] == LLADA2_VOCAB_SIZE
    kwargs["mask_token_id"] = config.get("mask_token_id", LLADA2_MASK_ID if llada2_vocab else None)
    kwargs["eos_token_id"] = config.get("eos_token_id", LLADA2_EOS_ID if llada2_vocab else None)
    kwargs["block_length"] = DEFAULT_BLOCK_LENGTH
    kwargs.update(overrides or {})
    if kwargs["mask_token_id"] is None:
        raise ValueError("config.json names no mask_token_id and the vocabulary is not LLaDA2's: pass mask_token_id=")
    return kwargs


def _merged_experts_hint(names: list[str]) -> Optional[str]:
    merged = [name for name in names if name.endswith(("mlp.experts.gate_proj", "mlp.experts.gate_proj.weight",
                                                       "mlp.experts.gate_up_proj", "mlp.experts.down_proj"))]
    if not merged:
        return None
    return (f"the checkpoint stores merged experts ({merged[0]}, dFactory's training layout); split them into "
            "mlp.experts.{e}.gate_proj / up_proj / down_proj first (dFactory's moe_convertor.py --mode split)")


def load_llada2(path: str | os.PathLike, *, dtype: Optional[torch.dtype] = None, **overrides: Any) -> LLaDA2MoeModelLM:
    """A :class:`LLaDA2MoeModelLM` (eval mode) from an official LLaDA2 folder or a vispec ``save_pretrained`` folder.

    Weights keep the checkpoint's dtype (bfloat16 for the official models) unless ``dtype`` is given; the model is
    built on the meta device and takes the loaded tensors, so memory holds one copy. ``overrides`` set model arguments
    the folder lacks or gets wrong (``mask_token_id=``, ``eos_token_id=``, ``block_length=``, ...).
    """
    folder = os.fspath(path)
    config_path = os.path.join(folder, "config.json")
    if not os.path.isfile(config_path):
        raise ValueError(f"{folder} is not a LLaDA2 checkpoint folder: config.json is missing")
    if os.path.isfile(os.path.join(folder, "diffusion_pytorch_model.safetensors")):
        as_dtype = {} if dtype is None else {"torch_dtype": dtype}  # diffusers loads float32 unless told
        model = LLaDA2MoeModelLM.from_pretrained(folder, **overrides, **as_dtype, **diffusers_load_kwargs())
    else:
        try:
            with open(config_path) as handle:
                config = json.load(handle)
        except (OSError, ValueError) as err:
            raise ValueError(f"{config_path} is not readable JSON: {err}") from None
        shapes = {}  # the files' shapes from their headers: a config that does not fit fails before any load
        for shard in shard_files(folder):
            shapes.update(safetensors_header(shard)[0])
        hint = _merged_experts_hint(sorted(shapes))
        if hint is not None:
            raise ValueError(f"{folder}: {hint}")
        kwargs = llada2_kwargs_from_config(config, overrides, set(shapes))
        with torch.device("meta"):
            model = LLaDA2MoeModelLM(**kwargs)
        check_state_dict(model, shapes, folder)
        model.load_state_dict(read_sharded_safetensors(folder), strict=True, assign=True)
    if dtype is not None:
        model = torch.nn.Module.to(model, dtype=dtype)  # ModelMixin.to warns spuriously on dtype casts
    return model.eval()


__all__ = ["CONFIG_KEYS", "LLADA2_MINI_CONFIG", "llada2_kwargs_from_config", "load_llada2"]
