#!/usr/bin/env bash
# session 31, call 2: issue 12's engine rows with session 30's prefill tiles (a158b66) against the tiles before
# (multilora-lora-s29tiles) and against the LoRA added after the GEMM (multilora-lora-addafter), with fp8 (issue 16);
# then S4 at N = 5 and 2,000 with the adapter files' page cache dropped every 0.5 s (--drop-page-cache, new: the disk
# in play, issue 13).
set -o pipefail
mkdir -p $OUT/c2
trap 'tar czf $OUT/c2.tgz -C $OUT c2 && rm -rf $OUT/c2' EXIT
. scripts/device_env.sh
cp .device/s31call2.sh $OUT/c2/script.sh
git log --oneline -1 > $OUT/c2/tree.txt 2>/dev/null; git status --short >> $OUT/c2/tree.txt 2>/dev/null
timeout 240 python3 bench/bench_generate.py --providers multilora,multilora-lora,multilora-lora-s29tiles,multilora-lora-addafter,multilora-fp8 \
  --rounds 5 --batches 1,64 --gen 64 --time-budget 220 --out $OUT/c2/gen > $OUT/c2/gen.log 2>&1
echo "rc=$? at $SECONDS s" >> $OUT/c2/gen.log; rm -f $OUT/c2/gen/*.png
mkdir -p /tmp/s4
timeout $(( 590 - SECONDS )) python3 bench/bench_serving.py --shape llama3-8b --adapter-set S4 --adapters 5,2000 \
  --adapter-files 64 --adapter-dir /tmp/s4 --preload 300 --modes engine --requests 512 --rate auto --no-burst-rows \
  --engine-warmup --warmup-requests 0 --drop-page-cache 0.5 --out $OUT/c2/s4cold > $OUT/c2/s4cold.log 2>&1
echo "s4 rc=$? at $SECONDS s" >> $OUT/c2/s4cold.log; rm -f $OUT/c2/s4cold/*.png
df -h /tmp >> $OUT/c2/s4cold.log 2>&1; free -g >> $OUT/c2/s4cold.log 2>&1
true
