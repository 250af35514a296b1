"""Training tiny-edit: an instruction-based image editor (transformers' Chameleon architecture) fine-tuned from tiny-t2i
on scene pairs that differ in one stated attribute (:mod:`vispec.eval.bench.scene_edits`).

Sequence (Lumina-mGPT 2.0's dual-panel image-to-image layout): the instruction's word ids, then ``[image start,
res(2 H), res(W)]`` (the header declares twice the height: two panels stacked vertically), then the SOURCE panel's
rows (``W / d`` codes as ``code_offset + code``, ``d`` the VQ's downsampling, then end of row), then the TARGET panel's
rows in the same format, then image end. Both panels are 64 x 64 pixels: with the shipped downsample-4 VQ, 16 rows of
16 codes and the end-of-row token, 272 tokens each (:func:`panel_tokens`).
Classifier-free guidance starts at image start: the unconditional sequence drops the instruction only (it keeps the
source panel), so training drops the instruction with probability ``instruction_dropout``. The objective is
next-token cross-entropy over the target panel's rows only, with logits over the codes and the end-of-row token
(as :mod:`vispec.eval.train.t2i`); instructions are left-padded with position ids counted from the first real token.

Vocabulary (:func:`edit_vocabulary`, the layout of :func:`vispec.eval.train.t2i.t2i_vocabulary`): the words of a
new word-level tokenizer (:func:`edit_tokenizer`: the caption words plus the edit words "make", "move", "add", ...),
then image start, image end, end of row, the resolution tokens and the VQ codes. The model starts from tiny-t2i
(:func:`init_from_t2i`): every weight is copied, the embedding and LM-head rows by token meaning (the same word, the
same layout token, the same code), rows of words tiny-t2i lacks drawn at random; ``max_position_embeddings`` becomes
1024 (RoPE: no position table to grow). tiny-t2i's VQ is reused unchanged.
"""

from __future__ import annotations

import json
import os
import time
from typing import Optional

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from vispec.eval.bench.scene_edits import INSTRUCTION_WORDS, EditSampler, aligned_target_codes
from vispec.eval.train.common import adamw, write_record
from vispec.eval.train.configs import EditTrainConfig  # its home: torch-free, for the CLI (re-exported here)
from vispec.eval.train.t2i import MAX_RESOLUTION, RESOLUTION_UNIT, image_rows, load_t2i, t2i_vocabulary

PANEL = (64, 64)  # each panel's (height, width) in pixels
MAX_POSITIONS = 1024

__all__ = ["EditTrainConfig", "edit_tokenizer", "edit_vocabulary", "init_from_t2i", "token_mapping", "panel_prefix",
           "make_pair_dataset", "batch_pairs", "train_edit", "teacher_forced", "panel_tokens"]


def panel_tokens(downsample: int) -> int:
    """Tokens of one panel's rows: ``H / d`` rows of ``W / d`` codes and the end-of-row token (272 at ``d = 4``)."""
    return (PANEL[0] // downsample) * (PANEL[1] // downsample + 1)


def edit_tokenizer():
    """The word-level tokenizer of the edit instructions (caption words and edit words)."""
    from vispec.eval.train.tokenizer import train_word_tokenizer

    return train_word_tokenizer([" ".join(INSTRUCTION_WORDS)])


def edit_vocabulary(tokenizer, num_codes: int) -> dict[str, int]:
    """tiny-edit's layout ids after its tokenizer's words (the layout of tiny-t2i's vocabulary)."""
    return t2i_vocabulary(tokenizer, num_codes)


def panel_prefix(vocab: dict[str, int], height: int = PANEL[0], width: int = PANEL[1]) -> list[int]:
    """``[image start, res(2 H), res(W)]``: the dual-panel header (twice the panel height)."""
    rows, cols = 2 * height // RESOLUTION_UNIT, width // RESOLUTION_UNIT
    if not (0 <= rows <= MAX_RESOLUTION and 0 <= cols <= MAX_RESOLUTION):
        raise ValueError(f"a {height}x{width} panel pair needs resolution tokens up to {MAX_RESOLUTION}, got {rows}, {cols}")
    return [vocab["image_start"], vocab["resolution_base"] + rows, vocab["resolution_base"] + cols]


def token_mapping(old_tokenizer, old_vocab: dict[str, int], new_tokenizer, new_vocab: dict[str, int]) -> dict[int, int]:
    """``{new id: old id}`` of the tokens both vocabularies hold with the same meaning: the same word (or special
    token), the layout tokens (image start / end, end of row, each resolution token) and each code."""
    num_codes = new_vocab["vocab_size"] - new_vocab["code_offset"]
    if old_vocab["vocab_size"] - old_vocab["code_offset"] != num_codes:
        raise ValueError(f"old_vocab has {old_vocab['vocab_size'] - old_vocab['code_offset']} codes, new_vocab {num_codes}")
    old_words = old_tokenizer.get_vocab()
    mapping = {new: old_words[word] for word, new in new_tokenizer.get_vocab().items() if word in old_words}
    for key in ("image_start", "image_end", "end_of_row"):
        mapping[new_vocab[key]] = old_vocab[key]
    for n in range(MAX_RESOLUTION + 1):
        mapping[new_vocab["resolution_base"] + n] = old_vocab["resolution_base"] + n
    for c in range(num_codes):
        mapping[new_vocab["code_offset"] + c] = old_vocab["code_offset"] + c
    return mapping


def init_from_t2i(t2i, old_tokenizer, old_vocab: dict[str, int], tokenizer, vocab: dict[str, int],
                  max_positions: int = MAX_POSITIONS, seed: int = 0):
    """A Chameleon of ``vocab``'s size initialised from tiny-t2i ``t2i``: every weight copied, the embedding and LM-head
    rows by :func:`token_mapping` (unmapped rows: normal with the config's ``initializer_range``, seeded ``seed``).
    Returns ``(model, mapping)``."""
    from transformers import ChameleonConfig, ChameleonForConditionalGeneration

    mapping = token_mapping(old_tokenizer, old_vocab, tokenizer, vocab)
    config = ChameleonConfig.from_dict({**t2i.config.to_dict(), "vocab_size": vocab["vocab_size"],
                                        "max_position_embeddings": max_positions,
                                        "vocabulary_map": {"<image>": tokenizer.unk_token_id},
                                        "image_token_id": tokenizer.unk_token_id, "bos_token_id": tokenizer.bos_token_id,
                                        "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = ChameleonForConditionalGeneration(config)
    state = {k: v for k, v in t2i.state_dict().items()
             if k not in ("model.embed_tokens.weight", "lm_head.weight")}
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or set(missing) - {"model.embed_tokens.weight", "lm_head.weight"}:
        raise ValueError(f"t2i does not match a Chameleon of this config: missing {missing}, unexpected {unexpected}")
    new = torch.tensor(sorted(mapping))
    old = torch.tensor([mapping[i] for i in new.tolist()])
    std = config.initializer_range
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name in ("model.embed_tokens.weight", "lm_head.weight"):
            target, source = model.get_parameter(name), t2i.get_parameter(name)
            target.copy_(torch.randn(target.shape, generator=gen) * std)
            target[new] = source[old]
    return model, mapping


@torch.no_grad()
def make_pair_dataset(vq, tokenizer, count: int, seed: int, split: str = "train", batch: int = 128) -> dict:
    """``{"source", "target"}`` codes ``int16 [n, H / d, W / d]`` (the target's aligned to the source outside the edit,
    :func:`~vispec.eval.bench.scene_edits.aligned_target_codes`), ``"instruction"`` ids (lists), ``"kind"`` and
    ``"target_caption"`` of ``count`` pairs of ``split`` (:class:`~vispec.eval.bench.scene_edits.EditSampler`)."""
    from vispec.models.llamagen_vq import encode_to_tokens

    sampler = EditSampler(split, seed=seed, size=PANEL)
    out: dict = {"source": [], "target": [], "instruction": [], "kind": [], "target_caption": [], "source_caption": []}
    for lo in tqdm(range(0, count, batch), desc=f"tokenise {split} pairs", mininterval=10):
        pairs = sampler.sample(min(batch, count - lo))
        source, target = torch.stack([p.source for p in pairs]), torch.stack([p.target for p in pairs])
        source_codes = encode_to_tokens(vq, source)
        target_codes = aligned_target_codes(source_codes, encode_to_tokens(vq, target), source, target)
        out["source"].append(source_codes.to(torch.int16))
        out["target"].append(target_codes.to(torch.int16))
        out["instruction"] += [list(ids) for ids in tokenizer([p.instruction for p in pairs])["input_ids"]]
        for key in ("kind", "target_caption", "source_caption", "instruction_text"):
            out.setdefault(key, [])
            out[key] += [p.instruction if key == "instruction_text" else getattr(p, key) for p in pairs]
        out.setdefault("num_objects", [])
        out["num_objects"] += [len(p.target_scene.objects) for p in pairs]
    out["source"], out["target"] = torch.cat(out["source"]), torch.cat(out["target"])
    return out


def batch_pairs(instructions: list[list[int]], source: torch.Tensor, target: torch.Tensor, vocab: dict[str, int],
                pad_id: int, drop: torch.Tensor) -> dict[str, torch.Tensor]:
    """Left-padded inputs: instruction (none where ``drop``), dual-panel header, source rows, target rows but the
    last token; ``targets`` the target rows in the decoder vocabulary, ``first`` the position predicting the first."""
    prefix = panel_prefix(vocab)  # both panels are PANEL-sized, whatever the VQ's downsampling
    prompts = [([] if d else list(c)) + prefix for c, d in zip(instructions, drop.tolist())]
    longest = max(len(p) for p in prompts)
    source_ids, _ = image_rows(source, vocab)
    target_ids, targets = image_rows(target, vocab)
    prompt_ids = torch.full((len(prompts), longest), pad_id, dtype=torch.long)
    mask = torch.zeros(len(prompts), longest, dtype=torch.long)
    for i, p in enumerate(prompts):
        prompt_ids[i, longest - len(p):] = torch.tensor(p)
        mask[i, longest - len(p):] = 1
    inputs = torch.cat([prompt_ids, source_ids, target_ids[:, :-1]], dim=1)
    attention = torch.cat([mask, torch.ones_like(source_ids), torch.ones_like(target_ids[:, :-1])], dim=1)
    positions = (attention.cumsum(1) - 1).clamp(min=0)
    return {"input_ids": inputs, "attention_mask": attention, "position_ids": positions, "targets": targets,
            "first": torch.tensor(longest + source_ids.shape[1] - 1)}


def target_logits(model, batch: dict[str, torch.Tensor], head_ids: torch.Tensor) -> torch.Tensor:
    """Logits ``[B, N, V]`` of the target panel's rows over the decoder vocabulary (codes, end of row)."""
    hidden = model.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                         position_ids=batch["position_ids"]).last_hidden_state
    return F.linear(hidden[:, int(batch["first"]):], model.lm_head.weight[head_ids])


def head_rows(vocab: dict[str, int]) -> torch.Tensor:
    num_codes = vocab["vocab_size"] - vocab["code_offset"]
    return torch.cat([torch.arange(num_codes) + vocab["code_offset"], torch.tensor([vocab["end_of_row"]])])


@torch.no_grad()
def teacher_forced(model, data: dict, vocab: dict[str, int], pad_id: int, batch_size: int = 16,
                   limit: Optional[int] = None) -> dict:
    """Held-out teacher-forced metrics on the target panel: next-token accuracy (codes and end of row), loss, and the
    fraction of target tokens equal to the source token at the same place (how much a copy would get), over codes
    only; also the accuracy on the codes that differ from the source (the edit itself)."""
    n = len(data["instruction"]) if limit is None else min(limit, len(data["instruction"]))
    head = head_rows(vocab)
    hits = total = loss = copy = changed = changed_hits = 0.0
    for lo in range(0, n, batch_size):
        idx = list(range(lo, min(n, lo + batch_size)))
        batch = batch_pairs([data["instruction"][i] for i in idx], data["source"][idx], data["target"][idx], vocab,
                            pad_id, torch.zeros(len(idx), dtype=torch.bool))
        logits = target_logits(model, batch, head)
        targets = batch["targets"]
        loss += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum").item()
        pred = logits.argmax(-1)
        hits += (pred == targets).sum().item()
        total += targets.numel()
        source_targets = image_rows(data["source"][idx], vocab)[1]
        is_code = targets != head.numel() - 1
        same = (source_targets == targets) & is_code
        copy += same.sum().item() / max(1, is_code.sum().item()) * len(idx)
        diff = is_code & ~same
        changed += diff.sum().item()
        changed_hits += ((pred == targets) & diff).sum().item()
    return {"pairs": n, "token_accuracy": hits / total, "loss": loss / total, "target_equals_source": copy / n,
            "accuracy_on_changed_codes": changed_hits / max(1.0, changed)}


def _cached(path: str, build) -> dict:
    if os.path.exists(path):
        return torch.load(path, weights_only=False)
    data = build()
    torch.save(data, path)
    return data


def fit_timed(model, step_loss, cfg: EditTrainConfig) -> tuple[dict, int, float]:
    """AdamW (:func:`~vispec.eval.train.common.adamw`), gradient clipping at 1, linear warm-up then cosine decay to 0.1
    of ``cfg.lr``, over ``cfg.steps`` steps or ``cfg.max_minutes`` of wall clock, whichever ends first: the schedule's
    progress is the larger of the two fractions, so a slow (shared) machine still ends on a decayed rate. Logs
    ``{"step", "loss", "lr", "elapsed_s"}`` to ``cfg.out/train_log.jsonl`` every ``cfg.log_every`` steps and at the
    end; returns ``(last record, steps done, minutes)``."""
    import math

    optimizer = adamw(model, cfg.lr, cfg.weight_decay)
    warmup = max(1, min(cfg.warmup, cfg.steps // 2))
    start = time.time()
    budget = cfg.max_minutes * 60 if cfg.max_minutes else float("inf")
    record: dict = {}
    step = 0
    with open(os.path.join(cfg.out, "train_log.jsonl"), "w") as log:
        while True:
            progress = max(step / cfg.steps, (time.time() - start) / budget)
            if progress >= 1:
                break
            scale = min(1.0, (step + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))
            for group in optimizer.param_groups:
                group["lr"] = cfg.lr * scale
            loss = step_loss(step)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            record = {"step": step, "loss": loss.item(), "lr": cfg.lr * scale, "elapsed_s": round(time.time() - start, 1)}
            if step % cfg.log_every == 0:
                log.write(json.dumps(record) + "\n")
                log.flush()
                print(json.dumps(record), flush=True)
            step += 1
        log.write(json.dumps(record) + "\n")
    return record, step, round((time.time() - start) / 60, 1)


def train_edit(cfg: EditTrainConfig) -> dict:
    """Fine-tune tiny-edit from ``cfg.init_from`` (module docstring); saves the transformer, ``tokenizer/`` and
    ``train_config.json`` (vocabulary, the init mapping's size, held-out teacher-forced metrics) in ``cfg.out``."""
    from diffusers import VQModel

    from vispec.models.checkpoints import diffusers_load_kwargs

    cfg.validate()
    torch.manual_seed(cfg.seed)
    t2i, old_tokenizer, old_vocab, folder = load_t2i(cfg.init_from)
    vq = VQModel.from_pretrained(os.path.join(folder, "vqvae"), **diffusers_load_kwargs()).eval()
    tokenizer = edit_tokenizer()
    vocab = edit_vocabulary(tokenizer, vq.config.num_vq_embeddings)
    os.makedirs(cfg.out, exist_ok=True)
    data = _cached(os.path.join(cfg.out, f"pairs_train_aligned_{cfg.num_pairs}_{cfg.seed}.pt"),
                   lambda: make_pair_dataset(vq, tokenizer, cfg.num_pairs, cfg.seed, "train"))
    held_out = _cached(os.path.join(cfg.out, f"pairs_test_aligned_{cfg.eval_pairs}_{cfg.seed}.pt"),
                       lambda: make_pair_dataset(vq, tokenizer, cfg.eval_pairs, cfg.seed, "test"))
    model, mapping = init_from_t2i(t2i, old_tokenizer, old_vocab, tokenizer, vocab, MAX_POSITIONS, cfg.seed)
    model.eval()
    before = teacher_forced(model, held_out, vocab, tokenizer.pad_token_id, limit=32)
    model.train()
    head = head_rows(vocab)
    gen = torch.Generator().manual_seed(cfg.seed)
    n = len(data["instruction"])

    def step_loss(step: int) -> torch.Tensor:
        pick = torch.randint(n, (cfg.batch_size,), generator=gen)
        drop = torch.rand(cfg.batch_size, generator=gen) < cfg.instruction_dropout
        batch = batch_pairs([data["instruction"][i] for i in pick.tolist()], data["source"][pick], data["target"][pick],
                            vocab, tokenizer.pad_token_id, drop)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.bf16):
            logits = target_logits(model, batch, head)
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), batch["targets"].reshape(-1))

    last, steps_done, minutes = fit_timed(model, step_loss, cfg)
    model.eval()
    model.save_pretrained(cfg.out)  # before the held-out pass
    tokenizer.save_pretrained(os.path.join(cfg.out, "tokenizer"))
    after = teacher_forced(model, held_out, vocab, tokenizer.pad_token_id)
    metrics = {"train_minutes": minutes, "steps_done": steps_done, "final_loss": last["loss"],
               "parameters": sum(p.numel() for n_, p in model.named_parameters() if not n_.startswith("model.vqmodel.")),
               "vocabulary": vocab, "mapped_rows": len(mapping), "new_rows": vocab["vocab_size"] - len(mapping),
               "held_out_before": before, "held_out": after}
    write_record(cfg.out, cfg, metrics)
    return metrics


def _edit_visible(instruction: str, num_objects: int, source_detections: list[dict], detections: list[dict]) -> bool:
    """What the target caption cannot see: the image holds exactly ``num_objects`` detected objects (a removed object
    of another colour is gone, an added one is there), and a single object told to move ("move the red circle up")
    has its centre moved that way by at least a tenth of the image side against the source's detection."""
    if len(detections) != num_objects:
        return False
    words = instruction.split()
    if words[0] != "move" or words[-1] not in ("left", "right", "up", "down") or len(source_detections) != 1:
        return True
    (y0, x0), (y1, x1) = [((d["box"][0] + d["box"][2]) / 2, (d["box"][1] + d["box"][3]) / 2)
                          for d in (source_detections[0], detections[0])]
    shift = {"left": x0 - x1, "right": x1 - x0, "up": y0 - y1, "down": y1 - y0}[words[-1]]
    return shift >= 0.1 * PANEL[1]


def edit_layout(vocab: dict[str, int], downsample: int):
    """The decoders' :class:`~vispec.models.unified.ImageLayout` of the TARGET panel: ``64 / d`` x ``64 / d`` codes
    with end of row (``d`` = ``downsample``, the VQ's), prefix ``[image start, res(128), res(64)]`` (the dual-panel
    header), suffix ``[image end]``."""
    from vispec.models.unified import ImageLayout

    rows, cols = PANEL[0] // downsample, PANEL[1] // downsample
    return ImageLayout(rows=rows, cols=cols, num_codes=vocab["vocab_size"] - vocab["code_offset"],
                       code_offset=vocab["code_offset"], eol_id=vocab["end_of_row"], prefix=tuple(panel_prefix(vocab)),
                       suffix=(vocab["image_end"],))


@torch.no_grad()
def evaluate_edit(transformer: str, tokenizer_folder: str, vq_folder: str, *, pairs: int = 32, seed: int = 1,
                  guidance_scales: tuple[float, ...] = (1.0, 3.0), temperature: float = 1.0,
                  teacher_pairs: int = 128, out: str = "") -> dict:
    """Check a trained editor with plain AR decoding (no pipeline): teacher-forced metrics on ``teacher_pairs``
    held-out pairs, then ``pairs`` held-out pairs decoded AR (``vispec.decoding.decode``, ``decoding="ar"``) at each
    guidance scale, the condition built by ``UnifiedTokenModel.condition([instruction], source=source panel)``
    (checked against the training layout: instruction, header, source rows; unconditional: header, source rows).
    Reports, per scale: the scene-check accuracy of the decoded images against the target captions (overall, per
    attribute and per edit kind), and the fraction of generated codes equal to the source's at the same place.
    ``strict_overall`` also asks the edit to be visible where the caption cannot show it (:func:`_edit_visible`).
    Baselines: the VQ reconstruction of the true target (the ceiling) and the source itself (no edit) against the
    target captions. Writes the result as JSON to ``out`` when given."""
    from diffusers import VQModel
    from transformers import ChameleonForConditionalGeneration, PreTrainedTokenizerFast

    from vispec.decoding import decode
    from vispec.eval.bench.scene_checks import check_images
    from vispec.models.llamagen_vq import decode_tokens, downsample_factor
    from vispec.models.unified import UnifiedTokenModel
    from vispec.models.unified_families import chameleon_backbone
    from vispec.sampling import SamplingConfig

    if isinstance(pairs, bool) or not isinstance(pairs, int) or pairs < 1:
        raise ValueError(f"pairs must be a positive int, got {pairs!r}")
    model = ChameleonForConditionalGeneration.from_pretrained(transformer).eval()
    tokenizer = PreTrainedTokenizerFast.from_pretrained(tokenizer_folder)
    vq = VQModel.from_pretrained(vq_folder).eval()
    vocab = edit_vocabulary(tokenizer, vq.config.num_vq_embeddings)
    if model.config.vocab_size != vocab["vocab_size"]:
        raise ValueError(f"transformer has {model.config.vocab_size} tokens, the tokenizer's layout {vocab['vocab_size']}")
    data = make_pair_dataset(vq, tokenizer, max(pairs, teacher_pairs), seed, "test")
    result: dict = {"teacher_forced": teacher_forced(model, data, vocab, tokenizer.pad_token_id, limit=teacher_pairs)}
    layout = edit_layout(vocab, downsample_factor(vq))
    wrapped = UnifiedTokenModel(chameleon_backbone(model, layout), layout, cfg_mode="image_start")
    source_codes, target_codes = data["source"][:pairs].long(), data["target"][:pairs].long()
    source_tokens = image_rows(source_codes, vocab)[1]  # decoder tokens: codes, num_codes for end of row
    instructions = data["instruction"][:pairs]
    condition = wrapped.condition(instructions, source=source_tokens)
    prefix = panel_prefix(vocab)
    source_ids = image_rows(source_codes, vocab)[0]
    for i in range(pairs):  # the condition is the training layout
        if condition.prompts[i].tolist() != instructions[i] + prefix + source_ids[i].tolist() or \
                condition.unconditional[i].tolist() != prefix + source_ids[i].tolist():
            raise RuntimeError("UnifiedTokenModel.condition(source=...) does not build the dual-panel training layout")
    captions, kinds = data["target_caption"][:pairs], data["kind"][:pairs]

    source_checked = check_images(decode_tokens(vq, source_codes).clamp(-1, 1), data["source_caption"][:pairs])

    def scores(codes: torch.Tensor) -> dict:
        images = decode_tokens(vq, codes).clamp(-1, 1)
        checked = check_images(images, captions)
        per_kind: dict = {}
        strict = []
        for i, (kind, row) in enumerate(zip(kinds, checked["per_image"])):
            ok = bool(row["overall"]) and _edit_visible(data["instruction_text"][i], data["num_objects"][i],
                                                        source_checked["per_image"][i]["detections"], row["detections"])
            per_kind.setdefault(kind, []).append(bool(row["overall"]))
            strict.append(ok)
        return {"accuracy": checked["accuracy"], "strict_overall": sum(strict) / len(strict),
                "overall_by_kind": {k: round(sum(v) / len(v), 3) for k, v in sorted(per_kind.items())},
                "codes_equal_source": (codes == source_codes).float().mean().item()}

    result["ceiling_vq_target"] = scores(target_codes)
    result["baseline_source_unchanged"] = scores(source_codes)
    for scale in guidance_scales:
        sampling = SamplingConfig(temperature=temperature, guidance_scale=scale)
        gen = torch.Generator().manual_seed(seed)
        start = time.time()
        output = decode(wrapped, condition, num_tokens=layout.num_tokens, decoding="ar", sampling=sampling,
                        generator=gen)
        codes = layout.codes(output.tokens)
        result[f"ar_guidance_{scale:g}"] = {**scores(codes), "seconds": round(time.time() - start, 1)}
    result["settings"] = {"pairs": pairs, "seed": seed, "split": "test", "temperature": temperature,
                          "decoding": "ar"}
    if out:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as handle:
            json.dump(result, handle, indent=2)
    return result
