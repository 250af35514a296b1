"""Speculative verification and coupling over a batch of draft windows (PyTorch reference).

Layout: ``B`` samples, each with a window of ``W`` draft slots padded to the same width;
``num_drafts[b] <= W`` says how many slots of sample ``b`` are real. Slot ``j`` holds draft token
``d_j`` with draft distribution ``q_j`` (dense, or one-hot on ``d_j`` for initialised drafts where
``draft_onehot[b, j]``) and is verified against the target ``p_j``.

For every real slot (speculative sampling, Leviathan et al. 2023 / Chen et al. 2023; the same
operation is the maximal coupling of ``q_j`` and ``p_j``, MC-SJD arXiv 2510.24211 §3):

* accept ``d_j`` iff ``u_j * q_j(d_j) < p_j(d_j)``, i.e. with probability ``min(1, p/q)``;
* otherwise output a sample from the residual ``r_j ∝ max(0, p_j - q_j)`` (for a one-hot ``q_j``:
  ``p_j`` with ``d_j`` removed);
* the coupled output ``x_j`` (``d_j`` or the residual sample) is distributed exactly as ``p_j``, and
  ``P[x_j = d_j] = Σ_v min(p_j(v), q_j(v)) = 1 - TV(p_j, q_j)``.

``num_accepted[b]`` is the index of the first rejected slot (``num_drafts[b]`` if none): SJD commits
``x_1..x_{m+1}``; MC-SJD additionally keeps every later ``x_j`` as the next draft.

Sampling from unnormalised weights ``w`` uses the exponential race
``argmax_v w_v / E_v`` with ``E_v ~ Exp(1)`` i.i.d. (equivalently Gumbel-max on ``log w``):
``P[v] = w_v / Σ w``, no normalisation and no softmax row are needed, and the noise is an explicit
input so a kernel can reproduce the choice exactly.

:func:`verify_drafts` (all slots), :func:`accept_drafts` with :func:`residual_sample` (acceptance
first, residual only where needed) and :func:`sample_from_weights` take **probability** tensors
and always run in PyTorch: they are the specification the exactness tests enumerate against and
the building blocks of the reference backend of :class:`vispec.kernels.target.Target`. Decoders
verify through :class:`~vispec.kernels.target.Target`, which starts from logits and dispatches to
the Triton kernels (:mod:`vispec.kernels.verify_triton`) on CUDA.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor


@dataclass
class VerifyResult:
    """Outputs of :func:`verify_drafts` (shapes ``[B, W]`` unless noted)."""

    accepted: Tensor  # bool: slot j accepted its draft (False on padding slots)
    coupled: Tensor  # long: x_j = d_j if accepted else the residual sample (-1 on padding slots)
    num_accepted: Tensor  # long [B]: index of the first rejection (= number of accepted leading drafts)


def race_argmax(weights: Tensor, exponentials: Tensor) -> Tensor:
    """Exponential race: ``argmax_v weights_v / E_v`` over the last dimension.

    Entries with zero weight never win (they score 0 while any positive weight scores > 0).
    A row of all-zero weights returns index 0; callers only use rows with positive mass.
    """
    return (weights / exponentials).argmax(dim=-1)


def sample_from_weights_reference(weights: Tensor, exponentials: Tensor) -> Tensor:
    """Reference categorical sampling ``[..., V] -> [...]`` from unnormalised weights."""
    if weights.shape != exponentials.shape:
        raise ValueError(f"exponentials must have shape {tuple(weights.shape)}, got {tuple(exponentials.shape)}")
    return race_argmax(weights.to(torch.float32) if weights.dtype != torch.float64 else weights, exponentials)


def residual_weights(p: Tensor, q: Tensor) -> Tensor:
    """Unnormalised residual ``max(0, p - q)`` (same shape as ``p``)."""
    return (p - q).clamp_min(0.0)


def draft_distribution(
    draft_tokens: Tensor, draft_probs: Optional[Tensor], draft_onehot: Tensor, vocab_size: int, dtype: torch.dtype
) -> Tensor:
    """Dense ``q`` of shape ``[B, W, V]``: stored rows, replaced by one-hot rows where ``draft_onehot``."""
    onehot = torch.nn.functional.one_hot(draft_tokens.clamp_min(0), vocab_size).to(dtype)
    if draft_probs is None:
        return onehot
    return torch.where(draft_onehot[..., None], onehot, draft_probs.to(dtype))


def accept_drafts_reference(
    target_probs: Tensor,
    draft_tokens: Tensor,
    draft_probs: Optional[Tensor],
    draft_onehot: Tensor,
    num_drafts: Tensor,
    accept_uniforms: Tensor,
) -> tuple[Tensor, Tensor]:
    """Acceptance flags ``[B, W]`` (``u * q(d) < p(d)``, False on padding) and ``num_accepted [B]``.

    Only ``p`` and ``q`` at the draft token are read; no residual is formed.
    """
    width = target_probs.shape[1]
    real = torch.arange(width, device=draft_tokens.device)[None, :] < num_drafts[:, None]
    tokens = torch.where(real, draft_tokens, torch.zeros_like(draft_tokens))[..., None]
    p_at = target_probs.gather(-1, tokens).squeeze(-1)
    if draft_probs is None:
        q_at = torch.ones_like(p_at)
    else:
        q_at = torch.where(draft_onehot, torch.ones_like(p_at), draft_probs.gather(-1, tokens).squeeze(-1).to(p_at.dtype))
    accepted = (accept_uniforms.to(p_at.dtype) * q_at < p_at) & real
    return accepted, torch.cumprod(accepted.to(torch.int64), dim=1).sum(dim=1)


def residual_sample_reference(
    target_probs: Tensor, draft_tokens: Tensor, draft_probs: Optional[Tensor], draft_onehot: Tensor, exponentials: Tensor
) -> Tensor:
    """A sample from ``max(0, p - q)`` for each row (any leading shape ``[...]``, vocabulary last)."""
    vocab = target_probs.shape[-1]
    q = draft_distribution(draft_tokens, draft_probs, draft_onehot, vocab, target_probs.dtype)
    return sample_from_weights_reference(residual_weights(target_probs, q), exponentials)


def verify_drafts_reference(
    target_probs: Tensor,
    draft_tokens: Tensor,
    draft_probs: Optional[Tensor],
    draft_onehot: Tensor,
    num_drafts: Tensor,
    accept_uniforms: Tensor,
    residual_exponentials: Tensor,
) -> VerifyResult:
    """Verify every slot of every window at once (module docstring).

    Args:
        target_probs: ``[B, W, V]`` processed target ``p_j`` for each slot.
        draft_tokens: ``[B, W]`` long draft tokens (any value on padding slots).
        draft_probs: ``[B, W, V]`` stored draft distributions, or ``None`` if all drafts are one-hot.
        draft_onehot: ``[B, W]`` bool, True where ``q_j`` is one-hot on ``d_j``.
        num_drafts: ``[B]`` long, real slots per sample (``0 <= num_drafts <= W``).
        accept_uniforms: ``[B, W]`` uniforms in (0, 1).
        residual_exponentials: ``[B, W, V]`` i.i.d. Exp(1) noise for the residual race.
    """
    width = target_probs.shape[1]
    real = torch.arange(width, device=draft_tokens.device)[None, :] < num_drafts[:, None]
    tokens = torch.where(real, draft_tokens, torch.zeros_like(draft_tokens))
    accepted, num_accepted = accept_drafts_reference(target_probs, tokens, draft_probs, draft_onehot, num_drafts, accept_uniforms)
    residual = residual_sample_reference(target_probs, tokens, draft_probs, draft_onehot, residual_exponentials)
    coupled = torch.where(accepted, tokens, residual)
    coupled = torch.where(real, coupled, torch.full_like(coupled, -1))
    return VerifyResult(accepted=accepted, coupled=coupled, num_accepted=num_accepted)


def _check_verify_inputs(
    target_probs: Tensor,
    draft_tokens: Tensor,
    draft_probs: Optional[Tensor],
    draft_onehot: Tensor,
    num_drafts: Tensor,
    accept_uniforms: Tensor,
    residual_exponentials: Tensor,
) -> None:
    if target_probs.dim() != 3:
        raise ValueError(f"target_probs must be [batch, window, vocab], got {tuple(target_probs.shape)}")
    bw = tuple(target_probs.shape[:2])
    for name, tensor in (("draft_tokens", draft_tokens), ("draft_onehot", draft_onehot), ("accept_uniforms", accept_uniforms)):
        if tuple(tensor.shape) != bw:
            raise ValueError(f"{name} must have shape {bw}, got {tuple(tensor.shape)}")
    if draft_probs is not None and draft_probs.shape != target_probs.shape:
        raise ValueError(f"draft_probs must have shape {tuple(target_probs.shape)}, got {tuple(draft_probs.shape)}")
    if residual_exponentials.shape != target_probs.shape:
        raise ValueError(
            f"residual_exponentials must have shape {tuple(target_probs.shape)}, got {tuple(residual_exponentials.shape)}"
        )
    if tuple(num_drafts.shape) != bw[:1]:
        raise ValueError(f"num_drafts must have shape {bw[:1]}, got {tuple(num_drafts.shape)}")
    if draft_probs is None and not bool(draft_onehot.all()):
        raise ValueError("draft_probs is None but some draft_onehot entries are False (dense drafts need their q rows)")


def verify_drafts(
    target_probs: Tensor,
    draft_tokens: Tensor,
    draft_probs: Optional[Tensor],
    draft_onehot: Tensor,
    num_drafts: Tensor,
    accept_uniforms: Tensor,
    residual_exponentials: Tensor,
    *,
    check_inputs: bool = True,
) -> VerifyResult:
    """Dispatch for batched speculative verification (see :func:`verify_drafts_reference`)."""
    if check_inputs:
        _check_verify_inputs(
            target_probs, draft_tokens, draft_probs, draft_onehot, num_drafts, accept_uniforms, residual_exponentials
        )
    return verify_drafts_reference(
        target_probs, draft_tokens, draft_probs, draft_onehot, num_drafts, accept_uniforms, residual_exponentials
    )


def accept_drafts(
    target_probs: Tensor,
    draft_tokens: Tensor,
    draft_probs: Optional[Tensor],
    draft_onehot: Tensor,
    num_drafts: Tensor,
    accept_uniforms: Tensor,
) -> tuple[Tensor, Tensor]:
    """Dispatch for the acceptance test alone (SJD: the residual is needed at one slot only)."""
    return accept_drafts_reference(target_probs, draft_tokens, draft_probs, draft_onehot, num_drafts, accept_uniforms)


def residual_sample(
    target_probs: Tensor, draft_tokens: Tensor, draft_probs: Optional[Tensor], draft_onehot: Tensor, exponentials: Tensor
) -> Tensor:
    """Dispatch for sampling the residual ``max(0, p - q)`` row by row."""
    return residual_sample_reference(target_probs, draft_tokens, draft_probs, draft_onehot, exponentials)


def sample_from_weights(weights: Tensor, exponentials: Tensor) -> Tensor:
    """Dispatch for categorical sampling from unnormalised weights by exponential race."""
    return sample_from_weights_reference(weights, exponentials)
