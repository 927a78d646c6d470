#!/usr/bin/env bash
# Session 37, call 2: (1) bench_adapter_load.py --cold, issue 13 item 4's disk -> host reads against a plain cold read
# of the same S4-like files at 1, 2 and 4 readers, with the host finish pipelined under the read (new this session:
# image.PIPELINE_PIECE_BYTES, row ours_host_finish_pipe) against the serial one (ours_host_finish_serial, the default
# while PIPELINE_PIECE_BYTES is 0) and the raw read (ours); (2) bench_gemm_lora.py --rounds 3, issue 12's prefill row
# (session 36 ran one round: the engine +9.9%); (3) cold_read_patterns.py if time is left.
#   run: command="END=585 bash bench/results/session37/next_call2.sh", timeout_s=600 (END: seconds the steps may take,
#   for a device budget short of 600 s); results in $OUT/c2.tgz
set -o pipefail
END=${END:-585}
mkdir -p $OUT/c2
trap 'tar czf $OUT/c2.tgz -C $OUT c2 && rm -rf $OUT/c2' EXIT
. scripts/device_env.sh
cp "$0" $OUT/c2/script.sh
git log --oneline -1 > $OUT/c2/tree.txt 2>/dev/null; git status --short >> $OUT/c2/tree.txt 2>/dev/null
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >> $OUT/c2/tree.txt 2>&1
(nproc; df -h /tmp; lsblk -o NAME,MODEL,SIZE,ROTA,TYPE,MOUNTPOINT; mount | grep -E " / | /tmp ") > $OUT/c2/disk.txt 2>&1
timeout $(( END < 460 ? END / 2 : 230 )) python3 bench/bench_adapter_load.py --cold \
  --modules q_proj,k_proj,v_proj,o_proj --rank 32 --adapters 12 \
  --providers plain,ours,ours_host_finish_serial,ours_host_finish_pipe,ours_split --threads 1,2,4 --runs 3 \
  --gemm-ms 50 --adapter-dir /tmp/bal --out $OUT/c2/load > $OUT/c2/load.log 2>&1
echo "rc=$? at $SECONDS s (END $END)" >> $OUT/c2/load.log
timeout $(( END - 20 - SECONDS < 230 ? END - 20 - SECONDS : 230 )) python3 bench/bench_gemm_lora.py --out $OUT/c2/gemm \
  --rounds 3 > $OUT/c2/gemm.log 2>&1
echo "rc=$? at $SECONDS s" >> $OUT/c2/gemm.log
if [ $SECONDS -lt $(( END - 100 )) ]; then
  timeout $(( END - SECONDS )) python3 bench/cold_read_patterns.py --adapter-dir /tmp/bal --rounds 5 \
    --out $OUT/c2/patterns > $OUT/c2/patterns.log 2>&1; echo "rc=$? at $SECONDS s" >> $OUT/c2/patterns.log
fi
rm -f $OUT/c2/*/*.png
true
