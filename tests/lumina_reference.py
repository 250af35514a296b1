"""Lumina-mGPT 2.0 checkpoints in the official layout, written for tests: the config and weights of a tiny model, the
folder writer, an independent reference forward that reads the official state dict (following the fork's modules,
Alpha-VLLM/Lumina-mGPT-2.0 ``lumina_mgpt/model/chameleon/modeling_chameleon.py``: RMSNorm, ``ChameleonLayerNorm`` with
repeat_interleave, half-split RoPE, SwiGLU, ``ChameleonSwinDecoderLayer`` ordering, ``mask_image_logits``), and a
tokenizer carrying Lumina's special-token names. Used by the checkpoint, conversion and README tests."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from vispec.eval.train.tokenizer import train_word_tokenizer

VOCAB = 96
IMGIMG = {"IMGIMGBAZ": 90, "IMGIMGBAA": 91}  # Chameleon-style image-token names in vocabulary_map
TINY_VQ = {"embed_dim": 32, "num_embeddings": 16, "latent_channels": 32, "resolution": 32, "base_channels": 32,
           "channel_multiplier": [1], "num_res_blocks": 1, "attn_resolutions": [], "model_type": "chameleon_vqgan",
           "return_dict": True}  # generic PretrainedConfig keys a serialized sub-config carries


def official_config(mp: int = 2, swin: bool = False, mask: bool = False, **extra) -> dict:
    """A config.json in the fork's field names (ChameleonXLLMXConfig.to_json_string style)."""
    return {
        "architectures": ["ChameleonXLLMXForConditionalGeneration"], "model_type": "chameleon",
        "torch_dtype": "float32", "transformers_version": "4.46.0",
        "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_act": "silu", "max_position_embeddings": 128,
        "initializer_range": 0.02, "rms_norm_eps": 1e-5, "use_cache": True, "pad_token_id": None, "bos_token_id": 1,
        "eos_token_id": 2, "tie_word_embeddings": False, "rope_theta": 5000.0, "rope_scaling": None,
        "attention_bias": False, "attention_dropout": 0.0, "model_parallel_size": mp, "swin_norm": swin,
        "mlp_bias": False, "mask_image_logits": mask, "dropout": 0.05, "z_loss_weight": 1e-5,
        "vq_config": TINY_VQ, "vocabulary_map": {"<image>": 8, "<racm3:break>": 80, **IMGIMG},
        **extra,
    }


def official_weights(config: dict, seed: int = 0, with_vqmodel: bool = False) -> dict[str, torch.Tensor]:
    """Random weights under the fork's names and shapes."""
    g = torch.Generator().manual_seed(seed)
    d, f, h, kv, mp = (config[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                            "num_key_value_heads", "model_parallel_size"))
    hd = d // h

    def rand(*shape, scale=0.3):
        return torch.randn(*shape, generator=g) * scale

    sd = {"model.embed_tokens.weight": rand(VOCAB, d, scale=1.0), "model.norm.weight": 1 + rand(d, scale=0.1),
          "lm_head.weight": rand(VOCAB, d)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        sd.update({
            p + "self_attn.q_proj.weight": rand(h * hd, d), p + "self_attn.k_proj.weight": rand(kv * hd, d),
            p + "self_attn.v_proj.weight": rand(kv * hd, d), p + "self_attn.o_proj.weight": rand(d, h * hd),
            p + "self_attn.q_norm.weight": 1 + rand(mp, hd, scale=0.2), p + "self_attn.q_norm.bias": rand(mp, hd, scale=0.2),
            p + "self_attn.k_norm.weight": 1 + rand(mp, hd, scale=0.2), p + "self_attn.k_norm.bias": rand(mp, hd, scale=0.2),
            p + "mlp.gate_proj.weight": rand(f, d), p + "mlp.up_proj.weight": rand(f, d), p + "mlp.down_proj.weight": rand(d, f),
            p + "input_layernorm.weight": 1 + rand(d, scale=0.1), p + "post_attention_layernorm.weight": 1 + rand(d, scale=0.1),
        })
    if with_vqmodel:
        sd["model.vqmodel.quantize.embedding.weight"] = rand(16, 32)
        sd["model.vqmodel.encoder.conv_in.weight"] = rand(32, 3, 3, 3)
    return sd


def write_folder(folder: Path, config: dict, weights: dict[str, torch.Tensor], shards: int = 1) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    if shards == 1:
        save_file(weights, str(folder / "model.safetensors"))
        return folder
    keys = sorted(weights)
    weight_map = {}
    for s in range(shards):
        name = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: weights[k].contiguous() for k in keys[s::shards]}
        save_file(part, str(folder / name))
        weight_map.update(dict.fromkeys(part, name))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder


# ------------------------------------------------------------------------- reference forward (fork semantics)
def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def reference_logits(sd: dict[str, torch.Tensor], config: dict, ids: torch.Tensor) -> torch.Tensor:
    d, h, kv, mp = (config[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "model_parallel_size"))
    hd, eps, b, t = d // h, config["rms_norm_eps"], ids.shape[0], ids.shape[1]
    inv = 1.0 / (config["rope_theta"] ** (torch.arange(0, hd, 2).float() / hd))
    angles = torch.arange(t).float()[:, None] * inv
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    x = sd["model.embed_tokens.weight"][ids]
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."

        def qk(name: str, heads: int, inp: torch.Tensor) -> torch.Tensor:
            y = (inp @ sd[p + f"self_attn.{name}_proj.weight"].t()).view(b, t, heads, hd)
            w = sd[p + f"self_attn.{name}_norm.weight"].repeat_interleave(heads // mp, 0)
            bias = sd[p + f"self_attn.{name}_norm.bias"].repeat_interleave(heads // mp, 0)
            y = F.layer_norm(y, (hd,), eps=1e-5) * w + bias
            y = y.transpose(1, 2)
            return y * cos + rotate_half(y) * sin

        def attention(inp: torch.Tensor) -> torch.Tensor:
            q, k = qk("q", h, inp), qk("k", kv, inp)
            v = (inp @ sd[p + "self_attn.v_proj.weight"].t()).view(b, t, kv, hd).transpose(1, 2)
            k, v = k.repeat_interleave(h // kv, 1), v.repeat_interleave(h // kv, 1)
            scores = (q @ k.transpose(-1, -2)) / hd**0.5
            out = scores.masked_fill(~causal, float("-inf")).softmax(-1) @ v
            return out.transpose(1, 2).reshape(b, t, d) @ sd[p + "self_attn.o_proj.weight"].t()

        def mlp(inp: torch.Tensor) -> torch.Tensor:
            gate = F.silu(inp @ sd[p + "mlp.gate_proj.weight"].t()) * (inp @ sd[p + "mlp.up_proj.weight"].t())
            return gate @ sd[p + "mlp.down_proj.weight"].t()

        w_in, w_post = sd[p + "input_layernorm.weight"], sd[p + "post_attention_layernorm.weight"]
        if config["swin_norm"]:
            x = x + rms(attention(x), w_in, eps)
            x = x + rms(mlp(x), w_post, eps)
        else:
            x = x + attention(rms(x, w_in, eps))
            x = x + mlp(rms(x, w_post, eps))
    logits = rms(x, sd["model.norm.weight"], eps) @ sd["lm_head.weight"].t()
    if config["mask_image_logits"]:
        logits[:, :, sorted(IMGIMG.values())] = torch.finfo(logits.dtype).min
    return logits


IDS = torch.tensor([[1, 5, 17, 80, 90, 33, 2, 60, 61, 62], [1, 7, 7, 8, 91, 40, 41, 42, 43, 44]])


CODE0 = 48  # --image-token-offset of the tiny vocabulary (96 ids: text and specials below, 32 codes from 48)
LUMINA_SPECIALS = ["<racm3:break>", "<eoss>", "<reserved08799>", "<reserved08706>"] + \
                  [f"<reserved{8800 + n:05d}>" for n in range(5)]


def lumina_tokenizer():
    tokenizer = train_word_tokenizer(["a red cat on the grass"])
    tokenizer.add_tokens(LUMINA_SPECIALS, special_tokens=True)
    assert len(tokenizer) <= CODE0
    return tokenizer
