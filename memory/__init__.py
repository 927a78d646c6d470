"""Device memory: the paged adapter weight pool, the KV cache, and memory accounting."""

from multilora.memory.pool import AdapterPool, LoRAModuleView, PoolFullError

__all__ = ["AdapterPool", "LoRAModuleView", "PoolFullError"]
