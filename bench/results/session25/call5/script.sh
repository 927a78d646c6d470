#!/usr/bin/env bash
# session 25, call 5: issue 13's S1 N = 5 row at call 4's offered rate (21.04 req/s) with async scheduling off: the
# A/B against call 4's N = 5 row (async on, the default). (Call 4's script read the rate back wrong.)
set -o pipefail
mkdir -p $OUT/c5
trap 'tar czf $OUT/c5.tgz -C $OUT c5 && rm -rf $OUT/c5' EXIT
pip install -q --no-deps --no-build-isolation --target /tmp/ml . >/dev/null 2>&1
export PYTHONPATH=/tmp/ml PYTHONUNBUFFERED=1
cp .device/s25call5.sh $OUT/c5/script.sh
timeout 160 python3 bench/bench_serving.py --shape llama3-8b --adapters 5 --adapter-files 64 \
  --modes engine --requests 256 --rate 21.04 --no-burst-rows --engine-warmup --warmup-requests 0 \
  --async-scheduling off --tag s1_sync --out $OUT/c5/s1sync > $OUT/c5/s1sync.log 2>&1
echo "s1sync rc=$? at $SECONDS s" >> $OUT/c5/s1sync.log; rm -f $OUT/c5/s1sync/*.png
true
