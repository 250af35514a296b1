"""Counting host synchronisations: the calls that make the host wait for a tensor's value.

A decode step that reads values back from the device (``bool(t.any())``, ``int(t.max())``, ``.item()``,
``.tolist()``, ``.cpu()``, ``nonzero`` and boolean-mask indexing, whose output shape depends on the
data) stalls a GPU pipeline and breaks ``torch.compile(fullgraph=True)`` graphs. :class:`HostSyncCounter`
counts them through a :class:`torch.overrides.TorchFunctionMode`, on any device (on the CPU the same
calls are the points where a CUDA run would wait), so tests and benchmarks can state syncs per step.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Callable

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode

# functions whose result is a host value, or whose output shape depends on tensor values
_READ_BACK = {"__bool__", "__int__", "__float__", "__index__", "__complex__", "item", "tolist", "cpu", "numpy",
              "nonzero", "argwhere", "masked_select", "unique", "unique_consecutive", "equal", "allclose", "bincount"}


def _name(func: Callable) -> str:
    return getattr(func, "__name__", str(func))


def _is_sync(name: str, args: tuple, kwargs: dict) -> bool:
    if name in _READ_BACK:
        return True
    if name == "where":  # one-argument torch.where is nonzero
        return len(args) + len(kwargs) == 1
    if name == "to":  # a copy to the host
        target = kwargs.get("device", args[1] if len(args) > 1 else None)
        return (isinstance(target, (str, torch.device)) and torch.device(target).type == "cpu"
                and isinstance(args[0], Tensor) and args[0].device.type != "cpu")
    if name == "__getitem__" and len(args) > 1:  # boolean-mask indexing
        index = args[1] if isinstance(args[1], tuple) else (args[1],)
        return any(isinstance(i, Tensor) and i.dtype == torch.bool for i in index)
    return False


class HostSyncCounter(TorchFunctionMode):
    """Context manager counting host synchronisations (module docstring).

    ``counter.total`` is the number seen, ``counter.by_name`` how many of each kind::

        with HostSyncCounter() as syncs:
            out = decode(model, condition, num_tokens=256, decoding="mc-sjd")
        syncs.total / out.stats.nfe.max()
    """

    def __init__(self) -> None:
        super().__init__()
        self.by_name: Counter[str] = Counter()

    @property
    def total(self) -> int:
        return sum(self.by_name.values())

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = _name(func)
        if _is_sync(name, args, kwargs):
            self.by_name[name] += 1
        return func(*args, **kwargs)
