#!/bin/bash
# before (base worktree at 2a4c8db) and after (working tree), interleaved A B A B, 2 threads
DEC="bench decoders --vocab-size 4096 --num-images 2 --methods ar,sjd-horizontal,mc-sjd-maximal,mc-sjd-gumbel"
IMG="bench image --num-images 64"
for round in 1 2; do
  (cd /tmp/base && .venv/bin/vispec $DEC --json /tmp/ab/dec-before-$round.json > /tmp/ab/dec-before-$round.txt 2>&1)
  (cd /work/main && .venv/bin/vispec $DEC --json /tmp/ab/dec-after-$round.json > /tmp/ab/dec-after-$round.txt 2>&1)
done
(cd /tmp/base && .venv/bin/vispec $IMG --json /tmp/ab/img-before.json > /tmp/ab/img-before.txt 2>&1)
(cd /work/main && .venv/bin/vispec $IMG --json /tmp/ab/img-after.json > /tmp/ab/img-after.txt 2>&1)
echo done > /tmp/ab/DONE
