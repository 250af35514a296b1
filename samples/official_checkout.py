"""The ``--official`` checkout check shared by the side-by-side scripts (``official_side_by_side.py``,
``fast_dllm_side_by_side.py``): the public code they import at run time must be a checkout of its repository."""

from __future__ import annotations

import argparse
import os
from typing import Optional


def check_official(parser: argparse.ArgumentParser, path: Optional[str], repo: str, clone_to: str,
                   files: tuple[str, ...]) -> str:
    """``path`` (``--official``) as an absolute path to a checkout of ``repo`` (``owner/name``) holding ``files``;
    otherwise a one-line usage error naming the flag (``clone_to``: where the error suggests cloning it)."""
    name = repo.split("/")[1]
    if not path:
        parser.error(f"--official PATH is required: a checkout of {repo} (git clone https://github.com/{repo} "
                     f"{clone_to})")
    if not os.path.isdir(path):
        parser.error(f"--official {path}: no such directory (expected a checkout of {repo})")
    missing = [f for f in files if not os.path.isfile(os.path.join(path, f))]
    if missing:
        parser.error(f"--official {path}: not a {name} checkout, {' and '.join(missing)} missing")
    return os.path.abspath(path)
