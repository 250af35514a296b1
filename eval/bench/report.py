"""What every ``vispec bench`` command ends with: the table on stdout, the JSON result on disk, and
the environment block its JSON records (torch version, threads, machine, device name).

Benchmarks hand their result to a ``partial`` callback after every measured row or phase, and the CLI
writes it at once (:func:`write_partial`), so Ctrl-C or a late error keeps what was measured: such a
file carries ``"complete": false``; the final write (:func:`emit`) replaces it with the whole result.
Every write goes to a temporary file in the same folder and is renamed over the target, so a reader
(or a kill in the middle of a write) never sees half a file.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
from typing import Callable, Optional

import torch


def check_device(name: str) -> torch.device:
    """``name`` as a device this process can use: ``ValueError`` for a name torch does not know (``"gpu"``)
    or a CUDA device without CUDA (torch's own errors are a ``RuntimeError`` and an ``AssertionError``)."""
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        raise ValueError(f"device must be cpu, cuda or cuda:N (a torch device), got {name!r}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={name!r} but CUDA is not available here (torch {torch.__version__})")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ValueError(f"device={name!r} but there are {torch.cuda.device_count()} CUDA device(s)")
    return device


def environment(device: torch.device | str) -> dict:
    """``torch``, ``threads``, ``machine`` and ``device_name`` (the GPU's name on CUDA, the processor's otherwise)."""
    device = torch.device(device)
    return {"torch": torch.__version__, "threads": torch.get_num_threads(), "machine": platform.machine(),
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda"
            else platform.processor() or platform.machine() or "cpu"}


def atomic_write(path: str, write: Callable[[str], object]) -> None:
    """``write(temporary)`` to a temporary file in ``path``'s folder (keeping its extension, which some writers read
    the format from), then rename it over ``path``: a reader, or a kill in the middle, never sees half a file."""
    folder, name = os.path.split(os.path.abspath(path))
    stem, ext = os.path.splitext(name)
    temporary = os.path.join(folder, f".{stem}.{os.getpid()}.tmp{ext}")  # same folder: the rename is atomic
    try:
        write(temporary)
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise


def write_json(result: dict, path: Optional[str]) -> None:
    """``result`` as JSON at ``path`` (when given), atomically (:func:`atomic_write`)."""
    if not path:
        return

    def dump(temporary: str) -> None:
        with open(temporary, "w") as handle:
            json.dump(result, handle, indent=2)

    atomic_write(path, dump)


def write_partial(result: dict, path: Optional[str]) -> None:
    """What a benchmark has measured so far, marked ``"complete": false`` (module docstring)."""
    write_json({"complete": False, **result}, path)


def emit(table: str, result: dict, path: Optional[str]) -> None:
    """Print ``table``; write ``result`` as JSON to ``path`` (when given) and say so."""
    print(table)
    write_json(result, path)
    if path:
        print(f"wrote {path}")
