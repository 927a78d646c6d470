#!/usr/bin/env bash
# Session 41, call 4: does faulting a host-arena chunk's pages in before cudaHostRegister (host_arena.PREFAULT, new,
# on by default) shorten the registration that held S4's steps up (call 2: 6 stalled steps of 126-187 ms, all
# registrations)? (1) bench_host_register.py: 1 GiB chunks, prefault off / on alternating, a thread issuing CUDA
# work beside; (2) S4 at 5 and 2,000 adapters with prefault on (--rate auto); (3) the same rows with prefault off at
# the rate (2) chose, if time is left.
#   run: command="END=450 bash bench/results/session41/next_call4.sh", timeout_s=480; results in $OUT/c4.tgz
set -o pipefail
END=${END:-450}
mkdir -p $OUT/c4
trap 'tar czf $OUT/c4.tgz -C $OUT c4 && rm -rf $OUT/c4' EXIT
. scripts/device_env.sh
cp "$0" $OUT/c4/script.sh
git log --oneline -1 > $OUT/c4/tree.txt 2>/dev/null; git status --short >> $OUT/c4/tree.txt 2>/dev/null
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >> $OUT/c4/tree.txt 2>&1
timeout 60 python3 bench/bench_host_register.py --rounds 3 --out $OUT/c4/hr > $OUT/c4/hr.log 2>&1
echo "rc=$? at $SECONDS s" >> $OUT/c4/hr.log
mkdir -p /tmp/s4
s4() {  # name, flags...
  local n=$1; shift
  timeout $(( END - SECONDS - 5 )) python3 bench/bench_serving.py --shape llama3-8b --adapter-set S4 \
    --adapter-files 64 --adapter-dir /tmp/s4 --preload 300 --modes engine --requests 512 --no-burst-rows \
    --engine-warmup --warmup-requests 0 --drop-after-read --out $OUT/c4/$n "$@" > $OUT/c4/$n.log 2>&1
  echo "rc=$? at $SECONDS s" >> $OUT/c4/$n.log; rm -f $OUT/c4/$n/*.png
}
s4 s4_on --adapters 5,2000 --rate auto --host-arena-prefault on
RATE=$(python3 -c "
import json; d=json.load(open('$OUT/c4/s4_on/serving_llama3-8b.json')); rows=d if isinstance(d, list) else d['rows']
print([r['rate'] for r in rows if r['rate'] != 'burst'][0])" 2>/dev/null)
if [ -n "$RATE" ] && [ $SECONDS -lt $(( END - 130 )) ]; then
  s4 s4_off --adapters 5,2000 --rate $RATE --host-arena-prefault off
else
  echo "skipped s4_off at $SECONDS s (rate '$RATE')" >> $OUT/c4/skipped.txt
fi
true
