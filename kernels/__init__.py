"""Verification, coupling, sampling and unmasking primitives (``vispec.kernels``).

Each operation is a triad: the contract and PyTorch reference, the Triton kernels with their
launchers (which take tensors), and one dispatch point; CUDA tensors run Triton, everything else the
reference, which is the specification the kernels match given the same noise
(:mod:`vispec.kernels.backend` forces either):

* speculative verification: :mod:`vispec.kernels.verify` (contract, glossary, reference),
  :mod:`vispec.kernels.verify_triton` (kernels), :class:`~vispec.kernels.target.Target` (dispatch,
  from raw logits with guidance, temperature, top-k and top-p fused);
* dLLM unmasking statistics: :func:`~vispec.kernels.unmask.unmask_candidates` (reference and
  dispatch), :mod:`vispec.kernels.unmask_triton`;
* :mod:`vispec.kernels.philox`: counter-based noise, reproduced bit for bit inside the kernels
  (:mod:`vispec.kernels.philox_triton`).

Nothing here knows a decoding policy (acceptance rules, couplings, windows): that is
:mod:`vispec.decoding`.
"""

from vispec.kernels.backend import resolve_backend
from vispec.kernels.philox import GeneratorArg, Stream, exponentials, per_sample_seeds, seeds_from_generators, uniforms
from vispec.kernels.target import Target, window_target
from vispec.kernels.unmask import RowNoise, UnmaskCandidates, unmask_candidates
from vispec.kernels.verify import Drafts, InjectedNoise, SampleRequest, sample_from_weights

__all__ = [
    "Drafts",
    "GeneratorArg",
    "InjectedNoise",
    "RowNoise",
    "SampleRequest",
    "Stream",
    "Target",
    "UnmaskCandidates",
    "exponentials",
    "per_sample_seeds",
    "resolve_backend",
    "sample_from_weights",
    "seeds_from_generators",
    "uniforms",
    "unmask_candidates",
    "window_target",
]
