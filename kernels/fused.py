"""The decoder's small per-token ops, each one launch on the GPU: RMSNorm (optionally after the residual add,
optionally of a delta RMS-normed first: Gemma 2's post-attention / post-feedforward norms), RoPE of q and k with
the cache write of k and v (optionally after a per-head RMSNorm of q and k, Qwen3's ``q_norm`` / ``k_norm``),
and the gated MLP activations SiLU(gate) * up (SwiGLU) and GELU_tanh(gate) * up (GeGLU, Gemma 2).

At batch 1 a Llama-3-8B decode step is about 3.9 ms of weight GEMMs; written as plain torch ops these
three steps were about 40 small kernels per layer (float casts, pow, mean, rsqrt, neg, cat, index_copy, ...),
about 1,500 launches and 2.4 ms per step on an H200 (``bench/profile_decode.py``). Each op here is one
Triton kernel (``multilora.kernels.triton_fused``) with the torch version as the CPU path and test oracle.

Every op rounds where the HF Llama reference (``transformers`` ``LlamaRMSNorm``, ``apply_rotary_pos_emb``,
``LlamaMLP``) rounds: RMSNorm in float32, cast to the activation dtype, then times the weight in that dtype;
RoPE in float32 (rotate-half convention), cast once; SiLU cast to the dtype before the product with ``up``.
The Triton kernels do the same float32 math, so they differ from torch only in reduction order (RMSNorm's
mean of squares) and fused multiply-adds, within one unit in the last place of the output dtype.

Gemma 2 rounds elsewhere (``transformers`` ``Gemma2RMSNorm``, ``unit_offset=True``): the normed value times
``1 + weight``, both in float32, cast once; its MLP is ``gelu(gate, approximate="tanh")`` cast to the dtype, times up.

Backends (argument ``backend``): ``"torch"``, ``"triton"``, or None = triton for CUDA tensors when it
imports, else torch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from multilora.kernels.backends import select_triton
from multilora.kernels.fp8 import quantize_per_token_torch


# --------------------------------------------------------------------------------------- torch (oracle)
def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float, *, unit_offset: bool = False) -> torch.Tensor:
    """RMSNorm (Zhang & Sennrich 2019): ``weight * (x / sqrt(mean(x^2) + eps))``, in float32 as HF Llama (the
    normed value cast to x's dtype, then times the weight in that dtype).

    ``unit_offset`` (Gemma 2, HF ``Gemma2RMSNorm``): ``(x / sqrt(mean(x^2) + eps)) * (1 + weight)`` all in float32,
    cast once (the checkpoint's weight is the offset from 1).

    x [T, N] (any float dtype); weight [N], x's dtype. Returns [T, N] in x's dtype."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if unit_offset:
        return (xf * (1.0 + weight.float())).to(x.dtype)
    return weight * xf.to(x.dtype)


def add_rms_norm_torch(h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float, *,
                       delta_weight: torch.Tensor | None = None, unit_offset: bool = False,
                       lora_delta: torch.Tensor | None = None) -> torch.Tensor:
    """The residual add, in place, then RMSNorm of the sum: ``h += delta; return rms_norm(h)``.

    ``lora_delta`` (same shape and dtype as ``delta``, or None): a LoRA output computed beside the projection
    that produced ``delta`` (``runtime.model``'s side stream), added to it first (``delta + lora_delta``, rounded
    to the dtype as peft's ``base_layer(x) + lora(x)``), before any norm of the delta.

    With ``delta_weight`` the delta is RMS-normed first (``h += rms_norm(delta, delta_weight)``: Gemma 2's
    post-attention and post-feedforward norms), rounded to the dtype before the add as HF's ``residual + norm(x)``.
    ``unit_offset`` applies to both norms (``rms_norm_torch``).

    h, delta [T, N], same dtype (h is updated in place: the residual stream); weight, delta_weight [N]. Returns
    [T, N]."""
    if lora_delta is not None:
        delta = delta + lora_delta
    if delta_weight is not None:
        delta = rms_norm_torch(delta, delta_weight, eps, unit_offset=unit_offset)
    h.add_(delta)
    return rms_norm_torch(h, weight, eps, unit_offset=unit_offset)


def rope_write_kv_torch(qkv: torch.Tensor, rope_cos: torch.Tensor, rope_sin: torch.Tensor, positions: torch.Tensor,
                        slot_mapping: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, *,
                        num_heads: int, num_kv_heads: int, head_dim: int, q_norm: torch.Tensor | None = None,
                        k_norm: torch.Tensor | None = None, norm_eps: float = 1e-6,
                        lora_delta: torch.Tensor | None = None) -> torch.Tensor:
    """RoPE (RoFormer, Su et al. 2021; rotate-half) on q and k, then k and v written to their cache slots.

    With ``q_norm`` / ``k_norm`` (both or neither), each q head and each k head is first RMS-normalised over its
    ``head_dim`` values and scaled by that weight (``rms_norm_torch`` per head, as HF Qwen3's ``q_norm`` /
    ``k_norm``): ``q[t, h] = rope(rms_norm(q[t, h], q_norm))``.

    Args:
        qkv: [T, (num_heads + 2 * num_kv_heads) * head_dim], the fused q/k/v projection, rows contiguous.
        rope_cos, rope_sin: float32 [n_positions, head_dim] (``cat(freqs, freqs)`` layout), rows by position.
        positions: int64 [T], each token's absolute position (< n_positions).
        slot_mapping: int64 [T], each token's flat cache slot (``block * block_size + offset``).
        k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], written in place (rows of a block
            contiguous; blocks may lie any stride apart).
        q_norm, k_norm: None, or [head_dim] in qkv's dtype; norm_eps: their epsilon.
        lora_delta: None, or qkv's shape and dtype: the projection's LoRA output, added first
            (``qkv + lora_delta``, rounded to the dtype); qkv itself is not changed.

    Returns:
        q after RoPE, [T, num_heads, head_dim] in qkv's dtype (a new tensor).
    """
    T = qkv.shape[0]
    if lora_delta is not None:
        qkv = qkv + lora_delta
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    cos = rope_cos.index_select(0, positions)[:, None, :]  # [T, 1, D]
    sin = rope_sin.index_select(0, positions)[:, None, :]

    def rope(x: torch.Tensor) -> torch.Tensor:
        half = head_dim // 2
        rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return (x.float() * cos + rot.float() * sin).to(x.dtype)

    q, k = q.reshape(T, num_heads, head_dim), k.reshape(T, num_kv_heads, head_dim)
    if (q_norm is None) != (k_norm is None):
        raise ValueError("rope_write_kv: pass both q_norm and k_norm, or neither")
    if q_norm is not None:
        q, k = rms_norm_torch(q, q_norm, norm_eps), rms_norm_torch(k, k_norm, norm_eps)
    q = rope(q)
    k = rope(k)
    bs = k_cache.shape[1]
    blk, row = slot_mapping // bs, slot_mapping % bs  # (blocks may lie apart: a unified arena's KV views)
    k_cache[blk, row] = k.to(k_cache.dtype)
    v_cache[blk, row] = v.reshape(T, num_kv_heads, head_dim).to(v_cache.dtype)
    return q


def silu_mul_torch(gate_up: torch.Tensor, lora_delta: torch.Tensor | None = None) -> torch.Tensor:
    """SwiGLU's gate (Shazeer 2020): gate_up [T, 2 * I] = [gate | up] -> ``silu(gate) * up`` [T, I].
    ``lora_delta`` (gate_up's shape and dtype, or None) is added to gate_up first, rounded to the dtype."""
    if lora_delta is not None:
        gate_up = gate_up + lora_delta
    g, u = gate_up.chunk(2, dim=-1)
    return F.silu(g) * u


def gelu_tanh_mul_torch(gate_up: torch.Tensor, lora_delta: torch.Tensor | None = None) -> torch.Tensor:
    """GeGLU's gate (Shazeer 2020) with the tanh approximation of GELU (Hendrycks & Gimpel 2016; HF
    ``gelu_pytorch_tanh``, Gemma 2): gate_up [T, 2 * I] = [gate | up] -> ``gelu_tanh(gate) * up`` [T, I], where
    ``gelu_tanh(x) = 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))``; ``lora_delta`` as for ``silu_mul_torch``."""
    if lora_delta is not None:
        gate_up = gate_up + lora_delta
    g, u = gate_up.chunk(2, dim=-1)
    return F.gelu(g, approximate="tanh") * u


# ------------------------------------------------------------------------------------------- dispatch
def _kernels(backend: str | None, x: torch.Tensor):
    """``multilora.kernels.triton_fused`` when ``backend`` means Triton for ``x``, else None (the torch path).

    Raises:
        ValueError: an unknown backend, or "triton" when triton does not import (``backends.select_triton``).
    """
    return select_triton(backend, x, "triton_fused")


def _with_fp8(y: torch.Tensor, quant: bool):
    """The torch path's ``quant``: ``(y, fp8.quantize_per_token_torch(y))``, else y."""
    return (y, quantize_per_token_torch(y)) if quant else y


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, unit_offset: bool = False,
             backend: str | None = None, quant: bool = False):
    """``rms_norm_torch`` or its one-kernel Triton twin (see the module docstring for ``backend``).

    ``quant``: return ``(y, (yq, ys))``, y with its per-token fp8 copy (float8_e4m3fn [T, N], float32 [T, 1]; bit for
    bit what the quantization of that y gives: ``fp8.quantize_per_token_torch`` on the torch path, Triton's
    ``quantize_per_token`` on the Triton path), written by the same kernel: the input of an fp8 GEMM that quantizes
    its activations (``fp8.fp8_linear``'s ``x_fp8``), one launch fewer per GEMM. On the GPU, y itself may differ in
    the last place from the call without ``quant`` (another compiled variant; the torch path is exact)."""
    k = _kernels(backend, x)
    if k is None:
        return _with_fp8(rms_norm_torch(x, weight, eps, unit_offset=unit_offset), quant)
    return k.rms_norm(x, weight, eps, unit_offset=unit_offset, quant=quant)


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float, *,
                 delta_weight: torch.Tensor | None = None, unit_offset: bool = False,
                 lora_delta: torch.Tensor | None = None, backend: str | None = None, quant: bool = False):
    """``add_rms_norm_torch`` (``h += delta``, or ``h += rms_norm(delta, delta_weight)``, in place; returns the
    normed sum; ``lora_delta`` added to ``delta`` first) or its one-kernel twin (both norms and the adds in one
    pass over the row). ``quant`` as ``rms_norm``'s."""
    k = _kernels(backend, h)
    if k is None:
        return _with_fp8(add_rms_norm_torch(h, delta, weight, eps, delta_weight=delta_weight,
                                            unit_offset=unit_offset, lora_delta=lora_delta), quant)
    return k.add_rms_norm(h, delta, weight, eps, delta_weight=delta_weight, unit_offset=unit_offset,
                          lora_delta=lora_delta, quant=quant)


def rope_write_kv(qkv: torch.Tensor, rope_cos: torch.Tensor, rope_sin: torch.Tensor, positions: torch.Tensor,
                  slot_mapping: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, *, num_heads: int,
                  num_kv_heads: int, head_dim: int, q_norm: torch.Tensor | None = None,
                  k_norm: torch.Tensor | None = None, norm_eps: float = 1e-6,
                  lora_delta: torch.Tensor | None = None, backend: str | None = None) -> torch.Tensor:
    """``rope_write_kv_torch`` or its one-kernel Triton twin (one program per token; the q/k norm, when given,
    and the LoRA delta's add are in the same kernel)."""
    k = _kernels(backend, qkv)
    fn = rope_write_kv_torch if k is None else k.rope_write_kv
    return fn(qkv, rope_cos, rope_sin, positions, slot_mapping, k_cache, v_cache, num_heads=num_heads,
              num_kv_heads=num_kv_heads, head_dim=head_dim, q_norm=q_norm, k_norm=k_norm, norm_eps=norm_eps,
              lora_delta=lora_delta)


def silu_mul(gate_up: torch.Tensor, *, lora_delta: torch.Tensor | None = None,
             backend: str | None = None, quant: bool = False):
    """``silu_mul_torch`` or its one-kernel Triton twin; ``quant`` as ``rms_norm``'s (the down GEMM's input)."""
    k = _kernels(backend, gate_up)
    if k is None:
        return _with_fp8(silu_mul_torch(gate_up, lora_delta), quant)
    return k.silu_mul(gate_up, lora_delta, quant=quant)


def gelu_tanh_mul(gate_up: torch.Tensor, *, lora_delta: torch.Tensor | None = None,
                  backend: str | None = None, quant: bool = False):
    """``gelu_tanh_mul_torch`` or its one-kernel Triton twin; ``quant`` as ``rms_norm``'s."""
    k = _kernels(backend, gate_up)
    if k is None:
        return _with_fp8(gelu_tanh_mul_torch(gate_up, lora_delta), quant)
    return k.gelu_tanh_mul(gate_up, lora_delta, quant=quant)


#: HF MLP activation name (``ModelConfig.hidden_act``) -> the gated op: ``act(gate) * up``.
GATED_ACTS = {"silu": silu_mul, "gelu_pytorch_tanh": gelu_tanh_mul}
