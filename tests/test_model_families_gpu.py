"""Qwen2 and Qwen3 on a GPU: the engine with every Triton path (LoRA, paged attention, the fused ops with Qwen3's
q/k norm inside the RoPE kernel; biases through addmm) against transformers + peft, and CUDA-graph decode
against eager decode.

Runs on the device machine (``python -m pytest -m gpu``); skipped on CPU. Random-weight models of a small
real-ish shape (hidden 512; Qwen3 with head_dim 128 != hidden / heads), biases and q/k norm weights redrawn
so they matter. bf16 is judged as in ``test_engine_gpu.py``: ours against a float32 peft reference must be about
as close as peft's own bf16 run.
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
             num_key_value_heads=2, max_position_embeddings=2048, rms_norm_eps=1e-6, rope_theta=1e6)
FAMILIES = {
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", dict(head_dim=128, tie_word_embeddings=False)),
}
ADAPTERS = {
    "qkv-r8": dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj"]),
    "all-r16-rslora": dict(r=16, lora_alpha=8, use_rslora=True,
                           target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    "kv-mlp-r4": dict(r=4, lora_alpha=8, target_modules=["k_proj", "v_proj", "down_proj"], rank_pattern={"v_proj": 2}),
}
ROW_ADAPTERS = ["qkv-r8", None, "all-r16-rslora", "kv-mlp-r4", "qkv-r8", None]


@pytest.fixture(scope="module", params=list(FAMILIES))
def setup(request, tmp_path_factory):
    import transformers

    cls_name, cfg_name, extra = FAMILIES[request.param]
    torch.manual_seed(0)
    hf = getattr(transformers, cls_name)(getattr(transformers, cfg_name)(**SHAPE, **extra)).eval()
    with torch.no_grad():
        for pname, p in hf.named_parameters():
            if pname.endswith(".bias"):
                p.normal_(0.0, 0.5)
            elif pname.endswith(("q_norm.weight", "k_norm.weight")):
                p.copy_(1 + 0.3 * torch.randn_like(p))
    d = tmp_path_factory.mktemp(f"gpu-{request.param}")
    hf.save_pretrained(str(d / "model"))
    model = peft_adapters(hf, ADAPTERS, d / "adapters", std=0.05)
    g = torch.Generator().manual_seed(1)
    rows = [torch.randint(3, SHAPE["vocab_size"], (int(n),), generator=g).tolist()
            for n in torch.randint(3, 40, (len(ROW_ADAPTERS),), generator=g)]
    return request.param, model, d, rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qwen_engine_matches_peft_on_gpu(setup, dtype):
    family, model, d, rows = setup
    ref32 = peft_batch_logits(model, rows, ROW_ADAPTERS, torch.float32)
    engine = gpu_engine(d, ADAPTERS, dtype)
    assert engine.config.architecture == family
    ours = engine.logits(rows, adapters=ROW_ADAPTERS)
    if dtype == torch.float32:
        for i, a in enumerate(ROW_ADAPTERS):  # TF32 may be used by GEMMs and tl.dot: looser than the CPU's 1e-5
            assert rel_err(ours[i], ref32[i]) < 2e-3, (family, a, rel_err(ours[i], ref32[i]))
    else:
        theirs = peft_batch_logits(model, rows, ROW_ADAPTERS, dtype)
        for i, a in enumerate(ROW_ADAPTERS):
            ours_err, peft_err = rel_err(ours[i], ref32[i]), rel_err(theirs[i], ref32[i])
            assert ours_err < 2 * peft_err + 1e-3, (family, a, ours_err, peft_err)


def test_qwen_fused_ops_triton_equal_torch_on_gpu(setup):
    """One prefill through the whole model: the Triton fused ops (q/k norm in the RoPE kernel) against the torch
    ops, bf16, hidden states to bf16 rounding."""
    family, _, d, rows = setup
    engine = gpu_engine(d, ADAPTERS, torch.bfloat16, cuda_graphs=False)
    tables = [engine.kv.allocate_seq(("probe", i), len(r)) for i, r in enumerate(rows)]
    plan = engine.runner.build_plan(rows, [0] * len(rows), tables, [-1] * len(rows), block_size=engine.kv.block_size)
    with torch.inference_mode():
        a = engine.model.forward(plan, engine.kv, ops_backend="torch").float()
        b = engine.model.forward(plan, engine.kv, ops_backend="triton").float()
    assert rel_err(b, a) < 2e-2, (family, rel_err(b, a))


def test_qwen_cuda_graph_decode_matches_eager(setup):
    """fp32 greedy decode replayed from CUDA graphs (batch shrinking across buckets) equals eager decode."""
    from multilora import SamplingParams

    family, _, d, rows = setup
    max_tokens = [10, 3, 7, 10, 1, 6]
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in max_tokens]
    outs = {}
    for graphs in (False, True):
        engine = gpu_engine(d, ADAPTERS, torch.float32, max_seq_len=64, kv_block_size=4, cuda_graphs=graphs)
        assert (engine.graphs is not None) == graphs
        outs[graphs] = [o.token_ids for o in engine.generate(rows, adapters=ROW_ADAPTERS, sampling=params)]
        if graphs:
            assert len(engine.graphs.captured) >= 2, engine.graphs.captured
    assert [len(t) for t in outs[True]] == max_tokens
    assert outs[True] == outs[False], family
