"""Decoding configuration: which decoder, window, draft initialisation and coupling.

A diffusers ``ConfigMixin`` (saved like a scheduler), so pipelines can register it as a component.
"""

from __future__ import annotations

from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.schedulers.scheduling_utils import SchedulerMixin

from vispec.sampling import SamplingConfig

STRATEGIES = ("ar", "sjd", "mc-sjd", "sd")
INITS = ("random", "horizontal", "vertical")
COUPLINGS = {"ar": ("none",), "sjd": ("none",), "mc-sjd": ("maximal", "gumbel"), "sd": ("none",)}
SD_DEFAULT_WINDOW = 5  # draft-model decoding: the pending token plus 4 drafted tokens per target forward


class DecodingConfig(SchedulerMixin, ConfigMixin):
    """How image tokens are decoded.

    Args:
        strategy: ``"ar"`` (one token per forward), ``"sjd"`` (Speculative Jacobi Decoding,
            arXiv 2410.01699), ``"mc-sjd"`` (coupled SJD, arXiv 2510.24211) or ``"sd"``
            (draft-model speculative decoding, Leviathan et al. 2023: a drafter GPT proposes
            ``window - 1`` tokens, the target verifies them in one forward).
        window: Jacobi window ``L`` (pending token plus ``L - 1`` drafts); ``>= 1``. For ``"sd"``
            the pending token plus the drafted tokens.
        init: draft initialisation for new window slots: ``"random"`` (uniform token),
            ``"horizontal"`` (copy the previous token in raster order, i.e. the left neighbour),
            ``"vertical"`` (copy the token one row above; horizontal on the first row).
        coupling: ``"none"`` for SJD; ``"maximal"`` (verify every slot, keep each slot's coupled output
            as its next draft) or ``"gumbel"`` (drafts by Gumbel-max with noise fixed per absolute
            position) for MC-SJD. ``None`` picks the strategy's default.
        guidance_scale, temperature, top_k, top_p, cfg_interval: the default target distribution
            (:class:`vispec.sampling.SamplingConfig`), so a saved pipeline carries the sampling settings
            its model was evaluated with; call arguments override them.
    """

    config_name = "decoding_config.json"

    @register_to_config
    def __init__(
        self,
        strategy: str = "sjd",
        window: int = 16,
        init: str = "horizontal",
        coupling: str | None = None,
        guidance_scale: float = 1.0,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        cfg_interval: int = -1,
    ):
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
        self.sampling()  # validates the sampling defaults

    def sampling(self, **overrides) -> SamplingConfig:
        """The default :class:`SamplingConfig`, with ``None``-valued overrides ignored."""
        c = self.config
        values = dict(guidance_scale=c.guidance_scale, temperature=c.temperature, top_k=c.top_k, top_p=c.top_p, cfg_interval=c.cfg_interval)
        values.update({k: v for k, v in overrides.items() if v is not None})
        return SamplingConfig(**values)

    @property
    def name(self) -> str:
        """Short label, e.g. ``ar``, ``sjd-horizontal``, ``mc-sjd-maximal``."""
        c = self.config
        if c.strategy == "ar":
            return "ar"
        if c.strategy == "sjd":
            return f"sjd-{c.init}"
        if c.strategy == "sd":
            return f"sd-{c.window - 1}"
        return f"mc-sjd-{c.coupling}"

    @classmethod
    def parse(cls, value: "DecodingConfig | str", base: "DecodingConfig | None" = None, **overrides) -> "DecodingConfig":
        """A config from a config, a strategy name (``"sjd"``) or a label (``"sjd-vertical"``, ``"mc-sjd-gumbel"``).

        A name keeps ``base``'s other settings (window, initialisation, sampling defaults) but takes its
        strategy and the strategy's default coupling unless the label names one. A label may end in
        ``:key=value`` options for the integer and string settings, e.g. ``"sjd:window=4"`` or
        ``"mc-sjd-gumbel:window=8,init=vertical"`` (benchmarks compare windows this way).
        """
        if isinstance(value, DecodingConfig):
            return cls.from_config({**value.config, **overrides}) if overrides else value
        if not isinstance(value, str):
            raise ValueError(f"decoding must be a DecodingConfig or a string, got {type(value).__name__}")
        label, _, options = value.partition(":")
        settings = {k: v for k, v in dict(base.config).items() if not k.startswith("_")} if base is not None else {}
        for strategy in ("mc-sjd", "sjd", "sd", "ar"):
            if label == strategy or label.startswith(strategy + "-"):
                if strategy == "sd" and settings.get("strategy") != "sd":
                    settings["window"] = SD_DEFAULT_WINDOW
                settings.update(strategy=strategy, coupling=None)
                suffix = label[len(strategy) + 1 :]
                if suffix:
                    settings["coupling" if strategy == "mc-sjd" else "init"] = suffix
                if strategy in ("ar", "sd") and suffix:
                    break
                settings.update(_parse_options(value, options))
                return cls(**{**settings, **overrides})
        raise ValueError(f"unknown decoding {value!r}; expected ar, sjd[-random|-horizontal|-vertical], mc-sjd[-maximal|-gumbel] "
                         "or sd, optionally followed by ':window=N'")


_LABEL_OPTIONS = {"window": int, "init": str, "coupling": str}


def _parse_options(value: str, options: str) -> dict:
    """``"window=4,init=vertical"`` -> ``{"window": 4, "init": "vertical"}`` (``value`` is the whole label, for errors)."""
    parsed: dict = {}
    if not options:
        return parsed
    for item in options.split(","):
        key, eq, text = item.partition("=")
        key = key.strip()
        if not eq or key not in _LABEL_OPTIONS:
            raise ValueError(f"decoding {value!r}: options must be key=value with key in {tuple(_LABEL_OPTIONS)}, got {item!r}")
        try:
            parsed[key] = _LABEL_OPTIONS[key](text.strip())
        except ValueError:
            raise ValueError(f"decoding {value!r}: {key} must be an integer, got {text!r}") from None
    return parsed


def split_specs(text: str, flag: str = "--methods") -> tuple[str, ...]:
    """A comma-separated list of decoding specs (``"ar,sjd:window=4,mc-sjd+lantern:k=10,delta=0.1"``) as a tuple.

    A ``key=value`` item continues the previous spec's options, so option lists keep their commas.
    An empty list is an error naming ``flag``."""
    specs: list[str] = []
    for item in (m.strip() for m in text.split(",")):
        if not item:
            continue
        if specs and "=" in item and item.split("=", 1)[0].replace("_", "").isalpha():
            specs[-1] += "," + item
        else:
            specs.append(item)
    if not specs:
        raise ValueError(f"{flag} is empty")
    return tuple(specs)
