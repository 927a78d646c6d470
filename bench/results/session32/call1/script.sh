#!/usr/bin/env bash
# session 32, call 1: the whole GPU suite on main c81df27 (fused-GLU switch, BusyClock, check_v, new GPU tests never
# run on the H200); then bench_expand_glu.py (gate/up LoRA expand fused into the activation vs lora_apply + act).
set -o pipefail
mkdir -p $OUT/c1
trap 'tar czf $OUT/c1.tgz -C $OUT c1 && rm -rf $OUT/c1' EXIT
. scripts/device_env.sh
cp .device/s32call1.sh $OUT/c1/script.sh
git log --oneline -1 > $OUT/c1/tree.txt 2>/dev/null; git status --short >> $OUT/c1/tree.txt 2>/dev/null
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >> $OUT/c1/tree.txt 2>&1
bash scripts/gpu_suite.sh $OUT/c1/suite 420 > $OUT/c1/suite.out 2>&1
echo "suite rc=$? at $SECONDS s" >> $OUT/c1/suite.out
timeout $(( 590 - SECONDS )) python3 bench/bench_expand_glu.py --out $OUT/c1/glu > $OUT/c1/glu.log 2>&1
echo "rc=$? at $SECONDS s" >> $OUT/c1/glu.log
true
