"""LANTERN's codebook neighbour tables: each code's nearest other codes, computed once per codebook.

LANTERN (Jang et al., ICLR 2025, arXiv 2410.03355) relaxes acceptance over the ``k`` codes nearest to a
draft in the VQ latent space (:class:`vispec.decoding.acceptance.LanternRule`). Finding them costs
``O(V² D)``, so :class:`NeighborTables` keeps one table per codebook and metric (raw or L2-normalised
vectors), keyed by the codebook's content (:func:`codebook_key`): a retrained or swapped tokenizer never
reuses another's table. Tables keep at least :data:`MAX_STORED_NEIGHBORS` columns (LANTERN's default
``k``), so every smaller ``k`` slices the same table. A pipeline owns one cache and every rule it builds
goes through it (:func:`vispec.decoding.rules.build_rule`).
"""

from __future__ import annotations

import hashlib
from typing import Optional

import torch
from torch import Tensor

from vispec.checks import check_int

MAX_STORED_NEIGHBORS = 1000
METRICS = {False: "raw", True: "normalized"}  # the table names a saved file uses


def codebook_neighbors(codebook: Tensor, k: int, normalize: bool = False, chunk: int = 4096) -> Tensor:
    """``[V, k]`` int64: each codebook entry's ``k`` nearest other entries by L2 distance, nearest first.

    LANTERN computes them on the raw VQ codebook weights (``normalize=False``); LlamaGen decodes
    with L2-normalised codes, which ``normalize=True`` uses instead.

    A row that is not all finite (NaN) marks a token with no latent, such as an end-of-row token in a
    unified decoder vocabulary: it is nobody's neighbour, and its own neighbours are itself (so the rule
    relaxes nothing for it: a draft of it is kept only as far as ``p`` itself allows).
    """
    if codebook.dim() != 2:
        raise ValueError(f"codebook must be [entries, dim], got shape {tuple(codebook.shape)}")
    vocab = codebook.shape[0]
    _check_k(codebook, k)
    weights = codebook.detach().double()
    latent = torch.isfinite(weights).all(-1)
    weights = torch.where(latent[:, None], weights, torch.zeros_like(weights))
    if normalize:
        weights = torch.nn.functional.normalize(weights, dim=-1)
    out = []
    for lo in range(0, vocab, chunk):
        dist = torch.cdist(weights[lo : lo + chunk], weights)
        rows = torch.arange(lo, min(lo + chunk, vocab))
        dist[rows - lo, rows] = float("inf")
        dist[:, ~latent] = float("inf")
        nearest = dist.topk(k, dim=-1, largest=False).indices if k else torch.zeros(len(rows), 0, dtype=torch.long)
        out.append(torch.where(latent[rows, None], nearest, rows[:, None]))
    return torch.cat(out)


def max_neighbors(codebook: Tensor) -> int:
    """The most neighbours a token of ``codebook`` can have: its latent entries (all finite) but itself."""
    return _latent_entries(codebook) - 1


def _latent_entries(codebook: Tensor) -> int:
    """How many rows of ``codebook`` are a latent (all finite)."""
    return int(torch.isfinite(codebook.detach()).all(-1).sum())


def _check_k(codebook: Tensor, k: int) -> None:
    """``k`` neighbours exist: at most the latent entries minus the token itself."""
    vocab, latent = codebook.shape[0], _latent_entries(codebook)
    extra = "" if latent == vocab else f", {latent} with a latent"
    check_int("lantern_k", k, minimum=0, maximum=latent - 1, hint=f" (codebook of {vocab} entries{extra})")


def codebook_key(codebook: Tensor) -> str:
    """A fingerprint of the codebook's shape, dtype and values (BLAKE2b of its bytes)."""
    values = codebook.detach().cpu().contiguous()
    digest = hashlib.blake2b(digest_size=16)
    digest.update(f"{tuple(values.shape)}:{values.dtype}".encode())
    digest.update(values.view(torch.uint8).numpy().tobytes() if values.numel() else b"")
    return digest.hexdigest()


class NeighborTables:
    """LANTERN neighbour tables by (codebook fingerprint, metric) (module docstring)."""

    def __init__(self) -> None:
        self._tables: dict[tuple[str, bool], Tensor] = {}

    def __len__(self) -> int:
        return len(self._tables)

    def table(self, codebook: Tensor, k: int, normalize: bool = False) -> Tensor:
        """``[V, >= k]`` the neighbours of every code of ``codebook``: cached, or computed now with
        ``max(MAX_STORED_NEIGHBORS, k)`` columns (at most ``V - 1``) and kept."""
        if codebook.dim() != 2:
            raise ValueError(f"codebook must be [entries, dim], got shape {tuple(codebook.shape)}")
        _check_k(codebook, k)
        key = (codebook_key(codebook), normalize)
        table = self._tables.get(key)
        if table is None or table.shape[1] < k:
            table = codebook_neighbors(codebook, min(_latent_entries(codebook) - 1, max(MAX_STORED_NEIGHBORS, k)), normalize)
            self._tables[key] = table
        return table

    def of(self, codebook: Tensor) -> dict[str, Tensor]:
        """The tables kept for ``codebook``, by metric name (``"raw"``, ``"normalized"``), e.g. to save them."""
        key = codebook_key(codebook)
        return {METRICS[normalize]: table for (owner, normalize), table in self._tables.items() if owner == key}

    def add(self, codebook: Tensor, tables: dict[str, Tensor], fingerprint: Optional[str] = None) -> None:
        """Keep saved ``tables`` (by metric name) for ``codebook``; ``fingerprint``: the :func:`codebook_key` they
        were saved with, if known. Tables of another codebook (fingerprint or row count) are ignored."""
        key = codebook_key(codebook)
        if fingerprint is not None and fingerprint != key:
            return
        for normalize, name in METRICS.items():
            table = tables.get(name)
            if table is not None and table.dim() == 2 and table.shape[0] == codebook.shape[0]:
                self._tables.setdefault((key, normalize), table.long())

    def share(self, other: "NeighborTables") -> None:
        """Use ``other``'s tables too (``from_pipe`` with the same tokenizer)."""
        self._tables = {**other._tables, **self._tables}
