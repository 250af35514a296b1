"""``vispec bench text``: accuracy and speed of unmasking strategies and caches on a masked diffusion LM.

For every task (test split of :mod:`vispec.eval.bench.text_tasks`), strategy (``llada`` = one token per step,
the baseline; ``threshold``; ``factor``; ``entropy``; ``contiguous``; ``learn2pd``, for models with a Learn2PD filter)
and cache (``none``, ``prefix``, ``dual``, ``dkv``), or for every explicit setting ``strategy[+rule...][@cache]`` (rules
``eotp``, ``prophet``, ``adablock``: :data:`RULES`), and for every value of a policy's knob swept by ``thresholds``
(threshold, contiguous), ``factors``, ``entropy_bounds`` or ``filter_thresholds`` (learn2pd), two or more runs:

* batch 1: problems one at a time; accuracy (strict-match and flexible-extract for arithmetic, as
  lm-eval scores GSM8K; exact match otherwise), NFE, tokens per forward, latency per problem and tokens/s;
* batch ``batch_size`` (or each of ``batch_sizes``, e.g. ``8, 32``): the same problems in batches (rows advance on
  their own and leave the forward when done): tokens/s and accuracy again, and the **batch-invariance check**: the
  problems whose text differs from their batch-1 text (``batch_mismatches``, and ``batch_invariant``, the share that
  agree). Every row decodes with its own generator keyed by position, so a row's tokens do not depend on the batch;
  a mismatch can only come from float rounding of the padded forwards flipping a near tie.

**How speed is counted** (as Fast-dLLM measures, and as users ask, Fast-dLLM issue #15): ``tokens`` of a problem are
its *generated* ids before its first EOS, EOS and end-of-turn excluded (:func:`vispec.dllm.count_tokens`): never the
prompt, never the left padding of a batch, never the EOS that early stop writes after the answer or the canvas left
after it. ``tokens_per_s`` is the sum of the problems' tokens over the sum of the wall times of the pipeline calls
that decoded them (tokenisation, chat template, decoding and detokenisation included; model loading and the warm-up
call excluded), so at batch ``B`` it is the throughput of ``B`` prompts decoded together. ``tokens_per_forward``
(TPF) is the tokens over the model forwards (NFE, cache refreshes included), per problem summed. Every run reports
peak memory. All settings share ``gen_length``, ``block_length`` and temperature 0.

**AUP** (accuracy under parallelism; Qian et al., "AUP: when Accuracy Meets Parallelism in Diffusion Language
Models", hao-ai-lab blog and the d3LLM code's ``aup_utils.py``, 2025): for each task and policy (a setting without
its knob value) the batch-1 runs give points ``(rho_i, y_i)``: TPF and accuracy in percent (the task's first metric),
sorted by ``rho``; points with ``y_i < y_1 - 5`` (five points below the least parallel one) are dropped, and
``AUP = rho_1 y_1 + 1/2 sum_{i>=2} (rho_i - rho_{i-1}) (y_i W(y_i) + y_{i-1} W(y_{i-1}))`` with
``W(y) = min(exp(-3 (1 - y / y_max)), 1)``, ``y_max`` the best accuracy of any run on the task
(:func:`accuracy_under_parallelism`). A policy run at one knob value has one point (``AUP = rho_1 y_1``); sweep the
knob for its curve.

The reference row is LLaDA's own baseline: ``llada``, one token per step (``steps = gen_length``), no cache
and **no** early stop, so the whole canvas is decoded as their ``generate()`` decodes it. It runs with the
strategies x caches grid; with ``settings`` only when ``reference`` asks for it (at a long ``gen_length`` it is most of
a run's time), and rows then have no ratios against it (a self-speculative row still has its stepwise twin's). Every other setting
runs with ``early_stop_eos`` (default on: a row stops once an EOS is committed with no mask before it,
filling the rest with EOS); early stop changes answers on some prompts (an EOS committed before earlier
masks changes their context), so ``llada`` + ``none`` *with* early stop is a row of its own. Speed-ups are
against the reference of the same task and batch size: ``speedup`` is the ratio of tokens/s (Fast-dLLM's
definition), ``latency_speedup`` the ratio of latency per problem, ``nfe_reduction`` the ratio of NFE.
:func:`accuracy_nfe_plot` draws accuracy against NFE, a panel per task.

Every row's setting is checked against the model before the first row runs (:func:`checked_rows`: the checks a
pipeline call runs before its first forward, on the pipeline without its weights): a cache, rule or policy the
model's family does not support is one error naming ``--settings`` and the setting, not a failure after the rows
before it were measured.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Callable, Optional, Union

from vispec.checks import check_number

if TYPE_CHECKING:
    from vispec.eval.bench.distributed import Workers

# Nothing heavy at import time: the CLI builds `vispec bench text`'s flags from TextBenchConfig, and
# `vispec ... --help` must not wait for torch (tests/cli/test_cli_startup.py). torch, the pipelines and the
# distributed helpers are imported by the functions that run the benchmark.

GRID_STRATEGIES = ("llada", "threshold", "factor", "entropy", "contiguous", "learn2pd")  # --strategies' default
# every strategy a setting may name: the grid's, and LLaDA2.1's token editing (block-causal models only; its settings
# are TokenEditingScheduler's defaults, LLaDA2's)
STRATEGIES = (*GRID_STRATEGIES, "editing")
# rules a setting may add to its strategy (``strategy+rule@cache``): Learn2PD's end-of-text prediction, Prophet's
# early commit, AdaBlock's adaptive blocks, and exact self-speculative decoding (``ssd`` or ``ssd=K``, K canvases per
# verifying forward; :mod:`vispec.dllm.speculative`), whose tokens are the same setting's without it
RULES = ("eotp", "prophet", "adablock", "ssd")
MAX_DRAFT_LENGTH = 256


def parse_rule(text: str, where: str) -> tuple[str, Union[int, str, None]]:
    """``"ssd=8"`` -> ``("ssd", 8)``, ``"ssd=auto"`` -> ``("ssd", "auto")``, ``"eotp"`` -> ``("eotp", None)``: a rule of
    :data:`RULES`, and for ``ssd`` an optional draft length (or ``auto``: chosen per round by cost,
    :mod:`vispec.dllm.draft_length`); anything else is a ``ValueError`` starting with ``where`` (the setting or the
    flag)."""
    name, eq, value = text.partition("=")
    if name not in RULES:
        raise ValueError(f"{where}: unknown rule {name!r}; expected some of {RULES} (ssd may take =K, a draft length, "
                         "or =auto)")
    if not eq:
        return name, None
    if name != "ssd":
        raise ValueError(f"{where}: rule {name!r} takes no value (only ssd=K does), got {text!r}")
    if value == "auto":
        return name, value
    if not value.isdigit() or not 1 <= int(value) <= MAX_DRAFT_LENGTH:
        raise ValueError(f"{where}: ssd=K needs a draft length K in [1, {MAX_DRAFT_LENGTH}] or auto, got {text!r}")
    return name, int(value)


def parse_setting(text: str) -> tuple[str, tuple[str, ...], str]:
    """``"learn2pd+eotp@dual"`` -> ``("learn2pd", ("eotp",), "dual")``: a strategy, optional ``+rule``s (``ssd=K`` with
    its draft length or ``ssd=auto``: :func:`parse_rule`) and an optional ``@cache`` (default ``none``). Anything else
    (an empty part: ``"threshold@"``, ``"threshold+"``, ``"@dual"``; a rule after the cache) is a ``ValueError`` naming
    the setting."""
    from vispec.dllm import CACHES

    head, at, cache = text.partition("@")
    strategy, *rules = head.split("+")
    if at and not cache:
        raise ValueError(f"settings: {text!r} names no cache after '@'; expected strategy[+rule...][@cache], a cache "
                         f"from {CACHES} (or no '@': no cache)")
    cache = cache or "none"
    if strategy not in STRATEGIES:
        raise ValueError(f"settings: unknown strategy {strategy!r} in {text!r}; expected one of {STRATEGIES}")
    names = [parse_rule(rule, f"settings: {text!r}")[0] for rule in rules]
    if len(set(names)) != len(names):
        raise ValueError(f"settings: a rule is repeated in {text!r}")
    if cache not in CACHES:
        raise ValueError(f"settings: unknown cache {cache!r} in {text!r}; expected one of {CACHES}")
    return strategy, tuple(rules), cache


@dataclass
class TextBenchConfig:
    model: str = "tiny-mdlm"
    strategies: tuple[str, ...] = GRID_STRATEGIES
    caches: tuple[str, ...] = ("none", "prefix", "dual")
    tasks: tuple[str, ...] = ("arithmetic", "sort", "reverse")
    num_problems: int = 100
    batch_size: int = 16
    batch_sizes: tuple[int, ...] = ()  # when given: the batched runs' sizes (batch 1 always runs), instead of batch_size
    gen_length: Optional[int] = None  # default: the pipeline's
    block_length: Optional[int] = None
    threshold: float = 0.9
    factor: float = 1.0
    entropy_bound: float = 0.1
    # knob values swept for AUP (each replaces the single knob above for its strategies; empty: the single knob)
    thresholds: tuple[float, ...] = ()  # threshold, contiguous
    factors: tuple[float, ...] = ()  # factor
    entropy_bounds: tuple[float, ...] = ()  # entropy
    filter_thresholds: tuple[float, ...] = ()  # learn2pd
    early_stop_eos: bool = True
    settings: tuple[str, ...] = ()  # "strategy[+rule...][@cache]"; when given, replaces the strategies x caches grid
    reference: bool = False  # with settings: run LLaDA's baseline row too (it runs with the grid, whose ratios need it)
    filter_threshold: float = 0.96  # Learn2PD's acceptance τ
    prophet_thresholds: tuple[float, ...] = (7.5, 5.0, 2.5)
    delimiters: tuple[str, ...] = (".",)  # AdaBlock's delimiter tokens (tiny-mdlm's step separator)
    delimiter_threshold: float = 0.3
    draft_length: int = 8  # the ssd rule's K when a setting says only "ssd": SelfSpeculation's default (tested equal)
    seed: int = 0
    device: str = "cpu"
    results_dir: Optional[str] = None  # per-problem results, written as they finish; a rerun skips them
    num_processes: Optional[int] = None  # the processes launched (torchrun); another world size is an error

    def validate(self) -> None:
        """The settings, before a model is loaded."""
        from vispec.dllm import CACHES

        for name in ("num_problems", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for size in self.batch_sizes:
            if not isinstance(size, int) or size < 1:
                raise ValueError(f"batch_sizes must be integers >= 1, got {self.batch_sizes!r}")
        if not isinstance(self.draft_length, int) or not 1 <= self.draft_length <= MAX_DRAFT_LENGTH:
            raise ValueError(f"draft_length must be an integer in [1, {MAX_DRAFT_LENGTH}] (the ssd rule's canvases per "
                             f"verifying forward), got {self.draft_length!r}")
        for strategy in self.strategies:
            if strategy not in STRATEGIES:
                raise ValueError(f"unknown strategy {strategy!r}; expected some of {STRATEGIES}")
        for cache in self.caches:
            if cache not in CACHES:
                raise ValueError(f"unknown cache {cache!r}; expected some of {CACHES}")
        for setting in self.settings:
            parse_setting(setting)
        self.rule_options({"eotp", "prophet", "adablock", "ssd"}, None)  # validates their settings
        running = {parse_setting(t)[0] for t in self.settings} if self.settings else set(self.strategies)
        for strategy in set(self.strategies) | running:
            for value in self.knob_values(strategy):  # validates the strategies' settings (threshold, factor, ...)
                setting_scheduler(self, strategy, value)
        for sweep in SWEEPS:
            users = sorted(s for s, knob in KNOBS.items() if knob[1] == sweep)
            if getattr(self, sweep) and not running & set(users):
                raise ValueError(f"{sweep} sweeps the knob of {' / '.join(users)}, which no setting runs")
        from vispec.eval.bench.report import check_device

        check_device(self.device)

    def knob_values(self, strategy: str) -> tuple:
        """The knob values ``strategy`` runs at: its sweep (``thresholds``, ``factors``, ...), or ``(None,)`` (the
        single knob, ``threshold``, ``factor``, ...; a strategy without a knob, ``llada``, always)."""
        knob = KNOBS.get(strategy)
        values = getattr(self, knob[1]) if knob else ()
        for value in values:
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"{knob[1]} must be numbers, got {values!r}")
        if len(set(values)) != len(values):
            raise ValueError(f"{knob[1]} repeats a value: {values!r}")
        return tuple(values) or (None,)

    def rule_options(self, rules, tokenizer) -> dict:
        """``pipe(...)`` keywords of a setting's rules (names, or ``ssd=K``; AdaBlock's delimiter ids come from
        ``tokenizer``)."""
        from vispec.dllm import AdaptiveBlocks, ProphetRule

        options = {}
        parsed = dict(parse_rule(rule, "rules") for rule in rules)  # name -> value (ssd's draft length or None)
        rules = set(parsed)
        if "ssd" in rules:
            from vispec.dllm import SelfSpeculation

            options["speculative"] = SelfSpeculation(parsed["ssd"] or self.draft_length)
        if "eotp" in rules:
            options["eotp"] = True
        if "prophet" in rules:
            options["early_commit"] = ProphetRule(thresholds=tuple(self.prophet_thresholds))
        if "adablock" in rules:
            if not self.delimiters:
                raise ValueError("delimiters must name at least one token for the adablock rule")
            ids = (0,) if tokenizer is None else tuple(_token_id(tokenizer, d) for d in self.delimiters)
            options["adaptive_block"] = AdaptiveBlocks(delimiter_ids=ids, threshold=self.delimiter_threshold)
        return options


def _token_id(tokenizer, token: str) -> int:
    ids = tokenizer.encode(token, add_special_tokens=False)
    if len(ids) != 1 or ids[0] == tokenizer.unk_token_id:
        raise ValueError(f"delimiters: {token!r} is not one token of this model's tokenizer")
    return ids[0]


# strategy -> (its knob's config field, the field sweeping it, the scheduler's argument, the knob's short name)
KNOBS = {"threshold": ("threshold", "thresholds", "threshold", "tau"),
         "contiguous": ("threshold", "thresholds", "threshold", "tau"),
         "factor": ("factor", "factors", "factor", "f"),
         "entropy": ("entropy_bound", "entropy_bounds", "gamma", "gamma"),
         "learn2pd": ("filter_threshold", "filter_thresholds", "threshold", "tau")}


SWEEPS = tuple(dict.fromkeys(knob[1] for knob in KNOBS.values()))


def setting_scheduler(cfg: TextBenchConfig, strategy: str, value: Optional[float] = None):
    """The scheduler of ``strategy`` with the config's knob (``threshold``, ``factor``, ``entropy_bound``,
    ``filter_threshold``), or with ``value`` for it (a swept value)."""
    from vispec.dllm import make_scheduler

    knob = KNOBS.get(strategy)
    if knob is None:
        if value is not None:
            raise ValueError(f"strategy {strategy!r} has no knob to set to {value!r}")
        return make_scheduler(strategy)
    return make_scheduler(strategy, **{knob[2]: getattr(cfg, knob[0]) if value is None else value})


def _row_bar(total: int, desc: str, enabled: Optional[bool]):
    """A tqdm bar (``tqdm.auto``, on stderr) over the problems of one run, removed when the run ends (its line
    follows); ``enabled=None``: only when stderr is a terminal, as ``vispec bench image``'s bar. Every update is
    drawn (``mininterval=0``): one comes per batch of problems, a model call apart, so none is worth skipping."""
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="problem", leave=False, disable=None if enabled is None else not enabled,
                dynamic_ncols=True, mininterval=0, miniters=1)


def _run(pipe, items, task, scheduler, cache: str, batch_size: int, cfg: TextBenchConfig, early_stop_eos: bool,
         options: dict, workers: Workers, store, group: str, tick: Optional[Callable[[int], None]] = None,
         ) -> Optional[dict]:
    """Decode ``items`` in units of ``batch_size`` (this process's share, :mod:`vispec.eval.bench.distributed`); on rank 0
    the row: accuracy and speed from every problem's record (None on the other ranks). ``tick(n)`` after each unit
    of ``n`` problems (decoded, or found in the results folder).

    Times are per unit: ``wall_s`` is the sum of the units' wall times (one process decoding every problem),
    tokens/s is the generated tokens over it, latency per problem is ``wall_s / n`` at batch 1 and the mean
    per-row latency inside the batch otherwise."""
    from vispec.eval.bench.distributed import one_process_seconds, run_units
    from vispec.eval.bench.memory import PeakMemory

    def compute(unit: range) -> dict:
        chunk = [items[i] for i in unit]
        with PeakMemory(cfg.device) as memory:
            start, cpu = time.perf_counter(), time.process_time()
            out = pipe(prompt=[item.prompt for item in chunk], strategy=scheduler, cache=cache, gen_length=cfg.gen_length,
                       block_length=cfg.block_length, early_stop_eos=early_stop_eos, **options)
            wall, cpu = time.perf_counter() - start, time.process_time() - cpu
        return {i: ({"text": text, "scores": task.score(text, item), "nfe": int(stats["nfe"]),
                     "tokens": int(stats["tokens"]), "latency_s": float(stats["latency_s"]), "unit_wall_s": wall,
                     "unit_cpu_s": cpu, "unit_size": len(unit), "peak_mem_mb": memory.peak_mb,
                     # rows the forwards carried (self-speculation forwards several canvases per row)
                     "canvases": int(stats.get("canvases", stats["nfe"]))}, {})
                for i, item, text, stats in zip(unit, chunk, out.texts, out.stats)}

    records = run_units(workers, len(items), batch_size, compute, store, group, tick=tick)
    if records is None:
        return None
    records = [record for record, _ in records]
    n = len(records)
    wall = one_process_seconds(records)
    nfe, tokens = sum(r["nfe"] for r in records), sum(r["tokens"] for r in records)
    row = {name: sum(r["scores"][name] for r in records) / n for name in records[0]["scores"]}
    cpu = sum(r.get("unit_cpu_s", 0.0) / r["unit_size"] for r in records)  # each unit's CPU time, once
    row.update(nfe=nfe / n, tokens=tokens / n, tokens_per_forward=tokens / max(nfe, 1), tokens_per_s=tokens / wall,
               latency_s=wall / n if batch_size == 1 else sum(r["latency_s"] for r in records) / n,
               wall_s=wall, cpu_s=cpu, canvases=sum(r.get("canvases", r["nfe"]) for r in records) / n,
               peak_mem_mb=max(r["peak_mem_mb"] for r in records), texts=[r["text"] for r in records],
               per_problem={name: [r["scores"][name] for r in records] for name in records[0]["scores"]})
    return row


def stepwise_rules(rules) -> tuple:
    """``rules`` without their ``ssd`` rule: the setting of a self-speculative row's stepwise twin (the same rules
    when there is none)."""
    return tuple(r for r in rules if parse_rule(r, "settings")[0] != "ssd")


def bench_rows(cfg: TextBenchConfig, reference: tuple) -> dict[tuple, Optional[str]]:
    """The rows' settings ``(strategy, rules, cache, early_stop_eos, knob value)`` in their order, each with the
    ``--settings`` item (or ``strategy@cache`` of the grid) it comes from; None for LLaDA's ``reference`` row. A
    self-speculative setting brings its stepwise twin first."""
    grid = ([(t, *parse_setting(t)) for t in cfg.settings] if cfg.settings
            else [(f"{s}@{c}", s, (), c) for s in cfg.strategies for c in cfg.caches])
    rows: dict[tuple, Optional[str]] = {reference: None} if cfg.reference or not cfg.settings else {}
    for text, strategy, rules, cache in grid:
        stepwise = stepwise_rules(rules)
        for value in cfg.knob_values(strategy):
            if stepwise != rules:  # a self-speculative row is compared with its stepwise twin, which runs first
                rows.setdefault((strategy, stepwise, cache, cfg.early_stop_eos, value), text)
            rows.setdefault((strategy, rules, cache, cfg.early_stop_eos, value), text)
    return rows


def checked_rows(cfg: TextBenchConfig, pipe, rows: dict[tuple, Optional[str]]) -> dict[tuple, dict]:
    """Each row's pipeline keywords of its rules, after checking its setting against ``pipe``'s model with the
    checks its calls run before their first forward (:meth:`MaskedDiffusionLMPipeline.check_decoding`: a cache, a
    rule or a policy the model's family does not support, ssd over dkv, a learn2pd filter, ...), all before the
    first row: a ``ValueError`` naming ``--settings`` (or ``--strategies`` / ``--cache``) and the setting."""
    if any(row[0] == "learn2pd" for row in rows) and pipe.filter is None:
        raise ValueError(f"the learn2pd strategy needs a Learn2PD filter, and {cfg.model} has none (train one with "
                         "`vispec train filter`)")
    checked = {}
    for (strategy, rules, cache, early_stop, value), text in rows.items():
        try:
            options = cfg.rule_options(set(rules), pipe.tokenizer)
            pipe.check_decoding(strategy=setting_scheduler(cfg, strategy, value), cache=cache, gen_length=cfg.gen_length,
                                block_length=cfg.block_length, early_stop_eos=early_stop, **options)
        except ValueError as err:
            where = ("the reference row (llada@none, LLaDA's baseline)" if text is None
                     else f"--settings {text!r}" if cfg.settings else f"--strategies / --cache {text!r}")
            twin = "" if text is None or list(rules) == list(parse_setting(text)[1]) else \
                f" (its stepwise twin {strategy}{''.join('+' + r for r in rules)}@{cache})"
            raise ValueError(f"{where}{twin} cannot run on {cfg.model}: {err}") from None
        checked[(strategy, rules, cache, early_stop, value)] = options
    return checked


def result_settings(cfg: TextBenchConfig) -> dict:
    """What a stored problem's result depends on (:class:`vispec.eval.bench.results.ResultStore`): everything but the
    number of problems (problem ``i`` is the same for any count, so a larger run reuses a smaller one's), the
    results folder and the process count."""
    import torch

    settings = {k: v for k, v in asdict(cfg).items() if k not in ("num_problems", "results_dir", "num_processes")
                and not (k in SWEEPS and not v)}  # no sweep: the settings of a results folder from before sweeps
    settings["device"] = torch.device(cfg.device).type
    return settings


def run_text_bench(cfg: TextBenchConfig, progress: Callable[[str], None] = print,
                   partial: Optional[Callable[[dict], None]] = None, progress_bar: Optional[bool] = None) -> Optional[dict]:
    """Run the benchmark (module docstring); ``partial(result)`` receives the runs so far after every run, and
    ``progress(line)`` a line per run; within a run (minutes, for the reference at a long ``gen_length``) a tqdm bar
    on stderr counts its problems (``progress_bar``: ``None`` = when stderr is a terminal; rank 0 only).

    Under ``torchrun`` every process decodes its share of each run's problems (:mod:`vispec.eval.bench.distributed`)
    and rank 0 computes the rows and returns the result; the other ranks return None. With ``results_dir``
    every problem's result is stored as its batch finishes and a rerun decodes only what is missing
    (:mod:`vispec.eval.bench.results`). Problem ``i`` decodes the same tokens for any process count."""
    from vispec.eval.bench.distributed import Workers, open_store
    from vispec.eval.bench.report import environment
    from vispec.eval.bench.text_tasks import get_task, split_items
    from vispec.models.checkpoints import check_pipeline_folder
    from vispec.pipelines import MaskedDiffusionLMPipeline
    from vispec.pipelines.embedded import resolve_model_path

    cfg.validate()
    workers = Workers.start(cfg.device, cfg.num_processes)
    say = progress if workers.is_main else (lambda message: None)
    tasks = [get_task(t) for t in cfg.tasks]
    folder = resolve_model_path(cfg.model)
    check_pipeline_folder(folder, "MaskedDiffusionLMPipeline", {"LlamaGenPipeline": "an image model: use `vispec bench image`"})
    reference = ("llada", (), "none", False, None)  # LLaDA's baseline: one token per step, no cache, no early stop
    settings = bench_rows(cfg, reference)

    def default_lengths(pipeline) -> None:
        cfg.gen_length = cfg.gen_length or pipeline.config.default_gen_length
        cfg.block_length = cfg.block_length or min(pipeline.config.default_block_length, cfg.gen_length)

    # every row's setting against the model before anything runs: on the pipeline without its weights (its model
    # built on the meta device) when it builds so, else on the loaded one, before the warm-up
    hollow, row_options = MaskedDiffusionLMPipeline.from_pretrained_without_weights(folder), None
    if hollow is not None:
        default_lengths(hollow)
        row_options = checked_rows(cfg, hollow, settings)
        del hollow
    pipe = MaskedDiffusionLMPipeline.from_pretrained(folder).to(workers.device)
    pipe.set_progress_bar_config(disable=True)
    default_lengths(pipe)
    if row_options is None:
        row_options = checked_rows(cfg, pipe, settings)
    store = open_store(workers, cfg.results_dir, result_settings(cfg))
    if workers.distributed:
        say(f"{workers.world_size} processes, each decoding every {workers.world_size}th batch of problems")
    pipe(prompt=split_items(tasks[0], "test", 1, cfg.seed)[0].prompt, strategy="threshold", gen_length=cfg.gen_length,
         block_length=cfg.block_length)  # warm-up, not timed
    runs = []
    config = {**asdict(cfg), **environment(workers.device), "num_processes": workers.world_size}
    for task in tasks:
        items = split_items(task, "test", cfg.num_problems, cfg.seed)
        for strategy, rules, cache, early_stop, value in settings:
            options = row_options[(strategy, rules, cache, early_stop, value)]
            for batch_size in dict.fromkeys((1, *(cfg.batch_sizes or (cfg.batch_size,)))):
                row = {"strategy": strategy, "rules": list(rules), "cache": cache, "early_stop_eos": early_stop,
                       "task": task.name, "batch_size": batch_size,
                       "reference": (strategy, rules, cache, early_stop, value) == reference}
                if value is not None:
                    row.update(knob=KNOBS[strategy][3], knob_value=value)
                group = f"{task.name}/{setting_name(row)}/B{batch_size}"
                share = sum(len(unit) for unit in workers.my_units(len(items), batch_size))
                with _row_bar(share, f"{task.name} {setting_name(row)} B={batch_size}",
                              progress_bar if workers.is_main else False) as bar:
                    measured = _run(pipe, items, task, setting_scheduler(cfg, strategy, value), cache, batch_size, cfg,
                                    early_stop, options, workers, store, group, tick=bar.update)
                if measured is None:
                    continue
                row.update(measured)
                alone = _batch_one_twin(runs, row)
                if alone is not None:  # the batch-invariance check: each problem's text alone and in the batch
                    row["batch_mismatches"] = [i for i, (a, b) in enumerate(zip(row["texts"], alone["texts"])) if a != b]
                    row["batch_invariant"] = 1 - len(row["batch_mismatches"]) / len(row["texts"])
                runs.append(row)
                acc = " ".join(f"{k} {row[k]:.3f}" for k in task.metrics)
                same = f", {len(row['batch_mismatches'])} differ from B=1" if "batch_mismatches" in row else ""
                say(f"{task.name} {setting_name(row)} B={batch_size}: {acc}, "
                    f"NFE {row['nfe']:.1f}, {row['tokens_per_s']:.1f} tok/s{same}")
                if partial:
                    partial({"config": config, "runs": list(runs)})
    if not workers.is_main:
        return None
    for row in runs:
        base = next((r for r in runs if (r["task"], r["batch_size"]) == (row["task"], row["batch_size"])
                     and r["reference"]), None)
        if base is not None:  # not run: --settings without --reference
            row["nfe_reduction"] = base["nfe"] / row["nfe"]
            # Fast-dLLM's speed-up is the ratio of tokens/s; the latency ratio also holds when outputs differ in length
            row["speedup"] = row["tokens_per_s"] / base["tokens_per_s"] if base["tokens_per_s"] > 0 else float("nan")
            row["latency_speedup"] = base["latency_s"] / row["latency_s"]
        twin = _stepwise_twin(runs, row)
        if twin is not None:  # the share of problems whose text is the stepwise run's (1.0: exact, as it must be)
            row["identical"] = sum(a == b for a, b in zip(row["texts"], twin["texts"])) / len(row["texts"])
            row["stepwise_nfe"] = twin["nfe"]
            row["stepwise_speedup"] = twin["latency_s"] / row["latency_s"]
    for row in runs:
        del row["texts"]
    config.update(temperature=0.0, baseline_steps=cfg.gen_length)
    return {"config": config, "runs": runs, "aup": aup_rows(runs)}


# the setting of a run, without its batch size (and, for AUP, without its knob value)
_POLICY_KEYS = ("task", "strategy", "cache", "early_stop_eos", "reference")


def _same_policy(a: dict, b: dict) -> bool:
    return all(a[k] == b[k] for k in _POLICY_KEYS) and list(a["rules"]) == list(b["rules"])


def _batch_one_twin(runs: list[dict], row: dict) -> Optional[dict]:
    """The batch-1 run of ``row``'s setting (same knob value), or None for a batch-1 row."""
    if row["batch_size"] == 1:
        return None
    return next((r for r in runs if r["batch_size"] == 1 and _same_policy(r, row)
                 and r.get("knob_value") == row.get("knob_value")), None)


def accuracy_under_parallelism(points: list[tuple[float, float]], y_max: float, alpha: float = 3.0,
                               drop: float = 5.0) -> tuple[float, list[tuple[float, float]]]:
    """d3LLM's AUP of ``points`` ``(rho, y)`` (tokens per forward, accuracy in percent) and the points it used
    (module docstring): sorted by ``rho`` (ties keep their order), those with ``rho <= 0`` or ``y < y_1 - drop``
    dropped, then ``rho_1 y_1`` plus the trapezoids of ``y W(y)``, ``W(y) = min(exp(-alpha (1 - y / y_max)), 1)``."""
    check_number("y_max", y_max, minimum=0, exclusive_minimum=True, hint=" (the best accuracy on the task, in %)")
    ordered = sorted(((float(r), float(y)) for r, y in points if r > 0), key=lambda p: p[0])
    if not ordered:
        return 0.0, []
    used = [p for p in ordered if p[1] >= ordered[0][1] - drop]

    def weighted(y: float) -> float:
        return y * min(math.exp(-alpha * (1 - y / y_max)), 1.0)

    aup = used[0][0] * used[0][1]
    for (r0, y0), (r1, y1) in zip(used, used[1:]):
        aup += 0.5 * (r1 - r0) * (weighted(y1) + weighted(y0))
    return aup, used


def aup_rows(runs: list[dict]) -> list[dict]:
    """AUP per task and policy from the batch-1 runs (module docstring): ``task``, ``policy`` (the setting's name
    without its knob value), ``metric``, ``points`` ``[[tpf, accuracy %, knob value], ...]`` (every run, sorted by
    TPF), ``used`` (how many entered AUP), ``y_max`` and ``aup``."""
    from vispec.eval.bench.text_tasks import get_task

    rows = []
    singles = [r for r in runs if r["batch_size"] == 1]
    for task in dict.fromkeys(r["task"] for r in singles):
        metric = get_task(task).metrics[0]
        mine = [r for r in singles if r["task"] == task]
        y_max = max(100 * r[metric] for r in mine)
        families: list[list[dict]] = []
        for r in mine:
            family = next((f for f in families if _same_policy(f[0], r)), None)
            if family is None:
                families.append([r])
            else:
                family.append(r)
        for family in families:
            points = sorted(((r["tokens_per_forward"], 100 * r[metric], r.get("knob_value")) for r in family),
                            key=lambda p: p[0])
            aup, used = (0.0, []) if y_max <= 0 else accuracy_under_parallelism([p[:2] for p in points], y_max)
            rows.append({"task": task, "policy": setting_name({k: v for k, v in family[0].items() if k != "knob"}),
                         "metric": metric, "knob": family[0].get("knob"), "points": [list(p) for p in points],
                         "used": len(used), "y_max": y_max, "aup": aup})
    return rows


def _stepwise_twin(runs: list[dict], row: dict) -> Optional[dict]:
    """The run of ``row``'s setting without its ``ssd`` rule (same task, batch size, cache and early stop), or None
    when ``row`` has no ``ssd`` rule."""
    rules = list(stepwise_rules(row["rules"]))
    if len(rules) == len(row["rules"]):
        return None
    keys = ("task", "batch_size", "strategy", "cache", "early_stop_eos")
    return next((r for r in runs if all(r[k] == row[k] for k in keys) and list(r["rules"]) == rules
                 and r.get("knob_value") == row.get("knob_value")), None)


def format_text_table(result: dict) -> str:
    """The bench's tables: every run; then, when several batch sizes ran, throughput by batch size with the
    batch-invariance check; then AUP per task and policy."""
    header = (f"{'task':<11} {'strategy':<18} {'rules':<17} {'cache':<6} {'stop':<4} {'B':>3} {'strict':>7} {'flex':>6} "
              f"{'exact':>6} {'nfe':>7} {'NFE x':>6} {'canv':>6} {'tok/fwd':>7} {'tok/s':>8} {'speedup':>7} {'lat s':>7} "
              f"{'cpu s':>7} {'same':>5} {'vs sw':>5} {'inv':>5} {'MB':>6}")
    lines = [header, "-" * len(header)]
    for r in result["runs"]:
        cell = lambda k: f"{r[k]:.3f}" if k in r else "-"
        stop = "EOS" if r.get("early_stop_eos") else "-"
        rules = "+".join(r.get("rules", ())) or "-"
        strategy = r["strategy"] + (f":{r['knob']}={r['knob_value']:g}" if r.get("knob") else "")
        n = max(1, round(r["wall_s"] / r["latency_s"])) if r.get("latency_s") else 1
        cpu = f"{r['cpu_s'] / n:.3f}" if "cpu_s" in r and r["batch_size"] == 1 else "-"
        same = f"{r['identical']:.2f}" if "identical" in r else "-"
        ratio = lambda k, width: f"{r[k]:>{width}.2f}" if k in r else f"{'-':>{width}}"  # noqa: E731
        inv = f"{r['batch_invariant']:.2f}" if "batch_invariant" in r else "-"
        lines.append(f"{r['task']:<11} {strategy:<18} {rules:<17} {r['cache']:<6} {stop:<4} {r['batch_size']:>3} "
                     f"{cell('strict_match'):>7} {cell('flexible_extract'):>6} {cell('exact_match'):>6} {r['nfe']:>7.1f} "
                     f"{ratio('nfe_reduction', 6)} {r.get('canvases', r['nfe']):>6.1f} {r['tokens_per_forward']:>7.2f} "
                     f"{r['tokens_per_s']:>8.1f} {ratio('speedup', 7)} {r['latency_s']:>7.3f} {cpu:>7} {same:>5} "
                     f"{ratio('stepwise_speedup', 5)} {inv:>5} "
                     f"{r['peak_mem_mb']:>6.0f}")
    lines.append("reference: llada, no cache, no early stop (LLaDA's baseline); stop EOS: early stop at EOS; "
                 "rules: eotp (end-of-text prediction), prophet (early commit), adablock (adaptive blocks), ssd=K "
                 "(exact self-speculation, K canvases per forward); canv: canvas rows forwarded per problem; cpu s: "
                 "CPU seconds per problem (B=1); same: share of problems whose text equals the setting without ssd; "
                 "vs sw: its latency speed-up over that stepwise twin; NFE x, speedup: over the reference (- where "
                 "--settings ran without --reference); "
                 "inv: share of problems whose text equals their batch-1 text; tok/s: generated tokens (prompt, "
                 "padding and EOS excluded) per second of the pipeline calls")
    throughput = format_throughput_table(result)
    if throughput:
        lines += ["", throughput]
    if result.get("aup"):
        lines += ["", format_aup_table(result)]
    return "\n".join(lines)


def format_throughput_table(result: dict) -> str:
    """Tokens/s of each setting at each batch size side by side, with TPF and the problems whose text differs from
    batch 1 (empty when only one batch size ran)."""
    sizes = sorted({r["batch_size"] for r in result["runs"]})
    if len(sizes) < 2:
        return ""
    header = f"{'task':<11} {'setting':<34} " + " ".join(f"{'tok/s B=' + str(b):>12}" for b in sizes) + \
        f" {'tok/fwd':>7}  differ from B=1 (problem indices)"
    lines = [header, "-" * len(header)]
    for r in (r for r in result["runs"] if r["batch_size"] == 1):
        same = [t for t in result["runs"] if _same_policy(t, r) and t.get("knob_value") == r.get("knob_value")]
        speed = {t["batch_size"]: t["tokens_per_s"] for t in same}
        differ = {t["batch_size"]: t["batch_mismatches"] for t in same if t.get("batch_mismatches")}
        note = "; ".join(f"B={b}: {v[:10]}{'...' if len(v) > 10 else ''}" for b, v in sorted(differ.items())) or "none"
        lines.append(f"{r['task']:<11} {setting_name(r):<34} " +
                     " ".join(f"{speed[b]:>12.1f}" if b in speed else f"{'-':>12}" for b in sizes) +
                     f" {r['tokens_per_forward']:>7.2f}  {note}")
    return "\n".join(lines)


def format_aup_table(result: dict) -> str:
    """AUP per task and policy (d3LLM's accuracy under parallelism; module docstring)."""
    header = f"{'task':<11} {'policy':<30} {'metric':<16} {'points':>6} {'used':>4} {'y_max':>6} {'AUP':>8}  (tok/fwd, acc %)"
    lines = [header, "-" * len(header)]
    for a in result["aup"]:
        points = ", ".join(f"({p[0]:.2f}, {p[1]:.1f})" for p in a["points"][:6]) + (" ..." if len(a["points"]) > 6 else "")
        lines.append(f"{a['task']:<11} {a['policy']:<30} {a['metric']:<16} {len(a['points']):>6} {a['used']:>4} "
                     f"{a['y_max']:>6.1f} {a['aup']:>8.2f}  {points}")
    lines.append("AUP: rho_1 y_1 + trapezoids of y W(y), W(y) = min(exp(-3 (1 - y / y_max)), 1), over the policy's "
                 "batch-1 runs by tokens per forward, points 5 below the least parallel one dropped (d3LLM)")
    return "\n".join(lines)


def setting_name(row: dict) -> str:
    """A run's setting as one label: ``strategy[:knob=value][+rule...]@cache`` with ``+stop`` for early stop at EOS
    (the knob value only for a swept knob)."""
    rules = "".join(f"+{m}" for m in row.get("rules", ()))
    knob = f":{row['knob']}={row['knob_value']:g}" if row.get("knob") else ""
    return f"{row['strategy']}{knob}{rules}{'+stop' if row.get('early_stop_eos') else ''}@{row['cache']}"


def accuracy_nfe_plot(result: dict, path: str, panel: tuple[int, int] = (560, 480)) -> str:
    """A PNG with one panel per task: mean NFE per problem (x, log scale) against the task's first metric (y:
    strict-match for arithmetic, exact match otherwise), one labelled point per setting at batch 1; the reference
    (LLaDA's baseline) in red. Drawn with PIL (no plotting dependency)."""
    import math

    from PIL import Image, ImageDraw

    from vispec.eval.bench.text_tasks import get_task

    runs = [r for r in result["runs"] if r["batch_size"] == 1]
    tasks = list(dict.fromkeys(r["task"] for r in runs))
    if not tasks:
        raise ValueError("the result has no batch-1 runs to plot")
    w, h = panel
    left, right, top, bottom = 55, 15, 30, 45
    image = Image.new("RGB", (w * len(tasks), h), "white")
    draw = ImageDraw.Draw(image)
    nfes = [r["nfe"] for r in runs]
    x_lo, x_hi = math.log10(min(nfes) / 1.3), math.log10(max(nfes) * 1.3)
    for i, task in enumerate(tasks):
        metric = get_task(task).metrics[0]
        ox = i * w

        def at(nfe: float, acc: float) -> tuple[float, float]:
            x = ox + left + (math.log10(nfe) - x_lo) / (x_hi - x_lo) * (w - left - right)
            return x, top + (1.0 - acc) * (h - top - bottom)

        draw.line([(ox + left, h - bottom), (ox + w - right, h - bottom)], fill="black")
        draw.line([(ox + left, top), (ox + left, h - bottom)], fill="black")
        for k in range(6):
            _, py = at(10 ** x_lo, k / 5)
            draw.text((ox + 10, py - 6), f"{k / 5:.1f}", fill="black")
        for k in range(math.floor(x_lo), math.ceil(x_hi) + 1):
            for m in (1, 2, 5):
                v = m * 10 ** k
                if x_lo <= math.log10(v) <= x_hi:
                    px, _ = at(v, 0)
                    draw.line([(px, h - bottom), (px, h - bottom + 4)], fill="black")
                    draw.text((px - 6, h - bottom + 6), f"{v:g}", fill="black")
        draw.text((ox + left, 8), f"{task}: {metric} vs NFE (batch 1, log x)", fill="black")
        draw.text((ox + w // 2 - 50, h - 18), "NFE per problem", fill="black")
        n_points = sum(r["task"] == task for r in runs)
        # points are numbered (labels of close points would overlap); the legend lists the numbers
        for k, r in enumerate(r for r in runs if r["task"] == task):
            px, py = at(r["nfe"], r.get(metric, 0.0))
            colour = (200, 30, 30) if r.get("reference") else (0, 90, 170)
            draw.ellipse([px - 3, py - 3, px + 3, py + 3], fill=colour)
            draw.text((px + 4, py - 14 - 10 * (k % 3)), str(k + 1), fill=colour)
            draw.text((ox + left + 8, h - bottom - 12 - 11 * (n_points - 1 - k)),
                      f"{k + 1} {setting_name(r)} ({r.get(metric, 0.0):.2f}, {r['nfe']:.1f})", fill=colour)
    image.save(path)
    return path
