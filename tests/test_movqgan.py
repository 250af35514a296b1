"""SBER-MoVQGAN (Lumina-mGPT 2.0's tokenizer) in a diffusers VQModel: layout, exact decode, file errors.

The reference below is written for this test from the structure of the official model
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
import torch.nn.functional as F
from diffusers import VQModel
from torch import nn

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

TINY = {"ch": 32, "ch_mult": (1, 2, 2, 4), "num_res_blocks": 1, "attn_resolutions": (8,), "resolution": 64,
        "z_channels": 4, "embed_dim": 4, "n_embed": 32}
FULL_270M = {"ch": 256, "ch_mult": (1, 2, 2, 4), "num_res_blocks": 2, "attn_resolutions": (32,), "resolution": 256,
             "z_channels": 4, "embed_dim": 4, "n_embed": 16384}


# ------------------------------------------------------------------ reference (official structure and names)
def swish(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(x)


class SpatialNorm(nn.Module):
    """GroupNorm(f) modulated by the quantized latent, nearest-resized to f's size (add_conv=False)."""

    def __init__(self, width: int, zq_ch: int):
        super().__init__()
        self.norm_layer = nn.GroupNorm(32, width, eps=1e-6, affine=True)
        self.conv_y = nn.Conv2d(zq_ch, width, 1)
        self.conv_b = nn.Conv2d(zq_ch, width, 1)

    def forward(self, f, zq):
        zq = F.interpolate(zq, size=f.shape[-2:], mode="nearest")
        return self.norm_layer(f) * self.conv_y(zq) + self.conv_b(zq)


def make_norm(width: int, zq_ch):
    return nn.GroupNorm(32, width, eps=1e-6, affine=True) if zq_ch is None else SpatialNorm(width, zq_ch)


def apply_norm(norm: nn.Module, x, zq):
    return norm(x) if zq is None else norm(x, zq)


class ResnetBlock(nn.Module):
    def __init__(self, cin: int, cout: int, zq_ch=None):
        super().__init__()
        self.norm1 = make_norm(cin, zq_ch)
        self.conv1 = nn.Conv2d(cin, cout, 3, padding=1)
        self.norm2 = make_norm(cout, zq_ch)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1)
        if cin != cout:
            self.nin_shortcut = nn.Conv2d(cin, cout, 1)

    def forward(self, x, zq=None):
        h = self.conv1(swish(apply_norm(self.norm1, x, zq)))
        h = self.conv2(swish(apply_norm(self.norm2, h, zq)))
        return (self.nin_shortcut(x) if hasattr(self, "nin_shortcut") else x) + h


class AttnBlock(nn.Module):
    def __init__(self, width: int, zq_ch=None):
        super().__init__()
        self.norm = make_norm(width, zq_ch)
        self.q, self.k, self.v, self.proj_out = (nn.Conv2d(width, width, 1) for _ in range(4))

    def forward(self, x, zq=None):
        h = apply_norm(self.norm, x, zq)
        b, c, hh, ww = h.shape
        q = self.q(h).reshape(b, c, hh * ww).transpose(1, 2)          # [b, hw, c]
        k = self.k(h).reshape(b, c, hh * ww)                          # [b, c, hw]
        weights = torch.softmax(torch.bmm(q, k) * c ** -0.5, dim=2)   # [b, hw(query), hw(key)]
        v = self.v(h).reshape(b, c, hh * ww)
        out = torch.bmm(v, weights.transpose(1, 2)).reshape(b, c, hh, ww)
        return x + self.proj_out(out)


class Downsample(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.conv = nn.Conv2d(width, width, 3, stride=2, padding=0)

    def forward(self, x):
        return self.conv(F.pad(x, (0, 1, 0, 1)))


class Upsample(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.conv = nn.Conv2d(width, width, 3, padding=1)

    def forward(self, x):
        return self.conv(F.interpolate(x, scale_factor=2.0, mode="nearest"))


def attention_levels(dd) -> list[bool]:
    return [dd["resolution"] // 2**i in dd["attn_resolutions"] for i in range(len(dd["ch_mult"]))]


def make_mid(width: int, zq_ch=None) -> nn.Module:
    mid = nn.Module()
    mid.block_1, mid.attn_1, mid.block_2 = ResnetBlock(width, width, zq_ch), AttnBlock(width, zq_ch), ResnetBlock(width, width, zq_ch)
    return mid


class Encoder(nn.Module):
    def __init__(self, dd):
        super().__init__()
        ch, mult, attn = dd["ch"], dd["ch_mult"], attention_levels(dd)
        self.conv_in = nn.Conv2d(3, ch, 3, padding=1)
        self.down = nn.ModuleList()
        width = ch
        for i, m in enumerate(mult):
            level = nn.Module()
            level.block, level.attn = nn.ModuleList(), nn.ModuleList()
            for _ in range(dd["num_res_blocks"]):
                level.block.append(ResnetBlock(width, ch * m))
                width = ch * m
                if attn[i]:
                    level.attn.append(AttnBlock(width))
            if i != len(mult) - 1:
                level.downsample = Downsample(width)
            self.down.append(level)
        self.mid = make_mid(width)
        self.norm_out = nn.GroupNorm(32, width, eps=1e-6)
        self.conv_out = nn.Conv2d(width, dd["z_channels"], 3, padding=1)

    def forward(self, x):
        h = self.conv_in(x)
        for i, level in enumerate(self.down):
            for k, block in enumerate(level.block):
                h = block(h)
                if len(level.attn):
                    h = level.attn[k](h)
            if i != len(self.down) - 1:
                h = level.downsample(h)
        h = self.mid.block_2(self.mid.attn_1(self.mid.block_1(h)))
        return self.conv_out(swish(self.norm_out(h)))


class MOVQDecoder(nn.Module):
    def __init__(self, dd):
        super().__init__()
        ch, mult, attn, zq = dd["ch"], dd["ch_mult"], attention_levels(dd), dd["embed_dim"]
        width = ch * mult[-1]
        self.conv_in = nn.Conv2d(dd["z_channels"], width, 3, padding=1)
        self.mid = make_mid(width, zq)
        self.up = nn.ModuleList()
        for i in reversed(range(len(mult))):
            level = nn.Module()
            level.block, level.attn = nn.ModuleList(), nn.ModuleList()
            for _ in range(dd["num_res_blocks"] + 1):
                level.block.append(ResnetBlock(width, ch * mult[i], zq))
                width = ch * mult[i]
                if attn[i]:
                    level.attn.append(AttnBlock(width, zq))
            if i != 0:
                level.upsample = Upsample(width)
            self.up.insert(0, level)  # up[0] is the full-resolution level
        self.norm_out = SpatialNorm(width, zq)
        self.conv_out = nn.Conv2d(width, 3, 3, padding=1)

    def forward(self, z, zq):
        h = self.conv_in(z)
        h = self.mid.block_2(self.mid.attn_1(self.mid.block_1(h, zq), zq), zq)
        for i in reversed(range(len(self.up))):
            level = self.up[i]
            for k, block in enumerate(level.block):
                h = block(h, zq)
                if len(level.attn):
                    h = level.attn[k](h, zq)
            if i != 0:
                h = level.upsample(h)
        return self.conv_out(swish(self.norm_out(h, zq)))


class MOVQ(nn.Module):
    def __init__(self, dd):
        super().__init__()
        self.encoder, self.decoder = Encoder(dd), MOVQDecoder(dd)
        self.quantize = nn.Module()
        self.quantize.embedding = nn.Embedding(dd["n_embed"], dd["embed_dim"])
        self.quant_conv = nn.Conv2d(dd["z_channels"], dd["embed_dim"], 1)
        self.post_quant_conv = nn.Conv2d(dd["embed_dim"], dd["z_channels"], 1)

    def decode_code(self, codes):  # [B, h, w] -> [B, 3, 8h, 8w]
        quant = self.quantize.embedding(codes).permute(0, 3, 1, 2)
        return self.decoder(self.post_quant_conv(quant), quant)

    def encode_indices(self, images):  # nearest codebook entry (|z|^2 + |e|^2 - 2 z.e), as [B, h, w]
        z = self.quant_conv(self.encoder(images)).permute(0, 2, 3, 1)
        e = self.quantize.embedding.weight
        d = (z**2).sum(-1, keepdim=True) + (e**2).sum(-1) - 2 * z @ e.t()
        return d.argmin(-1)


def randomized(dd, seed: int = 0) -> MOVQ:
    torch.manual_seed(seed)
    model = MOVQ(dd)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and p.ndim == 1:  # GroupNorm affine: away from the identity init
                p.copy_((1.0 if name.endswith("weight") else 0.0) + 0.1 * torch.randn_like(p))
        model.quantize.embedding.weight.normal_()
    return model.eval()


# ------------------------------------------------------------------------------------------------- tests
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
