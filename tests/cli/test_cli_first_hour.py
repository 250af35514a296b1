"""First-hour defects of ``vispec generate`` and ``vispec convert lumina-mgpt`` (issue 28, items 9 to 14 and 16):
each refusal is one line naming what the user typed, before any model is loaded."""

from __future__ import annotations

import json
import os
import re
import shlex

import pytest

from vispec.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def one_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("vispec: error:"), err
    return err[0]


@pytest.fixture
def no_loading(monkeypatch):
    """Loading any pipeline fails the test: the refusals must come first."""
    from vispec.pipelines import LlamaGenPipeline, MaskedDiffusionLMPipeline, UnifiedImagePipeline

    def refuse(*args, **kwargs):
        raise AssertionError("a pipeline was loaded before the arguments were checked")

    for cls in (LlamaGenPipeline, MaskedDiffusionLMPipeline, UnifiedImagePipeline):
        monkeypatch.setattr(cls, "from_pretrained", refuse)


# ---- item 9: a text model given to `generate image` ---------------------------------------------------------

@pytest.mark.parametrize("flags", [["--prompt", "x"], ["--class", "1"], []])
def test_generate_image_with_a_text_model_names_generate_text(capsys, no_loading, flags):
    assert main(["generate", "image", "--model", "tiny-mdlm", *flags]) == 2
    line = one_line(capsys)
    assert "use `vispec generate text`" in line and "class-conditional" not in line and "--class" not in line


# ---- item 10: a corrupt STEM.run.json with --resume -----------------------------------------------------------

@pytest.mark.parametrize("text", ["{not json", "[1, 2]", "\xff\xfe"])
def test_resume_with_a_corrupt_record_names_the_file_and_resume(tmp_path, capsys, no_loading, text):
    record = tmp_path / "x.run.json"
    record.write_bytes(text.encode("latin-1"))
    assert main(["generate", "image", "--class", "1", "--num-images", "2", "--out", str(tmp_path / "x.png"),
                 "--resume", "--quiet"]) == 2
    line = one_line(capsys)
    assert "--resume" in line and str(record) in line


# ---- item 11: --out in a folder that does not exist yet ----------------------------------------------------------

def test_out_in_a_missing_folder_is_created(tmp_path, capsys, monkeypatch):
    """The command-line page's ``--out cats/cat.png`` example, run as written in a fresh folder (fewer images)."""
    line = next(line for line in open(os.path.join(ROOT, "docs", "cli.md")) if "--out cats/cat.png" in line)
    argv = shlex.split(line.split("#")[0])[1:]
    assert argv[:2] == ["generate", "image"]
    argv[argv.index("--num-images") + 1] = "2"  # 1000 images in the docs; the path handling is the same
    monkeypatch.chdir(tmp_path)
    assert main([*argv, "--quiet"]) == 0
    assert sorted(os.listdir(tmp_path / "cats")) == ["cat-0.png", "cat-1.png", "cat.run.json"]


def test_out_under_a_file_is_refused(tmp_path, capsys, no_loading):
    (tmp_path / "file").write_text("x")
    assert main(["generate", "image", "--class", "1", "--out", str(tmp_path / "file" / "cats" / "cat.png")]) == 2
    assert "is a file, so the folder" in one_line(capsys)
    assert main(["bench", "decoders", "--json", str(tmp_path / "new" / "deeper" / "r.json"), "--rounds", "0"]) == 2
    assert (tmp_path / "new" / "deeper").is_dir()  # --json's folder made too, as for --out
    capsys.readouterr()


# ---- items 12 and 13: --prompts-file ----------------------------------------------------------------------------

TEXT = ["generate", "text", "--model", "tiny-mdlm", "--gen-length", "8", "--block-length", "8", "--quiet"]


def test_prompts_file_that_is_not_utf8_is_one_line(tmp_path, capsys, no_loading):
    prompts = tmp_path / "p.txt"
    prompts.write_bytes(b"sort the numbers : 3 1 2\n\xff\xfe caf\xe9\n")
    assert main([*TEXT, "--prompts-file", str(prompts), "--out", str(tmp_path / "a.jsonl")]) == 2
    line = one_line(capsys)
    assert "--prompts-file" in line and str(prompts) in line and "UTF-8" in line


def test_prompts_file_other_prompts_same_out_is_refused(tmp_path, capsys, monkeypatch):
    a, b, copy = tmp_path / "a.txt", tmp_path / "b.txt", tmp_path / "copy-of-a.txt"
    a.write_text("sort the numbers : 3 1 2\nreverse the letters : a b\n")
    b.write_text("sort the numbers : 9 8 7\n")
    copy.write_text(a.read_text())
    out = tmp_path / "a.jsonl"
    assert main([*TEXT, "--prompts-file", str(a), "--out", str(out)]) == 0
    first = out.read_text()
    assert [json.loads(r)["prompt"] for r in first.splitlines()] == a.read_text().splitlines()
    capsys.readouterr()

    from vispec.pipelines import MaskedDiffusionLMPipeline

    loaded = []
    real = MaskedDiffusionLMPipeline.from_pretrained.__func__
    monkeypatch.setattr(MaskedDiffusionLMPipeline, "from_pretrained",
                        classmethod(lambda cls, *a, **k: loaded.append(1) or real(cls, *a, **k)))
    for argv, differing in (([*TEXT, "--prompts-file", str(b), "--out", str(out)], "prompts"),
                            ([*TEXT, "--prompts-file", str(a), "--out", str(out), "--threshold", "0.5"], "threshold"),
                            ([*TEXT, "--prompts-file", str(a), "--out", str(out), "--seed", "4"], "seed")):
        assert main(argv) == 2
        line = one_line(capsys)
        assert f"--out {str(out)!r}" in line and re.search(rf"differing: [^)]*\b{differing}\b", line), line
    assert loaded == [] and out.read_text() == first  # refused before the model loaded; the answers kept
    assert main([*TEXT, "--prompts-file", str(copy), "--out", str(out)]) == 0  # the same prompts: the stored answers
    assert out.read_text() == first
    other = tmp_path / "b.jsonl"
    assert main([*TEXT, "--prompts-file", str(b), "--out", str(other)]) == 0
    assert json.loads(other.read_text())["prompt"] == "sort the numbers : 9 8 7"


def test_prompts_file_results_dir_with_a_corrupt_record(tmp_path, capsys, no_loading):
    prompts = tmp_path / "p.txt"
    prompts.write_text("sort the numbers : 3 1 2\n")
    parts = tmp_path / "a.jsonl.parts"
    parts.mkdir()
    (parts / "run.json").write_text("{")
    assert main([*TEXT, "--prompts-file", str(prompts), "--out", str(tmp_path / "a.jsonl")]) == 2
    line = one_line(capsys)
    assert str(parts / "run.json") in line and "--out" in line


# ---- item 14: convert lumina-mgpt names its flags ----------------------------------------------------------------

@pytest.mark.parametrize("flags,words", [
    (["--size", "100"], "--size must be a multiple of 32"),
    (["--size", "0"], "--size must be an integer >= 1"),
    (["--size", "-64"], "--size must be an integer >= 1"),
    (["--size", "32000"], "--size 32000: the tokenizer has no resolution token for 1000 patches"),
    (["--image-token-offset", "-5"], "--image-token-offset must be an integer >= 0"),
])
def test_convert_lumina_errors_name_the_flags(tmp_path, capsys, flags, words):
    import torch

    from lumina_reference import CODE0, lumina_tokenizer, official_config, official_weights, write_folder
    from movqgan_reference import TINY, randomized

    config = official_config(mp=1)
    checkpoint = write_folder(tmp_path / "ckpt", config, official_weights(config, seed=3))
    lumina_tokenizer().save_pretrained(checkpoint)
    movq = tmp_path / "movq.ckpt"
    torch.save(randomized(TINY).state_dict(), movq)
    argv = ["convert", "lumina-mgpt", "--checkpoint", str(checkpoint), "--movqgan", str(movq), "--out",
            str(tmp_path / "out"), "--image-token-offset", str(CODE0), "--size", "64", *flags]
    assert main(argv) == 2
    line = one_line(capsys)
    assert words in line and not re.search(r"\b(height|code_offset)\b", line), line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("field,value,words", [
    ("vocab_size", "many", "config.json vocab_size must be an integer"),
    ("num_hidden_layers", 2.5, "config.json num_hidden_layers must be an integer"),
    ("vq_config", [1], "config.json vq_config must be an object"),
])
def test_convert_lumina_badly_typed_config_field(tmp_path, capsys, field, value, words):
    """A ``config.json`` field of the wrong type is named in vispec's words, before the tokenizer (whose loading
    parses ``config.json`` through transformers) or any weight is read."""
    import json

    import torch

    from lumina_reference import CODE0, lumina_tokenizer, official_config, official_weights, write_folder
    from movqgan_reference import TINY, randomized

    config = official_config(mp=1)
    checkpoint = write_folder(tmp_path / "ckpt", config, official_weights(config, seed=3))
    lumina_tokenizer().save_pretrained(checkpoint)
    path = checkpoint / "config.json"
    written = json.loads(path.read_text())
    written[field] = value
    path.write_text(json.dumps(written))
    movq = tmp_path / "movq.ckpt"
    torch.save(randomized(TINY).state_dict(), movq)
    argv = ["convert", "lumina-mgpt", "--checkpoint", str(checkpoint), "--movqgan", str(movq), "--out",
            str(tmp_path / "out"), "--image-token-offset", str(CODE0), "--size", "64"]
    assert main(argv) == 2
    line = one_line(capsys)
    assert words in line, line
    assert not (tmp_path / "out").exists()


def test_convert_lumina_size_not_a_multiple_of_the_movqgan_downsampling(tmp_path, capsys):
    """The MoVQGAN's downsampling (8 for the tiny one) and the patch size (32) agree at 32; a tokenizer patch of 32
    with a downsampling that does not divide it is caught after the MoVQGAN is read, still naming --size."""
    from vispec.cli.convert import check_size

    with pytest.raises(ValueError, match=r"--size must be a multiple of 96 pixels .*MoVQGAN downsampling"):
        check_size(64, 96, {2: 10}, 32)
    check_size(64, 32, {2: 10}, 32)


# ---- item 16: the help of `generate image` ----------------------------------------------------------------------

def test_generate_help_names_text_to_image(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "class-conditional (--class" in text and "text-to-image (--prompt" in text
