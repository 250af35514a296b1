"""Every README example that runs on an embedded model runs as written in a fresh Python process."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
EMBEDDED = [b for b in BLOCKS if "vispec/tiny-" in b]


def test_the_readme_has_embedded_examples():
    assert len(EMBEDDED) >= 4


@pytest.mark.parametrize("index", range(len(EMBEDDED)))
def test_readme_example_runs_in_a_fresh_process(index, tmp_path):
    result = subprocess.run([sys.executable, "-c", EMBEDDED[index]], cwd=tmp_path, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, f"README example {index + 1} failed:\n{EMBEDDED[index]}\n{result.stderr[-3000:]}"
