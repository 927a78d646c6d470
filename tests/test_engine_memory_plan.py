"""The engine takes its adapter-pool, KV-cache and host-tier sizes from the memory plan (issue 5), on the
CPU here (host memory is the device) and with recorded snapshots replayed, so the sizes are exact."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from multilora import Engine  # noqa: E402
from multilora.memory.accounting import MemoryPlanError, MemorySnapshot  # noqa: E402
from multilora.memory.kv_cache import PagedKVCache  # noqa: E402

GiB = 1 << 30
MiB = 1 << 20


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    torch.manual_seed(0)
    d = tmp_path_factory.mktemp("tiny-plan")
    transformers.LlamaForCausalLM(cfg).save_pretrained(str(d))
    return d


def _host_snapshot(mem_available: int) -> MemorySnapshot:
    meminfo = (f"MemTotal:       {16 * GiB // 1024} kB\nMemFree:        {mem_available // 1024} kB\n"
               f"MemAvailable:   {mem_available // 1024} kB\n")
    return MemorySnapshot(has_gpu=False, meminfo_text=meminfo)


def test_sizes_come_from_the_plan_of_this_machine(tiny_dir):
    e = Engine(model=tiny_dir, progress=False, max_seq_len=128, max_batch_size=4)
    plan = e.memory_plan
    assert plan is not None and plan.kind == "host"
    assert e.pool.bytes_total <= plan.adapter_pool_bytes
    assert e.pool.bytes_total > plan.adapter_pool_bytes - e.pool.page_bytes  # whole pages of the plan's share
    assert e.kv.nbytes <= plan.kv_bytes
    assert e.cache.host_budget == plan.host_tier_bytes


def test_replayed_snapshot_sets_exact_sizes(tiny_dir):
    snap = _host_snapshot(1 * GiB)
    e = Engine(model=tiny_dir, progress=False, max_seq_len=128, max_batch_size=4, memory_snapshot=snap)
    plan = e.memory_plan
    assert plan.usable_bytes == 1 * GiB and plan.usable_source == "mem_available"
    assert e.pool.num_pages == plan.adapter_pool_bytes // e.pool.page_bytes
    block = 16 * PagedKVCache.bytes_per_token(2, 2, 16, torch.float32)
    assert e.kv.block_bytes == block and e.kv.block_size == 16
    # the plan's KV bytes in whole blocks (the null block included), at most 4 sequences of 128 tokens + null
    assert e.kv.num_blocks == min(4 * 128 // 16 + 1, plan.kv_bytes // block)
    assert e.kv.nbytes <= plan.kv_bytes
    # less memory never gives a bigger pool
    small = Engine(model=tiny_dir, progress=False, max_seq_len=128, max_batch_size=4,
                   memory_snapshot=_host_snapshot(256 * MiB))
    assert small.pool.num_pages <= e.pool.num_pages


def test_caps_only_lower_sizes(tiny_dir):
    snap = _host_snapshot(1 * GiB)
    free = Engine(model=tiny_dir, progress=False, max_seq_len=128, memory_snapshot=snap)
    page, one = free.pool.page_bytes, free.pool.max_adapter_pages  # one = pages of the largest max-rank adapter
    capped = Engine(model=tiny_dir, progress=False, max_seq_len=128, memory_snapshot=snap,
                    adapter_pool_bytes=(one + 10) * page + 7,
                    kv_cache_bytes=2 * 128 * PagedKVCache.bytes_per_token(2, 2, 16, torch.float32))
    assert capped.pool.num_pages == one + 10 and capped.kv.num_blocks == 2 * 128 // 16  # the null block is one of them
    assert capped.kv.nbytes == 2 * 128 * PagedKVCache.bytes_per_token(2, 2, 16, torch.float32)
    huge = Engine(model=tiny_dir, progress=False, max_seq_len=128, memory_snapshot=snap, adapter_pool_bytes=1 << 50)
    assert huge.pool.num_pages == free.pool.num_pages  # a cap above the plan does not raise the size


def test_live_state_that_does_not_fit_raises_a_clear_error(tiny_dir):
    with pytest.raises(MemoryPlanError) as err:
        Engine(model=tiny_dir, progress=False, max_seq_len=512, memory_snapshot=_host_snapshot(4 * MiB))
    msg = str(err.value)
    assert "mem_available" in msg and "fit" in msg


def test_kv_blocks_follow_the_block_size_and_a_small_cap_is_honoured(tiny_dir):
    snap = _host_snapshot(1 * GiB)
    per_token = PagedKVCache.bytes_per_token(2, 2, 16, torch.float32)
    for bs in (1, 4, 16):
        e = Engine(model=tiny_dir, progress=False, max_seq_len=128, max_batch_size=3, kv_block_size=bs,
                   memory_snapshot=snap)
        assert e.kv.block_size == bs and e.kv.num_usable_blocks == 3 * 128 // bs  # the max_batch_size default cap
        assert e.stats()["kv_blocks_total"] == e.stats()["kv_blocks_free"] == e.kv.num_usable_blocks
    # a cap below one max_seq_len sequence: the engine starts, long requests are refused at submission
    e = Engine(model=tiny_dir, progress=False, max_seq_len=128, kv_block_size=4, memory_snapshot=snap,
               kv_cache_bytes=11 * 4 * per_token)
    assert e.kv.num_usable_blocks == 10
    with pytest.raises(ValueError, match="kv_cache_bytes=.*holds 1 KV block"):
        Engine(model=tiny_dir, progress=False, max_seq_len=128, kv_block_size=4, kv_cache_bytes=4 * per_token + 1)
    for bad in (0, 2.0, True):
        with pytest.raises(ValueError, match="kv_block_size must be an int >= 1"):
            Engine(model=tiny_dir, progress=False, max_seq_len=128, kv_block_size=bad)
