"""Reading official checkpoint files without running untrusted pickles, and checking them strictly.

LlamaGen checkpoints come as ``.pt`` files holding the weights raw (FSDP exports) or under
``"model"`` (DDP training), ``"module"`` (DeepSpeed), ``"state_dict"`` or ``"ema"``; DDP files also
pickle an ``argparse.Namespace`` under ``"args"``. ``torch.load(weights_only=True)`` refuses such
files; we never fall back silently: the caller opts in with ``trust_pickle=True``.
:func:`check_state_dict` is the one strict key check every loader (LlamaGen GPT and VQ, LLaDA) runs
before ``load_state_dict``: missing, unexpected and mis-shaped keys are listed, never ignored.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Mapping
from typing import Any

import torch

_STATE_DICT_KEYS = ("model", "module", "state_dict", "ema")


def read_checkpoint(path: str | os.PathLike, *, trust_pickle: bool = False) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """``(state_dict, args)`` from a ``.pt``/``.pth``/``.safetensors`` file.

    ``args`` holds the training arguments a DDP checkpoint pickles under ``"args"`` (as a dict; empty
    when absent) or a safetensors file's string metadata.
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ValueError(f"checkpoint file not found: {path}")
    if path.endswith(".safetensors"):
        from safetensors import safe_open
        from safetensors.torch import load_file

        with safe_open(path, framework="pt") as handle:
            metadata = dict(handle.metadata() or {})
        return load_file(path, device="cpu"), metadata
    obj = _torch_load(path, trust_pickle)
    args = obj.get("args") if isinstance(obj, Mapping) else None
    args = dict(vars(args)) if hasattr(args, "__dict__") else dict(args) if isinstance(args, Mapping) else {}
    return _unwrap_state_dict(obj, path), args


def read_llamagen_checkpoint(path: str | os.PathLike, *, trust_pickle: bool = False) -> dict[str, torch.Tensor]:
    """The raw (LlamaGen-layout) state dict stored in a ``.pt``/``.pth``/``.safetensors`` file.

    ``.pt`` files are read with ``torch.load(weights_only=True)``; files that hold other pickled objects
    (e.g. an ``argparse.Namespace``) raise ``ValueError`` unless ``trust_pickle=True``, which runs the
    pickle (arbitrary code): only do that for files you trust.
    """
    return read_checkpoint(path, trust_pickle=trust_pickle)[0]


def _torch_load(path: str, trust_pickle: bool) -> Any:
    try:
        # trust_pickle: the caller vouched for the file, so its pickled objects may run
        return torch.load(path, map_location="cpu", weights_only=not trust_pickle)
    except pickle.UnpicklingError as err:
        if "global" not in str(err).lower():  # refusals of pickled classes name a "global"
            raise ValueError(f"{path} is not a readable torch checkpoint (corrupted or truncated?): {err}") from err
        raise ValueError(
            f"{path} holds pickled Python objects besides tensors (official DDP checkpoints pickle their training "
            "args), so torch.load(weights_only=True) refused it. Loading it runs code from the file: if you trust "
            "it, pass trust_pickle=True (command line: --trust-pickle)"
        ) from err
    except (RuntimeError, EOFError, OSError, ValueError) as err:
        raise ValueError(f"{path} is not a readable torch checkpoint (corrupted or truncated?): {err}") from err


def _unwrap_state_dict(obj: Any, path: str) -> dict[str, torch.Tensor]:
    if not isinstance(obj, Mapping):
        raise ValueError(f"{path} does not hold a state dict (got {type(obj).__name__})")
    for key in _STATE_DICT_KEYS:
        if isinstance(obj.get(key), Mapping):
            obj = obj[key]
            break
    tensors = {k: v for k, v in obj.items() if isinstance(v, torch.Tensor)}
    if not tensors or len(tensors) != len(obj):
        raise ValueError(
            f"{path}: expected a state dict of tensors, raw or under one of {list(_STATE_DICT_KEYS)}; "
            f"found keys {sorted(map(str, obj))[:10]}"
        )
    return tensors


def check_state_dict(model: torch.nn.Module, state_dict: Mapping[str, torch.Tensor], source: str,
                     target: str = "the model configuration") -> None:
    """Raise ``ValueError`` if ``state_dict`` does not fit ``model`` exactly.

    The message names ``source`` (the file or folder) and ``target`` (what it should match) and lists, sorted,
    the missing keys, the unexpected keys and the shape mismatches (``key: checkpoint (..) vs model (..)``);
    only the non-empty lists are shown. Works on models built on the meta device (only shapes are read).
    """
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(expected))
    shapes = sorted(
        f"{k}: checkpoint {tuple(state_dict[k].shape)} vs model {tuple(expected[k].shape)}"
        for k in set(expected) & set(state_dict)
        if tuple(state_dict[k].shape) != tuple(expected[k].shape)
    )
    problems = [f"{name} {_listed(keys)}" for name, keys in
                (("missing keys", missing), ("unexpected keys", unexpected), ("shape mismatches", shapes)) if keys]
    if problems:
        raise ValueError(f"{source} does not match {target}: " + ", ".join(problems))


def _listed(keys: list[str], limit: int = 20) -> str:
    """``keys`` as a list literal, the first ``limit`` of them and a count of the rest."""
    return str(keys) if len(keys) <= limit else f"{keys[:limit]} and {len(keys) - limit} more"


def diffusers_load_kwargs() -> dict[str, Any]:
    """Keyword arguments for diffusers ``from_pretrained`` calls: without ``accelerate`` installed,
    ``low_cpu_mem_usage=False`` (what diffusers falls back to anyway, minus a warning on every load)."""
    import importlib.util

    return {} if importlib.util.find_spec("accelerate") is not None else {"low_cpu_mem_usage": False}
