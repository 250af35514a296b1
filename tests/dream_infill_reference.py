"""Dream's ``_sample`` with mask tokens inside the prompt (infilling), written plainly (spec ``dllm.md`` §2; Dream's
``generation_utils.py``): the yardstick of vispec's infilling (:mod:`vispec.dllm.infill`) for the Dream scheduler.

The facts of the official code this follows: ``x`` is the prompt padded on the right with mask tokens to
``max_length``; every step takes ``mask_index = (x == mask_token_id)`` over the **whole** sequence, so a mask token in
the prompt is decoded with the generated ones: it gets a candidate and a confidence from the shifted logits, and it
counts in the step's masked count (``n = int(M (1 - s / t))``, all on the last step). Temperature 0, the
deterministic algorithms, ties to the lowest position (Dream's ``torch.topk`` leaves their order unspecified); the
mask count is averaged over the batch, as Dream does, so compare at batch size 1. Returns the whole sequence.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from dream_reference import _confidence, shifted


@torch.no_grad()
def dream_infill_sample(forward, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor], *,
                        max_new_tokens: int, steps: int, mask_id: int, alg: str, eps: float = 1e-3,
                        top_p: Optional[float] = None, top_k: Optional[int] = None,
                        never_propose: Sequence[int] = ()) -> torch.Tensor:
    """``[B, P + max_new_tokens]``: the prompts with their mask tokens decided, then the generation.

    ``forward(x, mask4d_or_None, tok_idx_or_None)`` returns unshifted logits; ``never_propose``: token ids whose
    logits are ``-inf`` before processing (vispec never proposes the mask token).
    """
    if alg not in ("maskgit_plus", "topk_margin", "entropy"):
        raise ValueError(f"the reference runs only the deterministic algorithms, got alg={alg!r}")
    batch = input_ids.shape[0]
    x = F.pad(input_ids, (0, max_new_tokens), value=mask_id)
    mask4, tok_idx = None, None
    if attention_mask is not None and bool((attention_mask == 0).any()):
        valid = F.pad(attention_mask, (0, max_new_tokens), value=1)
        tok_idx = (valid.long().cumsum(-1) - 1).masked_fill(valid == 0, 1)
        keep = valid.bool()
        mask4 = keep[:, None, None, :] & keep[:, None, :, None]
    timesteps = torch.linspace(1, eps, steps + 1)
    for i in range(steps):
        mask_index = x == mask_id  # every masked position of the sequence: the prompt's too
        logits = shifted(forward(x, mask4, tok_idx))
        mask_logits = logits[mask_index]
        if never_propose:
            mask_logits[:, list(never_propose)] = float("-inf")
        t, s = timesteps[i], timesteps[i + 1]
        confidence, x0 = _confidence(mask_logits, alg, top_p, top_k)
        num_mask = mask_index.sum() / mask_index.shape[0]
        count = int(num_mask * (1 - s / t)) if i < steps - 1 else int(num_mask)
        full = torch.full(x.shape, float("-inf"), dtype=logits.dtype)
        full[mask_index] = confidence
        if count > 0:
            chosen = torch.sort(full, dim=-1, descending=True, stable=True).indices[:, :count]
            proposal = torch.full_like(x, mask_id)
            proposal[mask_index] = x0
            for b in range(batch):
                x[b, chosen[b]] = proposal[b, chosen[b]]
    return x
