#!/usr/bin/env bash
# session 26, call 4: engine GPU tests on the final decode-attention launch (peft agreement, graphs vs eager, PDL).
set -o pipefail
mkdir -p $OUT/c4
trap 'tar czf $OUT/c4.tgz -C $OUT c4 && rm -rf $OUT/c4' EXIT
pip install -q --no-deps --no-build-isolation --target /tmp/ml . >/dev/null 2>&1
export PYTHONPATH=/tmp/ml PYTHONUNBUFFERED=1 R=$PWD
cp .device/s26call4.sh $OUT/c4/script.sh
git log --oneline -1 > $OUT/c4/tree.txt 2>/dev/null
(cd /tmp && timeout 130 python3 -m pytest -m gpu -q -p no:cacheprovider -rfEs -x $R/tests/test_engine_gpu.py \
  -k "matches_peft or cuda_graph or pdl" > $OUT/c4/test.log 2>&1; echo "rc=$? at $SECONDS s" >> $OUT/c4/test.log)
true
