#!/usr/bin/env bash
# session 20, call 1 (main at HEAD): the whole GPU suite after session 19's changes (scripts/gpu_suite.sh, 3 shards);
# then issue 13's one-batch row at 2,048 adapters: host finish (default) vs device finish, 4 I/O threads, then
# host finish with 8 I/O threads if time is left (reads bound the batch's tail: 34-52 reads at ~1 GB/s each).
set -o pipefail
mkdir -p $OUT/c1 /tmp/adapters
trap 'tar czf $OUT/c1.tgz -C $OUT c1 && rm -rf $OUT/c1' EXIT
pip install -q --no-deps --no-build-isolation --target /tmp/ml . >/dev/null 2>&1
export PYTHONPATH=/tmp/ml PYTHONUNBUFFERED=1
{ git log -1 --format=%H 2>/dev/null; md5sum kernels/triton_sgmv.py runtime/model.py memory/host_arena.py runtime/adapter_cache.py bench/*.py; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; } > $OUT/c1/trees.txt 2>&1
bash scripts/gpu_suite.sh $OUT/c1/gpu 330; echo "suite rc=$? at $SECONDS s" >> $OUT/c1/gpu/gpu_tests.log
ob() {  # name, flags...
  local n=$1; shift
  timeout 120 python3 bench/bench_adapter_throughput.py --shape llama3-8b --distinct-files 64 --counts 2048 \
    --popularity zipf --pool-adapters 0 --host-adapters 0 --adapter-dir /tmp/adapters --load-threads 2 --sample-threads \
    --out $OUT/c1/ob_$n "$@" > $OUT/c1/ob_$n.log 2>&1
  echo "rc=$? at $SECONDS s" >> $OUT/c1/ob_$n.log; rm -f $OUT/c1/ob_$n/*.png
}
ob host4 --io-threads 4
ob device4 --io-threads 4 --adapter-finish device
[ $SECONDS -lt 500 ] && ob host8 --io-threads 8
echo done
