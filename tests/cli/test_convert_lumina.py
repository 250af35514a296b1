"""``vispec convert lumina-mgpt``: a tiny checkpoint folder in Lumina-mGPT 2.0's layout (their config fields and
key names, their special-token names in the tokenizer) and a tiny MoVQGAN file in the official layout become a
UnifiedImagePipeline folder that loads and generates, from Python and from the CLI."""

from __future__ import annotations

import pytest
import torch

from vispec.cli import main
from vispec.models.lumina_checkpoint import load_lumina_chameleon
from vispec.pipelines import UnifiedImagePipeline

from lumina_reference import CODE0, lumina_tokenizer, official_config, official_weights, write_folder
from movqgan_reference import TINY, randomized


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("lumina")
    config = official_config(mp=1)
    checkpoint = write_folder(root / "Lumina-mGPT-2.0", config, official_weights(config, seed=3))
    lumina_tokenizer().save_pretrained(checkpoint)
    movq = root / "movqgan_tiny.ckpt"
    torch.save(randomized(TINY).state_dict(), movq)
    out = root / "pipeline"
    assert main(["convert", "lumina-mgpt", "--checkpoint", str(checkpoint), "--movqgan", str(movq), "--out", str(out),
                 "--image-token-offset", str(CODE0), "--size", "64"]) == 0
    return checkpoint, movq, out


def test_converted_folder_holds_the_layout_and_the_weights(converted):
    checkpoint, _, out = converted
    pipe = UnifiedImagePipeline.from_pretrained(out)
    tokenizer = lumina_tokenizer()
    vocab = tokenizer.get_vocab()
    cfg = pipe.config
    assert (cfg.code_offset, cfg.num_codes, cfg.downsample, cfg.resolution_unit) == (CODE0, 32, 8, 32)
    assert (cfg.image_start_id, cfg.eol_id, list(cfg.image_end_ids)) == (vocab["<racm3:break>"], vocab["<reserved08799>"],
                                                                          [vocab["<eoss>"]])
    assert list(cfg.prompt_suffix_ids) == [vocab["<reserved08706>"]]
    layout = pipe.layout(64, 64)
    assert layout.prefix == (vocab["<racm3:break>"], vocab["<reserved08802>"], vocab["<reserved08802>"])
    assert (pipe.decoding_config.guidance_scale, pipe.decoding_config.top_k) == (4.0, 0)  # 4096 > 32 codes
    reference = load_lumina_chameleon(checkpoint).state_dict()
    saved = pipe.transformer.state_dict()
    assert all(torch.equal(saved[k], v) for k, v in reference.items() if not k.startswith("model.vqmodel."))


def test_converted_pipeline_generates(converted, tmp_path, capsys):
    _, _, out = converted
    pipe = UnifiedImagePipeline.from_pretrained(out)
    pipe.set_progress_bar_config(disable=True)
    images = pipe("a red cat", decoding="mc-sjd", generator=torch.Generator().manual_seed(0), output_type="pt").images
    assert images.shape == (1, 3, 64, 64)
    grid = pipe("a red cat", decoding="ar", generator=torch.Generator().manual_seed(0), output_type="latent").images
    assert grid.shape == (1, 8, 8) and bool((grid >= 0).all() and (grid < 32).all())
    path = tmp_path / "cat.png"
    assert main(["generate", "image", "--model", str(out), "--prompt", "a red cat", "--out", str(path), "--quiet"]) == 0
    assert path.is_file()


def test_bad_folders_are_named(tmp_path, converted, capsys):
    checkpoint, movq, _ = converted
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["convert", "lumina-mgpt", "--checkpoint", str(empty), "--movqgan", str(movq), "--out",
                 str(tmp_path / "o1")]) == 2
    assert "empty is not a Lumina-mGPT checkpoint folder: config.json is missing" in capsys.readouterr().err
    assert main(["convert", "lumina-mgpt", "--checkpoint", str(checkpoint), "--tokenizer", str(empty), "--movqgan",
                 str(movq), "--out", str(tmp_path / "o1")]) == 2
    assert "no tokenizer could be read from" in capsys.readouterr().err
    assert main(["convert", "lumina-mgpt", "--checkpoint", str(checkpoint), "--movqgan", str(movq), "--out",
                 str(tmp_path / "o2"), "--image-token-offset", "80", "--size", "64"]) == 2
    assert "exceed the model's vocabulary (96)" in capsys.readouterr().err
