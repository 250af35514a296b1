"""``vispec bench image`` on a text-to-image ``UnifiedImagePipeline`` (tiny-t2i): the same benchmark as for tiny-c2i,
with held-out captions of both sizes, scene-check accuracy, CLIP score and CLIP-feature FID, their AR seed noise,
the real-render reference, a CLIP column in the table, eager-only throughput rows, and clear errors for options
that belong to the other kind of model. Behaviour only: no timing assertions."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest
import torch

from vispec.cli import main
from vispec.eval.bench import image, image_tasks

T2I = Path(__file__).resolve().parents[2] / "models" / "pretrained" / "tiny-t2i"  # the embedded model's folder
pytestmark = pytest.mark.skipif(not (T2I / "model_index.json").is_file() or not (T2I / "clip").is_dir(),
                                reason=f"the tiny-t2i pipeline folder (with its clip/) is absent at {T2I}")
TINY = ["--methods", "ar,sjd", "--num-images", "4", "--batch-size", "2", "--latency-images", "1", "--real-images", "4",
        "--noise-repeats", "1"]
METRICS = ("fid", "accuracy", "clip_score")


def run_main(argv: list[str]) -> tuple[int, str, str]:
    """``main(argv)`` with stdout and stderr captured (usable from a module-scoped fixture)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = main(argv)
    return status, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory):
    """One tiny run through the CLI, with every pipeline call recorded: ``(result, stdout, stderr, calls, path)``."""
    from vispec.pipelines import UnifiedImagePipeline

    path = tmp_path_factory.mktemp("t2i") / "bench.json"
    real, calls = UnifiedImagePipeline.__call__, []

    def recorded(self, *args, **kwargs):
        calls.append({k: kwargs.get(k) for k in ("prompt", "height", "width", "decoding", "output_type")}
                     | {"seeds": [g.initial_seed() for g in kwargs.get("generator") or []], "compile": "compile" in kwargs})
        return real(self, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(UnifiedImagePipeline, "__call__", recorded)
        status, out, err = run_main(["bench", "image", "--model", str(T2I), *TINY, "--quiet", "--json", str(path)])
    assert status == 0, err
    return json.loads(path.read_text()), out, err, calls, path


def test_json_has_the_text_to_image_quality_metrics_noise_and_reference(bench_run):
    result, _, _, _, path = bench_run
    assert "complete" not in result
    config = result["config"]
    assert config["task"] == "text-to-image" and config["clip"] == str(T2I / "clip") and config["evaluator"] is None
    assert "CLIP" in config["fid_features"]
    assert set(result["methods"]) == {"ar", "sjd-horizontal", "ar-reseed-1"}
    for name in ("ar", "sjd-horizontal"):
        row = result["methods"][name]
        assert {"accuracy", "accuracy_by_attribute", "clip_score", "fid", "nfe", "step_compression", "latency_s",
                "images_per_s", "peak_mem_mb"} <= set(row), name
        assert 0.0 <= row["accuracy"] <= 1.0 and row["accuracy"] == row["accuracy_by_attribute"]["overall"]
        assert {"colour", "shape", "count", "position", "size", "overall"} == set(row["accuracy_by_attribute"])
        assert row["clip_score"] >= 0 and row["fid"] > 0
        for metric in METRICS:
            assert isinstance(row[f"{metric}_z"], float) and isinstance(row[f"{metric}_within_noise"], bool)
    assert result["methods"]["ar"]["step_compression"] == 1.0
    assert result["methods"]["sjd-horizontal"]["nfe"] < result["methods"]["ar"]["nfe"]
    assert {"accuracy", "clip_score", "fid"} <= set(result["methods"]["ar-reseed-1"])
    noise = result["noise"]
    assert noise["ar_runs"] == 2
    for metric in METRICS:
        assert len(noise[f"{metric}_values"]) == 2 and noise[f"{metric}_values"][0] == result["methods"]["ar"][metric]
        assert {f"{metric}_mean", f"{metric}_sd", f"{metric}_interval"} <= set(noise)
    real = result["real"]
    assert real["images"] == 4 and real["accuracy"] >= 0.75  # the checks read clean renders right (about 1.0)
    assert real["clip_score"] > real["clip_score_mismatched"]  # the CLIP tells true captions from rolled ones
    assert real["fid_real_vs_real"] > 0 and set(real["accuracy_by_attribute"]) >= {"overall"}
    assert path.with_suffix(".png").is_file()  # the speed-vs-FID plot


def test_table_has_a_clip_column_and_the_real_render_line(bench_run):
    _, out, _, _, _ = bench_run
    header = next(line for line in out.splitlines() if line.startswith("method"))
    assert header.split()[header.split().index("acc") + 1] == "CLIP"
    assert "AR sampling noise over 2 runs" in out and ", CLIP " in out
    assert "real held-out renders: accuracy 1.000, CLIP" in out and "mismatched" in out and "FID real vs real" in out


def test_generation_covers_both_sizes_in_one_size_batches(bench_run):
    _, _, _, calls, _ = bench_run
    sizes = {(c["height"], c["width"]) for c in calls}
    assert sizes == {(64, 64), (64, 96)}
    conditions = image_tasks.held_out_prompts(4, seed=0)
    assert {(p.height, p.width) for p in conditions} == sizes  # the held-out captions come in both sizes
    timed = [c for c in calls if c["output_type"] == "pt"]  # the warm-up asks for latents
    assert all(len(c["prompt"]) <= 2 and len(c["prompt"]) == len(c["seeds"]) for c in timed)
    assert not any(c["compile"] for c in calls)  # the unified pipeline takes no compile argument
    # the quality run of ar: each image with its own seed, captions of its size only
    quality = [c for c in timed if c["decoding"] == "ar" and c["seeds"] and c["seeds"][0] < 10][1:]  # after batch-1 latency
    by_seed = {s: (caption, (c["height"], c["width"])) for c in quality for s, caption in zip(c["seeds"], c["prompt"])}
    assert by_seed == {i: (p.caption, (p.height, p.width)) for i, p in enumerate(conditions)}


def test_images_do_not_depend_on_the_batch_size(monkeypatch):
    """Per-image seeds and one-size batches: ar makes the same tokens alone or two to a batch, in the original order
    (the VQ decoder's batched convolutions may move a pixel by 1/255)."""
    from vispec.pipelines import UnifiedImagePipeline

    task = image_tasks.load_task(image.ImageBenchConfig(model=str(T2I)))
    conditions = [task.conditions(4)[i] for i in (3, 0, 1)]  # 64x64 first, then two 64x96
    assert [(p.height, p.width) for p in conditions] == [(64, 64), (64, 96), (64, 96)]
    real_pixels, codes = UnifiedImagePipeline._pixels, []

    def spy(self, grid, height, width):
        codes.extend(grid.cpu())
        return real_pixels(self, grid, height, width)

    monkeypatch.setattr(UnifiedImagePipeline, "_pixels", spy)
    alone, stats1, _ = task.generate("ar", conditions, [11, 12, 13], 1)
    alone_codes = codes[:]
    codes.clear()
    together, stats2, _ = task.generate("ar", conditions, [11, 12, 13], 2)
    assert len(alone_codes) == len(codes) == 3 and all(torch.equal(a, b) for a, b in zip(alone_codes, codes))
    assert [tuple(x.shape) for x in alone] == [(3, 64, 64), (3, 64, 96), (3, 64, 96)]  # the conditions' order
    for a, b in zip(alone, together):
        assert a.dtype == b.dtype == torch.uint8 and (a.int() - b.int()).abs().max() <= 1
    assert [s["nfe"] for s in stats1] == [s["nfe"] for s in stats2] == [272, 400, 400]


def test_compile_runs_eager_rows_only(tmp_path):
    path = tmp_path / "sweep.json"
    status, out, err = run_main(["bench", "image", "--model", str(T2I), "--methods", "ar", "--num-images", "2",
                                 "--batch-size", "2", "--latency-images", "1", "--real-images", "2", "--noise-repeats", "1",
                                 "--batch-sizes", "2", "--compile", "--rounds", "1", "--sweep-images", "2", "--quiet",
                                 "--json", str(path)])
    assert status == 0, err
    assert "--compile: ar decode eagerly" in err
    result = json.loads(path.read_text())
    assert result["config"]["compile_skipped"] == ["ar"]
    assert [(r["batch_size"], r["method"], r["compile"]) for r in result["throughput"]] == [(2, "ar", False)]
    assert "no compiled rows for ar (unified-token models decode eagerly)" in out


@pytest.fixture
def nothing_loads(monkeypatch):
    """Loading a pipeline or a CLIP fails the test: option checks must come first."""
    from vispec.pipelines import LlamaGenPipeline, MaskedDiffusionLMPipeline, UnifiedImagePipeline

    def refuse(*args, **kwargs):
        raise AssertionError("work started before the options were checked")

    for cls in (LlamaGenPipeline, MaskedDiffusionLMPipeline, UnifiedImagePipeline):
        monkeypatch.setattr(cls, "from_pretrained", refuse)
    monkeypatch.setattr("vispec.eval.bench.clip_score.load_clip", refuse)


@pytest.mark.parametrize("extra,words", [
    (["--model", "T2I", "--evaluator", "T2I"], "--evaluator is for class-to-image models"),
    (["--model", "tiny-c2i", "--clip", "T2I/clip"], "--clip is for text-to-image models"),
    (["--model", "T2I", "--clip", "T2I/missing"], "no CLIP at T2I/missing: pass --clip"),
    (["--model", "tiny-mdlm"], "not a LlamaGenPipeline: a text model: use `vispec bench text`"),
])
def test_bad_input_is_named_before_any_work(nothing_loads, extra, words):
    status, out, err = run_main(["bench", "image", *[a.replace("T2I", str(T2I)) for a in extra], *TINY])
    lines = err.strip().splitlines()
    assert status == 2 and len(lines) == 1 and lines[0].startswith("vispec: error:"), err
    assert words.replace("T2I", str(T2I)) in lines[0]


def test_draft_model_decoding_is_refused_before_generating(monkeypatch):
    from vispec.pipelines import UnifiedImagePipeline

    def refuse(*args, **kwargs):
        raise AssertionError("generation started before the methods were checked")

    monkeypatch.setattr(UnifiedImagePipeline, "__call__", refuse)
    status, _, err = run_main(["bench", "image", "--model", str(T2I), *TINY, "--methods", "ar,sd"])
    assert status == 2 and "needs a drafter model" in err and "use ar, sjd or mc-sjd" in err
