#!/usr/bin/env bash
# session 19, call 1 (main at de17fa4): the whole GPU suite after session 18's changes (3 shards; failures re-run
# alone); the layer with each token its own adapter (default --popularity distinct) at 1/8/64/256 tokens, session
# 18's tiles and the wide regime's 32-way shrink split; profile_decode batch 64 with LoRA in what is left.
set -o pipefail
mkdir -p $OUT/c1
trap 'tar czf $OUT/c1.tgz -C $OUT c1 && rm -rf $OUT/c1' EXIT
R=$PWD
pip install -q --no-deps --no-build-isolation --target /tmp/ml . >/dev/null 2>&1
export PYTHONPATH=/tmp/ml PYTHONUNBUFFERED=1
{ md5sum kernels/triton_sgmv.py runtime/model.py memory/host_arena.py bench/*.py; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; } > $OUT/c1/trees.txt 2>&1
T=$R/tests
shard() {  # name, files...
  local n=$1; shift
  (cd /tmp && timeout 290 python3 -m pytest -m gpu -q -p no:cacheprovider -rfEs --durations=5 "$@" > /tmp/shard_$n.log 2>&1;
   echo "shard $n rc=$? at $SECONDS s" >> /tmp/shard_$n.log)
}
shard A $T/test_kernels.py $T/test_fused_ops.py $T/test_image_finish.py $T/test_fp8_gpu.py $T/test_model_phi3_gpu.py &
shard B $T/test_attention.py $T/test_sampling.py $T/test_engine_gpu.py $T/test_model_gemma2_gpu.py &
shard C $T/test_adapter_tiers.py $T/test_engine_loop.py $T/test_engine_diagnostics.py $T/test_adapter_memory.py $T/test_suite_halves.py $T/test_model_families_gpu.py $T/test_engine_unified.py &
wait
for n in A B C; do echo "=== shard $n"; tail -25 /tmp/shard_$n.log; done > $OUT/c1/gpu_tests.log
grep -h "^FAILED\|^ERROR" /tmp/shard_*.log | sed 's/^[A-Z]* //; s/ - .*//' | sort -u > /tmp/failed.txt
if [ -s /tmp/failed.txt ]; then
  echo "=== re-run alone: $(wc -l < /tmp/failed.txt) failed in the shards" >> $OUT/c1/gpu_tests.log
  (cd /tmp && timeout 60 python3 -m pytest -m gpu -q -p no:cacheprovider -rfEs $(cat /tmp/failed.txt) 2>&1 | tail -60 >> $OUT/c1/gpu_tests.log)
fi
echo "tests done at $SECONDS s" >> $OUT/c1/gpu_tests.log
ov() {  # name, flags...
  local n=$1; shift
  timeout 80 python3 bench/bench_lora_overlap.py --cases all --tokens 1,8,64,256 --no-sweep --schedules serial,side_all \
    --out $OUT/c1/overlap_$n "$@" > $OUT/c1/overlap_$n.log 2>&1; echo "rc=$? at $SECONDS s" >> $OUT/c1/overlap_$n.log
}
ov s18
ov wshrink --wide-shrink 32,64
L=$(( 588 - SECONDS ))
if [ $L -gt 40 ]; then
  timeout $L python3 bench/profile_decode.py --batch 64 --lora --top 25 --json $OUT/c1/profile_b64_lora.json \
    > $OUT/c1/profile_b64_lora.log 2>&1; echo "rc=$? at $SECONDS s" >> $OUT/c1/profile_b64_lora.log
fi
