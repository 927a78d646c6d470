#!/usr/bin/env bash
# session 31, call 4 (the session's last ~380 s): PREFILL_WRITE_LOOP = (4, 128, 2) (call 3's sweep): its GPU tests
# (bits of the tiles before, the fp32 reference), then issue 12's engine rows at batch 1 and 64 against one tile per
# program (multilora-lora-s30tiles).
set -o pipefail
mkdir -p $OUT/c4
trap 'tar czf $OUT/c4.tgz -C $OUT c4 && rm -rf $OUT/c4' EXIT
. scripts/device_env.sh
cp .device/s31call4.sh $OUT/c4/script.sh
git log --oneline -1 > $OUT/c4/tree.txt 2>/dev/null; git status --short >> $OUT/c4/tree.txt 2>/dev/null
(cd /tmp && timeout 90 python3 -m pytest -m gpu -q -p no:cacheprovider -rfEs "$R/tests/test_kernels.py" \
  -k "prefill_tiles or lora_delta_writes" > $OUT/c4/tests.log 2>&1; echo "rc=$? at $SECONDS s" >> $OUT/c4/tests.log)
timeout $(( 350 - SECONDS )) python3 bench/bench_generate.py --providers multilora,multilora-lora,multilora-lora-s30tiles \
  --rounds 5 --batches 1,64 --gen 64 --time-budget $(( 330 - SECONDS )) --out $OUT/c4/gen > $OUT/c4/gen.log 2>&1
echo "rc=$? at $SECONDS s" >> $OUT/c4/gen.log; rm -f $OUT/c4/gen/*.png
true
