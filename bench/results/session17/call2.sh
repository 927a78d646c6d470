#!/usr/bin/env bash
# session 17, call 1 (tree: main + cuBLASLt token-range knob + decode-shrink sweep + capture-stream test fix):
# 1. GPU tests: the capture-stream test after other engines in one process (it failed so in call 0), the carve-out /
#    cuBLASLt test;
# 2. tune_lora_kernels --decode-shrink;
# 3. bench_lora_overlap all cases at 1, 8, 64 tokens (r16 and r64), serial / side_all;
# 4. bench_generate batch 1, 64: multilora, multilora-lt, multilora-lora, multilora-lora-lt, multilora-lora-carve 16
set -o pipefail
mkdir -p $OUT/c1
trap 'tar czf $OUT/c1.tgz -C $OUT c1 && rm -rf $OUT/c1' EXIT
R=$PWD
pip install -q --no-deps --no-build-isolation --target /tmp/ml . >/dev/null 2>&1
export PYTHONPATH=/tmp/ml PYTHONUNBUFFERED=1
{ git log --oneline -1 2>/dev/null; git status --short; md5sum kernels/triton_sgmv.py runtime/model.py; } > $OUT/c1/trees.txt 2>&1
(cd /tmp && timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider -rfEs $R/tests/test_engine_gpu.py \
  -k "cuda_graph_decode_matches_eager or carveout or capture_stream" > $OUT/c1/gpu_tests.log 2>&1; echo "rc=$? at $SECONDS s" >> $OUT/c1/gpu_tests.log)
timeout 300 python3 bench/tune_lora_kernels.py --decode-shrink --out $OUT/c1/shrink > $OUT/c1/shrink.log 2>&1
echo "rc=$? at $SECONDS s" >> $OUT/c1/shrink.log
timeout 90 python3 bench/bench_lora_overlap.py --cases all --tokens 1,8,64 --no-sweep --schedules serial,side_all \
  --out $OUT/c1/overlap > $OUT/c1/overlap.log 2>&1; echo "rc=$? at $SECONDS s" >> $OUT/c1/overlap.log
L=$(( 590 - SECONDS ))
if [ $L -gt 100 ]; then
  timeout $L python3 bench/bench_generate.py --providers multilora,multilora-lt,multilora-lora,multilora-lora-lt,multilora-lora-carve \
    --carveout 16 --batches 1,64 --gen 64 --adapter-files 8 --time-budget $(( L - 30 )) \
    --out $OUT/c1/gen > $OUT/c1/gen.log 2>&1
  echo "rc=$? at $SECONDS s" >> $OUT/c1/gen.log
  rm -f $OUT/c1/gen/*.png
fi
