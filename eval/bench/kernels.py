"""``vispec bench kernels``: the verification and unmasking kernels against their PyTorch references.

For every ``rows x vocab`` cell it times two operations on random logits, each the call a decoder makes:

* ``verify``: one SJD verification step from raw logits with fused classifier-free guidance, as
  :func:`vispec.decoding.sjd.sjd_step` runs it (:class:`VerifyProblem`: :func:`~vispec.kernels.target.window_target`
  with ``validate=False`` and :func:`~vispec.decoding.speculative.verify_window`): acceptance of dense drafts
  (windows of ``window`` rows per sample), the first rejection per sample, the residual sample there, fresh
  samples after it and the stored ``p`` rows that become the next drafts;
* ``unmask``: dLLM unmasking statistics (:func:`vispec.kernels.unmask.unmask_candidates`, ``validate=False``) at
  temperature 1 with in-kernel float64 Philox noise.

The timed calls read nothing back from the device (the bytes a pass moved are counted from its result afterwards).

Reported per cell and backend: time (median of wall-clock repeats, each ended by a device synchronisation), the
bytes the kernels must move (each logits row read once per pass that needs it, plus stored rows) and the
achieved GB/s against the device's peak, the kernel's speed-up over the reference, and what one call costs
besides the kernels' own work (:func:`count_per_call`: host syncs, ATen operators called from Python, Triton
launches). Per operation and backend, a least-squares fit ``time = a + bytes / b`` over the run's cells
(:func:`fit_overhead`) separates the fixed per-call cost ``a`` (``overhead_us``: Python and dispatch work,
launches, allocations) from the bandwidth ``b`` the time approaches on large problems (``asymptotic_gbps``):
a flat time across sizes is fixed cost, not a slow kernel. Two
decoding-step shares put the verification in context: a tiny-c2i window forward and a
LlamaGen-B-sized (111M parameters, randomly initialised) window forward, each against the
verification of its own logits.

``step_shares=False`` leaves the shares out (``vispec bench decoders --kernels`` runs this bench at its own
model's vocabulary without them). Without CUDA only the reference is timed; the JSON says so (``"kernels_timed": false``) and the
kernels' compile results for sm_80/sm_90 are reported instead (:mod:`vispec.kernels.compile_check`).
"""

from __future__ import annotations

import contextlib
import os
import statistics
import subprocess
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Callable, Optional

import torch

from vispec.eval.bench.report import check_device, environment
from vispec.eval.bench.configs import KernelBenchConfig  # noqa: F401 - re-exported
from vispec.kernels.backend import triton_available
from vispec.decoding.acceptance import AcceptanceRule
from vispec.decoding.speculative import JACOBI, verify_window
from vispec.kernels.target import window_target
from vispec.kernels.unmask import RowNoise, unmask_candidates
from vispec.profiling import HostSyncCounter
from vispec.sampling import SamplingConfig

_EXACT = AcceptanceRule()  # the exact rule: verify_window sends it straight to the target's kernels

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
    """One SJD verification pass over ``B`` windows of ``W`` rows, with the inputs a decoder holds before it verifies.

    Sample ``b``'s window row ``j`` predicts position ``j + 1`` and verifies draft ``j + 1`` (``W - 1`` drafts, each
    with a dense ``q`` row; the last row gives the bonus token). :meth:`step` is the part that is timed: what
    :func:`vispec.decoding.sjd.sjd_step` runs from the window's logits on, :func:`~vispec.kernels.target.window_target`
    with ``validate=False`` and :func:`~vispec.decoding.speculative.verify_window` with the exact rule and SJD's
    coupling (acceptance, first rejection, the residual sample there, fresh samples after it and the stored ``p``
    rows that become the next drafts). Nothing in it reads a value back: the bytes moved are counted afterwards
    from its result (:meth:`bytes_moved`).
    """

    cond: torch.Tensor  # [B, W, V]
    uncond: torch.Tensor  # [B, W, V]
    positions: torch.Tensor  # [B, W] the position each row predicts
    drafts: torch.Tensor  # [B, W] draft j + 1 at row j, -1 on the last row
    num_drafts: torch.Tensor  # [B] W - 1
    width: torch.Tensor  # [B] W
    draws: torch.Tensor  # [B] the pass's noise draw
    q: torch.Tensor  # [B, W - 1, V] dense draft distributions
    q_dense: torch.Tensor  # [B, W] bool: the row's draft has a dense q
    next_q: torch.Tensor  # [B, W - 1, V] where the pass stores the next drafts' q
    seeds: torch.Tensor  # [B]
    sampling: SamplingConfig

    @classmethod
    def from_logits(cls, cond: torch.Tensor, uncond: torch.Tensor, sampling: SamplingConfig,
                    seed: int = 0) -> "VerifyProblem":
        """Random drafts and draft distributions for window logits ``cond``, ``uncond [B, W, V]``."""
        batch, width, vocab = cond.shape
        device = cond.device
        gen = torch.Generator(device=device).manual_seed(seed)
        slot = torch.arange(width, device=device)
        drafts = torch.randint(0, vocab, (batch, width), device=device, generator=gen)
        drafts = torch.where(slot < width - 1, drafts, torch.full_like(drafts, -1))  # last row of a window: bonus
        q = torch.softmax(torch.randn(batch, max(width - 1, 1), vocab, device=device, generator=gen), -1)
        return cls(cond, uncond, (slot + 1).expand(batch, width).contiguous(), drafts,
                   torch.full((batch,), width - 1, device=device), torch.full((batch,), width, device=device),
                   torch.ones(batch, dtype=torch.long, device=device), q, (slot < width - 1).expand(batch, width).contiguous(),
                   torch.empty_like(q), torch.arange(batch, device=device) + 1, sampling)

    @classmethod
    def make(cls, rows: int, vocab: int, window: int, guidance_scale: float, dtype: torch.dtype, device: torch.device,
             seed: int = 0) -> "VerifyProblem":
        """``rows // window`` windows (one of ``rows`` rows when ``rows < window``) of random logits."""
        gen = torch.Generator(device=device).manual_seed(seed)
        width = min(window, rows)
        batch = max(rows // width, 1)
        cond = (torch.randn(batch, width, vocab, device=device, generator=gen) * 2.0).to(dtype)
        uncond = (torch.randn(batch, width, vocab, device=device, generator=gen) * 2.0).to(dtype)
        return cls.from_logits(cond, uncond, SamplingConfig(guidance_scale=guidance_scale), seed + 1)

    @property
    def rows(self) -> int:
        return self.cond.shape[0] * self.cond.shape[1]

    def step(self, backend: str):
        """One verification pass as SJD runs it (class docstring); returns its
        :class:`~vispec.decoding.speculative.Verified`."""
        target = window_target(self.cond, self.uncond, self.positions, self.width, self.seeds, self.sampling,
                               backend=backend, validate=False)
        return verify_window(target, _EXACT, self.drafts, self.num_drafts, self.width, self.draws, JACOBI, q=self.q,
                             q_dense=self.q_dense, store_q=self.next_q)

    def bytes_moved(self, verified) -> int:
        """Bytes the kernels must move in the pass that gave ``verified`` (read back here, after timing): the logits
        rows (both halves under guidance) once for acceptance and again for every row that samples or is stored, the
        dense ``q`` row of every residual row, and the stored ``p`` rows (float32)."""
        batch, width, vocab = self.cond.shape
        slot = torch.arange(width, device=self.cond.device)[None, :]
        m = verified.num_accepted[:, None]
        is_draft = slot < self.num_drafts[:, None]
        residual = is_draft & (slot == m)
        all_accepted = m == self.num_drafts[:, None]
        fresh = (slot >= torch.where(all_accepted, m, m + 1)) & (slot < self.width[:, None])
        stored = (slot > m) & (slot < self.width[:, None])
        logit_row = (2 if self.sampling.uses_guidance else 1) * vocab * self.cond.element_size()
        resampled = int((residual | fresh | stored).sum())
        return (batch * width * logit_row + resampled * logit_row + int((residual & self.q_dense).sum()) * vocab * 4
                + int(stored.sum()) * vocab * 4)


class _Syncs(HostSyncCounter):
    """:class:`~vispec.profiling.HostSyncCounter` that ignores what runs while ``paused`` (inside a Triton launch)."""

    paused = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if self.paused:
            return func(*args, **(kwargs or {}))
        return super().__torch_function__(func, types, args, kwargs)


_LAUNCH_RANGE = "vispec::triton_launch"


@contextlib.contextmanager
def _counted_launches(syncs: _Syncs, launches: list):
    """Count Triton launches (compiled or interpreted) and mark each as a profiler range, syncs paused inside it:
    what the interpreter does to run a kernel on the CPU is the kernel's work, not the caller's."""
    if not triton_available():
        yield
        return
    from triton.runtime import interpreter, jit

    classes = [cls for cls in (jit.JITFunction, getattr(interpreter, "InterpretedFunction", None)) if cls is not None]
    originals = {cls: cls.run for cls in classes}

    def wrap(original):
        def run(self, *args, **kwargs):
            if kwargs.get("warmup"):
                return original(self, *args, **kwargs)
            launches.append(getattr(self, "__name__", None) or getattr(getattr(self, "fn", None), "__name__", "?"))
            syncs.paused = True
            try:
                with torch.profiler.record_function(_LAUNCH_RANGE):
                    return original(self, *args, **kwargs)
            finally:
                syncs.paused = False
        return run

    for cls in classes:
        cls.run = wrap(originals[cls])
    try:
        yield
    finally:
        for cls, original in originals.items():
            cls.run = original


def count_per_call(fn: Callable[[], object]) -> dict:
    """What one call of ``fn`` costs besides the kernels' own work (run it once before, to warm caches up):

    * ``host_syncs``: values read back from the device (:class:`~vispec.profiling.HostSyncCounter`);
    * ``aten_ops``: ATen operators called from Python (``torch.profiler`` events with no ATen operator or Triton
      launch around them), each a dispatcher round trip and, on CUDA, mostly a kernel launch or an allocation;
    * ``triton_launches``: Triton kernel launches (``triton_kernels``: their names, in order).

    ``aten_op_names`` counts the ATen operators by name.
    """
    from torch.profiler import ProfilerActivity, profile

    syncs, launches = _Syncs(), []
    with profile(activities=[ProfilerActivity.CPU]) as prof, _counted_launches(syncs, launches), syncs:
        fn()
    events = prof.events()

    def called_from_python(event) -> bool:
        parent = event.cpu_parent
        while parent is not None:
            if parent.name.startswith("aten::") or parent.name == _LAUNCH_RANGE:
                return False
            parent = parent.cpu_parent
        return True

    names = Counter(event.name for event in events if event.name.startswith("aten::") and called_from_python(event))
    return {"host_syncs": syncs.total, "aten_ops": sum(names.values()), "triton_launches": len(launches),
            "triton_kernels": launches, "aten_op_names": dict(names)}


def fit_overhead(moved: list[float], seconds: list[float]) -> dict:
    """Least-squares fit ``seconds = a + moved / b`` over the cells of a run: the fixed per-call cost ``a``
    (``overhead_us``) and the bandwidth ``b`` the time approaches for large problems (``asymptotic_gbps``).

    Both terms are costs, so the fit is non-negative least squares: where the unconstrained optimum has ``a < 0``
    (time growing faster than linearly in the bytes, e.g. a compute-bound reference on the CPU) the best fit with
    ``a >= 0`` is the line through the origin, and where its slope ``1 / b`` is not positive (time not growing with
    the bytes: fixed cost only, at these sizes) the best fit is the mean time with no bandwidth term
    (``asymptotic_gbps`` None). ``bound`` names the constraint that is active (``"overhead"``, ``"bandwidth"``,
    else None), so a clamped value is never mistaken for a measured one. With fewer than two distinct byte counts
    there is nothing to fit (both None)."""
    points = len(moved)
    if points != len(seconds):
        raise ValueError(f"moved and seconds must have the same length, got {points} and {len(seconds)}")
    if len(set(moved)) < 2:
        return {"overhead_us": None, "asymptotic_gbps": None, "points": points, "bound": None}
    mean_x, mean_y = sum(moved) / points, sum(seconds) / points
    slope = (sum((x - mean_x) * (y - mean_y) for x, y in zip(moved, seconds))
             / sum((x - mean_x) ** 2 for x in moved))
    intercept, bound = mean_y - slope * mean_x, None
    if slope <= 0:
        intercept, slope, bound = mean_y, 0.0, "bandwidth"
    elif intercept < 0:
        slope = sum(x * y for x, y in zip(moved, seconds)) / sum(x * x for x in moved)
        intercept, bound = 0.0, "overhead"
    return {"overhead_us": intercept * 1e6, "asymptotic_gbps": 1.0 / slope / 1e9 if slope > 0 else None,
            "points": points, "bound": bound}


def _fits(cells: list[dict], backends: tuple[str, ...], peak: Optional[float]) -> list[dict]:
    """:func:`fit_overhead` per operation and backend over ``cells``, with the last cell's per-call counts."""
    fits = []
    for op in dict.fromkeys(cell["op"] for cell in cells):
        for backend in backends:
            runs = [cell[backend] for cell in cells if cell["op"] == op and backend in cell]
            if not runs:
                continue
            fit = fit_overhead([run["bytes"] for run in runs], [run["ms"] / 1e3 for run in runs])
            gbps = fit["asymptotic_gbps"]
            fits.append({"op": op, "backend": backend, **fit,
                         "asymptotic_peak_fraction": gbps / peak if gbps is not None and peak else None,
                         **{key: runs[-1][key] for key in ("host_syncs", "aten_ops", "triton_launches")}})
    return fits


def _unmask_op(logits: torch.Tensor, backend: str) -> Callable[[], object]:
    rows = logits.shape[0]
    noise = RowNoise(torch.arange(rows, device=logits.device) + 1, torch.arange(rows, device=logits.device),
                     torch.zeros(rows, dtype=torch.long, device=logits.device))
    return lambda: unmask_candidates(logits, 1.0, noise=noise, backend=backend, validate=False)


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


def _forward_share(model, batch: int, window: int, context: int, sampling: SamplingConfig, backend: str,
                   device: torch.device, cfg: KernelBenchConfig) -> dict:
    """Time a window forward of ``model`` (with CFG) at ``context`` cached tokens against the verification of its
    logits (:meth:`VerifyProblem.step`, drafts and their ``q`` made once beforehand)."""
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
        problem = VerifyProblem.from_logits(out.cond, out.uncond, sampling, cfg.seed)
        verify_s, _ = time_call(lambda: problem.step(backend), device, cfg.repeats, cfg.max_seconds)
    return {"batch": batch, "window": window, "context": context, "rows": batch * window, "vocab": vocab,
            "parameters": sum(p.numel() for p in model.parameters()), "forward_ms": forward_s * 1e3,
            "verify_ms": verify_s * 1e3, "verify_share_of_step": verify_s / (forward_s + verify_s),
            "verify_over_forward": verify_s / forward_s}


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
    shares["tiny-c2i"] = _forward_share(tiny, step_batch, cfg.window, 128, sampling, backend, device, cfg)
    progress(f"tiny-c2i step: forward {shares['tiny-c2i']['forward_ms']:.2f} ms, verify {shares['tiny-c2i']['verify_ms']:.2f} ms")
    report()
    torch.manual_seed(cfg.seed)
    base = LlamaGenGPT(vocab_size=16384, dim=768, n_layer=12, n_head=12, num_classes=1000, block_size=256,
                       class_dropout_prob=0.1).to(device).eval()
    shares["llamagen-b"] = _forward_share(base, step_batch, cfg.window, 128, sampling, backend, device, cfg)
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
                "kernels_timed": on_gpu, "cells": list(cells), "fits": _fits(cells, backends, peak),
                "step_shares": dict(shares)}

    for vocab in cfg.vocab:
        for rows in cfg.rows:
            problem = VerifyProblem.make(rows, vocab, cfg.window, cfg.guidance_scale, dtype, device, cfg.seed)
            for op in cfg.ops:
                cell = {"op": op, "rows": problem.rows, "vocab": vocab}
                for backend in backends:
                    if op == "verify":
                        fn = lambda b=backend, p=problem: p.step(b)  # noqa: E731
                        moved = problem.bytes_moved(fn())  # untimed: the timed calls read nothing back
                    else:
                        logits = problem.cond.reshape(problem.rows, vocab)
                        moved = logits.numel() * logits.element_size()
                        fn = _unmask_op(logits, backend)
                    seconds, calls = time_call(fn, device, cfg.repeats, cfg.max_seconds)
                    gbps = moved / seconds / 1e9
                    counts = count_per_call(fn)  # after the timed calls: every cache warm
                    del counts["triton_kernels"], counts["aten_op_names"]
                    cell[backend] = {"ms": seconds * 1e3, "calls": calls, "bytes": moved, "gbps": gbps,
                                     "peak_fraction": gbps / peak if peak else None, **counts}
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
        "fits": _fits(cells, backends, peak),
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
    """Fixed-width tables: per cell times, GB/s and speed-up; the fixed per-call cost and asymptotic bandwidth per
    operation and backend (:func:`fit_overhead`) with the per-call counts; then the decoding-step shares."""
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
    if result.get("fits"):
        lines.append("")
        lines.append("fixed cost per call and bandwidth: time = overhead + bytes / asymptotic GB/s (least squares over "
                     "the cells); per call: host syncs, ATen ops, Triton launches")
        fit_header = (f"{'op':<7} {'backend':<10} {'overhead us':>12} {'asym GB/s':>10} {'% peak':>7} {'syncs':>6} "
                      f"{'aten ops':>9} {'launches':>9}")
        lines += [fit_header, "-" * len(fit_header)]
        for fit in result["fits"]:
            overhead = f"{fit['overhead_us']:.1f}" if fit["overhead_us"] is not None else "-"
            if fit.get("bound") == "overhead":
                overhead += "*"
            gbps = f"{fit['asymptotic_gbps']:.1f}" if fit["asymptotic_gbps"] is not None else "-"
            frac = f"{100 * fit['asymptotic_peak_fraction']:.1f}" if fit["asymptotic_peak_fraction"] is not None else "-"
            lines.append(f"{fit['op']:<7} {fit['backend']:<10} {overhead:>12} {gbps:>10} {frac:>7} {fit['host_syncs']:>6} "
                         f"{fit['aten_ops']:>9} {fit['triton_launches']:>9}")
        bounds = {fit.get("bound") for fit in result["fits"]}
        if "overhead" in bounds:
            lines.append("* at the fit's bound: time grows faster than linearly in the bytes here, so the best fit with a "
                         "non-negative overhead passes through 0")
        if "bandwidth" in bounds:
            lines.append("- GB/s: time does not grow with the bytes at these sizes (fixed cost only)")
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
