#!/usr/bin/env bash
# Next GPU session, call 3 (written in session 33, which had no device).
# (1) Engine(adapter_pool_fill=True): the pool given the budget the KV cache can never use. S4's N = 2,000 row (pool
#     share 0.3 in bench_serving: ~33 GB, ~520 of S4's 2,000 adapters; with fill ~100 GB) with and without it,
#     alternated, at one fixed offered rate: RATE from call 2's S4 (its rows[0].offered_rps; session 32: 18.49), e.g.
#     run(command="RATE=18.3 bash bench/results/session33/next_call3.sh"). (The one-batch bench cannot show fill: its
#     ~41 distinct adapters per batch never filled the default pool, gpu_evictions 0 in every run since session 29.)
# (2) first: the LoRA grid sized by a step's distinct slots (triton_sgmv.GRID_BY_SEGMENTS, new default) against the
#     bound (provider multilora-lora-boundgrid), and the shrink's split from that grid (multilora-lora-gridsplit, off):
#     issue 12's TTFT row and decode rows, 5 interleaved rounds.
#   results in $OUT/c3.tgz
set -o pipefail
mkdir -p $OUT/c3
trap 'tar czf $OUT/c3.tgz -C $OUT c3 && rm -rf $OUT/c3' EXIT
. scripts/device_env.sh
cp "$0" $OUT/c3/script.sh
git log --oneline -1 > $OUT/c3/tree.txt 2>/dev/null; git status --short >> $OUT/c3/tree.txt 2>/dev/null
RATE=${RATE:-18.49}
echo "rate $RATE" >> $OUT/c3/tree.txt
timeout 170 python3 bench/bench_generate.py --providers multilora,multilora-lora,multilora-lora-boundgrid,multilora-lora-gridsplit \
  --rounds 5 --batches 1,64 --gen 64 --time-budget 160 --out $OUT/c3/gen > $OUT/c3/gen.log 2>&1
echo "rc=$? at $SECONDS s" >> $OUT/c3/gen.log; rm -f $OUT/c3/gen/*.png
mkdir -p /tmp/s4
s4() {  # name, flags...
  local n=$1; shift
  [ $SECONDS -gt 380 ] && { echo "skipped $n at $SECONDS s" >> $OUT/c3/skipped.txt; return; }
  timeout $(( 590 - SECONDS )) python3 bench/bench_serving.py --shape llama3-8b --adapter-set S4 --adapters 2000 \
    --adapter-files 64 --adapter-dir /tmp/s4 --preload 300 --modes engine --requests 512 --rate $RATE --no-burst-rows \
    --engine-warmup --warmup-requests 0 --drop-after-read --out $OUT/c3/s4_$n "$@" > $OUT/c3/s4_$n.log 2>&1
  echo "rc=$? at $SECONDS s" >> $OUT/c3/s4_$n.log; rm -f $OUT/c3/s4_$n/*.png
}
s4 fill1 --adapter-pool-fill
s4 def1
s4 fill2 --adapter-pool-fill
s4 def2
true
