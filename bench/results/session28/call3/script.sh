#!/usr/bin/env bash
# session 28, call 3: a pool miss without a host sync (AdapterPool's metadata through to_device; call 2: a mixed step
# with a miss 12.7 ms against 7.7 without, its schedule phase 6.1 ms) and registration through read_image: the GPU
# tests they touch and the tail of call 1's shard A (cut at its time limit); issue 13's S1 rows N = 5 and 2,000 in one
# run; the one-batch bench over 2,048 adapters.
set -o pipefail
mkdir -p $OUT/c3
trap 'tar czf $OUT/c3.tgz -C $OUT c3 && rm -rf $OUT/c3' EXIT
. scripts/device_env.sh
cp .device/s28call3.sh $OUT/c3/script.sh
git log --oneline -1 > $OUT/c3/tree.txt 2>/dev/null; git status --short >> $OUT/c3/tree.txt 2>/dev/null
(cd /tmp && timeout 170 python3 -m pytest -m gpu -q -p no:cacheprovider -rfEs "$R/tests/test_adapter_tiers.py" \
  "$R/tests/test_fused_ops.py" "$R/tests/test_kernels.py" \
  -k "not test_kernels or pdl_launches or replayed_after_compaction or large_offsets or decode_cuda_graph_capture" \
  > $OUT/c3/tests.log 2>&1; echo "rc=$? at $SECONDS s" >> $OUT/c3/tests.log)
timeout 260 python3 bench/bench_serving.py --shape llama3-8b --adapters 5,2000 --adapter-files 64 \
  --modes engine --requests 256 --rate auto --no-burst-rows --engine-warmup --warmup-requests 0 --out $OUT/c3/s1 \
  > $OUT/c3/s1.log 2>&1
echo "s1 rc=$? at $SECONDS s" >> $OUT/c3/s1.log; rm -f $OUT/c3/s1/*.png
mkdir -p /tmp/adapters
ob() {  # name, flags...
  local n=$1; shift
  [ $SECONDS -gt 520 ] && return
  timeout $(( 585 - SECONDS )) python3 bench/bench_adapter_throughput.py --shape llama3-8b --distinct-files 64 --counts 2048 \
    --popularity zipf --pool-adapters 0 --host-adapters 0 --adapter-dir /tmp/adapters --load-threads 2 --sample-threads \
    --out $OUT/c3/ob_$n "$@" > $OUT/c3/ob_$n.log 2>&1
  echo "rc=$? at $SECONDS s" >> $OUT/c3/ob_$n.log; rm -f $OUT/c3/ob_$n/*.png
}
ob prime; sync
ob default
true
