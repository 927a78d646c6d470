"""Adapter loads into the pool while the compute stream is busy: raw images (copies + the device finish,
``Engine(adapter_finish="device")``) against host-finished ones (one copy each), under different compute (sessions 12
and 13).

Images: ``host_finished`` (one copy each); ``device_finish`` (raw: the copy, then the in-place finish kernels right
after it on the same side stream); ``deferred_finish`` (raw: the copies on the side stream, the finish queued on the
compute stream after the compute, as the adapter cache does at a step boundary, ``AdapterPool.finish_pending``;
its GB/s is the copies', and ``finish_us_per_load`` the finish's own time on the then idle compute stream).

In session 12's one-batch bench the device-finished loads ran at 1.6-4.4 GB/s while the engine computed, against
~80% of the pinned copy bandwidth under a bf16 GEMM loop (``bench_adapter_load.py``). This separates the kinds of
compute an engine step is made of: none; large GEMMs; a CUDA graph of many small kernels replayed back to back (a
decode step); the same small kernels launched eagerly.

    python bench/finish_under_compute.py --out bench/results/tier_moves/session13   # H200, ~60 s
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

    def loads(image, kind: str, defer: bool) -> tuple[float, float | None]:
        slots = []
        torch.cuda.synchronize()
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
        ev[0].record(side)
        for _ in range(args.loads):  # queued first (asynchronous), then the compute beside them
            slots.append(pool.load(image, stream=side, defer_finish=defer))
        ev[1].record(side)
        compute(kind)
        ev[1].synchronize()
        gbps = args.loads * n * 2 / (ev[0].elapsed_time(ev[1]) / 1e3) / 1e9
        fin_us = None
        if defer:  # the step boundary: the finish on the compute stream, after its work
            ev[2].record()
            assert pool.finish_pending() == args.loads
            ev[3].record()
            ev[3].synchronize()
            fin_us = ev[2].elapsed_time(ev[3]) * 1e3 / args.loads
        torch.cuda.synchronize()
        for sl in slots:
            pool.free(sl)
        return gbps, fin_us

    rows = []
    for kind in ("none", "gemm", "graph", "eager"):
        for name, image, defer in (("device_finish", raw, False), ("deferred_finish", raw, True),
                                   ("host_finished", fin, False)):
            loads(image, kind, defer)
            r = [loads(image, kind, defer) for _ in range(3)]
            rates = [x[0] for x in r]  # (not ``g``: that is the CUDA graph replayed by compute("graph"))
            f = [x[1] for x in r if x[1] is not None]
            rows.append({"compute": kind, "images": name, "gbps": statistics.median(rates), "runs": rates,
                         "finish_us_per_load": statistics.median(f) if f else None})
            print(f"{kind:6s} {name:16s} {statistics.median(rates):6.2f} GB/s  {[round(v, 1) for v in rates]}"
                  + (f"  finish {statistics.median(f):.1f} us/load" if f else ""), flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "finish_under_compute.json").write_text(json.dumps(
            {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "image_bytes": n * 2,
             "loads": args.loads, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
