#!/usr/bin/env bash
# session 30, call 2: call 1's suite ran out of time in shard C four tests before its end: those four; issue 12's and
# 16's engine rows with the prefill-LoRA-on-the-side-stream providers (-sidepf, -sidepf0: TTFT and the batch-64 TPOT
# that the mixed steps carry); a kernel profile of a mixed step with a 4,096-token chunk, with and without adapters
# (where prefill LoRA time goes); then S1 on one trace (no regression from the urgent-read wait).
set -o pipefail
mkdir -p $OUT/c2
trap 'tar czf $OUT/c2.tgz -C $OUT c2 && rm -rf $OUT/c2' EXIT
. scripts/device_env.sh
cp .device/s30call2.sh $OUT/c2/script.sh
git log --oneline -1 > $OUT/c2/tree.txt 2>/dev/null; git status --short >> $OUT/c2/tree.txt 2>/dev/null
(cd /tmp && timeout 90 python3 -m pytest -m gpu -q -p no:cacheprovider -rfEs "$R/tests/test_fp8_gpu.py" \
  -k "test_fp8_activation_kernels_in_bf16 and True-True" > $OUT/c2/tests.log 2>&1; echo "rc=$? at $SECONDS s" >> $OUT/c2/tests.log)
timeout 230 python3 bench/bench_generate.py --providers multilora,multilora-lora,multilora-lora-sidepf,multilora-lora-sidepf0,multilora-fp8 \
  --rounds 3 --batches 1,64 --gen 64 --time-budget 200 --out $OUT/c2/gen > $OUT/c2/gen.log 2>&1
echo "rc=$? at $SECONDS s" >> $OUT/c2/gen.log; rm -f $OUT/c2/gen/*.png
prof() {  # name, flags...
  local n=$1; shift
  timeout 75 python3 bench/profile_decode.py --batch 64 --mixed-tokens 4096 --no-pdl --steps 4 --top 30 \
    --json $OUT/c2/prof_$n.json "$@" > $OUT/c2/prof_$n.log 2>&1
  echo "rc=$? at $SECONDS s" >> $OUT/c2/prof_$n.log
}
prof base
prof lora --lora
[ $SECONDS -lt 330 ] && { timeout $(( 585 - SECONDS )) python3 bench/bench_serving.py --shape llama3-8b --adapters 5,100,1000,2000 --adapter-files 64 \
  --modes engine --requests 512 --rate 20.84 --no-burst-rows --engine-warmup --warmup-requests 0 --out $OUT/c2/s1 \
  > $OUT/c2/s1.log 2>&1; echo "s1 rc=$? at $SECONDS s" >> $OUT/c2/s1.log; rm -f $OUT/c2/s1/*.png; }
true
