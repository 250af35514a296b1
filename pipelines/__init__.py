"""diffusers-style pipelines (``vispec.pipelines``).

Pipelines stay thin: validate inputs, call a decoder from :mod:`vispec.decoding`, decode tokens to
pixels, post-process.
"""

from vispec.pipelines.llamagen import EMBEDDED_MODELS, LlamaGenPipeline, LlamaGenPipelineOutput

__all__ = ["EMBEDDED_MODELS", "LlamaGenPipeline", "LlamaGenPipelineOutput"]
