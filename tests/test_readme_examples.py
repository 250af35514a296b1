"""Every python example in README.md runs in a fresh Python process.

``tests/test_readme.py`` runs the examples on embedded models as written. This file makes sure no example is
left out: each block parses, and is either such an embedded-model example or the one that needs official
LlamaGen checkpoints, which runs here on the tiny official-layout checkpoints in ``tests/data/llamagen``
(written by the official code) with only the constants a tiny model cannot take substituted (listed below).
"""

from __future__ import annotations

import ast
import pathlib
import re
import shutil
import subprocess
import sys

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
BLOCKS = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
EMBEDDED = [b for b in BLOCKS if "vispec/tiny-" in b]  # run by tests/test_readme.py
OFFICIAL = [b for b in BLOCKS if "c2i_B_256.pt" in b]
DATA = ROOT / "tests" / "data" / "llamagen"

# what the official-checkpoint example asks of a LlamaGen-B model that the tiny checkpoint (4 heads, 10 classes,
# a 4 x 4 token grid, 64-pixel images) cannot give; everything else runs as written
TINY = [('gpt_model="GPT-B"', "n_head=4"), ("[207, 360, 387, 974]", "[2, 3, 5, 9]"), ("num_tokens=256", "num_tokens=16"),
        (".view(-1, 16, 16)", ".view(-1, 4, 4)")]


def test_every_example_parses_and_is_run():
    assert len(BLOCKS) >= 5
    for block in BLOCKS:
        ast.parse(block)
    assert len(EMBEDDED) + len(OFFICIAL) == len(BLOCKS), "a README example neither runs on an embedded model nor is the official one"
    assert len(OFFICIAL) == 1


def test_official_checkpoint_example_on_tiny_official_files(tmp_path):
    code = OFFICIAL[0]
    for old, new in TINY:
        assert old in code, f"the README example changed: update TINY ({old!r})"
        code = code.replace(old, new)
    # the official tiny GPT in its DDP layout (it pickles argparse args), given LlamaGen's null class for CFG
    checkpoint = torch.load(DATA / "c2i_tiny.pt", map_location="cpu", weights_only=False)  # our own test data
    table = checkpoint["model"]["cls_embedding.embedding_table.weight"]
    checkpoint["model"]["cls_embedding.embedding_table.weight"] = torch.cat([table, table.mean(0, keepdim=True)])
    torch.save(checkpoint, tmp_path / "c2i_B_256.pt")
    shutil.copy(DATA / "vq16_tiny.pt", tmp_path / "vq_ds16_c2i.pt")
    code += "\nassert images.shape == (4, 3, 64, 64) and out.tokens.shape == (4, 16)\n"
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"{code}\n{result.stderr[-3000:]}"

