#!/usr/bin/env bash
# session 29, call 3: issue 12's r64 64/64 layer row with gate/up's 64-token tiles against without, now with the copy
# bandwidth and the share of it in the same run; gate/up's rank-64 expand at 48-256 tokens on four tiles (does the
# 64-token rule hold beside 64?); issue 13's S1 rows N = 5, 100, 1,000, 2,000 on one trace at session 28's fixed rate
# (20.84 req/s, 512 requests); then where a step still synchronizes the host (profile_decode --sync-audit).
set -o pipefail
mkdir -p $OUT/c3
trap 'tar czf $OUT/c3.tgz -C $OUT c3 && rm -rf $OUT/c3' EXIT
. scripts/device_env.sh
cp .device/s29call3.sh $OUT/c3/script.sh
git log --oneline -1 > $OUT/c3/tree.txt 2>/dev/null; git status --short >> $OUT/c3/tree.txt 2>/dev/null
lay() {  # name, flags...
  local n=$1; shift
  timeout 60 python3 bench/bench_lora_overlap.py --cases all --tokens 64 --no-sweep --schedules serial,side_write \
    --out $OUT/c3/lay_$n "$@" > $OUT/c3/lay_$n.log 2>&1
  echo "rc=$? at $SECONDS s" >> $OUT/c3/lay_$n.log
}
lay new
lay old --expand-wide-out none
timeout 50 python3 bench/tune_lora_kernels.py --decode-expand --rank 64 --tokens 48,96,128,256 --groups 8b-gate_up \
  --expand-configs 128:2:2,256:4:2,256:2:2,128:4:2 --out $OUT/c3/sweep > $OUT/c3/sweep.log 2>&1
echo "rc=$? at $SECONDS s" >> $OUT/c3/sweep.log
timeout 370 python3 bench/bench_serving.py --shape llama3-8b --adapters 5,100,1000,2000 --adapter-files 64 \
  --modes engine --requests 512 --rate 20.84 --no-burst-rows --engine-warmup --warmup-requests 0 --out $OUT/c3/s1 \
  > $OUT/c3/s1.log 2>&1
echo "s1 rc=$? at $SECONDS s" >> $OUT/c3/s1.log; rm -f $OUT/c3/s1/*.png
[ $SECONDS -lt 530 ] && { timeout $(( 590 - SECONDS )) python3 bench/profile_decode.py --batch 8 --lora --mixed-tokens 64 \
  --mixed-miss --targets qkvo --rank 8 --sync-audit --json $OUT/c3/audit_miss.json > $OUT/c3/audit_miss.log 2>&1;
  echo "rc=$? at $SECONDS s" >> $OUT/c3/audit_miss.log; }
true
