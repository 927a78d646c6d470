#!/usr/bin/env bash
# session 25, call 4: where an fp8 batch-64 decode step's time goes with the TMA tiles (profile_decode --no-pdl, to
# set against sessions 23/24); issue 13's S1 rows (N = 5 and 2,000, rate auto) with async scheduling (the default), and
# the N = 5 row at the same rate with it off (session 24's A/B under Poisson arrivals).
set -o pipefail
mkdir -p $OUT/c4
trap 'tar czf $OUT/c4.tgz -C $OUT c4 && rm -rf $OUT/c4' EXIT
pip install -q --no-deps --no-build-isolation --target /tmp/ml . >/dev/null 2>&1
export PYTHONPATH=/tmp/ml PYTHONUNBUFFERED=1 R=$PWD
cp .device/s25call4.sh $OUT/c4/script.sh
git log --oneline -1 > $OUT/c4/tree.txt 2>/dev/null; git status --short >> $OUT/c4/tree.txt 2>/dev/null
timeout 80 python3 bench/profile_decode.py --weight-dtype fp8 --no-pdl --batch 64 --json $OUT/c4/prof_fp8_b64.json \
  > $OUT/c4/prof_fp8_b64.log 2>&1; echo "rc=$? at $SECONDS s" >> $OUT/c4/prof_fp8_b64.log
timeout 210 python3 bench/bench_serving.py --shape llama3-8b --adapters 5,2000 --adapter-files 64 \
  --modes engine --requests 256 --rate auto --no-burst-rows --engine-warmup --warmup-requests 0 --out $OUT/c4/s1 \
  > $OUT/c4/s1.log 2>&1
echo "s1 rc=$? at $SECONDS s" >> $OUT/c4/s1.log; rm -f $OUT/c4/s1/*.png
RATE=$(python3 -c "import json,glob; r=[x for f in glob.glob('$OUT/c4/s1/serving_*.json') for x in json.load(open(f))['rows'] if x.get('num_adapters')==5]; print(r[0]['request_rate'])" 2>/dev/null)
echo "rate $RATE" >> $OUT/c4/s1.log
if [ -n "$RATE" ] && [ $SECONDS -lt 440 ]; then
  timeout $((570 - SECONDS)) python3 bench/bench_serving.py --shape llama3-8b --adapters 5 --adapter-files 64 \
    --modes engine --requests 256 --rate $RATE --no-burst-rows --engine-warmup --warmup-requests 0 \
    --async-scheduling off --tag s1_sync --out $OUT/c4/s1sync > $OUT/c4/s1sync.log 2>&1
  echo "s1sync rc=$? at $SECONDS s" >> $OUT/c4/s1sync.log; rm -f $OUT/c4/s1sync/*.png
fi
true
