"""Scene-edit pairs (:mod:`vispec.eval.bench.scene_edits`): exactly one stated attribute differs, the instruction names
it, the captions parse and describe the renders, the background and untouched objects are the same pixels, the splits
follow the composition splits, and the stream is seeded and random-access."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("skimage", reason="the scene checks need the train extra (scikit-image)")

from vispec.eval.bench.scene_checks import check_images  # noqa: E402
from vispec.eval.bench.scene_edits import EDIT_KINDS, INSTRUCTION_WORDS, EditSampler  # noqa: E402
from vispec.eval.bench.scenes import CAPTION_WORDS, parse_caption, split_of  # noqa: E402


@pytest.fixture(scope="module")
def train_pairs():
    return EditSampler("train", seed=3).sample(60)


@pytest.fixture(scope="module")
def test_pairs():
    return EditSampler("test", seed=3).sample(30)


def _differences(pair) -> set[str]:
    """Which of colour / size / box / count differ between the two scenes' objects (matched by identity)."""
    src, tgt = pair.source_scene.objects, pair.target_scene.objects
    if len(src) != len(tgt):
        return {"count"}
    left = [o for o in src if o not in tgt]
    right = [o for o in tgt if o not in src]
    assert len(left) == len(right) == 1, (pair.instruction, src, tgt)
    a, b = left[0], right[0]
    return {name for name in ("shape", "colour", "size", "box") if getattr(a, name) != getattr(b, name)}


def test_every_kind_occurs_and_one_attribute_differs(train_pairs, test_pairs):
    pairs = train_pairs + test_pairs
    assert {p.kind for p in pairs} == set(EDIT_KINDS)
    for p in pairs:
        diff = _differences(p)
        expected = {"colour": {"colour"}, "position": {"box"}, "size": {"size", "box"}, "count": {"count"},
                    "add": {"count"}, "remove": {"count"}}[p.kind]
        assert diff == expected, (p.kind, p.instruction, diff)
        a, b = parse_caption(p.source_caption), parse_caption(p.target_caption)
        if p.kind in ("colour", "size"):  # the captions differ in exactly that word
            sw, tw = p.source_caption.split(), p.target_caption.split()
            assert len(sw) == len(tw) and sum(x != y for x, y in zip(sw, tw)) == 1
        if p.kind == "count":
            assert abs(a["count"] - b["count"]) == 1 and a["objects"] == b["objects"]
        if p.kind == "position" and a["relation"] is None:
            assert p.source_caption == p.target_caption
        if p.kind == "position" and a["relation"] is not None:
            assert a["relation"] != b["relation"] and a["objects"] == b["objects"]


def test_instruction_names_the_edit(train_pairs):
    for p in train_pairs:
        words = p.instruction.split()
        assert set(words) <= set(INSTRUCTION_WORDS) and set(CAPTION_WORDS) <= set(INSTRUCTION_WORDS)
        verb = {"colour": "make", "size": "make", "position": "move", "remove": "remove", "add": "add"}.get(p.kind)
        if verb:
            assert words[0] == verb, p.instruction
        else:
            assert words[0] in ("add", "remove")
        if p.kind == "colour":  # "make the OLD SHAPE NEW"
            new = parse_caption(p.target_caption)
            assert words[-1] in {o["colour"] for o in new["objects"]} and words[2] != words[-1]
        if p.kind == "size":
            assert words[-1] in ("small", "large")


def test_captions_describe_both_renders(train_pairs):
    sources = torch.stack([p.source for p in train_pairs])
    targets = torch.stack([p.target for p in train_pairs])
    assert check_images(sources, [p.source_caption for p in train_pairs])["accuracy"]["overall"] == 1.0
    assert check_images(targets, [p.target_caption for p in train_pairs])["accuracy"]["overall"] == 1.0


def test_same_background_and_untouched_objects(train_pairs):
    for p in train_pairs:
        assert p.source.shape == p.target.shape == (3, 64, 64)
        outside = torch.ones(64, 64, dtype=torch.bool)
        for top, left, bottom, right in p.changed:  # edited objects' boxes, anti-aliased edges included
            outside[max(0, int(top) - 1): int(bottom) + 2, max(0, int(left) - 1): int(right) + 2] = False
        assert torch.equal(p.source[:, outside], p.target[:, outside]), p.instruction
        assert not torch.equal(p.source, p.target)


def test_splits_follow_the_compositions(train_pairs, test_pairs):
    for p in train_pairs:
        assert split_of(p.source_caption) == split_of(p.target_caption) == "train"
    for p in test_pairs:
        assert split_of(p.target_caption) == "test"


def test_seeded_random_access():
    a, b = EditSampler("train", seed=5), EditSampler("train", seed=5)
    stream = a.sample(4)
    again = b.pair_at(3)
    assert again.instruction == stream[3].instruction and torch.equal(again.target, stream[3].target)
    assert EditSampler("train", seed=6).pair_at(3).instruction != again.instruction or \
        not torch.equal(EditSampler("train", seed=6).pair_at(3).source, again.source)


@pytest.mark.parametrize("kwargs, name", [({"split": "val"}, "split"), ({"seed": -1}, "seed"),
                                          ({"kinds": ("recolour",)}, "kinds"), ({"size": (60, 64)}, "sizes"),
                                          ({"background": "noise"}, "background")])
def test_bad_arguments_are_named(kwargs, name):
    with pytest.raises(ValueError, match=name):
        EditSampler(**kwargs)
    with pytest.raises(ValueError, match="index"):
        EditSampler().pair_at(-1)


def test_aligned_target_codes_copy_the_source_outside_the_edit():
    """A code cell keeps the source's code unless a pixel changed in it or in a neighbouring cell (margin 1)."""
    from vispec.eval.bench.scene_edits import aligned_target_codes

    source = torch.zeros(1, 3, 16, 16)
    target = source.clone()
    target[0, :, 5, 9] = 1.0  # one pixel of code cell (1, 2) (4 x 4 pixels per cell)
    source_codes = torch.zeros(1, 4, 4, dtype=torch.long)
    target_codes = torch.ones(1, 4, 4, dtype=torch.long)  # an encoder that changed every code
    aligned = aligned_target_codes(source_codes, target_codes, source, target)
    expected = torch.zeros(4, 4, dtype=torch.long)
    expected[0:3, 1:4] = 1  # the cell and its neighbours take the target's codes
    assert torch.equal(aligned[0], expected)
    assert torch.equal(aligned_target_codes(source_codes, target_codes, source, target, margin=0)[0],
                       torch.nn.functional.one_hot(torch.tensor(1 * 4 + 2), 16).view(4, 4))
    with pytest.raises(ValueError, match="source_codes and target_codes"):
        aligned_target_codes(source_codes, target_codes[:, :2], source, target)
