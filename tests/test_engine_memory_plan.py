"""The engine takes its adapter-pool, KV-cache and host-tier sizes from the memory plan (issue 5), on the
CPU here (host memory is the device) and with recorded snapshots replayed, so the sizes are exact."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from multilora import Engine  # noqa: E402
from multilora.memory.accounting import MemoryPlanError, MemorySnapshot  # noqa: E402
from multilora.memory.kv_cache import KVCache  # noqa: E402

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
    kv_token = KVCache.bytes_per_token(2, 2, 16, torch.float32)
    assert e.kv.num_rows == min(4, plan.kv_bytes // (kv_token * 128))
    # less memory never gives a bigger pool
    small = Engine(model=tiny_dir, progress=False, max_seq_len=128, max_batch_size=4,
                   memory_snapshot=_host_snapshot(256 * MiB))
    assert small.pool.num_pages <= e.pool.num_pages


def test_caps_only_lower_sizes(tiny_dir):
    snap = _host_snapshot(1 * GiB)
    free = Engine(model=tiny_dir, progress=False, max_seq_len=128, memory_snapshot=snap)
    page = free.pool.page_bytes
    capped = Engine(model=tiny_dir, progress=False, max_seq_len=128, memory_snapshot=snap,
                    adapter_pool_bytes=10 * page, kv_cache_bytes=2 * 128 * KVCache.bytes_per_token(2, 2, 16, torch.float32))
    assert capped.pool.num_pages == 10 and capped.kv.num_rows == 2
    huge = Engine(model=tiny_dir, progress=False, max_seq_len=128, memory_snapshot=snap, adapter_pool_bytes=1 << 50)
    assert huge.pool.num_pages == free.pool.num_pages  # a cap above the plan does not raise the size


def test_live_state_that_does_not_fit_raises_a_clear_error(tiny_dir):
    with pytest.raises(MemoryPlanError) as err:
        Engine(model=tiny_dir, progress=False, max_seq_len=512, memory_snapshot=_host_snapshot(4 * MiB))
    msg = str(err.value)
    assert "mem_available" in msg and "fit" in msg
