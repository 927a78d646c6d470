"""The gate/up LoRA expand fused into the gated activation (prefill): measured SLOWER than the engine's path, so the
engine does not call it (its switch, session 31's ``runtime.model.LORA_FUSED_GLU_MIN_TOKENS``, was removed in session
32). Session 32, H200 (``python bench/bench_expand_glu.py``, 4,096 tokens on 64 adapters, Llama-3-8B gate/up, rank
16, 5 interleaved rounds; ``bench/results/session32/call1``): the layer's LoRA added 296-679 us over the base GEMM +
activation (1,556 us) at six tile configs (best 64 x 4 tiles, 4 warps), against 155 us for the engine's path (the
term written before the GEMM) and 189 us for the LoRA added after it; the same bits as ``lora_apply`` + the
activation at every config. This kernel moves less memory than those paths, so it is far from its bandwidth: each
program gathers a chunk's rows of gate and of up (two 2-D loads I apart) and its v tile; why it is slow is not yet
profiled.

For ``gate_up = x [W_gate; W_up]^T`` (the base GEMM's output without LoRA, ``[T, 2 I]``) and ``v`` the shrink of
``x`` on the two slices gate and up (``triton_sgmv.sgmv_shrink``), every row ``t``::

    g = gate_up[t, :I];  u = gate_up[t, I:]
    if s = token_slots[t] >= 0:              # the LoRA terms, rounded as the in-place expand rounds them
        g = rnd(g + rnd(scaling_g[s] * v_g[t] @ B_g[s]^T))     (rank 0: no term)
        u = rnd(u + rnd(scaling_u[s] * v_u[t] @ B_u[s]^T))
    out[t] = rnd(rnd(act(g)) * u)            # act: SiLU, or GELU (tanh) with ``gelu_tanh``

(``rnd``: to gate_up's dtype), so ``out`` is bit for bit ``lora_apply`` in place on ``gate_up`` followed by the
Triton ``silu_mul`` / ``gelu_tanh_mul`` (``multilora.kernels.triton_fused``) from a pool of rank <= 16 (one rank
tile; a wider pool's term is one dot over all its ranks, which may round its sum differently from the expand's
16-rank tiles).

Why: at 4,096 prefill tokens the engine's in-place LoRA writes gate/up's term (235 MB for Llama-3-8B) and the base
GEMM's epilogue reads it back; here it never leaves registers. Session 31 (H200): the writing expand alone took 94
us of a layer's ~350 us of prefill LoRA (``bench/results/session31/``), the GEMM's extra read about 1% of its 1.3
ms; the layer's prefill LoRA added 13-16% against issue 12's goal of 8%. ``python bench/bench_expand_glu.py`` (GPU)
times it against the engine's path and the add-after path.

Each program takes one chunk of the plan (``LoRAPlan``: tokens of one slot) and ``TILES`` output tiles of
``BLOCK_N`` columns of I; rows without an adapter (in no chunk) are taken by the programs in turn, token
``chunk, chunk + G, ...`` (G programs along the chunks), as ``triton_sgmv``'s writing expand zeroes them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from multilora.kernels.lora import LoRAPlan, LoRASlices
from multilora.kernels.triton_sgmv import (_chunk_tokens, _dot, _rank_rows, _slot_offset, _v_tile, check_io,
                                          check_v, num_chunks)


@triton.jit
def _glu_math(gate, up, out_ptr, GELU_TANH: tl.constexpr):
    """``rnd(rnd(act(gate)) * up)`` of fp32 ``gate`` and ``up`` (each already rounded to ``out_ptr``'s element type,
    ``rnd``'s), as ``triton_fused._glu_kernel`` computes it (the bit tests hold the two together)."""
    dt = out_ptr.dtype.element_ty
    if GELU_TANH:  # 0.5 g (1 + tanh(z)) = g * sigmoid(2 z), z = sqrt(2 / pi) (g + 0.044715 g^3)
        z2 = 1.5957691216057308 * (gate + 0.044715 * gate * gate * gate)
        a = gate / (1.0 + tl.exp(-z2))
    else:  # F.silu
        a = gate / (1.0 + tl.exp(-gate))
    return (a.to(dt).to(tl.float32) * up).to(dt)


@triton.jit(do_not_specialize=["T", "stride_c"])  # one compiled variant for every token count (as triton_sgmv's)
def _expand_glu_kernel(
    gu_ptr, out_ptr, buf_ptr, offb_ptr, ranks_ptr, scal_ptr, v_ptr, chunks_ptr, slots_ptr,
    T, I, meta_stride, stride_gu, stride_o, stride_c,
    SPLIT_K: tl.constexpr, RMAX: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr, ALIGN: tl.constexpr, IEEE: tl.constexpr, TILES: tl.constexpr, GELU_TANH: tl.constexpr,
):
    chunk = tl.program_id(0)
    n0 = tl.program_id(1) * (TILES * BLOCK_N)
    G = tl.num_programs(0)
    dt = out_ptr.dtype.element_ty
    # rows without an adapter (no chunk covers them): tokens chunk, chunk + G, ..., BLOCK_M at a time
    for t0 in range(chunk, T, G * BLOCK_M):
        ts = t0 + G * tl.arange(0, BLOCK_M)
        keep = (ts < T) & (tl.load(slots_ptr + ts, mask=ts < T, other=0) < 0)
        rows = ts.to(tl.int64)
        for g in tl.static_range(TILES):
            n = n0 + g * BLOCK_N + tl.arange(0, BLOCK_N)
            msk = keep[:, None] & (n < I)[None, :]
            gp = gu_ptr + rows[:, None] * stride_gu + n[None, :]
            gate = tl.load(gp, mask=msk, other=0.0).to(tl.float32)
            up = tl.load(gp + I, mask=msk, other=0.0).to(tl.float32)
            tl.store(out_ptr + rows[:, None] * stride_o + n[None, :], _glu_math(gate, up, out_ptr, GELU_TANH),
                     mask=msk)
    # the chunk's rows: one slot, the gate (slice 0) and up (slice 1) terms added before the activation
    slot = tl.load(chunks_ptr + stride_c + chunk)  # chunk_slot
    if slot < 0:  # a padding chunk
        return
    tok, m_mask = _chunk_tokens(chunks_ptr, stride_c, chunk, BLOCK_M)
    r_g = tl.load(ranks_ptr + slot)
    r_u = tl.load(ranks_ptr + meta_stride + slot)
    s_g = tl.where(r_g > 0, tl.load(scal_ptr + slot), 0.0)  # (a slice the adapter does not target: no term)
    s_u = tl.where(r_u > 0, tl.load(scal_ptr + meta_stride + slot), 0.0)
    j = tl.arange(0, BLOCK_R)
    jg, ju = j < r_g, j < r_u
    sid_g = r_g * 0  # the slice ids 0 and 1 as int32 scalars (``_v_tile`` computes with them)
    vg = _v_tile(v_ptr, sid_g, T, tok, j, m_mask[:, None] & jg[None, :], 2, SPLIT_K, RMAX, BLOCK_M, BLOCK_R)
    vu = _v_tile(v_ptr, sid_g + 1, T, tok, j, m_mask[:, None] & ju[None, :], 2, SPLIT_K, RMAX, BLOCK_M, BLOCK_R)
    bg_rows = _rank_rows(buf_ptr, _slot_offset(offb_ptr, 0, meta_stride, slot, ALIGN), j, I)
    bu_rows = _rank_rows(buf_ptr, _slot_offset(offb_ptr, 1, meta_stride, slot, ALIGN), j, I)
    for g in tl.static_range(TILES):  # the B rows' address is affine in g: the next tiles can be in flight
        n = n0 + g * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = n < I
        bg = tl.load(bg_rows[:, None] + n[None, :], mask=jg[:, None] & n_mask[None, :], other=0.0)
        bu = tl.load(bu_rows[:, None] + n[None, :], mask=ju[:, None] & n_mask[None, :], other=0.0)
        # the term as the in-place expand rounds it (its accumulator starts at +0: a -0 dot becomes +0)
        lg = (s_g * (0.0 + _dot(vg.to(bg.dtype), bg, IEEE))).to(dt).to(tl.float32)
        lu = (s_u * (0.0 + _dot(vu.to(bu.dtype), bu, IEEE))).to(dt).to(tl.float32)
        msk = m_mask[:, None] & n_mask[None, :]
        gp = gu_ptr + tok[:, None] * stride_gu + n[None, :]
        gate = tl.load(gp, mask=msk, other=0.0).to(tl.float32)
        up = tl.load(gp + I, mask=msk, other=0.0).to(tl.float32)
        gate = tl.where(r_g > 0, (gate + lg).to(dt).to(tl.float32), gate)  # (rank 0: the expand leaves y as it is)
        up = tl.where(r_u > 0, (up + lu).to(dt).to(tl.float32), up)
        tl.store(out_ptr + tok[:, None] * stride_o + n[None, :], _glu_math(gate, up, out_ptr, GELU_TANH), mask=msk)


def expand_glu(gate_up: torch.Tensor, v: torch.Tensor, slices: LoRASlices, plan: LoRAPlan, *,
               gelu_tanh: bool = False, block_n: int | None = None, tiles: int | None = None,
               num_warps: int | None = None, num_stages: int | None = None) -> torch.Tensor:
    """The gated activation of ``gate_up`` with the gate/up LoRA terms added first (module docstring).

    Args:
        gate_up: ``[T, 2 I]`` fp16 / bf16 / fp32 (the pool's dtype), unit stride along features: ``[gate | up]``,
            the base GEMM's output without LoRA.
        v: the shrink of x on ``slices`` (``triton_sgmv.sgmv_shrink``): fp32 ``[split_k, 2, T,
            slices.max_rank_rows]``, contiguous.
        slices: the gate and up slices of one layer (``lora_slices([view(gate_proj), view(up_proj)])``), each I wide.
        plan: the step's ``LoRAPlan`` (T tokens).
        gelu_tanh: GELU (tanh approximation, Gemma's ``gelu_pytorch_tanh``) instead of SiLU.
        block_n, tiles, num_warps, num_stages: tile overrides (None: 128 x 4 tiles, 4 warps, 2 stages on a GPU,
            the writing expand's best prefill tiles of session 31; 16 x 2 on the CPU).

    Returns:
        ``[T, I]`` in gate_up's dtype, a new tensor.

    Raises:
        ValueError: slices that are not two of width I = gate_up's columns / 2; gate_up or v of the wrong shape,
            dtype, device or stride (``check_io``); a ``block_n`` that is not a power of two >= 16.
    """
    check_io(slices, plan, gate_up=gate_up)
    if gate_up.dim() != 2:
        raise ValueError(f"gate_up: expected a 2-d [T, 2 I] tensor, got shape {tuple(gate_up.shape)}")
    T, two_i = gate_up.shape
    widths = [vw.d_out for vw in slices.views]
    if len(widths) != 2 or two_i % 2 or widths != [two_i // 2] * 2:
        raise ValueError(f"slices: expected the gate and up slices, each gate_up's columns / 2 = {two_i / 2:g} wide, "
                         f"got widths {widths}")
    if T != plan.num_tokens:
        raise ValueError(f"gate_up: expected the plan's {plan.num_tokens} rows, got {T}")
    check_v(v, slices, plan)  # (two slices, checked above)
    inter = two_i // 2
    out = torch.empty(T, inter, dtype=gate_up.dtype, device=gate_up.device)
    if T == 0:
        return out
    cuda = gate_up.device.type == "cuda"
    block_n = block_n or (128 if cuda else 16)
    tiles = tiles or (4 if cuda else 2)
    if block_n < 16 or block_n & (block_n - 1) or tiles < 1:
        raise ValueError(f"block_n, tiles: expected a power of two >= 16 and an int >= 1, got {block_n}, {tiles}")
    if num_stages is None and cuda:
        num_stages = 2
    extra = {} if num_stages is None else {"num_stages": num_stages}  # (the CPU's interpreter: none)
    split, _, _, rmax = v.shape
    _expand_glu_kernel[(num_chunks(plan, slices), triton.cdiv(inter, tiles * block_n))](
        gate_up, out, slices.buffer, slices.offsets_b, slices.ranks, slices.scalings, v, plan.chunks,
        plan.token_slots, T, inter, slices.meta_stride, gate_up.stride(0), out.stride(0), plan.chunks.stride(0),
        SPLIT_K=split, RMAX=rmax, BLOCK_M=plan.block_m, BLOCK_N=block_n,
        BLOCK_R=max(16, triton.next_power_of_2(rmax)), ALIGN=slices.align, IEEE=gate_up.dtype == torch.float32,
        TILES=tiles, GELU_TANH=gelu_tanh, num_warps=num_warps or 4, **extra,
    )
    return out
