"""Metrics, benchmarks, data generators and training (``vispec.eval``)."""
