"""The tiny-t2i CLIP: hard-negative captions, the contrastive loss, a few training steps with save/load, the
held-out evaluation and the CLIPScore wiring through torchmetrics."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("skimage", reason="scene backgrounds need the train extra (scikit-image)")

from vispec.eval.bench import clip_score as CS  # noqa: E402
from vispec.eval.bench.scenes import (  # noqa: E402
    SceneSampler, all_compositions, format_caption, parse_caption, split_of,
)
from vispec.eval.train.clip import (  # noqa: E402
    OPPOSITE, SWAP_KINDS, CLIPTrainConfig, build_clip, caption_fits, caption_swaps, clip_processor, clip_tokenizer,
    contrastive_loss, embed, evaluate_clip, hard_negative, train_clip,
)

TINY = dict(steps=2, batch_size=6, hidden_size=32, vision_layers=1, text_layers=1, heads=2, projection_dim=16,
            patch_size=16, eval_candidates=8, log_every=1)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("clip")
    metrics = train_clip(CLIPTrainConfig(out=str(out), **TINY))
    model, processor = CS.load_clip(out)
    return out, metrics, model, processor


@pytest.fixture(scope="module")
def scenes():
    return SceneSampler("test", seed=3).sample(6)


# ------------------------------------------------------------------------------------------ hard negatives
def _captions() -> list[str]:
    keys = all_compositions()
    picked = list(keys[::97]) + ["a large red circle", "three small blue squares", "a small cyan triangle below a "
                                 "large cyan square", "a red circle right of a blue circle"]
    return picked


def _differences(a: dict, b: dict) -> set[str]:
    found = {k for k in ("count", "relation") if a[k] != b[k]}
    for x, y in zip(a["objects"], b["objects"]):
        found |= {k for k in ("colour", "shape", "size") if x[k] != y[k]}
    return found


def test_each_swap_changes_exactly_the_intended_attribute_and_stays_in_the_grammar():
    for caption in _captions():
        parsed = parse_caption(caption)
        for kind in SWAP_KINDS:
            swaps = caption_swaps(caption, kind)
            assert len(set(swaps)) == len(swaps) and caption not in swaps
            for swap in swaps:
                other = parse_caption(swap)  # in the grammar (raises otherwise)
                assert format_caption(other) == swap
                assert _differences(parsed, other) == {kind}, (caption, swap)
                changed = [i for i, (x, y) in enumerate(zip(parsed["objects"], other["objects"])) if x != y]
                assert len(changed) == (0 if kind in ("count", "relation") else 1)
                if kind == "relation":
                    assert other["relation"] == OPPOSITE[parsed["relation"]]
        related = parsed["relation"] is not None
        assert len(caption_swaps(caption, "count")) == (0 if related else 2)
        assert len(caption_swaps(caption, "relation")) == (1 if related else 0)
        colours = len(caption_swaps(caption, "colour"))  # related: a swap may not make the two objects alike
        assert (8 <= colours <= 10) if related else colours == 5
    with pytest.raises(ValueError, match="kind"):
        caption_swaps("a red circle", "texture")


def test_train_only_negatives_are_train_compositions_and_none_fit_the_scene():
    rng = np.random.default_rng(0)
    batch = SceneSampler("train", seed=5).sample(12)
    for caption, scene in zip(batch.captions, batch.scenes):
        assert caption_fits(caption, scene)
        for kind in SWAP_KINDS:
            assert not any(caption_fits(s, scene) for s in caption_swaps(caption, kind))
            negative = hard_negative(caption, kind, rng, train_only=True)
            assert negative is None or (split_of(negative) == "train" and negative in caption_swaps(caption, kind))
        parsed = parse_caption(caption)
        if parsed["relation"]:  # the other phrasing and an unsized phrasing describe the same scene
            flipped = {**parsed, "relation": OPPOSITE[parsed["relation"]], "objects": parsed["objects"][::-1]}
            assert caption_fits(format_caption(flipped), scene)
        unsized = {**parsed, "objects": [{**o, "size": None} for o in parsed["objects"]]}
        assert caption_fits(format_caption(unsized), scene)


# ------------------------------------------------------------------------------------------------- loss
def test_contrastive_loss_is_symmetric_infonce_and_hard_negatives_raise_it():
    gen = torch.Generator().manual_seed(0)
    x, y, extra = torch.randn(5, 8, generator=gen), torch.randn(5, 8, generator=gen), torch.randn(7, 8, generator=gen)
    scale = torch.tensor(2.0)
    logits = scale.exp() * F.normalize(x, dim=-1) @ F.normalize(y, dim=-1).T
    labels = torch.arange(5)
    manual = (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2
    torch.testing.assert_close(contrastive_loss(x, y, scale), manual)
    torch.testing.assert_close(contrastive_loss(y, x, scale), manual)  # the two directions weigh the same
    with_negatives = contrastive_loss(x, torch.cat([y, extra]), scale)
    assert with_negatives > manual + 1e-4
    ignore = torch.zeros(5, 12, dtype=torch.bool)
    ignore[:, 5:] = True
    torch.testing.assert_close(contrastive_loss(x, torch.cat([y, extra]), scale, ignore), manual)
    with pytest.raises(ValueError, match="ignore"):
        contrastive_loss(x, y, scale, torch.eye(5, dtype=torch.bool))
    with pytest.raises(ValueError, match="text_embeds"):
        contrastive_loss(x, y[:3], scale)


def test_contrastive_loss_matches_transformers_clip_loss():
    cfg = CLIPTrainConfig(**TINY)
    processor = clip_processor(clip_tokenizer(), 64)
    model = build_clip(cfg, processor.tokenizer).eval()
    batch = SceneSampler("train", seed=2).sample(4)
    inputs = processor(text=list(batch.captions), images=[((i + 1) * 127.5).round().to(torch.uint8) for i in batch.images],
                       return_tensors="pt", padding=True)
    with torch.no_grad():
        out = model(**inputs, return_loss=True)
        ours = contrastive_loss(out.image_embeds, out.text_embeds, model.logit_scale)
    torch.testing.assert_close(ours, out.loss)


# ------------------------------------------------------------------------------------- training, save, load
def test_training_writes_a_folder_transformers_loads_alone(trained):
    out, metrics, model, processor = trained
    for name in ("config.json", "model.safetensors", "tokenizer.json", "train_log.jsonl", "train_config.json"):
        assert os.path.exists(out / name), name
    record = json.loads((out / "train_config.json").read_text())
    assert record["config"]["hidden_size"] == 32 and record["metrics"]["final_loss"] == metrics["final_loss"]
    assert np.isfinite(metrics["final_loss"]) and metrics["parameters"] > 0
    ids = processor.tokenizer(["a red circle", "a blue square left of a red circle"], padding=True)["input_ids"]
    bos, eos, pad = processor.tokenizer.bos_token_id, processor.tokenizer.eos_token_id, processor.tokenizer.pad_token_id
    assert ids[0] == [bos, *ids[0][1:4], eos] + [pad] * 5 and ids[1][0] == bos and ids[1][-1] == eos
    assert model.config.text_config.eos_token_id == eos
    wide = torch.randint(0, 256, (3, 64, 96), dtype=torch.uint8)
    square = torch.randint(0, 256, (3, 64, 64), dtype=torch.uint8)
    pixels = processor(images=[wide, square], return_tensors="pt")["pixel_values"]
    assert pixels.shape == (2, 3, 64, 64)  # whole image squeezed, not cropped
    torch.testing.assert_close(pixels[1], square.float() / 127.5 - 1)  # same size: the scenes' [-1, 1] values


def test_save_load_round_trip_keeps_the_embeddings(trained, tmp_path, scenes):
    _, _, model, processor = trained
    model.save_pretrained(tmp_path)
    processor.save_pretrained(tmp_path)
    again, processor2 = CS.load_clip(tmp_path)
    images = CS.to_uint8(scenes.images)
    a = processor(images=images, text=list(scenes.captions), return_tensors="pt", padding=True)
    b = processor2(images=images, text=list(scenes.captions), return_tensors="pt", padding=True)
    assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["pixel_values"], b["pixel_values"])
    with torch.no_grad():
        torch.testing.assert_close(model(**a).logits_per_image, again(**b).logits_per_image)
    with pytest.raises(ValueError, match="path"):
        CS.load_clip(tmp_path / "missing")


def test_evaluate_clip_reports_retrieval_and_swap_accuracy(trained):
    _, metrics, model, processor = trained
    result = evaluate_clip(model, processor, n=8, seed=1)
    assert result["eval_scenes"] == 8 and 0 <= result["i2t_r1"] <= 1 and 0 <= result["t2i_r1"] <= 1
    # recomputed image by image: win is the share of images beating every swap, pairwise the share of all
    # (image, swap) pairs won, pooled (so images with more swaps weigh more, and win may exceed pairwise)
    batch = SceneSampler("test", seed=1).sample(8)
    captions = list(batch.captions)
    swaps = {k: [caption_swaps(c, k) for c in captions] for k in SWAP_KINDS}
    texts = sorted(set(captions) | {s for per in swaps.values() for ss in per for s in ss})
    x, y = embed(model, processor, images=batch.images, texts=texts)
    scores = x @ y.T
    for kind in SWAP_KINDS:
        won = [scores[i, texts.index(c)] > scores[i, [texts.index(s) for s in swaps[kind][i]]]
               for i, c in enumerate(captions) if swaps[kind][i]]
        assert result[f"{kind}_images"] == len(won) <= 8
        if won:
            assert result[f"{kind}_win"] == round(sum(bool(w.all()) for w in won) / len(won), 4)
            assert result[f"{kind}_pairwise"] == round(float(torch.cat(won).float().mean()), 4)
            assert 0 <= result[f"{kind}_win"] <= 1 and 0 <= result[f"{kind}_pairwise"] <= 1
    assert result["colour_images"] == result["shape_images"] == 8
    assert result["count_images"] + result["relation_images"] == 8
    assert {k for k in metrics if k.endswith("_r1")} == {"i2t_r1", "t2i_r1"}
    assert not model.training
    with pytest.raises(ValueError, match="n must"):
        evaluate_clip(model, processor, n=1)


# ---------------------------------------------------------------------------------------------- CLIPScore
def _features(output) -> torch.Tensor:
    return output if isinstance(output, torch.Tensor) else output.pooler_output  # transformers 4 / 5


def _manual_cosines(model, processor, images: list[torch.Tensor], captions: list[str]) -> torch.Tensor:
    with torch.no_grad():
        pixels = processor(images=images, return_tensors="pt")["pixel_values"]
        tokens = processor.tokenizer(captions, padding="max_length", max_length=12, return_tensors="pt")
        x = _features(model.get_image_features(pixel_values=pixels))
        y = _features(model.get_text_features(input_ids=tokens["input_ids"], attention_mask=tokens["attention_mask"]))
    return F.cosine_similarity(x, y, dim=-1)


def test_clip_score_goes_through_torchmetrics_and_matches_cosine_times_100(trained, scenes):
    _, _, model, processor = trained
    assert CS.backend().startswith("torchmetrics")
    captions = list(scenes.captions[1:]) + [scenes.captions[0]]  # mismatched pairs: some cosines may be negative
    for caps in (list(scenes.captions), captions):
        cos = _manual_cosines(model, processor, CS.to_uint8(scenes.images), caps)
        per_image = CS.clip_scores(scenes.images, caps, model, processor)
        torch.testing.assert_close(per_image, (100 * cos).clamp(min=0), atol=1e-3, rtol=1e-4)
        total = CS.clip_score(scenes.images, caps, model, processor, batch_size=4)
        assert total == pytest.approx(max(100 * float(cos.mean()), 0.0), abs=1e-3)
    from PIL import Image

    pil = [Image.fromarray(i.permute(1, 2, 0).numpy()) for i in CS.to_uint8(scenes.images)]
    assert CS.clip_score(pil, list(scenes.captions), model, processor) == pytest.approx(
        CS.clip_score(scenes.images, list(scenes.captions), model, processor), abs=1e-4)
    squares = SceneSampler("test", seed=4, sizes=((64, 64),)).sample(3)
    stacked = torch.stack(squares.images)
    assert CS.clip_score(stacked, list(squares.captions), model, processor) == pytest.approx(
        CS.clip_score(list(squares.images), list(squares.captions), model, processor), abs=1e-4)


def test_manual_fallback_agrees_with_torchmetrics(trained, scenes, monkeypatch):
    _, _, model, processor = trained
    captions = list(scenes.captions)
    expected = CS.clip_scores(scenes.images, captions, model, processor), CS.clip_score(scenes.images, captions, model, processor)
    monkeypatch.setattr(CS, "backend", lambda: "manual")
    torch.testing.assert_close(CS.clip_scores(scenes.images, captions, model, processor), expected[0], atol=1e-3, rtol=1e-4)
    assert CS.clip_score(scenes.images, captions, model, processor) == pytest.approx(expected[1], abs=1e-3)


def test_clip_score_rejects_bad_inputs_with_named_arguments(trained, scenes):
    _, _, model, processor = trained
    images, captions = list(scenes.images), list(scenes.captions)
    cases = [
        ((images[0], captions[:1], model, processor), "images"),  # one [3, H, W] tensor, not a batch
        (([images[0] * 255], captions[:1], model, processor), r"\[-1, 1\]"),  # float images outside [-1, 1]
        (([images[0][:2]], captions[:1], model, processor), r"\[3, H, W\]"),
        (([torch.full((3, 8, 8), float("nan"))], captions[:1], model, processor), r"\[-1, 1\]"),
        ((images, captions[:-1], model, processor), "same length"),
        ((images[:1], captions[0], model, processor), "captions"),
        ((images, captions, model, None), "processor"),
        ((images, captions, torch.nn.Linear(2, 2), processor), "model"),
        (([], [], model, processor), "images"),
    ]
    for args, match in cases:
        with pytest.raises(ValueError, match=match):
            CS.clip_score(*args)
    with pytest.raises(ValueError, match="batch_size"):
        CS.clip_score(images, captions, model, processor, batch_size=0)
    assert next(model.parameters()).device.type == "cpu"


def test_train_clip_rejects_bad_settings_before_training(tmp_path):
    for change, match in (({"hard_negatives": ("texture",)}, "hard_negatives"), ({"text_length": 8}, "text_length"),
                          ({"steps": 0}, "steps"), ({"eval_candidates": 1}, "eval_candidates"),
                          ({"image_size": 60}, "patch_size")):
        with pytest.raises(ValueError, match=match):
            train_clip(CLIPTrainConfig(out=str(tmp_path / "x"), **{**TINY, **change}))
