"""Which cache class serves a ``cache=`` mode for a model: :data:`vispec.dllm.caches.CACHE_CLASSES`, or for
encoder/decoder canvas models with uniform corruption their own (:data:`vispec.dllm.uniform.CANVAS_CACHES`, built on
the former)."""

from __future__ import annotations

from typing import Any

from vispec.dllm.caches import CACHE_CLASSES
from vispec.dllm.uniform import CANVAS_CACHES


def cache_class(model: Any, mode: str) -> type:
    """The cache class of ``mode`` for ``model``: :data:`CACHE_CLASSES`, or for encoder/decoder canvas models with
    uniform corruption (``model.uniform_corruption``, DiffusionGemma) their own (:mod:`vispec.dllm.uniform`)."""
    classes = CACHE_CLASSES
    if getattr(model, "uniform_corruption", False):
        classes = CANVAS_CACHES
    if mode not in classes:
        raise ValueError(f"cache={mode!r} is not available for {type(model).__name__} (its modes: {tuple(classes)})")
    return classes[mode]
