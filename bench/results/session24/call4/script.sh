#!/usr/bin/env bash
# session 24, call 4: the issue-12 and issue-16 engine rows with async scheduling (the new CUDA default), 5 rounds,
# batch 1 and 64: bf16 base, bf16 on 1 / 64 distinct rank-16 adapters, fp8, fp8 with the fp8 LM head.
set -o pipefail
mkdir -p $OUT/c4
trap 'tar czf $OUT/c4.tgz -C $OUT c4 && rm -rf $OUT/c4' EXIT
pip install -q --no-deps --no-build-isolation --target /tmp/ml . >/dev/null 2>&1
export PYTHONPATH=/tmp/ml PYTHONUNBUFFERED=1
cp .device/s24call4.sh $OUT/c4/script.sh
timeout 290 python3 bench/bench_generate.py --providers multilora,multilora-lora,multilora-fp8,multilora-fp8-lmhead \
  --rounds 5 --batches 1,64 --gen 64 --time-budget 250 --out $OUT/c4/gen > $OUT/c4/gen.log 2>&1
echo "rc=$? at $SECONDS s" >> $OUT/c4/gen.log; rm -f $OUT/c4/gen/*.png
true
