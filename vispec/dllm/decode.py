"""Semi-autoregressive block decoding of a masked diffusion LM, with optional block KV caches.

The canvas is ``x = [prompt ; mask^L]`` (prompts left-padded, ``attention_mask`` marking real
tokens). It is split into ``K = L / Lb`` blocks decoded left to right; inside a block, each step runs
the model, and the scheduler (:mod:`vispec.dllm.schedulers`) commits some masked positions of the
block. Fixed-step policies (LLaDA's quota) run ``steps / K`` steps per block; adaptive ones run until
the block has no mask left. Steps that would commit nothing because a row's block is already
complete are skipped (LLaDA's reference spends forwards on them when ``steps / K`` exceeds the
block's masks; the tokens are the same).

Caches (``cache=``; :mod:`vispec.dllm.caches`, one class per mode): ``"none"``, a
full forward every step; ``"prefix"`` and ``"dual"`` (Fast-dLLM, Wu et al., arXiv 2505.22618, §3.1; spec
``dllm.md`` §4.3), where the block's first step is a full forward that caches every position's K/V and the
later steps forward ``x[block_start:]``, or only the block, against the cache; ``"dkv"`` (dKV-Cache-Decode,
Ma et al., arXiv 2505.15781, spec ``dllm.md`` §11), which caches a committed token's K/V from the step after
the one that commits it and refreshes the whole cache every ``cache_reload_steps`` forwards of a block.
``compile=True`` runs every forward through ``torch.compile`` with static shapes (:mod:`vispec.dllm.caches`;
not with ``"dkv"``).

Every forward counts one NFE for every row it serves, the cache-refreshing full forward included.

Block-causal models (``model.attention_layout == "block_causal"``: LLaDA2, :mod:`vispec.models.llada2`) decode with
their own loop (:mod:`vispec.dllm.block_causal`): blocks counted from each row's first prompt token, the canvas up to
the block's end forwarded under the block-causal mask, ``cache="prefix"`` keeping the finished blocks' K/V exactly;
the token-editing policy (:mod:`vispec.dllm.editing`, LLaDA2.1) runs only there.

Guidance is LLaDA's unsupervised CFG (the unconditional branch masks the prompt) in vispec's one
convention (:mod:`vispec.outputs`, as the image half): ``guidance_scale = s`` mixes
``ℓ = ℓ_u + s (ℓ_c - ℓ_u)`` and ``s = 1`` means no guidance (no unconditional branch is run). LLaDA's
``cfg_scale = w`` (``ℓ = ℓ_u + (w + 1)(ℓ_c - ℓ_u)``, ``w = 0`` off) is ``guidance_scale = w + 1``: the
same arithmetic, so LLaDA's ``cfg_scale=0.5`` and vispec's ``guidance_scale=1.5`` give the same tokens.
``early_stop_eos``: once a row commits EOS, its masked positions after that EOS become EOS and it
spends no more forwards on them (a uniform-corruption model, DiffusionGemma, has no masks in a finished canvas:
every position after its EOS becomes EOS, where its ``generate`` writes pad).

Batching: all rows share the block index (so caches refresh together), but each row commits its own
positions, keeps its own noise (Philox keyed by its seed, position and forward count) and leaves the
forward as soon as its block is complete; a row's tokens are those it would get alone.

Rules that end rows early or move block boundaries (all off by default; they compose with each other,
with every policy and every cache, and keep every row's tokens and NFE those it gets alone; how the block
loop runs them: :mod:`vispec.dllm.loop`):

* ``eotp=True``: end-of-text prediction (Learn2PD, arXiv 2509.25188; :mod:`vispec.dllm.eotp`).
  After each step a row's canvas may be cut after an EOS; the dropped tail reads as EOS and is never
  computed again.
* ``early_commit=ProphetRule(...)``: Prophet (arXiv 2508.19982; :mod:`vispec.dllm.prophet`). A row whose mean top-2 logit gap over
  its answer region clears the progress-dependent threshold commits all its masked positions (every
  block) to this forward's candidates and stops. It adds no forward.
* ``adaptive_block=AdaptiveBlocks(...)``: AdaBlock (arXiv 2509.26432; :mod:`vispec.dllm.blocks`). Each
  row's next block ends at a confident delimiter predicted by the forward that starts it, else after
  ``block_length`` positions.

:func:`decode` returns a :class:`vispec.outputs.DecodeOutput` like the image decoders
(:func:`vispec.decoding.decode`): ``tokens [B, gen_length]`` (the generated canvas, prompt excluded),
per-row :class:`vispec.outputs.DecodeStats` (NFE, tokens before the first EOS, EOS and EoT excluded:
spec §16.4, latency), ``method`` (the scheduler's strategy name) and ``labels`` (scheduler class and
cache). A step callback receives a :class:`vispec.outputs.DecodeProgress` after every forward; like
diffusers' ``LLaDA2Pipeline``, which applies a block its step-end callback returns, it may return an edit
(``{"tokens": canvas}`` and / or ``{"guidance_scale": s}``, :func:`decode`) or raise :class:`StopDecoding`
to end early with what is done. Logits with NaN raise ``ValueError`` at the end of their block (one
read-back per block) instead of leaving the canvas masked.

The options are one frozen :class:`vispec.dllm.options.UnmaskingOptions`, checked once when built (``decode`` builds
it from its keywords, or takes ``options=``); the checks that need the model run once, before the block loop
(:func:`vispec.dllm.checks.check_decode_inputs`).

Model protocol: ``model(input_ids, attention_mask).logits`` (``[B, N, V]``) and ``model.config`` with
``mask_token_id`` (and ``eos_token_id``, ``eot_token_id``, ``vocab_size``, ``max_sequence_length``
when present); the caches also need ``compute_kv_cache`` / ``forward_span`` and a cache with
``select`` (:class:`vispec.models.llada.LLaDAModelLM`). ``attention_mask`` is None when no prompt
is padded (checked once, before the block loop: the forwards themselves read nothing back).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

from vispec.dllm.block_causal import BlockCausalLoop, is_block_causal
from vispec.dllm.checks import check_decode_inputs
from vispec.dllm.loop import BlockLoop
from vispec.dllm.block_causal_speculative import BlockCausalSpeculativeLoop
from vispec.dllm.draft_length import model_chooser
from vispec.dllm.speculative import SpeculativeLoop
from vispec.dllm.options import UnmaskingOptions
from vispec.dllm.schedulers import UnmaskingScheduler
from vispec.dllm.uniform import SharedGenerator
from vispec.kernels.philox import GeneratorArg, per_sample_seeds
from vispec.outputs import DecodeOutput, StepCallback


@torch.no_grad()
def decode(
    model: Any,
    input_ids: Tensor,
    attention_mask: Optional[Tensor] = None,
    options: Optional[UnmaskingOptions] = None,
    *,
    scheduler: UnmaskingScheduler,
    generator: GeneratorArg = None,
    callback: Optional[StepCallback] = None,
    **option_keywords: Any,
) -> DecodeOutput:
    """Decode ``gen_length`` tokens after each prompt (module docstring).

    Args:
        input_ids: ``[B, P]`` left-padded prompts; ``attention_mask [B, P]`` marks real tokens. Mask tokens in a
            prompt are decoded too (infilling, :mod:`vispec.dllm.infill`: they join the first block), and the filled
            prompt is the output's ``prompt_tokens``.
        options: an :class:`~vispec.dllm.options.UnmaskingOptions`, or None to build one from the keywords (the
            fields below; an unknown keyword is a ``ValueError`` naming it). Not both.
        scheduler: the unmasking policy; ``steps`` (total over blocks) is required by fixed-step ones.
        temperature: 0 for arg-max candidates, else float64 Gumbel-max sampling.
        guidance_scale: unsupervised CFG scale ``s >= 1``, ``ℓ = ℓ_u + s (ℓ_c - ℓ_u)``; 1 = off. LLaDA's
            ``cfg_scale = w`` is ``guidance_scale = w + 1``.
        cache: ``"none"``, ``"prefix"``, ``"dual"`` (Fast-dLLM) or ``"dkv"`` (dKV-Cache-Decode; module docstring,
            :mod:`vispec.dllm.caches`).
        logits_eos_inf: never propose EOS. ``confidence_eos_eot_inf``: rank EOS/EoT proposals last.
        early_stop_eos: fill the masked positions after a committed EOS with EOS.
        suppress_mask_token: never propose the mask token (nor padded embedding columns).
        generator: one ``torch.Generator`` or a list with one per row; or a :class:`vispec.dllm.uniform.SharedGenerator`,
            which draws batch-wide in the order of transformers' / diffusers' reference implementations (the noise of
            uniform-corruption models such as DiffusionGemma, and the DiffusionGemma rule's samples), for token
            equality with them.
        callback: ``callback(progress)`` after every forward, ``progress`` a :class:`vispec.outputs.DecodeProgress`:
            ``step`` (global), ``num_committed [B]`` (committed generated tokens per row), ``tokens [B, gen_length]``
            (the canvas, :data:`vispec.outputs.UNDECIDED` where still masked) and ``details`` with ``block``,
            ``step_in_block``, ``rows`` (batch rows that took part) and ``transfer_index [R, Lb]`` (all copies).
            It may return None or an edit, applied before the next forward: ``"tokens"``, a new canvas
            ``[B, gen_length]`` (committed tokens may change and undecided positions may be committed;
            :data:`~vispec.outputs.UNDECIDED` where still undecided; re-masking a committed position is an
            error), and ``"guidance_scale"`` (only when decoding started guided, ``!= 1``: the unconditional
            branch and its cache rows exist from the start). An edited earlier block reaches the cached K/V at the
            next cache refresh, as Fast-dLLM's approximation has it. Raising :class:`StopDecoding` ends decoding
            with what is done (``labels["interrupted"] = True``).
        compile: run the model's forwards through ``torch.compile(fullgraph=True)`` with static shapes
            (:mod:`vispec.dllm.caches`: every forward takes the whole batch; ``"prefix"`` spans are compiled with
            ``dynamic=True`` since they shrink block after block). The graphs are cached on the model: the
            first call compiles (about a minute per graph on a CPU), later calls reuse them. Tokens and NFE
            equal the eager loop's up to float rounding of the fused kernels. Eager (False) is the default.
            Not with ``cache="dkv"``.
        cache_reload_steps: ``cache="dkv"`` only (checked always): an integer ``R >= 1``; forward ``j`` of a
            block refreshes every cached K/V with a full forward when ``j % R == 0`` (the paper's
            ``cache_reloading_step``, 8 for LLaDA, 4 for Dream). ``R = 1`` is ``cache="none"``. Committed tokens
            that a callback edits are recomputed at the next forward under ``"dkv"``.
        eotp: end-of-text prediction (module docstring); needs an EOS id. Stats gain ``canvas_length`` (each
            row's surviving canvas) and labels ``"eotp": True``; the callback's ``details`` gain
            ``canvas_length [R]`` after the step. The dropped positions of a row's block read to the policy as
            an EOS decided with probability 1 (Learn2PD's filter sees confidence 1 there), whether or not the
            forward computed them.
        early_commit: None or a :class:`vispec.dllm.prophet.ProphetRule` (module docstring). Stats gain
            ``early_committed`` (1 where the rule finished the row), labels ``"early_commit": "prophet"``.
        adaptive_block: None or a :class:`vispec.dllm.blocks.AdaptiveBlocks` (module docstring; delimiter ids
            come from the tokenizer); ``block_length`` is the initial block size ``B`` (``gen_length`` stays a
            multiple of it, and fixed-step policies keep ``steps / (gen_length / block_length)`` steps per
            block). Stats gain ``blocks`` (blocks per row), labels ``"adaptive_block": True``; the callback's
            ``details`` gain ``block_start`` and ``block_end`` (``[R]`` generated positions) and ``block`` is the
            round. ``eotp`` and ``adaptive_block`` need ``compile=False`` (their shapes change step by step);
            ``adaptive_block`` cannot drive the Learn2PD policy (its filter reads ``block_length`` inputs).

    Returns:
        :class:`vispec.outputs.DecodeOutput`: ``tokens [B, gen_length]``, per-row ``stats``, ``method`` (the
        scheduler's strategy name) and ``labels`` ``{"scheduler": class name, "cache": cache}``; ``prompt_tokens
        [B, P]``, the prompts with their mask tokens filled (``cat([prompt_tokens, tokens], 1)`` is Dream's
        ``sequences``).
    """
    if options is None:
        options = UnmaskingOptions.from_keywords(**option_keywords)
    elif option_keywords:
        raise ValueError(f"pass options or keyword options, not both (got options and {sorted(option_keywords)})")
    elif not isinstance(options, UnmaskingOptions):
        raise ValueError(f"options must be an UnmaskingOptions, got {type(options).__name__}")
    ids = check_decode_inputs(model, input_ids, attention_mask, options, scheduler)
    shared = shared_generator(generator, model, input_ids, options, scheduler)
    scheduler.set_timesteps(options.steps, options.gen_length, options.block_length)
    # speculative="auto" hands a decode to the stepwise loop (the same tokens) when no draft length pays at this batch
    chooser = None
    if options.speculative is not None and options.speculative.auto:
        chooser = model_chooser(model, input_ids.shape[0], input_ids.device, options, scheduler)
    stepwise = options.speculative is None or (chooser is not None and chooser.prefers_stepwise(input_ids.shape[0]))
    runner = BlockLoop if stepwise else SpeculativeLoop
    if is_block_causal(model):  # LLaDA2 layout: block-aligned canvas, exact prefix cache (vispec.dllm.block_causal)
        runner = BlockCausalLoop if stepwise else BlockCausalSpeculativeLoop
    if shared is None:
        seeds, extra = per_sample_seeds(generator, input_ids.shape[0], input_ids.device), {}
    else:  # the reference implementations' batch-wide draws (vispec.dllm.uniform); shared_generator refused the
        seeds, extra = shared.row_seeds(), {"shared": shared}  # speculative and block-causal runners: a BlockLoop
    if chooser is not None and not stepwise:
        extra["chooser"] = chooser
    loop = runner(model, input_ids, attention_mask, options, ids, scheduler, seeds, callback, **extra)
    if chooser is not None and stepwise:  # its steps' seconds, against which drafting must pay (draft_length.py)
        loop.step_timer, loop.step_clock = chooser.record_step, chooser.clock
    loop.run()
    out = loop.output()
    if stepwise and options.speculative is not None:  # handed over: reported as a self-speculative run of k = 1
        out.labels["speculative"] = {"draft_length": "auto", "rounds_by_draft_length": {}, "stepwise": True}
        out.stats.extra.update(steps=out.stats.nfe.clone(), canvases=out.stats.nfe.clone())
    return out


def shared_generator(generator: Any, model: Any, input_ids: Tensor, options: UnmaskingOptions,
                     scheduler: UnmaskingScheduler) -> Optional[SharedGenerator]:
    """``generator`` bound to the decode when it is a :class:`~vispec.dllm.uniform.SharedGenerator` (None otherwise).
    Its batch-wide draws serve the noise of models with a corruption process and policies that draw from it (the
    DiffusionGemma rule); vispec's counter-based sampling (temperature > 0, random remasking) and self-speculation
    have no reference order to follow, so they are refused with it."""
    if not isinstance(generator, SharedGenerator):
        return None
    if options.speculative is not None or is_block_causal(model):
        raise ValueError("a SharedGenerator serves the block loop of masked and uniform-corruption models; speculative "
                         "decoding (its lanes draw per row) and block-causal models take a torch.Generator or one per row")
    keyed = options.temperature > 0 or scheduler.uses_remask_noise
    if keyed and not getattr(scheduler, "draws_shared", False):
        raise ValueError(f"{type(scheduler).__name__} samples with counter-based noise (temperature > 0 or random "
                         "remasking), which has no reference order to share: pass a torch.Generator (or one per row) "
                         "as generator, or temperature=0 with a SharedGenerator")
    return generator.bind(input_ids.shape[0], input_ids.device)

