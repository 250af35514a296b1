"""Plain, obviously-correct Dream references written from the documented behaviour (spec ``dllm.md`` §2).

* :func:`dream_forward`: a Qwen2-style decoder with the causal mask removed, run straight from the official
  tensor names (``model.layers.{i}.self_attn.q_proj.weight`` ...): RMSNorm, q/k/v with biases, half-split RoPE
  at ``position_ids``, grouped-query attention under Dream's 4-D boolean mask ``A[b, i, j]``, SwiGLU MLP, final
  norm, LM head. It returns the *unshifted* logits, as Dream's model does (its sampler shifts them).
* :func:`dream_sample`: Dream's ``_sample`` loop at temperature 0 for the deterministic algorithms
  (``maskgit_plus``, ``topk_margin``, ``entropy``; ``alg_temp`` None): pad the prompt with masks, build the
  4-D mask ``valid_i ∧ valid_j`` and ``tok_idx = cumsum(mask) - 1`` when something is padded, ``t =
  linspace(1, eps, steps + 1)``, shift the logits, process them (top-p, then top-k, softmax), rank by the
  confidence and commit ``int(mean_b M_b · (1 - s / t))`` positions per row, the most confident (all on the last
  step; ties to the lowest position, where Dream's ``torch.topk`` leaves the order unspecified). The mask count is averaged over the batch, as Dream does: compare vispec (per-row counts) with it
  row by row at batch size 1.
* :func:`write_dream_folder`: a checkpoint folder in the official layout (``config.json``, sharded
  safetensors with ``model.safetensors.index.json``, or a single ``model.safetensors``).

Loops and one-row-at-a-time logic are fine here: this is the yardstick, not the implementation.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from safetensors.torch import save_file


def tiny_dream_config(**changes) -> dict:
    """A tiny ``config.json`` with the official keys (plus keys a loader must ignore)."""
    config = {
        "architectures": ["DreamModel"], "auto_map": {"AutoConfig": "configuration_dream.DreamConfig",
                                                      "AutoModel": "modeling_dream.DreamModel"},
        "model_type": "Dream", "attention_dropout": 0.0, "bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 1,
        "mask_token_id": 60, "hidden_act": "silu", "hidden_size": 32, "initializer_range": 0.02,
        "intermediate_size": 48, "max_position_embeddings": 128, "max_window_layers": 2, "num_attention_heads": 4,
        "num_hidden_layers": 2, "num_key_value_heads": 2, "rms_norm_eps": 1e-6, "rope_scaling": None,
        "rope_theta": 10000.0, "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "float32",
        "transformers_version": "4.46.2", "use_cache": False, "use_sliding_window": False, "vocab_size": 64,
    }
    config.update(changes)
    return config


def random_dream_state(config: dict, seed: int = 0, std: float = 0.2) -> dict[str, torch.Tensor]:
    """Random float32 weights under the official names for ``config`` (biases on q/k/v only)."""
    gen = torch.Generator().manual_seed(seed)
    hidden, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    kv = config["num_key_value_heads"] * (hidden // config["num_attention_heads"])
    normal = lambda *shape: torch.randn(*shape, generator=gen) * std  # noqa: E731
    norm = lambda: 1.0 + 0.1 * torch.randn(hidden, generator=gen)  # noqa: E731
    state = {"model.embed_tokens.weight": normal(vocab, hidden) * 5, "model.norm.weight": norm(),
             "lm_head.weight": normal(vocab, hidden) * 2}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        state |= {p + "self_attn.q_proj.weight": normal(hidden, hidden), p + "self_attn.q_proj.bias": normal(hidden),
                  p + "self_attn.k_proj.weight": normal(kv, hidden), p + "self_attn.k_proj.bias": normal(kv),
                  p + "self_attn.v_proj.weight": normal(kv, hidden), p + "self_attn.v_proj.bias": normal(kv),
                  p + "self_attn.o_proj.weight": normal(hidden, hidden), p + "mlp.gate_proj.weight": normal(inter, hidden),
                  p + "mlp.up_proj.weight": normal(inter, hidden), p + "mlp.down_proj.weight": normal(hidden, inter),
                  p + "input_layernorm.weight": norm(), p + "post_attention_layernorm.weight": norm()}
    return state


def write_dream_folder(folder: Path, state: dict[str, torch.Tensor], config: dict, *, sharded: bool = True,
                       drop: Sequence[str] = (), extra: Optional[dict[str, torch.Tensor]] = None) -> Path:
    """Write ``config.json`` and the weights in the official layout (two shards + index, or one file)."""
    folder = Path(folder)
    folder.mkdir(parents=True)
    sd = {k: v.clone().contiguous() for k, v in state.items() if k not in drop}
    sd.update(extra or {})
    names = sorted(sd)
    if sharded:
        shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
                  "model-00002-of-00002.safetensors": names[len(names) // 2:]}
        for file, keys in shards.items():
            save_file({k: sd[k] for k in keys}, str(folder / file), metadata={"format": "pt"})
        index = {"metadata": {"total_size": sum(v.numel() * v.element_size() for v in sd.values())},
                 "weight_map": {k: file for file, keys in shards.items() for k in keys}}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    else:
        save_file(sd, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config))
    return folder


# ---------------------------------------------------------------------------- the network
def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


@torch.no_grad()
def dream_forward(state: dict[str, torch.Tensor], config: dict, input_ids: torch.Tensor,
                  attention_mask: Optional[torch.Tensor] = None, position_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Unshifted logits ``[B, N, V]``. ``attention_mask``: None (Dream's ``"full"``) or bool ``[B, 1, N, N]``
    (query ``i`` may attend to key ``j``); ``position_ids [B, N]`` default ``arange(N)``. A query that may attend to
    nothing (a padded slot) gets a zero attention output."""
    batch, length = input_ids.shape
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim, eps = hidden // heads, config["rms_norm_eps"]
    if position_ids is None:
        position_ids = torch.arange(length)[None].expand(batch, -1)
    inv_freq = 1.0 / (config["rope_theta"] ** (torch.arange(0, head_dim, 2).float() / head_dim))
    angles = position_ids[..., None].float() * inv_freq
    angles = torch.cat([angles, angles], dim=-1)[:, None]  # [B, 1, N, head_dim]
    cos, sin = angles.cos(), angles.sin()
    h = state["model.embed_tokens.weight"][input_ids]
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        x = _rms_norm(h, state[p + "input_layernorm.weight"], eps)

        def proj(name, n_heads):
            out = F.linear(x, state[p + f"self_attn.{name}.weight"], state[p + f"self_attn.{name}.bias"])
            return out.view(batch, length, n_heads, head_dim).transpose(1, 2)

        q, k, v = proj("q_proj", heads), proj("k_proj", kv_heads), proj("v_proj", kv_heads)
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        k = k.repeat_interleave(heads // kv_heads, dim=1)
        v = v.repeat_interleave(heads // kv_heads, dim=1)
        scores = q @ k.transpose(-1, -2) / math.sqrt(head_dim)
        if attention_mask is not None:
            scores = scores.masked_fill(~attention_mask, float("-inf"))
        weights = torch.softmax(scores.float(), dim=-1).nan_to_num(0.0).to(q.dtype)
        att = (weights @ v).transpose(1, 2).reshape(batch, length, hidden)
        h = h + F.linear(att, state[p + "self_attn.o_proj.weight"])
        x = _rms_norm(h, state[p + "post_attention_layernorm.weight"], eps)
        gate, up = F.linear(x, state[p + "mlp.gate_proj.weight"]), F.linear(x, state[p + "mlp.up_proj.weight"])
        h = h + F.linear(F.silu(gate) * up, state[p + "mlp.down_proj.weight"])
    return F.linear(_rms_norm(h, state["model.norm.weight"], eps), state["lm_head.weight"])


def shifted(logits: torch.Tensor) -> torch.Tensor:
    """Dream's shift: the prediction for position ``j`` is the output at ``j - 1`` (position 0 keeps its own)."""
    return torch.cat([logits[:, :1], logits[:, :-1]], dim=1)


# ---------------------------------------------------------------------------- the sampler
def _confidence(logits: torch.Tensor, alg: str, top_p: Optional[float], top_k: Optional[int]):
    """``(confidence, token)`` per row at temperature 0: top-p, then top-k, then the max of the softmax."""
    lowest = torch.finfo(logits.dtype).min
    if top_p is not None and top_p < 1:
        ordered, order = torch.sort(logits, descending=True)
        mass = torch.softmax(ordered, dim=-1).cumsum(dim=-1)
        remove = mass > top_p
        remove = torch.cat([torch.zeros_like(remove[:, :1]), remove[:, :-1]], dim=1)  # keep the token crossing top_p
        logits = logits.masked_fill(torch.zeros_like(remove).scatter(-1, order, remove), lowest)
    if top_k:
        kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
        logits = logits.masked_fill(logits < kth, lowest)
    probs = torch.softmax(logits, dim=-1)
    confidence, token = probs.max(dim=-1)
    if alg == "topk_margin":
        ranked = torch.sort(probs, dim=-1, descending=True).values
        confidence = ranked[:, 0] - ranked[:, 1]
    elif alg == "entropy":
        confidence = (probs * torch.log(probs + 1e-10)).sum(dim=-1)
    return confidence, token


@torch.no_grad()
def dream_sample(forward, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor], *, max_new_tokens: int,
                 steps: int, mask_id: int, alg: str, eps: float = 1e-3, top_p: Optional[float] = None,
                 top_k: Optional[int] = None, never_propose: Sequence[int] = (),
                 trace: Optional[list] = None) -> torch.Tensor:
    """Dream's ``_sample`` at temperature 0 (module docstring): the generated tokens ``[B, max_new_tokens]``.

    ``forward(x, mask4d_or_None, tok_idx_or_None)`` returns unshifted logits. ``never_propose``: token ids whose
    logits are ``-inf`` before processing (vispec's default never proposes the mask token). ``trace``, when a
    list, receives the generated part ``[B, max_new_tokens]`` (``mask_id`` where undecided) after each step that
    commits something.
    """
    if alg not in ("maskgit_plus", "topk_margin", "entropy"):
        raise ValueError(f"the reference runs only the deterministic algorithms, got alg={alg!r}")
    batch, prompt_len = input_ids.shape
    x = F.pad(input_ids, (0, max_new_tokens), value=mask_id)
    mask4, tok_idx = None, None
    if attention_mask is not None and bool((attention_mask == 0).any()):
        valid = F.pad(attention_mask, (0, max_new_tokens), value=1)
        tok_idx = valid.long().cumsum(-1) - 1
        tok_idx = tok_idx.masked_fill(valid == 0, 1)
        keep = valid.bool()
        mask4 = keep[:, None, None, :] & keep[:, None, :, None]
    timesteps = torch.linspace(1, eps, steps + 1)
    for i in range(steps):
        mask_index = x == mask_id
        logits = shifted(forward(x, mask4, tok_idx))
        mask_logits = logits[mask_index]
        if never_propose:
            mask_logits[:, list(never_propose)] = float("-inf")
        t, s = timesteps[i], timesteps[i + 1]
        confidence, x0 = _confidence(mask_logits, alg, top_p, top_k)
        num_mask = mask_index.sum() / mask_index.shape[0]  # averaged over the batch, as Dream
        count = int(num_mask * (1 - s / t)) if i < steps - 1 else int(num_mask)
        full = torch.full(x.shape, float("-inf"), dtype=logits.dtype)
        full[mask_index] = confidence
        if count > 0:
            # Dream calls torch.topk, whose order among equal confidences is unspecified (with top_p < 1 at
            # T = 0 every position whose top-1 mass exceeds top_p ties at 1.0); here, as in vispec, ties go to the
            # lowest position (a stable descending sort)
            chosen = torch.sort(full, dim=-1, descending=True, stable=True).indices[:, :count]
            proposal = torch.full_like(x, mask_id)
            proposal[mask_index] = x0
            for b in range(batch):
                x[b, chosen[b]] = proposal[b, chosen[b]]
            if trace is not None:
                trace.append(x[:, prompt_len:].clone())
    return x[:, prompt_len:]
