"""Programmatic prompt-following checks for scene captions (GenEval-style, with no learned detector).

Detection (:func:`detect_objects`), per image:

* colour segmentation: a pixel belongs to a palette colour when its chroma (``max - min`` of RGB in
  ``[0, 1]``) is at least :data:`CHROMA_THRESHOLD` and its HSV hue lies within :data:`HUE_TOLERANCE`
  degrees of that colour's hue (nearest palette hue wins). Hue and chroma ignore brightness, and the
  scene backgrounds have chroma below about 0.05;
* objects: 8-connected components of each colour with area at least :data:`MIN_AREA_FRACTION` of the
  shorter side squared (their boxes and box centres come from these masks);
* coverage: around each component (its box grown by :data:`WINDOW_PAD`), a per-pixel coverage ``alpha``
  unmixes the pixel's chroma vector (RGB minus its grey mean, so grey texture drops out) between the
  background's (median over muted pixels) and the object's (mean of its most saturated quarter); pixels
  nearer to another object are dropped. A blur moves coverage around but keeps its row sums, column
  sums, mass and vertical third moment, so the features below survive blurry (VQ-like) decoding;
* shape: ``squareness = mass / (max row sum * max column sum)`` is 1 for a square, pi/4 for a circle,
  1/2 for a triangle (somewhat higher when blurred), and the vertical skew (third central moment over
  ``mass ** 1.5``) is -0.021 for an apex-up triangle (the only kind rendered) and 0 for the others:
  triangle if squareness < :data:`TRIANGLE_SQUARENESS` or skew < :data:`TRIANGLE_SKEW`. Squares and
  circles are told apart by ``corners``, the fourth cumulant of the coverage's projection on the two
  diagonals over that on the two axes (coverage below :data:`ALPHA_FLOOR` dropped, so background
  residue does not weigh in the tails): a square's axis projection is uniform and its diagonal one
  triangular, ``kappa_4`` -d^4/120 and -d^4/240, so ``corners`` = 1/2; a circle is isotropic, 1.
  Cumulants of a sum of independent variables add and a Gaussian's fourth is 0, so a Gaussian blur
  leaves ``corners`` unchanged. On VQ-decoded scenes, whose squares come back with rounded corners and
  whose circles come back lumpy, it separates the two better than ``squareness`` (which then decides
  triangles only): shape accuracy of 96 held-out scenes through tiny-t2i's VQ and back, 0.77 against
  0.64. Square if ``corners`` < :data:`SQUARE_CORNERS` (halfway), else circle;
* size: the side of the shape's box implied by its mass (``sqrt(mass / NOMINAL_FILL[shape])``) over the
  shorter image side, against :data:`~vispec.eval.bench.scenes.SIZE_THRESHOLD` (small below, large above);
* position: box centres. ``A left of B`` holds when B's centre is right of A's by more than their
  vertical offset (a 45-degree cone; likewise for the other relations).

Judgement (:func:`check_image`), for the attributes a caption asks for (:func:`parse_caption`):

* counted caption ``N [SIZE] COLOUR SHAPE``: ``colour`` — some object has the colour; ``count`` — exactly
  N objects have it; ``shape`` / ``size`` — all of them (at least one) have the shape / size;
* related caption ``A RELATION B``: among the assignments of two distinct detected objects of A's and B's
  colours, the one judged is the one matching the most of ``shape`` and ``size`` (if asked), then
  satisfying ``position``, then the largest; ``colour`` — such an assignment exists;
* ``overall``: every asked attribute is right. Objects of other colours are ignored.

Images are ``[3, H, W]`` / ``[B, 3, H, W]`` tensors: floating point in ``[-1, 1]`` (the VQ models' range)
by default, floating point in ``[0, 1]`` with ``zero_one=True``, or uint8 in ``[0, 255]``. Values are
clamped to the range.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from vispec.eval.bench.scenes import COLOURS, PALETTE, SIZE_THRESHOLD, box_centre, parse_caption

CHROMA_THRESHOLD = 0.25
HUE_TOLERANCE = 30.0
MIN_AREA_FRACTION = 0.006
WINDOW_PAD = 0.06  # coverage is summed over the component's box grown by this fraction of the shorter side
TRIANGLE_SQUARENESS = 0.70  # below: triangle (clean renders 0.52-0.59)
TRIANGLE_SKEW = -0.008  # vertical skew below: triangle (apex up: -0.021; circles and squares: 0)
SQUARE_CORNERS = 0.75  # below (and not a triangle): square (0.5), else circle (1.0); halfway between the two
ALPHA_FLOOR = 0.1  # coverage below this is left out of the corners statistic
NOMINAL_FILL = {"circle": np.pi / 4, "square": 1.0, "triangle": 0.5}  # area / box area of each drawn shape
ATTRIBUTES = ("colour", "shape", "count", "position", "size")


def _hue(rgb: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """HSV hue in degrees and chroma of ``[..., 3]`` RGB in ``[0, 1]``."""
    r, g, b = rgb[..., 0], rgb[..., 1], rgb[..., 2]
    mx, mn = rgb.max(-1), rgb.min(-1)
    chroma = mx - mn
    safe = np.where(chroma > 0, chroma, 1.0)
    hue = np.where(mx == r, ((g - b) / safe) % 6.0, np.where(mx == g, (b - r) / safe + 2.0, (r - g) / safe + 4.0))
    return hue * 60.0, chroma


PALETTE_HUES: dict[str, float] = {
    name: float(_hue(np.asarray(rgb, dtype=np.float64) / 255.0)[0]) for name, rgb in PALETTE.items()
}


@dataclass(frozen=True)
class Detection:
    """One detected object: its colour, shape and size judgements, mask ``area`` (pixels), the shape and size
    features (``squareness``, ``skew``, ``corners``, ``extent``: implied box side over the shorter image side) and
    ``box`` ``(top, left, bottom, right)`` of its mask in continuous pixel coordinates."""

    colour: str
    shape: str
    size: str
    area: int
    squareness: float
    skew: float
    corners: float
    extent: float
    box: tuple[float, float, float, float]

    @property
    def centre(self) -> tuple[float, float]:
        return box_centre(self.box)


def _to_unit_hwc(image: Tensor, zero_one: bool) -> np.ndarray:
    if not isinstance(image, Tensor) or image.ndim != 3 or image.shape[0] != 3:
        shape = tuple(image.shape) if isinstance(image, Tensor) else type(image).__name__
        raise ValueError(f"image must be a tensor of shape [3, H, W]; got {shape}")
    if image.dtype == torch.uint8:
        x = image.float() / 255.0
    elif image.dtype.is_floating_point:
        x = image.float() if zero_one else (image.float() + 1.0) / 2.0
    else:
        raise ValueError(f"image must be floating point or uint8; got dtype {image.dtype}")
    return x.detach().cpu().clamp(0.0, 1.0).permute(1, 2, 0).numpy()


def _soft_features(alpha: np.ndarray) -> tuple[float, float, float]:
    """``(mass, squareness, skew)`` of a coverage map: ``sum(alpha)``, ``mass / (max row sum * max column sum)``
    and the vertical third central moment over ``mass ** 1.5`` (mass, row sums and the third moment are
    unchanged by a symmetric blur)."""
    mass = float(alpha.sum())
    if mass <= 0:
        return 0.0, 0.0, 0.0
    squareness = mass / max(float(alpha.sum(1).max()) * float(alpha.sum(0).max()), 1e-6)
    rows = np.arange(alpha.shape[0], dtype=np.float64)
    profile = alpha.sum(1)
    mean = float((profile * rows).sum()) / mass
    skew = float((profile * (rows - mean) ** 3).sum()) / mass / mass**1.5
    return mass, squareness, skew


def _coverage(vectors: np.ndarray, chroma: np.ndarray, background: np.ndarray, own: np.ndarray,
              others: np.ndarray) -> np.ndarray:
    """Per-pixel coverage of one object in a window: chroma ``vectors [h, w, 3]`` unmixed between ``background``
    and the object's colour (mean of its most saturated quarter of ``own`` pixels); pixels nearer to
    ``others`` (other objects' masks) than to ``own`` are zeroed."""
    from scipy import ndimage

    colour = vectors[own & (chroma >= np.percentile(chroma[own], 75))].mean(0)
    direction = colour - background
    alpha = (vectors - background) @ direction / max(float(direction @ direction), 1e-6)
    if others.any():
        alpha[ndimage.distance_transform_edt(~others) < ndimage.distance_transform_edt(~own)] = 0.0
    return alpha


def _corners(alpha: np.ndarray) -> float:
    """Fourth cumulant of the coverage projected on the diagonals over that on the axes (module docstring); 1 (no
    corners) when the axis projections are not flatter than a Gaussian (``kappa_4 >= 0``: not a solid shape)."""
    weights = np.where(alpha >= ALPHA_FLOOR, alpha, 0.0)
    mass = float(weights.sum())
    if mass <= 0:
        return 1.0
    ys, xs = np.mgrid[: alpha.shape[0], : alpha.shape[1]].astype(np.float64)

    def kappa4(u: np.ndarray) -> float:
        centred = u - float((weights * u).sum()) / mass
        m2 = float((weights * centred**2).sum()) / mass
        return float((weights * centred**4).sum()) / mass - 3.0 * m2**2

    axes = kappa4(ys) + kappa4(xs)
    diagonals = kappa4((ys + xs) / np.sqrt(2)) + kappa4((ys - xs) / np.sqrt(2))
    return diagonals / axes if axes < 0 else 1.0


def _classify(squareness: float, skew: float, corners: float) -> str:
    if squareness < TRIANGLE_SQUARENESS or skew < TRIANGLE_SKEW:
        return "triangle"
    return "square" if corners < SQUARE_CORNERS else "circle"


def detect_objects(image: Tensor, *, zero_one: bool = False) -> list[Detection]:
    """The palette-coloured objects of one image ``[3, H, W]`` (see the module docstring), by colour then position."""
    from scipy import ndimage  # scipy comes with scikit-image (the train extra)

    rgb = _to_unit_hwc(image, zero_one).astype(np.float64)
    height, width = rgb.shape[:2]
    side = min(height, width)
    hue, chroma = _hue(rgb)
    vectors = rgb - rgb.mean(-1, keepdims=True)  # chroma plane: grey texture projects to zero
    muted = chroma < CHROMA_THRESHOLD / 2
    background = np.median(vectors[muted], 0) if muted.any() else np.zeros(3)
    distance = np.stack([np.abs((hue - PALETTE_HUES[c] + 180.0) % 360.0 - 180.0) for c in COLOURS])
    nearest = distance.argmin(0)
    coloured = (chroma >= CHROMA_THRESHOLD) & (distance.min(0) <= HUE_TOLERANCE)
    pad = max(2, round(WINDOW_PAD * side))
    detections = []
    for index, colour in enumerate(COLOURS):
        labels, _ = ndimage.label(coloured & (nearest == index), structure=np.ones((3, 3), dtype=bool))
        for label, box in enumerate(ndimage.find_objects(labels), start=1):
            mask = labels[box] == label
            area = int(mask.sum())
            if area < MIN_AREA_FRACTION * side**2:
                continue
            top, left, bottom, right = box[0].start, box[1].start, box[0].stop, box[1].stop
            window = (slice(max(0, top - pad), min(height, bottom + pad)),
                      slice(max(0, left - pad), min(width, right + pad)))
            own = labels[window] == label
            alpha = _coverage(vectors[window], chroma[window], background, own, coloured[window] & ~own)
            mass, squareness, skew = _soft_features(alpha)
            corners = _corners(alpha)
            shape = _classify(squareness, skew, corners)
            extent = (max(mass, 0.0) / NOMINAL_FILL[shape]) ** 0.5 / side
            detections.append(Detection(
                colour, shape, "large" if extent >= SIZE_THRESHOLD else "small", area, round(squareness, 4),
                round(skew, 4), round(corners, 4), round(extent, 4), (float(top), float(left), float(bottom), float(right)),
            ))
    return detections


def relation_holds(subject: tuple[float, float], reference: tuple[float, float], relation: str) -> bool:
    """Whether centre ``subject`` ``(y, x)`` is ``relation`` of centre ``reference`` (45-degree cones)."""
    dy, dx = reference[0] - subject[0], reference[1] - subject[1]
    main = {"left of": dx, "right of": -dx, "above": dy, "below": -dy}
    if relation not in main:
        raise ValueError(f"relation must be one of {list(main)}, got {relation!r}")
    return main[relation] > (abs(dy) if relation in ("left of", "right of") else abs(dx))


def _judge(parsed: dict, detections: list[Detection]) -> dict[str, Optional[bool]]:
    result: dict[str, Optional[bool]] = dict.fromkeys(ATTRIBUTES)
    asks_size = any(p["size"] is not None for p in parsed["objects"])
    if parsed["relation"] is None:
        p = parsed["objects"][0]
        found = [d for d in detections if d.colour == p["colour"]]
        result.update(colour=bool(found), count=len(found) == parsed["count"],
                      shape=bool(found) and all(d.shape == p["shape"] for d in found))
        if asks_size:
            result["size"] = bool(found) and all(d.size == p["size"] for d in found)
    else:
        a, b = parsed["objects"]
        best: Optional[tuple] = None
        for da, db in itertools.permutations(detections, 2):
            if da.colour != a["colour"] or db.colour != b["colour"]:
                continue
            shape = da.shape == a["shape"] and db.shape == b["shape"]
            size = all(p["size"] in (None, d.size) for p, d in ((a, da), (b, db)))
            position = relation_holds(da.centre, db.centre, parsed["relation"])
            score = (shape + size, position, da.area + db.area)  # identify the objects first, then judge position
            if best is None or score > best[0]:
                best = (score, shape, size, position)
        result.update(colour=best is not None, shape=bool(best and best[1]), position=bool(best and best[3]))
        if asks_size:
            result["size"] = bool(best and best[2])
    result["overall"] = all(v for v in result.values() if v is not None)
    return result


def check_image(image: Tensor, caption: str, *, zero_one: bool = False) -> dict:
    """Per-attribute judgement of one image ``[3, H, W]`` against ``caption``.

    Returns ``{"caption", "colour", "shape", "count", "position", "size", "overall", "detections"}``:
    booleans, None for attributes the caption does not ask for, and the detections as dicts.
    """
    parsed = parse_caption(caption)
    detections = detect_objects(image, zero_one=zero_one)
    return {"caption": caption, **_judge(parsed, detections), "detections": [dataclasses.asdict(d) for d in detections]}


def check_images(
    images: Union[Tensor, Sequence[Tensor]], captions: Sequence[str], *, zero_one: bool = False
) -> dict:
    """Prompt-following accuracy of images (``[B, 3, H, W]`` or a list of ``[3, H, W]``) against their captions.

    Returns ``{"accuracy": {attribute: fraction right, or None if no caption asks for it},
    "asked": {attribute: number of captions asking for it}, "checks": share, "made": number of checks,
    "per_image": [check_image results]}``
    over :data:`ATTRIBUTES` and ``"overall"``. ``accuracy["overall"]`` is the strict rate (images whose every asked
    attribute is right); ``checks`` pools the individual checks: the number of (image, asked attribute) judgements
    that pass over the number made, so a picture with the right colours and shapes but a wrong count passes 2 of 3.
    Captions are all parsed first (ValueError outside the grammar).
    """
    if isinstance(images, Tensor) and images.ndim != 4:
        raise ValueError(
            f"images must be a [B, 3, H, W] tensor or a list of [3, H, W] tensors; got {tuple(images.shape)}"
        )
    if isinstance(captions, str) or len(images) != len(captions):
        raise ValueError(
            f"captions must be a list with one caption per image; got {len(images)} images and {captions!r:.80}"
        )
    for caption in captions:
        parse_caption(caption)
    per_image = [check_image(image, caption, zero_one=zero_one) for image, caption in zip(images, captions)]
    accuracy, asked = {}, {}
    for attribute in (*ATTRIBUTES, "overall"):
        judged = [r[attribute] for r in per_image if r[attribute] is not None]
        asked[attribute] = len(judged)
        accuracy[attribute] = sum(judged) / len(judged) if judged else None
    passed = sum(sum(r[a] for a in ATTRIBUTES if r[a] is not None) for r in per_image)
    made = sum(asked[a] for a in ATTRIBUTES)
    return {"accuracy": accuracy, "asked": asked, "checks": passed / made if made else None, "made": made,
            "per_image": per_image}


def degrade(images: Tensor, factor: int = 4, noise_std: float = 0.03, seed: int = 0) -> Tensor:
    """A mild stand-in for a VQ round trip: area-downsample by ``factor``, bilinear upsample, add Gaussian noise.

    ``images``: float ``[B, 3, H, W]`` in ``[-1, 1]`` (H, W divisible by ``factor``); returns the same shape, clamped.
    """
    if not isinstance(images, Tensor) or images.ndim != 4 or not images.dtype.is_floating_point:
        raise ValueError("images must be a float tensor [B, 3, H, W] in [-1, 1]")
    if factor < 1 or images.shape[2] % factor or images.shape[3] % factor:
        raise ValueError(f"factor must be a positive divisor of H and W; got {factor} for {tuple(images.shape[2:])}")
    small = F.avg_pool2d(images, factor)
    blurred = F.interpolate(small, size=images.shape[2:], mode="bilinear", align_corners=False)
    noise = torch.randn(images.shape, generator=torch.Generator().manual_seed(seed)) * noise_std
    return (blurred + noise.to(images.dtype)).clamp(-1.0, 1.0)
