#!/usr/bin/env bash
# session 23, call 6: the tests changed after call 4 (fused quantization: the copy checked against the op's own output,
# the engine test by relative error, the 64-row rule for SiLU * up) and bench_fused_quant's new columns.
set -o pipefail
mkdir -p $OUT/c6
trap 'tar czf $OUT/c6.tgz -C $OUT c6 && rm -rf $OUT/c6' EXIT
R=$PWD
pip install -q --no-deps --no-build-isolation --target /tmp/ml . >/dev/null 2>&1
export PYTHONPATH=/tmp/ml PYTHONUNBUFFERED=1
(cd /tmp && timeout 120 python3 -m pytest -m gpu -q -p no:cacheprovider -rfEs $R/tests/test_fused_ops.py \
   $R/tests/test_fp8_gpu.py -k "fp8_copy or fused_quant or given_fp8 or lm_head" > $OUT/c6/tests.log 2>&1
 echo "rc=$? at $SECONDS s" >> $OUT/c6/tests.log)
timeout 90 python3 bench/bench_fused_quant.py --tokens 1,16,64,512,1024,4096 --out $OUT/c6/fused_quant \
  > $OUT/c6/fused_quant.log 2>&1; echo "rc=$? at $SECONDS s" >> $OUT/c6/fused_quant.log
true
