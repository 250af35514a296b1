"""A static, compilable dLLM decode step: LLaDA's forwards read nothing back, trace as one graph, and the
compiled block loop (``decode(..., compile=True)``) gives the eager tokens and NFE for every cache mode.

The compiled tiny-mdlm graphs are shared through a module-scoped pipeline (compiling costs ~15 s a graph
on two CPU cores; five graphs in all: none, the prefix/dual refresh, the prefix span (dynamic), the
guided refresh and dual block). Speed is measured by samples/dllm_compile_speed.py, not here.
"""

from __future__ import annotations

import pytest
import torch

from vispec.dllm import decode, make_scheduler
from vispec.models.llada import LLaDAModelLM
from vispec.profiling import HostSyncCounter

PROMPTS = ["sort the numbers : 5 3 9 3 1", "reverse the letters : k d m a", "what is 12 + 7 ?"]  # padded: 17, 16, 14 ids
GEN, BLOCK = 16, 8  # two blocks: the prefix span shrinks once


@pytest.fixture(scope="module")
def pipe(tiny_mdlm):
    return tiny_mdlm  # conftest.py


@pytest.fixture(scope="module")
def prompts(pipe):
    ids, mask = pipe.prepare_input_ids(prompt=PROMPTS)
    assert not mask.all() and mask[:, -1].all()  # left padding in the batch
    return ids, mask


def _decode(pipe, prompts, cache, strategy, temperature, guidance, compile):
    ids, mask = prompts
    scheduler = make_scheduler(strategy)
    return decode(pipe.model, ids, mask, scheduler=scheduler, gen_length=GEN, block_length=BLOCK,
                  steps=GEN if scheduler.fixed_steps else None, temperature=temperature, guidance_scale=guidance,
                  cache=cache, early_stop_eos=True, eos_token_id=pipe.tokenizer.eos_token_id,
                  generator=[torch.Generator().manual_seed(s) for s in (4, 5, 6)], compile=compile)


# (strategy, temperature, guidance): threshold at temperature 0.7 lets rows finish blocks at different
# steps (the compiled forward keeps the whole batch, the eager one drops finished rows); dual is guided
SETTINGS = {"none": (("threshold", 0.7, 1.0), ("llada", 0.0, 1.0)),
            "prefix": (("threshold", 0.7, 1.0), ("llada", 0.0, 1.0)),
            "dual": (("threshold", 0.7, 1.5), ("entropy", 0.0, 1.5))}


@pytest.mark.parametrize("cache", ["none", "prefix", "dual"])
def test_compiled_decode_gives_the_eager_tokens_and_nfe(pipe, prompts, cache):
    results = {}
    for setting in SETTINGS[cache]:
        eager = _decode(pipe, prompts, cache, *setting, compile=False)
        compiled = results[setting] = _decode(pipe, prompts, cache, *setting, compile=True)
        assert torch.equal(compiled.tokens, eager.tokens), (cache, setting)
        assert torch.equal(compiled.stats.nfe, eager.stats.nfe) and compiled.labels == eager.labels
        if setting[0] == "threshold":
            assert len(set(eager.stats.nfe.tolist())) > 1  # rows left the eager forwards at different steps
    # the graphs are cached on the model: the same call again compiles nothing
    with torch._dynamo.config.patch(error_on_recompile=True):
        again = _decode(pipe, prompts, cache, *SETTINGS[cache][0], compile=True)
    assert torch.equal(again.tokens, results[SETTINGS[cache][0]].tokens)
    assert pipe.model.compiled_core("_full_core") is pipe.model.compiled_core("_full_core")


def test_pipeline_compile_option(pipe):
    kwargs = dict(prompt=PROMPTS, gen_length=GEN, block_length=BLOCK, strategy="threshold", temperature=0.7,
                  guidance_scale=1.5, cache="dual", output_type="seq")
    gens = lambda: [torch.Generator().manual_seed(s) for s in (4, 5, 6)]
    eager = pipe(**kwargs, generator=gens())
    with torch._dynamo.config.patch(error_on_recompile=True):  # the shapes of the dual test: its graphs serve
        compiled = pipe(**kwargs, generator=gens(), compile=True)
    assert torch.equal(compiled.sequences, eager.sequences)
    assert [s["nfe"] for s in compiled.stats] == [s["nfe"] for s in eager.stats]


def _tiny(logits_shift: bool) -> LLaDAModelLM:
    torch.manual_seed(0)
    return LLaDAModelLM(d_model=32, n_heads=4, n_kv_heads=2, n_layers=2, mlp_hidden_size=48, vocab_size=61, embedding_size=64,
                        max_sequence_length=64, rope_theta=10000.0, mask_token_id=60, eos_token_id=1, eot_token_id=2,
                        pad_token_id=0, bos_token_id=3, init_std=0.3, logits_shift=logits_shift).eval()


@pytest.mark.parametrize("logits_shift", [False, True])
def test_forward_paths_trace_as_one_graph(logits_shift):
    """Dynamo with ``fullgraph=True`` raises on any graph break (a host read-back, data-dependent control flow);
    the eager backend traces without inductor, so every path is checked in seconds (decode tests run inductor)."""
    model = _tiny(logits_shift)
    ids = torch.randint(4, 60, (2, 12), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    ids[1, :3] = 0
    full = torch.compile(model._full_core, fullgraph=True, backend="eager")
    span = torch.compile(model._span_core, fullgraph=True, backend="eager")
    with torch.no_grad(), torch._dynamo.config.patch(recompile_limit=64):
        for attention_mask in (None, mask):
            for keep_kv in (False, True):
                got, want = full(ids, attention_mask, None, keep_kv), model._full_core(ids, attention_mask, None, keep_kv)
                torch.testing.assert_close(got[0], want[0], atol=1e-6, rtol=0)
            cache = model.compute_kv_cache(ids, attention_mask).kv_cache
            for start, end, use_suffix in ((7, 10, True), (0, 3, True), (4, 8, False)):  # dual, shift at 0, no suffix
                lo = start - 1 if logits_shift and start > 0 else start
                args = (ids[:, start:end], torch.arange(lo, end), start - lo, None if use_suffix else end)
                mine, theirs = cache.clone(), cache.clone()
                got = span(*args, mine.input_ids, mine.positions, mine.key_mask, mine.keys, mine.values)
                want = model.forward_span(ids[:, start:end], start, theirs, use_suffix=use_suffix).logits
                torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
                torch.testing.assert_close(mine.keys[1], theirs.keys[1], atol=1e-6, rtol=0)  # written in place


def _one_step_each_mode(model, ids, mask, start, end):
    """One block step of each cache mode, as the block loop runs them."""
    return {
        "none": lambda: model(ids, mask),
        "refresh": lambda: model.compute_kv_cache(ids, mask),
        "prefix": lambda: model.forward_span(ids[:, start:], start, model.compute_kv_cache(ids, mask).kv_cache),
        "dual": lambda: model.forward_span(ids[:, start:end], start, model.compute_kv_cache(ids, mask).kv_cache),
    }


def test_model_forwards_perform_no_host_synchronisation(pipe, prompts):
    ids, mask = prompts
    x = torch.cat([ids, torch.full((ids.shape[0], GEN), pipe.model.mask_token_id)], dim=1)
    full_mask = torch.cat([mask, torch.ones(ids.shape[0], GEN, dtype=mask.dtype)], dim=1)
    start = ids.shape[1]
    with torch.no_grad():
        for attention_mask in (full_mask, None):
            for name, step in _one_step_each_mode(pipe.model, x, attention_mask, start, start + BLOCK).items():
                with HostSyncCounter() as syncs:
                    step()
                assert syncs.total == 0, (name, dict(syncs.by_name))
    # negative controls: the counter sees the read-back the key mask used to make, and the block loop's own
    with HostSyncCounter() as syncs:
        bool(full_mask.bool().all())
    assert syncs.total == 1
    with HostSyncCounter() as syncs:
        decode(pipe.model, ids, mask, scheduler=make_scheduler("threshold"), gen_length=BLOCK, block_length=BLOCK)
    assert syncs.total > 0


def test_bad_compile_arguments(pipe, prompts):
    ids, mask = prompts

    class Plain(torch.nn.Module):  # the decode protocol without compilable cores
        def __init__(self, inner):
            super().__init__()
            self.inner, self.config = inner, inner.config

        def forward(self, input_ids, attention_mask=None):
            return self.inner(input_ids, attention_mask)

    with pytest.raises(ValueError, match="compile=True needs a model with static, compilable forwards"):
        decode(Plain(pipe.model), ids, mask, scheduler=make_scheduler("threshold"), gen_length=8, block_length=8, compile=True)
    with pytest.raises(ValueError, match="compile must be True or False"):
        decode(pipe.model, ids, mask, scheduler=make_scheduler("threshold"), gen_length=8, block_length=8, compile="yes")
    with pytest.raises(ValueError, match="name must be"):
        pipe.model.compiled_core("forward")
