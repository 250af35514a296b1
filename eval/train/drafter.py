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

import os
import time

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from vispec.eval.train.common import fit_sequences, write_record
from vispec.eval.train.configs import DrafterTrainConfig  # its home: torch-free, for the CLI (re-exported here)
from vispec.models.llamagen_gpt import LlamaGenCondition, LlamaGenGPT


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
    cfg.validate()
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

    def distillation_loss(seq: torch.Tensor, labels: torch.Tensor, gen: torch.Generator):
        """KL(p_target || q_drafter) per position, under a condition dropped with probability class_dropout_prob."""
        drop = torch.rand(seq.shape[0], generator=gen) < cfg.class_dropout_prob
        cond = LlamaGenCondition(class_labels=labels)
        with torch.no_grad():
            teacher = F.log_softmax(target(seq[:, :-1], cond, condition_drop=drop).float(), dim=-1)
        student = F.log_softmax(drafter(seq[:, :-1], cond, condition_drop=drop).float(), dim=-1)
        kl = F.kl_div(student, teacher, log_target=True, reduction="none").sum(-1).mean()

        def tv() -> dict:  # total variation from the teacher, on logged steps only
            return {"tv": round(0.5 * (student.exp() - teacher.exp()).abs().sum(-1).mean().item(), 4)}

        return kl, tv

    train_start = time.time()
    last = fit_sequences(drafter, tokens, labels, cfg, distillation_loss, desc="train drafter", loss_name="kl")
    metrics = {"sample_minutes": round(sample_minutes, 1), "train_minutes": round((time.time() - train_start) / 60, 1),
               "final_kl": last["kl"], "final_tv": last["tv"], "parameters": sum(p.numel() for p in drafter.parameters())}
    drafter.save_pretrained(cfg.out)
    write_record(cfg.out, cfg, metrics)
    return metrics
