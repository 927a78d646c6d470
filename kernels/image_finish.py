"""Finishing a raw adapter image on the device, after its host -> GPU copy (issue 13, item 4).

The adapter cache's I/O threads read an adapter's safetensors file **raw** (``runtime.adapters.image.read_image(...,
raw=True)``): every tensor's bytes go straight from the file into its place in the pool image, as a plain read
would, and three things a pool image needs are left to the GPU, where they cost microseconds instead of most of
the read's time on a CPU thread (bench/README.md, "Tier moves against their bounds"):

- each lora_B region holds B as the file stores it, ``[rows, r]`` row-major, where the pool keeps B^T ``[r, rows]``
  (``multilora.memory.pool``, "Element addresses");
- a fused projection's slices after the first (k and v of Phi-3's ``qkv_proj``, up of ``gate_up_proj``) repeat
  the first slice's A; their A regions are not yet written;
- the values are not yet checked finite.

:class:`FinishOps` lists the copies that turn such an image into the pool image: ops ``(src, dst, rows, cols,
transpose)`` in elements relative to the image start. ``transpose == 0`` copies ``rows * cols`` contiguous
elements; ``transpose == 1`` reads ``[rows, cols]`` row-major at ``src`` and writes ``[cols, rows]`` row-major at
``dst``. The ops' destinations partition the image (every element written exactly once); each op reads its source
from the same *group* (one (layer, projection) of the image). Every value an op reads is checked finite; the first
op (in order) found to hold a NaN or +-inf is reported, by its index, so the caller can name the file tensor it came
from (``keys``).

On the GPU the raw image is copied straight into its pool extent (one host -> GPU copy at copy speed) and finished
**in place** (:class:`InPlacePlan`): the raw reader puts each transposed op's source where its destination is
(``src == dst``), so a transpose first moves its source to a scratch buffer (*gather*) and then writes the
destination from there (*transpose*); a copy op's source is never any op's destination except its own (``src ==
dst``: a check, nothing stored; or a fused projection's shared A, read from the first slice's region). So the
finish is one launch of the copies, then a gather and a transpose launch per scratch-sized chunk of the
transposes, all on one stream, and it can be queued whenever the copy has landed: the adapter cache queues it on
the compute stream at a step boundary, where a kernel is never starved by the compute stream's GEMMs
(bench/README.md, "Session 12" and "Session 13").

``finish_torch`` is the reference (and the CPU pools' path); ``multilora.kernels.triton_image_finish`` is the GPU
kernel (tiles of ``InPlacePlan``), compared with it bit for bit in ``tests/test_image_finish.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import torch

#: the pool's scratch buffer for in-place transposes, in elements (64 MiB of bf16): every lora_B of a Llama-3-8B
#: rank-16 image (21 Mi elements) in one chunk, so such an image finishes in three launches; lowered to the most
#: lora_B elements an adapter of the pool's max rank has, raised to its largest single lora_B
#: (``multilora.memory.pool.scratch_elems``)
SCRATCH_ELEMS = 32 << 20

#: elements per program of the kernel (a tile of BLOCK_ROWS x BLOCK_COLS; 8 warps)
TILE_ELEMS = 16384
NUM_WARPS = 8


@dataclass(frozen=True)
class FinishOps:
    """The finish of one raw image layout (made once per copy plan: adapters whose config and header bytes
    are equal share the object; ``content_key`` is equal for every equal layout).

    ``ops``: int64 ``[n, 5]`` ``(src, dst, rows, cols, transpose)``, element offsets relative to the image start
    (module docstring). ``groups``: int64 ``[g, 3]`` ``(start, end, first op)`` in image order: the ops of group
    i are ``ops[groups[i, 2] : groups[i + 1, 2]]`` and read and write only ``[start, end)``; the groups tile
    ``[0, numel)``. ``keys``: per op, the file tensor its values come from ("" for zero padding). ``numel``:
    elements of the image.
    """

    ops: torch.Tensor
    groups: torch.Tensor
    keys: tuple[str, ...]
    numel: int
    _plans: dict = field(default_factory=dict, compare=False, repr=False)  # (scratch, block_cols) -> InPlacePlan

    def __post_init__(self) -> None:
        if self.ops.dtype != torch.int64 or self.ops.dim() != 2 or self.ops.shape[1] != 5:
            raise ValueError(f"FinishOps: ops must be int64 [n, 5], got {self.ops.dtype} {tuple(self.ops.shape)}")
        if len(self.keys) != self.ops.shape[0]:
            raise ValueError(f"FinishOps: keys must name every op ({self.ops.shape[0]}), got {len(self.keys)}")

    @cached_property
    def content_key(self) -> bytes:
        """The ops' and groups' bytes: equal for equal layouts (what device-side caches key on)."""
        return self.ops.numpy().tobytes() + b"|" + self.groups.numpy().tobytes() + b"|" + str(self.numel).encode()

    @property
    def max_cols(self) -> int:
        """The widest transposed source (the largest rank of the adapter's lora_B), 0 without transposes."""
        tr = self.ops[:, 4] == 1
        return int(self.ops[tr, 3].max()) if bool(tr.any()) else 0

    @property
    def largest_transpose(self) -> int:
        """Elements of the largest transposed op (one lora_B slice): the smallest scratch that can finish this image."""
        tr = self.ops[:, 4] == 1
        return int((self.ops[tr, 2] * self.ops[tr, 3]).max()) if bool(tr.any()) else 0

    def inplace_plan(self, scratch_elems: int, block_cols: int) -> "InPlacePlan":
        """The launches and tiles that finish this layout in place with a scratch of ``scratch_elems`` elements and
        the kernel's ``block_cols`` (cached on the object).

        Raises:
            ValueError: a transposed op larger than ``scratch_elems``, or one wider than ``block_cols``.
        """
        key = (scratch_elems, block_cols)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = _inplace_plan(self, scratch_elems, block_cols)
        return plan


#: the kinds of ``InPlacePlan`` launches (what ``src`` and ``dst`` of their tiles are relative to)
IN_PLACE, GATHER, TRANSPOSE = 0, 1, 2


@dataclass(frozen=True)
class InPlacePlan:
    """``FinishOps`` as launches over a raw image that already sits where its pool image goes.

    ``launches``: ``(kind, first tile, end tile)`` in the order they must run (one stream):
    ``IN_PLACE`` (the copy ops: ``src`` and ``dst`` relative to the image start; a tile whose ``src == dst`` only
    checks), then per chunk of transposes ``GATHER`` (plain copies of the transposed sources from the image into
    the scratch: ``src`` relative to the image, ``dst`` to the scratch) and ``TRANSPOSE`` (``src`` relative to the
    scratch, ``dst`` to the image). ``tiles``: int64 ``[t, 7]`` ``(src, dst, rows, cols, transpose, first row,
    op)``: a program finishes rows ``[first row, first row + block_rows)`` of its op (for a copy, rows of
    ``block_cols`` elements); ``op`` indexes ``FinishOps.ops`` (what a failed check reports). ``block_rows`` /
    ``block_cols``: the tile shape (``block_rows * block_cols == TILE_ELEMS`` unless a transposed source is
    wider). ``scratch_elems``: the most scratch elements one chunk uses.
    """

    launches: tuple[tuple[int, int, int], ...]
    tiles: torch.Tensor
    block_rows: int
    block_cols: int
    scratch_elems: int


def block_cols_for(max_rank: int) -> int:
    """The kernel's tile width for a pool of ``max_rank``: the next power of two >= the rank, at least 16 (one
    compiled variant per pool)."""
    return max(16, 1 << (max(int(max_rank), 1) - 1).bit_length())


def _tiles(ops: np.ndarray, op_index: np.ndarray, block_rows: int, block_cols: int) -> np.ndarray:
    """Kernel tiles ``(src, dst, rows, cols, transpose, first row, op)`` of the ops ``ops`` (``[n, 5]``; ``op_index``
    their indices in ``FinishOps.ops``): a copy is rows of ``block_cols`` elements, a transpose walks its source
    rows, ``block_rows`` per tile."""
    span = np.where(ops[:, 4] == 1, ops[:, 2], -(-(ops[:, 2] * ops[:, 3]) // block_cols))
    per = -(-span // block_rows)
    of = np.repeat(np.arange(ops.shape[0]), per)
    first = np.concatenate([[0], np.cumsum(per)[:-1]]) if ops.shape[0] else np.zeros(0, np.int64)
    row0 = (np.arange(of.size) - np.repeat(first, per)) * block_rows
    return np.concatenate([ops[of], row0[:, None], op_index[of][:, None]], axis=1).astype(np.int64).reshape(-1, 7)


def _check_in_place(ops: np.ndarray) -> None:
    """Raise ValueError unless these ops can run in place in ``InPlacePlan`` order: every transpose reads where it
    writes (``src == dst``, moved out through the scratch), and no copy that moves values (``src != dst``) reads
    elements that a moving op (such a copy, or a transpose) writes."""
    tr = ops[:, 4] == 1
    if bool((ops[tr, 0] != ops[tr, 1]).any()):
        raise ValueError("FinishOps.inplace_plan: a transposed op reads elsewhere than it writes (the raw reader puts "
                         "lora_B where its transpose goes); this layout cannot be finished in place")
    size = ops[:, 2] * ops[:, 3]
    moving = tr | (ops[:, 0] != ops[:, 1])
    lo = ops[moving, 1]
    order = np.argsort(lo)
    lo, hi = lo[order], (ops[moving, 1] + size[moving])[order]  # disjoint (destinations partition the image)
    readers = np.nonzero(~tr & (ops[:, 0] != ops[:, 1]))[0]
    s0, s1 = ops[readers, 0], ops[readers, 0] + size[readers]
    k = np.searchsorted(lo, s1, side="left") - 1  # the last moving destination starting before a source ends
    clash = (k >= 0) & (hi[np.maximum(k, 0)] > s0) & (s1 > s0)
    if bool(clash.any()):
        raise ValueError(f"FinishOps.inplace_plan: op {int(readers[np.argmax(clash)])} copies from elements another op "
                         "moves; this layout cannot be finished in place")


def _inplace_plan(fin: FinishOps, scratch_elems: int, block_cols: int) -> InPlacePlan:
    if fin.largest_transpose > scratch_elems:
        raise ValueError(f"FinishOps.inplace_plan: a lora_B of {fin.largest_transpose} elements does not fit a scratch "
                         f"of {scratch_elems}")
    if fin.max_cols > block_cols:
        raise ValueError(f"FinishOps.inplace_plan: a lora_B of rank {fin.max_cols} is wider than "
                         f"block_cols={block_cols}")
    block_rows = max(1, TILE_ELEMS // block_cols)
    ops = fin.ops.numpy()
    _check_in_place(ops)
    tr = np.nonzero(ops[:, 4] == 1)[0]
    cp = np.nonzero(ops[:, 4] == 0)[0]
    pieces = [(IN_PLACE, _tiles(ops[cp], cp, block_rows, block_cols))]
    size = ops[:, 2] * ops[:, 3]
    used_most, i = 0, 0
    while i < tr.size:  # chunks of consecutive transposes whose sources fit the scratch together
        j, used = i, 0
        while j < tr.size and used + size[tr[j]] <= scratch_elems:
            used += int(size[tr[j]])
            j += 1
        idx = tr[i:j]
        at = np.concatenate([[0], np.cumsum(size[idx])[:-1]]).astype(np.int64)
        one, zero = np.ones_like(at), np.zeros_like(at)
        gather = np.stack([ops[idx, 0], at, size[idx], one, zero], axis=1)  # a plain copy of rows * cols elements
        turn = np.stack([at, ops[idx, 1], ops[idx, 2], ops[idx, 3], one], axis=1)
        pieces += [(GATHER, _tiles(gather, idx, block_rows, block_cols)),
                   (TRANSPOSE, _tiles(turn, idx, block_rows, block_cols))]
        used_most, i = max(used_most, used), j
    launches, n = [], 0
    for kind, t in pieces:
        if t.shape[0]:
            launches.append((kind, n, n + t.shape[0]))
            n += t.shape[0]
    tiles = np.concatenate([t for _, t in pieces])  # (never empty: the IN_PLACE piece is always there)
    return InPlacePlan(launches=tuple(launches), tiles=torch.from_numpy(np.ascontiguousarray(tiles)),
                       block_rows=block_rows, block_cols=block_cols, scratch_elems=used_most)


def finish_torch(src: torch.Tensor, dst: torch.Tensor, fin: FinishOps) -> int:
    """Finish the raw image ``src`` into ``dst`` with torch ops (the reference; the CPU pools' path).

    Args:
        src: the raw image, 1-D ``[fin.numel]`` (any floating dtype, any device).
        dst: the destination, 1-D ``[fin.numel]``, same dtype and device, not overlapping ``src``.

    Returns:
        0 if every value read is finite, else 1 + the index of the first op (in ``fin.ops`` order) whose source
        holds a NaN or +-inf; ``dst`` is fully written either way.

    Raises:
        ValueError: ``src`` / ``dst`` of another size, dtype or device.
    """
    for name, t in (("src", src), ("dst", dst)):
        if t.dim() != 1 or t.numel() != fin.numel:
            raise ValueError(f"finish_torch: {name} must be 1-D of {fin.numel} elements, got {tuple(t.shape)}")
    if src.dtype != dst.dtype or src.device != dst.device:
        raise ValueError(f"finish_torch: src and dst must share dtype and device, got {src.dtype} on {src.device} "
                         f"and {dst.dtype} on {dst.device}")
    bad = 0
    for i, (s, d, rows, cols, tr) in enumerate(fin.ops.tolist()):
        x = src[s : s + rows * cols]
        if tr:
            dst[d : d + rows * cols].view(cols, rows).copy_(x.view(rows, cols).t())
        else:
            dst[d : d + rows * cols].copy_(x)
        if not bad and x.numel() and not bool(torch.isfinite(x).all()):
            bad = i + 1
    return bad


def finish_ops(ops: list[tuple[int, int, int, int, int]], groups: list[tuple[int, int, int]], keys: list[str],
               numel: int) -> FinishOps:
    """A :class:`FinishOps` from Python lists (the reader's plan builds it once per layout).

    Raises:
        ValueError: destinations that do not tile ``[0, numel)`` exactly, or an op outside its group.
    """
    o = torch.tensor(ops, dtype=torch.int64).reshape(-1, 5)
    g = torch.tensor(groups, dtype=torch.int64).reshape(-1, 3)
    n = o[:, 2] * o[:, 3]
    order = torch.argsort(o[:, 1])
    d, nn = o[order, 1], n[order]
    if numel and (o.shape[0] == 0 or int(d[0]) != 0 or int(d[-1] + nn[-1]) != numel
                  or bool((d[1:] != d[:-1] + nn[:-1]).any())):
        raise ValueError(f"finish_ops: the ops' destinations must tile [0, {numel}) exactly")
    bounds = g[:, :2].tolist()
    for k, (lo, hi) in enumerate(bounds):
        op_hi = int(g[k + 1, 2]) if k + 1 < g.shape[0] else o.shape[0]
        for s, dd, rows, cols, _ in o[int(g[k, 2]) : op_hi].tolist():
            if not (lo <= s and s + rows * cols <= hi and lo <= dd and dd + rows * cols <= hi):
                raise ValueError(f"finish_ops: op (src {s}, dst {dd}, {rows} x {cols}) leaves its group [{lo}, {hi})")
    return FinishOps(ops=o, groups=g, keys=tuple(keys), numel=numel)
