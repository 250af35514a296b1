"""The text half of the CLI: train mdlm -> assemble-mdlm -> generate text -> bench text, and one-line errors."""

from __future__ import annotations

import json

import pytest

from vispec.cli import main


@pytest.fixture(scope="module")
def pipeline_folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("mdlm")
    args = ["train", "mdlm", "--out", str(root / "trained"), "--steps", "2", "--batch-size", "4", "--d-model", "32",
            "--n-layers", "1", "--n-heads", "2", "--mlp-hidden-size", "48", "--warmup", "1", "--eval-every", "0",
            "--final-eval-n", "0", "--tokenizer-corpus", "100", "--answer-length", "32", "--threads", "1"]
    assert main(args) == 0
    assert main(["train", "assemble-mdlm", "--trained", str(root / "trained"), "--out", str(root / "pipe"),
                 "--block-length", "8"]) == 0
    return root / "pipe"


def test_assembled_folder_loads_with_its_defaults(pipeline_folder):
    from vispec.dllm import ThresholdScheduler
    from vispec.pipelines import MaskedDiffusionLMPipeline

    pipe = MaskedDiffusionLMPipeline.from_pretrained(pipeline_folder)
    assert pipe.config.default_gen_length == 32 and pipe.config.default_block_length == 8
    assert isinstance(pipe.scheduler, ThresholdScheduler) and pipe.scheduler.config.threshold == 0.9
    assert "Training record" in (pipeline_folder / "README.md").read_text()
    assert (pipeline_folder / "logs" / "model.jsonl").is_file()


def test_generate_text(pipeline_folder, capsys):
    assert main(["generate", "text", "--model", str(pipeline_folder), "--prompt", "sort the numbers : 3 1 2",
                 "--strategy", "threshold", "--threshold", "0.9", "--cache", "dual", "--quiet"]) == 0
    captured = capsys.readouterr()
    assert "threshold + dual cache: NFE" in captured.err


def test_generate_text_steps_are_the_total(pipeline_folder, capsys):
    """``--steps`` is the total number of steps (the pipeline's ``steps``), not LLaDA2's steps per block."""
    assert main(["generate", "text", "--model", str(pipeline_folder), "--prompt", "sort the numbers : 3 1 2",
                 "--strategy", "llada", "--steps", "8", "--gen-length", "32", "--block-length", "8", "--no-early-stop",
                 "--quiet"]) == 0
    assert "NFE 8" in capsys.readouterr().err


def test_bench_text_writes_table_and_json(pipeline_folder, tmp_path, capsys):
    path = tmp_path / "bench-text.json"
    assert main(["bench", "text", "--model", str(pipeline_folder), "--strategies", "llada,threshold", "--cache", "none,dual",
                 "--tasks", "arithmetic,sort", "--num-problems", "2", "--batch-size", "2", "--no-early-stop", "--json", str(path)]) == 0
    assert "tok/s" in capsys.readouterr().out
    result = json.loads(path.read_text())
    runs = result["runs"]
    settings = {(r["strategy"], r["cache"], r["task"], r["batch_size"]) for r in runs}
    assert len(runs) == len(settings) == 2 * 2 * 2 * 2
    for r in runs:
        assert {"strict_match", "flexible_extract"} <= set(r) if r["task"] == "arithmetic" else "exact_match" in r
        assert {"nfe", "tokens_per_forward", "tokens_per_s", "latency_s", "peak_mem_mb", "speedup", "latency_speedup",
                "nfe_reduction"} <= set(r)
        assert 1 <= r["nfe"] <= 32
    base = next(r for r in runs if (r["strategy"], r["cache"], r["batch_size"]) == ("llada", "none", 1))
    assert base["nfe"] == 32 and base["latency_speedup"] == 1.0 and result["config"]["early_stop_eos"] is False
    assert result["config"]["gen_length"] == 32 and result["config"]["block_length"] == 8


def test_bench_text_reference_is_llada_without_early_stop(pipeline_folder, tmp_path, capsys):
    """With early stop on (the default), LLaDA's baseline (no cache, no early stop) is still the reference row and
    llada + none with early stop is a row of its own; speed-ups are against the reference."""
    path = tmp_path / "bench-text.json"
    assert main(["bench", "text", "--model", str(pipeline_folder), "--strategies", "llada,threshold", "--cache", "none",
                 "--tasks", "arithmetic", "--num-problems", "2", "--batch-size", "1", "--json", str(path)]) == 0
    assert "reference: llada, no cache, no early stop" in capsys.readouterr().out
    runs = json.loads(path.read_text())["runs"]
    assert [(r["strategy"], r["early_stop_eos"], r["reference"]) for r in runs] == [
        ("llada", False, True), ("llada", True, False), ("threshold", True, False)]
    reference = runs[0]
    assert reference["nfe"] == 32 and reference["nfe_reduction"] == 1.0
    for r in runs[1:]:
        assert r["nfe_reduction"] == pytest.approx(32 / r["nfe"])


@pytest.mark.parametrize("argv,words", [
    (["generate", "text", "--model", "tiny-nothing", "--prompt", "x"], "unknown model"),
    (["bench", "text", "--model", "PIPE", "--strategies", "llada,warp"], "unknown strategy 'warp'"),
    (["bench", "text", "--model", "PIPE", "--cache", "paged"], "unknown cache 'paged'"),
    (["generate", "text", "--model", "PIPE", "--prompt", "x", "--strategy", "threshold", "--threshold", "1.5"], "threshold must be"),
    (["generate", "text", "--model", "PIPE", "--prompt", "x", "--gen-length", "30", "--block-length", "8"], "multiple of --block-length (8)"),
])
def test_user_errors_are_one_line(pipeline_folder, capsys, argv, words):
    argv = [str(pipeline_folder) if a == "PIPE" else a for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("vispec: error:") and words in err[0]


def test_bench_text_settings_rules_and_plot(pipeline_folder, tmp_path, capsys):
    """``--settings strategy+rule@cache`` replaces the grid; each rule reaches the decoder; ``--reference`` adds LLaDA's
    baseline row (and the ratios against it); the plot is written."""
    path = tmp_path / "bench-rules.json"
    assert main(["bench", "text", "--model", str(pipeline_folder), "--reference", "--settings",
                 "llada+eotp,threshold+prophet+eotp@dual,threshold+adablock@prefix,threshold@dkv",
                 "--delimiters", "=", "--tasks", "arithmetic", "--num-problems", "2", "--batch-size", "2",
                 "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"wrote {tmp_path / 'bench-rules.png'}" in out and (tmp_path / "bench-rules.png").stat().st_size > 0
    runs = json.loads(path.read_text())["runs"]
    names = [(r["strategy"], tuple(r["rules"]), r["cache"]) for r in runs if r["batch_size"] == 1]
    assert names == [("llada", (), "none"), ("llada", ("eotp",), "none"), ("threshold", ("prophet", "eotp"), "dual"),
                     ("threshold", ("adablock",), "prefix"), ("threshold", (), "dkv")]
    assert all(1 <= r["nfe"] <= 32 and r["nfe_reduction"] > 0 and r["latency_speedup"] > 0 for r in runs), runs


def test_bench_text_self_speculation_rows(pipeline_folder, tmp_path, capsys):
    """``llada+ssd=4`` runs after its stepwise twin (added when not listed), with the same texts (``identical`` 1.0),
    the twin's NFE and its speed-up over the twin beside its own, and the canvases it forwarded; ``ssd`` alone takes
    ``--draft-length``. Without ``--reference`` LLaDA's baseline row does not run (nor its ratios)."""
    from vispec.eval.bench.text import format_text_table

    path = tmp_path / "bench-ssd.json"
    assert main(["bench", "text", "--model", str(pipeline_folder), "--settings", "llada+ssd=4,threshold+ssd",
                 "--draft-length", "3", "--tasks", "sort", "--num-problems", "3", "--batch-sizes", "2,3",
                 "--json", str(path)]) == 0
    result = json.loads(path.read_text())
    runs = result["runs"]
    assert sorted({r["batch_size"] for r in runs}) == [1, 2, 3]
    names = [(r["strategy"], tuple(r["rules"]), r["early_stop_eos"]) for r in runs if r["batch_size"] == 1]
    assert names == [("llada", (), True), ("llada", ("ssd=4",), True), ("threshold", (), True),
                     ("threshold", ("ssd",), True)]
    for row in runs:
        assert "speedup" not in row and "nfe_reduction" not in row
        if row["rules"]:
            assert row["identical"] == 1.0 and row["nfe"] <= row["stepwise_nfe"] and row["canvases"] >= row["nfe"]
            assert row["cpu_s"] > 0 and row["stepwise_speedup"] > 0
    table = format_text_table(result)
    assert "ssd=4" in table and " 1.00 " in table


def test_generate_text_self_speculation(pipeline_folder, capsys):
    argv = ["generate", "text", "--model", str(pipeline_folder), "--prompt", "sort the numbers : 3 1 2", "--strategy",
            "llada", "--cache", "none", "--quiet"]
    assert main(argv) == 0
    stepwise = capsys.readouterr().out
    assert main(argv + ["--rules", "ssd=4"]) == 0
    assert capsys.readouterr().out == stepwise
    assert main(argv[:-3] + ["--cache", "dual", "--quiet"]) == 0
    dual = capsys.readouterr().out
    assert main(argv[:-3] + ["--cache", "dual", "--rules", "ssd=auto", "--quiet"]) == 0  # the cached run's tokens
    assert capsys.readouterr().out == dual
    assert main(argv[:-3] + ["--cache", "dkv", "--rules", "ssd", "--quiet"]) == 2
    assert "speculative" in capsys.readouterr().err


def test_bench_text_learn2pd_needs_a_filter(pipeline_folder, capsys):
    assert main(["bench", "text", "--model", str(pipeline_folder), "--settings", "learn2pd", "--tasks", "arithmetic",
                 "--num-problems", "1", "--batch-size", "1"]) == 2
    assert "needs a Learn2PD filter" in capsys.readouterr().err


@pytest.mark.parametrize("setting, match", [
    ("warp@dual", "unknown strategy 'warp'"), ("threshold+fast", "unknown rule 'fast'"),
    ("threshold@ram", "unknown cache 'ram'"), ("threshold+eotp+eotp", "repeated"),
])
def test_bench_text_bad_settings(setting, match):
    from vispec.eval.bench.text import TextBenchConfig

    with pytest.raises(ValueError, match=match):
        TextBenchConfig(settings=(setting,)).validate()


@pytest.mark.parametrize("field, value, match", [
    ("filter_threshold", 0.0, "threshold"), ("prophet_thresholds", (1.0,), "thresholds"),
    ("delimiter_threshold", 2.0, "threshold"), ("delimiters", (), "delimiters"),
])
def test_bench_text_bad_rule_settings(field, value, match):
    from vispec.eval.bench.text import TextBenchConfig

    with pytest.raises(ValueError, match=match):
        TextBenchConfig(**{field: value}).validate()


def test_generate_text_rules_and_dkv(pipeline_folder, capsys):
    assert main(["generate", "text", "--model", str(pipeline_folder), "--prompt", "sort the numbers : 3 1 2",
                 "--strategy", "threshold", "--rules", "eotp,prophet,adablock", "--delimiters", "=", "--cache", "dkv",
                 "--cache-reload-steps", "2", "--quiet"]) == 0
    assert "threshold+eotp+prophet+adablock + dkv cache: NFE" in capsys.readouterr().err
    assert main(["generate", "text", "--model", str(pipeline_folder), "--prompt", "sort the numbers : 3 1 2",
                 "--strategy", "dream", "--dream-alg", "maskgit_plus", "--steps", "8", "--quiet"]) == 0
    assert "dream + none cache: NFE" in capsys.readouterr().err


@pytest.mark.parametrize("args, match", [
    (["--rules", "eotp,warp"], "--rules: unknown rule 'warp'"),
    (["--rules", "ssd=0"], "ssd=K needs a draft length K in"),
    (["--rules", "eotp=3"], "rule 'eotp' takes no value"),
    (["--rules", "ssd,ssd=4"], "names a rule twice"),
    (["--cache", "dkv", "--cache-reload-steps", "0"], "cache_reload_steps"),
    (["--strategy", "learn2pd"], "no filter component"),
])
def test_generate_text_bad_rules(pipeline_folder, capsys, args, match):
    assert main(["generate", "text", "--model", str(pipeline_folder), "--prompt", "sort the numbers : 3 1 2", "--quiet",
                 *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and match in err[0]


def test_generate_text_runs_the_models_own_policy_and_accepts_editing(capsys):
    """Issue 47 item 24: without --strategy the model's saved policy runs (tiny-llada2: LLaDA2's editing rule, which
    --strategy could not name before); a strategy's knob without --strategy is refused, not dropped."""
    argv = ["generate", "text", "--model", "tiny-llada2", "--prompt", "sort the numbers : 3 1 2", "--quiet"]
    assert main(argv) == 0
    own = capsys.readouterr()
    assert "[editing + none cache" in own.err
    assert main(argv + ["--strategy", "editing"]) == 0
    assert capsys.readouterr().out == own.out  # the saved rule has the editing policy's default settings
    assert main(argv + ["--factor", "2"]) == 2
    assert "--factor sets a knob of a strategy: pass --strategy too" in capsys.readouterr().err
