"""A Llama-family decoder written for this runtime (Llama 2/3, Mistral, SmolLM2).

GQA attention with RoPE (the config's theta, optional llama3/linear scaling), RMSNorm, SwiGLU MLP,
tied or untied embeddings. q/k/v and gate/up are fused GEMMs; LoRA is added to every projection
through ``multilora.kernels.lora_apply`` and attention runs over the paged KV cache through
``multilora.kernels.attention``, both with the step's plan, passed explicitly (``StepPlan``). RMSNorm (fused
with the residual add), RoPE with the KV-cache write, and SiLU * up come from ``multilora.kernels.fused``: one
Triton kernel each on CUDA, torch ops on the CPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from multilora.kernels import LoRAPlan, LoRASlices, lora_apply, lora_slices
from multilora.kernels.attention import AttentionMetadata, build_attention_metadata, paged_attention
from multilora.kernels.fused import add_rms_norm, rms_norm, rope_write_kv, silu_mul
from multilora.memory.kv_cache import PagedKVCache
from multilora.memory.pool import AdapterPool
from multilora.config import ModelConfig


# ----------------------------------------------------------------------------------------- RoPE
def rope_inv_freq(config: ModelConfig, rope_freqs: torch.Tensor | None = None) -> torch.Tensor:
    """RoPE inverse frequencies ``theta^(-2i/d)`` [head_dim / 2], float32 (RoFormer, Su et al. 2021).

    ``rope_scaling`` "linear" divides by ``factor``; "llama3" applies Meta's Llama 3.1 frequency-dependent
    rescaling (long wavelengths / factor, short ones unchanged, a smooth ramp between); ``rope_freqs``
    (GGUF llama 3.x) divides elementwise.
    """
    d = config.head_dim
    inv = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    sc = config.rope_scaling or {}
    kind = sc.get("rope_type", sc.get("type", "default"))
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
    if rope_freqs is not None:
        inv = inv / rope_freqs.double()
    return inv.float()


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [num_tokens, head_dim] (float32) for the rotate-half convention."""
    freqs = positions.float()[:, None] * inv_freq[None, :].to(positions.device)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


# ----------------------------------------------------------------------------------- step plan
@dataclass(frozen=True)
class StepPlan:
    """Everything one forward step needs, built once and passed to every layer.

    Tokens are flattened (varlen): ``T = sum(q_lens)``, sequence ``b``'s tokens are contiguous.

    Attributes:
        input_ids: int64 [T].
        positions: int64 [T], absolute position of each token in its sequence (the forward looks up the
            model's RoPE tables with it, so a captured graph only needs this buffer updated).
        q_lens: host tuple [B], new tokens per sequence.
        last_index: int64 [B], flat index of each sequence's last token (for logits).
        attn: the step's paged-attention metadata (block tables, slot mapping, lengths).
        lora: the step's LoRA plan (token -> adapter slot).
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    q_lens: tuple[int, ...]
    last_index: torch.Tensor
    attn: AttentionMetadata
    lora: LoRAPlan


# ------------------------------------------------------------------------------------------ model
class LlamaModel:
    """Inference-only Llama decoder over flattened varlen batches, with per-token LoRA.

    Args:
        config: the model's configuration.
        weights: HF-named weights (see ``runtime.weights``); consumed (fused copies are made).
        device, dtype: where and in which dtype the model runs.
    """

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], *, device: torch.device, dtype: torch.dtype):
        self.config = config
        self.device = device
        self.dtype = dtype

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
        self.norm = put(w("model.norm.weight"))
        self.layers = []
        for i in range(config.num_layers):
            p = f"model.layers.{i}."
            qkv = torch.cat([w(p + f"self_attn.{m}.weight") for m in ("q_proj", "k_proj", "v_proj")])
            gate_up = torch.cat([w(p + "mlp.gate_proj.weight"), w(p + "mlp.up_proj.weight")])
            layer = {
                "in_norm": put(w(p + "input_layernorm.weight")),
                "post_norm": put(w(p + "post_attention_layernorm.weight")),
                "qkv": put(qkv),  # [q + 2 kv, hidden]
                "o": put(w(p + "self_attn.o_proj.weight")),  # [hidden, q]
                "gate_up": put(gate_up),  # [2 * inter, hidden]
                "down": put(w(p + "mlp.down_proj.weight")),  # [hidden, inter]
            }
            self._check_layer(i, layer)
            self.layers.append(layer)
        self.inv_freq = rope_inv_freq(config, weights.get("rope_freqs")).to(device)
        self.rope_cos = self.rope_sin = torch.empty(0, config.head_dim, dtype=torch.float32, device=device)
        self.ensure_rope_positions(256)
        self._views: list[dict[str, LoRASlices]] | None = None

    def ensure_rope_positions(self, n: int) -> None:
        """Grow the RoPE tables ``rope_cos``/``rope_sin`` (float32 [n_positions, head_dim], on the model's
        device) to cover positions ``0 .. n - 1``, doubling; they never shrink. A caller that captures
        CUDA graphs grows them first (the engine does, to ``max_seq_len``), so their address stays put."""
        have = self.rope_cos.shape[0]
        if n <= have:
            return
        size = max(have, 1)
        while size < n:
            size *= 2
        self.rope_cos, self.rope_sin = rope_cos_sin(self.inv_freq, torch.arange(size, device=self.device))

    def _check_layer(self, i: int, layer: dict[str, torch.Tensor]) -> None:
        c = self.config
        want = {
            "qkv": (c.q_size + 2 * c.kv_size, c.hidden_size),
            "o": (c.hidden_size, c.q_size),
            "gate_up": (2 * c.intermediate_size, c.hidden_size),
            "down": (c.hidden_size, c.intermediate_size),
        }
        for k, shape in want.items():
            if tuple(layer[k].shape) != shape:
                raise ValueError(f"model weights: layer {i} {k} has shape {tuple(layer[k].shape)}, expected {shape}")

    @property
    def nbytes(self) -> int:
        total = self.embed.numel() + self.norm.numel()
        if self.lm_head is not self.embed:
            total += self.lm_head.numel()
        total += sum(t.numel() for layer in self.layers for t in layer.values())
        return total * self.embed.element_size()

    def bind_pool(self, pool: AdapterPool) -> None:
        """Cache the pool's fused slices (per layer: qkv, o, gate_up, down); they never change."""
        self._views = [
            {
                "qkv": lora_slices([pool.module_view(i, m) for m in ("q_proj", "k_proj", "v_proj")]),
                "o": lora_slices([pool.module_view(i, "o_proj")]),
                "gate_up": lora_slices([pool.module_view(i, m) for m in ("gate_proj", "up_proj")]),
                "down": lora_slices([pool.module_view(i, "down_proj")]),
            }
            for i in range(self.config.num_layers)
        ]

    # ------------------------------------------------------------------------------ forward
    def _linear(self, x: torch.Tensor, layer: int, name: str, plan: StepPlan, lora_backend: str | None) -> torch.Tensor:
        y = x @ self.layers[layer][name].t()
        if plan.lora.has_lora and self._views is not None:
            lora_apply(y, x, self._views[layer][name], plan.lora, backend=lora_backend)
        return y

    def forward(self, plan: StepPlan, kv: PagedKVCache, *, lora_backend: str | None = None,
                attention_backend: str | None = None, ops_backend: str | None = None) -> torch.Tensor:
        """Run the decoder over the step's tokens; returns final hidden states [T, hidden] (normed).

        Keys and values of the step's tokens are written into ``kv`` at ``plan.attn.slot_mapping``.
        ``ops_backend`` picks the RMSNorm / RoPE + cache write / SiLU-mul ops (``multilora.kernels.fused``:
        "torch", "triton", None = triton on CUDA).
        """
        c = self.config
        h = self.embed.index_select(0, plan.input_ids)  # [T, hidden]: the residual stream, updated in place
        T = h.shape[0]
        x = rms_norm(h, self.layers[0]["in_norm"], c.rms_norm_eps, backend=ops_backend)
        for i, layer in enumerate(self.layers):
            qkv = self._linear(x, i, "qkv", plan, lora_backend)  # [T, q + 2 kv]
            k_cache, v_cache = kv.layer(i)  # [num_blocks, block_size, Hkv, D]
            q = rope_write_kv(qkv, self.rope_cos, self.rope_sin, plan.positions, plan.attn.slot_mapping, k_cache,
                              v_cache, num_heads=c.num_heads, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
                              backend=ops_backend)  # [T, H, D]
            attn = paged_attention(q, k_cache, v_cache, plan.attn, scale=c.head_dim ** -0.5,
                                   sliding_window=c.sliding_window or 0, backend=attention_backend)
            o = self._linear(attn.reshape(T, c.q_size), i, "o", plan, lora_backend)
            x = add_rms_norm(h, o, layer["post_norm"], c.rms_norm_eps, backend=ops_backend)
            gu = self._linear(x, i, "gate_up", plan, lora_backend)  # [T, 2 * inter]
            d = self._linear(silu_mul(gu, backend=ops_backend), i, "down", plan, lora_backend)
            nxt = self.layers[i + 1]["in_norm"] if i + 1 < len(self.layers) else self.norm
            x = add_rms_norm(h, d, nxt, c.rms_norm_eps, backend=ops_backend)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [n, hidden_size] -> float32 logits [n, vocab]."""
        return (hidden @ self.lm_head.t()).float()


def build_step_plan(
    model: LlamaModel,
    *,
    token_ids: Sequence[Sequence[int]],
    start_positions: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    block_size: int,
    lora: LoRAPlan,
) -> StepPlan:
    """Build the step plan for B sequences, each adding ``token_ids[b]`` at ``start_positions[b]`` onward.

    ``block_tables[b]`` are sequence b's KV blocks; they must cover ``start_positions[b] + len(token_ids[b])``
    positions. Grows the model's RoPE tables if a position is beyond them.

    Raises:
        ValueError: empty input, lengths that disagree, or a block table too short.
    """
    B = len(token_ids)
    if B == 0 or len(start_positions) != B or len(block_tables) != B:
        raise ValueError("build_step_plan: token_ids, start_positions and block_tables must be non-empty and equal in length")
    q_lens = tuple(len(t) for t in token_ids)
    if min(q_lens) == 0:
        raise ValueError("build_step_plan: every sequence must add at least one token")
    seq_lens = [s + n for s, n in zip(start_positions, q_lens)]
    dev = model.device
    model.ensure_rope_positions(max(seq_lens))
    attn = build_attention_metadata(q_lens, seq_lens, block_tables, block_size=block_size, device=dev)
    positions = torch.cat([torch.arange(s, s + n) for s, n in zip(start_positions, q_lens)])
    return StepPlan(
        input_ids=torch.tensor([t for seq in token_ids for t in seq], dtype=torch.long, device=dev),
        positions=positions.to(dev),
        q_lens=q_lens,
        last_index=(torch.tensor(q_lens).cumsum(0) - 1).to(dev),
        attn=attn,
        lora=lora,
    )
