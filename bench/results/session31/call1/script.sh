#!/usr/bin/env bash
# session 31, call 1: the whole GPU suite on main (session 30's prefill tiles a158b66 and review a15695f never ran as a
# whole; test_engine_gpu.py now dealt to shards D and F); then issue 12's prefill layer row (4,096 tokens on 64
# adapters): the LoRA added after the GEMM vs written first, session 30's prefill tiles vs the ones before.
set -o pipefail
mkdir -p $OUT/c1
trap 'tar czf $OUT/c1.tgz -C $OUT c1 && rm -rf $OUT/c1' EXIT
. scripts/device_env.sh
cp .device/s31call1.sh $OUT/c1/script.sh
git log --oneline -1 > $OUT/c1/tree.txt 2>/dev/null; git status --short >> $OUT/c1/tree.txt 2>/dev/null
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >> $OUT/c1/tree.txt 2>&1
bash scripts/gpu_suite.sh $OUT/c1/suite 420 > $OUT/c1/suite.out 2>&1
echo "suite rc=$? at $SECONDS s" >> $OUT/c1/suite.out
timeout $(( 590 - SECONDS )) python3 bench/bench_lora_overlap.py --cases prefill --out $OUT/c1/overlap > $OUT/c1/overlap.log 2>&1
echo "rc=$? at $SECONDS s" >> $OUT/c1/overlap.log
true
