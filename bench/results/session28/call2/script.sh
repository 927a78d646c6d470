#!/usr/bin/env bash
# session 28, call 2: where a mixed step's time goes (call 1: S1's N = 5 mixed steps spend 7.7 ms of host time in
# runner.run). profile_decode's mixed steps (40 decode rows + one 256-token prompt, rank 8 on q/k/v/o) with the rows
# on 5 adapters, on 40, and on 40 with a pool miss each step; then S1 at N = 2000 (call 1 ran out of time in its
# adapter registration) at call 1's rate, with the step phases.
set -o pipefail
mkdir -p $OUT/c2
trap 'tar czf $OUT/c2.tgz -C $OUT c2 && rm -rf $OUT/c2' EXIT
. scripts/device_env.sh
cp .device/s28call2.sh $OUT/c2/script.sh
git log --oneline -1 > $OUT/c2/tree.txt 2>/dev/null; git status --short >> $OUT/c2/tree.txt 2>/dev/null
P="--batch 40 --lora --rank 8 --targets qkvo --mixed-tokens 256 --steps 20 --top 25"
for v in "d5:--distinct 5" "d40:--distinct 40" "d40miss:--distinct 40 --mixed-miss"; do
  n=${v%%:*}; a=${v#*:}
  timeout 110 python3 bench/profile_decode.py $P $a --json $OUT/c2/prof_$n.json > $OUT/c2/prof_$n.log 2>&1
  echo "rc=$? at $SECONDS s" >> $OUT/c2/prof_$n.log
done
timeout $((590 - SECONDS)) python3 bench/bench_serving.py --shape llama3-8b --adapters 2000 --adapter-files 64 \
  --modes engine --requests 256 --rate 21.13 --no-burst-rows --engine-warmup --warmup-requests 0 --out $OUT/c2/s1 \
  > $OUT/c2/s1.log 2>&1
echo "s1 rc=$? at $SECONDS s" >> $OUT/c2/s1.log; rm -f $OUT/c2/s1/*.png
true
