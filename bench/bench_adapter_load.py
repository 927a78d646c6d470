r"""Tier moves of adapter images, ours against the bounds measured beside them, in one run (issue 13, item 4).

disk -> host (files in the page cache):
  ``plain``   a plain sequential read of each whole weight file into a reused buffer (``preadv``): the bound;
  ``ours``    ``read_image(..., raw=True)`` (``runtime/adapters/image.py``) into host-arena blocks, what the adapter
              cache's I/O threads run on a host-tier miss with ``Engine(adapter_finish="device")``: every tensor
              read in file order by scatter reads straight into its place, lora_B untransposed, nothing checked: the
              pool finishes the image on the GPU after the copy (``kernels/image_finish.py``; its cost is in the
              host -> GPU rows); the same files, the same number of threads; ``ours_readahead``: the same with
              the whole-file ``posix_fadvise(WILLNEED)`` before the read (``image.READ_AHEAD = True``; off by
              default until measured on the GPU host); ``ours_split``: the same with each image's reads split
              over ``SPLIT_THREADS`` threads (``image.SPLIT_READ_THREADS``; off by default, session 34);
  ``ours_host_finish``  ``read_image`` without ``raw`` (the I/O threads' work with the default
              ``adapter_finish="host"``): lora_B transposed on the host, the whole image checked finite at the end when the files
              are in the pool dtype, the tensors read in file order by scatter reads (``ours_host_finish_split``: split
              as ``ours_split``; ``ours_host_finish_pipe``: each piece of ``--pipe-piece-bytes`` finished on a
              finish thread while the next is read, ``image.PIPELINE_PIECE_BYTES``, for reads from the disk
              (``image.PIPELINE_COLD_ONLY``); ``ours_host_finish_serial``: the finish after the whole read, whatever
              the default; ``ours_host_finish_parallel``: the finish after the read spread over the finish threads,
              ``image.PARALLEL_FINISH``, where the file is in the page cache); ``ours_per_tensor``: that with each
              tensor read and checked while in cache instead (before session 8); ``ours_tensor_reads``: the whole-
              image check with one read per tensor (the scatter reads' A/B); ``ours_verified``: the same for a file version the cache has read before (its
              reloads after an eviction), which skips the finite checks;
  ``cache``   the adapter cache itself (its reloads raw on a CUDA pool, as with ``adapter_finish="device"``):
              ``prefetch`` of every adapter from the disk tier on its 4 I/O threads, the
              files' fingerprints checked before and after each read; its ``stats()`` ``disk_to_host_gbps`` (per
              reader) beside the wall-clock rate;
  ``general`` (``--general``) the general path, ``read_packed_adapter`` into a fresh image (the reload before).
host -> GPU (CUDA only):
  ``raw``     one ``copy_(non_blocking=True)`` per image from pinned memory (a torch pinned tensor and the arena's
              blocks) into a device buffer on a side stream, timed with CUDA events: the bound;
  ``ours``    the cache's ``prefetch`` of every adapter from the host tier into the pool, each load timed with CUDA
              events (``stats()`` ``host_to_gpu_gbps``), and the wall time from the first copy queued to the last
              landed; the host copies are raw images (since session 12), and since session 13 the cache copies
              each in one copy and defers its in-place finish to the step boundary (``AdapterPool.finish_pending``,
              on the compute stream; timed by ``finish_under_compute.py``), so these rows are the copies;
              ``ours_host_finished``: the same
              adapters' host-finished images (one ``cudaMemcpyAsync`` each, as before), the A/B of one run;
  ``ours_under_gemm`` the same while the compute stream runs a bf16 GEMM loop: the copies' GB/s and the GEMMs'
              slowdown (and ``ours_host_finished_under_gemm``).

``--cold`` drops the files' page cache before every timed disk -> host run (and before the ``cache`` row), so those
rows read the disk (issue 13's item 4 compares the reads with a plain read of the same files from the disk);
``--modules q_proj,k_proj,v_proj,o_proj`` writes adapters of issue 13's S1 / S4 kind.

Goals (issue 13): disk -> host >= 70% of ``plain``; host -> GPU >= 80% of ``raw``. GB = 1e9 bytes; every rate
counts the same bytes: the weight files' for disk -> host, the images' for host -> GPU (equal for Llama shapes,
whose modules fill whole pages). Results: ``--out``/``adapter_moves_<shape>.json`` (one object per measurement,
with the device, versions and shapes) and a table on stdout.

    python bench/bench_adapter_load.py --out bench/results                  # H200: Llama-3-8B r=16 bf16, ~1 min
    python bench/bench_adapter_load.py --shape tiny --adapters 4 --threads 1  # CPU smoke run
    python bench/bench_adapter_load.py --file-dtype float32 --general        # a converting read; the old path too
    python bench/bench_adapter_load.py --cold --modules q_proj,k_proj,v_proj,o_proj --rank 32 --adapters 16
                                                                             # S4-like files from the disk
    python bench/bench_adapter_load.py --cold --modules q_proj,k_proj,v_proj,o_proj --rank 32 --adapters 12 \
        --providers plain,ours,ours_readahead --threads 1,2,4 --runs 7 --no-cache-row   # the read-ahead A/B only
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from multilora.config import TARGET_MODULES, ModelConfig
from multilora.memory.host_arena import HostArena
from multilora.memory.pool import AdapterPool, host_footprint
from multilora.runtime.adapter_cache import AdapterCache
from multilora.runtime.adapters import read_packed_adapter
from multilora.runtime.adapters.disk import OpenFile
from multilora.runtime.adapters import image
from multilora.runtime.adapters.image import read_image
from multilora.runtime.adapters.load import load_peft_adapter
from multilora.runtime.weights import MODEL_SHAPES

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/_common.py, also under ``python -P``
from _common import at_least, drop_page_cache, write_adapter  # noqa: E402

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
WEIGHTS = "adapter_model.safetensors"
#: the disk -> host rows (module docstring), in their order
DISK_PROVIDERS = ("plain", "ours", "ours_readahead", "ours_split", "ours_host_finish", "ours_host_finish_split",
                  "ours_host_finish_pipe", "ours_host_finish_serial", "ours_host_finish_parallel", "ours_per_tensor",
                  "ours_tensor_reads",
                  "ours_verified")
#: the split reads' threads per image in the ``*_split`` rows (``image.SPLIT_READ_THREADS``)
SPLIT_THREADS = 4


def _parallel(threads: int, jobs: list, fn) -> float:
    """Run ``fn(job, worker)`` for every job on ``threads`` threads (job i on worker i % threads); wall seconds."""
    per = [jobs[w::threads] for w in range(threads)]
    with ThreadPoolExecutor(threads) as ex:
        t0 = time.perf_counter()
        list(ex.map(lambda w: [fn(j, w) for j in per[w]], range(threads)))
        return time.perf_counter() - t0


def disk_to_host(args, config, pool, dirs, file_bytes, threads) -> list[dict]:
    rows = []
    image_bytes = pool.bytes_needed(load_peft_adapter(dirs[0], config, header_only=True))
    arena = HostArena(None, pinned=pool.device.type == "cuda", unit=pool.page_bytes,
                      chunk_bytes=max(1 << 30, image_bytes), granule=image_bytes)
    blocks = [arena.alloc(image_bytes) for _ in range(max(threads))]  # one per worker, reused: the cache reuses
    total = sum(file_bytes)
    bufs = [torch.empty(max(file_bytes), dtype=torch.uint8) for _ in range(max(threads))]

    def plain(i, w):
        with OpenFile(dirs[i] / WEIGHTS) as f:
            f.read_into(memoryview(bufs[w].numpy())[: f.size], 0)
            f.check_unchanged()

    def ours(i, w):
        read_image(dirs[i], config, pool, name=f"a{i}", out=blocks[w].view(pool.dtype), raw=True)

    def ours_host_finish(i, w):
        read_image(dirs[i], config, pool, name=f"a{i}", out=blocks[w].view(pool.dtype))

    def switched(switch: str, value, read):
        """``read`` run with one of read_image's A/B switches set to ``value``: ``timed`` sets it once for the whole
        run, around all threads, and puts it back after (set inside each job, a job starting while another had it
        set would put back the set value)."""
        def run(i, w):
            read(i, w)
        run.switch = (switch, value)
        return run

    # each tensor checked while in cache (before the whole-image check); one read per tensor instead of the scatter
    # reads (before session 8); the whole-file advice before the read (session 32, off by default)
    ours_per_tensor = switched("_DEFER_CHECK", False, ours_host_finish)
    ours_tensor_reads = switched("_SCATTER", False, ours_host_finish)
    ours_readahead = switched("READ_AHEAD", True, ours)
    ours_split = switched("SPLIT_READ_THREADS", SPLIT_THREADS, ours)  # (session 34, off by default)
    ours_host_finish_split = switched("SPLIT_READ_THREADS", SPLIT_THREADS, ours_host_finish)
    # the host finish pipelined under the read in pieces of --pipe-piece-bytes, and serial (session 37)
    ours_host_finish_pipe = switched("PIPELINE_PIECE_BYTES", args.pipe_piece_bytes, ours_host_finish)
    ours_host_finish_serial = switched("PIPELINE_PIECE_BYTES", 0, ours_host_finish)
    ours_host_finish_parallel = switched("PARALLEL_FINISH", True, ours_host_finish)  # (the finish after the read)

    def timed(nt: int, fn) -> float:  # GB/s of one run (--cold: the files' page cache dropped first, untimed)
        if args.cold:
            drop_page_cache(dirs)
        switch, value = getattr(fn, "switch", (None, None))
        was = getattr(image, switch) if switch else None
        if switch:
            setattr(image, switch, value)
        try:
            return total / _parallel(nt, jobs, fn) / 1e9
        finally:
            if switch:
                setattr(image, switch, was)

    def ours_verified(i, w):  # a re-read of a file version the cache has read before: no finite checks
        read_image(dirs[i], config, pool, name=f"a{i}", out=blocks[w].view(pool.dtype), verified=True)

    def general(i, w):
        read_packed_adapter(dirs[i], config, pool, name=f"a{i}")

    jobs = list(range(len(dirs)))
    fns = {"plain": plain, "ours": ours, "ours_readahead": ours_readahead, "ours_split": ours_split,
           "ours_host_finish": ours_host_finish, "ours_host_finish_split": ours_host_finish_split,
           "ours_host_finish_pipe": ours_host_finish_pipe, "ours_host_finish_serial": ours_host_finish_serial,
           "ours_host_finish_parallel": ours_host_finish_parallel,
           "ours_per_tensor": ours_per_tensor, "ours_tensor_reads": ours_tensor_reads, "ours_verified": ours_verified,
           "general": general}
    names = DISK_PROVIDERS + (("general",) if args.general else ())  # (in DISK_PROVIDERS' order)
    providers = tuple((n, fns[n]) for n in names if args.providers is None or n in args.providers)
    for fn in (plain, ours):  # warm-up: page cache, scratch buffers, first-touch of the blocks and buffers
        _parallel(max(threads), jobs, fn)
    for nt in threads:
        rates: dict[str, list[float]] = {name: [] for name, _ in providers}
        pipes = {name: {"pipelined": 0, "cached_serial": 0} for name, _ in providers}  # the pipelined finish's calls
        for _ in range(args.runs):  # interleaved, so drift hits both alike
            for name, fn in providers:
                before = image.pipeline_counts()
                rates[name].append(timed(nt, fn))
                for k, v in image.pipeline_counts().items():
                    pipes[name][k] += v - before[k]
        med = {k: statistics.median(v) for k, v in rates.items() if v}
        for name, gbps in med.items():
            rows.append({"move": "disk_to_host", "provider": name, "threads": nt, "gbps": gbps,
                         "runs_gbps": rates[name], "bytes_per_run": total,
                         "vs_plain": gbps / med["plain"] if "plain" in med else None,
                         "reads_pipelined": pipes[name]["pipelined"],
                         "reads_cached_serial": pipes[name]["cached_serial"]})
        print(f"# disk_to_host, {nt} thread(s), GB/s medians of {args.runs}: "
              + ", ".join(f"{k} {v:.2f}" for k, v in med.items()), flush=True)  # (kept if a time limit stops the run)
    return rows


def through_cache(args, config, pool, dirs, image_bytes, file_bytes) -> tuple[list[dict], AdapterCache]:
    """The adapter cache: every adapter read from the disk tier by prefetch (I/O threads), then (CUDA) copied to
    the pool by prefetch (side stream), alone and under a GEMM loop."""
    n = len(dirs)

    def reload(handle, out):  # as the engine's: raw on a CUDA pool (finished by the pool on the GPU)
        return read_image(handle.path, config, pool, name=handle.name, out=out, verified=handle.values_checked,
                          raw=pool.device.type == "cuda")[1]

    # an unbounded host tier: every adapter must get its host copy (a budget of n images could leave the last one no
    # room, the arena's chunks holding whole images only, and the loop below waiting for it forever)
    cache = AdapterCache(pool, host_bytes=None, reload=reload)
    meta = load_peft_adapter(dirs[0], config, header_only=True)
    handles = [cache.add(f"a{i}", None, path=d, allow_pickle=False, summary="", max_rank=meta.max_rank,
                         pool_bytes=image_bytes) for i, d in enumerate(dirs)]
    rows = []
    if args.cold:
        drop_page_cache(dirs)
    t0 = time.perf_counter()
    while any(h.host is None for h in handles):  # reads on the I/O threads; the pool is full: no GPU copies yet
        cache.prefetch([h for h in handles if h.host is None], wanted=set())
        time.sleep(0.001)
        if time.perf_counter() - t0 > 120 + n:
            cache.close()
            raise SystemExit(f"the cache row: {sum(h.host is None for h in handles)} of {n} adapters still have no "
                             f"host copy after {time.perf_counter() - t0:.0f} s (stats: {cache.report()})")
    wall = time.perf_counter() - t0
    s = cache.report()
    rows.append({"move": "disk_to_host", "provider": "cache", "threads": 4, "gbps": sum(file_bytes) / wall / 1e9,
                 "bytes_per_run": sum(file_bytes), "stats_disk_to_host_gbps": s["disk_to_host_gbps"],
                 "stats_disk_to_host_seconds": s["disk_to_host_seconds"], "stats_bytes_disk_to_host": s["bytes_disk_to_host"]})
    return rows, cache


def host_to_gpu(args, cache: AdapterCache, image_bytes) -> list[dict]:
    pool = cache.pool
    handles = cache.handles()
    n = len(handles)
    side = torch.cuda.Stream()
    dst = torch.empty(image_bytes, dtype=torch.uint8, device=pool.device)
    pinned = torch.empty(image_bytes, dtype=torch.uint8, pin_memory=True)

    def raw(sources) -> float:
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        with torch.cuda.stream(side):
            begin.record(side)
            for src in sources:
                dst.copy_(src, non_blocking=True)
            end.record(side)
        end.synchronize()
        return len(sources) * image_bytes / (begin.elapsed_time(end) / 1e3) / 1e9

    arena_views = [h.host.block.bytes() for h in handles]
    raw(arena_views)  # warm-up
    raw_torch = statistics.median(raw([pinned] * n) for _ in range(args.runs))
    raw_arena = statistics.median(raw(arena_views) for _ in range(args.runs))
    rows = [{"move": "host_to_gpu", "provider": "raw_torch_pinned", "gbps": raw_torch, "bytes_per_run": n * image_bytes,
             "pinned_bytes_torch_would_hold": host_footprint(image_bytes, True)},
            {"move": "host_to_gpu", "provider": "raw_arena", "gbps": raw_arena, "bytes_per_run": n * image_bytes,
             "vs_raw": raw_arena / raw_torch}]

    def evict_all():  # (the cache has no public eviction call: its lock and its own eviction step)
        with cache._lock:
            for h in list(handles):
                if h.slot is not None:
                    cache._drop_from_pool(h)
        torch.cuda.synchronize()

    def ours(compute=None) -> tuple[float, float, float | None]:
        evict_all()
        before = cache.report()
        gemm_s = None
        t0 = time.perf_counter()
        if compute is not None:
            gemm_s = compute()  # queued on the compute stream, not waited for
        cache.prefetch(handles, wanted=set())
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        after = cache.report()
        timed = after["host_to_gpu_timed_bytes"] - before["host_to_gpu_timed_bytes"]
        secs = after["host_to_gpu_seconds"] - before["host_to_gpu_seconds"]
        assert after["host_to_gpu_copies"] - before["host_to_gpu_copies"] == n, "every adapter copied once"
        return timed / secs / 1e9, n * image_bytes / wall / 1e9, gemm_s

    def finished_images(on: bool) -> None:
        """The host copies as host-finished images (one copy per image, as before session 12) or raw again."""
        for h in handles:
            cfg = cache.pool.config
            read_image(h.path, cfg, pool, name=h.name, out=h.host.data, raw=not on)
            h.host.finish = None if on else h.host.finish or raw_finish
            h.host.checked = True

    raw_finish = handles[0].host.finish
    ours()  # warm-up
    runs = [ours() for _ in range(args.runs)]
    ev_gbps = statistics.median(r[0] for r in runs)
    rows.append({"move": "host_to_gpu", "provider": "ours", "gbps": ev_gbps,
                 "wall_gbps": statistics.median(r[1] for r in runs), "bytes_per_run": n * image_bytes,
                 "vs_raw": ev_gbps / raw_torch, "copies_per_run": n, "raw_images": raw_finish is not None})
    if raw_finish is not None:  # the A/B: the same loads of host-finished images (one plain copy each)
        finished_images(True)
        runs = [ours() for _ in range(args.runs)]
        g = statistics.median(r[0] for r in runs)
        rows.append({"move": "host_to_gpu", "provider": "ours_host_finished", "gbps": g,
                     "wall_gbps": statistics.median(r[1] for r in runs), "bytes_per_run": n * image_bytes,
                     "vs_raw": g / raw_torch, "copies_per_run": n})
        finished_images(False)

    a = torch.randn(8192, 8192, device=pool.device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=pool.device, dtype=torch.bfloat16)
    reps = max(1, int(args.gemm_ms / 1.2))  # ~1.2 ms per 8192^3 bf16 GEMM on an H200

    def gemms():
        for _ in range(reps):
            a @ b

    def timed_gemms() -> float:
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        gemms()
        end.record()
        timed_gemms.events = (begin, end)
        return 0.0

    gemms()
    torch.cuda.synchronize()
    alone = []
    for _ in range(args.runs):
        timed_gemms()
        torch.cuda.synchronize()
        alone.append(timed_gemms.events[0].elapsed_time(timed_gemms.events[1]))
    over = []
    for _ in range(args.runs):
        g, w, _ = ours(timed_gemms)
        over.append((g, w, timed_gemms.events[0].elapsed_time(timed_gemms.events[1])))
    rows.append({"move": "host_to_gpu", "provider": "ours_under_gemm", "gbps": statistics.median(o[0] for o in over),
                 "bytes_per_run": n * image_bytes,
                 "vs_raw": statistics.median(o[0] for o in over) / raw_torch,
                 "gemm_ms_alone": statistics.median(alone), "gemm_ms_with_copies": statistics.median(o[2] for o in over)})
    if raw_finish is not None:
        finished_images(True)
        over = []
        for _ in range(args.runs):
            g, w, _ = ours(timed_gemms)
            over.append((g, w, timed_gemms.events[0].elapsed_time(timed_gemms.events[1])))
        rows.append({"move": "host_to_gpu", "provider": "ours_host_finished_under_gemm",
                     "gbps": statistics.median(o[0] for o in over), "bytes_per_run": n * image_bytes,
                     "vs_raw": statistics.median(o[0] for o in over) / raw_torch,
                     "gemm_ms_alone": statistics.median(alone),
                     "gemm_ms_with_copies": statistics.median(o[2] for o in over)})
        finished_images(False)
    return rows


def main(argv: list[str] | None = None) -> int:
    first, _, rest = __doc__.partition("\n\n")  # (the first paragraph once, as the description)
    ap = argparse.ArgumentParser(description=first, formatter_class=argparse.RawDescriptionHelpFormatter, epilog=rest)
    ap.add_argument("--shape", default="llama3-8b", choices=sorted(MODEL_SHAPES))
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--adapters", type=int, default=8, help="distinct adapter files (84 MB each for the default)")
    ap.add_argument("--file-dtype", default="bfloat16", choices=sorted(DTYPES))
    ap.add_argument("--pool-dtype", default="bfloat16", choices=sorted(DTYPES))
    ap.add_argument("--threads", default="1,4", help="comma list of reader threads (the cache uses 4)")
    ap.add_argument("--torch-threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    ap.add_argument("--runs", type=int, default=3, help="repetitions; medians are reported")
    ap.add_argument("--general", action="store_true", help="also time read_packed_adapter (the reload before)")
    ap.add_argument("--pipe-piece-bytes", type=int, default=4 << 20,
                    help="the ours_host_finish_pipe row's pieces (image.PIPELINE_PIECE_BYTES; default 4 MiB)")
    ap.add_argument("--providers", default=None,
                    help="comma list of the disk -> host rows to time (default all: " + ", ".join(DISK_PROVIDERS)
                         + "; ``general`` also with --general), e.g. plain,ours,ours_readahead for the read-ahead A/B "
                         "with more --runs in the same time")
    ap.add_argument("--no-cache-row", action="store_true",
                    help="skip the adapter cache's disk -> host row (and so the host -> GPU rows, which copy its images)")
    ap.add_argument("--cold", action="store_true",
                    help="disk -> host rows from the disk: the files' page cache dropped before every timed run "
                         "(posix_fadvise DONTNEED, Linux; default: the files in the page cache)")
    ap.add_argument("--modules", default=",".join(TARGET_MODULES),
                    help="comma list of the adapters' target modules (default all seven; issue 13's S1 / S4 sets: "
                         "q_proj,k_proj,v_proj,o_proj)")
    ap.add_argument("--gemm-ms", type=float, default=300.0, help="length of the compute loop of the overlap run")
    ap.add_argument("--pool-device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--adapter-dir", type=Path, default=Path(tempfile.gettempdir()) / "multilora-bench-adapter-load")
    ap.add_argument("--out", type=Path, default=None, help="directory for adapter_moves_<shape>.json")
    args = ap.parse_args(argv)
    modules = tuple(m for m in args.modules.split(",") if m)
    if not modules or any(m not in TARGET_MODULES for m in modules):
        ap.error(f"--modules: expected a comma list of {', '.join(TARGET_MODULES)}, got {args.modules!r}")
    if args.providers is not None:
        args.providers = tuple(p for p in args.providers.split(",") if p)
        known = DISK_PROVIDERS + ("general",)
        bad = [p for p in args.providers if p not in known]
        if bad or not args.providers:
            ap.error(f"--providers: expected a comma list of {', '.join(known)}, got {','.join(args.providers)!r}")
        if "general" in args.providers and not args.general:
            args.general = True
    if args.cold and not hasattr(os, "posix_fadvise"):
        ap.error("--cold: needs os.posix_fadvise (Linux) to drop the files' page cache")
    if args.pipe_piece_bytes < 1:
        ap.error(f"--pipe-piece-bytes: expected a positive number of bytes, got {args.pipe_piece_bytes}")
    at_least(ap, ("--rank", args.rank, 1), ("--adapters", args.adapters, 1), ("--runs", args.runs, 1))
    if args.torch_threads is not None and args.torch_threads < 0:
        ap.error(f"--torch-threads: expected an integer >= 1 (0: torch's default), got {args.torch_threads}")
    try:
        threads = [int(t) for t in args.threads.split(",") if t.strip()]
    except ValueError:
        threads = []
    if not threads or min(threads) < 1:
        ap.error(f"--threads: expected a comma list of reader thread counts >= 1, got {args.threads!r}")
    try:
        dev = torch.device(args.pool_device)
    except (RuntimeError, ValueError) as e:
        ap.error(f"--pool-device: expected a torch device (cpu, cuda, cuda:1), got {args.pool_device!r}: {e}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        ap.error(f"--pool-device: {args.pool_device!r} needs a CUDA GPU, and torch sees none")
    if args.out is not None:
        try:  # before any work: a run whose results cannot be written is lost
            args.out.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            ap.error(f"--out: cannot make the directory {str(args.out)!r}: {e.strerror or e}")

    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    config = ModelConfig(**MODEL_SHAPES[args.shape])
    fdt, pdt = DTYPES[args.file_dtype], DTYPES[args.pool_dtype]
    tag = "" if modules == TARGET_MODULES else "-" + "-".join(m.split("_")[0] for m in modules)
    dirs = [write_adapter(args.adapter_dir / f"{args.shape}-r{args.rank}-{args.file_dtype}{tag}-{i}", config, i,
                          args.rank, fdt, modules) for i in range(args.adapters)]
    if args.cold:
        os.sync()  # (the page cache drops clean pages only: the files just written must reach the disk first)
    file_bytes = [(d / WEIGHTS).stat().st_size for d in dirs]
    meta = load_peft_adapter(dirs[0], config, header_only=True)
    probe = AdapterPool(config, num_bytes=1 << 20, max_rank=args.rank, dtype=pdt, device="meta")
    image_bytes = probe.bytes_needed(meta)
    # the pool holds every adapter: the host -> GPU runs copy all of them with no eviction in between
    pool = AdapterPool(config, num_bytes=args.adapters * image_bytes, max_rank=args.rank, max_slots=args.adapters,
                       dtype=pdt, device=args.pool_device)
    head = {"device": torch.cuda.get_device_name() if pool.device.type == "cuda" else platform.processor() or "cpu",
            "torch": torch.__version__, "torch_threads": torch.get_num_threads(), "cpus": os.cpu_count(),
            "shape": args.shape, "rank": args.rank, "file_dtype": args.file_dtype, "pool_dtype": args.pool_dtype,
            "adapters": args.adapters, "file_bytes": file_bytes[0], "image_bytes": image_bytes,
            "modules": list(modules), "read_ahead": image.READ_AHEAD, "split_read_threads": image.SPLIT_READ_THREADS,
            "split_threads_of_split_rows": SPLIT_THREADS, "pipeline_piece_bytes": image.PIPELINE_PIECE_BYTES,
            "pipe_piece_bytes_of_pipe_row": args.pipe_piece_bytes, "cold": args.cold}
    print(f"# {head}", flush=True)
    pool.warm_finish()  # the raw images' finish kernel (CUDA), compiled outside the timed rows
    rows = disk_to_host(args, config, pool, dirs, file_bytes, threads)
    if not args.no_cache_row:
        cache_rows, cache = through_cache(args, config, pool, dirs, image_bytes, file_bytes)
        plain4 = next((r["gbps"] for r in rows if r["provider"] == "plain" and r["threads"] == 4), None)
        for r in cache_rows:
            r["vs_plain"] = r["gbps"] / plain4 if plain4 else None
        rows += cache_rows
        if pool.device.type == "cuda":
            rows += host_to_gpu(args, cache, image_bytes)
        cache.close()
    rows = [{**head, **r} for r in rows]
    for r in rows:
        extra = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()
                 if k not in head and k not in ("move", "provider", "gbps", "runs_gbps")}
        print(f"{r['move']:13s} {r['provider']:17s} {r['gbps']:7.2f} GB/s  {extra}", flush=True)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / f"adapter_moves_{args.shape}.json"
        path.write_text(json.dumps(rows, indent=1))
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
