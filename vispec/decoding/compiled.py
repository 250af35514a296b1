"""``torch.compile`` for decode steps: one compiled callable per step function, shared by every decode.

A step is compiled with static shapes (``dynamic=False``): each (batch slots, padded window) pair is
its own graph, which is also what CUDA graphs need, so windows come from a small fixed set
(:func:`vispec.decoding.windows.window_set`). That is more graphs per step function than dynamo's
default recompile limit holds, so the limit is raised to :data:`RECOMPILE_LIMIT` while a compiled step
runs (``torch._dynamo.config.patch``) and only then: the process's own settings are left as they were.
Compiled steps read nothing back from the device; the decode loop does, once per step.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Callable, Iterator

import torch

RECOMPILE_LIMIT = 64

_graphs: dict[tuple[Callable, bool], Callable] = {}  # one compiled callable per (step, fullgraph)
_outside_mode = contextvars.ContextVar("vispec_compiled_steps_outside_mode", default=False)


def compiled(step: Callable, fullgraph: bool = True) -> Callable:
    """``step`` under ``torch.compile(fullgraph=fullgraph, dynamic=False)``, run with dynamo's recompile limit
    at least :data:`RECOMPILE_LIMIT`; the same callable for the same ``(step, fullgraph)`` (one set of graphs)."""
    key = (step, fullgraph)
    if key not in _graphs:
        graph = torch.compile(step, fullgraph=fullgraph, dynamic=False)

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
