"""The ``vispec`` command line: one module per command group (:mod:`~vispec.cli.bench`,
:mod:`~vispec.cli.generate`, :mod:`~vispec.cli.train`, :mod:`~vispec.cli.convert`, :mod:`~vispec.cli.demo`);
flags of the benchmarks and trainers are built from their config dataclasses (:mod:`~vispec.cli.args`).

User errors print one ``vispec: error: ...`` line on stderr and exit with status 2, no traceback;
real bugs keep their traceback, so they get reported instead of looking like bad input. User errors are:

* a flag argparse rejects (:class:`UsageError`: one line too, with the command's ``--help`` to read);
* a ``ValueError`` raised on purpose, by a ``raise`` statement: vispec's checks (and diffusers') raise
  ``ValueError`` naming the argument and what was expected. A ``ValueError`` the interpreter or a C
  extension raised implicitly (``a, b = ...`` unpacking, ``int("x")`` on a value nobody checked) is a bug;
* ``OSError`` (a missing, unreadable or unwritable file, a full disk) and running out of memory.

Ctrl-C prints ``vispec: interrupted`` and exits with 130, wherever it comes: while the parser is built, while a
command imports torch and the models, or while it works. Notes added to the exception (a benchmark's
"the rows measured so far are in ...") are appended to the line. ``VISPEC_TRACEBACK=1`` shows the
traceback of every error.

Start-up is light: this package and the parsers import no torch, diffusers, transformers or Triton (the
benchmarks' flags come from light config modules; a trainer's module, which imports torch, is imported only when
that trainer is named: :class:`LazySubParsers`). The commands import what they need when they run, so
``vispec ... --help`` is instant.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from typing import Any, Callable, NoReturn, Optional, Sequence

from vispec.cli.bench import add_bench
from vispec.cli.convert import add_convert
from vispec.cli.demo import add_demo
from vispec.cli.generate import add_generate
from vispec.cli.train import add_train
from vispec.version import __version__


class UsageError(Exception):
    """A command line argparse rejected (unknown flag, missing argument, a value of the wrong type)."""


class LazySubParsers(argparse._SubParsersAction):
    """Subcommands whose flags are added when the subcommand is chosen: ``add_parser(name, help=..., build=fn)``
    lists ``name`` (and its help) at once and calls ``fn(parser)`` only when the command line names it, so that
    the heavy module ``fn`` imports (a trainer's) is not imported for ``--help`` or for other commands."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._builders: dict[str, Callable[[argparse.ArgumentParser], None]] = {}

    def add_parser(self, name: str, build: Optional[Callable[[argparse.ArgumentParser], None]] = None,
                   **kwargs: Any) -> argparse.ArgumentParser:
        parser = super().add_parser(name, **kwargs)
        if build is not None:
            self._builders[name] = build
        return parser

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        build = self._builders.pop(values[0], None)
        if build is not None:
            build(self._name_parser_map[values[0]])
        super().__call__(parser, namespace, values, option_string)


class Parser(argparse.ArgumentParser):
    """argparse with its errors raised as :class:`UsageError` (one line) instead of usage text and ``exit(2)``;
    subcommand parsers are of this class too (argparse makes them of the parent's class), and their subcommands
    may be built lazily (:class:`LazySubParsers`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.register("action", "parsers", LazySubParsers)

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{self.prog}: {message} (see `{self.prog} --help`)")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="vispec", description="Many tokens per forward pass for visual AR models and masked diffusion LMs.")
    parser.add_argument("--version", action="version", version=f"vispec {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    add_bench(sub)
    add_train(sub)
    add_convert(sub)
    add_generate(sub)
    add_demo(sub)
    return parser


def is_user_error(err: BaseException) -> bool:
    """Whether ``err`` is the user's to fix rather than a bug (module docstring)."""
    if isinstance(err, (UsageError, OSError, MemoryError)) or type(err).__name__ == "OutOfMemoryError":
        return True
    if isinstance(err, ValueError):
        frames = traceback.extract_tb(err.__traceback__)
        return bool(frames) and (frames[-1].line or "").lstrip().startswith("raise")
    return False


def _one_line(err: BaseException) -> str:
    notes = getattr(err, "__notes__", None) or []
    text = " ".join(str(err).split()) or type(err).__name__
    if type(err).__name__ == "OutOfMemoryError" or isinstance(err, MemoryError):
        text = f"out of memory ({text}); try a smaller --batch-size / --max-batch-size"
    return text + "".join(f" ({' '.join(note.split())})" for note in notes)


def _leave_process_group() -> None:
    """Under torchrun: destroy the process group a command joined (torch warns at exit about one left open).
    Imports nothing: after a Ctrl-C during ``import torch`` the half-imported module must not raise anew."""
    dist = sys.modules.get("torch.distributed")
    is_initialized = getattr(dist, "is_initialized", None)
    if callable(is_initialized) and getattr(dist, "is_available", lambda: False)() and is_initialized():
        dist.destroy_process_group()


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the command ``argv`` (default: ``sys.argv[1:]``); returns the exit status (module docstring)."""
    try:
        parser = build_parser()
        args = parser.parse_args(argv)  # list flags raise ValueError on an empty or malformed list
        if not hasattr(args, "func"):
            parser.print_help()
            return 2
        try:
            return args.func(args)
        finally:
            _leave_process_group()
    except KeyboardInterrupt as err:
        print("vispec: interrupted" + "".join(f" ({note})" for note in getattr(err, "__notes__", None) or []),
              file=sys.stderr)
        return 130
    except Exception as err:  # noqa: BLE001 - sorted into user errors (one line) and bugs (re-raised)
        if not is_user_error(err) or os.environ.get("VISPEC_TRACEBACK"):
            raise
        print(f"vispec: error: {_one_line(err)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
