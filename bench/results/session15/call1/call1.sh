#!/usr/bin/env bash
# session 15, call 1: the whole GPU suite on main (3 shards at once on the one GPU; failures re-run alone), then the
# one-batch row at 2048 adapters, device finish, 5 ms and 0.5 ms switch intervals, with --sample-threads
set -o pipefail
R=$PWD
pip install -q --no-deps --no-build-isolation --target /tmp/ml . >/dev/null 2>&1
export PYTHONPATH=/tmp/ml PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > $OUT/gpu.txt 2>&1
git log --oneline -1 >> $OUT/gpu.txt
T=$R/tests
shard() {  # name, files...
  local n=$1; shift
  (cd /tmp && timeout 330 python3 -m pytest -m gpu -q -p no:cacheprovider -rfEs --durations=8 "$@" > /tmp/shard_$n.log 2>&1;
   echo "shard $n rc=$? at $SECONDS s" >> /tmp/shard_$n.log)
}
shard A $T/test_kernels.py $T/test_fused_ops.py $T/test_image_finish.py $T/test_fp8_gpu.py $T/test_model_phi3_gpu.py &
shard B $T/test_attention.py $T/test_sampling.py $T/test_engine_gpu.py $T/test_model_gemma2_gpu.py $T/test_model_families_gpu.py $T/test_engine_unified.py &
shard C $T/test_adapter_tiers.py $T/test_engine_loop.py $T/test_engine_diagnostics.py $T/test_adapter_memory.py $T/test_suite_halves.py &
wait
for n in A B C; do echo "=== shard $n"; tail -45 /tmp/shard_$n.log; done > $OUT/gpu_tests.log
grep -h "^FAILED\|^ERROR" /tmp/shard_*.log | sed 's/^[A-Z]* //; s/ - .*//' | sort -u > /tmp/failed.txt
if [ -s /tmp/failed.txt ]; then
  echo "=== re-run alone: $(wc -l < /tmp/failed.txt) failed in the shards" >> $OUT/gpu_tests.log
  (cd /tmp && timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider -rfEs $(sed "s|^|$R/|; s|^$R/$R|$R|" /tmp/failed.txt) 2>&1 | tail -40 >> $OUT/gpu_tests.log)
fi
echo "tests done at $SECONDS s" >> $OUT/gpu_tests.log
mkdir -p /tmp/adapters
run() {  # name, extra args, time limit
  timeout $3 python3 bench/bench_adapter_throughput.py --shape llama3-8b --distinct-files 64 --counts 2048 \
    --popularity zipf --pool-adapters 0 --host-adapters 0 --adapter-dir /tmp/adapters --adapter-finish device \
    --load-threads 2 --sample-threads $2 --out $OUT/onebatch_$1 > $OUT/onebatch_$1.log 2>&1
  echo "onebatch $1 rc=$? at $SECONDS s (limit $3)" >> $OUT/onebatch_$1.log
  rm -f $OUT/onebatch_$1/*.png
}
run si5 "--switch-interval 0.005" $((440 - SECONDS > 60 ? 440 - SECONDS : 60))
run si05 "--switch-interval 0.0005" $((585 - SECONDS > 30 ? 585 - SECONDS : 30))
