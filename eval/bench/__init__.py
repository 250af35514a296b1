"""Benchmarks (``vispec bench ...``) and what they measure with: photo-crop data, the text task suite,
the tiny-c2i evaluator (accuracy, FID features), the memory probe and the report helpers. Imports no trainer."""
