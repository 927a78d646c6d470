#!/usr/bin/env bash
# session 23, call 4: the GPU suite on the final tree (row max, fused fp8 quantization, the kernels-name hand-over,
# the PDL test helper), then decode-step profiles with plain launches (--no-pdl: kernel times that add up) for fp8 at
# batch 64 and 1, as time allows.
set -o pipefail
mkdir -p $OUT/c4
trap 'tar czf $OUT/c4.tgz -C $OUT c4 && rm -rf $OUT/c4' EXIT
R=$PWD
pip install -q --no-deps --no-build-isolation --target /tmp/ml . >/dev/null 2>&1
export PYTHONPATH=/tmp/ml PYTHONUNBUFFERED=1
{ git log --oneline -1; git status --short; } > $OUT/c4/tree.txt 2>&1
bash scripts/gpu_suite.sh $OUT/c4/gpu 360
echo "suite rc=$? at $SECONDS s" >> $OUT/c4/tree.txt
p() {  # name, flags
  local n=$1; shift
  [ $SECONDS -gt 470 ] && return
  timeout $(( 540 - SECONDS )) python3 bench/profile_decode.py --no-pdl --json $OUT/c4/$n.json "$@" > $OUT/c4/$n.log 2>&1
  echo "rc=$? at $SECONDS s" >> $OUT/c4/$n.log
}
timeout 90 python3 bench/bench_fused_quant.py --out $OUT/c4/fused_quant > $OUT/c4/fused_quant.log 2>&1
echo "rc=$? at $SECONDS s" >> $OUT/c4/fused_quant.log
p fp8_b64 --weight-dtype fp8 --batch 64
p fp8_b1 --weight-dtype fp8 --batch 1
true
