#!/usr/bin/env bash
# The GPU check of issue 33 in one go: `vispec bench decoders` on tiny-c2i's logits at GPT-L cost (tiny-c2i@GPT-L),
# bf16, eager and compiled steps (compiled: CUDA graphs, torch.compile mode reduce-overhead), AR against MC-SJD,
# with the roofline report (cost curve, bound, % of roofline, wall and CPU clocks) and `vispec bench kernels`'
# bandwidth report (% of peak HBM) in the same JSON and table. One batch size (1) by default: on an H200 (2026-11-27)
# the kernel report took 7 s, eager calibration 41 s and compiled calibration 150 s (about 27 s of inductor compile
# per window shape of GPT-L), so batch 1 needs about 6-7 minutes and each further batch size about 4 more; the bench rewrites its JSON after every batch size, so a run cut by the time limit keeps
# what it measured ("complete": false).
#
#   samples/gpu_bench.sh OUT_DIR                    # on the GPU machine
#   samples/gpu_bench.sh --device cpu OUT_DIR       # a dry run on CPU (or DEVICE=cpu): tiny-c2i, 16 tokens, batch 1,
#                                                   # eager only (no compile), to check the plumbing
#
# Overrides (environment): MODEL, BATCHES, IMAGES, ROUNDS, TOKENS, WINDOW, METHODS, LIMIT_S (the bench's time limit).
# Writes OUT_DIR/decoders.json, OUT_DIR/decoders.txt (the printed tables), OUT_DIR/progress.log, OUT_DIR/env.txt.
set -euo pipefail
. "$(dirname "$0")/gpu_common.sh"

usage="usage: samples/gpu_bench.sh [--device cuda|cpu] OUT_DIR"
DEVICE=${DEVICE:-cuda}
OUT=""
while [ $# -gt 0 ]; do
  case "$1" in
    --device) [ $# -ge 2 ] || { echo "--device needs a value (cuda or cpu); $usage" >&2; exit 2; }; DEVICE=$2; shift 2 ;;
    --device=*) DEVICE=${1#--device=}; shift ;;
    -h|--help) echo "$usage"; exit 0 ;;
    -*) echo "unknown option '$1'; $usage" >&2; exit 2 ;;
    *) [ -z "$OUT" ] || { echo "one OUT_DIR expected, got '$OUT' and '$1'; $usage" >&2; exit 2; }; OUT=$1; shift ;;
  esac
done
[ -n "$OUT" ] || { echo "$usage" >&2; exit 2; }
case "$DEVICE" in cuda|cpu) ;; *) echo "--device must be cuda or cpu, got '$DEVICE'" >&2; exit 2 ;; esac
mkdir -p -- "$OUT"

stamp() { echo "[$(date -u +%H:%M:%S)] $*" | tee -a "$OUT/progress.log" >&2; }

if [ "$DEVICE" = cuda ]; then
  MODEL=${MODEL:-tiny-c2i@GPT-L}; DTYPE=bfloat16; BATCHES=${BATCHES:-1}; IMAGES=${IMAGES:-2}; ROUNDS=${ROUNDS:-2}
  TOKENS=${TOKENS:-256}; WINDOW=${WINDOW:-16}; THREADS=0; LIMIT_S=${LIMIT_S:-380}; COMPILE="--compile --cuda-graphs"
else  # the dry run: eager (a CPU compile of every window shape takes minutes), the smallest decode
  MODEL=${MODEL:-tiny-c2i}; DTYPE=float32; BATCHES=${BATCHES:-1}; IMAGES=${IMAGES:-1}; ROUNDS=${ROUNDS:-1}
  TOKENS=${TOKENS:-16}; WINDOW=${WINDOW:-4}; THREADS=1; LIMIT_S=${LIMIT_S:-600}; COMPILE=""
fi
METHODS=${METHODS:-ar,mc-sjd}

stamp "environment -> $OUT/env.txt"
environment_report "$DEVICE" > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt" >&2

stamp "vispec bench decoders --model $MODEL --device $DEVICE --dtype $DTYPE $COMPILE --kernels --batch-sizes $BATCHES (limit ${LIMIT_S}s)"
set +e
timeout --signal=INT --kill-after=20 "$LIMIT_S" \
  vispec bench decoders --model "$MODEL" --device "$DEVICE" --dtype "$DTYPE" $COMPILE --kernels \
    --batch-sizes "$BATCHES" --methods "$METHODS" --image-tokens "$TOKENS" --window "$WINDOW" --num-images "$IMAGES" \
    --rounds "$ROUNDS" --threads "$THREADS" --json "$OUT/decoders.json" \
  > "$OUT/decoders.txt" 2> >(while IFS= read -r line; do stamp "$line"; done)
status=$?
set -e
if [ "$status" -ne 0 ] && [ -s "$OUT/decoders.json" ]; then
  stamp "the bench stopped with exit status $status (124/130: the ${LIMIT_S}s limit); the tables of what it finished:"
  tables_from_json "$OUT/decoders.json" >> "$OUT/decoders.txt" || true
fi
cat "$OUT/decoders.txt"
kept=""
for file in "$OUT/decoders.json" "$OUT/decoders.txt" "$OUT/progress.log" "$OUT/env.txt"; do
  [ -s "$file" ] && kept="$kept ${file}"
done
if [ "$status" -eq 0 ]; then stamp "done:$kept"; else stamp "stopped (exit status $status); kept:${kept:- nothing}"; fi
exit "$status"
