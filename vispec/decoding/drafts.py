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
  ``horizontal``;
* ``source``: input-guided aggressive decoding (IAD; Ge et al., arXiv 2205.10350, §2): the token of a source
  image at the same grid position, ``s[pos]`` (an image-to-image request: the picture being edited, tokenised
  by the model's VQ). Positions without a source token (``s[pos] = -1``) fall back to ``horizontal``. Image
  grids do not shift, so a rejection that commits another token leaves the alignment as it is: the draft for
  position ``pos`` is always ``s[pos]``.

Every rule is a deterministic function of the committed tokens and fixed inputs (or of independent noise), so
the draft distribution is one-hot and the verification exact.
"""

from __future__ import annotations

from typing import Optional

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
    source: Optional[Tensor] = None,
) -> Tensor:
    """Initial tokens for window slots at ``positions [B, W]`` (only slots at ``>= known`` matter).

    ``tokens [B, T]`` holds committed tokens and drafts by absolute position; ``known [B]`` is the
    first position without a token (``>= 1``: token 0 is always committed before any window).
    ``source [B, N]``: the source tokens of the batch's slots (``init="source"`` only; :func:`source_rows`);
    positions past ``N`` (window padding) read its last column.
    """
    if init == "random":
        return randint_below(seeds, positions, Stream.INIT, draws, vocab_size)
    last_known = tokens.gather(1, (known - 1)[:, None]).expand_as(positions)
    if init == "horizontal":
        return last_known
    if init == "source":
        if source is None:
            raise ValueError("init 'source' (input-guided drafts) needs the source tokens of the request")
        copied = source.gather(1, positions.clamp(0, source.shape[1] - 1))
        return torch.where(copied >= 0, copied, last_known)
    if init == "vertical":
        steps_back = torch.div(positions - known[:, None], grid_width, rounding_mode="floor") + 1
        row_above = positions - steps_back * grid_width
        above = tokens.gather(1, row_above.clamp_min(0))
        return torch.where(row_above >= 0, above, last_known)
    raise ValueError(f"init must be one of ('random', 'horizontal', 'vertical', 'source'), got {init!r}")


def source_rows(source: Optional[Tensor], ids: Tensor) -> Optional[Tensor]:
    """The source tokens ``[B, N]`` of the batch slots whose requests are ``ids [B]`` (-1: an idle slot, which
    reads request 0's: its rows are padding); None without a source."""
    return None if source is None else source.to(ids.device).index_select(0, ids.clamp_min(0))
