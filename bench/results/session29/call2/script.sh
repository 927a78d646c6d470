#!/usr/bin/env bash
# session 29, call 2: issue 12's r64 64/64 layer row with gate/up's expand on 256-wide 4-warp tiles
# (DECODE_EXPAND_RANK_WIDE_OUT, new) against every width on (128, 2) (--expand-wide-out none), alternated, twice; the
# gate/up rank-64 expand sweep at 32-256 tokens (the rule's range); issue 13's S4 at N = 5 and 2,000 on one trace.
set -o pipefail
mkdir -p $OUT/c2
trap 'tar czf $OUT/c2.tgz -C $OUT c2 && rm -rf $OUT/c2' EXIT
. scripts/device_env.sh
cp .device/s29call2.sh $OUT/c2/script.sh
git log --oneline -1 > $OUT/c2/tree.txt 2>/dev/null; git status --short >> $OUT/c2/tree.txt 2>/dev/null
lay() {  # name, flags...
  local n=$1; shift
  timeout 75 python3 bench/bench_lora_overlap.py --cases all --tokens 64 --no-sweep --schedules serial,side_all,side_write \
    --out $OUT/c2/lay_$n "$@" > $OUT/c2/lay_$n.log 2>&1
  echo "rc=$? at $SECONDS s" >> $OUT/c2/lay_$n.log
}
lay new1
lay old1 --expand-wide-out none
lay old2 --expand-wide-out none
lay new2
timeout 90 python3 bench/tune_lora_kernels.py --decode-expand --rank 64 --tokens 32,64,128,256 --groups 8b-gate_up \
  --out $OUT/c2/sweep > $OUT/c2/sweep.log 2>&1
echo "rc=$? at $SECONDS s" >> $OUT/c2/sweep.log
mkdir -p /tmp/s4
timeout $(( 590 - SECONDS )) python3 bench/bench_serving.py --shape llama3-8b --adapter-set S4 --adapters 5,2000 \
  --adapter-files 64 --adapter-dir /tmp/s4 --preload 300 --modes engine --requests 512 --rate auto --no-burst-rows \
  --engine-warmup --warmup-requests 0 --out $OUT/c2/s4 > $OUT/c2/s4.log 2>&1
echo "s4 rc=$? at $SECONDS s" >> $OUT/c2/s4.log; rm -f $OUT/c2/s4/*.png
true
