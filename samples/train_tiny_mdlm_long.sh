#!/usr/bin/env bash
# Reproduce the embedded tiny-mdlm-long model (seeded), on CPU: fine-tune the embedded tiny-mdlm (same tokenizer)
# with task weights favouring sort and reverse and a canvas mix (answer length 32; every 3rd step a batch of 8 at
# 256: the answer, <|eot_id|>, then EOS padding out to far positions), evaluate greedy one-token-per-step decoding
# at gen length 256 with blocks of 32, then write the pipeline folder (defaults gen 256, block 32).
# ~50 min on 2 cores (training stops after 36 minutes at the latest; the step count reached depends on the CPU).
# Logs to out/tiny-mdlm-long/train.log.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p out/tiny-mdlm-long
OMP_NUM_THREADS=2 vispec train mdlm --out out/tiny-mdlm-long --init-from vispec/tiny-mdlm \
    --task-weights 0.15 0.425 0.425 --answer-length 32 --long-answer-length 256 --long-every 3 --long-batch-size 8 \
    --steps 5500 --max-minutes 36 --lr 1e-3 --warmup 100 --seed 0 \
    --eval-every 1000 --eval-n 50 --eval-all-tasks \
    --final-eval-n 200 --eval-answer-length 256 --eval-block-length 32 --eval-batch-size 100 \
    2>&1 | tee out/tiny-mdlm-long/train.log
vispec train assemble-mdlm --trained out/tiny-mdlm-long --out models/pretrained/tiny-mdlm-long \
    --gen-length 256 --block-length 32 --max-sequence-length 512 --script samples/train_tiny_mdlm_long.sh
# Learn2PD's filter, trained on the model's own decodes (LLaDA's baseline answers, then the oracle pass) and added
# to the folder as its `filter` component (~20 min on 2 cores, most of it the 256-step reference decodes).
OMP_NUM_THREADS=2 vispec train filter --model models/pretrained/tiny-mdlm-long --out models/pretrained/tiny-mdlm-long \
    --prompts-per-task 32 --threads 2 2>&1 | tee out/tiny-mdlm-long/filter.log
