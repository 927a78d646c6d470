"""Backend selection: the torch version of an op (CPU, oracle) or its Triton kernels (CUDA), for the LoRA
apply op (``multilora.kernels.lora.resolve_backend``), attention and the fused per-token ops."""

from __future__ import annotations

import functools
import importlib
from types import ModuleType

import torch


@functools.cache
def triton_module(name: str) -> ModuleType | None:
    """``multilora.kernels.<name>`` (a module of Triton kernels), or None when it does not import because
    Triton is missing or has no backend for this platform (an ``ImportError`` of a module outside multilora).
    Any other error while importing it, or an ``ImportError`` of one of our own modules (a stale import), is a
    bug in that module and propagates. Imported once per process."""
    try:
        return importlib.import_module(f"multilora.kernels.{name}")
    except ImportError as e:
        if (e.name or "").startswith("multilora"):
            raise
        return None


def select_triton(backend: str | None, x: torch.Tensor | torch.device, module: str, *, label: str = "backend",
                  unavailable: str = "the Triton kernels are not available") -> ModuleType | None:
    """Which path an op takes for ``backend`` on tensor (or device) ``x``: the Triton module ``module``
    (``triton_module``), or None for the op's torch version. ``backend``: "torch", "triton", or None = Triton
    for CUDA tensors when the module imports, else torch.

    Raises:
        ValueError: an unknown backend name (``"<label>: expected ..."``), or "triton" when the module does not
            import (``"<label>='triton': <unavailable> (is triton installed?)"``).
    """
    if backend not in (None, "torch", "triton"):
        raise ValueError(f"{label}: expected 'torch', 'triton' or None, got {backend!r}")
    cuda = x.is_cuda if isinstance(x, torch.Tensor) else torch.device(x).type == "cuda"
    if backend == "torch" or (backend is None and not cuda):
        return None
    mod = triton_module(module)
    if mod is None and backend == "triton":
        raise ValueError(f"{label}='triton': {unavailable} (is triton installed?)")
    return mod
