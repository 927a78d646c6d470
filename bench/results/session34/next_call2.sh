#!/usr/bin/env bash
# Next GPU session, call 2 (session 33's next_call2.sh with session 34's split-read rows added; neither session had a
# device): issue 13 item 4, disk -> host against a plain
# cold read on the GPU host's own disk. (1) its block queue and the system-call patterns of a cold read
# (cold_read_patterns.py: does reading the header first, as read_image does, slow the kernel's readahead; does
# WILLNEED / SEQUENTIAL / split reads help); (2) read_image against plain, with and without the advice
# (image.READ_AHEAD), and the host-finish read the engine runs by default, 1 / 2 / 4 threads, then the cache's row and
# the host -> GPU rows; (3) S4 at 2,000 adapters with each read's files dropped right after it (--drop-after-read) in
# place of session 32's 0.5 s sweep; (4) its N = 2,000 row with adapter_finish="device".
#   run: command="bash bench/results/session34/next_call2.sh", timeout_s=600; results in $OUT/c2.tgz
set -o pipefail
mkdir -p $OUT/c2
trap 'tar czf $OUT/c2.tgz -C $OUT c2 && rm -rf $OUT/c2' EXIT
. scripts/device_env.sh
cp "$0" $OUT/c2/script.sh
git log --oneline -1 > $OUT/c2/tree.txt 2>/dev/null; git status --short >> $OUT/c2/tree.txt 2>/dev/null
(df -h /tmp; lsblk -o NAME,MODEL,SIZE,ROTA,TYPE,MOUNTPOINT; mount | grep -E " / | /tmp ") > $OUT/c2/disk.txt 2>&1
timeout 120 python3 bench/cold_read_patterns.py --adapter-dir /tmp/bal --rounds 5 --out $OUT/c2/patterns \
  > $OUT/c2/patterns.log 2>&1; echo "rc=$? at $SECONDS s" >> $OUT/c2/patterns.log
timeout 180 python3 bench/bench_adapter_load.py --cold --modules q_proj,k_proj,v_proj,o_proj --rank 32 --adapters 12 \
  --providers plain,ours,ours_readahead,ours_split,ours_host_finish,ours_host_finish_split --threads 1,2,4 --runs 3 --gemm-ms 50 --adapter-dir /tmp/bal \
  --out $OUT/c2/load > $OUT/c2/load.log 2>&1; echo "rc=$? at $SECONDS s" >> $OUT/c2/load.log
mkdir -p /tmp/s4
timeout $(( 590 - SECONDS )) python3 bench/bench_serving.py --shape llama3-8b --adapter-set S4 --adapters 5,2000 \
  --adapter-files 64 --adapter-dir /tmp/s4 --preload 300 --modes engine --requests 512 --rate auto --no-burst-rows \
  --engine-warmup --warmup-requests 0 --drop-after-read --out $OUT/c2/s4 > $OUT/c2/s4.log 2>&1
echo "s4 rc=$? at $SECONDS s" >> $OUT/c2/s4.log; rm -f $OUT/c2/s4/*.png
# (4) the N = 2,000 row again at the same offered rate with the reads raw and finished on the GPU
# (Engine(adapter_finish="device"): no transpose or check on the I/O threads; S4 ran "host" so far)
RATE=$(python3 -c "import json; print(json.load(open('$OUT/c2/s4/serving_llama3-8b.json'))['rows'][0]['offered_rps'])" 2>/dev/null)
if [ -n "$RATE" ] && [ $SECONDS -lt 400 ]; then
  timeout $(( 590 - SECONDS )) python3 bench/bench_serving.py --shape llama3-8b --adapter-set S4 --adapters 2000 \
    --adapter-files 64 --adapter-dir /tmp/s4 --preload 300 --modes engine --requests 512 --rate $RATE --no-burst-rows \
    --engine-warmup --warmup-requests 0 --drop-after-read --adapter-finish device --out $OUT/c2/s4dev \
    > $OUT/c2/s4dev.log 2>&1
  echo "s4dev rc=$? at $SECONDS s" >> $OUT/c2/s4dev.log; rm -f $OUT/c2/s4dev/*.png
else
  echo "s4dev skipped at $SECONDS s (rate '$RATE')" > $OUT/c2/s4dev.log
fi
true
