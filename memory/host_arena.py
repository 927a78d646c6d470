"""The pinned host arena: where the host tier's adapter images live, counted as the bytes they really hold.

Why an arena (and not torch's pinned tensors)
---------------------------------------------
``torch.empty(n, pin_memory=True)`` comes from torch's caching host allocator, which rounds every block up to
the next power of two (``PowerOf2Ceil`` in ``aten/src/ATen/core/CachingHostAllocator.h``, torch 2.4-2.13
below ``pinned_max_round_threshold``): an 84 MB Llama-3-8B rank-16 image pinned 128 MiB, the host tier's
budget held 34% fewer copies than its bytes, each new block cost a ``cudaHostAlloc`` under the driver's lock,
and freed blocks stayed cached in torch, outside any budget. Instead the host tier takes its memory in a few
large **chunks** (``chunk_bytes``, default 1 GiB, at least one max-size image; the first ones smaller: 64 MiB,
doubling), each one anonymous mapping
(``mmap``, ``MADV_HUGEPAGE`` where the kernel has it) that is page-locked once with ``cudaHostRegister``
(``torch.cuda.cudart()``) for exactly its size, and places images in them with the same first-fit extents as the
GPU pool (``multilora.memory.extents``), in units of ``unit`` bytes (the engine passes one pool page, so an
image takes exactly its bytes). Registration pins what the arena maps, nothing rounded: ``bytes_used`` is the
bytes of the live images, ``bytes_held`` the bytes mapped and pinned, at most the budget. Chunks are mapped
when first needed (an engine with few adapters pins little) and kept. One registration per chunk rather than
one per image: registering pins (and first touches) every page, about as costly as the allocation itself, so
doing it once per chunk and never again keeps it off the reload path (but each registration holds up other threads'
CUDA calls while it runs: ``DEFAULT_CHUNK_BYTES``). Chunks rather than one arena of the whole
budget: the budget may be tens of GB, and registering it whole would take seconds at start-up and hold all of
it before any adapter is loaded.

On a CPU-only machine (``pinned=False``) the chunks are the same mappings, not registered: the same code path.
If registration fails (the driver refuses), the chunk is kept unpinned, ``pinned`` turns False and a warning is
logged: copies from it are then synchronous, not wrong.

Blocks, moves and in-flight copies
----------------------------------
``alloc(nbytes)`` gives a :class:`HostBlock` (a chunk, a start and a length in units) or None when no chunk can
take it without evicting (the caller evicts and asks again). A block never spans two chunks. When a chunk's
free units suffice but no hole does, ``alloc`` **compacts** that chunk: a memcpy that slides its movable blocks
down (``Extents.compact``), at most one chunk's bytes. A block being written by a reader thread
(``fixed=True`` until ``release_fixed``) never moves. A host -> GPU copy reading a block is noted with its CUDA
event (``note_read``); a block is never moved nor reused while such a copy may still read it: ``free`` of a
block with a pending read defers the release until the event has completed (its bytes still count as used), and
a compaction first waits (host side, ``Event.synchronize``: a copy of a few MB) for the pending reads of the
chunk it moves. After a move the block's ``on_move`` callback re-points its owner's views.

Growing ahead
-------------
Mapping and registering a chunk costs time (registration first-touches and pins every page: on the H200 host the
step thread of a filling host tier spent 4-6% of its samples in it, bench/README.md session 15; ``PREFAULT`` now
touches the pages before the registration, outside the driver's lock). ``grow_ahead``
maps the next chunk on a background thread when the holes left could take fewer than two images of the
granule, so a later ``alloc`` finds room; its units count against the budget while it is mapped, and an ``alloc``
that finds no hole meanwhile waits for it (rather than map another chunk, or be refused for want of budget).
``alloc`` still grows on the caller's thread when it must (``sync_grows`` counts those, ``sync_register_seconds``
their time; ``grown_ahead`` the background ones). ``map_ahead(nbytes)`` has the same thread map whole chunks one
after another up to ``nbytes`` (an engine's ``host_arena_map_ahead_bytes``, from its start), each usable as it lands.

Thread safety: every method takes the arena's lock (a background growth maps outside it, then appends under it).
"""

from __future__ import annotations

import logging
import mmap
import threading
import time
import weakref
from typing import Any, Callable

import torch

from multilora.memory.extents import Extents, move_down

log = logging.getLogger("multilora")

#: Bytes of one chunk of the arena unless the caller asks otherwise (a compaction moves at most this; the engine
#: raises it to one max-rank image). Each chunk is page-locked by one ``cudaHostRegister``, which holds up the step
#: thread's CUDA calls while it runs, so the size trades how long one stall lasts against how many there are and
#: their total. Session 39 set 256 MiB from a run confounded by a bench defect (a smaller pool); session 40's A/B on
#: one H100 at the same rate (S4 at 2,000 adapters, ``bench/results/session40/README.md``): 256 MiB chunks, 20 stalled
#: steps of 66-136 ms, 1.78 s in all, 83.8% within the SLO, TTFT p99 0.82 s; 1 GiB chunks, 6 steps of 202-272 ms,
#: 1.29 s, 90.2%, 0.74 s; and the one-batch bench warm at 46% of the no-adapter tokens/s with 256 MiB chunks (7
#: registrations in the warm phase) where session 39 had 50-51% with 1 GiB. Registration costs less per byte in big
#: chunks (~0.21 ms per MiB at 1 GiB, ~0.33 at 256 MiB), so 1 GiB again.
DEFAULT_CHUNK_BYTES = 1 << 30
#: Write every page of a new chunk (one byte per 4 KiB page, on the thread mapping it, the GIL released) before
#: ``cudaHostRegister`` page-locks it. A fresh anonymous mapping has no pages yet: registering it first faults in
#: (and the kernel zeroes) every page, inside the call, while the driver's lock holds up every other thread's CUDA
#: calls (the step thread's launches: S4's stalled steps, ``DEFAULT_CHUNK_BYTES``). Faulted in first, the pages are
#: only pinned under the lock. Module-level so that benchmarks can A/B it (``bench/_common.py``). NOT YET MEASURED on
#: a GPU (session 41 had no device time left): ``bench_host_register.py`` and ``bench/results/session41/
#: next_call4.sh`` are the A/B; turn it off if they show no gain.
PREFAULT = True
#: The page size ``PREFAULT`` writes at (bytes; the smallest x86-64 / aarch64 base page).
PREFAULT_STRIDE = 4096
#: Bytes of the first chunk (each next one doubles, up to the chunk size).
FIRST_CHUNK_BYTES = 64 << 20


class HostBlock:
    """One image's place in the arena: ``units`` units from unit ``start`` of chunk ``chunk`` (``nbytes`` of them
    asked for). ``bytes()`` / ``view(dtype)`` give tensors at its current place (re-fetch them after a
    compaction, or let ``on_move`` do it)."""

    __slots__ = ("chunk", "start", "units", "nbytes", "reads", "fixed", "on_move", "_arena", "freed")

    def __init__(self, arena: "HostArena", chunk: int, start: int, units: int, nbytes: int, fixed: bool) -> None:
        self._arena = arena
        self.chunk, self.start, self.units, self.nbytes = chunk, start, units, nbytes
        self.reads: list[Any] = []  # CUDA events of copies reading this block, maybe still in flight
        self.fixed = fixed  # being written by a reader thread: never moved
        self.on_move: Callable[["HostBlock"], None] | None = None
        self.freed = False

    @property
    def held_bytes(self) -> int:
        """Bytes of the arena the block takes (``units * unit``)."""
        return self.units * self._arena.unit

    def bytes(self) -> torch.Tensor:
        """The block's first ``nbytes`` bytes, a ``uint8`` view of the arena at its current place."""
        lo = self.start * self._arena.unit
        return self._arena._chunks[self.chunk].buffer[lo : lo + self.nbytes]

    def view(self, dtype: torch.dtype) -> torch.Tensor:
        """The block's bytes as a 1-D tensor of ``dtype`` (``nbytes`` must be a multiple of its size)."""
        return self.bytes().view(dtype)


class _Chunk:
    __slots__ = ("buffer", "space", "blocks", "pinned", "pin_seconds", "_mm", "__weakref__")

    def __init__(self, nbytes: int, units: int, pinned: bool) -> None:
        self._mm, self.buffer = _map(nbytes)
        self.space = Extents(units)
        self.blocks: set[HostBlock] = set()
        self.pinned = False
        self.pin_seconds = 0.0  # the cudaHostRegister call alone (what holds other threads' CUDA calls up)
        if pinned:
            if PREFAULT:
                _prefault(self.buffer)
            t0 = time.perf_counter()
            self.pinned = _register(self.buffer)
            self.pin_seconds = time.perf_counter() - t0
            if self.pinned:
                weakref.finalize(self, _unregister, self.buffer.data_ptr())


def _prefault(buffer: torch.Tensor) -> None:
    """Fault in every page of ``buffer`` (a fresh mapping: its pages read as zeros, so writing zeros changes nothing)
    by writing one byte per ``PREFAULT_STRIDE`` bytes; a torch op, which releases the GIL while it runs."""
    n = buffer.numel()
    whole = n // PREFAULT_STRIDE * PREFAULT_STRIDE
    if whole:
        buffer[:whole].view(-1, PREFAULT_STRIDE)[:, 0].zero_()
    if whole < n:
        buffer[whole:].zero_()


def _map(nbytes: int) -> tuple[Any, torch.Tensor]:
    """``nbytes`` of fresh anonymous memory (private mapping, huge pages advised) as a ``uint8`` tensor."""
    flags = getattr(mmap, "MAP_PRIVATE", None)
    anon = getattr(mmap, "MAP_ANONYMOUS", getattr(mmap, "MAP_ANON", None))
    if flags is None or anon is None:  # no POSIX mmap flags (Windows): an ordinary tensor
        return None, torch.empty(nbytes, dtype=torch.uint8)
    mm = mmap.mmap(-1, nbytes, flags=flags | anon)
    if hasattr(mm, "madvise") and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            mm.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            pass
    return mm, torch.frombuffer(mm, dtype=torch.uint8, count=nbytes)


def _register(buffer: torch.Tensor) -> bool:
    """Page-lock ``buffer`` for DMA (``cudaHostRegister``, default flags); False (with a warning) if refused."""
    try:
        rc = torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), buffer.numel(), 0)
    except Exception as e:  # no CUDA runtime
        log.warning("host arena: cudaHostRegister unavailable (%s): host copies stay pageable", e)
        return False
    if int(rc) != 0:
        log.warning("host arena: cudaHostRegister of %d bytes failed (cudaError %d): this chunk stays pageable, "
                    "so its host -> GPU copies are synchronous", buffer.numel(), int(rc))
        return False
    return True


def _unregister(ptr: int) -> None:
    try:
        torch.cuda.cudart().cudaHostUnregister(ptr)
    except Exception:  # interpreter shutdown: the process is leaving anyway
        pass


def _event_done(ev: Any) -> bool:
    return ev is None or bool(ev.query())


class HostArena:
    """Host memory for adapter images within ``budget_bytes`` (module docstring).

    Args:
        budget_bytes: most bytes the chunks may map (None: unbounded).
        pinned: register every chunk with ``cudaHostRegister`` (the engine: True when the pool is on CUDA).
        unit: allocation unit in bytes (the engine: the pool's page bytes, so images take exactly their bytes).
        chunk_bytes: bytes of one chunk (rounded down to a multiple of the granule; the last chunk takes what is
            left of the budget).
        granule: chunks are sized in multiples of this many bytes (rounded down to units; default one unit). The
            engine passes the largest image, so chunks hold whole images of it, and of every image whose size
            divides it (ranks that divide ``max_lora_rank``), with no tail left over.

    Raises:
        ValueError: a non-positive ``unit`` or ``chunk_bytes`` below one unit, or a negative budget.
    """

    def __init__(self, budget_bytes: int | None, *, pinned: bool, unit: int = 128,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES, granule: int | None = None) -> None:
        if not isinstance(unit, int) or unit <= 0:
            raise ValueError(f"HostArena: unit must be a positive int, got {unit!r}")
        if chunk_bytes < unit:
            raise ValueError(f"HostArena: chunk_bytes must be at least one unit ({unit}), got {chunk_bytes}")
        if budget_bytes is not None and budget_bytes < 0:
            raise ValueError(f"HostArena: budget_bytes must be >= 0 or None, got {budget_bytes}")
        self.budget = budget_bytes
        self.want_pinned = pinned
        self.unit = unit
        g = max(1, (granule or unit) // unit)
        self.granule_units = g
        self.chunk_units = max(g, chunk_bytes // unit // g * g)
        self._chunks: list[_Chunk] = []
        self._deferred: list[HostBlock] = []  # freed, waiting for copies still reading them
        self._lock = threading.RLock()
        self._grown = threading.Condition(self._lock)  # notified when a background growth ends
        self.compactions = 0
        self.bytes_compacted = 0
        self.register_seconds = 0.0  # mapping + registering the chunks (any thread)
        self.pin_seconds = 0.0  # of those, in cudaHostRegister alone (the driver's lock held: PREFAULT)
        self.sync_register_seconds = 0.0  # of those, on the thread that needed the room (alloc)
        self.sync_grows = 0  # chunks mapped on the thread calling alloc
        self.grown_ahead = 0  # chunks mapped by grow_ahead's background thread
        self._pending_units = 0  # units of a chunk being mapped in the background (counted against the budget)
        self._growth: threading.Thread | None = None
        self._map_target_units = 0  # map_ahead: units the background thread maps chunks up to

    # ------------------------------------------------------------------ accounting
    @property
    def pinned(self) -> bool:
        """Whether every chunk mapped so far is page-locked (True with no chunk yet when ``pinned`` was asked)."""
        return self.want_pinned and all(c.pinned for c in self._chunks)

    @property
    def bytes_held(self) -> int:
        """Bytes the chunks map (and pin): what the arena really holds of host memory."""
        return sum(c.space.num_units for c in self._chunks) * self.unit

    @property
    def bytes_used(self) -> int:
        """Bytes of the live blocks plus freed ones still read by an in-flight copy (exact: units x unit)."""
        with self._lock:
            return sum(b.units for c in self._chunks for b in c.blocks) * self.unit

    @property
    def num_chunks(self) -> int:
        return len(self._chunks)

    def seconds(self) -> tuple[float, float]:
        """(``register_seconds``, ``pin_seconds``) read together, under the lock (a background chunk landing
        between two separate reads would count its pin time in one step and its mapping time in the next)."""
        with self._lock:
            return self.register_seconds, self.pin_seconds

    def _units(self, nbytes: int) -> int:
        return -(-nbytes // self.unit)

    def held_bytes_for(self, nbytes: int) -> int:
        """Bytes of the arena that a block of ``nbytes`` would take (rounded up to whole units: its ``held_bytes``)."""
        return self._units(nbytes) * self.unit

    def could_ever_fit(self, nbytes: int) -> bool:
        """Whether an empty arena could place ``nbytes`` (it fits one chunk and the budget)."""
        units = self._units(nbytes)
        budget_units = None if self.budget is None else self.budget // self.unit
        return units <= self.chunk_units and (budget_units is None or units <= min(self.chunk_units, budget_units))

    # ------------------------------------------------------------------ alloc / free
    def alloc(self, nbytes: int, *, fixed: bool = False) -> HostBlock | None:
        """A block of ``nbytes`` (rounded up to units), or None when no chunk can take it without evicting:
        first fit over the chunks, else a new chunk within the budget, else a compaction of a chunk whose free
        units suffice. ``fixed``: the block is being written (never moved until ``release_fixed``)."""
        if nbytes <= 0:
            raise ValueError(f"HostArena.alloc: nbytes must be positive, got {nbytes}")
        units = self._units(nbytes)
        with self._lock:
            self.reap()
            for i, c in enumerate(self._chunks):
                start = c.space.take(units)
                if start is not None:
                    return self._place(i, start, units, nbytes, fixed)
            seen = len(self._chunks)
            while self._growth is not None:  # a chunk is being mapped ahead: wait for it rather than map another
                self._grown.wait()
                for i in range(seen, len(self._chunks)):  # the chunks that landed meanwhile, first fit
                    start = self._chunks[i].space.take(units)
                    if start is not None:
                        return self._place(i, start, units, nbytes, fixed)
                seen = len(self._chunks)
            i = self._grow(units)
            if i is not None:
                return self._place(i, self._chunks[i].space.take(units), units, nbytes, fixed)
            for i, c in enumerate(self._chunks):
                if c.space.free_units + self._deferred_units(i) >= units:
                    self.compact(i)
                    start = c.space.take(units)
                    if start is not None:
                        return self._place(i, start, units, nbytes, fixed)
            return None

    def _deferred_units(self, chunk: int) -> int:
        return sum(b.units for b in self._deferred if b.chunk == chunk)

    def _place(self, chunk: int, start: int, units: int, nbytes: int, fixed: bool) -> HostBlock:
        b = HostBlock(self, chunk, start, units, nbytes, fixed)
        self._chunks[chunk].blocks.add(b)
        return b

    def _grow(self, units: int) -> int | None:
        """Map a new chunk that can hold ``units`` within the budget; its index, or None. Chunks double from
        ``FIRST_CHUNK_BYTES`` (at least the image asked for) up to ``chunk_bytes``: an engine with a few adapters
        pins a few of their sizes, not a whole chunk."""
        size = self._next_chunk_units(units)
        if size is None:
            return None
        t0 = time.perf_counter()
        self._chunks.append(_Chunk(size * self.unit, size, self.want_pinned))
        dt = time.perf_counter() - t0
        self.register_seconds += dt
        self.pin_seconds += self._chunks[-1].pin_seconds
        self.sync_register_seconds += dt
        self.sync_grows += 1
        return len(self._chunks) - 1

    def _next_chunk_units(self, units: int) -> int | None:
        """Units of the next chunk for an image of ``units`` (doubling from ``FIRST_CHUNK_BYTES`` up to the chunk
        size, within what the budget leaves after the mapped chunks and one being mapped), or None if that is
        fewer than ``units``."""
        g = self.granule_units
        room = self._room_units()
        first = -(-(FIRST_CHUNK_BYTES // self.unit) // g) * g
        grown = max(-(-units // g) * g, first << (len(self._chunks) + (self._growth is not None)))
        size = min(self.chunk_units, grown) if room is None else min(self.chunk_units, grown, room)
        return size if size >= units else None

    def grow_ahead(self, images: int = 2) -> bool:
        """Start mapping the next chunk on a background thread if the free holes could take fewer than ``images``
        images of the granule (the largest image) and the budget has room for one; a no-op while one is being
        mapped. Returns whether a chunk is being mapped when it returns. A failure is logged and leaves the arena
        as it was (``alloc`` grows on its own thread then)."""
        g = self.granule_units
        with self._lock:
            if self._growth is not None:
                return True
            fit = sum(n // g for c in self._chunks for _, n in c.space.holes())
            if fit >= images:
                return False
            size = self._next_chunk_units(g)
            if size is None:
                return False
            self._start_growth(size)
            return True

    def map_ahead(self, nbytes: int) -> bool:
        """Map (and, ``pinned``, register) chunks on the background thread until the arena holds at least ``nbytes``
        (rounded up to whole images of the granule, at most the budget): whole chunks of ``chunk_bytes``, not the
        doubling sizes of chunks mapped on demand. What an engine that expects to fill its host tier does at start
        (``EngineConfig.host_arena_map_ahead_bytes``), so that no ``alloc`` waits for a chunk to be mapped while the
        tier fills. An ``alloc`` meanwhile takes room in each chunk as it lands. Returns whether a chunk is being
        mapped when it returns. A failure is logged and ends the mapping ahead (``alloc`` grows itself then).

        Raises:
            ValueError: a negative ``nbytes``.
        """
        if nbytes < 0:
            raise ValueError(f"HostArena.map_ahead: nbytes must be >= 0, got {nbytes}")
        with self._lock:
            self._map_target_units = max(self._map_target_units, self._units(nbytes))
            if self._growth is not None:  # the running growth goes on to the target
                return True
            size = self._next_ahead_units()
            if size is None:
                return False
            self._start_growth(size)
            return True

    def _next_ahead_units(self) -> int | None:
        """Units of the next chunk ``map_ahead`` maps (its target not reached: a whole chunk, or what the target or
        the budget leaves, in whole granules), or None."""
        g = self.granule_units
        left = self._map_target_units - self.bytes_held // self.unit - self._pending_units
        if left <= 0:
            return None
        size = min(self.chunk_units, -(-left // g) * g)
        room = self._room_units()
        if room is not None:
            size = min(size, room // g * g)
        return size if size >= g else None

    def _room_units(self) -> int | None:
        """Units the budget leaves after the mapped chunks and one being mapped (None: no budget)."""
        return None if self.budget is None else (self.budget - self.bytes_held) // self.unit - self._pending_units

    def _start_growth(self, size: int) -> None:
        """Map a chunk of ``size`` units on the background thread (the arena's lock held)."""
        self._pending_units = size
        # the caller's CUDA device, so the chunk is registered in the same context as alloc's would be
        device = torch.cuda.current_device() if self.want_pinned and torch.cuda.is_available() else None
        self._growth = threading.Thread(target=self._map_ahead, args=(size, device),
                                        name="multilora-host-arena-grow", daemon=True)
        self._growth.start()

    def _map_ahead(self, size: int | None, device: int | None) -> None:
        """The background thread: map a chunk of ``size`` units, then, while ``map_ahead``'s target is not reached,
        the next one (each appended, and the waiting ``alloc`` calls woken, as it lands)."""
        if device is not None:
            try:
                torch.cuda.set_device(device)
            except Exception as e:  # noqa: BLE001 - registration then fails the same way, and is logged below
                log.warning("host arena: mapping ahead on device %s: %s", device, e)
        while size is not None:
            t0 = time.perf_counter()
            try:
                chunk = _Chunk(size * self.unit, size, self.want_pinned)
            except Exception as e:  # noqa: BLE001 - out of memory or mapping refused: alloc grows (or fails) itself
                log.warning("host arena: mapping a %d-byte chunk ahead failed: %s", size * self.unit, e)
                chunk = None
            dt = time.perf_counter() - t0
            with self._lock:
                self._pending_units = 0
                if chunk is not None:
                    self._chunks.append(chunk)
                    self.register_seconds += dt
                    self.pin_seconds += chunk.pin_seconds
                    self.grown_ahead += 1
                    size = self._next_ahead_units()
                else:
                    self._map_target_units = 0  # a failure ends the mapping ahead
                    size = None
                if size is None:
                    self._growth = None
                else:
                    self._pending_units = size
                self._grown.notify_all()

    def wait_growth(self, timeout: float | None = None) -> None:
        """Wait for the background mapping (if any: ``grow_ahead``'s chunk, ``map_ahead``'s chunks) to be in place
        (or to have failed). Not with the arena's lock held: the background thread takes it to append each chunk."""
        t = self._growth
        if t is not None:
            t.join(timeout)

    def note_read(self, block: HostBlock, event: Any) -> None:
        """A copy reading ``block`` was queued; ``event`` completes after it (None: it already finished)."""
        if event is None:
            return
        with self._lock:
            block.reads = [e for e in block.reads if not _event_done(e)] + [event]

    def release_fixed(self, block: HostBlock) -> None:
        """The block has been written: it may move from now on."""
        block.fixed = False

    def free(self, block: HostBlock) -> None:
        """Give a block back; if a copy may still read it, once that copy has completed (see ``reap``)."""
        with self._lock:
            if block.freed:
                raise RuntimeError("HostArena.free: block freed twice")
            block.freed = True
            block.on_move = None
            block.reads = [e for e in block.reads if not _event_done(e)]
            if block.reads:
                self._deferred.append(block)
            else:
                self._release(block)

    def _release(self, block: HostBlock) -> None:
        c = self._chunks[block.chunk]
        c.blocks.discard(block)
        c.space.give(block.start, block.units)

    def reap(self) -> None:
        """Release the deferred blocks whose copies have completed."""
        with self._lock:
            keep = []
            for b in self._deferred:
                b.reads = [e for e in b.reads if not _event_done(e)]
                if b.reads:
                    keep.append(b)
                else:
                    self._release(b)
            self._deferred = keep

    def settle(self, chunk: int | None = None) -> None:
        """Wait (host side) for every copy still reading a block (of ``chunk``, or all), then reap."""
        with self._lock:
            for i, c in enumerate(self._chunks):
                if chunk is not None and i != chunk:
                    continue
                for b in list(c.blocks):
                    for e in b.reads:
                        e.synchronize()
                    b.reads = []
            self.reap()

    def compact(self, chunk: int) -> int:
        """Slide the movable blocks of ``chunk`` down (module docstring); returns the bytes moved. Waits first for
        the copies reading any block of it (none moves, nor is moved over, while one may be read)."""
        with self._lock:
            self.settle(chunk)
            c = self._chunks[chunk]
            runs = [(b, b.start, b.units, not b.fixed) for b in c.blocks]
            moved = 0
            for b, old, new, n in c.space.compact(runs):
                move_down(c.buffer, new * self.unit, old * self.unit, n * self.unit)
                b.start = new
                moved += n * self.unit
                if b.on_move is not None:
                    b.on_move(b)
            self.compactions += 1
            self.bytes_compacted += moved
            return moved

    def holes(self, chunk: int) -> list[tuple[int, int]]:
        """Free runs ``(start unit, units)`` of a chunk."""
        return self._chunks[chunk].space.holes()

    def blocks(self) -> list[HostBlock]:
        """Every block not yet released (live and deferred), by chunk and address."""
        with self._lock:
            return sorted((b for c in self._chunks for b in c.blocks), key=lambda b: (b.chunk, b.start))
