"""``vispec bench kernels``: the verification and unmasking kernels against their PyTorch references.

For every ``rows x vocab`` cell it times two operations on random logits:

* ``verify``: one SJD verification step from raw logits with fused classifier-free guidance
  (:class:`vispec.kernels.target.Target`): acceptance of ``rows`` dense drafts (windows of
  ``window`` rows per sample), the first rejection per sample, the residual sample there, fresh
  samples after it and the stored ``p`` rows that become the next drafts;
* ``unmask``: dLLM unmasking statistics (:func:`vispec.kernels.unmask.unmask_candidates`) at
  temperature 1 with in-kernel float64 Philox noise.

Reported per cell and backend: time (median of CUDA-event or wall-clock repeats), the bytes the
kernels must move (each logits row read once per pass that needs it, plus stored rows) and the
achieved GB/s against the device's peak, and the kernel's speed-up over the reference. Two
decoding-step shares put the verification in context: a tiny-c2i window forward and a
LlamaGen-B-sized (111M parameters, randomly initialised) window forward, each against the
verification of its own logits.

``step_shares=False`` leaves the shares out (``vispec bench decoders --kernels`` runs this bench at its own
model's vocabulary without them). Without CUDA only the reference is timed; the JSON says so (``"kernels_timed": false``) and the
kernels' compile results for sm_80/sm_90 are reported instead (:mod:`vispec.kernels.compile_check`).
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from typing import Callable, Optional

import torch

from vispec.eval.bench.report import check_device, environment
from vispec.eval.bench.configs import KernelBenchConfig  # noqa: F401 - re-exported
from vispec.kernels.backend import triton_available
from vispec.kernels.target import Target
from vispec.kernels.unmask import RowNoise, unmask_candidates
from vispec.kernels.verify import Drafts, SampleRequest
from vispec.sampling import SamplingConfig

# HBM bandwidth in GB/s by device-name fragment (vendor data sheets)
PEAK_GBPS = {"H200": 4800.0, "H100 SXM": 3350.0, "H100 80GB HBM3": 3350.0, "H100 PCIe": 2000.0, "H100": 3350.0,
             "A100-SXM4-80GB": 2039.0, "A100 80GB": 1935.0, "A100": 1555.0, "L40S": 864.0, "RTX 4090": 1008.0}


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return check_device(name)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_call(fn: Callable[[], object], device: torch.device, repeats: int, max_seconds: float) -> tuple[float, int]:
    """Median seconds per call (one warm-up call first) and the number of timed calls."""
    fn()
    _sync(device)
    times: list[float] = []
    budget_end = time.perf_counter() + max_seconds
    while True:
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
        if repeats and len(times) >= repeats:
            break
        if not repeats and (len(times) >= 20 or time.perf_counter() > budget_end):
            break
    return statistics.median(times), len(times)


@dataclass
class VerifyProblem:
    """Random logits and drafts shaped like one SJD pass: ``rows // window`` samples of ``window`` rows."""

    cond: torch.Tensor
    uncond: torch.Tensor
    drafts: torch.Tensor
    q: torch.Tensor
    q_index: torch.Tensor
    row_sample: torch.Tensor
    row_start: torch.Tensor
    num_drafts: torch.Tensor
    seeds: torch.Tensor
    sampling: SamplingConfig

    @property
    def positions(self) -> torch.Tensor:
        """The position each row predicts (its slot in the window, plus one)."""
        width = int(self.num_drafts[0]) + 1
        return torch.arange(self.cond.shape[0], device=self.cond.device) % width + 1

    @classmethod
    def make(cls, rows: int, vocab: int, window: int, guidance_scale: float, dtype: torch.dtype, device: torch.device,
             seed: int = 0) -> "VerifyProblem":
        gen = torch.Generator(device=device).manual_seed(seed)
        width = min(window, rows)
        samples = max(rows // width, 1)
        rows = samples * width
        cond = (torch.randn(rows, vocab, device=device, generator=gen) * 2.0).to(dtype)
        uncond = (torch.randn(rows, vocab, device=device, generator=gen) * 2.0).to(dtype)
        row_sample = torch.arange(samples, device=device).repeat_interleave(width)
        slot = torch.arange(rows, device=device) % width
        drafts = torch.randint(0, vocab, (rows,), device=device, generator=gen)
        drafts = torch.where(slot < width - 1, drafts, torch.full_like(drafts, -1))  # last row of a window: bonus
        q = torch.softmax(torch.randn(rows, vocab, device=device, generator=gen), -1)
        return cls(cond, uncond, drafts, q, torch.arange(rows, device=device), row_sample,
                   torch.arange(samples, device=device) * width, torch.full((samples,), width - 1, device=device),
                   torch.arange(samples, device=device) + 1, SamplingConfig(guidance_scale=guidance_scale))

    def step(self, backend: str) -> tuple[torch.Tensor, int]:
        """One verification pass as SJD runs it; returns the stored next-draft rows and the bytes moved."""
        target = Target(self.cond, self.uncond, self.positions, self.row_sample, self.seeds, self.sampling,
                        backend=backend, validate=False)
        rows = self.cond.shape[0]
        width = int(self.num_drafts[0]) + 1
        draws = torch.ones(rows, dtype=torch.long, device=self.cond.device)
        drafts = Drafts(self.drafts, self.q, self.q_index)
        accepted = target.accept(drafts, draws)
        m = target.first_rejection(accepted, self.row_start, self.num_drafts)
        slot = torch.arange(rows, device=self.cond.device) % width
        m_row = m[self.row_sample]
        residual = (slot == m_row) & (m_row < self.num_drafts[self.row_sample])
        fresh = slot > m_row
        store_rows = torch.where(fresh, self.row_sample * width + slot - m_row - 1, torch.full_like(slot, -1))
        store = torch.empty(rows, self.cond.shape[1], dtype=torch.float32, device=self.cond.device)
        target.sample(SampleRequest(residual=residual, fresh=fresh | (slot == width - 1), residual_draws=draws,
                                    fresh_draws=draws, store_rows=store_rows, store_out=store), drafts)
        return store, self.bytes_moved(residual, fresh | (slot == width - 1))

    def bytes_moved(self, residual: torch.Tensor, fresh: torch.Tensor) -> int:
        """Bytes the kernels must move: both logits halves once for acceptance, again for every sampled or
        stored row, the ``q`` row of every residual row, and the stored ``p`` rows."""
        rows, vocab = self.cond.shape
        logit_row = 2 * vocab * self.cond.element_size()
        resampled = int((residual | fresh).sum())
        return rows * logit_row + resampled * logit_row + int(residual.sum()) * vocab * 4 + int(fresh.sum()) * vocab * 4


def _unmask_op(logits: torch.Tensor, backend: str) -> Callable[[], object]:
    rows = logits.shape[0]
    noise = RowNoise(torch.arange(rows, device=logits.device) + 1, torch.arange(rows, device=logits.device),
                     torch.zeros(rows, dtype=torch.long, device=logits.device))
    return lambda: unmask_candidates(logits, 1.0, noise=noise, backend=backend)


def _peak_gbps(device: torch.device, override: Optional[float]) -> Optional[float]:
    if override:
        return override
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for fragment, gbps in PEAK_GBPS.items():
        if fragment in name:
            return gbps
    return None


def _forward_share(model, batch: int, window: int, context: int, verify_fn: Callable, device: torch.device,
                   cfg: KernelBenchConfig) -> dict:
    """Time a window forward of ``model`` (with CFG) at ``context`` cached tokens against ``verify_fn(logits)``."""
    from vispec.models.llamagen_gpt import LlamaGenCondition

    labels = torch.arange(batch, device=device) % model.config.num_classes
    state, _ = model.prefill(LlamaGenCondition(class_labels=labels), guidance=True,
                             max_new_tokens=model.config.block_size, window=window)
    vocab = model.config.vocab_size
    gen = torch.Generator(device=device).manual_seed(cfg.seed)
    model.forward_window(state, torch.randint(0, vocab, (batch, context), device=device, generator=gen))
    model.rollback(state, torch.full((batch,), context, dtype=torch.long, device=device))
    tokens = torch.randint(0, vocab, (batch, window), device=device, generator=gen)

    def forward():
        out = model.forward_window(state, tokens)
        model.rollback(state, torch.zeros(batch, dtype=torch.long, device=device))
        return out

    with torch.no_grad():
        out = forward()
        forward_s, _ = time_call(forward, device, cfg.repeats, cfg.max_seconds)
        verify_s, _ = time_call(lambda: verify_fn(out), device, cfg.repeats, cfg.max_seconds)
    return {"batch": batch, "window": window, "context": context, "rows": batch * window, "vocab": vocab,
            "parameters": sum(p.numel() for p in model.parameters()), "forward_ms": forward_s * 1e3,
            "verify_ms": verify_s * 1e3, "verify_share_of_step": verify_s / (forward_s + verify_s),
            "verify_over_forward": verify_s / forward_s}


def _window_verify(sampling: SamplingConfig, backend: str, window: int) -> Callable:
    def run(out):
        batch, width, vocab = out.cond.shape
        device = out.cond.device
        rows = batch * width
        row_sample = torch.arange(batch, device=device).repeat_interleave(width)
        slot = torch.arange(rows, device=device) % width
        drafts = torch.where(slot < width - 1, torch.zeros_like(slot), torch.full_like(slot, -1))
        q = torch.full((1, vocab), 1.0 / vocab, device=device)
        problem = VerifyProblem(out.cond.reshape(rows, vocab), out.uncond.reshape(rows, vocab), drafts, q,
                                torch.zeros(rows, dtype=torch.long, device=device), row_sample,
                                torch.arange(batch, device=device) * width, torch.full((batch,), width - 1, device=device),
                                torch.arange(batch, device=device) + 1, sampling)
        return problem.step(backend)

    return run


def _compile_results(progress_bar: Optional[bool] = None) -> dict:
    """Run :mod:`vispec.kernels.compile_check` for sm_80 and sm_90 in a subprocess (the Triton interpreter off).

    With a progress bar (``progress_bar``, or ``None`` and stderr a terminal) the check draws its tqdm bar on
    this process's stderr, where its own errors then go too; without one, stderr is captured and its last line
    can be the summary."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "0"
    bar = sys.stderr.isatty() if progress_bar is None else progress_bar
    command = [sys.executable, "-m", "vispec.kernels.compile_check", "--arch", "80", "--arch", "90"]
    run = subprocess.run(command + (["--progress"] if bar else []), env=env, stdout=subprocess.PIPE,
                         stderr=None if bar else subprocess.PIPE, text=True)
    lines = (run.stdout + (run.stderr or "")).strip().splitlines()
    summary = lines[-1] if lines else ""
    if bar and run.returncode and not run.stdout.strip():
        summary = f"the compile check failed with exit status {run.returncode} (its messages are above)"
    return {"returncode": run.returncode, "summary": summary, "failures": [l for l in lines if l.startswith("FAILED")]}


def _step_shares(cfg: KernelBenchConfig, device: torch.device, backend: str, shares: dict, progress: Callable[[str], None],
                 report: Callable[[], None]) -> None:
    """The decoding-step shares (module docstring) into ``shares``: a tiny-c2i and a LlamaGen-B-sized window forward,
    each against the verification of its own logits."""
    step_batch = cfg.step_batch or (32 if device.type == "cuda" else 4)
    sampling = SamplingConfig(guidance_scale=cfg.guidance_scale)
    from vispec.pipelines.embedded import resolve_model_path
    from vispec.models.llamagen_gpt import LlamaGenGPT

    tiny = LlamaGenGPT.from_pretrained(os.path.join(resolve_model_path("tiny-c2i"), "transformer")).to(device).eval()
    shares["tiny-c2i"] = _forward_share(tiny, step_batch, cfg.window, 128, _window_verify(sampling, backend, cfg.window), device, cfg)
    progress(f"tiny-c2i step: forward {shares['tiny-c2i']['forward_ms']:.2f} ms, verify {shares['tiny-c2i']['verify_ms']:.2f} ms")
    report()
    torch.manual_seed(cfg.seed)
    base = LlamaGenGPT(vocab_size=16384, dim=768, n_layer=12, n_head=12, num_classes=1000, block_size=256,
                       class_dropout_prob=0.1).to(device).eval()
    shares["llamagen-b"] = _forward_share(base, step_batch, cfg.window, 128, _window_verify(sampling, backend, cfg.window), device, cfg)
    progress(f"LlamaGen-B step: forward {shares['llamagen-b']['forward_ms']:.2f} ms, verify {shares['llamagen-b']['verify_ms']:.2f} ms")


def run_kernel_bench(cfg: KernelBenchConfig, progress: Callable[[str], None] = print,
                     partial: Optional[Callable[[dict], None]] = None, progress_bar: Optional[bool] = None) -> dict:
    """Run the benchmark (module docstring); returns a JSON-ready dict. ``partial(result)`` receives the
    cells so far after every cell and step share, for an incremental JSON. ``progress_bar``: a tqdm bar on stderr
    over the compile check's configurations (minutes); ``None``: when stderr is a terminal."""
    cfg.validate()
    device = _device(cfg.device)
    dtype = getattr(torch, cfg.dtype)
    on_gpu = device.type == "cuda" and triton_available()
    backends = ("reference", "triton") if on_gpu else ("reference",)
    peak = _peak_gbps(device, cfg.peak_gbps)
    cells = []
    shares = {}

    def snapshot() -> dict:
        return {"config": {**asdict(cfg), "device": str(device)},
                "environment": {**environment(device), "peak_gbps": peak, "triton": triton_available()},
                "kernels_timed": on_gpu, "cells": list(cells), "step_shares": dict(shares)}

    for vocab in cfg.vocab:
        for rows in cfg.rows:
            problem = VerifyProblem.make(rows, vocab, cfg.window, cfg.guidance_scale, dtype, device, cfg.seed)
            for op in cfg.ops:
                cell = {"op": op, "rows": int(problem.cond.shape[0]), "vocab": vocab}
                for backend in backends:
                    if op == "verify":
                        _, moved = problem.step(backend)
                        fn = lambda b=backend, p=problem: p.step(b)  # noqa: E731
                    else:
                        moved = problem.cond.numel() * problem.cond.element_size()
                        fn = _unmask_op(problem.cond, backend)
                    seconds, calls = time_call(fn, device, cfg.repeats, cfg.max_seconds)
                    gbps = moved / seconds / 1e9
                    cell[backend] = {"ms": seconds * 1e3, "calls": calls, "bytes": moved, "gbps": gbps,
                                     "peak_fraction": gbps / peak if peak else None}
                if on_gpu:
                    cell["speedup"] = cell["reference"]["ms"] / cell["triton"]["ms"]
                progress(f"{op:<7} rows {cell['rows']:>5} vocab {vocab:>6}: "
                         + ", ".join(f"{b} {cell[b]['ms']:.3f} ms ({cell[b]['gbps']:.1f} GB/s)" for b in backends))
                cells.append(cell)
                if partial:
                    partial(snapshot())
            del problem

    backend = "triton" if on_gpu else "reference"
    if cfg.step_shares:
        _step_shares(cfg, device, backend, shares, progress, lambda: partial(snapshot()) if partial else None)

    result = {
        "config": {**asdict(cfg), "device": str(device)},
        "environment": {**environment(device), "peak_gbps": peak, "triton": triton_available()},
        "kernels_timed": on_gpu,
        "step_backend": backend,
        "cells": cells,
        "step_shares": shares,
    }
    if not on_gpu:
        result["note"] = ("no CUDA device: only the PyTorch reference was timed; the Triton kernels were not timed"
                          + (" (their sm_80/sm_90 compile results are under 'compile')" if cfg.compile_check else ""))
        if cfg.compile_check and triton_available():
            progress("compiling every kernel configuration for sm_80 and sm_90 ...")
            result["compile"] = _compile_results(progress_bar)
    return result


def format_kernel_table(result: dict) -> str:
    """Fixed-width tables: per cell times, GB/s and speed-up; then the decoding-step shares."""
    timed = result["kernels_timed"]
    header = f"{'op':<7} {'rows':>5} {'vocab':>7} {'ref ms':>9} {'ref GB/s':>9}"
    if timed:
        header += f" {'triton ms':>10} {'GB/s':>8} {'% peak':>7} {'speedup':>8}"
    lines = [header, "-" * len(header)]
    for cell in result["cells"]:
        ref = cell["reference"]
        line = f"{cell['op']:<7} {cell['rows']:>5} {cell['vocab']:>7} {ref['ms']:>9.3f} {ref['gbps']:>9.2f}"
        if timed:
            tri = cell["triton"]
            frac = f"{100 * tri['peak_fraction']:.1f}" if tri["peak_fraction"] is not None else "-"
            line += f" {tri['ms']:>10.3f} {tri['gbps']:>8.1f} {frac:>7} {cell['speedup']:>8.2f}"
        lines.append(line)
    if result["step_shares"]:
        lines.append("")
        lines.append(f"decoding-step shares (verification on the {result['step_backend']} backend)")
        lines.append(f"{'model':<11} {'params':>8} {'rows':>5} {'vocab':>6} {'forward ms':>11} {'verify ms':>10} {'verify/fwd':>11}")
    for name, share in result["step_shares"].items():
        lines.append(f"{name:<11} {share['parameters'] / 1e6:>7.1f}M {share['rows']:>5} {share['vocab']:>6} "
                     f"{share['forward_ms']:>11.2f} {share['verify_ms']:>10.2f} {share['verify_over_forward']:>11.3f}")
    if "note" in result:
        lines += ["", result["note"]]
    if "compile" in result:
        lines.append(f"compile check: {result['compile']['summary']}")
        lines += result["compile"]["failures"]
    return "\n".join(lines)
