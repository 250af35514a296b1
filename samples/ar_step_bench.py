"""Cost of vispec's AR decode step on tiny-c2i, eager and ``compile=True``: time, and counts that do not depend on load.

    python samples/ar_step_bench.py [--batch-sizes 1,4,16] [--rounds 5] [--modes eager,compiled] [--no-counts]
    python samples/ar_step_bench.py --tree /tmp/wt-65a9978              # run another commit's work tree
    python samples/ar_step_bench.py --trees /tmp/wt-65a9978,/work/main  # interleave two trees round by round
    python samples/ar_step_bench.py --official /tmp/llamagen-official   # also time official LlamaGen generate()
    python samples/ar_step_bench.py --decoding mc-sjd:window=16 --trees /tmp/wt-old,/work/main --no-counts

One thread. Each (mode, batch) is decoded once to warm up (compiles), then ``--rounds`` rounds run every
(mode, batch[, tree]) once in turn (interleaved, so load drifts hit all alike); printed: the median per-token CPU
time (``time.process_time``) and wall time of a 256-token decode. With ``--trees`` every tree runs in its own
long-lived worker process (``--worker``) and the rounds alternate between the workers; ratios are against the
first tree. A 2-token decode is timed in each round too (its CPU time is the per-decode part: prefill,
set-up, one step), so a change of the fixed cost is told apart from one of the step. ``--decoding`` times another
decoder's steps the same way (every decode uses the same seeds, so the warm-up compiles every window it meets);
its figures are then per committed token, not per pass (its counts too: take them with ``--no-counts`` off only to
compare trees).

Counts, per AR step (the difference between a 48- and a 16-token decode, divided by 32 steps, so prefill and
set-up cancel): ``ops`` the torch.profiler events (aten and custom ops, nested ones included) that run on the
host, eager or, for compiled steps, around and inside inductor's code (extern matmuls, opaque custom ops and
whatever eager work they do); ``top`` the top-level ones; ``calls`` Python function calls (cProfile). For
``compiled`` also what inductor generated for the step graphs (fresh compile, caches off): graphs, C++ kernels,
extern/fallback calls, graph inputs, characters of output code, and inductor's IR nodes before fusion.

Uses only API present at 65a9978 (``LlamaGenPipeline.from_pretrained``, ``decode``, ``LlamaGenCondition``,
``SamplingConfig``), so it runs on any commit since. ``--tree`` maps the package (and its ``vispec.models``,
``vispec.kernels``, ``vispec.pipelines``, ``vispec.eval`` folders) to the given work tree before vispec is imported.
"""

from __future__ import annotations

import argparse
import cProfile
import importlib.abc
import importlib.util
import json
import logging
import os
import pstats
import re
import statistics
import subprocess
import sys
import time
from collections import Counter

SUBPACKAGES = {"vispec": "vispec", "vispec.models": "models", "vispec.kernels": "kernels",
               "vispec.pipelines": "pipelines", "vispec.eval": "eval"}
COUNT_TOKENS = (48, 16)


def use_tree(tree: str) -> None:
    """Import ``vispec`` from work tree ``tree`` (pyproject's package-dir mapping), ahead of the editable install."""
    tree = os.path.abspath(tree)
    if any(name == "vispec" or name.startswith("vispec.") for name in sys.modules):
        raise RuntimeError("vispec was imported before use_tree")

    class TreeFinder(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name not in SUBPACKAGES:
                return None
            folder = os.path.join(tree, SUBPACKAGES[name])
            return importlib.util.spec_from_file_location(name, os.path.join(folder, "__init__.py"),
                                                          submodule_search_locations=[folder])

    sys.meta_path.insert(0, TreeFinder())


# ---------------------------------------------------------------------------------------------- worker


class Worker:
    """Runs the measurements in this process (vispec already mapped to the tree to measure)."""

    def __init__(self, guidance: float, official: str | None, decoding: str = "ar"):
        import torch

        torch.set_num_threads(1)
        import vispec
        from vispec.decoding import decode
        from vispec.models.llamagen_gpt import LlamaGenCondition
        from vispec.pipelines import LlamaGenPipeline
        from vispec.sampling import SamplingConfig

        self.torch, self.decode, self.Condition, self.Sampling = torch, decode, LlamaGenCondition, SamplingConfig
        self.vispec_file = vispec.__file__
        self.gpt = LlamaGenPipeline.from_pretrained("vispec/tiny-c2i").transformer
        self.guidance, self.decoding = guidance, decoding
        self.official = None
        if official:
            self._load_official(official)

    def _load_official(self, root: str) -> None:
        """The official LlamaGen ``Transformer`` with the same weights, and its ``generate``."""
        torch = self.torch
        sys.path.insert(0, root)
        from autoregressive.models.generate import generate
        from autoregressive.models.gpt import ModelArgs, Transformer

        cfg = self.gpt.config
        args = ModelArgs(dim=cfg.dim, n_layer=cfg.n_layer, n_head=cfg.n_head, n_kv_head=cfg.n_kv_head,
                         multiple_of=cfg.multiple_of, ffn_dim_multiplier=cfg.ffn_dim_multiplier, rope_base=cfg.rope_base,
                         norm_eps=cfg.norm_eps, token_dropout_p=0.0, attn_dropout_p=0.0, resid_dropout_p=0.0,
                         ffn_dropout_p=0.0, num_classes=cfg.num_classes, class_dropout_prob=cfg.class_dropout_prob,
                         model_type=cfg.model_type, vocab_size=cfg.vocab_size, cls_token_num=cfg.cls_token_num,
                         block_size=cfg.block_size)
        model = Transformer(args)
        missing, unexpected = model.load_state_dict(self.gpt.state_dict(), strict=False)
        if unexpected or any(not k.startswith("freqs_cis") for k in missing):
            raise RuntimeError(f"official model: missing {missing}, unexpected {unexpected}")
        model.eval()
        self.official = {"eager": model, "compiled": torch.compile(model, fullgraph=True), "generate": generate}

    def _run(self, mode: str, batch: int, tokens: int):
        torch = self.torch
        if mode.startswith("official-"):
            model = self.official["compiled" if mode.endswith("compiled") else "eager"]
            torch.manual_seed(0)
            labels = torch.arange(batch) % 10
            # a graph per (batch, length): more than dynamo's default limit here; raised per decode, not per step
            with torch._dynamo.config.patch(recompile_limit=64):
                return self.official["generate"](model, labels, tokens, cfg_scale=self.guidance, temperature=1.0,
                                                 top_k=0, top_p=1.0, sample_logits=True)
        condition = self.Condition(class_labels=torch.arange(batch) % 10)
        generators = [torch.Generator().manual_seed(i) for i in range(batch)]
        return self.decode(self.gpt, condition, num_tokens=tokens, sampling=self.Sampling(guidance_scale=self.guidance),
                           decoding=self.decoding, generator=generators, compile=mode == "compiled")

    def time(self, mode: str, batch: int, tokens: int) -> dict:
        cpu, wall = time.process_time(), time.perf_counter()
        self._run(mode, batch, tokens)
        return {"cpu": time.process_time() - cpu, "wall": time.perf_counter() - wall}

    def warm(self, mode: str, batch: int, tokens: int, compile_stats: bool) -> dict:
        """First decodes at every length the counts and timings use; with ``compile_stats`` (compiled modes) the
        first one compiles afresh with inductor's output code captured."""
        out: dict = {}
        if compile_stats and mode.endswith("compiled"):
            out["compile"] = self._compile_stats(lambda: self._run(mode, batch, tokens))
        for n in (tokens, *COUNT_TOKENS, 2):
            self._run(mode, batch, n)
        return out

    def _compile_stats(self, fn) -> dict:
        torch = self.torch
        import torch._inductor.config as inductor_config
        from torch._inductor import metrics

        codes: list[str] = []

        class Keep(logging.Handler):
            def emit(self, record):
                message = record.getMessage()
                if "def call(" in message:
                    codes.append(message)

        import torch._inductor.graph as inductor_graph

        logger = inductor_graph.output_code_log
        handler = Keep(level=logging.DEBUG)
        torch._logging.set_logs(output_code=True)
        logger.addHandler(handler)
        previous = logger.propagate
        logger.propagate = False
        metrics.reset()
        try:
            with inductor_config.patch(fx_graph_cache=False), torch._functorch.config.patch(enable_autograd_cache=False):
                fn()
        finally:
            logger.removeHandler(handler)
            logger.propagate = previous
            torch._logging.set_logs(output_code=False)
        graphs = []
        for code in codes:
            inputs = re.search(r"^\s+((?:\w+, )*\w+),? = args\s*$", code, re.M)
            graphs.append({"chars": len(code),
                           "cpp_kernels": len(re.findall(r"async_compile\.cpp(?:_pybinding)?\(", code)),
                           "extern_calls": len(re.findall(r"extern_kernels\.\w+\(", code)),
                           "fallback_ops": len(re.findall(r"torch\.ops\.\w+\.\w+(?:\.\w+)?\(", code)),
                           "inputs": len(inputs.group(1).split(", ")) if inputs else None})
        return {"graphs": len(graphs), "per_graph": graphs,
                "cpp_kernels": sum(g["cpp_kernels"] for g in graphs),
                "extern_calls": sum(g["extern_calls"] for g in graphs),
                "fallback_ops": sum(g["fallback_ops"] for g in graphs),
                "chars": sum(g["chars"] for g in graphs),
                "ir_nodes": int(getattr(metrics, "ir_nodes_pre_fusion", 0)),
                "generated_kernel_count": int(getattr(metrics, "generated_kernel_count", 0))}

    def counts(self, mode: str, batch: int) -> dict:
        """Per-step profiler events and Python calls: (48-token decode - 16-token decode) / 32."""
        from torch.profiler import ProfilerActivity, profile

        long, short = COUNT_TOKENS
        steps = long - short
        ops, top, calls, names = {}, {}, {}, {}
        for n in COUNT_TOKENS:
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                self._run(mode, batch, n)
            events = [e for e in prof.events() if "::" in e.name]
            ops[n], top[n] = len(events), sum(1 for e in events if e.cpu_parent is None)
            names[n] = Counter(e.name for e in events)
            profiler = cProfile.Profile()
            profiler.enable()
            self._run(mode, batch, n)
            profiler.disable()
            calls[n] = pstats.Stats(profiler).total_calls
        per_op = {name: (names[long][name] - names[short][name]) / steps for name in names[long]}
        busiest = sorted(((v, k) for k, v in per_op.items() if v > 0), reverse=True)[:12]
        return {"ops": (ops[long] - ops[short]) / steps, "top": (top[long] - top[short]) / steps,
                "calls": (calls[long] - calls[short]) / steps, "busiest": [[k, v] for v, k in busiest]}


def worker_loop(worker: Worker) -> None:
    """``--worker``: one JSON command per stdin line, one JSON answer per stdout line."""
    out = sys.stdout
    sys.stdout = sys.stderr  # stray prints must not corrupt the protocol
    print(json.dumps({"ready": True, "vispec": worker.vispec_file}), file=out, flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        method = getattr(worker, cmd.pop("cmd"))
        print(json.dumps(method(**cmd)), file=out, flush=True)


class Remote:
    """A worker process on one work tree."""

    def __init__(self, tree: str, args: argparse.Namespace):
        path, *settings = tree.split("@")  # PATH@VAR=VALUE@...: environment settings for this worker only
        env = dict(os.environ, **dict(s.split("=", 1) for s in settings))
        command = [sys.executable, os.path.abspath(__file__), "--worker", "--tree", path, "--guidance", str(args.guidance),
                   "--decoding", args.decoding]
        if args.official:
            command += ["--official", args.official]
        self.proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        hello = json.loads(self.proc.stdout.readline())
        self.vispec_file = hello["vispec"]

    def __getattr__(self, name):
        def call(**kwargs):
            self.proc.stdin.write(json.dumps({"cmd": name, **kwargs}) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"worker died during {name}({kwargs})")
            return json.loads(line)
        return call

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


# ---------------------------------------------------------------------------------------------- driver


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-sizes", default="1,4,16")
    parser.add_argument("--modes", default="eager,compiled",
                        help="eager, compiled (vispec), official-eager, official-compiled (need --official)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--guidance", type=float, default=3.0)
    parser.add_argument("--decoding", default="ar", help="the decoder whose steps are timed (a decoding spec, default ar)")
    parser.add_argument("--no-counts", action="store_true", help="timings only")
    parser.add_argument("--count-batches", default="1", help="batch sizes the counts are taken at")
    parser.add_argument("--tree", default=None, help="a work tree to import vispec from (this process)")
    parser.add_argument("--trees", default=None, help="comma-separated work trees, one worker each, interleaved; PATH@VAR=VALUE sets an "
                        "environment variable for that worker")
    parser.add_argument("--official", default=None, help="a checkout of FoundationVision/LlamaGen (official contender)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.tree:
        use_tree(args.tree)
    if args.worker:
        worker_loop(Worker(args.guidance, args.official, args.decoding))
        return
    trees = args.trees.split(",") if args.trees else [args.tree or "."]
    workers = ([Remote(t, args) for t in trees] if args.trees else [Worker(args.guidance, args.official, args.decoding)])
    for tree, w in zip(trees, workers):
        print(f"tree {tree}: vispec from {w.vispec_file}")
    batches = [int(b) for b in args.batch_sizes.split(",")]
    modes = args.modes.split(",")
    count_batches = [int(b) for b in args.count_batches.split(",")] if not args.no_counts else []
    result: dict = {"trees": trees, "decoding": args.decoding, "tokens": args.tokens, "threads": 1, "warm": {}, "counts": {}, "times": {}}
    for mode in modes:
        for batch in batches:
            for tree, w in zip(trees, workers):
                key = f"{tree}|{mode}|{batch}"
                result["warm"][key] = w.warm(mode=mode, batch=batch, tokens=args.tokens,
                                             compile_stats=batch in count_batches)
                if batch in count_batches:
                    result["counts"][key] = w.counts(mode=mode, batch=batch)
                result["times"][key] = []
    for r in range(args.rounds):
        for batch in batches:
            for mode in modes:
                for tree, w in (zip(trees, workers) if r % 2 == 0 else reversed(list(zip(trees, workers)))):
                    timed = w.time(mode=mode, batch=batch, tokens=args.tokens)
                    short = w.time(mode=mode, batch=batch, tokens=2)  # the per-decode part: prefill, set-up, one step
                    result["times"][f"{tree}|{mode}|{batch}"].append({**timed, "cpu2": short["cpu"], "wall2": short["wall"]})
    for w in workers:
        if isinstance(w, Remote):
            w.close()
    report(result, trees, modes, batches, args.tokens)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(result, handle, indent=1)


def report(result: dict, trees: list[str], modes: list[str], batches: list[int], tokens: int) -> None:
    if result["counts"]:
        print("\nper AR step (48 - 16 tokens) / 32; compiled: inductor's output for the step graphs at that batch")
        print(f"{'tree':28} {'mode':18} {'B':>3} {'ops':>7} {'top':>7} {'py calls':>9} | {'graphs':>6} {'kernels':>7} "
              f"{'extern':>6} {'fallbk':>6} {'inputs':>9} {'code chars':>10} {'ir nodes':>8}")
        for key, c in result["counts"].items():
            tree, mode, batch = key.split("|")
            comp = result["warm"].get(key, {}).get("compile")
            extra = ""
            if comp:
                inputs = "+".join(str(g["inputs"]) for g in comp["per_graph"])
                extra = (f"{comp['graphs']:>6} {comp['cpp_kernels']:>7} {comp['extern_calls']:>6} {comp['fallback_ops']:>6} "
                         f"{inputs:>9} {comp['chars']:>10} {comp['ir_nodes']:>8}")
            print(f"{tree[-28:]:28} {mode:18} {batch:>3} {c['ops']:7.1f} {c['top']:7.1f} {c['calls']:9.1f} | {extra}")
            print("      busiest: " + ", ".join(f"{n} {v:.1f}" for n, v in c["busiest"][:8]))
    print(f"\nms per token over {len(next(iter(result['times'].values())))} rounds ({tokens}-token decodes, 1 thread): "
          "CPU time median and minimum (the minimum is the least disturbed by other load), wall median; ratios = this "
          "row's CPU time / the first tree's (median, min)")
    print(f"{'tree':28} {'mode':18} {'B':>3} {'cpu med':>8} {'cpu min':>8} {'wall med':>8} {'ratio':>6} {'r(min)':>6} "
          f"{'2-token decode ms':>17}")
    for batch in batches:
        for mode in modes:
            base = None
            for tree in trees:
                times = result["times"][f"{tree}|{mode}|{batch}"]
                cpu = statistics.median(t["cpu"] for t in times) / tokens * 1e3
                low = min(t["cpu"] for t in times) / tokens * 1e3
                wall = statistics.median(t["wall"] for t in times) / tokens * 1e3
                base = base or (cpu, low)
                short = statistics.median(t["cpu2"] for t in times) * 1e3 if "cpu2" in times[0] else float("nan")
                print(f"{tree[-28:]:28} {mode:18} {batch:>3} {cpu:8.3f} {low:8.3f} {wall:8.3f} {cpu / base[0]:6.3f} "
                      f"{low / base[1]:6.3f} {short:17.2f}")


if __name__ == "__main__":
    main()
