"""A tiny CLIP for the captioned scenes (:mod:`vispec.eval.bench.scenes`): trained here, scored with
:mod:`vispec.eval.bench.clip_score`. No pip package bundles CLIP weights, so tiny-t2i gets its own.

Model: a transformers ``CLIPModel`` (Radford et al. 2021, "Learning Transferable Visual Models From Natural
Language Supervision"): a ViT over ``image_size``-square inputs in ``patch_size`` patches and a causal text
transformer pooled at the EOS token, each projected to ``projection_dim``.

Inputs: captions go through the scene word tokenizer (:func:`~vispec.eval.train.tokenizer.train_word_tokenizer`
over :data:`~vispec.eval.bench.scenes.CAPTION_WORDS`) with ``BOS caption EOS`` added and right padding
(``text_length`` ids in training); right padding plus causal attention makes the EOS feature independent of
the padded length. Images go through a ``CLIPImageProcessor``: a bicubic resize of the whole image to
``image_size`` x ``image_size`` (no crop), then ``(x / 255 - 0.5) / 0.5``, which is the scenes' own ``[-1, 1]``
range. The 64x96 scenes are thus squeezed to 64x64 (objects 2/3 as wide): every object, its count and
its left/right order survive, whereas a centre crop (what real CLIP processors do) can cut off the
objects that lie near the border (scenes keep only ``0.03 m`` of margin); padding to a square would
shrink every object of the 64x96 scenes to 2/3 in both directions. Model and processor are saved together
(``save_pretrained``), so ``CLIPModel.from_pretrained(out)`` and ``CLIPProcessor.from_pretrained(out)``
load them with transformers alone.

Objective (:func:`contrastive_loss`): symmetric InfoNCE over a batch of ``B`` pairs plus ``K`` hard-negative
captions. With ``x_i``, ``y_j`` the unit-normalised image and text embeddings and ``s_ij = exp(t) x_i . y_j``
(``t`` the learnt log temperature ``logit_scale``, clamped to ``log 100`` as in CLIP)::

    L_i2t = -1/B sum_i log( exp(s_ii) / sum_{j < B + K} exp(s_ij) )     texts: the B captions, then the K negatives
    L_t2i = -1/B sum_i log( exp(s_ii) / sum_{j < B} exp(s_ji) )         images: the B images
    L = (L_i2t + L_t2i) / 2

Pairs where a caption also describes another image of the batch (same or compatible caption, e.g. "a red
circle" for a scene of "a large red circle", :func:`caption_fits`) are left out of the sums (false
negatives). Hard negatives (NegCLIP: Yuksekgonul et al. 2023, "When and Why Vision-Language Models Behave
like Bags-of-Words"): for each caption and each kind in ``hard_negatives``, one random caption of
:func:`caption_swaps` (one attribute changed: an object's colour or shape, the count, the relation's
direction; optionally a stated size) joins the text side; only the image side sees them. With
``negatives_train_only`` they are drawn among train-split compositions only, so no test composition's text
is seen in training.

Speed (defaults: 1.26M parameters, about 27 GFLOP per step of 64 images and ~245 texts, 2 CPU cores shared
with two other jobs, load average 4-5): 0.60 s per step with one thread (0.50 s of CPU time per step, so
about 0.5 s on an idle core), 4.4 s per step with two threads (OpenMP threads stall on busy cores). Hence
``threads = 1`` and 1500 steps: about 12.5 minutes idle, 15 minutes on shared cores, plus ~10 s of
evaluation. A 150-step run already reached R@1 0.33 / 0.36 among 200 test scenes and separated colour swaps.
"""

from __future__ import annotations

import functools
import math
import os
import time
from typing import Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from vispec.eval.bench.scenes import (CAPTION_WORDS, COLOURS, NUMBERS, SHAPES, SIZES, Scene, SceneSampler,
                                      format_caption, parse_caption, split_of)
from vispec.eval.train.common import adamw, fit, warmup_cosine, write_record
from vispec.eval.train.configs import SWAP_KINDS, CLIPTrainConfig  # their home: torch-free, for the CLI (re-exported here)

OPPOSITE = {"left of": "right of", "right of": "left of", "above": "below", "below": "above"}
MAX_LOGIT_SCALE = math.log(100.0)
_parse = functools.lru_cache(maxsize=None)(parse_caption)  # read-only results: callers copy before changing


# ------------------------------------------------------------------------------------------ hard negatives
def caption_swaps(caption: str, kind: str) -> list[str]:
    """Every grammatical caption that differs from ``caption`` in exactly one attribute of kind ``kind``:

    ``colour`` / ``shape``: one object's colour / shape replaced (related objects must stay distinct);
    ``count``: another number (counted captions); ``relation``: the opposite direction, same objects
    (related captions); ``size``: a stated size flipped. Empty where the kind does not apply.
    """
    if kind not in SWAP_KINDS:
        raise ValueError(f"kind must be one of {SWAP_KINDS}, got {kind!r}")
    parsed = _parse(caption)
    variants: list[dict] = []
    if kind == "count" and parsed["count"] is not None:
        variants = [{**parsed, "count": n} for n in NUMBERS.values() if n != parsed["count"]]
    elif kind == "relation" and parsed["relation"] is not None:
        variants = [{**parsed, "relation": OPPOSITE[parsed["relation"]]}]
    elif kind in ("colour", "shape", "size"):
        key, values = {"colour": ("colour", COLOURS), "shape": ("shape", SHAPES), "size": ("size", SIZES)}[kind]
        for i, obj in enumerate(parsed["objects"]):
            if obj[key] is None:  # size not stated: nothing to flip
                continue
            for value in values:
                if value != obj[key]:
                    objects = [dict(o) for o in parsed["objects"]]
                    objects[i][key] = value
                    variants.append({**parsed, "objects": objects})
    out = []
    for variant in variants:
        try:
            out.append(format_caption(variant))
        except ValueError:  # two related objects of the same kind
            pass
    return out


def hard_negative(caption: str, kind: str, rng: np.random.Generator, train_only: bool = False) -> Optional[str]:
    """One random caption of :func:`caption_swaps` (train-split compositions only with ``train_only``); None if none."""
    swaps = _candidates(caption, kind, train_only)
    return swaps[int(rng.integers(len(swaps)))] if swaps else None


@functools.lru_cache(maxsize=None)
def _candidates(caption: str, kind: str, train_only: bool) -> tuple[str, ...]:
    return tuple(s for s in caption_swaps(caption, kind) if not train_only or split_of(s) == "train")


def caption_fits(caption: str, scene: Scene) -> bool:
    """Whether ``caption`` is true of ``scene``: same count or relation (either phrasing), colours and shapes,
    and each stated size (an unstated one fits any size)."""
    def fits(phrase: dict, obj) -> bool:
        return (phrase["colour"], phrase["shape"]) == (obj.colour, obj.shape) and phrase["size"] in (None, obj.size)

    parsed = _parse(caption)
    if parsed["count"] is not None:
        return scene.count == parsed["count"] and all(fits(parsed["objects"][0], o) for o in scene.objects)
    if scene.relation is None:
        return False
    a, b = scene.objects[:2]
    pairs = {scene.relation: (a, b), OPPOSITE[scene.relation]: (b, a)}
    if parsed["relation"] not in pairs:
        return False
    first, second = pairs[parsed["relation"]]
    return fits(parsed["objects"][0], first) and fits(parsed["objects"][1], second)


# ------------------------------------------------------------------------------------------------- loss
def contrastive_loss(image_embeds: Tensor, text_embeds: Tensor, logit_scale: Tensor,
                     ignore: Optional[Tensor] = None) -> Tensor:
    """Symmetric InfoNCE (module docstring) of ``image_embeds [B, D]`` against ``text_embeds [B + K, D]``.

    Text ``i < B`` is image ``i``'s caption, texts ``B..`` are extra negatives for the image side only;
    ``logit_scale`` is the log inverse temperature (``CLIPModel.logit_scale``); ``ignore [B, B + K]`` (bool)
    marks the image-text pairs to leave out of both softmaxes (never the diagonal)."""
    if image_embeds.dim() != 2 or text_embeds.dim() != 2 or image_embeds.shape[1] != text_embeds.shape[1]:
        raise ValueError(f"image_embeds and text_embeds must be [B, D] and [T, D], got {tuple(image_embeds.shape)} "
                         f"and {tuple(text_embeds.shape)}")
    b = image_embeds.shape[0]
    if b == 0 or text_embeds.shape[0] < b:
        raise ValueError(f"text_embeds needs at least one text per image ({b}), got {text_embeds.shape[0]}")
    logits = logit_scale.exp() * F.normalize(image_embeds, dim=-1) @ F.normalize(text_embeds, dim=-1).T
    if ignore is not None:
        if ignore.shape != logits.shape or ignore.dtype != torch.bool:
            raise ValueError(f"ignore must be a bool tensor of shape {tuple(logits.shape)}, got {ignore.dtype} "
                             f"{tuple(ignore.shape)}")
        if ignore.diagonal().any():
            raise ValueError("ignore must not mark a matching pair (its diagonal)")
        logits = logits.masked_fill(ignore, float("-inf"))
    labels = torch.arange(b, device=logits.device)
    return (F.cross_entropy(logits, labels) + F.cross_entropy(logits[:, :b].T, labels)) / 2


# ------------------------------------------------------------------------------------- model and processor
def clip_tokenizer(text_length: int = 12):
    """The scene word tokenizer with ``BOS ... EOS`` added to every caption, right padding, ``text_length`` long."""
    from tokenizers.processors import TemplateProcessing

    from vispec.eval.train.tokenizer import train_word_tokenizer

    tokenizer = train_word_tokenizer([" ".join(CAPTION_WORDS)])
    bos, eos = tokenizer.bos_token, tokenizer.eos_token
    tokenizer.backend_tokenizer.post_processor = TemplateProcessing(
        single=f"{bos} $A {eos}", special_tokens=[(bos, tokenizer.bos_token_id), (eos, tokenizer.eos_token_id)])
    tokenizer.padding_side = "right"
    tokenizer.model_max_length = text_length
    return tokenizer


def clip_processor(tokenizer, image_size: int = 64):
    """A ``CLIPProcessor``: ``tokenizer`` and a whole-image bicubic resize to ``image_size`` square into ``[-1, 1]``."""
    from transformers import CLIPProcessor

    try:  # transformers 5 without torchvision: the PIL backend (what CLIPImageProcessor falls back to)
        from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil as ImageProcessor
    except ImportError:  # pragma: no cover - transformers 4
        from transformers import CLIPImageProcessor as ImageProcessor
    images = ImageProcessor(do_resize=True, size={"height": image_size, "width": image_size}, do_center_crop=False,
                            do_rescale=True, rescale_factor=1 / 255, do_normalize=True, image_mean=[0.5] * 3,
                            image_std=[0.5] * 3, do_convert_rgb=False)
    return CLIPProcessor(image_processor=images, tokenizer=tokenizer)


def build_clip(cfg: CLIPTrainConfig, tokenizer):
    """A randomly initialised ``CLIPModel`` of ``cfg``'s sizes over ``tokenizer``'s vocabulary."""
    from transformers import CLIPConfig, CLIPModel, CLIPTextConfig, CLIPVisionConfig

    if cfg.image_size % cfg.patch_size:
        raise ValueError(f"image_size ({cfg.image_size}) must be a multiple of patch_size ({cfg.patch_size})")
    common = dict(hidden_size=cfg.hidden_size, intermediate_size=4 * cfg.hidden_size, num_attention_heads=cfg.heads,
                  projection_dim=cfg.projection_dim)
    text = CLIPTextConfig(vocab_size=len(tokenizer), num_hidden_layers=cfg.text_layers,
                          max_position_embeddings=cfg.text_length, pad_token_id=tokenizer.pad_token_id,
                          bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, **common)
    vision = CLIPVisionConfig(num_hidden_layers=cfg.vision_layers, image_size=cfg.image_size,
                              patch_size=cfg.patch_size, **common)
    config = CLIPConfig(text_config=text.to_dict(), vision_config=vision.to_dict(), projection_dim=cfg.projection_dim)
    return CLIPModel(config)


def pooled(output) -> Tensor:
    """The projected features of ``get_image_features`` / ``get_text_features``: a tensor in transformers 4,
    the ``pooler_output`` of a model output in transformers 5."""
    return output if isinstance(output, Tensor) else output.pooler_output


def scene_pixels(images: Sequence[Tensor], processor) -> Tensor:
    """``pixel_values [B, 3, S, S]`` of scene images (``[3, H, W]`` floats in ``[-1, 1]``) through ``processor``."""
    uint8 = [((image.detach().cpu().float() + 1) * 127.5).round().clamp(0, 255).to(torch.uint8) for image in images]
    return processor(images=uint8, return_tensors="pt")["pixel_values"]


def embed(model, processor, images: Sequence[Tensor] = (), texts: Sequence[str] = ()) -> tuple[Tensor, Tensor]:
    """Unit-normalised ``(image embeddings [N, D], text embeddings [M, D])`` (either may be empty)."""
    device = model.logit_scale.device
    dim = model.config.projection_dim
    x = y = torch.zeros(0, dim, device=device)
    if len(images):
        x = pooled(model.get_image_features(pixel_values=scene_pixels(images, processor).to(device)))
    if len(texts):
        tokens = processor.tokenizer(list(texts), padding=True, return_tensors="pt").to(device)
        y = pooled(model.get_text_features(input_ids=tokens["input_ids"], attention_mask=tokens["attention_mask"]))
    return F.normalize(x, dim=-1), F.normalize(y, dim=-1)


# --------------------------------------------------------------------------------------------- training
def batch_texts(captions: list[str], kinds: Sequence[str], rng: np.random.Generator,
                train_only: bool) -> list[str]:
    """The captions, then one hard negative per caption and kind (where one exists)."""
    negatives = [hard_negative(c, k, rng, train_only) for c in captions for k in kinds]
    return captions + [n for n in negatives if n is not None]


def false_negatives(scenes: Sequence[Scene], texts: Sequence[str]) -> Tensor:
    """``[B, T]`` bool: text ``t`` is true of scene ``i`` though it is not its caption (``t != i``)."""
    mask = torch.tensor([[caption_fits(t, s) for t in texts] for s in scenes], dtype=torch.bool)
    mask[:, : len(scenes)].fill_diagonal_(False)
    return mask


def train_clip(cfg: CLIPTrainConfig) -> dict:
    """Train the tiny CLIP on fresh train-split scenes each step; evaluate on test scenes; save model and processor."""
    cfg.validate()
    if cfg.threads > 0:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    processor = clip_processor(clip_tokenizer(cfg.text_length), cfg.image_size)
    model = build_clip(cfg, processor.tokenizer).train()
    opt = adamw(model, cfg.lr, cfg.weight_decay)
    sched = warmup_cosine(opt, cfg.steps, warmup=max(1, min(cfg.warmup, cfg.steps)), floor=0.1)
    sampler = SceneSampler("train", seed=cfg.seed)
    rng = np.random.default_rng(cfg.seed)
    os.makedirs(cfg.out, exist_ok=True)

    def step_loss(step: int):
        batch = sampler.sample(cfg.batch_size)
        texts = batch_texts(list(batch.captions), cfg.hard_negatives, rng, cfg.negatives_train_only)
        tokens = processor.tokenizer(texts, padding="max_length", max_length=cfg.text_length, return_tensors="pt")
        x = pooled(model.get_image_features(pixel_values=scene_pixels(batch.images, processor)))
        y = pooled(model.get_text_features(input_ids=tokens["input_ids"], attention_mask=tokens["attention_mask"]))
        loss = contrastive_loss(x, y, model.logit_scale, false_negatives(batch.scenes, texts))
        return loss, lambda: {"logit_scale": round(float(model.logit_scale.detach().exp()), 2), "texts": len(texts)}

    def clamp_scale(step: int) -> None:
        with torch.no_grad():
            model.logit_scale.clamp_(max=MAX_LOGIT_SCALE)

    start = time.time()
    last = fit(model, opt, sched, cfg.steps, step_loss, out=cfg.out, desc="train clip", log_every=cfg.log_every,
               after_step=clamp_scale)
    minutes = round((time.time() - start) / 60, 1)
    model.eval()
    metrics = {"train_minutes": minutes, "final_loss": last["loss"],
               "parameters": sum(p.numel() for p in model.parameters()),
               **evaluate_clip(model, processor, n=cfg.eval_candidates, seed=cfg.seed)}
    model.save_pretrained(cfg.out)
    processor.save_pretrained(cfg.out)
    write_record(cfg.out, cfg, metrics)
    return metrics


# ------------------------------------------------------------------------------------------- evaluation
@torch.no_grad()
def evaluate_clip(model, processor, n: int = 500, seed: int = 0, kinds: Sequence[str] = SWAP_KINDS) -> dict:
    """Held-out (test-split) metrics over ``n`` scenes of ``SceneSampler("test", seed)``.

    ``i2t_r1`` / ``t2i_r1``: retrieval recall at 1 among the ``n`` captions / images (a hit is any candidate
    with the query's caption, so repeated captions do not count against it; chance is about ``1/n``).
    For each kind of :func:`caption_swaps`: ``{kind}_win``, the fraction of the images it applies to whose
    true caption scores above every swapped caption of that kind; ``{kind}_pairwise``, the fraction of
    (image, swapped caption) pairs won (chance 0.5); ``{kind}_images``, how many images it applies to.
    ``processor`` is a ``CLIPProcessor``-like object (``.tokenizer``, ``__call__(images=...)``).
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 2:
        raise ValueError(f"n must be an int of at least 2, got {n!r}")
    bad = [k for k in kinds if k not in SWAP_KINDS]
    if bad:
        raise ValueError(f"kinds must be among {SWAP_KINDS}, got {bad}")
    was_training = model.training
    model.eval()
    batch = SceneSampler("test", seed=seed).sample(n)
    captions = list(batch.captions)
    swaps = {k: [caption_swaps(c, k) for c in captions] for k in kinds}
    texts = sorted(set(captions) | {s for per in swaps.values() for ss in per for s in ss})
    index = {t: i for i, t in enumerate(texts)}
    xs, ys = [], []
    for lo in range(0, n, 256):
        xs.append(embed(model, processor, images=batch.images[lo : lo + 256])[0])
    for lo in range(0, len(texts), 1024):
        ys.append(embed(model, processor, texts=texts[lo : lo + 1024])[1])
    x, y = torch.cat(xs), torch.cat(ys)
    scores = x @ y.T  # [n, texts]
    true = torch.tensor([index[c] for c in captions])
    pair = scores[:, true]  # [images, their captions]
    same = torch.tensor([[a == b for b in captions] for a in captions])
    rows = torch.arange(n)
    metrics = {"eval_scenes": n,
               "i2t_r1": round(float(same[rows, pair.argmax(1)].float().mean()), 4),
               "t2i_r1": round(float(same[pair.argmax(0), rows].float().mean()), 4)}
    for kind in kinds:
        wins, pairs, images = 0, [], 0
        for i, alternatives in enumerate(swaps[kind]):
            if alternatives:
                won = scores[i, true[i]] > scores[i, [index[s] for s in alternatives]]
                wins += bool(won.all())
                pairs.append(won.float())
                images += 1
        metrics[f"{kind}_win"] = round(wins / images, 4) if images else None
        metrics[f"{kind}_pairwise"] = round(float(torch.cat(pairs).mean()), 4) if images else None
        metrics[f"{kind}_images"] = images
    model.train(was_training)
    return metrics
