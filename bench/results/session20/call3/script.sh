#!/usr/bin/env bash
# session 20, call 3: PDL's trigger. Call 2 found PDL 2-6 us faster on most layer cases but rank 64 at 8 tokens
# (serial) 87 -> 113 us. Here: the PDL test with both triggers; the layer at 1/8/64 tokens with PDL (next kernel let
# launch right after each program's wait), PDL with the trigger at exit, and no PDL, twice each interleaved; then the
# engine A/B with --rounds 5 (this host's batch-64 rounds spread 7.6-9.3 ms in call 2).
set -o pipefail
mkdir -p $OUT/c3
trap 'tar czf $OUT/c3.tgz -C $OUT c3 && rm -rf $OUT/c3' EXIT
R=$PWD
pip install -q --no-deps --no-build-isolation --target /tmp/ml . >/dev/null 2>&1
export PYTHONPATH=/tmp/ml PYTHONUNBUFFERED=1
md5sum kernels/triton_sgmv.py runtime/model.py bench/*.py > $OUT/c3/trees.txt 2>&1
T=$R/tests
(cd /tmp && timeout 120 python3 -m pytest -m gpu -q -p no:cacheprovider -rfEs $T/test_kernels.py -k "pdl" > $OUT/c3/test_pdl.log 2>&1; echo "rc=$? at $SECONDS s" >> $OUT/c3/test_pdl.log)
ov() {  # name, flags...
  local n=$1; shift
  timeout 60 python3 bench/bench_lora_overlap.py --cases all --tokens 1,8,64 --no-sweep --schedules serial,side_all \
    --out $OUT/c3/overlap_$n "$@" > $OUT/c3/overlap_$n.log 2>&1; echo "rc=$? at $SECONDS s" >> $OUT/c3/overlap_$n.log
}
for i in 1 2; do
  ov pdl$i
  ov late$i --pdl-late-trigger
  ov nopdl$i --no-pdl
done
L=$(( 570 - SECONDS ))
timeout $L python3 bench/bench_generate.py --providers multilora,multilora-lora,multilora-lora-nopdl \
  --rounds 5 --batches 1,64 --gen 64 --adapter-files 8 --time-budget $(( L - 40 )) --out $OUT/c3/gen > $OUT/c3/gen.log 2>&1
echo "rc=$? at $SECONDS s" >> $OUT/c3/gen.log; rm -f $OUT/c3/gen/*.png
# issue 13's one-batch row, host vs device finish, interleaved after a first run that writes the files (untimed here)
mkdir -p /tmp/adapters
ob() {  # name, flags...
  local n=$1; shift
  [ $SECONDS -gt 540 ] && return
  timeout $(( 585 - SECONDS )) python3 bench/bench_adapter_throughput.py --shape llama3-8b --distinct-files 64 --counts 2048 \
    --popularity zipf --pool-adapters 0 --host-adapters 0 --adapter-dir /tmp/adapters --load-threads 2 --sample-threads \
    --out $OUT/c3/ob_$n "$@" > $OUT/c3/ob_$n.log 2>&1
  echo "rc=$? at $SECONDS s" >> $OUT/c3/ob_$n.log; rm -f $OUT/c3/ob_$n/*.png
}
ob prime; sync
ob host_a; ob device_a --adapter-finish device; ob device_b --adapter-finish device; ob host_b
