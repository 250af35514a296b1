"""The processed target distribution and the counter-based noise."""

from __future__ import annotations

import math

import pytest
import torch

from vispec.kernels.philox import Stream, philox4x32, randint_below, uniform_from_words, uniforms, vocab_words
from vispec.sampling import SamplingConfig, process_logits


def _pos(batch=1, width=1):
    return torch.zeros(batch, width, dtype=torch.long)


def test_cfg_on_raw_logits_then_temperature():
    cond = torch.tensor([[[2.0, 0.0, -1.0]]])
    uncond = torch.tensor([[[0.0, 1.0, 0.0]]])
    cfg = SamplingConfig(temperature=0.5, guidance_scale=3.0)
    expected = torch.softmax((uncond + 3.0 * (cond - uncond)) / 0.5, -1)
    torch.testing.assert_close(process_logits(cond, uncond, _pos(), cfg), expected)


def test_cfg_interval_follows_llamagen_steps():
    cond = torch.zeros(1, 4, 3)
    cond[..., 0] = 1.0
    uncond = torch.zeros(1, 4, 3)
    positions = torch.arange(4)[None]
    cfg = SamplingConfig(guidance_scale=5.0, cfg_interval=1)  # tokens 0, 1, 2 guided; 3 not
    probs = process_logits(cond, uncond, positions, cfg)
    guided = torch.softmax(torch.tensor([5.0, 0.0, 0.0]), -1)
    plain = torch.softmax(torch.tensor([1.0, 0.0, 0.0]), -1)
    for t in range(3):
        torch.testing.assert_close(probs[0, t], guided)
    torch.testing.assert_close(probs[0, 3], plain)


def test_top_k_keeps_ties_and_top_p_keeps_crossing_token():
    logits = torch.tensor([[[3.0, 2.0, 2.0, 0.0, -1.0]]])
    probs = process_logits(logits, None, _pos(), SamplingConfig(top_k=2))
    assert (probs[0, 0, :3] > 0).all() and (probs[0, 0, 3:] == 0).all()  # the tie at rank 2 is kept
    logits = torch.log(torch.tensor([[[0.5, 0.3, 0.15, 0.05]]]))
    probs = process_logits(logits, None, _pos(), SamplingConfig(top_p=0.7))
    torch.testing.assert_close(probs[0, 0], torch.tensor([0.625, 0.375, 0.0, 0.0]))
    probs = process_logits(logits, None, _pos(), SamplingConfig(top_p=0.8))  # 0.5 + 0.3 reaches 0.8
    assert (probs[0, 0, 2:] == 0).all()


def test_greedy_is_one_hot_on_first_argmax():
    logits = torch.tensor([[[1.0, 3.0, 3.0]]])
    probs = process_logits(logits, None, _pos(), SamplingConfig(temperature=0.0))
    assert probs.tolist() == [[[0.0, 1.0, 0.0]]]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(temperature=-1.0), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_k=-1), "top_k"),
        (dict(top_k=2.5), "top_k"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(guidance_scale=float("inf")), "guidance_scale"),
        (dict(cfg_interval=-2), "cfg_interval"),
    ],
)
def test_bad_sampling_config(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingConfig(**kwargs)


def test_bad_logits():
    with pytest.raises(ValueError, match="top_k"):
        process_logits(torch.zeros(1, 1, 4), None, _pos(), SamplingConfig(top_k=5))
    with pytest.raises(ValueError, match="NaN"):
        process_logits(torch.full((1, 1, 4), float("nan")), None, _pos(), SamplingConfig())
    with pytest.raises(ValueError, match="unconditional"):
        process_logits(torch.zeros(1, 1, 4), None, _pos(), SamplingConfig(guidance_scale=2.0))
    with pytest.raises(ValueError, match="logits"):
        process_logits(torch.zeros(1, 4), None, _pos(), SamplingConfig())


@pytest.mark.parametrize(
    "key, counter, expected",
    [  # Philox4x32-10 known-answer vectors (Random123 kat_vectors)
        (0, 0, (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
        (-1, 0xFFFFFFFF, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ],
)
def test_philox_known_answer(key, counter, expected):
    c = torch.tensor(counter)
    words = philox4x32(torch.tensor(key), c, c, c, c)
    assert tuple(int(w) for w in words) == expected


def test_philox_matches_triton():
    triton = pytest.importorskip("triton")
    import triton.language as tl

    @triton.jit
    def kernel(out_ptr, seed, c1, c2, c3, N: tl.constexpr):
        offs = tl.arange(0, N)
        zero = offs.to(tl.uint32) * 0
        a, b, c, d = tl.random.philox(seed, offs.to(tl.uint32), zero + c1, zero + c2, zero + c3)
        tl.store(out_ptr + offs, a.to(tl.int64))
        tl.store(out_ptr + N + offs, b.to(tl.int64))
        tl.store(out_ptr + 2 * N + offs, c.to(tl.int64))
        tl.store(out_ptr + 3 * N + offs, d.to(tl.int64))

    out = torch.zeros(4 * 64, dtype=torch.int64)
    seed = 0x1234567890ABCDE
    kernel[(1,)](out, seed, 7, int(Stream.RESIDUAL), 11, N=64)
    ref = philox4x32(torch.tensor(seed), torch.arange(64), torch.tensor(7), torch.tensor(int(Stream.RESIDUAL)), torch.tensor(11))
    assert torch.equal(out & 0xFFFFFFFF, torch.cat(ref))
    # per-vocabulary words: entry v is word v % 4 of block v // 4
    words = vocab_words(torch.tensor([seed]), torch.tensor([[7]]), torch.tensor(int(Stream.RESIDUAL)), torch.tensor([[11]]), 10)
    assert torch.equal(words[0, 0], torch.stack(ref, -1)[:3].flatten()[:10])


def test_uniforms_are_open_interval_and_uniform():
    seeds = torch.tensor([1, 2**62 + 5, -7])
    u = uniforms(seeds, torch.arange(2000)[None].expand(3, -1), Stream.ACCEPT, torch.tensor([0, 0, 0]))
    assert float(u.min()) > 0.0 and float(u.max()) < 1.0
    assert abs(float(u.mean()) - 0.5) < 0.02
    extremes = uniform_from_words(torch.tensor([0, 2**32 - 1]))
    assert float(extremes[0]) > 0 and float(extremes[1]) < 1 and math.isfinite(float(-torch.log(extremes[0])))
    ints = randint_below(seeds, torch.arange(3000)[None].expand(3, -1), Stream.INIT, torch.zeros(3, dtype=torch.long), 7)
    assert int(ints.min()) == 0 and int(ints.max()) == 6
