#!/usr/bin/env bash
# session 26, call 1: layer A/B of the fp8 GEMMs with the padded activation buffers (shipped table vs session 24's);
# the decode-attention sweep (tiles, warps, stages, splits per batch); then the whole GPU suite on this tree.
set -o pipefail
mkdir -p $OUT/c1
trap 'tar czf $OUT/c1.tgz -C $OUT c1 && rm -rf $OUT/c1' EXIT
pip install -q --no-deps --no-build-isolation --target /tmp/ml . >/dev/null 2>&1
export PYTHONPATH=/tmp/ml PYTHONUNBUFFERED=1 R=$PWD
cp .device/s26call1.sh $OUT/c1/script.sh
git log --oneline -1 > $OUT/c1/tree.txt 2>/dev/null; git status --short >> $OUT/c1/tree.txt 2>/dev/null
timeout 60 python3 bench/sweep_fp8_gemv.py --layer-only .device/fp8_table_s24.json --layer-ms 1,2,8,16,24,32,40,48,56,64 \
  --rep 10 --out $OUT/c1/layer > $OUT/c1/layer.log 2>&1
echo "rc=$? at $SECONDS s" >> $OUT/c1/layer.log
timeout 170 python3 bench/sweep_attention.py --rows 1:576:592,1:576:2048,1:2048:2048,64:576:592,32:576:592,8:576:592 \
  --block-n 32,64,128 --warps 2,4,8 --stages 2,3,4 --splits 1,2,4,8,16,32 --out $OUT/c1/attn > $OUT/c1/attn.log 2>&1
echo "rc=$? at $SECONDS s" >> $OUT/c1/attn.log
bash scripts/gpu_suite.sh $OUT/c1 $((580 - SECONDS)) > $OUT/c1/suite.out 2>&1
echo "suite rc=$? at $SECONDS s" >> $OUT/c1/suite.out
true
