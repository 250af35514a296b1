"""What both pipelines share: input checks of the diffusers contract and the per-step callback."""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

from torch import Tensor

from vispec.checks import check_int
from vispec.outputs import DecodeProgress


class StepCallbackMixin:
    """diffusers' ``check_inputs`` for the arguments every pipeline has, and the decoder callback that
    drives a progress bar and ``callback_on_step_end``."""

    _callback_tensor_inputs: list[str] = []

    def check_common_inputs(self, output_type: str, output_types: tuple[str, ...], per_prompt_name: str, per_prompt: int,
                            callback_inputs: Sequence[str]) -> None:
        if output_type not in output_types:
            raise ValueError(f"output_type must be one of {output_types}, got {output_type!r}")
        check_int(per_prompt_name, per_prompt, minimum=1)
        unknown = [k for k in callback_inputs if k not in self._callback_tensor_inputs]
        if unknown:
            raise ValueError(f"callback_on_step_end_tensor_inputs {unknown} are not among {self._callback_tensor_inputs}")

    def step_callback(self, bar: Any, callback_on_step_end: Optional[Callable], tensor_inputs: Sequence[str],
                      views: dict[str, Callable[[DecodeProgress], Tensor]]) -> Callable[[DecodeProgress], None]:
        """``on_step(progress)``: advance ``bar`` to the committed tokens, then call
        ``callback_on_step_end(pipe, step, step, {name: views[name](progress)})`` with the requested inputs."""
        done = [int(bar.n)]

        def on_step(progress: DecodeProgress) -> None:
            total = int(progress.num_committed.sum())
            bar.update(total - done[0])
            done[0] = total
            if callback_on_step_end is not None:
                outputs = callback_on_step_end(self, progress.step, progress.step, {k: views[k](progress) for k in tensor_inputs})
                if outputs is not None and not isinstance(outputs, dict):
                    raise ValueError(f"callback_on_step_end must return a dict or None, got {type(outputs).__name__}")

        return on_step
