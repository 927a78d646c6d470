"""Engine throughput against the number of distinct adapters, with a pool that holds far fewer (issue 4).

For each adapter count N (1, 8, 64, 512, 2048) and popularity (zipf, uniform), a batch of requests each
names an adapter drawn from N (rank r on all seven projections, written as PEFT files), served by an
engine whose pool holds ``--pool-adapters`` of them and whose host tier holds ``--host-adapters``.
Reported per row: output tokens/s and its ratio to the same engine serving the same requests with no
adapter, bytes moved between tiers per second, prefetch hit rate, and time requests waited; and where the time went:
steps by kind, requests passed over for adapter loads, reads and their summed seconds, the step-time histogram
(``step_seconds``). ``--switch-interval`` is the engine's ``gil_switch_interval`` (``sys.setswitchinterval``; default
the engine's, 0.5 ms; session 13 measured Python's 5 ms against 0.5 ms with this flag, before the engine set it).
``--sample-threads`` adds ``thread_samples`` to each row: where every Python thread was, sampled every 1 ms
(``_common.ThreadSampler``), to tell which code the step thread waits in when the I/O threads hold the GIL.

    python bench/bench_adapter_throughput.py --shape llama3-8b --out bench/results      # H200
    python bench/bench_adapter_throughput.py --shape tiny --counts 1,8,64 --batch 8      # CPU smoke run

Target (issue 4): at 2048 adapters, zipf popularity, decode throughput >= 85% of the no-adapter engine's.
Disk: N adapters x r x sum(d_in + d_out) x layers x 2 bytes (Llama-3-8B, r=16: 84 MB each, 172 GB for
2048); the script refuses to start when the adapter directory's disk cannot hold them. ``--distinct-files K``
writes K directories and loads adapter i from directory i % K: every name is still a distinct adapter to the
engine (own pages, host copy, disk reloads), so the traffic measured is the same.

Adapters are registered with ``load_adapter(preload=False)`` (header-only validation, disk tier; ``--preload``
reads them all up front). Each (count, popularity) is measured twice: ``cold``, the first batch after the new
adapters were registered (every adapter it names is read from disk), and ``warm``, a fresh draw from the same
popularity served next (what a long-running server sees; the target is judged on it). Every (count, popularity)
starts from an empty cache: the adapters of the rows before are unloaded and the N adapters registered again
(``distinct_read_from_disk`` counts the cold batch's reads). Before session 43 the names carried over from row to
row, so a "cold" batch found the adapters of earlier rows resident (zipf's hot ones above all) and a warm batch
the traffic of every row before; ``--keep-between-rows`` runs that way again.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import json
import platform
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from tqdm.auto import tqdm

from multilora import Engine, SamplingParams
from multilora.memory.pool import AdapterPool, max_adapter_pages
from multilora.config import ModelConfig
from multilora.runtime.weights import MODEL_SHAPES

from _common import (ThreadSampler, add_parallel_finish_arg, add_pipe_piece_bytes_arg,  # bench/_common.py (bench/
                     add_torch_threads_arg, add_urgent_read_wait_arg, at_least, compiles_between,  # is on sys.path)
                     positive_ints, set_parallel_finish, set_pipe_piece_bytes, set_torch_threads,
                     set_urgent_read_wait, write_adapters)


def popularity(kind: str, n: int, k: int, g: torch.Generator) -> list[int]:
    """k adapter indices in [0, n): zipf (s = 1, Punica/S-LoRA style) or uniform."""
    if kind == "uniform":
        return torch.randint(0, n, (k,), generator=g).tolist()
    w = 1.0 / torch.arange(1, n + 1, dtype=torch.float64)
    return torch.multinomial(w / w.sum(), k, replacement=True, generator=g).tolist()


def move_rates(before: dict, after: dict) -> dict:
    """GB/s of each tier move over a row, from the deltas of ``stats()``'s bytes and seconds (None: no move)."""
    out = {}
    for move, nbytes in (("host_to_gpu", "host_to_gpu_timed_bytes"), ("disk_to_host", "bytes_disk_to_host"),
                         ("gpu_to_host", "bytes_gpu_to_host")):
        if f"{move}_seconds" not in after:  # a tree before the tier-move stats
            continue
        b, t = after[nbytes] - before[nbytes], after[f"{move}_seconds"] - before[f"{move}_seconds"]
        out[f"{move}_gbps"] = b / t / 1e9 if t > 0 else None
    return out


def run_once(engine: Engine, prompts, names, gen: int, waits: list | None = None) -> tuple[float, int]:
    """Serve one batch; (seconds, output tokens). ``waits``: gets each request's ``time_in_queue`` appended."""
    t0 = time.perf_counter()
    outs = engine.generate(prompts, adapters=names, sampling=SamplingParams(max_tokens=gen, ignore_eos=True))
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    failed = [o for o in outs if o.finish_reason == "error"]
    if failed:  # a row of failed requests is no measurement (session 12 once printed 0 tokens/s for one)
        raise RuntimeError(f"{len(failed)} of {len(outs)} requests failed; the first: {failed[0].error}")
    if waits is not None:
        waits.extend(o.time_in_queue or 0.0 for o in outs)
    return time.perf_counter() - t0, sum(len(o.token_ids) for o in outs)



def _merged(earlier: list[dict], rows: list[dict]) -> list[dict]:
    """``rows`` after the rows of an earlier run (``--merge``) that they do not measure again, sorted."""
    if not earlier:
        return rows
    key = lambda r: (r["adapters"], r["popularity"], r.get("phase", "cold"),  # noqa: E731
                     r.get("keep_between_rows", True))  # (rows before session 43 carried the names over)
    done = {key(r) for r in rows}
    return sorted([r for r in earlier if key(r) not in done] + rows,
                  key=lambda r: (r["popularity"], r.get("phase", "cold"), r["adapters"]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llama3-8b", choices=sorted(MODEL_SHAPES))
    ap.add_argument("--counts", default="1,8,64,512,2048")
    ap.add_argument("--popularity", default="zipf,uniform", help="comma-separated: zipf, uniform (default both)")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--pool-adapters", type=int, default=32,
                    help="adapter slots of the GPU pool; 0: the memory plan's default pool (issue 13's goal row)")
    ap.add_argument("--adapter-pool-fill", action="store_true",
                    help="Engine(adapter_pool_fill=True): with --pool-adapters 0, the pool also takes the budget the KV "
                         "cache can never use (the A/B of session 33's switch)")
    ap.add_argument("--host-adapters", type=int, default=128,
                    help="adapters the host tier holds; 0: the memory plan's default host tier")
    ap.add_argument("--adapter-dir", help="where adapter files go (default: a temporary directory)")
    ap.add_argument("--distinct-files", type=int, default=0,
                    help="write only K adapter directories and load adapter i from directory i %% K (each name is "
                         "still a distinct adapter to the engine: its own pages, host copy and disk reloads); "
                         "0 = one directory per adapter. Makes 2048 Llama-3-8B adapters (84 MB each) fit one disk.")
    ap.add_argument("--merge", action="store_true", help="merge rows into an existing result file (runs split by --counts)")
    ap.add_argument("--keep-between-rows", action="store_true",
                    help="keep the adapters registered (and resident) from row to row, as before session 43: a cold "
                         "batch may then find earlier rows' adapters in the pool or host tier (default: every "
                         "(count, popularity) starts from an empty cache)")
    ap.add_argument("--preload", action="store_true",
                    help="read every adapter at registration (default: header-only, registered on the disk tier)")
    ap.add_argument("--load-threads", type=int, default=8, help="threads calling engine.load_adapter")
    ap.add_argument("--adapter-finish", default=None, choices=("host", "device"),
                    help="Engine(adapter_finish=...): where reloaded adapters get the pool layout (default: the "
                         "engine's, device on CUDA, host on the CPU; sessions 12, 13, 38); rows record the one used")
    ap.add_argument("--io-threads", type=int, default=None,
                    help="Engine(adapter_io_threads=...): threads reading adapters from disk (default: the engine's)")
    ap.add_argument("--host-map-ahead", type=float, default=None, metavar="GB",
                    help="Engine(host_arena_map_ahead_bytes=GB * 1e9): the host tier's chunks mapped and pinned on a "
                         "background thread from the engine's start; 0: as adapters need them (default: the engine's, "
                         "a pool's worth once the adapters outgrow the pool, on a discrete GPU)")
    ap.add_argument("--read-batch-bytes", type=int, default=None,
                    help="runtime.adapters.image._BATCH_B_BYTES: images with at most this many lora_B bytes are read "
                         "with every lora_B in the scratch and one transpose per module; 0: in 1 MiB groups, one "
                         "transpose per (layer, module), what ran before session 28 (default: the module's)")
    ap.add_argument("--check-chunk", type=int, default=None, metavar="ELEMENTS",
                    help="runtime.adapters.image._CHECK_CHUNK: elements per numpy reduction of the disk -> host "
                         "read's finite check (two per chunk, each giving the GIL up; default: the module's)")
    add_pipe_piece_bytes_arg(ap)
    add_parallel_finish_arg(ap)
    add_urgent_read_wait_arg(ap)
    add_torch_threads_arg(ap)
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--switch-interval", type=float, default=None,
                    help="sys.setswitchinterval (seconds; Python's default is 0.005): how long a thread back from I/O "
                         "may wait for the GIL behind the engine's thread")
    ap.add_argument("--sample-threads", action="store_true",
                    help="sample where every Python thread is (every 1 ms) during each timed batch: rows get "
                         "thread_samples (a GIL-contention diagnostic; _common.ThreadSampler)")
    args = ap.parse_args()
    if args.switch_interval:  # (the engine sets it too: Engine(gil_switch_interval=...) below)
        sys.setswitchinterval(args.switch_interval)
    from multilora.runtime.adapters import image as image_mod
    if args.read_batch_bytes is not None:
        image_mod._BATCH_B_BYTES = args.read_batch_bytes
    from multilora.runtime import scheduler as scheduler_mod
    set_urgent_read_wait(args.urgent_read_wait)
    if args.check_chunk is not None:
        if args.check_chunk < 1:
            ap.error(f"--check-chunk: expected a positive number of elements, got {args.check_chunk}")
        image_mod._CHECK_CHUNK = args.check_chunk
    set_pipe_piece_bytes(args.pipe_piece_bytes)
    set_parallel_finish(args.parallel_finish)

    counts = positive_ints(ap, "--counts", args.counts, "positive integers")
    pops = [p.strip() for p in args.popularity.split(",") if p.strip()]
    if not pops or any(p not in ("zipf", "uniform") for p in pops):
        ap.error(f"--popularity: expected comma-separated zipf / uniform, got {args.popularity!r}")
    at_least(ap, ("--rank", args.rank, 1), ("--batch", args.batch, 1), ("--prompt-len", args.prompt_len, 1),
             ("--gen", args.gen, 1), ("--pool-adapters", args.pool_adapters, 0),
             ("--host-adapters", args.host_adapters, 0), ("--distinct-files", args.distinct_files, 0),
             ("--load-threads", args.load_threads, 1))
    out = Path(args.out)
    try:  # before any work: a run whose results cannot be written is lost
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        ap.error(f"--out: cannot make the directory {str(out)!r}: {e.strerror or e}")
    threads = set_torch_threads(args.torch_threads)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    config = ModelConfig(**MODEL_SHAPES[args.shape])
    root = Path(args.adapter_dir or tempfile.mkdtemp(prefix="multilora-bench-"))
    if not args.adapter_dir:  # ours to remove (a Llama-3-8B run writes GBs of adapters)
        atexit.register(shutil.rmtree, root, True)
    root.mkdir(parents=True, exist_ok=True)
    n_files = args.distinct_files or max(counts)
    dirs = write_adapters(root, config, min(n_files, max(counts)), args.rank, dtype)

    layout = AdapterPool(config, num_bytes=1 << 20, max_rank=args.rank, dtype=dtype, device="meta")  # sizes only
    adapter_bytes = layout.page_bytes * layout.max_adapter_pages
    engine = Engine(config, device=device, dtype=dtype, progress=False, max_batch_size=args.batch,
                    adapter_finish=args.adapter_finish, adapter_pool_fill=args.adapter_pool_fill,
                    **({"adapter_io_threads": args.io_threads} if args.io_threads else {}),
                    **({"host_arena_map_ahead_bytes": int(args.host_map_ahead * 1e9)}
                       if args.host_map_ahead is not None else {}),
                    **({"gil_switch_interval": args.switch_interval} if args.switch_interval else {}),
                    max_seq_len=args.prompt_len + args.gen + 1, max_lora_rank=args.rank,
                    **({"adapter_slots": args.pool_adapters} if args.pool_adapters else {}),
                    **({"host_adapter_bytes": args.host_adapters * adapter_bytes} if args.host_adapters else {}))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, config.vocab_size, (args.prompt_len,), generator=g).tolist() for _ in range(args.batch)]
    run_once(engine, prompts, [None] * args.batch, 4)  # warm-up: kernels, allocator, autotuners at full batch
    base_s, base_tok = min(run_once(engine, prompts, [None] * args.batch, args.gen) for _ in range(2))
    rows = []
    meta = {"device": torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu",
            "torch": torch.__version__, "torch_threads": threads, "shape": args.shape, "dtype": str(dtype), "rank": args.rank,
            "batch": args.batch, "prompt_len": args.prompt_len, "gen": args.gen,
            "pool_adapters": engine.pool.num_pages // max_adapter_pages(config, args.rank),
            "host_adapters": engine.stats()["host_tier_budget"] // adapter_bytes,
            "pool_from_plan": not args.pool_adapters, "host_from_plan": not args.host_adapters,
            "adapter_pool_fill": args.adapter_pool_fill, "pool_max_slots": engine.pool.max_slots,
            "pool_bytes": engine.pool.bytes_total,
            "base_tokens_per_s": base_tok / base_s, "adapter_finish": "device" if engine.raw_reloads else "host",
            "read_batch_bytes": image_mod._BATCH_B_BYTES, "check_chunk": image_mod._CHECK_CHUNK,
            "pipe_piece_bytes": image_mod.PIPELINE_PIECE_BYTES, "parallel_finish": image_mod.PARALLEL_FINISH,
            "urgent_read_wait": scheduler_mod.URGENT_READ_WAIT,
            "adapter_io_threads": engine.engine_config.adapter_io_threads,
            "host_arena_map_ahead_bytes": engine.engine_config.host_arena_map_ahead_bytes,
            "host_arena_map_ahead_on_overflow": engine.cache.map_ahead_on_overflow}
    # warm-up on a throw-away adapter, unloaded again: Engine.warmup (every step class's kernels, the decode and
    # piecewise graphs, the device finish's kernels) as a serving engine runs it, then a LoRA batch at full size.
    # Without Engine.warmup the first row compiled kernels inside its timed steps (session 15: 38% of the step
    # thread's samples in Triton's compiler in a cold row); each row now counts its compiles (kernel_compiles).
    engine.load_adapter("warmup", dirs[0])
    warm = engine.warmup("warmup")
    meta["warmup_seconds"], meta["warmup_kernel_compiles"] = warm["seconds"], warm["kernel_compiles"]
    run_once(engine, prompts, ["warmup"] * args.batch, 4)
    engine.unload_adapter("warmup")
    loaded = 0
    stem = f"adapter_throughput_{args.shape}"
    path = out / f"{stem}.json"
    earlier = json.loads(path.read_text()) if args.merge and path.is_file() else []

    def register(lo: int, hi: int) -> float:
        """Register adapters a{lo}..a{hi - 1} (preload=False: header-only validation, on the disk tier, read on
        first use); the seconds it took."""
        t_load = time.perf_counter()
        with ThreadPoolExecutor(args.load_threads) as ex:  # load_adapter is thread-safe
            list(tqdm(ex.map(lambda i: engine.load_adapter(f"a{i}", dirs[i % len(dirs)], preload=args.preload),
                             range(lo, hi)),
                      total=hi - lo, desc=f"loading adapters {lo}..{hi - 1}", disable=hi - lo < 64))
        return time.perf_counter() - t_load

    for n in sorted(counts):
        if args.keep_between_rows:
            if n < loaded:  # counts ascend; start again only if asked for fewer
                for name in engine.list_adapters():
                    engine.unload_adapter(name)
                loaded = 0
            load_s, loaded = register(loaded, n), n
        for pop in pops:
            if not args.keep_between_rows:  # an empty cache: the rows before leave nothing resident
                for name in engine.list_adapters():
                    engine.unload_adapter(name)
                load_s = register(0, n)
            for phase in ("cold", "warm"):  # first batch after registration, then a fresh draw of the same mix
                names = [f"a{i}" for i in popularity(pop, n, args.batch, g)]
                before, pipes0 = engine.stats(), image_mod.pipeline_counts()
                waits: list[float] = []
                with ThreadSampler() if args.sample_threads else contextlib.nullcontext() as sampler:
                    secs, toks = run_once(engine, prompts, names, args.gen, waits)
                after, pipes = engine.stats(), image_mod.pipeline_counts()
                moved = sum(after[k] - before[k] for k in ("bytes_host_to_gpu", "bytes_gpu_to_host", "bytes_disk_to_host"))
                loads = after["gpu_misses"] - before["gpu_misses"] + after["prefetch_to_gpu"] - before["prefetch_to_gpu"]
                row = {**meta, "adapters": n, "popularity": pop, "phase": phase, "load_seconds_new_adapters": load_s,
                       "distinct_in_batch": len(set(names)), "keep_between_rows": args.keep_between_rows,
                       "distinct_read_from_disk": after["disk_to_host_reads"] - before["disk_to_host_reads"],
                       # the disk -> host reads through the pipelined finish's choice (image.PIPELINE_COLD_ONLY)
                       **{f"reads_{k}": pipes[k] - pipes0[k] for k in pipes},
                       "tokens_per_s": toks / secs, "vs_no_adapter": (toks / secs) / (base_tok / base_s),
                       "bytes_moved_per_s": moved / secs,
                       "bytes_disk_to_host": after["bytes_disk_to_host"] - before["bytes_disk_to_host"],
                       "bytes_host_to_gpu": after["bytes_host_to_gpu"] - before["bytes_host_to_gpu"],
                       "prefetch_hit_rate": ((after["prefetch_hits"] - before["prefetch_hits"]) / loads  # None:
                                             if loads else None),  # nothing was loaded
                       "queue_wait_s_total": after["queue_wait_seconds_total"] - before["queue_wait_seconds_total"],
                       "queue_wait_s_max": max(waits, default=0.0),  # this row's requests (the engine's is lifetime)
                       "gpu_evictions": after["gpu_evictions"] - before["gpu_evictions"],
                       **move_rates(before, after),
                       # where the time went (diagnostics): steps by kind, defers, reads and their summed seconds
                       **{k: after[k] - before[k] for k in ("steps", "prefill_steps", "decode_steps", "mixed_steps",
                                                            "queue_defers_for_adapter_load", "queue_waits_for_adapter",
                                                            "queue_urgent_waits_for_adapter_read",
                                                            "disk_to_host_reads", "disk_to_host_seconds",
                                                            "host_to_gpu_copies", "host_misses", "host_hits",
                                                            "pool_compactions", "pool_bytes_compacted",
                                                            "host_arena_map_seconds", "host_arena_pin_seconds",
                                                            "host_arena_sync_map_seconds",
                                                            "host_arena_sync_grows",
                                                            "host_arena_grown_ahead")
                          if isinstance(after.get(k), (int, float)) and isinstance(before.get(k), (int, float))},
                       "step_seconds": after.get("step_seconds"),
                       **compiles_between(before, after),  # Triton compiles inside the row (warm-up missed them)
                       **({"thread_samples": sampler.report()} if sampler is not None else {})}
                rows.append(row)
                print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items() if k not in meta}),
                      flush=True)
                path.write_text(json.dumps(_merged(earlier, rows), indent=1))  # after every row: Ctrl-C keeps them
    rows = _merged(earlier, rows)
    path.write_text(json.dumps(rows, indent=1))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        for pop in pops:
            for phase, ls in (("warm", "-"), ("cold", ":")):
                pts = [(r["adapters"], r["vs_no_adapter"]) for r in rows if r["popularity"] == pop and r.get("phase") == phase]
                if pts:
                    ax.plot(*zip(*pts), marker="o", ls=ls, label=f"{pop}, {phase}")
        ax.axhline(0.85, ls="--", c="gray", label="target 85%")
        ax.set_xscale("log")
        ax.set_xlabel("distinct adapters loaded")
        ax.set_ylabel("tokens/s vs no adapter")
        ax.set_title(f"{args.shape}, r={args.rank}, batch {args.batch}, pool {meta['pool_adapters']} adapters")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / f"{stem}.png", dpi=120)
    except ImportError:
        print("matplotlib not installed: no plot")


if __name__ == "__main__":
    main()
