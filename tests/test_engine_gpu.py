"""The engine on a GPU against transformers + peft: a random-weight model of SmolLM2-135M's shape.

Runs on the device machine (``python -m pytest -m gpu``); skipped on CPU. The engine uses the Triton
LoRA kernels there. Reference: peft's mixed-batch forward on the same weights and adapters. In bf16 both
sides round differently, so each is compared with a float32 peft reference and ours must be about as
close as peft's own bf16 run.
"""

from __future__ import annotations

import pytest
import torch
from testsupport import gpu_engine, peft_adapters, peft_batch_logits, rel_err

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (runs on the device machine)"),
]

SMOLLM2_SHAPE = dict(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
    num_key_value_heads=3, rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
    max_position_embeddings=2048,
)
ADAPTERS = {
    "attn-r8": dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    "mlp-r16-rslora": dict(r=16, lora_alpha=8, use_rslora=True, target_modules=["gate_proj", "up_proj", "down_proj"]),
    "all-r2": dict(r=2, lora_alpha=5, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    "regex-r64": dict(r=64, lora_alpha=32, target_modules=r".*\.(q_proj|v_proj|down_proj)", rank_pattern={"v_proj": 4}),
}
ROW_ADAPTERS = ["attn-r8", None, "mlp-r16-rslora", "all-r2", "regex-r64", "attn-r8", None, "all-r2"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    d = tmp_path_factory.mktemp("gpu-model")
    hf = LlamaForCausalLM(LlamaConfig(**SMOLLM2_SHAPE)).eval()
    hf.save_pretrained(str(d / "model"))
    model = peft_adapters(hf, ADAPTERS, d / "adapters", std=0.05)
    g = torch.Generator().manual_seed(1)
    rows = [torch.randint(0, 49152, (int(n),), generator=g).tolist() for n in torch.randint(3, 40, (len(ROW_ADAPTERS),), generator=g)]
    return model, d, rows


@pytest.mark.parametrize("dtype,first", [(torch.float32, False), (torch.bfloat16, False), (torch.float16, False),
                                         (torch.bfloat16, True), (torch.float16, True)],
                         ids=["fp32", "bf16", "fp16", "bf16-lora-before-gemm", "fp16-lora-before-gemm"])
def test_engine_matches_peft_on_gpu(setup, dtype, first, monkeypatch):
    """``first``: every in-place step (the mixed batch's prefill, and each row alone past the side stream's limit:
    2 tokens for this rank-64 pool) writes the LoRA term first and its GEMM adds x W^T to it
    (``LORA_BEFORE_GEMM_MIN_TOKENS`` = 1; by default from 256 tokens)."""
    from multilora import Engine
    from multilora.kernels import resolve_backend
    from multilora.kernels.triton_sgmv import lora_apply_triton
    from multilora.runtime import model as model_mod

    monkeypatch.setattr(model_mod, "LORA_BEFORE_GEMM_MIN_TOKENS", 1 if first else 1 << 30)
    model, d, rows = setup
    ref32 = peft_batch_logits(model, rows, ROW_ADAPTERS, torch.float32)
    engine = Engine(model=d / "model", device="cuda", dtype=dtype, progress=False, max_batch_size=8)
    assert resolve_backend(None, torch.empty(1, device="cuda")) is lora_apply_triton
    for n in ADAPTERS:
        engine.load_adapter(n, d / "adapters" / n)
    assert sum(map(len, rows)) > engine.model.lora_side_limit()  # the mixed batch's step: in place, no side stream
    ours = engine.logits(rows, adapters=ROW_ADAPTERS)
    if dtype == torch.float32:
        for i, a in enumerate(ROW_ADAPTERS):  # TF32 may be used by GEMMs and tl.dot: a looser bound than CPU
            assert rel_err(ours[i], ref32[i]) < 2e-3, (a, rel_err(ours[i], ref32[i]))
    else:
        theirs = peft_batch_logits(model, rows, ROW_ADAPTERS, dtype)
        for i, a in enumerate(ROW_ADAPTERS):
            ours_err, peft_err = rel_err(ours[i], ref32[i]), rel_err(theirs[i], ref32[i])
            assert ours_err < 2 * peft_err + 1e-3, (a, ours_err, peft_err)
    # each row of the mixed batch equals itself alone (rows with no adapter: the base model), up to the
    # dtype's own rounding level: GEMMs of another row count round differently (bf16: ~1e-2 relative)
    for i, a in enumerate(ROW_ADAPTERS):
        alone = engine.logits([rows[i]], adapters=[a])[0]
        bound = 1e-5 if dtype == torch.float32 else 2 * rel_err(ours[i], ref32[i])
        assert rel_err(ours[i], alone) <= bound, (a, rel_err(ours[i], alone), bound)
    # the plan sized the pool and the KV cache
    plan = engine.memory_plan
    assert plan is not None and engine.pool.bytes_total <= plan.adapter_pool_bytes
    assert engine.kv.nbytes <= plan.kv_bytes


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_prefill_from_a_rank16_pool_matches_peft_on_gpu(setup, dtype, monkeypatch):
    """A prefill step of more than 512 tokens (chunks of ``block_m > 16``) from a pool of max rank 16
    (``max_lora_rank=16``): the path that sessions 30-31's prefill tiles take in the engine (the LoRA term written
    before the GEMM, the shrink's 128-wide K blocks, the writing expand's looped tiles, ``PREFILL_WRITE_LOOP``), which
    the rank-64 pool of the other cases never takes. Last-position logits against a float32 peft reference, about as
    close as peft's own run in the dtype; a row without an adapter too."""
    from multilora.kernels import triton_sgmv
    from multilora.runtime import model as model_mod

    model, d, _ = setup
    names = ["attn-r8", "mlp-r16-rslora", "all-r2"]
    adapters = ["attn-r8", "mlp-r16-rslora", None, "all-r2"]
    g = torch.Generator().manual_seed(7)
    rows = [torch.randint(0, 49152, (n,), generator=g).tolist() for n in (200, 180, 150, 90)]  # 620 tokens
    engine = gpu_engine(d, names, dtype, max_lora_rank=16)
    assert engine.pool.max_rank == 16
    assert sum(map(len, rows)) >= max(513, model_mod.LORA_BEFORE_GEMM_MIN_TOKENS)
    looped = []  # the writing expand's launches that took PREFILL_WRITE_LOOP's tiles
    rule = triton_sgmv.prefill_write_tiles

    def spy(*args):
        got = rule(*args)
        looped.append(got is not None)
        return got

    monkeypatch.setattr(triton_sgmv, "prefill_write_tiles", spy)
    ours = engine.logits(rows, adapters=adapters)
    assert any(looped), "no expand took the looped prefill tiles"
    ref32 = peft_batch_logits(model, rows, adapters, torch.float32)
    theirs = peft_batch_logits(model, rows, adapters, dtype)
    for i, a in enumerate(adapters):
        ours_err, peft_err = rel_err(ours[i], ref32[i]), rel_err(theirs[i], ref32[i])
        assert ours_err < 2 * peft_err + 1e-3, (a, ours_err, peft_err)


def test_engine_generate_on_gpu(setup):
    from multilora import Engine, SamplingParams

    model, d, rows = setup
    engine = Engine(model=d / "model", device="cuda", progress=False, max_batch_size=4)
    for n in ADAPTERS:
        engine.load_adapter(n, d / "adapters" / n)
    outs = engine.generate(rows, adapters=ROW_ADAPTERS, sampling=SamplingParams(max_tokens=8, ignore_eos=True))
    assert [len(o.token_ids) for o in outs] == [8] * len(rows)
    alone = engine.generate([rows[2]], adapters=[ROW_ADAPTERS[2]], sampling=SamplingParams(max_tokens=8, ignore_eos=True))
    assert alone[0].token_ids == outs[2].token_ids
    assert engine.pool.pages_used <= engine.pool.num_pages and engine.stats()["running"] == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_graph_decode_matches_eager(setup, dtype):
    """Greedy generation with decode steps replayed from CUDA graphs equals eager decode. Requests stop at
    different lengths, so the batch shrinks across buckets; a small KV cache forces
    preemptions (re-admitted requests come back into the graphs with new block tables). fp32: identical
    tokens. bf16: kernels of another batch size (bucket padding) may round differently, so a greedy run may
    take the other branch at a near-tie; at least 90% of the tokens must agree position by position."""
    from multilora import Engine, SamplingParams

    model, d, rows = setup
    max_tokens = [12, 3, 7, 12, 1, 9, 5, 12]
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in max_tokens]
    outs = {}
    for graphs in (False, True):
        engine = Engine(model=d / "model", device="cuda", dtype=dtype, progress=False, max_batch_size=8,
                        max_seq_len=64, kv_block_size=4, cuda_graphs=graphs,
                        kv_cache_bytes=40 * 4 * 2 * 30 * 3 * 64 * torch.empty((), dtype=dtype).element_size())
        assert (engine.graphs is not None) == graphs
        for n in ADAPTERS:
            engine.load_adapter(n, d / "adapters" / n)
        outs[graphs] = [o.token_ids for o in engine.generate(rows, adapters=ROW_ADAPTERS, sampling=params)]
        if graphs:
            assert len(engine.graphs.captured) >= 2, engine.graphs.captured  # the batch crossed buckets
    assert [len(t) for t in outs[True]] == max_tokens
    if dtype == torch.float32:
        assert outs[True] == outs[False]
    else:
        same = sum(a == b for x, y in zip(outs[True], outs[False]) for a, b in zip(x, y))
        assert same >= 0.9 * sum(max_tokens), (outs[True], outs[False])


def test_cuda_graph_decode_equals_same_padded_step_eager_bf16(setup):
    """bf16, base model: greedy tokens with graph replay equal, token for token, those of the same padded
    static-buffer decode step run eagerly (``DecodeGraphs.capture = False``: same buckets, shapes and kernels,
    no graph). Batch shrinking across buckets and preemption (a small KV cache) included."""
    from multilora import Engine, SamplingParams

    model, d, rows = setup
    max_tokens = [12, 3, 7, 12, 1, 9, 5, 12]
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in max_tokens]
    outs = {}
    for capture in (False, True):
        engine = Engine(model=d / "model", device="cuda", dtype=torch.bfloat16, progress=False, max_batch_size=8,
                        max_seq_len=64, kv_block_size=4, kv_cache_bytes=40 * 4 * 2 * 30 * 3 * 64 * 2)
        engine.graphs.capture = capture
        outs[capture] = [o.token_ids for o in engine.generate(rows, sampling=params)]
        assert len(engine.graphs.captured) >= 2, engine.graphs.captured  # the batch crossed buckets
    assert [len(t) for t in outs[True]] == max_tokens
    assert outs[True] == outs[False]


def test_cuda_graph_replay_matches_eager_logits(setup):
    """One decode step, replayed from the graph and run eagerly on the same KV state: bf16 logits agree to
    bf16 rounding, and the argmax agrees wherever the top-2 gap is above that rounding."""
    from multilora import Engine

    model, d, rows = setup
    engine = Engine(model=d / "model", device="cuda", progress=False, max_batch_size=8, max_seq_len=64)
    for n in ADAPTERS:
        engine.load_adapter(n, d / "adapters" / n)
    slots, tables = [], []
    for i, (r, a) in enumerate(zip(rows, ROW_ADAPTERS)):
        slots.append(engine.cache.acquire(engine.cache.get(a)) if a else -1)
        tables.append(engine.kv.allocate_seq(("probe", i), len(r) + 1))
    engine.runner.run_eager(rows, [0] * len(rows), tables, slots)  # prefill: fills the KV cache
    nxt = [7 + i for i in range(len(rows))]
    for B in (len(rows), 5, 1):  # buckets 8, 8 (padded), 1
        eager = engine.runner.run_eager([[t] for t in nxt[:B]], [len(r) for r in rows[:B]], tables[:B], slots[:B])
        with torch.inference_mode():
            graph = engine.runner.decode_graph(nxt[:B], [len(r) for r in rows[:B]], tables[:B], slots[:B]).cpu()
        assert rel_err(graph, eager) < 2e-2, (B, rel_err(graph, eager))
        top2 = eager.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > 0.05 * top2[:, 0].abs().clamp(min=1)
        assert torch.equal(graph.argmax(-1)[clear], eager.argmax(-1)[clear])


def test_chunked_prefill_on_gpu_matches_unchunked(setup):
    """Chunked prefill on the GPU (fp32, CUDA graphs on): mixed steps of decode tokens and 32-token prompt chunks run
    eagerly through the Triton attention (chunks with KV context) and LoRA kernels, decode-only steps replay graphs.
    Against the unchunked engine: the logits of whole rows (Engine.logits) within fp32/TF32 noise, and greedy
    tokens (a 300-token prompt among the rows) agree at >= 90% of the positions (TF32 GEMMs of other shapes may
    take the other branch at a near-tie; on the CPU they are identical: tests/test_scheduler_chunked.py)."""
    from multilora import Engine, SamplingParams

    model, d, rows = setup
    g = torch.Generator().manual_seed(4)
    rows = rows + [torch.randint(0, 49152, (300,), generator=g).tolist()]
    names = ROW_ADAPTERS + ["all-r2"]
    engines = {}
    for chunked in (False, True):
        e = Engine(model=d / "model", device="cuda", dtype=torch.float32, progress=False, max_batch_size=8,
                   max_seq_len=512, enable_chunked_prefill=chunked, max_num_batched_tokens=32)
        for n in ADAPTERS:
            e.load_adapter(n, d / "adapters" / n)
        engines[chunked] = e
    want, got = engines[False].logits(rows, adapters=names), engines[True].logits(rows, adapters=names)
    for i in range(len(rows)):
        assert rel_err(got[i], want[i]) < 1e-3, (i, rel_err(got[i], want[i]))
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (12, 3, 7, 12, 1, 9, 5, 12, 6)]
    outs = {c: [o.token_ids for o in e.generate(rows, adapters=names, sampling=params)] for c, e in engines.items()}
    same = sum(a == b for x, y in zip(outs[True], outs[False]) for a, b in zip(x, y))
    assert same >= 0.9 * sum(p.max_tokens for p in params), outs
    s = engines[True].stats()
    assert s["mixed_steps"] > 0 and s["decode_steps"] > 0 and engines[True].graphs is not None
    assert len(engines[True].graphs.captured) >= 1  # decode-only steps replayed graphs
    assert engines[True].kv.num_free_blocks == engines[True].kv.num_usable_blocks


def test_side_stream_lora_equals_lora_in_place(setup):
    """The side-stream path (each projection's LoRA into a delta beside the GEMM, added by the following op) against
    LoRA added in place after each GEMM, in one engine: bf16 mixed-batch logits bit-identical (both paths round the
    LoRA term to bf16, then the sum), and greedy generation through CUDA graphs (decode steps of 1 and 2 requests:
    the side-stream limit of this rank-64 pool) gives the same tokens. The same with the side stream at the highest
    CUDA priority (``DecoderModel.lora_side_priority``): only the order the GPU runs programs in may change."""
    from multilora import Engine, SamplingParams

    model, d, rows = setup
    outs, logits = {}, {}
    highest = torch.cuda.Stream.priority_range()[1]
    for case, side, prio in (("in place", 0, 0), ("side", 1 << 20, 0), ("side, highest priority", 1 << 20, highest)):
        engine = Engine(model=d / "model", device="cuda", progress=False, max_batch_size=4,
                        lora_side_stream_max_tokens=side)
        engine.model.lora_side_priority = prio
        if engine.graphs is not None:
            engine.runner.reset_graphs()  # captured graphs bake the side stream in
        assert engine.model.lora_side_limit() == side
        for n in ADAPTERS:
            engine.load_adapter(n, d / "adapters" / n)
        logits[case] = engine.logits(rows, adapters=ROW_ADAPTERS)
        sp = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.0)
        outs[case] = [o.token_ids for o in engine.generate(rows[:2], adapters=ROW_ADAPTERS[:2], sampling=sp)]
        outs[case] += [o.token_ids for o in engine.generate(rows[2:3], adapters=ROW_ADAPTERS[2:3], sampling=sp)]
        assert engine.graphs is not None and engine.graphs.captured
        if prio:  # the stream really has a raised priority (torch clamps the request to its own range)
            assert engine.model._side is not None and engine.model._side.priority < 0, engine.model._side.priority
    for case in ("side", "side, highest priority"):
        assert torch.equal(logits["in place"], logits[case]), (case, rel_err(logits["in place"], logits[case]))
        assert outs["in place"] == outs[case], case


def test_side_stream_sm_carveout(setup):
    """``DecoderModel.lora_side_sm_carveout``: the base GEMMs of side-stream steps of >= 17 tokens go through cuBLASLt
    with SMs left out of their grid; ``DecoderModel.gemm_cublaslt_tokens``: the base GEMMs of steps of that many
    tokens go through cuBLASLt. cuBLASLt's kernels may sum in another order than cuBLAS's, so the bf16 logits are
    close to, not equal to, those of cuBLAS alone; torch's BLAS settings are restored after every GEMM; greedy
    decoding through CUDA graphs runs."""
    from multilora import Engine, SamplingParams

    model, d, rows = setup
    lib, carve = torch.backends.cuda.preferred_blas_library(), torch._C._get_sm_carveout_experimental()
    logits = {}
    for case, (sms, lt) in {"cuBLAS": (0, None), "carve 16": (16, None), "cuBLASLt": (0, (1, 1 << 20))}.items():
        engine = Engine(model=d / "model", device="cuda", progress=False, max_batch_size=4,
                        lora_side_stream_max_tokens=1 << 20)
        engine.model.lora_side_sm_carveout = sms
        engine.model.gemm_cublaslt_tokens = lt
        if engine.graphs is not None:
            engine.runner.reset_graphs()
        for n in ADAPTERS:
            engine.load_adapter(n, d / "adapters" / n)
        logits[case] = engine.logits(rows, adapters=ROW_ADAPTERS)
        sp = SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.0)
        outs = engine.generate(rows[:3], adapters=ROW_ADAPTERS[:3], sampling=sp)
        assert all(len(o.token_ids) == 6 for o in outs)
        assert torch.backends.cuda.preferred_blas_library() == lib and torch._C._get_sm_carveout_experimental() == carve
        engine.close()
    for case in ("carve 16", "cuBLASLt"):
        assert rel_err(logits["cuBLAS"], logits[case]) < 2e-2, (case, rel_err(logits["cuBLAS"], logits[case]))


def test_decode_and_piecewise_graphs_share_one_capture_stream(setup):
    """Every capture, decode and piecewise, and its warm-up run on the runner's one ``CaptureStream``, so the
    process keeps cuBLAS workspaces for two streams (the compute stream's and that one: what the memory plan counts,
    ``CAPTURE_WORKSPACE_BYTES``), not one more per graph captured: a stream per decode capture once held +32 MiB per
    bucket (session 15's memory-regression failure)."""
    from multilora import Engine
    from multilora.runtime.runner import CAPTURE_WORKSPACE_BYTES

    model, d, rows = setup
    torch.cuda.synchronize()
    torch._C._cuda_clearCublasWorkspaces()  # drop earlier tests' workspaces (the GPU suite runs in one process)
    engine = Engine(model=d / "model", device="cuda", progress=False, max_batch_size=8, max_seq_len=256)
    name = next(iter(ADAPTERS))
    engine.load_adapter(name, d / "adapters" / name)
    engine.warmup(name)
    r = engine.runner
    assert r.graphs is not None and r.pieces is not None
    assert len(r.graphs.captured) >= 4 and len(r.pieces.captured) >= 4, (r.graphs.captured, r.pieces.captured)
    assert r.graphs.stream is r.capture_stream and r.pieces.stream is r.capture_stream
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch._C._cuda_clearCublasWorkspaces()  # (the engine's graphs may use them: it is not used after this)
    held = before - torch.cuda.memory_allocated()
    assert 0 < held <= 2 * CAPTURE_WORKSPACE_BYTES, f"cuBLAS workspaces held {held / 2**20:.1f} MiB"
    engine.close()


def test_piecewise_graphs_on_gpu_match_eager_steps(setup):
    """Prefill and mixed steps replayed from piecewise CUDA graphs (``runtime.cuda_graphs.PiecewiseGraphs``; fp32)
    against eager steps (``piecewise_cuda_graph_max_tokens=0``): whole-row logits of unchunked prefill steps (up to
    256 tokens) within fp32/TF32 noise; greedy tokens of a chunked run (mixed steps of 32-token chunks beside decode
    rows) at >= 90% of the positions; then ``warm_pieces`` captures every bucket, largest first, within the memory
    the plan reserved for them, and the graphs still give the eager logits."""
    from multilora import Engine, SamplingParams

    model, d, rows = setup
    g = torch.Generator().manual_seed(5)
    rows = rows + [torch.randint(0, 49152, (300,), generator=g).tolist()]
    names = ROW_ADAPTERS + ["all-r2"]

    def engine(top: int, chunked: bool) -> Engine:
        kw = dict(max_num_batched_tokens=32) if chunked else dict(enable_chunked_prefill=False, max_prefill_tokens=256)
        e = Engine(model=d / "model", device="cuda", dtype=torch.float32, progress=False, max_batch_size=8,
                   max_seq_len=512, piecewise_cuda_graph_max_tokens=top, **kw)
        for n in ADAPTERS:
            e.load_adapter(n, d / "adapters" / n)
        return e

    eager, pw = engine(0, False), engine(1 << 20, False)
    assert eager.runner.pieces is None and pw.runner.pieces.buckets[-1] == 256  # capped by the step budget
    want, got = eager.logits(rows[:8], adapters=names[:8]), pw.logits(rows[:8], adapters=names[:8])
    for i in range(8):
        assert rel_err(got[i], want[i]) < 1e-3, (i, rel_err(got[i], want[i]))
    p = pw.runner.pieces
    assert p.captured, "no step replayed piecewise graphs"
    torch.cuda.synchronize()
    before = torch.cuda.memory_reserved()
    pw.runner.warm_pieces()
    torch.cuda.synchronize()
    grown = torch.cuda.memory_reserved() - before
    assert set(p.captured) == {(b, o) for b in p.buckets for o in (True, False)}
    bound = pw.runner.profile_reserve(256, pw.kv.block_size) + pw.runner.piecewise_reserve(256, pw.kv.block_size)
    assert grown <= bound, (grown, bound)
    got2 = pw.logits(rows[:8], adapters=names[:8])
    for i in range(8):
        assert rel_err(got2[i], want[i]) < 1e-3, (i, rel_err(got2[i], want[i]))
    del eager, pw
    engines = {top: engine(top, True) for top in (0, None)}
    assert engines[None].runner.pieces.buckets[-1] == 32
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (12, 3, 7, 12, 1, 9, 5, 12, 6)]
    outs = {t: [o.token_ids for o in e.generate(rows, adapters=names, sampling=params)] for t, e in engines.items()}
    same = sum(a == b for x, y in zip(outs[None], outs[0]) for a, b in zip(x, y))
    assert same >= 0.9 * sum(pr.max_tokens for pr in params), outs
    e = engines[None]
    assert e.stats()["mixed_steps"] > 0 and any(lora for _, lora in e.runner.pieces.captured)
    assert e.kv.num_free_blocks == e.kv.num_usable_blocks


def test_step_kernels_with_pdl_equal_plain_launches(setup, monkeypatch):
    """Programmatic dependent launch of the step's Triton kernels (``triton_pdl.ENABLED``: norms, RoPE + KV write,
    SiLU * up, paged attention and its split combine) and of the LoRA kernels (``triton_sgmv.PDL``) against plain
    launches, in one bf16 engine with the side stream: each kernel may start while the one before drains and waits
    before its first read, which must not change a bit. The prefill logits of a mixed batch (eager), one decode step
    replayed from a CUDA graph on the same KV state (8 rows, split-key attention), and 10 greedy tokens per row
    through graphs: identical."""
    from multilora import Engine, SamplingParams
    from multilora.kernels import triton_pdl, triton_sgmv

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("PDL needs compute capability 9.0+")
    model, d, rows = setup
    engine = Engine(model=d / "model", device="cuda", progress=False, max_batch_size=8, max_seq_len=128)
    assert engine.graphs is not None
    for n in ADAPTERS:
        engine.load_adapter(n, d / "adapters" / n)
    slots, tables = [], []
    for i, (r, a) in enumerate(zip(rows, ROW_ADAPTERS)):
        slots.append(engine.cache.acquire(engine.cache.get(a)) if a else -1)
        tables.append(engine.kv.allocate_seq(("probe", i), len(r) + 1))
    engine.runner.run_eager(rows, [0] * len(rows), tables, slots)  # prefill: the KV state both decode steps read
    nxt = [11 + i for i in range(len(rows))]
    sp = SamplingParams(max_tokens=10, ignore_eos=True, temperature=0.0)
    got = {}
    for pdl in (False, True):
        monkeypatch.setattr(triton_pdl, "ENABLED", pdl)
        monkeypatch.setattr(triton_sgmv, "PDL", pdl)
        engine.runner.reset_graphs()  # a capture bakes the launch attributes in
        assert triton_pdl.launch_args(torch.device("cuda")) == ({"PDL": True, "launch_pdl": True} if pdl else {})
        with torch.inference_mode():
            step = engine.runner.decode_graph(nxt, [len(r) for r in rows], tables, slots).cpu()
        logits = engine.logits(rows, adapters=ROW_ADAPTERS)
        tokens = [o.token_ids for o in engine.generate(rows, adapters=ROW_ADAPTERS, sampling=sp)]
        assert engine.graphs.captured
        got[pdl] = step, logits, tokens
    assert torch.equal(got[False][0], got[True][0]), rel_err(got[True][0], got[False][0])
    assert torch.equal(got[False][1], got[True][1]), rel_err(got[True][1], got[False][1])
    assert got[False][2] == got[True][2]


@pytest.mark.parametrize("stops", ["length", "eos"])
def test_async_scheduling_gives_the_tokens_of_synchronous_steps(setup, stops):
    """``async_scheduling`` (the CUDA default: each step launched before the step before is read back, its last
    tokens fed from the device into the graphs' static inputs) against every step read back at once, bf16, CUDA
    graphs (decode and piecewise), chunked prefill with a 300-token prompt in 32-token chunks, seeded sampling rows,
    and a KV cache small enough to preempt. Requests that end by length are read back before the next step is
    scheduled, so both engines run the same batches: the tokens are identical. With an end-of-sequence token
    (taken from the reference run), the step after a stop carries the stopped row once more in the async engine:
    a batch of another size whose bf16 kernels may round differently, so >= 90% of the tokens agree."""
    from multilora import Engine, SamplingParams

    model, d, rows = setup
    g = torch.Generator().manual_seed(5)
    rows = rows + [torch.randint(0, 49152, (300,), generator=g).tolist()]
    names = ROW_ADAPTERS + ["all-r2"]
    budgets = (12, 3, 7, 12, 1, 9, 5, 12, 6)
    temps = (0.0, 0.0, 0.9, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0)

    def run(async_, eos=None):
        e = Engine(model=d / "model", device="cuda", dtype=torch.bfloat16, progress=False, max_batch_size=8,
                   max_seq_len=512, max_num_batched_tokens=32, kv_block_size=4, async_scheduling=async_,
                   kv_cache_bytes=120 * 4 * 2 * 30 * 3 * 64 * 2)
        for n in ADAPTERS:
            e.load_adapter(n, d / "adapters" / n)
        if eos is not None:
            e.text.eos_ids = {eos}
        params = [SamplingParams(max_tokens=n, temperature=t, seed=11, ignore_eos=eos is None)
                  for n, t in zip(budgets, temps)]
        outs = e.generate(rows, adapters=names, sampling=params)
        assert e.kv.num_free_blocks == e.kv.num_usable_blocks and not e.has_unfinished()
        return [(o.token_ids, o.finish_reason) for o in outs], e.stats()

    eos = None
    if stops == "eos":
        first, _ = run(False)
        eos = first[0][0][4]  # a token greedy row 0 makes: it stops there
    want, ref = run(False, eos)
    got, s = run(True, eos)
    assert s["async_steps"] > 0 and s["graph_steps"] > 0 and s["mixed_steps"] > 0 and ref["async_steps"] == 0
    if stops == "length":
        assert got == want and s["preemptions"] == ref["preemptions"]
    else:
        assert want[0][1] == "stop"
        same = sum(a == b for (x, _), (y, _) in zip(got, want) for a, b in zip(x, y))
        assert same >= 0.9 * sum(len(y) for y, _ in want), (got, want)
