"""The decoding spec: which decoder, its window, draft initialisation, coupling and acceptance rule.

One grammar for every surface (:func:`vispec.decoding.decode`, the pipelines, the CLI and the
benchmarks)::

    spec    := variant [":" option ("," option)*] ["+" rule [":" rule-option ("," rule-option)*]]
    variant := "ar" | "sjd" ["-random" | "-horizontal" | "-vertical" | "-source"] | "mc-sjd" ["-maximal" | "-gumbel"]
             | "sjd-pac" ["-maximal" | "-gumbel"] | "auto" ["-maximal" | "-gumbel"] | "sd" | "gad" | "gsd" | "iad"
             ("gsd" is short for "sjd+gsd", "iad" for "sjd-source": drafts copied from a source image)
    option  := key "=" value, key in window, init, coupling, tree_width, tree_depth, passes, groups, guidance_scale,
               temperature, top_k, top_p, cfg_interval
    rule    := "exact" | "budget" | "lantern" | "gsd" | "lumina"  (options: vispec.decoding.acceptance.AcceptanceConfig)

e.g. ``"mc-sjd"``, ``"sjd-vertical:window=8"``, ``"mc-sjd+budget:delta=0.1"``, ``"mc-sjd+lantern:k=100,delta=0.1"``, ``"sd:window=3"``,
``"sjd-pac:window=64,tree_width=3,tree_depth=3"`` (SJD-PAC's published setting), ``"auto"`` (each pass AR, an MC-SJD
chain or an SJD-PAC tree, whichever the machine's cost curve and the decode's acceptance favour), ``"gad:passes=4"`` (GAD's block
drafted in 4 drafter forwards, each group conditioned on the drafts left of it).
:attr:`DecodingConfig.name` writes a config back in this grammar with only its non-default settings,
so ``DecodingConfig.parse(config.name) == config``; :attr:`DecodingConfig.method` is the same
without the sampling settings (the label statistics and tables show).

A :class:`DecodingConfig` is a frozen dataclass, checked once when built. Pipelines register it as a
component, so its acceptance rule and sampling defaults are saved with the model
(``decoding_config/decoding_config.json``); :class:`PipelineComponent` is the thin adapter that lets
diffusers' ``save_pretrained`` / ``from_pretrained`` write and read that file.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, fields, replace
from typing import Any, Optional, Union

import diffusers
from diffusers import SchedulerMixin  # diffusers' loader looks this base up in this module (PipelineComponent)

from vispec.checks import check_int
from vispec.decoding.acceptance import AcceptanceConfig, AcceptanceRule
from vispec.sampling import SamplingConfig

STRATEGIES = ("ar", "sjd", "mc-sjd", "sjd-pac", "auto", "sd", "gad")
INITS = ("random", "horizontal", "vertical", "source")
COUPLINGS = {"ar": ("none",), "sjd": ("none",), "mc-sjd": ("maximal", "gumbel"), "sjd-pac": ("maximal", "gumbel"),
             "auto": ("maximal", "gumbel"), "sd": ("none",),
             "gad": ("none",)}
DEFAULT_WINDOW = 16
SD_DEFAULT_WINDOW = 5  # draft-model decoding: the pending token plus 4 drafted tokens per target forward
GAD_DEFAULT_WINDOW = 9  # gad: the pending token plus a block of 8 drafts
GAD_DEFAULT_PASSES = 1  # gad: drafter forwards per block (groups drafted left to right, each seeing the earlier ones)
GAD_GROUPS = ("even", "doubling")  # gad: how the block splits into its passes' groups (vispec.decoding.gad.draft_groups)
PAC_DEFAULT_WINDOW = 64  # SJD-PAC: its paper's L (the tree's 13 slots and a chain of 51)
AUTO_WINDOW = "auto"
MAX_WINDOW = 4096  # slots per pass: a window past the largest image (Lumina-mGPT at 1024 px: 4096 tokens) only wastes
MAX_TREE_DEPTH = 64  # SJD-PAC's tree levels (the shape chooser's deepest depth)
AUTO_LARGEST_WINDOW = 64  # window="auto" picks from 1, 2, 4, ..., 64 (a GPU's forward cost is flat well past it)


def _window(text: str):
    return AUTO_WINDOW if text == AUTO_WINDOW else int(text)


OPTION_TYPES = {"window": _window, "init": str, "coupling": str, "tree_width": int, "tree_depth": int, "passes": int,
                "groups": str, "guidance_scale": float, "temperature": float, "top_k": int, "top_p": float, "cfg_interval": int}
TREE_KEYS = ("tree_width", "tree_depth")
GAD_KEYS = ("passes", "groups")
SAMPLING_KEYS = ("guidance_scale", "temperature", "top_k", "top_p", "cfg_interval")
SPEC_HELP = ("ar, sjd[-random|-horizontal|-vertical|-source], mc-sjd[-maximal|-gumbel], sjd-pac[-maximal|-gumbel], "
             "auto[-maximal|-gumbel], sd, gad, gsd or iad, "
             "optionally followed by "
             "':key=value,...' (window, init, coupling, tree_width, tree_depth, passes, groups, sampling settings) and '+rule' (exact, "
             "budget[:delta=..,decay=..,end=..,neighbors=..], lantern[:k=..,delta=..], gsd[:half_width=..], lumina)")


class PipelineComponent(SchedulerMixin):
    """The thin adapter through which diffusers saves and loads a frozen settings dataclass as a pipeline component.

    diffusers' ``save_pretrained`` saves a component whose class derives from one of its loadable bases, and
    ``from_pretrained`` loads one by looking that base's name up in the module ``model_index.json`` names (here
    ``vispec.decoding.config``, which therefore imports ``SchedulerMixin``, the lightest such base). Nothing else
    of diffusers is used: the settings are the dataclass's fields, written as JSON to :attr:`config_name` in
    the component's folder with diffusers' ``_class_name`` and ``_diffusers_version`` keys (ignored on loading).
    """

    config_name = "decoding_config.json"

    def settings(self) -> dict[str, Any]:
        """The fields, by name."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def save_pretrained(self, save_directory: Union[str, os.PathLike], **kwargs: Any) -> None:
        """Write the settings to ``save_directory/<config_name>`` (diffusers' saving keywords are ignored)."""
        os.makedirs(save_directory, exist_ok=True)
        data = {"_class_name": type(self).__name__, "_diffusers_version": diffusers.__version__, **self.settings()}
        with open(os.path.join(save_directory, self.config_name), "w") as handle:
            json.dump(data, handle, indent=2, sort_keys=True)
            handle.write("\n")

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: Union[str, os.PathLike], subfolder: Optional[str] = None,
                        **kwargs: Any):
        """Read a local folder's ``<config_name>`` (in ``subfolder`` if given); settings it lacks keep their
        defaults, and an unknown one is a ``ValueError`` (a file from a newer version)."""
        path = os.path.join(os.fspath(pretrained_model_name_or_path), subfolder or "", cls.config_name)
        try:
            with open(path) as handle:
                data = json.load(handle)
        except FileNotFoundError:
            raise ValueError(f"{path} not found: {cls.__name__}.from_pretrained needs a local folder holding "
                             f"{cls.config_name}") from None
        except (OSError, ValueError) as err:
            raise ValueError(f"{path} is not a readable JSON file: {err}") from None
        if not isinstance(data, dict):
            raise ValueError(f"{path} must hold a JSON object, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(k for k in data if not k.startswith("_") and k not in known)
        if unknown:
            raise ValueError(f"{path} has settings {unknown} that {cls.__name__} does not know (expected {sorted(known)})")
        return cls(**{k: v for k, v in data.items() if k in known})


@dataclass(frozen=True, repr=False)
class DecodingConfig(PipelineComponent):
    """How image tokens are decoded (module docstring for the spec grammar). Checked once, when built.

    Args:
        strategy: ``"ar"`` (one token per forward), ``"sjd"`` (Speculative Jacobi Decoding,
            arXiv 2410.01699), ``"mc-sjd"`` (coupled SJD, arXiv 2510.24211), ``"sjd-pac"`` (SJD-PAC's token trees,
            arXiv 2603.18599), ``"auto"`` (each pass's shape, AR, an MC-SJD chain or an SJD-PAC tree of at most
            ``tree_width`` and ``tree_depth``, chosen by expected tokens per second: :mod:`vispec.decoding.shapes`;
            exact; its window is always ``"auto"``) or ``"sd"``
            (draft-model speculative decoding, Leviathan et al. 2023: a drafter GPT proposes
            ``window - 1`` tokens, the target verifies them in one forward).
        window: Jacobi window ``L`` (pending token plus ``L - 1`` drafts); ``>= 1``, or ``"auto"`` for sjd and
            mc-sjd and sjd-pac: each pass picks a window from 1, 2, 4, ..., 64 by measured step cost and running
            acceptance (:mod:`vispec.decoding.windows`; sjd-pac's tree loses levels in windows too small
            for it; exact all the same, but the tokens a seed gives then depend on the machine's timings). For ``"sd"``
            the pending token plus the drafted tokens; likewise for ``"gad"`` (GAD, arXiv 2205.10350: a masked
            block drafter proposes ``window - 1`` tokens in one forward, :mod:`vispec.decoding.gad`).
        init: draft initialisation for new window slots: ``"random"`` (uniform token),
            ``"horizontal"`` (copy the previous token in raster order, i.e. the left neighbour),
            ``"vertical"`` (copy the token one row above; horizontal on the first row), ``"source"`` (the source
            image's token at the same grid position: input-guided aggressive decoding for image-to-image requests;
            ``"iad"`` is ``"sjd-source"``, whose unverified tail is drafted from the source again after every pass;
            ``"mc-sjd:init=source"`` keeps MC-SJD's coupled re-drafts). ``"source"`` needs a request with a source
            image (``decode(source=...)``, ``pipe(image=...)``).
        coupling: ``"none"`` for SJD; ``"maximal"`` (verify every slot, keep each slot's coupled output
            as its next draft) or ``"gumbel"`` (drafts by Gumbel-max with noise fixed per absolute
            position) for MC-SJD and for SJD-PAC's main path (``"maximal"``, the default, is SJD-PAC's adaptive
            continuation; ``"gumbel"`` composes its tree with MC-SJD's Gumbel coupling). ``None`` picks the
            strategy's default (stored resolved).
        tree_width, tree_depth: SJD-PAC's token tree (``"sjd-pac"``, :mod:`vispec.decoding.pac`): ``K``
            candidates per node on the first ``D - 1`` levels below the pending token (``D`` levels with
            it); the window holds the tree's ``(K^D - 1) / (K - 1)`` slots and a chain filling the rest.
            Defaults 3 and 3 (the paper's code); other strategies keep the defaults.
        passes, groups: GAD's drafter forwards per block (``"gad"``, :mod:`vispec.decoding.gad`): the block of
            ``window - 1`` drafts splits into ``passes`` groups drafted left to right, one drafter forward each, each
            group seeing the drafts of the groups before it as context (``1 <= passes <= window - 1``; ``1``:
            one forward, independent drafts). ``groups``: ``"even"`` (sizes as equal as they can be, e.g. 2, 2, 2, 2
            for 8 drafts in 4 passes) or ``"doubling"`` (each group twice the one before once the groups of one
            token end, e.g. 1, 1, 2, 4: the block's start, where acceptance matters most, is drafted
            autoregressively). Other strategies keep the defaults.
        acceptance: the acceptance rule, ``"exact"`` (default) or a lossy one: ``"budget"`` (output within a TV
            budget of the target per verification, :mod:`vispec.decoding.budget`), ``"lantern"``, ``"gsd"`` (with
            options), or ``"lumina"`` (Lumina-mGPT 2.0's biased rule; :mod:`vispec.decoding.acceptance`). Stored in
            canonical form.
        guidance_scale, temperature, top_k, top_p, cfg_interval: the default target distribution
            (:class:`vispec.sampling.SamplingConfig`), so a saved pipeline carries the sampling settings
            its model was evaluated with; call arguments override them.
    """

    strategy: str = "sjd"
    window: Union[int, str] = DEFAULT_WINDOW
    init: str = "horizontal"
    coupling: Optional[str] = None
    acceptance: str = "exact"
    tree_width: int = 3
    tree_depth: int = 3
    passes: int = GAD_DEFAULT_PASSES
    groups: str = "even"
    guidance_scale: float = SamplingConfig.guidance_scale  # the sampling defaults are SamplingConfig's
    temperature: float = SamplingConfig.temperature
    top_k: int = SamplingConfig.top_k
    top_p: float = SamplingConfig.top_p
    cfg_interval: int = SamplingConfig.cfg_interval

    def __post_init__(self) -> None:
        strategy, window = self.strategy, self.window
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
        if strategy == "auto" and window != AUTO_WINDOW:
            raise ValueError(f"decoding 'auto' chooses every pass's window itself: window must be 'auto' (or left out), "
                             f"got {window!r}; for a fixed window name its decoder, e.g. 'sjd-pac:window={window}'")
        if window != AUTO_WINDOW:
            check_int("window", window, minimum=1, maximum=MAX_WINDOW,
                      hint=" (slots per pass) or 'auto' (chosen per pass by cost)")
        if window == AUTO_WINDOW and strategy not in ("sjd", "mc-sjd", "sjd-pac", "auto"):
            raise ValueError(f"window='auto' applies to sjd, mc-sjd and sjd-pac, not {strategy!r}; give an integer window")
        if self.init not in INITS:
            raise ValueError(f"init must be one of {INITS}, got {self.init!r}")
        coupling = COUPLINGS[strategy][0] if self.coupling is None else self.coupling
        if coupling not in COUPLINGS[strategy]:
            raise ValueError(f"coupling for strategy {strategy!r} must be one of {COUPLINGS[strategy]}, got {coupling!r}")
        rule = AcceptanceConfig.parse(self.acceptance)
        check_int("tree_width", self.tree_width, minimum=1, maximum=MAX_WINDOW, hint=" (candidates per tree node)")
        check_int("tree_depth", self.tree_depth, minimum=1, maximum=MAX_TREE_DEPTH, hint=" (tree levels)")
        if strategy not in ("sjd-pac", "auto") and (self.tree_width, self.tree_depth) != (3, 3):
            raise ValueError(f"tree_width and tree_depth apply to sjd-pac and auto, not {strategy!r}")
        check_int("passes", self.passes, minimum=1)
        if self.groups not in GAD_GROUPS:
            raise ValueError(f"groups must be one of {GAD_GROUPS}, got {self.groups!r}")
        if strategy != "gad" and (self.passes, self.groups) != (GAD_DEFAULT_PASSES, "even"):
            raise ValueError(f"passes and groups apply to gad, not {strategy!r}")
        if strategy == "gad" and self.passes > max(window - 1, 1):
            raise ValueError(f"passes={self.passes} exceeds gad's {window - 1} drafts per block (window {window}): each "
                             f"pass drafts at least one token; use passes <= {max(window - 1, 1)}")
        if strategy in ("sjd-pac", "auto"):
            if self.largest_window < self.tree_size:
                raise ValueError(f"sjd-pac's window must hold its tree of {self.tree_size} slots (tree_width "
                                 f"{self.tree_width}, tree_depth {self.tree_depth}), got {window!r}"
                                 + (f" (the largest window 'auto' picks is {AUTO_LARGEST_WINDOW})" if window == AUTO_WINDOW else ""))
            if not rule.lossless:
                raise ValueError(f"{strategy!r} verifies with the exact rule only (its trees have no lossy rule), got "
                                 f"acceptance {rule.name!r}")
        if strategy == "ar" and not rule.lossless:
            raise ValueError(f"acceptance {rule.name!r} needs a speculative decoder (sjd, mc-sjd, sd, gad), not 'ar'")
        object.__setattr__(self, "coupling", coupling)  # stored resolved and canonical, so equal configs compare equal
        object.__setattr__(self, "acceptance", rule.name)
        self.sampling()  # validates the sampling defaults

    # ---- views ---------------------------------------------------------------------------------

    def __repr__(self) -> str:
        return f"DecodingConfig({self.name!r})"

    def sampling(self, **overrides) -> SamplingConfig:
        """The default :class:`SamplingConfig`, with ``None``-valued overrides ignored."""
        values = {k: getattr(self, k) for k in SAMPLING_KEYS}
        values.update({k: v for k, v in overrides.items() if v is not None})
        return SamplingConfig(**values)

    @property
    def largest_window(self) -> int:
        """The window, or with ``window="auto"`` the largest one the chooser may pick (:data:`AUTO_LARGEST_WINDOW`)."""
        window = self.window
        return AUTO_LARGEST_WINDOW if window == AUTO_WINDOW else window

    @property
    def tree_size(self) -> int:
        """Slots of SJD-PAC's tree: ``1 + K + ... + K^(D-1)``, the pending token included."""
        return sum(self.tree_width ** level for level in range(self.tree_depth))

    @property
    def rule(self) -> AcceptanceConfig:
        """The acceptance rule's settings."""
        return AcceptanceConfig.parse(self.acceptance)

    @property
    def name(self) -> str:
        """The spec in the module's grammar, with only the non-default settings: ``parse(name) == self``."""
        return self._label(SAMPLING_KEYS)

    @property
    def method(self) -> str:
        """:attr:`name` without the sampling settings, e.g. ``sjd-horizontal``, ``mc-sjd-maximal+lantern:k=100,delta=0.1``."""
        return self._label(())

    def _label(self, sampling_keys: tuple[str, ...]) -> str:
        variant = {"ar": "ar", "sd": "sd", "gad": "gad", "sjd": "iad" if self.init == "source" else f"sjd-{self.init}", "mc-sjd": f"mc-sjd-{self.coupling}",
                   "sjd-pac": "sjd-pac" if self.coupling == "maximal" else f"sjd-pac-{self.coupling}",
                   "auto": "auto" if self.coupling == "maximal" else f"auto-{self.coupling}"}[self.strategy]
        values, defaults = self.settings(), DecodingConfig.parse(variant).settings()
        keys = ("window",) + (("init",) if self.strategy != "sjd" else ()) + TREE_KEYS + GAD_KEYS + sampling_keys
        options = [f"{k}={values[k]!r}" if isinstance(values[k], float) else f"{k}={values[k]}" for k in keys
                   if values[k] != defaults[k]]
        label = variant + (":" + ",".join(options) if options else "")
        return label if self.acceptance == "exact" else f"{label}+{self.acceptance}"

    # ---- parsing -------------------------------------------------------------------------------

    @classmethod
    def parse(cls, value: Union["DecodingConfig", str], base: Optional["DecodingConfig"] = None, **overrides) -> "DecodingConfig":
        """A config from a config or a spec string (module docstring).

        A spec keeps ``base``'s other settings (window, initialisation, sampling defaults) but takes its
        strategy, the strategy's default coupling unless the variant names one, its options and its
        rule (``exact`` when it has none). Keyword ``overrides`` win over both.
        """
        if isinstance(value, DecodingConfig):
            return replace(value, **overrides) if overrides else value
        if not isinstance(value, str):
            raise ValueError(f"decoding must be a DecodingConfig or a string, got {type(value).__name__}")
        decoder, _, rule = value.strip().partition("+")
        label, _, options = decoder.partition(":")
        if label.strip() == "iad":  # input-guided aggressive decoding: SJD with drafts from the source image
            label = "sjd-source"
        if label.strip() == "gsd":  # short for sjd+gsd; the options are the rule's
            if rule:
                raise ValueError(f"decoding {value!r}: 'gsd' already names its rule (it is short for 'sjd+gsd')")
            label, rule, options = "sjd", "gsd" + (f":{options}" if options else ""), ""
        settings = base.settings() if base is not None else {}
        strategy, suffix = _variant(value, label.strip())
        if _default_window(strategy) != _default_window(settings.get("strategy", "sjd")):  # another window scale
            settings["window"] = _default_window(strategy)
        settings.update(strategy=strategy, coupling=None, acceptance=rule.strip() or "exact")
        if strategy not in ("sjd-pac", "auto"):  # a tree belongs to sjd-pac: another strategy parsed over its config drops it
            for key in TREE_KEYS:
                settings.pop(key, None)
        if strategy != "gad":  # likewise gad's passes
            for key in GAD_KEYS:
                settings.pop(key, None)
        if suffix:
            settings["coupling" if strategy in ("mc-sjd", "sjd-pac", "auto") else "init"] = suffix
        settings.update(_parse_options(value, options))
        try:
            return cls(**{**settings, **overrides})
        except ValueError as err:  # a value the config refuses: say which spec held it
            raise ValueError(f"decoding {value!r}: {err}") from None

    @classmethod
    def resolve(cls, decoding: Union["DecodingConfig", str, None], *, base: Optional["DecodingConfig"] = None,
                acceptance: Union[None, str, AcceptanceConfig, AcceptanceRule] = None) -> "DecodingConfig":
        """The config a call runs: ``decoding`` (default ``base``) with an ``acceptance`` given on its own.

        Naming a lossy rule both in ``decoding`` and as a different ``acceptance`` is an error. A config that
        already names the given rule is returned as it is (a pipeline resolves once and hands :func:`decode`
        the result with its built rule)."""
        if decoding is None and base is None:
            raise ValueError(f"decoding is required: {SPEC_HELP}")
        config = base if decoding is None else cls.parse(decoding, base=base)
        if acceptance is None:
            return config
        name = AcceptanceConfig.parse(acceptance.config if isinstance(acceptance, AcceptanceRule) else acceptance).name
        if name == config.acceptance:
            return config
        if decoding is not None and config.acceptance != "exact":
            raise ValueError(f"decoding {config.name!r} already names the acceptance rule {config.acceptance!r}; "
                             f"give it either in decoding or as acceptance={name!r}, not both")
        return replace(config, acceptance=name)


def _default_window(strategy: str) -> int:
    return {"sd": SD_DEFAULT_WINDOW, "gad": GAD_DEFAULT_WINDOW, "sjd-pac": PAC_DEFAULT_WINDOW,
            "auto": AUTO_WINDOW}.get(strategy, DEFAULT_WINDOW)


def _variant(value: str, label: str) -> tuple[str, str]:
    """``(strategy, suffix)`` of a variant label: ``"mc-sjd-gumbel"`` -> ``("mc-sjd", "gumbel")``."""
    for strategy in ("mc-sjd", "sjd-pac", "sjd", "sd", "gad", "ar", "auto"):
        if label == strategy:
            return strategy, ""
        if label.startswith(strategy + "-") and strategy in ("mc-sjd", "sjd-pac", "sjd", "auto"):
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
