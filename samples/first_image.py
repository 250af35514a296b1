"""A user's first image: import, load and the first two ``pipe(...)`` calls, each in a fresh Python process.

    .venv/bin/python samples/first_image.py [--repeats 1] [--json samples/first_image.json]

Every row is a new subprocess that runs the README's first call of a pipeline (``LlamaGenPipeline`` on the
embedded tiny-c2i, ``UnifiedImagePipeline`` on tiny-t2i), timing ``import`` (torch and ``vispec.pipelines``),
``from_pretrained``, the first image and a second, identical call. The keyed noise on CPU
(:mod:`vispec.kernels.race`) is set by ``VISPEC_FUSED_NOISE``:

* ``default``: the variable unset, what a user gets;
* ``eager``: ``0``, PyTorch's eager Philox;
* ``fused, cold``: ``1`` with an empty inductor cache (``TORCHINDUCTOR_CACHE_DIR`` a new folder): the first
  compile on a machine;
* ``fused, warm``: ``1`` again on that same folder: every later process.

A first call must not pay a compile that later calls do not amortise. Each phase is timed as wall seconds and
as CPU seconds (the process and the processes it waited for, such as the C++ compiler: inductor compiles in the
process, ``TORCHINDUCTOR_COMPILE_THREADS=1``), which a busy machine inflates much less than wall time;
``--threads`` (default 1) torch threads make CPU seconds the wall time of a quiet machine. ``amortise`` is how
many images the fused path's per-call CPU saving takes to pay back what its first call paid on top of the eager
first call. The images of every row must be identical (the fused noise is bit-identical to the eager one); the
script fails otherwise. Timings are medians over ``--repeats``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import torch

CHILD = r"""
import hashlib, json, os, time

def clock():  # (wall, CPU of this process and of the processes it waited for, e.g. the C++ compiler)
    t = os.times()
    return time.perf_counter(), t.user + t.system + t.children_user + t.children_system

marks = [clock()]
import torch
torch.set_num_threads({threads})
from vispec.kernels import race
from vispec.pipelines import {cls}
marks.append(clock())
pipe = {cls}.from_pretrained({name!r})
pipe.set_progress_bar_config(disable=True)
marks.append(clock())
digests = []
for _ in range(2):
    out = pipe({call}, generator=[torch.Generator().manual_seed(i) for i in range({batch})], output_type="np")
    marks.append(clock())
    digests.append(hashlib.sha256(out.images.tobytes()).hexdigest()[:16])
phases = ("import", "load", "first", "second")
print(json.dumps({{"fused": race.fused_enabled(), "images": digests,
                  **{{f"{{p}}_s": marks[i + 1][0] - marks[i][0] for i, p in enumerate(phases)}},
                  **{{f"{{p}}_cpu_s": marks[i + 1][1] - marks[i][1] for i, p in enumerate(phases)}}}}))
"""

PIPELINES = {
    "tiny-c2i": ("LlamaGenPipeline", "vispec/tiny-c2i", 'class_labels=[3, 3, 7], decoding="mc-sjd"', 3),
    "tiny-t2i": ("UnifiedImagePipeline", "vispec/tiny-t2i",
                 'prompt=["two red circles", "a blue square left of a yellow triangle"], height=64, width=96, '
                 'decoding="mc-sjd"', 2),
}
SETTINGS = ("default", "eager", "fused, cold", "fused, warm")
KEYS = ("import_s", "load_s", "first_s", "second_s", "import_cpu_s", "load_cpu_s", "first_cpu_s", "second_cpu_s")


def run_child(pipeline: str, setting: str, cache_dir: str, threads: int) -> dict:
    """One fresh process: the timings (seconds), whether the fused path ran, and digests of both calls' images."""
    cls, name, call, batch = PIPELINES[pipeline]
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache_dir, TORCHINDUCTOR_COMPILE_THREADS="1")
    env.pop("VISPEC_FUSED_NOISE", None)
    if setting != "default":
        env["VISPEC_FUSED_NOISE"] = "0" if setting == "eager" else "1"
    code = CHILD.format(cls=cls, name=name, call=call, batch=batch, threads=threads)
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{pipeline} ({setting}) failed:\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["process_s"] = wall
    return result


def measure(pipeline: str, settings: list[str], repeats: int, threads: int) -> dict[str, dict]:
    """Per setting, the median of each timing over ``repeats`` processes. Every repeat starts from a new, empty
    inductor cache folder, so the first process that compiles (``fused, cold``, else ``default`` when it is
    fused) finds it cold and the later ones warm."""
    runs: dict[str, list[dict]] = {s: [] for s in settings}
    for _ in range(repeats):
        with tempfile.TemporaryDirectory(prefix="inductor-") as cache_dir:
            for setting in sorted(settings, key=("fused, cold", "fused, warm", "default", "eager").index):
                runs[setting].append(run_child(pipeline, setting, cache_dir, threads))
    digests = {d for rs in runs.values() for r in rs for d in r["images"]}
    if len(digests) != 1:
        raise SystemExit(f"{pipeline}: images differ between settings or calls ({sorted(digests)})")
    return {s: {**{k: statistics.median(r[k] for r in rs) for k in (*KEYS, "process_s")}, "fused": rs[0]["fused"],
                "image_sha256_16": rs[0]["images"][0]} for s, rs in runs.items()}


def amortise(row: dict, eager: dict) -> Optional[float]:
    """Images (calls) it takes for the fused path's per-call CPU saving to pay back the CPU its first call paid on
    top of the eager first call's own warm-up (None: it never does)."""
    saving = eager["second_cpu_s"] - row["second_cpu_s"]
    extra = (row["first_cpu_s"] - row["second_cpu_s"]) - (eager["first_cpu_s"] - eager["second_cpu_s"])
    if not row["fused"] or extra <= 0:
        return 0.0
    return extra / saving if saving > 0 else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1, help="torch threads in each process")
    parser.add_argument("--pipelines", nargs="+", default=list(PIPELINES), choices=list(PIPELINES))
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--json", type=Path, default=Path(__file__).with_name("first_image.json"))
    args = parser.parse_args()
    if args.repeats < 1 or args.threads < 1:
        raise SystemExit("--repeats and --threads must be at least 1")
    report = {"machine": {"python": platform.python_version(), "torch": torch.__version__, "cpus": os.cpu_count(),
                          "load_average_start": os.getloadavg()[0]},
              "threads": args.threads, "repeats": args.repeats, "pipelines": {}}
    header = (f"{'pipeline':>9} {'noise':>12} {'fused':>5} | CPU s: {'import':>6} {'load':>5} {'first':>6} {'second':>6} "
              f"| wall s: {'first':>6} {'second':>6} {'process':>7} | {'amortise':>8}")
    print(header)
    print("-" * len(header))
    for pipeline in args.pipelines:
        rows = measure(pipeline, args.settings, args.repeats, args.threads)
        for setting, row in rows.items():
            calls = row["amortise_calls"] = amortise(row, rows["eager"]) if "eager" in rows else None
            shown = "-" if "eager" not in rows else "never" if calls is None else f"{calls:.0f}"
            print(f"{pipeline:>9} {setting:>12} {str(row['fused']):>5} | {'':6} {row['import_cpu_s']:6.1f} "
                  f"{row['load_cpu_s']:5.1f} {row['first_cpu_s']:6.2f} {row['second_cpu_s']:6.2f} | {'':7} "
                  f"{row['first_s']:6.2f} {row['second_s']:6.2f} {row['process_s']:7.1f} | {shown:>8}", flush=True)
        report["pipelines"][pipeline] = rows
    report["machine"]["load_average_end"] = os.getloadavg()[0]
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(f"{args.threads} torch thread(s) per process; load average {report['machine']['load_average_start']:.1f} -> "
          f"{report['machine']['load_average_end']:.1f} on {os.cpu_count()} cores; wrote {args.json}")


if __name__ == "__main__":
    main()
