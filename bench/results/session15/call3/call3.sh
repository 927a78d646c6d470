#!/usr/bin/env bash
# session 15, call 3 (tree sent: exp/kernel-prologue rebased on main 61d2362; .ab/before = main):
# 1. the whole GPU suite on the tree sent, 3 shards at once (the decode-graph stream change touches every capture);
# 2. bench_lora_kernels --subset prefill, before then after (rows above 512 tokens + a second sample of the layer);
# 3. bench_generate on the tree sent: the side-stream priority A/B with the order of call 2 reversed
set -o pipefail
mkdir -p $OUT/r
trap 'tar czf $OUT/r.tgz -C $OUT r && rm -rf $OUT/r' EXIT
R=$PWD
(cd .ab/before && pip install -q --no-deps --no-build-isolation --target /tmp/ml_before . >/dev/null 2>&1)
pip install -q --no-deps --no-build-isolation --target /tmp/ml_after . >/dev/null 2>&1
export PYTHONPATH=/tmp/ml_after PYTHONUNBUFFERED=1
echo "before=$(cat .ab/before.rev) after=the working tree (exp/kernel-prologue)" > $OUT/r/trees.txt
md5sum kernels/triton_sgmv.py .ab/before/kernels/triton_sgmv.py runtime/cuda_graphs.py >> $OUT/r/trees.txt
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >> $OUT/r/trees.txt 2>&1
T=$R/tests
shard() {  # name, files...
  local n=$1; shift
  (cd /tmp && timeout 320 python3 -m pytest -m gpu -q -p no:cacheprovider -rfEs --durations=5 "$@" > /tmp/shard_$n.log 2>&1;
   echo "shard $n rc=$? at $SECONDS s" >> /tmp/shard_$n.log)
}
shard A $T/test_kernels.py $T/test_fused_ops.py $T/test_image_finish.py $T/test_fp8_gpu.py $T/test_model_phi3_gpu.py &
shard B $T/test_attention.py $T/test_sampling.py $T/test_engine_gpu.py $T/test_model_gemma2_gpu.py $T/test_model_families_gpu.py $T/test_engine_unified.py &
shard C $T/test_adapter_tiers.py $T/test_engine_loop.py $T/test_engine_diagnostics.py $T/test_adapter_memory.py $T/test_suite_halves.py &
wait
for n in A B C; do echo "=== shard $n"; tail -25 /tmp/shard_$n.log; done > $OUT/r/gpu_tests.log
grep -h "^FAILED\|^ERROR" /tmp/shard_*.log | sed 's/^[A-Z]* //; s/ - .*//' | sort -u > /tmp/failed.txt
if [ -s /tmp/failed.txt ]; then  # ids as pytest printed them, relative to /tmp
  echo "=== re-run alone: $(wc -l < /tmp/failed.txt) failed in the shards" >> $OUT/r/gpu_tests.log
  (cd /tmp && timeout 100 python3 -m pytest -m gpu -q -p no:cacheprovider -rfEs $(cat /tmp/failed.txt) 2>&1 | tail -30 >> $OUT/r/gpu_tests.log)
fi
echo "tests done at $SECONDS s" >> $OUT/r/gpu_tests.log
for v in before after; do
  PYTHONPATH=/tmp/ml_$v timeout 75 python3 bench/bench_lora_kernels.py --subset prefill --budget-s 45 \
    --out $OUT/r/kern_$v > $OUT/r/kern_$v.log 2>&1; echo "rc=$? at $SECONDS s" >> $OUT/r/kern_$v.log
  rm -f $OUT/r/kern_$v/*.png
done
python3 bench/bench_lora_kernels.py --compare $OUT/r/kern_before/lora_kernels.json $OUT/r/kern_after/lora_kernels.json \
  > $OUT/r/kern_compare.md 2>&1
L=$(( 590 - SECONDS ))
timeout $L python3 bench/bench_generate.py --providers multilora,multilora-lora-hiprio,multilora-lora --batches 1,64 \
  --gen 64 --adapter-files 8 --time-budget $(( L - 40 )) --out $OUT/r/gen > $OUT/r/gen.log 2>&1
echo "rc=$? at $SECONDS s" >> $OUT/r/gen.log
rm -f $OUT/r/gen/*.png
