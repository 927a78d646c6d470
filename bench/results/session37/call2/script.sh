#!/usr/bin/env bash
# Session 37, call 2: the pipelined host finish (new this session: image.PIPELINE_PIECE_BYTES, off by default) A/B'd
# where it should show. (1) bench_adapter_load.py --cold, issue 13 item 4's disk -> host reads against a plain cold
# read of the same S4-like files at 1, 2 and 4 readers: ours_host_finish_pipe (4 MiB pieces) against
# ours_host_finish_serial (today's default) and the raw read (ours). (2) The one-batch bench at 2,048 adapters (issue
# 13's 50% goal; the session-30 command), default against --pipe-piece-bytes 4194304, alternated: in session 30 its
# I/O threads spent ~2/3 of their busy samples in the host finish (transposes and finite checks), 1/3 in the reads.
#   run: command="END=585 bash bench/results/session37/next_call2.sh", timeout_s=600; results in $OUT/c2.tgz
set -o pipefail
END=${END:-585}
mkdir -p $OUT/c2
trap 'tar czf $OUT/c2.tgz -C $OUT c2 && rm -rf $OUT/c2' EXIT
. scripts/device_env.sh
cp "$0" $OUT/c2/script.sh
git log --oneline -1 > $OUT/c2/tree.txt 2>/dev/null; git status --short >> $OUT/c2/tree.txt 2>/dev/null
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >> $OUT/c2/tree.txt 2>&1
(nproc; df -h /tmp; lsblk -o NAME,MODEL,SIZE,ROTA,TYPE,MOUNTPOINT; mount | grep -E " / | /tmp ") > $OUT/c2/disk.txt 2>&1
mkdir -p /tmp/adapters
(cd bench && timeout 300 python3 -c "
import torch; from pathlib import Path; from _common import write_adapters
from multilora.config import ModelConfig; from multilora.runtime.weights import MODEL_SHAPES
write_adapters(Path('/tmp/adapters'), ModelConfig(**MODEL_SHAPES['llama3-8b']), 64, 16, torch.bfloat16, threads=4)
" > $OUT/c2/write.log 2>&1; echo "write rc=$? at $SECONDS s" >> $OUT/c2/write.log) &
timeout $(( END < 460 ? END / 3 : 200 )) python3 bench/bench_adapter_load.py --cold \
  --modules q_proj,k_proj,v_proj,o_proj --rank 32 --adapters 12 \
  --providers plain,ours,ours_host_finish_serial,ours_host_finish_pipe --threads 1,2,4 --runs 3 \
  --no-cache-row --adapter-dir /tmp/bal --out $OUT/c2/load > $OUT/c2/load.log 2>&1
echo "rc=$? at $SECONDS s (END $END)" >> $OUT/c2/load.log
wait; sync
ob() {  # name, flags...
  local n=$1; shift
  [ $SECONDS -gt $(( END - 35 )) ] && { echo "skipped $n at $SECONDS s" >> $OUT/c2/skipped.txt; return; }
  timeout $(( END - SECONDS )) python3 bench/bench_adapter_throughput.py --shape llama3-8b --distinct-files 64 \
    --counts 2048 --popularity zipf --pool-adapters 0 --host-adapters 0 --adapter-dir /tmp/adapters --load-threads 2 \
    --sample-threads --out $OUT/c2/ob_$n "$@" > $OUT/c2/ob_$n.log 2>&1
  echo "rc=$? at $SECONDS s" >> $OUT/c2/ob_$n.log; rm -f $OUT/c2/ob_$n/*.png
}
ob pipe1 --pipe-piece-bytes 4194304
ob def1
ob pipe2 --pipe-piece-bytes 4194304
ob def2
ob pipe3 --pipe-piece-bytes 4194304
ob def3
ob pipe4 --pipe-piece-bytes 4194304
ob def4
true
