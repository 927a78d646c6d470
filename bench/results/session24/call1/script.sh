#!/usr/bin/env bash
# session 24, call 1: async scheduling (EngineConfig.async_scheduling, new; on by default on CUDA) on the GPU: its
# GPU tests; the engine rows of issues 12 and 16 with it and without it (-sync providers), batch 1 and 64, 3 rounds;
# where fp8 decode time goes with it (profile_decode --no-pdl, to set against session 23's call 4).
set -o pipefail
mkdir -p $OUT/c1
trap 'tar czf $OUT/c1.tgz -C $OUT c1 && rm -rf $OUT/c1' EXIT
R=$PWD
pip install -q --no-deps --no-build-isolation --target /tmp/ml . >/dev/null 2>&1
export PYTHONPATH=/tmp/ml PYTHONUNBUFFERED=1
{ git log --oneline -1; git status --short; md5sum kernels/*.py runtime/*.py bench/bench_generate.py; nvidia-smi -q | grep -i -m3 "clocks\|product name"; } > $OUT/c1/tree.txt 2>&1
cp .device/s24call1.sh $OUT/c1/script.sh
(cd /tmp && timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider -rfEs $R/tests/test_engine_gpu.py -k "async or graph_decode_matches" \
  > $OUT/c1/test_async.log 2>&1; echo "rc=$? at $SECONDS s" >> $OUT/c1/test_async.log)
timeout 240 python3 bench/bench_generate.py \
  --providers multilora,multilora-sync,multilora-lora,multilora-lora-sync,multilora-fp8,multilora-fp8-sync \
  --rounds 3 --batches 1,64 --gen 64 --time-budget 220 --out $OUT/c1/gen > $OUT/c1/gen.log 2>&1
echo "rc=$? at $SECONDS s" >> $OUT/c1/gen.log; rm -f $OUT/c1/gen/*.png
for b in 1 64; do
  [ $SECONDS -gt 480 ] && break
  timeout 80 python3 bench/profile_decode.py --weight-dtype fp8 --no-pdl --batch $b --json $OUT/c1/prof_fp8_b${b}.json \
    > $OUT/c1/prof_fp8_b${b}.log 2>&1; echo "rc=$? at $SECONDS s" >> $OUT/c1/prof_fp8_b${b}.log
done
true
