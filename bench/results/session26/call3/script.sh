#!/usr/bin/env bash
# session 26, call 3: the new decode-attention launch (configs and splits) on the GPU: its GPU tests; the launcher's
# default against session 25's per batch; the engine A/B (bf16, bf16 + 64 adapters, fp8; session 25's attention as
# -s25attn) at batch 1 and 64; the fp8 decode profile at batch 64.
set -o pipefail
mkdir -p $OUT/c3
trap 'tar czf $OUT/c3.tgz -C $OUT c3 && rm -rf $OUT/c3' EXIT
pip install -q --no-deps --no-build-isolation --target /tmp/ml . >/dev/null 2>&1
export PYTHONPATH=/tmp/ml PYTHONUNBUFFERED=1 R=$PWD
cp .device/s26call3.sh $OUT/c3/script.sh
git log --oneline -1 > $OUT/c3/tree.txt 2>/dev/null; git status --short >> $OUT/c3/tree.txt 2>/dev/null
(cd /tmp && timeout 70 python3 -m pytest -m gpu -q -p no:cacheprovider -rfEs $R/tests/test_attention.py \
  > $OUT/c3/test.log 2>&1; echo "rc=$? at $SECONDS s" >> $OUT/c3/test.log)
timeout 50 python3 bench/sweep_attention.py --no-grid --rows 1:576:592,1:576:2048,1:2048:2048,2:576:592,4:576:592,8:576:592,16:576:592,32:576:592,64:576:592,64:2048:2048,128:576:592 \
  --out $OUT/c3/attn > $OUT/c3/attn.log 2>&1
echo "rc=$? at $SECONDS s" >> $OUT/c3/attn.log
timeout 215 python3 bench/bench_generate.py --providers multilora,multilora-s25attn,multilora-lora,multilora-lora-s25attn,multilora-fp8,multilora-fp8-s25attn \
  --rounds 3 --batches 1,64 --gen 64 --time-budget 190 --out $OUT/c3/gen > $OUT/c3/gen.log 2>&1
echo "rc=$? at $SECONDS s" >> $OUT/c3/gen.log; rm -f $OUT/c3/gen/*.png
[ $SECONDS -lt 280 ] && timeout $((340 - SECONDS)) python3 bench/profile_decode.py --weight-dtype fp8 --no-pdl --batch 64 --json $OUT/c3/prof_fp8_b64.json \
  > $OUT/c3/prof_fp8_b64.log 2>&1
echo "rc=$? at $SECONDS s" >> $OUT/c3/prof_fp8_b64.log
true
