#!/usr/bin/env bash
# the next session's first call (written in session 18, not run): copy to .device/ and run with carry [".device"].
# 1. engine tests touched by the new decode tiles (the session-18 subset hit a 60 s limit);
# 2. the layer with each token its own adapter (bench_lora_overlap's new default), session 17's tiles beside;
# 3. the engine A/B with --rounds 3 (medians): base, LoRA with this session's tiles, with session 17's, carve-out 0.
set -o pipefail
mkdir -p $OUT/c1
trap 'tar czf $OUT/c1.tgz -C $OUT c1 && rm -rf $OUT/c1' EXIT
R=$PWD
pip install -q --no-deps --no-build-isolation --target /tmp/ml . >/dev/null 2>&1
export PYTHONPATH=/tmp/ml PYTHONUNBUFFERED=1
md5sum kernels/triton_sgmv.py runtime/model.py bench/*.py > $OUT/c1/trees.txt
(cd /tmp && timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider -rfEs $R/tests/test_engine_gpu.py \
  -k "cuda_graph_decode_matches_eager or side_stream_lora_equals or matches_peft" > $OUT/c1/gpu_tests.log 2>&1;
 echo "rc=$? at $SECONDS s" >> $OUT/c1/gpu_tests.log)
ov() {  # name, flags...
  local n=$1; shift
  timeout 80 python3 bench/bench_lora_overlap.py --cases all --tokens 1,8,64,256 --no-sweep --schedules serial,side_all \
    --out $OUT/c1/overlap_$n "$@" > $OUT/c1/overlap_$n.log 2>&1; echo "rc=$? at $SECONDS s" >> $OUT/c1/overlap_$n.log
}
ov s18
ov s17 --shrink-warps 4 --old-rank-tiles
L=$(( 585 - SECONDS ))
timeout $L python3 bench/bench_generate.py --providers multilora,multilora-lora,multilora-lora-s17tiles,multilora-lora-carve \
  --carveout 0 --rounds 3 --batches 1,64 --gen 64 --adapter-files 8 --time-budget $(( L - 30 )) --out $OUT/c1/gen \
  > $OUT/c1/gen.log 2>&1
echo "rc=$? at $SECONDS s" >> $OUT/c1/gen.log; rm -f $OUT/c1/gen/*.png
