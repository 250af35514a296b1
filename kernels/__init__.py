"""Verification, coupling and sampling primitives: PyTorch references and their dispatch (``vispec.kernels``)."""
