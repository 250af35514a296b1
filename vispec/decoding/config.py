"""Decoding configuration: which decoder, window, draft initialisation and coupling.

A diffusers ``ConfigMixin`` (saved like a scheduler), so pipelines can register it as a component.
"""

from __future__ import annotations

from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.schedulers.scheduling_utils import SchedulerMixin

STRATEGIES = ("ar", "sjd", "mc-sjd")
INITS = ("random", "horizontal", "vertical")
COUPLINGS = {"ar": ("none",), "sjd": ("none",), "mc-sjd": ("maximal", "gumbel")}


class DecodingConfig(SchedulerMixin, ConfigMixin):
    """How image tokens are decoded.

    Args:
        strategy: ``"ar"`` (one token per forward), ``"sjd"`` (Speculative Jacobi Decoding,
            arXiv 2410.01699) or ``"mc-sjd"`` (coupled SJD, arXiv 2510.24211).
        window: Jacobi window ``L`` (pending token plus ``L - 1`` drafts); ``>= 1``.
        init: draft initialisation for new window slots: ``"random"`` (uniform token),
            ``"horizontal"`` (copy the previous token in raster order, i.e. the left neighbour),
            ``"vertical"`` (copy the token one row above; horizontal on the first row).
        coupling: ``"none"`` for SJD; ``"maximal"`` (verify every slot, keep each slot's coupled output
            as its next draft) or ``"gumbel"`` (drafts by Gumbel-max with noise fixed per absolute
            position) for MC-SJD. ``None`` picks the strategy's default.
    """

    config_name = "decoding_config.json"

    @register_to_config
    def __init__(self, strategy: str = "sjd", window: int = 16, init: str = "horizontal", coupling: str | None = None):
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"window must be an integer >= 1, got {window!r}")
        if init not in INITS:
            raise ValueError(f"init must be one of {INITS}, got {init!r}")
        coupling = COUPLINGS[strategy][0] if coupling is None else coupling
        if coupling not in COUPLINGS[strategy]:
            raise ValueError(f"coupling for strategy {strategy!r} must be one of {COUPLINGS[strategy]}, got {coupling!r}")
        self.register_to_config(coupling=coupling)

    @property
    def name(self) -> str:
        """Short label, e.g. ``ar``, ``sjd-horizontal``, ``mc-sjd-maximal``."""
        c = self.config
        if c.strategy == "ar":
            return "ar"
        if c.strategy == "sjd":
            return f"sjd-{c.init}"
        return f"mc-sjd-{c.coupling}"

    @classmethod
    def parse(cls, value: "DecodingConfig | str", **overrides) -> "DecodingConfig":
        """Accept a config, a strategy name (``"sjd"``) or a label (``"sjd-vertical"``, ``"mc-sjd-gumbel"``)."""
        if isinstance(value, DecodingConfig):
            return cls.from_config({**value.config, **overrides}) if overrides else value
        if not isinstance(value, str):
            raise ValueError(f"decoding must be a DecodingConfig or a string, got {type(value).__name__}")
        for strategy in ("mc-sjd", "sjd", "ar"):
            if value == strategy:
                return cls(strategy=strategy, **overrides)
            if value.startswith(strategy + "-"):
                suffix = value[len(strategy) + 1 :]
                key = "coupling" if strategy == "mc-sjd" else "init"
                return cls(strategy=strategy, **{key: suffix, **overrides})
        raise ValueError(f"unknown decoding {value!r}; expected ar, sjd[-random|-horizontal|-vertical] or mc-sjd[-maximal|-gumbel]")
