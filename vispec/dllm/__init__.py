"""Masked diffusion LM decoding: unmasking schedulers and the block loop with KV caches.

:func:`decode` speaks the image half's vocabulary (:mod:`vispec.outputs`): it returns a
:class:`vispec.outputs.DecodeOutput`, reports :class:`vispec.outputs.DecodeProgress` to its step callback
and takes ``guidance_scale`` (1 = off; LLaDA's ``cfg_scale = w`` is ``guidance_scale = w + 1``). Its options are
one :class:`UnmaskingOptions` (or the same names as keywords).

Where things live: :mod:`~vispec.dllm.decode` (the entry point and the checks that need the model),
:mod:`~vispec.dllm.loop` (the block loop), :mod:`~vispec.dllm.caches` (one class per cache mode),
:mod:`~vispec.dllm.schedulers` / :mod:`~vispec.dllm.dream` / :mod:`~vispec.dllm.learned` / :mod:`~vispec.dllm.editing` (the policies),
:mod:`~vispec.dllm.block_causal` (the block loop of block-causal models, LLaDA2),
:mod:`~vispec.dllm.gemma_rule` (DiffusionGemma's own rule) and :mod:`~vispec.dllm.uniform` (uniform-corruption noise),
:mod:`~vispec.dllm.blocks` (fixed blocks, AdaBlock), :mod:`~vispec.dllm.eotp` and :mod:`~vispec.dllm.prophet` (the
after-step rules), :mod:`~vispec.dllm.infill` (mask tokens inside the prompt), :mod:`~vispec.dllm.options`, :mod:`~vispec.dllm.tokens`, :mod:`~vispec.dllm.callback`.
"""

from vispec.dllm.blocks import AdaptiveBlocks
from vispec.dllm.callback import StopDecoding
from vispec.dllm.checks import check_decode_inputs
from vispec.dllm.decode import decode
from vispec.dllm.loop import count_tokens
from vispec.dllm.dream import DreamScheduler
from vispec.dllm.editing import TokenEditingScheduler, from_block_refinement
from vispec.dllm.gemma_rule import DiffusionGemmaRule
from vispec.dllm.learned import LearnedFilterScheduler, ParallelDecodeFilter
from vispec.dllm.options import CACHES, UnmaskingOptions
from vispec.dllm.prophet import ProphetRule
from vispec.dllm.uniform import SharedGenerator
from vispec.dllm.options import SelfSpeculation
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
    "CACHES", "SCHEDULERS", "AdaptiveBlocks", "ProphetRule", "SelfSpeculation", "SharedGenerator", "ContiguousScheduler", "DiffusionGemmaRule", "DreamScheduler", "EntropyBoundScheduler", "FactorScheduler", "LLaDAScheduler", "LearnedFilterScheduler", "ParallelDecodeFilter", "StopDecoding", "ThresholdScheduler", "TokenEditingScheduler",
    "UnmaskNoise", "UnmaskSchedulerOutput", "UnmaskingOptions", "UnmaskingScheduler", "check_decode_inputs", "count_tokens",
    "decode", "from_block_refinement", "make_scheduler",
]
