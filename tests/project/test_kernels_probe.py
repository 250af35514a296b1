"""The checkout's ``kernels/`` folder (installed as ``vispec.kernels``) is found as Hugging Face's top-level
``kernels`` package when Python starts in the repository root. transformers probes for that package
(``is_kernels_available``: ``find_spec``, the distribution's version, then ``import kernels`` and its
``__version__``), and importing diffusers' pipelines runs the probe: it must answer False and import no vispec,
and an installed Hugging Face ``kernels`` must still be the one ``import kernels`` gives."""

from __future__ import annotations

import importlib.metadata
import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]

PROBE = """
import importlib.util, json, sys
spec = importlib.util.find_spec("kernels")
from diffusers import DiffusionPipeline
from diffusers.utils import is_kernels_available as diffusers_kernels
from transformers.utils import is_kernels_available as transformers_kernels
import kernels
print(json.dumps({"origin": spec and spec.origin, "transformers": transformers_kernels(), "diffusers": diffusers_kernels(),
                  "vispec": sorted(m for m in sys.modules if m == "vispec" or m.startswith("vispec.")),
                  "names": sorted(n for n in vars(kernels) if not n.startswith("__"))}))
"""


@pytest.mark.slow
def test_probe_in_the_repository_root_imports_no_vispec():
    try:
        pytest.skip(f"Hugging Face's kernels {importlib.metadata.version('kernels')} is installed: the next test's case")
    except importlib.metadata.PackageNotFoundError:
        pass
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["origin"] == str(ROOT / "kernels" / "__init__.py")  # not vacuous: the folder is what the probe finds
    assert found["transformers"] is False and found["diffusers"] is False
    assert found["vispec"] == [] and found["names"] == []


def test_an_installed_hugging_face_kernels_package_still_wins(tmp_path):
    """With Hugging Face's ``kernels`` further down ``sys.path`` (a stand-in here), ``import kernels`` in the
    repository root gives that package, not vispec's folder, and still imports no vispec."""
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "__init__.py").write_text("__version__ = '0.99.0'\n\ndef get_kernel(name):\n    return name\n")
    code = ("import json, sys, kernels; print(json.dumps({'file': kernels.__file__, 'kernel': kernels.get_kernel('k'), "
            "'vispec': [m for m in sys.modules if m.split('.')[0] == 'vispec']}))")
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found == {"file": str(tmp_path / "kernels" / "__init__.py"), "kernel": "k", "vispec": []}


def test_the_package_still_exports_its_api():
    import vispec.kernels as kernels

    assert kernels.__name__ == "vispec.kernels"
    assert {"Stream", "exponentials", "uniforms"} <= set(kernels.__all__)
    assert all(hasattr(kernels, name) for name in kernels.__all__)
