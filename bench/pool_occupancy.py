"""Adapter-pool occupancy of the seven adapter kinds of issue 12 on SmolLM2-135M: weight bytes vs the bytes each
takes in the pool, before (fixed pages of ``page_rows`` rank-rows of every layer and module, ``ceil(max rank /
page_rows)`` pages per adapter) and after (exact-size extents, ``multilora.memory.pool``), and whether a pool of
1.25x their summed weight bytes holds all seven at once (loaded for real, with random weights, on the CPU).

    python bench/pool_occupancy.py [--dtype float32] [--out bench/results/pool_occupancy.txt]

No GPU needed: occupancy is a property of the layout. float32 is the default because the issue's figures (75.5 MB
of weights in 175.8 MB of pool) are float32 (the CPU engine's dtype); bf16 halves every byte column.
"""

from __future__ import annotations

import argparse
import platform
import sys
from pathlib import Path

import torch

# (multilora as installed: the checkout's root is never put on sys.path, where its kernels/ directory would shadow
# Hugging Face's `kernels` package, which transformers >= 5.25 imports)
from multilora.config import TARGET_MODULES, ModelConfig
from multilora.memory.pool import AdapterPool

#: SmolLM2-135M: 30 layers, hidden 576, 9 heads of 64 (q 576), 3 KV heads (k/v 192), MLP 1536.
SMOLLM2 = ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                      num_kv_heads=3)
ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


def seven_kinds(config: ModelConfig = SMOLLM2) -> dict[str, dict[tuple[int, str], int]]:
    """The issue's seven adapter kinds as ``(layer, module) -> rank`` (what PEFT's target_modules, rank_pattern and
    layers_to_transform resolve to)."""
    layers = range(config.num_layers)

    def on(modules, r, which=layers, pattern=None):
        return {(layer, m): (pattern or {}).get(m, r) for layer in which for m in modules}

    return {
        "attention-only r64": on(ATTN, 64),
        "q/v r8": on(("q_proj", "v_proj"), 8),
        "MLP-only r4 (rsLoRA)": on(MLP, 4),
        "all modules r16": on(TARGET_MODULES, 16),
        "all modules r2": on(TARGET_MODULES, 2),
        "rank_pattern down=32, others r8": on(TARGET_MODULES, 8, pattern={"down_proj": 32}),
        "layers 0-9 only r8": on(TARGET_MODULES, 8, which=range(10)),
    }


def weight_elems(config: ModelConfig, ranks: dict[tuple[int, str], int]) -> int:
    """Elements of A and B over the adapter's modules: ``sum r * (d_in + d_out)``."""
    return sum(r * sum(config.module_shape(m)) for (_, m), r in ranks.items())


def old_pool_elems(config: ModelConfig, ranks: dict[tuple[int, str], int], page_rows: int = 8) -> int:
    """Elements the fixed-page pool (before issue 12) gave an adapter: ``ceil(max rank / page_rows)`` pages of
    ``page_rows * layers * sum over all 7 modules of (d_in + d_out)`` elements."""
    width = sum(sum(config.module_shape(m)) for m in TARGET_MODULES)
    return max(1, -(-max(ranks.values()) // page_rows)) * page_rows * config.num_layers * width


def make_adapter(config: ModelConfig, name: str, ranks: dict[tuple[int, str], int], seed: int = 0, scaling=0.5):
    """A ``LoRAAdapter`` with random A [r, d_in] / B [d_out, r] (float32) for these ranks."""
    from multilora.runtime.adapters import LoRAAdapter, LoRAModuleWeights

    g = torch.Generator().manual_seed(seed)
    mods = {}
    for (layer, m), r in ranks.items():
        d_in, d_out = config.module_shape(m)
        mods[(layer, m)] = LoRAModuleWeights(a=torch.randn(r, d_in, generator=g), b=torch.randn(d_out, r, generator=g),
                                             scaling=scaling)
    return LoRAAdapter(name=name, path=f"/synthetic/{name}", config={}, modules=mods)


def occupancy_rows(config: ModelConfig, dtype: torch.dtype) -> tuple[list[dict], AdapterPool]:
    """One row per kind (weight, old pool and new pool bytes, pages of (layer, module)) after loading all seven into
    a pool of 1.25x their summed weight bytes; and that pool."""
    e = torch.empty((), dtype=dtype).element_size()
    kinds = seven_kinds(config)
    total = sum(weight_elems(config, r) for r in kinds.values()) * e
    pool = AdapterPool(config, num_bytes=int(1.25 * total), max_rank=64, dtype=dtype)
    rows = []
    for i, (name, ranks) in enumerate(kinds.items()):
        slot = pool.load(make_adapter(config, name, ranks, seed=i))
        rows.append({"kind": name, "modules": len(ranks), "weight_bytes": weight_elems(config, ranks) * e,
                     "old_pool_bytes": old_pool_elems(config, ranks) * e,
                     "new_pool_bytes": pool.extent_of(slot)[1] * pool.page_bytes, "slot": slot})
    return rows, pool


def table(config: ModelConfig, dtype: torch.dtype) -> str:
    rows, pool = occupancy_rows(config, dtype)
    mb = 1e6
    lines = [f"adapter pool occupancy, SmolLM2-135M shapes (30 layers, hidden 576, q 576, k/v 192, MLP 1536), "
             f"{str(dtype).replace('torch.', '')}; torch {torch.__version__}, {platform.machine()}",
             "old: fixed pages of page_rows=8 rank-rows of every layer and module, ceil(max rank / 8) pages per adapter",
             "new: exact-size extents (memory/pool.py), pages of 64 elements",
             "",
             f"| kind | (layer, module)s | weights MB | old pool MB | old used | new pool MB | new / weights |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['kind']} | {r['modules']} | {r['weight_bytes'] / mb:.2f} | {r['old_pool_bytes'] / mb:.2f} "
                     f"| {r['weight_bytes'] / r['old_pool_bytes']:.0%} | {r['new_pool_bytes'] / mb:.2f} "
                     f"| {r['new_pool_bytes'] / r['weight_bytes']:.3f}x |")
    w = sum(r["weight_bytes"] for r in rows)
    old = sum(r["old_pool_bytes"] for r in rows)
    new = sum(r["new_pool_bytes"] for r in rows)
    lines.append(f"| all seven | | {w / mb:.2f} | {old / mb:.2f} | {w / old:.0%} | {new / mb:.2f} | {new / w:.3f}x |")
    lines += ["",
              f"all seven loaded at once into a pool of 1.25x their weight bytes ({pool.bytes_total / mb:.2f} MB): "
              f"{pool.slots_used} resident, {pool.bytes_used / mb:.2f} MB used, {pool.bytes_free / mb:.2f} MB free",
              f"pool minimum (the largest adapter max_lora_rank=64 allows: r64 on all 7 modules of all 30 layers): "
              f"{pool.max_adapter_pages * pool.page_bytes / mb:.2f} MB"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])  # (the first paragraph, whole)
    ap.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    ap.add_argument("--out", type=Path, default=None, help="also write the table here")
    args = ap.parse_args(argv)
    if args.out is not None and args.out.is_dir():
        ap.error(f"--out: expected a file to write the table to, got the directory {str(args.out)!r}")
    text = table(SMOLLM2, getattr(torch, args.dtype))
    print(text)
    if args.out is not None:
        try:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(text + "\n")
        except OSError as e:
            print(f"pool_occupancy.py: --out: cannot write {str(args.out)!r}: {e.strerror or e}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
