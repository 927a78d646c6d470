#!/usr/bin/env bash
# session 19, call 2 (main at de17fa4; call 1's shards A and B hit their 290 s limit): the engine A/B with --rounds 3
# (base, LoRA; medians by TPOT, every other round reversed); issue 13's one-batch row at 2,048 adapters with the host
# arena growing ahead (session 15's command); then the GPU test files call 1's shards did not reach (phi3, fp8,
# gemma2, sampling; two shards).
set -o pipefail
mkdir -p $OUT/c2 /tmp/adapters
trap 'tar czf $OUT/c2.tgz -C $OUT c2 && rm -rf $OUT/c2' EXIT
R=$PWD
pip install -q --no-deps --no-build-isolation --target /tmp/ml . >/dev/null 2>&1
export PYTHONPATH=/tmp/ml PYTHONUNBUFFERED=1
md5sum kernels/triton_sgmv.py runtime/model.py memory/host_arena.py runtime/adapter_cache.py bench/*.py > $OUT/c2/trees.txt
timeout 150 python3 bench/bench_generate.py --providers multilora,multilora-lora \
  --rounds 3 --batches 1,64 --gen 64 --adapter-files 8 --time-budget 130 --out $OUT/c2/gen \
  > $OUT/c2/gen.log 2>&1
echo "rc=$? at $SECONDS s" >> $OUT/c2/gen.log; rm -f $OUT/c2/gen/*.png
timeout 250 python3 bench/bench_adapter_throughput.py --shape llama3-8b --distinct-files 64 --counts 2048 \
  --popularity zipf --pool-adapters 0 --host-adapters 0 --adapter-dir /tmp/adapters --load-threads 2 --sample-threads \
  --out $OUT/c2/onebatch > $OUT/c2/onebatch.log 2>&1
echo "onebatch rc=$? at $SECONDS s" >> $OUT/c2/onebatch.log; rm -f $OUT/c2/onebatch/*.png
T=$R/tests
L=$(( 575 - SECONDS ))
(cd /tmp && timeout $L python3 -m pytest -m gpu -q -p no:cacheprovider -rfEs $T/test_model_phi3_gpu.py $T/test_fp8_gpu.py > /tmp/tA.log 2>&1; echo "A rc=$? at $SECONDS s" >> /tmp/tA.log) &
(cd /tmp && timeout $L python3 -m pytest -m gpu -q -p no:cacheprovider -rfEs $T/test_model_gemma2_gpu.py $T/test_sampling.py > /tmp/tB.log 2>&1; echo "B rc=$? at $SECONDS s" >> /tmp/tB.log) &
wait
{ tail -30 /tmp/tA.log; tail -30 /tmp/tB.log; } > $OUT/c2/gpu_tests.log
