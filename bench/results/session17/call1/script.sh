#!/usr/bin/env bash
# session 16, call 2 (tree sent: main + the looped decode expand as default + the side-stream SM carve-out knob):
# 1. the whole GPU suite, 3 shards at once; failures re-run alone;
# 2. bench_lora_overlap r16 at 1, 8, 32, 64, 128 tokens, serial / side_all: the one-tile expand (before), the looped
#    default, then cuBLASLt, cuBLASLt + carve-out 16, 32 (with the looped default);
# 3. bench_generate batch 1 and 64: multilora, multilora-lora, multilora-lora-onetile, multilora-lora-carve (32 SMs)
set -o pipefail
mkdir -p $OUT/c2
trap 'tar czf $OUT/c2.tgz -C $OUT c2 && rm -rf $OUT/c2' EXIT
R=$PWD
pip install -q --no-deps --no-build-isolation --target /tmp/ml . >/dev/null 2>&1
export PYTHONPATH=/tmp/ml PYTHONUNBUFFERED=1
{ git log --oneline -1 2>/dev/null; md5sum kernels/triton_sgmv.py runtime/model.py; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; } > $OUT/c2/trees.txt 2>&1
T=$R/tests
shard() {  # name, files...
  local n=$1; shift
  (cd /tmp && timeout 300 python3 -m pytest -m gpu -q -p no:cacheprovider -rfEs --durations=5 "$@" > /tmp/shard_$n.log 2>&1;
   echo "shard $n rc=$? at $SECONDS s" >> /tmp/shard_$n.log)
}
shard A $T/test_kernels.py $T/test_fused_ops.py $T/test_image_finish.py $T/test_fp8_gpu.py $T/test_model_phi3_gpu.py &
shard B $T/test_attention.py $T/test_sampling.py $T/test_engine_gpu.py $T/test_model_gemma2_gpu.py &
shard C $T/test_adapter_tiers.py $T/test_engine_loop.py $T/test_engine_diagnostics.py $T/test_adapter_memory.py $T/test_suite_halves.py $T/test_model_families_gpu.py $T/test_engine_unified.py &
wait
for n in A B C; do echo "=== shard $n"; tail -25 /tmp/shard_$n.log; done > $OUT/c2/gpu_tests.log
grep -h "^FAILED\|^ERROR" /tmp/shard_*.log | sed 's/^[A-Z]* //; s/ - .*//' | sort -u > /tmp/failed.txt
if [ -s /tmp/failed.txt ]; then  # ids as pytest printed them, relative to /tmp
  echo "=== re-run alone: $(wc -l < /tmp/failed.txt) failed in the shards" >> $OUT/c2/gpu_tests.log
  (cd /tmp && timeout 100 python3 -m pytest -m gpu -q -p no:cacheprovider -rfEs $(cat /tmp/failed.txt) 2>&1 | tail -60 >> $OUT/c2/gpu_tests.log)
fi
echo "tests done at $SECONDS s" >> $OUT/c2/gpu_tests.log
ov() {  # name, flags...
  local n=$1; shift
  timeout 60 python3 bench/bench_lora_overlap.py --cases r16 --tokens 1,8,32,64,128 --no-sweep --schedules serial,side_all \
    --out $OUT/c2/overlap "$@" > $OUT/c2/overlap_$n.log 2>&1; echo "rc=$? at $SECONDS s" >> $OUT/c2/overlap_$n.log
}
ov onetile --expand-one-tile
ov default
ov lt --blas cublaslt
ov lt_carve16 --blas cublaslt --carveout 16
ov lt_carve32 --blas cublaslt --carveout 32
L=$(( 590 - SECONDS ))
if [ $L -gt 120 ]; then
  timeout $L python3 bench/bench_generate.py --providers multilora,multilora-lora,multilora-lora-onetile,multilora-lora-carve \
    --carveout 32 --batches 1,64 --gen 64 --adapter-files 8 --time-budget $(( L - 40 )) \
    --out $OUT/c2/gen > $OUT/c2/gen.log 2>&1
  echo "rc=$? at $SECONDS s" >> $OUT/c2/gen.log
  rm -f $OUT/c2/gen/*.png
fi
