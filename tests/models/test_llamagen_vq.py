"""LlamaGen VQ tokenizer as a diffusers VQModel: key conversion, official test vectors, error paths."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch
from diffusers import VQModel

from vispec.models.llamagen_vq import (
    convert_llamagen_vq_state_dict,
    decode_tokens,
    encode_to_tokens,
    llamagen_vq_config,
    load_llamagen_vq,
    to_uint8,
)

DATA = Path(__file__).parents[1] / "data" / "llamagen"
CKPT = DATA / "vq16_tiny.pt"


@pytest.fixture(scope="module")
def raw_state_dict() -> dict[str, torch.Tensor]:
    return torch.load(CKPT, map_location="cpu", weights_only=True)["model"]


@pytest.fixture(scope="module")
def vectors() -> dict[str, torch.Tensor]:
    return torch.load(DATA / "vq16_tiny_io.pt", map_location="cpu", weights_only=True)


@pytest.fixture(scope="module")
def vq() -> VQModel:
    return load_llamagen_vq(CKPT)


def test_tiny_checkpoint_maps_every_key(raw_state_dict):
    converted = convert_llamagen_vq_state_dict(raw_state_dict)
    model = VQModel(**llamagen_vq_config(codebook_size=64, z_channels=32, base_channels=32))
    result = model.load_state_dict(converted, strict=False)
    assert result.missing_keys == [] and result.unexpected_keys == []
    assert "quantize.codebook_used" not in converted
    norms = converted["quantize.embedding.weight"].norm(dim=-1)
    torch.testing.assert_close(norms, torch.ones_like(norms))
    assert converted["encoder.mid_block.attentions.0.to_q.weight"].ndim == 2


def test_loaded_config_inferred_from_weights(vq):
    assert vq.config.num_vq_embeddings == 64
    assert vq.config.vq_embed_dim == 8
    assert vq.config.latent_channels == 32
    assert tuple(vq.config.block_out_channels) == (32, 32, 64, 64, 128)


def test_decode_matches_official(vq, vectors):
    decoded = decode_tokens(vq, vectors["indices"])
    assert decoded.shape == (2, 3, 64, 64)
    torch.testing.assert_close(decoded, vectors["decoded"], atol=1e-4, rtol=0)


def test_encode_matches_official(vq, vectors):
    tokens = encode_to_tokens(vq, vectors["image"])
    assert tokens.dtype == torch.long
    assert torch.equal(tokens, vectors["indices"])


def test_save_pretrained_round_trip(vq, vectors, tmp_path):
    vq.save_pretrained(tmp_path)
    again = VQModel.from_pretrained(tmp_path).eval()
    assert torch.equal(decode_tokens(again, vectors["indices"]), decode_tokens(vq, vectors["indices"]))


def test_missing_key_is_reported(raw_state_dict, tmp_path):
    broken = dict(raw_state_dict)
    del broken["decoder.conv_out.bias"]
    torch.save({"model": broken}, tmp_path / "missing.pt")
    with pytest.raises(ValueError, match=r"missing keys \['decoder\.conv_out\.bias'\]"):
        load_llamagen_vq(tmp_path / "missing.pt")


def test_extra_key_is_reported(raw_state_dict, tmp_path):
    extra = dict(raw_state_dict)
    extra["encoder.conv_blocks.0.res.2.conv1.weight"] = torch.zeros(32, 32, 3, 3)
    torch.save({"model": extra}, tmp_path / "extra.pt")
    with pytest.raises(ValueError, match=r"unexpected keys \['encoder\.down_blocks\.0\.resnets\.2\.conv1\.weight'\]"):
        load_llamagen_vq(tmp_path / "extra.pt")


def test_unmappable_key_is_reported(raw_state_dict):
    with pytest.raises(ValueError, match="discriminator.weight"):
        convert_llamagen_vq_state_dict({**raw_state_dict, "discriminator.weight": torch.zeros(1)})


def test_pickled_checkpoint_needs_opt_in(raw_state_dict, vectors, tmp_path):
    path = tmp_path / "with_args.pt"
    torch.save({"model": raw_state_dict, "args": argparse.Namespace(vq_model="VQ-16")}, path)
    with pytest.raises(ValueError, match="trust_pickle=True"):
        load_llamagen_vq(path)
    model = load_llamagen_vq(path, trust_pickle=True)
    torch.testing.assert_close(decode_tokens(model, vectors["indices"]), vectors["decoded"], atol=1e-4, rtol=0)


def test_safetensors_and_raw_state_dict(raw_state_dict, vectors, tmp_path):
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in raw_state_dict.items()}, tmp_path / "vq.safetensors")
    torch.save(raw_state_dict, tmp_path / "raw.pt")
    for name in ("vq.safetensors", "raw.pt"):
        model = load_llamagen_vq(tmp_path / name)
        torch.testing.assert_close(decode_tokens(model, vectors["indices"]), vectors["decoded"], atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    "tokens",
    [
        torch.zeros(2, 16, dtype=torch.long),  # wrong ndim
        torch.full((1, 4, 4), 64, dtype=torch.long),  # out of range (codebook has 64 entries)
        torch.full((1, 4, 4), -1, dtype=torch.long),  # negative id
        torch.zeros(1, 4, 4),  # float dtype
    ],
)
def test_bad_tokens_raise(vq, tokens):
    with pytest.raises(ValueError, match="tokens"):
        decode_tokens(vq, tokens)


def test_unknown_variant():
    with pytest.raises(ValueError, match=r"variant.*'VQ-16'.*'VQ-8'"):
        llamagen_vq_config("VQ-32")


def test_vq8_config_builds():
    config = llamagen_vq_config("VQ-8", codebook_size=64, z_channels=32, base_channels=32)
    assert tuple(config["block_out_channels"]) == (32, 64, 64, 128)
    model = VQModel(**config).eval()
    tokens = torch.randint(0, 64, (1, 2, 2))
    assert decode_tokens(model, tokens).shape == (1, 3, 16, 16)
    assert encode_to_tokens(model, torch.zeros(1, 3, 16, 16)).shape == (1, 2, 2)


def test_to_uint8_convention():
    images = torch.tensor([-2.0, -1.0, 0.0, 0.999, 1.0, 3.0]).view(1, 1, 1, 6)
    assert to_uint8(images).flatten().tolist() == [0, 0, 128, 255, 255, 255]
