#!/usr/bin/env bash
# session 24, call 5: after the review fixes (pool frees record an event that side-stream loads wait for; abort reads
# back first; interrupt-safe pending counts): the GPU tests of the adapter tiers, the unified pool, adapter memory
# and the async engine tests, two processes at once.
set -o pipefail
mkdir -p $OUT/c5
trap 'tar czf $OUT/c5.tgz -C $OUT c5 && rm -rf $OUT/c5' EXIT
R=$PWD
pip install -q --no-deps --no-build-isolation --target /tmp/ml . >/dev/null 2>&1
export PYTHONPATH=/tmp/ml PYTHONUNBUFFERED=1
cp .device/s24call5.sh $OUT/c5/script.sh
(cd /tmp && timeout 170 python3 -m pytest -m gpu -q -p no:cacheprovider -rfEs $R/tests/test_adapter_tiers.py \
  $R/tests/test_engine_unified.py $R/tests/test_adapter_memory.py > $OUT/c5/tiers.log 2>&1; echo "rc=$? at $SECONDS s" >> $OUT/c5/tiers.log) &
(cd /tmp && timeout 170 python3 -m pytest -m gpu -q -p no:cacheprovider -rfEs $R/tests/test_engine_gpu.py -k async \
  $R/tests/test_engine_loop.py > $OUT/c5/async.log 2>&1; echo "rc=$? at $SECONDS s" >> $OUT/c5/async.log) &
wait
true
