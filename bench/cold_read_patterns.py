"""Which way of reading an adapter file from a cold page cache is fastest on this host's disk (issue 13, item 4).

``bench_adapter_load.py --cold`` times our read (``read_image``) against a plain read of the same files; this probe
takes the difference apart at the system-call level, without our code in between, so that the choice of
``runtime.adapters.image.READ_AHEAD`` (and of any other read pattern) follows the host's disk and kernel, not a guess:

  ``plain``                one ``preadv`` of the whole file from byte 0 (the bound ``bench_adapter_load.py`` uses);
  ``header_then_rest``     what ``read_image`` asks of the kernel: the 8-byte header length and the header (two small
                           reads, which start the kernel's readahead with a small window), then the rest in one
                           ``preadv`` (ours scatters it over ~256 buffers: the same request size);
  ``..._willneed``         that after ``posix_fadvise(WILLNEED)`` of the whole file (``image.READ_AHEAD = True``);
  ``..._sequential``       that after ``posix_fadvise(SEQUENTIAL)`` (the kernel doubles the file's readahead window);
  ``..._split2/4``         the rest split in 2 / 4 parts read at once on as many threads (a deeper disk queue);
  ``ours`` / ``ours_readahead``  ``read_image(..., raw=True)`` itself into a reused image, without / with the advice.

Each round drops the files' page cache (``posix_fadvise(DONTNEED)``) before each pattern, patterns in alternating
order; medians of ``--rounds`` (the JSON rewritten after every round, so a run cut short keeps its rounds). The block device's queue settings (``read_ahead_kb``, ``max_sectors_kb``,
``nr_requests``, ``rotational``) are recorded with the rows: the kernel's readahead, and so every pattern above, depends
on them. Results: ``--out``/``cold_read_patterns.json`` and a table on stdout.

    python bench/cold_read_patterns.py                       # 12 S4-like files (q/k/v/o, rank 32, Llama-3-8B), ~1 min
    python bench/cold_read_patterns.py --adapter-dir /tmp/bal --rounds 9 --out DIR

A measurement of the disk where the files lie (a VM's virtual disk behaves like none of the GPU hosts'): compare rows
of one run only.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import struct
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from multilora.config import TARGET_MODULES, ModelConfig
from multilora.memory.pool import AdapterPool
from multilora.runtime.adapters import image
from multilora.runtime.weights import MODEL_SHAPES

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import drop_page_cache, write_adapter  # noqa: E402

WEIGHTS = "adapter_model.safetensors"
QUEUE_KEYS = ("read_ahead_kb", "max_sectors_kb", "nr_requests", "rotational", "scheduler")


def block_queue(path: Path) -> dict:
    """The queue settings of the block device holding ``path`` (``/sys/dev/block/MAJ:MIN/queue``, a partition's
    parent's), by key of ``QUEUE_KEYS``; ``{}`` where there is none (tmpfs, overlay, not Linux)."""
    st = os.stat(path)
    base = Path(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}")
    for q in (base / "queue", base / ".." / "queue"):
        if q.is_dir():
            out = {}
            for k in QUEUE_KEYS:
                try:
                    out[k] = (q / k).read_text().strip()
                except OSError:
                    pass
            out["device"] = base.resolve().name if q == base / "queue" else (base / "..").resolve().name
            return out
    return {}


def _header_end(fd: int) -> int:
    """Read the safetensors header as ``read_image`` does (its length, then the header): where the data starts."""
    n = struct.unpack("<Q", os.pread(fd, 8, 0))[0]
    os.pread(fd, n, 8)
    return 8 + n


def patterns(buf: memoryview, pool_ex: ThreadPoolExecutor) -> dict:
    """name -> fn(fd, size): the system-call patterns of the module docstring, reading into ``buf``."""
    def plain(fd, size):
        os.preadv(fd, [buf[:size]], 0)

    def rest(fd, size, advice=None, parts=1):
        if advice is not None:
            os.posix_fadvise(fd, 0, 0, advice)
        s = _header_end(fd)
        step = -(-(size - s) // parts)
        spans = [(s + i * step, min(size, s + (i + 1) * step)) for i in range(parts)]
        if parts == 1:
            os.preadv(fd, [buf[s:size]], s)
        else:
            list(pool_ex.map(lambda ab: os.preadv(fd, [buf[ab[0]:ab[1]]], ab[0]), spans))

    return {"plain": plain,
            "header_then_rest": rest,
            "header_then_rest_willneed": lambda fd, size: rest(fd, size, os.POSIX_FADV_WILLNEED),
            "header_then_rest_sequential": lambda fd, size: rest(fd, size, os.POSIX_FADV_SEQUENTIAL),
            "header_then_rest_split2": lambda fd, size: rest(fd, size, parts=2),
            "header_then_rest_split4": lambda fd, size: rest(fd, size, parts=4)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--shape", default="llama3-8b", choices=sorted(MODEL_SHAPES))
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--modules", default="q_proj,k_proj,v_proj,o_proj",
                    help="comma list of target modules (default issue 13's S1 / S4 set)")
    ap.add_argument("--adapters", type=int, default=12, help="files per round (55 MB each for the default)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--adapter-dir", type=Path, default=Path(tempfile.gettempdir()) / "multilora-cold-read-patterns")
    ap.add_argument("--out", type=Path, default=None, help="directory for cold_read_patterns.json")
    args = ap.parse_args(argv)
    if not hasattr(os, "posix_fadvise") or not hasattr(os, "preadv"):
        ap.error("needs os.posix_fadvise and os.preadv (Linux)")
    modules = tuple(m for m in args.modules.split(",") if m)
    if not modules or any(m not in TARGET_MODULES for m in modules):
        ap.error(f"--modules: expected a comma list of {', '.join(TARGET_MODULES)}, got {args.modules!r}")
    if args.adapters < 1 or args.rounds < 1:
        ap.error(f"--adapters and --rounds: expected >= 1, got {args.adapters} and {args.rounds}")

    config = ModelConfig(**MODEL_SHAPES[args.shape])
    tag = "" if modules == TARGET_MODULES else "-" + "-".join(m.split("_")[0] for m in modules)
    dirs = [write_adapter(args.adapter_dir / f"{args.shape}-r{args.rank}-bfloat16{tag}-{i}", config, i, args.rank,
                          torch.bfloat16, modules) for i in range(args.adapters)]
    os.sync()  # the page cache drops clean pages only
    files = [d / WEIGHTS for d in dirs]
    sizes = [f.stat().st_size for f in files]
    total = sum(sizes)
    buf_np = np.ones(max(sizes), dtype=np.uint8)  # touched: no page faults inside the timed reads
    pool_ex = ThreadPoolExecutor(4)
    fns = patterns(memoryview(buf_np), pool_ex)

    pool = AdapterPool(config, num_bytes=1 << 20, max_rank=args.rank, dtype=torch.bfloat16, device="meta")
    out_img = None

    def ours(readahead: bool):
        def run():
            nonlocal out_img
            was, image.READ_AHEAD = image.READ_AHEAD, readahead
            try:
                for d in dirs:
                    _, packed = image.read_image(d, config, pool, out=out_img, raw=True)
                    out_img = packed.data  # reused from the first read on (the first is outside the timing)
            finally:
                image.READ_AHEAD = was
        return run

    def syscalls(fn):
        def run():
            for f in files:
                fd = os.open(f, os.O_RDONLY)
                try:
                    fn(fd, os.fstat(fd).st_size)
                finally:
                    os.close(fd)
        return run

    runs = {name: syscalls(fn) for name, fn in fns.items()}
    runs["ours"], runs["ours_readahead"] = ours(False), ours(True)
    for run in runs.values():  # warm-up (plans, buffers, the image), untimed
        run()
    queue = block_queue(files[0])
    head = {"host": platform.node(), "cpu": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
            "kernel": platform.release(), "torch": torch.__version__, "shape": args.shape, "rank": args.rank,
            "modules": list(modules), "adapters": args.adapters, "file_bytes": sizes[0], "rounds": args.rounds,
            "queue": queue}
    print(f"# {head}", flush=True)
    rates: dict[str, list[float]] = {name: [] for name in runs}
    names = list(runs)

    def rows_so_far() -> list[dict]:
        plain = statistics.median(rates["plain"])
        return [{**head, "pattern": name, "gbps": statistics.median(v), "vs_plain": statistics.median(v) / plain,
                 "runs_gbps": v, "bytes_per_run": total} for name, v in rates.items()]

    path = None if args.out is None else args.out / "cold_read_patterns.json"
    if path is not None:
        args.out.mkdir(parents=True, exist_ok=True)
    for r in range(args.rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            drop_page_cache(dirs)
            t0 = time.perf_counter()
            runs[name]()
            rates[name].append(total / (time.perf_counter() - t0) / 1e9)
        print(f"  round {r + 1}/{args.rounds}: " + ", ".join(f"{n} {rates[n][-1]:.2f}" for n in names) + " GB/s",
              file=sys.stderr, flush=True)
        if path is not None:  # after every round: a run cut short by a time limit keeps what it measured
            path.write_text(json.dumps(rows_so_far(), indent=1))
    pool_ex.shutdown()
    for row in rows_so_far():
        print(f"{row['pattern']:28s} {row['gbps']:6.2f} GB/s  {row['vs_plain']:5.2f}x plain  runs "
              f"{[round(x, 2) for x in row['runs_gbps']]}", flush=True)
    if path is not None:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
