#!/usr/bin/env bash
# session 29, call 4: the new gate/up tile rule's GPU test (48-64 tokens); issue 12's and 16's engine rows
# (bench_generate: base, 64 adapters, fp8 at batch 1 and 64, 3 rounds); the one-batch bench over 2,048 adapters twice
# more on the default (batched) read path.
set -o pipefail
mkdir -p $OUT/c4
trap 'tar czf $OUT/c4.tgz -C $OUT c4 && rm -rf $OUT/c4' EXIT
. scripts/device_env.sh
cp .device/s29call4.sh $OUT/c4/script.sh
git log --oneline -1 > $OUT/c4/tree.txt 2>/dev/null; git status --short >> $OUT/c4/tree.txt 2>/dev/null
(cd /tmp && timeout 80 python3 -m pytest -m gpu -q -p no:cacheprovider -rfEs "$R/tests/test_kernels.py" \
  -k "rank_tiles_of_wide_outputs or wide_rank_tiles_and_knobs" > $OUT/c4/tests.log 2>&1; echo "rc=$? at $SECONDS s" >> $OUT/c4/tests.log)
timeout 200 python3 bench/bench_generate.py --providers multilora,multilora-lora,multilora-fp8 \
  --rounds 3 --batches 1,64 --gen 64 --time-budget 180 --out $OUT/c4/gen > $OUT/c4/gen.log 2>&1
echo "rc=$? at $SECONDS s" >> $OUT/c4/gen.log; rm -f $OUT/c4/gen/*.png
mkdir -p /tmp/adapters
(cd bench && timeout 60 python3 -c "
import torch; from pathlib import Path; from _common import write_adapters
from multilora.config import ModelConfig; from multilora.runtime.weights import MODEL_SHAPES
write_adapters(Path('/tmp/adapters'), ModelConfig(**MODEL_SHAPES['llama3-8b']), 64, 16, torch.bfloat16, threads=8)
" > $OUT/c4/write.log 2>&1; echo "write rc=$? at $SECONDS s" >> $OUT/c4/write.log); sync
ob() {  # name, flags...
  local n=$1; shift
  [ $SECONDS -gt 380 ] && { echo "skipped $n at $SECONDS s" >> $OUT/c4/skipped.txt; return; }
  timeout $(( 420 - SECONDS )) python3 bench/bench_adapter_throughput.py --shape llama3-8b --distinct-files 64 --counts 2048 \
    --popularity zipf --pool-adapters 0 --host-adapters 0 --adapter-dir /tmp/adapters --load-threads 2 --sample-threads \
    --out $OUT/c4/ob_$n "$@" > $OUT/c4/ob_$n.log 2>&1
  echo "rc=$? at $SECONDS s" >> $OUT/c4/ob_$n.log; rm -f $OUT/c4/ob_$n/*.png
}
ob batched3
ob batched4
true
