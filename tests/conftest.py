"""Test configuration: run Triton kernels in the interpreter (must be set before kernel imports)."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
