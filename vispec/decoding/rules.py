"""Building an acceptance rule from its settings: the one place that knows every rule's class.

:mod:`vispec.decoding.acceptance` holds the settings (:class:`~vispec.decoding.acceptance.AcceptanceConfig`) and the
exact, LANTERN, GSD and Lumina rules; :mod:`vispec.decoding.budget` builds the budgeted rule on them. This module
imports both, and neither imports it, so the imports point one way.
"""

from __future__ import annotations

from typing import Callable, Optional, Union

from torch import Tensor

from vispec.decoding.acceptance import AcceptanceConfig, AcceptanceRule, GSDRule, LanternRule, LuminaRule
from vispec.decoding.budget import BudgetRule
from vispec.decoding.neighbors import NeighborTables, codebook_neighbors, max_neighbors

TensorSource = Union[None, Tensor, Callable[[], Tensor]]
"""A tensor, or a function returning it (called only by the rule that needs it)."""


def build_rule(config: Union[None, str, AcceptanceConfig, AcceptanceRule], *, codebook: TensorSource = None,
               embeddings: TensorSource = None, neighbors: Optional[Tensor] = None,
               tables: Optional[NeighborTables] = None) -> AcceptanceRule:
    """The rule for ``config`` (a built rule is returned as it is): where every decoder and pipeline builds one.

    The budgeted rule (:mod:`vispec.decoding.budget`) needs the codebook only with ``neighbors``. LANTERN needs the VQ ``codebook`` ``[V, D]`` or a precomputed ``neighbors`` table; with ``tables`` the
    codebook's table comes from that cache (:class:`vispec.decoding.neighbors.NeighborTables`, computed once
    per codebook). GSD needs the AR model's input token ``embeddings`` ``[V, D]``; Lumina-mGPT 2.0's rule
    needs nothing. ``codebook`` and ``embeddings`` may be functions, called only when the rule needs them
    (a pipeline's weights may have to be materialised first)."""
    if isinstance(config, AcceptanceRule):
        return config
    config = AcceptanceConfig.parse(config)
    if config.rule == "budget":
        k = config.budget_neighbors
        if k and neighbors is None:
            neighbors = _neighbor_table("'budget'", "neighbors", codebook, tables, k, False)
        return BudgetRule(config, neighbors)
    if config.rule == "lantern":
        if neighbors is None:
            neighbors = _neighbor_table("'lantern'", "k", codebook, tables, config.lantern_k, config.lantern_normalize)
        if config.lantern_k > neighbors.shape[1]:
            raise ValueError(f"lantern_k={config.lantern_k} exceeds the neighbour table's {neighbors.shape[1]} columns")
        return LanternRule(config, neighbors)
    if config.rule == "gsd":
        weights = embeddings() if callable(embeddings) else embeddings
        if weights is None:
            raise ValueError("acceptance 'gsd' needs the AR model's input token embeddings")
        return GSDRule(config, weights)
    if config.rule == "lumina":
        return LuminaRule(config)
    return AcceptanceRule(config)


def _neighbor_table(rule: str, key: str, codebook: TensorSource, tables: Optional[NeighborTables], k: int,
                    normalize: bool) -> Tensor:
    """``[V, k]`` nearest codebook entries for ``rule`` (its name, and ``key`` its option giving ``k``, for the
    errors): from ``tables`` when given."""
    book = codebook() if callable(codebook) else codebook
    if book is None:
        raise ValueError(f"acceptance {rule} needs the tokenizer's codebook (a VQ model with quantize.embedding), "
                         "or a precomputed neighbour table")
    most = max_neighbors(book)
    if k > most:
        raise ValueError(f"acceptance {rule}: {key}={k} exceeds the {most} neighbours a token of this codebook has "
                         f"({book.shape[0]} entries); use {key} <= {most}")
    return tables.table(book, k, normalize) if tables is not None else codebook_neighbors(book, k, normalize)


__all__ = ["TensorSource", "build_rule"]
