"""The adapter cache: which loaded adapters are resident in the GPU pool, with refcounts, pins and LRU.

Tiers: ``host`` (every loaded adapter's validated weights, CPU float32, in a ``LoRAAdapter``) and
``gpu`` (pages in the ``AdapterPool``; on a CPU-only machine the pool lives in host memory and plays
the gpu tier's role). An adapter with running requests (refcount > 0) or pinned by the user is never
evicted; others leave the pool in least-recently-used order when an adapter that is needed does not fit.

Versions: every ``add`` makes a new ``AdapterHandle``. A request holds the handle it was admitted with, so
reloading or unloading a name never changes the weights of a running request: the old handle stays
resident until its last request releases it, then its pages are freed.

Thread safety: every public method takes the cache's lock, so ``load_adapter`` / ``unload_adapter`` /
``pin_adapter`` may be called from another thread while the engine steps.
"""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

from multilora.memory.pool import AdapterPool, PoolFullError
from multilora.runtime.adapters import LoRAAdapter


class UnknownAdapterError(KeyError):
    """A request or call named an adapter that is not loaded."""

    def __str__(self) -> str:  # KeyError quotes its message; show it plainly
        return str(self.args[0]) if self.args else ""


@dataclass(eq=False)
class AdapterHandle:
    """One loaded version of a named adapter."""

    name: str
    adapter: LoRAAdapter
    version: int
    refcount: int = 0
    slot: int | None = None
    retired: bool = False  # unloaded or replaced: no new requests; freed when refcount reaches 0


@dataclass
class CacheStats:
    gpu_hits: int = 0
    gpu_misses: int = 0
    loads_to_gpu: int = 0
    evictions: int = 0
    bytes_to_gpu: int = 0
    extra: dict = field(default_factory=dict)


class AdapterCache:
    """Registry of loaded adapters plus residency in the pool (see module docstring).

    Args:
        pool: the adapter pool that holds resident adapters.
    """

    def __init__(self, pool: AdapterPool) -> None:
        self.pool = pool
        self._lock = threading.RLock()
        self._by_name: dict[str, AdapterHandle] = {}
        self._resident: "OrderedDict[int, AdapterHandle]" = OrderedDict()  # id(handle) -> handle, LRU first
        self._pinned: set[str] = set()
        self._versions = itertools.count(1)
        self.stats = CacheStats()

    # ------------------------------------------------------------------ registry
    def add(self, name: str, adapter: LoRAAdapter) -> AdapterHandle:
        """Register ``adapter`` under ``name``, replacing (retiring) any earlier version."""
        with self._lock:
            handle = AdapterHandle(name=name, adapter=adapter, version=next(self._versions))
            old = self._by_name.get(name)
            self._by_name[name] = handle
            if old is not None:
                self._retire(old)
            return handle

    def remove(self, name: str) -> None:
        """Unregister ``name``. Running requests keep their version until they finish.

        Raises:
            UnknownAdapterError: no adapter of that name is loaded.
        """
        with self._lock:
            handle = self.get(name)
            del self._by_name[name]
            self._pinned.discard(name)
            self._retire(handle)

    def _retire(self, handle: AdapterHandle) -> None:
        handle.retired = True
        if handle.refcount == 0:
            self._drop_from_pool(handle)

    def get(self, name: str) -> AdapterHandle:
        with self._lock:
            try:
                return self._by_name[name]
            except KeyError:
                known = ", ".join(sorted(self._by_name)) or "none"
                raise UnknownAdapterError(f"adapter {name!r} is not loaded (loaded: {known})") from None

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._by_name)

    def pin(self, name: str, pinned: bool = True) -> None:
        """Pin (or unpin) an adapter: a pinned adapter, once resident, is never evicted."""
        with self._lock:
            self.get(name)
            (self._pinned.add if pinned else self._pinned.discard)(name)

    # ------------------------------------------------------------------ residency
    def _drop_from_pool(self, handle: AdapterHandle) -> None:
        if handle.slot is not None:
            self.pool.free(handle.slot)
            self._resident.pop(id(handle), None)
            handle.slot = None

    def _evictable(self) -> list[AdapterHandle]:
        return [
            h for h in self._resident.values()
            if h.refcount == 0 and not (h.name in self._pinned and self._by_name.get(h.name) is h)
        ]

    def acquire(self, handle: AdapterHandle) -> int:
        """Make ``handle`` resident (evicting LRU idle adapters if needed), add a reference, return its slot.

        Raises:
            PoolFullError: it cannot fit even after evicting every idle, unpinned adapter (nothing changes).
            UnknownAdapterError: the handle was retired and is not resident (its name was unloaded).
        """
        with self._lock:
            if handle.slot is not None:
                self.stats.gpu_hits += 1
            else:
                if handle.retired:
                    raise UnknownAdapterError(f"adapter {handle.name!r} was unloaded")
                need = self.pool.pages_needed(handle.adapter)
                victims = self._evictable()
                free_pages = self.pool.pages_free + sum(len(self.pool.pages_of(h.slot)) for h in victims)
                free_slots = self.pool.max_slots - self.pool.slots_used + len(victims)
                if need > free_pages or free_slots < 1 or need > self.pool.num_pages:
                    raise PoolFullError(
                        f"adapter {handle.name!r} needs {need} page(s); {self.pool.pages_free} free and "
                        f"{free_pages - self.pool.pages_free} more held by idle adapters, of {self.pool.num_pages}"
                    )
                for victim in victims:  # LRU order
                    if self.pool.can_fit(handle.adapter):
                        break
                    self._drop_from_pool(victim)
                    self.stats.evictions += 1
                handle.slot = self.pool.load(handle.adapter)
                self._resident[id(handle)] = handle
                self.stats.gpu_misses += 1
                self.stats.loads_to_gpu += 1
                self.stats.bytes_to_gpu += self.pool.pages_needed(handle.adapter) * self.pool.page_bytes
            handle.refcount += 1
            self._resident.move_to_end(id(handle))
            return handle.slot

    def release(self, handle: AdapterHandle) -> None:
        """Drop a reference taken by ``acquire``; a retired version leaves the pool at refcount 0."""
        with self._lock:
            if handle.refcount <= 0:
                raise RuntimeError(f"adapter {handle.name!r}: release without acquire")
            handle.refcount -= 1
            if handle.refcount == 0 and handle.retired:
                self._drop_from_pool(handle)

    def resident(self) -> list[str]:
        with self._lock:
            return [h.name for h in self._resident.values() if not h.retired]
