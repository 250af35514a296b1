#!/usr/bin/env bash
# Reproduce the embedded tiny-t2i model from scratch (seeded), on CPU. Each step logs to out/tiny-t2i/*.log.
# Budget on 2 CPU cores: scene VQ and CLIP side by side on one thread each (~25 min), then the decoder on both
# cores (~75 min, scene tokenisation included).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p out/tiny-t2i
OMP_NUM_THREADS=1 vispec train clip --out out/tiny-t2i/clip > out/tiny-t2i/clip.log 2>&1 &
OMP_NUM_THREADS=1 vispec train vq --data scenes --steps 2200 --codebook-size 512 --out out/tiny-t2i/vqvae 2>&1 | tee out/tiny-t2i/vq.log
wait
vispec train t2i --vq out/tiny-t2i/vqvae --out out/tiny-t2i/transformer --num-sequences 40000 --steps 2600 2>&1 | tee out/tiny-t2i/t2i.log
vispec train assemble-t2i --vq out/tiny-t2i/vqvae --t2i out/tiny-t2i/transformer --clip out/tiny-t2i/clip --out models/pretrained/tiny-t2i
