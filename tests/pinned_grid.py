"""The grid of decoding settings whose outputs are pinned (tests/decoding/test_pinned_outputs.py).

Recorded once before the core refactor of issue 11 (``python tests/pinned_grid.py --record``); the
test re-runs every case and requires identical tokens and NFE. Each case is plain data; the runners
below translate it into calls of the current API, so the grid outlives API changes.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
PINNED_FILE = os.path.join(HERE, "data", "pinned_outputs.json")
RECORDED_THREADS = 2  # torch threads of the recording (TVs are float reductions; tokens do not depend on it)

SAMPLINGS = {
    "cfg": dict(guidance_scale=3.0, temperature=1.0),
    "warped": dict(guidance_scale=2.0, temperature=0.9, top_k=12, top_p=0.95),
    "greedy": dict(guidance_scale=1.5, temperature=0.0),
    "plain": dict(guidance_scale=1.0, temperature=1.0),
}

# (decoding label, acceptance) on tiny-c2i: 256 tokens per image
C2I_METHODS = [
    ("ar", None), ("sjd-random", None), ("sjd-horizontal", None), ("sjd-vertical", None), ("sjd:window=4", None),
    ("mc-sjd-maximal", None), ("mc-sjd-gumbel", None), ("mc-sjd:window=6", None), ("sd", None),
    ("mc-sjd-maximal", "lantern:k=100,delta=0.1"), ("sjd-horizontal", "gsd"), ("sd", "lantern:k=50,delta=0.2"),
    ("mc-sjd-maximal", "lantern:k=10,delta=2"),
]
# batch compositions: seeds of a batch (one generator per image) and labels
C2I_BATCHES = [((11, 12, 13), (3, 3, 7)), ((12,), (3,))]


def c2i_cases() -> list[dict]:
    cases = []
    for decoding, acceptance in C2I_METHODS:
        for sampling in ("cfg", "warped"):
            for seeds, labels in C2I_BATCHES:
                cases.append(dict(model="tiny-c2i", decoding=decoding, acceptance=acceptance, sampling=sampling,
                                  seeds=list(seeds), labels=list(labels)))
    for decoding in ("ar", "sjd-horizontal", "mc-sjd-maximal", "mc-sjd-gumbel", "sd"):
        cases.append(dict(model="tiny-c2i", decoding=decoding, acceptance=None, sampling="greedy", seeds=[5, 6], labels=[1, 2]))
    return cases


GPT_METHODS = [
    ("ar", None), ("sjd-random", None), ("sjd-horizontal", None), ("sjd-vertical", None), ("mc-sjd-maximal", None),
    ("mc-sjd-gumbel", None), ("sjd:window=3", None), ("sd", None), ("sd:window=3", None),
    ("mc-sjd-maximal", "lantern:k=3,delta=0.1"), ("sjd-random", "gsd:d_thr=5"), ("sd", "lantern:k=3,delta=0.3"),
]


def gpt_cases() -> list[dict]:
    cases = []
    for decoding, acceptance in GPT_METHODS:
        for sampling in ("cfg", "warped", "greedy", "plain"):
            for seeds, labels in (((1, 2, 3, 4), (0, 1, 2, 0)), ((3,), (2,))):
                cases.append(dict(model="tiny-gpt", decoding=decoding, acceptance=acceptance, sampling=sampling,
                                  seeds=list(seeds), labels=list(labels)))
    return cases


MDLM_STRATEGIES = [("llada", {}), ("llada", {"remasking": "random"}), ("threshold", {"threshold": 0.9}),
                   ("factor", {"factor": 1.0}), ("entropy", {"gamma": 0.1})]
MDLM_PROMPTS = ["sort the numbers : 5 3 9 3 1", "reverse the letters : k d m a", "what is 12 + 7 ?"]


def mdlm_cases() -> list[dict]:
    cases = []
    for strategy, settings in MDLM_STRATEGIES:
        for cache in ("none", "prefix", "dual"):
            cases.append(dict(model="tiny-mdlm", strategy=strategy, settings=settings, cache=cache, temperature=0.0,
                              llada_cfg=0.0, seeds=[1, 2, 3], prompts=MDLM_PROMPTS))
        cases.append(dict(model="tiny-mdlm", strategy=strategy, settings=settings, cache="dual", temperature=0.7,
                          llada_cfg=0.5, seeds=[4, 5, 6], prompts=MDLM_PROMPTS))
    return cases


def all_cases() -> list[dict]:
    return c2i_cases() + gpt_cases() + mdlm_cases()


def case_key(case: dict) -> str:
    return json.dumps(case, sort_keys=True)


def digest(tokens: torch.Tensor) -> str:
    return hashlib.sha1(tokens.to(torch.int64).contiguous().numpy().tobytes()).hexdigest()[:16]


def record(results: dict, case: dict, tokens: torch.Tensor, nfe, extra=None) -> None:
    results[case_key(case)] = {
        "tokens": [digest(row) for row in tokens.cpu()],
        "nfe": [int(x) for x in nfe],
        **({} if extra is None else extra),
    }


if __name__ == "__main__" and "--record" in sys.argv:
    sys.path.insert(0, HERE)
    from pinned_runner import run_case  # noqa: E402

    torch.set_num_threads(RECORDED_THREADS)
    results: dict = {}
    for i, case in enumerate(all_cases()):
        run_case(case, results)
        print(i, case_key(case)[:100], flush=True)
    with open(PINNED_FILE, "w") as handle:
        json.dump(results, handle, indent=0, sort_keys=True)
    print(f"wrote {len(results)} cases to {PINNED_FILE}")
