"""The MLP's gated activation and the down projection's LoRA shrink in one kernel (``kernels.triton_sgmv.glu_shrink``)
against the engine's prefill path (issue 12: the prefill row and TTFT). GPU only.

One Llama-3-8B MLP's second half at ``--tokens`` prefill tokens on ``--adapters`` adapters of rank 16 (runs of
tokens / adapters, as a prefill of that many prompts), from a pool of max rank 16 (``--pool-rank 16,64`` adds the
engine's default ``max_lora_rank``), ``K`` copies per CUDA graph (more bytes than the L2), bf16, in these schedules:

  base         h = silu_mul(gate_up); y = h W_down^T (cuBLAS)
  write_first  h = silu_mul(gate_up); lora_delta(y, h) (shrink + writing expand); y.addmm_(h, W_down^T): the engine's
               path from ``runtime.model.LORA_BEFORE_GEMM_MIN_TOKENS`` tokens
  fused        h, v = glu_shrink(gate_up) at each of ``--fused-configs`` tiles; sgmv_expand(y, v, overwrite);
               y.addmm_(h, W_down^T): the path of ``runtime.model.GLU_SHRINK_MIN_TOKENS``

every schedule timed ``--rounds`` times, interleaved (every other round reversed), medians; printed: each one's time
and what it adds to base, and the bytes the fusion saves (h's read by the shrink: T x 14,336 x 2). Checked: every
fused config's h equals silu_mul's bit for bit and its y is within bf16 rounding of write_first's (the shrink's
partials sum in another order).

Usage: python bench/bench_glu_shrink.py --out DIR [--tokens 4096] [--adapters 64] [--rounds 5]   (~1 min on an H200)
       [--profile]   (each schedule's kernels too)
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from _common import time_schedules  # noqa: E402  (bench/_common.py)
from bench_lora_kernels import GROUPS, environment, synthetic_pool, time_ms  # noqa: E402

DEFAULT_CONFIGS = "64:64:8,64:32:4,64:64:4,32:64:4,16:128:4,64:128:8"  # (64:128:4 spills registers on sm_90)


def _configs(text: str) -> list[tuple[int, int, int]]:
    """``BLOCK_M:BLOCK_K:WARPS,...`` as int triples (an argparse type)."""
    try:
        out = [tuple(int(v) for v in c.split(":")) for c in text.split(",") if c]
    except ValueError:
        out = []
    if not out or any(len(c) != 3 or any(v < 16 or v & (v - 1) for v in c[:2]) or c[2] not in (1, 2, 4, 8, 16)
                      for c in out):
        raise argparse.ArgumentTypeError(f"expected BLOCK_M:BLOCK_K:WARPS,... (BLOCK_M and BLOCK_K powers of two >= "
                                         f"16, WARPS in 1, 2, 4, 8, 16), got {text!r}")
    return out


def run(T: int, n: int, pool_rank: int, rounds: int, configs: list[tuple[int, int, int]], K: int = 4,
        profile: bool = False) -> dict:
    from multilora.kernels import build_lora_plan, lora_delta, triton_sgmv
    from multilora.kernels.triton_fused import silu_mul

    d_in, d_outs = GROUPS["8b-down"]  # 14,336 -> 4,096
    pool, slices = synthetic_pool(d_in, d_outs, K * n, 16, pool_rank)
    runs = torch.arange(T) * n // T
    plans = [build_lora_plan(runs + k * n, device="cuda") for k in range(K)]
    ws = [torch.randn(d_outs[0], d_in, device="cuda", dtype=torch.bfloat16) * 0.01 for _ in range(K)]
    gus = [torch.randn(T, 2 * d_in, device="cuda", dtype=torch.bfloat16) for _ in range(K)]
    ys = [torch.empty(T, d_outs[0], device="cuda", dtype=torch.bfloat16) for _ in range(K)]

    def base():
        for k in range(K):
            torch.matmul(silu_mul(gus[k]), ws[k].t(), out=ys[k])

    def write_first():
        for k in range(K):
            h = silu_mul(gus[k])
            lora_delta(ys[k], h, slices, plans[k], backend="triton")
            ys[k].addmm_(h, ws[k].t())

    def fused(block_m, block_k, warps):
        def fn():
            for k in range(K):
                h, v = triton_sgmv.glu_shrink(gus[k], slices, plans[k], block_m=block_m, block_k=block_k,
                                              num_warps=warps)
                triton_sgmv.sgmv_expand(ys[k], v, slices, plans[k], overwrite=True)
                ys[k].addmm_(h, ws[k].t())
        return fn

    fns = {"base": base, "write_first": write_first}
    fns.update({f"fused_{bm}x{bk}w{w}": fused(bm, bk, w) for bm, bk, w in configs})
    write_first()
    want_y, want_h = ys[0].float().clone(), silu_mul(gus[0])
    scale = want_y.abs().max().item()
    checks = {}
    for (bm, bk, w), name in zip(configs, [n for n in fns if n.startswith("fused")]):
        h, v = triton_sgmv.glu_shrink(gus[0], slices, plans[0], block_m=bm, block_k=bk, num_warps=w)
        y = triton_sgmv.sgmv_expand(torch.empty_like(ys[0]), v, slices, plans[0], overwrite=True).addmm_(h, ws[0].t())
        checks[name] = dict(h_equals_silu_mul_bits=bool(torch.equal(h.view(torch.int16), want_h.view(torch.int16))),
                            y_max_abs_diff_rel=(y.float() - want_y).abs().max().item() / scale, split_k=v.shape[0])
    row = dict(tokens=T, adapters=n, rank=16, pool_max_rank=pool_rank, copies_per_graph=K, rounds=rounds,
               checks=checks, h_mb=T * d_in * 2 / 1e6,  # what the fused shrink does not read back
               **time_schedules(fns, rounds, K, lambda fn: time_ms(fn, True), profile))
    del pool, slices
    torch.cuda.empty_cache()
    return row


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "glu_shrink"))
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--adapters", type=int, default=64)
    ap.add_argument("--pool-rank", default="16", help="comma-separated pool max ranks, one case each (default 16)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--fused-configs", type=_configs, default=_configs(DEFAULT_CONFIGS),
                    metavar="BLOCK_M:BLOCK_K:WARPS,...",
                    help=f"the fused kernel's tiles to time (default {DEFAULT_CONFIGS})")
    ap.add_argument("--profile", action="store_true",
                    help="also trace each schedule's kernels (torch.profiler, eager): rows get 'kernels', the "
                         "slowest 12 per schedule, and the top 5 are printed")
    args = ap.parse_args(argv)
    try:
        pool_ranks = [int(r) for r in args.pool_rank.split(",") if r]
    except ValueError:
        pool_ranks = []
    if not pool_ranks or any(r < 16 or r > 64 for r in pool_ranks):
        ap.error(f"--pool-rank: expected comma-separated ints in [16, 64] (runtime.model.GLU_SHRINK_MAX_RANK), got "
                 f"{args.pool_rank!r}")
    if args.tokens < 1 or args.adapters < 1 or args.adapters > args.tokens or args.rounds < 1:
        ap.error(f"--tokens, --adapters, --rounds: expected 1 <= adapters <= tokens and rounds >= 1, got "
                 f"{args.tokens}, {args.adapters}, {args.rounds}")
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU (the kernels are timed in CUDA graphs)")
    os.makedirs(args.out, exist_ok=True)
    res = dict(environment=environment(), cases=[])
    for pr in pool_ranks:
        row = run(args.tokens, args.adapters, pr, args.rounds, args.fused_configs, profile=args.profile)
        res["cases"].append(row)
        print(f"T={args.tokens} n={args.adapters} r=16 pool r={pr}: base {row['us']['base']:.1f} us; LoRA adds "
              + ", ".join(f"{k} {v:.1f} ({v / row['us']['base']:+.1%})" for k, v in row["added_us"].items())
              + f"; h {row['h_mb']:.0f} MB; checks {row['checks']}", flush=True)
        for name, ks in row.get("kernels", {}).items():
            print(f"  {name}: " + "; ".join(f"{k['name'][:60]} {k['us_per_run']:.1f} us" for k in ks[:5]), flush=True)
        with open(os.path.join(args.out, "glu_shrink.json"), "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
