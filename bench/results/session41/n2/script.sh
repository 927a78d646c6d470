#!/usr/bin/env bash
# Written in session 40 for the next GPU session (ask for kind nvidia-h200 first: issues 12 and 13 record their goals on
# the H200; sessions 38-40 had only H100s). On the tree with 1 GiB host-arena chunks by default again (session 40's
# A/B: bench/results/session40/README.md): (1) the one-batch bench at 2,048 adapters with the default (device finish,
# 1 GiB chunks) twice, for issue 13's "at least 50% warm" (session 40 had 46% with 256 MiB chunks; session 39 50-51%
# with 1 GiB); (2) S4 with the disk in play at 5 and 2,000 adapters, --rate auto (goal: N = 2,000 at least 85% of
# N = 5's throughput).
#   run: command="END=585 bash bench/results/session40/next_call2.sh", timeout_s=600; results in $OUT/n2.tgz
set -o pipefail
END=${END:-585}
mkdir -p $OUT/n2
trap 'tar czf $OUT/n2.tgz -C $OUT n2 && rm -rf $OUT/n2' EXIT
. scripts/device_env.sh
cp "$0" $OUT/n2/script.sh
git log --oneline -1 > $OUT/n2/tree.txt 2>/dev/null; git status --short >> $OUT/n2/tree.txt 2>/dev/null
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >> $OUT/n2/tree.txt 2>&1
mkdir -p /tmp/s4 /tmp/adapters
(cd bench && timeout 90 python3 -c "
import torch; from pathlib import Path; from _common import write_adapters
from multilora.config import ModelConfig; from multilora.runtime.weights import MODEL_SHAPES
write_adapters(Path('/tmp/adapters'), ModelConfig(**MODEL_SHAPES['llama3-8b']), 64, 16, torch.bfloat16, threads=4)
" > $OUT/n2/write.log 2>&1; echo "write rc=$? at $SECONDS s" >> $OUT/n2/write.log)
ob() {  # name, flags...
  local n=$1; shift
  [ $SECONDS -gt $(( END - 60 )) ] && { echo "skipped $n at $SECONDS s" >> $OUT/n2/skipped.txt; return; }
  timeout $(( END - SECONDS )) python3 bench/bench_adapter_throughput.py --shape llama3-8b --distinct-files 64 \
    --counts 2048 --popularity zipf --pool-adapters 0 --host-adapters 0 --adapter-dir /tmp/adapters --load-threads 2 \
    --out $OUT/n2/ob_$n "$@" > $OUT/n2/ob_$n.log 2>&1
  echo "rc=$? at $SECONDS s" >> $OUT/n2/ob_$n.log; rm -f $OUT/n2/ob_$n/*.png
}
ob def1
ob def2
s4() {  # name, flags...
  local n=$1; shift
  timeout $(( END - SECONDS - 10 )) python3 bench/bench_serving.py --shape llama3-8b --adapter-set S4 \
    --adapter-files 64 --adapter-dir /tmp/s4 --preload 300 --modes engine --requests 512 --no-burst-rows \
    --engine-warmup --warmup-requests 0 --drop-after-read --out $OUT/n2/$n "$@" > $OUT/n2/$n.log 2>&1
  echo "rc=$? at $SECONDS s" >> $OUT/n2/$n.log; rm -f $OUT/n2/$n/*.png
}
if [ $SECONDS -lt $(( END - 200 )) ]; then
  s4 s4 --adapters 5,2000 --rate auto
else
  echo "skipped s4 at $SECONDS s" >> $OUT/n2/skipped.txt
fi
# (3) S1 at 5 and 2,000 adapters if time is left (issue 13's S1 goals, last met on the H200 in session 30)
if [ $SECONDS -lt $(( END - 170 )) ]; then
  timeout $(( END - SECONDS - 10 )) python3 bench/bench_serving.py --shape llama3-8b --adapters 5,2000 --adapter-files 64 \
    --modes engine --requests 512 --rate auto --no-burst-rows --engine-warmup --warmup-requests 0 --out $OUT/n2/s1 \
    > $OUT/n2/s1.log 2>&1
  echo "rc=$? at $SECONDS s" >> $OUT/n2/s1.log; rm -f $OUT/n2/s1/*.png
else
  echo "skipped s1 at $SECONDS s" >> $OUT/n2/skipped.txt
fi
true
