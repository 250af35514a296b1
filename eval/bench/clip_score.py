"""CLIPScore of images against captions, through torchmetrics' ``CLIPScore`` with any CLIP passed in.

CLIPScore (Hessel et al. 2021, "CLIPScore: A Reference-free Evaluation Metric for Image Captioning") of an
image ``I`` and a caption ``C``, with ``E_I``, ``E_C`` a CLIP's (Radford et al. 2021) image and text
embeddings::

    CLIP-S(I, C) = w * max(cos(E_I, E_C), 0)        w = 100 as in torchmetrics (Hessel et al. use 2.5)

:func:`clip_scores` gives it per image; :func:`clip_score` gives torchmetrics' ``CLIPScore`` over the whole
set, ``max(w * mean_i cos_i, 0)``: torchmetrics clamps the mean, not each pair, so it equals the mean of
:func:`clip_scores` when no pair has a negative cosine and is below it otherwise.

The model is passed to torchmetrics (recent versions, 1.9 here, accept ``model_name_or_path`` as a callable
returning ``(model, processor)``) behind a thin adapter whose ``get_image_features`` / ``get_text_features`` return
the projected feature tensors (transformers 5's ``CLIPModel`` returns model outputs, which torchmetrics 1.9
cannot normalise). With an older torchmetrics, or none, the same formula is computed here with the same
processor calls (:func:`backend` says which path runs).

Any ``CLIPModel`` works with its processor: the trained tiny-t2i CLIP (``load_clip(folder)``; its processor
squeezes a whole image to 64x64) or a real one, e.g. ``CLIPModel.from_pretrained("openai/clip-vit-base-patch16")``
with its ``CLIPProcessor`` (which resizes the shorter side to 224 and centre-crops, so a 64x96 scene loses a
strip at each side). The processor gets uint8 ``[3, H, W]`` tensors, as it would from a pipeline's images.

Images: a float tensor ``[B, 3, H, W]`` or a list of ``[3, H, W]`` tensors (sizes may differ) in ``[-1, 1]``
(the scenes' and VQ models' range; rounded to uint8 levels), uint8 tensors in ``[0, 255]``, or PIL images
(converted to RGB). A float image in ``[0, 1]`` cannot be told apart: convert it first (``2 * x - 1``).
"""

from __future__ import annotations

import functools
import os
from typing import Any, Optional, Sequence, Union

import torch
from torch import Tensor

Images = Union[Tensor, Sequence[Any]]
_RANGE_TOLERANCE = 1e-3


def _pooled(output: Any) -> Tensor:
    return output if isinstance(output, Tensor) else output.pooler_output


class FeatureModel(torch.nn.Module):
    """A CLIP whose ``get_image_features`` / ``get_text_features`` return the projected feature tensors
    (what torchmetrics expects), whichever transformers version made it; ``config`` is the model's."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model
        self.config = model.config

    def get_image_features(self, pixel_values: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        return _pooled(self.model.get_image_features(pixel_values, *args, **kwargs))

    def get_text_features(self, input_ids: Tensor, attention_mask: Optional[Tensor] = None, *args: Any,
                          **kwargs: Any) -> Tensor:
        return _pooled(self.model.get_text_features(input_ids, attention_mask, *args, **kwargs))


def to_uint8(images: Images, device: Union[str, torch.device] = "cpu") -> list[Tensor]:
    """``images`` (module docstring) as uint8 ``[3, H, W]`` tensors on ``device``; ValueError naming ``images``."""
    if isinstance(images, Tensor):
        if images.dim() != 4:
            raise ValueError(f"images as one tensor must be [B, 3, H, W], got shape {tuple(images.shape)}")
        images = list(images)
    if not isinstance(images, (list, tuple)) or not images:
        raise ValueError(f"images must be a [B, 3, H, W] tensor or a non-empty list of images, got {type(images).__name__}")
    out = []
    for i, image in enumerate(images):
        if not isinstance(image, Tensor):
            try:
                from PIL import Image
            except ImportError:  # pragma: no cover - PIL comes with transformers' image processors
                Image = None
            if Image is None or not isinstance(image, Image.Image):
                raise ValueError(f"images[{i}] must be a tensor or a PIL image, got {type(image).__name__}")
            import numpy as np

            image = torch.from_numpy(np.array(image.convert("RGB"))).permute(2, 0, 1)
        if image.dim() != 3 or image.shape[0] != 3 or min(image.shape[1:]) < 1:
            raise ValueError(f"images[{i}] must be [3, H, W], got shape {tuple(image.shape)}")
        if image.dtype == torch.uint8:
            out.append(image.to(device))
            continue
        if not image.is_floating_point():
            raise ValueError(f"images[{i}] must be uint8 or floating point, got {image.dtype}")
        lo, hi = float(image.min()), float(image.max())
        if not (-1 - _RANGE_TOLERANCE <= lo and hi <= 1 + _RANGE_TOLERANCE):  # also catches NaN
            raise ValueError(f"images[{i}] is floating point, so it must lie in [-1, 1]; got values in [{lo:.3g}, {hi:.3g}]")
        out.append(((image.detach().float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).to(device))
    return out


def _check(images: Images, captions: Sequence[str], model: Any, processor: Any) -> tuple[list[Tensor], list[str]]:
    if not (hasattr(model, "get_image_features") and hasattr(model, "get_text_features") and hasattr(model, "config")):
        raise ValueError(f"model must be a CLIP-like model (get_image_features, get_text_features, config), "
                         f"got {type(model).__name__}")
    if not callable(processor):
        raise ValueError(f"processor must be a CLIPProcessor-like callable (images=..., text=...), got {type(processor).__name__}")
    if isinstance(captions, str) or not isinstance(captions, (list, tuple)) or not all(isinstance(c, str) for c in captions):
        raise ValueError("captions must be a list of str")
    device = next(model.parameters()).device  # torchmetrics moves the model to the images' device: keep it there
    uint8 = to_uint8(images, device)
    if len(uint8) != len(captions):
        raise ValueError(f"images and captions must have the same length, got {len(uint8)} images and {len(captions)} captions")
    return uint8, list(captions)


@functools.cache
def backend() -> str:
    """``"torchmetrics <version>"`` when the installed torchmetrics' ``CLIPScore`` takes a custom model (a
    callable returning ``(model, processor)``), else ``"manual"``."""
    try:
        import torchmetrics
        from torchmetrics.multimodal.clip_score import CLIPScore
    except ImportError:
        return "manual"
    try:
        CLIPScore(model_name_or_path=lambda: (None, None))
    except (TypeError, ValueError, ModuleNotFoundError):  # older versions test `"openai" in model_name_or_path`
        return "manual"
    return f"torchmetrics {torchmetrics.__version__}"


def _cosines(images: list[Tensor], captions: list[str], model: FeatureModel, processor: Any) -> Tensor:
    """Per-pair cosines with torchmetrics' processor calls (the fallback path)."""
    device = images[0].device
    pixels = processor(images=[i.cpu() for i in images], return_tensors="pt", padding=True)["pixel_values"]
    text = processor(text=captions, return_tensors="pt", padding=True)
    x = model.get_image_features(pixels.to(device))
    y = model.get_text_features(text["input_ids"].to(device), text["attention_mask"].to(device))
    return torch.nn.functional.cosine_similarity(x, y, dim=-1).cpu()


class _EvalMode:
    def __init__(self, model: torch.nn.Module):
        self.model, self.training = model, model.training

    def __enter__(self) -> None:
        self.model.eval()

    def __exit__(self, *exc: Any) -> None:
        self.model.train(self.training)


@torch.no_grad()
def clip_score(images: Images, captions: Sequence[str], model: torch.nn.Module, processor: Any,
               batch_size: int = 64) -> float:
    """torchmetrics' ``CLIPScore`` of the pairs ``(images[i], captions[i])``: ``max(100 * mean_i cos_i, 0)``
    (module docstring), fed ``batch_size`` pairs per update. ``model`` is a ``CLIPModel`` (kept on its device,
    run in eval mode), ``processor`` its ``CLIPProcessor`` or an object that is called the same way."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    uint8, captions = _check(images, captions, model, processor)
    features = FeatureModel(model)
    with _EvalMode(model):
        if backend() == "manual":
            return float(max(100 * _cosines(uint8, captions, features, processor).mean(), 0.0))
        from torchmetrics.multimodal.clip_score import CLIPScore

        metric = CLIPScore(model_name_or_path=lambda: (features, processor))
        for lo in range(0, len(uint8), batch_size):
            metric.update(uint8[lo : lo + batch_size], captions[lo : lo + batch_size])
        return float(metric.compute())


@torch.no_grad()
def clip_cosines(images: Images, captions: Sequence[str], model: torch.nn.Module, processor: Any,
                 batch_size: int = 64) -> Tensor:
    """Per-pair cosines ``cos(E_I, E_C)`` (float64 ``[N]``, CPU), ``batch_size`` pairs per forward, with the processor
    calls torchmetrics makes; ``max(100 * mean, 0)`` of them is :func:`clip_score`."""
    uint8, captions = _check(images, captions, model, processor)
    features = FeatureModel(model)
    with _EvalMode(model):
        return torch.cat([_cosines(uint8[lo : lo + batch_size], captions[lo : lo + batch_size], features, processor)
                          for lo in range(0, len(uint8), batch_size)]).double()


@torch.no_grad()
def clip_scores(images: Images, captions: Sequence[str], model: torch.nn.Module, processor: Any) -> Tensor:
    """Per-image CLIPScores ``100 * max(cos_i, 0)`` (float32 ``[N]``, CPU): torchmetrics' functional
    ``clip_score`` on each pair alone; their mean is Hessel et al.'s corpus-level CLIP-S."""
    uint8, captions = _check(images, captions, model, processor)
    features = FeatureModel(model)
    with _EvalMode(model):
        if backend() == "manual":
            return (100 * _cosines(uint8, captions, features, processor)).clamp(min=0).float()
        from torchmetrics.functional.multimodal.clip_score import clip_score as tm_clip_score

        return torch.stack([tm_clip_score(image, caption, model_name_or_path=lambda: (features, processor)).cpu()
                            for image, caption in zip(uint8, captions)]).float()


def load_clip(path: Union[str, os.PathLike]) -> tuple[torch.nn.Module, Any]:
    """``(CLIPModel in eval mode, CLIPProcessor)`` from a folder saved by the tiny-t2i CLIP trainer (or any CLIP folder)."""
    from transformers import CLIPModel, CLIPProcessor

    path = os.fspath(path)
    if not os.path.isdir(path):
        raise ValueError(f"path must be a folder with a saved CLIPModel and CLIPProcessor, got {path!r}")
    return CLIPModel.from_pretrained(path).eval(), CLIPProcessor.from_pretrained(path)
