"""``torch.compile`` for decode steps: one compiled callable per step function, shared by every decode.

A step is compiled with static shapes (``dynamic=False``): each (batch slots, padded window) pair is
its own graph, which is also what CUDA graphs need, so windows come from a small fixed set
(:func:`vispec.decoding.windows.window_set`). That is more graphs per step function than dynamo's
default recompile limit holds, so the limit is raised to :data:`RECOMPILE_LIMIT` while a compiled step
runs (``torch._dynamo.config.patch``) and only then: the process's own settings are left as they were.
Compiled steps read nothing back from the device; the decode loop does, once per step.

CUDA graphs (:func:`cuda_graphs`): within that context (this thread or task) steps are compiled with
``mode="reduce-overhead"``, inductor's CUDA-graph trees, a separate set of graphs per step function. Inductor
replays a step as one CUDA graph only where that is safe: on CUDA tensors, and with the tensors a step writes
in place (the KV cache, the token buffer) static inputs. Where it is not, it runs the compiled kernels without a
graph and counts a skip (``torch._dynamo.utils.counters["inductor"]["cudagraph_skips"]``, read by
:func:`cudagraph_skips`), so a run can say whether graphs were replayed. On CPU every step is a skip.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Callable, Iterator

import torch

RECOMPILE_LIMIT = 64

CUDA_GRAPHS_MODE = "reduce-overhead"

_graphs: dict[tuple[Callable, bool, str], Callable] = {}  # one compiled callable per (step, fullgraph, mode)
_outside_mode = contextvars.ContextVar("vispec_compiled_steps_outside_mode", default=False)
_cuda_graphs = contextvars.ContextVar("vispec_compiled_steps_cuda_graphs", default=False)


def compile_mode() -> str:
    """The ``torch.compile`` mode steps compiled now get: ``"default"``, or :data:`CUDA_GRAPHS_MODE` within
    :func:`cuda_graphs`."""
    return CUDA_GRAPHS_MODE if _cuda_graphs.get() else "default"


@contextlib.contextmanager
def cuda_graphs(enabled: bool = True) -> Iterator[None]:
    """Within this context (this thread or task only), steps are compiled and run with ``mode="reduce-overhead"``
    (CUDA graphs, module docstring); ``enabled=False`` leaves the mode as it is outside."""
    token = _cuda_graphs.set(bool(enabled) or _cuda_graphs.get())
    try:
        yield
    finally:
        _cuda_graphs.reset(token)


def cudagraph_skips() -> int:
    """Compiled graphs inductor has run without a CUDA graph so far in this process (module docstring)."""
    from torch._dynamo.utils import counters

    return int(counters["inductor"]["cudagraph_skips"])


def compiled(step: Callable, fullgraph: bool = True) -> Callable:
    """``step`` under ``torch.compile(fullgraph=fullgraph, dynamic=False)`` (within :func:`cuda_graphs`:
    ``mode="reduce-overhead"``), run with dynamo's recompile limit at least :data:`RECOMPILE_LIMIT`; the same
    callable for the same ``(step, fullgraph, mode)`` (one set of graphs)."""
    mode = compile_mode()
    key = (step, fullgraph, mode)
    if key not in _graphs:
        graph = torch.compile(step, fullgraph=fullgraph, dynamic=False, mode=None if mode == "default" else mode)

        def run(*args: Any, **kwargs: Any) -> Any:
            config = torch._dynamo.config
            with config.patch(recompile_limit=max(config.recompile_limit, RECOMPILE_LIMIT)):
                if fullgraph and _outside_mode.get():
                    with torch.overrides._pop_mode_temporarily():
                        return graph(*args, **kwargs)
                return graph(*args, **kwargs)

        _graphs[key] = run
    return _graphs[key]


@contextlib.contextmanager
def outside_torch_function_mode() -> Iterator[None]:
    """Within this context (this thread or task only), ``fullgraph`` compiled steps run with the innermost
    torch-function mode suspended.

    For counting host syncs (:class:`vispec.profiling.HostSyncCounter` is such a mode): dynamo guards on
    the mode stack, so a compiled step called under the counter would recompile every step graph once
    more only to find what ``fullgraph=True`` already guarantees (no graph break, so nothing read back).
    Steps compiled without ``fullgraph`` (lossy acceptance rules) may break their graph, so they stay
    under the mode (counted, and recompiled)."""
    token = _outside_mode.set(True)
    try:
        yield
    finally:
        _outside_mode.reset(token)
