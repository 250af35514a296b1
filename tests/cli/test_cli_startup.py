"""``vispec`` starts light and stops cleanly (issue 28, items 17 and 19).

* ``--help`` of the command, of every command group and of every benchmark, ``generate``, ``convert`` and ``train``
  command imports no torch, diffusers, transformers or Triton (checked in ``sys.modules`` of a fresh process, not
  timed): the parsers are built from light modules, a trainer's flags from its torch-free config
  (:mod:`vispec.eval.train.configs`) when that trainer is named, and its module only when it runs;
* a bad ``vispec train`` flag (a range, a size past the machine's memory) is refused, one line naming the flag,
  before torch is imported;
* Ctrl-C anywhere (while the parser is built, while a command imports torch and the models, while it works)
  prints one line, ``vispec: interrupted``, and exits with 130.
"""

from __future__ import annotations

import json
import pathlib
import pkgutil
import signal
import subprocess
import sys
import types

import pytest

import vispec.cli as cli
import vispec.eval.train
from vispec.cli import main
from vispec.cli.train import TRAINERS

# the torch-free modules of vispec.eval.train (the configs and their checks); every other one is a trainer's
LIGHT_TRAIN = ("configs", "checks")
TRAIN_MODULES = tuple(f"vispec.eval.train.{m.name}" for m in pkgutil.iter_modules(vispec.eval.train.__path__)
                      if m.name not in LIGHT_TRAIN)
HEAVY = ("torch", "diffusers", "transformers", "triton", "vispec.pipelines", "vispec.models", *TRAIN_MODULES)

# every parser whose --help must be instant: the command, its groups, and every command, every trainer's included
HELP_COMMANDS = [[], ["bench"], ["bench", "decoders"], ["bench", "image"], ["bench", "text"], ["bench", "kernels"],
                 ["generate"], ["generate", "image"], ["generate", "text"], ["convert"], ["convert", "llamagen"],
                 ["convert", "lumina-mgpt"], ["demo"], ["train"], *[["train", name] for name in TRAINERS]]

_PROBE = """
import contextlib, io, json, sys
from vispec.cli import main
heavy = {heavy!r}
report = {{}}
for argv in {commands!r}:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            main(argv + ["--help"])
            status = None
        except SystemExit as exit:
            status = exit.code
    loaded = [name for name in heavy if any(m == name or m.startswith(name + ".") for m in sys.modules)]
    report[" ".join(argv) or "vispec"] = {{"status": status, "loaded": loaded, "usage": out.getvalue().startswith("usage:")}}
print(json.dumps(report))
"""


def test_help_imports_nothing_heavy():
    """One fresh process runs every ``--help`` in turn: after each, none of :data:`HEAVY` is imported."""
    code = _PROBE.format(heavy=HEAVY, commands=HELP_COMMANDS)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout)
    assert list(report) == [" ".join(argv) or "vispec" for argv in HELP_COMMANDS]
    for command, seen in report.items():
        assert seen == {"status": 0, "loaded": [], "usage": True}, (command, seen)


def test_every_trainer_module_counts_as_heavy():
    """The probe's list is not vacuous: every trainer's module (and the torch helpers they share) is in it."""
    assert {module for module, *_ in TRAINERS.values()} <= set(TRAIN_MODULES)
    assert {"vispec.eval.train.common", "vispec.eval.train.tokenizer"} <= set(TRAIN_MODULES)


# runs each `vispec train ...` command in turn, the machine's memory fixed at 8 GiB (the refusals do not depend on
# this machine), and reports its exit status, stderr and what it loaded
_FLAG_PROBE = """
import contextlib, io, json, sys
import vispec.eval.train.checks as checks
checks.total_memory = lambda: 8 * 2**30
from vispec.cli import main
heavy = {heavy!r}
report = []
for argv in {commands!r}:
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        status = main(argv)
    loaded = [name for name in heavy if any(m == name or m.startswith(name + ".") for m in sys.modules)]
    report.append({{"status": status, "err": err.getvalue(), "loaded": loaded}})
print(json.dumps(report))
"""

# (command, the flag its one error line must name): each refused by the torch-free checks
BAD_FLAGS = [
    (["train", "vq", "--steps", "-5"], "--steps"),
    (["train", "vq", "--base-channels", "1000000000"], "--base-channels"),
    (["train", "gpt", "--dim", "1000000000"], "--dim"),
    (["train", "drafter", "--n-layer", "1000000000"], "--n-layer"),
    (["train", "t2i", "--num-sequences", "1000000000000"], "--num-sequences"),
    (["train", "clip", "--threads", "100000"], "--threads"),
    (["train", "mdlm", "--d-model", "1000000000"], "--d-model"),
    (["train", "filter", "--hidden-size", "1000000000"], "--hidden-size"),
    (["train", "evaluator", "--width", "0"], "--width"),
]


def test_bad_trainer_flags_are_refused_before_torch():
    """A bad flag (a range, a size past the memory) exits 2 with one ``vispec: error:`` line naming it, and neither
    torch nor the trainer's module was imported to say so."""
    code = _FLAG_PROBE.format(heavy=HEAVY, commands=[argv for argv, _ in BAD_FLAGS])
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    for (argv, flag), seen in zip(BAD_FLAGS, json.loads(run.stdout), strict=True):
        lines = seen["err"].splitlines()
        assert seen["status"] == 2 and seen["loaded"] == [], (argv, seen)
        assert len(lines) == 1 and lines[0].startswith("vispec: error:") and flag in lines[0], (argv, lines)


_SCRIPT = """
import runpy, sys
sys.argv = [{script!r}, "--help"]
try:
    runpy.run_path({script!r}, run_name="__main__")
except SystemExit as exit:
    assert exit.code == 0, exit.code
print("loaded:", *[name for name in {heavy!r} if name in sys.modules])
"""


def test_the_vispec_script_starts_light():
    """The installed ``vispec`` script (``from vispec.cli import main``), run as a user runs it."""
    script = pathlib.Path(sys.executable).parent / "vispec"
    if not script.is_file():
        pytest.skip("no vispec script next to this Python (not installed)")
    code = _SCRIPT.format(script=str(script), heavy=HEAVY)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.startswith("usage: vispec") and run.stdout.strip().splitlines()[-1] == "loaded:"


def test_a_trainer_is_imported_only_when_named(capsys, monkeypatch):
    """The trainers' flags are built when their name is on the command line, and only theirs (from the torch-free
    configs; the trainer's module is imported when it runs, :func:`test_bad_trainer_flags_are_refused_before_torch`)."""
    built = []
    real = cli.train._add_trainer
    monkeypatch.setattr(cli.train, "_add_trainer", lambda parser, module, *names: (built.append(module),
                                                                                   real(parser, module, *names)))
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    assert built == []
    with pytest.raises(SystemExit):
        main(["train", "evaluator", "--help"])
    assert built == ["vispec.eval.train.evaluator"] and "--eval-images" in capsys.readouterr().out
    assert main(["train", "evaluator", "--steps", "x"]) == 2  # its flags are parsed as before
    assert "--steps: invalid int value" in capsys.readouterr().err


# ---- Ctrl-C ---------------------------------------------------------------------------------------------------


# announces (on stdout) that `import torch` starts, then runs the command
_ANNOUNCE_TORCH = """
import signal
import sys

# a terminal delivers Ctrl-C; a test run launched in the background (nohup, &) inherits SIGINT ignored
signal.signal(signal.SIGINT, signal.default_int_handler)

class Announce:
    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            sys.meta_path.remove(self)
            print("importing torch", flush=True)
        return None

sys.meta_path.insert(0, Announce())
from vispec.cli import main
sys.exit(main({argv!r}))
"""


def _interrupt_during_torch_import(argv: list[str]) -> subprocess.CompletedProcess:
    """Run ``main(argv)`` in a fresh process and send it SIGINT when the command starts to import torch: the
    interrupt lands in the slowest part of its start (torch, then the pipelines)."""
    code = _ANNOUNCE_TORCH.format(argv=argv)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "importing torch"
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.mark.parametrize("argv", [
    ["bench", "text", "--tasks", "sort", "--num-problems", "1", "--settings", "threshold"],
    ["generate", "image", "--class", "1", "--out", "never-written.png"],
])
def test_ctrl_c_during_start_up_is_one_line_and_130(argv, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run = _interrupt_during_torch_import(argv)
    assert (run.returncode, run.stderr) == (130, "vispec: interrupted\n")
    assert not (tmp_path / "never-written.png").exists()


def test_ctrl_c_while_the_parser_is_built(capsys, monkeypatch):
    """While a trainer's module is imported (the parser of `vispec train MODEL`), or any other part of the parser."""

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli.train, "_add_trainer", interrupted)
    assert main(["train", "vq", "--steps", "1"]) == 130
    assert capsys.readouterr().err == "vispec: interrupted\n"
    monkeypatch.setattr(cli, "build_parser", interrupted)
    assert main(["--help"]) == 130
    assert capsys.readouterr().err == "vispec: interrupted\n"


def test_leaving_the_process_group_survives_a_half_imported_torch(monkeypatch):
    """After Ctrl-C in the middle of ``import torch``, ``torch.distributed`` can be in ``sys.modules`` without its
    functions: leaving the process group must not raise (it would replace the interrupt by a traceback)."""
    monkeypatch.setitem(sys.modules, "torch.distributed", types.ModuleType("torch.distributed"))
    cli._leave_process_group()  # no AttributeError
