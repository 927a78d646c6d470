"""Backend selection: the torch version of an op (CPU, oracle) or its Triton kernels (CUDA), for the LoRA
apply op (``multilora.kernels.lora.resolve_backend``), attention and the fused per-token ops."""

from __future__ import annotations

import collections
import functools
import importlib
import logging
import threading
import time
from types import ModuleType

import torch

log = logging.getLogger("multilora")


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


def to_device(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``host`` (a CPU tensor) on ``device``. To CUDA through pinned memory and a non-blocking copy: it queues on the
    current stream and the host goes on at once. A copy from pageable memory waits for the work queued on the stream
    before it (the driver stages it), which would stall a host that prepares step n + 1 while the GPU runs step n
    (the engine's async scheduling). The pinned staging tensor outlives the copy (torch's caching host allocator
    records it on the stream). To the CPU: ``host`` itself."""
    device = torch.device(device)
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


@functools.lru_cache(maxsize=None)
def num_sms(index: int) -> int:
    """Streaming multiprocessors of CUDA device ``index`` (read once per device): what the kernels size their
    split-K and split-key grids by."""
    return torch.cuda.get_device_properties(index).multi_processor_count


_compiles = {"count": 0, "seconds": 0.0}
_compile_names: "collections.deque[str]" = collections.deque(maxlen=64)  # the latest variants, as Triton names them
_compile_lock = threading.Lock()
_compile_start = threading.local()
_hooked: list[bool] = []
_install_lock = threading.Lock()


def count_kernel_compiles() -> bool:
    """Count the Triton kernel variants this process compiles from now on (:func:`kernel_compiles`), through
    Triton's JIT hooks (``triton.knobs.runtime.jit_cache_hook`` before a compile, ``jit_post_compile_hook`` after,
    chained to any hooks already set). Idempotent. Returns False when Triton is missing or has no such hooks."""
    with _install_lock:  # one set of hooks even when engines start on several threads at once
        return _install()


def _install() -> bool:
    if _hooked:
        return _hooked[0]
    try:
        from triton import knobs

        rt = knobs.runtime
        before, after = rt.jit_cache_hook, rt.jit_post_compile_hook
    except (ImportError, AttributeError):
        _hooked.append(False)
        return False

    def on_start(*args, **kwargs):
        _compile_start.t = time.perf_counter()
        return before(*args, **kwargs) if before else None

    def on_done(*args, **kwargs):
        t0 = getattr(_compile_start, "t", None)
        name = _variant_name(kwargs)
        with _compile_lock:
            _compiles["count"] += 1
            _compile_names.append(str(name))
            if t0 is not None:
                _compiles["seconds"] += time.perf_counter() - t0
        log.debug("Triton kernel variant compiled: %s", name)
        _compile_start.t = None
        return after(*args, **kwargs) if after else None

    rt.jit_cache_hook, rt.jit_post_compile_hook = on_start, on_done
    _hooked.append(True)
    return True


def _variant_name(hook_kwargs: dict) -> str:
    """A compiled variant as Triton's post-compile hook describes it: the kernel's name, its options and argument types
    (``repr``), then the constexpr values and the specialisation of the integer arguments (``compile``'s
    ``constants`` and ``configs``: which are 1 or divisible by 16), at most 600 characters."""
    comp = hook_kwargs.get("compile") or {}
    parts = [str(hook_kwargs.get("repr") or getattr(hook_kwargs.get("fn"), "name", None) or "?")]
    for k in ("constants", "configs"):
        if comp.get(k):
            parts.append(f"{k}={comp[k]}")
    return " ".join(parts)[:600]


def kernel_compiles() -> dict[str, float | int | None]:
    """``{"kernel_compiles": n, "kernel_compile_seconds": s}``: Triton kernel variants compiled (or loaded from
    Triton's on-disk cache) in this process since :func:`count_kernel_compiles`, and the wall seconds they took
    (the caller waited that long: a compile inside a serving step stalls every running request). Both None when
    the count is off (no Triton, or no JIT hooks in this version). A kernel compiles once per distinct
    specialisation of its arguments (block sizes, and integer arguments equal to 1 or divisible by 16)."""
    if not (_hooked and _hooked[0]):
        return {"kernel_compiles": None, "kernel_compile_seconds": None}
    with _compile_lock:
        return {"kernel_compiles": _compiles["count"], "kernel_compile_seconds": _compiles["seconds"]}


def recent_kernel_compiles(n: int = 64) -> list[str]:
    """The last ``n`` (at most 64) Triton kernel variants compiled since :func:`count_kernel_compiles`, oldest
    first, as Triton's JIT hook names them (``kernel[num_warps=..., ...](arg: type, ...)``, the argument types
    showing the specialisation); empty when the count is off. What to read when a serving row reports compiles."""
    with _compile_lock:
        return list(_compile_names)[-n:] if n > 0 else []
