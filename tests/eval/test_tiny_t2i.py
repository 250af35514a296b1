"""The embedded text-to-image model ``vispec/tiny-t2i``: it loads offline by name (vispec's loader and diffusers'
generic one), follows the scene layout at both trained sizes, decodes with every exact decoder, its CLIP ranks true
captions above mismatched ones on real renders, and the CLI and the demo section use it."""

from __future__ import annotations

import json
import os

import pytest
import torch

from vispec.cli import main
from vispec.pipelines import EMBEDDED_MODELS, UnifiedImagePipeline, resolve_model_path

pytest.importorskip("skimage", reason="the scene checks need the train extra (scikit-image)")

from vispec.eval.bench.clip_score import clip_score, clip_scores, load_clip  # noqa: E402
from vispec.eval.bench.scene_checks import check_images  # noqa: E402
from vispec.eval.bench.scenes import DEFAULT_SIZES, SceneSampler  # noqa: E402


@pytest.fixture(scope="module")
def pipe() -> UnifiedImagePipeline:
    pipe = UnifiedImagePipeline.from_pretrained("vispec/tiny-t2i")
    pipe.set_progress_bar_config(disable=True)
    return pipe


def test_loads_offline_by_name_with_its_clip_and_config():
    assert "vispec/tiny-t2i" in EMBEDDED_MODELS
    folder = resolve_model_path("tiny-t2i")
    assert resolve_model_path("vispec/tiny-t2i") == folder
    with open(os.path.join(folder, "model_index.json")) as handle:
        index = json.load(handle)
    assert index["_class_name"][-1] == "UnifiedImagePipeline" and index["family"] == "chameleon"
    assert os.path.isfile(os.path.join(folder, "clip", "model.safetensors"))
    from diffusers import DiffusionPipeline

    generic = DiffusionPipeline.from_pretrained(folder, trust_remote_code=True)
    assert type(generic).__name__ == "UnifiedImagePipeline"


@pytest.mark.slow
@pytest.mark.parametrize("decoding", ["ar", "sjd", "mc-sjd"])
def test_generates_both_trained_sizes(pipe, decoding):
    prompts = ["two red circles", "a blue square left of a yellow triangle"]
    for height, width in DEFAULT_SIZES:
        out = pipe(prompts, height=height, width=width, decoding=decoding, output_type="pt",
                   generator=[torch.Generator().manual_seed(i) for i in range(2)])
        assert out.images.shape == (2, 3, height, width)
        assert 0.0 <= float(out.images.min()) and float(out.images.max()) <= 1.0
        tokens = (height // 4) * (width // 4 + 1)  # codes and one end-of-row token per row
        for stats in out.stats:
            assert stats["tokens"] == tokens
            assert 1 <= stats["nfe"] <= tokens
            if decoding != "ar":
                assert stats["nfe"] < tokens  # speculation accepted more than one token per forward somewhere


@pytest.mark.slow
def test_same_seed_same_tokens_whatever_the_batch(pipe):
    one = pipe("three green triangles", height=64, width=96, decoding="mc-sjd", output_type="latent",
               generator=torch.Generator().manual_seed(7)).images
    both = pipe(["a red circle", "three green triangles"], height=64, width=96, decoding="mc-sjd", output_type="latent",
                generator=[torch.Generator().manual_seed(3), torch.Generator().manual_seed(7)]).images
    assert one.shape == (1, 16, 24) and torch.equal(one[0], both[1])


def test_bundled_clip_scores_true_captions_above_mismatched():
    model, processor = load_clip(os.path.join(resolve_model_path("tiny-t2i"), "clip"))
    batch = SceneSampler("test", seed=3).sample(24)
    captions = list(batch.captions)
    true = clip_scores(batch.images, captions, model, processor)
    rolled = clip_scores(batch.images, captions[1:] + captions[:1], model, processor)
    assert float(true.mean()) > float(rolled.mean()) + 5.0
    assert clip_score(batch.images, captions, model, processor) == pytest.approx(float(true.mean()), rel=1e-4)
    assert check_images(batch.images, captions)["accuracy"]["overall"] == 1.0  # the references the bench uses


def test_cli_generates_a_wide_image_from_a_prompt(tmp_path, capsys):
    out = tmp_path / "scene.png"
    assert main(["generate", "image", "--model", "tiny-t2i", "--prompt", "two red circles", "--height", "64",
                 "--width", "96", "--decoding", "mc-sjd", "--seed", "1", "--out", str(out), "--quiet"]) == 0
    from PIL import Image

    assert Image.open(out).size == (96, 64)
    assert "NFE" in capsys.readouterr().out


@pytest.mark.slow
def test_demo_section_writes_grid_and_scores(tmp_path, monkeypatch):
    from vispec.eval import demo

    monkeypatch.setattr(demo, "DEMO_T2I_PROMPTS", 2)
    monkeypatch.setattr(demo, "DEMO_T2I_CHECKED", 5)  # 3 more pictures per decoder, batches of 2 and 1
    monkeypatch.setattr(demo, "DEMO_T2I_CHECK_BATCH", 2)
    monkeypatch.setattr(demo, "DEMO_T2I_METHODS", ("ar", "mc-sjd"))
    report = demo.run_t2i_demo(str(tmp_path))
    assert os.path.isfile(tmp_path / "t2i_grid.png") and len(report["prompts"]) == 2
    assert report["checked_prompts"] == 5 and "over 5 pictures per decoder" in demo._t2i_report_md(report)
    for row in report["methods"].values():
        assert {"nfe", "step_compression", "latency_s", "checks", "accuracy", "clip_score", "clip_score_mismatched"} <= set(row)
        assert 0.0 <= row["accuracy"] <= 1.0 and 0.0 <= row["checks"] <= 1.0 and row["clip_score"] >= 0.0
        assert row["checks_made"] >= 5  # one colour check per picture at least
        assert row["checks_se"] == pytest.approx((row["checks"] * (1 - row["checks"]) / row["checks_made"]) ** 0.5)
    assert all(f"{r['checks']:.3f} ±{r['checks_se']:.3f}" in "\n".join(report["table"]) for r in report["methods"].values())
    assert report["methods"]["ar"]["step_compression"] == 1.0
    assert report["methods"]["mc-sjd"]["step_compression"] > 1.0
    assert "CLIP mismatched" in demo._t2i_report_md(report)
