"""Triton paged attention: prefill of variable-length prompts and decode, mixed in ONE launch for the batch.

Semantics (``paged_attention`` in ``multilora.kernels.attention``; sequence ``b`` with ``n_b`` new tokens and
``L_b`` tokens of context, query ``i`` at absolute position ``p = L_b - n_b + i``, head ``h``, ``G = H // Hkv``)::

    out[t, h] = softmax_j( cap( scale * q[t, h] . K_b[j, h // G] ) ) @ V_b[j, h // G]
                over j <= p  and  (sliding_window == 0  or  j > p - sliding_window)

(``cap(s) = softcap * tanh(s / softcap)`` when ``softcap > 0``, Gemma 2; else ``cap(s) = s``: a constexpr branch,
so a model without soft-capping runs the same code as before)

with ``K_b[j] = k_cache[block_tables[b, j // block_size], j % block_size]``. The softmax is the online
(streaming) softmax of FlashAttention-2 (Dao, 2023, arXiv:2307.08691): running row max ``m`` and sum ``l``
in fp32, base-2 exponentials with ``log2(e)`` folded into the scale, one rescale of the accumulator per
key tile and one division at the end.

**Tiles and programs.** One program owns (a tile of query rows, one KV head, one split of the keys). Its
``BLOCK_M`` rows pack ``BLOCK_Q`` consecutive tokens of one sequence times the ``G`` query heads that
share the KV head: row ``r`` is token ``q0 + r // G`` and head ``kvh * G + r % G`` (``G`` need not be a
power of two; rows past ``BLOCK_Q * G`` are padding). So each KV tile is read once per KV head and feeds
one MMA for all ``G`` heads, at decode too (Llama-3-8B, G = 4: 4 of the 16 rows of an MMA at decode;
32 tokens x 4 heads = 128 rows at prefill). When ``G`` exceeds a program's rows (MQA with many heads) the
heads are cut into groups of ``G_TILE``, one group per program. Each program walks its keys in
``BLOCK_N`` tiles, looking each key's block up in the block table (any power-of-two ``block_size``, 1
included; cache offsets in int64), in up to three ranges: the keys every row of the tile may see
(causally and inside its window: no mask, no bounds checks), and masked ranges before it (the window's
edge) and after it (the causal diagonal).

**Decode** (``T == B``: every sequence has one new token; a property of the shapes alone) needs no host
metadata: program ``(b, kvh * groups + g, split)`` takes sequence ``b`` and loops to ``seq_lens[b]`` read
from device memory. The grid and every argument depend only on ``(T, B, H, Hkv, D, block_size,
block_tables.shape[1])`` and the device, never on the values of ``seq_lens`` or ``block_tables``: the
engine captures one CUDA graph per batch size and updates ``seq_lens`` / ``block_tables`` in place before
each replay. A sequence with ``seq_lens[b] == 0`` (a padding slot of a graph bucket) gets zeros.

**Split-KV for decode** (flash-decoding, Dao, Haziza, Massa and Sizov, 2023): when ``B * Hkv`` programs
would leave SMs idle, each sequence's keys are cut into ``num_splits`` equal runs of key tiles (computed in
the kernel from ``seq_lens[b]``; ``num_splits`` itself from static sizes), each split writes its partial
output and log-sum-exp in fp32, and a second small kernel combines them.

On GPUs of compute capability 9.0+ both kernels are launched with programmatic dependent launch
(``triton_pdl``): their programs wait for the kernels before them (the RoPE + KV write) first.

**Prefill and mixed batches** use a tile table built on the host with the step's metadata
(``build_attention_metadata(..., tiles_block_q=prefill_block_q(...))``, ``meta.tiles``; a launch whose
metadata carries no table for its ``BLOCK_Q`` builds one for that call): int32 ``[2, num_tiles]``,
``tile_seq`` and ``tile_q0`` (first new token of the tile), one entry per ``BLOCK_Q`` new tokens of each
sequence, ordered by decreasing causal key count so that the longest tiles start first (the last tiles of
long prompts would otherwise trail). Worked example with ``q_lens = [5, 1, 3]``, ``seq_lens = [5, 9, 7]``
(a prompt, a decode, a chunked prefill) and ``BLOCK_Q = 2``::

    tiles (seq, q0) by sequence:  (0, 0) (0, 2) (0, 4) | (1, 0) | (2, 0) (2, 2)
    keys each tile reads:            2      4      5   |    9   |    6      7      # L - n + min(q0 + 2, n)
    tile_seq = [1, 2, 2, 0, 0, 0]
    tile_q0  = [0, 2, 0, 4, 2, 0]                                # longest first; ties keep sequence order

The table reads ``seq_lens`` only for this order; a decode batch has no table (see above).

The kernel does not specialise on ``num_tiles`` nor on the block table's row stride ``stride_bt`` (the widest
block table of an eager step; ``do_not_specialize``): one compiled variant serves every tile count and width,
where Triton would compile three of each (1, multiples of 16, the rest) and a serving step reaching a new one
would stall on the compile.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from multilora.kernels import triton_pdl
from multilora.kernels.attention import tile_table
from multilora.kernels.backends import num_sms
from multilora.kernels.triton_pdl import pdl_wait

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_LOG2E = 1.4426950408889634
MAX_SPLITS = 32  # key splits of one sequence at decode, at most


# ---------------------------------------------------------------------------------------------- kernels
@triton.jit
def _tanh(x):
    """tanh in float32 from ``exp`` (the interpreter has no libdevice): ``sign(x) (1 - e) / (1 + e)`` with
    ``e = exp(-2 |x|)`` (no overflow; exact +-1 in the tails), and for ``|x| < 1/4``, where ``1 - e`` would cancel,
    its odd Taylor polynomial to x^11 (truncation error below 1e-10 relative). Within a few float32 ulps of
    ``torch.tanh`` everywhere (``tests/test_attention.py``)."""
    x2 = x * x
    poly = x * (1.0 + x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0 + x2 * (-17.0 / 315.0 + x2 * (62.0 / 2835.0
                                                                                   + x2 * (-1382.0 / 155925.0))))))
    e = tl.exp(-2.0 * tl.abs(x))
    big = (1.0 - e) / (1.0 + e)
    return tl.where(tl.abs(x) < 0.25, poly, tl.where(x < 0, -big, big))


@triton.jit
def _attend_range(
    acc, m_i, l_i, q, pos, k_base, v_base, bt_row, lo, hi, kv_hi, qk_scale, cap_scale, window,
    stride_kb, stride_ks, stride_vb, stride_vs,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    MASK: tl.constexpr, SLIDING: tl.constexpr, SOFTCAP: tl.constexpr, IEEE: tl.constexpr,
):
    """Online-softmax update of (acc, m, l) over keys ``[lo, hi)`` in tiles of ``BLOCK_N`` (``lo`` aligned).
    ``MASK``: apply the causal / window mask and bound loads by ``kv_hi``; else every key is visible.
    Scores in log2 units: ``q.k * qk_scale``, or with ``SOFTCAP`` ``tanh(q.k * qk_scale) * cap_scale``
    (the launcher passes ``qk_scale = scale / softcap`` and ``cap_scale = softcap * log2(e)``)."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    for start in range(lo, hi, BLOCK_N):
        j = start + offs_n  # key positions [BLOCK_N]
        if MASK:
            j_ok = j < kv_hi
            blk = tl.load(bt_row + j // BLOCK_SIZE, mask=j_ok, other=0).to(tl.int64)
        else:
            blk = tl.load(bt_row + j // BLOCK_SIZE).to(tl.int64)
        slot = (j % BLOCK_SIZE).to(tl.int64)
        k_rows = k_base + blk * stride_kb + slot * stride_ks  # [BLOCK_N]
        v_rows = v_base + blk * stride_vb + slot * stride_vs
        if MASK:
            k = tl.load(k_rows[:, None] + offs_d[None, :], mask=j_ok[:, None], other=0.0)  # [BLOCK_N, D]
        else:
            k = tl.load(k_rows[:, None] + offs_d[None, :])
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        if SOFTCAP:
            s = _tanh(s * qk_scale) * cap_scale  # [BLOCK_M, BLOCK_N], log2 units
        else:
            s = s * qk_scale  # [BLOCK_M, BLOCK_N], log2 units
        if MASK:
            ok = j[None, :] <= pos[:, None]
            if SLIDING:
                ok = ok & (j[None, :] > pos[:, None] - window)
            s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        if MASK:  # a row may have seen no key yet: subtract 0 instead of -inf (m stays -inf until a key)
            m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_sub = m_new
        alpha = tl.exp2(m_i - m_sub)
        p = tl.exp2(s - m_sub[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if MASK:
            v = tl.load(v_rows[:, None] + offs_d[None, :], mask=j_ok[:, None], other=0.0)
        else:
            v = tl.load(v_rows[:, None] + offs_d[None, :])
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit(do_not_specialize=["num_tiles", "stride_bt"])  # one variant per config (module docstring)
def _paged_attention_kernel(
    # pointers
    out_ptr, q_ptr, k_ptr, v_ptr, bt_ptr, seq_lens_ptr, qsl_ptr, tiles_ptr, part_o_ptr, part_lse_ptr,
    # sizes
    num_tiles, num_heads, window, qk_scale, cap_scale,
    # strides
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
    # meta
    G: tl.constexpr, G_TILE: tl.constexpr, GROUPS: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, DECODE: tl.constexpr,
    NUM_SPLITS: tl.constexpr, SLIDING: tl.constexpr, SOFTCAP: tl.constexpr, IEEE: tl.constexpr,
    PDL: tl.constexpr = False,
):
    if PDL:  # launched early (``triton_pdl``): wait for the kernels before, then let the next one launch
        pdl_wait(True)
    kvh = tl.program_id(1) // GROUPS
    grp = tl.program_id(1) % GROUPS
    split = tl.program_id(2)
    if DECODE:  # program = sequence, its one query at position L - 1; nothing read from the host
        b = tl.program_id(0)
        L = tl.load(seq_lens_ptr + b)
        q0 = 0
        qs = b
        n = 1
        first = L - 1
        kv_hi = L
    else:
        b = tl.load(tiles_ptr + tl.program_id(0))
        L = tl.load(seq_lens_ptr + b)
        q0 = tl.load(tiles_ptr + num_tiles + tl.program_id(0))
        qs = tl.load(qsl_ptr + b)
        n = tl.load(qsl_ptr + b + 1) - qs
        first = L - n + q0  # position of the tile's first query
        kv_hi = L - n + tl.minimum(q0 + BLOCK_Q, n)  # one past the position of its last query

    # rows: token q0 + r // G_TILE, head kvh * G + grp * G_TILE + r % G_TILE
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    ti = offs_m // G_TILE
    g = grp * G_TILE + offs_m % G_TILE
    i = q0 + ti
    row_ok = (ti < BLOCK_Q) & (g < G) & (i < n)
    h = kvh * G + g
    pos = L - n + i  # absolute position of each row's query
    tok = (qs + i).to(tl.int64)
    q = tl.load(q_ptr + tok[:, None] * stride_qt + h[:, None] * stride_qh + offs_d[None, :],
                mask=row_ok[:, None], other=0.0)

    # key ranges: A = [kv_lo, a_hi) masked (window edge), U = [u_lo, u_hi) unmasked, B = [b_lo, kv_hi) masked
    u_hi = (first + 1) // BLOCK_N * BLOCK_N  # keys below are causal-visible to every row
    if SLIDING:
        kv_lo = tl.maximum(first - window + 1, 0) // BLOCK_N * BLOCK_N
        u_lo = tl.cdiv(tl.maximum(kv_hi - window, 0), BLOCK_N) * BLOCK_N  # keys from here in every row's window
    else:
        kv_lo = 0
        u_lo = 0
    a_hi = tl.minimum(u_lo, kv_hi)
    b_lo = tl.maximum(u_hi, u_lo)
    if NUM_SPLITS > 1:  # this split's run of key tiles, from the device-side length
        per = tl.cdiv(tl.cdiv(kv_hi - kv_lo, BLOCK_N), NUM_SPLITS) * BLOCK_N
        s_lo = kv_lo + split * per
        s_hi = tl.minimum(s_lo + per, kv_hi)
        a_lo = tl.maximum(kv_lo, s_lo)
        a_hi = tl.minimum(a_hi, s_hi)
        u_lo = tl.maximum(u_lo, s_lo)
        u_hi = tl.minimum(u_hi, s_hi)
        b_lo = tl.maximum(b_lo, s_lo)
        b_hi = s_hi
    else:
        a_lo = kv_lo
        b_hi = kv_hi

    k_base = k_ptr + kvh.to(tl.int64) * stride_kh
    v_base = v_ptr + kvh.to(tl.int64) * stride_vh
    bt_row = bt_ptr + b.to(tl.int64) * stride_bt
    acc = tl.zeros((BLOCK_M, HEAD_DIM), dtype=tl.float32)
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    if SLIDING:
        acc, m_i, l_i = _attend_range(acc, m_i, l_i, q, pos, k_base, v_base, bt_row, a_lo, a_hi, kv_hi, qk_scale,
                                      cap_scale, window, stride_kb, stride_ks, stride_vb, stride_vs, BLOCK_N=BLOCK_N,
                                      HEAD_DIM=HEAD_DIM, BLOCK_SIZE=BLOCK_SIZE, MASK=True, SLIDING=SLIDING,
                                      SOFTCAP=SOFTCAP, IEEE=IEEE)
    acc, m_i, l_i = _attend_range(acc, m_i, l_i, q, pos, k_base, v_base, bt_row, u_lo, u_hi, kv_hi, qk_scale,
                                  cap_scale, window, stride_kb, stride_ks, stride_vb, stride_vs, BLOCK_N=BLOCK_N,
                                  HEAD_DIM=HEAD_DIM, BLOCK_SIZE=BLOCK_SIZE, MASK=False, SLIDING=SLIDING,
                                  SOFTCAP=SOFTCAP, IEEE=IEEE)
    acc, m_i, l_i = _attend_range(acc, m_i, l_i, q, pos, k_base, v_base, bt_row, b_lo, b_hi, kv_hi, qk_scale,
                                  cap_scale, window, stride_kb, stride_ks, stride_vb, stride_vs, BLOCK_N=BLOCK_N,
                                  HEAD_DIM=HEAD_DIM, BLOCK_SIZE=BLOCK_SIZE, MASK=True, SLIDING=SLIDING,
                                  SOFTCAP=SOFTCAP, IEEE=IEEE)

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)  # a row with no key (empty split, seq_len 0) stays 0
    o = acc / l_safe[:, None]
    if NUM_SPLITS > 1:  # partial output and log2-sum-exp of this split, fp32 [B, H, NUM_SPLITS, (D)]
        part = (b.to(tl.int64) * num_heads + h) * NUM_SPLITS + split
        tl.store(part_o_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], o, mask=row_ok[:, None])
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))
        tl.store(part_lse_ptr + part, lse, mask=row_ok)
    else:
        tl.store(out_ptr + tok[:, None] * stride_ot + h[:, None] * stride_oh + offs_d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def _combine_splits_kernel(
    # pointers
    out_ptr, part_o_ptr, part_lse_ptr,
    # sizes
    num_heads,
    # strides
    stride_ot, stride_oh,
    # meta
    NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, PDL: tl.constexpr = False,
):
    """out[b, h] = sum_s w_s o_s / sum_s w_s with w_s = 2^(lse_s - max lse) (empty splits: lse = -inf)."""
    if PDL:  # launched early (``triton_pdl``): wait for the kernels before, then let the next one launch
        pdl_wait(True)
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    s_ok = offs_s < NUM_SPLITS
    part = (b * num_heads + h) * NUM_SPLITS + offs_s
    lse = tl.load(part_lse_ptr + part, mask=s_ok, other=float("-inf"))
    top = tl.max(lse, 0)
    top = tl.where(top == float("-inf"), 0.0, top)
    w = tl.exp2(lse - top)
    o = tl.load(part_o_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], mask=s_ok[:, None], other=0.0)
    den = tl.sum(w, 0)
    res = tl.sum(w[:, None] * o, 0) / tl.where(den == 0.0, 1.0, den)
    tl.store(out_ptr + b * stride_ot + h * stride_oh + offs_d, res.to(out_ptr.dtype.element_ty))


# ---------------------------------------------------------------------------------------------- configs
# Tile sizes per phase, head_dim and dtype on an H100/H200 (sm_90). Decode is memory-bound: 64-key tiles
# (2 x 16 KiB of K/V at D = 128 bf16) in a 2-stage cp.async pipeline, 2 warps, mma.sync on 16 rows; a launch of
# at most ``DECODE_FEW_PROGRAMS`` programs before splitting (batch 1-2 of Llama-3-8B) takes 32-key tiles and up to
# ``MAX_SPLITS`` splits instead (``_decode_launch``). Chosen by ``bench/sweep_attention.py`` on an H200
# (``bench/results/session26/call2``; Llama-3-8B heads, bf16, context 576, us per call with the split combine,
# session 25's (64 keys, 4 warps, 3 stages) -> these): batch 64 50.4 -> 39.1 (91% of copy bandwidth), 32 29.0 ->
# 23.8, 8 14.6 -> 12.1, 1 9.5 -> 6.1. Prefill: 128-row tiles (FA-2's choice for D <= 128), 64-key tiles, 8 warps
# (wgmma). D = 256 halves the tiles; fp32 (IEEE dots on FMA units, a test path) uses small tiles. Every entry of
# session 25 compiled for sm_90 without register spills (ptxas, Triton 3.9: 146 / 184 registers for bf16 decode /
# prefill at D = 128). CPU (the interpreter) uses small tiles so that tests walk several.
_GPU_CONFIGS = {
    # (decode, head_dim <= 128, 16-bit): block_m, block_n, num_warps, num_stages
    (True, True, True): (16, 64, 2, 2),
    (True, False, True): (16, 32, 4, 2),
    (True, True, False): (16, 32, 8, 1),
    (True, False, False): (16, 16, 8, 1),
    (False, True, True): (128, 64, 8, 3),
    (False, False, True): (64, 32, 8, 2),
    (False, True, False): (32, 32, 8, 1),
    (False, False, False): (16, 16, 8, 1),
}
_GPU_DECODE_FEW = (16, 32, 2, 2)  # decode, head_dim <= 128, 16-bit, at most DECODE_FEW_PROGRAMS programs
_GPU_DECODE_S25 = (16, 64, 4, 3)  # session 25's decode config there (DECODE_TUNED = False)
DECODE_FEW_PROGRAMS = 16
#: The decode configs and split rule above. False: session 25's (``_GPU_DECODE_S25`` for 16-bit D <= 128 and its
#: split rule), the A/B of ``bench_generate.py``'s ``-s25attn`` providers.
DECODE_TUNED = True
_CPU_CONFIG = {True: (16, 16, 1, 1), False: (32, 16, 1, 1)}
DECODE_MAX_G_TILE = 64  # query heads per KV head that one decode program packs (more: head groups)


def _config(decode: bool, head_dim: int, dtype: torch.dtype, device: torch.device) -> tuple[int, int, int, int]:
    if device.type != "cuda":
        return _CPU_CONFIG[decode]
    return _GPU_CONFIGS[(decode, head_dim <= 128, dtype != torch.float32)]


def _tiling(decode: bool, G: int, block_m: int) -> tuple[int, int, int, int]:
    """(BLOCK_Q tokens, G_TILE heads, GROUPS head groups, BLOCK_M rows) of a program."""
    if decode:
        g_tile = min(G, DECODE_MAX_G_TILE)
        return 1, g_tile, triton.cdiv(G, g_tile), max(16, triton.next_power_of_2(g_tile))
    g_tile = min(G, block_m)
    return block_m // g_tile, g_tile, triton.cdiv(G, g_tile), block_m


def _num_splits(device: torch.device, programs: int, capacity: int, block_n: int, rule: str = "s25") -> int:
    """Decode key splits from static sizes only. The split of a sequence's keys is computed in the kernel from its
    length, so splits past its key tiles are empty programs that exit at once. ``rule`` (``_decode_launch``):

    - ``"few"``: doubled while the doubled ``programs * splits`` stays within two waves of SMs and ``splits`` is below
      the key tiles of the block table's capacity, up to ``MAX_SPLITS``;
    - ``"many"``: doubled while ``programs * splits`` is below one wave and ``splits`` below the capacity's key tiles,
      up to 16;
    - ``"s25"``: session 25's rule (one wave, up to 16, at most one split per two key tiles of the capacity): the
      configs the session 26 sweep did not time (fp32, head_dim > 128) and ``DECODE_TUNED = False``."""
    if device.type != "cuda":
        return 1
    sms = num_sms(device.index if device.index is not None else torch.cuda.current_device())
    splits = 1
    tiles = triton.cdiv(capacity, block_n)
    if rule == "few":
        while splits < MAX_SPLITS and programs * 2 * splits <= 2 * sms and splits < tiles:
            splits *= 2
    elif rule == "many":
        while splits < 16 and programs * splits < sms and splits < tiles:
            splits *= 2
    else:
        while splits < 16 and programs * splits < sms and 2 * splits * 2 * block_n <= capacity:
            splits *= 2
    return splits


def _decode_launch(device: torch.device, programs: int, capacity: int, head_dim: int, dtype: torch.dtype,
                   block_n: int | None = None, rows: int = 16) -> tuple[int, int, int, int, int]:
    """``(block_m, block_n, num_warps, num_stages, splits)`` of a decode launch of ``programs`` programs before
    splitting (``B * Hkv * head groups``) over block tables of ``capacity`` tokens; ``block_n`` overrides the
    config's key tile (the splits follow it). ``rows``: a program's query rows (``_tiling``: the query heads of a KV
    head, at least 16); past 16 (more than 16 query heads per KV head) the 2-warp configs take 4 warps, as before
    session 26 (the sweep timed G = 4 only). Only 16-bit head_dim <= 128 launches on a GPU take session 26's
    configs and split rules (``DECODE_TUNED``); the others keep session 25's."""
    cfg = _config(True, head_dim, dtype, device)
    timed = device.type == "cuda" and head_dim <= 128 and dtype != torch.float32
    if timed and DECODE_TUNED:
        rule = "few" if programs <= DECODE_FEW_PROGRAMS else "many"
        if rule == "few":
            cfg = _GPU_DECODE_FEW
    else:
        rule = "s25"
        if timed:
            cfg = _GPU_DECODE_S25
    block_m, bn, warps, stages = cfg
    bn = bn if block_n is None else block_n
    if rows > 16 and device.type == "cuda":
        warps = max(warps, 4)
    return block_m, bn, warps, stages, _num_splits(device, programs, capacity, bn, rule)


def prefill_block_q(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                    device: torch.device | str) -> int:
    """Tokens per prefill program (``BLOCK_Q``) for this model shape, dtype and device: the ``tiles_block_q`` a
    step's metadata needs so that the launch reads its tile table instead of building one."""
    block_m = _config(False, head_dim, dtype, torch.device(device))[0]
    return _tiling(False, num_heads // num_kv_heads, block_m)[0]


# ---------------------------------------------------------------------------------------------- launcher
def _check(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta, sliding_window: int,
           softcap: float = 0.0) -> None:
    if q.dim() != 3 or k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(f"paged_attention_triton: expected q [T, H, D] and caches [blocks, block_size, Hkv, D] of "
                         f"one shape, got {tuple(q.shape)}, {tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    T, H, D = q.shape
    bs, Hkv = k_cache.shape[1], k_cache.shape[2]
    if q.dtype not in _DTYPES or k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(f"paged_attention_triton: q, k_cache, v_cache must share one of float16/bfloat16/float32, "
                         f"got {q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    if D < 16 or D & (D - 1) or k_cache.shape[3] != D:
        raise ValueError(f"paged_attention_triton: head_dim must be a power of two >= 16 and match the cache, "
                         f"got q head_dim {D}, cache head_dim {k_cache.shape[3]}")
    if H % Hkv:
        raise ValueError(f"paged_attention_triton: num_heads {H} is not a multiple of num_kv_heads {Hkv}")
    if bs & (bs - 1) or bs != meta.block_size:
        raise ValueError(f"paged_attention_triton: block_size must be a power of two equal to meta.block_size, "
                         f"got cache block_size {bs}, meta.block_size {meta.block_size}")
    if sliding_window < 0:
        raise ValueError(f"paged_attention_triton: sliding_window must be >= 0, got {sliding_window}")
    if not softcap >= 0:
        raise ValueError(f"paged_attention_triton: softcap must be >= 0 (0 = none), got {softcap!r}")
    B = meta.seq_lens.shape[0]
    if T != meta.num_tokens or meta.query_start_loc.shape[0] != B + 1 or meta.block_tables.shape[0] != B:
        raise ValueError(f"paged_attention_triton: q has {T} tokens; metadata has {meta.num_tokens} tokens, "
                         f"{B} seq_lens, {meta.query_start_loc.shape[0]} query_start_loc, "
                         f"{meta.block_tables.shape[0]} block-table rows")
    for name in ("query_start_loc", "seq_lens", "block_tables"):
        t = getattr(meta, name)
        if t.dtype != torch.int32 or t.device != q.device:
            raise ValueError(f"paged_attention_triton: meta.{name} must be int32 on {q.device}, "
                             f"got {t.dtype} on {t.device}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.device != q.device:
            raise ValueError(f"paged_attention_triton: {name} is on {t.device}, q on {q.device}")
        if t.stride(3) != 1:
            raise ValueError(f"paged_attention_triton: {name} needs unit stride along head_dim, got {t.stride()}")
    if q.stride(2) != 1 or meta.block_tables.stride(1) != 1:
        raise ValueError("paged_attention_triton: q and meta.block_tables need unit stride in their last dimension")


def paged_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta, *, scale: float,
                           sliding_window: int = 0, softcap: float = 0.0, num_splits: int | None = None,
                           block_n: int | None = None, num_warps: int | None = None, num_stages: int | None = None,
                           out: torch.Tensor | None = None) -> torch.Tensor:
    """Triton backend of ``paged_attention`` (semantics above and in ``multilora.kernels.attention``).

    Args:
        q: ``[T, H, D]`` float16/bfloat16/float32, tokens of sequence b at rows
            ``query_start_loc[b] : query_start_loc[b + 1]``; D a power of two >= 16.
        k_cache, v_cache: ``[num_blocks, block_size, Hkv, D]``, q's dtype, unit stride along D; ``H % Hkv == 0``.
        meta: the step's ``AttentionMetadata`` (int32 tensors on q's device). The step's keys/values are
            already in the cache (``rope_write_kv``).
        scale: softmax scale. sliding_window: 0 = full causal, else the last ``sliding_window`` positions.
        softcap: 0 = none, else the scores are ``softcap * tanh(scale * q.k / softcap)`` (the ``SOFTCAP`` branch).
        num_splits: decode only, key splits per sequence (None: from static sizes and the SM count; 1 on CPU).
        block_n: keys per tile (a power of two >= 16; None: the config for the device, phase and dtype).
        num_warps, num_stages: the main kernel's warps (a power of two, 1-16) and software-pipeline stages (>= 1);
            None: the config's (``bench/sweep_attention.py`` sweeps them).
        out: None, or a contiguous ``[T, H, D]`` tensor of q's dtype that receives the result (``paged_attention``
            checks it).

    Returns:
        ``[T, H, D]`` in q's dtype (``out``, or a new tensor).

    Decode batches (``T == B``) launch a grid fixed by the shapes and read lengths and block ids from
    device memory only, so the call can be captured in a CUDA graph and replayed after in-place updates of
    ``meta.seq_lens`` / ``meta.block_tables``. fp32 inputs use IEEE fp32 dots (no TF32).

    Raises:
        ValueError: shapes, dtypes, devices or strides that do not fit (the message names the argument).
    """
    _check(q, k_cache, v_cache, meta, sliding_window, softcap)
    T, H, D = q.shape
    B, Hkv = meta.seq_lens.shape[0], k_cache.shape[2]
    if block_n is not None and (block_n < 16 or block_n & (block_n - 1)):
        raise ValueError(f"paged_attention_triton: block_n must be a power of two >= 16 or None, got {block_n}")
    if num_warps is not None and num_warps not in (1, 2, 4, 8, 16):
        raise ValueError(f"paged_attention_triton: num_warps must be 1, 2, 4, 8, 16 or None, got {num_warps}")
    if num_stages is not None and num_stages < 1:
        raise ValueError(f"paged_attention_triton: num_stages must be >= 1 or None, got {num_stages}")
    if num_splits is not None and num_splits < 1:
        raise ValueError(f"paged_attention_triton: num_splits must be >= 1 or None, got {num_splits}")
    G = H // Hkv
    decode = T == B
    if decode:  # (a decode program's rows follow G alone, not the config's block_m)
        block_q, g_tile, groups, block_m = _tiling(True, G, 16)
        capacity = meta.block_tables.shape[1] * meta.block_size
        _, cfg_n, cfg_warps, cfg_stages, cfg_splits = _decode_launch(q.device, B * Hkv * groups, capacity, D, q.dtype,
                                                                     block_n, block_m)
    else:
        block_m, cfg_n, cfg_warps, cfg_stages = _config(False, D, q.dtype, q.device)
        block_q, g_tile, groups, block_m = _tiling(False, G, block_m)
    block_n = cfg_n if block_n is None else block_n
    num_warps = cfg_warps if num_warps is None else num_warps
    num_stages = cfg_stages if num_stages is None else num_stages
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if decode:
        splits = num_splits or cfg_splits
        grid = (B, Hkv * groups, splits)
        tiles, num_tiles = meta.seq_lens, 0  # unused
    else:
        splits = 1
        tiles = meta.tiles
        if tiles is None or meta.tiles_block_q != block_q:  # metadata built without this table: build it here
            tiles = tile_table(meta.q_lens, meta.seq_lens_host, block_q).to(q.device)
        num_tiles = tiles.shape[1]
        grid = (num_tiles, Hkv * groups, 1)
    if splits > 1:
        part_o = torch.empty(B, H, splits, D, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(B, H, splits, dtype=torch.float32, device=q.device)
    else:
        part_o = part_lse = out  # unused
    _paged_attention_kernel[grid](
        out, q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, tiles, part_o, part_lse,
        num_tiles, H, sliding_window, scale / softcap if softcap else scale * _LOG2E, softcap * _LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
        v_cache.stride(2), meta.block_tables.stride(0),
        G=G, G_TILE=g_tile, GROUPS=groups, BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=block_n, HEAD_DIM=D,
        BLOCK_SIZE=meta.block_size, DECODE=decode, NUM_SPLITS=splits, SLIDING=sliding_window > 0,
        SOFTCAP=softcap > 0, IEEE=q.dtype == torch.float32, num_warps=num_warps, num_stages=num_stages,
        **triton_pdl.launch_args(q.device),
    )
    if splits > 1:
        _combine_splits_kernel[(B, H)](
            out, part_o, part_lse, H, out.stride(0), out.stride(1),
            NUM_SPLITS=splits, SPLITS_PAD=triton.next_power_of_2(splits), HEAD_DIM=D, num_warps=4,
            **triton_pdl.launch_args(q.device),
        )
    return out
