"""Adapter memory: no leak while serving many distinct adapters through a small pool, exact reloads, and
changed adapter files (issue 4's memory regression and tier tests).

- 200 distinct adapters through a pool sized for 4, a host tier for 8, each used by requests: after a
  warm-up of 20 adapters the bytes the runtime holds grow by less than 1 MB in total. On the CPU they are
  counted as every live torch tensor storage reachable from ``gc.get_objects()`` (de-duplicated by
  ``untyped_storage().data_ptr()``); on a GPU as ``torch.cuda.memory_allocated``. (A known peer bug kept an
  unused device copy of every loaded adapter in a list that only grew.)
- An adapter evicted gpu -> host, and host -> disk, and loaded again, gives bit-identical logits.
- An adapter whose files changed after its host copy was evicted fails its request (finish_reason "error",
  the message names the path) and leaves the other requests untouched.

The tiny model has a small vocabulary and no tokenizer (prompts are token ids), and runs on one thread.
"""

from __future__ import annotations

import gc
import shutil

import pytest
import torch

transformers = pytest.importorskip("transformers")

from multilora import Engine  # noqa: E402
from multilora.memory.pool import host_footprint  # noqa: E402
from multilora.runtime.adapter_cache import files_fingerprint  # noqa: E402
from multilora.config import TARGET_MODULES  # noqa: E402
from testsupport import write_adapter as _write_adapter  # noqa: E402
from testsupport import one_thread  # noqa: E402,F401 (autouse fixture)
from testsupport import tiny_llama_dir, greedy as _greedy, token_ids  # noqa: E402

VOCAB = 1024
MAX_SEQ = 16
N_ADAPTERS, WARMUP, CHUNK = 200, 20, 10
POOL_ADAPTERS, HOST_ADAPTERS = 4, 8
MB = 1 << 20
MODULE_SETS = [("q_proj", "v_proj"), ("k_proj", "o_proj", "down_proj"), TARGET_MODULES, ("gate_proj", "up_proj")]

def _ids(n, seed):
    return token_ids(n, seed, VOCAB)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(model dir, [200 adapter dirs], fp32 bytes of the largest adapter image): a tiny random GQA Llama (as in
    test_engine_behaviour.py, with a small vocabulary and no tokenizer) and rank-4/8 adapters on module subsets
    (the largest, rank 8 on every module, is the largest adapter max_lora_rank=8 allows)."""
    d = tiny_llama_dir(tmp_path_factory, VOCAB)
    probe = Engine(model=str(d), device="cpu", progress=False, max_batch_size=1, max_seq_len=MAX_SEQ, max_lora_rank=8,
                   adapter_slots=1)
    root = tmp_path_factory.mktemp("memory-adapters")
    dirs = [_write_adapter(root / f"ad{i:03d}", probe.config, 1000 + i, 4 if i % 3 == 0 else 8, MODULE_SETS[i % 4])
            for i in range(N_ADAPTERS)]
    return d, dirs, probe.pool.max_adapter_pages * probe.pool.page_bytes


def _engine(tiny, *, pool_adapters, host_adapters, device="cpu", **kw):
    """An engine whose pool holds ``pool_adapters`` adapters (slots; bytes for that many of the largest) and whose
    host tier the bytes of ``host_adapters`` of the largest."""
    d, _, fp32_unit = tiny
    dtype = torch.float32 if device == "cpu" else torch.bfloat16  # the engine's defaults
    unit = fp32_unit // 4 * dtype.itemsize
    kw.setdefault("max_batch_size", 4)
    return Engine(model=str(d), device=device, dtype=dtype, progress=False, max_seq_len=MAX_SEQ, max_lora_rank=8,
                  adapter_slots=pool_adapters, adapter_pool_bytes=pool_adapters * unit,
                  host_adapter_bytes=host_adapters * unit, **kw)


def live_tensor_bytes(device: str = "cpu") -> int:
    """Bytes of every distinct live tensor storage on ``device`` that the garbage collector can reach."""
    gc.collect()
    storages = {}
    for obj in gc.get_objects():
        try:
            if not issubclass(type(obj), torch.Tensor) or obj.device.type != device:
                continue
            st = obj.untyped_storage()
            ptr = st.data_ptr()
            if ptr:
                storages[ptr] = max(storages.get(ptr, 0), st.nbytes())
        except Exception:  # tensors without storage (sparse, functional wrappers): not the runtime's bytes
            continue
    return sum(storages.values())


# ------------------------------------------------------------------------------- the memory regression
def _serve_many(tiny, engine, measure, device):
    """Load the 200 adapters ten at a time and serve each (plus base requests and some earlier adapters);
    check budgets after every step; return (held bytes after warm-up, at the end)."""
    _, dirs, _ = tiny
    budget = engine.cache.host_budget
    baseline = None
    g = torch.Generator().manual_seed(7)
    for start in range(0, N_ADAPTERS, CHUNK):
        names = [f"ad{i:03d}" for i in range(start, start + CHUNK)]
        for i, name in zip(range(start, start + CHUNK), names):
            engine.load_adapter(name, dirs[i])
            assert engine.cache.host_bytes <= budget
        again = [f"ad{int(i):03d}" for i in torch.randint(0, start + CHUNK, (3,), generator=g)]
        reqs = [engine.add_request(_ids(3 + k % 4, start + k), a, _greedy(2))
                for k, a in enumerate(names + again + [None])]
        for _ in range(200):
            if not engine.has_unfinished():
                break
            engine.step()
            assert engine.cache.host_bytes <= budget, (engine.cache.host_bytes, budget)
            assert engine.pool.pages_used <= engine.pool.num_pages
            assert engine.pool.slots_used <= POOL_ADAPTERS
        assert not engine.has_unfinished()
        assert [r.finish_reason for r in reqs] == ["length"] * len(reqs), [r.error for r in reqs if r.error]
        if start + CHUNK == WARMUP:
            baseline = measure()
    return baseline, measure()


def test_200_adapters_through_a_pool_for_4_hold_no_extra_bytes_cpu(tiny):
    engine = _engine(tiny, pool_adapters=POOL_ADAPTERS, host_adapters=HOST_ADAPTERS)
    assert engine.pool.max_slots == POOL_ADAPTERS and engine.pool.num_pages == POOL_ADAPTERS * engine.pool.max_adapter_pages
    # the measure sees a leak of the size we look for
    before = live_tensor_bytes()
    leak = [torch.ones(MB // 4)]
    assert live_tensor_bytes() - before >= MB
    del leak

    baseline, end = _serve_many(tiny, engine, live_tensor_bytes, "cpu")
    grown = end - baseline
    assert grown < MB, f"the runtime holds {grown / MB:.2f} MB more after serving 180 more adapters"
    s = engine.stats()
    assert s["adapters_loaded"] == N_ADAPTERS
    assert s["gpu_evictions"] >= N_ADAPTERS - POOL_ADAPTERS and s["host_evictions"] > 0
    assert s["adapters_per_tier"]["gpu"] <= POOL_ADAPTERS
    assert s["host_tier_bytes"] <= s["host_tier_budget"]
    engine.cache.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (runs on the device machine)")
def test_200_adapters_through_a_pool_for_4_hold_no_extra_bytes_cuda(tiny):
    engine = _engine(tiny, pool_adapters=POOL_ADAPTERS, host_adapters=HOST_ADAPTERS, device="cuda")
    assert engine.pool.max_slots == POOL_ADAPTERS and engine.pool.num_pages == POOL_ADAPTERS * engine.pool.max_adapter_pages

    def allocated():
        torch.cuda.synchronize()
        gc.collect()
        return torch.cuda.memory_allocated()

    baseline, end = _serve_many(tiny, engine, allocated, "cuda")
    grown = end - baseline
    assert grown < MB, f"torch.cuda.memory_allocated grew by {grown / MB:.2f} MB over 180 more adapters"
    s = engine.stats()
    assert s["gpu_evictions"] >= N_ADAPTERS - POOL_ADAPTERS and s["host_tier_bytes"] <= s["host_tier_budget"]
    # host copies are pinned, in the host arena, each counted as exactly its bytes (no power-of-two rounding)
    copies = [h.host for h in engine.cache._host_lru.values() if h.host is not None]
    assert copies and all(c.data.is_pinned() and c.block is not None for c in copies)
    assert all(c.footprint == c.nbytes for c in copies) and s["host_arena_pinned"] is True
    assert sum(c.footprint for c in copies) <= engine.cache.host_budget
    engine.cache.close()


def test_host_footprint_rounds_pinned_blocks_to_powers_of_two():
    """What torch's caching host allocator would pin (the host tier no longer uses it: tests/test_adapter_tiers.py)."""
    assert host_footprint(84_000_000, pinned=True) == 1 << 27  # an 84 MB Llama-3-8B r=16 image pins 128 MiB
    assert host_footprint(84_000_000, pinned=False) == 84_000_000
    assert host_footprint(1 << 20, pinned=True) == 1 << 20
    assert host_footprint((1 << 20) + 1, pinned=True) == 1 << 21
    assert host_footprint(0, pinned=True) == 0


# ------------------------------------------------------------------------------------- exact reloads
def test_evicted_then_reloaded_adapter_gives_bit_identical_logits(tiny):
    """gpu -> host (its host copy kept) -> gpu, then host -> disk -> gpu: the same logits, bit for bit."""
    _, dirs, _ = tiny
    engine = _engine(tiny, pool_adapters=1, host_adapters=2)  # one adapter resident, two on the host
    for name, i in (("x", 2), ("y", 14), ("z", 26)):
        engine.load_adapter(name, dirs[i])  # rank 8 on every module, different weights: images of one size
    prompts = [_ids(5, 1), _ids(9, 2)]
    x = engine.cache.get("x")
    want = engine.logits(prompts, adapters="x")
    assert x.tier == "gpu"
    base = engine.logits(prompts, adapters=None)
    assert not torch.equal(want, base)

    engine.logits(prompts, adapters="y")  # x leaves the pool; its host copy stays
    assert x.tier == "host"
    assert torch.equal(engine.logits(prompts, adapters="x"), want)

    engine.logits(prompts, adapters="y")  # x leaves the pool again ...
    engine.logits(prompts, adapters="z")  # ... and z's host copy pushes x's out (LRU): x is on disk only
    assert x.tier == "disk"
    misses = engine.stats()["host_misses"]
    assert torch.equal(engine.logits(prompts, adapters="x"), want)
    assert engine.stats()["host_misses"] == misses + 1  # read from its files
    assert torch.equal(engine.logits(prompts, adapters=None), base)
    ref = _engine(tiny, pool_adapters=8, host_adapters=8)
    ref.load_adapter("x", dirs[2])
    assert torch.equal(ref.logits(prompts, adapters="x"), want)  # as on an engine that never evicted it
    engine.cache.close()
    ref.cache.close()


def test_adapter_copied_back_gpu_to_host_gives_bit_identical_logits(tiny):
    """An adapter whose host copy was dropped while it was resident is copied back (gpu -> host) when
    evicted; loaded again from that copy it gives the same logits. (Regression: on a CPU pool ``unpack``
    returned views of the pool's ranks / scalings, which the next load into the slot overwrote.)"""
    _, dirs, _ = tiny
    engine = _engine(tiny, pool_adapters=1, host_adapters=2)  # one adapter resident, two on the host
    prompts = [_ids(5, 1), _ids(9, 2)]
    engine.load_adapter("x", dirs[2])  # these three: every module at rank 8, images of one size
    x = engine.cache.get("x")
    want = engine.logits(prompts, adapters="x")
    engine.load_adapter("a", dirs[14])
    engine.load_adapter("b", dirs[26])  # the host tier keeps a, b: x's host copy leaves while x is resident
    assert x.tier == "gpu" and x.host is None
    engine.unload_adapter("b")  # room for one copy on the host
    moved = engine.stats()["bytes_gpu_to_host"]
    engine.logits(prompts, adapters="a")  # x leaves the pool: its image is copied back to the host
    assert x.tier == "host" and engine.stats()["bytes_gpu_to_host"] > moved
    assert torch.equal(engine.logits(prompts, adapters="x"), want)
    engine.cache.close()


# ---------------------------------------------------------------------------------- changed files
def test_adapter_files_changed_after_host_eviction_fail_only_its_request(tiny, tmp_path):
    _, dirs, _ = tiny
    path = tmp_path / "x"
    shutil.copytree(dirs[1], path)
    engine = _engine(tiny, pool_adapters=1, host_adapters=1, max_batch_size=3)
    engine.load_adapter("x", path)
    engine.load_adapter("y", dirs[2])
    engine.load_adapter("w", dirs[5])  # x's host copy leaves (the host tier holds one adapter)
    x = engine.cache.get("x")
    assert x.tier == "disk"
    batch = [(_ids(4, 11), "x"), (_ids(6, 12), None), (_ids(5, 13), "y"), (_ids(4, 11), None), (_ids(6, 12), "w"),
             (_ids(5, 13), "x")]
    want = {i: engine.generate([p], adapters=[a], sampling=_greedy(4))[0].token_ids
            for i, (p, a) in enumerate(batch) if a != "x"}
    assert x.tier == "disk"

    _write_adapter(path, engine.config, 999, 8, MODULE_SETS[0])  # other weights, same shapes
    assert files_fingerprint(path) != x.fingerprint

    outs = engine.generate([p for p, _ in batch], adapters=[a for _, a in batch], sampling=_greedy(4))
    for i, o in enumerate(outs):
        if batch[i][1] == "x":
            assert o.finish_reason == "error" and o.token_ids == [], (o.finish_reason, o.token_ids)
            assert str(path) in o.error, o.error
            # which files changed and how (save_peft_adapter replaces both by rename), and what tier it lost
            assert "adapter_config.json: replaced by another file" in o.error, o.error
            assert "adapter_model.safetensors: replaced by another file" in o.error, o.error
            assert "its host copy was evicted" in o.error, o.error
        else:
            assert (o.finish_reason, o.error) == ("length", None)
            assert o.token_ids == want[i]
    s = engine.stats()
    assert s["adapter_load_failures"] >= 1 and s["running"] == s["waiting"] == 0
    assert engine.kv.num_free_blocks == engine.kv.num_usable_blocks and engine.pool.pages_used <= engine.pool.num_pages
    assert x.refcount == 0 and x.queued == 0

    engine.load_adapter("x", path)  # loading it again serves the new files
    ref = _engine(tiny, pool_adapters=4, host_adapters=4)
    ref.load_adapter("x", path)
    p = batch[0][0]
    assert engine.generate([p], adapters=["x"], sampling=_greedy(4))[0].token_ids == \
        ref.generate([p], adapters=["x"], sampling=_greedy(4))[0].token_ids
    engine.cache.close()
    ref.cache.close()
