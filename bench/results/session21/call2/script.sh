#!/usr/bin/env bash
# session 21, call 2: the GPU tests call 1's shards did not reach in 300 s (verbose: which test, how long), then the
# engine A/B of PDL for the step's kernels (+ LoRA's) in bf16, bf16 + 64 adapters and fp8 (providers -plain).
set -o pipefail
mkdir -p $OUT/c2
trap 'tar czf $OUT/c2.tgz -C $OUT c2 && rm -rf $OUT/c2' EXIT
R=$PWD
pip install -q --no-deps --no-build-isolation --target /tmp/ml . >/dev/null 2>&1
export PYTHONPATH=/tmp/ml PYTHONUNBUFFERED=1
{ git log --oneline -1; md5sum kernels/*.py bench/bench_generate.py; } > $OUT/c2/tree.txt 2>&1
T=$R/tests
(cd /tmp && timeout 230 python3 -m pytest -m gpu -v -p no:cacheprovider -rfEs --durations=8 $T/test_engine_gpu.py \
   $T/test_model_gemma2_gpu.py > $OUT/c2/tests_x.log 2>&1; echo "rc=$? at $SECONDS s" >> $OUT/c2/tests_x.log) &
(cd /tmp && timeout 230 python3 -m pytest -m gpu -v -p no:cacheprovider -rfEs --durations=8 $T/test_model_phi3_gpu.py \
   $T/test_sampling.py "$T/test_fp8_gpu.py::test_engine_fp8_with_pdl_equals_plain_launches" \
   "$T/test_fp8_gpu.py::test_engine_fp8_logits_at_a_tuned_shape" > $OUT/c2/tests_y.log 2>&1; echo "rc=$? at $SECONDS s" >> $OUT/c2/tests_y.log) &
wait
L=$(( 585 - SECONDS ))
timeout $L python3 bench/bench_generate.py --providers multilora,multilora-plain,multilora-lora,multilora-lora-plain,multilora-fp8,multilora-fp8-plain \
  --rounds 3 --batches 1,64 --gen 64 --adapter-files 8 --time-budget $(( L - 25 )) --out $OUT/c2/gen > $OUT/c2/gen.log 2>&1
echo "rc=$? at $SECONDS s" >> $OUT/c2/gen.log; rm -f $OUT/c2/gen/*.png
