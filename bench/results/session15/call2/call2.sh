#!/usr/bin/env bash
# session 15, call 2 (tree sent: exp/kernel-prologue = main + the prologue reordering; .ab/before = main):
# 1. the GPU kernel tests on the branch; 2. bench_lora_kernels --subset decode, before then after;
# 3. bench_lora_overlap r16 cases, side stream at default vs highest priority (after tree);
# 4. bench_generate batch 1 and 64: before (multilora, multilora-lora), after (+ multilora-lora-hiprio)
set -o pipefail
mkdir -p $OUT/ab
trap 'tar czf $OUT/ab.tgz -C $OUT ab && rm -rf $OUT/ab' EXIT
R=$PWD
(cd .ab/before && pip install -q --no-deps --no-build-isolation --target /tmp/ml_before . >/dev/null 2>&1)
pip install -q --no-deps --no-build-isolation --target /tmp/ml_after . >/dev/null 2>&1
echo "before=$(cat .ab/before.rev) after=the working tree (exp/kernel-prologue)" > $OUT/ab/trees.txt
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >> $OUT/ab/trees.txt 2>&1
export PYTHONUNBUFFERED=1
(cd /tmp && PYTHONPATH=/tmp/ml_after timeout 130 python3 -m pytest -m gpu -q -p no:cacheprovider -rfEs \
  $R/tests/test_kernels.py $R/tests/test_adapter_memory.py $R/tests/test_engine_gpu.py::test_side_stream_lora_equals_lora_in_place \
  > $OUT/ab/gpu_tests_kernels.log 2>&1; echo "rc=$? at $SECONDS s" >> $OUT/ab/gpu_tests_kernels.log)
for v in before after; do
  PYTHONPATH=/tmp/ml_$v timeout 85 python3 bench/bench_lora_kernels.py --subset decode --budget-s 50 \
    --out $OUT/ab/kern_$v > $OUT/ab/kern_$v.log 2>&1; echo "rc=$? at $SECONDS s" >> $OUT/ab/kern_$v.log
  rm -f $OUT/ab/kern_$v/*.png
done
python3 bench/bench_lora_kernels.py --compare $OUT/ab/kern_before/lora_kernels.json $OUT/ab/kern_after/lora_kernels.json \
  > $OUT/ab/kern_compare.md 2>&1
PYTHONPATH=/tmp/ml_after timeout 75 python3 bench/bench_lora_overlap.py --cases r16 --no-sweep \
  --schedules side_all,side_all_hi --out $OUT/ab/overlap > $OUT/ab/overlap.log 2>&1
echo "rc=$? at $SECONDS s" >> $OUT/ab/overlap.log
gen() {  # tree, providers, limit
  PYTHONPATH=/tmp/ml_$1 timeout $3 python3 bench/bench_generate.py --providers $2 --batches 1,64 --gen 64 \
    --adapter-files 8 --time-budget $(( $3 - 45 )) --out $OUT/ab/gen_$1 > $OUT/ab/gen_$1.log 2>&1
  echo "rc=$? at $SECONDS s" >> $OUT/ab/gen_$1.log
  rm -f $OUT/ab/gen_$1/*.png
}
left=$(( 585 - SECONDS ))
gen before multilora,multilora-lora $(( left * 2 / 5 ))
gen after multilora,multilora-lora,multilora-lora-hiprio $(( 585 - SECONDS ))
