"""multilora: batched multi-LoRA inference. ``from multilora import Engine, EngineConfig, SamplingParams``."""

from __future__ import annotations

__all__ = ["Engine", "EngineConfig", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name: str):  # lazy: importing multilora.kernels must not load the engine
    if name in ("Engine", "RequestOutput"):
        from multilora.runtime import engine

        return getattr(engine, name)
    if name == "EngineConfig":
        from multilora.runtime.config import EngineConfig

        return EngineConfig
    if name == "SamplingParams":
        from multilora.runtime.sampling import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'multilora' has no attribute {name!r}")
