"""Triton SGMV kernels: LoRA shrink and expand for a batch of per-token adapter slots, read from the paged pool.

Semantics (``lora_apply`` in ``multilora.kernels.lora``; slice ``i`` owns columns ``[c_i, c_i + d_out_i)`` of y)::

    for every token t with s = token_slots[t] >= 0 and r = ranks_i[s] > 0:
        v[t, i, :r]                = x[t] @ A_i[s].T                            # shrink, fp32   [r]
        y[t, c_i : c_i + d_out_i] += scalings_i[s] * v[t, i, :r] @ B_i[s].T     # expand, in place
    rows with s == -1 (and slices with r == 0) are never read or written.

``A_i[s]`` row ``j`` and ``B_i[s]^T`` row ``j`` live on page ``page_table[s, j // R]`` at row ``j % R``
(layout and worked example: ``multilora.memory.pool``), so a rank tile may span pages and every rank-row
finds its own page. Rank loops stop at the slot's real rank ``r``: bytes and work are proportional to ``r``.

One kernel family serves prefill (SGMV) and decode (BGMV). Tokens are stably sorted by slot and cut into
**chunks** of at most ``BLOCK_M`` tokens of one slot; each program takes one chunk (for decode with distinct
adapters a chunk is one token: BGMV). The grid is ``min(T, cdiv(T, BLOCK_M) + max_slots)`` chunks, a bound
that depends only on the token count and the pool, never on how the batch is grouped; unused chunk entries
hold slot ``-1`` and their programs return at once. So a decode step can be captured in a CUDA graph.

Chunk table (``plan.extra["sgmv"][BLOCK_M]``, int32 on the plan's device, built once per step), worked
example with ``token_slots = [1, 2, 3, 2, 3, 2, 3, -1]`` and ``BLOCK_M = 2``::

    sorted_tokens = [0, 1, 3, 5, 2, 4, 6, 0]     # tokens grouped by slot (stable); tail padded with 0
    chunk_slot    = [1, 2, 2, 3, 3, -1, -1, -1]   # one entry per possible chunk (T entries), -1 = none
    chunk_start   = [0, 1, 3, 4, 6, 0, 0, 0]      # into sorted_tokens
    chunk_len     = [1, 2, 1, 2, 1, 0, 0, 0]

Shrink writes an fp32 intermediate ``v`` of shape ``[SPLIT_K, num_slices, T, RMAX]`` (``RMAX`` = the pool's
``max_pages_per_slot * R``); split-K partials are summed by expand, so nothing needs zeroing and results are
deterministic. The per-slot scaling is applied inside expand; pages never hold scaled weights.

``lora_fused`` does shrink and expand in one launch (each program recomputes the shrink of its chunk for
its output tiles). It is tested but off by default (``FUSED_MAX_TOKENS = 0``): slower than the two launches
on every decode case measured on an H200 (bench/README.md).
"""

from __future__ import annotations

import functools
from typing import Sequence

import numpy as np
import torch
import triton
import triton.language as tl

from multilora.kernels.lora import LoRAModuleView

MAX_SLICES = 3  # q/k/v; more views are launched in groups of three
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# ---------------------------------------------------------------------------------------------- kernels
@triton.jit
def _slice_pick(sid, a0, a1, a2):
    return tl.where(sid == 0, a0, tl.where(sid == 1, a1, a2))


@triton.jit
def _sgmv_shrink_kernel(
    # pointers
    x_ptr, buf_ptr, pt_ptr, ranks_ptr, v_ptr, sorted_ptr, cslot_ptr, cstart_ptr, clen_ptr,
    # sizes
    T, d_in, page_elems, page_rows, k_per_split,
    oa0, oa1, oa2, ro0, ro1, ro2,  # per slice: A offset in a page, rank-table offset (elements)
    # strides
    stride_xm, stride_pt,
    # meta
    NUM_SLICES: tl.constexpr, RMAX: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
):
    chunk = tl.program_id(0) // NUM_SLICES
    sid = tl.program_id(0) % NUM_SLICES
    split = tl.program_id(1)
    slot = tl.load(cslot_ptr + chunk)
    if slot < 0:
        return
    r = tl.load(ranks_ptr + _slice_pick(sid, ro0, ro1, ro2) + slot)
    if r == 0:
        return
    off_a = _slice_pick(sid, oa0, oa1, oa2).to(tl.int64)
    start = tl.load(cstart_ptr + chunk)
    n_tok = tl.load(clen_ptr + chunk)
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < n_tok
    tok = tl.load(sorted_ptr + start + offs_m, mask=m_mask, other=0).to(tl.int64)
    k_lo = split * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, d_in)
    offs_k = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + tok[:, None] * stride_xm  # [BLOCK_M, 1]
    v_rows = v_ptr + ((split * NUM_SLICES + sid).to(tl.int64) * T + tok[:, None]) * RMAX
    for j0 in range(0, r, BLOCK_R):
        j = j0 + tl.arange(0, BLOCK_R)
        j_mask = j < r
        page = tl.load(pt_ptr + slot.to(tl.int64) * stride_pt + j // page_rows, mask=j_mask, other=0)
        a_rows = buf_ptr + (page.to(tl.int64) * page_elems + off_a + (j % page_rows).to(tl.int64) * d_in)
        acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            k = k0 + offs_k
            k_mask = k < k_hi
            xt = tl.load(x_rows + k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            at = tl.load(a_rows[:, None] + k[None, :], mask=j_mask[:, None] & k_mask[None, :], other=0.0)
            if IEEE:
                acc += tl.dot(xt, tl.trans(at), input_precision="ieee")
            else:
                acc += tl.dot(xt, tl.trans(at))
        tl.store(v_rows + j[None, :], acc, mask=m_mask[:, None] & j_mask[None, :])


@triton.jit
def _sgmv_expand_kernel(
    # pointers
    y_ptr, buf_ptr, pt_ptr, ranks_ptr, scal_ptr, v_ptr, sorted_ptr, cslot_ptr, cstart_ptr, clen_ptr,
    # sizes
    T, page_elems, page_rows,
    ob0, ob1, ob2, do0, do1, do2, col0, col1, col2, ro0, ro1, ro2, so0, so1, so2, tiles0, tiles1,
    # strides
    stride_ym, stride_pt,
    # meta
    NUM_SLICES: tl.constexpr, SPLIT_K: tl.constexpr, RMAX: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, IEEE: tl.constexpr,
):
    chunk = tl.program_id(0)
    tile = tl.program_id(1)  # n tiles of all slices, slice after slice
    slot = tl.load(cslot_ptr + chunk)
    if slot < 0:
        return
    sid = (tile >= tiles0).to(tl.int32) + (tile >= tiles0 + tiles1).to(tl.int32)
    n_tile = tile - tl.where(sid == 0, 0, tl.where(sid == 1, tiles0, tiles0 + tiles1))
    r = tl.load(ranks_ptr + _slice_pick(sid, ro0, ro1, ro2) + slot)
    if r == 0:
        return
    scale = tl.load(scal_ptr + _slice_pick(sid, so0, so1, so2) + slot)
    off_b = _slice_pick(sid, ob0, ob1, ob2).to(tl.int64)
    d_out = _slice_pick(sid, do0, do1, do2)
    col = _slice_pick(sid, col0, col1, col2)
    start = tl.load(cstart_ptr + chunk)
    n_tok = tl.load(clen_ptr + chunk)
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < n_tok
    tok = tl.load(sorted_ptr + start + offs_m, mask=m_mask, other=0).to(tl.int64)
    n = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < d_out
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for j0 in range(0, r, BLOCK_R):
        j = j0 + tl.arange(0, BLOCK_R)
        j_mask = j < r
        page = tl.load(pt_ptr + slot.to(tl.int64) * stride_pt + j // page_rows, mask=j_mask, other=0)
        b_rows = buf_ptr + (page.to(tl.int64) * page_elems + off_b + (j % page_rows).to(tl.int64) * d_out)
        bt = tl.load(b_rows[:, None] + n[None, :], mask=j_mask[:, None] & n_mask[None, :], other=0.0)
        vm = m_mask[:, None] & j_mask[None, :]
        vt = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for sp in range(SPLIT_K):
            v_rows = v_ptr + ((sp * NUM_SLICES + sid).to(tl.int64) * T + tok[:, None]) * RMAX
            vt += tl.load(v_rows + j[None, :], mask=vm, other=0.0)
        if IEEE:
            acc += tl.dot(vt, bt, input_precision="ieee")
        else:
            acc += tl.dot(vt.to(bt.dtype), bt)
    y_ptrs = y_ptr + tok[:, None] * stride_ym + (col + n)[None, :]
    y_mask = m_mask[:, None] & n_mask[None, :]
    y_old = tl.load(y_ptrs, mask=y_mask, other=0.0)
    tl.store(y_ptrs, (y_old.to(tl.float32) + scale * acc).to(y_ptr.dtype.element_ty), mask=y_mask)


@triton.jit
def _lora_fused_kernel(
    # pointers
    y_ptr, x_ptr, buf_ptr, pt_ptr, ranks_ptr, scal_ptr, w_ptr, sorted_ptr, cslot_ptr, cstart_ptr, clen_ptr,
    # sizes
    d_in, page_elems, page_rows,
    oa0, oa1, oa2, ob0, ob1, ob2, do0, do1, do2, col0, col1, col2, ro0, ro1, ro2, so0, so1, so2,
    groups0, groups1,
    # strides
    stride_xm, stride_ym, stride_pt,
    # meta
    NUM_SLICES: tl.constexpr, RMAX: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, TILES: tl.constexpr, IEEE: tl.constexpr,
):
    """One program = one chunk x ``TILES`` output tiles of one slice: shrink (full K) then expand, no
    intermediate in HBM. Rank tile 0 of ``v`` stays in registers; further rank tiles (r > BLOCK_R) go
    through the program's private rows of the fp32 workspace ``w``."""
    chunk = tl.program_id(0)
    grp = tl.program_id(1)  # tile groups of all slices, slice after slice
    slot = tl.load(cslot_ptr + chunk)
    if slot < 0:
        return
    sid = (grp >= groups0).to(tl.int32) + (grp >= groups0 + groups1).to(tl.int32)
    g = grp - tl.where(sid == 0, 0, tl.where(sid == 1, groups0, groups0 + groups1))
    r = tl.load(ranks_ptr + _slice_pick(sid, ro0, ro1, ro2) + slot)
    if r == 0:
        return
    scale = tl.load(scal_ptr + _slice_pick(sid, so0, so1, so2) + slot)
    off_a = _slice_pick(sid, oa0, oa1, oa2).to(tl.int64)
    off_b = _slice_pick(sid, ob0, ob1, ob2).to(tl.int64)
    d_out = _slice_pick(sid, do0, do1, do2)
    col = _slice_pick(sid, col0, col1, col2)
    start = tl.load(cstart_ptr + chunk)
    n_tok = tl.load(clen_ptr + chunk)
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < n_tok
    tok = tl.load(sorted_ptr + start + offs_m, mask=m_mask, other=0).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    offs_r = tl.arange(0, BLOCK_R)
    x_rows = x_ptr + tok[:, None] * stride_xm  # [BLOCK_M, 1]
    pt_row = pt_ptr + slot.to(tl.int64) * stride_pt
    pid = chunk.to(tl.int64) * tl.num_programs(1) + grp
    w_rows = w_ptr + (pid * BLOCK_M + offs_m[:, None]) * (RMAX - BLOCK_R)  # rank tiles 1.. of this program
    # shrink: v[m, j] = x[tok_m] . A[j]
    v0 = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for j0 in range(0, r, BLOCK_R):
        j = j0 + offs_r
        j_mask = j < r
        page = tl.load(pt_row + j // page_rows, mask=j_mask, other=0)
        a_rows = buf_ptr + (page.to(tl.int64) * page_elems + off_a + (j % page_rows).to(tl.int64) * d_in)
        acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for k0 in range(0, d_in, BLOCK_K):
            k = k0 + offs_k
            k_mask = k < d_in
            xt = tl.load(x_rows + k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            at = tl.load(a_rows[:, None] + k[None, :], mask=j_mask[:, None] & k_mask[None, :], other=0.0)
            if IEEE:
                acc += tl.dot(xt, tl.trans(at), input_precision="ieee")
            else:
                acc += tl.dot(xt, tl.trans(at))
        if j0 == 0:
            v0 = acc
        else:
            tl.store(w_rows + (j - BLOCK_R)[None, :], acc, mask=j_mask[None, :])
    if r > BLOCK_R:
        tl.debug_barrier()  # the workspace rows written above are read back by other threads of this program
    # expand: y[tok, col + n] += scale * v @ B^T[:, n], for this program's TILES tiles
    j = offs_r
    j_mask = j < r
    page = tl.load(pt_row + j // page_rows, mask=j_mask, other=0)
    b0_rows = buf_ptr + (page.to(tl.int64) * page_elems + off_b + (j % page_rows).to(tl.int64) * d_out)
    if not IEEE:
        v0 = v0.to(y_ptr.dtype.element_ty)
    for t in range(TILES):
        n = (g * TILES + t) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = n < d_out
        bt = tl.load(b0_rows[:, None] + n[None, :], mask=j_mask[:, None] & n_mask[None, :], other=0.0)
        if IEEE:
            out = tl.dot(v0, bt, input_precision="ieee")
        else:
            out = tl.dot(v0, bt)
        for j0 in range(BLOCK_R, r, BLOCK_R):
            jj = j0 + offs_r
            jj_mask = jj < r
            pg = tl.load(pt_row + jj // page_rows, mask=jj_mask, other=0)
            b_rows = buf_ptr + (pg.to(tl.int64) * page_elems + off_b + (jj % page_rows).to(tl.int64) * d_out)
            bt = tl.load(b_rows[:, None] + n[None, :], mask=jj_mask[:, None] & n_mask[None, :], other=0.0)
            vt = tl.load(w_rows + (jj - BLOCK_R)[None, :], mask=jj_mask[None, :], other=0.0)
            if IEEE:
                out += tl.dot(vt, bt, input_precision="ieee")
            else:
                out += tl.dot(vt.to(bt.dtype), bt)
        y_ptrs = y_ptr + tok[:, None] * stride_ym + (col + n)[None, :]
        y_mask = m_mask[:, None] & n_mask[None, :]
        y_old = tl.load(y_ptrs, mask=y_mask, other=0.0)
        tl.store(y_ptrs, (y_old.to(tl.float32) + scale * out).to(y_ptr.dtype.element_ty), mask=y_mask)


# ---------------------------------------------------------------------------------------------- plan metadata
def block_m_for(num_tokens: int) -> int:
    """Tokens per chunk: 16 for decode-sized batches (one token per chunk when adapters are distinct),
    larger tiles for prefill. A function of the token count only (CUDA-graph friendly)."""
    return 16 if num_tokens <= 512 else 64


def _chunk_table(token_slots: "torch.Tensor | Sequence[int]", block_m: int, device: torch.device) -> torch.Tensor:
    """int32 ``[4, T]``: sorted_tokens, chunk_slot, chunk_start, chunk_len (see the module docstring).

    ``token_slots`` is a tensor (any device; read back to the host) or a host sequence of ints. Built with
    numpy in a fixed number of vectorised steps (no Python loop over tokens or chunks)."""
    if isinstance(token_slots, torch.Tensor):
        slots = token_slots.detach().to("cpu", torch.int64).numpy()
    else:
        slots = np.asarray(token_slots, dtype=np.int64)
    slots = slots.reshape(-1)
    T = slots.size
    table = np.zeros((4, max(T, 1)), dtype=np.int32)
    table[1] = -1
    order = np.argsort(slots, kind="stable")
    order = order[slots[order] >= 0]
    n = order.size
    if n:
        table[0, :n] = order
        s = slots[order]
        pos = np.arange(n)
        starts = np.zeros(n, dtype=np.int64)  # the first sorted position of each position's run of one slot
        np.copyto(starts[1:], pos[1:], where=s[1:] != s[:-1])
        np.maximum.accumulate(starts, out=starts)
        first = np.flatnonzero((pos - starts) % block_m == 0)  # chunk starts: a run's start, then every block_m
        c = first.size  # <= n <= T
        table[1, :c] = s[first]
        table[2, :c] = first
        table[3, : c - 1] = first[1:] - first[:-1]  # chunks tile [0, n): each ends where the next starts
        table[3, c - 1] = n - first[-1]
    return torch.from_numpy(table).to(device)


def _plan_table(plan, block_m: int, device: torch.device) -> torch.Tensor:
    cache = plan.extra.setdefault("sgmv", {})
    table = cache.get(block_m)
    if table is None or table.device != device:
        table = cache[block_m] = _chunk_table(plan.token_slots, block_m, device)
    return table


def extend_plan(plan) -> None:
    """Add the chunk table for this step's token count to ``plan.extra`` (called once per step by
    ``build_lora_plan`` on CUDA; its only host work is the copy of the table, like the plan's own)."""
    if plan.has_lora:
        _plan_table(plan, block_m_for(plan.num_tokens), plan.token_slots.device)


# ---------------------------------------------------------------------------------------------- launchers
@functools.lru_cache(maxsize=None)
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _split_k(device: torch.device, programs: int, d_in: int, block_k: int) -> int:
    """Split the shrink's K loop when too few programs would fill the GPU (decode). Depends on sizes only."""
    if device.type != "cuda":
        return 1
    want = 4 * _num_sms(device.index or 0)  # 4 programs per SM: best of 1x/2x/4x in the H200 sweep
    split = 1
    while split * programs < want and d_in >= 2 * split * block_k and split < 32:
        split *= 2
    return split


def _check_views(y: torch.Tensor, x: torch.Tensor, views: Sequence[LoRAModuleView]) -> None:
    v0 = views[0]
    for name, t in (("x", x), ("y", y), ("pool buffer", v0.buffer)):
        if t.dtype not in _DTYPES:
            raise ValueError(f"{name}: expected float16, bfloat16 or float32, got {t.dtype}")
    if x.dtype != v0.buffer.dtype or y.dtype != v0.buffer.dtype:
        raise ValueError(
            f"dtype mismatch: x is {x.dtype}, y is {y.dtype}, the adapter pool buffer is {v0.buffer.dtype}; "
            "cast the activations to the pool's dtype (the kernels do not mix dtypes)"
        )
    for name, t in (("x", x), ("y", y), ("pool buffer", v0.buffer), ("page_table", v0.page_table)):
        if t.device != x.device:
            raise ValueError(f"{name}: expected device {x.device}, got {t.device}")
    if x.stride(1) != 1 or y.stride(1) != 1:
        raise ValueError(f"x and y: expected unit stride along features, got {x.stride()} and {y.stride()}")
    for v in views:
        if v.buffer.data_ptr() != v0.buffer.data_ptr() or v.page_table.data_ptr() != v0.page_table.data_ptr():
            raise ValueError(f"views: fused slices must come from one pool ({v.module} does not)")
        if v.page_rows != v0.page_rows or v.page_elems != v0.page_elems:
            raise ValueError(f"views: page geometry of {v.module} differs from {v0.module}")
        if v.ranks.dtype != torch.int32 or v.scalings.dtype != torch.float32:
            raise ValueError(f"views: {v.module} ranks must be int32 and scalings float32")
    if not v0.buffer.is_contiguous() or not v0.page_table.is_contiguous():
        raise ValueError("pool buffer and page_table must be contiguous")


def _elem_offsets(tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, list[int]]:
    """A base tensor and each tensor's element offset from it (per-slice metadata without a copy)."""
    base = tensors[0]
    size = base.element_size()
    offs = []
    for t in tensors:
        if t.stride(0) != 1:
            raise ValueError("views: per-slot ranks/scalings must be contiguous")
        delta = t.data_ptr() - base.data_ptr()
        assert delta % size == 0
        offs.append(delta // size)
    return base, offs


def _pad3(vals: list[int], fill: int = 0) -> list[int]:
    return list(vals) + [fill] * (MAX_SLICES - len(vals))


def sgmv_shrink(x: torch.Tensor, views: Sequence[LoRAModuleView], table: torch.Tensor, *, block_m: int,
                num_chunks: int, block_k: int | None = None, split_k: int | None = None, num_warps: int = 4,
                num_stages: int | None = None) -> torch.Tensor:
    """``v[sp, i, t, :r] = partial (over K split sp) of x[t] @ A_i[slot[t]].T``; fp32 ``[SPLIT, S, T, RMAX]``.

    ``table`` is the chunk table (module docstring), ``num_chunks`` the grid bound. Rows of ``v`` that no
    chunk covers (slot -1, ranks beyond r) are left unwritten and never read.
    """
    v0 = views[0]
    T, d_in = x.shape
    rmax = v0.page_table.shape[1] * v0.page_rows
    if block_k is None:
        # measured on an H200 (bench/tune_lora_kernels.py): 128 for decode-sized batches, 256 for prefill
        block_k = 64 if x.device.type == "cpu" else 128 if x.dtype == torch.float32 or T <= 512 else 256
    block_k = min(block_k, max(16, triton.next_power_of_2(d_in)))
    split = split_k or _split_k(x.device, num_chunks * len(views), d_in, block_k)
    k_per = triton.cdiv(triton.cdiv(d_in, split), block_k) * block_k
    ranks, ro = _elem_offsets([v.ranks for v in views])
    v_out = torch.empty(split, len(views), T, rmax, dtype=torch.float32, device=x.device)
    grid = (num_chunks * len(views), split)
    extra = {} if num_stages is None else {"num_stages": num_stages}
    _sgmv_shrink_kernel[grid](
        x, v0.buffer, v0.page_table, ranks, v_out, table[0], table[1], table[2], table[3],
        T, d_in, v0.page_elems, v0.page_rows, k_per,
        *_pad3([v.offset_a for v in views]), *_pad3(ro),
        x.stride(0), v0.page_table.stride(0),
        NUM_SLICES=len(views), RMAX=rmax, BLOCK_M=block_m, BLOCK_R=16, BLOCK_K=block_k,
        IEEE=x.dtype == torch.float32, num_warps=num_warps, **extra,
    )
    return v_out


def sgmv_expand(y: torch.Tensor, v: torch.Tensor, views: Sequence[LoRAModuleView], table: torch.Tensor,
                *, block_m: int, num_chunks: int, col0: int = 0, block_n: int | None = None, num_warps: int = 4,
                num_stages: int | None = None) -> torch.Tensor:
    """``y[t, c_i + n] += scalings_i[s] * sum_sp v[sp, i, t, :r] @ B_i[s].T[:r, n]`` in place; returns y."""
    v0 = views[0]
    split, _, T, rmax = v.shape
    if block_n is None:
        # measured on an H200: 256-wide tiles for decode (fewer, larger B reads), 128 for prefill
        block_n = 64 if y.device.type == "cpu" else 256 if T <= 512 else 128
    cols, c = [], col0
    for vw in views:
        cols.append(c)
        c += vw.d_out
    tiles = [triton.cdiv(vw.d_out, block_n) for vw in views]
    ranks, ro = _elem_offsets([vw.ranks for vw in views])
    scal, so = _elem_offsets([vw.scalings for vw in views])
    grid = (num_chunks, sum(tiles))
    if num_stages is None and y.device.type == "cuda" and T <= 512:
        # decode: one rank tile per program (r <= 16), nothing to pipeline; 2 stages leave more shared memory
        # for resident programs (H200 sweep, bench/results/tune.log: 59 vs 80 us at T = 512 distinct)
        num_stages = 2
    extra = {} if num_stages is None else {"num_stages": num_stages}
    _sgmv_expand_kernel[grid](
        y, v0.buffer, v0.page_table, ranks, scal, v, table[0], table[1], table[2], table[3],
        T, v0.page_elems, v0.page_rows,
        *_pad3([vw.offset_b for vw in views]), *_pad3([vw.d_out for vw in views]), *_pad3(cols),
        *_pad3(ro), *_pad3(so), *_pad3(tiles)[:2],
        y.stride(0), v0.page_table.stride(0),
        NUM_SLICES=len(views), SPLIT_K=split, RMAX=rmax, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=16,
        IEEE=y.dtype == torch.float32, num_warps=num_warps, **extra,
    )
    return y


def lora_fused(y: torch.Tensor, x: torch.Tensor, views: Sequence[LoRAModuleView], table: torch.Tensor, *,
               block_m: int, num_chunks: int, col0: int = 0, block_n: int = 256, tiles: int = 1,
               block_k: int | None = None, num_warps: int = 4, num_stages: int | None = None) -> torch.Tensor:
    """Shrink and expand in ONE launch (decode): ``y[t, c_i + n] += scalings_i[s] * (x[t] @ A_i[s].T) @ B_i[s].T``
    in place; returns y. Grid ``(num_chunks, sum_i cdiv(cdiv(d_out_i, block_n), tiles))``: each program
    recomputes the rank-r shrink of its chunk for its ``tiles`` output tiles (A re-reads mostly hit L2)."""
    v0 = views[0]
    T, d_in = x.shape
    rmax = v0.page_table.shape[1] * v0.page_rows
    block_r = 16
    if block_k is None:
        block_k = 64 if x.device.type == "cpu" else 256
    block_k = min(block_k, max(16, triton.next_power_of_2(d_in)))
    cols, c = [], col0
    for vw in views:
        cols.append(c)
        c += vw.d_out
    groups = [triton.cdiv(triton.cdiv(vw.d_out, block_n), tiles) for vw in views]
    ranks, ro = _elem_offsets([vw.ranks for vw in views])
    scal, so = _elem_offsets([vw.scalings for vw in views])
    grid = (num_chunks, sum(groups))
    # private fp32 rows for rank tiles beyond the first (only touched by slots with r > 16)
    w_numel = grid[0] * grid[1] * block_m * (rmax - block_r) if rmax > block_r else 1
    work = torch.empty(w_numel, dtype=torch.float32, device=x.device)
    extra = {} if num_stages is None else {"num_stages": num_stages}
    _lora_fused_kernel[grid](
        y, x, v0.buffer, v0.page_table, ranks, scal, work, table[0], table[1], table[2], table[3],
        d_in, v0.page_elems, v0.page_rows,
        *_pad3([vw.offset_a for vw in views]), *_pad3([vw.offset_b for vw in views]),
        *_pad3([vw.d_out for vw in views]), *_pad3(cols), *_pad3(ro), *_pad3(so), *_pad3(groups)[:2],
        x.stride(0), y.stride(0), v0.page_table.stride(0),
        NUM_SLICES=len(views), RMAX=max(rmax, block_r), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=block_r,
        BLOCK_K=block_k, TILES=tiles, IEEE=x.dtype == torch.float32, num_warps=num_warps, **extra,
    )
    return y


# Fused (one-launch) decode path: used for token counts up to FUSED_MAX_TOKENS with these tiles; 0 = off.
# Off by default: on an H200 (bench/bench_decode_fused.py, results/decode_fused.json) it was slower than the
# two launches on every decode case (T = 1 q/k/v 12.1 vs 7.6 us; T = 512 distinct 206 vs 142 us; the 8B layer
# +64..84% vs +26..40%): without split-K each program walks all of d_in serially, and re-reading A per
# output tile multiplies L2 traffic, which costs more than the launch it saves.
FUSED_MAX_TOKENS = 0
FUSED_CONFIG = dict(block_n=256, tiles=1, block_k=256, num_warps=4)


def _use_fused(T: int, device: torch.device) -> bool:
    return T <= FUSED_MAX_TOKENS and device.type == "cuda"


def lora_apply_triton(y: torch.Tensor, x: torch.Tensor, views: Sequence[LoRAModuleView], plan) -> torch.Tensor:
    """Triton backend of ``lora_apply`` (semantics and shapes: ``multilora.kernels.lora``): one shrink and
    one expand launch per group of up to three fused slices. No host synchronisation when ``plan.extra``
    already holds the chunk table (``extend_plan``), so a decode step can be captured in a CUDA graph.

    Raises:
        ValueError: dtypes of x, y and the pool buffer that differ or are not fp16/bf16/fp32; tensors on
            different devices; views from different pools; non-unit feature strides.
    """
    if not views:
        raise ValueError("views: expected at least one LoRAModuleView (fused slice)")
    _check_views(y, x, views)
    if not plan.has_lora or plan.num_tokens == 0:
        return y
    T = plan.num_tokens
    block_m = block_m_for(T)
    table = _plan_table(plan, block_m, x.device)
    num_chunks = min(T, triton.cdiv(T, block_m) + views[0].page_table.shape[0])
    fused = _use_fused(T, x.device)
    col = 0
    for g in range(0, len(views), MAX_SLICES):
        group = list(views[g : g + MAX_SLICES])
        if fused:
            lora_fused(y, x, group, table, block_m=block_m, num_chunks=num_chunks, col0=col, **FUSED_CONFIG)
        else:
            v = sgmv_shrink(x, group, table, block_m=block_m, num_chunks=num_chunks)
            sgmv_expand(y, v, group, table, block_m=block_m, num_chunks=num_chunks, col0=col)
        col += sum(vw.d_out for vw in group)
    return y
