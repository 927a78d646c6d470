"""How much a disk -> host adapter read slows down beside a Python thread that wants the GIL (issue 13).

The adapter cache reads adapters on I/O threads (``runtime.adapters.image.read_image``: scatter reads, lora_B
transposed into the image by numpy, a finite check of the whole image) while the engine's step thread runs Python
(scheduling, launches) between its waits for the GPU. Every numpy call and read of the I/O thread releases the GIL and
must take it back, and a thread that holds the GIL gives it up only at the interpreter's switch interval (the engine
sets 0.5 ms, ``EngineConfig.gil_switch_interval``). This times one adapter's read into a pre-faulted image (as into
an arena block) alone and beside a thread that runs Python without pause (the worst case of a step thread), and the
same with parts of the read left out, to show which part pays for the GIL:

    python bench/read_contention.py                          # Llama-3-8B r16 on all seven projections, ~1 min
    python bench/read_contention.py --rank 8 --targets qkvo  # issue 13's S1 adapter

A CPU measurement: only the ratio between rows of one run means something, and only on an otherwise idle host.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from multilora.config import TARGET_MODULES, ModelConfig
from multilora.memory.pool import AdapterPool
from multilora.runtime.adapters import image
from multilora.runtime.weights import MODEL_SHAPES

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import write_adapter  # noqa: E402


def timed_reads(read, reads: int, busy: bool) -> float:
    """Seconds per ``read()`` (median of ``reads``) on a thread of its own, beside a busy Python thread or not."""
    stop = threading.Event()

    def spin() -> None:
        x = 0
        while not stop.is_set():
            x += 1

    spinner = threading.Thread(target=spin, daemon=True) if busy else None
    times: list[float] = []

    def reader() -> None:
        read()  # untimed: the plan, the scratch buffer
        for _ in range(reads):
            t = time.perf_counter()
            read()
            times.append(time.perf_counter() - t)

    if spinner is not None:
        spinner.start()
    try:
        th = threading.Thread(target=reader)
        th.start()
        th.join()
    finally:
        stop.set()
        if spinner is not None:
            spinner.join()
    return sorted(times)[len(times) // 2]


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="llama3-8b", choices=sorted(MODEL_SHAPES))
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--targets", choices=("all", "qkvo"), default="all")
    ap.add_argument("--reads", type=int, default=5, help="timed reads per row (the median is reported)")
    ap.add_argument("--switch-interval", type=float, default=0.0005,
                    help="sys.setswitchinterval during the rows, seconds (default the engine's 0.5 ms)")
    ap.add_argument("--adapter-dir", default=None, help="where the adapter is written (default: a temporary one)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    cfg = ModelConfig(**MODEL_SHAPES[args.shape])
    modules = TARGET_MODULES if args.targets == "all" else ("q_proj", "k_proj", "v_proj", "o_proj")
    root = Path(args.adapter_dir or tempfile.mkdtemp())
    path = write_adapter(root / f"{args.shape}-r{args.rank}-{args.targets}", cfg, seed=0, rank=args.rank,
                         dtype=torch.bfloat16, modules=modules)
    pool = AdapterPool(cfg, num_bytes=1 << 20, max_rank=args.rank, dtype=torch.bfloat16)
    _, packed = image.read_image(path, cfg, pool, name="probe")
    out = torch.zeros_like(packed.data)  # faulted in once, as an arena block is
    nbytes = out.numel() * out.element_size()
    place_b = image._place_b
    variants = [("the read", {}, None), ("without the finite check", {"verified": True}, None),
                ("without the finite check and the lora_B transposes", {"verified": True}, lambda *a: None)]
    before = sys.getswitchinterval()
    sys.setswitchinterval(args.switch_interval)
    rows = []
    try:
        for label, kw, placer in variants:
            image._place_b = placer or place_b
            try:
                def read(kw=kw) -> None:
                    image.read_image(path, cfg, pool, name="probe", out=out, **kw)

                alone, beside = timed_reads(read, args.reads, False), timed_reads(read, args.reads, True)
            finally:
                image._place_b = place_b
            rows.append({"variant": label, "alone_ms": 1e3 * alone, "beside_busy_ms": 1e3 * beside,
                         "slowdown": beside / alone, "alone_gbps": nbytes / alone / 1e9,
                         "beside_busy_gbps": nbytes / beside / 1e9})
            print(f"{label:<52} alone {1e3 * alone:7.1f} ms ({nbytes / alone / 1e9:5.2f} GB/s), beside a busy Python "
                  f"thread {1e3 * beside:7.1f} ms ({nbytes / beside / 1e9:5.2f} GB/s): {beside / alone:.1f}x", flush=True)
    finally:
        sys.setswitchinterval(before)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"shape": args.shape, "rank": args.rank, "targets": args.targets,
                                         "image_bytes": nbytes, "switch_interval_s": args.switch_interval,
                                         "torch": torch.__version__, "rows": rows}, indent=1))
    return rows


if __name__ == "__main__":
    main()
