"""Decode-path benchmark: the two-launch path (shrink + expand) against the fused one-launch kernel
(``lora_fused``) over a few tile configurations, on the decode cases of the issue's targets.

Every row is timed from a CUDA graph (``do_bench_cudagraph``), bf16, r = 16, cycling through K disjoint
sets of adapters/activations as ``bench_lora_kernels.py`` does (L2 not measured). Bytes that must move
count every fused slice's own A (q, k and v each have an A of r x d_in): ``r * (S * d_in + sum d_out)``
per distinct adapter, plus x once and y read and written.

Usage: python bench/bench_decode_fused.py --out bench/results   (writes decode_fused.json)
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from bench_lora_kernels import GROUPS, LAYER_8B, assign, ceilings, environment, synthetic_pool, time_ms  # noqa: E402

GB = 1e9
TWO_LAUNCH = "two-launch"
CONFIGS = {  # name -> lora_fused tiles
    "f256x1": dict(block_n=256, tiles=1, block_k=256, num_warps=4),
    "f256x4": dict(block_n=256, tiles=4, block_k=256, num_warps=4),
    "f512x2w8": dict(block_n=512, tiles=2, block_k=256, num_warps=8),
    "f256x64": dict(block_n=256, tiles=64, block_k=256, num_warps=4),  # one program per (chunk, slice)
    "f128x2k128": dict(block_n=128, tiles=2, block_k=128, num_warps=4),
}


def apply_op(name):
    """The apply op of a path: the product's two launches, or ``lora_fused`` with one of ``CONFIGS``."""
    from multilora.kernels.experimental.lora_fused import lora_fused
    from multilora.kernels.triton_sgmv import lora_apply_triton

    return lora_apply_triton if name == TWO_LAUNCH else functools.partial(lora_fused, **CONFIGS[name])


def bench_case(group, T, n, popularity, ceil, rank=16):
    from multilora.kernels import build_lora_plan

    d_in, d_outs = GROUPS[group]
    d_out = sum(d_outs)
    n = min(n, T)
    w_bytes = n * rank * (len(d_outs) * d_in + d_out) * 2
    act_bytes = (T * d_in + 2 * T * d_out) * 2
    K = max(1, min(8, math.ceil(200e6 / (w_bytes + act_bytes))))
    pool, slices = synthetic_pool(d_in, d_outs, K * n, rank)
    gen = torch.Generator().manual_seed(T * 131 + n)
    slot_lists = [assign(popularity, T, n, gen) + k * n for k in range(K)]
    plans = [build_lora_plan(sl, device="cuda") for sl in slot_lists]
    xs = [torch.randn(T, d_in, device="cuda", dtype=torch.bfloat16) for _ in range(K)]
    ys = [torch.randn(T, d_out, device="cuda", dtype=torch.bfloat16) for _ in range(K)]
    distinct = int(torch.unique(slot_lists[0]).numel())
    must = distinct * rank * (len(d_outs) * d_in + d_out) * 2 + act_bytes

    def fn(apply):
        for p, x, y in zip(plans, xs, ys):
            apply(y, x, slices, p)

    row = dict(group=group, tokens=T, adapters=n, distinct_in_batch=distinct, popularity=popularity, rank=rank,
               min_bytes=must, sets_per_call=K, us={}, bw_frac={})
    ref, y_fresh = None, ys[0].clone()
    for name in [TWO_LAUNCH, *CONFIGS]:
        apply = apply_op(name)
        try:
            y_chk = y_fresh.clone()  # ys are updated in place by every timed call: check on a fresh copy
            apply(y_chk, xs[0], slices, plans[0])
            if ref is None:
                ref = y_chk
            else:  # same result as the two-launch path (bf16 rounding of v differs: loose bound)
                err = (y_chk.float() - ref.float()).abs().max().item()
                row.setdefault("max_abs_diff", {})[name] = err
            t = time_ms(functools.partial(fn, apply), True) / K * 1e3
        except Exception as exc:  # noqa: BLE001
            row.setdefault("errors", {})[name] = f"{type(exc).__name__}: {exc}"[:300]
            continue
        row["us"][name] = t
        row["bw_frac"][name] = must / (t * 1e-6) / GB / ceil["copy_gbps"]
    del pool, slices, xs, ys
    torch.cuda.empty_cache()
    return row


def bench_layer(T, n, configs):
    """LoRA on the seven projections of a Llama-3-8B layer, as one CUDA graph, vs the base GEMMs."""
    from multilora.kernels import build_lora_plan

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

    def with_lora(apply):
        for k in range(K):
            for _, slices, ws, xs, ys in parts:
                torch.matmul(xs[k], ws[k].t(), out=ys[k])
                apply(ys[k], xs[k], slices, plans[k])

    tb = time_ms(base, True) / K * 1e3
    row = dict(group="8b-layer-7proj", tokens=T, adapters=n, popularity="uniform", base_us=tb, us={}, added={})
    for name in [TWO_LAUNCH, *configs]:
        t = time_ms(functools.partial(with_lora, apply_op(name)), True) / K * 1e3
        row["us"][name] = t
        row["added"][name] = (t - tb) / tb
    del parts
    torch.cuda.empty_cache()
    return row


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--budget-s", type=float, default=150.0)
    ap.add_argument("--layer-configs", default="f256x1,f256x4,f512x2w8")
    args = ap.parse_args(argv)
    res = {"environment": environment(), "ceilings": ceilings(), "configs": CONFIGS, "rows": [], "layer": []}
    print(json.dumps(res["ceilings"]), flush=True)
    cases = [("8b-qkv", T, T, "distinct") for T in (1, 16, 64, 128, 256, 512)]
    cases += [(g, T, T, "distinct") for g in ("8b-o", "8b-gate_up", "8b-down") for T in (64, 512)]
    cases += [("8b-qkv", 64, 8, "uniform"), ("8b-qkv", 512, 8, "uniform"), ("8b-gate_up", 64, 8, "uniform"),
              ("8b-down", 64, 8, "uniform"), ("70b-qkv", 64, 64, "distinct")]
    t0 = time.time()
    try:
        for c in cases:
            if time.time() - t0 > args.budget_s:
                print("budget reached before", c, flush=True)
                break
            row = bench_case(*c, res["ceilings"])
            res["rows"].append(row)
            best = min(row["us"], key=row["us"].get)
            print(f"{c[0]:<11} T={c[1]:<4} n={c[2]:<4} {c[3]:<8} "
                  + " ".join(f"{k}={v:.1f}us({row['bw_frac'][k]:.0%})" for k, v in row["us"].items())
                  + f" best={best} err={row.get('errors', '')} diff={row.get('max_abs_diff', '')}", flush=True)
        for T in (1, 8, 64, 256):
            if time.time() - t0 > args.budget_s + 60:
                break
            row = bench_layer(T, 8, args.layer_configs.split(","))
            res["layer"].append(row)
            print(f"layer T={T:<4} base={row['base_us']:.1f}us "
                  + " ".join(f"{k}=+{v:.1%}" for k, v in row["added"].items()), flush=True)
    finally:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "decode_fused.json"), "w") as f:
            json.dump(res, f, indent=1)
    print("total", time.time() - t0, flush=True)


if __name__ == "__main__":
    main()
