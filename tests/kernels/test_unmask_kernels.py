"""Triton unmasking kernel (:mod:`vispec.kernels.unmask_triton`) against the PyTorch reference.

Kernels run in Triton's interpreter on CPU (``conftest.py`` sets ``TRITON_INTERPRET=1``), plus an
AOT-compile check for sm80 / sm90 and a GPU comparison at real vocabulary sizes (skipped without
CUDA).

Tolerances: tokens must be equal. Confidence, margin and entropy are float64 in both
implementations and differ only in the order of the sums (tiles with online rescaling versus
torch's reductions) and in the algebraically equal entropy form ``log s - w / s`` versus
``-Σ p log p``; that moves results by a few float64 ulps times the condition number (observed
~1e-15 relative), so ``rtol = 1e-9`` is loose for float64 yet would catch any float32 step
(~1e-7). ``atol = 1e-12`` covers margins and entropies that are (near) zero, where a relative
bound means nothing.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch

pytest.importorskip("triton")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from vispec.kernels.philox import Stream, uniforms64  # noqa: E402
from vispec.kernels.unmask import RowNoise, UnmaskCandidates, unmask_candidates  # noqa: E402
from vispec.kernels.unmask_triton import compile_configs, unmask_candidates_triton  # noqa: E402

RTOL = 1e-9
ATOL = 1e-12

needs_kernel = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET", "0") not in ("1", "true", "on", "yes") and not torch.cuda.is_available(),
    reason="needs CUDA or TRITON_INTERPRET=1",
)


def _noise(n_rows: int, seed: int = 0, device: str = "cpu") -> RowNoise:
    gen = torch.Generator().manual_seed(seed)
    return RowNoise(
        torch.randint(-(2**62), 2**62, (n_rows,), generator=gen).to(device),
        torch.randint(0, 4096, (n_rows,), generator=gen).to(device),
        torch.randint(0, 64, (n_rows,), generator=gen).to(device),
    )


def _key_uniforms(noise: RowNoise, vocab: int) -> torch.Tensor:
    return uniforms64(noise.seeds, noise.positions[:, None], Stream.UNMASK, noise.draws, vocab)[:, 0]


def _assert_same(got: UnmaskCandidates, want: UnmaskCandidates) -> None:
    assert got.tokens.dtype == torch.int64 and got.confidence.dtype == torch.float64
    assert torch.equal(got.tokens, want.tokens), (got.tokens, want.tokens)
    for name in ("confidence", "margin", "entropy"):
        a, b = getattr(got, name), getattr(want, name)
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL, equal_nan=True, msg=lambda m: f"{name}: {m}")


def _kernel(logits, rows, temperature, *, uniforms=None, noise=None, proposal_mask=None, confidence_mask=None,
            block_size=None) -> UnmaskCandidates:
    """The kernel through the dispatch (default tile) or the launcher (explicit tile width)."""
    if block_size is None:
        return unmask_candidates(logits, temperature, uniforms, proposal_mask, confidence_mask,
                                 noise=noise, rows=rows, backend="triton")
    if rows is None:
        rows = torch.arange(logits.shape[0])
    keys = noise if noise is not None else (None, None, None)
    out = unmask_candidates_triton(logits, rows, temperature, uniforms, *keys, proposal_mask=proposal_mask,
                                   confidence_mask=confidence_mask, block_size=block_size)
    return UnmaskCandidates(*out)


def _reference(logits, rows, temperature, *, uniforms=None, noise=None, proposal_mask=None, confidence_mask=None):
    return unmask_candidates(logits, temperature, uniforms, proposal_mask, confidence_mask, noise=noise, rows=rows,
                             backend="reference")


def _check(logits, rows=None, temperature=0.0, *, noise_mode="keys", block_size=None, proposal_mask=None,
           confidence_mask=None, seed=0) -> UnmaskCandidates:
    """Kernel vs reference given the same noise (Philox keys, or the same keys' uniforms injected)."""
    n_rows = logits.shape[0] if rows is None else rows.numel()
    noise = _noise(n_rows, seed, str(logits.device))
    kwargs = dict(proposal_mask=proposal_mask, confidence_mask=confidence_mask)
    if noise_mode == "keys":
        kwargs["noise"] = noise
    else:
        kwargs["uniforms"] = _key_uniforms(noise, logits.shape[-1])
    want = _reference(logits, rows, temperature, **kwargs)
    got = _kernel(logits, rows, temperature, block_size=block_size, **kwargs)
    _assert_same(got, want)
    if noise_mode == "keys" and temperature > 0:  # the keys draw exactly the uniforms64 numbers
        _assert_same(_reference(logits, rows, temperature, uniforms=_key_uniforms(noise, logits.shape[-1]),
                                proposal_mask=proposal_mask, confidence_mask=confidence_mask), want)
    return got


# ---------------------------------------------------------------------------------------------------------
# fixed cases


@needs_kernel
@pytest.mark.parametrize("vocab, block_size", [(1, None), (7, None), (100, None), (100, 16), (300, 64)])
@pytest.mark.parametrize("temperature", [0.0, 0.7])
@pytest.mark.parametrize("noise_mode", ["keys", "uniforms"])
def test_matches_reference_vocab_sizes(vocab, block_size, temperature, noise_mode):
    """V not a power of two, V below / above the tile (several tiles, a ragged last tile), V = 1."""
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(3, vocab, generator=gen) * 3.0
    _check(logits, temperature=temperature, noise_mode=noise_mode, block_size=block_size, seed=vocab)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
@pytest.mark.parametrize("temperature", [0.0, 1.3])
def test_matches_reference_dtypes(dtype, temperature):
    gen = torch.Generator().manual_seed(1)
    logits = (torch.randn(4, 130, generator=gen) * 4.0).to(dtype)
    _check(logits, temperature=temperature, block_size=32)


@needs_kernel
@pytest.mark.parametrize("temperature", [0.0, 0.5])
@pytest.mark.parametrize("noise_mode", ["keys", "uniforms"])
def test_masks_and_confidence_masked_candidate(temperature, noise_mode):
    vocab = 90
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(4, vocab, generator=gen)
    logits[:, 3] = 40.0  # proposal-masked: would always win
    logits[0, 11] = 30.0  # row 0 proposes 11, which is confidence-masked -> confidence 0
    logits[1, 60] = 30.0  # row 1 proposes 60 (second tile), confidence-masked
    logits[2, 20] = float("-inf")  # an -inf logit (LLaDA's logits_eos_inf) must not give NaN
    proposal = torch.zeros(vocab, dtype=torch.bool)
    proposal[[3, 50]] = True
    confidence = torch.zeros(vocab, dtype=torch.bool)
    confidence[[11, 60, 61]] = True
    got = _check(logits, temperature=temperature, noise_mode=noise_mode, block_size=32,
                 proposal_mask=proposal, confidence_mask=confidence)
    assert not bool((got.tokens == 3).any())
    assert got.tokens[:2].tolist() == [11, 60] and got.confidence[:2].tolist() == [0.0, 0.0]
    assert bool(torch.isfinite(got.entropy).all()) and bool(torch.isfinite(got.confidence).all())
    # each mask alone
    _check(logits, temperature=temperature, noise_mode=noise_mode, block_size=32, proposal_mask=proposal)
    _check(logits, temperature=temperature, noise_mode=noise_mode, block_size=32, confidence_mask=confidence)


@needs_kernel
def test_ties_go_to_the_lowest_index_across_tiles():
    logits = torch.zeros(2, 64)
    logits[0, [40, 9, 57]] = 5.0  # maximum repeated in tiles 0, 2 and 3 (tile width 16)
    logits[1, [33, 34]] = 2.0  # repeated maximum inside one tile
    got = _check(logits, block_size=16)
    assert got.tokens.tolist() == [9, 33]
    assert got.margin.tolist() == [0.0, 0.0]


@needs_kernel
def test_rows_zero_one_and_in_place_subset():
    gen = torch.Generator().manual_seed(3)
    full = torch.randn(3, 10, 77, generator=gen) * 2.0
    block = full[:, 2:7]  # a block slice of [B, L, V], not viewable as a contiguous [B * Lb, V]
    empty = torch.zeros(0, dtype=torch.long)
    for temperature in (0.0, 0.9):
        out = _check(block, empty, temperature)
        assert out.tokens.shape == (0,) and out.entropy.shape == (0,)
        _check(block[0], torch.tensor([3]), temperature)  # R = 1
        _check(block[0, 1:2], None, temperature)  # R = 1 without rows
        _check(torch.zeros(0, 77), None, temperature)  # R = 0 without rows
        rows = torch.tensor([14, 0, 7, 7, 3])  # subset in any order, with a repeat
        _check(block, rows, temperature, block_size=32, seed=5)
        _check(block.to(torch.bfloat16), rows, temperature, seed=6)
    # rows index the logical [N, V] view: row 7 of block is full[1, 2 + 2]
    one = _kernel(block, torch.tensor([7]), 0.0)
    assert int(one.tokens) == int(full[1, 4].argmax())


@needs_kernel
def test_entirely_masked_rows_match_the_reference():
    """All -inf rows (reference: NaN confidence / margin, entropy 0) and an all-masked proposal."""
    logits = torch.full((3, 20), float("-inf"))
    logits[1, [2, 4]] = 1.0
    logits[2] = torch.linspace(-1, 1, 20)
    everything = torch.ones(20, dtype=torch.bool)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # numpy's inf - inf inside the interpreter
        _check(logits, block_size=16)
        _check(logits, temperature=0.4, block_size=16, proposal_mask=everything, confidence_mask=everything)


@needs_kernel
def test_scheduler_step_same_with_either_backend(monkeypatch):
    """The scheduler passes the block logits in place plus row indices and Philox keys."""
    from vispec.dllm.schedulers import LLaDAScheduler, UnmaskNoise

    gen = torch.Generator().manual_seed(4)
    batch, length, vocab, mask_id = 2, 6, 50, 49
    model_output = torch.randn(batch, length + 3, vocab, generator=gen)[:, 1 : length + 1]
    sample = torch.randint(0, 40, (batch, length), generator=gen)
    sample[0, [1, 2, 5]] = mask_id
    sample[1, [0, 4]] = mask_id
    noise = UnmaskNoise(torch.tensor([11, -5]), torch.arange(length)[None].expand(batch, -1) + 8, torch.tensor([2, 3]))
    scheduler = LLaDAScheduler()
    scheduler.set_timesteps(2, length, length)
    outs = {}
    for backend in ("reference", "triton"):
        monkeypatch.setenv("VISPEC_KERNELS", backend)
        outs[backend] = scheduler.step(model_output, 0, sample, mask_token_id=mask_id, temperature=0.8, noise=noise,
                                       num_masked_at_block_start=torch.tensor([3, 2]))
    assert torch.equal(outs["triton"].prev_sample, outs["reference"].prev_sample)
    assert torch.equal(outs["triton"].sampled_tokens, outs["reference"].sampled_tokens)
    torch.testing.assert_close(outs["triton"].confidence, outs["reference"].confidence, rtol=RTOL, atol=ATOL)


# ---------------------------------------------------------------------------------------------------------
# input validation (no kernel launch)


def test_invalid_inputs_raise_clear_errors():
    logits = torch.randn(2, 10)
    rows = torch.tensor([0, 1])
    bad = [
        (dict(logits=torch.randn(2, 3, 10)), "logits"),
        (dict(logits=torch.zeros(2, 10, dtype=torch.long)), "logits"),
        (dict(temperature=-1.0), "temperature"),
        (dict(temperature=0.5), "noise"),
        (dict(temperature=0.5, uniforms=torch.rand(2, 9, dtype=torch.float64)), "uniforms"),
        (dict(temperature=0.5, uniforms=torch.rand(2, 10)), "float64"),
        (dict(temperature=0.5, uniforms=torch.rand(2, 10, dtype=torch.float64), noise=_noise(2)), "either"),
        (dict(temperature=0.5, noise=_noise(3)), "noise.seeds"),
        (dict(temperature=0.5, noise=(1, 2, 3)), "noise.seeds"),
        (dict(rows=torch.tensor([0, 2])), "rows"),
        (dict(rows=torch.tensor([[0]])), "rows"),
        (dict(rows=torch.tensor([0.0])), "rows"),
        (dict(proposal_mask=torch.zeros(9, dtype=torch.bool)), "proposal_mask"),
        (dict(confidence_mask=torch.zeros(10)), "confidence_mask"),
        (dict(backend="cuda"), "backend"),
    ]
    for kwargs, name in bad:
        args = dict(logits=logits, temperature=0.0)
        args.update(kwargs)
        logits_arg, temperature = args.pop("logits"), args.pop("temperature")
        with pytest.raises(ValueError, match=name):
            unmask_candidates(logits_arg, temperature, **args)
    # rows allow [..., V] logits
    out = unmask_candidates(torch.randn(2, 3, 10), 0.0, rows=rows, backend="reference")
    assert out.tokens.shape == (2,)


# ---------------------------------------------------------------------------------------------------------
# fuzz


@needs_kernel
@settings(max_examples=25, deadline=None)
@given(
    n_total=st.integers(1, 5),
    vocab=st.integers(1, 200),
    block_size=st.sampled_from([None, 16, 32, 64]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    temperature=st.sampled_from([0.0, 0.3, 1.0, 2.5]),
    noise_mode=st.sampled_from(["keys", "uniforms"]),
    masks=st.sampled_from(["none", "proposal", "confidence", "both"]),
    ties=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
    data=st.data(),
)
def test_fuzz_shapes(n_total, vocab, block_size, dtype, temperature, noise_mode, masks, ties, seed, data):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(n_total, vocab, generator=gen) * 3.0
    if ties:  # coarse values: repeated maxima
        logits = logits.round()
    logits = logits.to(dtype)
    rows = data.draw(st.one_of(st.none(), st.lists(st.integers(0, n_total - 1), max_size=6)))
    rows = None if rows is None else torch.tensor(rows, dtype=torch.long)
    proposal = torch.rand(vocab, generator=gen) < 0.2 if masks in ("proposal", "both") else None
    confidence = torch.rand(vocab, generator=gen) < 0.2 if masks in ("confidence", "both") else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        _check(logits, rows, temperature, noise_mode=noise_mode, block_size=block_size, proposal_mask=proposal,
               confidence_mask=confidence, seed=seed)


# ---------------------------------------------------------------------------------------------------------
# AOT compile (no GPU needed)

# Compilation for sm_80 / sm_90 of every configuration in compile_configs() is checked with all the
# other kernels by tests/kernels/test_verify_kernels.py (vispec.kernels.compile_check).


# ---------------------------------------------------------------------------------------------------------
# GPU


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("vocab", [16384, 32000, 126464, 151936])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_matches_reference(vocab, dtype):
    gen = torch.Generator().manual_seed(vocab)
    full = (torch.randn(4, 40, vocab, generator=gen) * 4.0).to(dtype).cuda()
    block = full[:, 8:40]
    rows = torch.randperm(4 * 32, generator=gen)[:64].cuda()
    proposal = torch.zeros(vocab, dtype=torch.bool, device="cuda")
    proposal[[0, vocab - 1]] = True
    confidence = torch.zeros(vocab, dtype=torch.bool, device="cuda")
    confidence[[1, 2, vocab // 2]] = True
    for temperature in (0.0, 1.0):
        for masks in ((None, None), (proposal, confidence)):
            noise = _noise(rows.numel(), vocab, "cuda")
            want = _reference(block, rows, temperature, noise=noise, proposal_mask=masks[0], confidence_mask=masks[1])
            got = unmask_candidates(block, temperature, None, *masks, noise=noise, rows=rows, backend="triton")
            _assert_same(got, want)
