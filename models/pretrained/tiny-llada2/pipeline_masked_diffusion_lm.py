# Written by vispec's save_pretrained so that diffusers' generic loader finds this pipeline class:
# DiffusionPipeline.from_pretrained(folder, trust_remote_code=True). It only imports vispec.
from vispec.pipelines.masked_diffusion_lm import MaskedDiffusionLMPipeline  # noqa: F401
