"""Tile sweep of the SGMV shrink and expand launchers, each timed alone (CUDA graph, median), bf16, r = 16
(``--rank`` for the decode sweeps).

Usage: python bench/tune_lora_kernels.py --out DIR      (writes tune.json; prints the best per scenario)
The chosen defaults in kernels/triton_sgmv.py come from this sweep (bench/README.md has the outcome).

       python bench/tune_lora_kernels.py --decode-expand --out DIR   (writes tune_decode_expand.json / .md, ~3 min)
The decode expand alone at 8, 64 and 256 tokens with as many adapters (each token its own), the four fused
projections of a Llama-3-8B layer: output tiles looped per program (``tiles``) x ``block_n`` x pipeline stages x
warps, against the default configuration in the same run (issue 12: B is read far below copy speed there).

       python bench/tune_lora_kernels.py --decode-shrink --out DIR   (writes tune_decode_shrink.json / .md, ~3 min)
The decode shrink alone, same cases: ``block_k`` x the K split (half, the default's, twice) x warps x stages,
against the default configuration in the same run (issue 12: A is read at about half of copy speed at 64 tokens).

       python bench/tune_lora_kernels.py --prefill [--prefill-kernels expand] [--adapters 64] --out DIR
A prefill step's LoRA alone (writes tune_prefill.json / .md; ``--tokens``, default 4,096, on ``--adapters`` (8)
adapters in runs of tokens / adapters, as a prefill of that many prompts; the four fused projections of a Llama-3-8B
layer): the expand writing the LoRA term (``overwrite=True``, what the engine runs from
``LORA_BEFORE_GEMM_MIN_TOKENS``; chunk sizes ``block_m`` x ``block_n`` x warps x stages, and output tiles looped per
program, ``PREFILL_WRITE_LOOP``) and then the shrink
(``block_m`` x ``block_k`` x the K split, the default's and twice it, x warps), against the default configuration in
the same run, with each case's bytes (the expand's writes of y, the
shrink's reads of x) per us (issue 12's TTFT: H200, a 4,096-token mixed step's expands ran at 48 us each, half of
their write bandwidth).
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


def _write(out_dir: str, stem: str, env: dict, rows: list, lines: list) -> None:
    """Writes ``stem``.json (environment and every timed row) and ``stem``.md (the summary table) under ``out_dir``."""
    with open(os.path.join(out_dir, stem + ".json"), "w") as f:
        json.dump(dict(environment=env, rows=rows), f, indent=1)
    with open(os.path.join(out_dir, stem + ".md"), "w") as f:
        f.write("\n".join(lines) + "\n")


def decode_expand(out_dir: str, rank: int = 16, tokens: tuple[int, ...] = (8, 64, 256),
                  groups: tuple[str, ...] | None = None,
                  expand_configs: list[tuple[int, int, int]] | None = None) -> None:
    """The ``--decode-expand`` sweep (module docstring); writes ``tune_decode_expand[_r<rank>].json/.md`` (suffix for
    ranks other than 16)."""
    stem = "tune_decode_expand" + (f"_r{rank}" if rank != 16 else "")
    from bench_lora_kernels import GROUPS as G, LAYER_8B, environment
    from multilora.kernels import build_lora_plan
    from multilora.kernels import triton_sgmv as ts

    env = environment()
    rows, lines = [], ["| group | tokens = adapters | MB of B | default | best | best config | best GB/s |",
                       "|---|---|---|---|---|---|---|"]
    configs = ([dict(tiles=1, block_n=bn, num_stages=ns, num_warps=4) for bn in (128, 256, 512) for ns in (2, 3)]
               + [dict(tiles=1, block_n=512, num_stages=ns, num_warps=8) for ns in (2, 3)]
               + [dict(tiles=t, block_n=bn, num_stages=ns, num_warps=4)
                  for t in (2, 4, 8) for bn in (128, 256) for ns in (2, 3, 4)]
               + [dict(tiles=t, block_n=256, num_stages=3, num_warps=8) for t in (2, 4, 8)])
    if rank > 16:  # looped tiles are for rank <= 16 pools only (the launcher ignores ``tiles`` above): warps instead
        configs = [dict(block_n=bn, num_stages=ns, num_warps=nw) for bn in (64, 128, 256, 512) for ns in (2, 3, 4)
                   for nw in (1, 2, 4, 8)]
    if expand_configs:
        configs = [dict(block_n=bn, num_warps=nw, num_stages=ns) for bn, nw, ns in expand_configs]
    for group in groups or LAYER_8B:
        d_in, d_outs = G[group]
        for T in tokens:
            K = max(1, min(8, 256 // T * 2))  # sets per graph: enough distinct B bytes to pass L2
            pool, slices = synthetic_pool(d_in, d_outs, K * T, rank)
            gen = torch.Generator().manual_seed(T)
            plans = [build_lora_plan(assign("distinct", T, T, gen) + k * T, device="cuda") for k in range(K)]
            xs = [torch.randn(T, d_in, device="cuda", dtype=torch.bfloat16) for _ in range(K)]
            ys = [torch.randn(T, sum(d_outs), device="cuda", dtype=torch.bfloat16) for _ in range(K)]
            vs = [ts.sgmv_shrink(xs[k], slices, plans[k]) for k in range(K)]
            y0 = ys[0].clone()  # the timed calls add into ys: each configuration's check starts from this copy
            ref = ts.sgmv_expand(y0.clone(), vs[0], slices, plans[0])
            b_mb = T * rank * sum(d_outs) * 2 / 1e6
            case = []
            for cfg in [{}] + configs:
                def fn():
                    for k in range(K):
                        ts.sgmv_expand(ys[k], vs[k], slices, plans[k], **cfg)
                try:
                    got = ts.sgmv_expand(y0.clone(), vs[0], slices, plans[0], **cfg)
                    err = float((got.float() - ref.float()).abs().max())
                    us = time_ms(fn, True) / K * 1e3
                except Exception as exc:  # noqa: BLE001 - a configuration that does not compile is reported
                    print("expand", group, T, cfg, type(exc).__name__, exc, flush=True)
                    continue
                case.append(dict(group=group, tokens=T, adapters=T, b_mb=b_mb, us=us, max_abs_diff_vs_default=err,
                                 default=not cfg, **cfg))
            rows.extend(case)
            default = next(r for r in case if r["default"])
            best = min(case, key=lambda r: r["us"])
            cfg_s = ", ".join(f"{k} {best[k]}" for k in ("tiles", "block_n", "num_stages", "num_warps") if k in best)
            lines.append(f"| {group} | {T} | {b_mb:.1f} | {default['us']:.1f} us | {best['us']:.1f} us | {cfg_s} | "
                         f"{b_mb * 1e3 / best['us']:.0f} |")
            print(lines[-1], flush=True)
            _write(out_dir, stem, env, rows, lines)  # after each case: a timeout keeps the cases done
            del pool, slices
            torch.cuda.empty_cache()


def decode_shrink(out_dir: str, rank: int = 16, tokens: tuple[int, ...] = (8, 64, 256),
                  groups: tuple[str, ...] | None = None) -> None:
    """The ``--decode-shrink`` sweep (module docstring); writes ``tune_decode_shrink[_r<rank>].json/.md`` (suffix for
    ranks other than 16)."""
    stem = "tune_decode_shrink" + (f"_r{rank}" if rank != 16 else "")
    from bench_lora_kernels import GROUPS as G, LAYER_8B, environment
    from multilora.kernels import build_lora_plan
    from multilora.kernels import triton_sgmv as ts

    env = environment()
    rows, lines = [], ["| group | tokens = adapters | MB of A | default | best | best config | best GB/s |",
                       "|---|---|---|---|---|---|---|"]
    for group in groups or LAYER_8B:
        d_in, d_outs = G[group]
        for T in tokens:
            K = max(1, min(8, 256 // T * 2))  # sets per graph: enough distinct A bytes to pass L2
            pool, slices = synthetic_pool(d_in, d_outs, K * T, rank)
            gen = torch.Generator().manual_seed(T)
            plans = [build_lora_plan(assign("distinct", T, T, gen) + k * T, device="cuda") for k in range(K)]
            xs = [torch.randn(T, d_in, device="cuda", dtype=torch.bfloat16) for _ in range(K)]
            v0 = ts.sgmv_shrink(xs[0], slices, plans[0])  # the default configuration: its split and result
            ref, auto = v0.sum(0), v0.shape[0]
            a_mb = T * rank * d_in * len(d_outs) * 2 / 1e6
            configs = [dict(block_k=bk, split_k=sp, num_warps=nw, num_stages=ns)
                       for bk in (64, 128, 256) for sp in sorted({max(1, auto // 2), auto, auto * 2})
                       for nw in (2, 4) for ns in (2, 3, 4) if sp * bk <= d_in]
            configs += [dict(block_k=256, split_k=auto, num_warps=8, num_stages=3)]
            case = []
            for cfg in [{}] + configs:
                def fn():
                    for k in range(K):
                        ts.sgmv_shrink(xs[k], slices, plans[k], **cfg)
                try:
                    got = ts.sgmv_shrink(xs[0], slices, plans[0], **cfg).sum(0)
                    err = float((got - ref).abs().max())
                    us = time_ms(fn, True) / K * 1e3
                except Exception as exc:  # noqa: BLE001 - a configuration that does not compile is reported
                    print("shrink", group, T, cfg, type(exc).__name__, exc, flush=True)
                    continue
                case.append(dict(group=group, tokens=T, adapters=T, a_mb=a_mb, us=us, max_abs_diff_vs_default=err,
                                 default=not cfg, auto_split=auto, **cfg))
            rows.extend(case)
            default = next(r for r in case if r["default"])
            best = min(case, key=lambda r: r["us"])
            cfg_s = ", ".join(f"{k} {best[k]}" for k in ("block_k", "split_k", "num_stages", "num_warps") if k in best)
            lines.append(f"| {group} | {T} | {a_mb:.1f} | {default['us']:.1f} us (split {auto}) | {best['us']:.1f} us | "
                         f"{cfg_s or 'default'} | {a_mb * 1e3 / best['us']:.0f} |")
            print(lines[-1], flush=True)
            _write(out_dir, stem, env, rows, lines)  # after each case: a timeout keeps the cases done
            del pool, slices
            torch.cuda.empty_cache()


def prefill(out_dir: str, tokens: tuple[int, ...] = (4096,), groups: tuple[str, ...] | None = None,
            kernels: tuple[str, ...] = ("expand", "shrink"), adapters: int = 8) -> None:
    """The ``--prefill`` sweep (module docstring); writes ``tune_prefill.json/.md``."""
    from bench_lora_kernels import GROUPS as G, LAYER_8B, environment
    from multilora.kernels import build_lora_plan
    from multilora.kernels import triton_sgmv as ts

    env = environment()
    rows, lines = [], ["| kernel | group | tokens | MB moved | default | best | best config | best GB/s |",
                       "|---|---|---|---|---|---|---|---|"]
    n, K = adapters, 2  # adapters per step; steps per timed graph (y and x of two steps pass the 50 MB L2)
    for kernel in kernels:
        for group in groups or LAYER_8B:
            d_in, d_outs = G[group]
            d_out = sum(d_outs)
            for T in tokens:
                pool, slices = synthetic_pool(d_in, d_outs, K * n, 16)
                runs = (torch.arange(T) * n // T)  # n runs of T / n tokens, as a prefill of n prompts
                xs = [torch.randn(T, d_in, device="cuda", dtype=torch.bfloat16) for _ in range(K)]
                ys = [torch.empty(T, d_out, device="cuda", dtype=torch.bfloat16) for _ in range(K)]
                plan0 = [build_lora_plan(runs + k * n, device="cuda") for k in range(K)]
                vs = [ts.sgmv_shrink(xs[k], slices, plan0[k]) for k in range(K)]
                auto = vs[0].shape[0]
                if kernel == "expand":
                    ref = ts.sgmv_expand(ys[0].clone(), vs[0], slices, plan0[0], overwrite=True)
                    mb = T * d_out * 2 / 1e6
                    configs = [dict(block_m=bm, block_n=bn, num_warps=nw, num_stages=ns, tiles=1)
                               for bm in (64, 128) for bn in (128, 256) for nw in (4, 8) for ns in (2, 3)]
                    # looped tiles (PREFILL_WRITE_LOOP: one v tile, TILES B tiles per program)
                    configs += [dict(block_n=bn, num_warps=nw, num_stages=2, tiles=t)
                                for t in (2, 4) for bn in (128, 256) for nw in (4, 8)]
                    configs += [dict(block_n=128, num_warps=4, num_stages=2, tiles=8)]
                else:
                    ref = vs[0].sum(0)
                    mb = T * d_in * 2 / 1e6
                    configs = [dict(block_m=bm, block_k=bk, split_k=sp, num_warps=nw)
                               for bm in (64, 128) for bk in (128, 256) for sp in sorted({auto, 2 * auto})
                               for nw in (4, 8) if sp * bk <= d_in]
                case = []
                for cfg in [{}] + configs:
                    c = dict(cfg)
                    bm = c.pop("block_m", None)
                    plans = plan0 if bm is None else [build_lora_plan(runs + k * n, device="cuda", block_m=bm)
                                                      for k in range(K)]
                    if kernel == "expand":
                        def fn():
                            for k in range(K):
                                ts.sgmv_expand(ys[k], vs[k], slices, plans[k], overwrite=True, **c)
                    else:
                        def fn():
                            for k in range(K):
                                ts.sgmv_shrink(xs[k], slices, plans[k], **c)
                    try:
                        got = (ts.sgmv_expand(ys[0].clone(), vs[0], slices, plans[0], overwrite=True, **c)
                               if kernel == "expand" else ts.sgmv_shrink(xs[0], slices, plans[0], **c).sum(0))
                        err = float((got.float() - ref.float()).abs().max())
                        us = time_ms(fn, True) / K * 1e3
                    except Exception as exc:  # noqa: BLE001 - a configuration that does not compile is reported
                        print(kernel, group, T, cfg, type(exc).__name__, exc, flush=True)
                        continue
                    case.append(dict(kernel=kernel, group=group, tokens=T, adapters=n, mb=mb, us=us,
                                     max_abs_diff_vs_default=err, default=not cfg, auto_split=auto,
                                     default_block_m=plan0[0].block_m, **cfg))
                rows.extend(case)
                default = next(r for r in case if r["default"])
                best = min(case, key=lambda r: r["us"])
                keys = ("block_m", "block_n", "tiles", "block_k", "split_k", "num_stages", "num_warps")
                cfg_s = ", ".join(f"{k} {best[k]}" for k in keys if k in best)
                lines.append(f"| {kernel} | {group} | {T} | {mb:.0f} | {default['us']:.1f} us (block_m "
                             f"{default['default_block_m']}, split {auto}) | {best['us']:.1f} us | "
                             f"{cfg_s or 'default'} | {mb * 1e3 / best['us']:.0f} |")
                print(lines[-1], flush=True)
                _write(out_dir, "tune_prefill", env, rows, lines)  # after each case: a timeout keeps the cases done
                del pool, slices
                torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--decode-expand", action="store_true", help="the decode expand sweep (module docstring)")
    ap.add_argument("--decode-shrink", action="store_true", help="the decode shrink sweep (module docstring)")
    ap.add_argument("--prefill", action="store_true", help="the prefill expand (overwrite) and shrink sweep (module "
                    "docstring; --tokens default 4096 there)")
    ap.add_argument("--prefill-kernels", default="expand,shrink",
                    help="comma-separated kernels of the --prefill sweep (expand, shrink; default both)")
    ap.add_argument("--adapters", type=int, default=8,
                    help="adapters of a --prefill step (runs of tokens / adapters tokens; default 8)")
    ap.add_argument("--rank", type=int, default=16, help="adapter rank of the decode sweeps (default 16)")
    ap.add_argument("--tokens", default="8,64,256",
                    help="comma-separated token counts of the decode sweeps, each token its own adapter")
    ap.add_argument("--groups", default=None,
                    help="comma-separated projection groups of the decode sweeps (default: the layer's four, "
                         "8b-qkv,8b-o,8b-gate_up,8b-down)")
    ap.add_argument("--expand-configs", default=None, metavar="BLOCK_N:WARPS:STAGES,...",
                    help="the decode expand sweep's configurations instead of its grid, e.g. 128:2:2,256:4:2")
    args = ap.parse_args()
    tokens = tuple(int(t) for t in args.tokens.split(","))
    expand_configs = None
    if args.expand_configs:
        try:
            expand_configs = [tuple(int(v) for v in c.split(":")) for c in args.expand_configs.split(",")]
        except ValueError:
            expand_configs = []
        if not expand_configs or any(len(c) != 3 for c in expand_configs):
            ap.error(f"--expand-configs: expected BLOCK_N:WARPS:STAGES,... (integers), got {args.expand_configs!r}")
    groups = None
    if args.groups:
        groups = tuple(args.groups.split(","))
        bad = [g for g in groups if g not in GROUPS]
        if bad:
            ap.error(f"--groups: expected names from {','.join(GROUPS)}, got {','.join(bad)}")
    if args.prefill:
        kernels = tuple(k for k in args.prefill_kernels.split(",") if k)
        if not kernels or any(k not in ("expand", "shrink") for k in kernels):
            ap.error(f"--prefill-kernels: expected expand, shrink or expand,shrink, got {args.prefill_kernels!r}")
        if args.adapters < 1:
            ap.error(f"--adapters: expected an int >= 1, got {args.adapters}")
        os.makedirs(args.out, exist_ok=True)
        return prefill(args.out, tokens if args.tokens != "8,64,256" else (4096,), groups, kernels, args.adapters)
    if args.decode_shrink:
        os.makedirs(args.out, exist_ok=True)
        return decode_shrink(args.out, args.rank, tokens, groups)
    if args.decode_expand:
        os.makedirs(args.out, exist_ok=True)
        return decode_expand(args.out, args.rank, tokens, groups, expand_configs)
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
        nc = ts.chunk_bound(plans[0], slices)  # (the launcher's split follows the bound, not the launched grid)
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
