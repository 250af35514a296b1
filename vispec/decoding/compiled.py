"""``torch.compile`` for decode steps: one compiled callable per step function, shared by every decode.

A step is compiled with static shapes (``dynamic=False``): each (batch slots, padded window) pair is
its own graph, which is also what CUDA graphs need, so windows come from a small fixed set
(:func:`vispec.decoding.windows.window_set`) and the recompile limit is raised to hold them. Compiled
steps read nothing back from the device; the decode loop does, once per step.
"""

from __future__ import annotations

from typing import Callable

import torch

_COMPILED: dict[tuple[Callable, bool], Callable] = {}
RECOMPILE_LIMIT = 64


def compiled(step: Callable, fullgraph: bool = True) -> Callable:
    """``step`` under ``torch.compile(fullgraph=fullgraph, dynamic=False)``, compiled once per process."""
    key = (step, fullgraph)
    if key not in _COMPILED:
        config = torch._dynamo.config
        for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit", "accumulated_cache_size_limit"):
            if hasattr(config, name):
                setattr(config, name, max(getattr(config, name), RECOMPILE_LIMIT))
        _COMPILED[key] = torch.compile(step, fullgraph=fullgraph, dynamic=False)
    return _COMPILED[key]
