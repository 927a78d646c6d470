#!/usr/bin/env bash
# session 30, call 3: the LoRA term written before the base GEMM (LORA_BEFORE_GEMM_MIN_TOKENS, new): its GPU tests
# against peft (bf16, fp16), the engine A/B at batch 64 (TTFT, and TPOT whose mixed steps carry the prefill chunks)
# against multilora-lora-addafter (what ran before), the mixed-step profile with it (call 2 had it without); then S4 at
# N = 5 and 2,000 on one trace (the urgent-read wait's serving run).
set -o pipefail
mkdir -p $OUT/c3
trap 'tar czf $OUT/c3.tgz -C $OUT c3 && rm -rf $OUT/c3' EXIT
. scripts/device_env.sh
cp .device/s30call3.sh $OUT/c3/script.sh
git log --oneline -1 > $OUT/c3/tree.txt 2>/dev/null; git status --short >> $OUT/c3/tree.txt 2>/dev/null
(cd /tmp && timeout 120 python3 -m pytest -m gpu -q -p no:cacheprovider -rfEs "$R/tests/test_engine_gpu.py" \
  -k "lora_before_gemm" > $OUT/c3/tests.log 2>&1; echo "rc=$? at $SECONDS s" >> $OUT/c3/tests.log)
timeout 150 python3 bench/bench_generate.py --providers multilora,multilora-lora,multilora-lora-addafter \
  --rounds 5 --batches 64 --gen 64 --time-budget 130 --out $OUT/c3/gen > $OUT/c3/gen.log 2>&1
echo "rc=$? at $SECONDS s" >> $OUT/c3/gen.log; rm -f $OUT/c3/gen/*.png
timeout 75 python3 bench/profile_decode.py --batch 64 --mixed-tokens 4096 --no-pdl --steps 4 --top 30 --lora \
  --json $OUT/c3/prof_lora.json > $OUT/c3/prof_lora.log 2>&1
echo "rc=$? at $SECONDS s" >> $OUT/c3/prof_lora.log
mkdir -p /tmp/s4
[ $SECONDS -lt 380 ] && { timeout $(( 585 - SECONDS )) python3 bench/bench_serving.py --shape llama3-8b --adapter-set S4 --adapters 5,2000 \
  --adapter-files 64 --adapter-dir /tmp/s4 --preload 300 --modes engine --requests 512 --rate auto --no-burst-rows \
  --engine-warmup --warmup-requests 0 --out $OUT/c3/s4 > $OUT/c3/s4.log 2>&1; echo "s4 rc=$? at $SECONDS s" >> $OUT/c3/s4.log; rm -f $OUT/c3/s4/*.png; }
true
