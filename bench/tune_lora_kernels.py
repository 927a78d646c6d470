"""Tile sweep of the SGMV shrink and expand launchers, each timed alone (CUDA graph, median), bf16, r = 16.

Usage: python bench/tune_lora_kernels.py --out DIR      (writes tune.json; prints the best per scenario)
The chosen defaults in kernels/triton_sgmv.py come from this sweep (bench/README.md has the outcome).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_lora_kernels import GROUPS, assign, synthetic_pool, time_ms  # noqa: E402

SCENARIOS = [  # group, tokens, distinct adapters, popularity
    ("8b-qkv", 64, 64, "distinct"),
    ("8b-qkv", 512, 512, "distinct"),
    ("8b-qkv", 64, 8, "uniform"),
    ("8b-gate_up", 64, 8, "uniform"),
    ("8b-qkv", 8192, 8, "uniform"),
]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    from multilora.kernels import build_lora_plan
    from multilora.kernels import triton_sgmv as ts

    res = []
    for group, T, n, pop in SCENARIOS:
        d_in, d_outs = GROUPS[group]
        K = 4 if T <= 512 else 1
        pool, slices = synthetic_pool(d_in, d_outs, K * n, 16)
        gen = torch.Generator().manual_seed(T)
        plans = [build_lora_plan(assign(pop, T, n, gen) + k * n, device="cuda") for k in range(K)]
        xs = [torch.randn(T, d_in, device="cuda", dtype=torch.bfloat16) for _ in range(K)]
        ys = [torch.randn(T, sum(d_outs), device="cuda", dtype=torch.bfloat16) for _ in range(K)]
        nc = ts.num_chunks(plans[0], slices)
        auto_split = ts._split_k(xs[0].device, nc * slices.num_slices, d_in, 256)
        for bk, nw, ns, sm in itertools.product((128, 256, 512), (4, 8), (2, 3, 4), (1, 2, 4)):
            split = auto_split * sm
            if split * bk > d_in:
                continue
            cfg = dict(block_k=bk, split_k=split, num_warps=nw, num_stages=ns)

            def shrink():
                for k in range(K):
                    ts.sgmv_shrink(xs[k], slices, plans[k], **cfg)

            try:
                t = time_ms(shrink, T <= 512) / K
            except Exception as exc:  # noqa: BLE001
                print("shrink", group, T, cfg, exc)
                continue
            res.append(dict(op="shrink", group=group, tokens=T, adapters=n, popularity=pop, ms=t, **cfg))
        v_s = {}
        for split in sorted({auto_split, 1}):
            v_s[split] = [ts.sgmv_shrink(xs[k], slices, plans[k], split_k=split)
                          for k in range(K)]
        for bn, nw, ns, split in itertools.product((64, 128, 256, 512), (4, 8), (2, 3), sorted(v_s)):
            cfg = dict(block_n=bn, num_warps=nw, num_stages=ns)

            def expand():
                for k in range(K):
                    ts.sgmv_expand(ys[k], v_s[split][k], slices, plans[k], **cfg)

            try:
                t = time_ms(expand, T <= 512) / K
            except Exception as exc:  # noqa: BLE001
                print("expand", group, T, cfg, exc)
                continue
            res.append(dict(op="expand", group=group, tokens=T, adapters=n, popularity=pop, ms=t, split_k=split,
                            **cfg))
        for op in ("shrink", "expand"):
            rows = sorted((r for r in res if r["op"] == op and r["group"] == group and r["tokens"] == T
                           and r["adapters"] == n), key=lambda r: r["ms"])
            default = [r for r in rows if (op == "shrink" and r["block_k"] == 256 and r["num_warps"] == 4
                                           and r["split_k"] == auto_split and r["num_stages"] == 3)
                       or (op == "expand" and r["block_n"] == 128 and r["num_warps"] == 4
                           and r["num_stages"] == 3 and r["split_k"] == auto_split)]
            print(f"{op:6} {group:10} T={T:<5} n={n:<4} auto_split={auto_split} "
                  f"default={default[0]['ms'] * 1e3 if default else float('nan'):.1f}us best:",
                  [(round(r["ms"] * 1e3, 1), {k: r[k] for k in r if k in
                    ("block_k", "block_n", "split_k", "num_warps", "num_stages")}) for r in rows[:3]], flush=True)
        del pool, slices
        torch.cuda.empty_cache()
    with open(os.path.join(args.out, "tune.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
