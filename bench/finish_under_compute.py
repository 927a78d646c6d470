"""Adapter loads into the pool while the compute stream is busy: raw images (copies + the device finish,
``Engine(adapter_finish="device")``) against host-finished ones (one copy each), under different compute (session 12).

In session 12's one-batch bench the device-finished loads ran at 1.6-4.4 GB/s while the engine computed, against
~80% of the pinned copy bandwidth under a bf16 GEMM loop (``bench_adapter_load.py``). This separates the kinds of
compute an engine step is made of: none; large GEMMs; a CUDA graph of many small kernels replayed back to back (a
decode step); the same small kernels launched eagerly.

    python bench/finish_under_compute.py --out bench/results/tier_moves/session12   # H200, ~40 s
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch

from multilora.config import ModelConfig
from multilora.memory.host_arena import HostArena
from multilora.memory.pool import AdapterPool
from multilora.runtime.adapters.image import read_image
from multilora.runtime.weights import MODEL_SHAPES

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import write_adapter  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--loads", type=int, default=8)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    config = ModelConfig(**MODEL_SHAPES["llama3-8b"])
    d = write_adapter(Path(tempfile.mkdtemp()) / "a", config, 0, 16, torch.bfloat16)
    probe = AdapterPool(config, num_bytes=1 << 20, max_rank=16, dtype=torch.bfloat16, device="meta")
    _, raw0 = read_image(d, config, probe, name="a", raw=True)
    n = raw0.data.numel()
    pool = AdapterPool(config, num_bytes=args.loads * n * 2, max_rank=16, max_slots=args.loads, dtype=torch.bfloat16,
                       device=dev)
    arena = HostArena(None, pinned=True, unit=pool.page_bytes, chunk_bytes=max(1 << 30, 2 * n * 2))
    raw = read_image(d, config, pool, name="a", raw=True, out=arena.alloc(n * 2).view(torch.bfloat16))[1]
    raw.checked = True
    fin = read_image(d, config, pool, name="a", out=arena.alloc(n * 2).view(torch.bfloat16))[1]
    pool.warm_finish()
    side = torch.cuda.Stream(dev)
    print("# stream priority range", torch.cuda.Stream.priority_range() if hasattr(torch.cuda.Stream, "priority_range")
          else None, flush=True)

    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    x = torch.randn(64, 4096, device=dev, dtype=torch.bfloat16)
    w = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)

    def small():  # ~600 short kernels, like a decode step's
        y = x
        for _ in range(200):
            y = torch.nn.functional.silu(y @ w) * 0.5 + x
        return y

    small()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream(dev)
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        small()
        with torch.cuda.graph(g):
            small()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()

    def compute(kind: str, ms: float = 120.0):
        if kind == "gemm":
            for _ in range(int(ms / 1.2)):
                a @ a
        elif kind == "graph":
            for _ in range(40):
                g.replay()
        elif kind == "eager":
            for _ in range(40):
                small()

    def loads(image, kind: str) -> float:
        slots = []
        torch.cuda.synchronize()
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record(side)
        for _ in range(args.loads):  # queued first (asynchronous), then the compute beside them
            slots.append(pool.load(image, stream=side))
        end.record(side)
        compute(kind)
        end.synchronize()
        gbps = args.loads * n * 2 / (begin.elapsed_time(end) / 1e3) / 1e9
        torch.cuda.synchronize()
        for sl in slots:
            pool.free(sl)
        return gbps

    rows = []
    for kind in ("none", "gemm", "graph", "eager"):
        for name, image in (("device_finish", raw), ("host_finished", fin)):
            loads(image, kind)
            r = [loads(image, kind) for _ in range(3)]
            rows.append({"compute": kind, "images": name, "gbps": statistics.median(r), "runs": r})
            print(f"{kind:6s} {name:14s} {statistics.median(r):6.2f} GB/s  {[round(v, 1) for v in r]}", flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "finish_under_compute.json").write_text(json.dumps(
            {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "image_bytes": n * 2,
             "loads": args.loads, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
