"""Pool and KV sizing (``runtime/sizing.py``) as the pure function it is: model shape + options + a recorded
memory snapshot in, pages and blocks out, with no model loaded and no machine measured. The byte sizes are
checked against formulas written here from the pool layout (``memory/pool.py``) and the KV layout
(``memory/kv_cache.py``); the engine's own sizes against the function's."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from multilora.config import TARGET_MODULES, ModelConfig
from multilora.memory.accounting import MemoryPlanError, MemorySnapshot
from multilora.runtime.config import EngineConfig
from multilora.runtime.sizing import measure_and_size, memory_request, size_engine
from multilora.runtime.weights import MODEL_SHAPES

GiB, MiB = 1 << 30, 1 << 20
TINY = ModelConfig(**MODEL_SHAPES["tiny"])
SMOL = ModelConfig(**MODEL_SHAPES["smollm2-135m"])


def _host(mem_available: int) -> MemorySnapshot:
    return MemorySnapshot(has_gpu=False, meminfo_text=f"MemTotal: {64 * GiB // 1024} kB\n"
                                                      f"MemAvailable: {mem_available // 1024} kB\n")


@pytest.mark.parametrize("cfg", [TINY, SMOL], ids=["tiny", "smollm2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_request_bytes_follow_the_layouts(cfg, dtype):
    ec = EngineConfig(max_batch_size=3, kv_block_size=4, max_lora_rank=20, page_rows=8)
    r = memory_request(cfg, ec, dtype=dtype, max_seq_len=50)
    e = torch.empty((), dtype=dtype).element_size()
    width = sum(sum(cfg.module_shape(m)) for m in TARGET_MODULES)  # A rows + B^T rows of every module
    assert r.page_bytes == 64 * e  # the pool's allocation unit: 64 elements
    # the largest rank-20 adapter: every module of every layer, its weights in whole 64-element pages per module
    assert r.pages_per_adapter == cfg.num_layers * sum(-(-20 * sum(cfg.module_shape(m)) // 64) for m in TARGET_MODULES)
    assert r.pages_per_adapter * r.page_bytes < (20 * width + 64 * len(TARGET_MODULES)) * cfg.num_layers * e
    assert r.module_width == width and r.dtype_bytes == e
    assert r.kv_token_bytes == 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * e
    assert r.block_bytes == 4 * r.kv_token_bytes and r.seq_blocks == 13  # ceil(50 / 4)
    assert r.kv_cap == (3 * 13 + 1) * r.block_bytes and r.pool_cap is None and r.live_blocks == 13
    assert r.sampling_bytes == 3 * cfg.vocab_size * (4 + 4 + 36)


def test_caps_lower_the_request():
    ec = EngineConfig(max_batch_size=3, kv_block_size=4, max_lora_rank=16, adapter_slots=2,
                      adapter_pool_bytes=10 ** 12, kv_cache_bytes=None)
    r = memory_request(TINY, ec, dtype=torch.float32, max_seq_len=64)
    assert r.pool_cap == 2 * r.pages_per_adapter * r.page_bytes  # adapter_slots binds before the byte cap
    small = memory_request(TINY, EngineConfig(kv_block_size=4, kv_cache_bytes=5 * r.block_bytes + 7),
                           dtype=torch.float32, max_seq_len=64)
    assert small.kv_cap == 5 * r.block_bytes + 7 and small.live_blocks == 4  # an explicit smaller cap is honoured
    with pytest.raises(ValueError, match="kv_cache_bytes=.* holds 1 KV block"):
        memory_request(TINY, EngineConfig(kv_block_size=4, kv_cache_bytes=r.block_bytes), dtype=torch.float32,
                       max_seq_len=64)


@settings(max_examples=40, deadline=None)
@given(avail=st.integers(64 * MiB, 8 * GiB), more=st.integers(0, 4 * GiB), batch=st.integers(1, 64),
       share=st.sampled_from([None, 0.05, 0.3]), pool_cap=st.sampled_from([None, 3 * MiB, 40 * MiB]))
def test_sizes_fit_the_plan_and_grow_with_memory(avail, more, batch, share, pool_cap):
    ec = EngineConfig(max_batch_size=batch, adapter_pool_share=share, adapter_pool_bytes=pool_cap, max_lora_rank=16)
    r = memory_request(SMOL, ec, dtype=torch.float32, max_seq_len=256)
    try:
        a = size_engine(r, ec, _host(avail), reserve_bytes=r.activation_bytes)
    except (MemoryPlanError, ValueError):
        return  # too little memory for one adapter and one sequence: refused, as the engine refuses it
    b = size_engine(r, ec, _host(avail + more), reserve_bytes=r.activation_bytes)
    for s in (a, b):
        assert s.num_pages * r.page_bytes <= s.plan.adapter_pool_bytes and s.num_pages >= r.pages_per_adapter
        assert s.num_blocks * r.block_bytes <= s.plan.kv_bytes and s.num_blocks >= 2
        assert s.num_blocks <= batch * r.seq_blocks + 1  # never more than max_batch_size sequences + null block
        assert pool_cap is None or s.num_pages * r.page_bytes <= pool_cap
    assert b.num_pages >= a.num_pages and b.num_blocks >= a.num_blocks


def test_without_a_snapshot_the_caps_alone_size_the_engine():
    ec = EngineConfig(max_lora_rank=16, kv_block_size=16, max_batch_size=2)
    r = memory_request(TINY, ec, dtype=torch.float32, max_seq_len=64)
    s = size_engine(r, ec, None, reserve_bytes=0)
    assert s.plan is None and s.host_bytes is None
    assert s.num_pages == 8 * r.pages_per_adapter  # 8 max-rank adapters when the pool has no cap
    assert s.num_blocks == 2 * 4 + 1
    tiny_pool = EngineConfig(max_lora_rank=16, adapter_pool_bytes=r.page_bytes)
    with pytest.raises(ValueError, match="below the largest adapter max_lora_rank=16 allows"):
        size_engine(memory_request(TINY, tiny_pool, dtype=torch.float32, max_seq_len=64), tiny_pool, None,
                    reserve_bytes=0)


def test_measure_and_size_replays_a_snapshot_and_the_engine_uses_its_sizes():
    from multilora import Engine

    snap = _host(1 * GiB)
    ec = EngineConfig(device="cpu", max_seq_len=128, max_batch_size=4, memory_snapshot=snap, progress=False)
    r = memory_request(TINY, ec, dtype=torch.float32, max_seq_len=128)
    want = size_engine(r, ec, snap, reserve_bytes=r.activation_bytes)
    got = measure_and_size(r, ec, torch.device("cpu"), profile_reserve=lambda: pytest.fail("CPU never profiles"))
    assert (got.num_pages, got.num_blocks, got.host_bytes) == (want.num_pages, want.num_blocks, want.host_bytes)
    e = Engine(TINY, config=ec)
    assert (e.pool.num_pages, e.kv.num_blocks, e.cache.host_budget) == (want.num_pages, want.num_blocks, want.host_bytes)


@pytest.mark.parametrize("replayed", [True, False], ids=["memory plan", "caps alone"])
def test_a_pool_cap_below_one_adapter_names_the_argument_and_the_formula(replayed):
    # Issue 15 item 12 / issue 12: adapter_pool_bytes a page short of the largest rank-16 adapter.
    probe = memory_request(TINY, EngineConfig(max_lora_rank=16), dtype=torch.float32, max_seq_len=64)
    need = probe.pages_per_adapter * probe.page_bytes
    ec = EngineConfig(max_lora_rank=16, page_rows=8, adapter_pool_bytes=need - probe.page_bytes + 7)
    r = memory_request(TINY, ec, dtype=torch.float32, max_seq_len=64)
    width = sum(sum(TINY.module_shape(m)) for m in TARGET_MODULES)
    per_layer = sum(-(-16 * sum(TINY.module_shape(m)) // 64) for m in TARGET_MODULES)
    assert need == TINY.num_layers * per_layer * 64 * 4
    # the largest rank whose largest adapter fits, computed independently
    fit = max(k for k in range(17) if TINY.num_layers * sum(-(-k * sum(TINY.module_shape(m)) // 64)
                                                        for m in TARGET_MODULES) * 256 <= ec.adapter_pool_bytes)
    assert r.pool_cap_rank == fit and 0 < fit < 16
    with pytest.raises(MemoryPlanError) as err:
        size_engine(r, ec, _host(1 * GiB) if replayed else None, reserve_bytes=0)
    msg = str(err.value)
    for words in (
        f"adapter_pool_bytes={ec.adapter_pool_bytes} is below the largest adapter max_lora_rank=16 allows",
        f"(rank 16 on all 7 target modules of all {TINY.num_layers} layers), which needs {need} bytes",
        f"layers {TINY.num_layers} x sum over the target modules of ceil(max_lora_rank 16 x (d_in + d_out) / 64) "
        f"{per_layer} pages x page bytes 256 (64 elements x dtype bytes 4)",
        f"its weight bytes, 16 x {width} x {TINY.num_layers} x 4 = {16 * width * TINY.num_layers * 4}",
        f"at least {need}", "Engine(adapter_pool_bytes=...)", "--adapter-pool-bytes",
        f"lower max_lora_rank to at most {fit}", "Engine(max_lora_rank=...)", "--max-lora-rank",
    ):
        assert words in msg, (words, msg)
    assert err.value.needed_bytes == need and err.value.fits_bytes == ec.adapter_pool_bytes
    assert isinstance(err.value, ValueError)


def test_the_engine_raises_the_same_for_its_keyword():
    from multilora import Engine

    r = memory_request(TINY, EngineConfig(max_lora_rank=16), dtype=torch.float32, max_seq_len=64)
    with pytest.raises(MemoryPlanError, match=r"adapter_pool_bytes=255 is below the largest adapter.*at least"):
        Engine(TINY, device="cpu", max_seq_len=64, max_lora_rank=16, memory_snapshot=_host(1 * GiB),
               adapter_pool_bytes=r.page_bytes - 1, progress=False)


# ------------------------------------------------------------------ defaults for thousands of adapters (issue 13)
LLAMA3 = ModelConfig(**MODEL_SHAPES["llama3-8b"])


def _h200(mem_available_gib: int = 110, memlock: int | None = None) -> MemorySnapshot:
    """An H200 host as the plan sees it after Llama-3-8B's 16 GB of weights: 125 of 140 GiB free on the GPU."""
    return MemorySnapshot(has_gpu=True, cuda_free_bytes=125 * GiB, cuda_total_bytes=140 * GiB,
                          meminfo_text=f"MemTotal: {128 * GiB // 1024} kB\nMemAvailable: {mem_available_gib * GiB // 1024} kB\n",
                          rlimit_memlock_bytes=memlock)


def _bytes_of(model, rank, modules, dtype_bytes=2):
    """An adapter's image bytes, from the pool layout: ceil(r (d_in + d_out) / 64) pages of 64 elements per module."""
    return model.num_layers * sum(-(-rank * sum(model.module_shape(m)) // 64) for m in modules) * 64 * dtype_bytes


def test_default_pool_slots_and_host_tier_hold_thousands_of_adapters():
    """The plan's defaults on an H200 for Llama-3-8B in bf16 (docs/memory.md, "Defaults for thousands of
    adapters"): pool = 0.1 x 0.9 x (free - reserve), slots = what it holds of rank-8 q/k/v/o adapters (S1),
    host tier = half of MemAvailable: 139 rank-16 all-module adapters (84 MB) or 857 S1 adapters (13.6 MB)
    resident, and 55 GiB of host tier: 704 rank-16 or 4,332 S1 adapters."""
    ec = EngineConfig(max_lora_rank=64)
    req = memory_request(LLAMA3, ec, dtype=torch.bfloat16, max_seq_len=2048)
    sizes = size_engine(req, ec, _h200(), reserve_bytes=4 * GiB)
    budget = (125 * GiB - 4 * GiB) * 9 // 10
    assert sizes.num_pages * req.page_bytes == (budget // 10) // req.page_bytes * req.page_bytes
    s1, r16 = _bytes_of(LLAMA3, 8, ("q_proj", "k_proj", "v_proj", "o_proj")), _bytes_of(LLAMA3, 16, TARGET_MODULES)
    assert s1 == 13_631_488 and r16 == 83_886_080
    pool = sizes.num_pages * req.page_bytes
    assert sizes.slots == min(4096, max(256, pool // s1)) == 857
    assert pool // r16 == 139
    assert sizes.host_bytes == 55 * GiB  # min(140 GiB, 110 / 2, no memlock bound)
    assert sizes.host_bytes // r16 == 704 and sizes.host_bytes // s1 == 4332
    # an explicit slot count is kept; a small pool keeps 256 slots at least
    assert size_engine(req, EngineConfig(max_lora_rank=64, adapter_slots=64), _h200(), reserve_bytes=4 * GiB).slots == 64
    tiny_req = memory_request(TINY, EngineConfig(), dtype=torch.float32, max_seq_len=64)
    assert size_engine(tiny_req, EngineConfig(), _host(1 * GiB), reserve_bytes=0).slots >= 256


def test_adapter_pool_fill_on_the_h200_defaults():
    """docs/memory.md's figures for ``adapter_pool_fill`` on that H200: the KV cache keeps its 16 sequences of 2,048
    tokens (+ the null block, 4 GiB), the pool takes the rest of the 108.9 GiB budget, ~105 GiB: 1,342 rank-16
    all-module adapters, and the slot cap of 4,096 S1 ones; the host tier is unchanged."""
    ec = EngineConfig(max_lora_rank=64, adapter_pool_fill=True)
    req = memory_request(LLAMA3, ec, dtype=torch.bfloat16, max_seq_len=2048)
    sizes = size_engine(req, ec, _h200(), reserve_bytes=4 * GiB)
    budget = (125 * GiB - 4 * GiB) * 9 // 10
    kv = (16 * 2048 // 16 + 1) * req.block_bytes
    assert req.block_bytes == 16 * 131072 and sizes.num_blocks * req.block_bytes == kv  # 4 GiB + one block
    pool = sizes.num_pages * req.page_bytes
    assert pool == (budget - kv) // req.page_bytes * req.page_bytes and round(pool / GiB) == 105
    plain = size_engine(req, EngineConfig(max_lora_rank=64), _h200(), reserve_bytes=4 * GiB)
    idle = plain.plan.budget_bytes - plain.plan.adapter_pool_bytes - plain.plan.kv_bytes  # budgeted, given to none
    assert plain.plan.kv_bytes == kv and round(idle / GiB) == 94
    assert pool // _bytes_of(LLAMA3, 16, TARGET_MODULES) == 1342 and sizes.slots == 4096
    assert sizes.host_bytes == plain.host_bytes == 55 * GiB


def test_memlock_bound_host_tier_is_explained():
    ec = EngineConfig(max_lora_rank=16)
    req = memory_request(LLAMA3, ec, dtype=torch.bfloat16, max_seq_len=2048)
    sizes = size_engine(req, ec, _h200(memlock=8 << 20), reserve_bytes=4 * GiB)
    assert sizes.host_bytes == (8 << 20) * 4 // 5 and sizes.plan.host_tier_source == "memlock"
    assert any("RLIMIT_MEMLOCK" in n and "--host-adapter-bytes" in n for n in sizes.plan.notes)
    free = size_engine(req, ec, _h200(), reserve_bytes=4 * GiB)
    assert not any("RLIMIT_MEMLOCK" in n for n in free.plan.notes)


def test_max_seq_len_up_to_the_models_context():
    """``default_max_seq_len``: a ``max_seq_len`` up to the model's context is taken, past it refused naming it;
    linear RoPE scaling's configs keep the original length in ``max_position_embeddings`` (context = it x factor),
    llama3's give the extended one."""
    import dataclasses

    from multilora.runtime.sizing import default_max_seq_len, model_context

    base = dataclasses.replace(TINY, max_position_embeddings=4096)
    linear = dataclasses.replace(base, rope_scaling={"rope_type": "linear", "factor": 4.0})
    llama3 = dataclasses.replace(base, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 512})
    assert (model_context(base), model_context(linear), model_context(llama3)) == (4096, 16384, 4096)
    assert default_max_seq_len(linear, EngineConfig(max_seq_len=16384), "cuda") == 16384
    assert default_max_seq_len(base, EngineConfig(), "cuda") == 2048 and default_max_seq_len(base, EngineConfig(),
                                                                                             "cpu") == 1024
    with pytest.raises(ValueError, match=r"^Engine: max_seq_len=16385 is past the model's context of 16384 tokens "
                                         r"\(max_position_embeddings=4096 x its linear RoPE factor in its config\)"):
        default_max_seq_len(linear, EngineConfig(max_seq_len=16385), "cuda")
    with pytest.raises(ValueError, match=r"^Engine: max_seq_len=4097 is past the model's context of 4096 tokens"):
        default_max_seq_len(llama3, EngineConfig(max_seq_len=4097), "cuda")
