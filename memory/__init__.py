"""Device memory: the paged adapter weight pool, the KV cache, the unified memory that puts both in one buffer with a
movable boundary (``unified``), the pinned host arena of the host tier (``host_arena``, on the first-fit ``extents``
it shares with the pool), and memory accounting."""

from multilora.memory.pool import AdapterPool, LoRAModuleView, PoolFullError

__all__ = ["AdapterPool", "LoRAModuleView", "PoolFullError"]
