"""Speculative Jacobi Decoding and its coupled variants, over a ragged batch.

SJD (Teng et al., ICLR 2025, arXiv 2410.01699). Each sample keeps ``n`` committed tokens, of
which the newest (``z``, position ``n - 1``) is not yet in the KV cache, plus drafts at positions
``n, n+1, ...`` with stored draft distributions ``q``. One pass:

1. fill the window ``[z, d_1 .. d_{W-1}]`` (``W = min(L, N - n)``); missing drafts are initialised
   (:mod:`vispec.decoding.drafts`) with one-hot ``q``;
2. one forward; output ``j`` gives the processed target ``P_j`` for position ``n + j``;
3. verify draft ``d_j`` against ``P_{j-1}`` for all ``j`` at once (:func:`vispec.decoding.speculative.verify_window`):
   accept with ``min(1, P(d)/q(d))``; ``m`` = number of leading accepted drafts;
4. commit ``d_1 .. d_m`` and then the residual sample at the first rejection, or the bonus sample
   from ``P_{W-1}`` when every draft was accepted: ``m + 1`` tokens per pass;
5. keep the KV of ``z, d_1 .. d_m`` (rollback of the rest, per sample);
6. the unverified tail becomes the next drafts: position ``n + j`` (``j > m``) gets a token drawn
   from ``P_j`` and stores ``q := P_j``. With ``init="source"`` and no coupling (``"iad"``: input-guided
   aggressive decoding, Ge et al., arXiv 2205.10350) the tail is dropped instead and drafted from the
   source image again, as IAD re-copies the input after each rejection.

Step 6 is where the variants differ (MC-SJD, So et al., arXiv 2510.24211):

* ``sjd`` (coupling ``none``): a fresh independent sample ``y_j ~ P_j``;
* ``mc-sjd`` coupling ``maximal``: every draft slot is verified (no stop at the first rejection);
  slot ``j+1``'s coupled output (the kept draft, or its residual sample) is distributed as ``P_j``
  and becomes the draft for position ``n + j``, so a draft survives re-drafting with probability
  ``1 - TV(P_j, q)``, the largest possible; the last output ``P_{W-1}`` has no old draft and gives a
  fresh sample;
* ``mc-sjd`` coupling ``gumbel``: ``y_j = argmax_v log P_j(v) + g_{pos}(v)`` with Gumbel noise ``g``
  fixed per (sample, absolute position) for the whole decode, so a draft stays unchanged whenever
  its arg-max is stable under the new context. Verification uniforms stay fresh per pass.

All three are exact: every committed token is distributed as ``p(. | committed prefix)``
(tests/exactness/test_exactness.py checks the joint distribution against enumeration).

Batching: windows are padded to the widest sample; every sample has its own ``n``, drafts, cache
length and noise counters (pass index), and finished samples leave the batch or hand their slot to a
queued request (:class:`vispec.decoding.speculative.RaggedBatch`).

The step (:func:`sjd_step`) is static: its shapes depend only on the batch slots and the padded
window, and it reads nothing back from the device, so ``compile=True`` runs it through
``torch.compile(fullgraph=True)`` (exact rules; windows are then padded to a small fixed set). The
loop reads the committed counts back once per step. ``window="auto"`` picks each pass's window by
cost (:mod:`vispec.decoding.windows`).

Compiled: a fixed window runs every pass at its full width, the image's last passes too, where the widest sample
needs fewer rows. Each narrower width would be a graph of its own, compiled the first time a decode's tail needs
it (~30-60 s on a CPU): a tail's widths depend on how many drafts were accepted, so such a compile could stall any
later call, as it did a timed batch-16 decode of tiny-c2i that came after two warm-up calls (37.8 s instead of 3.5).
Padded rows change no token (each sample's own width is ``min(window, N - n)`` either way: tests/decoding/
test_padded_windows.py); they cost a few wider passes at the end of an image.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from vispec.decoding.acceptance import AcceptanceRule, TVTracker
from vispec.decoding.ar import decode_ar
from vispec.decoding.common import DecodeJob, condition_size, resolve_grid_width, start_decoding
from vispec.decoding.compiled import compiled, mark_persistent
from vispec.decoding.config import DecodingConfig
from vispec.decoding.drafts import init_draft_tokens, source_rows
from vispec.decoding.speculative import GUMBEL, JACOBI, MAXIMAL, Coupling, RaggedBatch, verify_window
from vispec.decoding.windows import WindowChooser, WindowStats, cost_key, round_up, window_set
from vispec.kernels.philox import Stream
from vispec.kernels.target import window_target
from vispec.kernels.verify import SampleRequest
from vispec.outputs import DecodeOutput
from vispec.protocol import SpeculativeARModel

COUPLINGS = {"none": JACOBI, "maximal": MAXIMAL, "gumbel": GUMBEL}


@dataclass(frozen=True)
class SJDStep:
    """What a step needs besides the batch: fixed for a whole decode."""

    model: Any
    job: DecodeJob
    rule: AcceptanceRule
    coupling: Coupling
    init: str
    grid_width: int
    vocab: int
    window: int  # the largest window
    tv: Optional[TVTracker]


def sjd_step(step: SJDStep, batch: RaggedBatch, width_pad: int, longest: Optional[int]) -> torch.Tensor:
    """One pass over every slot with windows padded to ``width_pad`` rows (steps 1-6 of the module
    docstring); returns the pass's status. ``longest``: the host's bound on cached tokens, or None to
    attend over the whole cache (compiled)."""
    job, model = step.job, step.model
    n, draft_count, draft_q, live = batch.n, batch.state["draft_count"], batch.state["draft_q"], batch.live
    width = torch.where(live, (job.num_tokens - n).clamp(max=step.window), 1)  # window rows per sample, z included
    slot = torch.arange(width_pad, device=n.device)
    positions = n[:, None] - 1 + slot  # window input positions
    in_window = slot[None, :] < width[:, None]

    # 1. fill the window: initialise the slots past the known drafts
    known = n + draft_count
    need_init = (slot[None, :] >= 1) & in_window & (positions >= known[:, None])
    init = init_draft_tokens(step.init, batch.tokens, positions, known, step.grid_width, step.vocab, batch.seeds, batch.nfe,
                             source_rows(job.source, batch.ids))
    batch.tokens.scatter_(1, positions, torch.where(need_init, init, batch.tokens.gather(1, positions)))
    # Rows past a sample's own width are padding (the widest sample's, or the compiled window set's, or an
    # idle slot's: width 1): they read buffer positions no real row uses (stale drafts, or past N for idle
    # slots), which once held -1 after a one-row pass and crashed compiled steps. They feed token 0, so the embedding sees only ids in [0, V) whatever the buffer holds there; their
    # outputs are padding rows of the target and their keys are rolled back, so no real row depends on them.
    window_tokens = torch.where(in_window, batch.tokens.gather(1, positions), 0)

    # 2. one forward; row j gives P_j for position n + j and verifies window token j + 1
    out = model.forward_window(batch.cache(), window_tokens, longest)
    target = window_target(out.cond, out.uncond, positions + 1, width, batch.seeds, job.sampling, job.processors,
                           backend=job.backend, validate=False)

    # 3. verify every draft at once
    drafts = torch.cat([window_tokens[:, 1:], torch.full_like(window_tokens[:, :1], -1)], dim=1)
    drafts = torch.where(slot[None, :] < (width - 1)[:, None], drafts, torch.full_like(drafts, -1))
    next_q = torch.zeros_like(draft_q)
    verified = verify_window(target, step.rule, drafts, width - 1, width, batch.nfe, step.coupling, q=draft_q,
                             q_dense=slot[None, :] < draft_count[:, None], store_q=next_q, tv=step.tv, ids=batch.ids,
                             num_tokens=job.num_tokens)
    m = verified.num_accepted

    # 4. commit d_1 .. d_m (already in the buffer) and x_{m+1}
    batch.commit(m, verified.next_token)

    # 5. keep the KV of z, d_1 .. d_m
    model.rollback(batch.cache(), torch.where(live, m + 1, 0))

    # 6. the outputs after m become the next drafts at positions n + j (their P_j is stored as q):
    #    fresh samples, or (maximal coupling) each slot's coupled output where it had a draft
    next_tokens = verified.fresh
    if step.coupling.every_rejection:
        next_tokens = torch.where(slot[None, :] < (width - 1)[:, None], verified.coupled, verified.fresh)
    at = n[:, None] + slot
    write = (slot[None, :] > m[:, None]) & in_window
    batch.tokens.scatter_(1, at, torch.where(write, next_tokens, batch.tokens.gather(1, at)))
    batch.state["draft_count"], batch.state["draft_q"] = width - 1 - m, next_q
    if step.init == "source" and not step.coupling.every_rejection:  # IAD: the tail is drafted from the source again
        batch.state["draft_count"] = torch.zeros_like(m)
    batch.state["single_passes"] = batch.state["single_passes"] + (live & (m == 0)).long()
    return target.status


def single_token_step(step: SJDStep, batch: RaggedBatch, width_pad: int, longest: Optional[int]) -> torch.Tensor:
    """:func:`sjd_step` with a window of one row (``width_pad == 1``), without the verification machinery:
    no draft is verified, so the pass samples ``x_n`` from ``P_0`` with the noise :func:`sjd_step` gives its
    bonus row (SAMPLE keyed by the pass, or the fixed GUMBEL noise), so the tokens are identical, and the
    drafts are dropped. It costs what an AR step costs, so a chooser that falls back to window 1 runs at
    AR speed."""
    job, model, n, live = step.job, step.model, batch.n, batch.live
    positions = (n - 1)[:, None]
    out = model.forward_window(batch.cache(), batch.tokens.gather(1, positions), longest)
    ones = torch.ones_like(n)
    target = window_target(out.cond, out.uncond, positions + 1, ones, batch.seeds, job.sampling, job.processors,
                           backend=job.backend, validate=False)
    stream, draws = (Stream.GUMBEL, torch.zeros_like(n)) if step.coupling.fixed_noise else (Stream.SAMPLE, batch.nfe)
    token = target.sample(SampleRequest(fresh=live, fresh_stream=stream, fresh_draws=draws))[1]
    batch.commit(torch.zeros_like(n), token)
    model.rollback(batch.cache(), live.long())
    batch.state["draft_count"] = torch.zeros_like(n)
    batch.state["single_passes"] = batch.state["single_passes"] + live.long()
    return target.status


def _chooser(model: SpeculativeARModel, slots: int, job: DecodeJob, decoding: DecodingConfig,
             stats: Optional[WindowStats]) -> WindowChooser:
    """The window chooser of a decode over ``slots`` batch slots, measuring into ``stats``: step times per
    (device, dtype, slots, compile), acceptance per spec."""
    return WindowChooser(decoding.largest_window, stats, cost_key(model, slots, job.compile), tokens_key=decoding.name,
                         slots=slots)


@torch.no_grad()
def decode_sjd(model: SpeculativeARModel, condition: Any, job: DecodeJob, decoding: DecodingConfig,
               rule: AcceptanceRule, window_stats: Optional[WindowStats] = None) -> DecodeOutput:
    """Decode ``job.num_tokens`` tokens per sample with SJD or MC-SJD (module docstring).

    ``rule``: the built acceptance rule of ``decoding.acceptance`` (:mod:`vispec.decoding.acceptance`);
    a lossy rule also reports, per sample, the mean and max total-variation distance of a
    verification's output from the target (``stats.tv_mean``, ``stats.tv_max``; over every verified
    row of every pass, :class:`~vispec.decoding.acceptance.TVTracker`). ``stats.windows`` counts the passes run
    with each window, ``stats.extra["single_passes"]`` each sample's passes that committed one token. With
    ``window="auto"`` and an exact rule, a decode the chooser's measurements give
    to AR (:meth:`~vispec.decoding.windows.WindowChooser.prefers_ar`) runs :func:`decode_ar`.
    ``window_stats``: the chooser's measurements, kept by the caller between decodes (default: this
    decode's own)."""
    if decoding.strategy not in ("sjd", "mc-sjd"):
        raise ValueError(f"decode_sjd needs strategy 'sjd' or 'mc-sjd', got {decoding.strategy!r}")
    auto = decoding.window == "auto"
    stats = WindowStats() if auto and window_stats is None else window_stats
    window = decoding.largest_window
    if auto and rule.lossless:
        slots = min(condition_size(condition), job.max_batch_size or condition_size(condition))
        if _chooser(model, slots, job, decoding, stats).prefers_ar(job.num_tokens):  # no window beats AR here (exact either way)
            out = decode_ar(model, condition, job)
            out.method = decoding.method
            return out
    grid_width = resolve_grid_width(model, job.num_tokens, job.grid_width, decoding.init)
    start = start_decoding(model, condition, job, window=window, grid_width=grid_width)
    q_dtype = torch.float64 if start.logits.cond.dtype == torch.float64 else torch.float32
    zeros = torch.zeros(start.batch, dtype=torch.long, device=start.device)
    batch = RaggedBatch(start, job, job.num_tokens, window, caches={"target": (model, start.state)},
                        state={"draft_count": zeros,  # valid drafts at positions n .. n + draft_count - 1
                               "draft_q": torch.zeros(start.batch, max(window - 1, 1), start.vocab, dtype=q_dtype,
                                                      device=start.device),  # q of the draft at position n + i
                               "single_passes": zeros.clone()},  # passes that committed one token
                        reported=("single_passes",), fixed=job.compile)
    tv = TVTracker(start.requests, start.device) if not rule.lossless else None
    mark_persistent(tv)  # CUDA graphs: the step adds to its sums in place (vispec.decoding.compiled)
    step = SJDStep(model, job, rule, COUPLINGS[decoding.coupling], decoding.init, grid_width, start.vocab, window, tv)
    run = compiled(sjd_step, fullgraph=rule.lossless) if job.compile else sjd_step
    run_single = compiled(single_token_step) if job.compile else single_token_step
    windows = window_set(window)
    chooser = _chooser(model, start.batch, job, decoding, stats) if auto else None
    steps = {window: step}  # per window: the step whose windows are at most that wide
    used: dict[int, int] = {}
    budget_marked = False

    while batch.running:
        need = batch.widths(window)
        if chooser is not None:
            chosen = chooser.choose(need, batch.longest(), batch.live_count, batch.remaining())
            if job.compile:  # compiled steps come in a few shapes: pad to the window set
                chosen = round_up(chosen, windows)
        else:  # compiled: the image's last passes run padded to the window too (module docstring, Compiled)
            chosen = window if job.compile else need
        width_pad = chosen
        if chosen not in steps:
            steps[chosen] = SJDStep(model, job, rule, step.coupling, decoding.init, grid_width, start.vocab, chosen, tv)
        before = [(n, i >= 0) for n, i in zip(batch.n_host, batch.ids_host)] if chooser else None  # for record()
        status = (run_single if width_pad == 1 else run)(steps[chosen], batch, width_pad, None if job.compile else batch.longest())
        # window 1 commits exactly one token per live sample: nothing to read back unless a sample
        # finishes or the chooser needs the time of its run of passes
        synced = width_pad > 1 or (chooser is not None and chooser.must_sync()) or batch.finishing_next()
        after = batch.sync(status) if synced else batch.advance(status)
        used[chosen] = used.get(chosen, 0) + 1
        if tv is not None and tv.budget is not None and not budget_marked:  # made by the first step
            mark_persistent(tv.budget)
            budget_marked = True
        if chooser:
            live = [(n, a) for (n, is_live), a in zip(before, after) if is_live]
            chooser.record(chosen, [a - n - 1 for n, a in live], [min(chosen, job.num_tokens - n) for n, _ in live], synced)
        edited = batch.report(job.callback)
        if edited is not None:  # drafts made from the old tokens are dropped
            batch.state["draft_count"] = torch.where(edited < job.num_tokens, 0, batch.state["draft_count"])

    out = batch.output(decoding.method, tv)
    out.stats.windows = used
    return out
