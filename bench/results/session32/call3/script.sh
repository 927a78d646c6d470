#!/usr/bin/env bash
# session 32, call 3: the whole GPU suite on the final tree (odd-width tile tests rewritten, fused-GLU switch removed, fp8
# head by default), each shard limited to 470 s (call 1: shards A and D hit 420 s).
set -o pipefail
mkdir -p $OUT/c3
trap 'tar czf $OUT/c3.tgz -C $OUT c3 && rm -rf $OUT/c3' EXIT
. scripts/device_env.sh
cp .device/s32call3.sh $OUT/c3/script.sh
git log --oneline -1 > $OUT/c3/tree.txt 2>/dev/null; git status --short >> $OUT/c3/tree.txt 2>/dev/null
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >> $OUT/c3/tree.txt 2>&1
bash scripts/gpu_suite.sh $OUT/c3/suite 470 > $OUT/c3/suite.out 2>&1
echo "suite rc=$? at $SECONDS s" >> $OUT/c3/suite.out
true
