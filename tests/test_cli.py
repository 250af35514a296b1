"""The vispec command line: version, decoder benchmark JSON, one-line errors."""

from __future__ import annotations

import json

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
    assert "step x" in out and "mc-sjd-gumbel" in out
    result = json.loads(path.read_text())
    assert set(result["methods"]) == {"ar", "sjd-vertical", "mc-sjd-gumbel"}
    assert result["config"]["num_images"] == 2
    for stats in result["methods"].values():
        assert {"nfe", "accepted_per_forward", "step_compression", "latency_s", "speedup", "peak_mem_mb"} <= set(stats)
        assert stats["nfe"] <= 16 and stats["peak_mem_mb"] > 0
    assert result["methods"]["ar"]["step_compression"] == 1.0


def test_user_errors_are_one_line(capsys):
    assert main(["bench", "decoders", *SMALL, "--methods", "ar,warp"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("vispec: error:") and "warp" in err[0]
    assert main(["bench", "decoders", *SMALL, "--model", "GPT-Z"]) == 2
    assert "GPT-Z" in capsys.readouterr().err
    assert main(["bench", "decoders", *SMALL, "--window", "0", "--methods", "sjd"]) == 2
    assert "window" in capsys.readouterr().err


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
    assert pipe.transformer.config.num_classes == 10 and pipe.decoding_config.config.guidance_scale == 1.0  # no null class
    image_path = tmp_path / "cat.png"
    assert main(["generate", "image", "--model", str(out), "--class", "3", "--decoding", "mc-sjd", "--seed", "0",
                 "--out", str(image_path), "--quiet"]) == 0
    assert "NFE" in capsys.readouterr().out
    assert Image.open(image_path).size == (64, 64)
    assert main(["generate", "image", "--model", str(out), "--class", "10", "--out", str(image_path), "--quiet"]) == 2
    assert "class_labels" in capsys.readouterr().err


def test_convert_rejects_mismatched_vocabulary(tmp_path, capsys):
    import torch

    sd = torch.load(f"{DATA}/t2i_tiny_raw.pt", weights_only=True)
    sd["tok_embeddings.weight"] = torch.zeros(32, 64)
    sd["output.weight"] = torch.zeros(32, 64)
    torch.save(sd, tmp_path / "gpt.pt")
    assert main(["convert", "llamagen", "--gpt", str(tmp_path / "gpt.pt"), "--vq", f"{DATA}/vq16_tiny.pt",
                 "--out", str(tmp_path / "x"), "--n-head", "4", "--image-size", "64", "--cls-token-num", "4"]) == 2
    assert "codebook has 64 codes" in capsys.readouterr().err
