"""Helpers shared by the engine benchmarks (``bench_adapter_throughput.py``, ``bench_generate.py``, ``bench_serving.py``,
``profile_decode.py``).

The scripts run as ``python bench/<script>.py``, so ``bench/`` is on ``sys.path`` and ``import _common`` works.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from multilora.runtime.adapters import save_peft_adapter
from multilora.config import TARGET_MODULES, ModelConfig


def adapter_bytes(config: ModelConfig, rank: int, dtype: torch.dtype) -> int:
    """Bytes of one rank-``rank`` adapter on all seven projections of every layer: A [r, d_in] + B [d_out, r] each."""
    per_layer = rank * sum(sum(config.module_shape(m)) for m in TARGET_MODULES)
    return per_layer * config.num_layers * torch.empty((), dtype=dtype).element_size()


def write_adapter(d: Path, config: ModelConfig, seed: int, rank: int, dtype: torch.dtype,
                  modules: tuple[str, ...] = TARGET_MODULES) -> Path:
    """A seeded random PEFT adapter in ``d`` (kept if already there): rank ``rank`` on ``modules`` (default all
    seven projections), A ~ N(0, 1/d_in), B ~ N(0, 0.01^2), lora_alpha = 2 r."""
    if (d / "adapter_config.json").is_file():
        return d
    g = torch.Generator().manual_seed(seed)
    t = {}
    for layer in range(config.num_layers):
        for m in modules:
            d_in, d_out = config.module_shape(m)
            t[(layer, m)] = ((torch.randn(rank, d_in, generator=g) / d_in**0.5).to(dtype),
                             (torch.randn(d_out, rank, generator=g) * 0.01).to(dtype))
    return save_peft_adapter(d, t, r=rank, lora_alpha=2 * rank, target_modules=list(modules))


def write_adapters(root: Path, config: ModelConfig, n: int, rank: int, dtype: torch.dtype,
                   threads: int = 1) -> list[Path]:
    """Adapters ``root/a0`` .. ``root/a{n-1}`` (adapter i seeded with i; existing directories are kept).

    Raises:
        SystemExit: ``root``'s disk cannot hold them (more than 90% of its free space).
    """
    per = adapter_bytes(config, rank, dtype)
    free = shutil.disk_usage(root).free
    if per * n > 0.9 * free:
        raise SystemExit(f"--adapter-dir {root}: {n} adapters need {per * n / 1e9:.1f} GB, {free / 1e9:.1f} GB free")
    with ThreadPoolExecutor(max(1, threads)) as ex:  # torch.randn and the file writes release the GIL
        return list(ex.map(lambda i: write_adapter(root / f"a{i}", config, i, rank, dtype), range(n)))


def add_urgent_read_wait_arg(ap) -> None:
    """``--urgent-read-wait on|off`` on the argparse parser ``ap``: the A/B switch of
    ``runtime.scheduler.URGENT_READ_WAIT`` (``set_urgent_read_wait`` applies it)."""
    ap.add_argument("--urgent-read-wait", choices=("on", "off"), default="on",
                    help="runtime.scheduler.URGENT_READ_WAIT: an urgent request whose adapter is being read waits for "
                         "the read outside the steps (on, since session 29) or is admitted into a step that waits "
                         "for it (off: what ran before); recorded in the results")


def set_urgent_read_wait(value: str) -> bool:
    """Sets ``runtime.scheduler.URGENT_READ_WAIT`` from ``--urgent-read-wait``'s ``value`` ("on" / "off"); returns the
    value it had before."""
    from multilora.runtime import scheduler

    before, scheduler.URGENT_READ_WAIT = scheduler.URGENT_READ_WAIT, value == "on"
    return before


def _piece_bytes(text: str) -> int:
    """``--pipe-piece-bytes``'s argparse type: 0 (off) or a positive number of bytes."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected 0 (off) or a positive number of bytes, got {text!r}")
    return value


def add_pipe_piece_bytes_arg(ap) -> None:
    """``--pipe-piece-bytes N`` on the argparse parser ``ap``: the A/B switch of
    ``runtime.adapters.image.PIPELINE_PIECE_BYTES`` (``set_pipe_piece_bytes`` applies it)."""
    ap.add_argument("--pipe-piece-bytes", type=_piece_bytes, default=None, metavar="BYTES",
                    help="runtime.adapters.image.PIPELINE_PIECE_BYTES: the disk -> host read's host finish pipelined "
                         "under the read in pieces of this many bytes (session 37); 0: the finish after the whole "
                         "read (default: the module's); recorded in the results")


def set_pipe_piece_bytes(value: int | None) -> int:
    """Sets ``runtime.adapters.image.PIPELINE_PIECE_BYTES`` from ``--pipe-piece-bytes``'s ``value`` (None: leaves
    it; the argument's type refused negative values); returns the value it had before."""
    from multilora.runtime.adapters import image

    before = image.PIPELINE_PIECE_BYTES
    if value is not None:
        image.PIPELINE_PIECE_BYTES = value
    return before


def add_parallel_finish_arg(ap) -> None:
    """``--parallel-finish on|off`` on the argparse parser ``ap``: the A/B switch of
    ``runtime.adapters.image.PARALLEL_FINISH`` (``set_parallel_finish`` applies it)."""
    ap.add_argument("--parallel-finish", choices=("on", "off"), default=None,
                    help="runtime.adapters.image.PARALLEL_FINISH: a read's host finish after the whole read spread "
                         "over the finish threads (session 37; default: the module's); recorded in the results")


def set_parallel_finish(value: str | None) -> bool:
    """Sets ``runtime.adapters.image.PARALLEL_FINISH`` from ``--parallel-finish``'s ``value`` ("on" / "off"; None
    leaves it); returns the value it had before."""
    from multilora.runtime.adapters import image

    before = image.PARALLEL_FINISH
    if value is not None:
        image.PARALLEL_FINISH = value == "on"
    return before


def add_host_arena_prefault_arg(ap) -> None:
    """``--host-arena-prefault on|off`` on the argparse parser ``ap``: the A/B switch of
    ``memory.host_arena.PREFAULT`` (``set_host_arena_prefault`` applies it)."""
    ap.add_argument("--host-arena-prefault", choices=("on", "off"), default=None,
                    help="memory.host_arena.PREFAULT: a new host-arena chunk's pages written before cudaHostRegister "
                         "pins them, outside the driver's lock (session 41; default: the module's); recorded in the "
                         "results")


def set_host_arena_prefault(value: str | None) -> bool:
    """Sets ``memory.host_arena.PREFAULT`` from ``--host-arena-prefault``'s ``value`` ("on" / "off"; None leaves
    it); returns the value it had before."""
    from multilora.memory import host_arena

    before = host_arena.PREFAULT
    if value is not None:
        host_arena.PREFAULT = value == "on"
    return before


def positive_ints(ap, flag: str, text: str, what: str) -> list[int]:
    """``text`` (a flag's comma-separated value) as ints >= 1, or ``ap.error``: "FLAG: expected comma-separated
    WHAT, got 'TEXT'" (exit status 2)."""
    try:
        out = [int(c) for c in text.split(",") if c.strip()]
    except ValueError:
        out = []
    if not out or min(out) < 1:
        ap.error(f"{flag}: expected comma-separated {what}, got {text!r}")
    return out


def at_least(ap, *checks: tuple[str, int | None, int]) -> None:
    """``ap.error`` (exit status 2) for the first ``(flag, value, low)`` whose value is below ``low``: "FLAG: expected
    an integer >= LOW, got VALUE"; a None value (a flag left to its default) passes."""
    for flag, value, low in checks:
        if value is not None and value < low:
            ap.error(f"{flag}: expected an integer >= {low}, got {value}")


def _threads(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = -1
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a number of threads >= 1, got {text!r}")
    return n


def add_torch_threads_arg(ap) -> None:
    """``--torch-threads N`` on the argparse parser ``ap``: ``torch.set_num_threads(N)`` in the bench's process (and
    its children); default torch's (every core). On a small shared CPU machine torch's default oversubscribes the
    cores whenever anything else runs, and CPU step times swing many-fold: 1 gives steadier numbers."""
    ap.add_argument("--torch-threads", type=_threads, default=None, metavar="N",
                    help="torch.set_num_threads(N) (default: torch's, every core; on a small shared CPU machine 1 "
                         "gives steadier CPU timings); recorded in the results")


def set_torch_threads(n: int | None) -> int:
    """Applies ``--torch-threads`` (None: leaves torch's); returns the threads torch now uses."""
    import torch

    if n is not None:
        torch.set_num_threads(n)
    return torch.get_num_threads()


def kernel_times(fn, runs: int = 3, top: int = 12) -> list[dict]:
    """Where ``fn``'s time goes, by kernel: ``fn`` run ``runs`` times under ``torch.profiler``; on a CUDA machine its
    GPU kernels (device time), else its CPU ops (self time). Returns the ``top`` rows, slowest first, each ``{"name",
    "calls_per_run", "us_per_call", "us_per_run"}`` (microseconds), for a bench's ``--profile`` (which kernel of a
    schedule is far from its bandwidth)."""
    from collections import defaultdict

    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    fn()  # (compiles and allocations outside the trace)
    if cuda:
        torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        for _ in range(runs):
            fn()
        if cuda:
            torch.cuda.synchronize()
    times: dict[str, list[float]] = defaultdict(list)
    if cuda:
        for ev in prof.events():
            if ev.device_type == torch.autograd.DeviceType.CUDA:
                times[ev.name].append(ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total)
    else:
        for e in prof.key_averages():
            if e.self_cpu_time_total > 0:
                times[e.key] = [e.self_cpu_time_total / e.count] * e.count
    rows = [{"name": n, "calls_per_run": len(v) / runs, "us_per_call": sum(v) / len(v), "us_per_run": sum(v) / runs}
            for n, v in times.items()]
    return sorted(rows, key=lambda r: -r["us_per_run"])[:top]


def interleaved_rounds(keys: list, rounds: int, measure) -> dict:
    """``measure(key)`` for every key once per round, every other round in reverse order (so a drift of the GPU's
    clocks over the run favours no key, the first timed nor the last); returns key -> its ``rounds`` values in round
    order (``statistics.median`` of them is what the benches report)."""
    values: dict = {k: [] for k in keys}
    for rnd in range(rounds):
        for k in (keys if rnd % 2 == 0 else keys[::-1]):
            values[k].append(measure(k))
    return values


def time_schedules(fns: dict, rounds: int, copies: int, timer, profile: bool = False) -> dict:
    """Times every schedule of ``fns`` (name -> a function running ``copies`` copies of it; one is ``"base"``) with
    ``timer(fn)`` (ms a run) over ``rounds`` interleaved rounds (``interleaved_rounds``). Returns ``us`` (median us a
    copy), ``us_rounds`` (every round's), ``added_us`` (each schedule's median minus base's) and with ``profile``
    ``kernels`` (each schedule's slowest kernels, ``kernel_times``, eager, per copy)."""
    names = list(fns)
    times = interleaved_rounds(names, rounds, lambda name: timer(fns[name]) / copies * 1e3)
    us = {k: statistics.median(v) for k, v in times.items()}
    out = dict(us=us, us_rounds=times, added_us={k: us[k] - us["base"] for k in names if k != "base"})
    if profile:  # (eager, one copy's worth per call: copies per run / copies)
        out["kernels"] = {name: [{**r, "us_per_run": r["us_per_run"] / copies,
                                  "calls_per_run": r["calls_per_run"] / copies}
                                 for r in kernel_times(fns[name])] for name in names}
    return out


def compiles_between(before: dict | None, after: dict) -> dict:
    """Triton compiles between two ``Engine.stats()`` (a timed row's start and end): ``kernel_compiles``,
    ``kernel_compile_seconds`` (None where a side has no count: no JIT hooks, or no ``before``) and
    ``kernel_compile_names`` (the last ones compiled, ``recent_kernel_compiles``). Each compile stalls the step
    thread (~0.3-1.5 s on an H200): nonzero means the warm-up missed a kernel variant and the row's time includes it."""
    out = {k: (after[k] - before[k] if before is not None and after.get(k) is not None and before.get(k) is not None
               else None) for k in ("kernel_compiles", "kernel_compile_seconds")}
    n = out["kernel_compiles"] or 0
    out["kernel_compile_names"] = list(after.get("recent_kernel_compiles") or [])[-n:] if n > 0 else []
    return out


def copy_bandwidth(device: torch.device) -> tuple[float, str]:
    """Bytes read + written per second by a large copy: GB/s and how it was measured."""
    if device.type == "cuda":
        n = 2 << 30
        src = torch.ones(n, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        for _ in range(5):
            dst.copy_(src)
        times = []
        for _ in range(20):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            dst.copy_(src)
            e.record()
            e.synchronize()
            times.append(s.elapsed_time(e) / 1e3)
        del src, dst
        torch.cuda.empty_cache()
        return 2 * n / statistics.median(times) / 1e9, "2 GiB device-to-device copy_, CUDA events, median of 20"
    n = 256 << 20
    src = torch.ones(n // 4, dtype=torch.float32)
    times = []
    for _ in range(6):
        t0 = time.perf_counter()
        src.clone()
        times.append(time.perf_counter() - t0)
    times = times[1:]
    return 2 * n / statistics.median(times) / 1e9, "256 MiB host tensor clone, median of 5"


class ThreadSampler:
    """Where each Python thread is, sampled every ``interval`` seconds from a thread of its own
    (``sys._current_frames``): per thread name, the innermost frames (``function (file:line)``, the ``depth``
    innermost joined by " < ") counted over the samples. A diagnostic for GIL contention (bench/README.md,
    "Session 13"): a thread that waits for the GIL is seen at the call that released it (a torch op, an event query,
    a read), a thread that holds it where it runs. The sampler needs the GIL itself, so it samples only when it gets
    it: its counts are shares of the samples taken, not of the wall time.

        with ThreadSampler() as s:
            ...
        s.report(top=8)   # {thread name: [[frames, share], ...]}
    """

    def __init__(self, interval: float = 0.001, depth: int = 3) -> None:
        self.interval, self.depth = interval, depth
        self.counts: dict[str, dict[str, int]] = {}
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="thread-sampler", daemon=True)

    def _where(self, frame) -> str:
        out = []
        while frame is not None and len(out) < self.depth:
            code = frame.f_code
            out.append(f"{code.co_name} ({Path(code.co_filename).name}:{frame.f_lineno})")
            frame = frame.f_back
        return " < ".join(out)

    def _run(self) -> None:
        me = threading.get_ident()
        while not self._stop.wait(self.interval):
            names = {t.ident: t.name for t in threading.enumerate()}
            for ident, frame in sys._current_frames().items():
                if ident == me:
                    continue
                per = self.counts.setdefault(names.get(ident, str(ident)), {})
                key = self._where(frame)
                per[key] = per.get(key, 0) + 1
            self.samples += 1

    def __enter__(self) -> "ThreadSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def report(self, top: int = 8) -> dict[str, list[list]]:
        """Per thread name (the threads of one pool merged by their name's prefix before the last "_": their shares
        add up, to at most the pool's size), its ``top`` most frequent places with their share of the samples."""
        merged: dict[str, dict[str, int]] = {}
        for name, per in self.counts.items():
            base = name.rsplit("_", 1)[0] if name.startswith(("multilora-", "ThreadPoolExecutor")) else name
            m = merged.setdefault(base, {})
            for k, v in per.items():
                m[k] = m.get(k, 0) + v
        n = max(1, self.samples)
        return {name: [[k, round(v / n, 4)] for k, v in sorted(per.items(), key=lambda kv: -kv[1])[:top]]
                for name, per in merged.items()}


def regular_files(dirs: list[Path]) -> list[Path]:
    """Every regular file under the directories ``dirs`` (symbolic links followed), sorted."""
    out = []
    for d in dirs:
        for parent, _, names in os.walk(d):
            out += [Path(parent, name) for name in names if os.path.isfile(os.path.join(parent, name))]
    return sorted(out)


def drop_page_cache(dirs: list[Path]) -> int:
    """Drops the OS page cache of every regular file under ``dirs``: opens each read-only,
    ``posix_fadvise(POSIX_FADV_DONTNEED)`` over the whole file, closes it; returns the number of files. The kernel
    drops clean pages only (``os.sync()`` first after writing); no root needed. Linux (``os.posix_fadvise``)."""
    paths = regular_files(dirs)
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return len(paths)
