"""SBER-MoVQGAN (Lumina-mGPT 2.0's tokenizer) in a diffusers VQModel: layout, exact decode, file errors.

The reference (``movqgan_reference.py``) is written for these tests from the structure of the official model
(ai-forever/MoVQGAN ``movqgan/modules/vqvae/vqvae_blocks.py`` ``Encoder``, ``movq_modules.py``
``MOVQDecoder``/``SpatialNorm``, ``models/vqgan.py`` ``MOVQ``), with the official module names, so its
``state_dict()`` has the official key layout; checkpoints are written from it as the official loader reads
``movqgan_270M.ckpt`` (a raw ``torch.save`` state dict) and as a Lightning training checkpoint (``"state_dict"``).
"""

from __future__ import annotations

import argparse
import pickle
from pathlib import Path

import pytest
import torch
from diffusers import VQModel

from vispec.models.checkpoints import build_on_meta, check_state_dict
from vispec.models.movqgan import (
    convert_movqgan_state_dict,
    infer_movqgan_ddconfig,
    load_movqgan,
    movqgan_config,
    movqgan_decode,
    movqgan_encode,
    movqgan_official_shapes,
    movqgan_to_uint8,
)

from movqgan_reference import FULL_270M, MOVQ, TINY, randomized


@pytest.fixture(scope="module")
def reference() -> MOVQ:
    return randomized(TINY)


@pytest.fixture(scope="module")
def ckpt(reference, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("movq") / "movqgan_tiny.ckpt"
    torch.save(reference.state_dict(), path)  # what get_movqgan_model's torch.load + load_state_dict reads
    return path


@pytest.fixture(scope="module")
def vq(ckpt) -> VQModel:
    return load_movqgan(ckpt)


def test_270m_config():
    config = movqgan_config()
    assert config["block_out_channels"] == (256, 512, 512, 1024)
    assert config["down_block_types"] == ("DownEncoderBlock2D",) * 3 + ("AttnDownEncoderBlock2D",)
    assert config["up_block_types"] == ("AttnUpDecoderBlock2D",) + ("UpDecoderBlock2D",) * 3
    assert (config["layers_per_block"], config["latent_channels"], config["vq_embed_dim"], config["num_vq_embeddings"]) == (2, 4, 4, 16384)
    assert config["norm_type"] == "spatial" and config["lookup_from_codebook"]


def test_270m_layout_maps_onto_vqmodel_exactly():
    """The full-size official layout (the reference on the meta device) renames onto VQModel(movqgan_config())
    with no missing, unexpected or mis-shaped key; about 270M parameters."""
    with torch.device("meta"):
        official = MOVQ(FULL_270M).state_dict()
    assert {k: tuple(v.shape) for k, v in official.items()} == movqgan_official_shapes()
    assert infer_movqgan_ddconfig(official) == {**FULL_270M, "ch_mult": (1, 2, 2, 4), "in_channels": 3, "out_ch": 3}
    converted = convert_movqgan_state_dict(official)
    model = build_on_meta(VQModel, movqgan_config())
    check_state_dict(model, converted, "270M layout", "VQModel(**movqgan_config())")
    params = sum(v.numel() for v in converted.values())
    assert 260e6 < params < 280e6, params


def test_decode_matches_reference(vq, reference):
    codes = torch.randint(0, TINY["n_embed"], (2, 3, 4), generator=torch.Generator().manual_seed(1))
    decoded = movqgan_decode(vq, codes)
    assert decoded.shape == (2, 3, 24, 32) and decoded.dtype == torch.float32
    with torch.no_grad():
        expected = reference.decode_code(codes)
    torch.testing.assert_close(decoded, expected, atol=1e-5, rtol=0)


def test_encode_matches_reference(vq, reference):
    images = torch.rand(2, 3, 32, 24, generator=torch.Generator().manual_seed(2)) * 2 - 1
    codes = movqgan_encode(vq, images)
    with torch.no_grad():
        expected = reference.encode_indices(images)
    assert codes.shape == (2, 4, 3) and codes.dtype == torch.long
    assert torch.equal(codes, expected)


def test_lightning_checkpoint_with_training_state(reference, vq, tmp_path):
    """A training checkpoint: the state dict under "state_dict", with loss (discriminator) and EMA entries."""
    state_dict = dict(reference.state_dict())
    state_dict["loss.discriminator.main.0.weight"] = torch.zeros(8, 3, 4, 4)
    state_dict["ema_decoder.conv_inweight"] = torch.zeros(1)
    state_dict["ema_decoder.num_updates"] = torch.tensor(-1, dtype=torch.int)
    path = tmp_path / "last.ckpt"
    torch.save({"state_dict": state_dict, "epoch": 3, "global_step": 1000}, path)
    again = load_movqgan(path)
    codes = torch.randint(0, TINY["n_embed"], (1, 2, 2))
    assert torch.equal(movqgan_decode(again, codes), movqgan_decode(vq, codes))


def test_save_pretrained_round_trip(vq, tmp_path):
    vq.save_pretrained(tmp_path)
    again = VQModel.from_pretrained(tmp_path).eval()
    codes = torch.randint(0, TINY["n_embed"], (1, 2, 3))
    assert torch.equal(movqgan_decode(again, codes), movqgan_decode(vq, codes))


def test_wrong_shape_is_reported_with_the_official_key(reference, tmp_path):
    state_dict = dict(reference.state_dict())
    state_dict["decoder.up.1.block.0.conv2.weight"] = torch.zeros(64, 64, 1, 1)
    torch.save(state_dict, tmp_path / "bad.ckpt")
    with pytest.raises(ValueError, match=r"shape mismatches \['decoder\.up\.1\.block\.0\.conv2\.weight: "
                                         r"checkpoint \(64, 64, 1, 1\) vs model \(64, 64, 3, 3\)'\]"):
        load_movqgan(tmp_path / "bad.ckpt")


def test_missing_and_unexpected_keys_are_reported(reference, tmp_path):
    state_dict = dict(reference.state_dict())
    del state_dict["decoder.norm_out.conv_b.bias"]
    state_dict["decoder.up.0.block.0.norm1.conv.weight"] = torch.zeros(4, 4, 3, 3)  # SpatialNorm(add_conv=True)
    torch.save(state_dict, tmp_path / "odd.ckpt")
    with pytest.raises(ValueError, match=r"missing keys \['decoder\.norm_out\.conv_b\.bias'\], "
                                         r"unexpected keys \['decoder\.up\.0\.block\.0\.norm1\.conv\.weight'\]"):
        load_movqgan(tmp_path / "odd.ckpt")
    with pytest.raises(ValueError, match=r"cannot map 1 MoVQGAN key\(s\).*norm1\.conv\.weight"):
        convert_movqgan_state_dict(state_dict)


def test_variant_checks_the_published_shapes(ckpt):
    with pytest.raises(ValueError, match=r"does not match the official MoVQGAN layout \(ch=256.*shape mismatches "
                                         r"\['decoder\.conv_in\.bias: checkpoint \(128,\) vs model \(1024,\)'"):
        load_movqgan(ckpt, variant="270M")
    with pytest.raises(ValueError, match=r"variant must be one of \['102M', '270M', '67M'\]"):
        load_movqgan(ckpt, variant="1B")


def test_corrupt_file(ckpt, tmp_path):
    truncated = tmp_path / "truncated.ckpt"
    truncated.write_bytes(ckpt.read_bytes()[: 2000])
    with pytest.raises(ValueError, match=r"truncated\.ckpt is not a readable torch checkpoint \(corrupted or truncated\?\)"):
        load_movqgan(truncated)
    garbage = tmp_path / "garbage.ckpt"
    garbage.write_bytes(b"not a checkpoint at all")
    with pytest.raises(ValueError, match=r"garbage\.ckpt is not a readable torch checkpoint \(corrupted\?\)"):
        load_movqgan(garbage)
    with pytest.raises(ValueError, match=r"checkpoint file not found"):
        load_movqgan(tmp_path / "absent.ckpt")


def test_pickles_are_refused_unless_trusted(reference, vq, tmp_path):
    plain = tmp_path / "plain.ckpt"
    with open(plain, "wb") as handle:
        pickle.dump({k: v.clone() for k, v in reference.state_dict().items()}, handle)
    with pytest.raises(ValueError, match=r"plain Python pickle .* trust_pickle=True"):
        load_movqgan(plain)
    with_args = tmp_path / "with_args.ckpt"
    torch.save({"state_dict": reference.state_dict(), "hyper_parameters": argparse.Namespace(embed_dim=4)}, with_args)
    with pytest.raises(ValueError, match=r"pickled Python objects besides tensors.*trust_pickle=True"):
        load_movqgan(with_args)
    codes = torch.randint(0, TINY["n_embed"], (1, 2, 2))
    for path in (plain, with_args):
        assert torch.equal(movqgan_decode(load_movqgan(path, trust_pickle=True), codes), movqgan_decode(vq, codes))


def test_decode_rejects_bad_codes(vq):
    with pytest.raises(ValueError, match=r"tokens must lie in \[0, 32\)"):
        movqgan_decode(vq, torch.full((1, 2, 2), 32))
    with pytest.raises(ValueError, match=r"shape \[B, h, w\]"):
        movqgan_decode(vq, torch.zeros(4, dtype=torch.long))


def test_config_checks():
    with pytest.raises(ValueError, match=r"z_channels \(8\) must equal embed_dim \(4\)"):
        movqgan_config(z_channels=8)
    with pytest.raises(ValueError, match=r"multiple of 32"):
        movqgan_config(ch=16)
    with pytest.raises(ValueError, match=r"unknown MoVQGAN config field\(s\) \['width'\]"):
        movqgan_config(width=3)


def test_to_uint8():
    images = torch.tensor([-1.5, -1.0, 0.0, 0.999, 1.0])
    assert movqgan_to_uint8(images).tolist() == [0, 0, 128, 255, 255]
