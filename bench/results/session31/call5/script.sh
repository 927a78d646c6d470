#!/usr/bin/env bash
# session 31, call 5 (the session's last ~200 s): the new engine GPU test of a 620-token prefill from a rank-16 pool
# (the looped prefill tiles in the engine) against peft, bf16 and fp16.
set -o pipefail
mkdir -p $OUT/c5
trap 'tar czf $OUT/c5.tgz -C $OUT c5 && rm -rf $OUT/c5' EXIT
. scripts/device_env.sh
cp .device/s31call5.sh $OUT/c5/script.sh
git log --oneline -1 > $OUT/c5/tree.txt 2>/dev/null
(cd /tmp && timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider -rfEs "$R/tests/test_engine_gpu.py" \
  -k "rank16_pool" > $OUT/c5/tests.log 2>&1; echo "rc=$? at $SECONDS s" >> $OUT/c5/tests.log)
true
