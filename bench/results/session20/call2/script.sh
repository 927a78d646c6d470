#!/usr/bin/env bash
# session 20, call 2: programmatic dependent launch (PDL) of the shrink / expand kernels. The new GPU test (PDL vs
# plain launches, eager and graph, bit for bit) first; then the layer with and without PDL (each token its own
# adapter, 1/8/64/256 tokens, ranks 16 and 64), the engine A/B (base, LoRA with PDL, LoRA without; --rounds 3), and the
# engine's and kernels' GPU tests in what is left.
set -o pipefail
mkdir -p $OUT/c2
trap 'tar czf $OUT/c2.tgz -C $OUT c2 && rm -rf $OUT/c2' EXIT
R=$PWD
pip install -q --no-deps --no-build-isolation --target /tmp/ml . >/dev/null 2>&1
export PYTHONPATH=/tmp/ml PYTHONUNBUFFERED=1
{ md5sum kernels/triton_sgmv.py runtime/model.py bench/*.py; python3 -c "import triton, torch; print(triton.__version__, torch.__version__, torch.version.cuda)"; } > $OUT/c2/trees.txt 2>&1
T=$R/tests
(cd /tmp && timeout 120 python3 -m pytest -m gpu -q -p no:cacheprovider -rfEs $T/test_kernels.py -k "pdl" > $OUT/c2/test_pdl.log 2>&1; echo "rc=$? at $SECONDS s" >> $OUT/c2/test_pdl.log)
ov() {  # name, flags...
  local n=$1; shift
  timeout 90 python3 bench/bench_lora_overlap.py --cases all --tokens 1,8,64,256 --no-sweep --schedules serial,side_all \
    --out $OUT/c2/overlap_$n "$@" > $OUT/c2/overlap_$n.log 2>&1; echo "rc=$? at $SECONDS s" >> $OUT/c2/overlap_$n.log
}
ov pdl
ov nopdl --no-pdl
timeout 240 python3 bench/bench_generate.py --providers multilora,multilora-lora,multilora-lora-nopdl \
  --rounds 3 --batches 1,64 --gen 64 --adapter-files 8 --time-budget 220 --out $OUT/c2/gen > $OUT/c2/gen.log 2>&1
echo "rc=$? at $SECONDS s" >> $OUT/c2/gen.log; rm -f $OUT/c2/gen/*.png
L=$(( 575 - SECONDS ))
if [ $L -gt 30 ]; then
  (cd /tmp && timeout $L python3 -m pytest -m gpu -q -p no:cacheprovider -rfEs $T/test_engine_gpu.py $T/test_kernels.py \
     > $OUT/c2/gpu_tests.log 2>&1; echo "rc=$? at $SECONDS s" >> $OUT/c2/gpu_tests.log)
fi
