"""Triton SGMV kernels (kernels/triton_sgmv.py, and the experimental one-launch kernel) against an independent
fp32 per-token loop reference; the LoRA plan, its chunk table and the fused-slices descriptor.

On CPU the real kernels run under TRITON_INTERPRET=1 (conftest) in fp32 and fp16 on small shapes; tests
marked ``gpu`` run the same cases in bf16/fp16 on Llama-3-8B-sized modules, plus the large-offset case.
The reference reads A and B back with ``testsupport.read_module`` and loops over tokens in fp32.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass, replace

import numpy as np

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from multilora.kernels import (LoRAPlan, block_m_for, build_lora_plan, chunk_table, fill_chunk_table, lora_apply,
                               lora_apply_torch, lora_delta, lora_slices)
from multilora.kernels import triton_pdl, triton_sgmv
from multilora.kernels.experimental.lora_fused import lora_fused
from multilora.kernels.triton_sgmv import lora_apply_triton
from multilora.memory.pool import PAGE_ELEMS, AdapterPool, image_layout
from multilora.config import TARGET_MODULES, ModelConfig
from testsupport import pdl_against_plain, read_module

HAS_CUDA = torch.cuda.is_available()
gpu = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (runs on the device machine)")]

# (device, dtype) cases: the interpreter has no bf16, so bf16 runs on the GPU only.
# Triton runs on CPU tensors only under the interpreter (set by conftest when there is no GPU).
interp = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="CPU cases need TRITON_INTERPRET=1")
CPU_CASES = [
    pytest.param("cpu", torch.float32, id="cpu-fp32", marks=interp),
    pytest.param("cpu", torch.float16, id="cpu-fp16", marks=interp),
]
GPU_CASES = [
    pytest.param("cuda", torch.bfloat16, id="gpu-bf16", marks=gpu),
    pytest.param("cuda", torch.float16, id="gpu-fp16", marks=gpu),
]
CASES = CPU_CASES + GPU_CASES

# Tolerance per dtype, on |y - y_ref| with |delta| ~ 1 and |y| ~ 1:
TOL = {
    torch.float32: dict(atol=1e-4, rtol=1e-4),  # ieee fp32 dots (input_precision="ieee"); only summation order differs
    torch.float16: dict(atol=1.5e-2, rtol=1e-2),  # x, A, B in fp16; v rounded to fp16 before expand; y rounded (eps 1e-3)
    torch.bfloat16: dict(atol=6e-2, rtol=3e-2),  # as fp16 with 8-bit mantissas (eps 7.8e-3), looser than fp16
}

# Model shapes: one layer is enough (layers only shift offsets; layer 1 of 2 tests a non-zero offset).
SMALL = ModelConfig(vocab_size=16, hidden_size=40, intermediate_size=72, num_layers=2, num_heads=5, num_kv_heads=1)
ODD = ModelConfig(vocab_size=16, hidden_size=2049, intermediate_size=3424, num_layers=1, num_heads=1, num_kv_heads=1)
LLAMA8B = ModelConfig(vocab_size=16, hidden_size=4096, intermediate_size=14336, num_layers=1, num_heads=32, num_kv_heads=8)


# ---------------------------------------------------------------------------------------------- fixtures
@dataclass
class StandInModule:  # what AdapterPool.load reads from a module's weights
    a: torch.Tensor  # [r, d_in]
    b: torch.Tensor  # [d_out, r]
    rank: int
    scaling: float


@dataclass
class StandInAdapter:  # what AdapterPool.load reads from an adapter
    name: str
    max_rank: int
    modules: dict


def random_adapter(cfg: ModelConfig, name: str, rank: int, gen: torch.Generator, skip: tuple[str, ...] = (),
                   vary: bool = False):
    """Random weights with |x A^T B^T| ~ 1 for x ~ N(0, 1); modules in ``skip`` are not targeted (rank 0);
    ``vary`` gives modules different ranks (rank, rank/2, rank/4 in turn, as PEFT's rank_pattern can)."""
    mods = {}
    for layer in range(cfg.num_layers):
        for mi, m in enumerate(TARGET_MODULES):
            if m in skip:
                continue
            d_in, d_out = cfg.module_shape(m)
            rank_m = max(1, rank >> ((mi + layer) % 3)) if vary else rank
            a = torch.randn(rank_m, d_in, generator=gen) / math.sqrt(d_in)
            b = torch.randn(d_out, rank_m, generator=gen) / math.sqrt(rank_m)
            mods[(layer, m)] = StandInModule(a, b, rank_m, float(torch.rand((), generator=gen)) + 0.5)
    return StandInAdapter(name, rank, mods)


def make_pool(cfg, ranks, *, dtype, device, churn=1, seed=0, first_slot=1, skip=None):
    """A pool holding one adapter per entry of ``ranks`` (odd entries with per-module ranks) in slots
    ``first_slot, first_slot + 1, ...``, placed after ``churn`` rounds of random filler adapters loaded and freed
    around them (``churn >= 2``: the pool then compacts, moving the adapters and rewriting their offsets), so
    the adapters' extents are neither at page 0 nor in slot order. Returns (pool, slots)."""
    gen = torch.Generator().manual_seed(seed)
    ads = [random_adapter(cfg, f"a{i}", r, gen, (skip or {}).get(i, ()), vary=i % 2 == 1) for i, r in enumerate(ranks)]

    def filler(i):
        r = int(torch.randint(1, 4, (), generator=gen))
        return random_adapter(cfg, f"filler{i}", r, gen, skip=TARGET_MODULES[int(torch.randint(1, 8, (), generator=gen)):])

    fillers = [filler(i) for i in range(first_slot + len(ranks) * max(churn, 1))]
    size = sum(_pages(cfg, a) for a in ads + fillers) + 2
    pool = AdapterPool(cfg, num_bytes=size * PAGE_ELEMS * torch.empty((), dtype=dtype).element_size(),
                       max_rank=max(*ranks, 3), max_slots=len(ranks) + len(fillers) + 1, dtype=dtype, device=device)
    held = [pool.load(f) for f in fillers[:first_slot]]
    rest = iter(fillers[first_slot:])
    slots = []
    for a in ads:
        slots.append(pool.load(a))
        for _ in range(max(churn, 1)):
            held.append(pool.load(next(rest)))
    order = torch.randperm(len(held), generator=gen).tolist()
    gone = set(order[len(order) // 3:]) if churn >= 1 else set()  # holes between the adapters
    if churn >= 2:
        gone.add(0)  # the filler at page 0: compaction then moves every adapter
    for i in sorted(gone):
        pool.free(held[i])
    if churn >= 2:
        before = {s: pool.extent_of(s) for s in slots}
        pool.compact()
        assert all(pool.extent_of(s) != before[s] for s in slots), "compaction left an adapter in place"
    return pool, slots


def _pages(cfg, adapter):
    return image_layout(cfg, {k: w.rank for k, w in adapter.modules.items()})[1]


def popularity_slots(kind: str, n_tokens: int, slots: list[int], gen: torch.Generator) -> list[int]:
    """One slot per token with the given adapter popularity."""
    n = len(slots)
    if kind == "distinct":  # every token its own adapter, as far as there are adapters
        idx = [i % n for i in range(n_tokens)]
    elif kind == "uniform":
        idx = torch.randint(0, n, (n_tokens,), generator=gen).tolist()
    elif kind == "zipf":  # p(k) ~ 1 / k
        p = torch.tensor([1.0 / (k + 1) for k in range(n)])
        idx = torch.multinomial(p, n_tokens, replacement=True, generator=gen).tolist()
    elif kind == "identical":
        idx = [0] * n_tokens
    elif kind == "skewed":  # 90% one adapter, the rest spread
        idx = [0 if torch.rand((), generator=gen) < 0.9 else 1 + (i % (n - 1)) for i in range(n_tokens)]
    else:
        raise AssertionError(kind)
    return [slots[i] for i in idx]


def reference(y0, x, pool, layer, modules, token_slots):
    """Plain fp32 loop: per token and module, y += s * (x A^T) B^T with A, B read back from the pool."""
    out = y0.float().clone()
    weights = {}
    col = 0
    for m in modules:
        d_out = pool.config.module_shape(m)[1]
        for t, s in enumerate(token_slots):
            if s < 0:
                continue
            if (s, m) not in weights:
                a, b, sc = read_module(pool, s, layer, m)
                weights[(s, m)] = (a.float(), b.float(), sc)
            a, b, sc = weights[(s, m)]
            if a.shape[0] == 0:
                continue
            v = x[t].float() @ a.t()  # [r]
            out[t, col : col + d_out] += sc * (v @ b.t())
        col += d_out
    return out


def run_case(cfg, ranks, token_slots_fn, modules, *, device, dtype, layer=0, churn=1, seed=0, skip=None,
             apply=lora_apply_triton, block_m=None):
    """``apply(y, x, slices, plan)`` (default: the Triton backend) against ``reference``; returns (y, y0).
    ``block_m``: the plan's chunk size (None: ``build_lora_plan``'s, which follows the token count)."""
    gen = torch.Generator().manual_seed(seed + 1)
    pool, slots = make_pool(cfg, ranks, dtype=dtype, device=device, churn=churn, seed=seed, skip=skip)
    token_slots = token_slots_fn(slots, gen)
    slices = lora_slices([pool.module_view(layer, m) for m in modules])
    T = len(token_slots)
    x = torch.randn(T, slices.d_in, generator=gen).to(device, dtype)
    y0 = torch.randn(T, slices.d_out, generator=gen).to(device, dtype)
    plan = build_lora_plan(token_slots, device=device, **({} if block_m is None else {"block_m": block_m}))
    y = apply(y0.clone(), x, slices, plan)
    ref = reference(y0, x, pool, layer, modules, token_slots)
    torch.testing.assert_close(y.float(), ref, **TOL[dtype])
    none = torch.tensor([s < 0 for s in token_slots], device=device)
    assert torch.equal(y[none], y0[none]), "rows with slot -1 must be left bit for bit"
    return y, y0


# ---------------------------------------------------------------------------------------------- cases
QKV = ("q_proj", "k_proj", "v_proj")
QKVO = ("q_proj", "k_proj", "v_proj", "o_proj")  # one d_in in SMALL (q_size == hidden): four consecutive slices  # unequal widths under GQA: 40, 8, 8 (SMALL); 4096, 1024, 1024 (8B)
GATE_UP = ("gate_proj", "up_proj")


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("rows", [1, 7, 77, 133])
@pytest.mark.parametrize("popularity", ["distinct", "uniform", "zipf", "identical", "skewed"])
def test_popularity_and_rows(popularity, rows, device, dtype):
    cfg = SMALL if device == "cpu" else LLAMA8B
    ranks = [1, 2, 4, 8, 12, 24, 16, 3] if device == "cpu" else [8, 16, 64, 12, 24, 1, 96, 16]
    run_case(cfg, ranks, lambda s, g: popularity_slots(popularity, rows, s, g), QKV,
             device=device, dtype=dtype, layer=cfg.num_layers - 1, seed=rows)


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("modules", [QKV, GATE_UP, ("down_proj",)], ids=["qkv", "gate_up", "down"])
@pytest.mark.parametrize("block_m", [16, 64])
def test_decode_and_prefill_tiles(block_m, modules, device, dtype):
    """The kernels' two prologues (``BLOCK_M <= 16``, decode-sized: tokens and y's tile loaded early; larger, prefill:
    after the slot's rank) at the same tokens: 77 rows on uniform adapters over 4 slots (one of rank 1), so the
    ``block_m = 16`` chunks are full and partial and the ``block_m = 64`` ones partial; padding chunks take the
    ``slot < 0`` return."""
    cfg = SMALL if device == "cpu" else LLAMA8B
    run_case(cfg, [8, 12, 1, 4], lambda s, g: popularity_slots("uniform", 77, s, g), modules,
             device=device, dtype=dtype, seed=block_m, block_m=block_m)


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("modules", [QKV, GATE_UP], ids=["qkv", "gate_up"])
@pytest.mark.parametrize("tiles", [2, 3, 8])
@pytest.mark.parametrize("odd", [False, True], ids=["even", "odd"])
def test_looped_expand_tiles(odd, tiles, modules, device, dtype):
    """The decode expand with ``tiles`` output tiles per program (one v tile, a loop over B tiles): slices whose
    widths are not multiples of a group (q/k/v: 40, 8, 8 with 16-wide tiles on CPU; 2049-wide gate/up), the last
    group's tiles past the slice masked; ranks 1..16, 9 and 33 rows (distinct adapters, and chunks of several
    tokens)."""
    if odd and device == "cpu":
        pytest.skip("the interpreter takes ~15 s a case at 2049 wide; SMALL's 16-wide tiles mask partial groups too")
    cfg = ODD if odd else SMALL if device == "cpu" else LLAMA8B
    block_n = 16 if device == "cpu" else None

    def apply(y, x, slices, plan):
        assert plan.block_m <= 16 and slices.max_rank_rows <= 16  # else the expand falls back to one tile
        return triton_sgmv._expand(y, triton_sgmv._shrink(x, slices, plan), slices, plan, tiles=tiles,
                                   block_n=block_n)

    for rows, popularity in ((9, "distinct"), (33, "uniform")):
        run_case(cfg, [8, 12, 1, 16, 4, 2, 3, 5, 7], lambda s, g: popularity_slots(popularity, rows, s, g), modules,
                 device=device, dtype=dtype, seed=tiles + rows, apply=apply)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (runs on the device machine)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("wide_shrink", [(16, None), (32, 64), (32, 32)], ids=["default", "32x64", "32x32"])
@pytest.mark.parametrize("modules", [QKV, ("down_proj",)], ids=["qkv", "down"])
def test_wide_rank_tiles_and_knobs(modules, wide_shrink, dtype, monkeypatch):
    """Decode steps of 1-16 tokens from a rank-64 pool (the wide regime, ``triton_sgmv.WIDE_SHRINK``'s K split and
    block_k, incl. the 32-way split the session-18 sweep liked) and of 64 tokens (``DECODE_EXPAND_RANK_TILES``'
    128-wide 2-warp expand, 2-warp shrink): ranks 1..64 in one pool against the fp32 reference."""
    monkeypatch.setattr(triton_sgmv, "WIDE_SHRINK", wide_shrink)
    for rows, popularity in ((1, "distinct"), (8, "distinct"), (16, "uniform"), (64, "distinct")):
        run_case(LLAMA8B, [64, 1, 33, 16, 48], lambda s, g: popularity_slots(popularity, rows, s, g), modules,
                 device="cuda", dtype=dtype, seed=rows)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (runs on the device machine)")
@pytest.mark.parametrize("wide_out", [(48, 64, 16384, 256, 4), None, (17, 512, 1, 64, 8)],
                         ids=["default", "off", "every-width-64x8"])
def test_rank_tiles_of_wide_outputs(wide_out, monkeypatch):
    """Decode expand from a rank-64 pool past the wide regime: Llama-3-8B's fused gate/up (28,672 wide) at 64 tokens
    takes ``DECODE_EXPAND_RANK_WIDE_OUT``'s tiles, q/k/v (6,144) and 17 tokens ``DECODE_EXPAND_RANK_TILES``'; either
    setting (and a rule that sends every width and count to 64-wide 8-warp tiles) against the fp32 reference, ranks
    1..64 in one pool."""
    monkeypatch.setattr(triton_sgmv, "DECODE_EXPAND_RANK_WIDE_OUT", wide_out)
    for modules in (GATE_UP, QKV):
        for rows, popularity in ((17, "uniform"), (48, "distinct"), (64, "distinct")):
            run_case(LLAMA8B, [64, 1, 33, 16, 48], lambda s, g: popularity_slots(popularity, rows, s, g), modules,
                     device="cuda", dtype=torch.bfloat16, seed=rows)


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("modules", [GATE_UP, ("down_proj",), ("o_proj",)], ids=["gate_up", "down", "o"])
@pytest.mark.parametrize("rows", [7, 77])
def test_odd_widths(modules, rows, device, dtype):
    """Output and input sizes 2049 and 3424: masked, never refused."""
    run_case(ODD, [8, 12, 1], lambda s, g: popularity_slots("uniform", rows, s, g), modules,
             device=device, dtype=dtype, seed=rows)


def _wide(width: int) -> ModelConfig:
    """gate/up project 64 -> ``width`` (the vocab or MLP sizes of real models)."""
    return ModelConfig(vocab_size=16, hidden_size=64, intermediate_size=width, num_layers=1, num_heads=1, num_kv_heads=1)


@pytest.mark.parametrize("width,ranks,rows,device,dtype", [
    pytest.param(7392, [1, 24], 5, "cpu", torch.float32, id="7392-cpu-fp32", marks=interp),
    pytest.param(200, [1, 256, 96], 4, "cpu", torch.float16, id="r256-cpu-fp16", marks=interp),
    pytest.param(7392, [1, 96, 256], 133, "cuda", torch.bfloat16, id="7392-gpu-bf16", marks=gpu),
    pytest.param(49152, [1, 96, 256], 133, "cuda", torch.bfloat16, id="49152-gpu-bf16", marks=gpu),
    pytest.param(128256, [1, 96, 256], 133, "cuda", torch.float16, id="128256-gpu-fp16", marks=gpu),
])
def test_real_widths_and_ranks_up_to_256(width, ranks, rows, device, dtype):
    """Output widths 7392, 49152, 128256 (not multiples of a tile) and ranks 1..256 in one batch."""
    run_case(_wide(width), ranks, lambda s, g: popularity_slots("uniform", rows, s, g), GATE_UP,
             device=device, dtype=dtype, churn=0, seed=width)


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("churn", [0, 1, 3])
def test_mixed_ranks_after_churn(churn, device, dtype):
    """Ranks 1..96 (several rank tiles of 16) at extents placed by no churn, by churn with holes, and by churn
    then compaction (offsets rewritten in place)."""
    ranks = [1, 2, 4, 8, 12, 24, 40] + ([96] if device == "cuda" else [])
    run_case(SMALL, ranks, lambda s, g: popularity_slots("distinct", 2 * len(s) + 1, s, g), QKV,
             device=device, dtype=dtype, churn=churn, seed=churn, layer=1)


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("with_none", [False, True])
def test_interleaved_slots(with_none, device, dtype):
    """Slot ids that do not start at 0 and interleave: [a, b, c, b, c, b, c, c] for the adapters' slots a < b < c
    (1, 3, 5: fillers hold the slots between them), and with -1 rows."""
    def slots_fn(s, g):
        assert s[0] > 0 and s == sorted(s)
        a, b, c = s[:3]
        out = [a, b, c, b, c, b, c, c]
        return [-1, *out[:4], -1, *out[4:], -1] if with_none else out

    run_case(SMALL, [8, 12, 4], slots_fn, GATE_UP, device=device, dtype=dtype)


@pytest.mark.parametrize("device,dtype", CASES)
def test_none_rows_untouched(device, dtype):
    """A batch with no adapter at all, and one with a single adapted row: -1 rows stay bit for bit."""
    run_case(SMALL, [8], lambda s, g: [-1] * 9, QKV, device=device, dtype=dtype)
    run_case(SMALL, [8], lambda s, g: [-1] * 4 + [s[0]] + [-1] * 4, QKV, device=device, dtype=dtype)


@pytest.mark.parametrize("device,dtype", CASES)
def test_module_not_targeted(device, dtype):
    """An adapter that does not target k_proj (rank 0 there) leaves that slice as the base output."""
    y, y0 = run_case(SMALL, [8, 4], lambda s, g: [s[0], s[1], s[0], s[1]], QKV,
                     device=device, dtype=dtype, skip={0: ("k_proj",)})
    q, k = SMALL.q_size, SMALL.kv_size
    assert torch.equal(y[0::2, q : q + k], y0[0::2, q : q + k])


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bit patterns (``torch.equal`` takes -0.0 for +0.0)."""
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("block_m", [16, 64], ids=["decode", "prefill"])
@pytest.mark.parametrize("ranks", [[8, 4, 1], [8, 24, 4]], ids=["r16-pool", "r24-pool"])
def test_lora_delta_writes_every_element(ranks, block_m, device, dtype):
    """``lora_delta`` into a buffer full of NaN: the rows with an adapter hold the LoRA term, bit for bit what
    ``lora_apply`` adds to zeros (both backends; -0.0 included: tiny x makes terms that round to zero); rows of slot
    -1 and the slice an adapter does not target (k_proj of adapter 0) hold +0; the term matches the fp32 reference.
    Decode and prefill chunks (the rank loop from a rank-24 pool; from a rank-16 pool one tile per program on the
    CPU, and 2 or 3 looped tiles through ``_expand(tiles=)``), with -1 rows between and after the adapted ones;
    a batch with no adapted row through the host's shortcut and through the kernel (a plan that says it has LoRA, as
    a CUDA graph captured with LoRA replays one)."""
    gen = torch.Generator().manual_seed(len(ranks) + block_m)
    pool, slots = make_pool(SMALL, ranks, dtype=dtype, device=device, skip={0: ("k_proj",)})
    slices = lora_slices([pool.module_view(1, m) for m in QKV])
    a, b, c = slots
    looped = [None] + ([2, 3] if max(ranks) <= 16 else [])  # (prefill: PREFILL_WRITE_LOOP's tiles on the GPU)
    for token_slots, scale in (([a, -1, b, c, -1, a, a, c, b, -1] * 3, 1.0), ([a, -1, b, c, -1, a] * 2, 1e-7),
                               ([-1] * 5, 1.0)):
        T = len(token_slots)
        x = (torch.randn(T, slices.d_in, generator=gen) * scale).to(device, dtype)
        plan = build_lora_plan(token_slots, device=device, block_m=block_m)
        zeros = torch.zeros(T, slices.d_out, dtype=dtype, device=device)
        ref = reference(zeros, x, pool, 1, QKV, token_slots)
        for backend in ("torch", "triton"):
            added = lora_apply(zeros.clone(), x, slices, plan, backend=backend)
            out = lora_delta(torch.full_like(zeros, float("nan")), x, slices, plan, backend=backend)
            assert torch.equal(_bits(out), _bits(added)), backend
            torch.testing.assert_close(out.float(), ref, **TOL[dtype])
        for tiles in looped[1:]:  # the looped expand tiles (the GPU's decode default) on the interpreter too
            v = triton_sgmv._shrink(x, slices, plan)
            want = triton_sgmv._expand(zeros.clone(), v, slices, plan, tiles=tiles, block_n=16)
            got = triton_sgmv._expand(torch.full_like(zeros, float("nan")), v, slices, plan, tiles=tiles, block_n=16,
                                      overwrite=True)
            assert torch.equal(_bits(got), _bits(want)), tiles
            torch.testing.assert_close(got.float(), ref, **TOL[dtype])
        none = torch.tensor([s < 0 for s in token_slots], device=device)
        assert not _bits(out[none]).any(), "rows of slot -1: +0"
        if scale == 1e-7:
            assert _bits(added).eq(_bits(torch.tensor(-0.0, dtype=dtype))).sum() == 0  # the in-place add gives +0
        if T > 5:
            q, k = SMALL.q_size, SMALL.kv_size
            rows_a = torch.tensor([s == a for s in token_slots], device=device)
            assert not _bits(out[rows_a, q : q + k]).any(), "k_proj is not targeted by adapter 0: +0 there"
        else:  # no adapted row: the same through the kernel with a plan that says it has LoRA
            forced = replace(plan, has_lora=True)
            got = triton_sgmv.lora_delta_triton(torch.full_like(zeros, float("nan")), x, slices, forced)
            assert not _bits(got).any()


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("block_m", [16, 64], ids=["decode", "prefill"])
def test_grid_by_the_steps_slots_gives_the_same_bits(block_m, device, dtype, monkeypatch):
    """A plan built for one step (``build_lora_plan``: ``num_segments``) sizes the launches' grid by its distinct
    slots, ``min(T, cdiv(T, block_m) + segments)``, not by the pool's ``max_slots``: fewer programs, the same bits
    as the bound's grid (``GRID_BY_SEGMENTS`` False) for ``lora_apply`` and ``lora_delta`` (whose unadapted rows, most
    of them here, a grid-stride loop zeroes), and the same K split of the shrink."""
    gen = torch.Generator().manual_seed(block_m)
    pool, slots = make_pool(SMALL, [8, 4, 1, 2, 3, 5], dtype=dtype, device=device)
    a, b = slots[1], slots[4]
    token_slots = [-1] * 40 + [a] * 5 + [-1] * 20 + [b] * 3 + [-1] * 9 + [a] * 2
    T, segments = len(token_slots), 2
    slices = lora_slices([pool.module_view(0, m) for m in QKV])
    x = torch.randn(T, slices.d_in, generator=gen).to(device, dtype)
    y0 = torch.randn(T, slices.d_out, generator=gen).to(device, dtype)
    plan = build_lora_plan(token_slots, device=device, block_m=block_m)
    assert plan.num_segments == segments and pool.max_slots > segments
    out, grids = {}, {}
    for by_segments in (True, False):
        monkeypatch.setattr(triton_sgmv, "GRID_BY_SEGMENTS", by_segments)
        shrink = _CountLaunches(triton_sgmv._sgmv_shrink_kernel)
        expand = _CountLaunches(triton_sgmv._sgmv_expand_kernel)
        monkeypatch.setattr(triton_sgmv, "_sgmv_shrink_kernel", shrink)
        monkeypatch.setattr(triton_sgmv, "_sgmv_expand_kernel", expand)
        out[by_segments] = (lora_apply(y0.clone(), x, slices, plan, backend="triton"),
                            lora_delta(torch.full_like(y0, float("nan")), x, slices, plan, backend="triton"))
        grids[by_segments] = (shrink.grids, expand.grids)
        monkeypatch.undo()
    for got, want in zip(out[True], out[False]):
        assert torch.equal(_bits(got), _bits(want))
    torch.testing.assert_close(out[True][0].float(), reference(y0, x, pool, 0, QKV, token_slots), **TOL[dtype])
    chunks = min(T, -(-T // block_m) + segments)
    bound = min(T, -(-T // block_m) + pool.max_slots)
    assert chunks < bound
    (s_new, e_new), (s_old, e_old) = grids[True], grids[False]
    assert [g[0] for g in s_new] == [chunks * 3] * 2 and [g[0] for g in s_old] == [bound * 3] * 2  # (chunk, slice)
    assert [g[1] for g in s_new] == [g[1] for g in s_old]  # the same K split
    assert [g[0] for g in e_new] == [chunks] * 2 and [g[0] for g in e_old] == [bound] * 2
    static = replace(plan, num_segments=None)  # a CUDA graph's plan of static buffers: the bound, whatever the step
    assert triton_sgmv.num_chunks(static, slices) == bound == triton_sgmv.chunk_bound(plan, slices)


@pytest.mark.parametrize("device,dtype", CASES)
def test_grid_by_segments_holds_a_table_one_program_short_of_it(device, dtype):
    """The tightest table under the grid ``min(T, cdiv(T, block_m) + segments)``: every token adapted, each slot's
    tokens one more than a multiple of block_m, so the table has ``cdiv(T, block_m) + segments - 1`` chunks; the
    results equal the reference (a grid one chunk smaller than this bound would leave the last chunk undone)."""
    from multilora.kernels.lora import fill_chunk_table

    pool, slots = make_pool(SMALL, [8, 4, 6, 2], dtype=dtype, device=device, seed=3)
    slices = lora_slices([pool.module_view(1, m) for m in QKV])
    for block_m in (16, 4):
        token_slots = [s for s in slots for _ in range(block_m + 1)]  # runs of block_m + 1: two chunks each
        T, d = len(token_slots), len(slots)
        table = np.empty((4, T), dtype=np.int32)
        fill_chunk_table(table, token_slots, block_m)
        assert int((table[1] >= 0).sum()) == 2 * d == -(-T // block_m) + d - 1
        plan = build_lora_plan(token_slots, device=device, block_m=block_m)
        assert triton_sgmv.num_chunks(plan, slices) == min(T, -(-T // block_m) + d) < triton_sgmv.chunk_bound(plan,
                                                                                                             slices)
        gen = torch.Generator().manual_seed(block_m)
        x = torch.randn(T, slices.d_in, generator=gen).to(device, dtype)
        y0 = torch.randn(T, slices.d_out, generator=gen).to(device, dtype)
        ref = reference(y0, x, pool, 1, QKV, token_slots)
        torch.testing.assert_close(lora_apply(y0.clone(), x, slices, plan, backend="triton").float(), ref, **TOL[dtype])
        got = lora_delta(torch.full_like(y0, float("nan")), x, slices, plan, backend="triton")
        torch.testing.assert_close(got.float(), reference(torch.zeros_like(y0), x, pool, 1, QKV, token_slots),
                                   **TOL[dtype])


@pytest.mark.parametrize("device,dtype", GPU_CASES)
def test_split_by_the_launched_grid_matches_the_reference(device, dtype, monkeypatch):
    """``SPLIT_BY_GRID`` (off by default, an A/B): the shrink's K split computed from the grid by the step's slots; on a
    mid-size step with few adapters (the grid far below the bound) it splits more, and the result stays within the
    fp32 reference."""
    pool, slots = make_pool(LLAMA8B, [16, 16, 8, 16], dtype=dtype, device=device, seed=5)
    slices = lora_slices([pool.module_view(0, m) for m in QKV])
    token_slots = [slots[i % 4] for i in range(192)]
    plan = build_lora_plan(token_slots, device=device)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(len(token_slots), slices.d_in, generator=gen).to(device, dtype)
    y0 = torch.randn(len(token_slots), slices.d_out, generator=gen).to(device, dtype)
    ref = reference(y0, x, pool, 0, QKV, token_slots)
    splits = {}
    for by_grid in (False, True):
        monkeypatch.setattr(triton_sgmv, "SPLIT_BY_GRID", by_grid)
        shrink = _CountLaunches(triton_sgmv._sgmv_shrink_kernel)
        monkeypatch.setattr(triton_sgmv, "_sgmv_shrink_kernel", shrink)
        y = lora_apply(y0.clone(), x, slices, plan, backend="triton")
        torch.testing.assert_close(y.float(), ref, **TOL[dtype])
        splits[by_grid] = shrink.grids[0][1]
        monkeypatch.undo()
    assert splits[True] >= splits[False], splits


@settings(max_examples=300, deadline=None)
@given(slots=st.lists(st.integers(-1, 6), min_size=0, max_size=120), block_m=st.integers(1, 70))
def test_every_chunk_of_a_table_has_a_program(slots, block_m):
    """Host-only property: whatever the slots (runs, interleaving, slot -1) and block_m, the chunk table
    ``build_lora_plan`` builds has at most ``num_chunks`` chunks (its grid) and ``num_segments`` is its distinct
    slots."""
    plan = build_lora_plan(slots, block_m=block_m)

    class Slices:
        max_slots = 4096

    table = plan.chunks.numpy()
    assert plan.num_segments == len({s for s in slots if s >= 0})
    assert int((table[1] >= 0).sum()) <= max(1, triton_sgmv.num_chunks(plan, Slices()))


class _CountLaunches:
    """Stands in for a @triton.jit kernel in its module: counts ``kernel[grid](...)`` launches, then launches."""

    def __init__(self, kernel):
        self.kernel, self.grids = kernel, []

    def __getitem__(self, grid):
        self.grids.append(grid)
        return self.kernel[grid]


@pytest.mark.parametrize("device,dtype", CASES)
def test_more_than_three_slices(device, dtype, monkeypatch):
    """Four fused views are one shrink and one expand launch (no grouping by three), columns in order."""
    shrink = _CountLaunches(triton_sgmv._sgmv_shrink_kernel)
    expand = _CountLaunches(triton_sgmv._sgmv_expand_kernel)
    monkeypatch.setattr(triton_sgmv, "_sgmv_shrink_kernel", shrink)
    monkeypatch.setattr(triton_sgmv, "_sgmv_expand_kernel", expand)
    run_case(SMALL, [8, 5], lambda s, g: [s[1], -1, s[0], s[1], s[0]], QKVO,
             device=device, dtype=dtype)
    assert len(shrink.grids) == 1 and len(expand.grids) == 1
    chunks = min(5, 1 + 2)  # min(T, cdiv(T, 16) + the step's 2 distinct slots): an eager plan (num_segments)
    block_n = 64 if device == "cpu" else 256  # the expand default for T <= 512
    assert shrink.grids[0][0] == chunks * 4  # (chunk, slice) programs
    widths = (SMALL.q_size, SMALL.kv_size, SMALL.kv_size, SMALL.hidden_size)
    assert expand.grids[0] == (chunks, sum(-(-w // block_n) for w in widths))  # every slice's tiles


def test_chunk_table_example():
    """The worked example of the LoRAPlan docstring."""
    t = chunk_table(torch.tensor([1, 2, 3, 2, 3, 2, 3, -1]), 2, torch.device("cpu"))
    assert t[0].tolist() == [0, 1, 3, 5, 2, 4, 6, 0]
    assert t[1].tolist() == [1, 2, 2, 3, 3, -1, -1, -1]
    assert t[2].tolist() == [0, 1, 3, 4, 6, 0, 0, 0]
    assert t[3].tolist() == [1, 2, 1, 2, 1, 0, 0, 0]


def test_lora_plan_worked_example():
    """The example of the LoRAPlan docstring: the chunk table of the plan and its slot groups."""
    plan = build_lora_plan([1, 2, 3, 2, 3, 2, 3, -1], block_m=2)
    assert plan.has_lora and plan.num_tokens == 8 and plan.block_m == 2
    assert [(s, t.tolist()) for s, t in plan.slot_groups()] == [(1, [0]), (2, [1, 3, 5]), (3, [2, 4, 6])]
    assert plan.token_slots.dtype == torch.int32 and plan.token_slots.tolist() == [1, 2, 3, 2, 3, 2, 3, -1]
    assert plan.chunks.dtype == torch.int32 and plan.chunks.is_contiguous()
    assert torch.equal(plan.chunks, chunk_table([1, 2, 3, 2, 3, 2, 3, -1], 2, "cpu"))
    assert build_lora_plan([1] * 512).block_m == 16 and build_lora_plan([1] * 513).block_m == 64
    assert block_m_for(512) == 16 and block_m_for(513) == 64


@settings(max_examples=200, deadline=None)
@given(slots=st.lists(st.integers(-1, 12), max_size=120), block_m=st.sampled_from([None, 1, 3, 64]))
def test_lora_plan_matches_set_and_nonzero_reference(slots, block_m):
    """slot_groups() as the per-token set + one nonzero per slot (the implementation before), whatever block_m."""
    plan = build_lora_plan(torch.tensor(slots, dtype=torch.int64), block_m=block_m)
    ids = sorted({s for s in slots if s >= 0})
    groups = plan.slot_groups()
    assert [s for s, _ in groups] == ids and plan.has_lora == bool(ids) and plan.num_tokens == len(slots)
    for s, idx in groups:
        want = torch.nonzero(torch.tensor(slots) == s).flatten()
        assert idx.dtype == torch.int64 and torch.equal(idx, want)
    assert torch.equal(plan.chunks, chunk_table(slots, block_m or block_m_for(len(slots)), "cpu"))
    assert plan.token_slots.tolist() == slots


def _chunk_table_loop(token_slots: torch.Tensor, block_m: int) -> torch.Tensor:
    """The chunk table built by a Python loop over runs and chunks (the implementation before numpy)."""
    slots = token_slots.detach().to("cpu", torch.int64)
    T = int(slots.numel())
    table = torch.zeros(4, max(T, 1), dtype=torch.int32)
    table[1].fill_(-1)
    order = torch.argsort(slots, stable=True)
    order = order[slots[order] >= 0]
    table[0, : order.numel()] = order.to(torch.int32)
    ids, counts = torch.unique_consecutive(slots[order], return_counts=True)
    c, seg = 0, 0
    for s, cnt in zip(ids.tolist(), counts.tolist()):
        for off in range(0, cnt, block_m):
            table[1, c], table[2, c], table[3, c] = s, seg + off, min(block_m, cnt - off)
            c += 1
        seg += cnt
    return table


@settings(max_examples=300, deadline=None)
@given(slots=st.lists(st.integers(-1, 9), max_size=80), block_m=st.sampled_from([1, 2, 3, 16, 64]))
def test_chunk_table_matches_loop_reference(slots, block_m):
    want = _chunk_table_loop(torch.tensor(slots, dtype=torch.int64), block_m)
    for arg in (torch.tensor(slots, dtype=torch.int32), slots, tuple(slots), np.array(slots)):  # tensor or host ints
        got = chunk_table(arg, block_m, torch.device("cpu"))
        assert got.dtype == torch.int32 and torch.equal(got, want), (slots, block_m)


@settings(max_examples=200, deadline=None)
@given(slots=st.lists(st.integers(-1, 9), max_size=40), extra=st.integers(0, 9), block_m=st.sampled_from([1, 2, 16]))
def test_fill_chunk_table_pads_a_wider_array(slots, extra, block_m):
    """Written into a wider [4, n] array (a graph's staging buffer, old values in it): the loop reference in
    the first T columns, padding (sorted 0, slot -1, start 0, len 0) in the rest."""
    T = len(slots)
    out = np.full((4, max(T, 1) + extra), 77, dtype=np.int32)  # stale values everywhere
    fill_chunk_table(out, slots, block_m)
    want = torch.zeros(4, out.shape[1], dtype=torch.int32)
    want[1] = -1
    want[:, : max(T, 1)] = _chunk_table_loop(torch.tensor(slots, dtype=torch.int64), block_m)
    assert torch.equal(torch.from_numpy(out), want), (slots, extra, block_m)


def test_fill_chunk_table_rejects_bad_output():
    with pytest.raises(ValueError, match="out: expected an int32 numpy array of shape \\[4, n >= 3\\]"):
        fill_chunk_table(np.zeros((4, 2), dtype=np.int32), [0, 1, 2], 16)
    with pytest.raises(ValueError, match="out: expected an int32"):
        fill_chunk_table(np.zeros((4, 3), dtype=np.int64), [0, 1, 2], 16)
    with pytest.raises(ValueError, match="out: expected an int32"):
        fill_chunk_table(np.zeros((3, 3), dtype=np.int32), [0, 1, 2], 16)


def test_chunk_table_random_decode_batches():
    """Decode-sized batches (distinct, shared and no adapters) and long prefill-like runs, vs the loop."""
    g = torch.Generator().manual_seed(3)
    for T in (1, 2, 7, 8, 16, 63, 64, 65, 512, 700):
        for hi in (0, 1, 4, T):  # slots drawn from [-1, hi): hi = 0 means no adapters at all
            slots = torch.randint(-1, max(hi, 0), (T,), generator=g) if hi else torch.full((T,), -1)
            for bm in (16, 64):
                assert torch.equal(chunk_table(slots, bm, torch.device("cpu")), _chunk_table_loop(slots, bm))
    assert torch.equal(chunk_table(torch.tensor([], dtype=torch.int64), 16, torch.device("cpu")),
                       torch.tensor([[0], [-1], [0], [0]], dtype=torch.int32))


@pytest.mark.parametrize("device,dtype", CPU_CASES[:1] + GPU_CASES[:1])
def test_dtype_mismatch_is_a_value_error(device, dtype):
    pool, slots = make_pool(SMALL, [4], dtype=dtype, device=device)
    slices = lora_slices([pool.module_view(0, "q_proj")])
    plan = build_lora_plan([slots[0]] * 3, device=device)
    other = torch.float16 if dtype != torch.float16 else torch.float32
    x = torch.randn(3, SMALL.hidden_size, device=device)
    y = torch.zeros(3, SMALL.q_size, device=device)
    with pytest.raises(ValueError, match="dtype"):
        lora_apply_triton(y.to(dtype), x.to(other), slices, plan)
    with pytest.raises(ValueError, match="dtype"):
        lora_apply_triton(y.to(other), x.to(dtype), slices, plan)
    with pytest.raises(ValueError, match="dtype"):
        lora_apply_triton(y.to(other), x.to(other), slices, plan)


@interp
def test_per_call_checks_of_the_triton_launcher():
    """What can change per call is checked per call: a non-unit feature stride; a plan on another device."""
    pool, slots = make_pool(SMALL, [4], dtype=torch.float32, device="cpu")
    slices = lora_slices([pool.module_view(0, "q_proj")])
    plan = build_lora_plan([slots[0]] * 3)
    x, y = torch.randn(3, 2 * SMALL.hidden_size)[:, ::2], torch.zeros(3, SMALL.q_size)
    with pytest.raises(ValueError, match="x: expected unit stride along features"):
        lora_apply_triton(y, x, slices, plan)
    meta = torch.device("meta")
    elsewhere = LoRAPlan(token_slots=plan.token_slots.to(meta), chunks=plan.chunks.to(meta), block_m=16, has_lora=True)
    with pytest.raises(ValueError, match="plan.chunks: expected device cpu"):
        lora_apply_triton(y, x.contiguous(), slices, elsewhere)


def test_lora_slices_table_and_checks():
    """The table of q/k/v (rows: d_out, col) and the ranks / scalings / offsets spacing, and what lora_slices
    refuses: no views or too many, views of two pools, mismatched d_in, wrong metadata dtypes, slices that are not
    consecutive modules, a buffer that is not flat."""
    pool, _ = make_pool(SMALL, [4], dtype=torch.float32, device="cpu")
    views = [pool.module_view(1, m) for m in QKV]
    s = lora_slices(views)
    q, kv, S = SMALL.q_size, SMALL.kv_size, pool.max_slots
    assert s.table.dtype == torch.int64 and s.table.is_contiguous() and s.table.shape == (2, 3)
    assert s.table.tolist() == [[q, kv, kv], [0, q, q + kv]]
    assert s.meta_stride == S and views[2].ranks.data_ptr() == views[0].ranks.data_ptr() + 4 * 2 * S  # int32: 4 bytes
    assert views[2].offsets_a.data_ptr() == views[0].offsets_a.data_ptr() + 8 * 2 * S  # int64: 8 bytes
    assert s.offsets_a is views[0].offsets_a and s.offsets_b is views[0].offsets_b
    assert (s.d_in, s.d_out, s.num_slices) == (SMALL.hidden_size, q + 2 * kv, 3)
    assert all(a is b for a, b in zip(s.views, views, strict=True))
    assert s.max_rank_rows == pool.max_rank and s.max_slots == S
    other, _ = make_pool(SMALL, [4], dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match="views: expected 1 to 4 LoRAModuleViews"):
        lora_slices([])
    with pytest.raises(ValueError, match="views: expected 1 to 4 LoRAModuleViews .* got 5"):
        lora_slices(views + views[:2])
    with pytest.raises(ValueError, match="one pool \\(k_proj does not\\)"):
        lora_slices([views[0], other.module_view(1, "k_proj")])
    with pytest.raises(ValueError, match="share one d_in; down_proj has 72, q_proj 40"):
        lora_slices([views[0], pool.module_view(1, "down_proj")])
    with pytest.raises(ValueError, match="k_proj ranks must be torch.int32"):
        lora_slices([views[0], replace(views[1], ranks=views[1].ranks.long())])
    with pytest.raises(ValueError, match="k_proj offsets_a must be torch.int64"):
        lora_slices([views[0], replace(views[1], offsets_a=views[1].offsets_a.int())])
    with pytest.raises(ValueError, match=f"evenly spaced .* k_proj's ranks row is {S} elements from q_proj's, expected {4 * S}"):
        lora_slices([views[0], views[2], views[1]])  # q, v, k: not consecutive
    with pytest.raises(ValueError, match="v_proj's offsets_b row is"):
        lora_slices([views[0], views[1], replace(views[2], offsets_b=pool.offsets_b[1, 5])])
    with pytest.raises(ValueError, match="contiguous and 1-D"):
        lora_slices([replace(views[0], buffer=pool.buffer.view(-1, 16))])
    with pytest.raises(ValueError, match="slices: expected a LoRASlices"):
        lora_apply(torch.zeros(1, q), torch.zeros(1, SMALL.hidden_size), views[:1], build_lora_plan([0]))


@pytest.mark.parametrize("cfg", [SMALL, ODD, LLAMA8B], ids=["small", "odd", "llama8b"])
def test_lora_slices_align_divides_every_offset_width_and_column(cfg):
    """``align`` (what the kernels declare of the offsets and widths they read) is the largest power of two up to
    16 that divides d_in, every width and column; and every offset the pool writes, for any rank, is a multiple
    of it: a larger one would be a false promise to the compiler."""
    pool, slots = make_pool(cfg, [1, 3, 5, 7], dtype=torch.float16, device="cpu", churn=2)
    for modules in (QKV, GATE_UP, ("o_proj",), ("down_proj",)):
        s = lora_slices([pool.module_view(cfg.num_layers - 1, m) for m in modules])
        values = [s.d_in] + [int(v) for v in s.table.flatten()]
        want = max(a for a in (1, 2, 4, 8, 16) if all(v % a == 0 for v in values))
        assert s.align == want, (modules, values)
        offs = torch.cat([torch.cat([v.offsets_a[slots], v.offsets_b[slots]]) for v in s.views])
        assert bool((offs % s.align == 0).all()), (modules, offs)
    if cfg is LLAMA8B:
        assert s.align == 16  # real shapes keep the vectorised loads


def test_lora_plan_checks_its_tensors():
    plan = build_lora_plan([0, -1, 1])
    with pytest.raises(ValueError, match="chunks: expected contiguous int32 \\[4, 3\\]"):
        replace(plan, chunks=plan.chunks[:, :2])
    with pytest.raises(ValueError, match="chunks: expected contiguous int32"):
        replace(plan, chunks=plan.chunks.t().contiguous().t())
    with pytest.raises(ValueError, match="token_slots: expected int32"):
        replace(plan, token_slots=plan.token_slots.long())
    with pytest.raises(ValueError, match="block_m"):
        replace(plan, block_m=0)
    empty = build_lora_plan([])
    assert empty.num_tokens == 0 and not empty.has_lora and empty.chunks.shape == (4, 1) and empty.slot_groups() == []


@pytest.mark.parametrize("device,dtype", CPU_CASES[:1] + GPU_CASES[:1])
def test_static_plan_rewritten_in_place(device, dtype):
    """A plan over static buffers (as a CUDA-graph step holds it), rewritten in place after it was built, gives
    the new slots' result with both backends: nothing is cached from the values it was built with."""
    pool, slots = make_pool(SMALL, [8, 4, 6], dtype=dtype, device=device, seed=2)
    slices = lora_slices([pool.module_view(0, m) for m in QKV])
    gen = torch.Generator().manual_seed(4)
    T = 6
    token_slots = torch.full((T,), slots[0], dtype=torch.int32, device=device)  # the static buffers
    chunks = chunk_table([slots[0]] * T, 16, device)
    plan = LoRAPlan(token_slots=token_slots, chunks=chunks, block_m=16, has_lora=True)
    x = torch.randn(T, slices.d_in, generator=gen).to(device, dtype)
    y0 = torch.randn(T, slices.d_out, generator=gen).to(device, dtype)
    for apply in (lora_apply_torch, lora_apply_triton):
        apply(y0.clone(), x, slices, plan)  # with the first slots (a torch plan would have grouped them now)
    for new in ([slots[2], -1, slots[1], slots[2], -1, slots[0]], [slots[1]] * 3 + [-1] * 3):
        token_slots.copy_(torch.tensor(new, dtype=torch.int32))
        chunks.copy_(chunk_table(new, 16, device))
        ref = reference(y0, x, pool, 0, QKV, new)
        none = torch.tensor([s < 0 for s in new], device=device)
        for apply in (lora_apply_torch, lora_apply_triton):
            y = apply(y0.clone(), x, slices, plan)
            torch.testing.assert_close(y.float(), ref, **TOL[dtype])
            assert torch.equal(y[none], y0[none])


def test_triton_module_hides_only_import_errors(monkeypatch):
    """A missing Triton (ImportError) selects the torch path; any other error in a Triton module, or an
    ImportError of one of our own modules (a stale import), propagates instead of silently falling back."""
    from multilora.kernels import backends

    def import_module(name):
        if name.endswith("broken"):
            raise RuntimeError("a bug in a Triton file")
        if name.endswith("stale"):
            raise ImportError("cannot import name 'gone' from 'multilora.kernels.lora'", name="multilora.kernels.lora")
        raise ModuleNotFoundError(f"No module named {name!r}", name="triton")

    monkeypatch.setattr(backends.importlib, "import_module", import_module)
    uncached = backends.triton_module.__wrapped__
    assert uncached("triton_missing") is None
    with pytest.raises(RuntimeError, match="a bug in a Triton file"):
        uncached("triton_broken")
    with pytest.raises(ImportError, match="gone"):
        uncached("triton_stale")


def test_to_device_keeps_nothing_and_num_sms_reads_once(monkeypatch):
    """``to_device`` holds no reference to what it copied (each step's plan goes through it: a cache there would keep
    every step's host and device tensors alive); ``num_sms`` reads a device's properties once."""
    import gc
    import weakref

    from multilora.kernels import backends

    host = torch.arange(5)
    gone = weakref.ref(host)
    assert torch.equal(backends.to_device(host, "cpu"), torch.arange(5))
    del host
    gc.collect()
    assert gone() is None
    calls = []
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: calls.append(i) or type("P", (), {"multi_processor_count": 7})())
    backends.num_sms.cache_clear()
    try:
        assert backends.num_sms(3) == 7 and backends.num_sms(3) == 7 and calls == [3]
    finally:
        backends.num_sms.cache_clear()


@pytest.mark.parametrize("device,dtype", CASES)
def test_torch_and_triton_backends_agree(device, dtype):
    pool, slots = make_pool(SMALL, [8, 16, 3], dtype=dtype, device=device, seed=5)
    gen = torch.Generator().manual_seed(9)
    token_slots = [slots[1], -1, slots[0], slots[2], slots[1], slots[1], -1, slots[0]]
    plan = build_lora_plan(token_slots, device=device)
    slices = lora_slices([pool.module_view(1, m) for m in QKV])
    x = torch.randn(8, SMALL.hidden_size, generator=gen).to(device, dtype)
    y0 = torch.randn(8, slices.d_out, generator=gen).to(device, dtype)
    yt = lora_apply(y0.clone(), x, slices, plan, backend="torch")
    yk = lora_apply(y0.clone(), x, slices, plan, backend="triton")
    torch.testing.assert_close(yk.float(), yt.float(), **TOL[dtype])
    assert torch.equal(yk[1], y0[1]) and torch.equal(yk[6], y0[6])


@interp
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ranks=st.lists(st.integers(1, 24), min_size=1, max_size=5),
    picks=st.lists(st.integers(-1, 4), min_size=1, max_size=40),
    churn=st.sampled_from([0, 1, 2]),
    module=st.sampled_from([QKV, GATE_UP, ("down_proj",), ("o_proj",)]),
    dtype=st.sampled_from([torch.float32, torch.float16]),
    seed=st.integers(0, 2**16),
)
def test_random_batches(ranks, picks, churn, module, dtype, seed):
    """Random batches: any ranks, any mix of slots and -1 rows, any placement (CPU interpreter)."""
    def slots_fn(s, g):
        return [-1 if p < 0 else s[p % len(s)] for p in picks]

    run_case(SMALL, ranks, slots_fn, module, device="cpu", dtype=dtype, churn=churn, seed=seed,
             layer=seed % 2)


# ---------------------------------------------------------------------------------------------- fused decode path
# ``multilora.kernels.experimental.lora_fused``: shrink + expand in one launch (off by default in the product).
# Run directly here for every token count and tile shape, on CPU too, against the same fp32 loop reference.
FUSED_TILES = [
    pytest.param(dict(block_n=16, tiles=1), id="n16x1"),  # many tile groups per slice: shrink recomputed
    pytest.param(dict(block_n=32, tiles=3), id="n32x3"),  # several tiles per program, a partial last group
]


def fused(**config):
    """``lora_fused`` with these tiles, as a ``run_case`` apply function."""
    return functools.partial(lora_fused, **config)


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("tiles", FUSED_TILES)
@pytest.mark.parametrize("rows", [1, 7, 77])
@pytest.mark.parametrize("popularity", ["distinct", "zipf", "skewed"])
def test_fused_popularity_and_rows(popularity, rows, tiles, device, dtype):
    apply = fused(**(tiles if device == "cpu" else dict(tiles, block_n=tiles["block_n"] * 16)))
    cfg = SMALL if device == "cpu" else LLAMA8B
    ranks = [1, 2, 4, 8, 12, 24, 16, 3] if device == "cpu" else [8, 16, 64, 12, 24, 1, 96, 16]
    run_case(cfg, ranks, lambda s, g: popularity_slots(popularity, rows, s, g), QKV,
             device=device, dtype=dtype, layer=cfg.num_layers - 1, seed=rows, apply=apply)


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("churn", [0, 2])
def test_fused_ranks_after_churn(churn, device, dtype):
    """Ranks above one rank tile (24, 40, 96) go through the program's workspace rows."""
    ranks = [1, 2, 4, 8, 12, 24, 40] + ([96] if device == "cuda" else [])
    run_case(SMALL, ranks, lambda s, g: popularity_slots("distinct", 2 * len(s) + 1, s, g), QKV,
             device=device, dtype=dtype, churn=churn, seed=churn, layer=1,
             apply=fused(block_n=32, tiles=2))


# (the experimental one-launch kernel: on the CPU in fp32 only, the interpreter's fp16 runs the same code; 30 s of CI)
@pytest.mark.parametrize("device,dtype", [c for c in CASES if c.values != ("cpu", torch.float16)])
@pytest.mark.parametrize("modules", [GATE_UP, ("down_proj",), ("o_proj",)], ids=["gate_up", "down", "o"])
def test_fused_odd_widths(modules, device, dtype):
    run_case(ODD, [8, 12, 1], lambda s, g: popularity_slots("uniform", 9, s, g), modules,
             device=device, dtype=dtype, seed=3, apply=fused(block_n=64, tiles=2) if device == "cpu" else lora_fused)


@pytest.mark.parametrize("device,dtype", CASES)
def test_fused_interleaved_none_and_untargeted(device, dtype):
    """Interleaved slot ids with -1 rows; a module an adapter does not target; four views in one launch."""
    apply = fused(block_n=16, tiles=2)
    run_case(SMALL, [8, 12, 4], lambda s, g: [-1, 1, 2, 3, 2, -1, 3, 2, 3, 3, -1], GATE_UP, device=device, dtype=dtype,
             apply=apply)
    run_case(SMALL, [8], lambda s, g: [-1] * 5, QKV, device=device, dtype=dtype, apply=apply)
    y, y0 = run_case(SMALL, [8, 4], lambda s, g: [s[0], s[1], s[0], s[1]], QKV,
                     device=device, dtype=dtype, skip={0: ("k_proj",)}, apply=apply)
    q, k = SMALL.q_size, SMALL.kv_size
    assert torch.equal(y[0::2, q : q + k], y0[0::2, q : q + k])
    run_case(SMALL, [8, 5], lambda s, g: [s[1], -1, s[0], s[1], s[0]], QKVO,
             device=device, dtype=dtype, apply=apply)


# ---------------------------------------------------------------------------------------------- GPU only
@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (runs on the device machine)")
@pytest.mark.parametrize("module", ["q_proj", "o_proj"], ids=["expand-rows-12288", "shrink-rows-12288"])
def test_large_offsets(module):
    """Rows of 12,288 bf16 at 87,383+ tokens: token * row offsets overflow int32 byte offsets."""
    cfg = ModelConfig(vocab_size=16, hidden_size=64, intermediate_size=64, num_layers=1, num_heads=1,
                      num_kv_heads=1, head_dim=12288)
    dtype, device, T = torch.bfloat16, "cuda", 90_000
    pool, slots = make_pool(cfg, [16, 8, 4], dtype=dtype, device=device)
    gen = torch.Generator(device=device).manual_seed(0)
    token_slots = torch.tensor(slots)[torch.arange(T) % 3]
    token_slots[::7] = -1
    view = pool.module_view(0, module)
    x = torch.randn(T, view.d_in, generator=gen, device=device, dtype=dtype)
    y0 = torch.randn(T, view.d_out, generator=gen, device=device, dtype=dtype)
    plan = build_lora_plan(token_slots, device=device)
    y = lora_apply_triton(y0.clone(), x, lora_slices([view]), plan)
    ref = y0.float().clone()
    for s in slots:  # per-slot fp32 reference (vectorized over tokens: 90k rows)
        a, b, sc = read_module(pool, s, 0, module)
        idx = (token_slots == s).nonzero().flatten().to(device)
        ref[idx] += sc * (x[idx].float() @ a.float().t()) @ b.float().t()
    tail = slice(87_000, T)
    torch.testing.assert_close(y[tail].float(), ref[tail], **TOL[dtype])
    for i in range(0, T, 8192):  # (in row blocks: one comparison of all 90k x 12,288 fp32 rows needs ~20 GB more,
        # which failed on an 80 GB H100 beside the suite's other shards, session 37)
        torch.testing.assert_close(y[i : i + 8192].float(), ref[i : i + 8192], **TOL[dtype])
    none = token_slots.to(device) < 0
    assert torch.equal(y[none], y0[none])


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (runs on the device machine)")
@pytest.mark.parametrize("path", ["default", "fused"])
def test_decode_cuda_graph_capture(path):
    """A decode step (T = 64, distinct adapters) captured in a CUDA graph and replayed equals eager: the two
    launches of the product path, and the experimental one-launch kernel."""
    apply = lora_fused if path == "fused" else lora_apply_triton
    dtype, device = torch.bfloat16, "cuda"
    pool, slots = make_pool(LLAMA8B, [16] * 8, dtype=dtype, device=device)
    token_slots = [slots[i % 8] if i % 5 else -1 for i in range(64)]
    plan = build_lora_plan(token_slots, device=device)
    slices = lora_slices([pool.module_view(0, m) for m in QKV])
    x = torch.randn(64, 4096, device=device, dtype=dtype)
    y0 = torch.randn(64, slices.d_out, device=device, dtype=dtype)
    y_eager = apply(y0.clone(), x, slices, plan)
    y = y0.clone()
    apply(y, x, slices, plan)  # warm-up (compiles) before capture
    y.copy_(y0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        apply(y, x, slices, plan)
    y.copy_(y0)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(y.float(), y_eager.float(), atol=0, rtol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (runs on the device machine)")
@pytest.mark.parametrize("rows", [1, 13, 64, 600])
@pytest.mark.parametrize("capture", [False, True], ids=["eager", "graph"])
@pytest.mark.parametrize("early", [True, False], ids=["trigger-early", "trigger-at-exit"])
def test_pdl_launches_equal_plain_launches(rows, capture, early, monkeypatch):
    """Programmatic dependent launch (``triton_sgmv.PDL``, on by default from sm_90): each kernel may start while the
    one before it drains and waits before it reads activations. Here a kernel writes x, another y, right before the
    shrink and the expand (the race PDL could open: reading them before they are written), on rows with and without
    an adapter, a rank-64 pool (the wide tiles at 1 row with PDL, at 13 without: ``_use_pdl``) and a rank-16 one,
    eager and replayed from a CUDA
    graph with new inputs: bit-identical to plain launches, and to the fp32 reference's tolerance; with the next
    kernel let launch right after a program's wait, or as it exits (``PDL_EARLY_TRIGGER``)."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("PDL needs compute capability 9.0+")
    monkeypatch.setattr(triton_sgmv, "PDL_EARLY_TRIGGER", early)
    dtype, device = torch.bfloat16, "cuda"
    for ranks in ([16, 8, 16, 4], [64, 16, 33, 64]):
        pool, slots = make_pool(LLAMA8B, ranks * 2, dtype=dtype, device=device)
        token_slots = [slots[(i * 7) % len(slots)] if i % 5 else -1 for i in range(rows)]
        plan = build_lora_plan(token_slots, device=device)
        slices = lora_slices([pool.module_view(0, m) for m in QKV])
        gen = torch.Generator(device=device).manual_seed(rows)
        x_src = [torch.randn(rows, 4096, device=device, dtype=dtype, generator=gen) for _ in range(3)]
        y_src = [torch.randn(rows, slices.d_out, device=device, dtype=dtype, generator=gen) for _ in range(3)]
        x_in, y_in = torch.empty_like(x_src[0]), torch.empty_like(y_src[0])  # a graph's static inputs
        x, y = torch.empty_like(x_in), torch.empty_like(y_in)

        def step():
            x.copy_(x_in * 1.5)  # a kernel writing x right before the shrink
            y.copy_(y_in - 0.25)  # and one writing y (after the shrink's inputs, before the expand)
            lora_apply_triton(y, x, slices, plan)

        def feed(i):
            x_in.copy_(x_src[i])
            y_in.copy_(y_src[i])

        run = pdl_against_plain(monkeypatch, triton_sgmv, "PDL", feed, step, y, capture=capture,
                                order=(1, 0, 2, 1, 2), label=f"rows {rows}, ranks {ranks}")
        assert triton_sgmv._pdl(x.device)
        got = run(2).float()
        ref = reference(y_src[2] - 0.25, x, pool, 0, QKV, token_slots)  # x, y as the kernels saw them (bf16)
        torch.testing.assert_close(got, ref, **TOL[dtype])


def test_pdl_rule(monkeypatch):
    """``_use_pdl``: PDL wherever the device has it, except the wide-rank regime (rank >= 64 pools, 2-16 tokens) where
    it measured slower; never off CUDA or with ``PDL = False``."""
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    monkeypatch.setattr(triton_pdl, "capability", lambda index: (9, 0))
    assert not triton_sgmv._use_pdl(cpu, 1, 16)
    want = {(1, 16): True, (8, 16): True, (64, 16): True, (4096, 16): True, (1, 64): True, (2, 64): False,
            (8, 64): False, (16, 64): False, (17, 64): True, (64, 64): True, (8, 128): False}
    assert {k: triton_sgmv._use_pdl(cuda, *k) for k in want} == want
    monkeypatch.setattr(triton_pdl, "capability", lambda index: (8, 0))
    assert not any(triton_sgmv._use_pdl(cuda, *k) for k in want)
    monkeypatch.setattr(triton_pdl, "capability", lambda index: (9, 0))
    monkeypatch.setattr(triton_sgmv, "PDL", False)
    assert not any(triton_sgmv._use_pdl(cuda, *k) for k in want)
    monkeypatch.setattr(triton_sgmv, "PDL", True)
    monkeypatch.setattr(torch.version, "hip", "6.2")  # a ROCm build: capability 9.x is not CUDA's there
    assert not any(triton_sgmv._use_pdl(cuda, *k) for k in want)


def test_step_kernels_launch_args(monkeypatch):
    """``triton_pdl.launch_args``: PDL (the kernels' constexpr and the launch option) on NVIDIA GPUs of compute
    capability 9.0+ while ``ENABLED``; nothing (a plain launch) on the CPU, older GPUs, ROCm, or with it off."""
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    on = {"PDL": True, "launch_pdl": True}
    monkeypatch.setattr(triton_pdl, "capability", lambda index: (9, 0))
    monkeypatch.setattr(torch.version, "hip", None)
    assert triton_pdl.launch_args(cuda) == on and triton_pdl.launch_args(cpu) == {}
    monkeypatch.setattr(triton_pdl, "ENABLED", False)
    assert triton_pdl.launch_args(cuda) == {}
    monkeypatch.setattr(triton_pdl, "ENABLED", True)
    monkeypatch.setattr(triton_pdl, "capability", lambda index: (8, 9))
    assert triton_pdl.launch_args(cuda) == {}
    monkeypatch.setattr(triton_pdl, "capability", lambda index: (9, 4))
    monkeypatch.setattr(torch.version, "hip", "6.2")
    assert triton_pdl.launch_args(cuda) == {}


# ---------------------------------------------------------------------------------------------- compaction
def _compaction_case(device, dtype, apply, capture=False):
    """One slices descriptor and one plan, applied before and after the pool compacts (every adapter moves, the
    offsets are rewritten in place): both results equal the dense fp32 reference of the ORIGINAL A / B tensors. With
    ``capture`` the call is a CUDA graph captured before the compaction and replayed after it."""
    cfg = SMALL if device == "cpu" else LLAMA8B
    gen = torch.Generator().manual_seed(11)
    filler = random_adapter(cfg, "filler", 4, gen)
    ads = [random_adapter(cfg, f"a{i}", r, gen, vary=i % 2 == 1) for i, r in enumerate([8, 16, 3, 24])]
    size = sum(_pages(cfg, a) for a in ads + [filler, filler])
    pool = AdapterPool(cfg, num_bytes=size * PAGE_ELEMS * torch.empty((), dtype=dtype).element_size(),
                       max_rank=24, max_slots=8, dtype=dtype, device=device)
    first = pool.load(filler)
    slots = [pool.load(a) for a in ads]
    layer = cfg.num_layers - 1
    slices = lora_slices([pool.module_view(layer, m) for m in QKV])
    token_slots = [slots[i % 4] if i % 5 else -1 for i in range(13)]
    plan = build_lora_plan(token_slots, device=device)
    x = torch.randn(13, slices.d_in, generator=gen).to(device, dtype)
    y0 = torch.randn(13, slices.d_out, generator=gen).to(device, dtype)
    ref = y0.float().clone()
    for t, s in enumerate(token_slots):  # dense per-token fp32 reference from the adapters' own tensors
        if s < 0:
            continue
        col = 0
        for m in QKV:
            w = ads[slots.index(s)].modules[(layer, m)]
            a, b = w.a.to(dtype).float().to(device), w.b.to(dtype).float().to(device)
            ref[t, col : col + b.shape[0]] += w.scaling * (x[t].float() @ a.t()) @ b.t()
            col += b.shape[0]
    y = y0.clone()
    if capture:
        apply(y, x, slices, plan)  # compile before capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            apply(y, x, slices, plan)
        y.copy_(y0)
        graph.replay()
    else:
        apply(y, x, slices, plan)
    torch.testing.assert_close(y.float(), ref, **TOL[dtype])
    before = {s: pool.extent_of(s) for s in slots}
    pool.free(first)
    pool.load(filler)  # goes into the hole at page 0 ...
    pool.free(slots[0])
    pool.compact()  # ... and now everything after it slides down
    assert all(pool.extent_of(s) != before[s] for s in slots[1:])
    slots[0] = pool.load(ads[0])  # reloaded at the top, into the same slot
    y.copy_(y0)
    if capture:
        graph.replay()
    else:
        apply(y, x, slices, plan)
    torch.testing.assert_close(y.float(), ref, **TOL[dtype])
    none = torch.tensor([s < 0 for s in token_slots], device=device)
    assert torch.equal(y[none], y0[none])


@pytest.mark.parametrize("device,dtype", CPU_CASES)
@pytest.mark.parametrize("path", ["triton", "torch", "fused"])
def test_compaction_between_calls_is_seen_by_the_next_call(path, device, dtype):
    apply = {"triton": lora_apply_triton, "torch": lora_apply_torch, "fused": fused(block_n=32, tiles=2)}[path]
    _compaction_case(device, dtype, apply)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (runs on the device machine)")
@pytest.mark.parametrize("path", ["default", "fused"])
def test_cuda_graph_replayed_after_compaction(path):
    """A graph captured before the pool compacts, replayed after: it reads the rewritten offsets in place."""
    _compaction_case("cuda", torch.bfloat16, lora_fused if path == "fused" else lora_apply_triton, capture=True)


def test_prefill_tile_rules(monkeypatch):
    """The launchers' default tiles by step (``shrink_block_k``, ``expand_block_n``, ``prefill_write_tiles``):
    sessions 30 and 31 changed only prefill chunks (block_m > 16) of rank <= 16 pools on a GPU (the shrink's block_k,
    its K split still computed for 256; a writing expand's block_n and looped tiles); the CPU, decode-sized steps,
    fp32, rank > 16 pools and an adding expand keep what ran before, and ``None`` restores it everywhere."""
    from multilora.kernels import triton_sgmv as ts

    bf16, f32 = torch.bfloat16, torch.float32
    assert ts.shrink_block_k("cpu", bf16, 4096, 64, 16) == (64, None)
    assert ts.shrink_block_k("cuda", f32, 4096, 64, 16) == (128, None)
    assert ts.shrink_block_k("cuda", bf16, 512, 16, 16) == (128, None)
    assert ts.shrink_block_k("cuda", bf16, 4096, 64, 16) == (ts.PREFILL_SHRINK_BLOCK_K, 256) == (128, 256)
    assert ts.shrink_block_k("cuda", bf16, 4096, 64, 64) == (256, None)  # rank 64: not swept
    assert ts.expand_block_n("cpu", bf16, 4096, 64, 16, True) == 64
    assert ts.expand_block_n("cuda", bf16, 512, 16, 16, True) == 256
    assert ts.expand_block_n("cuda", bf16, 4096, 64, 16, False) == 128  # adding: not swept
    assert ts.expand_block_n("cuda", bf16, 4096, 64, 16, True) == ts.PREFILL_WRITE_BLOCK_N == 256
    assert ts.expand_block_n("cuda", torch.float16, 4096, 64, 16, True) == 256
    assert ts.expand_block_n("cuda", f32, 4096, 64, 16, True) == 128  # fp32: not swept
    assert ts.expand_block_n("cuda", bf16, 4096, 64, 64, True) == 128  # a rank-64 pool: not swept
    # session 31's looped writing expand: the same places as the writing expand's block_n
    assert ts.prefill_write_tiles("cuda", bf16, 64, 16, True) == ts.PREFILL_WRITE_LOOP == (4, 128, 2)
    assert ts.prefill_write_tiles("cuda", torch.float16, 128, 8, True) == (4, 128, 2)
    for args in (("cpu", bf16, 64, 16, True), ("cuda", f32, 64, 16, True), ("cuda", bf16, 16, 16, True),
                 ("cuda", bf16, 64, 64, True), ("cuda", bf16, 64, 16, False)):
        assert ts.prefill_write_tiles(*args) is None, args
    monkeypatch.setattr(ts, "PREFILL_WRITE_LOOP", None)
    assert ts.prefill_write_tiles("cuda", bf16, 64, 16, True) is None
    monkeypatch.setattr(ts, "PREFILL_SHRINK_BLOCK_K", None)
    monkeypatch.setattr(ts, "PREFILL_WRITE_BLOCK_N", None)
    assert ts.shrink_block_k("cuda", bf16, 4096, 64, 16) == (256, None)
    assert ts.expand_block_n("cuda", bf16, 4096, 64, 16, True) == 128


def test_shrink_block_k_below_its_split_block_keeps_the_result():
    """Shrinks of 128-wide K blocks under K splits made for other widths (session 30's prefill rule runs 128-wide
    blocks with the split of 256: ``k_per`` then covers several blocks, and the last split a partial or empty range),
    on an input width that no block divides (2,049), then a writing expand of 256-wide tiles over a y of 7s: the
    torch reference of the LoRA term alone. Prefill chunks (600 tokens: block_m 64); fp32 (interpreted on the CPU)."""
    pytest.importorskip("triton")
    if __import__("os").environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        pytest.skip("needs TRITON_INTERPRET=1 on the CPU")
    from multilora.kernels import build_lora_plan, lora_apply_torch, lora_slices
    from multilora.kernels import triton_sgmv as ts

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    pool, slots = make_pool(ODD, [8, 16, 4], dtype=torch.float32, device=dev)
    sl = lora_slices([pool.module_view(0, m) for m in ("down_proj",)])
    assert sl.d_in % 128 != 0
    T = 600
    plan = build_lora_plan([slots[t * 3 // T] for t in range(T)], device=dev)
    assert plan.block_m > 16
    x = torch.randn(T, sl.d_in, generator=torch.Generator().manual_seed(3)).to(dev)
    ref = lora_apply_torch(torch.zeros(T, sl.d_out, device=dev), x, sl, plan)
    for split in (3, 5, 7):
        v = ts.sgmv_shrink(x, sl, plan, block_k=128, split_k=split)
        y = ts.sgmv_expand(torch.full((T, sl.d_out), 7.0, device=dev), v, sl, plan, overwrite=True, block_n=256)
        torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-4, msg=f"split {split}")


def test_shrink_computes_its_split_for_the_rules_split_block(monkeypatch):
    """``_shrink`` takes the K split from ``_split_k`` for the width ``shrink_block_k`` names (256 under session 30's
    prefill rule) while its programs step by the rule's block_k (128): the split a GPU would compute, recorded."""
    pytest.importorskip("triton")
    if __import__("os").environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        pytest.skip("needs TRITON_INTERPRET=1 on the CPU")
    from multilora.kernels import build_lora_plan, lora_slices
    from multilora.kernels import triton_sgmv as ts

    seen, real = [], ts._split_k
    monkeypatch.setattr(ts, "shrink_block_k", lambda *a: (128, 256))  # the rule as on a GPU
    monkeypatch.setattr(ts, "_split_k", lambda device, programs, d_in, block_k, *a: seen.append(block_k) or
                        real(device, programs, d_in, block_k, *a))
    pool, slots = make_pool(ODD, [8, 16], dtype=torch.float32, device="cpu")
    sl = lora_slices([pool.module_view(0, "down_proj")])
    plan = build_lora_plan([slots[t % 2] for t in range(600)], device="cpu")
    ts.sgmv_shrink(torch.randn(600, sl.d_in), sl, plan)
    assert seen == [256]
    ts.sgmv_shrink(torch.randn(600, sl.d_in), sl, plan, block_k=64)  # an explicit block_k: its own split
    assert seen == [256, 64]


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (runs on the device machine)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("modules", [QKV, GATE_UP, ("o_proj",), ("down_proj",)], ids=["qkv", "gate_up", "o", "down"])
@pytest.mark.parametrize("cfg", [LLAMA8B, ODD], ids=["llama8b", "odd"])
def test_prefill_tiles_write_the_old_tiles_bits(cfg, modules, dtype, monkeypatch):
    """A prefill step (600 tokens: block_m 64) from a pool of max rank 16 takes session 30's tiles (the shrink's
    128-wide K blocks under the split of 256, the writing expand's 256-wide tiles) and session 31's looped ones
    (``PREFILL_WRITE_LOOP``; on odd widths, 2049 / 3424, the last group of looped tiles is partial). The writing
    expand's tiles give the bits of the tiles before (``PREFILL_WRITE_BLOCK_N = PREFILL_WRITE_LOOP = None``) at every
    width: each element's sum runs over the ranks, in one tile. With the shrink's blocks of before too
    (``PREFILL_SHRINK_BLOCK_K = None``) the bits are the same on Llama-3-8B widths (the sweeps saw none differ); on
    odd widths the K sums split differently and may round differently (session 32, H200: they did, for d_in =
    2049), so there both are held to the torch reference within the dtype's rounding
    (``test_prefill_shrink_sums_are_the_fp64_sums`` holds the shrink's sums alone). A row without an adapter gets
    zeros."""
    pool, slots = make_pool(cfg, [16, 8, 4], dtype=dtype, device="cuda")  # (ODD: partial 4 x 128 column groups)
    assert pool.max_rank <= 16
    sl = lora_slices([pool.module_view(0, m) for m in modules])
    T = 600
    token_slots = [slots[t * 3 // T] for t in range(T)]
    token_slots[5] = -1
    plan = build_lora_plan(token_slots, device="cuda")
    assert plan.block_m > 16 and triton_sgmv.shrink_block_k("cuda", dtype, T, plan.block_m, pool.max_rank) == (128, 256)
    assert triton_sgmv.expand_block_n("cuda", dtype, T, plan.block_m, pool.max_rank, True) == 256
    x = torch.randn(T, sl.d_in, generator=torch.Generator().manual_seed(4)).to("cuda", dtype)

    def delta():
        return lora_delta(torch.full((T, sl.d_out), 3.0, device="cuda", dtype=dtype), x, sl, plan, backend="triton")

    new = delta()
    monkeypatch.setattr(triton_sgmv, "PREFILL_WRITE_BLOCK_N", None)
    monkeypatch.setattr(triton_sgmv, "PREFILL_WRITE_LOOP", None)
    assert torch.equal(new, delta())
    monkeypatch.setattr(triton_sgmv, "PREFILL_SHRINK_BLOCK_K", None)
    assert triton_sgmv.shrink_block_k("cuda", dtype, T, plan.block_m, pool.max_rank) != (128, 256)  # (other blocks)
    old = delta()
    assert not new[5].any() and not old[5].any()
    ref = reference(torch.zeros(T, sl.d_out, device="cuda"), x, pool, 0, modules, token_slots)
    torch.testing.assert_close(new.float(), ref, **TOL[dtype])
    if cfg is LLAMA8B:
        assert torch.equal(new, old)
    else:
        torch.testing.assert_close(old.float(), ref, **TOL[dtype])


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (runs on the device machine)")
@pytest.mark.parametrize("cfg", [LLAMA8B, ODD], ids=["llama8b", "odd"])
@pytest.mark.parametrize("tiles", ["rule", "before"])
def test_prefill_shrink_sums_are_the_fp64_sums(cfg, tiles, monkeypatch):
    """The prefill shrink's K split (``shrink_block_k``'s 128-wide blocks under the split of 256, and the blocks of
    before: ``PREFILL_SHRINK_BLOCK_K = None``), summed over its partials, equals ``x A^T`` computed in float64 within
    fp32 accumulation: ``|err| <= 1e-5 (|x| |A|^T)`` element-wise, which a dropped or doubled K element (the last
    one of d_in = 2049 in a partial block) would break well over 1 (about 50x at d_in 2049, 7x at 14336). bf16, q/k/v (d_in 4096 / 2049) and
    down (14336 / 3424), 600 tokens on three adapters."""
    if tiles == "before":
        monkeypatch.setattr(triton_sgmv, "PREFILL_SHRINK_BLOCK_K", None)
    dtype = torch.bfloat16
    pool, slots = make_pool(cfg, [16, 8, 4], dtype=dtype, device="cuda")
    T = 600
    token_slots = [slots[t * 3 // T] for t in range(T)]
    plan = build_lora_plan(token_slots, device="cuda")
    rule = triton_sgmv.shrink_block_k("cuda", dtype, T, plan.block_m, pool.max_rank)
    assert (rule == (128, 256)) == (tiles == "rule"), rule  # (the two cases take different K blocks)
    worst = 0.0
    for modules in (QKV, ("down_proj",)):
        sl = lora_slices([pool.module_view(0, m) for m in modules])
        x = torch.randn(T, sl.d_in, generator=torch.Generator().manual_seed(5)).to("cuda", dtype)
        v = triton_sgmv.sgmv_shrink(x, sl, plan).sum(0)  # [slices, T, rank rows]
        for i, m in enumerate(modules):
            for s in slots:
                a = read_module(pool, s, 0, m)[0].double()  # [r, d_in]
                if a.shape[0] == 0:
                    continue
                rows = torch.tensor([t for t in range(T) if token_slots[t] == s], device="cuda")
                xs = x[rows].double()
                want, bound = xs @ a.t(), 1e-5 * (xs.abs() @ a.abs().t())
                got = v[i, rows, : a.shape[0]].double()
                worst = max(worst, ((got - want).abs() / bound).max().item())
                assert ((got - want).abs() <= bound).all(), (m, s, tiles, (got - want).abs().max().item())
    print(f"largest |err| / bound: {worst:.3g}")


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("block_m", [16, 64], ids=["decode-chunks", "prefill-chunks"])
@pytest.mark.parametrize("gelu_tanh", [False, True], ids=["silu", "gelu_tanh"])
def test_expand_glu_is_lora_apply_then_the_activation(gelu_tanh, block_m, device, dtype):
    """``kernels.experimental.expand_glu`` (the gate/up expand fused into the gated activation; not used by the
    product): bit for bit ``lora_apply`` in place (Triton) followed by the Triton ``silu_mul`` / ``gelu_tanh_mul``,
    from a rank-16 pool with rows of slot -1 between runs of three adapters, one of which does not target up_proj
    (its up columns get no term); and the fp32 torch reference (loop + ``F.silu`` / tanh ``F.gelu``) within the
    dtype's rounding. GPU: odd widths (I = 3,424: a partial last group of 4 x 128 columns)."""
    from multilora.kernels import triton_fused
    from multilora.kernels.experimental.expand_glu import expand_glu

    cfg = SMALL if device == "cpu" else ODD
    pool, (a, b, c) = make_pool(cfg, [16, 8, 4], dtype=dtype, device=device, skip={1: ("up_proj",)})
    slices = lora_slices([pool.module_view(0, m) for m in GATE_UP])
    token_slots = [a, -1, b, b, c, -1, a, a, c, b, -1] * 3
    T, inter = len(token_slots), slices.views[0].d_out
    gen = torch.Generator().manual_seed(block_m + gelu_tanh)
    x = torch.randn(T, slices.d_in, generator=gen).to(device, dtype)
    gate_up = (torch.randn(T, 2 * inter, generator=gen) * 1.5).to(device, dtype)
    plan = build_lora_plan(token_slots, device=device, block_m=block_m)
    v = triton_sgmv.sgmv_shrink(x, slices, plan)
    got = expand_glu(gate_up, v, slices, plan, gelu_tanh=gelu_tanh)
    act = triton_fused.gelu_tanh_mul if gelu_tanh else triton_fused.silu_mul
    want = act(lora_apply(gate_up.clone(), x, slices, plan, backend="triton"))
    assert got.shape == (T, inter) and got.dtype == dtype
    assert torch.equal(_bits(got), _bits(want))
    ref_y = reference(gate_up, x, pool, 0, GATE_UP, token_slots)
    g, u = ref_y[:, :inter], ref_y[:, inter:]
    ref = (torch.nn.functional.gelu(g, approximate="tanh") if gelu_tanh else torch.nn.functional.silu(g)) * u
    tol = {torch.float32: dict(atol=1e-3, rtol=1e-3), torch.float16: dict(atol=6e-2, rtol=2e-2),
           torch.bfloat16: dict(atol=3e-1, rtol=6e-2)}[dtype]
    torch.testing.assert_close(got.float(), ref, **tol)


@pytest.mark.parametrize("device,dtype", CPU_CASES[:1])
def test_expand_glu_refuses_what_is_not_gate_up(device, dtype):
    """Slices that are not two of width I (q/k/v), a gate_up of another width, and a v of another shape are refused
    with errors naming the argument, what was expected and what was got."""
    from multilora.kernels.experimental.expand_glu import expand_glu

    pool, (a,) = make_pool(SMALL, [4], dtype=dtype, device=device)
    plan = build_lora_plan([a, -1, a], device=device)
    qkv = lora_slices([pool.module_view(0, m) for m in QKV])
    gu = lora_slices([pool.module_view(0, m) for m in GATE_UP])
    inter = gu.views[0].d_out
    x = torch.randn(3, SMALL.hidden_size, dtype=dtype)
    with pytest.raises(ValueError, match=r"slices: expected the gate and up slices.*got widths \[40, 8, 8\]"):
        expand_glu(torch.zeros(3, 2 * inter, dtype=dtype), triton_sgmv.sgmv_shrink(x, qkv, plan), qkv, plan)
    v = triton_sgmv.sgmv_shrink(x, gu, plan)
    with pytest.raises(ValueError, match=rf"slices: expected .* {inter + 1:g} wide, got widths \[{inter}, {inter}\]"):
        expand_glu(torch.zeros(3, 2 * inter + 2, dtype=dtype), v, gu, plan)
    with pytest.raises(ValueError, match=r"v: expected contiguous float32 \[split_k, 2, 3, "):
        expand_glu(torch.zeros(3, 2 * inter, dtype=dtype), v[:, :1].contiguous(), gu, plan)
