"""Plain autoregressive decoding: one image token per forward pass.

The baseline every speed-up is measured against (LlamaGen ``generate``, arXiv 2406.06525): the
prefill's last logits give token 0; each further pass feeds the newest token and samples the next
from the processed target ``p`` (:func:`vispec.sampling.process_logits`, through :class:`vispec.kernels.target.Target`). Sampling is the
exponential race ``argmax_v p_v / E_v`` with ``E`` keyed by (sample seed, position), so a sample's
tokens do not depend on the rest of the batch.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from vispec.decoding.common import DecodeOutput, DecodeStats, GeneratorArg, StepCallback, start_decoding
from vispec.kernels.philox import Stream
from vispec.kernels.target import window_target
from vispec.protocol import SpeculativeARModel
from vispec.sampling import PositionProcessor, SamplingConfig


@torch.no_grad()
def decode_ar(
    model: SpeculativeARModel,
    condition: Any,
    *,
    num_tokens: int,
    sampling: SamplingConfig,
    generator: GeneratorArg = None,
    processors: tuple[PositionProcessor, ...] = (),
    grid_width: Optional[int] = None,
    callback: Optional[StepCallback] = None,
    backend: str = "auto",
) -> DecodeOutput:
    """Sample ``num_tokens`` image tokens per sample, one per forward pass.

    ``backend`` picks the sampling kernels (:mod:`vispec.kernels.backend`)."""
    start = start_decoding(model, condition, num_tokens=num_tokens, grid_width=grid_width or num_tokens,
                           sampling=sampling, generator=generator, window=1)
    state, logits, seeds, clock, vocab = start.state, start.logits, start.seeds, start.clock, start.vocab
    batch, device = start.batch, start.device
    tokens = torch.empty(batch, num_tokens, dtype=torch.long, device=device)
    ones = torch.ones(batch, dtype=torch.long, device=device)
    every_row = torch.ones(batch, dtype=torch.bool, device=device)
    for t in range(num_tokens):
        if t > 0:
            logits = model.forward_window(state, tokens[:, t - 1 : t])
            model.rollback(state, ones)
        positions = torch.full((batch, 1), t, dtype=torch.long, device=device)
        target = window_target(logits.cond, logits.uncond, positions, ones, seeds, sampling, processors, backend=backend,
                               validate=False)
        tokens[:, t] = target.sample(fresh=every_row, fresh_stream=Stream.SAMPLE, fresh_draws=ones * t)[1]
        if callback is not None and t > 0:  # step = forward passes after the prefill, as in SJD
            progress = torch.where(torch.arange(num_tokens, device=device) <= t, tokens, torch.full_like(tokens, -1))
            callback(t, torch.full((batch,), t + 1, dtype=torch.long, device=device), progress)
    elapsed = clock.now()
    full = torch.full((batch,), num_tokens, dtype=torch.long)
    stats = DecodeStats(nfe=full.clone(), tokens=full, accepted_drafts=torch.zeros(batch, dtype=torch.long), latency_s=torch.full((batch,), elapsed, dtype=torch.float64))
    return DecodeOutput(tokens=tokens, stats=stats, method="ar")
