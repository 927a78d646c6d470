"""Microbenchmark of the LoRA apply op (shrink + expand) on a GPU: ours against what users would run.

Providers, side by side on every row (bf16, every token has an adapter):
  ours        ``lora_apply_triton`` over the paged pool (one shrink + one expand launch per fused group)
  loop        a torch loop over the batch's distinct adapters, dense A/B per adapter (what PEFT does)
  gather_bmm  gather each token's A and B (dense stacks) and two ``torch.bmm``
  base        the base layer's own GEMM ``x W^T`` over the same fused output width

Ceilings measured in the same run: device-to-device copy bandwidth (bytes read + written) and an
8192^3 bf16 GEMM. Times are medians of ``triton.testing.do_bench``; for T <= 512 tokens ours, gather_bmm
and base are captured in CUDA graphs (``do_bench_cudagraph``); the loop runs eagerly, as PEFT does.
Each timed call cycles through K disjoint sets of adapters/weights/activations (K chosen so a call moves
>= 200 MB) so that repeated runs do not measure the 60 MB L2.

Usage: python bench/bench_lora_kernels.py --out bench/results [--quick]
Writes ``lora_kernels.json`` (hardware, versions, ceilings, one row per shape with every field) and
``lora_kernels.png``; ``--plot FILE.json`` only redraws the plot from a results file.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import time

import torch

GB = 1e9
HERE = os.path.dirname(os.path.abspath(__file__))

# name -> (d_in, [d_out of each fused slice])
GROUPS = {
    "8b-qkv": (4096, [4096, 1024, 1024]),
    "8b-o": (4096, [4096]),
    "8b-gate_up": (4096, [14336, 14336]),
    "8b-down": (14336, [4096]),
    "70b-qkv": (8192, [8192, 1024, 1024]),
    "70b-gate_up": (8192, [28672, 28672]),
    "70b-down": (28672, [8192]),
}
LAYER_8B = ["8b-qkv", "8b-o", "8b-gate_up", "8b-down"]  # the seven projections of a Llama-3-8B layer


# ---------------------------------------------------------------------------------------------- setup
def group_config(d_in: int, d_outs: list[int]):
    """A one-layer ModelConfig whose q/k/v (or gate/up, or o/down) modules have the group's shapes."""
    from multilora.config import ModelConfig

    if len(d_outs) == 3:  # q/k/v: hidden = d_in, q = heads * head_dim, kv = kv_heads * head_dim
        hd = min(128, d_outs[1])  # (128 at every real shape; a smoke run's tiny groups take their k width)
        cfg = ModelConfig(16, d_in, 256, 1, d_outs[0] // hd, d_outs[1] // hd, head_dim=hd)
        return cfg, ["q_proj", "k_proj", "v_proj"]
    if len(d_outs) == 2:  # gate/up: hidden = d_in, intermediate = d_out
        return ModelConfig(16, d_in, d_outs[0], 1, 1, 1, head_dim=d_in), ["gate_proj", "up_proj"]
    if d_in > d_outs[0]:  # down: intermediate -> hidden
        return ModelConfig(16, d_outs[0], d_in, 1, 1, 1, head_dim=d_outs[0]), ["down_proj"]
    return ModelConfig(16, d_outs[0], 256, 1, 1, 1, head_dim=d_in), ["o_proj"]


def synthetic_pool(d_in, d_outs, n_adapters, rank, pool_rank=None, *, device="cuda", dtype=torch.bfloat16):
    """A pool with ``n_adapters`` resident adapters of one rank on the group's modules, random weights written
    straight into the buffer on ``device`` (bench only: ranks / scalings / offsets are set as ``AdapterPool.load``
    would, with the adapters' extents in a shuffled order). ``pool_rank``: the pool's ``max_rank`` (the kernels'
    RMAX, which picks their tiles), default ``rank``. Returns (pool, the group's ``LoRASlices``)."""
    from multilora.config import MODULE_INDEX
    from multilora.kernels import lora_slices
    from multilora.memory.pool import PAGE_ELEMS, AdapterPool, image_layout

    cfg, modules = group_config(d_in, d_outs)
    rel, pages = image_layout(cfg, {(0, m): rank for m in modules})
    pool = AdapterPool(cfg, num_bytes=n_adapters * pages * PAGE_ELEMS * torch.empty((), dtype=dtype).element_size(),
                       max_rank=pool_rank or rank, max_slots=n_adapters, dtype=dtype, device=device)
    pool.buffer.normal_(0, 0.02)
    base = torch.randperm(n_adapters, dtype=torch.int64) * pages * PAGE_ELEMS  # [n_adapters] extent starts
    for m in modules:
        mi = MODULE_INDEX[m]
        off_a = base + rel[(0, m)]
        pool.offsets_a[0, mi] = off_a.to(pool.device)
        pool.offsets_b[0, mi] = (off_a + rank * cfg.module_shape(m)[0]).to(pool.device)
        pool.ranks[0, mi] = rank
        pool.scalings[0, mi] = 2.0
    return pool, lora_slices([pool.module_view(0, m) for m in modules])


def assign(popularity, T, n, gen):
    """Index (0..n-1) of each token's adapter."""
    if popularity == "distinct":
        return torch.arange(T) % n
    if popularity == "uniform":
        return torch.randint(0, n, (T,), generator=gen)
    if popularity == "zipf":
        p = 1.0 / torch.arange(1, n + 1, dtype=torch.float64)
        return torch.multinomial(p, T, replacement=True, generator=gen)
    raise ValueError(popularity)


# ---------------------------------------------------------------------------------------------- providers
def make_providers(slices, plans, xs, ys, slot_lists, weights):
    from multilora.kernels import gather_adapter
    from multilora.kernels.triton_sgmv import lora_apply_triton

    views = slices.views
    d_outs = [v.d_out for v in views]
    cols = [sum(d_outs[:i]) for i in range(len(d_outs))]
    dense = []  # per slice: A [n_all, r, d_in], Bt [n_all, r, d_out], scaling [n_all]
    n_all = slices.max_slots
    for v in views:
        ab = [gather_adapter(v, s) for s in range(n_all)]
        dense.append((torch.stack([a for a, _, _, _ in ab]), torch.stack([bt for _, bt, _, _ in ab]),
                      torch.tensor([sc for _, _, sc, _ in ab], device="cuda")))
    loops = []  # per set: [(slot, token index)] of its distinct adapters
    for sl in slot_lists:
        loops.append([(int(s), (sl == s).nonzero().flatten().cuda()) for s in torch.unique(sl).tolist()])
    scale = [[float(x) for x in sc.tolist()] for _, _, sc in dense]  # Python floats, as PEFT holds them
    slots_dev = [sl.cuda() for sl in slot_lists]

    def ours():
        for p, x, y in zip(plans, xs, ys):
            lora_apply_triton(y, x, slices, p)

    def loop():
        for lp, x, y in zip(loops, xs, ys):
            for i, (a_all, bt_all, sc) in enumerate(dense):
                ysl = y[:, cols[i] : cols[i] + d_outs[i]]
                for s, idx in lp:
                    delta = (x.index_select(0, idx) @ a_all[s].t()) @ bt_all[s]
                    ysl.index_add_(0, idx, delta, alpha=scale[i][s])

    def gather_bmm():
        for sl, x, y in zip(slots_dev, xs, ys):
            for i, (a_all, bt_all, sc) in enumerate(dense):
                v = torch.bmm(a_all.index_select(0, sl), x.unsqueeze(-1))  # [T, r, 1]
                d = torch.bmm(bt_all.index_select(0, sl).transpose(1, 2), v).squeeze(-1)  # [T, d_out]
                y[:, cols[i] : cols[i] + d_outs[i]] += d * sc.index_select(0, sl)[:, None].to(d.dtype)

    def base():
        for w, x, y in zip(weights, xs, ys):
            torch.matmul(x, w.t(), out=y)

    return {"ours": ours, "loop": loop, "gather_bmm": gather_bmm, "base": base}


def time_ms(fn, graph: bool) -> float:
    import triton.testing as tt

    fn()
    torch.cuda.synchronize()
    if graph:
        return tt.do_bench_cudagraph(fn, rep=30, return_mode="median")
    return tt.do_bench(fn, warmup=10, rep=60, return_mode="median")


# ---------------------------------------------------------------------------------------------- rows
def bench_row(group, T, rank, n, popularity, ceil, *, providers=("ours", "loop", "gather_bmm", "base"), block_m=None):
    from multilora.kernels import build_lora_plan

    d_in, d_outs = GROUPS[group]
    d_out = sum(d_outs)
    n = min(n, T)
    w_bytes = n * rank * (len(d_outs) * d_in + d_out) * 2  # distinct adapters' A (one per slice) and B, bf16
    act_bytes = (T * d_in + 2 * T * d_out) * 2  # x read, y read + written
    K = max(1, min(8, math.ceil(200e6 / (w_bytes + act_bytes))))
    pool, slices = synthetic_pool(d_in, d_outs, K * n, rank)
    gen = torch.Generator().manual_seed(T * 131 + n)
    slot_lists = [assign(popularity, T, n, gen) + k * n for k in range(K)]
    plans = [build_lora_plan(sl, device="cuda", block_m=block_m) for sl in slot_lists]
    xs = [torch.randn(T, d_in, device="cuda", dtype=torch.bfloat16) for _ in range(K)]
    ys = [torch.randn(T, d_out, device="cuda", dtype=torch.bfloat16) for _ in range(K)]
    weights = [torch.randn(d_out, d_in, device="cuda", dtype=torch.bfloat16) * 0.02
               for _ in range(K if "base" in providers else 0)]
    fns = make_providers(slices, plans, xs, ys, slot_lists, weights)
    distinct = int(torch.unique(slot_lists[0]).numel())
    row = dict(group=group, d_in=d_in, d_outs=d_outs, tokens=T, rank=rank, adapters=n,
               distinct_in_batch=distinct, popularity=popularity, sets_per_call=K, dtype="bfloat16",
               block_m=plans[0].block_m, graph=T <= 512)
    for name in providers:
        if name == "gather_bmm" and T * rank * (d_in + d_out) * 2 > 16e9:
            row["gather_bmm_ms"] = None  # the gathered weights would not fit: skipped
            continue
        if name == "loop" and distinct * len(d_outs) > 2048 and T > 512:
            row["loop_ms"] = None
            continue
        graph = T <= 512 and name != "loop"
        row[f"{name}_ms"] = time_ms(fns[name], graph) / K
    # what must move and what must be computed (per call of one set)
    # every fused slice has its own A [r, d_in] (q, k and v: three), so A bytes and FLOPs count it per slice
    w_bytes = distinct * rank * (len(d_outs) * d_in + d_out) * 2
    flops = 2 * T * rank * (len(d_outs) * d_in + d_out)
    t = row["ours_ms"] * 1e-3
    row.update(min_bytes=w_bytes + act_bytes, flops=flops, ours_gbps=(w_bytes + act_bytes) / t / GB,
               ours_tflops=flops / t / 1e12)
    floor = max((w_bytes + act_bytes) / (ceil["copy_gbps"] * GB), flops / (ceil["gemm_tflops"] * 1e12))
    row["roofline"] = "memory" if (w_bytes + act_bytes) / (ceil["copy_gbps"] * GB) >= flops / (ceil["gemm_tflops"] * 1e12) else "compute"
    row["roofline_frac"] = floor / t
    row["bw_frac"] = row["ours_gbps"] / ceil["copy_gbps"]
    for other in ("loop", "gather_bmm"):
        if row.get(f"{other}_ms"):
            row[f"speedup_vs_{other}"] = row[f"{other}_ms"] / row["ours_ms"]
    if row.get("base_ms"):
        row["lora_over_base"] = row["ours_ms"] / row["base_ms"]
    del pool, slices, fns
    torch.cuda.empty_cache()
    return row


def bench_layer(T, n, ceil):
    """Decode target: LoRA on all seven projections of a Llama-3-8B layer vs the layer's base GEMMs
    (both as one CUDA graph: 4 GEMMs, plus 4 lora_apply = 8 launches)."""
    from multilora.kernels import build_lora_plan
    from multilora.kernels.triton_sgmv import lora_apply_triton

    n = min(n, T)
    gen = torch.Generator().manual_seed(T)
    K = 4
    parts = []
    for g in LAYER_8B:
        d_in, d_outs = GROUPS[g]
        pool, slices = synthetic_pool(d_in, d_outs, K * n, 16)
        ws = [torch.randn(sum(d_outs), d_in, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(K)]
        xs = [torch.randn(T, d_in, device="cuda", dtype=torch.bfloat16) for _ in range(K)]
        ys = [torch.empty(T, sum(d_outs), device="cuda", dtype=torch.bfloat16) for _ in range(K)]
        parts.append((pool, slices, ws, xs, ys))
    plans = [build_lora_plan(assign("uniform", T, n, gen) + k * n, device="cuda") for k in range(K)]

    def base():
        for k in range(K):
            for _, _, ws, xs, ys in parts:
                torch.matmul(xs[k], ws[k].t(), out=ys[k])

    def with_lora():
        for k in range(K):
            for _, slices, ws, xs, ys in parts:
                torch.matmul(xs[k], ws[k].t(), out=ys[k])
                lora_apply_triton(ys[k], xs[k], slices, plans[k])

    tb, tl_ = time_ms(base, True) / K, time_ms(with_lora, True) / K
    row = dict(group="8b-layer-7proj", tokens=T, rank=16, adapters=n, popularity="uniform", dtype="bfloat16",
               base_ms=tb, base_plus_lora_ms=tl_, lora_added_frac=(tl_ - tb) / tb, graph=True, sets_per_call=K)
    del parts
    torch.cuda.empty_cache()
    return row


def ceilings():
    import triton.testing as tt

    n = 1 << 30  # 2 GiB of bf16
    src = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    t = tt.do_bench(lambda: dst.copy_(src), warmup=20, rep=200, return_mode="median") * 1e-3
    copy = 2 * n * 2 / t / GB
    del src, dst
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    t = tt.do_bench(lambda: a @ b, warmup=50, rep=300, return_mode="median") * 1e-3
    torch.cuda.empty_cache()
    return {"copy_gbps": copy, "gemm_tflops": 2 * 8192**3 / t / 1e12}


def sweep(quick: bool, subset: str = "all"):
    """(kind, args) of every row; kinds: row, layer."""
    rows = []
    # target 1: decode, every request its own adapter
    for T in (1, 16, 64, 128, 256, 512):
        rows.append(("row", ("8b-qkv", T, 16, T, "distinct")))
    for g in ("8b-o", "8b-gate_up", "8b-down"):
        for T in (64, 512):
            rows.append(("row", (g, T, 16, T, "distinct")))
    # target 2: decode, <= 8 distinct adapters, the whole layer
    for T in (1, 8, 32, 64, 128, 256):
        rows.append(("layer", (T, 8)))
    # popularity
    for T in (64, 512, 2048):
        for pop in ("uniform", "zipf"):
            for n in (8, 64, 512):
                if n <= T:
                    rows.append(("row", ("8b-qkv", T, 16, n, pop)))
    # ranks
    for T in (64, 4096):
        for r in (8, 16, 64, 128):
            rows.append(("row", ("8b-qkv", T, r, 8, "uniform")))
    rows.append(("row", ("8b-qkv", 64, 128, 64, "distinct")))
    # prefill
    for g in ("8b-qkv", "8b-gate_up", "8b-down"):
        for T in (1024, 4096, 8192):
            rows.append(("row", (g, T, 16, 8, "uniform")))
    rows.append(("row", ("8b-qkv", 8192, 16, 1, "uniform")))
    rows.append(("row", ("8b-qkv", 8192, 64, 8, "uniform")))
    # 70B-class layer
    for g in ("70b-qkv", "70b-gate_up", "70b-down"):
        for T in (1, 64, 512, 4096):
            rows.append(("row", (g, T, 16, 8, "uniform")))
        rows.append(("row", (g, 64, 16, 64, "distinct")))
    # SGMV vs BGMV tiles: one kernel, BLOCK_M 16 (one token per chunk at decode) against 64
    for T, n, pop in ((64, 64, "distinct"), (64, 8, "uniform"), (512, 512, "distinct"), (512, 8, "uniform"),
                      (4096, 8, "uniform")):
        for bm in (16, 64):
            rows.append(("variant", ("8b-qkv", T, 16, n, pop, bm)))
    if quick:
        rows = rows[::6]
    if subset == "decode":  # the decode targets: every request its own adapter, the layer, popularity at 64/512
        rows = [(k, a) for k, a in rows if k == "layer" or (k == "row" and a[1] <= 512 and a[0].startswith("8b"))]
    if subset == "prefill":  # the 8B rows of more than 512 tokens, and the layer rows (a second sample of those)
        rows = [(k, a) for k, a in rows if k == "layer" or (k == "row" and a[1] > 512 and a[0].startswith("8b"))]
    return rows


def environment():
    if not torch.cuda.is_available():  # (a CPU smoke run)
        return {"gpu": None, "torch": torch.__version__, "python": sys.version.split()[0],
                "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    props = torch.cuda.get_device_properties(0)
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=20).stdout.strip()
    except Exception as exc:  # noqa: BLE001
        smi = f"unavailable: {exc}"
    import triton

    return {"gpu": props.name, "sms": props.multi_processor_count, "memory_gib": props.total_memory / 2**30,
            "nvidia_smi": smi, "torch": torch.__version__, "triton": triton.__version__,
            "cuda": torch.version.cuda, "python": sys.version.split()[0], "platform": platform.platform(),
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}


def compare(before_path: str, after_path: str) -> int:
    """Print the rows of two runs side by side: our time per case (or the LoRA time a layer adds), and the ratio."""
    with open(before_path) as f:
        before = json.load(f)["rows"]
    with open(after_path) as f:
        after = {_row_key(r): r for r in json.load(f)["rows"]}
    print("| case | before | after | after / before |\n|---|---|---|---|")
    for b in before:
        a = after.get(_row_key(b))
        if a is None:
            continue
        if b.get("ours_ms") is not None and a.get("ours_ms") is not None:
            tb, ta = b["ours_ms"] * 1e3, a["ours_ms"] * 1e3
        elif "base_plus_lora_ms" in b and "base_plus_lora_ms" in a:  # whole layer: the LoRA time it adds
            tb, ta = (b["base_plus_lora_ms"] - b["base_ms"]) * 1e3, (a["base_plus_lora_ms"] - a["base_ms"]) * 1e3
        else:
            continue
        print(f"| {' '.join(str(v) for v in _row_key(b))} | {tb:.1f} us | {ta:.1f} us | {ta / tb:.2f} |")
    return 0


def _row_key(r: dict) -> tuple:
    return (r["group"], f"T={r['tokens']}", f"r={r['rank']}", f"n={r['adapters']}", r["popularity"])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--quick", action="store_true", help="every sixth row only")
    ap.add_argument("--plot", help="only redraw the plot of this results JSON")
    ap.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"),
                    help="only print two results JSONs of the same rows side by side (after / before per row)")
    ap.add_argument("--subset", choices=("all", "decode", "prefill"), default="all",
                    help="decode: the decode rows (at most 512 tokens) and the layer rows; prefill: the 8B rows of more "
                    "than 512 tokens and the layer rows")
    ap.add_argument("--budget-s", type=float, default=420.0, help="stop starting rows after this many seconds")
    args = ap.parse_args(argv)
    if args.compare:
        return compare(*args.compare)
    if args.plot:
        with open(args.plot) as f:
            plot(json.load(f), os.path.join(os.path.dirname(args.plot), "lora_kernels.png"))
        return
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "lora_kernels.json")
    res = {"environment": environment(), "ceilings": ceilings(), "rows": [], "errors": []}
    print(json.dumps(res["environment"]), json.dumps(res["ceilings"]), flush=True)
    t0 = time.time()
    for kind, a in sweep(args.quick, args.subset):
        if time.time() - t0 > args.budget_s:
            res["errors"].append(f"time budget reached before {kind} {a}")
            continue
        try:
            if kind == "layer":
                row = bench_layer(*a, res["ceilings"])
            elif kind == "variant":
                row = bench_row(*a[:5], res["ceilings"], providers=("ours",), block_m=a[5])
                row["variant"] = True
            else:
                row = bench_row(*a, res["ceilings"])
        except Exception as exc:  # noqa: BLE001  (record and go on: one bad shape must not lose the run)
            res["errors"].append(f"{kind} {a}: {type(exc).__name__}: {exc}")
            print("ERROR", kind, a, exc, flush=True)
            torch.cuda.empty_cache()
            continue
        res["rows"].append(row)
        print(summary_line(row), flush=True)
        with open(path, "w") as f:
            json.dump(res, f, indent=1)
    with open(path, "w") as f:
        json.dump(res, f, indent=1)
    try:
        plot(res, os.path.join(args.out, "lora_kernels.png"))
    except ImportError as exc:
        print("no plot:", exc)


def summary_line(row):
    def f(k, fmt="{:.4f}"):
        v = row.get(k)
        return "-" if v is None else fmt.format(v)

    if row["group"].endswith("layer-7proj"):
        return (f"{row['group']:<16} T={row['tokens']:<5} n={row['adapters']:<4} base={f('base_ms')}ms "
                f"+lora={f('base_plus_lora_ms')}ms added={f('lora_added_frac', '{:.1%}')}")
    return (f"{row['group']:<12} T={row['tokens']:<5} r={row['rank']:<3} n={row['adapters']:<4} {row['popularity']:<8} "
            f"bm={row['block_m']:<3} ours={f('ours_ms')} loop={f('loop_ms')} gbmm={f('gather_bmm_ms')} "
            f"base={f('base_ms')} GB/s={f('ours_gbps', '{:.0f}')} ({f('bw_frac', '{:.0%}')}) "
            f"roof={f('roofline_frac', '{:.0%}')} xloop={f('speedup_vs_loop', '{:.1f}')} "
            f"xgbmm={f('speedup_vs_gather_bmm', '{:.1f}')}")


def plot(res, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in res["rows"] if not r.get("variant") and "ours_ms" in r]
    fig, axes = plt.subplots(1, 3, figsize=(18, 5.5))
    ax = axes[0]
    dec = [r for r in rows if r["group"] == "8b-qkv" and r["popularity"] == "distinct" and r["rank"] == 16]
    dec.sort(key=lambda r: r["tokens"])
    for name in ("ours", "loop", "gather_bmm", "base"):
        pts = [(r["tokens"], r[f"{name}_ms"] * 1e3) for r in dec if r.get(f"{name}_ms")]
        if pts:
            ax.plot(*zip(*pts), marker="o", label=name)
    ax.set(xscale="log", yscale="log", xlabel="tokens (= distinct adapters)", ylabel="time per call (us)",
           title="8B q/k/v, r=16, every token its own adapter")
    ax.legend()
    ax = axes[1]
    for grp, mk in (("8b-qkv", "o"), ("8b-gate_up", "s"), ("8b-down", "^"), ("70b-qkv", "v"), ("70b-down", "D")):
        pts = sorted((r["tokens"], r["roofline_frac"] * 100) for r in rows if r["group"] == grp and r["rank"] == 16)
        if pts:
            ax.plot(*zip(*pts), marker=mk, linestyle="", label=grp)
    ax.axhline(70, color="gray", linestyle="--", linewidth=1)
    ax.set(xscale="log", xlabel="tokens", ylabel="% of binding roofline",
           title=f"ours vs ceilings: copy {res['ceilings']['copy_gbps']:.0f} GB/s, "
                 f"GEMM {res['ceilings']['gemm_tflops']:.0f} TFLOP/s")
    ax.legend(fontsize=8)
    ax = axes[2]
    for other, mk in (("gather_bmm", "o"), ("loop", "s")):
        pts = sorted((r["distinct_in_batch"], r[f"speedup_vs_{other}"]) for r in rows if r.get(f"speedup_vs_{other}"))
        if pts:
            ax.plot(*zip(*pts), marker=mk, linestyle="", alpha=0.7, label=f"vs {other}")
    ax.axhline(1.5, color="gray", linestyle="--", linewidth=1)
    ax.axhline(10, color="gray", linestyle=":", linewidth=1)
    ax.set(xscale="log", yscale="log", xlabel="distinct adapters in batch", ylabel="speedup of ours",
           title="speedup over the torch providers (all rows)")
    ax.legend()
    fig.suptitle(f"multilora LoRA kernels, bf16, {res['environment']['gpu']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
