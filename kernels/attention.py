"""Attention over a paged KV cache: the metadata built once per step, the cache write, and the op.

Semantics, for sequence ``b`` with ``n_b = q_lens[b]`` new tokens and ``L_b = seq_lens[b]`` tokens of
context after this step (past + new), query ``i`` (absolute position ``p = L_b - n_b + i``) and head ``h``::

    out[t, h] = softmax_j( cap( scale * q[t, h] . K_b[j, h // G] ) ) @ V_b[j, h // G]     over keys j with
                j <= p  and  (sliding_window == 0  or  j > p - sliding_window)

where ``cap(s) = softcap * tanh(s / softcap)`` (Gemma 2's attention logit soft-capping) or, with
``softcap == 0``, ``cap(s) = s``; the cap applies before the mask (HF ``eager_attention_forward``).

where ``t = query_start_loc[b] + i``, ``G = num_heads // num_kv_heads`` (GQA) and ``K_b[j]`` is cache row
``k_cache[block_tables[b, j // block_size], j % block_size]``. Keys and values of the step's own tokens
are written first (``multilora.kernels.fused.rope_write_kv``), so prefill (``n_b = L_b``), chunked prefill
and decode (``n_b = 1``) are one op.

Block tables, worked example with ``block_size = 4``: a sequence of 10 tokens holding blocks ``[7, 2, 5]``
keeps tokens 0-3 in block 7, 4-7 in block 2 and 8-9 in rows 0-1 of block 5; token 9's cache slot is
``5 * 4 + 1 = 21`` (``slot_mapping`` holds these flat slots for the step's new tokens). Rows of
``block_tables`` are padded to a common width with any valid block id (never read past ``L_b``).

Backends: ``"torch"`` (``paged_attention_torch``: gathers the blocks and calls SDPA; the CPU path and the
test oracle) and ``"triton"`` (``multilora.kernels.triton_attention``, when present). ``backend=None``
picks triton for CUDA tensors when importable, else torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from multilora.kernels.backends import select_triton, to_device


@dataclass(frozen=True)
class AttentionMetadata:
    """Per-step description of the batch for paged attention (built once, passed to every layer).

    Attributes:
        query_start_loc: int32 ``[B + 1]``, ``query_start_loc[0] == 0``, ``query_start_loc[B] == T``.
        seq_lens: int32 ``[B]``, context length of each sequence after this step (past + new), ``>= q_len``.
        block_tables: int32 ``[B, max_blocks]``, the cache blocks of each sequence in order.
        slot_mapping: int64 ``[T]``, flat cache slot (``block * block_size + offset``) of each new token.
        block_size: tokens per cache block.
        q_lens, seq_lens_host: the same lengths as host tuples (for shapes and the torch path).
        max_query_len, max_seq_len: their maxima.
        tiles: int32 ``[2, num_tiles]``, the Triton kernel's prefill tile table (``tile_table`` with
            ``tiles_block_q``), or None (decode steps need none; the torch path never reads it).
        tiles_block_q: the ``BLOCK_Q`` ``tiles`` was built for (0 = no table).

    All tensors are on the compute device. For a CUDA graph the tensors are static buffers updated in
    place between replays; a backend that is graph-safe must not read the host fields inside the graph,
    and nothing derived from the tensors' values is kept in the metadata.
    """

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    slot_mapping: torch.Tensor
    block_size: int
    q_lens: tuple[int, ...]
    seq_lens_host: tuple[int, ...]
    max_query_len: int
    max_seq_len: int
    tiles: torch.Tensor | None = None
    tiles_block_q: int = 0

    @property
    def num_seqs(self) -> int:
        return len(self.q_lens)

    @property
    def num_tokens(self) -> int:
        return sum(self.q_lens)


def build_attention_metadata(
    q_lens: Sequence[int],
    seq_lens: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    *,
    block_size: int,
    device: torch.device | str,
    max_blocks: int | None = None,
    tiles_block_q: int = 0,
) -> AttentionMetadata:
    """Build the step's metadata from host lists (numpy on the host, no Python loop over tokens; one copy to
    ``device``: the tensors are views of one buffer).

    Args:
        q_lens: new tokens per sequence (each >= 1).
        seq_lens: context length per sequence after the step (each >= its q_len).
        block_tables: the blocks of each sequence; must cover ``seq_lens[b]`` tokens.
        block_size: tokens per block.
        device: where the tensors go.
        max_blocks: width of the block-table tensor (default: the longest table).
        tiles_block_q: also build the Triton kernel's prefill tile table for this ``BLOCK_Q``
            (``triton_attention.prefill_block_q``) when the step has a prompt (not every q_len 1); 0 = none.

    Raises:
        ValueError: lengths that disagree, a q_len < 1 or > seq_len, or a block table too short.
    """
    B = len(q_lens)
    if B == 0 or len(seq_lens) != B or len(block_tables) != B:
        raise ValueError(
            f"build_attention_metadata: q_lens, seq_lens and block_tables must be non-empty and equal in length, "
            f"got {B}, {len(seq_lens)}, {len(block_tables)}"
        )
    for b, (n, L, bt) in enumerate(zip(q_lens, seq_lens, block_tables)):
        if not 1 <= n <= L:
            raise ValueError(f"build_attention_metadata: sequence {b} has q_len {n} and seq_len {L}; need 1 <= q_len <= seq_len")
        if len(bt) * block_size < L:
            raise ValueError(f"build_attention_metadata: sequence {b} needs {-(-L // block_size)} blocks for {L} tokens, "
                             f"its block table has {len(bt)}")
    width = max(max_blocks if max_blocks is not None else max(len(bt) for bt in block_tables), 1)
    qn = np.fromiter(q_lens, dtype=np.int64, count=B)
    ln = np.fromiter(seq_lens, dtype=np.int64, count=B)
    T = int(qn.sum())
    tiles = tile_table(q_lens, seq_lens, tiles_block_q).numpy() if tiles_block_q and T != B else None
    # one host buffer, one copy to the device (fields 64-byte aligned): int64 slot_mapping [T], then int32
    # query_start_loc [B + 1], seq_lens [B], block_tables [B, width] and the tile table [2, num_tiles]
    o_qsl = _align64(8 * T)
    o_len = o_qsl + _align64(4 * (B + 1))
    o_tab = o_len + _align64(4 * B)
    o_tiles = o_tab + _align64(4 * B * width)
    host = torch.zeros(o_tiles + (0 if tiles is None else 4 * tiles.size), dtype=torch.uint8)
    buf = host.numpy()
    table = buf[o_tab : o_tab + 4 * B * width].view(np.int32).reshape(B, width)
    for b, bt in enumerate(block_tables):  # one numpy row assignment per sequence
        table[b, : len(bt)] = bt
    qsl = buf[o_qsl : o_qsl + 4 * (B + 1)].view(np.int32)
    qsl[1:] = np.cumsum(qn)
    buf[o_len : o_len + 4 * B].view(np.int32)[:] = ln
    # the new tokens' positions: sequence b's are L_b - q_b .. L_b - 1; position p sits in block p // block_size
    first = np.cumsum(qn) - qn  # each sequence's first token
    seq = np.repeat(np.arange(B), qn)
    pos = np.arange(T) + np.repeat(ln - qn - first, qn)
    buf[: 8 * T].view(np.int64)[:] = table[seq, pos // block_size].astype(np.int64) * block_size + pos % block_size
    if tiles is not None:
        buf[o_tiles:].view(np.int32)[:] = tiles.reshape(-1)
    dev = to_device(host, device)  # (pinned, non-blocking on CUDA)
    return AttentionMetadata(
        query_start_loc=dev[o_qsl : o_qsl + 4 * (B + 1)].view(torch.int32),
        seq_lens=dev[o_len : o_len + 4 * B].view(torch.int32),
        block_tables=dev[o_tab : o_tab + 4 * B * width].view(torch.int32).view(B, width),
        slot_mapping=dev[: 8 * T].view(torch.int64),
        block_size=block_size,
        q_lens=tuple(int(n) for n in q_lens),
        seq_lens_host=tuple(int(L) for L in seq_lens),
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        tiles=None if tiles is None else dev[o_tiles:].view(torch.int32).view(tiles.shape),
        tiles_block_q=tiles_block_q if tiles is not None else 0,
    )


def tile_table(q_lens: Sequence[int], seq_lens: Sequence[int], block_q: int) -> torch.Tensor:
    """The Triton kernel's prefill tile table, int32 ``[2, num_tiles]`` on the CPU: ``tile_seq`` and ``tile_q0``
    (first new token of the tile), one entry per ``block_q`` new tokens of each sequence, ordered by decreasing
    causal key count (the longest tiles start first; ties keep sequence order). Worked example in
    ``multilora.kernels.triton_attention``."""
    ql = np.fromiter(q_lens, dtype=np.int64)
    sl = np.fromiter(seq_lens, dtype=np.int64)
    per_seq = (ql + block_q - 1) // block_q
    seq = np.repeat(np.arange(ql.size), per_seq)
    first = np.repeat(np.cumsum(per_seq) - per_seq, per_seq)
    q0 = (np.arange(seq.size) - first) * block_q
    keys = sl[seq] - ql[seq] + np.minimum(q0 + block_q, ql[seq])
    order = np.argsort(-keys, kind="stable")
    return torch.from_numpy(np.stack([seq[order], q0[order]]).astype(np.int32))


def _align64(nbytes: int) -> int:
    return -(-nbytes // 64) * 64


def _torch_mask(meta: AttentionMetadata, sliding_window: int, device: torch.device) -> torch.Tensor:
    """bool [B, 1, max_q, max_seq_len], True = may attend. Built from the metadata's tensors at each call, so it
    is right for buffers updated in place (a captured decode step's)."""
    max_q = meta.max_query_len
    q_lens = (meta.query_start_loc[1:] - meta.query_start_loc[:-1]).long()
    start = meta.seq_lens.long() - q_lens  # absolute position of each sequence's first query
    qpos = start[:, None] + torch.arange(max_q, device=start.device)[None, :]  # [B, max_q]
    kpos = torch.arange(meta.max_seq_len, device=start.device)
    m = kpos[None, None, :] <= qpos[:, :, None]
    if sliding_window:
        m &= kpos[None, None, :] > qpos[:, :, None] - sliding_window
    valid_q = torch.arange(max_q, device=start.device)[None, :] < q_lens[:, None]
    m[:, :, 0] |= ~valid_q  # padded query rows see position 0 only (never all-masked; discarded)
    return m[:, None].to(device)


def _pad_index(meta: AttentionMetadata, device: torch.device) -> torch.Tensor:
    """Row of each query in the padded [B * max_q] layout: sequence b's i-th query goes to b * max_q + i."""
    q = np.fromiter(meta.q_lens, dtype=np.int64)
    idx = np.arange(q.sum()) + np.repeat(np.arange(q.size) * meta.max_query_len - (np.cumsum(q) - q), q)
    return torch.from_numpy(idx).to(device)


def paged_attention_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, *,
                          scale: float, sliding_window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """Torch reference of ``paged_attention``: gather each sequence's blocks, pad the queries, one SDPA call (with
    ``softcap``: the scores, their cap, the mask and the softmax written out in float32, as SDPA has no cap)."""
    T, H, D = q.shape
    Hkv = k_cache.shape[2]
    B, max_q, S = meta.num_seqs, meta.max_query_len, meta.max_seq_len
    nblk = -(-S // meta.block_size)
    tables = meta.block_tables[:, :nblk].long()
    kc = k_cache[tables].reshape(B, nblk * meta.block_size, Hkv, D)[:, :S].transpose(1, 2)  # [B, Hkv, S, D]
    vc = v_cache[tables].reshape(B, nblk * meta.block_size, Hkv, D)[:, :S].transpose(1, 2)
    # rows past a sequence's length may hold anything (torch.empty storage, NaN): a masked score gives them
    # weight 0, but 0 * NaN = NaN, so zero them first
    invalid = (torch.arange(S, device=q.device)[None, :] >= meta.seq_lens[:, None].to(q.device))[:, None, :, None]
    kc = kc.masked_fill(invalid, 0)
    vc = vc.masked_fill(invalid, 0)
    if H != Hkv:
        kc = kc.repeat_interleave(H // Hkv, dim=1)
        vc = vc.repeat_interleave(H // Hkv, dim=1)
    pad = _pad_index(meta, q.device)
    qp = q.new_zeros(B * max_q, H, D)
    qp[pad] = q
    qp = qp.view(B, max_q, H, D).transpose(1, 2)  # [B, H, max_q, D]
    mask = _torch_mask(meta, sliding_window, q.device)
    if softcap:  # in float32 at least
        acc = torch.promote_types(q.dtype, torch.float32)
        s = (qp.to(acc) @ kc.to(acc).transpose(-1, -2)) * scale  # [B, H, max_q, S]
        s = (torch.tanh(s / softcap) * softcap).masked_fill(~mask, float("-inf"))
        o = (torch.softmax(s, dim=-1) @ vc.to(acc)).to(q.dtype)
    else:
        o = F.scaled_dot_product_attention(qp, kc, vc, attn_mask=mask, scale=scale)
    return o.transpose(1, 2).reshape(B * max_q, H, D).index_select(0, pad)  # [T, H, D]


def resolve_attention_backend(backend: str | None, q: torch.Tensor) -> Callable:
    """The attention function for ``backend`` ("torch", "triton", or None = triton on CUDA if available).

    Raises:
        ValueError: an unknown name, or "triton" when the kernel cannot be used.
    """
    mod = select_triton(backend, q, "triton_attention", label="attention backend",
                        unavailable="the Triton kernel is not available")
    return paged_attention_torch if mod is None else mod.paged_attention_triton


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, *,
                    scale: float, sliding_window: int = 0, softcap: float = 0.0,
                    backend: str | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Causal (optionally sliding-window, optionally soft-capped) GQA attention of the step's queries over the
    paged cache.

    Semantics in the module docstring. The step's own keys/values must already be in the cache (``rope_write_kv``).

    Args:
        q: ``[T, num_heads, head_dim]`` float16/bfloat16/float32, tokens of sequence b contiguous.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]`` (one layer), q's dtype.
        meta: the step's ``AttentionMetadata``.
        scale: softmax scale (``head_dim ** -0.5`` for Llama).
        sliding_window: 0 = full causal; else each query sees its last ``sliding_window`` positions.
        softcap: 0 = none; else the scaled scores become ``softcap * tanh(s / softcap)`` (Gemma 2's
            ``attn_logit_softcapping``).
        backend: "torch", "triton" or None.
        out: None, or a ``[T, num_heads, head_dim]`` tensor of q's dtype and device, contiguous, that receives the
            result (a static buffer of a CUDA graph's next piece; ``runtime.cuda_graphs``).

    Returns:
        ``[T, num_heads, head_dim]`` in q's dtype: ``out`` when given.

    Raises:
        ValueError: shapes that disagree (num_heads not a multiple of num_kv_heads, head_dim or block size
            mismatch, T != sum(q_lens)) or an unknown backend.
    """
    if q.dim() != 3 or k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(f"paged_attention: expected q [T, H, D] and caches [blocks, block_size, Hkv, D], got "
                         f"{tuple(q.shape)}, {tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    T, H, D = q.shape
    if k_cache.shape[3] != D or H % k_cache.shape[2] or k_cache.shape[1] != meta.block_size:
        raise ValueError(f"paged_attention: q {tuple(q.shape)} does not fit cache {tuple(k_cache.shape)} with "
                         f"block_size {meta.block_size} (head_dim must match, num_heads a multiple of num_kv_heads)")
    if T != meta.num_tokens:
        raise ValueError(f"paged_attention: q has {T} tokens, the metadata {meta.num_tokens}")
    if not softcap >= 0:
        raise ValueError(f"paged_attention: softcap must be >= 0 (0 = none), got {softcap!r}")
    if out is not None and (out.shape != q.shape or out.dtype != q.dtype or out.device != q.device
                            or not out.is_contiguous()):
        raise ValueError(f"paged_attention: out must be a contiguous {tuple(q.shape)} {q.dtype} tensor on {q.device}, "
                         f"got {tuple(out.shape)} {out.dtype} on {out.device} (contiguous: {out.is_contiguous()})")
    fn = resolve_attention_backend(backend, q)
    if fn is paged_attention_torch:
        o = fn(q, k_cache, v_cache, meta, scale=scale, sliding_window=sliding_window, softcap=softcap)
        return o if out is None else out.copy_(o)
    return fn(q, k_cache, v_cache, meta, scale=scale, sliding_window=sliding_window, softcap=softcap, out=out)
