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
