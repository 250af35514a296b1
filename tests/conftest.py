"""Test configuration: run Triton kernels in the interpreter (must be set before kernel imports)."""

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
