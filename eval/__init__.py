"""Benchmarks and training of the embedded models (``vispec.eval``).

* :mod:`vispec.eval.bench`: the benchmarks with their data, tasks, evaluator and report helpers;
* :mod:`vispec.eval.train`: the trainers, the task tokenizer and the assembly of pipeline folders;
* :mod:`vispec.eval.demo`: ``vispec demo``.

Benchmarks import no trainer; trainers may use the benchmarks' data and evaluator model.
"""
