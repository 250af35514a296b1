"""CUDA graphs can replay the compiled decode steps: no step graph writes in place into an input that is not static.

Inductor replays a graph under ``mode="reduce-overhead"`` only if every input it mutates is a static input
(:mod:`vispec.decoding.compiled`). On CPU it never gets that far (a CPU graph is skipped first), so these tests
run inductor's own compile-time mutation check on CPU (``check_for_mutation_ignore_cuda_graph_managed_tensor``,
which CUDA builds run when ``triton.cudagraph_support_input_mutation`` is off) and record its verdict on every
compiled step graph. What they cannot show on CPU: that the graphs record and replay on a GPU.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from vispec.decoding import decode
from vispec.decoding import compiled as compiled_steps
from vispec.decoding.compiled import cudagraph_skip_reasons, cuda_graphs, mark_persistent, persistent_tensors
from vispec.models.llamagen_gpt import LlamaGenCondition
from vispec.sampling import SamplingConfig

from helpers import tiny_gpt

SAMPLING = SamplingConfig(temperature=0.9)  # the smallest step graphs (compile time)
NOT_RECORDED = "vispec test: a CPU graph is never recorded"


@contextlib.contextmanager
def mutation_verdicts():
    """Compile with inductor's CUDA-graph mutation check run on CPU graphs; yields the list of its verdicts, one per
    compiled graph (None: no non-static input is mutated), plus any input storage mutation it finds. The graphs
    still run without a CUDA graph. Everything patched is restored on exit."""
    from unittest import mock

    from torch._functorch import config as functorch_config
    from torch._inductor import config as inductor_config
    from torch._inductor import cudagraph_utils, output_code

    verdicts: list = []
    check = cudagraph_utils.check_for_mutation_ignore_cuda_graph_managed_tensor
    storage = output_code.get_input_storage_mutation_reason

    def checked(*args, **kwargs):
        verdicts.append(check(*args, **kwargs))
        return verdicts[-1] or NOT_RECORDED  # a reason in any case: CPU graphs must not reach cudagraphify

    def storage_checked(*args, **kwargs):
        reason = storage(*args, **kwargs)
        if reason is not None:
            verdicts.append(reason)
        return reason

    torch._dynamo.reset()  # every step graph is compiled again, under the patched check
    compiled_steps._graphs.clear()
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(mock.patch.object(cudagraph_utils, "check_for_mutation_ignore_cuda_graph_managed_tensor",
                                                  checked))
            # on CPU, inductor stops at "cpu device" before checking mutations
            stack.enter_context(mock.patch.object(cudagraph_utils, "check_lowering_disable_cudagraph", lambda *a, **k: None))
            stack.enter_context(mock.patch.object(output_code, "get_input_storage_mutation_reason", storage_checked))
            # the compile-time check (CUDA's default defers it to the graph tree; same rule, stricter: no exemption for
            # outputs of earlier graphs); no cache, which would skip it
            stack.enter_context(inductor_config.patch({"triton.cudagraph_support_input_mutation": False,
                                                       "fx_graph_cache": False}))
            stack.enter_context(functorch_config.patch(enable_autograd_cache=False))
            yield verdicts
    finally:
        torch._dynamo.reset()
        compiled_steps._graphs.clear()


def _model():
    return tiny_gpt(vocab_size=16, block_size=16, num_classes=3, dim=32, n_layer=1, std=0.3).to(torch.float64)


def _decode(model, spec, compile, requests=2):
    gens = [torch.Generator().manual_seed(7 + i) for i in range(requests)]
    return decode(model, LlamaGenCondition(class_labels=torch.arange(requests) % 3), num_tokens=6, sampling=SAMPLING,
                  decoding=spec, generator=gens, grid_width=3, compile=compile)


@pytest.mark.slow
def test_compiled_steps_mutate_only_static_inputs():
    """ar, sjd and mc-sjd steps under cuda_graphs(): inductor's check passes on every graph, and the tokens are the
    eager ones (float64: compiled rounding cannot flip a token)."""
    model = _model()
    specs = ("ar", "sjd:window=2", "mc-sjd-maximal:window=2")  # 4 step graphs
    eager = {spec: _decode(model, spec, compile=False) for spec in specs}
    reasons_before = len(cudagraph_skip_reasons())
    with mutation_verdicts() as verdicts, cuda_graphs():
        for spec in specs:
            before = len(verdicts)
            out = _decode(model, spec, compile=True)
            assert len(verdicts) > before, spec  # the check ran on this decode's step graphs
            assert torch.equal(out.tokens, eager[spec].tokens) and torch.equal(out.stats.nfe, eager[spec].stats.nfe), spec
    assert verdicts and all(v is None for v in verdicts), verdicts
    assert cudagraph_skip_reasons()[reasons_before:] == []  # inductor logs CPU graphs' skips without a reason


@pytest.mark.slow
def test_unmarked_buffers_are_reported_as_mutated_inputs(monkeypatch):
    """The negative control: without the marks the same check finds the KV cache and token buffer writes."""
    monkeypatch.setattr(torch._dynamo, "mark_static_address", lambda *args, **kwargs: None)
    model = _model()
    with mutation_verdicts() as verdicts, cuda_graphs():
        _decode(model, "ar", compile=True)
    assert verdicts and all(v is not None and "mutated inputs" in v for v in verdicts), verdicts


def test_marks_only_within_cuda_graphs():
    """Default mode is untouched; within cuda_graphs() the KV cache and the given buffers are marked, unguarded."""
    model = _model()
    state, _ = model.prefill(LlamaGenCondition(class_labels=torch.tensor([0, 1])), guidance=True, max_new_tokens=4)
    tokens = torch.zeros(2, 5, dtype=torch.long)
    tensors = persistent_tensors(state, tokens, None)
    assert state.cond_mask is None and len(tensors) == 2 * len(model.layers) + 2  # keys, values, lengths; tokens
    assert any(t is state.lengths for t in tensors) and tensors[-1] is tokens
    mark_persistent(state, tokens)
    assert not any(hasattr(t, "_dynamo_static_input_type") for t in tensors)
    with cuda_graphs():
        mark_persistent(state, tokens)
    assert all(getattr(t, "_dynamo_static_input_type", None) == "unguarded" for t in tensors)


def test_skip_reasons_are_recorded():
    """What inductor logs when it skips a CUDA graph is kept (first line, each reason once) from cuda_graphs() on."""
    from torch._inductor.cudagraph_utils import log_cudagraph_skip_and_bump_counter

    with cuda_graphs():
        pass
    message = "skipping cudagraphs due to mutated inputs (1 instances). Found from :"
    for _ in range(2):
        log_cudagraph_skip_and_bump_counter(message + "\n  File \"x.py\", line 1, in step\n")
    assert cudagraph_skip_reasons().count(message) == 1


def test_step_outputs_kept_by_a_decode_are_copied_out_of_the_graph_pool():
    """Within cuda_graphs(), after every compiled step the ragged batch's step-made tensors (n, nfe, accepted, its
    state) are copies of their own, with the same values; outside it (and for the persistent buffers) nothing is
    copied. (The failure this prevents needs a GPU: a CUDA-graph tree overwriting an earlier step's output.)"""
    calls = []

    class Kept:
        def own_graph_outputs(self):
            calls.append(self)

    def step(x: torch.Tensor, kept: Kept) -> torch.Tensor:
        return x + 1

    x, kept = torch.zeros(3), Kept()
    compiled_steps.compiled(step)(x, kept)
    assert calls == []
    with cuda_graphs():
        compiled_steps.compiled(step)(x, kept)
    assert calls == [kept]
    made = (torch.ones(2), 3)
    copied = compiled_steps._copied(made)
    assert type(copied) is tuple and torch.equal(copied[0], made[0]) and copied[0] is not made[0] and copied[1] == 3

    model = _model()
    seen = []
    own = compiled_steps.own_graph_outputs

    def spy(args):
        batch = next(a for a in args if hasattr(a, "own_graph_outputs"))
        made = (batch.n, batch.nfe, batch.accepted, dict(batch.state), batch.tokens)
        own(args)
        seen.append(made)
        assert all(torch.equal(a, b) and a.data_ptr() != b.data_ptr()
                   for a, b in zip((made[0], made[1], made[2], *made[3].values()),
                                   (batch.n, batch.nfe, batch.accepted, *batch.state.values())))
        assert batch.tokens is made[4]  # persistent: written in place, never copied

    eager = _decode(model, "mc-sjd-maximal:window=2", compile=False)
    from unittest import mock

    with mock.patch.object(compiled_steps, "own_graph_outputs", spy), cuda_graphs():
        out = _decode(model, "mc-sjd-maximal:window=2", compile=True)
    assert seen and torch.equal(out.tokens, eager.tokens)
