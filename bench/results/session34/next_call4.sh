#!/usr/bin/env bash
# Next GPU session, call 4 (written in session 34; ~200 s, if the session's budget allows after calls 1-3):
# bench_generate.py, issue 12's engine rows: the grid sized by a step's distinct slots (session 33's default) against
# the bound (-boundgrid), and the engine's prefill through the epilogue GEMM (-gemmfused:
# runtime.model.LORA_GEMM_EPILOGUE_MIN_TOKENS; worth running only if call 3's gemm_lora.md shows a fused config
# below the engine's path). Set gemm_lora.GPU_TILES to call 3's best config first if it is not the default.
#   run(command="bash bench/results/session34/next_call4.sh", timeout_s=300); results in $OUT/c4.tgz
set -o pipefail
mkdir -p $OUT/c4
trap 'tar czf $OUT/c4.tgz -C $OUT c4 && rm -rf $OUT/c4' EXIT
. scripts/device_env.sh
cp "$0" $OUT/c4/script.sh
git log --oneline -1 > $OUT/c4/tree.txt 2>/dev/null; git status --short >> $OUT/c4/tree.txt 2>/dev/null
timeout 230 python3 bench/bench_generate.py --providers multilora,multilora-lora,multilora-lora-boundgrid,multilora-lora-gemmfused \
  --rounds 3 --batches 1,64 --gen 64 --time-budget 220 --out $OUT/c4/gen > $OUT/c4/gen.log 2>&1
echo "rc=$? at $SECONDS s" >> $OUT/c4/gen.log; rm -f $OUT/c4/gen/*.png
true
