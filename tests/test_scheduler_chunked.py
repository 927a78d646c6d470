"""Chunked prefill (issue 13, item 2): the scheduler alone, then a tiny engine.

- The scheduler with a fake runner (no model) on hypothesis-drawn traffic (arrivals over many steps, adapters
  through a pool of 1-3 slots, aborts, ``Engine.logits``-style rows, KV caches small enough to preempt, token
  budgets from 1 up): the fake runner keeps its own copy of what every KV slot holds and checks, at every row of
  every step, that the request's earlier positions are in its blocks (so blocks are never shared, lost or
  reused under a live request) and that a step computes exactly ``computed .. computed + chunk - 1``. Checked:
  every decoding request gets its token at every step (no stall), prompt chunks stay within the prompt room,
  every prompt position is computed once unless its request was preempted (``Scheduler.advance``'s counts
  equal the fake runner's recount), an urgent request is overtaken by nobody behind it, every request is
  admitted within the no-starvation bound of ``runtime/scheduler.py``'s docstring, and at the end every KV block
  is free and every adapter reference and queue count returned. The unchunked scheduler runs the same checks
  that apply to it.
- A tiny random engine: outputs of random requests (greedy and seeded, three adapters) with chunked prefill at
  token budgets 1 to 64 equal the unchunked engine's and each request's run alone; ``Engine.logits`` too; a
  decoding request gets a token at every step while a long prompt prefills; aborting a request in the middle of
  its chunked prefill returns its blocks and adapter reference.
"""

from __future__ import annotations

import math
from collections import Counter
from types import SimpleNamespace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from multilora.memory.kv_cache import PagedKVCache
from multilora.memory.pool import PoolFullError
from multilora.runtime.sampling import SamplingParams
from multilora.runtime.scheduler import Request, Scheduler, Status, next_request_id

L = 32  # max_seq_len of the scheduler runs


# ----------------------------------------------------------------------------------- fake adapter cache
class FakeHandle:
    def __init__(self, name: str, host: bool = True) -> None:
        self.name, self.slot, self.refcount, self.queued, self.pool_bytes, self.last = name, None, 0, 0, 1, 0
        self.prefetch_failed = False  # (AdapterHandle's: reads of this fake never fail)
        self.host = host  # in host memory (False: on disk)
        self.loading: int | None = None  # steps left of a prefetch read in flight

    @property
    def tier(self) -> str:
        return "gpu" if self.slot is not None else "host" if self.host else "disk"


class FakeCache:
    """The adapter cache as the scheduler sees it: ``slots`` adapters resident at once, LRU among idle ones, a
    referenced adapter never evicted (``AdapterCache.acquire``'s contract; the real cache: test_adapter_cache_*)."""

    def __init__(self, slots: int, names=("a", "b", "c"), on_disk=()) -> None:
        self.slots = slots
        self.pool = SimpleNamespace(bytes_total=slots, max_slots=slots)
        self.handles = {n: FakeHandle(n, host=n not in on_disk) for n in names}
        self.clock = 0
        self.sync_reads = 0  # acquire of an adapter on disk: its files read inside the step

    def prefetch(self, handles, read_steps):
        """Start a disk read of each candidate on disk (done ``read_steps`` prefetch calls later)."""
        for h in self.handles.values():
            if h.loading is not None:
                h.loading -= 1
                if h.loading <= 0:
                    h.loading, h.host = None, True
        for h in handles:
            if not h.host and h.loading is None:
                h.loading = read_steps

    def enqueue(self, h):
        h.queued += 1

    def can_prefetch_to_host(self, h):  # (a host tier that holds any one image)
        return True

    def dequeue(self, h):
        assert h.queued > 0, f"{h.name}: dequeued more often than queued"
        h.queued -= 1

    def could_ever_fit(self, h):
        return True

    def reading(self, h):
        return h.loading is not None

    def acquire(self, h):
        if not h.host:
            self.sync_reads += 1
            h.host, h.loading = True, None
        if h.slot is None:
            used = {x.slot for x in self.handles.values() if x.slot is not None}
            if len(used) >= self.slots:
                idle = [x for x in self.handles.values() if x.slot is not None and x.refcount == 0]
                if not idle:
                    raise PoolFullError("every slot is in use")
                victim = min(idle, key=lambda x: x.last)
                h.slot, victim.slot = victim.slot, None
            else:
                h.slot = min(set(range(self.slots)) - used)
        h.refcount += 1
        self.clock += 1
        h.last = self.clock
        return h.slot

    def release(self, h):
        assert h.refcount > 0, f"{h.name}: released more often than acquired"
        h.refcount -= 1


def _next_token(req: Request) -> int:
    return (7 * req.request_id + 13 * len(req.output_ids)) % 1000 + 3  # any function of (request, n) will do


# --------------------------------------------------------------------------------------- the simulation
class Sim:
    """A scheduler, a real KV cache's bookkeeping, a fake adapter cache and a fake runner; ``step`` = one engine step."""

    def __init__(self, *, chunked, B, budget, max_prefill, blocks, block_size, patience, slots, adapter_aware=False,
                 names=("a", "b", "c"), on_disk=(), read_steps=2, prefetch=4):
        self.kv = PagedKVCache(num_layers=1, num_blocks=blocks + 1, block_size=block_size, num_kv_heads=1,
                               head_dim=1, dtype=torch.float32, device="cpu")
        self.cache = FakeCache(slots, names, on_disk)
        self.s = Scheduler(self.cache, kv=self.kv, max_batch_size=B, max_prefill_tokens=max_prefill,
                           patience=patience, chunked=chunked, max_num_batched_tokens=budget,
                           adapter_aware=adapter_aware)
        self.read_steps, self.prefetch = read_steps, prefetch
        self.early_reads = 0  # requests admitted with a read of their files while not urgent and others ran
        self.chunked, self.B, self.budget, self.max_prefill, self.patience = chunked, B, budget, max_prefill, patience
        self.store: dict[tuple[int, int], tuple[int, int, int]] = {}  # (block, offset) -> (request, position, token)
        self.computations: Counter = Counter()  # (request, position) -> times computed
        self.new = self.again = 0  # Scheduler.advance's counts
        self.steps = 0
        self.reqs: list[Request] = []
        self.arrived: dict[int, tuple[int, int]] = {}  # request id -> (steps before its arrival, requests ahead)
        self.admitted: dict[int, int] = {}  # request id -> the step that first admitted it

    def add(self, prompt_len, max_tokens, adapter, logits_only):
        ids = [(5 * i + prompt_len) % 1000 + 3 for i in range(prompt_len)]
        h = self.cache.handles[adapter] if adapter else None
        req = Request(request_id=next_request_id(), prompt=ids, prompt_ids=ids, adapter_name=adapter, handle=h,
                      params=SamplingParams(max_tokens=1 if logits_only else max_tokens, ignore_eos=True), seed=0,
                      logits_only=logits_only)
        self.arrived[req.request_id] = (self.steps, len(self.s.waiting))
        self.s.add(req)
        self.reqs.append(req)

    def step(self):
        s, bs = self.s, self.kv.block_size
        decoding = [r for r in s.running if not r.prefilling]
        urgent = [r for r in s.waiting if r.skipped_steps >= self.patience]
        order = {r.request_id: i for i, r in enumerate(s.waiting)}
        cold = {r.request_id for r in s.waiting if r.handle is not None and r.handle.tier == "disk"
                and r.skipped_steps < self.patience and s.running}
        sched = s.schedule()
        self.steps += 1
        self.early_reads += sum(r.request_id in cold for r in s.running)
        if self.prefetch:  # the engine's _make_resident: after scheduling, before the forward
            self.cache.prefetch(s.prefetch_candidates(self.prefetch), self.read_steps)
        for r in s.running:
            self.admitted.setdefault(r.request_id, self.steps)
        for u in urgent:  # nobody behind a still-waiting urgent request was admitted
            if u.status is Status.WAITING:
                assert not any(order.get(r.request_id, -1) > order[u.request_id] and self.admitted[r.request_id] ==
                               self.steps for r in s.running), "a request overtook an urgent one"
        assert len(s.running) <= self.B
        if sched.kind is None:
            assert not s.running
            return
        prompt = sum(r.chunk for r in sched.batch if r.prefilling)
        if self.chunked:  # no stall: each request that decoded before the step decodes in it, unless preempted
            for r in decoding:
                assert r.status is Status.WAITING or (r in sched.batch and r.chunk == 1), "a decode stalled"
            n_dec = sum(not r.prefilling for r in sched.batch)
            assert prompt <= s.prompt_room(n_dec) and (n_dec == 0 or sched.kind in ("decode", "mixed"))
        elif sched.kind == "prefill" and len(sched.batch) > 1:
            assert prompt <= self.max_prefill
        assert sched.sampling == [r for r in sched.batch if r.computed + r.chunk == r.num_tokens]
        for r in sched.batch:  # the forward: earlier positions are in the request's blocks; write the chunk
            table = self.kv.block_table(r.seq_id)
            toks = r.prompt_ids + r.output_ids
            assert r.chunk >= 1 and r.computed + r.chunk <= r.num_tokens <= len(table) * bs
            for p in range(r.computed):
                assert self.store[(table[p // bs], p % bs)] == (r.request_id, p, toks[p]), "KV lost or overwritten"
            for p in range(r.computed, r.computed + r.chunk):
                self.store[(table[p // bs], p % bs)] = (r.request_id, p, toks[p])
                self.computations[(r.request_id, p)] += 1
        new, again = s.advance(sched.batch)
        self.new, self.again = self.new + new, self.again + again
        for r in sched.sampling:  # the postprocess
            if r.logits_only:
                s.finish(r, "length")
                continue
            r.output_ids.append(_next_token(r))
            if len(r.output_ids) >= r.params.max_tokens or r.num_tokens >= L:
                s.finish(r, "length")

    def abort(self, i):
        live = [r for r in self.reqs if r.status is not Status.FINISHED]
        if live:
            self.s.finish(live[i % len(live)], "abort", "aborted")

    def check_end(self):
        s = self.s
        assert not s.has_unfinished()
        assert self.kv.num_free_blocks == self.kv.num_usable_blocks and not self.kv.allocator.owners()
        assert all(h.refcount == 0 and h.queued == 0 for h in self.cache.handles.values())
        for r in self.reqs:
            if r.finish_reason == "length" and not r.logits_only:
                assert r.output_ids == [(7 * r.request_id + 13 * n) % 1000 + 3 for n in range(len(r.output_ids))]
                assert len(r.output_ids) == min(r.params.max_tokens, L - len(r.prompt_ids))
            if r.finish_reason == "length":  # every prompt position computed; once, unless the request was preempted
                counts = [self.computations[(r.request_id, p)] for p in range(len(r.prompt_ids))]
                assert min(counts) >= 1 and (r.preemptions > 0 or max(counts) == 1), counts
        mine = {k for k in self.computations}
        prompt_len = {r.request_id: len(r.prompt_ids) for r in self.reqs}
        assert self.new == sum(1 for rid, p in mine if p < prompt_len[rid])
        assert self.again == sum(n - 1 for n in self.computations.values())
        assert (self.again > 0) <= (s.preemptions > 0)

    def check_bound(self):
        """Each admitted request within its bound (runtime/scheduler.py's docstring)."""
        B, pat = self.B, self.patience
        if self.chunked:
            p1 = min(self.max_prefill, max(1, self.budget - B))
            p0 = min(self.max_prefill, self.budget)
            F, c = math.ceil(B * L / p1) + L, math.ceil(L / p0)
        else:
            F, c = L, 1
        pat = 2 * pat if self.s.adapter_aware else pat  # an urgent request may wait patience more for its read
        for rid, step in self.admitted.items():
            arrived, k = self.arrived[rid]
            waited = step - arrived
            bound = ((k + 1) * (pat + F + 1) if self.s.preemptions == 0
                     else pat + (k + (pat + 1) * B) * L * c + 1)
            assert waited <= bound, (rid, waited, bound, k)


REQ = st.tuples(st.integers(1, L - 1), st.integers(1, 12), st.sampled_from([None, "a", "b", "c"]),
                st.sampled_from([False] * 5 + [True]))  # (prompt length, max_tokens, adapter, logits_only)
STEP = st.tuples(st.lists(REQ, max_size=3), st.integers(-1, 12))  # arrivals, abort the i-th live request (or -1)


@pytest.mark.parametrize("chunked,adapter_aware", [(True, False), (False, False), (True, True)])
def test_scheduler_invariants_on_random_traffic(chunked, adapter_aware):
    """adapter_aware: adapters b and c start on the disk tier (reads take 1-3 steps)."""
    @settings(max_examples=50 if chunked else 25, deadline=None, database=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow])
    @given(steps=st.lists(STEP, min_size=1, max_size=40), B=st.integers(1, 5), budget=st.integers(1, 24),
           max_prefill=st.integers(1, 32), extra_blocks=st.integers(0, 12), block_size=st.sampled_from([1, 4, 8]),
           patience=st.integers(0, 6), slots=st.integers(1, 3), read_steps=st.integers(1, 3))
    def run(steps, B, budget, max_prefill, extra_blocks, block_size, patience, slots, read_steps):
        sim = Sim(chunked=chunked, B=B, budget=budget, max_prefill=max_prefill, block_size=block_size,
                  blocks=-(-L // block_size) + extra_blocks, patience=patience, slots=slots,
                  adapter_aware=adapter_aware, on_disk=("b", "c") if adapter_aware else (), read_steps=read_steps)
        for arrivals, abort in steps:
            for spec in arrivals:
                sim.add(min(spec[0], L - spec[1]) if not spec[3] else spec[0], *spec[1:])
            if abort >= 0 and abort % 4 == 0:
                sim.abort(abort)
            sim.step()
        for _ in range(20000):
            if not sim.s.has_unfinished():
                break
            sim.step()
        sim.check_end()
        sim.check_bound()
        if adapter_aware:
            assert sim.early_reads == 0  # files read in a step only for an urgent request, or with nothing running

    run()


def test_prefetch_candidates_look_past_reads_in_flight():
    """The look-ahead: adapters already being read do not use up the per-step limit, so it reaches further down
    the queue while reads are slower than admissions; resident adapters and repeats are left out."""
    names = [f"d{i}" for i in range(10)]
    sim = Sim(chunked=True, B=1, budget=8, max_prefill=8, blocks=8, block_size=4, patience=4, slots=1,
              names=names, on_disk=names)
    for n in ["d0", "d0", "d1", "d2", "d1", "d3", "d4", "d5"]:
        sim.add(3, 2, n, False)
    s = sim.s
    assert [h.name for h in s.prefetch_candidates(2)] == ["d0", "d1"]
    sim.cache.prefetch(s.prefetch_candidates(2), read_steps=5)  # d0, d1 in flight
    assert [h.name for h in s.prefetch_candidates(2)] == ["d0", "d1", "d2", "d3"]
    sim.cache.handles["d2"].slot = 0  # resident: not a candidate
    assert [h.name for h in s.prefetch_candidates(2)] == ["d0", "d1", "d3", "d4"]
    sim.cache.handles["d2"].slot = None
    for n in names:  # every read in flight: nothing counts against the limit, the cap of 8 * limit handles holds
        sim.cache.handles[n].loading = 9
    assert [h.name for h in s.prefetch_candidates(2)] == [f"d{i}" for i in range(6)]
    for n in ("d6", "d7", "d8", "d9"):
        sim.add(3, 2, n, False)
    assert [h.name for h in s.prefetch_candidates(2)] == names
    assert [h.name for h in s.prefetch_candidates(1)] == names[:8]


def test_adapter_aware_admission_keeps_file_reads_out_of_steps():
    """A stream of requests, every third one for a different adapter on the disk tier (reads take 3 steps), the rest
    for a resident adapter, while requests run. Unaware, each cold request's files are read inside the step that
    admits it; aware, the cold ones are passed over while their prefetch runs, requests behind them are admitted,
    and no step reads files; every request is still admitted within the bound, with the same tokens."""
    names = ["hot"] + [f"d{i}" for i in range(12)]
    reads, outputs = {}, {}
    for aware in (False, True):
        sim = Sim(chunked=True, B=4, budget=16, max_prefill=16, blocks=64, block_size=4, patience=6, slots=6,
                  names=names, on_disk=names[1:], read_steps=3, adapter_aware=aware)
        sim.add(4, 20, "hot", False)
        sim.step()
        for i in range(36):
            sim.add(4 + i % 5, 3, names[1 + i // 3] if i % 3 == 0 else "hot", False)
            sim.step()
        for _ in range(500):
            if not sim.s.has_unfinished():
                break
            sim.step()
        sim.check_end()
        sim.check_bound()
        reads[aware] = sim.cache.sync_reads
        outputs[aware] = [r.output_ids for r in sim.reqs]
        if aware:
            assert sim.early_reads == 0 and sim.s.adapter_defers > 0
            assert sim.s.report()["queue_defers_for_adapter_load"] == sim.s.adapter_defers
    assert reads[False] == 12 and reads[True] == 0, reads
    assert [len(o) for o in outputs[True]] == [len(o) for o in outputs[False]]


@pytest.mark.parametrize("read_steps,off", [(6, False), (20, False), (6, True)],
                         ids=["read-lands-in-time", "read-too-slow", "switched-off"])
def test_urgent_request_waits_for_its_read_outside_the_step(read_steps, off, monkeypatch):
    """Patience 4: a request for an adapter on the disk tier is passed over for 4 steps (its prefetch read starts
    after the first one's scheduling), then it is urgent. While a request runs and its read is still in flight, it
    is not admitted into a step that would wait for the read (no file read inside a step), the request behind it for
    a resident adapter is not admitted either, and the running request decodes at every step; the step after the
    read lands admits it (a 6-step read: 3 steps of waiting). A read that has not landed after 4 more steps (20
    steps) stops the wait: it is admitted and its files read in the step, as before. Meanwhile the look-ahead stops
    at it (no read for the cold adapter behind it). With nothing running a request is admitted at once."""
    from multilora.runtime import scheduler

    monkeypatch.setattr(scheduler, "URGENT_READ_WAIT", not off)
    sim = Sim(chunked=True, B=4, budget=16, max_prefill=16, blocks=64, block_size=4, patience=4, slots=3,
              names=["hot", "cold", "cold2"], on_disk=["cold", "cold2"], read_steps=read_steps, adapter_aware=True)
    sim.add(4, 40, "hot", False)
    sim.step()
    runner = sim.reqs[0]
    sim.add(4, 3, "cold", False)
    for _ in range(4):  # passed over (not urgent yet); its read starts after the first of these steps
        sim.step()
    sim.add(4, 3, "hot", False)  # behind the now urgent request
    sim.add(4, 3, "cold2", False)  # and one whose adapter is on disk too
    urgent, behind, cold2 = sim.reqs[1:]
    want = ["cold", "cold2"] if off else ["cold"]  # the look-ahead stops at the urgent request
    assert [h.name for h in sim.s.prefetch_candidates(4)] == want
    waited = 0
    while urgent.status is Status.WAITING:
        n = len(runner.output_ids)
        sim.step()
        assert len(runner.output_ids) == n + 1  # the running request was not held up
        if urgent.status is Status.WAITING:
            waited += 1
            assert behind.status is Status.WAITING and cold2.handle.loading is None  # nobody behind, no read
    assert urgent.status is not Status.WAITING
    if read_steps == 6 and not off:
        assert (waited, sim.cache.sync_reads, sim.s.adapter_read_waits) == (3, 0, 3)
    elif off:  # what ran before: admitted at once, its files read in the step
        assert (waited, sim.cache.sync_reads, sim.s.adapter_read_waits) == (0, 1, 0)
    else:  # 4 steps of waiting, then admitted with its read in the step; so is cold2, urgent by then with no read
        assert (waited, sim.cache.sync_reads, sim.s.adapter_read_waits) == (4, 2, 4)  # started (the look-ahead)
        assert cold2.status is not Status.WAITING
    assert sim.s.report()["queue_urgent_waits_for_adapter_read"] == sim.s.adapter_read_waits
    for _ in range(400):
        if not sim.s.has_unfinished():
            break
        sim.step()
    sim.check_end()
    sim.check_bound()
    reads = sim.cache.sync_reads
    sim.cache.handles["cold2"].host, sim.cache.handles["cold2"].slot = False, None  # on disk again; nothing runs:
    sim.add(4, 3, "cold2", False)  # admitted at once, its files read in the step
    sim.step()
    assert sim.reqs[-1].status is not Status.WAITING and sim.cache.sync_reads == reads + 1


def test_long_prompt_never_stalls_decodes_and_is_chunked_by_the_budget():
    """A 300-token prompt arrives while 3 requests decode: each of them gets a token at every step of its
    prefill, which takes ceil(300 / (budget - 3)) steps; the prompt is computed exactly once."""
    global L
    sim = Sim(chunked=True, B=4, budget=16, max_prefill=4096, blocks=200, block_size=4, patience=4, slots=3)
    old, L = L, 400
    try:
        for _ in range(3):
            sim.add(5, 200, "a", False)
        while any(r.prefilling or r.status is Status.WAITING for r in sim.reqs):
            sim.step()
        sim.add(300, 4, "b", False)
        long = sim.reqs[-1]
        before = [len(r.output_ids) for r in sim.reqs[:3]]
        steps = 0
        while not long.output_ids:
            sim.step()
            steps += 1
            assert [len(r.output_ids) for r in sim.reqs[:3]] == [b + steps for b in before]
        assert steps == math.ceil(300 / (16 - 3))
        assert all(sim.computations[(long.request_id, p)] == 1 for p in range(300))
        for r in sim.reqs:
            sim.s.finish(r, "abort")
        sim.check_end()
    finally:
        L = old


# ------------------------------------------------------------------------------------------ a tiny engine
transformers = pytest.importorskip("transformers")

from multilora import Engine  # noqa: E402
from multilora.config import TARGET_MODULES, ModelConfig  # noqa: E402
from testsupport import one_thread  # noqa: E402,F401 (autouse fixture)
from testsupport import write_adapter  # noqa: E402

CFG = ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2,
                  max_position_embeddings=256)
MAX_SEQ = 64
BUDGETS = (1, 3, 8, 64)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("chunked-adapters")
    mods = [("q_proj", "v_proj"), TARGET_MODULES, ("gate_proj", "down_proj")]
    return {n: write_adapter(root / n, CFG, 40 + i, 4 + 2 * i, mods[i]) for i, n in enumerate("abc")}


def _engine(adapters, **kw):
    e = Engine(CFG, device="cpu", progress=False, max_seq_len=MAX_SEQ, max_lora_rank=8, adapter_slots=2, **kw)
    for n, p in adapters.items():
        e.load_adapter(n, p)
    return e


@pytest.fixture(scope="module")
def engines(adapters):
    """{budget: chunked engine}, the unchunked engine, and tokens(prompt, adapter, sampling) run alone."""
    chunked = {b: _engine(adapters, max_batch_size=4, max_num_batched_tokens=b) for b in BUDGETS}
    plain = _engine(adapters, max_batch_size=4, enable_chunked_prefill=False)
    ref = _engine(adapters, max_batch_size=1, enable_chunked_prefill=False)
    memo = {}

    def alone(prompt, adapter, sp):
        key = (tuple(prompt), adapter, sp.max_tokens, sp.temperature, sp.seed)
        if key not in memo:
            memo[key] = ref.generate([list(prompt)], adapters=[adapter], sampling=sp)[0].token_ids
        return memo[key]

    return chunked, plain, alone


def _sp(kind, n, seed):
    if kind == "greedy":
        return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    return SamplingParams(max_tokens=n, temperature=0.9, top_k=40, seed=seed, ignore_eos=True)


ENGINE_REQ = st.tuples(st.integers(1, 40), st.integers(0, 10**6), st.sampled_from([None, "a", "b", "c"]),
                       st.integers(1, 8), st.sampled_from(["greedy", "seeded"]))


def test_engine_outputs_equal_unchunked_and_alone(engines):
    chunked, plain, alone = engines

    @settings(max_examples=10, deadline=None, database=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow])
    @given(reqs=st.lists(ENGINE_REQ, min_size=1, max_size=6), budget=st.sampled_from(BUDGETS))
    def run(reqs, budget):
        g = torch.Generator()
        prompts = [torch.randint(3, CFG.vocab_size, (n,), generator=g.manual_seed(s)).tolist() for n, s, *_ in reqs]
        names = [a for _, _, a, _, _ in reqs]
        sps = [_sp(k, m, s) for _, s, _, m, k in reqs]
        e = chunked[budget]
        before = e.stats()
        got = [o.token_ids for o in e.generate(prompts, adapters=names, sampling=sps)]
        after = e.stats()
        want = [o.token_ids for o in plain.generate(prompts, adapters=names, sampling=sps)]
        assert got == want
        assert got == [alone(p, a, sp) for p, a, sp in zip(prompts, names, sps)]
        assert after["prompt_tokens"] - before["prompt_tokens"] == sum(map(len, prompts))
        assert after["recomputed_tokens"] == before["recomputed_tokens"]  # the cache never runs out here
        assert after["prefill_chunks"] - before["prefill_chunks"] >= sum(-(-len(p) // budget) for p in prompts)
        for x in (e, plain):
            assert x.kv.num_free_blocks == x.kv.num_usable_blocks
            assert all(x.cache.get(n).refcount == 0 for n in "abc")

    run()


def test_engine_logits_chunked_equal_unchunked(engines):
    chunked, plain, _ = engines
    g = torch.Generator().manual_seed(5)
    rows = [torch.randint(3, CFG.vocab_size, (n,), generator=g).tolist() for n in (1, 17, 40, 6)]
    names = ["a", None, "c", "b"]
    want = plain.logits(rows, adapters=names)
    for b in (1, 8):
        got = chunked[b].logits(rows, adapters=names)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # fp32; chunks change the reduction order only


def test_engine_decodes_every_step_while_a_long_prompt_prefills(engines):
    chunked, _, alone = engines
    e = chunked[8]
    short = e.add_request([5, 6, 7], "a", _sp("greedy", 40, 0))
    while not short.output_ids:
        e.step()
    long_prompt = torch.randint(3, CFG.vocab_size, (50,), generator=torch.Generator().manual_seed(9)).tolist()
    long = e.add_request(long_prompt, "b", _sp("seeded", 3, 11))
    before = e.stats()
    steps = 0
    while not long.output_ids:
        n = len(short.output_ids)
        e.step()
        steps += 1
        assert len(short.output_ids) == n + 1  # no stall
    assert steps == math.ceil(50 / (8 - 1))  # 7 prompt tokens beside the one decode token per step
    assert e.stats()["mixed_steps"] - before["mixed_steps"] == steps
    while e.has_unfinished():
        e.step()
    assert short.output_ids == alone([5, 6, 7], "a", _sp("greedy", 40, 0))
    assert long.output_ids == alone(long_prompt, "b", _sp("seeded", 3, 11))


def test_engine_abort_in_the_middle_of_a_chunked_prefill(engines):
    chunked, _, alone = engines
    e = chunked[3]
    prompt = list(range(10, 50))
    other = e.add_request([9, 8, 7, 6], "c", _sp("greedy", 12, 0))
    victim = e.add_request(prompt, "a", _sp("greedy", 5, 0))
    for _ in range(4):
        e.step()
    assert victim.status is Status.RUNNING and 0 < victim.computed < len(prompt)
    assert e.cache.get("a").refcount == 1
    assert e.abort(victim.request_id)
    assert victim.finish_reason == "abort" and not e.kv.has_seq(victim.seq_id)
    assert e.cache.get("a").refcount == 0
    while e.has_unfinished():
        e.step()
    assert other.output_ids == alone([9, 8, 7, 6], "c", _sp("greedy", 12, 0))
    assert e.kv.num_free_blocks == e.kv.num_usable_blocks
    assert all(e.cache.get(n).refcount == 0 and e.cache.get(n).queued == 0 for n in "abc")


def test_engine_adapter_aware_admission_reads_no_files_inside_steps(tmp_path):
    """Six requests for adapters registered on the disk tier (``preload=False``) arrive, with requests for a resident
    adapter, while a request runs. Unaware, each cold request is admitted at once and its files are read inside the
    step (``host_misses``); aware, each is passed over while its prefetch reads it, and no step reads files. The
    tokens are the same either way, and the same as each request run alone."""
    root = tmp_path / "adapters"
    cold = {f"d{i}": write_adapter(root / f"d{i}", CFG, 70 + i, 4, ("q_proj", "v_proj")) for i in range(6)}
    hot = write_adapter(root / "hot", CFG, 69, 4, TARGET_MODULES)
    g = torch.Generator().manual_seed(2)
    plan = [(torch.randint(3, CFG.vocab_size, (5 + i % 4,), generator=g).tolist(), f"d{i // 2}" if i % 2 == 0
             else "hot") for i in range(12)]
    got, stats = {}, {}
    for aware in (False, True):
        e = Engine(CFG, device="cpu", progress=False, max_seq_len=MAX_SEQ, max_lora_rank=8, max_batch_size=16,
                   adapter_slots=8, adapter_aware_admission=aware)
        e.load_adapter("hot", hot)
        for n, p in cold.items():
            e.load_adapter(n, p, preload=False)
        runner = e.add_request([4, 5, 6], "hot", _sp("greedy", 40, 0))
        e.step()
        reqs = []
        for prompt, name in plan:
            reqs.append(e.add_request(prompt, name, _sp("greedy", 4, 0)))
            e.step()
        while e.has_unfinished():
            e.step()
        got[aware] = [r.output_ids for r in [runner, *reqs]]
        stats[aware] = e.stats()
        e.cache.close()
    assert got[True] == got[False]
    assert stats[False]["host_misses"] == 6 and stats[False]["queue_defers_for_adapter_load"] == 0
    assert stats[True]["host_misses"] == 0 and stats[True]["queue_defers_for_adapter_load"] >= 6
    ref = Engine(CFG, device="cpu", progress=False, max_seq_len=MAX_SEQ, max_lora_rank=8, max_batch_size=1,
                 enable_chunked_prefill=False)
    ref.load_adapter("hot", hot)
    for n, p in cold.items():
        ref.load_adapter(n, p)
    for (prompt, name), out in zip(plan, got[True][1:]):
        assert out == ref.generate([prompt], adapters=[name], sampling=_sp("greedy", 4, 0))[0].token_ids


def test_engine_urgent_request_waits_for_its_read_outside_the_step(tmp_path, monkeypatch):
    """The real cache and engine: a request's adapter is registered on the disk tier and its prefetch read is held
    back (a gate in front of the I/O thread's read). Patience 2: passed over for 2 steps, then urgent; for 2 more
    steps it waits for the read outside the steps (the running request gets a token at each, no step blocks), then
    the read is let through and it is admitted; its tokens are those of the request run alone."""
    import threading

    root = tmp_path / "adapters"
    cold = write_adapter(root / "cold", CFG, 71, 4, ("q_proj", "v_proj"))
    hot = write_adapter(root / "hot", CFG, 69, 4, TARGET_MODULES)
    e = Engine(CFG, device="cpu", progress=False, max_seq_len=MAX_SEQ, max_lora_rank=8, max_batch_size=4,
               adapter_slots=4, starvation_patience=2)
    e.load_adapter("hot", hot)
    e.load_adapter("cold", cold, preload=False)
    gate = threading.Event()
    read = e.cache._prefetch_read

    def gated(*args, **kwargs):
        gate.wait(60)
        return read(*args, **kwargs)

    monkeypatch.setattr(e.cache, "_prefetch_read", gated)
    try:
        runner = e.add_request([4, 5, 6], "hot", _sp("greedy", 30, 0))
        e.step()
        req = e.add_request([7, 8, 9], "cold", _sp("greedy", 4, 0))
        for _ in range(4):  # 2 steps passed over (the read starts after the first), 2 waiting for the held read
            n = len(runner.output_ids)
            e.step()
            assert len(runner.output_ids) == n + 1 and req.status is Status.WAITING
        assert e.cache.reading(req.handle)
        assert e.stats()["queue_urgent_waits_for_adapter_read"] == 2 and e.stats()["host_misses"] == 0
    finally:
        gate.set()
    while e.has_unfinished():
        e.step()
    ref = Engine(CFG, device="cpu", progress=False, max_seq_len=MAX_SEQ, max_lora_rank=8, max_batch_size=1)
    ref.load_adapter("cold", cold)
    assert req.output_ids == ref.generate([[7, 8, 9]], adapters=["cold"], sampling=_sp("greedy", 4, 0))[0].token_ids
    e.cache.close()
