"""Tile sweep of the decode-sized fp8 weight-only GEMM (issue 16): ``triton_fp8.fp8_gemv2`` at many tile shapes
against the engine's current choice (``fp8_weight_only_linear``) and cuBLAS bf16, on the four fused projections of
a Llama-3-8B layer, with the weights rotated so that L2 (50 MB on an H200) holds none of them.

Each timed call runs the GEMM on ``C`` distinct copies of the weight (``C * bytes >= --rotate-mb``) inside one CUDA
graph and reports the time per GEMM, so every weight byte comes from HBM, as in the engine (every layer has its own
weights). Phases:

1. sweep: M = 1 (the CUDA-core path and tl.dot), 16 and 64 (tl.dot): every tile shape, programs per SM, prefetch /
   pipeline stages; one JSON line per (module, M, config).
2. layer: the best config of each (module, M class) found in phase 1, then the four GEMMs of a layer in sequence
   (distinct weights, 4 layers per graph, time per layer) for bf16, the current choice and the best, at
   M = 1, 2, 4, 8, 16, 32, 64.

    python bench/sweep_fp8_gemv.py --out bench/results/fp8/sweep       # H200: about 3-4 minutes
    python bench/sweep_fp8_gemv.py --quick --out DIR                     # a few configs (smoke run)
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import sys
import time
from pathlib import Path

import torch

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}  # (N, K)
DTYPE = torch.bfloat16


def configs(path: str, quick: bool) -> list[dict]:
    """Tile configs of one path: "row" (CUDA cores, M = 1) or "dot" (tl.dot)."""
    if path == "row":
        grid = itertools.product((8, 16, 32), (512, 1024), (4, 8), (False, True), (2, 4, 8))
        out = [dict(block_n=bn, block_k=bk, num_warps=w, prefetch=p, programs_per_sm=pps, num_stages=1, use_dot=False)
               for bn, bk, w, p, pps in grid if bn * bk // (32 * w) <= 128]
    else:
        grid = itertools.product((32, 64, 128), (128, 256), (4, 8), (2, 4), (2, 4))
        out = [dict(block_n=bn, block_k=bk, num_warps=w, num_stages=st, programs_per_sm=pps, prefetch=False,
                    use_dot=True) for bn, bk, w, st, pps in grid]
    return out[:3] if quick else out


def name_of(c: dict) -> str:
    return (f"{'dot' if c['use_dot'] else 'row'}_{c['block_n']}x{c['block_k']}w{c['num_warps']}s{c['num_stages']}"
            f"{'p' if c['prefetch'] else ''}_pps{c['programs_per_sm']}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench/results/fp8/sweep")
    ap.add_argument("--rotate-mb", type=float, default=256.0, help="weight bytes cycled through per timed call")
    ap.add_argument("--quick", action="store_true", help="three configs per path (smoke run)")
    ap.add_argument("--rep", type=int, default=25, help="ms of replays per timing (do_bench_cudagraph rep)")
    ap.add_argument("--smoke", action="store_true", help="CPU (TRITON_INTERPRET=1): tiny shapes, wall-clock timer; "
                    "checks the script, not speed")
    args = ap.parse_args(argv)
    global SHAPES
    if args.smoke:
        SHAPES = {"qkv": (96, 64), "o": (64, 64), "gate_up": (160, 64), "down": (64, 192)}
        args.quick = True
    elif not torch.cuda.is_available():
        sys.exit("sweep_fp8_gemv: needs a CUDA GPU with fp8 (compute capability 8.9+); --smoke runs on the CPU")
    import triton
    from triton.testing import do_bench_cudagraph

    from multilora.kernels import triton_fp8
    from multilora.kernels.fp8 import fp8_linear, quantize_weight

    dev = torch.device("cpu" if args.smoke else "cuda")
    num_sms = 4 if args.smoke else torch.cuda.get_device_properties(dev).multi_processor_count
    meta = {"device": "cpu (smoke)" if args.smoke else torch.cuda.get_device_name(dev), "torch": torch.__version__, "triton": triton.__version__,
            "python": platform.python_version(), "sms": num_sms, "rotate_mb": args.rotate_mb,
            "timing": "triton.testing.do_bench_cudagraph median over C rotated weight copies, per GEMM"}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    global DTYPE
    DTYPE = torch.float16 if args.smoke else torch.bfloat16  # the interpreter has no bf16
    g = torch.Generator(device=dev).manual_seed(0)
    weights = {}
    for name, (N, K) in SHAPES.items():
        c = max(1, int(args.rotate_mb * 2**20 // (N * K)) + 1)
        c = 2 if args.smoke else c
        w = [torch.randn(N, K, device=dev, dtype=DTYPE, generator=g) * K ** -0.5 for _ in range(c)]
        weights[name] = (w, [quantize_weight(t) for t in w])

    def bench(fn, n):
        if args.smoke:
            t = time.perf_counter()
            fn()
            return (time.perf_counter() - t) * 1e6 / n
        return do_bench_cudagraph(fn, rep=args.rep) * 1e3 / n

    rows = []

    def record(**row):
        rows.append(row)
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}), flush=True)

    t0 = time.perf_counter()
    for name, (N, K) in SHAPES.items():
        wb, wq = weights[name]
        for M in (1, 16, 64):
            x = torch.randn(M, K, device=dev, dtype=DTYPE, generator=g)
            ref = x.float() @ wb[0].float().t()
            record(phase="sweep", module=name, M=M, config="bf16",
                   us=bench(lambda: [x @ t.t() for t in wb], len(wb)))
            record(phase="sweep", module=name, M=M, config="current",
                   us=bench(lambda: [triton_fp8.fp8_weight_only_linear(x, q.qweight, q.scale) for q in wq], len(wq)))
            if not args.smoke:  # cuBLASLt fp8 (per-token activation quantization + torch._scaled_mm)
                record(phase="sweep", module=name, M=M, config="scaled_mm",
                       us=bench(lambda: [fp8_linear(x, q, method="scaled_mm") for q in wq], len(wq)))
            for path in (("row", "dot") if M == 1 else ("dot",)):
                for cfg in configs(path, args.quick):
                    fn = lambda cfg=cfg: [triton_fp8.fp8_gemv2(x, q.qweight, q.scale, num_sms=num_sms, **cfg)
                                          for q in wq]
                    try:
                        y = fn()[0]
                    except Exception as e:  # a config Triton cannot compile (shared memory, registers)
                        record(phase="sweep", module=name, M=M, config=name_of(cfg), us=None, error=str(e)[:200])
                        continue
                    err = float((y.float() - ref).norm() / ref.norm())
                    record(phase="sweep", module=name, M=M, config=name_of(cfg), cfg=cfg, us=bench(fn, len(wq)),
                           rel_err=err)
            print(f"# {name} M={M} done at {time.perf_counter() - t0:.0f} s", flush=True)
    for r in rows:
        if r.get("us"):
            N, K = SHAPES[r["module"]]
            wbytes = N * K * (2 if r["config"] == "bf16" else 1)
            r["weight_tb_s"] = wbytes / (r["us"] * 1e-6) / 1e12

    # phase 2: best config per (module, M class), then whole layers
    best: dict[tuple[str, int], dict] = {}
    for r in rows:
        if r.get("cfg") and r.get("us") and r["rel_err"] < 5e-2:
            k = (r["module"], r["M"])
            if k not in best or r["us"] < best[k]["us"]:
                best[k] = r
    for (name, M), r in sorted(best.items()):
        cur = next(x for x in rows if x["module"] == name and x["M"] == M and x["config"] == "current")
        bf = next(x for x in rows if x["module"] == name and x["M"] == M and x["config"] == "bf16")
        print(f"# best {name} M={M}: {r['config']} {r['us']:.1f} us ({r['weight_tb_s']:.2f} TB/s); current "
              f"{cur['us']:.1f} us; bf16 {bf['us']:.1f} us", flush=True)

    def best_cfg(name, M):
        cls = 1 if M == 1 else (16 if M <= 16 else 64)
        return best[(name, cls)]["cfg"] if (name, cls) in best else None

    layers = 4
    lw = {}
    for name, (N, K) in SHAPES.items():  # 4 layers of distinct weights (cycled from the rotation copies)
        wb, wq = weights[name]
        lw[name] = [(wb[i % len(wb)], wq[i % len(wq)]) for i in range(layers)]
    for M in (1, 2, 4, 8, 16, 32, 64):
        xs = {name: torch.randn(M, K, device=dev, dtype=DTYPE, generator=g) for name, (N, K) in SHAPES.items()}

        def run(kind):
            for i in range(layers):
                for name in SHAPES:
                    x, (b, q) = xs[name], lw[name][i]
                    if kind == "bf16":
                        x @ b.t()
                    elif kind == "current":
                        triton_fp8.fp8_weight_only_linear(x, q.qweight, q.scale)
                    else:
                        cfg = best_cfg(name, M)
                        if cfg is None:
                            triton_fp8.fp8_weight_only_linear(x, q.qweight, q.scale)
                        else:
                            if not cfg["use_dot"] and M > 1:
                                cfg = dict(cfg, use_dot=True)
                            triton_fp8.fp8_gemv2(x, q.qweight, q.scale, num_sms=num_sms, **cfg)
        for kind in ("bf16", "current", "best"):
            run(kind)
            record(phase="layer", M=M, config=kind, us=bench(lambda: run(kind), layers))
    # the tuned table the engine reads (kernels/tuned/fp8_gemv_*.json; MULTILORA_FP8_TUNED=<this file> to try it)
    wo_max = 1
    for M in (16, 64):
        wo = sum(best[(n, M)]["us"] for n in SHAPES if (n, M) in best)
        sm = [r["us"] for r in rows if r["phase"] == "sweep" and r["M"] == M and r["config"] == "scaled_mm"]
        if len(sm) == len(SHAPES) and all((n, M) in best for n in SHAPES) and wo < sum(sm):
            wo_max = M
    tuned = {"device": meta["device"], "source": "python bench/sweep_fp8_gemv.py (" + meta["timing"] + ")",
             "torch": meta["torch"], "triton": meta["triton"], "weight_only_max_tokens": wo_max,
             "configs": {}}
    for (name, M), r in sorted(best.items()):
        N, K = SHAPES[name]
        tuned["configs"].setdefault(f"{N}x{K}", {})[str(M)] = r["cfg"]
    (out / "fp8_gemv_tuned.json").write_text(json.dumps(tuned, indent=1))
    (out / "sweep_fp8_gemv.json").write_text(json.dumps({"meta": meta, "rows": rows,
                                                         "best": {f"{k[0]}/{k[1]}": v["cfg"] for k, v in best.items()}},
                                                        indent=1))
    lines = [f"{meta['device']}, torch {meta['torch']}, triton {meta['triton']}; {meta['timing']}", "",
             "| module | M | bf16 us | scaled_mm us | current fp8 us | best fp8 us | best config | best TB/s |",
             "|---|---|---|---|---|---|---|---|"]
    for (name, M), r in sorted(best.items()):
        t = {x["config"]: x["us"] for x in rows if x.get("module") == name and x["M"] == M}
        sm = f"{t['scaled_mm']:.1f}" if "scaled_mm" in t else "-"
        lines.append(f"| {name} | {M} | {t['bf16']:.1f} | {sm} | {t['current']:.1f} | {r['us']:.1f} | {r['config']} | "
                     f"{r['weight_tb_s']:.2f} |")
    lines += ["", f"weight_only_max_tokens (weight-only beats scaled_mm over the 4 GEMMs up to): {wo_max}"]
    lines += ["", "| layer (4 GEMMs, 4 layers per graph) | M | bf16 us | current fp8 us | best fp8 us |", "|---|---|---|---|---|"]
    for M in (1, 2, 4, 8, 16, 32, 64):
        t = {r["config"]: r["us"] for r in rows if r["phase"] == "layer" and r["M"] == M}
        lines.append(f"| layer | {M} | {t['bf16']:.1f} | {t['current']:.1f} | {t['best']:.1f} |")
    md = "\n".join(lines) + "\n"
    (out / "sweep_fp8_gemv.md").write_text(md)
    print("\n" + md)


if __name__ == "__main__":
    main()
