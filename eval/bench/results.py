"""Per-item results on disk: written as each unit of work finishes, read back for the report, skipped on a rerun.

Layout under a run folder (``--results-dir``)::

    run.json                          the settings the results depend on (a rerun with others is refused)
    <group>/<index:08d>.safetensors   an item's tensors (tokens, an image, evaluator features), when it has any
    <group>/<index:08d>.json          its record (stats, scores); written last, so it marks the item complete

A group is one decoding setting of a benchmark (``ar``, ``mc-sjd``, ``ar-reseed-1``, ...). Every file is
written to a temporary name in its folder and renamed over the target, so a process killed in the middle
leaves either the whole item or none of it: a rerun recomputes only the units that are not complete (and
recomputes each whole, :mod:`vispec.eval.bench.distributed`), so it ends with the same results as an uninterrupted
run. Several processes may write into one run folder (on a shared file system across nodes): each writes
only its own units' items.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from typing import Any, Iterable, Optional

from torch import Tensor

from vispec.eval.bench.report import atomic_write

_SAFE = re.compile(r"[^A-Za-z0-9._-]+")


def group_folder(name: str) -> str:
    """A folder name for the group ``name``: the name with unsafe characters replaced, and a short hash of the
    original when anything was replaced (``mc-sjd+lantern:k=100`` and ``mc-sjd+lantern:k=10,0`` stay apart)."""
    safe = _SAFE.sub("_", name)
    if safe == name:
        return name
    return f"{safe}-{hashlib.sha1(name.encode()).hexdigest()[:8]}"


def _write_text(path: str, text: str) -> None:
    with open(path, "w") as handle:
        handle.write(text)


def _json_text(obj: Any) -> str:
    return json.dumps(obj, indent=1, sort_keys=True, allow_nan=True)


def settings_record(path: str, settings: dict, flag: str, where: str, create: bool = True) -> dict:
    """The settings a run's stored items were made with, kept at ``path`` (JSON): written when missing
    (``create``), compared when present. Other settings are refused, naming the ones that differ: the stored
    items would silently mix two runs. Returns the settings as they read back (tuples become lists)."""
    settings = json.loads(_json_text(settings))
    if os.path.exists(path):
        with open(path) as handle:
            stored = json.load(handle)
        if stored != settings:
            keys = sorted(k for k in stored.keys() | settings.keys() if stored.get(k) != settings.get(k))
            raise ValueError(f"{flag} {where!r} holds results of other settings (differing: {', '.join(keys)}); "
                             f"pass another {flag}, or delete them to start over")
    elif create:
        atomic_write(path, lambda tmp: _write_text(tmp, _json_text(settings)))
    else:
        raise FileNotFoundError(f"{path} is missing (the main process writes it first)")
    return settings


class ResultStore:
    """The per-item results of one run (module docstring).

    Args:
        root: the run folder; created when missing.
        settings: what the results depend on (JSON-able). A folder whose ``run.json`` holds other settings is
            refused, naming the settings that differ: its items would silently mix two runs.
        create: write ``run.json`` when it is missing (the main process; the others open it after a barrier).
    """

    def __init__(self, root: str, settings: dict, create: bool = True):
        self.root = root
        if os.path.exists(root) and not os.path.isdir(root):
            raise ValueError(f"results_dir must be a folder, and {root!r} is a file")
        if create:
            os.makedirs(root, exist_ok=True)
        self.settings = settings_record(os.path.join(root, "run.json"), settings, "results_dir", root, create=create)

    def _path(self, group: str, index: int, ext: str) -> str:
        return os.path.join(self.root, group_folder(group), f"{index:08d}.{ext}")

    def has(self, group: str, index: int) -> bool:
        return os.path.exists(self._path(group, index, "json"))

    def has_all(self, group: str, indices: Iterable[int]) -> bool:
        return all(self.has(group, i) for i in indices)

    def write(self, group: str, index: int, record: dict, tensors: Optional[dict[str, Tensor]] = None) -> None:
        """Store item ``index`` of ``group``: its tensors first, then its record (which marks it complete)."""
        from safetensors.torch import save_file

        os.makedirs(os.path.join(self.root, group_folder(group)), exist_ok=True)
        if tensors:
            contiguous = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
            atomic_write(self._path(group, index, "safetensors"), lambda tmp: save_file(contiguous, tmp))
        record = {**record, "tensors": sorted(tensors) if tensors else []}
        atomic_write(self._path(group, index, "json"), lambda tmp: _write_text(tmp, _json_text(record)))

    def read(self, group: str, index: int) -> tuple[dict, dict[str, Tensor]]:
        """Item ``index``'s record and tensors (``FileNotFoundError`` when it is not complete)."""
        from safetensors.torch import load_file

        path = self._path(group, index, "json")
        if not os.path.exists(path):
            raise FileNotFoundError(f"item {index} of {group!r} is not in {self.root}")
        with open(path) as handle:
            record = json.load(handle)
        names = record.pop("tensors")
        tensors = load_file(self._path(group, index, "safetensors")) if names else {}
        return record, tensors
