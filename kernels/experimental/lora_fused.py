"""One-launch LoRA shrink + expand (decode): tried, tested, OFF by default — no product code calls it.

Semantics: those of ``lora_apply`` (``multilora.kernels.lora``)::

    for every token t with s = token_slots[t] >= 0 and r = ranks_i[s] > 0:
        y[t, c_i : c_i + d_out_i] += scalings_i[s] * (x[t] @ A_i[s].T) @ B_i[s].T
    rows with s == -1 (and slices with r == 0) are never read or written.

Each program owns one chunk of the plan (``LoRAPlan``) and a run of ``tiles`` output tiles of one slice and
recomputes the rank-r shrink of its chunk for them: no fp32 intermediate in HBM and one launch instead of two.

Why it is off: on an H200 (``bench/bench_decode_fused.py``, ``bench/results/decode_fused.json``) it was slower
than the two launches of ``multilora.kernels.triton_sgmv`` on every decode case — T = 1 q/k/v 12.1 vs 7.6 us,
T = 512 distinct 206 vs 142 us, the Llama-3-8B layer +64..84% vs +26..40% over the base GEMMs. Without
split-K each program walks all of d_in serially, and re-reading A per output tile multiplies L2 traffic,
which costs more than the launch it saves.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from multilora.kernels.lora import LoRAPlan, LoRASlices
from multilora.kernels.triton_sgmv import (_add_scaled, _chunk_tokens, _dot, _rank_rows, _shrink_tile, _slot_offset,
                                          _tile_slice, check_io, num_chunks, tile_ends)


@triton.jit
def _lora_fused_kernel(
    # pointers
    y_ptr, x_ptr, buf_ptr, offa_ptr, offb_ptr, ranks_ptr, scal_ptr, tab_ptr, w_ptr, chunks_ptr,
    # sizes
    d_in, e0, e1, e2, meta_stride,
    # strides
    stride_xm, stride_ym, stride_c,
    # meta
    NUM_SLICES: tl.constexpr, RMAX: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, TILES: tl.constexpr, ALIGN: tl.constexpr,
    IEEE: tl.constexpr,
):
    """One program = one chunk x ``TILES`` output tiles of one slice: shrink (full K) then expand, no
    intermediate in HBM. Rank tile 0 of ``v`` stays in registers; further rank tiles (r > BLOCK_R) go
    through the program's private rows of the fp32 workspace ``w``."""
    chunk = tl.program_id(0)
    grp = tl.program_id(1)  # tile groups of all slices, slice after slice
    slot = tl.load(chunks_ptr + stride_c + chunk)  # chunk_slot
    sid, g, d_out, col = _tile_slice(tab_ptr, grp, e0, e1, e2, NUM_SLICES, ALIGN)
    if slot < 0:
        return
    r = tl.load(ranks_ptr + sid * meta_stride + slot)
    off_a = _slot_offset(offa_ptr, sid, meta_stride, slot, ALIGN)
    off_b = _slot_offset(offb_ptr, sid, meta_stride, slot, ALIGN)
    if r == 0:
        return
    scale = tl.load(scal_ptr + sid * meta_stride + slot)
    tok, m_mask = _chunk_tokens(chunks_ptr, stride_c, chunk, BLOCK_M)
    offs_r = tl.arange(0, BLOCK_R)
    x_rows = x_ptr + tok[:, None] * stride_xm  # [BLOCK_M, 1]
    pid = chunk.to(tl.int64) * tl.num_programs(1) + grp
    w_rows = w_ptr + (pid * BLOCK_M + tl.arange(0, BLOCK_M)[:, None]) * (RMAX - BLOCK_R)  # rank tiles 1..
    # shrink: v[m, j] = x[tok_m] . A[j]
    v0 = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for j0 in range(0, r, BLOCK_R):
        j = j0 + offs_r
        j_mask = j < r
        a_rows = _rank_rows(buf_ptr, off_a, j, d_in)
        acc = _shrink_tile(x_rows, a_rows, m_mask, j_mask, 0, d_in, BLOCK_M, BLOCK_R, BLOCK_K, IEEE)
        if j0 == 0:
            v0 = acc
        else:
            tl.store(w_rows + (j - BLOCK_R)[None, :], acc, mask=j_mask[None, :])
    if r > BLOCK_R:
        tl.debug_barrier()  # the workspace rows written above are read back by other threads of this program
    # expand: y[tok, col + n] += scale * v @ B^T[:, n], for this program's TILES tiles
    j_mask = offs_r < r
    b0_rows = _rank_rows(buf_ptr, off_b, offs_r, d_out)
    v0 = v0.to(y_ptr.dtype.element_ty)  # IEEE: fp32 already
    for t in range(TILES):
        n = (g * TILES + t) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = n < d_out
        bt = tl.load(b0_rows[:, None] + n[None, :], mask=j_mask[:, None] & n_mask[None, :], other=0.0)
        out = _dot(v0, bt, IEEE)
        for j0 in range(BLOCK_R, r, BLOCK_R):
            jj = j0 + offs_r
            jj_mask = jj < r
            b_rows = _rank_rows(buf_ptr, off_b, jj, d_out)
            bt = tl.load(b_rows[:, None] + n[None, :], mask=jj_mask[:, None] & n_mask[None, :], other=0.0)
            vt = tl.load(w_rows + (jj - BLOCK_R)[None, :], mask=jj_mask[None, :], other=0.0)
            out += _dot(vt.to(bt.dtype), bt, IEEE)
        _add_scaled(y_ptr, stride_ym, tok, m_mask, col + n, n_mask, scale, out)


def lora_fused(y: torch.Tensor, x: torch.Tensor, slices: LoRASlices, plan: LoRAPlan, *, block_n: int = 256,
               tiles: int = 1, block_k: int | None = None, num_warps: int = 4,
               num_stages: int | None = None) -> torch.Tensor:
    """``y[t, c_i + n] += scalings_i[s] * (x[t] @ A_i[s].T) @ B_i[s].T`` for every token with slot ``s >= 0``, in
    ONE launch; rows with slot -1 are left bit for bit.

    Args:
        y: ``[T, slices.d_out]`` fp16/bf16/fp32 (the pool's dtype); updated in place.
        x: ``[T, slices.d_in]``, same dtype and device.
        slices, plan: the fused slices (``lora_slices``) and the step's ``LoRAPlan`` (``T = plan.num_tokens``).
        block_n, tiles: each program writes ``tiles`` tiles of ``block_n`` columns of one slice; the grid is
            ``(num_chunks, sum_i cdiv(d_out_i, block_n * tiles))``.
        block_k, num_warps, num_stages: tile overrides.

    Returns:
        ``y``.

    Raises:
        ValueError: shapes that disagree with the slices or the plan; dtypes, devices or strides as
            ``lora_apply_triton``.
    """
    check_io(slices, plan, x=x, y=y)
    T, d_in = x.shape
    if tuple(x.shape) != (plan.num_tokens, slices.d_in) or tuple(y.shape) != (plan.num_tokens, slices.d_out):
        raise ValueError(f"x, y: expected [{plan.num_tokens}, {slices.d_in}] and [{plan.num_tokens}, {slices.d_out}], "
                         f"got {tuple(x.shape)} and {tuple(y.shape)}")
    if not plan.has_lora or T == 0:
        return y
    rmax, block_r = slices.max_rank_rows, 16
    if block_k is None:
        block_k = 64 if x.device.type == "cpu" else 256
    block_k = min(block_k, max(16, triton.next_power_of_2(d_in)))
    S = slices.num_slices
    grid = (num_chunks(plan, slices), sum(triton.cdiv(vw.d_out, block_n * tiles) for vw in slices.views))
    # private fp32 rows for rank tiles beyond the first (only touched by slots with r > 16)
    w_numel = grid[0] * grid[1] * plan.block_m * (rmax - block_r) if rmax > block_r else 1
    work = torch.empty(w_numel, dtype=torch.float32, device=x.device)
    extra = {} if num_stages is None else {"num_stages": num_stages}
    _lora_fused_kernel[grid](
        y, x, slices.buffer, slices.offsets_a, slices.offsets_b, slices.ranks, slices.scalings, slices.table, work,
        plan.chunks, d_in, *tile_ends(slices, block_n * tiles), slices.meta_stride,
        x.stride(0), y.stride(0), plan.chunks.stride(0),
        NUM_SLICES=S, RMAX=max(rmax, block_r), BLOCK_M=plan.block_m,
        BLOCK_N=block_n, BLOCK_R=block_r, BLOCK_K=block_k, TILES=tiles, ALIGN=slices.align,
        IEEE=x.dtype == torch.float32, num_warps=num_warps, **extra,
    )
    return y
