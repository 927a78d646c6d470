#!/usr/bin/env bash
# session 23, call 1: the two-pass greedy row max (runtime.sampling.row_max, new) on the GPU; the engine rows of issue
# 16 (bf16, fp8, fp8 one-pass max = before, fp8 + fp8 LM head) at batch 1 and 64, 3 rounds; profiles of the batch-64
# decode step in fp8 and bf16 (where fp8's time goes at 64 rows); issue 13's one-batch row with the new default
# (host tier mapped ahead once adapters outgrow the pool) against --host-map-ahead 0, interleaved after a priming run.
set -o pipefail
mkdir -p $OUT/c1
trap 'tar czf $OUT/c1.tgz -C $OUT c1 && rm -rf $OUT/c1' EXIT
R=$PWD
pip install -q --no-deps --no-build-isolation --target /tmp/ml . >/dev/null 2>&1
export PYTHONPATH=/tmp/ml PYTHONUNBUFFERED=1
{ git log --oneline -1; git status --short; md5sum kernels/*.py runtime/*.py bench/bench_generate.py; nvidia-smi -q | grep -i -m3 "clocks\|product name"; } > $OUT/c1/tree.txt 2>&1
(cd /tmp && timeout 60 python3 -m pytest -m gpu -q -p no:cacheprovider -rfEs $R/tests/test_sampling.py \
  > $OUT/c1/test_sampling.log 2>&1; echo "rc=$? at $SECONDS s" >> $OUT/c1/test_sampling.log)
timeout 170 python3 bench/bench_generate.py --providers multilora,multilora-fp8,multilora-fp8-onepassmax,multilora-fp8-lmhead \
  --rounds 3 --batches 1,64 --gen 64 --time-budget 150 --out $OUT/c1/gen > $OUT/c1/gen.log 2>&1
echo "rc=$? at $SECONDS s" >> $OUT/c1/gen.log; rm -f $OUT/c1/gen/*.png
for w in fp8 bf16; do
  timeout 90 python3 bench/profile_decode.py --weight-dtype $w --batch 64 --json $OUT/c1/prof_${w}_b64.json \
    > $OUT/c1/prof_${w}_b64.log 2>&1; echo "rc=$? at $SECONDS s" >> $OUT/c1/prof_${w}_b64.log
done
mkdir -p /tmp/adapters
ob() {  # name, flags...
  local n=$1; shift
  [ $SECONDS -gt 500 ] && return
  timeout $(( 560 - SECONDS )) python3 bench/bench_adapter_throughput.py --shape llama3-8b --distinct-files 64 --counts 2048 \
    --popularity zipf --pool-adapters 0 --host-adapters 0 --adapter-dir /tmp/adapters --load-threads 2 --sample-threads \
    --out $OUT/c1/ob_$n "$@" > $OUT/c1/ob_$n.log 2>&1
  echo "rc=$? at $SECONDS s" >> $OUT/c1/ob_$n.log; rm -f $OUT/c1/ob_$n/*.png
}
ob prime; sync
ob default_a; ob off_a --host-map-ahead 0; ob off_b --host-map-ahead 0; ob default_b
true
