"""The options of one masked-diffusion decode (:func:`vispec.dllm.decode`), checked once when built.

:class:`UnmaskingOptions` holds everything about a decode that is not the model, the prompts, the policy
(the scheduler), the seeds or the step callback. Its checks need nothing but the values, so they run once, in
``__post_init__``; the checks that need the model (its config's ids, context length, cache support) run once at
the start of :func:`vispec.dllm.decode`. The pipeline maps its user and LLaDA2 argument names into one of these.

Guidance is vispec's one convention (:mod:`vispec.outputs`, as the image half): ``guidance_scale = s`` mixes
``ℓ = ℓ_u + s (ℓ_c - ℓ_u)`` and ``s = 1`` means no guidance; LLaDA's ``cfg_scale = w`` is ``guidance_scale = w + 1``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional, Union

from vispec.checks import check_int, check_number
from vispec.dllm.blocks import AdaptiveBlocks
from vispec.dllm.prophet import ProphetRule

CACHES = ("none", "prefix", "dual", "dkv")
GUIDANCE_HINT = " (1 disables guidance; LLaDA's cfg_scale w is guidance_scale w + 1)"
_FLAGS = ("logits_eos_inf", "confidence_eos_eot_inf", "early_stop_eos", "suppress_mask_token", "compile", "eotp")


def check_blocks(gen_length: int, block_length: int) -> int:
    """``K = gen_length / block_length`` semi-autoregressive blocks; ``ValueError`` naming the argument otherwise."""
    check_int("gen_length", gen_length, minimum=1)
    check_int("block_length", block_length, minimum=1)
    if gen_length % block_length:
        raise ValueError(f"gen_length ({gen_length}) must be a multiple of block_length ({block_length})")
    return gen_length // block_length


DEFAULT_DRAFT_LENGTH = 8  # SelfSpeculation's k, and a bare ``ssd`` rule's (CLI, bench, lm-eval): one default


@dataclass(frozen=True)
class SelfSpeculation:
    """Exact self-speculative decoding for :func:`vispec.dllm.decode` (``speculative=``; :mod:`vispec.dllm.speculative`).

    Args:
        draft_length: ``k``, the canvases one verifying forward takes per row: the exact next canvas and ``k - 1``
            drafted ones; a forward advances 1 to ``k`` reference steps. ``k = 1`` is the stepwise run. ``"auto"``:
            chosen per round, up to ``max_draft_length``, by expected reference steps per second
            (:mod:`vispec.dllm.draft_length`; the tokens are the same for any choice).
        max_draft_length: the largest ``k`` ``"auto"`` may choose.
    """

    draft_length: Union[int, str] = DEFAULT_DRAFT_LENGTH
    max_draft_length: int = 16

    def __post_init__(self) -> None:
        check_int("max_draft_length", self.max_draft_length, minimum=1, maximum=256,
                  hint=" (the largest draft length draft_length='auto' chooses)")
        if self.draft_length != "auto":
            check_int("draft_length", self.draft_length, minimum=1, maximum=256,
                      hint=" (canvases per verifying forward: the exact next one and draft_length - 1 drafts), or "
                           "'auto'")

    @property
    def auto(self) -> bool:
        return self.draft_length == "auto"


@dataclass(frozen=True)
class UnmaskingOptions:
    """How :func:`vispec.dllm.decode` decodes (its docstring explains every field; the defaults are its defaults).

    Args:
        gen_length, block_length: the generated canvas ``L`` and the semi-AR block ``Lb`` (``L`` a multiple of ``Lb``).
        steps: total steps over all blocks, for fixed-step policies (``None`` for adaptive ones).
        temperature: 0 for arg-max candidates, else float64 Gumbel-max sampling.
        guidance_scale: unsupervised CFG scale ``s >= 1`` (module docstring).
        cache: one of :data:`CACHES` (:mod:`vispec.dllm.caches`); ``cache_reload_steps``: dKV's refresh period.
        mask_token_id, eos_token_id, eot_token_id: override the model config's ids.
        logits_eos_inf, confidence_eos_eot_inf, early_stop_eos, suppress_mask_token: LLaDA's EOS options and the
            mask-token suppression.
        compile: static, compiled forwards (not with ``"dkv"``, ``eotp`` or ``adaptive_block``).
        eotp: end-of-text prediction (:mod:`vispec.dllm.eotp`); ``early_commit``: a
            :class:`~vispec.dllm.prophet.ProphetRule`; ``adaptive_block``: an :class:`~vispec.dllm.blocks.AdaptiveBlocks`.
        speculative: None, or exact self-speculative decoding (:class:`~vispec.dllm.speculative.SelfSpeculation`, or
            its draft length as an int): the stepwise run's tokens, several steps per forward.
    """

    gen_length: int = 128
    block_length: int = 128
    steps: Optional[int] = None
    temperature: float = 0.0
    guidance_scale: float = 1.0
    cache: str = "none"
    cache_reload_steps: int = 8
    mask_token_id: Optional[int] = None
    eos_token_id: Optional[int] = None
    eot_token_id: Optional[int] = None
    logits_eos_inf: bool = False
    confidence_eos_eot_inf: bool = False
    early_stop_eos: bool = False
    suppress_mask_token: bool = True
    compile: bool = False
    eotp: bool = False
    early_commit: Optional[ProphetRule] = None
    adaptive_block: Optional[AdaptiveBlocks] = None
    speculative: Optional[SelfSpeculation] = None

    def __post_init__(self) -> None:
        check_blocks(self.gen_length, self.block_length)
        if self.steps is not None:
            check_int("steps", self.steps, minimum=1, hint=" (the total over all blocks)")
        check_number("temperature", self.temperature, minimum=0, hint=" (0 means arg-max candidates)")
        check_number("guidance_scale", self.guidance_scale, minimum=1, hint=GUIDANCE_HINT)
        if self.cache not in CACHES:
            raise ValueError(f"cache must be one of {CACHES}, got {self.cache!r}")
        check_int("cache_reload_steps", self.cache_reload_steps, minimum=1,
                  hint=" (cache='dkv': a full forward refreshes every cached K/V every that many steps of a block)")
        for name in ("mask_token_id", "eos_token_id", "eot_token_id"):
            if getattr(self, name) is not None:
                check_int(name, getattr(self, name), minimum=0)
        for name in _FLAGS:
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.early_commit is not None:
            if not isinstance(self.early_commit, ProphetRule):
                raise ValueError(f"early_commit must be None or a ProphetRule, got {type(self.early_commit).__name__}")
            self.early_commit.check_length(self.gen_length)
        if self.adaptive_block is not None and not isinstance(self.adaptive_block, AdaptiveBlocks):
            raise ValueError(f"adaptive_block must be None or an AdaptiveBlocks, got {type(self.adaptive_block).__name__}")
        if self.compile and self.cache == "dkv":
            raise ValueError("compile=True does not support cache='dkv': its set of recomputed positions changes size "
                             "every step (no static shapes); pass compile=False")
        if self.speculative is not None:
            self._check_speculative()
        if self.compile and (self.eotp or self.adaptive_block is not None):
            raise ValueError("compile=True needs static shapes; eotp (the canvas shrinks) and adaptive_block (blocks "
                             "change length) need compile=False")

    def _check_speculative(self) -> None:
        """Self-speculation reproduces the stepwise run only where every step sees its own canvas's logits
        (:mod:`vispec.dllm.speculative`): the rules that change that are refused, naming them."""
        if isinstance(self.speculative, int) and not isinstance(self.speculative, bool):
            check_int("speculative", self.speculative, minimum=1, maximum=256,
                      hint=" (the draft length: canvases per verifying forward), or 'auto', or a SelfSpeculation")
            object.__setattr__(self, "speculative", SelfSpeculation(self.speculative))
        elif self.speculative == "auto":
            object.__setattr__(self, "speculative", SelfSpeculation("auto"))
        if not isinstance(self.speculative, SelfSpeculation):
            raise ValueError(f"speculative must be None, a draft length (int), 'auto' or a SelfSpeculation, got "
                             f"{self.speculative!r}")
        approximate = [name for name, on in (("cache='dkv'", self.cache == "dkv"), ("eotp", self.eotp),
                                             ("early_commit", self.early_commit is not None),
                                             ("adaptive_block", self.adaptive_block is not None),
                                             ("compile", self.compile)) if on]
        if approximate:
            raise ValueError(f"speculative (exact self-speculative decoding) reproduces the stepwise run, which "
                             f"{', '.join(approximate)} would change (or, for compile, lanes change count forward to "
                             f"forward); pass cache 'none', 'prefix' or 'dual' and none of eotp, early_commit, "
                             f"adaptive_block, compile")

    @property
    def num_blocks(self) -> int:
        return self.gen_length // self.block_length

    @classmethod
    def from_keywords(cls, **options) -> "UnmaskingOptions":
        """Options from :func:`vispec.dllm.decode`'s keywords; an unknown keyword is a ``ValueError`` naming it."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(f"unknown decoding option(s) {unknown}; the options are {sorted(known)} "
                             f"(vispec.dllm.UnmaskingOptions)")
        return cls(**options)
