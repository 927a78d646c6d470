#!/usr/bin/env bash
# session 19, call 3: issue 13's one-batch row at 2,048 adapters with prefetch no longer waiting for a chunk mapped
# ahead (twice: the row's spread is large), S1 at --rate auto (last run in session 13), then the GPU tests of the
# engine (test_engine_gpu: call 1's shard B did not finish it) and the adapter tiers.
set -o pipefail
mkdir -p $OUT/c3 /tmp/adapters
trap 'tar czf $OUT/c3.tgz -C $OUT c3 && rm -rf $OUT/c3' EXIT
R=$PWD
pip install -q --no-deps --no-build-isolation --target /tmp/ml . >/dev/null 2>&1
export PYTHONPATH=/tmp/ml PYTHONUNBUFFERED=1
md5sum kernels/triton_sgmv.py memory/host_arena.py runtime/adapter_cache.py bench/*.py > $OUT/c3/trees.txt
for i in 1 2; do
  timeout 130 python3 bench/bench_adapter_throughput.py --shape llama3-8b --distinct-files 64 --counts 2048 \
    --popularity zipf --pool-adapters 0 --host-adapters 0 --adapter-dir /tmp/adapters --load-threads 2 --sample-threads \
    --out $OUT/c3/onebatch$i > $OUT/c3/onebatch$i.log 2>&1
  echo "onebatch rc=$? at $SECONDS s" >> $OUT/c3/onebatch$i.log; rm -f $OUT/c3/onebatch$i/*.png
done
timeout $(( 400 - SECONDS )) python3 bench/bench_serving.py --shape llama3-8b --adapters 5,2000 --adapter-files 64 \
  --modes engine --requests 256 --rate auto --no-burst-rows --engine-warmup --warmup-requests 0 --out $OUT/c3/s1 \
  > $OUT/c3/s1.log 2>&1
echo "s1 rc=$? at $SECONDS s" >> $OUT/c3/s1.log; rm -f $OUT/c3/s1/*.png
T=$R/tests
(cd /tmp && timeout $(( 585 - SECONDS )) python3 -m pytest -m gpu -q -p no:cacheprovider -rfEs $T/test_engine_gpu.py $T/test_adapter_tiers.py \
   > $OUT/c3/gpu_tests.log 2>&1; echo "rc=$? at $SECONDS s" >> $OUT/c3/gpu_tests.log)
