"""An independent, functional reference of the official LLaDA2 (``llada2_moe``) forward, for the loader and model tests.

Written from the official modeling structure, op by op and without vispec's modules: fused QKV split into heads, per-head
RMSNorm of queries and keys, partial RoPE (``cos``/``sin`` of ``cat(freqs, freqs)`` over the rotated dimensions, the rest
passed through), eager attention with an additive 4-D mask, the group-limited sigmoid gate with expert bias, routed
experts weighted by the normalised unbiased scores times the scaling factor, shared experts, final norm and head. Also
writes a checkpoint folder in the official layout (``config.json`` + sharded safetensors with the index)."""

from __future__ import annotations

import json
import pathlib

import torch
import torch.nn.functional as F


def tiny_llada2_config(**changes) -> dict:
    """An official-layout ``config.json`` dict, tiny (layer 0 dense, layer 1 MoE), with the keys the hub files carry."""
    config = {
        "architectures": ["LLaDA2MoeModelLM"],
        "auto_map": {"AutoConfig": "configuration_llada2_moe.LLaDA2MoeConfig",
                     "AutoModelForCausalLM": "modeling_llada2_moe.LLaDA2MoeModelLM"},
        "model_type": "llada2_moe", "dtype": "float32", "vocab_size": 96, "hidden_size": 32, "intermediate_size": 48,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "hidden_act": "silu",
        "use_qkv_bias": False, "use_qk_norm": True, "use_bias": False, "rms_norm_eps": 1e-6,
        "max_position_embeddings": 256, "rope_theta": 600000, "partial_rotary_factor": 0.5, "num_experts": 8,
        "num_shared_experts": 1, "num_experts_per_tok": 2, "n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5,
        "moe_intermediate_size": 16, "first_k_dense_replace": 1, "norm_topk_prob": True, "score_function": "sigmoid",
        "moe_router_enable_expert_bias": True, "router_dtype": "fp32", "output_router_logits": False,
        "tie_word_embeddings": False, "norm_head": False, "rope_scaling": None, "use_cache": True,
        "initializer_range": 0.02, "max_window_layers": 28, "embedding_dropout": 0.0, "attention_dropout": 0.0,
        "output_dropout": 0.0, "pad_token_id": 2, "mask_token_id": 95, "eos_token_id": 1,
    }
    config.update(changes)
    return config


def random_llada2_state(config: dict, seed: int = 0, dtype=torch.float64) -> dict[str, torch.Tensor]:
    """Random tensors under the official names for ``config``."""
    gen = torch.Generator().manual_seed(seed)
    t = lambda *shape, scale=0.3: (torch.randn(*shape, generator=gen) * scale).to(dtype)  # noqa: E731
    H, V, hd = config["hidden_size"], config["vocab_size"], config["head_dim"]
    nh, nkv, E = config["num_attention_heads"], config["num_key_value_heads"], config["num_experts"]
    state = {"model.word_embeddings.weight": t(V, H, scale=1.0), "lm_head.weight": t(V, H, scale=1.0),
             "model.norm.weight": 1 + t(H, scale=0.1)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        state[p + "input_layernorm.weight"] = 1 + t(H, scale=0.1)
        state[p + "post_attention_layernorm.weight"] = 1 + t(H, scale=0.1)
        state[p + "attention.query_key_value.weight"] = t((nh + 2 * nkv) * hd, H)
        state[p + "attention.query_layernorm.weight"] = 1 + t(hd, scale=0.1)
        state[p + "attention.key_layernorm.weight"] = 1 + t(hd, scale=0.1)
        state[p + "attention.dense.weight"] = t(H, nh * hd)
        if i < config["first_k_dense_replace"]:
            for name, shape in (("gate_proj", (config["intermediate_size"], H)), ("up_proj", (config["intermediate_size"], H)),
                                ("down_proj", (H, config["intermediate_size"]))):
                state[p + f"mlp.{name}.weight"] = t(*shape)
            continue
        F_ = config["moe_intermediate_size"]
        state[p + "mlp.gate.weight"] = t(E, H)
        state[p + "mlp.gate.expert_bias"] = t(E, scale=0.1)
        for e in range(E):
            for name, shape in (("gate_proj", (F_, H)), ("up_proj", (F_, H)), ("down_proj", (H, F_))):
                state[p + f"mlp.experts.{e}.{name}.weight"] = t(*shape)
        S = F_ * config["num_shared_experts"]
        for name, shape in (("gate_proj", (S, H)), ("up_proj", (S, H)), ("down_proj", (H, S))):
            state[p + f"mlp.shared_experts.{name}.weight"] = t(*shape)
    return state


def write_llada2_folder(folder: pathlib.Path, state: dict, config: dict, sharded: bool = True) -> pathlib.Path:
    """``config.json`` and the tensors as official shards with ``model.safetensors.index.json`` (or one file)."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    names = sorted(state)
    if not sharded:
        save_file({k: state[k].contiguous() for k in names}, str(folder / "model.safetensors"))
        return folder
    half = len(names) // 2
    weight_map = {}
    for index, part in enumerate((names[:half], names[half:])):
        shard = f"model-0000{index + 1}-of-00002.safetensors"
        save_file({k: state[k].contiguous() for k in part}, str(folder / shard))
        weight_map.update({k: shard for k in part})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder


def _rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rotate_half(x):
    a, b = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-b, a), dim=-1)


def _swiglu(state, prefix, x):
    gate = x @ state[prefix + "gate_proj.weight"].T
    return (F.silu(gate) * (x @ state[prefix + "up_proj.weight"].T)) @ state[prefix + "down_proj.weight"].T


def _moe(state, p, config, x):
    tokens = x.reshape(-1, x.shape[-1])
    logits = tokens @ state[p + "mlp.gate.weight"].T
    scores = torch.sigmoid(logits)
    biased = scores + state[p + "mlp.gate.expert_bias"]
    n, G = tokens.shape[0], config["n_group"]
    group_scores = biased.view(n, G, -1).topk(2, dim=-1)[0].sum(dim=-1)
    group_idx = group_scores.topk(config["topk_group"], dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
    score_mask = group_mask.unsqueeze(-1).expand(n, G, config["num_experts"] // G).reshape(n, -1)
    _, top = biased.masked_fill(~score_mask.bool(), float("-inf")).topk(config["num_experts_per_tok"], dim=-1)
    weight = scores.gather(1, top)
    weight = weight / (weight.sum(dim=-1, keepdim=True) + 1e-20) * config["routed_scaling_factor"]
    out = torch.zeros_like(tokens)
    for slot in range(top.shape[1]):  # reference: every token through its chosen experts, one slot at a time
        for e in range(config["num_experts"]):
            pick = top[:, slot] == e
            if pick.any():
                out[pick] += weight[pick, slot, None] * _swiglu(state, p + f"mlp.experts.{e}.", tokens[pick])
    out = out + _swiglu(state, p + "mlp.shared_experts.", tokens)
    return out.view(x.shape)


def llada2_forward(state: dict, config: dict, ids: torch.Tensor, additive_mask: torch.Tensor,
                   position_ids: torch.Tensor) -> torch.Tensor:
    """Logits ``[B, T, V]`` of the official forward with a 4-D additive mask ``[B|1, 1, T, T]``."""
    eps = config["rms_norm_eps"]
    nh, nkv, hd = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    rot = int(hd * config["partial_rotary_factor"])
    inv_freq = 1.0 / (config["rope_theta"] ** (torch.arange(0, rot, 2, dtype=torch.int64).double() / rot))
    freqs = position_ids[..., None].double() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos()[:, None], emb.sin()[:, None]
    h = state["model.word_embeddings.weight"][ids]
    B, T, _ = h.shape
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        x = _rms(h, state[p + "input_layernorm.weight"], eps)
        qkv = (x @ state[p + "attention.query_key_value.weight"].T).view(B, T, nh + 2 * nkv, hd)
        q, k, v = qkv.split([nh, nkv, nkv], dim=-2)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q = _rms(q, state[p + "attention.query_layernorm.weight"], eps)
        k = _rms(k, state[p + "attention.key_layernorm.weight"], eps)
        q = torch.cat([q[..., :rot] * cos + _rotate_half(q[..., :rot]) * sin, q[..., rot:]], dim=-1)
        k = torch.cat([k[..., :rot] * cos + _rotate_half(k[..., :rot]) * sin, k[..., rot:]], dim=-1)
        k = k.repeat_interleave(nh // nkv, dim=1)
        v = v.repeat_interleave(nh // nkv, dim=1)
        att = torch.softmax(q @ k.transpose(2, 3) * hd ** -0.5 + additive_mask, dim=-1) @ v
        h = h + att.transpose(1, 2).reshape(B, T, -1) @ state[p + "attention.dense.weight"].T
        z = _rms(h, state[p + "post_attention_layernorm.weight"], eps)
        h = h + (_swiglu(state, p + "mlp.", z) if i < config["first_k_dense_replace"] else _moe(state, p, config, z))
    return _rms(h, state["model.norm.weight"], eps) @ state["lm_head.weight"].T


def block_mask(total: int, block_length: int) -> torch.Tensor:
    """The official ``generate``'s additive block-diffusion mask ``[1, 1, total, total]`` (log of the block tril)."""
    blocks = (total + block_length - 1) // block_length
    tril = torch.tril(torch.ones(blocks, blocks, dtype=torch.float64))
    full = tril.repeat_interleave(block_length, 0).repeat_interleave(block_length, 1)[:total, :total]
    return full.log()[None, None]
