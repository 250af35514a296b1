"""``samples/gpu_check.sh`` (one GPU lease's checks): bad settings are refused before any work, and its CPU dry run
keeps the files it names."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "samples" / "gpu_check.sh"


def _run(*args: str, timeout: int = 60, **env: str) -> subprocess.CompletedProcess:
    environ = {**os.environ, "PATH": f"{pathlib.Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}", **env}
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout, env=environ)


@pytest.mark.parametrize("args, env, message", [
    ((), {}, "usage: samples/gpu_check.sh OUT_DIR"),
    (("--help",), {}, "usage: samples/gpu_check.sh OUT_DIR"),
    (("out",), {"DEVICE": "tpu"}, "DEVICE must be cuda or cpu, got 'tpu'"),
    (("out",), {"PHASES": "tests,bench"}, "PHASES: unknown phase 'bench'"),
    (("out",), {"DEADLINE_S": "9m"}, "DEADLINE_S must be a whole number of seconds, got '9m'"),
])
def test_bad_settings_are_refused_before_any_work(args, env, message, tmp_path):
    result = _run(*[str(tmp_path / a) if a == "out" else a for a in args], **env)
    assert result.returncode == 2 and message in result.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_the_cpu_dry_run_keeps_what_it_names(tmp_path):
    out = tmp_path / "dry"
    result = _run(str(out), timeout=900, DEVICE="cpu", MODEL="tiny-c2i", TOKENS="16", PHASES="eager",
                  EAGER_BATCHES="1,2", DEADLINE_S="600")
    assert result.returncode == 0, result.stderr[-3000:]
    done = next(line for line in result.stderr.splitlines() if "done:" in line)
    assert sorted(done.split("done:")[1].split()) == sorted(p.name for p in out.iterdir())
    eager = json.loads((out / "eager.json").read_text())
    assert eager.get("complete", True) and {r["method"] for r in eager["rows"]} == {"ar", "mc-sjd", "sjd-pac", "auto"}
    assert {r["batch_size"] for r in eager["rows"]} == {1, 2}
    assert all(r["ops_per_step"] is not None for r in eager["rows"])
    assert "B method" in (out / "eager.txt").read_text() and (out / "step-costs.tar").stat().st_size > 0
