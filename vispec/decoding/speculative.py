"""The pieces every speculative decoder shares: a ragged batch and one verification of a window.

* :class:`RaggedBatch` owns the batch slots of a decode, each sample at its own pace: their ids in
  the caller's batch, tokens by absolute position, committed counts, forward passes (NFE), accepted
  drafts, seeds and model caches, plus decoder state carried along (:attr:`RaggedBatch.state`).
  :meth:`~RaggedBatch.sync`, the step's one read-back, retires finished samples (outputs kept in the
  caller's batch order) and hands their slots to queued requests.
* :func:`verify_window` verifies every sample's window of drafts against one target forward
  (Leviathan et al. 2023; SJD, arXiv 2410.01699; MC-SJD, arXiv 2510.24211). For sample ``b`` with
  ``D_b`` drafts, row ``j`` of the window is the target ``P_j`` that verifies draft ``d_{j+1}``
  (``j < D_b``); row ``D_b`` gives the bonus token. Steps: accept (the exact rule by the target's
  kernels, :meth:`vispec.kernels.target.Target.accept`; a relaxed rule of :mod:`vispec.decoding.acceptance`
  on the dense probability rows)
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
from vispec.decoding.common import DecodeJob, DecodeStart, first_token, select_condition
from vispec.decoding.compiled import mark_persistent
from vispec.decoding.edits import edited_tokens, first_change, refeed
from vispec.kernels.philox import Stream
from vispec.kernels.target import Target
from vispec.kernels.verify import Drafts, SampleRequest
from vispec.outputs import DecodeOutput, DecodeProgress, DecodeStats, StepCallback, committed_view
from vispec.sampling import raise_status


@dataclass(frozen=True)
class Coupling:
    """What a verification samples besides the accepted drafts.

    * ``every_rejection``: every rejected draft row gets its residual sample (MC-SJD's maximal
      coupling: row ``j``'s coupled output is distributed as ``P_j`` and becomes the next draft for its
      position); otherwise only the first rejection does;
    * ``fresh``: which rows sample ``P`` itself: ``"tail"``, every row from the first output not yet
      decided on (the bonus token and the next Jacobi drafts); ``"last"``, the window's last row (it
      has no old draft to couple with); ``"bonus"``, the bonus row only, when every draft was accepted;
      ``"every"``, every row of the window (SJD-PAC's Gumbel main path: its tree decides where the path
      ends, and every row after it needs a draft even where this chain accepted);
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
    num_tokens: Optional[int] = None,
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
            at ``[b, j - m - 1]`` (they become the next pass's draft distributions; under maximal coupling the
            budgeted rule stores a draft row's ``p̃``, the law of its coupled output).
        tv, ids: with a lossy rule, its measured TV per sample (``ids``: the samples' batch ids), and with the
            budgeted rule the budget each committed verification used.
        num_tokens: the image's length ``N`` (the budgeted rule's annealing along the image).
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

    # the exact rule goes straight to the target's kernels; a relaxed one works on its dense probability rows
    exact = rule.lossless
    if not exact:  # bound to this verification's rows (the budgeted rule's per-row budgets)
        rule = rule.for_verification(target, row_drafts, slot.expand(batch, slots).reshape(-1), num_tokens)
    accepted = (target.accept(row_drafts, flat_draws) if exact else rule.accept_drafts(target, row_drafts, flat_draws))
    accepted = accepted.view(batch, slots)
    if tv is not None:
        tv.measure(target, rule, ids, num_drafts, slots, row_drafts)
    m = target.first_rejection(accepted.reshape(-1), sample[:, 0] * slots, num_drafts, width=slots)

    is_draft = slot[None, :] < num_drafts[:, None]
    if tv is not None and hasattr(rule, "used"):  # the verifications that decide a token: rows 0 .. m
        tv.record_budget(ids, is_draft & (slot[None, :] <= m[:, None]), *(t.view(batch, slots) for t in rule.used(batch * slots)))
    residual = is_draft & (~accepted if coupling.every_rejection else slot[None, :] == m[:, None])
    all_accepted = (m == num_drafts)[:, None]
    if coupling.fresh == "last":
        fresh = slot[None, :] == (width - 1)[:, None]
    elif coupling.fresh == "tail":
        fresh = (slot[None, :] >= torch.where(all_accepted[:, 0], m, m + 1)[:, None]) & (slot[None, :] < width[:, None])
    elif coupling.fresh == "every":
        fresh = slot[None, :] < width[:, None]
    else:
        fresh = (slot[None, :] == num_drafts[:, None]) & all_accepted
    stream, fresh_draws = (Stream.GUMBEL, torch.zeros_like(flat_draws)) if coupling.fixed_noise else (Stream.SAMPLE, flat_draws)
    request = SampleRequest(residual=residual.reshape(-1), fresh=fresh.reshape(-1), residual_draws=flat_draws,
                            fresh_stream=stream, fresh_draws=fresh_draws)
    if store_q is not None:
        later = (slot[None, :] > m[:, None]) & (slot[None, :] < width[:, None])
        rows = torch.where(later, sample * store_q.shape[1] + slot[None, :] - m[:, None] - 1, torch.full_like(drafts, -1))
        request.store_rows, request.store_out = rows.reshape(-1), store_q.view(-1, store_q.shape[-1])
    residual_tokens, fresh_tokens = target.sample(request, row_drafts) if exact else rule.sample(target, request, row_drafts)
    if store_q is not None and coupling.every_rejection and hasattr(rule, "store_relaxed"):
        # a draft row's coupled output (the next draft) is distributed as p̃, not P: p̃ is the next pass's q
        rule.store_relaxed(torch.where(is_draft, rows, -1).reshape(-1), store_q.view(-1, store_q.shape[-1]))

    coupled = torch.where(accepted, drafts, residual_tokens.view(batch, slots))
    fresh_tokens = fresh_tokens.view(batch, slots)
    at = m[:, None]
    next_token = torch.where(all_accepted, fresh_tokens.gather(1, at), coupled.gather(1, at))[:, 0]
    return Verified(accepted, m, coupled, fresh_tokens, next_token)


class RaggedBatch:
    """The samples of a decode in a fixed set of batch slots (module docstring).

    Each slot holds one request at its own pace: its id in the caller's batch (``ids``), tokens by
    absolute position, committed count ``n``, forward passes (NFE), accepted drafts, seed, model
    caches and decoder state (:attr:`state`, zeroed when a slot takes a new request). Decoders run
    one static step on every slot and then call :meth:`sync`, the step's one read-back: it copies
    ``n`` to the host (:attr:`n_host`), raises a deferred status (NaN logits), stores finished
    requests' outputs and frees their slots. A freed slot takes the next queued request
    (continuous batching: ``refill`` writes its condition into that slot's cache rows, nothing is
    copied); with no request waiting, finished slots either leave the batch (``select``, when the
    batch may shrink) or idle, masked by :attr:`live` (``fixed=True``: compiled steps keep one shape).

    Args:
        start: the prefilled decode (:func:`vispec.decoding.common.start_decoding`).
        job: the decode's settings (sampling of token 0 for new requests).
        num_tokens: ``N`` tokens per sample; ``room``: extra token slots past ``N`` (drafts of a window).
        caches: model caches of the slots, e.g. ``{"target": (model, state)}``; the first one's prefill
            logits give token 0.
        state: decoder tensors with the slots as first dimension.
        reported: names in ``state`` of per-sample counters reported in ``stats.extra``.
        fixed: keep every slot (idle when nothing is queued) instead of dropping finished ones.
    """

    def __init__(self, start: DecodeStart, job: DecodeJob, num_tokens: int, room: int, caches: dict[str, tuple[Any, Any]],
                 state: Optional[dict[str, Tensor]] = None, reported: tuple[str, ...] = (), fixed: bool = False):
        slots, device, requests = start.batch, start.device, start.requests
        self.job, self.start, self.num_tokens, self.clock, self.reported = job, start, num_tokens, start.clock, reported
        self.fixed = fixed or requests > slots
        self.queued = slots  # the next request to start
        self.ids = torch.arange(slots, device=device)
        self.tokens = torch.zeros(slots, num_tokens + room, dtype=torch.long, device=device)  # by absolute position
        first, self.status = first_token(start.logits, start.seeds[:slots], job)
        self.tokens[:, 0] = first
        self.n = torch.ones(slots, dtype=torch.long, device=device)  # committed tokens
        self.nfe = torch.ones(slots, dtype=torch.long, device=device)  # forward passes (the prefill included)
        self.accepted = torch.zeros(slots, dtype=torch.long, device=device)
        self.commits = torch.zeros(slots, room + 2, dtype=torch.long, device=device)  # [b, k]: passes committing k
        self.seeds = start.seeds[:slots].clone()
        self.live = torch.ones(slots, dtype=torch.bool, device=device)
        self.caches = dict(caches)
        self.state = dict(state or {})
        self.step = 0
        self.probe_host: list[list[int]] = []
        self.n_host, self.ids_host = [1] * slots, list(range(slots))  # host mirrors (-1: idle slot)
        # outputs, in the caller's batch order (on the device until the end: storing them reads nothing back)
        self._tokens = torch.zeros(requests, num_tokens, dtype=torch.long, device=device)
        self._nfe = torch.ones(requests, dtype=torch.long, device=device)
        self._accepted = torch.zeros(requests, dtype=torch.long, device=device)
        self._commits = torch.zeros(requests, room + 2, dtype=torch.long, device=device)
        self._latency = torch.zeros(requests, dtype=torch.float64)
        self._extra = {name: torch.zeros(requests, dtype=torch.long, device=device) for name in reported}
        self._committed = torch.ones(requests, dtype=torch.long, device=device)
        self._mark_persistent()
        self._retire()

    def _mark_persistent(self) -> None:
        """Within CUDA graphs: the buffers steps write in place (tokens, commit counts, model caches) are static
        inputs (:func:`vispec.decoding.compiled.mark_persistent`); ``n``, ``nfe``, ``accepted`` and :attr:`state`
        are made anew by every step."""
        mark_persistent(self.tokens, self.commits, *(state for _, state in self.caches.values()))

    def own_graph_outputs(self) -> None:
        """After a step run as a CUDA graph: the tensors steps make anew (``n``, ``nfe``, ``accepted``, :attr:`state`)
        become copies of their own, outside the graph's output pool, which a later replay may overwrite
        (:func:`vispec.decoding.compiled.own_graph_outputs`). The persistent buffers are written in place and stay."""
        self.n, self.nfe, self.accepted = self.n.clone(), self.nfe.clone(), self.accepted.clone()
        self.state = {name: value.clone() if isinstance(value, Tensor) else value for name, value in self.state.items()}

    # ---- host-side view -------------------------------------------------------------------------

    @property
    def running(self) -> bool:
        return any(i >= 0 for i in self.ids_host)

    def widths(self, window: int) -> int:
        """The widest window any live slot needs: ``min(window, N - n)`` over live slots."""
        return max(min(window, self.num_tokens - n) for n, i in zip(self.n_host, self.ids_host) if i >= 0)

    def longest(self) -> int:
        """The most image tokens any live slot has cached (``n - 1``: the newest is fed by the next window)."""
        return max(n - 1 for n, i in zip(self.n_host, self.ids_host) if i >= 0)

    def remaining(self) -> int:
        """Tokens the batch still has to commit in its slowest slot: the most any live slot lacks, or a whole
        image while requests wait for a slot."""
        if self.queued < self.start.requests:
            return self.num_tokens
        return max(self.num_tokens - n for n, i in zip(self.n_host, self.ids_host) if i >= 0)

    @property
    def live_count(self) -> int:
        return sum(i >= 0 for i in self.ids_host)

    def cache(self, name: str = "target") -> Any:
        """The cache state of model ``name``."""
        return self.caches[name][1]

    # ---- the step's one read-back ------------------------------------------------------------------

    def commit(self, num_accepted: Tensor, next_token: Tensor) -> None:
        """Commit ``d_1 .. d_m`` (already in place, ``m = num_accepted [B]``) and ``x_{m+1} = next_token [B]`` on
        live slots; count the pass."""
        m = torch.where(self.live, num_accepted, 0)
        at = (self.n + m)[:, None]
        # Idle slots keep what their buffer holds: a step samples nothing for them (-1, e.g. the one-row pass),
        # and a later, wider window still reads their positions past N as padding. The buffer so holds only
        # token ids in [0, V), and no gather or embedding of a padded row can see an out-of-range index.
        self.tokens.scatter_(1, at, torch.where(self.live[:, None], next_token[:, None], self.tokens.gather(1, at)))
        self.n = self.n + (m + 1) * self.live
        self.nfe = self.nfe + self.live
        self.accepted = self.accepted + m
        self.commits.scatter_add_(1, (m + 1)[:, None], self.live[:, None].long())

    def sync(self, status: Optional[Tensor] = None, probe: Optional[Tensor] = None) -> list[int]:
        """The step's one read-back: committed counts (and the step's status) to the host; then finished
        requests leave their slots. Returns the committed counts by slot as they were before that.
        ``probe``: an integer ``[slots, k]`` tensor read back in the same transfer, kept as :attr:`probe_host` (one
        list per slot, before finished requests leave)."""
        if status is not None:
            self.status = torch.maximum(self.status, status)
        parts = [self.n, self.status.view(1)] + ([] if probe is None else [probe.reshape(-1).to(self.n.dtype)])
        values = torch.cat(parts).tolist()
        slots = self.n.shape[0]
        raise_status(int(values[slots]))
        if probe is not None:
            width = probe.shape[1]
            self.probe_host = [values[slots + 1 + b * width: slots + 1 + (b + 1) * width] for b in range(slots)]
        values = values[: slots + 1]
        self.n_host = values[:-1]
        self.step += 1
        after = list(self.n_host)
        self._retire()
        return after

    def finishing_next(self) -> bool:
        """Whether a live sample would reach ``N`` tokens by committing one more."""
        return any(i >= 0 and n + 1 >= self.num_tokens for n, i in zip(self.n_host, self.ids_host))

    def advance(self, status: Optional[Tensor] = None) -> list[int]:
        """:meth:`sync` for a pass in which every live slot committed exactly one token (window 1) and none
        finished (:meth:`finishing_next` was False): the host mirrors advance without a read-back; a
        status is kept on the device and raised at the next :meth:`sync`."""
        if status is not None:
            self.status = torch.maximum(self.status, status)
        self.n_host = [n + 1 if i >= 0 else n for n, i in zip(self.n_host, self.ids_host)]
        self.step += 1
        return list(self.n_host)

    def _retire(self) -> None:
        done = [b for b, (n, i) in enumerate(zip(self.n_host, self.ids_host)) if i >= 0 and n >= self.num_tokens]
        if not done:
            return
        device = self.n.device
        slots = torch.tensor(done, dtype=torch.long, device=device)
        finished = [self.ids_host[b] for b in done]
        at = torch.tensor(finished, dtype=torch.long, device=device)
        self._tokens[at] = self.tokens[slots, : self.num_tokens]
        self._nfe[at], self._accepted[at], self._commits[at] = self.nfe[slots], self.accepted[slots], self.commits[slots]
        self._committed[at] = self.num_tokens
        self._latency[torch.tensor(finished, dtype=torch.long)] = self.clock.now()
        for name in self.reported:
            self._extra[name][at] = self.state[name][slots]
        waiting = min(len(done), self.start.requests - self.queued)
        if waiting:
            self._refill(done[:waiting])
            done = done[waiting:]
        if not done:
            return
        for b in done:
            self.ids_host[b] = -1
        if self.fixed:
            self.live[torch.tensor(done, dtype=torch.long, device=device)] = False
            return
        keep = [b for b, i in enumerate(self.ids_host) if i >= 0]
        if keep:
            self._select(keep)

    def _refill(self, slots_list: list[int]) -> None:
        """Start the next queued requests in ``slots_list`` (their cache rows are overwritten, not copied)."""
        device = self.n.device
        slots = torch.tensor(slots_list, dtype=torch.long, device=device)
        requests = torch.arange(self.queued, self.queued + len(slots_list), device=device)
        condition = select_condition(self.start.condition, torch.arange(self.queued, self.queued + len(slots_list)))
        logits = None
        for model, state in self.caches.values():
            out = model.refill(state, slots, condition)
            logits = out if logits is None else logits
        seeds = self.start.seeds[requests]
        first, status = first_token(logits, seeds, self.job)
        self.status = torch.maximum(self.status, status)
        self.tokens[slots] = 0
        self.tokens[slots, 0] = first
        self.n[slots], self.nfe[slots], self.accepted[slots], self.commits[slots] = 1, 1, 0, 0
        self.seeds[slots], self.ids[slots] = seeds, requests
        for tensor in self.state.values():
            tensor[slots] = 0
        for b, request in zip(slots_list, range(self.queued, self.queued + len(slots_list))):
            self.n_host[b], self.ids_host[b] = 1, request
        self.queued += len(slots_list)

    def _select(self, keep_list: list[int]) -> None:
        """Drop every slot not in ``keep_list`` (and its cache rows)."""
        keep = torch.tensor(keep_list, dtype=torch.long, device=self.n.device)
        self.caches = {name: (model, model.select(state, keep)) for name, (model, state) in self.caches.items()}
        self.ids, self.tokens, self.n, self.nfe, self.accepted, self.commits, self.seeds, self.live = (
            t[keep] for t in (self.ids, self.tokens, self.n, self.nfe, self.accepted, self.commits, self.seeds, self.live))
        self.state = {name: t[keep] for name, t in self.state.items()}
        self._mark_persistent()  # new buffers (and a new shape: new graphs)
        self.n_host = [self.n_host[b] for b in keep_list]
        self.ids_host = [self.ids_host[b] for b in keep_list]

    # ---- reporting ---------------------------------------------------------------------------------

    def report(self, callback: Optional[StepCallback]) -> Optional[Tensor]:
        """Call ``callback`` with every sample's committed tokens (-1 where not committed yet) and apply the
        committed tokens it may return (:mod:`vispec.decoding.edits`). Returns each slot's first changed
        position (``N`` where none changed; the decoder drops what it built on the old tokens), None if
        nothing changed."""
        if callback is None:
            return None
        live = [b for b, i in enumerate(self.ids_host) if i >= 0]
        slots = torch.tensor(live, dtype=torch.long, device=self.n.device)
        ids = torch.tensor([self.ids_host[b] for b in live], dtype=torch.long, device=self.n.device)
        self._committed[ids] = self.n[slots]
        tokens = self._tokens.clone()  # finished samples are already final there
        decided = torch.arange(self.num_tokens, device=self.tokens.device)[None, :] < self.n[slots][:, None]
        tokens[ids] = committed_view(self.tokens[slots, : self.num_tokens], decided)
        not_started = torch.arange(self.start.requests, device=self.n.device) >= self.queued
        tokens[not_started] = committed_view(tokens[not_started], torch.zeros_like(tokens[not_started], dtype=torch.bool))
        committed = torch.where(not_started, 0, self._committed)
        edit = edited_tokens(callback(DecodeProgress(self.step, committed, tokens)), tokens, self.start.vocab)
        return None if edit is None else self._rewrite(edit, tokens, slots, ids)

    def _rewrite(self, edit: Tensor, given: Tensor, slots: Tensor, ids: Tensor) -> Tensor:
        """Apply edited committed tokens (:mod:`vispec.decoding.edits`): finished requests' outputs are replaced;
        live slots get the tokens and the target cache is rewound and fed again from each slot's first
        change. Returns each slot's first changed position (``N`` where none changed)."""
        finished = ~torch.isin(torch.arange(self.start.requests, device=edit.device), ids) & (given[:, 0] >= 0)
        self._tokens[finished] = edit[finished]
        first = torch.full_like(self.n, self.num_tokens)
        first[slots] = first_change(edit[ids], given[ids])
        span = self.tokens[slots, : self.num_tokens]
        self.tokens[slots, : self.num_tokens] = torch.where(edit[ids] >= 0, edit[ids], span)
        cached = self.n - 1
        keep = torch.minimum(first, cached)
        model, state = self.caches["target"]
        refeed(model, state, self.tokens, cached, keep)
        return first

    def output(self, method: str, tv: Optional[TVTracker]) -> DecodeOutput:
        """The decode's result in the caller's batch order (``tv``: the lossy rule's measured TV, if any)."""
        nfe = self._nfe.cpu()
        stats = DecodeStats(nfe=nfe, tokens=torch.full_like(nfe, self.num_tokens), latency_s=self._latency,
                            accepted_drafts=self._accepted.cpu(), extra={k: v.cpu() for k, v in self._extra.items()},
                            commits=self._commits.cpu())
        if tv is not None:
            stats.tv_mean, stats.tv_max = tv.result()
            stats.extra.update(tv.budget_result())
        return DecodeOutput(tokens=self._tokens, stats=stats, method=method)
