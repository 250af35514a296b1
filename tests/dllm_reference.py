"""A plain, obviously-correct LLaDA sampler written from the spec's pseudo-code (dllm.md §1.3).

One prompt at a time, Python loops everywhere, no caches: the yardstick the batched implementation
in ``vispec.dllm`` must match token for token at temperature 0. It keeps LLaDA's own guidance
argument, ``cfg_scale = w`` (``ℓ_u + (w + 1)(ℓ_c - ℓ_u)``, 0 = off), which is vispec's
``guidance_scale = w + 1``.

Tie rule: each step commits the ``n_i`` highest confidences, exact ties to the lowest position
(:func:`most_confident`). LLaDA's ``generate()`` calls ``torch.topk`` there, whose order among equal values
PyTorch leaves unspecified (on CPU with torch 2.13, ``topk`` over eight values with four tied at 1.0 returned
indices [21, 23], not [20, 21]); such ties are common in float32 / bfloat16, where near-certain positions round to
exactly 1.0. vispec follows the rule written here, on every device and torch version.
"""

from __future__ import annotations

from typing import Optional

import torch


def most_confident(confidence: list[float], n: int) -> list[int]:
    """The positions of the ``n`` highest ``confidence`` values, exact ties to the lowest position."""
    by_rank = sorted(range(len(confidence)), key=lambda j: (-confidence[j], j))
    return by_rank[:n]


@torch.no_grad()
def llada_reference(model, prompt: torch.Tensor, *, steps: int, gen_length: int, block_length: int, mask_id: int,
                    cfg_scale: float = 0.0, remasking: str = "low_confidence", eos_id=None, eot_id=None,
                    logits_eos_inf: bool = False, confidence_eos_eot_inf: bool = False,
                    trace: Optional[list] = None) -> torch.Tensor:
    """Generated tokens ``[gen_length]`` for one unpadded ``prompt [P]`` at temperature 0.

    ``trace``, when a list, receives one dict per committing step: ``canvas`` (the generated part after the step,
    ``mask_id`` where undecided), ``committed`` (generated positions, in the order chosen) and ``confidence``
    (``{generated position: confidence}`` of the block's masked positions before the step)."""
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
            # LLaDA: torch.topk(confidence[0], quota[i]), whose order among equal confidences is unspecified;
            # here (and in vispec) exact ties go to the lowest position
            chosen = most_confident(confidence[0].tolist(), quota[i])
            for j in chosen:
                x[0, j] = candidates[0, j]
            if trace is not None:
                gen = x[0, len(prompt):]
                trace.append({"canvas": gen.clone(), "committed": [j - len(prompt) for j in chosen],
                              "confidence": {j - len(prompt): float(confidence[0, j]) for j in range(lo, hi)
                                             if confidence[0, j] != float("-inf")}})
    return x[0, len(prompt):]


def quota_step_law(canvas: tuple, masked: list[int], draw: list[torch.Tensor], confidence: list[torch.Tensor],
                   quota: int):
    """The exact law of one LLaDA step with temperature sampling, for the enumeration certificates: every joint draw
    of the masked positions (``draw[a]``: position ``masked[a]``'s sampling distribution), of which the ``quota``
    most confident (``confidence[a][token]``; ties to the lower position) are committed. Yields ``(new canvas,
    probability)``; the same new canvas may come more than once."""
    import itertools

    for combo in itertools.product(range(len(draw[0])), repeat=len(masked)):
        prob = 1.0
        for a, token in enumerate(combo):
            prob *= float(draw[a][token])
        ranked = sorted(range(len(masked)), key=lambda a: (-float(confidence[a][combo[a]]), masked[a]))
        new = list(canvas)
        for a in ranked[:quota]:
            new[masked[a]] = combo[a]
        yield tuple(new), prob
