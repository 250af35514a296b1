"""Speculative Jacobi Decoding and its coupled variants, over a ragged batch.

SJD (Teng et al., ICLR 2025, arXiv 2410.01699). Each sample keeps ``n`` committed tokens, of
which the newest (``z``, position ``n - 1``) is not yet in the KV cache, plus drafts at positions
``n, n+1, ...`` with stored draft distributions ``q``. One pass:

1. fill the window ``[z, d_1 .. d_{W-1}]`` (``W = min(L, N - n)``); missing drafts are initialised
   (:mod:`vispec.decoding.drafts`) with one-hot ``q``;
2. one forward; output ``j`` gives the processed target ``P_j`` for position ``n + j``;
3. verify draft ``d_j`` against ``P_{j-1}`` for all ``j`` at once (:func:`vispec.kernels.verify_drafts`):
   accept with ``min(1, P(d)/q(d))``; ``m`` = number of leading accepted drafts;
4. commit ``d_1 .. d_m`` and then the residual sample at the first rejection, or the bonus sample
   from ``P_{W-1}`` when every draft was accepted: ``m + 1`` tokens per pass;
5. keep the KV of ``z, d_1 .. d_m`` (rollback of the rest, per sample);
6. the unverified tail becomes the next drafts: position ``n + j`` (``j > m``) gets a token drawn
   from ``P_j`` and stores ``q := P_j``.

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
(tests/test_exactness.py checks the joint distribution against enumeration).

Batching: windows are padded to the widest sample; every sample has its own ``n``, drafts, cache
length and noise counters (pass index), and finished samples leave the batch.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
from torch import Tensor

from vispec.decoding.acceptance import AcceptanceRule, TVTracker
from vispec.decoding.common import DecodeOutput, GeneratorArg, SampleResults, StepCallback, start_decoding
from vispec.decoding.config import DecodingConfig
from vispec.decoding.drafts import init_draft_tokens
from vispec.kernels.philox import Stream
from vispec.kernels.target import window_target
from vispec.protocol import SpeculativeARModel
from vispec.sampling import PositionProcessor, SamplingConfig


def _resolve_grid_width(model: Any, num_tokens: int, grid_width: Optional[int], init: str) -> int:
    if grid_width is not None:
        return grid_width
    if hasattr(model, "grid_size"):
        return int(model.grid_size)
    side = math.isqrt(num_tokens)
    if side * side == num_tokens:
        return side
    if init == "vertical":
        raise ValueError(f"grid_width is needed for vertical initialisation of {num_tokens} tokens (not a square grid)")
    return num_tokens


@torch.no_grad()
def decode_sjd(
    model: SpeculativeARModel,
    condition: Any,
    *,
    num_tokens: int,
    sampling: SamplingConfig,
    decoding: DecodingConfig,
    generator: GeneratorArg = None,
    processors: tuple[PositionProcessor, ...] = (),
    grid_width: Optional[int] = None,
    callback: Optional[StepCallback] = None,
    backend: str = "auto",
    acceptance: Optional[AcceptanceRule] = None,
) -> DecodeOutput:
    """Decode ``num_tokens`` tokens per sample with SJD or MC-SJD (module docstring).

    ``backend`` picks the verification kernels (:mod:`vispec.kernels.backend`): Triton for CUDA
    tensors by default, the PyTorch reference otherwise. ``acceptance``: the acceptance rule
    (:mod:`vispec.decoding.acceptance`; default exact). A lossy rule also reports, per sample, the
    mean and max total-variation distance of a verification's output from the target
    (``stats.tv_mean``, ``stats.tv_max``; measured on the first draft of up to
    ``TV_SAMPLES_PER_STEP`` samples per pass)."""
    rule = acceptance or AcceptanceRule()
    cfg = decoding.config
    if cfg.strategy not in ("sjd", "mc-sjd"):
        raise ValueError(f"decode_sjd needs strategy 'sjd' or 'mc-sjd', got {cfg.strategy!r}")
    window, coupling = cfg.window, cfg.coupling
    grid_width = _resolve_grid_width(model, num_tokens, grid_width, cfg.init)
    start = start_decoding(model, condition, num_tokens=num_tokens, grid_width=grid_width, sampling=sampling,
                           generator=generator, window=window)
    state, logits, seeds, clock, vocab = start.state, start.logits, start.seeds, start.clock, start.vocab
    batch, device = start.batch, start.device
    zeros = torch.zeros(batch, dtype=torch.long, device=device)

    # token 0 from the prefill
    first_target = window_target(logits.cond, logits.uncond, zeros[:, None], torch.ones_like(zeros), seeds, sampling,
                                 processors, backend=backend)
    first = first_target.sample(fresh=torch.ones(batch, dtype=torch.bool, device=device), fresh_draws=zeros)[1]

    results = SampleResults(batch, num_tokens, device)  # in the caller's batch order
    tv = TVTracker(batch, device) if not rule.lossless else None

    # per active sample
    ids = torch.arange(batch, device=device)
    buf = torch.zeros(batch, num_tokens + window, dtype=torch.long, device=device)  # tokens by position (+ padding room)
    buf[:, 0] = first
    n = torch.ones(batch, dtype=torch.long, device=device)  # committed tokens
    draft_count = zeros.clone()  # valid drafts at positions n .. n + draft_count - 1
    q_dtype = torch.float64 if logits.cond.dtype == torch.float64 else torch.float32
    draft_q = torch.zeros(batch, max(window - 1, 1), vocab, dtype=q_dtype, device=device)  # q of draft i (position n + i)
    nfe = torch.ones(batch, dtype=torch.long, device=device)
    accepted = zeros.clone()
    step = 0

    while True:
        finished = n >= num_tokens
        if bool(finished.any()):
            results.finish(finished.nonzero().squeeze(1), ids, buf, nfe, accepted, clock.now())
            keep = (~finished).nonzero().squeeze(1)
            if keep.numel() == 0:
                break
            state = model.select(state, keep)
            ids, buf, n, draft_count, draft_q, nfe, accepted, seeds = (
                t[keep] for t in (ids, buf, n, draft_count, draft_q, nfe, accepted, seeds)
            )
        active = ids.numel()
        width_b = (num_tokens - n).clamp(max=window)  # window incl. z, per sample
        width = int(width_b.max())
        slot = torch.arange(width, device=device)
        positions = n[:, None] - 1 + slot  # window input positions
        in_window = slot[None, :] < width_b[:, None]

        # 1. initialise missing drafts
        known = n + draft_count
        need_init = (slot[None, :] >= 1) & in_window & (positions >= known[:, None])
        if bool(need_init.any()):
            init = init_draft_tokens(cfg.init, buf, positions, known, grid_width, vocab, seeds, nfe)
            buf.scatter_(1, positions, torch.where(need_init, init, buf.gather(1, positions)))
        window_tokens = buf.gather(1, positions)

        # 2. forward and target (row j of a sample predicts position n + j and verifies window token j + 1)
        out = model.forward_window(state, window_tokens)
        out_positions = positions + 1
        target = window_target(out.cond, out.uncond, out_positions, width_b, seeds, sampling, processors, backend=backend,
                               validate=False)
        num_slots = width - 1
        num_drafts = width_b - 1
        q_width = draft_q.shape[1]
        row_drafts = torch.cat([window_tokens[:, 1:], torch.full_like(window_tokens[:, :1], -1)], dim=1)
        row_drafts = torch.where(slot[None, :] < num_drafts[:, None], row_drafts, torch.full_like(row_drafts, -1))
        dense = slot[None, :] < draft_count[:, None]  # the stored drafts carry their dense q (draft_q rows)
        q_index = torch.where(dense, torch.arange(active, device=device)[:, None] * q_width + slot.clamp(max=q_width - 1),
                              torch.full_like(row_drafts, -1)).reshape(-1)
        q_flat = draft_q.reshape(-1, vocab)
        row_nfe = nfe[:, None].expand(-1, width).reshape(-1)

        # 3. acceptance for every draft row at once; m = leading accepted drafts
        accept_flags = target.accept(row_drafts.reshape(-1), q=q_flat, q_index=q_index, draws=row_nfe, rule=rule).view(active, width)
        if tv is not None:
            tv.measure(target, rule, ids, num_drafts, width, row_drafts.reshape(-1), q_flat, q_index)
        m = target.first_rejection(accept_flags.reshape(-1), torch.arange(active, device=device) * width, num_drafts)
        # residual samples where they are used: every rejected slot (maximal coupling), or the
        # first rejection only (SJD)
        real = slot[None, :] < num_drafts[:, None]
        if coupling == "maximal":
            need_residual = real & ~accept_flags
        else:
            need_residual = real & (slot[None, :] == m[:, None])

        # samples from the outputs that become drafts or the bonus token: Gumbel-coupled, or fresh
        # (SJD; maximal coupling only needs its last output, which has no old draft to couple with)
        use_from = torch.where(m == num_drafts, m, m + 1)  # bonus slot, or first slot after the rejection
        if coupling == "maximal":
            need_fresh = slot[None, :] == (width_b - 1)[:, None]
        else:
            need_fresh = (slot[None, :] >= use_from[:, None]) & in_window
        fresh_stream, fresh_draws = (Stream.GUMBEL, torch.zeros_like(nfe)) if coupling == "gumbel" else (Stream.SAMPLE, nfe)

        # the rows after m become the next drafts (position n + j is draft j - m - 1 of the next pass):
        # their p is stored as q
        becomes_draft = (slot[None, :] > m[:, None]) & in_window
        store_rows = torch.where(becomes_draft, torch.arange(active, device=device)[:, None] * q_width + slot[None, :] - m[:, None] - 1,
                                 torch.full_like(row_drafts, -1))
        next_q = torch.zeros_like(draft_q)
        residual, fresh = target.sample(
            residual=need_residual.reshape(-1), fresh=need_fresh.reshape(-1), draft_tokens=row_drafts.reshape(-1),
            q=q_flat, q_index=q_index, residual_draws=row_nfe, fresh_stream=fresh_stream,
            fresh_draws=fresh_draws[:, None].expand(-1, width).reshape(-1),
            store_rows=store_rows.reshape(-1), store_out=next_q.view(-1, vocab), rule=rule,
        )
        residual, fresh = residual.view(active, width), fresh.view(active, width)
        coupled = torch.where(accept_flags, row_drafts, residual)[:, :num_slots] if num_slots > 0 else None
        accept_flags = accept_flags[:, :num_slots]

        # 4. commit: d_1..d_m are already in buf; write the residual (rejection) or bonus token
        bonus = fresh.gather(1, m[:, None]).squeeze(1)
        if coupled is None:
            last = bonus
        else:
            residual_tok = coupled.gather(1, m.clamp(max=num_slots - 1)[:, None]).squeeze(1)
            last = torch.where(m < num_drafts, residual_tok, bonus)
        buf.scatter_(1, (n + m)[:, None], last[:, None])

        # 6. next drafts at positions n + j, j in (m, width_b)
        next_tokens = fresh
        if coupled is not None and coupling == "maximal":
            coupled_ok = slot[None, :num_slots] < num_drafts[:, None]
            next_tokens = fresh.clone()
            next_tokens[:, :num_slots] = torch.where(coupled_ok, coupled, fresh[:, :num_slots])
        out_pos_n = n[:, None] + slot
        write = (slot[None, :] > m[:, None]) & in_window
        buf.scatter_(1, out_pos_n, torch.where(write, next_tokens, buf.gather(1, out_pos_n)))
        draft_count = width_b - 1 - m
        draft_q = next_q

        # 5. cache: keep z and the accepted drafts
        model.rollback(state, m + 1)
        n = n + m + 1
        nfe = nfe + 1
        accepted = accepted + m
        step += 1
        if callback is not None:
            results.report_progress(callback, step, ids, n, buf)

    return results.output(decoding.name, rule, tv)
