"""Triton kernels for ``multilora.kernels.fused``: RMSNorm (with the residual add, and Gemma 2's norm of the
delta before it), RoPE + KV-cache write, SiLU * up and GELU_tanh * up. Semantics, shapes and rounding are those
of the torch versions there (the oracle).

Every grid depends only on tensor shapes, never on values, so the kernels are safe inside a CUDA graph whose
buffers (positions, slots) are updated in place between replays. On GPUs of compute capability 9.0+ they are
launched with programmatic dependent launch (``triton_pdl``): each program waits for the kernels before it first,
then lets the next kernel launch.

- ``_rms_norm_kernel``: one program per row; the row (``BLOCK = next_pow2(N)``, N <= 65536) is held in
  registers, so the residual add, the sum of squares and the scaled store read and write the row once.
  ``DELTA_NORM`` (Gemma 2) RMS-normalises the delta row first, in the same registers (two reductions, one
  pass); ``UNIT_OFFSET`` multiplies by ``1 + weight`` in float32 and rounds once (``Gemma2RMSNorm``).
- ``_rope_kv_kernel``: one program per token: all query heads and KV heads as one [heads, head_dim / 2] tile
  each (the two halves of rotate-half loaded separately, so no permute), the rotated key and the value
  stored at the token's cache slot, the rotated query to a new [T, H, D] tensor. With ``HAS_NORM`` (Qwen3)
  each head is RMS-normalised first: its sum of squares is the two half-tiles' row sums, in registers.
- ``_glu_kernel``: (token, column block) programs over [T, I]; ``GELU_TANH`` picks GELU_tanh over SiLU, as
  ``x * sigmoid(2 sqrt(2 / pi) (x + 0.044715 x^3))`` (equal to ``0.5 x (1 + tanh(...))``, no cancellation).
- ``QUANT`` (RMSNorm and the gated activations, ``quant=True``): the output row, still in registers, is also
  quantized per token to fp8 e4m3 (``_quant_row``: the same operations as ``triton_fp8``'s ``_quant_kernel`` on the
  stored row, so the same bits) for the fp8 GEMM that reads it next (``fp8.fp8_linear``'s ``x_fp8``); the gated activation then runs one
  program per row (the row's absolute maximum comes before the first fp8 store).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from multilora.kernels import triton_pdl
from multilora.kernels.fp8 import _MIN_SCALE, FP8_MAX, empty_fp8_rows
from multilora.kernels.triton_pdl import pdl_wait

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_ROW = 65536


@triton.jit
def _normed_row(x, w_ptr, dst_ptr, offs, mask, N, eps, UNIT_OFFSET: tl.constexpr):
    """RMSNorm of one row ``x`` [BLOCK] (masked lanes 0) by the weight at ``w_ptr``, rounded to ``dst_ptr``'s dtype
    ``dt`` where ``rms_norm_torch`` rounds: Llama's ``w * (x * inv).to(dt)``, or Gemma's ``(x * inv * (1 + w)).to(dt)``."""
    dt = dst_ptr.dtype.element_ty
    xf = x.to(tl.float32)
    inv = tl.math.rsqrt(tl.sum(xf * xf, axis=0) / N + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if UNIT_OFFSET:
        return ((xf * inv) * (1.0 + w)).to(dt)
    return ((xf * inv).to(dt).to(tl.float32) * w).to(dt)


@triton.jit
def _load_sum(p, lp, m, HAS_LORA: tl.constexpr):
    """``p[...]`` (plus ``lp[...]``, rounded to p's dtype as torch's ``x + lora_delta``), in p's dtype."""
    x = tl.load(p, mask=m, other=0.0)
    if HAS_LORA:
        x = (x.to(tl.float32) + tl.load(lp, mask=m, other=0.0).to(tl.float32)).to(p.dtype.element_ty)
    return x


@triton.jit
def _quant_row(y, q_ptr, s_ptr, row, stride_q, offs, mask, fp8_max, min_scale):
    """Per-token fp8 quantization of one row ``y`` [BLOCK] (masked lanes 0), from registers: as ``triton_fp8``'s
    ``_quant_kernel`` on the stored row (``fp8.quantize_per_token_torch``), bit for bit."""
    yf = y.to(tl.float32)
    sc = tl.maximum(tl.max(tl.abs(yf), axis=0) / fp8_max, min_scale)
    q = tl.minimum(tl.maximum(yf / sc, -fp8_max), fp8_max)
    tl.store(q_ptr + row * stride_q + offs, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row, sc)


@triton.jit
def _rms_norm_kernel(x_ptr, d_ptr, l_ptr, w_ptr, dw_ptr, out_ptr, q_ptr, s_ptr, stride_x, stride_d, stride_l, stride_o,
                     stride_q, N, eps, fp8_max, min_scale,
                     HAS_DELTA: tl.constexpr, HAS_LORA: tl.constexpr, DELTA_NORM: tl.constexpr,
                     UNIT_OFFSET: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False,
                     QUANT: tl.constexpr = False):
    if PDL:  # launched early (``triton_pdl``): wait for the kernels before, then let the next one launch
        pdl_wait(True)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_DELTA:  # the residual add, rounded to the activation dtype as torch's h + delta is
        # plus the projection's LoRA output, computed beside it (HAS_LORA): base + lora, rounded as torch's sum
        d = _load_sum(d_ptr + row * stride_d + offs, l_ptr + row * stride_l + offs, mask, HAS_LORA)
        if DELTA_NORM:  # Gemma 2: h += rms_norm(delta, delta_weight), the normed delta rounded first
            d = _normed_row(d, dw_ptr, x_ptr, offs, mask, N, eps, UNIT_OFFSET)
        x = (x.to(tl.float32) + d.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(x_ptr + row * stride_x + offs, x, mask=mask)
    y = _normed_row(x, w_ptr, out_ptr, offs, mask, N, eps, UNIT_OFFSET)
    tl.store(out_ptr + row * stride_o + offs, y, mask=mask)
    if QUANT:  # the next fp8 GEMM's per-token input too (``fused.rms_norm(quant=True)``)
        _quant_row(y, q_ptr, s_ptr, row, stride_q, offs, mask, fp8_max, min_scale)


@triton.jit
def _rope_tile(src, lsrc, c, s, w_ptr, eps, rows, HALF: tl.constexpr, BLOCK_H: tl.constexpr,
               BLOCK_HALF: tl.constexpr, HEAD_DIM: tl.constexpr, HAS_NORM: tl.constexpr, HAS_LORA: tl.constexpr):
    """Load [rows, head_dim] at src (heads contiguous; plus the LoRA delta at lsrc, ``HAS_LORA``), RMS-normalise
    each head by w (``HAS_NORM``; rounded to src's dtype where ``rms_norm_torch`` rounds), and rotate:
    (x1 * c - x2 * s, x2 * c + x1 * s), fp32."""
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_HALF)
    m = (offs_h[:, None] < rows) & (offs_d[None, :] < HALF)
    off = offs_h[:, None] * HEAD_DIM + offs_d[None, :]
    x1 = _load_sum(src + off, lsrc + off, m, HAS_LORA).to(tl.float32)
    x2 = _load_sum(src + off + HALF, lsrc + off + HALF, m, HAS_LORA).to(tl.float32)
    if HAS_NORM:
        dt = src.dtype.element_ty
        inv = tl.math.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / HEAD_DIM + eps)[:, None]
        dm = offs_d < HALF
        w1 = tl.load(w_ptr + offs_d, mask=dm, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(w_ptr + HALF + offs_d, mask=dm, other=0.0).to(tl.float32)[None, :]
        x1 = ((x1 * inv).to(dt).to(tl.float32) * w1).to(dt).to(tl.float32)
        x2 = ((x2 * inv).to(dt).to(tl.float32) * w2).to(dt).to(tl.float32)
    return x1 * c + (-x2) * s, x2 * c + x1 * s, m, off


@triton.jit
def _rope_kv_kernel(qkv_ptr, l_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr, q_ptr, kc_ptr, vc_ptr, qn_ptr, kn_ptr,
                    stride_qkv, stride_l, stride_cos, stride_sin, stride_kb, stride_kc, stride_vb, stride_vc, block_size,
                    eps,
                    H: tl.constexpr, HKV: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr,
                    BLOCK_H: tl.constexpr, BLOCK_HKV: tl.constexpr, BLOCK_HALF: tl.constexpr,
                    HAS_NORM: tl.constexpr, HAS_LORA: tl.constexpr, PDL: tl.constexpr = False):
    if PDL:  # launched early (``triton_pdl``): wait for the kernels before, then let the next one launch
        pdl_wait(True)
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    blk, row_in_blk = slot // block_size, slot % block_size  # blocks may lie apart (a unified arena's stride)
    offs_d = tl.arange(0, BLOCK_HALF)
    dm = offs_d < HALF
    c = tl.load(cos_ptr + pos * stride_cos + offs_d, mask=dm, other=0.0)[None, :]
    s = tl.load(sin_ptr + pos * stride_sin + offs_d, mask=dm, other=0.0)[None, :]
    row = qkv_ptr + t * stride_qkv
    lrow = l_ptr + t * stride_l
    # queries -> q [T, H, D]
    o1, o2, m, off = _rope_tile(row, lrow, c, s, qn_ptr, eps, H, HALF, BLOCK_H, BLOCK_HALF, HEAD_DIM, HAS_NORM,
                                HAS_LORA)
    qd = q_ptr + t * (H * HEAD_DIM)
    tl.store(qd + off, o1.to(q_ptr.dtype.element_ty), mask=m)
    tl.store(qd + off + HALF, o2.to(q_ptr.dtype.element_ty), mask=m)
    # keys -> k_cache[slot]
    o1, o2, m, off = _rope_tile(row + H * HEAD_DIM, lrow + H * HEAD_DIM, c, s, kn_ptr, eps, HKV, HALF, BLOCK_HKV,
                                BLOCK_HALF, HEAD_DIM, HAS_NORM, HAS_LORA)
    kd = kc_ptr + blk * stride_kb + row_in_blk * stride_kc
    tl.store(kd + off, o1.to(q_ptr.dtype.element_ty).to(kc_ptr.dtype.element_ty), mask=m)
    tl.store(kd + off + HALF, o2.to(q_ptr.dtype.element_ty).to(kc_ptr.dtype.element_ty), mask=m)
    # values -> v_cache[slot], copied (both halves)
    vs = row + (H + HKV) * HEAD_DIM
    lvs = lrow + (H + HKV) * HEAD_DIM
    vd = vc_ptr + blk * stride_vb + row_in_blk * stride_vc
    for half in tl.static_range(2):
        v = _load_sum(vs + off + half * HALF, lvs + off + half * HALF, m, HAS_LORA)
        tl.store(vd + off + half * HALF, v.to(vc_ptr.dtype.element_ty), mask=m)


@triton.jit
def _glu_kernel(gu_ptr, l_ptr, out_ptr, q_ptr, s_ptr, stride_gu, stride_l, stride_o, stride_q, I, fp8_max, min_scale,
                GELU_TANH: tl.constexpr, HAS_LORA: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False,
                QUANT: tl.constexpr = False):
    if PDL:  # launched early (``triton_pdl``): wait for the kernels before, then let the next one launch
        pdl_wait(True)
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = offs < I
    g = _load_sum(gu_ptr + t * stride_gu + offs, l_ptr + t * stride_l + offs, m, HAS_LORA).to(tl.float32)
    u = _load_sum(gu_ptr + t * stride_gu + I + offs, l_ptr + t * stride_l + I + offs, m, HAS_LORA).to(tl.float32)
    if GELU_TANH:  # 0.5 g (1 + tanh(z)) = g * sigmoid(2 z), z = sqrt(2 / pi) (g + 0.044715 g^3)
        z2 = 1.5957691216057308 * (g + 0.044715 * g * g * g)
        a = g / (1.0 + tl.exp(-z2))
    else:  # F.silu
        a = g / (1.0 + tl.exp(-g))
    a = a.to(out_ptr.dtype.element_ty)  # rounded as torch rounds the activation before the product
    h = (a.to(tl.float32) * u).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + t * stride_o + offs, h, mask=m)
    if QUANT:  # one program holds the whole row (BLOCK >= I): the down GEMM's per-token fp8 input too
        _quant_row(h, q_ptr, s_ptr, t, stride_q, offs, m, fp8_max, min_scale)


# ---------------------------------------------------------------------------------------------- launchers
def _check(name: str, x: torch.Tensor, ndim: int, dtype: torch.dtype | None = None) -> None:
    if x.dim() != ndim:
        raise ValueError(f"{name}: expected a {ndim}-d tensor, got shape {tuple(x.shape)}")
    if x.dtype not in _DTYPES:
        raise ValueError(f"{name}: expected float16, bfloat16 or float32, got {x.dtype}")
    if dtype is not None and x.dtype != dtype:
        raise ValueError(f"{name}: expected dtype {dtype}, got {x.dtype}")
    if x.stride(-1) != 1:
        raise ValueError(f"{name}: the last dimension must be contiguous (stride 1), got strides {x.stride()}")


def _check_lora(lora_delta: torch.Tensor | None, like: torch.Tensor, like_name: str) -> None:
    """A LoRA delta added to ``like`` must have its shape and dtype, with contiguous rows."""
    if lora_delta is None:
        return
    _check("lora_delta", lora_delta, 2, like.dtype)
    if lora_delta.shape != like.shape:
        raise ValueError(f"lora_delta: expected {like_name}'s shape {tuple(like.shape)}, got {tuple(lora_delta.shape)}")


def _fp8_out(x: torch.Tensor, quant: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-token fp8 copy of an op's output [T, N] (``quant``): float8_e4m3fn [T, N] and float32 [T, 1]; else
    one-element placeholders (the kernel does not touch them)."""
    T, N = x.shape
    if quant:  # (in a buffer of at least 64 rows: fp8.empty_fp8_rows)
        return empty_fp8_rows(T, N, x.device), torch.empty(T, 1, dtype=torch.float32, device=x.device)
    return x, x


def _norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
          delta_weight: torch.Tensor | None = None, unit_offset: bool = False,
          lora_delta: torch.Tensor | None = None, quant: bool = False):
    _check("x", x, 2)
    N = x.shape[1]
    if N > MAX_ROW:
        raise ValueError(f"x: rows of at most {MAX_ROW} elements, got {N}")
    for name, w in (("weight", weight), ("delta_weight", delta_weight)):
        if w is not None and (w.shape != (N,) or w.dtype != x.dtype or not w.is_contiguous()):
            raise ValueError(f"{name}: expected a contiguous [{N}] {x.dtype} tensor, got {tuple(w.shape)} {w.dtype}")
    if delta is not None:
        _check("delta", delta, 2, x.dtype)
        if delta.shape != x.shape:
            raise ValueError(f"delta: expected shape {tuple(x.shape)}, got {tuple(delta.shape)}")
        _check_lora(lora_delta, delta, "delta")
    elif lora_delta is not None:
        raise ValueError("lora_delta: only with a delta (it is added to the delta)")
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    q, s = _fp8_out(out, quant)
    if x.shape[0] == 0:
        return (out, (q, s)) if quant else out
    block = triton.next_power_of_2(N)
    d = delta if delta is not None else x
    lo = lora_delta if lora_delta is not None else d
    dw = delta_weight if delta_weight is not None else weight
    _rms_norm_kernel[(x.shape[0],)](x, d, lo, weight, dw, out, q, s, x.stride(0), d.stride(0), lo.stride(0),
                                    out.stride(0), q.stride(0), N, float(eps), FP8_MAX, _MIN_SCALE,
                                    HAS_DELTA=delta is not None, HAS_LORA=lora_delta is not None,
                                    DELTA_NORM=delta_weight is not None, UNIT_OFFSET=bool(unit_offset), BLOCK=block,
                                    QUANT=quant, num_warps=max(1, min(16, block // 512)),
                                    **triton_pdl.launch_args(x.device))
    return (out, (q, s)) if quant else out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, unit_offset: bool = False, quant: bool = False):
    """Triton ``rms_norm_torch``: x [T, N] (last dim contiguous), weight [N] -> new [T, N]; with ``quant``
    ``(y, (yq, ys))``, y's per-token fp8 copy made in the same kernel (``fused.rms_norm``)."""
    return _norm(x, None, weight, eps, unit_offset=unit_offset, quant=quant)


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float, *,
                 delta_weight: torch.Tensor | None = None, unit_offset: bool = False,
                 lora_delta: torch.Tensor | None = None, quant: bool = False):
    """Triton ``add_rms_norm_torch``: ``h += delta`` (or ``h += rms_norm(delta, delta_weight)``; ``lora_delta``
    added to the delta first) in place, returns RMSNorm(h) as a new [T, N]; one kernel. ``quant`` as
    ``rms_norm``'s."""
    return _norm(h, delta, weight, eps, delta_weight, unit_offset, lora_delta, quant)


def rope_write_kv(qkv: torch.Tensor, rope_cos: torch.Tensor, rope_sin: torch.Tensor, positions: torch.Tensor,
                  slot_mapping: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, *, num_heads: int,
                  num_kv_heads: int, head_dim: int, q_norm: torch.Tensor | None = None,
                  k_norm: torch.Tensor | None = None, norm_eps: float = 1e-6,
                  lora_delta: torch.Tensor | None = None) -> torch.Tensor:
    """Triton ``rope_write_kv_torch`` (same arguments and result); one program per token."""
    _check("qkv", qkv, 2)
    _check_lora(lora_delta, qkv, "qkv")
    T, width = qkv.shape
    if width != (num_heads + 2 * num_kv_heads) * head_dim:
        raise ValueError(f"qkv: expected {(num_heads + 2 * num_kv_heads) * head_dim} columns "
                         f"((num_heads + 2 * num_kv_heads) * head_dim), got {width}")
    if head_dim % 2:
        raise ValueError(f"head_dim: RoPE needs an even head_dim, got {head_dim}")
    for name, t in (("rope_cos", rope_cos), ("rope_sin", rope_sin)):
        if t.dtype != torch.float32 or t.dim() != 2 or t.shape[1] != head_dim or t.stride(1) != 1:
            raise ValueError(f"{name}: expected float32 [n_positions, {head_dim}] with contiguous rows, "
                             f"got {t.dtype} {tuple(t.shape)}")
    for name, t in (("positions", positions), ("slot_mapping", slot_mapping)):
        if t.shape != (T,) or t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name}: expected int32/int64 [{T}], got {t.dtype} {tuple(t.shape)}")
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if (c.dim() != 4 or c.shape[2:] != (num_kv_heads, head_dim) or c.stride(3) != 1 or c.stride(2) != head_dim
                or c.stride(1) != num_kv_heads * head_dim):
            raise ValueError(f"{name}: expected [num_blocks, block_size, {num_kv_heads}, {head_dim}] with rows of "
                             f"contiguous heads (blocks may lie apart), got shape {tuple(c.shape)} strides {c.stride()}")
    if (q_norm is None) != (k_norm is None):
        raise ValueError("rope_write_kv: pass both q_norm and k_norm, or neither")
    for name, w in (("q_norm", q_norm), ("k_norm", k_norm)):
        if w is not None and (w.shape != (head_dim,) or w.dtype != qkv.dtype or not w.is_contiguous()):
            raise ValueError(f"{name}: expected a contiguous [{head_dim}] {qkv.dtype} tensor, got "
                             f"{tuple(w.shape)} {w.dtype}")
    q = torch.empty(T, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    if T == 0:
        return q
    half = head_dim // 2
    has_norm = q_norm is not None
    lo = lora_delta if lora_delta is not None else qkv
    _rope_kv_kernel[(T,)](qkv, lo, rope_cos, rope_sin, positions, slot_mapping, q, k_cache, v_cache,
                          q_norm if has_norm else rope_cos, k_norm if has_norm else rope_cos,
                          qkv.stride(0), lo.stride(0), rope_cos.stride(0), rope_sin.stride(0), k_cache.stride(0),
                          k_cache.stride(1), v_cache.stride(0), v_cache.stride(1), k_cache.shape[1], float(norm_eps),
                          H=num_heads, HKV=num_kv_heads, HEAD_DIM=head_dim,
                          HALF=half, BLOCK_H=triton.next_power_of_2(num_heads),
                          BLOCK_HKV=triton.next_power_of_2(num_kv_heads), BLOCK_HALF=triton.next_power_of_2(half),
                          HAS_NORM=has_norm, HAS_LORA=lora_delta is not None, num_warps=4,
                          **triton_pdl.launch_args(qkv.device))
    return q


def silu_mul(gate_up: torch.Tensor, lora_delta: torch.Tensor | None = None, quant: bool = False):
    """Triton ``silu_mul_torch``: gate_up [T, 2 I] (+ lora_delta, same shape) -> new [T, I]; with ``quant``
    ``(h, (hq, hs))``, h's per-token fp8 copy made in the same kernel (one program per row then)."""
    return _glu(gate_up, lora_delta, gelu_tanh=False, quant=quant)


def gelu_tanh_mul(gate_up: torch.Tensor, lora_delta: torch.Tensor | None = None, quant: bool = False):
    """Triton ``gelu_tanh_mul_torch``: gate_up [T, 2 I] (+ lora_delta, same shape) -> new [T, I]; ``quant`` as
    ``silu_mul``'s."""
    return _glu(gate_up, lora_delta, gelu_tanh=True, quant=quant)


def _glu(gate_up: torch.Tensor, lora_delta: torch.Tensor | None, *, gelu_tanh: bool, quant: bool = False):
    _check("gate_up", gate_up, 2)
    _check_lora(lora_delta, gate_up, "gate_up")
    T, two_i = gate_up.shape
    if two_i % 2:
        raise ValueError(f"gate_up: expected an even number of columns [gate | up], got {two_i}")
    inter = two_i // 2
    if quant and inter > MAX_ROW:
        raise ValueError(f"gate_up: quant=True holds a row of at most {MAX_ROW} elements in one program, got {inter}")
    out = torch.empty(T, inter, dtype=gate_up.dtype, device=gate_up.device)
    q, s = _fp8_out(out, quant)
    if T == 0:
        return (out, (q, s)) if quant else out
    # quant: one program per row (the row's absolute maximum before any store of q), else 1,024-wide column blocks
    block = triton.next_power_of_2(inter) if quant else 1024
    warps = max(4, min(16, block // 1024)) if quant else 4
    lo = lora_delta if lora_delta is not None else gate_up
    _glu_kernel[(T, triton.cdiv(inter, block))](gate_up, lo, out, q, s, gate_up.stride(0), lo.stride(0), out.stride(0),
                                                q.stride(0), inter, FP8_MAX, _MIN_SCALE, GELU_TANH=gelu_tanh,
                                                HAS_LORA=lora_delta is not None, BLOCK=block, QUANT=quant,
                                                num_warps=warps, **triton_pdl.launch_args(gate_up.device))
    return (out, (q, s)) if quant else out
