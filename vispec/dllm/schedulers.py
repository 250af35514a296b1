"""Unmasking policies for masked diffusion LMs, as diffusers-style schedulers.

Every policy sees one semi-autoregressive block at a time (``[B, Lb]``; pure diffusion is one
block over the whole canvas), proposes a candidate for every masked position
(:func:`vispec.kernels.unmask.unmask_candidates`: arg-max or float64 Gumbel-max, confidence
``softmax(ℓ)[x̂]`` without temperature, entropy) and decides which positions to commit
("transfer"). A committed token is never re-masked. Policies (all batched: each row has its own
commit set, no Python loop over rows):

* :class:`LLaDAScheduler`: the LLaDA reference (Nie et al. 2025, arXiv 2502.09992;
  ML-GSAI/LLaDA ``generate.py``). ``steps`` is the total over all blocks, ``s = steps / K`` per
  block; step ``i`` of a block with ``M`` masked positions at its start commits exactly
  ``n_i = ⌊M / s⌋ + 1[i < M mod s]`` positions (the remainder first): the top-``n_i`` by confidence
  (``remasking="low_confidence"``; the confidence in the logits' own precision, as their ``generate()`` ranks,
  and exact ties to the lowest position: their ``torch.topk`` replaced by a stable descending sort, since
  ``topk`` leaves the order of ties unspecified) or by a uniform draw (``"random"``).
* :class:`ThresholdScheduler`: Fast-dLLM's confidence-aware parallel decoding (Wu et al. 2025,
  arXiv 2505.22618, §3.2): commit every masked position with ``c ≥ τ``, and always the most
  confident one.
* :class:`FactorScheduler`: Fast-dLLM's factor rule: with confidences sorted ``c_(1) ≥ c_(2) ≥ …``
  commit the longest prefix whose ranks all pass ``c_(n) ≥ 1 - f / (n + 1)`` (rank 1 always passes);
  ``commit_last_rank=True`` adds their code's boundary case (the last rank is committed when it is the
  first to fail).
* :class:`ContiguousScheduler`: the longest run of confident masked positions from the leftmost mask
  (a Lexical-Unit-Decoding analogue), at least the most confident one.
* :class:`EntropyBoundScheduler`: EB-Sampler (Ben-Hamu et al. 2025, arXiv 2505.24857): sort by
  entropy (or confidence) and commit the largest prefix with ``Σ_{i≤k} H_i - max_{i≤k} H_i ≤ γ``,
  at least one.

``step`` follows diffusers' ``BlockRefinementScheduler.step`` (model output, timestep = step index in
the block, current block tokens) and returns :class:`UnmaskSchedulerOutput`. It is two parts a policy overrides:
``propose`` (a candidate and a confidence for every masked position; Dream's own candidates,
:mod:`vispec.dllm.dream`) and ``select`` (which positions to commit); a learned filter adds ``accept``
(:mod:`vispec.dllm.learned`).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.schedulers.scheduling_utils import SchedulerMixin
from diffusers.utils import BaseOutput
from torch import Tensor

from vispec.checks import check_int, check_number
from vispec.dllm.options import check_blocks
from vispec.kernels.philox import Stream, uniforms
from vispec.kernels.unmask import RowNoise, unmask_candidates

if TYPE_CHECKING:
    from vispec.dllm.uniform import SharedGenerator


@dataclass
class UnmaskSchedulerOutput(BaseOutput):
    """One unmasking step on a block.

    Args:
        prev_sample: ``[B, Lb]`` block tokens after the step.
        transfer_index: ``[B, Lb]`` bool, positions committed in this step.
        sampled_tokens: ``[B, Lb]`` candidates (``-1`` where the position was not masked).
        confidence: ``[B, Lb]`` float64 confidences (``-inf`` where not masked).
        accepted: ``[B, Lb]`` bool, the committed positions a learned filter accepted (Learn2PD), as opposed to
            those committed only to meet the per-step floor; None for policies without a filter. End-of-text
            prediction truncates after an accepted EOS.
        draft: ``[B, Lb]`` provisional tokens for still-undecided positions (``-1``: none), which a model with a
            uniform corruption process is shown there at the next forward instead of fresh noise
            (:mod:`vispec.dllm.uniform`); None for policies without drafts (masked models ignore it).
        pred_logits: ``[B, Lb, V]`` the logits such a model self-conditions on at the next forward (diffusers'
            ``pred_logits``); None: the step's own ``model_output``.
    """

    prev_sample: Tensor
    transfer_index: Tensor
    sampled_tokens: Tensor
    confidence: Tensor
    accepted: Optional[Tensor] = None
    draft: Optional[Tensor] = None
    pred_logits: Optional[Tensor] = None


@dataclass
class Proposal:
    """A step's candidates for the masked positions of a block (:meth:`UnmaskingScheduler.propose`).

    Args:
        tokens: ``[B, Lb]`` candidates (``-1`` where the position was not masked).
        confidence: ``[B, Lb]`` float64 confidences the policy ranks by (``-inf`` where not masked).
        entropy: ``[B, Lb]`` float64 entropies of the candidates' distributions (``+inf`` where not masked), or None
            when the proposal does not compute them.
    """

    tokens: Tensor
    confidence: Tensor
    entropy: Optional[Tensor] = None


@dataclass
class UnmaskNoise:
    """The counter-based key of a step's randomness: Philox keyed by (row seed, absolute position, stream, draw).

    ``seeds [B]`` come from each row's ``torch.Generator``; ``positions [B, Lb]`` are the block's
    positions in the generated canvas (independent of the prompt's padded width); ``draws [B]`` is the row's forward count, so every step gets fresh noise
    and a row's numbers do not depend on the rest of the batch.

    ``rows [B]`` (the step's batch rows, sorted) lets a policy keep per-row state over the steps of a block (the
    DiffusionGemma rule's stability history, :mod:`vispec.dllm.gemma_rule`); ``shared`` is the decode's
    :class:`vispec.dllm.uniform.SharedGenerator` when it draws as the reference implementations do (None: counter-based).
    """

    seeds: Tensor
    positions: Tensor
    draws: Tensor
    rows: Optional[Tensor] = None
    shared: Optional["SharedGenerator"] = None


class UnmaskingScheduler(SchedulerMixin, ConfigMixin):
    """Base class: candidate proposal (:meth:`propose`) and the batched commit step; subclasses choose the commit set
    (:meth:`select`).

    ``fixed_steps`` is True for policies with a step budget per block (the block loop runs exactly
    ``steps_per_block`` steps); adaptive policies run until the block has no masked position.
    ``strategy`` is the policy's name in :data:`SCHEDULERS` (the ``method`` of a decode's output).
    """

    config_name = "scheduler_config.json"
    order = 1
    strategy = ""
    fixed_steps = False
    uses_remask_noise = False

    def __init__(self) -> None:
        self.num_blocks: Optional[int] = None
        self.steps_per_block: Optional[int] = None
        self.timesteps = torch.zeros(0, dtype=torch.long)

    def set_timesteps(self, num_inference_steps: Optional[int], gen_length: int, block_length: int,
                      device: "torch.device | str | None" = None) -> None:
        """Validate the canvas split; fixed-step policies also need ``num_inference_steps`` (total over blocks)."""
        self.num_blocks = check_blocks(gen_length, block_length)
        if self.fixed_steps:
            steps = check_int("steps", num_inference_steps, minimum=1,
                              hint=f" (the total over all blocks; {type(self).__name__} runs a fixed number per block)")
            if steps % self.num_blocks:
                raise ValueError(f"steps ({steps}) must be divisible by the number of blocks "
                                 f"(gen_length / block_length = {self.num_blocks})")
            self.steps_per_block = steps // self.num_blocks
            self.timesteps = torch.arange(self.steps_per_block, device=device)
        else:
            self.steps_per_block = None
            self.timesteps = torch.zeros(0, dtype=torch.long, device=device)

    def step(
        self,
        model_output: Tensor,
        timestep: int,
        sample: Tensor,
        *,
        mask_token_id: int,
        temperature: float = 0.0,
        noise: Optional[UnmaskNoise] = None,
        num_masked_at_block_start: Optional[Tensor] = None,
        proposal_mask: Optional[Tensor] = None,
        confidence_mask: Optional[Tensor] = None,
        return_dict: bool = True,
    ) -> "UnmaskSchedulerOutput | tuple":
        """One unmasking step on the block ``sample [B, Lb]`` from ``model_output [B, Lb, V]``: :meth:`propose` a
        candidate for every masked position, :meth:`select` the positions to commit (plus those a learned filter
        :meth:`accept` s), and commit them.

        Args:
            timestep: step index within the block (``0, 1, ...``), or a LongTensor ``[B]`` with one per row (rows at
                different steps, as the lanes of :mod:`vispec.dllm.speculative`).
            noise: the randomness key; needed for ``temperature > 0`` and random commits.
            num_masked_at_block_start: ``[B]`` masked positions when the block started (quota policies).
            proposal_mask, confidence_mask: ``[V]`` bool token masks (:mod:`vispec.kernels.unmask`).
        """
        self.check_step(model_output, timestep, sample, temperature, noise, proposal_mask, confidence_mask)
        masked = sample == mask_token_id
        proposal = self.propose(model_output, masked, temperature=temperature, noise=noise,
                                proposal_mask=proposal_mask, confidence_mask=confidence_mask)
        accepted = self.accept(model_output, masked, proposal_mask)
        transfer = self.select(proposal.confidence, proposal.entropy, masked, timestep, num_masked_at_block_start,
                               noise) & masked
        if accepted is not None:
            transfer = transfer | accepted
        tokens = proposal.tokens.to(sample.dtype)
        prev = torch.where(transfer, tokens, sample)
        if not return_dict:
            return prev, transfer, tokens, proposal.confidence
        return UnmaskSchedulerOutput(prev_sample=prev, transfer_index=transfer, sampled_tokens=tokens,
                                     confidence=proposal.confidence, accepted=accepted)

    def check_step(self, model_output: Tensor, timestep: int, sample: Tensor, temperature: float,
                   noise: Optional[UnmaskNoise], proposal_mask: Optional[Tensor], confidence_mask: Optional[Tensor]) -> None:
        """:meth:`step`'s inputs (errors name the argument), before any work."""
        if self.fixed_steps and self.steps_per_block is None:
            raise ValueError("call set_timesteps(steps, gen_length, block_length) before step")
        if not isinstance(sample, Tensor) or sample.dim() != 2 or sample.dtype.is_floating_point:
            raise ValueError(f"sample must be an integer tensor [B, Lb], got "
                             f"{tuple(sample.shape) if isinstance(sample, Tensor) else type(sample).__name__}")
        if (not isinstance(model_output, Tensor) or not model_output.dtype.is_floating_point
                or model_output.dim() != 3 or model_output.shape[:2] != sample.shape):
            got = tuple(model_output.shape) if isinstance(model_output, Tensor) else type(model_output).__name__
            raise ValueError(f"model_output must be float logits [B, Lb, V] matching sample {tuple(sample.shape)}, got {got}")
        if isinstance(timestep, Tensor):  # one step index per row (self-speculative lanes), range kept by the caller
            if timestep.dtype != torch.long or tuple(timestep.shape) != tuple(sample.shape[:1]):
                raise ValueError(f"timestep must be an int or a LongTensor [B] of per-row step indices, got "
                                 f"{timestep.dtype} {tuple(timestep.shape)}")
        elif self.fixed_steps:
            check_int("timestep", timestep, minimum=0, maximum=self.steps_per_block - 1,
                      hint=f" (the step index within the block; {self.steps_per_block} steps per block)")
        else:
            check_int("timestep", timestep, minimum=0, hint=" (the step index within the block)")
        check_number("temperature", temperature, minimum=0, hint=" (0 means arg-max candidates)")
        if (temperature > 0 or self.uses_remask_noise) and noise is None:
            raise ValueError(f"noise is needed for temperature > 0 and for random commits ({type(self).__name__})")
        vocab = model_output.shape[-1]
        for name, token_mask in (("proposal_mask", proposal_mask), ("confidence_mask", confidence_mask)):
            if token_mask is not None and (not isinstance(token_mask, Tensor) or token_mask.dtype != torch.bool
                                           or token_mask.shape != (vocab,)):
                raise ValueError(f"{name} must be None or a bool tensor of shape ({vocab},)")

    def propose(self, model_output: Tensor, masked: Tensor, *, temperature: float, noise: Optional[UnmaskNoise],
                proposal_mask: Optional[Tensor], confidence_mask: Optional[Tensor]) -> Proposal:
        """A candidate, its confidence and its entropy for every ``masked`` position (:class:`Proposal`): the kernel's
        arg-max or float64 Gumbel-max (:func:`vispec.kernels.unmask.unmask_candidates`), ranked by
        :meth:`ranking_confidence`."""
        # the masked positions as row indices into model_output viewed as [B * Lb, V]: the kernel reads
        # them in place, and draws their Gumbel noise from the Philox keys (no [R, V] uniforms)
        rows = masked.reshape(-1).nonzero().squeeze(-1)
        b, j = rows // masked.shape[1], rows % masked.shape[1]
        row_noise = None
        if temperature > 0:
            row_noise = RowNoise(noise.seeds[b], noise.positions[b, j], noise.draws[b])
        cand = unmask_candidates(model_output, temperature, None, proposal_mask, confidence_mask,
                                 noise=row_noise, rows=rows)
        tokens = torch.full(masked.shape, -1, dtype=torch.long, device=masked.device)
        tokens[b, j] = cand.tokens
        confidence = torch.full(masked.shape, float("-inf"), dtype=torch.float64, device=masked.device)
        confidence[b, j] = self.ranking_confidence(model_output.reshape(-1, model_output.shape[-1]), rows, cand,
                                                   confidence_mask)
        entropy = torch.full(masked.shape, float("inf"), dtype=torch.float64, device=masked.device)
        entropy[b, j] = cand.entropy
        return Proposal(tokens, confidence, entropy)

    def ranking_confidence(self, logits: Tensor, rows: Tensor, cand, confidence_mask: Optional[Tensor]) -> Tensor:
        """``[R]`` float64 confidences the policy ranks by, for the masked ``rows`` of ``logits [B * Lb, V]``:
        the kernel's float64 ``softmax(ℓ)[x̂]`` (subclasses may compute it as their reference code does)."""
        return cand.confidence

    def select(self, confidence: Tensor, entropy: Optional[Tensor], masked: Tensor, timestep: int,
               num_masked_at_block_start: Optional[Tensor], noise: Optional[UnmaskNoise]) -> Tensor:
        """``[B, Lb]`` bool commit set (subclasses). ``confidence`` is ``-inf`` and ``entropy`` ``+inf`` off ``masked``."""
        raise NotImplementedError

    def accept(self, model_output: Tensor, masked: Tensor, proposal_mask: Optional[Tensor]) -> Optional[Tensor]:
        """``[B, Lb]`` bool masked positions a learned filter accepts (committed besides :meth:`select`'s), or None
        for policies without one (:class:`vispec.dllm.learned.LearnedFilterScheduler`)."""
        return None


def top_n_by(score: Tensor, n: Tensor) -> Tensor:
    """``[B, Lb]`` bool: the ``n[b]`` highest-scoring positions of each row (``-inf`` scores never count)."""
    order = score.argsort(dim=-1, descending=True, stable=True)
    rank = torch.empty_like(order)
    rank.scatter_(-1, order, torch.arange(score.shape[-1], device=score.device).expand_as(order))
    return (rank < n[:, None]) & torch.isfinite(score)


def most_confident(confidence: Tensor) -> Tensor:
    """``[B, Lb]`` bool: the single most confident masked position per row (none if the row has none)."""
    return top_n_by(confidence, torch.ones(confidence.shape[0], dtype=torch.long, device=confidence.device))


class LLaDAScheduler(UnmaskingScheduler):
    """The LLaDA reference policy: a fixed per-step quota, top-``n_i`` by confidence or at random (module docstring).

    Args:
        remasking: ``"low_confidence"`` (commit the most confident; LLaDA's name for throwing away the
            rest) or ``"random"`` (commit ``n_i`` positions chosen uniformly at random).
    """

    strategy = "llada"
    fixed_steps = True

    @register_to_config
    def __init__(self, remasking: str = "low_confidence"):
        super().__init__()
        if remasking not in ("low_confidence", "random"):
            raise ValueError(f"remasking must be 'low_confidence' or 'random', got {remasking!r}")
        self.uses_remask_noise = remasking == "random"

    def quota(self, num_masked: Tensor, timestep: int) -> Tensor:
        """``n_i = ⌊M / s⌋ + 1[i < M mod s]`` per row (LLaDA ``get_num_transfer_tokens``)."""
        if self.steps_per_block is None:
            raise ValueError("call set_timesteps(steps, gen_length, block_length) before step")
        s = self.steps_per_block
        return num_masked // s + (timestep < num_masked % s).long()

    def ranking_confidence(self, logits: Tensor, rows: Tensor, cand, confidence_mask: Optional[Tensor]) -> Tensor:
        """LLaDA's ranking: ``softmax(ℓ)[x̂]`` computed in the logits' own precision (float32, or bfloat16 for
        the 8B model), where near-certain positions round to exactly 1.0 and tie. An exact tie goes to the lowest
        position (:func:`top_n_by` sorts stably), on every device and torch version; their ``generate()`` ranks
        with ``torch.topk``, whose order among ties is unspecified (on CPU with torch 2.13, ``topk`` over eight
        values with four tied at 1.0 returned indices [21, 23], not [20, 21]), so at such steps it may commit
        other positions than vispec."""
        if logits.dtype == torch.float64:
            return cand.confidence
        picked = logits[rows]
        if confidence_mask is not None:
            picked = picked.masked_fill(confidence_mask, float("-inf"))
        return torch.softmax(picked, dim=-1).gather(-1, cand.tokens[:, None]).squeeze(-1).to(torch.float64)

    def select(self, confidence, entropy, masked, timestep, num_masked_at_block_start, noise):
        if num_masked_at_block_start is None:
            raise ValueError("LLaDAScheduler.step needs num_masked_at_block_start")
        score = confidence
        if self.config.remasking == "random":
            draws = uniforms(noise.seeds, noise.positions, Stream.REMASK, noise.draws).to(torch.float64)
            score = torch.where(masked, draws, torch.full_like(draws, float("-inf")))
        return top_n_by(score, self.quota(num_masked_at_block_start, timestep))


class ThresholdScheduler(UnmaskingScheduler):
    """Fast-dLLM threshold rule: commit ``c ≥ threshold``, and at least the most confident position."""

    strategy = "threshold"

    @register_to_config
    def __init__(self, threshold: float = 0.9):
        super().__init__()
        check_number("threshold", threshold, minimum=0, maximum=1, exclusive_minimum=True)

    def select(self, confidence, entropy, masked, timestep, num_masked_at_block_start, noise):
        return (masked & (confidence >= self.config.threshold)) | most_confident(confidence)


class FactorScheduler(UnmaskingScheduler):
    """Fast-dLLM factor rule: the longest confidence-sorted prefix with ``(n + 1)(1 - c_(n)) ≤ factor``.

    Args:
        factor: ``f`` (> 0).
        commit_last_rank: Fast-dLLM's code (``get_transfer_index_dynamic``) also commits the last masked
            rank when it is the first to fail, so a block whose every other rank passes is committed whole.
            ``False`` (default) is the rule as the paper states it; ``True`` follows their code.
    """

    strategy = "factor"

    @register_to_config
    def __init__(self, factor: float = 1.0, commit_last_rank: bool = False):
        super().__init__()
        check_number("factor", factor, minimum=0, exclusive_minimum=True)
        if not isinstance(commit_last_rank, bool):
            raise ValueError(f"commit_last_rank must be a bool, got {commit_last_rank!r}")

    def select(self, confidence, entropy, masked, timestep, num_masked_at_block_start, noise):
        sorted_conf, order = confidence.sort(dim=-1, descending=True, stable=True)
        rank = torch.arange(1, confidence.shape[-1] + 1, device=confidence.device, dtype=torch.float64)
        passes = (rank + 1) * (1 - sorted_conf) <= self.config.factor
        passes[:, 0] = True  # rank 1 always passes
        passes &= torch.isfinite(sorted_conf)
        count = passes.long().cumprod(dim=-1).sum(dim=-1)
        if self.config.commit_last_rank:
            num_masked = torch.isfinite(confidence).sum(dim=-1)
            count = torch.where(count == num_masked - 1, num_masked, count)
        return top_n_by(confidence, count)


class EntropyBoundScheduler(UnmaskingScheduler):
    """EB-Sampler: the largest error-sorted prefix with ``Σ H - max H ≤ gamma`` (at least one position).

    Args:
        gamma: entropy budget in nats (``≥ 0``; 0 commits one position per step unless entropies are 0).
        order_by: ``"entropy"`` (ascending) or ``"confidence"`` (descending) as the error proxy.
    """

    strategy = "entropy"

    @register_to_config
    def __init__(self, gamma: float = 0.1, order_by: str = "entropy"):
        super().__init__()
        check_number("gamma", gamma, minimum=0, hint=" (an entropy budget in nats)")
        if order_by not in ("entropy", "confidence"):
            raise ValueError(f"order_by must be 'entropy' or 'confidence', got {order_by!r}")

    def select(self, confidence, entropy, masked, timestep, num_masked_at_block_start, noise):
        score = -entropy if self.config.order_by == "entropy" else confidence
        order = score.argsort(dim=-1, descending=True, stable=True)
        h = entropy.gather(-1, order).masked_fill(~masked.gather(-1, order), 0.0)
        spent = h.cumsum(dim=-1) - h.cummax(dim=-1).values  # nondecreasing in k
        count = ((spent <= self.config.gamma) & masked.gather(-1, order)).long().cumprod(dim=-1).sum(dim=-1).clamp_min(1)
        return top_n_by(score.masked_fill(~masked, float("-inf")), count)


class ContiguousScheduler(UnmaskingScheduler):
    """Contiguous-run rule, the block-decoding analogue of Lexical Unit Decoding (Sun et al. 2024, arXiv
    2405.15208): commit the longest run of masked positions with ``c ≥ threshold`` that starts at the leftmost
    masked position (decoded positions inside the run do not break it; the first masked position below the
    threshold does). When the leftmost masked position is not confident, commit the most confident one, so
    every step makes progress (as the threshold rule does).

    Args:
        threshold: ``τ`` in (0, 1].
    """

    strategy = "contiguous"

    @register_to_config
    def __init__(self, threshold: float = 0.9):
        super().__init__()
        check_number("threshold", threshold, minimum=0, maximum=1, exclusive_minimum=True)

    def select(self, confidence, entropy, masked, timestep, num_masked_at_block_start, noise):
        confident = masked & (confidence >= self.config.threshold)
        blocked = (masked & ~confident).long().cumsum(dim=-1) > 0  # at or after the first unconfident mask
        run = confident & ~blocked
        return torch.where(run.any(dim=-1, keepdim=True), run, most_confident(confidence))


SCHEDULERS = {
    "llada": LLaDAScheduler,
    "threshold": ThresholdScheduler,
    "factor": FactorScheduler,
    "entropy": EntropyBoundScheduler,
    "contiguous": ContiguousScheduler,
}


def make_scheduler(strategy: str, **settings) -> UnmaskingScheduler:
    """A scheduler by strategy name (``llada``, ``threshold``, ``factor``, ``entropy``, ``contiguous``) with its
    settings."""
    if strategy not in SCHEDULERS:
        raise ValueError(f"strategy must be one of {tuple(SCHEDULERS)}, got {strategy!r}")
    cls = SCHEDULERS[strategy]
    parameters = inspect.signature(cls.__init__).parameters
    known = {n for n, p in parameters.items() if n != "self" and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    open_ended = any(p.kind == p.VAR_KEYWORD for p in parameters.values())
    unknown = [] if open_ended else sorted(set(settings) - known)
    if unknown:
        raise ValueError(f"unknown setting(s) {unknown} for strategy {strategy!r} ({cls.__name__}); its settings are "
                         f"{sorted(known)}")
    return cls(**settings)
