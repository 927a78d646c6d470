#!/usr/bin/env bash
# session 20, call 4: the PDL rule (plain launches in the wide-rank regime past one token): the PDL tests, then the
# layer at 1/8/64 tokens with the rule and without PDL; the engine GPU tests in what is left (limit 170 s in all).
set -o pipefail
mkdir -p $OUT/c4
trap 'tar czf $OUT/c4.tgz -C $OUT c4 && rm -rf $OUT/c4' EXIT
R=$PWD
pip install -q --no-deps --no-build-isolation --target /tmp/ml . >/dev/null 2>&1
export PYTHONPATH=/tmp/ml PYTHONUNBUFFERED=1
md5sum kernels/triton_sgmv.py bench/*.py > $OUT/c4/trees.txt 2>&1
T=$R/tests
(cd /tmp && timeout 60 python3 -m pytest -m gpu -q -p no:cacheprovider -rfEs $T/test_kernels.py -k "pdl" > $OUT/c4/test_pdl.log 2>&1; echo "rc=$? at $SECONDS s" >> $OUT/c4/test_pdl.log)
ov() {  # name, flags...
  local n=$1; shift
  timeout 40 python3 bench/bench_lora_overlap.py --cases all --tokens 1,8,64 --no-sweep --schedules serial,side_all \
    --out $OUT/c4/overlap_$n "$@" > $OUT/c4/overlap_$n.log 2>&1; echo "rc=$? at $SECONDS s" >> $OUT/c4/overlap_$n.log
}
ov rule
ov nopdl --no-pdl
L=$(( 170 - SECONDS ))
[ $L -gt 20 ] && (cd /tmp && timeout $L python3 -m pytest -m gpu -q -p no:cacheprovider -rfEs $T/test_engine_gpu.py \
   > $OUT/c4/gpu_tests.log 2>&1; echo "rc=$? at $SECONDS s" >> $OUT/c4/gpu_tests.log)
