#!/usr/bin/env bash
# session 24, call 3: the GPU suite again in four shards (call 2's three shards hit their 380 s limit in A and B,
# with no failure before it), with async scheduling on by default.
set -o pipefail
mkdir -p $OUT/c3
trap 'tar czf $OUT/c3.tgz -C $OUT c3 && rm -rf $OUT/c3' EXIT
R=$PWD
pip install -q --no-deps --no-build-isolation --target /tmp/ml . >/dev/null 2>&1
export PYTHONPATH=/tmp/ml PYTHONUNBUFFERED=1
{ git log --oneline -1; git status --short; } > $OUT/c3/tree.txt 2>&1
cp .device/s24call3.sh $OUT/c3/script.sh
bash scripts/gpu_suite.sh $OUT/c3/gpu 440
echo "suite rc=$? at $SECONDS s" >> $OUT/c3/tree.txt
true
