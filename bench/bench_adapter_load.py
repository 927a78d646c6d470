"""Disk -> host adapter reload speed: read + validate + pack one PEFT adapter into pool pages (CPU only).

This is what the adapter cache's I/O threads run for every host-tier miss (``Engine._reload_adapter``) and
what ``Engine.load_adapter(preload=True)`` runs at registration: with this branch
``multilora.runtime.adapters.read_packed_adapter`` (file dtype kept, finiteness checked in it, rows copied
straight into the page image); ``--path legacy`` times the public route instead, ``load_peft_adapter``
(float32 copies) then ``AdapterPool.pack``. On a tree without ``read_packed_adapter`` (before this branch)
the fast path falls back to the legacy route, so the same command gives the before / after numbers.

    python bench/bench_adapter_load.py                                   # Llama-3-8B, r=16, bf16 -> bf16
    python bench/bench_adapter_load.py --file-dtype float32 --pool-dtype bfloat16,float32
    python bench/bench_adapter_load.py --threads 1,2,4 --torch-threads 1
    python bench/bench_adapter_load.py --pool-device cuda --threads 1,4        # GPU host: pinned page images

The adapter files are written once (``bench/_common.py``'s writer, kept in ``--adapter-dir``) and are in
the page cache when timed: the numbers are the CPU cost of the path (what limited the H200 host), not disk
bandwidth. MB/s counts the adapter's weight bytes in the file's dtype (84 MB for Llama-3-8B r=16 bf16), over
the wall time of ``--loads`` loads per thread; the median of ``--runs`` runs is printed. The page image
is fresh memory each time (as in the engine), so on a CPU pool its page faults are part of the cost
(``THP_MEM_ALLOC_ENABLE=1`` makes torch back large CPU tensors with huge pages); with ``--pool-device cuda``
it is pinned memory from torch's caching host allocator, which the timed loads reuse (each image is dropped
after its load, as an evicted host copy is in a serving engine); the first allocation (``cudaHostAlloc``
of the size rounded up to a power of two) is timed separately.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from multilora.memory.pool import AdapterPool
from multilora.runtime.adapters import load_peft_adapter
from multilora.config import ModelConfig
from multilora.runtime.weights import MODEL_SHAPES

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/_common.py, also under ``python -P``
from _common import adapter_bytes, write_adapter  # noqa: E402

try:  # the fast path (the engine's reload / preload)
    from multilora.runtime.adapters import read_packed_adapter
except ImportError:
    try:  # a tree where it lived in the engine
        from multilora.runtime.engine import read_packed_adapter
    except ImportError:  # an older tree: the engine packed load_peft_adapter's float32 copies
        read_packed_adapter = None

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def legacy(path: Path, config: ModelConfig, pool: AdapterPool, name: str):
    return pool.pack(load_peft_adapter(path, config, name=name))


def fast(path: Path, config: ModelConfig, pool: AdapterPool, name: str):
    if read_packed_adapter is None:
        return legacy(path, config, pool, name)
    return read_packed_adapter(path, config, pool, name=name)[1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="llama3-8b", choices=sorted(MODEL_SHAPES))
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--file-dtype", default="bfloat16", help="comma list of " + ", ".join(DTYPES))
    ap.add_argument("--pool-dtype", default="bfloat16", help="comma list of " + ", ".join(DTYPES))
    ap.add_argument("--threads", default="1,2", help="comma list of loader thread counts (the cache uses 4)")
    ap.add_argument("--torch-threads", type=int, default=1, help="torch.set_num_threads (intra-op threads)")
    ap.add_argument("--loads", type=int, default=3, help="loads per thread per run")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--path", choices=("fast", "legacy"), default="fast")
    ap.add_argument("--pool-device", default="cpu", help="cpu, or cuda: page images in pinned host memory")
    ap.add_argument("--adapter-dir", type=Path, default=Path(tempfile.gettempdir()) / "multilora-bench-adapter-load")
    args = ap.parse_args(argv)

    torch.set_num_threads(args.torch_threads)
    config = ModelConfig(**MODEL_SHAPES[args.shape])
    threads = [int(t) for t in args.threads.split(",")]
    fn = fast if args.path == "fast" else legacy
    route = "legacy" if args.path == "legacy" or read_packed_adapter is None else "fast"
    print(f"# {args.shape} r={args.rank} all 7 projections; torch {torch.__version__}, torch threads "
          f"{torch.get_num_threads()}, {os.cpu_count()} cpus, load {os.getloadavg()[0]:.2f}; path {route}",
          flush=True)
    for fdt_name in args.file_dtype.split(","):
        fdt = DTYPES[fdt_name]
        nbytes = adapter_bytes(config, args.rank, fdt)
        args.adapter_dir.mkdir(parents=True, exist_ok=True)
        dirs = [write_adapter(args.adapter_dir / f"{args.shape}-r{args.rank}-{fdt_name}-{i}", config, i, args.rank, fdt)
                for i in range(max(threads))]
        for pdt_name in args.pool_dtype.split(","):
            pool = AdapterPool(config, num_bytes=1 << 20, max_rank=args.rank, dtype=DTYPES[pdt_name],
                               device=args.pool_device)
            image = pool.max_adapter_pages * pool.page_elems  # elements of one rank-r adapter on every module
            if pool.device.type == "cuda":
                t0 = time.perf_counter()
                torch.empty(image, dtype=pool.dtype, pin_memory=True)
                first = time.perf_counter() - t0
                t0 = time.perf_counter()
                torch.empty(image, dtype=pool.dtype, pin_memory=True)
                print(f"pinned image ({pool.dtype}): first allocation {first * 1e3:.1f} ms, "
                      f"reused {(time.perf_counter() - t0) * 1e3:.2f} ms", flush=True)
            fn(dirs[0], config, pool, "warmup")
            for nt in threads:
                rates = []
                for _ in range(args.runs):
                    def worker(i: int) -> None:
                        for k in range(args.loads):
                            fn(dirs[i], config, pool, f"a{i}-{k}")
                    with ThreadPoolExecutor(nt) as ex:
                        t0 = time.perf_counter()
                        list(ex.map(worker, range(nt)))
                        dt = time.perf_counter() - t0
                    rates.append(nt * args.loads * nbytes / dt)
                mbs = statistics.median(rates) / 1e6
                print(f"file {fdt_name:8s} -> pool {pdt_name:8s} threads {nt}: {mbs:7.0f} MB/s  "
                      f"({mbs * 1e6 / nbytes:5.1f} adapters/s of {nbytes / 1e6:.0f} MB; runs "
                      f"{', '.join(f'{r / 1e6:.0f}' for r in rates)})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
