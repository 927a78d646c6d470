"""The tiered adapter cache: gpu (pool extents) -> host (packed images, byte budget) -> disk (files).

Tiers
-----
- **gpu**: an exact-size extent in the ``AdapterPool`` (on a CPU-only machine the pool lives in host memory and
  plays this role). The pool is the only owner of device memory for adapter weights. Fit and eviction count
  bytes (``AdapterHandle.pool_bytes``: the adapter's image, what it occupies in the pool) against the pool's free
  bytes: the pool compacts itself when the free bytes suffice but no hole does, so free bytes are usable bytes.
- **host**: each adapter as a ``PackedAdapter`` (its image laid out exactly as in the pool) in a block of the
  host arena (``multilora.memory.host_arena``: chunks of host memory mapped once and, when the pool is on CUDA,
  page-locked with ``cudaHostRegister``, so host -> GPU copies are one asynchronous ``cudaMemcpyAsync`` per
  adapter), bounded by ``host_bytes``, counted as exactly the bytes the copies hold (no power-of-two rounding:
  the arena's unit is one pool page). Room is made by dropping host copies LRU first (retired versions first);
  a chunk whose free bytes suffice but no hole does is compacted (a memcpy, after the copies reading it have
  landed). The one copy just added or read back is never dropped to make room; one that can never fit the arena
  (larger than a chunk or the whole budget) is held outside it, alone, so the budget can be exceeded only while
  that single copy is all the host tier holds.
- **disk**: the adapter's own files. A host copy dropped from the host tier (or never made:
  ``load_adapter(preload=False)``) is read from them on demand, after checking that the two files the
  adapter is read from (``adapter_config.json`` and its weight file; other files of the directory do not
  count) are the ones ``load_adapter`` read: same inode, size, mtime_ns and ctime_ns (``files_fingerprint``),
  before and after the read; if not, the requests that need it fail cleanly, with an error saying which file
  changed and how, instead of running other weights.

Eviction (LRU)
--------------
gpu -> host: when a needed adapter does not fit in the pool's free bytes, idle adapters leave it least recently
used first; an evicted adapter keeps (or regains, by a device -> host copy, if the host budget allows) its
host copy. An adapter is *idle* when no running request uses it (refcount 0) and the user has not pinned
it (``pin``). host -> disk: when the host tier exceeds its budget, host copies leave least recently used
first (copies of retired versions first).

Versions
--------
Every ``add`` makes a new ``AdapterHandle``; a request holds the handle it was submitted with, so
reloading or unloading a name never changes the weights of a request already submitted: it is served
with its version (from the pool, the host copy, or the files while they are unchanged). Retired versions
leave the pool when their last request releases them.

Prefetch and tier moves
-----------------------
``prefetch(handles)`` is called each step with the adapters of waiting requests: disk -> host reads run on
``io_threads`` background I/O threads (``Engine(adapter_io_threads=4)``), each writing straight into an arena block
reserved for it under the lock (``runtime.adapters.image.read_image``: no intermediate copy; with
``Engine(adapter_finish="device")``, the default on CUDA, a *raw* image, which the pool finishes on the GPU after the
copy: ``PackedAdapter.finish``); host -> GPU copies of adapters that fit in free bytes run on a side CUDA stream and
record an event; ``wait_ready`` makes the compute stream wait on those events (not on the device) before a step
reads the slots. A raw image is copied as it is and finished in place by ``wait_ready`` on the compute stream at the
step boundary (``AdapterPool.finish_pending``): the slots the step reads, and every other one whose copy has landed
(a few tens of microseconds each; on a side stream, the finish kernels waited behind the step's GEMMs for free SMs:
bench/README.md, "Session 12"). ``acquire``'s own copy (an adapter not prefetched) also runs on the side stream, and
the current stream waits on it at once. Every host -> GPU copy is timed with two CUDA events; every disk -> host
read with the wall clock: ``report()`` gives the GB/s of each move with the bytes and seconds it comes from. An
arena block is neither moved nor reused while a copy reading it may be in flight (its event is noted; a free is
deferred until it completes). Compaction of the pool is serialised with copies still in flight by the pool itself
(``multilora.memory.pool``, "Asynchronous loads"): it makes the compute stream wait on every pending side-stream
copy before moving anything, and later side-stream copies wait on the moves.

Values checked after the copy
-----------------------------
A raw image's values are checked finite by the pool's finish kernel. ``acquire`` reads that answer
(``AdapterPool.nonfinite``) when the load has landed, and each step's ``wait_ready`` reads those that landed since:
never a host wait (a first version waited in ``acquire`` for loads still in flight and stalled the engine's steps
behind them). A failed check fails the adapter for good (``handle.failed``: ``acquire`` raises an ``AdapterError``
naming the file and tensor), and it leaves the host tier, and the pool once no request uses it. Requests admitted
before the answer was read run on the bad values: their logits turn non-finite and each fails alone (the
postprocessor's guard names the adapter), except rows of ``Engine.logits``, which return those logits as they are. A
passed check marks the handle's values checked (``values_checked``), so later reads of the same file version skip
checks, as after a host-side check. A slot whose check is pending is never copied back to the host tier.

Thread safety: public methods take the cache's lock; ``load_adapter``/``unload_adapter``/``pin_adapter``
may be called from another thread while the engine steps.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from multilora.memory.host_arena import DEFAULT_CHUNK_BYTES, HostArena, HostBlock
from multilora.memory.pool import AdapterPool, PackedAdapter, PoolFullError
from multilora.runtime.adapters import AdapterError
from multilora.runtime.adapters.disk import FileStamp, files_fingerprint

log = logging.getLogger("multilora")


def loaded_names(names: Any, shown: int = 10) -> str:
    """``"loaded: a, b, c"`` for an unknown-adapter message: at most ``shown`` names (sorted), then how many more
    (an engine may hold thousands)."""
    names = sorted(names)
    if not names:
        return "loaded: none"
    more = f", ... and {len(names) - shown} more" if len(names) > shown else ""
    return "loaded: " + ", ".join(names[:shown]) + more


class UnknownAdapterError(KeyError):
    """A request or call named an adapter that is not loaded."""

    def __str__(self) -> str:  # KeyError quotes its message; show it plainly
        return str(self.args[0]) if self.args else ""


__all__ = ["AdapterCache", "AdapterHandle", "CacheStats", "UnknownAdapterError", "files_fingerprint"]


@dataclass(eq=False)
class AdapterHandle:
    """One loaded version of a named adapter and where it lives."""

    name: str
    version: int
    path: Path
    allow_pickle: bool
    fingerprint: tuple[FileStamp, ...]  # the files as load_adapter read them (files_fingerprint)
    max_rank: int
    pool_bytes: int  # bytes its image occupies in the pool
    summary: str
    host: PackedAdapter | None = None  # host tier copy (None: on disk only)
    refcount: int = 0  # running requests (and transient users) of this version
    queued: int = 0  # waiting requests of this version
    slot: int | None = None  # gpu tier
    retired: bool = False  # unloaded or replaced: no new requests; freed when its requests are done
    ready_event: object | None = None  # torch.cuda.Event of an asynchronous host -> GPU copy
    loading: Future | None = None  # disk -> host load in flight
    loading_block: HostBlock | None = None  # the arena block that load writes into
    prefetched: bool = False  # made resident by prefetch and not used yet
    prefetched_host: bool = False  # its host copy came from a prefetch read and has not been used yet
    had_host: bool = False  # has had a host copy (False: registered on disk and never read since)
    #: its files' values are known finite (read and checked on the host, or a raw image of them passed the device
    #: check): reloads of these files (stamps unchanged) skip the finite checks
    values_checked: bool = False
    #: a prefetch read of its files failed: not prefetched again until a read succeeds (``acquire`` reads them and
    #: reports the error)
    prefetch_failed: bool = False
    failed: str | None = None  # why it can never be served (a tensor-parallel worker could not read it): acquire raises

    @property
    def tier(self) -> str:
        return "gpu" if self.slot is not None else "host" if self.host is not None else "disk"


@dataclass
class CacheStats:
    """Counters of the adapter cache (see ``AdapterCache``)."""

    gpu_hits: int = 0
    gpu_misses: int = 0
    host_hits: int = 0
    host_misses: int = 0
    gpu_evictions: int = 0
    host_evictions: int = 0
    bytes_host_to_gpu: int = 0
    bytes_gpu_to_host: int = 0
    bytes_disk_to_host: int = 0
    prefetch_gpu: int = 0
    prefetch_host: int = 0
    #: requests whose adapter a finished prefetch had put where it was needed (GPU, or host for its copy up)
    prefetch_hits: int = 0
    #: requests that waited for a prefetch read still in flight (counted as host misses, not prefetch hits)
    prefetch_late: int = 0
    load_failures: int = 0
    host_to_gpu_copies: int = 0
    host_to_gpu_timed_bytes: int = 0  # bytes of the copies whose CUDA events have completed (timed)
    host_to_gpu_seconds: float = 0.0
    disk_to_host_reads: int = 0
    disk_to_host_seconds: float = 0.0  # summed over the reads (each on one thread)
    gpu_to_host_seconds: float = 0.0
    evictions_for_kv: int = 0  # adapters evicted so that a unified memory's KV side could take their units
    preloads: int = 0  # adapters registered with their image read at load (load_adapter(preload=True))
    bytes_preloaded: int = 0  # their images' bytes (read outside the tier moves: not in bytes_disk_to_host)


class BusyClock:
    """The wall time during which at least one of several threads' operations was in flight (the union of their
    intervals) and the bytes those operations delivered: the aggregate speed of concurrent disk -> host reads, where
    their summed per-read seconds give the speed of one reader. Thread-safe (one lock, held for a few attribute
    updates). ``seconds`` leaves out the part of an operation still in flight. ``clock``: the time source
    (``time.perf_counter``; a test passes its own)."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._inflight = 0
        self._since = 0.0
        self.seconds = 0.0
        self.nbytes = 0

    def _tick(self) -> float:  # (under the lock) the time since the last event, if anything was in flight
        now = self._clock()
        if self._inflight:
            self.seconds += now - self._since
        self._since = now
        return now

    def begin(self) -> float:
        """An operation starts; returns the clock's time of it (``time.perf_counter()`` seconds)."""
        with self._lock:
            now = self._tick()
            self._inflight += 1
            return now

    def end(self, nbytes: int = 0) -> float:
        """An operation ends (``nbytes``: what it moved; 0 for one that failed); returns the clock's time of it."""
        with self._lock:
            now = self._tick()
            self._inflight -= 1
            self.nbytes += nbytes
            return now

    def snapshot(self) -> tuple[float, int]:
        """``(seconds, nbytes)`` read together under the lock (a read ending between two attribute reads would
        pair one read's bytes with another moment's seconds)."""
        with self._lock:
            return self.seconds, self.nbytes


class _CopyTimer:
    """Times a host -> GPU copy with two CUDA events on its stream (``AdapterPool.load``'s ``timer``)."""

    def __init__(self) -> None:
        self.begin = torch.cuda.Event(enable_timing=True)
        self.end = torch.cuda.Event(enable_timing=True)

    def start(self, stream) -> None:
        self.begin.record(stream)

    def stop(self, stream) -> None:
        self.end.record(stream)


class AdapterCache:
    """Adapters by name, their tiers, refcounts, pins and LRU order (see the module docstring).

    Args:
        pool: the adapter pool (gpu tier).
        host_bytes: host-tier budget in bytes (None: unbounded): the host arena's (``multilora.memory.host_arena``),
            pinned when the pool is on CUDA.
        reload: ``reload(handle, out) -> PackedAdapter`` reads a handle's files again (disk -> host), writing the
            image into ``out`` (a 1-D CPU tensor of the pool dtype and the image's size: an arena block) when it
            is not None.
        chunk_bytes: bytes of one chunk of the host arena (default ``DEFAULT_CHUNK_BYTES``, at least one image of
            the pool's largest adapter).
        io_threads: threads reading adapters from disk for ``prefetch`` (default 4).
        map_ahead_on_overflow: bytes of the host arena to map ahead (``HostArena.map_ahead``, on the background
            thread) once the registered adapters' pool bytes first exceed the pool's: from then on the host tier
            fills, and no adapter's copy into it should wait for a chunk to be mapped. 0 (default): never.
    """

    def __init__(self, pool: AdapterPool, *, host_bytes: int | None,
                 reload: Callable[..., PackedAdapter], chunk_bytes: int | None = None, io_threads: int = 4,
                 map_ahead_on_overflow: int = 0):
        self.pool = pool
        self.host_budget = host_bytes
        self._reload = reload
        self._lock = threading.RLock()
        self._by_name: dict[str, AdapterHandle] = {}
        self._gpu_lru: "OrderedDict[int, AdapterHandle]" = OrderedDict()  # id -> handle, least recent first
        self._host_lru: "OrderedDict[int, AdapterHandle]" = OrderedDict()
        self._pinned: set[str] = set()
        self._versions = itertools.count(1)
        self._cuda = pool.device.type == "cuda"
        self._stream = torch.cuda.Stream(device=pool.device) if self._cuda else None
        self._unchecked: dict[int, AdapterHandle] = {}  # resident handles whose device check has not been read
        if not isinstance(io_threads, int) or isinstance(io_threads, bool) or io_threads < 1:
            raise ValueError(f"AdapterCache: io_threads must be an int >= 1, got {io_threads!r}")
        self.io_threads = io_threads
        self._io = ThreadPoolExecutor(max_workers=io_threads, thread_name_prefix="multilora-adapter-io")
        largest = pool.max_adapter_pages * pool.page_bytes
        self.arena = HostArena(host_bytes, pinned=self._cuda, unit=pool.page_bytes,
                               chunk_bytes=max(chunk_bytes or DEFAULT_CHUNK_BYTES, largest), granule=largest)
        self._timing: list[tuple[_CopyTimer, int]] = []  # host -> GPU copies not timed yet
        self._orphans: list[AdapterHandle] = []  # forgotten while a disk -> host read was writing their block
        self.stats = CacheStats()
        self.disk_busy = BusyClock()  # the disk -> host reads' union of in-flight time (aggregate GB/s)
        ahead = map_ahead_on_overflow
        if not isinstance(ahead, int) or isinstance(ahead, bool) or ahead < 0:
            raise ValueError(f"AdapterCache: map_ahead_on_overflow must be an int >= 0, got {ahead!r}")
        self.map_ahead_on_overflow = ahead
        self._registered_bytes = 0  # pool bytes of the registered (not retired) versions
        self._host_total = 0  # ``host_bytes``: the footprints of the handles' host copies
        #: when the registered adapters first outgrew the pool and the arena was mapped ahead (None: not yet)
        self.mapped_ahead_at_adapters: int | None = None
        #: a unified memory (``multilora.memory.unified``) whose pool is ``pool``: the pool grows into free KV
        #: blocks before idle adapters are evicted, and ``yield_to_kv`` gives units back; None: a fixed pool
        self.unified: Any = None
        #: with ``unified``: KV blocks the pool must leave free (the scheduler's ``kv_reserve_blocks``)
        self.kv_reserve: Callable[[], int] = lambda: 0

    # ------------------------------------------------------------------ registry
    def add(self, name: str, packed: PackedAdapter | None, *, path: Path, allow_pickle: bool, summary: str,
            max_rank: int | None = None, pool_bytes: int | None = None,
            fingerprint: tuple[FileStamp, ...] | None = None) -> AdapterHandle:
        """Register an adapter under ``name``, retiring any earlier version: packed (host tier: the image is
        copied into the host arena), or with ``packed=None`` on the disk tier only (``max_rank`` and ``pool_bytes``
        then given; read on first use). ``fingerprint``: the files' stamps as they were read
        (``LoRAAdapter.files``); default ``files_fingerprint(path)`` now."""
        if packed is None and (max_rank is None or pool_bytes is None):
            raise ValueError("AdapterCache.add: an adapter registered on disk (packed=None) needs max_rank and pool_bytes")
        with self._lock:
            handle = AdapterHandle(
                name=name, version=next(self._versions), path=Path(path), allow_pickle=allow_pickle,
                fingerprint=tuple(fingerprint) if fingerprint else files_fingerprint(Path(path)),
                max_rank=packed.max_rank if packed is not None else max_rank,
                pool_bytes=packed.nbytes if packed is not None else pool_bytes,
                summary=summary,
            )
            old = self._by_name.get(name)
            self._by_name[name] = handle
            self._registered_bytes += handle.pool_bytes - (old.pool_bytes if old is not None else 0)
            if old is not None:
                self._retire(old)
            if (self.map_ahead_on_overflow and self.mapped_ahead_at_adapters is None
                    and self._registered_bytes > self.pool.bytes_total):
                self.mapped_ahead_at_adapters = len(self._by_name)
                self.arena.map_ahead(self.map_ahead_on_overflow)
            if packed is not None:
                self.stats.preloads += 1
                self.stats.bytes_preloaded += packed.nbytes
                self._set_host(handle, self._into_arena(packed, keep=handle))
                self._enforce_host_budget(keep=handle)
            return handle

    def remove(self, name: str) -> None:
        """Unregister ``name``; requests already submitted for it are still served with their version.

        Raises:
            UnknownAdapterError: no adapter of that name is loaded.
        """
        with self._lock:
            handle = self.get(name)
            del self._by_name[name]
            self._registered_bytes -= handle.pool_bytes
            self._pinned.discard(name)
            self._retire(handle)

    def _retire(self, handle: AdapterHandle) -> None:
        handle.retired = True
        self._forget_if_done(handle)

    def _forget_if_done(self, handle: AdapterHandle) -> None:
        """A retired version leaves every tier once no request runs or waits with it."""
        if not handle.retired or handle.refcount > 0:
            return
        self._drop_from_pool(handle)
        if handle.queued == 0:
            self._drop_host(handle)
            if handle.loading is not None:  # its read still writes into its block: freed once it is done
                self._orphans.append(handle)

    def enqueue(self, handle: AdapterHandle) -> None:
        """A request holding ``handle`` starts waiting (keeps a retired version's host copy)."""
        with self._lock:
            handle.queued += 1

    def dequeue(self, handle: AdapterHandle) -> None:
        """A request holding ``handle`` stops waiting (admitted or failed)."""
        with self._lock:
            handle.queued -= 1
            self._forget_if_done(handle)

    def get(self, name: str) -> AdapterHandle:
        with self._lock:
            try:
                return self._by_name[name]
            except KeyError:
                raise UnknownAdapterError(f"adapter {name!r} is not loaded ({loaded_names(self._by_name)})") from None

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._by_name)

    def pin(self, name: str, pinned: bool = True) -> None:
        """Pin an adapter: make it resident now and never evict it while pinned. ``pinned=False`` unpins.

        Raises:
            UnknownAdapterError: not loaded. PoolFullError: it cannot be made resident (nothing changes).
        """
        with self._lock:
            handle = self.get(name)
            if not pinned:
                self._pinned.discard(name)
                return
            self.acquire(handle)
            self._pinned.add(name)
            self.release(handle)

    def is_pinned(self, handle: AdapterHandle) -> bool:
        return handle.name in self._pinned and self._by_name.get(handle.name) is handle

    # ------------------------------------------------------------------ host tier
    @property
    def host_bytes(self) -> int:
        """Host bytes the host tier's copies hold: their arena blocks' bytes (exact), plus any copy outside the
        arena (one larger than a chunk or the budget) at its own size."""
        return self._host_total  # (kept by _set_host / _drop_host: summing 2,000 copies at each miss took ~0.5 ms)

    def _set_host(self, handle: AdapterHandle, packed: PackedAdapter) -> None:
        if handle.host is not None:
            self._host_total -= handle.host.footprint
        self._host_total += packed.footprint
        handle.host = packed
        handle.had_host = True
        handle.prefetch_failed = False  # a read succeeded: prefetch it again when it leaves the host tier
        handle.values_checked = handle.values_checked or packed.checked
        self._host_lru[id(handle)] = handle
        self._host_lru.move_to_end(id(handle))

    def _drop_host(self, handle: AdapterHandle) -> None:
        handle.prefetched_host = False
        packed, handle.host = handle.host, None
        if packed is not None:
            self._host_total -= packed.footprint
        self._host_lru.pop(id(handle), None)
        if packed is not None and packed.block is not None:
            self.arena.free(packed.block)  # deferred while a host -> GPU copy may still read it
            packed.block = None

    def _enforce_host_budget(self, keep: AdapterHandle | None = None) -> None:
        if self.host_budget is None:
            return
        over = self.host_bytes - self.host_budget
        if over <= 0:
            return
        for h in self._host_victims(keep):
            if over <= 0:
                break
            over -= h.host.footprint
            self._drop_host(h)
            self.stats.host_evictions += 1

    def _host_victims(self, keep: AdapterHandle | None) -> list[AdapterHandle]:
        """Host copies in the order they leave: retired versions first, then least recently used."""
        order = [h for h in self._host_lru.values() if h.retired] + [h for h in self._host_lru.values() if not h.retired]
        return [h for h in order if h is not keep and h.host is not None]

    def _host_block(self, nbytes: int, keep: AdapterHandle | None, *, fixed: bool = False,
                    spare: set[int] | None = None) -> HostBlock | None:
        """An arena block of ``nbytes``, dropping host copies (``_host_victims`` order, never ``keep``'s nor those
        of handles whose ids are in ``spare``) until one fits; None if the image can never fit the arena (larger
        than a chunk or the budget) or nothing left to drop makes room."""
        if not self.arena.could_ever_fit(nbytes):
            return None
        block = self.arena.alloc(nbytes, fixed=fixed)
        victims = iter([v for v in self._host_victims(keep) if spare is None or id(v) not in spare])
        while block is None:
            victim = next(victims, None)
            if victim is None:
                self.arena.settle()  # freed blocks still read by in-flight copies: wait for those copies
                block = self.arena.alloc(nbytes, fixed=fixed)
                break
            self._drop_host(victim)
            self.stats.host_evictions += 1
            block = self.arena.alloc(nbytes, fixed=fixed)
        if block is not None:
            self.arena.grow_ahead()  # the next chunk mapped off this thread while the tier fills
        return block

    def _adopt(self, packed: PackedAdapter, block: HostBlock) -> PackedAdapter:
        """``packed`` as the owner of ``block`` (its ``data`` a view of it, re-pointed after a compaction)."""
        dtype = self.pool.dtype
        packed.block = block

        def moved(b: HostBlock, p: PackedAdapter = packed) -> None:
            p.data = b.view(dtype)

        block.on_move = moved
        return packed

    def _into_arena(self, packed: PackedAdapter, keep: AdapterHandle | None) -> PackedAdapter:
        """A copy of ``packed`` in the host arena (one memcpy), or ``packed`` itself if no block can be had."""
        block = self._host_block(packed.nbytes, keep)
        if block is None:
            return packed
        block.view(self.pool.dtype).copy_(packed.data)
        return self._adopt(PackedAdapter(data=block.view(self.pool.dtype), ranks=packed.ranks,
                                         scalings=packed.scalings, offsets=packed.offsets, max_rank=packed.max_rank,
                                         name=packed.name, finish=packed.finish, checked=packed.checked), block)

    def _ensure_host(self, handle: AdapterHandle) -> PackedAdapter:
        """The handle's host copy, reading its files again (disk -> host) if it was dropped."""
        if handle.host is not None:
            self.stats.host_hits += 1
            if handle.prefetched_host:
                self.stats.prefetch_hits += 1
                handle.prefetched_host = False
            self._host_lru.move_to_end(id(handle))
            return handle.host
        if handle.loading is not None:  # a prefetch is reading it: wait for that instead of reading twice
            waited = not handle.loading.done()  # (a read that landed before this call is collected here: in time)
            try:
                handle.loading.result()  # the I/O thread takes no lock, so waiting under ours is safe
            except Exception:
                pass  # read again below, reporting the error on this path
            if self._collect(handle):
                if waited:  # late: the request waited for the disk
                    self.stats.prefetch_late += 1
                    self.stats.host_misses += 1
                else:
                    self.stats.prefetch_hits += 1
                    self.stats.host_hits += 1
                handle.prefetched_host = False
                return handle.host
        self.stats.host_misses += 1
        block = self._host_block(handle.pool_bytes, keep=handle, fixed=True)
        try:
            packed, seconds = self._read_files(handle, block)
        except Exception:
            self.stats.load_failures += 1
            if block is not None:
                self.arena.free(block)
            raise
        self._count_read(packed, seconds)
        self._set_host(handle, self._settled(packed, block))
        self._enforce_host_budget(keep=handle)
        return packed

    def _settled(self, packed: PackedAdapter, block: HostBlock | None) -> PackedAdapter:
        """A finished read's image: its block, written, may move from now on."""
        if block is None:
            return packed
        self.arena.release_fixed(block)
        return self._adopt(packed, block)

    def _count_read(self, packed: PackedAdapter, seconds: float) -> None:
        self.stats.bytes_disk_to_host += packed.nbytes
        self.stats.disk_to_host_reads += 1
        self.stats.disk_to_host_seconds += seconds

    def _collect(self, handle: AdapterHandle) -> bool:
        """Take a finished prefetch read into the host tier; True if the handle now has a host copy."""
        fut = handle.loading
        if fut is None or not fut.done():
            return handle.host is not None
        handle.loading, block, handle.loading_block = None, handle.loading_block, None
        try:
            packed, seconds = fut.result()
        except Exception:
            if block is not None:
                self.arena.free(block)
            handle.prefetch_failed = True  # (logged once by _prefetch_read; not read again every step)
            return handle.host is not None
        if handle.host is None:
            self._set_host(handle, self._settled(packed, block))
            handle.prefetched_host = True
            self.stats.prefetch_host += 1
            self._count_read(packed, seconds)
            self._enforce_host_budget(keep=handle)
        elif block is not None:
            self.arena.free(block)
        return True

    def _reap_orphans(self) -> None:
        """Free the blocks of finished reads of handles forgotten while they were being read."""
        left = []
        for h in self._orphans:
            if h.loading is not None and not h.loading.done():
                left.append(h)
                continue
            h.loading = None
            if h.loading_block is not None:
                self.arena.free(h.loading_block)
                h.loading_block = None
        self._orphans = left

    def _read_files(self, handle: AdapterHandle, block: HostBlock | None) -> tuple[PackedAdapter, float]:
        """disk -> host into ``block`` (or a fresh tensor), if the files are still those ``load_adapter`` read,
        before and after the read (a file replaced and put back in between gets a new ctime): ``(image, seconds
        the read took)``. No lock taken: runs on the I/O thread too.

        Raises:
            AdapterError: the files changed (see ``_check_files``), or cannot be read; ValueError: the image is
                not of the size registered (its files changed in a way their stamps did not show).
        """
        self._check_files(handle, "since load_adapter")
        t0 = self.disk_busy.begin()
        try:
            packed = self._reload(handle, None if block is None else block.view(self.pool.dtype))
        except BaseException as e:
            self.disk_busy.end(0)
            if isinstance(e, AdapterError) and repr(handle.name) not in str(e):  # the request's adapter, not only
                raise AdapterError(f"adapter {handle.name!r} (version {handle.version}, read from disk): {e}",
                                   path=e.path, key=e.key) from e  # its directory
            raise
        seconds = self.disk_busy.end(packed.nbytes) - t0  # (the clock's own times: its union <= the reads' sum)
        self._check_files(handle, "while it was read again")
        if packed.nbytes != handle.pool_bytes:
            raise AdapterError(f"{handle.path}: adapter {handle.name!r} read again as an image of {packed.nbytes} "
                               f"bytes, registered as {handle.pool_bytes}: load_adapter it again", path=handle.path)
        return packed, seconds

    @staticmethod
    def _check_files(handle: AdapterHandle, when: str) -> None:
        """Raise AdapterError naming the file that changed and how, unless the files match the fingerprint."""
        now = files_fingerprint(handle.path)
        if now == handle.fingerprint:
            return
        how = "; ".join(was.change_to(new) for was, new in zip(handle.fingerprint, now) if was != new)
        why = ("its host copy was evicted" if handle.had_host else
               "it was registered on the disk tier (load_adapter(preload=False)) and not read since")
        raise AdapterError(
            f"{handle.path}: the files of adapter {handle.name!r} (version {handle.version}) changed {when} ({how}); "
            f"it has no host copy to serve instead ({why}): load_adapter it again",
            path=handle.path,
        )

    # ------------------------------------------------------------------ gpu tier
    def _drop_from_pool(self, handle: AdapterHandle) -> None:
        if handle.slot is None:
            return
        if (handle.host is None and not handle.retired and handle.failed is None and self.host_budget is not None
                and not self.pool.needs_check(handle.slot)):  # (never copy back values not checked, or bad)
            # only into free room, of the budget and of the arena: gpu -> host never evicts. Free arena room is not
            # budget room when a copy lives outside the arena (``_into_arena`` keeps one there when no block could be
            # made, e.g. while reads held the blocks), so the budget is checked first (the block's bytes: whole units)
            held = self.arena.held_bytes_for(handle.pool_bytes)
            block = self.arena.alloc(handle.pool_bytes) if self._host_total + held <= self.host_budget else None
            if block is not None:  # gpu -> host: copy the image back
                t0 = time.perf_counter()
                packed = self.pool.unpack(handle.slot, name=handle.name, out=block.view(self.pool.dtype))
                self.stats.gpu_to_host_seconds += time.perf_counter() - t0
                self._set_host(handle, self._adopt(packed, block))
                self.stats.bytes_gpu_to_host += packed.nbytes
        self.pool.free(handle.slot)
        self._gpu_lru.pop(id(handle), None)
        handle.slot = None
        handle.ready_event = None
        handle.prefetched = False

    def _evictable(self) -> list[AdapterHandle]:
        return [h for h in self._gpu_lru.values() if h.refcount == 0 and not self.is_pinned(h)]

    def _fits_after_evicting(self, handle: AdapterHandle, victims: list[AdapterHandle]) -> bool:
        """Whether ``handle`` gets its bytes and a slot once every one of ``victims`` has left the pool."""
        free = self.pool.bytes_free + sum(v.pool_bytes for v in victims)
        slots = self.pool.max_slots - self.pool.slots_used + len(victims)
        return handle.pool_bytes <= free and slots >= 1

    def _evict_until_fits(self, handle: AdapterHandle, victims: list[AdapterHandle]) -> None:
        """Evict ``victims`` in order (least recently used first) until ``handle`` fits."""
        for victim in victims:
            if self.pool.bytes_free >= handle.pool_bytes and self.pool.slots_used < self.pool.max_slots:
                break
            self._drop_from_pool(victim)
            self.stats.gpu_evictions += 1

    def can_prefetch_to_host(self, handle: AdapterHandle) -> bool:
        """Whether ``prefetch`` can ever read ``handle``'s files into the host tier: False when its image is larger
        than the tier's whole budget (``acquire`` then reads it on demand: there is no read to wait for)."""
        return self.host_budget is None or handle.pool_bytes <= self.host_budget

    def reading(self, handle: AdapterHandle) -> bool:
        """Whether a prefetch read of ``handle``'s files (disk -> host) is still in flight, so that ``acquire`` now
        would wait for it on the calling thread (the scheduler's: every running request would wait too)."""
        fut = handle.loading
        return fut is not None and not fut.done()

    def pinned(self, exclude: AdapterHandle | None = None) -> tuple[int, int]:
        """(count, pool bytes) of the resident pinned adapters, ``exclude`` aside."""
        with self._lock:
            held = [h for h in self._gpu_lru.values() if h is not exclude and self.is_pinned(h)]
            return len(held), sum(h.pool_bytes for h in held)

    def could_ever_fit(self, handle: AdapterHandle) -> bool:
        """Whether the handle fits (its bytes and a slot) once every unpinned adapter has left the pool (a unified
        memory's pool at its largest, ``bytes_capacity``)."""
        with self._lock:
            if handle.slot is not None:
                return True
            n_pinned, pinned_bytes = self.pinned(exclude=handle)
            return handle.pool_bytes <= self.pool.bytes_capacity - pinned_bytes and n_pinned < self.pool.max_slots

    # ------------------------------------------------------------------ unified memory
    def _grow_for(self, nbytes: int) -> None:
        """With a unified memory: grow the pool over free KV blocks until ``nbytes`` are free in it, leaving the
        scheduler's reserve (``kv_reserve``) of KV blocks free; no data moves."""
        u = self.unified
        short = nbytes - self.pool.bytes_free
        if u is None or short <= 0:
            return
        spare = u.kv.num_free_blocks - self.kv_reserve()
        if spare > 0:
            u.grow_pool(min(-(-short // u.unit_bytes), spare))

    def yield_to_kv(self, blocks: int) -> int:
        """With a unified memory: give up to ``blocks`` units of the pool to the KV side (the scheduler's
        ``kv_reclaim``), evicting idle adapters (refcount 0, unpinned) least recently used first until enough pool
        pages are free, never below the pool's minimum; the pool compacts if its free pages are not at its top.
        Adapters no waiting request names leave first (LRU among them), then those queued requests wait for.
        Returns the KV blocks gained (0 without a unified memory)."""
        u = self.unified
        if u is None or blocks <= 0:
            return 0
        with self._lock:
            units = min(blocks, u.pool_units - u.layout.min_pool_units)
            want = units * u.layout.pages_per_unit
            for victim in sorted(self._evictable(), key=lambda h: h.queued > 0):  # stable: LRU within each group
                if self.pool.pages_free >= want:
                    break
                self._drop_from_pool(victim)
                self.stats.gpu_evictions += 1
                self.stats.evictions_for_kv += 1
            return u.shrink_pool(units)

    def _to_gpu(self, handle: AdapterHandle, packed: PackedAdapter) -> int:
        """host -> GPU: the image into the pool in one copy; its slot. On CUDA the copy runs on the side stream,
        timed with CUDA events, and ``handle.ready_event`` completes after it; the arena block is noted as read
        by it (never moved nor reused before it completes). On the CPU it is a timed synchronous copy."""
        if self._stream is None:
            t0 = time.perf_counter()
            slot = self.pool.load(packed)
            self.stats.host_to_gpu_seconds += time.perf_counter() - t0
            self.stats.host_to_gpu_timed_bytes += packed.nbytes
        else:
            timer = _CopyTimer()
            slot = self.pool.load(packed, stream=self._stream, timer=timer, defer_finish=True)
            handle.ready_event = timer.end
            if packed.block is not None:
                self.arena.note_read(packed.block, timer.end)
            self._timing.append((timer, packed.nbytes))
        self.stats.host_to_gpu_copies += 1
        self.stats.bytes_host_to_gpu += packed.nbytes
        return slot

    def _check_values(self, handle: AdapterHandle, *, raise_error: bool = True) -> None:
        """Read the device check of a slot loaded from a raw image (``AdapterPool.nonfinite``) if its load has
        landed; if not, note the handle and read it at a later step (``_poll_checks``): no host wait. A non-finite
        value fails the adapter for good (``handle.failed``: the message names its weight file and tensor); it
        leaves the host tier, and the pool unless requests use it (they run on; their logits turn non-finite and
        the postprocessor fails each of them alone).

        Raises:
            AdapterError: (``raise_error``) a value of the adapter's files is NaN or +-inf.
        """
        slot = handle.slot
        if slot is None or not self.pool.needs_check(slot):
            self._unchecked.pop(id(handle), None)
            return
        if not self.pool.check_ready(slot):
            self._unchecked[id(handle)] = handle
            return
        self._unchecked.pop(id(handle), None)
        bad = self.pool.nonfinite(slot)
        if bad is None:
            handle.values_checked = True
            if handle.host is not None:
                handle.host.checked = True
            return
        handle.failed = (f"{handle.path}: adapter {handle.name!r}: tensor {bad!r}: expected finite values, got "
                         f"non-finite (NaN/inf) ones (found by the pool's check after the copy into it)")
        if handle.refcount == 0:
            self._drop_from_pool(handle)
        self._drop_host(handle)
        self.stats.load_failures += 1
        log.warning("%s", handle.failed)
        if raise_error:
            raise AdapterError(handle.failed, path=handle.path, key=bad)

    def _poll_checks(self) -> None:
        """Read the device checks whose loads have landed since (``_check_values``, without raising); the others are
        left for a later step without querying their events one by one (``AdapterPool.checks_answered``)."""
        if not self._unchecked:
            return
        answered = self.pool.checks_answered()
        for h in list(self._unchecked.values()):
            if h.slot is None or not self.pool.needs_check(h.slot) or h.slot in answered:
                self._check_values(h, raise_error=False)

    def _settle_timings(self) -> None:
        """Add the completed host -> GPU copies' event times to the stats (no host sync). The copies complete in the
        order they were queued (one side stream): no query after the first still in flight."""
        for i, (timer, nbytes) in enumerate(self._timing):
            if not timer.end.query():
                self._timing = self._timing[i:]
                return
            self.stats.host_to_gpu_seconds += timer.begin.elapsed_time(timer.end) / 1e3
            self.stats.host_to_gpu_timed_bytes += nbytes
        self._timing = []

    def acquire(self, handle: AdapterHandle) -> int:
        """Make ``handle`` resident (evicting idle adapters LRU first), take a reference, return its slot.

        On CUDA the host -> GPU copy runs on the side stream and the current stream is made to wait for it (no
        host sync): work queued after this call on this thread's stream reads the slot only once the copy has
        landed; ``ready_event`` stays set, so ``wait_ready`` orders a step's stream too (``pin`` from another
        thread).

        Raises:
            PoolFullError: it does not fit even after evicting every idle adapter (nothing changes).
            AdapterError: it has no host copy and its files changed since it was loaded (or cannot be read).
        """
        with self._lock:
            if handle.failed is not None:
                raise AdapterError(handle.failed)
            if handle.slot is not None:
                self._check_values(handle)
                self.stats.gpu_hits += 1
                if handle.prefetched:
                    self.stats.prefetch_hits += 1
                    handle.prefetched = False
            else:
                self._grow_for(handle.pool_bytes)
                victims = self._evictable()
                if not self._fits_after_evicting(handle, victims):
                    n_pinned, _ = self.pinned(exclude=handle)
                    busy = self.pool.slots_used - len(victims) - n_pinned
                    raise PoolFullError(
                        f"adapter {handle.name!r} needs {handle.pool_bytes} bytes of the adapter pool and a slot; "
                        f"{self.pool.bytes_free} bytes free and {sum(v.pool_bytes for v in victims)} held by idle "
                        f"adapters, of {self.pool.bytes_total}; {self.pool.max_slots - self.pool.slots_used} of "
                        f"{self.pool.max_slots} slot(s) free, {len(victims)} held by idle adapters, {busy} by "
                        f"adapters in use and {n_pinned} by pinned ones"
                        + (" (pin_adapter(name, False) unpins one)" if n_pinned else "")
                    )
                packed = self._ensure_host(handle)
                self.stats.gpu_misses += 1
                self._evict_until_fits(handle, victims)
                handle.slot = self._to_gpu(handle, packed)
                if handle.ready_event is not None:  # kept too: a step's wait_ready waits on it from its own thread
                    torch.cuda.current_stream(self.pool.device).wait_event(handle.ready_event)
                self._gpu_lru[id(handle)] = handle
                self._check_values(handle)
                self._enforce_host_budget()
            handle.refcount += 1
            self._gpu_lru.move_to_end(id(handle))
            return handle.slot

    def release(self, handle: AdapterHandle) -> None:
        """Drop a reference taken by ``acquire``; a retired version leaves the pool at refcount 0."""
        with self._lock:
            if handle.refcount <= 0:
                raise RuntimeError(f"adapter {handle.name!r}: release without acquire")
            handle.refcount -= 1
            if handle.failed is not None and handle.refcount == 0:  # (its values failed the device check)
                self._drop_from_pool(handle)
            self._forget_if_done(handle)

    # ------------------------------------------------------------------ prefetch
    def prefetch(self, handles: list[AdapterHandle], wanted: set[int] | None = None) -> None:
        """Start moving the adapters of waiting requests up a tier.

        disk -> host on the I/O threads, each read writing straight into an arena block reserved here (host
        copies leave LRU first to make room); host -> GPU on the side stream (CUDA) or directly (CPU), into free
        bytes or bytes of idle adapters that no waiting request wants (``wanted``: ids of the handles of all
        waiting requests), least recently used first.
        """
        wanted = wanted if wanted is not None else {id(h) for h in handles}
        with self._lock:
            self._reap_orphans()
            self._settle_timings()
            for h in handles:
                if h.slot is not None or h.retired or h.failed is not None or h.prefetch_failed:
                    continue
                self._collect(h)
                if h.host is None:
                    # (a host tier smaller than the image: the copy would push out every other one, the prefetched
                    # images of waiting requests too; acquire reads it on demand)
                    if h.loading is None and not h.prefetch_failed and self.can_prefetch_to_host(h):
                        block = self._host_block(h.pool_bytes, keep=h, fixed=True, spare=wanted)
                        if block is None and self.arena.could_ever_fit(h.pool_bytes):
                            continue  # no room on the host now: read on demand
                        h.loading_block = block
                        h.loading = self._io.submit(self._prefetch_read, h, block)
                    continue
                self._grow_for(h.pool_bytes)
                spare = [v for v in self._evictable() if id(v) not in wanted]
                if not self._fits_after_evicting(h, spare):
                    continue
                self._evict_until_fits(h, spare)
                h.slot = self._to_gpu(h, h.host)
                h.prefetched, h.prefetched_host = True, False  # (the hit, if any, is counted on the GPU)
                self._gpu_lru[id(h)] = h
                self._gpu_lru.move_to_end(id(h), last=False)  # not used yet: first to leave if room is needed
                self.stats.prefetch_gpu += 1
                self._host_lru.move_to_end(id(h))

    def _prefetch_read(self, handle: AdapterHandle, block: HostBlock | None) -> tuple[PackedAdapter, float]:
        try:
            return self._read_files(handle, block)
        except Exception as e:  # reported when a step needs it (acquire reads again and raises)
            log.warning("prefetch of adapter %r failed: %s", handle.name, e)
            raise

    def wait_ready(self, handles: list[AdapterHandle]) -> None:
        """Make the current CUDA stream wait for pending prefetch copies of these handles (no host sync), then queue
        on it the in-place finish of raw images: these handles' and every other whose copy has landed
        (``AdapterPool.finish_pending``); read the device checks that have completed (``_poll_checks``: every step,
        with prefetch on or off)."""
        with self._lock:
            self._poll_checks()
            for h in handles:
                ev = h.ready_event
                if ev is not None:
                    torch.cuda.current_stream(self.pool.device).wait_event(ev)
                    h.ready_event = None
            self.pool.finish_pending([h.slot for h in handles if h.slot is not None])

    # ------------------------------------------------------------------ introspection
    def resident(self) -> list[str]:
        with self._lock:
            return [h.name for h in self._gpu_lru.values() if not h.retired]

    def handles(self) -> list[AdapterHandle]:
        """Live handles: registered ones plus retired ones still resident or held on the host."""
        with self._lock:
            seen = {id(h): h for h in self._by_name.values()}
            seen.update({id(h): h for h in self._gpu_lru.values()})
            seen.update({id(h): h for h in self._host_lru.values()})
            return list(seen.values())

    def report(self) -> dict:
        """The cache's part of ``Engine.stats()``: adapters per tier, pool pages (``PAGE_ELEMS`` elements each, the
        pool's allocation unit) and bytes, compactions and the bytes they moved (and ``pool_max_rank_adapters``, how
        many adapters of the pool's max rank on every module it holds at once; ``pool_max_slots``, its slots), host-tier
        bytes, hits and misses per tier, evictions,
        bytes moved per tier, prefetches and load failures (key names are a contract); ``adapter_preloads`` and
        ``bytes_preloaded``: the images read by ``load_adapter(preload=True)``, at load, apart from the tier moves.

        The tier moves' speeds, each with the bytes and seconds it comes from (GB = 1e9 bytes; None before any):
        ``host_to_gpu_gbps`` = ``host_to_gpu_timed_bytes`` / ``host_to_gpu_seconds``, the copies' own time on the
        GPU between two CUDA events on the side stream (on a CPU pool, the copies' wall time), of the copies
        completed so far (``host_to_gpu_copies`` counts all, one copy per adapter); ``disk_to_host_gbps`` =
        ``bytes_disk_to_host`` / ``disk_to_host_seconds``, the reads' wall time summed over the I/O threads (the
        speed of one reader; ``disk_to_host_reads`` reads), and ``disk_to_host_aggregate_gbps`` =
        ``disk_to_host_busy_bytes`` / ``disk_to_host_busy_seconds``, the bytes every read delivered over the wall
        time during which at least one read was in flight (``BusyClock``: the speed of all readers together, the
        figure to hold against a plain sequential read of the disk). The busy bytes count what the disk delivered:
        also prefetch reads later dropped (the adapter got a host copy another way, or was forgotten) and reads
        whose after-read check then failed, so under prefetch they may exceed ``bytes_disk_to_host`` (the reads
        taken into the host tier); ``gpu_to_host_gbps`` = ``bytes_gpu_to_host`` /
        ``gpu_to_host_seconds`` (synchronous copies back). The host arena: ``host_arena_bytes_held`` (mapped and,
        with ``host_arena_pinned``, page-locked), ``host_arena_bytes_used`` (blocks, including freed ones an
        in-flight copy still reads), ``host_arena_chunks``, ``host_arena_compactions`` and the bytes they moved,
        ``host_arena_map_seconds`` (mapping and registering the chunks, on any thread; ``host_arena_pin_seconds``
        of it in ``cudaHostRegister`` alone, which holds up other threads' CUDA calls), ``host_arena_sync_grows``
        and ``host_arena_sync_map_seconds`` (chunks mapped on the thread that needed the room, and their time) and
        ``host_arena_grown_ahead`` (chunks mapped ahead on a background thread: ``HostArena.grow_ahead``);
        ``host_arena_map_ahead_on_overflow`` (the constructor's ``map_ahead_on_overflow``) and
        ``host_arena_mapped_ahead_at_adapters`` (how many adapters were registered when they first outgrew the pool
        and that many bytes began to be mapped ahead; None: not yet or never)."""
        s, pool = self.stats, self.pool
        with self._lock:
            self._settle_timings()
        tiers = {"gpu": 0, "host": 0, "disk": 0}
        for h in self.handles():
            if not h.retired:
                tiers[h.tier] += 1

        def gbps(nbytes: int, seconds: float) -> float | None:
            return nbytes / seconds / 1e9 if seconds > 0 else None

        a = self.arena
        busy_s, busy_b = self.disk_busy.snapshot()
        mapped_s, pinned_s = a.seconds()
        return {
            "adapters_loaded": len(self.names()), "adapters_resident": self.resident(), "adapters_per_tier": tiers,
            "pool_pages_total": pool.num_pages, "pool_pages_used": pool.pages_used, "pool_page_bytes": pool.page_bytes,
            "pool_bytes_total": pool.bytes_total, "pool_bytes_used": pool.bytes_used,
            "pool_compactions": pool.compactions, "pool_bytes_compacted": pool.bytes_moved,
            "pool_max_rank_adapters": min(pool.max_slots, pool.num_pages // pool.max_adapter_pages),
            "pool_max_slots": pool.max_slots,
            "host_tier_bytes": self.host_bytes, "host_tier_budget": self.host_budget, "gpu_hits": s.gpu_hits,
            "gpu_misses": s.gpu_misses, "host_hits": s.host_hits, "host_misses": s.host_misses,
            "gpu_evictions": s.gpu_evictions, "host_evictions": s.host_evictions,
            "bytes_host_to_gpu": s.bytes_host_to_gpu, "bytes_gpu_to_host": s.bytes_gpu_to_host,
            "bytes_disk_to_host": s.bytes_disk_to_host, "prefetch_to_gpu": s.prefetch_gpu,
            "prefetch_to_host": s.prefetch_host, "prefetch_hits": s.prefetch_hits, "prefetch_late": s.prefetch_late,
            "adapter_load_failures": s.load_failures, "adapter_preloads": s.preloads,
            "bytes_preloaded": s.bytes_preloaded,
            "host_to_gpu_copies": s.host_to_gpu_copies, "host_to_gpu_timed_bytes": s.host_to_gpu_timed_bytes,
            "host_to_gpu_seconds": s.host_to_gpu_seconds,
            "host_to_gpu_gbps": gbps(s.host_to_gpu_timed_bytes, s.host_to_gpu_seconds),
            "disk_to_host_reads": s.disk_to_host_reads, "disk_to_host_seconds": s.disk_to_host_seconds,
            "disk_to_host_gbps": gbps(s.bytes_disk_to_host, s.disk_to_host_seconds),
            "disk_to_host_busy_seconds": busy_s, "disk_to_host_busy_bytes": busy_b,
            "disk_to_host_aggregate_gbps": gbps(busy_b, busy_s),
            "gpu_to_host_seconds": s.gpu_to_host_seconds,
            "gpu_to_host_gbps": gbps(s.bytes_gpu_to_host, s.gpu_to_host_seconds),
            "host_arena_bytes_held": a.bytes_held, "host_arena_bytes_used": a.bytes_used,
            "host_arena_pinned": a.pinned, "host_arena_chunks": a.num_chunks,
            "host_arena_compactions": a.compactions, "host_arena_bytes_compacted": a.bytes_compacted,
            "host_arena_map_seconds": mapped_s, "host_arena_pin_seconds": pinned_s,
            "host_arena_sync_map_seconds": a.sync_register_seconds,
            "host_arena_sync_grows": a.sync_grows,
            "host_arena_grown_ahead": a.grown_ahead, "host_arena_map_ahead_on_overflow": self.map_ahead_on_overflow,
            "host_arena_mapped_ahead_at_adapters": self.mapped_ahead_at_adapters,
            "pool_bytes_capacity": pool.bytes_capacity, "evictions_for_kv": s.evictions_for_kv,
            **(self.unified.report() if self.unified is not None else {}),
        }

    def close(self) -> None:
        self._io.shutdown(wait=True)
        if self._stream is not None:
            self._stream.synchronize()
