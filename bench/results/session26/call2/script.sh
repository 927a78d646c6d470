#!/usr/bin/env bash
# session 26, call 2: the fp8 activation-kernel GPU test again (its launch count fixed); the decode-attention sweep
# (tiles, warps, stages, splits per batch); the engine at batch 1/32/64 with the 64-row fp8 buffers and without.
set -o pipefail
mkdir -p $OUT/c2
trap 'tar czf $OUT/c2.tgz -C $OUT c2 && rm -rf $OUT/c2' EXIT
pip install -q --no-deps --no-build-isolation --target /tmp/ml . >/dev/null 2>&1
export PYTHONPATH=/tmp/ml PYTHONUNBUFFERED=1 R=$PWD
cp .device/s26call2.sh $OUT/c2/script.sh
git log --oneline -1 > $OUT/c2/tree.txt 2>/dev/null; git status --short >> $OUT/c2/tree.txt 2>/dev/null
(cd /tmp && timeout 90 python3 -m pytest -m gpu -q -p no:cacheprovider -rfEs $R/tests/test_fp8_gpu.py -k "activation_kernels" \
  > $OUT/c2/test.log 2>&1; echo "rc=$? at $SECONDS s" >> $OUT/c2/test.log)
timeout 220 python3 bench/sweep_attention.py --rows 1:576:592,1:576:2048,1:2048:2048,64:576:592,32:576:592,8:576:592 \
  --block-n 32,64,128 --warps 2,4,8 --stages 2,3,4 --splits 1,2,4,8,16,32 --out $OUT/c2/attn > $OUT/c2/attn.log 2>&1
echo "rc=$? at $SECONDS s" >> $OUT/c2/attn.log
timeout $((575 - SECONDS)) python3 bench/bench_generate.py --providers multilora,multilora-fp8,multilora-fp8-nopad --rounds 3 \
  --batches 1,32,64 --gen 64 --time-budget $((540 - SECONDS)) --out $OUT/c2/gen > $OUT/c2/gen.log 2>&1
echo "rc=$? at $SECONDS s" >> $OUT/c2/gen.log; rm -f $OUT/c2/gen/*.png
true
