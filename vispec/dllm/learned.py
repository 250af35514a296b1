"""Learn2PD: a learned filter decides which masked positions of a block to commit.

Learn2PD ("Learning to Parallel", Bao et al. 2025, arXiv 2509.25188) keeps the masked diffusion LM frozen
and trains a tiny per-block filter ``f_θ : R^{Lb} → R^{Lb}``. At every step of a block:

* the features are ``c_j = max_v softmax(ℓ_j)_v`` for **every** position ``j`` of the block, in block order
  (positions decoded earlier included: there ``c_j`` is the model's current arg-max probability at that
  position), computed in float32 over the proposal vocabulary (:func:`block_features`);
* the filter accepts the masked positions with ``σ(f_θ(c))_j > τ`` (``τ = 0.96``, the paper's scripts);
* the committed set is the accepted positions plus a floor of the single most confident masked position
  (the vanilla one-token-per-step LLaDA quota their scripts keep, ``steps = gen_length``), so every step
  makes progress and a filter that accepts nothing degrades to the LLaDA baseline.

The filter is trained on the base model's own decodes (:mod:`vispec.eval.train.filter`): rows
``(c, 1[x̂_j = y*_j])`` recorded along an "extremely greedy parallel" pass toward the reference answer
``y*``, with a binary cross-entropy loss. It is a diffusers ``ModelMixin`` saved as the pipeline's
``filter`` component beside the model it was trained for.

:class:`LearnedFilterScheduler` is the policy (strategy ``"learn2pd"``: ``select`` is the floor, ``accept`` the
filter); it reports the accepted positions
in :attr:`vispec.dllm.UnmaskSchedulerOutput.accepted`, which end-of-text prediction reads (an accepted EOS
truncates the canvas after it).
"""

from __future__ import annotations

from typing import Optional

import torch
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.models.modeling_utils import ModelMixin
from torch import Tensor, nn

from vispec.checks import check_int, check_number
from vispec.dllm.schedulers import SCHEDULERS, UnmaskingScheduler, most_confident


class ParallelDecodeFilter(ModelMixin, ConfigMixin):
    """The Learn2PD filter: a 2-layer MLP ``Lb → hidden → Lb`` (ReLU), one logit per block position.

    With ``block_length = hidden_size = 32`` it has 2,112 parameters, the size the paper describes
    (about 2K). Input ``[..., Lb]`` float confidences (:func:`block_features`), output ``[..., Lb]`` logits;
    ``σ(logit) > τ`` accepts a position.
    """

    @register_to_config
    def __init__(self, block_length: int = 32, hidden_size: int = 32):
        super().__init__()
        check_int("block_length", block_length, minimum=1)
        check_int("hidden_size", hidden_size, minimum=1)
        self.net = nn.Sequential(nn.Linear(block_length, hidden_size), nn.ReLU(), nn.Linear(hidden_size, block_length))

    def forward(self, features: Tensor) -> Tensor:
        if features.shape[-1] != self.config.block_length:
            raise ValueError(f"features must have {self.config.block_length} entries per block (the filter's "
                             f"block_length), got shape {tuple(features.shape)}")
        return self.net(features.to(self.net[0].weight.dtype))


def block_features(logits: Tensor, proposal_mask: Optional[Tensor] = None) -> Tensor:
    """``[B, Lb]`` float32 ``max_v softmax(ℓ)_v`` of block logits ``[B, Lb, V]``: the arg-max probability of every
    block position, the filter's input. The softmax runs over the whole vocabulary (as the confidence does);
    tokens in ``proposal_mask [V]`` (the mask token, padded columns, EOS with ``logits_eos_inf``) are never
    arg-max candidates, so they are left out of the max."""
    probs = torch.softmax(logits.float(), dim=-1)
    if proposal_mask is not None:
        probs = probs.masked_fill(proposal_mask, 0.0)
    return probs.amax(dim=-1)


class LearnedFilterScheduler(UnmaskingScheduler):
    """Learn2PD's policy: commit the masked positions the filter accepts, and at least the most confident one.

    Args:
        threshold: ``τ`` in (0, 1]: accept where ``σ(f_θ(c)) > τ`` (0.96 in Learn2PD's scripts).
        filter: the trained :class:`ParallelDecodeFilter` (not part of the saved scheduler config; the pipeline
            passes its ``filter`` component when the scheduler has none). Its ``block_length`` must equal the
            decode's block length.
    """

    strategy = "learn2pd"
    ignore_for_config = ["filter"]

    @register_to_config
    def __init__(self, threshold: float = 0.96, filter: Optional[ParallelDecodeFilter] = None):
        super().__init__()
        check_number("threshold", threshold, minimum=0, maximum=1, exclusive_minimum=True)
        if filter is not None and not isinstance(filter, ParallelDecodeFilter):
            raise ValueError(f"filter must be a ParallelDecodeFilter, got {type(filter).__name__}")
        self.filter = filter

    def set_timesteps(self, num_inference_steps, gen_length, block_length, device=None) -> None:
        """As the base class, and check the filter exists and was trained for ``block_length``."""
        if self.filter is None:
            raise ValueError("LearnedFilterScheduler needs a trained filter: pass filter= (a ParallelDecodeFilter, "
                             "e.g. from `vispec train filter`), or load a pipeline whose folder has one")
        if self.filter.config.block_length != block_length:
            raise ValueError(f"block_length ({block_length}) must equal the filter's block_length "
                             f"({self.filter.config.block_length}): the filter reads one confidence per block position")
        super().set_timesteps(num_inference_steps, gen_length, block_length, device)

    def check_step(self, *args) -> None:
        """As the base class, and the filter must exist."""
        if self.filter is None:
            raise ValueError("LearnedFilterScheduler needs a trained filter (filter=)")
        super().check_step(*args)

    def select(self, confidence, entropy, masked, timestep, num_masked_at_block_start, noise):
        """The floor: the most confident masked position (the filter's accepted positions are committed with it)."""
        return most_confident(confidence)

    def accept(self, model_output: Tensor, masked: Tensor, proposal_mask: Optional[Tensor]) -> Tensor:
        """The masked positions with ``σ(f_θ(c)) > τ`` (module docstring), committed from the same candidates."""
        with torch.no_grad():
            logits = self.filter.to(model_output.device)(block_features(model_output, proposal_mask))
        return masked & (torch.sigmoid(logits.float()) > self.config.threshold)


SCHEDULERS["learn2pd"] = LearnedFilterScheduler
