"""Captioned scenes for tiny-t2i: determinism, the composition split, the caption grammar, image format, and
the prompt-following checks on ground-truth renders (clean, against wrong captions, degraded)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("skimage", reason="photo backgrounds and the checks need the train extra (scikit-image)")

from vispec.eval.bench import scenes as S  # noqa: E402
from vispec.eval.bench.scene_checks import (  # noqa: E402
    ATTRIBUTES, CHROMA_THRESHOLD, check_image, check_images, degrade, detect_objects,
)

PER_SPLIT = 160


@pytest.fixture(scope="module")
def batches() -> dict[str, S.SceneBatch]:
    return {split: S.SceneSampler(split, seed=11).sample(PER_SPLIT) for split in S.SPLITS}


def _all(batches: dict[str, S.SceneBatch]) -> tuple[list[torch.Tensor], list[str], list[S.Scene]]:
    images, captions, scenes = [], [], []
    for batch in batches.values():
        images += batch.images
        captions += batch.captions
        scenes += batch.scenes
    return images, captions, scenes


def _other_phrasing(key: str) -> str:
    parsed = S.parse_caption(key)
    flip = {"left of": "right of", "above": "below"}[parsed["relation"]]
    return S.format_caption({"count": None, "relation": flip, "objects": parsed["objects"][::-1]})


# ------------------------------------------------------------------------------------ determinism
def test_same_seed_same_scenes_and_random_access():
    a = S.SceneSampler("train", seed=3).sample(6)
    sampler = S.SceneSampler("train", seed=3)
    b1, b2 = sampler.sample(2), sampler.sample(4)
    assert a.captions == b1.captions + b2.captions and a.scenes == b1.scenes + b2.scenes
    assert all(torch.equal(x, y) for x, y in zip(a.images, b1.images + b2.images))
    image, caption, scene = S.SceneSampler("train", seed=3).scene_at(4)
    assert torch.equal(image, a.images[4]) and caption == a.captions[4] and scene == a.scenes[4]
    r1, r2 = (S.SceneSampler("train", seed=3).render_caption("a red circle above a blue square", 2) for _ in range(2))
    assert torch.equal(r1[0], r2[0]) and r1[1] == r2[1] and r1[1].relation == "above"
    other = S.SceneSampler("train", seed=4).sample(6)
    assert other.captions != a.captions and not all(torch.equal(x, y) for x, y in zip(a.images, other.images))


# ---------------------------------------------------------------------------------------- split
def test_composition_split_is_disjoint_complete_and_pinned():
    train, test = set(S.compositions("train")), set(S.compositions("test"))
    assert not train & test and train | test == set(S.all_compositions())
    assert len(S.all_compositions()) == 5670 and len(test) == 1094  # pins the sha256 split
    for keys in (train, test):  # both kinds in both splits
        assert any(S.parse_caption(k)["relation"] is None for k in keys)
        assert any(S.parse_caption(k)["relation"] is not None for k in keys)
    assert S.split_of("two red circles") == "train"
    assert S.split_of("a blue square left of a yellow triangle") == "test"
    assert S.split_of("a yellow triangle right of a blue square") == "test"  # same composition, other phrasing
    assert S.composition_key("a yellow triangle right of a blue square") == "a blue square left of a yellow triangle"


def test_sampled_scenes_stay_in_their_split(batches):
    for split, batch in batches.items():
        keys = set(S.compositions(split))
        for caption, scene in zip(batch.captions, batch.scenes):
            assert scene.split == split == S.split_of(caption)
            assert scene.composition == S.composition_key(caption) and scene.composition in keys
        assert {s.relation for s in batch.scenes} == {None, *S.RELATIONS}
        assert {s.count for s in batch.scenes} == {None, 1, 2, 3}


# -------------------------------------------------------------------------------------- grammar
def test_caption_grammar_round_trips():
    for key in S.all_compositions():
        captions = [key] if S.parse_caption(key)["relation"] is None else [key, _other_phrasing(key)]
        for caption in captions:
            assert S.format_caption(S.parse_caption(caption)) == caption
            assert set(caption.split()) <= set(S.CAPTION_WORDS)


def test_parsed_captions_describe_their_scenes(batches):
    _, captions, scenes = _all(batches)
    for caption, scene in zip(captions, scenes):
        parsed = S.parse_caption(caption)
        assert S.format_caption(parsed) == caption
        assert (parsed["count"], parsed["relation"]) == (scene.count, scene.relation)
        phrases = parsed["objects"] * (parsed["count"] or 1)
        assert len(phrases) == len(scene.objects)
        for p, obj in zip(phrases, scene.objects):
            assert (p["colour"], p["shape"]) == (obj.colour, obj.shape) and p["size"] in (None, obj.size)


@pytest.mark.parametrize("caption", [
    "", " a red circle", "a red circle ", "a  red circle", "A red circle", "a red circle.", "a purple circle",
    "one red circle", "two red circle", "a red circles", "red circle", "a red", "two small large red circles",
    "a red circle left a blue square", "a red circle left of a red circle",
    "a small red circle above a large red circle",
    "two red circles left of a blue square", "a red circle left of two blue squares", "a red circle near a blue square",
])
def test_captions_outside_the_grammar_raise(caption):
    with pytest.raises(ValueError, match="caption"):
        S.parse_caption(caption)


def test_format_caption_rejects_bad_descriptions():
    good = {"count": 2, "relation": None, "objects": [{"colour": "red", "shape": "circle", "size": None}]}
    assert S.format_caption(good) == "two red circles"
    for bad in ({**good, "count": 4}, {**good, "relation": "above"}, {"count": 1, "objects": good["objects"]},
                {**good, "objects": [{"colour": "pink", "shape": "circle", "size": None}]}):
        with pytest.raises(ValueError, match="parsed"):
            S.format_caption(bad)


# --------------------------------------------------------------------------------------- images
def _outside_objects(scene) -> np.ndarray:
    outside = np.ones((scene.height, scene.width), dtype=bool)
    for obj in scene.objects:
        t, l, b, r = (int(v) for v in obj.box)
        outside[max(0, t - 1) : b + 2, max(0, l - 1) : r + 2] = False
    return outside


def test_images_shapes_range_and_muted_smooth_backgrounds(batches):
    images, _, scenes = _all(batches)
    assert {(im.shape[1], im.shape[2]) for im in images} == {(64, 64), (64, 96)}
    levels = []
    for image, scene in zip(images, scenes):
        assert image.dtype == torch.float32 and image.shape == (3, scene.height, scene.width)
        unit = (image.numpy() + 1) / 2
        assert unit.min() >= 0.0 and unit.max() <= 1.0
        assert abs(unit * 255 - np.round(unit * 255)).max() < 1e-3  # uint8 grid, as to_model_range
        outside = _outside_objects(scene)
        chroma = unit.max(0) - unit.min(0)
        assert chroma[outside].max() < CHROMA_THRESHOLD / 2
        grey = unit.mean(0)
        # a plain background is flat: one grey level up to uint8 rounding
        assert np.ptp(grey[outside]) <= 2 / 255
        levels.append(float(np.median(grey[outside])))
    assert max(levels) - min(levels) > 0.2  # varied between scenes
    groups = batches["test"].by_size()
    assert sum(len(idx) for _, idx in groups.values()) == PER_SPLIT
    for (h, w), (stacked, idx) in groups.items():
        assert stacked.shape == (len(idx), 3, h, w) and torch.equal(stacked[0], batches["test"].images[idx[0]])


def test_photo_backgrounds_are_textured_and_checks_still_hold():
    batch = S.SceneSampler("test", seed=5, background="photo").sample(12)
    for image, scene in zip(batch.images, batch.scenes):
        unit = (image.numpy() + 1) / 2
        outside = _outside_objects(scene)
        chroma = unit.max(0) - unit.min(0)
        assert chroma[outside].max() < CHROMA_THRESHOLD / 2
        assert np.abs(np.diff(unit.mean(0), axis=1))[outside[:, 1:] & outside[:, :-1]].std() > 0.003  # texture, grain
    assert check_images(batch.images, batch.captions)["accuracy"]["overall"] == 1.0
    plain = S.SceneSampler("test", seed=5).sample(12)
    assert plain.captions == batch.captions  # the background draws come after the layout's
    assert not torch.equal(plain.images[0], batch.images[0])


def test_other_sizes_render():
    batch = S.SceneSampler("test", seed=0, sizes=((96, 64), (128, 128))).sample(8)
    assert {(im.shape[1], im.shape[2]) for im in batch.images} <= {(96, 64), (128, 128)}
    assert check_images(batch.images, batch.captions)["accuracy"]["overall"] == 1.0


# ------------------------------------------------------------------------------------ detectors
def test_detections_match_ground_truth(batches):
    images, _, scenes = _all(batches)
    for image, scene in zip(images, scenes):
        detections = detect_objects(image)
        assert len(detections) == len(scene.objects)
        for obj in scene.objects:
            near = min(detections, key=lambda d: abs(d.centre[0] - obj.centre[0]) + abs(d.centre[1] - obj.centre[1]))
            assert (near.colour, near.shape, near.size) == (obj.colour, obj.shape, obj.size)
            assert abs(near.centre[0] - obj.centre[0]) <= 1.5 and abs(near.centre[1] - obj.centre[1]) <= 1.5


def test_corners_tell_squares_from_circles_and_ignore_a_gaussian_blur(batches):
    """``corners`` (diagonal over axis fourth cumulants) is 1/2 for a square and 1 for a circle, and a Gaussian
    blur (zero fourth cumulant) moves it little."""
    from scipy import ndimage

    images, _, scenes = _all(batches)
    seen: dict[str, list[tuple[float, float]]] = {"square": [], "circle": []}
    for image, scene in list(zip(images, scenes))[:60]:
        blurred = torch.from_numpy(ndimage.gaussian_filter(image.numpy(), (0, 1.5, 1.5), mode="nearest"))
        for obj in scene.objects:
            if obj.shape not in seen:
                continue
            pair = []
            for x in (image, blurred):
                d = min(detect_objects(x), key=lambda d: abs(d.centre[0] - obj.centre[0]) + abs(d.centre[1] - obj.centre[1]))
                pair.append(d.corners)
            seen[obj.shape].append(tuple(pair))
    for shape, clean in (("square", 0.5), ("circle", 1.0)):
        values = np.array(seen[shape])
        assert len(values) >= 10
        assert np.abs(values[:, 0] - clean).max() < 0.05  # clean renders
        assert np.abs(values[:, 1] - values[:, 0]).mean() < 0.05  # blurred: corners stays


def test_checks_pass_ground_truth_renders(batches):
    for batch in batches.values():
        result = check_images(batch.images, batch.captions)
        assert all(result["asked"][a] > 0 for a in ATTRIBUTES)
        assert all(result["accuracy"][a] >= 0.95 for a in (*ATTRIBUTES, "overall")), result["accuracy"]
        assert len(result["per_image"]) == PER_SPLIT


def test_checks_pool_the_individual_judgements_and_overall_is_strict(batches):
    batch = batches["train"]
    assert check_images(batch.images, batch.captions)["checks"] >= 0.95
    counted = next(i for i, c in enumerate(batch.captions) if c.split(" ")[0] in ("two", "three"))
    wrong = batch.captions[counted].replace("two", "THREE").replace("three", "two").replace("THREE", "three")
    result = check_images([batch.images[counted]], [wrong])
    asked = [a for a in ATTRIBUTES if result["per_image"][0][a] is not None]
    assert not result["per_image"][0]["count"] and result["accuracy"]["overall"] == 0.0
    assert result["checks"] == (len(asked) - 1) / len(asked)  # colour and shape (and size) pass, the count does not


def test_value_range_flags_agree(batches):
    batch = batches["train"]
    images = torch.stack([im for im in batch.images if im.shape[2] == 64][:8])
    captions = [c for im, c in zip(batch.images, batch.captions) if im.shape[2] == 64][:8]
    base = check_images(images, captions)["per_image"]
    assert check_images((images + 1) / 2, captions, zero_one=True)["per_image"] == base
    assert check_images(((images + 1) * 127.5).round().to(torch.uint8), captions)["per_image"] == base


def _wrong_captions(caption: str) -> list[tuple[str, str]]:
    """``(wrong caption, the attribute it gets wrong)`` variants of a caption that stay in the grammar."""
    parsed = S.parse_caption(caption)
    first = parsed["objects"][0]
    swaps = {
        "colour": {**first, "colour": S.COLOURS[(S.COLOURS.index(first["colour"]) + 1) % len(S.COLOURS)]},
        "shape": {**first, "shape": S.SHAPES[(S.SHAPES.index(first["shape"]) + 1) % len(S.SHAPES)]},
    }
    if first["size"] is not None:
        swaps["size"] = {**first, "size": "small" if first["size"] == "large" else "large"}
    variants = [({**parsed, "objects": [p, *parsed["objects"][1:]]}, a) for a, p in swaps.items()]
    if parsed["relation"] is None:
        variants.append(({**parsed, "count": parsed["count"] % 3 + 1}, "count"))
    else:
        flip = {"left of": "right of", "right of": "left of", "above": "below", "below": "above"}
        variants.append(({**parsed, "relation": flip[parsed["relation"]]}, "position"))
    out = []
    for wrong, attribute in variants:
        try:
            out.append((S.format_caption(wrong), attribute))
        except ValueError:  # e.g. both related objects now of one kind
            continue
    return out


def test_checks_reject_wrong_captions(batches):
    images, captions, _ = _all(batches)
    wrong_images, wrong_captions, attributes = [], [], []
    for image, caption in zip(images, captions):
        for wrong, attribute in _wrong_captions(caption):
            wrong_images.append(image)
            wrong_captions.append(wrong)
            attributes.append(attribute)
    result = check_images(wrong_images, wrong_captions)
    assert len(wrong_captions) > 3 * len(captions)
    overall = [not r["overall"] for r in result["per_image"]]
    assert sum(overall) / len(overall) >= 0.95
    for attribute in ATTRIBUTES:
        caught = [not r[attribute] for r, a in zip(result["per_image"], attributes) if a == attribute]
        assert len(caught) > 20 and sum(caught) / len(caught) >= 0.95, attribute

def test_two_red_circles_are_not_three_blue_or_square():
    sampler = S.SceneSampler("test", seed=0)
    renders = [sampler.render_caption("two red circles", index=i) for i in range(12)]
    assert all(scene.caption == "two red circles" and scene.split == "train" for _, scene in renders)
    for caption, wrong in [("two red circles", None), ("three red circles", "count"),
                           ("two blue circles", "colour"), ("two red squares", "shape")]:
        results = [check_image(image, caption) for image, _ in renders]
        assert all(r["overall"] == (wrong is None) for r in results), caption
        if wrong:
            assert not any(r[wrong] for r in results)
            if wrong != "colour":  # with no blue object, shape and count fail too
                assert all(r[a] for r in results for a in ("colour", "shape", "count") if a != wrong)
    assert set(results[0]) == {"caption", "detections", "overall", *ATTRIBUTES}


def test_checks_survive_a_mild_degradation(batches):
    for batch in batches.values():
        degraded = list(batch.images)
        for seed, (stacked, idx) in enumerate(batch.by_size().values()):
            for i, image in zip(idx, degrade(stacked, factor=4, noise_std=0.03, seed=seed)):
                degraded[i] = image
        assert float((degraded[0] - batch.images[0]).abs().mean()) > 0.01
        result = check_images(degraded, batch.captions)
        assert all(result["accuracy"][a] >= 0.95 for a in (*ATTRIBUTES, "overall")), result["accuracy"]


# -------------------------------------------------------------------------------- bad arguments
@pytest.mark.parametrize("kwargs, match", [
    ({"split": "val"}, "split"), ({"split": "eval"}, "split"), ({"seed": -1}, "seed"), ({"seed": 1.5}, "seed"),
    ({"sizes": ()}, "sizes"), ({"sizes": ((64, 60),)}, "sizes"), ({"sizes": ((32, 32),)}, "sizes"),
    ({"sizes": ((256, 256),)}, "sizes"), ({"sizes": ((64, 64, 3),)}, "sizes"), ({"sizes": (64, 64)}, "sizes"),
    ({"sizes": ((64.5, 64),)}, "sizes"), ({"relation_fraction": 1.5}, "relation_fraction"),
    ({"background": "noise"}, "background"), ({"photos": []}, "photos"),
])
def test_sampler_rejects_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        S.SceneSampler(**kwargs)


def test_other_bad_arguments_raise():
    sampler = S.SceneSampler("test", seed=0)
    image = sampler.scene_at(0)[0]
    for call, match in [
        (lambda: sampler.sample(-1), "n must"), (lambda: sampler.scene_at(-2), "index"),
        (lambda: sampler.render_caption("a red circle", index=-1), "index"),
        (lambda: sampler.render_caption("two red circle"), "caption"),
        (lambda: S.compositions("val"), "split"), (lambda: S.split_of("a red thing"), "caption"),
        (lambda: check_images(image[None], ["a red circle", "a blue square"]), "captions"),
        (lambda: check_images(image[None], "a red circle"), "captions"),
        (lambda: check_images(image, ["a red circle"] * 3), "images"),
        (lambda: check_images(image[None], ["a red blob"]), "caption"),
        (lambda: check_image(image[:2], "a red circle"), "image"),
        (lambda: degrade(image[None], factor=3), "factor"), (lambda: degrade(image), "images"),
    ]:
        with pytest.raises(ValueError, match=match):
            call()
