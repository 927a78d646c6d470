"""Model configuration of the decoders multilora serves, and the target-module names.

One decoder serves every family (``runtime.model``); a family is a few flags on ``ModelConfig``:

| ``model_type`` | families | what differs from Llama |
|---|---|---|
| ``llama`` | Llama 2 / 3 / 3.1, SmolLM2 | (``attention_bias``: biases on q/k/v/o) |
| ``mistral`` | Mistral 7B | one sliding window for every layer |
| ``qwen2`` | Qwen2, Qwen2.5 | biases on q/k/v; sliding window on layers ``>= max_window_layers`` when ``use_sliding_window`` |
| ``qwen3`` | Qwen3 (dense) | RMSNorm of each q and k head before RoPE; ``head_dim`` of its own; ``attention_bias`` |
| ``phi3`` | Phi-3 mini / medium | fused ``qkv_proj`` / ``gate_up_proj`` (weights and adapters); ``longrope`` RoPE scaling |
| ``gemma2`` | Gemma 2 | RMSNorm times ``1 + weight``; embeddings times sqrt(hidden); GeGLU (tanh GELU); norms after attention and MLP; attention and final-logit soft-capping; ``query_pre_attn_scalar``; alternating sliding-window layers; ``head_dim`` of its own |

Any other ``model_type`` is refused by ``ModelConfig.from_hf_dict`` with the list above (``SERVED_MODEL_TYPES``).

Shared by every part of multilora (``memory/`` sizes the adapter pool from it, ``runtime/`` builds the model
from it), so it lives above them: ``kernels/`` and ``memory/`` never import ``runtime/``.

The fields follow Hugging Face ``config.json`` names where one exists. ``ModelConfig.from_hf_dict``
reads a ``config.json``; ``runtime.weights`` builds one from GGUF metadata.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

#: The seven Llama projections a LoRA adapter may target, in the order used everywhere in multilora
#: (pool layout, plans, stats). ``MODULE_INDEX[name]`` is the position of a module in this tuple.
TARGET_MODULES: tuple[str, ...] = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
)
MODULE_INDEX: dict[str, int] = {m: i for i, m in enumerate(TARGET_MODULES)}
#: HF ``model_type`` values served, each with the HF class of its checkpoints (for messages and the README).
SERVED_MODEL_TYPES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
}
#: Fused projections of Phi-3 checkpoints (``fused_projections``) and the target modules they hold, in row order:
#: ``qkv_proj.weight`` [q + 2 kv, hidden] is ``q_proj`` / ``k_proj`` / ``v_proj`` stacked; ``gate_up_proj.weight``
#: [2 inter, hidden] is ``gate_proj`` then ``up_proj`` (HF ``Phi3MLP`` chunks it in that order).
FUSED_PROJECTIONS: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}
#: HF ``layer_types`` entries: a layer attends causally to every earlier position, or to the last ``sliding_window``.
FULL_ATTENTION, SLIDING_ATTENTION = "full_attention", "sliding_attention"
#: The submodule that holds each projection in HF Llama module names (``model.layers.N.<parent>.<module>``).
MODULE_PARENT: dict[str, str] = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
}
_HF_PARENT: dict[str, str] = {**MODULE_PARENT, "qkv_proj": "self_attn", "gate_up_proj": "mlp"}
#: MLP activations (HF ``hidden_act`` / ``hidden_activation``): SwiGLU's SiLU, GeGLU's tanh-approximate GELU (Gemma 2).
HIDDEN_ACTS = ("silu", "gelu_pytorch_tanh")
#: Gemma2Config's defaults, used for the fields a Gemma 2 ``config.json`` leaves out (transformers does the same).
_GEMMA2_DEFAULTS: dict[str, Any] = dict(head_dim=256, hidden_activation="gelu_pytorch_tanh", rms_norm_eps=1e-6,
                                        tie_word_embeddings=True, query_pre_attn_scalar=256, sliding_window=4096,
                                        final_logit_softcapping=30.0, attn_logit_softcapping=50.0,
                                        max_position_embeddings=8192)
#: RoPE scaling types read from ``rope_scaling`` / ``rope_parameters`` (``su`` is ``longrope``'s old name).
ROPE_TYPES = ("default", "linear", "llama3", "longrope")


@dataclass
class ModelConfig:
    """Shape and numerics of a decoder of one of the served families (see the module docstring).

    Derived fields (``head_dim`` when not given) are filled in ``__post_init__``.
    ``rope_scaling`` is the HF dict (``{"rope_type": "llama3", "factor": ..., ...}``) or None.
    ``sliding_window`` limits attention to the last N positions (None = full causal) on the layers
    ``layer_types`` marks ``"sliding_attention"``; ``layer_types`` None = every layer (Mistral v0.1).
    ``qkv_bias`` / ``o_bias``: the base q/k/v (o) projections have a bias (Qwen2: q/k/v; Llama and Qwen3
    ``attention_bias``: all four); LoRA adapters never have one. ``qk_norm`` (Qwen3): an RMSNorm with a
    [head_dim] weight on every q and k head before RoPE (``rms_norm_eps``).

    Gemma 2 (HF ``modeling_gemma2``): ``hidden_act`` ``"gelu_pytorch_tanh"`` (GeGLU: ``gelu_tanh(gate) * up``);
    ``norm_unit_offset``: every RMSNorm multiplies by ``1 + weight`` in float32 and rounds once (``Gemma2RMSNorm``);
    ``scale_embeddings``: the embedding rows times ``sqrt(hidden_size)`` rounded to the model dtype;
    ``block_output_norms``: the attention and the MLP outputs are RMS-normed before their residual add
    (HF ``post_attention_layernorm`` / ``post_feedforward_layernorm``; the MLP's input norm is then
    ``pre_feedforward_layernorm``); ``query_pre_attn_scalar``: the softmax scale is its ``** -0.5`` (None:
    ``head_dim ** -0.5``); ``attn_logit_softcapping`` / ``final_logit_softcapping``: the attention scores /
    the logits become ``cap * tanh(x / cap)`` (None: not capped).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int = 0
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    architecture: str = "llama"
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    layer_types: list[str] | None = None
    fused_projections: bool = False
    hidden_act: str = "silu"
    norm_unit_offset: bool = False
    scale_embeddings: bool = False
    block_output_norms: bool = False
    query_pre_attn_scalar: float | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None

    def __post_init__(self) -> None:
        if self.head_dim <= 0:
            self.head_dim = self.hidden_size // self.num_heads
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.architecture not in SERVED_MODEL_TYPES:
            raise ValueError(_not_served(self.architecture, "ModelConfig.architecture"))
        if self.hidden_act not in HIDDEN_ACTS:
            raise ValueError(f"hidden_act must be one of {', '.join(HIDDEN_ACTS)}, got {self.hidden_act!r}")
        for name in ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping"):
            v = getattr(self, name)
            if v is not None and not (isinstance(v, (int, float)) and v > 0):
                raise ValueError(f"{name} must be a positive number or None, got {v!r}")
        if self.layer_types is not None:
            self.layer_types = list(self.layer_types)
            bad = [t for t in self.layer_types if t not in (FULL_ATTENTION, SLIDING_ATTENTION)]
            if len(self.layer_types) != self.num_layers or bad:
                raise ValueError(
                    f"layer_types must list {self.num_layers} entries (one per layer), each {FULL_ATTENTION!r} or "
                    f"{SLIDING_ATTENTION!r}; got {self.layer_types!r}"
                )
        if self.rope_scaling is not None and self.rope_type == "longrope":
            sc = self.rope_scaling
            for key in ("short_factor", "long_factor"):
                f = sc.get(key)
                if not isinstance(f, (list, tuple)) or len(f) != self.head_dim // 2:
                    raise ValueError(
                        f"rope_scaling (longrope): {key} must list head_dim / 2 = {self.head_dim // 2} numbers, "
                        f"got {f!r}"
                    )
            if not isinstance(sc.get("original_max_position_embeddings"), int):
                raise ValueError("rope_scaling (longrope): original_max_position_embeddings must be an integer, "
                                 f"got {sc.get('original_max_position_embeddings')!r}")

    @property
    def rope_type(self) -> str:
        """The RoPE scaling type: one of ``ROPE_TYPES`` (``"default"`` without ``rope_scaling``)."""
        sc = self.rope_scaling or {}
        return sc.get("rope_type", sc.get("type", "default"))

    @property
    def lora_modules(self) -> tuple[str, ...]:
        """The projection names of one layer that a PEFT adapter may target, in HF ``named_modules`` order: the
        seven ``TARGET_MODULES``, or Phi-3's ``o_proj``, ``qkv_proj``, ``gate_up_proj``, ``down_proj``."""
        if self.fused_projections:
            return ("o_proj", "qkv_proj", "gate_up_proj", "down_proj")
        return TARGET_MODULES

    @staticmethod
    def lora_slices(module: str) -> tuple[str, ...]:
        """The target modules a projection name stands for, in row order (``FUSED_PROJECTIONS``, else itself)."""
        return FUSED_PROJECTIONS.get(module, (module,))

    def window(self, layer: int) -> int:
        """The sliding window of ``layer`` in tokens (0 = full causal attention)."""
        if not self.sliding_window:
            return 0
        if self.layer_types is not None and self.layer_types[layer] != SLIDING_ATTENTION:
            return 0
        return int(self.sliding_window)

    @property
    def attn_scale(self) -> float:
        """The softmax scale of the attention scores: ``query_pre_attn_scalar ** -0.5`` (Gemma 2), else
        ``head_dim ** -0.5``."""
        return float(self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def module_shape(self, module: str) -> tuple[int, int]:
        """(in_features, out_features) of a target module, as ``nn.Linear`` would have them."""
        h, i = self.hidden_size, self.intermediate_size
        return {
            "q_proj": (h, self.q_size),
            "k_proj": (h, self.kv_size),
            "v_proj": (h, self.kv_size),
            "o_proj": (self.q_size, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
            "qkv_proj": (h, self.q_size + 2 * self.kv_size),
            "gate_up_proj": (h, 2 * i),
        }[module]

    def hf_module_name(self, layer: int, module: str) -> str:
        """The HF/PEFT module path of a projection, e.g. ``model.layers.3.self_attn.q_proj`` (or Phi-3's
        ``model.layers.3.self_attn.qkv_proj``)."""
        return f"model.layers.{layer}.{_HF_PARENT[module]}.{module}"

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> "ModelConfig":
        """Build from a HF ``config.json`` dict of a served ``model_type`` (``SERVED_MODEL_TYPES``).

        Reads the family flags as transformers does: Qwen2's q/k/v biases; ``attention_bias`` (Llama, Qwen3,
        Gemma 2); Qwen3's q/k norms; Phi-3's fused projections and ``longrope`` scaling (``_hf_rope_scaling``); the
        sliding window of Qwen2/Qwen3 only when ``use_sliding_window`` is true, on the layers ``layer_types`` names
        (or, without it, the layers ``>= max_window_layers``); Gemma 2's flags (see the class docstring), its
        ``layer_types`` (default: even layers slide) and, for the fields its file leaves out, Gemma2Config's
        defaults (``_GEMMA2_DEFAULTS``: tied embeddings, caps 50 / 30, ``query_pre_attn_scalar`` 256, ...).

        Raises:
            ValueError: a ``model_type`` not served (the message names it and lists the served ones), a
                feature of a served family that is not supported, or a required field missing.
        """
        mt = cfg.get("model_type", "llama")
        if mt not in SERVED_MODEL_TYPES:
            raise ValueError(_not_served(mt, "config.json", cfg.get("architectures")))
        gemma2 = mt == "gemma2"
        if gemma2:  # the fields a Gemma 2 file leaves out take Gemma2Config's defaults, as in transformers
            cfg = {**_GEMMA2_DEFAULTS, **cfg}
            if cfg.get("use_bidirectional_attention"):
                raise ValueError("config.json: use_bidirectional_attention=true is not supported (causal attention only)")
        if cfg.get("mlp_bias"):
            raise ValueError("config.json: mlp_bias=true is not supported (the MLP projections have no bias here)")
        if mt == "mistral" and cfg.get("attention_bias"):
            raise ValueError("config.json: attention_bias=true is not supported for mistral")
        if gemma2:  # Gemma2MLP reads hidden_activation only (Gemma 2 files also carry a hidden_act)
            act = cfg.get("hidden_activation")
            if act != "gelu_pytorch_tanh":
                raise ValueError(f"config.json: hidden_activation must be 'gelu_pytorch_tanh' (GeGLU with tanh GELU) "
                                 f"for gemma2, got {act!r}")
        else:
            act = cfg.get("hidden_act", "silu")
            if act != "silu":
                raise ValueError(f"config.json: hidden_act must be 'silu' (SwiGLU), got {act!r}")
        required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
        missing = [k for k in required if k not in cfg]
        if missing:
            raise ValueError(f"config.json: missing required field(s) {missing}")
        rope = cfg.get("rope_parameters") or {}
        theta = cfg.get("rope_theta", rope.get("rope_theta", 10000.0))
        scaling = _hf_rope_scaling(mt, cfg, rope)
        partial = cfg.get("partial_rotary_factor", rope.get("partial_rotary_factor", 1.0))
        if partial is not None and float(partial) != 1.0:
            raise ValueError(
                f"config.json: partial_rotary_factor {partial!r} is not supported (RoPE on part of each head, e.g. "
                "Phi-4-mini); multilora rotates the whole head (partial_rotary_factor 1.0)"
            )
        eos = cfg.get("eos_token_id")
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        bias = bool(cfg.get("attention_bias", False))
        window, layer_types = _hf_sliding_window(mt, cfg)
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=cfg["num_attention_heads"],
            num_kv_heads=cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
            head_dim=cfg.get("head_dim") or 0,
            rope_theta=float(theta),
            rope_scaling=scaling,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            sliding_window=window,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            architecture=mt,
            qkv_bias=True if mt == "qwen2" else bias,
            o_bias=False if mt == "qwen2" else bias,
            qk_norm=mt == "qwen3",
            layer_types=layer_types,
            fused_projections=mt == "phi3",
            hidden_act=act,
            norm_unit_offset=gemma2,
            scale_embeddings=gemma2,
            block_output_norms=gemma2,
            query_pre_attn_scalar=cfg.get("query_pre_attn_scalar") if gemma2 else None,
            attn_logit_softcapping=cfg.get("attn_logit_softcapping") if gemma2 else None,
            final_logit_softcapping=cfg.get("final_logit_softcapping") if gemma2 else None,
        )


def _not_served(model_type: Any, where: str, architectures: Any = None) -> str:
    arch = f" (architectures {architectures!r})" if architectures else ""
    served = ", ".join(f"{k} ({v})" for k, v in SERVED_MODEL_TYPES.items())
    return f"{where}: model_type {model_type!r}{arch} is not served by multilora; served model types: {served}"


def _hf_rope_scaling(model_type: str, cfg: dict[str, Any], rope: dict[str, Any]) -> dict[str, Any] | None:
    """The RoPE scaling dict of a ``config.json`` as transformers reads it, or None for plain RoPE.

    ``rope_scaling`` (transformers 4.x files) or, without it, a non-default ``rope_parameters`` (5.x). ``su`` is
    ``longrope``'s old name, and Phi-3 configs also map ``yarn`` to it (``Phi3Config.convert_rope_params_to_dict``).
    A ``longrope`` dict gets ``original_max_position_embeddings`` as transformers' ``standardize_rope_params``
    gives it: the config's top-level field when there is one (Phi-3 writes it there), else the dict's own, else
    ``max_position_embeddings``.

    Raises:
        ValueError: a type not in ``ROPE_TYPES`` (the message names it and ``rope_scaling``).
    """
    scaling = cfg.get("rope_scaling")
    if scaling is None and rope.get("rope_type", rope.get("type", "default")) != "default":
        scaling = rope
    if scaling is None:
        return None
    scaling = dict(scaling)
    rtype = scaling.get("rope_type", scaling.get("type", "default"))
    if rtype == "su" or (model_type == "phi3" and rtype == "yarn"):
        rtype = "longrope"
    if rtype not in ROPE_TYPES:
        raise ValueError(
            f"config.json: rope_scaling type {rtype!r} is not supported; supported: {', '.join(ROPE_TYPES)} (and su)"
        )
    scaling["rope_type"] = rtype
    if rtype == "longrope":
        orig = cfg.get("original_max_position_embeddings") or scaling.get("original_max_position_embeddings")
        scaling["original_max_position_embeddings"] = int(orig or cfg.get("max_position_embeddings", 4096))
    return scaling


def _hf_sliding_window(model_type: str, cfg: dict[str, Any]) -> tuple[int | None, list[str] | None]:
    """``(sliding_window, layer_types)`` as transformers reads them for ``model_type``.

    Llama / Mistral / Phi-3: ``sliding_window`` (if any) on every layer. Qwen2 / Qwen3: no window unless
    ``use_sliding_window`` (their shipped configs carry ``sliding_window: 32768`` with it false); with it, the
    layers ``layer_types`` marks sliding, or (older files without ``layer_types``) those ``>= max_window_layers``.
    """
    window = cfg.get("sliding_window")
    if model_type in ("llama", "mistral", "phi3"):
        return window, None
    if model_type == "gemma2":  # Gemma2Config: without layer_types, even layers slide and odd ones see everything
        if window is None:
            return None, None
        types = cfg.get("layer_types") or [SLIDING_ATTENTION if (i + 1) % 2 else FULL_ATTENTION
                                           for i in range(cfg["num_hidden_layers"])]
        return int(window), list(types)
    if not cfg.get("use_sliding_window", False) or window is None:
        return None, None
    n = cfg["num_hidden_layers"]
    types = cfg.get("layer_types")
    if types is None:
        first = int(cfg.get("max_window_layers", 28))
        types = [SLIDING_ATTENTION if i >= first else FULL_ATTENTION for i in range(n)]
    return int(window), list(types)
