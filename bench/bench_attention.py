"""Paged attention on a GPU: our Triton kernel against torch and FlexAttention, Llama-3-8B attention shapes.

Shapes: 32 query heads, 8 KV heads, head_dim 128, bf16, block_size 16; decode (one new token per sequence)
for batch 1/8/64/256 at context 512/2048, and prefill of B prompts of 512 tokens (B = 1, 8, 32) in one
launch. Every sequence of a row has the same length, so a dense batch is exact and SDPA is a fair bound.

Providers, side by side on every row:
  ours         ``paged_attention_triton`` over the paged cache (one launch; decode may add a split combine)
  torch_ref    ``paged_attention_torch``: gather the blocks, repeat KV heads, SDPA with a mask
  sdpa_dense   SDPA (flash backend, enable_gqa) on contiguous K/V: no paging, the lower bound of the time
  flex         FlexAttention (torch.compile) on K/V gathered from the paged cache, causal block mask
  flex_kernel  the same FlexAttention call on already-dense K/V (the gather not counted)

Decode rows are timed from CUDA graphs (``triton.testing.do_bench_cudagraph``) and each call cycles through
up to 64 disjoint problem sets (>= 256 MB of KV per call where the row is smaller) so the 60 MB L2 is not
measured; prefill rows use ``do_bench`` (which flushes L2 between runs) on one set. Reported: median time,
achieved bandwidth (KV bytes read / time) for decode, causal TFLOP/s for prefill, and the copy bandwidth of
a 1 GiB device-to-device copy measured in the same run. FlexAttention rows run after all others, while the
time budget lasts (its compiles take seconds each).

Usage: python bench/bench_attention.py --out bench/results [--no-flex] [--budget-s 75]
Writes ``attention.json`` (device, versions, copy bandwidth, one row per shape with its fields and errors)
and ``attention.png``; ``--plot FILE.json`` only redraws the plot.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from dataclasses import dataclass

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
GB = 1e9
DEV = "cuda"  # the CPU smoke test (tests/test_attention.py) runs main() on "cpu" with tiny rows
H, HKV, D, BLOCK = 32, 8, 128, 16  # Llama-3-8B attention, the engine's block size
SCALE = D ** -0.5
DTYPE = torch.bfloat16
DECODE_ROWS = [("decode", B, ctx) for ctx in (512, 2048) for B in (1, 8, 64, 256)]
PREFILL_ROWS = [("prefill", B, 512) for B in (1, 8, 32)]
# FlexAttention order of importance (its compiles may not all fit in the budget)
FLEX_ORDER = [("prefill", 8, 512), ("decode", 64, 2048), ("decode", 8, 2048), ("decode", 256, 2048),
              ("prefill", 32, 512), ("decode", 1, 2048), ("prefill", 1, 512), ("decode", 1, 512),
              ("decode", 8, 512), ("decode", 64, 512), ("decode", 256, 512)]
SET_BYTES = 256e6  # decode: KV bytes per timed call, at least (L2 is 60 MB)
MAX_SETS = 64
CORE = ("ours", "torch_ref", "sdpa_dense")
FLEX = ("flex", "flex_kernel")


def _import_multilora() -> None:
    """Make ``multilora`` importable from a checkout that is not pip-installed (the repo maps
    ``multilora.kernels`` to ``kernels/``; pyproject does this for an install)."""
    try:
        import multilora.kernels.attention  # noqa: F401
        return
    except ImportError:
        pass
    root = os.path.dirname(HERE)
    sys.path.insert(0, root)
    import multilora

    if root not in multilora.__path__:
        multilora.__path__.append(root)


# ---------------------------------------------------------------------------------------------- problems
@dataclass
class ProblemSet:
    q: torch.Tensor  # [T, H, D]
    k_cache: torch.Tensor  # [num_blocks, BLOCK, HKV, D]
    v_cache: torch.Tensor
    meta: object  # AttentionMetadata
    tables: torch.Tensor  # int64 [B, ctx // BLOCK]
    q_dense: torch.Tensor  # [B, H, n, D]
    k_dense: torch.Tensor  # [B, HKV, ctx, D]
    v_dense: torch.Tensor


def kv_bytes(B: int, ctx: int) -> int:
    return 2 * B * ctx * HKV * D * DTYPE.itemsize


def causal_flops(B: int, n: int) -> int:
    """QK^T and PV over the causal triangle of n new tokens per sequence (no past): 4 * H * D per pair."""
    return 4 * B * H * D * n * (n + 1) // 2


def make_set(phase: str, B: int, ctx: int, gen: torch.Generator) -> ProblemSet:
    from multilora.kernels.attention import build_attention_metadata

    n = 1 if phase == "decode" else ctx
    nblk = ctx // BLOCK
    tables = torch.randperm(B * nblk, device=DEV, generator=gen).view(B, nblk)  # shuffled blocks
    k_dense = torch.randn(B, HKV, ctx, D, device=DEV, generator=gen, dtype=DTYPE)
    v_dense = torch.randn(B, HKV, ctx, D, device=DEV, generator=gen, dtype=DTYPE)
    k_cache = torch.empty(B * nblk, BLOCK, HKV, D, device=DEV, dtype=DTYPE)
    v_cache = torch.empty_like(k_cache)
    k_cache[tables.flatten()] = k_dense.transpose(1, 2).reshape(B * nblk, BLOCK, HKV, D)
    v_cache[tables.flatten()] = v_dense.transpose(1, 2).reshape(B * nblk, BLOCK, HKV, D)
    q = torch.randn(B * n, H, D, device=DEV, generator=gen, dtype=DTYPE)
    meta = build_attention_metadata([n] * B, [ctx] * B, tables.cpu().tolist(), block_size=BLOCK, device=DEV)
    q_dense = q.view(B, n, H, D).transpose(1, 2).contiguous()
    return ProblemSet(q, k_cache, v_cache, meta, tables, q_dense, k_dense, v_dense)


def make_problem(phase: str, B: int, ctx: int) -> list[ProblemSet]:
    gen = torch.Generator(device=DEV).manual_seed(B * 10007 + ctx)
    sets = 1 if phase == "prefill" else max(1, min(MAX_SETS, math.ceil(SET_BYTES / kv_bytes(B, ctx))))
    return [make_set(phase, B, ctx, gen) for _ in range(sets)]


# ---------------------------------------------------------------------------------------------- providers
def _gather(s: ProblemSet, cache: torch.Tensor) -> torch.Tensor:
    B, nblk = s.tables.shape
    return cache[s.tables].view(B, nblk * BLOCK, HKV, D).transpose(1, 2)  # [B, HKV, ctx, D], strided


def make_providers(phase: str, sets: list[ProblemSet], names) -> tuple[dict, dict]:
    """Callables that run one provider over every set (returning the outputs), and notes for the row."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from multilora.kernels.attention import paged_attention_torch
    from multilora.kernels.triton_attention import paged_attention_triton

    causal = phase == "prefill"
    fns, notes = {}, {}
    if "ours" in names:
        fns["ours"] = lambda: [paged_attention_triton(s.q, s.k_cache, s.v_cache, s.meta, scale=SCALE) for s in sets]
    if "torch_ref" in names:
        fns["torch_ref"] = lambda: [paged_attention_torch(s.q, s.k_cache, s.v_cache, s.meta, scale=SCALE) for s in sets]
    if "sdpa_dense" in names:
        backends = [SDPBackend.FLASH_ATTENTION]
        try:  # the flash backend, if it takes this call; else whichever SDPA picks
            with sdpa_kernel(backends):
                F.scaled_dot_product_attention(sets[0].q_dense, sets[0].k_dense, sets[0].v_dense, is_causal=causal,
                                               scale=SCALE, enable_gqa=True)
        except RuntimeError as exc:
            print(f"  sdpa_dense: flash backend refused ({str(exc)[:100]}); any backend", flush=True)
            backends = [getattr(SDPBackend, b) for b in ("FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION",
                                                          "MATH") if hasattr(SDPBackend, b)]
        notes["sdpa_dense_backends"] = [b.name for b in backends]

        def sdpa_dense():
            with sdpa_kernel(backends):
                return [F.scaled_dot_product_attention(s.q_dense, s.k_dense, s.v_dense, is_causal=causal, scale=SCALE,
                                                       enable_gqa=True) for s in sets]
        fns["sdpa_dense"] = sdpa_dense
    if any(n in names for n in FLEX):
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        flex = torch.compile(flex_attention, dynamic=False)
        n, ctx = sets[0].q_dense.shape[2], sets[0].k_dense.shape[2]
        mask = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, n, ctx, device=DEV) if causal else None

        def run(s, k, v):
            return flex(s.q_dense, k, v, block_mask=mask, scale=SCALE, enable_gqa=True)

        fns["flex"] = lambda: [run(s, _gather(s, s.k_cache), _gather(s, s.v_cache)) for s in sets]
        fns["flex_kernel"] = lambda: [run(s, s.k_dense, s.v_dense) for s in sets]
    return fns, notes


def time_ms(fn, graph: bool) -> tuple[float, bool]:
    """Median ms of one call of ``fn``, and whether it was timed from a CUDA graph."""
    import triton.testing as tt

    fn()
    torch.cuda.synchronize()
    if graph:
        try:
            return tt.do_bench_cudagraph(fn, rep=30, return_mode="median"), True
        except Exception as exc:  # noqa: BLE001  (some providers cannot be captured: time them eagerly)
            print(f"  (no CUDA graph: {type(exc).__name__}: {str(exc)[:120]})", flush=True)
            torch.cuda.synchronize()
    return tt.do_bench(fn, warmup=10, rep=60, return_mode="median"), False


def _to_tokens(o: torch.Tensor) -> torch.Tensor:
    """Dense [B, H, n, D] -> [B * n, H, D] (token order of the paged op)."""
    B, _, n, _ = o.shape
    return o.transpose(1, 2).reshape(B * n, H, D)


def bench_row(phase: str, B: int, ctx: int, sets: list[ProblemSet], names, copy_gbps: float, row: dict | None = None):
    from multilora.kernels import triton_attention

    n = 1 if phase == "decode" else ctx
    if row is None:
        row = dict(phase=phase, batch=B, context=ctx, q_len=n, heads=H, kv_heads=HKV, head_dim=D, block_size=BLOCK,
                   dtype="bfloat16", sets_per_call=len(sets), kv_bytes=kv_bytes(B, ctx), errors={})
        if phase == "decode":
            capacity = sets[0].meta.block_tables.shape[1] * BLOCK
            dev = torch.device(DEV)
            row["ours_num_splits"] = triton_attention._decode_launch(dev, B * HKV, capacity, D, DTYPE)[4]
        else:
            row["causal_flops"] = causal_flops(B, n)
    try:
        fns, notes = make_providers(phase, sets, names)
    except Exception as exc:  # noqa: BLE001
        for name in names:
            row["errors"][name] = f"setup: {type(exc).__name__}: {str(exc)[:500]}"
        print(f"  ERROR setup of {names}: {str(exc)[:200]}", flush=True)
        return row
    row.update(notes)
    ref = None
    for name in names:
        try:
            t, graphed = time_ms(fns[name], graph=phase == "decode")
        except Exception as exc:  # noqa: BLE001  (record and go on: one provider must not lose the run)
            row["errors"][name] = f"{type(exc).__name__}: {str(exc)[:500]}"
            print(f"  ERROR {name}: {row['errors'][name][:200]}", flush=True)
            torch.cuda.synchronize()
            continue
        t /= len(sets)
        row[f"{name}_ms"] = t
        row[f"{name}_graph"] = graphed
        if phase == "decode":
            row[f"{name}_gbps"] = kv_bytes(B, ctx) / (t * 1e-3) / GB
            row[f"{name}_copy_frac"] = row[f"{name}_gbps"] / copy_gbps
        else:
            row[f"{name}_tflops"] = causal_flops(B, n) / (t * 1e-3) / 1e12
        try:  # agreement with dense SDPA on the first set (fp32 SDPA reference, same bf16 inputs)
            if ref is None:
                s = sets[0]
                ref = _to_tokens(torch.nn.functional.scaled_dot_product_attention(
                    s.q_dense.float(), s.k_dense.float(), s.v_dense.float(), is_causal=phase == "prefill", scale=SCALE,
                    enable_gqa=True))
            out = fns[name]()[0]
            out = _to_tokens(out) if out.dim() == 4 else out
            row[f"{name}_max_abs_err"] = float((out.float() - ref).abs().max())
        except Exception as exc:  # noqa: BLE001
            row["errors"][f"{name}_check"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    return row


def copy_bandwidth() -> float:
    """GB/s of one 1 GiB device-to-device copy (bytes read + written)."""
    import triton.testing as tt

    n = 1 << 29  # bf16 elements
    src = torch.randn(n, device=DEV, dtype=DTYPE)
    dst = torch.empty_like(src)
    t = tt.do_bench(lambda: dst.copy_(src), warmup=20, rep=200, return_mode="median") * 1e-3
    return 2 * n * DTYPE.itemsize / t / GB


def has_device() -> bool:
    return torch.cuda.is_available()


def environment() -> dict:
    import triton

    props = torch.cuda.get_device_properties(0)
    return {"gpu": props.name, "sms": props.multi_processor_count, "memory_gib": props.total_memory / 2**30,
            "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
            "python": sys.version.split()[0], "platform": platform.platform(),
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}


# ---------------------------------------------------------------------------------------------- output
def _fmt(row: dict, name: str) -> str:
    t = row.get(f"{name}_ms")
    if t is None:
        return "error" if name in row["errors"] else "-"
    return f"{t * 1e3:.1f}us" if t < 1 else f"{t:.2f}ms"


def summary_line(row: dict) -> str:
    if row["phase"] == "decode":
        perf = (f"ours {row.get('ours_gbps', 0):.0f} GB/s ({row.get('ours_copy_frac', 0):.0%} of copy), "
                f"sdpa {row.get('sdpa_dense_gbps', 0):.0f} GB/s, splits {row.get('ours_num_splits')}")
    else:
        perf = f"ours {row.get('ours_tflops', 0):.0f} TFLOP/s, sdpa {row.get('sdpa_dense_tflops', 0):.0f} TFLOP/s"
    times = " ".join(f"{n}={_fmt(row, n)}" for n in CORE + FLEX)
    err = row.get("ours_max_abs_err")
    return (f"{row['phase']:<7} B={row['batch']:<4} ctx={row['context']:<5} {times} | {perf} | "
            f"ours err {'-' if err is None else f'{err:.1e}'}")


def table(res: dict) -> str:
    """Median time per call of every provider, and our bandwidth (decode) or TFLOP/s (prefill)."""
    lines = [f"{'row':<22}" + "".join(f"{n:>13}" for n in CORE + FLEX) + "   ours"]
    for r in res["rows"]:
        perf = (f"{r.get('ours_gbps', 0):.0f} GB/s ({r.get('ours_copy_frac', 0):.0%} of copy)" if r["phase"] == "decode"
                else f"{r.get('ours_tflops', 0):.0f} TFLOP/s")
        lines.append(f"{r['phase'] + ' B=' + str(r['batch']) + ' ctx=' + str(r['context']):<22}"
                     + "".join(f"{_fmt(r, n):>13}" for n in CORE + FLEX) + f"   {perf}")
    return "\n".join(lines)


def plot(res: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(14, 5.5))
    names = CORE + FLEX
    ax = axes[0]
    for ctx, style in ((512, "--"), (2048, "-")):
        rows = [r for r in res["rows"] if r["phase"] == "decode" and r["context"] == ctx]
        rows.sort(key=lambda r: r["batch"])
        for i, name in enumerate(names):
            pts = [(r["batch"], r[f"{name}_gbps"]) for r in rows if r.get(f"{name}_gbps")]
            if pts:
                ax.plot(*zip(*pts), style, marker="o", color=f"C{i}", label=f"{name} ctx {ctx}")
    ax.axhline(res["copy_gbps"], color="k", lw=0.8, ls=":", label="device copy")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch (sequences)")
    ax.set_ylabel("KV bytes read / time (GB/s)")
    ax.set_title("decode, Llama-3-8B attention (32/8 heads, d 128, bf16, block 16)")
    ax.legend(fontsize=7, ncol=2)
    ax = axes[1]
    rows = sorted((r for r in res["rows"] if r["phase"] == "prefill"), key=lambda r: r["batch"])
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        xs = [j + i * width for j in range(len(rows))]
        ax.bar(xs, [r.get(f"{name}_tflops") or 0 for r in rows], width, color=f"C{i}", label=name)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(rows))], [f"B={r['batch']} x 512" for r in rows])
    ax.set_ylabel("causal TFLOP/s")
    ax.set_title("prefill of B prompts of 512 tokens, one launch")
    ax.legend(fontsize=8)
    env = res["environment"]
    fig.suptitle(f"{env['gpu']}, torch {env['torch']}, triton {env['triton']}; copy {res['copy_gbps']:.0f} GB/s",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------- main
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--no-flex", action="store_true", help="skip FlexAttention (torch.compile)")
    ap.add_argument("--budget-s", type=float, default=75.0, help="start no FlexAttention row after this many seconds")
    ap.add_argument("--plot", help="only redraw the plot of this results JSON")
    args = ap.parse_args(argv)
    if args.plot:
        with open(args.plot) as f:
            plot(json.load(f), os.path.join(os.path.dirname(args.plot), "attention.png"))
        return 0
    if not has_device():
        print("bench_attention: needs a CUDA GPU (nothing to measure on CPU)", file=sys.stderr)
        return 2
    t0 = time.time()
    _import_multilora()
    try:  # one FlexAttention compile per shape and stride pattern: more than dynamo's default limit of 8
        import torch._dynamo as dynamo  # (a plain ``import torch._dynamo`` would make torch local to main)

        for knob in ("recompile_limit", "cache_size_limit"):
            if hasattr(dynamo.config, knob):
                setattr(dynamo.config, knob, 64)
    except Exception as exc:  # noqa: BLE001
        print("dynamo config:", exc)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "attention.json")
    res = {"environment": environment(), "copy_gbps": copy_bandwidth(), "rows": [], "errors": [],
           "providers": {"ours": "paged_attention_triton", "torch_ref": "paged_attention_torch (gather + SDPA)",
                         "sdpa_dense": "SDPA flash backend on contiguous K/V (no paging)",
                         "flex": "FlexAttention (compiled) on K/V gathered from the paged cache",
                         "flex_kernel": "FlexAttention (compiled) on contiguous K/V"}}
    print(json.dumps(res["environment"]), f"copy {res['copy_gbps']:.0f} GB/s", flush=True)
    problems, rows = {}, {}

    def save():
        res["rows"] = [rows[k] for k in DECODE_ROWS + PREFILL_ROWS if k in rows]
        with open(path, "w") as f:
            json.dump(res, f, indent=1)

    for key in DECODE_ROWS + PREFILL_ROWS:
        try:
            problems[key] = make_problem(*key)
            rows[key] = bench_row(*key, problems[key], CORE, res["copy_gbps"])
        except Exception as exc:  # noqa: BLE001
            res["errors"].append(f"{key}: {type(exc).__name__}: {exc}")
            print("ERROR", key, exc, flush=True)
            torch.cuda.empty_cache()
            continue
        print(summary_line(rows[key]), flush=True)
        save()
    if not args.no_flex:
        for key in FLEX_ORDER:
            if key not in rows:
                continue
            if time.time() - t0 > args.budget_s:
                rows[key]["errors"]["flex"] = "skipped: time budget"
                continue
            bench_row(*key, problems[key], FLEX, res["copy_gbps"], row=rows[key])
            print(summary_line(rows[key]), flush=True)
            save()
    save()
    print("\n" + table(res))
    try:
        plot(res, os.path.join(args.out, "attention.png"))
    except ImportError as exc:
        print("no plot:", exc)
    print(f"done in {time.time() - t0:.0f} s -> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
