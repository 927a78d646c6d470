#!/usr/bin/env bash
# Session 43, call 2 (issue 12's TTFT): the MLP activation + down-projection LoRA shrink kernel
# (kernels.triton_sgmv.glu_shrink, written in session 43 without a GPU, off by default: runtime.model.GLU_SHRINK_MIN_TOKENS):
# (1) its GPU tests (bf16 / fp16 at Llama-3-8B width against the fp32 reference); (2) bench_glu_shrink.py: the MLP's
# second half at 4,096 tokens on 64 adapters, the engine's path against the fused one at six tile configs, pools of
# max rank 16 and 64; (3) bench_generate.py TTFT / TPOT at batch 64: multilora, multilora-lora and
# multilora-lora-glushrink (GLU_SHRINK_MIN_TOKENS = 256) with the glu_shrink tiles that (2) found fastest at rank 16.
#   run: command="END=560 bash bench/results/session43/next_call2.sh", timeout_s=600; results in $OUT/c2.tgz
#   (END < 300: the tests get END / 2 s, then the layer bench the rest at pool rank 16 only, no engine rows)
set -o pipefail
END=${END:-560}
mkdir -p $OUT/c2
trap 'tar czf $OUT/c2.tgz -C $OUT c2 && rm -rf $OUT/c2' EXIT
. scripts/device_env.sh
cp "$0" $OUT/c2/script.sh
git log --oneline -1 > $OUT/c2/tree.txt 2>/dev/null; git status --short >> $OUT/c2/tree.txt 2>/dev/null
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >> $OUT/c2/tree.txt 2>&1
timeout $(( END < 300 ? END / 2 : 120 )) python3 -m pytest -q -m gpu tests/test_glu_shrink.py > $OUT/c2/tests.log 2>&1
echo "rc=$? at $SECONDS s" >> $OUT/c2/tests.log
timeout $(( END - SECONDS - 5 < 150 ? END - SECONDS - 5 : 150 )) python3 bench/bench_glu_shrink.py --out $OUT/c2/layer --rounds 5 \
  --pool-rank $([ $END -lt 300 ] && echo 16 || echo 16,64) > $OUT/c2/layer.log 2>&1
echo "rc=$? at $SECONDS s" >> $OUT/c2/layer.log
BEST=$(python3 - "$OUT/c2/layer/glu_shrink.json" <<'PY' 2>/dev/null
import json, sys
case = json.load(open(sys.argv[1]))["cases"][0]
ok = {k: v for k, v in case["us"].items() if k.startswith("fused_") and case["checks"][k]["h_equals_silu_mul_bits"]
      and case["checks"][k]["y_max_abs_diff_rel"] < 2e-2}
best = min(ok, key=ok.get)
print(best[len("fused_"):].replace("x", " ").replace("w", " "))
PY
)
echo "best tiles (block_m block_k warps): ${BEST:-none, defaults}" >> $OUT/c2/layer.log
LEFT=$(( END - SECONDS - 15 ))
if [ $LEFT -gt 120 ]; then
  LEFT=$LEFT timeout $LEFT python3 - $BEST <<'PY' > $OUT/c2/gen.log 2>&1
import os, runpy, sys
if len(sys.argv) == 4:
    from multilora.kernels import triton_sgmv
    triton_sgmv.GLU_SHRINK_TILES = tuple(int(v) for v in sys.argv[1:])
    print("GLU_SHRINK_TILES", triton_sgmv.GLU_SHRINK_TILES, flush=True)
out = os.path.join(os.environ["OUT"], "c2", "gen")
sys.argv = ["bench_generate.py", "--providers", "multilora,multilora-lora,multilora-lora-glushrink", "--rounds", "3",
            "--batches", "64", "--gen", "16", "--time-budget", str(int(os.environ.get("LEFT", "300")) - 30),
            "--in-process", "--out", out]
runpy.run_path("bench/bench_generate.py", run_name="__main__")
PY
  echo "rc=$? at $SECONDS s" >> $OUT/c2/gen.log
fi
rm -f $OUT/c2/*/*.png
true
