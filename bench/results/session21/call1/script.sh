#!/usr/bin/env bash
# session 21, call 1: the GPU suite on session 21's tree (PDL for the step's Triton kernels: triton_pdl; new GPU tests
# against plain launches; HostArena.map_ahead's GPU test never run), then the engine A/B of PDL for the step's kernels
# in bf16 and fp8 (providers -plain: every Triton kernel launched plainly), decode only, 3 rounds.
set -o pipefail
mkdir -p $OUT/c1
trap 'tar czf $OUT/c1.tgz -C $OUT c1 && rm -rf $OUT/c1' EXIT
R=$PWD
pip install -q --no-deps --no-build-isolation --target /tmp/ml . >/dev/null 2>&1
export PYTHONPATH=/tmp/ml PYTHONUNBUFFERED=1
{ git log --oneline -1; md5sum kernels/*.py bench/bench_generate.py; nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv; } > $OUT/c1/tree.txt 2>&1
bash scripts/gpu_suite.sh $OUT/c1/gpu 300
echo "suite rc=$? at $SECONDS s" >> $OUT/c1/tree.txt
L=$(( 585 - SECONDS ))
timeout $L python3 bench/bench_generate.py --providers multilora,multilora-plain,multilora-fp8,multilora-fp8-plain \
  --rounds 3 --batches 1,64 --gen 64 --time-budget $(( L - 30 )) --out $OUT/c1/gen > $OUT/c1/gen.log 2>&1
echo "rc=$? at $SECONDS s" >> $OUT/c1/gen.log; rm -f $OUT/c1/gen/*.png
