"""A Llama-family decoder written for this runtime (Llama 2/3, Mistral, SmolLM2).

GQA attention with RoPE (the config's theta, optional llama3/linear scaling), RMSNorm, SwiGLU MLP,
tied or untied embeddings. q/k/v and gate/up are fused GEMMs; LoRA is added to every projection
through ``multilora.kernels.lora_apply`` with the step's plan, passed explicitly (``StepPlan``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F

from multilora.kernels import LoRAPlan, lora_apply
from multilora.memory.kv_cache import KVCache
from multilora.memory.pool import AdapterPool, LoRAModuleView
from multilora.runtime.config import ModelConfig


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


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim]; cos/sin [T, head_dim]."""
    half = x.shape[-1] // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    xf = x.float()
    return (xf * cos[:, None, :] + rot.float() * sin[:, None, :]).to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm (Zhang & Sennrich 2019), computed in float32 as HF Llama does."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


# ----------------------------------------------------------------------------------- step plan
@dataclass(frozen=True)
class StepPlan:
    """Everything one forward step needs, built once and passed to every layer.

    Tokens are flattened: ``T = sum(q_lens)``, sequence ``b``'s tokens are contiguous.

    Attributes:
        input_ids: int64 [T].
        positions: int64 [T], absolute position of each token in its sequence.
        cos, sin: float32 [T, head_dim] RoPE tables for ``positions``.
        kv_rows: int64 [B] KV-cache row of each sequence.
        token_rows: int64 [T] KV row of each token (for the cache write).
        q_lens: host list [B]; max_q = max(q_lens); ctx_max = max context length (past + new).
        pad_index: int64 [T], index of each token in the padded [B * max_q] query layout.
        attn_mask: bool [B, 1, max_q, ctx_max], True = may attend.
        last_index: int64 [B], flat index of each sequence's last token (for logits).
        lora: the step's LoRA plan (token -> adapter slot).
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    kv_rows: torch.Tensor
    token_rows: torch.Tensor
    q_lens: tuple[int, ...]
    max_q: int
    ctx_max: int
    pad_index: torch.Tensor
    attn_mask: torch.Tensor
    last_index: torch.Tensor
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
        self._views: list[dict[str, list[LoRAModuleView]]] | None = None

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
        """Cache the pool views (per layer: qkv, o, gate_up, down slices); they never change."""
        self._views = [
            {
                "qkv": [pool.module_view(i, m) for m in ("q_proj", "k_proj", "v_proj")],
                "o": [pool.module_view(i, "o_proj")],
                "gate_up": [pool.module_view(i, m) for m in ("gate_proj", "up_proj")],
                "down": [pool.module_view(i, "down_proj")],
            }
            for i in range(self.config.num_layers)
        ]

    # ------------------------------------------------------------------------------ forward
    def _linear(self, x: torch.Tensor, layer: int, name: str, plan: StepPlan, lora_backend: str | None) -> torch.Tensor:
        y = x @ self.layers[layer][name].t()
        if plan.lora.has_lora and self._views is not None:
            lora_apply(y, x, self._views[layer][name], plan.lora, backend=lora_backend)
        return y

    def _attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, plan: StepPlan, kv: KVCache) -> torch.Tensor:
        c = self.config
        kv.k[layer].index_put_((plan.token_rows, plan.positions), k)
        kv.v[layer].index_put_((plan.token_rows, plan.positions), v)
        B = len(plan.q_lens)
        qp = q.new_zeros(B * plan.max_q, c.num_heads, c.head_dim)
        qp[plan.pad_index] = q
        qp = qp.view(B, plan.max_q, c.num_heads, c.head_dim).transpose(1, 2)  # [B, H, Sq, D]
        kc = kv.k[layer].index_select(0, plan.kv_rows)[:, : plan.ctx_max].transpose(1, 2)  # [B, Hkv, S, D]
        vc = kv.v[layer].index_select(0, plan.kv_rows)[:, : plan.ctx_max].transpose(1, 2)
        rep = c.num_heads // c.num_kv_heads
        if rep > 1:
            kc = kc.repeat_interleave(rep, dim=1)
            vc = vc.repeat_interleave(rep, dim=1)
        o = F.scaled_dot_product_attention(qp, kc, vc, attn_mask=plan.attn_mask)  # [B, H, Sq, D]
        o = o.transpose(1, 2).reshape(B * plan.max_q, c.q_size)
        return o.index_select(0, plan.pad_index)  # [T, q_size]

    def forward(self, plan: StepPlan, kv: KVCache, *, lora_backend: str | None = None) -> torch.Tensor:
        """Run the decoder over the step's tokens; returns final hidden states [T, hidden] (normed)."""
        c = self.config
        h = self.embed.index_select(0, plan.input_ids)  # [T, hidden]
        T = h.shape[0]
        for i, layer in enumerate(self.layers):
            x = rms_norm(h, layer["in_norm"], c.rms_norm_eps)
            qkv = self._linear(x, i, "qkv", plan, lora_backend)  # [T, q + 2 kv]
            q, k, v = qkv.split([c.q_size, c.kv_size, c.kv_size], dim=-1)
            q = apply_rope(q.reshape(T, c.num_heads, c.head_dim), plan.cos, plan.sin)
            k = apply_rope(k.reshape(T, c.num_kv_heads, c.head_dim), plan.cos, plan.sin)
            v = v.reshape(T, c.num_kv_heads, c.head_dim)
            attn = self._attention(q, k, v, i, plan, kv)
            h = h + self._linear(attn, i, "o", plan, lora_backend)
            x = rms_norm(h, layer["post_norm"], c.rms_norm_eps)
            gu = self._linear(x, i, "gate_up", plan, lora_backend)  # [T, 2 * inter]
            g, u = gu.chunk(2, dim=-1)
            h = h + self._linear(F.silu(g) * u, i, "down", plan, lora_backend)
        return rms_norm(h, self.norm, c.rms_norm_eps)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [n, hidden_size] -> float32 logits [n, vocab]."""
        return (hidden @ self.lm_head.t()).float()


def build_step_plan(
    model: LlamaModel,
    *,
    token_ids: Sequence[Sequence[int]],
    start_positions: Sequence[int],
    kv_rows: Sequence[int],
    lora: LoRAPlan,
) -> StepPlan:
    """Build the step plan for B sequences, each adding ``token_ids[b]`` at ``start_positions[b]`` onward.

    Raises:
        ValueError: empty input, or lengths that disagree.
    """
    B = len(token_ids)
    if B == 0 or len(start_positions) != B or len(kv_rows) != B:
        raise ValueError("build_step_plan: token_ids, start_positions and kv_rows must be non-empty and equal in length")
    dev = model.device
    q_lens = tuple(len(t) for t in token_ids)
    if min(q_lens) == 0:
        raise ValueError("build_step_plan: every sequence must add at least one token")
    max_q = max(q_lens)
    ctx = [s + n for s, n in zip(start_positions, q_lens)]
    ctx_max = max(ctx)
    flat = [t for seq in token_ids for t in seq]
    positions = torch.cat([torch.arange(s, s + n) for s, n in zip(start_positions, q_lens)])
    pad_index = torch.cat([torch.arange(n) + b * max_q for b, n in enumerate(q_lens)])
    token_rows = torch.repeat_interleave(torch.tensor(list(kv_rows)), torch.tensor(q_lens))
    # mask[b, i, j]: query i of sequence b (absolute position start_b + i) may see key position j
    qpos = torch.tensor(list(start_positions))[:, None] + torch.arange(max_q)[None, :]  # [B, max_q]
    kpos = torch.arange(ctx_max)
    mask = kpos[None, None, :] <= qpos[:, :, None]
    win = model.config.sliding_window
    if win:
        mask &= kpos[None, None, :] > qpos[:, :, None] - win
    valid_q = torch.arange(max_q)[None, :] < torch.tensor(q_lens)[:, None]
    mask[:, :, 0] |= ~valid_q  # padded query rows see position 0 only (never all-masked; discarded)
    last_index = torch.tensor(q_lens).cumsum(0) - 1
    cos, sin = rope_cos_sin(model.inv_freq, positions.to(dev))
    return StepPlan(
        input_ids=torch.tensor(flat, dtype=torch.long, device=dev),
        positions=positions.to(dev),
        cos=cos,
        sin=sin,
        kv_rows=torch.tensor(list(kv_rows), dtype=torch.long, device=dev),
        token_rows=token_rows.to(dev),
        q_lens=q_lens,
        max_q=max_q,
        ctx_max=ctx_max,
        pad_index=pad_index.to(dev),
        attn_mask=mask[:, None].to(dev),
        last_index=last_index.to(dev),
        lora=lora,
    )
