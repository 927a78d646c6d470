#!/usr/bin/env bash
# session 24, call 2: the GPU suite with async scheduling on by default (every engine GPU test now runs its steps one
# ahead), then, as time allows, the fused fp8 quantization engine A/B with the 64-row rule (5 rounds, batch 64).
set -o pipefail
mkdir -p $OUT/c2
trap 'tar czf $OUT/c2.tgz -C $OUT c2 && rm -rf $OUT/c2' EXIT
R=$PWD
pip install -q --no-deps --no-build-isolation --target /tmp/ml . >/dev/null 2>&1
export PYTHONPATH=/tmp/ml PYTHONUNBUFFERED=1
{ git log --oneline -1; git status --short; } > $OUT/c2/tree.txt 2>&1
cp .device/s24call2.sh $OUT/c2/script.sh
bash scripts/gpu_suite.sh $OUT/c2/gpu 380
echo "suite rc=$? at $SECONDS s" >> $OUT/c2/tree.txt
if [ $SECONDS -lt 470 ]; then
  timeout $(( 570 - SECONDS )) python3 bench/bench_generate.py --providers multilora-fp8,multilora-fp8-sepquant \
    --rounds 5 --batches 64 --gen 64 --time-budget 80 --out $OUT/c2/gen > $OUT/c2/gen.log 2>&1
  echo "rc=$? at $SECONDS s" >> $OUT/c2/gen.log; rm -f $OUT/c2/gen/*.png
fi
true
