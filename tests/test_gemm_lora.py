"""``kernels.experimental.gemm_lora``: the base GEMM with the LoRA expand in its epilogue, against an independent
fp32 reference (``x W^T`` plus ``test_kernels.reference``'s per-token loop over A and B read back from the pool).

On the CPU under TRITON_INTERPRET=1 in fp32 and fp16 on small shapes whose slice widths are multiples of 16; the
``gpu`` cases run bf16 / fp16 at Llama-3-8B widths, and hold the kernel to the engine's path (the LoRA term written
first, cuBLAS adding ``x W^T``)."""

from __future__ import annotations

import os

import pytest
import torch

from multilora.config import ModelConfig
from multilora.kernels import build_lora_plan, lora_slices
from multilora.kernels.experimental.gemm_lora import gemm_lora
from test_kernels import CASES, CPU_CASES, GATE_UP, HAS_CUDA, LLAMA8B, QKV, TOL, make_pool, reference

# head_dim 16: q 64, k / v 32; gate / up 96; down 96 -> 64: every width a multiple of 16 (a column tile in one slice)
WIDE16 = ModelConfig(vocab_size=16, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2)


def _sequences(rows: int, slots: list[int], gen: torch.Generator) -> list[int]:
    """A prefill's token slots: sequences of random lengths, each on one slot (or none, -1), back to back."""
    out = []
    while len(out) < rows:
        n = int(torch.randint(1, 24, (), generator=gen))
        s = slots[int(torch.randint(0, len(slots), (), generator=gen))] if torch.rand((), generator=gen) > 0.15 else -1
        out += [s] * n
    return out[:rows]


def _case(cfg, modules, rows, *, device, dtype, seed=0, layer=1, ranks=(8, 12, 1, 16, 4), skip=None):
    gen = torch.Generator().manual_seed(seed)
    pool, slots = make_pool(cfg, list(ranks), dtype=dtype, device=device, seed=seed, skip=skip)
    token_slots = _sequences(rows, slots, gen)
    slices = lora_slices([pool.module_view(layer, m) for m in modules])
    x = torch.randn(rows, slices.d_in, generator=gen).to(device, dtype)
    w = (torch.randn(slices.d_out, slices.d_in, generator=gen) / slices.d_in ** 0.5).to(device, dtype)
    plan = build_lora_plan(token_slots, device=device)
    ref = reference(torch.zeros(rows, slices.d_out, device=device), x, pool, layer, modules, token_slots) \
        + x.float() @ w.float().t()
    return pool, slices, plan, x, w, ref, token_slots


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("modules", [QKV, GATE_UP, ("down_proj",)], ids=["qkv", "gate_up", "down"])
@pytest.mark.parametrize("rows", [1, 37, 70])
def test_gemm_lora_is_the_base_gemm_plus_the_lora_term(rows, modules, device, dtype):
    """Sequences of one slot each (some of none), ranks 1-16 varying by module, one adapter targeting no q/k/v or
    gate/up slice (rank 0 there): ``x W^T`` + every row's LoRA term; rows without an adapter get exactly the plain
    GEMM's values (the same kernel without the epilogue)."""
    cfg = WIDE16 if device == "cpu" else LLAMA8B
    pool, slices, plan, x, w, ref, token_slots = _case(  # (LLAMA8B has one layer: layer 1 failed on the GPU)
        cfg, modules, rows, device=device, dtype=dtype, seed=rows, skip={2: ("k_proj", "up_proj")},
        layer=cfg.num_layers - 1)
    kw = dict(block_m=16, block_n=16, block_k=32) if device == "cpu" else {}
    y = gemm_lora(x, w, slices, plan, **kw)
    torch.testing.assert_close(y.float(), ref, **TOL[dtype])
    base = gemm_lora(x, w, **kw)
    torch.testing.assert_close(base.float(), x.float() @ w.float().t(), **TOL[dtype])
    none = torch.tensor([s < 0 for s in token_slots], device=device)
    assert torch.equal(y[none], base[none]), "rows of slot -1: the plain GEMM"


@pytest.mark.parametrize("device,dtype", CPU_CASES)
def test_tiles_tma_and_odd_k(device, dtype):
    """Other tiles (64-row tiles over several sequences, 32-wide columns), K not a multiple of block_k (down's 96
    in 64-wide steps: the masked loop), group_m 1 and 4, the tiles through tensor descriptors, and a shrink split 2
    and 3 ways over K (the partials summed in the epilogue): all the reference's values."""
    for modules, kw in ((GATE_UP, dict(block_m=64, block_n=32, block_k=16, group_m=1)),
                        (("down_proj",), dict(block_m=32, block_n=16, block_k=64, group_m=4)),
                        (QKV, dict(block_m=16, block_n=32, block_k=32, tma=True)),
                        (("down_proj",), dict(block_m=16, block_n=16, block_k=64, tma=True))):
        pool, slices, plan, x, w, ref, _ = _case(WIDE16, modules, 53, device=device, dtype=dtype, seed=len(kw))
        torch.testing.assert_close(gemm_lora(x, w, slices, plan, **kw).float(), ref, **TOL[dtype])
    # the shrink's K split as the kernel's runtime loop (2 and 3 partials summed in the epilogue)
    from multilora.kernels.triton_sgmv import sgmv_shrink

    pool, slices, plan, x, w, ref, _ = _case(WIDE16, ("down_proj",), 40, device=device, dtype=dtype, seed=9)
    for split in (2, 3):
        v = sgmv_shrink(x, slices, plan, split_k=split, block_k=16)
        assert v.shape[0] == split
        torch.testing.assert_close(gemm_lora(x, w, slices, plan, v, block_m=16, block_n=16, block_k=32).float(), ref,
                                   **TOL[dtype])


def test_errors_name_the_argument():
    pool, slices, plan, x, w, _, _ = _case(WIDE16, QKV, 8, device="cpu", dtype=torch.float32)
    with pytest.raises(ValueError, match=r"block_n: every slice's width must be a multiple of it .* got block_n 64 "
                                         r"and widths \[64, 32, 32\]"):
        gemm_lora(x, w, slices, plan, block_n=64)
    with pytest.raises(ValueError, match="plan: expected the step's LoRAPlan with slices, got None"):
        gemm_lora(x, w, slices)
    with pytest.raises(ValueError, match="block_k: expected a power of two >= 16, got 24"):
        gemm_lora(x, w, block_k=24)
    with pytest.raises(ValueError, match=r"x, weight: expected \[M, K\] and \[N, K\]"):
        gemm_lora(x, w[:, :-1])
    with pytest.raises(ValueError, match="x, weight: expected one of float16, bfloat16, float32 for both"):
        gemm_lora(x, w.half())
    with pytest.raises(ValueError, match="plan: expected x's 7 tokens, got 8"):
        gemm_lora(x[:7], w, slices, plan)
    with pytest.raises(ValueError, match=r"slices: expected d_in 64 and d_out 64 \(x's and weight's\), got 64 and 128"):
        gemm_lora(x, w[:64], slices, plan)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (runs on the device machine)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("modules", [QKV, GATE_UP, ("down_proj",)], ids=["qkv", "gate_up", "down"])
@pytest.mark.parametrize("tma", [False, True], ids=["ptr", "tma"])
def test_gpu_prefill_against_the_engines_path(tma, modules, dtype):
    """A 1,000-token prefill at Llama-3-8B widths on ranks 1-64 (so several 16-rank dots per slot): the reference's
    values, and the engine's path (``lora_delta`` then ``addmm_``) within one rounding of the term."""
    from multilora.kernels import lora_delta

    pool, slices, plan, x, w, ref, _ = _case(LLAMA8B, modules, 1000, device="cuda", dtype=dtype, layer=0,
                                             ranks=(64, 1, 33, 16, 48))
    y = gemm_lora(x, w, slices, plan, tma=tma)
    torch.testing.assert_close(y.float(), ref, **TOL[dtype])
    engine = torch.empty_like(y)
    lora_delta(engine, x, slices, plan)
    engine.addmm_(x, w.t())
    torch.testing.assert_close(y.float(), engine.float(), **TOL[dtype])



@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the CPU engine's Triton LoRA needs the "
                                                                         "interpreter")
def test_engine_prefill_takes_the_epilogue_gemm_when_switched_on(tmp_path, monkeypatch):
    """``runtime.model.LORA_GEMM_EPILOGUE_MIN_TOKENS`` (off by default): a 2 x 150-token prefill on two adapters (a
    300-token step, past ``LORA_BEFORE_GEMM_MIN_TOKENS``) runs every projection through ``gemm_lora`` and gives the
    logits of the engine's path (fp32 on the CPU: within 1e-4); off, nothing calls it."""
    from multilora.kernels.experimental import gemm_lora as gl
    from multilora.runtime import model as model_mod
    from multilora.runtime.weights import MODEL_SHAPES
    from testsupport import two_adapter_prefill

    cfg = ModelConfig(**MODEL_SHAPES["tiny"])  # (hidden 64, q 64, k / v 32, intermediate 128: multiples of 16)
    e, prompts = two_adapter_prefill(tmp_path, cfg)
    calls = []
    real = gl.gemm_lora
    monkeypatch.setattr(gl, "gemm_lora", lambda *a, **k: calls.append(a[0].shape[0]) or real(*a, **k))
    before = e.logits(prompts, adapters=["a0", "a1"])
    assert calls == []
    monkeypatch.setattr(model_mod, "LORA_GEMM_EPILOGUE_MIN_TOKENS", 256)
    after = e.logits(prompts, adapters=["a0", "a1"])
    assert calls == [300] * 4 * cfg.num_layers, calls  # (q/k/v, o, gate/up, down of every layer)
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-4)
