"""Unmasking statistics for masked diffusion LMs (PyTorch reference and dispatch).

For each row ``r`` (one still-masked position) with logits ``ℓ_r ∈ R^V``, one pass over the
vocabulary gives:

* the candidate ``x̂_r``: ``argmax_v ℓ_rv`` at temperature 0, otherwise LLaDA's float64 Gumbel-max
  ``argmax_v exp(ℓ_rv) / (-log u_rv)^T`` (ML-GSAI/LLaDA ``add_gumbel_noise``), evaluated in log space
  as ``argmax_v ℓ_rv - T log(-log u_rv)`` (the same arg-max, no overflow), i.e. a sample from
  ``softmax(ℓ_r / T)``;
* its confidence ``c_r = softmax(ℓ_r)[x̂_r]`` **without** temperature, as LLaDA and Fast-dLLM
  define it, here in float64. (LLaDA's ``generate()`` computes it in the logits' own precision, where
  near-certain positions round to exactly 1.0 and tie; :class:`vispec.dllm.LLaDAScheduler` re-ranks
  in that precision, the other policies use these float64 values);
* the top-2 margin ``p_(1) - p_(2)`` and the entropy ``H_r = -Σ_v p_v log p_v`` of
  ``p = softmax(ℓ_r)`` (EB-Sampler's error proxy, arXiv 2505.24857).

Two optional token masks reproduce LLaDA's EOS options: ``proposal_mask`` (tokens set to ``-inf``
before the proposal: ``logits_eos_inf``, and the mask token itself) and ``confidence_mask``
(tokens set to ``-inf`` only in the confidence: ``confidence_eos_eot_inf`` with its intended
semantics, so a position proposing EOS gets confidence 0 and ranks last).

Randomness is an explicit input: injected ``uniforms``, or the counter-based keys of
:class:`RowNoise` (``uniforms64(seeds, positions[:, None], Stream.UNMASK, draws, V)[:, 0]``, which
the Triton kernel generates in place, tile by tile), so the kernel and the reference given the same
numbers return the same candidates. :func:`unmask_candidates` is the dispatch point: ``backend``
``"auto"`` runs the Triton kernel (:mod:`vispec.kernels.unmask_triton`) on CUDA tensors when
triton is installed and the reference otherwise (:func:`vispec.kernels.backend.resolve_backend`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch
from torch import Tensor

from vispec.checks import check_number
from vispec.kernels.backend import resolve_backend
from vispec.kernels.philox import Stream, uniforms64


@dataclass
class UnmaskCandidates:
    """Per-row candidate and statistics (all ``[R]``)."""

    tokens: Tensor  # long: proposed token x̂
    confidence: Tensor  # float64: softmax(ℓ)[x̂] (confidence-masked tokens get 0)
    margin: Tensor  # float64: top-1 minus top-2 probability of softmax(ℓ)
    entropy: Tensor  # float64: entropy of softmax(ℓ) in nats


class RowNoise(NamedTuple):
    """Philox keys of the candidate noise, one per row (all ``[R]`` integer tensors).

    Row ``r`` uses the float64 uniforms ``uniforms64(seeds[r], positions[r], Stream.UNMASK, draws[r], V)``
    (:func:`vispec.kernels.philox.uniforms64`): ``seeds`` is the sample's 64-bit seed, ``positions``
    the absolute position of the masked token, ``draws`` the sample's forward-pass count.
    """

    seeds: Tensor
    positions: Tensor
    draws: Tensor


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


def _check_index_tensor(name: str, value: object, n_rows: int, device: torch.device) -> Tensor:
    if not isinstance(value, Tensor):
        raise ValueError(f"{name} must be a tensor, got {type(value).__name__}")
    if value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool:
        raise ValueError(f"{name} must be an integer tensor, got {value.dtype}")
    if value.shape != (n_rows,):
        raise ValueError(f"{name} must have shape ({n_rows},) (one entry per row), got {tuple(value.shape)}")
    if value.device != device:
        raise ValueError(f"{name} must be on {device} like logits, got {value.device}")
    return value


def _check_token_mask(name: str, value: Optional[Tensor], vocab: int, device: torch.device) -> None:
    if value is None:
        return
    if not isinstance(value, Tensor) or value.dtype != torch.bool or value.shape != (vocab,):
        shape = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
        raise ValueError(f"{name} must be a bool tensor of shape ({vocab},), got {shape}"
                         + (f" {value.dtype}" if isinstance(value, Tensor) else ""))
    if value.device != device:
        raise ValueError(f"{name} must be on {device} like logits, got {value.device}")


def unmask_candidates(
    logits: Tensor,
    temperature: float = 0.0,
    uniforms: Optional[Tensor] = None,
    proposal_mask: Optional[Tensor] = None,
    confidence_mask: Optional[Tensor] = None,
    *,
    noise: Optional[RowNoise] = None,
    rows: Optional[Tensor] = None,
    backend: str = "auto",
    validate: bool = True,
) -> UnmaskCandidates:
    """Candidates, confidence, margin and entropy for ``R`` logits rows (module docstring).

    Row ``r`` is ``logits[r]`` for ``[R, V]`` logits, or, with ``rows``, row ``rows[r]`` of
    ``logits`` viewed as ``[N, V]`` (``N`` = product of the leading dimensions, row-major). The
    Triton kernel reads those rows in place (strided views such as ``logits[:, start:end]`` are not
    copied); the reference gathers them.

    Args:
        logits: ``[R, V]`` logits (``[..., V]`` with ``rows``), float16 / bfloat16 / float32 / float64.
        temperature: ``0`` for arg-max; ``> 0`` needs ``uniforms`` or ``noise``.
        uniforms: ``[R, V]`` float64 uniforms in (0, 1) (:func:`vispec.kernels.philox.uniforms64`).
        proposal_mask: ``[V]`` bool, tokens that are never proposed.
        confidence_mask: ``[V]`` bool, tokens whose logits are ``-inf`` in the confidence softmax.
        noise: :class:`RowNoise` Philox keys (``[R]`` each) instead of ``uniforms``: row ``r`` uses
            ``uniforms64(seeds, positions[:, None], Stream.UNMASK, draws, V)[r, 0]``, generated inside the
            Triton kernel (nothing of size ``[R, V]`` is stored).
        rows: ``[R]`` integer indices into ``logits`` viewed as ``[N, V]``; default all rows of ``[R, V]`` logits.
        backend: ``"auto"``, ``"triton"`` or ``"reference"`` (:func:`vispec.kernels.backend.resolve_backend`).
        validate: check that ``rows`` lie inside ``logits``, which reads a value back from the device (a host
            synchronisation). Callers that build ``rows`` themselves (e.g. from ``nonzero`` of a mask over
            ``logits``' leading dimensions) pass ``False``: the call then reads nothing back, and the kernel does
            not bounds-check the rows (out-of-range rows are undefined behaviour, as out-of-range indices are).
            Shapes, dtypes and devices are always checked (they are known on the host).

    Returns:
        :class:`UnmaskCandidates` with ``[R]`` tensors.
    """
    if not isinstance(logits, Tensor):
        raise ValueError(f"logits must be a tensor, got {type(logits).__name__}")
    if not logits.dtype.is_floating_point:
        raise ValueError(f"logits must be a floating-point tensor, got {logits.dtype}")
    if rows is None and logits.dim() != 2:
        raise ValueError(f"logits must be [rows, vocab], got shape {tuple(logits.shape)}")
    if rows is not None and logits.dim() < 2:
        raise ValueError(f"logits must be [..., vocab] with at least 2 dimensions when rows is given, got shape {tuple(logits.shape)}")
    vocab = logits.shape[-1]
    if vocab < 1:
        raise ValueError(f"logits must have a vocabulary of at least 1 entry, got shape {tuple(logits.shape)}")
    temperature = float(check_number("temperature", temperature, minimum=0, hint=" (0 means arg-max)"))
    if not isinstance(validate, bool):
        raise ValueError(f"validate must be True or False, got {validate!r}")
    device = logits.device
    if rows is None:
        n_rows = logits.shape[0]
    else:
        if not isinstance(rows, Tensor) or rows.dim() != 1:
            raise ValueError(f"rows must be a 1-D integer tensor, got {tuple(rows.shape) if isinstance(rows, Tensor) else type(rows).__name__}")
        n_rows = rows.shape[0]
        _check_index_tensor("rows", rows, n_rows, device)
        n_total = logits.numel() // vocab
        if validate and n_rows and bool(((rows < 0) | (rows >= n_total)).any()):
            raise ValueError(f"rows must lie in [0, {n_total}) (logits viewed as [{n_total}, {vocab}])")
    if uniforms is not None and noise is not None:
        raise ValueError("give either uniforms or noise, not both")
    if temperature > 0 and uniforms is None and noise is None:
        raise ValueError(f"temperature > 0 needs uniforms of shape {(n_rows, vocab)} or noise (RowNoise keys)")
    if uniforms is not None:
        if not isinstance(uniforms, Tensor) or uniforms.shape != (n_rows, vocab):
            shape = tuple(uniforms.shape) if isinstance(uniforms, Tensor) else type(uniforms).__name__
            raise ValueError(f"uniforms must have shape {(n_rows, vocab)}, got {shape}")
        if uniforms.dtype != torch.float64:
            raise ValueError(f"uniforms must be float64, got {uniforms.dtype}")
        if uniforms.device != device:
            raise ValueError(f"uniforms must be on {device} like logits, got {uniforms.device}")
    if noise is not None:
        if not isinstance(noise, tuple) or len(noise) != 3:
            raise ValueError(f"noise must be a RowNoise(seeds, positions, draws), got {type(noise).__name__}")
        noise = RowNoise(*(_check_index_tensor(f"noise.{name}", value, n_rows, device)
                           for name, value in zip(RowNoise._fields, noise)))
    _check_token_mask("proposal_mask", proposal_mask, vocab, device)
    _check_token_mask("confidence_mask", confidence_mask, vocab, device)
    row_index = rows if rows is None or rows.dtype == torch.int64 else rows.to(torch.int64)

    if resolve_backend(backend, logits, uniforms, proposal_mask, confidence_mask, row_index,
                       *(noise if noise is not None else ())) == "triton":
        from vispec.kernels.unmask_triton import unmask_candidates_triton

        keys = noise if noise is not None else (None, None, None)
        tokens, confidence, margin, entropy = unmask_candidates_triton(
            logits, row_index, temperature, uniforms if temperature > 0 else None, *keys,
            proposal_mask=proposal_mask, confidence_mask=confidence_mask)
        return UnmaskCandidates(tokens=tokens, confidence=confidence, margin=margin, entropy=entropy)

    row_logits = logits if row_index is None else logits[torch.unravel_index(row_index, logits.shape[:-1])]
    if temperature > 0 and uniforms is None:
        uniforms = uniforms64(noise.seeds, noise.positions[:, None], Stream.UNMASK, noise.draws, vocab)[:, 0]
    return unmask_candidates_reference(row_logits, temperature, uniforms, proposal_mask, confidence_mask)
