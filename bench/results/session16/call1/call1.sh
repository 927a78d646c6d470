#!/usr/bin/env bash
# session 16, call 1 (tree sent: main + the looped decode expand, uncommitted):
# 1. GPU tests: the looped expand and both tile kinds (test_kernels), the shared capture stream (test_engine_gpu),
#    adapter memory; 2. the decode-expand sweep (tune_lora_kernels --decode-expand);
# 3. bench_lora_overlap r16 serial/side_all: default, the sweep's best tiles, cuBLASLt, cuBLASLt + SM carve-out 16/32;
# 4. bench_generate batch 1 and 64: multilora, multilora-lora, multilora-lora-tiles (the sweep's best) if time is left
set -o pipefail
mkdir -p $OUT/c1
trap 'tar czf $OUT/c1.tgz -C $OUT c1 && rm -rf $OUT/c1' EXIT
R=$PWD
pip install -q --no-deps --no-build-isolation --target /tmp/ml . >/dev/null 2>&1
export PYTHONPATH=/tmp/ml PYTHONUNBUFFERED=1
{ git log --oneline -1 2>/dev/null; md5sum kernels/triton_sgmv.py; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; } > $OUT/c1/trees.txt 2>&1
(cd /tmp && timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider -rfEs \
  $R/tests/test_kernels.py -k "looped or decode_and_prefill" > /tmp/t1.log 2>&1; echo "rc=$? at $SECONDS s" >> /tmp/t1.log) &
(cd /tmp && timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider -rfEs $R/tests/test_adapter_memory.py \
  "$R/tests/test_engine_gpu.py::test_decode_and_piecewise_graphs_share_one_capture_stream" > /tmp/t2.log 2>&1;
  echo "rc=$? at $SECONDS s" >> /tmp/t2.log) &
wait
cat /tmp/t1.log /tmp/t2.log | grep -v "^\.*$" | tail -60 > $OUT/c1/gpu_tests.log
timeout 240 python3 bench/tune_lora_kernels.py --decode-expand --out $OUT/c1/tune > $OUT/c1/tune.log 2>&1
echo "rc=$? at $SECONDS s" >> $OUT/c1/tune.log
# the best (tiles, stages) at block_n 256, 4 warps, summed over the four groups' 64-token rows
BEST=$(python3 - $OUT/c1/tune/tune_decode_expand.json <<'PY' 2>/dev/null || echo 4:3
import json, sys, collections
rows = json.load(open(sys.argv[1]))["rows"]
tot = collections.defaultdict(float); cnt = collections.Counter()
for r in rows:
    if r["tokens"] == 64 and not r["default"] and r.get("block_n") == 256 and r.get("num_warps") == 4 and r["tiles"] > 1:
        tot[(r["tiles"], r["num_stages"])] += r["us"]; cnt[(r["tiles"], r["num_stages"])] += 1
best = min((k for k in tot if cnt[k] == 4), key=lambda k: tot[k])
print(f"{best[0]}:{best[1]}")
PY
)
echo "best tiles:stages = $BEST at $SECONDS s" | tee $OUT/c1/best.txt
ov() {  # name, flags...
  local n=$1; shift
  timeout 60 python3 bench/bench_lora_overlap.py --cases r16 --no-sweep --schedules serial,side_all \
    --out $OUT/c1/overlap "$@" > $OUT/c1/overlap_$n.log 2>&1; echo "rc=$? at $SECONDS s" >> $OUT/c1/overlap_$n.log
}
ov default
ov tiles --expand-tiles $BEST
ov lt --blas cublaslt
ov lt_carve16 --blas cublaslt --carveout 16
ov lt_carve32 --blas cublaslt --carveout 32
ov tiles_again --expand-tiles $BEST
L=$(( 585 - SECONDS ))
if [ $L -gt 150 ]; then
  timeout $L python3 bench/bench_generate.py --providers multilora,multilora-lora,multilora-lora-tiles \
    --expand-tiles $BEST --batches 1,64 --gen 64 --adapter-files 8 --time-budget $(( L - 40 )) \
    --out $OUT/c1/gen > $OUT/c1/gen.log 2>&1
  echo "rc=$? at $SECONDS s" >> $OUT/c1/gen.log
  rm -f $OUT/c1/gen/*.png
fi
