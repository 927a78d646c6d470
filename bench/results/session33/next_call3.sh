#!/usr/bin/env bash
# Next GPU session, call 3 (written in session 33, which had no device): Engine(adapter_pool_fill=True), the pool given
# the budget the KV cache can never use (~105 GiB instead of ~11 GiB at the defaults on an H200 with Llama-3-8B).
# (1) issue 13's one-batch bench over 2,048 adapters with the plan's default pool, default against --adapter-pool-fill,
# alternated (session 30's command; ~25 s a run); (2) S4 at 2,000 adapters with --adapter-pool-fill (compare with call
# 2's S4, the same trace and drops: tier moves, SLO, TTFT).
#   run: command="bash bench/results/session33/next_call3.sh", timeout_s=600; results in $OUT/c3.tgz
set -o pipefail
mkdir -p $OUT/c3
trap 'tar czf $OUT/c3.tgz -C $OUT c3 && rm -rf $OUT/c3' EXIT
. scripts/device_env.sh
cp "$0" $OUT/c3/script.sh
git log --oneline -1 > $OUT/c3/tree.txt 2>/dev/null; git status --short >> $OUT/c3/tree.txt 2>/dev/null
mkdir -p /tmp/adapters
(cd bench && timeout 200 python3 -c "
import torch; from pathlib import Path; from _common import write_adapters
from multilora.config import ModelConfig; from multilora.runtime.weights import MODEL_SHAPES
write_adapters(Path('/tmp/adapters'), ModelConfig(**MODEL_SHAPES['llama3-8b']), 64, 16, torch.bfloat16, threads=4)
" > $OUT/c3/write.log 2>&1; echo "write rc=$? at $SECONDS s" >> $OUT/c3/write.log)
sync
ob() {  # name, flags...
  local n=$1; shift
  [ $SECONDS -gt 330 ] && { echo "skipped $n at $SECONDS s" >> $OUT/c3/skipped.txt; return; }
  timeout 120 python3 bench/bench_adapter_throughput.py --shape llama3-8b --distinct-files 64 --counts 2048 \
    --popularity zipf --pool-adapters 0 --host-adapters 0 --adapter-dir /tmp/adapters --load-threads 2 --sample-threads \
    --out $OUT/c3/ob_$n "$@" > $OUT/c3/ob_$n.log 2>&1
  echo "rc=$? at $SECONDS s" >> $OUT/c3/ob_$n.log; rm -f $OUT/c3/ob_$n/*.png
}
ob def1
ob fill1 --adapter-pool-fill
ob fill2 --adapter-pool-fill
ob def2
mkdir -p /tmp/s4
timeout $(( 590 - SECONDS )) python3 bench/bench_serving.py --shape llama3-8b --adapter-set S4 --adapters 5,2000 \
  --adapter-files 64 --adapter-dir /tmp/s4 --preload 300 --modes engine --requests 512 --rate auto --no-burst-rows \
  --engine-warmup --warmup-requests 0 --drop-after-read --adapter-pool-fill --out $OUT/c3/s4fill > $OUT/c3/s4fill.log 2>&1
echo "s4 rc=$? at $SECONDS s" >> $OUT/c3/s4fill.log; rm -f $OUT/c3/s4fill/*.png
true
