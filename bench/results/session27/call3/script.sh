#!/usr/bin/env bash
# session 27, call 3: where lora_delta starts to pay (the layer at 1-64 tokens, side_all vs side_write), then the
# whole GPU suite on the final tree (LORA_DELTA_OVERWRITE_MIN_TOKENS = 17, GEMV_PRELOAD = 2).
set -o pipefail
mkdir -p $OUT/c3
trap 'tar czf $OUT/c3.tgz -C $OUT c3 && rm -rf $OUT/c3' EXIT
pip install -q --no-deps --no-build-isolation --target /tmp/ml . >/dev/null 2>&1
export PYTHONPATH=/tmp/ml PYTHONUNBUFFERED=1 R=$PWD
cp .device/s27call3.sh $OUT/c3/script.sh
git log --oneline -1 > $OUT/c3/tree.txt 2>/dev/null; git status --short >> $OUT/c3/tree.txt 2>/dev/null
timeout 80 python3 bench/bench_lora_overlap.py --cases r16 --tokens 1,2,4,8,16,24,32,64 --no-sweep --schedules side_all,side_write \
  --out $OUT/c3/overlap > $OUT/c3/overlap.log 2>&1
echo "rc=$? at $SECONDS s" >> $OUT/c3/overlap.log
L=$((560 - SECONDS)); [ $L -gt 440 ] && L=440; bash scripts/gpu_suite.sh $OUT/c3/suite $L > $OUT/c3/suite.out 2>&1
echo "suite rc=$? at $SECONDS s" >> $OUT/c3/suite.out
true
