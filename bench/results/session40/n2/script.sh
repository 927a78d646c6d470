#!/usr/bin/env bash
# Written in session 39 for the next GPU session (ask for kind nvidia-h200 first: issues 12 and 13 record their goals on
# the H200; sessions 38 and 39 had only H100s). On the tree with 256 MiB host-arena chunks by default (1ffe4e3) and
# bench_serving freeing each N's engine before the next (4fb29d8: until then S4's N = 2,000 row got 344 pool slots,
# not 1,231, because the N = 5 engine was still alive): (1) the one-batch bench at 2,048 adapters, default (device)
# against --adapter-finish host, alternated, one each; (2) S4 with the disk in play at 5 and 2,000 adapters (every row
# now on the same pool; rows record gpu_bytes_allocated_before_engine); (3) S4 at 2,000 again at the same rate with
# 1 GiB chunks (the default before), the chunk A/B without session 39's pool confound.
#   run: command="END=585 bash bench/results/session39/next_call2.sh", timeout_s=600; results in $OUT/n2.tgz
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
ob host1 --adapter-finish host
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
RATE=$(python3 -c "import json,sys; r=[x for x in json.load(open('$OUT/n2/s4/serving_llama3-8b.json'))['rows'] if x['rate'] != 'burst']; print(r[0]['offered_rps'])" 2>/dev/null)
if [ -n "$RATE" ] && [ $SECONDS -lt $(( END - 90 )) ]; then
  s4 s4gib --adapters 2000 --rate $RATE --host-arena-chunk-bytes 1073741824
else
  echo "skipped s4gib at $SECONDS s (rate '$RATE')" >> $OUT/n2/skipped.txt
fi
true
