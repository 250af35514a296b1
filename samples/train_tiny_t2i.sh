#!/usr/bin/env bash
# Reproduce the embedded tiny-t2i model (seeded), on CPU. Each step logs to out/tiny-t2i/*.log.
# The shipped decoder was trained on the current scenes (flat backgrounds, objects 0.26-0.42 of the shorter side)
# with the scene VQ and CLIP of the previous tiny-t2i, which were trained before the scenes changed (gently ramped
# backgrounds, objects 0.20-0.40; their records are in the model folder's README): the VQ's round trip passes the
# scene checks on 0.92 of current training scenes, against 0.80 of the old ones. FROM_SCRATCH=1 first trains a VQ
# and a CLIP on the current scenes (~25 min, side by side on one thread each) and uses those instead.
# The decoder trains in two stages under bfloat16 autocast (--bf16, where the CPU multiplies bfloat16 natively:
# AVX512-BF16 or AMX): 3000 steps from scratch at learning rate 1e-3 on 48000 scenes (~8 min of scene tokenisation,
# then ~49 min at ~1 s a step on 2 cores), assembled as a pipeline, then 2200 steps continued from it (--init-from)
# at 5e-4 on 36000 fresh scenes (seed 1; ~5 min of tokenisation, then ~36 min). About 1 h 40 min in all; the model
# card records both stages, their total minutes, and both loss logs (logs/transformer-init.jsonl is stage one's).
# In float32 the second stage lifted AR's scene checks from 0.57 to 0.66 on training compositions (96 scenes); the
# shipped bfloat16 model passes 0.62 (0.64 held out; docs/models.md). On a CPU without native bfloat16 the script
# trains in float32 instead: ~1.6 s a step, about 2.8 hours, and other weights (the float32 model, trained earlier,
# passed the same share of checks within noise).
set -euo pipefail
cd "$(dirname "$0")/.."
BF16=$(python -c "from vispec.eval.train.checks import native_bf16; print('--bf16' if native_bf16() else '')")
mkdir -p out/tiny-t2i
VQ=models/pretrained/tiny-t2i/vqvae
CLIP=models/pretrained/tiny-t2i/clip
if [ "${FROM_SCRATCH:-0}" = 1 ]; then
    OMP_NUM_THREADS=1 vispec train clip --out out/tiny-t2i/clip > out/tiny-t2i/clip.log 2>&1 &
    OMP_NUM_THREADS=1 vispec train vq --data scenes --steps 2200 --codebook-size 512 --out out/tiny-t2i/vqvae 2>&1 | tee out/tiny-t2i/vq.log
    wait
    VQ=out/tiny-t2i/vqvae
    CLIP=out/tiny-t2i/clip
else  # assemble-t2i copies its inputs into models/pretrained/tiny-t2i: work from a copy
    rm -rf out/tiny-t2i/vqvae out/tiny-t2i/clip
    cp -r "$VQ" out/tiny-t2i/vqvae && cp -r "$CLIP" out/tiny-t2i/clip
    VQ=out/tiny-t2i/vqvae
    CLIP=out/tiny-t2i/clip
fi
OMP_NUM_THREADS=2 vispec train t2i --vq "$VQ" --out out/tiny-t2i/stage1 --num-sequences 48000 --steps 3000 \
    --layers 6 --batch-size 16 --lr 1e-3 --warmup 100 --seed 0 $BF16 2>&1 | tee out/tiny-t2i/t2i.log
vispec train assemble-t2i --vq "$VQ" --t2i out/tiny-t2i/stage1 --clip "$CLIP" --out out/tiny-t2i/stage1-pipeline
OMP_NUM_THREADS=2 vispec train t2i --vq "$VQ" --init-from out/tiny-t2i/stage1-pipeline --out out/tiny-t2i/transformer \
    --num-sequences 36000 --steps 2200 --layers 6 --batch-size 16 --lr 5e-4 --warmup 50 --seed 1 $BF16 2>&1 \
    | tee out/tiny-t2i/t2i-continued.log
vispec train assemble-t2i --vq "$VQ" --t2i out/tiny-t2i/transformer --clip "$CLIP" --out models/pretrained/tiny-t2i
