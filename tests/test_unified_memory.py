"""The unified memory (memory/unified.py): one arena for the KV cache and the adapter pool, the boundary between them
moving both ways; the allocators it stands on (``Extents.resize``, ``FloorBlockAllocator``).

References: the module docstring's layout formulas recomputed here (element addresses of KV rows and pool pages in
the arena), a plain-Python model of which unit belongs to which side, and the data itself: under random sequences
of KV allocations, adapter loads, frees and boundary moves (hypothesis), every live adapter reads back bit for bit
(``AdapterPool.unpack``) and every live sequence's KV rows keep the values written into them, while the arena
tensor never changes.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from multilora.config import TARGET_MODULES, ModelConfig
from multilora.memory.extents import Extents
from multilora.memory.kv_cache import NULL_BLOCK, FloorBlockAllocator, KVCacheFullError
from multilora.memory.pool import PAGE_ELEMS, max_adapter_pages
from multilora.memory.unified import UnifiedMemory, unified_layout
from test_pool import _adapter, _same_bits

# 2 layers, 1 KV head of 16: a KV block of 4 tokens over all layers is 2 * 2 * 4 * 16 = 256 fp32 = 4 pages
CFG = ModelConfig(vocab_size=32, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=2, num_kv_heads=1)
BS = 4
UNIT_ELEMS = 2 * CFG.num_layers * BS * CFG.num_kv_heads * CFG.head_dim
PPU = UNIT_ELEMS // PAGE_ELEMS
MAX_RANK = 2


def _layout(pool_units=8, kv_units=24, min_kv_blocks=3):
    unit = UNIT_ELEMS * 4
    return unified_layout(pool_bytes=pool_units * unit, kv_bytes=kv_units * unit, block_bytes=unit,
                          page_bytes=PAGE_ELEMS * 4, min_pool_bytes=max_adapter_pages(CFG, MAX_RANK) * PAGE_ELEMS * 4,
                          min_kv_blocks=min_kv_blocks)


def _memory(**kw):
    return UnifiedMemory(CFG, _layout(**kw), block_size=BS, dtype=torch.float32, device="cpu", max_rank=MAX_RANK,
                         max_slots=16)


# ------------------------------------------------------------------------------------------ the allocators
def test_extents_resize_grows_merging_the_top_hole_and_shrinks_only_free_units():
    e = Extents(10)
    assert e.take(4) == 0 and e.top_hole == 6
    e.resize(14)
    assert e.holes() == [(4, 10)] and e.num_units == 14
    assert e.take(10) == 4 and e.top_hole == 0
    with pytest.raises(ValueError, match="only free units at the top"):
        e.resize(13)
    e.give(10, 4)
    e.resize(11)
    assert e.holes() == [(10, 1)] and e.free_units == 1
    e.resize(10)
    assert e.holes() == [] and e.num_units == 10
    e.resize(12)  # growing after a taken top unit: a new hole
    assert e.holes() == [(10, 2)]


def test_floor_allocator_hands_out_the_highest_blocks_and_moves_its_floor():
    a = FloorBlockAllocator(12, floor=4)
    assert (a.num_usable, a.num_free) == (8, 8)
    assert a.allocate("x", 3) == [11, 10, 9]  # highest first: free blocks gather above the floor
    assert a.free_above_floor() == 5
    a.raise_floor(2)
    assert (a.floor, a.num_usable, a.num_free) == (6, 6, 3)
    assert a.allocate("y", 3) == [8, 7, 6]
    with pytest.raises(KVCacheFullError):
        a.allocate("z", 1)
    with pytest.raises(ValueError, match="not all free"):
        a.raise_floor(1)
    a.free("x")
    a.lower_floor(5)
    assert (a.floor, a.num_free) == (1, 8)
    assert a.allocate("z", 4) == [11, 10, 9, 5]  # freed high blocks first, then the highest below
    with pytest.raises(ValueError, match="cannot lower"):
        a.lower_floor(1)  # never over the null block
    a.free("y")
    a.free("z")
    assert a.free_above_floor() == 11 and a.num_free == 11
    with pytest.raises(ValueError):
        a.raise_floor(11)  # would leave no block
    with pytest.raises(ValueError, match=r"floor must be an int in \[1, 12\)"):
        FloorBlockAllocator(12, floor=0)


# ------------------------------------------------------------------------------------------ layout
def test_layout_keeps_the_total_in_whole_units_and_both_minimums():
    lay = _layout(pool_units=12, kv_units=20)
    min_pool = -(-max_adapter_pages(CFG, MAX_RANK) // PPU)
    assert (lay.num_units, lay.floor, lay.min_pool_units, lay.pages_per_unit) == (32, 13, min_pool, PPU)
    assert lay.max_floor == 32 - 3 and lay.nbytes == 32 * UNIT_ELEMS * 4
    assert _layout(pool_units=1, kv_units=40).floor == 1 + min_pool  # the pool holds the largest adapter
    unit = UNIT_ELEMS * 4  # shares that are not whole units: the pool's rounds down, the KV side keeps its blocks
    odd = unified_layout(pool_bytes=25 * unit // 2, kv_bytes=39 * unit // 2, block_bytes=unit, page_bytes=PAGE_ELEMS * 4,
                         min_pool_bytes=max_adapter_pages(CFG, MAX_RANK) * PAGE_ELEMS * 4, min_kv_blocks=3)
    assert (odd.num_units, odd.floor) == (32, 13) and odd.num_units - odd.floor >= 39 // 2 - 1
    with pytest.raises(ValueError, match=r"at least .* are needed \(the null block, .* for the largest adapter, 3 "
                                         r"for one max_seq_len sequence\)"):
        _layout(pool_units=1, kv_units=1)
    with pytest.raises(ValueError, match="whole number of adapter-pool pages"):
        unified_layout(pool_bytes=10**6, kv_bytes=10**6, block_bytes=1000, page_bytes=256, min_pool_bytes=1,
                       min_kv_blocks=1)


def test_kv_rows_and_pool_pages_sit_where_the_docstring_says():
    m = _memory()
    L, H, D = CFG.num_layers, CFG.num_kv_heads, CFG.head_dim
    for layer, blk, row, h in [(0, 31, 0, 0), (1, 20, 3, 0), (1, m.floor, 2, 0)]:
        k, v = m.kv.layer(layer)
        k[blk, row, h] = torch.arange(D) + 1000.0
        v[blk, row, h] = torch.arange(D) + 2000.0
        base = ((blk * 2 * L + layer) * BS + row) * H * D + h * D  # arena [units, 2, L, bs, H, D]
        assert torch.equal(m.arena[base: base + D], torch.arange(D) + 1000.0)
        v_base = (((blk * 2 + 1) * L + layer) * BS + row) * H * D + h * D
        assert torch.equal(m.arena[v_base: v_base + D], torch.arange(D) + 2000.0)
    assert m.kv.nbytes == (32 - m.floor + 1) * UNIT_ELEMS * 4  # the usable blocks + the null block
    a = _adapter("a", {(0, "q_proj"): 2, (1, "down_proj"): 1}, config=CFG)
    slot = m.pool.load(a)
    start, n = m.pool.extent_of(slot)
    offs = m.pool.offsets_a[:, :, slot]
    used = offs[offs > 0]
    assert used.min() == (PPU + start) * PAGE_ELEMS  # pool page p is arena page PPU + p: the null block is unit 0
    assert (PPU + start + n) * PAGE_ELEMS <= m.floor * UNIT_ELEMS  # below the floor


def test_boundary_moves_keep_data_and_refuse_what_is_in_use():
    m = _memory(pool_units=8, kv_units=24)
    f0, pages0 = m.floor, m.pool.num_pages
    assert pages0 == (f0 - 1) * PPU
    ptr = m.arena.data_ptr()
    m.kv.allocate_seq("s", 5 * BS)  # the highest 5 blocks
    table = m.kv.block_table("s")
    assert table == list(range(31, 26, -1))
    k, _ = m.kv.layer(1)
    k[table] = 7.0
    # the pool grows over free KV blocks only, and the KV side keeps min_kv_blocks
    assert m.grow_pool(100) == 27 - f0
    assert m.floor == 27 and m.pool.num_pages == 26 * PPU  # stopped at the sequence's lowest block
    assert m.free_kv_units_at_floor() == 0 and m.grow_pool(1) == 0
    filler = m.pool.load(_adapter("f", {(layer, mod): 2 for layer in range(2) for mod in ("gate_proj", "up_proj")},
                                  config=CFG))
    a = _adapter("a", {(layer, mod): 2 for layer in range(2) for mod in TARGET_MODULES}, config=CFG)
    slot = m.pool.load(a)
    image = m.pool.unpack(slot).data.clone()
    m.pool.free(filler)  # a hole below the adapter: the shrink below must compact
    m.kv.free_seq("s")
    assert m.grow_pool(100) == m.layout.max_floor - 27 and m.floor == m.layout.max_floor
    # the KV side takes units back over free pool pages, never below the pool's minimum
    got = m.shrink_pool(100)
    assert m.floor == 1 + m.layout.min_pool_units and got > 0
    assert m.pool.compactions == 1 and m.pool.extent_of(slot)[0] == 0
    assert _same_bits(m.pool.unpack(slot).data, image), "the adapter moved with its bits"
    assert torch.equal(k[table], torch.full_like(k[table], 7.0)), "KV rows of a freed sequence are not touched"
    assert m.arena.data_ptr() == ptr and m.pool.buffer.data_ptr() == ptr
    assert m.report()["unified_floor_moves_up"] == 2 and m.report()["unified_floor_moves_down"] == 1


# ------------------------------------------------------------------------------------------ random sequences
class UnifiedMachine(RuleBasedStateMachine):
    """Random KV allocations and frees, adapter loads and frees, boundary moves and null-block writes (CUDA-graph
    padding) on one small arena; after every step, every live adapter reads back bit for bit, every live
    sequence's rows hold their values, and the two sides partition the units."""

    @initialize(pool_units=st.integers(3, 14), kv_units=st.integers(10, 30))
    def setup(self, pool_units, kv_units):
        self.m = _memory(pool_units=pool_units, kv_units=kv_units, min_kv_blocks=2)
        self.ptr = self.m.arena.data_ptr()
        self.seqs: dict[int, float] = {}  # seq id -> the value its rows hold
        self.adapters: dict[int, torch.Tensor] = {}  # slot -> its image
        self.next = 1

    @rule(tokens=st.integers(1, 4 * BS))
    def allocate(self, tokens):
        kv = self.m.kv
        if not kv.can_fit(tokens):
            return
        sid, val = self.next, float(self.next)
        self.next += 1
        table = kv.allocate_seq(sid, tokens)
        assert all(b >= kv.floor for b in table)
        for layer in range(CFG.num_layers):
            k, v = kv.layer(layer)
            k[table], v[table] = val, -val
        self.seqs[sid] = val

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def free_seq(self, data):
        sid = data.draw(st.sampled_from(sorted(self.seqs)))
        self.m.kv.free_seq(sid)
        del self.seqs[sid]

    @rule(rank=st.integers(1, MAX_RANK), layers=st.sets(st.integers(0, 1), min_size=1),
          modules=st.sets(st.sampled_from(TARGET_MODULES), min_size=2), seed=st.integers(0, 99))
    def load(self, rank, layers, modules, seed):
        a = _adapter(f"a{seed}", {(layer, mod): rank for layer in layers for mod in modules}, seed=seed, config=CFG)
        if not self.m.pool.can_fit(a):
            return
        slot = self.m.pool.load(a)
        self.adapters[slot] = self.m.pool.unpack(slot).data.clone()

    @precondition(lambda self: self.adapters)
    @rule(data=st.data())
    def free_adapter(self, data):
        slot = data.draw(st.sampled_from(sorted(self.adapters)))
        self.m.pool.free(slot)
        del self.adapters[slot]

    @rule(units=st.integers(1, 20))
    def grow(self, units):
        before, free_run = self.m.floor, self.m.free_kv_units_at_floor()
        got = self.m.grow_pool(units)
        assert got == min(units, free_run) and self.m.floor == before + got

    @rule(units=st.integers(1, 20))
    def shrink(self, units):
        before, room = self.m.floor, self.m.free_pool_units_at_top()
        got = self.m.shrink_pool(units)
        assert got == min(units, room) and self.m.floor == before - got

    @rule(val=st.floats(-9, 9))
    def pad_write(self, val):
        for layer in range(CFG.num_layers):  # what padded rows of a captured step write
            k, v = self.m.kv.layer(layer)
            k[NULL_BLOCK], v[NULL_BLOCK] = val, val

    @invariant()
    def data_and_partition(self):
        m = self.m
        if not hasattr(m, "pool"):
            return
        kv, pool, lay = m.kv, m.pool, m.layout
        assert m.arena.data_ptr() == self.ptr  # one allocation, never replaced
        assert 1 + lay.min_pool_units <= m.floor <= lay.max_floor
        assert pool.num_pages == (m.floor - 1) * PPU
        owned = [b for o in kv.allocator.owners() for b in kv.block_table(o)]
        assert len(owned) == len(set(owned)) and all(b >= m.floor for b in owned)
        assert len(owned) + kv.num_free_blocks == kv.num_usable_blocks == lay.num_units - m.floor
        for slot, image in self.adapters.items():
            start, n = pool.extent_of(slot)
            assert 0 <= start and start + n <= pool.num_pages
            assert _same_bits(pool.unpack(slot).data, image), f"slot {slot} changed"
        for sid, val in self.seqs.items():
            table = kv.block_table(sid)
            for layer in range(CFG.num_layers):
                k, v = kv.layer(layer)
                assert (k[table] == val).all() and (v[table] == -val).all(), f"sequence {sid} changed"


TestUnifiedMachine = UnifiedMachine.TestCase
TestUnifiedMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None,
                                       suppress_health_check=[HealthCheck.too_slow])
