"""Masked diffusion LM decoding: unmasking schedulers and the block loop with KV caches.

:func:`decode` speaks the image half's vocabulary (:mod:`vispec.outputs`): it returns a
:class:`vispec.outputs.DecodeOutput`, reports :class:`vispec.outputs.DecodeProgress` to its step callback
and takes ``guidance_scale`` (1 = off; LLaDA's ``cfg_scale = w`` is ``guidance_scale = w + 1``).
"""

from vispec.dllm.blocks import AdaptiveBlocks
from vispec.dllm.decode import CACHES, StopDecoding, check_decode_args, count_tokens, decode
from vispec.dllm.dream import DreamScheduler
from vispec.dllm.early_commit import ProphetRule
from vispec.dllm.learned import LearnedFilterScheduler, ParallelDecodeFilter
from vispec.dllm.schedulers import (
    SCHEDULERS,
    ContiguousScheduler,
    EntropyBoundScheduler,
    FactorScheduler,
    LLaDAScheduler,
    ThresholdScheduler,
    UnmaskingScheduler,
    UnmaskNoise,
    UnmaskSchedulerOutput,
    make_scheduler,
)

__all__ = [
    "CACHES", "SCHEDULERS", "AdaptiveBlocks", "ProphetRule", "ContiguousScheduler", "DreamScheduler", "EntropyBoundScheduler", "FactorScheduler", "LLaDAScheduler", "LearnedFilterScheduler", "ParallelDecodeFilter", "StopDecoding", "ThresholdScheduler",
    "UnmaskNoise", "UnmaskSchedulerOutput", "UnmaskingScheduler", "check_decode_args", "count_tokens", "decode",
    "make_scheduler",
]
