"""A reference SBER-MoVQGAN (Lumina-mGPT 2.0's tokenizer), written for tests from the structure of the official model
(ai-forever/MoVQGAN ``movqgan/modules/vqvae/vqvae_blocks.py`` ``Encoder``, ``movq_modules.py`` ``MOVQDecoder`` /
``SpatialNorm``, ``models/vqgan.py`` ``MOVQ``) with the official module names, so its ``state_dict()`` has the
official key layout. Used by the MoVQGAN, conversion and README tests."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

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
