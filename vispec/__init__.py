"""vispec: many tokens per forward pass for visual AR models and masked diffusion LMs."""

from vispec.version import __version__

__all__ = ["__version__"]
