"""Which implementation a dispatch function runs: the Triton kernel or the PyTorch reference.

``backend="auto"`` (the default everywhere) sends CUDA tensors to Triton when it is installed and
everything else to the reference. ``"triton"`` forces the kernel (CUDA tensors, or any tensors
when ``TRITON_INTERPRET=1`` runs kernels in Triton's interpreter, as the tests do); ``"reference"``
forces PyTorch. The environment variable ``VISPEC_KERNELS`` (``auto``, ``triton`` or
``reference``) changes the default for every call that leaves ``backend`` at ``"auto"``.

Inside a ``torch.compile``'d graph (the compiled decode steps) ``"auto"`` picks the reference: Inductor compiles
the PyTorch reference into its own fused Triton kernels, where a hand-written kernel would be an opaque call that
splits the graph. Eager CUDA calls keep the hand-written kernels.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Literal

import torch

Backend = Literal["auto", "triton", "reference"]
BACKENDS = ("auto", "triton", "reference")
ENV_VAR = "VISPEC_KERNELS"


_TRITON_INSTALLED = importlib.util.find_spec("triton") is not None  # looked up once: dynamo cannot trace find_spec


def triton_available() -> bool:
    """True when the ``triton`` package can be imported (looked up once, at import)."""
    return _TRITON_INSTALLED


def interpreter_enabled() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def check_backend(backend: str, name: str = "backend") -> str:
    if backend not in BACKENDS:
        raise ValueError(f"{name} must be one of {BACKENDS}, got {backend!r}")
    return backend


def resolve_backend(backend: str, *tensors: torch.Tensor) -> Literal["triton", "reference"]:
    """The implementation to run for ``tensors`` (see the module docstring).

    Raises ``ValueError`` when ``"triton"`` is forced where no kernel can run.
    """
    check_backend(backend)
    if backend == "auto":
        backend = check_backend(os.environ.get(ENV_VAR, "auto").strip().lower() or "auto", ENV_VAR)
    on_cuda = all(t.is_cuda for t in tensors if t is not None)
    if backend == "reference":
        return "reference"
    if backend == "auto":
        if torch.compiler.is_compiling():  # Inductor fuses the reference itself (module docstring)
            return "reference"
        return "triton" if on_cuda and triton_available() else "reference"
    if not triton_available():
        raise ValueError("backend='triton' needs the triton package (pip install 'vispec[triton]')")
    if not on_cuda and not interpreter_enabled():
        raise ValueError(
            "backend='triton' needs CUDA tensors, or TRITON_INTERPRET=1 set before vispec.kernels is imported "
            "to run the kernels in Triton's CPU interpreter"
        )
    return "triton"
