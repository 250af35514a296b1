"""``torch.compile`` for decode steps: one compiled callable per step function, shared by every decode.

A step is compiled with static shapes (``dynamic=False``): each (batch slots, padded window) pair is
its own graph, which is also what CUDA graphs need, so windows come from a small fixed set
(:func:`vispec.decoding.windows.window_set`). That is more graphs per step function than dynamo's
default recompile limit holds, so the limit is raised to :data:`RECOMPILE_LIMIT` while a compiled step
runs (``torch._dynamo.config.patch``) and only then: the process's own settings are left as they were.
Compiled steps read nothing back from the device; the decode loop does, once per step.

CUDA graphs (:func:`cuda_graphs`): within that context (this thread or task) steps are compiled with
``mode="reduce-overhead"``, inductor's CUDA-graph trees, a separate set of graphs per step function. Inductor
replays a step as one CUDA graph only where that is safe: on CUDA tensors, and where every graph input the step
writes in place is a *static input* (a parameter or buffer, a tensor marked with
``torch._dynamo.mark_static_address``, or an output of an earlier CUDA graph); otherwise it runs the compiled
kernels without a graph and counts a skip with the reason "mutated inputs"
(``torch._dynamo.utils.counters["inductor"]["cudagraph_skips"]``, read by :func:`cudagraph_skips`;
:func:`cudagraph_skip_reasons` keeps the reasons). On CPU every step is a skip.

The decode steps write in place into tensors that live for a whole decode: the model's KV cache (keys, values,
cached lengths; the state's ``persistent_tensors()``), the ragged batch's token buffer and per-slot commit counts,
and a lossy rule's TV sums. Within :func:`cuda_graphs` each decoder marks these once, when it allocates them
(:func:`mark_persistent`: ``mark_static_address(t, guard=False)``), so they are static inputs and the steps
replay; tensors a step builds anew (committed counts, draft distributions, window targets) are left unmarked,
since they are outputs of the previous step's graph or copied into the graph's own input buffers. The ones a
decode keeps past the step, and what the step returns, are copied out of the graph's output pool right after it
(:func:`own_graph_outputs`): a later replay, of this graph or another, may overwrite that pool. The marks
are *unguarded*: dynamo does not recompile when a marked tensor's address changes, the CUDA-graph tree
re-records the graph instead. A new decode allocates new buffers, so each step graph is recorded once more per
decode (and when a batch drops finished slots, a new shape: a new graph anyway); within a decode, steps replay.
Outside :func:`cuda_graphs` nothing is marked and compiled steps are exactly as in the default mode.
tests/decoding/test_cuda_graph_inputs.py runs inductor's mutation check on CPU: the AR, SJD and MC-SJD step graphs
(SJD-PAC's too) mutate static inputs only. Not so the lossy acceptance rules' steps (compiled without ``fullgraph``,
they break their graph, and two of the pieces write into tensors made earlier in the same step: the residual
tokens and the next draft distributions): those pieces still run without a CUDA graph.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import logging
from typing import Any, Callable, Iterator, Optional

import torch
from torch import Tensor

RECOMPILE_LIMIT = 64

CUDA_GRAPHS_MODE = "reduce-overhead"

#: inductor options of steps compiled for the CPU (:func:`compiled`): the C++ wrapper
CPU_OPTIONS = {"cpp_wrapper": True}

_graphs: dict[tuple[Callable, bool, str], Callable] = {}  # one compiled callable per (step, fullgraph, mode)
_outside_mode = contextvars.ContextVar("vispec_compiled_steps_outside_mode", default=False)
_cuda_graphs = contextvars.ContextVar("vispec_compiled_steps_cuda_graphs", default=False)
SKIP_REASONS_KEPT = 32
_skip_reasons: list[str] = []  # cudagraph_skip_reasons()
_skip_handler: Optional[logging.Handler] = None


def compile_mode() -> str:
    """The ``torch.compile`` mode steps compiled now get: ``"default"``, or :data:`CUDA_GRAPHS_MODE` within
    :func:`cuda_graphs`."""
    return CUDA_GRAPHS_MODE if _cuda_graphs.get() else "default"


@contextlib.contextmanager
def cuda_graphs(enabled: bool = True) -> Iterator[None]:
    """Within this context (this thread or task only), steps are compiled and run with ``mode="reduce-overhead"``
    (CUDA graphs, module docstring); ``enabled=False`` leaves the mode as it is outside."""
    if enabled:
        _record_skip_reasons()
    token = _cuda_graphs.set(bool(enabled) or _cuda_graphs.get())
    try:
        yield
    finally:
        _cuda_graphs.reset(token)


def cudagraph_skips() -> int:
    """Compiled graphs inductor has run without a CUDA graph so far in this process (module docstring)."""
    from torch._dynamo.utils import counters

    return int(counters["inductor"]["cudagraph_skips"])


def persistent_tensors(*items: Any) -> list[Tensor]:
    """The tensors of ``items`` that a decode keeps (and its steps may write in place): a tensor itself; a decode
    state's ``persistent_tensors()`` where it has that method; else every tensor it holds in its fields, in lists,
    tuples and dicts, and in plain objects it holds (e.g. a cache object), modules excepted. Each tensor once."""
    found: dict[int, Tensor] = {}
    seen: set[int] = set()

    def visit(item: Any) -> None:
        if item is None or id(item) in seen or isinstance(item, (torch.nn.Module, str, bytes, int, float, bool)):
            return
        seen.add(id(item))
        if isinstance(item, Tensor):
            found.setdefault(id(item), item)
        elif callable(getattr(item, "persistent_tensors", None)):
            for tensor in item.persistent_tensors():
                visit(tensor)
        elif isinstance(item, (list, tuple)):
            for value in item:
                visit(value)
        elif isinstance(item, dict):
            for value in item.values():
                visit(value)
        elif dataclasses.is_dataclass(item) or hasattr(item, "__dict__"):
            for value in vars(item).values():
                visit(value)

    for item in items:
        visit(item)
    return list(found.values())


def mark_persistent(*items: Any) -> None:
    """Within :func:`cuda_graphs`: mark the :func:`persistent_tensors` of ``items`` as static inputs of compiled steps
    (``torch._dynamo.mark_static_address(t, guard=False)``; module docstring), so steps that write them in place
    replay as CUDA graphs. Call it once per tensor, where a decode allocates it, and never for a tensor made anew
    each step (its address changes every step: the graph would be re-recorded every step). Outside
    :func:`cuda_graphs` it does nothing."""
    if not _cuda_graphs.get():
        return
    for tensor in persistent_tensors(*items):
        torch._dynamo.mark_static_address(tensor, guard=False)


def cudagraph_skip_reasons() -> list[str]:
    """The distinct reasons inductor gave so far in this process for running a compiled graph without a CUDA graph,
    in the order first seen (each its first line: the stack trace after it is dropped; at most
    :data:`SKIP_REASONS_KEPT`). Recorded from the first :func:`cuda_graphs` context on; inductor logs reasons for CUDA
    graphs only (on CPU, :func:`cudagraph_skips` counts skips and no reason is given)."""
    return list(_skip_reasons)


class _SkipReasons(logging.Handler):
    """Keeps inductor's CUDA-graph skip messages (its ``cudagraphs`` log) in :data:`_skip_reasons`."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            lines = record.getMessage().strip().splitlines()
        except Exception:  # a malformed record must not break a decode
            return
        if lines and lines[0] not in _skip_reasons and len(_skip_reasons) < SKIP_REASONS_KEPT:
            _skip_reasons.append(lines[0])


def _record_skip_reasons() -> None:
    global _skip_handler
    if _skip_handler is None:
        from torch._inductor import cudagraph_utils

        _skip_handler = _SkipReasons(level=logging.WARNING)
        cudagraph_utils.cudagraphs_log.addHandler(_skip_handler)


def compiled(step: Callable, fullgraph: bool = True) -> Callable:
    """``step`` under ``torch.compile(fullgraph=fullgraph, dynamic=False)`` (within :func:`cuda_graphs`:
    ``mode="reduce-overhead"``), run with dynamo's recompile limit at least :data:`RECOMPILE_LIMIT`; the same
    callable for the same ``(step, fullgraph, mode)`` (one set of graphs).

    On CPU (the first tensor argument's device) and outside :func:`cuda_graphs` the graphs are compiled with
    inductor's C++ wrapper (:data:`CPU_OPTIONS`): the code that allocates buffers and calls the kernels of a step is
    C++, not Python. A tiny model's step is mostly that call overhead: on tiny-c2i at batch 1 the Python wrapper took
    ~0.57 ms of a ~4.8 ms AR step (``samples/ar_step_bench.py``). The kernels are the same, so are the outputs."""
    mode = compile_mode()
    key = (step, fullgraph, mode)
    if key not in _graphs:
        graphs: dict[bool, Callable] = {}  # on CPU (C++ wrapper) or not

        def graph_for(on_cpu: bool) -> Callable:
            if on_cpu not in graphs:
                options = dict(CPU_OPTIONS) if on_cpu and mode == "default" else None
                graphs[on_cpu] = torch.compile(step, fullgraph=fullgraph, dynamic=False,
                                               mode=None if mode == "default" else mode, options=options)
            return graphs[on_cpu]

        def call(args: tuple, kwargs: dict) -> Any:
            graph = graph_for(_on_cpu(args))
            if fullgraph and _outside_mode.get():
                with torch.overrides._pop_mode_temporarily():
                    result = graph(*args, **kwargs)
            else:
                result = graph(*args, **kwargs)
            if mode == CUDA_GRAPHS_MODE:  # nothing a graph wrote outlives the call inside its pool
                own_graph_outputs(args)
                result = _copied(result)
            return result

        def run(*args: Any, **kwargs: Any) -> Any:
            # the limit raised for this call only, as config.patch would, but set and restored directly: the patch
            # context costs ~35 us per call on CPU, this ~7 us (samples/ar_step_bench.py)
            config = torch._dynamo.config
            limit = config.recompile_limit
            if limit >= RECOMPILE_LIMIT:
                return call(args, kwargs)
            config.recompile_limit = RECOMPILE_LIMIT
            try:
                return call(args, kwargs)
            finally:
                config.recompile_limit = limit

        _graphs[key] = run
    return _graphs[key]


def own_graph_outputs(args: tuple) -> None:
    """After a step replayed as a CUDA graph: the arguments that keep tensors the step made anew (a ragged batch's
    committed counts and per-decode state: objects with an ``own_graph_outputs()`` method) copy them out of the
    graph's output pool.

    A CUDA-graph tree writes a graph's outputs into the same memory at every replay, and when the decode switches
    between step graphs (a one-row pass, a window, a tree) it may start a new generation of the tree, after which
    every earlier output may be overwritten. A decode keeps some outputs for several steps (e.g. a count only the
    one-row step updates), so without the copy a later step reads one that another replay has overwritten (on an
    H200, 2026-12-04: "accessing tensor output of CUDAGraphs that has been overwritten by a subsequent run" in the
    first MC-SJD calibration). What a step returns is copied too (:func:`_copied`): AR's next position and status
    go into the next step, as gpt-fast's decode loop clones the token it feeds back."""
    for arg in args:
        own = getattr(arg, "own_graph_outputs", None)
        if callable(own) and not isinstance(arg, type):
            own()


def _copied(result: Any) -> Any:
    """A step's return value with its tensors cloned (a tensor, or a tuple or list of them and other values)."""
    if isinstance(result, Tensor):
        return result.clone()
    if isinstance(result, (tuple, list)):
        return type(result)(value.clone() if isinstance(value, Tensor) else value for value in result)
    return result


def _on_cpu(args: tuple) -> bool:
    """Whether a step's first tensor argument lives on the CPU (steps take the model first, then tensors)."""
    for arg in args:
        if isinstance(arg, Tensor):
            return arg.device.type == "cpu"
    return True


@contextlib.contextmanager
def outside_torch_function_mode() -> Iterator[None]:
    """Within this context (this thread or task only), ``fullgraph`` compiled steps run with the innermost
    torch-function mode suspended.

    For counting host syncs (:class:`vispec.profiling.HostSyncCounter` is such a mode): dynamo guards on
    the mode stack, so a compiled step called under the counter would recompile every step graph once
    more only to find what ``fullgraph=True`` already guarantees (no graph break, so nothing read back).
    Steps compiled without ``fullgraph`` (lossy acceptance rules) may break their graph, so they stay
    under the mode (counted, and recompiled)."""
    token = _outside_mode.set(True)
    try:
        yield
    finally:
        _outside_mode.reset(token)


_announced: set = set()


def compiled_before(key: Any) -> bool:
    """Whether :func:`announce_compile` was called with ``key`` in this process (its graph was compiled)."""
    return key in _announced


def announce_compile(what: str, key: Any) -> None:
    """Say once per process, on stderr, that ``what`` is about to be compiled for the first time (``key``: what makes
    a graph new, e.g. the step, the batch slots and the shape), so a first call that spends minutes compiling is
    not silent."""
    if key in _announced:
        return
    _announced.add(key)
    import sys

    print(f"vispec: compiling {what} (once per shape in this process; later calls reuse it)", file=sys.stderr, flush=True)
