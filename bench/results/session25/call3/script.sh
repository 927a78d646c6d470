#!/usr/bin/env bash
# session 25, call 3: the layer's four fp8 GEMMs at graph-bucket row counts, the shipped table (TMA tiles for 2-64
# rows) against session 24's (pointer tiles); then the whole GPU suite on this tree.
set -o pipefail
mkdir -p $OUT/c3
trap 'tar czf $OUT/c3.tgz -C $OUT c3 && rm -rf $OUT/c3' EXIT
pip install -q --no-deps --no-build-isolation --target /tmp/ml . >/dev/null 2>&1
export PYTHONPATH=/tmp/ml PYTHONUNBUFFERED=1 R=$PWD
cp .device/s25call3.sh $OUT/c3/script.sh
git log --oneline -1 > $OUT/c3/tree.txt 2>/dev/null; git status --short >> $OUT/c3/tree.txt 2>/dev/null
timeout 100 python3 bench/sweep_fp8_gemv.py --layer-only .device/fp8_table_s24.json --layer-ms 1,2,8,16,24,32,40,48,56,64 \
  --rep 10 --out $OUT/c3/layer > $OUT/c3/layer.log 2>&1
echo "rc=$? at $SECONDS s" >> $OUT/c3/layer.log
bash scripts/gpu_suite.sh $OUT/c3 $((570 - SECONDS)) > $OUT/c3/suite.out 2>&1
echo "suite rc=$? at $SECONDS s" >> $OUT/c3/suite.out
true
