"""Per-position logits processors: defined in :mod:`vispec.processors` (the core, so model adapters can name
them); re-exported here for decoders and users."""

from vispec.processors import AllowedTokenRange, PeriodicForcedToken

__all__ = ["AllowedTokenRange", "PeriodicForcedToken"]
