"""Training and evaluation images for the embedded class-conditional model (tiny-c2i).

Images are random crops of natural photos bundled with scikit-image (a training/eval extra, not a
runtime dependency); the class of a crop is its source photo. Natural textures keep the token
distributions as high-entropy as real images, which matters for honest speed-up numbers.

Split: each photo is cut into 128-pixel tiles, and a seeded quarter of its tiles (at least one) is
held out. A crop lies inside one tile, with side ``s ~ U[64, 128]`` (scale jitter), a random
horizontal flip, and area-resampling to 64x64. Evaluation crops therefore come from pixels the
models never saw.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

PHOTOS = (
    "astronaut.png", "brick.png", "camera.png", "chelsea.png", "coffee.png", "coins.png", "grass.png",
    "gravel.png", "hubble_deep_field.jpg", "ihc.png", "moon.png", "motorcycle_left.png", "retina.jpg", "rocket.jpg",
)
CLASS_NAMES = tuple(os.path.splitext(p)[0] for p in PHOTOS)
IMAGE_SIZE = 64
TILE = 128
HELD_OUT_FRACTION = 0.25


def _skimage_data_dir() -> str:
    try:
        import skimage
    except ImportError as err:  # pragma: no cover - exercised only without the extra
        raise ImportError("tiny-c2i data needs scikit-image: pip install 'vispec[train]'") from err
    return os.path.join(os.path.dirname(skimage.__file__), "data")


def load_photos() -> list[Tensor]:
    """The source photos as uint8 ``[3, H, W]`` tensors (greyscale replicated to RGB)."""
    from skimage import io

    photos = []
    for name in PHOTOS:
        image = np.asarray(io.imread(os.path.join(_skimage_data_dir(), name)))
        if image.ndim == 2:
            image = np.repeat(image[..., None], 3, axis=2)
        photos.append(torch.from_numpy(np.ascontiguousarray(image[..., :3])).permute(2, 0, 1).contiguous())
    return photos


@dataclass(frozen=True)
class Tile:
    photo: int
    top: int
    left: int


def split_tiles(photos: list[Tensor], seed: int = 0) -> dict[str, list[Tile]]:
    """``{"train": [...], "eval": [...]}``: every full 128-px tile of every photo, a seeded quarter held out."""
    rng = np.random.default_rng(seed)
    split: dict[str, list[Tile]] = {"train": [], "eval": []}
    for index, photo in enumerate(photos):
        tiles = [Tile(index, r * TILE, c * TILE) for r in range(photo.shape[1] // TILE) for c in range(photo.shape[2] // TILE)]
        held = max(1, round(HELD_OUT_FRACTION * len(tiles)))
        order = rng.permutation(len(tiles))
        split["eval"] += [tiles[i] for i in order[:held]]
        split["train"] += [tiles[i] for i in order[held:]]
    return split


class CropSampler:
    """Random 64x64 crops with labels from one split (``"train"`` or ``"eval"``)."""

    def __init__(self, split: str = "train", split_seed: int = 0, photos: Optional[list[Tensor]] = None):
        if split not in ("train", "eval"):
            raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
        self.photos = photos if photos is not None else load_photos()
        self.tiles = split_tiles(self.photos, split_seed)[split]
        self.by_class = [[t for t in self.tiles if t.photo == c] for c in range(len(self.photos))]

    @property
    def num_classes(self) -> int:
        return len(self.photos)

    def sample(self, count: int, generator: torch.Generator, labels: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
        """``(images uint8 [count, 3, 64, 64], labels [count])``; labels uniform over classes unless given."""
        if labels is None:
            labels = torch.randint(0, self.num_classes, (count,), generator=generator)
        crops = []
        for label in labels.tolist():
            tiles = self.by_class[label]
            tile = tiles[int(torch.randint(0, len(tiles), (1,), generator=generator))]
            side = int(torch.randint(IMAGE_SIZE, TILE + 1, (1,), generator=generator))
            top = tile.top + int(torch.randint(0, TILE - side + 1, (1,), generator=generator))
            left = tile.left + int(torch.randint(0, TILE - side + 1, (1,), generator=generator))
            crop = self.photos[tile.photo][:, top : top + side, left : left + side].float()[None]
            if side != IMAGE_SIZE:
                crop = F.interpolate(crop, size=(IMAGE_SIZE, IMAGE_SIZE), mode="area")
            if bool(torch.rand((), generator=generator) < 0.5):
                crop = crop.flip(-1)
            crops.append(crop.round().clamp(0, 255).to(torch.uint8)[0])
        return torch.stack(crops), labels


def to_model_range(images: Tensor) -> Tensor:
    """uint8 ``[0, 255]`` -> float ``[-1, 1]`` (the VQ models' input range)."""
    return images.float() / 127.5 - 1.0
