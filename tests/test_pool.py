"""The paged adapter pool (memory/pool.py): load / free / read back, page accounting, the address contract.

The reference for the layout is the module docstring's formulas, recomputed here from the module shapes
(not from the pool's own offset methods), and its worked example's numbers for SmolLM2-135M. Page
bookkeeping is checked against a plain-Python model of the pool, including under random load/free
sequences (hypothesis).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from multilora.memory.pool import AdapterPool, PoolFullError
from multilora.runtime.adapters import LoRAAdapter, LoRAModuleWeights
from multilora.config import TARGET_MODULES, ModelConfig
from testsupport import read_module

# hidden 24, q 24, k/v 8 (GQA 3:1), MLP 40: every module has its own (d_in, d_out), none a power of two
CFG = ModelConfig(vocab_size=32, hidden_size=24, intermediate_size=40, num_layers=3, num_heads=3, num_kv_heads=1)
R = 8


def _adapter(name, ranks, *, seed=0, config=CFG):
    """An adapter with random A, B: ``ranks`` maps (layer, module) -> rank (per-module ranks like rank_pattern)."""
    g = torch.Generator().manual_seed(seed)
    mods = {}
    for (layer, m), r in sorted(ranks.items(), key=lambda kv: (kv[0][0], TARGET_MODULES.index(kv[0][1]))):
        d_in, d_out = config.module_shape(m)
        mods[(layer, m)] = LoRAModuleWeights(a=torch.randn(r, d_in, generator=g), b=torch.randn(d_out, r, generator=g),
                                             scaling=0.5 + r / 7)
    return LoRAAdapter(name=name, path=f"/nowhere/{name}", config={}, modules=mods)


def _uniform(name, r, *, seed=0, modules=TARGET_MODULES, layers=range(CFG.num_layers)):
    return _adapter(name, {(layer, m): r for layer in layers for m in modules}, seed=seed)


def _pool(num_pages=16, **kw):
    kw.setdefault("page_rows", R)
    kw.setdefault("max_rank", 32)
    return AdapterPool(CFG, num_pages=num_pages, **kw)


def _check_round_trip(pool, slot, adapter):
    for layer in range(CFG.num_layers):
        for m in TARGET_MODULES:
            a, b, s = read_module(pool, slot, layer, m)
            w = adapter.modules.get((layer, m))
            if w is None:
                assert a.shape[0] == 0 and b.shape[1] == 0 and s == 0.0, (layer, m)
                assert int(pool.ranks[layer, TARGET_MODULES.index(m), slot]) == 0
            else:
                assert torch.equal(a, w.a) and torch.equal(b, w.b), (layer, m)  # fp32 pool: exact
                assert s == pytest.approx(w.scaling)
                assert int(pool.ranks[layer, TARGET_MODULES.index(m), slot]) == w.rank


def _snapshot(pool):
    return {
        "pages_used": pool.pages_used, "pages_free": pool.pages_free, "slots_used": pool.slots_used,
        "resident": {s: pool.pages_of(s) for s in pool.resident_slots()},
        "page_table": pool.page_table.clone(), "ranks": pool.ranks.clone(), "scalings": pool.scalings.clone(),
        "buffer": pool.buffer.clone().view(torch.int32),  # bitwise (the buffer may hold uninitialised NaNs)
    }


def _assert_same(s1, s2):
    for k in s1:
        if isinstance(s1[k], torch.Tensor):
            assert torch.equal(s1[k], s2[k]), k
        else:
            assert s1[k] == s2[k], k


def _assert_invariants(pool):
    owned = [p for s in pool.resident_slots() for p in pool.pages_of(s)]
    assert len(owned) == len(set(owned)), "a page is owned twice"
    assert all(0 <= p < pool.num_pages for p in owned)
    assert pool.pages_used == len(owned) and pool.pages_free == pool.num_pages - len(owned)
    for s in range(pool.max_slots):
        row = pool.page_table[s].tolist()
        if s in pool.resident_slots():
            pages = pool.pages_of(s)
            assert row[: len(pages)] == pages and all(p == -1 for p in row[len(pages):])
        else:
            assert all(p == -1 for p in row), s
            assert int(pool.ranks[:, :, s].abs().sum()) == 0


# ----------------------------------------------------------------------------------------- round trip
@pytest.mark.parametrize("rank", [1, 3, 8, 17])
def test_round_trip_uniform_rank(rank):
    pool = _pool()
    ad = _uniform("u", rank, seed=rank)
    slot = pool.load(ad)
    assert pool.pages_of(slot) == pool.page_table[slot, : math.ceil(rank / R)].tolist()
    assert pool.pages_used == math.ceil(rank / R) == pool.pages_needed(ad)
    _check_round_trip(pool, slot, ad)


def test_round_trip_mixed_ranks_side_by_side_then_free():
    pool = _pool(num_pages=8)
    ads = {r: _uniform(f"r{r}", r, seed=r, modules=TARGET_MODULES[r % 3:]) for r in (1, 3, 8, 17)}
    slots = {r: pool.load(a) for r, a in ads.items()}
    assert pool.pages_used == sum(math.ceil(r / R) for r in ads) == 1 + 1 + 1 + 3
    assert pool.slots_used == 4
    _assert_invariants(pool)
    for r, a in ads.items():
        _check_round_trip(pool, slots[r], a)
    pool.free(slots[8])
    assert pool.pages_used == 5 and pool.slots_used == 3
    _assert_invariants(pool)
    for r in (1, 3, 17):  # the others are untouched by the free
        _check_round_trip(pool, slots[r], ads[r])
    for r in (1, 3, 17):
        pool.free(slots[r])
    assert pool.pages_used == 0 and pool.pages_free == 8 and pool.slots_used == 0
    _assert_invariants(pool)
    with pytest.raises(KeyError):
        pool.free(slots[1])


def test_round_trip_per_module_ranks():
    """rank_pattern-like: ranks differ per (layer, module), some modules absent; pages follow the max rank."""
    ranks = {(0, "q_proj"): 3, (0, "down_proj"): 17, (1, "v_proj"): 1, (2, "o_proj"): 8, (2, "up_proj"): 9}
    pool = _pool()
    ad = _adapter("pattern", ranks, seed=3)
    assert ad.max_rank == 17
    slot = pool.load(ad)
    assert pool.pages_used == math.ceil(17 / R) == 3
    _check_round_trip(pool, slot, ad)


def test_reload_into_a_freed_slot_leaves_no_stale_rows():
    pool = _pool(num_pages=3)
    big = _uniform("big", 17, seed=1)
    slot = pool.load(big)
    pool.free(slot)
    small = _adapter("small", {(1, "k_proj"): 2}, seed=2)
    slot2 = pool.load(small)
    _check_round_trip(pool, slot2, small)  # modules of the old adapter read as rank 0
    assert pool.pages_used == 1


def test_rank_above_max_rank_is_refused_and_changes_nothing():
    pool = _pool(max_rank=16)
    pool.load(_uniform("ok", 4))
    before = _snapshot(pool)
    with pytest.raises(ValueError, match="max_rank"):
        pool.load(_uniform("too-big", 17))
    _assert_same(before, _snapshot(pool))


# ------------------------------------------------------------------------------------------- pool full
def test_pool_full_pages_leaves_state_unchanged():
    pool = _pool(num_pages=4)
    a = _uniform("a", 17, seed=1)  # 3 pages
    slot_a = pool.load(a)
    before = _snapshot(pool)
    with pytest.raises(PoolFullError, match="b"):
        pool.load(_uniform("b", 9, seed=2))  # needs 2, 1 free
    _assert_same(before, _snapshot(pool))
    _check_round_trip(pool, slot_a, a)
    c = _uniform("c", 8, seed=3)  # 1 page still fits
    slot_c = pool.load(c)
    assert pool.pages_free == 0
    _check_round_trip(pool, slot_c, c)
    _check_round_trip(pool, slot_a, a)


def test_pool_full_slots_leaves_state_unchanged():
    pool = _pool(num_pages=8, max_slots=2)
    pool.load(_uniform("a", 1, seed=1))
    pool.load(_uniform("b", 1, seed=2))
    assert pool.pages_free == 6
    before = _snapshot(pool)
    with pytest.raises(PoolFullError):
        pool.load(_uniform("c", 1, seed=3))
    _assert_same(before, _snapshot(pool))
    assert not pool.can_fit(_uniform("c", 1))


# ----------------------------------------------------------------------------------- address contract
def _docstring_offsets(config, page_rows):
    """offset_a / offset_b / page_elems exactly as the module docstring writes them."""
    S = [sum(config.module_shape(m)) for m in TARGET_MODULES]
    W = sum(S)

    def offset_a(layer, mi):
        return page_rows * (layer * W + sum(S[:mi]))

    def offset_b(layer, mi):
        return offset_a(layer, mi) + page_rows * config.module_shape(TARGET_MODULES[mi])[0]

    return S, W, offset_a, offset_b, page_rows * config.num_layers * W


def test_docstring_worked_example_smollm2_numbers():
    """The docstring's SmolLM2-135M example, with the shapes read from the embedded model's GGUF."""
    gguf = pytest.importorskip("gguf")
    from multilora.runtime.weights import config_from_gguf, default_model_path

    reader = gguf.GGUFReader(str(default_model_path()))
    emb = next(t for t in reader.tensors if t.name == "token_embd.weight")
    config = config_from_gguf(reader, int(emb.shape[-1]))
    assert (config.num_layers, config.hidden_size, config.q_size, config.kv_size, config.intermediate_size) == (
        30, 576, 576, 192, 1536)
    S, W, offset_a, offset_b, page_elems = _docstring_offsets(config, 8)
    assert S == [1152, 768, 768, 1152, 2112, 2112, 2112]
    assert W == 10176 and page_elems == 2_442_240
    k = TARGET_MODULES.index("k_proj")
    assert offset_a(1, k) == 90_624
    pool = AdapterPool(config, num_pages=1, page_rows=8, max_rank=64, dtype=torch.float32, device="meta")
    assert pool.page_elems == 2_442_240
    assert pool.page_bytes == 2_442_240 * 4 and round(pool.page_bytes / 1e6, 1) == 9.8
    assert pool.offset_a(1, "k_proj") == 90_624
    for layer in (0, 1, 17, 29):
        for mi, m in enumerate(TARGET_MODULES):
            assert pool.offset_a(layer, m) == offset_a(layer, mi)
            assert pool.offset_b(layer, m) == offset_b(layer, mi)
    # the example's element range: page_table[slot] = [5, 2, ...], k_proj A row j = 11 of layer 1
    j, page_table = 11, [5, 2]
    start = page_table[j // 8] * page_elems + offset_a(1, k) + (j % 8) * 576
    assert start == 2 * 2_442_240 + 90_624 + 3 * 576


@pytest.mark.parametrize("page_rows", [8, 3])
def test_element_addresses_follow_the_docstring(page_rows):
    pool = AdapterPool(CFG, num_pages=9, page_rows=page_rows, max_rank=32)
    pool.load(_uniform("filler", 2 * page_rows, seed=9))  # so the tested adapter's pages are not 0, 1, ...
    ranks = {(layer, m): r for layer, (m, r) in enumerate([("q_proj", 17), ("down_proj", 5), ("v_proj", 11)])}
    ranks[(0, "gate_proj")] = 2 * page_rows + 1
    ad = _adapter("x", ranks, seed=4)
    slot = pool.load(ad)
    _, _, offset_a, offset_b, page_elems = _docstring_offsets(CFG, page_rows)
    assert pool.page_elems == page_elems
    flat = pool.buffer.reshape(-1)
    table = pool.page_table[slot].long()
    for (layer, m), w in ad.modules.items():
        d_in, d_out = CFG.module_shape(m)
        mi = TARGET_MODULES.index(m)
        j = torch.arange(w.rank)
        base = table[j // page_rows] * page_elems
        a_addr = base[:, None] + offset_a(layer, mi) + (j % page_rows)[:, None] * d_in + torch.arange(d_in)[None, :]
        b_addr = base[None, :] + offset_b(layer, mi) + (j % page_rows)[None, :] * d_out + torch.arange(d_out)[:, None]
        assert torch.equal(flat[a_addr], w.a), (layer, m)  # A[j, k]
        assert torch.equal(flat[b_addr], w.b), (layer, m)  # B[n, j]
        assert pool.scalings[layer, mi, slot] == pytest.approx(w.scaling)


# ----------------------------------------------------------------------------------- random sequences
TINY = ModelConfig(vocab_size=8, hidden_size=4, intermediate_size=6, num_layers=1, num_heads=2, num_kv_heads=1)

ops = st.lists(
    st.one_of(
        st.tuples(st.just("load"), st.integers(1, 20)),
        st.tuples(st.just("free"), st.integers(0, 1000)),
    ),
    min_size=1, max_size=40,
)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=ops, page_rows=st.sampled_from([1, 4, 8]), num_pages=st.integers(1, 12), max_slots=st.integers(1, 6))
def test_random_load_free_sequences(ops, page_rows, num_pages, max_slots):
    pool = AdapterPool(TINY, num_pages=num_pages, page_rows=page_rows, max_rank=20, max_slots=max_slots)
    live: dict[int, LoRAAdapter] = {}  # slot -> adapter (the model of the pool)
    for n, (op, arg) in enumerate(ops):
        if op == "load":
            ad = _adapter(f"a{n}", {(0, "q_proj"): arg, (0, "down_proj"): max(1, arg // 2)}, seed=n, config=TINY)
            need = math.ceil(arg / page_rows)
            fits = len(live) < max_slots and need <= num_pages - sum(len(pool.pages_of(s)) for s in live)
            if fits:
                slot = pool.load(ad)
                assert slot not in live and 0 <= slot < max_slots
                assert len(pool.pages_of(slot)) == need
                live[slot] = ad
            else:
                before = _snapshot(pool)
                with pytest.raises(PoolFullError):
                    pool.load(ad)
                _assert_same(before, _snapshot(pool))
        elif live:
            slot = sorted(live)[arg % len(live)]
            pool.free(slot)
            del live[slot]
        _assert_invariants(pool)
        assert sorted(live) == pool.resident_slots()
        assert pool.pages_used == sum(math.ceil(a.max_rank / page_rows) for a in live.values())
        for slot, ad in live.items():  # no load ever overwrote another adapter's pages
            for (layer, m), w in ad.modules.items():
                a, b, _ = read_module(pool, slot, layer, m)
                assert torch.equal(a, w.a) and torch.equal(b, w.b)
