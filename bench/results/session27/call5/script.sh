#!/usr/bin/env bash
# session 27, call 5: the engine A/B of lora_delta (from 2 tokens) against the zeroed buffer at batch 8 (call 4:
# batch 4 slower, batch 16 faster).
set -o pipefail
mkdir -p $OUT/c5
trap 'tar czf $OUT/c5.tgz -C $OUT c5 && rm -rf $OUT/c5' EXIT
rm -rf /tmp/ml; pip install -q --no-deps --no-build-isolation --target /tmp/ml . >/dev/null 2>&1
export PYTHONPATH=/tmp/ml PYTHONUNBUFFERED=1
cp .device/s27call5.sh $OUT/c5/script.sh
timeout 100 python3 bench/bench_generate.py --providers multilora,multilora-lora,multilora-lora-zeroed \
  --rounds 2 --batches 8 --gen 64 --time-budget 80 --out $OUT/c5/gen > $OUT/c5/gen.log 2>&1
echo "rc=$? at $SECONDS s" >> $OUT/c5/gen.log; rm -f $OUT/c5/gen/*.png
true
