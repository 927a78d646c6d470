"""One device buffer for the KV cache and the adapter pool, with a movable boundary between them (S-LoRA's unified
paging, issue 13 item 5): at low load idle KV memory holds more adapters; at high load adapters give way to KV.

Layout
------
The **arena** is ONE device allocation of ``num_units`` **units**; a unit is the bytes of one KV block over all
layers (K and V: ``2 * layers * block_size * kv_heads * head_dim * dtype bytes``; 2 MiB for Llama-3-8B with blocks of
16 tokens), a whole number of adapter-pool pages (``pages_per_unit = unit_bytes / page_bytes``)::

    unit:   0            1 ..................... floor - 1   floor .......................... num_units - 1
            [null block] [adapter pool pages  -> free top]   [free KV blocks <- KV blocks in use            ]

- **KV block** ``b`` is unit ``b``: the arena seen as ``[num_units, 2, layers, block_size, kv_heads, head_dim]``;
  layer ``l``'s keys are ``arena[:, 0, l]`` (``[num_units, block_size, kv_heads, head_dim]``, blocks ``unit_bytes``
  apart: the attention and KV-write kernels take the block stride). Block 0 stays the KV cache's null block (the
  padding target of CUDA-graph rows, ``multilora.memory.kv_cache``), so no padding write ever lands in the pool.
- **Pool page** ``p`` is arena page ``pages_per_unit + p`` (``AdapterPool(buffer=..., base_page=pages_per_unit)``):
  the pool owns units ``[1, floor)``.
- The **floor** is the boundary, in ``[1 + min_pool_units, max_floor]``. The KV side hands out its highest free blocks first
  (``kv_cache.FloorBlockAllocator``), so its free blocks gather just above the floor; the pool places extents
  first fit from its bottom and compacts downward (``multilora.memory.pool``), so its free pages gather just below
  the floor. ``grow_pool(units)`` raises the floor over free KV blocks; ``shrink_pool(units)`` lowers it over free
  pool pages (compacting first when they are free but not at the top). Neither moves a KV block or evicts an
  adapter: which adapters leave, and when the pool may take KV blocks, is the runtime's policy
  (``multilora.runtime.adapter_cache``, ``multilora.runtime.scheduler``).

Bounds: the pool never goes below ``min_pool_units`` (the largest adapter ``max_lora_rank`` allows), the KV side never
below ``min_kv_blocks`` usable blocks (one ``max_seq_len`` sequence): both live states always fit, so a request
that fits alone always runs (the scheduler's no-starvation bound is unchanged).

Ordering (CUDA): both sides are used on the engine's compute stream, and the pool's side-stream loads into pages
that were KV blocks wait for the compute stream's earlier work (``AdapterPool.resize``); pages given to the KV side
were free, and ``AdapterPool.free`` / ``compact`` already made the compute stream wait for their last copies.
Tensors never change: CUDA graphs keep their addresses, and the pool rewrites moved offsets in place.

Worked example: 10 units of 4 pages; ``floor = 4`` (pool pages 0-11 = units 1-3, KV blocks 4-9). A sequence takes
blocks 9 and 8 (the highest first). ``grow_pool(2)``: blocks 4 and 5 are free -> floor 6, pool 20 pages. An adapter
of 6 pages sits at pool pages 0-5 (units 1-2); ``shrink_pool(3)``: the 14 free pages hold 3 whole units -> floor 3,
pool 8 pages, KV blocks 3-9.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from multilora.config import ModelConfig
from multilora.memory.kv_cache import PagedKVCache
from multilora.memory.pool import PAGE_ELEMS, AdapterPool


@dataclass(frozen=True)
class UnifiedLayout:
    """The arena's sizes (all derived in ``unified_layout``).

    Attributes:
        num_units: units of the arena (= KV blocks of its storage, the null block included).
        unit_bytes: bytes of one unit (one KV block over all layers, K and V).
        pages_per_unit: adapter-pool pages per unit.
        floor: the initial boundary (units ``[1, floor)`` to the pool).
        min_pool_units, min_kv_blocks: the lower bounds of each side.
        max_floor: the highest boundary: ``min_kv_blocks`` usable KV blocks left.
    """

    num_units: int
    unit_bytes: int
    pages_per_unit: int
    floor: int
    min_pool_units: int
    min_kv_blocks: int
    max_floor: int

    @property
    def nbytes(self) -> int:
        return self.num_units * self.unit_bytes

    @property
    def pool_pages(self) -> int:
        """The pool's starting pages (units ``[1, floor)``)."""
        return (self.floor - 1) * self.pages_per_unit

    @property
    def max_pool_pages(self) -> int:
        """The most pages the pool can grow to (units ``[1, max_floor)``: ``min_kv_blocks`` usable KV blocks left)."""
        return (self.max_floor - 1) * self.pages_per_unit

    @property
    def max_kv_usable_blocks(self) -> int:
        """The most usable KV blocks (the null block aside): all units but the pool's minimum."""
        return self.num_units - 1 - self.min_pool_units


def unified_layout(*, pool_bytes: int, kv_bytes: int, block_bytes: int, page_bytes: int, min_pool_bytes: int,
                   min_kv_blocks: int) -> UnifiedLayout:
    """The arena for a memory plan's ``pool_bytes`` + ``kv_bytes`` (the KV's null block included): the same total
    in whole units, the pool's starting share rounded down to whole units (at least ``min_pool_units``), so the KV
    side starts with at least the blocks the plan gave it.

    Raises:
        ValueError: a block that is not a whole number of pages, or a total below both sides' minimums plus the
            null block (the message gives the numbers).
    """
    if block_bytes % page_bytes:
        raise ValueError(f"unified memory: a KV block ({block_bytes} bytes) must be a whole number of adapter-pool "
                         f"pages ({page_bytes} bytes); this model's shape does not allow it (turn unified_pool off)")
    units = (pool_bytes + kv_bytes) // block_bytes
    min_pool_units = -(-min_pool_bytes // block_bytes)
    if units < 1 + min_pool_units + min_kv_blocks:
        raise ValueError(f"unified memory: {pool_bytes + kv_bytes} bytes hold {units} units of {block_bytes} bytes; "
                         f"at least {1 + min_pool_units + min_kv_blocks} are needed (the null block, {min_pool_units} "
                         f"for the largest adapter, {min_kv_blocks} for one max_seq_len sequence)")
    max_units = units - 1 - min_kv_blocks
    pool_units = min(max(pool_bytes // block_bytes, min_pool_units), max_units)
    return UnifiedLayout(num_units=units, unit_bytes=block_bytes, pages_per_unit=block_bytes // page_bytes,
                         floor=1 + pool_units, min_pool_units=min_pool_units, min_kv_blocks=min_kv_blocks,
                         max_floor=1 + max_units)


class UnifiedMemory:
    """The arena, its KV cache and its adapter pool (module docstring), and the boundary moves between them.

    Args:
        config: the model's configuration (one tensor-parallel rank's).
        layout: ``unified_layout``'s result.
        block_size: tokens per KV block.
        dtype, device: of both the KV cache and the pool.
        max_rank, max_slots: the pool's.

    Attributes:
        kv: a ``PagedKVCache`` over the arena (``storage=``, ``floor=``).
        pool: an ``AdapterPool`` over the arena (``buffer=``, ``base_page=``, ``capacity_pages=``).
        moves_up, moves_down, units_up, units_down: how often and by how many units the floor rose (pool grew)
            and fell (KV grew).

    Thread safety: ``grow_pool`` / ``shrink_pool`` hold the KV cache's lock and the pool's lock (in that order;
    nothing else takes both).
    """

    def __init__(self, config: ModelConfig, layout: UnifiedLayout, *, block_size: int, dtype: torch.dtype,
                 device: torch.device | str, max_rank: int, max_slots: int) -> None:
        self.layout = lay = layout
        L, H, D = config.num_layers, config.num_kv_heads, config.head_dim
        elt = torch.empty((), dtype=dtype).element_size()
        block_bytes = PagedKVCache.bytes_per_token(L, H, D, dtype) * block_size
        if block_bytes != lay.unit_bytes:
            raise ValueError(f"UnifiedMemory: unit_bytes {lay.unit_bytes} is not one KV block of this model "
                             f"({block_bytes} bytes)")
        # zeros: the torch reference attention multiplies masked rows by 0 (NaN x 0 = NaN); pool pages are written
        # whole by ``load`` before any slot reads them
        self.arena = torch.zeros(lay.num_units * lay.unit_bytes // elt, dtype=dtype, device=device)
        blocks = self.arena.view(lay.num_units, 2, L, block_size, H, D)
        k, v = blocks[:, 0].transpose(0, 1), blocks[:, 1].transpose(0, 1)  # [L, num_units, block_size, H, D]
        self.kv = PagedKVCache(num_layers=L, num_blocks=lay.num_units, block_size=block_size, num_kv_heads=H,
                               head_dim=D, dtype=dtype, device=device, storage=(k, v), floor=lay.floor)
        self.kv.max_usable_blocks = lay.max_kv_usable_blocks
        self.kv.size_hint = "raise kv_cache_bytes or adapter_pool_bytes (with unified_pool they size one buffer)"
        self.pool = AdapterPool(config, num_bytes=lay.pool_pages * PAGE_ELEMS * elt, max_rank=max_rank,
                                max_slots=max_slots, dtype=dtype, device=device, buffer=self.arena,
                                base_page=lay.pages_per_unit, capacity_pages=lay.max_pool_pages)
        self.moves_up = self.moves_down = self.units_up = self.units_down = 0
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ sizes
    @property
    def floor(self) -> int:
        return self.kv.floor

    @property
    def pool_units(self) -> int:
        return self.floor - 1

    @property
    def unit_bytes(self) -> int:
        return self.layout.unit_bytes

    def free_kv_units_at_floor(self, limit: int | None = None) -> int:
        """KV blocks free from the floor up, without a gap (at most ``limit``), up to ``max_floor``: how far
        ``grow_pool`` can go now."""
        with self.kv._lock:
            return self._growth_room(limit)

    def _growth_room(self, limit: int | None) -> int:
        """``free_kv_units_at_floor`` with the KV cache's lock held."""
        return min(self.kv.allocator.free_above_floor(limit), max(self.layout.max_floor - self.floor, 0))

    def free_pool_units_at_top(self) -> int:
        """Whole units of free pool pages, above the pool's minimum: how far ``shrink_pool`` can go (compacting)."""
        ppu = self.layout.pages_per_unit
        return max(0, min(self.pool.pages_free // ppu, self.pool_units - self.layout.min_pool_units))

    # ------------------------------------------------------------------ boundary moves
    def grow_pool(self, units: int) -> int:
        """Raise the floor by up to ``units`` over free KV blocks; returns the units the pool gained."""
        if units <= 0:
            return 0
        with self._lock, self.kv._lock:
            n = self._growth_room(units)
            if n <= 0:
                return 0
            self.kv.allocator.raise_floor(n)
            self.pool.resize(self.pool.num_pages + n * self.layout.pages_per_unit)
            self.moves_up += 1
            self.units_up += n
            return n

    def shrink_pool(self, units: int) -> int:
        """Lower the floor by up to ``units`` over free pool pages (the pool compacts first if they are not at its
        top); returns the units the KV side gained."""
        if units <= 0:
            return 0
        with self._lock, self.kv._lock:
            n = min(units, self.free_pool_units_at_top())
            if n <= 0:
                return 0
            self.pool.resize(self.pool.num_pages - n * self.layout.pages_per_unit)
            self.kv.allocator.lower_floor(n)
            self.moves_down += 1
            self.units_down += n
            return n

    def report(self) -> dict:
        """The unified memory's part of ``Engine.stats()``."""
        return {"unified_units": self.layout.num_units, "unified_unit_bytes": self.layout.unit_bytes,
                "unified_pool_units": self.pool_units, "unified_kv_units": self.layout.num_units - self.floor,
                "unified_floor_moves_up": self.moves_up, "unified_floor_moves_down": self.moves_down,
                "unified_units_to_pool": self.units_up, "unified_units_to_kv": self.units_down}
