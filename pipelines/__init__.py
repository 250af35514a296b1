"""diffusers-style pipelines (``vispec.pipelines``).

Pipelines stay thin: validate inputs, call a decoder (:mod:`vispec.decoding` for images,
:mod:`vispec.dllm` for text), decode tokens to pixels or text, post-process.
"""

from vispec.pipelines.embedded import EMBEDDED_MODELS, resolve_model_path
from vispec.pipelines.llamagen import LlamaGenPipeline, LlamaGenPipelineOutput
from vispec.pipelines.masked_diffusion_lm import MaskedDiffusionLMPipeline, MaskedDiffusionLMPipelineOutput
from vispec.pipelines.unified import UnifiedImagePipeline, UnifiedImagePipelineOutput

__all__ = ["EMBEDDED_MODELS", "LlamaGenPipeline", "LlamaGenPipelineOutput", "MaskedDiffusionLMPipeline",
           "MaskedDiffusionLMPipelineOutput", "UnifiedImagePipeline", "UnifiedImagePipelineOutput", "resolve_model_path"]
