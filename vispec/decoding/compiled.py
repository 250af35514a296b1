"""``torch.compile`` for decode steps: one compiled callable per step function, shared by every decode.

A step is compiled with static shapes (``dynamic=False``): each (batch slots, padded window) pair is
its own graph, which is also what CUDA graphs need, so windows come from a small fixed set
(:func:`vispec.decoding.windows.window_set`). That is more graphs per step function than dynamo's
default recompile limit holds, so the limit is raised to :data:`RECOMPILE_LIMIT` while a compiled step
runs (``torch._dynamo.config.patch``) and only then: the process's own settings are left as they were.
Compiled steps read nothing back from the device; the decode loop does, once per step.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch

RECOMPILE_LIMIT = 64


def compiled(step: Callable, fullgraph: bool = True) -> Callable:
    """``step`` under ``torch.compile(fullgraph=fullgraph, dynamic=False)``, run with dynamo's recompile limit
    at least :data:`RECOMPILE_LIMIT`; the same callable for the same ``(step, fullgraph)`` (one set of graphs)."""
    return compile_step(step, fullgraph)


@functools.cache
def compile_step(step: Callable, fullgraph: bool) -> Callable:
    """The one cached compile behind :func:`compiled` (benchmarks may wrap it to run steps under other modes)."""
    graph = torch.compile(step, fullgraph=fullgraph, dynamic=False)

    @functools.wraps(step)
    def run(*args: Any, **kwargs: Any) -> Any:
        config = torch._dynamo.config
        with config.patch(recompile_limit=max(config.recompile_limit, RECOMPILE_LIMIT)):
            return graph(*args, **kwargs)

    return run
