#!/usr/bin/env bash
# session 22, call 2: GEMV_WIDEN_F16 is now the default (call 1: every one-row fp8 GEMV faster, engine b1 3.57 -> 3.26
# ms). Re-sweep the one-row tiles with it (chosen under the old bound), the LM head's shape too (new fp8_lm_head);
# the engine at batch 1 with the new table (bf16, fp8, fp8 + fp8 LM head, interleaved rounds); issue 13's
# --host-map-ahead A/B, interleaved after an untimed priming run that writes the adapter files.
set -o pipefail
mkdir -p $OUT/c2
trap 'tar czf $OUT/c2.tgz -C $OUT c2 && rm -rf $OUT/c2' EXIT
R=$PWD
pip install -q --no-deps --no-build-isolation --target /tmp/ml . >/dev/null 2>&1
export PYTHONPATH=/tmp/ml PYTHONUNBUFFERED=1
{ git log --oneline -1; git status --short; md5sum kernels/*.py bench/*.py runtime/model.py; } > $OUT/c2/tree.txt 2>&1
(cd /tmp && timeout 60 python3 -m pytest -m gpu -q -p no:cacheprovider -rfEs -s $R/tests/test_fp8_gpu.py -k "lm_head" \
  > $OUT/c2/test_lm_head.log 2>&1; echo "rc=$? at $SECONDS s" >> $OUT/c2/test_lm_head.log)
timeout 240 python3 bench/sweep_fp8_gemv.py --paths row --lm-head 128256 --out $OUT/c2/sweep > $OUT/c2/sweep.log 2>&1
echo "rc=$? at $SECONDS s" >> $OUT/c2/sweep.log
TUNED=$OUT/c2/sweep/fp8_gemv_tuned.json
[ -f $TUNED ] || TUNED=
MULTILORA_FP8_TUNED=$TUNED timeout 150 python3 bench/bench_generate.py --providers multilora,multilora-fp8,multilora-fp8-lmhead \
  --rounds 3 --batches 1 --gen 64 --time-budget 130 --out $OUT/c2/gen > $OUT/c2/gen.log 2>&1
echo "rc=$? at $SECONDS s tuned=$TUNED" >> $OUT/c2/gen.log; rm -f $OUT/c2/gen/*.png
mkdir -p /tmp/adapters
ob() {  # name, flags...
  local n=$1; shift
  [ $SECONDS -gt 540 ] && return
  timeout $(( 585 - SECONDS )) python3 bench/bench_adapter_throughput.py --shape llama3-8b --distinct-files 64 --counts 2048 \
    --popularity zipf --pool-adapters 0 --host-adapters 0 --adapter-dir /tmp/adapters --load-threads 2 --sample-threads \
    --out $OUT/c2/ob_$n "$@" > $OUT/c2/ob_$n.log 2>&1
  echo "rc=$? at $SECONDS s" >> $OUT/c2/ob_$n.log; rm -f $OUT/c2/ob_$n/*.png
}
ob prime; sync
ob map_a --host-map-ahead 8; ob plain_a; ob plain_b; ob map_b --host-map-ahead 8
[ $SECONDS -lt 520 ] && timeout $(( 585 - SECONDS )) python3 bench/profile_decode.py --weight-dtype fp8 --batch 1 \
  --json $OUT/c2/prof_fp8_b1.json > $OUT/c2/prof_fp8_b1.log 2>&1
true
