#!/usr/bin/env bash
# session 27, call 2: lora_delta with the first token's slot read before the PDL wait (call 1: batch-1 LoRA 0.03 ms
# slower than the zeroed buffer); the layer at rank 16 and 64, 1 and 64 tokens (serial / side_all / side_write); the
# engine A/B (zeroed, preload 0 / 2 / 4); issue 13's S1 rows at N = 5 and 2,000.
set -o pipefail
mkdir -p $OUT/c2
trap 'tar czf $OUT/c2.tgz -C $OUT c2 && rm -rf $OUT/c2' EXIT
pip install -q --no-deps --no-build-isolation --target /tmp/ml . >/dev/null 2>&1
export PYTHONPATH=/tmp/ml PYTHONUNBUFFERED=1 R=$PWD
cp .device/s27call2.sh $OUT/c2/script.sh
git log --oneline -1 > $OUT/c2/tree.txt 2>/dev/null; git status --short >> $OUT/c2/tree.txt 2>/dev/null
timeout 100 python3 bench/bench_lora_overlap.py --cases all --tokens 1,64 --no-sweep --schedules serial,side_all,side_write \
  --out $OUT/c2/overlap > $OUT/c2/overlap.log 2>&1
echo "rc=$? at $SECONDS s" >> $OUT/c2/overlap.log
timeout 200 python3 bench/bench_generate.py --providers multilora,multilora-lora,multilora-lora-zeroed,multilora-fp8,multilora-fp8-nopreload,multilora-fp8-preload4 \
  --rounds 3 --batches 1,64 --gen 64 --time-budget 180 --out $OUT/c2/gen > $OUT/c2/gen.log 2>&1
echo "rc=$? at $SECONDS s" >> $OUT/c2/gen.log; rm -f $OUT/c2/gen/*.png
timeout $((575 - SECONDS)) python3 bench/bench_serving.py --shape llama3-8b --adapters 5,2000 --adapter-files 64 \
  --modes engine --requests 256 --rate auto --no-burst-rows --engine-warmup --warmup-requests 0 --out $OUT/c2/s1 \
  > $OUT/c2/s1.log 2>&1
echo "s1 rc=$? at $SECONDS s" >> $OUT/c2/s1.log; rm -f $OUT/c2/s1/*.png
true
