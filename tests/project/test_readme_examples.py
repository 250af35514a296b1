"""Every python example in README.md and docs/*.md runs in a fresh Python process.

``tests/project/test_readme.py`` runs the examples on embedded models as written. This file makes sure no example is
left out: each block parses, and is either such an embedded-model example, the one that needs official
LlamaGen checkpoints, which runs here on the tiny official-layout checkpoints in ``tests/data/llamagen``
(written by the official code) with only the constants a tiny model cannot take substituted (listed below),
or the one on a converted Lumina-mGPT 2.0 folder, which runs on a tiny checkpoint in Lumina's layout converted
by ``vispec convert lumina-mgpt`` (``tests/cli/test_convert_lumina.py``), or the one on a converted LlamaGen t2i folder
with its T5 encoder, which runs on the tiny official-layout t2i checkpoint and a tiny T5 converted by the documented
``vispec convert llamagen --text-encoder`` line.
"""

from __future__ import annotations

import ast
import pathlib
import shutil
import subprocess
import sys

import torch
from readme_blocks import BLOCKS, EMBEDDED, LLAMAGEN_T2I, LUMINA, OFFICIAL, RANDOM_MODEL  # the first two: test_readme.py

ROOT = pathlib.Path(__file__).resolve().parents[2]
DATA = ROOT / "tests" / "data" / "llamagen"

# what the official-checkpoint example asks of a LlamaGen-B model that the tiny checkpoint (4 heads, 10 classes,
# a 4 x 4 token grid, 64-pixel images) cannot give; everything else runs as written
TINY = [('gpt_model="GPT-B"', "n_head=4"), ("[207, 360, 387, 974]", "[2, 3, 5, 9]"), ("num_tokens=256", "num_tokens=16"),
        (".view(-1, 16, 16)", ".view(-1, 4, 4)")]


def test_every_example_parses_and_is_run():
    assert len(BLOCKS) >= 5
    for block in BLOCKS:
        ast.parse(block)
    assert len(EMBEDDED) + len(RANDOM_MODEL) + len(OFFICIAL) + len(LUMINA) + len(LLAMAGEN_T2I) == len(BLOCKS), \
        "a README example neither runs on an embedded or tiny random model nor is one of the official-checkpoint ones"
    assert len(OFFICIAL) == 1 and len(LUMINA) == 1 and len(LLAMAGEN_T2I) == 1


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


def test_lumina_example_on_a_tiny_converted_checkpoint(tmp_path):
    """The README's Lumina-mGPT 2.0 example, on a tiny checkpoint in Lumina's layout converted by the CLI (its grid
    is 8 x 8 codes at 64 pixels, so only the size is substituted)."""
    from vispec.cli import main

    from lumina_reference import CODE0, lumina_tokenizer, official_config, official_weights, write_folder
    from movqgan_reference import TINY, randomized

    config = official_config(mp=1)
    checkpoint = write_folder(tmp_path / "Lumina-mGPT-2.0", config, official_weights(config, seed=3))
    lumina_tokenizer().save_pretrained(checkpoint)
    torch.save(randomized(TINY).state_dict(), tmp_path / "movqgan_270M.ckpt")
    assert main(["convert", "lumina-mgpt", "--checkpoint", str(checkpoint), "--movqgan", str(tmp_path / "movqgan_270M.ckpt"),
                 "--out", str(tmp_path / "lumina-mgpt-2"), "--image-token-offset", str(CODE0), "--size", "64"]) == 0
    code = LUMINA[0]
    assert "height=768, width=768" in code, "the README example changed: update this test"
    code = code.replace("height=768, width=768", "height=64, width=64")
    code += "\nassert out.images[0].size == (64, 64) and (tmp := __import__('os').path.isfile('cat.png'))\n"
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"{code}\n{result.stderr[-3000:]}"


def test_llamagen_t2i_example_on_a_tiny_converted_checkpoint(tmp_path, monkeypatch):
    """docs/image.md's LlamaGen t2i example: its ``vispec convert llamagen --text-encoder`` line on the tiny t2i
    checkpoint (4 heads, 4 caption tokens, a 4 x 4 grid at 64 pixels: those flags substituted) and a tiny T5 folder,
    then the python block as written."""
    import shlex

    from llamagen_t5_reference import write_t5_folder

    from vispec.cli import main

    page = (ROOT / "docs" / "image.md").read_text()
    line = next(line for line in page.splitlines() if line.startswith("vispec convert llamagen --gpt t2i_XL"))
    assert "--gpt-model GPT-XL" in line, "the docs example changed: update this test"
    argv = shlex.split(line.replace("--gpt-model GPT-XL", "--n-head 4 --image-size 64 --cls-token-num 4"))[1:]
    shutil.copy(DATA / "t2i_tiny_raw.pt", tmp_path / "t2i_XL_stage1_256.pt")
    shutil.copy(DATA / "vq16_tiny.pt", tmp_path / "vq_ds16_t2i.pt")
    write_t5_folder(tmp_path / "flan-t5-xl")
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 0
    code = LLAMAGEN_T2I[0] + "\nassert out.images[0].size == (64, 64) and __import__('os').path.isfile('cat.png')\n"
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"{code}\n{result.stderr[-3000:]}"
