"""Training the VQ tokenizers of the embedded models (LlamaGen VQ family at downsample 4 or 8, cosine codebook):
tiny-c2i's on photo crops (``data="photos"``), tiny-t2i's on captioned scenes (``data="scenes"``,
:mod:`vispec.eval.bench.scenes`, both aspect ratios; the convolutional VQ takes any multiple of its downsampling).

Objective (VQGAN without the adversarial and perceptual terms, which need pretrained networks we
cannot download; LlamaGen's codebook choices kept):

* encoder output ``z`` and codebook rows are L2-normalised; the code is ``argmax_k <z, e_k>``;
* loss = ``|x - x̂|_1 + |x - x̂|_2^2 + |sg(ẑ) - e|^2 + β |ẑ - sg(e)|^2`` with straight-through
  gradients (β = 0.25);
* codes unused for ``restart_every`` steps are re-seeded from random encoder outputs (keeps the
  1024-entry codebook in use).

The saved ``VQModel`` has the normalisation baked into its codebook, exactly like converted
LlamaGen checkpoints, so :func:`vispec.models.llamagen_vq.encode_to_tokens` / ``decode_tokens`` apply.
"""

from __future__ import annotations

import math
import os
import time

import torch
import torch.nn.functional as F
from diffusers import VQModel

from vispec.eval.bench.data import CropSampler, to_model_range
from vispec.eval.bench.scenes import DEFAULT_SIZES, SceneSampler
from vispec.eval.train.common import fit, warmup_cosine, write_record
from vispec.eval.train.configs import VQ_LEVELS, VQTrainConfig  # its home: torch-free, for the CLI (re-exported here)
from vispec.models.llamagen_vq import llamagen_vq_config


class SceneImages:
    """Scene images in [0, 255] with :class:`CropSampler`'s ``sample(count, gen)`` interface: each call draws one of
    the scene sizes (by ``gen``) and that many scenes of it, from a seeded stream per size."""

    def __init__(self, split: str, seed: int):
        self.samplers = [SceneSampler(split, seed=seed + i, sizes=(size,)) for i, size in enumerate(DEFAULT_SIZES)]

    def sample(self, count: int, gen: torch.Generator) -> tuple[torch.Tensor, None]:
        sampler = self.samplers[int(torch.randint(len(self.samplers), (1,), generator=gen))]
        images = torch.stack(sampler.sample(count).images)
        return ((images + 1) * 127.5).round(), None  # [0, 255], as to_model_range takes them


def image_sources(cfg: VQTrainConfig) -> tuple:
    """``(train, held-out)`` image samplers for ``cfg.data``."""
    if cfg.data == "photos":
        return CropSampler("train"), CropSampler("eval")
    if cfg.data == "scenes":
        return SceneImages("train", cfg.seed), SceneImages("test", cfg.seed + 100)
    raise ValueError(f"data must be 'photos' or 'scenes', got {cfg.data!r}")


def build_vq(cfg: VQTrainConfig) -> VQModel:
    """The LlamaGen VQ family at downsample 4 (three channel levels) or 8 (four), with ``cfg``'s widths."""
    kwargs = llamagen_vq_config(
        f"VQ-{VQ_LEVELS[len(cfg.channel_mult)]}", codebook_size=cfg.codebook_size, codebook_embed_dim=cfg.embed_dim, z_channels=cfg.z_channels,
        base_channels=cfg.base_channels,
    )
    kwargs.update(
        layers_per_block=cfg.layers_per_block, sample_size=64,
        block_out_channels=tuple(cfg.base_channels * m for m in cfg.channel_mult),
    )
    return VQModel(**kwargs)


def quantize(vq: VQModel, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(normalised z, straight-through quantised z, code indices)`` for images in [-1, 1]."""
    z = F.normalize(vq.quant_conv(vq.encoder(images)), dim=1)
    codebook = F.normalize(vq.quantize.embedding.weight, dim=1)
    b, d, h, w = z.shape
    flat = z.permute(0, 2, 3, 1).reshape(-1, d)
    codes = (flat @ codebook.T).argmax(dim=1)
    zq = codebook[codes].view(b, h, w, d).permute(0, 3, 1, 2)
    return z, zq, codes


def reconstruct(vq: VQModel, zq: torch.Tensor) -> torch.Tensor:
    return vq.decoder(vq.post_quant_conv(zq))


@torch.no_grad()
def evaluate(vq: VQModel, sampler: CropSampler, count: int, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    images = to_model_range(sampler.sample(count, gen)[0])
    _, zq, codes = quantize(vq, images)
    recon = reconstruct(vq, zq).clamp(-1, 1)
    mse = float(F.mse_loss(recon, images))
    counts = torch.bincount(codes, minlength=vq.config.num_vq_embeddings).double()
    probs = counts / counts.sum()
    perplexity = float(torch.exp(-(probs[probs > 0] * probs[probs > 0].log()).sum()))
    return {"psnr_db": 10 * math.log10(4.0 / mse), "codes_used": int((counts > 0).sum()), "perplexity": perplexity}


def train_vq(cfg: VQTrainConfig) -> dict:
    cfg.validate()
    torch.manual_seed(cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed)
    train, held_out = image_sources(cfg)
    vq = build_vq(cfg).train()
    opt = torch.optim.Adam(vq.parameters(), lr=cfg.lr, betas=(0.9, 0.95))
    sched = warmup_cosine(opt, cfg.steps, warmup=200)
    os.makedirs(cfg.out, exist_ok=True)
    last_used = torch.zeros(cfg.codebook_size, dtype=torch.long)
    batch: dict = {}  # this step's encoder outputs and codes, for the codebook restarts

    def step_loss(step: int):
        images = to_model_range(train.sample(cfg.batch_size, gen)[0])
        z, zq, codes = quantize(vq, images)
        recon = reconstruct(vq, z + (zq - z).detach())
        rec = F.l1_loss(recon, images) + F.mse_loss(recon, images)
        vq_loss = F.mse_loss(zq, z.detach()) + cfg.beta * F.mse_loss(z, zq.detach())
        batch.update(z=z.detach(), codes=codes)
        return rec + vq_loss, lambda: {"rec": rec.item(), "vq": vq_loss.item(), "codes_in_batch": int(codes.unique().numel())}

    def restart_dead_codes(step: int) -> None:
        last_used[batch["codes"].unique()] = step
        if cfg.restart_every and (step + 1) % cfg.restart_every == 0:
            dead = (step - last_used >= cfg.restart_every).nonzero().squeeze(1)
            if dead.numel():
                flat = batch["z"].permute(0, 2, 3, 1).reshape(-1, cfg.embed_dim)
                pick = torch.randint(0, flat.shape[0], (dead.numel(),), generator=gen)
                with torch.no_grad():
                    vq.quantize.embedding.weight[dead] = flat[pick] + 0.01 * torch.randn(dead.numel(), cfg.embed_dim, generator=gen)
                last_used[dead] = step

    start = time.time()
    fit(vq, opt, sched, cfg.steps, step_loss, out=cfg.out, desc="train vq", log_every=cfg.log_every, clip_norm=None,
        after_step=restart_dead_codes)
    vq.eval()
    with torch.no_grad():  # bake the cosine codebook in, as for converted LlamaGen checkpoints
        vq.quantize.embedding.weight.copy_(F.normalize(vq.quantize.embedding.weight, dim=1))
    metrics = {"train_minutes": round((time.time() - start) / 60, 1), "held_out": evaluate(vq, held_out, cfg.eval_images, cfg.seed + 1)}
    vq.save_pretrained(cfg.out)
    write_record(cfg.out, cfg, metrics)
    return metrics
