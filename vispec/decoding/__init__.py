"""Model-agnostic decoders for visual AR models: AR, SJD, MC-SJD and draft-model SD.

:func:`decode` is the entry point; decoders reach models only through
:class:`vispec.protocol.SpeculativeARModel`. The decoding spec (decoder, window, initialisation,
coupling, acceptance rule) is a :class:`DecodingConfig` or a string in its grammar
(:mod:`vispec.decoding.config`).
"""

from __future__ import annotations

from typing import Any, Optional, Union

import torch

from vispec.decoding.acceptance import AcceptanceConfig, AcceptanceRule
from vispec.decoding.rules import build_rule
from vispec.decoding.ar import decode_ar
from vispec.decoding.common import DecodeJob, condition_size
from vispec.decoding.config import DecodingConfig, split_specs
from vispec.decoding.gad import decode_gad
from vispec.decoding.sd import decode_sd
from vispec.decoding.pac import decode_pac
from vispec.decoding.sjd import decode_sjd
from vispec.decoding.windows import WindowStats
from vispec.kernels.philox import GeneratorArg
from vispec.outputs import DecodeOutput, DecodeProgress, DecodeStats, StepCallback
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
    compile: bool = False,
    max_batch_size: Optional[int] = None,
    window_stats: Optional[WindowStats] = None,
    source: Optional[torch.Tensor] = None,
) -> DecodeOutput:
    """Generate ``num_tokens`` image tokens per sample with the chosen decoder.

    ``decoding``: a :class:`DecodingConfig` or a spec such as ``"ar"``, ``"sjd-vertical"``,
    ``"mc-sjd:window=8"``, ``"sjd-pac"``, ``"auto"`` (every pass's shape chosen by cost: :mod:`vispec.decoding.shapes`) or ``"mc-sjd+lantern:k=100,delta=0.1"`` (:mod:`vispec.decoding.config`).
    ``sampling``: the target distribution (default: ``decoding``'s sampling settings).
    ``processors``: per-position logits processors (:mod:`vispec.processors`), applied after the
    model's own ``position_processors`` (a unified-token model's forced end-of-row token).
    ``generator``: one ``torch.Generator`` for the batch or a list with one per sample (then each
    sample's output is independent of the batch it runs in). ``callback(progress)`` runs after every
    forward pass (:class:`vispec.outputs.DecodeProgress`). ``backend``: ``"auto"`` (Triton kernels for
    CUDA tensors, the PyTorch reference otherwise), ``"triton"`` or ``"reference"``.
    ``acceptance``: the rule, when not given in ``decoding``: a name with options, an
    :class:`AcceptanceConfig` or a built rule (:mod:`vispec.decoding.acceptance`; the relaxed rules are
    lossy). LANTERN needs the tokenizer's ``codebook`` (``[V, D]``); GSD uses the model's input token
    embeddings. ``drafter``: the small model that proposes tokens for ``"sd"`` (a GPT), or for ``"gad"`` the masked
    block drafter (:class:`vispec.models.gad_drafter.GADDrafter`, one forward per block; :mod:`vispec.decoding.gad`).

    ``compile``: run each decode step (forward, verification, sampling) through
    ``torch.compile(fullgraph=True)`` (ar, sjd, mc-sjd, sjd-pac; the first call of each shape compiles, so
    warm up before timing; tokens equal eager's except where float rounding flips a near-tie).
    ``max_batch_size``: stream more requests than this through a batch of this many slots: a finished
    sample hands its slot to the next request (continuous batching); outputs stay in the caller's order
    and, with per-sample generators, do not depend on the slot a request ran in.
    ``window_stats``: with ``window="auto"``, the window chooser's measurements of ``model``
    (:class:`vispec.decoding.windows.WindowStats`), kept by the caller so later decodes of the same model
    start from them (pipelines keep one per transformer); without it they last this decode.
    ``source``: ``[B, num_tokens]`` image tokens of a source image per sample (an image-to-image request; -1
    where a position has none), the drafts of ``init="source"`` (``"iad"``, ``"mc-sjd:init=source"``:
    input-guided aggressive decoding, :mod:`vispec.decoding.drafts`); given only with that initialisation.
    """
    if not isinstance(model, SpeculativeARModel):
        raise ValueError(f"model must implement prefill/forward_window/rollback/select, got {type(model).__name__}")
    config = DecodingConfig.resolve(decoding, acceptance=acceptance)  # as given if a pipeline resolved it
    sampling = config.sampling() if sampling is None else sampling
    if not isinstance(sampling, SamplingConfig):
        raise ValueError(f"sampling must be a SamplingConfig, got {type(sampling).__name__}")
    if config.strategy == "sd" and drafter is None:
        raise ValueError("decoding 'sd' needs a drafter model (drafter=...), e.g. the embedded tiny-c2i drafter")
    if config.strategy == "gad" and drafter is None:
        raise ValueError("decoding 'gad' needs a block drafter (drafter=...), e.g. the embedded tiny-c2i gad_drafter")
    if not isinstance(compile, bool):
        raise ValueError(f"compile must be True or False, got {compile!r}")
    if compile and not getattr(model, "compilable", True):
        raise ValueError(f"compile=True is not supported for {type(model).__name__} (its forward runs a transformers "
                         f"model with a Python-side cache); use compile=False")
    if window_stats is not None and not isinstance(window_stats, WindowStats):
        raise ValueError(f"window_stats must be a WindowStats, got {type(window_stats).__name__}")
    source = check_source(source, config, condition, num_tokens, model)
    processors = tuple(getattr(model, "position_processors", ())) + tuple(processors)  # the model's own first
    job = DecodeJob(num_tokens, sampling, generator, processors, grid_width, callback, backend, compile, max_batch_size,
                    source)
    if config.strategy == "ar":
        return decode_ar(model, condition, job)
    rule = build_rule(acceptance if isinstance(acceptance, AcceptanceRule) else config.rule, codebook=codebook,
                      embeddings=lambda: _token_embeddings(model))
    if config.strategy == "sd":
        return decode_sd(model, drafter, condition, job, config, rule)
    if config.strategy == "gad":
        return decode_gad(model, drafter, condition, job, config, rule)
    if config.strategy in ("sjd-pac", "auto"):
        return decode_pac(model, condition, job, config, rule, window_stats)
    return decode_sjd(model, condition, job, config, rule, window_stats)


def check_source(source: Optional[torch.Tensor], config: DecodingConfig, condition: Any, num_tokens: int,
                 model: Any) -> Optional[torch.Tensor]:
    """``source`` as ``[B, num_tokens]`` int64, checked: given exactly when ``config`` drafts
    from it (``init="source"``), one row per sample, ids in ``[-1, V)``."""
    uses = config.init == "source" and config.strategy in ("sjd", "mc-sjd", "sjd-pac", "auto")
    if source is None:
        if uses:
            raise ValueError(f"decoding {config.name!r} drafts from a source image (init='source'): give source=[B, "
                             f"{num_tokens}] tokens (an image-to-image request)")
        return None
    if not uses:
        raise ValueError(f"source is used only by decoders that draft from it (init='source': 'iad', "
                         f"'mc-sjd:init=source'), not {config.name!r}")
    if not isinstance(source, torch.Tensor) or source.dtype.is_floating_point or source.dtype == torch.bool:
        raise ValueError(f"source must be an integer tensor of image tokens, got {type(source).__name__}"
                         + (f" of dtype {source.dtype}" if isinstance(source, torch.Tensor) else ""))
    batch = condition_size(condition)
    if source.shape != (batch, num_tokens):
        raise ValueError(f"source must have shape [{batch}, {num_tokens}] (one row of num_tokens per sample), got "
                         f"{tuple(source.shape)}")
    vocab = getattr(model, "image_vocab_size", None)
    low, high = (int(source.min()), int(source.max())) if source.numel() else (0, 0)
    if low < -1 or (isinstance(vocab, int) and high >= vocab):
        raise ValueError(f"source tokens must lie in [-1, {vocab}) (-1: no source token), got values in [{low}, {high}]")
    return source.long()


def _token_embeddings(model) -> torch.Tensor:
    embeddings = getattr(model, "tok_embeddings", None)
    if embeddings is None or not hasattr(embeddings, "weight"):
        raise ValueError(f"acceptance 'gsd' needs the model's input token embeddings (tok_embeddings); "
                         f"{type(model).__name__} has none")
    return embeddings.weight


__all__ = ["AcceptanceConfig", "AcceptanceRule", "DecodeJob", "DecodeOutput", "DecodeProgress", "DecodeStats", "DecodingConfig",
           "StepCallback", "WindowStats", "build_rule", "decode", "decode_ar", "decode_gad", "decode_pac", "decode_sd", "decode_sjd", "split_specs"]
