"""Megatron-style shards of a model and of its LoRA adapters for tensor parallelism (the layout and why it needs no
extra collective for LoRA: ``runtime.parallel``'s docstring). Pure tensor slicing: no processes, no collectives.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from multilora.config import ModelConfig

COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW_PARALLEL = ("o_proj", "down_proj")


# ------------------------------------------------------------------------------------------- shapes
def check_tp_size(config: ModelConfig, size: int) -> None:
    """Raise ValueError unless ``config`` can be split over ``size`` ranks (heads, intermediate, KV heads)."""
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"Engine: tensor_parallel_size must be an int >= 1, got {size!r}")
    H, KV, I = config.num_heads, config.num_kv_heads, config.intermediate_size
    bad = []
    if H % size:
        bad.append(f"num_heads {H}")
    if I % size:
        bad.append(f"intermediate_size {I}")
    if KV % size and size % KV:
        bad.append(f"num_kv_heads {KV} (the size must divide it or be a multiple of it)")
    if bad:
        fits = [n for n in range(1, H + 1) if not H % n and not I % n and not (KV % n and n % KV)]
        raise ValueError(f"Engine: tensor_parallel_size={size} does not divide the model's {', '.join(bad)}; the sizes "
                         f"that do: {', '.join(map(str, fits))}")


def tp_rank_config(config: ModelConfig, size: int) -> ModelConfig:
    """The shape of one rank's shard: ``num_heads / N``, ``max(num_kv_heads / N, 1)``, ``intermediate_size / N``,
    the same ``head_dim``, hidden size, vocabulary and everything else."""
    check_tp_size(config, size)
    if size == 1:
        return config
    return dataclasses.replace(config, num_heads=config.num_heads // size,
                               num_kv_heads=max(config.num_kv_heads // size, 1),
                               intermediate_size=config.intermediate_size // size, head_dim=config.head_dim)


def _ranges(config: ModelConfig, rank: int, size: int) -> dict[str, tuple[int, int]]:
    """Output rows (column-parallel) or input columns (row-parallel) of each target module that ``rank`` keeps."""
    D = config.head_dim
    hq = config.num_heads // size
    kv = config.num_kv_heads
    kv_lo = rank * kv // size if kv >= size else rank // (size // kv)
    kv_n = max(kv // size, 1)
    il = config.intermediate_size // size
    q = (rank * hq * D, (rank + 1) * hq * D)
    k = (kv_lo * D, (kv_lo + kv_n) * D)
    i = (rank * il, (rank + 1) * il)
    return {"q_proj": q, "k_proj": k, "v_proj": k, "o_proj": q, "gate_proj": i, "up_proj": i, "down_proj": i}


def shard_lora(module: str, a: torch.Tensor, b: torch.Tensor, config: ModelConfig, rank: int,
               size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One target module's LoRA factors on ``rank``: a [r, d_in], b [d_out, r] of the full model -> the shard's
    (module docstring: B's rows for column-parallel modules, A's columns for row-parallel ones)."""
    if size == 1:
        return a, b
    lo, hi = _ranges(config, rank, size)[module]
    if module in ROW_PARALLEL:
        return a[:, lo:hi].contiguous(), b
    return a, b[lo:hi].contiguous()


class ShardSink:
    """A ``ModuleSink`` (``runtime.adapters.load``) that shards each module's factors before passing them on."""

    def __init__(self, inner: Any, config: ModelConfig, rank: int, size: int) -> None:
        self.inner, self.config, self.rank, self.size = inner, config, rank, size

    def put(self, layer: int, module: str, a: torch.Tensor, b: torch.Tensor, scaling: float) -> None:
        a, b = shard_lora(module, a, b, self.config, self.rank, self.size)
        self.inner.put(layer, module, a, b, scaling)

    def finish(self) -> Any:
        return self.inner.finish()


def shard_weights(weights: dict[str, torch.Tensor], config: ModelConfig, rank: int,
                  size: int) -> dict[str, torch.Tensor]:
    """HF-named base weights of the full model -> rank ``rank``'s shard (module docstring). Phi-3's fused
    ``qkv_proj`` / ``gate_up_proj`` tensors are split into their parts, sharded and fused again."""
    if size == 1:
        return weights
    R = _ranges(config, rank, size)
    out: dict[str, torch.Tensor] = {}
    c = config
    for name, t in weights.items():
        parts = name.split(".")
        if len(parts) < 5 or parts[0] != "model" or parts[1] != "layers":
            out[name] = t  # embeddings, final norm, LM head, rope_freqs: replicated
            continue
        mod, kind = parts[-2], parts[-1]
        if mod in COLUMN_PARALLEL and kind in ("weight", "bias"):
            lo, hi = R[mod]
            out[name] = t[lo:hi].contiguous()
        elif mod in ROW_PARALLEL and kind == "weight":
            lo, hi = R[mod]
            out[name] = t[:, lo:hi].contiguous()
        elif mod in ROW_PARALLEL and kind == "bias":
            out[name] = t if rank == 0 else torch.zeros_like(t)  # added once, by rank 0
        elif mod == "qkv_proj":  # Phi-3: [q; k; v] rows
            q, k, v = t.split([c.q_size, c.kv_size, c.kv_size])
            out[name] = torch.cat([q[slice(*R["q_proj"])], k[slice(*R["k_proj"])], v[slice(*R["v_proj"])]]).contiguous()
        elif mod == "gate_up_proj":  # Phi-3: [gate; up] rows
            g, u = t.split([c.intermediate_size, c.intermediate_size])
            out[name] = torch.cat([g[slice(*R["gate_proj"])], u[slice(*R["up_proj"])]]).contiguous()
        else:  # norms, q/k norms: replicated
            out[name] = t
    return out
