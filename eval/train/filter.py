"""Training a Learn2PD filter (:class:`vispec.dllm.learned.ParallelDecodeFilter`) for a masked diffusion LM.

Learn2PD (arXiv 2509.25188; spec ``dllm.md`` §5.1-5.2) learns from the frozen base model's own decodes:

1. **Reference answers.** Decode every training prompt with LLaDA's baseline (one token per step,
   ``steps = gen_length``, low-confidence remasking, temperature 0, no cache, no early stop) and keep the
   canvas ``y*`` (:func:`reference_answers`).
2. **Oracle pass ("extremely greedy parallel").** Decode again from the all-mask canvas, block by block with
   full forwards. At every step of block ``k`` record, for each row still holding masks in the block, one
   training row: the features ``c ∈ R^{Lb}`` (:func:`vispec.dllm.learned.block_features`, every block
   position) and the labels ``1[x̂_j = y*_j]`` (every block position). Then commit **every** masked position
   whose arg-max ``x̂_j`` already equals ``y*_j``. When a row commits nothing (its predictions would repeat,
   the model being deterministic), ``y*`` is copied into its block, so the pass always ends
   (:func:`oracle_rows`). Rows are batched: each sample advances at its own pace.
3. **Training.** Rows are shuffled and split 80 / 10 / 10; the loss is ``BCEWithLogits(f_θ(c), labels)`` over
   all positions, full batch, AdamW (lr 3e-3 as in their notebook), for ``epochs`` epochs. The record
   reports, on the held-out split and over the masked positions only (those the filter decides), the
   false-positive rate (wrong tokens accepted at τ), the recall of right tokens and the precision of accepted
   ones (:func:`filter_metrics`).

``vispec train filter --model tiny-mdlm-long --out DIR`` runs all three and writes ``DIR`` as the
model's pipeline folder with the trained ``filter`` component (and ``filter/training.json``), so
``MaskedDiffusionLMPipeline.from_pretrained(DIR)(prompt, strategy="learn2pd")`` uses it. ``DIR`` may be the model's
own folder (the filter is added to it; other files there, such as a README, are kept).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from dataclasses import asdict
from typing import Any, Optional

import torch
from torch import Tensor

from vispec.eval.train.configs import FilterTrainConfig  # its home: torch-free, for the CLI (re-exported here)

SPLITS = (0.8, 0.1, 0.1)


@torch.no_grad()
def reference_answers(model: Any, input_ids: Tensor, attention_mask: Optional[Tensor], gen_length: int,
                      block_length: int) -> Tensor:
    """``[B, gen_length]`` canvases of LLaDA's baseline: one token per step, no cache, no early stop, temperature 0."""
    from vispec.dllm import LLaDAScheduler, decode

    return decode(model, input_ids, attention_mask, scheduler=LLaDAScheduler(), gen_length=gen_length,
                  block_length=block_length, steps=gen_length).tokens


@torch.no_grad()
def oracle_rows(model: Any, input_ids: Tensor, attention_mask: Optional[Tensor], reference: Tensor,
                block_length: int, mask_token_id: int) -> dict[str, Tensor]:
    """The oracle pass (module docstring, step 2) toward ``reference [B, L]``.

    Returns ``features [N, Lb]`` float32, ``labels [N, Lb]`` bool, ``masked [N, Lb]`` bool (the positions still
    masked when the row was recorded), ``sample [N]`` (the batch row) and ``step [N]`` (step within the block).
    """
    from vispec.dllm.tokens import proposal_mask
    from vispec.dllm.learned import block_features

    batch, prompt_len = input_ids.shape
    gen_length = reference.shape[1]
    if gen_length % block_length:
        raise ValueError(f"the reference length ({gen_length}) must be a multiple of block_length ({block_length})")
    x = torch.cat([input_ids, torch.full_like(reference, mask_token_id)], dim=1)
    key_mask = None
    if attention_mask is not None and not bool(attention_mask.bool().all()):
        key_mask = torch.cat([attention_mask.bool(), torch.ones_like(reference, dtype=torch.bool)], dim=1)
    records: dict[str, list[Tensor]] = {"features": [], "labels": [], "masked": [], "sample": [], "step": []}
    proposal = None
    for block in range(gen_length // block_length):
        lo, hi = block * block_length, (block + 1) * block_length
        start, end = prompt_len + lo, prompt_len + hi
        target = reference[:, lo:hi]
        for step in range(block_length):  # every step commits at least one position of each active row
            rows = (x[:, start:end] == mask_token_id).any(dim=1).nonzero().squeeze(1)
            if rows.numel() == 0:
                break
            logits = model(x[rows], attention_mask=None if key_mask is None else key_mask[rows]).logits[:, start:end]
            if proposal is None:
                proposal = proposal_mask(model, logits.shape[-1], mask_token_id, logits.device)
            guess = logits.masked_fill(proposal, float("-inf")).argmax(dim=-1)
            right = guess == target[rows]
            masked = x[rows, start:end] == mask_token_id
            records["features"].append(block_features(logits, proposal).cpu())
            records["labels"].append(right.cpu())
            records["masked"].append(masked.cpu())
            records["sample"].append(rows.cpu())
            records["step"].append(torch.full((rows.numel(),), step, dtype=torch.long))
            commit = masked & right
            stalled = ~commit.any(dim=1, keepdim=True)
            commit = commit | (stalled & masked)  # a row that commits nothing takes y* for its whole block
            x[rows, start:end] = torch.where(commit, target[rows], x[rows, start:end])
    return {name: torch.cat(parts) for name, parts in records.items()}


def split_rows(n: int, seed: int) -> tuple[Tensor, Tensor, Tensor]:
    """Shuffled row indices split 80 / 10 / 10 (train, validation, test), seeded."""
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    n_train, n_val = int(SPLITS[0] * n), int(SPLITS[1] * n)
    return order[:n_train], order[n_train:n_train + n_val], order[n_train + n_val:]


@torch.no_grad()
def filter_metrics(filter_model: torch.nn.Module, features: Tensor, labels: Tensor, masked: Tensor,
                   threshold: float) -> dict[str, float]:
    """BCE over all positions, and over the masked positions at ``σ > threshold``: false-positive rate (wrong
    tokens accepted / wrong tokens), recall (right tokens accepted / right tokens), precision (right / accepted)
    and the accepted fraction."""
    logits = filter_model(features)
    loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, labels.float())
    accept = (torch.sigmoid(logits) > threshold) & masked
    right, wrong = labels & masked, ~labels & masked
    ratio = lambda a, b: float(a) / float(b) if float(b) else None  # noqa: E731 (None: no such positions)
    return {"bce": float(loss), "false_positive_rate": ratio((accept & wrong).sum(), wrong.sum()),
            "recall": ratio((accept & right).sum(), right.sum()), "precision": ratio((accept & right).sum(), accept.sum()),
            "accepted_fraction": ratio(accept.sum(), masked.sum())}


def fit_filter(rows: dict[str, Tensor], block_length: int, hidden_size: int = 32, epochs: int = 3000, lr: float = 3e-3,
               weight_decay: float = 0.01, threshold: float = 0.96, seed: int = 0, log_every: int = 500):
    """Train a :class:`ParallelDecodeFilter` on oracle rows (module docstring, step 3); returns it and its record
    (``history`` every ``log_every`` epochs, and the final ``train`` / ``validation`` / ``test`` metrics)."""
    from vispec.dllm.learned import ParallelDecodeFilter

    features, labels, masked = rows["features"].float(), rows["labels"].bool(), rows["masked"].bool()
    if features.dim() != 2 or features.shape[1] != block_length:
        raise ValueError(f"features must be [N, {block_length}], got {tuple(features.shape)}")
    if features.shape[0] < 10:
        raise ValueError(f"at least 10 oracle rows are needed for an 80/10/10 split, got {features.shape[0]}")
    torch.manual_seed(seed)
    model = ParallelDecodeFilter(block_length=block_length, hidden_size=hidden_size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    train, val, test = split_rows(features.shape[0], seed)
    target = labels[train].float()
    history = []
    for epoch in range(epochs):
        optimizer.zero_grad(set_to_none=True)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(model(features[train]), target)
        loss.backward()
        optimizer.step()
        if (epoch + 1) % log_every == 0 or epoch + 1 == epochs:
            history.append({"epoch": epoch + 1, "train_bce": loss.item(),
                            **{f"val_{k}": v for k, v in filter_metrics(model, features[val], labels[val], masked[val], threshold).items()}})
    model.eval()
    record = {"history": history, "rows": {"train": len(train), "validation": len(val), "test": len(test)},
              **{name: filter_metrics(model, features[idx], labels[idx], masked[idx], threshold)
                 for name, idx in (("train", train), ("validation", val), ("test", test))}}
    return model, record


def training_prompts(tasks: tuple[str, ...], per_task: int, seed: int) -> list[str]:
    """``per_task`` prompts of each task's train stream (never a test prompt), interleaved."""
    from vispec.eval.bench.text_tasks import train_stream

    streams = [train_stream(task, seed=seed) for task in tasks]
    return [next(stream).prompt for _ in range(per_task) for stream in streams]


def oracle_dataset(pipe: Any, prompts: list[str], gen_length: int, block_length: int, batch_size: int) -> dict[str, Tensor]:
    """Reference answers and oracle rows for ``prompts`` through ``pipe``'s model and tokenizer, in batches."""
    parts = []
    for lo in range(0, len(prompts), batch_size):
        ids, mask = pipe.prepare_input_ids(prompt=prompts[lo:lo + batch_size])
        ids, mask = ids.to(pipe.device), mask.to(pipe.device)
        mask = None if bool(mask.bool().all()) else mask
        reference = reference_answers(pipe.model, ids, mask, gen_length, block_length)
        rows = oracle_rows(pipe.model, ids, mask, reference, block_length, pipe.mask_token_id)
        rows["sample"] += lo
        parts.append(rows)
    return {name: torch.cat([p[name] for p in parts]) for name in parts[0]}


def train_filter(cfg: FilterTrainConfig) -> dict:
    """Oracle data from ``cfg.model``, the filter, and the pipeline folder ``cfg.out`` with it (module docstring)."""
    from vispec.pipelines import MaskedDiffusionLMPipeline

    cfg.validate()
    torch.set_num_threads(cfg.threads)
    pipe = MaskedDiffusionLMPipeline.from_pretrained(cfg.model)
    pipe.set_progress_bar_config(disable=True)
    gen_length = cfg.gen_length or pipe.config.default_gen_length
    block_length = cfg.block_length or pipe.config.default_block_length
    if gen_length % block_length:
        raise ValueError(f"gen_length ({gen_length}) must be a multiple of block_length ({block_length})")
    start = time.perf_counter()
    rows = oracle_dataset(pipe, training_prompts(tuple(cfg.tasks), cfg.prompts_per_task, cfg.seed), gen_length,
                          block_length, cfg.batch_size)
    data_minutes = (time.perf_counter() - start) / 60
    start = time.perf_counter()
    filter_model, record = fit_filter(rows, block_length, cfg.hidden_size, cfg.epochs, cfg.lr, cfg.weight_decay,
                                      cfg.threshold, cfg.seed)
    record.update(data_minutes=round(data_minutes, 2), train_minutes=round((time.perf_counter() - start) / 60, 2),
                  oracle_rows=int(rows["features"].shape[0]), gen_length=gen_length, block_length=block_length,
                  parameters=sum(p.numel() for p in filter_model.parameters()),
                  label_rate_masked=float(rows["labels"][rows["masked"]].float().mean()))
    pipe.register_modules(filter=filter_model)
    with tempfile.TemporaryDirectory() as staging:  # written whole, then copied over: --out may be the model's folder
        pipe.save_pretrained(staging)
        with open(os.path.join(staging, "filter", "training.json"), "w") as f:
            json.dump({"config": asdict(cfg), "metrics": record}, f, indent=2)
        shutil.copytree(staging, cfg.out, dirs_exist_ok=True)
    return {"out": cfg.out, **{k: v for k, v in record.items() if k != "history"}}
