"""The CUDA-graph decode path's bookkeeping, on the CPU (the graphs themselves: tests/test_engine_gpu.py).

``runner.enable_graphs(capture=False)`` runs exactly the step a graph would replay (the static plan of the
runner's ``DecodeBuffers``, batch padded to its bucket, padding rows pointed at the KV cache's null block with
no adapter) but eagerly, so the buffer filling, the padding and the static plan itself (through the torch
backends) are checked here against the engine's ordinary decode path.
"""

from __future__ import annotations

import pytest
import torch

from multilora import Engine, SamplingParams
from multilora.config import TARGET_MODULES, ModelConfig
from multilora.kernels.lora import chunk_table
from multilora.runtime.cuda_graphs import bucket_sizes
from multilora.runtime.weights import MODEL_SHAPES
from testsupport import one_thread  # noqa: F401 (autouse fixture)
from testsupport import write_adapter

CFG = ModelConfig(**MODEL_SHAPES["tiny"])


def test_bucket_sizes():
    assert bucket_sizes(1) == [1]
    assert bucket_sizes(6) == [1, 2, 4, 6]
    assert bucket_sizes(16) == [1, 2, 4, 8, 16]
    assert bucket_sizes(40) == [1, 2, 4, 8, 16, 32, 40]
    for n in (1, 3, 17, 64, 100, 256):
        b = bucket_sizes(n)
        assert b == sorted(set(b)) and b[-1] == n and all(1 <= x <= n for x in b)


def _engine(tmp_path, graphs: bool, **kw):
    e = Engine(CFG, device="cpu", progress=False, max_batch_size=6, max_seq_len=48, kv_block_size=4, max_lora_rank=8,
               adapter_slots=3, kv_cache_bytes=12 * 4 * CFG.num_layers * 2 * CFG.num_kv_heads * CFG.head_dim * 4, **kw)
    for i in range(3):
        e.load_adapter(f"a{i}", write_adapter(tmp_path / f"a{i}", CFG, seed=i, rank=4 + 2 * i, modules=TARGET_MODULES))
    if graphs:
        e.runner.enable_graphs(capture=False)
    return e


@pytest.mark.parametrize("block_size_tokens", [4])
def test_padded_static_decode_equals_eager(tmp_path, block_size_tokens):
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, CFG.vocab_size, (int(n),), generator=g).tolist() for n in (9, 3, 14, 5, 7, 2)]
    adapters = ["a0", None, "a1", "a2", "a0", None]
    params = [SamplingParams(max_tokens=n, ignore_eos=True, temperature=t, seed=7)
              for n, t in zip((10, 2, 6, 10, 1, 8), (0, 0, 0.8, 0, 0, 1.0))]
    outs = {}
    for graphs in (False, True):
        e = _engine(tmp_path / str(graphs), graphs)
        outs[graphs] = [o.token_ids for o in e.generate(prompts, adapters=adapters, sampling=params)]
        if graphs:
            used = {b for b, _ in e.graphs._graphs}
            assert len(used) >= 3, used  # the batch shrank through several buckets (6 -> 4 -> 2 ...)
            assert e.stats()["preemptions"] > 0  # re-admitted requests came back with new block tables
            assert e.kv.num_free_blocks == e.kv.num_usable_blocks
    assert outs[True] == outs[False]


def test_padding_rows_touch_only_the_null_block(tmp_path):
    """A padded step writes K/V only at the real rows' slots and in the null block 0."""
    e = _engine(tmp_path, graphs=True)
    tables = [e.kv.allocate_seq(("s", i), 6) for i in range(3)]  # bucket 4: one padding row
    before_k = e.kv.k.clone()
    with torch.inference_mode():
        e.runner.decode_graph([5, 6, 7], [5, 2, 0], tables, [-1, 0, -1])
    changed = (e.kv.k != before_k).any(dim=(0, 3, 4)).nonzero().tolist()  # (block, offset) pairs written
    want = {(tables[0][1], 1), (tables[1][0], 2), (tables[2][0], 0)}
    assert set(map(tuple, changed)) - {(0, 0)} == want


class _EagerReplay:
    """Stands in for a captured CUDA graph on the CPU: ``replay()`` runs the captured plan again, reading the
    static buffers as the graph would, and writes the same logits buffer."""

    def __init__(self, forward, plan):
        self.forward, self.plan = forward, plan
        with torch.inference_mode():
            self.logits = forward(plan).clone()  # the warm-up run of _record

    def replay(self) -> None:
        with torch.inference_mode():
            self.logits.copy_(self.forward(self.plan))


def _replay_engine(tmp_path, **kw):
    """An engine whose decode steps take the graph path of ``ModelRunner.decode_graph`` (capture, staging, one
    copy of the shared buffer, replay) with the graph replaced by ``_EagerReplay``; Triton LoRA (interpreted on
    the CPU) reads the chunk table from the shared buffer, as the captured kernels do."""
    e = _engine(tmp_path, graphs=False, lora_backend="triton", attention_backend="torch", **kw)
    g = e.runner.enable_graphs(capture=True)

    def record(plan):
        r = _EagerReplay(g._forward, plan)
        return r, r.logits

    g._record = record
    return e


@pytest.mark.parametrize("chunked", [False, True])
def test_graph_replay_path_equals_eager(tmp_path, chunked):
    """Greedy generation through the replay path equals eager decode (unchunked): buckets shrink (6 -> 4 -> 2 -> 1),
    LoRA graphs and no-LoRA graphs alternate over the shared chunk field, preempted requests return with new block
    tables (unchunked); chunked, decode steps replay graphs between mixed steps that run eagerly."""
    pytest.importorskip("triton")
    if torch.cuda.is_available() or __import__("os").environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CPU check under the Triton interpreter (the GPU runs real graphs: test_engine_gpu.py)")
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, CFG.vocab_size, (int(n),), generator=g).tolist() for n in (9, 3, 14, 5, 7, 2)]
    adapters = ["a0", None, "a1", "a2", "a0", None]
    params = [SamplingParams(max_tokens=n, ignore_eos=True, temperature=0) for n in (3, 12, 5, 4, 2, 7)]
    eager = _engine(tmp_path / "eager", graphs=False, enable_chunked_prefill=False)
    want = [o.token_ids for o in eager.generate(prompts, adapters=adapters, sampling=params)]
    e = _replay_engine(tmp_path / "replay", enable_chunked_prefill=chunked)
    got = [o.token_ids for o in e.generate(prompts, adapters=adapters, sampling=params)]
    assert got == want
    assert {lora for _, lora in e.graphs.captured} == {False, True}
    assert len({b for b, _ in e.graphs.captured}) >= 3, e.graphs.captured
    s = e.stats()
    assert s["preemptions"] > 0 if not chunked else s["mixed_steps"] > 0 and s["decode_steps"] > 0
    assert e.kv.num_free_blocks == e.kv.num_usable_blocks


@pytest.mark.parametrize("written_from", [8, 1], ids=["zeroed-decode", "written-decode"])
def test_graphs_reset_captures_again_with_the_deferred_lora_path(tmp_path, written_from, monkeypatch):
    """``DecodeGraphs.reset`` drops every graph; the next steps capture again, here with the model switched to the
    deferred LoRA adds (the GPU's side-stream path, on one stream here), and generate what eager decode does. The
    deferred term is written by ``lora_delta`` from ``LORA_DELTA_OVERWRITE_MIN_TOKENS`` tokens: the prefills (18
    tokens) either way, the decode steps (buckets of up to 4 rows, a row without an adapter and padding rows among
    them) only with the minimum at 1."""
    from multilora.runtime import model as model_mod

    monkeypatch.setattr(model_mod, "LORA_DELTA_OVERWRITE_MIN_TOKENS", written_from)
    pytest.importorskip("triton")
    if torch.cuda.is_available() or __import__("os").environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CPU check under the Triton interpreter (the GPU runs real graphs: test_engine_gpu.py)")
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, CFG.vocab_size, (int(n),), generator=g).tolist() for n in (6, 3, 9)]
    adapters = ["a0", "a2", None]
    params = [SamplingParams(max_tokens=n, ignore_eos=True, temperature=0) for n in (5, 3, 4)]
    want = [o.token_ids for o in _engine(tmp_path / "eager", graphs=False).generate(prompts, adapters=adapters,
                                                                                    sampling=params)]
    e = _replay_engine(tmp_path / "replay")
    assert [o.token_ids for o in e.generate(prompts, adapters=adapters, sampling=params)] == want
    assert e.graphs.captured
    e.model.lora_side_max_tokens = 1 << 20
    e.graphs.reset()
    assert e.graphs.captured == []
    assert [o.token_ids for o in e.generate(prompts, adapters=adapters, sampling=params)] == want
    assert any(lora for _, lora in e.graphs.captured)


def test_graph_replay_logits_and_staging(tmp_path):
    """One replayed step against the eager forward on the same KV state, then the staged buffers: padding rows
    (token 0, position 0, KV slot 0, context 1, no adapter, a zero block table) and the chunk field."""
    pytest.importorskip("triton")
    if torch.cuda.is_available() or __import__("os").environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CPU check under the Triton interpreter")

    e = _replay_engine(tmp_path)
    rows = [[5, 9, 11, 3, 7], [4, 4, 8], [10, 2, 6, 6, 1, 12, 13]]
    slots = [e.cache.acquire(e.cache.get("a1")), -1, e.cache.acquire(e.cache.get("a0"))]
    tables = [e.kv.allocate_seq(("s", i), len(r) + 1) for i, r in enumerate(rows)]
    e.runner.run_eager(rows, [0] * 3, tables, slots)  # prefill: fills the KV cache
    nxt, pos = [7, 8, 9], [len(r) for r in rows]
    for sl in (slots, [-1, -1, -1], slots):  # LoRA, no LoRA, LoRA again: the chunk field is rewritten
        eager = e.runner.run_eager([[t] for t in nxt], pos, tables, sl)
        with torch.inference_mode():
            got = e.runner.decode_graph(nxt, pos, tables, sl)
        torch.testing.assert_close(got, eager, atol=1e-4, rtol=1e-4)
    gr = e.runner.buffers.d
    bs = e.kv.block_size
    assert gr["input_ids"][:4].tolist() == nxt + [0] and gr["positions"][:4].tolist() == pos + [0]
    assert gr["slot_mapping"][:4].tolist() == [t[p // bs] * bs + p % bs for t, p in zip(tables, pos)] + [0]
    assert gr["seq_lens"][:4].tolist() == [p + 1 for p in pos] + [1]
    assert gr["token_slots"][:4].tolist() == slots + [-1]
    assert gr["block_tables"][:4].tolist() == [t + [0] * (12 - len(t)) for t in tables] + [[0] * 12]
    want = torch.full((4, 4), 0, dtype=torch.int32)
    want[1] = -1
    want[:, :3] = chunk_table(slots, 16, torch.device("cpu"))
    assert torch.equal(e.graphs._graphs[(4, True)].plan.lora.chunks, want)
    # a shorter table in the same row is zero-filled past its end (rows are rewritten only when they change)
    short = [tables[1], tables[0], tables[2]]  # row 0: 2 blocks -> 1
    assert len(short[0]) < len(tables[0])
    with torch.inference_mode():
        e.runner.decode_graph(nxt, [3, 2, 1], short, slots)
    assert gr["block_tables"][:3].tolist() == [t + [0] * (12 - len(t)) for t in short]


def test_static_graph_plan_applies_adapters_through_the_torch_backend(tmp_path):
    """The graph path's plan is its static buffers, complete: run through the torch LoRA and attention
    backends (``capture=False``) it gives the adapter's output, as the eager plan does; a placeholder LoRA plan
    would give the base model's. The plan's tensors are views of the runner's one device buffer."""
    e = _engine(tmp_path, graphs=True, lora_backend="torch", attention_backend="torch")
    rows = [[5, 9, 11, 3, 7], [4, 4, 8]]
    slots = [e.cache.acquire(e.cache.get("a2")), e.cache.acquire(e.cache.get("a0"))]
    tables = [e.kv.allocate_seq(("s", i), len(r) + 1) for i, r in enumerate(rows)]
    e.runner.run_eager(rows, [0, 0], tables, slots)
    nxt, pos = [7, 8], [len(r) for r in rows]
    with torch.inference_mode():
        got = e.runner.decode_graph(nxt, pos, tables, slots)
    adapted = e.runner.run_eager([[t] for t in nxt], pos, tables, slots)
    base = e.runner.run_eager([[t] for t in nxt], pos, tables, [-1, -1])
    torch.testing.assert_close(got, adapted, atol=1e-5, rtol=1e-5)
    assert float((adapted - base).norm() / base.norm()) > 1e-2  # the adapters change the output
    plan = e.graphs._graphs[(2, True)].plan
    buf = e.runner.buffers._dev.untyped_storage().data_ptr()
    assert plan.lora.has_lora and all(t.untyped_storage().data_ptr() == buf for t in (
        plan.lora.chunks, plan.lora.token_slots, plan.input_ids, plan.attn.block_tables, plan.attn.seq_lens))


def test_warmup_reaches_every_bucket_and_leaves_the_engine_as_it_was(tmp_path):
    """``Engine.warmup`` steps every decode bucket with and without the adapter (graph keys (bucket, lora)), runs
    prefills at its prompt lengths (here capped at max_prefill_tokens 40) and a mixed step, frees every KV block,
    and later generations equal those of an engine that was never warmed up."""
    e = _engine(tmp_path / "w", graphs=True, max_prefill_tokens=40)
    got = e.warmup("a1")
    assert got["requests"] > 0 and got["seconds"] >= 0
    assert set(e.graphs.captured) == {(b, lora) for b in bucket_sizes(6) for lora in (False, True)}
    assert got["decode_graphs"] == 2 * len(bucket_sizes(6))
    assert e.kv.num_free_blocks == e.kv.num_usable_blocks and not e.has_unfinished()
    steps = e.stats()["step_seconds"]
    assert {"prefill", "decode", "mixed"} <= set(steps), steps
    fresh = _engine(tmp_path / "f", graphs=True, max_prefill_tokens=40)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, CFG.vocab_size, (n,), generator=g).tolist() for n in (9, 3, 14)]
    sp = SamplingParams(max_tokens=6, ignore_eos=True)
    assert ([o.token_ids for o in e.generate(prompts, adapters=["a0", None, "a2"], sampling=sp)]
            == [o.token_ids for o in fresh.generate(prompts, adapters=["a0", None, "a2"], sampling=sp)])


def test_warmup_errors(tmp_path):
    e = _engine(tmp_path, graphs=False)
    with pytest.raises(KeyError, match=r"warmup: adapter 'nope' is not loaded \(loaded: "):
        e.warmup("nope")
    e.add_request([5, 6, 7], None, SamplingParams(max_tokens=2))
    with pytest.raises(RuntimeError, match="warmup: requests are running"):
        e.warmup()
    while e.has_unfinished():
        e.step()
    steps = e.stats()["steps"]
    # a CPU engine without graphs has nothing to warm: nothing runs (a user's CPU warm-up took 28-60 s for nothing)
    assert e.warmup("a1") == {"seconds": 0.0, "kernel_compiles": 0, "decode_graphs": 0, "piecewise_graphs": 0,
                              "requests": 0}
    assert e.stats()["steps"] == steps
    e2 = _engine(tmp_path / "q", graphs=True, max_waiting_requests=3)  # the 6-row bucket cannot queue: skipped
    e2.warmup()
    assert {(1, False), (2, False)} <= set(e2.graphs.captured) and (6, False) not in e2.graphs.captured
