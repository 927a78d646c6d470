#!/usr/bin/env bash
# session 30, call 1: the whole GPU suite on main (the scheduler's urgent-read wait, the 16 Mi finite-check chunks and
# the gpu -> host copy-back budget fix never ran on the H200); then the one-batch bench over 2,048 adapters: default
# against --urgent-read-wait off and against --check-chunk 1048576 (session 29's 1 Mi chunks), alternated.
set -o pipefail
mkdir -p $OUT/c1
trap 'tar czf $OUT/c1.tgz -C $OUT c1 && rm -rf $OUT/c1' EXIT
. scripts/device_env.sh
cp .device/s30call1.sh $OUT/c1/script.sh
git log --oneline -1 > $OUT/c1/tree.txt 2>/dev/null; git status --short >> $OUT/c1/tree.txt 2>/dev/null
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >> $OUT/c1/tree.txt 2>&1
mkdir -p /tmp/adapters
(cd bench && timeout 300 python3 -c "
import torch; from pathlib import Path; from _common import write_adapters
from multilora.config import ModelConfig; from multilora.runtime.weights import MODEL_SHAPES
write_adapters(Path('/tmp/adapters'), ModelConfig(**MODEL_SHAPES['llama3-8b']), 64, 16, torch.bfloat16, threads=4)
" > $OUT/c1/write.log 2>&1; echo "write rc=$? at $SECONDS s" >> $OUT/c1/write.log) &
bash scripts/gpu_suite.sh $OUT/c1/suite 420 > $OUT/c1/suite.out 2>&1
echo "suite rc=$? at $SECONDS s" >> $OUT/c1/suite.out
ob() {  # name, flags...
  local n=$1; shift
  [ $SECONDS -gt 565 ] && { echo "skipped $n at $SECONDS s" >> $OUT/c1/skipped.txt; return; }
  timeout $(( 592 - SECONDS )) python3 bench/bench_adapter_throughput.py --shape llama3-8b --distinct-files 64 --counts 2048 \
    --popularity zipf --pool-adapters 0 --host-adapters 0 --adapter-dir /tmp/adapters --load-threads 2 --sample-threads \
    --out $OUT/c1/ob_$n "$@" > $OUT/c1/ob_$n.log 2>&1
  echo "rc=$? at $SECONDS s" >> $OUT/c1/ob_$n.log; rm -f $OUT/c1/ob_$n/*.png
}
wait; sync
ob def1
ob nowait1 --urgent-read-wait off
ob chunk1 --check-chunk 1048576
ob def2
ob nowait2 --urgent-read-wait off
ob chunk2 --check-chunk 1048576
true
