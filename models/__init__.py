"""Model definitions, checkpoint conversion and adapters (``vispec.models``)."""
