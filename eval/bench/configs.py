"""The settings of ``vispec bench decoders | image | kernels``, importable without torch.

The CLI builds each benchmark's flags from its config dataclass when it builds its parser, so these classes must
not pull in torch, diffusers or the models: ``vispec ... --help`` stays instant (``vispec bench text``'s
:class:`~vispec.eval.bench.text.TextBenchConfig` lives in its own light module). What the checks in ``validate``
need (the GPT configs, the decoding-spec parser, the device check) is imported when they run. Each benchmark
module re-exports its config, so ``from vispec.eval.bench.decoders import DecoderBenchConfig`` keeps working.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Optional

ALL_METHODS = ("ar", "sjd-random", "sjd-horizontal", "sjd-vertical", "mc-sjd-maximal", "mc-sjd-gumbel")
TRAINED_MODELS = ("tiny-c2i",)  # embedded pipelines whose transformer the decoder bench can load


def split_inflated_name(name: str) -> tuple[str, Optional[str]]:
    """``"<trained model>@<GPT config>"`` (e.g. ``tiny-c2i@GPT-L``: tiny-c2i's logits at GPT-L cost,
    :func:`vispec.models.inflate.inflate`) -> ``("tiny-c2i", "GPT-L")``; a name without ``@`` -> ``(name, None)``.
    Only the spelling is checked here (no torch): :func:`check_inflated_model` checks the parts."""
    if "@" not in name:
        return name, None
    base, _, target = name.rpartition("@")
    if not base or not target:
        raise ValueError(f"model {name!r}: an inflated model is named <trained model>@<GPT config>, e.g. tiny-c2i@GPT-L")
    return base, target


def check_inflated_model(name: str, trained: Optional[tuple[str, ...]] = TRAINED_MODELS):
    """The :class:`~vispec.models.inflate.InflationPlan` of ``name`` (``<trained model>@<GPT config>``), checked
    before anything is loaded: the GPT config is known, the trained model is one of ``trained`` (None: any pipeline,
    embedded name or folder, whose transformer is a LlamaGen GPT or a Chameleon) and the GPT config is no smaller than
    it in any size (its ``transformer/config.json`` is read, not the weights). ValueError naming what is wrong."""
    return _inflation_source(name, trained)[0]


def _inflation_source(name: str, trained: Optional[tuple[str, ...]]) -> tuple:
    """``(plan, the trained model's transformer config.json as a dict)`` (:func:`check_inflated_model`)."""
    import json
    import os

    from vispec.models.inflate import plan_inflation
    from vispec.models.llamagen_gpt import GPT_CONFIGS
    from vispec.pipelines.embedded import resolve_model_path

    base, target = split_inflated_name(name)
    if target is None:
        raise ValueError(f"model {name!r} is not an inflated model name (<trained model>@<GPT config>)")
    if target not in GPT_CONFIGS:
        raise ValueError(f"model {name!r}: unknown GPT config {target!r} after '@'; expected one of {sorted(GPT_CONFIGS)}")
    if trained is not None and base not in trained:
        raise ValueError(f"model {name!r}: only a trained model can be inflated; expected one of {list(trained)} "
                         f"before '@' (e.g. {trained[0]}@{target})")
    folder = resolve_model_path(base)
    path = os.path.join(folder, "transformer", "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"model {name!r}: {base} has no transformer/config.json to inflate")
    with open(path) as f:
        config = json.load(f)
    try:
        return plan_inflation(config, target), config
    except ValueError as err:
        raise ValueError(f"model {name!r}: {err}") from None


DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def check_decoder_memory(cfg: "DecoderBenchConfig") -> None:
    """Refuse a ``vispec bench decoders`` model that would not fit this machine, from its sizes, before anything is
    built: a named random-init GPT or an inflated one (``tiny-c2i@GPT-7B``; the embedded tiny-c2i itself is tiny).
    The model is built in float32 on the CPU (:func:`vispec.eval.bench.decoders.build_model`) and then cast to
    ``dtype`` on ``device``, where the decodes add their key/value cache (the widest batch, both guidance rows, the
    class token, the image and the widest window). Estimates (:func:`vispec.models.inflate.parameter_count`) against
    :func:`vispec.models.offload.available_memory`; the error names ``--model`` with the need and what is available,
    in GiB. Activations and the sweep's compiled graphs come on top (a lower estimate)."""
    import torch

    from vispec.eval.bench.decoders import decoding_config
    from vispec.models import offload
    from vispec.models.inflate import approx_count, gib, parameter_count, source_sizes
    from vispec.models.llamagen_gpt import GPT_CONFIGS

    base, target = split_inflated_name(cfg.model)
    if target is not None:
        plan, config = _inflation_source(cfg.model, TRAINED_MODELS)
        sizes, note = plan, f" ({base}'s logits at {target} cost: width {plan.dim}, {plan.n_layer} layers)"
    elif cfg.model in GPT_CONFIGS:  # LlamaGenGPT.from_name's other defaults
        config = dict(GPT_CONFIGS[cfg.model], model_type="c2i", vocab_size=cfg.vocab_size, num_classes=cfg.num_classes,
                      multiple_of=256, ffn_dim_multiplier=None, norm_eps=1e-5, class_dropout_prob=0.1, n_kv_head=None)
        plan, note = None, ""
        sizes = source_sizes(config)
    else:  # the embedded trained model
        return
    parameters = parameter_count(config, plan)
    batch = max(cfg.batch_sizes) if cfg.batch_sizes else cfg.batch_size
    batch_flag = f"--batch-sizes {max(cfg.batch_sizes)}" if cfg.batch_sizes else f"--batch-size {cfg.batch_size}"
    rows = batch * (2 if cfg.guidance_scale != 1 else 1)
    window = max([cfg.window] + [decoding_config(m, cfg.window).largest_window for m in cfg.methods])
    positions = 1 + cfg.image_tokens + window
    size = DTYPE_BYTES[cfg.dtype]
    cache = 2 * sizes.n_layer * rows * sizes.n_kv_head * sizes.head_dim * positions * size
    what = f"model (--model) {cfg.model!r}: ~{approx_count(parameters)} parameters{note}"
    built = f"{gib(parameters * 4)} of float32 weights (built on the CPU before the cast to --dtype {cfg.dtype})"
    used = (f"{gib(parameters * size)} of {cfg.dtype} weights and {gib(cache)} of key/value cache ({batch_flag}"
            f"{', x2 rows for guidance' if rows > batch else ''}, {positions} positions)")
    # (device, weight bytes, cache bytes, what they are): the float32 build on the CPU, then the decodes on the device
    needs = [("cpu", parameters * 4, 0, built)]
    decodes = (cfg.device, parameters * size, cache, used)
    if torch.device(cfg.device).type != "cpu":
        needs.append(decodes)
    elif parameters * size + cache > parameters * 4:  # on the CPU the larger of the two
        needs = [decodes]
    for where, weights, kv, why in needs:
        free = offload.available_memory(torch.device(where))
        if free is not None and weights + kv > free:
            smaller = "--model" if weights > free else batch_flag.split()[0]
            raise ValueError(f"{what} need {why}: {gib(weights + kv)}, more than the {gib(free)} available on {where}; "
                             f"pick a smaller {smaller}")


COST_CURVES = ("measured", "flat")  # --cost-curve: besides these, a cost-curve JSON file
_WINDOW_LABEL = re.compile(r"[1-9][0-9]*")
_SHAPE_LABEL = re.compile(r"(chain|tree):([1-9][0-9]*)")


def read_cost_curve(path: str) -> dict:
    """``--cost-curve PATH``: the step costs of a cost-curve file in the on-disk cache format
    (:func:`vispec.decoding.windows.save_step_costs`: ``{"key": ..., "costs": {label: [[cached length, seconds], ...]}}``,
    e.g. recorded on a GPU), as ``{label: [(length, seconds), ...]}``: the shape chooser's labels (``ar``, ``chain:L``,
    ``tree:L``, and ``ar-decoder``, its yardstick) as strings, the window chooser's windows as ints. The window
    chooser's windows a file lacks are taken from ``ar`` (window 1) and ``chain:L`` (window ``L``). A ValueError naming ``--cost-curve`` and what is wrong (the
    file unreadable, not JSON, another layout, an unknown label, a sample that is no ``[length >= 0, seconds > 0]``,
    no ``ar`` cost)."""
    import json
    import math

    from vispec.decoding.shapes import AR_DECODER

    where = f"cost_curve (--cost-curve) {path!r}"
    expected = ('expected measured, flat or a cost-curve JSON file ({"key": ..., "costs": {label: [[cached length, '
                'seconds], ...]}}, as vispec keeps them in $VISPEC_CACHE_DIR/step-costs)')
    try:
        with open(path) as handle:
            text = handle.read()
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"{where}: cannot read it ({err}); {expected}") from None
    try:
        data = json.loads(text)
    except ValueError as err:
        raise ValueError(f"{where} is not valid JSON ({err}); {expected}") from None
    if not isinstance(data, dict) or not isinstance(data.get("costs"), dict) or not data["costs"]:
        raise ValueError(f"{where} has no \"costs\" object of cost labels; {expected}")
    costs: dict = {}
    for label, samples in data["costs"].items():
        if _WINDOW_LABEL.fullmatch(label):
            key = int(label)
        elif label in ("ar", AR_DECODER) or (_SHAPE_LABEL.fullmatch(label)
                                              and int(_SHAPE_LABEL.fullmatch(label).group(2)) >= 2):
            key = label
        else:
            raise ValueError(f"{where}: unknown cost label {label!r}; expected ar, {AR_DECODER}, chain:L or tree:L (L >= 2 "
                             f"rows, the shape chooser's) or a window 1, 2, 4, ... (the window chooser's)")
        pairs = []
        for sample in samples if isinstance(samples, list) and samples else [None]:
            ok = (isinstance(sample, (list, tuple)) and len(sample) == 2
                  and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in sample))
            if not ok or not (sample[0] >= 0 and math.isfinite(sample[1]) and sample[1] > 0):
                raise ValueError(f"{where}: cost label {label!r} needs a non-empty list of [cached length >= 0, "
                                 f"seconds > 0] pairs, got {samples!r}"[:400])
            pairs.append((int(sample[0]), float(sample[1])))
        costs[key] = pairs
    if "ar" not in costs:
        raise ValueError(f"{where} has no \"ar\" cost: the chooser's predicted speed-ups are relative to it")
    costs.setdefault(1, costs["ar"])
    for label in [k for k in costs if isinstance(k, str) and k.startswith("chain:")]:
        costs.setdefault(int(label.split(":")[1]), costs[label])
    return costs


def check_cost_curve(value: str) -> None:
    """``--cost-curve``: ``measured``, ``flat`` or a readable cost-curve file (:func:`read_cost_curve`)."""
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"cost_curve (--cost-curve) must be measured, flat or a cost-curve JSON file, got {value!r}")
    if value not in COST_CURVES:
        read_cost_curve(value)


def _check_device(name: str) -> None:
    from vispec.eval.bench.report import check_device

    check_device(name)


@dataclass
class DecoderBenchConfig:
    model: str = "GPT-mini"
    vocab_size: int = 16384
    image_tokens: int = 256
    num_classes: int = 1000
    init_std: float = 0.02
    methods: tuple[str, ...] = ALL_METHODS
    window: int = 16
    num_images: int = 4
    batch_size: int = 1
    batch_sizes: Optional[tuple[int, ...]] = None
    compile: bool = False
    rounds: int = 3
    threads: int = 0
    guidance_scale: float = 2.0
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    device: str = "cpu"
    dtype: str = "float32"
    cuda_graphs: bool = False  # compiled steps with torch.compile(mode="reduce-overhead") (needs compile)
    kernels: bool = False  # also `vispec bench kernels` at the model's vocabulary, in the same result
    cost_curve: str = "measured"  # what the choosers price passes by: measured, flat or a cost-curve file (COST_CURVES)
    extra: dict = field(default_factory=dict)

    @property
    def sweep(self) -> bool:
        """Whether this is a batch sweep (``batch_sizes`` or ``compile`` given) rather than the one-batch-size run."""
        return self.batch_sizes is not None or self.compile

    def validate(self) -> None:
        """Every setting, before a model is built."""
        from vispec.eval.bench.decoders import decoding_config
        from vispec.models.llamagen_gpt import GPT_CONFIGS

        check_cost_curve(self.cost_curve)
        if split_inflated_name(self.model)[1] is not None:
            check_inflated_model(self.model)
        elif self.model not in GPT_CONFIGS and self.model not in TRAINED_MODELS:
            raise ValueError(f"unknown model {self.model!r}; expected one of {sorted(GPT_CONFIGS) + list(TRAINED_MODELS)} "
                             f"or <trained model>@<GPT config> (e.g. {TRAINED_MODELS[0]}@GPT-L)")
        for method in self.methods:
            config = decoding_config(method, self.window)
            # decodes a bare GPT: no drafter model, no VQ codebook (a refusal now, not after the other methods ran)
            if config.strategy in ("sd", "gad"):
                raise ValueError(f"methods: {method!r} needs a drafter model, which `vispec bench decoders` does not "
                                 f"load; time {config.strategy} with `vispec bench image --model tiny-c2i` (its folder has "
                                 "a drafter and a gad_drafter)")
            if config.rule.rule == "lantern":
                raise ValueError(f"methods: {method!r} needs the VQ codebook, which `vispec bench decoders` does not "
                                 "load; time +lantern with `vispec bench image`")
        for name in ("num_images", "batch_size", "image_tokens", "vocab_size", "num_classes", "rounds"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.batch_sizes is not None and (not self.batch_sizes or min(self.batch_sizes) < 1):
            raise ValueError(f"batch_sizes must be integers >= 1, got {self.batch_sizes}")
        if self.compile:
            for method in self.methods:
                if decoding_config(method, self.window).strategy not in ("ar", "sjd", "mc-sjd", "sjd-pac", "auto"):
                    raise ValueError(f"--compile applies to ar, sjd, mc-sjd, sjd-pac and auto, not {method!r}")
        if self.threads < 0:
            raise ValueError(f"threads must be >= 0 (0: leave torch's thread count), got {self.threads}")
        if self.init_std <= 0:
            raise ValueError(f"init_std must be > 0, got {self.init_std}")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        if self.cuda_graphs and not self.compile:
            raise ValueError("cuda_graphs (--cuda-graphs) runs the compiled decode steps as CUDA graphs: add --compile")
        if self.image_tokens < 2:
            raise ValueError(f"image_tokens must be >= 2 (the roofline's cost curve times passes after the first token), "
                             f"got {self.image_tokens}")
        _check_device(self.device)
        check_decoder_memory(self)


@dataclass
class ImageBenchConfig:
    model: str = "tiny-c2i"
    methods: tuple[str, ...] = ("ar", "sjd", "mc-sjd")
    num_images: int = 1000
    batch_size: int = 32
    latency_images: int = 16
    real_images: int = 1000
    noise_repeats: int = 3
    seed: int = 0
    guidance_scale: Optional[float] = None
    temperature: Optional[float] = None
    top_k: Optional[int] = None
    top_p: Optional[float] = None
    evaluator: Optional[str] = None  # class-to-image: defaults to the model folder's "evaluator" subfolder
    clip: Optional[str] = None  # text-to-image: a CLIP folder, defaults to the model folder's "clip" subfolder
    device: str = "cpu"
    lantern_k: tuple[int, ...] = (1000,)
    lantern_delta: tuple[float, ...] = (0.1,)
    batch_sizes: Optional[tuple[int, ...]] = None
    compile: bool = False
    rounds: int = 3
    sweep_images: int = 16
    results_dir: Optional[str] = None  # every image's result, written as its batch finishes; a rerun skips them
    num_processes: Optional[int] = None  # the processes launched (torchrun); another world size is an error
    cost_curve: str = "measured"  # what the choosers price passes by: measured, flat or a cost-curve file (COST_CURVES)
    extra: dict = field(default_factory=dict)

    @property
    def sweep(self) -> bool:
        """Whether a throughput sweep runs (``batch_sizes`` or ``compile`` given)."""
        return self.batch_sizes is not None or self.compile

    def validate(self) -> None:
        """The settings, before any model is loaded: a late failure would lose hours of work. The methods' spelling
        (and their ``+lantern`` sweeps) is checked here; whether the model can run each one, once it is loaded."""
        from vispec.eval.bench.image import expand_methods

        check_cost_curve(self.cost_curve)
        for name in ("batch_size", "latency_images", "noise_repeats", "rounds", "sweep_images"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("num_images", "real_images"):  # FID needs two images per side
            if getattr(self, name) < 2:
                raise ValueError(f"{name} must be >= 2 (FID needs at least two images), got {getattr(self, name)}")
        if self.noise_repeats > 40:
            raise ValueError(f"noise_repeats must be <= 40 (distinct 32-bit seeds), got {self.noise_repeats}")
        if self.batch_sizes is not None and (not self.batch_sizes or min(self.batch_sizes) < 1):
            raise ValueError(f"batch_sizes must be integers >= 1, got {self.batch_sizes}")
        expand_methods(tuple(self.methods), tuple(self.lantern_k), tuple(self.lantern_delta))
        if split_inflated_name(self.model)[1] is not None:  # any LlamaGen or Chameleon pipeline can be inflated
            check_inflated_model(self.model, trained=None)
        _check_device(self.device)


@dataclass
class KernelBenchConfig:
    rows: tuple[int, ...] = (16, 128, 512, 2048)
    vocab: tuple[int, ...] = (8192, 16384, 126464)
    window: int = 16
    guidance_scale: float = 4.0
    dtype: str = "float32"
    device: str = "auto"
    repeats: int = 0  # 0: as many as fit in max_seconds (at least 1, at most 20)
    max_seconds: float = 5.0
    step_batch: int = 0  # samples in the decoding-step shares (0: 32 on CUDA, 4 on CPU)
    peak_gbps: Optional[float] = None
    ops: tuple[str, ...] = ("verify", "unmask")
    compile_check: bool = True
    step_shares: bool = True  # the decoding-step shares (tiny-c2i and a LlamaGen-B-sized forward against verification)
    seed: int = 0
    extra: dict = field(default_factory=dict)

    def validate(self) -> None:
        """Every setting, before any tensor is made."""
        if not self.rows or any(r < 1 for r in self.rows):
            raise ValueError(f"rows must be positive integers, got {self.rows}")
        if not self.vocab or any(v < 2 for v in self.vocab):
            raise ValueError(f"vocab must be integers >= 2, got {self.vocab}")
        if self.window < 2:
            raise ValueError(f"window must be >= 2, got {self.window}")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        unknown = set(self.ops) - {"verify", "unmask"}
        if unknown or not self.ops:
            raise ValueError(f"ops must be a non-empty subset of verify, unmask; got {self.ops}")
        if self.max_seconds <= 0 or self.repeats < 0:
            raise ValueError("max_seconds must be > 0 and repeats >= 0")
        if self.device != "auto":  # auto: cuda when available, else cpu
            _check_device(self.device)
