"""Keyed exponential race on CPU with the Philox noise compiled: bit-identical to the eager composition.

Sampling from unnormalised weights ``w`` is the exponential race ``argmax_v w_v / E_v`` with
``E_v = -log(u_v) ~ Exp(1)`` i.i.d.: ``P[v] = w_v / Σ w`` (the Gumbel-max trick on ``log w``, as
``-log E_v`` is standard Gumbel). The uniforms are counter-based Philox4x32-10 (Salmon et al.,
"Parallel random numbers: as easy as 1, 2, 3", SC 2011) keyed by ``(seed; c0 = v // 4, position,
stream, draw)``, entry ``v`` taking word ``v % 4`` (:mod:`vispec.kernels.philox`).

Eagerly, Philox is ten rounds of about a dozen int64 ops over ``[rows, V]``, each its own kernel
launch. Here:

1. ``_uniform_blocks``, compiled (inductor C++, ``dynamic=True``, lazily on first use): Philox inline,
   one evaluation per block of four entries, straight to ``u = ((word >> 9) + 1/2) / 2**23`` (exact) in a
   ``[rows, 4, blocks]`` float32 buffer (word-major: every store is contiguous; no int64 buffer is
   written).
2. ``torch.log_`` on that buffer, eagerly: inductor's vectorised ``log`` (SLEEF) rounds differently from
   eager's (MKL VML in x86 builds) on ~650k of the 2**23 possible ``u``, so the one transcendental is
   the very kernel :func:`~vispec.kernels.philox.exponentials` runs (elementwise, so the same values;
   pinned exhaustively by the tests).
3. The race, eagerly: ``argmin_v w_v / log u_v``. Since ``w / log u = -(w / E)`` exactly (IEEE division
   is sign-symmetric) and negation reverses the order, this is ``argmax_v w_v / E_v`` including ties
   (first index), signed zeros (equal) and NaN (both pick the first NaN), without a negation pass.
   (A compiled division + argmax was slower than these two eager ops: inductor's CPU argmax over the
   word-major layout is a scalar loop, and a second compiled call costs ~15 us of dynamo overhead.)

Exact integer Philox without int64 overflow (signed overflow is undefined behaviour in the C++ that
inductor generates): both round multipliers ``M`` exceed ``2**31``, so with ``m = M - 2**32`` (``|m| <
2**30``) and ``x < 2**32``, ``q = x * m`` fits in int64 and ``x * M = q + x * 2**32``; hence
``lo = q & (2**32 - 1)`` and ``hi = x + (q >> 32)`` (arithmetic shift = floor), ``0 <= hi < 2**32``. The
block index is masked before its first multiply so inductor keeps it a value: it would otherwise fold
``block * m`` into a vector ``arange`` whose ``int`` step overflows.

Which path runs is read when noise is drawn, never at import: :func:`set_fused` (``True``, ``False``, or
``None`` to defer to the environment; :func:`fused` scopes it to a ``with`` block), else ``VISPEC_FUSED_NOISE``
(``1`` / ``0``), else :data:`DEFAULT`. Non-CPU tensors (the Triton kernels cover CUDA), tracing under
``torch.compile`` and a failed compilation (warned once) run eagerly whatever the setting. Both paths give the
same bits, so the setting only moves time, and :data:`DEFAULT` is eager: in a fresh process the compile adds
17 to 23 CPU seconds to the first ``pipe(...)`` call with inductor's on-disk cache cold and 5 to 6 s with it
warm, on top of a 3 to 4 s call (tiny-c2i, tiny-t2i), while a later call saves between nothing and 0.7 s: a
dozen calls or more before it pays, if ever (``samples/first_image.py``; ``samples/first_image.txt``). Long runs
on CPU (benchmarks, large vocabularies) opt in with ``VISPEC_FUSED_NOISE=1`` or ``set_fused(True)``.

Compiled decode steps (:func:`race` while ``torch.compile`` traces, on any device) need neither path: the Philox words
are traced into the step's own graph (:func:`graph_uniforms`: step 1's overflow-free arithmetic, every operation
exact, so inductor's code gives the eager bits; pinned by the tests) and one opaque op, ``vispec::race_uniforms``, runs
the eager ``log`` and the race, whatever the setting. The acceptance uniforms (:func:`uniforms_for`), the rank
uniforms (:func:`words_for`) and the sibling and residual noise (:func:`exponentials_for`, whose ``log`` alone is an
opaque op, ``vispec::neg_log``) are drawn the same way. Before, the whole race was an opaque op that drew the noise eagerly
by default: ~330 extra ATen ops per AR step, 8-10% of tiny-c2i's compiled step on CPU (``samples/ar_step_bench.py``).
"""

from __future__ import annotations

import contextlib
import os
import warnings
from typing import Callable, Iterator, Optional, Union

import torch
from torch import Tensor

from vispec.kernels.philox import KEY_A, KEY_B, N_ROUNDS, ROUND_A, ROUND_B, exponentials, uniforms
from vispec.kernels.verify import sample_from_weights

ENV_VAR = "VISPEC_FUSED_NOISE"
_MASK32 = 0xFFFFFFFF
_M_A = ROUND_A - 2**32  # both multipliers have the top bit set: |m| < 2**30
_M_B = ROUND_B - 2**32
#: The path when neither :func:`set_fused` nor ``VISPEC_FUSED_NOISE`` says (module docstring).
DEFAULT = False
_SETTINGS = {"1": True, "true": True, "on": True, "yes": True, "0": False, "false": False, "off": False, "no": False}
_forced: Optional[bool] = None  # set_fused(); None: the environment decides
_failed = False  # a compilation failed: eager from then on
_compiled: dict[tuple[bool, int], Callable] = {}

Keys = Union[Tensor, int]


def set_fused(enabled: Optional[bool]) -> None:
    """Use the compiled path (``True``) or the eager one (``False``) on CPU; ``None`` defers again to
    ``VISPEC_FUSED_NOISE`` and :data:`DEFAULT`."""
    global _forced
    if enabled is not None and not isinstance(enabled, bool):
        raise ValueError(f"enabled must be True, False or None, got {enabled!r}")
    _forced = enabled


@contextlib.contextmanager
def fused(enabled: Optional[bool]) -> Iterator[None]:
    """:func:`set_fused` for the ``with`` block only (the previous setting comes back after it)."""
    previous = _forced
    set_fused(enabled)
    try:
        yield
    finally:
        set_fused(previous)


def _wanted() -> bool:
    """The setting: :func:`set_fused`, else ``VISPEC_FUSED_NOISE`` (read now), else :data:`DEFAULT`."""
    if _forced is not None:
        return _forced
    value = os.environ.get(ENV_VAR, "").strip().lower()
    if value and value not in _SETTINGS:
        raise ValueError(f"{ENV_VAR} must be one of {sorted(_SETTINGS)} (or unset), got {value!r}")
    return _SETTINGS[value] if value else DEFAULT


def fused_enabled() -> bool:
    """True while CPU calls take the compiled path (wanted, and no compilation failure so far)."""
    return _wanted() and not _failed


def _uniform_blocks(keys: Tensor, blocks: int) -> Tensor:
    """``[R, 4, blocks]`` float32: ``u[r, j, b]`` is word ``j`` of Philox4x32-10 with key ``keys[0, r]`` and
    counter ``(b, keys[1, r], keys[2, r], keys[3, r])`` (block, position, stream, draw), mapped to
    ``((word >> 9) + 1/2) / 2**23``. Compiled; also correct run eagerly."""
    seeds, positions, streams, draws = keys
    x0 = torch.arange(blocks, dtype=torch.int64, device=keys.device)[None, :] & _MASK32
    k0, k1 = (seeds & _MASK32)[:, None], ((seeds >> 32) & _MASK32)[:, None]
    x1, x2, x3 = ((c & _MASK32)[:, None] for c in (positions, streams, draws))
    for r in range(N_ROUNDS):
        q_b, q_a = x2 * _M_B, x0 * _M_A  # |q| < 2**62: no overflow
        x0, x2 = ((x2 + (q_b >> 32)) ^ x1 ^ ((k0 + r * KEY_A) & _MASK32),
                  (x0 + (q_a >> 32)) ^ x3 ^ ((k1 + r * KEY_B) & _MASK32))
        x1, x3 = q_b & _MASK32, q_a & _MASK32
    return torch.stack([((x >> 9).to(torch.float32) + 0.5) * (1.0 / 8388608.0) for x in (x0, x1, x2, x3)], dim=1)


def _compiled_uniforms() -> Callable:
    """The compiled :func:`_uniform_blocks`, traced on first use at sizes that are distinct and >= 2, so duck
    sizing and 0/1 specialisation add no guard a later shape could fail (callers keep rows and blocks
    >= 2). Dynamo guards on the inference mode and the thread count (global state), so each setting gets
    its own such trace (a cache hit in inductor after the first)."""
    state = (torch.is_inference_mode_enabled(), torch.get_num_threads())
    if state not in _compiled:
        # one thread: the kernel is cheap next to the eager log, and the code (so inductor's cache entry)
        # then does not depend on torch's thread count
        compiled = torch.compile(_uniform_blocks, dynamic=True, fullgraph=True, options={"cpp.threads": 1})
        compiled(torch.zeros(4, 3, dtype=torch.int64), 5)
        _compiled[state] = compiled
    return _compiled[state]


def _rows(x: Keys, rows: int, device: torch.device) -> Tensor:
    """``[rows]`` int64 (a Python int or a one-element tensor is broadcast)."""
    if not isinstance(x, Tensor):
        return torch.full((rows,), int(x), dtype=torch.int64, device=device)
    x = x.to(device=device, dtype=torch.int64).reshape(-1)
    return x.expand(rows) if x.numel() == 1 else x


def _keys(seeds: Tensor, positions: Keys, streams: Keys, draws: Keys) -> Tensor:
    """``[4, R]`` int64 ``(seeds, positions, streams, draws)``, a fresh tensor (views as inputs would add guards)."""
    rows = seeds.shape[0]
    keys = [x if isinstance(x, Tensor) and x.dtype == torch.int64 and x.shape == (rows,) else _rows(x, rows, seeds.device)
            for x in (seeds, positions, streams, draws)]
    if any(k.shape != (rows,) for k in keys):
        shapes = [tuple(k.shape) for k in keys[1:]]
        raise ValueError(f"positions, streams and draws need one value per row ({rows}), got shapes {shapes}")
    return torch.stack(keys)


def _log_in_vocab_order(u: Tensor, rows: int, vocab: int) -> Tensor:
    """``log`` in place (eager) on a ``[>= R, 4, >= ceil(V / 4)]`` uniform buffer; ``[R, V]`` in vocabulary
    order (entry ``v`` is ``u[r, v % 4, v // 4]``)."""
    blocks = (vocab + 3) // 4
    log_u = torch.log_(u) if u.shape[0] == rows and u.shape[2] == blocks else torch.log_(u)[:rows, :, :blocks]
    log_u = log_u.transpose(1, 2).reshape(rows, 4 * blocks)
    return log_u if vocab == 4 * blocks else log_u[:, :vocab]


def _log_uniforms(keys: Tensor, vocab: int) -> Tensor:
    """``[R, V]`` float32 ``log u``: the uniforms compiled, then :func:`_log_in_vocab_order`."""
    rows = keys.shape[1]
    with torch.no_grad():
        u = _compiled_uniforms()(keys if rows > 1 else keys.repeat(1, 2), max((vocab + 3) // 4, 2))
    return _log_in_vocab_order(u, rows, vocab)


def _fused(run: Callable[[], Tensor], eager: Callable[[], Tensor]) -> Tensor:
    """``run()``; if it fails (no C++ compiler, inductor error), warn once, switch the fused path off and
    return ``eager()``, the specification."""
    global _failed
    try:
        return run()
    except Exception as error:  # noqa: BLE001 - any failure of the compiled path falls back
        _failed = True
        warnings.warn(f"vispec.kernels.race: compiled Philox noise failed ({type(error).__name__}: {error}); "
                      "using the eager exponential race", RuntimeWarning, stacklevel=3)
        return eager()


def _use_fused(*tensors: Tensor) -> bool:
    return (all(t.device.type == "cpu" for t in tensors) and not torch.compiler.is_compiling()
            and fused_enabled())


def eager_exponentials(seeds: Tensor, positions: Keys, streams: Keys, draws: Keys, vocab: int) -> Tensor:
    """The specification: row ``r`` is ``exponentials(seeds[r:r+1], positions[r].view(1, 1), streams[r],
    draws[r].view(1), V)[0, 0]`` (one batched call; counter-based noise does not depend on the batch)."""
    rows, device = seeds.shape[0], seeds.device
    positions, streams, draws = (_rows(x, rows, device) for x in (positions, streams, draws))
    return exponentials(seeds, positions[:, None], streams[:, None], draws, vocab)[:, 0]


def keyed_exponentials(seeds: Tensor, positions: Keys, streams: Keys, draws: Keys, vocab: int) -> Tensor:
    """``[R, V]`` float32 Exp(1) noise, row ``r`` keyed by ``(seeds[r]; positions[r], streams[r], draws[r])``:
    bit-identical to :func:`eager_exponentials`. ``seeds`` is ``[R]`` int64, the other keys ``[R]`` integer
    tensors (or one value for every row)."""
    if not _use_fused(seeds) or seeds.shape[0] == 0 or vocab < 1:
        return eager_exponentials(seeds, positions, streams, draws, vocab)
    keys = _keys(seeds, positions, streams, draws)
    return _fused(lambda: _log_uniforms(keys, vocab).neg(), lambda: eager_exponentials(seeds, positions, streams, draws, vocab))


def keyed_uniforms(seeds: Tensor, positions: Keys, streams: Keys, draws: Keys) -> Tensor:
    """``[R]`` float32 uniforms (word 0 of the block ``c0 = 0``): bit-identical to ``uniforms(seeds,
    positions[:, None], stream, draws)[:, 0]``, e.g. the acceptance uniforms (``Stream.ACCEPT``)."""
    rows = seeds.shape[0]

    def eager() -> Tensor:
        positions_, streams_, draws_ = (_rows(x, rows, seeds.device) for x in (positions, streams, draws))
        return uniforms(seeds, positions_[:, None], streams_[:, None], draws_)[:, 0]

    if not _use_fused(seeds) or rows == 0:
        return eager()
    keys = _keys(seeds, positions, streams, draws)

    def run() -> Tensor:
        with torch.no_grad():
            return _compiled_uniforms()(keys if rows > 1 else keys.repeat(1, 2), 2)[:rows, 0, 0]

    return _fused(run, eager)


def keyed_race(weights: Tensor, seeds: Tensor, positions: Keys, streams: Keys, draws: Keys) -> Tensor:
    """``[R]`` int64 exponential-race samples ``argmax_v weights[r, v] / E[r, v]``, ``E = keyed_exponentials``.

    Bit-identical to ``sample_from_weights(weights, E)`` (:mod:`vispec.kernels.verify`): weights other than
    float64 race in float32, float64 weights divide by ``E`` promoted to float64; ties go to the first
    maximal index, zero weights never beat positive ones, an all-zero row gives 0, a NaN weight wins.
    """
    if weights.dim() != 2 or weights.shape[0] != seeds.shape[0]:
        raise ValueError(f"weights must be [rows, vocab] with one row per seed ({seeds.shape[0]}), got {tuple(weights.shape)}")
    rows, vocab = weights.shape

    def eager() -> Tensor:
        return sample_from_weights(weights, eager_exponentials(seeds, positions, streams, draws, vocab))

    if not _use_fused(weights, seeds) or rows == 0 or vocab == 0:
        return eager()
    keys = _keys(seeds, positions, streams, draws)
    w = weights if weights.dtype in (torch.float32, torch.float64) else weights.to(torch.float32)
    return _fused(lambda: torch.div(w, _log_uniforms(keys, vocab)).argmin(dim=-1), eager)


def warmup() -> bool:
    """Compile now (for the current inference mode and thread count) instead of on first use, if the fused path
    is wanted; returns :func:`fused_enabled`. First use costs the ``torch.compile`` start-up: a few seconds with
    inductor's on-disk cache warm, longer the first time on a machine."""
    keyed_uniforms(torch.zeros(2, dtype=torch.int64), 0, 0, 0)
    return fused_enabled()


# ---- opaque to torch.compile: compiled decode steps call the very same kernels -------------------------


@torch.library.custom_op("vispec::keyed_race", mutates_args=())
def _keyed_race_op(weights: Tensor, seeds: Tensor, positions: Tensor, streams: Tensor, draws: Tensor) -> Tensor:
    return keyed_race(weights, seeds, positions, streams, draws)


@_keyed_race_op.register_fake
def _(weights: Tensor, seeds: Tensor, positions: Tensor, streams: Tensor, draws: Tensor) -> Tensor:
    return weights.new_empty(weights.shape[:1], dtype=torch.int64)


def race(weights: Tensor, seeds: Tensor, positions: Tensor, streams: Tensor, draws: Tensor) -> Tensor:
    """:func:`keyed_race` for ``[R]`` key tensors, also inside ``torch.compile``d code: there the Philox words are
    traced into the graph (:func:`graph_uniforms`, exact integer arithmetic) and only ``log`` and the race run
    eagerly, in one opaque op (``vispec::race_uniforms``), so inductor never swaps in its own ``log`` and compiled
    decode steps draw bit-identical noise."""
    if torch.compiler.is_compiling():
        rows, vocab = weights.shape
        if rows == 0 or vocab == 0:
            return torch.ops.vispec.keyed_race(weights, seeds, positions, streams, draws)
        return torch.ops.vispec.race_uniforms(weights, graph_uniforms(_keys(seeds, positions, streams, draws), vocab))
    return keyed_race(weights, seeds, positions, streams, draws)


def graph_uniforms(keys: Tensor, vocab: int) -> Tensor:
    """``[R, V]`` float32 uniforms in vocabulary order for the ``[4, R]`` keys of :func:`_keys`: bit-identical to
    :func:`vispec.kernels.philox.uniforms` with ``vocab_size=V`` (entry ``v`` is word ``v % 4`` of the block
    ``c0 = v // 4``). Written for tracing into a compiled graph: :func:`_uniform_blocks`' overflow-free Philox
    (every step an exact integer op, the map to ``u`` exact in float32), so whatever code inductor generates gives
    the same bits; only the ``log`` after it must stay eager (module docstring)."""
    rows = keys.shape[1]
    blocks = (vocab + 3) // 4
    u = _uniform_blocks(keys, blocks).transpose(1, 2).reshape(rows, 4 * blocks)
    return (u if vocab == 4 * blocks else u[:, :vocab]).contiguous()


def _race_uniforms(weights: Tensor, u: Tensor) -> Tensor:
    """The eager end of the exponential race: ``E = -log(u)`` by ATen's own ``log`` (the very kernel of
    :func:`vispec.kernels.philox.exponentials`, on the same ``[R, V]`` layout), then :func:`sample_from_weights`."""
    return sample_from_weights(weights, torch.log(u).neg_())


# A bare library op, not ``torch.library.custom_op``: a compiled step calls it once per step, and custom_op's Python
# wrapper costs ~40 us per call on CPU against ~5 us for a kernel the dispatcher calls directly.
_LIBRARY = torch.library.Library("vispec", "FRAGMENT")
_LIBRARY.define("race_uniforms(Tensor weights, Tensor u) -> Tensor")
_LIBRARY.impl("race_uniforms", _race_uniforms, "CompositeExplicitAutograd")


@torch.library.register_fake("vispec::race_uniforms")
def _(weights: Tensor, u: Tensor) -> Tensor:
    return weights.new_empty(weights.shape[:1], dtype=torch.int64)


def _neg_log(u: Tensor) -> Tensor:
    """``E = -log(u)`` by ATen's own ``log``, the kernel of :func:`vispec.kernels.philox.exponentials` (module
    docstring, step 2): the eager end of :func:`exponentials_for` in a compiled step."""
    return torch.log(u).neg_()


_LIBRARY.define("neg_log(Tensor u) -> Tensor")
_LIBRARY.impl("neg_log", _neg_log, "CompositeExplicitAutograd")


@torch.library.register_fake("vispec::neg_log")
def _(u: Tensor) -> Tensor:
    return torch.empty_like(u)


def exponentials_for(seeds: Tensor, positions: Tensor, streams: Tensor, draws: Tensor, vocab: int) -> Tensor:
    """:func:`keyed_exponentials` for ``[R]`` key tensors, also inside ``torch.compile``d code: there the Philox words
    are traced into the graph (:func:`graph_uniforms`) and only the ``log`` runs eagerly (``vispec::neg_log``), as in
    :func:`race`."""
    if torch.compiler.is_compiling():
        if seeds.shape[0] == 0 or vocab < 1:
            return seeds.new_empty((seeds.shape[0], max(vocab, 0)), dtype=torch.float32)
        return torch.ops.vispec.neg_log(graph_uniforms(_keys(seeds, positions, streams, draws), vocab))
    return keyed_exponentials(seeds, positions, streams, draws, vocab).contiguous()


def words_for(seeds: Tensor, positions: Tensor, streams: Tensor, draws: Tensor, count: int) -> Tensor:
    """``[R, count]`` float32 uniforms, entry ``k`` word ``k % 4`` of the Philox block ``c0 = k // 4`` of row ``r``'s
    key (:func:`vispec.kernels.philox.uniforms` with ``vocab_size=count``; entry 0 is :func:`uniforms_for`'s
    number); inside ``torch.compile``d code traced into the graph (:func:`graph_uniforms`: exact integer arithmetic,
    the eager bits)."""
    if torch.compiler.is_compiling():
        return graph_uniforms(_keys(seeds, positions, streams, draws), count)
    return uniforms(seeds, positions[:, None], streams[:, None], draws, vocab_size=count)[:, 0].contiguous()


def uniforms_for(seeds: Tensor, positions: Tensor, streams: Tensor, draws: Tensor) -> Tensor:
    """:func:`keyed_uniforms` for ``[R]`` key tensors; inside ``torch.compile``d code traced into the graph (word 0
    of :func:`graph_uniforms`' first block: the eager bits). Before, an opaque op drew them eagerly: ~50 ATen ops
    and 2 ms of a ~19 ms compiled MC-SJD pass on tiny-c2i at batch 1 (a 2-core AVX2 CPU)."""
    if torch.compiler.is_compiling():
        return graph_uniforms(_keys(seeds, positions, streams, draws), 1)[:, 0]
    return keyed_uniforms(seeds, positions, streams, draws).contiguous()
