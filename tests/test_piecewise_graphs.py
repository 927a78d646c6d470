"""Piecewise CUDA graphs of prefill and mixed steps (``runtime.cuda_graphs.PiecewiseGraphs``, the runner's
``StepBuffers`` / ``piecewise_step``), their bookkeeping on the CPU; the graphs themselves: tests/test_engine_gpu.py.

``runner.enable_pieces(n, capture=False)`` runs exactly the pieces a step's graphs would replay (the static plan of
the runner's ``StepBuffers``, the step padded to its token bucket, padding tokens pointed at the KV cache's null block
with no adapter, attention eager between the pieces over the real tokens) but eagerly, so the staging, the padding,
the piece boundaries and the static plan are checked here against the engine's ordinary eager path. With
``capture=True`` and the capture replaced by eager stand-ins, the replay order (one warm-up run, then replays with
attention between) is checked too.
"""

from __future__ import annotations

import pytest
import torch

from multilora import Engine, EngineConfig, SamplingParams
from multilora.config import TARGET_MODULES, ModelConfig
from multilora.runtime import cuda_graphs
from multilora.runtime.cuda_graphs import PiecewiseGraphs, token_buckets
from multilora.runtime.runner import PIECEWISE_MAX_TOKENS
from multilora.runtime.weights import MODEL_SHAPES
from testsupport import one_thread  # noqa: F401 (autouse fixture)
from testsupport import write_adapter

CFG = ModelConfig(**MODEL_SHAPES["tiny"])


def test_token_buckets():
    assert token_buckets(0) == [] and token_buckets(-3) == []
    assert token_buckets(1) == [16] and token_buckets(16) == [16] and token_buckets(17) == [16, 32]
    b = token_buckets(2048)
    assert b[:8] == list(range(16, 129, 16)) and b[-1] == 2048 and 512 in b and 1024 in b
    for n in (1, 40, 100, 128, 129, 500, 777, 2048, 3000):
        b = token_buckets(n)
        assert b == sorted(set(b)) and b[-1] >= n and b[-1] - n < 16 and all(x % 16 == 0 for x in b)
        # past 128 tokens a step is padded by at most 1/8 of its size (up to 1,024: by 1/2 of a step of 64)
        for t in range(1, n + 1, 7):
            pad = next(x for x in b if x >= t) - t
            assert pad < 16 or pad <= t // 2, (n, t, pad)


def _engine(tmp_path, pieces: int = 64, *, capture: bool = False, **kw):
    kw.setdefault("max_batch_size", 6)
    e = Engine(CFG, device="cpu", progress=False, max_seq_len=80, kv_block_size=4, max_lora_rank=8, adapter_slots=3,
               kv_cache_bytes=40 * 4 * CFG.num_layers * 2 * CFG.num_kv_heads * CFG.head_dim * 4, **kw)
    for i in range(3):
        e.load_adapter(f"a{i}", write_adapter(tmp_path / f"a{i}", CFG, seed=i, rank=4 + 2 * i, modules=TARGET_MODULES))
    if pieces:
        e.runner.enable_graphs(capture=False)
        e.runner.enable_pieces(pieces, capture=capture)
    return e


def _work(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, CFG.vocab_size, (int(n),), generator=g).tolist() for n in (9, 30, 14, 5, 70, 2)]
    adapters = ["a0", None, "a1", "a2", "a0", None]
    params = [SamplingParams(max_tokens=n, ignore_eos=True, temperature=0) for n in (6, 3, 8, 5, 4, 7)]
    return prompts, adapters, params


@pytest.mark.parametrize("chunked", [True, False])
def test_piecewise_steps_generate_what_eager_steps_do(tmp_path, chunked):
    """Greedy generations with prefill and mixed steps through the pieces equal the eager engine's: steps of many
    token buckets, with and without LoRA; chunked (budget 24): prompt chunks beside decode rows; unchunked (prefill
    steps of up to 100 tokens): the steps past the largest bucket (64), a 70-token prompt among them, take the eager
    path."""
    prompts, adapters, params = _work()
    kw = dict(max_num_batched_tokens=24) if chunked else dict(enable_chunked_prefill=False, max_prefill_tokens=100,
                                                               max_batch_size=3)
    want = [o.token_ids for o in _engine(tmp_path / "e", 0, **kw).generate(prompts, adapters=adapters, sampling=params)]
    e = _engine(tmp_path / "p", **kw)
    eager = []
    build = e.runner.build_plan
    e.runner.build_plan = lambda token_ids, *a, **k: eager.append(sum(map(len, token_ids))) or build(token_ids, *a, **k)
    assert [o.token_ids for o in e.generate(prompts, adapters=adapters, sampling=params)] == want
    assert e.runner.pieces.captured
    s = e.stats()
    assert s["mixed_steps"] > 0 if chunked else s["prefill_steps"] > 0
    assert all(t > 64 for t in eager) and (bool(eager) != chunked), eager  # eager: only steps past every bucket
    assert s["eager_steps"] == len(eager) and s["piecewise_graph_steps"] > 0 and s["graph_steps"] > 0
    assert s["eager_steps"] + s["piecewise_graph_steps"] + s["graph_steps"] == s["steps"]
    assert e.kv.num_free_blocks == e.kv.num_usable_blocks


def test_one_piecewise_step_equals_the_eager_forward_and_pads_into_the_null_block(tmp_path):
    """One mixed step (two decode rows, a prompt chunk; adapters and none) through the pieces against the eager
    forward on the same KV state: the same logits, and the padded step writes K/V at the real tokens' slots and in
    the null block 0 only."""
    e = _engine(tmp_path, capture=False)
    r = e.runner
    slots = [e.cache.acquire(e.cache.get("a1")), -1, e.cache.acquire(e.cache.get("a0"))]
    rows = [[5, 9, 11, 3, 7], [4, 4, 8]]
    tables = [e.kv.allocate_seq(("s", i), 20) for i in range(3)]
    r.run_eager(rows, [0, 0], tables[:2], slots[:2])  # two prompts in the cache
    step = [[7], [8], list(range(3, 16))]  # decode, decode, a 13-token chunk: 15 tokens -> bucket 16
    starts = [5, 3, 0]
    before = e.kv.k.clone()
    with torch.inference_mode():
        got = r.piecewise_step(step, starts, tables, slots)
    written = (e.kv.k != before).any(dim=(0, 3, 4)).nonzero().tolist()  # (block, offset) pairs
    bs = e.kv.block_size
    real = {(tables[b][p // bs], p % bs) for b, (t, s0) in enumerate(zip(step, starts)) for p in range(s0, s0 + len(t))}
    assert set(map(tuple, written)) - {(0, 0)} == real
    e.kv.k.copy_(before)  # the same KV state for the eager forward (it rewrites the step's own slots)
    want = r.run_eager(step, starts, tables, slots)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    d = r.step_buffers.d  # the staged padding: token 0 at position 0, KV slot 0, no adapter
    assert d["input_ids"][15:16].tolist() == [0] and d["positions"][15:16].tolist() == [0]
    assert d["slot_mapping"][15:16].tolist() == [0] and d["token_slots"][:16].tolist() == [slots[0], -1] + [slots[2]] * 13 + [-1]
    # only some rows sample (a chunk that stops short of its prompt's end): their logits, in batch order
    with torch.inference_mode():
        part = r.piecewise_step(step, starts, tables, slots, sample=[True, False, True])
    torch.testing.assert_close(part, want[[0, 2]], atol=1e-5, rtol=1e-5)
    with torch.inference_mode():
        none = r.piecewise_step([[3, 4]], [0], [tables[2]], [-1], sample=[False])
    assert none.shape == (0, CFG.vocab_size)


class _Replay:
    """Stands in for one captured piece on the CPU: ``replay()`` runs the piece again on the captured context."""

    def __init__(self, piece, ctx, k, log):
        self.piece, self.ctx, self.k, self.log = piece, ctx, k, log

    def replay(self) -> None:
        self.log.append(("replay", self.k, self.ctx.bucket, self.ctx.plan.lora.has_lora))
        with torch.inference_mode():
            self.piece(self.ctx, self.k)


def _fake_capture(monkeypatch, log):
    def record(self, ctx, piece, between):
        last = self.num_pieces - 1
        for k in range(self.num_pieces):  # the eager warm-up run of the real _record
            log.append(("warm", k, ctx.bucket, ctx.plan.lora.has_lora))
            piece(ctx, k)
            if k < last:
                between(k)
        return [_Replay(piece, ctx, k, log) for k in range(self.num_pieces)]

    monkeypatch.setattr(PiecewiseGraphs, "_record", record)


def test_replay_path_runs_attention_between_the_pieces_and_equals_eager(tmp_path, monkeypatch):
    """With capture on (stood in for): the first step of a key runs once eagerly, then replays; every step replays
    num_layers + 1 pieces in order with the attention of layer k after piece k; the first capture is of the largest
    bucket (it lays out the shared pool); generations equal the eager engine's."""
    log: list = []
    _fake_capture(monkeypatch, log)
    prompts, adapters, params = _work(3)
    want = [o.token_ids for o in _engine(tmp_path / "e", 0, max_num_batched_tokens=24)
            .generate(prompts, adapters=adapters, sampling=params)]
    e = _engine(tmp_path / "p", capture=True, max_num_batched_tokens=24)
    calls: list = []
    attend = e.model.attend

    def spy(i, *a, **kw):
        calls.append(i)
        return attend(i, *a, **kw)

    e.model.attend = spy
    assert [o.token_ids for o in e.generate(prompts, adapters=adapters, sampling=params)] == want
    L = CFG.num_layers
    assert log[: L + 1] == [("warm", k, 64, True) for k in range(L + 1)]  # the largest bucket first
    replays = [k for what, k, *_ in log if what == "replay"]
    assert replays and len(replays) % (L + 1) == 0 and replays == list(range(L + 1)) * (len(replays) // (L + 1))
    used = [(b, o) for what, k, b, o in log if what == "warm" and k == 0]
    assert len(used) == len(set(used)) == len(e.runner.pieces.captured) >= 2  # each key warmed once, then replayed
    assert calls and set(calls) == set(range(L))


def test_warm_pieces_captures_every_bucket_largest_first_and_writes_only_the_null_block(tmp_path, monkeypatch):
    log: list = []
    _fake_capture(monkeypatch, log)
    e = _engine(tmp_path, capture=True)
    order = []
    run = e.runner.pieces.run

    def spy(key, *a, **kw):
        order.append(key)
        return run(key, *a, **kw)

    e.runner.pieces.run = spy
    before = e.kv.k.clone()
    n = e.runner.warm_pieces()
    buckets = token_buckets(64)
    assert n == 2 * len(buckets) and set(e.runner.pieces.captured) == {(b, o) for b in buckets for o in (True, False)}
    assert [b for b, _ in order] == sorted([b for b, _ in order], reverse=True)
    changed = (e.kv.k != before).any(dim=(0, 2, 3, 4)).nonzero().flatten().tolist()
    assert set(changed) <= {0}
    assert e.runner.warm_pieces() == 0  # all captured: nothing again


def test_engine_warmup_reports_piecewise_graphs(tmp_path):
    e = _engine(tmp_path, max_prefill_tokens=40)
    got = e.warmup("a1")
    assert got["piecewise_graphs"] == 2 * len(token_buckets(64))
    assert e.kv.num_free_blocks == e.kv.num_usable_blocks and not e.has_unfinished()


def test_reset_graphs_drops_decode_and_piecewise_graphs(tmp_path):
    e = _engine(tmp_path, max_num_batched_tokens=24)
    prompts, adapters, params = _work(5)
    e.generate(prompts, adapters=adapters, sampling=params)
    assert e.runner.pieces.captured and e.runner.graphs.captured
    e.runner.reset_graphs()
    assert e.runner.pieces.captured == [] and e.runner.graphs.captured == []


def test_piecewise_tokens_and_config(tmp_path):
    """The engine's choice: ``PIECEWISE_MAX_TOKENS`` capped by the step budget, 0 when off or unsupported (here: no
    CUDA, so a CPU engine never enables them itself); the option is validated."""
    e = _engine(tmp_path, 0)
    r = e.runner
    assert not r.piecewise_supported() and r.piecewise_tokens(None, 4096) == 0 and r.pieces is None
    r.piecewise_supported = lambda: True
    assert r.piecewise_tokens(None, 4096) == PIECEWISE_MAX_TOKENS == 2048
    assert r.piecewise_tokens(None, 512) == 512 and r.piecewise_tokens(300, 4096) == 300
    assert r.piecewise_tokens(0, 4096) == 0
    assert EngineConfig(piecewise_cuda_graph_max_tokens=0).piecewise_cuda_graph_max_tokens == 0
    for bad in (-1, 1.5, "64"):
        with pytest.raises(ValueError, match="piecewise_cuda_graph_max_tokens"):
            EngineConfig(piecewise_cuda_graph_max_tokens=bad)
    assert cuda_graphs.PiecewiseGraphs(3, [16, 32], torch.device("cpu")).bucket_for(33) is None


def test_piecewise_lora_grid_takes_the_batch_not_the_pools_slots(tmp_path, monkeypatch):
    """The piecewise graphs' static LoRA plan says a step holds at most ``max_batch_size`` distinct adapters
    (``LoRAPlan.num_segments``), so the Triton launches size their grid by the batch instead of the pool's slots;
    a step through the pieces (Triton backend, on the interpreter here) gives the bits of the same step with the grid
    at the pool's bound (``GRID_BY_SEGMENTS`` False) and the eager forward's logits; a step of more sequences than
    the batch is refused (never staged by the engine: its scheduler runs at most ``max_batch_size``)."""
    from multilora.kernels import triton_sgmv

    e = _engine(tmp_path, capture=False, max_batch_size=2, lora_backend="triton")
    r = e.runner
    assert r.step_buffers.max_segments == 2 and e.pool.max_slots == 3
    assert r.step_buffers.context(16, True, e.kv.block_size).plan.lora.num_segments == 2
    slots = [e.cache.acquire(e.cache.get("a1")), e.cache.acquire(e.cache.get("a2"))]
    tables = [e.kv.allocate_seq(("s", i), 20) for i in range(2)]
    step, starts = [[5, 9, 11, 3, 7], list(range(3, 12))], [0, 0]
    before = e.kv.k.clone(), e.kv.v.clone()
    got, grids = {}, {}
    launch = triton_sgmv._sgmv_expand_kernel
    for by_segments in (True, False):
        monkeypatch.setattr(triton_sgmv, "GRID_BY_SEGMENTS", by_segments)
        seen = []

        class Count:  # the expand launches' grids
            def __getitem__(self, grid):
                seen.append(grid[0])
                return launch[grid]

        monkeypatch.setattr(triton_sgmv, "_sgmv_expand_kernel", Count())
        e.kv.k.copy_(before[0]), e.kv.v.copy_(before[1])
        with torch.inference_mode():
            got[by_segments] = r.piecewise_step(step, starts, tables, slots)
        grids[by_segments] = set(seen)
        monkeypatch.setattr(triton_sgmv, "_sgmv_expand_kernel", launch)
    assert torch.equal(got[True], got[False])
    assert grids == {True: {1 + 2}, False: {1 + 3}}  # bucket 16, block_m 16: + the batch (2), + the pool's slots (3)
    monkeypatch.setattr(triton_sgmv, "GRID_BY_SEGMENTS", True)
    e.kv.k.copy_(before[0]), e.kv.v.copy_(before[1])
    with torch.inference_mode():
        want = r.run_eager(step, starts, tables, slots)
    torch.testing.assert_close(got[True], want, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="3 sequences in one step, more than max_segments=2"):
        r.step_buffers.stage(16, [[1], [2], [3]], [0, 0, 0], [slots[0], -1, slots[1]], None)
