"""``triton_sgmv.glu_shrink``: the MLP's gated activation and the down projection's LoRA shrink in one kernel,
against independent references: ``fused.silu_mul_torch`` / ``gelu_tanh_mul_torch`` for the activation, and
``test_kernels.reference`` (a per-token fp32 loop over A and B read back from the pool) for the LoRA term that
``sgmv_expand`` makes of the kernel's ``v``.

On the CPU under TRITON_INTERPRET=1 in fp32 and fp16 on small shapes; the ``gpu`` cases run bf16 / fp16 at the
Llama-3-8B width (intermediate 14,336)."""

from __future__ import annotations

import os

import pytest
import torch

from multilora.config import ModelConfig
from multilora.kernels import build_lora_plan, lora_slices
from multilora.kernels.fused import gelu_tanh_mul_torch, silu_mul_torch
from multilora.kernels.triton_fused import gelu_tanh_mul, silu_mul
from multilora.kernels.triton_sgmv import glu_shrink, lora_delta_triton, sgmv_expand
from test_kernels import CASES, GPU_CASES, LLAMA8B, TOL, make_pool, reference

# intermediate 96 (6 column blocks of 16), hidden 64
SMALL = ModelConfig(vocab_size=16, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2)
DOWN = ("down_proj",)


def _token_slots(rows: int, slots: list[int], gen: torch.Generator, *, mixed: bool) -> list[int]:
    """Sequences of random lengths, each on one slot or none (-1), back to back; ``mixed``: every token its own
    draw (blocks of many slots: the kernel's slot loop)."""
    if mixed:
        pick = torch.randint(-1, len(slots), (rows,), generator=gen).tolist()
        return [slots[i] if i >= 0 else -1 for i in pick]
    out = []
    while len(out) < rows:
        n = int(torch.randint(1, 24, (), generator=gen))
        s = slots[int(torch.randint(0, len(slots), (), generator=gen))] if torch.rand((), generator=gen) > 0.2 else -1
        out += [s] * n
    return out[:rows]


def _case(cfg, rows, *, device, dtype, seed, mixed, layer, ranks=(8, 12, 1, 16, 4), skip=None, gelu=False, **kw):
    gen = torch.Generator().manual_seed(seed)
    pool, slots = make_pool(cfg, list(ranks), dtype=dtype, device=device, seed=seed, skip=skip)
    token_slots = _token_slots(rows, slots, gen, mixed=mixed)
    slices = lora_slices([pool.module_view(layer, "down_proj")])
    gate_up = (2 * torch.randn(rows, 2 * slices.d_in, generator=gen)).to(device, dtype)
    plan = build_lora_plan(token_slots, device=device)
    h, v = glu_shrink(gate_up, slices, plan, gelu_tanh=gelu, **kw)
    h_ref = (gelu_tanh_mul_torch if gelu else silu_mul_torch)(gate_up)
    y = sgmv_expand(torch.empty(rows, slices.d_out, dtype=dtype, device=device), v, slices, plan, overwrite=True)
    return pool, slices, plan, token_slots, gate_up, h, h_ref, v, y


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("gelu", [False, True], ids=["silu", "gelu_tanh"])
@pytest.mark.parametrize("rows,mixed", [(1, False), (37, False), (70, True), (150, False)])
def test_activation_and_lora_term_match_the_references(rows, mixed, gelu, device, dtype):
    """Every row's activation (adapted or not) equals the unfused op's within one unit in the last place, and the
    LoRA term expanded from ``v`` is every row's ``s * (h A^T) B^T`` (zeros in rows of slot -1), with ranks 1-16 and an
    adapter that does not target down_proj (rank 0)."""
    cfg = SMALL if device == "cpu" else LLAMA8B
    kw = dict(block_m=16, block_k=32) if device == "cpu" else {}
    pool, slices, plan, ts, gu, h, h_ref, v, y = _case(
        cfg, rows, device=device, dtype=dtype, seed=rows + 7 * gelu, mixed=mixed, layer=cfg.num_layers - 1,
        skip={2: ("down_proj",)}, gelu=gelu, **kw)
    ulp = {torch.float32: 2e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]
    torch.testing.assert_close(h.float(), h_ref.float(), atol=ulp, rtol=ulp)
    ref = reference(torch.zeros_like(y, dtype=torch.float32), h_ref, pool, cfg.num_layers - 1, DOWN, ts)
    torch.testing.assert_close(y.float(), ref, **TOL[dtype])
    none = torch.tensor([s < 0 for s in ts], device=device)
    assert torch.count_nonzero(y[none]) == 0


@pytest.mark.gpu  # (literally here: scripts/gpu_suite.sh shards the files that say mark.gpu)
@pytest.mark.parametrize("device,dtype", GPU_CASES)
@pytest.mark.parametrize("gelu", [False, True], ids=["silu", "gelu_tanh"])
def test_prefill_tiles_on_the_gpu(gelu, device, dtype):
    """More than 512 tokens take the prefill tiles (``GLU_SHRINK_TILES``) and the default K split: 1,100 tokens of
    sequences on ranks 1-16 (and rows of none) at the Llama-3-8B width, against the references."""
    pool, slices, plan, ts, gu, h, h_ref, v, y = _case(LLAMA8B, 1100, device=device, dtype=dtype, seed=11, mixed=False,
                                                       layer=0, gelu=gelu)
    assert torch.equal(h, (gelu_tanh_mul if gelu else silu_mul)(gu))
    ref = reference(torch.zeros_like(y, dtype=torch.float32), h, pool, 0, DOWN, ts)
    torch.testing.assert_close(y.float(), ref, **TOL[dtype])


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("split_k", [1, 2, 3, 4])  # (4: the last split's K range is empty, its partials zeros)
def test_split_k_and_blocks_that_mix_slots(split_k, device, dtype):
    """A K split of 1-4 (partials summed by the expand; at 4 the last split has no columns) and 8-row blocks over
    tokens drawn one by one (most blocks hold several slots and rows of none): the same term as ``lora_delta``
    computed from the stored h, and h bit for bit the unfused Triton GLU's."""
    cfg = SMALL if device == "cpu" else LLAMA8B
    pool, slices, plan, ts, gu, h, h_ref, v, y = _case(
        cfg, 45, device=device, dtype=dtype, seed=split_k, mixed=True, layer=0, block_m=16 if device == "cuda" else 8,
        block_k=16 if device == "cpu" else None, split_k=split_k)
    assert v.shape[0] == split_k
    assert torch.equal(h, silu_mul(gu))
    unfused = lora_delta_triton(torch.empty_like(y), h, slices, plan)
    torch.testing.assert_close(y.float(), unfused.float(), **TOL[dtype])
    torch.testing.assert_close(y.float(), reference(torch.zeros_like(y, dtype=torch.float32), h, pool, 0, DOWN, ts),
                               **TOL[dtype])


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="CPU cases need TRITON_INTERPRET=1")
def test_no_adapted_row_and_no_rows():
    """A step with no adapter still gets its activation; zero rows give empty tensors."""
    pool, slots = make_pool(SMALL, [4], dtype=torch.float32, device="cpu")
    slices = lora_slices([pool.module_view(0, "down_proj")])
    gu = torch.randn(20, 2 * slices.d_in)
    h, _ = glu_shrink(gu, slices, build_lora_plan([-1] * 20), block_m=8, block_k=32)
    torch.testing.assert_close(h, silu_mul_torch(gu), atol=2e-6, rtol=2e-6)
    h, v = glu_shrink(gu[:0], slices, build_lora_plan([]))
    assert h.shape == (0, slices.d_in) and v.shape[2] == 0


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="CPU cases need TRITON_INTERPRET=1")
def test_errors_name_the_argument():
    pool, slots = make_pool(SMALL, [4], dtype=torch.float32, device="cpu")
    down = lora_slices([pool.module_view(0, "down_proj")])
    gate_up = lora_slices([pool.module_view(0, m) for m in ("gate_proj", "up_proj")])
    plan = build_lora_plan([slots[0]] * 4)
    with pytest.raises(ValueError, match="slices: expected the down projection's one slice"):
        glu_shrink(torch.randn(4, 2 * down.d_in), gate_up, plan)
    with pytest.raises(ValueError, match=r"gate_up: expected shape \[4, 192\], got \(4, 190\)"):
        glu_shrink(torch.randn(4, 190), down, plan)
    with pytest.raises(ValueError, match="gate_up: expected shape"):
        glu_shrink(torch.randn(5, 2 * down.d_in), down, plan)
    with pytest.raises(ValueError, match="dtype mismatch: gate_up is torch.float16"):
        glu_shrink(torch.randn(4, 2 * down.d_in).half(), down, plan)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the CPU engine's Triton LoRA needs the "
                                                                         "interpreter")
@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_engine_prefill_takes_the_fused_kernel_when_switched_on(tmp_path, monkeypatch, family):
    """``runtime.model.GLU_SHRINK_MIN_TOKENS`` (off by default): a 2 x 150-token prefill on two adapters (a 300-token
    step, past ``LORA_BEFORE_GEMM_MIN_TOKENS``) runs every layer's activation and down shrink through ``glu_shrink``
    (GeGLU for Gemma 2) and gives the logits of the engine's unfused path (fp32 on the CPU: within 1e-4); off, or
    with more runs of one slot in a 64-token block than ``GLU_SHRINK_MAX_BLOCK_RUNS``, nothing calls it."""
    from multilora.kernels import triton_sgmv
    from multilora.runtime import model as model_mod
    from multilora.runtime.weights import MODEL_SHAPES
    from testsupport import two_adapter_prefill

    extra = {} if family == "llama" else dict(hidden_act="gelu_pytorch_tanh", norm_unit_offset=True,
                                              block_output_norms=True)
    cfg = ModelConfig(**{**MODEL_SHAPES["tiny"], **extra})
    e, prompts = two_adapter_prefill(tmp_path, cfg)
    calls = []
    real = triton_sgmv.glu_shrink
    monkeypatch.setattr(triton_sgmv, "glu_shrink", lambda *a, **k: calls.append((a[0].shape[0], k)) or real(*a, **k))
    before = e.logits(prompts, adapters=["a0", "a1"])
    assert calls == []
    monkeypatch.setattr(model_mod, "GLU_SHRINK_MIN_TOKENS", 256)
    after = e.logits(prompts, adapters=["a0", "a1"])
    assert calls == [(300, {"gelu_tanh": family == "gemma2"})] * cfg.num_layers, calls
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-4)
    calls.clear()
    monkeypatch.setattr(model_mod, "GLU_SHRINK_MAX_BLOCK_RUNS", 1)  # tokens 128-191 hold both prompts: 2 runs
    e.logits(prompts, adapters=["a0", "a1"])
    assert calls == []


def test_plans_count_the_runs_of_one_slot_per_block():
    """``LoRAPlan.max_block_runs`` (what bounds the kernel's passes per block) against a plain loop over 64-token
    blocks, on prefills, decode batches and mixes of both."""
    from multilora.kernels.lora import RUN_BLOCK

    gen = torch.Generator().manual_seed(3)
    cases = [[], [5] * 300, [1] * 100 + [2] * 100, list(range(70)), [-1, -1, 3, 3, -1] * 40,
             torch.randint(-1, 4, (257,), generator=gen).tolist(), list(range(64)) + [7] * 512]
    for slots in cases:
        want = max((1 + sum(a != b for a, b in zip(blk[1:], blk[:-1]))
                    for blk in (slots[i: i + RUN_BLOCK] for i in range(0, len(slots), RUN_BLOCK))), default=0)
        assert build_lora_plan(slots).max_block_runs == want, slots[:8]
