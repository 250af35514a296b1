"""Loading official FoundationVision/LlamaGen GPT checkpoints into :class:`LlamaGenGPT`.

The official ``.pt`` files carry weights only (no head count, grid size or class count for raw
FSDP exports), so the configuration is assembled from, in order of precedence: keyword arguments,
the pickled training ``args`` of DDP checkpoints (``gpt_model``, ``image_size``,
``downsample_size``, ``num_classes``, ``cls_token_num``), and the tensor shapes (vocabulary, width,
depth, KV heads, caption width, presence of the null-class row). Anything that cannot be determined
raises ``ValueError`` naming the keyword to pass. Keys are checked strictly: missing, unexpected
and mis-shaped keys are listed, never ignored.
"""

from __future__ import annotations

import os
from typing import Any, Optional

import torch

from vispec.models.checkpoints import check_state_dict, read_checkpoint
from vispec.models.llamagen_gpt import GPT_CONFIGS, LlamaGenGPT, ffn_hidden_dim


def _num_layers(state_dict: dict[str, torch.Tensor]) -> int:
    layers = {int(k.split(".")[1]) for k in state_dict if k.startswith("layers.") and k.split(".")[1].isdigit()}
    return len(layers)


_INTEGER_ARGS = ("image_size", "downsample_size", "num_classes", "cls_token_num")


def _integer_args(args: dict[str, Any]) -> dict[str, Any]:
    """``args`` with its integer settings as ``int``: a safetensors file's metadata holds only strings
    (``"num_classes": "1000"``), a pickled ``Namespace`` holds ints. A value that is no integer is a
    ``ValueError`` naming it."""
    out = dict(args)
    for key in _INTEGER_ARGS:
        value = out.get(key)
        if value is None or (isinstance(value, int) and not isinstance(value, bool)):
            continue
        try:
            out[key] = int(str(value).strip())
        except ValueError:
            raise ValueError(f"the checkpoint's {key} setting (training args or safetensors metadata) must be an "
                             f"integer, got {value!r}") from None
    return out


def infer_llamagen_config(
    state_dict: dict[str, torch.Tensor], args: dict[str, Any], overrides: dict[str, Any]
) -> dict[str, Any]:
    """``LlamaGenGPT`` keyword arguments for a LlamaGen state dict (module docstring)."""
    if "tok_embeddings.weight" not in state_dict:
        raise ValueError("not a LlamaGen GPT state dict: 'tok_embeddings.weight' is missing")
    args = _integer_args(args)
    config: dict[str, Any] = {}
    name = overrides.pop("gpt_model", None) or args.get("gpt_model")
    if name in GPT_CONFIGS:
        config.update(GPT_CONFIGS[name])
    vocab, dim = state_dict["tok_embeddings.weight"].shape
    config.update(vocab_size=int(vocab), dim=int(dim), n_layer=_num_layers(state_dict))
    if "cls_embedding.embedding_table.weight" in state_dict:
        config["model_type"] = "c2i"
        rows = int(state_dict["cls_embedding.embedding_table.weight"].shape[0])
        num_classes = overrides.pop("num_classes", None) or args.get("num_classes") or rows - 1
        if rows not in (num_classes, num_classes + 1):
            raise ValueError(f"class table has {rows} rows, which does not fit num_classes={num_classes} (expected {num_classes} or {num_classes + 1})")
        config.update(num_classes=int(num_classes), class_dropout_prob=0.1 if rows == num_classes + 1 else 0.0, cls_token_num=1)
    elif "cls_embedding.cap_proj.fc1.weight" in state_dict:
        config["model_type"] = "t2i"
        config["caption_dim"] = int(state_dict["cls_embedding.cap_proj.fc1.weight"].shape[1])
        config["cls_token_num"] = int(overrides.pop("cls_token_num", None) or args.get("cls_token_num") or 120)
    else:
        raise ValueError("not a LlamaGen GPT state dict: no class table and no caption projection")
    block_size = overrides.pop("block_size", None)
    image_size = overrides.pop("image_size", None) or args.get("image_size")
    downsample = overrides.pop("downsample_size", None) or args.get("downsample_size") or 16
    if block_size is None and image_size is not None:
        block_size = (int(image_size) // int(downsample)) ** 2
    if block_size is None:
        raise ValueError("the grid size is unknown for this checkpoint: pass image_size= (and downsample_size=) or block_size=")
    config["block_size"] = int(block_size)
    config.update(overrides)
    if "n_head" not in config:
        raise ValueError(f"the head count is unknown (gpt_model={name!r}): pass gpt_model= one of {sorted(GPT_CONFIGS)} or n_head=")
    head_dim = config["dim"] // config["n_head"]
    qkv_rows = int(state_dict["layers.0.attention.wqkv.weight"].shape[0]) if config["n_layer"] else 3 * config["dim"]
    config.setdefault("n_kv_head", (qkv_rows // head_dim - config["n_head"]) // 2)
    if config["n_layer"]:
        hidden = int(state_dict["layers.0.feed_forward.w1.weight"].shape[0])
        expected = ffn_hidden_dim(config["dim"], config.get("multiple_of", 256), config.get("ffn_dim_multiplier"))
        if hidden != expected:
            raise ValueError(f"feed-forward width {hidden} does not follow the LlamaGen rule ({expected}); pass multiple_of= / ffn_dim_multiplier=")
    return config


def load_llamagen_gpt(
    path: str | os.PathLike, *, trust_pickle: bool = False, dtype: Optional[torch.dtype] = None, **config: Any
) -> LlamaGenGPT:
    """Build a :class:`LlamaGenGPT` from an official checkpoint (``.pt`` in any official layout, or safetensors).

    Keyword arguments override the inferred configuration: ``gpt_model`` (``"GPT-B"``, ...),
    ``n_head``, ``image_size``/``downsample_size`` or ``block_size``, ``num_classes``,
    ``cls_token_num``. DDP checkpoints pickle an ``argparse.Namespace``; they load only with
    ``trust_pickle=True`` (which executes the pickle: use it for files you trust).
    """
    state_dict, args = read_checkpoint(path, trust_pickle=trust_pickle)
    kwargs = infer_llamagen_config(state_dict, args, dict(config))
    model = LlamaGenGPT(**kwargs)
    check_state_dict(model, state_dict, os.fspath(path))
    model.load_state_dict(state_dict, strict=True)
    if dtype is not None:
        model = torch.nn.Module.to(model, dtype=dtype)  # ModelMixin.to warns spuriously on dtype casts
    return model.eval()
