"""The Triton kernel of ``multilora.kernels.image_finish``: a raw adapter image finished in place in its pool
extent, one launch per ``InPlacePlan`` launch.

One program per tile of ``InPlacePlan.tiles``: ``block_rows`` x ``block_cols`` elements of one op, read at ``src``
of ``src_ptr`` and written at ``dst`` of ``dst_ptr`` (the image's place in the pool buffer, or the scratch, as the
launch's kind says: the image start is in the pointer, a tensor view, so no integer argument ever exceeds 32 bits
and one compiled variant serves every place in a pool of any size). A copy op's tile is ``block_rows * block_cols``
contiguous elements (a 1-D range), not stored again when the launch is in place and it reads where it writes; a
transpose op's tile is ``block_rows`` source rows of its ``cols`` (the rank, <= ``block_cols``) elements, turned in
registers (``tl.trans``) and stored as ``cols`` runs of ``block_rows`` contiguous elements. Each value is checked
finite as ``x * 0 == 0`` in float32 (false for NaN and +-inf, IEEE 754); a tile that finds one records its op with
an atomic min on the flag (``int32``, set to ``2**31 - 1`` before the launches), so the flag ends as the first such
op in op order. Values are moved, never converted: the pool holds the bits the file holds.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from multilora.kernels.image_finish import GATHER, IN_PLACE, NUM_WARPS, TRANSPOSE, InPlacePlan

NO_BAD_OP = 2**31 - 1


# the integers vary per launch and slot: not specialised (one compiled variant per dtype and tile width; the
# pointers are the scratch and views of the pool buffer at page boundaries, always 16-byte aligned)
@triton.jit(do_not_specialize=["tile0", "flag_index", "in_place"])
def _finish_kernel(src_ptr, dst_ptr, tiles_ptr, flag_ptr, tile0, flag_index, in_place,
                   BR: tl.constexpr, BC: tl.constexpr):
    t = tl.program_id(0).to(tl.int64) + tile0
    row = tiles_ptr + t * 7
    src = tl.load(row)
    dst = tl.load(row + 1)
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
        if (in_place == 0) | (src != dst):  # (in place and reading where it writes: a check only)
            tl.store(dst_ptr + dst + o, xc, mask=mc)
        bad = tl.max(((xc.to(tl.float32) * 0.0) != 0.0).to(tl.int32), axis=0)
    if bad > 0:
        tl.atomic_min(flag_ptr + flag_index, op.to(tl.int32))


def finish_inplace(buffer: torch.Tensor, image_start: int, plan: InPlacePlan, tiles: torch.Tensor,
                   scratch: torch.Tensor, flags: torch.Tensor, flag_index: int = 0) -> None:
    """Finish the raw image at ``buffer[image_start : image_start + numel]`` in place: ``plan``'s launches, in order,
    on the current stream (no host sync; nothing else may touch the image or ``scratch`` until they have run).

    Args:
        buffer: the pool buffer, 1-D (CUDA, or CPU under ``TRITON_INTERPRET=1``).
        image_start: the element where the image starts in ``buffer``.
        plan, tiles: ``FinishOps.inplace_plan(...)`` and its ``tiles`` on ``buffer``'s device (the caller keeps them).
        scratch: 1-D, ``buffer``'s dtype and device, at least ``plan.scratch_elems`` elements.
        flags, flag_index: ``flags[flag_index]`` (int32, on the device) must be ``NO_BAD_OP`` before the call; after
            the launches, the index of the first op that read a non-finite value, else still ``NO_BAD_OP``.

    Raises:
        ValueError: ``scratch`` of another dtype or device, or smaller than the plan's chunks.
    """
    if scratch.dtype != buffer.dtype or scratch.device != buffer.device or scratch.numel() < plan.scratch_elems:
        raise ValueError(f"finish_inplace: scratch must be {buffer.dtype} on {buffer.device} with at least "
                         f"{plan.scratch_elems} elements, got {scratch.dtype} on {scratch.device} with "
                         f"{scratch.numel()}")
    image = buffer[image_start:]  # (the offset in the pointer: the kernel's integers stay small)
    for kind, t0, t1 in plan.launches:
        if kind == IN_PLACE:
            src, dst, same = image, image, 1
        elif kind == GATHER:
            src, dst, same = image, scratch, 0
        else:
            assert kind == TRANSPOSE, kind
            src, dst, same = scratch, image, 0
        _finish_kernel[(t1 - t0,)](src, dst, tiles, flags, t0, flag_index, same,
                                   BR=plan.block_rows, BC=plan.block_cols, num_warps=NUM_WARPS)
