"""Data split, trainers (a few steps each) and the evaluator's FID adapter for tiny-c2i."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("skimage", reason="tiny-c2i data needs the train extra (scikit-image)")

from diffusers import VQModel  # noqa: E402

from vispec.eval.bench.data import CLASS_NAMES, CropSampler, load_photos, split_tiles  # noqa: E402
from vispec.eval.bench.evaluator import CropClassifier, FIDFeatures  # noqa: E402
from vispec.eval.train.evaluator import EvaluatorTrainConfig, train_evaluator  # noqa: E402
from vispec.eval.train.gpt import GPTTrainConfig, train_gpt  # noqa: E402
from vispec.eval.train.vq import VQTrainConfig, train_vq  # noqa: E402
from vispec.models.llamagen_gpt import LlamaGenGPT  # noqa: E402
from vispec.models.llamagen_vq import decode_tokens, encode_to_tokens  # noqa: E402


def test_split_holds_out_disjoint_tiles_of_every_photo():
    photos = load_photos()
    assert len(photos) == len(CLASS_NAMES) >= 12
    split = split_tiles(photos, seed=0)
    train, held = set(split["train"]), set(split["eval"])
    assert not train & held
    assert {t.photo for t in held} == set(range(len(photos))) == {t.photo for t in train}
    assert 0.2 < len(held) / (len(held) + len(train)) < 0.35


def test_crops_are_deterministic_uint8_with_requested_labels():
    sampler = CropSampler("eval")
    labels = torch.tensor([0, 5, 13, 13])
    a, la = sampler.sample(4, torch.Generator().manual_seed(1), labels=labels)
    b, _ = sampler.sample(4, torch.Generator().manual_seed(1), labels=labels)
    assert a.dtype == torch.uint8 and a.shape == (4, 3, 64, 64) and torch.equal(a, b) and torch.equal(la, labels)
    assert float(a.float().std()) > 5  # natural texture, not flat
    with pytest.raises(ValueError, match="split"):
        CropSampler("test")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    vq_metrics = train_vq(VQTrainConfig(out=str(root / "vq"), steps=3, batch_size=4, eval_images=8, log_every=1, restart_every=2))
    ev_metrics = train_evaluator(EvaluatorTrainConfig(out=str(root / "ev"), steps=3, batch_size=8, eval_images=28, log_every=1))
    gpt_metrics = train_gpt(GPTTrainConfig(vq=str(root / "vq"), out=str(root / "gpt"), num_sequences=16, steps=2, batch_size=4,
                                           dim=64, n_layer=1, n_head=2, log_every=1))
    return root, vq_metrics, ev_metrics, gpt_metrics


def test_trainers_save_loadable_models(trained):
    root, vq_metrics, ev_metrics, gpt_metrics = trained
    vq = VQModel.from_pretrained(root / "vq").eval()
    norms = vq.quantize.embedding.weight.norm(dim=1)
    torch.testing.assert_close(norms, torch.ones_like(norms))  # cosine codebook baked in
    images = torch.rand(2, 3, 64, 64) * 2 - 1
    tokens = encode_to_tokens(vq, images)
    assert tokens.shape == (2, 16, 16)
    assert decode_tokens(vq, tokens).shape == (2, 3, 64, 64)
    assert vq_metrics["held_out"]["codes_used"] >= 1
    assert 0.0 <= ev_metrics["held_out_accuracy"] <= 1.0
    gpt = LlamaGenGPT.from_pretrained(root / "gpt")
    assert gpt.config.num_classes == len(CLASS_NAMES) and gpt.config.vocab_size == vq.config.num_vq_embeddings
    assert gpt.has_unconditional and gpt_metrics["parameters"] > 0
    assert (root / "gpt" / "train_log.jsonl").read_text().count("\n") == 2


def _weights(folder) -> dict:
    from safetensors.torch import load_file

    return load_file(str(folder / "diffusion_pytorch_model.safetensors"))


def test_trainers_are_reproducible_from_the_seed(trained, tmp_path):
    """The same config and seed give bit-identical weights (the embedded models can be rebuilt exactly)."""
    root = trained[0]
    train_vq(VQTrainConfig(out=str(tmp_path / "vq"), steps=3, batch_size=4, eval_images=8, log_every=1, restart_every=2))
    train_evaluator(EvaluatorTrainConfig(out=str(tmp_path / "ev"), steps=3, batch_size=8, eval_images=28, log_every=1))
    train_gpt(GPTTrainConfig(vq=str(root / "vq"), out=str(tmp_path / "gpt"), num_sequences=16, steps=2, batch_size=4,
                             dim=64, n_layer=1, n_head=2, log_every=1))
    for name in ("vq", "ev", "gpt"):
        first, again = _weights(root / name), _weights(tmp_path / name)
        assert first.keys() == again.keys()
        assert all(torch.equal(first[k], again[k]) for k in first), name
    other = train_gpt(GPTTrainConfig(vq=str(root / "vq"), out=str(tmp_path / "gpt-seed1"), num_sequences=16, steps=2, batch_size=4,
                                     dim=64, n_layer=1, n_head=2, log_every=1, seed=1))
    assert other["parameters"] > 0
    assert not torch.equal(_weights(root / "gpt")["tok_embeddings.weight"], _weights(tmp_path / "gpt-seed1")["tok_embeddings.weight"])


def test_fid_features_plug_into_torchmetrics():
    from torchmetrics.image.fid import FrechetInceptionDistance

    torch.manual_seed(0)
    fid = FrechetInceptionDistance(feature=FIDFeatures(CropClassifier(num_classes=14, feature_dim=16)), reset_real_features=True)
    real, _ = CropSampler("eval").sample(64, torch.Generator().manual_seed(0))
    noise = torch.randint(0, 256, (64, 3, 64, 64), dtype=torch.uint8)
    fid.update(real, real=True)
    fid.update(real, real=False)
    same = float(fid.compute())
    fid.reset()
    fid.update(real, real=True)
    fid.update(noise, real=False)
    assert abs(same) < 1e-2 < float(fid.compute())


@pytest.mark.slow
def test_assemble_and_bench_image_on_the_trained_parts(trained, tmp_path):
    from vispec.eval.bench.image import ImageBenchConfig, format_image_table, run_image_bench
    from vispec.eval.train.assemble import AssembleConfig, assemble
    from vispec.pipelines import LlamaGenPipeline

    root = trained[0]
    folder = tmp_path / "tiny-c2i"
    assemble(AssembleConfig(vq=str(root / "vq"), gpt=str(root / "gpt"), evaluator=str(root / "ev"), out=str(folder),
                            guidance_scale=2.5, window=8))
    assert (folder / "evaluator").is_dir() and "Training records" in (folder / "README.md").read_text()
    pipe = LlamaGenPipeline.from_pretrained(folder)
    assert pipe.decoding_config.sampling().guidance_scale == 2.5
    result = run_image_bench(ImageBenchConfig(model=str(folder), methods=("ar", "mc-sjd", "sjd:window=3"), num_images=4,
                                              batch_size=2, latency_images=1, real_images=16, noise_repeats=2),
                             progress=lambda msg: None)
    canonical = ("ar", "mc-sjd-maximal", "sjd-horizontal:window=3")  # rows are named by DecodingConfig.name
    assert set(result["methods"]) == set(canonical) | {"ar-reseed-1", "ar-reseed-2"}
    for name in canonical:
        row = result["methods"][name]
        assert {"nfe", "step_compression", "latency_s", "speedup", "images_per_s", "accuracy", "fid", "peak_mem_mb"} <= set(row)
        assert 0.0 <= row["accuracy"] <= 1.0 and row["nfe"] <= 256
    assert result["methods"]["ar"]["step_compression"] == 1.0
    noise = result["noise"]
    assert noise["ar_runs"] == 3 and len(noise["fid_values"]) == 3
    assert noise["fid_values"][0] == result["methods"]["ar"]["fid"]
    assert len(set(noise["fid_values"])) == 3  # re-seeds draw other images (torch seeds use 32 bits)
    assert noise["fid_sd"] > 0 and noise["fid_interval"] > noise["fid_sd"]
    assert isinstance(result["methods"]["mc-sjd-maximal"]["fid_within_noise"], bool)
    assert "ar-reseed-2" in format_image_table(result) and "AR sampling noise over 3 runs" in format_image_table(result)
