#!/usr/bin/env bash
# The GPU tests (-m gpu) on a machine with one CUDA GPU, in seven shards run at once (about 7.5 minutes on the H200
# instead of about 13 one after the other), for the device machine's 10-minute calls.
#
#   bash scripts/gpu_suite.sh OUT_DIR [LIMIT_SECONDS]     (LIMIT: each shard's time limit, default 470)
#
# Needs the package importable (an editable install, or PYTHONPATH at an install of this tree). Writes
# OUT_DIR/gpu_tests.log: each shard's tail (and `shard X rc=N at S s`; rc 124 = its time limit), then the tests that
# failed in a shard run again alone (two processes on one GPU can disturb each other's timing-sensitive tests; at
# most 150 s, and not past 560 s from the script's start, so that a 600 s device call keeps the log).
# Every test file with a gpu mark runs: a file not named in a shard below goes to shard C, and the log says so.
# OUT_DIR/durations.txt: every test's time of 1 s or more, by shard, to deal the shards by. A shard past its limit
# gets SIGINT (pytest then stops, names the test it was in and still reports the tests done and their durations),
# and SIGKILL 20 s later if it has not stopped. Exit status: 0 when no shard failed or timed out and no failure repeated alone.
set -uo pipefail
OUT=${1:?usage: scripts/gpu_suite.sh OUT_DIR [LIMIT_SECONDS]}
LIMIT=${2:-470}
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
T=$ROOT/tests
mkdir -p "$OUT"
LOGS=$(mktemp -d)
# by the durations seen on the H200 (session 18: A 242 s, B 291 s, C 117 s when run together; session 21, with the
# PDL tests: A and B past 300 s, C 116 s, so Phi-3 and Gemma 2 moved from A and B to C; session 22: A past 330 s 38
# tests into test_fp8_gpu.py, B 322 s, C 207 s, so test_fp8_gpu.py (50 s alone) moved from A to C; session 24: A and B
# both past 380 s (B with the async-scheduling tests), C 308 s, so test_engine_gpu.py got a shard of its own, D, and
# test_image_finish.py moved from A to B; session 28: A, test_kernels.py with test_fused_ops.py, past 396 s, so
# test_fused_ops.py moved to B (71 s) and test_kernels.py's tests are dealt alternately to shards A and E; session 30:
# C past 420 s four tests before its end, B 166 s, so test_fp8_gpu.py moved from C to B; D 418 s of its 420, so
# session 31 deals test_engine_gpu.py's tests alternately to D and F; session 32: at 420 s A and D timed out, at 470 s
# every shard passed, the longest (B) in 445 s: the next test added wants a seventh shard or a second call; session 40,
# on a slower H100 host: B ran its last test at 463 s and C (with test_gemm_lora.py, no shard named it) was stopped 8
# tests before its end, so a seventh shard G takes test_gemm_lora.py, test_fp8_gpu.py from B and Gemma 2 from C)
A="test_kernels.py"
B="test_attention.py test_sampling.py test_image_finish.py test_fused_ops.py test_glu_shrink.py"  # (session 41: B 204 s)
D="test_engine_gpu.py"
C="test_adapter_tiers.py test_engine_loop.py test_engine_diagnostics.py test_adapter_memory.py test_suite_halves.py
   test_model_families_gpu.py test_engine_unified.py test_model_phi3_gpu.py"
G="test_gemm_lora.py test_fp8_gpu.py test_model_gemma2_gpu.py"
named=" $(echo $A $B $C $D $G) "  # (echo: one space between names)
extra=""
for f in $(grep -l "mark\.gpu" "$T"/test_*.py | xargs -n1 basename); do
    case "$named" in *" $f "*) ;; *) extra="$extra $f" ;; esac
done
C="$C$extra"
SECONDS=0
shard() {  # name, test files or node ids (relative to tests/)...
    local n=$1; shift
    (set -f; cd /tmp && timeout -s INT -k 20 "$LIMIT" python3 -m pytest -m gpu -q -p no:cacheprovider -rfEs --durations=0 \
        --durations-min=1.0 \
        $(printf "$T/%s " "$@") > "$LOGS/shard_$n.log" 2>&1
     rc=$?
     [ $rc -eq 5 ] && { echo "(no gpu tests collected in this shard)" >> "$LOGS/shard_$n.log"; rc=0; }
     echo "shard $n rc=$rc at $SECONDS s" >> "$LOGS/shard_$n.log")
}
# a file group's tests dealt alternately to two shards (neighbours in a file tend to cost alike): prints the ids of
# the first half to $LOGS/<first>_ids.txt and the second's to $LOGS/<second>_ids.txt; when collection fails, the files
# whole go to the first shard (its log says why) and the second gets nothing
deal() {  # first, second, files...
    local first=$1 second=$2; shift 2
    (set -f; cd /tmp && python3 -m pytest -m gpu -q -p no:cacheprovider -p no:warnings --collect-only \
        $(printf "$T/%s " "$@") 2>/dev/null) \
        | grep -E "^[^ ]*tests/test_[^ ]*\.py::[^ ]+$" | sed "s|^.*tests/||" > "$LOGS/all_$first.txt"  # node ids only
    if [ -s "$LOGS/all_$first.txt" ]; then
        awk 'NR % 2 == 1' "$LOGS/all_$first.txt" > "$LOGS/${first}_ids.txt"
        awk 'NR % 2 == 0' "$LOGS/all_$first.txt" > "$LOGS/${second}_ids.txt"
    else
        echo "$@" > "$LOGS/${first}_ids.txt"; : > "$LOGS/${second}_ids.txt"
    fi
}
deal A E $A
deal D F $D
set -f  # (node ids hold brackets: no globbing of them against this directory's files)
for n in A E D F; do
    [ -s "$LOGS/${n}_ids.txt" ] && shard $n $(cat "$LOGS/${n}_ids.txt") &
done
set +f
shard B $B &
shard C $C &
shard G $G &
wait
{
    [ -n "$extra" ] && echo "=== files with a gpu mark that no shard named, run in shard C:$extra"
    for n in A E B C G D F; do
        [ -f "$LOGS/shard_$n.log" ] || continue; echo "=== shard $n"
        grep -Ev "^[0-9.]+s (call|setup|teardown) " "$LOGS/shard_$n.log" | tail -25; done
} > "$OUT/gpu_tests.log"
# every test's duration of 1 s or more, by shard (the data for the next rebalancing of the shards)
: > "$OUT/durations.txt"
for n in A E B C G D F; do
    [ -f "$LOGS/shard_$n.log" ] || continue
    grep -E "^[0-9.]+s (call|setup|teardown) " "$LOGS/shard_$n.log" | sed "s/^/$n /" >> "$OUT/durations.txt"
done
status=0
grep -q "rc=[^0]" "$LOGS"/shard_*.log && status=1
grep -h "^FAILED\|^ERROR" "$LOGS"/shard_*.log | sed 's/^[A-Z]* //; s/ - .*//' | sort -u > "$LOGS/failed.txt"
if [ -s "$LOGS/failed.txt" ]; then
    echo "=== re-run alone: $(wc -l < "$LOGS/failed.txt") failed in the shards" >> "$OUT/gpu_tests.log"
    left=$(( 560 - SECONDS )); [ $left -gt 150 ] && left=150; [ $left -lt 30 ] && left=30  # (a 600 s device call)
    (cd /tmp && timeout $left python3 -m pytest -m gpu -q -p no:cacheprovider -rfEs $(cat "$LOGS/failed.txt") 2>&1 \
        | tail -60 >> "$OUT/gpu_tests.log"; exit "${PIPESTATUS[0]}") || status=1
fi
echo "tests done at $SECONDS s, status $status" >> "$OUT/gpu_tests.log"
rm -rf "$LOGS"
exit $status
