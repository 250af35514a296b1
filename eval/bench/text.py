"""``vispec bench text``: accuracy and speed of unmasking strategies and caches on a masked diffusion LM.

For every task (test split of :mod:`vispec.eval.bench.text_tasks`), strategy (``llada`` = one token per step,
the baseline; ``threshold``; ``factor``; ``entropy``; ``contiguous``) and cache (``none``, ``prefix``, ``dual``), two runs:

* batch 1: problems one at a time; accuracy (strict-match and flexible-extract for arithmetic, as
  lm-eval scores GSM8K; exact match otherwise), NFE, tokens per forward, latency per problem and
  tokens/s (generated tokens before EOS, EOS excluded, over the wall time of the whole loop:
  tokenisation and decoding included, as Fast-dLLM measures);
* batch ``batch_size``: the same problems in batches (rows advance on their own and leave the
  forward when done): tokens/s and accuracy again (identical tokens up to float ties).

Every run reports peak memory. All settings share ``gen_length``, ``block_length`` and temperature 0.

The reference row is LLaDA's own baseline: ``llada``, one token per step (``steps = gen_length``), no cache
and **no** early stop, so the whole canvas is decoded as their ``generate()`` decodes it. Every other setting
runs with ``early_stop_eos`` (default on: a row stops once an EOS is committed with no mask before it,
filling the rest with EOS); early stop changes answers on some prompts (an EOS committed before earlier
masks changes their context), so ``llada`` + ``none`` *with* early stop is a row of its own. Speed-ups are
against the reference of the same task and batch size: ``speedup`` is the ratio of tokens/s (Fast-dLLM's
definition), ``latency_speedup`` the ratio of latency per problem, ``nfe_reduction`` the ratio of NFE.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Callable, Optional

from vispec.eval.bench.memory import PeakMemory
from vispec.eval.bench.report import check_device, environment

STRATEGIES = ("llada", "threshold", "factor", "entropy", "contiguous")


@dataclass
class TextBenchConfig:
    model: str = "tiny-mdlm"
    strategies: tuple[str, ...] = STRATEGIES
    caches: tuple[str, ...] = ("none", "prefix", "dual")
    tasks: tuple[str, ...] = ("arithmetic", "sort", "reverse")
    num_problems: int = 100
    batch_size: int = 16
    gen_length: Optional[int] = None  # default: the pipeline's
    block_length: Optional[int] = None
    threshold: float = 0.9
    factor: float = 1.0
    entropy_bound: float = 0.1
    early_stop_eos: bool = True
    seed: int = 0
    device: str = "cpu"

    def validate(self) -> None:
        """The settings, before a model is loaded."""
        from vispec.dllm import CACHES

        for name in ("num_problems", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for strategy in self.strategies:
            if strategy not in STRATEGIES:
                raise ValueError(f"unknown strategy {strategy!r}; expected some of {STRATEGIES}")
        for cache in self.caches:
            if cache not in CACHES:
                raise ValueError(f"unknown cache {cache!r}; expected some of {CACHES}")
        check_device(self.device)


def _scheduler(cfg: TextBenchConfig, strategy: str):
    from vispec.dllm import make_scheduler

    settings = {"threshold": {"threshold": cfg.threshold}, "factor": {"factor": cfg.factor},
                "entropy": {"gamma": cfg.entropy_bound}, "contiguous": {"threshold": cfg.threshold}}.get(strategy, {})
    return make_scheduler(strategy, **settings)


def _run(pipe, items, task, scheduler, cache: str, batch_size: int, cfg: TextBenchConfig, early_stop_eos: bool) -> dict:
    """Decode ``items`` in batches of ``batch_size``; accuracy and speed."""
    scores: dict[str, float] = {}
    nfe, tokens, latency = [], [], []
    with PeakMemory(cfg.device) as memory:
        start = time.perf_counter()
        for lo in range(0, len(items), batch_size):
            chunk = items[lo : lo + batch_size]
            out = pipe(prompt=[item.prompt for item in chunk], strategy=scheduler, cache=cache, gen_length=cfg.gen_length,
                       block_length=cfg.block_length, early_stop_eos=early_stop_eos)
            for item, text, stats in zip(chunk, out.texts, out.stats):
                for name, value in task.score(text, item).items():
                    scores[name] = scores.get(name, 0.0) + value
                nfe.append(stats["nfe"])
                tokens.append(stats["tokens"])
                latency.append(stats["latency_s"])
        wall = time.perf_counter() - start
    n = len(items)
    row = {name: value / n for name, value in scores.items()}
    row.update(nfe=sum(nfe) / n, tokens=sum(tokens) / n, tokens_per_forward=sum(tokens) / max(sum(nfe), 1),
               tokens_per_s=sum(tokens) / wall, latency_s=wall / n if batch_size == 1 else sum(latency) / n,
               wall_s=wall, peak_mem_mb=memory.peak_mb)
    return row


def run_text_bench(cfg: TextBenchConfig, progress: Callable[[str], None] = print,
                   partial: Optional[Callable[[dict], None]] = None) -> dict:
    """Run the benchmark (module docstring); ``partial(result)`` receives the runs so far after every run."""
    from vispec.eval.bench.text_tasks import get_task, split_items
    from vispec.models.checkpoints import check_pipeline_folder
    from vispec.pipelines import MaskedDiffusionLMPipeline
    from vispec.pipelines.embedded import resolve_model_path

    cfg.validate()
    tasks = [get_task(t) for t in cfg.tasks]
    folder = resolve_model_path(cfg.model)
    check_pipeline_folder(folder, "MaskedDiffusionLMPipeline", {"LlamaGenPipeline": "an image model: use `vispec bench image`"})
    pipe = MaskedDiffusionLMPipeline.from_pretrained(folder).to(cfg.device)
    pipe.set_progress_bar_config(disable=True)
    cfg.gen_length = cfg.gen_length or pipe.config.default_gen_length
    cfg.block_length = cfg.block_length or min(pipe.config.default_block_length, cfg.gen_length)
    reference = ("llada", "none", False)  # LLaDA's baseline: one token per step, no cache, no early stop
    settings = list(dict.fromkeys([reference] + [(s, c, cfg.early_stop_eos) for s in cfg.strategies for c in cfg.caches]))
    pipe(prompt=split_items(tasks[0], "test", 1, cfg.seed)[0].prompt, strategy="threshold", gen_length=cfg.gen_length,
         block_length=cfg.block_length)  # warm-up, not timed
    runs = []
    for task in tasks:
        items = split_items(task, "test", cfg.num_problems, cfg.seed)
        for strategy, cache, early_stop in settings:
            for batch_size in dict.fromkeys((1, cfg.batch_size)):
                row = {"strategy": strategy, "cache": cache, "early_stop_eos": early_stop, "task": task.name,
                       "batch_size": batch_size, "reference": (strategy, cache, early_stop) == reference}
                row.update(_run(pipe, items, task, _scheduler(cfg, strategy), cache, batch_size, cfg, early_stop))
                runs.append(row)
                acc = " ".join(f"{k} {row[k]:.3f}" for k in task.metrics)
                progress(f"{task.name} {strategy}+{cache}{' +stop' if early_stop else ''} B={batch_size}: {acc}, "
                         f"NFE {row['nfe']:.1f}, {row['tokens_per_s']:.1f} tok/s")
                if partial:
                    partial({"config": {**asdict(cfg), **environment(cfg.device)}, "runs": list(runs)})
    for row in runs:
        base = next(r for r in runs if (r["task"], r["batch_size"]) == (row["task"], row["batch_size"]) and r["reference"])
        row["nfe_reduction"] = base["nfe"] / row["nfe"]
        # Fast-dLLM's speed-up is the ratio of tokens/s; the latency ratio also holds when outputs differ in length
        row["speedup"] = row["tokens_per_s"] / base["tokens_per_s"] if base["tokens_per_s"] > 0 else float("nan")
        row["latency_speedup"] = base["latency_s"] / row["latency_s"]
    config = asdict(cfg)
    config.update(**environment(cfg.device), temperature=0.0, baseline_steps=cfg.gen_length)
    return {"config": config, "runs": runs}


def format_text_table(result: dict) -> str:
    header = (f"{'task':<11} {'strategy':<10} {'cache':<7} {'stop':<4} {'B':>3} {'strict':>7} {'flex':>6} {'exact':>6} {'nfe':>7} "
              f"{'NFE x':>6} {'tok/fwd':>7} {'tok/s':>8} {'speedup':>7} {'lat s':>7} {'MB':>6}")
    lines = [header, "-" * len(header)]
    for r in result["runs"]:
        cell = lambda k: f"{r[k]:.3f}" if k in r else "-"
        stop = "EOS" if r.get("early_stop_eos") else "-"
        lines.append(f"{r['task']:<11} {r['strategy']:<10} {r['cache']:<7} {stop:<4} {r['batch_size']:>3} {cell('strict_match'):>7} "
                     f"{cell('flexible_extract'):>6} {cell('exact_match'):>6} {r['nfe']:>7.1f} {r['nfe_reduction']:>6.2f} "
                     f"{r['tokens_per_forward']:>7.2f} {r['tokens_per_s']:>8.1f} {r['speedup']:>7.2f} {r['latency_s']:>7.3f} "
                     f"{r['peak_mem_mb']:>6.0f}")
    lines.append("reference: llada, no cache, no early stop (LLaDA's baseline); stop EOS: early stop at EOS")
    return "\n".join(lines)
