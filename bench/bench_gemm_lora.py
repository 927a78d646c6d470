"""The base GEMM with the LoRA expand in its epilogue (``kernels.experimental.gemm_lora``) against the engine's prefill
path, at issue 12's prefill row (H200): 4,096 tokens on 64 rank-16 adapters (64-token sequences, each its own adapter),
the four fused GEMMs of a Llama-3-8B layer (q/k/v, o, gate/up, down), bf16.

Providers, per group, timed in CUDA graphs over ``SETS`` sets of weights / activations / adapters (so that repeats do
not measure L2), in interleaved rounds (every other round reversed; each figure the median of its rounds):

  cublas         ``torch.matmul(x, W^T)``: the base GEMM, no LoRA
  engine         shrink, the expand writing the term into y (``lora_delta``), then ``y.addmm_(x, W^T)``: the engine's
                 path from ``runtime.model.LORA_BEFORE_GEMM_MIN_TOKENS`` tokens (session 31: LoRA +13-16% of the layer)
  triton_<cfg>   ``gemm_lora(x, W)`` without LoRA: how far this Triton GEMM is from cuBLAS with tiles ``cfg``
  fused_<cfg>    the shrink, then ``gemm_lora(x, W, slices, plan, v)``: the term added in the GEMM's epilogue

Tile configs ``BMxBNxBK_gG_wW_sS[_tma]`` (``--configs`` picks some by index). The layer figures sum the groups'
medians; "added" is against cuBLAS's layer. Checks, per group: fused against the engine's path (max |diff| over
max |engine|; the two round differently: one rounding of the term) and the rows' values against an fp32 reference on
a sample of rows.

Usage: python bench/bench_gemm_lora.py --out DIR [--rounds 3] [--configs 0,3]     (~2-3 min on an H200, compiles
included)
       python bench/bench_gemm_lora.py --out DIR --smoke    (the CPU under TRITON_INTERPRET=1: tiny shapes, fp32,
                                                             wall-clock timings that mean nothing; a test of the script)
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

from _common import interleaved_rounds  # noqa: E402
from bench_lora_kernels import GROUPS, LAYER_8B, environment, synthetic_pool, time_ms  # noqa: E402

#: (block_m, block_n, block_k, group_m, num_warps, num_stages, tma): the Triton matmul tutorial's Hopper tiles and
#: neighbours; block_n divides every slice width of Llama-3-8B (1,024, 4,096, 14,336)
CONFIGS = (
    (128, 128, 64, 8, 8, 3, False),
    (128, 256, 64, 8, 8, 3, False),
    (128, 128, 64, 8, 4, 4, False),
    (128, 128, 64, 8, 8, 3, True),
    (128, 256, 64, 8, 8, 3, True),
    (256, 128, 64, 8, 8, 3, True),
)
SETS = 2
#: ``--smoke``: tiny groups (widths multiples of 16), tiles and counts for the CPU's interpreter
SMOKE_GROUPS = {"qkv": (32, [32, 16, 16]), "o": (32, [32]), "gate_up": (32, [48, 48]), "down": (48, [32])}
SMOKE_CONFIGS = ((16, 16, 16, 2, 4, 1, False), (32, 16, 32, 1, 4, 1, True))


def config_name(c) -> str:
    bm, bn, bk, gm, w, s, tma = c
    return f"{bm}x{bn}x{bk}_g{gm}_w{w}_s{s}" + ("_tma" if tma else "")


def group_case(group: str, T: int, n: int, rank: int, configs, rounds: int, smoke: bool = False) -> dict:
    from multilora.kernels import build_lora_plan, lora_delta
    from multilora.kernels.experimental.gemm_lora import gemm_lora
    from multilora.kernels.triton_sgmv import sgmv_shrink

    d_in, d_outs = (SMOKE_GROUPS if smoke else GROUPS)[group]
    d_out = sum(d_outs)
    dev, dt = ("cpu", torch.float32) if smoke else ("cuda", torch.bfloat16)
    pool, slices = synthetic_pool(d_in, d_outs, SETS * n, rank, device=dev, dtype=dt)
    gen = torch.Generator().manual_seed(T + d_out)
    per_seq = T // n
    plans, xs, ws, ys = [], [], [], []
    for k in range(SETS):  # each sequence (per_seq contiguous tokens) its own adapter, the adapters in random order
        order = torch.randperm(n, generator=gen) + k * n
        plans.append(build_lora_plan(order.repeat_interleave(per_seq)[:T].to(torch.int32), device=dev))
        xs.append(torch.randn(T, d_in, device=dev, dtype=dt))
        ws.append(torch.randn(d_out, d_in, device=dev, dtype=dt) * 0.02)
        ys.append(torch.empty(T, d_out, device=dev, dtype=dt))

    def cublas():
        for k in range(SETS):
            torch.matmul(xs[k], ws[k].t(), out=ys[k])

    def engine():
        for k in range(SETS):
            lora_delta(ys[k], xs[k], slices, plans[k])
            ys[k].addmm_(xs[k], ws[k].t())

    def triton_base(c):
        bm, bn, bk, gm, w, s, tma = c
        for k in range(SETS):
            gemm_lora(xs[k], ws[k], block_m=bm, block_n=bn, block_k=bk, group_m=gm, num_warps=w, num_stages=s,
                      tma=tma)

    def fused(c):
        bm, bn, bk, gm, w, s, tma = c
        for k in range(SETS):
            gemm_lora(xs[k], ws[k], slices, plans[k], sgmv_shrink(xs[k], slices, plans[k]), block_m=bm, block_n=bn,
                      block_k=bk, group_m=gm, num_warps=w, num_stages=s, tma=tma)

    fns = {"cublas": cublas, "engine": engine}
    for c in configs:
        fns[f"triton_{config_name(c)}"] = lambda c=c: triton_base(c)
        fns[f"fused_{config_name(c)}"] = lambda c=c: fused(c)
    row = dict(group=group, d_in=d_in, d_outs=d_outs, tokens=T, adapters=n, rank=rank, sets_per_call=SETS)
    # checks on set 0: the engine's path, each config's fused output, an fp32 reference on 64 sampled rows
    engine()
    want = ys[0].float()
    rows = torch.randperm(T, generator=gen)[:64].to(dev)
    from multilora.kernels import lora_apply_torch

    ref = lora_apply_torch(torch.zeros(rows.numel(), d_out, device=dev), xs[0][rows].float(), _fp32(slices),
                           build_lora_plan(plans[0].token_slots[rows], device=dev))
    ref += xs[0][rows].float() @ ws[0].float().t()
    row["engine_vs_fp32_max_rel"] = float((want[rows] - ref).abs().max() / ref.abs().max())
    for c in configs:
        bm, bn, bk, gm, w, s, tma = c
        try:
            got = gemm_lora(xs[0], ws[0], slices, plans[0], block_m=bm, block_n=bn, block_k=bk, group_m=gm,
                            num_warps=w, num_stages=s, tma=tma).float()
        except Exception as e:  # noqa: BLE001 - a config that does not compile or launch is reported, not fatal
            print(f"  {group} {config_name(c)}: {type(e).__name__}: {str(e)[:200]}", flush=True)
            fns.pop(f"triton_{config_name(c)}")
            fns.pop(f"fused_{config_name(c)}")
            row[f"error_{config_name(c)}"] = f"{type(e).__name__}: {str(e)[:500]}"
            continue
        row[f"fused_{config_name(c)}_vs_engine_max_rel"] = float((got - want).abs().max() / want.abs().max())
        row[f"fused_{config_name(c)}_vs_fp32_max_rel"] = float((got[rows] - ref).abs().max() / ref.abs().max())
    timer = _wall_ms if smoke else time_ms

    def measure(name):  # a provider that fails (a compile, a launch) is recorded and left out of later rounds
        if f"error_{name}" in row:
            return float("nan")
        try:
            return timer(fns[name], True) / SETS * 1e3
        except Exception as e:  # noqa: BLE001
            print(f"  {group} {name}: {type(e).__name__}: {str(e)[:200]}", flush=True)
            row[f"error_{name}"] = f"{type(e).__name__}: {str(e)[:500]}"
            return float("nan")

    times = interleaved_rounds(list(fns), rounds, measure)
    for name, ts in times.items():
        if f"error_{name}" not in row:
            row[f"{name}_us"] = statistics.median(ts)
            row[f"{name}_us_rounds"] = ts
    del pool, slices, xs, ws, ys
    torch.cuda.empty_cache()
    return row


def _wall_ms(fn, graph: bool) -> float:
    """``--smoke``'s timer: one call's wall-clock ms (the interpreter's: no evidence of anything)."""
    import time

    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def _fp32(slices):
    """``slices`` over an fp32 copy of the pool's buffer (the torch reference in fp32)."""
    import dataclasses

    from multilora.kernels import lora_slices

    buf = slices.buffer.float()
    return lora_slices([dataclasses.replace(v, buffer=buf) for v in slices.views])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--adapters", type=int, default=64)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--configs", default=None,
                    help="indices into CONFIGS, comma-separated (default all): " + "; ".join(
                        f"{i}: {config_name(c)}" for i, c in enumerate(CONFIGS)))
    ap.add_argument("--smoke", action="store_true",
                    help="a test of the script on the CPU (TRITON_INTERPRET=1): tiny shapes, fp32, timings meaningless")
    args = ap.parse_args(argv)
    if args.smoke:
        if os.environ.get("TRITON_INTERPRET") != "1":
            ap.error("--smoke runs the kernels on the CPU: set TRITON_INTERPRET=1 before starting")
        args.tokens, args.adapters, args.rounds = min(args.tokens, 48), min(args.adapters, 4), 1
    elif not torch.cuda.is_available():
        ap.error("needs a CUDA GPU (or --smoke under TRITON_INTERPRET=1)")
    table = SMOKE_CONFIGS if args.smoke else CONFIGS
    try:
        configs = table if args.configs is None else [table[int(i)] for i in args.configs.split(",")]
    except (ValueError, IndexError):
        ap.error(f"--configs: expected indices 0..{len(table) - 1}, comma-separated, got {args.configs!r}")
    os.makedirs(args.out, exist_ok=True)
    res = dict(environment=environment(), settings=dict(tokens=args.tokens, adapters=args.adapters, rank=args.rank,
                                                        rounds=args.rounds, sets=SETS, smoke=args.smoke,
                                                        configs=[config_name(c) for c in configs]), groups=[])
    for g in SMOKE_GROUPS if args.smoke else LAYER_8B:
        row = group_case(g, args.tokens, args.adapters, args.rank, configs, args.rounds, args.smoke)
        res["groups"].append(row)
        print(f"{g}: cublas {row.get('cublas_us', float('nan')):.1f} us, engine {row.get('engine_us', float('nan')):.1f}; "
              + ", ".join(f"{config_name(c)} base {row.get('triton_' + config_name(c) + '_us', float('nan')):.1f} "
                          f"fused {row.get('fused_' + config_name(c) + '_us', float('nan')):.1f}" for c in configs),
              flush=True)
        with open(os.path.join(args.out, "gemm_lora.json"), "w") as f:  # (after each group: a run cut short keeps
            json.dump(res, f, indent=1)  # the groups it finished)
    names = [k[:-3] for k in res["groups"][0] if k.endswith("_us") and all(k in r for r in res["groups"])]
    layer = {name: sum(r[f"{name}_us"] for r in res["groups"]) for name in names}
    base = layer["cublas"]
    res["layer"] = {name: dict(us=us, over_cublas=us / base - 1) for name, us in layer.items()}
    lines = ["| provider | layer us | over cuBLAS |", "|---|---|---|"]
    lines += [f"| {name} | {us:.1f} | {us / base - 1:+.1%} |" for name, us in sorted(layer.items(), key=lambda x: x[1])]
    print("\n".join(lines))
    with open(os.path.join(args.out, "gemm_lora.json"), "w") as f:
        json.dump(res, f, indent=1)
    with open(os.path.join(args.out, "gemm_lora.md"), "w") as f:
        f.write(f"{args.tokens} tokens on {args.adapters} rank-{args.rank} adapters, Llama-3-8B layer, bf16, medians of "
                f"{args.rounds} rounds\n\n" + "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
