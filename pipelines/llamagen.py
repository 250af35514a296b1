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
* ``text_encoder`` and ``tokenizer`` (optional, caption models): transformers' ``T5EncoderModel`` and its tokenizer
  (FLAN-T5-XL for the official t2i checkpoints), so ``pipe(prompt="a photo of a cat")`` builds the caption
  features as LlamaGen's ``sample_t2i.py`` does (:meth:`LlamaGenPipeline.encode_prompt`); without them, pass
  ``prompt_embeds``.

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
import warnings
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
    model_cpu_offload_seq = "text_encoder->transformer->vqvae"
    _optional_components = ["drafter", "gad_drafter", "text_encoder", "tokenizer"]
    _callback_tensor_inputs = ["tokens", "num_committed"]
    _applied_callback_inputs = ("tokens",)

    def __init__(self, transformer: LlamaGenGPT, vqvae: VQModel, decoding_config: DecodingConfig,
                 drafter: Optional[LlamaGenGPT] = None, gad_drafter: Optional[GADDrafter] = None,
                 text_encoder: Any = None, tokenizer: Any = None):
        _check_text_encoder(transformer, text_encoder)
        super().__init__()
        self.register_modules(transformer=transformer, vqvae=vqvae, decoding_config=decoding_config, drafter=drafter,
                              gad_drafter=gad_drafter, text_encoder=text_encoder, tokenizer=tokenizer)
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

    def encode_prompt(self, prompt: Union[str, Sequence[str]], clean_caption: bool = True,
                      device: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Caption features as LlamaGen's t2i sampling builds them (``sample_t2i.py``, ``language/t5.py``).

        Each caption is cleaned (``clean_caption``: the DeepFloyd-IF cleaning LlamaGen's ``T5Embedder`` applies
        twice, taken from diffusers' PixArt pipeline; needs ``beautifulsoup4`` and ``ftfy``) or only lower-cased
        and stripped; tokenized with EOS, padded and truncated to the transformer's ``cls_token_num`` tokens (120,
        LlamaGen's ``t5_feature_max_len``); encoded with its attention mask (the T5 last hidden state); then
        left-padded: the valid features moved to the end, the padding zeroed. The null caption for guidance is
        the transformer's learnt ``uncond_embedding``, under the same mask. Returns ``(prompt_embeds [B, T, C],
        prompt_mask [B, T] bool)``."""
        texts = self._prompts(prompt)
        self._check_prompt_components()
        texts = _caption_texts(texts, clean_caption)
        tokens = self.tokenizer(texts, max_length=self.transformer.config.cls_token_num, padding="max_length",
                                truncation=True, add_special_tokens=True, return_attention_mask=True, return_tensors="pt")
        device = self._execution_device if device is None else device
        with torch.no_grad():
            hidden = self.text_encoder(input_ids=tokens["input_ids"].to(device),
                                       attention_mask=tokens["attention_mask"].to(device)).last_hidden_state
        mask = tokens["attention_mask"].to(hidden.device).bool()
        order = torch.sort(mask.to(torch.uint8), dim=1, stable=True).indices  # padding first, then the valid tokens in order
        mask = mask.gather(1, order)
        embeds = hidden.gather(1, order[..., None].expand_as(hidden)).masked_fill(~mask[..., None], 0)
        return embeds, mask

    def _prompts(self, prompt: Any) -> list[str]:
        prompts = [prompt] if isinstance(prompt, str) else prompt
        if not isinstance(prompts, (list, tuple)) or not prompts or not all(isinstance(p, str) for p in prompts):
            raise ValueError(f"prompt must be a string or a non-empty list of strings, got {prompt!r}")
        return list(prompts)

    def _check_prompt_components(self) -> None:
        missing = [name for name in ("text_encoder", "tokenizer") if getattr(self, name, None) is None]
        if missing:
            raise ValueError(f"prompt needs a text encoder, but this pipeline has no {' and no '.join(missing)}: pass "
                             "prompt_embeds (caption features [batch, tokens, caption_dim]) instead, or load a "
                             "text_encoder and tokenizer (T5EncoderModel and its tokenizer: LlamaGenPipeline("
                             "..., text_encoder=, tokenizer=), from_pretrained(folder, text_encoder=, tokenizer=), or "
                             "`vispec convert llamagen --text-encoder FOLDER`)")
        _check_text_encoder(self.transformer, self.text_encoder)

    def _check_condition_inputs(self, class_labels: Any, prompt: Any, prompt_embeds: Any,
                                prompt_mask: Any) -> tuple[Any, Optional[list[str]]]:
        """What conditions the call, checked before any work: ``(class_labels, prompts or None)``. A caption
        (a string or a list of strings) passed first, ``pipe("a photo of a cat")``, is the prompt."""
        if self.transformer.config.model_type == "c2i":
            for name, value in (("prompt", prompt), ("prompt_embeds", prompt_embeds)):
                if value is not None:
                    raise ValueError(f"this is a class-conditional model: pass class_labels, not {name}")
            return class_labels, None
        if prompt is None and (isinstance(class_labels, str) or (isinstance(class_labels, (list, tuple)) and class_labels
                                                                  and all(isinstance(c, str) for c in class_labels))):
            class_labels, prompt = None, class_labels
        if class_labels is not None:
            raise ValueError("this is a caption-conditioned model: pass prompt (with a text_encoder) or prompt_embeds "
                             "(caption features), not class_labels")
        if prompt is None:
            if prompt_embeds is None:
                raise ValueError("this is a caption-conditioned model: pass prompt_embeds (caption features)" +
                                 (" or prompt" if getattr(self, "text_encoder", None) is not None else
                                  ", or load a text_encoder and tokenizer to pass prompt"))
            return None, None
        if prompt_embeds is not None or prompt_mask is not None:
            given = "prompt_embeds" if prompt_embeds is not None else "prompt_mask"
            raise ValueError(f"pass prompt or prompt_embeds (with prompt_mask), not both: got prompt and {given} "
                             "(prompt is encoded into its own features and mask)")
        prompts = self._prompts(prompt)
        self._check_prompt_components()
        return None, prompts

    def condition(self, class_labels: Any, prompt_embeds: Optional[torch.Tensor], prompt_mask: Optional[torch.Tensor],
                  repeat: int, prompt: Any = None, clean_caption: bool = True) -> LlamaGenCondition:
        device = self._execution_device
        class_labels, prompts = self._check_condition_inputs(class_labels, prompt, prompt_embeds, prompt_mask)
        if self.transformer.config.model_type == "c2i":
            return LlamaGenCondition(class_labels=self._class_labels(class_labels).repeat_interleave(repeat).to(device))
        if prompts is not None:
            prompt_embeds, prompt_mask = self.encode_prompt(prompts, clean_caption=clean_caption)
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
        class_labels: Union[int, Sequence[int], torch.Tensor, str, Sequence[str], None] = None,
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
        prompt: Union[str, Sequence[str], None] = None,
        clean_caption: bool = True,
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
            prompt: captions (caption models with a ``text_encoder`` and ``tokenizer``), encoded by
                :meth:`encode_prompt`; a string or list of strings passed first is taken as the prompt.
            clean_caption: clean captions as LlamaGen does (:meth:`encode_prompt`); False only lower-cases and strips.

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
        _, prompts = self._check_condition_inputs(class_labels, prompt, prompt_embeds, prompt_mask)
        if prompts is not None:  # before the text encoder runs
            check_generator(generator, len(prompts) * num_images_per_prompt)
        condition = self.condition(class_labels, prompt_embeds, prompt_mask, num_images_per_prompt, prompt=prompt,
                                   clean_caption=clean_caption)
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


def _check_text_encoder(transformer: Any, text_encoder: Any) -> None:
    """A text encoder conditions caption models only, and its hidden size is the transformer's ``caption_dim``."""
    if text_encoder is None:
        return
    config = transformer.config
    if config.model_type != "t2i":
        raise ValueError("a text_encoder feeds caption models (t2i); this transformer is class-conditional "
                         f"({config.model_type}): leave text_encoder out and pass class_labels")
    encoder_config = getattr(text_encoder, "config", None)
    size = next((v for v in (getattr(encoder_config, k, None) for k in ("d_model", "hidden_size")) if isinstance(v, int)), None)
    if size is not None and size != config.caption_dim:
        raise ValueError(f"the text_encoder's hidden size ({size}) does not match the transformer's caption_dim "
                         f"({config.caption_dim}): LlamaGen's t2i checkpoints take FLAN-T5-XL features (2048)")


def _caption_texts(texts: list[str], clean: bool) -> list[str]:
    """LlamaGen's caption text: its ``T5Embedder`` cleans each caption twice (DeepFloyd IF's cleaning, which diffusers'
    PixArt pipeline carries); without cleaning (or without ``beautifulsoup4`` / ``ftfy``, with a warning) a caption
    is only lower-cased and stripped, as ``T5Embedder(use_text_preprocessing=False)`` does."""
    if clean:
        from diffusers.utils import is_bs4_available, is_ftfy_available

        if is_bs4_available() and is_ftfy_available():
            from diffusers import PixArtAlphaPipeline

            cleaner = PixArtAlphaPipeline._clean_caption  # reads only the class's bad_punct_regex
            return [cleaner(PixArtAlphaPipeline, cleaner(PixArtAlphaPipeline, text)) for text in texts]
        warnings.warn("clean_caption=True needs beautifulsoup4 and ftfy (pip install vispec[t2i]) for "
                      "LlamaGen's caption cleaning; captions are only lower-cased and stripped", stacklevel=3)
    return [text.lower().strip() for text in texts]


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
