"""``vispec bench decoders``: AR, SJD (each initialisation) and MC-SJD (each coupling) side by side.

Per method: mean NFE per image, mean accepted draft tokens per verification pass, step compression
(AR's NFE / the method's NFE), latency per image (time until the image's last token, averaged),
speed-up (AR latency / method latency), images per second and peak memory (RSS on CPU, max
allocated on CUDA). Numbers are printed as a table and optionally written as JSON.

A randomly initialised model has nearly uniform next-token distributions at LlamaGen's init scale
(std 0.02), where no drafting scheme can be accepted often; ``init_std`` scales the random weights
up to make distributions peaked, which is still no substitute for a trained model.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from vispec.decoding import DecodingConfig, decode
from vispec.eval.bench.memory import PeakMemory
from vispec.eval.bench.report import environment
from vispec.models.llamagen_gpt import GPT_CONFIGS, LlamaGenCondition, LlamaGenGPT
from vispec.sampling import SamplingConfig

ALL_METHODS = ("ar", "sjd-random", "sjd-horizontal", "sjd-vertical", "mc-sjd-maximal", "mc-sjd-gumbel")


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
    guidance_scale: float = 2.0
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    device: str = "cpu"
    dtype: str = "float32"
    extra: dict = field(default_factory=dict)

    def validate(self) -> None:
        if self.model not in GPT_CONFIGS:
            raise ValueError(f"unknown model {self.model!r}; expected one of {sorted(GPT_CONFIGS)}")
        for method in self.methods:
            DecodingConfig.parse(method) if method == "ar" else DecodingConfig.parse(method, window=self.window)
        for name in ("num_images", "batch_size", "image_tokens", "vocab_size", "num_classes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.init_std <= 0:
            raise ValueError(f"init_std must be > 0, got {self.init_std}")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")


def build_random_model(cfg: DecoderBenchConfig) -> LlamaGenGPT:
    torch.manual_seed(cfg.seed)
    model = LlamaGenGPT.from_name(
        cfg.model, vocab_size=cfg.vocab_size, block_size=cfg.image_tokens, num_classes=cfg.num_classes,
        initializer_range=cfg.init_std,
    )
    torch.nn.init.normal_(model.output.weight, std=cfg.init_std)  # LlamaGen zero-inits the head
    # nn.Module.to: diffusers' ModelMixin.to warns on every dtype cast (diffusers 0.42)
    return torch.nn.Module.to(model, device=cfg.device, dtype=getattr(torch, cfg.dtype)).eval()


def _run_method(model, cfg: DecoderBenchConfig, method: str, sampling: SamplingConfig) -> dict:
    decoding = DecodingConfig.parse(method, window=cfg.window) if method != "ar" else DecodingConfig.parse("ar")
    device = torch.device(cfg.device)
    labels = torch.arange(cfg.num_images) % cfg.num_classes
    gens = [torch.Generator().manual_seed(cfg.seed * 100003 + i) for i in range(cfg.num_images)]
    nfe, accepted, latency = [], [], []
    with PeakMemory(device) as memory:
        start = time.perf_counter()
        for lo in range(0, cfg.num_images, cfg.batch_size):
            hi = min(lo + cfg.batch_size, cfg.num_images)
            out = decode(
                model, LlamaGenCondition(class_labels=labels[lo:hi].to(device)), num_tokens=cfg.image_tokens,
                sampling=sampling, decoding=decoding, generator=gens[lo:hi],
            )
            nfe += out.stats.nfe.tolist()
            accepted += out.stats.accepted_per_forward.tolist()
            latency += out.stats.latency_s.tolist()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        total = time.perf_counter() - start
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    return {
        "nfe": mean(nfe),
        "accepted_per_forward": mean(accepted),
        "tokens_per_forward": cfg.image_tokens / mean(nfe),
        "latency_s": mean(latency),
        "images_per_s": cfg.num_images / total,
        "peak_mem_mb": memory.peak_mb,
    }


def run_decoder_bench(cfg: DecoderBenchConfig, progress=print) -> dict:
    """Run every method; returns ``{"config": ..., "methods": {name: {...}}}``."""
    cfg.validate()
    model = build_random_model(cfg)
    sampling = SamplingConfig(temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p, guidance_scale=cfg.guidance_scale)
    methods = list(dict.fromkeys(("ar",) + tuple(cfg.methods)))  # AR is the baseline
    # warm-up (allocator, kernels), not timed
    decode(model, LlamaGenCondition(class_labels=torch.zeros(1, dtype=torch.long, device=cfg.device)),
           num_tokens=min(cfg.image_tokens, 2 * cfg.window), sampling=sampling, decoding=DecodingConfig.parse("sjd", window=cfg.window))
    results = {}
    for method in methods:
        progress(f"running {method} ...")
        results[method] = _run_method(model, cfg, method, sampling)
    ar = results["ar"]
    for res in results.values():
        res["step_compression"] = ar["nfe"] / res["nfe"]
        res["speedup"] = ar["latency_s"] / res["latency_s"]
    config = {k: v for k, v in vars(cfg).items() if k != "extra"}
    config.update(methods=list(methods), parameters=sum(p.numel() for p in model.parameters()), **environment(cfg.device))
    return {"config": config, "methods": {m: results[m] for m in methods if m in cfg.methods or m == "ar"}}


def format_table(result: dict) -> str:
    """A fixed-width table of a bench result."""
    cols = [("method", "{:<16}"), ("nfe", "{:>8.1f}"), ("acc/fwd", "{:>8.3f}"), ("step x", "{:>7.2f}"),
            ("latency s", "{:>10.3f}"), ("speedup", "{:>8.2f}"), ("img/s", "{:>7.2f}"), ("peak MB", "{:>8.0f}")]
    keys = ["nfe", "accepted_per_forward", "step_compression", "latency_s", "speedup", "images_per_s", "peak_mem_mb"]
    header = " ".join(f"{name:<16}" if i == 0 else f"{name:>{len(fmt.format(0.0))}}" for i, (name, fmt) in enumerate(cols))
    lines = [header, "-" * len(header)]
    for method, res in result["methods"].items():
        cells = [cols[0][1].format(method)] + [fmt.format(res[k]) for (_, fmt), k in zip(cols[1:], keys)]
        lines.append(" ".join(cells))
    return "\n".join(lines)

