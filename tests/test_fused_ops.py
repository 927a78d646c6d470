"""The decoder's small ops (kernels/fused.py): the torch versions and the Triton kernels against independent
float64 references written another way:

- RMSNorm as ``x / (||x||_2 / sqrt(N))``, the residual add in float64;
- RoPE as complex multiplication of (x_i, x_{i + D/2}) pairs by ``exp(i * pos * theta_i)`` (the rotation
  the rotate-half form computes), and the cache rows read back through the slot mapping;
- SiLU as ``x * sigmoid(x)``; GELU_tanh as ``0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))`` (the kernel
  computes ``x * sigmoid(2 z)``);
- Gemma 2's RMSNorm as ``x / (||x||_2 / sqrt(N)) * (1 + w)``, and its normed delta before the residual add.

On CPU the Triton kernels run under TRITON_INTERPRET=1 (conftest) in fp32 and fp16; ``gpu`` tests run
bf16/fp16 on CUDA, including the whole model forward with the kernels against the torch ops.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from multilora.kernels import fused

HAS_CUDA = torch.cuda.is_available()
interp = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="CPU cases need TRITON_INTERPRET=1")
DEV = "cuda" if HAS_CUDA else "cpu"
# |out - ref| per output dtype, ref in float64 from the same rounded inputs, |ref| <~ 4: the output's own
# rounding (half an ulp) plus float32 intermediate roundings (RMSNorm: the dtype-rounded normed value times
# the weight rounds twice).
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=4e-3, rtol=2e-3),
       torch.bfloat16: dict(atol=3e-2, rtol=1.6e-2)}
BACKENDS = ["torch", pytest.param("triton", marks=interp)] if not HAS_CUDA else ["torch", "triton"]
CPU_DTYPES = [torch.float32, torch.float16]


def ref_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xd = x.double()
    rms = torch.sqrt((xd.norm(dim=-1, keepdim=True) ** 2) / x.shape[-1] + eps)
    return (xd / rms) * w.double()


def ref_rope(x: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] -> float64, pairs (i, i + D/2) rotated by pos * inv_freq[i] as complex numbers."""
    half = x.shape[-1] // 2
    xd = x.double()
    z = torch.complex(xd[..., :half], xd[..., half:])
    ang = pos.double()[:, None, None] * inv_freq.double()[None, None, :]
    r = z * torch.polar(torch.ones_like(ang), ang)
    return torch.cat((r.real, r.imag), dim=-1)


def tables(inv_freq: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    f = torch.arange(n, dtype=torch.float64)[:, None] * inv_freq.double()[None, :]
    emb = torch.cat((f, f), dim=-1)
    return emb.cos().float(), emb.sin().float()


# -------------------------------------------------------------------------------------------- RMSNorm
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("T,N", [(1, 64), (5, 96), (3, 4096)])
def test_rms_norm_matches_reference(backend, dtype, T, N):
    g = torch.Generator().manual_seed(N + T)
    x = (torch.randn(T, N, generator=g) * 3).to(dtype)
    w = (1 + 0.5 * torch.randn(N, generator=g)).to(dtype)
    out = fused.rms_norm(x, w, 1e-5, backend=backend)
    assert out.dtype == dtype and out.shape == (T, N)
    torch.testing.assert_close(out.double(), ref_rms_norm(x, w, 1e-5), **TOL[dtype])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", CPU_DTYPES)
def test_add_rms_norm_updates_residual_in_place(backend, dtype):
    g = torch.Generator().manual_seed(1)
    T, N = 4, 200
    h = torch.randn(T, N, generator=g).to(dtype)
    d = torch.randn(T, N, generator=g).to(dtype)
    w = (1 + 0.5 * torch.randn(N, generator=g)).to(dtype)
    h0 = h.clone()
    out = fused.add_rms_norm(h, d, w, 1e-6, backend=backend)
    summed = (h0.double() + d.double()).to(dtype)  # the sum, rounded to the dtype once
    assert torch.equal(h, summed), "h must hold h + delta rounded to its dtype"
    torch.testing.assert_close(out.double(), ref_rms_norm(summed, w, 1e-6), **TOL[dtype])


@interp
def test_rms_norm_triton_equals_torch_in_fp32():
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(7, 300, generator=g), torch.randn(300, generator=g)
    torch.testing.assert_close(fused.rms_norm(x, w, 1e-5, backend="triton"), fused.rms_norm_torch(x, w, 1e-5),
                               atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("T,N", [(1, 64), (5, 96), (3, 2304)])
def test_rms_norm_unit_offset_matches_reference(backend, dtype, T, N):
    """Gemma 2: ``* (1 + w)`` in float32, rounded once (so one rounding, not two, against the float64 reference)."""
    g = torch.Generator().manual_seed(N + T + 1)
    x = (torch.randn(T, N, generator=g) * 3).to(dtype)
    w = (0.5 * torch.randn(N, generator=g)).to(dtype)
    out = fused.rms_norm(x, w, 1e-6, unit_offset=True, backend=backend)
    assert out.dtype == dtype and out.shape == (T, N)
    torch.testing.assert_close(out.double(), ref_rms_norm(x, 1 + w.double(), 1e-6), **TOL[dtype])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("unit_offset", [False, True])
def test_add_rms_norm_of_a_normed_delta(backend, dtype, unit_offset):
    """Gemma 2's post-attention / post-feedforward norm fused with the residual add and the next norm:
    ``h += rms_norm(delta, w1)`` (the normed delta rounded to the dtype, then the sum rounded), returns
    ``rms_norm(h, w2)``."""
    g = torch.Generator().manual_seed(5 + unit_offset)
    T, N = 4, 200
    h = torch.randn(T, N, generator=g).to(dtype)
    d = (torch.randn(T, N, generator=g) * 7).to(dtype)
    w1, w2 = ((unit_offset is False) + 0.5 * torch.randn(2, N, generator=g)).to(dtype)
    h0 = h.clone()
    out = fused.add_rms_norm(h, d, w2, 1e-6, delta_weight=w1, unit_offset=unit_offset, backend=backend)
    scale = (lambda w: 1 + w.double()) if unit_offset else (lambda w: w)  # noqa: E731
    normed = ref_rms_norm(d, scale(w1), 1e-6).to(dtype)
    summed = h0.double() + normed.double()
    torch.testing.assert_close(h.double(), summed, **TOL[dtype])
    torch.testing.assert_close(out.double(), ref_rms_norm(h, scale(w2), 1e-6), **TOL[dtype])


@interp
@pytest.mark.parametrize("unit_offset", [False, True])
def test_normed_delta_triton_equals_torch_in_fp32(unit_offset):
    g = torch.Generator().manual_seed(3)
    h, d = torch.randn(2, 6, 300, generator=g)
    w1, w2 = torch.randn(2, 300, generator=g)
    h1, h2 = h.clone(), h.clone()
    a = fused.add_rms_norm(h1, d, w2, 1e-6, delta_weight=w1, unit_offset=unit_offset, backend="triton")
    b = fused.add_rms_norm_torch(h2, d, w2, 1e-6, delta_weight=w1, unit_offset=unit_offset)
    torch.testing.assert_close(h1, h2, atol=2e-6, rtol=2e-6)
    torch.testing.assert_close(a, b, atol=2e-6, rtol=2e-6)


# ------------------------------------------------------------------------------------------------ RoPE
def _rope_case(T, H, Hkv, D, dtype, seed, block_size=4, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(T, (H + 2 * Hkv) * D, generator=g).to(dtype)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
    n_pos = 64
    cos, sin = tables(inv_freq, n_pos)
    pos = torch.randint(0, n_pos, (T,), generator=g)
    num_blocks = -(-T // block_size) + 2
    slots = torch.randperm(num_blocks * block_size, generator=g)[:T]  # distinct, scattered
    kc = torch.full((num_blocks, block_size, Hkv, D), float("nan")).to(dtype)
    vc = kc.clone()
    to = lambda t: t.to(device)  # noqa: E731
    return [to(t) for t in (qkv, cos, sin, pos, slots, kc, vc)], inv_freq


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("T,H,Hkv,D", [(1, 4, 2, 16), (6, 9, 3, 64), (3, 8, 8, 32)])
def test_rope_write_kv_matches_reference(backend, dtype, T, H, Hkv, D):
    (qkv, cos, sin, pos, slots, kc, vc), inv_freq = _rope_case(T, H, Hkv, D, dtype, seed=T * H + D)
    q = fused.rope_write_kv(qkv, cos, sin, pos, slots, kc, vc, num_heads=H, num_kv_heads=Hkv, head_dim=D,
                            backend=backend)
    qr, kr, vr = qkv.split([H * D, Hkv * D, Hkv * D], dim=-1)
    assert q.shape == (T, H, D) and q.dtype == dtype
    torch.testing.assert_close(q.double(), ref_rope(qr.reshape(T, H, D), pos, inv_freq), **TOL[dtype])
    flat_k, flat_v = kc.view(-1, Hkv, D), vc.view(-1, Hkv, D)
    torch.testing.assert_close(flat_k[slots].double(), ref_rope(kr.reshape(T, Hkv, D), pos, inv_freq), **TOL[dtype])
    assert torch.equal(flat_v[slots], vr.reshape(T, Hkv, D)), "values are copied unchanged"
    untouched = torch.ones(flat_k.shape[0], dtype=torch.bool)
    untouched[slots] = False
    assert flat_k[untouched].isnan().all() and flat_v[untouched].isnan().all(), "a slot outside slot_mapping was written"


@pytest.mark.parametrize("backend", [pytest.param(b, marks=pytest.mark.gpu) for b in BACKENDS] if HAS_CUDA else BACKENDS)
@pytest.mark.parametrize("dtype", CPU_DTYPES + ([torch.bfloat16] if HAS_CUDA else []))
def test_rope_write_kv_into_blocks_that_lie_apart(backend, dtype):
    """A unified arena's KV views (``multilora.memory.unified``): block ``b`` of k and v lies a whole unit apart
    (here 3 rows of blocks: k, a filler the pool would own, v). Written there, q, k and v equal the same write into
    contiguous caches, and nothing between the blocks (the filler, other blocks' rows) is touched."""
    T, H, Hkv, D, bs = 5, 4, 2, 16, 4
    (qkv, cos, sin, pos, slots, kc, vc), _ = _rope_case(T, H, Hkv, D, dtype, seed=7, block_size=bs, device=DEV)
    nb = kc.shape[0]
    arena = torch.full((nb, 3, bs, Hkv, D), float("nan"), dtype=dtype, device=DEV)
    ks, vs = arena[:, 0], arena[:, 2]  # [nb, bs, Hkv, D], blocks 3 * bs * Hkv * D elements apart
    assert ks.stride(0) == 3 * bs * Hkv * D and not ks.is_contiguous()
    kw = dict(num_heads=H, num_kv_heads=Hkv, head_dim=D, backend=backend)
    q1 = fused.rope_write_kv(qkv, cos, sin, pos, slots, kc, vc, **kw)
    q2 = fused.rope_write_kv(qkv, cos, sin, pos, slots, ks, vs, **kw)
    assert torch.equal(q1, q2)
    assert torch.equal(kc.nan_to_num(), ks.nan_to_num()) and torch.equal(vc.nan_to_num(), vs.nan_to_num())
    assert torch.equal(kc.isnan(), ks.isnan()) and torch.equal(vc.isnan(), vs.isnan())
    assert arena[:, 1].isnan().all(), "a write landed between the blocks"


@interp
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(T=st.integers(1, 5), Hkv=st.integers(1, 3), G=st.integers(1, 3), D=st.sampled_from([2, 8, 24]),
       seed=st.integers(0, 1000))
def test_rope_write_kv_triton_equals_torch_fp32(T, Hkv, G, D, seed):
    args, _ = _rope_case(T, Hkv * G, Hkv, D, torch.float32, seed)
    kw = dict(num_heads=Hkv * G, num_kv_heads=Hkv, head_dim=D)
    a = [t.clone() for t in args]
    q1 = fused.rope_write_kv(*args, backend="triton", **kw)
    q2 = fused.rope_write_kv(*a, backend="torch", **kw)
    torch.testing.assert_close(q1, q2, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(args[5], a[5], atol=1e-6, rtol=1e-6, equal_nan=True)
    assert torch.equal(args[6].nan_to_num(), a[6].nan_to_num())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", CPU_DTYPES + ([torch.bfloat16] if HAS_CUDA else []))
@pytest.mark.parametrize("T,H,Hkv,D", [(1, 4, 2, 16), (5, 6, 1, 24), (3, 8, 8, 128)])
def test_rope_write_kv_with_qk_norm_matches_reference(backend, dtype, T, H, Hkv, D):
    """Qwen3: each q and k head RMS-normalised over head_dim by its own weight, then rotated. Reference: the
    float64 RMSNorm of each head (``ref_rms_norm``), rounded to the dtype as the op's input is, then RoPE as a
    complex rotation. On CUDA the tensors live there (bf16 too); on a CPU Triton runs in the interpreter."""
    (qkv, cos, sin, pos, slots, kc, vc), inv_freq = _rope_case(T, H, Hkv, D, dtype, seed=3 * T + D, device=DEV)
    g = torch.Generator().manual_seed(D)
    qn, kn = ((1 + 0.3 * torch.randn(D, generator=g)).to(dtype).to(DEV) for _ in range(2))
    eps = 1e-6
    q = fused.rope_write_kv(qkv, cos, sin, pos, slots, kc, vc, num_heads=H, num_kv_heads=Hkv, head_dim=D,
                            q_norm=qn, k_norm=kn, norm_eps=eps, backend=backend)
    qkv, pos, slots, qn, kn = (t.cpu() for t in (qkv, pos, slots, qn, kn))
    qr, kr, vr = qkv.split([H * D, Hkv * D, Hkv * D], dim=-1)
    q_ref = ref_rope(ref_rms_norm(qr.reshape(T, H, D), qn, eps).to(dtype), pos, inv_freq)
    k_ref = ref_rope(ref_rms_norm(kr.reshape(T, Hkv, D), kn, eps).to(dtype), pos, inv_freq)
    tol = {k: 2 * v for k, v in TOL[dtype].items()}  # the normed value rounds once more before the rotation
    torch.testing.assert_close(q.double().cpu(), q_ref, **tol)
    flat_k, flat_v = kc.view(-1, Hkv, D).cpu(), vc.view(-1, Hkv, D).cpu()
    torch.testing.assert_close(flat_k[slots].double(), k_ref, **tol)
    assert torch.equal(flat_v[slots], vr.reshape(T, Hkv, D)), "values are not normalised"


@interp
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(T=st.integers(1, 4), Hkv=st.integers(1, 3), G=st.integers(1, 3), D=st.sampled_from([2, 8, 24]),
       seed=st.integers(0, 1000))
def test_rope_write_kv_qk_norm_triton_equals_torch_fp32(T, Hkv, G, D, seed):
    args, _ = _rope_case(T, Hkv * G, Hkv, D, torch.float32, seed)
    g = torch.Generator().manual_seed(seed)
    kw = dict(num_heads=Hkv * G, num_kv_heads=Hkv, head_dim=D, q_norm=torch.randn(D, generator=g),
              k_norm=torch.randn(D, generator=g), norm_eps=1e-6)
    a = [t.clone() for t in args]
    q1 = fused.rope_write_kv(*args, backend="triton", **kw)
    q2 = fused.rope_write_kv(*a, backend="torch", **kw)
    torch.testing.assert_close(q1, q2, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(args[5], a[5], atol=1e-5, rtol=1e-5, equal_nan=True)


@pytest.mark.parametrize("backend", BACKENDS)
def test_rope_write_kv_qk_norm_arguments_are_checked(backend):
    (qkv, cos, sin, pos, slots, kc, vc), _ = _rope_case(2, 4, 2, 16, torch.float32, 0, device=DEV)
    kw = dict(num_heads=4, num_kv_heads=2, head_dim=16, backend=backend)
    with pytest.raises(ValueError, match="both q_norm and k_norm"):
        fused.rope_write_kv(qkv, cos, sin, pos, slots, kc, vc, q_norm=torch.ones(16, device=DEV), **kw)
    if backend == "triton":
        with pytest.raises(ValueError, match=r"k_norm: expected a contiguous \[16\]"):
            fused.rope_write_kv(qkv, cos, sin, pos, slots, kc, vc, q_norm=torch.ones(16, device=DEV),
                                k_norm=torch.ones(8, device=DEV), **kw)


@interp
def test_rope_write_kv_rejects_bad_shapes():
    (qkv, cos, sin, pos, slots, kc, vc), _ = _rope_case(2, 4, 2, 16, torch.float32, 0)
    with pytest.raises(ValueError, match="qkv: expected 128 columns"):
        fused.rope_write_kv(qkv[:, :-16], cos, sin, pos, slots, kc, vc, num_heads=4, num_kv_heads=2, head_dim=16,
                            backend="triton")
    with pytest.raises(ValueError, match="k_cache"):
        fused.rope_write_kv(qkv, cos, sin, pos, slots, kc.transpose(1, 2), vc, num_heads=4, num_kv_heads=2,
                            head_dim=16, backend="triton")
    with pytest.raises(ValueError, match="rope_cos: expected float32"):
        fused.rope_write_kv(qkv, cos.double(), sin, pos, slots, kc, vc, num_heads=4, num_kv_heads=2, head_dim=16,
                            backend="triton")


# ------------------------------------------------------------------------------------------- SiLU * up
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("T,inter", [(1, 8), (4, 1500)])
def test_silu_mul_matches_reference(backend, dtype, T, inter):
    g = torch.Generator().manual_seed(inter)
    gu = (torch.randn(T, 2 * inter, generator=g) * 4).to(dtype)
    out = fused.silu_mul(gu, backend=backend)
    gd, ud = gu.double().chunk(2, dim=-1)
    ref = gd * torch.sigmoid(gd) * ud
    assert out.shape == (T, inter) and out.dtype == dtype
    torch.testing.assert_close(out.double(), ref, atol=TOL[dtype]["atol"] * 4, rtol=TOL[dtype]["rtol"] * 2)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("T,inter", [(1, 8), (4, 1500)])
def test_gelu_tanh_mul_matches_reference(backend, dtype, T, inter):
    """GeGLU (Gemma 2, HF ``gelu_pytorch_tanh``): gate values out to +-12 cover both tails of the tanh."""
    g = torch.Generator().manual_seed(inter + 1)
    gu = (torch.randn(T, 2 * inter, generator=g) * 4).to(dtype)
    out = fused.gelu_tanh_mul(gu, backend=backend)
    gd, ud = gu.double().chunk(2, dim=-1)
    ref = 0.5 * gd * (1 + torch.tanh(math.sqrt(2 / math.pi) * (gd + 0.044715 * gd ** 3))) * ud
    assert out.shape == (T, inter) and out.dtype == dtype
    torch.testing.assert_close(out.double(), ref, atol=TOL[dtype]["atol"] * 4, rtol=TOL[dtype]["rtol"] * 2)
    assert fused.GATED_ACTS["gelu_pytorch_tanh"] is fused.gelu_tanh_mul and fused.GATED_ACTS["silu"] is fused.silu_mul


def test_backend_argument_is_checked():
    x = torch.ones(1, 4)
    with pytest.raises(ValueError, match="backend: expected 'torch', 'triton' or None, got 'cuda'"):
        fused.rms_norm(x, torch.ones(4), 1e-5, backend="cuda")


# ------------------------------------------------------------------------------------------------ GPU
@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (runs on the device machine)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_ops_match_torch_ops(dtype):
    g = torch.Generator().manual_seed(0)
    T, N, H, Hkv, D = 37, 4096, 32, 8, 128
    x = torch.randn(T, N, generator=g).to(dtype).cuda()
    w = (1 + 0.1 * torch.randn(N, generator=g)).to(dtype).cuda()
    d = torch.randn(T, N, generator=g).to(dtype).cuda()
    ulp = TOL[dtype]
    torch.testing.assert_close(fused.rms_norm(x, w, 1e-5, backend="triton"), fused.rms_norm(x, w, 1e-5, backend="torch"), **ulp)
    h1, h2 = x.clone(), x.clone()
    o1 = fused.add_rms_norm(h1, d, w, 1e-5, backend="triton")
    o2 = fused.add_rms_norm(h2, d, w, 1e-5, backend="torch")
    assert torch.equal(h1, h2)
    torch.testing.assert_close(o1, o2, **ulp)
    torch.testing.assert_close(o1.double(), ref_rms_norm(h2, w, 1e-5), **TOL[dtype])
    (qkv, cos, sin, pos, slots, kc, vc), inv_freq = _rope_case(T, H, Hkv, D, dtype, seed=3, block_size=16, device="cuda")
    a = [t.clone() for t in (kc, vc)]
    q1 = fused.rope_write_kv(qkv, cos, sin, pos, slots, kc, vc, num_heads=H, num_kv_heads=Hkv, head_dim=D, backend="triton")
    q2 = fused.rope_write_kv(qkv, cos, sin, pos, slots, *a, num_heads=H, num_kv_heads=Hkv, head_dim=D, backend="torch")
    torch.testing.assert_close(q1, q2, **ulp)
    torch.testing.assert_close(kc, a[0], equal_nan=True, **ulp)
    assert torch.equal(vc.nan_to_num(), a[1].nan_to_num())
    torch.testing.assert_close(q1.double().cpu(), ref_rope(qkv[:, : H * D].reshape(T, H, D).cpu(), pos.cpu(), inv_freq),
                               **TOL[dtype])
    gu = (torch.randn(T, 2 * 14336, generator=g) * 4).to(dtype).cuda()
    torch.testing.assert_close(fused.silu_mul(gu, backend="triton"), fused.silu_mul(gu, backend="torch"), **ulp)


# ------------------------------------------------------------------------------------- whole forward
@interp
def test_model_forward_with_triton_ops_equals_torch_ops():
    """The tiny random model, a prefill of two prompts then a decode step: hidden states and every KV-cache
    row the same with the Triton ops (interpreter, fp32) as with the torch ops."""
    from multilora import Engine
    from multilora.config import ModelConfig
    from multilora.runtime.weights import MODEL_SHAPES

    e = Engine(ModelConfig(**MODEL_SHAPES["tiny"]), device="cpu", progress=False, max_batch_size=2, max_seq_len=64,
               kv_block_size=4)
    steps = [([[5, 7, 9, 11, 13], [3, 1]], [0, 0]), ([[2], [4]], [5, 2])]
    tables = [[1, 2], [3]]
    out = {}
    for backend in ("torch", "triton"):
        for k, v in (e.kv.layer(i) for i in range(e.config.num_layers)):
            k.fill_(float("nan"))
            v.fill_(float("nan"))
        hs = []
        for ids, starts in steps:
            plan = e.runner.build_plan(ids, starts, tables, [-1] * len(ids), block_size=4)
            hs.append(e.model.forward(plan, e.kv, ops_backend=backend))
        out[backend] = hs, [t.clone() for i in range(e.config.num_layers) for t in e.kv.layer(i)]
    for a, b in zip(out["torch"][0], out["triton"][0]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    for a, b in zip(out["torch"][1], out["triton"][1]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, equal_nan=True)


# ------------------------------------------------------------------------------------- the LoRA delta's add
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", CPU_DTYPES)
def test_ops_add_a_lora_delta_as_the_sum_of_their_input(backend, dtype):
    """Each op after a projection takes the projection's LoRA output (``lora_delta``, computed beside it) and gives
    exactly what it gives for the rounded sum ``input + lora_delta`` as its input; the input is left as it was."""
    g = torch.Generator().manual_seed(9)
    T, N, inter = 3, 96, 80
    # residual add + RMSNorm, with and without Gemma 2's norm of the delta
    for dw in (None, (0.5 * torch.randn(N, generator=g)).to(dtype)):
        h, d, lo = (torch.randn(3, T, N, generator=g) * 3).to(dtype)
        w = (1 + 0.5 * torch.randn(N, generator=g)).to(dtype)
        h1, h2, d0 = h.clone(), h.clone(), d.clone()
        a = fused.add_rms_norm(h1, d, w, 1e-6, delta_weight=dw, lora_delta=lo, backend=backend)
        b = fused.add_rms_norm(h2, d + lo, w, 1e-6, delta_weight=dw, backend=backend)
        assert torch.equal(a, b) and torch.equal(h1, h2) and torch.equal(d, d0)
        assert not torch.equal(a, fused.add_rms_norm(h.clone(), d, w, 1e-6, delta_weight=dw, backend=backend))
    # RoPE + KV write (queries, keys and values all take their part of the delta)
    H, Hkv, D = 4, 2, 16
    (qkv, cos, sin, pos, slots, kc, vc), _ = _rope_case(T, H, Hkv, D, dtype, seed=4)
    lo = torch.randn(qkv.shape, generator=g).to(dtype)
    qkv0, kc2, vc2 = qkv.clone(), kc.clone(), vc.clone()
    kw = dict(num_heads=H, num_kv_heads=Hkv, head_dim=D, backend=backend)
    q1 = fused.rope_write_kv(qkv, cos, sin, pos, slots, kc, vc, lora_delta=lo, **kw)
    q2 = fused.rope_write_kv(qkv + lo, cos, sin, pos, slots, kc2, vc2, **kw)
    assert torch.equal(q1, q2) and torch.equal(qkv, qkv0)
    assert torch.equal(kc.nan_to_num(), kc2.nan_to_num()) and torch.equal(vc.nan_to_num(), vc2.nan_to_num())
    assert torch.equal(vc.view(-1, Hkv, D)[slots], (qkv + lo)[:, (H + Hkv) * D:].reshape(T, Hkv, D))
    # the gated activations
    gu, lo = (torch.randn(2, T, 2 * inter, generator=g) * 2).to(dtype)
    for op in (fused.silu_mul, fused.gelu_tanh_mul):
        assert torch.equal(op(gu, lora_delta=lo, backend=backend), op(gu + lo, backend=backend))


@pytest.mark.parametrize("backend", BACKENDS)
def test_lora_delta_of_the_wrong_shape_or_dtype_is_refused(backend):
    T, N = 2, 32
    h, d = torch.randn(2, T, N)
    w = torch.ones(N)
    cases = [(lambda lo: fused.add_rms_norm(h.clone(), d, w, 1e-6, lora_delta=lo, backend=backend), (T, 2 * N)),
             (lambda lo: fused.silu_mul(torch.randn(T, 2 * N), lora_delta=lo, backend=backend), (T, N))]
    for call, bad_shape in cases:
        with pytest.raises((ValueError, RuntimeError)):
            call(torch.randn(bad_shape))
    if backend == "triton":  # the Triton launchers name the argument
        with pytest.raises(ValueError, match="lora_delta: expected"):
            fused.add_rms_norm(h.clone(), d, w, 1e-6, lora_delta=torch.randn(T, 2 * N), backend=backend)
        with pytest.raises(ValueError, match="lora_delta: expected dtype"):
            fused.silu_mul(torch.randn(T, 2 * N), lora_delta=torch.randn(T, 2 * N).half(), backend=backend)


# ------------------------------------------------------------------ fp8 copies written beside the output (quant=True)
def _check_fp8_copy(y: torch.Tensor, yq: torch.Tensor, ys: torch.Tensor, backend: str) -> None:
    """``(yq, ys)`` is the quantization an fp8 GEMM would run on y, bit for bit: ``fp8.quantize_per_token_torch`` on
    the torch path, the Triton ``quantize_per_token`` kernel on the Triton path (Triton's float32 division is not
    torch's: the two agree on all but a rare value, ``tests/test_fp8_gpu.py``)."""
    from multilora.kernels.fp8 import FP8_DTYPE, quantize_per_token_torch
    if backend == "torch":
        wq, ws = quantize_per_token_torch(y)
    else:
        from multilora.kernels import triton_fp8
        wq, ws = triton_fp8.quantize_per_token(y)
    assert yq.dtype == FP8_DTYPE and ys.dtype == torch.float32 and ys.shape == (y.shape[0], 1)
    assert torch.equal(yq.view(torch.uint8), wq.view(torch.uint8)) and torch.equal(ys, ws)


@pytest.mark.parametrize("backend", [pytest.param(b, marks=pytest.mark.gpu) for b in BACKENDS] if HAS_CUDA else BACKENDS)
@pytest.mark.parametrize("dtype", CPU_DTYPES + ([torch.bfloat16] if HAS_CUDA else []))
@pytest.mark.parametrize("T,N,I", [(1, 64, 96), (5, 96, 1000), (3, 256, 2304)] + ([(70, 4096, 14336)] if HAS_CUDA else []))
def test_ops_write_the_fp8_copy_of_their_output(backend, dtype, T, N, I):
    """rms_norm / add_rms_norm / silu_mul / gelu_tanh_mul with ``quant=True``: the output as without (bit for bit on
    the CPU; on a GPU the variant with the copy is another compile, within the output's rounding), and its per-token
    fp8 copy bit for bit the quantization of that output (what the fp8 GEMM would do with it), incl. an all-zero row."""

    def same(got, want):
        if DEV == "cpu":
            assert torch.equal(got, want)
        else:
            torch.testing.assert_close(got, want, **TOL[dtype])

    g = torch.Generator().manual_seed(T * N + I)
    x = (torch.randn(T, N, generator=g) * 3).to(DEV, dtype)
    x[0] = 0  # the minimum scale
    w = (torch.rand(N, generator=g) + 0.5).to(DEV, dtype)
    d = torch.randn(T, N, generator=g).to(DEV, dtype)
    y = fused.rms_norm(x, w, 1e-6, backend=backend)
    got, (q, s) = fused.rms_norm(x, w, 1e-6, backend=backend, quant=True)
    same(got, y)
    _check_fp8_copy(got, q, s, backend)
    h1, h2 = x.clone(), x.clone()
    y = fused.add_rms_norm(h1, d, w, 1e-6, backend=backend)
    got, (q, s) = fused.add_rms_norm(h2, d, w, 1e-6, backend=backend, quant=True)
    same(got, y)
    assert torch.equal(h1, h2)
    _check_fp8_copy(got, q, s, backend)
    gu = torch.randn(T, 2 * I, generator=g).to(DEV, dtype)
    lora = (torch.randn(T, 2 * I, generator=g) * 0.1).to(DEV, dtype)
    for op in (fused.silu_mul, fused.gelu_tanh_mul):
        for ld in (None, lora):
            y = op(gu, lora_delta=ld, backend=backend)
            got, (q, s) = op(gu, lora_delta=ld, backend=backend, quant=True)
            same(got, y)
            _check_fp8_copy(got, q, s, backend)
    empty, (q, s) = fused.silu_mul(gu[:0], backend=backend, quant=True)
    assert empty.shape == (0, I) and q.shape == (0, I) and s.shape == (0, 1)
