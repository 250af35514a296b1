r"""Exact verification of several sibling candidates at one position: recursive rejection sampling (RRS).

The PyTorch reference (the specification) of multi-candidate verification, as a tree drafter such as
SJD-PAC needs it: at one node, ``K`` sibling candidates ``x_1 .. x_K`` are proposed for the same position
and at most one of them is kept, so that the token that comes out is distributed exactly as the target
``p``. :mod:`vispec.decoding.pac` (SJD-PAC) verifies its tree nodes with it.

Like the other kernel families this is a triad: this module is the contract and the PyTorch reference
(:func:`rrs_reference`, :func:`without_replacement`, :func:`rrs_noise`: the specification),
:mod:`vispec.kernels.multi_verify_triton` the Triton kernel (one program per row, noise generated in the kernel,
``q_i`` recomputed tile by tile: nothing of size ``[R, K, V]`` is stored), and :func:`rrs` the dispatch point
(:func:`vispec.kernels.backend.resolve_backend`: CUDA tensors run the kernel, everything else the reference).
Given the same keys both return the same ``(accepted_rank, token)`` bit for bit, for candidates drawn without
replacement from one row ``q`` and for one-hot candidates; the one exception is the last bit of the float32
``log`` in the race's exponentials (section "Noise").

The recursion
-------------

Let ``r_0 = p``. For ``i = 1 .. K``, candidate ``x_i`` comes with the distribution ``q_i`` it was drawn
from, and with ``\bar r = r / Σ r`` (the normalised residual):

* accept ``x_i`` with probability ``min(1, \bar r_{i-1}(x_i) / q_i(x_i))``, and stop;
* otherwise ``r_i = max(0, \bar r_{i-1} - q_i)`` (up to a positive factor), and go on.

If every candidate is rejected the token is a sample from ``\bar r_K``. Each stage is one ordinary
speculative step (Leviathan et al. 2023; Chen et al. 2023) of the target ``\bar r_{i-1}`` against the
draft ``q_i``: given what happened before, it rejects with probability ``β_i = Σ_v max(0, \bar r_{i-1}(v) -
q_i(v)) = TV(\bar r_{i-1}, q_i)``. Every candidate is rejected with probability ``E[β_1 ⋯ β_K]`` along the
path of rejections (``β_1 ⋯ β_K`` itself when the ``q_i`` do not depend on the earlier candidates).

Where the ``q_i`` come from:

* **without replacement** from one draft ``q`` (SJD-PAC's siblings; recursive speculative decoding):
  ``q_i`` is ``q`` with ``x_1 .. x_{i-1}`` removed and renormalised (:func:`without_replacement`). A
  sequential draw without replacement is what the Gumbel-top-k trick gives (the ``K`` largest of
  ``q(v) / E_v``, ``E_v ~ Exp(1)``, in decreasing order; Kool et al. 2019);
* **explicit rows** ``q_i``, one per rank: any proposals, e.g. ``K`` i.i.d. draws from one ``q``
  (``q_i = q``) or candidates from ``K`` different drafters;
* **one-hot** (``q=None``): candidates without a distribution (initialised drafts, tokens taken from a
  previous iteration); ``q_i`` is one-hot on ``x_i``, the acceptance probability is ``min(1, \bar r(x_i))``
  and a rejection removes ``x_i`` from the residual.

Exactness (induction on the number of stages left)
--------------------------------------------------

Write ``H_i`` for the history after stage ``i`` (candidates ``x_1 .. x_i`` and the verdicts so far). The one
requirement is that, given ``H_{i-1}``, candidate ``x_i`` is distributed as ``q_i`` (which may depend on
``H_{i-1}``) and independent of the acceptance uniform ``u_i``: the candidates are drafted with their own
noise before verification, and the number of candidates of a row is fixed before verification too.

Claim: given ``H_{i-1}``, the token that stages ``i .. K`` return is distributed as ``\bar r_{i-1}``.

* No stage left (``i = K + 1``): the token is the residual sample from ``\bar r_K``. Exact.
* Stage ``i``, assuming the claim for ``i + 1``. The stage returns ``x_i = v`` with probability
  ``q_i(v) min(1, \bar r_{i-1}(v) / q_i(v)) = min(q_i(v), \bar r_{i-1}(v))``. It rejects with probability
  ``β_i = 1 - Σ_v min(q_i(v), \bar r_{i-1}(v))``; then ``\bar r_i = max(0, \bar r_{i-1} - q_i) / β_i``,
  a function of ``H_{i-1}`` alone (not of ``x_i`` or ``u_i``), and, since the verdict of stage ``i`` only
  involves ``x_i`` and the independent ``u_i``, ``x_{i+1}`` given ``H_i`` is still distributed as ``q_{i+1}``.
  By the hypothesis the later stages then return ``v`` with probability ``\bar r_i(v)``. Summing,
  ``min(q_i(v), \bar r_{i-1}(v)) + β_i max(0, \bar r_{i-1}(v) - q_i(v)) / β_i = \bar r_{i-1}(v)``
  (when ``β_i = 0`` the second term is absent: a rejection has probability 0).

With ``i = 1`` the output is distributed as ``\bar r_0 = p``, for every ``K``, every way of choosing the
``q_i`` from the history, and one-hot ``q_i`` alike. A rank without a candidate (``-1``; candidates of a row
are left-aligned) is not a stage: a row with ``k < K`` candidates is the recursion with ``k`` stages, and a
row with none samples ``p``. ``tests/kernels/test_multi_verify.py`` checks the claim with exact rational
arithmetic over every candidate tuple, with negative controls (a residual that is not updated after a
rejection; candidates drawn without replacement but verified against the unconditioned ``q``), and the
implementation by a chi-square test over keyed noise.

Arithmetic
----------

Everything is float64. The residual is kept **unnormalised**: ``r_0 = p`` as given (its rows need only
positive mass) and, with ``S = Σ_v r_{i-1}(v)`` recomputed at every rank,

* the test is ``u · q_i(x) · S < r_{i-1}(x)`` (that is ``u < \bar r_{i-1}(x) / q_i(x)``, the exact rule of
  :func:`vispec.kernels.verify.speculative_test` on normalised rows, without dividing);
* a rejection sets ``r_i = max(0, r_{i-1} - S · q_i) = S · max(0, \bar r_{i-1} - q_i)``.

Every sum (``S`` and the normalisers of ``q`` rows) is :func:`pairwise_sum`: the perfect binary tree over
adjacent pairs of the row zero-padded to a power of two. A float sum depends on its order; fixing the order
makes the result a function of the values alone (the same bits on CPU, on CUDA and in the Triton kernel, whose
aligned power-of-two tiles are subtrees of that tree), and pairwise summation is also the accurate one (error
growing with ``log V``). The explicit rows ``q_i`` are normalised (float64) before use. If rounding ever left a
rejected row with no residual mass (a rejection that has probability 0 in exact arithmetic), that row keeps
``r_{i-1}`` (whether any mass is left does not depend on a summation order). The residual token is the
exponential race ``argmax_v r_K(v) / E_v`` (:func:`vispec.kernels.verify.race_argmax`, float64 weights over
float32 noise promoted to float64), which needs no normalisation.

Noise
-----

:func:`rrs_noise` keys every number by (sample seed, position, stream, draw) with the existing streams:
the uniform of rank ``k`` is word ``k % 4`` of the Philox block ``c0 = k // 4`` of ``(position, ACCEPT,
draw)``, so rank 0 is bit for bit the acceptance uniform of the single-draft test at that position and draw
(:meth:`vispec.kernels.target.Target.accept_uniforms`), and a rank's number does not depend on ``K``; the
residual race uses ``(position, RESIDUAL, draw)``, the single-draft residual race's noise. ``draw`` is the
caller's pass counter (as elsewhere: a position verified again in a later pass gets fresh numbers). With
``K = 1`` the recursion is the single-draft speculative step on the same noise. A row's result depends only
on its own inputs and keys, never on the rest of the batch.

The Triton kernel draws the same numbers in the kernel: the uniforms bit for bit, the exponentials as
``-log u`` of the same float32 ``u`` with Triton's ``log`` (the single-draft residual race's noise of
:mod:`vispec.kernels.verify_triton`), which may differ from torch's in the last bit. So the kernel and the
reference can pick different residual tokens only when the two best race keys ``r(v) / E_v`` of a row agree to
about 1e-7 relative; with the same noise tensors (the launcher's injected mode) they agree in every case.

Cost: the only Python loop is over the ``K`` ranks (a handful of siblings; each rank is a few ``[R, V]``
float64 passes); rows are never looped over. The reference path of :func:`rrs` materialises the ``[R, K, V]``
float64 rows of :func:`without_replacement`; the kernel reads ``p`` and ``q`` in their own dtype, a few passes
per rank reached (``3`` with ``q``, ``2`` one-hot) plus one for the race, and stores nothing but the results.

References
----------

* Y. Leviathan, M. Kalman, Y. Matias, "Fast Inference from Transformers via Speculative Decoding", ICML 2023
  (arXiv 2211.17192); C. Chen et al., "Accelerating Large Language Model Decoding with Speculative Sampling",
  arXiv 2302.01318: the single-draft test and residual.
* Z. Sun et al., "SpecTr: Fast Speculative Decoding via Optimal Transport", NeurIPS 2023 (arXiv 2310.15141):
  verification of several candidates at one position as a coupling problem.
* W. Jeon et al., "Recursive Speculative Decoding: Accelerating LLM Inference via Sampling Without
  Replacement", 2024 (arXiv 2402.14160): recursive rejection sampling of candidates drawn without
  replacement; S. Yang et al., "Multi-Candidate Speculative Decoding", 2024: the same recursion with and
  without replacement.
* W. Kool, H. van Hoof, M. Welling, "Stochastic Beams and Where to Find Them: The Gumbel-Top-k Trick for
  Sampling Sequences Without Replacement", ICML 2019.
* Kang et al., SJD-PAC, CVPR 2026 (arXiv 2603.18599): speculative Jacobi decoding with drafted trees,
  verified by this recursion.
"""

from __future__ import annotations

from typing import Optional, Union

import torch
from torch import Tensor

from vispec.kernels import race
from vispec.kernels.backend import resolve_backend
from vispec.kernels.philox import Stream
from vispec.kernels.verify import as_long, race_argmax

__all__ = ["pairwise_sum", "rrs", "rrs_noise", "rrs_reference", "without_replacement"]


# ---- argument checks (every message starts with the argument's name) --------------------------------


def _check_floating(x: Tensor, name: str, shape: tuple[int, ...]) -> None:
    """A floating-point tensor of ``shape``, or a ``ValueError`` naming ``name``."""
    if not isinstance(x, Tensor):
        raise ValueError(f"{name} must be a tensor, got {type(x).__name__}")
    if tuple(x.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(x.shape)}")
    if not x.dtype.is_floating_point:
        raise ValueError(f"{name} must be a floating-point tensor, got {x.dtype}")


def _float_tensor(x: Tensor, name: str, shape: tuple[int, ...]) -> Tensor:
    """``x`` as float64 of ``shape``, or a ``ValueError`` naming ``name``."""
    _check_floating(x, name, shape)
    return x.to(torch.float64)


def _weights(x: Tensor, name: str, shape: tuple[int, ...], validate: bool) -> Tensor:
    """Non-negative finite float64 weights of ``shape`` (the range checked with ``validate``)."""
    x = _float_tensor(x, name, shape)
    if validate and x.numel() and not bool((torch.isfinite(x) & (x >= 0)).all()):
        raise ValueError(f"{name} must be finite and non-negative")
    return x


def _matrix_rows(x: Tensor, name: str) -> tuple[int, int]:
    if not isinstance(x, Tensor) or x.dim() != 2:
        raise ValueError(f"{name} must be a [rows, vocab] tensor, got shape {tuple(getattr(x, 'shape', ()))}")
    return int(x.shape[0]), int(x.shape[1])


def _checked_candidates(candidates: Tensor, rows: int, vocab: int, validate: bool) -> Tensor:
    """int64 ``[R, K]`` candidates in ``[-1, V)``, left-aligned (no candidate after a -1)."""
    if not isinstance(candidates, Tensor) or candidates.dim() != 2 or candidates.shape[0] != rows:
        raise ValueError(f"candidates must be [{rows}, K] (one row per row of p/q), got shape "
                         f"{tuple(getattr(candidates, 'shape', ()))}")
    candidates = as_long(candidates, "candidates", (rows, int(candidates.shape[1])))
    if validate and candidates.numel():
        if int(candidates.min()) < -1 or int(candidates.max()) >= vocab:
            raise ValueError(f"candidates must be token ids in [0, {vocab}) or -1 (no candidate), got values in "
                             f"[{int(candidates.min())}, {int(candidates.max())}]")
        present = candidates >= 0
        if bool((present[:, 1:] & ~present[:, :-1]).any()):
            raise ValueError("candidates must be left-aligned in each row: no candidate after a -1")
    return candidates


def _check_positive_at(q_rows: Tensor, candidates: Tensor) -> None:
    """Every present candidate has positive probability under its own ``q_i`` (``q_rows [R, K, V]``)."""
    present = candidates >= 0
    at = q_rows.gather(-1, candidates.clamp_min(0)[..., None]).squeeze(-1)
    bad = present & ~(at > 0)
    if bool(bad.any()):
        row, rank = (int(i) for i in bad.nonzero()[0])
        raise ValueError(f"candidates[{row}, {rank}] = {int(candidates[row, rank])} has zero probability under "
                         "its draft distribution q_i: it cannot have been drawn from it (a repeated candidate, "
                         "drawn without replacement, or a token outside the draft's support)")


def pairwise_sum(x: Tensor) -> Tensor:
    """``Σ`` over the last dimension in one fixed order: the perfect binary tree over adjacent pairs of the row
    zero-padded to a power of two (``((x0 + x1) + (x2 + x3)) + ((x4 + x5) + (x6 + 0))`` for 7 entries).

    The reference's sums (module docstring, "Arithmetic"), so that the result is a function of the values alone:
    the same bits on any device and in :mod:`vispec.kernels.multi_verify_triton`, whose tiles are subtrees of this
    tree. The padding length does not matter (a subtree of zeros adds ``+0``). ``[..., V] -> [...]``, ``V >= 1``.
    """
    if x.shape[-1] == 0:
        return x.new_zeros(x.shape[:-1])
    while x.shape[-1] > 1:
        n = x.shape[-1]
        pairs = x[..., 0:n - 1:2] + x[..., 1:n:2]
        x = torch.cat([pairs, x[..., n - 1:] + 0.0], dim=-1) if n % 2 else pairs  # the last one's sibling: zeros
    return x[..., 0] + 0.0


def _normalised(q: Tensor) -> Tensor:
    """Rows of ``q`` divided by their sums (:func:`pairwise_sum`); rows of zero mass stay zero (no NaN)."""
    mass = pairwise_sum(q)[..., None]
    return torch.where(mass > 0, q / torch.where(mass > 0, mass, torch.ones_like(mass)), torch.zeros_like(q))


# ---- the distributions of candidates drawn without replacement ---------------------------------------


def without_replacement(q: Tensor, candidates: Tensor, *, validate: bool = True) -> Tensor:
    """``[R, K, V]`` float64: ``q_i``, the law candidate ``i`` was drawn from when ``candidates`` were drawn in
    order without replacement from ``q``: ``q`` with the earlier candidates of the row zeroed, renormalised.

    Args:
        q: ``[R, V]`` draft weights (finite, non-negative; normalised here, in float64).
        candidates: ``[R, K]`` integer token ids, ``-1`` where a row has no candidate at that rank (left-aligned).
        validate: check ranges (each check reads a value back from the device).

    At a rank where nothing is left (every token of positive weight already drawn, or a row of zero mass)
    ``q_i`` is all zeros, never NaN. A rank without a candidate gets the law its candidate would have been
    drawn from (``q`` without the earlier candidates). Raises ``ValueError`` naming ``candidates`` if a
    candidate has zero probability under its ``q_i`` (a repeat, or a token outside ``q``'s support), or
    naming the argument of any other shape, dtype or range error.
    """
    rows, vocab = _matrix_rows(q, "q")
    q = _weights(q, "q", (rows, vocab), validate)
    candidates = _checked_candidates(candidates, rows, vocab, validate)
    ranks = candidates.shape[1]
    present = candidates >= 0
    drawn = torch.zeros(rows, ranks, vocab, dtype=torch.float64, device=q.device)
    drawn.scatter_(-1, candidates.clamp_min(0)[..., None], present[..., None].to(torch.float64))
    # candidates drawn before rank i: an exclusive prefix sum over the ranks
    earlier = (drawn.cumsum(1) - drawn) > 0
    out = _normalised(torch.where(earlier, torch.zeros((), dtype=torch.float64, device=q.device), q[:, None, :]))
    if validate:
        _check_positive_at(out, candidates)
    return out


# ---- the reference ----------------------------------------------------------------------------------


def rrs_reference(p: Tensor, q: Optional[Tensor], candidates: Tensor, uniforms: Tensor, exponentials: Tensor, *,
                  validate: bool = True) -> tuple[Tensor, Tensor]:
    """Recursive rejection sampling of ``K`` candidates per row against the target (module docstring).

    Args:
        p: ``[R, V]`` target weights (finite, non-negative, positive row mass; need not be normalised).
        q: ``[R, K, V]`` the distribution each candidate was drawn from (``q[r, i]`` for ``candidates[r, i]``;
            e.g. :func:`without_replacement`; normalised here), or ``None``: one-hot candidates.
        candidates: ``[R, K]`` integer token ids, ``-1`` where a row has no candidate at that rank (left-aligned).
        uniforms: ``[R, K]`` floating acceptance uniforms in ``[0, 1)``, one per rank (:func:`rrs_noise`).
        exponentials: ``[R, V]`` floating Exp(1) noise (positive) of the residual race (:func:`rrs_noise`).
        validate: check ranges (each check reads a value back from the device); shapes and dtypes are
            always checked.

    Returns:
        ``(accepted_rank [R], token [R])`` int64: the rank of the accepted candidate (``-1``: all rejected, or
        none), and the token: that candidate, else the residual sample ``argmax_v r_K(v) / E_v``.

    Rank ``i`` tests ``u_i · q_i(x_i) · S < r_{i-1}(x_i)`` with ``S = Σ r_{i-1}`` (the residual is kept
    unnormalised, float64). Raises ``ValueError`` naming the argument on a bad shape, dtype or range, and
    naming ``candidates`` when one has zero probability under its ``q_i``.
    """
    rows, vocab = _matrix_rows(p, "p")
    p = _weights(p, "p", (rows, vocab), validate)
    if validate and rows and not bool((p.sum(-1) > 0).all()):
        raise ValueError("p must have positive mass in every row")
    candidates = _checked_candidates(candidates, rows, vocab, validate)
    ranks = candidates.shape[1]
    if q is not None:
        q = _normalised(_weights(q, "q", (rows, ranks, vocab), validate))
        if validate:
            _check_positive_at(q, candidates)
    u = _float_tensor(uniforms, "uniforms", (rows, ranks))
    if validate and u.numel() and not bool(((u >= 0) & (u < 1)).all()):
        raise ValueError("uniforms must lie in [0, 1)")
    e = _float_tensor(exponentials, "exponentials", (rows, vocab))
    if validate and e.numel() and not bool((e > 0).all()):
        raise ValueError("exponentials must be positive (Exp(1) noise), with no NaN")

    r = p  # r_{i-1}, unnormalised
    accepted_rank = torch.full((rows,), -1, dtype=torch.int64, device=p.device)
    token = torch.full((rows,), -1, dtype=torch.int64, device=p.device)
    for i in range(ranks):  # K is small: a few siblings per node
        x = candidates[:, i]
        live = (x >= 0) & (accepted_rank < 0)
        at = x.clamp_min(0)[:, None]
        q_i = (torch.nn.functional.one_hot(at[:, 0], vocab).to(torch.float64) if q is None else q[:, i])
        mass = pairwise_sum(r)
        q_at = q_i.gather(-1, at).squeeze(-1)
        r_at = r.gather(-1, at).squeeze(-1)
        accept = live & (u[:, i] * q_at * mass < r_at)
        accepted_rank = torch.where(accept, i, accepted_rank)
        token = torch.where(accept, x, token)
        residual = (r - mass[:, None] * q_i).clamp_min(0.0)
        update = live & ~accept & (residual > 0).any(-1)  # no mass left: a rejection of probability 0
        r = torch.where(update[:, None], residual, r)
    token = torch.where(accepted_rank >= 0, token, race_argmax(r, e))
    return accepted_rank, token


# ---- keyed noise --------------------------------------------------------------------------------------


def _count(value: int, name: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


def _keys(seeds: Tensor, positions: Tensor, draws: Union[Tensor, int], rows: int) -> tuple[Tensor, Tensor, Tensor]:
    """``(seeds, positions, draws)`` as int64 ``[rows]`` tensors (``draws`` may be one int for every row), or a
    ``ValueError`` naming the argument."""
    for name, x in (("seeds", seeds), ("positions", positions)):
        if not isinstance(x, Tensor):
            raise ValueError(f"{name} must be a [{rows}] integer tensor, got {type(x).__name__}")
    seeds = as_long(seeds, "seeds", (rows,))
    positions = as_long(positions, "positions", (rows,))
    if isinstance(draws, Tensor):
        draws = as_long(draws, "draws", (rows,))
    else:
        draws = torch.full((rows,), _count(draws, "draws", 0), dtype=torch.int64, device=seeds.device)
    return seeds, positions, draws


def rrs_noise(seeds: Tensor, positions: Tensor, num_candidates: int, vocab: int,
              draws: Union[Tensor, int] = 0) -> tuple[Tensor, Tensor]:
    """``(uniforms [R, K], exponentials [R, V])`` float32 for :func:`rrs_reference`, row ``r`` keyed by
    ``(seeds[r]; positions[r], stream, draws[r])`` alone (module docstring, "Noise").

    Args:
        seeds: ``[R]`` integer Philox seeds, one per row (a row's sample's seed).
        positions: ``[R]`` the absolute position each row verifies.
        num_candidates: ``K >= 0``, the ranks.
        vocab: ``V >= 1``.
        draws: the pass counter, one for all rows or ``[R]`` (default 0).

    Rank ``k``'s uniform is word ``k % 4`` of block ``c0 = k // 4`` of ``(position, ACCEPT, draw)`` (rank 0 is
    the single-draft acceptance uniform); the exponentials are the RESIDUAL race's noise of ``(position, draw)``.
    """
    if not isinstance(seeds, Tensor) or seeds.dim() != 1:
        raise ValueError(f"seeds must be a [rows] tensor, got shape {tuple(getattr(seeds, 'shape', ()))}")
    rows = int(seeds.shape[0])
    seeds, positions, draws = _keys(seeds, positions, draws, rows)
    ranks = _count(num_candidates, "num_candidates", 0)
    vocab = _count(vocab, "vocab", 1)
    streams = torch.full_like(seeds, int(Stream.ACCEPT))
    if ranks:
        u = race.words_for(seeds, positions, streams, draws, ranks)
    else:
        u = torch.zeros(rows, 0, dtype=torch.float32, device=seeds.device)
    e = race.exponentials_for(seeds, positions, torch.full_like(seeds, int(Stream.RESIDUAL)), draws, vocab)
    return u, e


# ---- dispatch -----------------------------------------------------------------------------------------------

_MIN_BLOCK, _MAX_BLOCK = 16, 2**16  # vispec.kernels.multi_verify_triton.MIN_BLOCK, 2 ** TREE_LEVELS


def _floating(x: Tensor, name: str, shape: tuple[int, ...], validate: bool) -> None:
    """A floating ``shape`` tensor of finite non-negative weights (range checked with ``validate``), left in its
    dtype, or a ``ValueError`` naming ``name``."""
    _check_floating(x, name, shape)
    if validate and x.numel() and not bool((torch.isfinite(x) & (x >= 0)).all()):
        raise ValueError(f"{name} must be finite and non-negative")


def _check_drawable(q_base: Tensor, candidates: Tensor) -> None:
    """Every present candidate has positive weight under ``q_base`` and is not a repeat of an earlier candidate of
    its row: :func:`without_replacement`'s check on ``[R, K]`` values (the same condition, except a float64
    weight so small that ``q(x) / Σ q`` underflows to 0, which only the reference path reports)."""
    present = candidates >= 0
    at = q_base.gather(-1, candidates.clamp_min(0))
    ranks = candidates.shape[1]
    earlier = torch.ones(ranks, ranks, dtype=torch.bool, device=candidates.device).tril(-1)  # [i, j]: j < i
    repeat = ((candidates[:, :, None] == candidates[:, None, :]) & earlier).any(-1)
    bad = present & (~(at > 0) | repeat)
    if bool(bad.any()):
        row, rank = (int(i) for i in bad.nonzero()[0])
        raise ValueError(f"candidates[{row}, {rank}] = {int(candidates[row, rank])} has zero probability under "
                         "its draft distribution q_i: it cannot have been drawn from it (a repeated candidate, "
                         "drawn without replacement, or a token outside the draft's support)")


def _check_block(block: Optional[int]) -> Optional[int]:
    if block is not None and (isinstance(block, bool) or not isinstance(block, int) or block < _MIN_BLOCK
                              or block > _MAX_BLOCK or block & (block - 1)):
        raise ValueError(f"block must be None or a power of two in [{_MIN_BLOCK}, {_MAX_BLOCK}], got {block!r}")
    return block


def rrs(p: Tensor, q_base: Optional[Tensor], candidates: Tensor, seeds: Tensor, positions: Tensor,
        draws: Union[Tensor, int] = 0, *, backend: str = "auto", validate: bool = True,
        block: Optional[int] = None) -> tuple[Tensor, Tensor]:
    """Recursive rejection sampling with keyed noise: the dispatch point (module docstring).

    Args:
        p: ``[R, V]`` target weights (floating, finite, non-negative, positive row mass; need not be normalised).
        q_base: ``[R, V]`` the draft row each row's candidates were drawn from, in order and without replacement
            (floating, finite, non-negative; normalised in float64), or ``None``: one-hot candidates.
        candidates: ``[R, K]`` integer token ids, ``-1`` where a row has no candidate at that rank (left-aligned).
        seeds: ``[R]`` integer Philox seeds (a row's sample's seed).
        positions: ``[R]`` integer absolute positions the rows verify.
        draws: the pass counter, one int for all rows or ``[R]`` integers (default 0). The keys are moved to
            ``p``'s device.
        backend: ``"auto"`` (CUDA tensors: Triton), ``"triton"`` or ``"reference"``
            (:func:`vispec.kernels.backend.resolve_backend`).
        validate: check ranges (each check reads a value back from the device); shapes and dtypes are always
            checked.
        block: the kernel's tile width (a power of two >= 16; default from ``V``). The result does not depend on
            it; the reference ignores it.

    Returns:
        ``(accepted_rank [R], token [R])`` int64, as :func:`rrs_reference`: the rank of the accepted candidate
        (``-1``: all rejected, or none) and the token (that candidate, else the residual race's sample).

    The reference path is exactly ``rrs_reference(p, without_replacement(q_base, candidates), candidates,
    *rrs_noise(seeds, positions, K, V, draws))`` (``q=None`` when ``q_base`` is ``None``); the Triton path
    (:func:`vispec.kernels.multi_verify_triton.launch_rrs`) computes the same from ``p``, ``q_base`` and the keys.
    Raises ``ValueError`` naming the argument on a bad shape, dtype or range (both paths check the same way,
    ``candidates`` included: a candidate with no weight under ``q_base`` or repeated in its row), and when
    ``backend="triton"`` cannot run.
    """
    rows, vocab = _matrix_rows(p, "p")
    _floating(p, "p", (rows, vocab), validate)
    if validate and rows and not bool((p > 0).any(-1).all()):
        raise ValueError("p must have positive mass in every row")
    if q_base is not None:
        _floating(q_base, "q_base", (rows, vocab), validate)
    candidates = _checked_candidates(candidates, rows, vocab, validate).to(p.device)
    if validate and q_base is not None and candidates.numel():
        _check_drawable(q_base, candidates)
    seeds, positions, draws = (k.to(p.device) for k in _keys(seeds, positions, draws, rows))  # the keys follow p
    block = _check_block(block)
    if resolve_backend(backend, p, q_base, candidates, seeds, positions, draws) == "reference":
        q = None if q_base is None else without_replacement(q_base, candidates, validate=validate)
        uniforms, exponentials = rrs_noise(seeds, positions, int(candidates.shape[1]), vocab, draws)
        return rrs_reference(p, q, candidates, uniforms, exponentials, validate=validate)
    from vispec.kernels.multi_verify_triton import launch_rrs

    return launch_rrs(p, q_base, candidates, seeds, positions, draws, block=block)
