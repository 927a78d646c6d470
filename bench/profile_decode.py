"""Where a decode step's GPU time goes: a kernel-level profile of the engine's decode step (issue 6).

A random-weight model of a real shape (default Llama-3-8B, bf16) on CUDA; B requests of --prompt-len random
tokens (no adapters, or request i on adapter a<i> with --lora), prefilled, then --steps decode steps run under
``torch.profiler`` (CPU + CUDA activities; kernels replayed from CUDA graphs are traced too). Printed:

- wall ms per step (host clock, step call to step call, the median; no synchronization between them, so with
  async scheduling a step's host work overlaps the GPU's step before: ``--sync`` for the old behaviour) and GPU
  kernel ms per step (sum of kernel times);
- the kernels grouped by name: calls per step, us per call, share of kernel time;
- for each weight GEMM shape of the model at M = B tokens, ``x @ W.t()`` alone (CUDA events, median of 50):
  its time and the weight bytes it reads over that time against the copy bandwidth (the ceiling of a
  weight-bound step).

    python bench/profile_decode.py                    # H200: ~1 min
    python bench/profile_decode.py --batch 64 --lora
    python bench/profile_decode.py --batch 40 --lora --rank 8 --targets qkvo --distinct 40 --mixed-tokens 256 --mixed-miss
    python bench/profile_decode.py --batch 8 --lora --mixed-tokens 64 --mixed-miss --sync-audit   # host syncs per site
    python bench/profile_decode.py --json bench/results/profile_decode.json
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

from multilora import Engine, SamplingParams
from multilora.config import TARGET_MODULES, ModelConfig
from multilora.runtime.weights import MODEL_SHAPES

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import copy_bandwidth, write_adapter  # noqa: E402


def gemm_table(cfg: ModelConfig, B: int, dtype: torch.dtype, device: torch.device, bw: float) -> list[dict]:
    shapes = {"qkv": (cfg.q_size + 2 * cfg.kv_size, cfg.hidden_size), "o": (cfg.hidden_size, cfg.q_size),
              "gate_up": (2 * cfg.intermediate_size, cfg.hidden_size), "down": (cfg.hidden_size, cfg.intermediate_size),
              "lm_head": (cfg.vocab_size, cfg.hidden_size)}
    rows = []
    for name, (n, k) in shapes.items():
        w = torch.randn(n, k, device=device, dtype=dtype)
        x = torch.randn(B, k, device=device, dtype=dtype)
        for _ in range(5):
            x @ w.t()
        ts = []
        for _ in range(50):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            x @ w.t()
            e.record()
            e.synchronize()
            ts.append(s.elapsed_time(e) / 1e3)
        t = statistics.median(ts)
        gbps = w.numel() * w.element_size() / t / 1e9
        rows.append({"gemm": name, "n": n, "k": k, "us": t * 1e6, "weight_gbps": gbps, "frac_of_copy": gbps / bw})
        del w, x
    return rows


def sync_audit(step, steps: int) -> dict[str, int]:
    """Run ``step()`` ``steps`` times under ``torch.cuda.set_sync_debug_mode("warn")`` and count the warnings it gives
    (a pageable host -> device copy, ``.item()``, a stream or device synchronize...) by the innermost multilora frame
    that made the call: ``{"path:line function": count}``. An event's ``synchronize`` (the engine's read-back) is not
    reported by the mode."""
    import traceback
    import warnings

    sites: dict[str, int] = defaultdict(int)
    shown = warnings.showwarning

    def hook(message, category, filename, lineno, file=None, line=None):  # (warnings.showwarning's signature)
        text = str(message).lower()
        if "synchroniz" not in text or "prototype feature" in text:  # (the mode's own notice when it is set)
            return shown(message, category, filename, lineno, file, line)
        frames = [f for f in traceback.extract_stack()[:-1] if "multilora" in f.filename and "/bench/" not in f.filename]
        f = frames[-1] if frames else None
        sites[f"{f.filename.split('multilora/')[-1]}:{f.lineno} {f.name}" if f else f"{filename}:{lineno}"] += 1

    torch.cuda.synchronize()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = hook
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(steps):
                step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    return dict(sites)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="llama3-8b", choices=sorted(MODEL_SHAPES))
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--lora", action="store_true",
                    help="request i on adapter a<i mod --distinct> (rank --rank on --targets; default its own)")
    ap.add_argument("--rank", type=int, default=16, help="the adapters' rank (with --lora; default 16)")
    ap.add_argument("--targets", choices=("all", "qkvo"), default="all",
                    help="the adapters' target modules: all seven projections, or q/k/v/o (issue 13's S1 set)")
    ap.add_argument("--distinct", type=int, default=None,
                    help="with --lora: how many distinct adapters the batch's requests take in turn (default: one "
                         "each); a mixed step's decode rows then run that many adapters")
    ap.add_argument("--mixed-miss", action="store_true",
                    help="with --mixed-tokens and --lora: each step's new request takes an adapter not used before "
                         "(registered, not on the GPU: a pool miss copied in by that step), not a0")
    ap.add_argument("--no-cuda-graphs", action="store_true")
    ap.add_argument("--torch-ops", action="store_true",
                    help="RMSNorm / RoPE + KV write / SiLU-mul as torch ops instead of the fused Triton kernels")
    ap.add_argument("--mixed-tokens", type=int, default=0,
                    help="profile mixed steps instead: before each step a new request of this many prompt tokens "
                         "(max_tokens 1) joins, so every step carries the batch's decode rows and one prompt chunk")
    ap.add_argument("--weight-dtype", choices=["bf16", "fp8"], default="bf16",
                    help="base linear weights: bf16, or fp8 (e4m3, Engine(weight_dtype='fp8'); Hopper and newer)")
    ap.add_argument("--no-pdl", action="store_true",
                    help="launch every Triton kernel plainly (kernels.triton_pdl.ENABLED and triton_sgmv.PDL off): "
                         "with programmatic dependent launch a kernel starts while the one before drains and waits, "
                         "so its profiled time includes that wait and the kernels' times overlap")
    ap.add_argument("--sync", action="store_true",
                    help="read each step back before launching the next (EngineConfig.async_scheduling=False; the "
                         "default on CUDA launches a step before reading the step before back)")
    ap.add_argument("--sync-audit", action="store_true",
                    help="after the profile, run --steps more steps under torch's sync debug mode ('warn') and print "
                         "where in multilora each host-synchronizing CUDA call came from (file:line, count): a step "
                         "should wait for the GPU only in its read-back (an event, which the mode does not report)")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    logging.getLogger("multilora").setLevel(logging.ERROR)
    if not torch.cuda.is_available():
        ap.error("needs CUDA")
    dev, dtype = torch.device("cuda"), torch.bfloat16
    if args.torch_ops:
        from multilora.kernels import fused
        fused._kernels = lambda backend, x: None
    if args.no_pdl:
        from multilora.kernels import triton_pdl, triton_sgmv
        triton_pdl.ENABLED = triton_sgmv.PDL = False
    cfg = ModelConfig(**MODEL_SHAPES[args.shape])
    bw, _ = copy_bandwidth(dev)
    total_steps = args.steps * (2 if args.sync_audit else 1) + 8  # steps every running request lives through
    distinct = min(args.distinct or args.batch, args.batch)
    if args.mixed_miss and not (args.lora and args.mixed_tokens):
        ap.error("--mixed-miss needs --lora and --mixed-tokens")
    engine = Engine(cfg, device=dev, dtype=dtype, progress=False,
                    max_batch_size=max(args.batch, 1) + (1 if args.mixed_tokens else 0),
                    max_seq_len=max(args.prompt_len + 2 * total_steps + 16, args.mixed_tokens + 16),
                    max_lora_rank=args.rank,
                    adapter_slots=distinct + (total_steps + 2 if args.mixed_miss else 2) if args.lora else 1,
                    adapter_pool_share=0.3 if args.lora else None, cuda_graphs=not args.no_cuda_graphs,
                    weight_dtype="fp8" if args.weight_dtype == "fp8" else None,
                    async_scheduling=False if args.sync else None)
    names = None
    tmp = tempfile.TemporaryDirectory()
    fresh: list[str] = []  # --mixed-miss: the new requests' adapters, each used once
    if args.lora:
        modules = TARGET_MODULES if args.targets == "all" else ("q_proj", "k_proj", "v_proj", "o_proj")
        files = [write_adapter(Path(tmp.name) / f"a{i}", cfg, seed=i, rank=args.rank, dtype=dtype, modules=modules)
                 for i in range(distinct)]
        names = [f"a{i % distinct}" for i in range(args.batch)]
        for i in range(distinct):
            engine.load_adapter(f"a{i}", files[i])
        if args.mixed_miss:  # the same weights under new names: each a distinct adapter to the engine
            fresh = [f"m{i}" for i in range(total_steps)]
            for i, n in enumerate(fresh):
                engine.load_adapter(n, files[i % distinct])
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, cfg.vocab_size, (args.prompt_len,), generator=g).tolist() for _ in range(args.batch)]
    sp = SamplingParams(max_tokens=total_steps + 8, ignore_eos=True, temperature=0.0)  # all running to the end
    engine.generate(prompts, adapters=names, sampling=SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0))
    for i, p in enumerate(prompts):
        engine.add_request(p, names[i] if names else None, sp)
    while engine.scheduler.waiting:
        engine.step()
    one = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0.0)

    def step() -> None:
        if args.mixed_tokens:  # a fresh prompt each step: its one chunk rides beside the decode rows
            p = torch.randint(0, cfg.vocab_size, (args.mixed_tokens,), generator=g).tolist()
            engine.add_request(p, fresh.pop() if fresh else names[0] if names else None, one)
        engine.step()

    for _ in range(4):  # untimed: the steps' first runs (graph captures)
        step()
    torch.cuda.synchronize()

    enq: list[float] = []  # host time of each step's forward call: its launches are queued when it returns
    run = engine.runner.run

    def timed_run(*a, **k):
        t = time.perf_counter()
        out = run(*a, **k)
        enq.append(time.perf_counter() - t)
        return out

    engine.runner.run = timed_run
    before = dict(engine._counters)
    mark = engine.step_times.observed
    misses0 = engine.cache.stats.gpu_misses
    walls = []  # step to step, no sync between (async scheduling overlaps a step's host work with the one before)
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step()
        t1 = time.perf_counter()
        walls.append(t1 - t0)
        t0 = t1
    torch.cuda.synchronize()
    kinds = {k: engine._counters[k] - before.get(k, 0) for k in ("decode_steps", "mixed_steps", "prefill_steps")}
    misses = engine.cache.stats.gpu_misses - misses0
    ph = [p for p in engine.step_times.phases_since(mark) if p]
    phases = {n[:-2]: statistics.median(p[n] for p in ph) * 1e3 for n in (ph[0] if ph else {}) if n.endswith("_s")}
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(4):
            step()
        torch.cuda.synchronize()
    kern: dict[str, list[float]] = defaultdict(list)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            kern[ev.name].append(ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total)
    # steps the trace holds: the profiler can miss the first replay; each step reads its ids back once
    steps_prof = sum(len(v) for n, v in kern.items() if "DtoH" in n) or 4
    total_us = sum(sum(v) for v in kern.values())
    wall_ms = statistics.median(walls) * 1e3
    print(f"profiled {steps_prof} steps; step kinds {dict(kinds)}; mixed tokens {args.mixed_tokens}")
    print(f"host time of the forward call (runner.run; launches queued, not waited for): median "
          f"{statistics.median(enq[: args.steps]) * 1e3:.3f} ms")
    lora = (f"{distinct} adapters of rank {args.rank} on {args.targets}" + (", a pool miss per step" if args.mixed_miss
                                                                          else "") if args.lora else "no adapters")
    print(f"pool misses in the timed steps: {misses}; the steps' host phases (Engine.step; median ms): "
          + ", ".join(f"{n} {v:.3f}" for n, v in phases.items()))
    print(f"{args.shape} {args.weight_dtype} weights, batch {args.batch}, {lora}, "
          f"cuda_graphs={not args.no_cuda_graphs}, ops={'torch' if args.torch_ops else 'triton'}, pdl={not args.no_pdl}, "
          f"async_scheduling={engine._async}; copy bandwidth {bw:.0f} GB/s")
    wbytes = engine.model.nbytes - (0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size * 2)
    print(f"wall {wall_ms:.3f} ms/step (median of {args.steps}); GPU kernels {total_us / steps_prof / 1e3:.3f} ms/step "
          f"over {sum(len(v) for v in kern.values()) / steps_prof:.0f} kernels/step; weights {wbytes / 1e9:.2f} GB -> "
          f"{wbytes / (wall_ms / 1e3) / 1e9:.0f} GB/s = {wbytes / (wall_ms / 1e3) / 1e9 / bw:.1%} of copy")
    rows = sorted(((n, len(v) / steps_prof, sum(v) / len(v), sum(v) / total_us) for n, v in kern.items()),
                  key=lambda r: -r[2] * r[1])
    print(f"\n{'calls/step':>10} {'us/call':>9} {'share':>7}  kernel")
    for n, c, us, sh in rows[: args.top]:
        print(f"{c:10.1f} {us:9.2f} {sh:7.1%}  {n[:110]}")
    cpu = sorted((e for e in prof.key_averages() if e.self_cpu_time_total > 0), key=lambda e: -e.self_cpu_time_total)
    cpu_total = sum(e.self_cpu_time_total for e in cpu)
    print(f"\nhost (CPU) self time under the profiler: {cpu_total / steps_prof / 1e3:.3f} ms/step (profiler overhead "
          f"included); top ops:")
    for e in cpu[:15]:
        print(f"{e.count / steps_prof:10.1f} {e.self_cpu_time_total / e.count:9.2f} "
              f"{e.self_cpu_time_total / cpu_total:7.1%}  {e.key[:100]}")
    gt = gemm_table(cfg, args.batch, dtype, dev, bw)
    print(f"\nGEMMs alone at M={args.batch}:")
    for r in gt:
        print(f"  {r['gemm']:<8} [{r['n']}x{r['k']}] {r['us']:8.1f} us  {r['weight_gbps']:6.0f} GB/s  {r['frac_of_copy']:.1%}")
    per_layer = sum(r["us"] for r in gt if r["gemm"] != "lm_head")
    lm = next(r["us"] for r in gt if r["gemm"] == "lm_head")
    print(f"  GEMMs of one step: {(per_layer * cfg.num_layers + lm) / 1e3:.3f} ms")
    audit = sync_audit(step, args.steps) if args.sync_audit else None
    if audit is not None:
        print(f"\nhost syncs in {args.steps} steps under sync debug mode (site: count): "
              + ("none" if not audit else ""))
        for where, n in sorted(audit.items(), key=lambda kv: -kv[1]):
            print(f"{n:8d}  {where}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"shape": args.shape, "batch": args.batch, "lora": args.lora,
                                         "rank": args.rank, "targets": args.targets, "distinct": distinct,
                                         "mixed_miss": args.mixed_miss, "pool_misses": misses,
                                         "sync_audit": audit,
                                         "phase_ms": phases,
                                         "mixed_tokens": args.mixed_tokens, "step_kinds": kinds,
                                         "weight_dtype": args.weight_dtype, "async_scheduling": engine._async,
                                         "host_forward_ms": statistics.median(enq[: args.steps]) * 1e3,
                                         "copy_gbps": bw, "wall_ms": wall_ms, "gpu_kernel_ms": total_us / steps_prof / 1e3,
                                         "kernels": [{"name": n, "calls_per_step": c, "us_per_call": us, "share": sh}
                                                     for n, c, us, sh in rows],
                                         "gemms": gt, "torch": torch.__version__,
                                         "gpu": torch.cuda.get_device_name()}, indent=1))
    tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
