"""Draft-model speculative decoding (Leviathan et al., ICML 2023; Chen et al. 2023) over a ragged batch.

A small drafter GPT (same tokenizer, same condition) proposes ``γ = window - 1`` tokens one
forward at a time, sampling ``d_i ~ q_i`` from its own processed distribution (same guidance,
processors, temperature, top-k, top-p as the target). The target verifies ``[z, d_1 .. d_γ]`` in
one forward exactly as SJD does (:func:`vispec.decoding.speculative.verify_window`): keep ``d_i`` with
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
from torch import Tensor

from vispec.decoding.acceptance import AcceptanceRule, TVTracker
from vispec.decoding.common import DecodeJob, select_condition, start_decoding
from vispec.decoding.config import DecodingConfig
from vispec.decoding.edits import refeed
from vispec.decoding.speculative import DRAFT_MODEL, RaggedBatch, verify_window
from vispec.kernels.philox import Stream
from vispec.kernels.target import window_target
from vispec.kernels.verify import SampleRequest
from vispec.outputs import DecodeOutput
from vispec.protocol import SpeculativeARModel


def _draft_step(drafter, state, tokens, take, keep, positions, seeds, draws, job: DecodeJob) -> tuple[Tensor, Tensor]:
    """One drafter forward on ``tokens [B, W]``: sample from output ``take[b]`` (predicting ``positions[b]``)
    and keep ``keep[b]`` of the tokens in the drafter's cache. Returns ``(draft [B], q [B, V])``; the
    drafter's distribution is computed with validation on (NaN logits raise at once)."""
    out = drafter.forward_window(state, tokens)
    drafter.rollback(state, keep)
    pick = take[:, None, None].expand(-1, 1, out.cond.shape[-1])
    cond = out.cond.gather(1, pick)
    uncond = None if out.uncond is None else out.uncond.gather(1, pick)
    target = window_target(cond, uncond, positions[:, None], torch.ones_like(take), seeds, job.sampling, job.processors,
                           backend=job.backend, validate=True)
    q = torch.zeros(tokens.shape[0], cond.shape[-1], dtype=torch.float32, device=tokens.device)
    rows = torch.arange(tokens.shape[0], device=tokens.device)
    _, draft = target.sample(SampleRequest(fresh=torch.ones_like(take, dtype=torch.bool), fresh_stream=Stream.DRAFT,
                                           fresh_draws=draws, store_rows=rows, store_out=q))
    return draft, q


def _propose(drafter, batch: RaggedBatch, drafts_b: Tensor, vocab: int, job: DecodeJob) -> tuple[Tensor, Optional[Tensor]]:
    """The drafter's drafts ``[B, R]`` (-1 past ``drafts_b``) and their ``q [B, R, V]`` (None when ``R = 0``),
    ``R = max(drafts_b)``.

    Its first forward feeds the tokens committed since its last round (keeping them); each further
    forward feeds this round's drafts again without keeping them."""
    n, cached, rounds = batch.n, batch.state["cached"], int(drafts_b.max())
    drafts = torch.full((n.shape[0], rounds), -1, dtype=torch.long, device=n.device)
    q = torch.zeros(n.shape[0], rounds, vocab, dtype=torch.float32, device=n.device) if rounds else None
    for i in range(rounds):
        if i == 0:
            pending = n - cached
            span = torch.arange(int(pending.max()), device=n.device)
            tokens = batch.tokens.gather(1, (cached[:, None] + span).clamp(max=batch.tokens.shape[1] - 1))
            take, keep = (pending - 1).clamp_min(0), pending  # idle slots: nothing pending
        else:
            tokens, take, keep = drafts[:, :i].clamp_min(0), torch.full_like(n, i - 1), torch.zeros_like(n)
        draft, q[:, i] = _draft_step(drafter, batch.cache("drafter"), tokens, take, keep, n + i, batch.seeds, batch.nfe, job)
        drafts[:, i] = torch.where(i < drafts_b, draft, torch.full_like(draft, -1))
    if rounds:
        batch.state["cached"] = n.clone()
        batch.state["drafter_nfe"] = batch.state["drafter_nfe"] + drafts_b
    return drafts, q


@torch.no_grad()
def decode_sd(model: SpeculativeARModel, drafter: SpeculativeARModel, condition: Any, job: DecodeJob, decoding: DecodingConfig,
              rule: AcceptanceRule) -> DecodeOutput:
    """Decode ``job.num_tokens`` tokens per sample with ``drafter`` proposing for ``model`` (module docstring).

    ``stats.nfe`` counts target forwards (the prefill included); ``stats.extra["drafter_nfe"]`` the
    drafter's. ``rule`` as in :func:`vispec.decoding.sjd.decode_sjd`.
    """
    if decoding.strategy != "sd":
        raise ValueError(f"decode_sd needs strategy 'sd', got {decoding.strategy!r}")
    if not isinstance(drafter, SpeculativeARModel):
        raise ValueError(f"drafter must implement prefill/forward_window/rollback/select, got {type(drafter).__name__}")
    if drafter.image_vocab_size != model.image_vocab_size:
        raise ValueError(f"drafter vocabulary ({drafter.image_vocab_size}) differs from the target's ({model.image_vocab_size})")
    gamma = decoding.window - 1
    if gamma < 1:
        raise ValueError(f"draft-model decoding needs window >= 2 (at least one drafted token), got {decoding.window}")
    if job.compile:
        raise ValueError("compile=True supports decoding 'ar', 'sjd' and 'mc-sjd'; 'sd' runs its drafter rounds eagerly "
                         "(use compile=False)")
    num_tokens, sampling = job.num_tokens, job.sampling
    start = start_decoding(model, condition, job, window=decoding.window, grid_width=num_tokens)
    first = condition if start.requests == start.batch else select_condition(condition, torch.arange(start.batch))
    d_state, _ = drafter.prefill(first, guidance=sampling.uses_guidance, max_new_tokens=num_tokens, window=decoding.window)
    zeros = torch.zeros(start.batch, dtype=torch.long, device=start.device)
    batch = RaggedBatch(start, job, num_tokens, decoding.window + 1,
                        caches={"target": (model, start.state), "drafter": (drafter, d_state)},
                        state={"cached": zeros, "drafter_nfe": zeros}, reported=("drafter_nfe",))
    tv = TVTracker(start.requests, start.device) if not rule.lossless else None

    while batch.running:
        n = batch.n
        drafts_b = (num_tokens - n - 1).clamp(min=0, max=gamma)  # γ_b: the bonus position n + γ_b stays < N

        # 1. draft: the drafter proposes γ_b tokens at positions n .. n + γ_b - 1
        drafts, q = _propose(drafter, batch, drafts_b, start.vocab, job)
        width = drafts.shape[1] + 1
        slot = torch.arange(width, device=n.device)
        at = (n[:, None] + slot[:-1]).clamp(max=batch.tokens.shape[1] - 1)
        batch.tokens.scatter_(1, at, torch.where(drafts >= 0, drafts, batch.tokens.gather(1, at)))

        # 2. one target forward on [z, d_1 .. d_γ]; row j predicts position n + j and verifies d_{j+1}
        positions = n[:, None] - 1 + slot
        out = model.forward_window(batch.cache(), batch.tokens.gather(1, positions), batch.longest())
        target = window_target(out.cond, out.uncond, positions + 1, drafts_b + 1, batch.seeds, sampling, job.processors,
                               backend=job.backend, validate=False)

        # 3. verify
        row_drafts = torch.cat([drafts, torch.full_like(n[:, None], -1)], dim=1)
        verified = verify_window(target, rule, row_drafts, drafts_b, drafts_b + 1, batch.nfe, DRAFT_MODEL, q=q,
                                 q_dense=slot[None, :] < drafts_b[:, None], tv=tv, ids=batch.ids,
                                 num_tokens=num_tokens)

        # 4. commit; 5. keep the target's KV of z, d_1 .. d_m
        batch.commit(verified.num_accepted, verified.next_token)
        model.rollback(batch.cache(), torch.where(batch.live, verified.num_accepted + 1, 0))
        batch.sync(target.status)
        edited = batch.report(job.callback)
        if edited is not None:  # the drafter's cache is rewound to the first edit; _propose feeds it again
            cached = torch.minimum(batch.state["cached"], edited)
            refeed(drafter, batch.cache("drafter"), batch.tokens, cached, cached)
            batch.state["cached"] = cached

    return batch.output(decoding.method, tv)
