#!/usr/bin/env bash
# Session 38, call 5: the engine GPU tests under the new adapter_finish default (device on CUDA), in four shards at
# once: test_engine_gpu.py dealt in thirds, and the model-family files; each shard limited to LIMIT s.
#   run: command="LIMIT=200 bash bench/results/session38/call5.sh", timeout_s=260; results in $OUT/c5/
set -o pipefail
LIMIT=${LIMIT:-200}
mkdir -p $OUT/c5
. scripts/device_env.sh
git log --oneline -1 > $OUT/c5/tree.txt 2>/dev/null; git status --short >> $OUT/c5/tree.txt 2>/dev/null
nvidia-smi --query-gpu=name --format=csv >> $OUT/c5/tree.txt 2>&1
T=$PWD/tests
cd /tmp && python3 -m pytest -m gpu -q -p no:cacheprovider --collect-only $T/test_engine_gpu.py 2>/dev/null \
  | grep -E "::" | sed "s|^.*tests/|$T/|" > /tmp/ids.txt
for k in 0 1 2; do
  awk -v k=$k 'NR % 3 == k' /tmp/ids.txt > /tmp/ids_$k.txt
  (set -f; timeout -s INT -k 15 $LIMIT python3 -m pytest -m gpu -q -p no:cacheprovider -rfEs $(cat /tmp/ids_$k.txt) \
     > $OUT/c5/engine_$k.log 2>&1; echo "rc=$? at $SECONDS s" >> $OUT/c5/engine_$k.log) &
done
(timeout -s INT -k 15 $LIMIT python3 -m pytest -m gpu -q -p no:cacheprovider -rfEs $T/test_model_families_gpu.py \
   $T/test_suite_halves.py $T/test_model_phi3_gpu.py $T/test_model_gemma2_gpu.py > $OUT/c5/families.log 2>&1
 echo "rc=$? at $SECONDS s" >> $OUT/c5/families.log) &
wait
for f in $OUT/c5/*.log; do echo "== $f"; tail -6 $f; done
