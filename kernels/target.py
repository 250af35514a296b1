"""The dispatch point of speculative verification: a batch of target rows, verified against and sampled from.

A :class:`Target` holds ``T`` rows of raw model logits in the ragged layout of
:mod:`vispec.kernels.verify` and stands for the distributions ``p_t = process_logits(...)``
(:mod:`vispec.sampling`: guidance, processors, temperature, top-k, top-p). Its operations
(:meth:`~Target.accept`, :meth:`~Target.first_rejection`, :meth:`~Target.sample`) run the PyTorch
reference of :mod:`vispec.kernels.verify` on materialised ``p`` rows, or the Triton kernels of
:mod:`vispec.kernels.verify_triton` from the logits (:mod:`vispec.kernels.backend` picks). The
kernel layer knows no policy: acceptance rules, couplings and windows live in :mod:`vispec.decoding`.

Randomness is counter-based Philox keyed by (sample seed, the position the row predicts, stream,
draw) (:meth:`Target.accept_uniforms`, :meth:`Target.race_noise`), or injected, so both backends
see the same noise: tokens are identical unless two race keys agree to within float32 rounding
(the backends round ``log`` and the normaliser differently).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from vispec.kernels import race, verify
from vispec.kernels.backend import resolve_backend
from vispec.kernels.philox import Stream
from vispec.kernels.verify import Drafts, LogitRows, SampleRequest, as_long, noise_race
from vispec.sampling import PositionProcessor, SamplingConfig, guided_logits, process_logits_status, raise_status


_ALL_POSITIONS = 2**63 - 1  # guide_limit when every position is guided (cfg_interval = -1)


def block_size(vocab_size: int) -> int:
    """Vocabulary tile of the kernels: a power of two in ``[16, 2048]``."""
    return max(16, min(2048, 1 << max(vocab_size - 1, 1).bit_length()))


def _kernels():
    from vispec.kernels import verify_triton

    return verify_triton


class Target:
    """``T`` rows of the processed target ``p`` (module docstring).

    Args:
        cond: ``[T, V]`` conditional logits (fp32, bf16, fp16 or fp64; the vocabulary dimension contiguous).
        uncond: ``[T, V]`` unconditional logits, needed when ``sampling.guidance_scale != 1``.
        positions: ``[T]`` the image-token index each row predicts (guidance interval, processors, noise keys).
        row_sample: ``[T]`` the sample each row belongs to, ``-1`` for padding rows.
        seeds: ``[B]`` int64 per-sample seeds (:func:`vispec.kernels.philox.per_sample_seeds`).
        sampling: temperature, top-k, top-p and guidance.
        processors: per-position logits processors (applied in PyTorch before the kernels).
        backend: ``"auto"``, ``"triton"`` or ``"reference"``.
        block: vocabulary tile of the kernels (default :func:`block_size`).
        validate: check index arguments against their ranges (token ids, row indices) and raise on NaN
            logits at once. Each check reads a value back from the device; decoders that build the
            indices themselves turn it off, and check :attr:`status` once per step instead
            (:meth:`check_status`). Kernels do not bounds-check these indices.
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
        if cond.dim() != 2:
            raise ValueError(f"cond must be [rows, vocab], got shape {tuple(cond.shape)}")
        rows, vocab = cond.shape
        if uncond is not None and uncond.shape != cond.shape:
            raise ValueError(f"uncond must have shape {tuple(cond.shape)}, got {tuple(uncond.shape)}")
        self.positions = as_long(positions, "positions", (rows,))
        self.row_sample = as_long(row_sample, "row_sample", (rows,))
        if seeds.dim() != 1:
            raise ValueError(f"seeds must be [batch], got shape {tuple(seeds.shape)}")
        if validate and rows and int(self.row_sample.max()) >= seeds.shape[0]:
            raise ValueError(f"row_sample refers to sample {int(self.row_sample.max())} but seeds has {seeds.shape[0]} entries")
        self.seeds = seeds if seeds.dtype == torch.int64 and seeds.is_contiguous() else seeds.to(torch.int64).contiguous()
        self.sampling, self.vocab, self.validate = sampling, vocab, validate
        self.backend = resolve_backend(backend, cond)
        self.block = block or block_size(vocab)
        if self.block < 4 or self.block & (self.block - 1):
            raise ValueError(f"block must be a power of two >= 4, got {self.block}")
        sampling.check_vocab(vocab)
        self._row_stats: Optional[tuple[Tensor, Tensor, Tensor]] = None  # row_stats(), once computed
        self.logit_rows: Optional[LogitRows] = None
        # the rows' problems on the device (vispec.sampling.STATUS_*), reduced only when :attr:`status` is read
        self._status: Optional[Tensor] = None
        if self.backend == "reference":
            probs, status = process_logits_status(cond[None], None if uncond is None else uncond[None], self.positions[None],
                                                  sampling, processors)
            self.probs: Optional[Tensor] = probs[0]
            self._raise_status(status)
            return
        self.probs = None
        self.logit_rows = self._logit_rows(cond, uncond, processors)
        if not sampling.greedy and ((0 < sampling.top_k < vocab) or sampling.top_p < 1.0):
            self.logit_rows.tau = _kernels().launch_threshold(self.logit_rows)

    def _logit_rows(self, cond: Tensor, uncond: Optional[Tensor], processors: tuple[PositionProcessor, ...]) -> LogitRows:
        """What the kernels read: guidance and processors are applied here in PyTorch when there are processors."""
        sampling = self.sampling
        positions = self.positions[None] if processors or (sampling.uses_guidance and uncond is None) else None
        if processors:
            cond = guided_logits(cond[None].float(), None if uncond is None else uncond[None].float(), positions, sampling)
            for processor in processors:
                cond = processor(cond, positions)
            cond, uncond = cond[0], None
        if uncond is not None and not sampling.uses_guidance:
            uncond = None
        if sampling.uses_guidance and uncond is None and not processors:
            guided_logits(cond[None], None, positions, sampling)  # raises the missing-branch error
        # the kernels guide a row whose position is <= guide_limit (vispec.sampling.guided_logits' cfg_interval)
        guide_limit = sampling.cfg_interval + 1 if sampling.cfg_interval >= 0 else _ALL_POSITIONS
        contiguous = lambda x: None if x is None else (x if x.stride(-1) == 1 else x.contiguous())  # noqa: E731
        return LogitRows(contiguous(cond), contiguous(uncond), guide_limit, float(sampling.guidance_scale),
                         1.0 if sampling.greedy else float(sampling.temperature), sampling.greedy, sampling.top_k,
                         sampling.top_p, None, self.positions, self.row_sample, self.seeds, self.block)

    # ---- noise and probabilities ---------------------------------------------------------------

    @property
    def num_rows(self) -> int:
        return int(self.positions.shape[0])

    @property
    def device(self) -> torch.device:
        return self.positions.device

    def _row_seeds(self, rows: Optional[Tensor] = None) -> Tensor:
        owner = self.row_sample.clamp_min(0)
        return self.seeds[owner if rows is None else owner[rows]]

    def accept_uniforms(self, draws: Tensor) -> Tensor:
        """``[T]`` the acceptance uniforms the test uses: Philox keyed by (seed, position, ACCEPT, ``draws``)."""
        return race.uniforms_for(self._row_seeds(), self.positions, torch.full_like(self.positions, int(Stream.ACCEPT)),
                                 draws.to(torch.int64))

    def race_noise(self, rows: Tensor, stream: Tensor, draws: Tensor) -> Tensor:
        """``[len(rows), V]`` Exp(1) race noise of ``rows``, keyed by (seed, position, ``stream``, ``draws``)."""
        return race.exponentials_for(self._row_seeds(rows), self.positions[rows], stream, draws, self.vocab)

    def probabilities(self) -> Tensor:
        """``[T, V]`` rows of ``p`` (padding rows zero on the Triton backend). The reference holds them; the
        Triton backend writes them once, on demand (relaxed acceptance rules work on probability rows)."""
        if self.probs is None:
            out = torch.zeros(self.num_rows, self.vocab, dtype=torch.float32, device=self.device)
            rows = torch.arange(self.num_rows, device=self.device)
            self.sample(SampleRequest(store_rows=torch.where(self.row_sample >= 0, rows, torch.full_like(rows, -1)), store_out=out))
            self.probs = out
        return self.probs

    @property
    def status(self) -> Tensor:
        """int64 scalar on the device: the worst problem the operations so far saw (``vispec.sampling.STATUS_*``),
        for the caller's synchronisation point (:meth:`check_status`, or a decoder's one read-back per step).

        The kernels' per-row status is a function of the rows alone (NaN logits, no mass left after top-k/top-p),
        the same in every pass over them, so the first one is kept and reduced here, not in each operation."""
        status = self._status
        if status is None or not status.numel():
            return torch.zeros((), dtype=torch.int64, device=self.device)
        return status.max().to(torch.int64)

    def _raise_status(self, status: Tensor) -> None:
        """Raise on a bad status now (``validate``); keep it for :attr:`status` (no device work)."""
        if self.validate:
            raise_status(status)
        if self._status is None:
            self._status = status

    def check_status(self) -> None:
        """Raise if any operation so far saw NaN logits or a position with no token left (one read-back)."""
        raise_status(self.status)

    def row_stats(self) -> tuple[Tensor, Tensor, Tensor]:
        """Triton backend: ``(m, s, amax)`` per row, the running maximum and normaliser of the processed logits
        (``p_v = exp(w_v - m) / s``) and their arg-max (greedy rows): what :meth:`sample`'s kernel needs.

        A function of the rows alone (not of drafts or noise), computed once: by the acceptance kernel, which
        yields them in the same pass (:meth:`accept`), or here by that kernel without drafts. Either way
        the values are the same, so the order of :meth:`accept` and :meth:`sample` calls does not matter."""
        if self._row_stats is None:
            _, stats, status = _kernels().launch_accept(self.logit_rows, Drafts.none(self.num_rows, self.device),
                                                       torch.zeros_like(self.positions), None)
            self._raise_status(status)
            self._keep_row_stats(stats)
        return self._row_stats

    def _keep_row_stats(self, stats: tuple[Tensor, Tensor, Tensor]) -> None:
        if self._row_stats is None:
            self._row_stats = stats

    # ---- operations ----------------------------------------------------------------------------

    def accept(self, drafts: Drafts, draws: Optional[Tensor] = None, uniforms: Optional[Tensor] = None) -> Tensor:
        """``[T]`` bool: the exact speculative test ``u q(d) < p(d)`` on rows with a draft.

        ``u`` is :meth:`accept_uniforms` of ``draws [T]`` (zeros when omitted), or ``uniforms [T]`` when given."""
        drafts = drafts.checked(self.num_rows, self.vocab, self.validate)
        draws = torch.zeros_like(self.positions) if draws is None else as_long(draws, "draws", (self.num_rows,))
        if uniforms is not None and tuple(uniforms.shape) != (self.num_rows,):
            raise ValueError(f"uniforms must have shape ({self.num_rows},), got {tuple(uniforms.shape)}")
        if self.backend == "triton":
            accepted, stats, status = _kernels().launch_accept(self.logit_rows, drafts, draws, uniforms)
            self._raise_status(status)
            self._keep_row_stats(stats)  # the fused pass computed them: row_stats() need not run it again
            return accepted
        real = (drafts.tokens >= 0) & (self.row_sample >= 0)
        return verify.accept_reference(self.probs, drafts, self.accept_uniforms(draws) if uniforms is None else uniforms, real)

    def first_rejection(self, accepted: Tensor, row_start: Tensor, num_drafts: Tensor, width: Optional[int] = None) -> Tensor:
        """``[B]`` leading accepted rows among ``row_start[b] .. row_start[b] + num_drafts[b] - 1``.

        ``width``: a bound on ``num_drafts`` known on the host (else it is read back from the device)."""
        if tuple(accepted.shape) != (self.num_rows,):
            raise ValueError(f"accepted must have shape ({self.num_rows},), got {tuple(accepted.shape)}")
        batch = num_drafts.shape[0] if num_drafts.dim() == 1 else -1
        row_start = as_long(row_start, "row_start", (batch,))
        num_drafts = as_long(num_drafts, "num_drafts", (batch,))
        if self.validate and batch and (int((row_start + num_drafts).max()) > self.num_rows or int(num_drafts.min()) < 0
                                        or int(row_start.min()) < 0):
            raise ValueError(f"row_start + num_drafts must describe rows inside [0, {self.num_rows}] with num_drafts >= 0")
        if self.backend == "triton":
            return _kernels().launch_first_rejection(accepted, row_start, num_drafts)
        return verify.first_rejection_reference(accepted, row_start, num_drafts, width)

    def sample(self, request: SampleRequest, drafts: Optional[Drafts] = None) -> tuple[Tensor, Tensor]:
        """``(residual_tokens [T], fresh_tokens [T])``, -1 on rows not asked for (:class:`SampleRequest`)."""
        wants_residual, wants_fresh = request.residual is not None, request.fresh is not None
        triton = self.backend == "triton"
        request = request.checked(self.num_rows, self.vocab, self.device, self.validate, stream_rows=not triton)
        if drafts is None:
            if wants_residual and self.validate and bool(request.residual.any()):
                raise ValueError("residual rows need drafts")
            drafts = Drafts.none(self.num_rows, self.device)
        drafts = drafts.checked(self.num_rows, self.vocab, self.validate)
        if triton:  # the kernel skips padding rows and residuals of rows without a draft itself
            return _kernels().launch_sample(self.logit_rows, self.row_stats(), request, drafts)
        request.residual = request.residual & (self.row_sample >= 0) & (drafts.tokens >= 0)
        request.fresh = request.fresh & (self.row_sample >= 0)
        race = (noise_race(request.noise.residual, request.noise.fresh) if request.noise is not None
                else self._keyed_race(request))
        tokens = verify.sample_reference(self.probs, request.residual if wants_residual else None,
                                         request.fresh if wants_fresh else None, drafts, race)
        if request.store_rows is not None:
            self._store(request.store_rows, request.store_out)
        return tokens

    def _keyed_race(self, request: SampleRequest) -> verify.RaceFn:
        """Races with every row's Philox noise: RESIDUAL keyed by ``residual_draws``, the fresh stream by ``fresh_draws``."""
        def keyed(weights: Tensor, kind: str) -> Tensor:
            if kind == "residual":
                stream, draws = torch.full_like(self.positions, int(Stream.RESIDUAL)), request.residual_draws
            else:
                stream, draws = request.fresh_stream, request.fresh_draws
            return race.race(weights, self._row_seeds(), self.positions, stream, draws)
        return keyed

    def _store(self, store_rows: Tensor, store_out: Tensor) -> None:
        """``store_out[store_rows[t]] = p_t`` for real rows with ``store_rows[t] >= 0``, without a read-back: the
        other rows go to a scratch row past the end (the kept indices are distinct)."""
        keep = (store_rows >= 0) & (self.row_sample >= 0)
        scratch = torch.cat([store_out, store_out.new_zeros(1, store_out.shape[1])])
        scratch.index_copy_(0, torch.where(keep, store_rows, store_out.shape[0]), self.probs.to(store_out.dtype))
        store_out.copy_(scratch[:-1])


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
    owner = torch.arange(batch, device=cond.device)[:, None]
    row_sample = torch.where(slots < num_rows.to(cond.device)[:, None], owner, -1)
    flat = lambda x: None if x is None else x.reshape(batch * width, vocab)  # noqa: E731
    return Target(flat(cond), flat(uncond), positions.reshape(-1), row_sample.reshape(-1), seeds, sampling, processors,
                  backend=backend, block=block, validate=validate)
