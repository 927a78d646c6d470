#!/usr/bin/env bash
# session 18, call 3 (main + rank > 16 decode tiles: DECODE_EXPAND_RANK_TILES = (128, 2), 2-warp shrink outside
# the wide regime): GPU kernel tests; layer A/B (session 17 tiles vs now) r16 / r64 at 1, 8, 64 tokens;
# engine batch 1 / 64: multilora, multilora-lora, multilora-lt, multilora-lora-lt
set -o pipefail
mkdir -p $OUT/c3
trap 'tar czf $OUT/c3.tgz -C $OUT c3 && rm -rf $OUT/c3' EXIT
R=$PWD
pip install -q --no-deps --no-build-isolation --target /tmp/ml . >/dev/null 2>&1
export PYTHONPATH=/tmp/ml PYTHONUNBUFFERED=1
{ git log --oneline -1 2>/dev/null; git status --short; md5sum kernels/triton_sgmv.py runtime/model.py; } > $OUT/c3/trees.txt 2>&1
(cd /tmp && timeout 120 python3 -m pytest -m gpu -q -p no:cacheprovider -rfEs $R/tests/test_kernels.py > $OUT/c3/gpu_tests.log 2>&1;
 echo "rc=$? at $SECONDS s" >> $OUT/c3/gpu_tests.log
 timeout 60 python3 -m pytest -m gpu -q -p no:cacheprovider -rfEs $R/tests/test_engine_gpu.py -k "cuda_graph_decode_matches_eager or side_stream_lora_equals" >> $OUT/c3/gpu_tests.log 2>&1;
 echo "rc=$? at $SECONDS s" >> $OUT/c3/gpu_tests.log)
ov() {  # name, flags...
  local n=$1; shift
  timeout 60 python3 bench/bench_lora_overlap.py --cases all --tokens 1,8,64 --no-sweep --schedules serial,side_all \
    --out $OUT/c3/overlap_$n "$@" > $OUT/c3/overlap_$n.log 2>&1; echo "rc=$? at $SECONDS s" >> $OUT/c3/overlap_$n.log
}
ov s17 --shrink-warps 4 --old-rank-tiles
ov s18
L=$(( 560 - SECONDS ))
timeout $L python3 bench/bench_generate.py --providers multilora,multilora-lora,multilora-lt,multilora-lora-lt \
  --batches 1,64 --gen 64 --adapter-files 8 --time-budget $(( L - 30 )) --out $OUT/c3/gen > $OUT/c3/gen.log 2>&1
echo "rc=$? at $SECONDS s" >> $OUT/c3/gen.log; rm -f $OUT/c3/gen/*.png
