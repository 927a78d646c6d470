#!/usr/bin/env bash
# session 23, call 2: the fused per-token fp8 quantization (model.FUSE_FP8_QUANT, new: RMSNorm and SiLU * up write the
# fp8 GEMM inputs) on the GPU: the fused-op tests (bf16 too), the fp8 GPU tests of it, the sm_90 compile; then the
# engine A/B at batch 1 and 64: bf16, fp8 (fused), fp8 with separate quantization launches (before), fp8 + fp8 LM head.
set -o pipefail
mkdir -p $OUT/c2
trap 'tar czf $OUT/c2.tgz -C $OUT c2 && rm -rf $OUT/c2' EXIT
R=$PWD
pip install -q --no-deps --no-build-isolation --target /tmp/ml . >/dev/null 2>&1
export PYTHONPATH=/tmp/ml PYTHONUNBUFFERED=1
{ git log --oneline -1; git status --short; md5sum kernels/*.py runtime/*.py bench/bench_generate.py; } > $OUT/c2/tree.txt 2>&1
(cd /tmp && timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider -rfEs $R/tests/test_fused_ops.py \
   $R/tests/test_fp8_gpu.py -k "fp8_copy or fused_quant or given_fp8 or pdl or lm_head or graph" > $OUT/c2/tests.log 2>&1
 echo "rc=$? at $SECONDS s" >> $OUT/c2/tests.log)
timeout 200 python3 bench/bench_generate.py --providers multilora,multilora-fp8,multilora-fp8-sepquant,multilora-fp8-lmhead \
  --rounds 3 --batches 1,64 --gen 64 --time-budget 180 --out $OUT/c2/gen > $OUT/c2/gen.log 2>&1
echo "rc=$? at $SECONDS s" >> $OUT/c2/gen.log; rm -f $OUT/c2/gen/*.png
[ $SECONDS -lt 420 ] && timeout 100 python3 bench/profile_decode.py --weight-dtype fp8 --batch 64 \
  --json $OUT/c2/prof_fp8_b64.json > $OUT/c2/prof_fp8_b64.log 2>&1
true
