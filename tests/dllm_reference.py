"""A plain, obviously-correct LLaDA sampler written from the spec's pseudo-code (dllm.md §1.3).

One prompt at a time, Python loops everywhere, no caches: the yardstick the batched implementation
in ``vispec.dllm`` must match token for token at temperature 0. It keeps LLaDA's own guidance
argument, ``cfg_scale = w`` (``ℓ_u + (w + 1)(ℓ_c - ℓ_u)``, 0 = off), which is vispec's
``guidance_scale = w + 1``.
"""

from __future__ import annotations

import torch


@torch.no_grad()
def llada_reference(model, prompt: torch.Tensor, *, steps: int, gen_length: int, block_length: int, mask_id: int,
                    cfg_scale: float = 0.0, remasking: str = "low_confidence", eos_id=None, eot_id=None,
                    logits_eos_inf: bool = False, confidence_eos_eot_inf: bool = False) -> torch.Tensor:
    """Generated tokens ``[gen_length]`` for one unpadded ``prompt [P]`` at temperature 0."""
    x = torch.cat([prompt, torch.full((gen_length,), mask_id, dtype=torch.long)])[None]
    prompt_index = torch.zeros_like(x, dtype=torch.bool)
    prompt_index[0, : len(prompt)] = True
    num_blocks = gen_length // block_length
    per_block = steps // num_blocks
    for k in range(num_blocks):
        lo, hi = len(prompt) + k * block_length, len(prompt) + (k + 1) * block_length
        masked_count = int((x[0, lo:hi] == mask_id).sum())
        quota = [masked_count // per_block + (1 if i < masked_count % per_block else 0) for i in range(per_block)]
        for i in range(per_block):
            if cfg_scale > 0:
                uncond = x.clone()
                uncond[prompt_index] = mask_id
                both = model(torch.cat([x, uncond])).logits
                logits = both[1:] + (cfg_scale + 1) * (both[:1] - both[1:])
            else:
                logits = model(x).logits
            native = logits.dtype  # LLaDA ranks confidences in the logits' precision
            logits = logits.double()
            if logits_eos_inf:
                logits[:, :, eos_id] = float("-inf")
            proposal = logits.clone()
            proposal[:, :, mask_id] = float("-inf")  # vispec never proposes the mask token ...
            proposal[:, :, model.config.vocab_size:] = float("-inf")  # ... nor padded embedding columns
            candidates = proposal.argmax(dim=-1)
            conf_logits = logits.clone()
            if confidence_eos_eot_inf:
                conf_logits[:, :, eos_id] = float("-inf")
                conf_logits[:, :, eot_id] = float("-inf")
            probs = torch.softmax(conf_logits.to(native), dim=-1)
            confidence = probs.gather(-1, candidates[..., None]).squeeze(-1)
            for j in range(x.shape[1]):
                if j < lo or j >= hi or x[0, j] != mask_id:
                    confidence[0, j] = float("-inf")
            if quota[i] == 0:
                continue
            chosen = torch.topk(confidence[0], quota[i]).indices
            for j in chosen.tolist():
                x[0, j] = candidates[0, j]
    return x[0, len(prompt):]
