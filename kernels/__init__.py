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

This folder is installed as ``vispec.kernels`` (``package-dir`` in ``pyproject.toml``). With the checkout's root
on ``sys.path`` (Python started in it) the folder is also found as a top-level ``kernels``, the import name of
Hugging Face's ``kernels`` package, which transformers probes for (``is_kernels_available``: ``find_spec``, then
the distribution's version, then as a last resort ``import kernels`` and its ``__version__``). Imported under
that name the module imports no vispec: it hands over to Hugging Face's package where one is installed further
down ``sys.path`` (so ``from kernels import get_kernel`` still finds it) and otherwise stays empty, without a
``__version__``, so the probe reads version ``N/A`` and answers False (``tests/project/test_kernels_probe.py``).
"""

if __name__ != "kernels":  # not the folder found as Hugging Face's top-level ``kernels`` (docstring)
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
else:  # the checkout's folder imported as Hugging Face's top-level ``kernels`` (docstring)
    import importlib.machinery
    import importlib.util
    import os
    import sys

    _checkout = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    _elsewhere = [p for p in sys.path if os.path.abspath(p or os.curdir) != _checkout]
    _spec = importlib.machinery.PathFinder.find_spec("kernels", _elsewhere)
    if _spec is not None and _spec.loader is not None:  # the import statement returns sys.modules["kernels"]
        sys.modules["kernels"] = importlib.util.module_from_spec(_spec)
        _spec.loader.exec_module(sys.modules["kernels"])
    del importlib, os, sys, _checkout, _elsewhere, _spec  # the empty stand-in exposes nothing
