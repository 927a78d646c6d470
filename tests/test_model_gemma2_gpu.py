"""Gemma 2 on a GPU: the engine with every Triton path (LoRA; paged attention with its soft-capping branch and
sliding window; the fused ops with ``1 + w`` norms, the normed deltas and GELU_tanh) against transformers + peft,
the Triton kernels against the torch ones, and CUDA-graph decode against eager decode.

Runs on the device machine (``python -m pytest -m gpu tests/test_model_gemma2_gpu.py``); skipped on CPU. A
random-weight model of a small real-ish shape: head_dim 256 as Gemma 2 2B / 9B (the Triton attention's D = 256
tiles), ``query_pre_attn_scalar`` 192 != head_dim, caps small enough to be active on random weights, a 16-token
window on the even layers with prompts up to 40 tokens. bf16 is judged as in ``test_engine_gpu.py``: ours against a
float32 peft reference must be about as close as peft's own bf16 run.
"""

from __future__ import annotations

import pytest
import torch
from testsupport import gpu_engine, peft_adapters, peft_batch_logits, rel_err

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (runs on the device machine)"),
]

SHAPE = dict(vocab_size=4096, hidden_size=512, intermediate_size=1408, num_hidden_layers=6, num_attention_heads=8,
             num_key_value_heads=4, head_dim=256, query_pre_attn_scalar=192, max_position_embeddings=2048,
             sliding_window=16, attn_logit_softcapping=5.0, final_logit_softcapping=8.0, initializer_range=0.05,
             tie_word_embeddings=True)
ADAPTERS = {
    "qkv-r8": dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj"]),
    "all-r16-rslora": dict(r=16, lora_alpha=8, use_rslora=True,
                           target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    "kv-mlp-r4": dict(r=4, lora_alpha=8, target_modules=["k_proj", "v_proj", "down_proj"], rank_pattern={"v_proj": 2}),
}
ROW_ADAPTERS = ["qkv-r8", None, "all-r16-rslora", "kv-mlp-r4", "qkv-r8", None]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    import transformers

    torch.manual_seed(0)
    # eager attention: the one that soft-caps (an SDPA or flash path would drop the cap; a GPU machine's transformers
    # may pick one by default, as the CPU test's does not)
    hf = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(**SHAPE, attn_implementation="eager")).eval()
    assert hf.config._attn_implementation == "eager"
    with torch.no_grad():
        for pname, p in hf.named_parameters():
            if pname.endswith("norm.weight"):
                p.normal_(0.0, 0.3)  # scales 1 + w, not the init's 1
    d = tmp_path_factory.mktemp("gpu-gemma2")
    hf.save_pretrained(str(d / "model"))
    model = peft_adapters(hf, ADAPTERS, d / "adapters", std=0.05)
    g = torch.Generator().manual_seed(1)
    rows = [torch.randint(3, SHAPE["vocab_size"], (int(n),), generator=g).tolist()
            for n in torch.randint(3, 40, (len(ROW_ADAPTERS),), generator=g)]
    return model, d, rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemma2_engine_matches_peft_on_gpu(setup, dtype):
    model, d, rows = setup
    ref32 = peft_batch_logits(model, rows, ROW_ADAPTERS, torch.float32)
    engine = gpu_engine(d, ADAPTERS, dtype)
    assert engine.config.architecture == "gemma2" and engine.config.head_dim == 256
    ours = engine.logits(rows, adapters=ROW_ADAPTERS)
    if dtype == torch.float32:
        for i, a in enumerate(ROW_ADAPTERS):  # TF32 may be used by GEMMs and tl.dot: looser than the CPU's 1e-5
            assert rel_err(ours[i], ref32[i]) < 2e-3, (a, rel_err(ours[i], ref32[i]))
    else:
        theirs = peft_batch_logits(model, rows, ROW_ADAPTERS, dtype)
        for i, a in enumerate(ROW_ADAPTERS):
            ours_err, peft_err = rel_err(ours[i], ref32[i]), rel_err(theirs[i], ref32[i])
            assert ours_err < 2 * peft_err + 1e-3, (a, ours_err, peft_err)


def test_gemma2_triton_kernels_equal_torch_on_gpu(setup):
    """One prefill through the whole model, bf16: the Triton fused ops and attention (soft-capped, sliding) against
    the torch ops and attention, hidden states to bf16 rounding; each swapped alone and both."""
    _, d, rows = setup
    engine = gpu_engine(d, ADAPTERS, torch.bfloat16, cuda_graphs=False)
    tables = [engine.kv.allocate_seq(("probe", i), len(r)) for i, r in enumerate(rows)]
    plan = engine.runner.build_plan(rows, [0] * len(rows), tables, [-1] * len(rows), block_size=engine.kv.block_size)
    with torch.inference_mode():
        ref = engine.model.forward(plan, engine.kv, ops_backend="torch", attention_backend="torch").float()
        for ops, attn in (("triton", "torch"), ("torch", "triton"), ("triton", "triton")):
            out = engine.model.forward(plan, engine.kv, ops_backend=ops, attention_backend=attn).float()
            assert rel_err(out, ref) < 2e-2, (ops, attn, rel_err(out, ref))


def test_gemma2_cuda_graph_decode_matches_eager(setup):
    """fp32 greedy decode replayed from CUDA graphs (batch shrinking across buckets; sequences growing past the
    16-token window) equals eager decode."""
    from multilora import SamplingParams

    _, d, rows = setup
    max_tokens = [24, 3, 7, 24, 1, 18]
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in max_tokens]
    outs = {}
    for graphs in (False, True):
        engine = gpu_engine(d, ADAPTERS, torch.float32, max_seq_len=96, kv_block_size=4, cuda_graphs=graphs)
        assert (engine.graphs is not None) == graphs
        outs[graphs] = [o.token_ids for o in engine.generate(rows, adapters=ROW_ADAPTERS, sampling=params)]
        if graphs:
            assert len(engine.graphs.captured) >= 2, engine.graphs.captured
    assert [len(t) for t in outs[True]] == max_tokens
    assert outs[True] == outs[False]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gemma2_ops_at_9b_widths_on_gpu(dtype):
    """The new ops at Gemma 2 9B's widths (hidden 3584, inter 14336; attention 16 heads / 8 KV heads / head_dim 256,
    cap 50 and a tight cap 2): Triton against torch, and the attention against the float32 torch path."""
    from multilora.kernels import fused
    from multilora.kernels.attention import build_attention_metadata, paged_attention_torch
    from multilora.kernels.triton_attention import paged_attention_triton

    g = torch.Generator().manual_seed(0)
    tol = dict(atol=3e-2, rtol=1.6e-2) if dtype == torch.bfloat16 else dict(atol=4e-3, rtol=2e-3)
    T, N, inter = 37, 3584, 14336
    h, d = (torch.randn(2, T, N, generator=g) * 4).to(dtype).cuda()
    w1, w2 = (0.3 * torch.randn(2, N, generator=g)).to(dtype).cuda()
    torch.testing.assert_close(fused.rms_norm(h, w1, 1e-6, unit_offset=True, backend="triton"),
                               fused.rms_norm(h, w1, 1e-6, unit_offset=True, backend="torch"), **tol)
    h1, h2 = h.clone(), h.clone()
    o1 = fused.add_rms_norm(h1, d, w2, 1e-6, delta_weight=w1, unit_offset=True, backend="triton")
    o2 = fused.add_rms_norm(h2, d, w2, 1e-6, delta_weight=w1, unit_offset=True, backend="torch")
    torch.testing.assert_close(h1, h2, **tol)
    torch.testing.assert_close(o1, o2, **tol)
    gu = (torch.randn(T, 2 * inter, generator=g) * 4).to(dtype).cuda()
    torch.testing.assert_close(fused.gelu_tanh_mul(gu, backend="triton"), fused.gelu_tanh_mul(gu, backend="torch"),
                               **tol)
    H, Hkv, D, bs = 16, 8, 256, 16
    for q_lens, seq_lens in (([40, 1, 7, 1], [40, 300, 60, 4097]), ([1] * 8, [1, 17, 300, 700, 33, 2, 64, 129])):
        need = [-(-L // bs) for L in seq_lens]
        perm = torch.randperm(sum(need) + 4, generator=g).tolist()
        tables = [[perm.pop() for _ in range(k)] for k in need]
        meta = build_attention_metadata(q_lens, seq_lens, tables, block_size=bs, device="cuda")
        kc, vc = torch.randn(2, sum(need) + 4, bs, Hkv, D, generator=g).to(dtype).cuda()
        q = (torch.randn(sum(q_lens), H, D, generator=g) * 3).to(dtype).cuda()
        for cap, window in ((50.0, 0), (2.0, 0), (2.0, 64)):
            ref = paged_attention_torch(q.float(), kc.float(), vc.float(), meta, scale=256 ** -0.5,
                                        sliding_window=window, softcap=cap)
            out = paged_attention_triton(q, kc, vc, meta, scale=256 ** -0.5, sliding_window=window, softcap=cap)
            torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
