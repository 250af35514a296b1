"""Forwards and accuracy of vispec's policies against diffusers' ``LLaDA2Pipeline`` defaults on tiny-llada2.

The issue-32 target: vispec's threshold + cache policies give at least 3x fewer forwards than LLaDA2's defaults at
equal accuracy, on the same model (the embedded tiny-llada2, a LLaDA2-layout block-diffusion MoE) and the same
problems (the test split of the embedded tasks, problems decoded one at a time: batch 1, so every problem's forwards
are its own).

Settings (every one at the task's own canvas, gen length 32, and LLaDA2's block length 32, greedy):

* ``diffusers LLaDA2Pipeline defaults``: diffusers' own pipeline and ``BlockRefinementScheduler`` at its call
  defaults (threshold 0.7, editing_threshold 0.5, max_post_steps 16, num_inference_steps 32, minimal_topk 1,
  eos_early_stop True; gen_length 32 instead of 2048, block_length 32 from the scheduler's config); its forwards are
  counted by a hook on the model. Its answers are the texts before the first EOS / end-of-turn, as vispec reads them;
* ``editing (LLaDA2 defaults)``: vispec's :class:`vispec.dllm.TokenEditingScheduler` with the same settings
  (token-equal to diffusers; the ``same`` column counts the problems whose text equals diffusers');
* vispec's adaptive policies with the exact prefix cache: ``threshold`` (Fast-dLLM's rule) at several τ, ``factor``,
  ``entropy`` (EB-sampler's bound), and LLaDA2's rule with editing off or a lower commit threshold;
* ``diffusers LLaDA2Pipeline + vispec threshold``: diffusers' own pipeline driven by vispec's threshold policy through
  :class:`vispec.dllm.diffusers_scheduler.VispecPolicyScheduler` (compare with vispec's own run of that policy);
* ``eotp`` / ``prophet`` (end-of-text prediction, early commit): tried, and reported as refused when the block-causal
  loop refuses them.

Per setting: accuracy (the task's metrics), its paired difference from diffusers' defaults with a 95% interval
(``± 1.96 sd(a_i - b_i) / √n`` over the problems), mean forwards (NFE) per problem, the NFE reduction against
diffusers' defaults, generated tokens per forward (prompt and EOS excluded) and seconds per problem.

Usage: ``OMP_NUM_THREADS=1 python samples/bench_text_llada2.py [--num-problems 256] [--tasks arithmetic]
[--model tiny-llada2] [--out samples/bench-text-llada2.tiny-llada2]`` writes ``OUT.json`` and ``OUT.txt``.
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch
from diffusers import BlockRefinementScheduler, LLaDA2Pipeline

from vispec.dllm import ProphetRule, TokenEditingScheduler, count_tokens, make_scheduler
from vispec.dllm.diffusers_scheduler import VispecPolicyScheduler
from vispec.eval.bench.text_tasks import get_task, split_items
from vispec.eval.train.tokenizer import decode_answer
from vispec.pipelines import MaskedDiffusionLMPipeline

GEN_LENGTH, BLOCK_LENGTH = 32, 32

# (label, strategy factory, pipeline keywords)
VISPEC_SETTINGS = [
    ("editing (LLaDA2 defaults)@none", TokenEditingScheduler, dict(cache="none")),
    ("editing (LLaDA2 defaults)@prefix", TokenEditingScheduler, dict(cache="prefix")),
    ("editing, no T2T@prefix", lambda: TokenEditingScheduler(editing_threshold=None), dict(cache="prefix")),
    # LLaDA2.1's "speedy" use of its own rule: a low commit threshold, T2T edits to repair
    ("editing tau=0.3, T2T 0.5@prefix", lambda: TokenEditingScheduler(threshold=0.3), dict(cache="prefix")),
    ("editing tau=0.1, T2T 0.5@prefix", lambda: TokenEditingScheduler(threshold=0.1), dict(cache="prefix")),
    *[(f"threshold tau={tau:g}@prefix", lambda tau=tau: make_scheduler("threshold", threshold=tau), dict(cache="prefix"))
      for tau in (0.9, 0.7, 0.5, 0.4, 0.3, 0.2, 0.1)],
    ("threshold tau=0.3@none", lambda: make_scheduler("threshold", threshold=0.3), dict(cache="none")),
    *[(f"factor f={f:g}@prefix", lambda f=f: make_scheduler("factor", factor=f), dict(cache="prefix"))
      for f in (1.0, 2.0, 4.0, 8.0)],
    *[(f"entropy gamma={g:g}@prefix", lambda g=g: make_scheduler("entropy", gamma=g), dict(cache="prefix"))
      for g in (0.5, 1.0, 2.0, 4.0)],
]
REFUSED_RULES = [("threshold tau=0.5+eotp@prefix", dict(eotp=True)),
                 ("threshold tau=0.5+prophet@prefix", dict(early_commit=ProphetRule()))]


def _eot(pipe: MaskedDiffusionLMPipeline) -> int:
    return pipe.tokenizer.convert_tokens_to_ids("<|eot_id|>")


class ForwardCounter:
    """Counts the model's forwards (a pre-hook on the module): diffusers' pipeline reports none."""

    def __init__(self, model: torch.nn.Module):
        self.count = 0
        self.handle = model.register_forward_pre_hook(self._tick)

    def _tick(self, module, args):
        self.count += 1


def diffusers_run(pipe: MaskedDiffusionLMPipeline, items, scheduler=None, **call) -> list[dict]:
    """diffusers' LLaDA2Pipeline over vispec's components, one problem at a time: at its defaults, or driven by
    ``scheduler`` (a :class:`vispec.dllm.diffusers_scheduler.VispecPolicyScheduler`) with the call keywords ``call``."""
    reference = LLaDA2Pipeline(model=pipe.model, scheduler=scheduler or BlockRefinementScheduler(),
                               tokenizer=pipe.tokenizer)
    reference.set_progress_bar_config(disable=True)
    counter = ForwardCounter(pipe.model)
    eot = _eot(pipe)
    records = []
    for item in items:
        counter.count = 0
        start = time.perf_counter()
        out = reference(prompt=item.prompt, gen_length=GEN_LENGTH, output_type="seq", **call)
        wall = time.perf_counter() - start
        text = decode_answer(pipe.tokenizer, out.sequences[0].tolist())
        tokens = int(count_tokens(out.sequences, pipe.tokenizer.eos_token_id, eot)[0])  # as vispec counts them
        records.append({"text": text, "nfe": counter.count, "tokens": tokens, "seconds": wall})
    counter.handle.remove()
    return records


def vispec_run(pipe: MaskedDiffusionLMPipeline, items, strategy, options: dict) -> list[dict]:
    records = []
    for item in items:
        start = time.perf_counter()
        out = pipe(prompt=item.prompt, strategy=strategy(), gen_length=GEN_LENGTH, block_length=BLOCK_LENGTH,
                   early_stop_eos=True, **options)
        wall = time.perf_counter() - start
        # generated tokens before the first EOS, EOS and end-of-turn excluded, counted as for diffusers' rows (the
        # LLaDA2 config names no end-of-turn id, so the pipeline's own count would include <|eot_id|>)
        tokens = int(count_tokens(out.sequences, pipe.tokenizer.eos_token_id, _eot(pipe))[0])
        records.append({"text": out.texts[0], "nfe": int(out.stats[0]["nfe"]), "tokens": tokens, "seconds": wall})
    return records


def summarize(name: str, task, items, records: list[dict], base: list[dict] | None) -> dict:
    n = len(items)
    scores = [task.score(r["text"], item) for r, item in zip(records, items)]
    metric = task.metrics[0]
    row = {"setting": name, "task": task.name, "n": n, **{m: sum(s[m] for s in scores) / n for m in task.metrics},
           "nfe": sum(r["nfe"] for r in records) / n, "tokens": sum(r["tokens"] for r in records) / n,
           "seconds_per_problem": sum(r["seconds"] for r in records) / n,
           "per_problem": {"correct": [s[metric] for s in scores], "nfe": [r["nfe"] for r in records]}}
    row["tokens_per_forward"] = row["tokens"] / row["nfe"]
    if base is not None:
        base_scores = [task.score(r["text"], item)[metric] for r, item in zip(base, items)]
        diffs = [s[metric] - b for s, b in zip(scores, base_scores)]
        mean = sum(diffs) / n
        sd = math.sqrt(sum((d - mean) ** 2 for d in diffs) / max(n - 1, 1))
        row.update(accuracy_diff=mean, accuracy_diff_ci95=1.96 * sd / math.sqrt(n),
                   same_text=sum(r["text"] == b["text"] for r, b in zip(records, base)) / n)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="tiny-llada2")
    parser.add_argument("--tasks", default="arithmetic")
    parser.add_argument("--num-problems", type=int, default=256)
    parser.add_argument("--out", default="samples/bench-text-llada2.tiny-llada2")
    args = parser.parse_args()
    if args.num_problems < 1:
        raise ValueError(f"--num-problems must be >= 1, got {args.num_problems}")
    pipe = MaskedDiffusionLMPipeline.from_pretrained(args.model)
    pipe.set_progress_bar_config(disable=True)
    rows, refused = [], []
    for task_name in args.tasks.split(","):
        task = get_task(task_name)
        items = split_items(task, "test", args.num_problems, 0)
        base = diffusers_run(pipe, items)
        rows.append(summarize("diffusers LLaDA2Pipeline defaults", task, items, base, base))
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "per_problem"}), flush=True)
        for name, strategy, options in VISPEC_SETTINGS:
            rows.append(summarize(name, task, items, vispec_run(pipe, items, strategy, options), base))
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "per_problem"}), flush=True)
        # the interop direction: a vispec policy as the scheduler inside diffusers' own pipeline (its code unchanged;
        # the call's threshold is the policy's tau, and vispec's policies never edit)
        inside = VispecPolicyScheduler.from_policy(make_scheduler("threshold", threshold=0.5), block_length=BLOCK_LENGTH)
        rows.append(summarize("diffusers LLaDA2Pipeline + vispec threshold tau=0.5", task, items,
                              diffusers_run(pipe, items, inside, threshold=0.5), base))
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "per_problem"}), flush=True)
        for name, options in REFUSED_RULES:
            try:
                vispec_run(pipe, items[:1], lambda: make_scheduler("threshold", threshold=0.5), dict(cache="prefix", **options))
                refused.append({"setting": name, "task": task.name, "refused": None})
            except ValueError as err:
                refused.append({"setting": name, "task": task.name, "refused": str(err)})
    for row in rows:
        base = next(r for r in rows if r["task"] == row["task"] and r["setting"].startswith("diffusers"))
        row["nfe_reduction"] = base["nfe"] / row["nfe"]
        # "equal accuracy": the 95% interval of the paired difference reaches 0 or above (not significantly worse)
        row["equal_accuracy"] = row.get("accuracy_diff", 0.0) + row.get("accuracy_diff_ci95", 0.0) >= 0
    best = {}
    for row in rows:
        policy = row["setting"].split(" ")[0] in ("threshold", "factor", "entropy")
        if policy and row["equal_accuracy"] and row["nfe_reduction"] > best.get(row["task"], {}).get("nfe_reduction", 0):
            best[row["task"]] = {"setting": row["setting"], "nfe_reduction": row["nfe_reduction"],
                                 "accuracy_diff": row["accuracy_diff"], "accuracy_diff_ci95": row["accuracy_diff_ci95"]}
    result = {"config": {"model": args.model, "gen_length": GEN_LENGTH, "block_length": BLOCK_LENGTH, "batch_size": 1,
                         "temperature": 0.0, "num_problems": args.num_problems, "torch_threads": torch.get_num_threads()},
              "runs": rows, "refused": refused, "best_at_equal_accuracy": best}
    with open(args.out + ".json", "w") as f:
        json.dump(result, f, indent=1)
    with open(args.out + ".txt", "w") as f:
        f.write(format_table(result) + "\n")
    print(format_table(result))


def format_table(result: dict) -> str:
    header = (f"{'task':<11} {'setting':<52} {'acc':>6} {'diff vs diffusers':>18} {'same':>5} {'NFE':>6} "
              f"{'NFE x':>6} {'tok/fwd':>7} {'s/prob':>7}")
    lines = [header, "-" * len(header)]
    for r in result["runs"]:
        metric = get_task(r["task"]).metrics[0]
        diff = f"{100 * r['accuracy_diff']:+.1f} ± {100 * r['accuracy_diff_ci95']:.1f}" if "accuracy_diff" in r else "-"
        lines.append(f"{r['task']:<11} {r['setting']:<52} {r[metric]:>6.3f} {diff:>18} {r.get('same_text', 1):>5.2f} "
                     f"{r['nfe']:>6.2f} {r['nfe_reduction']:>6.2f} {r['tokens_per_forward']:>7.2f} "
                     f"{r['seconds_per_problem']:>7.3f}")
    c = result["config"]
    lines.append(f"{c['model']}, {c['num_problems']} test problems per task, batch 1, greedy, gen length {c['gen_length']}, "
                 f"block {c['block_length']}; acc: the task's first metric (arithmetic: strict-match); diff: accuracy "
                 "minus diffusers' defaults on the same problems, percentage points, 95% paired interval; same: share "
                 "of problems whose text equals diffusers'; NFE x: diffusers' NFE / the setting's")
    for task, b in result["best_at_equal_accuracy"].items():
        lines.append(f"{task}: fewest forwards among vispec's policies (threshold, factor, entropy) at equal accuracy "
                     f"(paired 95% interval reaching 0): {b['setting']}, {b['nfe_reduction']:.2f}x fewer forwards than "
                     f"diffusers' defaults ({100 * b['accuracy_diff']:+.1f} ± {100 * b['accuracy_diff_ci95']:.1f} points)")
    for r in result["refused"]:
        lines.append(f"{r['setting']}: " + (f"refused ({r['refused']})" if r["refused"] else "ran"))
    return "\n".join(lines)


if __name__ == "__main__":
    main()
