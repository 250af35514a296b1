"""vispec's unmasking policies as a diffusers scheduler, for diffusers' own dLLM pipelines (unchanged).

diffusers 0.42 ships two text-diffusion pipelines that drive a ``BlockRefinementScheduler``: ``LLaDA2Pipeline``
(masked block diffusion) and ``DiffusionGemmaPipeline`` (uniform corruption, :mod:`vispec.dllm.uniform`).
:class:`VispecPolicyScheduler` has the interface they call, and decides what to commit with a vispec policy
(:data:`vispec.dllm.SCHEDULERS`: LLaDA's quota, Fast-dLLM's threshold and factor rules, EB-Sampler's entropy bound, the
contiguous run, Learn2PD's filter, Dream's sampler, DiffusionGemma's own rule):

* ``config.block_length`` (``LLaDA2Pipeline``'s default block) and ``set_timesteps(num_inference_steps, device=,
  block_length=)``: the policy's step budget per block is ``num_inference_steps`` (fixed-step policies: LLaDA's quota,
  Dream, DiffusionGemma's rule); adaptive policies commit at least one position per step and run until the block is
  complete. ``set_timesteps`` also checks the calling pipeline's model (:meth:`VispecPolicyScheduler.check_model`,
  before any forward): a block-causal model's ``config.block_length`` must be the pipeline's ``block_length``, and
  the policies vispec's own decode refuses for that model are refused (the editing policy on a bidirectional one).
* ``step(model_output, timestep, sample, *, mask_token_id=, temperature=, generator=, ...)`` returns
  ``prev_sample``, ``transfer_index``, ``editing_transfer_index``, ``sampled_tokens``, ``sampled_probs`` and
  ``pred_logits`` (:class:`PolicySchedulerOutput`):

  - with a ``mask_token_id`` (``LLaDA2Pipeline``) the masked positions of ``sample`` are the undecided ones; the
    policy's candidates never propose the mask token (as vispec's decode); the call's ``threshold`` replaces the
    policy's τ for policies that have one (threshold, contiguous, Learn2PD), as ``BlockRefinementScheduler``'s
    per-call ``threshold`` replaces its config's; for the others it has no meaning and is not read. vispec's
    policies never re-open a committed token, so ``editing_transfer_index`` is all False and ``LLaDA2Pipeline``
    ends a block once its masks are filled, whatever its ``editing_threshold``; ``minimal_topk`` is not read by
    ``BlockRefinementScheduler.step`` either (the pipeline only caps its step count with it);
  - with ``mask_token_id=None`` (``DiffusionGemmaPipeline``) the scheduler tracks the committed positions itself
    (reset at ``timestep == 0``, as ``BlockRefinementScheduler``'s uniform mode), shows the policy the rest as
    undecided, and renoises them: each step that starts with an undecided position draws one ``torch.randint(0, V,
    sample.shape, generator=generator)`` (a policy's drafts, DiffusionGemma's rule, take precedence); a step on a
    complete canvas draws nothing and changes nothing. ``pred_logits`` (self-conditioning) is the policy's, else the
    raw logits. Pass ``confidence_threshold=None`` to the pipeline: its own stop rule replaces a stopped row's
    canvas with the denoiser's arg-max, over the policy's commits.

* ``check_eos_finished`` (a row is finished once a step commits an EOS and every generated position before the
  sequence's first EOS is decided, as ``BlockRefinementScheduler``'s; batched) and ``check_block_should_continue``
  (until the block is complete; fixed-step policies also stop at their budget, leaving masks as
  ``BlockRefinementScheduler`` does).

Candidates are the arg-max at temperature 0 (and with ``sampling_method="greedy"``); at ``temperature > 0`` they are
vispec's counter-based Gumbel-max samples keyed by per-row seeds drawn once per call from the pipeline's
``generator`` (at the call's first step), the block's position in the pipeline's loop and the step count;
``top_k`` / ``top_p`` have no equivalent and are refused. DiffusionGemma's rule draws its samples from the pipeline's
``generator`` batch-wide (:class:`vispec.dllm.uniform.SharedGenerator`). Exact self-speculative decoding verifies
several canvases in one forward, which a pipeline that runs one forward per step cannot give it: it is refused by
name (use :class:`vispec.pipelines.MaskedDiffusionLMPipeline` with ``speculative=``).

The scheduler's config (``scheduler_config.json``) holds ``strategy``, ``policy_config`` (the policy's own config) and
``block_length``, so it saves and loads like diffusers' schedulers; a Learn2PD filter is not part of it (pass the
policy object, :meth:`VispecPolicyScheduler.from_policy`).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Optional

import torch
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.schedulers.scheduling_utils import SchedulerMixin
from diffusers.utils import BaseOutput
from torch import Tensor

from vispec.checks import check_int, check_number
from vispec.dllm.block_causal import is_block_causal
from vispec.dllm.checks import check_policy_fits_model
from vispec.dllm.options import SelfSpeculation
from vispec.dllm.schedulers import UnmaskingScheduler, UnmaskNoise, make_scheduler
from vispec.dllm.uniform import SharedGenerator
from vispec.kernels.philox import per_sample_seeds

SAMPLING_METHODS = ("auto", "greedy", "multinomial")


@dataclass
class PolicySchedulerOutput(BaseOutput):
    """One step of :class:`VispecPolicyScheduler`, with ``BlockRefinementSchedulerOutput``'s fields.

    Args:
        prev_sample: ``[B, Lb]`` the block after the step (uniform mode: undecided positions renoised or drafted).
        transfer_index: ``[B, Lb]`` bool, positions committed in this step.
        editing_transfer_index: ``[B, Lb]`` bool, committed tokens replaced in this step (vispec's policies: none).
        sampled_tokens: ``[B, Lb]`` the policy's candidates at undecided positions, the block's tokens elsewhere.
        sampled_probs: ``[B, Lb]`` float32 the candidates' confidences (0 at decided positions).
        pred_logits: ``[B, Lb, V]`` the logits to self-condition on (DiffusionGemma).
    """

    prev_sample: Tensor
    transfer_index: Tensor
    editing_transfer_index: Tensor
    sampled_tokens: Tensor
    sampled_probs: Tensor
    pred_logits: Tensor


class VispecPolicyScheduler(SchedulerMixin, ConfigMixin):
    """A vispec unmasking policy behind ``BlockRefinementScheduler``'s interface (module docstring).

    Args:
        strategy: the policy's name in :data:`vispec.dllm.SCHEDULERS` (``"threshold"``, ``"factor"``, ``"entropy"``,
            ``"llada"``, ``"learn2pd"``, ``"gemma"``, ...).
        policy_config: the policy's settings (its config, e.g. ``{"threshold": 0.9}``); None: its defaults.
        block_length: the block ``LLaDA2Pipeline`` uses when its call gives none.
        num_inference_steps: the default step budget per block until ``set_timesteps`` (diffusers' convention).
    """

    config_name = "scheduler_config.json"
    order = 1

    @register_to_config
    def __init__(self, strategy: str = "threshold", policy_config: Optional[dict] = None, block_length: int = 32,
                 num_inference_steps: int = 32):
        if strategy == "speculative" or isinstance(policy_config, SelfSpeculation):
            raise ValueError(_SPECULATIVE)
        check_int("block_length", block_length, minimum=1)
        check_int("num_inference_steps", num_inference_steps, minimum=1)
        if policy_config is not None and not isinstance(policy_config, dict):
            raise ValueError(f"policy_config must be a dict of the policy's settings or None, got "
                             f"{type(policy_config).__name__}")
        self.policy: UnmaskingScheduler = make_scheduler(strategy, **(policy_config or {}))
        self._by_threshold: dict[float, UnmaskingScheduler] = {}
        self._reset(num_inference_steps, block_length)

    @classmethod
    def from_policy(cls, policy: UnmaskingScheduler, block_length: int = 32,
                    num_inference_steps: int = 32) -> "VispecPolicyScheduler":
        """The scheduler of an existing policy object (its settings; a Learn2PD filter is kept)."""
        if isinstance(policy, (SelfSpeculation, int)) and not isinstance(policy, bool):
            raise ValueError(_SPECULATIVE)
        if not isinstance(policy, UnmaskingScheduler) or not policy.strategy:
            raise ValueError(f"policy must be one of vispec's unmasking policies (vispec.dllm.SCHEDULERS), got "
                             f"{type(policy).__name__}")
        settings = {k: v for k, v in policy.config.items() if not k.startswith("_")}
        scheduler = cls(strategy=policy.strategy, policy_config=settings, block_length=block_length,
                        num_inference_steps=num_inference_steps)
        if getattr(policy, "filter", None) is not None:
            scheduler.policy.filter = policy.filter
        return scheduler

    # ------------------------------------------------------------------ diffusers' schedule
    def _reset(self, num_inference_steps: int, block_length: int) -> None:
        self.num_inference_steps = num_inference_steps
        self.block_length = block_length
        self.timesteps = torch.arange(num_inference_steps - 1, -1, -1, dtype=torch.long)
        self._seeds: Optional[Tensor] = None  # per-row Philox seeds, drawn at the call's first sampling step
        self._blocks = -1  # blocks started in this call (the noise keys' positions)
        self._steps = 0  # steps taken in this call (the noise keys' draw index)
        self._masked_at_start: Optional[Tensor] = None
        self._committed: Optional[Tensor] = None  # uniform mode: positions committed in the current block

    def set_timesteps(self, num_inference_steps: int, device: "str | torch.device | None" = None,
                      block_length: Optional[int] = None) -> None:
        """A pipeline call's schedule: ``num_inference_steps`` per block over blocks of ``block_length`` (default the
        config's); resets the per-call state."""
        check_int("num_inference_steps", num_inference_steps, minimum=1, hint=" (steps per block)")
        block_length = self.config.block_length if block_length is None else block_length
        check_int("block_length", block_length, minimum=1)
        model = _calling_pipeline_model(self)
        if model is not None:  # before the pipeline's first forward
            self.check_model(model, block_length)
        self._reset(num_inference_steps, block_length)
        self.timesteps = self.timesteps.to(device) if device is not None else self.timesteps
        for policy in (self.policy, *self._by_threshold.values()):
            policy.set_timesteps(num_inference_steps if policy.fixed_steps else None, block_length, block_length, device)

    def check_model(self, model: Any, block_length: Optional[int] = None) -> None:
        """Refuse what ``model`` cannot run with this scheduler in a diffusers pipeline, naming both values (``set_timesteps``
        asks it for the model of the pipeline that calls it, before any denoising step):

        * a block-causal model (vispec's LLaDA2 layout, :func:`vispec.dllm.block_causal.is_block_causal`) attends over
          blocks of its ``config.block_length`` under the 2-D padding mask ``LLaDA2Pipeline`` passes: the pipeline's
          ``block_length`` (``block_length`` here, default the config's) must be that one, or the pipeline denoises
          blocks the attention does not have and gives other tokens than vispec's pipeline (which lays out its own
          block mask);
        * the policies the model's attention cannot run, :func:`vispec.dllm.checks.check_policy_fits_model` (the
          check vispec's own decode applies: the editing policy needs a block-causal model)."""
        block_length = self.config.block_length if block_length is None else block_length
        trained = getattr(getattr(model, "config", None), "block_length", None)
        if is_block_causal(model) and trained is not None and trained != block_length:
            raise ValueError(f"block_length={block_length} (the pipeline's blocks) differs from the model's block_length="
                             f"{trained}: {type(model).__name__} attends block-causally over blocks of {trained} under the "
                             f"2-D mask LLaDA2Pipeline passes, so blocks of {block_length} would denoise other tokens than "
                             f"vispec's pipeline; pass block_length={trained} to the call or to VispecPolicyScheduler")
        check_policy_fits_model(model, self.policy)

    # ------------------------------------------------------------------ the step
    def step(self, model_output: Tensor, timestep: "int | Tensor", sample: Tensor, *, mask_token_id: Optional[int] = None,
             temperature: float = 0.0, top_p: Optional[float] = None, top_k: Optional[int] = None,
             sampling_method: str = "auto", threshold: Optional[float] = None,
             editing_threshold: Optional[float] = None, minimal_topk: Optional[int] = None,
             prompt_mask: Optional[Tensor] = None, generator: Optional[torch.Generator] = None,
             return_dict: bool = True) -> "PolicySchedulerOutput | tuple":
        """One step on the block ``sample [B, Lb]`` from ``model_output [B, Lb, V]`` (module docstring)."""
        step_index = self._check_step(model_output, timestep, sample, mask_token_id, temperature, top_p, top_k,
                                      sampling_method, threshold, generator)
        temperature = 0.0 if sampling_method == "greedy" else float(temperature)
        vocab = model_output.shape[-1]
        uniform = mask_token_id is None
        if step_index == 0:
            self._blocks += 1
            if uniform:
                self._committed = torch.zeros_like(sample, dtype=torch.bool)
        mask_id = vocab if uniform else int(mask_token_id)
        view = torch.where(self._committed, sample, torch.full_like(sample, mask_id)) if uniform else sample
        undecided = view == mask_id
        if step_index == 0:
            self._masked_at_start = undecided.sum(dim=1)
        if not bool(undecided.any()):  # nothing to decide (LLaDA2's post-mask steps, a finished canvas)
            return self._output(sample, torch.zeros_like(undecided), sample, torch.zeros_like(model_output[..., 0]),
                                model_output, return_dict)
        policy = self._policy(threshold)
        out = policy.step(model_output, min(step_index, self._last_step(policy)), view, mask_token_id=mask_id,
                          temperature=temperature, noise=self._noise(sample, temperature, policy, generator),
                          num_masked_at_block_start=self._masked_at_start,
                          proposal_mask=None if uniform or mask_id >= vocab else self._proposal_mask(vocab, mask_id,
                                                                                                   sample.device))
        self._steps += 1
        transfer = out.transfer_index & undecided
        tokens = torch.where(undecided, out.sampled_tokens.clamp_min(0), sample)
        probs = torch.where(undecided, out.confidence, torch.zeros_like(out.confidence)).to(torch.float32)
        predicted = model_output if out.pred_logits is None else out.pred_logits
        if not uniform:
            return self._output(torch.where(transfer, out.prev_sample, sample), transfer, tokens, probs, predicted,
                                return_dict)
        self._committed = self._committed | transfer
        committed = torch.where(transfer, out.prev_sample, sample)
        noise = torch.randint(0, vocab, sample.shape, device=sample.device, generator=generator)
        draft = out.draft if out.draft is not None else torch.full_like(sample, -1)
        shown = torch.where(self._committed, committed, torch.where(draft >= 0, draft, noise))
        return self._output(shown, transfer, tokens, probs, predicted, return_dict)

    def _check_step(self, model_output, timestep, sample, mask_token_id, temperature, top_p, top_k, sampling_method,
                    threshold, generator) -> int:
        """The step's inputs (errors name the argument) and its step index within the block."""
        if not isinstance(sample, Tensor) or sample.dim() != 2 or sample.dtype.is_floating_point:
            raise ValueError(f"sample must be an integer tensor [B, Lb], got "
                             f"{tuple(sample.shape) if isinstance(sample, Tensor) else type(sample).__name__}")
        if (not isinstance(model_output, Tensor) or not model_output.dtype.is_floating_point
                or model_output.dim() != 3 or model_output.shape[:2] != sample.shape):
            raise ValueError(f"model_output must be float logits [B, Lb, V] matching sample {tuple(sample.shape)}")
        step_index = int(timestep.item()) if isinstance(timestep, Tensor) else timestep
        check_int("timestep", step_index, minimum=0, hint=" (the step index within the block)")
        if mask_token_id is not None:
            check_int("mask_token_id", mask_token_id, minimum=0)
        elif step_index > 0 and (self._committed is None or self._committed.shape != sample.shape):
            raise ValueError("uniform-corruption mode (mask_token_id=None) starts every block at timestep 0")
        check_number("temperature", temperature, minimum=0, hint=" (0 means arg-max candidates)")
        if sampling_method not in SAMPLING_METHODS:
            raise ValueError(f"sampling_method must be one of {SAMPLING_METHODS}, got {sampling_method!r}")
        for name, value in (("top_p", top_p), ("top_k", top_k)):
            if value is not None:
                raise ValueError(f"{name} has no equivalent for vispec's policies: their candidates are the arg-max or "
                                 "samples of the full softmax at temperature=; pass top_p=None, top_k=None")
        if generator is not None and not isinstance(generator, torch.Generator):
            raise ValueError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
        if self._masked_at_start is None and step_index > 0:
            raise ValueError("call set_timesteps and start each block at timestep 0")
        return step_index

    def _last_step(self, policy: UnmaskingScheduler) -> int:
        """Fixed-step policies see at most their last step index (a pipeline may step a complete block once more)."""
        return policy.steps_per_block - 1 if policy.fixed_steps else 1 << 30

    def _policy(self, threshold: Optional[float]) -> UnmaskingScheduler:
        """The policy, with the call's ``threshold`` as τ when it has one (one object per value, kept)."""
        if threshold is None or "threshold" not in self.policy.config or threshold == self.policy.config.threshold:
            return self.policy
        check_number("threshold", threshold, minimum=0, maximum=1, exclusive_minimum=True,
                     hint=f" (τ of the {self.policy.strategy!r} policy)")
        if threshold not in self._by_threshold:
            settings = {k: v for k, v in self.policy.config.items() if not k.startswith("_")}
            policy = type(self.policy).from_config({**settings, "threshold": float(threshold)})
            if getattr(self.policy, "filter", None) is not None:
                policy.filter = self.policy.filter
            policy.set_timesteps(self.num_inference_steps if policy.fixed_steps else None, self.block_length,
                                 self.block_length)
            self._by_threshold[threshold] = policy
        return self._by_threshold[threshold]

    def _noise(self, sample: Tensor, temperature: float, policy: UnmaskingScheduler,
               generator: Optional[torch.Generator]) -> UnmaskNoise:
        """The step's randomness: the pipeline's generator, shared, for DiffusionGemma's rule; counter-based keys from
        per-row seeds drawn once per call otherwise (only when something is sampled)."""
        batch, width = sample.shape
        rows = torch.arange(batch, device=sample.device)
        shared = None
        if getattr(policy, "draws_shared", False):
            shared = SharedGenerator(generator).bind(batch, sample.device)
        elif (temperature > 0 or policy.uses_remask_noise) and self._seeds is None:
            self._seeds = per_sample_seeds(generator, batch, sample.device)
        seeds = self._seeds if self._seeds is not None else torch.zeros(batch, dtype=torch.long, device=sample.device)
        positions = self._blocks * width + torch.arange(width, device=sample.device).expand(batch, -1)
        draws = torch.full((batch,), self._steps, dtype=torch.long, device=sample.device)
        return UnmaskNoise(seeds, positions, draws, rows=rows, shared=shared)

    @staticmethod
    def _proposal_mask(vocab: int, mask_id: int, device: torch.device) -> Tensor:
        """``[V]`` bool: the mask token is never a candidate (vispec's decode, ``suppress_mask_token``)."""
        mask = torch.zeros(vocab, dtype=torch.bool, device=device)
        mask[mask_id] = True
        return mask

    @staticmethod
    def _output(prev: Tensor, transfer: Tensor, tokens: Tensor, probs: Tensor, predicted: Tensor,
                return_dict: bool) -> "PolicySchedulerOutput | tuple":
        editing = torch.zeros_like(transfer)
        if not return_dict:
            return prev, transfer, editing, tokens, probs, predicted
        return PolicySchedulerOutput(prev_sample=prev, transfer_index=transfer, editing_transfer_index=editing,
                                     sampled_tokens=tokens, sampled_probs=probs, pred_logits=predicted)

    # ------------------------------------------------------------------ LLaDA2Pipeline's loop control
    @staticmethod
    def check_eos_finished(cur_x: Tensor, sampled_tokens: Tensor, final_transfer: Tensor, finished: Tensor,
                           eos_token_id: int, mask_token_id: int, prompt_length: int) -> Tensor:
        """``[B]`` finished flags: a row finishes when this step commits an EOS, its sequence's first EOS lies after the
        prompt, and every generated position before that EOS is decided (``BlockRefinementScheduler``'s rule, for
        all rows at once)."""
        committed_eos = ((sampled_tokens == eos_token_id) & final_transfer).any(dim=1)
        is_eos = cur_x == eos_token_id
        first = is_eos.to(torch.int8).argmax(dim=1)
        positions = torch.arange(cur_x.shape[1], device=cur_x.device)
        before = (positions >= prompt_length) & (positions < first[:, None])
        decided = ~((cur_x == mask_token_id) & before).any(dim=1)
        return finished | (committed_eos & is_eos.any(dim=1) & (first >= prompt_length) & decided)

    def check_block_should_continue(self, step_idx: int, masks_remaining: bool, editing_enabled: bool,
                                    editing_transfer_index: Tensor, post_steps: int, max_post_steps: int,
                                    finished: Tensor) -> bool:
        """Whether ``LLaDA2Pipeline`` steps the block again: while it has masks (fixed-step policies: within their
        budget), not after every row finished; with editing, while a step edits and ``post_steps <= max_post_steps``."""
        if bool(finished.all()):
            return False
        if not masks_remaining:
            return bool(editing_enabled and editing_transfer_index.any() and post_steps <= max_post_steps)
        return not (self.policy.fixed_steps and step_idx >= self.policy.steps_per_block)


def _calling_pipeline_model(scheduler: VispecPolicyScheduler) -> Optional[Any]:
    """The ``model`` of the pipeline whose call runs ``scheduler.set_timesteps`` (``LLaDA2Pipeline.__call__``,
    ``DiffusionGemmaPipeline.__call__``), or None when no caller holds this scheduler as its ``scheduler``. diffusers'
    pipelines hand their scheduler no model; the calling frames are the one place it can see the pipeline before the
    first forward."""
    frame = sys._getframe(2)  # set_timesteps' caller
    for _ in range(4):
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        if owner is not None and owner is not scheduler:
            try:
                if getattr(owner, "scheduler", None) is scheduler:
                    return getattr(owner, "model", None)
            except Exception:  # an object whose attributes raise is not a pipeline
                pass
        frame = frame.f_back
    return None


_SPECULATIVE = ("exact self-speculative decoding verifies several canvases in one forward; diffusers' pipelines run "
                "one forward per step of their own loop, so it cannot run inside them: use vispec's "
                "MaskedDiffusionLMPipeline(..., speculative=k) or vispec.dllm.decode(..., speculative=k)")

__all__ = ["PolicySchedulerOutput", "VispecPolicyScheduler"]
