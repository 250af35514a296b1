"""Per-call overhead of the kernels' dispatch (issue 33): with ``validate=False`` the verification and unmasking
calls read nothing back from the device, and the Triton dispatch issues no ATen work besides allocating its outputs
(counted with :func:`vispec.eval.bench.kernels.count_per_call`; TRITON_INTERPRET=1 from conftest.py runs the kernels,
whose interpreter work is not the caller's)."""

from __future__ import annotations

import pytest
import torch

from vispec.decoding.acceptance import AcceptanceRule
from vispec.decoding.speculative import JACOBI, verify_window
from vispec.eval.bench.kernels import count_per_call
from vispec.kernels.backend import interpreter_enabled, triton_available
from vispec.kernels.target import Target, window_target
from vispec.kernels.unmask import RowNoise, unmask_candidates
from vispec.kernels.verify import Drafts, SampleRequest
from vispec.profiling import HostSyncCounter
from vispec.sampling import SamplingConfig

BACKENDS = ["reference", pytest.param("triton", marks=pytest.mark.skipif(
    not (triton_available() and interpreter_enabled()), reason="needs triton with TRITON_INTERPRET=1"))]
B, W, V = 2, 4, 32


def _window(seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    slot = torch.arange(W)
    return {
        "cond": torch.randn(B, W, V, generator=gen) * 2, "uncond": torch.randn(B, W, V, generator=gen),
        "positions": (slot + 1).expand(B, W).contiguous(),
        "drafts": torch.where(slot < W - 1, torch.randint(0, V, (B, W), generator=gen), -1),
        "q": torch.softmax(torch.randn(B, W - 1, V, generator=gen), -1), "q_dense": (slot < W - 1).expand(B, W).contiguous(),
        "seeds": torch.tensor([11, 12]),
    }


def _verify(backend: str, x: dict, store: torch.Tensor):
    """What a decoder runs from a window's logits on (vispec.decoding.sjd.sjd_step)."""
    width = torch.tensor([W, W - 1])  # the second window is one row shorter: a padding row
    target = window_target(x["cond"], x["uncond"], x["positions"], width, x["seeds"], SamplingConfig(guidance_scale=3.0, top_k=9),
                           backend=backend, validate=False)
    verified = verify_window(target, AcceptanceRule(), x["drafts"], width - 1, width, torch.tensor([1, 2]), JACOBI,
                             q=x["q"], q_dense=x["q_dense"], store_q=store)
    return verified, target.status


@pytest.mark.parametrize("backend", BACKENDS)
def test_verification_reads_nothing_back_without_validation(backend):
    x = _window()
    store = torch.zeros(B, W - 1, V)
    _verify(backend, x, store)  # warm-up (kernel compilation in the interpreter, caches)
    with HostSyncCounter() as syncs:
        verified, status = _verify(backend, x, store)
    assert syncs.total == 0, dict(syncs.by_name)
    assert int(status) == 0  # the deferred status is still there for the caller's one read-back


def test_verification_gives_the_same_tokens_on_both_backends():
    """The dispatch changes (uninitialised outputs, guidance decided in the kernel, bool flags) keep the kernels
    equal to the reference, padding rows included."""
    if not (triton_available() and interpreter_enabled()):
        pytest.skip("needs triton with TRITON_INTERPRET=1")
    x = _window(3)
    results = {}
    for backend in ("reference", "triton"):
        store = torch.zeros(B, W - 1, V)
        verified, _ = _verify(backend, x, store)
        results[backend] = (verified, store)
    (ref, ref_store), (tri, tri_store) = results["reference"], results["triton"]
    for name in ("accepted", "num_accepted", "coupled", "fresh", "next_token"):
        assert torch.equal(getattr(ref, name), getattr(tri, name)), name
    assert torch.allclose(ref_store, tri_store, atol=1e-6)


@pytest.mark.skipif(not (triton_available() and interpreter_enabled()), reason="needs triton with TRITON_INTERPRET=1")
def test_triton_dispatch_only_allocates_its_outputs():
    """Target + accept + first_rejection + sample on prepared inputs: three launches and no ATen op other than the
    outputs' allocations (no fills, casts, masks or reductions per call)."""
    x = _window(1)
    rows = B * W
    cond, uncond = x["cond"].reshape(rows, V), x["uncond"].reshape(rows, V)
    positions, row_sample = x["positions"].reshape(-1), torch.arange(B).repeat_interleave(W)
    drafts = Drafts(x["drafts"].reshape(-1), x["q"].reshape(-1, V), torch.arange(rows) % (B * (W - 1)))
    draws, row_start, num_drafts = torch.ones(rows, dtype=torch.long), torch.arange(B) * W, torch.full((B,), W - 1)
    flags = torch.arange(rows) % 2 == 0
    other = ~flags
    store_rows, store = torch.where(flags, torch.arange(rows) // 2, -1), torch.empty(rows, V)
    sampling = SamplingConfig(guidance_scale=2.0)

    def dispatch():
        target = Target(cond, uncond, positions, row_sample, x["seeds"], sampling, backend="triton", validate=False)
        accepted = target.accept(drafts, draws)
        target.first_rejection(accepted, row_start, num_drafts, width=W)
        return target.sample(SampleRequest(residual=flags, fresh=other, residual_draws=draws, fresh_draws=draws,
                                           store_rows=store_rows, store_out=store), drafts)

    dispatch()
    counts = count_per_call(dispatch)
    assert counts["host_syncs"] == 0
    assert counts["triton_kernels"] == ["_accept_kernel", "_first_rejection_kernel", "_sample_kernel"]
    assert set(counts["aten_op_names"]) == {"aten::empty"}, counts["aten_op_names"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_unmasking_reads_nothing_back_without_validation(backend):
    """The decoders' form (rows of [B, L, V] logits read in place, token masks, Philox noise)."""
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(2, 6, V, generator=gen)
    rows = torch.tensor([0, 3, 7, 11])
    noise = RowNoise(torch.tensor([5, 5, 6, 6]), rows % 6, torch.tensor([1, 1, 2, 2]))
    proposal, confidence = torch.arange(V) == V - 1, torch.arange(V) == V - 2
    call = lambda validate: unmask_candidates(logits, 0.7, None, proposal, confidence, noise=noise, rows=rows,  # noqa: E731
                                              backend=backend, validate=validate)
    checked = call(True)
    with HostSyncCounter() as syncs:
        fast = call(False)
    assert syncs.total == 0, dict(syncs.by_name)
    for name in ("tokens", "confidence", "margin", "entropy"):
        assert torch.equal(getattr(checked, name), getattr(fast, name)), name
    with HostSyncCounter() as syncs:
        call(True)
    assert syncs.total == 1  # the rows' range check, the one read-back validation costs
    with pytest.raises(ValueError, match="rows must lie in"):
        unmask_candidates(logits, 0.0, rows=torch.tensor([12]), backend=backend)
    with pytest.raises(ValueError, match="validate must be True or False"):
        unmask_candidates(logits, 0.0, rows=rows, backend=backend, validate=None)


@pytest.mark.skipif(not (triton_available() and interpreter_enabled()), reason="needs triton with TRITON_INTERPRET=1")
@pytest.mark.parametrize("form", ["all-rows", "contiguous-rows", "sliced-rows"])
def test_triton_unmasking_only_allocates_its_outputs(form):
    """No row-id arithmetic for collapsible layouts, no temperature tensor, no mask bit set: four allocations and
    one launch (a strided slice still maps its rows to storage rows on the device)."""
    gen = torch.Generator().manual_seed(4)
    full = torch.randn(2, 8, V, generator=gen)
    logits = {"all-rows": full.reshape(16, V), "contiguous-rows": full, "sliced-rows": full[:, 2:6]}[form]
    rows = None if form == "all-rows" else torch.tensor([0, 2, 5, 7])
    count = 16 if rows is None else 4
    noise = RowNoise(torch.full((count,), 9), torch.arange(count), torch.ones(count, dtype=torch.long))
    mask = torch.arange(V) == 0
    call = lambda: unmask_candidates(logits, 1.3, None, mask, mask, noise=noise, rows=rows, backend="triton",  # noqa: E731
                                     validate=False)
    out = call()
    reference = unmask_candidates(logits, 1.3, None, mask, mask, noise=noise, rows=rows, backend="reference")
    assert torch.equal(out.tokens, reference.tokens)
    torch.testing.assert_close(out.confidence, reference.confidence, rtol=1e-12, atol=1e-12)
    counts = count_per_call(call)
    assert counts["host_syncs"] == 0 and counts["triton_launches"] == 1
    expected = {"aten::empty"} if form != "sliced-rows" else {"aten::empty", "aten::zeros_like", "aten::remainder",
                                                               "aten::mul", "aten::add_", "aten::floor_divide"}
    assert set(counts["aten_op_names"]) <= expected and "aten::empty" in counts["aten_op_names"], counts["aten_op_names"]
