"""``LlamaGenPipeline``: class- or caption-conditioned image generation with AR, SJD or MC-SJD decoding.

A diffusers ``DiffusionPipeline`` with three components:

* ``transformer``: the LlamaGen GPT (:class:`vispec.models.llamagen_gpt.LlamaGenGPT`);
* ``vqvae``: the VQ tokenizer as a diffusers ``VQModel`` (cosine codebook baked in);
* ``decoding_config``: a :class:`vispec.decoding.DecodingConfig` (strategy, window, draft
  initialisation, coupling, and the model's default sampling settings), saved like a scheduler;
* ``drafter`` (optional): a smaller LlamaGen GPT for draft-model speculative decoding
  (``decoding="sd"``);
* ``gad_drafter`` (optional): a masked block drafter (:class:`vispec.models.gad_drafter.GADDrafter`) for GAD
  (``decoding="gad"``, :mod:`vispec.decoding.gad`): one drafter forward proposes the whole block.

Decoding specs follow the one grammar of :mod:`vispec.decoding.config` (``"mc-sjd"``,
``"sjd-vertical:window=8"``, ``"mc-sjd+lantern:k=100,delta=0.1"``). Acceptance rules (``acceptance="lantern"``,
``"gsd"``, or a ``+rule`` suffix of the spec, which is saved with ``decoding_config``) are lossy relaxations of speculative verification (:mod:`vispec.decoding.acceptance`). LANTERN's
codebook neighbour table is computed once per codebook, cached on the pipeline (:attr:`neighbor_tables`) and
written by ``save_pretrained`` (``lantern_neighbors.safetensors``), so a loaded pipeline does not recompute it.

``__call__`` validates its inputs, decodes image tokens with :func:`vispec.decoding.decode` (per-image
generators make every image independent of its batch), turns the token grid into pixels with the VQ
decoder and returns images with per-image decoding statistics (``return_dict=False`` returns ``(images,)``
as diffusers' image pipelines do; the statistics are then in ``pipe.last_stats``).

What diffusers' PipelineTesterMixin expects of an AR pipeline holds here with two main differences: there is
no ``num_inference_steps`` (a decoder takes as many forwards as it needs; ``num_timesteps`` is AR's count,
an upper bound) and no ``latents`` (decoding starts from the condition alone); every mixin check that does
not apply is listed, with the reason, in ``tests/pipelines/test_contract.py``. A step-end callback may
return changed committed ``tokens``: the decoder rewinds its cache to the first change, feeds the edited
tokens again and continues from them (:mod:`vispec.decoding.edits`; exact given the edited prefix), and
``pipe._interrupt = True`` stops and returns what is done.
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

from safetensors import safe_open
from safetensors.torch import save_file

from vispec.decoding import DecodingConfig
from vispec.decoding.acceptance import AcceptanceConfig, AcceptanceRule
from vispec.decoding.rules import build_rule
from vispec.decoding.neighbors import NeighborTables, codebook_key
from vispec.models.checkpoints import diffusers_load_kwargs
from vispec.models.gad_drafter import GADDrafter
from vispec.models.llamagen_gpt import LlamaGenCondition, LlamaGenGPT
from vispec.models.llamagen_vq import decode_tokens
from vispec.models.offload import materialized
from vispec.outputs import UNDECIDED, DecodeProgress
from vispec.pipelines.common import PipelineMixin, check_generator, grey_undecided
from vispec.pipelines.embedded import EMBEDDED_MODELS, resolve_model_path  # noqa: F401 (re-exported)

OUTPUT_TYPES = ("pil", "np", "pt", "latent")
NEIGHBORS_FILE = "lantern_neighbors.safetensors"


@dataclass
class LlamaGenPipelineOutput(BaseOutput):
    """``images`` as requested by ``output_type``; ``stats`` one dict per image (NFE, tokens per forward, ...;
    after an interrupt: ``interrupted``, the committed ``tokens`` and the decode ``steps`` run)."""

    images: Union[list[PIL.Image.Image], np.ndarray, torch.Tensor]
    stats: list[dict]


class LlamaGenPipeline(PipelineMixin, DiffusionPipeline):
    """Generate images from a LlamaGen GPT and VQ tokenizer with AR, SJD, MC-SJD or draft-model decoding (module docstring)."""

    # the drafter is not in the sequence: it alternates with the transformer every step, so both stay on the device
    model_cpu_offload_seq = "transformer->vqvae"
    _optional_components = ["drafter", "gad_drafter"]
    _callback_tensor_inputs = ["tokens", "num_committed"]
    _applied_callback_inputs = ("tokens",)

    def __init__(self, transformer: LlamaGenGPT, vqvae: VQModel, decoding_config: DecodingConfig,
                 drafter: Optional[LlamaGenGPT] = None, gad_drafter: Optional[GADDrafter] = None):
        super().__init__()
        self.register_modules(transformer=transformer, vqvae=vqvae, decoding_config=decoding_config, drafter=drafter,
                              gad_drafter=gad_drafter)
        self.image_processor = VaeImageProcessor(do_normalize=True, do_resize=False)
        self.neighbor_tables = NeighborTables()  # LANTERN's, per codebook
        self._neighbors_looked_up = False  # whether the folder this pipeline came from was searched for tables

    def __setattr__(self, name: str, value: Any) -> None:
        """A new tokenizer never takes the tables saved with the folder's (computed ones are keyed by codebook)."""
        if name == "vqvae" and value is not self.__dict__.get("vqvae", value):
            self._neighbors_looked_up = True
        super().__setattr__(name, value)

    def _saved_neighbors(self) -> NeighborTables:
        """:attr:`neighbor_tables`, with (on first use) the tables saved in the folder the pipeline was loaded
        from, so they survive every loader; a table saved for another codebook is ignored."""
        if not self._neighbors_looked_up:
            self._neighbors_looked_up = True
            folder = self.name_or_path
            path = os.path.join(folder, NEIGHBORS_FILE) if isinstance(folder, str) else ""
            if os.path.isfile(path):
                with safe_open(path, framework="pt") as saved:
                    tables = {k: saved.get_tensor(k) for k in saved.keys()}
                    fingerprint = (saved.metadata() or {}).get("codebook")
                self.neighbor_tables.add(self.codebook(), tables, fingerprint)
        return self.neighbor_tables

    @property
    def lantern_neighbors(self) -> dict[str, torch.Tensor]:
        """LANTERN's nearest-code tables of the current tokenizer, ``"raw"`` / ``"normalized"`` -> ``[V, K]``:
        computed once per codebook, or read (on first use) from the folder the pipeline was loaded from."""
        return self._saved_neighbors().of(self.codebook())

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: Union[str, os.PathLike], **kwargs) -> "LlamaGenPipeline":
        """Load a saved pipeline folder, or an embedded model by name (``"vispec/tiny-c2i"``), offline.

        The folder is checked first (its kind, every component's subfolder and weight shapes). LANTERN's saved
        neighbour tables are read on first use (:attr:`lantern_neighbors`), so they survive every loader: this
        one, diffusers' ``DiffusionPipeline.from_pretrained(folder, trust_remote_code=True)`` and ``from_pipe``."""
        kwargs = {**diffusers_load_kwargs(), **kwargs}
        path = resolve_model_path(pretrained_model_name_or_path)
        cls.check_folder(path)
        return super().from_pretrained(path, **kwargs)

    def copy_state_from(self, pipeline: Any) -> None:
        """``from_pipe``: the neighbour tables carry over (they are keyed by codebook)."""
        if isinstance(pipeline, LlamaGenPipeline):
            self.neighbor_tables.share(pipeline._saved_neighbors())
            self._neighbors_looked_up = True

    def save_pretrained(self, save_directory: Union[str, os.PathLike], **kwargs) -> None:
        """diffusers' ``save_pretrained``, plus the current tokenizer's LANTERN neighbour tables (with its codebook's
        fingerprint, :func:`vispec.decoding.neighbors.codebook_key`)."""
        super().save_pretrained(save_directory, **kwargs)
        tables = self.lantern_neighbors if len(self._saved_neighbors()) else {}
        if tables:
            codebook = self.codebook()
            dtype = torch.int16 if codebook.shape[0] <= 32767 else torch.int32
            save_file({k: v.to(dtype).contiguous() for k, v in tables.items()}, os.path.join(save_directory, NEIGHBORS_FILE),
                      metadata={"codebook": codebook_key(codebook)})

    # ------------------------------------------------------------------ acceptance
    def codebook(self) -> torch.Tensor:
        """The VQ codebook ``[V, D]`` (LANTERN's latent space)."""
        quantize = getattr(self.vqvae, "quantize", None)
        embedding = getattr(quantize, "embedding", None)
        if embedding is None or not hasattr(embedding, "weight"):
            raise ValueError(f"acceptance 'lantern' needs a tokenizer with a codebook (quantize.embedding); "
                             f"{type(self.vqvae).__name__} has none")
        return materialized(embedding)  # with values under sequential offload too

    def acceptance_rule(self, acceptance: Union[None, str, AcceptanceConfig, AcceptanceRule]) -> AcceptanceRule:
        """The rule (:func:`vispec.decoding.rules.build_rule`): LANTERN's neighbour table comes from
        :attr:`neighbor_tables` (computed once per codebook), GSD uses the transformer's token embeddings."""
        return build_rule(acceptance, codebook=self.codebook, tables=self._saved_neighbors(),
                          embeddings=lambda: materialized(self.transformer.tok_embeddings))

    # ------------------------------------------------------------------ inputs
    def _class_labels(self, class_labels: Any) -> torch.Tensor:
        """Class ids as a 1-D LongTensor. As diffusers' DiT pipeline, nested lists and tensors of any shape are
        flattened (``[[1], [2]]`` is ``[1, 2]``); bools, floats and tensors without values are refused."""
        num_classes = self.transformer.config.num_classes
        expected = "class_labels must be an int, a (nested) list of ints or an integer tensor"
        if class_labels is None or _has_bool(class_labels):
            raise ValueError(f"{expected}, got {class_labels!r}")
        if isinstance(class_labels, torch.Tensor) and class_labels.device.type == "meta":
            raise ValueError("class_labels are on the meta device (they have no values); pass them on the CPU or a GPU")
        if isinstance(class_labels, int):
            class_labels = [class_labels]
        try:
            labels = torch.as_tensor(class_labels).cpu().reshape(-1)
        except (TypeError, ValueError, RuntimeError) as err:
            raise ValueError(f"{expected}, got {class_labels!r}") from err
        if labels.numel() == 0 or labels.dtype not in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8):
            raise ValueError(f"{expected}, got {class_labels!r}")
        bad = labels[(labels < 0) | (labels >= num_classes)]
        if bad.numel():
            raise ValueError(f"class_labels must lie in [0, {num_classes}); got {bad.tolist()}")
        return labels.long()

    def check_inputs(self, output_type: str, num_images_per_prompt: int, callback: Any, callback_inputs: Sequence[str]) -> list[str]:
        return self.check_common_inputs(output_type, OUTPUT_TYPES, "num_images_per_prompt", num_images_per_prompt, callback,
                                        callback_inputs)

    def condition(self, class_labels: Any, prompt_embeds: Optional[torch.Tensor], prompt_mask: Optional[torch.Tensor], repeat: int) -> LlamaGenCondition:
        device = self._execution_device
        if self.transformer.config.model_type == "c2i":
            if prompt_embeds is not None:
                raise ValueError("this is a class-conditional model: pass class_labels, not prompt_embeds")
            return LlamaGenCondition(class_labels=self._class_labels(class_labels).repeat_interleave(repeat).to(device))
        if prompt_embeds is None or class_labels is not None:
            raise ValueError("this is a caption-conditioned model: pass prompt_embeds (caption features), not class_labels")
        for name, value in (("prompt_embeds", prompt_embeds), ("prompt_mask", prompt_mask)):
            if value is not None and (not isinstance(value, torch.Tensor) or value.device.type == "meta"):
                raise ValueError(f"{name} must be a tensor with values (not on the meta device), got "
                                 f"{value.device if isinstance(value, torch.Tensor) else type(value).__name__}")
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
        callback_on_step_end: Optional[Callable[["LlamaGenPipeline", int, int, dict], Optional[dict]]] = None,
        callback_on_step_end_tensor_inputs: Sequence[str] = ("tokens",),
        max_batch_size: Optional[int] = None,
        compile: bool = False,
    ) -> Union[LlamaGenPipelineOutput, tuple]:
        """Generate images.

        Args:
            class_labels: class ids (class-conditional models): an int, a list (nested lists are flattened, as
                diffusers' DiT pipeline does) or an integer tensor.
            prompt_embeds, prompt_mask: caption features ``[B, T, C]`` and their mask (caption models).
            guidance_scale, temperature, top_k, top_p: override the defaults in ``decoding_config``.
            decoding: a spec (:mod:`vispec.decoding.config`: ``"ar"``, ``"sjd-vertical"``, ``"mc-sjd:window=8"``,
                ``"mc-sjd+lantern:k=100,delta=0.1"``, ...) or a :class:`DecodingConfig`; a spec keeps the pipeline's
                window, initialisation and sampling defaults unless it names them. Default: the pipeline's
                ``decoding_config``. ``"sd"`` is draft-model speculative decoding with the pipeline's ``drafter``;
                ``"gad"`` drafts whole blocks with its ``gad_drafter``.
            acceptance: instead of a ``+rule`` suffix: ``"exact"``, ``"lantern"``, ``"gsd"`` (with ``:key=value`` options), an
                :class:`~vispec.decoding.acceptance.AcceptanceConfig` or a built rule. LANTERN and GSD are
                lossy; each image's stats then carry the measured TV from the exact target.
            num_images_per_prompt: images per label / caption.
            generator: one ``torch.Generator``, or a list with one per image (each image then does not
                depend on the rest of the batch).
            output_type: ``"pil"``, ``"np"`` (NHWC float in [0, 1]), ``"pt"`` (NCHW float in [0, 1]) or
                ``"latent"`` (the token grid ``[B, h, w]``).
            return_dict: False returns ``(images,)`` as diffusers' image pipelines do; the per-image statistics
                are then in ``pipe.last_stats`` (always set after a call).
            callback_on_step_end: ``f(pipe, step, step, callback_kwargs) -> dict`` after every forward pass (or a
                diffusers ``PipelineCallback``); ``callback_kwargs`` holds copies of the requested tensors
                (``tokens``: committed tokens ``[B, N]``, -1 where not yet decided; ``num_committed``). Returned
                ``tokens`` with changed committed values are applied: decoding continues from the edited tokens
                (undecided positions must stay -1; ``num_committed`` cannot change). The decoders fix the target
                when they start, so changing ``pipe._guidance_scale`` raises ``ValueError``. Setting
                ``pipe._interrupt = True`` stops decoding
                and returns what is done: ``"latent"`` keeps -1 where a token is undecided, pixel outputs show
                those tokens' patches mid-grey, and each image's stats say ``"interrupted": True``.
            max_batch_size: decode at most this many images at once; more are streamed through that many
                batch slots, a finished image handing its slot to the next (continuous batching).
            compile: run each decode step through ``torch.compile(fullgraph=True)`` (``ar``, ``sjd``,
                ``mc-sjd``); the first steps of each shape compile, later calls reuse the graphs.

        Returns ``LlamaGenPipelineOutput(images, stats)`` (``stats``: :meth:`vispec.outputs.DecodeOutput.as_dicts`).
        """
        # 1. check inputs
        tensor_inputs = self.check_inputs(output_type, num_images_per_prompt, callback_on_step_end,
                                          callback_on_step_end_tensor_inputs)
        config = DecodingConfig.resolve(decoding, base=self.decoding_config, acceptance=acceptance)
        rule = self.acceptance_rule(acceptance if isinstance(acceptance, AcceptanceRule) else config.rule)
        if config.strategy == "sd" and self.drafter is None:
            raise ValueError("decoding 'sd' needs a drafter: this pipeline has none (pass drafter= when building it)")
        if config.strategy == "gad" and self.gad_drafter is None:
            raise ValueError("decoding 'gad' needs a block drafter: this pipeline has none (pass gad_drafter= when "
                             "building it, e.g. GADDrafter.from_pretrained(...); `vispec train gad-drafter` trains one)")
        sampling = config.sampling(guidance_scale=guidance_scale, temperature=temperature, top_k=top_k, top_p=top_p)
        condition = self.condition(class_labels, prompt_embeds, prompt_mask, num_images_per_prompt)
        batch = condition.batch_size
        check_generator(generator, batch)
        num_tokens = self.transformer.num_image_tokens
        side = self.transformer.grid_size
        # 2. decode tokens, with a progress bar over generated tokens
        tokens, stats = self.decode_image_tokens(
            self.transformer, condition, num_tokens=num_tokens, sampling=sampling, config=config, rule=rule,
            generator=generator, max_batch_size=max_batch_size, callback_on_step_end=callback_on_step_end,
            tensor_inputs=tensor_inputs, grid_width=side, compile=compile,
            drafter={"sd": self.drafter, "gad": self.gad_drafter}.get(config.strategy))

        # 3. tokens -> pixels
        grid = tokens.view(batch, side, side)
        if output_type == "latent":
            images: Any = grid
        else:
            images = self.image_processor.postprocess(self._pixels(grid), output_type=output_type)
        self.last_stats = stats
        self.maybe_free_model_hooks()
        if not return_dict:
            return (images,)
        return LlamaGenPipelineOutput(images=images, stats=stats)

    def apply_callback_outputs(self, edits: dict[str, Any], progress: DecodeProgress) -> Optional[dict]:
        """Returned committed ``tokens`` go to the decoder, which continues from them (:mod:`vispec.decoding.edits`);
        a changed guidance scale is refused (the base class)."""
        super().apply_callback_outputs({k: v for k, v in edits.items() if k != "tokens"}, progress)
        return {"tokens": edits["tokens"]} if "tokens" in edits else None

    def _pixels(self, grid: torch.Tensor) -> torch.Tensor:
        """VQ-decode a token grid to float pixels in [-1, 1]; undecided tokens (an interrupted call) become
        mid-grey patches. NaN or inf pixels (a broken VQ decoder, e.g. float16 overflow) raise ``ValueError``."""
        undecided = grid == UNDECIDED
        grid = grid.masked_fill(undecided, 0).to(self._execution_device)
        pixels = decode_tokens(self.vqvae, grid).float()
        if not bool(torch.isfinite(pixels).all()):
            raise ValueError("the VQ decoder (vqvae) returned NaN or inf pixels: its weights or dtype are broken "
                             "(e.g. a float16 overflow; try float32 or bfloat16)")
        return grey_undecided(pixels, undecided)


def _has_bool(value: Any) -> bool:
    """Whether ``value`` is or holds a ``bool`` (Python's ``True`` is an ``int``, never a class id a user meant)."""
    if isinstance(value, (bool, np.bool_)):
        return True
    if isinstance(value, torch.Tensor):
        return value.dtype == torch.bool
    if isinstance(value, np.ndarray):
        return value.dtype == np.bool_
    if isinstance(value, (list, tuple)):
        return any(_has_bool(v) for v in value)
    return False
