"""Pearson's chi-square test of sampled sequences against an exact joint, with the power calculation of the
exactness certificates (tests/exactness/test_exactness.py's module docstring): the smallest ``n`` whose power against
TV ``δ = 0.03`` is at least 0.99 at level ``α = 1e-3``, cells with expected count < 5 pooled."""

from __future__ import annotations

import torch
from scipy import stats

from helpers import sequence_index

ALPHA = 1e-3
POWER = 0.99
TV_DETECT = 0.03


def pooled_cells(expected: torch.Tensor, min_expected: float = 5.0) -> torch.Tensor:
    """Cell id per sequence: its own cell if its expected count is >= min_expected, else one pooled cell."""
    big = expected >= min_expected
    ids = torch.full_like(expected, -1, dtype=torch.long)
    ids[big] = torch.arange(int(big.sum()))
    ids[~big] = int(big.sum())
    return ids


def degrees_of_freedom(joint: torch.Tensor, n: int) -> int:
    ids = pooled_cells(joint * n)
    return int(ids.max()) + 1 - 1


def required_samples(joint: torch.Tensor, tv: float = TV_DETECT, alpha: float = ALPHA, power: float = POWER) -> int:
    """Smallest n (multiple of 1024) with power >= `power` against TV `tv` (module docstring)."""
    n = 1024
    while True:
        df = degrees_of_freedom(joint, n)
        critical = stats.chi2.ppf(1 - alpha, df)
        if stats.ncx2.sf(critical, df, 4 * n * tv * tv) >= power:
            return n
        n += 1024


def chi_square_vs_exact(tokens: torch.Tensor, joint: torch.Tensor, vocab: int) -> tuple[float, float, float]:
    """(statistic, p-value, empirical TV) of sampled sequences against the exact joint."""
    n = tokens.shape[0]
    counts = torch.bincount(sequence_index(tokens, vocab), minlength=joint.numel()).double()
    ids = pooled_cells(joint * n)
    cells = int(ids.max()) + 1
    observed = torch.zeros(cells, dtype=torch.float64).index_add_(0, ids, counts)
    expected = torch.zeros(cells, dtype=torch.float64).index_add_(0, ids, joint * n)
    statistic = float(((observed - expected) ** 2 / expected).sum())
    p_value = float(stats.chi2.sf(statistic, cells - 1))
    tv = 0.5 * float((counts / n - joint).abs().sum())
    return statistic, p_value, tv
