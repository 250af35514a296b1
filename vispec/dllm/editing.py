"""LLaDA2's commit rule with token editing, as a vispec unmasking policy (:class:`TokenEditingScheduler`).

LLaDA2.0 (inclusionAI tech report, 2025) commits masked positions by a confidence threshold with a top-k floor;
LLaDA2.1 (Bie et al., "LLaDA2.1: Speeding Up Text Diffusion via Token Editing", arXiv 2602.08676) adds
token-to-token (T2T) edits to these mask-to-token (M2T) commits: a committed token is replaced when the model is
confident of another one. diffusers ships the rule as ``BlockRefinementScheduler`` driven by ``LLaDA2Pipeline``; this
module is vispec's own implementation of the same decisions, batched (each row its own commit set, no loop over rows).

One step on a block of ``Lb`` positions (``x`` the block's tokens, ``ℓ`` the logits):

* candidates ``x̂_j = argmax ℓ_j`` (temperature 0; Gumbel-max samples keyed per row and position otherwise) at every
  masked position and every *editable* one (a generated, non-masked position; prompt positions inside the block are
  never editable), with confidence ``c_j = softmax(ℓ_j)[x̂_j]`` in float32, as ``LLaDA2Pipeline`` computes it;
* **M2T**: with ``n_t`` the quota of step ``t`` of the block (``Lb`` spread over ``N`` steps, the remainder first:
  ``n_t = ⌊Lb / N⌋ + 1[t < Lb mod N]``; ``t`` clamped to ``N - 1``), a row commits ``{j masked : c_j > τ}`` when that
  set has at least ``n_t`` positions, else its ``min(n_t, #masked)`` most confident masked positions (``τ > 1``
  forces the top-k rule);
* **T2T** (``editing_threshold = τ_e > 0``; None or 0 disables): every editable ``j`` with ``c_j > τ_e`` and
  ``x̂_j ≠ x_j`` takes ``x̂_j``;
* both apply at once: ``x ← where(M2T ∨ T2T, x̂, x)``.

The step budget ``N = min(num_inference_steps, ⌊gen_length / minimal_topk⌋)`` counts the steps that found masks
(``minimal_topk`` acts only through this cap, as in diffusers). When a block has no mask left, editing continues
with *post* steps. A row's block ends (:meth:`TokenEditingScheduler.block_continues`) when, after a step that started
with masks, ``N`` such steps have run; or, after a step that started without masks, editing is off, that step edited
nothing, or ``max_post_steps`` post steps are exceeded. This is ``BlockRefinementScheduler.check_block_should_continue``
for a row alone; diffusers applies it to the whole batch at once (the batch continues while any row does, and its
step counter advances while any row has masks), which vispec does not: each row stops by its own rule, so its tokens
are the ones it gets alone. The two agree whenever a row's edits settle before the batch moves on (always with
editing off; see :mod:`vispec.dllm.block_causal`).

The policy needs the block-causal loop (:mod:`vispec.dllm.block_causal`, LLaDA2-layout models): the editable positions,
the post steps and the per-row stop rule live there. :func:`from_block_refinement` maps a diffusers
``BlockRefinementScheduler`` onto it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from diffusers.configuration_utils import register_to_config
from diffusers.schedulers.scheduling_utils import SchedulerMixin  # noqa: F401 (diffusers' pipeline loader finds a
# saved component's base class in the component's own module: without this name a saved pipeline would not load)
from torch import Tensor

from vispec.checks import check_int, check_number
from vispec.dllm.options import check_blocks
from vispec.dllm.schedulers import SCHEDULERS, UnmaskingScheduler, UnmaskNoise, UnmaskSchedulerOutput, top_n_by
from vispec.kernels.unmask import RowNoise, unmask_candidates


@dataclass
class EditingSchedulerOutput(UnmaskSchedulerOutput):
    """:class:`~vispec.dllm.schedulers.UnmaskSchedulerOutput` plus ``editing_transfer_index [B, Lb]`` (bool, the
    committed positions a T2T edit replaced in this step), diffusers' name. ``sampled_tokens`` and ``confidence`` hold
    the candidates of the masked *and* editable positions."""

    editing_transfer_index: Optional[Tensor] = None


def transfer_quota(block_length: int, steps: int) -> Tensor:
    """``[steps]`` positions committed at each step when ``block_length`` spread over ``steps`` (remainder first)."""
    quota = torch.full((steps,), block_length // steps, dtype=torch.long)
    quota[: block_length % steps] += 1
    return quota


class TokenEditingScheduler(UnmaskingScheduler):
    """LLaDA2 threshold commits with a top-k floor and token-to-token editing (module docstring).

    Args:
        threshold: ``τ`` (> 0; above 1 only the top-k quota commits). Default 0.7, ``LLaDA2Pipeline``'s.
        editing_threshold: ``τ_e`` in ``[0, 1]``, or None; None or 0 disables editing. Default 0.5 (LLaDA2Pipeline).
        max_post_steps: post steps (editing only, after the block's masks are gone) a block may run beyond the first
            ``≥ 0``; default 16.
        num_inference_steps: ``N``, the step budget per block (diffusers' name; LLaDA2's ``steps``); default 32.
        minimal_topk: caps ``N`` at ``gen_length // minimal_topk`` (default 1).
        block_length: None, or the block length a pipeline uses when the call gives none (as diffusers reads
            ``BlockRefinementScheduler.config.block_length``).
    """

    strategy = "editing"

    @register_to_config
    def __init__(self, threshold: float = 0.7, editing_threshold: Optional[float] = 0.5, max_post_steps: int = 16,
                 num_inference_steps: int = 32, minimal_topk: int = 1, block_length: Optional[int] = None):
        super().__init__()
        check_number("threshold", threshold, minimum=0, exclusive_minimum=True,
                     hint=" (a confidence; above 1 only the top-k quota commits)")
        if editing_threshold is not None:
            check_number("editing_threshold", editing_threshold, minimum=0, maximum=1,
                         hint=" (None or 0 disables token editing)")
        check_int("max_post_steps", max_post_steps, minimum=0)
        check_int("num_inference_steps", num_inference_steps, minimum=1, hint=" (steps per block)")
        check_int("minimal_topk", minimal_topk, minimum=1)
        if block_length is not None:
            check_int("block_length", block_length, minimum=1)
        self.block_steps: Optional[int] = None
        self.quota: Optional[Tensor] = None

    @property
    def editing(self) -> bool:
        """Whether T2T edits are on (``editing_threshold`` positive)."""
        return self.config.editing_threshold is not None and self.config.editing_threshold > 0

    def set_timesteps(self, num_inference_steps: Optional[int], gen_length: int, block_length: int,
                      device: "torch.device | str | None" = None) -> None:
        """The per-block budget ``N`` and quota schedule for blocks of ``block_length``; ``num_inference_steps`` is the
        decode's ``steps`` option, which this policy does not take (its budget is its config's)."""
        if num_inference_steps is not None:
            raise ValueError("steps does not apply to the editing policy: its step budget per block is "
                             "TokenEditingScheduler(num_inference_steps=...)")
        self.num_blocks = check_blocks(gen_length, block_length)
        if self.config.minimal_topk > gen_length:
            raise ValueError(f"minimal_topk ({self.config.minimal_topk}) must be at most gen_length ({gen_length}): "
                             "the step budget is num_inference_steps capped at gen_length // minimal_topk")
        self.block_steps = min(self.config.num_inference_steps, gen_length // self.config.minimal_topk)
        self.quota = transfer_quota(block_length, self.block_steps).to(device)
        self.steps_per_block = None
        self.timesteps = torch.arange(self.block_steps, device=device)

    def block_continues(self, had_masks: Tensor, steps: Tensor, post_steps: Tensor, edited: Tensor) -> Tensor:
        """``[R]`` bool: whether each row's block runs another step, after a step that started with masks
        (``had_masks``) or without; ``steps`` counts the row's steps that started with masks, ``post_steps`` the others,
        ``edited`` whether this step made a T2T edit (module docstring)."""
        if self.block_steps is None:
            raise ValueError("call set_timesteps(None, gen_length, block_length) before block_continues")
        post = edited & (post_steps <= self.config.max_post_steps) if self.editing else torch.zeros_like(had_masks)
        return torch.where(had_masks, steps < self.block_steps, post)

    def step(self, model_output: Tensor, timestep: "int | Tensor", sample: Tensor, *, mask_token_id: int,
             temperature: float = 0.0, noise: Optional[UnmaskNoise] = None,
             num_masked_at_block_start: Optional[Tensor] = None, proposal_mask: Optional[Tensor] = None,
             confidence_mask: Optional[Tensor] = None, editable: Optional[Tensor] = None,
             return_dict: bool = True) -> "EditingSchedulerOutput | tuple":
        """One M2T + T2T step on the block ``sample [B, Lb]`` (module docstring).

        Args:
            timestep: the row's count of steps that started with masks (int, or a LongTensor ``[B]``, one per row).
            editable: ``[B, Lb]`` bool, the committed positions T2T may replace (None: none; the block-causal loop
                passes the generated positions).
        """
        if self.quota is None:
            raise ValueError("call set_timesteps(None, gen_length, block_length) before step")
        self.check_step(model_output, timestep, sample, temperature, noise, proposal_mask, confidence_mask)
        masked = sample == mask_token_id
        if editable is None:
            editable = torch.zeros_like(masked)
        elif not isinstance(editable, Tensor) or editable.dtype != torch.bool or editable.shape != sample.shape:
            raise ValueError(f"editable must be None or a bool tensor of shape {tuple(sample.shape)}")
        editable = editable & ~masked & self.editing
        tokens, confidence = self.candidates(model_output, masked | editable, temperature, noise, proposal_mask,
                                             confidence_mask)
        steps = timestep if isinstance(timestep, Tensor) else torch.full_like(masked[:, 0], timestep, dtype=torch.long)
        quota = self.quota.to(sample.device)[steps.clamp(max=self.quota.numel() - 1)]
        masked_conf = confidence.masked_fill(~masked, float("-inf"))
        confident = masked_conf > self.config.threshold
        enough = confident.sum(dim=1) >= quota
        transfer = torch.where(enough[:, None], confident, top_n_by(masked_conf, quota)) & masked
        edit = editable & (confidence > self.config.editing_threshold if self.editing else False) & (tokens != sample)
        prev = torch.where(transfer | edit, tokens.to(sample.dtype), sample)
        conf64 = confidence.to(torch.float64).masked_fill(~(masked | editable), float("-inf"))
        tokens = tokens.masked_fill(~(masked | editable), -1)
        if not return_dict:
            return prev, transfer, tokens, conf64, edit
        return EditingSchedulerOutput(prev_sample=prev, transfer_index=transfer, sampled_tokens=tokens,
                                      confidence=conf64, editing_transfer_index=edit)

    @staticmethod
    def candidates(logits: Tensor, wanted: Tensor, temperature: float, noise: Optional[UnmaskNoise],
                   proposal_mask: Optional[Tensor], confidence_mask: Optional[Tensor]) -> tuple[Tensor, Tensor]:
        """``[B, Lb]`` candidates and float32 confidences ``softmax(ℓ)[x̂]`` at the ``wanted`` positions (elsewhere
        0 and -inf): arg-max over the tokens ``proposal_mask`` allows (first index on ties, as ``torch.argmax``), or a
        Gumbel-max sample keyed by the row's seed, the position and the forward count for ``temperature > 0``."""
        rows = wanted.reshape(-1).nonzero().squeeze(-1)
        flat = logits.reshape(-1, logits.shape[-1])
        picked = flat[rows]
        if temperature > 0:
            b, j = rows // wanted.shape[1], rows % wanted.shape[1]
            row_noise = RowNoise(noise.seeds[b], noise.positions[b, j], noise.draws[b])
            chosen = unmask_candidates(logits, temperature, None, proposal_mask, None, noise=row_noise, rows=rows).tokens
        else:
            proposal = picked if proposal_mask is None else picked.masked_fill(proposal_mask, float("-inf"))
            chosen = proposal.argmax(dim=-1)
        scored = picked.float() if confidence_mask is None else picked.float().masked_fill(confidence_mask, float("-inf"))
        conf = torch.softmax(scored, dim=-1).gather(-1, chosen[:, None]).squeeze(-1)
        tokens = torch.zeros(wanted.shape, dtype=torch.long, device=wanted.device)
        confidence = torch.full(wanted.shape, float("-inf"), dtype=torch.float32, device=wanted.device)
        tokens.view(-1)[rows] = chosen
        confidence.view(-1)[rows] = conf
        return tokens, confidence


def from_block_refinement(scheduler: Any, max_post_steps: int = 16) -> TokenEditingScheduler:
    """The vispec policy equal to a diffusers ``BlockRefinementScheduler``: its config's ``threshold``,
    ``editing_threshold`` (a negative one, which diffusers reads as off, becomes None), ``num_inference_steps``,
    ``minimal_topk`` and ``block_length``, with ``max_post_steps`` (a ``LLaDA2Pipeline`` call argument; 16, its
    default). diffusers' ``LLaDA2Pipeline`` overrides the scheduler's ``threshold`` (with 0.7), ``editing_threshold``
    (0.5) and ``num_inference_steps`` (32) by its own call defaults; vispec takes the scheduler's unless the call
    passes them."""
    config = scheduler.config
    editing = config.get("editing_threshold")
    if editing is not None and editing <= 0:
        editing = None
    return TokenEditingScheduler(threshold=float(config.get("threshold", 0.95)), editing_threshold=editing,
                                 max_post_steps=max_post_steps, num_inference_steps=int(config.get("num_inference_steps", 32)),
                                 minimal_topk=int(config.get("minimal_topk", 1)), block_length=config.get("block_length"))


SCHEDULERS["editing"] = TokenEditingScheduler
