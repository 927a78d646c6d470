"""Stateful (hypothesis RuleBasedStateMachine) test of pool + adapter cache + scheduler on a real tiny Engine.

Random loads (each name from one of two pre-written directories: its two versions), unloads, pins and
unpins, requests (a loaded adapter or None, a short token-id prompt, greedy, 1-3 tokens) and steps run
against an engine whose pool holds 3 "units" (a unit: the bytes of a rank-8 adapter on every module; the pool
then holds exactly one rank-24 adapter on every module, the largest max_lora_rank=24 allows) and whose host tier
holds 2 units. Each adapter takes exactly its image (rank x (d_in + d_out) per module it targets), so partial
adapters pack densely and churn leaves holes that the pool compacts away. After every rule the bookkeeping is checked against the pool, the
cache's handles, the scheduler and the KV cache; at teardown every request must finish, and every output
that is not an error must equal the same request run alone on a reference engine (big pool, the request's
adapter version loaded). The only error the design allows here is the scheduler's "can never fit": the
request's adapter needs more bytes than the pool holds besides the *other* pinned adapters
(runtime/scheduler.py docstring). The adapter files never change here, so no "files changed" error may occur.
A variant runs the same machine with a KV cache of a few blocks, so requests are preempted (their blocks and
adapter references taken back, recomputed later) in between loads, reloads, unloads and pins.

Host tier rule (runtime/adapter_cache.py, ``_enforce_host_budget(keep=...)``): the copy just added or read
is never dropped by the budget, so ``host_bytes`` may exceed the budget, but only when that one copy is
all the host tier holds (a rank-24 adapter may exceed the 2-unit budget). The module docstring states a
plain bound ("bounded by host_bytes"); this exception is the code's.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hypothesis import HealthCheck, seed, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.stateful import (  # noqa: E402
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
    run_state_machine_as_test,
)

from multilora import Engine  # noqa: E402
from multilora.memory.kv_cache import PagedKVCache  # noqa: E402
from multilora.memory.pool import PoolFullError, max_adapter_pages  # noqa: E402
from multilora.runtime.adapter_cache import files_fingerprint  # noqa: E402
from multilora.config import TARGET_MODULES  # noqa: E402
from multilora.runtime.scheduler import Status  # noqa: E402
from testsupport import write_adapter as _write_adapter  # noqa: E402
from testsupport import one_thread  # noqa: E402,F401 (autouse fixture)
from testsupport import tiny_llama_dir, greedy as _greedy  # noqa: E402

VOCAB = 1024
ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
# name -> its two versions (seed, rank, target modules); bytes: rank x the (d_in + d_out) of its modules
VERSIONS = {
    "a": [(11, 8, ("q_proj", "v_proj")), (12, 8, ("q_proj", "v_proj"))],
    "b": [(21, 8, TARGET_MODULES), (22, 4, ("k_proj", "o_proj"))],
    "c": [(31, 16, ATTN), (32, 16, MLP)],
    "d": [(41, 8, ("v_proj", "down_proj")), (42, 24, ("q_proj", "down_proj"))],
}
POOL_PAGES, HOST_PAGES, MAX_BATCH, MAX_SEQ, PATIENCE = 3, 2, 3, 16, 2
NEVER_FITS = "more than the adapter pool holds besides pinned adapters"
STEPS = st.integers(0, 2)  # engine steps run before a rule's action (interleaving without a separate step rule)
DRAIN_STEPS = 2000  # teardown: above 4 steps for each of the <= 120 requests even if served one at a time
KV_BLOCK, KV_BLOCKS = 1, 10  # the preemption variant: 10 token positions for up to 3 requests of up to 9 tokens
PREEMPTIONS: list[int] = []  # preemptions of each finished example of the preemption variant


# ------------------------------------------------------------------------------ tiny model and adapters
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(model dir, {name: [dir of version 0, dir of version 1]}, unit bytes) of a tiny random GQA Llama (a unit:
    a rank-8 adapter on every module, what one page of the old fixed-page pool held).

    As in test_engine_behaviour.py, but with a small vocabulary and no tokenizer: prompts are token ids, and
    every Engine would read the tokenizer again (~0.4 s each; this file builds dozens of engines)."""
    d = tiny_llama_dir(tmp_path_factory, VOCAB)
    probe = Engine(model=str(d), device="cpu", progress=False, max_batch_size=1, max_seq_len=MAX_SEQ, max_lora_rank=24,
                   adapter_slots=1)
    root = tmp_path_factory.mktemp("stateful-adapters")
    dirs = {n: [_write_adapter(root / f"{n}{v}", probe.config, *spec) for v, spec in enumerate(specs)]
            for n, specs in VERSIONS.items()}
    return d, dirs, max_adapter_pages(probe.config, 8) * probe.pool.page_bytes


@pytest.fixture(scope="module")
def reference(tiny):
    """tokens(adapter dir or None, prompt, max_tokens): the request run alone on an engine with a big pool."""
    d, dirs, _ = tiny
    ref = Engine(model=str(d), device="cpu", progress=False, max_batch_size=1, max_seq_len=MAX_SEQ, max_lora_rank=24,
                 adapter_slots=8)
    by_dir = {}
    for n, versions in dirs.items():
        for v, path in enumerate(versions):
            ref.load_adapter(f"{n}@{v}", path)
            by_dir[Path(path)] = f"{n}@{v}"
    memo = {}

    def tokens(path, prompt, max_tokens):
        key = (None if path is None else Path(path), tuple(prompt), max_tokens)
        if key not in memo:
            out = ref.generate([list(prompt)], adapters=[None if path is None else by_dir[Path(path)]],
                               sampling=_greedy(max_tokens))[0]
            assert out.finish_reason == "length", out.error
            memo[key] = out.token_ids
        return memo[key]

    return tokens


# --------------------------------------------------------------------------------------- the machine
def _rank(name, version):
    return VERSIONS[name][version][1]


def make_machine(tiny, reference, *, pins, kv_blocks=None):
    """The machine class; ``pins``: "none" (no pin rule), "small" (at most one pinned name, whose version
    has rank 8 at most, at most one unit: the pinned adapter can never crowd out its own requests), "any"
    (unrestricted).
    ``kv_blocks``: usable KV blocks of KV_BLOCK tokens (None: the default cache, which never runs out)."""
    model_dir, dirs, unit = tiny
    kv_kw = {}
    if kv_blocks is not None:
        per_token = PagedKVCache.bytes_per_token(2, 2, 16, torch.float32)
        kv_kw = dict(kv_block_size=KV_BLOCK, kv_cache_bytes=(kv_blocks + 1) * KV_BLOCK * per_token)

    class CacheMachine(RuleBasedStateMachine):
        def __init__(self):
            super().__init__()
            self.engine = Engine(
                model=str(model_dir), device="cpu", progress=False, max_batch_size=MAX_BATCH, max_seq_len=MAX_SEQ,
                max_lora_rank=24, adapter_pool_bytes=POOL_PAGES * unit,
                host_adapter_bytes=HOST_PAGES * unit, starvation_patience=PATIENCE, prefetch_adapters=2,
                **kv_kw,
            )
            assert self.engine.pool.bytes_total == POOL_PAGES * unit == self.engine.pool.max_adapter_pages * \
                self.engine.pool.page_bytes  # the pool's minimum: one rank-24 adapter on every module
            assert kv_blocks is None or self.engine.kv.num_usable_blocks == kv_blocks
            assert self.engine.scheduler.max_batch_size == MAX_BATCH
            self.loaded: dict[str, Path] = {}  # name -> the directory of the version loaded now
            self.requests: list[tuple] = []  # (request, adapter dir or None, prompt, max_tokens)
            self.pinned_slots: dict[int, tuple] = {}  # id(handle) -> (handle, slot) while pinned and resident
            self.checked_errors: set[int] = set()
            self.pinned_names: set[str] = set()
            self.preemptions = PREEMPTIONS

        # ---------------------------------------------------------------- rules
        @initialize(versions=st.fixed_dictionaries({n: st.sampled_from([0, 1, None]) for n in sorted(VERSIONS)}))
        def load_some(self, versions):
            for name, version in versions.items():
                if version is not None:
                    self.load(name, version, then=0)

        @rule(name=st.sampled_from(sorted(VERSIONS)), version=st.integers(0, 1), then=STEPS)
        def load(self, name, version, then=0):
            self._advance(then)
            if pins == "small" and name in self.pinned_names and _rank(name, version) > 8:
                return  # the pin passes to the new version (the cache pins by name)
            path = dirs[name][version]
            self.engine.load_adapter(name, path)
            self.loaded[name] = Path(path)

        @rule(data=st.data(), then=STEPS)
        def unload(self, data, then):
            self._advance(then)
            if not self.loaded:
                return
            name = data.draw(st.sampled_from(sorted(self.loaded)), label="unload")
            self.engine.unload_adapter(name)
            del self.loaded[name]
            self.pinned_names.discard(name)  # unloading drops the pin

        if pins != "none":
            @rule(data=st.data(), pinned=st.booleans(), then=STEPS)
            def pin(self, data, pinned, then):
                self._advance(then)
                if not self.loaded:
                    return
                name = data.draw(st.sampled_from(sorted(self.loaded)), label="pin")
                if pins == "small" and pinned and (
                        self.pinned_names - {name} or _rank(name, dirs[name].index(self.loaded[name])) > 8):
                    return
                pages = self.engine.pool.pages_used
                try:
                    self.engine.pin_adapter(name, pinned)
                except PoolFullError:
                    assert pinned and self.engine.pool.pages_used == pages  # only pinning fails, changing nothing
                else:
                    (self.pinned_names.add if pinned else self.pinned_names.discard)(name)
                    assert self.engine.cache.get(name).slot is not None or not pinned  # pinned: resident now
                if not pinned:
                    for key, (h, _) in list(self.pinned_slots.items()):
                        if h.name == name:
                            del self.pinned_slots[key]

        @rule(data=st.data(), count=st.integers(1, 3), then=STEPS)
        def add_requests(self, data, count, then):
            self._advance(then)
            for _ in range(count):  # a small burst: admission under pressure
                base = not self.loaded or data.draw(st.integers(0, 3), label="base") == 3
                adapter = None if base else data.draw(st.sampled_from(sorted(self.loaded)), label="adapter")
                prompt = data.draw(st.lists(st.integers(3, VOCAB - 1), min_size=1, max_size=6), label="prompt")
                max_tokens = data.draw(st.integers(1, 3), label="max_tokens")
                req = self.engine.add_request(list(prompt), adapter, _greedy(max_tokens))
                path = None if adapter is None else self.loaded[adapter]
                assert req.handle is None or req.handle.path == path
                self.requests.append((req, path, list(prompt), max_tokens))

        @rule(n=st.integers(1, 4))
        def step(self, n):
            self._advance(n)

        def _advance(self, n):
            for _ in range(n):
                self.engine.step()
                self._check_errors()

        # ---------------------------------------------------------------- checks
        def _other_pinned_bytes(self, handle):
            cache = self.engine.cache
            return sum(h.pool_bytes for h in cache.handles()
                       if h is not handle and h.slot is not None and cache.is_pinned(h))

        def _check_errors(self):
            """A request may fail only when its adapter needs more bytes than the pool holds besides the
            other pinned adapters (checked right after the step that failed it: pins do not change in a step)."""
            for req, path, _, _ in self.requests:
                if req.finish_reason != "error" or req.request_id in self.checked_errors:
                    continue
                self.checked_errors.add(req.request_id)
                assert req.handle is not None, f"a base-model request failed: {req.error}"
                need, other = req.handle.pool_bytes, self._other_pinned_bytes(req.handle)
                assert need > self.engine.pool.bytes_total - other, (
                    f"request for {req.adapter_name!r} ({path.name}, {need} bytes, pinned="
                    f"{self.engine.cache.is_pinned(req.handle)}, resident={req.handle.slot is not None}) failed "
                    f"although it fits beside the other pinned adapters ({other} of {self.engine.pool.bytes_total} "
                    f"bytes): {req.error}"
                )
                assert NEVER_FITS in req.error, req.error

        @invariant()
        def pool_bytes_match_resident_handles(self):
            pool, cache = self.engine.pool, self.engine.cache
            resident = [h for h in cache.handles() if h.slot is not None]
            assert sorted(h.slot for h in resident) == pool.resident_slots()  # no orphan slot, no shared slot
            assert pool.bytes_used == sum(h.pool_bytes for h in resident)
            assert all(pool.extent_of(h.slot)[1] * pool.page_bytes == h.pool_bytes for h in resident)
            runs = sorted([pool.extent_of(s) for s in pool.resident_slots() if pool.extent_of(s)[1]] + pool.holes())
            pos = 0
            for start, n in runs:  # extents and holes tile the pool: no page has two owners, none is lost
                assert start == pos and n > 0, runs
                pos += n
            assert pos == pool.num_pages and pool.pages_used + pool.pages_free == pool.num_pages

        @invariant()
        def running_requests_hold_their_resident_adapter(self):
            sch, cache = self.engine.scheduler, self.engine.cache
            assert len(sch.running) <= MAX_BATCH
            kv = self.engine.kv
            assert sorted(kv.allocator.owners()) == sorted(r.seq_id for r in sch.running)  # blocks: running only
            owned = [b for r in sch.running for b in kv.block_table(r.seq_id)]
            assert len(owned) == len(set(owned)) and 0 not in owned  # no block owned twice, null block never
            assert len(owned) + kv.num_free_blocks == kv.num_usable_blocks
            for r in sch.running:
                assert r.status is Status.RUNNING
                assert len(kv.block_table(r.seq_id)) * kv.block_size >= r.num_tokens - 1  # the KV written so far
                if r.handle is None:
                    assert r.slot == -1
                else:
                    assert r.handle.slot is not None and r.handle.slot == r.slot, (r.adapter_name, r.handle.slot, r.slot)
            for r in sch.waiting:
                assert r.status is Status.WAITING and not kv.has_seq(r.seq_id) and r.slot == -1
            for h in cache.handles():  # references are exactly the running / waiting requests holding a version
                assert h.refcount == sum(r.handle is h for r in sch.running), (h.name, h.version, h.refcount)
                assert h.queued == sum(r.handle is h for r in sch.waiting), (h.name, h.version, h.queued)
                if h.retired:  # a retired version lingers only for its requests
                    assert h.refcount > 0 or h.queued > 0, f"retired {h.name!r} v{h.version} leaked ({h.tier})"

        @invariant()
        def host_tier_within_budget(self):
            cache = self.engine.cache
            budget = cache.host_budget
            assert budget == HOST_PAGES * unit
            copies = [h for h in cache.handles() if h.host is not None]
            assert cache.host_bytes == sum(h.host.nbytes for h in copies)
            if cache.host_bytes > budget:  # only the one kept copy may exceed it on its own
                assert len(copies) == 1 and copies[0].host.nbytes > budget, (
                    f"host tier {cache.host_bytes} B > budget {budget} B with {len(copies)} copies: "
                    + ", ".join(f"{h.name}v{h.version}({h.host.nbytes})" for h in copies))

        @invariant()
        def every_loaded_adapter_is_in_a_tier(self):
            cache = self.engine.cache
            assert self.engine.list_adapters() == sorted(self.loaded)
            for name, path in self.loaded.items():
                h = cache.get(name)
                assert not h.retired and h.path == path and path.is_dir()
                assert h.tier in ("gpu", "host", "disk")
                if h.tier == "disk":
                    assert files_fingerprint(h.path) == h.fingerprint  # reloadable

        @invariant()
        def pinned_adapters_stay_put(self):
            cache = self.engine.cache
            for h in cache.handles():
                if not cache.is_pinned(h):
                    self.pinned_slots.pop(id(h), None)
                elif id(h) in self.pinned_slots:
                    assert h.slot == self.pinned_slots[id(h)][1], f"pinned {h.name!r} left its slot"
                elif h.slot is not None:
                    self.pinned_slots[id(h)] = (h, h.slot)

        # ---------------------------------------------------------------- teardown
        def teardown(self):
            engine = self.engine
            try:
                for _ in range(DRAIN_STEPS):
                    if not engine.has_unfinished():
                        break
                    engine.step()
                    self._check_errors()
                    self.pool_bytes_match_resident_handles()
                    self.running_requests_hold_their_resident_adapter()
                assert not engine.has_unfinished(), f"requests still unfinished after {DRAIN_STEPS} steps"
                for req, path, prompt, max_tokens in self.requests:
                    assert req.status is Status.FINISHED
                    if req.finish_reason == "error":
                        continue  # judged by _check_errors when it failed
                    assert req.finish_reason == "length", (req.finish_reason, req.error)
                    want = reference(path, prompt, max_tokens)
                    assert req.output_ids == want, (
                        f"request for {req.adapter_name!r} ({None if path is None else path.name}) "
                        f"gave {req.output_ids}, alone {want}")
                assert all(h.refcount == 0 and h.queued == 0 for h in engine.cache.handles())
                assert engine.kv.num_free_blocks == engine.kv.num_usable_blocks
                if kv_blocks is not None:
                    self.preemptions.append(engine.stats()["preemptions"])
            finally:
                engine.cache.close()

    return CacheMachine


STATEFUL = settings(max_examples=50, stateful_step_count=40, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
# Fixed seeds: the same sequences every run. derandomize's own seed explored badly here (whole examples
# without a step); these give each variant hundreds of steps, gpu evictions, host misses and prefetches.
SEEDS = {"none": 7, "small": 1, "any": 1}


def _run(tiny, reference, pins, kv_blocks=None, **overrides):
    machine = seed(SEEDS[pins])(make_machine(tiny, reference, pins=pins, kv_blocks=kv_blocks))
    run_state_machine_as_test(machine, settings=settings(STATEFUL, **overrides))


def test_cache_state_machine_without_pins(tiny, reference):
    """Loads, reloads, unloads, requests and steps: every bookkeeping invariant, every output as alone (also for
    adapters the pool moved when it compacted)."""
    _run(tiny, reference, "none")


def test_cache_state_machine_with_one_small_pin(tiny, reference):
    """The same with pins and unpins of at most one adapter of rank <= 8 at a time (pinning may raise
    PoolFullError, which changes nothing); a pinned resident adapter never leaves its slot."""
    _run(tiny, reference, "small")


def test_cache_state_machine_with_any_pins(tiny, reference):
    """Unrestricted pins: a request for a pinned adapter must be served (it is resident already)."""
    _run(tiny, reference, "any")


def test_cache_state_machine_with_kv_preemption(tiny, reference):
    """The one-small-pin machine over a KV cache of 10 one-token blocks: requests are preempted and recomputed
    while adapters are loaded, reloaded, unloaded and pinned; every invariant holds, every output is as alone."""
    PREEMPTIONS.clear()
    _run(tiny, reference, "small", kv_blocks=KV_BLOCKS)
    assert sum(PREEMPTIONS) > 0, "the small KV cache never preempted a request"


def test_request_for_a_pinned_adapter_is_served(tiny, reference):
    model_dir, dirs, unit = tiny
    engine = Engine(model=str(model_dir), device="cpu", progress=False, max_batch_size=MAX_BATCH, max_seq_len=MAX_SEQ,
                    max_lora_rank=24, adapter_pool_bytes=POOL_PAGES * unit)
    engine.load_adapter("c", dirs["c"][0])  # rank 16 on the attention modules
    engine.pin_adapter("c")
    assert engine.cache.get("c").slot is not None
    out = engine.generate([[5, 6, 7]], adapters=["c"], sampling=_greedy(3))[0]
    assert (out.finish_reason, out.error) == ("length", None)
    assert out.token_ids == reference(dirs["c"][0], [5, 6, 7], 3)
