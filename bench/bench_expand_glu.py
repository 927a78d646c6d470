"""The gate/up LoRA expand fused into the gated activation (``multilora.kernels.experimental.expand_glu``) against
the engine's prefill paths (issue 12: the prefill row and TTFT). GPU only.

One Llama-3-8B gate/up projection (4,096 -> 2 x 14,336) and its SiLU * up at ``--tokens`` prefill tokens on
``--adapters`` adapters of rank 16 (runs of tokens / adapters, as a prefill of that many prompts), from a pool of
max rank 16 (``--pool-rank 16,64`` adds the engine's default ``max_lora_rank``, which the fused kernel does not
serve), ``K`` copies per CUDA graph (more bytes than the L2), bf16, in these schedules:

  base         y = x W^T (cuBLAS); out = silu_mul(y)
  serial       y = x W^T; lora_apply(y) in place (shrink + adding expand); out = silu_mul(y)
  write_first  lora_delta(y) (shrink + writing expand); y.addmm_(x, W^T); out = silu_mul(y): the engine's in-place
               path from ``runtime.model.LORA_BEFORE_GEMM_MIN_TOKENS`` tokens
  fused        y = x W^T; v = shrink(x); out = expand_glu(y, v), at each of ``--fused-configs`` tiles

every schedule timed ``--rounds`` times, interleaved (every other round reversed), medians; printed: each one's time
and what it adds to base; checked: fused's output equals serial's bit for bit (its documented semantics).

Usage: python bench/bench_expand_glu.py --out DIR [--tokens 4096] [--adapters 64] [--rounds 5]   (~1 min on an H200)
       [--profile]   (each schedule's kernels too: which one is far from its bandwidth)
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

DEFAULT_CONFIGS = "128:4:4,128:2:4,256:2:4,64:4:4,128:8:4,128:4:8"


def _configs(text: str) -> list[tuple[int, int, int]]:
    """``BLOCK_N:TILES:WARPS,...`` as int triples (an argparse type)."""
    try:
        out = [tuple(int(v) for v in c.split(":")) for c in text.split(",") if c]
    except ValueError:
        out = []
    if not out or any(len(c) != 3 or c[0] < 16 or c[0] & (c[0] - 1) or c[1] < 1 or c[2] not in (1, 2, 4, 8, 16)
                      for c in out):
        raise argparse.ArgumentTypeError(f"expected BLOCK_N:TILES:WARPS,... (BLOCK_N a power of two >= 16, TILES "
                                         f">= 1, WARPS in 1, 2, 4, 8, 16), got {text!r}")
    return out


def run(T: int, n: int, pool_rank: int, rounds: int, configs: list[tuple[int, int, int]], K: int = 4,
        profile: bool = False) -> dict:
    from multilora.kernels import build_lora_plan, lora_apply, lora_delta
    from multilora.kernels import triton_sgmv
    from multilora.kernels.experimental.expand_glu import expand_glu
    from multilora.kernels.triton_fused import silu_mul

    d_in, d_outs = GROUPS["8b-gate_up"]
    pool, slices = synthetic_pool(d_in, d_outs, K * n, 16, pool_rank)
    runs = torch.arange(T) * n // T
    plans = [build_lora_plan(runs + k * n, device="cuda") for k in range(K)]
    ws = [torch.randn(sum(d_outs), d_in, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(K)]
    xs = [torch.randn(T, d_in, device="cuda", dtype=torch.bfloat16) for _ in range(K)]
    ys = [torch.empty(T, sum(d_outs), device="cuda", dtype=torch.bfloat16) for _ in range(K)]
    outs = [torch.empty(T, d_outs[0], device="cuda", dtype=torch.bfloat16) for _ in range(K)]

    def base():
        for k in range(K):
            torch.matmul(xs[k], ws[k].t(), out=ys[k])
            outs[k].copy_(silu_mul(ys[k]))

    def serial():
        for k in range(K):
            torch.matmul(xs[k], ws[k].t(), out=ys[k])
            lora_apply(ys[k], xs[k], slices, plans[k], backend="triton")
            outs[k].copy_(silu_mul(ys[k]))

    def write_first():
        for k in range(K):
            lora_delta(ys[k], xs[k], slices, plans[k], backend="triton")
            ys[k].addmm_(xs[k], ws[k].t())
            outs[k].copy_(silu_mul(ys[k]))

    def fused(block_n, tiles, warps):
        def fn():
            for k in range(K):
                torch.matmul(xs[k], ws[k].t(), out=ys[k])
                v = triton_sgmv.sgmv_shrink(xs[k], slices, plans[k])
                outs[k].copy_(expand_glu(ys[k], v, slices, plans[k], block_n=block_n, tiles=tiles, num_warps=warps))
        return fn

    # (the copies into outs stand for the next op's read of the activation: the same in every schedule)
    fns = {"base": base, "serial": serial, "write_first": write_first}
    fns.update({f"fused_{bn}x{t}w{w}": fused(bn, t, w) for bn, t, w in configs})
    serial()
    want = outs[0].clone()
    same = {}
    for name in fns:
        if name.startswith("fused"):
            outs[0].fill_(float("nan"))
            fns[name]()
            same[name] = bool(torch.equal(outs[0].view(torch.int16), want.view(torch.int16)))
    row = dict(tokens=T, adapters=n, rank=16, pool_max_rank=pool_rank, copies_per_graph=K, rounds=rounds,
               fused_equals_serial_bits=same,
               lora_term_mb=T * sum(d_outs) * 2 / 1e6,  # what write_first writes and the GEMM reads back
               **time_schedules(fns, rounds, K, lambda fn: time_ms(fn, True), profile))
    del pool, slices
    torch.cuda.empty_cache()
    return row


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "expand_glu"))
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--adapters", type=int, default=64)
    ap.add_argument("--pool-rank", default="16", help="comma-separated pool max ranks, one case each (default 16: "
                    "the fused kernel's bits are serial's for pools of max rank <= 16; from a wider pool the fused term is one "
                    "dot over all ranks, whose bits may differ from serial's)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--fused-configs", type=_configs, default=_configs(DEFAULT_CONFIGS),
                    metavar="BLOCK_N:TILES:WARPS,...",
                    help=f"the fused kernel's tiles to time (default {DEFAULT_CONFIGS})")
    ap.add_argument("--profile", action="store_true",
                    help="also trace each schedule's kernels (torch.profiler, eager): rows get 'kernels', the "
                         "slowest 12 per schedule with their us per call and per copy, and the top 5 are printed")
    args = ap.parse_args(argv)
    try:
        pool_ranks = [int(r) for r in args.pool_rank.split(",") if r]
    except ValueError:
        pool_ranks = []
    if not pool_ranks or any(r < 16 for r in pool_ranks):
        ap.error(f"--pool-rank: expected comma-separated ints >= 16, got {args.pool_rank!r}")
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
              + f"; fused == serial bits: {row['fused_equals_serial_bits']}", flush=True)
        for name, ks in row.get("kernels", {}).items():
            print(f"  {name}: " + "; ".join(f"{k['name'][:60]} {k['us_per_run']:.1f} us" for k in ks[:5]), flush=True)
        with open(os.path.join(args.out, "expand_glu.json"), "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
