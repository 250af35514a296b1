"""README.md's python examples, by how the tests run them (tests/project/test_readme*.py)."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
BLOCKS = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
EMBEDDED = [b for b in BLOCKS if "vispec/tiny-" in b]  # on embedded models: run as written
# on tiny random models the example builds itself (the LLaDA2 layout, transformers' DiffusionGemma): run as written
RANDOM_MODEL = [b for b in BLOCKS if b not in EMBEDDED and ("LLaDA2MoeModelLM(" in b or "DiffusionGemmaForBlockDiffusion(" in b)]
OFFICIAL = [b for b in BLOCKS if "c2i_B_256.pt" in b]  # official LlamaGen checkpoints: run on tiny ones
LUMINA = [b for b in BLOCKS if '"lumina-mgpt-2"' in b]  # a converted Lumina-mGPT 2.0 folder: run on a tiny one
