#!/usr/bin/env bash
# Reproduce the embedded tiny-mdlm model from scratch (seeded), on CPU: task suite, tokenizer, LLaDA SFT
# (~65 min on 2 cores), then the pipeline folder. Logs to out/tiny-mdlm/train.log.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p out/tiny-mdlm
vispec train mdlm --out out/tiny-mdlm 2>&1 | tee out/tiny-mdlm/train.log
vispec train assemble-mdlm --trained out/tiny-mdlm --out models/pretrained/tiny-mdlm
