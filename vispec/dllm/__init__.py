"""Masked diffusion LM decoding: unmasking schedulers and the block loop with KV caches."""

from vispec.dllm.generate import CACHES, TextDecodeOutput, TextDecodeStats, count_tokens, generate
from vispec.dllm.schedulers import (
    SCHEDULERS,
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
    "CACHES", "SCHEDULERS", "EntropyBoundScheduler", "FactorScheduler", "LLaDAScheduler", "TextDecodeOutput",
    "TextDecodeStats", "ThresholdScheduler", "UnmaskNoise", "UnmaskSchedulerOutput", "UnmaskingScheduler",
    "count_tokens", "generate", "make_scheduler",
]
