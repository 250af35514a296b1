"""Self-speculation against its stepwise twin, interleaved: the wall-clock ratio ``vispec bench text`` measures
once, row after row, measured here round by round in one process.

    OMP_NUM_THREADS=1 python samples/ssd_side_by_side.py --model tiny-mdlm-long \\
        --settings threshold+ssd=auto@dual,llada+ssd=auto --batch-sizes 1,4,16 --num-problems 8 --rounds 3

Every ``--settings`` item (``vispec bench text``'s grammar, with an ``ssd`` rule) is paired with its stepwise
twin (the same setting without ``ssd``). For each batch size both decode the same problems (``--num-problems``
test problems of every ``--tasks`` task, in units of the batch size), once untimed (``ssd=auto`` learns this
process's cost line and acceptance there, as a long-running process would have), then ``--rounds`` timed rounds
in which the two alternate (their order flips every round), so that a drift of the machine hits both alike.
Printed per (setting, batch size): wall and CPU seconds per problem (medians over rounds), the speed-up
``stepwise / ssd`` (median of the per-round ratios, wall and CPU), forwards and canvas rows per problem, and the
share of problems whose text equals the twin's (1.00: self-speculation is exact with respect to its twin). With
``ssd=auto`` a decode may run as the stepwise loop (``vispec.dllm.draft_length``): the ssd forwards are then the
stepwise ones.
``--json`` keeps every round's times.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

from vispec.eval.bench.report import write_json


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny-mdlm", help="embedded model name or a pipeline folder")
    parser.add_argument("--settings", default="threshold+ssd=auto@dual",
                        help="comma list of strategy[+rule...][@cache] settings, each with an ssd rule")
    parser.add_argument("--tasks", default="arithmetic,sort,reverse")
    parser.add_argument("--num-problems", type=int, default=8, help="test problems per task")
    parser.add_argument("--batch-sizes", default="1,4,16")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", default=None, help="write the rounds and the table here")
    args = parser.parse_args(argv)
    for flag in ("num_problems", "rounds", "threads"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    try:
        args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    except ValueError:
        parser.error(f"--batch-sizes must be a comma list of integers, got {args.batch_sizes!r}")
    if min(args.batch_sizes) < 1:
        parser.error(f"--batch-sizes must be >= 1, got {args.batch_sizes}")
    args.settings = [s for s in args.settings.split(",") if s]
    args.tasks = [t for t in args.tasks.split(",") if t]
    return args


def decode_all(pipe, problems, batch: int, contender: dict) -> dict:
    """Decode every problem in units of ``batch``; wall and CPU seconds, texts, forwards and canvases."""
    texts, nfe, canvases = [], 0, 0
    wall, cpu = time.perf_counter(), time.process_time()
    for first in range(0, len(problems), batch):
        out = pipe(prompt=[item.prompt for item in problems[first:first + batch]], **contender)
        texts += out.texts
        nfe += sum(int(s["nfe"]) for s in out.stats)
        canvases += sum(int(s.get("canvases", s["nfe"])) for s in out.stats)
    return {"wall_s": time.perf_counter() - wall, "cpu_s": time.process_time() - cpu, "texts": texts,
            "nfe": nfe / len(problems), "canvases": canvases / len(problems)}


def main(argv=None) -> dict:
    args = parse_args(argv)
    from vispec.eval.bench.text import (TextBenchConfig, bench_rows, checked_rows, parse_setting,
                                        setting_scheduler, stepwise_rules)
    from vispec.eval.bench.text_tasks import split_items
    from vispec.pipelines import MaskedDiffusionLMPipeline

    for text in args.settings:
        rules = parse_setting(text)[1]
        if stepwise_rules(rules) == tuple(rules):
            raise SystemExit(f"--settings {text!r} has no ssd rule: nothing to compare with its stepwise twin")
    cfg = TextBenchConfig(model=args.model, settings=tuple(args.settings), tasks=tuple(args.tasks))
    cfg.validate()
    torch.set_num_threads(args.threads)
    pipe = MaskedDiffusionLMPipeline.from_pretrained(args.model)
    pipe.set_progress_bar_config(disable=True)
    cfg.gen_length = pipe.config.default_gen_length
    cfg.block_length = min(pipe.config.default_block_length, cfg.gen_length)
    rows = bench_rows(cfg, ("llada", (), "none", False, None))
    options = checked_rows(cfg, pipe, rows)
    problems = [item for task in args.tasks for item in split_items(task, "test", args.num_problems, cfg.seed)]

    def contender(key) -> dict:
        strategy, _, cache, early_stop, value = key
        return dict(strategy=setting_scheduler(cfg, strategy, value), cache=cache, gen_length=cfg.gen_length,
                    block_length=cfg.block_length, early_stop_eos=early_stop, **options[key])

    pairs = []  # (setting text, stepwise key, ssd key)
    for key, text in rows.items():
        stepwise = stepwise_rules(key[1])
        if text is not None and stepwise != tuple(key[1]):
            pairs.append((text, (key[0], stepwise, *key[2:]), key))
    load = os.getloadavg()[0]
    print(f"{args.model}: {len(problems)} problems ({', '.join(args.tasks)}), gen length {cfg.gen_length}, block "
          f"{cfg.block_length}, {args.threads} thread(s), rounds {args.rounds}", file=sys.stderr)
    results = []
    for text, stepwise, speculative in pairs:
        for batch in args.batch_sizes:
            sides = {"stepwise": contender(stepwise), "ssd": contender(speculative)}
            first = {name: decode_all(pipe, problems, batch, c) for name, c in sides.items()}  # untimed
            rounds = []
            for r in range(args.rounds):
                order = list(sides) if r % 2 == 0 else list(reversed(sides))
                rounds.append({name: decode_all(pipe, problems, batch, sides[name]) for name in order})
                print(f"[{text} B={batch}] round {r + 1}/{args.rounds}: " + ", ".join(
                    f"{n} {rounds[-1][n]['wall_s']:.2f} s" for n in order), file=sys.stderr)
            same = sum(a == b for a, b in zip(first["stepwise"]["texts"], first["ssd"]["texts"])) / len(problems)
            stable = all(x[n]["texts"] == first[n]["texts"] for x in rounds for n in sides)
            med = lambda name, what: statistics.median(x[name][what] for x in rounds) / len(problems)  # noqa: E731
            ratio = lambda what: statistics.median(x["stepwise"][what] / x["ssd"][what] for x in rounds)  # noqa: E731
            results.append({"setting": text, "batch_size": batch, "same": same, "repeatable": stable,
                            "stepwise_wall_s": med("stepwise", "wall_s"), "ssd_wall_s": med("ssd", "wall_s"),
                            "stepwise_cpu_s": med("stepwise", "cpu_s"), "ssd_cpu_s": med("ssd", "cpu_s"),
                            "speedup_wall": ratio("wall_s"), "speedup_cpu": ratio("cpu_s"),
                            "stepwise_nfe": first["stepwise"]["nfe"],
                            "ssd_nfe": statistics.median(x["ssd"]["nfe"] for x in rounds),
                            "ssd_canvases": statistics.median(x["ssd"]["canvases"] for x in rounds),
                            "rounds": [{n: {k: x[n][k] for k in ("wall_s", "cpu_s")} for n in x} for x in rounds]})
    print(f"\n{args.model}  {len(problems)} problems  rounds {args.rounds}  load avg {load:.2f} -> "
          f"{os.getloadavg()[0]:.2f} ({os.cpu_count()} cores)")
    header = (f"  {'setting':28s} {'B':>3s} {'sw s/pb':>8s} {'ssd s/pb':>8s} {'sw cpu':>7s} {'ssd cpu':>7s} "
              f"{'x wall':>6s} {'x cpu':>6s} {'sw fwd':>6s} {'ssd fwd':>7s} {'canv':>6s} {'same':>5s}")
    print(header)
    for row in results:
        print(f"  {row['setting']:28s} {row['batch_size']:>3d} {row['stepwise_wall_s']:8.3f} {row['ssd_wall_s']:8.3f} "
              f"{row['stepwise_cpu_s']:7.3f} {row['ssd_cpu_s']:7.3f} {row['speedup_wall']:5.2f}x {row['speedup_cpu']:5.2f}x "
              f"{row['stepwise_nfe']:6.1f} {row['ssd_nfe']:7.1f} {row['ssd_canvases']:6.1f} {row['same']:5.2f}"
              + ("" if row["repeatable"] else "  (texts changed between rounds!)"))
    print("  s/pb: seconds per problem (median over rounds); x: stepwise time / ssd time, median of per-round ratios; "
          "fwd: forwards per problem (ssd: median over the timed rounds); canv: canvas rows the ssd forwards carried per "
          "problem (the same); same: share of problems whose text equals the stepwise twin's")
    report = {"model": args.model, "tasks": args.tasks, "num_problems": len(problems), "threads": args.threads,
              "gen_length": cfg.gen_length, "block_length": cfg.block_length, "rows": results,
              "torch": torch.__version__, "machine": os.uname().machine, "cores": os.cpu_count()}
    if args.json:
        write_json(report, args.json)
        print(f"wrote {args.json}")
    return report


if __name__ == "__main__":
    main()
