"""Special tokens of a masked-diffusion decode: ids from the model config and the token masks of the proposal and the
confidence."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor


def config_id(model: Any, name: str) -> Optional[int]:
    """``model.config.<name>`` as an int, or None when the model has no config or the config no such id."""
    value = getattr(getattr(model, "config", None), name, None)
    return None if value is None else int(value)


@dataclass(frozen=True)
class TokenIds:
    """The decode's mask, EOS and EoT ids (the options' overrides, else the model config's)."""

    mask: int
    eos: Optional[int]
    eot: Optional[int]


def proposal_mask(model: Any, vocab: int, mask_id: int, device: torch.device, suppress_mask_token: bool = True) -> Tensor:
    """``[V]`` bool: the tokens never proposed as candidates, the padded embedding columns past the model's
    ``vocab_size`` and (``suppress_mask_token``) the mask token itself."""
    proposal = torch.zeros(vocab, dtype=torch.bool, device=device)
    real_vocab = config_id(model, "vocab_size")
    if real_vocab is not None and real_vocab < vocab:
        proposal[real_vocab:] = True  # padded embedding columns belong to no token
    if suppress_mask_token and mask_id < vocab:
        proposal[mask_id] = True
    return proposal


def token_masks(model: Any, vocab: int, ids: TokenIds, device: torch.device, confidence_eos_eot_inf: bool,
                suppress_mask_token: bool) -> tuple[Optional[Tensor], Optional[Tensor]]:
    """``(proposal_mask, confidence_mask)``, ``[V]`` bool or None: the tokens never proposed
    (:func:`proposal_mask`), and (``confidence_eos_eot_inf``) EOS / EoT, whose proposals rank last."""
    proposal = proposal_mask(model, vocab, ids.mask, device, suppress_mask_token)
    confidence = None
    if confidence_eos_eot_inf:
        confidence = torch.zeros(vocab, dtype=torch.bool, device=device)
        confidence[[i for i in (ids.eos, ids.eot) if i is not None]] = True
    return (proposal if bool(proposal.any()) else None), confidence
