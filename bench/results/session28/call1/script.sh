#!/usr/bin/env bash
# session 28, call 1: issue 13's S1 rows with the engine's step phases (first GPU run of them); the layer A/B of the
# final lora_delta kernels (+0 add, tiled zero rows); the whole GPU suite on the tree session 27 left unrun.
set -o pipefail
mkdir -p $OUT/c1
trap 'tar czf $OUT/c1.tgz -C $OUT c1 && rm -rf $OUT/c1' EXIT
. scripts/device_env.sh
cp .device/s28call1.sh $OUT/c1/script.sh
git log --oneline -1 > $OUT/c1/tree.txt 2>/dev/null; git status --short >> $OUT/c1/tree.txt 2>/dev/null
timeout 170 python3 bench/bench_serving.py --shape llama3-8b --adapters 5,2000 --adapter-files 64 \
  --modes engine --requests 256 --rate auto --no-burst-rows --engine-warmup --warmup-requests 0 --out $OUT/c1/s1 \
  > $OUT/c1/s1.log 2>&1
echo "s1 rc=$? at $SECONDS s" >> $OUT/c1/s1.log; rm -f $OUT/c1/s1/*.png
timeout 40 python3 bench/bench_lora_overlap.py --cases r16 --tokens 1,8,64 --no-sweep --schedules side_all,side_write \
  --out $OUT/c1/overlap > $OUT/c1/overlap.log 2>&1
echo "rc=$? at $SECONDS s" >> $OUT/c1/overlap.log
L=$((585 - SECONDS)); [ $L -gt 420 ] && L=420; bash scripts/gpu_suite.sh $OUT/c1/suite $L > $OUT/c1/suite.out 2>&1
echo "suite rc=$? at $SECONDS s" >> $OUT/c1/suite.out
true
