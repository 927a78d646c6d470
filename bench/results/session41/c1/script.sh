#!/usr/bin/env bash
# Next GPU session, call 1 (written in session 33, which had no device): the whole GPU suite on main. Not run on the
# H200 since session 32's call 3: the tensor-parallel workers' fp8_lm_head, DecoderModel(fp8_lm_head=None), the
# resume line order (87a0a18), the shrink-block assertions of test_kernels.py, and anything committed after.
#   run: command="bash bench/results/session33/next_call1.sh", timeout_s=600; results in $OUT/c1.tgz
set -o pipefail
mkdir -p $OUT/c1
trap 'tar czf $OUT/c1.tgz -C $OUT c1 && rm -rf $OUT/c1' EXIT
. scripts/device_env.sh
cp "$0" $OUT/c1/script.sh
git log --oneline -1 > $OUT/c1/tree.txt 2>/dev/null; git status --short >> $OUT/c1/tree.txt 2>/dev/null
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >> $OUT/c1/tree.txt 2>&1
bash scripts/gpu_suite.sh $OUT/c1/suite 470 > $OUT/c1/suite.out 2>&1
echo "suite rc=$? at $SECONDS s" >> $OUT/c1/suite.out
true
