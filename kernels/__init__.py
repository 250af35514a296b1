"""Verification, coupling and sampling primitives (``vispec.kernels``).

Each operation has one dispatch function; the PyTorch reference beside it is the specification
that device kernels must match exactly given the same noise.
"""

from vispec.kernels.philox import Stream, exponentials, seeds_from_generators, uniforms
from vispec.kernels.verify import VerifyResult, sample_from_weights, verify_drafts

__all__ = [
    "Stream",
    "VerifyResult",
    "exponentials",
    "sample_from_weights",
    "seeds_from_generators",
    "uniforms",
    "verify_drafts",
]
