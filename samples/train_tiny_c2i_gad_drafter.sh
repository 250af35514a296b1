#!/usr/bin/env bash
# Reproduce the embedded tiny-c2i GAD block drafter (seeded), on CPU, and add it to the tiny-c2i pipeline.
# 2048 AR samples of tiny-c2i (CFG 3.0) are the distillation set. The drafter (dim 128, 2 layers) is *causal*
# (--attention causal --context 0, the defaults): an AR GPT whose unknown block positions are [MASK] inputs, started from
# tiny-c2i's AR drafter (--warm-start drafter, the default: the same blocks plus a [MASK] row), so the block's first
# row is an AR drafter's next-token prediction. It is trained on KL(p_tiny-c2i(. | x_<n+i) || q_i(. | c, x_<n)),
# packed: one forward per sequence gives the first row at every prefix length and the masks of 16 random blocks
# (vispec/eval/train/gad.py). The embedded one: 3000 steps, 38.8 min on one core of a busy 2-core machine (the
# samples cached from an earlier run); final TV from the teacher 0.24 at the block's first row (the AR drafter:
# 0.25) and 0.36 at the masks (the bidirectional drafter embedded before: 0.44 and 0.45).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p out/tiny-c2i-gad-drafter
OMP_NUM_THREADS=1 vispec train gad-drafter --num-sequences 2048 --steps 3000 --out out/tiny-c2i-gad-drafter 2>&1 | tee out/tiny-c2i-gad-drafter/train.log
vispec train assemble-gad-drafter --drafter out/tiny-c2i-gad-drafter --pipeline models/pretrained/tiny-c2i
