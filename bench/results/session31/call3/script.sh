#!/usr/bin/env bash
# session 31, call 3: the looped prefill writing expand (triton_sgmv.PREFILL_WRITE_LOOP = (2, 256, 2), new): its GPU
# tests (bits of the tiles before, the fp32 reference); the expand alone at 4,096 tokens on 64 adapters, the loop
# swept; the layer's prefill row (now / session 30's / before); the engine A/B at batch 64 (TTFT, issue 12).
set -o pipefail
mkdir -p $OUT/c3
trap 'tar czf $OUT/c3.tgz -C $OUT c3 && rm -rf $OUT/c3' EXIT
. scripts/device_env.sh
cp .device/s31call3.sh $OUT/c3/script.sh
git log --oneline -1 > $OUT/c3/tree.txt 2>/dev/null; git status --short >> $OUT/c3/tree.txt 2>/dev/null
(cd /tmp && timeout 120 python3 -m pytest -m gpu -q -p no:cacheprovider -rfEs "$R/tests/test_kernels.py" \
  -k "prefill_tiles or lora_delta_writes or looped_expand" > $OUT/c3/tests.log 2>&1; echo "rc=$? at $SECONDS s" >> $OUT/c3/tests.log)
mkdir -p $OUT/c3/tune
timeout 150 python3 bench/tune_lora_kernels.py --prefill --prefill-kernels expand --adapters 64 --out $OUT/c3/tune \
  > $OUT/c3/tune.log 2>&1
echo "rc=$? at $SECONDS s" >> $OUT/c3/tune.log
timeout 90 python3 bench/bench_lora_overlap.py --cases prefill --out $OUT/c3/overlap > $OUT/c3/overlap.log 2>&1
echo "rc=$? at $SECONDS s" >> $OUT/c3/overlap.log
timeout $(( 585 - SECONDS )) python3 bench/bench_generate.py --providers multilora,multilora-lora,multilora-lora-s30tiles,multilora-lora-addafter \
  --rounds 5 --batches 64 --gen 64 --time-budget $(( 560 - SECONDS )) --out $OUT/c3/gen > $OUT/c3/gen.log 2>&1
echo "rc=$? at $SECONDS s" >> $OUT/c3/gen.log; rm -f $OUT/c3/gen/*.png
true
