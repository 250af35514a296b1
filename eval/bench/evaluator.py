"""The tiny-c2i evaluator: a small CNN classifier of 64x64 crops (class = source photo).

Two uses:

* class adherence: top-1 accuracy of the classifier on generated images;
* FID for this domain: its penultimate features are the feature extractor of torchmetrics'
  ``FrechetInceptionDistance(feature=<module>)`` (Inception weights cannot be downloaded here, and
  an ImageNet network would not see this domain well anyway). Numbers are comparable only with each
  other, never with Inception FID.

Its trainer is :func:`vispec.eval.train.evaluator.train_evaluator`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.models.modeling_utils import ModelMixin
from torch import Tensor, nn


def _block(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.GroupNorm(8, cout), nn.SiLU(),
        nn.Conv2d(cout, cout, 3, padding=1, bias=False), nn.GroupNorm(8, cout), nn.SiLU(),
    )


class CropClassifier(ModelMixin, ConfigMixin):
    """Four conv stages (64 -> 8 pixels), global average pooling, a ``feature_dim`` embedding, a linear head.

    Input: images in ``[-1, 1]``, ``[B, 3, 64, 64]``. :meth:`features` returns the embedding used for FID.
    """

    @register_to_config
    def __init__(self, num_classes: int = 14, width: int = 32, feature_dim: int = 128):
        super().__init__()
        widths = (width, width * 2, width * 4, width * 4)
        stages, cin = [], 3
        for w in widths:
            stages.append(_block(cin, w))
            cin = w
        self.stages = nn.ModuleList(stages)
        self.embed = nn.Linear(cin, feature_dim)
        self.head = nn.Linear(feature_dim, num_classes)

    def features(self, images: Tensor) -> Tensor:
        h = images.to(self.embed.weight.dtype)
        for i, stage in enumerate(self.stages):
            h = stage(h)
            if i < len(self.stages) - 1:
                h = F.avg_pool2d(h, 2)
        return F.silu(self.embed(h.mean(dim=(2, 3))))

    def forward(self, images: Tensor) -> Tensor:
        return self.head(self.features(images))


class FIDFeatures(nn.Module):
    """Adapter for ``torchmetrics FrechetInceptionDistance(feature=...)``: uint8 ``[N, 3, H, W]`` in."""

    def __init__(self, classifier: CropClassifier):
        super().__init__()
        self.classifier = classifier
        self.num_features = classifier.config.feature_dim

    def forward(self, images: Tensor) -> Tensor:
        dtype = self.classifier.embed.weight.dtype  # follows fid.set_dtype
        return self.classifier.features(images.to(dtype) / 127.5 - 1.0)


@torch.no_grad()
def classify_accuracy(model: CropClassifier, images: Tensor, labels: Tensor, batch: int = 256) -> float:
    """Top-1 accuracy on uint8 images."""
    correct = 0
    for lo in range(0, images.shape[0], batch):
        logits = model(images[lo : lo + batch].float() / 127.5 - 1.0)
        correct += int((logits.argmax(-1) == labels[lo : lo + batch]).sum())
    return correct / images.shape[0]
