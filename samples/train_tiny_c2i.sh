#!/usr/bin/env bash
# Reproduce the embedded tiny-c2i model from scratch (seeded), on CPU. Each step logs to out/tiny-c2i/*.log.
# Budget on 2 CPU cores: VQ ~40 min, evaluator ~15 min, GPT <= 90 min (tokenisation included).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p out/tiny-c2i
vispec train vq --out out/tiny-c2i/vqvae 2>&1 | tee out/tiny-c2i/vq.log
vispec train evaluator --out out/tiny-c2i/evaluator 2>&1 | tee out/tiny-c2i/evaluator.log
vispec train gpt --vq out/tiny-c2i/vqvae --out out/tiny-c2i/transformer 2>&1 | tee out/tiny-c2i/gpt.log
vispec train assemble --vq out/tiny-c2i/vqvae --gpt out/tiny-c2i/transformer --evaluator out/tiny-c2i/evaluator \
    --out models/pretrained/tiny-c2i
