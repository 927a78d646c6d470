r"""Serving benchmark: a reproducible trace of requests arriving over time, each naming one of N adapters, served by
the engine in-process (``EngineLoop``, mode ``engine``) or over HTTP by ``multilora serve``'s app in a child process
driven like a load generator (mode ``http``: the engine steps on a thread of the server's process; mode
``http-engine-process``: the engine steps in a process of its own, ``multilora serve --engine-process``). Issue 14
(the HTTP layer's cost) and the start of issue 13.

    python bench/bench_serving.py --shape llama3-8b --adapters 5 --modes engine,http,http-engine-process \
        --out bench/results                                                                                # H200
    python bench/bench_serving.py --shape tiny --adapters 3 --requests 12 --modes engine,http,http-engine-process \
        --warmup-requests 8                                             # CPU smoke run (the default warms with 192)
    python bench/bench_serving.py --adapters 5 --modes engine --rate 4 --long-prompt-share 0.1 --long-prompt-len 4096 \
        --chunked-prefill off --tag llama3-8b-long-off --out bench/results        # then --chunked-prefill on: TPOT p99

The trace (seeded: the same arguments give the same requests, and every row of a run at one rate the same arrivals
and lengths, whatever its N: ``trace_span_s`` and ``trace_digest`` in each row say so): arrivals Poisson at ``--rate`` req/s (or gamma with
coefficient of variation 2, ``--arrival gamma``: burstier), adapter popularity power law with alpha = 1 (``zipf``)
or ``uniform``, input and output lengths uniform in ``--input-len`` / ``--output-len`` (default [8, 512]; every
request runs to its output length: ``ignore_eos``); ``--long-prompt-share`` of the requests (drawn per request)
get a prompt of ``--long-prompt-len`` tokens instead: the long-prompt mix, where an unchunked prefill stops every
running decode (``--chunked-prefill off``) and a chunked one does not (``on``, the engine's default; its step
budget ``--max-num-batched-tokens``). Prompts are random token ids (random-weight models of real
shapes have no tokenizer). Adapter sets: ``S1`` rank 8 on q/k/v/o; ``S4`` ranks 16, 32 and 64 in turn, on q/k/v/o.

``--rate burst`` sends every request at t = 0: the engine runs at its ``--max-batch-size`` and the row's achieved
req/s is its capacity. ``--rate auto`` first measures that capacity with a burst in mode ``engine`` and then offers
``--rate-fraction`` (default 0.9) of it to every mode, so rows compare at one offered rate.

Reported per row (mode ``engine`` also: every step's wall time by kind, ``<kind>_step_ms`` p50 / p99 / max, and
``stall_steps`` / ``stall_seconds``: steps over 5x their kind's median, as from a compile; ``<kind>_phase_ms``:
where the steps' host time went, and ``<kind>_step_ms_by_misses``: steps that copied adapters to the GPU pool
against those that did not, and ``stalls``, the stall steps with their phases; ``StepTrace``; ``ttft_split``: where
the first-token latency went by the engine's own times, submit / queue / prefill for all and for the requests over
the SLO's TTFT, and TTFT per adapter tier at submission; and
``output_tok_s_under_load`` / ``backlog_at_last_arrival``, the row until its last arrival, without the drain:
``under_load``): offered and achieved req/s, output tokens/s, TTFT p50/p90/p99, TPOT p50/p99, end-to-end latency
p50/p99 (all seconds, measured by the client: from the request's scheduled arrival to its first token / last byte),
adapter bytes moved per tier and per second, pool / host-tier hit rates, and the share of requests within an SLO
(issue 13's: TTFT <= 5x and TPOT <= 2x the p50s of the first N's row of the same mode and rate kind). Both modes time the same thing from the
outside (an ``async for`` over the engine's stream in-process; server-sent events over HTTP), so the difference is
the HTTP layer: FastAPI + uvicorn + JSON + SSE, a socket and a second process.

``--drop-page-cache S``: during every timed row a thread drops the OS page cache of the adapter files every S
seconds, so the engine's disk -> host reads come from the disk, not from memory (issue 13's S4: "disk is in play").
The run's ``cold_read_gbps`` (a plain sequential read of the files of up to 8 adapter directories, their cache
dropped first) is the disk's own figure to hold the rows' ``disk_to_host_aggregate_gbps`` (all the engine's readers
together) against; ``disk_to_host_gbps`` is one reader's speed. The periodic sweep can also drop pages the OS has
read ahead for a read still in flight, which that read then fetches again in small pieces: ``--drop-after-read``
(engine mode) instead drops an adapter directory's page cache right after each engine read of it finishes, so every
later read of those files comes from the disk and no read in flight is disturbed (but a read of the same files
running at that moment; S4 draws 2,000 adapters from ``--adapter-files`` directories). Either flag measures the
cold read first.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import functools
import gc
import hashlib
import json
import math
import os
import platform
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from multilora import Engine, SamplingParams
from multilora.config import ModelConfig
from multilora.memory import host_arena as host_arena_mod
from multilora.runtime import scheduler as scheduler_mod
from multilora.runtime.adapters import image as image_mod
from multilora.runtime.adapters import save_peft_adapter
from multilora.runtime.config import EngineConfig, bytes_arg, finish_on_device
from multilora.runtime.weights import MODEL_SHAPES

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (add_host_arena_prefault_arg, set_host_arena_prefault,  # noqa: E402
                     add_parallel_finish_arg, add_pipe_piece_bytes_arg, add_urgent_read_wait_arg,
                     compiles_between, drop_page_cache, regular_files, set_parallel_finish,  # (bench/_common.py)
                     set_pipe_piece_bytes, set_urgent_read_wait, add_torch_threads_arg, set_torch_threads,
                     positive_ints, at_least)

ADAPTER_SETS = {"S1": ((8,), ("q_proj", "k_proj", "v_proj", "o_proj")),
                "S4": ((16, 32, 64), ("q_proj", "k_proj", "v_proj", "o_proj"))}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
MODES = ("engine", "http", "http-engine-process")


# ------------------------------------------------------------------------------------------------ the trace
@dataclass(frozen=True)
class TraceRequest:
    arrival: float  # seconds after the start
    adapter: int  # index into the adapter names
    prompt: list[int]
    output_len: int


#: the arrival gaps' generator is seeded with ``seed + ARRIVAL_SEED_OFFSET`` (``make_trace``): apart from the
#: adapters', lengths' and prompts' generator (seeded with ``seed``), whose draws are unchanged since session 8
ARRIVAL_SEED_OFFSET = 1_000_003


def make_trace(*, n_requests: int, rate: float, arrival: str, popularity: str, n_adapters: int,
               input_len: tuple[int, int], output_len: tuple[int, int], vocab: int, seed: int,
               long_share: float = 0.0, long_len: int = 0) -> list[TraceRequest]:
    """``n_requests`` requests; ``rate`` = inf puts every arrival at 0. Gamma arrivals have shape 1/cv^2 = 0.25
    (cv 2) and the same mean gap 1/rate as Poisson's exponential gaps. A share ``long_share`` of the requests
    (each drawn with that probability) get ``long_len`` prompt tokens instead of ``input_len``'s (the trace of
    ``long_share`` 0 is unchanged)."""
    g = torch.Generator().manual_seed(seed)
    if math.isinf(rate):
        times = [0.0] * n_requests
    else:
        # the gaps from a generator of their own, seeded by ``seed`` alone: every row of a run (and every run) gets
        # the same arrival times at the same rate. Until session 28 they came from torch's global generator, seeded
        # once per process, so each fixed-rate row drew other gaps than the row before: the trace's span, and with
        # it the achieved req/s of a row that keeps up, differed from row to row by chance (about 6%, one sigma, at
        # 256 requests), which compared N = 2,000 with N = 5 on different traces.
        ga = torch.Generator().manual_seed(seed + ARRIVAL_SEED_OFFSET)
        if arrival == "poisson":
            gaps = torch.empty(n_requests, dtype=torch.float64).exponential_(rate, generator=ga)
        else:  # gamma, cv 2: shape k = 1/cv^2, scale = 1/(rate k)
            k = 0.25
            gaps = torch._standard_gamma(torch.full((n_requests,), k, dtype=torch.float64), generator=ga) / (rate * k)
        times = torch.cumsum(gaps, 0).tolist()
        times = [t - times[0] for t in times]
    if popularity == "uniform":
        adapters = torch.randint(0, n_adapters, (n_requests,), generator=g).tolist()
    else:
        w = 1.0 / torch.arange(1, n_adapters + 1, dtype=torch.float64)
        adapters = torch.multinomial(w / w.sum(), n_requests, replacement=True, generator=g).tolist()
    ins = torch.randint(input_len[0], input_len[1] + 1, (n_requests,), generator=g).tolist()
    outs = torch.randint(output_len[0], output_len[1] + 1, (n_requests,), generator=g).tolist()
    if long_share > 0:
        long = (torch.rand(n_requests, generator=g) < long_share).tolist()
        ins = [long_len if is_long else n for n, is_long in zip(ins, long)]
    return [TraceRequest(t, a, torch.randint(0, vocab, (n,), generator=g).tolist(), o)
            for t, a, n, o in zip(times, adapters, ins, outs)]


def trace_facts(trace: list[TraceRequest]) -> dict:
    """What makes rows comparable: ``trace_span_s`` (first to last arrival, seconds) and ``trace_digest`` (a hash of
    the arrival times, prompt lengths and output lengths, not of the adapters, which depend on N): rows with equal
    digests replayed the same arrivals and lengths."""
    h = hashlib.sha256()
    for req in trace:
        h.update(struct.pack("<dii", req.arrival, len(req.prompt), req.output_len))
    span = trace[-1].arrival - trace[0].arrival if trace else 0.0
    return {"trace_span_s": span, "trace_digest": h.hexdigest()[:16]}


# ------------------------------------------------------------------------------------------------ adapters
def write_adapter_set(root: Path, config: ModelConfig, kind: str, n_files: int, dtype: torch.dtype,
                      threads: int | None = None) -> list[Path]:
    """``n_files`` seeded random PEFT adapters of set ``kind`` under ``root`` (kept when already there), written by
    ``threads`` threads (default: up to 8, one per CPU; each file has its own seeded generator, so the files are the
    same whatever the count; ``torch.randn`` and the writes release the GIL)."""
    ranks, modules = ADAPTER_SETS[kind]

    def one(i: int) -> Path:
        d = root / f"{kind}-{i}"
        if (d / "adapter_config.json").is_file():
            return d
        r = ranks[i % len(ranks)]
        g = torch.Generator().manual_seed(i)
        t = {}
        for layer in range(config.num_layers):
            for m in modules:
                d_in, d_out = config.module_shape(m)
                t[(layer, m)] = ((torch.randn(r, d_in, generator=g) / d_in**0.5).to(dtype),
                                 (torch.randn(d_out, r, generator=g) * 0.01).to(dtype))
        save_peft_adapter(d, t, r=r, lora_alpha=2 * r, target_modules=list(modules))
        return d

    workers = max(1, min(n_files, threads or min(8, os.cpu_count() or 1)))
    if workers == 1:
        return [one(i) for i in range(n_files)]
    with ThreadPoolExecutor(workers) as ex:
        return list(ex.map(one, range(n_files)))


# ------------------------------------------------------------------------------------------------ the page cache
def cold_read(dirs: list[Path], buffer_bytes: int = 16 << 20) -> dict:
    """The disk's plain sequential read, the reference for the rows' ``disk_to_host_aggregate_gbps``: the page cache of the
    files under ``dirs`` dropped, each file read whole in turn by one thread (``readinto`` one reusable
    ``buffer_bytes`` buffer), their cache dropped again. ``cold_read_bytes`` and ``cold_read_gbps`` (bytes / s / 1e9)."""
    paths = regular_files(dirs)
    drop_page_cache(dirs)
    view = memoryview(bytearray(buffer_bytes))
    total = 0
    t0 = time.perf_counter()
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while n := f.readinto(view):
                total += n
    seconds = time.perf_counter() - t0
    drop_page_cache(dirs)
    return {"cold_read_bytes": total, "cold_read_gbps": total / seconds / 1e9 if seconds > 0 else None}


class DropAfterRead:
    """``--drop-after-read``: wraps an in-process engine's disk -> host adapter reads (its adapter cache's reload) so
    that each one, when done (also when it failed), has its adapter directory's page cache dropped
    (``drop_page_cache``): every later read of those files comes from the disk. The drop runs on a thread of its own,
    so its time is not counted in the read's (the cache times the reload for ``disk_to_host_gbps`` and the aggregate
    figure). ``reads``: the reads whose drop is done (thread-safe)."""

    def __init__(self, engine: Engine) -> None:
        cache = engine.cache
        real = cache._reload  # (the cache's reload callable: ``reload(handle, out) -> PackedAdapter``)
        lock = threading.Lock()
        self.reads = 0
        self._drops = ThreadPoolExecutor(1, thread_name_prefix="drop-after-read")

        def drop(path: Path) -> None:
            drop_page_cache([path])
            with lock:
                self.reads += 1

        def reload(handle: Any, out: Any = None) -> Any:
            try:
                return real(handle, out)
            finally:
                self._drops.submit(drop, Path(handle.path))

        cache._reload = reload

    def settle(self) -> int:
        """Wait for the drops queued so far; returns ``reads``."""
        self._drops.submit(lambda: None).result()
        return self.reads


class PageCacheDropper:
    """``with PageCacheDropper(dirs, every) as drops``: inside the block (a timed row) a daemon thread drops the page
    cache of every file under ``dirs`` (``drop_page_cache``), sleeps ``every`` seconds, and again, until the block
    ends; ``passes`` counts the drops (at least 1 when on), ``files`` the files of the last. ``every`` 0: off,
    no thread. A drop that fails is raised again at the block's end."""

    def __init__(self, dirs: list[Path], every: float) -> None:
        self.dirs, self.every = dirs, every
        self.passes = self.files = 0
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="page-cache-dropper", daemon=True)

    def _run(self) -> None:
        try:
            while True:
                self.files = drop_page_cache(self.dirs)
                self.passes += 1
                if self._stop.wait(self.every):
                    return
        except BaseException as e:
            self.error = e

    def __enter__(self) -> "PageCacheDropper":
        if self.every > 0:
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        if self.error is not None and exc[0] is None:
            raise RuntimeError(f"--drop-page-cache: dropping the page cache failed: {self.error!r}") from self.error


def longest_request(args: argparse.Namespace) -> int:
    """Tokens of the trace's longest request: its longest prompt + its longest output."""
    return max(args.input_len[1], args.long_prompt_len if args.long_prompt_share > 0 else 0) + args.output_len[1]


def max_seq_len(args: argparse.Namespace, context: int) -> int:
    """The engine's ``max_seq_len``: the longest request and 8 tokens of slack, at most the model's ``context``
    (``parse_args`` refuses a trace whose longest request is past it)."""
    return min(longest_request(args) + 8, context)


def build_engine(args: argparse.Namespace, config: ModelConfig, files: list[Path], n_adapters: int,
                 unified: bool = False) -> Engine:
    """The engine of every row: adapters ``a0 .. a{N-1}`` registered (adapter i from ``files[i % len(files)]``;
    each a distinct adapter to the engine), warmed up on every kernel shape the trace can reach; ``unified``: the
    adapter pool and the KV cache in one buffer (``Engine(unified_pool=True)``) of the same bytes."""
    ranks, _ = ADAPTER_SETS[args.adapter_set]
    max_seq = max_seq_len(args, config.max_position_embeddings)
    engine = Engine(config, device=args.device, dtype=DTYPES[args.dtype], progress=False,
                    max_batch_size=args.max_batch_size, max_seq_len=max_seq, max_lora_rank=max(ranks),
                    adapter_pool_share=args.adapter_pool_share, adapter_pool_bytes=args.adapter_pool_bytes,
                    kv_cache_bytes=args.kv_cache_bytes, unified_pool=unified, adapter_pool_fill=args.adapter_pool_fill,
                    adapter_finish=args.adapter_finish, host_arena_chunk_bytes=args.host_arena_chunk_bytes,
                    enable_chunked_prefill=args.chunked_prefill == "on",
                    max_num_batched_tokens=args.max_num_batched_tokens,
                    piecewise_cuda_graph_max_tokens=args.piecewise_cuda_graph_max_tokens,
                    async_scheduling={"auto": None, "on": True, "off": False}[args.async_scheduling],
                    **({"gil_switch_interval": args.switch_interval} if args.switch_interval else {}),
                    **({} if args.max_prefill_tokens is None else {"max_prefill_tokens": args.max_prefill_tokens}))
    t0 = time.perf_counter()
    for i in tqdm(range(n_adapters), desc=f"N = {n_adapters}: registering adapters", disable=n_adapters < 64,
                  mininterval=2):
        engine.load_adapter(f"a{i}", files[i % len(files)], preload=i < args.preload)
    print(f"N = {n_adapters}: engine built and adapters registered in {time.perf_counter() - t0:.1f} s; warm-up of "
          f"{args.warmup_requests} requests", flush=True)
    if args.engine_warmup:  # the product's warm-up (what `multilora serve` runs), before the bench's own
        w = engine.warmup("a0")
        print(f"N = {n_adapters}: Engine.warmup: {w['requests']} requests in {w['seconds']:.1f} s, "
              f"{w['kernel_compiles']} kernel compiles, {w['decode_graphs']} decode graphs, "
              f"{w['piecewise_graphs']} piecewise graph steps", flush=True)
    # warm-up, untimed: Triton compiles a kernel variant per block size and per integer-argument divisibility, so the
    # first steps of each new prefill size are slow; a burst drawn like the trace (another seed) reaches most of them
    warm = make_trace(n_requests=args.warmup_requests, rate=math.inf, arrival="poisson", popularity="uniform",
                      n_adapters=n_adapters, input_len=args.input_len, output_len=(2, 16), vocab=config.vocab_size,
                      seed=args.seed + 1, long_share=args.long_prompt_share, long_len=args.long_prompt_len)
    def run(part: list[TraceRequest], max_tokens: int | None = None) -> None:
        engine.generate([r.prompt for r in part], adapters=[f"a{r.adapter}" for r in part],
                        sampling=[SamplingParams(max_tokens=max_tokens or r.output_len, ignore_eos=True) for r in part])

    for i in range(0, len(warm), 4 * args.max_batch_size):  # large prefill steps, decode at every batch size
        run(warm[i : i + 4 * args.max_batch_size])
    i = 0
    while i < len(warm):  # the small prefill steps of a running server: 1 to 3 new prompts at a time
        k = 1 + i % 3
        run(warm[i : i + k], max_tokens=2)
        i += k
    engine.runner.warm_pieces()  # every token bucket's piecewise graphs not yet captured: none inside a row
    print(f"N = {n_adapters}: ready after {time.perf_counter() - t0:.1f} s", flush=True)
    return engine


# ------------------------------------------------------------------------------------------------ clients
@dataclass
class Result:
    scheduled: float  # perf_counter() seconds
    first: float | None = None
    end: float | None = None
    tokens: int = 0
    error: str | None = None
    # the engine's own view (in-process engine mode: ``RequestOutput``'s times, on this process's clock): from the
    # scheduled arrival to the engine's ``arrival_time`` (the submit), in the queue (``time_in_queue``, over its
    # admissions), in prefill (the rest until ``first_token_time``); its preemptions; the adapter's tier at submission
    submit_s: float | None = None
    queue_s: float | None = None
    prefill_s: float | None = None
    preemptions: int = 0
    tier: str | None = None


async def _pace(t0: float, req: TraceRequest) -> float:
    at = t0 + req.arrival
    delay = at - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)
    return at


#: most stall steps a row records (``StepTrace.summary``'s ``stalls``)
STALLS_KEPT = 20


def _phase_record(p: dict | None) -> dict:
    """A step's phases as a stall record gives them: ``<name>_ms`` for each ``<name>_s`` or ``<name>_seconds``,
    counts as they are."""
    if not p:
        return {}
    out = {}
    for k, v in p.items():
        base = k[:-2] if k.endswith("_s") else k[:-8] if k.endswith("_seconds") else None
        out[k if base is None else base + "_ms"] = v if base is None else 1e3 * v
    return out


class StepTrace:
    """Wall time of every engine step of a row, by kind (``with StepTrace(engine) as st``: the steps the engine's
    ``step_times`` observed inside the block), to tell stalls (a few steps far above their kind's median: a
    compile, a capture, a garbage collection) from a uniformly slower engine. ``summary()``: per kind the steps,
    p50 / p99 / max milliseconds and the batch rows' p50; ``stall_steps`` (steps over 5x their kind's median and
    over 50 ms) and ``stall_seconds`` (their time above that median). Where the steps carry the engine's host phases
    (``StepTimes.phases_since``): per kind ``<kind>_phase_ms`` (each phase's p50 and mean, ms) and the steps that
    copied adapters to the GPU pool (misses of their batch or prefetches for the queue) against those that did not
    (``<kind>_step_ms_by_misses``: steps and p50 of each),
    which tells a step slowed by its new adapters from one slowed by its batch; and ``stalls``, the first
    ``STALLS_KEPT`` stall steps in order, each with its index among the row's steps, kind, milliseconds, rows, its
    phases in ms and counts (adapter copies, pool compactions, host-arena mapping) and the same of the step after it
    (with async scheduling a step's GPU time is read back in the next step)."""

    def __init__(self, engine: Engine) -> None:
        self.engine, self.steps, self.phases = engine, [], []  # (kind, rows, seconds); dict or None per step

    def __enter__(self) -> "StepTrace":
        self._mark = self.engine.step_times.observed
        return self

    def __exit__(self, *exc) -> None:
        self.steps = self.engine.step_times.since(self._mark)
        self.phases = self.engine.step_times.phases_since(self._mark)

    def summary(self) -> dict:
        out: dict[str, Any] = {"stall_steps": 0, "stall_seconds": 0.0}
        cuts: dict[str, float] = {}  # a kind's stall threshold
        for kind in sorted({k for k, _, _ in self.steps}):
            secs = sorted(t for k, _, t in self.steps if k == kind)
            rows = sorted(r for k, r, _ in self.steps if k == kind)
            med = pct(secs, 50)
            out[f"{kind}_step_ms"] = {"steps": len(secs), "p50": 1e3 * med, "p99": 1e3 * pct(secs, 99),
                                      "max": 1e3 * secs[-1], "rows_p50": pct(rows, 50)}
            cuts[kind] = max(5 * med, 0.05)
            stalls = [t for t in secs if t > cuts[kind]]
            out["stall_steps"] += len(stalls)
            out["stall_seconds"] += sum(t - med for t in stalls)
            ph = [(t, p) for (k, _, t), p in zip(self.steps, self.phases) if k == kind and p]
            if ph:
                names = [n for n in ph[0][1] if n.endswith("_s")]
                out[f"{kind}_phase_ms"] = {n[:-2]: {"p50": 1e3 * pct(sorted(p[n] for _, p in ph), 50),
                                                    "mean": 1e3 * sum(p[n] for _, p in ph) / len(ph)} for n in names}
                split = {}
                def copies(p):  # adapters the step copied to the GPU pool: for its batch, and ahead for the queue
                    return p.get("adapter_misses", 0) + p.get("adapter_prefetches", 0)

                for label, keep in (("with_misses", lambda p: copies(p) > 0), ("without_misses", lambda p: copies(p) == 0)):
                    ts = sorted(t for t, p in ph if keep(p))
                    split[label] = {"steps": len(ts), "p50": 1e3 * pct(ts, 50) if ts else None}
                out[f"{kind}_step_ms_by_misses"] = split
        # the stall steps in order, with where their host time went; with async scheduling a step's GPU time shows in
        # the next step's read-back, so the step after each is kept too
        phases = self.phases if len(self.phases) == len(self.steps) else [None] * len(self.steps)
        out["stalls"] = [{"step": i, "kind": k, "ms": 1e3 * t, "rows": n, **_phase_record(phases[i]),
                          "next": None if i + 1 >= len(self.steps) else {
                              "kind": self.steps[i + 1][0], "ms": 1e3 * self.steps[i + 1][2],
                              **_phase_record(phases[i + 1])}}
                         for i, (k, n, t) in enumerate(self.steps) if t > cuts[k]][:STALLS_KEPT]
        return out


async def run_engine(engine: Engine, trace: list[TraceRequest]) -> tuple[list[Result], float]:
    """The trace through an ``EngineLoop`` in this process; returns per-request results and the wall time."""
    from multilora.runtime.engine_loop import EngineLoop

    loop = EngineLoop(engine, poll_seconds=0.002)
    t0 = time.perf_counter() + 0.05

    async def one(req: TraceRequest) -> Result:
        res = Result(await _pace(t0, req))
        try:
            stream = await asyncio.to_thread(loop.submit, req.prompt, f"a{req.adapter}",
                                             SamplingParams(max_tokens=req.output_len, ignore_eos=True))
            async for d in stream:
                if d.token_ids and res.first is None:
                    res.first = time.perf_counter()
                res.tokens += len(d.token_ids)
                if d.finished and d.error:
                    res.error = d.error
                if d.finished and d.output is not None:
                    o = d.output
                    res.tier, res.preemptions = o.adapter_tier, o.preemptions
                    if o.arrival_time is not None:
                        res.submit_s = o.arrival_time - res.scheduled
                        if o.time_in_queue is not None and o.first_token_time is not None:
                            res.queue_s = o.time_in_queue
                            res.prefill_s = o.first_token_time - o.arrival_time - o.time_in_queue
        except Exception as e:  # a refused request is a result, not the end of the run
            res.error = f"{type(e).__name__}: {e}"
        res.end = time.perf_counter()
        return res

    try:
        results = await _gather_counted(one, trace, "requests done")
    finally:
        await asyncio.to_thread(loop.close)
    return results, time.perf_counter() - t0


async def _gather_counted(one, trace: list[TraceRequest], desc: str) -> list[Result]:
    """``one(req)`` for every request of the trace, concurrently, with a progress bar of those done."""
    bar = tqdm(total=len(trace), desc=desc, mininterval=5, leave=False)

    async def counted(req: TraceRequest) -> Result:
        res = await one(req)
        bar.update(1)
        return res

    try:
        return list(await asyncio.gather(*(counted(r) for r in trace)))
    finally:
        bar.close()


async def run_http(url: str, trace: list[TraceRequest], timeout: float) -> tuple[list[Result], float]:
    """The trace as streaming ``POST /v1/completions`` (token-id prompts) against ``url``."""
    import httpx

    limits = httpx.Limits(max_connections=len(trace) + 8, max_keepalive_connections=len(trace) + 8)
    async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits) as client:
        t0 = time.perf_counter() + 0.05

        async def one(req: TraceRequest) -> Result:
            res = Result(await _pace(t0, req))
            body = {"model": f"a{req.adapter}", "prompt": req.prompt, "max_tokens": req.output_len,
                    "temperature": 0.0, "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}}
            try:
                async with client.stream("POST", "/v1/completions", json=body) as r:
                    if r.status_code != 200:
                        res.error = f"HTTP {r.status_code}: {(await r.aread())[:300]!r}"
                    else:
                        async for line in r.aiter_lines():
                            if not line.startswith("data: ") or line == "data: [DONE]":
                                continue
                            ev = json.loads(line[6:])
                            if "error" in ev:
                                res.error = ev["error"].get("message")
                            elif ev.get("usage"):
                                res.tokens = ev["usage"]["completion_tokens"]
                            elif ev.get("choices") and res.first is None:
                                res.first = time.perf_counter()
            except Exception as e:
                res.error = f"{type(e).__name__}: {e}"
            res.end = time.perf_counter()
            return res

        results = await _gather_counted(one, trace, "requests done (http)")
    return results, time.perf_counter() - t0


# ------------------------------------------------------------------------------------------------ the server child
def serve_child(args: argparse.Namespace) -> None:
    """``--serve-child PORT``: build the same engine (``--serve-engine-process``: in an ``EngineProcess`` of its own),
    serve it with uvicorn on 127.0.0.1:PORT until terminated."""
    import uvicorn

    from multilora.runtime.server import create_app

    if args.switch_interval:
        sys.setswitchinterval(args.switch_interval)
    if args.serve_engine_process:
        from multilora.runtime.engine_process import EngineProcess

        engine = EngineProcess.start(functools.partial(child_engine, args))
    else:
        engine = child_engine(args)
    app = create_app(engine, served_model_name="base")
    try:
        uvicorn.run(app, host="127.0.0.1", port=args.serve_child, log_level="warning")
    finally:
        if args.serve_engine_process:
            engine.close()


def child_engine(args: argparse.Namespace) -> Engine:
    """The server child's engine (in the server's process, or in its engine process: a spawned process that imports
    the scheduler afresh, so ``--urgent-read-wait`` is set here too)."""
    set_urgent_read_wait(args.urgent_read_wait)
    set_pipe_piece_bytes(args.pipe_piece_bytes)
    set_parallel_finish(args.parallel_finish)
    set_host_arena_prefault(args.host_arena_prefault)
    config, files = setup(args)
    return build_engine(args, config, files, args.n_adapters)


def start_server(argv: list[str], n_adapters: int, timeout: float) -> tuple[subprocess.Popen, str]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    cmd = [sys.executable, __file__, *argv, "--serve-child", str(port), "--n-adapters", str(n_adapters)]
    proc = subprocess.Popen(cmd)
    url = f"http://127.0.0.1:{port}"
    import httpx

    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server child exited with {proc.returncode} before serving")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"the server child did not answer /health within {timeout:.0f} s")


# ------------------------------------------------------------------------------------------------ the report
def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))]


def under_load(results: list[Result]) -> dict:
    """The row while requests still arrive: from the first to the last scheduled arrival, output tokens/s
    (``output_tok_s_under_load``; each request's tokens counted as spread evenly from its first token to its last)
    and ``backlog_at_last_arrival`` (requests arrived by then and not yet finished). Unlike ``achieved_rps`` and
    ``output_tok_s``, which run to the last request's end, these leave out the drain after the last arrival, whose
    length is set by a few requests' output lengths: rows that keep up come out near the offered load. None for a
    burst row (one arrival time)."""
    t_lo = min((r.scheduled for r in results), default=0.0)
    t_hi = max((r.scheduled for r in results), default=0.0)
    if t_hi <= t_lo:
        return {"output_tok_s_under_load": None, "backlog_at_last_arrival": None}
    tokens = 0.0
    for r in results:
        if r.error is not None or r.first is None or r.end is None or r.tokens == 0:
            continue
        if r.end <= r.first:  # all its tokens at once
            tokens += r.tokens if t_lo <= r.end <= t_hi else 0
            continue
        overlap = max(0.0, min(r.end, t_hi) - max(r.first, t_lo))
        tokens += r.tokens * overlap / (r.end - r.first)
    backlog = sum(1 for r in results if r.scheduled <= t_hi and (r.end is None or r.end > t_hi))
    return {"output_tok_s_under_load": tokens / (t_hi - t_lo), "backlog_at_last_arrival": backlog}


def summarize(results: list[Result], wall: float, offered: float, before: dict | None, after: dict | None) -> dict:
    ok = [r for r in results if r.error is None and r.first is not None]
    ttft = [r.first - r.scheduled for r in ok]
    tpot = [(r.end - r.first) / (r.tokens - 1) for r in ok if r.tokens > 1]
    e2e = [r.end - r.scheduled for r in ok]
    tokens = sum(r.tokens for r in ok)
    span = max((r.end for r in ok), default=0) - min((r.scheduled for r in results), default=0)
    keys = ("bytes_host_to_gpu", "bytes_disk_to_host", "bytes_gpu_to_host")
    # the engine's counters (mode engine); an HTTP row passes None: its engine lives in the server's process
    moved = {k: (after[k] - before[k]) if before is not None else None for k in keys}

    def rate(hits: str, misses: str) -> float | None:
        if before is None:
            return None
        h, m = after[hits] - before[hits], after[misses] - before[misses]
        return h / (h + m) if h + m else None

    row = {"requests": len(results), "failed": len(results) - len(ok),
           "offered_rps": offered if math.isfinite(offered) else None,  # (burst: None, strict JSON has no Infinity)
           "achieved_rps": len(ok) / span if span > 0 else None, "output_tok_s": tokens / span if span > 0 else None,
           "wall_s": wall, "output_tokens": tokens, **under_load(results)}
    for name, xs in (("ttft", ttft), ("tpot", tpot), ("e2e", e2e)):
        for q in ((50, 90, 99) if name == "ttft" else (50, 99)):
            row[f"{name}_p{q}_s"] = pct(xs, q)
    for k, v in moved.items():
        row[k] = v
        row[f"{k}_per_s"] = v / span if v is not None and span > 0 else None
    for k in ("prefill_steps", "decode_steps", "mixed_steps", "prefill_chunks",  # the engine's step kinds, and
              "graph_steps", "piecewise_graph_steps", "eager_steps",  # how they ran; steps launched before the
              "async_steps", "async_dropped_tokens"):  # step before was read back (async scheduling)
        row[k] = after.get(k, 0) - before.get(k, 0) if before is not None else None
    # Triton compiles inside the row (each stalls every running request; at 90% load the backlog takes long to
    # drain): nonzero means the warm-up missed a kernel variant and the row's latencies include it
    row.update(compiles_between(before, after))
    if after is not None:  # where the memory ended the row (a unified pool moves its boundary; memory/unified.py)
        row["adapters_resident_end"] = len(after.get("adapters_resident") or [])
        row["pool_bytes_end"] = after.get("pool_bytes_total")
        row["gpu_evictions"] = after["gpu_evictions"] - before["gpu_evictions"] if before is not None else None
        row["pool_max_slots"] = after.get("pool_max_slots")
        for k in ("evictions_for_kv", "unified_floor_moves_up", "unified_floor_moves_down", "kv_reclaims_from_pool",
                  "pool_compactions", "pool_bytes_compacted",
                  # the host tier's growth in the row: chunks mapped and page-locked, and their time (any thread)
                  "host_arena_chunks", "host_arena_map_seconds", "host_arena_pin_seconds", "host_arena_sync_grows",
                  "host_arena_sync_map_seconds",
                  "host_arena_grown_ahead", "host_arena_bytes_held"):
            row[k] = (after[k] - before[k]) if before is not None and k in after else None
    row["pool_hit_rate"] = rate("gpu_hits", "gpu_misses")
    row["host_hit_rate"] = rate("host_hits", "host_misses")
    # GB/s of each tier move over the row, from the stats' bytes and seconds (runtime/adapter_cache.py report())
    for move, nbytes in (("host_to_gpu", "host_to_gpu_timed_bytes"), ("disk_to_host", "bytes_disk_to_host"),
                         ("gpu_to_host", "bytes_gpu_to_host")):
        secs = f"{move}_seconds"
        if before is None or secs not in after:
            row[f"{move}_gbps"] = None
            continue
        t = after[secs] - before[secs]
        row[f"{move}_gbps"] = (after[nbytes] - before[nbytes]) / t / 1e9 if t > 0 else None
    # all disk -> host readers together (the union of their in-flight time), the figure to hold against the run's
    # cold_read_gbps (--drop-page-cache); disk_to_host_gbps above is one reader's
    row["disk_to_host_aggregate_gbps"] = None
    if before is not None and "disk_to_host_busy_seconds" in after:
        t = after["disk_to_host_busy_seconds"] - before["disk_to_host_busy_seconds"]
        nb = after["disk_to_host_busy_bytes"] - before["disk_to_host_busy_bytes"]
        row["disk_to_host_aggregate_gbps"] = nb / t / 1e9 if t > 0 else None
    errors = sorted({r.error for r in results if r.error})[:3]
    if errors:
        row["errors"] = errors
    return row


def slo_share(results: list[Result], ttft_max: float | None, tpot_max: float | None) -> float | None:
    """Share of all requests (failed ones count as missed) with TTFT <= ``ttft_max`` and TPOT <= ``tpot_max``."""
    if ttft_max is None or tpot_max is None or not results:
        return None
    met = 0
    for r in results:
        if r.error is None and r.first is not None and r.first - r.scheduled <= ttft_max:
            tpot = (r.end - r.first) / (r.tokens - 1) if r.tokens > 1 else 0.0
            met += tpot <= tpot_max
    return met / len(results)


def ttft_split(results: list[Result], ttft_max: float | None) -> dict | None:
    """Where the first-token latency goes, from the engine's own times (None without them: the HTTP modes): for every
    request and for those over ``ttft_max`` (the SLO's TTFT; ``slow``), p50 / p90 seconds of the submit (scheduled
    arrival -> the engine's ``arrival_time``), the queue (``time_in_queue``: waiting for the adapter, KV room or its
    turn, over its admissions), the prefill (the rest until the engine's ``first_token_time``) and the delivery (the
    rest until the client saw the token: the loop publishing it, the event loop waking the stream), and how many
    were preempted before it; and per adapter tier at submission ("gpu", "host", "disk", "base") the requests, TTFT
    p50 / p90 and the share within ``ttft_max``."""
    timed = [r for r in results if r.queue_s is not None and r.prefill_s is not None and r.first is not None]
    if not timed:
        return None

    def parts(rs: list[Result]) -> dict:
        out: dict[str, Any] = {"requests": len(rs), "preempted": sum(r.preemptions > 0 for r in rs)}
        cols = {"submit": [r.submit_s for r in rs], "queue": [r.queue_s for r in rs],
                "prefill": [r.prefill_s for r in rs],
                "deliver": [(r.first - r.scheduled) - r.submit_s - r.queue_s - r.prefill_s for r in rs]}
        for name, xs in cols.items():
            out[name + "_p50_s"], out[name + "_p90_s"] = pct(xs, 50), pct(xs, 90)
        return out

    slow = [r for r in timed if ttft_max is not None and r.first - r.scheduled > ttft_max]
    tiers: dict[str, Any] = {}
    for tier in ("gpu", "host", "disk", "base"):
        rs = [r for r in timed if (r.tier or "base") == tier]
        if rs:
            ttft = [r.first - r.scheduled for r in rs]
            tiers[tier] = {"requests": len(rs), "ttft_p50_s": pct(ttft, 50), "ttft_p90_s": pct(ttft, 90),
                           "within_ttft": None if ttft_max is None else sum(t <= ttft_max for t in ttft) / len(rs)}
    return {"all": parts(timed), "slow": parts(slow) if slow else {"requests": 0}, "by_tier": tiers}


def fmt(v: Any, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def markdown(rows: list[dict]) -> str:
    head = ("| mode | pool + KV | N | set | rate | offered req/s | achieved req/s | out tok/s | TTFT p50 / p90 / p99 (s) "
            "| TPOT p50 / p99 (ms) | e2e p50 / p99 (s) | within SLO | failed | kernel compiles in row "
            "| decode step p50 / max (ms) | stalls (s) | pool hit rate | host -> GPU GB | resident at end |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]

    def steps(r: dict) -> str:
        d = r.get("decode_step_ms")
        return "-" if not d else f"{d['p50']:.2f} / {d['max']:.2f}"

    def stalls(r: dict) -> str:
        return "-" if r.get("stall_steps") is None else f"{r['stall_steps']} ({r['stall_seconds']:.2f})"

    def compiles(r: dict) -> str:
        n = r.get("kernel_compiles")
        return "-" if n is None else f"{n} ({r['kernel_compile_seconds']:.1f} s)"

    for r in rows:
        lines.append(
            f"| {r['mode']} | {'unified' if r.get('unified_pool') else 'apart'} | {r['n_adapters']} "
            f"| {r['adapter_set']} | {r['rate']} | {fmt(r['offered_rps'], '.2f')} "
            f"| {fmt(r['achieved_rps'], '.2f')} | {fmt(r['output_tok_s'], '.0f')} "
            f"| {fmt(r['ttft_p50_s'], '.3f')} / {fmt(r['ttft_p90_s'], '.3f')} / {fmt(r['ttft_p99_s'], '.3f')} "
            f"| {fmt(r['tpot_p50_s'] and r['tpot_p50_s'] * 1e3, '.2f')} / {fmt(r['tpot_p99_s'] and r['tpot_p99_s'] * 1e3, '.2f')} "
            f"| {fmt(r['e2e_p50_s'], '.2f')} / {fmt(r['e2e_p99_s'], '.2f')} "
            f"| {'-' if r.get('slo_share') is None else format(100 * r['slo_share'], '.1f') + '%'} | {r['failed']} "
            f"| {compiles(r)} | {steps(r)} | {stalls(r)} | {fmt(r.get('pool_hit_rate'), '.3f')} "
            f"| {fmt(r.get('bytes_host_to_gpu') and r['bytes_host_to_gpu'] / 1e9, '.2f')} "
            f"| {fmt(r.get('adapters_resident_end'), 'd')} |")
    return "\n".join(lines)


#: the keys issue 13 fixes for every row of ``serving_<shape>.json`` (a contract other tools read)
CONTRACT_KEYS = ("device", "adapter_set", "num_adapters", "popularity", "request_rate", "throughput_req_s", "output_tok_s",
                 "ttft_p50_s", "ttft_p99_s", "tpot_p50_ms", "tpot_p99_ms", "slo_attainment")


def contract_keys(row: dict) -> dict:
    """The row's figures under the issue's key names: ``request_rate`` req/s offered (None for a burst row),
    ``throughput_req_s`` achieved, TPOT in milliseconds, ``slo_attainment`` the share within the SLO (0..1)."""
    def ms(v: float | None) -> float | None:
        return None if v is None else 1e3 * v

    return {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu",
            "num_adapters": row["n_adapters"],
            "request_rate": None if row["rate"] == "burst" else row["offered_rps"],
            "throughput_req_s": row["achieved_rps"], "tpot_p50_ms": ms(row["tpot_p50_s"]),
            "tpot_p99_ms": ms(row["tpot_p99_s"]), "slo_attainment": row["slo_share"]}


def _strict(obj):
    """``obj`` with every NaN or infinite float replaced by None: strict JSON parsers refuse Python's ``NaN`` /
    ``Infinity``."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _strict(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_strict(v) for v in obj]
    return obj


def plot(rows: list[dict], path: Path) -> None:
    """Output tokens/s and TTFT p50 / p99 against the number of adapters N, one line per (mode, rate kind)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        if not getattr(plot, "warned", False):  # (once per run, not after every row)
            print("matplotlib not installed: no plot", flush=True)
            plot.warned = True
        return
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    for key in sorted({(r["mode"], r["rate"] == "burst") for r in rows}):
        sel = sorted((r for r in rows if (r["mode"], r["rate"] == "burst") == key), key=lambda r: r["num_adapters"])
        label = f"{key[0]}, {'burst' if key[1] else 'fixed rate'}"
        ns = [r["num_adapters"] for r in sel]
        a1.plot(ns, [r["output_tok_s"] for r in sel], marker="o", label=label)
        a2.plot(ns, [r["ttft_p50_s"] for r in sel], marker="o", label=f"{label}: p50")
        a2.plot(ns, [r["ttft_p99_s"] for r in sel], marker="x", linestyle="--", label=f"{label}: p99")
    for ax, title in ((a1, "output tokens/s"), (a2, "TTFT (s)")):
        ax.set_xscale("log")
        ax.set_xlabel("adapters N")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    a2.set_yscale("log")
    a1.legend(fontsize=7)
    a2.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def environment() -> dict:
    env = {"python": platform.python_version(), "torch": torch.__version__, "platform": platform.platform()}
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
    for pkg in ("triton", "fastapi", "uvicorn", "httpx"):
        try:
            env[pkg] = __import__(pkg).__version__
        except Exception:
            env[pkg] = None
    return env


# ------------------------------------------------------------------------------------------------ main
def pair(s: str) -> tuple[int, int]:
    lo, _, hi = s.partition(",")
    a, b = int(lo), int(hi or lo)
    if not 1 <= a <= b:
        raise argparse.ArgumentTypeError(f"expected LO,HI with 1 <= LO <= HI, got {s!r}")
    return a, b


def seconds_arg(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        v = math.nan
    if not (math.isfinite(v) and v >= 0):
        raise argparse.ArgumentTypeError(f"expected seconds >= 0 (0: off), got {s!r}")
    return v


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llama3-8b", choices=sorted(MODEL_SHAPES))
    ap.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    ap.add_argument("--dtype", default=None, choices=sorted(DTYPES), help="default: bf16 on CUDA, fp32 on CPU")
    ap.add_argument("--adapters", default="5", help="comma-separated adapter counts N (rows)")
    ap.add_argument("--adapter-set", default="S1", choices=sorted(ADAPTER_SETS))
    ap.add_argument("--adapter-files", type=int, default=8, help="distinct adapter directories written; adapter i "
                    "loads directory i %% K (each name is still its own adapter to the engine)")
    ap.add_argument("--adapter-dir", help="where adapter files go (default: a temporary directory)")
    ap.add_argument("--preload", type=int, default=10**9, help="adapters read at registration (the rest on first use)")
    ap.add_argument("--adapter-pool-share", type=float, default=0.3)
    ap.add_argument("--adapter-pool-bytes", type=bytes_arg, default=None, help="the pool's bytes, a count or with a "
                    "unit: 8GiB (default: the plan's share); with --unified-pool on, its starting size")
    ap.add_argument("--kv-cache-bytes", type=bytes_arg, default=None, help="cap on the KV cache's bytes (8GiB, ...)")
    ap.add_argument("--adapter-finish", default=None, choices=("host", "device"),
                    help="Engine(adapter_finish=...): where an adapter read from disk gets the pool's layout (device: "
                         "the I/O threads read the file raw, the GPU finishes it; default: the engine's, device on "
                         "CUDA, host on the CPU; rows record the one used)")
    ap.add_argument("--host-arena-chunk-bytes", type=bytes_arg, default=None,
                    help="Engine(host_arena_chunk_bytes=...): bytes of one chunk of the host tier's pinned arena, each "
                         "page-locked by one cudaHostRegister (default: the engine's, 1 GiB; 1 = one max-rank image)")
    ap.add_argument("--adapter-pool-fill", action="store_true", help="Engine(adapter_pool_fill=True): the pool also "
                    "takes the budget the KV cache can never use (max_batch_size sequences of the trace's longest)")
    ap.add_argument("--unified-pool", default="off", help="comma-separated off,on: rows with the pool and the KV "
                    "cache apart (off) and in one buffer of the same bytes (on; Engine(unified_pool=True)), per N")
    ap.add_argument("--popularity", default="zipf", choices=("zipf", "uniform"))
    ap.add_argument("--arrival", default="poisson", choices=("poisson", "gamma"))
    ap.add_argument("--rate", default="auto", help="req/s, 'burst' (all at t = 0) or 'auto' (a fraction of the "
                    "burst capacity of mode engine at the first N)")
    ap.add_argument("--rate-fraction", type=float, default=0.9)
    ap.add_argument("--no-burst-rows", dest="burst_rows", action="store_false",
                    help="skip the burst (capacity) row of each mode before its fixed-rate row")
    ap.add_argument("--requests", type=int, default=256, help="requests per row")
    ap.add_argument("--input-len", type=pair, default=(8, 512), help="LO,HI (uniform)")
    ap.add_argument("--output-len", type=pair, default=(8, 512), help="LO,HI (uniform)")
    ap.add_argument("--max-batch-size", type=int, default=64)
    ap.add_argument("--chunked-prefill", default="on", choices=("on", "off"),
                    help="the engine's enable_chunked_prefill (on: decode tokens and prompt chunks share each step)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None,
                    help="chunked prefill's tokens per step (default: the engine's, = --max-prefill-tokens)")
    ap.add_argument("--piecewise-cuda-graph-max-tokens", type=int, default=None,
                    help="the engine's option: prefill/mixed steps of up to this many tokens replay piecewise CUDA "
                         "graphs (default: the engine's, 2048 capped by the step budget; 0: eager, as before)")
    ap.add_argument("--max-prefill-tokens", type=int, default=None, help="default: the engine's (4096)")
    ap.add_argument("--async-scheduling", default="auto", choices=("auto", "on", "off"),
                    help="Engine(async_scheduling=...): auto = the engine's default (on for CUDA); off = every step "
                         "read back before the next is launched (the A/B)")
    ap.add_argument("--long-prompt-share", type=float, default=0.0,
                    help="share of requests with a --long-prompt-len prompt (the long-prompt mix)")
    ap.add_argument("--long-prompt-len", type=int, default=4096)
    ap.add_argument("--warmup-requests", type=int, default=192, help="untimed requests before the rows (per engine)")
    ap.add_argument("--engine-warmup", action="store_true",
                    help="engine mode: run Engine.warmup (what `multilora serve` runs on a GPU) before the bench's "
                         "warm-up; with --warmup-requests 0 the rows' compile counts show whether it alone suffices")
    ap.add_argument("--modes", default="engine,http", help="comma-separated: engine, http, http-engine-process")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds: server start, and one HTTP request")
    ap.add_argument("--out", default=None, help="write serving_<tag>.json / .md here")
    ap.add_argument("--tag", default=None, help="default: the shape")
    ap.add_argument("--switch-interval", type=float, default=None,
                    help="sys.setswitchinterval in the process that builds the engine (seconds; "
                         "Engine(gil_switch_interval=...); default the engine's 0.0005, Python's own is 0.005)")
    ap.add_argument("--drop-page-cache", type=seconds_arg, default=0.0, metavar="SECONDS",
                    help="during every timed row, drop the OS page cache of the adapter files every SECONDS seconds "
                         "(posix_fadvise DONTNEED, Linux), so the engine's disk -> host reads come from the disk; and "
                         "measure a plain sequential read of up to 8 of them first (cold_read_gbps). 0: off")
    ap.add_argument("--drop-after-read", action="store_true",
                    help="engine mode: drop an adapter directory's OS page cache right after each engine read of it "
                         "(so later reads of it come from the disk, and no read in flight loses its read-ahead "
                         "pages as with the periodic --drop-page-cache); measures the cold read first too")
    add_urgent_read_wait_arg(ap)
    add_pipe_piece_bytes_arg(ap)
    add_host_arena_prefault_arg(ap)
    add_parallel_finish_arg(ap)
    add_torch_threads_arg(ap)
    ap.add_argument("--serve-child", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--n-adapters", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--serve-engine-process", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    args.dtype = args.dtype or ("bf16" if args.device.startswith("cuda") else "fp32")
    args.counts = positive_ints(ap, "--adapters", args.adapters, "adapter counts >= 1")
    at_least(ap, ("--adapter-files", args.adapter_files, 1), ("--requests", args.requests, 1),
             ("--warmup-requests", args.warmup_requests, 0), ("--preload", args.preload, 0),
             ("--long-prompt-len", args.long_prompt_len, 1), ("--max-batch-size", args.max_batch_size, 1),
             ("--max-num-batched-tokens", args.max_num_batched_tokens, 1),
             ("--max-prefill-tokens", args.max_prefill_tokens, 1),
             ("--piecewise-cuda-graph-max-tokens", args.piecewise_cuda_graph_max_tokens, 0))
    if not (0 < args.rate_fraction <= 1e6) or not math.isfinite(args.rate_fraction):
        ap.error(f"--rate-fraction: expected a positive fraction of the burst capacity, got {args.rate_fraction}")
    if args.switch_interval is not None and not args.switch_interval >= 0:
        ap.error(f"--switch-interval: expected seconds >= 0 (0: the engine's default), got {args.switch_interval}")
    if args.timeout is not None and not args.timeout > 0:
        ap.error(f"--timeout: expected seconds > 0, got {args.timeout}")
    if args.out is not None:
        try:  # before any work: a run whose rows cannot be written is lost
            os.makedirs(args.out, exist_ok=True)
        except OSError as e:
            ap.error(f"--out: cannot make the directory {args.out!r}: {e.strerror or e}")
    args.mode_list = [m.strip() for m in args.modes.split(",")]
    bad = [m for m in args.mode_list if m not in MODES]
    if bad:
        ap.error(f"--modes: expected some of {', '.join(MODES)}, got {bad}")
    args.unified_list = [u.strip() == "on" for u in args.unified_pool.split(",")]
    if any(u.strip() not in ("off", "on") for u in args.unified_pool.split(",")):
        ap.error(f"--unified-pool: expected off, on or off,on, got {args.unified_pool!r}")
    for name in ("adapter_pool_bytes", "kv_cache_bytes"):
        if getattr(args, name) is not None:
            setattr(args, name, int(getattr(args, name)))
    if not 0 <= args.long_prompt_share <= 1:
        ap.error(f"--long-prompt-share: expected a share in [0, 1], got {args.long_prompt_share}")
    if args.rate not in ("auto", "burst"):
        try:
            if float(args.rate) <= 0:
                raise ValueError
        except ValueError:
            ap.error(f"--rate: expected a positive number, 'burst' or 'auto', got {args.rate!r}")
    context = MODEL_SHAPES[args.shape]["max_position_embeddings"]
    if longest_request(args) > context:
        ap.error(f"--input-len / --output-len{' / --long-prompt-len' if args.long_prompt_share > 0 else ''}: the "
                 f"longest request ({longest_request(args)} tokens) is past the {args.shape} shape's context of "
                 f"{context} tokens: lower them")
    for flag, on in (("--drop-page-cache", args.drop_page_cache > 0), ("--drop-after-read", args.drop_after_read)):
        if on and not hasattr(os, "posix_fadvise"):
            ap.error(f"{flag}: needs os.posix_fadvise (Linux), which Python on {platform.system()} lacks")
    return args


def setup(args: argparse.Namespace) -> tuple[ModelConfig, list[Path]]:
    torch.manual_seed(args.seed)  # whatever else draws from the global generator (the trace has its own)
    config = ModelConfig(**MODEL_SHAPES[args.shape])
    if args.adapter_dir is None and "MULTILORA_BENCH_ADAPTERS" not in os.environ:
        tmp = tempfile.mkdtemp(prefix="multilora-serving-")
        os.environ["MULTILORA_BENCH_ADAPTERS"] = tmp
        atexit.register(shutil.rmtree, tmp, True)  # ours to remove (a Llama-3-8B set is GBs)
    root = Path(args.adapter_dir or os.environ["MULTILORA_BENCH_ADAPTERS"])
    root.mkdir(parents=True, exist_ok=True)
    return config, write_adapter_set(root, config, args.adapter_set, args.adapter_files, DTYPES[args.dtype])


def main(argv: list[str] | None = None) -> list[dict]:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    before = set_urgent_read_wait(args.urgent_read_wait)  # before any engine (a child sets its own)
    pipe_before = set_pipe_piece_bytes(args.pipe_piece_bytes)
    parallel_before = set_parallel_finish(args.parallel_finish)
    prefault_before = set_host_arena_prefault(args.host_arena_prefault)
    args.torch_threads_used = set_torch_threads(args.torch_threads)  # (a server child parses the same flags)
    try:
        return _main(args, argv)
    finally:  # (in-process callers get the module's values back)
        scheduler_mod.URGENT_READ_WAIT = before
        image_mod.PIPELINE_PIECE_BYTES = pipe_before
        image_mod.PARALLEL_FINISH = parallel_before
        host_arena_mod.PREFAULT = prefault_before


def _main(args: argparse.Namespace, argv: list[str]) -> list[dict]:
    if args.serve_child is not None:
        serve_child(args)
        return []
    config, files = setup(args)
    # the child reuses the parent's adapter files (and torch seed: the same random base weights)
    child_argv = [a for a in argv] + (["--adapter-dir", os.environ["MULTILORA_BENCH_ADAPTERS"]]
                                      if args.adapter_dir is None else [])
    disk: dict = {}  # the run's cold sequential read (--drop-page-cache, --drop-after-read)
    if args.drop_page_cache > 0 or args.drop_after_read:
        os.sync()  # the kernel drops clean pages only: the freshly written files written back first
        n_files = drop_page_cache(files)
        disk = cold_read(files[:8])
        how = " and".join(([f" every {args.drop_page_cache:g} s during rows"] if args.drop_page_cache > 0 else [])
                          + ([" after each engine read"] if args.drop_after_read else []))
        print(f"page cache of {n_files} adapter files dropped{how} (cold sequential read: "
              f"{fmt(disk['cold_read_gbps'], '.2f')} GB/s over {disk['cold_read_bytes'] / 1e6:.1f} MB)", flush=True)
    rows: list[dict] = []
    slo_ref: dict[tuple[str, bool], tuple[float | None, float | None]] = {}
    rate: float | None = None if args.rate == "auto" else (math.inf if args.rate == "burst" else float(args.rate))
    for n in args.counts:
        def trace_at(r: float) -> list[TraceRequest]:
            return make_trace(n_requests=args.requests, rate=r, arrival=args.arrival, popularity=args.popularity,
                              n_adapters=n, input_len=args.input_len, output_len=args.output_len,
                              vocab=config.vocab_size, seed=args.seed, long_share=args.long_prompt_share,
                              long_len=args.long_prompt_len)

        unified = False
        gpu_before: int | None = None  # torch.cuda.memory_allocated() before this N's engine was built (CUDA)

        def record(mode: str, r: float, results: list[Result], wall: float, before: dict | None,
                   after: dict | None, steps: dict | None = None, drops: int = 0,
                   after_reads: int | None = None, pipes_before: dict | None = None) -> dict:
            pipes = image_mod.pipeline_counts()  # (the in-process engine's reads: the pipelined finish's choices)
            row = {**trace_facts(trace_at(r)), "mode": mode, "n_adapters": n, "adapter_set": args.adapter_set, "popularity": args.popularity,
                   "unified_pool": unified, "adapter_pool_bytes": args.adapter_pool_bytes,
                   "adapter_pool_fill": args.adapter_pool_fill, "adapter_finish": ("device" if finish_on_device(
                       EngineConfig(adapter_finish=args.adapter_finish), torch.device(args.device).type) else "host"),
                   "kv_cache_bytes": args.kv_cache_bytes, "host_arena_chunk_bytes": args.host_arena_chunk_bytes,
                   "gpu_bytes_allocated_before_engine": gpu_before if mode == "engine" else None,
                   "arrival": args.arrival, "rate": "burst" if math.isinf(r) else f"{r:.2f}",
                   "chunked_prefill": args.chunked_prefill, "max_num_batched_tokens": args.max_num_batched_tokens,
                   "piecewise_cuda_graph_max_tokens": args.piecewise_cuda_graph_max_tokens,
                   "long_prompt_share": args.long_prompt_share, "urgent_read_wait": scheduler_mod.URGENT_READ_WAIT,
                   "pipe_piece_bytes": image_mod.PIPELINE_PIECE_BYTES, "parallel_finish": image_mod.PARALLEL_FINISH,
                   "host_arena_prefault": host_arena_mod.PREFAULT,
                   **{f"reads_{k}": (pipes[k] - pipes_before[k] if pipes_before is not None else None) for k in pipes},
                   "drop_page_cache_s": args.drop_page_cache, "page_cache_drops": drops,
                   "drop_after_read": after_reads is not None, "drops_after_reads": after_reads,
                   "long_prompt_len": args.long_prompt_len if args.long_prompt_share > 0 else None,
                   **summarize(results, wall, r, before, after), **(steps or {})}
            # SLO (issue 13): TTFT <= 5x and TPOT <= 2x the p50s of the first N's row of this mode and rate kind
            ref = slo_ref.setdefault((mode, row["rate"] == "burst"), (row["ttft_p50_s"], row["tpot_p50_s"]))
            row["slo_ttft_s"], row["slo_tpot_s"] = (None, None) if None in ref else (5 * ref[0], 2 * ref[1])
            row["slo_share"] = slo_share(results, row["slo_ttft_s"], row["slo_tpot_s"])
            row["ttft_split"] = ttft_split(results, row["slo_ttft_s"])
            row.update(contract_keys(row))
            rows.append(row)
            print(json.dumps(_strict(row)), flush=True)
            write(args, argv, config, rows, disk)
            return row

        def rates() -> list[float]:  # each mode: a burst row (its capacity), then the fixed-rate row
            return [math.inf, rate] if args.burst_rows and not math.isinf(rate) else [rate]

        for unified in args.unified_list if "engine" in args.mode_list or rate is None else []:
            # what the rows before left allocated (0 unless something still holds their engine): this engine's
            # memory plan sizes its pool and KV cache from the free memory, so a leftover engine shrinks them
            gpu_before = torch.cuda.memory_allocated() if torch.cuda.is_available() else None
            engine = build_engine(args, config, files, n, unified)
            dropper = DropAfterRead(engine) if args.drop_after_read else None
            if dropper is not None:  # (registering and warming up read files into the page cache)
                drop_page_cache(files)

            def after_reads(before_reads: int) -> int | None:  # this row's reads that dropped their files' cache
                return None if dropper is None else dropper.settle() - before_reads

            todo = rates() if rate is not None else []
            if rate is None:  # --rate auto: a burst fixes the rate every later row is offered
                before, reads0 = engine.stats(), dropper.settle() if dropper else 0
                pipes0 = image_mod.pipeline_counts()
                with StepTrace(engine) as st, PageCacheDropper(files, args.drop_page_cache) as drops:
                    res, wall = asyncio.run(run_engine(engine, trace_at(math.inf)))
                rate = args.rate_fraction * record("engine", math.inf, res, wall, before, engine.stats(),
                                                   st.summary(), drops.passes, after_reads(reads0),
                                                   pipes0)["achieved_rps"]
                todo = [rate]
            for r in todo if "engine" in args.mode_list else []:
                before, reads0 = engine.stats(), dropper.settle() if dropper else 0
                pipes0 = image_mod.pipeline_counts()
                with StepTrace(engine) as st, PageCacheDropper(files, args.drop_page_cache) as drops:
                    res, wall = asyncio.run(run_engine(engine, trace_at(r)))
                record("engine", r, res, wall, before, engine.stats(), st.summary(), drops.passes,
                       after_reads(reads0), pipes0)
            # every holder of this engine let go before the next N's is built: the StepTrace of the last row holds
            # it, and --drop-after-read's reload wrapper makes a cycle through its cache (freed by a collection
            # only). Until session 39 both kept the N = 5 engine (~16 GB for Llama-3-8B) alive while N = 2,000's
            # was planned: its pool got 344 slots, not 1,231 (bench/results/session39/README.md)
            st = dropper = None  # noqa: F841 - the names are the references
            del engine
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        unified = False
        for mode in [m for m in MODES[1:] if m in args.mode_list]:  # http, http-engine-process
            extra = ["--serve-engine-process"] if mode == "http-engine-process" else []
            proc, url = start_server(child_argv + extra, n, args.timeout)
            try:
                for r in rates():
                    with PageCacheDropper(files, args.drop_page_cache) as drops:
                        res, wall = asyncio.run(run_http(url, trace_at(r), args.timeout))
                    record(mode, r, res, wall, None, None, drops=drops.passes)
            finally:
                proc.terminate()  # SIGTERM: uvicorn's shutdown closes the engine process too
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
    print(markdown(rows))
    return rows


def write(args: argparse.Namespace, argv: list[str], config: ModelConfig, rows: list[dict],
          disk: dict | None = None) -> None:
    """``serving_<tag>.json`` / ``.md`` in ``--out`` (rewritten after every row: a cut-off run keeps its rows);
    ``disk``: run-wide facts of the disk (``cold_read_gbps`` / ``cold_read_bytes``), put in the environment."""
    if not args.out:
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = args.tag or args.shape
    meta = {"torch_threads": getattr(args, "torch_threads_used", None),
            "command": "python bench/bench_serving.py " + " ".join(argv), "environment": {**environment(), **(disk or {})},
            "shape": args.shape, "config": {k: v for k, v in vars(config).items() if not k.startswith("_")}}
    (out / f"serving_{tag}.json").write_text(json.dumps(_strict({"meta": meta, "rows": rows}), indent=1, default=str))
    (out / f"serving_{tag}.md").write_text(f"`{meta['command']}`\n\n{markdown(rows)}\n")
    plot(rows, out / f"serving_{tag}.png")


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:  # Ctrl-C: a line, not a traceback (the rows finished so far are kept)
        print("\ninterrupted: the rows finished so far are in --out's serving_<tag>.json", file=sys.stderr)
        sys.exit(130)
