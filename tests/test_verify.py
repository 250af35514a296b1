"""The verification reference: all-slot verification equals acceptance plus per-row residuals."""

from __future__ import annotations

import pytest
import torch

from vispec.kernels.philox import Stream, exponentials, uniforms
from vispec.kernels.verify import accept_drafts, residual_sample, sample_from_weights, verify_drafts


def _case(batch=6, width=5, vocab=7, seed=0, same=False):
    gen = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(batch, width, vocab, generator=gen) * 2, -1)
    q = p.clone() if same else torch.softmax(torch.randn(batch, width, vocab, generator=gen) * 2, -1)
    drafts = torch.randint(0, vocab, (batch, width), generator=gen)
    onehot = torch.rand(batch, width, generator=gen) < 0.5
    num = torch.tensor([0, 1, width, 2, width, 3])[:batch]
    seeds = torch.arange(batch) * 7919 + 3
    pos = torch.arange(width)[None].expand(batch, -1)
    draws = torch.zeros(batch, dtype=torch.long)
    return p, q, drafts, onehot, num, uniforms(seeds, pos, Stream.ACCEPT, draws), exponentials(seeds, pos, Stream.RESIDUAL, draws, vocab)


@pytest.mark.parametrize("seed", range(5))
def test_all_slots_equal_acceptance_plus_residual_rows(seed):
    p, q, drafts, onehot, num, u, e = _case(seed=seed)
    full = verify_drafts(p, drafts, q, onehot, num, u, e)
    flags, m = accept_drafts(p, drafts, q, onehot, num, u)
    assert torch.equal(flags, full.accepted) and torch.equal(m, full.num_accepted)
    rows = residual_sample(p, drafts, q, onehot, e)
    real = torch.arange(p.shape[1])[None] < num[:, None]
    expected = torch.where(real, torch.where(flags, drafts, rows), torch.full_like(rows, -1))
    assert torch.equal(full.coupled, expected)
    assert bool((full.coupled[~real] == -1).all()) and not bool(full.accepted[~real].any())
    assert bool((m <= num).all())


def test_zero_length_rows_and_p_equal_q_accepts_everything():
    p, q, drafts, onehot, num, u, e = _case(same=True)
    drafts = torch.multinomial(p.view(-1, p.shape[-1]), 1).view(drafts.shape)  # drafts drawn from q = p
    result = verify_drafts(p, drafts, q, torch.zeros_like(onehot), num, u, e)
    assert torch.equal(result.num_accepted, num)  # p = q: min(1, p/q) = 1, zero residual mass never used


def test_all_reject_when_draft_has_zero_target_mass():
    p, q, drafts, onehot, num, u, e = _case()
    p = p.clone()
    p.scatter_(-1, drafts[..., None], 0.0)
    p = p / p.sum(-1, keepdim=True)
    result = verify_drafts(p, drafts, q, onehot, num, u, e)
    assert int(result.num_accepted.sum()) == 0
    real = torch.arange(p.shape[1])[None] < num[:, None]
    assert bool((result.coupled[real] != drafts[real]).all())  # the residual never returns a zero-mass token


def test_race_never_picks_zero_weight():
    weights = torch.tensor([[0.0, 1e-30, 0.0, 0.0]])
    e = torch.full((1, 4), 1e-6)
    e[0, 1] = 50.0
    assert int(sample_from_weights(weights, e)[0]) == 1


def test_bad_shapes_name_the_argument():
    p, q, drafts, onehot, num, u, e = _case()
    with pytest.raises(ValueError, match="draft_tokens"):
        verify_drafts(p, drafts[:, :2], q, onehot, num, u, e)
    with pytest.raises(ValueError, match="residual_exponentials"):
        verify_drafts(p, drafts, q, onehot, num, u, e[..., :3])
    with pytest.raises(ValueError, match="draft_probs"):
        verify_drafts(p, drafts, None, onehot, num, u, e)
