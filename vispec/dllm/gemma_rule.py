"""DiffusionGemma's own decoding rule as a vispec policy: a provisional canvas, then one commit when it has converged.

DiffusionGemma (transformers' ``DiffusionGemmaForBlockDiffusion``, Google 2026) is a block-diffusion model with
*uniform* corruption (:mod:`vispec.dllm.uniform`): a canvas of ``C`` tokens starts uniformly random and is denoised
for at most ``N`` steps. Nothing is final until the canvas stops; each step keeps some positions provisionally (the
*draft*, shown to the denoiser at the next step) and renoises the others. Two samplers decide the draft:

* ``sampler="entropy_bound"``, the rule of transformers' ``DiffusionGemmaGenerationMixin.generate`` (its defaults:
  ``max_denoising_steps=48``, ``EntropyBoundSamplerConfig(entropy_bound=0.1)``, ``t_max=0.8``, ``t_min=0.4``,
  ``stability_threshold=1``, ``confidence_threshold=0.005``). At step ``i`` (``0 ≤ i < N``) the logits are tempered,
  ``ℓ̃ = ℓ / T_i`` with ``T_i = t_min + (t_max - t_min)(N - i)/N`` (float32, as their logits processor computes it:
  ``t_max`` at the first step, falling linearly); every undecided position draws a sample ``x̃_j ~ softmax(ℓ̃_j)``;
  with the entropies ``H_j`` of ``softmax(ℓ̃_j)`` sorted ascending, the draft keeps the samples of the longest prefix
  with ``Σ_{k≤m} H_(k) - H_(m) ≤ γ`` (EB-Sampler's bound on the accepted tokens' mutual information, Ben-Hamu et al.
  2025, arXiv 2505.24857; at least one position); the denoiser self-conditions on ``ℓ̃``.
* ``sampler="block_refinement"``, the rule of diffusers' ``DiffusionGemmaPipeline`` with its
  ``BlockRefinementScheduler`` (uniform-corruption mode, the pipeline's documented default: ``threshold=0.95``,
  ``num_inference_steps=48``, temperature 0). Candidates are the arg-max (or, at ``temperature > 0``, samples of
  ``softmax(ℓ / T)``) with confidence ``p_j`` their probability; the draft *grows*: after step ``i`` it holds at least
  ``⌈(i + 1) C / N⌉`` positions (the highest-confidence new ones; ties in the order of ``torch.argsort``) plus every
  new one with ``p_j > threshold``, and a drafted token stays; the denoiser self-conditions on the raw logits.

Both end a row's canvas with the same *stable-and-confident* rule (transformers' ``StableAndConfidentStoppingCriteria``,
applied by diffusers' pipeline too): after a step, with ``a`` the arg-max of the logits the sampler used (``ℓ̃``
or ``ℓ``), the row stops when ``a`` equals its arg-max of each of the last ``stability_threshold`` steps (0: no
stability condition in transformers; diffusers' pipeline keeps one step of history whatever the value, so with
``block_refinement`` 0 acts as 1) and the mean entropy over the canvas is below ``confidence_threshold``; it then commits ``a`` at
every undecided position and leaves the forward. A row that never stops commits at step ``N - 1``: ``a`` for
``entropy_bound`` (transformers returns the last arg-max), its complete draft for ``block_refinement`` (diffusers
returns the canvas). ``confidence_threshold=None`` turns the rule off (every block runs ``N`` steps).

In vispec the rule is an :class:`~vispec.dllm.UnmaskingScheduler` whose commits happen only at the stop: the block
loop, caches, end-of-text prediction and Prophet's early commit run around it unchanged, and the model adapter
(:mod:`vispec.models.diffusion_gemma`) shows the denoiser the rule's draft (:attr:`~vispec.dllm.UnmaskSchedulerOutput.
draft`) and self-conditions on its :attr:`~vispec.dllm.UnmaskSchedulerOutput.pred_logits`. Positions decided
before the stop (a callback's edit, an end-of-text cut) stay as they are; the rule's sums and means then run over
the undecided positions. Samples come from the decode's :class:`~vispec.dllm.uniform.SharedGenerator` when it has
one (``torch.multinomial`` over the whole batch, as the references draw; tokens equal theirs for the same seed),
else from counter-based Gumbel-max noise per row (:func:`vispec.kernels.unmask.unmask_candidates`: the same
distribution, batch-invariant). The rule keeps per-row state over a block (the arg-max history, the growing draft),
indexed by the step's batch rows (:attr:`vispec.dllm.UnmaskNoise.rows`).
"""

from __future__ import annotations

from typing import Optional

import torch
from diffusers.configuration_utils import register_to_config
from torch import Tensor

from vispec.checks import check_int, check_number
from vispec.dllm.options import check_blocks
from vispec.dllm.schedulers import SCHEDULERS, UnmaskingScheduler, UnmaskNoise, UnmaskSchedulerOutput
from vispec.kernels.unmask import RowNoise, unmask_candidates

SAMPLERS = ("entropy_bound", "block_refinement")


def token_entropy(logits: Tensor) -> Tensor:
    """``[..., W]`` entropy of ``softmax(logits)`` in the logits' precision, computed as transformers' and diffusers'
    ``Categorical(logits=...).entropy()`` (so the stop rule and the bound see their very numbers)."""
    return torch.distributions.Categorical(logits=logits, validate_args=False).entropy()


class DiffusionGemmaRule(UnmaskingScheduler):
    """DiffusionGemma's decoding rule (module docstring): a provisional draft, one commit when the canvas is stable and
    confident or its step budget ends.

    Args:
        sampler: ``"entropy_bound"`` (transformers' ``generate``) or ``"block_refinement"`` (diffusers'
            ``DiffusionGemmaPipeline`` with ``BlockRefinementScheduler``).
        max_denoising_steps: ``N``, the step budget per canvas (block); ``steps`` / ``num_inference_steps`` of a
            decode override it (``steps`` is the total over blocks).
        entropy_bound: ``γ`` of the entropy-bound draft (``> 0``).
        t_min, t_max: the tempering schedule of ``entropy_bound`` (``T`` from ``t_max`` down to ``t_min``; both
            None: no tempering).
        threshold: ``block_refinement``'s confidence above which a position joins the draft beyond the quota.
        stability_threshold: steps the arg-max must have stayed the same (``>= 0``).
        confidence_threshold: the mean entropy (nats) under which a stable canvas stops; None: never stop early.
    """

    strategy = "gemma"
    fixed_steps = True
    draws_shared = True  # its samples come from a SharedGenerator when the decode has one (vispec.dllm.decode)

    @register_to_config
    def __init__(self, sampler: str = "entropy_bound", max_denoising_steps: int = 48, entropy_bound: float = 0.1,
                 t_min: Optional[float] = 0.4, t_max: Optional[float] = 0.8, threshold: float = 0.95,
                 stability_threshold: int = 1, confidence_threshold: Optional[float] = 0.005):
        super().__init__()
        if sampler not in SAMPLERS:
            raise ValueError(f"sampler must be one of {SAMPLERS}, got {sampler!r}")
        check_int("max_denoising_steps", max_denoising_steps, minimum=1)
        check_number("entropy_bound", entropy_bound, minimum=0, exclusive_minimum=True, hint=" (nats)")
        if (t_min is None) != (t_max is None):
            raise ValueError(f"t_min and t_max are both set (a tempering schedule) or both None, got t_min={t_min!r}, "
                             f"t_max={t_max!r}")
        if t_min is not None:
            check_number("t_min", t_min, minimum=0, exclusive_minimum=True)
            check_number("t_max", t_max, minimum=t_min, hint=f" (the first step's temperature, >= t_min={t_min})")
        check_number("threshold", threshold, minimum=0)
        check_int("stability_threshold", stability_threshold, minimum=0)
        if confidence_threshold is not None:
            check_number("confidence_threshold", confidence_threshold, minimum=0, exclusive_minimum=True,
                         hint=" (a mean entropy in nats; None turns the early stop off)")
        self.history: Optional[Tensor] = None  # [S, n, W] the last arg-max canvases of each batch row
        self.drafted: Optional[Tensor] = None  # [n, W] block_refinement: positions in the draft
        self.draft_tokens: Optional[Tensor] = None  # [n, W] block_refinement: their tokens

    # ------------------------------------------------------------------ budget and inputs
    def set_timesteps(self, num_inference_steps: Optional[int], gen_length: int, block_length: int,
                      device: "torch.device | str | None" = None) -> None:
        """``N`` per block: ``num_inference_steps / K`` when given (the total over the ``K`` blocks, as vispec's other
        fixed-step policies), else ``max_denoising_steps``."""
        blocks = check_blocks(gen_length, block_length)
        if num_inference_steps is None:
            num_inference_steps = self.config.max_denoising_steps * blocks
        super().set_timesteps(num_inference_steps, gen_length, block_length, device)

    @property
    def default_steps_per_block(self) -> int:
        """The budget a pipeline uses when the call gives none: ``max_denoising_steps``."""
        return self.config.max_denoising_steps

    def check_options(self, options) -> None:
        """The decode options this rule cannot honour (:func:`vispec.dllm.decode` asks before any work)."""
        if self.config.sampler == "entropy_bound" and options.temperature != 0:
            raise ValueError(f"temperature={options.temperature!r}: the entropy-bound DiffusionGemma rule samples at its "
                             "own annealed temperature (t_max -> t_min); leave temperature=0")
        if options.speculative is not None:
            raise ValueError("the DiffusionGemma rule keeps per-row state from step to step, which self-speculative "
                             "lanes (several steps per forward) do not pass: pass speculative=None")
        if options.confidence_eos_eot_inf:
            raise ValueError("confidence_eos_eot_inf ranks EOS / EoT proposals last by confidence; the DiffusionGemma "
                             "rule commits a whole canvas at once and ranks nothing: pass confidence_eos_eot_inf=False")

    def check_step(self, model_output, timestep, sample, temperature, noise, proposal_mask, confidence_mask) -> None:
        super().check_step(model_output, timestep, sample, temperature, noise, proposal_mask, confidence_mask)
        if isinstance(timestep, Tensor):
            raise ValueError("the DiffusionGemma rule runs one step index for all rows (no self-speculative lanes)")
        if noise is None or noise.rows is None:
            raise ValueError("the DiffusionGemma rule keeps per-row state over a block: step() needs noise=UnmaskNoise("
                             "..., rows=) with the step's batch rows (vispec's block loop passes them)")
        if self.config.sampler == "entropy_bound" and temperature != 0:
            raise ValueError("the entropy-bound DiffusionGemma rule samples at its own annealed temperature; "
                             f"temperature must be 0, got {temperature!r}")
        if confidence_mask is not None:
            raise ValueError("the DiffusionGemma rule ranks no confidences: confidence_mask must be None")

    def temperature_at(self, timestep: int, device: torch.device) -> Optional[Tensor]:
        """``T_i`` (float32) as transformers' ``LinearTemperatureScheduleLogitsProcessor`` computes it, from the
        remaining step count ``N - i`` (an int32 tensor there); None without a schedule."""
        if self.config.t_min is None:
            return None
        remaining = torch.tensor(self.steps_per_block - timestep, dtype=torch.int32, device=device)
        return self.config.t_min + (self.config.t_max - self.config.t_min) * (remaining / self.steps_per_block)

    # ------------------------------------------------------------------ the step
    def step(self, model_output: Tensor, timestep: int, sample: Tensor, *, mask_token_id: int, temperature: float = 0.0,
             noise: Optional[UnmaskNoise] = None, num_masked_at_block_start: Optional[Tensor] = None,
             proposal_mask: Optional[Tensor] = None, confidence_mask: Optional[Tensor] = None,
             return_dict: bool = True) -> "UnmaskSchedulerOutput | tuple":
        """One step on the block ``sample [R, W]`` (module docstring): the draft, the stop rule, and (at the stop or the
        last step) the commit of the whole canvas. ``noise.rows`` are the step's batch rows."""
        self.check_step(model_output, timestep, sample, temperature, noise, proposal_mask, confidence_mask)
        rows = noise.rows
        undecided = sample == mask_token_id
        logits = model_output if proposal_mask is None else model_output.masked_fill(proposal_mask, float("-inf"))
        if timestep == 0:
            self._start_block(rows, sample, undecided)
        if self.config.sampler == "entropy_bound":
            temp = self.temperature_at(timestep, logits.device)
            logits = logits if temp is None else logits / temp
            entropy = token_entropy(logits)
            draft = self._entropy_bound_draft(logits, entropy, undecided, noise)
            final = logits.argmax(dim=-1)
        else:
            entropy = token_entropy(logits.float())
            draft = self._refinement_draft(logits, timestep, undecided, temperature, noise)
            final = self.draft_tokens[rows]
        argmax = logits.argmax(dim=-1)
        stop = self._converged(rows, torch.where(undecided, argmax, sample), entropy, undecided)
        commit = stop | (timestep == self.steps_per_block - 1)
        final = torch.where(stop[:, None], argmax, final)
        transfer = undecided & commit[:, None]
        tokens = torch.where(undecided, final, torch.full_like(final, -1))
        prev = torch.where(transfer, final, sample)
        top = logits.gather(-1, argmax[..., None]).squeeze(-1).float() - torch.logsumexp(logits.float(), dim=-1)
        confidence = top.to(torch.float64).exp().masked_fill(~undecided, float("-inf"))  # softmax(ℓ)[a], reported
        draft = torch.where(transfer, torch.full_like(draft, -1), draft)
        if not return_dict:
            return prev, transfer, tokens, confidence
        return UnmaskSchedulerOutput(prev_sample=prev, transfer_index=transfer, sampled_tokens=tokens,
                                     confidence=confidence, draft=draft, pred_logits=logits)

    def _start_block(self, rows: Tensor, sample: Tensor, undecided: Tensor) -> None:
        """Fresh per-row state for a block: no arg-max history, an empty draft (decided positions count as drafted)."""
        n, width = int(rows.max()) + 1, sample.shape[1]
        depth = max(self.config.stability_threshold, 1)
        self.history = torch.full((depth, n, width), -1, dtype=torch.long, device=sample.device)
        self.drafted = torch.zeros(n, width, dtype=torch.bool, device=sample.device)
        self.draft_tokens = torch.zeros(n, width, dtype=torch.long, device=sample.device)
        self.drafted[rows] = ~undecided
        self.draft_tokens[rows] = sample

    def _samples(self, logits: Tensor, undecided: Tensor, temperature: float, noise: UnmaskNoise) -> tuple[Tensor, Tensor]:
        """``[R, W]`` one sample of ``softmax(ℓ / T)`` per position and ``[R, W, V]`` float32 ``softmax(ℓ / T)``: from the
        shared generator (``multinomial`` over the whole batch, every position, as the references) or counter-based
        Gumbel-max per row (undecided positions; ``-1`` elsewhere)."""
        scaled = logits if temperature == 1.0 else logits / temperature
        probs = torch.softmax(scaled, dim=-1, dtype=torch.float32)
        if noise.shared is not None:
            return noise.shared.multinomial(probs, noise.rows), probs
        index = undecided.reshape(-1).nonzero().squeeze(-1)
        b, j = index // undecided.shape[1], index % undecided.shape[1]
        cand = unmask_candidates(logits, temperature, noise=RowNoise(noise.seeds[b], noise.positions[b, j],
                                                                     noise.draws[b]), rows=index)
        samples = torch.full(undecided.shape, -1, dtype=torch.long, device=logits.device)
        samples[b, j] = cand.tokens
        return samples, probs

    def _entropy_bound_draft(self, logits: Tensor, entropy: Tensor, undecided: Tensor, noise: UnmaskNoise) -> Tensor:
        """The samples of the longest entropy-sorted prefix within the bound ``γ`` (module docstring); ``-1`` elsewhere."""
        samples, _ = self._samples(logits, undecided, 1.0, noise)
        ranked, order = torch.sort(entropy.masked_fill(~undecided, float("inf")), dim=-1)  # as their sampler sorts
        within = ranked.cumsum(dim=-1) - ranked <= self.config.entropy_bound  # inf - inf is NaN: decided never pass
        accepted = torch.zeros_like(within).scatter(-1, order, within) & undecided
        return torch.where(accepted, samples, torch.full_like(samples, -1))

    def _refinement_draft(self, logits: Tensor, timestep: int, undecided: Tensor, temperature: float,
                          noise: UnmaskNoise) -> Tensor:
        """``BlockRefinementScheduler``'s uniform-corruption commits as a growing draft (module docstring)."""
        rows = noise.rows
        if temperature == 0:
            tokens = logits.argmax(dim=-1)
            probs = torch.softmax(logits.float(), dim=-1)
        else:
            tokens, probs = self._samples(logits, undecided, temperature, noise)
        confidence = probs.gather(-1, tokens.clamp_min(0)[..., None]).squeeze(-1)
        drafted, width = self.drafted[rows], undecided.shape[1]
        target = ((timestep + 1) * width + self.steps_per_block - 1) // self.steps_per_block
        needed = (target - drafted.sum(dim=-1)).clamp(min=0)
        rank = confidence.masked_fill(drafted, float("-inf")).argsort(dim=-1, descending=True).argsort(dim=-1)
        joins = ~drafted & ((rank < needed[:, None]) | (confidence > self.config.threshold))
        self.draft_tokens[rows] = torch.where(joins, tokens, self.draft_tokens[rows])
        self.drafted[rows] = drafted | joins
        return torch.where(self.drafted[rows] & undecided, self.draft_tokens[rows], torch.full_like(tokens, -1))

    def _converged(self, rows: Tensor, argmax: Tensor, entropy: Tensor, undecided: Tensor) -> Tensor:
        """``[R]`` the stable-and-confident rule (module docstring); the history advances every step."""
        if self.config.confidence_threshold is None:
            return torch.zeros(rows.shape[0], dtype=torch.bool, device=rows.device)
        if self.config.stability_threshold == 0 and self.config.sampler == "entropy_bound":
            stable = torch.ones(rows.shape[0], dtype=torch.bool, device=rows.device)
        else:
            history = self.history[:, rows]
            stable = (history == argmax[None]).all(dim=-1).all(dim=0)
            self.history[:, rows] = torch.cat([history[1:], argmax[None]])
        count = undecided.sum(dim=-1)
        masked_mean = (entropy * undecided).sum(dim=-1) / count.clamp_min(1)
        mean = torch.where(undecided.all(dim=-1), entropy.mean(dim=-1), masked_mean)  # their mean over the canvas
        return stable & (mean < self.config.confidence_threshold) & (count > 0)


SCHEDULERS["gemma"] = DiffusionGemmaRule
