#!/usr/bin/env bash
# session 25, call 1: the fp8-activation kernels (pointer / TMA, x @ w^T / w @ x^T) on the GPU: their tests, a
# 64-row tile sweep of the four kernels, and the engine at batch 64 with the sweep's table against the shipped one.
set -o pipefail
mkdir -p $OUT/c1
trap 'tar czf $OUT/c1.tgz -C $OUT c1 && rm -rf $OUT/c1' EXIT
pip install -q --no-deps --no-build-isolation --target /tmp/ml . >/dev/null 2>&1
export PYTHONPATH=/tmp/ml PYTHONUNBUFFERED=1 R=$PWD
cp .device/s25call1.sh $OUT/c1/script.sh
git log --oneline -1 > $OUT/c1/tree.txt 2>/dev/null; git status --short >> $OUT/c1/tree.txt 2>/dev/null
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > $OUT/c1/gpu.txt 2>&1
(cd /tmp && timeout 110 python3 -m pytest -m gpu -q -p no:cacheprovider -rfEs $R/tests/test_fp8_gpu.py -k "activation_kernels" 2>&1 | tail -15) > $OUT/c1/tests.log 2>&1 || true
echo "tests done at $SECONDS s" >> $OUT/c1/tests.log
timeout 280 python3 bench/sweep_fp8_gemv.py --paths scaled2 --ms 64 --rep 10 --out $OUT/c1/sweep > $OUT/c1/sweep.log 2>&1
echo "rc=$? at $SECONDS s" >> $OUT/c1/sweep.log
if [ -f $OUT/c1/sweep/fp8_gemv_tuned.json ]; then
  MULTILORA_FP8_TUNED=$OUT/c1/sweep/fp8_gemv_tuned.json timeout $((575 - SECONDS)) python3 bench/bench_generate.py \
    --providers multilora,multilora-fp8,multilora-fp8-shipped --rounds 3 --batches 64 --gen 64 \
    --time-budget $((540 - SECONDS)) --out $OUT/c1/gen > $OUT/c1/gen.log 2>&1
  echo "rc=$? at $SECONDS s" >> $OUT/c1/gen.log; rm -f $OUT/c1/gen/*.png
fi
true
