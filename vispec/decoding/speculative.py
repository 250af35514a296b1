"""The pieces every speculative decoder shares: a ragged batch and one verification of a window.

* :class:`RaggedBatch` owns the active samples of a decode, each at its own pace: their ids in the
  caller's batch, tokens by absolute position, committed counts, forward passes (NFE), accepted
  drafts, seeds and model caches, plus decoder state carried along (:attr:`RaggedBatch.state`).
  :meth:`~RaggedBatch.compact` lets finished samples leave; their outputs are kept in the caller's
  batch order.
* :func:`verify_window` verifies every sample's window of drafts against one target forward
  (Leviathan et al. 2023; SJD, arXiv 2410.01699; MC-SJD, arXiv 2510.24211). For sample ``b`` with
  ``D_b`` drafts, row ``j`` of the window is the target ``P_j`` that verifies draft ``d_{j+1}``
  (``j < D_b``); row ``D_b`` gives the bonus token. Steps: accept (:mod:`vispec.decoding.acceptance`)
  → measure the TV of lossy rules → first rejection ``m`` → residual and fresh samples
  (:class:`Coupling`) → the committed token ``x_{m+1}``: the residual sample at the first rejection, or
  the bonus sample when every draft was accepted.

Layout: windows are padded to the widest sample, ``[B, W]``; row ``b W + j`` of the
:class:`~vispec.kernels.target.Target` is sample ``b``'s window row ``j``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor

from vispec.decoding.acceptance import AcceptanceRule, TVTracker
from vispec.decoding.common import DecodeStart
from vispec.kernels.philox import Stream
from vispec.kernels.target import Target
from vispec.kernels.verify import Drafts, SampleRequest
from vispec.outputs import DecodeOutput, DecodeProgress, DecodeStats, StepCallback, committed_view


@dataclass(frozen=True)
class Coupling:
    """What a verification samples besides the accepted drafts.

    * ``every_rejection``: every rejected draft row gets its residual sample (MC-SJD's maximal
      coupling: row ``j``'s coupled output is distributed as ``P_j`` and becomes the next draft for its
      position); otherwise only the first rejection does;
    * ``fresh``: which rows sample ``P`` itself: ``"tail"``, every row from the first output not yet
      decided on (the bonus token and the next Jacobi drafts); ``"last"``, the window's last row (it
      has no old draft to couple with); ``"bonus"``, the bonus row only, when every draft was accepted;
    * ``fixed_noise``: fresh rows use the GUMBEL stream with draw 0, the same noise for a position
      over the whole decode (MC-SJD's Gumbel coupling), instead of SAMPLE keyed by the pass.
    """

    every_rejection: bool
    fresh: str
    fixed_noise: bool = False


JACOBI = Coupling(every_rejection=False, fresh="tail")
MAXIMAL = Coupling(every_rejection=True, fresh="last")
GUMBEL = Coupling(every_rejection=False, fresh="tail", fixed_noise=True)
DRAFT_MODEL = Coupling(every_rejection=False, fresh="bonus")


@dataclass
class Verified:
    """The result of :func:`verify_window` (``[B, W]`` unless noted; -1 where nothing was sampled)."""

    accepted: Tensor  # bool: row j's draft d_{j+1} was kept
    num_accepted: Tensor  # [B] m: leading accepted drafts
    coupled: Tensor  # the draft where accepted, else the residual sample
    fresh: Tensor  # samples from P itself
    next_token: Tensor  # [B] x_{m+1}: the residual sample at the first rejection, or the bonus sample


def verify_window(
    target: Target,
    rule: AcceptanceRule,
    drafts: Tensor,
    num_drafts: Tensor,
    width: Tensor,
    draws: Tensor,
    coupling: Coupling,
    *,
    q: Optional[Tensor] = None,
    q_dense: Optional[Tensor] = None,
    store_q: Optional[Tensor] = None,
    tv: Optional[TVTracker] = None,
    ids: Optional[Tensor] = None,
) -> Verified:
    """Verify a padded batch of windows in one go (module docstring).

    Args:
        target: ``B W`` rows, sample ``b``'s window rows first (:func:`vispec.kernels.target.window_target`).
        rule: the acceptance rule.
        drafts: ``[B, W]`` the draft row ``j`` verifies (-1 from slot ``num_drafts[b]`` on).
        num_drafts: ``[B]`` ``D_b``; ``width``: ``[B]`` rows of sample ``b``'s window (``>= D_b + 1``).
        draws: ``[B]`` the noise draw counter of this pass (the sample's NFE).
        coupling: what else is sampled (:class:`Coupling`).
        q: ``[B, Wq, V]`` dense draft distributions; row ``j`` uses ``q[b, j]`` where ``q_dense[b, j]``,
            else its draft is one-hot (an initialised draft).
        store_q: ``[B, Wq, V]``: the ``P`` rows after the first rejection are written here, row ``j``
            at ``[b, j - m - 1]`` (they become the next pass's draft distributions).
        tv, ids: with a lossy rule, its measured TV per sample (``ids``: the samples' batch ids).
    """
    batch, slots = drafts.shape
    slot = torch.arange(slots, device=drafts.device)
    sample = torch.arange(batch, device=drafts.device)[:, None]
    flat_draws = draws[:, None].expand(-1, slots).reshape(-1)
    dense_rows = None
    if q is not None:
        q_width = q.shape[1]
        dense_rows = torch.where(q_dense, sample * q_width + slot.clamp(max=q_width - 1), torch.full_like(drafts, -1))
    row_drafts = Drafts(drafts.reshape(-1), None if q is None else q.reshape(-1, q.shape[-1]),
                        None if dense_rows is None else dense_rows.reshape(-1))

    accepted = rule.accept_drafts(target, row_drafts, flat_draws).view(batch, slots)
    if tv is not None:
        tv.measure(target, rule, ids, num_drafts, slots, row_drafts)
    m = target.first_rejection(accepted.reshape(-1), sample[:, 0] * slots, num_drafts)

    is_draft = slot[None, :] < num_drafts[:, None]
    residual = is_draft & (~accepted if coupling.every_rejection else slot[None, :] == m[:, None])
    all_accepted = (m == num_drafts)[:, None]
    if coupling.fresh == "last":
        fresh = slot[None, :] == (width - 1)[:, None]
    elif coupling.fresh == "tail":
        fresh = (slot[None, :] >= torch.where(all_accepted[:, 0], m, m + 1)[:, None]) & (slot[None, :] < width[:, None])
    else:
        fresh = (slot[None, :] == num_drafts[:, None]) & all_accepted
    stream, fresh_draws = (Stream.GUMBEL, torch.zeros_like(flat_draws)) if coupling.fixed_noise else (Stream.SAMPLE, flat_draws)
    request = SampleRequest(residual=residual.reshape(-1), fresh=fresh.reshape(-1), residual_draws=flat_draws,
                            fresh_stream=stream, fresh_draws=fresh_draws)
    if store_q is not None:
        later = (slot[None, :] > m[:, None]) & (slot[None, :] < width[:, None])
        rows = torch.where(later, sample * store_q.shape[1] + slot[None, :] - m[:, None] - 1, torch.full_like(drafts, -1))
        request.store_rows, request.store_out = rows.reshape(-1), store_q.view(-1, store_q.shape[-1])
    residual_tokens, fresh_tokens = rule.sample(target, request, row_drafts)

    coupled = torch.where(accepted, drafts, residual_tokens.view(batch, slots))
    fresh_tokens = fresh_tokens.view(batch, slots)
    at = m[:, None]
    next_token = torch.where(all_accepted, fresh_tokens.gather(1, at), coupled.gather(1, at))[:, 0]
    return Verified(accepted, m, coupled, fresh_tokens, next_token)


class RaggedBatch:
    """The active samples of a decode (module docstring).

    Args:
        start: the prefilled decode (:func:`vispec.decoding.common.start_decoding`).
        num_tokens: ``N`` tokens per sample; ``room``: extra token slots past ``N`` (drafts of a window).
        first: ``[B]`` token 0 of each sample (from the prefill's logits).
        caches: model caches compacted with the batch, e.g. ``{"target": (model, state)}``.
        state: decoder tensors with the batch as first dimension, compacted with it.
        reported: names in ``state`` of per-sample counters reported in ``stats.extra``.
    """

    def __init__(self, start: DecodeStart, num_tokens: int, room: int, first: Tensor, caches: dict[str, tuple[Any, Any]],
                 state: Optional[dict[str, Tensor]] = None, reported: tuple[str, ...] = ()):
        batch, device = start.batch, start.device
        self.num_tokens, self.clock, self.reported = num_tokens, start.clock, reported
        self.ids = torch.arange(batch, device=device)
        self.tokens = torch.zeros(batch, num_tokens + room, dtype=torch.long, device=device)  # by absolute position
        self.tokens[:, 0] = first
        self.n = torch.ones(batch, dtype=torch.long, device=device)  # committed tokens
        self.nfe = torch.ones(batch, dtype=torch.long, device=device)  # forward passes (the prefill included)
        self.accepted = torch.zeros(batch, dtype=torch.long, device=device)
        self.seeds = start.seeds
        self.caches = dict(caches)
        self.state = dict(state or {})
        self.step = 0
        # outputs, in the caller's batch order
        self._tokens = torch.zeros(batch, num_tokens, dtype=torch.long, device=device)
        self._nfe = torch.ones(batch, dtype=torch.long)
        self._accepted = torch.zeros(batch, dtype=torch.long)
        self._latency = torch.zeros(batch, dtype=torch.float64)
        self._extra = {name: torch.zeros(batch, dtype=torch.long) for name in reported}
        self._committed = torch.ones(batch, dtype=torch.long, device=device)

    def cache(self, name: str = "target") -> Any:
        """The cache state of model ``name``."""
        return self.caches[name][1]

    def compact(self) -> bool:
        """Store the finished samples' outputs and drop them (and their cache rows); False once none is left."""
        finished = self.n >= self.num_tokens
        if not bool(finished.any()):
            return True
        done = finished.nonzero().squeeze(1)
        at = self.ids[done]
        self._tokens[at] = self.tokens[done, : self.num_tokens]
        cpu, now = at.cpu(), self.clock.now()
        self._nfe[cpu], self._accepted[cpu], self._latency[cpu] = self.nfe[done].cpu(), self.accepted[done].cpu(), now
        for name in self.reported:
            self._extra[name][cpu] = self.state[name][done].cpu()
        keep = (~finished).nonzero().squeeze(1)
        if keep.numel() == 0:
            return False
        self.caches = {name: (model, model.select(state, keep)) for name, (model, state) in self.caches.items()}
        self.ids, self.tokens, self.n, self.nfe, self.accepted, self.seeds = (
            t[keep] for t in (self.ids, self.tokens, self.n, self.nfe, self.accepted, self.seeds))
        self.state = {name: t[keep] for name, t in self.state.items()}
        return True

    def commit(self, verified: Verified) -> None:
        """Commit ``d_1 .. d_m`` (already in place) and ``x_{m+1}``; count the pass."""
        m = verified.num_accepted
        self.tokens.scatter_(1, (self.n + m)[:, None], verified.next_token[:, None])
        self.n = self.n + m + 1
        self.nfe = self.nfe + 1
        self.accepted = self.accepted + m
        self.step += 1

    def report(self, callback: Optional[StepCallback]) -> None:
        """Call ``callback`` with every sample's committed tokens (-1 where not committed yet)."""
        if callback is None:
            return
        self._committed[self.ids] = self.n
        tokens = self._tokens.clone()  # finished samples are already final there
        decided = torch.arange(self.num_tokens, device=self.tokens.device)[None, :] < self.n[:, None]
        tokens[self.ids] = committed_view(self.tokens[:, : self.num_tokens], decided)
        callback(DecodeProgress(self.step, self._committed.clone(), tokens))

    def output(self, method: str, tv: Optional[TVTracker]) -> DecodeOutput:
        """The decode's result in the caller's batch order (``tv``: the lossy rule's measured TV, if any)."""
        stats = DecodeStats(nfe=self._nfe, tokens=torch.full_like(self._nfe, self.num_tokens), latency_s=self._latency,
                            accepted_drafts=self._accepted, extra=dict(self._extra))
        if tv is not None:
            stats.tv_mean, stats.tv_max = tv.result()
        return DecodeOutput(tokens=self._tokens, stats=stats, method=method)
