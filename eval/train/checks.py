"""The checks of the trainer configs (:mod:`vispec.eval.train.configs`), without torch: ``vispec train MODEL`` checks
its flags (and prints its ``--help``) before torch, diffusers, transformers or the models are imported.

Every trainer config has ``validate(name=field_name)``: each field checked before any work (no data made, no model
built, no folder written), a ``ValueError`` naming the field as ``name(field)`` says, which is the field itself in
Python and its flag (``--batch-size``) on the command line (:mod:`vispec.cli.train`). The trainers call it first.

The configs that define a model also refuse sizes that cannot be trained here (:func:`check_training_memory`):
parameters at :data:`BYTES_PER_PARAMETER` bytes each plus rough activation and data terms, in plain integer
arithmetic from the fields, against the machine's memory (:func:`total_memory`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any, Callable, NamedTuple, Optional

from vispec.checks import check_int, check_number, writable_ancestor

# how a check calls a config field: the field itself (Python), or the flag that sets it (the command line)
Namer = Callable[[str], str]
MAX_SEED = 2**32 - 1  # numpy's and most tools' seed range; seeds offset by small counts stay in torch's
# fp32 weights, their gradients and AdamW's (or Adam's) two moments: 4 bytes each
BYTES_PER_PARAMETER = 16
# torch.set_num_threads takes a C int (2**40 overflows inside torch); past a thousand threads the pool is absurd on
# any CPU (the largest have a few hundred hardware threads)
MAX_THREADS = 1024


def field_name(field: str) -> str:
    """The default :data:`Namer`: errors name the config field itself."""
    return field


def check_fields(cfg: Any, name: Namer = field_name, *, counts: tuple[str, ...] = (), non_negative: tuple[str, ...] = (),
                 positive: tuple[str, ...] = (), non_negative_numbers: tuple[str, ...] = (),
                 fractions: tuple[str, ...] = ()) -> None:
    """Range checks of ``cfg``'s fields, each error naming ``name(field)``: ``counts`` integers >= 1, ``non_negative``
    integers >= 0 (0 usually meaning "off" or "the default"), ``positive`` finite numbers > 0,
    ``non_negative_numbers`` finite numbers >= 0, ``fractions`` probabilities in [0, 1)."""
    for field in counts:
        check_int(name(field), getattr(cfg, field), minimum=1)
    for field in non_negative:
        check_int(name(field), getattr(cfg, field), minimum=0)
    for field in positive:
        check_number(name(field), getattr(cfg, field), minimum=0, exclusive_minimum=True)
    for field in non_negative_numbers:
        check_number(name(field), getattr(cfg, field), minimum=0)
    for field in fractions:
        value = getattr(cfg, field)
        check_number(name(field), value, minimum=0, maximum=1)
        if value == 1:
            raise ValueError(f"{name(field)} must be a probability in [0, 1) (1 would drop every one), got {value!r}")


def check_common(cfg: Any, name: Namer = field_name) -> None:
    """The fields most trainers share, where ``cfg`` has them: ``out`` (a folder that can be made and written,
    :func:`check_output_folder`), ``seed`` (in [0, :data:`MAX_SEED`]), ``steps``, ``batch_size`` and ``log_every``
    (>= 1), ``lr`` (> 0) and ``weight_decay`` (>= 0)."""
    if hasattr(cfg, "out"):
        check_output_folder(cfg, "out", name)
    if hasattr(cfg, "seed") and check_int(name("seed"), cfg.seed, minimum=0) > MAX_SEED:
        raise ValueError(f"{name('seed')} must be an integer in [0, {MAX_SEED}], got {cfg.seed}")
    check_fields(cfg, name, counts=tuple(f for f in ("steps", "batch_size", "log_every") if hasattr(cfg, f)),
                 positive=("lr",) if hasattr(cfg, "lr") else (),
                 non_negative_numbers=("weight_decay",) if hasattr(cfg, "weight_decay") else ())


def check_threads(cfg: Any, name: Namer = field_name, *, minimum: int = 0) -> None:
    """``cfg.threads`` in [``minimum``, :data:`MAX_THREADS`] (0, where allowed, leaves torch's setting as is)."""
    check_int(name("threads"), cfg.threads, minimum=minimum, maximum=MAX_THREADS,
              hint=" (0 leaves torch's setting)" if minimum == 0 else "")


def check_folder(cfg: Any, field: str, name: Namer = field_name, *, holds: str = "", what: str = "a folder") -> None:
    """``cfg.<field>`` must be an existing folder (holding the file ``holds``, when given); the error names
    ``name(field)``, the path and ``what`` was expected there. Nothing is looked up online."""
    path = getattr(cfg, field)
    if not isinstance(path, str) or not path:
        raise ValueError(f"{name(field)} must be {what}, got {path!r}")
    if not os.path.isdir(path):
        why = "is not a folder" if os.path.exists(path) else "does not exist"
        raise ValueError(f"{name(field)} {path!r} {why}; expected {what}")
    if holds and not os.path.isfile(os.path.join(path, holds)):
        raise ValueError(f"{name(field)} {path!r} has no {holds}; expected {what}")


def check_output_folder(cfg: Any, field: str = "out", name: Namer = field_name) -> None:
    """``cfg.<field>`` must be a folder a trainer can write: an existing folder, or a path whose missing folders can
    be made (:func:`vispec.checks.writable_ancestor`: probed, not read from permission bits). The error names
    ``name(field)``, the path and the reason."""
    path = getattr(cfg, field)
    if not isinstance(path, str) or not path:
        raise ValueError(f"{name(field)} must be a folder path, got {path!r}")
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"{name(field)} {path!r} is a file; expected a folder")
    writable_ancestor(path, name(field), path)


def check_choice(cfg: Any, field: str, choices: tuple[str, ...], name: Namer = field_name) -> None:
    """``cfg.<field>`` must be one of ``choices``."""
    if getattr(cfg, field) not in choices:
        raise ValueError(f"{name(field)} must be one of {', '.join(choices)}, got {getattr(cfg, field)!r}")


def check_heads(cfg: Any, dim: str, heads: str, name: Namer = field_name, *, multiple: int = 2) -> None:
    """``cfg.<dim>`` must split into ``cfg.<heads>`` heads whose size is a multiple of ``multiple`` (RoPE rotates
    pairs; LlamaGen's 2-D RoPE needs 4)."""
    width, count = getattr(cfg, dim), getattr(cfg, heads)
    if width % count or (width // count) % multiple:
        raise ValueError(f"{name(dim)} ({width}) must split into {name(heads)} ({count}) heads whose size is a "
                         f"multiple of {multiple}")


def check_pipeline_name(cfg: Any, field: str, name: Namer = field_name, expected: Optional[str] = None) -> None:
    """``cfg.<field>`` must be an embedded model name or a local pipeline folder (nothing is downloaded), and with
    ``expected`` a pipeline of that class (its ``model_index.json``). This check imports :mod:`vispec.pipelines` (and
    torch): configs run it after their torch-free checks."""
    from vispec.pipelines.embedded import resolve_model_path

    value = getattr(cfg, field)
    try:
        folder = resolve_model_path(value)
    except (ValueError, TypeError) as err:
        raise ValueError(f"{name(field)}: {err}") from None
    if expected is None:
        return
    try:
        with open(os.path.join(folder, "model_index.json")) as handle:
            found = json.load(handle).get("_class_name")
    except (OSError, ValueError, AttributeError):
        found = None
    found = found[-1] if isinstance(found, list) and found else found
    if found != expected:
        raise ValueError(f"{name(field)} {value!r} is a {found or 'folder of unknown kind'}, not a {expected} (an image "
                         f"model such as tiny-c2i)" if expected == "LlamaGenPipeline" else
                         f"{name(field)} {value!r} is a {found or 'folder of unknown kind'}, not a {expected}")


def check_decoding_defaults(cfg: Any, name: Namer = field_name, *, strategy: str = "mc-sjd") -> None:
    """The sampling and window defaults an assembler stores in a pipeline (``guidance_scale``, ``temperature``,
    ``top_k``, ``top_p``, ``window``, ``init`` where present) as :class:`~vispec.decoding.DecodingConfig` checks
    them, the error naming ``name(field)``. This check imports :mod:`vispec.decoding` (and torch): configs run it
    after their torch-free checks."""
    from vispec.decoding import DecodingConfig

    keys = [k for k in ("window", "init", "guidance_scale", "temperature", "top_k", "top_p") if hasattr(cfg, k)]
    try:
        DecodingConfig(strategy=strategy, **{k: getattr(cfg, k) for k in keys})
    except ValueError as err:
        message = str(err)
        field = next((k for k in keys if message.startswith(k)), None)
        if field is None:
            raise
        raise ValueError(name(field) + message[len(field):]) from None


# ---- memory ----------------------------------------------------------------------------------------------------

class Footprint(NamedTuple):
    """A config's training size: ``parameters`` (each :data:`BYTES_PER_PARAMETER` bytes to train), ``other_bytes``
    (rough activations of one step and the data held in memory) and the ``fields`` that set them."""

    parameters: int
    other_bytes: int
    fields: tuple[str, ...]

    @property
    def bytes(self) -> int:
        return self.parameters * BYTES_PER_PARAMETER + self.other_bytes


def check_device_present(device: str, flag: str) -> None:
    """A ``cuda[:N]`` device (``flag``: the field or flag that named it) exists on this machine (torch is imported only
    to ask); ``cpu`` always does."""
    if not device.startswith("cuda"):
        return
    import torch

    if not torch.cuda.is_available():
        raise ValueError(f"{flag} {device}, but CUDA is not available here (torch {torch.__version__}); use {flag} cpu")
    index = int(device.partition(":")[2] or 0)
    if index >= torch.cuda.device_count():
        raise ValueError(f"{flag} {device}, but this machine has {torch.cuda.device_count()} CUDA device(s)")


def native_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 natively (AVX512-BF16 or AMX, as oneDNN reports); the training scripts
    ask it before passing ``--bf16``."""
    import torch

    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def check_bf16(cfg: Any, name: Namer = field_name) -> None:
    """``cfg.bf16`` (matrix products under bfloat16 autocast) only where the CPU multiplies bfloat16 natively
    (:func:`native_bf16`): there it speeds a step up (1.4-1.9x for tiny-t2i on 2 cores), elsewhere it slows it down.
    torch is imported only when the switch is on."""
    if not cfg.bf16:
        return
    if not native_bf16():
        raise ValueError(f"{name('bf16')}: this CPU has no native bfloat16 matrix products (AVX512-BF16 or AMX), "
                         "where autocast would slow training down; train without it")


def total_memory() -> Optional[int]:
    """The machine's memory in bytes (``os.sysconf``), or None where it cannot be read (then nothing is refused)."""
    try:
        pages, page = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None
    return pages * page if pages > 0 and page > 0 else None


def approx(count: int) -> str:
    """``count`` (an integer >= 0, however large) in short scientific notation: ``4e18``, ``1.6e19``; below 10,000
    as it is."""
    if count < 10_000:
        return str(count)
    exponent = int(math.log10(count))
    while 10**exponent > count:  # log10 rounds up just below a power of ten
        exponent -= 1
    mantissa = round(count / 10**exponent, 1)
    if mantissa >= 10:
        mantissa, exponent = 1.0, exponent + 1
    return f"{mantissa:g}e{exponent}"


def _shown(value: Any) -> str:
    """A field's value as the user typed it: lists comma-separated, huge integers in scientific notation."""
    if isinstance(value, tuple):
        return ",".join(_shown(v) for v in value)
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**15:
        return ("-" if value < 0 else "") + approx(abs(value))
    return str(value)


def check_training_memory(cfg: Any, footprint: Footprint, name: Namer = field_name) -> None:
    """Refuse ``cfg`` when ``footprint.bytes`` exceeds the machine's memory (:func:`total_memory`), naming the
    fields that set the size: those changed from their defaults first, the others after "with"."""
    memory = total_memory()
    if memory is None or footprint.bytes <= memory:
        return
    defaults = {f.name: f.default for f in dataclasses.fields(cfg)}
    changed = [f for f in footprint.fields if getattr(cfg, f) != defaults.get(f)]
    rest = [f for f in footprint.fields if f not in changed]

    def listed(fields: list[str]) -> str:
        return ", ".join(f"{name(f)} {_shown(getattr(cfg, f))}" for f in fields)

    sizes = f"{listed(changed)} (with {listed(rest)})" if changed and rest else listed(changed or rest)
    raise ValueError(
        f"{sizes} gives ~{approx(footprint.parameters)} parameters and ~{approx(footprint.other_bytes)} bytes of "
        f"activations and data: ~{approx(footprint.bytes)} bytes to train ({BYTES_PER_PARAMETER} per parameter for "
        f"fp32 weights, gradients and AdamW's two moments); this machine has {memory / 2**30:.1f} GiB of memory")
