#!/usr/bin/env bash
# session 18, call 2 (main + DECODE_SHRINK_WARPS = 2 + sweeps' --rank/--tokens + overlap --shrink-warps):
# 1. layer r16 / r64 at 1, 8, 64 tokens, serial / side_all, decode shrink 4 warps (before) vs 2 (now), ABBA order;
# 2. decode-shrink and decode-expand sweeps at rank 64, 1 / 8 / 64 tokens;
# 3. GPU kernel tests that touch the shrink (bf16/fp16 vs fp32 reference).
set -o pipefail
mkdir -p $OUT/c2
trap 'tar czf $OUT/c2.tgz -C $OUT c2 && rm -rf $OUT/c2' EXIT
R=$PWD
pip install -q --no-deps --no-build-isolation --target /tmp/ml . >/dev/null 2>&1
export PYTHONPATH=/tmp/ml PYTHONUNBUFFERED=1
{ git log --oneline -1 2>/dev/null; git status --short; md5sum kernels/triton_sgmv.py runtime/model.py; } > $OUT/c2/trees.txt 2>&1
ov() {  # name, flags...
  local n=$1; shift
  timeout 60 python3 bench/bench_lora_overlap.py --cases all --tokens 1,8,64 --no-sweep --schedules serial,side_all \
    --out $OUT/c2/overlap_$n "$@" > $OUT/c2/overlap_$n.log 2>&1; echo "rc=$? at $SECONDS s" >> $OUT/c2/overlap_$n.log
}
ov w4a --shrink-warps 4
ov w2a
ov w2b
ov w4b --shrink-warps 4
timeout 150 python3 bench/tune_lora_kernels.py --decode-shrink --rank 64 --tokens 1,8,64 --out $OUT/c2/sweep > $OUT/c2/shrink_r64.log 2>&1
echo "rc=$? at $SECONDS s" >> $OUT/c2/shrink_r64.log
timeout 150 python3 bench/tune_lora_kernels.py --decode-expand --rank 64 --tokens 1,8,64 --out $OUT/c2/sweep > $OUT/c2/expand_r64.log 2>&1
echo "rc=$? at $SECONDS s" >> $OUT/c2/expand_r64.log
(cd /tmp && timeout $(( 585 - SECONDS )) python3 -m pytest -m gpu -q -p no:cacheprovider -rfEs $R/tests/test_kernels.py \
  > $OUT/c2/gpu_tests.log 2>&1; echo "rc=$? at $SECONDS s" >> $OUT/c2/gpu_tests.log)
