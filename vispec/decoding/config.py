"""The decoding spec: which decoder, its window, draft initialisation, coupling and acceptance rule.

One grammar for every surface (:func:`vispec.decoding.decode`, the pipelines, the CLI and the
benchmarks)::

    spec    := variant [":" option ("," option)*] ["+" rule [":" rule-option ("," rule-option)*]]
    variant := "ar" | "sjd" ["-random" | "-horizontal" | "-vertical"] | "mc-sjd" ["-maximal" | "-gumbel"]
             | "sd" | "gsd"                          ("gsd" is short for "sjd+gsd")
    option  := key "=" value, key in window, init, coupling, guidance_scale, temperature, top_k, top_p, cfg_interval
    rule    := "exact" | "lantern" | "gsd" | "lumina"  (options: vispec.decoding.acceptance.AcceptanceConfig)

e.g. ``"mc-sjd"``, ``"sjd-vertical:window=8"``, ``"mc-sjd+lantern:k=100,delta=0.1"``, ``"sd:window=3"``.
:attr:`DecodingConfig.name` writes a config back in this grammar with only its non-default settings,
so ``DecodingConfig.parse(config.name) == config``; :attr:`DecodingConfig.method` is the same
without the sampling settings (the label statistics and tables show).

A :class:`DecodingConfig` is a diffusers ``ConfigMixin`` (saved like a scheduler), so pipelines register
it as a component and its acceptance rule and sampling defaults are saved with the model.
"""

from __future__ import annotations

from typing import Optional, Union

from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.schedulers.scheduling_utils import SchedulerMixin

from vispec.checks import check_int
from vispec.decoding.acceptance import AcceptanceConfig, AcceptanceRule
from vispec.sampling import SamplingConfig

STRATEGIES = ("ar", "sjd", "mc-sjd", "sd")
INITS = ("random", "horizontal", "vertical")
COUPLINGS = {"ar": ("none",), "sjd": ("none",), "mc-sjd": ("maximal", "gumbel"), "sd": ("none",)}
DEFAULT_WINDOW = 16
SD_DEFAULT_WINDOW = 5  # draft-model decoding: the pending token plus 4 drafted tokens per target forward
AUTO_WINDOW = "auto"


def _window(text: str):
    return AUTO_WINDOW if text == AUTO_WINDOW else int(text)


OPTION_TYPES = {"window": _window, "init": str, "coupling": str, "guidance_scale": float, "temperature": float, "top_k": int,
                "top_p": float, "cfg_interval": int}
SAMPLING_KEYS = ("guidance_scale", "temperature", "top_k", "top_p", "cfg_interval")
SPEC_HELP = ("ar, sjd[-random|-horizontal|-vertical], mc-sjd[-maximal|-gumbel], sd or gsd, optionally followed by "
             "':key=value,...' (window, init, coupling, sampling settings) and '+rule' (exact, lantern[:k=..,delta=..], "
             "gsd[:half_width=..], lumina)")


class DecodingConfig(SchedulerMixin, ConfigMixin):
    """How image tokens are decoded (module docstring for the spec grammar).

    Args:
        strategy: ``"ar"`` (one token per forward), ``"sjd"`` (Speculative Jacobi Decoding,
            arXiv 2410.01699), ``"mc-sjd"`` (coupled SJD, arXiv 2510.24211) or ``"sd"``
            (draft-model speculative decoding, Leviathan et al. 2023: a drafter GPT proposes
            ``window - 1`` tokens, the target verifies them in one forward).
        window: Jacobi window ``L`` (pending token plus ``L - 1`` drafts); ``>= 1``, or ``"auto"`` for sjd and
            mc-sjd: each pass picks a window from 1, 2, 4, 8, 16 by measured step cost and running
            acceptance (:mod:`vispec.decoding.windows`; exact all the same, but the tokens a seed gives
            then depend on the machine's timings). For ``"sd"``
            the pending token plus the drafted tokens.
        init: draft initialisation for new window slots: ``"random"`` (uniform token),
            ``"horizontal"`` (copy the previous token in raster order, i.e. the left neighbour),
            ``"vertical"`` (copy the token one row above; horizontal on the first row).
        coupling: ``"none"`` for SJD; ``"maximal"`` (verify every slot, keep each slot's coupled output
            as its next draft) or ``"gumbel"`` (drafts by Gumbel-max with noise fixed per absolute
            position) for MC-SJD. ``None`` picks the strategy's default.
        acceptance: the acceptance rule, ``"exact"`` (default) or a lossy one (``"lantern"``, ``"gsd"``, with
            options, or ``"lumina"``, Lumina-mGPT 2.0's biased rule; :mod:`vispec.decoding.acceptance`). Stored in
            canonical form.
        guidance_scale, temperature, top_k, top_p, cfg_interval: the default target distribution
            (:class:`vispec.sampling.SamplingConfig`), so a saved pipeline carries the sampling settings
            its model was evaluated with; call arguments override them.
    """

    config_name = "decoding_config.json"

    @register_to_config
    def __init__(
        self,
        strategy: str = "sjd",
        window: Union[int, str] = DEFAULT_WINDOW,
        init: str = "horizontal",
        coupling: Optional[str] = None,
        acceptance: str = "exact",
        guidance_scale: float = 1.0,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        cfg_interval: int = -1,
    ):
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
        if window != AUTO_WINDOW:
            check_int("window", window, minimum=1, hint=" or 'auto' (chosen per pass by cost)")
        if window == AUTO_WINDOW and strategy not in ("sjd", "mc-sjd"):
            raise ValueError(f"window='auto' applies to sjd and mc-sjd, not {strategy!r}; give an integer window")
        if init not in INITS:
            raise ValueError(f"init must be one of {INITS}, got {init!r}")
        coupling = COUPLINGS[strategy][0] if coupling is None else coupling
        if coupling not in COUPLINGS[strategy]:
            raise ValueError(f"coupling for strategy {strategy!r} must be one of {COUPLINGS[strategy]}, got {coupling!r}")
        rule = AcceptanceConfig.parse(acceptance)
        if strategy == "ar" and not rule.lossless:
            raise ValueError(f"acceptance {rule.name!r} needs a speculative decoder (sjd, mc-sjd, sd), not 'ar'")
        self.register_to_config(coupling=coupling, acceptance=rule.name)
        self.sampling()  # validates the sampling defaults

    # ---- views ---------------------------------------------------------------------------------

    def settings(self) -> dict:
        """The registered settings (diffusers' bookkeeping keys left out)."""
        return {k: v for k, v in self.config.items() if not k.startswith("_")}

    def __eq__(self, other: object) -> bool:
        return isinstance(other, DecodingConfig) and self.settings() == other.settings()

    def __hash__(self) -> int:
        return hash(self.name)

    def __repr__(self) -> str:
        return f"DecodingConfig({self.name!r})"

    def sampling(self, **overrides) -> SamplingConfig:
        """The default :class:`SamplingConfig`, with ``None``-valued overrides ignored."""
        values = {k: self.config[k] for k in SAMPLING_KEYS}
        values.update({k: v for k, v in overrides.items() if v is not None})
        return SamplingConfig(**values)

    @property
    def largest_window(self) -> int:
        """The window, or with ``window="auto"`` the largest one the chooser may pick (:data:`DEFAULT_WINDOW`)."""
        window = self.config.window
        return DEFAULT_WINDOW if window == AUTO_WINDOW else window

    @property
    def rule(self) -> AcceptanceConfig:
        """The acceptance rule's settings."""
        return AcceptanceConfig.parse(self.config.acceptance)

    @property
    def name(self) -> str:
        """The spec in the module's grammar, with only the non-default settings: ``parse(name) == self``."""
        return self._label(SAMPLING_KEYS)

    @property
    def method(self) -> str:
        """:attr:`name` without the sampling settings, e.g. ``sjd-horizontal``, ``mc-sjd-maximal+lantern:k=100,delta=0.1``."""
        return self._label(())

    def _label(self, sampling_keys: tuple[str, ...]) -> str:
        c = self.config
        variant = {"ar": "ar", "sd": "sd", "sjd": f"sjd-{c.init}", "mc-sjd": f"mc-sjd-{c.coupling}"}[c.strategy]
        defaults = DecodingConfig.parse(variant).config
        keys = ("window",) + (("init",) if c.strategy != "sjd" else ()) + sampling_keys
        options = [f"{k}={c[k]!r}" if isinstance(c[k], float) else f"{k}={c[k]}" for k in keys if c[k] != defaults[k]]
        label = variant + (":" + ",".join(options) if options else "")
        return label if c.acceptance == "exact" else f"{label}+{c.acceptance}"

    # ---- parsing -------------------------------------------------------------------------------

    @classmethod
    def parse(cls, value: Union["DecodingConfig", str], base: Optional["DecodingConfig"] = None, **overrides) -> "DecodingConfig":
        """A config from a config or a spec string (module docstring).

        A spec keeps ``base``'s other settings (window, initialisation, sampling defaults) but takes its
        strategy, the strategy's default coupling unless the variant names one, its options and its
        rule (``exact`` when it has none). Keyword ``overrides`` win over both.
        """
        if isinstance(value, DecodingConfig):
            return cls(**{**value.settings(), **overrides}) if overrides else value  # not from_config: it would
            # restore the defaults diffusers lists in "_use_default_values" over the overrides
        if not isinstance(value, str):
            raise ValueError(f"decoding must be a DecodingConfig or a string, got {type(value).__name__}")
        decoder, _, rule = value.strip().partition("+")
        label, _, options = decoder.partition(":")
        if label.strip() == "gsd":  # short for sjd+gsd; the options are the rule's
            if rule:
                raise ValueError(f"decoding {value!r}: 'gsd' already names its rule (it is short for 'sjd+gsd')")
            label, rule, options = "sjd", "gsd" + (f":{options}" if options else ""), ""
        settings = base.settings() if base is not None else {}
        strategy, suffix = _variant(value, label.strip())
        if (strategy == "sd") != (settings.get("strategy") == "sd"):  # sd's window counts drafts differently
            settings["window"] = SD_DEFAULT_WINDOW if strategy == "sd" else DEFAULT_WINDOW
        settings.update(strategy=strategy, coupling=None, acceptance=rule.strip() or "exact")
        if suffix:
            settings["coupling" if strategy == "mc-sjd" else "init"] = suffix
        settings.update(_parse_options(value, options))
        try:
            return cls(**{**settings, **overrides})
        except ValueError as err:  # a value the config refuses: say which spec held it
            raise ValueError(f"decoding {value!r}: {err}") from None

    @classmethod
    def resolve(cls, decoding: Union["DecodingConfig", str, None], *, base: Optional["DecodingConfig"] = None,
                acceptance: Union[None, str, AcceptanceConfig, AcceptanceRule] = None) -> "DecodingConfig":
        """The config a call runs: ``decoding`` (default ``base``) with an ``acceptance`` given on its own.

        Naming a lossy rule both in ``decoding`` and as a different ``acceptance`` is an error."""
        if decoding is None and base is None:
            raise ValueError(f"decoding is required: {SPEC_HELP}")
        config = base if decoding is None else cls.parse(decoding, base=base)
        if acceptance is None:
            return config
        name = AcceptanceConfig.parse(acceptance.config if isinstance(acceptance, AcceptanceRule) else acceptance).name
        if decoding is not None and config.config.acceptance not in ("exact", name):
            raise ValueError(f"decoding {config.name!r} already names the acceptance rule {config.config.acceptance!r}; "
                             f"give it either in decoding or as acceptance={name!r}, not both")
        return cls.parse(config, acceptance=name)


def _variant(value: str, label: str) -> tuple[str, str]:
    """``(strategy, suffix)`` of a variant label: ``"mc-sjd-gumbel"`` -> ``("mc-sjd", "gumbel")``."""
    for strategy in ("mc-sjd", "sjd", "sd", "ar"):
        if label == strategy:
            return strategy, ""
        if label.startswith(strategy + "-") and strategy in ("mc-sjd", "sjd"):
            return strategy, label[len(strategy) + 1:]
    raise ValueError(f"unknown decoding {value!r}; expected {SPEC_HELP}")


def _parse_options(value: str, options: str) -> dict:
    """``"window=4,init=vertical"`` -> ``{"window": 4, "init": "vertical"}`` (``value`` is the whole spec, for errors)."""
    parsed: dict = {}
    for item in filter(None, (o.strip() for o in options.split(","))):
        key, eq, text = item.partition("=")
        key = key.strip()
        if not eq or key not in OPTION_TYPES:
            raise ValueError(f"decoding {value!r}: options must be key=value with key in {tuple(OPTION_TYPES)}, got {item!r}")
        kind = OPTION_TYPES[key]
        try:
            parsed[key] = kind(text.strip())
        except ValueError:
            raise ValueError(f"decoding {value!r}: {key} must be {'a number' if kind is float else 'an integer'}"
                             f"{' or auto' if key == 'window' else ''}, "
                             f"got {text.strip()!r}") from None
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
