"""The ``vispec`` command line: one module per command group (:mod:`~vispec.cli.bench`,
:mod:`~vispec.cli.generate`, :mod:`~vispec.cli.train`, :mod:`~vispec.cli.convert`, :mod:`~vispec.cli.demo`);
flags of the benchmarks and trainers are built from their config dataclasses (:mod:`~vispec.cli.args`).

User errors (bad arguments, unreadable files) print one ``vispec: error: ...`` line and exit with
status 2; no traceback.
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from vispec.cli.bench import add_bench
from vispec.cli.convert import add_convert
from vispec.cli.demo import add_demo
from vispec.cli.generate import add_generate
from vispec.cli.train import add_train
from vispec.version import __version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vispec", description="Many tokens per forward pass for visual AR models and masked diffusion LMs.")
    parser.add_argument("--version", action="version", version=f"vispec {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    add_bench(sub)
    add_train(sub)
    add_convert(sub)
    add_generate(sub)
    add_demo(sub)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)  # list flags raise ValueError on an empty or malformed list
        if not hasattr(args, "func"):
            parser.print_help()
            return 2
        return args.func(args)
    except (ValueError, FileNotFoundError, OSError) as err:
        print(f"vispec: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
