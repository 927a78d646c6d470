#!/usr/bin/env bash
# session 27, call 4: lora_delta from 2 tokens (LORA_DELTA_OVERWRITE_MIN_TOKENS = 2; call 3's suite ran with 17): the
# engine GPU tests that run side-stream decode steps of 2-4 requests; the engine A/B at batch 4 and 16.
set -o pipefail
mkdir -p $OUT/c4
trap 'tar czf $OUT/c4.tgz -C $OUT c4 && rm -rf $OUT/c4' EXIT
pip install -q --no-deps --no-build-isolation --target /tmp/ml . >/dev/null 2>&1
export PYTHONPATH=/tmp/ml PYTHONUNBUFFERED=1 R=$PWD
cp .device/s27call4.sh $OUT/c4/script.sh
git log --oneline -1 > $OUT/c4/tree.txt 2>/dev/null; git status --short >> $OUT/c4/tree.txt 2>/dev/null
(cd /tmp && timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider -rfEs "$R/tests/test_engine_gpu.py" \
  -k "side_stream or matches_peft or cuda_graph or async" > $OUT/c4/test.log 2>&1; echo "rc=$? at $SECONDS s" >> $OUT/c4/test.log)
timeout $((290 - SECONDS)) python3 bench/bench_generate.py --providers multilora,multilora-lora,multilora-lora-zeroed \
  --rounds 2 --batches 4,16 --gen 64 --time-budget $((270 - SECONDS)) --out $OUT/c4/gen > $OUT/c4/gen.log 2>&1
echo "rc=$? at $SECONDS s" >> $OUT/c4/gen.log; rm -f $OUT/c4/gen/*.png
true
