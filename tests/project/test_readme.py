"""Every README example that runs on an embedded model, or on a tiny random model it builds, runs as written in a fresh
Python process."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from readme_blocks import EMBEDDED, RANDOM_MODEL

RUN = EMBEDDED + RANDOM_MODEL


def test_the_readme_has_embedded_examples():
    assert len(EMBEDDED) >= 4


# a warning line names the file that warned: one of diffusers' or transformers' own deprecations
LIBRARY_DEPRECATION = re.compile(r"/(diffusers|transformers)/\S+:\d+: (DeprecationWarning|FutureWarning)")


@pytest.mark.parametrize("index", range(len(RUN)))
def test_readme_example_runs_in_a_fresh_process(index, tmp_path):
    """Every deprecation shown (``-W always``), none of them diffusers' or transformers'."""
    env = {**os.environ, "PYTHONWARNINGS": "always::DeprecationWarning,always::FutureWarning"}
    result = subprocess.run([sys.executable, "-c", RUN[index]], cwd=tmp_path, capture_output=True, text=True,
                            timeout=300, env=env)
    assert result.returncode == 0, f"README example {index + 1} failed:\n{RUN[index]}\n{result.stderr[-3000:]}"
    warned = [line for line in result.stderr.splitlines() if LIBRARY_DEPRECATION.search(line)]
    assert not warned, f"README example {index + 1} printed library deprecations:\n" + "\n".join(warned)


def test_library_deprecations_are_recognised():
    line = "/x/site-packages/transformers/utils/deprecation.py:172: FutureWarning: `past_key_values` is deprecated"
    assert LIBRARY_DEPRECATION.search(line) and not LIBRARY_DEPRECATION.search(line.replace("transformers", "torch"))
