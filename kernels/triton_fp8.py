"""Triton kernels for ``multilora.kernels.fp8``: the fp8-weight GEMMs (weight-only, and for up to 64 rows also with
fp8 activations) and the per-token activation quantization. Semantics are those of ``fp8.fp8_linear(method=
"dequant")`` (weight-only), of method "scaled_mm" (fp8 activations) and of ``fp8.quantize_per_token_torch``.

- ``_w8_gemv_splitk_kernel`` (M <= 64: decode): the same product split over K too, so that a few rows still
  give every SM several programs streaming weight bytes; each program writes an fp32 partial and the last of a
  column block's programs (a ticket counter, reset by it) sums them in a fixed order and stores y. One launch, no
  memset: the workspace and tickets persist per shape. Runs where the GPU's tuned table has no entry for the
  shape and row class (tiles of ``bench/results/fp8/fp8_gemm.md``).
- ``_w8_gemv2_kernel`` (M <= 64, where the GPU's tuned table has the shape: ``gemv_config``): the same split-K
  scheme with a runtime split count, an accumulate-then-sum CUDA-core path for one row, and ``FP8_X``: per-token
  fp8 activations on fp8 tensor cores (method "scaled_mm"'s product). On the H200 a layer's four GEMMs take 1.13-1.22x
  less time than with the first kernel at 1-16 rows (``bench/results/fp8/README.md``, session 9); the first stays for GPUs nobody has tuned
  (its tiles were measured; the second's defaults would not be). ``SWAP`` takes the tensor-core product as
  ``w @ x^T``.
- ``_w8_gemv_tma_kernel`` (``fp8_gemv2(fp8_x=True, tma=True)``, where a tuned entry says ``"tma": true``): the
  ``FP8_X`` product with both tiles loaded through host-built tensor descriptors (TMA on Hopper: one bulk copy per
  tile into a multi-stage shared-memory pipeline). Compiled for sm_90 (Triton 3.6), the pointer kernel's 64-row
  fp8-activation tile holds 255 registers and spills, where the TMA tile of the same shape takes 126 and none. On
  the H200 (session 25, ``bench/results/session25/``) a layer's four GEMMs at 64 rows take 80.6 us against 93.0
  with the pointer tiles, at 16 rows 75.4 against 83.8. Tiles of x that run past its edge are zero-filled by the
  TMA unit, which measured slower the more rows it fills (48 rows 84.4 us, 40 rows 98.8 us, 32 rows with 32-row
  tiles 98.3 us); so the fp8 activations are quantized into buffers of at least 64 rows (``fp8.empty_fp8_rows``)
  and a TMA tile (not swapped) reads all 64 from memory, the rows past M computed and never stored: 24-40 rows then
  take the 64-row time, 80-81 us (session 26, ``bench/results/session26/``).
- ``_w8_gemm_kernel`` (M > 64): ``y[M, N] = x[M, K] @ (Wq[N, K] * s[N])^T (+ b)``. Programs tile (N, M); each loops
  over K, loading an fp8 [BLOCK_K, BLOCK_N] weight tile (1 byte per weight), widening it to x's dtype in registers
  and accumulating with ``tl.dot`` in fp32. The column scale and the bias are applied once, after the K loop.
- ``_quant_kernel``: one program per token: the row in registers, its absmax, the scale and the fp8 row.

Grids depend only on shapes, so all of them are safe inside CUDA graphs. On GPUs of compute capability 9.0+ every
kernel here is launched with programmatic dependent launch (``triton_pdl``): its programs wait for the kernels
before them first, so a GEMV's programs are already placed when the op before it (a norm, SiLU * up) completes.
The row count ``M`` is not specialised on (``do_not_specialize``): one compiled variant serves every batch size,
so a new batch size never stalls a step on a compile.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path
from typing import Any

import torch
import triton
import triton.language as tl

from multilora.kernels import triton_pdl
from multilora.kernels.backends import num_sms as num_sms_of
from multilora.kernels import fp8 as _fp8
from multilora.kernels.fp8 import _MIN_SCALE, FP8_DTYPE, FP8_MAX, empty_fp8_rows
from multilora.kernels.triton_pdl import pdl_wait

MAX_QUANT_ROW = 65536
log = logging.getLogger("multilora")


@triton.jit
def _store_scaled(y_ptr, s_ptr, b_ptr, stride_ym, offs_m, offs_n, m_mask, n_mask, acc, HAS_BIAS: tl.constexpr):
    """``y[offs_m, offs_n] = acc * s[offs_n] (+ b[offs_n])``, fp32 ``acc`` [BLOCK_M, BLOCK_N] rounded once to y's dtype."""
    acc = acc * tl.load(s_ptr + offs_n, mask=n_mask, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


@triton.jit(do_not_specialize=["M"])
def _w8_gemm_kernel(x_ptr, w_ptr, s_ptr, b_ptr, y_ptr,
                    M, N, K,
                    stride_xm, stride_wn, stride_ym,
                    HAS_BIAS: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr = False):
    if PDL:  # launched early (``triton_pdl``): wait for the kernels before, then let the next one launch
        pdl_wait(True)
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    m_mask = offs_m < M
    dt = x_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = (k0 + offs_k) < K
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + (k0 + offs_k)[None, :],
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptr + offs_n[None, :] * stride_wn + (k0 + offs_k)[:, None],
                    mask=n_mask[None, :] & k_mask[:, None], other=0.0)  # [BLOCK_K, BLOCK_N] fp8
        acc += tl.dot(x, w.to(dt))
    _store_scaled(y_ptr, s_ptr, b_ptr, stride_ym, offs_m, offs_n, m_mask, n_mask, acc, HAS_BIAS)


@triton.jit(do_not_specialize=["M"])
def _w8_gemv_splitk_kernel(x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, part_ptr, count_ptr,
                           M, N, K, K_PER_SPLIT,
                           stride_xm, stride_wn, stride_ym,
                           HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, USE_DOT: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           PDL: tl.constexpr = False):
    """Decode-sized M, split-K: program (n, k) reduces weight rows ``offs_n`` over ``[k * K_PER_SPLIT, (k + 1) *
    K_PER_SPLIT)`` for all M (<= BLOCK_M) rows of x (``USE_DOT``: one ``tl.dot`` per K tile; else per-row sums), writes its fp32 partial [BLOCK_M, BLOCK_N] to ``part``, then takes a ticket
    on ``count[n]``; the last of the SPLIT_K programs of column block n sums the partials (in a fixed order: the
    result does not depend on which program came last), applies the scale and bias, stores y and resets the
    ticket to 0 for the next call."""
    if PDL:  # launched early (``triton_pdl``): wait for the kernels before, then let the next one launch
        pdl_wait(True)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    m_mask = offs_m < M
    dt = x_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_lo = pid_k * K_PER_SPLIT
    for k0 in range(k_lo, k_lo + K_PER_SPLIT, BLOCK_K):
        kk = k0 + offs_k
        k_mask = kk < K
        if USE_DOT:  # tensor cores: M padded to BLOCK_M >= 16 costs nothing in a bandwidth-bound GEMM
            x = tl.load(x_ptr + offs_m[:, None] * stride_xm + kk[None, :], mask=m_mask[:, None] & k_mask[None, :],
                        other=0.0)  # [BLOCK_M, BLOCK_K]
            w = tl.load(w_ptr + offs_n[None, :] * stride_wn + kk[:, None], mask=n_mask[None, :] & k_mask[:, None],
                        other=0.0)  # [BLOCK_K, BLOCK_N] fp8
            acc += tl.dot(x, w.to(dt))
        else:  # one or two rows: CUDA-core multiply and row sums
            w = tl.load(w_ptr + offs_n[:, None] * stride_wn + kk[None, :], mask=n_mask[:, None] & k_mask[None, :],
                        other=0.0).to(dt).to(tl.float32)  # [BLOCK_N, BLOCK_K]
            for m in tl.static_range(BLOCK_M):
                x = tl.load(x_ptr + m * stride_xm + kk, mask=k_mask & ((offs_k * 0 + m) < M), other=0.0).to(tl.float32)
                part = tl.sum(w * x[None, :], axis=1)  # [BLOCK_N]
                acc += tl.where(offs_m[:, None] == m, part[None, :], 0.0)
    p = part_ptr + (pid_k * BLOCK_M + offs_m[:, None]) * N + offs_n[None, :]
    tl.store(p, acc, mask=n_mask[None, :])
    ticket = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel")  # orders the store above before the last reader
    if ticket == SPLIT_K - 1:
        total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in tl.static_range(SPLIT_K):
            total += tl.load(part_ptr + (k * BLOCK_M + offs_m[:, None]) * N + offs_n[None, :],
                             mask=n_mask[None, :], other=0.0, cache_modifier=".cg")
        _store_scaled(y_ptr, s_ptr, b_ptr, stride_ym, offs_m, offs_n, m_mask, n_mask, total, HAS_BIAS)
        tl.atomic_xchg(count_ptr + pid_n, 0)


@triton.jit(do_not_specialize=["M"])
def _w8_gemv2_kernel(x_ptr, xs_ptr, w_ptr, s_ptr, b_ptr, y_ptr, part_ptr, count_ptr,
                     M, N, K, K_PER_SPLIT, SPLIT_K,
                     stride_xm, stride_wn, stride_ym,
                     HAS_BIAS: tl.constexpr, USE_DOT: tl.constexpr, EVEN: tl.constexpr, PREFETCH: tl.constexpr,
                     FP8_X: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     PDL: tl.constexpr = False, WIDEN_F16: tl.constexpr = False, SWAP: tl.constexpr = False,
                     PRELOAD: tl.constexpr = 0):
    """``_w8_gemv_splitk_kernel`` with fewer registers per byte in flight, run with the tiles of a GPU's tuned table
    (``kernels/tuned/``, ``bench/sweep_fp8_gemv.py``):
    SPLIT_K is a runtime argument (not a constexpr: one variant serves every split above 1; Triton still
    specialises 1 and multiples of 16); the CUDA-core path (``USE_DOT`` False,
    one row of x) keeps an elementwise fp32 accumulator [BLOCK_N, BLOCK_K] and sums it once after the K loop instead
    of a cross-thread reduction per tile; ``PREFETCH`` issues the next weight tile's load before widening the
    current one (a register double buffer of raw fp8 bytes); ``EVEN`` (N % BLOCK_N == 0 and K % K_PER_SPLIT == 0)
    drops the masks. ``FP8_X`` (with ``USE_DOT``): x is already fp8 (per-token quantized, row scales ``xs``
    float32 [M]) and the dot runs on fp8 tensor cores with no widening; the partials are unscaled and
    ``xs[m] * s[n]`` is applied once at the store. ``SWAP`` (with ``USE_DOT``): the product is taken as
    ``w @ x^T`` [BLOCK_N, BLOCK_M] (the weight tile on the MMA's M side, the rows of x on its N side) and transposed
    once before the store. ``PRELOAD`` (0-4; the CUDA-core path without ``PREFETCH``; at most K_PER_SPLIT / BLOCK_K):
    the first that many weight tiles of the program are loaded before the PDL wait (weights are no kernel's output),
    so that a program launched early moves its first bytes while the kernel before it drains; they are then
    multiplied in order, as the loop would (the same result bit for bit). The ticket reduction is the same as
    ``_w8_gemv_splitk_kernel``'s."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    m_mask = offs_m < M
    dt = x_ptr.dtype.element_ty
    k_lo = pid_k * K_PER_SPLIT
    w_rows = w_ptr + offs_n[:, None] * stride_wn  # [BLOCK_N, 1]
    if USE_DOT and SWAP:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    elif USE_DOT:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    else:
        acc2 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    if PREFETCH:
        kk = k_lo + offs_k
        if EVEN:
            w_next = tl.load(w_rows + kk[None, :], eviction_policy="evict_first")
        else:
            w_next = tl.load(w_rows + kk[None, :], mask=n_mask[:, None] & (kk < K)[None, :], other=0.0,
                             eviction_policy="evict_first")
    if PRELOAD >= 1:
        w0 = _row_tile(w_rows, k_lo + offs_k, n_mask, K, EVEN)
    if PRELOAD >= 2:
        w1 = _row_tile(w_rows, k_lo + BLOCK_K + offs_k, n_mask, K, EVEN)
    if PRELOAD >= 3:
        w2 = _row_tile(w_rows, k_lo + 2 * BLOCK_K + offs_k, n_mask, K, EVEN)
    if PRELOAD >= 4:
        w3 = _row_tile(w_rows, k_lo + 3 * BLOCK_K + offs_k, n_mask, K, EVEN)
    if PDL:  # launched early (``triton_pdl``): weights are no kernel's output, so the first tiles (PREFETCH, PRELOAD)
        pdl_wait(True)  # may load before the wait; x, the partials and the tickets after it
    if PRELOAD >= 1:
        acc2 = _row_fma(acc2, w0, x_ptr, k_lo + offs_k, K, EVEN, WIDEN_F16)
    if PRELOAD >= 2:
        acc2 = _row_fma(acc2, w1, x_ptr, k_lo + BLOCK_K + offs_k, K, EVEN, WIDEN_F16)
    if PRELOAD >= 3:
        acc2 = _row_fma(acc2, w2, x_ptr, k_lo + 2 * BLOCK_K + offs_k, K, EVEN, WIDEN_F16)
    if PRELOAD >= 4:
        acc2 = _row_fma(acc2, w3, x_ptr, k_lo + 3 * BLOCK_K + offs_k, K, EVEN, WIDEN_F16)
    for k0 in range(k_lo + PRELOAD * BLOCK_K, k_lo + K_PER_SPLIT, BLOCK_K):
        kk = k0 + offs_k
        if PREFETCH:
            w = w_next
            kn = kk + BLOCK_K
            nxt = (kn < K) & (kn < k_lo + K_PER_SPLIT)
            w_next = tl.load(w_rows + kn[None, :], mask=n_mask[:, None] & nxt[None, :], other=0.0,
                             eviction_policy="evict_first")
        elif EVEN:
            w = tl.load(w_rows + kk[None, :], eviction_policy="evict_first")
        else:
            w = tl.load(w_rows + kk[None, :], mask=n_mask[:, None] & (kk < K)[None, :], other=0.0,
                        eviction_policy="evict_first")
        if USE_DOT:
            if EVEN:
                x = tl.load(x_ptr + offs_m[:, None] * stride_xm + kk[None, :], mask=m_mask[:, None], other=0.0)
            else:
                x = tl.load(x_ptr + offs_m[:, None] * stride_xm + kk[None, :],
                            mask=m_mask[:, None] & (kk < K)[None, :], other=0.0)
            if SWAP and FP8_X:
                acc += tl.dot(w, tl.trans(x))
            elif SWAP:
                acc += tl.dot(w.to(dt), tl.trans(x))
            elif FP8_X:
                acc += tl.dot(x, tl.trans(w))
            else:
                acc += tl.dot(x, tl.trans(w.to(dt)))
        else:
            acc2 = _row_fma(acc2, w, x_ptr, kk, K, EVEN, WIDEN_F16)
    if not USE_DOT:
        acc = tl.where(offs_m[:, None] == 0, tl.sum(acc2, axis=1)[None, :], 0.0)  # [BLOCK_M, BLOCK_N], row 0
    elif SWAP:
        acc = tl.trans(acc)  # [BLOCK_M, BLOCK_N]
    _finish_split(acc, xs_ptr, s_ptr, b_ptr, y_ptr, part_ptr, count_ptr, pid_n, pid_k, N, SPLIT_K, stride_ym,
                  offs_m, offs_n, m_mask, n_mask, HAS_BIAS, FP8_X, BLOCK_M, BLOCK_N)


@triton.jit
def _row_tile(w_rows, kk, n_mask, K, EVEN: tl.constexpr):
    """The raw fp8 weight tile [BLOCK_N, BLOCK_K] at columns ``kk`` of rows ``w_rows`` (``_w8_gemv2_kernel``)."""
    if EVEN:
        return tl.load(w_rows + kk[None, :], eviction_policy="evict_first")
    return tl.load(w_rows + kk[None, :], mask=n_mask[:, None] & (kk < K)[None, :], other=0.0,
                   eviction_policy="evict_first")


@triton.jit
def _row_fma(acc2, w, x_ptr, kk, K, EVEN: tl.constexpr, WIDEN_F16: tl.constexpr):
    """The one-row path's step: ``acc2 + widen(w) * x[kk]`` (fp32, elementwise [BLOCK_N, BLOCK_K])."""
    if EVEN:
        x = tl.load(x_ptr + kk).to(tl.float32)
    else:
        x = tl.load(x_ptr + kk, mask=kk < K, other=0.0).to(tl.float32)
    if WIDEN_F16:  # fp8 -> f16 -> f32, both exact (``GEMV_WIDEN_F16``)
        return acc2 + w.to(tl.float16).to(tl.float32) * x[None, :]
    return acc2 + w.to(x_ptr.dtype.element_ty).to(tl.float32) * x[None, :]


@triton.jit
def _finish_split(acc, xs_ptr, s_ptr, b_ptr, y_ptr, part_ptr, count_ptr, pid_n, pid_k, N, SPLIT_K, stride_ym,
                  offs_m, offs_n, m_mask, n_mask, HAS_BIAS: tl.constexpr, FP8_X: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr):
    """The end of a split-K program, fp32 ``acc`` [BLOCK_M, BLOCK_N] its partial: with one split, scale and store
    y; else store the partial, take a ticket on ``count[pid_n]``, and the last of the column block's programs sums the
    partials in split order, scales, stores y and resets the ticket (``_w8_gemv_splitk_kernel``)."""
    p = part_ptr + (pid_k * BLOCK_M + offs_m[:, None]) * N + offs_n[None, :]
    if SPLIT_K == 1:
        if FP8_X:
            acc = acc * tl.load(xs_ptr + offs_m, mask=m_mask, other=0.0)[:, None]
        _store_scaled(y_ptr, s_ptr, b_ptr, stride_ym, offs_m, offs_n, m_mask, n_mask, acc, HAS_BIAS)
    else:
        tl.store(p, acc, mask=n_mask[None, :])
        ticket = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel")  # orders the store above before the last reader
        if ticket == SPLIT_K - 1:
            total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k in range(0, SPLIT_K):
                total += tl.load(part_ptr + (k * BLOCK_M + offs_m[:, None]) * N + offs_n[None, :],
                                 mask=n_mask[None, :], other=0.0, cache_modifier=".cg")
            if FP8_X:
                total = total * tl.load(xs_ptr + offs_m, mask=m_mask, other=0.0)[:, None]
            _store_scaled(y_ptr, s_ptr, b_ptr, stride_ym, offs_m, offs_n, m_mask, n_mask, total, HAS_BIAS)
            tl.atomic_xchg(count_ptr + pid_n, 0)


@triton.jit(do_not_specialize=["M"])
def _w8_gemv_tma_kernel(x_desc, xs_ptr, w_desc, s_ptr, b_ptr, y_ptr, part_ptr, count_ptr,
                        M, N, K, K_PER_SPLIT, SPLIT_K, stride_ym,
                        HAS_BIAS: tl.constexpr, SWAP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, PDL: tl.constexpr = False):
    """``_w8_gemv2_kernel``'s ``FP8_X`` product (fp8 x and weights on fp8 tensor cores, split K, the same ticket
    reduction and store) with both tiles loaded through tensor descriptors (``x_desc`` fp8 [M, K] in blocks
    [BLOCK_M, BLOCK_K], ``w_desc`` fp8 [N, K] in blocks [BLOCK_N, BLOCK_K]): on Hopper each tile is one TMA copy
    into shared memory, with no per-element addresses or masks in registers; rows and columns past the tensor's
    edge read as zeros. ``SWAP``: ``w @ x^T`` as in ``_w8_gemv2_kernel``."""
    if PDL:  # launched early (``triton_pdl``): wait for the kernels before, then let the next one launch
        pdl_wait(True)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    k_lo = pid_k * K_PER_SPLIT
    k_hi = tl.minimum(k_lo + K_PER_SPLIT, K)
    if SWAP:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        w = w_desc.load([pid_n * BLOCK_N, k0])  # [BLOCK_N, BLOCK_K] fp8
        x = x_desc.load([0, k0])  # [BLOCK_M, BLOCK_K] fp8
        if SWAP:
            acc = tl.dot(w, tl.trans(x), acc)
        else:
            acc = tl.dot(x, tl.trans(w), acc)
    if SWAP:
        acc = tl.trans(acc)
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    offs_m = tl.arange(0, BLOCK_M)
    _finish_split(acc, xs_ptr, s_ptr, b_ptr, y_ptr, part_ptr, count_ptr, pid_n, pid_k, N, SPLIT_K, stride_ym,
                  offs_m, offs_n, offs_m < M, offs_n < N, HAS_BIAS, True, BLOCK_M, BLOCK_N)


#: Most elements along one dimension of a TMA box (CUDA's ``cuTensorMapEncodeTiled``: boxDim[i] <= 256).
TMA_MAX_BOX = 256


def _rows_view(x: torch.Tensor, rows: int) -> torch.Tensor | None:
    """x [M, K] (unit last stride) seen with ``rows`` rows from its first, where its storage holds them (an fp8 buffer
    of ``fp8.empty_fp8_rows``): the rows past M are whatever the buffer holds, for a TMA tile of ``rows`` rows whose
    rows past M are computed and never stored; else None."""
    need = x.storage_offset() + (rows - 1) * x.stride(0) + x.shape[1]
    if x.untyped_storage().nbytes() < need * x.element_size():
        return None
    return x.as_strided((rows, x.shape[1]), x.stride())


def _tma_ok(t: torch.Tensor) -> bool:
    """Whether a 2-D tensor can back a TMA descriptor: CUDA, unit last stride, base and row stride multiples of 16
    bytes (``cuTensorMapEncodeTiled``'s alignment rules)."""
    return ((t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1") and t.dim() == 2 and t.stride(1) == 1 and t.data_ptr() % 16 == 0
            and (t.stride(0) * t.element_size()) % 16 == 0)


#: The one-row (CUDA-core) path of ``_w8_gemv2_kernel`` widens each fp8 weight to float32 through float16 instead of
#: through x's dtype. Both routes are exact (every e4m3 value is a float16 and a bfloat16), so the products and sums
#: are bit for bit the same (``tests/test_fp8.py::test_gemv_widening_through_f16_is_bit_identical``, and its bf16
#: twin in ``tests/test_fp8_gpu.py``). What changes is the instructions, for bf16 x: Triton widens e4m3 to bfloat16
#: through float16 (``cvt.rn.f16x2.e4m3x2`` then a ``cvt.bf16.f16`` per weight, which ptxas emits as ``F2F``, a
#: conversion-pipe instruction), then to float32; the float16 route replaces the ``F2F`` with ``HADD2.F32`` (the FMA
#: pipe). sm_90 SASS of the H200's one-row tile (BLOCK_N 2, BLOCK_K 2048, 4 warps): 32 F2F per 32 weight bytes per
#: thread before, none after; 496 -> 464 instructions. Measured on an H200 (session 22, ``python bench/bench_fp8.py
#: --ms 1``, session 9's tiles, ``bench/results/session22/``): qkv 9.5 -> 8.2 us, o 6.9 -> 6.0, gate_up 37.0 -> 32.3,
#: down 21.1 -> 16.8 us (2.79 -> 3.49 TB/s); engine batch-1 decode TPOT 3.57 -> 3.26 ms. Off (False) only for A/Bs
#: (``bench_fp8.py`` provider ``weight_only_bf16widen``, ``bench_generate.py`` provider ``multilora-fp8-bf16widen``).
GEMV_WIDEN_F16 = True
#: Weight tiles each program of the one-row path loads before its PDL wait (``_w8_gemv2_kernel``'s ``PRELOAD``, read
#: per call; at most 4, and at most the program's K tiles; not with ``prefetch``). At one row a step's GEMVs follow
#: latency-bound kernels (RMSNorm, RoPE, attention, SiLU * up) whose time leaves the memory bus idle; a GEMV launched
#: early under PDL can spend that time reading its first weights. Bit for bit the same products. H200, Llama-3-8B,
#: fp8 engine, median batch-1 decode step (``bench_generate.py``, bench/results/session27/ calls 1 and 2): none 2.728
#: and 2.710 ms, 2 tiles 2.703 and 2.674 ms, 4 tiles 2.942 ms (call 2). 0: none (what ran before session 27; the
#: ``bench_generate.py`` provider ``multilora-fp8-nopreload``; ``multilora-fp8-preload4``: 4).
GEMV_PRELOAD = 2

_WORKSPACES: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def _workspace(device: torch.device, split_k: int, block_m: int, n: int, n_blocks: int):
    """The split-K partials [split_k * block_m, n] float32 and tickets [n_blocks] int32 of one shape, made once per
    (device, shape) and kept: their addresses stay put (CUDA graphs) and the tickets are back at 0 after each call.
    Calls of one shape must not run concurrently on two streams (the engine runs its GEMMs on one stream)."""
    key = (device, split_k, block_m, n, n_blocks)  # tickets: one per column block of this tile width
    ws = _WORKSPACES.get(key)
    if ws is None:
        ws = _WORKSPACES[key] = (torch.empty(split_k * block_m, n, dtype=torch.float32, device=device),
                                 torch.zeros(n_blocks, dtype=torch.int32, device=device))
    return ws


def fp8_gemv_splitk(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None, *,
                    block_n: int = 64, block_k: int = 256, split_k: int | None = None, num_warps: int = 4,
                    use_dot: bool | None = None) -> torch.Tensor:
    """``fp8_weight_only_linear`` for at most 64 rows, split over K so that enough programs stream the weight
    (``_w8_gemv_splitk_kernel``; ``use_dot`` None = tensor cores from 2 rows). Same arguments, result and errors.
    ``fp8_weight_only_linear`` picks the tiles measured fastest on an H200 (``bench/results/fp8/fp8_gemm.md``)."""
    M, K = x.shape
    N = qweight.shape[0]
    if not 1 <= M <= 64:
        raise ValueError(f"fp8_gemv_splitk: x must have 1..64 rows, got {M}")
    use_dot = M > 1 if use_dot is None else use_dot
    n_blocks = triton.cdiv(N, block_n)
    if split_k is None:  # about 4 programs per SM of an H200 (132 SMs), each at least 4 K tiles
        split_k = max(1, min(triton.cdiv(528, n_blocks), K // (4 * block_k)))
    k_per = triton.cdiv(triton.cdiv(K, split_k), block_k) * block_k
    split_k = triton.cdiv(K, k_per)
    bm = max(16, triton.next_power_of_2(M)) if use_dot else triton.next_power_of_2(M)
    part, count = _workspace(x.device, split_k, bm, N, n_blocks)
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    _w8_gemv_splitk_kernel[(n_blocks, split_k)](x, qweight, scale, bias if bias is not None else scale, y, part, count,
                                                M, N, K, k_per, x.stride(0), qweight.stride(0), y.stride(0),
                                                HAS_BIAS=bias is not None, SPLIT_K=split_k, USE_DOT=use_dot, BLOCK_M=bm,
                                                BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps,
                                                **triton_pdl.launch_args(x.device))
    return y


def fp8_gemv2(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None, *,
              block_n: int = 32, block_k: int = 512, split_k: int | None = None, programs_per_sm: int = 4,
              num_warps: int = 4, num_stages: int = 1, prefetch: bool = False, use_dot: bool | None = None,
              num_sms: int | None = None, fp8_x: bool = False, out_dtype: torch.dtype | None = None,
              x_scale: torch.Tensor | None = None, swap: bool = False, tma: bool = False,
              preload: int | None = None) -> torch.Tensor:
    """``fp8_gemv_splitk`` through ``_w8_gemv2_kernel``: same arguments, result and errors, plus ``programs_per_sm``
    (split_k None: about that many programs per SM of ``num_sms``, each at least 2 K tiles; None = x's GPU's, 4
    on the CPU), ``num_stages`` and
    ``prefetch`` (the kernel's docstring). ``use_dot`` None = tensor cores from 2 rows; the CUDA-core path takes one
    row only. ``fp8_x``: the "scaled_mm" semantics (``fp8.fp8_linear``): x is quantized per token
    (``quantize_per_token``) and multiplied on fp8 tensor cores; ``x`` may then also be given already quantized
    (float8_e4m3fn, with ``x_scale`` float32 [M, 1] and ``out_dtype``). ``swap`` (tensor cores): the product as
    ``w @ x^T``, weight rows on the MMA's M side (``_w8_gemv2_kernel``'s ``SWAP``). ``tma`` (``fp8_x`` only):
    ``_w8_gemv_tma_kernel``, both tiles through tensor descriptors; ``block_n`` and ``block_k`` at most
    ``TMA_MAX_BOX``; x's tiles are read from x's buffer where it holds their rows (``_rows_view``; not swapped, the
    tiles then hold ``fp8.FP8_X_ROWS`` rows), else zero-filled past x's edge. Where x or the weight cannot back a
    descriptor (``_tma_ok``: alignment) the call takes the pointer kernel with the same tiles instead: the same
    product. ``preload`` (the one-row path without ``prefetch``): weight tiles per program loaded before the PDL wait
    (None = ``GEMV_PRELOAD``; capped at the program's K tiles; the same result).

    Raises:
        ValueError: more than 64 rows; ``fp8_x`` with ``use_dot=False``; an fp8 x without ``x_scale`` or
            ``out_dtype``; ``tma`` without ``fp8_x`` or with a tile wider than ``TMA_MAX_BOX``; ``preload`` outside
            0..4."""
    M, K = x.shape
    N = qweight.shape[0]
    if not 1 <= M <= 64:
        raise ValueError(f"fp8_gemv2: x must have 1..64 rows, got {M}")
    out_dtype = out_dtype or x.dtype
    xs = scale  # unused unless fp8_x
    if fp8_x:
        if use_dot is False:
            raise ValueError("fp8_gemv2: fp8_x needs the tensor-core path (use_dot)")
        use_dot = True
        if x.dtype == FP8_DTYPE:
            if x_scale is None or out_dtype == FP8_DTYPE:
                raise ValueError("fp8_gemv2: an fp8 x needs x_scale [M, 1] and an out_dtype")
            xs = x_scale
        else:
            x, xs = quantize_per_token(x)
    use_dot = M > 1 if use_dot is None else use_dot
    if not use_dot and M != 1:
        raise ValueError(f"fp8_gemv2: the CUDA-core path (use_dot=False) takes 1 row, got {M}")
    n_blocks = triton.cdiv(N, block_n)
    if split_k is None:
        if num_sms is None:
            num_sms = num_sms_of(x.device.index or 0) if x.is_cuda else 4
        split_k = max(1, min(triton.cdiv(programs_per_sm * num_sms, n_blocks), K // (2 * block_k)))
    k_per = triton.cdiv(triton.cdiv(K, split_k), block_k) * block_k
    split_k = triton.cdiv(K, k_per)
    bm = max(16, triton.next_power_of_2(M)) if use_dot else 1
    even = N % block_n == 0 and K % k_per == 0
    preload = GEMV_PRELOAD if preload is None else preload
    if not 0 <= preload <= 4:
        raise ValueError(f"fp8_gemv2: preload must be 0..4 weight tiles, got {preload}")
    preload = 0 if use_dot or prefetch else min(preload, k_per // block_k)
    if tma:
        if not fp8_x:
            raise ValueError("fp8_gemv2: tma=True takes the fp8-activation product (fp8_x=True)")
        if max(block_n, block_k, bm) > TMA_MAX_BOX:
            raise ValueError(f"fp8_gemv2: tma=True needs block_n, block_k and the padded rows at most {TMA_MAX_BOX}, "
                             f"got block_n {block_n}, block_k {block_k}, rows {bm}")
        tma = _tma_ok(x) and _tma_ok(qweight)  # (else the pointer kernel: the same product)
    xv = x
    if tma:  # tiles over x's buffer where it has the rows (not swapped: FP8_X_ROWS, swapped: bm), else past its edge
        want = bm if swap else max(bm, _fp8.FP8_X_ROWS)  # (read per call: a knob the A/B benches set)
        view = _rows_view(x, want) if M < want else None
        if view is not None:
            xv, bm = view, want
    part, count = _workspace(x.device, split_k, bm, N, n_blocks)
    y = torch.empty(M, N, dtype=out_dtype, device=x.device)
    if tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        _w8_gemv_tma_kernel[(n_blocks, split_k)](
            TensorDescriptor.from_tensor(xv, [bm, block_k]), xs, TensorDescriptor.from_tensor(qweight, [block_n, block_k]),
            scale, bias if bias is not None else scale, y, part, count, M, N, K, k_per, split_k, y.stride(0),
            HAS_BIAS=bias is not None, SWAP=swap, BLOCK_M=bm, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps,
            num_stages=num_stages, **triton_pdl.launch_args(x.device))
        return y
    _w8_gemv2_kernel[(n_blocks, split_k)](x, xs, qweight, scale, bias if bias is not None else scale, y, part, count,
                                          M, N, K, k_per, split_k, x.stride(0), qweight.stride(0), y.stride(0),
                                          HAS_BIAS=bias is not None, USE_DOT=use_dot, EVEN=even, PREFETCH=prefetch,
                                          FP8_X=fp8_x, BLOCK_M=bm, BLOCK_N=block_n, BLOCK_K=block_k,
                                          WIDEN_F16=GEMV_WIDEN_F16 and not use_dot, SWAP=swap and use_dot,
                                          PRELOAD=preload,
                                          num_warps=num_warps,
                                          num_stages=num_stages,
                                          **triton_pdl.launch_args(x.device))
    return y


def _config(N: int) -> dict:
    """Tile sizes of the tiled kernel (only M > 64 reaches it from ``fp8_weight_only_linear``)."""
    return dict(BLOCK_M=64, BLOCK_N=64 if N <= 8192 else 128, BLOCK_K=128, num_warps=4, num_stages=4)


#: Tuned tiles of ``fp8_gemv2`` per device, shape and row class: ``kernels/tuned/fp8_gemv_*.json`` as written by
#: ``bench/sweep_fp8_gemv.py`` ({"device": name, "configs": {"NxK": {"1" | "16" | "64": kwargs (the tile sizes, and
#: optionally "swap" / "tma": which kernel)}}, and
#: "scaled_configs" of the same form for the fp8-activation path where it beat cuBLASLt, ...}); the file named by
#: the environment variable ``MULTILORA_FP8_TUNED`` (if set) is read last and wins.
TUNED_DIR = Path(__file__).resolve().with_name("tuned")
_tuned: dict[str, dict] | None = None
_tuned_lock = threading.Lock()
#: The keys of one tuned entry: ``fp8_gemv2``'s tile arguments (positive integers, then flags).
_INT_KEYS = ("block_n", "block_k", "num_warps", "num_stages", "programs_per_sm")
_BOOL_KEYS = ("prefetch", "use_dot")
_KEYS = set(_INT_KEYS + _BOOL_KEYS)
#: Keys an entry may add (tables written before them leave them out: False): ``fp8_gemv2``'s ``swap`` and ``tma``.
_OPTIONAL_BOOL_KEYS = ("swap", "tma")


def _check_entry(section: str, shape: str, rows: str, cfg: Any) -> None:
    where = f"{section}[{shape!r}][{rows!r}]"
    if rows not in ("1", "16", "64"):
        raise ValueError(f"{where}: the row class must be '1', '16' or '64'")
    if not isinstance(cfg, dict) or not _KEYS <= set(cfg) <= _KEYS | {"fp8_x", *_OPTIONAL_BOOL_KEYS}:
        raise ValueError(f"{where}: expected the keys {sorted(_KEYS)} (and optionally {['fp8_x', *_OPTIONAL_BOOL_KEYS]}), "
                         f"got {sorted(cfg) if isinstance(cfg, dict) else cfg!r}")
    for k in _OPTIONAL_BOOL_KEYS:
        if not isinstance(cfg.get(k, False), bool):
            raise ValueError(f"{where}: {k} must be true or false, got {cfg[k]!r}")
    for k in _INT_KEYS:
        if not isinstance(cfg[k], int) or isinstance(cfg[k], bool) or cfg[k] < 1:
            raise ValueError(f"{where}: {k} must be a positive integer, got {cfg[k]!r}")
    for k in _BOOL_KEYS:
        if not isinstance(cfg[k], bool):
            raise ValueError(f"{where}: {k} must be true or false, got {cfg[k]!r}")
    if section == "scaled_configs" and not cfg["use_dot"]:
        raise ValueError(f"{where}: fp8 activations need use_dot true")
    if cfg.get("tma") and section != "scaled_configs":
        raise ValueError(f"{where}: tma takes fp8 activations (scaled_configs)")
    if cfg.get("tma") and max(cfg["block_n"], cfg["block_k"]) > TMA_MAX_BOX:
        raise ValueError(f"{where}: tma tiles of at most {TMA_MAX_BOX} (block_n, block_k), got {cfg['block_n']}, "
                         f"{cfg['block_k']}")


def _read_tuned(path: Path, into: dict[str, dict]) -> None:
    """Merge one table file into ``into``; a file that does not read or parse, or has any bad entry, is skipped
    whole with a warning naming it and the entry."""
    try:
        data = json.loads(path.read_text())
        device = data["device"]
        if not isinstance(device, str):
            raise ValueError(f"device must be a GPU name, got {device!r}")
        sections = {k: data.get(k, {}) for k in ("configs", "scaled_configs")}
        for name, section in sections.items():
            for shape, by_rows in section.items():
                for rows, cfg in by_rows.items():
                    _check_entry(name, shape, rows, cfg)
        limit = data.get("weight_only_max_tokens")
        if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or not 0 <= limit <= 64):
            raise ValueError(f"weight_only_max_tokens must be an integer in 0..64, got {limit!r}")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        log.warning("fp8 tuned tiles: ignoring %s (%s)", path, e)
        return
    entry = into.setdefault(device, {"configs": {}, "scaled_configs": {}})
    for name, section in sections.items():
        for shape, by_rows in section.items():
            entry[name].setdefault(shape, {}).update(by_rows)
    if limit is not None:
        entry["weight_only_max_tokens"] = limit


def tuned_table() -> dict[str, dict]:
    """{device name: {"configs": {"NxK": {row class: fp8_gemv2 kwargs}}, "scaled_configs": {the same, for the
    fp8-activation path}, "weight_only_max_tokens": n}} from the shipped files and ``MULTILORA_FP8_TUNED`` (read once
    per process; a malformed file is skipped whole with a warning)."""
    global _tuned
    with _tuned_lock:
        if _tuned is None:
            table = shipped_table()
            extra = os.environ.get("MULTILORA_FP8_TUNED")
            if extra:
                _read_tuned(Path(extra), table)
            _tuned = table
        return _tuned


def shipped_table() -> dict[str, dict]:
    """A new table of the shipped files alone (``kernels/tuned/``; ``tuned_table``'s form, without
    ``MULTILORA_FP8_TUNED``): what A/B benchmarks compare a new sweep's file against."""
    table: dict[str, dict] = {}
    for path in sorted(TUNED_DIR.glob("fp8_gemv_*.json")):
        _read_tuned(path, table)
    return table


def row_class(M: int) -> str:
    """The tuned-table row class of M rows: "1", "16" (2-16) or "64" (17-64)."""
    return "1" if M == 1 else ("16" if M <= 16 else "64")


def gemv_config(device: torch.device, N: int, K: int, M: int, *, scaled: bool = False) -> dict | None:
    """The tuned ``fp8_gemv2`` arguments for an [M, K] x [N, K]^T product on ``device`` (this GPU's entry for this
    shape and row class; ``scaled``: of the fp8-activation path, ``fp8_x``), or None where there is none. A
    CUDA-core entry (one row only) is never returned for more rows."""
    if not 1 <= M <= 64:
        return None
    section = "scaled_configs" if scaled else "configs"
    cfg = _device_entry(device).get(section, {}).get(f"{N}x{K}", {}).get(row_class(M))
    if cfg is None or (not cfg["use_dot"] and M > 1):
        return None
    return {k: v for k, v in cfg.items() if k != "fp8_x"}


def weight_only_max_tokens(device: torch.device) -> int | None:
    """Most rows for which this GPU's tuned table measured the weight-only GEMM faster than ``scaled_mm`` (None: no
    table for this GPU)."""
    if device.type != "cuda":
        return None
    return _device_entry(device).get("weight_only_max_tokens")


_ENTRIES: dict[torch.device, tuple[dict, dict]] = {}


def _device_entry(device: torch.device) -> dict:
    """This device's entry of ``tuned_table`` (cached per device and table: GEMMs of eager steps look it up)."""
    hit = _ENTRIES.get(device)
    if hit is not None and hit[0] is _tuned:
        return hit[1]
    table = tuned_table()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    _ENTRIES[device] = (table, table.get(name, {}))
    return _ENTRIES[device][1]


def fp8_weight_only_linear(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
                           bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ (qweight * scale[:, None])^T (+ bias)`` with fp8 weights widened in registers (module docstring).

    x [M, K] float16/bfloat16 (contiguous rows), qweight float8_e4m3fn [N, K] row-major, scale float32 [N], bias
    None or [N]; returns a new [M, N] tensor in x's dtype. Up to 64 rows run a split-K GEMV: ``fp8_gemv2`` with the
    tiles of ``gemv_config`` where this GPU and shape have a tuned entry (``bench/sweep_fp8_gemv.py``), else
    ``fp8_gemv_splitk`` with the tiles measured in ``bench/results/fp8/fp8_gemm.md``; more rows the tiled kernel.

    Raises:
        ValueError: shapes, dtypes or devices that disagree (named).
    """
    M, K = x.shape
    N = qweight.shape[0]
    if qweight.dtype != FP8_DTYPE or qweight.shape[1] != K or qweight.stride(1) != 1:
        raise ValueError(f"fp8_weight_only_linear: qweight must be row-major float8_e4m3fn [N, {K}], got "
                         f"{tuple(qweight.shape)} {qweight.dtype}")
    if scale.dtype != torch.float32 or tuple(scale.shape) != (N,):
        raise ValueError(f"fp8_weight_only_linear: scale must be float32 [{N}], got {tuple(scale.shape)} {scale.dtype}")
    if x.dtype not in (torch.float16, torch.bfloat16) or x.stride(1) != 1:
        raise ValueError(f"fp8_weight_only_linear: x must be float16/bfloat16 with contiguous rows, got {x.dtype}")
    if not qweight.device == x.device == scale.device:
        raise ValueError("fp8_weight_only_linear: x, qweight and scale must be on one device")
    cfg = gemv_config(x.device, N, K, M)
    if cfg is not None:
        return fp8_gemv2(x, qweight, scale, bias, **cfg)
    if M == 1:  # decode-sized: split over K so that enough programs stream the weight (bench/results/fp8/)
        return fp8_gemv_splitk(x, qweight, scale, bias, block_n=64, block_k=256, num_warps=4, use_dot=False)
    if 2 <= M <= 16:
        return fp8_gemv_splitk(x, qweight, scale, bias, block_n=64, block_k=256, num_warps=8, use_dot=True)
    if 17 <= M <= 64:
        return fp8_gemv_splitk(x, qweight, scale, bias, block_n=64, block_k=128, num_warps=4, use_dot=True)
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0:
        return y
    cfg = _config(N)
    grid = (triton.cdiv(N, cfg["BLOCK_N"]), triton.cdiv(M, cfg["BLOCK_M"]))
    _w8_gemm_kernel[grid](x, qweight, scale, bias if bias is not None else scale, y, M, N, K,
                          x.stride(0), qweight.stride(0), y.stride(0), HAS_BIAS=bias is not None, **cfg,
                          **triton_pdl.launch_args(x.device))
    return y




@triton.jit
def _quant_kernel(x_ptr, q_ptr, s_ptr, K, stride_x, stride_q, fp8_max, min_scale, BLOCK: tl.constexpr,
                  PDL: tl.constexpr = False):
    if PDL:  # launched early (``triton_pdl``): wait for the kernels before, then let the next one launch
        pdl_wait(True)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < K
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    s = tl.maximum(tl.max(tl.abs(x), axis=0) / fp8_max, min_scale)
    q = tl.minimum(tl.maximum(x / s, -fp8_max), fp8_max)
    tl.store(q_ptr + row * stride_q + offs, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row, s)


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``fp8.quantize_per_token_torch`` in one launch: x [T, K] (K <= 65536, contiguous rows) ->
    (float8_e4m3fn [T, K], float32 [T, 1]); the fp8 rows lie in a buffer of at least ``FP8_X_ROWS`` rows
    (``fp8.empty_fp8_rows``)."""
    T, K = x.shape
    if K > MAX_QUANT_ROW or x.stride(1) != 1:
        raise ValueError(f"quantize_per_token: rows must be contiguous and at most {MAX_QUANT_ROW} wide, got "
                         f"{tuple(x.shape)} with strides {x.stride()}")
    q = empty_fp8_rows(T, K, x.device)  # (in a buffer of at least 64 rows: TMA tiles of x read real memory)
    s = torch.empty(T, 1, dtype=torch.float32, device=x.device)
    if T:
        block = triton.next_power_of_2(K)
        _quant_kernel[(T,)](x, q, s, K, x.stride(0), q.stride(0), FP8_MAX, _MIN_SCALE, BLOCK=block,
                            num_warps=8 if block >= 4096 else 4, **triton_pdl.launch_args(x.device))
    return q, s
