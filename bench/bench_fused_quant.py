"""The fp8 GEMM's per-token activation quantization written by the op before it, against a launch of its own
(``runtime.model.FUSE_FP8_QUANT``, issue 16).

For T tokens at Llama-3-8B widths (hidden 4096, MLP 14336), bf16, CUDA: RMSNorm with the residual add then
``triton_fp8.quantize_per_token`` (two launches) against ``add_rms_norm(..., quant=True)`` (one), and SiLU * up then
the quantization against ``silu_mul(..., quant=True)``. Each timing replays a CUDA graph of 8 such pairs in a row
(``triton.testing.do_bench_cudagraph``, median), as a step runs them layer after layer, with programmatic dependent
launch as the engine sets it (``kernels.triton_pdl``); us per pair. Every row also checks the bits: the fused fp8 copy must be exactly the quantization of the fused op's output (``copy_exact``); how many
outputs (and fp8 values) differ from the separate way's is reported (on the GPU the op's variant with the copy is
another compile: its sums of squares may round an output in the last place differently). ``--smoke`` runs tiny shapes
on the CPU (Triton's interpreter) for the check alone.

    python bench/bench_fused_quant.py --out bench/results/fused_quant
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path

import torch

from multilora.kernels import fused

CHAIN = 8


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])  # (the first paragraph, whole)
    ap.add_argument("--tokens", default="1,2,16,64,512,4096", help="comma list of T")
    ap.add_argument("--out", type=Path, default=Path("bench/results/fused_quant"))
    ap.add_argument("--smoke", action="store_true", help="CPU, TRITON_INTERPRET=1, tiny shapes: checks only")
    args = ap.parse_args(argv)
    if args.smoke:
        if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
            ap.error("--smoke: runs the kernels in Triton's interpreter on the CPU; set TRITON_INTERPRET=1 (before "
                     "the command: TRITON_INTERPRET=1 python bench/bench_fused_quant.py --smoke)")
        dev, dtype, hidden, inter = torch.device("cpu"), torch.float16, 64, 96
    elif torch.cuda.is_available():
        dev, dtype, hidden, inter = torch.device("cuda"), torch.bfloat16, 4096, 14336
    else:
        sys.exit("bench_fused_quant: needs CUDA (or --smoke with TRITON_INTERPRET=1)")
    from multilora.kernels import triton_fp8

    tokens = [int(t) for t in args.tokens.split(",")]
    g = torch.Generator(device=dev).manual_seed(0)
    rows = []
    for T in tokens:
        h = torch.randn(T, hidden, device=dev, dtype=dtype, generator=g)
        d = torch.randn(T, hidden, device=dev, dtype=dtype, generator=g)
        w = (torch.rand(hidden, device=dev, generator=g) + 0.5).to(dtype)
        gu = torch.randn(T, 2 * inter, device=dev, dtype=dtype, generator=g)

        def norm_sep():
            y = fused.add_rms_norm(h, d, w, 1e-5, backend="triton")
            return y, triton_fp8.quantize_per_token(y)

        def norm_fused():
            return fused.add_rms_norm(h, d, w, 1e-5, backend="triton", quant=True)

        def glu_sep():
            y = fused.silu_mul(gu, backend="triton")
            return y, triton_fp8.quantize_per_token(y)

        def glu_fused():
            return fused.silu_mul(gu, backend="triton", quant=True)

        for op, sep, fus in (("add_rms_norm", norm_sep, norm_fused), ("silu_mul", glu_sep, glu_fused)):
            h0 = h.clone()
            ys, (qs, ss) = sep()
            h.copy_(h0)
            yf, (qf, sf) = fus()
            h.copy_(h0)
            qy, sy = triton_fp8.quantize_per_token(yf)  # what the GEMM's own quantization makes of the fused output
            row = {"op": op, "tokens": T,
                   "copy_exact": torch.equal(qy.view(torch.uint8), qf.view(torch.uint8)) and torch.equal(sy, sf),
                   "outputs_differing": int((ys != yf).sum()), "fp8_differing": int((qs.view(torch.uint8)
                                                                                    != qf.view(torch.uint8)).sum())}
            if not args.smoke:
                from triton.testing import do_bench_cudagraph

                for name, fn in (("separate_us", sep), ("fused_us", fus)):
                    row[name] = do_bench_cudagraph(lambda fn=fn: [fn() for _ in range(CHAIN)], rep=50) * 1e3 / CHAIN
                row["saved_us"] = row["separate_us"] - row["fused_us"]
            rows.append(row)
            print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    meta = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu (smoke)",
            "torch": torch.__version__, "python": platform.python_version(), "dtype": str(dtype),
            "hidden": hidden, "intermediate": inter, "chain": CHAIN}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "fused_quant.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    lines = [f"# {meta['device']}, {dtype}, hidden {hidden}, MLP {inter}; us per op pair, CUDA graph of {CHAIN}", "",
             "| op | T | separate | fused | saved | fp8 copy exact | outputs differing | fp8 values differing |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        f = lambda k: f"{r[k]:.2f}" if k in r else "-"  # noqa: E731
        lines.append(f"| {r['op']} | {r['tokens']} | {f('separate_us')} | {f('fused_us')} | {f('saved_us')} | "
                     f"{r['copy_exact']} | {r['outputs_differing']} | {r['fp8_differing']} |")
    (args.out / "fused_quant.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if all(r["copy_exact"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
