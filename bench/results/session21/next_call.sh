#!/usr/bin/env bash
# session 21, call 3 (short: little device time left): batch-64 rows of the base and of 64 adapters that record the new
# within-run TPOT, slowest steps, time by step kind, time outside steps and GC pauses (call 2's batch-64 TPOT ran
# 1.2-1.9x the decode-step median); then the one GPU test calls 1-2 did not finish (Gemma 2 ops at 9B widths, fp16).
set -o pipefail
mkdir -p $OUT/c3
trap 'tar czf $OUT/c3.tgz -C $OUT c3 && rm -rf $OUT/c3' EXIT
R=$PWD
pip install -q --no-deps --no-build-isolation --target /tmp/ml . >/dev/null 2>&1
export PYTHONPATH=/tmp/ml PYTHONUNBUFFERED=1
{ git log --oneline -1; md5sum kernels/*.py bench/bench_generate.py; } > $OUT/c3/tree.txt 2>&1
T=$R/tests
timeout 115 python3 bench/bench_generate.py --providers multilora,multilora-lora --rounds 2 --batches 64 --gen 64 \
  --adapter-files 8 --time-budget 100 --out $OUT/c3/gen > $OUT/c3/gen.log 2>&1
echo "rc=$? at $SECONDS s" >> $OUT/c3/gen.log; rm -f $OUT/c3/gen/*.png
L=$(( 170 - SECONDS ))
[ $L -gt 20 ] && (cd /tmp && timeout $L python3 -m pytest -m gpu -v -p no:cacheprovider -rfEs --durations=8 \
   $T/test_model_gemma2_gpu.py -k "9b_widths" > $OUT/c3/tests.log 2>&1; echo "rc=$? at $SECONDS s" >> $OUT/c3/tests.log)
