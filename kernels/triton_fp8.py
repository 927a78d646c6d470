"""Triton kernels for ``multilora.kernels.fp8``: the weight-only fp8 GEMM and the per-token activation quantization.
Semantics are those of ``fp8.fp8_linear(method="dequant")`` and ``fp8.quantize_per_token_torch`` (the oracles).

- ``_w8_gemv_splitk_kernel`` (M <= 64: decode): the same product split over K too, so that a few rows still
  give every SM several programs streaming weight bytes; each program writes an fp32 partial and the last of a
  column block's programs (a ticket counter, reset by it) sums them in a fixed order and stores y. One launch, no
  memset: the workspace and tickets persist per shape.
- ``_w8_gemm_kernel`` (M > 64): ``y[M, N] = x[M, K] @ (Wq[N, K] * s[N])^T (+ b)``. Programs tile (N, M); each loops
  over K, loading an fp8 [BLOCK_K, BLOCK_N] weight tile (1 byte per weight), widening it to x's dtype in registers
  and accumulating with ``tl.dot`` in fp32. The column scale and the bias are applied once, after the K loop.
- ``_quant_kernel``: one program per token: the row in registers, its absmax, the scale and the fp8 row.

Grids depend only on shapes, so both are safe inside CUDA graphs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from multilora.kernels.fp8 import _MIN_SCALE, FP8_DTYPE, FP8_MAX

MAX_QUANT_ROW = 65536


@triton.jit
def _store_scaled(y_ptr, s_ptr, b_ptr, stride_ym, offs_m, offs_n, m_mask, n_mask, acc, HAS_BIAS: tl.constexpr):
    """``y[offs_m, offs_n] = acc * s[offs_n] (+ b[offs_n])``, fp32 ``acc`` [BLOCK_M, BLOCK_N] rounded once to y's dtype."""
    acc = acc * tl.load(s_ptr + offs_n, mask=n_mask, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _w8_gemm_kernel(x_ptr, w_ptr, s_ptr, b_ptr, y_ptr,
                    M, N, K,
                    stride_xm, stride_wn, stride_ym,
                    HAS_BIAS: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
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


@triton.jit
def _w8_gemv_splitk_kernel(x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, part_ptr, count_ptr,
                           M, N, K, K_PER_SPLIT,
                           stride_xm, stride_wn, stride_ym,
                           HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, USE_DOT: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Decode-sized M, split-K: program (n, k) reduces weight rows ``offs_n`` over ``[k * K_PER_SPLIT, (k + 1) *
    K_PER_SPLIT)`` for all M (<= BLOCK_M) rows of x (``USE_DOT``: one ``tl.dot`` per K tile; else per-row sums), writes its fp32 partial [BLOCK_M, BLOCK_N] to ``part``, then takes a ticket
    on ``count[n]``; the last of the SPLIT_K programs of column block n sums the partials (in a fixed order: the
    result does not depend on which program came last), applies the scale and bias, stores y and resets the
    ticket to 0 for the next call."""
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


_WORKSPACES: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def _workspace(device: torch.device, split_k: int, block_m: int, n: int, n_blocks: int):
    """The split-K partials [split_k * block_m, n] float32 and tickets [n_blocks] int32 of one shape, made once per
    (device, shape) and kept: their addresses stay put (CUDA graphs) and the tickets are back at 0 after each call.
    Calls of one shape must not run concurrently on two streams (the engine runs its GEMMs on one stream)."""
    key = (device, split_k, block_m, n)
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
                                                BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps)
    return y


def _config(N: int) -> dict:
    """Tile sizes of the tiled kernel (only M > 64 reaches it from ``fp8_weight_only_linear``)."""
    return dict(BLOCK_M=64, BLOCK_N=64 if N <= 8192 else 128, BLOCK_K=128, num_warps=4, num_stages=4)


def fp8_weight_only_linear(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
                           bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ (qweight * scale[:, None])^T (+ bias)`` with fp8 weights widened in registers (module docstring).

    x [M, K] float16/bfloat16 (contiguous rows), qweight float8_e4m3fn [N, K] row-major, scale float32 [N], bias
    None or [N]; returns a new [M, N] tensor in x's dtype.

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
                          x.stride(0), qweight.stride(0), y.stride(0), HAS_BIAS=bias is not None, **cfg)
    return y


@triton.jit
def _quant_kernel(x_ptr, q_ptr, s_ptr, K, stride_x, stride_q, fp8_max, min_scale, BLOCK: tl.constexpr):
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
    (float8_e4m3fn [T, K], float32 [T, 1])."""
    T, K = x.shape
    if K > MAX_QUANT_ROW or x.stride(1) != 1:
        raise ValueError(f"quantize_per_token: rows must be contiguous and at most {MAX_QUANT_ROW} wide, got "
                         f"{tuple(x.shape)} with strides {x.stride()}")
    q = torch.empty(T, K, dtype=FP8_DTYPE, device=x.device)
    s = torch.empty(T, 1, dtype=torch.float32, device=x.device)
    if T:
        block = triton.next_power_of_2(K)
        _quant_kernel[(T,)](x, q, s, K, x.stride(0), q.stride(0), FP8_MAX, _MIN_SCALE, BLOCK=block,
                            num_warps=8 if block >= 4096 else 4)
    return q, s
