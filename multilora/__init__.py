"""multilora: batched multi-LoRA inference. ``from multilora import Engine, EngineConfig, SamplingParams``.

The errors a caller may catch are here too: ``AdapterError`` (a ValueError: a bad adapter directory),
``UnknownAdapterError`` (a KeyError: a name not loaded), ``EngineOverloadedError`` (the waiting queue is full),
``ModelLoadError`` (a ValueError: a model that cannot be loaded), ``PoolFullError`` (an adapter that cannot be made
resident now), ``EngineDeadError`` (an engine process that has exited)."""

from __future__ import annotations

__all__ = ["AdapterError", "Engine", "EngineConfig", "EngineDeadError", "EngineOverloadedError", "ModelLoadError",
           "PoolFullError", "RequestOutput", "SamplingParams", "UnknownAdapterError"]
__version__ = "0.1.0"

# name -> (module, attribute): imported on first use (importing multilora.kernels must not load the engine)
_LAZY = {
    "Engine": ("multilora.runtime.engine", "Engine"),
    "RequestOutput": ("multilora.runtime.engine", "RequestOutput"),
    "EngineOverloadedError": ("multilora.runtime.engine", "EngineOverloadedError"),
    "EngineConfig": ("multilora.runtime.config", "EngineConfig"),
    "SamplingParams": ("multilora.runtime.sampling", "SamplingParams"),
    "AdapterError": ("multilora.runtime.adapters.spec", "AdapterError"),
    "UnknownAdapterError": ("multilora.runtime.adapter_cache", "UnknownAdapterError"),
    "ModelLoadError": ("multilora.runtime.weights", "ModelLoadError"),
    "PoolFullError": ("multilora.memory.pool", "PoolFullError"),
    "EngineDeadError": ("multilora.runtime.engine_process", "EngineDeadError"),
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'multilora' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
