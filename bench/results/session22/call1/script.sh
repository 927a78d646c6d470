#!/usr/bin/env bash
# The first call of the next session (written in session 21, not run): the Gemma 2 test that did not finish; the fp8
# one-row GEMV widened through float16 (GEMV_WIDEN_F16, off until measured) per GEMM and in the engine; batch-64 rows
# with the new diagnostics (tpot_in_run_ms, slowest_steps, step_ms_by_kind, ms_outside_steps, gc_pauses_ms).
# Copy to .device/ and run with carry [".device"]; about 420 s.
set -o pipefail
mkdir -p $OUT/c1
trap 'tar czf $OUT/c1.tgz -C $OUT c1 && rm -rf $OUT/c1' EXIT
R=$PWD
pip install -q --no-deps --no-build-isolation --target /tmp/ml . >/dev/null 2>&1
export PYTHONPATH=/tmp/ml PYTHONUNBUFFERED=1
{ git log --oneline -1; md5sum kernels/*.py bench/bench_generate.py bench/bench_fp8.py; } > $OUT/c1/tree.txt 2>&1
T=$R/tests
(cd /tmp && timeout 100 python3 -m pytest -m gpu -v -p no:cacheprovider -rfEs --durations=8 $T/test_model_gemma2_gpu.py \
   $T/test_fp8_gpu.py -k "9b_widths or widening" > $OUT/c1/tests.log 2>&1
 echo "rc=$? at $SECONDS s" >> $OUT/c1/tests.log)
timeout 90 python3 bench/bench_fp8.py --ms 1 --out $OUT/c1/fp8 > $OUT/c1/fp8.log 2>&1; echo "rc=$? at $SECONDS s" >> $OUT/c1/fp8.log
L=$(( 560 - SECONDS ))
timeout $L python3 bench/bench_generate.py --providers multilora,multilora-lora,multilora-fp8,multilora-fp8-f16widen \
  --rounds 3 --batches 1,64 --gen 64 --adapter-files 8 --time-budget $(( L - 25 )) --out $OUT/c1/gen > $OUT/c1/gen.log 2>&1
echo "rc=$? at $SECONDS s" >> $OUT/c1/gen.log; rm -f $OUT/c1/gen/*.png
