"""How much a disk -> host adapter read slows down beside a Python thread that wants the GIL (issue 13).

The adapter cache reads adapters on I/O threads (``runtime.adapters.image.read_image``: scatter reads, lora_B
transposed into the image by numpy, a finite check of the whole image) while the engine's step thread runs Python
(scheduling, launches) between its waits for the GPU. Every numpy call and read of the I/O thread releases the GIL and
must take it back, and a thread that holds the GIL gives it up only at the interpreter's switch interval (the engine
sets 0.5 ms, ``EngineConfig.gil_switch_interval``). This times one adapter's read into a pre-faulted image (as into
an arena block) alone and beside a thread that runs Python without pause (the worst case of a step thread), and the
same with parts of the read left out, to show which part pays for the GIL, and the read in ``_SCATTER_BYTES``
groups with one transpose per (layer, module), what ran before session 28 (``image._BATCH_B_BYTES = 0``):

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


def timed_reads(read, reads: int, busy: float, period: float = 0.005) -> float:
    """Seconds per ``read()`` (median of ``reads``) on a thread of its own, beside a thread that runs Python for
    ``busy`` of every ``period`` seconds and sleeps the rest (the GIL free), as a step thread waits for the GPU
    (``busy`` 1: always in Python; 0: no such thread)."""
    stop = threading.Event()

    def spin() -> None:
        x = 0
        while not stop.is_set():
            t = time.perf_counter()
            while time.perf_counter() - t < busy * period:
                x += 1
            if busy < 1:
                time.sleep((1 - busy) * period)

    spinner = threading.Thread(target=spin, daemon=True) if busy > 0 else None
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
    ap.add_argument("--busy-fractions", type=lambda v: [float(x) for x in v.split(",") if x],
                    default=[0.2, 0.4, 0.6, 0.8],
                    help="also time both paths beside a thread in Python this share of every 5 ms (comma list)")
    ap.add_argument("--check-chunks", type=lambda v: [int(float(x) * (1 << 20)) for x in v.split(",") if x],
                    default=[], metavar="M,...",
                    help="also time the read with its finite check in chunks of M Mi elements (image._CHECK_CHUNK; "
                    "the default's is %d Mi): fewer numpy calls, each giving the GIL up" % (image._CHECK_CHUNK >> 20))
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
    # (image._BATCH_B_BYTES: 0 reads in groups of _SCATTER_BYTES with one transpose per (layer, module), what ran
    # before session 28's batched path; the last two rows take the groups too, to show what each part costs there)
    variants = [("the read", {}, None, image._BATCH_B_BYTES),
                *[(f"the read, finite check in chunks of {c / (1 << 20):g}M elements", {"check_chunk": c}, None,
                   image._BATCH_B_BYTES) for c in args.check_chunks],
                ("the read without the finite check", {"verified": True}, None, image._BATCH_B_BYTES),
                ("the read in 1 MiB groups (before session 28)", {}, None, 0),
                ("groups, without the finite check", {"verified": True}, None, 0),
                ("groups, without the finite check and the lora_B transposes", {"verified": True}, lambda *a: None, 0)]
    before = sys.getswitchinterval()
    sys.setswitchinterval(args.switch_interval)
    rows = []
    try:
        batch_bytes = image._BATCH_B_BYTES
        check_chunk = image._CHECK_CHUNK
        for label, kw, placer, batch in variants:
            image._place_b = placer or place_b
            image._BATCH_B_BYTES = batch
            kw = dict(kw)
            image._CHECK_CHUNK = kw.pop("check_chunk", check_chunk)
            try:
                def read(kw=kw) -> None:
                    image.read_image(path, cfg, pool, name="probe", out=out, **kw)

                alone, beside = timed_reads(read, args.reads, 0.0), timed_reads(read, args.reads, 1.0)
            finally:
                image._place_b = place_b
                image._BATCH_B_BYTES = batch_bytes
                image._CHECK_CHUNK = check_chunk
            rows.append({"variant": label, "alone_ms": 1e3 * alone, "beside_busy_ms": 1e3 * beside,
                         "slowdown": beside / alone, "alone_gbps": nbytes / alone / 1e9,
                         "beside_busy_gbps": nbytes / beside / 1e9})
            print(f"{label:<60} alone {1e3 * alone:7.1f} ms ({nbytes / alone / 1e9:5.2f} GB/s), beside a busy Python "
                  f"thread {1e3 * beside:7.1f} ms ({nbytes / beside / 1e9:5.2f} GB/s): {beside / alone:.1f}x",
                  flush=True)
        duty = []  # the two paths beside a thread in Python part of the time
        for frac in args.busy_fractions:
            got = {}
            for label, batch in (("groups", 0), ("batched", batch_bytes)):
                image._BATCH_B_BYTES = batch
                try:
                    got[label] = timed_reads(lambda: image.read_image(path, cfg, pool, name="probe", out=out),
                                             args.reads, frac)
                finally:
                    image._BATCH_B_BYTES = batch_bytes
            duty.append({"busy_fraction": frac, "groups_ms": 1e3 * got["groups"], "batched_ms": 1e3 * got["batched"]})
            print(f"beside a thread in Python {frac:.0%} of every 5 ms: groups {1e3 * got['groups']:6.1f} ms, "
                  f"batched {1e3 * got['batched']:6.1f} ms", flush=True)
    finally:
        sys.setswitchinterval(before)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"shape": args.shape, "rank": args.rank, "targets": args.targets,
                                         "image_bytes": nbytes, "switch_interval_s": args.switch_interval,
                                         "torch": torch.__version__, "rows": rows, "duty": duty}, indent=1))
    return rows


if __name__ == "__main__":
    main()
