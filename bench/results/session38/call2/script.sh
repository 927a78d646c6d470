#!/usr/bin/env bash
# Written in session 37 for the next GPU session: (1) S4 with the disk in play, the pipelined finish's engine A/B:
# N = 5 and 2,000 with the default (cold reads pipelined), then N = 2,000 at the same offered rate with
# --pipe-piece-bytes 0 (rows record reads_pipelined / reads_cached_serial and disk_to_host_aggregate_gbps against
# the plain cold read beside them); (2) if time is left, the one-batch bench at 2,048 adapters with
# --adapter-finish device against the default, alternated (session 13's A/B, before everything since: the device
# finish reads 2.2x faster from the page cache) and with --parallel-finish on (image.PARALLEL_FINISH, written in
# session 37 after its calls: the finish after the read spread over the finish threads), after a page-cache A/B of
# the same in bench_adapter_load.py (row ours_host_finish_parallel).
#   run: command="END=585 bash bench/results/session37/next_call5.sh", timeout_s=600; results in $OUT/c5.tgz
set -o pipefail
END=${END:-585}
mkdir -p $OUT/c5
trap 'tar czf $OUT/c5.tgz -C $OUT c5 && rm -rf $OUT/c5' EXIT
. scripts/device_env.sh
cp "$0" $OUT/c5/script.sh
git log --oneline -1 > $OUT/c5/tree.txt 2>/dev/null; git status --short >> $OUT/c5/tree.txt 2>/dev/null
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >> $OUT/c5/tree.txt 2>&1
mkdir -p /tmp/s4 /tmp/adapters
s4() {  # name, flags...
  local n=$1; shift
  timeout $(( END - SECONDS - 20 )) python3 bench/bench_serving.py --shape llama3-8b --adapter-set S4 \
    --adapter-files 64 --adapter-dir /tmp/s4 --preload 300 --modes engine --requests 512 --no-burst-rows \
    --engine-warmup --warmup-requests 0 --drop-after-read --out $OUT/c5/$n "$@" > $OUT/c5/$n.log 2>&1
  echo "rc=$? at $SECONDS s" >> $OUT/c5/$n.log; rm -f $OUT/c5/$n/*.png
}
s4 s4 --adapters 5,2000 --rate auto
RATE=$(python3 -c "import json; print(json.load(open('$OUT/c5/s4/serving_llama3-8b.json'))['rows'][0]['offered_rps'])" 2>/dev/null)
if [ -n "$RATE" ] && [ $SECONDS -lt $(( END - 150 )) ]; then
  s4 s4serial --adapters 2000 --rate $RATE --pipe-piece-bytes 0
fi
(cd bench && timeout 120 python3 -c "
import torch; from pathlib import Path; from _common import write_adapters
from multilora.config import ModelConfig; from multilora.runtime.weights import MODEL_SHAPES
write_adapters(Path('/tmp/adapters'), ModelConfig(**MODEL_SHAPES['llama3-8b']), 64, 16, torch.bfloat16, threads=4)
" > $OUT/c5/write.log 2>&1; echo "write rc=$? at $SECONDS s" >> $OUT/c5/write.log)
ob() {  # name, flags...
  local n=$1; shift
  [ $SECONDS -gt $(( END - 40 )) ] && { echo "skipped $n at $SECONDS s" >> $OUT/c5/skipped.txt; return; }
  timeout $(( END - SECONDS )) python3 bench/bench_adapter_throughput.py --shape llama3-8b --distinct-files 64 \
    --counts 2048 --popularity zipf --pool-adapters 0 --host-adapters 0 --adapter-dir /tmp/adapters --load-threads 2 \
    --sample-threads --out $OUT/c5/ob_$n "$@" > $OUT/c5/ob_$n.log 2>&1
  echo "rc=$? at $SECONDS s" >> $OUT/c5/ob_$n.log; rm -f $OUT/c5/ob_$n/*.png
}
timeout 60 python3 bench/bench_adapter_load.py --modules q_proj,k_proj,v_proj,o_proj --rank 32 --adapters 12 \
  --providers plain,ours,ours_host_finish_serial,ours_host_finish_parallel --threads 1,2,4 --runs 3 --no-cache-row \
  --adapter-dir /tmp/bal --out $OUT/c5/load > $OUT/c5/load.log 2>&1; echo "rc=$? at $SECONDS s" >> $OUT/c5/load.log
ob par1 --parallel-finish on
ob def1
ob dev1 --adapter-finish device
ob dev2 --adapter-finish device
ob def2
ob par2 --parallel-finish on
true
