"""Scene pairs for instruction-based image editing (tiny-edit): a source scene, a target scene that differs from it
in exactly one stated attribute, the instruction that names the change, and both captions.

Both scenes share the background (the same pixels), the untouched objects (same boxes, same brightness) and the
image size, so the only pixels that differ are those of the edited object(s). The target caption is the target
scene's caption in the scene grammar (:mod:`vispec.eval.bench.scenes`), so
``check_images(edited, [pair.target_caption])`` (:mod:`vispec.eval.bench.scene_checks`) judges both the edit and the
attributes that must stay.

Edit kinds (:data:`EDIT_KINDS`), and the scenes they apply to:

* ``"colour"`` (a single object, or one object of a related scene): "make the red square blue";
* ``"position"``: a single object moves along one direction, "move the red circle to the left" (its caption, which
  abstracts positions, is unchanged); in a related scene the subject moves so that another relation holds,
  "move the red square below the blue circle" (the target caption states the new relation);
* ``"size"`` (a single object, or one object of a related scene): "make the red circle large"; the source caption
  states the object's old size so that the two captions differ in that word only;
* ``"count"`` (counted scenes): "add a red circle" / "remove one red circle" (count one more or one less, 1..3);
* ``"add"`` (a single object): a second object of another colour or shape at a stated relation, "add a blue
  square left of the red circle" (the target is a related scene);
* ``"remove"`` (related scenes): "remove the blue square" (the target is a single object).

Splits follow the scene composition splits: a ``"train"`` pair has its source's and its target's composition keys
in the train split; a ``"test"`` pair has its target's key in the test split (its source is drawn from all
compositions), so no test target composition is ever trained on. Pair ``i`` depends only on ``(seed, split, i)``
(:meth:`EditSampler.pair_at`, random access like :class:`~vispec.eval.bench.scenes.SceneSampler`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional, Sequence

import numpy as np
import torch
from torch import Tensor

from vispec.eval.bench.data import to_model_range
from vispec.eval.bench.scenes import (BACKGROUNDS, CAPTION_WORDS, COLOURS, EXTENTS, GAP, MARGIN, PALETTE,
                                      SHAPES, SIZES, SPLITS, Scene, SceneObject, SceneSampler, shape_alpha, layout_objects,
                                      photo_background, plain_background, all_compositions, composition_key,
                                      compositions, format_caption, parse_caption, split_of)

EDIT_KINDS = ("colour", "position", "size", "count", "add", "remove")
DIRECTIONS = ("left", "right", "up", "down")
EDIT_WORDS: tuple[str, ...] = ("make", "move", "remove", "add", "one", "the", "to", "left", "right", "up", "down")
INSTRUCTION_WORDS: tuple[str, ...] = tuple(sorted(set(CAPTION_WORDS) | set(EDIT_WORDS)))
MIN_MOVE = 0.2  # a single object's move, in fractions of the shorter side, at least
_OPPOSITE = {"left of": "right of", "right of": "left of", "above": "below", "below": "above"}
_SALT = 0x5ED17  # separates the pair streams from the scene streams of the same seed


class EditPair(NamedTuple):
    """One editing example: ``source`` and ``target`` images ``[3, H, W]`` in ``[-1, 1]``, the ``instruction``, both
    captions, the edit ``kind``, the two scenes' ground truth and ``changed``: the boxes ``(top, left, bottom,
    right)`` of every object that differs (old and new), outside which the two images are identical."""

    source: Tensor
    target: Tensor
    instruction: str
    source_caption: str
    target_caption: str
    kind: str
    source_scene: Scene
    target_scene: Scene
    changed: tuple[tuple[float, float, float, float], ...]


@dataclass(frozen=True)
class _Obj:
    """An object and its brightness (the factor on its palette colour), kept when the object is untouched."""

    obj: SceneObject
    brightness: float


def _name(p: dict) -> str:
    return f"{p['colour']} {p['shape']}"


def _fits(box: tuple, others: Sequence[tuple], height: int, width: int, gap_fraction: float = 1.0) -> bool:
    """Inside the margins and at least ``gap_fraction`` of the scene gap away from every box in ``others``."""
    m = min(height, width)
    margin, gap = MARGIN * m, GAP * m * gap_fraction
    if box[0] < margin - 1e-6 or box[1] < margin - 1e-6 or box[2] > height - margin + 1e-6 or box[3] > width - margin + 1e-6:
        return False
    for b in others:
        if not (box[2] + gap <= b[0] or b[2] + gap <= box[0] or box[3] + gap <= b[1] or b[3] + gap <= box[1]):
            return False
    return True


def _relation_ok(subject: tuple, reference: tuple, relation: str) -> bool:
    """``subject relation reference`` with the main-axis offset at least 1.5 times the cross-axis one (the scenes'
    geometry, stricter than the checks' 45-degree cone)."""
    sy, sx = (subject[0] + subject[2]) / 2, (subject[1] + subject[3]) / 2
    ry, rx = (reference[0] + reference[2]) / 2, (reference[1] + reference[3]) / 2
    main = {"left of": rx - sx, "right of": sx - rx, "above": ry - sy, "below": sy - ry}[relation]
    cross = abs(sy - ry) if relation in ("left of", "right of") else abs(sx - rx)
    return main > 0 and main >= 1.5 * cross


def _free_box(rng: np.random.Generator, side: float, others: Sequence[tuple], height: int, width: int,
              accept=None) -> Optional[tuple]:
    """A uniformly drawn square box of ``side`` on a half-pixel grid that fits (:func:`_fits`) and satisfies
    ``accept(box)``; None when there is none."""
    m = min(height, width)
    margin = MARGIN * m
    tops = np.arange(margin, height - margin - side + 1e-6, 0.5)
    lefts = np.arange(margin, width - margin - side + 1e-6, 0.5)
    order = rng.permutation(len(tops) * len(lefts))
    for k in order:
        r, c = divmod(int(k), len(lefts))
        box = (float(tops[r]), float(lefts[c]), float(tops[r]) + side, float(lefts[c]) + side)
        if _fits(box, others, height, width) and (accept is None or accept(box)):
            return box
    return None


class EditSampler:
    """Seeded stream of editing pairs (module docstring) of one split, ``size`` ``(H, W)`` (default 64 x 64).

    ``kinds``: the edit kinds, drawn uniformly per pair; the source scene is then drawn among the compositions the kind
    applies to (a single object or a related scene: related with chance ``relation_fraction``; counted scenes for
    ``"count"``; a single object for ``"add"``; related for ``"remove"``). A draw whose edit does not fit the layout or
    whose compositions fall outside the split is redrawn from the pair's generator. ``background``: ``"plain"`` or ``"photo"`` as in
    :class:`~vispec.eval.bench.scenes.SceneSampler`."""

    def __init__(self, split: str = "train", seed: int = 0, size: Sequence[int] = (64, 64),
                 kinds: Sequence[str] = EDIT_KINDS, relation_fraction: float = 0.5, background: str = "plain"):
        if split not in SPLITS:
            raise ValueError(f"split must be 'train' or 'test', got {split!r}")
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed must be a non-negative int, got {seed!r}")
        kinds = tuple(kinds)
        if not kinds or any(k not in EDIT_KINDS for k in kinds):
            raise ValueError(f"kinds must be a non-empty subset of {EDIT_KINDS}, got {kinds!r}")
        if not 0.0 <= relation_fraction <= 1.0:
            raise ValueError(f"relation_fraction must lie in [0, 1], got {relation_fraction!r}")
        if background not in BACKGROUNDS:
            raise ValueError(f"background must be one of {BACKGROUNDS}, got {background!r}")
        # the scene sampler checks the size and holds the photo tiles of the split
        self._scenes = SceneSampler(split, seed, sizes=(tuple(size),), background=background)
        self.split, self.seed, self.kinds = split, seed, kinds
        self.height, self.width = self._scenes.sizes[0]
        self.relation_fraction = float(relation_fraction)
        self.background = background
        pool = compositions("train") if split == "train" else all_compositions()
        self.counted = tuple(k for k in pool if parse_caption(k)["relation"] is None)
        self.single = tuple(k for k in self.counted if parse_caption(k)["count"] == 1)
        self.related = tuple(k for k in pool if parse_caption(k)["relation"] is not None)
        self._next = 0

    # ---------------------------------------------------------------------------------------------- stream
    def pair_at(self, index: int) -> EditPair:
        """Pair ``index`` of the stream (a pure function of ``(seed, split, index)``)."""
        if isinstance(index, bool) or not isinstance(index, int) or index < 0:
            raise ValueError(f"index must be a non-negative int, got {index!r}")
        rng = np.random.default_rng([self.seed, SPLITS.index(self.split), index, _SALT])
        for _ in range(200):
            pair = self._try(rng)
            if pair is not None:
                return pair
        raise RuntimeError(f"no valid edit found for pair {index} of split {self.split!r}")  # pragma: no cover

    def sample(self, n: int) -> list[EditPair]:
        """The next ``n`` pairs of the stream."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"n must be a non-negative int, got {n!r}")
        pairs = [self.pair_at(i) for i in range(self._next, self._next + n)]
        self._next += n
        return pairs

    # ---------------------------------------------------------------------------------------------- drawing
    def _try(self, rng: np.random.Generator) -> Optional[EditPair]:
        h, w = self.height, self.width
        kind = self.kinds[int(rng.integers(len(self.kinds)))]
        related = {"count": False, "add": False, "remove": True}.get(kind, rng.random() < self.relation_fraction)
        pool = self.related if related else self.counted
        if kind in ("colour", "position", "size", "add") and not related:
            pool = self.single
        parsed = parse_caption(pool[int(rng.integers(len(pool)))])
        if parsed["relation"] is not None and rng.random() < 0.5:
            parsed = {"count": None, "relation": _OPPOSITE[parsed["relation"]], "objects": parsed["objects"][::-1]}
        if not _applies(kind, parsed):  # pragma: no cover - the pools above are chosen so that it applies
            return None
        objects = [_Obj(o, float(rng.uniform(0.85, 1.0))) for o in layout_objects(rng, parsed, h, w)]
        edit = getattr(self, f"_{kind}")(rng, parsed, objects)
        if edit is None:
            return None
        source_parsed, target_parsed, target_objects, instruction, changed = edit
        source_caption, target_caption = format_caption(source_parsed), format_caption(target_parsed)
        if self.split == "train" and "test" in (split_of(source_caption), split_of(target_caption)):
            return None
        if self.split == "test" and split_of(target_caption) != "test":
            return None
        background = (plain_background(rng, h, w) if self.background == "plain" else
                      photo_background(rng, self._scenes._grey, self._scenes._tiles, h, w))
        images, scenes = [], []
        for caption, parsed_, objs in ((source_caption, source_parsed, objects),
                                       (target_caption, target_parsed, target_objects)):
            images.append(_render(objs, background))
            key = composition_key(caption)
            scenes.append(Scene(h, w, tuple(o.obj for o in objs), parsed_["count"], parsed_["relation"], caption, key,
                                split_of(key)))
        return EditPair(images[0], images[1], instruction, source_caption, target_caption, kind, scenes[0], scenes[1],
                        tuple(changed))

    def _colour(self, rng, parsed, objects):
        k = int(rng.integers(len(objects)))
        old = objects[k].obj
        other = [(o.obj.colour, o.obj.shape) for i, o in enumerate(objects) if i != k]
        choices = [c for c in COLOURS if c != old.colour and (c, old.shape) not in other]
        colour = choices[int(rng.integers(len(choices)))]
        target = list(objects)
        target[k] = _Obj(SceneObject(old.shape, colour, old.size, old.box), objects[k].brightness)
        phrases = [dict(p) for p in parsed["objects"]]
        phrases[k]["colour"] = colour
        instruction = f"make the {old.colour} {old.shape} {colour}"
        return parsed, {**parsed, "objects": phrases}, target, instruction, [old.box]

    def _size(self, rng, parsed, objects):
        h, w = self.height, self.width
        k = int(rng.integers(len(objects)))
        old = objects[k].obj
        size = "large" if old.size == "small" else "small"
        side = float(rng.uniform(*EXTENTS[size])) * min(h, w)
        cy, cx = old.centre
        m = min(h, w)
        lo, hi_y, hi_x = MARGIN * m + side / 2, h - MARGIN * m - side / 2, w - MARGIN * m - side / 2
        cy, cx = float(np.clip(cy, lo, hi_y)), float(np.clip(cx, lo, hi_x))
        box = (cy - side / 2, cx - side / 2, cy + side / 2, cx + side / 2)
        others = [o.obj.box for i, o in enumerate(objects) if i != k]
        if not _fits(box, others, h, w):
            return None
        if parsed["relation"] is not None:  # the relation must still hold after the growth
            boxes = [o.obj.box for o in objects]
            boxes[k] = box
            if not _relation_ok(boxes[0], boxes[1], parsed["relation"]):
                return None
        target = list(objects)
        target[k] = _Obj(SceneObject(old.shape, old.colour, size, box), objects[k].brightness)
        source_phrases = [dict(p) for p in parsed["objects"]]
        source_phrases[k]["size"] = old.size  # the source caption states the old size
        target_phrases = [dict(p) for p in source_phrases]
        target_phrases[k]["size"] = size
        instruction = f"make the {old.colour} {old.shape} {size}"
        return ({**parsed, "objects": source_phrases}, {**parsed, "objects": target_phrases}, target, instruction,
                [old.box, box])

    def _position(self, rng, parsed, objects):
        h, w = self.height, self.width
        m = min(h, w)
        if parsed["relation"] is None:  # a single object moves
            old = objects[0].obj
            direction = DIRECTIONS[int(rng.integers(len(DIRECTIONS)))]
            cy, cx = old.centre
            dy, dx = {"left": (0, -1), "right": (0, 1), "up": (-1, 0), "down": (1, 0)}[direction]

            def moved(box):
                ny, nx = (box[0] + box[2]) / 2, (box[1] + box[3]) / 2
                main = (ny - cy) * dy + (nx - cx) * dx
                cross = abs(nx - cx) if dy else abs(ny - cy)
                return main >= MIN_MOVE * m and cross <= 0.05 * m

            box = _free_box(rng, old.box[2] - old.box[0], [], h, w, moved)
            if box is None:
                return None
            target = [_Obj(SceneObject(old.shape, old.colour, old.size, box), objects[0].brightness)]
            instruction = f"move the {old.colour} {old.shape} {'to the ' if dx else ''}{direction}"
            return parsed, parsed, target, instruction, [old.box, box]
        subject, reference = objects[0].obj, objects[1].obj
        relations = [r for r in _OPPOSITE if r != parsed["relation"]]
        relation = relations[int(rng.integers(len(relations)))]
        box = _free_box(rng, subject.box[2] - subject.box[0], [reference.box], h, w,
                        lambda b: _relation_ok(b, reference.box, relation))
        if box is None:
            return None
        target = [_Obj(SceneObject(subject.shape, subject.colour, subject.size, box), objects[0].brightness), objects[1]]
        instruction = f"move the {subject.colour} {subject.shape} {relation} the {reference.colour} {reference.shape}"
        return parsed, {**parsed, "relation": relation}, target, instruction, [subject.box, box]

    def _count(self, rng, parsed, objects):
        h, w = self.height, self.width
        phrase, count = parsed["objects"][0], parsed["count"]
        options = [d for d in (1, -1) if 1 <= count + d <= 3]
        delta = options[int(rng.integers(len(options)))]
        name = _name(phrase)
        if delta < 0:
            k = int(rng.integers(len(objects)))
            target = [o for i, o in enumerate(objects) if i != k]
            instruction = f"remove one {name}"
            changed = [objects[k].obj.box]
        else:
            size = phrase["size"] or SIZES[int(rng.integers(2))]
            side = float(rng.uniform(*EXTENTS[size])) * min(h, w)
            box = _free_box(rng, side, [o.obj.box for o in objects], h, w)
            if box is None:
                return None
            new = SceneObject(phrase["shape"], phrase["colour"], size, box)
            target = [*objects, _Obj(new, float(rng.uniform(0.85, 1.0)))]
            instruction = f"add a {phrase['size'] + ' ' if phrase['size'] else ''}{name}"
            changed = [box]
        return parsed, {**parsed, "count": count + delta}, target, instruction, changed

    def _add(self, rng, parsed, objects):
        h, w = self.height, self.width
        old = objects[0].obj
        kinds = [(c, s) for c in COLOURS for s in SHAPES if (c, s) != (old.colour, old.shape)]
        colour, shape = kinds[int(rng.integers(len(kinds)))]
        relation = tuple(_OPPOSITE)[int(rng.integers(4))]
        size = SIZES[int(rng.integers(2))]
        side = float(rng.uniform(*EXTENTS[size])) * min(h, w)
        box = _free_box(rng, side, [old.box], h, w, lambda b: _relation_ok(b, old.box, relation))
        if box is None:
            return None
        new = SceneObject(shape, colour, size, box)
        target = [_Obj(new, float(rng.uniform(0.85, 1.0))), objects[0]]
        target_parsed = {"count": None, "relation": relation,
                         "objects": [{"colour": colour, "shape": shape, "size": None}, dict(parsed["objects"][0])]}
        instruction = f"add a {colour} {shape} {relation} the {old.colour} {old.shape}"
        return parsed, target_parsed, target, instruction, [box]

    def _remove(self, rng, parsed, objects):
        k = int(rng.integers(2))
        gone = objects[k].obj
        target = [objects[1 - k]]
        target_parsed = {"count": 1, "relation": None, "objects": [dict(parsed["objects"][1 - k])]}
        return parsed, target_parsed, target, f"remove the {gone.colour} {gone.shape}", [gone.box]


def _applies(kind: str, parsed: dict) -> bool:
    """Whether an edit ``kind`` applies to a scene of caption ``parsed`` (module docstring)."""
    single = parsed["relation"] is None and parsed["count"] == 1
    related = parsed["relation"] is not None
    return {"colour": single or related, "position": single or related, "size": single or related,
            "count": parsed["relation"] is None, "add": single, "remove": related}[kind]


def _render(objects: Sequence[_Obj], background: np.ndarray) -> Tensor:
    """Composite ``objects`` (each at its own brightness) over ``background``; ``[3, H, W]`` in ``[-1, 1]``."""
    image = background.copy()
    for item in objects:
        colour = np.asarray(PALETTE[item.obj.colour], dtype=np.float32) / 255.0 * item.brightness
        y0, x0, a = shape_alpha(item.obj.shape, item.obj.box)
        region = image[y0: y0 + a.shape[0], x0: x0 + a.shape[1]]
        region += a[..., None] * (colour - region)
    pixels = np.round(np.clip(image, 0.0, 1.0) * 255.0).astype(np.uint8)
    return to_model_range(torch.from_numpy(pixels).permute(2, 0, 1))


def aligned_target_codes(source_codes: Tensor, target_codes: Tensor, source: Tensor, target: Tensor,
                         margin: int = 1) -> Tensor:
    """The target's VQ codes with the source's code wherever the edit left the pixels alone: code cell ``(i, j)``
    keeps the source's code when the source and target pixels agree on the cell and its ``margin`` cells around.

    A VQ encoder is not local (its receptive field spans the picture, and flat regions sit near ties between
    codes), so encoding the target alone changes codes far from the edit (on the scene pairs ~60% of them while
    ~5% of the pixels change). A picture-editing model should copy what it does not edit, and an edit's drafts
    (IAD) are the source's codes: the training targets and the benchmark's measure of how much an edit keeps use
    these aligned codes. ``source_codes, target_codes``: ``[B, h, w]``; ``source, target``: ``[B, 3, H, W]``."""
    if source_codes.shape != target_codes.shape or source.shape != target.shape or source_codes.dim() != 3:
        raise ValueError(f"source_codes and target_codes must be [B, h, w] and source and target [B, 3, H, W] of one "
                         f"batch, got {tuple(source_codes.shape)}, {tuple(target_codes.shape)}, {tuple(source.shape)}, "
                         f"{tuple(target.shape)}")
    h, w = source_codes.shape[1:]
    factor = source.shape[2] // h
    if source.shape[2] != h * factor or source.shape[3] != w * factor:
        raise ValueError(f"pictures of {tuple(source.shape[2:])} pixels do not tile into {h} x {w} code cells")
    changed = (source != target).any(dim=1).float()[:, None]  # [B, 1, H, W]
    cells = torch.nn.functional.max_pool2d(changed, factor)  # any changed pixel per cell
    if margin:
        cells = torch.nn.functional.max_pool2d(cells, 2 * margin + 1, stride=1, padding=margin)
    return torch.where(cells[:, 0].to(source_codes.device) > 0, target_codes, source_codes)


__all__ = ["aligned_target_codes", "EDIT_KINDS", "EDIT_WORDS", "INSTRUCTION_WORDS", "DIRECTIONS", "EditPair", "EditSampler"]
