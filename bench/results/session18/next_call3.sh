#!/usr/bin/env bash
# the next session's third call (written in session 18, not run): issue 13's rows after session 18's kernel tiles and
# the host arena growing ahead: the one-batch row at 2,048 adapters (session 15's command, default finish and switch
# interval; rows now carry host_arena_sync_grows / _grown_ahead / _sync_map_seconds), then S1 at --rate auto.
set -o pipefail
mkdir -p $OUT/c3 /tmp/adapters
trap 'tar czf $OUT/c3.tgz -C $OUT c3 && rm -rf $OUT/c3' EXIT
pip install -q --no-deps --no-build-isolation --target /tmp/ml . >/dev/null 2>&1
export PYTHONPATH=/tmp/ml PYTHONUNBUFFERED=1
md5sum kernels/triton_sgmv.py memory/host_arena.py runtime/adapter_cache.py > $OUT/c3/trees.txt
timeout 270 python3 bench/bench_adapter_throughput.py --shape llama3-8b --distinct-files 64 --counts 2048 \
  --popularity zipf --pool-adapters 0 --host-adapters 0 --adapter-dir /tmp/adapters --load-threads 2 --sample-threads \
  --out $OUT/c3/onebatch > $OUT/c3/onebatch.log 2>&1
echo "onebatch rc=$? at $SECONDS s" >> $OUT/c3/onebatch.log; rm -f $OUT/c3/onebatch/*.png
timeout $(( 585 - SECONDS )) python3 bench/bench_serving.py --shape llama3-8b --adapters 5,2000 --adapter-files 64 \
  --modes engine --requests 256 --rate auto --no-burst-rows --engine-warmup --warmup-requests 0 --out $OUT/c3/s1 \
  > $OUT/c3/s1.log 2>&1
echo "s1 rc=$? at $SECONDS s" >> $OUT/c3/s1.log; rm -f $OUT/c3/s1/*.png
