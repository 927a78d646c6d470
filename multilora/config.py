"""Model configuration of a Llama-family decoder (Llama 2/3, Mistral, SmolLM2), and the target-module names.

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


@dataclass
class ModelConfig:
    """Shape and numerics of a Llama-family decoder.

    Derived fields (``head_dim`` when not given) are filled in ``__post_init__``.
    ``rope_scaling`` is the HF dict (``{"rope_type": "llama3", "factor": ..., ...}``) or None.
    ``sliding_window`` (Mistral v0.1) limits attention to the last N positions; None = full causal.
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

    def __post_init__(self) -> None:
        if self.head_dim <= 0:
            self.head_dim = self.hidden_size // self.num_heads
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )

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
        }[module]

    def hf_module_name(self, layer: int, module: str) -> str:
        """The HF/PEFT module path of a projection, e.g. ``model.layers.3.self_attn.q_proj``."""
        return f"model.layers.{layer}.{MODULE_PARENT[module]}.{module}"

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> "ModelConfig":
        """Build from a HF ``config.json`` dict (``model_type`` llama, mistral or qwen-free Llama clones).

        Raises:
            ValueError: the architecture is not a Llama-family decoder, or a required field is missing.
        """
        mt = cfg.get("model_type", "llama")
        if mt not in ("llama", "mistral"):
            raise ValueError(
                f"config.json: model_type must be 'llama' or 'mistral' (Llama-family decoders), got {mt!r}"
            )
        for key in ("attention_bias", "mlp_bias"):
            if cfg.get(key):
                raise ValueError(f"config.json: {key}=true is not supported (Llama projections have no bias)")
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"config.json: hidden_act must be 'silu' (SwiGLU), got {act!r}")
        required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
        missing = [k for k in required if k not in cfg]
        if missing:
            raise ValueError(f"config.json: missing required field(s) {missing}")
        rope = cfg.get("rope_parameters") or {}
        theta = cfg.get("rope_theta", rope.get("rope_theta", 10000.0))
        scaling = cfg.get("rope_scaling")
        if scaling is None and rope.get("rope_type", "default") != "default":
            scaling = dict(rope)
        if scaling is not None:
            rtype = scaling.get("rope_type", scaling.get("type", "default"))
            if rtype not in ("default", "llama3", "linear"):
                raise ValueError(
                    f"config.json: rope_scaling type {rtype!r} is not supported (default, linear, llama3)"
                )
        eos = cfg.get("eos_token_id")
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
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
            sliding_window=cfg.get("sliding_window"),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            architecture=mt,
        )
