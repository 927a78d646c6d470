#!/usr/bin/env bash
# session 32, call 2: the odd-width prefill tile tests rewritten after call 1 (and the new fp64 shrink-sum test); fp8
# engine tests with the LM head in fp8 by default (untied heads); issue 16's rows with that default against the bf16
# head (multilora-fp8-bf16head); then issue 13's S4 with the disk in play (disk -> host aggregate vs a cold read).
set -o pipefail
mkdir -p $OUT/c2
trap 'tar czf $OUT/c2.tgz -C $OUT c2 && rm -rf $OUT/c2' EXIT
. scripts/device_env.sh
cp .device/s32call2.sh $OUT/c2/script.sh
git log --oneline -1 > $OUT/c2/tree.txt 2>/dev/null; git status --short >> $OUT/c2/tree.txt 2>/dev/null
(cd /tmp && timeout 150 python3 -m pytest -m gpu -q -s -p no:cacheprovider -rfEs "$R/tests/test_kernels.py" \
  -k "prefill_tiles or prefill_shrink_sums" > $OUT/c2/tests_kernels.log 2>&1; echo "rc=$? at $SECONDS s" >> $OUT/c2/tests_kernels.log) &
(cd /tmp && timeout 150 python3 -m pytest -m gpu -q -s -p no:cacheprovider -rfEs "$R/tests/test_fp8_gpu.py" \
  -k "engine_fp8 or tuned_shape" > $OUT/c2/tests_fp8.log 2>&1; echo "rc=$? at $SECONDS s" >> $OUT/c2/tests_fp8.log) &
wait
timeout 200 python3 bench/bench_generate.py --providers multilora,multilora-fp8,multilora-fp8-bf16head \
  --rounds 5 --batches 1,64 --gen 64 --time-budget 180 --out $OUT/c2/gen > $OUT/c2/gen.log 2>&1
echo "rc=$? at $SECONDS s" >> $OUT/c2/gen.log; rm -f $OUT/c2/gen/*.png
mkdir -p /tmp/s4
timeout $(( 590 - SECONDS )) python3 bench/bench_serving.py --shape llama3-8b --adapter-set S4 --adapters 5,2000 \
  --adapter-files 64 --adapter-dir /tmp/s4 --preload 300 --modes engine --requests 512 --rate auto --no-burst-rows \
  --engine-warmup --warmup-requests 0 --drop-page-cache 0.5 --out $OUT/c2/s4cold > $OUT/c2/s4cold.log 2>&1
echo "s4 rc=$? at $SECONDS s" >> $OUT/c2/s4cold.log; rm -f $OUT/c2/s4cold/*.png
true
