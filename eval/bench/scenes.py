"""Captioned synthetic scenes for the text-to-image model (tiny-t2i): flat coloured shapes on muted photo textures.

A scene holds one to three objects. Each object is a shape (circle, square, triangle) in one colour of
:data:`PALETTE` and one size (small, large). A scene is either *counted* (one, two or three objects of the
same kind: "two red circles", "a large green circle") or *related* (two objects of different kinds and a
spatial relation: "a blue square left of a yellow triangle"). Counts and relations are never combined.

Caption grammar (words from :data:`CAPTION_WORDS` only, single spaces, lower case, no punctuation)::

    caption  := counted | related
    counted  := NUMBER [SIZE] COLOUR SHAPE           SHAPE is plural after "two" and "three"
    related  := PHRASE RELATION PHRASE               the two phrases differ in colour or shape
    PHRASE   := "a" [SIZE] COLOUR SHAPE
    NUMBER   := "a" | "two" | "three"                "a" is the count one
    SIZE     := "small" | "large"                    absent: each object's size is drawn at random
    COLOUR   := "red" | "yellow" | "green" | "cyan" | "blue" | "magenta"
    SHAPE    := "circle" | "square" | "triangle"
    RELATION := "left of" | "right of" | "above" | "below"

:func:`parse_caption` and :func:`format_caption` are exact inverses on this grammar.

Split: the *composition key* of a caption is its canonical form (a caption already abstracts positions;
"X right of Y" is keyed as "Y left of X" and "X below Y" as "Y above X", so both phrasings of one
layout share a split). A stable hash (sha256 of :data:`SPLIT_SALT` and the key) sends a fraction
:data:`TEST_FRACTION` of keys to ``"test"``; test compositions never occur in training. Photo
backgrounds follow the photo-tile split of :mod:`vispec.eval.bench.data`: train scenes use its train
tiles, test scenes its held-out tiles.

Backgrounds (:data:`BACKGROUNDS`), both with a faint uniform tint (chroma at most about 0.05), far below the
objects' chroma (about 0.7), so colour segmentation separates them:

* ``"plain"`` (the default; tiny-t2i's domain): one flat grey level in [0.25, 0.75]. Varied between
  scenes, flat within one, so a small model spends its capacity on the objects (the scenes before
  issue 48 had a gentle random ramp, which tiny-t2i's 3.5M parameters spent their loss on);
* ``"photo"``: a crop of a bundled scikit-image photo (scale jitter, random flip; needs scikit-image),
  converted to grey, standardised and re-mapped to mid grey levels with a low contrast (standard
  deviation 0.04-0.10 on [0, 1]; flat crops are not amplified), plus grey grain (standard deviation
  0.005-0.02). Textured, so image tokens are not low-entropy.

Geometry, in fractions of the image's shorter side ``m``: every object's box is square, with side
``[0.26, 0.30] m`` (small) or ``[0.38, 0.42] m`` (large; three of them still fit in a square image); objects keep
``0.08 m`` apart and ``0.03 m`` from the border. Related objects lie along the relation's axis with a main-axis
offset at least 1.5 times the cross-axis one. Shapes are drawn with PIL at 4x resolution and box-filtered down
(anti-aliased edges), then alpha-composited; images are quantised to uint8 and returned in ``[-1, 1]``.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass
from typing import NamedTuple, Optional, Sequence

import numpy as np
import torch
from PIL import Image, ImageDraw
from torch import Tensor

from vispec.eval.bench.data import TILE, Tile, load_photos, split_tiles, to_model_range

SHAPES = ("circle", "square", "triangle")
PALETTE: dict[str, tuple[int, int, int]] = {  # hues about 60 degrees apart, chroma 160-180 of 255
    "red": (220, 40, 40),
    "yellow": (220, 210, 40),
    "green": (40, 190, 40),
    "cyan": (40, 200, 200),
    "blue": (50, 50, 230),
    "magenta": (200, 40, 200),
}
COLOURS = tuple(PALETTE)
SIZES = ("small", "large")
RELATIONS = ("left of", "right of", "above", "below")
NUMBERS: dict[str, int] = {"a": 1, "two": 2, "three": 3}
CAPTION_WORDS: tuple[str, ...] = tuple(sorted(
    set(NUMBERS) | set(SIZES) | set(COLOURS) | set(SHAPES) | {s + "s" for s in SHAPES}
    | {w for r in RELATIONS for w in r.split()}
))
SPLITS = ("train", "test")
DEFAULT_SIZES: tuple[tuple[int, int], ...] = ((64, 64), (64, 96))
TEST_FRACTION = 0.2
BACKGROUNDS = ("plain", "photo")
SPLIT_SALT = "vispec-scenes-v1"

EXTENTS: dict[str, tuple[float, float]] = {"small": (0.26, 0.30), "large": (0.38, 0.42)}
SIZE_THRESHOLD = 0.34  # between the small and large extents; the checks' small/large boundary
GAP = 0.08
MARGIN = 0.03
SUPERSAMPLE = 4
_SWAPPED = {"right of": "left of", "below": "above"}


# ----------------------------------------------------------------------------------------------- grammar
def _phrase(colour: str, shape: str, size: Optional[str]) -> dict:
    return {"colour": colour, "shape": shape, "size": size}


def _parse_phrase(words: list[str], caption: str) -> tuple[int, dict, list[str]]:
    """``(number, phrase, remaining words)`` for ``NUMBER [SIZE] COLOUR SHAPE`` at the start of ``words``."""
    def bad(why: str) -> ValueError:
        return ValueError(f"caption {caption!r} is outside the scene grammar: {why}")

    if not words or words[0] not in NUMBERS:
        raise bad(f"expected one of {sorted(NUMBERS)}")
    number, rest = NUMBERS[words[0]], words[1:]
    size = None
    if rest and rest[0] in SIZES:
        size, rest = rest[0], rest[1:]
    if not rest or rest[0] not in COLOURS:
        raise bad(f"expected a colour from {list(COLOURS)}")
    colour, rest = rest[0], rest[1:]
    nouns = {(s + "s" if number > 1 else s): s for s in SHAPES}
    if not rest or rest[0] not in nouns:
        raise bad(f"expected one of {sorted(nouns)}")
    return number, _phrase(colour, nouns[rest[0]], size), rest[1:]


def parse_caption(caption: str) -> dict:
    """The attributes a caption asks for: ``{"count": int | None, "relation": str | None, "objects": [...]}``.

    ``objects`` holds phrases ``{"colour", "shape", "size" (None when not asked)}``: one for a counted
    caption (``count`` objects of that kind), two for a related one (subject, then reference; ``count``
    is None). Raises ValueError for any caption outside the grammar (see the module docstring).
    """
    if not isinstance(caption, str):
        raise ValueError(f"caption must be a str, got {type(caption).__name__}")
    words = caption.split(" ")
    number, first, rest = _parse_phrase(words, caption)
    if not rest:
        return {"count": number, "relation": None, "objects": [first]}
    relation = next((r for r in RELATIONS if rest[: len(r.split())] == r.split()), None)
    if number != 1 or relation is None:
        raise ValueError(f"caption {caption!r} is outside the scene grammar: expected a relation after 'a ...'")
    number, second, rest = _parse_phrase(rest[len(relation.split()):], caption)
    if number != 1 or rest:
        raise ValueError(f"caption {caption!r} is outside the scene grammar: a relation joins two 'a ...' phrases")
    if (first["colour"], first["shape"]) == (second["colour"], second["shape"]):
        raise ValueError(f"caption {caption!r} is outside the scene grammar: related objects must differ")
    return {"count": None, "relation": relation, "objects": [first, second]}


def format_caption(parsed: dict) -> str:
    """The caption of a parsed description (the inverse of :func:`parse_caption`); ValueError if invalid."""
    if not isinstance(parsed, dict) or set(parsed) != {"count", "relation", "objects"}:
        raise ValueError(f"parsed must be a dict with keys count, relation, objects; got {parsed!r}")

    def words(number: int, p: dict) -> str:
        if not isinstance(p, dict) or p.get("colour") not in COLOURS or p.get("shape") not in SHAPES \
                or p.get("size") not in (None, *SIZES):
            raise ValueError(f"parsed object must have a palette colour, a shape and size None/small/large; got {p!r}")
        article = {v: k for k, v in NUMBERS.items()}[number]
        noun = p["shape"] + ("s" if number > 1 else "")
        return " ".join(w for w in (article, p["size"], p["colour"], noun) if w)

    objects = parsed["objects"] if isinstance(parsed["objects"], list) else []
    if parsed["relation"] is None and parsed["count"] in NUMBERS.values() and len(objects) == 1:
        text = words(parsed["count"], objects[0])
    elif parsed["relation"] in RELATIONS and parsed["count"] is None and len(objects) == 2:
        text = f"{words(1, objects[0])} {parsed['relation']} {words(1, objects[1])}"
    else:
        raise ValueError(f"parsed must have a count 1-3 and one object, or a relation and two objects; got {parsed!r}")
    if parse_caption(text) != parsed:  # e.g. two related objects of the same kind
        raise ValueError(f"parsed {parsed!r} is outside the scene grammar")
    return text


def composition_key(caption: str) -> str:
    """Canonical form of a caption: relations written as "left of" / "above" (subject and reference swapped)."""
    parsed = parse_caption(caption)
    if parsed["relation"] in _SWAPPED:
        parsed = {"count": None, "relation": _SWAPPED[parsed["relation"]], "objects": parsed["objects"][::-1]}
    return format_caption(parsed)


def split_of(composition: str) -> str:
    """``"train"`` or ``"test"`` for a composition key or any caption (a stable sha256 hash of its key)."""
    key = composition_key(composition)
    digest = hashlib.sha256(f"{SPLIT_SALT}\n{key}".encode()).digest()
    return "test" if int.from_bytes(digest[:8], "big") / 2.0**64 < TEST_FRACTION else "train"


@functools.cache
def all_compositions() -> tuple[str, ...]:
    """Every composition key: counted ones first, then related ones (relations "left of" and "above" only)."""
    phrases = [_phrase(c, s, z) for z in (None, *SIZES) for c in COLOURS for s in SHAPES]
    counted = [
        format_caption({"count": n, "relation": None, "objects": [p]}) for n in NUMBERS.values() for p in phrases
    ]
    related = [
        format_caption({"count": None, "relation": r, "objects": [a, b]})
        for r in ("left of", "above") for a in phrases for b in phrases
        if (a["colour"], a["shape"]) != (b["colour"], b["shape"])
    ]
    return tuple(counted + related)


@functools.cache
def compositions(split: str) -> tuple[str, ...]:
    """The composition keys of one split (``"train"`` or ``"test"``), in :func:`all_compositions` order."""
    _check_split(split)
    return tuple(k for k in all_compositions() if split_of(k) == split)


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")


# --------------------------------------------------------------------------------------- descriptions
def box_centre(box: tuple[float, float, float, float]) -> tuple[float, float]:
    """``(y, x)`` of the centre of a ``(top, left, bottom, right)`` box."""
    return ((box[0] + box[2]) / 2, (box[1] + box[3]) / 2)


@dataclass(frozen=True)
class SceneObject:
    """One rendered object; ``box`` is ``(top, left, bottom, right)`` in continuous pixel coordinates."""

    shape: str
    colour: str
    size: str
    box: tuple[float, float, float, float]

    @property
    def centre(self) -> tuple[float, float]:
        return box_centre(self.box)


@dataclass(frozen=True)
class Scene:
    """Ground truth of one image: its objects, ``count`` (counted scenes) or ``relation`` (related scenes:
    ``objects[0] relation objects[1]``), the caption, its composition key and the key's split."""

    height: int
    width: int
    objects: tuple[SceneObject, ...]
    count: Optional[int]
    relation: Optional[str]
    caption: str
    composition: str
    split: str


class SceneBatch(NamedTuple):
    """``sample(n)`` result: images ``[3, H, W]`` in ``[-1, 1]`` (sizes may differ), captions, ground truth."""

    images: list[Tensor]
    captions: list[str]
    scenes: list[Scene]

    def by_size(self) -> dict[tuple[int, int], tuple[Tensor, list[int]]]:
        """``{(H, W): (images [B, 3, H, W], their indices in this batch)}``."""
        groups: dict[tuple[int, int], list[int]] = {}
        for i, image in enumerate(self.images):
            groups.setdefault((image.shape[1], image.shape[2]), []).append(i)
        return {hw: (torch.stack([self.images[i] for i in idx]), idx) for hw, idx in groups.items()}


# -------------------------------------------------------------------------------------------- layout
def _scatter(rng: np.random.Generator, sides: list[float], height: int, width: int) -> list[tuple]:
    """Non-overlapping square boxes, returned in the order of ``sides``.

    Largest first, each uniform over the quarter-pixel positions still free (restart on a dead end).
    """
    m = min(height, width)
    margin, gap = MARGIN * m, GAP * m
    order = sorted(range(len(sides)), key=lambda i: -sides[i])
    for _ in range(1000):
        boxes: dict[int, tuple] = {}
        for i in order:
            d = sides[i]
            tops = np.arange(margin, height - margin - d, 0.25)[:, None]
            lefts = np.arange(margin, width - margin - d, 0.25)[None, :]
            free = np.ones((tops.shape[0], lefts.shape[1]), dtype=bool)
            for b in boxes.values():
                vertical = (tops + d + gap <= b[0]) | (b[2] + gap <= tops)
                free &= vertical | (lefts + d + gap <= b[1]) | (b[3] + gap <= lefts)
            candidates = np.flatnonzero(free)
            if not candidates.size:
                break
            r, c = divmod(int(candidates[rng.integers(candidates.size)]), free.shape[1])
            boxes[i] = (float(tops[r, 0]), float(lefts[0, c]), float(tops[r, 0]) + d, float(lefts[0, c]) + d)
        else:
            return [boxes[i] for i in range(len(sides))]
    raise RuntimeError(f"could not place objects of sides {sides} in {height}x{width}")  # pragma: no cover


def _pair(rng: np.random.Generator, sides: list[float], relation: str, height: int, width: int) -> list[tuple]:
    """Boxes of ``[subject, reference]`` such that ``subject relation reference`` holds."""
    m = min(height, width)
    margin, gap = MARGIN * m, GAP * m
    horizontal = relation in ("left of", "right of")
    length, cross_length = (width, height) if horizontal else (height, width)
    order = [0, 1] if relation in ("left of", "above") else [1, 0]  # along the axis: first, second
    e1, e2 = sides[order[0]], sides[order[1]]
    u = np.sort(rng.uniform(0, length - 2 * margin - e1 - e2 - gap, 2))
    start1 = margin + u[0]
    start2 = start1 + e1 + gap + (u[1] - u[0])
    c1, c2 = start1 + e1 / 2, start2 + e2 / 2
    cross1 = rng.uniform(margin + e1 / 2, cross_length - margin - e1 / 2)
    window = (c2 - c1) / 1.5  # cross-axis offset at most 1/1.5 of the main-axis one
    lo = max(margin + e2 / 2, cross1 - window)
    hi = min(cross_length - margin - e2 / 2, cross1 + window)
    if lo <= hi:
        cross2 = rng.uniform(lo, hi)
    else:  # not reached with the EXTENTS above; keeps odd geometry in the image
        cross2 = float(np.clip(cross1, margin + e2 / 2, cross_length - margin - e2 / 2))
    centres = {order[0]: (c1, cross1), order[1]: (c2, cross2)}
    boxes = []
    for i in (0, 1):
        main, cross = centres[i]
        y, x = (cross, main) if horizontal else (main, cross)
        d = sides[i]
        boxes.append((y - d / 2, x - d / 2, y + d / 2, x + d / 2))
    return boxes


def layout_objects(rng: np.random.Generator, parsed: dict, height: int, width: int) -> tuple[SceneObject, ...]:
    phrases = parsed["objects"] * (parsed["count"] or 1)
    sizes = [p["size"] or SIZES[int(rng.integers(2))] for p in phrases]
    sides = [rng.uniform(*EXTENTS[s]) * min(height, width) for s in sizes]
    if parsed["relation"] is None:
        boxes = _scatter(rng, sides, height, width)
    else:
        boxes = _pair(rng, sides, parsed["relation"], height, width)
    return tuple(
        SceneObject(p["shape"], p["colour"], s, tuple(float(v) for v in b)) for p, s, b in zip(phrases, sizes, boxes)
    )


# ----------------------------------------------------------------------------------------- rendering
def _grey(photo: Tensor) -> np.ndarray:
    rgb = photo.float().numpy()
    return (0.299 * rgb[0] + 0.587 * rgb[1] + 0.114 * rgb[2]).astype(np.float32)


@functools.cache
def _default_photos() -> tuple[tuple[np.ndarray, ...], dict[str, tuple[Tile, ...]]]:
    photos = load_photos()
    tiles = split_tiles(photos, seed=0)
    return tuple(_grey(p) for p in photos), {"train": tuple(tiles["train"]), "test": tuple(tiles["eval"])}


def _tint(rng: np.random.Generator) -> np.ndarray:
    angle, tint = rng.uniform(0, 2 * np.pi), rng.uniform(0, 0.03)
    return (tint * np.cos(angle - np.array([0, 2 * np.pi / 3, 4 * np.pi / 3]))).astype(np.float32)


def plain_background(rng: np.random.Generator, height: int, width: int) -> np.ndarray:
    """A flat grey ``[H, W, 3]`` in ``[0, 1]`` with a faint tint (see the module docstring)."""
    grey = np.full((height, width, 1), rng.uniform(0.25, 0.75), dtype=np.float32)
    return grey + _tint(rng)


def photo_background(rng: np.random.Generator, grey: Sequence[np.ndarray], tiles: Sequence[Tile], height: int,
                      width: int) -> np.ndarray:
    """A muted textured background ``[H, W, 3]`` in ``[0, 1]`` (see the module docstring)."""
    tile = tiles[int(rng.integers(len(tiles)))]
    scale = rng.uniform(1.0, TILE / max(height, width))
    ch, cw = min(TILE, round(height * scale)), min(TILE, round(width * scale))
    top = tile.top + int(rng.integers(TILE - ch + 1))
    left = tile.left + int(rng.integers(TILE - cw + 1))
    crop = grey[tile.photo][top : top + ch, left : left + cw]
    if (ch, cw) != (height, width):
        crop = np.asarray(Image.fromarray(crop, mode="F").resize((width, height), Image.BOX))
    if rng.random() < 0.5:
        crop = crop[:, ::-1]
    z = (crop - crop.mean()) / max(float(crop.std()), 4.0)
    grain = rng.uniform(0.005, 0.02) * rng.standard_normal((height, width), dtype=np.float32)
    level = np.clip(rng.uniform(0.3, 0.7) + rng.uniform(0.04, 0.10) * z + grain, 0.05, 0.95)
    return level[..., None] + _tint(rng)


def shape_alpha(shape: str, box: tuple[float, float, float, float]) -> tuple[int, int, np.ndarray]:
    """``(y0, x0, coverage [h, w] in [0, 1])`` of a shape over the integer pixels around its box."""
    y0, x0 = int(np.floor(box[0])), int(np.floor(box[1]))
    h, w = int(np.ceil(box[2])) - y0, int(np.ceil(box[3])) - x0
    s = SUPERSAMPLE
    t, l, b, r = ((box[0] - y0) * s, (box[1] - x0) * s, (box[2] - y0) * s - 1, (box[3] - x0) * s - 1)
    canvas = Image.new("L", (w * s, h * s), 0)
    draw = ImageDraw.Draw(canvas)
    if shape == "circle":
        draw.ellipse((l, t, r, b), fill=255)
    elif shape == "square":
        draw.rectangle((round(l), round(t), round(r), round(b)), fill=255)
    else:  # apex up
        draw.polygon([((l + r) / 2, t), (r, b), (l, b)], fill=255)
    small = canvas.resize((w, h), Image.BOX)
    return y0, x0, np.asarray(small, dtype=np.float32) / 255.0


def render(rng: np.random.Generator, objects: Sequence[SceneObject], background: np.ndarray) -> np.ndarray:
    """Composite ``objects`` over ``background`` ``[H, W, 3]`` in ``[0, 1]``; returns uint8 ``[H, W, 3]``.

    Each object's colour is its palette colour times a random brightness in ``[0.85, 1]`` (hue kept).
    """
    image = background.copy()
    for obj in objects:
        colour = np.asarray(PALETTE[obj.colour], dtype=np.float32) / 255.0 * rng.uniform(0.85, 1.0)
        y0, x0, a = shape_alpha(obj.shape, obj.box)
        region = image[y0 : y0 + a.shape[0], x0 : x0 + a.shape[1]]
        region += a[..., None] * (colour - region)
    return np.round(np.clip(image, 0.0, 1.0) * 255.0).astype(np.uint8)


# ------------------------------------------------------------------------------------------- sampler
def _check_index(index: int) -> int:
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise ValueError(f"index must be a non-negative int, got {index!r}")
    return index


def _check_sizes(sizes: Sequence[Sequence[int]]) -> tuple[tuple[int, int], ...]:
    try:
        out = tuple((int(h), int(w)) for h, w in sizes)
        ok = bool(out) and all(h == hw[0] and w == hw[1] for (h, w), hw in zip(out, sizes))
    except (TypeError, ValueError):
        ok = False
    if not ok or any(v % 16 or not 64 <= v <= TILE for hw in out for v in hw):
        raise ValueError(
            f"sizes must be a non-empty sequence of (height, width) pairs, each a multiple of 16 in [64, {TILE}]; "
            f"got {sizes!r}"
        )
    return out


class SceneSampler:
    """Seeded stream of captioned scenes from one split.

    Scene ``i`` depends only on ``(seed, split, i)`` (its own numpy generator), so :meth:`scene_at` gives
    random access and :meth:`sample` continues the stream. A scene is related with probability
    ``relation_fraction`` (else counted); its composition is uniform over the split's keys of that kind,
    a related key is phrased either way round with equal odds, and its size is uniform over ``sizes``.
    ``background`` is ``"plain"`` or ``"photo"`` (see the module docstring); for ``"photo"``, ``photos``
    (uint8 ``[3, H, W]`` tensors, default :func:`~vispec.eval.bench.data.load_photos`) supply the textures.
    """

    def __init__(self, split: str = "train", seed: int = 0, sizes: Sequence[Sequence[int]] = DEFAULT_SIZES,
                 relation_fraction: float = 0.5, photos: Optional[list[Tensor]] = None, background: str = "plain"):
        _check_split(split)
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed must be a non-negative int, got {seed!r}")
        if not 0.0 <= relation_fraction <= 1.0:
            raise ValueError(f"relation_fraction must lie in [0, 1], got {relation_fraction!r}")
        if background not in BACKGROUNDS:
            raise ValueError(f"background must be one of {BACKGROUNDS}, got {background!r}")
        if photos is not None and background != "photo":
            raise ValueError(f"photos are only used with background='photo', got background={background!r}")
        self.background = background
        self.split, self.seed, self.sizes = split, seed, _check_sizes(sizes)
        self.relation_fraction = float(relation_fraction)
        keys = compositions(split)
        self.counted = tuple(k for k in keys if parse_caption(k)["relation"] is None)
        self.related = tuple(k for k in keys if parse_caption(k)["relation"] is not None)
        self._grey: tuple[np.ndarray, ...] = ()
        self._tiles: tuple[Tile, ...] = ()
        if background == "photo" and photos is None:
            self._grey, tiles = _default_photos()
            self._tiles = tiles[split]
        elif background == "photo":
            self._grey = tuple(_grey(p) for p in photos)
            split_tiles_ = split_tiles(photos, seed=0)
            self._tiles = tuple(split_tiles_["eval" if split == "test" else "train"])
        self._next = 0

    def scene_at(self, index: int) -> tuple[Tensor, str, Scene]:
        """``(image [3, H, W] float32 in [-1, 1], caption, ground truth)`` of scene ``index`` of the stream."""
        rng = np.random.default_rng([self.seed, SPLITS.index(self.split), _check_index(index)])
        height, width = self.sizes[int(rng.integers(len(self.sizes)))]
        related = rng.random() < self.relation_fraction
        pool = self.related if related and self.related else self.counted
        parsed = parse_caption(pool[int(rng.integers(len(pool)))])
        if parsed["relation"] is not None and rng.random() < 0.5:  # the other phrasing
            swap = {"left of": "right of", "above": "below"}[parsed["relation"]]
            parsed = {"count": None, "relation": swap, "objects": parsed["objects"][::-1]}
        return self._draw(rng, format_caption(parsed), height, width)

    def render_caption(self, caption: str, index: int = 0) -> tuple[Tensor, Scene]:
        """``(image, ground truth)``: a render of any grammatical ``caption`` (of either split), e.g. a reference
        for a prompt. Seeded by ``(seed, split, index, caption)``; size and background drawn as in the stream."""
        parse_caption(caption)
        digest = int.from_bytes(hashlib.sha256(caption.encode()).digest()[:8], "big")
        rng = np.random.default_rng([self.seed, SPLITS.index(self.split), _check_index(index), digest])
        height, width = self.sizes[int(rng.integers(len(self.sizes)))]
        image, _, scene = self._draw(rng, caption, height, width)
        return image, scene

    def _draw(self, rng: np.random.Generator, caption: str, height: int, width: int) -> tuple[Tensor, str, Scene]:
        parsed = parse_caption(caption)
        objects = layout_objects(rng, parsed, height, width)
        if self.background == "plain":
            background = plain_background(rng, height, width)
        else:
            background = photo_background(rng, self._grey, self._tiles, height, width)
        pixels = render(rng, objects, background)
        image = to_model_range(torch.from_numpy(pixels).permute(2, 0, 1))
        key = composition_key(caption)
        return image, caption, Scene(height, width, objects, parsed["count"], parsed["relation"], caption, key,
                                     split_of(key))

    def sample(self, n: int) -> SceneBatch:
        """The next ``n`` scenes of the stream as ``(images, captions, scenes)``."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"n must be a non-negative int, got {n!r}")
        items = [self.scene_at(i) for i in range(self._next, self._next + n)]
        self._next += n
        return SceneBatch([it[0] for it in items], [it[1] for it in items], [it[2] for it in items])
