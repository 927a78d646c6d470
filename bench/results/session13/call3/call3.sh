#!/usr/bin/env bash
# session 13, call 3: the GPU tests after the point where call 1's suite was cut (its first 286 ran), then
# one-batch at 2048 with diagnostics: device finish (Python's default switch interval, then 0.5 ms), host finish
set -o pipefail
R=$PWD
pip install -q --no-deps --no-build-isolation --target /tmp/ml . >/dev/null 2>&1
export PYTHONPATH=/tmp/ml PYTHONUNBUFFERED=1
cd /tmp && python3 -m pytest -m gpu --co -q -p no:cacheprovider $R/tests 2>/dev/null | grep '::' > $OUT/gpu_ids.txt
FILES=$(tail -n +287 $OUT/gpu_ids.txt | awk -F'::' '{print $1}' | uniq | sed "s#^#$R/#" | sed "s#^$R/$R/#$R/#")
echo "$(wc -l < $OUT/gpu_ids.txt) gpu tests; tail files: $FILES" > $OUT/gpu_tests_tail.log
timeout 250 python3 -m pytest -m gpu -q -p no:cacheprovider -rfEs $FILES 2>&1 | tail -40 >> $OUT/gpu_tests_tail.log
echo "tail rc=$? at $SECONDS s" >> $OUT/gpu_tests_tail.log
cd $R
mkdir -p /tmp/adapters
run() {  # name, finish, extra args, time limit
  timeout $4 python3 bench/bench_adapter_throughput.py --shape llama3-8b --distinct-files 64 --counts 2048 \
    --popularity zipf --pool-adapters 0 --host-adapters 0 --adapter-dir /tmp/adapters --adapter-finish $2 \
    --load-threads 2 $3 --out $OUT/onebatch_$1 > $OUT/onebatch_$1.log 2>&1
  echo "onebatch $1 rc=$? at $SECONDS s (limit $4)" >> $OUT/onebatch_$1.log
}
run device device "" $(( (585 - SECONDS) * 38 / 100 ))
run device_si05 device "--switch-interval 0.0005" $(( (585 - SECONDS) * 60 / 100 ))
run host host "" $((585 - SECONDS))
