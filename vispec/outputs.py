"""What every vispec decoder returns and reports while it runs: one vocabulary for both halves.

* :class:`DecodeOutput`: the generated ``tokens [B, N]`` (image tokens in raster order, or the
  generated text canvas), per-sample :class:`DecodeStats` and the method's name;
  :meth:`DecodeOutput.as_dicts` is the one place per-sample statistics become plain dicts
  (pipelines, CLI and benchmarks use it).
* :class:`DecodeProgress`: what a step callback receives after every forward pass; one callback
  signature, ``callback(progress) -> None``, for :func:`vispec.decoding.decode` and
  :func:`vispec.dllm.decode`.

Guidance has one convention everywhere (diffusers, LlamaGen): ``guidance_scale = s`` mixes the
logits as ``l = l_u + s (l_c - l_u)``, and ``s = 1`` means no guidance. LLaDA's ``cfg_scale = w``
(``l = l_u + (w + 1)(l_c - l_u)``) is ``s = w + 1``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch import Tensor

UNDECIDED = -1
"""The token id :class:`DecodeProgress` shows where a sample has not committed a token yet."""


@dataclass
class DecodeStats:
    """Per-sample statistics (tensors of shape ``[B]``).

    * ``nfe``: forward passes spent on the sample (an image decoder's prefill included);
    * ``tokens``: tokens generated (text: before the first EOS, EOS and end-of-turn excluded);
    * ``latency_s``: wall time from the start of decoding until the sample finished;
    * ``accepted_drafts``: drafts accepted over all verification passes (speculative decoders);
    * ``tv_mean``, ``tv_max``: with a lossy acceptance rule, the mean and max total-variation distance
      of a verification's output distribution from the exact target (:mod:`vispec.decoding.acceptance`);
    * ``extra``: further per-sample counters (e.g. ``drafter_nfe`` for draft-model decoding);
    * ``windows``: for the batch, how many passes ran with each window (``{window: passes}``; an
      image decoder's padded window, which ``window="auto"`` chooses per pass);
    * ``shapes``: the shape-choosing decoders (``"auto"``, ``"sjd-pac:window=auto"``): passes per shape (``{"ar": ..,
      "chain 16": .., "tree 16 K3 D3": ..}``, :mod:`vispec.decoding.shapes`); ``chooser``: their chooser's
      ``predicted_speedup`` over AR's passes on the same cost curve and whether the decode ``calibrated`` it
      (a decode the chooser handed to AR: ``predicted_speedup`` 1.0, ``handed_to_ar`` True; one it gave a single chain
      for every pass: ``fixed_shape``, e.g. ``"chain 16"``, and that chain's predicted speed-up);
    * ``commits``: ``[B, W]`` image decoders: ``commits[b, k]`` is how many of sample ``b``'s verification
      passes committed ``k`` tokens (column 1: the single-token passes; the prefill is not a pass).
    """

    nfe: Tensor
    tokens: Tensor
    latency_s: Tensor
    accepted_drafts: Optional[Tensor] = None
    tv_mean: Optional[Tensor] = None
    tv_max: Optional[Tensor] = None
    extra: dict[str, Tensor] = field(default_factory=dict)
    windows: dict[int, int] = field(default_factory=dict)
    commits: Optional[Tensor] = None
    shapes: dict[str, int] = field(default_factory=dict)
    chooser: dict[str, Any] = field(default_factory=dict)

    @property
    def tokens_per_forward(self) -> Tensor:
        """Tokens per forward pass (= step compression against one-token-per-forward decoding)."""
        return self.tokens.double() / self.nfe.clamp_min(1).double()

    @property
    def accepted_per_forward(self) -> Optional[Tensor]:
        """Mean accepted draft tokens per verification pass (an image decoder's prefill excluded)."""
        if self.accepted_drafts is None:
            return None
        return self.accepted_drafts.double() / (self.nfe - 1).clamp_min(1).double()

    def per_sample(self) -> list[dict]:
        """One dict of Python numbers per sample (only the statistics this decoder has; ``commits`` as a list)."""
        columns: dict[str, tuple[Tensor, type]] = {
            "nfe": (self.nfe, int), "tokens": (self.tokens, int), "tokens_per_forward": (self.tokens_per_forward, float),
            "latency_s": (self.latency_s, float),
        }
        if self.accepted_drafts is not None:
            columns["accepted_per_forward"] = (self.accepted_per_forward, float)
        if self.tv_mean is not None:
            columns.update(tv_mean=(self.tv_mean, float), tv_max=(self.tv_max, float))
        for name, values in self.extra.items():
            columns[name] = (values, float if values.dtype.is_floating_point else int)
        lists = {name: (values.tolist(), kind) for name, (values, kind) in columns.items()}
        rows = [{name: kind(values[i]) for name, (values, kind) in lists.items()} for i in range(int(self.nfe.shape[0]))]
        if self.commits is not None:  # a list indexed by k (passes committing k tokens), trailing zeros trimmed
            for row, counts in zip(rows, self.commits.tolist()):
                while counts and counts[-1] == 0:
                    counts.pop()
                row["commits"] = counts
        return rows

    def summary(self) -> dict[str, float]:
        """Means over the batch (``tv_max``: the maximum)."""
        out = {"nfe": float(self.nfe.double().mean()), "tokens": float(self.tokens.double().mean()),
               "tokens_per_forward": float(self.tokens_per_forward.mean()), "latency_s": float(self.latency_s.double().mean())}
        if self.accepted_drafts is not None:
            out["accepted_per_forward"] = float(self.accepted_per_forward.mean())
        if self.tv_mean is not None:
            out.update(tv_mean=float(self.tv_mean.nanmean()), tv_max=float(self.tv_max.nan_to_num(0).max()))
        return out


@dataclass
class DecodeOutput:
    """Generated ``tokens [B, N]``, per-sample ``stats`` and ``method``, the decoder's name.

    ``labels`` are constant per-run facts shown with every sample's statistics (e.g. the dLLM cache).
    ``prompt_tokens [B, P]`` (masked diffusion LMs): the prompts as decoded, their mask tokens filled (infilling,
    :mod:`vispec.dllm.infill`); None for decoders that do not return them."""

    tokens: Tensor
    stats: DecodeStats
    method: str = ""
    labels: dict = field(default_factory=dict)
    prompt_tokens: Optional[Tensor] = None

    def as_dicts(self) -> list[dict]:
        """Per-sample statistics as plain dicts: ``{"method": ..., **labels, "nfe": ..., ...}``."""
        return [{"method": self.method, **self.labels, **row} for row in self.stats.per_sample()]


@dataclass
class DecodeProgress:
    """What a step callback sees after every forward pass (copies: changing them does not affect decoding).

    * ``step``: forward passes so far (an image decoder's prefill not counted);
    * ``num_committed``: ``[B]`` committed tokens per sample;
    * ``tokens``: ``[B, N]`` committed tokens, :data:`UNDECIDED` (-1) where nothing is committed yet;
    * ``details``: decoder-specific facts (the dLLM loop: ``block``, ``step_in_block``, ``rows``,
      ``transfer_index``).
    """

    step: int
    num_committed: Tensor
    tokens: Tensor
    details: dict = field(default_factory=dict)


StepCallback = Callable[[DecodeProgress], None]
"""``callback(progress)`` after every forward pass; see :class:`DecodeProgress`."""


def committed_view(tokens: Tensor, decided: Tensor) -> Tensor:
    """``tokens`` where ``decided``, :data:`UNDECIDED` elsewhere (a new tensor)."""
    return torch.where(decided, tokens, torch.full_like(tokens, UNDECIDED))
