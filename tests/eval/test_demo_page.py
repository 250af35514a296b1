"""The demo's one page (``out/demo/index.html``), opened in headless Chromium as a reader would: every image loads
and every table has rows. A page whose image is missing must fail the same check (the negative control)."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest
from PIL import Image

from vispec.eval import demo

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="needs Chromium (Debian package `chromium`; make test installs it)")


def _sections() -> dict[str, dict]:
    table = {"header": ["method", "nfe", "wall s"], "rows": [["ar", "256.0", "1.000"], ["mc-sjd", "80.0", "0.600"]],
             "load": "load average 0.10 -> 0.20 on 2 cores"}
    return {key: dict(table) for key, _, _ in demo.SECTIONS}


def _rendered(page) -> tuple[str, int]:
    result = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--allow-file-access-from-files",
                             "--virtual-time-budget=5000", "--dump-dom", page.as_uri()],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    images = re.search(r'data-images-loaded="([^"]*)"', result.stdout)
    tables = re.search(r'data-tables="(\d+)"', result.stdout)
    assert images and tables, f"the page's check did not run:\n{result.stdout[:2000]}"
    return images.group(1), int(tables.group(1))


def test_every_image_loads_and_every_table_renders(tmp_path):
    for _, _, grid in demo.SECTIONS:
        if grid:
            Image.new("RGB", (40, 20), "red").save(tmp_path / grid)
    page = demo.write_index(str(tmp_path), _sections())
    assert _rendered(tmp_path / "index.html") == ("3/3", len(demo.SECTIONS))
    assert page.endswith("index.html")


def test_a_missing_image_fails_the_check(tmp_path):
    Image.new("RGB", (40, 20), "red").save(tmp_path / "grid.png")
    demo.write_index(str(tmp_path), _sections())
    images, _ = _rendered(tmp_path / "index.html")
    assert images == "1/3"
