"""Counter-based randomness: Philox4x32-10 in PyTorch, keyed by (sample seed, counters).

Every random number a decoder uses is a pure function of the sample's 64-bit seed and four 32-bit
counters, ``(c0, c1, c2, c3) = (vocab block, absolute token position, stream, draw)``. So

* a sample's output does not depend on what else is in the batch (no shared RNG state);
* MC-SJD's Gumbel coupling reuses the same noise for the same absolute position across Jacobi
  iterations without storing a ``[batch, positions, vocab]`` table (MC-SJD, arXiv 2510.24211);
* a Triton kernel computing ``tl.random.philox(seed, c0, c1, c2, c3)`` and the same uint32 -> float
  mapping reproduces these numbers bit for bit. Per-vocabulary noise uses all four output words:
  entry ``v`` is word ``v % 4`` of counter ``c0 = v // 4``.

Philox4x32-10 is Salmon et al., "Parallel random numbers: as easy as 1, 2, 3" (SC 2011); the round
constants are the ones Triton and cuRAND use. Integers are held in int64 tensors and masked to
32 bits; 32x32-bit products wrap modulo 2**64, which keeps their bit patterns exact.
"""

from __future__ import annotations

from enum import IntEnum
from typing import Optional, Sequence, Union

import torch
from torch import Tensor

_MASK32 = 0xFFFFFFFF
ROUND_A = 0xD2511F53
ROUND_B = 0xCD9E8D57
KEY_A = 0x9E3779B9
KEY_B = 0xBB67AE85
N_ROUNDS = 10


class Stream(IntEnum):
    """Counter ``c2``: which use a random number serves, so streams never overlap."""

    SAMPLE = 1  # fresh samples from p (AR tokens, SJD Jacobi drafts, bonus tokens)
    ACCEPT = 2  # acceptance uniforms of the speculative test
    RESIDUAL = 3  # exponential race for the residual max(0, p - q)
    INIT = 4  # random draft initialisation
    GUMBEL = 5  # MC-SJD Gumbel coupling (same for every iteration at a position)
    UNMASK = 6  # dLLM candidate sampling (float64 Gumbel-max over the vocabulary)
    REMASK = 7  # dLLM random remasking (one uniform per position and step)
    DRAFT = 8  # draft-model speculative decoding: the drafter's samples
    SIBLING = 9  # SJD-PAC: tree candidates drawn without replacement (Gumbel-top-k) besides the main draft


def philox4x32(seed: Tensor, c0: Tensor, c1: Tensor, c2: Tensor, c3: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The four output words of Philox4x32-10 with key ``seed`` (64-bit) and counter ``(c0..c3)``.

    All arguments are integer tensors that broadcast together; the words are int64 in
    ``[0, 2**32)``. ``seed`` may use all 64 bits (negative int64 values are read as two's
    complement).

    The 32x32-bit products may exceed int64's range: torch's integer multiply wraps modulo 2**64
    (two's complement), which keeps the bit pattern of the unsigned product, so ``(p >> 32) & M``
    is its high word and ``p & M`` its low word (pinned by the known-answer and Triton tests).
    """
    # key schedule for all rounds at once, at the seeds' (small) shape: [..., N_ROUNDS]
    bumps = torch.arange(N_ROUNDS, dtype=torch.int64, device=seed.device)
    k0s = ((seed & _MASK32)[..., None] + bumps * KEY_A) & _MASK32
    k1s = (((seed >> 32) & _MASK32)[..., None] + bumps * KEY_B) & _MASK32
    x0, x1, x2, x3 = (c & _MASK32 for c in (c0, c1, c2, c3))
    for r in range(N_ROUNDS):
        prod_b = x2 * ROUND_B
        prod_a = x0 * ROUND_A
        x0 = ((prod_b >> 32) & _MASK32) ^ x1 ^ k0s[..., r]
        x2 = ((prod_a >> 32) & _MASK32) ^ x3 ^ k1s[..., r]
        x1 = prod_b & _MASK32
        x3 = prod_a & _MASK32
    # ten rounds mix every input into every word, so all four already have the broadcast shape
    return x0, x1, x2, x3


def philox_uint32(seed: Tensor, c0: Tensor, c1: Tensor, c2: Tensor, c3: Tensor) -> Tensor:
    """First output word of :func:`philox4x32` (what Triton's ``tl.randint`` returns)."""
    return philox4x32(seed, c0, c1, c2, c3)[0]


def vocab_words(seeds: Tensor, positions: Tensor, stream_t: Tensor, draws: Tensor, vocab_size: int) -> Tensor:
    """``[B, W, V]`` words for every vocabulary entry: entry ``v`` is word ``v % 4`` of the Philox
    block with ``c0 = v // 4`` (one Philox evaluation serves four entries, like ``tl.randint4x``)."""
    blocks = torch.arange((vocab_size + 3) // 4, dtype=torch.int64, device=positions.device)
    stream_t = stream_t[..., None] if stream_t.dim() else stream_t
    words = philox4x32(seeds[:, None, None], blocks, positions[..., None], stream_t, draws[..., None])
    return torch.stack(words, dim=-1).flatten(-2)[..., :vocab_size]


def uniform_from_words(x: Tensor) -> Tensor:
    """Map uint32 words to float32 uniforms strictly inside (0, 1): ``((x >> 9) + 0.5) / 2**23``.

    Every value ``(k + 1/2) / 2**23`` is exact in float32 (the largest, ``1 - 2**-24``, is the float
    just below 1), so ``u`` is never 0 or 1, ``-log(u)`` is finite and ``u < 1`` always holds. The
    grid makes ``P[u < r]`` differ from ``r`` by at most ``2**-24``.
    """
    return ((x >> 9).to(torch.float32) + 0.5) * (1.0 / 8388608.0)


def _stream_tensor(stream: "Stream | Tensor", positions: Tensor) -> Tensor:
    if isinstance(stream, Tensor):
        return stream.to(device=positions.device, dtype=torch.int64).expand_as(positions)
    return torch.tensor(int(stream), dtype=torch.int64, device=positions.device)


def _counters(seeds: Tensor, positions: Tensor, stream: "Stream | Tensor", draws: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """int64 ``(seeds, positions, stream, draws)`` with ``draws`` (and a per-row stream) at ``positions``' shape."""
    positions = positions.to(torch.int64)
    draws = draws.to(torch.int64)
    if draws.dim() == 1:
        draws = draws[:, None].expand_as(positions)
    return seeds.to(torch.int64), positions, _stream_tensor(stream, positions), draws


def uniforms(seeds: Tensor, positions: Tensor, stream: "Stream | Tensor", draws: Tensor, vocab_size: int | None = None) -> Tensor:
    """Uniforms keyed by sample seed, absolute position, stream and draw index.

    Args:
        seeds: ``[B]`` int64 seeds, one per sample.
        positions: ``[B, W]`` absolute token positions.
        stream: the purpose (:class:`Stream`), or an int64 tensor broadcastable to ``positions``
            with one stream per row (so one Philox evaluation serves rows of several purposes).
        draws: ``[B]`` or ``[B, W]`` draw counters (a sample's forward-pass count, so a position
            verified again in a later pass gets fresh numbers).
        vocab_size: if given, returns ``[B, W, V]`` (one number per vocabulary entry, from
            :func:`vocab_words`); otherwise ``[B, W]`` (first word of the block ``c0 = 0``).
    """
    seeds, positions, stream_t, draws = _counters(seeds, positions, stream, draws)
    if vocab_size is None:
        words = philox_uint32(seeds[:, None], torch.zeros_like(positions), positions, stream_t, draws)
    else:
        words = vocab_words(seeds, positions, stream_t, draws, vocab_size)
    return uniform_from_words(words)


def uniforms64(seeds: Tensor, positions: Tensor, stream: "Stream | Tensor", draws: Tensor, vocab_size: int) -> Tensor:
    """``[B, W, V]`` float64 uniforms strictly inside (0, 1) with 53 random bits, one per vocabulary entry.

    Entry ``v`` uses words ``2 (v % 2)`` and ``2 (v % 2) + 1`` of the Philox block ``c0 = v // 2``:
    ``u = ((a >> 5) * 2**26 + (b >> 6) + 1/2) / 2**53``, the float64 construction of Random123's
    ``u01`` family. LLaDA draws its Gumbel noise in float64 because low-precision Gumbel-max hurts
    quality (arXiv 2409.02908); this is the counter-based equivalent.
    """
    seeds, positions, stream_t, draws = _counters(seeds, positions, stream, draws)
    stream_t = stream_t[..., None] if stream_t.dim() else stream_t
    blocks = torch.arange((vocab_size + 1) // 2, dtype=torch.int64, device=positions.device)
    w0, w1, w2, w3 = philox4x32(seeds[:, None, None], blocks, positions[..., None], stream_t, draws[..., None])
    high = torch.stack((w0, w2), dim=-1).flatten(-2)[..., :vocab_size]
    low = torch.stack((w1, w3), dim=-1).flatten(-2)[..., :vocab_size]
    return ((high >> 5) * 67108864 + (low >> 6)).to(torch.float64).add_(0.5).mul_(2.0**-53)


def exponentials(seeds: Tensor, positions: Tensor, stream: "Stream | Tensor", draws: Tensor, vocab_size: int) -> Tensor:
    """``[B, W, V]`` standard exponentials ``-log(u)`` (float32) for exponential-race sampling."""
    return -torch.log(uniforms(seeds, positions, stream, draws, vocab_size))


def seeds_from_generators(generators: list[torch.Generator | None], device: torch.device | str = "cpu") -> Tensor:
    """One int64 seed per sample, drawn from that sample's ``torch.Generator``.

    A ``None`` entry draws from torch's global generator. This is the only place a decoder touches
    a ``torch.Generator``; everything after is counter-based.
    """
    seeds = []
    for gen in generators:
        if gen is not None and not isinstance(gen, torch.Generator):
            raise ValueError(f"generator entries must be torch.Generator or None, got {type(gen).__name__}")
        value = torch.randint(-(2**63), 2**63 - 1, (1,), generator=gen, device=gen.device if gen is not None else "cpu")
        seeds.append(value.cpu())
    return torch.cat(seeds).to(device) if seeds else torch.zeros(0, dtype=torch.int64, device=device)


GeneratorArg = Union[None, torch.Generator, Sequence[Optional[torch.Generator]]]
"""What decoders take as ``generator``: ``None``, one ``torch.Generator`` for the batch, or one per sample."""


def per_sample_seeds(generator: GeneratorArg, batch_size: int, device: torch.device | str = "cpu") -> Tensor:
    """``[B]`` int64 seeds. A list gives one generator per sample (sample ``i``'s output then does
    not depend on the rest of the batch); a single generator is drawn ``B`` times in order."""
    if generator is None or isinstance(generator, torch.Generator):
        gens = [generator] * batch_size
    else:
        gens = list(generator)
        if len(gens) != batch_size:
            raise ValueError(f"generator list has {len(gens)} entries, expected one per sample ({batch_size})")
    return seeds_from_generators(gens, device)


def randint_below(seeds: Tensor, positions: Tensor, stream: Stream, draws: Tensor, high: int) -> Tensor:
    """``[B, W]`` integers uniform in ``[0, high)``: ``(word * high) >> 32`` (exact integer math)."""
    if draws.dim() == 1:
        draws = draws[:, None].expand_as(positions)
    stream_t = torch.tensor(int(stream), dtype=torch.int64, device=positions.device)
    words = philox_uint32(seeds.to(torch.int64)[:, None], torch.zeros_like(positions), positions.to(torch.int64), stream_t, draws.to(torch.int64))
    return (words * high) >> 32
