"""``samples/gpu_bench.sh``: its arguments are checked before any work, and its CPU dry run ends with the files it
names (issue 47 item 22)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "samples" / "gpu_bench.sh"


def _run(*args: str, timeout: int = 60) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": f"{pathlib.Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    env.pop("DEVICE", None)
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout, env=env)


@pytest.mark.parametrize("args, message", [
    (("--bogus", "out"), "unknown option '--bogus'"),
    (("--device",), "--device needs a value"),
    (("--device", "tpu", "out"), "--device must be cuda or cpu, got 'tpu'"),
    (("a", "b"), "one OUT_DIR expected, got 'a' and 'b'"),
    ((), "usage: samples/gpu_bench.sh"),
])
def test_bad_arguments_are_refused_before_any_work(args, message, tmp_path):
    result = _run(*args)
    assert result.returncode == 2 and message in result.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_the_cpu_dry_run_keeps_what_it_names(tmp_path):
    result = _run("--device", "cpu", str(tmp_path / "dry"), timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    done = next(line for line in result.stderr.splitlines() if "done:" in line)
    named = done.split("done:", 1)[1].split()
    assert named and all(os.path.getsize(path) > 0 for path in named)
    report = json.loads((tmp_path / "dry" / "decoders.json").read_text())
    assert report["rows"] and "kernels" in report
