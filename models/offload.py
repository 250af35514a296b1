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


def run_offload_hook(module: nn.Module) -> None:
    """Fire ``module``'s accelerate hook as its own ``forward`` would, for code that runs the module's parts
    (or another object's method) instead of ``module(...)``: diffusers' ``apply_forward_hook`` for a wrapper. Model
    offload then moves ``module`` to its execution device (and the previous model of the offload sequence
    back to the CPU); without a hook nothing happens."""
    hook = getattr(module, "_hf_hook", None)
    if hook is not None and hasattr(hook, "pre_forward"):
        hook.pre_forward(module)


def module_device(module: nn.Module) -> torch.device:
    """Where ``module`` computes: its first parameter's device or, while sequential offload parks the weights on
    ``meta``, the execution device of the first offload hook found on it or a submodule (CPU without parameters)."""
    param = next(module.parameters(), None)
    if param is None:
        return torch.device("cpu")
    if param.device.type != "meta":
        return param.device
    for sub in module.modules():
        device = hook_execution_device(sub)
        if device is not None:
            return device
    return param.device


def available_memory(device: torch.device) -> Optional[int]:
    """Bytes that can still be allocated on ``device``: free CUDA memory, or the system's available memory
    (Linux ``MemAvailable``) for the CPU; None where it cannot be told (then callers check nothing)."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    if device.type != "cpu":
        return None
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None
