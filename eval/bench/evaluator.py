"""The tiny-c2i evaluator: a small CNN classifier of 64x64 crops (class = source photo).

Two uses:

* class adherence: top-1 accuracy of the classifier on generated images;
* FID for this domain: its penultimate features are the feature extractor of torchmetrics'
  ``FrechetInceptionDistance(feature=<module>)`` (Inception weights cannot be downloaded here, and
  an ImageNet network would not see this domain well anyway). Numbers are comparable only with each
  other, never with Inception FID.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.models.modeling_utils import ModelMixin
from torch import Tensor, nn
from tqdm.auto import tqdm

from vispec.eval.training import warmup_cosine, write_record


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


@dataclass
class EvaluatorTrainConfig:
    out: str = "out/tiny-c2i/evaluator"
    steps: int = 1500
    batch_size: int = 32
    width: int = 16
    feature_dim: int = 128
    lr: float = 2e-3
    weight_decay: float = 0.05
    eval_images: int = 1400
    seed: int = 0
    log_every: int = 50


def train_evaluator(cfg: EvaluatorTrainConfig) -> dict:
    from vispec.eval.data import CropSampler, to_model_range

    torch.manual_seed(cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed)
    train, held_out = CropSampler("train"), CropSampler("eval")
    model = CropClassifier(num_classes=train.num_classes, width=cfg.width, feature_dim=cfg.feature_dim).train()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    sched = warmup_cosine(opt, cfg.steps, warmup=100)
    os.makedirs(cfg.out, exist_ok=True)
    start = time.time()
    with open(os.path.join(cfg.out, "train_log.jsonl"), "w") as log:
        for step in tqdm(range(cfg.steps), desc="train evaluator", mininterval=5):
            images, labels = train.sample(cfg.batch_size, gen)
            loss = F.cross_entropy(model(to_model_range(images)), labels, label_smoothing=0.05)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            if step % cfg.log_every == 0 or step == cfg.steps - 1:
                log.write(json.dumps({"step": step, "loss": loss.item(), "elapsed_s": round(time.time() - start, 1)}) + "\n")
                log.flush()
    model.eval()
    accuracy = classify_accuracy(model, *held_out.sample(cfg.eval_images, torch.Generator().manual_seed(cfg.seed + 1), labels=torch.arange(cfg.eval_images) % held_out.num_classes))
    metrics = {"train_minutes": round((time.time() - start) / 60, 1), "held_out_accuracy": accuracy, "held_out_images": cfg.eval_images}
    model.save_pretrained(cfg.out)
    write_record(cfg.out, cfg, metrics)
    return metrics


@torch.no_grad()
def classify_accuracy(model: CropClassifier, images: Tensor, labels: Tensor, batch: int = 256) -> float:
    """Top-1 accuracy on uint8 images."""
    correct = 0
    for lo in range(0, images.shape[0], batch):
        logits = model(images[lo : lo + batch].float() / 127.5 - 1.0)
        correct += int((logits.argmax(-1) == labels[lo : lo + batch]).sum())
    return correct / images.shape[0]
