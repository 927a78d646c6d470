"""Tile sweep of the decode-sized fp8 weight-only GEMM (issue 16): ``triton_fp8.fp8_gemv2`` at many tile shapes
against the engine's current choice (``fp8_weight_only_linear``) and cuBLAS bf16, on the four fused projections of
a Llama-3-8B layer, with the weights rotated so that L2 (50 MB on an H200) holds none of them.

Each timed call runs the GEMM on ``C`` distinct copies of the weight (``C * bytes >= --rotate-mb``) inside one CUDA
graph and reports the time per GEMM, so every weight byte comes from HBM, as in the engine (every layer has its own
weights). Phases:

1. sweep: M = 1 (the CUDA-core path and tl.dot), 16 and 64 (tl.dot): every tile shape, programs per SM, prefetch /
   pipeline stages; one JSON line per (module, M, config).
2. table: the fastest config per (module, M class) becomes ``fp8_gemv_tuned.json`` (the form of
   ``kernels/tuned/fp8_gemv_*.json``): weight-only tiles, fp8-activation tiles where they beat cuBLASLt, and
   ``weight_only_max_tokens`` (the largest class where weight-only beats the best fp8-activation GEMM).
3. layer: the four GEMMs of a layer in sequence (distinct weights, 4 layers per graph, time per layer) through
   ``fp8_linear(method=None)``, with the shipped tables and then with the new one, against bf16, at
   M = 1, 2, 4, 8, 16, 32, 64.

    python bench/sweep_fp8_gemv.py --out bench/results/fp8/sweep       # H200: about 3-4 minutes
    python bench/sweep_fp8_gemv.py --quick --out DIR                     # a few configs (smoke run)

Path ``scaled2`` (session 25) sweeps the fp8-activation product over its four kernels (pointer or TMA loads, x @ w^T
or w @ x^T: ``fp8_gemv2``'s ``tma`` / ``swap``) on a coarse grid (4 stages, 2 programs per SM), then the ``--refine``
fastest of each (module, rows) again at 3-6 stages and 1-4 programs per SM; ``--ms`` picks the row classes swept
(H200, one class: under 2 minutes). ``--layer-only TABLE`` skips the sweep and runs the layer phase with TABLE's
entries as its "tuned" rows (an A/B of two tables at the ``--layer-ms`` row counts):

    python bench/sweep_fp8_gemv.py --paths scaled2 --ms 64 --rep 10 --out DIR
    python bench/sweep_fp8_gemv.py --layer-only OLD.json --layer-ms 16,32,48,64 --out DIR
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}  # (N, K)
DTYPE = torch.bfloat16


def configs(path: str, quick: bool) -> list[dict]:
    """Tile configs of one path: "row" (CUDA cores, M = 1), "dot" (bf16 tensor cores, weights widened) or "scaled"
    (fp8 activations, fp8 tensor cores: ``fp8_x``)."""
    if path == "row":
        grid = itertools.product((2, 4, 8, 16), (512, 1024, 2048), (2, 4), (False,), (1, 2, 3, 4))
        out = [dict(block_n=bn, block_k=bk, num_warps=w, prefetch=p, programs_per_sm=pps, num_stages=1, use_dot=False)
               for bn, bk, w, p, pps in grid if bn * bk // (32 * w) <= 128]
    elif path == "dot":
        grid = itertools.product((32, 64, 128), (128, 256), (4, 8), (2, 4), (2, 4))
        out = [dict(block_n=bn, block_k=bk, num_warps=w, num_stages=st, programs_per_sm=pps, prefetch=False,
                    use_dot=True) for bn, bk, w, st, pps in grid]
    elif path == "scaled":
        grid = itertools.product((32, 64, 128), (128, 256), (4,), (2, 4), (2, 4))
        out = [dict(block_n=bn, block_k=bk, num_warps=w, num_stages=st, programs_per_sm=pps, prefetch=False,
                    use_dot=True, fp8_x=True) for bn, bk, w, st, pps in grid]
    else:  # "scaled2": the coarse grid (4 stages, 2 programs per SM) of the four kernels; ``refine`` does the rest
        grid = itertools.product(((False, False), (True, False), (False, True), (True, True)), (32, 64, 128, 256),
                                 (128, 256), (4, 8))
        out = [dict(block_n=bn, block_k=bk, num_warps=w, num_stages=4, programs_per_sm=2, prefetch=False,
                    use_dot=True, fp8_x=True, swap=sw, tma=tma) for (sw, tma), bn, bk, w in grid
               if 4 * (64 + bn) * bk <= 200 * 1024]  # 4 stages of x and w tiles in shared memory (at 64 rows)
    return out[:3] if quick else out


def refine(cfg: dict, quick: bool) -> list[dict]:
    """The "scaled2" neighbours of a coarse winner: its tiles at 3-6 pipeline stages and 1-4 programs per SM."""
    grid = itertools.product((3, 4, 5, 6), (1, 2, 3, 4))
    out = [dict(cfg, num_stages=st, programs_per_sm=pps) for st, pps in grid
           if (st, pps) != (cfg["num_stages"], cfg["programs_per_sm"])
           and st * (64 + cfg["block_n"]) * cfg["block_k"] <= 220 * 1024]
    return out[:2] if quick else out


def name_of(c: dict) -> str:
    kind = "x8" if c.get("fp8_x") else ("dot" if c["use_dot"] else "row")
    kind += ("_tma" if c.get("tma") else "") + ("_swap" if c.get("swap") else "")
    return (f"{kind}_{c['block_n']}x{c['block_k']}w{c['num_warps']}s{c['num_stages']}"
            f"{'p' if c['prefetch'] else ''}_pps{c['programs_per_sm']}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench/results/fp8/sweep")
    ap.add_argument("--rotate-mb", type=float, default=256.0, help="weight bytes cycled through per timed call")
    ap.add_argument("--quick", action="store_true", help="three configs per path (smoke run)")
    ap.add_argument("--rep", type=int, default=25, help="ms of replays per timing (do_bench_cudagraph rep)")
    ap.add_argument("--paths", default="row,dot,scaled", help="comma list of the tile grids to sweep: row (M = 1, "
                    "CUDA cores), dot (bf16 tensor cores), scaled (fp8 activations, fp8 tensor cores)")
    ap.add_argument("--ms", default="1,16,64", help="comma list of the row counts to sweep (of 1, 16, 64: one per "
                    "row class of the table)")
    ap.add_argument("--refine", type=int, default=4, help="scaled2: how many of the coarse grid's fastest configs per "
                    "(module, rows) are tried again at 3-6 stages and 1-4 programs per SM")
    ap.add_argument("--layer-only", metavar="TABLE", help="skip the sweep: the layer phase alone, with the table file "
                    "TABLE (read on top of the shipped ones) as its \"tuned\" rows, e.g. an older table for an A/B")
    ap.add_argument("--layer-ms", default="1,2,4,8,16,32,64", help="comma list of the layer phase's row counts (1-64)")
    ap.add_argument("--lm-head", type=int, default=0, metavar="VOCAB",
                    help="also sweep the LM head [VOCAB, 4096] (Llama-3: 128256) for the fp8 LM head "
                         "(EngineConfig.fp8_lm_head); its tiles join the table, not the layer phase")
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
    from multilora.kernels.fp8 import fp8_linear, quantize_per_token_torch, quantize_weight, resolve_method

    def triton_scaled_mm(x, q):  # cuBLASLt's fp8 GEMM with the per-token quantization launch (no tuned kernel)
        xq, xsc = triton_fp8.quantize_per_token(x) if x.is_cuda else quantize_per_token_torch(x)
        return torch._scaled_mm(xq, q.qweight.t(), scale_a=xsc, scale_b=q.scale.view(1, -1), out_dtype=x.dtype)

    dev = torch.device("cpu" if args.smoke else "cuda")
    num_sms = 4 if args.smoke else torch.cuda.get_device_properties(dev).multi_processor_count
    meta = {"device": "cpu (smoke)" if args.smoke else torch.cuda.get_device_name(dev), "torch": torch.__version__, "triton": triton.__version__,
            "python": platform.python_version(), "sms": num_sms, "rotate_mb": args.rotate_mb,
            "timing": "triton.testing.do_bench_cudagraph median over C rotated weight copies, per GEMM"}
    # the arguments, checked before any weight is made
    sweep_ms = tuple(int(m) for m in args.ms.split(","))
    if not set(sweep_ms) <= {1, 16, 64}:
        sys.exit(f"sweep_fp8_gemv: --ms takes row counts of 1, 16, 64 (one per row class), got {args.ms}")
    ms = tuple(int(m) for m in args.layer_ms.split(","))
    if not all(1 <= m <= 64 for m in ms):
        sys.exit(f"sweep_fp8_gemv: --layer-ms takes row counts 1..64, got {args.layer_ms}")
    if args.layer_only:  # the table must hold entries for this GPU, or "tuned" would silently be "current"
        read: dict = {}
        triton_fp8._read_tuned(Path(args.layer_only), read)
        if not any(read.get(meta["device"], {}).get(k) for k in ("configs", "scaled_configs")):
            sys.exit(f"sweep_fp8_gemv: --layer-only {args.layer_only}: no valid entry for {meta['device']} "
                     f"(devices in it: {sorted(read) or 'none: the file did not parse, see the warning'})")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    global DTYPE
    DTYPE = torch.float16 if args.smoke else torch.bfloat16  # the interpreter has no bf16
    g = torch.Generator(device=dev).manual_seed(0)
    swept = dict(SHAPES)  # the sweep phase's shapes: the layer's four, and the LM head if asked
    if args.lm_head:
        swept["lm_head"] = (args.lm_head, SHAPES["o"][1])
    weights = {}
    for name, (N, K) in swept.items():
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

    paths = args.paths.split(",")
    swept_now = {} if args.layer_only else swept  # the shapes the sweep phase runs (none with --layer-only)
    t0 = time.perf_counter()
    for name, (N, K) in swept_now.items():
        wb, wq = weights[name]
        for M in sweep_ms:
            x = torch.randn(M, K, device=dev, dtype=DTYPE, generator=g)
            ref = x.float() @ wb[0].float().t()
            record(phase="sweep", module=name, M=M, config="bf16",
                   us=bench(lambda: [x @ t.t() for t in wb], len(wb)))
            # what the engine runs now (method None, with the tuned tables already shipped), and cuBLASLt's fp8 GEMM
            record(phase="sweep", module=name, M=M, config="current", method=resolve_method(None, x, N),
                   us=bench(lambda: [fp8_linear(x, q) for q in wq], len(wq)))
            if not args.smoke:
                record(phase="sweep", module=name, M=M, config="scaled_mm",
                       us=bench(lambda: [triton_scaled_mm(x, q) for q in wq], len(wq)))
            def try_cfg(cfg):
                fn = lambda cfg=cfg: [triton_fp8.fp8_gemv2(x, q.qweight, q.scale, num_sms=num_sms, **cfg) for q in wq]
                try:
                    y = fn()[0]
                except Exception as e:  # a config Triton cannot compile (shared memory, registers)
                    record(phase="sweep", module=name, M=M, config=name_of(cfg), us=None, error=str(e)[:200])
                    return
                err = float((y.float() - ref).norm() / ref.norm())
                record(phase="sweep", module=name, M=M, config=name_of(cfg), cfg=cfg, us=bench(fn, len(wq)),
                       rel_err=err)

            for path in paths:
                if (path == "row") != (M == 1):
                    continue
                start = len(rows)
                for cfg in configs(path, args.quick):
                    try_cfg(cfg)
                if path == "scaled2":  # the coarse grid's fastest, at other stages and programs per SM
                    done = sorted((r for r in rows[start:] if r.get("us") and r["rel_err"] < 0.1), key=lambda r: r["us"])
                    for r in done[:args.refine]:
                        for cfg in refine(r["cfg"], args.quick):
                            try_cfg(cfg)
            print(f"# {name} M={M} done at {time.perf_counter() - t0:.0f} s", flush=True)
    for r in rows:
        if r.get("us"):
            N, K = swept[r["module"]]
            wbytes = N * K * (2 if r["config"] == "bf16" else 1)
            r["weight_tb_s"] = wbytes / (r["us"] * 1e-6) / 1e12

    def at(name, M, config):
        return next((r for r in rows if r.get("module") == name and r["M"] == M and r["config"] == config), None)

    # the fastest swept config per (module, M) and path kind: weight-only (row / dot) and fp8 activations
    best: dict[tuple[str, int], dict] = {}
    best_sc: dict[tuple[str, int], dict] = {}
    for r in rows:
        if r.get("cfg") and r.get("us") and r["rel_err"] < 0.1:  # a sanity bound (fp8 activations add ~1e-2)
            into = best_sc if r["cfg"].get("fp8_x") else best
            k = (r["module"], r["M"])
            if k not in into or r["us"] < into[k]["us"]:
                into[k] = r
    # the engine's current weight-only path competes too (the shipped table's config, possibly not re-swept here)
    for name, (N, K) in swept.items():
        for M in sweep_ms:
            cur, cfg = at(name, M, "current"), triton_fp8.gemv_config(dev, N, K, M)
            if cur and cur["method"] == "weight_only" and cfg and ((name, M) not in best or cur["us"] < best[(name, M)]["us"]):
                best[(name, M)] = dict(cur, cfg=cfg, config="current (" + name_of(cfg) + ")")
    for (name, M), r in sorted(best.items()):
        print(f"# best weight-only {name} M={M}: {r['config']} {r['us']:.1f} us ({r['weight_tb_s']:.2f} TB/s); "
              f"bf16 {at(name, M, 'bf16')['us']:.1f} us", flush=True)
    for (name, M), r in sorted(best_sc.items()):
        cub = at(name, M, "scaled_mm")
        print(f"# best fp8-activation {name} M={M}: {r['config']} {r['us']:.1f} us; cuBLASLt "
              f"{cub['us'] if cub else float('nan'):.1f} us", flush=True)

    # the tuned table the engine reads (kernels/tuned/fp8_gemv_*.json; MULTILORA_FP8_TUNED=<this file> to try it)
    def scaled_us(name, M):
        cub = at(name, M, "scaled_mm")
        ours = best_sc.get((name, M))
        return min([v for v in (cub and cub["us"], ours and ours["us"]) if v] or [float("inf")])
    wo_max = 1
    for M in (16, 64):
        if not all((n, M) in best for n in SHAPES):
            break
        if sum(best[(n, M)]["us"] for n in SHAPES) >= sum(scaled_us(n, M) for n in SHAPES):
            break
        wo_max = M
    tuned = {"device": meta["device"], "source": "python bench/sweep_fp8_gemv.py --paths " + args.paths + " ("
             + meta["timing"] + ")", "torch": meta["torch"], "triton": meta["triton"],
             "weight_only_max_tokens": wo_max, "configs": {}, "scaled_configs": {}}
    if not any(M in sweep_ms for M in (16, 64)) or not any((n, M) in best for n in SHAPES for M in (16, 64)):
        del tuned["weight_only_max_tokens"]  # not measured here (no weight-only tiles of 16 or 64 rows swept):
        wo_max = None  # a table read on top of the shipped ones then keeps theirs
    for (name, M), r in sorted(best.items()):
        N, K = swept[name]
        tuned["configs"].setdefault(f"{N}x{K}", {})[str(M)] = r["cfg"]
    for (name, M), r in sorted(best_sc.items()):
        cub = at(name, M, "scaled_mm")
        if cub is None or r["us"] < cub["us"]:
            N, K = swept[name]
            tuned["scaled_configs"].setdefault(f"{N}x{K}", {})[str(M)] = r["cfg"]
    if args.layer_only:  # (checked above: it has entries for this GPU)
        tuned_path = Path(args.layer_only)
        tuned = json.loads(tuned_path.read_text())
        wo_max = tuned.get("weight_only_max_tokens")
    else:
        tuned_path = out / "fp8_gemv_tuned.json"
        tuned_path.write_text(json.dumps(tuned, indent=1))

    # phase 2: whole layers (4 GEMMs in sequence, 4 layers of distinct weights per graph) through the product path,
    # fp8_linear(method=None): first with the shipped tables ("current"), then with the table just written ("tuned")
    layers = 4
    lw = {name: [(weights[name][0][i % len(weights[name][0])], weights[name][1][i % len(weights[name][1])])
                 for i in range(layers)] for name in SHAPES}
    xs = {M: {name: torch.randn(M, K, device=dev, dtype=DTYPE, generator=g) for name, (N, K) in SHAPES.items()}
          for M in ms}

    def run(M, kind):
        for i in range(layers):
            for name in SHAPES:
                x, (b, q) = xs[M][name], lw[name][i]
                if kind == "bf16":
                    x @ b.t()
                else:
                    fp8_linear(x, q)
    for kind in ("bf16", "current", "tuned"):
        if kind == "tuned":
            os.environ["MULTILORA_FP8_TUNED"] = str(tuned_path)
            triton_fp8._tuned = None  # re-read the tables with the new file on top
        for M in ms:
            run(M, kind)
            record(phase="layer", M=M, config=kind, us=bench(lambda: run(M, kind), layers))
    (out / "sweep_fp8_gemv.json").write_text(json.dumps({"meta": meta, "rows": rows, "tuned": tuned}, indent=1))
    lines = [f"{meta['device']}, torch {meta['torch']}, triton {meta['triton']}; {meta['timing']}; paths {args.paths}", "",
             "| module | M | bf16 us | engine before us | cuBLASLt scaled_mm us | best weight-only us (config, TB/s) | "
             "best fp8-activation us (config) |", "|---|---|---|---|---|---|---|"]
    for name in swept_now:
        for M in sweep_ms:
            b, c, sm = at(name, M, "bf16"), at(name, M, "current"), at(name, M, "scaled_mm")
            wo, sc = best.get((name, M)), best_sc.get((name, M))
            lines.append(f"| {name} | {M} | {b['us']:.1f} | {c['us']:.1f} ({c['method']}) | "
                         f"{sm['us']:.1f} | " if sm else f"| {name} | {M} | {b['us']:.1f} | {c['us']:.1f} | - | ")
            lines[-1] += (f"{wo['us']:.1f} ({wo['config']}, {wo['weight_tb_s']:.2f}) | " if wo else "- | ")
            lines[-1] += (f"{sc['us']:.1f} ({sc['config']}) |" if sc else "- |")
    lines += ["", f"weight_only_max_tokens: {'not measured (left out of the table)' if wo_max is None else wo_max}", "",
              "| layer (4 GEMMs, 4 layers per graph) | M | bf16 us | engine before us | tuned us | tuned vs bf16 |",
              "|---|---|---|---|---|---|"]
    for M in ms:
        t = {r["config"]: r["us"] for r in rows if r["phase"] == "layer" and r["M"] == M}
        lines.append(f"| layer | {M} | {t['bf16']:.1f} | {t['current']:.1f} | {t['tuned']:.1f} | "
                     f"{t['bf16'] / t['tuned']:.2f}x |")
    md = "\n".join(lines) + "\n"
    (out / "sweep_fp8_gemv.md").write_text(md)
    print("\n" + md)


if __name__ == "__main__":
    main()
