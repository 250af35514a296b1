"""diffusers' offloading (accelerate hooks) on both pipelines, exercised for real on the CPU.

``enable_*_cpu_offload(device="cpu")`` installs the same hooks as on a GPU, with the CPU as the execution
device. The decoders call ``prefill`` / ``forward_window`` / ``refill`` (GPT, drafter) and
``compute_kv_cache`` / ``forward_span`` (LLaDA with a cache), not ``forward``, so these tests count the hooks'
``pre_forward`` calls per component (model offload: one per model call; sequential offload: per weighted
submodule, with the weights parked on ``meta`` in between) and compare the outputs with the plain pipeline.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from helpers import image_inputs, image_pipe, text_pipe

accelerate = pytest.importorskip("accelerate")
from accelerate.hooks import AlignDevicesHook, CpuOffload  # noqa: E402


@pytest.fixture
def hook_calls(monkeypatch):
    """``Counter`` of offload-hook ``pre_forward`` calls by the id of the module they fired for."""
    calls: Counter = Counter()
    for hook_cls in (CpuOffload, AlignDevicesHook):
        original = hook_cls.pre_forward

        def counted(self, module, *args, _original=original, **kwargs):
            calls[id(module)] += 1
            return _original(self, module, *args, **kwargs)

        monkeypatch.setattr(hook_cls, "pre_forward", counted)
    return calls


def _fired(calls: Counter, component: torch.nn.Module) -> int:
    """Hook calls for ``component`` or any of its submodules."""
    return sum(calls[id(m)] for m in component.modules())


def test_model_offload_fires_for_every_model_call(hook_calls):
    pipe = image_pipe()
    inputs = image_inputs(count=1, decoding="sd:window=3", output_type="pt")
    want = pipe(**inputs).images
    pipe.enable_model_cpu_offload(device="cpu")
    assert pipe._execution_device == torch.device("cpu")
    out = pipe(**image_inputs(count=1, decoding="sd:window=3", output_type="pt"))
    torch.testing.assert_close(out.images, want, rtol=0, atol=0)
    stats = out.stats[0]
    assert hook_calls[id(pipe.transformer)] == stats["nfe"]  # prefill + every verification forward
    assert hook_calls[id(pipe.drafter)] == stats["drafter_nfe"] + 1 > 1  # its prefill is not in drafter_nfe
    assert hook_calls[id(pipe.vqvae)] == 1  # decode, through diffusers' own apply_forward_hook
    # maybe_free_model_hooks put every model back on the CPU, hooks kept for the next call
    assert all(hasattr(m, "_hf_hook") for m in (pipe.transformer, pipe.drafter, pipe.vqvae))

    text = text_pipe()
    want_text = {cache: text(prompt="sort the list", cache=cache, output_type="seq").sequences for cache in ("none", "dual")}
    text.enable_model_cpu_offload(device="cpu")
    for cache in ("none", "dual"):
        hook_calls.clear()
        out = text(prompt="sort the list", cache=cache, output_type="seq")
        assert torch.equal(out.sequences, want_text[cache])
        assert hook_calls[id(text.model)] == out.stats[0]["nfe"]  # forward, or compute_kv_cache + forward_span


def test_sequential_offload_loads_weights_per_submodule(hook_calls):
    pipe = image_pipe()
    want = pipe(**image_inputs(decoding="sd:window=3", output_type="pt")).images
    want_lantern = pipe(**image_inputs(decoding="sjd+lantern:k=8", acceptance=None)).images
    pipe.enable_sequential_cpu_offload(device="cpu")
    assert pipe.transformer.tok_embeddings.weight.device.type == "meta"
    assert pipe.transformer.device == pipe._execution_device == torch.device("cpu")
    out = pipe(**image_inputs(decoding="sd:window=3", output_type="pt"))
    torch.testing.assert_close(out.images, want, rtol=0, atol=0)
    for component in (pipe.transformer, pipe.drafter, pipe.vqvae):
        assert _fired(hook_calls, component) > 0
    assert pipe.transformer.tok_embeddings.weight.device.type == "meta"  # parked again
    assert torch.equal(pipe(**image_inputs(decoding="sjd+lantern:k=8")).images, want_lantern)  # codebook read via the hook

    text = text_pipe()
    want_text = text(prompt=["sort the list", "reverse"], cache="prefix", output_type="seq").sequences
    text.enable_sequential_cpu_offload(device="cpu")
    hook_calls.clear()
    assert torch.equal(text(prompt=["sort the list", "reverse"], cache="prefix", output_type="seq").sequences, want_text)
    assert _fired(hook_calls, text.model) > 0


def test_offload_without_an_accelerator_is_diffusers_error():
    """With no device given on a CPU-only machine, diffusers' own error stands (offloading to the CPU saves nothing)."""
    if torch.cuda.is_available():
        pytest.skip("an accelerator is present")
    with pytest.raises(RuntimeError, match="requires accelerator"):
        image_pipe().enable_model_cpu_offload()


# ---- the unified-token pipeline (issue 28, items 1 and 6b) ----------------------------------------

def _unified():
    from unified_helpers import tiny_unified_pipeline

    return tiny_unified_pipeline()


def _seeds(count: int = 2) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(i) for i in range(count)]


def test_unified_model_offload_fires_for_every_transformer_call(hook_calls):
    """The decoders run the transformer's parts (``prefill`` / ``forward_window`` of the wrapper), never its
    ``forward``; its model-offload hook must still fire on each of those calls (on a GPU: the move to it)."""
    pipe = _unified()
    prompts = ["a red cat", "blue sky"]
    want = pipe(prompts, generator=_seeds(), output_type="pt").images
    pipe.enable_model_cpu_offload(device="cpu")
    for decoding, batch in (("mc-sjd", None), ("ar", 1)):  # max_batch_size=1 streams: prefill, then a refill
        hook_calls.clear()
        out = pipe(prompts, generator=_seeds(), output_type="pt", decoding=decoding, max_batch_size=batch)
        if decoding == "mc-sjd":
            torch.testing.assert_close(out.images, want, rtol=0, atol=0)
        nfe = out.stats[0]["nfe"] if batch is None else sum(s["nfe"] for s in out.stats)
        assert hook_calls[id(pipe.transformer)] == nfe > 1
        assert hook_calls[id(pipe.vqvae)] == 1
    assert all(hasattr(m, "_hf_hook") for m in (pipe.transformer, pipe.vqvae))


def test_unified_sequential_offload_gives_the_same_codes(hook_calls):
    """``enable_sequential_cpu_offload(device="cpu")`` runs (the weights on ``meta`` between forwards; the cache
    on the hooks' device) and gives the same codes and pixels; LANTERN's codebook is read through the hook."""
    pipe = _unified()
    want = pipe(["a red cat", "blue sky"], generator=_seeds(), output_type="latent").images
    want_lantern = pipe("a red cat", generator=_seeds(1), output_type="pt", decoding="mc-sjd+lantern:k=2,delta=0.2").images
    pipe.enable_sequential_cpu_offload(device="cpu")
    assert pipe.transformer.lm_head.weight.device.type == "meta"
    assert torch.equal(pipe(["a red cat", "blue sky"], generator=_seeds(), output_type="latent").images, want)
    assert _fired(hook_calls, pipe.transformer) > 0
    lantern = pipe("a red cat", generator=_seeds(1), output_type="pt", decoding="mc-sjd+lantern:k=2,delta=0.2").images
    torch.testing.assert_close(lantern, want_lantern, rtol=0, atol=0)
    assert pipe.transformer.lm_head.weight.device.type == "meta"  # parked again
