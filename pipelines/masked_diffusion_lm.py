"""``MaskedDiffusionLMPipeline``: text generation with a masked diffusion LM and an unmasking scheduler.

A diffusers ``DiffusionPipeline`` following diffusers' ``LLaDA2Pipeline`` conventions, with components:

* ``model``: the mask predictor (:class:`vispec.models.llada.LLaDAModelLM`, or any module with
  ``model(input_ids, attention_mask).logits`` and a config holding ``mask_token_id``);
* ``tokenizer``: a transformers tokenizer with a mask token (``<|mdm_mask|>`` for LLaDA);
* ``scheduler``: an unmasking policy from :mod:`vispec.dllm.schedulers` (LLaDA quota, confidence
  threshold, factor, entropy bound), swappable like diffusers schedulers.

``__call__`` tokenises the prompts (through the chat template when the tokenizer has one), left-pads
them, decodes with :func:`vispec.dllm.decode` (semi-AR blocks, optional Prefix/Dual KV cache,
per-sequence generators) and returns sequences, texts and per-sequence statistics
(:meth:`vispec.outputs.DecodeOutput.as_dicts`).

Guidance follows vispec's one convention (as :class:`vispec.pipelines.LlamaGenPipeline` and diffusers):
``guidance_scale = s`` gives ``ℓ = ℓ_u + s (ℓ_c - ℓ_u)`` with the prompt masked in the unconditional
branch, and ``guidance_scale = 1`` (the default) turns guidance off. LLaDA's ``cfg_scale = w`` is
``guidance_scale = w + 1`` (LLaDA's ``cfg_scale=0.5`` is ``guidance_scale=1.5``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, Union

import torch
from diffusers import DiffusionPipeline
from diffusers.utils import BaseOutput

import vispec.models.llada  # noqa: F401 (diffusers resolves the saved model class through this module)
from vispec.dllm import CACHES, UnmaskingScheduler, check_decode_args, decode, make_scheduler
from vispec.models.checkpoints import diffusers_load_kwargs
from vispec.outputs import UNDECIDED, DecodeProgress
from vispec.pipelines.common import StepCallbackMixin
from vispec.pipelines.embedded import resolve_model_path

OUTPUT_TYPES = ("seq", "text")


@dataclass
class MaskedDiffusionLMPipelineOutput(BaseOutput):
    """``sequences [B, gen_length]`` (generated ids), ``texts`` (decoded up to the first EOS; ``None`` for
    ``output_type="seq"``) and ``stats``: one dict per sequence (:meth:`vispec.outputs.DecodeOutput.as_dicts`:
    ``method`` (strategy name), ``scheduler``, ``cache``, ``nfe``, ``tokens``, ``tokens_per_forward``, ``latency_s``)."""

    sequences: torch.Tensor
    texts: Optional[list[str]]
    stats: list[dict]


class MaskedDiffusionLMPipeline(DiffusionPipeline, StepCallbackMixin):
    """Generate text with a masked diffusion LM (module docstring).

    ``default_gen_length`` and ``default_block_length`` are saved with the pipeline, so an embedded model
    carries the lengths it was trained and evaluated with.
    """

    model_cpu_offload_seq = "model"
    _callback_tensor_inputs = ["sequences", "transfer_index"]

    def __init__(self, model: Any, tokenizer: Any, scheduler: UnmaskingScheduler, default_gen_length: int = 128,
                 default_block_length: int = 32):
        super().__init__()
        self.register_modules(model=model, tokenizer=tokenizer, scheduler=scheduler)
        self.register_to_config(default_gen_length=default_gen_length, default_block_length=default_block_length)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: Union[str, os.PathLike], **kwargs) -> "MaskedDiffusionLMPipeline":
        """Load a saved pipeline folder, or an embedded model by name (``"vispec/tiny-mdlm"``), offline."""
        kwargs = {**diffusers_load_kwargs(), **kwargs}
        return super().from_pretrained(resolve_model_path(pretrained_model_name_or_path), **kwargs)

    # ------------------------------------------------------------------ inputs
    @property
    def mask_token_id(self) -> int:
        mask_id = getattr(self.tokenizer, "mask_token_id", None)
        if mask_id is None:
            raise ValueError("the tokenizer has no mask token (set tokenizer.mask_token, e.g. '<|mdm_mask|>')")
        return int(mask_id)

    def _encode(self, prompt: Optional[Union[str, list[str]]], messages: Optional[list], use_chat_template: bool,
                add_generation_prompt: bool) -> list[list[int]]:
        if prompt is not None and messages is not None:
            raise ValueError("pass prompt or messages, not both")
        has_template = bool(getattr(self.tokenizer, "chat_template", None))
        if messages is not None:
            if not has_template:
                raise ValueError("messages need a tokenizer with a chat template; pass prompt instead")
            conversations = messages if messages and isinstance(messages[0], list) else [messages]
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
        add_generation_prompt=True,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Left-padded ``input_ids`` and ``attention_mask`` ``[B, P]`` from prompts, messages or ids."""
        pad_id = getattr(self.tokenizer, "pad_token_id", None)
        if pad_id is None:
            raise ValueError("the tokenizer has no pad token (needed for left padding)")
        if pad_id == self.mask_token_id:
            raise ValueError(f"the tokenizer's pad_token_id equals its mask_token_id ({pad_id})")
        if input_ids is not None:
            if prompt is not None or messages is not None:
                raise ValueError("pass input_ids or prompt / messages, not both")
            input_ids = torch.as_tensor(input_ids)
            if input_ids.dim() == 1:
                input_ids = input_ids[None]
            if input_ids.dim() != 2 or input_ids.shape[1] == 0:
                raise ValueError(f"input_ids must be [batch, length >= 1], got {tuple(input_ids.shape)}")
            mask = torch.ones_like(input_ids) if attention_mask is None else torch.as_tensor(attention_mask)
            if mask.shape != input_ids.shape:
                raise ValueError(f"attention_mask must have shape {tuple(input_ids.shape)}, got {tuple(mask.shape)}")
            return input_ids.long(), mask.long()
        if prompt is None and messages is None:
            raise ValueError("pass prompt, messages or input_ids")
        rows = self._encode(prompt, messages, use_chat_template, add_generation_prompt)
        width = max(len(r) for r in rows)
        if width == 0:
            raise ValueError("the prompt encodes to no tokens")
        ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
        mask = torch.zeros(len(rows), width, dtype=torch.long)
        for i, row in enumerate(rows):  # tokenisation, not a hot path
            ids[i, width - len(row):] = torch.tensor(row, dtype=torch.long)
            mask[i, width - len(row):] = 1
        return ids, mask

    def check_inputs(self, output_type: str, cache: str, num_sequences_per_prompt: int, callback_inputs: Sequence[str]) -> None:
        self.check_common_inputs(output_type, OUTPUT_TYPES, "num_sequences_per_prompt", num_sequences_per_prompt, callback_inputs)
        if cache not in CACHES:
            raise ValueError(f"cache must be one of {CACHES}, got {cache!r}")

    def _scheduler(self, strategy: Union[str, UnmaskingScheduler, None], threshold: Optional[float]) -> UnmaskingScheduler:
        scheduler = self.scheduler if strategy is None else strategy
        if isinstance(scheduler, str):
            if threshold is not None and scheduler != "threshold":
                raise ValueError(f"threshold applies to the threshold strategy, not {scheduler!r}")
            return make_scheduler(scheduler, **({} if threshold is None else {"threshold": threshold}))
        if not isinstance(scheduler, UnmaskingScheduler):
            raise ValueError(f"strategy must be a strategy name or an UnmaskingScheduler, got {type(scheduler).__name__}")
        if threshold is not None:
            if "threshold" not in scheduler.config:
                raise ValueError(f"threshold applies to the threshold strategy, not {type(scheduler).__name__}")
            scheduler = type(scheduler).from_config({**scheduler.config, "threshold": threshold})
        return scheduler

    def decode_texts(self, sequences: torch.Tensor) -> list[str]:
        """Text of each generated row up to its first EOS or end-of-turn token, special tokens skipped."""
        stops = {getattr(self.tokenizer, "eos_token_id", None), self._eot_token_id()} - {None}
        texts = []
        for row in sequences.tolist():
            cut = next((i for i, token in enumerate(row) if token in stops), len(row))
            row = row[:cut]
            texts.append(self.tokenizer.decode(row, skip_special_tokens=True).strip())
        return texts

    def _eot_token_id(self) -> Optional[int]:
        eot = getattr(getattr(self.model, "config", None), "eot_token_id", None)
        if eot is None and "<|eot_id|>" in self.tokenizer.get_vocab():
            eot = self.tokenizer.convert_tokens_to_ids("<|eot_id|>")
        return eot

    # ------------------------------------------------------------------ call
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
        early_stop_eos: bool = True,
        logits_eos_inf: bool = False,
        confidence_eos_eot_inf: bool = False,
        num_sequences_per_prompt: int = 1,
        generator: Union[torch.Generator, list[torch.Generator], None] = None,
        output_type: str = "text",
        return_dict: bool = True,
        callback_on_step_end: Optional[Callable[["MaskedDiffusionLMPipeline", int, int, dict], Optional[dict]]] = None,
        callback_on_step_end_tensor_inputs: Sequence[str] = ("sequences",),
        compile: bool = False,
    ) -> Union[MaskedDiffusionLMPipelineOutput, tuple]:
        """Generate text.

        Args:
            prompt, messages, input_ids, attention_mask: the prompts (strings; chat messages; or left-padded ids).
            use_chat_template, add_generation_prompt: apply the tokenizer's chat template when it has one.
            gen_length, block_length: canvas and semi-AR block lengths (default: the pipeline's config).
            num_inference_steps: total steps for fixed-step schedulers (default: ``gen_length``, one token per step).
            temperature: 0 for arg-max candidates, else float64 Gumbel-max sampling.
            guidance_scale: unsupervised CFG scale ``s >= 1`` (``ℓ = ℓ_u + s (ℓ_c - ℓ_u)``, the prompt masked in
                the unconditional branch); 1 (default) = off. LLaDA's ``cfg_scale = w`` is ``guidance_scale = w + 1``.
            strategy: ``"llada"``, ``"threshold"``, ``"factor"``, ``"entropy"`` or a scheduler object (default:
                the pipeline's ``scheduler``); ``threshold`` overrides τ of the threshold rule.
            cache: ``"none"``, ``"prefix"`` or ``"dual"`` (Fast-dLLM block KV caches).
            early_stop_eos: once EOS is committed, the rest of the canvas becomes EOS without more forwards.
            logits_eos_inf, confidence_eos_eot_inf: LLaDA's EOS options (spec: intended semantics).
            generator: one ``torch.Generator`` or a list with one per sequence.
            output_type: ``"text"`` (sequences and texts) or ``"seq"`` (sequences only).
            callback_on_step_end: ``f(pipe, step, step, callback_kwargs)`` after every forward; ``sequences``
                (generated canvas, mask id where undecided) and ``transfer_index`` are copies.
            compile: run the model's forwards through ``torch.compile(fullgraph=True)`` with static shapes
                (:func:`vispec.dllm.decode`: the whole batch in every forward, ``"prefix"`` spans compiled with
                ``dynamic=True``); the graphs are cached on ``self.model``, so only the first call with a new
                shape compiles. Same tokens as eager (the default, False) up to float rounding of fused kernels.
        """
        # 1. check inputs
        self.check_inputs(output_type, cache, num_sequences_per_prompt, callback_on_step_end_tensor_inputs)
        gen_length = self.config.default_gen_length if gen_length is None else gen_length
        if block_length is None:  # the default block never exceeds the canvas
            block_length = self.config.default_block_length
            if isinstance(gen_length, int) and gen_length < block_length:
                block_length = gen_length
        scheduler = self._scheduler(strategy, threshold)
        steps = (num_inference_steps or gen_length) if scheduler.fixed_steps else num_inference_steps
        ids, mask = self.prepare_input_ids(prompt, messages, input_ids, attention_mask, use_chat_template, add_generation_prompt)
        ids = ids.repeat_interleave(num_sequences_per_prompt, 0).to(self._execution_device)
        mask = mask.repeat_interleave(num_sequences_per_prompt, 0).to(self._execution_device)
        batch = ids.shape[0]
        if isinstance(generator, list) and len(generator) != batch:
            raise ValueError(f"generator list has {len(generator)} entries, expected one per sequence ({batch})")
        check_decode_args(self.model, ids, mask, gen_length, block_length, temperature, guidance_scale, cache, self.mask_token_id,
                          compile)
        scheduler.set_timesteps(steps, gen_length, block_length)  # validates steps against the blocks

        # 2. decode, with progress bars over blocks and committed tokens
        num_blocks = gen_length // block_length  # both validated above
        mask_id = self.mask_token_id
        with self.progress_bar(total=num_blocks) as block_bar, self.progress_bar(total=batch * gen_length) as token_bar:
            blocks_done = [0]
            views = {"sequences": lambda p: p.tokens.masked_fill(p.tokens == UNDECIDED, mask_id),  # mask id where undecided
                     "transfer_index": lambda p: p.details["transfer_index"]}
            on_token = self.step_callback(token_bar, callback_on_step_end, callback_on_step_end_tensor_inputs, views)

            def on_step(progress: DecodeProgress) -> None:
                block_bar.update(progress.details["block"] - blocks_done[0])
                blocks_done[0] = progress.details["block"]
                on_token(progress)

            out = decode(self.model, ids, mask, scheduler=scheduler, gen_length=gen_length, block_length=block_length, steps=steps,
                         temperature=temperature, guidance_scale=guidance_scale, cache=cache, mask_token_id=mask_id,
                         eos_token_id=getattr(self.tokenizer, "eos_token_id", None), logits_eos_inf=logits_eos_inf,
                         confidence_eos_eot_inf=confidence_eos_eot_inf, early_stop_eos=early_stop_eos, generator=generator,
                         callback=on_step, compile=compile)
            block_bar.update(num_blocks - blocks_done[0])

        # 3. post-process
        texts = self.decode_texts(out.tokens) if output_type == "text" else None
        stats = out.as_dicts()
        self.maybe_free_model_hooks()
        if not return_dict:
            return (out.tokens, texts, stats)
        return MaskedDiffusionLMPipelineOutput(sequences=out.tokens, texts=texts, stats=stats)
