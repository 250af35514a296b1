"""Test configuration: run Triton kernels in the interpreter (must be set before kernel imports), and draw the
keyed CPU noise eagerly (``VISPEC_FUSED_NOISE=0``, bit-identical to the fused path): no test process, nor any
process a test starts (README examples, torchrun workers, remote-code loads inherit the environment), pays the
fused noise's compile; ``tests/kernels/test_race.py`` switches the fused path on for its own tests. Set the variable
before running pytest to choose otherwise.

Layout: one folder per layer (``kernels``, ``decoding``, ``dllm``, ``models``, ``pipelines``, ``cli``, ``eval``), the
statistical certificates together in ``exactness``, and project-wide checks (import layering, README examples,
the ``kernels`` name probe) in ``project``. Helpers shared between test files live beside this file
(``helpers.py``: tiny models, exact joints, dummy pipelines; ``unified_helpers.py``; ``*_reference.py``:
independent reference implementations; ``pinned_*.py``) and import by name (``pythonpath`` in ``pyproject.toml``);
no test file imports another test file.

``slow``: statistical and long tests. Whole files are marked here (:data:`SLOW_FILES`), single tests where they
are defined; ``pytest -m "not slow"`` is the fast inner loop, ``make test`` runs everything."""

import copy
import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("VISPEC_FUSED_NOISE", "0")
# the shape chooser's cost curves are not written to the user's cache (~/.cache/vispec): a test that checks the
# cache points VISPEC_CACHE_DIR at a folder of its own
os.environ.setdefault("VISPEC_CACHE_DIR", "off")

import pytest  # noqa: E402
import torch  # noqa: E402

# Under pytest-xdist (``make test`` runs one worker per core) each worker computes on one thread unless
# OMP_NUM_THREADS says otherwise: the tiny models' ops are too small to share between cores, and two workers
# with two threads each on two cores spend more CPU time than they gain. Tests that depend on the count set it.
# The processes tests start (README examples, CLI runs, torchrun jobs) inherit the setting through the environment.
if os.environ.get("PYTEST_XDIST_WORKER") and "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)

# test files that are statistical certificates or run for minutes (relative to tests/)
SLOW_FILES = (
    "exactness/",  # chi-square certificates against exact joints: tens of thousands of decodes each
    "dllm/test_compiled_loop.py",  # torch.compile of every cache mode
    "eval/test_distributed_jobs.py",  # torchrun jobs of two processes
    "eval/test_bench_image_t2i.py",  # text-to-image benchmarks on tiny-t2i (a minute to set up)
    "eval/test_tiny_c2i_training.py",  # trains tiny-c2i's parts
    "project/test_readme.py",  # every README example in a fresh process
    "project/test_readme_examples.py",
)


def pytest_collection_modifyitems(config, items):
    """Marks :data:`SLOW_FILES`, then puts the slow tests first (a stable sort): under xdist the long tests
    then start early and the short ones fill the gaps, instead of one long test running alone at the end."""
    root = os.path.dirname(os.path.abspath(__file__))
    for item in items:
        path = os.path.relpath(str(item.path), root).replace(os.sep, "/")
        if path.startswith(SLOW_FILES):
            item.add_marker(pytest.mark.slow)
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@pytest.fixture(autouse=True)
def _restore_thread_count():
    """Trainers run in-process set torch's thread count; float reductions (and so measured TVs) depend on it."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def embedded_text_pipeline(name: str):
    """An embedded masked diffusion LM pipeline (``"vispec/tiny-mdlm"``, ...), progress bars off."""
    from vispec.pipelines import MaskedDiffusionLMPipeline

    pipeline = MaskedDiffusionLMPipeline.from_pretrained(name)
    pipeline.set_progress_bar_config(disable=True)
    return pipeline


@pytest.fixture(scope="module")
def tiny_mdlm():
    """The embedded tiny-mdlm pipeline, progress bars off. Module scope, not session: ``compile=True`` caches
    its graphs on the model (``_compiled_cores``), which later ``copy.deepcopy(pipe.model)`` calls would copy."""
    return embedded_text_pipeline("vispec/tiny-mdlm")


@pytest.fixture(scope="module")
def tiny_llada2():
    """The embedded tiny-llada2 pipeline (block-causal MoE), progress bars off; module scope as :func:`tiny_mdlm`."""
    return embedded_text_pipeline("vispec/tiny-llada2")


@pytest.fixture(scope="module")
def tiny_mdlm64(tiny_mdlm):
    """tiny-mdlm's model in float64: padded and unpadded rows agree to ~1e-15, so arg-max ties cannot flip."""
    return copy.deepcopy(tiny_mdlm.model).double().eval()
