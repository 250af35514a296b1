"""``vispec demo``: the main job (compare the decoders, write a grid and a report)."""

from __future__ import annotations

import argparse

from vispec.cli.paths import check_output_folder


def _cmd_demo(args: argparse.Namespace) -> int:
    from vispec.eval.demo import run_demo

    run_demo(out_dir=check_output_folder(args.out, "--out"))
    return 0


def add_demo(sub: argparse._SubParsersAction) -> None:
    demo = sub.add_parser("demo", help="the main job: compare the decoders and write a report")
    demo.add_argument("--out", default="out/demo", help="report folder (default: %(default)s)")
    demo.set_defaults(func=_cmd_demo)
