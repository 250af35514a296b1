"""DiffusionGemma through vispec: transformers' ``DiffusionGemmaForBlockDiffusion`` behind the block loop.

DiffusionGemma (transformers 5.24, ``models/diffusion_gemma``) splits one set of weights into two passes:

* a **causal encoder** reads the prompt and every finished canvas into a K/V cache (the prompt once, then one pass of
  ``C`` tokens per finished canvas, at positions ``0..P-1`` and ``P + kC ..``); the decoder never writes it, so the
  cache of a finished prefix is exact;
* a **bidirectional decoder** denoises one canvas of ``C = config.canvas_length`` tokens at positions
  ``[P + kC, P + (k+1)C)``, attending to the cached prefix and the whole canvas, and self-conditions on the previous
  step's logits (``softmax(ℓ) E`` through a gated MLP; zeros at a canvas's first step).

It is trained with *uniform* corruption: an undecided canvas position holds a random token, not a mask
(:mod:`vispec.dllm.uniform`). :class:`DiffusionGemmaLM` presents it to :func:`vispec.dllm.decode` as a masked
diffusion LM over the same canvas: its config's ``mask_token_id`` is a virtual id one past the vocabulary (it
never reaches the model), the block loop's blocks are the canvases (``block_length = canvas_length``), and the
caches the block loop picks for ``uniform_corruption`` models (:mod:`vispec.dllm.uniform`) run the two passes. At
every decoder forward an undecided position shows the policy's draft for it (:attr:`vispec.dllm.UnmaskSchedulerOutput.draft`; the DiffusionGemma rule's
provisional canvas, :mod:`vispec.dllm.gemma_rule`) or a fresh uniform token; the decoder self-conditions on the
policy's ``pred_logits`` (else the raw logits) of the row's previous step in the canvas. So every vispec policy
runs on it (masked policies commit, the rest of the canvas is renoised each step, as diffusers'
``BlockRefinementScheduler`` does in its uniform-corruption mode), as do end-of-text prediction (a cut hides the
dropped canvas positions from the decoder's keys) and Prophet's early commit (judged when a row's remaining masks
all lie in its current canvas, the only one a forward computes).

Caches (``cache=``): ``"prefix"`` encodes each finished canvas once, for every row of the batch, as transformers'
``generate`` does (exact); ``"dual"`` is the same here (the decoder sees no suffix: later canvases do not exist for
it); ``"none"`` re-encodes the prompt and every finished canvas, in the same passes, before every decoder forward of
the rows in it (no cache; the same arithmetic as the cached passes, up to how a smaller batch rounds). ``"dkv"`` is
refused: a decoder forward recomputes the whole canvas from a self-conditioning input that changes every step, so
there are no per-token K/V to keep. NFE counts decoder forwards (one per row per step), as transformers'
``tokens_per_forward`` does; the one encoder pass per canvas is not counted.

At the defaults of :class:`vispec.dllm.gemma_rule.DiffusionGemmaRule`, with a :class:`vispec.dllm.uniform.
SharedGenerator`, ``decode`` returns transformers' ``generate`` tokens (``entropy_bound``) and diffusers'
``DiffusionGemmaPipeline`` + ``BlockRefinementScheduler`` tokens (``block_refinement``) for the same seed, batch > 1
and padded prompts included (``tests/dllm/test_diffusion_gemma.py``).

diffusers 0.42.1's ``DiffusionGemmaPipeline`` passes the cache as ``past_key_values=``, which transformers 5.24 renamed
``cache=`` (its ``create_diffusion_decoder_attention_mask`` refuses the old name, and the forwards warn); the adapter
accepts both, so ``DiffusionGemmaPipeline(model=DiffusionGemmaLM(model), ...)`` runs and warns of nothing.

Saving and loading: the adapter is a diffusers ``ModelMixin`` (the base diffusers' pipelines look for to save and load
a component), so a pipeline holding it records ``["vispec.models.diffusion_gemma", "DiffusionGemmaLM"]`` in
``model_index.json``, as the other vispec models record their module and class. Its folder is transformers' own
layout: :meth:`DiffusionGemmaLM.save_pretrained` is the wrapped model's ``save_pretrained`` (``config.json``,
``generation_config.json``, ``model.safetensors``), and :meth:`DiffusionGemmaLM.from_pretrained` is
``DiffusionGemmaForBlockDiffusion.from_pretrained`` (after the folder's weight shapes are checked against its
``config.json``, :func:`vispec.models.checkpoints.check_model_folder`) wrapped again, with the keywords diffusers'
pipeline loader passes translated to transformers' (``torch_dtype`` is ``dtype``; ``low_cpu_mem_usage`` and
``offload_state_dict`` no longer exist there). So ``MaskedDiffusionLMPipeline.save_pretrained`` /
``from_pretrained`` round-trip it, and a folder written by transformers' ``save_pretrained`` loads as it is.
"""

from __future__ import annotations

import copy
import inspect
import os
from typing import Any, Optional

import torch
from diffusers.models.modeling_utils import ModelMixin
from torch import Tensor, nn

from vispec.models.checkpoints import check_model_folder, read_json_object


CACHE_KEYWORD_RENAMED = "past_key_values"  # diffusers 0.42's name for transformers 5.24's `cache=`


def _rename_cache(kwargs: dict) -> dict:
    """``past_key_values=`` (diffusers 0.42) as ``cache=`` (transformers 5.24)."""
    if CACHE_KEYWORD_RENAMED in kwargs:
        if "cache" in kwargs:
            raise ValueError("pass the cache as cache= or past_key_values=, not both")
        kwargs["cache"] = kwargs.pop(CACHE_KEYWORD_RENAMED)
    return kwargs


def _cache_kw(function: Any) -> str:
    """The keyword ``function`` takes its cache under: ``cache`` (transformers >= 5.24) or ``past_key_values``."""
    return "cache" if "cache" in inspect.signature(function).parameters else CACHE_KEYWORD_RENAMED


def select_rows(cache: Any, index: Tensor) -> Any:
    """A copy of a transformers ``DynamicCache`` holding only the batch rows ``index`` (the original is untouched)."""
    part = copy.copy(cache)
    part.layers = [copy.copy(layer) for layer in cache.layers]
    for layer in part.layers:
        layer.batch_select_indices(index)
    return part


# what diffusers' pipeline loader passes a diffusers model and transformers >= 5 no longer takes
_GONE_LOAD_KEYWORDS = ("low_cpu_mem_usage", "offload_state_dict")


# text_config keys transformers' DiffusionGemmaTextConfig defaults to None although every layer's MoE block is built
# from them (its router and experts): a config without them fails inside torch (`empty(): argument 'size' ...`)
REQUIRED_TEXT_KEYS = ("num_experts", "top_k_experts", "moe_intermediate_size")


def check_diffusion_gemma_folder(folder: str | os.PathLike, variant: Optional[str] = None) -> None:
    """Raise ``ValueError`` (naming the folder or its ``config.json``) unless ``folder/config.json`` exists and
    describes a DiffusionGemma (``model_type`` ``diffusion_gemma``) with the ``text_config`` keys transformers has no
    usable default for (:data:`REQUIRED_TEXT_KEYS`, integers >= 1), whose weights in ``folder`` fit it (shapes from
    the safetensors headers, :func:`vispec.models.checkpoints.check_model_folder`). Nothing is built before: without
    ``config.json`` transformers would build a model from its defaults and fail inside torch."""
    from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion

    folder = os.path.normpath(os.fspath(folder))
    config_path = os.path.join(folder, "config.json")
    if not os.path.isfile(config_path):
        raise ValueError(f"{folder} has no config.json: a DiffusionGemma folder holds transformers' config.json (the "
                         "model's sizes) next to its weights, as DiffusionGemmaLM.save_pretrained and transformers' "
                         "save_pretrained write them")
    config = read_json_object(config_path)
    found = config.get("model_type")
    if found != DiffusionGemmaConfig.model_type:
        raise ValueError(f"{config_path} describes a model of type {found!r}, not a DiffusionGemma (model_type "
                         f"{DiffusionGemmaConfig.model_type!r}): DiffusionGemmaLM loads DiffusionGemmaForBlockDiffusion "
                         "folders")
    text = config.get("text_config")
    if not isinstance(text, dict):
        raise ValueError(f"{config_path} has no text_config object (the text model's sizes; got {text!r}): "
                         "transformers' defaults lack the MoE sizes " + ", ".join(REQUIRED_TEXT_KEYS))
    missing = [key for key in REQUIRED_TEXT_KEYS if text.get(key) is None]
    if missing:
        raise ValueError(f"{config_path}: text_config lacks {', '.join(missing)} (transformers has no default for "
                         f"{'them' if len(missing) > 1 else 'it'}; every layer's MoE block is built from "
                         f"{', '.join(REQUIRED_TEXT_KEYS)})")
    for key in REQUIRED_TEXT_KEYS:
        value = text[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{config_path}: text_config.{key} must be an integer >= 1, got {value!r}")
    check_model_folder(DiffusionGemmaForBlockDiffusion, folder, variant)


class DiffusionGemmaLMConfig:
    """The wrapped model's config (every attribute reads through, so diffusers' ``DiffusionGemmaPipeline`` finds
    ``canvas_length`` and ``get_text_config``) plus the ids vispec's decode reads: ``mask_token_id`` (virtual, the
    vocabulary size), ``eos_token_id`` / ``eot_token_id`` (the text config's EOS, or the first two of its list),
    ``pad_token_id``, ``vocab_size`` and ``max_sequence_length``."""

    def __init__(self, config: Any, **ids: Any):
        self.__dict__["_config"] = config
        self.__dict__["_ids"] = ids

    def __getattr__(self, name: str) -> Any:
        ids = self.__dict__["_ids"]
        if name in ids:
            return ids[name]
        return getattr(self.__dict__["_config"], name)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("DiffusionGemmaLMConfig is read-only: change the wrapped model's config")


class _EncoderCall:
    """The encoder as diffusers' pipeline calls it (``past_key_values=`` accepted)."""

    def __init__(self, encoder: nn.Module):
        self._encoder = encoder

    def __call__(self, *args, **kwargs):
        return self._encoder(*args, **_rename_cache(kwargs))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._encoder, name)


class _DecoderCall:
    """The decoder as diffusers' pipeline calls it (its mask builder with ``past_key_values=`` accepted)."""

    def __init__(self, decoder: nn.Module):
        self._decoder = decoder

    def __call__(self, *args, **kwargs):
        return self._decoder(*args, **_rename_cache(kwargs))

    def create_diffusion_decoder_attention_mask(self, *args, **kwargs):
        return self._decoder.create_diffusion_decoder_attention_mask(*args, **_rename_cache(kwargs))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._decoder, name)


class _ModelCall:
    """``DiffusionGemmaModel`` (the ``.model`` of the wrapped model) with diffusers-compatible encoder and decoder."""

    def __init__(self, model: nn.Module):
        self._model = model
        self.encoder = _EncoderCall(model.encoder)
        self.decoder = _DecoderCall(model.decoder)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)


class DiffusionGemmaLM(ModelMixin):
    """transformers' ``DiffusionGemmaForBlockDiffusion`` for :func:`vispec.dllm.decode` and vispec's text pipeline
    (module docstring), and for diffusers' ``DiffusionGemmaPipeline``. :meth:`save_pretrained` / :meth:`from_pretrained`
    write and read transformers' folder layout, so diffusers' pipelines save and load it as a component.

    It speaks the block loop's protocol for uniform-corruption canvas models (``uniform_corruption = True``;
    :mod:`vispec.dllm.uniform` runs the caches over it): :meth:`encode`, :meth:`denoise`, :meth:`new_cache`,
    :meth:`select_cache_rows`, ``canvas_length``, ``vocab_size`` and :attr:`conditioning_dtype`.

    Args:
        model: a ``DiffusionGemmaForBlockDiffusion`` (its weights are used as they are; the adapter holds no copy).
    """

    uniform_corruption = True

    def __init__(self, model: nn.Module):
        super().__init__()
        try:
            from transformers import DiffusionGemmaForBlockDiffusion
        except ImportError as err:  # pragma: no cover - the installed transformers has it
            raise ImportError("DiffusionGemmaLM needs transformers >= 5.24 (DiffusionGemmaForBlockDiffusion)") from err
        if not isinstance(model, DiffusionGemmaForBlockDiffusion):
            raise ValueError(f"model must be a transformers DiffusionGemmaForBlockDiffusion, got {type(model).__name__}")
        self.diffusion_gemma = model
        text = model.config.get_text_config(decoder=True)
        eos = text.eos_token_id
        eos_ids = list(eos) if isinstance(eos, (list, tuple)) else ([] if eos is None else [eos])
        self.canvas_length = int(model.config.canvas_length)
        self.vocab_size = int(text.vocab_size)
        self.config = DiffusionGemmaLMConfig(
            model.config, mask_token_id=self.vocab_size, vocab_size=self.vocab_size,
            eos_token_id=eos_ids[0] if eos_ids else None, eot_token_id=eos_ids[1] if len(eos_ids) > 1 else None,
            pad_token_id=text.pad_token_id, max_sequence_length=text.max_position_embeddings)
        self.model = _ModelCall(model.model)

    @property
    def device(self) -> torch.device:
        return self.diffusion_gemma.device

    @property
    def dtype(self) -> torch.dtype:
        return self.diffusion_gemma.dtype

    def to(self, *args, **kwargs) -> "DiffusionGemmaLM":
        """torch's ``Module.to`` (diffusers' ``ModelMixin.to`` logs a float32-modules notice on every dtype cast, which
        the wrapped transformers model does not ask for)."""
        return nn.Module.to(self, *args, **kwargs)

    # ------------------------------------------------------------------ saving and loading (transformers' layout)
    def save_pretrained(self, save_directory: str | os.PathLike, *, safe_serialization: bool = True,
                        variant: Optional[str] = None, max_shard_size: Optional[int | str] = None,
                        use_flashpack: bool = False, **kwargs: Any) -> None:
        """Write the wrapped model to ``save_directory`` in transformers' layout (its ``save_pretrained``:
        ``config.json``, ``generation_config.json``, ``model.safetensors`` or shards); ``DiffusionGemmaLM.from_pretrained``
        and ``DiffusionGemmaForBlockDiffusion.from_pretrained`` both read it.

        The named keywords are those diffusers' pipeline ``save_pretrained`` hands a component; ``variant`` and
        ``max_shard_size`` (default transformers' own) reach transformers, as does everything in ``kwargs``
        (``push_to_hub``, ``state_dict``, ...). transformers >= 5 writes safetensors only, so
        ``safe_serialization=False`` is refused, as is ``use_flashpack`` (a diffusers-model format)."""
        if safe_serialization is not True:
            raise ValueError("safe_serialization must be True: transformers >= 5 saves DiffusionGemma as safetensors "
                             f"only, got safe_serialization={safe_serialization!r}")
        if use_flashpack:
            raise ValueError("use_flashpack=True saves diffusers models in the FlashPack format; DiffusionGemmaLM is "
                             "saved in transformers' layout: pass use_flashpack=False")
        if max_shard_size is not None:
            kwargs["max_shard_size"] = max_shard_size
        self.diffusion_gemma.save_pretrained(save_directory, variant=variant, **kwargs)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str | os.PathLike, **kwargs: Any) -> "DiffusionGemmaLM":
        """A ``DiffusionGemmaForBlockDiffusion`` loaded by transformers' ``from_pretrained`` (a folder in its layout, as
        :meth:`save_pretrained` or transformers write it, or a hub id), wrapped, in eval mode.

        ``kwargs`` go to transformers' ``from_pretrained`` (``dtype``, ``device_map``, ``subfolder``, ``variant``, ...),
        with what diffusers' pipeline loader passes a diffusers model translated: ``torch_dtype`` is ``dtype`` (the
        name transformers >= 4.56 takes without a deprecation notice); ``low_cpu_mem_usage`` and ``offload_state_dict``
        are dropped (transformers >= 5 always loads lazily); ``use_flashpack`` must be false. A local folder is checked
        first (:func:`check_diffusion_gemma_folder`; nothing is allocated before): it must hold a ``config.json``
        describing a DiffusionGemma with its MoE sizes, and its weight shapes must fit that config. With
        ``output_loading_info=True`` the result is ``(model, loading_info)``, as in transformers."""
        from transformers import DiffusionGemmaForBlockDiffusion

        kwargs = dict(kwargs)
        torch_dtype = kwargs.pop("torch_dtype", None)
        if torch_dtype is not None:
            if kwargs.get("dtype") is not None and kwargs["dtype"] != torch_dtype:
                raise ValueError(f"pass the dtype once: dtype={kwargs['dtype']!r} and torch_dtype={torch_dtype!r} differ")
            kwargs["dtype"] = torch_dtype
        for name in _GONE_LOAD_KEYWORDS:
            kwargs.pop(name, None)
        if kwargs.pop("use_flashpack", False):
            raise ValueError("use_flashpack=True loads diffusers models saved in the FlashPack format; DiffusionGemmaLM "
                             "is saved in transformers' layout: pass use_flashpack=False")
        folder = os.path.join(os.fspath(pretrained_model_name_or_path), kwargs.get("subfolder") or "")
        if os.path.isdir(folder):
            check_diffusion_gemma_folder(folder, kwargs.get("variant"))
        loaded = DiffusionGemmaForBlockDiffusion.from_pretrained(pretrained_model_name_or_path, **kwargs)
        if isinstance(loaded, tuple):  # output_loading_info=True
            return cls(loaded[0]).eval(), *loaded[1:]
        return cls(loaded).eval()

    def forward(self, *args, **kwargs):
        """The wrapped model's forward (``past_key_values=`` accepted as ``cache=``, as diffusers 0.42 passes it)."""
        return self.diffusion_gemma(*args, **_rename_cache(kwargs))

    # ------------------------------------------------------------------ what vispec's decode checks
    def check_decode(self, input_ids: Tensor, attention_mask: Optional[Tensor], options: Any, scheduler: Any) -> None:
        """The decode settings this model cannot run (:func:`vispec.dllm.decode` asks before any work)."""
        if options.block_length != self.canvas_length:
            raise ValueError(f"block_length must equal the model's canvas_length ({self.canvas_length}): DiffusionGemma "
                             f"denoises fixed canvases of that many tokens, got block_length={options.block_length}")
        if options.guidance_scale != 1:
            raise ValueError("guidance_scale != 1 (LLaDA's unsupervised guidance masks the prompt) has no equivalent for "
                             "DiffusionGemma, which has no mask token: pass guidance_scale=1")
        if options.adaptive_block is not None:
            raise ValueError("adaptive_block changes block lengths; DiffusionGemma denoises canvases of canvas_length "
                             "tokens: pass adaptive_block=None")
        if options.speculative is not None:
            raise ValueError("speculative decoding verifies several canvases per forward of a masked model; "
                             "DiffusionGemma's forwards carry self-conditioning and noise from step to step: pass "
                             "speculative=None")
        if int(input_ids.min()) < 0 or int(input_ids.max()) >= self.vocab_size:
            raise ValueError(f"input_ids must lie in [0, {self.vocab_size}) (DiffusionGemma has no mask token to infill), "
                             f"got values in [{int(input_ids.min())}, {int(input_ids.max())}]")

    # ------------------------------------------------------------------ the two passes
    def encode(self, ids: Tensor, seen_mask: Tensor, cache: Any, first: int) -> None:
        """Append the causal encoder's K/V of ``ids [R, n]`` (positions ``first ..``) to ``cache``; ``seen_mask [R,
        first + n]`` marks the real tokens of everything encoded so far (prompt padding is 0), as ``generate``."""
        encoder = self.diffusion_gemma.model.encoder
        positions = torch.arange(first, first + ids.shape[1], dtype=torch.int32, device=ids.device)[None]
        shape = torch.empty((ids.shape[0], ids.shape[1], 0), dtype=self.dtype, device=ids.device)
        masks = encoder.create_masks_for_generate(config=self.diffusion_gemma.config, inputs_embeds=shape,
                                                  attention_mask=seen_mask, position_ids=positions,
                                                  **{_cache_kw(encoder.create_masks_for_generate): cache})
        encoder(input_ids=ids.contiguous(), attention_mask=masks, position_ids=positions,
                **{_cache_kw(encoder.forward): cache})

    def denoise(self, canvas: Tensor, cache: Any, visible: Optional[Tensor], first: int,
                self_conditioning: Optional[Tensor]) -> Tensor:
        """``[R, C, V]`` float32 logits of the decoder over ``canvas [R, C]`` at positions ``first ..``, against the
        encoder ``cache``; ``visible [R, first + C]`` hides padded (and end-of-text-dropped) keys (None: all visible)."""
        model = self.diffusion_gemma
        decoder = model.model.decoder
        shape = torch.empty((canvas.shape[0], canvas.shape[1], 0), dtype=self.dtype, device=canvas.device)
        masks = decoder.create_diffusion_decoder_attention_mask(
            config=model.config, inputs_embeds=shape, decoder_attention_mask=visible,
            **{_cache_kw(decoder.create_diffusion_decoder_attention_mask): cache})
        positions = torch.arange(first, first + canvas.shape[1], dtype=torch.int32, device=canvas.device)[None]
        out = model(decoder_input_ids=canvas, self_conditioning_logits=self_conditioning, decoder_attention_mask=masks,
                    decoder_position_ids=positions, **{_cache_kw(model.forward): cache})
        return out.logits

    def new_cache(self) -> Any:
        """An empty encoder cache of the layout ``generate`` uses (sliding-window layers where the config has them)."""
        from transformers import DynamicCache

        return DynamicCache(config=self.diffusion_gemma.config.get_text_config(decoder=True))

    @staticmethod
    def select_cache_rows(cache: Any, index: Tensor) -> Any:
        """A copy of an encoder cache holding the batch rows ``index`` (:func:`select_rows`)."""
        return select_rows(cache, index)

    @property
    def conditioning_dtype(self) -> torch.dtype:
        """The dtype ``generate`` stores self-conditioning logits in (the token embeddings')."""
        return self.diffusion_gemma.model.decoder.embed_tokens.weight.dtype
