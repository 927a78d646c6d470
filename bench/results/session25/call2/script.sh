#!/usr/bin/env bash
# session 25, call 2: the 16-row sweep of the four fp8-activation kernels (the 64-row TMA tiles now shipped; its layer
# phase shows 2-64 rows, 17-32 rows with x padded to 64 in TMA tiles), then issue 16's engine rows at batch 1 and 64.
set -o pipefail
mkdir -p $OUT/c2
trap 'tar czf $OUT/c2.tgz -C $OUT c2 && rm -rf $OUT/c2' EXIT
pip install -q --no-deps --no-build-isolation --target /tmp/ml . >/dev/null 2>&1
export PYTHONPATH=/tmp/ml PYTHONUNBUFFERED=1 R=$PWD
cp .device/s25call2.sh $OUT/c2/script.sh
git log --oneline -1 > $OUT/c2/tree.txt 2>/dev/null; git status --short >> $OUT/c2/tree.txt 2>/dev/null
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > $OUT/c2/gpu.txt 2>&1
timeout 200 python3 bench/sweep_fp8_gemv.py --paths scaled2 --ms 16 --rep 10 --out $OUT/c2/sweep > $OUT/c2/sweep.log 2>&1
echo "rc=$? at $SECONDS s" >> $OUT/c2/sweep.log
timeout $((575 - SECONDS)) python3 bench/bench_generate.py --providers multilora,multilora-fp8 --rounds 5 --batches 1,64 \
  --gen 64 --time-budget $((540 - SECONDS)) --out $OUT/c2/gen > $OUT/c2/gen.log 2>&1
echo "rc=$? at $SECONDS s" >> $OUT/c2/gen.log; rm -f $OUT/c2/gen/*.png
true
