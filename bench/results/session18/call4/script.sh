#!/usr/bin/env bash
# session 18, call 4 (main + bench_generate provider multilora-lora-s17tiles): the engine A/B of this session's decode
# tiles against session 17's, twice in opposite orders (the first LoRA variant after warm-up has run slower), with
# the carve-out 0 row beside; then the layer at r16 256 tokens / 256 adapters.
set -o pipefail
mkdir -p $OUT/c4
trap 'tar czf $OUT/c4.tgz -C $OUT c4 && rm -rf $OUT/c4' EXIT
pip install -q --no-deps --no-build-isolation --target /tmp/ml . >/dev/null 2>&1
export PYTHONPATH=/tmp/ml PYTHONUNBUFFERED=1
md5sum kernels/triton_sgmv.py bench/bench_generate.py > $OUT/c4/trees.txt
g() {  # name, providers
  timeout 100 python3 bench/bench_generate.py --providers $2 --carveout 0 --batches 1,64 --gen 64 --adapter-files 8 \
    --time-budget 80 --out $OUT/c4/gen_$1 > $OUT/c4/gen_$1.log 2>&1; echo "rc=$? at $SECONDS s" >> $OUT/c4/gen_$1.log
  rm -f $OUT/c4/gen_$1/*.png
}
g a multilora,multilora-lora,multilora-lora-s17tiles,multilora-lora-carve
g b multilora,multilora-lora-carve,multilora-lora-s17tiles,multilora-lora
timeout $(( 235 - SECONDS )) python3 bench/bench_lora_overlap.py --cases r16 --tokens 256 --no-sweep --schedules serial,side_all \
  --out $OUT/c4/overlap > $OUT/c4/overlap.log 2>&1; echo "rc=$? at $SECONDS s" >> $OUT/c4/overlap.log
