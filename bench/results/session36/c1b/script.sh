#!/usr/bin/env bash
# Session 36, call 1b: the device budget fell to ~600 s (nine failed machine starts and one machine taken back), too
# little for the whole GPU suite (~470 s of shards + start). This runs the GPU tests of what sessions 33-35 changed
# on the GPU paths, each shard under LIMIT seconds (SIGINT at the limit: pytest names the test it was in and reports
# those done): test_kernels.py (session 33's grid sized by a step's distinct slots, the default decode path) dealt
# to two shards, test_engine_gpu.py (engine vs peft, TP, the step) dealt to two, and test_engine_unified.py +
# test_engine_loop.py + test_gemm_lora.py (session 35's unified setup and loop; session 34's epilogue GEMM) in one.
#   run: command="LIMIT=330 bash bench/results/session36/next_call1b.sh", timeout_s=LIMIT+60; results $OUT/c1b.tgz
set -o pipefail
LIMIT=${LIMIT:-330}
mkdir -p $OUT/c1b
trap 'tar czf $OUT/c1b.tgz -C $OUT c1b && rm -rf $OUT/c1b' EXIT
. scripts/device_env.sh
cp "$0" $OUT/c1b/script.sh
git log --oneline -1 > $OUT/c1b/tree.txt 2>/dev/null; git status --short >> $OUT/c1b/tree.txt 2>/dev/null
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >> $OUT/c1b/tree.txt 2>&1
T=$PWD/tests
ids() { (cd /tmp && python3 -m pytest -m gpu -q -p no:cacheprovider --collect-only "$T/$1" 2>/dev/null) \
        | grep -E "^[^ ]*tests/test_[^ ]*\.py::[^ ]+$" | sed "s|^.*tests/|$T/|"; }
ids test_kernels.py > /tmp/k.txt; ids test_engine_gpu.py > /tmp/g.txt
awk 'NR%2==1' /tmp/k.txt > /tmp/k1.txt; awk 'NR%2==0' /tmp/k.txt > /tmp/k2.txt
awk 'NR%2==1' /tmp/g.txt > /tmp/g1.txt; awk 'NR%2==0' /tmp/g.txt > /tmp/g2.txt
echo "$T/test_engine_unified.py $T/test_engine_loop.py $T/test_gemm_lora.py" | tr ' ' '\n' > /tmp/u.txt
wc -l /tmp/k1.txt /tmp/k2.txt /tmp/g1.txt /tmp/g2.txt >> $OUT/c1b/tree.txt
for n in k1 k2 g1 g2 u; do
  (set -f; cd /tmp && timeout -s INT -k 15 $LIMIT python3 -m pytest -m gpu -q -p no:cacheprovider -rfEs \
     --durations=0 --durations-min=1.0 $(cat /tmp/$n.txt) > $OUT/c1b/$n.log 2>&1
   echo "shard $n rc=$? at $SECONDS s" >> $OUT/c1b/$n.log) &
done
wait
grep -hE "^shard |passed|failed|error" $OUT/c1b/*.log > $OUT/c1b/summary.txt
true
