#!/usr/bin/env bash
# Session 37, call 4: the pipelined host finish by default (image.PIPELINE_PIECE_BYTES 4 MiB) for reads from the
# disk only (image.PIPELINE_COLD_ONLY: a file whose first bytes are in the page cache is finished serially, as
# before). (1) bench_adapter_load.py --cold at 1 and 2 readers: the pipe row must still pipeline cold reads
# (reads_pipelined) and keep call 2's gain; (2) the one-batch bench at 2,048 adapters (files in the page cache),
# default against --pipe-piece-bytes 0, alternated: call 2's loss with every read pipelined must be gone; (3) S4 at
# N = 5 and 2,000 with each engine read's files dropped from the page cache after it (--drop-after-read): issue 13
# item 4's disk -> host aggregate GB/s against the plain cold read measured beside it (session 32: 55%).
#   run: command="END=560 bash bench/results/session37/next_call4.sh", timeout_s=590; results in $OUT/c4.tgz
set -o pipefail
END=${END:-560}
mkdir -p $OUT/c4
trap 'tar czf $OUT/c4.tgz -C $OUT c4 && rm -rf $OUT/c4' EXIT
. scripts/device_env.sh
cp "$0" $OUT/c4/script.sh
git log --oneline -1 > $OUT/c4/tree.txt 2>/dev/null; git status --short >> $OUT/c4/tree.txt 2>/dev/null
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >> $OUT/c4/tree.txt 2>&1
mkdir -p /tmp/adapters
(cd bench && timeout 300 python3 -c "
import torch; from pathlib import Path; from _common import write_adapters
from multilora.config import ModelConfig; from multilora.runtime.weights import MODEL_SHAPES
write_adapters(Path('/tmp/adapters'), ModelConfig(**MODEL_SHAPES['llama3-8b']), 64, 16, torch.bfloat16, threads=4)
" > $OUT/c4/write.log 2>&1; echo "write rc=$? at $SECONDS s" >> $OUT/c4/write.log) &
timeout 90 python3 bench/bench_adapter_load.py --cold --modules q_proj,k_proj,v_proj,o_proj --rank 32 --adapters 12 \
  --providers plain,ours_host_finish_serial,ours_host_finish_pipe --threads 1,2 --runs 3 --no-cache-row \
  --adapter-dir /tmp/bal --out $OUT/c4/load > $OUT/c4/load.log 2>&1
echo "rc=$? at $SECONDS s" >> $OUT/c4/load.log
wait; sync
ob() {  # name, flags...
  local n=$1; shift
  [ $SECONDS -gt $(( END - 40 )) ] && { echo "skipped $n at $SECONDS s" >> $OUT/c4/skipped.txt; return; }
  timeout $(( END - SECONDS )) python3 bench/bench_adapter_throughput.py --shape llama3-8b --distinct-files 64 \
    --counts 2048 --popularity zipf --pool-adapters 0 --host-adapters 0 --adapter-dir /tmp/adapters --load-threads 2 \
    --sample-threads --out $OUT/c4/ob_$n "$@" > $OUT/c4/ob_$n.log 2>&1
  echo "rc=$? at $SECONDS s" >> $OUT/c4/ob_$n.log; rm -f $OUT/c4/ob_$n/*.png
}
ob def1
ob off1 --pipe-piece-bytes 0
mkdir -p /tmp/s4
timeout $(( END - SECONDS - 130 > 150 ? END - SECONDS - 130 : 150 )) python3 bench/bench_serving.py --shape llama3-8b \
  --adapter-set S4 --adapters 5,2000 --adapter-files 64 --adapter-dir /tmp/s4 --preload 300 --modes engine \
  --requests 512 --rate auto --no-burst-rows --engine-warmup --warmup-requests 0 --drop-after-read \
  --out $OUT/c4/s4 > $OUT/c4/s4.log 2>&1
echo "s4 rc=$? at $SECONDS s" >> $OUT/c4/s4.log; rm -f $OUT/c4/s4/*.png
ob off2 --pipe-piece-bytes 0
ob def2
ob def3
ob off3 --pipe-piece-bytes 0
true
