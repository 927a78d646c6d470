#!/usr/bin/env bash
# session 13, call 2: GPU tests of the changed modules, finish_under_compute, one-batch at 2048 (device, then host)
set -o pipefail
R=$PWD
pip install -q --no-deps --no-build-isolation --target /tmp/ml . >/dev/null 2>&1
export PYTHONPATH=/tmp/ml PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > $OUT/gpu.txt 2>&1
(cd /tmp && timeout 120 python3 -m pytest -m gpu -q -p no:cacheprovider -rfEs $R/tests/test_image_finish.py \
  $R/tests/test_adapter_tiers.py 2>&1 | tail -30 > $OUT/gpu_tests_changed.log)
echo "tests rc=$? at $SECONDS s" >> $OUT/gpu_tests_changed.log
timeout 100 python3 bench/finish_under_compute.py --out $OUT/fuc > $OUT/finish_under_compute.log 2>&1
echo "fuc rc=$? at $SECONDS s" >> $OUT/finish_under_compute.log
mkdir -p /tmp/adapters
for F in device host; do
  T=$((540 - SECONDS)); [ $F = device ] && T=$(( (540 - SECONDS) * 55 / 100 ))
  timeout $T python3 bench/bench_adapter_throughput.py --shape llama3-8b --distinct-files 64 --counts 2048 \
    --popularity zipf --pool-adapters 0 --host-adapters 0 --adapter-dir /tmp/adapters --adapter-finish $F \
    --load-threads 2 --out $OUT/onebatch_$F > $OUT/onebatch_$F.log 2>&1
  echo "onebatch $F rc=$? at $SECONDS s (limit $T)" >> $OUT/onebatch_$F.log
done
