#!/usr/bin/env bash
# Session 36, call 2 (session 34's calls 2 and 3 cut to what decides, since a failed machine start cost 181 s of the
# session's 1,800): (1) bench_gemm_lora.py, issue 12's prefill row with the expand in the base GEMM's epilogue
# (never run on a GPU); (2) bench_adapter_load.py, issue 13 item 4's disk -> host A/Bs (split reads, read-ahead, host
# finish) against a plain cold read of the same files; (3) cold_read_patterns.py if time is left. The S4 serving rows
# of session 34's calls 2 and 3 are left for a later session.
#   run: command="END=585 bash bench/results/session36/next_call2.sh", timeout_s=600 (END: seconds the steps may take,
#   for a device budget short of 600 s); results in $OUT/c2.tgz
set -o pipefail
END=${END:-585}
mkdir -p $OUT/c2
trap 'tar czf $OUT/c2.tgz -C $OUT c2 && rm -rf $OUT/c2' EXIT
. scripts/device_env.sh
cp "$0" $OUT/c2/script.sh
git log --oneline -1 > $OUT/c2/tree.txt 2>/dev/null; git status --short >> $OUT/c2/tree.txt 2>/dev/null
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >> $OUT/c2/tree.txt 2>&1
(df -h /tmp; lsblk -o NAME,MODEL,SIZE,ROTA,TYPE,MOUNTPOINT; mount | grep -E " / | /tmp ") > $OUT/c2/disk.txt 2>&1
timeout $(( END < 460 ? END / 2 : 230 )) python3 bench/bench_gemm_lora.py --out $OUT/c2/gemm --rounds 3 > $OUT/c2/gemm.log 2>&1
echo "rc=$? at $SECONDS s (END $END)" >> $OUT/c2/gemm.log
timeout $(( END - 20 - SECONDS < 200 ? END - 20 - SECONDS : 200 )) python3 bench/bench_adapter_load.py --cold \
  --modules q_proj,k_proj,v_proj,o_proj --rank 32 --adapters 12 \
  --providers plain,ours,ours_readahead,ours_split,ours_host_finish,ours_host_finish_split --threads 1,2,4 --runs 3 \
  --gemm-ms 50 --adapter-dir /tmp/bal --out $OUT/c2/load > $OUT/c2/load.log 2>&1
echo "rc=$? at $SECONDS s" >> $OUT/c2/load.log
if [ $SECONDS -lt $(( END - 100 )) ]; then
  timeout $(( END - SECONDS )) python3 bench/cold_read_patterns.py --adapter-dir /tmp/bal --rounds 5 \
    --out $OUT/c2/patterns > $OUT/c2/patterns.log 2>&1; echo "rc=$? at $SECONDS s" >> $OUT/c2/patterns.log
fi
rm -f $OUT/c2/*/*.png
true
