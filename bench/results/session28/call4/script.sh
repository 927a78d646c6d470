#!/usr/bin/env bash
# session 28, call 4: issue 13's S1 rows on one trace (the arrival gaps were drawn from torch's global generator, so
# each row of a run had its own arrival times), N = 5 and 2,000 at call 3's rate, 512 requests (half the drain's share).
set -o pipefail
mkdir -p $OUT/c4
trap 'tar czf $OUT/c4.tgz -C $OUT c4 && rm -rf $OUT/c4' EXIT
. scripts/device_env.sh
cp .device/s28call4.sh $OUT/c4/script.sh
git log --oneline -1 > $OUT/c4/tree.txt 2>/dev/null; git status --short >> $OUT/c4/tree.txt 2>/dev/null
timeout 220 python3 bench/bench_serving.py --shape llama3-8b --adapters 5,2000 --adapter-files 64 \
  --modes engine --requests 512 --rate 20.84 --no-burst-rows --engine-warmup --warmup-requests 0 --out $OUT/c4/s1 \
  > $OUT/c4/s1.log 2>&1
echo "s1 rc=$? at $SECONDS s" >> $OUT/c4/s1.log; rm -f $OUT/c4/s1/*.png
true
