"""``LlamaGenPipeline``: class- or caption-conditioned image generation with AR, SJD or MC-SJD decoding.

A diffusers ``DiffusionPipeline`` with three components:

* ``transformer``: the LlamaGen GPT (:class:`vispec.models.llamagen_gpt.LlamaGenGPT`);
* ``vqvae``: the VQ tokenizer as a diffusers ``VQModel`` (cosine codebook baked in);
* ``decoding_config``: a :class:`vispec.decoding.DecodingConfig` (strategy, window, draft
  initialisation, coupling, and the model's default sampling settings), saved like a scheduler;
* ``drafter`` (optional): a smaller LlamaGen GPT for draft-model speculative decoding
  (``decoding="sd"``).

Decoding specs follow the one grammar of :mod:`vispec.decoding.config` (``"mc-sjd"``,
``"sjd-vertical:window=8"``, ``"mc-sjd+lantern:k=100,delta=0.1"``). Acceptance rules (``acceptance="lantern"``,
``"gsd"``, or a ``+rule`` suffix of the spec, which is saved with ``decoding_config``) are lossy relaxations of speculative verification (:mod:`vispec.decoding.acceptance`). LANTERN's
codebook neighbour table is computed once per tokenizer, cached on the pipeline and written by
``save_pretrained`` (``lantern_neighbors.safetensors``), so a loaded pipeline does not recompute it.

``__call__`` validates its inputs, decodes image tokens with :func:`vispec.decoding.decode` (per-image
generators make every image independent of its batch), turns the token grid into pixels with the VQ
decoder and returns images with per-image decoding statistics.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, Union

import numpy as np
import PIL.Image
import torch
from diffusers import DiffusionPipeline, VQModel
from diffusers.image_processor import VaeImageProcessor
from diffusers.utils import BaseOutput

from safetensors.torch import load_file, save_file

from vispec.decoding import DecodingConfig, decode
from vispec.decoding.acceptance import AcceptanceConfig, AcceptanceRule, build_rule, codebook_neighbors
from vispec.models.checkpoints import diffusers_load_kwargs
from vispec.models.llamagen_gpt import LlamaGenCondition, LlamaGenGPT
from vispec.models.llamagen_vq import decode_tokens
from vispec.pipelines.common import StepCallbackMixin
from vispec.pipelines.embedded import EMBEDDED_MODELS, resolve_model_path  # noqa: F401 (re-exported)

OUTPUT_TYPES = ("pil", "np", "pt", "latent")
NEIGHBORS_FILE = "lantern_neighbors.safetensors"
MAX_STORED_NEIGHBORS = 1000  # LANTERN's default k; larger k is computed on demand


@dataclass
class LlamaGenPipelineOutput(BaseOutput):
    """``images`` as requested by ``output_type``; ``stats`` one dict per image (NFE, tokens per forward, ...)."""

    images: Union[list[PIL.Image.Image], np.ndarray, torch.Tensor]
    stats: list[dict]


class LlamaGenPipeline(DiffusionPipeline, StepCallbackMixin):
    """Generate images from a LlamaGen GPT and VQ tokenizer with AR, SJD, MC-SJD or draft-model decoding (module docstring)."""

    model_cpu_offload_seq = "transformer->vqvae"
    _optional_components = ["drafter"]
    _callback_tensor_inputs = ["tokens", "num_committed"]

    def __init__(self, transformer: LlamaGenGPT, vqvae: VQModel, decoding_config: DecodingConfig,
                 drafter: Optional[LlamaGenGPT] = None):
        super().__init__()
        self.register_modules(transformer=transformer, vqvae=vqvae, decoding_config=decoding_config, drafter=drafter)
        self.image_processor = VaeImageProcessor(do_normalize=True, do_resize=False)
        self.lantern_neighbors: dict[str, torch.Tensor] = {}  # "raw" / "normalized" -> [V, K] nearest codes

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: Union[str, os.PathLike], **kwargs) -> "LlamaGenPipeline":
        """Load a saved pipeline folder, or an embedded model by name (``"vispec/tiny-c2i"``), offline."""
        kwargs = {**diffusers_load_kwargs(), **kwargs}
        path = resolve_model_path(pretrained_model_name_or_path)
        pipe = super().from_pretrained(path, **kwargs)
        table = os.path.join(path, NEIGHBORS_FILE)
        if os.path.isfile(table):
            pipe.lantern_neighbors = {k: v.long() for k, v in load_file(table).items()}
        return pipe

    def save_pretrained(self, save_directory: Union[str, os.PathLike], **kwargs) -> None:
        """diffusers' ``save_pretrained``, plus the cached LANTERN neighbour tables."""
        super().save_pretrained(save_directory, **kwargs)
        if self.lantern_neighbors:
            dtype = torch.int16 if self.codebook().shape[0] <= 32767 else torch.int32
            save_file({k: v.to(dtype).contiguous() for k, v in self.lantern_neighbors.items()},
                      os.path.join(save_directory, NEIGHBORS_FILE))

    # ------------------------------------------------------------------ acceptance
    def codebook(self) -> torch.Tensor:
        """The VQ codebook ``[V, D]`` (LANTERN's latent space)."""
        quantize = getattr(self.vqvae, "quantize", None)
        embedding = getattr(quantize, "embedding", None)
        if embedding is None or not hasattr(embedding, "weight"):
            raise ValueError(f"acceptance 'lantern' needs a tokenizer with a codebook (quantize.embedding); "
                             f"{type(self.vqvae).__name__} has none")
        return embedding.weight

    def acceptance_rule(self, acceptance: Union[None, str, AcceptanceConfig, AcceptanceRule]) -> AcceptanceRule:
        """Build the rule; LANTERN neighbour tables are computed once per tokenizer and cached."""
        if isinstance(acceptance, AcceptanceRule):
            return acceptance
        config = AcceptanceConfig.parse(acceptance)
        if config.rule != "lantern":
            return build_rule(config, embeddings=self.transformer.tok_embeddings.weight if config.rule == "gsd" else None)
        key = "normalized" if config.lantern_normalize else "raw"
        table = self.lantern_neighbors.get(key)
        if table is None or table.shape[1] < config.lantern_k:
            codebook = self.codebook()
            stored = min(codebook.shape[0] - 1, max(MAX_STORED_NEIGHBORS, config.lantern_k))
            if config.lantern_k > codebook.shape[0] - 1:
                codebook_neighbors(codebook, config.lantern_k)  # raises the range error
            table = codebook_neighbors(codebook, stored, normalize=config.lantern_normalize)
            self.lantern_neighbors[key] = table
        return build_rule(config, neighbors=table)

    # ------------------------------------------------------------------ inputs
    def _class_labels(self, class_labels: Any) -> torch.Tensor:
        num_classes = self.transformer.config.num_classes
        if isinstance(class_labels, bool) or class_labels is None:
            raise ValueError("class_labels must be an int, a list of ints or a 1-D integer tensor")
        if isinstance(class_labels, int):
            class_labels = [class_labels]
        try:
            labels = torch.as_tensor(class_labels)
        except (TypeError, ValueError, RuntimeError) as err:
            raise ValueError(f"class_labels must be an int, a list of ints or a 1-D integer tensor, got {class_labels!r}") from err
        if labels.dim() != 1 or labels.numel() == 0 or labels.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8):
            raise ValueError(f"class_labels must be an int, a list of ints or a 1-D integer tensor, got {class_labels!r}")
        bad = labels[(labels < 0) | (labels >= num_classes)]
        if bad.numel():
            raise ValueError(f"class_labels must lie in [0, {num_classes}); got {bad.tolist()}")
        return labels.long()

    def check_inputs(self, output_type: str, num_images_per_prompt: int, callback_inputs: Sequence[str]) -> None:
        self.check_common_inputs(output_type, OUTPUT_TYPES, "num_images_per_prompt", num_images_per_prompt, callback_inputs)

    def condition(self, class_labels: Any, prompt_embeds: Optional[torch.Tensor], prompt_mask: Optional[torch.Tensor], repeat: int) -> LlamaGenCondition:
        device = self._execution_device
        if self.transformer.config.model_type == "c2i":
            if prompt_embeds is not None:
                raise ValueError("this is a class-conditional model: pass class_labels, not prompt_embeds")
            return LlamaGenCondition(class_labels=self._class_labels(class_labels).repeat_interleave(repeat).to(device))
        if prompt_embeds is None or class_labels is not None:
            raise ValueError("this is a caption-conditioned model: pass prompt_embeds (caption features), not class_labels")
        mask = None if prompt_mask is None else prompt_mask.bool().repeat_interleave(repeat, 0).to(device)
        return LlamaGenCondition(caption_embeds=prompt_embeds.repeat_interleave(repeat, 0).to(device), caption_mask=mask)

    # ------------------------------------------------------------------ call
    @torch.no_grad()
    def __call__(
        self,
        class_labels: Union[int, Sequence[int], torch.Tensor, None] = None,
        prompt_embeds: Optional[torch.Tensor] = None,
        prompt_mask: Optional[torch.Tensor] = None,
        guidance_scale: Optional[float] = None,
        temperature: Optional[float] = None,
        top_k: Optional[int] = None,
        top_p: Optional[float] = None,
        decoding: Union[str, DecodingConfig, None] = None,
        acceptance: Union[str, AcceptanceConfig, AcceptanceRule, None] = None,
        num_images_per_prompt: int = 1,
        generator: Union[torch.Generator, list[torch.Generator], None] = None,
        output_type: str = "pil",
        return_dict: bool = True,
        callback_on_step_end: Optional[Callable[["LlamaGenPipeline", int, int, dict], dict]] = None,
        callback_on_step_end_tensor_inputs: Sequence[str] = ("tokens",),
        max_batch_size: Optional[int] = None,
        compile: bool = False,
    ) -> Union[LlamaGenPipelineOutput, tuple]:
        """Generate images.

        Args:
            class_labels: class ids (class-conditional models).
            prompt_embeds, prompt_mask: caption features ``[B, T, C]`` and their mask (caption models).
            guidance_scale, temperature, top_k, top_p: override the defaults in ``decoding_config``.
            decoding: a spec (:mod:`vispec.decoding.config`: ``"ar"``, ``"sjd-vertical"``, ``"mc-sjd:window=8"``,
                ``"mc-sjd+lantern:k=100,delta=0.1"``, ...) or a :class:`DecodingConfig`; a spec keeps the pipeline's
                window, initialisation and sampling defaults unless it names them. Default: the pipeline's
                ``decoding_config``. ``"sd"`` is draft-model speculative decoding with the pipeline's ``drafter``.
            acceptance: instead of a ``+rule`` suffix: ``"exact"``, ``"lantern"``, ``"gsd"`` (with ``:key=value`` options), an
                :class:`~vispec.decoding.acceptance.AcceptanceConfig` or a built rule. LANTERN and GSD are
                lossy; each image's stats then carry the measured TV from the exact target.
            num_images_per_prompt: images per label / caption.
            generator: one ``torch.Generator``, or a list with one per image (each image then does not
                depend on the rest of the batch).
            output_type: ``"pil"``, ``"np"`` (NHWC float in [0, 1]), ``"pt"`` (NCHW float in [0, 1]) or
                ``"latent"`` (the token grid ``[B, h, w]``).
            callback_on_step_end: ``f(pipe, step, step, callback_kwargs) -> dict`` after every forward pass;
                ``callback_kwargs`` holds copies of the requested tensors (``tokens``: committed tokens,
                -1 where not yet decided; ``num_committed``), so returned values cannot change decoding.
            max_batch_size: decode at most this many images at once; more are streamed through that many
                batch slots, a finished image handing its slot to the next (continuous batching).
            compile: run each decode step through ``torch.compile(fullgraph=True)`` (``ar``, ``sjd``,
                ``mc-sjd``); the first steps of each shape compile, later calls reuse the graphs.

        Returns ``LlamaGenPipelineOutput(images, stats)`` (``stats``: :meth:`vispec.outputs.DecodeOutput.as_dicts`).
        """
        # 1. check inputs
        self.check_inputs(output_type, num_images_per_prompt, callback_on_step_end_tensor_inputs)
        config = DecodingConfig.resolve(decoding, base=self.decoding_config, acceptance=acceptance)
        rule = acceptance if isinstance(acceptance, AcceptanceRule) else self.acceptance_rule(config.rule)
        if config.config.strategy == "sd" and self.drafter is None:
            raise ValueError("decoding 'sd' needs a drafter: this pipeline has none (pass drafter= when building it)")
        sampling = config.sampling(guidance_scale=guidance_scale, temperature=temperature, top_k=top_k, top_p=top_p)
        condition = self.condition(class_labels, prompt_embeds, prompt_mask, num_images_per_prompt)
        batch = condition.batch_size
        if isinstance(generator, list) and len(generator) != batch:
            raise ValueError(f"generator list has {len(generator)} entries, expected one per image ({batch})")
        num_tokens = self.transformer.num_image_tokens
        side = self.transformer.grid_size

        # 2. decode tokens, with a progress bar over generated tokens
        with self.progress_bar(total=batch * num_tokens) as bar:
            bar.update(batch)  # token 0 comes from the prefill
            on_step = self.step_callback(bar, callback_on_step_end, callback_on_step_end_tensor_inputs,
                                         {"tokens": lambda p: p.tokens, "num_committed": lambda p: p.num_committed})
            out = decode(self.transformer, condition, num_tokens=num_tokens, sampling=sampling, decoding=config,
                         generator=generator, grid_width=side, callback=on_step, acceptance=rule,
                         drafter=self.drafter if config.config.strategy == "sd" else None, compile=compile,
                         max_batch_size=max_batch_size)

        # 3. tokens -> pixels
        grid = out.tokens.view(batch, side, side)
        if output_type == "latent":
            images: Any = grid
        else:
            pixels = decode_tokens(self.vqvae, grid.to(self._execution_device)).float()
            images = self.image_processor.postprocess(pixels, output_type=output_type)
        stats = out.as_dicts()
        self.maybe_free_model_hooks()
        if not return_dict:
            return (images, stats)
        return LlamaGenPipelineOutput(images=images, stats=stats)
