#!/usr/bin/env bash
# the next session's second call (written in session 18, not run): the engine A/B with --rounds 3 (medians, every
# other round reversed): base, LoRA with session 18's tiles, with session 17's, with carve-out 0.
set -o pipefail
mkdir -p $OUT/c2
trap 'tar czf $OUT/c2.tgz -C $OUT c2 && rm -rf $OUT/c2' EXIT
pip install -q --no-deps --no-build-isolation --target /tmp/ml . >/dev/null 2>&1
export PYTHONPATH=/tmp/ml PYTHONUNBUFFERED=1
md5sum kernels/triton_sgmv.py runtime/model.py bench/*.py > $OUT/c2/trees.txt
L=$(( 585 - SECONDS ))
timeout $L python3 bench/bench_generate.py --providers multilora,multilora-lora,multilora-lora-s17tiles,multilora-lora-carve \
  --carveout 0 --rounds 3 --batches 1,64 --gen 64 --adapter-files 8 --time-budget $(( L - 30 )) --out $OUT/c2/gen \
  > $OUT/c2/gen.log 2>&1
echo "rc=$? at $SECONDS s" >> $OUT/c2/gen.log; rm -f $OUT/c2/gen/*.png
