"""The python examples of README.md and the documentation pages (docs/*.md), by how the tests run them
(tests/project/test_readme*.py). An example the README shares with a page is run once."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"```python\n(.*?)```", re.S)
BLOCKS = list(dict.fromkeys(block for page in PAGES for block in FENCE.findall(page.read_text())))
EMBEDDED = [b for b in BLOCKS if "vispec/tiny-" in b]  # on embedded models: run as written
# on tiny random models the example builds itself (the LLaDA2 layout, transformers' DiffusionGemma): run as written
RANDOM_MODEL = [b for b in BLOCKS if b not in EMBEDDED and ("LLaDA2MoeModelLM(" in b or "DiffusionGemmaForBlockDiffusion(" in b)]
OFFICIAL = [b for b in BLOCKS if "c2i_B_256.pt" in b]  # official LlamaGen checkpoints: run on tiny ones
LUMINA = [b for b in BLOCKS if '"lumina-mgpt-2"' in b]  # a converted Lumina-mGPT 2.0 folder: run on a tiny one
LLAMAGEN_T2I = [b for b in BLOCKS if '"llamagen-xl-t2i"' in b]  # a converted LlamaGen t2i folder with T5: a tiny one
