"""Paged attention: the torch reference (kernels/attention.py) and the Triton kernel (kernels/triton_attention.py)
against an independent fp64 loop over tokens and heads that reads every key through the block tables.

On CPU the real kernel runs under TRITON_INTERPRET=1 (conftest) in fp32 and fp16 on small shapes; tests
marked ``gpu`` run bf16/fp16 against dense SDPA on contiguous K/V (Llama-3-8B heads: 32 query heads,
8 KV heads, head_dim 128), large cache offsets, and CUDA-graph capture/replay of a decode step.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from multilora.kernels import triton_attention
from multilora.kernels.attention import (AttentionMetadata, build_attention_metadata, paged_attention,
                                         paged_attention_torch, tile_table)
from multilora.kernels.triton_attention import paged_attention_triton, prefill_block_q
from testsupport import spy_launches


def write_kv(k_cache, v_cache, k, v, slot_mapping):
    """Write keys and values [T, Hkv, D] into their flat cache slots (``block * block_size + offset``), in place."""
    nb, bs = k_cache.shape[:2]
    k_cache.view(nb * bs, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k)
    v_cache.view(nb * bs, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v)

HAS_CUDA = torch.cuda.is_available()
gpu = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (runs on the device machine)")]
# Triton runs on CPU tensors only under the interpreter (set by conftest when there is no GPU); no bf16 there.
interp = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="CPU cases need TRITON_INTERPRET=1")

# Tolerance per dtype on |out - ref|, ref in fp64 (CPU) or fp32 (GPU) from the same rounded inputs, |out| <~ 1:
TOL = {
    torch.float64: dict(atol=1e-10, rtol=1e-10),  # not used by the kernel; the reference in fp64
    torch.float32: dict(atol=2e-5, rtol=2e-5),  # ieee fp32 dots; only summation order and exp2 vs exp differ
    torch.float16: dict(atol=4e-3, rtol=4e-3),  # P rounded to fp16 before P @ V (eps 1e-3), output rounded to fp16
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),  # as fp16 with 8-bit mantissas (eps 7.8e-3): looser
}


# ---------------------------------------------------------------------------------------------- fixtures
@dataclass
class Batch:
    q: torch.Tensor  # [T, H, D]
    k_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor
    meta: AttentionMetadata
    tables: list[list[int]]  # host block tables, unpadded
    q_lens: list[int]
    seq_lens: list[int]


def make_batch(q_lens, seq_lens, *, H, Hkv, D, block_size, dtype=torch.float32, device="cpu", seed=0,
               spare_blocks=3, extra_width=0, poison=False) -> Batch:
    """Random queries and caches; block tables drawn from a shuffled free list (neither contiguous nor
    monotonic). ``poison`` fills every cache row that holds no token of any sequence (unused blocks, tails of
    last blocks) with NaN: a kernel that reads past ``seq_lens[b]`` returns NaN."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-L // block_size) for L in seq_lens]
    num_blocks = sum(need) + spare_blocks
    free = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [[free.pop() for _ in range(k)] for k in need]
    k_cache = torch.randn(num_blocks, block_size, Hkv, D, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, Hkv, D, generator=gen)
    if poison:
        used = torch.zeros(num_blocks * block_size, dtype=torch.bool)
        for L, t in zip(seq_lens, tables):
            for j in range(L):
                used[t[j // block_size] * block_size + j % block_size] = True
        used = used.view(num_blocks, block_size)
        k_cache[~used] = float("nan")
        v_cache[~used] = float("nan")
    q = torch.randn(sum(q_lens), H, D, generator=gen)
    meta = build_attention_metadata(q_lens, seq_lens, tables, block_size=block_size, device=device,
                                    max_blocks=max(need) + extra_width)
    return Batch(q.to(device, dtype), k_cache.to(device, dtype), v_cache.to(device, dtype), meta, tables,
                 list(q_lens), list(seq_lens))


def _metadata_loop(q_lens, seq_lens, tables, block_size, max_blocks=None):
    """(query_start_loc, seq_lens, block_tables, slot_mapping) built by Python loops (the implementation
    before numpy): the reference for ``build_attention_metadata``'s tensors."""
    width = max_blocks if max_blocks is not None else max(len(bt) for bt in tables)
    table = torch.zeros(len(tables), max(width, 1), dtype=torch.int32)
    for b, bt in enumerate(tables):
        table[b, : len(bt)] = torch.tensor(list(bt), dtype=torch.int32)
    slots = []
    for n, L, bt in zip(q_lens, seq_lens, tables):
        for p in range(L - n, L):
            slots.append(bt[p // block_size] * block_size + p % block_size)
    qsl = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(list(q_lens), dtype=torch.int32).cumsum(0)
    return qsl, torch.tensor(list(seq_lens), dtype=torch.int32), table, torch.tensor(slots, dtype=torch.int64)


@settings(max_examples=200, deadline=None)
@given(data=st.data(), B=st.integers(1, 6), block_size=st.sampled_from([1, 2, 4, 16]), extra=st.integers(0, 3))
def test_metadata_tensors_match_loop_reference(data, B, block_size, extra):
    seq_lens = data.draw(st.lists(st.integers(1, 70), min_size=B, max_size=B))
    q_lens = [data.draw(st.integers(1, L)) for L in seq_lens]
    tables = [data.draw(st.lists(st.integers(1, 500), min_size=-(-L // block_size), max_size=-(-L // block_size) + 2))
              for L in seq_lens]  # any block ids, possibly more blocks than needed
    width = data.draw(st.sampled_from([None, max(len(t) for t in tables) + extra]))
    meta = build_attention_metadata(q_lens, seq_lens, tables, block_size=block_size, device="cpu", max_blocks=width)
    want = _metadata_loop(q_lens, seq_lens, tables, block_size, width)
    got = (meta.query_start_loc, meta.seq_lens, meta.block_tables, meta.slot_mapping)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and torch.equal(g, w)
    assert (meta.q_lens, meta.seq_lens_host) == (tuple(q_lens), tuple(seq_lens))
    assert (meta.max_query_len, meta.max_seq_len, meta.block_size) == (max(q_lens), max(seq_lens), block_size)


def naive_attention(b: Batch, *, scale: float, sliding_window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """fp64 loop: for every new token and head, softmax over its visible keys read one by one through the
    host block table (scores soft-capped as ``softcap * tanh(s / softcap)`` when ``softcap``). Reads no key
    beyond ``p``."""
    T, H, D = b.q.shape
    bs, Hkv = b.k_cache.shape[1], b.k_cache.shape[2]
    G = H // Hkv
    q, kc, vc = b.q.double().cpu(), b.k_cache.double().cpu(), b.v_cache.double().cpu()
    out = torch.zeros(T, H, D, dtype=torch.float64)
    t = 0
    for n, L, table in zip(b.q_lens, b.seq_lens, b.tables):
        for i in range(n):
            p = L - n + i
            lo = max(0, p - sliding_window + 1) if sliding_window else 0
            keys = range(lo, p + 1)
            k = torch.stack([kc[table[j // bs], j % bs] for j in keys])  # [keys, Hkv, D]
            v = torch.stack([vc[table[j // bs], j % bs] for j in keys])
            for h in range(H):
                score = k[:, h // G] @ q[t, h] * scale
                if softcap:
                    score = softcap * torch.tanh(score / softcap)
                w = torch.softmax(score, dim=0)
                out[t, h] = w @ v[:, h // G]
            t += 1
    return out


def check(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.dtype == dtype and out.shape == ref.shape
    torch.testing.assert_close(out.double().cpu(), ref.double().cpu(), **TOL[dtype])


# Batches: a prompt, decodes, chunked prefills (q_len < seq_len), a one-token prompt, lengths across blocks.
MIXED = ([7, 1, 3, 1, 12, 1], [7, 20, 9, 1, 30, 16])
DECODE = ([1] * 5, [1, 9, 16, 17, 40])
HEADS = [pytest.param(4, 4, id="mha"), pytest.param(4, 2, id="gqa2"), pytest.param(8, 2, id="gqa4"),
         pytest.param(6, 1, id="mqa6")]


# ---------------------------------------------------------------------------------------------- torch reference
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("H,Hkv", HEADS)
@pytest.mark.parametrize("window", [0, 5])
@pytest.mark.parametrize("lens", [MIXED, DECODE], ids=["mixed", "decode"])
def test_reference_matches_naive_loop(lens, window, H, Hkv, block_size):
    b = make_batch(*lens, H=H, Hkv=Hkv, D=16, block_size=block_size, dtype=torch.float64, seed=block_size + H,
                   extra_width=2)
    out = paged_attention_torch(b.q, b.k_cache, b.v_cache, b.meta, scale=0.3, sliding_window=window)
    check(out, naive_attention(b, scale=0.3, sliding_window=window), torch.float64)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seqs=st.lists(st.tuples(st.integers(1, 12), st.integers(0, 20)), min_size=1, max_size=5),
    heads=st.sampled_from([(1, 1), (2, 1), (3, 3), (4, 2), (6, 2), (8, 1)]),
    block_size=st.sampled_from([1, 2, 4, 8, 16]),
    D=st.sampled_from([4, 16]),
    window=st.sampled_from([0, 1, 3, 8]),
    seed=st.integers(0, 2**16),
)
def test_reference_random_shapes(seqs, heads, block_size, D, window, seed):
    """Random small batches (q_len 1..12 after 0..20 tokens of past) for the reference against the loop."""
    q_lens = [n for n, _ in seqs]
    seq_lens = [n + past for n, past in seqs]
    b = make_batch(q_lens, seq_lens, H=heads[0], Hkv=heads[1], D=D, block_size=block_size, dtype=torch.float64,
                   seed=seed)
    out = paged_attention_torch(b.q, b.k_cache, b.v_cache, b.meta, scale=D ** -0.5, sliding_window=window)
    check(out, naive_attention(b, scale=D ** -0.5, sliding_window=window), torch.float64)


# ---------------------------------------------------------------------------------------------- triton (CPU)
CPU_DTYPES = [pytest.param(torch.float32, id="fp32", marks=interp),
              pytest.param(torch.float16, id="fp16", marks=interp)]


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("H,Hkv", HEADS)
def test_triton_mixed_batch(H, Hkv, block_size, dtype):
    """Prefill, chunked prefill and decode sequences in one launch; every GQA ratio and block size."""
    b = make_batch(*MIXED, H=H, Hkv=Hkv, D=16, block_size=block_size, dtype=dtype, seed=block_size * H)
    out = paged_attention_triton(b.q, b.k_cache, b.v_cache, b.meta, scale=0.25)
    check(out, naive_attention(b, scale=0.25), dtype)


# on a GPU both backends run there, in the GPU suite (``-m gpu``); on a CPU Triton runs in the interpreter
APART_BACKENDS = ([pytest.param(b, marks=pytest.mark.gpu) for b in ("torch", "triton")] if HAS_CUDA
                  else ["torch", pytest.param("triton", marks=interp)])


@pytest.mark.parametrize("backend", APART_BACKENDS)
@pytest.mark.parametrize("lens", [MIXED, DECODE], ids=["mixed", "decode"])
def test_blocks_that_lie_apart(lens, backend):
    """A unified arena's KV views (``multilora.memory.unified``): each layer's block ``b`` lies a whole unit apart
    (here: k, v and two other layers' blocks interleaved, every row outside this layer's k and v NaN). Both
    backends read through the block stride: the same output as the naive loop over contiguous caches (on the GPU
    when there is one)."""
    dev = "cuda" if HAS_CUDA else "cpu"
    b = make_batch(*lens, H=4, Hkv=2, D=16, block_size=4, seed=11, device=dev)
    arena = torch.full((b.k_cache.shape[0], 4, *b.k_cache.shape[1:]), float("nan"), device=dev)
    arena[:, 1], arena[:, 3] = b.k_cache, b.v_cache
    ks, vs = arena[:, 1], arena[:, 3]
    assert not ks.is_contiguous() and ks.stride(0) == 4 * ks[0].numel()
    fn = paged_attention_torch if backend == "torch" else paged_attention_triton
    check(fn(b.q, ks, vs, b.meta, scale=0.25), naive_attention(b, scale=0.25), torch.float32)


def test_decode_launch_rule(monkeypatch):
    """The decode launch's config and splits from static sizes, as the H200 sweep chose them (module comment): few
    programs take 32-key tiles and split to two waves of SMs (up to MAX_SPLITS, at most a power of two past the
    capacity's key tiles); more take 64-key tiles, 2 warps, 2 stages and split to one wave; session 25's configs and
    rule when ``DECODE_TUNED`` is False and for fp32 and head_dim 256. No GPU needed: the SM count is given."""
    ta = triton_attention
    monkeypatch.setattr(ta, "num_sms", lambda index: 132)
    cuda = torch.device("cuda", 0)
    bf16 = torch.bfloat16
    assert ta._decode_launch(cuda, 8, 592, 128, bf16) == (16, 32, 2, 2, 32)  # Llama-3-8B batch 1
    assert ta._decode_launch(cuda, 8, 2048, 128, bf16) == (16, 32, 2, 2, 32)
    assert ta._decode_launch(cuda, 8, 64, 128, bf16)[4] == 2  # two 32-key tiles of capacity: two splits
    assert ta._decode_launch(cuda, 16, 592, 128, bf16) == (16, 32, 2, 2, 16)  # batch 2: two waves at 16 splits
    assert ta._decode_launch(cuda, 64, 592, 128, bf16) == (16, 64, 2, 2, 4)  # batch 8: 256 programs
    assert ta._decode_launch(cuda, 128, 592, 128, bf16) == (16, 64, 2, 2, 2)
    assert ta._decode_launch(cuda, 256, 592, 128, bf16) == (16, 64, 2, 2, 1)  # batch 32, 64: no split
    assert ta._decode_launch(cuda, 8, 592, 128, bf16, block_n=128)[1:] == (128, 2, 2, 8)  # splits follow the tile
    # fp32 and head_dim 256 (not timed by the sweep): session 25's configs and split rule
    assert ta._decode_launch(cuda, 8, 2048, 128, torch.float32) == (16, 32, 8, 1, 16)
    assert ta._decode_launch(cuda, 8, 592, 128, torch.float32)[4] == 8  # one split per two 32-key tiles: 8, not 16
    assert ta._decode_launch(cuda, 4, 2048, 256, bf16)[:4] == ta._GPU_CONFIGS[(True, False, True)]
    assert ta._decode_launch(cuda, 8, 592, 256, bf16)[4] == 8
    assert ta._decode_launch(cuda, 256, 592, 128, bf16, rows=32)[2] == 4  # 32 query heads per KV head: 4 warps
    assert ta._decode_launch(torch.device("cpu"), 8, 592, 128, bf16)[4] == 1
    monkeypatch.setattr(ta, "DECODE_TUNED", False)
    assert ta._decode_launch(cuda, 8, 592, 128, bf16) == (16, 64, 4, 3, 4)  # session 25: one split per two tiles
    assert ta._decode_launch(cuda, 8, 2048, 128, bf16) == (16, 64, 4, 3, 16)
    assert ta._decode_launch(cuda, 256, 592, 128, bf16) == (16, 64, 4, 3, 1)


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("H,Hkv", [HEADS[2], HEADS[3]])
@pytest.mark.parametrize("splits", [1, 3])
def test_triton_decode(splits, H, Hkv, block_size, dtype):
    """Decode batches, with and without split-KV (3 splits: uneven runs of key tiles, some empty)."""
    b = make_batch(*DECODE, H=H, Hkv=Hkv, D=32, block_size=block_size, dtype=dtype, seed=splits + block_size)
    out = paged_attention_triton(b.q, b.k_cache, b.v_cache, b.meta, scale=0.2, num_splits=splits)
    check(out, naive_attention(b, scale=0.2), dtype)


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("window", [1, 5, 16, 40])
@pytest.mark.parametrize("lens", [MIXED, DECODE], ids=["mixed", "decode"])
def test_triton_sliding_window(lens, window, dtype):
    """Windows shorter than a key tile, about one tile, and longer than every sequence; split decode too."""
    b = make_batch(*lens, H=8, Hkv=2, D=16, block_size=4, dtype=dtype, seed=window)
    out = paged_attention_triton(b.q, b.k_cache, b.v_cache, b.meta, scale=0.25, sliding_window=window,
                                 num_splits=2 if lens is DECODE else None)
    check(out, naive_attention(b, scale=0.25, sliding_window=window), dtype)


@pytest.mark.parametrize("dtype", [pytest.param(torch.float64, id="torch-fp64")] + CPU_DTYPES)
@pytest.mark.parametrize("window", [0, 5])
@pytest.mark.parametrize("lens", [MIXED, DECODE], ids=["mixed", "decode"])
def test_softcap(lens, window, dtype):
    """Gemma 2's attention logit soft-capping: scores of up to ~15 capped at 2 (tanh saturated) and at 40 (nearly
    linear), in the torch path (fp64) and the Triton kernel (fp32 / fp16; decode split in 2)."""
    b = make_batch(*lens, H=8, Hkv=2, D=16, block_size=4, dtype=dtype, seed=11 + window)
    for cap in (2.0, 40.0):
        ref = naive_attention(b, scale=0.6, sliding_window=window, softcap=cap)
        if dtype == torch.float64:
            out = paged_attention_torch(b.q, b.k_cache, b.v_cache, b.meta, scale=0.6, sliding_window=window,
                                        softcap=cap)
        else:
            out = paged_attention_triton(b.q, b.k_cache, b.v_cache, b.meta, scale=0.6, sliding_window=window,
                                         softcap=cap, num_splits=2 if lens is DECODE else None)
        check(out, ref, dtype)
    uncapped = naive_attention(b, scale=0.6, sliding_window=window)
    assert (uncapped - naive_attention(b, scale=0.6, sliding_window=window, softcap=2.0)).abs().max() > 0.1


@interp
def test_softcap_tanh_is_accurate_near_zero_and_in_the_tails():
    """The kernel's exp-based tanh (the interpreter has no libdevice) against torch.tanh: relative error at most
    two fp32 ulps (observed 1.8e-7) from 1e-8 to 100 (a plain ``1 - 2 / (exp(2x) + 1)`` cancels near 0: 1e-6
    relative at 0.08, every digit below 1e-7)."""
    import triton
    import triton.language as tl

    @triton.jit
    def _k(x_ptr, o_ptr, N, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        m = offs < N
        tl.store(o_ptr + offs, triton_attention._tanh(tl.load(x_ptr + offs, mask=m)), mask=m)

    mag = torch.logspace(-8, 2, 500, dtype=torch.float64)
    x = torch.cat([mag, -mag, torch.zeros(1, dtype=torch.float64)]).float()
    out = torch.empty_like(x)
    _k[(1,)](x, out, x.numel(), BLOCK=1024)
    ref = torch.tanh(x.double())
    assert ((out.double() - ref).abs() <= 2.4e-7 * ref.abs() + 1e-30).all()


@interp
@pytest.mark.parametrize("D", [16, 64, 128])
def test_triton_head_dims_and_key_tiles(D):
    """head_dim 16/64/128 and key tiles of 32 (default 16 on CPU)."""
    b = make_batch([9, 1, 2], [9, 33, 40], H=4, Hkv=2, D=D, block_size=8, seed=D)
    for block_n in (None, 32):
        out = paged_attention_triton(b.q, b.k_cache, b.v_cache, b.meta, scale=D ** -0.5, block_n=block_n)
        check(out, naive_attention(b, scale=D ** -0.5), torch.float32)


@interp
def test_triton_head_groups(monkeypatch):
    """More query heads per KV head than one program's rows: heads cut into groups (prefill and decode)."""
    monkeypatch.setitem(triton_attention._CPU_CONFIG, False, (16, 16, 1, 1))  # 16-row prefill tiles
    monkeypatch.setattr(triton_attention, "DECODE_MAX_G_TILE", 8)
    for lens in (([5, 1], [5, 20]), ([1, 1], [3, 20])):
        b = make_batch(*lens, H=20, Hkv=1, D=16, block_size=4, seed=len(lens[0]))
        out = paged_attention_triton(b.q, b.k_cache, b.v_cache, b.meta, scale=0.25)
        check(out, naive_attention(b, scale=0.25), torch.float32)


@interp
@pytest.mark.parametrize("lens", [MIXED, DECODE], ids=["mixed", "decode"])
def test_triton_reads_nothing_past_seq_len(lens):
    """Unused blocks and the tails of last blocks hold NaN: the output is finite and bit for bit the same."""
    kw = dict(H=8, Hkv=2, D=16, block_size=4, seed=7, extra_width=2)
    clean, poisoned = make_batch(*lens, **kw), make_batch(*lens, **kw, poison=True)
    a = paged_attention_triton(clean.q, clean.k_cache, clean.v_cache, clean.meta, scale=0.25, sliding_window=6)
    b = paged_attention_triton(poisoned.q, poisoned.k_cache, poisoned.v_cache, poisoned.meta, scale=0.25,
                               sliding_window=6, num_splits=2 if lens is DECODE else None)
    assert torch.isfinite(b).all()
    if lens is MIXED:
        assert torch.equal(a, b)
    check(b, naive_attention(clean, scale=0.25, sliding_window=6), torch.float32)


@interp
def test_dispatch_through_paged_attention():
    b = make_batch(*MIXED, H=4, Hkv=2, D=16, block_size=4)
    out = paged_attention(b.q, b.k_cache, b.v_cache, b.meta, scale=0.25, backend="triton")
    check(out, naive_attention(b, scale=0.25), torch.float32)


# ---------------------------------------------------------------------------------------------- graph safety
def _rewrite_in_place(b: Batch, seq_lens: list[int], seed: int) -> Batch:
    """New lengths and freshly shuffled block tables for the same sequences, written into the SAME metadata
    tensors (what the engine does to a captured decode graph's static buffers); also returns a Batch with
    fresh metadata for the same data (the oracle)."""
    bs = b.meta.block_size
    width = b.meta.block_tables.shape[1]
    num_blocks = b.k_cache.shape[0]
    gen = torch.Generator().manual_seed(seed)
    free = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [[free.pop() for _ in range(-(-L // bs))] for L in seq_lens]
    fresh = build_attention_metadata(b.q_lens, seq_lens, tables, block_size=bs, device=b.q.device, max_blocks=width)
    b.meta.seq_lens.copy_(fresh.seq_lens)
    b.meta.block_tables.copy_(fresh.block_tables)
    return Batch(b.q, b.k_cache, b.v_cache, fresh, tables, b.q_lens, seq_lens)


@interp
@pytest.mark.parametrize("splits", [1, 3])
def test_decode_metadata_updated_in_place(splits, monkeypatch):
    """CUDA-graph replay, emulated: the same metadata object after in-place updates of seq_lens and
    block_tables gives what fresh metadata gives, and the launch (grid and every scalar) does not change."""
    calls = spy_launches(monkeypatch, triton_attention, "_paged_attention_kernel")
    b = make_batch([1] * 4, [3, 17, 9, 1], H=8, Hkv=2, D=16, block_size=4, spare_blocks=12, extra_width=3)
    asked = build_attention_metadata(b.q_lens, b.seq_lens, b.tables, block_size=4, device="cpu", tiles_block_q=4)
    assert asked.tiles is None and asked.tiles_block_q == 0, "a decode step must carry no host-built table"
    first = paged_attention_triton(b.q, b.k_cache, b.v_cache, b.meta, scale=0.25, num_splits=splits)
    check(first, naive_attention(b, scale=0.25), torch.float32)
    for step, lens in enumerate(([4, 18, 10, 2], [24, 1, 30, 7])):  # grow by one, then anything that fits
        new = _rewrite_in_place(b, lens, seed=step)
        replay = paged_attention_triton(b.q, b.k_cache, b.v_cache, b.meta, scale=0.25, num_splits=splits)
        fresh = paged_attention_triton(new.q, new.k_cache, new.v_cache, new.meta, scale=0.25, num_splits=splits)
        assert torch.equal(replay, fresh)
        check(replay, naive_attention(new, scale=0.25), torch.float32)
    assert all(c == calls[0] for c in calls), "decode launches must depend on shapes only"


@interp
def test_padding_slot_with_seq_len_zero_gives_zeros():
    """A graph bucket's unused slot (seq_len set to 0 in place) yields zeros, not NaN; the others are exact."""
    b = make_batch([1] * 3, [5, 9, 2], H=4, Hkv=2, D=16, block_size=4)
    b.meta.seq_lens[1] = 0
    for splits in (1, 2):
        out = paged_attention_triton(b.q, b.k_cache, b.v_cache, b.meta, scale=0.25, num_splits=splits)
        assert torch.equal(out[1], torch.zeros_like(out[1]))
        ref = naive_attention(b, scale=0.25)
        check(out[[0, 2]], ref[[0, 2]], torch.float32)


# ---------------------------------------------------------------------------------------------- tile table
def test_tile_table_example():
    """The worked example of the module docstring."""
    t = tile_table([5, 1, 3], [5, 9, 7], 2)
    assert t.dtype == torch.int32
    assert t[0].tolist() == [1, 2, 2, 0, 0, 0]
    assert t[1].tolist() == [0, 2, 0, 4, 2, 0]


def _tile_table_loop(q_lens, seq_lens, block_q):
    """The tile table by a Python loop over sequences and tiles, sorted by key count (stable)."""
    tiles = [(L - n + min(q0 + block_q, n), b, q0) for b, (n, L) in enumerate(zip(q_lens, seq_lens))
             for q0 in range(0, n, block_q)]
    tiles.sort(key=lambda t: -t[0])  # stable: ties keep sequence, then tile order
    return [[b for _, b, _ in tiles], [q0 for _, _, q0 in tiles]]


@settings(max_examples=100, deadline=None)
@given(lens=st.lists(st.tuples(st.integers(1, 40), st.integers(0, 30)), min_size=1, max_size=6),
       block_q=st.sampled_from([1, 2, 3, 16]))
def test_tile_table_matches_loop_reference(lens, block_q):
    q_lens = [n for n, _ in lens]
    seq_lens = [n + past for n, past in lens]
    assert tile_table(q_lens, seq_lens, block_q).tolist() == _tile_table_loop(q_lens, seq_lens, block_q)


@interp
@pytest.mark.parametrize("G", [1, 4])
def test_prefill_metadata_carries_the_launch_tile_table(G, monkeypatch):
    """``build_attention_metadata(tiles_block_q=prefill_block_q(...))`` puts the launch's table in the metadata
    (one buffer, one copy), and the launcher reads it instead of building one."""
    b = make_batch(*MIXED, H=2 * G, Hkv=2, D=16, block_size=4)
    bq = prefill_block_q(2 * G, 2, 16, torch.float32, "cpu")
    meta = build_attention_metadata(b.q_lens, b.seq_lens, b.tables, block_size=4, device="cpu", tiles_block_q=bq)
    assert meta.tiles_block_q == bq and torch.equal(meta.tiles, tile_table(*MIXED, bq))
    assert meta.tiles.untyped_storage().data_ptr() == meta.seq_lens.untyped_storage().data_ptr()
    monkeypatch.setattr(triton_attention, "tile_table", None)  # the launcher must not rebuild the table it has
    out = paged_attention_triton(b.q, b.k_cache, b.v_cache, meta, scale=0.25)
    check(out, naive_attention(b, scale=0.25), torch.float32)


# ---------------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("change,match", [
    (dict(D=48), "power of two"),
    (dict(D=8), "power of two"),
    (dict(H=6, Hkv=4), "multiple"),
])
def test_bad_shapes_are_value_errors(change, match):
    kw = dict(H=4, Hkv=2, D=16, block_size=4) | change
    if kw["H"] % kw["Hkv"]:
        b = make_batch(*MIXED, **dict(kw, H=4))
        b.q = torch.randn(b.q.shape[0], kw["H"], kw["D"])
    else:
        b = make_batch(*MIXED, **kw)
    with pytest.raises(ValueError, match=match):
        paged_attention_triton(b.q, b.k_cache, b.v_cache, b.meta, scale=0.25)


@pytest.mark.parametrize("kw,match", [
    (dict(block_n=0), "block_n must be a power of two >= 16"), (dict(block_n=24), "block_n"),
    (dict(num_warps=0), "num_warps must be 1, 2, 4, 8, 16"), (dict(num_warps=3), "num_warps"),
    (dict(num_stages=0), "num_stages must be >= 1"), (dict(num_splits=0), "num_splits must be >= 1"),
])
def test_bad_launch_overrides_are_value_errors(kw, match):
    """An explicit 0 is refused, not read as "the config's" (the launcher takes None for that)."""
    b = make_batch(*DECODE, H=4, Hkv=2, D=16, block_size=4)
    with pytest.raises(ValueError, match=match):
        paged_attention_triton(b.q, b.k_cache, b.v_cache, b.meta, scale=0.25, **kw)


def test_dtype_and_block_size_mismatch_are_value_errors():
    b = make_batch(*MIXED, H=4, Hkv=2, D=16, block_size=4)
    with pytest.raises(ValueError, match="float16/bfloat16/float32"):
        paged_attention_triton(b.q.half(), b.k_cache, b.v_cache, b.meta, scale=0.25)
    with pytest.raises(ValueError, match="block_size"):
        paged_attention_triton(b.q, b.k_cache.view(-1, 2, 2, 16), b.v_cache.view(-1, 2, 2, 16), b.meta, scale=0.25)
    with pytest.raises(ValueError, match="tokens"):
        paged_attention_triton(b.q[:-1], b.k_cache, b.v_cache, b.meta, scale=0.25)


# ---------------------------------------------------------------------------------------------- GPU only
LLAMA8B = dict(H=32, Hkv=8, D=128)


def _dense_reference(q, ks, vs, q_lens, scale, window=0):
    """fp32 SDPA per sequence on contiguous K/V ``[L, Hkv, D]`` (GQA by repeat), causal with the query offset."""
    outs, t = [], 0
    G = q.shape[1] // ks[0].shape[1]
    for n, k, v in zip(q_lens, ks, vs):
        L = k.shape[0]
        qpos = torch.arange(L - n, L, device=q.device)[:, None]
        kpos = torch.arange(L, device=q.device)[None, :]
        mask = kpos <= qpos
        if window:
            mask &= kpos > qpos - window
        qq = q[t : t + n].float().transpose(0, 1)  # [H, n, D]
        kk = k.float().repeat_interleave(G, dim=1).transpose(0, 1)  # [H, L, D]
        vv = v.float().repeat_interleave(G, dim=1).transpose(0, 1)
        outs.append(F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask, scale=scale).transpose(0, 1))
        t += n
    return torch.cat(outs)


def _paged_from_dense(ks, vs, q_lens, *, block_size, dtype, seed, extra_blocks=7):
    """Write contiguous per-sequence K/V into a paged cache through ``write_kv`` (blocks from a shuffled free list)."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [k.shape[0] for k in ks]
    need = [-(-L // block_size) for L in seq_lens]
    num_blocks = sum(need) + extra_blocks
    free = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [[free.pop() for _ in range(c)] for c in need]
    Hkv, D = ks[0].shape[1:]
    k_cache = torch.full((num_blocks, block_size, Hkv, D), float("nan"), dtype=dtype, device="cuda")
    v_cache = torch.full_like(k_cache, float("nan"))  # nothing past seq_lens may be read
    whole = build_attention_metadata(seq_lens, seq_lens, tables, block_size=block_size, device="cuda")
    write_kv(k_cache, v_cache, torch.cat(ks), torch.cat(vs), whole.slot_mapping)
    meta = build_attention_metadata(q_lens, seq_lens, tables, block_size=block_size, device="cuda")
    return k_cache, v_cache, meta


def _random_lengths(B, max_len, kind, gen):
    seq_lens = torch.randint(1, max_len + 1, (B,), generator=gen).tolist()
    if kind == "decode":
        q_lens = [1] * B
    elif kind == "prefill":
        q_lens = list(seq_lens)
    else:  # mixed: prompts, chunks of prompts, decodes
        q_lens = [[L, 1, max(1, L // 3)][i % 3] for i, L in enumerate(seq_lens)]
    return q_lens, seq_lens


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (runs on the device machine)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("B,kind", [(1, "decode"), (8, "decode"), (64, "decode"), (1, "prefill"), (16, "prefill"),
                                    (64, "mixed")])
@pytest.mark.parametrize("window", [0, 700])
def test_gpu_matches_dense_sdpa(B, kind, window, dtype):
    """Llama-3-8B heads, block_size 16, random lengths up to 2048 against dense SDPA on contiguous K/V."""
    gen = torch.Generator().manual_seed(B * 7 + len(kind) + window)
    dev = torch.Generator(device="cuda").manual_seed(B)
    q_lens, seq_lens = _random_lengths(B, 2048, kind, gen)
    H, Hkv, D = LLAMA8B["H"], LLAMA8B["Hkv"], LLAMA8B["D"]
    ks = [torch.randn(L, Hkv, D, generator=dev, device="cuda", dtype=dtype) for L in seq_lens]
    vs = [torch.randn(L, Hkv, D, generator=dev, device="cuda", dtype=dtype) for L in seq_lens]
    q = torch.randn(sum(q_lens), H, D, generator=dev, device="cuda", dtype=dtype)
    k_cache, v_cache, meta = _paged_from_dense(ks, vs, q_lens, block_size=16, dtype=dtype, seed=B)
    out = paged_attention_triton(q, k_cache, v_cache, meta, scale=D ** -0.5, sliding_window=window)
    ref = _dense_reference(q, ks, vs, q_lens, D ** -0.5, window)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), ref, **TOL[dtype])


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (runs on the device machine)")
@pytest.mark.parametrize("block_size,D", [(1, 64), (32, 64), (128, 128), (16, 256)])
def test_gpu_block_sizes_and_head_dims(block_size, D):
    gen = torch.Generator().manual_seed(block_size + D)
    for kind in ("decode", "mixed"):
        q_lens, seq_lens = _random_lengths(12, 700, kind, gen)
        ks = [torch.randn(L, 2, D, generator=gen).to("cuda", torch.bfloat16) for L in seq_lens]
        vs = [torch.randn(L, 2, D, generator=gen).to("cuda", torch.bfloat16) for L in seq_lens]
        q = torch.randn(sum(q_lens), 8, D, generator=gen).to("cuda", torch.bfloat16)
        k_cache, v_cache, meta = _paged_from_dense(ks, vs, q_lens, block_size=block_size, dtype=torch.bfloat16, seed=D)
        out = paged_attention_triton(q, k_cache, v_cache, meta, scale=D ** -0.5)
        torch.testing.assert_close(out.float(), _dense_reference(q, ks, vs, q_lens, D ** -0.5), **TOL[torch.bfloat16])


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (runs on the device machine)")
def test_gpu_fp32_matches_naive():
    b = make_batch(*MIXED, H=8, Hkv=2, D=64, block_size=16, device="cuda", seed=3)
    out = paged_attention_triton(b.q, b.k_cache, b.v_cache, b.meta, scale=0.125, sliding_window=9)
    check(out, naive_attention(b, scale=0.125, sliding_window=9), torch.float32)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (runs on the device machine)")
def test_gpu_large_cache_offsets():
    """A cache of 140,000 blocks x 16 x 8 x 128 = 2.3e9 elements per tensor: rows past 2^31 elements."""
    nb, bs, Hkv, D, H = 140_000, 16, 8, 128, 32
    k_cache = torch.zeros(nb, bs, Hkv, D, dtype=torch.bfloat16, device="cuda")
    v_cache = torch.zeros_like(k_cache)
    gen = torch.Generator().manual_seed(0)
    seq_lens, q_lens = [300, 45, 1000], [1, 45, 1]
    top = list(range(nb - 1, nb - 1 - sum(-(-L // bs) for L in seq_lens), -1))  # the highest blocks
    tables, c = [], 0
    for L in seq_lens:
        tables.append(top[c : c + -(-L // bs)])
        c += len(tables[-1])
    assert min(top) * bs * Hkv * D > 2**31
    ks = [torch.randn(L, Hkv, D, generator=gen).to("cuda", torch.bfloat16) for L in seq_lens]
    vs = [torch.randn(L, Hkv, D, generator=gen).to("cuda", torch.bfloat16) for L in seq_lens]
    whole = build_attention_metadata(seq_lens, seq_lens, tables, block_size=bs, device="cuda")
    write_kv(k_cache, v_cache, torch.cat(ks), torch.cat(vs), whole.slot_mapping)
    q = torch.randn(sum(q_lens), H, D, generator=gen).to("cuda", torch.bfloat16)
    for lens in (q_lens, [1, 1, 1]):
        meta = build_attention_metadata(lens, seq_lens, tables, block_size=bs, device="cuda")
        qq = q[: sum(lens)]
        out = paged_attention_triton(qq, k_cache, v_cache, meta, scale=D ** -0.5)
        torch.testing.assert_close(out.float(), _dense_reference(qq, ks, vs, lens, D ** -0.5), **TOL[torch.bfloat16])
    del k_cache, v_cache
    torch.cuda.empty_cache()


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (runs on the device machine)")
@pytest.mark.parametrize("B", [1, 8, 64])
def test_gpu_decode_cuda_graph_replay(B):
    """A decode launch captured once, replayed after in-place updates of seq_lens and block_tables (lengths
    up to 2048, including a seq_len-0 padding slot), equals eager on fresh metadata bit for bit."""
    H, Hkv, D, bs = LLAMA8B["H"], LLAMA8B["Hkv"], LLAMA8B["D"], 16
    width = 2048 // bs
    gen = torch.Generator().manual_seed(B)
    dev_gen = torch.Generator(device="cuda").manual_seed(B)
    num_blocks = B * width + 8
    k_cache = torch.randn(num_blocks, bs, Hkv, D, generator=dev_gen, device="cuda").to(torch.bfloat16)
    v_cache = torch.randn(num_blocks, bs, Hkv, D, generator=dev_gen, device="cuda").to(torch.bfloat16)
    q = torch.randn(B, H, D, generator=dev_gen, device="cuda").to(torch.bfloat16)

    def step_meta():
        seq_lens = torch.randint(1, 2049, (B,), generator=gen).tolist()
        free = torch.randperm(num_blocks, generator=gen).tolist()
        tables = [[free.pop() for _ in range(-(-L // bs))] for L in seq_lens]
        return build_attention_metadata([1] * B, seq_lens, tables, block_size=bs, device="cuda", max_blocks=width)

    static = step_meta()
    paged_attention_triton(q, k_cache, v_cache, static, scale=D ** -0.5)  # compile before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = paged_attention_triton(q, k_cache, v_cache, static, scale=D ** -0.5)
    for step in range(3):
        fresh = step_meta()
        ref = paged_attention_torch(q, k_cache, v_cache, fresh, scale=D ** -0.5)
        if step == 2 and B > 1:
            fresh.seq_lens[-1] = 0  # a padding slot of the bucket: zeros
            ref[-1] = 0
        static.seq_lens.copy_(fresh.seq_lens)
        static.block_tables.copy_(fresh.block_tables)
        graph.replay()
        eager = paged_attention_triton(q, k_cache, v_cache, fresh, scale=D ** -0.5)
        torch.cuda.synchronize()
        assert torch.equal(out, eager)
        torch.testing.assert_close(out.float(), ref.float(), **TOL[torch.bfloat16])


# ---------------------------------------------------------------------------------------------- benchmark script
def _bench_module():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "bench" / "bench_attention.py"
    spec = importlib.util.spec_from_file_location("bench_attention", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def test_bench_script_formats_and_counts():
    """bench/bench_attention.py (GPU only) imports on CPU, counts bytes and FLOPs, and formats rows with
    errors and missing providers."""
    mod = _bench_module()
    assert mod.kv_bytes(2, 16) == 2 * 2 * 16 * 8 * 128 * 2  # K and V, bf16
    assert mod.causal_flops(1, 3) == 4 * 32 * 128 * 6  # 3 + 2 + 1 visible pairs per head
    rows = [dict(phase="decode", batch=8, context=512, errors={"flex": "skipped: time budget"}, ours_ms=0.0123,
                 ours_gbps=2000.0, ours_copy_frac=0.47, ours_num_splits=2, sdpa_dense_ms=1.5, ours_max_abs_err=1e-3),
            dict(phase="prefill", batch=1, context=512, errors={}, ours_ms=0.05, ours_tflops=300.0)]
    text = mod.table({"rows": rows})
    assert "12.3us" in text and "1.50ms" in text and "error" in text and "300 TFLOP/s" in text
    assert all(mod.summary_line(r) for r in rows)
    if not HAS_CUDA:
        assert mod.main(["--out", "/nonexistent"]) == 2, "without CUDA the script says so and exits"


@interp
@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_bench_script_runs_end_to_end_on_cpu(tmp_path, monkeypatch):
    """main() end to end on tiny rows on the CPU (kernel under the interpreter, FlexAttention eager, fp16, timing
    stubbed): every provider runs, rows carry their fields, the JSON is written. Numbers mean nothing."""
    mod = _bench_module()
    for name, value in dict(DEV="cpu", DTYPE=torch.float16, H=8, HKV=2, D=32, SCALE=32 ** -0.5, MAX_SETS=2,
                            DECODE_ROWS=[("decode", 2, 32)], PREFILL_ROWS=[("prefill", 2, 32)],
                            FLEX_ORDER=[("prefill", 2, 32), ("decode", 2, 32)]).items():
        monkeypatch.setattr(mod, name, value)
    monkeypatch.setattr(mod, "has_device", lambda: True)
    monkeypatch.setattr(mod, "copy_bandwidth", lambda: 1000.0)
    monkeypatch.setattr(mod, "environment", lambda: {"gpu": "cpu", "torch": torch.__version__, "triton": "-"})
    monkeypatch.setattr(mod, "time_ms", lambda fn, graph: (fn(), (0.01, False))[1])
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: fn)  # FlexAttention eager: the API, not the speed
    assert mod.main(["--out", str(tmp_path)]) == 0
    import json

    res = json.loads((tmp_path / "attention.json").read_text())
    assert [r["phase"] for r in res["rows"]] == ["decode", "prefill"]
    for r in res["rows"]:
        assert not r["errors"], r["errors"]
        for name in mod.CORE + mod.FLEX:
            assert r[f"{name}_ms"] == 0.01 / r["sets_per_call"]
            assert r[f"{name}_max_abs_err"] < 1e-2, (name, r[f"{name}_max_abs_err"])
    assert res["rows"][0]["ours_gbps"] > 0 and res["rows"][1]["ours_tflops"] > 0


def _sweep_module():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "bench" / "sweep_attention.py"
    spec = importlib.util.spec_from_file_location("sweep_attention", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_sweep_script_checks_its_arguments():
    """bench/sweep_attention.py refuses malformed rows and grids with a message naming the flag."""
    mod = _sweep_module()
    assert mod.parse_rows("1:576:592,64:512:2048") == [(1, 576, 592), (64, 512, 2048)]
    for bad in ("1:576", "1:600:592", "0:8:8", "a:b:c"):
        with pytest.raises(SystemExit, match="--rows"):
            mod.parse_rows(bad)
    with pytest.raises(SystemExit, match="--warps"):
        mod._ints("4,x", "--warps")
    with pytest.raises(SystemExit, match="--block-n"):
        mod.main(["--block-n", "24", "--out", "/nonexistent"])
    with pytest.raises(SystemExit, match="--top"):
        mod.main(["--top", "0", "--out", "/nonexistent"])
    with pytest.raises(SystemExit, match="--configs"):
        mod.main(["--configs", "64:2:2", "--out", "/nonexistent"])
    if not HAS_CUDA:
        assert mod.main(["--out", "/nonexistent"]) == 2, "without CUDA the script says so and exits"


@interp
def test_sweep_script_runs_end_to_end_on_cpu(tmp_path, monkeypatch):
    """main() on a tiny row on the CPU (kernel under the interpreter, fp32, timing stubbed by a clock that favours
    one config): every config is checked against the torch reference, the split step takes the best configs of the
    first step, and the JSON names the best. Numbers mean nothing."""
    mod = _sweep_module()
    for name, value in dict(DEV="cpu", DTYPE=torch.float32, H=4, HKV=2, D=16, SCALE=16 ** -0.5, MAX_SETS=2).items():
        monkeypatch.setattr(mod, name, value)
    monkeypatch.setattr(mod, "has_device", lambda: True)
    monkeypatch.setattr(mod, "copy_bandwidth", lambda device: (1000.0, "stub"))
    calls = []

    def fake_time(fn, n_sets):  # runs the call once; a different positive time for each config
        calls.append(len(fn()))
        return 5.0 + (len(calls) * 7) % 5
    monkeypatch.setattr(mod, "time_us", fake_time)
    assert mod.main(["--rows", "2:40:64", "--block-n", "16,32", "--warps", "1", "--stages", "1", "--splits", "1,2",
                     "--top", "1", "--out", str(tmp_path)]) == 0
    import json

    res = json.loads((tmp_path / "attention_sweep.json").read_text())
    (row,) = res["rows"]
    assert (row["batch"], row["context"], row["capacity"]) == (2, 40, 64)
    assert len(row["step1"]) == 2 and all(r["max_abs_err"] < 1e-4 for r in row["step1"])
    assert len(row["step2"]) == 1 and row["step2"][0]["splits"] == 2  # the top config at the split it lacked
    assert row["step2"][0]["max_abs_err"] < 1e-4, "two splits and their combine agree with the reference"
    assert row["default"]["max_abs_err"] < 1e-4 and row["s25"]["max_abs_err"] < 1e-4
    assert row["best"]["us"] == min(r["us"] for r in [row["default"], row["s25"]] + row["step1"] + row["step2"])
    assert set(calls) == {row["sets_per_call"]}
    assert mod.main(["--rows", "1:24:32", "--no-grid", "--configs", "16:1:1:2", "--out", str(tmp_path)]) == 0
    (row,) = json.loads((tmp_path / "attention_sweep.json").read_text())["rows"]
    assert row["step1"] == [] and row["step2"] == []
    assert [(r["block_n"], r["splits"]) for r in row["configs"]] == [(16, 2)]
    assert row["configs"][0]["max_abs_err"] < 1e-4
