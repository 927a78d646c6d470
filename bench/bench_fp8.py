"""fp8 base-weight GEMMs against the bf16 GEMM they replace (issue 16): which fp8 GEMM to use at which batch.

The four fused projections of one Llama-3-8B layer (qkv 6144 x 4096, o 4096 x 4096, gate_up 28672 x 4096,
down 4096 x 14336), M = 1 ... 256 rows (decode batch or prefill tokens). Providers, side by side in one run:

    bf16         x @ W^T, W bfloat16 (cuBLAS): what the engine runs without weight_dtype="fp8"
    scaled_mm    per-token fp8 activations (one Triton quantization launch) + torch._scaled_mm (cuBLASLt fp8)
    weight_only  bf16 activations, fp8 weights widened in registers (multilora.kernels.triton_fp8)
    weight_only_f16widen  (one row) the same with the weights widened through float16 (``triton_fp8.GEMV_WIDEN_F16``
                 forced on; the default since session 22)
    weight_only_bf16widen (one row) the same widened through bfloat16 (``GEMV_WIDEN_F16`` forced off: the A/B)

Times are medians of ``triton.testing.do_bench_cudagraph`` (the engine replays decode steps from CUDA graphs).
Each row also gives the bytes the GEMM must read (weights + activations) over its time, and the relative error
||y - y_ref|| / ||y_ref|| against an fp32 GEMM of the bf16 weight (the quantization error of each provider).

    python bench/bench_fp8.py --out bench/results/fp8        # H200: about 1 minute
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

import torch

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}  # (N, K)


def _widened(fn, f16: bool):
    """``fn()`` with ``triton_fp8.GEMV_WIDEN_F16`` set to ``f16`` (the A/B of that switch; a graph captured through
    this keeps the launch made while it was set)."""
    from multilora.kernels import triton_fp8

    was, triton_fp8.GEMV_WIDEN_F16 = triton_fp8.GEMV_WIDEN_F16, f16
    try:
        return fn()
    finally:
        triton_fp8.GEMV_WIDEN_F16 = was


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ms", default="1,2,4,8,16,32,64,128,256", help="rows (comma-separated)")
    ap.add_argument("--out", default="bench/results/fp8")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_fp8: needs a CUDA GPU with fp8 (compute capability 8.9+)")
    import triton
    from triton.testing import do_bench_cudagraph

    from multilora.kernels import triton_fp8
    from multilora.kernels.fp8 import fp8_linear, fp8_supported, quantize_weight

    ok, why = fp8_supported("cuda")
    if not ok:
        sys.exit(f"bench_fp8: {why}")
    dev = torch.device("cuda")
    meta = {"device": torch.cuda.get_device_name(dev), "torch": torch.__version__, "triton": triton.__version__,
            "python": platform.python_version(), "timing": "triton.testing.do_bench_cudagraph median"}
    rows = []
    g = torch.Generator(device=dev).manual_seed(0)
    for name, (N, K) in SHAPES.items():
        w = torch.randn(N, K, device=dev, dtype=torch.bfloat16, generator=g) * K ** -0.5
        q = quantize_weight(w)
        for M in [int(m) for m in args.ms.split(",")]:
            x = torch.randn(M, K, device=dev, dtype=torch.bfloat16, generator=g)
            ref = x.float() @ w.float().t()
            provs = {"bf16": (lambda: x @ w.t(), 2 * N * K),
                     "scaled_mm": (lambda: fp8_linear(x, q, method="scaled_mm"), N * K),
                     "weight_only": (lambda: fp8_linear(x, q, method="weight_only"), N * K)}
            if M == 1:  # the engine's one-row GEMV with the weights widened through float16 / bfloat16 (GEMV_WIDEN_F16)
                for name, f16 in (("weight_only_f16widen", True), ("weight_only_bf16widen", False)):
                    provs[name] = (lambda f16=f16: _widened(lambda: fp8_linear(x, q, method="weight_only"), f16), N * K)
            # the split-K GEMV at a few tile shapes, rows summed on CUDA cores (M <= 2) or by tl.dot (the engine's
            # choice is made from these rows)
            for dot, bn, bk, nw in ((False, 64, 256, 4), (False, 32, 512, 4), (True, 64, 128, 4), (True, 128, 128, 4),
                                    (True, 64, 256, 8)):
                if (not dot and M > 2) or M > 64:
                    continue
                provs[f"splitk_{'dot' if dot else 'row'}_{bn}x{bk}w{nw}"] = (
                    lambda bn=bn, bk=bk, nw=nw, dot=dot: triton_fp8.fp8_gemv_splitk(
                        x, q.qweight, q.scale, block_n=bn, block_k=bk, num_warps=nw, use_dot=dot), N * K)
            for prov, (fn, wbytes) in provs.items():
                y = fn()
                err = float((y.float() - ref).norm() / ref.norm())
                us = do_bench_cudagraph(fn, rep=100) * 1e3
                nbytes = wbytes + 2 * M * K + 2 * M * N
                row = {"module": name, "N": N, "K": K, "M": M, "provider": prov, "us": us,
                       "gbps": nbytes / us / 1e3, "rel_err": err}
                rows.append(row)
                print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "fp8_gemm.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    by = {(r["module"], r["M"], r["provider"]): r for r in rows}
    ms = sorted({r["M"] for r in rows})
    extra = sorted({r["provider"] for r in rows} - {"bf16", "scaled_mm", "weight_only"})
    lines = [f"{meta['device']}, torch {meta['torch']}, triton {meta['triton']}; {meta['timing']}", "",
             "| module | M | bf16 us | scaled_mm us | weight_only us | best fp8 vs bf16 | rel err scaled_mm | rel err weight_only |",
             "|---|---|---|---|---|---|---|---|"]
    for name in SHAPES:
        for M in ms:
            b, s, wo = (by[(name, M, p)] for p in ("bf16", "scaled_mm", "weight_only"))
            best = min(s["us"], wo["us"])
            lines.append(f"| {name} | {M} | {b['us']:.1f} | {s['us']:.1f} | {wo['us']:.1f} | {b['us'] / best:.2f}x "
                         f"({'scaled_mm' if s['us'] <= wo['us'] else 'weight_only'}) | {s['rel_err']:.2e} | "
                         f"{wo['rel_err']:.2e} |")
    sums = []
    for M in ms:
        t = {p: sum(by[(n, M, p)]["us"] for n in SHAPES) for p in ("bf16", "scaled_mm", "weight_only")}
        sums.append(f"| layer (4 GEMMs) | {M} | {t['bf16']:.1f} | {t['scaled_mm']:.1f} | {t['weight_only']:.1f} | "
                    f"{t['bf16'] / min(t['scaled_mm'], t['weight_only']):.2f}x | | |")
    if extra:
        sums += ["", "split-K GEMV, us: " + ", ".join(extra), "", "| module | M | bf16 | " + " | ".join(extra) + " |",
                 "|---|---|---|" + "---|" * len(extra)]
        for name in SHAPES:
            for M in [m for m in ms if any((name, m, p) in by for p in extra)]:
                sums.append(f"| {name} | {M} | {by[(name, M, 'bf16')]['us']:.1f} | "
                            + " | ".join(f"{by[(name, M, p)]['us']:.1f}" if (name, M, p) in by else "-" for p in extra) + " |")
    md = "\n".join(lines + sums) + "\n"
    (out / "fp8_gemm.md").write_text(md)
    print("\n" + md)


if __name__ == "__main__":
    main()
