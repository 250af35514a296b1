"""The vispec command line: version, decoder benchmark JSON, one-line errors."""

from __future__ import annotations

import json

import pytest

from vispec.cli import main
from vispec.version import __version__

SMALL = ["--model", "GPT-mini", "--vocab-size", "64", "--image-tokens", "16", "--num-classes", "4", "--num-images", "2", "--window", "4"]


def test_version(capsys):
    try:
        main(["--version"])
    except SystemExit as exit_:
        assert exit_.code == 0
    assert __version__ in capsys.readouterr().out


def test_bench_decoders_writes_table_and_json(tmp_path, capsys):
    path = tmp_path / "bench.json"
    assert main(["bench", "decoders", *SMALL, "--methods", "sjd-vertical,mc-sjd-gumbel", "--batch-size", "2", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "step x" in out and "mc-sjd-gumbel" in out and "1-token" in out
    result = json.loads(path.read_text())
    assert set(result["methods"]) == {"ar", "sjd-vertical", "mc-sjd-gumbel"}
    assert result["methods"]["ar"]["single_token_passes"] == 1.0
    assert 0 <= result["methods"]["mc-sjd-gumbel"]["single_token_passes"] < 1
    assert result["config"]["num_images"] == 2
    for stats in result["methods"].values():
        assert {"nfe", "accepted_per_forward", "step_compression", "latency_s", "speedup", "peak_mem_mb"} <= set(stats)
        assert stats["nfe"] <= 16 and stats["peak_mem_mb"] > 0
    assert result["methods"]["ar"]["step_compression"] == 1.0


@pytest.mark.slow
def test_bench_decoders_batch_sweep_eager_and_compiled(tmp_path, capsys):
    """--batch-sizes and --compile: one row per batch size, compile setting and method, with the ratios and counts."""
    path = tmp_path / "sweep.json"
    args = [*SMALL, "--image-tokens", "4", "--window", "2", "--num-images", "1", "--init-std", "0.3", "--methods", "ar,mc-sjd-maximal",
            "--batch-sizes", "1,2", "--compile", "--rounds", "1", "--json", str(path)]
    assert main(["bench", "decoders", *args]) == 0
    out = capsys.readouterr().out
    assert "vs eager AR" in out and "syncs/step" in out and "compiled" in out
    result = json.loads(path.read_text())
    assert result["config"]["batch_sizes"] == [1, 2] and result["config"]["compile"] is True
    rows = result["rows"]
    assert {(r["batch_size"], r["method"], r["compile"]) for r in rows} == {
        (b, m, c) for b in (1, 2) for m in ("ar", "mc-sjd-maximal") for c in (False, True)}
    for row in rows:
        assert {"images_per_s", "s_per_image", "speedup_vs_ar", "speedup_vs_eager_ar", "step_compression", "syncs_per_step",
                "ops_per_step", "windows", "round_s", "warmup_s"} <= set(row)
        assert row["images"] == row["batch_size"] and len(row["round_s"]) == 1
        assert row["images_per_s"] > 0 and row["ops_per_step"] > 0 and row["syncs_per_step"] >= 0
        assert sum(row["windows"].values()) == row["steps_per_decode"]  # one decode per round
        if row["method"] == "ar":
            assert row["windows"] == {"1": 3} and row["step_compression"] == 1.0
            assert row["speedup_vs_ar"] == 1.0
            if not row["compile"]:
                assert row["speedup_vs_eager_ar"] == 1.0
        else:
            assert row["step_compression"] >= 1.0 and max(int(w) for w in row["windows"]) <= 2


def test_user_errors_are_one_line(capsys):
    assert main(["bench", "decoders", *SMALL, "--methods", "ar,warp"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("vispec: error:") and "warp" in err[0]
    assert main(["bench", "decoders", *SMALL, "--model", "GPT-Z"]) == 2
    assert "GPT-Z" in capsys.readouterr().err
    assert main(["bench", "decoders", *SMALL, "--window", "0", "--methods", "sjd"]) == 2
    assert "window" in capsys.readouterr().err
    assert main(["bench", "decoders", *SMALL, "--batch-sizes", "1,0"]) == 2
    assert "batch_sizes" in capsys.readouterr().err
    assert main(["bench", "decoders", *SMALL, "--model", "tiny-c2i", "--image-tokens", "1024"]) == 2
    assert "256" in capsys.readouterr().err


DATA = "tests/data/llamagen"


def test_convert_official_checkpoints_then_generate(tmp_path, capsys):
    from PIL import Image

    from vispec.pipelines import LlamaGenPipeline

    out = tmp_path / "pipe"
    args = ["convert", "llamagen", "--gpt", f"{DATA}/c2i_tiny.pt", "--vq", f"{DATA}/vq16_tiny.pt", "--out", str(out), "--n-head", "4"]
    assert main(args) == 2  # the DDP checkpoint pickles its args: refused without the opt-in
    assert "--trust-pickle" in capsys.readouterr().err
    assert main([*args, "--trust-pickle"]) == 0
    pipe = LlamaGenPipeline.from_pretrained(out)
    assert pipe.transformer.config.num_classes == 10 and pipe.decoding_config.guidance_scale == 1.0  # no null class
    image_path = tmp_path / "cat.png"
    assert main(["generate", "image", "--model", str(out), "--class", "3", "--decoding", "mc-sjd", "--seed", "0",
                 "--out", str(image_path), "--quiet"]) == 0
    assert "NFE" in capsys.readouterr().out
    assert Image.open(image_path).size == (64, 64)
    assert main(["generate", "image", "--model", str(out), "--class", "10", "--out", str(image_path), "--quiet"]) == 2
    assert "--class must be in [0, 10)" in capsys.readouterr().err  # the flag, and the range the checkpoint has


def test_convert_rejects_mismatched_vocabulary(tmp_path, capsys):
    import torch

    sd = torch.load(f"{DATA}/t2i_tiny_raw.pt", weights_only=True)
    sd["tok_embeddings.weight"] = torch.zeros(32, 64)
    sd["output.weight"] = torch.zeros(32, 64)
    torch.save(sd, tmp_path / "gpt.pt")
    assert main(["convert", "llamagen", "--gpt", str(tmp_path / "gpt.pt"), "--vq", f"{DATA}/vq16_tiny.pt",
                 "--out", str(tmp_path / "x"), "--n-head", "4", "--image-size", "64", "--cls-token-num", "4"]) == 2
    assert "codebook has 64 codes" in capsys.readouterr().err


def test_generate_image_takes_a_source_image(tmp_path, capsys):
    """Issue 47 item 23: ``--image PATH`` reaches image-to-image decoding (it said "give image=" with no way to);
    the output has the source's size; a missing file and a class-conditional model are refused by name."""
    import PIL.Image

    source = tmp_path / "source.png"
    PIL.Image.new("RGB", (64, 64), (200, 30, 30)).save(source)
    out = tmp_path / "edit.png"
    argv = ["generate", "image", "--model", "tiny-edit", "--prompt", "make the square blue", "--decoding", "iad",
            "--out", str(out), "--quiet"]
    assert main(argv + ["--image", str(source)]) == 0
    assert PIL.Image.open(out).size == (64, 64) and "iad" in capsys.readouterr().out
    assert main(argv + ["--image", str(tmp_path / "missing.png")]) == 2
    assert "--image" in capsys.readouterr().err
    assert main(["generate", "image", "--model", "tiny-c2i", "--class", "1", "--image", str(source), "--out",
                 str(tmp_path / "c.png")]) == 2
    assert "--image applies to text-to-image pipelines" in capsys.readouterr().err
