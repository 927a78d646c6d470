#!/usr/bin/env bash
# session 13, call 4 (after the event-query change): GPU tests of the changed modules; one-batch at 2048, device and
# host finish, each with Python's default switch interval and with 0.5 ms; finish_under_compute (all rows)
set -o pipefail
R=$PWD
pip install -q --no-deps --no-build-isolation --target /tmp/ml . >/dev/null 2>&1
export PYTHONPATH=/tmp/ml PYTHONUNBUFFERED=1
(cd /tmp && timeout 100 python3 -m pytest -m gpu -q -p no:cacheprovider -rfEs $R/tests/test_image_finish.py \
  $R/tests/test_adapter_tiers.py 2>&1 | tail -20 > $OUT/gpu_tests_changed.log)
echo "tests rc=$? at $SECONDS s" >> $OUT/gpu_tests_changed.log
mkdir -p /tmp/adapters
run() {  # name, finish, extra args, time limit
  timeout $4 python3 bench/bench_adapter_throughput.py --shape llama3-8b --distinct-files 64 --counts 2048 \
    --popularity zipf --pool-adapters 0 --host-adapters 0 --adapter-dir /tmp/adapters --adapter-finish $2 \
    --load-threads 2 $3 --out $OUT/onebatch_$1 > $OUT/onebatch_$1.log 2>&1
  echo "onebatch $1 rc=$? at $SECONDS s (limit $4)" >> $OUT/onebatch_$1.log
  rm -f $OUT/onebatch_$1/*.png
}
run device device "" 130
run device_si05 device "--switch-interval 0.0005" 110
run host host "" 110
run host_si05 host "--switch-interval 0.0005" $((520 - SECONDS))
timeout $((585 - SECONDS)) python3 bench/finish_under_compute.py --out $OUT/fuc > $OUT/finish_under_compute.log 2>&1
echo "fuc rc=$? at $SECONDS s" >> $OUT/finish_under_compute.log
