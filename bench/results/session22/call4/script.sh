#!/usr/bin/env bash
# session 22, call 4: test_fp8_gpu.py whole (call 3's shard A reached its 330 s limit 38 tests into it; everything
# before it passed)
set -o pipefail
mkdir -p $OUT/c4
trap 'tar czf $OUT/c4.tgz -C $OUT c4 && rm -rf $OUT/c4' EXIT
R=$PWD
pip install -q --no-deps --no-build-isolation --target /tmp/ml . >/dev/null 2>&1
export PYTHONPATH=/tmp/ml PYTHONUNBUFFERED=1
git log --oneline -1 > $OUT/c4/tree.txt 2>&1
(cd /tmp && timeout 250 python3 -m pytest -m gpu -v -p no:cacheprovider -rfEs --durations=8 $R/tests/test_fp8_gpu.py \
   > $OUT/c4/test_fp8_gpu.log 2>&1; echo "rc=$? at $SECONDS s" >> $OUT/c4/test_fp8_gpu.log)
