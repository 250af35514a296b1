#!/usr/bin/env bash
# Reproduce the embedded tiny-mdlm-long model (seeded), on CPU, in three fine-tuning stages from the embedded
# tiny-mdlm (same tokenizer). Every step trains on answer canvases of 32, and every 3rd step also on a batch of 8
# at 256 (the answer, <|eot_id|>, then EOS padding out to far positions):
#   1. task weights favouring sort and reverse (lr 1e-3, at most 36 min);
#   2. arithmetic weighted back up (0.45 / 0.4 / 0.15; lr 5e-4, at most 33 min);
#   3. sort weighted up (0.3 / 0.6 / 0.1; lr 3e-4, at most 15 min).
# Each stage ends with greedy one-token-per-step decoding at gen length 256 (blocks of 32) on 200 test problems
# per task; the pipeline folder (defaults gen 256, block 32) records every stage. Stages stop at their step count
# or their minute cap, whichever comes first, so the steps reached depend on the CPU.
# ~2 h on 2 cores with the filter. Logs to out/tiny-mdlm-long*/train.log.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p out/tiny-mdlm-long
OMP_NUM_THREADS=2 vispec train mdlm --out out/tiny-mdlm-long --init-from vispec/tiny-mdlm \
    --task-weights 0.15 0.425 0.425 --answer-length 32 --long-answer-length 256 --long-every 3 --long-batch-size 8 \
    --steps 5500 --max-minutes 36 --lr 1e-3 --warmup 100 --seed 0 \
    --eval-every 1000 --eval-n 50 --eval-all-tasks \
    --final-eval-n 200 --eval-answer-length 256 --eval-block-length 32 --eval-batch-size 100 \
    2>&1 | tee out/tiny-mdlm-long/train.log
mkdir -p out/tiny-mdlm-long-2 out/tiny-mdlm-long-3
OMP_NUM_THREADS=2 vispec train mdlm --out out/tiny-mdlm-long-2 --init-from out/tiny-mdlm-long \
    --task-weights 0.45 0.4 0.15 --answer-length 32 --long-answer-length 256 --long-every 3 --long-batch-size 8 \
    --steps 4200 --max-minutes 33 --lr 5e-4 --warmup 50 --seed 1 --eval-every 0 \
    --final-eval-n 200 --eval-all-tasks --eval-answer-length 256 --eval-block-length 32 --eval-batch-size 100 \
    2>&1 | tee out/tiny-mdlm-long-2/train.log
OMP_NUM_THREADS=2 vispec train mdlm --out out/tiny-mdlm-long-3 --init-from out/tiny-mdlm-long-2 \
    --task-weights 0.3 0.6 0.1 --answer-length 32 --long-answer-length 256 --long-every 3 --long-batch-size 8 \
    --steps 2400 --max-minutes 15 --lr 3e-4 --warmup 50 --seed 2 --eval-every 0 \
    --final-eval-n 200 --eval-all-tasks --eval-answer-length 256 --eval-block-length 32 --eval-batch-size 100 \
    2>&1 | tee out/tiny-mdlm-long-3/train.log
vispec train assemble-mdlm --trained out/tiny-mdlm-long-3 --out models/pretrained/tiny-mdlm-long \
    --gen-length 256 --block-length 32 --max-sequence-length 512 --script samples/train_tiny_mdlm_long.sh
# Learn2PD's filter, trained on the model's own decodes (LLaDA's baseline answers, then the oracle pass) and added
# to the folder as its `filter` component (~20 min on 2 cores, most of it the 256-step reference decodes).
OMP_NUM_THREADS=2 vispec train filter --model models/pretrained/tiny-mdlm-long --out models/pretrained/tiny-mdlm-long \
    --prompts-per-task 32 --threads 2 2>&1 | tee out/tiny-mdlm-long/filter.log
