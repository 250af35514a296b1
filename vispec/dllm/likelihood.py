"""Log-likelihood of a continuation under a masked diffusion LM: LLaDA's Monte-Carlo bound.

A masked diffusion LM has no left-to-right factorisation, so ``log p(y | x)`` of a continuation ``y`` (``L`` tokens)
after a prompt ``x`` is not a sum of next-token terms. LLaDA (Nie et al. 2025, arXiv 2502.09992) scores it with
the lower bound its evaluation uses (the lower-variance form of its ELBO, over the number of masked tokens rather
than a continuous masking time)::

    log p(y | x) >= E_{l ~ U{1..L}} E_{M ~ U{subsets of size l}} [ (L / l) * sum_{i in M} log p_theta(y_i | x, y with M masked) ]

The mask predictor sees the prompt intact and the continuation with the ``l`` positions of ``M`` replaced by the
mask token; the ``L / l`` weight (``1 / p_mask`` with ``p_mask = l / L``) makes every mask count contribute on the
scale of the whole continuation. :func:`log_likelihood_bound` averages ``mc_num`` samples of the bracket. As LLaDA's
official evaluation computes it (``eval_llada.py``: 128 samples in mini-batches of 32; ``get_log_likelihood.py``: 128
in mini-batches of 16, citing the paper's Appendix B.5: one sample for single-token continuations, where the bound is
exact, and 128 for the rest), the mask counts of a mini-batch of ``b`` samples are stratified:
``l_j = ((round(k + j L / b) - 1) mod L) + 1`` for ``j = 0 .. b-1`` with one uniform offset ``k`` in ``{1..L}`` per
mini-batch, and each sample masks ``l_j`` positions drawn uniformly without replacement.

Guidance as in the rest of vispec: ``guidance_scale = s`` scores with ``l_u + s (l_c - l_u)``, the unconditional
branch seeing the prompt masked (LLaDA's ``cfg = s - 1``); 1 is off.

Randomness comes from one ``torch.Generator`` per continuation, so a continuation's estimate does not depend on
which others are scored with it. Each mini-batch is one forward of ``b`` rows of the same length (no padding); the
masks of all of a continuation's samples are drawn at once (no Python loop over samples or positions).
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from vispec.checks import check_int, check_number

# LLaDA's official evaluation settings (eval_llada.py): Monte-Carlo samples per continuation and rows per forward
MC_NUM = 128
MC_BATCH_SIZE = 32


def stratified_mask_counts(length: int, batch_size: int, offsets: Tensor) -> Tensor:
    """``[R, b]`` mask counts in ``{1..length}``: for mini-batch ``r`` with offset ``offsets[r]`` in ``{1..length}``,
    ``l_j = ((round(k + j * length / b) - 1) mod length) + 1`` (module docstring; ``round`` half to even)."""
    j = torch.arange(batch_size, dtype=torch.float64)
    counts = torch.round(offsets.to(torch.float64)[:, None] + j * (length / batch_size)).long()
    return (counts - 1) % length + 1


def random_masks(counts: Tensor, length: int, generator: torch.Generator) -> Tensor:
    """``[N, length]`` bool: row ``n`` masks ``counts[n]`` positions drawn uniformly without replacement (the ranks
    of i.i.d. uniform keys)."""
    keys = torch.rand(counts.shape[0], length, generator=generator, dtype=torch.float64)
    ranks = keys.argsort(dim=1).argsort(dim=1)
    return ranks < counts[:, None]


def _check_ids(name: str, ids: Tensor, allow_empty: bool) -> Tensor:
    if not isinstance(ids, Tensor) or ids.dim() != 1 or ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise ValueError(f"{name} must be 1-D integer token id tensors, got "
                         f"{tuple(ids.shape) if isinstance(ids, Tensor) else type(ids).__name__}")
    if ids.numel() == 0 and not allow_empty:
        raise ValueError(f"{name} must hold at least one token")
    return ids.long()


def _widened(logits: Tensor) -> Tensor:
    """Half-precision logits in float32 (float32 and float64 kept)."""
    return logits if logits.dtype in (torch.float32, torch.float64) else logits.float()


def _logits(model, ids: Tensor, prompt_len: int, mask_token_id: int, guidance_scale: float) -> Tensor:
    """``[b, N, V]`` logits of ``ids [b, N]`` (no padding; float32 at least), guided when ``guidance_scale != 1``."""
    if guidance_scale == 1.0:
        return _widened(model(ids).logits)
    unconditional = ids.clone()
    unconditional[:, :prompt_len] = mask_token_id
    both = _widened(model(torch.cat([ids, unconditional])).logits)
    conditional, uncond = both.chunk(2)
    return uncond + guidance_scale * (conditional - uncond)


@torch.no_grad()
def log_likelihood_bound(
    model,
    prompts: Sequence[Tensor],
    continuations: Sequence[Tensor],
    *,
    mask_token_id: int,
    generators: Sequence[torch.Generator],
    mc_num: int = MC_NUM,
    batch_size: int = MC_BATCH_SIZE,
    guidance_scale: float = 1.0,
) -> Tensor:
    """``[n]`` float64 Monte-Carlo estimates of LLaDA's bound on ``log p(continuation | prompt)`` (module docstring).

    Args:
        model: a mask predictor, ``model(ids [b, N]).logits -> [b, N, V]`` (bidirectional; a Dream-style model's
            output aligned to the positions, as :class:`vispec.models.llada.LLaDAModelLM` returns it).
        prompts, continuations: ``n`` 1-D token id tensors each (a prompt may be empty; a continuation may not).
        mask_token_id: the model's mask token.
        generators: one CPU ``torch.Generator`` per continuation (the offsets and the masks are drawn from it).
        mc_num: samples per continuation, a multiple of ``batch_size``.
        batch_size: samples per forward (one stratified mini-batch).
        guidance_scale: CFG scale ``s >= 1`` (1 = off).
    """
    check_int("mc_num", mc_num, minimum=1, hint=" (Monte-Carlo samples per continuation; LLaDA uses 128)")
    check_int("batch_size", batch_size, minimum=1, hint=" (Monte-Carlo samples per forward; LLaDA uses 32)")
    if mc_num % batch_size:
        raise ValueError(f"mc_num ({mc_num}) must be a multiple of batch_size ({batch_size}): the mask counts are "
                         "stratified within each mini-batch of batch_size samples")
    check_number("guidance_scale", guidance_scale, minimum=1, hint=" (1 = off; LLaDA's cfg = guidance_scale - 1)")
    check_int("mask_token_id", mask_token_id, minimum=0)
    if not (len(prompts) == len(continuations) == len(generators)):
        raise ValueError(f"prompts, continuations and generators must have one entry per continuation, got "
                         f"{len(prompts)}, {len(continuations)} and {len(generators)}")
    prompts = [_check_ids("prompts", p, allow_empty=True) for p in prompts]
    continuations = [_check_ids("continuations", c, allow_empty=False) for c in continuations]
    for generator in generators:
        if not isinstance(generator, torch.Generator) or generator.device.type != "cpu":
            raise ValueError("generators must be CPU torch.Generator objects, one per continuation")
    device = next(model.parameters()).device
    rounds = mc_num // batch_size
    estimates = torch.empty(len(prompts), dtype=torch.float64)
    for n, (prompt, target, generator) in enumerate(zip(prompts, continuations, generators)):
        length, prompt_len = target.numel(), prompt.numel()
        offsets = torch.randint(1, length + 1, (rounds,), generator=generator)
        counts = stratified_mask_counts(length, batch_size, offsets).reshape(-1)  # [mc_num]
        masks = random_masks(counts, length, generator)  # [mc_num, L]
        sequence = torch.cat([prompt, target]).to(device)
        weights = (length / counts.to(torch.float64)).to(device)  # 1 / p_mask
        total = torch.zeros((), dtype=torch.float64, device=device)
        for r in range(rounds):  # one forward per stratified mini-batch
            rows = slice(r * batch_size, (r + 1) * batch_size)
            mask = masks[rows].to(device)
            noisy = sequence.expand(batch_size, -1).clone()
            noisy[:, prompt_len:] = torch.where(mask, torch.full_like(mask, mask_token_id, dtype=torch.long),
                                                noisy[:, prompt_len:])
            logits = _logits(model, noisy, prompt_len, mask_token_id, guidance_scale)[:, prompt_len:]
            nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.to(device).repeat(batch_size),
                                  reduction="none").reshape(batch_size, length).to(torch.float64)
            total += ((nll * mask).sum(dim=1) * weights[rows]).sum()
        estimates[n] = -(total / mc_num).cpu()
    return estimates
