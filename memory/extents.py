"""Extents: the first-fit allocator of runs of consecutive units shared by the GPU adapter pool
(``multilora.memory.pool``, units = pages) and the pinned host arena (``multilora.memory.host_arena``, units of
one pool page's bytes), and the overlap-safe in-buffer move that their compactions use.

An :class:`Extents` holds the free runs ("holes") of ``[0, num_units)`` as a sorted list of ``[start, length]``,
never two adjacent ones. ``take(n)`` gives the first hole (by address) of at least ``n`` units and shrinks it;
``give(start, n)`` returns a run and merges it with its neighbours. ``compact(runs)`` plans the slide of every
movable run down to the lowest free unit in address order (a run that must not move stays and the cursor jumps
past it), rewrites the holes, and returns the moves for the caller to perform in address order with
:func:`move_down`. Plain Python bookkeeping: the caller holds the lock.

Worked example: 10 units, runs a = [0, 2), b = [4, 3), c = [8, 1) (holes [2, 2), [7, 1), [9, 1)); with all three
movable ``compact`` returns the moves b: 4 -> 2 and c: 8 -> 5 and leaves one hole [6, 4); with b fixed, only
c moves (8 -> 7) and the holes are [2, 2), [8, 2).
"""

from __future__ import annotations

import bisect
from typing import Hashable, Iterable

import torch


class Extents:
    """Free runs of ``[0, num_units)``, first fit (module docstring). All counts are units.

    Raises:
        ValueError: a negative ``num_units``.
    """

    def __init__(self, num_units: int) -> None:
        if num_units < 0:
            raise ValueError(f"Extents: num_units must be >= 0, got {num_units}")
        self.num_units = num_units
        self._holes: list[list[int]] = [[0, num_units]] if num_units else []  # sorted by start, never adjacent

    @property
    def free_units(self) -> int:
        return sum(n for _, n in self._holes)

    @property
    def largest_hole(self) -> int:
        """The largest free run (what ``take`` can give without a compaction)."""
        return max((n for _, n in self._holes), default=0)

    def holes(self) -> list[tuple[int, int]]:
        """The free runs ``(start, length)``, by address."""
        return [(s, n) for s, n in self._holes]

    def take(self, units: int) -> int | None:
        """First fit: the start of a run of ``units`` free units, removed from the holes; None if no hole fits."""
        for i, (start, n) in enumerate(self._holes):
            if n >= units:
                if n == units:
                    del self._holes[i]
                else:
                    self._holes[i] = [start + units, n - units]
                return start
        return None

    def give(self, start: int, units: int) -> None:
        """Return ``[start, start + units)`` to the holes, merged with adjacent ones."""
        if units == 0:
            return
        assert 0 <= start and start + units <= self.num_units, (start, units, self.num_units)
        i = bisect.bisect_left(self._holes, [start, 0])
        if i > 0 and self._holes[i - 1][0] + self._holes[i - 1][1] == start:
            i -= 1
            self._holes[i][1] += units
        else:
            self._holes.insert(i, [start, units])
        if i + 1 < len(self._holes) and self._holes[i][0] + self._holes[i][1] == self._holes[i + 1][0]:
            self._holes[i][1] += self._holes.pop(i + 1)[1]

    @property
    def top_hole(self) -> int:
        """Free units at the top (the hole ending at ``num_units``; 0 if the last unit is taken)."""
        if self._holes and self._holes[-1][0] + self._holes[-1][1] == self.num_units:
            return self._holes[-1][1]
        return 0

    def resize(self, num_units: int) -> None:
        """Grow or shrink ``[0, num_units)`` at the top: growing adds the new units to the holes (merged with a top
        hole); shrinking removes them, and they must all be free (``top_hole``).

        Raises:
            ValueError: a negative size, or a shrink past the top hole (nothing changes).
        """
        delta = num_units - self.num_units
        if num_units < 0 or -delta > self.top_hole:
            raise ValueError(f"Extents.resize: cannot go from {self.num_units} to {num_units} units (top hole "
                             f"{self.top_hole}): only free units at the top can be removed")
        if delta > 0:
            old = self.num_units
            self.num_units = num_units
            self.give(old, delta)
        elif delta < 0:
            self._holes[-1][1] += delta
            if self._holes[-1][1] == 0:
                self._holes.pop()
            self.num_units = num_units

    def compact(self, runs: Iterable[tuple[Hashable, int, int, bool]]) -> list[tuple[Hashable, int, int, int]]:
        """Plan a compaction of the allocated ``runs`` ``(key, start, length, movable)`` (every allocated run,
        exactly once): movable runs slide down to the lowest free unit in address order, fixed ones stay.
        Rewrites the holes; returns the moves ``(key, old start, new start, length)`` in address order (each
        ``new < old``; performed in this order, no move overwrites a run that a later one still reads)."""
        moves: list[tuple[Hashable, int, int, int]] = []
        holes: list[list[int]] = []
        cursor = 0
        for key, start, n, movable in sorted(runs, key=lambda r: r[1]):
            if n == 0:
                continue
            if not movable or start == cursor:
                if start > cursor:
                    holes.append([cursor, start - cursor])
                cursor = start + n
                continue
            moves.append((key, start, cursor, n))
            cursor += n
        if cursor < self.num_units:
            holes.append([cursor, self.num_units - cursor])
        self._holes = holes
        return moves


def move_down(buffer: torch.Tensor, dst: int, src: int, n: int) -> None:
    """Copy elements ``[src, src + n)`` of the 1-D ``buffer`` to ``[dst, dst + n)`` with ``dst < src`` (on the
    current stream for a CUDA buffer), in pieces that never overlap (each piece's source lies past its
    destination and later pieces read only elements no earlier piece wrote); at most 8 pieces, else through one
    temporary copy of the source."""
    assert dst < src, (dst, src)
    gap = src - dst
    if gap >= n:
        buffer[dst : dst + n].copy_(buffer[src : src + n])
    elif -(-n // gap) <= 8:
        for k in range(0, n, gap):
            m = min(gap, n - k)
            buffer[dst + k : dst + k + m].copy_(buffer[src + k : src + k + m])
    else:
        buffer[dst : dst + n].copy_(buffer[src : src + n].clone())
