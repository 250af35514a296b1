"""The documentation: the README is a short front door, the site in docs/ builds strictly (a broken link, a page
missing from the navigation or a docstring reference that does not resolve fails), and every code block says what
it is (python blocks run in a fresh process: tests/project/test_readme*.py; the rest are shell, text or output)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from readme_blocks import BLOCKS, PAGES, ROOT

README = (ROOT / "README.md").read_text()


def test_the_readme_is_short_and_opens_with_the_two_commands():
    lines = README.splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines; reference material belongs in docs/"
    commands = [line.split("#")[0].strip() for line in lines[:8] if line.startswith("make ")]
    assert commands == ["make demo", "make test"]


def test_the_readme_holds_nothing_the_docs_do_not():
    docs = "\n".join(page.read_text() for page in PAGES[1:])
    for block in re.findall(r"```python\n(.*?)```", README, re.S):
        assert block in docs, f"a README example that no documentation page holds:\n{block}"
    for row in re.findall(r"^\|(?!---).*\|$", README, re.M):
        assert row.replace("](docs/", "](") in docs, f"a README table row that no documentation page holds: {row}"
    for target in re.findall(r"\]\(docs/([^)#]+)", README):
        assert (ROOT / "docs" / target).is_file(), f"README links to docs/{target}, which does not exist"


def test_every_code_block_says_what_it_is():
    for page in PAGES:
        fences = re.findall(r"^```(.*)$", page.read_text(), re.M)
        openings = fences[::2]
        assert len(fences) % 2 == 0, f"{page.name}: an unclosed code block"
        assert all(language.strip() in {"python", "bash", "text"} for language in openings), \
            f"{page.name}: a code block without python / bash / text: {openings}"
    assert len(BLOCKS) >= 20


def test_the_cli_reference_is_generated_from_the_parsers():
    from vispec.cli.reference import markdown

    text = markdown()
    for command in ("vispec generate image", "vispec bench text", "vispec train llada2", "vispec convert llamagen"):
        assert f"`{command}`" in text
    assert "--decoding" in text and "--speculative" not in text.split("`vispec generate image`")[0]


@pytest.mark.slow
def test_the_site_builds_strictly(tmp_path):
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                            cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-4000:]
    api = (tmp_path / "site" / "api" / "index.html").read_text()
    assert "LlamaGenPipeline" in api and "SelfSpeculation" in api
    cli = (tmp_path / "site" / "cli" / "index.html").read_text()
    assert "vispec bench decoders" in cli
