"""Model-agnostic decoders for visual AR models: AR, SJD and MC-SJD.

:func:`decode` is the entry point; decoders reach models only through
:class:`vispec.protocol.SpeculativeARModel`.
"""

from __future__ import annotations

from typing import Any, Optional, Union

import torch

from vispec.decoding.acceptance import AcceptanceConfig, AcceptanceRule, build_rule
from vispec.decoding.ar import decode_ar
from vispec.decoding.common import DecodeOutput, DecodeStats, GeneratorArg, StepCallback
from vispec.decoding.config import DecodingConfig
from vispec.decoding.sd import decode_sd
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
    acceptance: Union[None, str, AcceptanceConfig, AcceptanceRule] = None,
    codebook: Optional[torch.Tensor] = None,
    drafter: Optional[SpeculativeARModel] = None,
) -> DecodeOutput:
    """Generate ``num_tokens`` image tokens per sample with the chosen decoder.

    ``decoding`` is a :class:`DecodingConfig` or a name (``"ar"``, ``"sjd"``, ``"sjd-vertical"``,
    ``"mc-sjd"``, ``"mc-sjd-gumbel"``). ``generator``: one ``torch.Generator`` for the batch or a list
    with one per sample (then each sample's output is independent of the batch it runs in).
    ``backend``: ``"auto"`` (Triton kernels for CUDA tensors, the PyTorch reference otherwise),
    ``"triton"`` or ``"reference"`` (:mod:`vispec.kernels.backend`).
    ``acceptance``: ``"exact"`` (default), ``"lantern"``, ``"gsd"`` (with options, e.g.
    ``"lantern:k=100,delta=0.1"``), an :class:`AcceptanceConfig` or a built rule
    (:mod:`vispec.decoding.acceptance`; the relaxed rules are lossy). LANTERN needs the tokenizer's
    ``codebook`` (``[V, D]``); GSD uses the model's input token embeddings. ``drafter``: the small
    model that proposes tokens for ``decoding="sd"`` (draft-model speculative decoding).
    """
    if not isinstance(model, SpeculativeARModel):
        raise ValueError(f"model must implement prefill/forward_window/rollback/select, got {type(model).__name__}")
    sampling = sampling or SamplingConfig()
    if not isinstance(sampling, SamplingConfig):
        raise ValueError(f"sampling must be a SamplingConfig, got {type(sampling).__name__}")
    config = DecodingConfig.parse(decoding)
    rule = acceptance if isinstance(acceptance, AcceptanceRule) else build_rule(
        acceptance, codebook=codebook, embeddings=_token_embeddings(model) if AcceptanceConfig.parse(acceptance).rule == "gsd" else None)
    if config.config.strategy == "ar":
        if not rule.lossless:
            raise ValueError(f"acceptance {rule.config.name!r} needs a speculative decoder (sjd, mc-sjd), not 'ar'")
        return decode_ar(
            model, condition, num_tokens=num_tokens, sampling=sampling, generator=generator,
            processors=processors, grid_width=grid_width, callback=callback, backend=backend,
        )
    if config.config.strategy == "sd":
        if drafter is None:
            raise ValueError("decoding 'sd' needs a drafter model (drafter=...), e.g. the embedded tiny-c2i-drafter")
        return decode_sd(
            model, drafter, condition, num_tokens=num_tokens, sampling=sampling, decoding=config, generator=generator,
            processors=processors, callback=callback, backend=backend, acceptance=rule,
        )
    return decode_sjd(
        model, condition, num_tokens=num_tokens, sampling=sampling, decoding=config, generator=generator,
        processors=processors, grid_width=grid_width, callback=callback, backend=backend, acceptance=rule,
    )


def _token_embeddings(model) -> torch.Tensor:
    embeddings = getattr(model, "tok_embeddings", None)
    if embeddings is None or not hasattr(embeddings, "weight"):
        raise ValueError(f"acceptance 'gsd' needs the model's input token embeddings (tok_embeddings); "
                         f"{type(model).__name__} has none")
    return embeddings.weight


__all__ = ["AcceptanceConfig", "AcceptanceRule", "build_rule", "DecodeOutput", "DecodeStats", "DecodingConfig", "StepCallback", "decode", "decode_ar", "decode_sd", "decode_sjd"]
