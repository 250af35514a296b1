"""Benchmarks and generation keep what they made (issue 13, item 8) and ``bench image`` sweeps batch sizes and
compile settings (issue 12, item 5): JSON written after every measured row (atomically, marked incomplete
until the end), a progress bar, images saved chunk by chunk, throughput rows per batch size."""

from __future__ import annotations

import json
import math

import pytest
import torch

from vispec.cli import main
from vispec.eval.bench import decoders, image, kernels, text
from vispec.pipelines.embedded import resolve_model_path

DATA = "tests/data/llamagen"
SMALL = ["--model", "GPT-mini", "--vocab-size", "64", "--image-tokens", "4", "--num-classes", "4", "--num-images", "1",
         "--window", "2", "--methods", "ar,sjd,mc-sjd"]


@pytest.fixture(scope="module")
def tiny_pipeline(tmp_path_factory):
    """The official-code test checkpoints converted: a 16-token, 0.1M-parameter LlamaGen pipeline (fast)."""
    out = tmp_path_factory.mktemp("tiny") / "pipe"
    assert main(["convert", "llamagen", "--gpt", f"{DATA}/c2i_tiny.pt", "--vq", f"{DATA}/vq16_tiny.pt", "--out", str(out),
                 "--n-head", "4", "--trust-pickle"]) == 0
    return out


def fail_on_call(monkeypatch, module, name: str, call: int, error: BaseException) -> None:
    """``module.name`` raises ``error`` on its ``call``-th call (1-based) and runs normally before."""
    real, calls = getattr(module, name), []

    def wrapper(*args, **kwargs):
        calls.append(1)
        if len(calls) == call:
            raise error
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, wrapper)


def read(path) -> dict:
    leftovers = [p.name for p in path.parent.iterdir() if p.name.endswith(".tmp")]
    assert not leftovers, leftovers  # atomic writes leave no temporary file behind
    return json.loads(path.read_text())


def test_bench_decoders_keeps_measured_rows_on_a_late_error_or_ctrl_c(tmp_path, capsys, monkeypatch):
    path = tmp_path / "bench.json"
    fail_on_call(monkeypatch, decoders, "_run_method", 3, ValueError("decoder exploded"))
    assert main(["bench", "decoders", *SMALL, "--json", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "decoder exploded" in err and f"the results measured so far are in {path}" in err
    partial = read(path)
    assert partial["complete"] is False and list(partial["methods"]) == ["ar", "sjd"]

    fail_on_call(monkeypatch, decoders, "_run_method", 2, KeyboardInterrupt())
    assert main(["bench", "decoders", *SMALL, "--json", str(path)]) == 130
    assert f"vispec: interrupted (the results measured so far are in {path}" in capsys.readouterr().err
    assert list(read(path)["methods"]) == ["ar"]

    monkeypatch.undo()
    assert main(["bench", "decoders", *SMALL, "--json", str(path)]) == 0
    final = read(path)
    assert "complete" not in final and set(final["methods"]) == {"ar", "sjd", "mc-sjd"}


def test_bench_decoders_sweep_writes_each_batch_size(tmp_path, capsys, monkeypatch):
    path = tmp_path / "sweep.json"
    fail_on_call(monkeypatch, decoders._Contender, "run", 5, ValueError("late"))  # B=1: 2 contenders x (warm-up + round)
    assert main(["bench", "decoders", *SMALL, "--methods", "ar,mc-sjd", "--batch-sizes", "1,2", "--rounds", "1",
                 "--json", str(path)]) == 2
    partial = read(path)
    assert partial["complete"] is False and {r["batch_size"] for r in partial["rows"]} == {1}


def test_bench_text_and_kernels_keep_measured_rows(tmp_path, capsys, monkeypatch):
    path = tmp_path / "text.json"
    fail_on_call(monkeypatch, text, "_run", 2, ValueError("late"))
    assert main(["bench", "text", "--strategies", "llada,threshold", "--cache", "none", "--tasks", "arithmetic",
                 "--num-problems", "1", "--batch-size", "1", "--json", str(path)]) == 2
    runs = read(path)["runs"]
    assert [(r["strategy"], r["cache"]) for r in runs] == [("llada", "none")] and runs[0]["nfe"] >= 1

    path = tmp_path / "kernels.json"
    fail_on_call(monkeypatch, kernels, "_forward_share", 1, ValueError("late"))
    assert main(["bench", "kernels", "--rows", "16", "--vocab", "64", "--ops", "verify", "--repeats", "1",
                 "--no-compile-check", "--json", str(path)]) == 2
    partial = read(path)
    assert partial["complete"] is False and [(c["op"], c["rows"], c["vocab"]) for c in partial["cells"]] == [("verify", 16, 64)]


def _bench_image_args(pipeline, path) -> list[str]:
    evaluator = f"{resolve_model_path('tiny-c2i')}/evaluator"  # a 64x64 crop classifier: fits the tiny pipeline's images
    return ["bench", "image", "--model", str(pipeline), "--evaluator", evaluator, "--methods", "ar,mc-sjd", "--num-images", "4",
            "--batch-size", "2", "--latency-images", "1", "--real-images", "4", "--noise-repeats", "1", "--json", str(path)]


def test_bench_image_sweeps_batch_sizes_and_compile_settings(tiny_pipeline, tmp_path, capsys, monkeypatch):
    """Throughput per batch size and compile setting; ``--compile`` reaches the pipeline (run eagerly here:
    a first compile takes minutes, and compiled decoding is tested where it is implemented)."""
    real, seen = image.generate_uint8, []

    def eager(pipe, method, labels, seeds, batch_size, cfg, compile=False, tick=None, tokens=None):
        seen.append((method, batch_size, len(seeds), compile, tokens is not None))
        return real(pipe, method, labels, seeds, batch_size, cfg, compile=False, tick=tick, tokens=tokens)

    monkeypatch.setattr(image, "generate_uint8", eager)
    calibrate = image.roofline.calibrate  # the roofline's cost curve: eager too
    monkeypatch.setattr(image.roofline, "calibrate", lambda *args, compile, **kw: calibrate(*args, compile=False, **kw))
    path = tmp_path / "bench.json"
    args = [*_bench_image_args(tiny_pipeline, path), "--batch-sizes", "1,2", "--compile", "--rounds", "1", "--sweep-images", "2"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "throughput: medians of 1 interleaved round(s)" in out and "vs eager AR" in out and "compiled" in out
    result = read(path)
    assert "complete" not in result and result["config"]["batch_sizes"] == [1, 2] and result["config"]["compile"] is True
    methods = ("ar", "mc-sjd-maximal")
    rows = result["throughput"]
    assert [(r["batch_size"], r["method"], r["compile"]) for r in rows] == [
        (b, m, c) for b in (1, 2) for c in (False, True) for m in methods]
    for row in rows:
        assert row["images"] == 2 and row["rounds"] == 1 and len(row["round_s"]) == 1 and len(row["warmup_s"]) >= 1
        assert row["images_per_s"] > 0 and row["s_per_image"] == pytest.approx(1 / row["images_per_s"])
        if row["method"] == "ar":
            assert row["speedup_vs_ar"] == 1.0 and (row["compile"] or row["speedup_vs_eager_ar"] == 1.0)
    # quality once, eager, at --batch-size (4 images: two units of 2, kept with their tokens); the sweep decodes at
    # each batch size, eager and compiled
    latency = [call[:4] for call in seen if call[2] == 1]
    quality = [call[:4] for call in seen if call[4]]
    assert latency == [("ar", 1, 1, False), ("mc-sjd-maximal", 1, 1, False)]
    assert quality == [("ar", 2, 2, False)] * 2 + [("mc-sjd-maximal", 2, 2, False)] * 2 + [("ar", 2, 2, False)] * 2
    assert {(b, c) for _, b, n, c, kept in seen if n == 2 and not kept} == {(1, False), (1, True), (2, False), (2, True)}
    assert set(result["methods"]) == {*methods, "ar-reseed-1"} and result["methods"]["ar"]["fid"] > 0
    # the roofline (vispec.eval.bench.roofline): a cost curve per batch size and compile setting, the bound and the
    # measured share of it on both clocks
    assert [(c["batch_size"], c["compile"]) for c in result["roofline"]["curves"]] == [(1, False), (1, True), (2, False), (2, True)]
    for row in rows:
        assert {"tokens_per_pass", "roofline_bound", "roofline_fraction", "roofline_fraction_cpu", "speedup_vs_ar_cpu"} <= set(row)
        assert len(row["round_cpu_s"]) == 1 and (row["method"] != "ar" or row["roofline_bound"] == 1.0)
    assert "throughput roofline" in out and "% roof cpu" in out


def test_bench_image_keeps_quality_rows_and_shows_progress(tiny_pipeline, tmp_path, capsys, monkeypatch):
    path = tmp_path / "bench.json"
    fail_on_call(monkeypatch, image, "frechet_distance", 3, ValueError("late"))  # real vs real, ar, then mc-sjd fails
    assert main(_bench_image_args(tiny_pipeline, path)) == 2
    partial = read(path)
    assert partial["complete"] is False and list(partial["methods"]) == ["ar"] and partial["real"]["images"] == 4
    assert {"accuracy", "fid", "nfe", "images_per_s"} <= set(partial["methods"]["ar"])
    capsys.readouterr()

    fail_on_call(monkeypatch, image, "frechet_distance", 2, ValueError("late"))  # the bar on: drawn to stderr, counted in images
    cfg = image.ImageBenchConfig(model=str(tiny_pipeline), evaluator=f"{resolve_model_path('tiny-c2i')}/evaluator",
                                 methods=("ar",), num_images=2, batch_size=2, latency_images=1, real_images=2, noise_repeats=1)
    with pytest.raises(ValueError, match="late"):
        image.run_image_bench(cfg, progress=lambda msg: None, progress_bar=True)
    bar = capsys.readouterr().err
    assert "bench image" in bar and "3/5" in bar and "img" in bar  # 1 + 2 images of ar done, 2 reseeds to go


@pytest.mark.slow
def test_bench_image_quality_does_not_depend_on_the_batch_size():
    """Measuring quality once is sound: with per-image keyed noise a method's tokens are the same at any batch
    size (an exact rule with a Jacobi window; a lossy rule with a drafter), on the trained tiny-c2i. (The VQ
    decoder's batched convolutions round differently: pixels may move by 1/255.)"""
    from vispec.pipelines import LlamaGenPipeline

    pipe = LlamaGenPipeline.from_pretrained("vispec/tiny-c2i")
    pipe.set_progress_bar_config(disable=True)
    labels, seeds = [3, 7], [11, 12]

    def tokens(method: str, batch: int):
        outs = [pipe(class_labels=labels[lo : lo + batch], decoding=method, output_type="latent",
                     generator=[torch.Generator().manual_seed(s) for s in seeds[lo : lo + batch]]) for lo in range(0, 2, batch)]
        return torch.cat([out.images for out in outs]), [s["nfe"] for out in outs for s in out.stats]

    for method in ("mc-sjd", "sd+lantern:k=100,delta=0.1"):
        (alone, nfe1), (together, nfe2) = tokens(method, 1), tokens(method, 2)
        assert torch.equal(alone, together) and nfe1 == nfe2, method


def test_generate_image_saves_in_chunks_of_batch_size(tiny_pipeline, tmp_path, capsys, monkeypatch):
    import numpy as np
    from PIL import Image

    from vispec.pipelines import LlamaGenPipeline

    calls = []
    real = LlamaGenPipeline.__call__

    def counted(self, *args, **kwargs):
        calls.append(len(kwargs["class_labels"]))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(LlamaGenPipeline, "__call__", counted)
    base = ["generate", "image", "--model", str(tiny_pipeline), "--class", "3", "--num-images", "3", "--quiet"]
    assert main([*base, "--batch-size", "2", "--out", str(tmp_path / "a.png")]) == 0
    assert calls == [2, 1]
    assert main([*base, "--batch-size", "3", "--out", str(tmp_path / "c.png")]) == 0
    assert calls == [2, 1, 3]
    out = capsys.readouterr().out
    for i in range(3):
        assert f"a-{i}.png: " in out
        chunked, whole = (np.asarray(Image.open(tmp_path / f"{n}-{i}.png"), dtype=np.int16) for n in ("a", "c"))
        assert np.abs(chunked - whole).max() <= 1  # the same tokens; the VQ decoder's batched convolutions round apart


def test_single_token_share_of_passes():
    """The prefill is no pass; AR commits one token every pass; decoders that do not count it give NaN."""
    assert image.single_token_share([{"nfe": 5, "single_passes": 1, "accepted_per_forward": 1.0},
                                     {"nfe": 3, "single_passes": 2, "accepted_per_forward": 0.5}]) == 0.5
    assert image.single_token_share([{"nfe": 17}]) == image.single_token_share([{"nfe": 17, "accepted_per_forward": 0.0}]) == 1.0
    assert math.isnan(image.single_token_share([{"nfe": 9, "accepted_per_forward": 1.0}]))
