"""Progress inside long benchmark phases (issue 28, item 20): ``bench text`` draws a tqdm bar over the problems of
each row, ``bench kernels`` one over the configurations its compile check compiles; on stderr, only when stderr is
a terminal unless asked (as ``bench image``), off with ``--quiet``."""

from __future__ import annotations

import subprocess
import sys

import pytest

from vispec.cli import main
from vispec.eval.bench import image, kernels, text
from vispec.kernels import compile_check


def test_bench_text_bar_counts_the_problems_of_each_row(capsys):
    cfg = text.TextBenchConfig(settings=("threshold",), reference=True, tasks=("sort",), num_problems=3, batch_size=2,
                               gen_length=8, block_length=8)  # short canvases: the bar is under test, not the answers
    lines = []
    result = text.run_text_bench(cfg, progress=lines.append, progress_bar=True)
    err = capsys.readouterr().err
    assert [(r["strategy"], r["batch_size"]) for r in result["runs"]] == [("llada", 1), ("llada", 2), ("threshold", 1),
                                                                           ("threshold", 2)]
    for row in ("sort llada@none B=1", "sort llada@none B=2", "sort threshold+stop@none B=1", "sort threshold+stop@none B=2"):
        assert f"{row}: 100%" in err and "3/3" in err, row  # each row's bar reaches its 3 problems
    assert "2/3" in err and "problem" in err  # batch 2: a unit of 2, then 1
    assert len(lines) == 4  # the row lines are unchanged


def test_bench_text_bar_is_off_when_stderr_is_not_a_terminal(capsys):
    for enabled in (None, False):  # None (the default): only on a terminal, and capsys' stderr is none
        with text._row_bar(3, "sort llada@none B=1", enabled) as bar:
            bar.update(3)
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("bench", ["text", "kernels", "image"])
def test_quiet_turns_the_bars_off(bench, monkeypatch):
    seen = []

    def record(cfg, progress, partial, progress_bar):
        seen.append(progress_bar)
        return None  # as a rank other than 0: nothing to print

    module = {"text": text, "kernels": kernels, "image": image}[bench]
    monkeypatch.setattr(module, f"run_{bench}_bench" if bench != "kernels" else "run_kernel_bench", record)
    assert main(["bench", bench]) == 0 and main(["bench", bench, "--quiet"]) == 0
    assert seen == [None, False]  # None: a bar when stderr is a terminal


def test_compile_check_bar_counts_every_configuration(capsys, monkeypatch):
    """``python -m vispec.kernels.compile_check --progress``: one step per configuration and architecture."""
    configs = [("verify.a[x=1]", None, {}, {}), ("verify.a[x=2]", None, {}, {}), ("unmask.c", None, {}, {})]
    monkeypatch.setattr(compile_check, "selected_configs", lambda prefixes=(): configs)

    def compile_all(arch, prefixes=(), done=None, spot=False, pairwise=False):
        records = []
        for name, *_ in compile_check.chosen_configs(configs, spot, pairwise):
            records.append({"kernel": name, "arch": f"sm_{arch}", "ok": True, "seconds": 0.0, "error": None})
            done(records[-1])
        return records

    monkeypatch.setattr(compile_check, "compile_all", compile_all)
    assert compile_check.main(["--arch", "80", "--arch", "90", "--progress"]) == 0
    captured = capsys.readouterr()
    assert "compiling for sm_90" in captured.err and "6/6" in captured.err and "kernel" in captured.err
    assert captured.out.strip() == "compiled 6/6 kernel configurations (sm_80, sm_90) in 0.0 s"
    assert compile_check.main(["--arch", "80"]) == 0 and capsys.readouterr().err == ""  # no bar unless asked
    # a spot check compiles the first configuration of each kernel: verify.a[x=1] and unmask.c
    assert compile_check.main(["--arch", "90", "--spot-arch", "80", "--progress"]) == 0
    captured = capsys.readouterr()
    assert "5/5" in captured.err and "one per kernel" in captured.err
    assert captured.out.strip() == "compiled 5/5 kernel configurations (sm_80, sm_90) in 0.0 s"


@pytest.mark.parametrize("bar", [True, False])
def test_bench_kernels_shows_the_compile_checks_bar(bar, monkeypatch):
    """With a bar the check draws it on this process's stderr (not captured); without, its output is captured."""
    calls = []

    def run(command, **kwargs):
        calls.append((command, kwargs))
        return subprocess.CompletedProcess(command, 0, "compiled 2/2 kernel configurations (sm_80, sm_90) in 1.0 s\n",
                                           None if kwargs["stderr"] is None else "")

    monkeypatch.setattr(kernels.subprocess, "run", run)
    result = kernels._compile_results(bar)
    (command, kwargs), = calls
    assert ("--progress" in command) is bar and (kwargs["stderr"] is None) is bar
    assert result == {"returncode": 0, "summary": "compiled 2/2 kernel configurations (sm_80, sm_90) in 1.0 s",
                      "failures": []}


def test_bench_kernels_names_a_failed_check_whose_messages_went_to_the_terminal(monkeypatch):
    monkeypatch.setattr(kernels.subprocess, "run", lambda command, **kwargs: subprocess.CompletedProcess(command, 1, "", None))
    assert kernels._compile_results(True)["summary"] == ("the compile check failed with exit status 1 (its messages "
                                                         "are above)")


@pytest.mark.slow
@pytest.mark.skipif(not __import__("vispec.kernels.backend", fromlist=["x"]).triton_available(), reason="needs triton")
def test_compile_check_bar_in_a_real_compilation():
    import os

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-m", "vispec.kernels.compile_check", "--arch", "80", "--kernel",
                          "philox.scalar", "--progress"], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "compiling for sm_80" in run.stderr and "1/1" in run.stderr
