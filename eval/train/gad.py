"""Training the GAD block drafter (:class:`vispec.models.gad_drafter.GADDrafter`) by distillation from tiny-c2i.

``decoding="gad"`` (:mod:`vispec.decoding.gad`) drafts ``d_i ~ q_i`` for the ``k`` positions after the committed
prefix ``x_{<n}``, all from one forward and independently of each other, and the target accepts ``d_i`` with
probability ``min(1, p(d_i | x_{<n}, d_{<i}) / q_i(d_i))`` while every earlier draft was accepted. The best
*independent* proposal for position ``n + i`` is therefore close to the target's marginal

    p_i(x) = E_{x_{n..n+i-1} ~ p} [ p(x_{n+i} = x | x_{<n+i}) ]     (given the prefix x_{<n} alone).

The objective (MaskGIT-style, but only the masking GAD meets): per training row a random prefix length
``n ~ U{1, .., 255}`` and block size ``k ~ U{1, .., max_block}`` (cut at the image's end), the block's ``k``
positions masked, and the loss

    L = mean_{i < k} KL( p(. | x_{<n+i}) || q_i(. | c, x_{<n}) )

with ``p`` the target's next-token distribution on the training sequence (teacher forcing) and ``q_i`` the
drafter's. Why distillation and not cross-entropy on the sampled tokens: the sequences are the target's own
samples, so ``x_{n+i}`` given ``x_{<n}`` is distributed as ``p_i`` and both losses have the same minimiser
``q_i = p_i`` (``E[KL(p(.|x_{<n+i}) || q)] = CE(p_i, q) - const``); the teacher's full distribution is the
Rao-Blackwellised target, with far less variance per step than one sampled token, which is what the
acceptance ``1 - TV(p, q)`` needs (as :mod:`vispec.eval.train.drafter` argues for the AR drafter).

As in that trainer, the condition is dropped to the null class with probability ``class_dropout_prob`` for
teacher and student alike, so the drafter learns both CFG branches and its guided ``q`` mirrors the
target's guided ``p``. Each step runs the teacher once per sequence (a full 256-token forward) and the drafter
on ``blocks_per_sequence`` rows per sequence (the drafter is cheap: fixed input ``1 + context + max_block``).
A causal drafter (``--attention causal --context 0``, :mod:`vispec.models.gad_drafter`) is trained on the same
KL, packed: one forward per sequence (:meth:`~vispec.models.gad_drafter.GADDrafter.forward_packed`) gives row 0 for
every prefix length ``n = 1 .. N - 1`` (an AR drafter's objective, dense) and the masks of ``blocks_per_sequence``
blocks at random starts; the loss is the mean KL over the first rows plus the mean KL over the masks' rows, so the
first row, the one every block's acceptance starts with, keeps half the weight.
Sequences are sampled from the target with AR (:func:`vispec.eval.train.drafter.sample_target_sequences`),
cached in ``out``.
"""

from __future__ import annotations

import json
import os
import shutil
import time

import torch
import torch.nn.functional as F

from vispec.eval.train.common import fit_sequences, write_record
from vispec.eval.train.configs import GADDrafterAssembleConfig, GADDrafterTrainConfig  # torch-free homes (re-exported)
from vispec.eval.train.drafter import sample_target_sequences
from vispec.models.gad_drafter import GADDrafter
from vispec.models.llamagen_gpt import LlamaGenCondition, LlamaGenGPT

__all__ = ["GADDrafterAssembleConfig", "GADDrafterTrainConfig", "assemble_gad_drafter", "block_rows", "build_gad_drafter",
           "train_gad_drafter", "warm_start_from_ar"]


def build_gad_drafter(cfg: GADDrafterTrainConfig, target: LlamaGenGPT) -> GADDrafter:
    """A fresh drafter sized by ``cfg`` for ``target``'s vocabulary, classes and grid."""
    t = target.config
    return GADDrafter(vocab_size=t.vocab_size, dim=cfg.dim, n_layer=cfg.n_layer, n_head=cfg.n_head,
                      num_classes=t.num_classes, class_dropout_prob=cfg.class_dropout_prob, block_size=t.block_size,
                      context=cfg.context, max_block=cfg.max_block, attention=cfg.attention)


def warm_start_from_ar(drafter: GADDrafter, ar_drafter: LlamaGenGPT) -> None:
    """Start ``drafter`` from a LlamaGen GPT of the same shape (tiny-c2i's AR ``drafter``, or the target
    ``transformer`` itself): the two share LlamaGen's blocks, class table, norm and head parameter for parameter; the
    token table gains the ``[MASK]`` row, which keeps its random init. The GPT already predicts ``x_n`` from ``x_{<n}``,
    which is the block's first position; training then only has to move that skill from the last prefix token's
    output to the masks' (and make the attention bidirectional). Raises if any shape differs."""
    source, own = ar_drafter.state_dict(), drafter.state_dict()
    loaded = {}
    for key, value in own.items():
        if key not in source:
            raise ValueError(f"warm start: the AR drafter has no parameter {key!r} (it must be a LlamaGen GPT with the "
                             f"GAD drafter's dim, n_layer and n_head)")
        theirs = source[key]
        if key == "tok_embeddings.weight" and theirs.shape[0] == value.shape[0] - 1 and theirs.shape[1:] == value.shape[1:]:
            theirs = torch.cat([theirs, value[-1:]])  # the [MASK] row stays as initialised
        if theirs.shape != value.shape:
            raise ValueError(f"warm start: {key} has shape {tuple(theirs.shape)} in the AR drafter and {tuple(value.shape)} "
                             f"in the GAD drafter (dim, n_layer and n_head must match)")
        loaded[key] = theirs
    drafter.load_state_dict(loaded)


def block_rows(batch: int, repeats: int, num_tokens: int, max_block: int,
               gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(sequence [R], num_prefix [R], num_masked [R])`` for ``R = batch * repeats`` training rows: each sequence
    ``repeats`` times, with ``n ~ U{1, .., N - 1}`` and ``k ~ U{1, .., max_block}`` cut to ``N - n``."""
    sequence = torch.arange(batch).repeat_interleave(repeats)
    rows = sequence.numel()
    prefix = torch.randint(1, num_tokens, (rows,), generator=gen)
    masked = torch.minimum(torch.randint(1, max_block + 1, (rows,), generator=gen), num_tokens - prefix)
    return sequence, prefix, masked


def train_gad_drafter(cfg: GADDrafterTrainConfig) -> dict:
    """Sample (or load the cached) target sequences, distil the drafter (module docstring), save it to ``cfg.out``."""
    cfg.validate()
    torch.manual_seed(cfg.seed)
    os.makedirs(cfg.out, exist_ok=True)
    cache = os.path.join(cfg.out, f"samples_{cfg.num_sequences}_{cfg.seed}.pt")
    start = time.time()
    from vispec.pipelines.llamagen import LlamaGenPipeline

    if os.path.exists(cache):
        data = torch.load(cache, weights_only=True)
        tokens, labels = data["tokens"], data["labels"]
        target = LlamaGenPipeline.from_pretrained(cfg.target).transformer.eval()
    else:
        tokens, labels, target = sample_target_sequences(cfg)
        torch.save({"tokens": tokens, "labels": labels}, cache)
    sample_minutes = (time.time() - start) / 60
    drafter = build_gad_drafter(cfg, target).eval()  # no dropout layers; the label dropout is done here
    if cfg.warm_start:
        ar_drafter = getattr(LlamaGenPipeline.from_pretrained(cfg.target), cfg.warm_start)
        if ar_drafter is None:
            raise ValueError(f"warm_start={cfg.warm_start!r}: the target pipeline {cfg.target!r} has no {cfg.warm_start} "
                             f"component (train one with `vispec train drafter`, or pass --warm-start '')")
        warm_start_from_ar(drafter, ar_drafter)
    num_tokens = target.config.block_size

    def teacher_log_probs(seq: torch.Tensor, labels: torch.Tensor, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """``(drop [B], log p [B, N, V])``: the condition dropped with probability ``class_dropout_prob`` (teacher and
        student alike) and the target's next-token log-probabilities, output ``t`` predicting token ``t`` from ``x_{<t}``."""
        drop = torch.rand(seq.shape[0], generator=gen) < cfg.class_dropout_prob
        with torch.no_grad():
            logits = target(seq[:, :-1], LlamaGenCondition(class_labels=labels), condition_drop=drop)
        return drop, F.log_softmax(logits.float(), -1)

    def distillation_loss(seq: torch.Tensor, labels: torch.Tensor, gen: torch.Generator):
        """Mean KL(p_target || q_drafter) over the masked positions of every row."""
        drop, teacher = teacher_log_probs(seq, labels, gen)
        which, prefix, masked = block_rows(seq.shape[0], cfg.blocks_per_sequence, num_tokens, cfg.max_block, gen)
        logits = drafter(seq[which], prefix, masked, labels[which], drop[which], validate=False)
        offsets = torch.arange(cfg.max_block)
        valid = offsets[None, :] < masked[:, None]  # [R, K]
        at = (prefix[:, None] + offsets[None, :]).clamp(max=num_tokens - 1)
        p_log = teacher[which[:, None], at]  # [R, K, V]
        q_log = F.log_softmax(logits, -1)
        kl = (F.kl_div(q_log, p_log, log_target=True, reduction="none").sum(-1) * valid).sum() / valid.sum()

        def extras() -> dict:  # logged steps only: TV from the teacher, overall and at the block's first position
            tv = 0.5 * (q_log.detach().exp() - p_log.exp()).abs().sum(-1)
            return {"tv": round(float((tv * valid).sum() / valid.sum()), 4), "tv_first": round(float(tv[:, 0].mean()), 4)}

        return kl, extras

    def packed_loss(seq: torch.Tensor, labels: torch.Tensor, gen: torch.Generator):
        """Causal drafter: KL at every block-first position (all ``n``) plus KL at the masks of
        ``blocks_per_sequence`` random blocks per sequence, all in one packed forward (module docstring)."""
        drop, teacher = teacher_log_probs(seq, labels, gen)
        starts = torch.randint(1, num_tokens, (seq.shape[0], cfg.blocks_per_sequence), generator=gen)
        first, rest = drafter.forward_packed(seq, starts, labels, drop)
        first_log, p_first = F.log_softmax(first, -1), teacher[:, 1:]
        kl_first = F.kl_div(first_log, p_first, log_target=True, reduction="none").sum(-1).mean()
        at = starts[:, :, None] + 1 + torch.arange(cfg.max_block - 1)  # [B, M, K-1]: the position each mask drafts
        valid = at < num_tokens
        p_rest = teacher[torch.arange(seq.shape[0])[:, None, None], at.clamp(max=num_tokens - 1)]
        rest_log = F.log_softmax(rest, -1)
        kl_rest = (F.kl_div(rest_log, p_rest, log_target=True, reduction="none").sum(-1) * valid).sum() / valid.sum()

        def extras() -> dict:  # logged steps only: TV from the teacher at the first slot and at the masks
            tv_first = 0.5 * (first_log.detach().exp() - p_first.exp()).abs().sum(-1).mean()
            tv_rest = 0.5 * (rest_log.detach().exp() - p_rest.exp()).abs().sum(-1)
            return {"tv": round(float((tv_rest * valid).sum() / valid.sum()), 4), "tv_first": round(float(tv_first), 4)}

        return kl_first + kl_rest, extras

    train_start = time.time()
    loss = packed_loss if drafter.causal else distillation_loss
    last = fit_sequences(drafter, tokens, labels, cfg, loss, desc="train gad drafter", loss_name="kl")
    metrics = {"sample_minutes": round(sample_minutes, 1), "train_minutes": round((time.time() - train_start) / 60, 1),
               "final_kl": last["kl"], "final_tv": last["tv"], "final_tv_first": last["tv_first"],
               "parameters": sum(p.numel() for p in drafter.parameters())}
    drafter.save_pretrained(cfg.out)
    write_record(cfg.out, cfg, metrics)
    return metrics


def assemble_gad_drafter(cfg: GADDrafterAssembleConfig) -> dict:
    """Add a trained drafter to a pipeline folder as its ``gad_drafter`` component: the weights and config in
    ``gad_drafter/``, the component in ``model_index.json``, and the training record and log beside the other
    models' (``logs/gad_drafter_train_log.jsonl``). The other components' files are left as they are."""
    cfg.validate()
    drafter = GADDrafter.from_pretrained(cfg.drafter).eval()
    index_path = os.path.join(cfg.pipeline, "model_index.json")
    with open(index_path) as handle:
        index = json.load(handle)
    transformer = LlamaGenGPT.from_pretrained(os.path.join(cfg.pipeline, "transformer"))
    t, d = transformer.config, drafter.config
    if (d.vocab_size, d.num_classes) != (t.vocab_size, t.num_classes) or d.block_size < t.block_size:
        raise ValueError(f"drafter (vocabulary {d.vocab_size}, classes {d.num_classes}, {d.block_size} tokens) does not fit the "
                         f"pipeline's transformer (vocabulary {t.vocab_size}, classes {t.num_classes}, {t.block_size} tokens)")
    drafter.save_pretrained(os.path.join(cfg.pipeline, "gad_drafter"))
    index["gad_drafter"] = ["vispec.models.gad_drafter", "GADDrafter"]
    with open(index_path, "w") as handle:
        json.dump(dict(sorted(index.items())), handle, indent=2)
        handle.write("\n")
    log = os.path.join(cfg.drafter, "train_log.jsonl")
    if os.path.isfile(log):
        os.makedirs(os.path.join(cfg.pipeline, "logs"), exist_ok=True)
        shutil.copyfile(log, os.path.join(cfg.pipeline, "logs", "gad_drafter_train_log.jsonl"))
    return {"gad_drafter_parameters": sum(p.numel() for p in drafter.parameters())}
