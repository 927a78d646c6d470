"""Triton SGMV kernels: LoRA shrink and expand for a batch of per-token adapter slots, read from the adapter pool.

Semantics (``lora_apply`` in ``multilora.kernels.lora``; slice ``i`` owns columns ``[c_i, c_i + d_out_i)`` of y)::

    for every token t with s = token_slots[t] >= 0 and r = ranks_i[s] > 0:
        v[t, i, :r]                = x[t] @ A_i[s].T                            # shrink, fp32   [r]
        y[t, c_i : c_i + d_out_i] += scalings_i[s] * v[t, i, :r] @ B_i[s].T     # expand, in place
    rows with s == -1 (and slices with r == 0) are never read or written; with ``overwrite`` (``lora_delta``) y is
    written, not added to, and those rows and slices get zeros: every element is written once, none read.

``A_i[s]`` row ``j`` is ``buffer[offsets_a_i[s] + j * d_in ...]`` and ``B_i[s]^T`` row ``j`` is
``buffer[offsets_b_i[s] + j * d_out_i ...]`` (layout and worked example: ``multilora.memory.pool``): one offset
per (slot, slice), loaded beside the rank, then contiguous rows (``_rank_rows``). Rank loops stop at the slot's
real rank ``r``: bytes and work are proportional to ``r``. Per-slice widths and columns come from
``LoRASlices.table``; the slot's rank, scaling and offsets sit ``meta_stride`` elements apart per slice, and an
output tile's slice comes from three host-computed tile boundaries (``tile_ends``), so no table read gates a
load that needs the slot. Offsets and widths are declared multiples of ``LoRASlices.align``. A fused group of 1
to ``MAX_SLICES`` slices is one shrink and one expand launch.

One kernel family serves prefill (SGMV) and decode (BGMV). Each program takes one chunk of the plan's chunk
table (``LoRAPlan``: at most ``block_m`` tokens of one slot, worked example there). The grid is
``min(T, cdiv(T, block_m) + max_slots)`` chunks for a plan of static buffers (a CUDA graph), a bound that depends
only on the token count and the pool, never on how the batch is grouped; a plan that bounds its distinct slots
(``LoRAPlan.num_segments``: exact for a plan built for one step, the engine's batch for the piecewise graphs' static
plans) puts that bound in place of ``max_slots`` (``num_chunks``). Unused chunk entries hold slot ``-1`` and their
programs return at once.
The launchers read nothing back from the device, so a decode step can be captured in a CUDA graph and
replayed with the plan's tensors rewritten in place.

Shrink writes an fp32 intermediate ``v`` of shape ``[SPLIT_K, num_slices, T, RMAX]`` (``RMAX`` = the pool's
``max_rank``); split-K partials are summed by expand, so nothing needs zeroing and results are
deterministic. The per-slot scaling is applied inside expand; the pool never holds scaled weights.

Neither kernel specialises on the token count ``T`` nor on the chunk table's row stride ``stride_c`` (its
chunk count; ``do_not_specialize``): Triton would otherwise compile a
variant for ``T == 1``, for ``T % 16 == 0`` and for the rest, and a serving step whose token count first fell
in a new class stalled every running request for the compile (about 0.3 s each on an H200;
``bench/results/serving/``). The constexprs still change with ``T`` at thresholds: ``block_m``, ``block_k``
and the expand's stages above 512 tokens, the decode expand's looped tiles at 16 tokens (``DECODE_EXPAND_LOOP``),
and the split count (``_split_k``: a power of two that halves as the chunk count doubles). ``Engine.warmup``'s
prefill lengths and decode buckets reach every one of them (``tests/test_kernel_variants.py``).

At decode (chunks of at most 16 tokens) from a pool of rank <= 16, an expand program loops over ``TILES`` adjacent
output tiles of its chunk: the slot's rank, offset, scale and v are read once, and the pipeliner keeps the next B
tiles in flight while one is multiplied and stored (each token its own adapter, one 256-wide tile per program
read B at a third of copy bandwidth: a few KB behind a chain of dependent loads per program). A prefill expand that
writes the LoRA term (``lora_delta``) from such a pool loops too (``PREFILL_WRITE_LOOP``, ``prefill_write_tiles``).

On GPUs of compute capability 9.0+ both kernels are launched with programmatic dependent launch (``PDL``): a kernel
may start while the one before it on the stream drains; its programs read the plan (slot, rank, offset, scaling),
then wait for that kernel to complete (``_pdl_wait``) before they read x, v or y, and let the next kernel launch.

A one-launch shrink + expand kernel was tried and is off by default: ``multilora.kernels.experimental``.

``glu_shrink`` computes the MLP's gated activation and the down projection's shrink in one kernel (programs over
consecutive tokens, not chunks, since every token needs its activation; a block's slots are visited in turn), writing
the same ``v`` for ``sgmv_expand``; the engine takes it from ``runtime.model.GLU_SHRINK_MIN_TOKENS`` (off until
measured on a GPU).
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from multilora.kernels import triton_pdl
from multilora.kernels.backends import num_sms
from multilora.kernels.triton_pdl import pdl_wait as _pdl_wait
from multilora.kernels.lora import MAX_SLICES, LoRAPlan, LoRASlices

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# ---------------------------------------------------------------------------------------------- kernels
# Building blocks (inlined by Triton), shared with ``multilora.kernels.experimental.lora_fused``.
@triton.jit
def _field(tab_ptr, f: tl.constexpr, sid, NUM_SLICES: tl.constexpr, ALIGN: tl.constexpr):
    """Field ``f`` of slice ``sid`` from the ``[2, NUM_SLICES]`` table, declared a multiple of ``ALIGN``
    (``LoRASlices.align``): values read from memory carry no divisibility the compiler can see, and without it
    the row loads and stores are not vectorised."""
    return tl.multiple_of(tl.load(tab_ptr + f * NUM_SLICES + sid), ALIGN)


@triton.jit
def _tile_slice(tab_ptr, tile, e0, e1, e2, NUM_SLICES: tl.constexpr, ALIGN: tl.constexpr):
    """Map ``tile``, an index over the output tiles of all slices (slice after slice), to its slice from the
    host's tile boundaries ``e0 <= e1 <= e2`` (one past the last tile of slices 0, 1, 2; ``tile_ends``), with no
    memory read; then read the slice's fields (loads that do not depend on the slot: issued alongside it).
    Returns (slice id, tile within the slice, d_out, col)."""
    sid = (tile >= e0).to(tl.int32) + (tile >= e1).to(tl.int32) + (tile >= e2).to(tl.int32)
    first = tl.where(sid == 0, 0, tl.where(sid == 1, e0, tl.where(sid == 2, e1, e2)))
    return (sid, tile - first, _field(tab_ptr, 0, sid, NUM_SLICES, ALIGN).to(tl.int32),
            _field(tab_ptr, 1, sid, NUM_SLICES, ALIGN).to(tl.int32))


def tile_ends(slices: LoRASlices, tile_n: int) -> list[int]:
    """The ``e0, e1, e2`` of ``_tile_slice`` for output tiles ``tile_n`` wide: cumulative tile counts of slices 0..2
    (``2**30`` for slices that do not exist: at most ``MAX_SLICES`` slices, so three boundaries suffice)."""
    ends = np.cumsum([triton.cdiv(v.d_out, tile_n) for v in slices.views]).tolist()[: MAX_SLICES - 1]
    return ends + [1 << 30] * (MAX_SLICES - 1 - len(ends))


@triton.jit
def _chunk_tokens(chunks_ptr, stride_c, chunk, BLOCK_M: tl.constexpr):
    """The tokens of ``chunk`` (int64 ``[BLOCK_M]``, from sorted_tokens) and the mask of the real ones."""
    start = tl.load(chunks_ptr + 2 * stride_c + chunk)  # chunk_start
    n_tok = tl.load(chunks_ptr + 3 * stride_c + chunk)  # chunk_len
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < n_tok
    tok = tl.load(chunks_ptr + start + offs_m, mask=m_mask, other=0).to(tl.int64)
    return tok, m_mask


@triton.jit
def _slot_offset(off_ptr, sid, meta_stride, slot, ALIGN: tl.constexpr):
    """The int64 element offset of slice ``sid``'s region of ``slot`` in the pool buffer (``offsets_a`` or
    ``offsets_b``), declared a multiple of ``ALIGN`` (``LoRASlices.align``, which the pool's layout holds)."""
    return tl.multiple_of(tl.load(off_ptr + sid * meta_stride + slot), ALIGN)


@triton.jit
def _rank_rows(buf_ptr, offset, j, width):
    """Pointers to rank-rows ``j`` of one slot's region: row ``j`` starts ``j * width`` elements after the region's
    ``offset`` (int64) in the flat pool buffer (``multilora.memory.pool``)."""
    return buf_ptr + (offset + j.to(tl.int64) * width)


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _shrink_tile(x_rows, a_rows, m_mask, j_mask, k_lo, k_hi, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
                 BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
    """fp32 ``[BLOCK_M, BLOCK_R]``: ``x[tok, k_lo:k_hi] @ A[j, k_lo:k_hi].T`` (``x_rows`` ``[BLOCK_M, 1]`` and
    ``a_rows`` ``[BLOCK_R]`` point at the rows' starts)."""
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k = k0 + offs_k
        k_mask = k < k_hi
        xt = tl.load(x_rows + k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        at = tl.load(a_rows[:, None] + k[None, :], mask=j_mask[:, None] & k_mask[None, :], other=0.0)
        acc += _dot(xt, tl.trans(at), IEEE)
    return acc


@triton.jit
def _y_tile(y_ptr, stride_ym, tok, m_mask, n, n_mask):
    """Pointers, mask and current values of the ``y[tok, n]`` tile. The decode-sized expand calls it before its rank
    loop (y does not depend on the weights, so the read is in flight while the weights are); ``_add_scaled`` calls it
    after the loop."""
    y_ptrs = y_ptr + tok[:, None] * stride_ym + n[None, :]
    y_mask = m_mask[:, None] & n_mask[None, :]
    return y_ptrs, y_mask, tl.load(y_ptrs, mask=y_mask, other=0.0)


@triton.jit
def _store_scaled(y_ptrs, y_mask, y_old, scale, acc):
    """``y = y_old + scale * acc``: the LoRA term rounded to y's dtype, then the sum (as peft's ``base_layer(x) +
    lora_B(lora_A(x)) * scaling``). A zeroed ``y`` thus holds the rounded term, and a later ``y_base + that`` (the
    side-stream path of ``runtime.model``, added by the following op) is bit-identical to adding in place here."""
    dt = y_ptrs.dtype.element_ty
    tl.store(y_ptrs, (y_old.to(tl.float32) + (scale * acc).to(dt).to(tl.float32)).to(dt), mask=y_mask)


@triton.jit
def _write_scaled(y_ptr, stride_ym, tok, m_mask, n, n_mask, scale, acc):
    """``y[tok, n] = 0 + scale * acc`` (``OVERWRITE``; ``_add_scaled``'s twin): ``_store_scaled`` of a zero
    ``y_old``, bit for bit (the term rounded to y's dtype, then the add of +0, which turns a -0 into +0 as the in-place
    add does), with no read of y."""
    dt = y_ptr.dtype.element_ty
    tl.store(y_ptr + tok[:, None] * stride_ym + n[None, :], (0.0 + (scale * acc).to(dt).to(tl.float32)).to(dt),
             mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _zero_rows(y_ptr, slots, ts, T, stride_ym, col, n, d_out, TILES: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr):
    """Zeros into ``y[ts, col + n + g * BLOCK_N]`` (g < TILES, columns below ``d_out``) for the tokens ``ts`` (int
    ``[BLOCK_M]``) below ``T`` whose ``slots`` are -1: a [BLOCK_M, BLOCK_N] store per tile, in the expand's tile layout
    (so in 16-byte vectors, as its other stores)."""
    rows = y_ptr + ts.to(tl.int64)[:, None] * stride_ym + col
    keep = (ts < T) & (slots < 0)
    for g in tl.static_range(TILES):
        ng = n + g * BLOCK_N
        tl.store(rows + ng[None, :], tl.zeros((BLOCK_M, BLOCK_N), dtype=y_ptr.dtype.element_ty),
                 mask=keep[:, None] & (ng < d_out)[None, :])


@triton.jit
def _zero_unadapted(y_ptr, slots_ptr, first_slots, stride_ym, T, chunk, col, n, d_out, TILES: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """``OVERWRITE``: zero the output tiles' columns of the tokens ``t = chunk, chunk + G, ...`` (G the grid's chunk
    count) whose slot is -1 (``_zero_rows``, BLOCK_M tokens at a time): the rows no chunk covers, so that the expand
    alone defines every row of its output tiles. ``first_slots``: the slots of the first BLOCK_M of those tokens,
    loaded by the caller before its PDL wait (the plan is no kernel's output), so that at decode (T <= G: one token
    per program) no load stands between the wait and the stores."""
    G = tl.num_programs(0)
    ts = chunk + G * tl.arange(0, BLOCK_M)
    _zero_rows(y_ptr, first_slots, ts, T, stride_ym, col, n, d_out, TILES, BLOCK_M, BLOCK_N)
    for t0 in range(chunk + G * BLOCK_M, T, G * BLOCK_M):
        ts = t0 + G * tl.arange(0, BLOCK_M)
        _zero_rows(y_ptr, tl.load(slots_ptr + ts, mask=ts < T, other=0), ts, T, stride_ym, col, n, d_out, TILES,
                   BLOCK_M, BLOCK_N)


@triton.jit
def _add_scaled(y_ptr, stride_ym, tok, m_mask, n, n_mask, scale, acc):
    """``y[tok, n] += scale * acc`` (``_y_tile`` then ``_store_scaled``)."""
    y_ptrs, y_mask, y_old = _y_tile(y_ptr, stride_ym, tok, m_mask, n, n_mask)
    _store_scaled(y_ptrs, y_mask, y_old, scale, acc)


@triton.jit(do_not_specialize=["T", "stride_c"])  # one compiled variant for every token count (module docstring)
def _sgmv_shrink_kernel(
    # pointers
    x_ptr, buf_ptr, offa_ptr, ranks_ptr, v_ptr, chunks_ptr,
    # sizes
    T, d_in, k_per_split, meta_stride,
    # strides
    stride_xm, stride_c,
    # meta
    NUM_SLICES: tl.constexpr, RMAX: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr, ALIGN: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr = False,
    PDL_TRIGGER: tl.constexpr = True,
):
    chunk = tl.program_id(0) // NUM_SLICES
    sid = tl.program_id(0) % NUM_SLICES
    split = tl.program_id(1)
    slot = tl.load(chunks_ptr + stride_c + chunk)  # chunk_slot
    if BLOCK_M <= 16:  # decode-sized tiles: the tokens beside the slot (prologue: see _sgmv_expand_kernel)
        tok, m_mask = _chunk_tokens(chunks_ptr, stride_c, chunk, BLOCK_M)
    if PDL:  # launched early (programmatic dependent launch): the slot's plan entries, then wait (``_pdl_wait``)
        r = tl.load(ranks_ptr + sid * meta_stride + slot, mask=slot >= 0, other=0)
        off_a = tl.multiple_of(tl.load(offa_ptr + sid * meta_stride + slot, mask=slot >= 0, other=0), ALIGN)
        _pdl_wait(PDL_TRIGGER)
    else:
        if slot < 0:
            return
        r = tl.load(ranks_ptr + sid * meta_stride + slot)  # no table read on the way to the rank
        off_a = _slot_offset(offa_ptr, sid, meta_stride, slot, ALIGN)  # independent of r: loaded alongside it
    if r == 0:
        return
    if BLOCK_M > 16:
        tok, m_mask = _chunk_tokens(chunks_ptr, stride_c, chunk, BLOCK_M)
    k_lo = split * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, d_in)
    x_rows = x_ptr + tok[:, None] * stride_xm  # [BLOCK_M, 1]
    v_rows = v_ptr + ((split * NUM_SLICES + sid).to(tl.int64) * T + tok[:, None]) * RMAX
    for j0 in range(0, r, BLOCK_R):
        j = j0 + tl.arange(0, BLOCK_R)
        j_mask = j < r
        a_rows = _rank_rows(buf_ptr, off_a, j, d_in)
        acc = _shrink_tile(x_rows, a_rows, m_mask, j_mask, k_lo, k_hi, BLOCK_M, BLOCK_R, BLOCK_K, IEEE)
        tl.store(v_rows + j[None, :], acc, mask=m_mask[:, None] & j_mask[None, :])


@triton.jit
def _v_tile(v_ptr, sid, T, tok, j, vm, NUM_SLICES: tl.constexpr, SPLIT_K: tl.constexpr, RMAX: tl.constexpr,
            BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr):
    """fp32 ``[BLOCK_M, BLOCK_R]``: the shrink's ``v[:, sid, tok, j]`` summed over its ``SPLIT_K`` partials (``vm``
    masks rows and ranks)."""
    vt = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for sp in range(SPLIT_K):
        v_rows = v_ptr + ((sp * NUM_SLICES + sid).to(tl.int64) * T + tok[:, None]) * RMAX
        vt += tl.load(v_rows + j[None, :], mask=vm, other=0.0)
    return vt


@triton.jit(do_not_specialize=["T", "stride_c"])  # one compiled variant for every token count (module docstring)
def _sgmv_expand_kernel(
    # pointers
    y_ptr, buf_ptr, offb_ptr, ranks_ptr, scal_ptr, tab_ptr, v_ptr, chunks_ptr, slots_ptr,
    # sizes
    T, e0, e1, e2, meta_stride,
    # strides
    stride_ym, stride_c,
    # meta
    NUM_SLICES: tl.constexpr, SPLIT_K: tl.constexpr, RMAX: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, ALIGN: tl.constexpr, IEEE: tl.constexpr, TILES: tl.constexpr = 1,
    PDL: tl.constexpr = False, PDL_TRIGGER: tl.constexpr = True, OVERWRITE: tl.constexpr = False,
):
    chunk = tl.program_id(0)
    tile = tl.program_id(1)  # n tiles of all slices, slice after slice (groups of TILES sub-tiles of BLOCK_N)
    # Decode-sized tiles (BLOCK_M <= 16: steps of at most 512 tokens) order the prologue for latency. The chunk's
    # start and length are loaded beside the slot, the tokens beside the rank and offsets, and y's tile beside the
    # weights, so that the weights and y are the third dependent read (slot, start; tokens, rank, offset; weights, v,
    # y) instead of the fifth and sixth (slot; rank, offset; start; tokens; weights, v; y after the dot). At decode a
    # program moves a few KB: these round trips are most of its time (H200, one Llama-3-8B layer's seven projections
    # in a CUDA graph, 1 / 8 / 32 tokens: LoRA 46-48 -> 36-37 us, 51-52 -> 42-43, 54-56 -> 48-50; 64-256 tokens within
    # noise, one 256-token sample 1.22x; bench/README.md, session 15). Prefill tiles keep y's tile out of the rank
    # loop: live beside a 64-row accumulator it cost 1.3-1.5x on gate/up and down at 1-8 Ki tokens (same runs).
    slot = tl.load(chunks_ptr + stride_c + chunk)  # chunk_slot
    sid, n_tile, d_out, col = _tile_slice(tab_ptr, tile, e0, e1, e2, NUM_SLICES, ALIGN)
    if BLOCK_M <= 16:
        tok, m_mask = _chunk_tokens(chunks_ptr, stride_c, chunk, BLOCK_M)  # padding chunks: len 0, nothing loaded
        n = n_tile * (TILES * BLOCK_N) + tl.arange(0, BLOCK_N)
        n_mask = n < d_out
    if OVERWRITE:  # (the slots of this program's first BLOCK_M tokens for ``_zero_unadapted``)
        ts0 = chunk + tl.num_programs(0) * tl.arange(0, BLOCK_M)
        first_slots = tl.load(slots_ptr + ts0, mask=ts0 < T, other=0)
    if PDL:  # launched early (programmatic dependent launch): the slot's plan entries, then wait (``_pdl_wait``)
        r = tl.load(ranks_ptr + sid * meta_stride + slot, mask=slot >= 0, other=0)
        off_b = tl.multiple_of(tl.load(offb_ptr + sid * meta_stride + slot, mask=slot >= 0, other=0), ALIGN)
        scale = tl.load(scal_ptr + sid * meta_stride + slot, mask=slot >= 0, other=0.0)
        _pdl_wait(PDL_TRIGGER)
    if OVERWRITE:  # y is the LoRA term alone: the rows of slot -1 get zeros here (after the wait: a write)
        _zero_unadapted(y_ptr, slots_ptr, first_slots, stride_ym, T, chunk, col,
                        n_tile * (TILES * BLOCK_N) + tl.arange(0, BLOCK_N), d_out, TILES, BLOCK_M, BLOCK_N)
    if not PDL:
        if slot < 0:
            return
        r = tl.load(ranks_ptr + sid * meta_stride + slot)
        off_b = _slot_offset(offb_ptr, sid, meta_stride, slot, ALIGN)
        scale = tl.load(scal_ptr + sid * meta_stride + slot)
    if OVERWRITE:
        if slot < 0:  # a padding chunk: no tokens
            return
        scale = tl.where(r > 0, scale, 0.0)  # a slice the adapter does not target (r == 0): its rows get zeros
    elif r == 0:
        return
    if TILES > 1:  # a rank-16 pool (RMAX <= BLOCK_R): one v tile, TILES B tiles in a loop (decode; prefill writing)
        if BLOCK_M > 16:
            tok, m_mask = _chunk_tokens(chunks_ptr, stride_c, chunk, BLOCK_M)
            n = n_tile * (TILES * BLOCK_N) + tl.arange(0, BLOCK_N)
        j = tl.arange(0, BLOCK_R)
        j_mask = j < r
        vm = m_mask[:, None] & j_mask[None, :]
        vt = _v_tile(v_ptr, sid, T, tok, j, vm, NUM_SLICES, SPLIT_K, RMAX, BLOCK_M, BLOCK_R)
        b_rows = _rank_rows(buf_ptr, off_b, j, d_out)
        for g in range(TILES):  # the B rows' address is affine in g: the pipeliner keeps the next tiles in flight
            ng = n + g * BLOCK_N
            ng_mask = ng < d_out
            bt = tl.load(b_rows[:, None] + ng[None, :], mask=j_mask[:, None] & ng_mask[None, :], other=0.0)
            if OVERWRITE:
                _write_scaled(y_ptr, stride_ym, tok, m_mask, col + ng, ng_mask, scale, _dot(vt.to(bt.dtype), bt, IEEE))
            else:
                y_ptrs, y_mask, y_old = _y_tile(y_ptr, stride_ym, tok, m_mask, col + ng, ng_mask)
                _store_scaled(y_ptrs, y_mask, y_old, scale, _dot(vt.to(bt.dtype), bt, IEEE))
        return
    if BLOCK_M > 16:  # prefill tiles: as before the reordering
        tok, m_mask = _chunk_tokens(chunks_ptr, stride_c, chunk, BLOCK_M)
        n = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = n < d_out
    elif not OVERWRITE:  # (after the slot's loads in program order: a load waits in line for its address, here the
        y_ptrs, y_mask, y_old = _y_tile(y_ptr, stride_ym, tok, m_mask, col + n, n_mask)  # tokens)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for j0 in range(0, r, BLOCK_R):
        j = j0 + tl.arange(0, BLOCK_R)
        j_mask = j < r
        b_rows = _rank_rows(buf_ptr, off_b, j, d_out)
        bt = tl.load(b_rows[:, None] + n[None, :], mask=j_mask[:, None] & n_mask[None, :], other=0.0)
        vm = m_mask[:, None] & j_mask[None, :]
        vt = _v_tile(v_ptr, sid, T, tok, j, vm, NUM_SLICES, SPLIT_K, RMAX, BLOCK_M, BLOCK_R)
        acc += _dot(vt.to(bt.dtype), bt, IEEE)  # IEEE: both fp32 (the cast is a no-op)
    if OVERWRITE:
        _write_scaled(y_ptr, stride_ym, tok, m_mask, col + n, n_mask, scale, acc)
    elif BLOCK_M > 16:
        _add_scaled(y_ptr, stride_ym, tok, m_mask, col + n, n_mask, scale, acc)
    else:
        _store_scaled(y_ptrs, y_mask, y_old, scale, acc)


@triton.jit(do_not_specialize=["T"])  # one compiled variant for every token count (module docstring)
def _glu_shrink_kernel(
    # pointers
    gu_ptr, out_ptr, buf_ptr, offa_ptr, ranks_ptr, slots_ptr, v_ptr,
    # sizes
    T, I, k_per_split,
    # strides
    stride_gu, stride_o,
    # meta
    GELU_TANH: tl.constexpr, RMAX: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr, ALIGN: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr = False,
    PDL_TRIGGER: tl.constexpr = True,
):
    # Program (row block, K split): rows ``BLOCK_M`` consecutive tokens (not a chunk: every token's activation is
    # computed, adapted or not), columns ``[k_lo, k_hi)`` of the intermediate. The block's distinct slots are taken
    # in ascending order (a prefill block holds one or two: sequences are contiguous). The first pass computes and
    # stores the activation of every row and shrinks the rows of the smallest slot; each further slot recomputes the
    # activation of its own rows only (from gate / up, not from the stored h: no read-after-write across threads).
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    split = tl.program_id(1)
    r_mask = rows < T
    rows = rows.to(tl.int64)
    slots = tl.load(slots_ptr + rows, mask=r_mask, other=-1)
    NONE: tl.constexpr = 1 << 30
    cur = tl.min(tl.where(slots >= 0, slots, NONE), axis=0)
    has = cur < NONE
    r = tl.load(ranks_ptr + cur, mask=has, other=0)
    off_a = tl.multiple_of(tl.load(offa_ptr + cur, mask=has, other=0), ALIGN)
    if PDL:  # launched early (programmatic dependent launch): the plan's entries, then wait (``_pdl_wait``)
        _pdl_wait(PDL_TRIGGER)
    k_lo = split * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, I)
    offs_k = tl.arange(0, BLOCK_K)
    j = tl.arange(0, BLOCK_R)
    g_rows = gu_ptr + rows[:, None] * stride_gu
    it = 0
    while (it == 0) | has:
        first = (tl.zeros_like(slots) + it) == 0  # (a vector: the interpreter's masks must be tensors of int1)
        sel = r_mask & (slots == cur)  # this slot's rows (none when the block has no adapted row)
        ld = sel | (r_mask & first)  # the rows whose activation this pass computes
        j_mask = j < r
        a_rows = _rank_rows(buf_ptr, off_a, j, I)
        acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            k = k0 + offs_k
            k_mask = k < k_hi
            m = ld[:, None] & k_mask[None, :]
            g = tl.load(g_rows + k[None, :], mask=m, other=0.0).to(tl.float32)
            u = tl.load(g_rows + I + k[None, :], mask=m, other=0.0).to(tl.float32)
            if GELU_TANH:  # as ``triton_fused._glu_kernel``: g * sigmoid(2 z), z = sqrt(2 / pi) (g + 0.044715 g^3)
                act = g / (1.0 + tl.exp(-(1.5957691216057308 * (g + 0.044715 * g * g * g))))
            else:  # F.silu
                act = g / (1.0 + tl.exp(-g))
            h = (act.to(out_ptr.dtype.element_ty).to(tl.float32) * u).to(out_ptr.dtype.element_ty)
            tl.store(out_ptr + rows[:, None] * stride_o + k[None, :], h, mask=m & first[:, None])
            at = tl.load(a_rows[:, None] + k[None, :], mask=j_mask[:, None] & k_mask[None, :], other=0.0)
            acc += _dot(tl.where(sel[:, None], h, 0.0).to(at.dtype), tl.trans(at), IEEE)
        v_rows = v_ptr + (split.to(tl.int64) * T + rows[:, None]) * RMAX
        tl.store(v_rows + j[None, :], acc, mask=sel[:, None] & j_mask[None, :])
        cur = tl.min(tl.where(slots > cur, slots, NONE), axis=0)  # the next slot of the block
        has = cur < NONE
        r = tl.load(ranks_ptr + cur, mask=has, other=0)
        off_a = tl.multiple_of(tl.load(offa_ptr + cur, mask=has, other=0), ALIGN)
        it += 1


# ---------------------------------------------------------------------------------------------- launchers


#: Few-token steps (at most this many tokens) from a pool of rank >= ``WIDE_RANK`` take the wide-rank tiles:
#: split-K at most 16 (expand sums every split's partial for each of its rank tiles: 32 splits x 4 tiles at r = 64)
#: and 2-warp expand programs. H200, rank-64 adapters, one group (``bench/bench_lora_overlap.py`` sweep, results in
#: bench/results/lora_side_stream/lora_overlap_run1.json): q/k/v 1 token 24.3 -> 11.7 us, 8 tokens 39.1 -> 18.9;
#: gate/up 22.0 -> 11.7 and 40.2 -> 25.1; down 25.2 -> 17.2 and 41.2 -> 24.7.
WIDE_RANK, WIDE_RANK_MAX_TOKENS = 64, 16
#: The wide-rank regime's shrink: ``(cap on the K split, block_k or None for the launcher's default)``. The
#: session-18 shrink sweep at rank 64, 1-8 tokens found 32 splits of 64-wide K blocks best for the shrink alone
#: (67 -> 53 us summed over the layer's groups; 32 splits of d_in 4096 need block_k <= 64); whether the expand's
#: extra partials eat that is for ``bench_lora_overlap.py --wide-shrink 32,64`` to measure.
WIDE_SHRINK: tuple[int, int | None] = (16, None)


#: Decode expand from a pool of rank <= 16 (``plan.block_m <= 16``: steps of at most 512 tokens): rows of
#: ``(max tokens, tiles, block_n, num_stages)``; the first row whose max tokens >= T gives the output tiles looped per
#: program (``_sgmv_expand_kernel``'s ``TILES``, the B tiles kept in flight by the pipeliner), their width and the
#: loop's stages. H200 sweep, each token its own adapter, the four fused projections of a Llama-3-8B layer
#: (``python bench/tune_lora_kernels.py --decode-expand``; bench/results/session16/): summed expand time 24.9 ->
#: 15.6 us at 8 tokens, 72.3 -> 45.5 us at 64, 189 -> 124 us at 256 against one 256-wide tile per program (the
#: table ``((512, 1, 256, 2),)``, what ran before). The row boundary at 16 tokens is an existing regime boundary
#: (``WIDE_RANK_MAX_TOKENS``), so ``Engine.warmup`` compiles both.
DECODE_EXPAND_LOOP: tuple[tuple[int, int, int, int], ...] = ((16, 2, 256, 4), (512, 4, 128, 3))


#: Warps of a decode shrink program (``plan.block_m <= 16``) outside the wide-rank regime (``_wide``: that one keeps
#: 4; prefill takes 4). H200 sweeps, each token its own adapter, the four fused projections of a Llama-3-8B layer
#: (``python bench/tune_lora_kernels.py --decode-shrink [--rank 64 --tokens 1,8,64]``; bench/results/session18/):
#: rank 16 at 8 / 64 / 256 tokens, the default block_k and split with 2 warps instead of 4 is within 3% of each
#: case's best of 55 configurations (geometric mean; 4 warps 17% above), summed at 64 tokens 40.7 -> 35.6 us; rank 64
#: at 64 tokens 123.0 -> 99.4 us (within 0.4% of the best). At rank 64 and 1-8 tokens 2 warps gain nothing at the
#: wide regime's split (16); the best there splits K 32 ways (67 -> 53 us) but costs the expand more partials
#: (not measured together yet).
DECODE_SHRINK_WARPS = 2

#: ``(block_n, num_warps)`` of the decode expand (``plan.block_m <= 16``) from a pool of rank > 16 (rank <= 16
#: pools take ``DECODE_EXPAND_LOOP``'s looped tiles). H200 sweep at rank 64 (``--decode-expand --rank 64 --tokens
#: 1,8,64``; bench/results/session18/): summed over q/k/v, o, gate/up, 76.5 -> 60.7 us at 1 and 8 tokens against
#: 256-wide 2-warp programs, and q/k/v + o 61.0 -> 38.8 us at 64 tokens against 256-wide 4-warp ones (o alone
#: 41.1 -> 19.3). ``None``: the launcher's older defaults (what ran before session 18).
DECODE_EXPAND_RANK_TILES: tuple[int, int] | None = (128, 2)

#: ``(min_tokens, max_tokens, min_d_out, block_n, num_warps)``: a decode expand of ``min_tokens``..``max_tokens``
#: tokens from a pool of rank > 16 whose slices' output width sums to at least ``min_d_out`` (Llama-3-8B's fused
#: gate/up: 2 x 14,336) takes these tiles instead of ``DECODE_EXPAND_RANK_TILES``. H200, rank 64, gate/up alone, each
#: token its own adapter (``tune_lora_kernels.py --decode-expand --rank 64 --groups 8b-gate_up``,
#: bench/results/session29/calls 2-3), us at (128, 2) -> (256, 4): 32 tokens 52.4 -> 87.9, **48 69.1 -> 57.5, 64 88.5
#: -> 75.3**, 96 107.3 -> 110.1, 128 142.4 -> 145.8, 256 277.8 -> 287.8; q/k/v, o and down (4,096-6,144 wide) are
#: fastest at (128, 2) and lose 4-22 us at (256, 4) at 64 tokens (session 19). The layer's seven projections at rank
#: 64, 64 tokens (``bench_lora_overlap.py --cases all --tokens 64 [--expand-wide-out none]``): LoRA adds 216-219 ->
#: 206-209 us on the side stream (73% -> 77% of copy bandwidth on its 671 MB), 239-240 -> 227-228 serial. ``None``:
#: every width takes ``DECODE_EXPAND_RANK_TILES`` (what ran before session 29).
DECODE_EXPAND_RANK_WIDE_OUT: tuple[int, int, int, int, int] | None = (48, 64, 16384, 256, 4)


#: Prefill tiles (``plan.block_m > 16``: steps of more than 512 tokens) from a pool whose ``max_rank`` (the engine's
#: ``max_lora_rank``, default 64: then these do not apply) is <= 16, in bf16 / fp16 on a GPU: the shrink's
#: ``block_k`` (its K split still computed as for the 256-wide blocks that ran before), and the ``block_n`` of an
#: expand that writes the LoRA term (``overwrite=True``: ``lora_delta``, the engine's in-place path from
#: ``runtime.model.LORA_BEFORE_GEMM_MIN_TOKENS``). H200, bf16, 4,096 tokens on 8 adapters (runs of 512), each kernel
#: alone per fused projection of a Llama-3-8B layer, the default against the sweep in one run (``python
#: bench/tune_lora_kernels.py --prefill``, bench/results/session30/call4/), us: shrink with block_k 256 -> 128 (split
#: 4 / 8 / 4 / 8, 4 warps) q/k/v 30.6 -> 19.7, o 17.7 -> 12.7, gate/up 21.6 -> 16.1, down 38.4 -> 33.9 (108 -> 82
#: summed; block_m 128 would give 77 but the plan's chunks are shared with the expand, fastest at 64); expand writing,
#: block_n 128 -> 256 (4 warps) q/k/v 29.8 -> 27.8, o 31.4 -> 20.8, gate/up 119.7 -> 116.6, down 30.8 -> 20.4 (211 ->
#: 186 summed); the same bits in every case. Not measured in the engine yet. ``None``: the launcher's older defaults
#: (256 and 128; what ran before session 30).
PREFILL_SHRINK_BLOCK_K: int | None = 128
PREFILL_WRITE_BLOCK_N: int | None = 256
#: ``(tiles, block_n, num_stages)`` of a prefill expand that writes the LoRA term (``overwrite=True``, chunks of
#: ``block_m > 16``) from a pool of max rank <= 16, bf16 / fp16 on a GPU: the looped tiles of the decode expand
#: (``DECODE_EXPAND_LOOP``: one v tile per program, ``tiles`` B tiles of ``block_n`` in a loop, the next in flight
#: while the last is stored), so each program's prologue (chunk, slot, rank, offset, scaling: dependent loads) is paid
#: once per ``tiles * block_n`` columns. The writing expand alone at 4,096 tokens wrote y at 1.6-2.0 TB/s with one
#: tile per program in every configuration of session 30's sweep. H200, bf16, 4,096 tokens on 64 adapters (runs of
#: 64), 4 warps, summed over the four fused projections of a Llama-3-8B layer (``python bench/tune_lora_kernels.py
#: --prefill --prefill-kernels expand --adapters 64``, bench/results/session31/call3/), us: one 256-wide tile per
#: program (session 30) 217.6; 2 x 256 200.0; **4 x 128 153.3** (q/k/v 32.0 -> 23.8, o 24.1 -> 17.7, gate/up 137.5
#: -> 94.2, down 24.1 -> 17.6; gate/up alone is best at 8 x 128, 92.5); 8 warps slower in each looped case; the same
#: bits. In the engine (``bench_generate.py``, batch 64, TTFT of 64 x 512-token prompts) 2 x 256 against one tile
#: measured 0.901 against 0.894 s, within its spread. ``None``: one tile per program (``PREFILL_WRITE_BLOCK_N``; what
#: ran before session 31).
PREFILL_WRITE_LOOP: tuple[int, int, int] | None = (4, 128, 2)


#: Launch the shrink and expand with programmatic dependent launch (PDL) on GPUs that have it (compute capability
#: 9.0+: Hopper, Blackwell): each kernel may start launching while the kernel before it on the stream drains, reads
#: its slot, rank, offset and scaling, and waits (``_pdl_wait``) before its first read of activations; an expand thus
#: starts while its shrink's last programs run instead of after the shrink has completed and the launch latency.
#: Not in the wide-rank regime past one token (``_use_pdl``). False: plain launches (what ran before session 20).
#: Captured CUDA graphs keep the programmatic edges. H200, one Llama-3-8B layer's seven projections in a CUDA graph,
#: each token its own adapter, LoRA added in place (bench/results/session20/call3, two runs each, us the LoRA adds):
#: rank 16 at 1 / 8 / 64 tokens 29.8 -> 21.5, 35.1 -> 27.5, 78.2 -> 76.2; rank 64 at 1 / 64 tokens 70.6 -> 60.0,
#: 247.1 -> 238.6; but rank 64 at 8 tokens (the wide regime: 16-way split shrink, 2-warp expand) 86.7 -> 108.5, and
#: the same with the trigger at exit (``PDL_EARLY_TRIGGER = False``): hence plain launches there.
PDL = True
#: With PDL, whether a program lets the next kernel launch right after its wait (``griddepcontrol.launch_dependents``)
#: rather than when it exits (session 20: right after the wait was as fast or faster in every case measured).
PDL_EARLY_TRIGGER = True


def _pdl(device: torch.device) -> bool:
    """Whether launches on ``device`` may use PDL (``PDL`` and a CUDA device of compute capability >= 9:
    ``triton_pdl.has_pdl``)."""
    return PDL and triton_pdl.has_pdl(device)


def _use_pdl(device: torch.device, T: int, rmax: int) -> bool:
    """Whether a launch of ``T`` tokens from a pool of rank ``rmax`` on ``device`` uses PDL: ``_pdl``, except the
    wide-rank regime (``_wide``) past one token, where it measured slower (``PDL``)."""
    return _pdl(device) and not (_wide(T, rmax) and T > 1)


def decode_expand_tiles(T: int) -> tuple[int, int | None, int | None]:
    """``(tiles, block_n, num_stages)`` of ``DECODE_EXPAND_LOOP``'s row for a decode step of ``T`` tokens (a pool of
    rank <= 16, on a GPU); ``(1, None, None)`` (the launcher's defaults) past its last row."""
    return next((row[1:] for row in DECODE_EXPAND_LOOP if T <= row[0]), (1, None, None))


def _wide(T: int, rmax: int) -> bool:
    return rmax >= WIDE_RANK and T <= WIDE_RANK_MAX_TOKENS


def shrink_block_k(device_type: str, dtype: torch.dtype, T: int, block_m: int, rmax: int) -> tuple[int, int | None]:
    """The shrink's default ``(block_k, split_block)`` for a step of ``T`` tokens in chunks of ``block_m`` from a pool
    of rank ``rmax``: 64 on the CPU; 128 for fp32 and decode-sized steps (T <= 512) and 256 for prefill (H200,
    ``bench/tune_lora_kernels.py``), except prefill chunks (``block_m > 16``) of a pool of max rank <= 16, which take
    ``PREFILL_SHRINK_BLOCK_K`` with the K split still computed for 256 (``split_block``; None: for block_k itself)."""
    if device_type == "cpu":
        return 64, None
    if dtype == torch.float32 or T <= 512:
        return 128, None
    if block_m > 16 and rmax <= 16 and PREFILL_SHRINK_BLOCK_K is not None:
        return PREFILL_SHRINK_BLOCK_K, 256  # session 30's prefill sweep
    return 256, None


def expand_block_n(device_type: str, dtype: torch.dtype, T: int, block_m: int, rmax: int, overwrite: bool) -> int:
    """The expand's default ``block_n`` where no decode rule (``DECODE_EXPAND_LOOP``, ``DECODE_EXPAND_RANK_TILES``)
    sets it: 64 on the CPU; 256 for decode-sized steps (T <= 512: fewer, larger B reads) and 128 for prefill (H200),
    except a bf16 / fp16 prefill expand that writes (``overwrite``, chunks of ``block_m > 16``, a pool of max rank
    <= 16), which takes ``PREFILL_WRITE_BLOCK_N`` (used only when ``PREFILL_WRITE_LOOP`` is None: the looped tiles
    bring their own ``block_n``, ``prefill_write_tiles``)."""
    if device_type == "cpu":
        return 64
    if overwrite and dtype != torch.float32 and block_m > 16 and rmax <= 16 and PREFILL_WRITE_BLOCK_N is not None:
        return PREFILL_WRITE_BLOCK_N  # session 30's prefill sweep
    return 256 if T <= 512 else 128


def prefill_write_tiles(device_type: str, dtype: torch.dtype, block_m: int, rmax: int,
                        overwrite: bool) -> tuple[int, int, int] | None:
    """``PREFILL_WRITE_LOOP``'s ``(tiles, block_n, num_stages)`` for an expand of chunks of ``block_m`` from a pool
    of rank ``rmax`` where it applies: one that writes the LoRA term (``overwrite``), prefill chunks (``block_m >
    16``), a pool of max rank <= 16 (one v tile), bf16 / fp16 on a GPU; else None (one tile per program)."""
    if (PREFILL_WRITE_LOOP is None or not overwrite or block_m <= 16 or rmax > 16 or device_type != "cuda"
            or dtype == torch.float32):
        return None
    return PREFILL_WRITE_LOOP


def _split_k(device: torch.device, programs: int, d_in: int, block_k: int, max_split: int = 32) -> int:
    """Split the shrink's K loop when too few programs would fill the GPU (decode). Depends on sizes only."""
    if device.type != "cuda":
        return 1
    want = 4 * num_sms(device.index or 0)  # 4 programs per SM: best of 1x/2x/4x in the H200 sweep
    split = 1
    while split * programs < want and d_in >= 2 * split * block_k and split < max_split:
        split *= 2
    return split


#: size a step's grid by its bound on distinct slots (``LoRAPlan.num_segments``) rather than the pool's ``max_slots``
#: (session 33: an engine's default pool has 256-4,096 slots, so a 4,096-token prefill on 64 adapters launched ~7x
#: the chunk programs it has, the rest returning at once); False: the bound for any grouping (an A/B switch)
GRID_BY_SEGMENTS = True
#: compute the shrink's K split from the launched grid (``num_chunks``) instead of the bound (``chunk_bound``): with
#: the smaller grid a mid-size step may leave SMs idle at the bound's split, and a larger split fills them, at other
#: bits (the partials sum in another order; within the reference), and the split, a compile-time constant of the
#: expand, then depends on how a step is grouped, so serving can meet variants the warm-up did not compile (rows'
#: ``kernel_compiles``). Off: the bits of the bound (an A/B switch, not yet measured: ``bench_generate.py`` provider
#: ``multilora-lora-gridsplit``)
SPLIT_BY_GRID = False


def chunk_bound(plan: LoRAPlan, slices: LoRASlices) -> int:
    """``min(T, cdiv(T, block_m) + max_slots)``: chunks enough for any grouping of T tokens (a function of the token
    count and the pool only, so CUDA-graph safe). The shrink's K split is computed from it, whatever the grid."""
    T = plan.num_tokens
    return min(T, triton.cdiv(T, plan.block_m) + slices.max_slots)


def num_chunks(plan: LoRAPlan, slices: LoRASlices) -> int:
    """The grid's chunk count: ``chunk_bound``, or with a bound on the step's distinct slots
    (``plan.num_segments``) ``min(T, cdiv(T, block_m) + num_segments)``: the step's chunks are at most
    ``cdiv(n, block_m) + num_segments`` for its ``n <= T`` adapted tokens, and at least ``cdiv(T, block_m)`` programs
    keep the OVERWRITE expand's zeroing of unadapted rows (a grid-stride loop) spread as before. Same bits either way:
    the programs past the chunks return at once."""
    T, seg = plan.num_tokens, plan.num_segments
    if seg is None or not GRID_BY_SEGMENTS:
        return chunk_bound(plan, slices)
    return min(T, triton.cdiv(T, plan.block_m) + min(seg, slices.max_slots))


def check_io(slices: LoRASlices, plan: LoRAPlan, **tensors: torch.Tensor) -> None:
    """Per-call checks of activations (``x=``, ``y=``) against the pool: what can change between calls
    (everything static was checked by ``lora_slices``).

    Raises:
        ValueError: a dtype that is not fp16/bf16/fp32 or differs from the pool buffer's; a tensor or the
            plan on another device than the pool; a non-unit stride along features.
    """
    buf = slices.buffer
    for name, t in tensors.items():
        if t.dtype not in _DTYPES:
            raise ValueError(f"{name}: expected float16, bfloat16 or float32, got {t.dtype}")
    if any(t.dtype != buf.dtype for t in tensors.values()):
        got = ", ".join(f"{name} is {t.dtype}" for name, t in tensors.items())
        raise ValueError(f"dtype mismatch: {got}, the adapter pool buffer is {buf.dtype}; "
                         "cast the activations to the pool's dtype (the kernels do not mix dtypes)")
    for name, t in (*tensors.items(), ("plan.chunks", plan.chunks)):
        if t.device != buf.device:
            raise ValueError(f"{name}: expected device {buf.device} (the pool's), got {t.device}")
    for name, t in tensors.items():
        if t.stride(1) != 1:
            raise ValueError(f"{name}: expected unit stride along features, got strides {t.stride()}")


def check_v(v: torch.Tensor, slices: LoRASlices, plan: LoRAPlan) -> None:
    """``v`` is ``sgmv_shrink``'s output for ``slices`` and ``plan``: contiguous fp32 ``[split_k, num_slices, T,
    slices.max_rank_rows]``.

    Raises:
        ValueError: naming ``v``, the shape expected and the dtype and shape got.
    """
    want = (slices.num_slices, plan.num_tokens, slices.max_rank_rows)
    if v.dim() != 4 or tuple(v.shape[1:]) != want or v.dtype != torch.float32 or not v.is_contiguous():
        raise ValueError(f"v: expected contiguous float32 [split_k, {', '.join(map(str, want))}], got "
                         f"{v.dtype} {tuple(v.shape)}")


def _check_rows(name: str, t: torch.Tensor, rows: int, cols: int) -> None:
    if tuple(t.shape) != (rows, cols):
        raise ValueError(f"{name}: expected shape [{rows}, {cols}], got {tuple(t.shape)}")


def _shrink(x: torch.Tensor, slices: LoRASlices, plan: LoRAPlan, *, block_k: int | None = None,
            split_k: int | None = None, num_warps: int | None = None, num_stages: int | None = None) -> torch.Tensor:
    T, d_in = x.shape
    S, rmax = slices.num_slices, slices.max_rank_rows
    wide = x.device.type == "cuda" and _wide(T, rmax)
    if num_warps is None:
        num_warps = DECODE_SHRINK_WARPS if x.device.type == "cuda" and plan.block_m <= 16 and not wide else 4
    chunks = num_chunks(plan, slices)
    if block_k is None and wide and WIDE_SHRINK[1]:
        block_k = WIDE_SHRINK[1]
    split_block = None  # the block_k that the K split is computed for, when it is not block_k itself
    if block_k is None:
        block_k, split_block = shrink_block_k(x.device.type, x.dtype, T, plan.block_m, rmax)
    cap = max(16, triton.next_power_of_2(d_in))
    block_k = min(block_k, cap)
    programs = (chunks if SPLIT_BY_GRID else chunk_bound(plan, slices)) * S  # (the bound: the split and so the bits
    # do not depend on how the step is grouped)
    split = split_k or _split_k(x.device, programs, d_in, min(split_block or block_k, cap),
                                WIDE_SHRINK[0] if wide else 32)
    k_per = triton.cdiv(triton.cdiv(d_in, split), block_k) * block_k
    v_out = torch.empty(split, S, T, rmax, dtype=torch.float32, device=x.device)
    extra = {} if num_stages is None else {"num_stages": num_stages}
    if _use_pdl(x.device, T, rmax):
        extra.update(PDL=True, PDL_TRIGGER=PDL_EARLY_TRIGGER, launch_pdl=True)
    _sgmv_shrink_kernel[(chunks * S, split)](
        x, slices.buffer, slices.offsets_a, slices.ranks, v_out, plan.chunks,
        T, d_in, k_per, slices.meta_stride,
        x.stride(0), plan.chunks.stride(0),
        NUM_SLICES=S, RMAX=rmax, BLOCK_M=plan.block_m, BLOCK_R=16, BLOCK_K=block_k, ALIGN=slices.align,
        IEEE=x.dtype == torch.float32, num_warps=num_warps, **extra,
    )
    return v_out


def _expand(y: torch.Tensor, v: torch.Tensor, slices: LoRASlices, plan: LoRAPlan, *, block_n: int | None = None,
            num_warps: int | None = None, num_stages: int | None = None, tiles: int | None = None,
            overwrite: bool = False) -> torch.Tensor:
    split, S, T, rmax = v.shape
    # the looped tiles (one v tile, TILES B tiles per program): decode chunks of a rank-16 pool, prefill chunks of one
    # that write the LoRA term (prefill_write_tiles), and any chunks of one when ``tiles`` is given
    prefill_loop = prefill_write_tiles(y.device.type, y.dtype, plan.block_m, rmax, overwrite)
    loop = rmax <= 16 and (plan.block_m <= 16 or prefill_loop is not None or tiles is not None)
    if y.device.type == "cuda" and plan.block_m <= 16 and rmax > 16 and DECODE_EXPAND_RANK_TILES is not None:
        tiles_bn, tiles_nw = DECODE_EXPAND_RANK_TILES
        wide_out = DECODE_EXPAND_RANK_WIDE_OUT
        if (wide_out is not None and wide_out[0] <= T <= wide_out[1]
                and sum(vw.d_out for vw in slices.views) >= wide_out[2]):
            tiles_bn, tiles_nw = wide_out[3:]
        block_n = block_n or tiles_bn
        num_warps = num_warps or tiles_nw
    if num_warps is None:
        num_warps = 2 if y.device.type == "cuda" and _wide(T, rmax) else 4
    if tiles is None and loop and y.device.type == "cuda":
        tiles, bn, stages = prefill_loop or decode_expand_tiles(T)
        block_n = block_n or bn
        num_stages = num_stages or stages
    group = (tiles or 1) if loop else 1
    if block_n is None:
        block_n = expand_block_n(y.device.type, y.dtype, T, plan.block_m, rmax, overwrite)
    n_tiles = sum(triton.cdiv(vw.d_out, group * block_n) for vw in slices.views)
    if num_stages is None and y.device.type == "cuda" and T <= 512:
        # decode: one rank tile per program (r <= 16), nothing to pipeline; 2 stages leave more shared memory
        # for resident programs (H200 sweep, bench/results/tune.log: 59 vs 80 us at T = 512 distinct)
        num_stages = 2
    extra = {} if num_stages is None else {"num_stages": num_stages}
    if _use_pdl(y.device, T, rmax):
        extra.update(PDL=True, PDL_TRIGGER=PDL_EARLY_TRIGGER, launch_pdl=True)
    _sgmv_expand_kernel[(num_chunks(plan, slices), n_tiles)](
        y, slices.buffer, slices.offsets_b, slices.ranks, slices.scalings, slices.table, v, plan.chunks,
        plan.token_slots, T, *tile_ends(slices, group * block_n), slices.meta_stride,
        y.stride(0), plan.chunks.stride(0),
        NUM_SLICES=S, SPLIT_K=split, RMAX=rmax, BLOCK_M=plan.block_m,
        BLOCK_N=block_n, BLOCK_R=16, ALIGN=slices.align, IEEE=y.dtype == torch.float32, TILES=group,
        OVERWRITE=overwrite, num_warps=num_warps, **extra,
    )
    return y


def sgmv_shrink(x: torch.Tensor, slices: LoRASlices, plan: LoRAPlan, *, block_k: int | None = None,
                split_k: int | None = None, num_warps: int | None = None,
                num_stages: int | None = None) -> torch.Tensor:
    """Shrink: ``v[sp, i, t, :r] = partial (over K split sp) of x[t] @ A_i[slot[t]].T``.

    Args:
        x: ``[T, slices.d_in]`` fp16/bf16/fp32 (the pool's dtype), unit stride along features.
        slices, plan: the fused slices and the step's plan (``T = plan.num_tokens``).
        block_k, split_k, num_warps, num_stages: tile overrides (None = the measured defaults).

    Returns:
        fp32 ``[SPLIT_K, num_slices, T, slices.max_rank_rows]``; rows that no chunk covers (slot -1, ranks
        beyond r) are left unwritten and never read by ``sgmv_expand``.

    Raises:
        ValueError: ``x`` of the wrong shape, dtype, device or stride (``check_io``).
    """
    check_io(slices, plan, x=x)
    _check_rows("x", x, plan.num_tokens, slices.d_in)
    return _shrink(x, slices, plan, block_k=block_k, split_k=split_k, num_warps=num_warps, num_stages=num_stages)


def sgmv_expand(y: torch.Tensor, v: torch.Tensor, slices: LoRASlices, plan: LoRAPlan, *, block_n: int | None = None,
                num_warps: int | None = None, num_stages: int | None = None, tiles: int | None = None,
                overwrite: bool = False) -> torch.Tensor:
    """Expand: ``y[t, c_i + n] += scalings_i[s] * sum_sp v[sp, i, t, :r] @ B_i[s].T[:r, n]`` in place; with
    ``overwrite``, ``y[t, c_i + n] = ...`` instead (the term rounded to y's dtype, bit for bit what the in-place
    add gives on a zeroed y) and every other element of y (rows of slot -1, slices of rank 0) set to 0: y's old
    values are never read.

    Args:
        y: ``[T, slices.d_out]`` fp16/bf16/fp32 (the pool's dtype), unit stride along features; updated in place.
        v: ``sgmv_shrink``'s fp32 ``[SPLIT_K, num_slices, T, slices.max_rank_rows]``.
        slices, plan: as for ``sgmv_shrink``.
        block_n, num_warps, num_stages: tile overrides (None = the measured defaults).
        tiles: output tiles of ``block_n`` columns per program, looped (None = ``DECODE_EXPAND_LOOP``'s for decode
            chunks, ``plan.block_m <= 16``, and ``PREFILL_WRITE_LOOP``'s for a writing prefill expand:
            ``prefill_write_tiles``); used by pools of rank <= 16 only (one v tile), else 1.
        overwrite: write the LoRA term instead of adding it (above).

    Returns:
        ``y``.

    Raises:
        ValueError: ``y`` or ``v`` of the wrong shape, dtype, device or stride.
    """
    check_io(slices, plan, y=y)
    _check_rows("y", y, plan.num_tokens, slices.d_out)
    check_v(v, slices, plan)
    return _expand(y, v, slices, plan, block_n=block_n, num_warps=num_warps, num_stages=num_stages, tiles=tiles,
                   overwrite=overwrite)


#: ``glu_shrink``'s tiles on a GPU: ``(block_m, block_k, num_warps)`` for steps of more than 512 tokens, else
#: ``(16, block_k, num_warps)``. Not yet timed on a GPU (written in session 43, which had no device): the largest
#: tiles that compile for sm_90 (Triton 3.9, bf16, ranks 16 and 64) without spilling registers: 64 x 64 with 8 warps
#: uses 212 registers and no stack; 64 x 128 with 4 warps 255 and 1,064-1,568 bytes of stack (``cuobjdump
#: -res-usage``); 64 x 32 with 4 warps 219, 16 x 128 with 4 warps 158.
GLU_SHRINK_TILES: tuple[int, int, int] = (64, 64, 8)


def glu_shrink(gate_up: torch.Tensor, slices: LoRASlices, plan: LoRAPlan, *, gelu_tanh: bool = False,
               block_m: int | None = None, block_k: int | None = None, split_k: int | None = None,
               num_warps: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated activation of the MLP and the down projection's LoRA shrink in one launch: ``h = act(gate) * up``
    (``fused.silu_mul_torch``, or ``gelu_tanh_mul_torch`` with ``gelu_tanh``; the rounding of
    ``triton_fused._glu_kernel``) and ``v = sgmv_shrink(h, slices, plan)``'s partials, computed from h while it is in
    registers, so the shrink does not read h back (at a 4,096-token Llama-3-8B prefill h is 117 MB a layer).

    Programs take ``block_m`` consecutive tokens (all of them: rows of slot -1 get their activation, no shrink) and
    one of ``split_k`` column ranges of the intermediate; a block's distinct slots run one after the other, the
    first pass storing h for every row (a prefill block holds one slot, or two where sequences meet).

    Args:
        gate_up: ``[T, 2 I]`` = ``[gate | up]`` fp16/bf16/fp32 (the pool's dtype), unit stride along features.
        slices: the down projection's ``LoRASlices`` (one slice, ``d_in == I``).
        plan: the step's ``LoRAPlan`` (``T = plan.num_tokens``; its ``token_slots`` are read, not its chunk table).
        gelu_tanh: GeGLU (Gemma 2) instead of SwiGLU.
        block_m, block_k, split_k, num_warps: tile overrides (None = ``GLU_SHRINK_TILES`` on a GPU, and a K split
            that gives 4 programs per SM, as the shrink's, of at most 8: the expand sums every split's partial).

    Returns:
        ``(h, v)``: h ``[T, I]`` in gate_up's dtype; v fp32 ``[split_k, 1, T, slices.max_rank_rows]``, the input of
        ``sgmv_expand`` (rows of slot -1 and ranks beyond a slot's rank unwritten, as ``sgmv_shrink``'s).

    Raises:
        ValueError: ``gate_up`` of the wrong shape, dtype, device or stride (``check_io``), or ``slices`` of more than
            one slice or of another width.
    """
    check_io(slices, plan, gate_up=gate_up)
    T, two_i = gate_up.shape
    inter = two_i // 2
    if slices.num_slices != 1:
        raise ValueError(f"slices: expected the down projection's one slice, got {slices.num_slices} slices")
    _check_rows("gate_up", gate_up, plan.num_tokens, 2 * slices.d_in)  # ([gate | up]: twice down's d_in)
    rmax = slices.max_rank_rows
    gpu = gate_up.device.type == "cuda"
    bm, bk, nw = GLU_SHRINK_TILES if gpu else (16, 32, 4)
    if T <= 512:
        bm = 16
    block_m, block_k, num_warps = block_m or bm, block_k or bk, num_warps or nw
    block_k = min(block_k, max(16, triton.next_power_of_2(inter)))
    if gpu and (block_m < 16 or block_k < 16):  # (the interpreter runs smaller ones; tl.dot compiles 16 and up)
        raise ValueError(f"block_m, block_k: expected at least 16 on a GPU (tl.dot), got {block_m}, {block_k}")
    programs = triton.cdiv(max(T, 1), block_m)
    split = split_k or _split_k(gate_up.device, programs, inter, block_k, max_split=8)  # (the expand sums them)
    k_per = triton.cdiv(triton.cdiv(inter, split), block_k) * block_k
    out = torch.empty(T, inter, dtype=gate_up.dtype, device=gate_up.device)
    v = torch.empty(split, 1, T, rmax, dtype=torch.float32, device=gate_up.device)
    if T == 0:
        return out, v
    extra = {}
    if _use_pdl(gate_up.device, T, rmax):
        extra.update(PDL=True, PDL_TRIGGER=PDL_EARLY_TRIGGER, launch_pdl=True)
    _glu_shrink_kernel[(programs, split)](
        gate_up, out, slices.buffer, slices.offsets_a, slices.ranks, plan.token_slots, v,
        T, inter, k_per, gate_up.stride(0), out.stride(0),
        GELU_TANH=bool(gelu_tanh), RMAX=rmax, BLOCK_M=block_m, BLOCK_R=max(16, triton.next_power_of_2(rmax)),
        BLOCK_K=block_k, ALIGN=slices.align, IEEE=gate_up.dtype == torch.float32, num_warps=num_warps, **extra,
    )
    return out, v


def lora_apply_triton(y: torch.Tensor, x: torch.Tensor, slices: LoRASlices, plan: LoRAPlan) -> torch.Tensor:
    """Triton backend of ``lora_apply``: ``y[t, c_i : c_i + d_out_i] += scalings_i[s] * (x[t] @ A_i[s].T) @ B_i[s].T``
    for every token with ``s = token_slots[t] >= 0`` (semantics and shapes: ``multilora.kernels.lora``, which
    checks the shapes); one shrink and one expand launch for all the slices. No host synchronisation, so a
    decode step can be captured in a CUDA graph.

    Raises:
        ValueError: dtypes of x, y and the pool buffer that differ or are not fp16/bf16/fp32; x, y or the plan
            on another device than the pool; non-unit feature strides.
    """
    check_io(slices, plan, x=x, y=y)
    if not plan.has_lora or plan.num_tokens == 0:
        return y
    return _expand(y, _shrink(x, slices, plan), slices, plan)


def lora_delta_triton(out: torch.Tensor, x: torch.Tensor, slices: LoRASlices, plan: LoRAPlan) -> torch.Tensor:
    """Triton backend of ``lora_delta``: ``out`` = every token's LoRA term (``lora_apply_triton``'s, rounded to
    out's dtype), 0 in the rows of slot -1 and the slices of rank 0; out's old values are never read, so it needs no
    zeroing (the expand writes every element: ``sgmv_expand(overwrite=True)``). One shrink and one expand launch; no
    host synchronisation.

    Raises:
        ValueError: as ``lora_apply_triton``, for ``out`` in place of y.
    """
    check_io(slices, plan, x=x, y=out)
    if not plan.has_lora or plan.num_tokens == 0:
        return out.zero_()
    return _expand(out, _shrink(x, slices, plan), slices, plan, overwrite=True)
