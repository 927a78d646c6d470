"""Backend selection for the LoRA apply op: torch (CPU, oracle) or the Triton kernels (CUDA)."""

from __future__ import annotations

from typing import Callable

import torch

from multilora.kernels.lora import LoRAPlan, lora_apply_torch


def _triton_backend() -> Callable | None:
    try:
        from multilora.kernels import triton_sgmv  # noqa: F401
    except Exception:  # triton missing or no GPU backend yet
        return None
    return getattr(triton_sgmv, "lora_apply_triton", None)


def resolve_backend(backend: str | None, x: torch.Tensor) -> Callable:
    """The apply function for ``backend`` ("torch", "triton" or None = triton on CUDA if available).

    Raises:
        ValueError: an unknown backend name, or "triton" when it cannot be used.
    """
    if backend not in (None, "torch", "triton"):
        raise ValueError(f"backend: expected 'torch', 'triton' or None, got {backend!r}")
    if backend == "torch" or (backend is None and not x.is_cuda):
        return lora_apply_torch
    fn = _triton_backend()
    if fn is None:
        if backend == "triton":
            raise ValueError("backend='triton': the Triton kernels are not available (is triton installed?)")
        return lora_apply_torch
    return fn


def _extend_plan(plan: LoRAPlan) -> None:
    """Let a GPU backend add its per-step metadata to a new plan (no-op on CPU)."""
    if plan.token_slots.is_cuda:
        try:
            from multilora.kernels import triton_sgmv
        except Exception:
            return
        hook = getattr(triton_sgmv, "extend_plan", None)
        if hook is not None:
            hook(plan)
