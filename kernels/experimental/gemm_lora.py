"""The base GEMM with the LoRA expand in its epilogue (prefill): ``y = x W^T + LoRA term`` in one kernel, the term
never written to memory nor read back. Waiting to be measured on an H200 (``bench/bench_gemm_lora.py``); the engine
does not call it.

Why: issue 12 asks a 4,096-token prefill on 64 rank-16 adapters to add at most 8% to a Llama-3-8B layer's base
GEMMs. The engine's path (``runtime.model.LORA_BEFORE_GEMM_MIN_TOKENS``: the shrink, the expand writing the term into
y, then cuBLAS adding ``x W^T`` to y in its epilogue) adds 13-16% (session 31, ``bench_lora_overlap.py --cases
prefill``): an unfused LoRA must move about 918 MB there (x into the shrinks, 213 MB; the term written and read back,
2 x 349 MB), 8.4% of the base layer at copy bandwidth alone. Here only the shrink's x read and its small fp32 ``v``
move; what the epilogue adds is a rank-wide dot per (output tile, distinct slot in its rows), small beside the K loop
of the tile (e.g. 16 against 4,096). Whether it wins hangs on this Triton GEMM keeping up with cuBLAS on the H200
(the bench times the kernel without LoRA against ``torch.matmul`` beside it).

For every row ``t`` with slot ``s = token_slots[t] >= 0``, every slice ``i`` (columns ``[c_i, c_i + d_out_i)``) of
rank ``r = ranks_i[s] > 0``::

    y[t, c_i + n] = rnd(sum_k x[t, k] W[c_i + n, k]  +  scalings_i[s] * sum_j v[t, i, j] B_i[s]^T[j, n])

summed in float32 into one accumulator (``v`` the shrink's fp32 partials summed over its K split, times the scaling,
cast to the weights' dtype for the dot; ``triton_sgmv``'s expand casts ``v`` and scales the dot's sum), rounded once
(``rnd``: to y's dtype); rows of slot -1 and slices of rank 0 get ``rnd(x W^T)``. The engine's path rounds the term
to y's dtype, then the sum: the two agree within a rounding of the term, not bit for bit.

Tiles: programs in groups of ``GROUP_M`` row tiles (``BLOCK_M`` rows) over the column tiles (``BLOCK_N``), K in
``BLOCK_K`` steps; ``tma``: x and W tiles through tensor descriptors (Hopper TMA), else pointer loads. A column tile
lies in one slice (every slice's width is a multiple of ``BLOCK_N``, checked), so its epilogue reads one slice's B.
Its row tile's distinct slots are visited in ascending order (``tl.min`` over the slots above the last one), each
with one masked ``[BLOCK_M, BLOCK_R] x [BLOCK_R, BLOCK_N]`` dot per 16 ranks: a prefill's sequences are contiguous
rows, so a 128-row tile meets one to three slots.
"""

from __future__ import annotations

import itertools

import torch
import triton
import triton.language as tl

from multilora.kernels.lora import MAX_SLICES, LoRAPlan, LoRASlices
from multilora.kernels.triton_sgmv import check_io, check_v, sgmv_shrink

_NO_SLOT = tl.constexpr(1 << 30)  # above any slot: the end of a tile's slot walk


@triton.jit
def _v_rows(v_ptr, sid, T, tok, j, vm, split_k, NUM_SLICES: tl.constexpr, RMAX: tl.constexpr,
            BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr):
    """fp32 ``[BLOCK_M, BLOCK_R]``: the shrink's ``v[:, sid, tok, j]`` summed over its ``split_k`` partials (``vm``
    masks rows and ranks), as ``triton_sgmv._v_tile`` with the split a runtime value: the shrink's split changes
    with the token count, and this kernel compiles one variant for every count."""
    vt = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for sp in range(split_k):
        v_rows = v_ptr + ((sp * NUM_SLICES + sid).to(tl.int64) * T + tok[:, None]) * RMAX
        vt += tl.load(v_rows + j[None, :], mask=vm, other=0.0)
    return vt


@triton.jit(do_not_specialize=["M", "split_k"])  # one compiled variant for every token count (as triton_sgmv's)
def _gemm_lora_kernel(
    x_ptr, w_ptr, x_desc, w_desc, y_ptr, v_ptr, slots_ptr, buf_ptr, offb_ptr, ranks_ptr, scal_ptr,
    M, N, K, stride_xm, stride_wn, stride_ym, meta_stride, e0, e1, e2, e3, split_k,
    NUM_SLICES: tl.constexpr, RMAX: tl.constexpr, LORA: tl.constexpr, TMA: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
    GROUP_M: tl.constexpr, ALIGN: tl.constexpr, IEEE: tl.constexpr, EVEN_K: tl.constexpr,
):
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n  # programs of GROUP_M row tiles over every column tile: W's tiles reused in L2
    first_m = (pid // per_group) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % size_m
    pid_n = (pid % per_group) // size_m
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if TMA:  # (the descriptors zero-fill past x's and W's edges)
        for k in range(0, tl.cdiv(K, BLOCK_K)):
            a = x_desc.load([pid_m * BLOCK_M, k * BLOCK_K])
            b = w_desc.load([pid_n * BLOCK_N, k * BLOCK_K])
            acc = _dot_acc(a, b.T, acc, IEEE)
    else:
        rk = tl.arange(0, BLOCK_K)
        # rows and columns past the edge read row M - 1's / column N - 1's neighbours wrapped (% M, % N): valid
        # addresses, no mask in the loop; their results are never stored
        x_ptrs = x_ptr + (rm % M).to(tl.int64)[:, None] * stride_xm + rk[None, :]
        w_ptrs = w_ptr + (rn % N).to(tl.int64)[None, :] * stride_wn + rk[:, None]
        for k in range(0, tl.cdiv(K, BLOCK_K)):
            if EVEN_K:
                a = tl.load(x_ptrs)
                b = tl.load(w_ptrs)
            else:
                k_mask = rk < K - k * BLOCK_K
                a = tl.load(x_ptrs, mask=k_mask[None, :], other=0.0)
                b = tl.load(w_ptrs, mask=k_mask[:, None], other=0.0)
            acc = _dot_acc(a, b, acc, IEEE)
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
    m_mask = rm < M
    n_mask = rn < N
    if LORA:
        # the column tile's slice (whole in one: the host checks the widths) from the slices' end columns
        c = pid_n * BLOCK_N
        sid = (c >= e0).to(tl.int32) + (c >= e1).to(tl.int32) + (c >= e2).to(tl.int32)
        start = tl.where(sid == 0, 0, tl.where(sid == 1, e0, tl.where(sid == 2, e1, e2)))
        end = tl.where(sid == 0, e0, tl.where(sid == 1, e1, tl.where(sid == 2, e2, e3)))
        d_out = end - start
        n_loc = rn - start
        tok = rm.to(tl.int64)
        slots = tl.load(slots_ptr + rm, mask=m_mask, other=-1)
        s = tl.min(tl.where(slots >= 0, slots, _NO_SLOT), axis=0)
        while s < _NO_SLOT:  # the tile's distinct slots, ascending
            r = tl.load(ranks_ptr + sid * meta_stride + s)
            off_b = tl.multiple_of(tl.load(offb_ptr + sid * meta_stride + s), ALIGN)
            scale = tl.load(scal_ptr + sid * meta_stride + s)
            rows = slots == s
            for j0 in tl.range(0, r, BLOCK_R, num_stages=1):  # (usually once: nothing to pipeline)
                j = j0 + tl.arange(0, BLOCK_R)
                j_mask = j < r
                vt = _v_rows(v_ptr, sid, M, tok, j, rows[:, None] & j_mask[None, :], split_k, NUM_SLICES, RMAX,
                             BLOCK_M, BLOCK_R)
                b_ptrs = buf_ptr + (off_b + j.to(tl.int64)[:, None] * d_out) + n_loc[None, :]
                bt = tl.load(b_ptrs, mask=j_mask[:, None] & n_mask[None, :], other=0.0)
                acc = _dot_acc((vt * scale).to(bt.dtype), bt, acc, IEEE)  # (into acc: no second accumulator)
            s = tl.min(tl.where(slots > s, slots, _NO_SLOT), axis=0)
    y_ptrs = y_ptr + rm.to(tl.int64)[:, None] * stride_ym + rn[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _dot_acc(a, b, acc, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


#: (block_m, block_n, block_k, group_m, num_warps, num_stages) on a GPU when none are given: the Triton matmul
#: tutorial's large-tile config for Hopper, not yet measured here (``bench/bench_gemm_lora.py`` sweeps a few)
GPU_TILES = (128, 128, 64, 8, 8, 3)
CPU_TILES = (16, 16, 16, 2, 4, 1)  # (the interpreter: small tiles, fast)


def fits(slices: LoRASlices, device: torch.device | str) -> bool:
    """Whether every slice of ``slices`` is a whole number of the default column tiles on ``device`` (``GPU_TILES``'
    ``block_n`` on CUDA, ``CPU_TILES``' elsewhere): what ``gemm_lora`` with the default tiles needs."""
    bn = (GPU_TILES if torch.device(device).type == "cuda" else CPU_TILES)[1]
    return all(vw.d_out % bn == 0 for vw in slices.views)


def gemm_lora(x: torch.Tensor, weight: torch.Tensor, slices: LoRASlices | None = None, plan: LoRAPlan | None = None,
              v: torch.Tensor | None = None, *, block_m: int | None = None, block_n: int | None = None,
              block_k: int | None = None, group_m: int | None = None, num_warps: int | None = None,
              num_stages: int | None = None, tma: bool = False) -> torch.Tensor:
    """``x W^T`` with each row's LoRA term added in the GEMM's epilogue (module docstring); without ``slices`` (or
    with a plan of no adapter) the plain GEMM.

    Args:
        x: ``[M, K]`` float16 / bfloat16 / float32, unit stride along K.
        weight: ``[N, K]`` (a linear layer's weight) of x's dtype, unit stride along K.
        slices: the projection's fused slices in the pool (``lora_slices``), ``slices.d_in == K`` and
            ``slices.d_out == N``; every slice's width a multiple of ``block_n``.
        plan: the step's ``LoRAPlan`` (``M`` tokens).
        v: the shrink of x (``triton_sgmv.sgmv_shrink(x, slices, plan)``, fp32 ``[split_k, num_slices, M,
            max_rank]``); None: computed here (one more launch).
        block_m, block_n, block_k, group_m, num_warps, num_stages: tiles (None: ``GPU_TILES`` on CUDA, ``CPU_TILES``
            under the interpreter); block sizes powers of two >= 16.
        tma: x and W tiles through tensor descriptors (needs 16-byte aligned rows; Hopper's TMA on a GPU).
            float32 on a GPU runs IEEE FMA dots at these tiles (254 registers, or spills with ``tma``: Triton 3.6 for
            sm_90): for tests, not speed.

    Returns:
        ``[M, N]`` in x's dtype, a new tensor.

    Raises:
        ValueError: shapes, dtypes, devices or strides that do not match (naming the argument); a block size that
            is not a power of two >= 16; a slice width that is not a multiple of ``block_n``; ``slices`` without
            ``plan``; ``tma`` with rows that are not 16-byte aligned.
    """
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"x, weight: expected [M, K] and [N, K], got {tuple(x.shape)} and {tuple(weight.shape)}")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32) or weight.dtype != x.dtype:
        raise ValueError(f"x, weight: expected one of float16, bfloat16, float32 for both, got {x.dtype} and "
                         f"{weight.dtype}")
    if x.device != weight.device or x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(f"x, weight: expected one device and unit stride along K, got {x.device} / {weight.device}, "
                         f"strides {x.stride()} / {weight.stride()}")
    M, K = x.shape
    N = weight.shape[0]
    cuda = x.device.type == "cuda"
    bm, bn, bk, gm, nw, ns = [a if a is not None else d for a, d in zip(
        (block_m, block_n, block_k, group_m, num_warps, num_stages), GPU_TILES if cuda else CPU_TILES)]
    for name, b in (("block_m", bm), ("block_n", bn), ("block_k", bk)):
        if b < 16 or b & (b - 1):
            raise ValueError(f"{name}: expected a power of two >= 16, got {b}")
    lora = slices is not None and plan is not None and plan.has_lora and M > 0
    if slices is not None:
        if plan is None:
            raise ValueError("plan: expected the step's LoRAPlan with slices, got None")
        check_io(slices, plan, x=x, weight=weight)
        if (slices.d_in, slices.d_out) != (K, N):
            raise ValueError(f"slices: expected d_in {K} and d_out {N} (x's and weight's), got {slices.d_in} and "
                             f"{slices.d_out}")
        if plan.num_tokens != M:
            raise ValueError(f"plan: expected x's {M} tokens, got {plan.num_tokens}")
        widths = [vw.d_out for vw in slices.views]
        if any(w % bn for w in widths):
            raise ValueError(f"block_n: every slice's width must be a multiple of it (one slice per column tile), "
                             f"got block_n {bn} and widths {widths}")
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return y
    if lora:
        v = sgmv_shrink(x, slices, plan) if v is None else v
        check_v(v, slices, plan)
        ends = list(itertools.accumulate(vw.d_out for vw in slices.views))  # each slice's end column
        ends += [1 << 30] * (MAX_SLICES - len(ends))
        meta = (v, plan.token_slots, slices.buffer, slices.offsets_b, slices.ranks, slices.scalings)
        consts = dict(NUM_SLICES=slices.num_slices, RMAX=v.shape[3], ALIGN=slices.align)
        stride, split = slices.meta_stride, v.shape[0]
    else:
        ends, stride, split = [N, 1 << 30, 1 << 30, 1 << 30], 0, 1
        meta = (y, y, y, y, y, y)  # (not read)
        consts = dict(NUM_SLICES=1, RMAX=16, ALIGN=1)
    x_desc = w_desc = x  # (not read without TMA)
    if tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        for name, t in (("x", x), ("weight", weight)):
            if t.data_ptr() % 16 or (t.stride(0) * t.element_size()) % 16:
                raise ValueError(f"{name}: tma=True needs a 16-byte aligned base and rows, got strides {t.stride()} of "
                                 f"{t.element_size()}-byte elements")
        x_desc = TensorDescriptor.from_tensor(x, [bm, bk])
        w_desc = TensorDescriptor.from_tensor(weight, [bn, bk])
    extra = {"num_stages": ns} if cuda else {}
    grid = (triton.cdiv(M, bm) * triton.cdiv(N, bn),)
    _gemm_lora_kernel[grid](
        x, weight, x_desc, w_desc, y, *meta, M, N, K, x.stride(0), weight.stride(0), y.stride(0), stride, *ends, split,
        LORA=lora, TMA=tma, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, BLOCK_R=16, GROUP_M=gm,
        IEEE=x.dtype == torch.float32, EVEN_K=K % bk == 0, num_warps=nw, **consts, **extra,
    )
    return y
