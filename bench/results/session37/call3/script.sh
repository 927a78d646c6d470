#!/usr/bin/env bash
# Session 37, call 3: bench_gemm_lora.py --rounds 3, issue 12's prefill row (4,096 tokens on 64 rank-16 adapters, the
# layer's seven projections: cuBLAS, the engine's path, the epilogue-fused GEMM; session 36 ran one round: the engine
# +9.9%), then cold_read_patterns.py if time is left (the disk's own answer to queue depth).
#   run: command="END=585 bash bench/results/session37/next_call3.sh", timeout_s=600; results in $OUT/c3.tgz
set -o pipefail
END=${END:-585}
mkdir -p $OUT/c3
trap 'tar czf $OUT/c3.tgz -C $OUT c3 && rm -rf $OUT/c3' EXIT
. scripts/device_env.sh
cp "$0" $OUT/c3/script.sh
git log --oneline -1 > $OUT/c3/tree.txt 2>/dev/null; git status --short >> $OUT/c3/tree.txt 2>/dev/null
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >> $OUT/c3/tree.txt 2>&1
timeout $(( END - 20 < 300 ? END - 20 : 300 )) python3 bench/bench_gemm_lora.py --out $OUT/c3/gemm --rounds 3 \
  > $OUT/c3/gemm.log 2>&1
echo "rc=$? at $SECONDS s" >> $OUT/c3/gemm.log
if [ $SECONDS -lt $(( END - 120 )) ]; then
  timeout $(( END - SECONDS )) python3 bench/cold_read_patterns.py --adapter-dir /tmp/bal --rounds 5 \
    --out $OUT/c3/patterns > $OUT/c3/patterns.log 2>&1; echo "rc=$? at $SECONDS s" >> $OUT/c3/patterns.log
fi
rm -f $OUT/c3/*/*.png
true
