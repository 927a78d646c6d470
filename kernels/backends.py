"""Backend selection: the torch version of an op (CPU, oracle) or its Triton kernels (CUDA), for the LoRA
apply op here and, through ``select_triton``, for attention and the fused per-token ops."""

from __future__ import annotations

import functools
import importlib
from types import ModuleType
from typing import Callable

import torch

from multilora.kernels.lora import LoRAPlan, lora_apply_torch


@functools.cache
def triton_module(name: str) -> ModuleType | None:
    """``multilora.kernels.<name>`` (a module of Triton kernels), or None when it does not import (triton
    missing, or no backend for this platform: an ``ImportError``). Any other error while importing it is a
    bug in that module and propagates. Imported once per process."""
    try:
        return importlib.import_module(f"multilora.kernels.{name}")
    except ImportError:
        return None


def select_triton(backend: str | None, x: torch.Tensor, module: str, *, label: str = "backend",
                  unavailable: str = "the Triton kernels are not available") -> ModuleType | None:
    """Which path an op takes for ``backend`` on tensor ``x``: the Triton module ``module`` (``triton_module``),
    or None for the op's torch version. ``backend``: "torch", "triton", or None = Triton for CUDA tensors
    when the module imports, else torch.

    Raises:
        ValueError: an unknown backend name (``"<label>: expected ..."``), or "triton" when the module does not
            import (``"<label>='triton': <unavailable> (is triton installed?)"``).
    """
    if backend not in (None, "torch", "triton"):
        raise ValueError(f"{label}: expected 'torch', 'triton' or None, got {backend!r}")
    if backend == "torch" or (backend is None and not x.is_cuda):
        return None
    mod = triton_module(module)
    if mod is None and backend == "triton":
        raise ValueError(f"{label}='triton': {unavailable} (is triton installed?)")
    return mod


def run_cuda_hook(module: str, hook: str, arg: object, x: torch.Tensor) -> None:
    """Call ``multilora.kernels.<module>.<hook>(arg)`` when ``x`` is on CUDA and the module imports: a GPU
    backend adding its per-step metadata to a new plan (no-op on CPU)."""
    if x.is_cuda:
        fn = getattr(triton_module(module), hook, None)
        if fn is not None:
            fn(arg)


def resolve_backend(backend: str | None, x: torch.Tensor) -> Callable:
    """The apply function for ``backend`` ("torch", "triton" or None = triton on CUDA if available).

    Raises:
        ValueError: an unknown backend name, or "triton" when it cannot be used.
    """
    mod = select_triton(backend, x, "triton_sgmv")
    return lora_apply_torch if mod is None else mod.lora_apply_triton


def _extend_plan(plan: LoRAPlan) -> None:
    """Let a GPU backend add its per-step metadata to a new plan (no-op on CPU)."""
    run_cuda_hook("triton_sgmv", "extend_plan", plan, plan.token_slots)
