"""Where the LoRA time of a decode layer goes, and whether a side stream hides it (issue 12, H200).

One Llama-3-8B layer's seven projections (4 fused GEMMs: q/k/v, o, gate/up, down) with LoRA on all of them,
captured in one CUDA graph, in these schedules (``--schedules`` picks some):

  base           the 4 GEMMs alone
  serial         GEMM, then shrink + expand in place (the engine before this bench)
  side_shrink    the shrink on a side stream, concurrent with the GEMM; expand in place after the join
  side_all       zero a delta buffer + shrink + expand into it on a side stream, concurrent with the GEMM; join
                 (the delta would be added by the op that follows the projection: RoPE + KV write, the residual
                 add + RMSNorm, SiLU * up, so no launch on the main stream)
  side_write     side_all with no zeroing: the expand writes the LoRA term into the buffer (``lora_delta``, what
                 the engine runs since session 27; ``side_all`` is what ran before)
  side_all_add   side_all plus an explicit ``y += delta`` (what it costs when the following op cannot take it)
  side_all_hi    side_all on a side stream of the highest CUDA priority (captured into the graph's nodes), so the
                 block scheduler starts the LoRA programs before the GEMM's pending ones
  write_first    shrink + an expand that writes the LoRA term into the output (``lora_delta``), then the GEMM adds
                 ``x W^T`` to it (``y.addmm_``, beta 1): the engine's in-place path from
                 ``runtime.model.LORA_BEFORE_GEMM_MIN_TOKENS`` tokens (prefill)

``--prefill`` times issue 12's prefill row instead: 4,096 tokens on 64 adapters (64 tokens each), rank 16, in a pool
of max rank 16 (what ``bench_generate.py`` sizes) and of max rank 64 (the engine's default ``max_lora_rank``), in the
schedules base, serial (the LoRA added after the GEMM) and write_first, each with the prefill tiles of now, of
session 30 (``_s30_tiles``) and before (``_s29_tiles``). The prefill tile rules apply to pools of max rank <= 16 only:
the rank-64 pool's three variants run the same code, a measure of the spread between repeats.

and, for rank 64 at few tokens, a tile sweep of the shrink's split-K and the expand's ``block_n`` / warps.

A case "T tokens / n adapters" gives each token its own adapter (``--popularity distinct``, as the engine benchmark's
requests); before session 18 each token's adapter was drawn uniformly from the n, so about 63% of them were touched
(the layer figures of sessions 15-18 in bench/README.md are of such draws).

Usage: python bench/bench_lora_overlap.py --out bench/results/overlap      (~2 min on an H200)
       python bench/bench_lora_overlap.py --cases prefill --rounds 5 --out DIR  (the prefill row, medians of 5)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from _common import interleaved_rounds  # noqa: E402  (bench/_common.py)
from bench_lora_kernels import GROUPS, LAYER_8B, assign, environment, synthetic_pool, time_ms  # noqa: E402


def layer_case(T, n, rank, K=4, pool_rank=None, schedules=None, popularity="distinct", rounds=1):
    from multilora.kernels import build_lora_plan
    from multilora.kernels.triton_sgmv import _expand, _shrink

    gen = torch.Generator().manual_seed(T * 7 + rank)
    parts = []
    for g in LAYER_8B:
        d_in, d_outs = GROUPS[g]
        pool, slices = synthetic_pool(d_in, d_outs, K * n, rank, pool_rank)
        ws = [torch.randn(sum(d_outs), d_in, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(K)]
        xs = [torch.randn(T, d_in, device="cuda", dtype=torch.bfloat16) for _ in range(K)]
        ys = [torch.empty(T, sum(d_outs), device="cuda", dtype=torch.bfloat16) for _ in range(K)]
        ds = [torch.empty(T, sum(d_outs), device="cuda", dtype=torch.bfloat16) for _ in range(K)]
        parts.append((pool, slices, ws, xs, ys, ds))
    slots = [assign(popularity, T, n, gen) + k * n for k in range(K)]
    plans = [build_lora_plan(s, device="cuda") for s in slots]
    side = torch.cuda.Stream()
    side_hi = torch.cuda.Stream(priority=torch.cuda.Stream.priority_range()[1])  # (lowest, highest)

    def base():
        for k in range(K):
            for _, _, ws, xs, ys, _ in parts:
                torch.matmul(xs[k], ws[k].t(), out=ys[k])

    def serial():
        for k in range(K):
            for _, sl, ws, xs, ys, _ in parts:
                torch.matmul(xs[k], ws[k].t(), out=ys[k])
                _expand(ys[k], _shrink(xs[k], sl, plans[k]), sl, plans[k])

    def side_shrink():
        main = torch.cuda.current_stream()
        for k in range(K):
            for _, sl, ws, xs, ys, _ in parts:
                side.wait_stream(main)
                with torch.cuda.stream(side):
                    v = _shrink(xs[k], sl, plans[k])
                torch.matmul(xs[k], ws[k].t(), out=ys[k])
                main.wait_stream(side)
                _expand(ys[k], v, sl, plans[k])

    def side_all(add=False, stream=side, write=False):
        main = torch.cuda.current_stream()
        for k in range(K):
            for _, sl, ws, xs, ys, ds in parts:
                stream.wait_stream(main)
                with torch.cuda.stream(stream):
                    if not write:
                        ds[k].zero_()
                    _expand(ds[k], _shrink(xs[k], sl, plans[k]), sl, plans[k], overwrite=write)
                torch.matmul(xs[k], ws[k].t(), out=ys[k])
                main.wait_stream(stream)
                if add:
                    ys[k].add_(ds[k])

    def write_first():
        for k in range(K):
            for _, sl, ws, xs, ys, _ in parts:
                _expand(ys[k], _shrink(xs[k], sl, plans[k]), sl, plans[k], overwrite=True)
                ys[k].addmm_(xs[k], ws[k].t())

    # correctness of the schedules against serial (same math)
    serial()
    ref = [p[4][0].clone() for p in parts]
    side_all(add=True)
    err = max(float((p[4][0].float() - r.float()).abs().max() / r.float().abs().max()) for p, r in zip(parts, ref))
    zeroed = [p[5][0].clone() for p in parts]
    for p in parts:
        p[5][0].fill_(float("nan"))
    side_all(write=True)
    same = all(torch.equal(p[5][0].view(torch.int16), z.view(torch.int16)) for p, z in zip(parts, zeroed))  # bits
    write_first()  # the same sum in another order of rounding: near serial, not equal to it
    err_first = max(float((p[4][0].float() - r.float()).abs().max() / r.float().abs().max()) for p, r in zip(parts, ref))
    distinct = int(torch.unique(slots[0]).numel())
    row = dict(tokens=T, adapters=n, rank=rank, pool_max_rank=pool_rank or rank, sets_per_call=K,
               popularity=popularity, distinct_adapters=distinct,
               side_all_add_vs_serial_max_rel=err, side_write_equals_side_all=same,
               write_first_vs_serial_max_rel=err_first,
               # the bytes that must move: each distinct adapter's A and B of the seven projections, once
               adapter_mb=distinct * rank * 2 / 1e6
               * sum(d_in * len(d_outs) + sum(d_outs) for d_in, d_outs in (GROUPS[g] for g in LAYER_8B)))
    fns = {"base": base, "serial": serial, "side_shrink": side_shrink, "side_all": side_all,
           "side_write": lambda: side_all(write=True), "side_all_add": lambda: side_all(True), "side_all_hi": lambda: side_all(stream=side_hi),
           "write_first": write_first}
    from multilora.kernels import triton_sgmv

    # "old": the tiles before the wide-rank rule (session 14), and so before session 18's decode tiles too; for
    # prefill, "s29": the prefill tiles before session 30's (triton_sgmv.PREFILL_SHRINK_BLOCK_K / PREFILL_WRITE_BLOCK_N
    # / PREFILL_WRITE_LOOP), "s30": session 30's (PREFILL_WRITE_LOOP None: one tile per program)
    names = ("WIDE_RANK", "DECODE_SHRINK_WARPS", "DECODE_EXPAND_RANK_TILES", "PREFILL_SHRINK_BLOCK_K",
             "PREFILL_WRITE_BLOCK_N", "PREFILL_WRITE_LOOP")
    now = tuple(getattr(triton_sgmv, a) for a in names)
    tiles_of = {"new": now, "old": (1 << 30, 4, None) + now[3:], "s29": now[:3] + (None, None, None),
                "s30": now[:5] + (None,)}
    variants = (("new", "s30", "s29") if T > 512 else ("new", "old") if (pool_rank or rank) >= now[0] else ("new",))
    # every (schedule, tiles) pair once per round, every other round in reverse order (so a drift of the clocks
    # over the run does not favour the pairs timed first); each pair's figure is the median of its rounds
    pairs = [(name, tiles) for name in schedules or fns for tiles in (variants if name != "base" else ("new",))]

    def measure(pair):
        name, tiles = pair
        for a, v in zip(names, tiles_of[tiles]):
            setattr(triton_sgmv, a, v)
        return time_ms(fns[name], True) / K * 1e3

    try:
        times = {name if tiles == "new" else f"{name}_{tiles}_tiles": ts
                 for (name, tiles), ts in interleaved_rounds(pairs, rounds, measure).items()}
        for key, ts in times.items():
            row[f"{key}_us"] = statistics.median(ts)
            if rounds > 1:
                row[f"{key}_us_rounds"] = ts
        for key in times:
            if key != "base":
                row[f"{key}_added_us"] = row[f"{key}_us"] - row["base_us"]
    finally:
        for a, v in zip(names, now):
            setattr(triton_sgmv, a, v)
    del parts
    torch.cuda.empty_cache()
    return row


def tile_sweep(group, T, n, rank, K=8):
    from multilora.kernels import build_lora_plan
    from multilora.kernels.triton_sgmv import _expand, _shrink

    d_in, d_outs = GROUPS[group]
    pool, sl = synthetic_pool(d_in, d_outs, K * n, rank)
    gen = torch.Generator().manual_seed(T)
    plans = [build_lora_plan(assign("uniform", T, n, gen) + k * n, device="cuda") for k in range(K)]
    xs = [torch.randn(T, d_in, device="cuda", dtype=torch.bfloat16) for _ in range(K)]
    ys = [torch.zeros(T, sum(d_outs), device="cuda", dtype=torch.bfloat16) for _ in range(K)]
    rows = []
    for split in (None, 4, 8, 16):
        for block_n in (32, 64, 128, 256):
            for warps in (2, 4, 8):
                def fn():
                    for k in range(K):
                        _expand(ys[k], _shrink(xs[k], sl, plans[k], split_k=split), sl, plans[k], block_n=block_n,
                                num_warps=warps)
                try:
                    us = time_ms(fn, True) / K * 1e3
                except Exception as e:  # noqa: BLE001 - a config that does not compile is reported, not fatal
                    us = None
                    print(f"  {group} T={T} r={rank} split={split} bn={block_n} w={warps}: {type(e).__name__}")
                rows.append(dict(group=group, tokens=T, adapters=n, rank=rank, split_k=split, block_n=block_n,
                                 num_warps=warps, us=us))
    # the shrink alone at each split, for the share of the time
    for split in (None, 4, 8, 16, 32):
        def sh():
            for k in range(K):
                _shrink(xs[k], sl, plans[k], split_k=split)
        rows.append(dict(group=group, tokens=T, adapters=n, rank=rank, split_k=split, shrink_only=True,
                         us=time_ms(sh, True) / K * 1e3))
    del pool, sl
    torch.cuda.empty_cache()
    return rows


def _int_pair(text: str) -> tuple[int, int]:
    """An argparse type: ``"A,B"`` as two ints."""
    try:
        a, b = (int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected two ints A,B, got {text!r}") from None
    return a, b


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "overlap"))
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--rounds", type=int, default=1,
                    help="time every schedule (and tile variant) this many times, interleaved, every other round in "
                         "reverse; each figure is the median of its rounds (prefill: the GEMMs run at full power and "
                         "single timings spread by more than the tile effects)")
    ap.add_argument("--cases", default="all", choices=("all", "wide", "r16", "prefill"),
                    help="wide: the wide-rank tiles old vs new (rank 16 and 64 adapters, pool of rank 64); r16: the "
                    "rank-16 cases of all (1, 8, 64 and 256 tokens, as many adapters); prefill: 4,096 tokens on 64 "
                    "adapters of rank 16 in pools of max rank 16 and 64, the prefill tiles against session 30's "
                    "(_s30_tiles) and the ones before (_s29_tiles), no tile sweep")
    ap.add_argument("--schedules", default=None, help="comma-separated subset of base,serial,side_shrink,side_all,"
                    "side_write,side_all_add,side_all_hi,write_first (default: all; base is always run)")
    ap.add_argument("--expand-one-tile", action="store_true",
                    help="decode expand as before session 16: one 256-wide output tile per program "
                    "(triton_sgmv.DECODE_EXPAND_LOOP = ((512, 1, 256, 2),)); the run's JSON gets a _onetile suffix")
    ap.add_argument("--tokens", default=None, metavar="T,T,...",
                    help="only the cases of these token counts (r16: 1, 8, 64, 256; any count is a case of as many "
                    "rank-16 adapters)")
    ap.add_argument("--blas", default=None, choices=("cublas", "cublaslt"),
                    help="torch.backends.cuda.preferred_blas_library for the GEMMs (default: torch's choice)")
    ap.add_argument("--carveout", type=int, default=None, metavar="SMS",
                    help="leave SMS SMs out of the GEMMs' grid (torch._C._set_sm_carveout_experimental; honoured by "
                    "cuBLASLt paths only, so use with --blas cublaslt), for the side stream's LoRA kernels")
    ap.add_argument("--popularity", default="distinct", choices=("distinct", "uniform"),
                    help="each token's adapter in the layer cases: distinct (T tokens on T adapters: each its own, "
                    "the default since session 18) or uniform (drawn uniformly from the n: about 63%% of them "
                    "distinct when n = T; what ran before session 18); the run's JSON gets _uniform for it")
    ap.add_argument("--shrink-warps", type=int, default=None, metavar="N",
                    help="warps of the decode shrink outside the wide-rank regime (triton_sgmv.DECODE_SHRINK_WARPS; 4 "
                    "is what ran before session 18); the run's JSON gets a _shrink<N>w suffix")
    ap.add_argument("--wide-shrink", default=None, type=_int_pair, metavar="SPLIT,BLOCK_K",
                    help="the wide-rank regime's shrink (triton_sgmv.WIDE_SHRINK: cap on the K split, block_k; default "
                    "16 and the launcher's 128), e.g. 32,64; the run's JSON gets _wshrink<SPLIT>x<BLOCK_K>")
    ap.add_argument("--old-rank-tiles", action="store_true",
                    help="decode expand from a rank > 16 pool as before session 18 (DECODE_EXPAND_RANK_TILES = None: "
                    "256-wide tiles, 2 warps up to 16 tokens, 4 above); the run's JSON gets _oldranktiles")
    ap.add_argument("--expand-rank-tiles", default=None, type=_int_pair, metavar="BLOCK_N,WARPS",
                    help="decode expand from a rank > 16 pool with these tiles (triton_sgmv.DECODE_EXPAND_RANK_TILES; "
                    "default 128,2 since session 18), e.g. 256,4; the run's JSON gets _xtiles<BLOCK_N>x<WARPS>")
    ap.add_argument("--expand-wide-out", default=None, metavar="MIN_T,MAX_T,MIN_D_OUT,BLOCK_N,WARPS|none",
                    help="decode expand of MIN_T..MAX_T tokens from a rank > 16 pool, for fused outputs at least "
                    "MIN_D_OUT wide (triton_sgmv.DECODE_EXPAND_RANK_WIDE_OUT; default 48,64,16384,256,4 since session "
                    "29: gate/up at 48-64 tokens); none: every width takes DECODE_EXPAND_RANK_TILES (what ran before); "
                    "the run's JSON gets _wideout<...>")
    ap.add_argument("--no-pdl", action="store_true",
                    help="plain launches of the LoRA kernels instead of programmatic dependent launch "
                    "(triton_sgmv.PDL = False: what ran before session 20); the run's JSON gets _nopdl")
    ap.add_argument("--pdl-late-trigger", action="store_true",
                    help="with PDL, let the next kernel launch as each program exits instead of right after its wait "
                    "(triton_sgmv.PDL_EARLY_TRIGGER = False); the run's JSON gets _pdllate")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error(f"--rounds: expected an int >= 1, got {args.rounds}")
    from multilora.kernels import triton_sgmv

    tag = ""
    if args.expand_one_tile:
        triton_sgmv.DECODE_EXPAND_LOOP = ((512, 1, 256, 2),)
        tag += "_onetile"
    if args.popularity != "distinct":
        tag += f"_{args.popularity}"
    if args.shrink_warps is not None:
        if args.shrink_warps not in (1, 2, 4, 8, 16):
            ap.error(f"--shrink-warps: expected 1, 2, 4, 8 or 16, got {args.shrink_warps}")
        triton_sgmv.DECODE_SHRINK_WARPS = args.shrink_warps
        tag += f"_shrink{args.shrink_warps}w"
    if args.wide_shrink:
        split, block_k = args.wide_shrink
        if split < 1 or block_k < 16 or block_k & (block_k - 1):
            ap.error(f"--wide-shrink: expected SPLIT >= 1 and BLOCK_K a power of two >= 16, got {split},{block_k}")
        triton_sgmv.WIDE_SHRINK = (split, block_k)
        tag += f"_wshrink{split}x{block_k}"
    if args.old_rank_tiles:
        triton_sgmv.DECODE_EXPAND_RANK_TILES = None
        tag += "_oldranktiles"
    if args.expand_rank_tiles:
        if args.old_rank_tiles:
            ap.error("--expand-rank-tiles and --old-rank-tiles: expected one of them, got both")
        block_n, warps = args.expand_rank_tiles
        if block_n < 16 or block_n & (block_n - 1) or warps not in (1, 2, 4, 8, 16):
            ap.error(f"--expand-rank-tiles: expected BLOCK_N a power of two >= 16 and WARPS in 1, 2, 4, 8, 16, got "
                     f"{block_n},{warps}")
        triton_sgmv.DECODE_EXPAND_RANK_TILES = (block_n, warps)
        tag += f"_xtiles{block_n}x{warps}"
    if args.expand_wide_out is not None:
        if args.expand_wide_out == "none":
            triton_sgmv.DECODE_EXPAND_RANK_WIDE_OUT = None
            tag += "_wideoutnone"
        else:
            try:
                lo, hi, min_d, block_n, warps = (int(v) for v in args.expand_wide_out.split(","))
            except ValueError:
                ap.error(f"--expand-wide-out: expected MIN_T,MAX_T,MIN_D_OUT,BLOCK_N,WARPS (five integers) or none, "
                         f"got {args.expand_wide_out!r}")
            if not 1 <= lo <= hi or min_d < 1 or block_n < 16 or block_n & (block_n - 1) or warps not in (1, 2, 4, 8, 16):
                ap.error(f"--expand-wide-out: expected 1 <= MIN_T <= MAX_T, MIN_D_OUT >= 1, BLOCK_N a power of two "
                         f">= 16 and WARPS in 1, 2, 4, 8, 16, got {args.expand_wide_out}")
            triton_sgmv.DECODE_EXPAND_RANK_WIDE_OUT = (lo, hi, min_d, block_n, warps)
            tag += f"_wideout{lo}-{hi}x{min_d}x{block_n}x{warps}"
    if args.no_pdl:
        triton_sgmv.PDL = False
        tag += "_nopdl"
    if args.pdl_late_trigger:
        triton_sgmv.PDL_EARLY_TRIGGER = False
        tag += "_pdllate"
    if args.blas:
        torch.backends.cuda.preferred_blas_library(args.blas)
        tag += f"_{args.blas}"
    if args.carveout is not None:
        torch._C._set_sm_carveout_experimental(args.carveout)
        tag += f"_carve{args.carveout}"
    schedules = {"wide": ("base", "serial", "side_all"), "prefill": ("base", "serial", "write_first")}.get(args.cases)
    if args.schedules:
        schedules = ("base", *[s for s in args.schedules.split(",") if s and s != "base"])
        known = ("serial", "side_shrink", "side_all", "side_write", "side_all_add", "side_all_hi", "write_first")
        if any(s not in known for s in schedules[1:]):
            ap.error(f"--schedules: expected names from base,{','.join(known)}, got {args.schedules!r}")
    os.makedirs(args.out, exist_ok=True)
    from _common import copy_bandwidth

    copy_gbps, copy_how = copy_bandwidth(torch.device("cuda"))
    res = dict(environment=dict(environment(), copy_gbps=copy_gbps, copy_measured=copy_how), layer=[], sweep=[],
               settings=dict(decode_expand_loop=triton_sgmv.DECODE_EXPAND_LOOP,
                             decode_shrink_warps=triton_sgmv.DECODE_SHRINK_WARPS,
                             decode_expand_rank_tiles=triton_sgmv.DECODE_EXPAND_RANK_TILES,
                             decode_expand_rank_wide_out=triton_sgmv.DECODE_EXPAND_RANK_WIDE_OUT,
                             wide_shrink=triton_sgmv.WIDE_SHRINK, pdl=triton_sgmv.PDL,
                             pdl_early_trigger=triton_sgmv.PDL_EARLY_TRIGGER,
                             blas=str(torch.backends.cuda.preferred_blas_library()),
                             sm_carveout=torch._C._get_sm_carveout_experimental()))
    cases = [(1, 1, 16, None), (8, 8, 16, None), (64, 64, 16, None), (256, 256, 16, None), (1, 1, 64, None),
             (8, 8, 64, None), (64, 64, 64, None)]
    if args.cases == "r16":
        cases = [c for c in cases if c[2] == 16]
    if args.cases == "prefill":  # issue 12's prefill row: 4,096 tokens on 64 adapters, pools of max rank 16 and 64
        cases = [(4096, 64, 16, None), (4096, 64, 16, 64)]
    if args.cases == "wide":  # the wide-rank tiles, old and new: rank-16 and rank-64 adapters in a rank-64 pool
        cases = [(1, 1, 16, 64), (8, 8, 16, 64), (64, 64, 16, 64), (1, 1, 64, 64), (8, 8, 64, 64), (16, 16, 64, 64),
                 (64, 64, 64, 64)]
    if args.tokens:
        want = [int(t) for t in args.tokens.split(",")]
        cases = [c for c in cases if c[0] in want] + [(t, t, 16, None) for t in want if t not in [c[0] for c in cases]]
        tag += "_t" + "-".join(map(str, want))
    for T, n, rank, pool_rank in cases:
        row = layer_case(T, n, rank, pool_rank=pool_rank, schedules=schedules, popularity=args.popularity,
                         rounds=args.rounds)
        for key in [k for k in row if k.endswith("_added_us")]:  # the LoRA's bytes over its time, against copy
            row[key[:-len("_added_us")] + "_frac_of_copy"] = row["adapter_mb"] * 1e3 / row[key] / copy_gbps
        res["layer"].append(row)
        print(f"layer T={T:4d} n={n:4d} ({row['distinct_adapters']} distinct) r={rank:3d} "
              f"pool r={row['pool_max_rank']}: base {row['base_us']:.1f} us; "
              "LoRA adds " + ", ".join(f"{k[:-9]} {v:.1f} ({v / row['base_us']:+.1%})" for k, v in row.items()
                                       if k.endswith("_added_us"))
              + f" us; {row['adapter_mb']:.0f} MB of adapters, copy {copy_gbps:.0f} GB/s, side_write at "
              f"{row.get('side_write_frac_of_copy', float('nan')):.0%} of copy"
              + f" (err {row['side_all_add_vs_serial_max_rel']:.1e}; side_write == side_all: "
              f"{row['side_write_equals_side_all']})", flush=True)
    if not args.no_sweep and args.cases != "prefill":
        for group in ("8b-qkv", "8b-gate_up", "8b-down"):
            for T in (1, 8):
                rows = tile_sweep(group, T, T, 64)
                res["sweep"].extend(rows)
                best = min((r for r in rows if r.get("us") and not r.get("shrink_only")), key=lambda r: r["us"])
                default = next(r for r in rows if r["split_k"] is None and r["block_n"] == 256 and r["num_warps"] == 4)
                print(f"sweep {group} T={T} r=64: default {default['us']:.1f} us, best {best['us']:.1f} us "
                      f"(split {best['split_k']}, block_n {best['block_n']}, warps {best['num_warps']}); shrink "
                      + ", ".join(f"{r['split_k']}:{r['us']:.1f}" for r in rows if r.get("shrink_only")), flush=True)
    # a subset run (other cases or schedules) gets its own file beside the full run's
    suffix = "" if args.cases == "all" and not args.schedules else f"_{args.cases}" + ("_subset" if args.schedules else "")
    suffix += tag
    with open(os.path.join(args.out, f"lora_overlap{suffix}.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
