"""Plain autoregressive decoding: one image token per forward pass.

The baseline every speed-up is measured against (LlamaGen ``generate``, arXiv 2406.06525): the
prefill's last logits give token 0; each further pass feeds the newest token and samples the next
from the processed target ``p`` (:func:`vispec.sampling.process_logits`, through
:class:`vispec.kernels.target.Target`). Sampling is the exponential race ``argmax_v p_v / E_v`` with
``E`` keyed by (sample seed, position), so a sample's tokens do not depend on the rest of the batch.

The step (:func:`ar_step`: forward, sample, keep) reads nothing back from the device, so the loop
has no host synchronisation until the end, and ``compile=True`` runs the step through
``torch.compile(fullgraph=True)``. With more requests than ``max_batch_size`` the requests go
through the batch in waves (every AR request needs the same number of passes, so waves are
continuous batching without partial refills). A step callback may rewrite committed tokens
(:mod:`vispec.decoding.edits`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable, Optional

import torch
from torch import Tensor

from vispec.decoding.common import (DecodeJob, condition_size, first_token, resolve_grid_width, sample_tokens, select_condition,
                                    start_decoding)
from vispec.decoding.compiled import compiled, mark_persistent
from vispec.decoding.edits import edited_tokens, first_change, refeed
from vispec.outputs import DecodeOutput, DecodeProgress, DecodeStats, committed_view
from vispec.protocol import SpeculativeARModel
from vispec.sampling import raise_status


def ar_step(model: SpeculativeARModel, state: Any, out: Tensor, position: Tensor, seeds: Tensor, status: Tensor,
            job: DecodeJob, longest: Optional[int]) -> tuple[Tensor, Tensor]:
    """One AR pass: feed the newest token ``out[b, position[b]]``, keep it, sample token ``position + 1`` (draw
    ``position + 1``) into ``out`` in place. Returns ``(position + 1, the worse of status and this step's)``.

    The whole pass is one compiled graph: the index bookkeeping (next position, reading the newest token, writing
    the sampled one, the running status) is part of it, so a compiled decode loop runs no eager op per step."""
    position = position + 1
    logits = model.forward_window(state, out.gather(1, position[:, None] - 1), longest)
    model.rollback(state, torch.ones_like(position))
    tokens, step_status = sample_tokens(logits, position, position, seeds, job)
    out.scatter_(1, position[:, None], tokens[:, None])
    return position, torch.maximum(status, step_status)


def first_wave_token(logits: Any, seeds: Tensor, job: DecodeJob) -> tuple[Tensor, Tensor, Tensor]:
    """A wave's start, after its prefill (or refill) gave ``logits``: the token buffer ``out [B, N]`` with token 0
    sampled (draw 0) and kept where the compiled step writes in place (:func:`~vispec.decoding.compiled.mark_persistent`),
    the newest token's position (0 for every sample) and the sampling status."""
    first, status = first_token(logits, seeds, job)
    out = torch.empty(seeds.shape[0], job.num_tokens, dtype=torch.long, device=seeds.device)
    out[:, 0] = first
    mark_persistent(out)  # the step writes it in place
    return out, torch.zeros(seeds.shape[0], dtype=torch.long, device=seeds.device), status


@torch.no_grad()
def time_ar_passes(model: SpeculativeARModel, condition: Any, job: DecodeJob, clock: Callable[[], float], *,
                   runs: int = 4, passes: int = 16) -> list[tuple[int, float]]:
    """:func:`decode_ar`'s own step loop, timed: the prefill and one untimed pass (it compiles the step where this
    process has not), then ``runs`` runs of ``passes`` passes (fewer where the image is short), each read back at its
    end; ``[(cached image tokens at the run's middle, seconds per pass)]`` in ``clock``'s seconds. The shape
    chooser's yardstick (:mod:`vispec.decoding.shapes`): what a pass of the AR decoder a user would run instead
    costs, which the chooser's own one-token pass (in the speculative batch state, the cache sized for its widest
    shape) exceeded by 10-40% where measured. Draws its own seeds: the caller's generators are not advanced. At
    most the first ``max_batch_size`` requests."""
    requests = condition_size(condition)
    job = replace(job, generator=[torch.Generator().manual_seed(i) for i in range(requests)], callback=None)
    grid_width = resolve_grid_width(model, job.num_tokens, job.grid_width)
    start = start_decoding(model, condition, job, window=1, grid_width=grid_width)
    run = compiled(ar_step) if job.compile else ar_step
    state, seeds = start.state, start.seeds[: start.batch]
    mark_persistent(state)
    out, position, status = first_wave_token(start.logits, seeds, job)
    passes = max(1, min(passes, (job.num_tokens - 2) // runs))  # a short image: shorter runs
    samples = []
    t = 1
    while t + passes < job.num_tokens and len(samples) < runs:
        count = 1 if t == 1 else passes  # the first run: one pass, untimed
        began = clock()
        for _ in range(count):
            position, status = run(model, state, out, position, seeds, status, job, None if job.compile else t - 1)
            t += 1
        int(position[0])  # read back: the passes have run
        if count == passes:
            samples.append((t - 1 - passes // 2, (clock() - began) / passes))
    return samples


@torch.no_grad()
def decode_ar(model: SpeculativeARModel, condition: Any, job: DecodeJob) -> DecodeOutput:
    """Sample ``job.num_tokens`` image tokens per sample, one per forward pass."""
    num_tokens = job.num_tokens
    start = start_decoding(model, condition, job, window=1, grid_width=resolve_grid_width(model, num_tokens, job.grid_width))
    run = compiled(ar_step) if job.compile else ar_step
    slots, requests, device = start.batch, start.requests, start.device
    tokens = torch.empty(requests, num_tokens, dtype=torch.long, device=device)
    latency = torch.zeros(requests, dtype=torch.float64)
    state, logits, status = start.state, start.logits, torch.zeros((), dtype=torch.long, device=device)
    mark_persistent(state)  # CUDA graphs: the step writes the KV cache in place (vispec.decoding.compiled)
    slot_tokens = torch.arange(num_tokens, device=device)
    for first in range(0, requests, slots):  # waves of requests
        ids = torch.arange(first, min(first + slots, requests), device=device)
        if first > 0:
            index = torch.arange(ids.shape[0], device=device)
            if ids.shape[0] < slots:
                state = model.select(state, index)
                mark_persistent(state)  # new buffers: the graph is recorded again
            logits = model.refill(state, index, select_condition(start.condition, ids.cpu()))
        seeds = start.seeds[ids]
        out, position, wave_status = first_wave_token(logits, seeds, job)
        status = torch.maximum(status, wave_status)
        for t in range(1, num_tokens):
            position, status = run(model, state, out, position, seeds, status, job, None if job.compile else t - 1)
            if job.callback is not None:  # step = forward passes after the prefill, as in SJD
                done = committed_view(out, (slot_tokens <= t)[None, :].expand_as(out))
                view = torch.full((requests, num_tokens), -1, dtype=torch.long, device=device)
                view[:first] = tokens[:first]
                view[ids] = done
                committed = torch.zeros(requests, dtype=torch.long, device=device)
                committed[:first], committed[ids] = num_tokens, t + 1
                edit = job.callback(DecodeProgress(first // slots * (num_tokens - 1) + t, committed, view))
                edit = edited_tokens(edit, view, start.vocab)
                if edit is not None:  # rewrite committed tokens: earlier waves' outputs, this wave's cache
                    tokens[:first] = edit[:first]
                    keep = torch.minimum(first_change(edit[ids], view[ids]), torch.full_like(position, t))
                    out[:, : t + 1] = edit[ids, : t + 1]
                    refeed(model, state, out, torch.full_like(position, t), keep)
        raise_status(status)
        tokens[ids] = out
        latency[ids.cpu()] = start.clock.now()
    full = torch.full((requests,), num_tokens, dtype=torch.long)
    commits = torch.zeros(requests, 3, dtype=torch.long)
    commits[:, 1] = num_tokens - 1  # every pass after the prefill commits one token
    stats = DecodeStats(nfe=full.clone(), tokens=full, latency_s=latency, accepted_drafts=torch.zeros(requests, dtype=torch.long),
                        windows={1: (requests + slots - 1) // slots * (num_tokens - 1)}, commits=commits)
    return DecodeOutput(tokens=tokens, stats=stats, method="ar")
