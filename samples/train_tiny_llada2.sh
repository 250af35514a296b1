#!/usr/bin/env bash
# Reproduce the embedded tiny-llada2 (seeded), on CPU: tiny-mdlm upcycled to the LLaDA2 MoE layout, fine-tuned with
# the block-diffusion objective (2500 steps of 16 rows, 0.7-0.9 s per step on one busy core: ~30-36 min), then the
# forwards bench against diffusers' LLaDA2Pipeline defaults and the pipeline folder. Logs to out/tiny-llada2/train.log.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p out/tiny-llada2
OMP_NUM_THREADS=1 vispec train llada2 --out out/tiny-llada2 2>&1 | tee out/tiny-llada2/train.log
vispec train assemble-llada2 --trained out/tiny-llada2 --out models/pretrained/tiny-llada2
OMP_NUM_THREADS=1 python samples/bench_text_llada2.py --model tiny-llada2 --num-problems 256 \
    --out samples/bench-text-llada2.tiny-llada2
vispec train assemble-llada2 --trained out/tiny-llada2 --out models/pretrained/tiny-llada2 \
    --bench samples/bench-text-llada2.tiny-llada2.json
