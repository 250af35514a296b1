"""Plain autoregressive decoding: one image token per forward pass.

The baseline every speed-up is measured against (LlamaGen ``generate``, arXiv 2406.06525): the
prefill's last logits give token 0; each further pass feeds the newest token and samples the next
from the processed target ``p`` (:func:`vispec.sampling.process_logits`, through
:class:`vispec.kernels.target.Target`). Sampling is the exponential race ``argmax_v p_v / E_v`` with
``E`` keyed by (sample seed, position), so a sample's tokens do not depend on the rest of the batch.
"""

from __future__ import annotations

from typing import Any

import torch

from vispec.decoding.common import DecodeJob, resolve_grid_width, sample_tokens, start_decoding
from vispec.outputs import DecodeOutput, DecodeProgress, DecodeStats, committed_view
from vispec.protocol import SpeculativeARModel


@torch.no_grad()
def decode_ar(model: SpeculativeARModel, condition: Any, job: DecodeJob) -> DecodeOutput:
    """Sample ``job.num_tokens`` image tokens per sample, one per forward pass."""
    num_tokens = job.num_tokens
    start = start_decoding(model, condition, job, window=1, grid_width=resolve_grid_width(model, num_tokens, job.grid_width))
    state, logits, batch, device = start.state, start.logits, start.batch, start.device
    tokens = torch.empty(batch, num_tokens, dtype=torch.long, device=device)
    ones = torch.ones(batch, dtype=torch.long, device=device)
    slots = torch.arange(num_tokens, device=device)
    for t in range(num_tokens):
        if t > 0:
            logits = model.forward_window(state, tokens[:, t - 1 : t])
            model.rollback(state, ones)
        tokens[:, t] = sample_tokens(logits, ones * t, ones * t, start.seeds, job)
        if job.callback is not None and t > 0:  # step = forward passes after the prefill, as in SJD
            job.callback(DecodeProgress(t, ones * (t + 1), committed_view(tokens, (slots <= t)[None, :].expand_as(tokens))))
    elapsed = start.clock.now()
    full = torch.full((batch,), num_tokens, dtype=torch.long)
    stats = DecodeStats(nfe=full.clone(), tokens=full, latency_s=torch.full((batch,), elapsed, dtype=torch.float64),
                        accepted_drafts=torch.zeros(batch, dtype=torch.long))
    return DecodeOutput(tokens=tokens, stats=stats, method="ar")
