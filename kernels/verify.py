"""Speculative verification over a flattened ragged batch: the contract and its PyTorch reference.

This module is the specification. :mod:`vispec.kernels.verify_triton` computes the same from raw
logits on CUDA (kernels and their launchers), and :class:`vispec.kernels.target.Target` dispatches
between the two; given the same noise they return the same tokens.

Layout (vLLM's ragged layout)::

    T rows                   row t stands for the target distribution p_t (``[V]``) of the position
                             positions[t] it predicts; row_sample[t] is its sample, -1 marks padding
    B samples                sample b's draft rows are row_start[b] .. row_start[b] + num_drafts[b] - 1
    drafts.tokens   [T]      the draft d_t that row t verifies (-1: the row has no draft)
    drafts.q        [Nq, V]  dense draft distributions; row t uses q[drafts.q_index[t]] when
    drafts.q_index  [T]      q_index[t] >= 0, else q_t is one-hot on d_t (initialised drafts)

Glossary (Leviathan et al. 2023; Chen et al. 2023; MC-SJD, arXiv 2510.24211):

* **accepted**: the draft passes the speculative test ``u q(d) < p(d)`` with ``u ~ U(0, 1)``, i.e.
  it is kept with probability ``min(1, p(d) / q(d))`` (:func:`speculative_test`);
* **num_accepted** ``m_b``: the leading accepted drafts of sample ``b`` (the index of its first
  rejection, :func:`first_rejection`);
* **residual** (recovered) token: a sample from ``max(0, p - q)`` (:func:`residual_weights`), drawn
  where a draft was rejected;
* **fresh** token: a sample from ``p`` itself: the bonus token after a fully accepted window, or a
  new Jacobi draft;
* **coupled output**: the draft if accepted, else the residual token. It is distributed exactly as
  ``p``, and it equals the draft with probability ``Σ_v min(p(v), q(v)) = 1 - TV(p, q)``: the maximal
  coupling of ``q`` and ``p``.

Sampling from unnormalised weights ``w`` is the exponential race ``argmax_v w_v / E_v`` with
``E_v ~ Exp(1)`` i.i.d. (Gumbel-max on ``log w``): ``P[v] = w_v / Σ w``, with no normalisation and
the noise an explicit input, so a kernel can reproduce the choice exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Union

import torch
from torch import Tensor

from vispec.kernels.philox import Stream


def speculative_test(u: Tensor, q_at: Tensor, p_at: Tensor) -> Tensor:
    """The exact acceptance rule: keep the draft iff ``u q(d) < p(d)`` (``[R]`` each; ``q_at``, ``p_at``
    at the draft token)."""
    return u.to(p_at.dtype) * q_at.to(p_at.dtype) < p_at


def residual_weights(p: Tensor, q: Tensor) -> Tensor:
    """The exact rule's residual: unnormalised ``max(0, p - q)`` (same shape as ``p``)."""
    return (p - q.to(p.dtype)).clamp_min(0.0)


def race_argmax(weights: Tensor, exponentials: Tensor) -> Tensor:
    """Exponential race ``argmax_v weights_v / E_v`` over the last dimension.

    Entries with zero weight never win (they score 0 while any positive weight scores > 0). A row of
    all-zero weights returns index 0; callers only use rows with positive mass.
    """
    return (weights / exponentials).argmax(dim=-1)


def sample_from_weights(weights: Tensor, exponentials: Tensor) -> Tensor:
    """Categorical samples ``[..., V] -> [...]`` from unnormalised weights (float32 unless float64)."""
    if weights.shape != exponentials.shape:
        raise ValueError(f"exponentials must have shape {tuple(weights.shape)}, got {tuple(exponentials.shape)}")
    return race_argmax(weights.to(torch.float32) if weights.dtype != torch.float64 else weights, exponentials)


def as_long(x: Tensor, name: str, shape: tuple[int, ...]) -> Tensor:
    """``x`` as a contiguous int64 tensor of ``shape``, or a ``ValueError`` naming ``name``."""
    if tuple(x.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(x.shape)}")
    if x.dtype.is_floating_point or x.dtype == torch.bool:
        raise ValueError(f"{name} must be an integer tensor, got {x.dtype}")
    if x.dtype == torch.int64 and x.is_contiguous():  # the common case: no dispatcher round trip at all
        return x
    return x.to(torch.int64).contiguous()


def _check_below(x: Tensor, bound: int, message: str) -> None:
    if x.numel() and int(x.max()) >= bound:
        raise ValueError(message.format(int(x.max())))


@dataclass
class Drafts:
    """The draft each row verifies (module docstring): ``tokens [T]`` (-1: none), and optionally dense
    ``q [Nq, V]`` with ``q_index [T]`` (-1: one-hot on the draft)."""

    tokens: Tensor
    q: Optional[Tensor] = None
    q_index: Optional[Tensor] = None

    @classmethod
    def none(cls, rows: int, device: torch.device) -> "Drafts":
        return cls(torch.full((rows,), -1, dtype=torch.int64, device=device))

    def checked(self, rows: int, vocab: int, validate: bool) -> "Drafts":
        """Shapes and dtypes checked, indices made int64 and rows contiguous; with ``validate``, ranges too
        (each range check reads a value back from the device)."""
        tokens = as_long(self.tokens, "draft tokens", (rows,))
        if validate:
            _check_below(tokens, vocab, f"draft tokens must be < the vocabulary ({vocab}) or -1 (no draft), got {{}}")
        if (self.q is None) != (self.q_index is None):
            raise ValueError("q and q_index must be given together (dense draft rows and which row each draft uses)")
        if self.q is None:
            return Drafts(tokens)
        if self.q.dim() != 2 or self.q.shape[1] != vocab:
            raise ValueError(f"q must be [rows, {vocab}], got shape {tuple(self.q.shape)}")
        q_index = as_long(self.q_index, "q_index", (rows,))
        if validate:
            _check_below(q_index, self.q.shape[0], f"q_index refers to row {{}} but q has {self.q.shape[0]} rows")
        return Drafts(tokens, self.q if self.q.stride(-1) == 1 else self.q.contiguous(), q_index)

    def dense(self, rows: Tensor, vocab: int, dtype: torch.dtype) -> Tensor:
        """``[len(rows), V]`` draft distributions of ``rows``: one-hot on the draft unless ``q_index >= 0``."""
        out = torch.nn.functional.one_hot(self.tokens[rows].clamp_min(0), vocab).to(dtype)
        if self.q is None:
            return out
        index = self.q_index[rows]
        return torch.where((index >= 0)[:, None], self.q[index.clamp_min(0)].to(dtype), out)

    def q_at_draft(self, dtype: torch.dtype) -> Tensor:
        """``[T]`` ``q_t(d_t)``: 1 for one-hot drafts, the dense row's entry otherwise."""
        ones = torch.ones(self.tokens.shape, dtype=dtype, device=self.tokens.device)
        if self.q is None:
            return ones
        dense = self.q[self.q_index.clamp_min(0)].gather(-1, self.tokens.clamp_min(0)[:, None]).squeeze(-1)
        return torch.where(self.q_index >= 0, dense.to(dtype), ones)


@dataclass
class InjectedNoise:
    """Exp(1) noise ``[T, V]`` for the residual and fresh races instead of the keyed Philox streams (tests)."""

    residual: Tensor
    fresh: Tensor


@dataclass
class SampleRequest:
    """Which rows sample what (:meth:`vispec.kernels.target.Target.sample`); rows not asked for get -1.

    * ``residual`` ``[T]`` bool: sample the residual ``max(0, p - q)`` of the row's draft;
    * ``fresh`` ``[T]`` bool: sample ``p``;
    * ``residual_draws`` ``[T]``: draw counters of the RESIDUAL noise stream;
    * ``fresh_stream``: SAMPLE, or GUMBEL for MC-SJD's fixed per-position noise (one, or ``[T]``);
      ``fresh_draws`` ``[T]`` its draw counters;
    * ``store_rows`` ``[T]`` with ``store_out [N, V]``: row ``t``'s ``p`` is written to
      ``store_out[store_rows[t]]`` where ``store_rows[t] >= 0`` (the next drafts' ``q``);
    * ``noise``: injected noise instead of Philox.
    """

    residual: Optional[Tensor] = None
    fresh: Optional[Tensor] = None
    residual_draws: Optional[Tensor] = None
    fresh_stream: Union[Stream, Tensor] = Stream.SAMPLE
    fresh_draws: Optional[Tensor] = None
    store_rows: Optional[Tensor] = None
    store_out: Optional[Tensor] = None
    noise: Optional[InjectedNoise] = None

    def checked(self, rows: int, vocab: int, device: torch.device, validate: bool,
                stream_rows: bool = True) -> "SampleRequest":
        """Every field present, shaped ``[T]`` (flags bool, counters int64), or a ``ValueError`` naming it.

        ``stream_rows=False`` keeps a single ``fresh_stream`` (a :class:`Stream`) as it is instead of a ``[T]``
        tensor (the kernels take one stream as a scalar)."""
        flags = {}
        for name in ("residual", "fresh"):
            value = getattr(self, name)
            value = torch.zeros(rows, dtype=torch.bool, device=device) if value is None else value
            if tuple(value.shape) != (rows,) or value.dtype != torch.bool:
                raise ValueError(f"{name} must be a bool tensor of shape ({rows},), got {value.dtype} {tuple(value.shape)}")
            flags[name] = value
        draws = {name: torch.zeros(rows, dtype=torch.int64, device=device) if getattr(self, name) is None
                 else as_long(getattr(self, name), name, (rows,)) for name in ("residual_draws", "fresh_draws")}
        if isinstance(self.fresh_stream, Tensor):
            stream = as_long(self.fresh_stream, "fresh_stream", (rows,))
        else:
            stream = int(self.fresh_stream)
            if stream < 0:
                raise ValueError(f"fresh_stream must be a Stream (a counter >= 0) or an int64 tensor of shape ({rows},), "
                                 f"got {stream}")
            if stream_rows:
                stream = torch.full((rows,), int(stream), dtype=torch.int64, device=device)
        if self.noise is not None:
            for name in ("residual", "fresh"):
                noise = getattr(self.noise, name)
                if tuple(noise.shape) != (rows, vocab):
                    raise ValueError(f"{name} noise must have shape {(rows, vocab)}, got {tuple(noise.shape)}")
        store_rows = self.store_rows
        if (store_rows is None) != (self.store_out is None):
            raise ValueError("store_rows and store_out must be given together")
        if store_rows is not None:
            store_rows = as_long(store_rows, "store_rows", (rows,))
            if self.store_out.dim() != 2 or self.store_out.shape[1] != vocab:
                raise ValueError(f"store_out must be [N, {vocab}], got shape {tuple(self.store_out.shape)}")
            if validate:
                _check_below(store_rows, self.store_out.shape[0],
                             f"store_rows refers to row {{}} but store_out has {self.store_out.shape[0]} rows")
        return SampleRequest(flags["residual"], flags["fresh"], draws["residual_draws"], stream, draws["fresh_draws"],
                             store_rows, self.store_out, self.noise)


@dataclass
class LogitRows:
    """The target rows as the kernels read them: raw logits and how to process them (the order of
    :mod:`vispec.sampling`: guidance, temperature, the top-k/top-p threshold ``tau``, softmax)."""

    cond: Tensor  # [T, V] raw conditional logits (vocabulary contiguous)
    uncond: Optional[Tensor]  # [T, V] unconditional logits, None without guidance
    guide_limit: int  # guidance applies on rows whose position is <= guide_limit (cfg_interval + 1, or int64 max)
    guidance_scale: float
    temperature: float  # 1.0 when greedy
    greedy: bool
    top_k: int
    top_p: float
    tau: Optional[Tensor]  # float32 [T]: processed logits below tau are dropped; None: no top-k/top-p
    positions: Tensor  # int64 [T]: the image-token index each row predicts (noise keys)
    row_sample: Tensor  # int64 [T]: the row's sample, -1 for padding
    seeds: Tensor  # int64 [B]: per-sample Philox seeds
    block: int  # vocabulary tile of the kernels

    @property
    def vocab(self) -> int:
        return int(self.cond.shape[1])


# ---- the reference (probability rows ``p [T, V]``) -------------------------------------------------


def accept_reference(p: Tensor, drafts: Drafts, u: Tensor, real: Tensor) -> Tensor:
    """``[T]`` bool: :func:`speculative_test` on ``real`` rows (those with a draft), False elsewhere."""
    p_at = p.gather(-1, drafts.tokens.clamp_min(0)[:, None]).squeeze(-1)
    return speculative_test(u, drafts.q_at_draft(p_at.dtype), p_at) & real


def first_rejection_reference(accepted: Tensor, row_start: Tensor, num_drafts: Tensor, width: Optional[int] = None) -> Tensor:
    """``[B]`` leading accepted rows among ``row_start[b] .. row_start[b] + num_drafts[b] - 1`` (``width``: a
    host-side bound on ``num_drafts``; without it the maximum is read back from the device)."""
    if width is None:
        width = int(num_drafts.max()) if num_drafts.numel() else 0
    slots = torch.arange(width, device=accepted.device)
    real = slots[None, :] < num_drafts[:, None]
    if not width:
        return torch.zeros_like(num_drafts)
    flags = accepted[(row_start[:, None] + slots).clamp(max=max(accepted.shape[0] - 1, 0))] & real
    return torch.cumprod(flags.to(torch.int64), dim=1).sum(dim=1)


RaceFn = Callable[[Tensor, str], Tensor]
"""``race(weights [T, V], kind) -> [T]``: every row's exponential race over ``weights`` with the noise of
``kind`` (``"residual"`` or ``"fresh"``) for that row."""


def sample_reference(p: Tensor, residual: Optional[Tensor], fresh: Optional[Tensor], drafts: Drafts,
                     race: RaceFn) -> tuple[Tensor, Tensor]:
    """``(residual_tokens [T], fresh_tokens [T])`` (-1 where not asked): races over :func:`residual_weights`
    of the rows in ``residual`` and over ``p`` of the rows in ``fresh`` (None: no row asks).

    Dense and static: every row races (its noise is keyed per row, so the rows not asked for change
    nothing), and no shape depends on the flags, so no value is read back from the device."""
    none = torch.full((p.shape[0],), -1, dtype=torch.int64, device=p.device)
    residual_tokens = fresh_tokens = none
    if residual is not None:
        weights = residual_weights(p, drafts.dense(torch.arange(p.shape[0], device=p.device), p.shape[-1], p.dtype))
        residual_tokens = torch.where(residual, race(_race_dtype(weights), "residual"), none)
    if fresh is not None:
        fresh_tokens = torch.where(fresh, race(_race_dtype(p), "fresh"), none)
    return residual_tokens, fresh_tokens


def _race_dtype(weights: Tensor) -> Tensor:
    return weights.to(torch.float32) if weights.dtype != torch.float64 else weights


def noise_race(residual: Tensor, fresh: Tensor) -> RaceFn:
    """A :data:`RaceFn` with given Exp(1) noise ``[T, V]`` per kind (tests, :class:`InjectedNoise`)."""
    return lambda weights, kind: race_argmax(weights, residual if kind == "residual" else fresh)
