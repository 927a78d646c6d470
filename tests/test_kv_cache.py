"""The paged KV cache (issue 6): block bookkeeping, storage, and preemption end to end.

- ``BlockAllocator`` under a hypothesis state machine: no block owned twice, free + owned == every usable
  block, the null block 0 never handed out, a failed request changes nothing.
- ``PagedKVCache``: storage shape and bytes, layer views, ``ensure_capacity``, the docstring's example,
  concurrent use from threads.
- A real tiny engine whose KV cache holds a few blocks (block sizes 1, 4, 16): random requests (greedy
  and seeded sampling, three adapters through a pool for two, arriving in two waves) force preemption;
  every request finishes with the tokens it gets when run alone, and every block is free when idle.
- A request that could never fit in the whole cache is rejected at submission, naming the numbers.
- A sliding-window (Mistral) model with a tiny cache still generates exactly what transformers does.
"""

from __future__ import annotations

import threading

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

from multilora.memory.kv_cache import NULL_BLOCK, BlockAllocator, KVCacheFullError, PagedKVCache


# ------------------------------------------------------------------------------------ allocator
class AllocatorMachine(RuleBasedStateMachine):
    """The allocator against a plain model: owner -> number of blocks."""

    owners = Bundle("owners")

    def __init__(self):
        super().__init__()
        self.num_blocks = 9
        self.a = BlockAllocator(self.num_blocks)
        self.model: dict[int, int] = {}
        self.next_owner = 0

    @rule(target=owners, n=st.integers(0, 10))
    def allocate(self, n):
        owner, self.next_owner = self.next_owner, self.next_owner + 1
        free = self.a.num_free
        if n > free:
            with pytest.raises(KVCacheFullError, match=f"asked for {n} block.*{free} of 8 are free"):
                self.a.allocate(owner, n)
            assert not self.a.has(owner) and self.a.num_free == free
            return owner  # an owner without blocks: the other rules must cope
        assert self.a.can_allocate(n)
        blocks = self.a.allocate(owner, n)
        assert len(blocks) == n and self.a.blocks_of(owner) == blocks
        self.model[owner] = n
        return owner

    @rule(owner=owners, n=st.integers(0, 4))
    def append(self, owner, n):
        if owner not in self.model:
            with pytest.raises(KeyError):
                self.a.append(owner, n)
            return
        before, free = self.a.blocks_of(owner), self.a.num_free
        if n > free:
            with pytest.raises(KVCacheFullError):
                self.a.append(owner, n)
            assert self.a.blocks_of(owner) == before and self.a.num_free == free
            return
        new = self.a.append(owner, n)
        assert self.a.blocks_of(owner) == before + new  # appended at the end, earlier blocks keep their place
        self.model[owner] += n

    @rule(owner=consumes(owners))
    def free(self, owner):
        if owner not in self.model:
            with pytest.raises(KeyError):
                self.a.free(owner)
            return
        assert self.a.free(owner) == self.model.pop(owner)
        assert not self.a.has(owner)

    @rule(owner=owners)
    def allocate_twice_is_refused(self, owner):
        if owner in self.model:
            before = self.a.blocks_of(owner)
            with pytest.raises(ValueError, match="already owns"):
                self.a.allocate(owner, 1)
            assert self.a.blocks_of(owner) == before

    @invariant()
    def every_usable_block_free_or_owned_once(self):
        owned = [b for o in self.a.owners() for b in self.a.blocks_of(o)]
        assert len(owned) == len(set(owned)), f"a block has two owners: {owned}"
        assert NULL_BLOCK not in owned
        assert sorted(owned + self.a._free) == list(range(1, self.num_blocks))  # free + owned == all usable
        assert self.a.num_free + len(owned) == self.a.num_usable == self.num_blocks - 1
        assert {o: len(self.a.blocks_of(o)) for o in self.a.owners()} == self.model

    def teardown(self):
        for owner in list(self.model):
            self.a.free(owner)
        assert self.a.num_free == self.a.num_usable  # all blocks free when idle


TestAllocatorMachine = AllocatorMachine.TestCase
TestAllocatorMachine.settings = settings(max_examples=150, stateful_step_count=30, deadline=None, database=None)


def test_allocator_rejects_bad_sizes():
    with pytest.raises(ValueError, match="num_blocks must be an int >= 2"):
        BlockAllocator(1)
    a = BlockAllocator(4)
    with pytest.raises(ValueError, match="n_blocks must be an int >= 0"):
        a.allocate("x", -1)
    assert not a.has("x") and a.num_free == 3


# ---------------------------------------------------------------------------------- paged cache
def _cache(num_blocks=8, block_size=4, **kw):
    return PagedKVCache(num_layers=2, num_blocks=num_blocks, block_size=block_size, num_kv_heads=2, head_dim=8,
                        dtype=torch.float32, device="cpu", **kw)


def test_storage_shapes_and_bytes():
    kv = _cache()
    assert kv.k.shape == kv.v.shape == (2, 8, 4, 2, 8)
    per_token = PagedKVCache.bytes_per_token(2, 2, 8, torch.float32)
    assert per_token == 2 * 2 * 2 * 8 * 4
    assert kv.block_bytes == 4 * per_token and kv.nbytes == 8 * kv.block_bytes  # the null block is counted
    assert kv.num_usable_blocks == kv.num_free_blocks == 7
    assert [kv.blocks_for_tokens(n) for n in (1, 4, 5, 8, 9)] == [1, 1, 2, 2, 3]
    k1, v1 = kv.layer(1)
    assert k1.shape == (8, 4, 2, 8) and k1.is_contiguous()
    k1[3, 2] = 7.0
    assert float(kv.k[1, 3, 2].sum()) == 7.0 * 16  # a view, not a copy
    with pytest.raises(ValueError, match="block_size must be an int >= 1"):
        _cache(block_size=0)


def test_docstring_example_and_capacity():
    kv = _cache()
    assert kv.allocate_seq("a", 6) == [1, 2]
    assert kv.ensure_capacity("a", 8) and kv.block_table("a") == [1, 2]  # still fits: no new block
    assert kv.ensure_capacity("a", 9) and kv.block_table("a") == [1, 2, 3]
    assert kv.ensure_capacity("b", 16) and kv.block_table("b") == [4, 5, 6, 7]  # a new sequence is allocated
    assert kv.num_free_blocks == 0 and not kv.can_fit(1)
    assert not kv.ensure_capacity("a", 13)  # no free block: False, nothing changes
    assert kv.block_table("a") == [1, 2, 3]
    with pytest.raises(KVCacheFullError, match="'c' asked for 1 block"):
        kv.allocate_seq("c", 1)
    with pytest.raises(ValueError, match="already owns"):
        kv.allocate_seq("a", 1)
    kv.free_seq("a")
    assert not kv.has_seq("a") and kv.num_free_blocks == 3
    with pytest.raises(KeyError):
        kv.free_seq("a")
    kv.free_seq("b")
    assert kv.num_free_blocks == kv.num_usable_blocks


def test_concurrent_sequences_never_share_a_block():
    kv = _cache(num_blocks=33, block_size=2)
    errors = []

    def worker(t):
        try:
            for i in range(200):
                sid = (t, i)
                if kv.ensure_capacity(sid, 1 + (i * 7 + t) % 9):
                    if i % 3:
                        kv.ensure_capacity(sid, 12)
                    table = kv.block_table(sid)
                    assert NULL_BLOCK not in table
                    kv.free_seq(sid)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors
    assert kv.num_free_blocks == kv.num_usable_blocks and not kv.allocator.owners()


# ------------------------------------------------------------------------- engine: preemption
transformers = pytest.importorskip("transformers")

from multilora import Engine, SamplingParams  # noqa: E402
from multilora.runtime.scheduler import Status  # noqa: E402
from testsupport import one_thread  # noqa: E402,F401 (autouse fixture)
from testsupport import write_adapter as _write_adapter  # noqa: E402
from testsupport import tiny_llama_dir, TINY_LLAMA  # noqa: E402

VOCAB = 1024
MAX_SEQ = 32
MAX_BATCH = 4
MAX_PREFILL = 24
KV_TOKENS = 48  # 1.5 max-length sequences: random batches run out of blocks
BLOCK_SIZES = (1, 4, 16)
ADAPTERS = {"a": (61, 4, ("q_proj", "v_proj")), "b": (62, 4, ("o_proj", "down_proj")),
            "c": (63, 8, ("k_proj", "gate_proj", "up_proj"))}
TINY = dict(vocab_size=VOCAB, **TINY_LLAMA)


def _kv_bytes(blocks, block_size):
    return (blocks + 1) * block_size * PagedKVCache.bytes_per_token(2, 2, 16, torch.float32)  # + the null block


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(model dir, {adapter name: dir}): a tiny random GQA Llama without tokenizer and three adapters."""
    d = tiny_llama_dir(tmp_path_factory, VOCAB, "tiny-llama-kv")
    probe = Engine(model=str(d), device="cpu", progress=False, max_batch_size=1, max_seq_len=MAX_SEQ, max_lora_rank=8)
    root = tmp_path_factory.mktemp("kv-adapters")
    return d, {n: _write_adapter(root / n, probe.config, *spec) for n, spec in ADAPTERS.items()}


def _engine(tiny, **kw):
    d, dirs = tiny
    e = Engine(model=str(d), device="cpu", progress=False, max_seq_len=MAX_SEQ, max_lora_rank=8, **kw)
    for n, p in dirs.items():
        e.load_adapter(n, p)
    return e


@pytest.fixture(scope="module")
def alone(tiny):
    """tokens(prompt, adapter, sampling): the request run alone on an engine whose KV cache never runs out."""
    ref = _engine(tiny, max_batch_size=1, adapter_slots=len(ADAPTERS))
    memo = {}

    def tokens(prompt, adapter, sp):
        key = (tuple(prompt), adapter, sp.max_tokens, sp.temperature, sp.seed)
        if key not in memo:
            out = ref.generate([list(prompt)], adapters=[adapter], sampling=sp)[0]
            assert (out.finish_reason, out.error) == ("length", None)
            memo[key] = out.token_ids
        return memo[key]

    return tokens


def _check_kv(engine):
    """Bookkeeping after a step: blocks owned by running requests only, never twice, never block 0."""
    kv, sch = engine.kv, engine.scheduler
    assert sorted(kv.allocator.owners()) == sorted(r.seq_id for r in sch.running)
    owned = [b for r in sch.running for b in kv.block_table(r.seq_id)]
    assert len(owned) == len(set(owned)) and NULL_BLOCK not in owned
    assert len(owned) + kv.num_free_blocks == kv.num_usable_blocks
    assert len(sch.running) <= MAX_BATCH
    for r in sch.running:
        assert len(kv.block_table(r.seq_id)) * kv.block_size >= r.num_tokens - 1  # the KV written so far
        # the scheduler's record (it skips ensure_capacity below it) never claims more than the table holds
        assert 0 < r.kv_tokens <= len(kv.block_table(r.seq_id)) * kv.block_size
    for r in sch.waiting:
        assert r.status is Status.WAITING and not kv.has_seq(r.seq_id) and r.slot == -1 and r.kv_tokens == 0


def _sampling(kind, max_tokens, seed):
    if kind == "greedy":
        return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return SamplingParams(max_tokens=max_tokens, temperature=0.9, top_k=50, seed=seed, ignore_eos=True)


def run_waves(engine, first, later, steps_between, check):
    """Submit the ``first`` requests (``REQUEST`` tuples), step ``steps_between`` times, submit the ``later`` ones
    (a second wave arriving while the first runs), step until idle, with ``check()`` after every step. Returns
    ``(request, prompt, adapter, sampling)`` of each."""
    def submit(wave):
        return [(engine.add_request(list(p), a, _sampling(k, n, s)), p, a, _sampling(k, n, s))
                for p, a, n, k, s in wave]

    reqs = submit(first)
    for _ in range(steps_between):
        engine.step()
        check()
    reqs += submit(later)
    for _ in range(2000):
        if not engine.has_unfinished():
            break
        engine.step()
        check()
    assert not engine.has_unfinished()
    return reqs


REQUEST = st.tuples(
    st.lists(st.integers(3, VOCAB - 1), min_size=1, max_size=20),  # prompt
    st.sampled_from([None, "a", "b", "c"]),  # adapter (three adapters, a pool for two)
    st.integers(1, 16),  # max_tokens
    st.sampled_from(["greedy", "seeded"]),
    st.integers(0, 2**16),  # seed
)


@pytest.mark.parametrize("block_size,chunked", [(b, True) for b in BLOCK_SIZES] + [(4, False)])
def test_random_requests_through_a_small_cache_finish_as_alone(tiny, alone, block_size, chunked):
    engine = _engine(tiny, max_batch_size=MAX_BATCH, max_prefill_tokens=MAX_PREFILL, adapter_slots=2,
                     kv_block_size=block_size, kv_cache_bytes=_kv_bytes(KV_TOKENS // block_size, block_size),
                     enable_chunked_prefill=chunked)
    assert engine.kv.num_usable_blocks * block_size == KV_TOKENS
    sch = engine.scheduler
    schedule = sch.schedule

    def checked_schedule():  # a prefill of several requests keeps within max_prefill_tokens (recomputed ones too)
        picked = schedule()
        if chunked:  # prompt chunks within the prompt room; every decoding request in the step
            assert sum(r.chunk for r in picked.batch if r.prefilling) <= MAX_PREFILL
            assert all(r in picked.batch and r.chunk == 1 for r in sch.running if not r.prefilling)
        elif picked.kind == "prefill" and len(picked.batch) > 1:
            assert sum(r.num_tokens for r in picked.batch) <= MAX_PREFILL
        return picked

    sch.schedule = checked_schedule
    preemptions, recomputed = [], []

    @settings(max_examples=40, deadline=None, database=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow])
    @given(first=st.lists(REQUEST, min_size=3, max_size=8), later=st.lists(REQUEST, max_size=4),
           steps_between=st.integers(0, 6))
    def run(first, later, steps_between):
        before = engine.stats()
        reqs = run_waves(engine, first, later, steps_between, lambda: _check_kv(engine))
        for req, p, a, sp in reqs:
            assert (req.finish_reason, req.error) == ("length", None)
            assert req.output_ids == alone(p, a, sp), (
                f"{a!r} {sp.temperature} after {req.preemptions} preemption(s): {req.output_ids} != alone")
        # idle: every block free, no reference left
        assert engine.kv.num_free_blocks == engine.kv.num_usable_blocks and not engine.kv.allocator.owners()
        assert all(engine.cache.get(n).refcount == 0 and engine.cache.get(n).queued == 0 for n in ADAPTERS)
        after = engine.stats()
        assert after["kv_blocks_free"] == after["kv_blocks_total"] == KV_TOKENS // block_size
        preemptions.append(after["preemptions"] - before["preemptions"])
        recomputed.append(after["recomputed_tokens"] - before["recomputed_tokens"])

    run()
    assert sum(preemptions) > 0, f"block size {block_size}: no request was ever preempted"
    assert sum(recomputed) > 0
    engine.cache.close()


def test_request_that_could_never_fit_is_rejected_at_submission(tiny):
    engine = _engine(tiny, max_batch_size=2, kv_block_size=4, kv_cache_bytes=_kv_bytes(6, 4))
    assert engine.kv.num_usable_blocks == 6  # 24 tokens, less than one max_seq_len (32) sequence
    with pytest.raises(ValueError, match=r"20 prompt tokens \+ max_tokens=8 .* = 28 tokens need 7 KV blocks of 4 "
                                         r"tokens; the whole KV cache has 6"):
        engine.add_request(list(range(3, 23)), None, _sampling("greedy", 8, 0))
    with pytest.raises(ValueError, match=r"= 32 tokens need 8 KV blocks"):  # max_tokens is capped by max_seq_len
        engine.add_request(list(range(3, 23)), None, _sampling("greedy", 1000, 0))
    with pytest.raises(ValueError, match=r"prompts\[1\]: request: .* need 7 KV blocks"):
        engine.generate([[5, 6, 7], list(range(3, 23))], sampling=_sampling("greedy", 8, 0))
    assert not engine.has_unfinished()  # nothing was queued
    # the largest request that fits (24 tokens) runs, alone or beside another one (which is then preempted)
    outs = engine.generate([list(range(3, 19)), [9, 8, 7]], sampling=_sampling("greedy", 8, 0))
    assert [(o.finish_reason, len(o.token_ids)) for o in outs] == [("length", 8), ("length", 8)]
    assert engine.stats()["kv_blocks_free"] == 6
    engine.cache.close()


# ------------------------------------------------------------------------ sliding window (Mistral)
MISTRAL_ROWS = (12, 11, 5)
GEN = 8


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    """(model dir, HF model, rows, greedy reference tokens) of a tiny random Mistral with a window of 4."""
    torch.manual_seed(0)
    model = transformers.MistralForCausalLM(transformers.MistralConfig(**TINY, sliding_window=4)).eval()
    d = tmp_path_factory.mktemp("tiny-mistral")
    model.save_pretrained(str(d))
    g = torch.Generator().manual_seed(7)
    rows = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in MISTRAL_ROWS]
    with torch.no_grad():
        ref = [model.generate(torch.tensor([r]), max_new_tokens=GEN, min_new_tokens=GEN, do_sample=False,
                              pad_token_id=0)[0, len(r):].tolist() for r in rows]
        logits = [model(input_ids=torch.tensor([r])).logits[0, -1].float() for r in rows]
    return d, rows, ref, logits


@pytest.mark.parametrize("block_size,blocks", [(1, 24), (4, 6), (16, 3)])
def test_sliding_window_model_matches_transformers_with_preemption(mistral, block_size, blocks):
    d, rows, ref, ref_logits = mistral
    engine = Engine(model=str(d), device="cpu", progress=False, max_seq_len=MAX_SEQ, max_batch_size=3,
                    kv_block_size=block_size, kv_cache_bytes=_kv_bytes(blocks, block_size))
    assert engine.config.sliding_window == 4 and engine.kv.num_usable_blocks == blocks
    outs = engine.generate(rows, sampling=SamplingParams(max_tokens=GEN, temperature=0.0, ignore_eos=True))
    assert [o.token_ids for o in outs] == ref
    assert engine.stats()["preemptions"] > 0
    ours = engine.logits(rows)  # rows in chunks that fit the cache
    for o, r in zip(ours, ref_logits):
        assert float((o - r).norm() / r.norm()) < 1e-4
    assert engine.stats()["kv_blocks_free"] == blocks
