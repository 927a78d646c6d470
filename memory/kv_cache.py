"""The paged KV cache: fixed-size blocks of token positions, a block table per sequence.

Storage is allocated once: ``k`` and ``v`` are ``[num_layers, num_blocks, block_size, num_kv_heads,
head_dim]``. A sequence owns a **block table**, the list of its blocks in order: token ``p`` of the
sequence lives at row ``p % block_size`` of block ``table[p // block_size]`` (flat slot
``table[p // block_size] * block_size + p % block_size``, see ``multilora.kernels.attention``).

Worked example, ``block_size = 4``, ``num_blocks = 8`` (block 0 reserved, 7 usable):
``allocate_seq("a", 6)`` -> ``[1, 2]`` (tokens 0-3 in block 1, 4-5 in rows 0-1 of block 2);
``ensure_capacity("a", 9)`` appends one block -> ``[1, 2, 3]``; ``free_seq("a")`` returns all three.

**Block 0 is the null block.** It is never handed out: block-table rows are padded with 0, and padded
rows of a captured CUDA graph write their (garbage) keys and values there, so no sequence's data is
ever overwritten by padding. It is part of the storage and of the bytes accounted for the cache
(``nbytes``), not of the usable blocks (``num_usable_blocks = num_blocks - 1``).

A unified memory (``multilora.memory.unified``) gives the cache its storage (``storage=``: views of one arena
shared with the adapter pool, blocks a whole arena unit apart) and a movable first usable block (``floor=``:
``FloorBlockAllocator``, which hands out the highest free blocks first).

Bookkeeping (``BlockAllocator``) is plain Python, so tests cover it completely on a CPU; ``PagedKVCache``
adds the storage and a lock (its methods may be called from several threads).
"""

from __future__ import annotations

import heapq
import threading
from collections.abc import Hashable

import torch

#: Block id that is never handed out (padding target; see the module docstring).
NULL_BLOCK = 0


class KVCacheFullError(RuntimeError):
    """Not enough free KV blocks for an allocation (the message says how many were asked and free)."""


class BlockAllocator:
    """Free list and owner map of ``num_blocks`` KV blocks; block 0 (``NULL_BLOCK``) is never handed out.

    Invariants: every usable block (1 .. num_blocks - 1) is either free or owned by exactly one owner;
    ``num_free + sum(len(blocks_of(o)) for o in owners) == num_blocks - 1``. Not thread-safe on its own
    (``PagedKVCache`` serialises access).

    Args:
        num_blocks: blocks of the storage, the null block included (>= 2).
    """

    floor = NULL_BLOCK + 1  #: the first usable block (movable in ``FloorBlockAllocator``)

    def __init__(self, num_blocks: int) -> None:
        if not isinstance(num_blocks, int) or num_blocks < 2:
            raise ValueError(f"BlockAllocator: num_blocks must be an int >= 2 (block 0 is reserved), got {num_blocks!r}")
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, NULL_BLOCK, -1))  # a stack: low ids first, freed ones reused first
        self._owned: dict[Hashable, list[int]] = {}

    @property
    def num_usable(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    def _release(self, blocks: list[int]) -> None:
        """Put an owner's blocks back among the free ones (a stack: reused first)."""
        self._free.extend(reversed(blocks))

    def _pop(self, n_blocks: int) -> list[int]:
        """Take ``n_blocks`` free blocks (there are enough): the lowest ids of a fresh cache, freed ones first."""
        taken = self._free[len(self._free) - n_blocks:][::-1]
        del self._free[len(self._free) - n_blocks:]
        return taken

    def owners(self) -> list[Hashable]:
        return list(self._owned)

    def has(self, owner: Hashable) -> bool:
        return owner in self._owned

    def blocks_of(self, owner: Hashable) -> list[int]:
        """The owner's blocks in order (a copy). Raises KeyError for an unknown owner."""
        if owner not in self._owned:
            raise KeyError(f"BlockAllocator: {owner!r} owns no blocks")
        return list(self._owned[owner])

    def can_allocate(self, n_blocks: int) -> bool:
        return 0 <= n_blocks <= self.num_free

    def allocate(self, owner: Hashable, n_blocks: int) -> list[int]:
        """Give a new owner ``n_blocks`` blocks and return them.

        Raises:
            ValueError: ``owner`` already owns blocks, or ``n_blocks`` < 0.
            KVCacheFullError: fewer than ``n_blocks`` are free (nothing changes).
        """
        if owner in self._owned:
            raise ValueError(f"BlockAllocator.allocate: {owner!r} already owns {len(self._owned[owner])} block(s)")
        self._owned[owner] = self._take(owner, n_blocks)
        return list(self._owned[owner])

    def append(self, owner: Hashable, n_blocks: int) -> list[int]:
        """Add ``n_blocks`` blocks at the end of an owner's table; return the new blocks.

        Raises:
            KeyError: unknown owner. ValueError: ``n_blocks`` < 0.
            KVCacheFullError: fewer than ``n_blocks`` are free (nothing changes).
        """
        if owner not in self._owned:
            raise KeyError(f"BlockAllocator.append: {owner!r} owns no blocks (allocate first)")
        new = self._take(owner, n_blocks)
        self._owned[owner].extend(new)
        return new

    def free(self, owner: Hashable) -> int:
        """Return all of an owner's blocks; returns how many. Raises KeyError for an unknown owner."""
        if owner not in self._owned:
            raise KeyError(f"BlockAllocator.free: {owner!r} owns no blocks")
        blocks = self._owned.pop(owner)
        self._release(blocks)
        return len(blocks)

    def _take(self, owner: Hashable, n_blocks: int) -> list[int]:
        if not isinstance(n_blocks, int) or n_blocks < 0:
            raise ValueError(f"BlockAllocator: n_blocks must be an int >= 0, got {n_blocks!r}")
        if n_blocks > self.num_free:
            raise KVCacheFullError(
                f"KV cache full: {owner!r} asked for {n_blocks} block(s), {self.num_free} of {self.num_usable} are free"
            )
        return self._pop(n_blocks)


class FloorBlockAllocator(BlockAllocator):
    """A ``BlockAllocator`` whose usable blocks are ``[floor, num_blocks)`` with a movable ``floor`` (the KV side of
    ``multilora.memory.unified``: blocks below the floor, but for the null block 0, belong to the adapter pool).

    It hands out the HIGHEST free blocks first (a max-heap), so free blocks gather just above the floor, where
    the adapter pool grows into them (``raise_floor``); ``lower_floor`` gives it blocks the pool left.
    Invariant: every block of ``[floor, num_blocks)`` is either free or owned by exactly one owner; blocks below
    the floor are neither.

    Args:
        num_blocks: blocks of the storage (the null block 0 included).
        floor: the first usable block (1 <= floor < num_blocks).
    """

    def __init__(self, num_blocks: int, *, floor: int = 1) -> None:
        super().__init__(num_blocks)
        if not isinstance(floor, int) or not NULL_BLOCK < floor < num_blocks:
            raise ValueError(f"FloorBlockAllocator: floor must be an int in [1, {num_blocks}), got {floor!r}")
        self.floor = floor
        self._free_set = set(range(floor, num_blocks))
        self._heap = [-b for b in range(num_blocks - 1, floor - 1, -1)]  # max-heap (negated), a valid heap as built
        del self._free  # the base class's stack is not used

    @property
    def num_usable(self) -> int:
        return self.num_blocks - self.floor

    @property
    def num_free(self) -> int:
        return len(self._free_set)

    def _release(self, blocks: list[int]) -> None:
        for b in blocks:
            self._free_set.add(b)
            heapq.heappush(self._heap, -b)

    def _pop(self, n_blocks: int) -> list[int]:
        taken: list[int] = []
        while len(taken) < n_blocks:
            b = -heapq.heappop(self._heap)
            if b in self._free_set:  # else a stale entry (a block the floor took, or taken already)
                self._free_set.discard(b)
                taken.append(b)
        return taken

    def free_above_floor(self, limit: int | None = None) -> int:
        """How many consecutive blocks from the floor up are free (at most ``limit``): what ``raise_floor`` can take."""
        n, top = 0, self.num_blocks if limit is None else min(self.num_blocks, self.floor + limit)
        while self.floor + n < top and self.floor + n in self._free_set:
            n += 1
        return n

    def raise_floor(self, n_blocks: int) -> None:
        """Give up blocks ``[floor, floor + n_blocks)``, which must all be free.

        Raises:
            ValueError: one of them is owned, or the floor would reach ``num_blocks`` (nothing changes).
        """
        if n_blocks < 0 or self.floor + n_blocks >= self.num_blocks or self.free_above_floor(n_blocks) < n_blocks:
            raise ValueError(f"FloorBlockAllocator.raise_floor: blocks [{self.floor}, {self.floor + n_blocks}) are not "
                             f"all free (or would leave no block): {self.free_above_floor(n_blocks)} are")
        self._free_set.difference_update(range(self.floor, self.floor + n_blocks))
        self.floor += n_blocks
        if len(self._heap) > 4 * (len(self._free_set) + 64):  # drop stale entries now and then
            self._heap = [-b for b in self._free_set]
            heapq.heapify(self._heap)

    def lower_floor(self, n_blocks: int) -> None:
        """Take blocks ``[floor - n_blocks, floor)`` back as free blocks.

        Raises:
            ValueError: the floor would reach the null block (nothing changes).
        """
        if n_blocks < 0 or self.floor - n_blocks <= NULL_BLOCK:
            raise ValueError(f"FloorBlockAllocator.lower_floor: cannot lower floor {self.floor} by {n_blocks}")
        self._release(list(range(self.floor - n_blocks, self.floor)))
        self.floor -= n_blocks


class PagedKVCache:
    """KV storage in blocks of ``block_size`` tokens with a block table per sequence.

    Args:
        num_layers, num_kv_heads, head_dim: the model's.
        num_blocks: blocks of storage, the reserved null block included (>= 2).
        block_size: tokens per block (>= 1).
        dtype, device: of the storage.

    The storage is zero-filled once: the torch reference attention multiplies masked-out rows of a
    gathered block by a zero weight, and uninitialised memory could hold NaN (NaN x 0 = NaN).
    Sequences are named by any hashable ``seq_id`` (the engine uses the request id); the cache, not the
    request, holds each sequence's block table.
    """

    def __init__(
        self,
        *,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        storage: tuple[torch.Tensor, torch.Tensor] | None = None,
        floor: int | None = None,
    ) -> None:
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"PagedKVCache: block_size must be an int >= 1, got {block_size!r}")
        self.allocator = BlockAllocator(num_blocks) if floor is None else FloorBlockAllocator(num_blocks, floor=floor)
        shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        if storage is None:
            self.k = torch.zeros(shape, dtype=dtype, device=device)
            self.v = torch.zeros(shape, dtype=dtype, device=device)
        else:
            for name, t in zip(("k", "v"), storage):
                if tuple(t.shape) != shape or t.dtype != dtype or t.stride(-1) != 1:
                    raise ValueError(f"PagedKVCache: storage {name} must be {dtype} {list(shape)} with unit stride "
                                     f"along head_dim, got {t.dtype} {list(t.shape)} strides {t.stride()}")
            self.k, self.v = storage
        self.num_blocks = num_blocks
        self.block_size = block_size
        #: the most usable blocks this cache can ever have (a unified memory's KV side grows up to it)
        self.max_usable_blocks = self.allocator.num_usable
        #: what a request too long for ``max_usable_blocks`` is told to raise (a unified memory names both sizes)
        self.size_hint = "raise kv_cache_bytes"
        self._lock = threading.Lock()

    # ---------------------------------------------------------------------------------- sizes
    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """K and V bytes one token takes over all layers."""
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    @property
    def block_bytes(self) -> int:
        """K and V bytes of one block over all layers."""
        return 2 * self.k[:, 0].numel() * self.k.element_size()

    @property
    def nbytes(self) -> int:
        """Bytes of the cache's blocks now: its usable blocks and the null block (a unified memory's KV side
        changes size; ``multilora.memory.unified``)."""
        return (self.allocator.num_usable + 1) * self.block_bytes

    @property
    def num_usable_blocks(self) -> int:
        return self.allocator.num_usable

    @property
    def floor(self) -> int:
        """The first usable block: 1 (after the null block), higher in a unified memory."""
        return self.allocator.floor

    @property
    def num_free_blocks(self) -> int:
        with self._lock:
            return self.allocator.num_free

    def blocks_for_tokens(self, num_tokens: int) -> int:
        """Blocks that hold ``num_tokens`` positions: ceil(num_tokens / block_size)."""
        return -(-num_tokens // self.block_size)

    def can_fit(self, num_tokens: int) -> bool:
        """Whether a new sequence of ``num_tokens`` positions would get its blocks now."""
        with self._lock:
            return self.allocator.can_allocate(self.blocks_for_tokens(num_tokens))

    # ------------------------------------------------------------------------------ sequences
    def allocate_seq(self, seq_id: Hashable, num_tokens: int) -> list[int]:
        """Give a new sequence the blocks for ``num_tokens`` positions; return its block table.

        Raises:
            ValueError: ``seq_id`` already holds blocks. KVCacheFullError: not enough free blocks.
        """
        with self._lock:
            return self.allocator.allocate(seq_id, self.blocks_for_tokens(num_tokens))

    def ensure_capacity(self, seq_id: Hashable, num_tokens: int) -> bool:
        """Grow a sequence's table to hold ``num_tokens`` positions (a new ``seq_id`` is allocated).

        Returns False, changing nothing, when not enough blocks are free; True otherwise (also when it
        already holds enough; tables never shrink here).
        """
        with self._lock:
            a = self.allocator
            have = len(a.blocks_of(seq_id)) if a.has(seq_id) else None
            need = self.blocks_for_tokens(num_tokens) - (have or 0)
            if not a.can_allocate(max(need, 0)):
                return False
            if have is None:
                a.allocate(seq_id, need)
            elif need > 0:
                a.append(seq_id, need)
            return True

    def free_seq(self, seq_id: Hashable) -> None:
        """Return all blocks of a sequence. Raises KeyError for an unknown ``seq_id``."""
        with self._lock:
            self.allocator.free(seq_id)

    def has_seq(self, seq_id: Hashable) -> bool:
        with self._lock:
            return self.allocator.has(seq_id)

    def block_table(self, seq_id: Hashable) -> list[int]:
        """The sequence's blocks in order (a copy). Raises KeyError for an unknown ``seq_id``."""
        with self._lock:
            return self.allocator.blocks_of(seq_id)

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``i``'s (k_cache, v_cache), each ``[num_blocks, block_size, num_kv_heads, head_dim]`` (views)."""
        return self.k[i], self.v[i]
