#!/usr/bin/env bash
# the next session's first call (written in session 18, not run): copy to .device/ and run with carry [".device"].
# 1. GPU tests touched by session 18: the rank-64 tiles and WIDE_SHRINK knob, the arena grown ahead (pinned),
#    engine graphs / side stream / peft;
# 2. the layer with each token its own adapter (bench_lora_overlap's new default) at 1, 8, 64, 256 tokens (r16, r64):
#    session 18's tiles, session 17's, and the wide regime's 32-way shrink split (--wide-shrink 32,64);
# 3. profile_decode at batch 64 with and without LoRA (where the batch-64 LoRA step's time goes).
set -o pipefail
mkdir -p $OUT/c1
trap 'tar czf $OUT/c1.tgz -C $OUT c1 && rm -rf $OUT/c1' EXIT
R=$PWD
pip install -q --no-deps --no-build-isolation --target /tmp/ml . >/dev/null 2>&1
export PYTHONPATH=/tmp/ml PYTHONUNBUFFERED=1
md5sum kernels/triton_sgmv.py runtime/model.py bench/*.py > $OUT/c1/trees.txt
(cd /tmp && timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider -rfEs $R/tests/test_kernels.py $R/tests/test_adapter_tiers.py -k "wide_rank_tiles or arena or grown" \
   > $OUT/c1/gpu_tests.log 2>&1; echo "rc=$? at $SECONDS s" >> $OUT/c1/gpu_tests.log
 timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider -rfEs $R/tests/test_engine_gpu.py \
  -k "cuda_graph_decode_matches_eager or side_stream_lora_equals or matches_peft" >> $OUT/c1/gpu_tests.log 2>&1;
 echo "rc=$? at $SECONDS s" >> $OUT/c1/gpu_tests.log)
ov() {  # name, flags...
  local n=$1; shift
  timeout 80 python3 bench/bench_lora_overlap.py --cases all --tokens 1,8,64,256 --no-sweep --schedules serial,side_all \
    --out $OUT/c1/overlap_$n "$@" > $OUT/c1/overlap_$n.log 2>&1; echo "rc=$? at $SECONDS s" >> $OUT/c1/overlap_$n.log
}
ov s18
ov s17 --shrink-warps 4 --old-rank-tiles
ov wshrink --wide-shrink 32,64
for l in "" "--lora"; do
  timeout $(( (585 - SECONDS) / 2 )) python3 bench/profile_decode.py --batch 64 $l --top 25 \
    --json $OUT/c1/profile_b64${l:+_lora}.json > $OUT/c1/profile_b64${l:+_lora}.log 2>&1
  echo "rc=$? at $SECONDS s" >> $OUT/c1/profile_b64${l:+_lora}.log
done
