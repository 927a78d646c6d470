#!/usr/bin/env bash
# session 19, call 4: rank-64 decode expand at 64 tokens = 64 adapters (r64 64/64 moves 671 MB at 64% of copy
# bandwidth; issue 12 asks 70%): the expand sweep alone (session 18's timed out before gate/up and down), then the
# layer (each token its own adapter) with the default tiles (128, 2) and candidates.
set -o pipefail
mkdir -p $OUT/c4
trap 'tar czf $OUT/c4.tgz -C $OUT c4 && rm -rf $OUT/c4' EXIT
pip install -q --no-deps --no-build-isolation --target /tmp/ml . >/dev/null 2>&1
export PYTHONPATH=/tmp/ml PYTHONUNBUFFERED=1
md5sum kernels/triton_sgmv.py bench/*.py > $OUT/c4/trees.txt
timeout 90 python3 bench/tune_lora_kernels.py --decode-expand --rank 64 --tokens 64 --out $OUT/c4/sweep > $OUT/c4/sweep.log 2>&1
echo "rc=$? at $SECONDS s" >> $OUT/c4/sweep.log
for t in default 256,4 256,2 128,4 64,2 512,4; do
  [ $SECONDS -gt 165 ] && break
  f=""; [ $t != default ] && f="--expand-rank-tiles $t"
  timeout 30 python3 bench/bench_lora_overlap.py --cases all --tokens 8,64 --no-sweep --schedules serial,side_all $f \
    --out $OUT/c4/overlap_${t/,/x} > $OUT/c4/overlap_${t/,/x}.log 2>&1; echo "rc=$? at $SECONDS s" >> $OUT/c4/overlap_${t/,/x}.log
done
