"""The processed target distribution of a batch of rows, verified against and sampled from.

A :class:`Target` holds ``T`` rows of raw model logits (a flattened ragged batch: row ``t``
belongs to sample ``row_sample[t]``, ``-1`` marks padding) and stands for the distribution
``p_t = process_logits(...)`` of :mod:`vispec.sampling` (guidance, processors, temperature,
top-k, top-p). Its operations are the dispatch points of speculative decoding:

* :meth:`Target.accept`: the speculative test ``u q(d) < p(d)`` per row (acceptance probability
  ``min(1, p(d)/q(d))``; Leviathan et al. 2023, Chen et al. 2023);
* :meth:`Target.first_rejection`: per sample, the number of leading accepted drafts;
* :meth:`Target.sample`: exponential-race samples from the residual ``max(0, p - q)`` and/or from
  ``p`` itself, and optionally the rows of ``p`` (stored as the next drafts' ``q``);
* :meth:`Target.verify`: all three for a window (the SJD / MC-SJD / draft-model step).

Backends (:mod:`vispec.kernels.backend`): the PyTorch reference materialises ``p`` with
:func:`~vispec.sampling.process_logits` and is the specification; the Triton kernels
(:mod:`vispec.kernels.verify_triton`) compute the same from the logits without a softmax row.
Randomness is counter-based Philox keyed by (sample seed, the position the row predicts, stream,
draw), or injected, so both backends see the same noise: tokens are identical unless two race keys
agree to within float32 rounding (the backends round ``log`` and the normaliser differently).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch
from torch import Tensor

from vispec.kernels.backend import resolve_backend
from vispec.kernels.philox import Stream, exponentials, uniforms
from vispec.kernels.verify import residual_weights, sample_from_weights_reference
from vispec.sampling import PositionProcessor, SamplingConfig, guided_logits, process_logits

if TYPE_CHECKING:
    from vispec.decoding.acceptance import AcceptanceRule

MODE_RESIDUAL = 1
MODE_FRESH = 2


def block_size(vocab_size: int) -> int:
    """Vocabulary tile of the kernels: a power of two in ``[16, 2048]``."""
    return max(16, min(2048, 1 << max(vocab_size - 1, 1).bit_length()))


def _long(x: Tensor, name: str, shape: tuple[int, ...]) -> Tensor:
    if tuple(x.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(x.shape)}")
    if x.dtype.is_floating_point or x.dtype == torch.bool:
        raise ValueError(f"{name} must be an integer tensor, got {x.dtype}")
    return x.to(torch.int64).contiguous()


@dataclass
class VerifyOutput:
    """Result of :meth:`Target.verify` (row tensors ``[T]``, sample tensors ``[B]``)."""

    accepted: Tensor  # bool [T]: the row's draft passed the test (False on rows without a draft)
    num_accepted: Tensor  # long [B]: leading accepted drafts (= index of the first rejection)
    coupled: Tensor  # long [T]: draft if accepted, else the residual sample (MC-SJD maximal coupling: every draft row;
    #                  otherwise only the first rejected row); -1 elsewhere
    next_token: Tensor  # long [B]: the residual sample at the first rejection, or the bonus sample after the last draft


class Target:
    """``T`` rows of the processed target ``p`` (module docstring).

    Args:
        cond: ``[T, V]`` conditional logits (fp32, bf16, fp16 or fp64; the vocabulary dimension contiguous).
        uncond: ``[T, V]`` unconditional logits, needed when ``sampling.guidance_scale != 1``.
        positions: ``[T]`` the image-token index each row predicts (guidance interval, processors, noise keys).
        row_sample: ``[T]`` the sample each row belongs to, ``-1`` for padding rows.
        seeds: ``[B]`` int64 per-sample seeds (:func:`vispec.kernels.philox.seeds_from_generators`).
        sampling: temperature, top-k, top-p and guidance.
        processors: per-position logits processors (applied in PyTorch before the kernels).
        backend: ``"auto"``, ``"triton"`` or ``"reference"``.
        block: vocabulary tile of the kernels (default :func:`block_size`).
        validate: check index arguments against their ranges (token ids, row indices). Each check
            reads a value back from the device; decoders that build the indices themselves turn
            it off. Kernels do not bounds-check these indices.
    """

    def __init__(
        self,
        cond: Tensor,
        uncond: Optional[Tensor],
        positions: Tensor,
        row_sample: Tensor,
        seeds: Tensor,
        sampling: SamplingConfig,
        processors: tuple[PositionProcessor, ...] = (),
        *,
        backend: str = "auto",
        block: Optional[int] = None,
        validate: bool = True,
    ):
        self.validate = validate
        if cond.dim() != 2:
            raise ValueError(f"cond must be [rows, vocab], got shape {tuple(cond.shape)}")
        rows, vocab = cond.shape
        if uncond is not None and uncond.shape != cond.shape:
            raise ValueError(f"uncond must have shape {tuple(cond.shape)}, got {tuple(uncond.shape)}")
        self.positions = _long(positions, "positions", (rows,))
        self.row_sample = _long(row_sample, "row_sample", (rows,))
        if seeds.dim() != 1:
            raise ValueError(f"seeds must be [batch], got shape {tuple(seeds.shape)}")
        if validate and rows and int(self.row_sample.max()) >= seeds.shape[0]:
            raise ValueError(f"row_sample refers to sample {int(self.row_sample.max())} but seeds has {seeds.shape[0]} entries")
        self.seeds = seeds.to(torch.int64).contiguous()
        self.sampling = sampling
        self.vocab = vocab
        self.backend = resolve_backend(backend, cond)
        self.block = block or block_size(vocab)
        if self.block < 4 or self.block & (self.block - 1):
            raise ValueError(f"block must be a power of two >= 4, got {self.block}")
        sampling.check_vocab(vocab)
        self._stats: Optional[tuple[Tensor, Tensor, Tensor]] = None
        if self.backend == "reference":
            probs = process_logits(cond[None], None if uncond is None else uncond[None], self.positions[None], sampling, processors)
            self.probs: Optional[Tensor] = probs[0]
            return
        self.probs = None
        if processors:  # guidance and processors in PyTorch; the kernels see processed logits
            cond = guided_logits(cond[None].float(), None if uncond is None else uncond[None].float(), self.positions[None], sampling)
            for processor in processors:
                cond = processor(cond, self.positions[None])
            cond, uncond = cond[0], None
        if uncond is not None and not sampling.uses_guidance:
            uncond = None
        if sampling.uses_guidance and uncond is None and not processors:
            guided_logits(cond[None], None, self.positions[None], sampling)  # raises the missing-branch error
        self.cond = cond if cond.stride(-1) == 1 else cond.contiguous()
        self.uncond = None if uncond is None else (uncond if uncond.stride(-1) == 1 else uncond.contiguous())
        if self.uncond is not None:
            active = torch.ones_like(self.positions, dtype=torch.bool)
            if sampling.cfg_interval >= 0:
                active = self.positions <= sampling.cfg_interval + 1
            self.guide = active.to(torch.int8)
        else:
            self.guide = torch.zeros(rows, dtype=torch.int8, device=cond.device)
        self.tau: Optional[Tensor] = None
        if not sampling.greedy and ((0 < sampling.top_k < vocab) or sampling.top_p < 1.0):
            self.tau = _triton_threshold(self)

    # ---- helpers ---------------------------------------------------------------------------

    @property
    def num_rows(self) -> int:
        return int(self.positions.shape[0])

    @property
    def device(self) -> torch.device:
        return self.positions.device

    def per_row(self, per_sample: Tensor) -> Tensor:
        """``[B]`` values spread to the rows (padding rows get sample 0's value)."""
        return per_sample.to(self.device)[self.row_sample.clamp_min(0)]

    def _row_seeds(self) -> Tensor:
        return self.seeds[self.row_sample.clamp_min(0)]

    def _check_drafts(self, draft_tokens: Tensor, q: Optional[Tensor], q_index: Optional[Tensor]) -> tuple[Tensor, Optional[Tensor], Optional[Tensor]]:
        draft_tokens = _long(draft_tokens, "draft_tokens", (self.num_rows,))
        if self.validate and self.num_rows and int(draft_tokens.max()) >= self.vocab:
            raise ValueError(f"draft_tokens must be < the vocabulary ({self.vocab}) or -1 (no draft), got {int(draft_tokens.max())}")
        if (q is None) != (q_index is None):
            raise ValueError("q and q_index must be given together (dense draft rows and which row each draft uses)")
        if q is not None:
            if q.dim() != 2 or q.shape[1] != self.vocab:
                raise ValueError(f"q must be [rows, {self.vocab}], got shape {tuple(q.shape)}")
            q_index = _long(q_index, "q_index", (self.num_rows,))
            if self.validate and self.num_rows and int(q_index.max()) >= q.shape[0]:
                raise ValueError(f"q_index refers to row {int(q_index.max())} but q has {q.shape[0]} rows")
            if q.stride(-1) != 1:
                q = q.contiguous()
        return draft_tokens, q, q_index

    def _draws(self, draws: Optional[Tensor], name: str) -> Tensor:
        if draws is None:
            return torch.zeros(self.num_rows, dtype=torch.int64, device=self.device)
        return _long(draws, name, (self.num_rows,))

    def _raise_status(self, status: Tensor) -> None:
        worst = int(status.max()) if status.numel() else 0
        if worst == 1:
            raise ValueError("logits contain NaN; the model produced invalid outputs")
        if worst == 2:
            raise ValueError("every token was masked out at some position (all logits -inf after processing)")

    def probabilities(self) -> Tensor:
        """``[T, V]`` rows of ``p`` (padding rows zero). The reference holds them; the Triton backend
        writes them once, on demand (relaxed acceptance rules work on probability rows)."""
        if self.probs is None:
            out = torch.zeros(self.num_rows, self.vocab, dtype=torch.float32, device=self.device)
            rows = torch.arange(self.num_rows, device=self.device)
            self.sample(store_rows=torch.where(self.row_sample >= 0, rows, torch.full_like(rows, -1)), store_out=out)
            self.probs = out
        return self.probs

    def dense_q(self, rows: Tensor, draft_tokens: Tensor, q: Optional[Tensor], q_index: Optional[Tensor]) -> Tensor:
        """``[len(rows), V]`` draft distributions of ``rows``: one-hot on the draft unless ``q_index >= 0``."""
        dtype = self.probabilities().dtype
        out = torch.nn.functional.one_hot(draft_tokens[rows].clamp_min(0), self.vocab).to(dtype)
        if q is not None:
            dense = q_index[rows] >= 0
            out = torch.where(dense[:, None], q[q_index[rows].clamp_min(0)].to(dtype), out)
        return out

    def output_tv(self, rule: "AcceptanceRule", rows: Tensor, draft_tokens: Tensor, *, q: Optional[Tensor] = None,
                  q_index: Optional[Tensor] = None) -> Tensor:
        """``[len(rows)]`` TV between what one verification of each row outputs under ``rule`` and ``p``
        (:meth:`vispec.decoding.acceptance.AcceptanceRule.output_tv`)."""
        draft_tokens, q, q_index = self._check_drafts(draft_tokens, q, q_index)
        return rule.output_tv(self.probabilities()[rows], self.dense_q(rows, draft_tokens, q, q_index))

    # ---- operations --------------------------------------------------------------------------

    def accept(
        self,
        draft_tokens: Tensor,
        *,
        q: Optional[Tensor] = None,
        q_index: Optional[Tensor] = None,
        draws: Optional[Tensor] = None,
        accept_uniforms: Optional[Tensor] = None,
        rule: Optional["AcceptanceRule"] = None,
    ) -> Tensor:
        """Acceptance flags ``[T]`` bool: ``u q(d) < p(d)`` for rows with a draft (``draft_tokens >= 0``).

        A lossy ``rule`` (:mod:`vispec.decoding.acceptance`) replaces the test; it runs in PyTorch on
        the rows of :meth:`probabilities`, with the same noise.

        ``q`` is one-hot on the draft unless ``q_index[t] >= 0`` selects a dense row of ``q``
        (``[Nq, V]`` probabilities). ``u`` is Philox noise keyed by (seed, position, ACCEPT,
        ``draws[t]``), or ``accept_uniforms [T]`` when given.
        """
        draft_tokens, q, q_index = self._check_drafts(draft_tokens, q, q_index)
        draws = self._draws(draws, "draws")
        if accept_uniforms is not None and tuple(accept_uniforms.shape) != (self.num_rows,):
            raise ValueError(f"accept_uniforms must have shape ({self.num_rows},), got {tuple(accept_uniforms.shape)}")
        real = (draft_tokens >= 0) & (self.row_sample >= 0)
        if rule is not None and not rule.lossless:
            rows = real.nonzero().squeeze(1)
            if accept_uniforms is None:
                accept_uniforms = uniforms(self._row_seeds(), self.positions[:, None], Stream.ACCEPT, draws)[:, 0]
            accepted = torch.zeros_like(real)
            accepted[rows] = rule.accept(self.probabilities()[rows], draft_tokens[rows],
                                         self.dense_q(rows, draft_tokens, q, q_index), accept_uniforms[rows])
            return accepted
        if self.backend == "triton":
            accepted, status = _triton_accept(self, draft_tokens, q, q_index, draws, accept_uniforms)
            self._raise_status(status)
            return accepted
        tokens = draft_tokens.clamp_min(0)[:, None]
        p_at = self.probs.gather(-1, tokens).squeeze(-1)
        q_at = torch.ones_like(p_at)
        if q is not None:
            dense = q_index >= 0
            q_at = torch.where(dense, q[q_index.clamp_min(0)].gather(-1, tokens).squeeze(-1).to(p_at.dtype), q_at)
        if accept_uniforms is None:
            accept_uniforms = uniforms(self._row_seeds(), self.positions[:, None], Stream.ACCEPT, draws)[:, 0]
        return (accept_uniforms.to(p_at.dtype) * q_at < p_at) & real

    def first_rejection(self, accepted: Tensor, row_start: Tensor, num_drafts: Tensor) -> Tensor:
        """``[B]`` leading accepted rows among ``row_start[b] .. row_start[b] + num_drafts[b] - 1``."""
        batch = num_drafts.shape[0] if num_drafts.dim() == 1 else -1
        row_start = _long(row_start, "row_start", (batch,))
        num_drafts = _long(num_drafts, "num_drafts", (batch,))
        if self.validate and batch and (int((row_start + num_drafts).max()) > self.num_rows or int(num_drafts.min()) < 0 or int(row_start.min()) < 0):
            raise ValueError(f"row_start + num_drafts must describe rows inside [0, {self.num_rows}] with num_drafts >= 0")
        if self.backend == "triton":
            return _triton_first_rejection(accepted, row_start, num_drafts)
        width = int(num_drafts.max()) if batch else 0
        slots = torch.arange(width, device=accepted.device)
        real = slots[None, :] < num_drafts[:, None]
        flags = accepted[(row_start[:, None] + slots).clamp(max=max(self.num_rows - 1, 0))] & real if width else real
        return torch.cumprod(flags.to(torch.int64), dim=1).sum(dim=1)

    def sample(
        self,
        *,
        residual: Optional[Tensor] = None,
        fresh: Optional[Tensor] = None,
        draft_tokens: Optional[Tensor] = None,
        q: Optional[Tensor] = None,
        q_index: Optional[Tensor] = None,
        residual_draws: Optional[Tensor] = None,
        fresh_stream: Stream | Tensor = Stream.SAMPLE,
        fresh_draws: Optional[Tensor] = None,
        residual_noise: Optional[Tensor] = None,
        fresh_noise: Optional[Tensor] = None,
        store_rows: Optional[Tensor] = None,
        store_out: Optional[Tensor] = None,
        rule: Optional["AcceptanceRule"] = None,
    ) -> tuple[Tensor, Tensor]:
        """Exponential-race samples, ``(residual_tokens [T], fresh_tokens [T])`` with ``-1`` on rows not asked for.

        Args:
            residual: ``[T]`` bool, rows that sample the residual ``max(0, p - q)`` of their draft.
            fresh: ``[T]`` bool, rows that sample ``p``.
            draft_tokens, q, q_index: the drafts, as in :meth:`accept`.
            residual_draws: ``[T]`` draw counters of the RESIDUAL stream.
            fresh_stream: the stream of fresh samples (SAMPLE, or GUMBEL for MC-SJD's coupling), one or ``[T]``.
            fresh_draws: ``[T]`` draw counters of the fresh stream.
            residual_noise, fresh_noise: ``[T, V]`` injected Exp(1) noise instead of Philox (both or neither).
            store_rows: ``[T]`` long, row ``t``'s ``p`` is written to ``store_out[store_rows[t]]`` where ``>= 0``.
            store_out: ``[N, V]`` tensor receiving those rows.
            rule: a lossy acceptance rule whose residual (``rule.residual_weights``) rejected rows sample.
        """
        rows = self.num_rows
        residual = torch.zeros(rows, dtype=torch.bool, device=self.device) if residual is None else residual
        fresh = torch.zeros(rows, dtype=torch.bool, device=self.device) if fresh is None else fresh
        for name, flags in (("residual", residual), ("fresh", fresh)):
            if tuple(flags.shape) != (rows,) or flags.dtype != torch.bool:
                raise ValueError(f"{name} must be a bool tensor of shape ({rows},), got {flags.dtype} {tuple(flags.shape)}")
        if draft_tokens is None:
            if bool(residual.any()):
                raise ValueError("residual rows need draft_tokens")
            draft_tokens = torch.full((rows,), -1, dtype=torch.int64, device=self.device)
        draft_tokens, q, q_index = self._check_drafts(draft_tokens, q, q_index)
        residual_draws = self._draws(residual_draws, "residual_draws")
        fresh_draws = self._draws(fresh_draws, "fresh_draws")
        if isinstance(fresh_stream, Tensor):
            fresh_stream = _long(fresh_stream, "fresh_stream", (rows,))
        else:
            fresh_stream = torch.full((rows,), int(fresh_stream), dtype=torch.int64, device=self.device)
        if (residual_noise is None) != (fresh_noise is None):
            raise ValueError("residual_noise and fresh_noise must be given together (injected noise) or not at all")
        for name, noise in (("residual_noise", residual_noise), ("fresh_noise", fresh_noise)):
            if noise is not None and tuple(noise.shape) != (rows, self.vocab):
                raise ValueError(f"{name} must have shape {(rows, self.vocab)}, got {tuple(noise.shape)}")
        if (store_rows is None) != (store_out is None):
            raise ValueError("store_rows and store_out must be given together")
        if store_rows is not None:
            store_rows = _long(store_rows, "store_rows", (rows,))
            if store_out.dim() != 2 or store_out.shape[1] != self.vocab:
                raise ValueError(f"store_out must be [N, {self.vocab}], got shape {tuple(store_out.shape)}")
            if self.validate and rows and int(store_rows.max()) >= store_out.shape[0]:
                raise ValueError(f"store_rows refers to row {int(store_rows.max())} but store_out has {store_out.shape[0]} rows")
        residual = residual & (self.row_sample >= 0) & (draft_tokens >= 0)
        fresh = fresh & (self.row_sample >= 0)
        if rule is not None and not rule.lossless and bool(residual.any()):
            rr = residual.nonzero().squeeze(1)
            weights = rule.residual_weights(self.probabilities()[rr], draft_tokens[rr], self.dense_q(rr, draft_tokens, q, q_index))
            if residual_noise is None:
                noise = exponentials(self._row_seeds()[rr], self.positions[rr][:, None], Stream.RESIDUAL, residual_draws[rr],
                                     self.vocab)[:, 0]
            else:
                noise = residual_noise[rr]
            residual_tokens = torch.full((rows,), -1, dtype=torch.int64, device=self.device)
            residual_tokens[rr] = sample_from_weights_reference(weights, noise)
            _, fresh_tokens = self.sample(fresh=fresh, fresh_stream=fresh_stream, fresh_draws=fresh_draws,
                                          residual_noise=residual_noise, fresh_noise=fresh_noise,
                                          store_rows=store_rows, store_out=store_out)
            return residual_tokens, fresh_tokens
        if self.backend == "triton":
            return _triton_sample(self, residual, fresh, draft_tokens, q, q_index, residual_draws, fresh_stream,
                                  fresh_draws, residual_noise, fresh_noise, store_rows, store_out)
        return self._sample_reference(residual, fresh, draft_tokens, q, q_index, residual_draws, fresh_stream, fresh_draws,
                                      residual_noise, fresh_noise, store_rows, store_out)

    def _sample_reference(self, residual, fresh, draft_tokens, q, q_index, residual_draws, fresh_stream, fresh_draws,
                          residual_noise, fresh_noise, store_rows, store_out) -> tuple[Tensor, Tensor]:
        rr = residual.nonzero().squeeze(1)
        fr = fresh.nonzero().squeeze(1)
        if residual_noise is None:  # one Philox evaluation for both kinds of rows (counter-keyed: same numbers)
            rows = torch.cat([rr, fr])
            noise = exponentials(
                self._row_seeds()[rows], self.positions[rows][:, None],
                torch.cat([torch.full_like(rr, int(Stream.RESIDUAL)), fresh_stream[fr]])[:, None],
                torch.cat([residual_draws[rr], fresh_draws[fr]]), self.vocab,
            )[:, 0]
            residual_noise_rows, fresh_noise_rows = noise[: rr.numel()], noise[rr.numel():]
        else:
            residual_noise_rows, fresh_noise_rows = residual_noise[rr], fresh_noise[fr]
        residual_tokens = torch.full((self.num_rows,), -1, dtype=torch.int64, device=self.device)
        fresh_tokens = residual_tokens.clone()
        probs = self.probs
        if rr.numel():
            weights = residual_weights(probs[rr], self.dense_q(rr, draft_tokens, q, q_index))
            residual_tokens[rr] = sample_from_weights_reference(weights, residual_noise_rows)
        if fr.numel():
            fresh_tokens[fr] = sample_from_weights_reference(probs[fr], fresh_noise_rows)
        if store_rows is not None:
            sel = (store_rows >= 0) & (self.row_sample >= 0)
            store_out[store_rows[sel]] = probs[sel].to(store_out.dtype)
        return residual_tokens, fresh_tokens

    def verify(
        self,
        draft_tokens: Tensor,
        row_start: Tensor,
        num_drafts: Tensor,
        *,
        q: Optional[Tensor] = None,
        q_index: Optional[Tensor] = None,
        draws: Optional[Tensor] = None,
        coupling: str = "first",
        bonus_stream: Stream = Stream.SAMPLE,
        bonus_draws: Optional[Tensor] = None,
        accept_uniforms: Optional[Tensor] = None,
        residual_noise: Optional[Tensor] = None,
        fresh_noise: Optional[Tensor] = None,
        rule: Optional["AcceptanceRule"] = None,
    ) -> VerifyOutput:
        """One speculative-decoding verification of a window per sample.

        Sample ``b``'s rows are ``row_start[b] + j``, ``j = 0 .. num_drafts[b]``: row ``j < num_drafts[b]``
        verifies ``draft_tokens[row]`` and row ``num_drafts[b]`` gives the bonus sample. With
        ``coupling="first"`` the residual is sampled at the first rejection only (standard
        speculative sampling); with ``"maximal"`` every rejected row gets its residual sample,
        so ``coupled[t]`` is the maximal coupling of ``q_t`` and ``p_t`` for every draft row
        (MC-SJD, arXiv 2510.24211).
        """
        if coupling not in ("first", "maximal"):
            raise ValueError(f"coupling must be 'first' or 'maximal', got {coupling!r}")
        draws = self._draws(draws, "draws")
        accepted = self.accept(draft_tokens, q=q, q_index=q_index, draws=draws, accept_uniforms=accept_uniforms, rule=rule)
        m = self.first_rejection(accepted, row_start, num_drafts)
        rows = torch.arange(self.num_rows, device=self.device)
        sample = self.row_sample.clamp_min(0)
        offset = rows - row_start.to(self.device)[sample]
        valid = self.row_sample >= 0
        is_draft = valid & (offset >= 0) & (offset < num_drafts.to(self.device)[sample])
        if coupling == "maximal":
            need_residual = is_draft & ~accepted
        else:
            need_residual = is_draft & (offset == m[sample])
        is_bonus = valid & (offset == num_drafts.to(self.device)[sample])
        need_fresh = is_bonus & (m[sample] == num_drafts.to(self.device)[sample])
        residual_tokens, fresh_tokens = self.sample(
            residual=need_residual, fresh=need_fresh, draft_tokens=draft_tokens, q=q, q_index=q_index,
            residual_draws=draws, fresh_stream=bonus_stream, fresh_draws=self._draws(bonus_draws, "bonus_draws"),
            residual_noise=residual_noise, fresh_noise=fresh_noise, rule=rule,
        )
        coupled = torch.where(accepted, draft_tokens, residual_tokens)
        coupled = torch.where(is_draft, coupled, torch.full_like(coupled, -1))
        at = (row_start.to(self.device) + m).clamp(max=max(self.num_rows - 1, 0))
        picked = torch.where(m < num_drafts.to(self.device), residual_tokens[at], fresh_tokens[at]) if self.num_rows else m
        return VerifyOutput(accepted=accepted, num_accepted=m, coupled=coupled, next_token=picked)


# ---- Triton launchers -----------------------------------------------------------------------------


def _kernels():
    from vispec.kernels import verify_triton

    return verify_triton


def _num_warps(block: int) -> int:
    return 8 if block >= 2048 else 4


def _common_args(target: Target) -> tuple:
    cond = target.cond
    uncond = target.uncond if target.uncond is not None else cond
    return (cond, uncond, cond.stride(0), uncond.stride(0), target.guide, float(target.sampling.guidance_scale),
            float(target.sampling.temperature) if not target.sampling.greedy else 1.0)


def _triton_threshold(target: Target) -> Tensor:
    k = _kernels()
    rows = target.num_rows
    tau = torch.full((rows,), float("-inf"), dtype=torch.float32, device=target.device)
    if rows == 0:
        return tau
    cond, uncond, stride_c, stride_u, guide, scale, temperature = _common_args(target)
    top_k, top_p = target.sampling.top_k, target.sampling.top_p
    k._threshold_kernel[(rows,)](
        cond, uncond, stride_c, stride_u, guide, scale, temperature, target.row_sample, tau,
        target.vocab, top_k, float(top_p),
        HAS_UNCOND=target.uncond is not None, USE_TOP_K=0 < top_k < target.vocab, USE_TOP_P=top_p < 1.0,
        BLOCK=target.block, num_warps=_num_warps(target.block), enable_fp_fusion=False,
    )
    return tau


def _triton_accept(target: Target, draft_tokens, q, q_index, draws, accept_uniforms) -> tuple[Tensor, Tensor]:
    k = _kernels()
    rows, device = target.num_rows, target.device
    accepted = torch.zeros(rows, dtype=torch.int8, device=device)
    m = torch.full((rows,), float("-inf"), dtype=torch.float32, device=device)
    s = torch.zeros(rows, dtype=torch.float32, device=device)
    amax = torch.zeros(rows, dtype=torch.int64, device=device)
    status = torch.zeros(rows, dtype=torch.int8, device=device)
    if rows:
        cond, uncond, stride_c, stride_u, guide, scale, temperature = _common_args(target)
        tau = target.tau if target.tau is not None else m
        q_t = q if q is not None else cond
        q_idx = q_index if q_index is not None else draft_tokens
        u = accept_uniforms.to(torch.float32).contiguous() if accept_uniforms is not None else m
        k._accept_kernel[(rows,)](
            cond, uncond, stride_c, stride_u, guide, scale, temperature, tau,
            draft_tokens, q_t, q_t.stride(0), q_idx,
            target.row_sample, target.seeds, target.positions, draws, u,
            accepted, m, s, amax, status, target.vocab,
            HAS_UNCOND=target.uncond is not None, GREEDY=target.sampling.greedy, HAS_TAU=target.tau is not None,
            HAS_DENSE=q is not None, INJECTED=accept_uniforms is not None, BLOCK=target.block,
            num_warps=_num_warps(target.block), enable_fp_fusion=False,
        )
    target._stats = (m, s, amax)
    return accepted.bool(), status


def _triton_first_rejection(accepted: Tensor, row_start: Tensor, num_drafts: Tensor) -> Tensor:
    out = torch.zeros(num_drafts.shape[0], dtype=torch.int64, device=accepted.device)
    if out.numel():
        _kernels()._first_rejection_kernel[(out.numel(),)](accepted.to(torch.int8).contiguous(), row_start, num_drafts, out, num_warps=1,
                                                        enable_fp_fusion=False)
    return out


def _triton_sample(target: Target, residual, fresh, draft_tokens, q, q_index, residual_draws, fresh_stream, fresh_draws,
                   residual_noise, fresh_noise, store_rows, store_out) -> tuple[Tensor, Tensor]:
    k = _kernels()
    rows, device = target.num_rows, target.device
    residual_out = torch.full((rows,), -1, dtype=torch.int64, device=device)
    fresh_out = residual_out.clone()
    if rows == 0:
        return residual_out, fresh_out
    if target._stats is None:  # no acceptance pass yet: compute (m, s) / arg-max without drafts
        _, status = _triton_accept(target, torch.full((rows,), -1, dtype=torch.int64, device=device), None, None,
                                   torch.zeros(rows, dtype=torch.int64, device=device), None)
        target._raise_status(status)
    m, s, amax = target._stats
    mode = (residual.to(torch.int8) * MODE_RESIDUAL + fresh.to(torch.int8) * MODE_FRESH).contiguous()
    cond, uncond, stride_c, stride_u, guide, scale, temperature = _common_args(target)
    tau = target.tau if target.tau is not None else m
    q_t = q if q is not None else cond
    q_idx = q_index if q_index is not None else draft_tokens
    injected = residual_noise is not None
    r_noise = residual_noise.to(torch.float32).contiguous() if injected else m
    f_noise = fresh_noise.to(torch.float32).contiguous() if injected else m
    store = store_rows is not None
    out = store_out if store else m
    k._sample_kernel[(rows,)](
        cond, uncond, stride_c, stride_u, guide, scale, temperature, tau,
        draft_tokens, q_t, q_t.stride(0), q_idx,
        m, s, amax, mode,
        target.row_sample, target.seeds, target.positions, residual_draws, fresh_stream, fresh_draws,
        r_noise, f_noise, target.vocab if injected else 0,
        store_rows if store else draft_tokens, out, out.stride(0) if store else 0,
        residual_out, fresh_out, target.vocab,
        HAS_UNCOND=target.uncond is not None, GREEDY=target.sampling.greedy, HAS_TAU=target.tau is not None,
        HAS_DENSE=q is not None, INJECTED=injected, STORE=store, BLOCK=target.block,
        num_warps=_num_warps(target.block), enable_fp_fusion=False,
    )
    return residual_out, fresh_out


def window_target(
    cond: Tensor, uncond: Optional[Tensor], positions: Tensor, num_rows: Tensor, seeds: Tensor, sampling: SamplingConfig,
    processors: tuple[PositionProcessor, ...] = (), *, backend: str = "auto", block: Optional[int] = None,
    validate: bool = True,
) -> Target:
    """A :class:`Target` over padded windows: ``cond [B, W, V]``, ``positions [B, W]``, sample ``b`` owning
    rows ``b W .. b W + num_rows[b] - 1`` (the rest are padding). Row ``b W + j`` is ``cond[b, j]``."""
    if cond.dim() != 3:
        raise ValueError(f"cond must be [batch, window, vocab], got shape {tuple(cond.shape)}")
    batch, width, vocab = cond.shape
    if tuple(positions.shape) != (batch, width):
        raise ValueError(f"positions must have shape {(batch, width)}, got {tuple(positions.shape)}")
    slots = torch.arange(width, device=cond.device)
    owner = torch.arange(batch, device=cond.device)[:, None].expand(batch, width)
    row_sample = torch.where(slots[None, :] < num_rows.to(cond.device)[:, None], owner, torch.full_like(owner, -1))
    flat = lambda x: None if x is None else x.reshape(batch * width, vocab)  # noqa: E731
    return Target(flat(cond), flat(uncond), positions.reshape(-1), row_sample.reshape(-1), seeds, sampling, processors,
                  backend=backend, block=block, validate=validate)
