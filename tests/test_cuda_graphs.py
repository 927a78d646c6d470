"""The CUDA-graph decode runner's bookkeeping, on the CPU (the graphs themselves: tests/test_engine_gpu.py).

``DecodeGraphs(capture=False)`` runs exactly the step a graph would replay (static buffers, batch padded
to its bucket, padding rows pointed at the KV cache's null block with no adapter) but eagerly, so the
buffer filling and padding are checked here against the engine's ordinary decode path.
"""

from __future__ import annotations

import pytest
import torch

from multilora import Engine, SamplingParams
from multilora.config import TARGET_MODULES, ModelConfig
from multilora.runtime.cuda_graphs import DecodeGraphs, bucket_sizes
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


def _engine(tmp_path, graphs: bool):
    e = Engine(CFG, device="cpu", progress=False, max_batch_size=6, max_seq_len=48, kv_block_size=4, max_lora_rank=8,
               adapter_slots=3, kv_cache_bytes=12 * 4 * CFG.num_layers * 2 * CFG.num_kv_heads * CFG.head_dim * 4)
    for i in range(3):
        e.load_adapter(f"a{i}", write_adapter(tmp_path / f"a{i}", CFG, seed=i, rank=4 + 2 * i, modules=TARGET_MODULES))
    if graphs:
        e.graphs = DecodeGraphs(e.model, e.kv, max_batch_size=6, max_blocks=12, max_seq_len=48, lora_backend=None,
                                attention_backend=None, capture=False)
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
    e.graphs.run(token_ids=[5, 6, 7], positions=[5, 2, 0], block_tables=tables, token_slots=[-1, 0, -1], chunk_table=None)
    changed = (e.kv.k != before_k).any(dim=(0, 3, 4)).nonzero().tolist()  # (block, offset) pairs written
    want = {(tables[0][1], 1), (tables[1][0], 2), (tables[2][0], 0)}
    assert set(map(tuple, changed)) - {(0, 0)} == want


class _EagerReplay:
    """Stands in for a captured CUDA graph on the CPU: ``replay()`` runs the captured plan again, reading the
    static buffers as the graph would, and writes the same logits buffer."""

    def __init__(self, graphs: DecodeGraphs, plan):
        self.graphs, self.plan = graphs, plan
        with torch.inference_mode():
            self.logits = graphs._forward(plan).clone()  # the warm-up run of _record

    def replay(self) -> None:
        with torch.inference_mode():
            self.logits.copy_(self.graphs._forward(self.plan))


def _replay_engine(tmp_path):
    """An engine whose decode steps take the graph path of ``DecodeGraphs.run`` (capture, staging, one copy of
    the shared buffer, replay) with the graph replaced by ``_EagerReplay``; Triton LoRA (interpreted on the
    CPU) reads the chunk table from the shared buffer, as the captured kernels do."""
    e = _engine(tmp_path, graphs=False)
    g = DecodeGraphs(e.model, e.kv, max_batch_size=6, max_blocks=12, max_seq_len=48, lora_backend="triton",
                     attention_backend="torch", capture=True)

    def record(plan):
        r = _EagerReplay(g, plan)
        return r, r.logits

    g._record = record
    e.graphs = g
    return e


def test_graph_replay_path_equals_eager(tmp_path):
    """Greedy generation through the replay path equals eager decode: buckets shrink (6 -> 4 -> 2 -> 1), LoRA
    graphs and no-LoRA graphs alternate over the shared chunk field, preempted requests return with new block
    tables."""
    pytest.importorskip("triton")
    if torch.cuda.is_available() or __import__("os").environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CPU check under the Triton interpreter (the GPU runs real graphs: test_engine_gpu.py)")
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, CFG.vocab_size, (int(n),), generator=g).tolist() for n in (9, 3, 14, 5, 7, 2)]
    adapters = ["a0", None, "a1", "a2", "a0", None]
    params = [SamplingParams(max_tokens=n, ignore_eos=True, temperature=0) for n in (3, 12, 5, 4, 2, 7)]
    eager = _engine(tmp_path / "eager", graphs=False)
    want = [o.token_ids for o in eager.generate(prompts, adapters=adapters, sampling=params)]
    e = _replay_engine(tmp_path / "replay")
    got = [o.token_ids for o in e.generate(prompts, adapters=adapters, sampling=params)]
    assert got == want
    assert {lora for _, lora in e.graphs.captured} == {False, True}
    assert len({b for b, _ in e.graphs.captured}) >= 3, e.graphs.captured
    assert e.stats()["preemptions"] > 0
    assert e.kv.num_free_blocks == e.kv.num_usable_blocks


def test_graph_replay_logits_and_staging(tmp_path):
    """One replayed step against the eager forward on the same KV state, then the staged buffers: padding rows
    (token 0, position 0, KV slot 0, context 1, no adapter, a zero block table) and the chunk field."""
    pytest.importorskip("triton")
    if torch.cuda.is_available() or __import__("os").environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CPU check under the Triton interpreter")
    from multilora.kernels import chunk_table

    e = _replay_engine(tmp_path)
    rows = [[5, 9, 11, 3, 7], [4, 4, 8], [10, 2, 6, 6, 1, 12, 13]]
    slots = [e.cache.acquire(e.cache.get("a1")), -1, e.cache.acquire(e.cache.get("a0"))]
    tables = [e.kv.allocate_seq(("s", i), len(r) + 1) for i, r in enumerate(rows)]
    e._run_forward(rows, [0] * 3, tables, slots)  # prefill: fills the KV cache
    nxt, pos = [7, 8, 9], [len(r) for r in rows]
    for sl in (slots, [-1, -1, -1], slots):  # LoRA, no LoRA, LoRA again: the chunk field is rewritten
        eager = e._run_forward([[t] for t in nxt], pos, tables, sl)
        table = chunk_table(sl, 16, torch.device("cpu")) if any(s >= 0 for s in sl) else None
        with torch.inference_mode():
            got = e.graphs.run(token_ids=nxt, positions=pos, block_tables=tables, token_slots=sl, chunk_table=table)
        torch.testing.assert_close(got, eager, atol=1e-4, rtol=1e-4)
    gr = e.graphs
    bs = e.kv.block_size
    assert gr.input_ids[:4].tolist() == nxt + [0] and gr.positions[:4].tolist() == pos + [0]
    assert gr.slot_mapping[:4].tolist() == [t[p // bs] * bs + p % bs for t, p in zip(tables, pos)] + [0]
    assert gr.seq_lens[:4].tolist() == [p + 1 for p in pos] + [1] and gr.token_slots[:4].tolist() == slots + [-1]
    assert gr.block_tables[:4].tolist() == [t + [0] * (12 - len(t)) for t in tables] + [[0] * 12]
    want = torch.full((4, 4), 0, dtype=torch.int32)
    want[1] = -1
    want[:, :3] = chunk_table(slots, 16, torch.device("cpu"))
    assert torch.equal(gr._graphs[(4, True)].chunk_table, want)
    # a shorter table in the same row is zero-filled past its end (rows are rewritten only when they change)
    short = [tables[1], tables[0], tables[2]]  # row 0: 2 blocks -> 1
    assert len(short[0]) < len(tables[0])
    with torch.inference_mode():
        gr.run(token_ids=nxt, positions=[3, 2, 1], block_tables=short, token_slots=slots, chunk_table=None)
    assert gr.block_tables[:3].tolist() == [t + [0] * (12 - len(t)) for t in short]
