"""Decode paged attention on a GPU: key tile, warps, pipeline stages and key splits swept per batch size.

The engine's decode attention (``kernels/triton_attention.py``) takes its config and split count from static
sizes (``_decode_launch``: the programs before splitting, the SM count and the block table's capacity). This
sweep times the alternatives per row so the profile picks them: for each row (batch B, context ctx, block-table
capacity in tokens — the engine's ``max_seq_len`` rounded up to whole blocks) it times the launcher's default
(``default``) and session 25's (``s25``: ``DECODE_TUNED = False``), then, unless ``--no-grid``,

  1. every (block_n, num_warps, num_stages) of the grid at the splits the launcher would pick for that tile, then
  2. the best ``--top`` of those at every split count of ``--splits``,

and every ``--configs`` entry. Times are medians of CUDA-graph replays (``do_bench_cudagraph``) of calls
cycling through disjoint problem sets (256 MB of KV per replay, or 64 sets where that is less: >= 150 MB
at batch 1, context 576; the L2 is 60 MB), attention
kernel plus the split combine, launched as the engine launches them (with PDL where the GPU has it). Every
config's output is checked against ``paged_attention_torch`` on the first set (bf16 tolerance).

Shapes: Llama-3-8B attention (32 query heads, 8 KV heads, head_dim 128), bf16, block_size 16; every sequence
of a row has the row's context (the engine's ``bench_generate.py`` rows: prompt 512 + up to 64 generated).

    python bench/sweep_attention.py --out DIR                       # the default rows, ~2 minutes on an H200
    python bench/sweep_attention.py --rows 1:576:592,64:576:592 --block-n 32,64 --warps 4 --stages 2,3 --out DIR
    python bench/sweep_attention.py --no-grid --configs 64:2:2:8 --out DIR   # the defaults, s25's and one config

Writes ``DIR/attention_sweep.json`` (device, versions, copy bandwidth, per row every timed config) and prints a
table per row.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from _common import copy_bandwidth  # noqa: E402  (bench/_common.py: GB/s and how it was measured)

DEV = "cuda"  # the CPU smoke test (tests/test_attention.py) runs main() on "cpu" with tiny shapes
H, HKV, D, BLOCK = 32, 8, 128, 16
SCALE = D ** -0.5
DTYPE = torch.bfloat16
SET_BYTES = 256e6
MAX_SETS = 64
TOL = 0.05  # max |error| against the fp32 torch reference for a config to count (bf16: ~1e-2 seen)
DEFAULT_ROWS = "1:576:592,1:576:2048,1:2048:2048,8:576:592,16:576:592,32:576:592,64:576:592,64:576:2048,128:576:592"


def _ints(text: str, name: str) -> list[int]:
    try:
        vals = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise SystemExit(f"sweep_attention: {name} must be comma-separated integers, got {text!r}") from None
    if not vals or min(vals) < 1:
        raise SystemExit(f"sweep_attention: {name} must be integers >= 1, got {text!r}")
    return vals


def parse_rows(text: str) -> list[tuple[int, int, int]]:
    """``B:ctx:capacity,...`` -> [(B, ctx, capacity)], capacity >= ctx (tokens)."""
    rows = []
    for part in text.split(","):
        try:
            B, ctx, cap = (int(v) for v in part.split(":"))
        except ValueError:
            raise SystemExit(f"sweep_attention: --rows entries must be B:ctx:capacity, got {part!r}") from None
        if B < 1 or ctx < 1 or cap < ctx:
            raise SystemExit(f"sweep_attention: --rows entry {part!r}: need B >= 1, ctx >= 1, capacity >= ctx")
        rows.append((B, ctx, cap))
    return rows


def make_sets(B: int, ctx: int, cap: int, dev: str):
    """Disjoint problem sets of one row: random K/V in shuffled blocks (block 0 left as the null block), block
    tables ``cap / BLOCK`` wide (the engine's width for its ``max_seq_len``), q; ``SET_BYTES`` of KV in all, in at
    most ``MAX_SETS`` sets."""
    from multilora.kernels.attention import build_attention_metadata

    nblk, width = -(-ctx // BLOCK), -(-cap // BLOCK)
    n_sets = max(1, min(MAX_SETS, math.ceil(SET_BYTES / (2 * B * ctx * HKV * D * DTYPE.itemsize))))
    gen = torch.Generator(device=dev).manual_seed(B * 7919 + ctx)
    sets = []
    for _ in range(n_sets):
        k = torch.randn(B * nblk + 1, BLOCK, HKV, D, device=dev, dtype=DTYPE, generator=gen)
        v = torch.randn(B * nblk + 1, BLOCK, HKV, D, device=dev, dtype=DTYPE, generator=gen)
        tables = (torch.randperm(B * nblk, device=dev, generator=gen) + 1).view(B, nblk).cpu().tolist()
        meta = build_attention_metadata([1] * B, [ctx] * B, tables, block_size=BLOCK, device=dev, max_blocks=width)
        q = torch.randn(B, H, D, device=dev, dtype=DTYPE, generator=gen)
        sets.append((q, k, v, meta))
    return sets


def time_us(fn, n_sets: int) -> float:
    """Median us of one problem set's call: ``fn`` (a call over every set) replayed from a CUDA graph."""
    import triton.testing as tt

    fn()
    torch.cuda.synchronize()
    return tt.do_bench_cudagraph(fn, rep=25, return_mode="median") * 1e3 / n_sets


def has_device() -> bool:
    return torch.cuda.is_available()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default=DEFAULT_ROWS, help="B:ctx:capacity,... (capacity: block-table tokens)")
    ap.add_argument("--block-n", default="16,32,64,128")
    ap.add_argument("--warps", default="2,4,8")
    ap.add_argument("--stages", default="1,2,3,4")
    ap.add_argument("--splits", default="1,2,4,8,16,32,64")
    ap.add_argument("--top", type=int, default=3, help="configs of step 1 taken to the split sweep")
    ap.add_argument("--no-grid", action="store_true", help="time the default, s25's and --configs only")
    ap.add_argument("--configs", default="", help="block_n:warps:stages:splits,... also timed (splits 0: the "
                    "launcher's for that tile)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    if args.top < 1:
        raise SystemExit(f"sweep_attention: --top must be >= 1, got {args.top}")
    rows = parse_rows(args.rows)
    block_ns, warps, stages, splits = (_ints(args.block_n, "--block-n"), _ints(args.warps, "--warps"),
                                       _ints(args.stages, "--stages"), _ints(args.splits, "--splits"))
    extra = []
    for part in filter(None, args.configs.split(",")):
        try:
            bn, w, st, sp = (int(v) for v in part.split(":"))
        except ValueError:
            raise SystemExit(f"sweep_attention: --configs entries must be block_n:warps:stages:splits, got {part!r}") \
                from None
        extra.append((bn, w, st, sp or None))
    if any(b < 16 or b & (b - 1) for b in block_ns + [e[0] for e in extra]):
        raise SystemExit(f"sweep_attention: --block-n and --configs key tiles must be powers of two >= 16, got "
                         f"{args.block_n!r}, {args.configs!r}")
    if not has_device():
        print("sweep_attention: needs a CUDA GPU", file=sys.stderr)
        return 2
    import triton

    from multilora.kernels import triton_attention as ta
    from multilora.kernels.attention import paged_attention_torch

    dev = DEV
    device = torch.device(dev)
    copy_gbps, copy_how = copy_bandwidth(device)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    res = dict(device=name, torch=torch.__version__, triton=triton.__version__,
               copy_gbps=copy_gbps, copy_how=copy_how, heads=H, kv_heads=HKV, head_dim=D, block_size=BLOCK,
               dtype=str(DTYPE).split(".")[-1], rows=[])
    os.makedirs(args.out, exist_ok=True)
    t_start = time.time()
    for (B, ctx, cap) in rows:
        sets = make_sets(B, ctx, cap, dev)
        q0, k0, v0, m0 = sets[0]
        ref = paged_attention_torch(q0.float(), k0.float(), v0.float(), m0, scale=SCALE)
        kv_bytes = 2 * B * ctx * HKV * D * DTYPE.itemsize

        def run(bn, w, st, sp):
            return [ta.paged_attention_triton(q, k, v, m, scale=SCALE, block_n=bn, num_warps=w, num_stages=st,
                                              num_splits=sp) for (q, k, v, m) in sets]

        def measure(bn, w, st, sp):
            sp_eff = sp or ta._decode_launch(device, B * HKV, cap, D, DTYPE, bn)[4]
            rec = dict(block_n=bn, num_warps=w, num_stages=st, splits=sp_eff)
            try:
                out = run(bn, w, st, sp_eff)[0]
                rec["max_abs_err"] = float((out.float() - ref).abs().max())
                rec["us"] = time_us(lambda: run(bn, w, st, sp_eff), len(sets))
                rec["gbps"] = kv_bytes / (rec["us"] * 1e-6) / 1e9
            except Exception as exc:  # noqa: BLE001  (a config that does not compile or fit: record, go on)
                rec["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
                torch.cuda.synchronize()
            return rec

        row = dict(batch=B, context=ctx, capacity=cap, kv_bytes=kv_bytes, sets_per_call=len(sets))
        _, bn, w, st, sp = ta._decode_launch(device, B * HKV, cap, D, DTYPE)
        row["default"] = measure(bn, w, st, sp)
        tuned = ta.DECODE_TUNED
        try:
            ta.DECODE_TUNED = False
            _, bn, w, st, sp = ta._decode_launch(device, B * HKV, cap, D, DTYPE)
        finally:
            ta.DECODE_TUNED = tuned
        row["s25"] = measure(bn, w, st, sp)
        grid = [] if args.no_grid else [measure(bn, w, st, None) for bn in block_ns for w in warps for st in stages]
        ok = sorted((r for r in grid if "us" in r and r["max_abs_err"] < TOL), key=lambda r: r["us"])
        split_recs = [measure(r["block_n"], r["num_warps"], r["num_stages"], sp)
                      for r in ok[:args.top] for sp in splits if sp != r["splits"]]
        row["step1"], row["step2"] = grid, split_recs
        row["configs"] = [measure(*e) for e in extra]
        everything = [r for r in [row["default"], row["s25"]] + grid + split_recs + row["configs"]
                      if "us" in r and r["max_abs_err"] < TOL]
        row["best"] = min(everything, key=lambda r: r["us"]) if everything else None
        res["rows"].append(row)
        d, o, b = row["default"], row["s25"], row["best"]
        print(f"B={B} ctx={ctx} cap={cap}: default {d.get('us', float('nan')):.2f} us "
              f"(bn {d['block_n']} w {d['num_warps']} st {d['num_stages']} splits {d['splits']}); s25 "
              f"{o.get('us', float('nan')):.2f} us (bn {o['block_n']} w {o['num_warps']} st {o['num_stages']} "
              f"splits {o['splits']}); best "
              + (f"{b['us']:.2f} us (bn {b['block_n']} w {b['num_warps']} st {b['num_stages']} splits {b['splits']}, "
                 f"{b['gbps']:.0f} GB/s = {b['gbps'] / copy_gbps:.0%} of copy)" if b else "none")
              + f"  [{time.time() - t_start:.0f} s]", flush=True)
        for r in sorted(everything, key=lambda r: r["us"])[:8]:
            print(f"    {r['us']:8.2f} us  bn {r['block_n']:3d} w {r['num_warps']} st {r['num_stages']} "
                  f"splits {r['splits']:2d}  err {r['max_abs_err']:.1e}", flush=True)
        with open(os.path.join(args.out, "attention_sweep.json"), "w") as f:
            json.dump(res, f, indent=1)
        del sets
    return 0


if __name__ == "__main__":
    sys.exit(main())
