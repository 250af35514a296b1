"""``MaskedDiffusionLMPipeline``: text generation with a masked diffusion LM and an unmasking scheduler.

A diffusers ``DiffusionPipeline`` following diffusers' ``LLaDA2Pipeline`` conventions, with components:

* ``model``: the mask predictor (:class:`vispec.models.llada.LLaDAModelLM`, or any module with
  ``model(input_ids, attention_mask).logits`` and a config holding ``mask_token_id``), or transformers' DiffusionGemma
  wrapped in :class:`vispec.models.diffusion_gemma.DiffusionGemmaLM` (uniform corruption; ``block_length`` = its
  ``canvas_length``; ``strategy="gemma"`` is its own rule, whose step budget is the default per block);
* ``tokenizer``: a transformers tokenizer with a mask token (``<|mdm_mask|>`` for LLaDA);
* ``scheduler``: an unmasking policy from :mod:`vispec.dllm.schedulers` (LLaDA quota, confidence
  threshold, factor, entropy bound, contiguous run, Learn2PD), swappable like diffusers schedulers;
* ``filter`` (optional): a trained Learn2PD filter (:class:`vispec.dllm.learned.ParallelDecodeFilter`), used by
  ``strategy="learn2pd"``.

``__call__`` tokenises the prompts (through the chat template when the tokenizer has one), left-pads
them, decodes with :func:`vispec.dllm.decode` (semi-AR blocks, optional Prefix/Dual KV cache,
per-sequence generators) and returns sequences, texts and per-sequence statistics
(:meth:`vispec.outputs.DecodeOutput.as_dicts`; with ``return_dict=False`` the tuple is ``(sequences, texts)``
as in ``LLaDA2Pipeline`` and the statistics are in ``pipe.last_stats``). Mask tokens typed in a prompt
(``<|mdm_mask|>``) are filled (infilling, :mod:`vispec.dllm.infill`): the output's ``prompt_sequences`` and
``full_texts`` hold the filled prompts.

Users of diffusers' ``LLaDA2Pipeline`` can keep its argument names: ``num_inference_steps`` is steps per
block (``steps`` is LLaDA's total over blocks), ``eos_early_stop``, ``mask_token_id`` and ``eos_token_id``
are accepted. Its ``BlockRefinementScheduler`` is accepted as a scheduler or ``strategy=`` and runs as the equal vispec
policy (:class:`vispec.dllm.TokenEditingScheduler`: threshold commits with a top-k floor and token editing, on
block-causal LLaDA2-layout models, :mod:`vispec.models.llada2`), with ``minimal_topk``, ``editing_threshold`` and
``max_post_steps`` as call arguments; ``top_k`` and ``top_p`` are refused with an error that says what to use
instead. The tokenizer is optional when ``input_ids`` are given.

Guidance follows vispec's one convention (as :class:`vispec.pipelines.LlamaGenPipeline` and diffusers):
``guidance_scale = s`` gives ``ℓ = ℓ_u + s (ℓ_c - ℓ_u)`` with the prompt masked in the unconditional
branch, and ``guidance_scale = 1`` (the default) turns guidance off. LLaDA's ``cfg_scale = w`` is
``guidance_scale = w + 1`` (LLaDA's ``cfg_scale=0.5`` is ``guidance_scale=1.5``).
"""

from __future__ import annotations

import inspect
import os
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional, Sequence, Union

import torch
from diffusers import DiffusionPipeline
from diffusers.utils import BaseOutput

import vispec.models.diffusion_gemma  # noqa: F401 (likewise for a saved DiffusionGemmaLM)
import vispec.models.llada  # noqa: F401 (diffusers resolves the saved model class through this module)
from vispec.checks import check_int
from vispec.dllm import (AdaptiveBlocks, ProphetRule, SelfSpeculation, TokenEditingScheduler, UnmaskingOptions,
                         UnmaskingScheduler, decode, from_block_refinement, make_scheduler)
from vispec.dllm.learned import LearnedFilterScheduler, ParallelDecodeFilter
from vispec.dllm.options import check_blocks
from vispec.dllm.uniform import SharedGenerator
from vispec.models.checkpoints import diffusers_load_kwargs
from vispec.outputs import UNDECIDED, DecodeProgress
from vispec.pipelines.common import PipelineMixin, check_generator
from vispec.pipelines.embedded import resolve_model_path

OUTPUT_TYPES = ("seq", "text")


@dataclass
class MaskedDiffusionLMPipelineOutput(BaseOutput):
    """``sequences [B, gen_length]`` (generated ids), ``texts`` (decoded up to the first EOS; ``None`` for
    ``output_type="seq"``) and ``stats``: one dict per sequence (:meth:`vispec.outputs.DecodeOutput.as_dicts`:
    ``method`` (strategy name), ``scheduler``, ``cache``, ``nfe``, ``tokens``, ``tokens_per_forward``, ``latency_s``).

    Infilling (mask tokens, e.g. ``<|mdm_mask|>``, inside the prompt; :mod:`vispec.dllm.infill`): ``prompt_sequences
    [B, P]`` are the left-padded prompt ids with those positions filled (``cat([prompt_sequences, sequences], 1)``
    is the whole decoded sequence, as Dream's ``diffusion_generate`` returns it), and ``full_texts`` the filled prompt
    followed by the generated text (up to the first EOS; special tokens skipped; ``None`` for ``output_type="seq"``).
    Both are set for every call."""

    sequences: torch.Tensor
    texts: Optional[list[str]]
    stats: list[dict]
    prompt_sequences: Optional[torch.Tensor] = None
    full_texts: Optional[list[str]] = None


def _from_diffusers(scheduler: Any) -> Any:
    """A diffusers ``BlockRefinementScheduler`` as the equal vispec policy (:func:`vispec.dllm.from_block_refinement`,
    LLaDA2's threshold commits with a top-k floor and token editing); anything else unchanged."""
    if type(scheduler).__name__ == "BlockRefinementScheduler" and hasattr(scheduler, "config"):
        return from_block_refinement(scheduler)
    return scheduler


class MaskedDiffusionLMPipeline(PipelineMixin, DiffusionPipeline):
    """Generate text with a masked diffusion LM (module docstring).

    ``default_gen_length`` and ``default_block_length`` are saved with the pipeline, so an embedded model
    carries the lengths it was trained and evaluated with. ``tokenizer`` is optional (``input_ids`` then).
    """

    model_cpu_offload_seq = "model"
    _optional_components = ["tokenizer", "filter"]
    _callback_tensor_inputs = ["sequences", "transfer_index"]
    _applied_callback_inputs = ("sequences",)

    def __init__(self, model: Any, tokenizer: Any, scheduler: UnmaskingScheduler, default_gen_length: int = 128,
                 default_block_length: int = 32, filter: Optional[ParallelDecodeFilter] = None):
        super().__init__()
        scheduler = _from_diffusers(scheduler)
        if filter is not None and not isinstance(filter, ParallelDecodeFilter):
            raise ValueError(f"filter must be a ParallelDecodeFilter (Learn2PD), got {type(filter).__name__}")
        self.register_modules(model=model, tokenizer=tokenizer, scheduler=scheduler, filter=filter)
        self.register_to_config(default_gen_length=default_gen_length, default_block_length=default_block_length)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: Union[str, os.PathLike], **kwargs) -> "MaskedDiffusionLMPipeline":
        """Load a saved pipeline folder, or an embedded model by name (``"vispec/tiny-mdlm"``), offline."""
        kwargs = {**diffusers_load_kwargs(), **kwargs}
        path = resolve_model_path(pretrained_model_name_or_path)
        cls.check_folder(path)
        return super().from_pretrained(path, **kwargs)

    # ------------------------------------------------------------------ inputs
    def _token_id(self, name: str) -> Optional[int]:
        """``name`` (``mask_token_id``, ``eos_token_id``, ``pad_token_id``, ``bos_token_id``) from the tokenizer,
        else from the model's config (a pipeline without a tokenizer)."""
        value = getattr(self.tokenizer, name, None) if self.tokenizer is not None else None
        if value is None:
            value = getattr(getattr(self.model, "config", None), name, None)
        return None if value is None else int(value)

    @property
    def mask_token_id(self) -> int:
        mask_id = self._token_id("mask_token_id")
        if mask_id is None:
            raise ValueError("the tokenizer has no mask token and the model config no mask_token_id: set "
                             "tokenizer.mask_token (e.g. '<|mdm_mask|>') or pass mask_token_id=")
        return mask_id

    def _vocab_width(self) -> Optional[int]:
        """Token ids the model embeds (its padded embedding width), when its config says."""
        config = getattr(self.model, "config", None)
        width = getattr(config, "embedding_size", None) or getattr(config, "vocab_size", None)
        return None if width is None else int(width)

    def _encode(self, prompt: Optional[Union[str, list[str]]], messages: Optional[list], use_chat_template: bool,
                add_generation_prompt: bool) -> list[list[int]]:
        if prompt is not None and messages is not None:
            raise ValueError("pass prompt or messages, not both")
        if self.tokenizer is None:
            raise ValueError("prompt and messages need a tokenizer; this pipeline has none: pass input_ids")
        has_template = bool(getattr(self.tokenizer, "chat_template", None))
        if messages is not None:
            conversations = _conversations(messages)
            if not has_template:
                raise ValueError("messages need a tokenizer with a chat template; pass prompt instead")
        else:
            prompts = [prompt] if isinstance(prompt, str) else prompt
            if not isinstance(prompts, list) or not prompts or not all(isinstance(p, str) for p in prompts):
                raise ValueError(f"prompt must be a string or a non-empty list of strings, got {prompt!r}")
            if not (use_chat_template and has_template):
                return [self.tokenizer(p, add_special_tokens=True)["input_ids"] for p in prompts]
            conversations = [[{"role": "user", "content": p}] for p in prompts]
        texts = [self.tokenizer.apply_chat_template(c, add_generation_prompt=add_generation_prompt, tokenize=False) for c in conversations]
        return [self.tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]

    def prepare_input_ids(
        self, prompt=None, messages=None, input_ids=None, attention_mask=None, use_chat_template=True,
        add_generation_prompt=True, mask_token_id: Optional[int] = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Left-padded ``input_ids`` and ``attention_mask`` ``[B, P]`` from prompts, messages or ids.

        Given ``input_ids`` without ``attention_mask``, leading pad ids (the pad id is known from the tokenizer or
        the model config) are left padding and get mask 0; a pad id after a row's first real token is ambiguous
        and refused. Ids must be integers the model embeds; a mask must be 0/1 with a real token in every row.
        """
        mask_id = self.mask_token_id if mask_token_id is None else mask_token_id
        pad_id = self._token_id("pad_token_id")
        if pad_id is not None and pad_id == mask_id:
            raise ValueError(f"the tokenizer's pad_token_id equals its mask_token_id ({pad_id})")
        if input_ids is not None:
            if prompt is not None or messages is not None:
                raise ValueError("pass input_ids or prompt / messages, not both")
            return self._checked_ids(input_ids, attention_mask, pad_id)
        if attention_mask is not None:
            raise ValueError("attention_mask goes with input_ids; prompts and messages are padded by the pipeline")
        if prompt is None and messages is None:
            raise ValueError("pass prompt, messages or input_ids")
        if pad_id is None:
            raise ValueError("the tokenizer has no pad token (needed for left padding)")
        rows = self._encode(prompt, messages, use_chat_template, add_generation_prompt)
        width = max(len(r) for r in rows)
        if width == 0:
            raise ValueError("the prompt encodes to no tokens")
        return left_pad(rows, pad_id)

    def _checked_ids(self, input_ids: Any, attention_mask: Any, pad_id: Optional[int]) -> tuple[torch.Tensor, torch.Tensor]:
        ids = _as_tensor("input_ids", input_ids)
        if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
            raise TypeError(f"input_ids must hold integer token ids, got dtype {ids.dtype}")
        if ids.dim() == 1:
            ids = ids[None]
        if ids.dim() != 2 or ids.shape[0] == 0 or ids.shape[1] == 0:
            raise ValueError(f"input_ids must be [batch >= 1, length >= 1], got {tuple(ids.shape)}")
        ids = ids.long()
        width = self._vocab_width()
        if (width is not None and int(ids.max()) >= width) or int(ids.min()) < 0:
            raise ValueError(f"input_ids must lie in [0, {width}) (the model's vocabulary), got values in "
                             f"[{int(ids.min())}, {int(ids.max())}]")
        if attention_mask is None:
            return ids, self._inferred_mask(ids, pad_id)
        mask = _as_tensor("attention_mask", attention_mask)
        if mask.dim() == 1:
            mask = mask[None]
        if mask.shape != ids.shape:
            raise ValueError(f"attention_mask must have shape {tuple(ids.shape)}, got {tuple(mask.shape)}")
        if mask.dtype.is_floating_point or mask.dtype.is_complex or not bool(((mask == 0) | (mask == 1)).all()):
            raise ValueError("attention_mask must hold 0 (padding) and 1 (real token), as integers or bools")
        empty = (mask == 0).all(dim=1).nonzero().squeeze(1).tolist()
        if empty:
            raise ValueError(f"attention_mask rows {empty} are all padding (no real token to condition on)")
        return ids, mask.long()

    def _inferred_mask(self, ids: torch.Tensor, pad_id: Optional[int]) -> torch.Tensor:
        """The attention mask of ``ids`` passed without one: leading pad ids are left padding (module docstring)."""
        if pad_id is None or not bool((ids == pad_id).any()):
            return torch.ones_like(ids)
        if pad_id == self._token_id("bos_token_id"):
            raise ValueError(f"input_ids contain the pad id {pad_id}, which is also the BOS id: pass attention_mask "
                             "(padding cannot be told from real tokens)")
        leading = (ids == pad_id).long().cumprod(dim=1).bool()
        inner = (ids == pad_id) & ~leading
        if bool(inner.any()):
            raise ValueError(f"input_ids contain the pad id {pad_id} after a row's first real token (rows "
                             f"{inner.any(dim=1).nonzero().squeeze(1).tolist()}): pass attention_mask, since vispec "
                             "cannot tell padding from a real token there")
        if bool(leading.all(dim=1).any()):
            raise ValueError(f"input_ids rows {leading.all(dim=1).nonzero().squeeze(1).tolist()} are all padding")
        return (~leading).long()

    def check_inputs(self, output_type: str, num_sequences_per_prompt: int, callback: Any,
                     callback_inputs: Sequence[str]) -> list[str]:
        if output_type == "text" and self.tokenizer is None:
            raise ValueError("output_type='text' needs a tokenizer; this pipeline has none: use output_type='seq'")
        return self.check_common_inputs(output_type, OUTPUT_TYPES, "num_sequences_per_prompt", num_sequences_per_prompt,
                                        callback, callback_inputs)

    def _scheduler(self, strategy: Union[str, UnmaskingScheduler, None], threshold: Optional[float],
                   minimal_topk: Optional[int] = None, num_inference_steps: Optional[int] = None,
                   **editing: Any) -> tuple[UnmaskingScheduler, Optional[int]]:
        """The call's policy: ``strategy`` (a name, a vispec scheduler or diffusers' ``BlockRefinementScheduler``) or the
        pipeline's, with the call's ``threshold`` and, for the editing policy, its ``editing`` settings
        (``editing_threshold``, ``max_post_steps``), ``minimal_topk`` and ``num_inference_steps`` (None: the
        scheduler's); and the ``num_inference_steps`` left for a fixed-step policy's options."""
        scheduler = _from_diffusers(self.scheduler if strategy is None else strategy)
        if isinstance(scheduler, str):
            scheduler = make_scheduler(scheduler)
        if not isinstance(scheduler, UnmaskingScheduler):
            raise ValueError(f"strategy must be a strategy name, an UnmaskingScheduler or diffusers' "
                             f"BlockRefinementScheduler, got {type(scheduler).__name__}")
        if isinstance(scheduler, TokenEditingScheduler):  # LLaDA2's names are the policy's own settings
            editing.update(minimal_topk=minimal_topk, num_inference_steps=num_inference_steps)
            num_inference_steps = None
        elif minimal_topk is not None and minimal_topk != 1:
            raise ValueError(f"minimal_topk={minimal_topk!r} has no equivalent here: the adaptive strategies commit at "
                             "least one token per step; for n tokens per step use strategy='llada' with "
                             "num_inference_steps = block_length / n (or strategy='editing', LLaDA2's rule)")
        overrides = {name: value for name, value in editing.items() if value is not None}
        if threshold is not None:
            if "threshold" not in scheduler.config:
                raise ValueError(f"threshold applies to the threshold, contiguous and learn2pd strategies, not "
                                 f"{scheduler.strategy or type(scheduler).__name__!r} (and to the editing strategy, "
                                 "LLaDA2's rule)")
            overrides["threshold"] = threshold
        if not overrides:
            return self._with_filter(scheduler), num_inference_steps
        if not isinstance(scheduler, TokenEditingScheduler) and set(overrides) - {"threshold"}:
            names = sorted(set(overrides) - {"threshold"})
            raise ValueError(f"{', '.join(names)} apply to the editing strategy (LLaDA2's rule; strategy='editing' or "
                             f"diffusers' BlockRefinementScheduler), not {scheduler.strategy or type(scheduler).__name__!r}")
        own_filter = getattr(scheduler, "filter", None)
        # diffusers' from_config drops keys listed in `_use_default_values`: pass the settings alone
        settings = {k: v for k, v in scheduler.config.items() if not k.startswith("_")}
        scheduler = type(scheduler).from_config({**settings, **overrides})
        if own_filter is not None:
            scheduler.filter = own_filter
        return self._with_filter(scheduler), num_inference_steps

    def _with_filter(self, scheduler: UnmaskingScheduler) -> UnmaskingScheduler:
        """A Learn2PD scheduler without a filter of its own gets the pipeline's ``filter`` component (a copy of the
        scheduler: the pipeline's own scheduler object is not changed)."""
        if not isinstance(scheduler, LearnedFilterScheduler) or scheduler.filter is not None:
            return scheduler
        if self.filter is None:
            raise ValueError("strategy 'learn2pd' needs a trained filter: this pipeline has no filter component (train "
                             "one with `vispec train filter`, or pass LearnedFilterScheduler(filter=...))")
        return LearnedFilterScheduler(threshold=scheduler.config.threshold, filter=self.filter)

    def decode_texts(self, sequences: torch.Tensor, eos_token_id: Optional[int] = None,
                     prompts: Optional[list[list[int]]] = None) -> list[str]:
        """Text of each generated row up to its first EOS or end-of-turn token, special tokens skipped; with
        ``prompts`` (one id list per row, padding dropped), each row's prompt ids come first (``full_texts``)."""
        eos = getattr(self.tokenizer, "eos_token_id", None) if eos_token_id is None else eos_token_id
        stops = {eos, self._eot_token_id()} - {None}
        texts = []
        for i, row in enumerate(sequences.tolist()):
            cut = next((i for i, token in enumerate(row) if token in stops), len(row))
            row = row[:cut] if prompts is None else prompts[i] + row[:cut]
            texts.append(self.tokenizer.decode(row, skip_special_tokens=True).strip())
        return texts

    def _eot_token_id(self) -> Optional[int]:
        eot = getattr(getattr(self.model, "config", None), "eot_token_id", None)
        if eot is None and "<|eot_id|>" in self.tokenizer.get_vocab():
            eot = self.tokenizer.convert_tokens_to_ids("<|eot_id|>")
        return eot

    # ------------------------------------------------------------------ call
    def _options(self, scheduler: UnmaskingScheduler, steps: Optional[int], num_inference_steps: Optional[int],
                 **settings: Any) -> UnmaskingOptions:
        """The decode's options from the call's (user and LLaDA2) names: LLaDA's ``steps`` (over all blocks) or LLaDA2's
        ``num_inference_steps`` (per block); fixed-step policies default to one token per step, adaptive ones take
        neither."""
        if steps is not None and num_inference_steps is not None:
            raise ValueError("pass steps (total over all blocks, as LLaDA's generate) or num_inference_steps (per block, "
                             "as diffusers' LLaDA2Pipeline), not both")
        if not scheduler.fixed_steps and (steps is not None or num_inference_steps is not None):
            raise ValueError(f"steps / num_inference_steps apply to fixed-step strategies ('llada'); "
                             f"{type(scheduler).__name__} commits until each block is complete")
        if num_inference_steps is not None:
            check_int("num_inference_steps", num_inference_steps, minimum=1, hint=" (steps per block)")
        if scheduler.fixed_steps and steps is None and num_inference_steps is None:
            own = getattr(scheduler, "default_steps_per_block", None)  # a budget of its own (DiffusionGemma's rule)
            steps = settings["gen_length"] if own is None else own * check_blocks(settings["gen_length"],
                                                                                  settings["block_length"])
        options = UnmaskingOptions(steps=steps, **settings)
        if num_inference_steps is not None:
            options = replace(options, steps=num_inference_steps * options.num_blocks)
        return options

    def apply_callback_outputs(self, edits: dict[str, Any], progress: DecodeProgress) -> Optional[dict]:
        """A returned ``sequences`` (mask id where undecided) replaces the canvas, and a changed
        ``pipe._guidance_scale`` the guidance scale, before the next forward (:func:`vispec.dllm.decode`)."""
        edit: dict[str, Any] = {}
        if "guidance_scale" in edits:
            edit["guidance_scale"] = edits["guidance_scale"]
        if "sequences" in edits:
            sequences = edits["sequences"]
            if not isinstance(sequences, torch.Tensor) or sequences.dtype.is_floating_point or sequences.dtype == torch.bool:
                raise ValueError(f"callback_on_step_end must return 'sequences' as an integer tensor of shape "
                                 f"{tuple(progress.tokens.shape)}, got {sequences!r}")
            sequences = sequences.long()
            edit["tokens"] = torch.where(sequences == self._mask_id, UNDECIDED, sequences)
        return edit

    def _decode_settings(self, *, gen_length: Optional[int], block_length: Optional[int],
                         num_inference_steps: Optional[int], temperature: float, guidance_scale: float,
                         strategy: Union[str, UnmaskingScheduler, None], threshold: Optional[float], cache: str,
                         early_stop_eos: Optional[bool], logits_eos_inf: bool, confidence_eos_eot_inf: bool,
                         compile: bool, eotp: bool, early_commit: Optional[ProphetRule],
                         adaptive_block: Optional[AdaptiveBlocks], speculative: Union[int, str, SelfSpeculation, None],
                         cache_reload_steps: int, steps: Optional[int], eos_early_stop: Optional[bool],
                         mask_token_id: Optional[int], eos_token_id: Optional[int], top_k: Optional[int],
                         top_p: Optional[float], minimal_topk: Optional[int], editing_threshold: Optional[float],
                         max_post_steps: Optional[int]) -> tuple[UnmaskingScheduler, UnmaskingOptions, int, Optional[int]]:
        """A call's policy, its decode options (checked once, when built) from the user's and LLaDA2's names, and its
        mask and EOS ids (:meth:`__call__`'s arguments of the same names)."""
        for name, value in (("top_k", top_k), ("top_p", top_p)):
            if value is not None:
                raise ValueError(f"{name} (LLaDA2's candidate filtering) has no equivalent here: candidates are arg-max "
                                 "(temperature=0) or Gumbel-max samples from the full softmax at temperature=")
        if eos_early_stop is not None and early_stop_eos is not None and eos_early_stop != early_stop_eos:
            raise ValueError("early_stop_eos and eos_early_stop (its LLaDA2 name) disagree; pass one")
        width = self._vocab_width()
        for name, value in (("mask_token_id", mask_token_id), ("eos_token_id", eos_token_id)):
            if value is not None:
                check_int(name, value, minimum=0, maximum=None if width is None else width - 1)
        scheduler, num_inference_steps = self._scheduler(
            strategy, threshold, editing_threshold=editing_threshold, max_post_steps=max_post_steps,
            minimal_topk=minimal_topk, num_inference_steps=num_inference_steps)
        gen_length = self.config.default_gen_length if gen_length is None else gen_length
        if block_length is None:  # the scheduler's (BlockRefinementScheduler's block_length), else the pipeline's
            block_length = scheduler.config.get("block_length") or self.config.default_block_length
            if isinstance(gen_length, int) and gen_length < block_length:  # the default block never exceeds the canvas
                block_length = gen_length
        mask_id = self.mask_token_id if mask_token_id is None else mask_token_id
        eos_id = self._token_id("eos_token_id") if eos_token_id is None else eos_token_id
        options = self._options(
            scheduler, steps, num_inference_steps, gen_length=gen_length, block_length=block_length,
            temperature=temperature, guidance_scale=guidance_scale, cache=cache, cache_reload_steps=cache_reload_steps,
            mask_token_id=mask_id, eos_token_id=eos_id, logits_eos_inf=logits_eos_inf,
            confidence_eos_eot_inf=confidence_eos_eot_inf,
            early_stop_eos=next((v for v in (early_stop_eos, eos_early_stop) if v is not None), True),
            compile=compile, eotp=eotp, early_commit=early_commit, adaptive_block=adaptive_block,
            speculative=speculative)
        return scheduler, options, mask_id, eos_id

    def check_decoding(self, **decoding: Any) -> None:
        """What a call with these decoding keywords (:meth:`__call__`'s, e.g. ``strategy``, ``cache``, ``gen_length``,
        ``speculative``, ``eotp``; the others at their defaults) refuses before its first forward, whatever the
        prompt: the options' checks and the model's (:func:`vispec.dllm.checks.check_decoding`: the model family's
        caches and rules, the policy's limits), as a ``ValueError`` naming the argument. For settings checked once
        before many calls (``vispec bench text``'s rows, lm-eval's ``vispec-dllm``); it reads the model's class and
        config, never its weights, so it also runs on :meth:`from_pretrained_without_weights`'s pipeline."""
        from vispec.dllm.checks import check_decoding

        names = [n for n in inspect.signature(self._decode_settings).parameters]
        unknown = sorted(set(decoding) - set(names))
        if unknown:
            raise ValueError(f"check_decoding takes the decoding keywords of a call {names}, got {unknown}")
        scheduler, options, _, _ = self._decode_settings(**{n: decoding.get(n, _CALL_DEFAULTS[n]) for n in names})
        check_decoding(self.model, options, scheduler)

    @classmethod
    def from_pretrained_without_weights(cls, pretrained_model_name_or_path: Union[str, os.PathLike],
                                        **kwargs) -> Optional["MaskedDiffusionLMPipeline"]:
        """The saved pipeline with its model built from its config on the meta device (no weights read, nothing
        allocated; the tokenizer, scheduler and filter loaded as usual), for :meth:`check_decoding` before the weights
        load; None when the model cannot be built so (:func:`vispec.models.checkpoints.build_component_on_meta`).
        Not for decoding: its model has no values."""
        from diffusers.utils import logging as diffusers_logging

        from vispec.models.checkpoints import build_component_on_meta

        path = resolve_model_path(pretrained_model_name_or_path)
        model = build_component_on_meta(path, "model")
        if model is None:
            return None
        bar = diffusers_logging.is_progress_bar_enabled()
        diffusers_logging.disable_progress_bar()  # a check, not a load: no "Loading pipeline components" bar
        try:
            return cls.from_pretrained(path, model=model, **kwargs)
        finally:
            if bar:
                diffusers_logging.enable_progress_bar()

    @torch.no_grad()
    def __call__(
        self,
        prompt: Union[str, list[str], None] = None,
        messages: Optional[list] = None,
        input_ids: Optional[torch.Tensor] = None,
        attention_mask: Optional[torch.Tensor] = None,
        use_chat_template: bool = True,
        add_generation_prompt: bool = True,
        gen_length: Optional[int] = None,
        block_length: Optional[int] = None,
        num_inference_steps: Optional[int] = None,
        temperature: float = 0.0,
        guidance_scale: float = 1.0,
        strategy: Union[str, UnmaskingScheduler, None] = None,
        threshold: Optional[float] = None,
        cache: str = "none",
        early_stop_eos: Optional[bool] = None,
        logits_eos_inf: bool = False,
        confidence_eos_eot_inf: bool = False,
        num_sequences_per_prompt: int = 1,
        generator: Union[torch.Generator, list[torch.Generator], None] = None,
        output_type: Optional[str] = None,
        return_dict: bool = True,
        callback_on_step_end: Optional[Callable[["MaskedDiffusionLMPipeline", int, int, dict], Optional[dict]]] = None,
        callback_on_step_end_tensor_inputs: Sequence[str] = ("sequences",),
        compile: bool = False,
        eotp: bool = False,
        early_commit: Optional[ProphetRule] = None,
        adaptive_block: Optional[AdaptiveBlocks] = None,
        speculative: Union[int, str, SelfSpeculation, None] = None,
        cache_reload_steps: int = 8,
        steps: Optional[int] = None,
        eos_early_stop: Optional[bool] = None,
        mask_token_id: Optional[int] = None,
        eos_token_id: Optional[int] = None,
        top_k: Optional[int] = None,
        top_p: Optional[float] = None,
        minimal_topk: Optional[int] = None,
        editing_threshold: Optional[float] = None,
        max_post_steps: Optional[int] = None,
    ) -> Union[MaskedDiffusionLMPipelineOutput, tuple]:
        """Generate text.

        Args:
            prompt, messages, input_ids, attention_mask: the prompts (strings; chat messages, one conversation as
                a list of ``{"role", "content"}`` dicts or a batch as a list of them; or left-padded ids, whose
                mask is inferred from leading pad ids when not given: :meth:`prepare_input_ids`).
            use_chat_template, add_generation_prompt: apply the tokenizer's chat template when it has one.
            gen_length, block_length: canvas and semi-AR block lengths (default: the pipeline's config).
            num_inference_steps: steps per block for fixed-step strategies (``"llada"``) and the editing policy's step
                budget per block, as in diffusers' ``LLaDA2Pipeline``; ``steps``: the same as a total over all blocks (LLaDA's ``generate``). Default:
                one token per step (``steps = gen_length``). Adaptive strategies take neither.
            temperature: 0 for arg-max candidates, else float64 Gumbel-max sampling.
            guidance_scale: unsupervised CFG scale ``s >= 1`` (``ℓ = ℓ_u + s (ℓ_c - ℓ_u)``, the prompt masked in
                the unconditional branch); 1 (default) = off. LLaDA's ``cfg_scale = w`` is ``guidance_scale = w + 1``.
            strategy: ``"llada"``, ``"threshold"``, ``"factor"``, ``"entropy"``, ``"contiguous"``, ``"learn2pd"`` (needs the ``filter`` component) or a scheduler object (default:
                the pipeline's ``scheduler``); ``threshold`` overrides τ of the threshold, contiguous and learn2pd rules.
            cache: ``"none"``, ``"prefix"`` or ``"dual"`` (Fast-dLLM block KV caches), or ``"dkv"`` (dKV-Cache's
                delayed caching, a full refresh every ``cache_reload_steps`` forwards of a block).
            early_stop_eos (LLaDA2: ``eos_early_stop``): once EOS is committed, the rest of the canvas becomes EOS
                without more forwards (default True).
            logits_eos_inf, confidence_eos_eot_inf: LLaDA's EOS options (spec: intended semantics).
            generator: one ``torch.Generator`` or a list with one per sequence; or a :class:`vispec.dllm.SharedGenerator`
                (batch-wide draws in transformers' / diffusers' order, for DiffusionGemma's token equality with them).
            output_type: ``"text"`` (sequences and texts; the default with a tokenizer) or ``"seq"`` (sequences
                only; the default without one).
            return_dict: False returns ``(sequences, texts)`` as ``LLaDA2Pipeline`` does; the per-sequence
                statistics are then in ``pipe.last_stats`` (always set after a call).
            callback_on_step_end: ``f(pipe, step, step, callback_kwargs)`` after every forward (or a diffusers
                ``PipelineCallback``); ``sequences`` (generated canvas, mask id where undecided) and
                ``transfer_index`` are copies. A returned ``sequences`` replaces the canvas before the next
                forward (committed tokens may change, masked ones be committed; not re-masked), as
                ``LLaDA2Pipeline`` applies a returned block; changing ``pipe._guidance_scale`` changes the guidance
                of a guided call; setting ``pipe._interrupt = True`` stops and returns what is done (mask ids
                where undecided, ``"interrupted": True`` in the statistics).
            compile: run the model's forwards through ``torch.compile(fullgraph=True)`` with static shapes
                (:func:`vispec.dllm.decode`: the whole batch in every forward, ``"prefix"`` spans compiled with
                ``dynamic=True``); the graphs are cached on ``self.model``, so only the first call with a new
                shape compiles. Same tokens as eager (the default, False) up to float rounding of fused kernels.
            eotp: Learn2PD's end-of-text prediction: cut each row's canvas after an accepted (or committed) EOS, else
                after the masked position predicting EOS most confidently; the cut tail is EOS and never computed again.
            early_commit: a :class:`vispec.dllm.ProphetRule` (Prophet: commit every remaining mask by arg-max once the
                mean top-2 logit gap clears a threshold that falls with progress).
            adaptive_block: a :class:`vispec.dllm.AdaptiveBlocks` (AdaBlock: each block ends at the most confident
                predicted delimiter in a look-ahead window; delimiter ids from the tokenizer).
            speculative: exact self-speculative decoding (:mod:`vispec.dllm.speculative`): a draft length ``k``,
                ``"auto"`` (``k`` chosen per forward by expected steps per second, :mod:`vispec.dllm.draft_length`) or
                a :class:`vispec.dllm.SelfSpeculation`; each forward verifies ``k`` canvases and advances 1 to ``k``
                steps of the stepwise run, whose tokens it returns exactly (any strategy, any temperature; caches
                ``"none"``, ``"prefix"`` or ``"dual"``, each reproducing the stepwise run with that cache; none of
                eotp, early_commit, adaptive_block, compile).
            mask_token_id, eos_token_id: override the tokenizer's (or, without a tokenizer, the model config's).
            top_k, top_p: ``LLaDA2Pipeline``'s candidate filters, which have no equivalent here (they raise, saying
                what to use).
            minimal_topk, editing_threshold, max_post_steps: ``LLaDA2Pipeline``'s settings of the editing policy
                (``strategy="editing"`` or diffusers' ``BlockRefinementScheduler``, :mod:`vispec.dllm.editing`), which
                also reads ``num_inference_steps`` as its step budget per block; None: the scheduler's. For the other
                strategies only ``minimal_topk=1`` has an equivalent (they commit at least one token per step).
        """
        # 1. check inputs; the options (checked once, when built) from the user's and LLaDA2's names
        if output_type is None:
            output_type = "text" if self.tokenizer is not None else "seq"
        tensor_inputs = self.check_inputs(output_type, num_sequences_per_prompt, callback_on_step_end,
                                          callback_on_step_end_tensor_inputs)
        scheduler, options, mask_id, eos_id = self._decode_settings(
            gen_length=gen_length, block_length=block_length, num_inference_steps=num_inference_steps,
            temperature=temperature, guidance_scale=guidance_scale, strategy=strategy, threshold=threshold, cache=cache,
            early_stop_eos=early_stop_eos, logits_eos_inf=logits_eos_inf, confidence_eos_eot_inf=confidence_eos_eot_inf,
            compile=compile, eotp=eotp, early_commit=early_commit, adaptive_block=adaptive_block, speculative=speculative,
            cache_reload_steps=cache_reload_steps, steps=steps, eos_early_stop=eos_early_stop,
            mask_token_id=mask_token_id, eos_token_id=eos_token_id, top_k=top_k, top_p=top_p, minimal_topk=minimal_topk,
            editing_threshold=editing_threshold, max_post_steps=max_post_steps)
        gen_length = options.gen_length
        ids, mask = self.prepare_input_ids(prompt, messages, input_ids, attention_mask, use_chat_template, add_generation_prompt,
                                           mask_token_id=mask_id)
        batch = ids.shape[0] * num_sequences_per_prompt
        if not isinstance(generator, SharedGenerator):  # the reference implementations' draws (vispec.dllm.uniform)
            check_generator(generator, batch)
        device = self._execution_device
        ids = ids.repeat_interleave(num_sequences_per_prompt, 0).to(device)
        mask = mask.repeat_interleave(num_sequences_per_prompt, 0).to(device)
        self.start_call(float(guidance_scale), options.steps if scheduler.fixed_steps else gen_length)
        self._mask_id = mask_id

        # 2. decode (the checks that need the model run first, in decode), with progress bars over blocks and tokens
        num_blocks = options.num_blocks
        with self.progress_bar(total=num_blocks) as block_bar, self.progress_bar(total=batch * gen_length) as token_bar:
            blocks_done = [0]
            views = {"sequences": lambda p: p.tokens.masked_fill(p.tokens == UNDECIDED, mask_id),  # mask id where undecided
                     "transfer_index": lambda p: p.details["transfer_index"]}
            on_token = self.step_callback(token_bar, callback_on_step_end, tensor_inputs, views)

            def on_step(progress: DecodeProgress) -> Optional[dict]:
                block_bar.update(progress.details["block"] - blocks_done[0])
                blocks_done[0] = progress.details["block"]
                return on_token(progress)

            out = decode(self.model, ids, mask, options, scheduler=scheduler, generator=generator, callback=on_step)
            block_bar.update(num_blocks - blocks_done[0])

        # 3. post-process
        prompt_ids = ids if out.prompt_tokens is None else out.prompt_tokens  # filled prompts (infilling)
        texts = full_texts = None
        if output_type == "text":
            texts = self.decode_texts(out.tokens, eos_id)
            prompts = [[t for t, real in zip(row, keep) if real] for row, keep in zip(prompt_ids.tolist(),
                                                                                     mask.bool().tolist())]
            full_texts = self.decode_texts(out.tokens, eos_id, prompts)
        stats = self.last_stats = out.as_dicts()
        self.maybe_free_model_hooks()
        if not return_dict:
            return (out.tokens, texts)
        return MaskedDiffusionLMPipelineOutput(sequences=out.tokens, texts=texts, stats=stats,
                                               prompt_sequences=prompt_ids, full_texts=full_texts)


# the defaults of a call's keywords, which check_decoding gives the keywords it is not passed
_CALL_DEFAULTS = {name: p.default for name, p in inspect.signature(MaskedDiffusionLMPipeline.__call__).parameters.items()}


def left_pad(rows: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token id lists as left-padded ``ids [B, P]`` and ``attention_mask [B, P]`` (1 on the tokens), ``P`` the longest."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):  # tokenisation, not a hot path
        ids[i, width - len(row):] = torch.tensor(row, dtype=torch.long)
        mask[i, width - len(row):] = 1
    return ids, mask


def _as_tensor(name: str, value: Any) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        if value.device.type == "meta":
            raise ValueError(f"{name} is on the meta device (it has no values)")
        return value.cpu()
    try:
        return torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError) as err:
        raise TypeError(f"{name} must be a tensor or a (nested) list of integers, got {type(value).__name__}") from err


def _conversations(messages: Any) -> list[list[dict]]:
    """``messages`` as a batch of conversations: one conversation (a list of ``{"role", "content"}`` dicts) or a
    list of them."""
    expected = ("messages must be one conversation, a list of {'role': ..., 'content': ...} dicts, or a batch of "
                "them (a list of such lists)")
    if not isinstance(messages, (list, tuple)) or not messages:
        raise TypeError(f"{expected}; got {('a ' + type(messages).__name__) if messages else repr(messages)}")
    conversations = list(messages) if isinstance(messages[0], (list, tuple)) else [messages]
    for conversation in conversations:
        if not isinstance(conversation, (list, tuple)) or not conversation:
            raise TypeError(f"{expected}; got an entry {conversation!r}")
        for message in conversation:
            if isinstance(message, str):
                raise TypeError(f"{expected}; got the string {message!r} (plain strings go in prompt=)")
            if not isinstance(message, dict) or not isinstance(message.get("role"), str) \
                    or not isinstance(message.get("content"), str):
                raise TypeError(f"{expected}; got {message!r}")
    return [list(c) for c in conversations]
