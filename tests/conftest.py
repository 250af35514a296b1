"""Test configuration: run Triton kernels in the interpreter (must be set before kernel imports)."""

import copy
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(autouse=True)
def _restore_thread_count():
    """Trainers run in-process set torch's thread count; float reductions (and so measured TVs) depend on it."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny_mdlm():
    """The embedded tiny-mdlm pipeline, progress bars off. Module scope, not session: ``compile=True`` caches
    its graphs on the model (``_compiled_cores``), which later ``copy.deepcopy(pipe.model)`` calls would copy."""
    from vispec.pipelines import MaskedDiffusionLMPipeline

    pipeline = MaskedDiffusionLMPipeline.from_pretrained("vispec/tiny-mdlm")
    pipeline.set_progress_bar_config(disable=True)
    return pipeline


@pytest.fixture(scope="module")
def tiny_mdlm64(tiny_mdlm):
    """tiny-mdlm's model in float64: padded and unpadded rows agree to ~1e-15, so arg-max ties cannot flip."""
    return copy.deepcopy(tiny_mdlm.model).double().eval()
