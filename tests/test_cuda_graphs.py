"""The CUDA-graph decode runner's bookkeeping, on the CPU (the graphs themselves: tests/test_engine_gpu.py).

``DecodeGraphs(capture=False)`` runs exactly the step a graph would replay (static buffers, batch padded
to its bucket, padding rows pointed at the KV cache's null block with no adapter) but eagerly, so the
buffer filling and padding are checked here against the engine's ordinary decode path.
"""

from __future__ import annotations

import pytest
import torch

from multilora import Engine, SamplingParams
from multilora.runtime.config import TARGET_MODULES, ModelConfig
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
