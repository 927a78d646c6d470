#!/usr/bin/env bash
# Session 38, call 4: adapter_finish=None (device on CUDA) as the new default. (1) the GPU tests of the adapter tiers,
# the pool, the unified pool, the engine loop and the image finish, which reload adapters from disk and so now take
# the raw read + device finish by default; (2) S4 with the disk in play at 5 and 2,000 adapters (the same command as
# call 2, whose rows used the host finish pipelined under cold reads); (3) the fused gate/up expand at narrower tiles
# (call 3: time grows with the tile width); (4) the one-batch bench, default against --adapter-finish host, if time.
#   run: command="END=585 bash bench/results/session38/call4.sh", timeout_s=600; results in $OUT/c4.tgz
set -o pipefail
END=${END:-585}
mkdir -p $OUT/c4
trap 'tar czf $OUT/c4.tgz -C $OUT c4 && rm -rf $OUT/c4' EXIT
. scripts/device_env.sh
cp "$0" $OUT/c4/script.sh
git log --oneline -1 > $OUT/c4/tree.txt 2>/dev/null; git status --short >> $OUT/c4/tree.txt 2>/dev/null
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >> $OUT/c4/tree.txt 2>&1
cd tests && timeout 170 python3 -m pytest -q -m gpu -p no:cacheprovider test_adapter_tiers.py test_adapter_memory.py \
  test_engine_unified.py test_image_finish.py test_engine_loop.py test_engine_diagnostics.py > $OUT/c4/gpu_tests.log 2>&1
echo "rc=$? at $SECONDS s" >> $OUT/c4/gpu_tests.log; cd ..
mkdir -p /tmp/s4 /tmp/adapters
timeout $(( END - SECONDS - 20 > 260 ? 260 : END - SECONDS - 20 )) python3 bench/bench_serving.py --shape llama3-8b \
  --adapter-set S4 --adapter-files 64 --adapter-dir /tmp/s4 --preload 300 --modes engine --requests 512 --no-burst-rows \
  --engine-warmup --warmup-requests 0 --drop-after-read --out $OUT/c4/s4 --adapters 5,2000 --rate auto \
  > $OUT/c4/s4.log 2>&1
echo "rc=$? at $SECONDS s" >> $OUT/c4/s4.log; rm -f $OUT/c4/s4/*.png
timeout 60 python3 bench/bench_expand_glu.py --out $OUT/c4/eg --rounds 3 \
  --fused-configs 64:2:4,64:1:4,32:4:4,32:2:4,32:1:4,64:2:8,32:4:2,64:1:2 > $OUT/c4/eg.log 2>&1
echo "rc=$? at $SECONDS s" >> $OUT/c4/eg.log
(cd bench && timeout 90 python3 -c "
import torch; from pathlib import Path; from _common import write_adapters
from multilora.config import ModelConfig; from multilora.runtime.weights import MODEL_SHAPES
write_adapters(Path('/tmp/adapters'), ModelConfig(**MODEL_SHAPES['llama3-8b']), 64, 16, torch.bfloat16, threads=4)
" > $OUT/c4/write.log 2>&1; echo "write rc=$? at $SECONDS s" >> $OUT/c4/write.log)
ob() {  # name, flags...
  local n=$1; shift
  [ $SECONDS -gt $(( END - 60 )) ] && { echo "skipped $n at $SECONDS s" >> $OUT/c4/skipped.txt; return; }
  timeout $(( END - SECONDS )) python3 bench/bench_adapter_throughput.py --shape llama3-8b --distinct-files 64 \
    --counts 2048 --popularity zipf --pool-adapters 0 --host-adapters 0 --adapter-dir /tmp/adapters --load-threads 2 \
    --out $OUT/c4/ob_$n "$@" > $OUT/c4/ob_$n.log 2>&1
  echo "rc=$? at $SECONDS s" >> $OUT/c4/ob_$n.log; rm -f $OUT/c4/ob_$n/*.png
}
ob def1
ob host1 --adapter-finish host
ob def2
ob host2 --adapter-finish host
true
