"""Unmasking statistics for masked diffusion LMs (PyTorch reference and dispatch).

For each row ``r`` (one still-masked position) with logits ``ℓ_r ∈ R^V``, one pass over the
vocabulary gives:

* the candidate ``x̂_r``: ``argmax_v ℓ_rv`` at temperature 0, otherwise LLaDA's float64 Gumbel-max
  ``argmax_v exp(ℓ_rv) / (-log u_rv)^T`` (ML-GSAI/LLaDA ``add_gumbel_noise``), evaluated in log space
  as ``argmax_v ℓ_rv - T log(-log u_rv)`` (the same arg-max, no overflow), i.e. a sample from
  ``softmax(ℓ_r / T)``;
* its confidence ``c_r = softmax(ℓ_r)[x̂_r]`` **without** temperature, as LLaDA and Fast-dLLM
  compute it (float64);
* the top-2 margin ``p_(1) - p_(2)`` and the entropy ``H_r = -Σ_v p_v log p_v`` of
  ``p = softmax(ℓ_r)`` (EB-Sampler's error proxy, arXiv 2505.24857).

Two optional token masks reproduce LLaDA's EOS options: ``proposal_mask`` (tokens set to ``-inf``
before the proposal: ``logits_eos_inf``, and the mask token itself) and ``confidence_mask``
(tokens set to ``-inf`` only in the confidence: ``confidence_eos_eot_inf`` with its intended
semantics, so a position proposing EOS gets confidence 0 and ranks last).

Randomness is an explicit input (``uniforms``), so a device kernel given the same numbers returns
the same candidates. :func:`unmask_candidates` is the dispatch point.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor


@dataclass
class UnmaskCandidates:
    """Per-row candidate and statistics (all ``[R]``)."""

    tokens: Tensor  # long: proposed token x̂
    confidence: Tensor  # float64: softmax(ℓ)[x̂] (confidence-masked tokens get 0)
    margin: Tensor  # float64: top-1 minus top-2 probability of softmax(ℓ)
    entropy: Tensor  # float64: entropy of softmax(ℓ) in nats


def unmask_candidates_reference(
    logits: Tensor,
    temperature: float = 0.0,
    uniforms: Optional[Tensor] = None,
    proposal_mask: Optional[Tensor] = None,
    confidence_mask: Optional[Tensor] = None,
) -> UnmaskCandidates:
    """Reference for :func:`unmask_candidates` (module docstring)."""
    logits64 = logits.to(torch.float64)
    proposal = logits64 if proposal_mask is None else logits64.masked_fill(proposal_mask, float("-inf"))
    if temperature > 0:
        proposal = proposal - temperature * torch.log(-torch.log(uniforms))
    tokens = proposal.argmax(dim=-1)
    probs = torch.softmax(logits64, dim=-1)
    log_probs = torch.log_softmax(logits64, dim=-1)
    entropy = -(probs * log_probs).nan_to_num(0.0).sum(dim=-1)
    top2 = probs.topk(min(2, probs.shape[-1]), dim=-1).values
    margin = top2[:, 0] - (top2[:, 1] if top2.shape[-1] > 1 else 0.0)
    conf_probs = probs if confidence_mask is None else torch.softmax(logits64.masked_fill(confidence_mask, float("-inf")), dim=-1)
    confidence = conf_probs.gather(-1, tokens[:, None]).squeeze(-1)
    return UnmaskCandidates(tokens=tokens, confidence=confidence, margin=margin, entropy=entropy)


def unmask_candidates(
    logits: Tensor,
    temperature: float = 0.0,
    uniforms: Optional[Tensor] = None,
    proposal_mask: Optional[Tensor] = None,
    confidence_mask: Optional[Tensor] = None,
) -> UnmaskCandidates:
    """Candidates, confidence, margin and entropy for logits rows ``[R, V]`` (module docstring).

    Args:
        logits: ``[R, V]`` logits of the masked positions (any float dtype).
        temperature: ``0`` for arg-max; ``> 0`` needs ``uniforms``.
        uniforms: ``[R, V]`` float64 uniforms in (0, 1) (:func:`vispec.kernels.philox.uniforms64`).
        proposal_mask: ``[V]`` bool, tokens that are never proposed.
        confidence_mask: ``[V]`` bool, tokens whose logits are ``-inf`` in the confidence softmax.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [rows, vocab], got shape {tuple(logits.shape)}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if temperature > 0 and (uniforms is None or uniforms.shape != logits.shape):
        raise ValueError(f"temperature > 0 needs uniforms of shape {tuple(logits.shape)}")
    return unmask_candidates_reference(logits, temperature, uniforms, proposal_mask, confidence_mask)
