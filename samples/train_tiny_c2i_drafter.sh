#!/usr/bin/env bash
# Reproduce the embedded tiny-c2i drafter (seeded), on CPU, and add it to the tiny-c2i pipeline.
# 4096 AR samples of tiny-c2i (CFG 3.0) are the distillation set; the drafter (dim 128, 2 layers) is
# trained on KL(p_target || q_drafter) against tiny-c2i's own next-token distributions, both CFG branches.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p out/tiny-c2i-drafter
vispec train drafter --steps 2500 --batch-size 16 --sample-decoding ar --num-sequences 4096 --out out/tiny-c2i-drafter 2>&1 | tee out/tiny-c2i-drafter/train.log
vispec train assemble-drafter --drafter out/tiny-c2i-drafter --pipeline models/pretrained/tiny-c2i
