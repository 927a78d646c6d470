#!/usr/bin/env bash
# session 22, call 3: the GPU suite on session 22's final tree (fp8 GEMV widened through float16 by default, the
# re-swept one-row tiles and the LM head's, fp8_lm_head, the host tier mapped ahead once adapters outgrow the pool),
# then the engine rows of issues 12 and 16 in one run: bf16, bf16 + 64 adapters, fp8, fp8 + fp8 LM head; 3 rounds.
set -o pipefail
mkdir -p $OUT/c3
trap 'tar czf $OUT/c3.tgz -C $OUT c3 && rm -rf $OUT/c3' EXIT
R=$PWD
pip install -q --no-deps --no-build-isolation --target /tmp/ml . >/dev/null 2>&1
export PYTHONPATH=/tmp/ml PYTHONUNBUFFERED=1
{ git log --oneline -1; git status --short; md5sum kernels/*.py runtime/*.py bench/bench_generate.py; } > $OUT/c3/tree.txt 2>&1
bash scripts/gpu_suite.sh $OUT/c3/gpu 330
echo "suite rc=$? at $SECONDS s" >> $OUT/c3/tree.txt
L=$(( 585 - SECONDS ))
timeout $L python3 bench/bench_generate.py --providers multilora,multilora-lora,multilora-fp8,multilora-fp8-lmhead \
  --rounds 3 --batches 1,64 --gen 64 --adapter-files 8 --time-budget $(( L - 30 )) --out $OUT/c3/gen > $OUT/c3/gen.log 2>&1
echo "rc=$? at $SECONDS s" >> $OUT/c3/gen.log; rm -f $OUT/c3/gen/*.png
