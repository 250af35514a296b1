"""LLaDA's ``generate()`` with mask tokens inside the prompt, written plainly from its pseudo-code (spec ``dllm.md``
§1.3; ML-GSAI/LLaDA ``generate.py``): the yardstick of vispec's infilling (:mod:`vispec.dllm.infill`) for the LLaDA
quota policy at temperature 0.

The facts of the official code this follows: ``x = [prompt ; mask^L]``; ``prompt_index = (x != mask)`` once, at the
start (so the prompt's mask tokens are not in it, and guidance's unconditional branch keeps them); at every step
``mask_index = (x == mask)`` over the **whole** sequence, the confidence is ``-inf`` at ``j >= end of block k`` and
where not masked, and the quota ``n_{k,i}`` comes from the masked count of block ``k`` alone. So the prompt's masks
are candidates from the first block on and compete with the block's positions for its quota.

``count_prompt_masks=False`` is that code verbatim: it ends with as many positions still masked as the prompt had
masks. ``True`` is vispec's one documented change: the first block's count includes the prompt's masks, so
everything is decoded. Without prompt masks the two are the same (and :func:`dllm_reference.llada_reference`'s).
One prompt at a time, no padding, Python loops: the yardstick, not the implementation.
"""

from __future__ import annotations

import torch


@torch.no_grad()
def llada_infill_reference(model, prompt: torch.Tensor, *, steps: int, gen_length: int, block_length: int,
                           mask_id: int, cfg_scale: float = 0.0, count_prompt_masks: bool = True) -> torch.Tensor:
    """The whole sequence ``[P + gen_length]`` (prompt with its masks decided, then the generation) for one
    unpadded ``prompt [P]`` at temperature 0, ``remasking="low_confidence"``; ``cfg_scale = w`` is LLaDA's
    (vispec's ``guidance_scale = w + 1``)."""
    P = len(prompt)
    x = torch.cat([prompt, torch.full((gen_length,), mask_id, dtype=torch.long)])[None]
    prompt_index = x != mask_id  # LLaDA: computed once, before decoding
    num_blocks = gen_length // block_length
    per_block = steps // num_blocks
    for k in range(num_blocks):
        lo, hi = P + k * block_length, P + (k + 1) * block_length
        masked_count = int((x[0, lo:hi] == mask_id).sum())
        if count_prompt_masks and k == 0:
            masked_count += int((x[0, :P] == mask_id).sum())
        quota = [masked_count // per_block + (1 if i < masked_count % per_block else 0) for i in range(per_block)]
        for i in range(per_block):
            mask_index = x == mask_id  # the whole sequence, prompt included
            if cfg_scale > 0:
                uncond = x.clone()
                uncond[prompt_index] = mask_id
                both = model(torch.cat([x, uncond])).logits
                logits = both[1:] + (cfg_scale + 1) * (both[:1] - both[1:])
            else:
                logits = model(x).logits
            proposal = logits.double().clone()
            proposal[:, :, mask_id] = float("-inf")  # vispec never proposes the mask token ...
            proposal[:, :, model.config.vocab_size:] = float("-inf")  # ... nor padded embedding columns
            candidates = proposal.argmax(dim=-1)
            confidence = torch.softmax(logits, dim=-1).gather(-1, candidates[..., None]).squeeze(-1)
            for j in range(x.shape[1]):
                if j >= hi or not mask_index[0, j]:
                    confidence[0, j] = float("-inf")
            if quota[i] == 0:
                continue
            chosen = torch.topk(confidence[0], quota[i]).indices
            for j in chosen.tolist():
                x[0, j] = candidates[0, j]
    return x[0]
