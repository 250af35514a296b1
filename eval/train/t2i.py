"""Training tiny-t2i: a unified-token text-to-image decoder (transformers' Chameleon architecture) over captioned
scenes (:mod:`vispec.eval.bench.scenes`) and the VQ tokens of their images.

Vocabulary (:func:`t2i_vocabulary`): the caption tokenizer's words and specials, then image start, image end,
end of row, the resolution tokens (``n`` = pixels / 16, ``n`` in 0..8) and the VQ codes. A training sequence
is the caption (dropped with probability ``caption_dropout``, so the unconditional branch of classifier-free
guidance sees the image prefix alone, as Lumina-mGPT 2.0's guidance does), then ``[image start, res(H),
res(W)]``, then the rows: ``W / d`` codes and the end-of-row token each (``d`` the VQ's downsampling, 4 for the
shipped model). The objective is next-token
cross-entropy over the rows only, with logits over the codes and the end-of-row token (the head rows
the decoders use; :func:`vispec.models.unified.lm_head_backbone`). Both scene sizes are trained, one size per
batch; captions are left-padded with position ids counted from each caption's first token, so a prompt sits
at positions ``0..`` as at inference. ``init_from`` continues a trained tiny-t2i (same VQ, same architecture) on a
fresh draw of scenes (another ``seed``) with a new warm-up and cosine schedule; its record keeps the parent's
and its folder the parent's loss log, one stage back (:func:`parent_history`, :func:`with_parent`).
"""

from __future__ import annotations

import json
import os
import shutil
import time

import torch
import torch.nn.functional as F
from diffusers import VQModel
from tqdm.auto import tqdm

from vispec.eval.bench.scenes import CAPTION_WORDS, DEFAULT_SIZES, SceneSampler
from vispec.eval.train.common import adamw, fit, warmup_cosine, write_record
from vispec.eval.train.configs import T2ITrainConfig  # its home: torch-free, for the CLI (re-exported here)
from vispec.models.checkpoints import diffusers_load_kwargs
from vispec.models.llamagen_vq import encode_to_tokens

RESOLUTION_UNIT = 16  # pixels per resolution-token step
MAX_RESOLUTION = 8  # resolution tokens for n = 0 .. 8 (up to 128 pixels)


def caption_tokenizer():
    """The word-level tokenizer of the scene captions."""
    from vispec.eval.train.tokenizer import train_word_tokenizer

    return train_word_tokenizer([" ".join(CAPTION_WORDS)])


def t2i_vocabulary(tokenizer, num_codes: int) -> dict[str, int]:
    """The ids of tiny-t2i's layout tokens after the tokenizer's (module docstring)."""
    text = len(tokenizer)
    return {"image_start": text, "image_end": text + 1, "end_of_row": text + 2, "resolution_base": text + 3,
            "code_offset": text + 4 + MAX_RESOLUTION, "vocab_size": text + 4 + MAX_RESOLUTION + num_codes}


def build_chameleon(cfg: T2ITrainConfig, vocab_size: int, tokenizer):
    from transformers import ChameleonConfig, ChameleonForConditionalGeneration

    config = ChameleonConfig(
        vocab_size=vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.hidden_size * 11 // 4,
        num_hidden_layers=cfg.layers, num_attention_heads=cfg.heads, num_key_value_heads=cfg.heads,
        max_position_embeddings=512, vocabulary_map={"<image>": tokenizer.unk_token_id}, image_token_id=tokenizer.unk_token_id,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        vq_config={"embed_dim": 8, "num_embeddings": 16, "latent_channels": 8, "base_channels": 32,  # unused encoder
                   "channel_multiplier": [1, 1], "resolution": 16, "in_channels": 3, "out_channels": 3,
                   "num_res_blocks": 1, "attn_resolutions": []},
    )
    config._attn_implementation = "eager"  # faster than SDPA for these short sequences on CPU
    return ChameleonForConditionalGeneration(config)


@torch.no_grad()
def make_scene_dataset(vq: VQModel, tokenizer, count: int, seed: int, batch: int = 256) -> dict:
    """Per scene size: codes ``int16 [n, h, w]`` and caption ids (lists), from training scenes."""
    data: dict = {}
    per_size = count // len(DEFAULT_SIZES)
    for i, size in enumerate(DEFAULT_SIZES):
        sampler = SceneSampler("train", seed=seed + i, sizes=(size,))
        codes, captions = [], []
        for lo in tqdm(range(0, per_size, batch), desc=f"tokenise scenes {size[0]}x{size[1]}", mininterval=5):
            scenes = sampler.sample(min(batch, per_size - lo))
            images = torch.stack(scenes.images)
            codes.append(encode_to_tokens(vq, images).to(torch.int16))
            captions += [list(ids) for ids in tokenizer(list(scenes.captions))["input_ids"]]
        data[size] = {"codes": torch.cat(codes), "captions": captions}
    return data


def image_rows(codes: torch.Tensor, vocab: dict[str, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(model ids [B, N], decoder targets [B, N])`` of code grids ``[B, h, w]``: each row then end of row; targets
    in the decoder vocabulary (codes, ``num_codes`` for end of row)."""
    b, h, w = codes.shape
    num_codes = vocab["vocab_size"] - vocab["code_offset"]
    targets = torch.cat([codes.long(), torch.full((b, h, 1), num_codes, dtype=torch.long)], dim=2).view(b, -1)
    ids = torch.where(targets == num_codes, vocab["end_of_row"], targets + vocab["code_offset"])
    return ids, targets


def batch_sequences(captions: list[list[int]], codes: torch.Tensor, size: tuple[int, int], vocab: dict[str, int],
                    pad_id: int, drop: torch.Tensor) -> dict[str, torch.Tensor]:
    """Left-padded inputs of one size: caption (none where ``drop``), image prefix, rows but the last token."""
    prefix = [vocab["image_start"], vocab["resolution_base"] + size[0] // RESOLUTION_UNIT,
              vocab["resolution_base"] + size[1] // RESOLUTION_UNIT]
    prompts = [([] if d else c) + prefix for c, d in zip(captions, drop.tolist())]
    longest = max(len(p) for p in prompts)
    ids, targets = image_rows(codes, vocab)
    prompt_ids = torch.full((len(prompts), longest), pad_id, dtype=torch.long)
    mask = torch.zeros(len(prompts), longest, dtype=torch.long)
    for i, p in enumerate(prompts):
        prompt_ids[i, longest - len(p):] = torch.tensor(p)
        mask[i, longest - len(p):] = 1
    inputs = torch.cat([prompt_ids, ids[:, :-1]], dim=1)
    attention = torch.cat([mask, torch.ones_like(ids[:, :-1])], dim=1)
    positions = (attention.cumsum(1) - 1).clamp(min=0)
    return {"input_ids": inputs, "attention_mask": attention, "position_ids": positions, "targets": targets,
            "first": torch.tensor(longest - 1)}


def row_logits(model, batch: dict[str, torch.Tensor], head_ids: torch.Tensor) -> torch.Tensor:
    """Logits ``[B, N, V]`` of the rows over the decoder vocabulary (codes, end of row)."""
    hidden = model.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                         position_ids=batch["position_ids"]).last_hidden_state
    hidden = hidden[:, int(batch["first"]):]
    return F.linear(hidden, model.lm_head.weight[head_ids])


def load_t2i(name_or_path: str):
    """``(transformer, tokenizer, vocabulary, vqvae folder)`` of a tiny-t2i pipeline folder or embedded name."""
    from transformers import ChameleonForConditionalGeneration, PreTrainedTokenizerFast

    from vispec.pipelines.embedded import resolve_model_path

    folder = resolve_model_path(name_or_path)
    with open(os.path.join(folder, "model_index.json")) as handle:
        index = json.load(handle)
    t2i = ChameleonForConditionalGeneration.from_pretrained(os.path.join(folder, "transformer")).eval()
    tokenizer = PreTrainedTokenizerFast.from_pretrained(os.path.join(folder, "tokenizer"))
    vocab = {"image_start": index["image_start_id"], "image_end": index["image_end_ids"][0], "end_of_row": index["eol_id"],
             "resolution_base": index["resolution_token_base"], "code_offset": index["code_offset"],
             "vocab_size": index["code_offset"] + index["num_codes"]}
    return t2i, tokenizer, vocab, folder


def continued_model(cfg: T2ITrainConfig, vocab: dict[str, int]):
    """The decoder of ``cfg.init_from`` to continue training (its architecture and code count were checked by
    ``cfg.validate``); its token layout must be the one :func:`t2i_vocabulary` gives for ``cfg.vq``'s codes."""
    model, _, old_vocab, _ = load_t2i(cfg.init_from)
    if old_vocab != vocab:
        raise ValueError(f"init_from {cfg.init_from!r} has the token layout {old_vocab}, but the caption tokenizer and "
                         f"the VQ give {vocab}")
    model.config._attn_implementation = "eager"
    return model


def parent_history(init_from: str, out: str) -> dict:
    """The decoder record of the pipeline ``init_from`` (the ``transformer`` entry of its card's record,
    :func:`vispec.eval.train.assemble.read_card_record`; ``{}`` when it has none), and its decoder loss log
    (``logs/transformer.jsonl``) copied to ``out/init_from_log.jsonl``, so that a continued run's card shows every stage
    it was trained through."""
    from vispec.eval.train.assemble import read_card_record
    from vispec.pipelines.embedded import resolve_model_path

    folder = resolve_model_path(init_from)
    log = os.path.join(folder, "logs", "transformer.jsonl")
    if os.path.isfile(log):
        shutil.copy(log, os.path.join(out, "init_from_log.jsonl"))
    return read_card_record(folder).get("transformer", {})


def with_parent(metrics: dict, parent: dict) -> dict:
    """``metrics`` plus ``init_from_record`` (the parent's record) and ``total_train_minutes`` over every stage."""
    if not parent:
        return metrics
    before = parent.get("metrics", {})
    total = before.get("total_train_minutes", before.get("train_minutes", 0.0)) + metrics["train_minutes"]
    return {**metrics, "total_train_minutes": round(total, 1), "init_from_record": parent}


def train_t2i(cfg: T2ITrainConfig) -> dict:
    cfg.validate()
    torch.manual_seed(cfg.seed)
    vq = VQModel.from_pretrained(cfg.vq, **diffusers_load_kwargs()).eval()
    tokenizer = caption_tokenizer()
    num_codes = vq.config.num_vq_embeddings
    vocab = t2i_vocabulary(tokenizer, num_codes)
    model = (continued_model(cfg, vocab) if cfg.init_from else build_chameleon(cfg, vocab["vocab_size"], tokenizer)).train()
    os.makedirs(cfg.out, exist_ok=True)
    cache = os.path.join(cfg.out, f"scenes_{cfg.num_sequences}_{cfg.seed}.pt")
    if os.path.exists(cache):
        data = {tuple(k): v for k, v in torch.load(cache, weights_only=False)}
    else:
        data = make_scene_dataset(vq, tokenizer, cfg.num_sequences, cfg.seed)
        torch.save(list(data.items()), cache)
    head_ids = torch.cat([torch.arange(num_codes) + vocab["code_offset"], torch.tensor([vocab["end_of_row"]])])
    opt = adamw(model, cfg.lr, cfg.weight_decay)
    sched = warmup_cosine(opt, cfg.steps, warmup=cfg.warmup)
    gen = torch.Generator().manual_seed(cfg.seed)
    sizes = list(data)

    def step_loss(step: int):
        size = sizes[step % len(sizes)]
        part = data[size]
        pick = torch.randint(len(part["captions"]), (cfg.batch_size,), generator=gen)
        drop = torch.rand(cfg.batch_size, generator=gen) < cfg.caption_dropout
        batch = batch_sequences([part["captions"][i] for i in pick.tolist()], part["codes"][pick], size, vocab,
                                tokenizer.pad_token_id, drop)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.bf16):
            logits = row_logits(model, batch, head_ids)
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), batch["targets"].reshape(-1)), None

    start = time.time()
    last = fit(model, opt, sched, cfg.steps, step_loss, out=cfg.out, desc="train t2i", log_every=cfg.log_every)
    model.eval()
    metrics = {"train_minutes": round((time.time() - start) / 60, 1), "final_loss": last["loss"],
               "parameters": sum(p.numel() for n, p in model.named_parameters() if not n.startswith("model.vqmodel.")),
               "vocabulary": vocab}
    model.save_pretrained(cfg.out)
    tokenizer.save_pretrained(os.path.join(cfg.out, "tokenizer"))
    if cfg.init_from:
        metrics = with_parent(metrics, parent_history(cfg.init_from, cfg.out))
    write_record(cfg.out, cfg, metrics)
    return metrics

