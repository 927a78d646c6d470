"""fp8 base weights on a GPU (issue 16): the fp8 GEMMs in bf16 against a float32 reference of the same quantized
values, the Triton quantization against the torch one, and the engine in fp8 against the engine in bf16
(last-position logits within the documented error; CUDA-graph decode equal to eager decode).

Runs on the device machine (``python -m pytest -m gpu``); skipped on CPU and on GPUs without fp8.
"""

from __future__ import annotations

import pytest
import torch
from testsupport import fp8_reference, pdl_against_plain, rel_err, spy_launches

from multilora import Engine, SamplingParams
from multilora.config import ModelConfig
from multilora.kernels import fp8

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (runs on the device machine)"),
    pytest.mark.skipif(torch.cuda.is_available() and not fp8.fp8_supported("cuda")[0],
                       reason="this GPU has no fp8 (compute capability < 8.9)"),
]

# bf16 output: one rounding of the result (2^-8 relative) over a float32 accumulation
BF16_OUT = 1e-2


@pytest.mark.parametrize("M", [1, 2, 3, 8, 16, 33, 64, 130])
@pytest.mark.parametrize("N,K", [(6144, 4096), (4096, 14336), (2049, 3424), (128, 64)])
@pytest.mark.parametrize("method", ["weight_only", "scaled_mm"])
def test_fp8_gemm_bf16(M, N, K, method):
    if method == "scaled_mm" and (N % 16 or K % 16):
        pytest.skip("cuBLASLt's fp8 GEMM needs N and K multiples of 16 (method None picks weight_only there)")
    g = torch.Generator(device="cuda").manual_seed(M * 7 + N)
    w = fp8.quantize_weight(torch.randn(N, K, device="cuda", generator=g) * K ** -0.5)
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=g)
    b = torch.randn(N, device="cuda", dtype=torch.bfloat16, generator=g)
    for bias in (None, b):
        y = fp8.fp8_linear(x, w, bias, method=method)
        assert y.dtype == torch.bfloat16 and y.shape == (M, N)
        assert rel_err(y.float(), fp8_reference(x, w, bias, quantize_x=method == "scaled_mm")) < BF16_OUT


def test_quantize_per_token_triton_equals_torch():
    from multilora.kernels import triton_fp8

    x = torch.randn(37, 4096, device="cuda", dtype=torch.bfloat16) * torch.logspace(-2, 2, 37, device="cuda")[:, None]
    q, s = triton_fp8.quantize_per_token(x)
    q2, s2 = fp8.quantize_per_token_torch(x)
    torch.testing.assert_close(s, s2, rtol=1e-6, atol=0)
    assert (q.float() == q2.float()).float().mean() > 0.999  # fp32 division may round the odd value differently


def test_fp8_auto_method_is_graph_safe():
    """method None inside a CUDA graph: the same output as eager, both widths of M."""
    w = fp8.quantize_weight(torch.randn(1024, 512, device="cuda") * 0.05)
    for M in (4, 64):
        x = torch.randn(M, 512, device="cuda", dtype=torch.bfloat16)
        eager = fp8.fp8_linear(x, w)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fp8.fp8_linear(x, w)  # warm-up (Triton compile) outside the capture
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fp8.fp8_linear(x, w)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)


SHAPE = ModelConfig(vocab_size=4096, hidden_size=1024, intermediate_size=2816, num_layers=6, num_heads=16,
                    num_kv_heads=4, max_position_embeddings=2048)
#: the fp8 engine's last-position logits against the bf16 engine's (random weights of SHAPE, prompts of 1-130
#: tokens: the prefill GEMMs quantize activations too). Measured 0.133 on an H200 (bench/results/fp8/README.md)
ENGINE_LOGITS_REL_ERR = 0.2


@pytest.fixture(scope="module")
def engines():
    kw = dict(device="cuda", progress=False, max_batch_size=8, max_seq_len=256, kv_cache_bytes=64 << 20,
              adapter_pool_bytes=32 << 20)
    return Engine(SHAPE, **kw), Engine(SHAPE, weight_dtype="fp8", fp8_lm_head=False, **kw)  # (the head: below)


def test_engine_fp8_logits_close_to_bf16(engines):
    e16, e8 = engines
    g = torch.Generator().manual_seed(0)
    rows = [torch.randint(0, SHAPE.vocab_size, (n,), generator=g).tolist() for n in (1, 7, 40, 130)]
    err = rel_err(e8.logits(rows), e16.logits(rows))
    print(f"fp8 vs bf16 engine logits: relative error {err:.4f}")
    assert 0 < err < ENGINE_LOGITS_REL_ERR
    assert e8.model.nbytes < 0.6 * e16.model.nbytes


def _assert_graph_decode_equals_eager(engine, g):
    """12 greedy tokens of three prompts, decode steps replayed from CUDA graphs, then every step eager: equal."""
    assert engine.graphs is not None
    prompts = [torch.randint(0, SHAPE.vocab_size, (n,), generator=g).tolist() for n in (5, 17, 9)]
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    graphed = [o.token_ids for o in engine.generate(prompts, sampling=sp)]
    saved = engine.runner.graphs, engine.runner.pieces
    engine.runner.graphs = engine.runner.pieces = None  # every step eager
    try:
        eager = [o.token_ids for o in engine.generate(prompts, sampling=sp)]
    finally:
        engine.runner.graphs, engine.runner.pieces = saved
    assert graphed == eager


def test_engine_fp8_graph_decode_equals_eager(engines):
    _assert_graph_decode_equals_eager(engines[1], torch.Generator().manual_seed(1))


def _tuned_shapes():
    from multilora.kernels import triton_fp8

    entry = triton_fp8.tuned_table().get(torch.cuda.get_device_name(), {}) if torch.cuda.is_available() else {}
    return sorted({tuple(int(v) for v in s.split("x")) for sec in ("configs", "scaled_configs")
                   for s in entry.get(sec, {})})


@pytest.mark.parametrize("M", [1, 2, 8, 16, 40, 64])
def test_tuned_paths_compute_their_methods_product(M):
    """At every shape this GPU's tuned table covers, method None (the engine's) computes exactly what the method it
    resolves to promises: weight-only = the bf16 x times the dequantized weight; scaled_mm (here our fp8-activation
    kernel where the table has it) = the per-token-quantized x times it. Both within bf16 output rounding."""
    from multilora.kernels import triton_fp8

    shapes = _tuned_shapes()
    if not shapes:
        pytest.skip(f"no tuned fp8 table for {torch.cuda.get_device_name()}")
    g = torch.Generator(device="cuda").manual_seed(M)
    for N, K in shapes:
        w = fp8.quantize_weight(torch.randn(N, K, device="cuda", generator=g) * K ** -0.5)
        x = torch.randn(M, K, device="cuda", generator=g).to(torch.bfloat16)
        how = fp8.resolve_method(None, x, N)
        y = fp8.fp8_linear(x, w)
        if how == "weight_only":
            ref = x.float() @ w.dequantize().t()
        else:
            xq, xs = triton_fp8.quantize_per_token(x)
            ref = (xq.float() * xs) @ w.dequantize().t()
        assert rel_err(y.float(), ref) < BF16_OUT, (N, K, M, how)


def test_engine_fp8_logits_at_a_tuned_shape():
    """The fp8 engine at Llama-3-8B widths (2 layers: the tuned tiles and the fp8-activation kernel run) against the
    bf16 engine: last-position logits within ENGINE_LOGITS_REL_ERR, batches of 1, 8 and 40 prompts."""
    if not _tuned_shapes():
        pytest.skip(f"no tuned fp8 table for {torch.cuda.get_device_name()}")
    from multilora.runtime.weights import MODEL_SHAPES

    cfg = ModelConfig(**dict(MODEL_SHAPES["llama3-8b"], num_layers=2, vocab_size=4096))
    kw = dict(device="cuda", progress=False, max_batch_size=64, max_seq_len=256, kv_cache_bytes=256 << 20,
              adapter_pool_bytes=64 << 20)
    torch.manual_seed(0)
    e16 = Engine(cfg, **kw)
    torch.manual_seed(0)
    e8 = Engine(cfg, weight_dtype="fp8", **kw)
    g = torch.Generator().manual_seed(2)
    for batch in (1, 8, 40):
        rows = [torch.randint(0, cfg.vocab_size, (int(n),), generator=g).tolist()
                for n in torch.randint(1, 60, (batch,), generator=g)]
        err = rel_err(e8.logits(rows), e16.logits(rows))
        print(f"fp8 vs bf16 engine logits, llama3-8b widths, batch {batch}: relative error {err:.4f}")
        assert 0 < err < ENGINE_LOGITS_REL_ERR


@pytest.mark.parametrize("M", [1, 2, 16, 64, 130])
@pytest.mark.parametrize("capture", [False, True], ids=["eager", "graph"])
def test_fp8_gemms_with_pdl_equal_plain_launches(M, capture, monkeypatch):
    """The fp8 GEMMs, GEMVs and the per-token quantization launched with programmatic dependent launch
    (``triton_pdl.ENABLED``) against plain launches: a kernel writes x right before a GEMM whose output is the next
    GEMM's input (what an early launch could race with), at every tuned shape and an untuned one, eager and
    replayed from a CUDA graph with new inputs: bit-identical."""
    from multilora.kernels import triton_fp8, triton_pdl

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("PDL needs compute capability 9.0+")
    g = torch.Generator(device="cuda").manual_seed(M)
    for N, K in _tuned_shapes() + [(2049, 3424)]:
        w = fp8.quantize_weight(torch.randn(N, K, device="cuda", generator=g) * K ** -0.5)
        # the second GEMM maps N back to K; not after the LM head (N = vocab: no model has a GEMM that wide in K)
        back = N <= triton_fp8.MAX_QUANT_ROW
        w2 = fp8.quantize_weight(torch.randn(K, N, device="cuda", generator=g) * N ** -0.5) if back else None
        srcs = [torch.randn(M, K, device="cuda", generator=g).to(torch.bfloat16) for _ in range(3)]
        x_in = torch.empty_like(srcs[0])
        x = torch.empty_like(x_in)
        out = torch.empty(M, K if back else N, device="cuda", dtype=torch.bfloat16)

        def step():
            x.copy_(x_in * 1.5)  # writes the first GEMM's input right before it
            y = fp8.fp8_linear(x, w)
            out.copy_(fp8.fp8_linear(y, w2) if w2 is not None else y * 2)  # the next kernel reads the GEMM's output

        pdl_against_plain(monkeypatch, triton_pdl, "ENABLED", lambda i: x_in.copy_(srcs[i]), step, out,
                          capture=capture, label=(N, K, M))


def test_engine_fp8_with_pdl_equals_plain_launches(engines, monkeypatch):
    """The fp8 engine's steps with every Triton kernel launched with PDL (``triton_pdl.ENABLED``) against plain
    launches: prefill logits and 12 greedy tokens through CUDA-graph decode steps, identical."""
    from multilora.kernels import triton_pdl

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("PDL needs compute capability 9.0+")
    _, e8 = engines
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, SHAPE.vocab_size, (n,), generator=g).tolist() for n in (5, 17, 9, 70)]
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    got = {}
    for pdl in (False, True):
        monkeypatch.setattr(triton_pdl, "ENABLED", pdl)
        e8.runner.reset_graphs()
        got[pdl] = e8.logits(prompts), [o.token_ids for o in e8.generate(prompts, sampling=sp)]
        assert e8.graphs.captured
    assert torch.equal(got[False][0], got[True][0]), rel_err(got[True][0], got[False][0])
    assert got[False][1] == got[True][1]


def test_engine_fp8_fused_quantization_equals_separate(engines, monkeypatch):
    """``model.FUSE_FP8_QUANT``: the norms and SiLU * up write the fp8 GEMMs' per-token inputs; prefill logits and the
    logits of CUDA-graph decode steps agree with those of the separate quantization launches to far below the fp8
    error (the fused norm's compile may round an output in the last place differently: bench/results/session23/)."""
    from multilora.runtime import model as model_mod

    _, e8 = engines
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, SHAPE.vocab_size, (n,), generator=g).tolist() for n in (5, 17, 9, 70, 33, 2, 8, 40)]
    monkeypatch.setattr(model_mod, "FUSE_FP8_QUANT_GLU_MIN_TOKENS", 1)  # SiLU * up's copy too, at every size
    got = {}
    for fuse in (False, True):
        monkeypatch.setattr(model_mod, "FUSE_FP8_QUANT", fuse)
        e8.runner.reset_graphs()
        e8.generate(prompts, sampling=SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))  # captures
        assert e8.graphs.captured
        got[fuse] = e8.logits(prompts)
    assert rel_err(got[True], got[False]) < 1e-2


def test_fp8_linear_with_given_fp8_input_equals_its_own_quantization():
    """``fp8_linear(x, w, x_fp8=quantize_per_token(x))`` at every tuned shape and 2-64 rows (the tuned fp8-activation
    kernel) and past 64 rows (cuBLASLt): the same bf16 y bit for bit as letting it quantize x itself."""
    from multilora.kernels import triton_fp8

    g = torch.Generator(device="cuda").manual_seed(6)
    for N, K in _tuned_shapes():
        w = fp8.quantize_weight(torch.randn(N, K, device="cuda", generator=g) * K ** -0.5)
        for M in (2, 16, 64, 100):
            x = torch.randn(M, K, device="cuda", generator=g).to(torch.bfloat16)
            if fp8.resolve_method(None, x, N) != "scaled_mm":
                continue
            want = fp8.fp8_linear(x, w)
            got = fp8.fp8_linear(x, w, x_fp8=triton_fp8.quantize_per_token(x))
            assert torch.equal(got, want), (N, K, M)


def test_gemv_widening_through_f16_is_bit_identical_in_bf16(monkeypatch):
    """``triton_fp8.GEMV_WIDEN_F16`` (fp8 weights widened through float16 instead of bfloat16 in the one-row path):
    bf16 y bit for bit the same at every tuned shape and an untuned one, and within bf16 rounding of float32."""
    from multilora.kernels import triton_fp8

    g = torch.Generator(device="cuda").manual_seed(5)
    for N, K in _tuned_shapes() + [(2049, 3424)]:
        w = fp8.quantize_weight(torch.randn(N, K, device="cuda", generator=g) * K ** -0.5)
        x = torch.randn(1, K, device="cuda", generator=g).to(torch.bfloat16)  # the one-row path
        cfg = triton_fp8.gemv_config(x.device, N, K, 1) or dict(block_n=2, block_k=1024, use_dot=False)
        monkeypatch.setattr(triton_fp8, "GEMV_WIDEN_F16", False)
        want = triton_fp8.fp8_gemv2(x, w.qweight, w.scale, **cfg)
        monkeypatch.setattr(triton_fp8, "GEMV_WIDEN_F16", True)
        got = triton_fp8.fp8_gemv2(x, w.qweight, w.scale, **cfg)
        assert torch.equal(got, want), (N, K)
        assert rel_err(got.float(), x.float() @ w.dequantize().t()) < BF16_OUT, (N, K)


def test_gemv_preload_is_bit_identical_in_bf16():
    """``triton_fp8.GEMV_PRELOAD`` (the one-row path's first weight tiles loaded before the PDL wait): bf16 y bit for
    bit that of no preload, 1-4 tiles, at every tuned shape and an untuned one, launched with PDL after a kernel that
    writes x (``triton_pdl.launch_args``: PDL on this GPU)."""
    from multilora.kernels import triton_fp8

    g = torch.Generator(device="cuda").manual_seed(6)
    for N, K in _tuned_shapes() + [(2049, 3424)]:
        w = fp8.quantize_weight(torch.randn(N, K, device="cuda", generator=g) * K ** -0.5)
        src = torch.randn(1, K, device="cuda", generator=g).to(torch.bfloat16)
        cfg = triton_fp8.gemv_config(src.device, N, K, 1) or dict(block_n=2, block_k=1024, use_dot=False)
        outs = []
        for p in (0, 1, 2, 4):
            x = src * 1.5  # a kernel writing x right before the GEMV
            outs.append(triton_fp8.fp8_gemv2(x, w.qweight, w.scale, preload=p, **cfg))
        for p, got in zip((1, 2, 4), outs[1:]):
            assert torch.equal(got, outs[0]), (N, K, p)


def test_engine_fp8_lm_head(engines):
    """``fp8_lm_head``: the LM head's GEMM computes the bf16 hidden times the dequantized fp8 head (one row: the
    weight-only GEMV, within bf16 output rounding; more rows: fp8 activations, within their rounding), the engine's
    logits stay within ENGINE_LOGITS_REL_ERR of the bf16 engine's, and its CUDA-graph decode equals eager decode."""
    e16, e8 = engines
    kw = dict(device="cuda", progress=False, max_batch_size=8, max_seq_len=256, kv_cache_bytes=64 << 20,
              adapter_pool_bytes=32 << 20)
    eh = Engine(SHAPE, weight_dtype="fp8", fp8_lm_head=True, **kw)
    head = eh.model.lm_head
    assert isinstance(head, fp8.Fp8Weight) and eh.model.nbytes < e8.model.nbytes
    g = torch.Generator(device="cuda").manual_seed(3)
    for M, bound in ((1, BF16_OUT), (3, 0.06), (64, 0.06)):
        h = torch.randn(M, SHAPE.hidden_size, device="cuda", dtype=torch.bfloat16, generator=g)
        ref = h.float() @ head.dequantize().t()
        err = rel_err(eh.model.compute_logits(h), ref)
        assert err < bound, (M, err)
    g = torch.Generator().manual_seed(0)
    rows = [torch.randint(0, SHAPE.vocab_size, (n,), generator=g).tolist() for n in (1, 7, 40, 130)]
    err_head, err = rel_err(eh.logits(rows), e16.logits(rows)), rel_err(e8.logits(rows), e16.logits(rows))
    print(f"fp8 vs bf16 engine logits: relative error {err:.4f}; with the fp8 LM head {err_head:.4f}")
    assert 0 < err_head < ENGINE_LOGITS_REL_ERR
    _assert_graph_decode_equals_eager(eh, g)


@pytest.mark.parametrize("M", [2, 17, 40, 64])
@pytest.mark.parametrize("swap,tma", [(False, False), (True, False), (False, True), (True, True)])
def test_fp8_activation_kernels_in_bf16(M, swap, tma, monkeypatch):
    """``fp8_gemv2(fp8_x=True)``'s four kernels (pointer loads or TMA, x @ w^T or w @ x^T) in bf16 at Llama-3-8B
    widths and an unaligned one, with and without a bias and a split of K, x quantized into a 64-row buffer (TMA:
    64-row tiles over it) and into one of its own size: the scaled_mm product within bf16 output rounding; and
    replayed from a CUDA graph with a new x, the eager result bit for bit. The TMA kernel runs exactly when asked
    (every shape here can back a descriptor)."""
    from multilora.kernels import triton_fp8

    launches = spy_launches(monkeypatch, triton_fp8, "_w8_gemv_tma_kernel")
    g = torch.Generator(device="cuda").manual_seed(M)
    for (N, K), bn, bk in (((4096, 4096), 64, 128), ((28672, 4096), 128, 128), ((4096, 14336), 256, 128),
                           ((2049, 3424), 64, 256)):
        launches.clear()  # (the graph check of the shape before launched it too)
        w = fp8.quantize_weight(torch.randn(N, K, device="cuda", generator=g) * K ** -0.5)
        x = torch.randn(M, K, device="cuda", generator=g).to(torch.bfloat16)
        b = torch.randn(N, device="cuda", generator=g).to(torch.bfloat16)
        for bias, split in ((None, None), (b, 1), (b, 4)):
            kw = dict(block_n=bn, block_k=bk, num_warps=4, num_stages=3, fp8_x=True, swap=swap, tma=tma, split_k=split)
            y = triton_fp8.fp8_gemv2(x, w.qweight, w.scale, bias, **kw)
            ref = fp8_reference(x, w, bias, quantize_x=True)
            assert rel_err(y.float(), ref) < BF16_OUT, (N, K, bias is not None, split)
            # x quantized into a buffer of exactly M rows (no 64-row buffer: TMA tiles past its edge read zeros)
            xq, xs = triton_fp8.quantize_per_token(x)
            y2 = triton_fp8.fp8_gemv2(xq.clone(), w.qweight, w.scale, bias, x_scale=xs, out_dtype=torch.bfloat16, **kw)
            assert rel_err(y2.float(), ref) < BF16_OUT, (N, K, bias is not None, split)
        assert len(launches) == (6 if tma else 0), (N, K)
        xg = x.clone()
        triton_fp8.fp8_gemv2(xg, w.qweight, w.scale, b, **kw)  # compiled before the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            yg = triton_fp8.fp8_gemv2(xg, w.qweight, w.scale, b, **kw)
        x2 = torch.randn(M, K, device="cuda", generator=g).to(torch.bfloat16)
        xg.copy_(x2)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(yg, triton_fp8.fp8_gemv2(x2, w.qweight, w.scale, b, **kw)), (N, K)
