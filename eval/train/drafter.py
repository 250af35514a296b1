"""Training ``tiny-c2i-drafter``: a small LlamaGen GPT distilled from tiny-c2i for draft-model decoding.

Draft-model speculative decoding (Leviathan et al. 2023; the setting LANTERN, arXiv 2410.03355,
was built for) accepts a draft ``x ~ q`` with probability ``min(1, p(x)/q(x))``, so the expected
acceptance per position is ``1 - TV(p, q)``: the drafter should match the target's distribution,
not the data. Distillation therefore has two parts:

1. **Sequences** from the target itself: tiny-c2i samples class-conditionally with the pipeline's
   guidance (the contexts the drafter meets at inference), decoded with AR.
2. **Soft targets**: on each training sequence the target's next-token distribution under the same
   condition, conditional or (with probability ``class_dropout_prob``) unconditional, so the drafter
   learns both CFG branches; the loss is ``KL(p_target || q_drafter)`` averaged over positions.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from vispec.eval.training import gpt_optimizer, warmup_cosine, write_record
from vispec.models.llamagen_gpt import LlamaGenCondition, LlamaGenGPT


@dataclass
class DrafterTrainConfig:
    target: str = "tiny-c2i"  # embedded name or pipeline folder
    out: str = "out/tiny-c2i-drafter"
    num_sequences: int = 4096
    sample_batch: int = 256
    sample_decoding: str = "ar"  # at batch 256 on a CPU, AR is the fastest exact sampler
    steps: int = 2500
    batch_size: int = 16  # ~0.4 s per step on 2 CPU cores (the teacher forward dominates)
    lr: float = 2e-3
    weight_decay: float = 0.05
    dim: int = 128
    n_layer: int = 2
    n_head: int = 4
    class_dropout_prob: float = 0.1
    seed: int = 0
    log_every: int = 25


@torch.no_grad()
def sample_target_sequences(cfg: DrafterTrainConfig) -> tuple[torch.Tensor, torch.Tensor, LlamaGenGPT]:
    """``(tokens int16 [N, 256], labels [N], target model)``: class-conditional samples of the target."""
    from vispec.pipelines.llamagen import LlamaGenPipeline

    pipe = LlamaGenPipeline.from_pretrained(cfg.target)
    model = pipe.transformer.eval()
    num_classes = model.config.num_classes
    gen = torch.Generator().manual_seed(cfg.seed)
    labels = torch.arange(cfg.num_sequences) % num_classes
    labels = labels[torch.randperm(cfg.num_sequences, generator=gen)]
    tokens = []
    for lo in tqdm(range(0, cfg.num_sequences, cfg.sample_batch), desc="sample target", mininterval=5):
        batch = labels[lo : lo + cfg.sample_batch]
        gens = [torch.Generator().manual_seed(cfg.seed * 1_000_003 + lo + i) for i in range(batch.numel())]
        out = pipe(class_labels=batch.tolist(), decoding=cfg.sample_decoding, generator=gens, output_type="latent")
        tokens.append(out.images.flatten(1).to(torch.int16))
    return torch.cat(tokens), labels, model


def build_drafter(cfg: DrafterTrainConfig, target: LlamaGenGPT) -> LlamaGenGPT:
    t = target.config
    return LlamaGenGPT(vocab_size=t.vocab_size, dim=cfg.dim, n_layer=cfg.n_layer, n_head=cfg.n_head,
                       num_classes=t.num_classes, class_dropout_prob=cfg.class_dropout_prob, block_size=t.block_size,
                       token_dropout_p=0.0, resid_dropout_p=0.0, ffn_dropout_p=0.0)


def train_drafter(cfg: DrafterTrainConfig) -> dict:
    torch.manual_seed(cfg.seed)
    os.makedirs(cfg.out, exist_ok=True)
    cache = os.path.join(cfg.out, f"samples_{cfg.num_sequences}_{cfg.seed}.pt")
    start = time.time()
    if os.path.exists(cache):
        data = torch.load(cache, weights_only=True)
        tokens, labels = data["tokens"], data["labels"]
        from vispec.pipelines.llamagen import LlamaGenPipeline

        target = LlamaGenPipeline.from_pretrained(cfg.target).transformer.eval()
    else:
        tokens, labels, target = sample_target_sequences(cfg)
        torch.save({"tokens": tokens, "labels": labels}, cache)
    sample_minutes = (time.time() - start) / 60
    # eval mode throughout: no dropout layers are used, and the label dropout is done here (so the
    # teacher sees the same condition) rather than inside the model
    drafter = build_drafter(cfg, target).eval()
    opt = gpt_optimizer(drafter, cfg.lr, cfg.weight_decay)
    sched = warmup_cosine(opt, cfg.steps, warmup=100, floor=0.1)
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    train_start = time.time()
    with open(os.path.join(cfg.out, "train_log.jsonl"), "w") as log:
        bar = tqdm(range(cfg.steps), desc="train drafter", mininterval=5)
        for step in bar:
            pick = torch.randint(0, tokens.shape[0], (cfg.batch_size,), generator=gen)
            seq = tokens[pick].long()
            drop = torch.rand(cfg.batch_size, generator=gen) < cfg.class_dropout_prob
            cond = LlamaGenCondition(class_labels=labels[pick])
            with torch.no_grad():
                teacher = F.log_softmax(target(seq[:, :-1], cond, condition_drop=drop).float(), dim=-1)
            student = F.log_softmax(drafter(seq[:, :-1], cond, condition_drop=drop).float(), dim=-1)
            loss = F.kl_div(student, teacher, log_target=True, reduction="none").sum(-1).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
            opt.step()
            sched.step()
            if step % cfg.log_every == 0 or step == cfg.steps - 1:
                tv = 0.5 * (student.exp() - teacher.exp()).abs().sum(-1).mean().item()
                log.write(json.dumps({"step": step, "kl": loss.item(), "tv": round(tv, 4),
                                      "elapsed_s": round(time.time() - train_start, 1)}) + "\n")
                log.flush()
                bar.set_postfix(kl=f"{loss.item():.3f}", tv=f"{tv:.3f}")
    metrics = {"sample_minutes": round(sample_minutes, 1), "train_minutes": round((time.time() - train_start) / 60, 1),
               "final_kl": loss.item(), "final_tv": tv, "parameters": sum(p.numel() for p in drafter.parameters())}
    drafter.save_pretrained(cfg.out)
    write_record(cfg.out, cfg, metrics)
    return metrics


@dataclass
class DrafterAssembleConfig:
    drafter: str = "out/tiny-c2i-drafter"
    pipeline: str = "models/pretrained/tiny-c2i"
    lantern_k: int = 1000  # neighbour table stored with the pipeline (LANTERN's default k)


def assemble_drafter(cfg: DrafterAssembleConfig) -> dict:
    """Add a trained drafter to a pipeline folder (``drafter/`` component) and store the LANTERN
    neighbour table of its tokenizer, so ``decoding="sd"`` and ``acceptance="lantern"`` work offline."""
    from vispec.pipelines.llamagen import LlamaGenPipeline

    pipe = LlamaGenPipeline.from_pretrained(cfg.pipeline)
    drafter = LlamaGenGPT.from_pretrained(cfg.drafter).eval()
    if drafter.config.vocab_size != pipe.transformer.config.vocab_size:
        raise ValueError(f"drafter vocabulary {drafter.config.vocab_size} differs from the pipeline's {pipe.transformer.config.vocab_size}")
    pipe.register_modules(drafter=drafter)
    pipe.acceptance_rule(f"lantern:k={cfg.lantern_k}")  # computes and caches the raw-codebook table
    pipe.save_pretrained(cfg.pipeline)
    return {"drafter_parameters": sum(p.numel() for p in drafter.parameters()),
            "neighbors": list(pipe.lantern_neighbors["raw"].shape)}
