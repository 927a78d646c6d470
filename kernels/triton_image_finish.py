"""The Triton kernel of ``multilora.kernels.image_finish``: one chunk of a raw adapter image, from the staging
buffer into the pool, in one launch.

One program per tile of ``FinishPlan.tiles``: ``block_rows`` x ``block_cols`` elements of one op, read from the
staging buffer (``src - chunk start``) and written to the pool buffer (``dst + image start``). A copy op's tile
is ``block_rows * block_cols`` contiguous elements (a 1-D range); a transpose op's tile is ``block_rows`` source
rows of its ``cols`` (the rank, <= ``block_cols``) elements, turned in registers (``tl.trans``) and stored as
``cols`` runs of ``block_rows`` contiguous elements. Each value is checked finite as
``x * 0 == 0`` in float32 (false for NaN and +-inf, IEEE 754); a tile that finds one records its op with an
atomic min on the flag (``int32``, set to ``2**31 - 1`` before the chunks), so the flag ends as the first such
op in op order. Values are moved, never converted: the pool holds the bits the file holds.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from multilora.kernels.image_finish import NUM_WARPS, FinishPlan

NO_BAD_OP = 2**31 - 1


# the offsets vary per chunk, image and slot: not specialised (one compiled variant per dtype and tile width; the
# pointer arguments are whole tensors' bases, always 16-byte aligned)
@triton.jit(do_not_specialize=["tile0", "flag_index", "src_shift", "dst_base"])
def _finish_kernel(src_ptr, dst_ptr, tiles_ptr, flag_ptr, tile0, flag_index, src_shift, dst_base,
                   BR: tl.constexpr, BC: tl.constexpr):
    t = tl.program_id(0).to(tl.int64) + tile0
    row = tiles_ptr + t * 7
    src = tl.load(row) - src_shift
    dst = tl.load(row + 1) + dst_base
    rows = tl.load(row + 2)
    cols = tl.load(row + 3)
    tr = tl.load(row + 4)
    r0 = tl.load(row + 5)
    op = tl.load(row + 6)
    # (Triton wants a value assigned in both branches to have one type: each branch reduces its own check)
    if tr != 0:
        # rows [r0, r0 + BR) of a [rows, cols] source, stored transposed: the tile is turned in registers
        # (tl.trans), so the loads walk source rows and the stores walk destination rows, both contiguous
        ri = r0 + tl.arange(0, BR).to(tl.int64)
        ci = tl.arange(0, BC).to(tl.int64)
        mt = (ri[:, None] < rows) & (ci[None, :] < cols)
        xt = tl.load(src_ptr + src + ri[:, None] * cols + ci[None, :], mask=mt, other=0.0)
        tl.store(dst_ptr + dst + ci[:, None] * rows + ri[None, :], tl.trans(xt), mask=tl.trans(mt))
        bad = tl.max(tl.max(((xt.to(tl.float32) * 0.0) != 0.0).to(tl.int32), axis=1), axis=0)
    else:
        # a contiguous copy: elements [r0 * BC, (r0 + BR) * BC) of rows * cols
        o = r0 * BC + tl.arange(0, BR * BC).to(tl.int64)
        mc = o < rows * cols
        xc = tl.load(src_ptr + src + o, mask=mc, other=0.0)
        tl.store(dst_ptr + dst + o, xc, mask=mc)
        bad = tl.max(((xc.to(tl.float32) * 0.0) != 0.0).to(tl.int32), axis=0)
    if bad > 0:
        tl.atomic_min(flag_ptr + flag_index, op.to(tl.int32))


def finish_chunk(staging: torch.Tensor, buffer: torch.Tensor, image_start: int, plan: FinishPlan,
                 tiles: torch.Tensor, chunk: int, flags: torch.Tensor, flag_index: int = 0) -> None:
    """Launch the kernel for ``plan.chunks[chunk]``: the chunk's raw elements, already in ``staging[: end -
    start]``, finished into ``buffer[image_start + start : image_start + end]``.

    Args:
        staging, buffer: 1-D CUDA tensors of one dtype.
        tiles: ``plan.tiles`` on the device (the caller keeps it there).
        flags, flag_index: ``flags[flag_index]`` (int32, on the device) is ``NO_BAD_OP`` before the image's first
            chunk; after the last, the index of the first op that read a non-finite value, else still
            ``NO_BAD_OP``.
    """
    start, _, t0, t1 = plan.chunks[chunk]
    if t1 > t0:
        _finish_kernel[(t1 - t0,)](staging, buffer, tiles, flags, t0, flag_index, start, image_start,
                                   BR=plan.block_rows, BC=plan.block_cols, num_warps=NUM_WARPS)


def finish_image(src: torch.Tensor, buffer: torch.Tensor, image_start: int, plan: FinishPlan, tiles: torch.Tensor,
                 staging: torch.Tensor, flags: torch.Tensor, flag_index: int = 0) -> None:
    """Finish the raw image ``src`` (1-D, pinned host memory for an asynchronous copy) into ``buffer`` from element
    ``image_start``, chunk by chunk: each chunk copied into ``staging`` (``non_blocking``), then one kernel launch
    (``finish_chunk``), all on the current stream, which orders each copy after the previous chunk's kernel.
    ``flags[flag_index]`` as for ``finish_chunk`` (set it to ``NO_BAD_OP`` first).

    Raises:
        ValueError: ``staging`` smaller than the plan's chunks, or ``src`` not of the plan's image size.
    """
    if plan.chunks and plan.chunks[-1][1] != src.numel():
        raise ValueError(f"finish_image: src has {src.numel()} elements, the plan's image {plan.chunks[-1][1]}")
    for i, (c0, c1, _, _) in enumerate(plan.chunks):
        if c1 - c0 > staging.numel():
            raise ValueError(f"finish_image: a chunk of {c1 - c0} elements does not fit staging of {staging.numel()}")
        staging[: c1 - c0].copy_(src[c0:c1], non_blocking=True)
        finish_chunk(staging, buffer, image_start, plan, tiles, i, flags, flag_index)
