"""Draft-model speculative decoding (Leviathan et al., ICML 2023; Chen et al. 2023) over a ragged batch.

A small drafter GPT (same tokenizer, same condition) proposes ``γ = window - 1`` tokens one
forward at a time, sampling ``d_i ~ q_i`` from its own processed distribution (same guidance,
processors, temperature, top-k, top-p as the target). The target verifies ``[z, d_1 .. d_γ]`` in
one forward exactly as SJD does (:class:`vispec.kernels.target.Target`): keep ``d_i`` with
probability ``min(1, p_i(d_i) / q_i(d_i))`` (or a lossy rule's relaxed test), resample the first
rejection from ``max(0, p - q)``, or take the bonus token from ``p_γ``. With the exact rule every
committed token is distributed as ``p(. | committed prefix)``.

Caches: the target keeps ``z`` and the accepted drafts (rollback). The drafter caches only
committed tokens: each round first feeds the tokens committed since its last round (``m + 1`` of
them, ragged across samples) and keeps them, then feeds its own drafts of this round again on each
further step without keeping them (its forward is cheap; no truncation is needed in the protocol).
Every sample has its own committed count, draft length, noise counters and finishing time.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from vispec.decoding.acceptance import AcceptanceRule, TVTracker
from vispec.decoding.common import DecodeOutput, GeneratorArg, SampleResults, StepCallback, start_decoding
from vispec.decoding.config import DecodingConfig
from vispec.kernels.philox import Stream
from vispec.kernels.target import window_target
from vispec.protocol import SpeculativeARModel
from vispec.sampling import PositionProcessor, SamplingConfig


def _draft_step(drafter, state, tokens, take, keep, positions, seeds, draws, sampling, processors, backend):
    """One drafter forward on ``tokens [B, W]``: sample from output ``take[b]`` (predicting ``positions[b]``)
    and keep ``keep[b]`` of the tokens in the drafter's cache. Returns ``(draft [B], q [B, V])``."""
    out = drafter.forward_window(state, tokens)
    drafter.rollback(state, keep)
    pick = take[:, None, None].expand(-1, 1, out.cond.shape[-1])
    cond = out.cond.gather(1, pick)
    uncond = None if out.uncond is None else out.uncond.gather(1, pick)
    ones = torch.ones_like(take)
    target = window_target(cond, uncond, positions[:, None], ones, seeds, sampling, processors, backend=backend, validate=False)
    q = torch.zeros(tokens.shape[0], cond.shape[-1], dtype=torch.float32, device=tokens.device)
    rows = torch.arange(tokens.shape[0], device=tokens.device)
    _, draft = target.sample(fresh=torch.ones_like(take, dtype=torch.bool), fresh_stream=Stream.DRAFT, fresh_draws=draws,
                             store_rows=rows, store_out=q)
    return draft, q


@torch.no_grad()
def decode_sd(
    model: SpeculativeARModel,
    drafter: SpeculativeARModel,
    condition: Any,
    *,
    num_tokens: int,
    sampling: SamplingConfig,
    decoding: DecodingConfig,
    generator: GeneratorArg = None,
    processors: tuple[PositionProcessor, ...] = (),
    callback: Optional[StepCallback] = None,
    backend: str = "auto",
    acceptance: Optional[AcceptanceRule] = None,
) -> DecodeOutput:
    """Decode ``num_tokens`` tokens per sample with ``drafter`` proposing for ``model`` (module docstring).

    ``stats.nfe`` counts target forwards (the prefill included); ``extra["drafter_nfe"]`` the
    drafter's. ``acceptance`` as in :func:`vispec.decoding.sjd.decode_sjd`.
    """
    cfg = decoding.config
    if cfg.strategy != "sd":
        raise ValueError(f"decode_sd needs strategy 'sd', got {cfg.strategy!r}")
    if not isinstance(drafter, SpeculativeARModel):
        raise ValueError(f"drafter must implement prefill/forward_window/rollback/select, got {type(drafter).__name__}")
    if drafter.image_vocab_size != model.image_vocab_size:
        raise ValueError(f"drafter vocabulary ({drafter.image_vocab_size}) differs from the target's ({model.image_vocab_size})")
    rule = acceptance or AcceptanceRule()
    gamma = cfg.window - 1
    if gamma < 1:
        raise ValueError(f"draft-model decoding needs window >= 2 (at least one drafted token), got {cfg.window}")
    start = start_decoding(model, condition, num_tokens=num_tokens, grid_width=num_tokens, sampling=sampling,
                           generator=generator, window=cfg.window)
    state, logits, seeds, clock, vocab = start.state, start.logits, start.seeds, start.clock, start.vocab
    batch, device = start.batch, start.device
    d_state, _ = drafter.prefill(condition, guidance=sampling.uses_guidance, max_new_tokens=num_tokens, window=cfg.window)
    zeros = torch.zeros(batch, dtype=torch.long, device=device)

    first = window_target(logits.cond, logits.uncond, zeros[:, None], torch.ones_like(zeros), seeds, sampling, processors,
                          backend=backend).sample(fresh=torch.ones(batch, dtype=torch.bool, device=device), fresh_draws=zeros)[1]

    results = SampleResults(batch, num_tokens, device)  # in the caller's batch order
    tv = TVTracker(batch, device) if not rule.lossless else None

    ids = torch.arange(batch, device=device)
    buf = torch.zeros(batch, num_tokens + cfg.window + 1, dtype=torch.long, device=device)
    buf[:, 0] = first
    n = torch.ones(batch, dtype=torch.long, device=device)  # committed tokens (the newest, z, is not in the target cache)
    cached = zeros.clone()  # committed tokens in the drafter's cache
    nfe = torch.ones(batch, dtype=torch.long, device=device)
    dnfe = zeros.clone()
    accepted = zeros.clone()
    step = 0
    while True:
        finished = n >= num_tokens
        if bool(finished.any()):
            results.finish(finished.nonzero().squeeze(1), ids, buf, nfe, accepted, clock.now(), drafter_nfe=dnfe)
            keep = (~finished).nonzero().squeeze(1)
            if keep.numel() == 0:
                break
            state, d_state = model.select(state, keep), drafter.select(d_state, keep)
            ids, buf, n, cached, nfe, dnfe, accepted, seeds = (t[keep] for t in (ids, buf, n, cached, nfe, dnfe, accepted, seeds))
        active = ids.numel()
        drafts_b = (num_tokens - n - 1).clamp(min=0, max=gamma)  # γ_b: the bonus position n + γ_b stays < N
        rounds = int(drafts_b.max())
        slot_d = torch.arange(max(rounds, 1), device=device)
        drafts = torch.full((active, max(rounds, 1)), -1, dtype=torch.long, device=device)
        q = torch.zeros(active, max(rounds, 1), vocab, dtype=torch.float32, device=device)

        # drafter: feed the tokens committed since its last round, then its own drafts
        if rounds:
            pending = n - cached
            width = int(pending.max())
            span = torch.arange(width, device=device)
            feed = buf.gather(1, (cached[:, None] + span).clamp(max=buf.shape[1] - 1))
            for i in range(rounds):
                if i == 0:
                    tokens, take, keep = feed, pending - 1, pending
                else:
                    tokens, take, keep = drafts[:, :i].clamp_min(0), torch.full_like(n, i - 1), torch.zeros_like(n)
                draft, q_i = _draft_step(drafter, d_state, tokens, take, keep, n + i, seeds, nfe, sampling, processors, backend)
                live = i < drafts_b
                drafts[:, i] = torch.where(live, draft, torch.full_like(draft, -1))
                q[:, i] = q_i
            cached = n.clone()
            dnfe = dnfe + torch.where(drafts_b > 0, drafts_b, torch.zeros_like(drafts_b))
        buf.scatter_(1, (n[:, None] + slot_d).clamp(max=buf.shape[1] - 1), torch.where(drafts >= 0, drafts, buf.gather(1, (n[:, None] + slot_d).clamp(max=buf.shape[1] - 1))))

        # target: verify [z, d_1 .. d_γ] in one forward; row j predicts position n + j and verifies d_{j+1}
        width = rounds + 1
        slot = torch.arange(width, device=device)
        positions = n[:, None] - 1 + slot
        window_tokens = buf.gather(1, positions)
        out = model.forward_window(state, window_tokens)
        target = window_target(out.cond, out.uncond, positions + 1, drafts_b + 1, seeds, sampling, processors,
                               backend=backend, validate=False)
        row_drafts = torch.full((active, width), -1, dtype=torch.long, device=device)
        row_drafts[:, :rounds] = drafts[:, :rounds]
        real = slot[None, :] < drafts_b[:, None]
        q_index = torch.where(real, torch.arange(active, device=device)[:, None] * q.shape[1] + slot.clamp(max=q.shape[1] - 1),
                              torch.full_like(row_drafts, -1)).reshape(-1)
        q_flat = q.reshape(-1, vocab)
        row_nfe = nfe[:, None].expand(-1, width).reshape(-1)
        flags = target.accept(row_drafts.reshape(-1), q=q_flat, q_index=q_index, draws=row_nfe, rule=rule)
        if tv is not None:
            tv.measure(target, rule, ids, drafts_b, width, row_drafts.reshape(-1), q_flat, q_index)
        m = target.first_rejection(flags, torch.arange(active, device=device) * width, drafts_b)
        rejected_at = real & (slot[None, :] == m[:, None])
        bonus_at = (slot[None, :] == drafts_b[:, None]) & (m == drafts_b)[:, None]
        residual, fresh = target.sample(residual=rejected_at.reshape(-1), fresh=bonus_at.reshape(-1),
                                        draft_tokens=row_drafts.reshape(-1), q=q_flat, q_index=q_index,
                                        residual_draws=row_nfe, fresh_draws=row_nfe, rule=rule)
        last = torch.maximum(residual, fresh).view(active, width).gather(1, m[:, None]).squeeze(1)
        buf.scatter_(1, (n + m)[:, None], last[:, None])

        model.rollback(state, m + 1)
        n = n + m + 1
        nfe = nfe + 1
        accepted = accepted + m
        step += 1
        if callback is not None:
            results.report_progress(callback, step, ids, n, buf)

    return results.output(decoding.name, rule, tv)
