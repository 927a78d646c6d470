"""fp8 base weights: float8 (e4m3) linear weights with one float32 scale per output channel, and the GEMM that
uses them. The LoRA shrink/expand and everything else stay in the activation dtype (bf16).

Quantization (per output channel, symmetric; as vLLM's and TensorRT-LLM's "fp8 per-channel" weight schemes):

    scale[n] = max_k |W[n, k]| / 448          (448 = the largest finite float8_e4m3fn, OCP FP8 spec, 2022)
    Wq[n, k] = float8_e4m3fn(W[n, k] / scale[n])     so   W ~= Wq * scale[:, None]

Two GEMMs compute ``y = x @ (Wq * scale[:, None])^T (+ bias)`` [T, N] in x's dtype (``method``):

- ``"scaled_mm"``: the activations are quantized too, dynamically per token (``xs[t] = max_k |x[t, k]| / 448``,
  ``xq = float8(x / xs)``), then one ``torch._scaled_mm`` (cuBLASLt's fp8 tensor-core GEMM on Hopper, with
  row-wise scales ``scale_a = xs [T, 1]`` and ``scale_b = scale [1, N]`` applied in its epilogue); for at most
  64 rows, where the GPU's tuned table has a "scaled_configs" entry for the shape, our split-K Triton kernel
  instead (``triton_fp8.fp8_gemv2(fp8_x=True)``: the same quantization, fp8 tensor cores, the scales at the
  store; on the H200 most of those tiles load through TMA tensor descriptors: ``triton_fp8``'s module docstring).
  Reads 1 byte per weight and uses fp8 tensor cores; adds the activation's rounding to e4m3 (3 mantissa bits).
- ``"weight_only"`` (CUDA, Triton: ``multilora.kernels.triton_fp8``): the activations stay in bf16; each fp8
  weight tile is widened to bf16 in registers and the product accumulates in fp32, the scale applied once per
  output column. Reads 1 byte per weight and adds no activation rounding; uses bf16 tensor cores.
- ``"dequant"``: the reference (tests, CPU): ``x.float() @ (Wq.float() * scale)^T``, rounded once to x's dtype.

None picks ``"weight_only"`` on CUDA for at most ``WEIGHT_ONLY_MAX_TOKENS`` rows (decode: bandwidth-bound, where
skipping the activation quantization and its extra launch pays; for a shape the GPU's tuned table has
fp8-activation tiles for at this row count, the table's limit instead, ``triton_fp8.weight_only_max_tokens``) and
``"scaled_mm"`` otherwise, and on the CPU
(torch implements ``_scaled_mm`` there too). The threshold is measured (``bench/bench_fp8.py``, results in
``bench/results/fp8/``). Every path's shapes depend only on the input's shape, so all are CUDA-graph safe.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from multilora.kernels.backends import triton_module

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448.0
METHODS = ("scaled_mm", "weight_only", "dequant")
#: At most this many rows take the weight-only GEMM under method None on CUDA (bench/bench_fp8.py decides).
WEIGHT_ONLY_MAX_TOKENS = 16
_MIN_SCALE = 1e-12  # an all-zero row or token gets this scale (its values quantize to 0 exactly)


@dataclass(frozen=True)
class Fp8Weight:
    """A linear weight in fp8: ``qweight`` float8_e4m3fn [N, K] (row-major, as the bf16 weight it replaces) and
    ``scale`` float32 [N] (one per output channel); ``W ~= qweight.float() * scale[:, None]``."""

    qweight: torch.Tensor
    scale: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.qweight.shape

    @property
    def nbytes(self) -> int:
        return self.qweight.numel() * self.qweight.element_size() + self.scale.numel() * self.scale.element_size()

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[N, K] in ``dtype``: ``qweight * scale[:, None]`` computed in float32."""
        return (self.qweight.float() * self.scale[:, None]).to(dtype)


def fp8_supported(device: torch.device | str) -> tuple[bool, str]:
    """Whether this device runs the fp8 GEMMs, and why not: CUDA needs compute capability 8.9 (Ada) or newer
    (Hopper 9.0: fp8 tensor cores); the CPU runs ``torch._scaled_mm`` (slowly: correct, for tests)."""
    device = torch.device(device)
    if device.type == "cpu":
        return True, ""
    if device.type != "cuda":
        return False, f"fp8 weights are not implemented on {device.type} devices"
    cap = torch.cuda.get_device_capability(device)
    if cap < (8, 9):
        name = torch.cuda.get_device_name(device)
        return False, (f"{name} (compute capability {cap[0]}.{cap[1]}) has no fp8 tensor cores; fp8 needs 8.9 "
                       f"(Ada) or newer (Hopper 9.0)")
    return True, ""


def quantize_weight(w: torch.Tensor) -> Fp8Weight:
    """Per-output-channel fp8 quantization of a linear weight w [N, K] (any float dtype; see the module
    docstring for the formula). Computed in float32 on w's device.

    Raises:
        ValueError: w is not a 2-D floating tensor.
    """
    if w.dim() != 2 or not w.is_floating_point():
        raise ValueError(f"quantize_weight: w must be a 2-D float tensor [N, K], got {tuple(w.shape)} {w.dtype}")
    wf = w.float()
    scale = (wf.abs().amax(dim=1) / FP8_MAX).clamp_min(_MIN_SCALE)  # [N]
    q = (wf / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return Fp8Weight(q.contiguous(), scale.contiguous())


#: Rows an fp8 activation buffer of 1 to ``FP8_X_ROWS - 1`` rows is allocated with (``empty_fp8_rows``).
FP8_X_ROWS = 64


def empty_fp8_rows(rows: int, k: int, device: torch.device | str) -> torch.Tensor:
    """An uninitialised float8_e4m3fn ``[rows, k]`` tensor for per-token quantized activations. For 1 to
    ``FP8_X_ROWS - 1`` rows it is the leading rows of a ``[FP8_X_ROWS, k]`` allocation, so a TMA tile of
    ``FP8_X_ROWS`` rows can read x from real memory (``triton_fp8._w8_gemv_tma_kernel``). A tile that runs past a
    tensor's edge gets zeros from the TMA unit instead, and that measured slower: on an H200, a layer's four GEMMs
    took 80.6 us at 64 rows, 84.4 us at 48 and 98.8 us at 40 (``bench/results/session25/``). The rows past
    ``rows`` are never written; a matrix product's row m depends on x's row m alone, and those rows are never
    stored."""
    alloc = FP8_X_ROWS if 0 < rows < FP8_X_ROWS else rows
    return torch.empty(alloc, k, dtype=FP8_DTYPE, device=device)[:rows]


def quantize_per_token_torch(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token fp8 quantization of x [T, K]: ``(xq float8_e4m3fn [T, K], xs float32 [T, 1])`` with
    ``x ~= xq.float() * xs`` (module docstring)."""
    xf = x.float()
    xs = (xf.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp_min(_MIN_SCALE)
    return (xf / xs).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), xs


def _check(x: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None) -> None:
    if x.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"fp8_linear: x must be [T, {w.shape[1]}] for a weight of shape {tuple(w.shape)}, "
                         f"got {tuple(x.shape)}")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"fp8_linear: x must be float16, bfloat16 or float32, got {x.dtype}")
    if bias is not None and tuple(bias.shape) != (w.shape[0],):
        raise ValueError(f"fp8_linear: bias must be [{w.shape[0]}], got {tuple(bias.shape)}")


def resolve_method(method: str | None, x: torch.Tensor, n: int | None = None) -> str:
    """The GEMM that ``fp8_linear(x, w, method=method)`` runs for a weight of ``n`` output channels (module docstring).

    Raises:
        ValueError: an unknown method, or "weight_only" where the Triton kernel is not available (no CUDA tensor,
            or Triton does not import).
    """
    return resolve_method_for(method, x.shape[0], x.shape[1], n, x.device)


def resolve_method_for(method: str | None, rows: int, k: int, n: int | None, device: torch.device) -> str:
    """``resolve_method`` from the shapes alone: an input of ``rows`` x ``k`` on ``device`` (what the op that
    produces that input asks, to write its fp8 copy beside it: ``wants_fp8_input``). Same result and errors."""
    if method not in (None, *METHODS):
        raise ValueError(f"fp8_linear: method must be one of {list(METHODS)} or None, got {method!r}")
    is_cuda = device.type == "cuda"
    interpret = os.environ.get("TRITON_INTERPRET") == "1"  # the CPU tests run the kernel in Triton's interpreter
    triton_ok = (is_cuda or interpret) and triton_module("triton_fp8") is not None
    if method is None:
        # cuBLASLt's fp8 GEMM needs K and N multiples of 16 (every real model's are; tiny test models' may not be)
        aligned = k % 16 == 0 and (n is None or n % 16 == 0)
        # a GPU's tuned limit holds where it was measured: shapes whose fp8-activation tiles are in its table
        kern = triton_module("triton_fp8") if is_cuda and triton_ok else None
        tuned = kern is not None and n is not None and kern.gemv_config(device, n, k, rows, scaled=True)
        limit = kern.weight_only_max_tokens(device) if tuned else None
        small = rows <= (WEIGHT_ONLY_MAX_TOKENS if limit is None else limit) or not aligned
        return "weight_only" if is_cuda and triton_ok and small else "scaled_mm"
    if method == "weight_only" and not triton_ok:
        raise ValueError(f"fp8_linear: method='weight_only' needs Triton and a CUDA tensor, got a {device.type} "
                         f"tensor{'' if triton_module('triton_fp8') is not None else ' and no Triton'}")
    return method


def wants_fp8_input(method: str | None, rows: int, w: "Fp8Weight", device: torch.device) -> bool:
    """Whether ``fp8_linear(x, w, method=method)`` of an x [rows, w.shape[1]] on ``device`` quantizes x per token
    (the "scaled_mm" semantics), so that the op producing x can write that fp8 copy too (``fp8_linear``'s ``x_fp8``:
    RMSNorm and SiLU * up do, in the same kernel, ``multilora.kernels.fused``), saving the quantization's launch."""
    return resolve_method_for(method, rows, w.shape[1], w.shape[0], device) == "scaled_mm"


def fp8_linear(x: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None = None, *,
               method: str | None = None, x_fp8: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """``y = x @ (w.qweight * w.scale[:, None])^T (+ bias)``: x [T, K] float16/bfloat16/float32, bias None or [N]
    in x's dtype; returns a new [T, N] tensor in x's dtype. ``method``: see the module docstring.

    ``x_fp8``: x already quantized per token, ``(xq float8_e4m3fn [T, K], xs float32 [T, 1])`` exactly as
    ``quantize_per_token_torch(x)`` gives it (the fused ops' ``quant=True`` output); the "scaled_mm" path then
    uses it instead of quantizing x again (the same product, one launch fewer); the other paths ignore it.

    Raises:
        ValueError: shapes or dtypes that disagree (named), or an unknown / unavailable method.
    """
    _check(x, w, bias)
    if x_fp8 is not None:
        xq, xs = x_fp8
        if xq.dtype != FP8_DTYPE or xq.shape != x.shape or xs.dtype != torch.float32 or \
                tuple(xs.shape) != (x.shape[0], 1):
            raise ValueError(f"fp8_linear: x_fp8 must be (float8_e4m3fn {tuple(x.shape)}, float32 "
                             f"[{x.shape[0]}, 1]), got ({xq.dtype} {tuple(xq.shape)}, {xs.dtype} {tuple(xs.shape)})")
    how = resolve_method(method, x, w.shape[0])
    if how == "dequant":
        y = x.float() @ w.dequantize().t()
        if bias is not None:
            y += bias.float()
        return y.to(x.dtype)
    if how == "weight_only":
        return triton_module("triton_fp8").fp8_weight_only_linear(x, w.qweight, w.scale, bias)
    k = triton_module("triton_fp8") if x.is_cuda else None
    cfg = k.gemv_config(x.device, w.shape[0], x.shape[1], x.shape[0], scaled=True) if k is not None else None
    if cfg is not None and x.dtype in (torch.float16, torch.bfloat16):
        # the same product on our split-K kernel, where this GPU's sweep measured it faster than cuBLASLt
        if x_fp8 is not None:
            return k.fp8_gemv2(x_fp8[0], w.qweight, w.scale, bias, fp8_x=True, x_scale=x_fp8[1], out_dtype=x.dtype,
                               **cfg)
        return k.fp8_gemv2(x, w.qweight, w.scale, bias, fp8_x=True, **cfg)
    if x_fp8 is not None:
        xq, xs = x_fp8
    else:
        xq, xs = k.quantize_per_token(x) if k is not None else quantize_per_token_torch(x)
    # cuBLASLt's row-wise-scaled fp8 GEMM: mat2 column-major ([K, N] view of the row-major [N, K] weight).
    # A bias goes in the epilogue where the output dtype is bf16 (its only supported case), else after.
    fused_bias = bias is not None and x.dtype == torch.bfloat16
    y = torch._scaled_mm(xq, w.qweight.t(), scale_a=xs, scale_b=w.scale.view(1, -1),
                         bias=bias if fused_bias else None, out_dtype=x.dtype)
    if bias is not None and not fused_bias:
        y += bias
    return y
