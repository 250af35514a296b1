"""Dream's sampler as an unmasking policy: a fixed timestep schedule, confidence from tempered probabilities.

Dream (Ye et al., "Dream 7B: Diffusion Large Language Models", arXiv 2508.15487; ``DreamLM/Dream``, the
``diffusion_generate`` / ``_sample`` loop of the HF model repo; spec ``dllm.md`` §2) decodes the whole canvas
in ``s`` steps along ``t_i = linspace(1, eps, s + 1)``. At step ``i`` (from ``t_i`` to ``t_{i+1}``) every masked
position ``j`` gets a candidate from its logits ``ℓ_j`` processed in this order:

* temperature ``ℓ ← ℓ / T`` (``T > 0``), then top-p (sort descending, drop a token when the cumulative
  probability of the tokens *before* it exceeds ``top_p``; the first is always kept), then top-k (drop the
  tokens below the ``k``-th largest), both dropping to the dtype's lowest finite value; ``q = softmax(ℓ)``;
* ``T > 0``: ``x̂_j ~ q_j`` (Gumbel-max in float64 from the row's Philox keys); ``T = 0``: ``x̂_j = argmax q_j``.
  Top-p / top-k apply at ``T = 0`` too: they change ``q`` and so the confidences below.

The commit rule depends on ``alg``; with ``r_i = 1 - t_{i+1} / t_i`` (in float32, as Dream) and ``M`` the row's
masked count at this step:

* ``origin``: each masked position is committed independently with probability ``r_i``;
* ``maskgit_plus`` (confidence ``c_j = q_j(x̂_j)``), ``topk_margin`` (``c_j = q_(1) - q_(2)``), ``entropy``
  (``c_j = Σ_v q_jv log(q_jv + 1e-10)``, the negative entropy: higher is more certain): commit
  ``n = ⌊M r_i⌋`` positions, those with the highest confidence (ties to the lowest position) or, with
  ``alg_temp > 0``, ``n`` positions drawn without replacement from ``softmax(c / alg_temp)`` over the masked
  positions (as Gumbel-top-``n``: the ``n`` largest ``c_j / alg_temp + G_j``, ``G_j`` standard Gumbel, which
  is the same distribution; Kool et al. 2019);
* the last step (``i = s - 1``) commits every remaining masked position.

Confidences and probabilities are computed in the logits' precision (float32 for vispec's models; half
precision is upcast to float32), as Dream computes them in its logits' dtype, so the ranking matches a float32
reference bit for bit.

In :func:`vispec.dllm.decode` one block over the whole canvas is Dream's schedule; with several blocks the
schedule runs per block (``steps / K`` steps each, ``M`` counted in the block), Fast-dLLM's block layout.

**Differences from Dream** (deliberate; tokens are Dream's at batch size 1):

* ``M`` is the row's own mask count. Dream averages the mask count over the batch (``mask_index.sum() / B``), so
  a row's schedule there depends on the other rows (and with unequal rows the top-``n`` can pick unmasked
  positions). vispec keeps every row independent of the batch; at batch size 1 the two are the same.
* Randomness is counter-based: per-row Philox keyed by (row seed, position in the generated canvas, stream,
  forward count) (:class:`vispec.dllm.UnmaskNoise`), so a row's tokens do not depend on the batch. Candidate
  samples use :attr:`~vispec.kernels.philox.Stream.UNMASK` (float64 Gumbel-max, the unmasking kernel);
  ``origin``'s coins and the ``alg_temp`` draws use :attr:`~vispec.kernels.philox.Stream.REMASK` (the stream of
  the "which positions to commit" draws). Dream uses ``torch.rand`` / ``Categorical`` / ``multinomial`` on the
  global generator.
* ``decode``'s token masks: ``suppress_mask_token`` (default on) removes the mask token (and padded embedding
  columns) from the distribution before the temperature, as ``logits_eos_inf`` removes EOS; Dream can
  propose the mask token. ``confidence_eos_eot_inf`` ranks positions whose candidate is EOS / EoT below every
  other masked position (their confidence becomes ``-(log V + 1)``, below any value the three measures take).
* Exact ties in confidence go to the lowest position (Dream's ``torch.topk`` replaced by a stable descending sort,
  the same on every device and torch version). Dream ranks with ``torch.topk``, whose order among equal values
  is unspecified (PyTorch documents none; on CPU it changes with the input's length), so at a tied step its
  commit set, and its tokens, can differ from vispec's; ties are common with ``top_p < 1`` at ``T = 0``, where every
  position whose top-1 probability exceeds ``top_p`` keeps one token and has confidence exactly 1.
* ``timesteps`` are computed on the CPU (Dream computes ``linspace`` on the model's device).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from diffusers.configuration_utils import register_to_config
from torch import Tensor

from vispec.checks import check_int, check_number
from vispec.dllm.schedulers import SCHEDULERS, Proposal, UnmaskingScheduler, UnmaskNoise, top_n_by
from vispec.kernels.philox import Stream, uniforms
from vispec.kernels.unmask import RowNoise, unmask_candidates

DREAM_ALGS = ("origin", "maskgit_plus", "topk_margin", "entropy")
ENTROPY_EPS = 1e-10  # Dream's neg-entropy: Σ q log(q + 1e-10)


def dream_transfer_ratios(steps: int, eps: float) -> Tensor:
    """``[steps]`` float32 ``r_i = 1 - t_{i+1} / t_i`` for ``t = linspace(1, eps, steps + 1)`` (float32, as Dream)."""
    check_int("steps", steps, minimum=1)
    check_number("eps", eps, minimum=0, maximum=1, exclusive_minimum=True)
    t = torch.linspace(1.0, float(eps), steps + 1, dtype=torch.float32)
    return 1 - t[1:] / t[:-1]


def top_p_filter(logits: Tensor, top_p: float) -> Tensor:
    """Dream's top-p on ``[R, V]`` logits: sort descending, drop token ``k`` of the order when the inclusive cumulative
    probability of token ``k - 1`` exceeds ``top_p`` (the first token is always kept); dropped tokens get the dtype's
    lowest finite value."""
    ordered, order = torch.sort(logits, dim=-1, descending=True)
    cumulative = torch.softmax(ordered, dim=-1).cumsum(dim=-1)
    drop_sorted = torch.zeros_like(cumulative, dtype=torch.bool)
    drop_sorted[..., 1:] = cumulative[..., :-1] > top_p
    drop = torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)
    return logits.masked_fill(drop, torch.finfo(logits.dtype).min)


def top_k_filter(logits: Tensor, top_k: int) -> Tensor:
    """Dream's top-k on ``[R, V]`` logits: tokens below the ``k``-th largest logit get the dtype's lowest finite value
    (``k`` is capped at ``V``; ties with the ``k``-th are kept)."""
    kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, torch.finfo(logits.dtype).min)


def dream_candidates(logits: Tensor, temperature: float, alg: str, *, top_p: Optional[float] = None,
                     top_k: Optional[int] = None, proposal_mask: Optional[Tensor] = None,
                     noise: Optional[RowNoise] = None) -> tuple[Tensor, Tensor]:
    """``(tokens [R], confidence [R] float64)`` for ``[R, V]`` logits of masked positions (module docstring).

    ``q = softmax(topk(topp(ℓ / T)))`` in the logits' precision (half precision upcast to float32);
    ``proposal_mask [V]`` (bool) removes tokens from ``q`` before the temperature. ``T > 0`` samples
    ``x̂ ~ q`` with the float64 Gumbel-max of :func:`vispec.kernels.unmask.unmask_candidates` keyed by ``noise``;
    ``T = 0`` takes ``argmax q``. The confidence is ``q(x̂)`` (``origin``, ``maskgit_plus``), ``q_(1) - q_(2)``
    (``topk_margin``) or ``Σ q log(q + 1e-10)`` (``entropy``).
    """
    if alg not in DREAM_ALGS:
        raise ValueError(f"alg must be one of {DREAM_ALGS}, got {alg!r}")
    x = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    if proposal_mask is not None:
        x = x.masked_fill(proposal_mask, float("-inf"))
    if temperature > 0:
        x = x / temperature
    if top_p is not None and top_p < 1:
        x = top_p_filter(x, top_p)
    if top_k:
        x = top_k_filter(x, top_k)
    q = torch.softmax(x, dim=-1)
    if temperature > 0:
        if noise is None:
            raise ValueError("temperature > 0 needs noise (RowNoise keys) to sample the candidates")
        # a sample from softmax(x) = q: argmax_v x_v + Gumbel_v in float64, from the rows' Philox keys
        tokens = unmask_candidates(x, 1.0, noise=noise).tokens
        prob = q.gather(-1, tokens[:, None]).squeeze(-1)
    else:
        prob, tokens = q.max(dim=-1)
    if alg == "topk_margin":
        top = q.topk(min(2, q.shape[-1]), dim=-1).values
        confidence = top[:, 0] - top[:, 1] if top.shape[-1] > 1 else top[:, 0]
    elif alg == "entropy":
        confidence = (q * torch.log(q + ENTROPY_EPS)).sum(dim=-1)
    else:
        confidence = prob
    return tokens, confidence.to(torch.float64)


class DreamScheduler(UnmaskingScheduler):
    """Dream's ``_sample`` rule (module docstring) as a fixed-step policy, strategy ``"dream"``.

    Args:
        alg: ``"origin"``, ``"maskgit_plus"``, ``"topk_margin"`` or ``"entropy"`` (the default: the setting of
            Dream's README example and of Fast-dLLM's Dream baseline; Dream's own generation-config default is
            ``"origin"``).
        alg_temp: ``None`` or ``0`` commits the ``n`` most confident positions; ``> 0`` draws them from
            ``softmax(confidence / alg_temp)`` (not with ``"origin"``, which has no confidence ranking).
        eps: the last timestep ``t_s`` in ``(0, 1]`` (Dream: ``1e-3``).
        top_p: ``None`` or ``1`` disables; otherwise in ``(0, 1)``.
        top_k: ``None`` or ``0`` disables; otherwise the number of tokens kept.

    The temperature is :func:`vispec.dllm.decode`'s ``temperature``; ``steps`` (total over blocks) is required.
    Only the candidates (:meth:`propose`) and the commit set (:meth:`select`) are Dream's; :meth:`step` is the base
    class's. ``noise`` is needed for ``temperature > 0``, ``alg="origin"`` and ``alg_temp > 0``.
    """

    strategy = "dream"
    fixed_steps = True

    @register_to_config
    def __init__(self, alg: str = "entropy", alg_temp: Optional[float] = None, eps: float = 1e-3,
                 top_p: Optional[float] = None, top_k: Optional[int] = None):
        super().__init__()
        if not isinstance(alg, str) or alg not in DREAM_ALGS:
            raise ValueError(f"alg must be one of {DREAM_ALGS}, got {alg!r}")
        if alg_temp is not None:
            check_number("alg_temp", alg_temp, minimum=0, hint=" (None or 0 commits the most confident positions)")
            if alg == "origin" and alg_temp > 0:
                raise ValueError(f"alg_temp={alg_temp} needs a confidence ranking; alg='origin' commits each masked "
                                 "position independently (use None)")
        check_number("eps", eps, minimum=0, maximum=1, exclusive_minimum=True, hint=" (Dream's default is 1e-3)")
        if top_p is not None:
            check_number("top_p", top_p, minimum=0, maximum=1, exclusive_minimum=True, hint=" (None or 1 disables top-p)")
        if top_k is not None:
            check_int("top_k", top_k, minimum=0, hint=" (None or 0 disables top-k)")
        self.uses_remask_noise = alg == "origin" or bool(alg_temp)
        self.transfer_ratios: Optional[Tensor] = None

    def set_timesteps(self, num_inference_steps: Optional[int], gen_length: int, block_length: int,
                      device: "torch.device | str | None" = None) -> None:
        """The base split (``steps / K`` steps per block) and the per-step ratios ``r_i`` of one block."""
        super().set_timesteps(num_inference_steps, gen_length, block_length, device)
        self.transfer_ratios = dream_transfer_ratios(self.steps_per_block, self.config.eps)

    def num_transfer(self, num_masked: Tensor, timestep: int) -> Tensor:
        """``[B]`` positions committed at ``timestep`` (not ``origin``): ``⌊M r_i⌋`` in float32, all on the last step."""
        if self.transfer_ratios is None:
            raise ValueError("call set_timesteps(steps, gen_length, block_length) before step")
        if isinstance(timestep, Tensor):  # per-row steps (self-speculative decoding's lanes)
            ratio = self.transfer_ratios.to(num_masked.device)[timestep]
            count = (num_masked.to(torch.float32) * ratio).floor().long()
            return torch.where(timestep == self.steps_per_block - 1, num_masked.long(), count)
        if timestep == self.steps_per_block - 1:
            return num_masked.long()
        ratio = self.transfer_ratios[timestep].to(num_masked.device)
        return (num_masked.to(torch.float32) * ratio).floor().long()

    def propose(self, model_output: Tensor, masked: Tensor, *, temperature: float, noise: Optional[UnmaskNoise],
                proposal_mask: Optional[Tensor], confidence_mask: Optional[Tensor]) -> Proposal:
        """Dream's candidates and confidences for the ``masked`` positions (module docstring,
        :func:`dream_candidates`); with ``confidence_mask``, EOS / EoT proposals rank below every other position."""
        config = self.config
        b, j = masked.nonzero(as_tuple=True)
        row_noise = None
        if temperature > 0:
            row_noise = RowNoise(noise.seeds[b], noise.positions[b, j], noise.draws[b])
        cand_tokens, cand_conf = dream_candidates(model_output[b, j], float(temperature), config.alg, top_p=config.top_p,
                                                  top_k=config.top_k, proposal_mask=proposal_mask, noise=row_noise)
        if confidence_mask is not None:  # EOS / EoT proposals rank below every other masked position
            floor = torch.full_like(cand_conf, -(math.log(model_output.shape[-1]) + 1.0))
            cand_conf = torch.where(confidence_mask[cand_tokens], floor, cand_conf)
        tokens = torch.full(masked.shape, -1, dtype=torch.long, device=masked.device)
        tokens[b, j] = cand_tokens
        confidence = torch.full(masked.shape, float("-inf"), dtype=torch.float64, device=masked.device)
        confidence[b, j] = cand_conf
        return Proposal(tokens, confidence)

    def select(self, confidence: Tensor, entropy: Optional[Tensor], masked: Tensor, timestep: int,
               num_masked_at_block_start: Optional[Tensor], noise: Optional[UnmaskNoise]) -> Tensor:
        """``[B, Lb]`` bool commit set: all masks on the last step, coins (``origin``) or the top-``n`` (or
        Gumbel-top-``n``) of the row's own mask count at this step (``num_masked_at_block_start`` is not used)."""
        if isinstance(timestep, Tensor):  # per-row steps: the rule below row by row, batched
            last = (timestep == self.steps_per_block - 1)[:, None]
            return torch.where(last, masked, self._select_before_last(confidence, masked, timestep, noise))
        if timestep == self.steps_per_block - 1:
            return masked
        return self._select_before_last(confidence, masked, timestep, noise)

    def _select_before_last(self, confidence: Tensor, masked: Tensor, timestep: "int | Tensor",
                            noise: Optional[UnmaskNoise]) -> Tensor:
        """The commit set of a step before the block's last (``timestep`` an int or ``[B]`` per row)."""
        if self.config.alg == "origin":
            coins = uniforms(noise.seeds, noise.positions, Stream.REMASK, noise.draws)  # float32 in (0, 1)
            ratio = self.transfer_ratios.to(coins.device)[timestep]
            return masked & (coins < (ratio[:, None] if isinstance(timestep, Tensor) else ratio))
        score = confidence
        if self.config.alg_temp:
            coins = uniforms(noise.seeds, noise.positions, Stream.REMASK, noise.draws).to(torch.float64)
            keys = (confidence / self.config.alg_temp - torch.log(-torch.log(coins))).clamp(min=-torch.finfo(torch.float64).max)
            score = torch.where(masked, keys, torch.full_like(keys, float("-inf")))
        return top_n_by(score, self.num_transfer(masked.sum(dim=-1), timestep)) & masked


SCHEDULERS["dream"] = DreamScheduler
