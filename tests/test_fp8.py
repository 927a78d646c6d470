"""fp8 base weights on the CPU (issue 16): the quantization's error bounds, every fp8 GEMM against a plain float32
reference built here from the quantized values, and the engine's fp8 path against an fp32 engine whose weights are
the dequantized fp8 weights (so the LoRA delta and everything else is checked exactly, the quantization apart).

The weight-only Triton kernel runs under TRITON_INTERPRET=1 (conftest) in fp16; ``torch._scaled_mm`` has a CPU
implementation. The same GEMMs in bf16 on a GPU: ``test_fp8_gpu.py``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from testsupport import fp8_reference, rel_err, spy_launches, write_adapter

from multilora import Engine
from multilora.config import ModelConfig
from multilora.kernels import fp8
from multilora.runtime.weights import MODEL_SHAPES

E4M3_REL = 2.0 ** -4  # e4m3 keeps 3 mantissa bits: round-to-nearest is within half a step, 2^-4 of the value
E4M3_SUBNORMAL_ABS = 2.0 ** -10  # below 2^-6 the step is 2^-9 (of the scale): half of it


def _bound_ok(orig: torch.Tensor, deq: torch.Tensor, scale: torch.Tensor) -> bool:
    err = (orig.float() - deq).abs()
    return bool((err <= orig.float().abs() * E4M3_REL + scale * E4M3_SUBNORMAL_ABS + 1e-12).all())


@pytest.mark.parametrize("shape", [(1, 1), (7, 33), (64, 200)])
def test_quantize_weight_bounds(shape):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(*shape, generator=g) * torch.logspace(-3, 2, shape[0])[:, None]  # rows of very different size
    q = fp8.quantize_weight(w)
    assert q.qweight.dtype == torch.float8_e4m3fn and q.scale.dtype == torch.float32
    assert q.qweight.shape == w.shape and q.scale.shape == (shape[0],)
    torch.testing.assert_close(q.scale, w.abs().amax(1) / 448.0)
    assert (q.qweight.float().abs().amax(1) == 448.0).all()  # each row's largest value maps to the top of the range
    assert _bound_ok(w, q.dequantize(), q.scale[:, None])
    assert q.nbytes == w.numel() + 4 * shape[0]


def test_quantize_zero_rows_and_errors():
    w = torch.zeros(3, 8)
    w[1] = torch.arange(8.0)
    q = fp8.quantize_weight(w)
    assert (q.dequantize()[0] == 0).all() and (q.dequantize()[2] == 0).all()
    with pytest.raises(ValueError, match=r"quantize_weight: w must be a 2-D float tensor \[N, K\], got \(8,\)"):
        fp8.quantize_weight(torch.ones(8))
    x = torch.randn(5, 300)
    xq, xs = fp8.quantize_per_token_torch(x)
    assert xs.shape == (5, 1) and _bound_ok(x, xq.float() * xs, xs)


@pytest.mark.parametrize("M", [1, 3, 17])
@pytest.mark.parametrize("bias", [False, True])
def test_scaled_mm_and_dequant_match_reference(M, bias):
    g = torch.Generator().manual_seed(M)
    N, K = 48, 64  # _scaled_mm wants multiples of 16
    w = fp8.quantize_weight(torch.randn(N, K, generator=g))
    x = torch.randn(M, K, generator=g)
    b = torch.randn(N, generator=g) if bias else None
    y = fp8.fp8_linear(x, w, b, method="scaled_mm")
    assert y.shape == (M, N) and y.dtype == torch.float32
    assert rel_err(y, fp8_reference(x, w, b, quantize_x=True)) < 1e-5
    assert rel_err(fp8.fp8_linear(x, w, b, method="dequant"), fp8_reference(x, w, b, quantize_x=False)) < 1e-6
    assert fp8.resolve_method(None, x, N) == "scaled_mm"  # the CPU's default


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="CPU cases need TRITON_INTERPRET=1")
@pytest.mark.parametrize("M,N,K", [(1, 40, 96), (2, 72, 520), (3, 33, 200), (8, 64, 64), (20, 70, 130), (40, 16, 48),
                                   (70, 24, 40)])
def test_weight_only_kernel_matches_reference(M, N, K):
    g = torch.Generator().manual_seed(N)
    w = fp8.quantize_weight(torch.randn(N, K, generator=g))
    x = torch.randn(M, K, generator=g).half()
    b = torch.randn(N, generator=g).half()
    y = fp8.fp8_linear(x, w, b, method="weight_only")
    assert y.dtype == torch.float16 and y.shape == (M, N)
    ref = fp8_reference(x, w, b, quantize_x=False)
    assert rel_err(y.float(), ref) < 2e-3  # fp16 output rounding (2^-11) plus fp32 accumulation order


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="CPU cases need TRITON_INTERPRET=1")
def test_splitk_tickets_reset_and_result_independent_of_split():
    """Every split of K gives the same sums (the last program adds the partials in a fixed order) and leaves the
    ticket counters at 0 for the next call (a CUDA graph replays the same workspace)."""
    from multilora.kernels import triton_fp8

    g = torch.Generator().manual_seed(3)
    w = fp8.quantize_weight(torch.randn(40, 1000, generator=g))
    x = torch.randn(3, 1000, generator=g).half()
    ref = fp8_reference(x, w, None, quantize_x=False)
    for dot in (False, True):
        outs = [triton_fp8.fp8_gemv_splitk(x, w.qweight, w.scale, block_n=16, block_k=64, split_k=s, use_dot=dot)
                for s in (1, 2, 5)]
        for y in outs:
            assert rel_err(y.float(), ref) < 2e-3
        assert all(int(t[1].sum()) == 0 for t in triton_fp8._WORKSPACES.values())
    with pytest.raises(ValueError, match="x must have 1..64 rows, got 65"):
        triton_fp8.fp8_gemv_splitk(torch.randn(65, 1000).half(), w.qweight, w.scale)


def test_fp8_linear_errors(monkeypatch):
    w = fp8.quantize_weight(torch.randn(16, 32))
    with pytest.raises(ValueError, match=r"x must be \[T, 32\] for a weight of shape \(16, 32\), got \(2, 31\)"):
        fp8.fp8_linear(torch.randn(2, 31), w)
    with pytest.raises(ValueError, match=r"bias must be \[16\], got \(15,\)"):
        fp8.fp8_linear(torch.randn(2, 32), w, torch.randn(15))
    with pytest.raises(ValueError, match="method must be one of"):
        fp8.fp8_linear(torch.randn(2, 32), w, method="int8")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="method='weight_only' needs Triton and a CUDA tensor, got a cpu tensor"):
        fp8.fp8_linear(torch.randn(2, 32), w, method="weight_only")


def test_fp8_supported_refuses_pre_ada_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    ok, why = fp8.fp8_supported("cuda:0")
    assert not ok and "A100" in why and "8.0" in why and "8.9" in why
    assert fp8.fp8_supported("cpu") == (True, "")


def test_engine_config_validation():
    with pytest.raises(ValueError, match=r"Engine: weight_dtype must be None or 'fp8', got 'int8'"):
        Engine(ModelConfig(**MODEL_SHAPES["tiny"]), device="cpu", weight_dtype="int8")
    with pytest.raises(ValueError, match=r"Engine: fp8_gemm must be None unless weight_dtype='fp8'"):
        Engine(ModelConfig(**MODEL_SHAPES["tiny"]), device="cpu", fp8_gemm="scaled_mm")
    with pytest.raises(ValueError, match=r"Engine: fp8_gemm='weight_only' needs a CUDA GPU .*got device cpu"):
        Engine(ModelConfig(**MODEL_SHAPES["tiny"]), device="cpu", weight_dtype="fp8", fp8_gemm="weight_only")
    with pytest.raises(ValueError, match=r"Engine: fp8_lm_head must be None or False unless weight_dtype='fp8', got True"):
        Engine(ModelConfig(**MODEL_SHAPES["tiny"]), device="cpu", fp8_lm_head=True)
    with pytest.raises(ValueError, match=r"Engine: fp8_lm_head must be None, True or False, got 'yes'"):
        Engine(ModelConfig(**MODEL_SHAPES["tiny"]), device="cpu", weight_dtype="fp8", fp8_lm_head="yes")


CFG = ModelConfig(**MODEL_SHAPES["tiny"])
ROWS = [[5, 9, 14, 3, 77, 301, 12], [8, 1, 400], [2, 3, 4, 5, 6, 7, 8, 9, 10, 11]]


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """An fp8 engine (its LM head kept in float32: ``test_engine_fp8_lm_head`` takes the head) and an fp32 engine
    whose projections are the fp8 engine's dequantized weights, same adapters."""
    d = tmp_path_factory.mktemp("fp8-adapters")
    kw = dict(device="cpu", progress=False, max_batch_size=4, max_seq_len=64, max_lora_rank=16)
    e8 = Engine(CFG, weight_dtype="fp8", fp8_lm_head=False, **kw)
    e32 = Engine(CFG, **kw)  # the same seeded random weights
    for l8, l32 in zip(e8.model.layers, e32.model.layers):
        for name in ("qkv", "o", "gate_up", "down"):
            assert isinstance(l8[name], fp8.Fp8Weight)
            l32[name] = l8[name].dequantize()
    for i, (rank, mods) in enumerate([(8, ["q_proj", "v_proj"]), (16, ["o_proj", "gate_proj", "down_proj"])]):
        path = write_adapter(d / f"a{i}", CFG, seed=i, rank=rank, modules=mods)
        for e in (e8, e32):
            e.load_adapter(f"a{i}", path)
    return e8, e32


def test_engine_fp8_plumbing_exact(engines):
    """With the reference GEMM (no activation rounding) the fp8 engine IS the dequantized fp32 engine: base, LoRA
    (applied to the full-precision activations, from the pool, unchanged) and mixed batches."""
    e8, e32 = engines
    e8.model.fp8_method = "dequant"
    try:
        for adapters in ([None, None, None], ["a0", None, "a1"]):
            assert rel_err(e8.logits(ROWS, adapters), e32.logits(ROWS, adapters)) < 1e-5
    finally:
        e8.model.fp8_method = None


def test_engine_fp8_default_gemm_close_and_smaller(engines):
    """The default CPU GEMM (per-token fp8 activations + _scaled_mm) adds only the activations' rounding; the model
    stores 1 byte per projection weight (+ a float32 scale per row)."""
    e8, e32 = engines
    err = rel_err(e8.logits(ROWS, ["a0", None, "a1"]), e32.logits(ROWS, ["a0", None, "a1"]))
    assert 0 < err < 0.1  # measured about 0.03 on this random model (3 mantissa bits on the activations)
    c = CFG
    proj = c.num_layers * ((c.q_size + 2 * c.kv_size) * c.hidden_size + c.hidden_size * c.q_size
                           + 3 * c.intermediate_size * c.hidden_size)
    rows = c.num_layers * (c.q_size + 2 * c.kv_size + 2 * c.hidden_size + 2 * c.intermediate_size)
    assert e32.model.nbytes - e8.model.nbytes == proj * 4 - (proj + 4 * rows)
    out = e8.generate([ROWS[0]], adapters=["a1"])[0]
    assert out.finish_reason in ("length", "stop") and len(out.token_ids) > 0


@pytest.mark.parametrize("tied", [False, True])
def test_fp8_lm_head_default_follows_the_head(tied):
    """``fp8_lm_head=None`` (the default): with ``weight_dtype="fp8"`` the head is fp8 exactly when the model has one
    of its own (untied: the float32 head is replaced, the model's bytes fall by 3 per head weight less the row
    scales), and stays the embedding table when tied; without fp8 it is the model-dtype head. True / False force it,
    and the CLI's ``--fp8-lm-head`` / ``--no-fp8-lm-head`` set them (no flag: None)."""
    from multilora.runtime.config import EngineConfig

    cfg = ModelConfig(**{**MODEL_SHAPES["tiny"], "tie_word_embeddings": tied})
    kw = dict(device="cpu", progress=False, max_batch_size=2, max_seq_len=32, max_lora_rank=8)
    auto, off = Engine(cfg, weight_dtype="fp8", **kw), Engine(cfg, weight_dtype="fp8", fp8_lm_head=False, **kw)
    assert isinstance(off.model.lm_head, torch.Tensor)
    if tied:
        assert auto.model.lm_head is auto.model.embed and auto.model.nbytes == off.model.nbytes
        assert isinstance(Engine(cfg, weight_dtype="fp8", fp8_lm_head=True, **kw).model.lm_head, fp8.Fp8Weight)
    else:
        head = auto.model.lm_head
        assert isinstance(head, fp8.Fp8Weight)
        torch.testing.assert_close(head.dequantize(), fp8.quantize_weight(off.model.lm_head).dequantize(), rtol=0,
                                   atol=0)
        assert off.model.nbytes - auto.model.nbytes == 3 * cfg.vocab_size * cfg.hidden_size - 4 * cfg.vocab_size
    assert isinstance(Engine(cfg, **kw).model.lm_head, torch.Tensor)
    parser = __import__("argparse").ArgumentParser()
    EngineConfig.add_cli_flags(parser)
    assert [parser.parse_args(f).fp8_lm_head for f in ([], ["--fp8-lm-head"], ["--no-fp8-lm-head"])] == [None, True,
                                                                                                          False]


@pytest.mark.parametrize("tied", [False, True])
def test_engine_fp8_lm_head(tied):
    """``fp8_lm_head``: the LM head is quantized like the projections; with the reference GEMM the engine IS the fp32
    engine with every projection AND the head dequantized (logits and greedy tokens, with adapters); the head's
    bytes go from 4 to 1 per weight (+ a float32 scale per vocab row), or, tied, an fp8 copy joins the table."""
    cfg = ModelConfig(**{**MODEL_SHAPES["tiny"], "tie_word_embeddings": tied})
    kw = dict(device="cpu", progress=False, max_batch_size=4, max_seq_len=64, max_lora_rank=16)
    e8 = Engine(cfg, weight_dtype="fp8", fp8_lm_head=True, fp8_gemm=None, **kw)
    ref = Engine(cfg, **kw)  # the same seeded random weights
    head = e8.model.lm_head
    assert isinstance(head, fp8.Fp8Weight) and tuple(head.shape) == (cfg.vocab_size, cfg.hidden_size)
    assert (ref.model.lm_head is ref.model.embed) == tied and isinstance(e8.model.embed, torch.Tensor)
    # the head quantized from the model-dtype weights this config loads (the embedding table when tied)
    torch.testing.assert_close(head.dequantize(), fp8.quantize_weight(ref.model.lm_head).dequantize(), rtol=0, atol=0)
    for l8, l32 in zip(e8.model.layers, ref.model.layers):
        for name in ("qkv", "o", "gate_up", "down"):
            l32[name] = l8[name].dequantize()
    before = ref.model.nbytes
    ref.model.lm_head = head.dequantize()
    c = cfg
    proj = c.num_layers * ((c.q_size + 2 * c.kv_size) * c.hidden_size + c.hidden_size * c.q_size
                           + 3 * c.intermediate_size * c.hidden_size)
    rows = c.num_layers * (c.q_size + 2 * c.kv_size + 2 * c.hidden_size + 2 * c.intermediate_size)
    assert head.nbytes == c.vocab_size * c.hidden_size + 4 * c.vocab_size
    # untied: the float32 head (4 bytes a weight) is replaced; tied: the fp8 copy is extra
    head_saved = 4 * c.vocab_size * c.hidden_size - head.nbytes if not tied else -head.nbytes
    assert before - e8.model.nbytes == proj * 4 - (proj + 4 * rows) + head_saved
    e8.model.fp8_method = "dequant"
    assert rel_err(e8.logits(ROWS, [None, None, None]), ref.logits(ROWS, [None, None, None])) < 1e-5
    assert [o.token_ids for o in e8.generate(ROWS[:2])] == [o.token_ids for o in ref.generate(ROWS[:2])]
    e8.model.fp8_method = None  # the CPU's default GEMM (fp8 activations): close, not equal
    assert 0 < rel_err(e8.logits(ROWS, [None] * 3), ref.logits(ROWS, [None] * 3)) < 0.1


def _tuned_file(tmp_path, data) -> str:
    p = tmp_path / "tuned.json"
    p.write_text(json.dumps(data))
    return str(p)


def test_shipped_tuned_tables_parse():
    """Every shipped table (kernels/tuned/) is read without a warning and holds only fp8_gemv2 arguments."""
    from multilora.kernels import triton_fp8

    files = sorted(triton_fp8.TUNED_DIR.glob("fp8_gemv_*.json"))
    assert files, "no tuned table shipped"
    for f in files:
        table: dict = {}
        triton_fp8._read_tuned(f, table)
        data = json.loads(f.read_text())
        assert data["device"] in table and table[data["device"]]["configs"], f


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="CPU cases need TRITON_INTERPRET=1")
def test_tuned_table_routes_the_gemv_and_bad_files_are_skipped(tmp_path, monkeypatch, caplog):
    """A table for this device (here "cpu", under the interpreter) sends fp8_weight_only_linear through fp8_gemv2
    with its tiles, for its shape and row class only; a malformed file is skipped with a warning naming it."""
    from multilora.kernels import triton_fp8

    cfg = dict(block_n=16, block_k=32, num_warps=4, num_stages=1, programs_per_sm=2, prefetch=False, use_dot=True)
    good = _tuned_file(tmp_path, {"device": "cpu", "weight_only_max_tokens": 16,
                                  "configs": {"32x64": {"16": cfg}}})
    monkeypatch.setenv("MULTILORA_FP8_TUNED", good)
    monkeypatch.setattr(triton_fp8, "_tuned", None)
    calls = []
    real = triton_fp8.fp8_gemv2
    monkeypatch.setattr(triton_fp8, "fp8_gemv2", lambda *a, **k: calls.append(k) or real(*a, **k))
    dev = torch.device("cpu")
    assert triton_fp8.gemv_config(dev, 32, 64, 3) == cfg
    assert triton_fp8.gemv_config(dev, 32, 64, 1) is None  # no "1" entry: the measured default path
    assert triton_fp8.gemv_config(dev, 32, 128, 3) is None  # another shape
    g = torch.Generator().manual_seed(5)
    w = fp8.quantize_weight(torch.randn(32, 64, generator=g))
    x = torch.randn(3, 64, generator=g).half()
    y = triton_fp8.fp8_weight_only_linear(x, w.qweight, w.scale)
    assert len(calls) == 1 and calls[0]["block_k"] == 32
    assert rel_err(y.float(), fp8_reference(x, w, None, quantize_x=False)) < 2e-3
    triton_fp8.fp8_weight_only_linear(torch.randn(1, 64).half(), w.qweight, w.scale)
    assert len(calls) == 1  # one row: not in the table, so the split-K kernel of fp8_gemm.md

    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"device": "cpu", "configs": {"32x64": {"16": {"block_n": 16}}}}))
    monkeypatch.setenv("MULTILORA_FP8_TUNED", str(bad))
    monkeypatch.setattr(triton_fp8, "_tuned", None)
    with caplog.at_level("WARNING", logger="multilora"):
        assert triton_fp8.gemv_config(dev, 32, 64, 3) is None
    assert "ignoring" in caplog.text and "bad.json" in caplog.text and "block_n" in caplog.text


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="CPU cases need TRITON_INTERPRET=1")
@pytest.mark.parametrize("M,N,K", [(1, 40, 96), (3, 33, 200), (20, 70, 130), (64, 32, 256)])
def test_gemv2_fp8_activations_match_the_scaled_mm_reference(M, N, K):
    """fp8_gemv2(fp8_x=True) computes what method "scaled_mm" computes: per-token fp8 x times the fp8 weight,
    both scales applied once; for every split of K, and the same from an already quantized x."""
    from multilora.kernels import triton_fp8

    g = torch.Generator().manual_seed(M + N)
    w = fp8.quantize_weight(torch.randn(N, K, generator=g))
    x = torch.randn(M, K, generator=g).half()
    b = torch.randn(N, generator=g).half()
    xq, xs = triton_fp8.quantize_per_token(x)
    ref = (xq.float() * xs) @ w.dequantize().t() + b.float()
    for kw in (dict(block_n=16, block_k=64), dict(block_n=16, block_k=32, split_k=3), dict(block_n=32, block_k=64, split_k=1)):
        y = triton_fp8.fp8_gemv2(x, w.qweight, w.scale, b, fp8_x=True, **kw)
        assert y.dtype == torch.float16 and rel_err(y.float(), ref) < 2e-3
        y2 = triton_fp8.fp8_gemv2(xq, w.qweight, w.scale, b, fp8_x=True, x_scale=xs, out_dtype=torch.float16, **kw)
        assert torch.equal(y, y2)
    with pytest.raises(ValueError, match="fp8_x needs the tensor-core path"):
        triton_fp8.fp8_gemv2(x, w.qweight, w.scale, fp8_x=True, use_dot=False)
    with pytest.raises(ValueError, match="needs x_scale"):
        triton_fp8.fp8_gemv2(xq, w.qweight, w.scale, fp8_x=True)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="CPU cases need TRITON_INTERPRET=1")
@pytest.mark.parametrize("M,N,K", [(3, 48, 128), (20, 70, 160), (64, 32, 256), (5, 48, 200)])
def test_gemv2_swapped_and_tma_kernels_compute_the_same_product(M, N, K, monkeypatch):
    """The product taken as w @ x^T (``swap``) and through tensor descriptors (``tma``, both tiles TMA-loaded; the
    rows and columns past the edge read as zeros) equal the scaled_mm reference, for every split of K, unaligned
    N and padded rows included; the TMA kernel runs exactly for the tma calls, except where a row of K fp8 bytes
    is no multiple of 16 (K = 200: no descriptor; the pointer kernel, same product); tma asks fp8 activations and
    tiles of at most TMA_MAX_BOX."""
    from multilora.kernels import triton_fp8

    launches = spy_launches(monkeypatch, triton_fp8, "_w8_gemv_tma_kernel")
    g = torch.Generator().manual_seed(M * N)
    w = fp8.quantize_weight(torch.randn(N, K, generator=g))
    x = torch.randn(M, K, generator=g).half()
    b = torch.randn(N, generator=g).half()
    xq, xs = triton_fp8.quantize_per_token(x)
    ref = (xq.float() * xs) @ w.dequantize().t() + b.float()
    for kw in (dict(block_n=16, block_k=32), dict(block_n=16, block_k=32, split_k=3), dict(block_n=32, block_k=64, split_k=1)):
        for swap, tma in ((True, False), (False, True), (True, True)):
            before = len(launches)
            y = triton_fp8.fp8_gemv2(x, w.qweight, w.scale, b, fp8_x=True, swap=swap, tma=tma, **kw)
            assert y.dtype == torch.float16 and rel_err(y.float(), ref) < 2e-3, (kw, swap, tma)
            assert len(launches) - before == (1 if tma and K % 16 == 0 else 0), (kw, swap, tma)
    wref = fp8_reference(x, w, b, quantize_x=False)  # swap on the weight-only tensor-core path too
    y = triton_fp8.fp8_gemv2(x, w.qweight, w.scale, b, block_n=16, block_k=32, split_k=2, use_dot=True, swap=True)
    assert rel_err(y.float(), wref) < 2e-3
    with pytest.raises(ValueError, match="fp8_x=True"):
        triton_fp8.fp8_gemv2(x, w.qweight, w.scale, tma=True, use_dot=True)
    with pytest.raises(ValueError, match="at most 256"):
        triton_fp8.fp8_gemv2(x, w.qweight, w.scale, fp8_x=True, tma=True, block_n=16, block_k=512)


def test_fp8_activation_buffers_hold_64_rows():
    """``empty_fp8_rows``: 1-63 rows are the leading rows of a 64-row buffer (a TMA tile of 64 rows reads real memory),
    0 and 64+ rows exactly what is asked; ``quantize_per_token`` and the fused ops' fp8 copies use it."""
    from multilora.kernels import triton_fp8

    for rows, alloc in ((1, 64), (17, 64), (63, 64), (64, 64), (65, 65), (0, 0)):
        t = fp8.empty_fp8_rows(rows, 48, "cpu")
        assert t.shape == (rows, 48) and t.dtype == fp8.FP8_DTYPE and t.is_contiguous()
        assert t.untyped_storage().nbytes() == alloc * 48, rows
        r = triton_fp8._rows_view(t, 64)
        assert (r is not None) == (rows >= 1 and alloc >= 64) and (r is None or r.data_ptr() == t.data_ptr())
    assert triton_fp8._rows_view(torch.empty(3, 48, dtype=fp8.FP8_DTYPE), 64) is None  # a buffer of its own size
    if os.environ.get("TRITON_INTERPRET") == "1":
        q, _ = triton_fp8.quantize_per_token(torch.randn(5, 48).half())
        assert q.untyped_storage().nbytes() == 64 * 48


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="CPU cases need TRITON_INTERPRET=1")
@pytest.mark.parametrize("M", [3, 20, 40])
def test_tma_tiles_over_a_padded_buffer_ignore_its_other_rows(M, monkeypatch):
    """An fp8 x in a 64-row buffer (``empty_fp8_rows``) is read by 64-row TMA tiles; the buffer's rows past M hold NaN
    here and change nothing: the result equals the scaled_mm reference and the same x in a buffer of its own size
    (64-row tile past the edge, zeros from TMA), for one split and three, and swapped (tiles of the padded row count
    read from the buffer)."""
    from multilora.kernels import triton_fp8

    launches = spy_launches(monkeypatch, triton_fp8, "_w8_gemv_tma_kernel")
    g = torch.Generator().manual_seed(M)
    N, K = 48, 128
    w = fp8.quantize_weight(torch.randn(N, K, generator=g))
    x = torch.randn(M, K, generator=g).half()
    xq, xs = triton_fp8.quantize_per_token(x)
    padded = fp8.empty_fp8_rows(M, K, "cpu")
    padded.as_strided((64, K), (K, 1))[M:] = float("nan")  # the rows no one writes, poisoned
    padded.copy_(xq)
    own = xq.clone()  # storage of exactly M rows
    assert triton_fp8._rows_view(padded, 64) is not None and triton_fp8._rows_view(own, 64) is None
    ref = (xq.float() * xs) @ w.dequantize().t()
    for split, swap in ((1, False), (3, False), (2, True)):
        kw = dict(fp8_x=True, x_scale=xs, out_dtype=torch.float16, tma=True, block_n=16, block_k=32, split_k=split,
                  swap=swap)
        y = triton_fp8.fp8_gemv2(padded, w.qweight, w.scale, **kw)
        assert torch.isfinite(y).all() and rel_err(y.float(), ref) < 2e-3, split
        assert torch.equal(y, triton_fp8.fp8_gemv2(own, w.qweight, w.scale, **kw)), split
    assert len(launches) == 6  # every call above through the TMA kernel


def test_tuned_entries_may_name_swap_and_tma(tmp_path, caplog):
    """Entries may add swap / tma (booleans; tma only in scaled_configs with tiles of at most 256); older entries
    without them still read; a bad value skips the file with a warning naming the key."""
    from multilora.kernels import triton_fp8

    cfg = dict(block_n=64, block_k=128, num_warps=4, num_stages=4, programs_per_sm=2, prefetch=False, use_dot=True)
    table: dict = {}
    triton_fp8._read_tuned(Path(_tuned_file(tmp_path, {"device": "g", "configs": {"8x8": {"64": dict(cfg, swap=True)}},
                                                       "scaled_configs": {"8x8": {"64": dict(cfg, fp8_x=True, tma=True,
                                                                                             swap=False)}}})), table)
    assert table["g"]["scaled_configs"]["8x8"]["64"]["tma"] is True and table["g"]["configs"]["8x8"]["64"]["swap"]
    for bad, why in (({"configs": {"8x8": {"64": dict(cfg, swap="yes")}}}, "swap must be true or false"),
                     ({"configs": {"8x8": {"64": dict(cfg, tma=1)}}}, "tma must be true or false"),
                     ({"configs": {"8x8": {"64": dict(cfg, tma=True)}}}, "tma takes fp8 activations (scaled_configs)"),
                     ({"scaled_configs": {"8x8": {"64": dict(cfg, tma=True, block_k=512)}}}, "tma tiles of at most 256")):
        table = {}
        caplog.clear()
        with caplog.at_level("WARNING", logger="multilora"):
            triton_fp8._read_tuned(Path(_tuned_file(tmp_path, {"device": "g", **bad})), table)
        assert table == {} and why in caplog.text, why


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="CPU cases need TRITON_INTERPRET=1")
def test_split_k_workspaces_are_per_column_block_count():
    """Two tile widths of one weight shape and split need different ticket counts (one per column block): each call
    gets a workspace of its own count, every result is right and every ticket is back at 0."""
    from multilora.kernels import triton_fp8

    g = torch.Generator().manual_seed(9)
    w = fp8.quantize_weight(torch.randn(64, 256, generator=g))
    x = torch.randn(1, 256, generator=g).half()
    ref = fp8_reference(x, w, None, quantize_x=False)
    for bn in (32, 4, 16):  # 2, 16 and 4 column blocks, split_k 2 each
        y = triton_fp8.fp8_gemv2(x, w.qweight, w.scale, block_n=bn, block_k=64, split_k=2, use_dot=False)
        assert rel_err(y.float(), ref) < 2e-3, bn
        y = triton_fp8.fp8_gemv_splitk(x, w.qweight, w.scale, block_n=bn, block_k=64, split_k=2, use_dot=False)
        assert rel_err(y.float(), ref) < 2e-3, bn
    for (dev, split, bm, n, blocks), (part, count) in triton_fp8._WORKSPACES.items():
        assert count.numel() == blocks and int(count.sum()) == 0


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_gemv_widening_through_f16_is_bit_identical(dtype, monkeypatch):
    """``GEMV_WIDEN_F16``: the one-row path widens each fp8 weight through float16 instead of x's dtype. Every e4m3
    value (subnormals, the largest, negatives) is exact in both, so y is bit for bit the same, with and without a
    split and with masked tails. (bf16, the case it is for, runs on a GPU: ``test_fp8_gpu.py``; the interpreter has no
    bf16.)"""
    from multilora.kernels import triton_fp8

    g = torch.Generator().manual_seed(11)
    w = fp8.quantize_weight(torch.randn(37, 300, generator=g) * torch.logspace(-3, 2, 300))  # wide range of codes
    x = torch.randn(1, 300, generator=g).to(dtype)
    ref = fp8_reference(x, w, None, quantize_x=False)
    for split in (1, 3):
        kw = dict(block_n=4, block_k=64, split_k=split, use_dot=False)
        monkeypatch.setattr(triton_fp8, "GEMV_WIDEN_F16", False)
        want = triton_fp8.fp8_gemv2(x, w.qweight, w.scale, **kw)
        monkeypatch.setattr(triton_fp8, "GEMV_WIDEN_F16", True)
        got = triton_fp8.fp8_gemv2(x, w.qweight, w.scale, **kw)
        assert torch.equal(got, want), split
        assert rel_err(got.float(), ref) < (2e-3 if dtype == torch.float16 else 1e-5), split


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gemv_preload_is_bit_identical(dtype):
    """``preload`` (``GEMV_PRELOAD``): the one-row path's first weight tiles loaded before the PDL wait and multiplied
    ahead of the loop. y is bit for bit that of no preload, for 1-4 tiles, with and without a split (whose programs
    hold 2-5 tiles: preload capped there), with masked tails (300 = 4 x 64 + 44, 37 rows) and an even shape; a
    preload outside 0..4 is refused."""
    from multilora.kernels import triton_fp8

    g = torch.Generator().manual_seed(12)
    for n, k in ((37, 300), (32, 256)):
        w = fp8.quantize_weight(torch.randn(n, k, generator=g))
        x = torch.randn(1, k, generator=g).to(dtype)
        ref = fp8_reference(x, w, None, quantize_x=False)
        for split in (1, 2):
            kw = dict(block_n=4, block_k=64, split_k=split, use_dot=False)
            want = triton_fp8.fp8_gemv2(x, w.qweight, w.scale, preload=0, **kw)
            assert rel_err(want.float(), ref) < (2e-3 if dtype == torch.float16 else 1e-5)
            for p in (1, 2, 3, 4):
                got = triton_fp8.fp8_gemv2(x, w.qweight, w.scale, preload=p, **kw)
                assert torch.equal(got, want), (n, k, split, p)
    with pytest.raises(ValueError, match="preload must be 0..4"):
        triton_fp8.fp8_gemv2(x, w.qweight, w.scale, preload=5, use_dot=False)


@pytest.mark.parametrize("bad,why", [
    ({"device": "cpu", "weight_only_max_tokens": "abc", "configs": {}}, "weight_only_max_tokens must be an integer"),
    ({"device": "cpu", "configs": {"32x64": {"8": {}}}}, "row class must be"),
    ({"device": "cpu", "scaled_configs": {"32x64": {"1": dict(block_n=2, block_k=64, num_warps=4, num_stages=1,
                                                              programs_per_sm=1, prefetch=False, use_dot=False)}}},
     "fp8 activations need use_dot"),
    ({"device": "cpu", "configs": {"32x64": {"1": dict(block_n="2", block_k=64, num_warps=4, num_stages=1,
                                                       programs_per_sm=1, prefetch=False, use_dot=False)}}},
     "block_n must be a positive integer"),
])
def test_malformed_tuned_tables_are_skipped_whole(tmp_path, monkeypatch, caplog, bad, why):
    """A bad value anywhere in a table file skips the file with a warning naming the entry; lookups keep working."""
    from multilora.kernels import triton_fp8

    monkeypatch.setenv("MULTILORA_FP8_TUNED", _tuned_file(tmp_path, bad))
    monkeypatch.setattr(triton_fp8, "_tuned", None)
    with caplog.at_level("WARNING", logger="multilora"):
        assert triton_fp8.gemv_config(torch.device("cpu"), 32, 64, 1) is None
        assert triton_fp8.weight_only_max_tokens(torch.device("cpu")) is None
    assert "ignoring" in caplog.text and why in caplog.text


def test_fused_activation_quantization_is_taken_and_exact(engines, monkeypatch):
    """The RMSNorms and SiLU * up write the per-token fp8 input of the q/k/v, gate/up and down GEMMs
    (``model.FUSE_FP8_QUANT``); o's input is quantized by its GEMM as before. Logits are bit for bit those of the
    separate quantization, base and with adapters; ``fp8_linear`` refuses a malformed ``x_fp8``."""
    from multilora.runtime import model as model_mod
    e8, _ = engines
    monkeypatch.setattr(model_mod, "FUSE_FP8_QUANT_GLU_MIN_TOKENS", 1)  # the test's steps are small: SiLU * up too
    seen = []
    real = model_mod.fp8_linear

    def spy(x, w, b=None, *, method=None, x_fp8=None):
        seen.append(x_fp8 is not None)
        return real(x, w, b, method=method, x_fp8=x_fp8)

    monkeypatch.setattr(model_mod, "fp8_linear", spy)
    for adapters in ([None, None, None], ["a0", None, "a1"]):
        fused = e8.logits(ROWS, adapters)
        calls = list(seen)
        seen.clear()
        monkeypatch.setattr(model_mod, "FUSE_FP8_QUANT", False)
        try:
            sep = e8.logits(ROWS, adapters)
        finally:
            monkeypatch.setattr(model_mod, "FUSE_FP8_QUANT", True)
        assert not any(seen)
        seen.clear()
        assert torch.equal(fused, sep)
        assert calls and calls.count(True) == 3 * CFG.num_layers * (len(calls) // (4 * CFG.num_layers))
    x = torch.randn(3, 64)
    w = fp8.quantize_weight(torch.randn(16, 64))
    xq, xs = fp8.quantize_per_token_torch(x)
    assert torch.equal(fp8.fp8_linear(x, w, x_fp8=(xq, xs)), fp8.fp8_linear(x, w))
    with pytest.raises(ValueError, match="x_fp8 must be"):
        fp8.fp8_linear(x, w, x_fp8=(xq, xs.view(3)))
    with pytest.raises(ValueError, match="x_fp8 must be"):
        fp8.fp8_linear(x, w, x_fp8=(x, xs))
