"""Verification, coupling, sampling and unmasking primitives (``vispec.kernels``).

Each operation has one dispatch point; CUDA tensors run Triton kernels, everything else the
PyTorch reference beside them, which is the specification the kernels match given the same noise
(:mod:`vispec.kernels.backend` forces either):

* :class:`~vispec.kernels.target.Target`: speculative verification and sampling from raw logits
  (guidance, temperature, top-k, top-p fused; Triton in :mod:`vispec.kernels.verify_triton`);
* :func:`~vispec.kernels.unmask.unmask_candidates`: dLLM unmasking statistics (Triton in
  :mod:`vispec.kernels.unmask_triton`);
* :mod:`vispec.kernels.philox`: counter-based noise, reproduced bit for bit inside the kernels
  (:mod:`vispec.kernels.philox_triton`).

:mod:`vispec.kernels.verify` holds the same verification on probability tensors (the form the
exactness tests enumerate against).
"""

from vispec.kernels.backend import resolve_backend
from vispec.kernels.philox import Stream, exponentials, seeds_from_generators, uniforms
from vispec.kernels.target import Target, VerifyOutput, window_target
from vispec.kernels.unmask import RowNoise, UnmaskCandidates, unmask_candidates
from vispec.kernels.verify import VerifyResult, sample_from_weights, verify_drafts

__all__ = [
    "RowNoise",
    "Stream",
    "Target",
    "UnmaskCandidates",
    "VerifyOutput",
    "VerifyResult",
    "exponentials",
    "resolve_backend",
    "sample_from_weights",
    "seeds_from_generators",
    "uniforms",
    "unmask_candidates",
    "verify_drafts",
    "window_target",
]
