#!/usr/bin/env bash
# session 30, call 4 (the session's last ~240 s): the prefill expand that writes the LoRA term (overwrite=True, what the
# engine runs from LORA_BEFORE_GEMM_MIN_TOKENS) swept at 4,096 tokens on 8 adapters (call 3's profile: 48 us per expand,
# half of its write bandwidth); then the two GPU tests of that path against peft (call 3's -k matched none).
set -o pipefail
mkdir -p $OUT/c4
trap 'tar czf $OUT/c4.tgz -C $OUT c4 && rm -rf $OUT/c4' EXIT
. scripts/device_env.sh
cp .device/s30call4.sh $OUT/c4/script.sh
git log --oneline -1 > $OUT/c4/tree.txt 2>/dev/null; git status --short >> $OUT/c4/tree.txt 2>/dev/null
mkdir -p $OUT/c4/tune
timeout 125 python3 bench/tune_lora_kernels.py --prefill --out $OUT/c4/tune > $OUT/c4/tune.log 2>&1
echo "rc=$? at $SECONDS s" >> $OUT/c4/tune.log
(cd /tmp && timeout $(( 225 - SECONDS )) python3 -m pytest -m gpu -q -p no:cacheprovider -rfEs "$R/tests/test_engine_gpu.py" \
  -k "before" > $OUT/c4/tests.log 2>&1; echo "rc=$? at $SECONDS s" >> $OUT/c4/tests.log)
true
