"""Training a tiny LLaDA2-layout block-diffusion model on the synthetic text tasks: sparse upcycling from tiny-mdlm,
then the block-diffusion SFT objective.

**Upcycling** (Komatsuzaki et al., "Sparse Upcycling: Training Mixture-of-Experts from Dense Checkpoints",
arXiv 2212.05055). :func:`upcycle_llada` turns a dense LLaDA (1.x layout, :class:`vispec.models.llada.LLaDAModelLM`)
into a :class:`vispec.models.llada2.LLaDA2MoeModelLM` that computes the same function under the same attention
pattern. Embeddings, norms, head and attention copy over (``q_proj``/``k_proj``/``v_proj`` fused into
``query_key_value``, ``attn_out`` → ``dense``; no QK norm, ``partial_rotary_factor = 1`` so RoPE rotates the whole
head as LLaDA does). The first ``first_k_dense_replace`` layers keep the dense SwiGLU. In a MoE layer the dense MLP's
``F`` hidden units split into ``F - m`` and ``m`` (``m = moe_intermediate_size``); a SwiGLU is a sum over its hidden
units, so ``mlp(z) = shared(z) + routed(z)`` with the shared expert holding the first ``F - m`` units
(``num_shared_experts = (F - m) / m``) and ``routed`` the last ``m``. Every routed expert is a copy of ``routed``
with its ``down_proj`` divided by ``routed_scaling_factor = ρ``. LLaDA2's router weighs the ``k > 1`` chosen experts
by ``ρ s_e / Σ s_e'`` (``norm_topk_prob``), weights that sum to ``ρ`` whatever the router picks, so at init

    moe(z) = Σ_{e ∈ top-k} ρ s_e / Σ s_e' · routed(z) / ρ + shared(z) = mlp(z)

exactly (up to float rounding); the router's own weights start random so the copies can drift apart in training.

**Objective** (block diffusion: Arriola et al., "Block Diffusion", arXiv 2503.09573 (BD3-LM); LLaDA2.0's
block-diffusion SFT). A training row is ``prompt ; answer <|eot_id|> EOS…`` with the answer canvas ``L`` long, cut
into blocks of ``Lb`` positions counted from the row's first token, as LLaDA2 decodes (:mod:`vispec.dllm.block_causal`).
Attention is block-causal: a position sees its own block and the earlier ones. Per row, one block ``c`` among those
the canvas touches is drawn uniformly; everything before it is clean (the prompt and the earlier answer blocks, as at
decoding time), and its canvas positions are masked independently with probability ``p = (1 - ε) t + ε``,
``t ~ U(0, 1)`` (stratified over the batch). Blocks after ``c`` cannot reach it under block-causal attention and get no
loss. The loss of a row is

    L = 1 / |canvas ∩ c| · Σ_{i ∈ canvas ∩ c, masked} CE(x_i, f(x_t)_i) / p

(LLaDA's SFT bound restricted to one block), averaged over the batch. ``edit_noise = q > 0`` adds LLaDA2.1's
token-to-token (T2T) data: each *unmasked* canvas position of block ``c`` is replaced by a random task token with
probability ``q``, and every unmasked canvas position of the block is trained towards its clean token,
``+ 1 / |canvas ∩ c| · Σ_{i ∈ canvas ∩ c, unmasked} CE(x_i, f(x_t)_i)``: a corrupted token must be restored, a right
one kept. Decoding with editing reads the model's prediction at committed positions (a T2T edit replaces a committed
token whose prediction differs with confidence above ``editing_threshold``); a model never trained there (M2T alone,
whose loss skips the unmasked positions) predicts arbitrary tokens at them, and the edits would destroy answers.

**Router balancing** (DeepSeek-V3's auxiliary-loss-free balancing, which LLaDA2's ``expert_bias`` implements): after
each step every MoE layer's ``expert_bias`` moves by ``± balance_rate`` towards the mean load (``b_e += γ sign(N̄ - N_e)``,
``N_e`` the tokens routed to expert ``e`` in the step); the bias changes which experts are chosen, never their weights.

:func:`evaluate_decoding` scores a model with vispec's block-causal decoder (:func:`vispec.dllm.decode`).
"""

from __future__ import annotations

import json
import os
import time
from typing import Union

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerFast

from vispec.eval.bench.text_tasks import TextTask, get_task, split_items
from vispec.eval.train.common import write_record
# their home: torch-free, for the CLI (re-exported here)
from vispec.eval.train.configs import LLaDA2AssembleConfig, LLaDA2TrainConfig, resolve_init_folders
from vispec.eval.train.mdlm import check_vocabulary, encode_items, make_tasks, score_answers, start_text_training
from vispec.eval.train.tokenizer import eot_token_id, load_text_tokenizer
from vispec.models.llada import LLaDAModelLM
from vispec.models.llada2 import LLaDA2MoeGate, LLaDA2MoeModelLM

__all__ = ["LLaDA2AssembleConfig", "LLaDA2TrainConfig", "assemble_llada2", "block_causal_batch", "block_diffusion_loss",
           "evaluate_decoding", "train_llada2", "upcycle_llada"]


# ------------------------------------------------------------------------------------------ upcycling
def upcycle_llada(dense: LLaDAModelLM, *, block_length: int = 32, num_experts: int = 4, num_experts_per_tok: int = 2,
                  moe_intermediate_size: int = 128, first_k_dense_replace: int = 1,
                  routed_scaling_factor: float = 2.5, seed: int = 0) -> LLaDA2MoeModelLM:
    """The LLaDA2-layout model computing ``dense``'s function (module docstring), in float32, train mode off.

    ``dense``'s MLP width must be a multiple of ``moe_intermediate_size`` and at least twice it (a shared part and one
    routed part); ``num_experts_per_tok >= 2`` (with one expert the router's weight is not normalised, so the mix would
    not be the dense MLP)."""
    c = dense.config
    width, m = c.mlp_hidden_size, moe_intermediate_size
    if not isinstance(m, int) or m < 1 or width % m or width // m < 2:
        raise ValueError(f"moe_intermediate_size must divide the dense MLP width ({width}) at least twice, got {m!r}")
    if not isinstance(num_experts_per_tok, int) or not 2 <= num_experts_per_tok <= num_experts:
        raise ValueError(f"num_experts_per_tok must lie in [2, num_experts={num_experts}] (the router normalises the "
                         f"weights of k > 1 experts only), got {num_experts_per_tok!r}")
    if not 0 <= first_k_dense_replace <= c.n_layers:
        raise ValueError(f"first_k_dense_replace must lie in [0, n_layers={c.n_layers}], got {first_k_dense_replace}")
    if c.embedding_size != c.vocab_size:
        raise ValueError(f"the dense model's embedding_size ({c.embedding_size}) must equal its vocab_size "
                         f"({c.vocab_size}) (LLaDA2 has no padded embedding rows)")
    torch.manual_seed(seed)
    model = LLaDA2MoeModelLM(
        vocab_size=c.vocab_size, hidden_size=c.d_model, intermediate_size=width, num_hidden_layers=c.n_layers,
        num_attention_heads=c.n_heads, num_key_value_heads=c.n_kv_heads or c.n_heads, head_dim=c.d_model // c.n_heads,
        use_qk_norm=False, rms_norm_eps=c.rms_norm_eps, max_position_embeddings=c.max_sequence_length,
        rope_theta=c.rope_theta, partial_rotary_factor=1.0, num_experts=num_experts, num_shared_experts=width // m - 1,
        num_experts_per_tok=num_experts_per_tok, n_group=1, topk_group=1, routed_scaling_factor=routed_scaling_factor,
        moe_intermediate_size=m, first_k_dense_replace=first_k_dense_replace, mask_token_id=c.mask_token_id,
        eos_token_id=c.eos_token_id, pad_token_id=c.pad_token_id, block_length=block_length,
    ).float()
    src = dense.model.transformer
    shared = width - m
    with torch.no_grad():
        model.model.word_embeddings.weight.copy_(src.wte.weight)
        model.model.norm.weight.copy_(src.ln_f.weight)
        model.lm_head.weight.copy_(src.ff_out.weight)
        for block, layer in zip(src.blocks, model.model.layers):
            layer.input_layernorm.weight.copy_(block.attn_norm.weight)
            layer.post_attention_layernorm.weight.copy_(block.ff_norm.weight)
            layer.attention.query_key_value.weight.copy_(
                torch.cat([block.q_proj.weight, block.k_proj.weight, block.v_proj.weight]))
            layer.attention.dense.weight.copy_(block.attn_out.weight)
            if not hasattr(layer.mlp, "experts"):
                layer.mlp.gate_proj.weight.copy_(block.ff_proj.weight)
                layer.mlp.up_proj.weight.copy_(block.up_proj.weight)
                layer.mlp.down_proj.weight.copy_(block.ff_out.weight)
                continue
            moe = layer.mlp
            moe.shared_experts.gate_proj.weight.copy_(block.ff_proj.weight[:shared])
            moe.shared_experts.up_proj.weight.copy_(block.up_proj.weight[:shared])
            moe.shared_experts.down_proj.weight.copy_(block.ff_out.weight[:, :shared])
            for expert in moe.experts:
                expert.gate_proj.weight.copy_(block.ff_proj.weight[shared:])
                expert.up_proj.weight.copy_(block.up_proj.weight[shared:])
                expert.down_proj.weight.copy_(block.ff_out.weight[:, shared:] / routed_scaling_factor)
    return model.eval()


# ------------------------------------------------------------------------------------------ objective
def block_causal_batch(attention_mask: torch.Tensor, block_length: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For left-padded rows (``attention_mask [B, T]``, 1 = real): ``(block [B, T], position_ids [B, T],
    mask4 [B, 1, T, T])``: each position's block counted from its row's first real token (-1 on padding), its RoPE
    position (0 on padding) and the block-causal attention (bool, True = attend; padded keys hidden, a padded query
    sees itself)."""
    real = attention_mask.bool()
    rel = real.long().cumsum(dim=1) - 1
    block = torch.where(real, rel.div(block_length, rounding_mode="floor"), torch.full_like(rel, -1))
    allowed = (block[:, None, :] <= block[:, :, None]) & real[:, None, :]
    allowed |= torch.eye(real.shape[1], dtype=torch.bool, device=real.device)[None]
    return block, rel.clamp(min=0), allowed[:, None]


def block_diffusion_loss(model: LLaDA2MoeModelLM, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                         answer_length: int, generator: torch.Generator, *, eps: float = 1e-3,
                         stratified_t: bool = True, edit_noise: float = 0.0, noise_tokens: torch.Tensor | None = None,
                         per_row: bool = False) -> torch.Tensor:
    """The block-diffusion loss (module docstring) of a batch whose last ``answer_length`` columns are the answer
    canvas; ``per_row=True`` returns each row's term ``[B]``. ``noise_tokens`` (1-D ids) are the T2T replacements
    (``edit_noise > 0``)."""
    batch, width = input_ids.shape
    Lb = model.config.block_length
    if Lb is None:
        raise ValueError("the model's config.block_length is None (bidirectional); block diffusion needs a block length")
    block, positions, mask4 = block_causal_batch(attention_mask, Lb)
    canvas = torch.zeros_like(block, dtype=torch.bool)
    canvas[:, width - answer_length:] = True
    first, last = block[:, width - answer_length], block[:, -1]
    chosen = first + (torch.rand(batch, generator=generator) * (last - first + 1)).long().clamp(max=last - first)
    noised = canvas & (block == chosen[:, None])  # [B, T]
    if stratified_t:
        t = (torch.randperm(batch, generator=generator) + torch.rand(batch, generator=generator)) / batch
    else:
        t = torch.rand(batch, generator=generator)
    p = (1 - eps) * t + eps
    draw = torch.rand(batch, width, generator=generator)
    masked = noised & (draw < p[:, None])
    noisy = torch.where(masked, model.config.mask_token_id, input_ids)
    corrupted = torch.zeros_like(masked)
    if edit_noise > 0:
        if noise_tokens is None or noise_tokens.numel() == 0:
            raise ValueError("edit_noise > 0 needs noise_tokens (the ids T2T corruption draws from)")
        corrupt_draw = torch.rand(batch, width, generator=generator)
        pick = noise_tokens[torch.randint(len(noise_tokens), (batch, width), generator=generator)]
        corrupted = noised & ~masked & (corrupt_draw < edit_noise) & (pick != input_ids)
        noisy = torch.where(corrupted, pick, noisy)
    device = model.device
    logits = model(noisy.to(device), attention_mask=mask4.to(device), position_ids=positions.to(device)).logits
    ce = F.cross_entropy(logits.transpose(1, 2), input_ids.to(device), reduction="none")  # [B, T]
    count = noised.sum(dim=1).clamp(min=1).to(device)
    rows = (ce * masked.to(device)).sum(dim=1) / (p.to(device) * count)
    if edit_noise > 0:  # T2T: restore the corrupted tokens, keep the right ones
        rows = rows + (ce * (noised & ~masked).to(device)).sum(dim=1) / count
    return rows if per_row else rows.mean()


class ExpertLoad:
    """Counts the tokens each MoE layer's router sends to each expert (forward hooks on the gates) and applies the
    auxiliary-loss-free bias update (module docstring)."""

    def __init__(self, model: LLaDA2MoeModelLM):
        self.gates = [m for m in model.modules() if isinstance(m, LLaDA2MoeGate)]
        self.counts = [torch.zeros(g.num_experts) for g in self.gates]
        self.handles = [g.register_forward_hook(self._hook(i)) for i, g in enumerate(self.gates)]

    def _hook(self, index: int):
        def record(module, inputs, output):
            experts = output[0].detach().reshape(-1).cpu()
            self.counts[index] += torch.bincount(experts, minlength=module.num_experts).float()
        return record

    def update(self, rate: float) -> list[list[float]]:
        """Move each gate's ``expert_bias`` towards balance; returns the step's load fractions and resets them."""
        loads = []
        for gate, counts in zip(self.gates, self.counts):
            if rate > 0 and gate.expert_bias is not None:
                gate.expert_bias += rate * torch.sign(counts.mean() - counts).to(gate.expert_bias)
            loads.append([round(v, 3) for v in (counts / counts.sum().clamp(min=1)).tolist()])
            counts.zero_()
        return loads

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


# ------------------------------------------------------------------------------------------ evaluation
@torch.no_grad()
def evaluate_decoding(model: LLaDA2MoeModelLM, tokenizer: PreTrainedTokenizerFast, task: Union[str, TextTask],
                      n: int = 256, *, gen_length: int = 32, strategy: str = "threshold", threshold: float = 0.9,
                      batch_size: int = 64, seed: int = 0, examples: int = 2) -> dict:
    """Metrics of vispec's block-causal decoder (blocks of the model's ``block_length``, ``cache="prefix"``, EOS early
    stop) on the first ``n`` test items of ``task``: ``strategy="threshold"`` (Fast-dLLM's rule at ``threshold``) or
    ``"llada2"`` (LLaDA2's defaults, :class:`vispec.dllm.TokenEditingScheduler`). Returns ``{"task", "n", <metric>,
    ..., "nfe": mean forwards per problem, "examples"}``."""
    from vispec.dllm import ThresholdScheduler, TokenEditingScheduler, decode

    task = get_task(task)
    if strategy not in ("threshold", "llada2"):
        raise ValueError(f"strategy must be 'threshold' or 'llada2', got {strategy!r}")
    scheduler = ThresholdScheduler(threshold=threshold) if strategy == "threshold" else TokenEditingScheduler()
    was_training = model.training
    model.eval()
    items = split_items(task, "test", n, seed)
    totals = {metric: 0.0 for metric in task.metrics}
    nfe, shown = 0.0, []
    Lb = model.config.block_length
    for lo in range(0, n, batch_size):
        chunk = items[lo: lo + batch_size]
        ids, mask = encode_items(tokenizer, chunk, 0, with_answers=False)
        out = decode(model, ids.to(model.device), mask.to(model.device), scheduler=scheduler, gen_length=gen_length, block_length=Lb, cache="prefix",
                     early_stop_eos=True, eot_token_id=eot_token_id(tokenizer))
        nfe += float(out.stats.nfe.float().sum())
        score_answers(task, tokenizer, chunk, out.tokens.cpu(), totals, shown, examples)
    model.train(was_training)
    return {"task": task.name, "n": n, **{k: v / n for k, v in totals.items()}, "nfe": round(nfe / n, 3),
            "strategy": strategy, **({"threshold": threshold} if strategy == "threshold" else {}), "examples": shown}


# ------------------------------------------------------------------------------------------ training
def _initial_model(cfg: LLaDA2TrainConfig, tasks: list[TextTask]) -> tuple[LLaDA2MoeModelLM, PreTrainedTokenizerFast]:
    """The upcycled dense model (``init_from`` a LLaDA 1.x folder or name) or a LLaDA2 folder to continue from."""
    from vispec.models.checkpoints import diffusers_load_kwargs

    model_path, tokenizer_path = resolve_init_folders(cfg.init_from)
    tokenizer = load_text_tokenizer(tokenizer_path)
    check_vocabulary(tokenizer, tasks, seed=cfg.seed)
    with open(os.path.join(model_path, "config.json")) as f:
        class_name = json.load(f).get("_class_name")
    if class_name == "LLaDA2MoeModelLM":
        model = LLaDA2MoeModelLM.from_pretrained(model_path, **diffusers_load_kwargs()).float()
        if model.config.block_length != cfg.block_length:
            raise ValueError(f"init_from={cfg.init_from!r} has block_length {model.config.block_length}, the config "
                             f"asks for {cfg.block_length}")
    elif class_name == "LLaDAModelLM":
        dense = LLaDAModelLM.from_pretrained(model_path, **diffusers_load_kwargs()).float()
        model = upcycle_llada(dense, block_length=cfg.block_length, num_experts=cfg.num_experts,
                              num_experts_per_tok=cfg.num_experts_per_tok,
                              moe_intermediate_size=cfg.moe_intermediate_size,
                              first_k_dense_replace=cfg.first_k_dense_replace,
                              routed_scaling_factor=cfg.routed_scaling_factor, seed=cfg.seed)
    else:
        raise ValueError(f"init_from={cfg.init_from!r}: its model is a {class_name}, expected LLaDAModelLM (upcycled) "
                         "or LLaDA2MoeModelLM (continued)")
    if model.config.vocab_size != len(tokenizer) or model.config.mask_token_id != tokenizer.mask_token_id:
        raise ValueError(f"init_from={cfg.init_from!r}: model vocabulary {model.config.vocab_size} / mask id "
                         f"{model.config.mask_token_id} do not match its tokenizer ({len(tokenizer)} / "
                         f"{tokenizer.mask_token_id})")
    return model, tokenizer


def _noise_tokens(tokenizer: PreTrainedTokenizerFast) -> torch.Tensor:
    """The ids T2T corruption draws from: every token but the special ones (mask, padding, BOS, EOS, EoT, unknown)."""
    special = {tokenizer.mask_token_id, tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id,
               tokenizer.unk_token_id, eot_token_id(tokenizer)}
    special |= set(tokenizer.all_special_ids)
    return torch.tensor([i for i in range(len(tokenizer)) if i not in special])


def _evaluate_all(model, tokenizer, tasks, n, cfg) -> dict:
    results = {}
    for task in tasks:
        for strategy in ("llada2", "threshold"):
            result = evaluate_decoding(model, tokenizer, task, n, gen_length=cfg.answer_length, strategy=strategy,
                                       threshold=cfg.eval_threshold, batch_size=cfg.eval_batch_size, seed=cfg.seed)
            results[f"{task.name}/{strategy}"] = {k: v for k, v in result.items() if k != "examples"}
    return results


def train_llada2(cfg: LLaDA2TrainConfig) -> dict:
    """Upcycle ``cfg.init_from`` (or continue a LLaDA2 folder), fine-tune with the block-diffusion objective (seeded),
    log to ``out/train_log.jsonl``, checkpoint ``out/transformer`` every ``checkpoint_every`` steps and at the end,
    save ``out/tokenizer`` and the record ``out/train_config.json``; returns the metrics (the model's accuracy and
    forwards before and after training on the configured tasks)."""
    cfg.validate()
    tasks = make_tasks(cfg)
    if cfg.threads > 0:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    os.makedirs(cfg.out, exist_ok=True)
    model, tokenizer = _initial_model(cfg, tasks)
    model.to(cfg.device)
    tokenizer.save_pretrained(os.path.join(cfg.out, "tokenizer"))
    metrics: dict = {"parameters": sum(p.numel() for p in model.parameters())}
    if cfg.initial_eval_n:
        tick = time.time()
        metrics["initial_eval"] = _evaluate_all(model, tokenizer, tasks, cfg.initial_eval_n, cfg)
        print(json.dumps({"initial_eval": metrics["initial_eval"], "eval_s": round(time.time() - tick, 1)}), flush=True)
    noise_tokens = _noise_tokens(tokenizer)
    load = ExpertLoad(model)
    opt, sched, streams, picker, gen = start_text_training(model, cfg, tasks)
    start, train_s, step = time.time(), 0.0, -1
    evals: list[dict] = []
    save = lambda: model.save_pretrained(os.path.join(cfg.out, "transformer"))  # noqa: E731
    with open(os.path.join(cfg.out, "train_log.jsonl"), "w") as log:
        bar = tqdm(range(cfg.steps), desc="train llada2", mininterval=5)
        for step in bar:
            tick = time.time()
            choice = picker.choices(range(len(streams)), weights=cfg.task_weights, k=cfg.batch_size)
            ids, mask = encode_items(tokenizer, [next(streams[c]) for c in choice], cfg.answer_length)
            rows = block_diffusion_loss(model, ids, mask, cfg.answer_length, gen, eps=cfg.mask_eps,
                                        stratified_t=cfg.stratified_t, edit_noise=cfg.edit_noise,
                                        noise_tokens=noise_tokens, per_row=True)
            loss = rows.mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            with torch.no_grad():
                loads = load.update(cfg.balance_rate)
            train_s += time.time() - tick
            last = step == cfg.steps - 1 or (cfg.max_minutes > 0 and train_s > 60 * cfg.max_minutes)
            if step % cfg.log_every == 0 or last:
                picked = torch.tensor(choice)
                by_task = {t: round(rows[picked == i].mean().item(), 4) for i, t in enumerate(cfg.tasks) if (picked == i).any()}
                record = {"step": step, "loss": round(loss.item(), 4), "loss_by_task": by_task, "lr": sched.get_last_lr()[0],
                          "expert_load": loads, "train_s": round(train_s, 1), "elapsed_s": round(time.time() - start, 1)}
                log.write(json.dumps(record) + "\n")
                log.flush()
                bar.set_postfix(loss=f"{loss.item():.3f}")
            if cfg.checkpoint_every and step > 0 and step % cfg.checkpoint_every == 0:
                save()
            if cfg.eval_every and step > 0 and step % cfg.eval_every == 0:
                result = evaluate_decoding(model, tokenizer, tasks[0], cfg.eval_n, gen_length=cfg.answer_length,
                                           threshold=cfg.eval_threshold, batch_size=cfg.eval_batch_size, seed=cfg.seed)
                evals.append({"step": step, **{k: v for k, v in result.items() if k != "examples"}})
                log.write(json.dumps({"step": step, "eval": result}) + "\n")
                log.flush()
            if last:
                break
    load.close()
    model.eval()
    metrics.update({"train_minutes": round(train_s / 60, 1), "steps_done": step + 1, "final_loss": loss.item(),
                    "seconds_per_step": round(train_s / (step + 1), 3), "progress": evals})
    save()
    if cfg.final_eval_n:
        tick = time.time()
        metrics["eval"] = _evaluate_all(model, tokenizer, tasks, cfg.final_eval_n, cfg)
        print(json.dumps({"final_eval": metrics["eval"], "eval_s": round(time.time() - tick, 1)}), flush=True)
    write_record(cfg.out, cfg, metrics)
    return metrics


# ------------------------------------------------------------------------------------------ the pipeline folder
def _card_scores(results: dict) -> str:
    return "; ".join(f"{key} {next(v for k, v in r.items() if k in ('strict_match', 'exact_match')):.3f} "
                     f"(NFE {r['nfe']:.2f})" for key, r in results.items())


def assemble_llada2(cfg: LLaDA2AssembleConfig) -> dict:
    """Write the trained model as a :class:`vispec.pipelines.MaskedDiffusionLMPipeline` folder (``model/``,
    ``tokenizer/``, ``scheduler/``: LLaDA2's own rule, :class:`vispec.dllm.TokenEditingScheduler` at diffusers'
    defaults), its card (README.md with the training record) and ``logs/model.jsonl``."""
    import shutil

    from vispec.dllm import TokenEditingScheduler
    from vispec.eval.train.assemble import read_record, write_pipeline_folder
    from vispec.models.checkpoints import diffusers_load_kwargs
    from vispec.pipelines import MaskedDiffusionLMPipeline

    cfg.validate()
    record = read_record(cfg.trained, required=True)
    config, metrics = record["config"], record.get("metrics", {})
    model = LLaDA2MoeModelLM.from_pretrained(os.path.join(cfg.trained, "transformer"), **diffusers_load_kwargs()).eval()
    tokenizer = load_text_tokenizer(os.path.join(cfg.trained, "tokenizer"))
    gen_length = cfg.gen_length or config["answer_length"]
    c = model.config
    pipe = MaskedDiffusionLMPipeline(model=model, tokenizer=tokenizer, scheduler=TokenEditingScheduler(),
                                     default_gen_length=gen_length, default_block_length=c.block_length)
    name = os.path.basename(os.path.normpath(cfg.out))
    parameters = sum(p.numel() for p in model.parameters())
    active = parameters - (c.num_hidden_layers - c.first_k_dense_replace) * (c.num_experts - c.num_experts_per_tok) \
        * 3 * c.hidden_size * c.moe_intermediate_size
    card = [
        f"# {name}: vispec's embedded LLaDA2-style block-diffusion model",
        "",
        "A mask predictor in the LLaDA2.0 / 2.1 layout (vispec.models.llada2.LLaDA2MoeModelLM, the official BailingMoe-v2",
        "parameter names and config keys): block-causal attention over blocks of "
        f"{c.block_length} positions, a mixture-of-experts MLP",
        f"from layer {c.first_k_dense_replace} on ({c.num_experts} routed experts of width {c.moe_intermediate_size}, "
        f"{c.num_experts_per_tok} per token, sigmoid router",
        f"with LLaDA2's normalised top-k weights x {c.routed_scaling_factor} and load-balancing expert bias, and a shared "
        f"expert of width {c.num_shared_experts * c.moe_intermediate_size}).",
        "It was *upcycled* from tiny-mdlm (vispec.eval.train.llada2.upcycle_llada: attention, embeddings and norms",
        "copied, every routed expert a copy of the dense MLP's last hidden units and the shared expert the rest, so",
        "under tiny-mdlm's bidirectional attention the upcycled model computes tiny-mdlm's function, up to float",
        "rounding) and fine-tuned with the block-diffusion objective (one block of the answer noised, the blocks before",
        f"it clean; LLaDA2.1's token-to-token data: unmasked tokens corrupted at rate {config['edit_noise']}, every "
        "unmasked token trained to be kept or restored) on vispec's synthetic tasks",
        "(vispec.eval.bench.text_tasks: arithmetic word problems in GSM8K format, sorting digits, reversing letters).",
        "",
        f"- Model: {parameters / 1e6:.2f}M parameters ({active / 1e6:.2f}M active per token), hidden {c.hidden_size}, "
        f"{c.num_hidden_layers} layers, {c.num_attention_heads} heads, vocabulary {c.vocab_size} (tiny-mdlm's tokenizer).",
        f"- Training: {metrics.get('steps_done', config['steps'])} steps of {config['batch_size']} rows at lr "
        f"{config['lr']}, task weights {dict(zip(config['tasks'], config['task_weights']))}, answer canvas "
        f"{config['answer_length']}, {metrics.get('train_minutes', '?')} min on {config['device']} "
        f"({config['threads']} thread(s)).",
        f"- Defaults: gen length {gen_length}, block length {c.block_length}, scheduler: LLaDA2's own rule at diffusers' "
        "LLaDA2Pipeline defaults (TokenEditingScheduler: threshold 0.7, editing_threshold 0.5, max_post_steps 16, "
        "32 steps per block). Pass strategy='threshold' (or 'factor', 'entropy') and cache='prefix' for vispec's "
        "policies with the exact block cache.",
        "- Loads in diffusers too: `LLaDA2Pipeline(model=pipe.model, scheduler=BlockRefinementScheduler(), "
        "tokenizer=pipe.tokenizer)`.",
        f"- Reproduce with {cfg.script} (seeded).",
    ]
    if metrics.get("initial_eval"):
        card.append(f"- Upcycled, before fine-tuning ({next(iter(metrics['initial_eval'].values()))['n']} test problems "
                    f"per task, block-causal decoding): {_card_scores(metrics['initial_eval'])}.")
    if metrics.get("eval"):
        card.append(f"- After fine-tuning ({next(iter(metrics['eval'].values()))['n']} test problems per task; "
                    f"llada2 = LLaDA2's defaults, threshold = vispec's threshold {config['eval_threshold']} with the "
                    f"prefix cache): {_card_scores(metrics['eval'])}.")
    if cfg.bench:
        with open(cfg.bench) as f:
            bench = json.load(f)
        n = bench["config"]["num_problems"]
        card += ["", f"## Forwards against diffusers' LLaDA2Pipeline defaults ({n} test problems, batch 1, "
                     "samples/bench_text_llada2.py)", "", "```"]
        card += [f"{r['task']:<11} {r['setting']:<52} acc {r[get_task(r['task']).metrics[0]]:.3f} "
                 f"({100 * r.get('accuracy_diff', 0):+5.1f} ± {100 * r.get('accuracy_diff_ci95', 0):4.1f})  "
                 f"NFE {r['nfe']:.2f}  x{r['nfe_reduction']:.2f}  tok/fwd {r['tokens_per_forward']:.2f}"
                 for r in bench["runs"]]
        card += ["```", "acc (a ± b): accuracy, and its difference from diffusers' defaults on the same problems in points "
                 "with a 95% paired interval; xN: diffusers' forwards over the setting's."]
    extras = {"logs/model.jsonl": lambda path: shutil.copy(os.path.join(cfg.trained, "train_log.jsonl"), path)}
    return write_pipeline_folder(pipe, cfg.out, card, record, record_title="Training record", extras=extras)
