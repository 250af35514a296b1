"""Reading official checkpoint files without running untrusted pickles, and checking them strictly.

LlamaGen checkpoints come as ``.pt`` files holding the weights raw (FSDP exports) or under
``"model"`` (DDP training), ``"module"`` (DeepSpeed), ``"state_dict"`` or ``"ema"``; DDP files also
pickle an ``argparse.Namespace`` under ``"args"``. ``torch.load(weights_only=True)`` refuses such
files; we never fall back silently: the caller opts in with ``trust_pickle=True``.
:func:`check_state_dict` is the one strict key check every loader (LlamaGen GPT and VQ, LLaDA) runs
before ``load_state_dict``: missing, unexpected and mis-shaped keys are listed, never ignored.

Files are untrusted input, so every way they can be wrong is a ``ValueError`` that names the file and
says what it is: a truncated or corrupt file ("corrupted or truncated?"), a plain Python pickle (it
can only be read by running it: ``trust_pickle``), a torch file that pickles objects besides tensors.
Configurations are untrusted too: :class:`CheckedFromPretrained` (a base class of the vispec models)
and :func:`check_pipeline_folder` compare the tensor shapes a folder's weight files declare (safetensors
headers, read without loading a tensor) with the model its ``config.json`` describes, built with its
parameters on the meta device, so a config asking for a 20-GB embedding fails before anything is allocated.
That build is bounded too (:func:`parameter_limit`): a config counting 100,000 layers stops after a few hundred
parameters, not after building them all. The unified pipeline's transformer (a transformers model) is checked the
same way, and first by the config fields its weights reveal (:data:`TRANSFORMERS_WEIGHT_FACTS`:
``vocab_size``, ``num_hidden_layers``, ``vq_config.num_embeddings``, ...), so the error names the field, the
config's value and the weights' (:func:`check_config_fields`, which the Lumina-mGPT converter runs as well).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import pickle
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional

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
        from safetensors.torch import load_file

        metadata = dict(safetensors_header(path)[1])  # a clear error for a corrupt or truncated file
        try:
            return load_file(path, device="cpu"), metadata
        except Exception as err:  # noqa: BLE001 - untrusted bytes: any failure is the file's
            raise _unreadable(path, "safetensors file", err) from None
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


# the first bytes of torch.save's files: a zip archive (torch >= 1.6) or the legacy pickled magic number
_ZIP_MAGIC = b"PK\x03\x04"
_LEGACY_TORCH_MAGIC = (0x1950A86A20F9469CFC6C).to_bytes(10, "little")


def file_kind(path: str) -> str:
    """``"torch"`` (a ``torch.save`` file, zip or legacy), ``"pickle"`` (a plain Python pickle) or ``"unknown"``,
    from the first bytes: the error for an unreadable file can then say what the file is."""
    with open(path, "rb") as handle:
        head = handle.read(16)
    if head.startswith(_ZIP_MAGIC):
        return "torch"
    if len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5:  # PROTO opcode: a pickle stream
        return "torch" if _LEGACY_TORCH_MAGIC in head else "pickle"
    return "unknown"


def _torch_load(path: str, trust_pickle: bool) -> Any:
    kind = file_kind(path)
    if kind == "pickle":
        if not trust_pickle:
            raise ValueError(
                f"{path} is a plain Python pickle (pickle.dump), not a torch.save checkpoint: it can only be read by "
                "running the pickle, which runs code from the file. If you trust it, pass trust_pickle=True "
                "(command line: --trust-pickle)")
        try:
            with open(path, "rb") as handle:
                return pickle.load(handle)  # noqa: S301 - the caller vouched for the file (trust_pickle)
        except Exception as err:  # noqa: BLE001 - untrusted bytes: any failure is the file's
            raise _unreadable(path, "Python pickle", err) from None
    try:
        with warnings.catch_warnings():  # torch warns about the pickle protocol of files it then reads fine
            warnings.filterwarnings("ignore", message=".*pickle protocol.*")
            # trust_pickle: the caller vouched for the file, so its pickled objects may run
            return torch.load(path, map_location="cpu", weights_only=not trust_pickle)
    except Exception as err:  # noqa: BLE001 - untrusted bytes: torch raises many types for garbage
        if kind == "torch" and isinstance(err, pickle.UnpicklingError) and "global" in str(err).lower():
            raise ValueError(  # refusals of pickled classes name a "global"
                f"{path} holds pickled Python objects besides tensors (official DDP checkpoints pickle their training "
                "args), so torch.load(weights_only=True) refused it. Loading it runs code from the file: if you trust "
                "it, pass trust_pickle=True (command line: --trust-pickle)"
            ) from None
        if os.path.getsize(path) == 0:
            raise ValueError(f"{path} is not a readable torch checkpoint: the file is empty (truncated?)") from None
        if kind == "unknown":
            raise ValueError(f"{path} is not a readable torch checkpoint (corrupted?): it starts with neither the zip "
                             "header of torch.save nor a pickle header") from None
        raise _unreadable(path, "torch checkpoint", err) from None


def _reason(err: BaseException) -> str:
    """The part of a reader's error that describes the file, without advice that does not apply to
    vispec's callers (torch's "re-run with weights_only=False", a bug-report request)."""
    text = str(err).strip()
    if "WeightsUnpickler error:" in text:  # the unpickler's own words follow, on the same or a later line
        rest = text.split("WeightsUnpickler error:", 1)[1]
        detail = next((line.strip() for line in rest.splitlines() if line.strip()), "")
        return detail if detail and "weights_only" not in detail else "content the weights-only unpickler cannot read"
    first = next((line.strip() for line in text.splitlines() if line.strip()), "")
    if "weights_only" in first or not first:
        return type(err).__name__
    first = first.split(". This is an internal", 1)[0]  # miniz: "failed finding central directory. This is ..."
    return first[:200]


def _unreadable(path: str, what: str, err: BaseException) -> ValueError:
    return ValueError(f"{path} is not a readable {what} (corrupted or truncated?): {_reason(err)}")


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


# ---- configurations checked against their weight files, before a model is built ---------------------


def safetensors_header(path: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """``(tensors, metadata)`` of a safetensors file from its header alone: ``tensors`` maps each name to a
    meta-device tensor of the stored shape and dtype (nothing is read or allocated), ``metadata`` is the
    header's string metadata. A corrupt or truncated file is a ``ValueError`` saying so, not a
    ``SafetensorError`` traceback (the library checks that the header covers the file exactly)."""
    from safetensors import safe_open

    path = os.fspath(path)
    try:
        with safe_open(path, framework="pt") as handle:
            metadata = dict(handle.metadata() or {})
            tensors = {}
            for name in handle.keys():
                piece = handle.get_slice(name)
                dtype = _SAFETENSORS_DTYPES.get(piece.get_dtype(), torch.uint8)
                tensors[name] = torch.empty(piece.get_shape(), dtype=dtype, device="meta")
    except Exception as err:  # noqa: BLE001 - untrusted bytes: any failure is the file's
        raise _unreadable(path, "safetensors file", err) from None
    return tensors, metadata


_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                       "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                       "BOOL": torch.bool}


def bin_shapes(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The tensors of a ``torch.save`` weights file (diffusers' ``.bin``) as meta tensors of their stored
    shapes and dtypes: the weights-only unpickler reads the small pickle and maps nothing (storages go to
    the meta device), so no code from the file runs and nothing is allocated."""
    path = os.fspath(path)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*pickle protocol.*")
            loaded = torch.load(path, map_location="meta", weights_only=True)
    except Exception as err:  # noqa: BLE001 - untrusted bytes: any failure is the file's
        raise _unreadable(path, "torch weights file", err) from None
    return _unwrap_state_dict(loaded, path)


# the weight file names of each library: (safetensors, safetensors index, .bin, .bin index)
_WEIGHT_NAMES = {
    "diffusers": ("diffusion_pytorch_model.safetensors", "diffusion_pytorch_model.safetensors.index.json",
                  "diffusion_pytorch_model.bin", "diffusion_pytorch_model.bin.index.json"),
    "transformers": ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json"),
}


def weight_file_shapes(folder: str | os.PathLike, variant: Optional[str] = None,
                       library: str = "diffusers") -> Optional[tuple[str, dict[str, torch.Tensor]]]:
    """``(file, tensors)`` of a model folder's weights as meta tensors, read without loading them:
    safetensors (a single file or the shards its index lists, with ``library``'s file names, ``"diffusers"``
    or ``"transformers"``, for ``variant``) from their headers, else ``.bin`` files with :func:`bin_shapes`;
    ``None`` when the folder has neither."""
    from diffusers.utils import _add_variant

    safe_single, safe_index, bin_single, bin_index = (_add_variant(name, variant) for name in _WEIGHT_NAMES[library])
    folder = os.fspath(folder)
    single = os.path.join(folder, safe_single)
    if os.path.isfile(single):
        return single, safetensors_header(single)[0]
    index = os.path.join(folder, safe_index)
    reader = lambda path: safetensors_header(path)[0]  # noqa: E731
    if not os.path.isfile(index):
        single = os.path.join(folder, bin_single)
        if os.path.isfile(single):
            return single, bin_shapes(single)
        index, reader = os.path.join(folder, bin_index), bin_shapes
    if not os.path.isfile(index):
        return None
    try:
        with open(index) as handle:
            weight_map = json.load(handle)["weight_map"]
        shards = sorted(set(weight_map.values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise ValueError(f"{index} is not a readable shard index (corrupted?): {err}") from None
    tensors: dict[str, torch.Tensor] = {}
    for shard in shards:
        path = os.path.join(folder, os.path.basename(str(shard)))
        if not os.path.isfile(path):
            raise ValueError(f"{index} names shard {shard!r}, which is missing from {folder}")
        tensors.update(reader(path))
    return index, tensors


class _LargeFactoriesOnMeta(torch.overrides.TorchFunctionMode):
    """Tensor factories that would allocate much (every ``torch.empty``, which ``nn.Linear``, ``nn.Embedding``
    and the convolutions allocate their parameters with, and any other factory of more than
    :attr:`LIMIT` elements) make meta tensors instead. Small ones stay real, so constructors that compute
    with small tensors (``torch.linspace(...).tolist()`` for drop-path rates) still run; a plain
    ``torch.device("meta")`` context breaks those."""

    LIMIT = 1 << 20
    SIZED = {torch.zeros, torch.ones, torch.rand, torch.randn, torch.full, torch.empty_strided}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.empty or (func in self.SIZED and self._numel(func, args, kwargs) > self.LIMIT):
            kwargs["device"] = "meta"
        return func(*args, **kwargs)

    @staticmethod
    def _numel(func, args, kwargs) -> int:
        if "size" in kwargs:
            size = kwargs["size"]
        elif not args:
            return 0
        elif func is torch.full or isinstance(args[0], (tuple, list, torch.Size)):
            size = args[0]  # full(size, value), empty_strided(size, stride), zeros((a, b))
        else:
            size = [a for a in args if isinstance(a, int)]  # zeros(a, b)
        numel = 1
        for dim in (size if isinstance(size, (tuple, list, torch.Size)) else (size,)):
            numel *= int(dim) if isinstance(dim, int) else 1
        return numel


class TooManyParameters(ValueError):
    """A model being built registers more parameters than :func:`parameter_limit` allows."""


def too_many_parameters(config_path: str, model_name: str, limit: int, source: str, held: int) -> ValueError:
    """The error for a config whose model outgrew :func:`parameter_limit`: the config, the limit, the weights."""
    return ValueError(f"{config_path} describes a {model_name} of more than {limit} parameter tensors, but {source} "
                      f"holds {held}: a count in the config (layers, blocks) exceeds the weights'")


@contextlib.contextmanager
def parameter_limit(limit: Optional[int]):
    """Within the block, building modules that register more than ``limit`` parameters in all raises
    :class:`TooManyParameters` at the first one past it: a configuration whose counts (layers, blocks) exceed
    what its weight files hold stops before it builds them all, even on the meta device (a million layers of
    Python objects); :func:`too_many_parameters` words the error for users. ``None``: no limit."""
    if limit is None:
        yield
        return
    count = 0

    def hook(module: torch.nn.Module, name: str, param: Any) -> None:
        nonlocal count
        count += 1
        if count > limit:
            raise TooManyParameters(f"the model registers more than {limit} parameter tensors")

    handle = torch.nn.modules.module.register_module_parameter_registration_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def tensor_budget(num_tensors: int) -> int:
    """The parameter tensors a model built for a weight file of ``num_tensors`` tensors may register: twice
    those and some more (tied weights, parts a file may omit), far below what a runaway count builds."""
    return 2 * num_tensors + 256


def build_on_meta(model_cls: type, config: Any, max_parameters: Optional[int] = None) -> torch.nn.Module:
    """``model_cls.from_config(config)`` (diffusers), or ``model_cls(config)`` for a transformers model given its
    config object, with its parameters on the meta device: the shapes a configuration asks for, whatever their
    size, without allocating them; at most ``max_parameters`` parameter tensors (:func:`parameter_limit`)."""
    with _LargeFactoriesOnMeta(), warnings.catch_warnings(), parameter_limit(max_parameters):
        warnings.simplefilter("ignore")  # diffusers warns about config keys a class does not take
        if isinstance(config, Mapping):
            return model_cls.from_config(dict(config))
        return model_cls(config)


def check_official_config(config: Any, model_type: str, family: str, required: Mapping[str, Any],
                          size_keys: tuple[str, ...], integer_keys: tuple[str, ...], minimum: int) -> None:
    """The checks every official ``config.json`` reader starts with: ``config`` is a dict whose ``model_type`` (if set)
    is ``model_type`` (case-insensitive), whose settings in ``required`` have the only values the model implements,
    which has every key of ``size_keys``, and whose ``size_keys + integer_keys`` are integers ``>= minimum``. Each
    error names the key and what ``family``'s loader expects."""
    if not isinstance(config, dict):
        raise ValueError(f"config must be a dict (a parsed config.json), got {type(config).__name__}")
    found = config.get("model_type")
    if found is not None and str(found).lower() != model_type.lower():
        raise ValueError(f"config.json sets model_type={found!r}; this loader reads {family} checkpoints "
                         f"(model_type {model_type!r})")
    for key, wanted in required.items():
        if config.get(key) is not None and config[key] != wanted:
            raise ValueError(f"config.json sets {key}={config[key]!r}; the {family} loader implements only {key}={wanted!r}")
    missing = [key for key in size_keys if config.get(key) is None]
    if missing:
        raise ValueError(f"config.json lacks {missing}, needed to build the model")
    kind = "non-negative" if minimum == 0 else "positive" if minimum == 1 else f">= {minimum}"
    for key in size_keys + integer_keys:
        value = config.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < minimum):
            raise ValueError(f"config.json sets {key}={value!r}; it must be a {kind} integer")


def read_json_object(path: str) -> dict[str, Any]:
    """The JSON object in ``path`` (a config file); ``ValueError`` naming the file when it is unreadable or not an object."""
    try:
        with open(path) as handle:
            config = json.load(handle)
    except (OSError, ValueError) as err:
        raise ValueError(f"{path} is not a readable JSON file: {err}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(config).__name__}")
    return config


def check_model_folder(model_cls: type, folder: str | os.PathLike, variant: Optional[str] = None) -> None:
    """Raise ``ValueError`` unless the weights in ``folder`` (safetensors or ``.bin``) fit the model
    ``folder/config.json`` describes (:func:`check_state_dict` on shapes only); nothing is loaded or
    allocated. A folder without a config or without weights is left to the loader, which reports it.

    ``model_cls`` is a diffusers model or a transformers ``PreTrainedModel`` (a unified pipeline's transformer).
    For transformers models, the config fields the weights reveal (:data:`TRANSFORMERS_WEIGHT_FACTS`) are checked
    first, each named with the config's value and the weights', and only the shapes of the keys both sides have
    are compared (transformers renames and ties some keys, and reports missing ones itself). Either way the
    model is built on the meta device with at most :func:`tensor_budget` parameter tensors."""
    folder = os.fspath(folder)
    config_path = os.path.join(folder, "config.json")
    if not os.path.isfile(config_path):
        return
    transformers_model = is_transformers_model(model_cls)
    found = weight_file_shapes(folder, variant, "transformers" if transformers_model else "diffusers")
    if found is None:
        return
    source, tensors = found
    config: Any = read_json_object(config_path)
    if transformers_model:
        config = transformers_config(model_cls, config, config_path)
        check_config_fields(config, tensors, weight_facts(model_cls), config_path, source)
    limit = tensor_budget(len(tensors))
    try:
        model = build_on_meta(model_cls, config, limit)
    except TooManyParameters:
        raise too_many_parameters(config_path, model_cls.__name__, limit, source, len(tensors)) from None
    except (ValueError, TypeError) as err:  # a config the class refuses: its own words
        raise ValueError(f"{config_path} does not describe a valid {model_cls.__name__}: {err}") from None
    except Exception:  # noqa: BLE001 - a constructor that cannot run with meta parameters: left to the loader
        return
    if transformers_model:  # transformers renames some keys and ties others: the shapes of the shared keys
        model = _StateDictView({k: v for k, v in model.state_dict().items() if k in tensors})
        tensors = {k: v for k, v in tensors.items() if k in model.state_dict()}
    check_state_dict(model, tensors, source, f"the model {config_path} describes")


class _StateDictView:
    """Only what :func:`check_state_dict` reads of a model: ``state_dict()``."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]):
        self._tensors = dict(tensors)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self._tensors


def is_transformers_model(model_cls: Any) -> bool:
    """Whether ``model_cls`` is a transformers ``PreTrainedModel`` class."""
    from transformers import PreTrainedModel

    return isinstance(model_cls, type) and issubclass(model_cls, PreTrainedModel)


def transformers_config(model_cls: type, config: Mapping[str, Any], config_path: str) -> Any:
    """``model_cls``'s config object from a ``config.json`` dict (what ``from_pretrained`` builds the model from,
    defaults filled in); a config transformers refuses is a ``ValueError`` naming the file."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return model_cls.config_class.from_dict(dict(config))
    except Exception as err:  # noqa: BLE001 - untrusted values: transformers raises many types
        reason = " ".join(line.strip() for line in str(err).splitlines() if line.strip())[:300] or type(err).__name__
        raise ValueError(f"{config_path} does not describe a valid {model_cls.__name__}: {reason}") from None


# ---- config fields the weight files reveal --------------------------------------------------------------


@dataclass(frozen=True)
class WeightFact:
    """A config field that the weight files reveal, so that a config can be checked against the headers before
    a model is built (and the error names the field).

    ``field`` is a dotted path into the config (``"vq_config.num_embeddings"``). With ``dim`` an integer, the field
    equals dimension ``dim`` of tensor ``key``, and the fact applies when the files hold ``key`` (they may omit
    parts: Lumina-mGPT drops its VQ encoder). With ``dim=None`` the field counts the numbered blocks under the
    prefix ``key`` (``"model.layers."``: ``model.layers.0.*``, ``model.layers.1.*``, ...), and the fact applies
    when the files hold at least one such block (a config counting blocks a file lacks entirely is caught by
    :func:`parameter_limit` and the missing keys).
    """

    field: str
    key: str
    dim: Optional[int] = 0


def _decoder_facts(field_prefix: str, prefix: str, head: str = "lm_head.weight") -> tuple[WeightFact, ...]:
    """The facts of a Llama-style decoder whose config fields sit under ``field_prefix``, its weights under
    ``prefix`` and its output head at ``head``."""
    embed = f"{prefix}embed_tokens.weight"
    return (WeightFact(f"{field_prefix}vocab_size", embed, 0), WeightFact(f"{field_prefix}vocab_size", head, 0),
            WeightFact(f"{field_prefix}hidden_size", embed, 1),
            WeightFact(f"{field_prefix}intermediate_size", f"{prefix}layers.0.mlp.gate_proj.weight", 0),
            WeightFact(f"{field_prefix}num_hidden_layers", f"{prefix}layers.", None))


def _vq_facts(codes_field: str, prefix: str, encoder_blocks: str) -> tuple[WeightFact, ...]:
    """The facts of the VQ image tokenizer inside a unified model, its weights under ``prefix`` and its first
    encoder level's residual blocks under ``prefix + encoder_blocks``."""
    codebook = f"{prefix}quantize.embedding.weight"
    return (WeightFact(f"vq_config.{codes_field}", codebook, 0), WeightFact("vq_config.embed_dim", codebook, 1),
            WeightFact("vq_config.base_channels", f"{prefix}encoder.conv_in.weight", 0),
            WeightFact("vq_config.num_res_blocks", prefix + encoder_blocks, None))


#: Per transformers ``model_type``: the config fields its weights reveal. Key names are those of the files: the
#: in-memory names of transformers 5.x, and for Emu3 also the names its checkpoints are saved under
#: (``text_model.model.*``, ``vqmodel.*``; transformers renames them on load). A fact whose tensor a file lacks
#: does not apply, so listing both forms is safe.
TRANSFORMERS_WEIGHT_FACTS: dict[str, tuple[WeightFact, ...]] = {
    "chameleon": _decoder_facts("", "model.") + _vq_facts("num_embeddings", "model.vqmodel.", "encoder.down.0.block."),
    "emu3": _decoder_facts("text_config.", "text_model.model.", "text_model.lm_head.weight")
    + _decoder_facts("text_config.", "model.text_model.")
    + _vq_facts("codebook_size", "vqmodel.", "encoder.down_block.down.0.block.")
    + _vq_facts("codebook_size", "model.vqmodel.", "encoder.down_block.down.0.block."),
    "janus": _decoder_facts("text_config.", "model.language_model.")
    + _vq_facts("num_embeddings", "model.vqmodel.", "encoder.down.0.block.")
    + (WeightFact("vq_config.num_embeddings", "model.generation_embeddings.weight", 0),
       WeightFact("vq_config.num_embeddings", "model.generation_head.vision_head.weight", 0),
       WeightFact("vision_config.hidden_size", "model.vision_model.embeddings.patch_embedding.weight", 0),
       WeightFact("vision_config.num_hidden_layers", "model.vision_model.encoder.layers.", None)),
}


def weight_facts(model_cls: type) -> tuple[WeightFact, ...]:
    """The :class:`WeightFact` s of a transformers model class (by its config's ``model_type``); none when unknown."""
    return TRANSFORMERS_WEIGHT_FACTS.get(getattr(model_cls.config_class, "model_type", None), ())


def _config_field(config: Any, path: str) -> Any:
    """The value at dotted ``path`` in a config object or dict; None when a step is absent."""
    for name in path.split("."):
        config = config.get(name) if isinstance(config, Mapping) else getattr(config, name, None)
        if config is None:
            return None
    return config


def _blocks(tensors: Mapping[str, torch.Tensor], prefix: str) -> list[int]:
    """The sorted block numbers ``N`` of the tensors named ``prefix + "N." + ...``."""
    found = set()
    for name in tensors:
        head, _, _ = name[len(prefix):].partition(".") if name.startswith(prefix) else ("", "", "")
        if head.isdigit():
            found.add(int(head))
    return sorted(found)


def _fact_mismatch(fact: WeightFact, value: Any, tensors: Mapping[str, torch.Tensor]) -> Optional[str]:
    """Why ``value`` (the config's) contradicts the weights by ``fact``; None when it fits or the fact does not apply."""
    if fact.dim is None:
        blocks = _blocks(tensors, fact.key)
        if not blocks:
            return None
        held = len(blocks)
        evidence = f"{fact.key}{blocks[0]}" + (f" to {fact.key}{blocks[-1]}" if held > 1 else "")
    else:
        if fact.key not in tensors or tensors[fact.key].dim() <= fact.dim:
            return None
        held = int(tensors[fact.key].shape[fact.dim])
        evidence = f"{fact.key} has shape {tuple(tensors[fact.key].shape)}"
    if isinstance(value, int) and not isinstance(value, bool) and value == held:
        return None
    return f"{fact.field} is {value!r} but the weights hold {held} ({evidence})"


def check_config_fields(config: Any, tensors: Mapping[str, torch.Tensor], facts: tuple[WeightFact, ...],
                        config_path: str, source: str) -> None:
    """Raise one ``ValueError`` naming every config field that contradicts the weights (``tensors``: meta tensors
    from the files' headers, :func:`safetensors_header`), by ``facts``: the config's value and the weights'. Run it
    before a model is built: a config asking for 100,000 layers or a 20M-row codebook fails here, allocating nothing."""
    problems: dict[str, str] = {}
    for fact in facts:
        if fact.field in problems:
            continue
        value = _config_field(config, fact.field)
        problem = None if value is None else _fact_mismatch(fact, value, tensors)
        if problem is not None:
            problems[fact.field] = problem
    if problems:
        raise ValueError(f"{config_path} does not match the weights in {source}: " + "; ".join(problems.values()))


class CheckedFromPretrained:
    """A base class for diffusers models (before ``ModelMixin``): ``from_pretrained`` on a local folder first
    checks the folder's weight shapes against its ``config.json`` (:func:`check_model_folder`), so an
    untrusted config cannot make the loader allocate what the file does not hold."""

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        folder = os.path.join(os.fspath(pretrained_model_name_or_path), kwargs.get("subfolder") or "")
        if os.path.isdir(folder):
            check_model_folder(cls, folder, kwargs.get("variant"))
        return super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)


def _component_class(library: Any, class_name: Any) -> Optional[type]:
    """A ``model_index.json`` component's class, for diffusers, transformers and vispec components only (importing
    other libraries named by an untrusted file is left to diffusers' loader); ``None`` when not a diffusers model
    or a transformers ``PreTrainedModel`` (the unified pipeline's transformer)."""
    from diffusers.models.modeling_utils import ModelMixin

    if not isinstance(library, str) or not isinstance(class_name, str):
        return None
    if library not in ("diffusers", "transformers") and not library.startswith("vispec."):
        return None
    try:
        cls = getattr(importlib.import_module(library), class_name, None)
    except Exception:  # noqa: BLE001 - a name the library cannot import (missing backend): left to the loader
        return None
    if not isinstance(cls, type):
        return None
    return cls if issubclass(cls, ModelMixin) or is_transformers_model(cls) else None


def pipeline_kind(folder: str | os.PathLike) -> Optional[str]:
    """The pipeline class name in ``folder/model_index.json`` (the class of a ``[module, class]`` pair); None when
    it is unreadable (:func:`check_pipeline_folder` then says why)."""
    try:
        with open(os.path.join(os.fspath(folder), "model_index.json")) as handle:
            name = json.load(handle).get("_class_name")
    except (OSError, ValueError, AttributeError):
        return None
    return name[-1] if isinstance(name, list) and name else name


def check_pipeline_folder(path: str | os.PathLike, expected_class: Optional[str] = None,
                          hints: Optional[Mapping[str, str]] = None) -> dict[str, Any]:
    """Check a saved pipeline folder before loading it; return its ``model_index.json``.

    ``ValueError`` (naming the folder) when: ``model_index.json`` is unreadable; the pipeline is not
    ``expected_class`` (``hints[found class]`` is appended, e.g. the command for that kind); a component the index
    names has no subfolder; a model component's weights do not fit its config (:func:`check_model_folder`,
    which covers diffusers' own ``VQModel`` and transformers models, the unified pipeline's transformer, too)."""
    folder = os.fspath(path)
    index_path = os.path.join(folder, "model_index.json")
    try:
        with open(index_path) as handle:
            index = json.load(handle)
    except FileNotFoundError:
        raise ValueError(f"{folder} is not a pipeline folder (no model_index.json)") from None
    except (OSError, ValueError) as err:
        raise ValueError(f"{index_path} is not a readable JSON file: {err}") from None
    if not isinstance(index, dict):
        raise ValueError(f"{index_path} must hold a JSON object, got {type(index).__name__}")
    found = index.get("_class_name")
    if isinstance(found, list) and found:  # a pipeline outside diffusers: [module, class name]
        found = found[-1]
    if expected_class is not None and found != expected_class:
        hint = (hints or {}).get(found) if isinstance(found, str) else None
        raise ValueError(f"{folder} holds a {found or 'pipeline of unknown kind'} (model_index.json), not a {expected_class}"
                         + (f": {hint}" if hint else ""))
    for name, spec in index.items():
        if name.startswith("_") or not isinstance(spec, list) or len(spec) != 2 or spec[0] is None:
            continue
        sub = os.path.join(folder, name)
        if not os.path.isdir(sub):
            raise ValueError(f"pipeline folder {folder} lacks the subfolder {name}/ that model_index.json names "
                             f"({spec[0]}.{spec[1]})")
        model_cls = _component_class(*spec)
        if model_cls is not None:
            check_model_folder(model_cls, sub)
    return index


def build_component_on_meta(folder: str | os.PathLike, name: str) -> Optional[torch.nn.Module]:
    """The model component ``name`` of the pipeline folder ``folder`` built from its ``config.json`` on the meta
    device (:func:`build_on_meta`): its class and config, no weights read, nothing allocated. For the checks that
    need a model's family and config but not its weights, before the weights load (a decoding's settings:
    ``MaskedDiffusionLMPipeline.from_pretrained_without_weights``). None when it cannot be built so: no such
    component, a class outside diffusers / transformers / vispec, an unreadable config, a constructor that cannot
    run on meta (the loader then reports what is wrong)."""
    folder = os.fspath(folder)
    try:
        with open(os.path.join(folder, "model_index.json")) as handle:
            spec = json.load(handle).get(name)
        model_cls = _component_class(*spec) if isinstance(spec, list) and len(spec) == 2 else None
        if model_cls is None:
            return None
        config_path = os.path.join(folder, name, "config.json")
        config: Any = read_json_object(config_path)
        transformers_model = is_transformers_model(model_cls)
        if transformers_model:
            config = transformers_config(model_cls, config, config_path)
        found = weight_file_shapes(os.path.join(folder, name), None, "transformers" if transformers_model else "diffusers")
        return build_on_meta(model_cls, config, tensor_budget(len(found[1]) if found else 0))
    except Exception:  # noqa: BLE001 - whatever stops it here stops the real load too, which says why
        return None
