"""Training a small LLaDA on the synthetic text tasks with LLaDA's SFT objective, and a greedy evaluator.

Objective (Nie et al., arXiv 2502.09992, SFT; spec ``dllm.md`` §1.2): a sequence is ``prompt ; answer``
where the answer is ``answer <|eot_id|>`` padded with EOS to a fixed ``answer_length`` (the padding is
trained too, as LLaDA does). Per sequence draw ``t ~ U(0, 1)``, set ``p = (1 - eps) t + eps`` and mask
each answer token independently with probability ``p``; the prompt is never masked. The loss is

    L = 1 / (B * answer_length) * sum_b sum_{i masked in b} CE(x_i, f(x_t)_i) / p_b,

an upper bound on the negative log-likelihood of the answer. ``stratified_t`` draws the batch's ``t`` one
per stratum ``[k/B, (k+1)/B)`` (each still uniform on its own), which lowers the variance of the batch loss.

:func:`evaluate_greedy` decodes the answer one token per step (``steps = answer_length``), as one block or in
LLaDA's semi-autoregressive blocks: each step commits the masked position of the current block whose argmax has
the highest probability (LLaDA "low_confidence" remasking, temperature 0) and reports the task's metrics on its
test split.

Fine-tuning (``init_from``) starts from a trained model and its tokenizer (tiny-mdlm-long starts from tiny-mdlm);
a canvas length mix (``long_answer_length`` every ``long_every`` steps) teaches the EOS padding of a long
generation canvas without paying for long sequences on every step.
"""

from __future__ import annotations

import json
import math
import os
import random
import time
from typing import Union

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerFast

from vispec.eval.bench.text_tasks import TextItem, TextTask, get_task, split_items, train_stream
from vispec.eval.train.common import adamw, warmup_cosine, write_record
# their home: torch-free, for the CLI (re-exported here)
from vispec.eval.train.configs import MDLMTrainConfig, resolve_init_folders
from vispec.eval.train.tokenizer import answer_ids, decode_answer, eot_token_id, prompt_ids, train_task_tokenizer
from vispec.models.llada import LLaDAModelLM


# ------------------------------------------------------------------------------------------ data
def encode_items(
    tokenizer: PreTrainedTokenizerFast, items: list[TextItem], answer_length: int, with_answers: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask)`` ``[B, P + answer_length]``: prompts left-padded to the longest, then
    the answer canvas (EOS-padded answers, or all mask tokens when ``with_answers=False``)."""
    prompts = [prompt_ids(tokenizer, item.prompt) for item in items]
    width = max(len(p) for p in prompts)
    rows, masks = [], []
    for item, prompt in zip(items, prompts):
        canvas = answer_ids(tokenizer, item.answer, answer_length) if with_answers else [tokenizer.mask_token_id] * answer_length
        pad = width - len(prompt)
        rows.append([tokenizer.pad_token_id] * pad + prompt + canvas)
        masks.append([0] * pad + [1] * (len(prompt) + answer_length))
    return torch.tensor(rows), torch.tensor(masks)


def sft_loss(
    model: LLaDAModelLM,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    answer_length: int,
    generator: torch.Generator,
    eps: float = 1e-3,
    stratified_t: bool = True,
    per_row: bool = False,
) -> torch.Tensor:
    """LLaDA SFT loss (module docstring) for a batch whose last ``answer_length`` columns are the answer;
    ``per_row=True`` returns each row's term ``[B]`` (their mean is the loss)."""
    batch = input_ids.shape[0]
    if stratified_t:
        t = (torch.randperm(batch, generator=generator) + torch.rand(batch, generator=generator)) / batch
    else:
        t = torch.rand(batch, generator=generator)
    p_mask = (1 - eps) * t + eps
    masked = torch.rand(batch, answer_length, generator=generator) < p_mask[:, None]
    targets = input_ids[:, -answer_length:]
    noisy = input_ids.clone()
    noisy[:, -answer_length:] = torch.where(masked, model.config.mask_token_id, targets)
    logits = model(noisy.to(model.device), attention_mask.to(model.device)).logits[:, -answer_length:]
    masked = masked.to(model.device)
    ce = F.cross_entropy(logits.transpose(1, 2), targets.to(model.device), reduction="none")  # [B, L]
    rows = (ce * masked).sum(dim=1) / (p_mask.to(model.device) * answer_length)
    return rows if per_row else rows.mean()


# ------------------------------------------------------------------------------------------ decoding
def _answer_settled(answers: torch.Tensor, mask_id: int, stop_ids: tuple[int, ...]) -> torch.Tensor:
    """``[B]`` bool: the row has a committed stop token (EOS / EoT) and every position before the first one is
    committed, so the text :func:`decode_answer` reads from it can no longer change."""
    is_stop = torch.zeros_like(answers, dtype=torch.bool)
    for token in stop_ids:
        is_stop |= answers == token
    has_stop = is_stop.any(dim=1)
    first = torch.where(has_stop, is_stop.int().argmax(dim=1), torch.full_like(has_stop, answers.shape[1], dtype=torch.long))
    before = torch.arange(answers.shape[1], device=answers.device)[None, :] < first[:, None]
    return has_stop & ~((answers == mask_id) & before).any(dim=1)


@torch.no_grad()
def decode_low_confidence(
    model: LLaDAModelLM, input_ids: torch.Tensor, attention_mask: torch.Tensor, answer_length: int,
    block_length: int = 0, stop_ids: tuple[int, ...] = (),
) -> torch.Tensor:
    """Fill the last ``answer_length`` (masked) columns, one token per step per row, highest-confidence
    position first (LLaDA ``low_confidence``, temperature 0). ``block_length`` > 0 decodes semi-autoregressively
    in blocks of that many columns, left to right (LLaDA's blocks, ``steps = answer_length``); 0 is one block.
    ``stop_ids`` (EOS, EoT) given: a row stops once its text up to the first committed stop token is complete
    (its later columns stay masked; :func:`decode_answer` reads the same text). Returns the answers ``[B, L]``."""
    block_length = block_length or answer_length
    if block_length < 1 or answer_length % block_length:
        raise ValueError(f"block_length must divide answer_length ({answer_length}), got {block_length}")
    x = input_ids.clone().to(model.device)
    attention_mask = attention_mask.to(model.device)
    mask_id, rows = model.config.mask_token_id, torch.arange(x.shape[0], device=x.device)
    start = x.shape[1] - answer_length
    done = torch.zeros(x.shape[0], dtype=torch.bool, device=x.device)
    for lo in range(0, answer_length, block_length):
        for _ in range(block_length):
            still = x[:, start + lo : start + lo + block_length] == mask_id
            still &= ~done[:, None]
            if not bool(still.any()):
                break
            logits = model(x, attention_mask).logits[:, start + lo : start + lo + block_length]
            confidence, prediction = torch.softmax(logits, dim=-1).max(dim=-1)
            confidence = confidence.masked_fill(~still, -math.inf)
            pick = confidence.argmax(dim=-1)
            active = still.any(dim=-1)
            x[rows[active], start + lo + pick[active]] = prediction[rows, pick][active]
            if stop_ids:
                done |= _answer_settled(x[:, start:], mask_id, stop_ids)
        if bool(done.all()):
            break
    return x[:, start:]


@torch.no_grad()
def score_answers(task: TextTask, tokenizer: PreTrainedTokenizerFast, items: list[TextItem], answers: torch.Tensor,
                  totals: dict, shown: list, examples: int) -> None:
    """Add the task's metrics of each decoded answer row (``answers``, token ids) to ``totals`` and keep the first
    ``examples`` prompts, completions and targets in ``shown`` (the evaluators of this module and of
    :mod:`vispec.eval.train.llada2`)."""
    for item, row in zip(items, answers):
        completion = decode_answer(tokenizer, row.tolist())
        for metric, value in task.score(completion, item).items():
            totals[metric] += value
        if len(shown) < examples:
            shown.append({"prompt": item.prompt, "completion": completion, "target": item.answer})


def evaluate_greedy(
    model: LLaDAModelLM,
    tokenizer: PreTrainedTokenizerFast,
    task: Union[str, TextTask],
    n: int = 500,
    *,
    answer_length: int = 32,
    batch_size: int = 64,
    seed: int = 0,
    examples: int = 2,
    block_length: int = 0,
) -> dict:
    """Metrics of one-token-per-step greedy decoding (``block_length``: LLaDA blocks, 0 = one block) on the first
    ``n`` test items of ``task``: ``{"task", "n", <metric>: mean, ..., "examples": [{"prompt", "completion",
    "target"}, ...]}``. A row stops once its text before the first EOS / EoT is complete (same scores, less work)."""
    task = get_task(task)
    if n < 1 or batch_size < 1:
        raise ValueError(f"n and batch_size must be >= 1, got n={n}, batch_size={batch_size}")
    was_training = model.training
    model.eval()
    items = split_items(task, "test", n, seed)
    totals = {metric: 0.0 for metric in task.metrics}
    shown = []
    for lo in range(0, n, batch_size):
        chunk = items[lo : lo + batch_size]
        ids, mask = encode_items(tokenizer, chunk, answer_length, with_answers=False)
        answers = decode_low_confidence(model, ids, mask, answer_length, block_length,
                                        stop_ids=(tokenizer.eos_token_id, eot_token_id(tokenizer))).cpu()
        score_answers(task, tokenizer, chunk, answers, totals, shown, examples)
    model.train(was_training)
    return {"task": task.name, "n": n, **{k: v / n for k, v in totals.items()}, "examples": shown}


# ------------------------------------------------------------------------------------------ training
def make_tasks(cfg: MDLMTrainConfig) -> list[TextTask]:
    """The configured tasks: ``cfg.tasks`` by name, with ``cfg.task_options[name]`` overriding their fields."""
    unknown = sorted(set(cfg.task_options) - set(cfg.tasks))
    if unknown:
        raise ValueError(f"task_options names tasks that are not trained: {unknown} (tasks: {list(cfg.tasks)})")
    tasks = [get_task(name) for name in cfg.tasks]
    return [type(t)(**cfg.task_options[t.name]) if t.name in cfg.task_options else t for t in tasks]


def build_model(cfg: MDLMTrainConfig, tokenizer: PreTrainedTokenizerFast) -> LLaDAModelLM:
    vocab = len(tokenizer)
    return LLaDAModelLM(
        d_model=cfg.d_model, n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads or None, n_layers=cfg.n_layers,
        mlp_hidden_size=cfg.mlp_hidden_size, vocab_size=vocab, embedding_size=vocab,
        max_sequence_length=256, rope_theta=cfg.rope_theta, mask_token_id=tokenizer.mask_token_id,
        eos_token_id=tokenizer.eos_token_id, eot_token_id=eot_token_id(tokenizer), pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )


def check_vocabulary(tokenizer: PreTrainedTokenizerFast, tasks: list[TextTask], n_per_task: int = 200, seed: int = 0) -> None:
    """Raise ``ValueError`` unless every word of every task (its vocabulary and ``n_per_task`` train items) is a
    known token of ``tokenizer``."""
    unknown = set()
    for task in tasks:
        words = set(task.words())
        for item in split_items(task, "train", n_per_task, seed):
            words.update(item.prompt.split() + item.answer.split())
        unknown |= {f"{task.name}:{w}" for w in words if tokenizer.convert_tokens_to_ids(w) == tokenizer.unk_token_id}
    if unknown:
        raise ValueError(f"init_from: the tokenizer lacks task words {sorted(unknown)[:20]}")


def start_text_training(model: torch.nn.Module, cfg, tasks: list[TextTask]) -> tuple:
    """What the text trainers (this one, :mod:`vispec.eval.train.llada2`) set up before their first step: ``model``
    in training mode, AdamW with warm-up and cosine decay to 10%, one training stream per task, the task picker and
    the masking generator, all seeded from ``cfg.seed``. Returns ``(optimizer, scheduler, streams, picker, gen)``."""
    model.train()
    opt = adamw(model, cfg.lr, cfg.weight_decay)
    sched = warmup_cosine(opt, cfg.steps, warmup=cfg.warmup, floor=0.1)
    streams = [train_stream(task, cfg.seed) for task in tasks]
    return opt, sched, streams, random.Random(cfg.seed), torch.Generator().manual_seed(cfg.seed + 1)


def train_mdlm(cfg: MDLMTrainConfig) -> dict:
    """Train (seeded), log to ``out/train_log.jsonl``, save ``out/transformer`` (diffusers folder),
    ``out/tokenizer`` and ``out/train_config.json``; returns the metrics."""
    cfg.validate()
    tasks = make_tasks(cfg)
    if cfg.threads > 0:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    os.makedirs(cfg.out, exist_ok=True)
    if cfg.init_from:
        from vispec.eval.train.tokenizer import load_text_tokenizer
        from vispec.models.checkpoints import diffusers_load_kwargs

        model_path, tokenizer_path = resolve_init_folders(cfg.init_from)
        tokenizer = load_text_tokenizer(tokenizer_path)
        check_vocabulary(tokenizer, tasks, seed=cfg.seed)
        model = LLaDAModelLM.from_pretrained(model_path, **diffusers_load_kwargs()).float()
        if model.config.vocab_size != len(tokenizer) or model.config.mask_token_id != tokenizer.mask_token_id:
            raise ValueError(f"init_from={cfg.init_from!r}: model vocabulary {model.config.vocab_size} / mask id "
                             f"{model.config.mask_token_id} do not match its tokenizer ({len(tokenizer)} / {tokenizer.mask_token_id})")
    else:
        tokenizer = train_task_tokenizer(tasks, cfg.tokenizer_corpus, cfg.seed)
        model = build_model(cfg, tokenizer)
    tokenizer.save_pretrained(os.path.join(cfg.out, "tokenizer"))
    opt, sched, streams, picker, gen = start_text_training(model, cfg, tasks)
    start, train_s, step = time.time(), 0.0, -1
    evals: list[dict] = []
    with open(os.path.join(cfg.out, "train_log.jsonl"), "w") as log:
        bar = tqdm(range(cfg.steps), desc="train mdlm", mininterval=5)
        for step in bar:
            tick = time.time()
            long = cfg.long_every and step % cfg.long_every == cfg.long_every - 1
            length = cfg.long_answer_length if long else cfg.answer_length
            batch = cfg.long_batch_size or cfg.batch_size if long else cfg.batch_size
            choice = picker.choices(range(len(streams)), weights=cfg.task_weights, k=batch)
            ids, mask = encode_items(tokenizer, [next(streams[c]) for c in choice], length)
            rows = sft_loss(model, ids, mask, length, gen, cfg.mask_eps, cfg.stratified_t, per_row=True)
            loss = rows.mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            train_s += time.time() - tick
            last = step == cfg.steps - 1 or (cfg.max_minutes > 0 and train_s > 60 * cfg.max_minutes)
            if step % cfg.log_every == 0 or last:
                picked = torch.tensor(choice)
                by_task = {t: round(rows[picked == i].mean().item(), 4) for i, t in enumerate(cfg.tasks) if (picked == i).any()}
                record = {"step": step, "loss": round(loss.item(), 4), "loss_by_task": by_task, "lr": sched.get_last_lr()[0],
                          **({"answer_length": length} if cfg.long_every else {}),
                          "train_s": round(train_s, 1), "elapsed_s": round(time.time() - start, 1)}
                log.write(json.dumps(record) + "\n")
                log.flush()
                bar.set_postfix(loss=f"{loss.item():.3f}")
            if cfg.eval_every and step > 0 and step % cfg.eval_every == 0:
                for task in tasks if cfg.eval_all_tasks else tasks[:1]:
                    result = evaluate_greedy(model, tokenizer, task, cfg.eval_n, answer_length=cfg.answer_length,
                                             batch_size=cfg.eval_batch_size)
                    evals.append({"step": step, **{k: v for k, v in result.items() if k != "examples"}})
                    log.write(json.dumps({"step": step, "eval": result}) + "\n")
                    log.flush()
            if last:
                break
    model.eval()
    metrics = {"train_minutes": round(train_s / 60, 1), "steps_done": step + 1, "final_loss": loss.item(),
               "seconds_per_step": round(train_s / (step + 1), 3), "parameters": sum(p.numel() for p in model.parameters())}
    model.save_pretrained(os.path.join(cfg.out, "transformer"))
    metrics["progress"] = evals
    if cfg.final_eval_n:
        eval_length = cfg.eval_answer_length or cfg.answer_length
        metrics["eval"] = {}
        for task in tasks:
            tick = time.time()
            result = evaluate_greedy(model, tokenizer, task, cfg.final_eval_n, answer_length=eval_length,
                                     batch_size=cfg.eval_batch_size, block_length=cfg.eval_block_length)
            metrics["eval"][task.name] = {k: v for k, v in result.items() if k != "examples"}
            if cfg.eval_answer_length or cfg.eval_block_length:  # a canvas other than the training one: say which
                metrics["eval"][task.name].update(gen_length=eval_length, block_length=cfg.eval_block_length or eval_length)
            print(json.dumps({"final_eval": metrics["eval"][task.name], "eval_s": round(time.time() - tick, 1),
                              "examples": result["examples"]}), flush=True)
    write_record(cfg.out, cfg, metrics)
    return metrics
