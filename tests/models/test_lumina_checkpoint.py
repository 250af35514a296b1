"""Lumina-mGPT 2.0 checkpoint folders -> transformers 5.x ChameleonForConditionalGeneration; special tokens.

Tiny folders are written in the official layout: ``config.json`` with the fork's ``ChameleonXLLMXConfig``
field names, safetensors with the fork's key names (qk-norm parameters ``[model_parallel_size, head_dim]``).
The reference forward (``lumina_reference.py``) follows the fork's modules (Alpha-VLLM/Lumina-mGPT-2.0
``lumina_mgpt/model/chameleon/modeling_chameleon.py``: RMSNorm, ``ChameleonLayerNorm`` with repeat_interleave,
half-split RoPE, SwiGLU, ``ChameleonSwinDecoderLayer`` ordering, ``mask_image_logits``) and reads the official
state dict directly, so logits of the converted transformers model are compared with an independent computation.
"""

from __future__ import annotations


import pytest
import torch
from transformers import ChameleonForConditionalGeneration

from vispec.models.lumina_checkpoint import (
    LUMINA_ONLY_CONFIG_FIELDS,
    LUMINA_VQMODEL_PREFIX,
    LuminaSpecialTokens,
    convert_lumina_state_dict,
    load_lumina_chameleon,
    lumina_chameleon_config,
)

from lumina_reference import IDS, IMGIMG, VOCAB, official_config, official_weights, reference_logits, write_folder


# ------------------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("mp, swin, mask", [(1, False, False), (2, False, False), (2, True, True)])
def test_converted_folder_gives_the_reference_logits(tmp_path, mp, swin, mask):
    config = official_config(mp=mp, swin=swin, mask=mask)
    weights = official_weights(config)
    model = load_lumina_chameleon(write_folder(tmp_path / "ckpt", config, weights, shards=2))
    with torch.no_grad():
        logits = model(IDS).logits
    expected = reference_logits(weights, config, IDS)
    assert logits.shape == (2, 10, VOCAB)
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)
    masked = (logits[..., sorted(IMGIMG.values())] == torch.finfo(logits.dtype).min).all().item()
    assert masked == mask


def test_strict_load_into_a_fresh_model(tmp_path):
    """The converted state dict fills every key of ChameleonForConditionalGeneration but the documented
    model.vqmodel.* (Chameleon's VQ image encoder, unused by Lumina-mGPT 2.0); the folder's own vqmodel keys
    are dropped."""
    config = official_config(mp=2)
    weights = official_weights(config, with_vqmodel=True)
    converted = convert_lumina_state_dict(weights)
    assert not any(k.startswith(LUMINA_VQMODEL_PREFIX) for k in converted)
    model = ChameleonForConditionalGeneration(lumina_chameleon_config(config)).eval()
    result = model.load_state_dict(converted, strict=False)
    assert result.unexpected_keys == []
    assert result.missing_keys and all(k.startswith(LUMINA_VQMODEL_PREFIX) for k in result.missing_keys)
    with torch.no_grad():
        torch.testing.assert_close(model(IDS).logits, reference_logits(weights, config, IDS), atol=1e-5, rtol=1e-5)
    again = load_lumina_chameleon(write_folder(tmp_path / "with_vq", config, weights))  # vqmodel keys tolerated
    assert again.model.vqmodel.quantize.embedding.weight.device.type == "cpu"


def test_qk_norm_expansion_repeats_each_group():
    config = official_config(mp=2)
    weights = official_weights(config)
    converted = convert_lumina_state_dict(weights)
    q = weights["model.layers.0.self_attn.q_norm.weight"]  # [2, 16] -> [4, 16]: heads 0, 1 use group 0
    assert converted["model.layers.0.self_attn.q_norm.weight"].shape == (4, 16)
    assert torch.equal(converted["model.layers.0.self_attn.q_norm.weight"], q[[0, 0, 1, 1]])
    k = weights["model.layers.0.self_attn.k_norm.bias"]  # 2 kv heads, 2 groups: unchanged
    assert torch.equal(converted["model.layers.0.self_attn.k_norm.bias"], k)


def test_bfloat16_folder_and_dtype(tmp_path):
    config = official_config(mp=1)
    weights = {k: v.to(torch.bfloat16) for k, v in official_weights(config).items()}
    model = load_lumina_chameleon(write_folder(tmp_path / "bf16", config, weights))
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert model.model.vqmodel.quantize.embedding.weight.dtype == torch.bfloat16
    as_float = load_lumina_chameleon(tmp_path / "bf16", dtype=torch.float32)
    assert as_float.lm_head.weight.dtype == torch.float32
    with torch.no_grad():
        expected = reference_logits({k: v.float() for k, v in weights.items()}, config, IDS)
        torch.testing.assert_close(as_float(IDS).logits, expected, atol=1e-5, rtol=1e-5)


def test_unknown_and_missing_keys_are_reported(tmp_path):
    config = official_config()
    weights = official_weights(config)
    weights["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.zeros(8)
    with pytest.raises(ValueError, match=r"cannot map 1 Lumina-mGPT key\(s\).*rotary_emb\.inv_freq"):
        convert_lumina_state_dict(weights)
    del weights["model.layers.0.self_attn.rotary_emb.inv_freq"]
    del weights["model.layers.1.mlp.down_proj.weight"]
    with pytest.raises(ValueError, match=r"missing keys \['model\.layers\.1\.mlp\.down_proj\.weight'\]"):
        load_lumina_chameleon(write_folder(tmp_path / "missing", config, weights))


def test_config_that_does_not_fit_the_weights(tmp_path):
    config = official_config()
    weights = official_weights(config)
    with pytest.raises(ValueError, match=r"vocab_size is 128 but the weights hold 96 \(model\.embed_tokens\.weight has shape \(96, 64\)\)"):
        load_lumina_chameleon(write_folder(tmp_path / "vocab", {**config, "vocab_size": 128}, weights))
    bad_norm = dict(weights, **{"model.layers.0.self_attn.q_norm.weight": torch.ones(3, 16)})
    with pytest.raises(ValueError, match=r"q_norm\.weight: 3 group\(s\) of head_dim 16 do not divide the 64 rows"):
        convert_lumina_state_dict(bad_norm)


def test_folder_errors(tmp_path):
    with pytest.raises(ValueError, match=r"config\.json is missing"):
        load_lumina_chameleon(tmp_path)
    folder = write_folder(tmp_path / "corrupt", official_config(), official_weights(official_config()))
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"model\.safetensors is not a readable safetensors file \(corrupted or truncated\?\)"):
        load_lumina_chameleon(folder)
    (folder / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"config\.json is not a readable JSON file"):
        load_lumina_chameleon(folder)


def test_config_mapping():
    config = lumina_chameleon_config(official_config(rope_scaling={"type": "linear", "factor": 2.0}))
    assert config.rope_parameters == {"rope_type": "linear", "factor": 2.0, "rope_theta": 5000.0}
    assert (config.hidden_size, config.num_key_value_heads, config.model_parallel_size) == (64, 2, 2)
    assert "IMGIMGBAZ" not in config.vocabulary_map and config.vocabulary_map["<image>"] == 8
    assert config.vq_config.base_channels == 32
    for field in ("mask_image_logits", "dropout", "z_loss_weight"):
        assert field in LUMINA_ONLY_CONFIG_FIELDS
    masked = lumina_chameleon_config(official_config(mask=True))
    assert masked.vocabulary_map["IMGIMGBAZ"] == 90
    absent = {k: v for k, v in official_config().items() if k != "mask_image_logits"}  # fork default: True
    assert "IMGIMGBAA" in lumina_chameleon_config(absent).vocabulary_map
    assert lumina_chameleon_config({"model_type": "chameleon"}).rope_parameters["rope_theta"] == 10000.0
    with pytest.raises(ValueError, match=r"model_type='llama'"):
        lumina_chameleon_config({"model_type": "llama"})
    with pytest.raises(ValueError, match=r"rope_scaling must be None or"):
        lumina_chameleon_config(official_config(rope_scaling={"type": "yarn", "factor": 2.0}))
    with pytest.raises(ValueError, match=r"multiple of model_parallel_size \(3\)"):
        lumina_chameleon_config(official_config(mp=3))


def test_special_token_defaults():
    tokens = LuminaSpecialTokens()
    assert (tokens.image_start, tokens.image_end, tokens.end_of_row) == (151665, 151666, 151670)
    assert (tokens.image_token_ids.start, tokens.image_token_ids.stop - 1) == (155000, 171383)
    assert (tokens.cfg_scale, tokens.image_top_k, tokens.temperature) == (4.0, 4096, 1.0)
    assert tokens.grid(768, 768) == (96, 96)
    assert tokens.image_length(768, 768) == 3 + 96 * 97 + 1
    assert tokens.prompt("a cat", height=512, width=768) == (
        "Generate an image of 768x512 according to the following prompt:\na cat")
    with pytest.raises(ValueError, match=r"<reserved08824> is unknown.*from_vocab"):
        tokens.resolution_token_id(24)
    with pytest.raises(ValueError, match=r"height must be a positive multiple of 32"):
        tokens.grid(700, 768)


def test_special_tokens_from_vocab():
    vocab = {"<racm3:break>": 151665, "<eoss>": 151666, "<reserved08706>": 151700, "<reserved08799>": 151670,
             "<reserved08816>": 151900, "<reserved08824>": 151908, "hello": 3}
    tokens = LuminaSpecialTokens.from_vocab(vocab)
    assert tokens.separator == 151700
    assert tokens.image_prefix(768, 512) == [151665, 151908, 151900]
    assert tokens.grids_of(151908) == 24
    assert tokens.replace(cfg_scale=3.0).cfg_scale == 3.0
    with pytest.raises(ValueError, match=r"not a known resolution token"):
        tokens.grids_of(3)
