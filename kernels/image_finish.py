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
``dst``. The ops' destinations partition the image (every element written exactly once, so one launch may run
them all in any order); each op reads its source from the same *group* (one (layer, projection) of the image: a
contiguous run of whole pages), so the image can be finished group-aligned chunk by chunk through a staging
buffer smaller than the image. Every value an op reads is checked finite; the first op (in order) found to hold
a NaN or +-inf is reported, by its index, so the caller can name the file tensor it came from (``keys``).

``finish_torch`` is the reference (and the CPU pools' path); ``multilora.kernels.triton_image_finish`` is the GPU
kernel (tiles of ``FinishPlan``), compared with it bit for bit in ``tests/test_image_finish.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import torch

#: the most elements the pool stages at a time (64 MiB of bf16): two chunks per Llama-3-8B rank-16 image, each a host
#: -> GPU copy followed by one kernel launch (every launch may wait for SMs behind the compute stream's kernels, so
#: fewer is better: 6 chunks of 16 MiB ran at 4.4 GB/s under an engine's prefill in session 12); lowered to the
#: largest image a pool admits, raised to its largest group (``multilora.memory.pool.staging_elems``)
STAGING_ELEMS = 32 << 20

#: elements per program of the kernel (a tile of BLOCK_ROWS x BLOCK_COLS; 8 warps)
TILE_ELEMS = 16384
NUM_WARPS = 8


@dataclass(frozen=True)
class FinishOps:
    """The device finish of one raw image layout (made once per copy plan: adapters whose config and header bytes
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
    _plans: dict = field(default_factory=dict, compare=False, repr=False)  # (staging, block_cols) -> FinishPlan

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
    def largest_group(self) -> int:
        """Elements of the largest group: the smallest staging buffer that can finish this image."""
        g = self.groups
        return int((g[:, 1] - g[:, 0]).max()) if g.shape[0] else 0

    def plan(self, staging_elems: int, block_cols: int) -> "FinishPlan":
        """The tiles of this layout for a staging buffer of ``staging_elems`` and the kernel's ``block_cols``
        (cached on the object).

        Raises:
            ValueError: a group larger than ``staging_elems``, or a transposed source wider than ``block_cols``.
        """
        key = (staging_elems, block_cols)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = _plan(self, staging_elems, block_cols)
        return plan


@dataclass(frozen=True)
class FinishPlan:
    """``FinishOps`` cut into staging-sized chunks of whole groups, each op into kernel tiles.

    ``chunks``: ``(start, end, first tile, end tile)`` per chunk (image elements ``[start, end)`` go through the
    staging buffer together). ``tiles``: int64 ``[t, 7]`` ``(src, dst, rows, cols, transpose, first row, op)``:
    a program finishes rows ``[first row, first row + block_rows)`` of its op (for a copy, rows of
    ``block_cols`` elements), reading ``src`` relative to the image start. ``block_rows`` / ``block_cols``: the
    tile shape (``block_rows * block_cols == TILE_ELEMS`` unless a transposed source is wider).
    """

    chunks: tuple[tuple[int, int, int, int], ...]
    tiles: torch.Tensor
    block_rows: int
    block_cols: int


def block_cols_for(max_rank: int) -> int:
    """The kernel's tile width for a pool of ``max_rank``: the next power of two >= the rank, at least 16 (one
    compiled variant per pool)."""
    return max(16, 1 << (max(int(max_rank), 1) - 1).bit_length())


def _plan(fin: FinishOps, staging_elems: int, block_cols: int) -> FinishPlan:
    if fin.largest_group > staging_elems:
        raise ValueError(f"FinishOps.plan: a group of {fin.largest_group} elements does not fit a staging buffer of "
                         f"{staging_elems}")
    if fin.max_cols > block_cols:
        raise ValueError(f"FinishOps.plan: a lora_B of rank {fin.max_cols} is wider than block_cols={block_cols}")
    block_rows = max(1, TILE_ELEMS // block_cols)
    ops = fin.ops.numpy()
    n_ops = ops.shape[0]
    # tiles per op: a copy is rows of block_cols elements; a transpose walks its source rows
    span = np.where(ops[:, 4] == 1, ops[:, 2], -(-(ops[:, 2] * ops[:, 3]) // block_cols))
    per = -(-span // block_rows)
    op_of = np.repeat(np.arange(n_ops), per)
    first = np.concatenate([[0], np.cumsum(per)[:-1]]) if n_ops else np.zeros(0, np.int64)
    row0 = (np.arange(op_of.size) - np.repeat(first, per)) * block_rows
    tiles = np.concatenate([ops[op_of], row0[:, None], op_of[:, None]], axis=1).astype(np.int64)
    tile_start = np.concatenate([[0], np.cumsum(per)]).astype(np.int64)  # first tile of op i; the end at n_ops
    groups = fin.groups.numpy()
    chunks = []
    i = 0
    while i < groups.shape[0]:
        start = int(groups[i, 0])
        j = i
        while j + 1 < groups.shape[0] and int(groups[j + 1, 1]) - start <= staging_elems:
            j += 1
        end = int(groups[j, 1])
        op_lo = int(groups[i, 2])
        op_hi = int(groups[j + 1, 2]) if j + 1 < groups.shape[0] else n_ops
        chunks.append((start, end, int(tile_start[op_lo]), int(tile_start[op_hi])))
        i = j + 1
    return FinishPlan(chunks=tuple(chunks), tiles=torch.from_numpy(tiles), block_rows=block_rows,
                      block_cols=block_cols)


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
