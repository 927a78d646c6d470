#!/usr/bin/env bash
# Session 41, call 5 (what the 300 s of device time left after failed starts allows): bench_host_register.py alone,
# 1 GiB chunks, prefault off / on alternating, a thread issuing CUDA work beside (host_arena.PREFAULT's A/B).
#   run: command="bash bench/results/session41/next_call5.sh", timeout_s=90; results in $OUT/c5/
mkdir -p $OUT/c5
. scripts/device_env.sh
git log --oneline -1 > $OUT/c5/tree.txt 2>/dev/null; git status --short >> $OUT/c5/tree.txt 2>/dev/null
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >> $OUT/c5/tree.txt 2>&1
timeout 70 python3 bench/bench_host_register.py --rounds 3 --out $OUT/c5 > $OUT/c5/hr.log 2>&1
echo "rc=$? at $SECONDS s" >> $OUT/c5/hr.log
true
