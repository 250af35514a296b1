"""Outputs pinned before the core refactor (issue 11): tokens, NFE and accepted drafts of every case in
tests/pinned_grid.py (decoders and variants, acceptance rules, sampling settings, seeds, batch
compositions on tiny-c2i and a tiny random GPT; every dLLM strategy x cache on tiny-mdlm) must stay
identical. Lossy rules' measured TV must agree to 1e-9."""

from __future__ import annotations

import json
import math

import pytest
import torch

from pinned_grid import PINNED_FILE, RECORDED_THREADS, all_cases, case_key
from pinned_runner import run_case

with open(PINNED_FILE) as handle:
    PINNED = json.load(handle)


@pytest.mark.parametrize("model", ["tiny-c2i", "tiny-gpt", "tiny-mdlm"])
def test_outputs_match_the_pinned_grid(model):
    torch.set_num_threads(RECORDED_THREADS)  # float reductions, and so the measured TVs, depend on it (restored by conftest)
    cases = [c for c in all_cases() if c["model"] == model]
    assert cases and all(case_key(c) in PINNED for c in cases)
    results: dict = {}
    mismatches = []
    for case in cases:
        run_case(case, results)
        key = case_key(case)
        got, want = results[key], PINNED[key]
        for field in ("tokens", "nfe", "accepted", "counted"):
            if field in want and got.get(field) != want[field]:
                mismatches.append(f"{field} of {key}: got {got.get(field)}, pinned {want[field]}")
        if "tv_mean" in want:
            same = all(math.isclose(a, b, rel_tol=0, abs_tol=1e-9) or (math.isnan(a) and math.isnan(b))
                       for a, b in zip(got.get("tv_mean", []), want["tv_mean"]))
            if not same or len(got.get("tv_mean", [])) != len(want["tv_mean"]):
                mismatches.append(f"tv_mean of {key}: got {got.get('tv_mean')}, pinned {want['tv_mean']}")
    assert not mismatches, f"{len(mismatches)} of {len(cases)} cases changed:\n" + "\n".join(mismatches[:20])
