"""Draft initialisation for new Jacobi window slots (SJD, arXiv 2410.01699, §3.3 and Fig. 9).

Initialised drafts are deterministic given the current state (or drawn from an independent noise
stream), so their draft distribution is one-hot: a draft ``x`` is accepted with probability
``p(x)``. That keeps SJD exact whatever the initialisation.

For a sample with ``n`` committed tokens and ``c`` valid drafts, the known prefix ends at
``k = n + c`` (positions ``< k`` hold committed tokens or drafts); slots at positions ``>= k`` are
initialised:

* ``random``: uniform over the vocabulary (noise stream ``INIT``);
* ``horizontal``: the previous token in raster order. For a run of new slots that is the last
  known token ``x[k - 1]`` (each new slot copies its left neighbour, itself a copy);
* ``vertical``: the token one row above, ``x[pos - g]`` for grid width ``g``, following the chain
  ``pos - g, pos - 2g, ...`` back into the known prefix; on the first row it falls back to
  ``horizontal``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from vispec.kernels.philox import Stream, randint_below


def init_draft_tokens(
    init: str,
    tokens: Tensor,
    positions: Tensor,
    known: Tensor,
    grid_width: int,
    vocab_size: int,
    seeds: Tensor,
    draws: Tensor,
) -> Tensor:
    """Initial tokens for window slots at ``positions [B, W]`` (only slots at ``>= known`` matter).

    ``tokens [B, T]`` holds committed tokens and drafts by absolute position; ``known [B]`` is the
    first position without a token (``>= 1``: token 0 is always committed before any window).
    """
    if init == "random":
        return randint_below(seeds, positions, Stream.INIT, draws, vocab_size)
    last_known = tokens.gather(1, (known - 1)[:, None]).expand_as(positions)
    if init == "horizontal":
        return last_known
    if init == "vertical":
        steps_back = torch.div(positions - known[:, None], grid_width, rounding_mode="floor") + 1
        source = positions - steps_back * grid_width
        above = tokens.gather(1, source.clamp_min(0))
        return torch.where(source >= 0, above, last_known)
    raise ValueError(f"init must be one of ('random', 'horizontal', 'vertical'), got {init!r}")
