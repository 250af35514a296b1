"""Where a model computes under accelerate's offload hooks (diffusers' ``enable_*_cpu_offload``).

``enable_sequential_cpu_offload`` parks every weight on the ``meta`` device and loads it only for the forward
of the leaf module that owns it, so ``weight.device`` no longer says where tensors must be created and a
weight read outside a forward has no values. These helpers ask the module's hook instead. Without
accelerate, or without hooks, they are plain attribute reads.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn


def hook_execution_device(module: nn.Module) -> Optional[torch.device]:
    """The execution device of ``module``'s accelerate hook (a ``SequentialHook`` is searched), or None."""
    hook = getattr(module, "_hf_hook", None)
    for part in getattr(hook, "hooks", (hook,)):
        device = getattr(part, "execution_device", None)
        if device is not None:
            return torch.device(device)
    return None


def weight_device(module: nn.Module, weight: Tensor) -> torch.device:
    """Where ``module`` (owning ``weight``) computes: the weight's device, or the hook's execution device
    while sequential offload keeps the weight on ``meta``."""
    if weight.device.type == "meta":
        return hook_execution_device(module) or weight.device
    return weight.device


def materialized(module: nn.Module, name: str = "weight") -> Tensor:
    """``module.<name>`` with values: read from the offload hook's weights map (on its execution device)
    while sequential offload keeps the parameter on ``meta``; the parameter itself otherwise."""
    tensor = getattr(module, name)
    if tensor.device.type != "meta":
        return tensor
    hook = getattr(module, "_hf_hook", None)
    for part in getattr(hook, "hooks", (hook,)):
        weights = getattr(part, "weights_map", None)
        if weights is not None and name in weights:
            return weights[name].to(hook_execution_device(module) or "cpu")
    raise ValueError(f"{type(module).__name__}.{name} is on the meta device and no offload hook holds its values")
