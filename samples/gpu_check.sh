#!/usr/bin/env bash
# One GPU lease's worth of checks (issue 45 item 6), in the order that keeps the most when time runs out:
#   1. the CUDA kernel tests (`pytest -m gpu tests/kernels`: verification, unmasking, recursive rejection sampling);
#   2. `vispec bench decoders` on tiny-c2i@GPT-L in bf16 with eager steps at batch 1 and 16: AR, MC-SJD (window 16),
#      SJD-PAC and the exact shape chooser (`auto`), with `vispec bench kernels`' bandwidth report;
#   3. the GPU command's compiled steps (torch.compile, CUDA graphs) at batch 1 for AR and MC-SJD (an inductor
#      compile of GPT-L's step took ~40 s per window shape on an H200 on 2026-12-04: batch 1 needs ~7 minutes).
# Each phase has its own limit inside DEADLINE_S (default 540 s); the bench rewrites its JSON after every measured
# row, so a phase cut short keeps what it measured ("complete": false). The step-cost curves the bench calibrated
# come back as step-costs.tar: a curve file for `--cost-curve PATH` on another machine.
#
#   samples/gpu_check.sh OUT_DIR        # on the GPU machine; OUT_DIR gets at most 7 files
#
# samples/gpu_bench.sh runs one `bench decoders` (compiled steps on CUDA); this script is a whole lease: install,
# kernel tests, eager and compiled benches, each bounded, so one call of the device tool returns all of it.
#
# Where vispec is not installed there, wheels in .whl/ (diffusers and what it needs) are installed with vispec
# itself, offline. It needs only tiny-c2i's weights: where a checkout must travel in under 64 MiB (this repository
# is ~150 MB), the other embedded models can stay behind.
# Overrides (environment): PHASES (default tests,eager,compiled), EAGER_BATCHES (default 1,16), COMPILED_BATCHES
# (default 1), DEADLINE_S, DEVICE (cpu: a dry run of the plumbing), MODEL, TOKENS, IMAGES, ROUNDS.
set -uo pipefail
. "$(dirname "$0")/gpu_common.sh"

usage="usage: samples/gpu_check.sh OUT_DIR"
[ $# -eq 1 ] && [ "${1#-}" = "$1" ] || { echo "$usage" >&2; exit 2; }
OUT=$1
DEADLINE_S=${DEADLINE_S:-540}
DEVICE=${DEVICE:-cuda}; MODEL=${MODEL:-tiny-c2i@GPT-L}; PHASES=${PHASES:-tests,eager,compiled}; TOKENS=${TOKENS:-256}; IMAGES=${IMAGES:-1}; ROUNDS=${ROUNDS:-2}
case "$DEVICE" in cuda|cpu) ;; *) echo "DEVICE must be cuda or cpu, got '$DEVICE'" >&2; exit 2 ;; esac
for p in ${PHASES//,/ }; do
  case "$p" in tests|eager|compiled) ;; *) echo "PHASES: unknown phase '$p' (expected a comma-separated subset of tests,eager,compiled)" >&2; exit 2 ;; esac
done
[[ "$DEADLINE_S" =~ ^[0-9]+$ ]] || { echo "DEADLINE_S must be a whole number of seconds, got '$DEADLINE_S'" >&2; exit 2; }
mkdir -p -- "$OUT"
OUT=$(cd -- "$OUT" && pwd)  # the phases run in a folder of their own
LOG="$OUT/log.txt"
WORK=$(mktemp -d)
export VISPEC_CACHE_DIR="$WORK/cache" PYTHONUNBUFFERED=1
started=$SECONDS

stamp() { echo "[$(date -u +%H:%M:%S) +$((SECONDS - started))s] $*" | tee -a "$LOG" >&2; }
left() { echo $((DEADLINE_S - (SECONDS - started))); }
# run NAME SECONDS CMD...: CMD under a limit (INT first, so the bench writes what it has), its output in WORK/NAME.txt
run() {
  local name=$1 limit=$2; shift 2
  if [ "$limit" -lt 20 ]; then stamp "$name: skipped ($limit s left)"; return 0; fi
  stamp "$name (limit ${limit}s): $*"
  timeout --signal=INT --kill-after=15 "$limit" "$@" > "$WORK/$name.txt" 2> >(while IFS= read -r l; do stamp "  $l"; done)
  local status=$?
  stamp "$name: exit status $status"
  return 0
}

stamp "environment"
environment_report "$DEVICE" 2>&1 | tee -a "$LOG"

REPO=$(pwd)
cd "$WORK"  # from here on: the installed vispec, not the checkout's folders (vispec/ alone would shadow it)
if ! python3 -c "import vispec.eval, vispec.kernels" 2>/dev/null; then
  stamp "installing vispec (and .whl/*.whl) offline"
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --no-cache-dir \
    $(ls "$REPO"/.whl/*.whl 2>/dev/null) "$REPO" >> "$LOG" 2>&1 || { stamp "install failed"; exit 1; }
fi

phase() { [[ ",$PHASES," == *",$1,"* ]]; }
# keep NAME: the bench's printed tables in OUT/NAME.txt; from its partial JSON where the time limit cut it short
keep() {
  cp "$WORK/$1.txt" "$OUT/$1.txt"
  if [ ! -s "$OUT/$1.txt" ] && [ -s "$OUT/$1.json" ]; then
    tables_from_json "$OUT/$1.json" > "$OUT/$1.txt" 2>> "$LOG" || true
  fi
}

phase tests && run tests 90 env TRITON_INTERPRET=0 python3 -m pytest -q -p no:cacheprovider \
  --rootdir "$REPO" -c "$REPO/pyproject.toml" -m gpu "$REPO/tests/kernels"
phase tests && cp "$WORK/tests.txt" "$OUT/tests.txt"

bench=(python3 -c "from vispec.cli import main; main()" bench decoders --model "$MODEL" --device "$DEVICE"
       --dtype bfloat16 --image-tokens "$TOKENS" --window 16 --num-images "$IMAGES" --rounds "$ROUNDS")
eager_limit=$(( $(left) * 2 / 5 ))
phase compiled || eager_limit=$(( $(left) - 25 ))
phase eager && run eager "$eager_limit" "${bench[@]}" --methods ar,mc-sjd,sjd-pac,auto --batch-sizes "${EAGER_BATCHES:-1,16}" --kernels \
  --json "$OUT/eager.json" --plot "$WORK/eager.png"
phase eager && keep eager

phase compiled && run compiled "$(( $(left) - 25 ))" "${bench[@]}" --methods ar,mc-sjd \
  --batch-sizes "${COMPILED_BATCHES:-1}" --compile --cuda-graphs \
  --json "$OUT/compiled.json" --plot "$WORK/compiled.png"
phase compiled && keep compiled

if [ -d "$VISPEC_CACHE_DIR" ]; then tar -C "$VISPEC_CACHE_DIR" -cf "$OUT/step-costs.tar" . && stamp "step-costs.tar: $(tar -tf "$OUT/step-costs.tar" | grep -c json) curves"; fi
stamp "done: $(cd "$OUT" && ls | tr '\n' ' ')"
