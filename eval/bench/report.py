"""What every ``vispec bench`` command ends with: the table on stdout, the JSON result on disk, and
the environment block its JSON records (torch version, threads, machine, device name)."""

from __future__ import annotations

import json
import platform
from typing import Optional

import torch


def environment(device: torch.device | str) -> dict:
    """``torch``, ``threads``, ``machine`` and ``device_name`` (the GPU's name on CUDA, the processor's otherwise)."""
    device = torch.device(device)
    return {"torch": torch.__version__, "threads": torch.get_num_threads(), "machine": platform.machine(),
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda"
            else platform.processor() or platform.machine() or "cpu"}


def write_json(result: dict, path: Optional[str]) -> None:
    if path:
        with open(path, "w") as handle:
            json.dump(result, handle, indent=2)


def emit(table: str, result: dict, path: Optional[str]) -> None:
    """Print ``table``; write ``result`` as JSON to ``path`` (when given) and say so."""
    print(table)
    write_json(result, path)
    if path:
        print(f"wrote {path}")
