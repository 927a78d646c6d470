#!/usr/bin/env bash
# session 27, call 1: lora_delta (side-stream LoRA term written, no zeroing) and the one-row fp8 GEMV's weight
# preload before the PDL wait: their GPU tests; the layer A/B (side_all vs side_write); the engine A/B.
set -o pipefail
mkdir -p $OUT/c1
trap 'tar czf $OUT/c1.tgz -C $OUT c1 && rm -rf $OUT/c1' EXIT
pip install -q --no-deps --no-build-isolation --target /tmp/ml . >/dev/null 2>&1
export PYTHONPATH=/tmp/ml PYTHONUNBUFFERED=1 R=$PWD
cp .device/s27call1.sh $OUT/c1/script.sh
git log --oneline -1 > $OUT/c1/tree.txt 2>/dev/null; git status --short >> $OUT/c1/tree.txt 2>/dev/null
(cd /tmp && timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider -rfEs \
  "$R/tests/test_kernels.py" -k "lora_delta or none_rows or module_not or looped or pdl" \
  > $OUT/c1/test_kernels.log 2>&1; echo "rc=$? at $SECONDS s" >> $OUT/c1/test_kernels.log)
(cd /tmp && timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider -rfEs \
  "$R/tests/test_fp8_gpu.py" "$R/tests/test_engine_gpu.py" -k "preload or widening or pdl or side_stream" \
  > $OUT/c1/test_fp8_engine.log 2>&1; echo "rc=$? at $SECONDS s" >> $OUT/c1/test_fp8_engine.log)
timeout 60 python3 bench/bench_lora_overlap.py --cases r16 --tokens 1,64 --no-sweep --schedules serial,side_all,side_write \
  --out $OUT/c1/overlap > $OUT/c1/overlap.log 2>&1
echo "rc=$? at $SECONDS s" >> $OUT/c1/overlap.log
timeout $((560 - SECONDS)) python3 bench/bench_generate.py --providers multilora,multilora-lora,multilora-lora-zeroed,multilora-fp8,multilora-fp8-nopreload \
  --rounds 3 --batches 1,64 --gen 64 --time-budget $((520 - SECONDS)) --out $OUT/c1/gen > $OUT/c1/gen.log 2>&1
echo "rc=$? at $SECONDS s" >> $OUT/c1/gen.log; rm -f $OUT/c1/gen/*.png
true
