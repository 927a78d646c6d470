#!/usr/bin/env bash
# Next GPU session, call 3 (written in session 34, which had no device; replaces session 33's next_call3.sh).
# (1) bench_gemm_lora.py: issue 12's prefill row with the LoRA expand in the base GEMM's epilogue
#     (kernels.experimental.gemm_lora, new, never run on a GPU) against cuBLAS and the engine's path, six tile
#     configs, 3 interleaved rounds (~2-3 min; gemm_lora.json rewritten after each group). Decides whether the
#     prefill goal (LoRA <= 8% of the layer) is in reach.
# (2) S4's N = 2,000 row with and without Engine(adapter_pool_fill=True), alternated at one fixed offered rate: RATE
#     from call 2's S4 (its rows[0].offered_rps; session 32: 18.49), e.g.
#     run(command="RATE=18.3 bash bench/results/session34/next_call3.sh"); one pair, not started past 300 s.
#   results in $OUT/c3.tgz. The engine A/B of (1) and of session 33's grid change: next_call4.sh.
set -o pipefail
mkdir -p $OUT/c3
trap 'tar czf $OUT/c3.tgz -C $OUT c3 && rm -rf $OUT/c3' EXIT
. scripts/device_env.sh
cp "$0" $OUT/c3/script.sh
git log --oneline -1 > $OUT/c3/tree.txt 2>/dev/null; git status --short >> $OUT/c3/tree.txt 2>/dev/null
RATE=${RATE:-18.49}
echo "rate $RATE" >> $OUT/c3/tree.txt
timeout 240 python3 bench/bench_gemm_lora.py --out $OUT/c3/gemm --rounds 3 > $OUT/c3/gemm.log 2>&1
echo "rc=$? at $SECONDS s" >> $OUT/c3/gemm.log
mkdir -p /tmp/s4
s4() {  # name, flags...
  local n=$1; shift
  timeout $(( 590 - SECONDS )) python3 bench/bench_serving.py --shape llama3-8b --adapter-set S4 --adapters 2000 \
    --adapter-files 64 --adapter-dir /tmp/s4 --preload 300 --modes engine --requests 512 --rate $RATE --no-burst-rows \
    --engine-warmup --warmup-requests 0 --drop-after-read --out $OUT/c3/s4_$n "$@" > $OUT/c3/s4_$n.log 2>&1
  echo "rc=$? at $SECONDS s" >> $OUT/c3/s4_$n.log; rm -f $OUT/c3/s4_$n/*.png
}
if [ $SECONDS -gt 300 ]; then  # a pair or none: one row alone compares with nothing
  echo "S4 pair skipped at $SECONDS s" >> $OUT/c3/skipped.txt
else
  s4 fill1 --adapter-pool-fill
  s4 def1
fi
true
