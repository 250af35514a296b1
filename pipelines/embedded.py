"""The models vispec ships as package data, and how a model name becomes a local pipeline folder."""

from __future__ import annotations

import os
from importlib import resources
from typing import Union

# public name -> folder under vispec/models/pretrained
EMBEDDED_MODELS = {"vispec/tiny-c2i": "tiny-c2i", "vispec/tiny-mdlm": "tiny-mdlm", "vispec/tiny-mdlm-long": "tiny-mdlm-long", "vispec/tiny-t2i": "tiny-t2i",
                   "vispec/tiny-edit": "tiny-edit", "vispec/tiny-llada2": "tiny-llada2"}


def resolve_model_path(name_or_path: Union[str, os.PathLike]) -> str:
    """A local pipeline folder for an embedded model name (``"vispec/tiny-c2i"`` or ``"tiny-c2i"``) or a path."""
    name = os.fspath(name_or_path)
    if os.path.isdir(name):
        if not os.path.isfile(os.path.join(name, "model_index.json")):
            raise ValueError(f"{name} is not a pipeline folder (no model_index.json)")
        return name
    key = name if name in EMBEDDED_MODELS else f"vispec/{name}"
    if key in EMBEDDED_MODELS:
        path = resources.files("vispec.models") / "pretrained" / EMBEDDED_MODELS[key]
        if not (path / "model_index.json").is_file():
            raise ValueError(f"embedded model {name!r} is not installed with this copy of vispec (expected {path})")
        return str(path)
    raise ValueError(
        f"unknown model {name!r}: expected a local pipeline folder or one of {sorted(EMBEDDED_MODELS)} "
        "(vispec never downloads weights; convert official checkpoints with `vispec convert`)"
    )
