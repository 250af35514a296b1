"""Model-agnostic decoders for visual AR models: AR, SJD and MC-SJD.

:func:`decode` is the entry point; decoders reach models only through
:class:`vispec.protocol.SpeculativeARModel`.
"""

from __future__ import annotations

from typing import Any, Optional, Union

from vispec.decoding.ar import decode_ar
from vispec.decoding.common import DecodeOutput, DecodeStats, GeneratorArg, StepCallback
from vispec.decoding.config import DecodingConfig
from vispec.decoding.sjd import decode_sjd
from vispec.protocol import SpeculativeARModel
from vispec.sampling import PositionProcessor, SamplingConfig


def decode(
    model: SpeculativeARModel,
    condition: Any,
    *,
    num_tokens: int,
    sampling: Optional[SamplingConfig] = None,
    decoding: Union[DecodingConfig, str] = "sjd",
    generator: GeneratorArg = None,
    processors: tuple[PositionProcessor, ...] = (),
    grid_width: Optional[int] = None,
    callback: Optional[StepCallback] = None,
    backend: str = "auto",
) -> DecodeOutput:
    """Generate ``num_tokens`` image tokens per sample with the chosen decoder.

    ``decoding`` is a :class:`DecodingConfig` or a name (``"ar"``, ``"sjd"``, ``"sjd-vertical"``,
    ``"mc-sjd"``, ``"mc-sjd-gumbel"``). ``generator``: one ``torch.Generator`` for the batch or a list
    with one per sample (then each sample's output is independent of the batch it runs in).
    ``backend``: ``"auto"`` (Triton kernels for CUDA tensors, the PyTorch reference otherwise),
    ``"triton"`` or ``"reference"`` (:mod:`vispec.kernels.backend`).
    """
    if not isinstance(model, SpeculativeARModel):
        raise ValueError(f"model must implement prefill/forward_window/rollback/select, got {type(model).__name__}")
    sampling = sampling or SamplingConfig()
    if not isinstance(sampling, SamplingConfig):
        raise ValueError(f"sampling must be a SamplingConfig, got {type(sampling).__name__}")
    config = DecodingConfig.parse(decoding)
    if config.config.strategy == "ar":
        return decode_ar(
            model, condition, num_tokens=num_tokens, sampling=sampling, generator=generator,
            processors=processors, grid_width=grid_width, callback=callback, backend=backend,
        )
    return decode_sjd(
        model, condition, num_tokens=num_tokens, sampling=sampling, decoding=config, generator=generator,
        processors=processors, grid_width=grid_width, callback=callback, backend=backend,
    )


__all__ = ["DecodeOutput", "DecodeStats", "DecodingConfig", "StepCallback", "decode", "decode_ar", "decode_sjd"]
