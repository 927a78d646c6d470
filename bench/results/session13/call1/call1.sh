#!/usr/bin/env bash
# session 13, call 1: the whole GPU suite on main, then S1 N=5 vs 2000 at --rate auto
set -o pipefail
R=$PWD
pip install -q --no-deps --no-build-isolation --target /tmp/ml . >/dev/null 2>&1
export PYTHONPATH=/tmp/ml PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > $OUT/gpu.txt 2>&1
(cd /tmp && timeout 340 python3 -m pytest -m gpu -q -p no:cacheprovider -rfEs $R/tests 2>&1 | tail -60 > $OUT/gpu_tests_session13_main.log)
echo "suite rc=$? at $SECONDS s" >> $OUT/gpu_tests_session13_main.log
mkdir -p $OUT/s1
timeout $((585 - SECONDS)) python3 bench/bench_serving.py --shape llama3-8b --adapters 5,2000 --adapter-files 64 \
  --modes engine --requests 256 --rate auto --no-burst-rows --engine-warmup --warmup-requests 0 \
  --out $OUT/s1 --tag s1_rate_auto > $OUT/s1/s1_rate_auto.log 2>&1
echo "bench rc=$? at $SECONDS s" >> $OUT/s1/s1_rate_auto.log
