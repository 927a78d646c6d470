"""How long a host-arena chunk's page-locking holds up a thread issuing CUDA work, with and without faulting the
chunk's pages in first (``multilora.memory.host_arena.PREFAULT``; session 41, issue 13: S4's stalled steps were all
chunk registrations).

Each round maps one chunk of ``--chunk-mib`` MiB (``host_arena._Chunk``, pinned, as the host tier's arena does on a
CUDA machine) while a "step" thread runs a small bf16 matmul and a ``torch.cuda.synchronize()`` in a loop, as an
engine's step thread launches and reads back. Per round: the chunk's whole mapping time, the time in
``cudaHostRegister`` alone (``pin_seconds``) and the step thread's worst op (``stall_ms``: its slowest loop iteration
that overlapped the mapping, minus the median iteration before it). Rounds alternate prefault off / on
(``--rounds`` of each). One JSON line per round, a summary per mode, and ``host_register.json`` in ``--out``.

    python bench/bench_host_register.py --out bench/results/host_register      # CUDA, ~15 s
    python bench/bench_host_register.py --smoke --out /tmp/hr                  # CPU: the code path (a stub register)
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import threading
import time
from pathlib import Path

import torch

from multilora.memory import host_arena


def one_round(nbytes: int, prefault: bool, op_size: int, device: str, pinned: bool) -> dict:
    x = torch.randn(op_size, op_size, device=device, dtype=torch.bfloat16 if device == "cuda" else torch.float32)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    ops: list[tuple[float, float]] = []  # (start, seconds) of each step-thread iteration
    stop = threading.Event()

    def step() -> None:
        while not stop.is_set():
            t = time.perf_counter()
            (x @ x).sum()
            sync()
            ops.append((t, time.perf_counter() - t))

    th = threading.Thread(target=step, daemon=True)
    th.start()
    old, host_arena.PREFAULT = host_arena.PREFAULT, prefault
    try:
        time.sleep(0.2)
        before = len(ops)
        t0 = time.perf_counter()
        chunk = host_arena._Chunk(nbytes, nbytes, pinned)
        t1 = time.perf_counter()
        time.sleep(0.2)
    finally:  # (a chunk that failed to map: the step thread stopped all the same)
        host_arena.PREFAULT = old
        stop.set()
        th.join()
    median = statistics.median(dt for _, dt in ops[:before]) if before else float("nan")
    during = [dt for t, dt in ops if t < t1 and t + dt > t0]
    row = {"prefault": prefault, "chunk_bytes": nbytes, "pinned": chunk.pinned, "map_seconds": t1 - t0,
           "pin_seconds": chunk.pin_seconds, "step_op_median_ms": 1e3 * median,
           "stall_ms": 1e3 * (max(during) - median) if during else 0.0, "step_ops_during": len(during)}
    del chunk  # (unregistered and unmapped by its finalizer)
    return row


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chunk-mib", type=int, default=1024, help="MiB of each chunk (default: 1024, the default chunk)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of each mode, alternating (default: 3)")
    ap.add_argument("--op-size", type=int, default=1024, help="the step thread's matmul is N x N (default: 1024)")
    ap.add_argument("--smoke", action="store_true", help="on the CPU, 16 MiB chunks, 1 round: the code path only")
    ap.add_argument("--out", type=Path, default=None, help="directory for host_register.json")
    args = ap.parse_args(argv)
    device = "cpu" if args.smoke else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        ap.error("needs a CUDA GPU (use --smoke on the CPU)")
    nbytes = (16 if args.smoke else args.chunk_mib) << 20
    rounds = 1 if args.smoke else args.rounds
    rows = []
    register = host_arena._register
    if args.smoke:  # no CUDA: the registration a no-op that refuses, so the prefault path runs as on a GPU
        host_arena._register = lambda buffer: False
    try:
        for i in range(rounds):
            for prefault in (False, True):
                row = {"round": i, **one_round(nbytes, prefault, 64 if args.smoke else args.op_size, device, True)}
                print(json.dumps(row), flush=True)
                rows.append(row)
    finally:
        host_arena._register = register
    summary = {}
    for prefault, mode in ((False, "off"), (True, "on")):
        rs = [r for r in rows if r["prefault"] is prefault]
        m = summary[mode] = {k: statistics.median(r[k] for r in rs) for k in ("map_seconds", "pin_seconds", "stall_ms")}
        print(f"prefault {mode:3}: median map {m['map_seconds']:.3f} s, in cudaHostRegister {m['pin_seconds']:.3f} s, "
              f"step thread's worst op +{m['stall_ms']:.1f} ms", flush=True)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        meta = {"device": torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu",
                "torch": torch.__version__, "chunk_bytes": nbytes, "op_size": args.op_size, "rounds": rounds}
        (args.out / "host_register.json").write_text(json.dumps({**meta, "summary": summary, "rows": rows}, indent=1))
    return rows


if __name__ == "__main__":
    main()
