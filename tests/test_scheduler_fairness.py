"""Scheduler fairness and many adapters end to end (issue 4).

- No starvation: with a pool for 2 adapters and a steady stream of requests for hot adapters A and B (new
  ones every step, so the queue never empties), one request for a cold adapter C is admitted within the
  bound of runtime/scheduler.py's docstring, ``(k + 1) * (patience + F + 1)`` steps after it arrives (k = requests
  ahead of it in the queue; F = max_seq_len unchunked, the chunked F with 6-token steps), and gives the same
  tokens as run alone.
- End to end: 50 adapters through a pool for 8 (and a host tier for 12), ~100 mixed requests (some for
  the base model) arriving in waves: every output equals its single-request reference; the stats show
  evictions and consistent traffic counters; a pinned adapter never leaves its slot.

The tiny model has a small vocabulary and no tokenizer (prompts are token ids), and runs on one thread.
"""

from __future__ import annotations

import math

import pytest
import torch

transformers = pytest.importorskip("transformers")

from multilora import Engine  # noqa: E402
from multilora.config import TARGET_MODULES  # noqa: E402
from multilora.runtime.scheduler import Status  # noqa: E402
from testsupport import write_adapter as _write_adapter  # noqa: E402
from testsupport import one_thread  # noqa: E402,F401 (autouse fixture)
from testsupport import tiny_llama_dir, greedy as _greedy, token_ids  # noqa: E402

VOCAB = 1024
MAX_SEQ = 16
N_ADAPTERS = 50
MODULE_SETS = [("q_proj", "v_proj"), ("k_proj", "o_proj", "down_proj"), TARGET_MODULES, ("gate_proj", "up_proj")]


def _ids(n, seed):
    return token_ids(n, seed, VOCAB)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(model dir, {name: adapter dir}, bytes of the largest adapter image): a tiny random GQA Llama (as in
    test_engine_behaviour.py, with a small vocabulary and no tokenizer) and 50 rank-4/8 adapters."""
    d = tiny_llama_dir(tmp_path_factory, VOCAB)
    probe = Engine(model=str(d), device="cpu", progress=False, max_batch_size=1, max_seq_len=MAX_SEQ, max_lora_rank=8,
                   adapter_slots=1)
    root = tmp_path_factory.mktemp("fairness-adapters")
    dirs = {f"ad{i:02d}": _write_adapter(root / f"ad{i:02d}", probe.config, 500 + i, 4 if i % 3 == 0 else 8,
                                         MODULE_SETS[i % 4])
            for i in range(N_ADAPTERS)}
    for name, path in dirs.items():
        probe.load_adapter(name, path, preload=False)
    return d, dirs, max(probe.cache.get(name).pool_bytes for name in dirs)


@pytest.fixture(scope="module")
def alone(tiny):
    """tokens(prompt, adapter, max_tokens): the request run alone on an engine that holds every adapter."""
    d, dirs, _ = tiny
    ref = Engine(model=str(d), device="cpu", progress=False, max_batch_size=1, max_seq_len=MAX_SEQ, max_lora_rank=8,
                 adapter_slots=N_ADAPTERS + 2)
    for name, path in dirs.items():
        ref.load_adapter(name, path)
    memo = {}

    def tokens(prompt, adapter, max_tokens):
        key = (tuple(prompt), adapter, max_tokens)
        if key not in memo:
            out = ref.generate([list(prompt)], adapters=[adapter], sampling=_greedy(max_tokens))[0]
            assert out.finish_reason == "length", out.error
            memo[key] = out.token_ids
        return memo[key]

    return tokens


# ---------------------------------------------------------------------------------------- starvation
@pytest.mark.parametrize("patience,chunked", [(0, True), (8, True), (8, False)])
def test_cold_adapter_is_admitted_within_the_bound_under_a_hot_stream(tiny, alone, patience, chunked):
    """patience 8: the stream overtakes C for a while (the scenario starves C without the bound); patience 0:
    C is urgent at its first skip, so nothing that arrived after it is admitted before it."""
    d, dirs, _ = tiny
    hot_a, hot_b, cold = "ad01", "ad02", "ad05"
    engine = Engine(model=str(d), device="cpu", progress=False, max_batch_size=4, max_seq_len=MAX_SEQ, max_lora_rank=8,
                    adapter_slots=2, starvation_patience=patience, enable_chunked_prefill=chunked,
                    max_num_batched_tokens=6)
    assert engine.pool.max_slots == 2  # A and B fill the pool's slots
    for name in (hot_a, hot_b, cold):
        engine.load_adapter(name, dirs[name])
    hot, n = [], 0

    def stream():  # two new hot requests every step: the queue never empties
        nonlocal n
        for name in (hot_a, hot_b):
            prompt = _ids(3, 100 + n)
            hot.append((engine.add_request(prompt, name, _greedy(4)), prompt, name))
            n += 1

    for _ in range(4):
        stream()
        engine.step()
    stream()
    k = len(engine.scheduler.waiting)  # requests ahead of C
    assert k > 0
    cold_prompt = _ids(5, 7)
    c = engine.add_request(cold_prompt, cold, _greedy(3))
    L, B = engine.max_seq_len, engine.max_batch_size
    F = math.ceil(B * L / min(4096, max(1, 6 - B))) + L if chunked else L  # steps a running request takes at most
    bound = (k + 1) * (engine.scheduler.patience + F + 1)

    steps = 0
    while c.status is Status.WAITING:
        assert steps < bound, f"C not admitted within the scheduler's bound of {bound} steps (k={k})"
        stream()
        engine.step()
        steps += 1
        assert len(engine.scheduler.waiting) > 0
    assert c.status is not Status.FINISHED or c.finish_reason != "error", c.error
    assert steps <= bound
    assert engine.stats()["queue_waits_for_adapter"] > 0  # C was passed over: its adapter did not fit
    overtaken = any(r.admit_time is not None and r.admit_time < c.admit_time and r.arrival > c.arrival
                    for r, _, _ in hot)
    assert overtaken == (patience > 0)

    while c.status is not Status.FINISHED:
        stream()
        engine.step()
    for _ in range(500):  # the stream stops; everything drains
        if not engine.has_unfinished():
            break
        engine.step()
    assert not engine.has_unfinished()
    assert (c.finish_reason, c.error) == ("length", None)
    assert c.output_ids == alone(cold_prompt, cold, 3)
    for r, prompt, name in hot[:: max(1, len(hot) // 12)]:  # a sample of the hot requests: also as alone
        assert r.finish_reason == "length" and r.output_ids == alone(prompt, name, 4)


# ----------------------------------------------------------------------------------------- end to end
def test_50_adapters_through_a_pool_for_8_every_output_as_alone(tiny, alone):
    d, dirs, image_bytes = tiny
    names = sorted(dirs)
    pinned = names[0]
    engine = Engine(model=str(d), device="cpu", progress=False, max_batch_size=10, max_seq_len=MAX_SEQ, max_lora_rank=8,
                    adapter_slots=8, host_adapter_bytes=12 * image_bytes, starvation_patience=4)
    assert engine.pool.max_slots == 8
    for name in names:
        engine.load_adapter(name, dirs[name])
    engine.pin_adapter(pinned)
    handle = engine.cache.get(pinned)
    slot = handle.slot
    assert slot is not None

    g = torch.Generator().manual_seed(3)
    plan = []  # (prompt, adapter, max_tokens): every adapter once, then random ones; ~15% for the base model
    for i in range(100):
        if i < N_ADAPTERS:
            adapter = names[i]
        elif int(torch.randint(0, 7, (1,), generator=g)) == 0:
            adapter = None
        else:
            adapter = names[int(torch.randint(0, N_ADAPTERS, (1,), generator=g))]
        plan.append((_ids(int(torch.randint(2, 9, (1,), generator=g)), 1000 + i), adapter,
                     int(torch.randint(1, 5, (1,), generator=g))))
    plan[10:10] = [(_ids(4, 77), None, 3), (_ids(6, 78), pinned, 4), (_ids(3, 79), None, 2)]
    order = torch.randperm(len(plan), generator=g).tolist()
    plan = [plan[i] for i in order]

    reqs = []
    budget = engine.cache.host_budget

    def step():
        engine.step()
        assert handle.slot == slot, "the pinned adapter left its slot"
        assert engine.pool.pages_used <= engine.pool.num_pages
        assert engine.cache.host_bytes <= budget
        assert len(engine.scheduler.running) <= 10

    for wave in range(0, len(plan), 20):  # requests arrive in waves while others run
        reqs += [engine.add_request(list(p), a, _greedy(n)) for p, a, n in plan[wave:wave + 20]]
        for _ in range(4):
            step()
    for _ in range(1000):
        if not engine.has_unfinished():
            break
        step()
    assert not engine.has_unfinished()

    for r, (p, a, n) in zip(reqs, plan):
        assert (r.finish_reason, r.error) == ("length", None), (a, r.error)
        assert r.output_ids == alone(p, a, n), f"request for {a!r} differs from its single-request reference"

    s = engine.stats()
    assert s["gpu_evictions"] > 0 and s["host_evictions"] > 0
    assert s["queue_waits_for_adapter"] > 0  # 10 running requests, 8 slots: requests waited for the pool
    assert s["bytes_host_to_gpu"] > 0 and s["bytes_disk_to_host"] > 0
    for key in ("prefetch_to_gpu", "prefetch_to_host", "prefetch_hits"):
        assert isinstance(s[key], int) and s[key] >= 0, key
    # each host -> gpu copy moves one adapter image, each stored disk -> host read one image, whole pages each
    page, small = engine.pool.page_bytes, min(engine.cache.get(n).pool_bytes for n in names)
    copies = s["gpu_misses"] + s["prefetch_to_gpu"]
    assert copies * small <= s["bytes_host_to_gpu"] <= copies * image_bytes and s["bytes_host_to_gpu"] % page == 0
    reads = s["host_misses"] - s["adapter_load_failures"] + s["prefetch_to_host"]
    assert reads * small <= s["bytes_disk_to_host"] <= reads * image_bytes and s["bytes_disk_to_host"] % page == 0
    assert s["bytes_gpu_to_host"] % page == 0 and s["bytes_gpu_to_host"] <= s["gpu_evictions"] * image_bytes
    assert s["gpu_misses"] + s["prefetch_to_gpu"] >= N_ADAPTERS  # each adapter came up at least once
    assert s["prefetch_hits"] <= s["prefetch_to_gpu"] + s["prefetch_to_host"]
    assert s["adapter_load_failures"] == 0
    assert sum(s["adapters_per_tier"].values()) == s["adapters_loaded"] == N_ADAPTERS
    assert s["adapters_per_tier"]["gpu"] <= 8 and pinned in s["adapters_resident"]
    assert s["requests_finished"] == len(plan) and s["requests_failed"] == 0
    assert engine.kv.num_free_blocks == engine.kv.num_usable_blocks
    assert all(engine.cache.get(nm).refcount == 0 for nm in names)
    engine.cache.close()
