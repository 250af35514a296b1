"""``UnifiedImagePipeline``: text-to-image with unified-token models (Lumina-mGPT 2.0 and other Chameleon
forks, Emu3, Janus) under AR, SJD, MC-SJD and the relaxed acceptance rules.

Components:

* ``transformer``: the transformers model (``ChameleonForConditionalGeneration``, ``Emu3ForConditionalGeneration``
  or ``JanusForConditionalGeneration``), wrapped per call in :class:`vispec.models.unified.UnifiedTokenModel`;
* ``tokenizer``: its transformers tokenizer (prompts only: image tokens are ids the layout names);
* ``vqvae`` (optional): a diffusers ``VQModel`` that turns codes into pixels (Lumina-mGPT 2.0's MoVQGAN);
  without it the transformer's own ``decode_image_tokens`` is used (Emu3, Janus);
* ``decoding_config``: the default decoder and sampling settings (:class:`vispec.decoding.DecodingConfig`).

Image-to-image (``image=``): the source picture, tokenised by the ``vqvae``, is the upper panel of Lumina-mGPT 2.0's
dual-panel image (the resolution tokens declare twice the height; the panel sits in the prompt after the image
prefix, in both guidance branches) and the decoder writes the lower panel. ``image_to_image`` in the config marks a
model trained for it (the benchmark then runs its image-to-image task); any pipeline with a vqvae takes the request.

The layout (:class:`vispec.models.unified.ImageLayout`) is built per call from ``height`` and ``width``:
``rows = height / downsample`` rows of ``width / downsample`` codes, each row ended by ``eol_id``; the prefix
is ``image_start_id`` and, when the model has them, two resolution tokens
``resolution_token_base + height / resolution_unit`` and ``... + width / resolution_unit``; ``image_end_ids``
close the image. The prompt is ``prompt_template`` filled with ``prompt`` and the size (``height`` / ``h``,
``width`` / ``w``), tokenized, then ``prompt_suffix_ids`` (Lumina-mGPT 2.0: its turn separator).

Guidance follows the model (``cfg_mode``): Lumina-mGPT starts it at image start (the unconditional branch
sees only the image prefix; ``negative_prompt`` is refused), Emu3 takes a negative prompt, Janus pads the
prompt. Step-end callbacks see ``tokens`` (the decoded rows, end-of-row tokens included, -1 where undecided)
and may return changed committed codes (end-of-row positions must stay).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, Union

import numpy as np
import PIL.Image
import torch
from diffusers import DiffusionPipeline
from diffusers.image_processor import VaeImageProcessor
from diffusers.utils import BaseOutput

from vispec.checks import check_int
from vispec.decoding import DecodingConfig
from vispec.decoding.acceptance import AcceptanceConfig, AcceptanceRule
from vispec.decoding.rules import build_rule
from vispec.decoding.neighbors import NeighborTables
from vispec.models.checkpoints import diffusers_load_kwargs
from vispec.models.llamagen_vq import decode_tokens
from vispec.models.offload import available_memory, materialized
from vispec.models.unified import CFG_MODES, ImageLayout, UnifiedTokenModel
from vispec.models.unified_families import chameleon_backbone, emu3_backbone, janus_backbone
from vispec.outputs import UNDECIDED, DecodeProgress
from vispec.pipelines.common import PipelineMixin, check_generator, grey_undecided
from vispec.pipelines.embedded import resolve_model_path

OUTPUT_TYPES = ("pil", "np", "pt", "latent")
FAMILIES = {"chameleon": chameleon_backbone, "emu3": emu3_backbone, "janus": janus_backbone}
ID_ROLES = {"image_start_id": "the image-start token", "eol_id": "the end-of-row token", "bos_id": "the BOS token",
            "pad_id": "the pad token", "image_end_ids": "an image-end token", "prompt_suffix_ids": "a prompt-suffix token",
            "code_offset": "the first image code"}  # the config fields that name vocabulary ids, for errors


def _check_prompt_text(name: str, value: Any) -> None:
    """``value`` (the ``name`` argument) is a string or a non-empty list / tuple of strings, else a ValueError."""
    if isinstance(value, str):
        return
    if not isinstance(value, (list, tuple)) or not value or not all(isinstance(p, str) for p in value):
        raise ValueError(f"{name} must be a string or a non-empty list of strings, got {value!r}")


def _tokens_or_error(name: str, value: Any, ids: list[list[int]]) -> list[list[int]]:
    """``ids`` (the token ids of the ``name`` argument ``value``), unless a prompt gave none: then a ValueError."""
    texts = [value] if isinstance(value, str) else list(value)
    for text, row in zip(texts, ids):
        if not row:
            raise ValueError(f"{name}={text!r} gives no tokens in this model's prompt template; give a non-empty "
                             f"{name}")
    return ids


@dataclass
class UnifiedImagePipelineOutput(BaseOutput):
    """``images`` as requested by ``output_type`` (``"latent"``: the code grids ``[B, rows, cols]``); ``stats``
    one dict per image."""

    images: Union[list[PIL.Image.Image], np.ndarray, torch.Tensor]
    stats: list[dict]


class UnifiedImagePipeline(PipelineMixin, DiffusionPipeline):
    """Text-to-image for unified-token models with vispec's decoders (module docstring)."""

    model_cpu_offload_seq = "transformer->vqvae"
    _optional_components = ["vqvae"]
    _callback_tensor_inputs = ["tokens", "num_committed"]
    _applied_callback_inputs = ("tokens",)

    def __init__(self, transformer: Any, tokenizer: Any, decoding_config: DecodingConfig, vqvae: Any = None, *,
                 family: str = "chameleon", num_codes: int = 16384, code_offset: int = 0, eol_id: Optional[int] = None,
                 image_start_id: Optional[int] = None, image_end_ids: Optional[list] = None,
                 resolution_token_base: Optional[int] = None, resolution_unit: int = 32, downsample: int = 8,
                 prompt_template: str = "{prompt}", prompt_suffix_ids: Optional[list] = None, cfg_mode: str = "image_start",
                 bos_id: Optional[int] = None,
                 pad_id: Optional[int] = None, default_height: int = 256, default_width: int = 256,
                 image_to_image: bool = False):
        super().__init__()
        if family not in FAMILIES:
            raise ValueError(f"family must be one of {sorted(FAMILIES)}, got {family!r}")
        if cfg_mode not in CFG_MODES:
            raise ValueError(f"cfg_mode must be one of {CFG_MODES}, got {cfg_mode!r}")
        for name, value in (("num_codes", num_codes), ("downsample", downsample), ("resolution_unit", resolution_unit)):
            check_int(name, value, minimum=1)
        self.register_modules(transformer=transformer, tokenizer=tokenizer, decoding_config=decoding_config, vqvae=vqvae)
        self.register_to_config(
            family=family, num_codes=num_codes, code_offset=code_offset, eol_id=eol_id, image_start_id=image_start_id,
            image_end_ids=list(image_end_ids or []), resolution_token_base=resolution_token_base, resolution_unit=resolution_unit,
            downsample=downsample, prompt_template=prompt_template, prompt_suffix_ids=list(prompt_suffix_ids or []),
            cfg_mode=cfg_mode, bos_id=bos_id, pad_id=pad_id,
            default_height=default_height, default_width=default_width, image_to_image=bool(image_to_image))
        self.image_processor = VaeImageProcessor(do_normalize=True, do_resize=False)
        self.neighbor_tables = NeighborTables()  # LANTERN's, per codebook

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: Union[str, os.PathLike], **kwargs) -> "UnifiedImagePipeline":
        """Load a saved (or ``vispec convert lumina-mgpt``-converted) pipeline folder, or an embedded model by name
        (``"vispec/tiny-t2i"``), offline, after checking it."""
        kwargs = {**diffusers_load_kwargs(), **kwargs}
        path = resolve_model_path(pretrained_model_name_or_path)
        cls.check_folder(path)
        return super().from_pretrained(path, **kwargs)

    # ------------------------------------------------------------------ layout and model
    def layout(self, height: int, width: int, source_panel: bool = False) -> ImageLayout:
        """The image layout of a ``height x width`` image (module docstring). ``source_panel``: an image-to-image
        request's dual-panel layout: the resolution tokens declare twice the height (the source panel above, the
        decoded one below; :meth:`vispec.models.unified.UnifiedTokenModel.condition` puts the source in the prompt)."""
        cfg = self.config
        unit = self._size_unit()
        for name, value in (("height", height), ("width", width)):
            check_int(name, value, minimum=unit, hint=f" and a multiple of {unit}")
            if value % unit:
                why = "the tokenizer's downsampling" + (" and the resolution tokens' unit" if unit != cfg.downsample else "")
                raise ValueError(f"{name} must be a multiple of {unit} ({why}), got {value}")
        self._check_vocabulary_ids()
        prefix = () if cfg.image_start_id is None else (cfg.image_start_id,)
        if cfg.resolution_token_base is not None:
            declared = 2 * height if source_panel else height
            self._check_resolution_tokens(declared, width, "2 x height (the dual panel)" if source_panel else "height")
            prefix += (cfg.resolution_token_base + declared // cfg.resolution_unit,
                       cfg.resolution_token_base + width // cfg.resolution_unit)
        return ImageLayout(rows=height // cfg.downsample, cols=width // cfg.downsample, num_codes=cfg.num_codes,
                           code_offset=cfg.code_offset, eol_id=cfg.eol_id, prefix=prefix,
                           suffix=tuple(cfg.image_end_ids))

    def _size_unit(self) -> int:
        """``height`` and ``width`` are multiples of this: the downsampling, and the resolution tokens' unit."""
        cfg = self.config
        return cfg.downsample if cfg.resolution_token_base is None else int(np.lcm(cfg.downsample, cfg.resolution_unit))

    def _vocabulary_size(self) -> Optional[int]:
        """The transformer's input vocabulary (prompt and image-layout ids index it); None if it has no embedding."""
        get = getattr(self.transformer, "get_input_embeddings", None)
        embedding = get() if callable(get) else None
        size = getattr(embedding, "num_embeddings", None)
        return size if isinstance(size, int) else None

    def _reserved_ids(self) -> dict[str, tuple[int, int]]:
        """The ``model_index.json`` fields that name vocabulary ids: field -> (first id, last id)."""
        cfg = self.config
        ids = {name: getattr(cfg, name) for name in ("image_start_id", "eol_id", "bos_id", "pad_id")}
        spans = {name: (value, value) for name, value in ids.items() if value is not None}
        for name in ("image_end_ids", "prompt_suffix_ids"):
            if getattr(cfg, name):
                spans[name] = (min(getattr(cfg, name)), max(getattr(cfg, name)))
        if cfg.family != "janus":  # Janus codes come from their own head, not the vocabulary
            spans["code_offset"] = (cfg.code_offset, cfg.code_offset + cfg.num_codes - 1)
        if cfg.resolution_token_base is not None:
            spans["resolution_token_base"] = (cfg.resolution_token_base, cfg.resolution_token_base)
        return spans

    def _check_vocabulary_ids(self) -> None:
        """Every id the config names lies in the transformer's vocabulary (an id past it would fail in the
        embedding lookup, mid-decode); the error names the ``model_index.json`` field."""
        size = self._vocabulary_size()
        if size is None:
            return
        for name, (first, last) in self._reserved_ids().items():
            if not isinstance(first, int) or isinstance(first, bool) or first < 0 or last >= size:
                what = f"ids {first}..{last}" if first != last else f"id {first}"
                if name == "code_offset":
                    what = f"code ids {first}..{last} (code_offset + num_codes {self.config.num_codes})"
                raise ValueError(f"{name} (model_index.json) gives {what}, outside the transformer's vocabulary of "
                                 f"{size} ids (0..{size - 1})")

    def _check_resolution_tokens(self, height: int, width: int, height_name: str = "height") -> None:
        """The resolution tokens ``resolution_token_base + size / resolution_unit`` must stay below the next id the
        config gives another role (codes, end of row, image start / end) and inside the vocabulary; the error
        names ``height`` / ``width`` and the largest size that keeps them there."""
        cfg = self.config
        base = cfg.resolution_token_base
        others = {name: span for name, span in self._reserved_ids().items() if name != "resolution_token_base"}
        above = [(first, f"id {first} is {ID_ROLES[name]} ({name})") for name, (first, _) in others.items() if first > base]
        size = self._vocabulary_size()
        above += [(size, f"the vocabulary has {size} ids")] if size is not None else []
        for name, (first, last) in others.items():
            if first <= base <= last:
                raise ValueError(f"resolution_token_base {base} (model_index.json) is an id of {name} ({first}..{last})")
        if not above:
            return
        end, owner = min(above)
        largest = (end - 1 - base) * cfg.resolution_unit
        for name, value in ((height_name, height), ("width", width)):
            token = base + value // cfg.resolution_unit
            if token >= end:
                raise ValueError(f"{name}={value} needs the resolution token {token} (resolution_token_base {base} + "
                                 f"{name} / {cfg.resolution_unit}), past this model's resolution tokens, which end at "
                                 f"id {end - 1} ({owner}): {name} must be at most {largest}")

    def unified_model(self, layout: ImageLayout) -> UnifiedTokenModel:
        """The transformer as a decoder-protocol model for ``layout``."""
        backbone = FAMILIES[self.config.family](self.transformer, layout)
        return UnifiedTokenModel(backbone, layout, self.config.cfg_mode, bos_id=self.config.bos_id, pad_id=self.config.pad_id)

    def encode_prompt(self, prompt: Union[str, Sequence[str]], height: int, width: int) -> list[list[int]]:
        """Token ids of each prompt in the model's template."""
        prompts = [prompt] if isinstance(prompt, str) else prompt
        if not isinstance(prompts, (list, tuple)) or not prompts or not all(isinstance(p, str) for p in prompts):
            raise ValueError(f"prompt must be a string or a non-empty list of strings, got {prompt!r}")
        texts = [self.config.prompt_template.format(prompt=p, h=height, w=width, height=height, width=width) for p in prompts]
        suffix = list(self.config.prompt_suffix_ids)
        return [list(ids) + suffix for ids in self.tokenizer(texts)["input_ids"]]

    # ------------------------------------------------------------------ checks before any work
    def _prompt_ids(self, prompt: Any, negative_prompt: Any, height: int, width: int
                    ) -> tuple[list[list[int]], Optional[list[list[int]]]]:
        """The call's prompts and negative prompts (one per prompt, or None) as token ids, each argument checked
        under its own name."""
        _check_prompt_text("prompt", prompt)
        prompts = _tokens_or_error("prompt", prompt, self.encode_prompt(prompt, height, width))
        if negative_prompt is None:
            return prompts, None
        if self.config.cfg_mode != "negative":
            raise ValueError(f"negative_prompt needs a model whose guidance takes one (cfg_mode 'negative'); this one "
                             f"uses cfg_mode {self.config.cfg_mode!r}")
        _check_prompt_text("negative_prompt", negative_prompt)
        negatives = _tokens_or_error("negative_prompt", negative_prompt,
                                     self.encode_prompt(negative_prompt, height, width))
        if len(negatives) not in (1, len(prompts)):
            raise ValueError(f"negative_prompt has {len(negatives)} prompts for {len(prompts)} prompts: give one, or "
                             f"one per prompt")
        return prompts, negatives * len(prompts) if len(negatives) == 1 else negatives

    def _check_pixel_decoder(self, output_type: str) -> None:
        """Pixels need a vqvae or a transformer with ``decode_image_tokens``; refused before decoding otherwise."""
        if output_type != "latent" and self.vqvae is None and not hasattr(self.transformer, "decode_image_tokens"):
            raise ValueError(f"output_type={output_type!r} needs an image decoder, and this pipeline has no vqvae and "
                             f"its transformer cannot decode image tokens; use output_type='latent' (code grids) or "
                             f"give the pipeline a vqvae")

    def _check_context(self, model: UnifiedTokenModel, layout: ImageLayout, prompts: list[list[int]],
                       negatives: Optional[list[list[int]]], height: int, width: int, panel: int = 0) -> None:
        """Every prompt row (template, image prefix, ``panel`` source tokens) and the image's tokens must fit the
        transformer's context (``max_position_embeddings``); the error names ``height`` / ``width`` when the image
        alone does not fit, else ``prompt`` or ``negative_prompt``."""
        limit = model.max_positions
        if limit is None:
            return
        prefix, image = len(layout.prefix) + panel, layout.num_tokens
        if prefix + image >= limit:  # not even a one-token prompt fits
            largest = self._largest_square((limit - len(layout.prefix) - 1) // (2 if panel else 1))
            hint = f"; the largest square image that fits is {largest}x{largest}" if largest else ""
            what = f"a {prefix}-token image prefix" if not panel else f"the image prefix and the {panel}-token source panel"
            raise ValueError(f"height={height} and width={width} give {image} image tokens ({layout.rows} rows of "
                             f"{layout.row_length}) after {what}, beyond the transformer's "
                             f"context of {limit} positions (max_position_embeddings){hint}")
        for name, rows in (("prompt", prompts), ("negative_prompt", negatives or [])):
            longest = max((len(r) for r in rows), default=0)
            if longest + prefix + image > limit:
                raise ValueError(f"{name} is {longest} tokens long (template included); with the {prefix + image} tokens "
                                 f"of a {height}x{width} image it needs {longest + prefix + image} positions, beyond the "
                                 f"transformer's context of {limit} (max_position_embeddings): shorten it to at most "
                                 f"{limit - prefix - image} tokens or ask for a smaller image")

    def _largest_square(self, budget: int) -> int:
        """The largest square size (a multiple of the size unit) whose image tokens fit in ``budget`` positions;
        0 if none does."""
        cfg, unit = self.config, self._size_unit()
        size = 0
        while True:
            side = (size + unit) // cfg.downsample
            if side * (side + (cfg.eol_id is not None)) > budget:
                return size
            size += unit

    def _check_memory(self, model: UnifiedTokenModel, layout: ImageLayout, rows: list[list[int]], batch: int,
                      max_batch_size: Optional[int], guidance: bool, output_type: str, panel: int = 0) -> None:
        """Refuse a call whose key/value cache (``max_batch_size`` images at a time, all at once by default), token
        grids and pixels would not fit the execution device's available memory (a lower estimate: activations
        and the image decoder's work come on top). The error names ``num_images_per_prompt``."""
        slots = batch if max_batch_size is None else min(batch, check_int("max_batch_size", max_batch_size, minimum=1))
        capacity = max(len(r) for r in rows) + len(layout.prefix) + panel + layout.num_tokens
        need = model.cache_bytes(slots * (2 if guidance else 1), capacity) + batch * layout.num_tokens * 8
        if output_type != "latent":
            need += batch * 3 * layout.rows * layout.cols * self.config.downsample ** 2 * 4
        free = available_memory(self._execution_device)
        if free is not None and need > free:
            raise ValueError(f"num_images_per_prompt: {batch} images ({slots} decoded at a time) need at least "
                             f"{need / 2 ** 30:.1f} GiB for the key/value cache and outputs, more than the "
                             f"{free / 2 ** 30:.1f} GiB available on {self._execution_device}; ask for fewer images per "
                             f"call or set max_batch_size")

    # ------------------------------------------------------------------ image-to-image
    def _source_pixels(self, image: Any) -> torch.Tensor:
        """``image`` (the call's argument) as ``[B, 3, H, W]`` in [-1, 1] (diffusers' ``VaeImageProcessor``:
        PIL images, numpy arrays or tensors in [0, 1], or lists of them), checked before any work."""
        if self.vqvae is None:
            raise ValueError("image (image-to-image) needs the pipeline's vqvae to tokenise the source; this pipeline "
                             "has none")
        items = image if isinstance(image, (list, tuple)) else [image]
        if not items or not all(isinstance(i, (PIL.Image.Image, np.ndarray, torch.Tensor)) for i in items):
            raise ValueError(f"image must be a PIL image, a numpy array or a tensor (or a non-empty list of them), got "
                             f"{type(image).__name__}")
        for item in items:
            if isinstance(item, PIL.Image.Image):
                if 0 in item.size:
                    raise ValueError(f"image is empty: a {item.size[0]}x{item.size[1]} PIL image")
                continue
            if isinstance(item, torch.Tensor):
                item = item.detach().cpu()
                values = (item.float() if item.is_floating_point() else item).numpy()
            else:
                values = np.asarray(item)
            if values.size == 0 or 0 in values.shape:
                raise ValueError(f"image is empty: an array or tensor of shape {tuple(values.shape)} (expected [H, W, 3] "
                                 "or [3, H, W] pixels)")
            if not np.issubdtype(values.dtype, np.number) and values.dtype != np.bool_:
                raise ValueError(f"image arrays and tensors must hold numbers in [0, 1], got dtype {values.dtype}")
            if not np.isfinite(values).all():
                raise ValueError(f"image has {int((~np.isfinite(values)).sum())} NaN or infinite values; pixels must "
                                 "lie in [0, 1]")
            if float(values.min()) < 0 or float(values.max()) > 1:
                raise ValueError(f"image arrays and tensors must lie in [0, 1] (diffusers' convention), got values in "
                                 f"[{float(values.min()):.3g}, {float(values.max()):.3g}]")
        try:
            pixels = self.image_processor.preprocess(image)
        except (ValueError, TypeError) as err:
            raise ValueError(f"image could not be read as images: {err}") from None
        if pixels.dim() != 4 or pixels.shape[1] != 3:
            raise ValueError(f"image must have 3 channels (RGB), got a batch of shape {tuple(pixels.shape)}")
        return pixels.float()

    def _source_size(self, pixels: torch.Tensor, height: Optional[int], width: Optional[int]) -> tuple[int, int]:
        """The decoded panel's size: the source's; a ``height`` / ``width`` that differs is refused (no resizing)."""
        size = (int(pixels.shape[2]), int(pixels.shape[3]))
        for name, given, actual in (("height", height, size[0]), ("width", width, size[1])):
            if given is not None and given != actual:
                raise ValueError(f"{name}={given} differs from the source image's {name} {actual}: an edited image has "
                                 f"its source's size (resize the source, or leave {name} out)")
        return size

    @torch.no_grad()
    def source_tokens(self, pixels: torch.Tensor, layout: ImageLayout) -> torch.Tensor:
        """Decoder tokens ``[B, num_tokens]`` of source images ``[B, 3, H, W]`` in [-1, 1]: the vqvae's codes, rows
        ended by the end-of-row token (the layout of the decoded panel)."""
        from vispec.models.llamagen_vq import encode_to_tokens

        codes = encode_to_tokens(self.vqvae, pixels.to(self._execution_device))
        return layout.tokens_of_codes(codes.cpu())

    # ------------------------------------------------------------------ acceptance
    def codebook(self) -> torch.Tensor:
        """LANTERN's latent space over the decoder vocabulary: the VQ codebook, and a NaN row for end of row
        (a token with no latent: no neighbours, never a neighbour; :func:`vispec.decoding.neighbors.codebook_neighbors`)."""
        embedding = getattr(getattr(self.vqvae, "quantize", None), "embedding", None)
        if embedding is None:
            raise ValueError("acceptance 'lantern' needs the pipeline's vqvae codebook (quantize.embedding); this "
                             "pipeline has no vqvae")
        codes = materialized(embedding).detach().float()  # with values under sequential offload too
        if self.config.eol_id is None:
            return codes
        return torch.cat([codes, torch.full((1, codes.shape[1]), float("nan"), dtype=codes.dtype, device=codes.device)])

    def acceptance_rule(self, acceptance: Union[None, str, AcceptanceConfig, AcceptanceRule],
                        model: Optional[UnifiedTokenModel] = None) -> AcceptanceRule:
        """The rule (:func:`vispec.decoding.rules.build_rule`): LANTERN's neighbour table comes from
        :attr:`neighbor_tables` (computed once per codebook), GSD uses the image tokens' input embeddings of
        ``model`` (default: the transformer at the default size). The end-of-row token has no latent in either
        (a NaN row): no relaxed rule keeps it where the target gives it no mass, nor relaxes towards it."""
        def embeddings() -> torch.Tensor:
            wrapped = model or self.unified_model(self.layout(self.config.default_height, self.config.default_width))
            weight = wrapped.tok_embeddings.weight
            if self.config.eol_id is None or weight.shape[0] <= self.config.num_codes:
                return weight
            weight = weight.detach().float().clone()
            weight[self.config.num_codes:] = float("nan")  # end of row: no latent, a group of its own
            return weight

        return build_rule(acceptance, codebook=self.codebook, embeddings=embeddings, tables=self.neighbor_tables)

    # ------------------------------------------------------------------ call
    @torch.no_grad()
    def __call__(
        self,
        prompt: Union[str, list[str]],
        negative_prompt: Union[str, list[str], None] = None,
        image: Any = None,
        height: Optional[int] = None,
        width: Optional[int] = None,
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
        callback_on_step_end: Optional[Callable[["UnifiedImagePipeline", int, int, dict], Optional[dict]]] = None,
        callback_on_step_end_tensor_inputs: Sequence[str] = ("tokens",),
        max_batch_size: Optional[int] = None,
    ) -> Union[UnifiedImagePipelineOutput, tuple]:
        """Generate images from text, or edit an image (image-to-image).

        Args:
            prompt: one prompt or a list; negative_prompt: likewise (models with ``cfg_mode="negative"``).
            image: a source image for image-to-image (an edit instruction in ``prompt``): a PIL image, a numpy array
                or a ``[B, 3, H, W]`` / ``[3, H, W]`` tensor in [0, 1] (diffusers' convention), or a list of them;
                one for every prompt or one per prompt. It is tokenised by the ``vqvae`` and laid out as the upper
                panel of Lumina-mGPT 2.0's dual-panel image (the resolution tokens declare twice the height); the
                decoder writes the lower panel, of the source's size (``height`` / ``width`` default to it and
                must match it). ``decoding="iad"`` or ``"mc-sjd:init=source"`` draft from the source (input-guided
                aggressive decoding: exact, and fast where the edit keeps most of the picture); each image's
                ``stats["source_kept"]`` is the fraction of its codes equal to the source's.
            height, width: pixels (multiples of the tokenizer's downsampling; default the config's); the size's
                resolution tokens must lie below the next id the config gives another role, and prompt, image
                prefix and image tokens must fit the transformer's context (``max_position_embeddings``).
            guidance_scale, temperature, top_k, top_p: override ``decoding_config``'s sampling defaults (top-k
                and top-p act on the codes: the end-of-row token is forced, never sampled).
            decoding: a spec (``"ar"``, ``"sjd"``, ``"mc-sjd:window=16"``, ``"mc-sjd+lantern:k=100,delta=0.1"``);
                acceptance: a rule given on its own (:mod:`vispec.decoding.acceptance`).
            num_images_per_prompt, generator (one, or one per image), output_type (``"pil"``, ``"np"``,
                ``"pt"``, ``"latent"``: code grids), return_dict (False: ``(images,)``), callbacks and
                ``max_batch_size`` as in :class:`vispec.pipelines.LlamaGenPipeline`. A call whose key/value cache
                (``max_batch_size`` images at a time; all by default), code grids and pixels need more than the
                execution device's available memory is refused before any work (``num_images_per_prompt`` named).

        Every argument, and every vocabulary id ``model_index.json`` names, is checked before decoding starts.
        """
        tensor_inputs = self.check_common_inputs(output_type, OUTPUT_TYPES, "num_images_per_prompt", num_images_per_prompt,
                                                 callback_on_step_end, callback_on_step_end_tensor_inputs)
        pixels = None if image is None else self._source_pixels(image)
        if pixels is not None:
            height, width = self._source_size(pixels, height, width)
        height = self.config.default_height if height is None else height
        width = self.config.default_width if width is None else width
        layout = self.layout(height, width, source_panel=pixels is not None)
        self._check_pixel_decoder(output_type)
        config = DecodingConfig.resolve(decoding, base=self.decoding_config, acceptance=acceptance)
        if config.init == "source" and config.strategy != "ar" and pixels is None:
            raise ValueError(f"decoding {config.name!r} drafts from a source image (init='source'): give image=... "
                             f"(an image-to-image request)")
        if config.strategy == "sd":
            raise ValueError("decoding 'sd' needs a drafter model; UnifiedImagePipeline has none: use 'ar', 'sjd' or 'mc-sjd'")
        sampling = config.sampling(guidance_scale=guidance_scale, temperature=temperature, top_k=top_k, top_p=top_p)
        sampling.check_vocab(layout.vocab_size)  # what the decoders check once started
        prompts, negatives = self._prompt_ids(prompt, negative_prompt, 2 * height if pixels is not None else height, width)
        if pixels is not None and pixels.shape[0] not in (1, len(prompts)):
            raise ValueError(f"image has {pixels.shape[0]} images for {len(prompts)} prompts: give one, or one per prompt")
        model = self.unified_model(layout)
        panel = 0 if pixels is None else layout.num_tokens
        self._check_context(model, layout, prompts, negatives, height, width, panel)
        batch = len(prompts) * num_images_per_prompt
        check_generator(generator, batch)
        self._check_memory(model, layout, prompts + (negatives or []), batch, max_batch_size,
                           sampling.uses_guidance, output_type, panel)
        rule = self.acceptance_rule(acceptance if isinstance(acceptance, AcceptanceRule) else config.rule, model)
        repeat = lambda rows: [r for r in rows for _ in range(num_images_per_prompt)]  # noqa: E731
        source = None
        if pixels is not None:
            source = self.source_tokens(pixels, layout).expand(len(prompts), -1).repeat_interleave(num_images_per_prompt, 0)
        condition = model.condition(repeat(prompts), None if negatives is None else repeat(negatives), source=source)
        self._layout = layout
        drafts_from_source = source is not None and config.init == "source" and config.strategy != "ar"
        tokens, stats = self.decode_image_tokens(
            model, condition, num_tokens=layout.num_tokens, sampling=sampling, config=config, rule=rule,
            generator=generator, max_batch_size=max_batch_size, callback_on_step_end=callback_on_step_end,
            tensor_inputs=tensor_inputs, **({"source": source} if drafts_from_source else {}))

        codes = layout.codes(tokens)
        if source is not None:
            kept = (codes == layout.codes(source.to(codes.device))).flatten(1).float().mean(1).tolist()
            for row, fraction in zip(stats, kept):
                row["source_kept"] = fraction
        images: Any = codes if output_type == "latent" else self.image_processor.postprocess(
            self._pixels(codes, height, width), output_type=output_type)
        self.last_stats = stats
        self.maybe_free_model_hooks()
        if not return_dict:
            return (images,)
        return UnifiedImagePipelineOutput(images=images, stats=stats)

    def apply_callback_outputs(self, edits: dict[str, Any], progress: DecodeProgress) -> Optional[dict]:
        """Returned ``tokens`` may change committed codes; end-of-row positions must keep the end-of-row token."""
        super().apply_callback_outputs({k: v for k, v in edits.items() if k != "tokens"}, progress)
        if "tokens" not in edits:
            return None
        tokens, layout = edits["tokens"], self._layout
        if isinstance(tokens, torch.Tensor) and tokens.shape == progress.tokens.shape and layout.eol_id is not None:
            ends = torch.arange(tokens.shape[1]) % layout.row_length == layout.row_length - 1
            given = progress.tokens[:, ends]
            if not torch.equal(tokens[:, ends].to(given), given):
                raise ValueError("edited tokens must keep the end-of-row token at the end of every row")
        return {"tokens": tokens}

    def _pixels(self, codes: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """Code grids ``[B, rows, cols]`` to pixels in [-1, 1]; undecided codes become mid-grey patches."""
        undecided = codes == UNDECIDED
        grid = codes.masked_fill(undecided, 0).to(self._execution_device)
        if self.vqvae is not None:
            pixels = decode_tokens(self.vqvae, grid).float()
        elif hasattr(self.transformer, "decode_image_tokens"):
            pixels = self._family_pixels(grid, height, width).float()
        else:
            raise ValueError("this pipeline has no vqvae and its transformer cannot decode image tokens; use "
                             "output_type='latent' or give the pipeline a vqvae")
        if not bool(torch.isfinite(pixels).all()):
            raise ValueError("the image decoder returned NaN or inf pixels: its weights or dtype are broken")
        return grey_undecided(pixels, undecided)

    def _family_pixels(self, grid: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """The transformer's own image decoder: Emu3 takes vocabulary ids and the grid size, Janus codes."""
        if self.config.family == "emu3":
            ids = grid + self.config.code_offset
            return self.transformer.decode_image_tokens(ids.flatten(1), height=grid.shape[1], width=grid.shape[2])
        return self.transformer.decode_image_tokens(grid.flatten(1))
