#!/usr/bin/env bash
# session 22, call 6 (the last ~250 s of device time): the fused split-KV combine in the attention kernel
# (triton_attention.FUSED_COMBINE, new, on): the GPU attention tests, the fp8 engine graph test (refactored helper),
# then the engine A/B at batch 1 (where decode attention splits the keys), bf16 and fp8, 3 rounds.
set -o pipefail
mkdir -p $OUT/c6
trap 'tar czf $OUT/c6.tgz -C $OUT c6 && rm -rf $OUT/c6' EXIT
R=$PWD
pip install -q --no-deps --no-build-isolation --target /tmp/ml . >/dev/null 2>&1
export PYTHONPATH=/tmp/ml PYTHONUNBUFFERED=1
git log --oneline -1 > $OUT/c6/tree.txt 2>&1
(cd /tmp && timeout 60 python3 -m pytest -m gpu -q -p no:cacheprovider -rfEs --durations=5 $R/tests/test_attention.py \
   $R/tests/test_fp8_gpu.py -k "gpu_ or graph_decode_equals_eager or lm_head" > $OUT/c6/tests.log 2>&1
 echo "rc=$? at $SECONDS s" >> $OUT/c6/tests.log)
L=$(( 150 - SECONDS ))
timeout $L python3 bench/bench_generate.py --providers multilora,multilora-sepcombine,multilora-fp8,multilora-fp8-sepcombine \
  --rounds 3 --batches 1 --gen 64 --time-budget $(( L - 15 )) --out $OUT/c6/gen > $OUT/c6/gen.log 2>&1
echo "rc=$? at $SECONDS s" >> $OUT/c6/gen.log; rm -f $OUT/c6/gen/*.png
