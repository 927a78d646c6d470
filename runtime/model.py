"""The decoder written for this runtime, one for every served family (Llama 2/3, Mistral, SmolLM2, Qwen2/2.5,
Qwen3 dense, Phi-3, Gemma 2; ``multilora.config`` lists them and the flags that tell them apart).

GQA attention with RoPE (the config's theta, optional llama3/linear/longrope scaling), RMSNorm, SwiGLU MLP,
tied or untied embeddings. The family differences are config flags read here, never a second decoder:
biases on the base projections (``qkv_bias``, ``o_bias``: added by the GEMM itself, ``torch.addmm``; LoRA
has none), per-head q/k RMSNorm before RoPE (``qk_norm``: fused into the RoPE + cache-write op), and a
sliding window per layer (``ModelConfig.window``), Phi-3's fused checkpoint tensors (``fused_projections``: taken
as they are), and Gemma 2's pieces: ``1 + weight`` RMSNorms in float32 (``norm_unit_offset``: a flag of the norm
kernels), embeddings times sqrt(hidden) (``scale_embeddings``), the norms of the attention and MLP outputs
before each residual add (``block_output_norms``: fused into the add + norm kernel), GeGLU (``hidden_act``), the
attention scale from ``query_pre_attn_scalar``, attention soft-capping (a constexpr branch of the attention
kernel) and final-logit soft-capping (three in-place ops on the float32 logits). q/k/v and gate/up are fused
GEMMs; LoRA is added to
every projection through ``multilora.kernels.lora_apply`` and attention runs over the paged KV cache through
``multilora.kernels.attention``, both with the step's plan, passed explicitly (``runner.StepPlan``, built by
the runner only). RMSNorm (fused
with the residual add), RoPE with the KV-cache write, and SiLU * up (GELU_tanh * up) come from
``multilora.kernels.fused``: one Triton kernel each on CUDA, torch ops on the CPU.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from multilora.config import ModelConfig
from multilora.kernels.attention import paged_attention
from multilora.kernels.fp8 import Fp8Weight, fp8_linear, quantize_weight, wants_fp8_input
from multilora.kernels.fused import GATED_ACTS, add_rms_norm, rms_norm, rope_write_kv
from multilora.kernels.lora import LoRASlices, lora_apply, lora_delta, lora_slices
from multilora.memory.kv_cache import PagedKVCache
from multilora.memory.pool import AdapterPool

if TYPE_CHECKING:  # pragma: no cover
    from multilora.runtime.runner import StepPlan

#: The fused projections of a layer and the target modules whose LoRA slices each one carries, in column order.
FUSED_MODULES: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}

#: The largest step (tokens) whose LoRA runs on a side stream beside the base GEMMs, its output added by the op after
#: each projection (``DecoderModel.lora_side_max_tokens``). One Llama-3-8B layer, seven projections, rank 16, CUDA
#: graph, H200 (``bench/bench_lora_overlap.py``, bench/results/lora_side_stream/): LoRA adds 37.4 -> 8.9 us at 1
#: token, 50.7 -> 38.4 at 8, 84.7 -> 73.7 at 64 distinct adapters, but 197 -> 223 us at 256, where the LoRA kernels
#: and the GEMM compete for the same bandwidth. The whole engine (``bench/bench_generate.py``, rank-16 adapters on all seven
#: projections, TPOT in place -> side stream, base model in brackets; bench/results/lora_side_stream/): batch 1 6.22 ->
#: 5.20 ms (5.00), batch 8 6.98 -> 6.67 (5.30), batch 64 on 64 adapters 11.17 -> 10.78 (7.46).
#: That holds for a pool of rank <= ``LORA_SIDE_NARROW_RANK``; from a pool of larger
#: rank (the kernels' tiles and work grow with it) only steps of at most ``LORA_SIDE_WIDE_MAX_TOKENS`` tokens take the
#: side stream: rank-64 adapters, same bench, 1 token 70.5 -> 39.8 us, but 8 tokens 85 -> 106 and 64 tokens 237 -> 254
#: (rank-16 adapters in a rank-64 pool: 1 token 32.3 -> 0 us, 8 tokens 39.4 -> 23.9, 64 tokens 91.0 -> 80.7).
LORA_SIDE_MAX_TOKENS = 64
LORA_SIDE_NARROW_RANK, LORA_SIDE_WIDE_MAX_TOKENS = 16, 2
#: The side stream's CUDA priority (``DecoderModel.lora_side_priority``): 0, the default. The highest priority was
#: measured and changed nothing (H200, one Llama-3-8B layer, LoRA adds 78.0 vs 77.2 us at 64 tokens, 5.9 vs 5.3 at 1;
#: bench/README.md, session 15): the GEMM's CTAs hold every SM, and priority only orders the CTAs still waiting.
LORA_SIDE_PRIORITY = 0
#: SMs the base GEMMs leave free for the side stream's LoRA kernels (``DecoderModel.lora_side_sm_carveout``) in steps
#: of at least ``LORA_SIDE_CARVEOUT_MIN_TOKENS`` tokens whose LoRA takes the side stream: those GEMMs go through
#: cuBLASLt with its SM-count target lowered by that many (``gemm_sm_carveout``). 0: off, the GEMMs as before.
#: H200, Llama-3-8B, rank 16 on all seven projections (bench/results/session17/): batch 64 on 64 adapters TPOT 10.78
#: -> 10.38 ms with 32 (base 7.80: 1.38x -> 1.33x), batch 1 unchanged (4.99 ms, its steps are below the minimum);
#: one layer at 64 tokens, LoRA adds 60.2 -> 55.4 us (16: 52.6), base layer 128.3 -> 121.6 us.
LORA_SIDE_SM_CARVEOUT, LORA_SIDE_CARVEOUT_MIN_TOKENS = 32, 17
#: Steps of at least this many tokens write the side stream's LoRA term into its buffer through ``lora_delta`` (the
#: expand writes every element: rows without an adapter get zeros from it) instead of a zeroing launch and
#: ``lora_apply``'s read-add of the zeros; the same bits. H200, Llama-3-8B, rank 16 on all seven projections, each
#: token its own adapter (bench/results/session27/): the engine's median decode step, zeroed -> written (calls 1, 2,
#: 4, 5): batch 1 4.68 -> 4.72 and 4.59 -> 4.66 ms, batch 4 5.12 -> 5.20, batch 8 5.54 -> 5.44, batch 16 5.96 -> 5.84,
#: batch 64 7.96 -> 7.67 and 7.87 -> 7.52 ms; hence the minimum of 8 (a graph bucket). One layer alone
#: (``bench_lora_overlap.py`` side_all -> side_write, call 3), LoRA added, us: 1 token 3.7 -> 4.3, 2 2.9 -> 2.3,
#: 4 11.0 -> 6.8, 8 20.7 -> 12.3, 16 28.4 -> 17.4, 32 45.1 -> 31.0, 64 66.9 -> 49.4: from 2 tokens faster there, so
#: what costs at 2-4 tokens in the engine is not the kernels alone (not profiled). ``1 << 30``: never (what ran
#: before session 27; the ``bench_generate.py`` provider ``multilora-lora-zeroed``).
LORA_DELTA_OVERWRITE_MIN_TOKENS = 8
#: fp8 weights whose GEMM quantizes its activations per token (``fp8.fp8_linear``'s "scaled_mm" semantics: from 2
#: rows on the H200's tuned table) take them from the op before: the RMSNorms before q/k/v and gate/up and the
#: SiLU * up before down write the fp8 copy beside their output in the same kernel (``quant=True``), instead of a
#: quantization launch per GEMM (three of the layer's four; o's input comes from attention and is quantized as
#: before). The fp8 copy is exactly the per-token quantization of the op's output; that output can differ in the
#: last place from the kernel variant without the copy (its sums of squares compiled in another order: 30 of 4.2M
#: bf16 values, one row, at 1,024 tokens on the H200, ``bench/results/session23/``). One pair (H200, ``python
#: bench/bench_fused_quant.py``, us per op + its quantization): RMSNorm 2.9 -> 2.2 at 64 tokens, 46.6 -> 39.8 at
#: 4,096; SiLU * up, whose fused form runs one program per row, 4.3 -> 4.0 at 64 and 127 -> 115 at 4,096 but 3.2 ->
#: 3.8 at 16, hence ``FUSE_FP8_QUANT_GLU_MIN_TOKENS``. False only for A/Bs (``bench_generate.py`` provider
#: ``multilora-fp8-sepquant``).
FUSE_FP8_QUANT = True
FUSE_FP8_QUANT_GLU_MIN_TOKENS = 64
#: Steps of at least this many tokens whose LoRA runs in place (not on the side stream) write the LoRA term first,
#: into the projection's output (``lora_delta``: the expand writes every element, zeros in rows without an adapter),
#: and the base GEMM then adds ``x W^T`` to it in its epilogue (``y.addmm_(x, W^T)``, cuBLAS with beta = 1): the
#: expand no longer reads and rewrites ``y`` after the GEMM (at a 4,096-token prefill the expand moved
#: [T, d_out] bf16 twice, 2 x 238 MB for gate/up), and the GEMM, compute-bound there, reads ``y`` in its epilogue.
#: Profile before (H200, Llama-3-8B, rank 16 on all seven projections, 64 adapters; ``profile_decode.py --batch 64
#: --mixed-tokens 4096 --no-pdl --lora``, bench/results/session30/call2): LoRA adds 9.1 ms to a 55.7 ms mixed step,
#: 7.1 of it the in-place expands (128 launches, 55 us each). After (call 3, another host): expands 48.3 us each, the
#: GEMMs with the epilogue read 1% slower, the step's kernels 64.83 -> 64.57 ms; engine A/B in one run
#: (``bench_generate.py --providers multilora,multilora-lora,multilora-lora-addafter --rounds 5 --batches 64``): TTFT
#: 0.862 -> 0.856 s (base 0.777). The writing expand was then half its write bandwidth: session 30's prefill tiles
#: (``triton_sgmv.PREFILL_WRITE_BLOCK_N``) are for it. bf16 / fp16 weights without a bias only (an fp8 GEMM has no
#: such epilogue; with a bias peft adds the LoRA term after it). Rounding: ``bf16(x W^T + bf16(lora))`` instead of
#: ``bf16(bf16(x W^T) + lora)``; ``test_engine_gpu.py``'s peft bounds hold (call 4). ``1 << 30``: never (what ran
#: before session 30; the ``bench_generate.py`` provider ``multilora-lora-addafter``).
LORA_BEFORE_GEMM_MIN_TOKENS = 256
#: Such steps (at least ``LORA_BEFORE_GEMM_MIN_TOKENS`` tokens, the LoRA term written before a bf16/fp16 GEMM without a
#: bias) of at least this many tokens take the base GEMM with the LoRA expand in its epilogue instead
#: (``kernels.experimental.gemm_lora``: the shrink, then one Triton GEMM adding each row's term to its accumulator;
#: the term is neither written nor read back), where the Triton LoRA backend runs and every slice's width is a
#: multiple of its column tile (``gemm_lora.fits``). ``1 << 30``: never, the default until measured on the H200
#: (``bench/bench_gemm_lora.py`` for the layer, ``bench_generate.py`` provider ``multilora-lora-gemmfused`` for TTFT;
#: written in session 34 without a GPU). Rounding: ``rnd(x W^T + term)``, one rounding instead of two.
LORA_GEMM_EPILOGUE_MIN_TOKENS = 1 << 30


#: Token counts ``(lo, hi)`` of the steps whose base GEMMs go through cuBLASLt instead of cuBLAS
#: (``DecoderModel.gemm_cublaslt_tokens``); None: cuBLAS for all (torch's default). One Llama-3-8B layer's seven
#: projections (H200, bench_lora_overlap, session 17): 118.6 vs 128.3 us at 64 tokens, 115.5 vs 122.3 at 32, equal at
#: 1 and 128, 120.1 vs 118.1 at 8.
GEMM_CUBLASLT_TOKENS: tuple[int, int] | None = None


#: ``LORA_GEMM_EPILOGUE_MIN_TOKENS``' other condition: at least this many tokens per distinct slot of the step
#: (``LoRAPlan.num_segments``, a bound for the piecewise graphs' static plans). The epilogue visits a row tile's
#: slots one at a time, so it is for prefill-shaped steps (a 4,096-token prefill on 64 adapters: 64 per slot), not a
#: large decode or mixed step whose row tiles hold up to 128 slots each.
LORA_GEMM_EPILOGUE_MIN_TOKENS_PER_SLOT = 32


#: Steps of at least this many tokens (and ``LORA_BEFORE_GEMM_MIN_TOKENS``: the down projection's LoRA term written
#: before its GEMM) compute the MLP's gated activation and the down projection's LoRA shrink in one kernel
#: (``kernels.triton_sgmv.glu_shrink``): the shrink takes h while it is in registers instead of reading it back (at a
#: 4,096-token Llama-3-8B prefill h is 117 MB a layer, ~28 us at copy bandwidth of the ~290 us the layer's LoRA adds).
#: Where the Triton LoRA backend runs, a step whose 64-token blocks hold at most ``GLU_SHRINK_MAX_BLOCK_RUNS`` runs of
#: one slot each (``LoRAPlan.max_block_runs``; the kernel visits a block's slots one after the other: a prefill of whole
#: prompts, not a mixed step's decode tokens), a bf16 / fp16 pool (fp32 tiles need more shared memory than GPUs
#: before Hopper have) of max rank <= ``GLU_SHRINK_MAX_RANK``, SiLU or GELU_tanh, no fp8 down GEMM and no bias on it.
#: h has the bits of the Triton GLU kernel (``kernels.fused`` on a GPU). ``1 << 30``: never, the default until measured on a GPU (written in session 43
#: without one; ``bench_generate.py`` provider ``multilora-lora-glushrink`` for TTFT). The same bits for h; the
#: shrink's partials sum in another order (within the kernels' reference bounds).
GLU_SHRINK_MIN_TOKENS = 1 << 30
#: ``GLU_SHRINK_MIN_TOKENS``' rank bound: a block holds one ``[block_m, next_pow2(max_rank)]`` fp32 accumulator.
GLU_SHRINK_MAX_RANK = 64
#: ``GLU_SHRINK_MIN_TOKENS``' bound on a step's ``LoRAPlan.max_block_runs``.
GLU_SHRINK_MAX_BLOCK_RUNS = 4


def _gemm_epilogue(x: torch.Tensor, slices: LoRASlices, plan: Any, lora_backend: str | None) -> bool:
    """Whether ``kernels.experimental.gemm_lora`` should take this projection: a bf16 / fp16 step of at least
    ``LORA_GEMM_EPILOGUE_MIN_TOKENS_PER_SLOT`` tokens per distinct slot (``plan``, the step's ``LoRAPlan``), the
    Triton LoRA backend running for ``x`` (CUDA, or ``lora_backend="triton"`` under the interpreter) and every slice a
    whole number of column tiles."""
    from multilora.kernels.backends import select_triton
    from multilora.kernels.experimental.gemm_lora import fits

    seg = plan.num_segments
    return (x.dtype in (torch.float16, torch.bfloat16) or x.device.type != "cuda") and seg is not None \
        and x.shape[0] >= LORA_GEMM_EPILOGUE_MIN_TOKENS_PER_SLOT * max(seg, 1) \
        and select_triton(lora_backend, x, "triton_sgmv") is not None and fits(slices, x.device)


@contextlib.contextmanager
def gemm_sm_carveout(sms: int, cublaslt: bool = False):
    """Within the block, torch's GEMMs on CUDA go through cuBLASLt (``cublaslt=True`` or ``sms > 0``: torch's
    ``preferred_blas_library("cublaslt")``) and leave ``sms`` SMs out of their grid (torch's private
    ``torch._C._set_sm_carveout_experimental``, which cuBLASLt's ``CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET`` honours;
    cuBLAS ignores it), so kernels on another stream find idle SMs. A CUDA graph captured inside keeps the GEMMs so
    chosen. Both settings are restored on exit. ``sms <= 0`` and not ``cublaslt``: no change."""
    if sms <= 0 and not cublaslt:
        yield
        return
    lib, carve = torch.backends.cuda.preferred_blas_library(), torch._C._get_sm_carveout_experimental()
    torch.backends.cuda.preferred_blas_library("cublaslt")
    if sms > 0:
        torch._C._set_sm_carveout_experimental(sms)
    try:
        yield
    finally:
        if sms > 0:
            torch._C._set_sm_carveout_experimental(carve)
        torch.backends.cuda.preferred_blas_library(lib)


# ----------------------------------------------------------------------------------------- RoPE
def rope_inv_freq(config: ModelConfig, rope_freqs: torch.Tensor | None = None, *, long: bool = False) -> torch.Tensor:
    """RoPE inverse frequencies ``theta^(-2i/d)`` [head_dim / 2], float32 (RoFormer, Su et al. 2021).

    ``rope_scaling`` "linear" divides by ``factor``; "llama3" applies Meta's Llama 3.1 frequency-dependent
    rescaling (long wavelengths / factor, short ones unchanged, a smooth ramp between); "longrope" (Phi-3;
    LongRoPE, Ding et al. 2024, as transformers' ``_compute_longrope_parameters``) divides elementwise by
    ``short_factor``, or by ``long_factor`` with ``long=True``; ``rope_freqs`` (GGUF llama 3.x) divides elementwise.
    """
    d = config.head_dim
    inv = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    sc = config.rope_scaling or {}
    kind = config.rope_type
    if kind == "linear":
        inv = inv / float(sc["factor"])
    elif kind == "llama3":
        factor = float(sc["factor"])
        lo, hi = float(sc.get("low_freq_factor", 1.0)), float(sc.get("high_freq_factor", 4.0))
        old = float(sc.get("original_max_position_embeddings", 8192))
        wavelen = 2 * math.pi / inv
        smooth = ((old / wavelen) - lo) / (hi - lo)
        scaled = torch.where(wavelen > old / lo, inv / factor, inv)
        mid = (wavelen <= old / lo) & (wavelen >= old / hi)
        scaled = torch.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)
        inv = scaled
    elif kind == "longrope":
        inv = inv / torch.tensor(sc["long_factor" if long else "short_factor"], dtype=torch.float64)
    if rope_freqs is not None:
        inv = inv / rope_freqs.double()
    return inv.float()


def rope_attention_factor(config: ModelConfig) -> float:
    """The factor cos and sin are multiplied by (1.0 but for "longrope"), as transformers'
    ``_compute_longrope_parameters``: ``attention_factor`` if the config gives it, else with
    ``factor = rope_scaling.factor or max_position_embeddings / original_max_position_embeddings``,
    ``sqrt(1 + ln(factor) / ln(original_max_position_embeddings))`` when ``factor > 1``, else 1.0. It scales
    q and k alike, so the attention logits by its square; the same factor is used with short and long factors."""
    if config.rope_type != "longrope":
        return 1.0
    sc = config.rope_scaling or {}
    if sc.get("attention_factor") is not None:
        return float(sc["attention_factor"])
    orig = int(sc["original_max_position_embeddings"])
    factor = float(sc.get("factor") or config.max_position_embeddings / orig)
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor,
                 scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [num_tokens, head_dim] (float32) for the rotate-half convention, each times ``scale``."""
    freqs = positions.float()[:, None] * inv_freq[None, :].to(positions.device)
    emb = torch.cat((freqs, freqs), dim=-1)
    if scale == 1.0:
        return emb.cos(), emb.sin()
    return emb.cos() * scale, emb.sin() * scale


# ------------------------------------------------------------------------------------------ model
@dataclass
class ForwardPass:
    """One forward's state between its pieces (``DecoderModel.start`` / ``resume``): the step's plan and cache, the
    residual stream ``h`` [T, hidden] (updated in place by every layer), the RoPE table rows [T], whether the LoRA of
    the column-parallel (``defer``) and row-parallel (``defer_row``) projections goes on the side stream, and the
    backends."""

    plan: Any
    kv: PagedKVCache
    h: torch.Tensor
    rope_rows: torch.Tensor
    defer: bool
    defer_row: bool
    lora_backend: str | None
    ops_backend: str | None


class DecoderModel:
    """Inference-only decoder over flattened varlen batches, with per-token LoRA.

    Per layer it holds (``layers[i]``): ``in_norm``, ``post_norm`` [hidden] (the norms before attention and
    before the MLP); ``qkv`` [q + 2 kv, hidden]; ``o`` [hidden, q]; ``gate_up`` [2 inter, hidden]; ``down``
    [hidden, inter]; and, as the config says, ``qkv_bias`` [q + 2 kv], ``o_bias`` [hidden], ``q_norm`` /
    ``k_norm`` [head_dim], ``attn_out_norm`` / ``mlp_out_norm`` [hidden] (Gemma 2's norms of the attention and
    MLP outputs; its ``post_norm`` is HF's ``pre_feedforward_layernorm``, and HF's ``post_attention_layernorm`` is
    ``attn_out_norm``).

    Args:
        config: the model's configuration.
        weights: HF-named weights (see ``runtime.weights``); consumed (fused copies are made).
        device, dtype: where and in which dtype the model runs.
        weight_dtype: None (the base projections in ``dtype``) or "fp8": the four fused projections of every layer
            (qkv, o, gate_up, down) stored as float8 e4m3 with per-output-channel scales
            (``multilora.kernels.fp8``), quantized here once; embeddings, norms, biases, the LoRA pool and the
            activations stay in ``dtype``, and the LM head too unless ``fp8_lm_head`` (by default an untied head is
            fp8).
        fp8_method: the fp8 GEMM (``multilora.kernels.fp8.fp8_linear``'s ``method``; None = by rows and device).
        fp8_lm_head: with ``weight_dtype="fp8"``, the LM head too (``self.lm_head`` an ``Fp8Weight``; tied
            embeddings keep the embedding table in ``dtype`` beside the fp8 copy). None (default): on when
            ``weight_dtype`` is "fp8" and the model's head is untied (as ``EngineConfig.fp8_lm_head``).
        tp_group: None, or a tensor-parallel rank's group (``runtime.parallel.TPGroup``): ``config`` and ``weights``
            are then that rank's shard, and the outputs of o and down (partial sums, LoRA included) are all-reduced.
        lora_side_max_tokens: ``self.lora_side_max_tokens`` (None: ``lora_side_limit``'s measured default).
    """

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], *, device: torch.device, dtype: torch.dtype,
                 weight_dtype: str | None = None, fp8_method: str | None = None, tp_group: Any = None,
                 lora_side_max_tokens: int | None = None, fp8_lm_head: bool | None = None):
        if weight_dtype not in (None, "fp8"):
            raise ValueError(f"DecoderModel: weight_dtype must be None or 'fp8', got {weight_dtype!r}")
        if fp8_lm_head and weight_dtype != "fp8":
            raise ValueError(f"DecoderModel: fp8_lm_head needs weight_dtype='fp8', got weight_dtype={weight_dtype!r}")
        self.config = config
        self.device = device
        self.dtype = dtype
        self.weight_dtype = weight_dtype
        self.fp8_method = fp8_method
        self.tp_group = tp_group
        self.skip_logits = False  # a tensor-parallel worker: rank 0 alone computes logits

        def w(name: str) -> torch.Tensor:
            if name not in weights:
                raise ValueError(f"model weights: missing tensor {name!r}")
            return weights[name]

        def put(t: torch.Tensor) -> torch.Tensor:
            return t.to(device=device, dtype=dtype).contiguous()

        self.embed = put(w("model.embed_tokens.weight"))  # [vocab, hidden]
        if self.embed.shape != (config.vocab_size, config.hidden_size):
            raise ValueError(
                f"model weights: embed_tokens shape {tuple(self.embed.shape)} does not match config "
                f"(vocab {config.vocab_size}, hidden {config.hidden_size})"
            )
        self.lm_head = self.embed if config.tie_word_embeddings or "lm_head.weight" not in weights else put(weights["lm_head.weight"])
        if fp8_lm_head is None:  # (the default: where it replaces a head of the model's own)
            fp8_lm_head = weight_dtype == "fp8" and self.lm_head is not self.embed
        if fp8_lm_head:  # [vocab, hidden] fp8 + scales; an untied model-dtype head is freed here
            self.lm_head = quantize_weight(self.lm_head)
        self.norm = put(w("model.norm.weight"))
        self.layers = []
        for i in range(config.num_layers):
            p = f"model.layers.{i}."
            if config.fused_projections:  # Phi-3: the checkpoint holds them fused, in our row order
                qkv, gate_up = w(p + "self_attn.qkv_proj.weight"), w(p + "mlp.gate_up_proj.weight")
            else:
                qkv = torch.cat([w(p + f"self_attn.{m}.weight") for m in ("q_proj", "k_proj", "v_proj")])
                gate_up = torch.cat([w(p + "mlp.gate_proj.weight"), w(p + "mlp.up_proj.weight")])
            layer = {
                "in_norm": put(w(p + "input_layernorm.weight")),
                "post_norm": put(w(p + ("pre_feedforward_layernorm.weight" if config.block_output_norms
                                        else "post_attention_layernorm.weight"))),
                "qkv": put(qkv),  # [q + 2 kv, hidden]
                "o": put(w(p + "self_attn.o_proj.weight")),  # [hidden, q]
                "gate_up": put(gate_up),  # [2 * inter, hidden]
                "down": put(w(p + "mlp.down_proj.weight")),  # [hidden, inter]
            }
            if config.qkv_bias:
                qkv_b = [w(p + f"self_attn.{m}.bias") for m in ("q_proj", "k_proj", "v_proj")]
                layer["qkv_bias"] = put(torch.cat(qkv_b))  # [q + 2 kv]
            if config.o_bias:
                layer["o_bias"] = put(w(p + "self_attn.o_proj.bias"))  # [hidden]
            if config.qk_norm:
                layer["q_norm"] = put(w(p + "self_attn.q_norm.weight"))  # [head_dim]
                layer["k_norm"] = put(w(p + "self_attn.k_norm.weight"))
            if config.block_output_norms:  # Gemma 2
                layer["attn_out_norm"] = put(w(p + "post_attention_layernorm.weight"))  # [hidden]
                layer["mlp_out_norm"] = put(w(p + "post_feedforward_layernorm.weight"))
            self._check_layer(i, layer)
            if weight_dtype == "fp8":
                for name in FUSED_MODULES:
                    layer[name] = quantize_weight(layer[name])  # the model-dtype copy is freed here
            self.layers.append(layer)
        #: Gemma 2: sqrt(hidden) rounded to the model dtype, as HF's ``embed_scale.to(weight.dtype)`` (1.0: none)
        self.embed_scale = float(torch.tensor(config.hidden_size ** 0.5).to(dtype)) if config.scale_embeddings else 1.0
        self._act = GATED_ACTS[config.hidden_act]
        self.inv_freq = rope_inv_freq(config, weights.get("rope_freqs")).to(device)
        longrope = config.rope_type == "longrope"
        self.long_inv_freq = rope_inv_freq(config, long=True).to(device) if longrope else None
        self.rope_scale = rope_attention_factor(config)
        #: longrope: a sequence whose length after the step exceeds this takes the long factors (0: never)
        self.rope_long_after = int(config.rope_scaling["original_max_position_embeddings"]) if longrope else 0
        self.rope_long_offset = 0  # longrope: the row of the long table of position 0 (= positions per table)
        self.rope_cos = self.rope_sin = torch.empty(0, config.head_dim, dtype=torch.float32, device=device)
        self.ensure_rope_positions(256)
        self._lora: list[dict[str, LoRASlices]] | None = None
        #: steps of at most this many tokens compute each projection's LoRA into its own buffer, on a side CUDA
        #: stream concurrent with the base GEMM, and the op after the projection adds it (0: LoRA in place, after
        #: the GEMM; None: ``lora_side_limit``'s measured default). Off the GPU the deferred path runs on the one
        #: stream (tests set it to exercise the adds).
        self.lora_side_max_tokens = lora_side_max_tokens
        #: CUDA priority of that side stream (lower is higher; ``torch.cuda.Stream.priority_range()``, 0 the default).
        #: Kernels captured from it keep it in a CUDA graph (torch instantiates graphs with node priorities), so a
        #: higher priority lets the block scheduler start the LoRA programs before the GEMM's pending ones.
        #: Captured graphs bake it in: change it before capture (``ModelRunner.reset_graphs``, ``engine.runner``).
        self.lora_side_priority = LORA_SIDE_PRIORITY
        #: SMs the base GEMM leaves to the side stream's LoRA in steps of at least ``LORA_SIDE_CARVEOUT_MIN_TOKENS``
        #: tokens (``gemm_sm_carveout``; 0: off). Captured graphs bake it in, as ``lora_side_priority``.
        self.lora_side_sm_carveout = LORA_SIDE_SM_CARVEOUT
        #: ``(lo, hi)``: steps of lo..hi tokens run their base GEMMs through cuBLASLt (``GEMM_CUBLASLT_TOKENS``); None:
        #: cuBLAS. Captured graphs bake it in, as ``lora_side_priority``.
        self.gemm_cublaslt_tokens = GEMM_CUBLASLT_TOKENS
        self._side: torch.cuda.Stream | None = None
        self._side_priority = 0  # the lora_side_priority that _side was made with
        self._pool_max_rank = 0

    def ensure_rope_positions(self, n: int) -> None:
        """Grow the RoPE tables ``rope_cos``/``rope_sin`` (float32 [n_positions, head_dim], on the model's
        device) to cover positions ``0 .. n - 1``, doubling; they never shrink. A caller that captures
        CUDA graphs grows them first (the engine does, to ``max_seq_len``), so their address stays put.

        With "longrope" each table is two stacked: rows ``[0, n)`` from the short factors, rows ``[n, 2n)`` from
        the long ones (``rope_long_offset = n``), both times ``rope_scale``; ``_rope_rows`` picks the row."""
        have = self.rope_cos.shape[0] // (2 if self.long_inv_freq is not None else 1)
        if n <= have:
            return
        size = max(have, 1)
        while size < n:
            size *= 2
        pos = torch.arange(size, device=self.device)
        cos, sin = rope_cos_sin(self.inv_freq, pos, self.rope_scale)
        if self.long_inv_freq is not None:
            lcos, lsin = rope_cos_sin(self.long_inv_freq, pos, self.rope_scale)
            cos, sin = torch.cat([cos, lcos]), torch.cat([sin, lsin])
            self.rope_long_offset = size
        self.rope_cos, self.rope_sin = cos, sin

    def _rope_rows(self, plan: "StepPlan") -> torch.Tensor:
        """The RoPE table row of each token [T] int64: its position, or with "longrope" its position plus
        ``rope_long_offset`` when its sequence is longer than ``original_max_position_embeddings`` after this step.

        That is transformers' rule (``dynamic_rope_update`` -> ``longrope_frequency_update``: one choice per
        forward by ``max(position_ids) + 1``) applied to each sequence of the batch. transformers' Phi-3 also drops
        its KV cache and runs the whole sequence again at the step that takes it past the original length
        (``Phi3ForCausalLM.prepare_inputs_for_generation``); the engine's scheduler does the same
        (``Scheduler(recompute_after=rope_long_after)``), so the cached keys of a sequence always carry the
        factors of its current length and one sequence's generation equals HF's. Decode steps (one token per
        sequence, the last of its sequence) compute it from ``positions`` alone, so a CUDA graph replays it from
        its positions buffer."""
        pos = plan.positions
        if not self.rope_long_offset:
            return pos
        if plan.attn.max_query_len == 1:
            seq_len = pos + 1  # [T]
        else:
            q_lens = torch.tensor(plan.q_lens, device=pos.device)
            seq_len = torch.repeat_interleave(plan.attn.seq_lens.to(torch.int64), q_lens, output_size=pos.shape[0])
        return pos + self.rope_long_offset * (seq_len > self.rope_long_after)

    def _check_layer(self, i: int, layer: dict[str, torch.Tensor]) -> None:
        c = self.config
        want = {
            "qkv": (c.q_size + 2 * c.kv_size, c.hidden_size),
            "o": (c.hidden_size, c.q_size),
            "gate_up": (2 * c.intermediate_size, c.hidden_size),
            "down": (c.hidden_size, c.intermediate_size),
            "qkv_bias": (c.q_size + 2 * c.kv_size,),
            "o_bias": (c.hidden_size,),
            "q_norm": (c.head_dim,),
            "k_norm": (c.head_dim,),
            "attn_out_norm": (c.hidden_size,),
            "mlp_out_norm": (c.hidden_size,),
        }
        for k, shape in want.items():
            if k in layer and tuple(layer[k].shape) != shape:
                raise ValueError(f"model weights: layer {i} {k} has shape {tuple(layer[k].shape)}, expected {shape}")

    @property
    def nbytes(self) -> int:
        """Bytes of the base weights as stored (fp8 projections at 1 byte per weight plus their float32 scales)."""
        total = self.embed.numel() + self.norm.numel()
        if isinstance(self.lm_head, torch.Tensor) and self.lm_head is not self.embed:
            total += self.lm_head.numel()
        total += sum(t.numel() for layer in self.layers for t in layer.values() if isinstance(t, torch.Tensor))
        fp8 = sum(t.nbytes for layer in self.layers for t in layer.values() if isinstance(t, Fp8Weight))
        if isinstance(self.lm_head, Fp8Weight):
            fp8 += self.lm_head.nbytes
        return total * self.embed.element_size() + fp8

    def bind_pool(self, pool: AdapterPool) -> None:
        """Describe where each fused projection's LoRA slices live in the pool (``FUSED_MODULES``; one small device
        table per layer and projection, built once: they never change)."""
        self._lora = [{name: lora_slices([pool.module_view(i, m) for m in modules])
                       for name, modules in FUSED_MODULES.items()} for i in range(self.config.num_layers)]
        self._pool_max_rank = pool.max_rank

    # ------------------------------------------------------------------------------ forward
    def lora_side_limit(self) -> int:
        """The largest step (tokens) whose LoRA goes on the side stream: ``lora_side_max_tokens`` when set, else on
        CUDA ``LORA_SIDE_MAX_TOKENS`` for a pool of rank <= ``LORA_SIDE_NARROW_RANK`` and
        ``LORA_SIDE_WIDE_MAX_TOKENS`` for larger ranks (the measurements at ``LORA_SIDE_MAX_TOKENS``); 0 elsewhere."""
        if self.lora_side_max_tokens is not None:
            return self.lora_side_max_tokens
        if self.device.type != "cuda":
            return 0
        return LORA_SIDE_MAX_TOKENS if self._pool_max_rank <= LORA_SIDE_NARROW_RANK else LORA_SIDE_WIDE_MAX_TOKENS

    def _fp8_in(self, layer: int, name: str, rows: int, device: torch.device) -> bool:
        """Whether the op producing projection ``name``'s input (``rows`` tokens on ``device``) should also write its
        per-token fp8 copy (``quant=True`` of the fused ops): the weight is fp8 and its GEMM quantizes activations at
        that many rows (``fp8.wants_fp8_input``), and ``FUSE_FP8_QUANT`` is on."""
        w = self.layers[layer][name]
        return FUSE_FP8_QUANT and isinstance(w, Fp8Weight) and wants_fp8_input(self.fp8_method, rows, w, device)

    def _glu_shrink(self, gu: torch.Tensor, layer: int, plan: "StepPlan", lora_backend: str | None, *,
                    defer: bool, quant: bool) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(h, v)`` from ``kernels.triton_sgmv.glu_shrink`` where a step takes it (``GLU_SHRINK_MIN_TOKENS``): the
        gated activation of ``gu`` [T, 2 I] and the down projection's LoRA shrink, for ``_linear(..., v=v)``; else
        None (the activation and the shrink run apart)."""
        T = gu.shape[0]
        if (T < max(GLU_SHRINK_MIN_TOKENS, LORA_BEFORE_GEMM_MIN_TOKENS) or defer or quant or not plan.lora.has_lora
                or self._lora is None or self.config.hidden_act not in ("silu", "gelu_pytorch_tanh")):
            return None
        w = self.layers[layer]["down"]
        slices = self._lora[layer]["down"]
        runs = plan.lora.max_block_runs
        if (isinstance(w, Fp8Weight) or self.layers[layer].get("down_bias") is not None
                or slices.max_rank_rows > GLU_SHRINK_MAX_RANK or gu.dtype != slices.buffer.dtype
                or runs is None or runs > GLU_SHRINK_MAX_BLOCK_RUNS
                or (gu.device.type == "cuda" and gu.dtype == torch.float32)
                or (T >= LORA_GEMM_EPILOGUE_MIN_TOKENS and _gemm_epilogue(gu, slices, plan.lora, lora_backend))):
            return None
        from multilora.kernels.backends import select_triton

        mod = select_triton(lora_backend, gu, "triton_sgmv")
        if mod is None:
            return None
        return mod.glu_shrink(gu, slices, plan.lora, gelu_tanh=self.config.hidden_act == "gelu_pytorch_tanh")

    def _linear(self, x: torch.Tensor, layer: int, name: str, plan: "StepPlan", lora_backend: str | None, *,
                defer: bool = False, x_fp8: tuple[torch.Tensor, torch.Tensor] | None = None,
                v: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``x W^T (+ b)`` of a fused projection and its LoRA; returns ``(y, lora_delta)``.

        The bias is the GEMM's own epilogue (addmm: one launch, graph-safe), added before the LoRA delta as peft
        does (``base_layer(x) + lora``); fp8 weights go through ``fp8_linear`` (its bias in the GEMM's epilogue
        where it can be). Without ``defer`` the LoRA is added to ``y`` in place after the GEMM and ``lora_delta``
        is None (from ``LORA_BEFORE_GEMM_MIN_TOKENS`` tokens, without a bias and fp8, the LoRA term is written into
        ``y`` first and the GEMM adds ``x W^T`` to it; from ``LORA_GEMM_EPILOGUE_MIN_TOKENS``, off by default, one Triton
        GEMM adds the term in its epilogue instead). With ``defer`` (and LoRA in the step) it goes into
        ``lora_delta`` [T, d_out] instead (0 in rows without an adapter; written by ``kernels.lora_delta`` from
        ``LORA_DELTA_OVERWRITE_MIN_TOKENS`` tokens), computed on the side stream while the GEMM runs (on CUDA; the
        main stream waits for it before returning), for the following op to add: at decode the two small LoRA
        launches then cost no time of their own (``bench/bench_lora_overlap.py``). ``x_fp8``: x's per-token fp8
        copy for an fp8 GEMM (``fp8_linear``). ``v``: the LoRA shrink of ``x`` already made (``_glu_shrink``; the
        step then takes the term-first path), so only the expand runs here."""
        w, b = self.layers[layer][name], self.layers[layer].get(name + "_bias")
        slices = self._lora[layer][name] if plan.lora.has_lora and self._lora is not None else None
        delta = side = None
        if slices is not None and defer:
            delta = torch.empty(x.shape[0], slices.d_out, dtype=x.dtype, device=x.device)  # on the main stream
            if x.device.type == "cuda":
                if self._side is None or self._side_priority != self.lora_side_priority:
                    self._side = torch.cuda.Stream(x.device, priority=self.lora_side_priority)  # torch clamps it
                    self._side_priority = self.lora_side_priority
                side, main = self._side, torch.cuda.current_stream(x.device)
                side.wait_stream(main)  # x (and delta's block) are ready
            with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
                if x.shape[0] >= LORA_DELTA_OVERWRITE_MIN_TOKENS:
                    lora_delta(delta, x, slices, plan.lora, backend=lora_backend)
                else:
                    lora_apply(delta.zero_(), x, slices, plan.lora, backend=lora_backend)
        # in place, from LORA_BEFORE_GEMM_MIN_TOKENS: the LoRA term first, then the GEMM adds x W^T to it
        first = slices is not None and delta is None and b is None and not isinstance(w, Fp8Weight) \
            and x.shape[0] >= LORA_BEFORE_GEMM_MIN_TOKENS
        epilogue = first and x.shape[0] >= LORA_GEMM_EPILOGUE_MIN_TOKENS \
            and _gemm_epilogue(x, slices, plan.lora, lora_backend)
        # (a shrink made before, ``_glu_shrink``, chose this step by the same conditions)
        assert v is None or (first and not epilogue), "a shrink made before _linear is for the term-first path only"
        if epilogue:  # the GEMM adds the LoRA term in its epilogue: nothing written first
            from multilora.kernels.experimental.gemm_lora import gemm_lora

            return gemm_lora(x, w, slices, plan.lora), None
        if first:
            y = torch.empty(x.shape[0], w.shape[0], dtype=x.dtype, device=x.device)
            if v is not None:  # only the expand: writes every element of y, as lora_delta
                from multilora.kernels.triton_sgmv import sgmv_expand

                sgmv_expand(y, v, slices, plan.lora, overwrite=True)
            else:
                lora_delta(y, x, slices, plan.lora, backend=lora_backend)
        carve = self.lora_side_sm_carveout if side is not None and x.shape[0] >= LORA_SIDE_CARVEOUT_MIN_TOKENS else 0
        lt = self.gemm_cublaslt_tokens is not None and x.device.type == "cuda" \
            and self.gemm_cublaslt_tokens[0] <= x.shape[0] <= self.gemm_cublaslt_tokens[1]
        with gemm_sm_carveout(carve, lt):
            if isinstance(w, Fp8Weight):
                y = fp8_linear(x, w, b, method=self.fp8_method, x_fp8=x_fp8)
            elif first:
                y.addmm_(x, w.t())  # beta = 1: y = lora + x W^T, the GEMM's epilogue reading y
            else:
                y = x @ w.t() if b is None else torch.addmm(b, x, w.t())
        if side is not None:
            main.wait_stream(side)  # before anything reads delta or frees x
        elif slices is not None and delta is None and not first:
            lora_apply(y, x, slices, plan.lora, backend=lora_backend)
        return y, delta

    def forward(self, plan: "StepPlan", kv: PagedKVCache, *, lora_backend: str | None = None,
                attention_backend: str | None = None, ops_backend: str | None = None) -> torch.Tensor:
        """Run the decoder over the step's tokens; returns final hidden states [T, hidden] (normed).

        Keys and values of the step's tokens are written into ``kv`` at ``plan.attn.slot_mapping``.
        ``ops_backend`` picks the RMSNorm / (q/k norm +) RoPE + cache write / SiLU-mul (GELU-mul) ops
        (``multilora.kernels.fused``: "torch", "triton", None = triton on CUDA).

        It runs the pieces ``start``, then per layer ``attend`` and ``resume``: the runner's piecewise CUDA graphs
        capture ``start`` and ``resume`` and run ``attend`` eagerly between them (``runtime.cuda_graphs``).
        """
        st, q = self.start(plan, kv, lora_backend=lora_backend, ops_backend=ops_backend)
        for i in range(self.config.num_layers):
            q = self.resume(st, i, self.attend(i, q, plan.attn, kv, backend=attention_backend))
        return q

    def start(self, plan: "StepPlan", kv: PagedKVCache, *, lora_backend: str | None = None,
              ops_backend: str | None = None, residual: torch.Tensor | None = None) -> tuple["ForwardPass", torch.Tensor]:
        """The forward up to layer 0's attention: the embeddings (the residual stream), layer 0's norm, its q/k/v
        projection and LoRA, RoPE and the KV write. Returns (the pass's state for ``resume``, layer 0's queries
        [T, num_heads, head_dim]). ``residual``: a [T, hidden] buffer of the model dtype to hold the residual
        stream (a static buffer under CUDA graphs); default a new tensor."""
        c = self.config
        if residual is None:
            h = self.embed.index_select(0, plan.input_ids)  # [T, hidden]: the residual stream, updated in place
        else:
            h = torch.index_select(self.embed, 0, plan.input_ids, out=residual)
        if self.embed_scale != 1.0:
            h.mul_(self.embed_scale)  # Gemma 2: in the model dtype, as HF
        T = h.shape[0]
        defer = T <= self.lora_side_limit()
        st = ForwardPass(plan=plan, kv=kv, h=h, rope_rows=self._rope_rows(plan), defer=defer,
                         defer_row=defer and self.tp_group is None,  # row-parallel o / down: LoRA in place, inside
                         lora_backend=lora_backend, ops_backend=ops_backend)  # the all-reduce
        quant = self._fp8_in(0, "qkv", T, h.device)
        x = rms_norm(h, self.layers[0]["in_norm"], c.rms_norm_eps, unit_offset=c.norm_unit_offset, backend=ops_backend,
                     quant=quant)
        x, xq = x if quant else (x, None)
        return st, self._qkv_rope(st, 0, x, xq)

    def attend(self, i: int, q: torch.Tensor, meta: Any, kv: PagedKVCache, *, backend: str | None = None,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """Layer ``i``'s attention of queries ``q`` [T, num_heads, head_dim] over the paged cache (``meta``: the step's
        ``AttentionMetadata``); [T, num_heads, head_dim], written into ``out`` when given."""
        c = self.config
        k_cache, v_cache = kv.layer(i)  # [num_blocks, block_size, Hkv, D]
        return paged_attention(q, k_cache, v_cache, meta, scale=c.attn_scale, sliding_window=c.window(i),
                               softcap=c.attn_logit_softcapping or 0.0, backend=backend, out=out)

    def resume(self, st: "ForwardPass", i: int, attn: torch.Tensor) -> torch.Tensor:
        """The forward from layer ``i``'s attention output ``attn`` [T, num_heads, head_dim] to the next layer's
        attention: o and its LoRA, the residual add + norm, the MLP, the residual add + the next norm, then the next
        layer's q/k/v, RoPE and KV write. Returns the next layer's queries, or after the last layer the final
        normed hidden states [T, hidden]."""
        c, layer, plan = self.config, self.layers[i], st.plan
        eps, offset, ops, lb = c.rms_norm_eps, c.norm_unit_offset, st.ops_backend, st.lora_backend
        h = st.h
        T = h.shape[0]
        o, lo = self._linear(attn.reshape(T, c.q_size), i, "o", plan, lb, defer=st.defer_row)
        if self.tp_group is not None:
            self.tp_group.all_reduce(o)  # row-parallel: the ranks' partial sums (base + LoRA), before any norm
        # (an fp8 GEMM that quantizes its activations gets them from the op before it: quant=True, no launch of its own)
        quant = self._fp8_in(i, "gate_up", T, h.device)
        x = add_rms_norm(h, o, layer["post_norm"], eps, delta_weight=layer.get("attn_out_norm"),
                         unit_offset=offset, lora_delta=lo, backend=ops, quant=quant)
        x, xq = x if quant else (x, None)
        gu, lg = self._linear(x, i, "gate_up", plan, lb, defer=st.defer, x_fp8=xq)  # [T, 2 * inter]
        quant = T >= FUSE_FP8_QUANT_GLU_MIN_TOKENS and self._fp8_in(i, "down", T, h.device)
        fused = None if lg is not None else self._glu_shrink(gu, i, plan, lb, defer=st.defer_row, quant=quant)
        if fused is not None:  # the activation and the down projection's LoRA shrink, one kernel
            a, v = fused
            aq = None
        else:
            a = self._act(gu, lora_delta=lg, backend=ops, quant=quant)
            a, aq, v = *(a if quant else (a, None)), None
        d, ld = self._linear(a, i, "down", plan, lb, defer=st.defer_row, x_fp8=aq, v=v)
        if self.tp_group is not None:
            self.tp_group.all_reduce(d)
        last = i + 1 == len(self.layers)
        nxt = self.norm if last else self.layers[i + 1]["in_norm"]
        quant = not last and self._fp8_in(i + 1, "qkv", T, h.device)
        x = add_rms_norm(h, d, nxt, eps, delta_weight=layer.get("mlp_out_norm"), unit_offset=offset,
                         lora_delta=ld, backend=ops, quant=quant)
        x, xq = x if quant else (x, None)
        return x if last else self._qkv_rope(st, i + 1, x, xq)

    def _qkv_rope(self, st: "ForwardPass", i: int, x: torch.Tensor,
                  x_fp8: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Layer ``i``'s q/k/v projection of the normed ``x`` (and its fp8 copy ``x_fp8``) and its LoRA, then RoPE
        (and q/k norms) with the KV-cache write; the queries [T, num_heads, head_dim]."""
        c, layer = self.config, self.layers[i]
        qkv, lq = self._linear(x, i, "qkv", st.plan, st.lora_backend, defer=st.defer,
                               x_fp8=x_fp8)  # [T, q + 2 kv]
        k_cache, v_cache = st.kv.layer(i)
        return rope_write_kv(qkv, self.rope_cos, self.rope_sin, st.rope_rows, st.plan.attn.slot_mapping, k_cache,
                             v_cache, num_heads=c.num_heads, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
                             q_norm=layer.get("q_norm"), k_norm=layer.get("k_norm"), norm_eps=c.rms_norm_eps,
                             lora_delta=lq, backend=st.ops_backend)  # [T, H, D]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [n, hidden_size] -> float32 logits [n, vocab]; with ``final_logit_softcapping`` (Gemma 2)
        ``cap * tanh(logits / cap)``, in place on the float32 logits (HF caps the model-dtype logits: in float32 the
        same, in bf16 ours is the more exact). A tensor-parallel worker returns [n, 1] of nothing (rank 0 samples)."""
        if self.skip_logits:
            return hidden[:, :1].float()
        if isinstance(self.lm_head, Fp8Weight):  # fp8_lm_head
            logits = fp8_linear(hidden, self.lm_head, method=self.fp8_method).float()
        else:
            logits = (hidden @ self.lm_head.t()).float()
        cap = self.config.final_logit_softcapping
        if cap:
            logits.div_(cap).tanh_().mul_(cap)
        return logits


#: The name the decoder had while it served Llama-family configs only.
LlamaModel = DecoderModel
