"""An engine with ``unified_pool=True`` (memory/unified.py) end to end on a tiny model, against engines with a fixed
pool and KV cache (the reference: a request run alone on an engine that never runs short).

- Random requests (greedy and seeded sampling, six adapters, two waves) through a unified memory too small for
  their KV and adapters at once: KV blocks are taken back from the pool (idle adapters evicted) and the pool grows
  again; every request finishes with the tokens it gets alone, every block and reference comes back, and the
  buffer's bytes never change.
- At equal memory, a unified engine keeps more adapters resident than a fixed split: a second pass over six
  adapters at low load moves nothing host -> GPU, where the fixed pool evicts and copies again.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from test_kv_cache import (ADAPTERS, MAX_BATCH, MAX_PREFILL, MAX_SEQ, VOCAB, _check_kv, _kv_bytes,  # noqa: F401
                           _sampling, alone, run_waves, tiny)
from multilora.memory.pool import PAGE_ELEMS, max_adapter_pages

BS = 4
UNIT = 2 * 2 * BS * 2 * 16 * 4  # a KV block of the tiny model (2 layers, 2 KV heads of 16, fp32) over all layers
NAMES = {f"{n}{i}": n for n in ADAPTERS for i in (1, 2)}  # six adapters, each name its own to every tier


def _unified(tiny, *, pool_units, kv_blocks, **kw):
    from multilora import Engine

    d, dirs = tiny
    e = Engine(model=str(d), device="cpu", progress=False, max_seq_len=MAX_SEQ, max_lora_rank=8, kv_block_size=BS,
               adapter_pool_bytes=pool_units * UNIT, kv_cache_bytes=_kv_bytes(kv_blocks, BS), **kw)
    for name, src in NAMES.items():
        e.load_adapter(name, dirs[src])
    return e


def test_min_pool_is_the_largest_adapter_in_whole_units(tiny):
    e = _unified(tiny, pool_units=40, kv_blocks=12, unified_pool=True, max_batch_size=2)
    min_units = -(-max_adapter_pages(e.config, 8) * PAGE_ELEMS * 4 // UNIT)
    u = e.unified
    assert (u.unit_bytes, u.layout.num_units, u.layout.min_pool_units) == (UNIT, 53, min_units)
    assert u.layout.max_floor == 53 - MAX_SEQ // BS and e.kv.max_usable_blocks == 53 - 1 - min_units
    assert e.pool.bytes_total == 40 * UNIT and e.kv.num_usable_blocks == 12
    e.cache.close()
    # the smallest buffer: the largest adapter (29 units), 2 KV blocks and the null block: a request longer than
    # the KV side can ever hold is refused at submission, naming both sizes
    small = _unified(tiny, pool_units=min_units, kv_blocks=2, unified_pool=True, max_batch_size=2)
    assert small.kv.max_usable_blocks == 2
    with pytest.raises(ValueError, match=r"need 6 KV blocks of 4 tokens; the whole KV cache has 2: .* raise "
                                         r"kv_cache_bytes or adapter_pool_bytes \(with unified_pool they size one "
                                         r"buffer\)"):
        small.add_request(list(range(3, 23)), None, _sampling("greedy", 4, 0))
    small.cache.close()


REQUEST = st.tuples(
    st.lists(st.integers(3, VOCAB - 1), min_size=1, max_size=20),  # prompt
    st.sampled_from([None, *NAMES]),
    st.integers(1, 16),  # max_tokens
    st.sampled_from(["greedy", "seeded"]),
    st.integers(0, 2**16),  # seed
)


def test_random_requests_through_a_small_unified_memory_finish_as_alone(tiny, alone):
    # 36 pool units (the largest adapter needs 29; the six adapters 42) + 13 KV units (12 blocks and the null
    # block): a batch of four requests of up to 36 tokens (9 blocks each) takes blocks back from the pool
    engine = _unified(tiny, pool_units=36, kv_blocks=12, unified_pool=True, max_batch_size=MAX_BATCH,
                      max_prefill_tokens=MAX_PREFILL)
    u, sch = engine.unified, engine.scheduler
    nbytes, ptr = u.arena.numel() * u.arena.element_size(), u.arena.data_ptr()

    def check():
        _check_kv(engine)
        assert 1 + u.layout.min_pool_units <= u.floor <= u.layout.max_floor
        assert engine.pool.num_pages == (u.floor - 1) * u.layout.pages_per_unit
        for h in engine.cache.handles():  # an adapter in use is resident
            assert h.refcount == 0 or h.slot is not None
        assert u.arena.data_ptr() == ptr and u.arena.numel() * u.arena.element_size() == nbytes

    moves = []

    @settings(max_examples=12, deadline=None, database=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow])
    @given(first=st.lists(REQUEST, min_size=3, max_size=8), later=st.lists(REQUEST, max_size=4),
           steps_between=st.integers(0, 6))
    def run(first, later, steps_between):
        reqs = run_waves(engine, first, later, steps_between, check)
        for req, p, a, sp in reqs:
            assert (req.finish_reason, req.error) == ("length", None)
            assert req.output_ids == alone(p, NAMES.get(a), sp), f"{a!r} after {req.preemptions} preemption(s)"
        assert engine.kv.num_free_blocks == engine.kv.num_usable_blocks and not engine.kv.allocator.owners()
        assert all(engine.cache.get(n).refcount == 0 and engine.cache.get(n).queued == 0 for n in NAMES)
        moves.append((u.moves_up, u.moves_down, engine.cache.stats.evictions_for_kv, sch.kv_reclaims))

    run()
    up, down, evicted, reclaims = moves[-1]
    assert up > 0 and down > 0, f"the boundary never moved both ways: {moves[-1]}"
    assert evicted > 0 and reclaims > 0, f"no adapter ever gave way to KV: {moves[-1]}"
    stats = engine.stats()
    assert stats["unified_floor_moves_down"] == down and stats["evictions_for_kv"] == evicted
    assert stats["kv_reclaims_from_pool"] == reclaims
    engine.cache.close()


def test_equal_memory_keeps_more_adapters_resident_than_a_fixed_split(tiny, alone):
    """30 pool units (29 hold the largest adapter; the six adapters need 42) and 40 KV blocks, one request at a
    time over the six adapters, twice: the unified pool grows into the idle KV blocks and holds all six, so the
    second pass copies nothing; the fixed pool evicts and copies again. Outputs are the same."""
    sp = _sampling("greedy", 4, 0)
    prompt = [5, 6, 7, 8]
    runs = {}
    for unified in (False, True):
        e = _unified(tiny, pool_units=30, kv_blocks=40, unified_pool=unified, max_batch_size=5)  # KV cap: 5 x 8 blocks
        outs = []
        for _ in range(2):
            before = e.stats()["bytes_host_to_gpu"]
            outs.append([e.generate([prompt], adapters=[n], sampling=sp)[0].token_ids for n in NAMES])
            moved = e.stats()["bytes_host_to_gpu"] - before
        runs[unified] = (outs, moved, len(e.stats()["adapters_resident"]), e.stats()["pool_bytes_total"])
        e.cache.close()
    want = [alone(prompt, src, sp) for src in NAMES.values()]
    assert all(o == want for o in runs[False][0] + runs[True][0])
    (_, moved_fixed, res_fixed, pool_fixed), (_, moved_unified, res_unified, pool_unified) = runs[False], runs[True]
    assert moved_unified == 0 and moved_fixed > 0, (moved_unified, moved_fixed)
    assert res_unified == len(NAMES) > res_fixed
    assert pool_fixed == 30 * UNIT < pool_unified


HAS_CUDA = torch.cuda.is_available()


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (runs on the device machine)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_unified_memory_on_gpu_gives_the_tokens_of_a_fixed_split(tiny, dtype):
    """On CUDA, with decode CUDA graphs and piecewise graphs (the defaults): the same greedy requests (six
    adapters and none, more than the memory holds at once: reclaims, evictions, compactions, preemptions) give
    the same tokens from a unified memory as from a fixed pool and KV cache of the same bytes. The kernels read
    the same values in the same order, through strided KV views and moved pool offsets."""
    from multilora import Engine, SamplingParams

    d, dirs = tiny
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, VOCAB, (int(n),), generator=g).tolist() for n in torch.randint(1, 21, (24,), generator=g)]
    names = [None, *NAMES]
    adapters = [names[i % len(names)] for i in range(len(prompts))]
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outs, stats = {}, {}
    for unified in (False, True):
        unit = UNIT * dtype.itemsize // 4  # UNIT is fp32's
        e = Engine(model=str(d), device="cuda", dtype=dtype, progress=False, max_seq_len=MAX_SEQ, max_lora_rank=8,
                   kv_block_size=BS, max_batch_size=MAX_BATCH, adapter_pool_bytes=36 * unit,
                   kv_cache_bytes=13 * unit, unified_pool=unified)  # as the CPU test: 36 pool units, 12 KV blocks
        for name, src in NAMES.items():
            e.load_adapter(name, dirs[src])
        res = e.generate(prompts, adapters=adapters, sampling=sp)
        assert all((r.finish_reason, r.error) == ("length", None) for r in res)
        outs[unified] = [r.token_ids for r in res]
        stats[unified] = e.stats()
        e.cache.close()
    assert outs[True] == outs[False]
    s = stats[True]
    assert s["unified_floor_moves_up"] + s["unified_floor_moves_down"] > 0, s
    assert s["graph_steps"] > 0, "decode steps replayed CUDA graphs"
