"""The checks of :func:`vispec.dllm.decode` that need the model, the prompts or the policy, shared by the block loop
and self-speculation (:mod:`vispec.dllm.speculative`): they run once, before any forward, and their errors name the
argument."""

from __future__ import annotations

import copy
from typing import Optional

import torch
from torch import Tensor

from vispec.dllm.block_causal import check_block_causal, is_block_causal
from vispec.dllm.cache_modes import cache_class
from vispec.dllm.editing import TokenEditingScheduler
from vispec.dllm.infill import check_infill
from vispec.dllm.options import UnmaskingOptions
from vispec.dllm.schedulers import UnmaskingScheduler
from vispec.dllm.tokens import TokenIds, config_id


def check_policy_fits_model(model: object, scheduler: UnmaskingScheduler) -> None:
    """The policies ``model``'s attention cannot run, refused naming both: the editing policy needs a block-causal model.
    :func:`check_decode_inputs` asks it, and so does :class:`vispec.dllm.diffusers_scheduler.VispecPolicyScheduler` for
    the model of the diffusers pipeline it runs in."""
    if isinstance(scheduler, TokenEditingScheduler) and not is_block_causal(model):
        raise ValueError(f"the editing policy (TokenEditingScheduler, LLaDA2's M2T + T2T rule) needs a block-causal "
                         f"model (LLaDA2 layout, vispec.models.llada2), got {type(model).__name__}; for LLaDA / "
                         "Dream use strategy='threshold' (threshold commits) or 'llada' (a fixed quota per step)")


def check_decode_inputs(model: object, input_ids: Tensor, attention_mask: Optional[Tensor], options: UnmaskingOptions,
                        scheduler: UnmaskingScheduler) -> TokenIds:
    """The checks of :func:`vispec.dllm.decode` that need the model, the prompts or the policy (the options checked themselves when
    built); errors name the argument. Returns the mask, EOS and EoT ids (the options', else the model config's)."""
    if not isinstance(input_ids, Tensor) or input_ids.dim() != 2 or input_ids.shape[1] < 1 or input_ids.dtype != torch.long:
        raise ValueError(f"input_ids must be a LongTensor [batch, prompt_length >= 1], got "
                         f"{tuple(input_ids.shape) if isinstance(input_ids, Tensor) else type(input_ids).__name__}")
    if attention_mask is not None and tuple(attention_mask.shape) != tuple(input_ids.shape):
        raise ValueError(f"attention_mask must have the shape of input_ids {tuple(input_ids.shape)}, got {tuple(attention_mask.shape)}")
    if not isinstance(scheduler, UnmaskingScheduler):
        raise ValueError(f"scheduler must be an UnmaskingScheduler (vispec.dllm.SCHEDULERS), got {type(scheduler).__name__}")
    block_causal = is_block_causal(model)
    if not block_causal:
        cache_class(model, options.cache).check_model(model)
    check_policy_fits_model(model, scheduler)
    own_checks = getattr(model, "check_decode", None)  # a model's own limits (vispec.models.diffusion_gemma)
    if own_checks is not None:
        own_checks(input_ids, attention_mask, options, scheduler)
    policy_checks = getattr(scheduler, "check_options", None)  # options a policy cannot honour (vispec.dllm.gemma_rule)
    if policy_checks is not None:
        policy_checks(options)
    if options.compile and not hasattr(model, "compiled_core"):
        raise ValueError(f"compile=True needs a model with static, compilable forwards (compiled_core), "
                         f"got {type(model).__name__}")
    mask_id = options.mask_token_id if options.mask_token_id is not None else config_id(model, "mask_token_id")
    if mask_id is None:
        raise ValueError("mask_token_id is needed (the model config has none)")
    pad_id = config_id(model, "pad_token_id")
    if pad_id is not None and pad_id == mask_id:
        raise ValueError(f"the model's pad_token_id equals mask_token_id ({mask_id}); padding would read as masks")
    if block_causal:
        check_block_causal(model, input_ids, attention_mask, options, mask_id)
    else:
        check_infill(model, input_ids, attention_mask, options, scheduler, mask_id)  # prompt masks (vispec.dllm.infill)
    context = config_id(model, "max_sequence_length")
    if context is not None and input_ids.shape[1] + options.gen_length > context:
        raise ValueError(f"prompt length {input_ids.shape[1]} + gen_length {options.gen_length} exceeds the model's "
                         f"context of {context} tokens")
    eos_id = options.eos_token_id if options.eos_token_id is not None else config_id(model, "eos_token_id")
    eot_id = options.eot_token_id if options.eot_token_id is not None else config_id(model, "eot_token_id")
    for name in ("early_stop_eos", "logits_eos_inf", "eotp"):
        if getattr(options, name) and eos_id is None:
            raise ValueError(f"{name} needs an eos_token_id (the model config has none)")
    if options.confidence_eos_eot_inf and eos_id is None and eot_id is None:
        raise ValueError("confidence_eos_eot_inf needs eos_token_id or eot_token_id")
    if options.adaptive_block is not None:
        options.adaptive_block.check_ids(config_id(model, "vocab_size"), mask_id)
        if getattr(scheduler, "strategy", "") == "learn2pd":
            raise ValueError("adaptive_block cannot run with the learn2pd policy: its filter reads exactly "
                             "block_length confidences per block")
    return TokenIds(mask_id, eos_id, eot_id)


def check_decoding(model: object, options: UnmaskingOptions, scheduler: UnmaskingScheduler) -> TokenIds:
    """What :func:`vispec.dllm.decode` refuses for ``model`` with ``options`` and ``scheduler`` whatever the prompt,
    before its first forward: :func:`check_decode_inputs` (the model family's caches and rules, the policy's limits,
    the ids) on a one-token placeholder prompt, and the policy's step split (``set_timesteps``, on a copy). For
    settings checked once before many decodes (``vispec bench text``'s rows, lm-eval's ``vispec-dllm``); it reads the
    model's class and config, never its weights, so ``model`` may be built on the meta device. The checks of a
    prompt's own length and masks run with the decode that gets it."""
    mask_id = options.mask_token_id if options.mask_token_id is not None else config_id(model, "mask_token_id")
    placeholder = torch.full((1, 1), 1 if mask_id == 0 else 0, dtype=torch.long)  # a real token, never the mask
    ids = check_decode_inputs(model, placeholder, None, options, scheduler)
    copy.deepcopy(scheduler).set_timesteps(options.steps, options.gen_length, options.block_length)
    return ids
