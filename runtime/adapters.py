"""PEFT LoRA adapters for a Llama-family base model: load, validate, and write them.

An adapter on disk is a directory holding ``adapter_config.json`` and ``adapter_model.safetensors``, the
files ``peft.PeftModel.save_pretrained`` writes. :func:`load_peft_adapter` turns one into a
:class:`LoRAAdapter`: for every targeted ``(layer, module)`` the pair

    A = lora_A.weight  [r, in_features]    float32, CPU, contiguous
    B = lora_B.weight  [out_features, r]   float32, CPU, contiguous

and the scaling ``s`` so that the module computes ``y = x W^T + s * (x A^T) B^T``:

    s = lora_alpha / r            (LoRA, Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models")
    s = lora_alpha / sqrt(r)      (rsLoRA, Kalajdzievski 2023, "A Rank Stabilization Scaling Factor for
                                   Fine-Tuning with LoRA"; ``use_rslora: true``)

with ``r`` and ``lora_alpha`` taken per module after ``rank_pattern`` / ``alpha_pattern``.

Which modules an adapter targets follows PEFT's rules, applied to the HF module names of the base model
(``model.layers.3.self_attn.q_proj``):

- ``target_modules`` as a list: an entry matches a module whose full name equals it or ends with
  ``"." + entry``; ``layers_to_transform`` (int or list, with optional ``layers_pattern``) then keeps only the
  listed layers (not for an entry that equals the full name). ``"all-linear"`` means the seven projections.
- ``target_modules`` as a string: a regex matched with ``re.fullmatch`` against the full module name.
- ``exclude_modules`` (list: exact name or suffix; string: ``re.fullmatch``) removes modules.
- ``rank_pattern`` / ``alpha_pattern``: the first key ``k`` (in the file's order) with
  ``re.match(rf"(.*\\.)?({k})$", module_name)`` gives the module's rank / alpha; else ``r`` / ``lora_alpha``.
  PEFT writes ``adapter_config.json`` with sorted keys, so when patterns overlap the file's order may differ
  from the one used in training; the tensor shapes then disagree and loading fails with a note saying so.

Everything this runtime cannot serve exactly is refused with :class:`AdapterError`, never ignored: DoRA and
other LoRA variants, ``modules_to_save``, ``fan_in_fan_out``, bias training, targets other than the seven
Llama projections, initialisations that expect a modified base model (PiSSA, OLoRA, CorDA, LoRA-GA, LoftQ),
and any tensor that does not fit the base model. Loading is all-or-nothing and touches no global state.
"""

from __future__ import annotations

import json
import math
import os
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Protocol

import torch

from multilora.config import MODULE_INDEX, MODULE_PARENT, TARGET_MODULES, ModelConfig

__all__ = [
    "AdapterError",
    "LoRAAdapter",
    "LoRAModuleWeights",
    "load_peft_adapter",
    "load_peft_adapter_into",
    "ModuleSink",
    "save_peft_adapter",
    "CONFIG_NAME",
    "SAFETENSORS_NAME",
    "PICKLE_NAME",
]

CONFIG_NAME = "adapter_config.json"
SAFETENSORS_NAME = "adapter_model.safetensors"
PICKLE_NAME = "adapter_model.bin"

#: Prefix PEFT puts in front of the base model's module names in ``adapter_model.safetensors``.
_PEFT_PREFIX = "base_model.model."
#: ``target_modules`` shorthand PEFT expands to every linear layer but the output head.
_ALL_LINEAR = "all-linear"
#: Non-projection modules a user may mean to target that this runtime cannot serve yet.
_NOT_YET = ("embed_tokens", "lm_head")


class AdapterError(ValueError):
    """An adapter could not be loaded. The message names the file, the key (config field or tensor
    name), what was expected and what was found.

    Attributes:
        path: the file or directory at fault, or None.
        key: the ``adapter_config.json`` field or tensor key at fault, or None.
    """

    def __init__(self, message: str, *, path: str | os.PathLike | None = None, key: str | None = None) -> None:
        super().__init__(message)
        self.path: str | None = None if path is None else str(path)
        self.key: str | None = key


@dataclass(frozen=True)
class LoRAModuleWeights:
    """The LoRA weights of one (layer, module).

    Attributes:
        a: PEFT's ``lora_A.weight``, shape ``[r, in_features]``, float32, CPU, contiguous.
        b: PEFT's ``lora_B.weight``, shape ``[out_features, r]``, float32, CPU, contiguous.
        scaling: the factor applied to ``(x A^T) B^T``: ``lora_alpha / r`` (LoRA paper), or
            ``lora_alpha / sqrt(r)`` with ``use_rslora`` (rsLoRA, Kalajdzievski 2023), with this module's
            ``r`` and ``lora_alpha`` after ``rank_pattern`` / ``alpha_pattern``. Never folded into ``b``.
    """

    a: torch.Tensor
    b: torch.Tensor
    scaling: float

    @property
    def rank(self) -> int:
        """The module's rank ``r`` (rows of ``a``)."""
        return int(self.a.shape[0])


@dataclass
class LoRAAdapter:
    """A loaded, validated PEFT LoRA adapter.

    Attributes:
        name: the name the caller gave it (None if none was given).
        path: the directory it was loaded from.
        config: the raw ``adapter_config.json`` dict.
        modules: ``(layer, module) -> LoRAModuleWeights`` for every targeted projection, ``module`` one of
            ``TARGET_MODULES``; ordered by layer, then ``TARGET_MODULES`` order.
    """

    name: str | None
    path: str
    config: dict = field(repr=False)
    modules: dict[tuple[int, str], LoRAModuleWeights] = field(repr=False)

    @property
    def max_rank(self) -> int:
        """The largest rank over the modules (0 if there are none)."""
        return max((w.rank for w in self.modules.values()), default=0)

    @property
    def nbytes(self) -> int:
        """Bytes of all ``a`` and ``b`` tensors."""
        return sum(w.a.numel() * w.a.element_size() + w.b.numel() * w.b.element_size() for w in self.modules.values())

    def target_summary(self) -> str:
        """One line for logs, e.g. ``"r=8 alpha=16 on q_proj,v_proj x 30 layers"``.

        Ranks and alphas that vary over modules (``rank_pattern`` / ``alpha_pattern``) are shown as
        ``min..max``; ``rslora`` is appended for rsLoRA scaling.
        """
        if not self.modules:
            return "no modules"
        ranks = sorted({w.rank for w in self.modules.values()})
        rslora = bool(self.config.get("use_rslora", False))
        # alpha = scaling * r (or * sqrt(r)); rounded so float noise does not show up as a range
        alphas = sorted(
            {float(f"{w.scaling * (math.sqrt(w.rank) if rslora else w.rank):.6g}") for w in self.modules.values()}
        )

        def span(vals: list[float]) -> str:
            fmt = [f"{v:g}" for v in (vals[0], vals[-1])]
            return fmt[0] if len(vals) == 1 else f"{fmt[0]}..{fmt[1]}"

        mods = [m for m in TARGET_MODULES if any(mm == m for _, mm in self.modules)]
        layers = {layer for layer, _ in self.modules}
        text = f"r={span(ranks)} alpha={span(alphas)} on {','.join(mods)} x {len(layers)} layer"
        text += "" if len(layers) == 1 else "s"
        return text + (" rslora" if rslora else "")


# --------------------------------------------------------------------------------------------- config


@dataclass(frozen=True)
class _Spec:
    """The parts of ``adapter_config.json`` that decide targets, ranks and scalings."""

    r: int
    lora_alpha: float
    use_rslora: bool
    target_modules: tuple[str, ...] | str
    exclude_modules: tuple[str, ...] | str | None
    rank_pattern: dict[str, int]
    alpha_pattern: dict[str, float]
    layers_to_transform: int | tuple[int, ...] | None
    layers_pattern: tuple[str, ...] | None


def _jd(value: Any) -> str:
    """A config value as JSON text, for messages."""
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _read_config(cfg_path: Path) -> dict:
    try:
        text = cfg_path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise AdapterError(f"{cfg_path}: cannot read the adapter config: {e}", path=cfg_path) from e
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise AdapterError(
            f"{cfg_path}: malformed JSON at line {e.lineno} column {e.colno} (char {e.pos}): {e.msg}",
            path=cfg_path,
        ) from e
    if not isinstance(raw, dict):
        raise AdapterError(
            f"{cfg_path}: expected a JSON object (the PEFT LoraConfig), got {type(raw).__name__}", path=cfg_path
        )
    return raw


def _check_regex(pattern: str, cfg_path: Path, key: str, wrap: bool = False) -> None:
    try:
        re.compile(rf"(.*\.)?({pattern})$" if wrap else pattern)
    except re.error as e:
        raise AdapterError(
            f"{cfg_path}: {key}: {pattern!r} is not a valid regular expression ({e})", path=cfg_path, key=key
        ) from e


def _str_or_list(raw: dict, key: str, cfg_path: Path, *, allow_none: bool) -> tuple[str, ...] | str | None:
    v = raw.get(key)
    if v is None:
        if allow_none:
            return None
        got = "null" if key in raw else "nothing (the field is missing)"
        raise AdapterError(
            f"{cfg_path}: {key}: expected a list of module names or a regex string, got {got}",
            path=cfg_path,
            key=key,
        )
    if isinstance(v, str):
        return v
    if isinstance(v, list) and all(isinstance(x, str) for x in v):
        return tuple(dict.fromkeys(v))
    raise AdapterError(
        f"{cfg_path}: {key}: expected a list of strings or a string, got {_jd(v)}", path=cfg_path, key=key
    )


#: Config fields that switch on something this runtime cannot serve: (field, off values, expected, why).
#: "off values" == () means any falsy value (null, false, [], {}) is off.
_FLAG = (None, False)
_UNSUPPORTED: tuple[tuple[str, tuple, str, str], ...] = (
    ("use_dora", _FLAG, "false", "DoRA (weight-decomposed LoRA) is not supported"),
    ("fan_in_fan_out", _FLAG, "false", "transposed (Conv1D-style) weights are not supported; Llama projections "
     "are nn.Linear"),
    ("bias", (None, "none"), '"none"', "training biases changes the base model's biases, which is not supported"),
    ("lora_bias", _FLAG, "false", "a bias on lora_B is not supported"),
    ("modules_to_save", (), "null or []", "fully fine-tuned extra modules (modules_to_save) are not supported"),
    ("target_parameters", (), "null or []", "LoRA on raw parameters (target_parameters) is not supported"),
    ("trainable_token_indices", (), "null", "trained embedding rows (trainable_token_indices) are not supported"),
    ("layer_replication", (), "null", "a model with replicated layers (layer_replication) is not supported"),
    ("use_qalora", _FLAG, "false", "QALoRA is not supported"),
    ("alora_invocation_tokens", (), "null", "activated LoRA (alora_invocation_tokens) is not supported"),
    ("velora_config", (), "null", "the VeLoRA variant is not supported"),
    ("monteclora_config", (), "null", "the MonteCLoRA variant is not supported"),
    ("use_bdlora", (), "null", "block-diagonal LoRA (use_bdlora) is not supported"),
    ("arrow_config", (), "null", "Arrow routing is not supported"),
    ("kasa_config", (), "null", "the KaSA variant is not supported"),
)

#: ``init_lora_weights`` values whose adapters only work on a base model they modified at init.
_MUTATING_INITS = ("pissa", "olora", "corda", "lora_ga", "loftq")


def _parse_config(raw: dict, cfg_path: Path) -> _Spec:
    """Validate the LoraConfig dict and extract what loading needs. Raises AdapterError."""

    def fail(key: str, msg: str) -> AdapterError:
        return AdapterError(f"{cfg_path}: {key}: {msg}", path=cfg_path, key=key)

    pt = raw.get("peft_type")
    if pt is not None and pt != "LORA":
        raise fail("peft_type", f"expected \"LORA\", got {_jd(pt)} (only LoRA adapters are supported)")
    for key, off, expected, why in _UNSUPPORTED:
        v = raw.get(key)
        if not (any(v is o or v == o and type(v) is type(o) for o in off) if off else not v):
            raise fail(key, f"expected {expected}, got {_jd(v)}: {why}")
    init = raw.get("init_lora_weights")
    if isinstance(init, str) and init.lower().startswith(_MUTATING_INITS):
        raise fail(
            "init_lora_weights",
            f"got {_jd(init)}: this initialisation modifies the base weights, so the adapter only works on that "
            "modified base model; expected true (convert it with PEFT's save_pretrained("
            "path_initial_model_for_weight_conversion=...) first)",
        )

    for key in ("r", "lora_alpha"):
        if key not in raw:
            raise fail(key, "missing (a PEFT LoraConfig always has it)")
    r = raw["r"]
    if not _is_int(r) or r <= 0:
        raise fail("r", f"expected a positive integer rank, got {_jd(r)}")
    alpha = raw["lora_alpha"]
    if not _is_number(alpha) or not math.isfinite(alpha):
        raise fail("lora_alpha", f"expected a finite number, got {_jd(alpha)}")
    rslora = raw.get("use_rslora", False)
    if rslora is None:
        rslora = False
    if not isinstance(rslora, bool):
        raise fail("use_rslora", f"expected true or false, got {_jd(rslora)}")

    target = _str_or_list(raw, "target_modules", cfg_path, allow_none=False)
    assert target is not None
    if isinstance(target, str):
        if target.lower() == _ALL_LINEAR:
            target = TARGET_MODULES
        else:
            _check_regex(target, cfg_path, "target_modules")
    exclude = _str_or_list(raw, "exclude_modules", cfg_path, allow_none=True)
    if isinstance(exclude, str):
        _check_regex(exclude, cfg_path, "exclude_modules")

    patterns: dict[str, dict] = {}
    for key, ok, what in (
        ("rank_pattern", lambda v: _is_int(v) and v > 0, "a positive integer rank"),
        ("alpha_pattern", lambda v: _is_number(v) and math.isfinite(v), "a finite number"),
    ):
        pat = raw.get(key) or {}
        if not isinstance(pat, dict):
            raise fail(key, f"expected an object {{pattern: value}}, got {_jd(pat)}")
        for k, v in pat.items():
            _check_regex(k, cfg_path, key, wrap=True)
            if not ok(v):
                raise fail(key, f"value for {k!r}: expected {what}, got {_jd(v)}")
        patterns[key] = dict(pat)

    ltt = raw.get("layers_to_transform")
    if ltt is not None:
        if _is_int(ltt):
            pass
        elif isinstance(ltt, list) and all(_is_int(x) for x in ltt):
            ltt = tuple(ltt)
        else:
            raise fail("layers_to_transform", f"expected an integer or a list of integers, got {_jd(ltt)}")
    lpat = raw.get("layers_pattern")
    if lpat is not None:
        if isinstance(lpat, str):
            lpat = (lpat,)
        elif isinstance(lpat, list) and all(isinstance(x, str) for x in lpat):
            lpat = tuple(lpat)
        else:
            raise fail("layers_pattern", f"expected a string or a list of strings, got {_jd(lpat)}")
    if isinstance(target, str) and (ltt is not None or lpat is not None):
        key = "layers_to_transform" if ltt is not None else "layers_pattern"
        raise fail(key, f"cannot be used when target_modules is a regex string (got {_jd(raw[key])} with "
                   f"target_modules {_jd(raw['target_modules'])}); PEFT refuses this combination too")

    return _Spec(
        r=r,
        lora_alpha=alpha,
        use_rslora=rslora,
        target_modules=target,
        exclude_modules=exclude,
        rank_pattern=patterns["rank_pattern"],
        alpha_pattern=patterns["alpha_pattern"],
        layers_to_transform=ltt,
        layers_pattern=lpat,
    )


# --------------------------------------------------------------------------------------------- targets


def _llama_module_names(config: ModelConfig) -> list[tuple[str, tuple[int, str] | None]]:
    """Every module name of a HF ``LlamaForCausalLM`` (as ``named_modules`` lists them), each with its
    ``(layer, module)`` if it is one of the seven projections, else None."""
    names: list[tuple[str, tuple[int, str] | None]] = [
        ("", None), ("model", None), ("model.embed_tokens", None), ("model.layers", None),
    ]
    for layer in range(config.num_layers):
        p = f"model.layers.{layer}"
        names += [(p, None), (f"{p}.self_attn", None)]
        attn = [m for m in TARGET_MODULES if MODULE_PARENT[m] == "self_attn"]
        mlp = [m for m in TARGET_MODULES if MODULE_PARENT[m] == "mlp"]
        names += [(config.hf_module_name(layer, m), (layer, m)) for m in attn]
        names.append((f"{p}.mlp", None))
        names += [(config.hf_module_name(layer, m), (layer, m)) for m in mlp]
        names += [(f"{p}.mlp.act_fn", None), (f"{p}.input_layernorm", None), (f"{p}.post_attention_layernorm", None)]
    names += [("model.norm", None), ("model.rotary_emb", None), ("lm_head", None)]
    return names


def _suffix_match(entry: str, name: str) -> bool:
    return name == entry or name.endswith("." + entry)


def _excluded(spec: _Spec, name: str) -> bool:
    ex = spec.exclude_modules
    if not ex:
        return False
    if isinstance(ex, str):
        return re.fullmatch(ex, name) is not None
    return any(_suffix_match(e, name) for e in ex)


def _layer_selected(spec: _Spec, name: str) -> bool:
    """PEFT's ``layers_to_transform`` / ``layers_pattern`` rule for a module name."""
    ltt = spec.layers_to_transform
    if ltt is None or (isinstance(ltt, tuple) and len(ltt) == 0):
        return True
    if not spec.layers_pattern:
        m = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", name)  # first numbered segment: the layer index
    else:
        m = None
        for pat in spec.layers_pattern:
            m = re.match(rf"(?:^|.*?\.){pat}\.(?P<idx>\d+)\.", name)
            if m is not None:
                break
    if m is None:
        return False
    idx = int(m.group("idx"))
    return idx == ltt if isinstance(ltt, int) else idx in ltt


def _is_targeted(spec: _Spec, name: str) -> bool:
    """Whether PEFT would put a LoRA layer on the module ``name``."""
    if _excluded(spec, name):
        return False
    tm = spec.target_modules
    if isinstance(tm, str):
        return re.fullmatch(tm, name) is not None
    if name in tm:
        return True  # a full module name: PEFT skips the layer filter for it
    return any(name.endswith("." + t) for t in tm) and _layer_selected(spec, name)


def _pattern_value(pattern: Mapping[str, Any], name: str, default: Any) -> tuple[Any, str | None]:
    """PEFT's ``rank_pattern`` / ``alpha_pattern`` lookup: the first key (dict order) that matches."""
    for k, v in pattern.items():
        if re.match(rf"(.*\.)?({k})$", name):
            return v, k
    return default, None


@dataclass(frozen=True)
class _Target:
    name: str  # HF module name
    r: int
    alpha: float
    r_source: str  # for messages: where r came from

    def scaling(self, rslora: bool) -> float:
        return self.alpha / math.sqrt(self.r) if rslora else self.alpha / self.r


def _resolve_targets(spec: _Spec, config: ModelConfig, cfg_path: Path) -> dict[tuple[int, str], _Target]:
    """The (layer, module) pairs the config targets on this model, with each one's r and alpha."""
    names = _llama_module_names(config)

    def reject(key: str, what: str, hits: list[str]) -> AdapterError:
        shown = ", ".join(hits[:4]) + (", ..." if len(hits) > 4 else "")
        later = [n for n in hits if n.rsplit(".", 1)[-1] in _NOT_YET]
        why = (
            "LoRA on embed_tokens / lm_head is not supported yet"
            if later
            else "only the seven Llama projections can carry LoRA here"
        )
        return AdapterError(
            f"{cfg_path}: target_modules: {what} matches {shown}, which is not one of "
            f"{', '.join(TARGET_MODULES)}: {why}",
            path=cfg_path,
            key=key,
        )

    tm = spec.target_modules
    if isinstance(tm, str):
        hits = [n for n, proj in names if proj is None and _is_targeted(spec, n)]
        if hits:
            raise reject("target_modules", f"the regex {tm!r}", hits)
    else:
        for entry in tm:
            all_hits = [(n, proj) for n, proj in names if _suffix_match(entry, n)]
            if not all_hits:
                raise AdapterError(
                    f"{cfg_path}: target_modules: {entry!r} matches no module of this Llama model "
                    f"({config.num_layers} layers); expected one of {', '.join(TARGET_MODULES)} "
                    "(or a suffix of a module name such as self_attn.q_proj)",
                    path=cfg_path,
                    key="target_modules",
                )
            bad = [n for n, proj in all_hits if proj is None and not _excluded(spec, n)]
            if bad:
                raise reject("target_modules", f"the entry {entry!r}", bad)

    targets: dict[tuple[int, str], _Target] = {}
    for n, proj in names:
        if proj is None or not _is_targeted(spec, n):
            continue
        r, rkey = _pattern_value(spec.rank_pattern, n, spec.r)
        alpha, _ = _pattern_value(spec.alpha_pattern, n, spec.lora_alpha)
        src = f"rank_pattern[{rkey!r}]" if rkey is not None else "r"
        targets[proj] = _Target(name=n, r=r, alpha=alpha, r_source=src)
    if not targets:
        detail = f"target_modules {_jd(tm if isinstance(tm, str) else list(tm))}"
        if spec.layers_to_transform is not None:
            lt = spec.layers_to_transform
            detail += f", layers_to_transform {_jd(lt if isinstance(lt, int) else list(lt))}"
        if spec.layers_pattern is not None:
            detail += f", layers_pattern {_jd(list(spec.layers_pattern))}"
        if spec.exclude_modules:
            ex = spec.exclude_modules
            detail += f", exclude_modules {_jd(ex if isinstance(ex, str) else list(ex))}"
        raise AdapterError(
            f"{cfg_path}: the adapter targets no module of this model ({config.num_layers} layers) with {detail}; "
            "expected at least one Llama projection (serving it would silently give base-model output)",
            path=cfg_path,
            key="target_modules",
        )
    return targets


# --------------------------------------------------------------------------------------------- tensors

_KEY_RE = re.compile(
    r"^(?:base_model\.model\.)?model\.layers\.(?P<layer>\d+)\.(?P<parent>[^.]+)\.(?P<module>[^.]+)"
    r"\.(?P<kind>lora_A|lora_B)(?:\.(?P<adapter>[^.]+))?\.weight$"
)


def _parse_key(key: str, config: ModelConfig, wpath: Path) -> tuple[int, str, str]:
    """``(layer, module, "A" | "B")`` of a tensor key, or AdapterError saying why it does not map."""

    def fail(why: str) -> AdapterError:
        return AdapterError(f"{wpath}: tensor {key!r}: {why}", path=wpath, key=key)

    m = _KEY_RE.match(key)
    if m is None:
        parts = key.split(".")
        expected = ("expected keys like 'base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight' "
                    "(lora_A / lora_B of a Llama projection)")
        for special, why in (
            ("lora_embedding_A", "unsupported tensor lora_embedding_A (LoRA on an embedding): not supported yet"),
            ("lora_embedding_B", "unsupported tensor lora_embedding_B (LoRA on an embedding): not supported yet"),
            ("lora_magnitude_vector", "unsupported tensor lora_magnitude_vector (DoRA): DoRA is not supported"),
            ("modules_to_save", "unsupported tensor of modules_to_save (a fully trained module): not supported"),
        ):
            if special in parts:
                raise fail(why)
        if "lora_B" in parts and parts[-1] == "bias":
            raise fail("unsupported tensor lora_B.bias (lora_bias): not supported")
        for mod in _NOT_YET:
            if mod in parts:
                raise fail(f"LoRA on {mod} is not supported yet; {expected}")
        other = [p for p in parts if p.startswith("lora_") and p not in ("lora_A", "lora_B")]
        if other:
            raise fail(f"unsupported tensor {other[0]} (a LoRA variant this runtime cannot serve); {expected}")
        raise fail(f"does not name a LoRA weight of a decoder-layer projection; {expected}")
    layer, parent, module = int(m["layer"]), m["parent"], m["module"]
    if m["adapter"] not in (None, "default"):
        raise fail(f"unexpected adapter-name segment {m['adapter']!r}; expected none or 'default'")
    if module not in MODULE_INDEX:
        raise fail(f"unknown module {module!r}; expected one of {', '.join(TARGET_MODULES)}")
    if parent != MODULE_PARENT[module]:
        raise fail(f"{module} sits under {MODULE_PARENT[module]!r} in a Llama layer, got {parent!r}")
    if layer >= config.num_layers:
        n = config.num_layers
        raise fail(f"layer {layer} out of range: the base model has {n} layers (0..{n - 1})")
    return layer, module, m["kind"][-1]


#: safetensors header dtype names (https://github.com/huggingface/safetensors, format spec) -> torch dtypes
_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "BOOL": torch.bool}

class _LazyTensors(Mapping):
    """``key -> tensor`` of an open safetensors file, each tensor read (``safe_open.get_tensor``) when first
    asked for, so the fast path validates, checks and packs one tensor while it is still in cache instead of
    holding every tensor of the file first. ``close()`` releases the safetensors handle."""

    def __init__(self, handle: Any, path: Path, keys: list[str]) -> None:
        self._f, self._path, self._keys = handle, path, keys
        self._keyset = set(keys)

    def __getitem__(self, key: str) -> torch.Tensor:
        if key not in self._keyset:
            raise KeyError(key)
        try:
            return self._f.get_tensor(key)
        except Exception as e:  # I/O errors surface here instead of in _read_weights
            raise AdapterError(f"{self._path}: cannot read the safetensors file: {e}", path=self._path) from e

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def close(self) -> None:
        self._f.__exit__(None, None, None)


def _read_weights(root: Path, allow_pickle: bool, header_only: bool = False,
                  lazy: bool = False) -> tuple[Path, Mapping[str, torch.Tensor], list[str]]:
    """Read the weight file: ``(path, key -> tensor, keys in file order)``. Keys are validated by the caller
    before tensors are used; safetensors keys are listed before any tensor is read. With ``header_only``
    a safetensors file gives ``meta``-device tensors of the header's shapes and dtypes (no data is read).
    With ``lazy`` a safetensors file gives a :class:`_LazyTensors` (the caller closes it); a pickle file is
    read whole either way."""
    st = root / SAFETENSORS_NAME
    pk = root / PICKLE_NAME
    if st.is_file():
        try:
            from safetensors import safe_open

            if lazy:
                f = safe_open(str(st), framework="pt", device="cpu")
                keys = list(f.keys())
                return st, _LazyTensors(f, st, keys), keys
            with safe_open(str(st), framework="pt", device="cpu") as f:
                keys = list(f.keys())
                if header_only:
                    out = {}
                    for k in keys:
                        sl = f.get_slice(k)
                        out[k] = torch.empty(sl.get_shape(), dtype=_ST_DTYPES.get(sl.get_dtype(), torch.uint8), device="meta")
                    return st, out, keys
                return st, {k: f.get_tensor(k) for k in keys}, keys
        except Exception as e:  # safetensors raises its own error types for corrupt headers
            raise AdapterError(f"{st}: cannot read the safetensors file: {e}", path=st) from e
    if pk.is_file():
        if not allow_pickle:
            raise AdapterError(
                f"{pk}: only a pickle weight file was found (no {SAFETENSORS_NAME}); a pickle can run arbitrary "
                "code when loaded, so it is refused by default. If you trust it, pass allow_pickle=True (it is "
                f"then read with torch.load(weights_only=True)), or convert it to {SAFETENSORS_NAME} "
                "(e.g. safetensors.torch.save_file(torch.load(path, weights_only=True), ...))",
                path=pk,
            )
        try:
            obj = torch.load(pk, weights_only=True, map_location="cpu")
        except Exception as e:
            raise AdapterError(f"{pk}: cannot load with torch.load(weights_only=True): {e}", path=pk) from e
        if not isinstance(obj, dict) or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in obj.items()
        ):
            raise AdapterError(
                f"{pk}: expected a dict of tensor name -> tensor, got {type(obj).__name__}"
                + (" with non-tensor values" if isinstance(obj, dict) else ""),
                path=pk,
            )
        return pk, dict(obj), list(obj)
    raise AdapterError(
        f"{root}: no adapter weights: expected {SAFETENSORS_NAME} (or {PICKLE_NAME}) in the directory, found neither",
        path=root,
    )


def _fmt_shape(shape: Any) -> str:
    return "[" + ", ".join(str(int(s)) for s in shape) + "]"


def _overlap_hint(pattern: Mapping[str, Any], name: str) -> str:
    """A note for rank errors when several ``rank_pattern`` keys match one module: the first in file order
    wins, and PEFT writes ``adapter_config.json`` with sorted keys, so the order can differ from training."""
    hits = [k for k in pattern if re.match(rf"(.*\.)?({k})$", name)]
    if len(hits) < 2:
        return ""
    return (
        f"; note: rank_pattern keys {hits} all match {name} and the first one in the file wins; PEFT saves "
        "the config with sorted keys, so overlapping patterns may resolve differently than during training"
    )


#: File dtypes whose values float32 holds exactly: converting them straight to the pool dtype rounds once,
#: exactly as the float32 copy then the pool dtype did. Others (float64, ...) still go through float32 first.
_EXACT_IN_F32 = (torch.float32, torch.bfloat16, torch.float16)


def _all_finite(x: torch.Tensor) -> bool:
    """Whether every value of a floating-point tensor is finite, in one reduction pass without temporaries.

    ``aminmax`` propagates NaN, and a +inf / -inf is the max / min, so both ends are finite exactly when
    every value is. On CPU this is ~10x faster than ``torch.isfinite(x).all()`` (which builds two boolean
    tensors); it was most of the cost of loading an adapter."""
    if x.numel() == 0:
        return True
    lo, hi = torch.aminmax(x)
    return math.isfinite(float(lo)) and math.isfinite(float(hi))


class ModuleSink(Protocol):
    """Where :func:`load_peft_adapter_into` puts each validated module (e.g. ``AdapterPool.packer``)."""

    def put(self, layer: int, module: str, a: torch.Tensor, b: torch.Tensor, scaling: float) -> None: ...


def _build_modules(
    wpath: Path,
    tensors: Mapping[str, torch.Tensor],
    keys: list[str],
    targets: dict[tuple[int, str], _Target],
    config: ModelConfig,
    spec: _Spec,
    cfg_path: Path,
    *,
    native: bool = False,
    open_sink: Callable[[int], ModuleSink | None] | None = None,
) -> tuple[dict[tuple[int, str], LoRAModuleWeights], ModuleSink | None]:
    """Validate the tensors against the targets and build the modules (float32 CPU copies): ``(modules,
    None)``.

    With ``native`` (the fast path) values stay in the file's dtype (float32 for dtypes float32 does not
    hold exactly, as before); once every key is validated, ``open_sink(max rank)`` gives a sink (or None),
    then each module's values are checked and handed to ``sink.put``, and the returned modules hold
    ``meta`` tensors of the file's shapes and dtypes: nothing is kept. Returns ``(modules, sink)``.
    Checks, their order and their messages are the same in both modes."""
    found: dict[tuple[int, str], dict[str, str]] = {}
    for key in keys:
        layer, module, kind = _parse_key(key, config, wpath)
        if (layer, module) not in targets:
            raise AdapterError(
                f"{wpath}: tensor {key!r}: {config.hf_module_name(layer, module)} is not targeted by {cfg_path.name} "
                f"(target_modules / layers_to_transform); expected tensors only for the "
                f"{len(targets)} targeted module(s)",
                path=wpath,
                key=key,
            )
        slot = found.setdefault((layer, module), {})
        if kind in slot:
            raise AdapterError(
                f"{wpath}: tensor {key!r}: duplicate lora_{kind} for {config.hf_module_name(layer, module)} "
                f"(also given as {slot[kind]!r})",
                path=wpath,
                key=key,
            )
        slot[kind] = key

    for (layer, module), t in targets.items():
        kinds = found.get((layer, module), {})
        if not kinds:
            raise AdapterError(
                f"{wpath}: no lora_A / lora_B tensors for {t.name}, which {cfg_path.name} targets; expected "
                f"'{_PEFT_PREFIX}{t.name}.lora_A.weight' and '.lora_B.weight'",
                path=wpath,
                key=f"{_PEFT_PREFIX}{t.name}.lora_A.weight",
            )
        for have, miss in (("A", "B"), ("B", "A")):
            if have in kinds and miss not in kinds:
                raise AdapterError(
                    f"{wpath}: tensor {kinds[have]!r}: lora_{have} of {t.name} has no matching lora_{miss}; "
                    f"expected both lora_A and lora_B, got only lora_{have}",
                    path=wpath,
                    key=kinds[have],
                )

    sink = open_sink(max(t.r for t in targets.values())) if native and open_sink is not None else None
    modules: dict[tuple[int, str], LoRAModuleWeights] = {}
    for (layer, module) in sorted(targets, key=lambda lm: (lm[0], MODULE_INDEX[lm[1]])):
        t = targets[(layer, module)]
        d_in, d_out = config.module_shape(module)
        pair, meta = {}, {}
        for kind, expect, what in (("A", (t.r, d_in), "[r, in_features]"), ("B", (d_out, t.r), "[out_features, r]")):
            key = found[(layer, module)][kind]
            x = tensors[key]
            if tuple(x.shape) != expect:
                raise AdapterError(
                    f"{wpath}: tensor {key!r}: expected shape {_fmt_shape(expect)} ({what} with r={t.r} from "
                    f"{t.r_source} in {cfg_path.name}, in/out features of {module} from the base model), "
                    f"got {_fmt_shape(x.shape)}" + _overlap_hint(spec.rank_pattern, t.name),
                    path=wpath,
                    key=key,
                )
            if not x.is_floating_point():
                raise AdapterError(
                    f"{wpath}: tensor {key!r}: expected a floating-point dtype, got {x.dtype}", path=wpath, key=key
                )
            if x.device.type == "meta":  # header-only validation: values are checked when they are read
                pair[kind] = x
                continue
            if native:  # (no-op calls skipped: this runs for every tensor, hundreds per adapter)
                file_dtype = x.dtype
                if x.requires_grad:
                    x = x.detach()
                if x.device.type != "cpu":
                    x = x.to(device="cpu")
                if file_dtype not in _EXACT_IN_F32:
                    x = x.to(torch.float32)
            else:
                x = x.detach().to(device="cpu", dtype=torch.float32).contiguous()
            if not _all_finite(x):
                bad = int((~torch.isfinite(x)).sum())
                raise AdapterError(
                    f"{wpath}: tensor {key!r}: expected finite values, got {bad} non-finite (NaN/inf) of {x.numel()}",
                    path=wpath,
                    key=key,
                )
            pair[kind] = x
            if native:
                meta[kind] = torch.empty(x.shape, dtype=file_dtype, device="meta")
        scaling = float(t.scaling(spec.use_rslora))
        if native and meta:
            if sink is not None:
                sink.put(layer, module, pair["A"], pair["B"], scaling)
            pair = meta
        modules[(layer, module)] = LoRAModuleWeights(a=pair["A"], b=pair["B"], scaling=scaling)
    return modules, sink


# --------------------------------------------------------------------------------------------- public API


def load_peft_adapter(
    path: str | os.PathLike,
    config: ModelConfig,
    *,
    name: str | None = None,
    allow_pickle: bool = False,
    header_only: bool = False,
) -> LoRAAdapter:
    """Load and validate a PEFT LoRA adapter directory for the base model ``config``.

    Args:
        path: a directory holding ``adapter_config.json`` and ``adapter_model.safetensors``.
        config: the base model; sets the number of layers and each projection's (in, out) features.
        name: stored as ``LoRAAdapter.name``.
        allow_pickle: if the directory has only ``adapter_model.bin`` (a pickle), load it with
            ``torch.load(weights_only=True, map_location="cpu")`` instead of refusing it.
        header_only: validate everything but the values from the config and the safetensors header alone
            (no tensor data is read): the returned modules hold ``meta``-device tensors of the right shapes.
            The non-finite check then happens when the values are read. A pickle file is always read.

    Returns:
        A LoRAAdapter whose ``modules[(layer, module)]`` holds ``a`` [r, in] and ``b`` [out, r] (float32,
        CPU, contiguous, whatever dtype the file had) and ``scaling`` = ``lora_alpha / r`` (LoRA paper, Hu et
        al. 2021) or ``lora_alpha / sqrt(r)`` with ``use_rslora`` (rsLoRA, Kalajdzievski 2023), with ``r`` and
        ``lora_alpha`` per module after ``rank_pattern`` / ``alpha_pattern``.

    Raises:
        AdapterError: missing files or directory; malformed JSON (with its position); a config that is not
            plain LoRA (DoRA or another variant, ``modules_to_save``, ``fan_in_fan_out``, ``bias`` other than
            "none", ``lora_bias``, a base-mutating ``init_lora_weights``, ``peft_type`` other than LORA) or has
            ``r <= 0``; targets other than the seven projections (embed_tokens, lm_head: not supported yet) or
            no targeted module at all; a tensor key that does not map to a targeted (layer, module) lora_A /
            lora_B weight; a shape that does not fit (expected vs got); lora_A without lora_B or the reverse;
            a targeted module without tensors; non-finite or non-float values; a pickle without
            ``allow_pickle``. The message names the file and key.
    """
    root, cfg_path, raw, spec, targets = _read_spec(path, config)
    wpath, tensors, keys = _read_weights(root, allow_pickle, header_only)
    modules, _ = _build_modules(wpath, tensors, keys, targets, config, spec, cfg_path)
    return LoRAAdapter(name=name, path=str(root), config=raw, modules=modules)


def load_peft_adapter_into(
    path: str | os.PathLike,
    config: ModelConfig,
    open_sink: Callable[[int], ModuleSink | None],
    *,
    name: str | None = None,
    allow_pickle: bool = False,
) -> tuple[LoRAAdapter, ModuleSink | None]:
    """:func:`load_peft_adapter`, streaming each module's weights into a sink instead of returning them.

    The engine's disk -> host path (reload and ``load_adapter(preload=True)``) with ``AdapterPool.packer``
    as the sink: tensors stay in the file's dtype (no float32 copies; dtypes that float32 does not hold
    exactly, such as float64, are still rounded to float32 first, so the pool gets bit-identical values),
    are read one at a time, checked (same checks, order and messages as :func:`load_peft_adapter`,
    non-finite values included) and passed to ``sink.put(layer, module, a, b, scaling)`` in layer, then
    ``TARGET_MODULES`` order. ``a`` / ``b`` may be views of file buffers that are dropped afterwards: the sink
    must copy them.

    Args:
        open_sink: called with the adapter's largest rank once the config and every tensor key are validated,
            before any value is read; returns the sink, or None to validate without keeping values.
        path, config, name, allow_pickle: as for :func:`load_peft_adapter`.

    Returns:
        ``(adapter, sink)``: the adapter's modules hold ``meta`` tensors (the file's shapes and dtypes) and
        the scalings; the sink is what ``open_sink`` returned.

    Raises:
        AdapterError: as :func:`load_peft_adapter`. Whatever ``open_sink`` or ``sink.put`` raise.
    """
    root, cfg_path, raw, spec, targets = _read_spec(path, config)
    wpath, tensors, keys = _read_weights(root, allow_pickle, lazy=True)
    try:
        modules, sink = _build_modules(wpath, tensors, keys, targets, config, spec, cfg_path, native=True,
                                       open_sink=open_sink)
    finally:
        if isinstance(tensors, _LazyTensors):
            tensors.close()
    return LoRAAdapter(name=name, path=str(root), config=raw, modules=modules), sink


def _read_spec(path: str | os.PathLike, config: ModelConfig) -> tuple[Path, Path, dict, _Spec, dict[tuple[int, str], _Target]]:
    """The directory checks, the config and the targets: ``(root, config path, raw config, spec, targets)``."""
    root = Path(path)
    if not root.exists():
        raise AdapterError(f"{root}: adapter directory does not exist", path=root)
    if not root.is_dir():
        raise AdapterError(
            f"{root}: expected a directory holding {CONFIG_NAME} and {SAFETENSORS_NAME}, got a file", path=root
        )
    cfg_path = root / CONFIG_NAME
    if not cfg_path.is_file():
        raise AdapterError(f"{cfg_path}: missing: an adapter directory must hold {CONFIG_NAME}", path=cfg_path)
    raw = _read_config(cfg_path)
    spec = _parse_config(raw, cfg_path)
    return root, cfg_path, raw, spec, _resolve_targets(spec, config, cfg_path)


def save_peft_adapter(
    out_dir: str | os.PathLike,
    modules: Mapping[tuple[int, str], tuple[torch.Tensor, torch.Tensor]],
    *,
    r: int,
    lora_alpha: float,
    target_modules: list[str] | str,
    use_rslora: bool = False,
    rank_pattern: dict[str, int] | None = None,
    alpha_pattern: dict[str, float] | None = None,
    layers_to_transform: int | list[int] | None = None,
    base_model_name_or_path: str | None = None,
) -> Path:
    """Write a LoRA adapter in PEFT's format: ``adapter_config.json`` + ``adapter_model.safetensors``.

    ``peft.PeftModel.from_pretrained`` loads the result, and so does :func:`load_peft_adapter`.

    Args:
        out_dir: the directory to write (created if needed; the two files are replaced atomically).
        modules: ``(layer, module) -> (A [r_m, in_features], B [out_features, r_m])``, PEFT's ``lora_A.weight``
            and ``lora_B.weight``; ``module`` in ``TARGET_MODULES``. Tensors are written in their own dtype.
        r, lora_alpha, use_rslora, rank_pattern, alpha_pattern, layers_to_transform, base_model_name_or_path:
            the LoraConfig fields of the same names. ``r_m`` must be the module's rank after ``rank_pattern``.
        target_modules: module names (suffix match) or one regex string, as in PEFT.

    Returns:
        ``Path(out_dir)``.

    Raises:
        ValueError: no modules; an unknown module; a tensor that is not 2-D, whose A and B ranks differ, whose
            rank disagrees with ``r`` / ``rank_pattern``; or a (layer, module) that the config would not target.
    """
    if not modules:
        raise ValueError("save_peft_adapter: modules is empty; an adapter needs at least one (layer, module)")
    if not _is_int(r) or r <= 0:
        raise ValueError(f"save_peft_adapter: r must be a positive int, got {r!r}")
    if isinstance(target_modules, str):
        tm: list[str] | str = target_modules
    else:
        tm = list(dict.fromkeys(target_modules))
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "revision": None,
        "inference_mode": True,
        "r": r,
        "lora_alpha": lora_alpha,
        "lora_dropout": 0.0,
        "target_modules": tm,
        "exclude_modules": None,
        "use_rslora": bool(use_rslora),
        "use_dora": False,
        "fan_in_fan_out": False,
        "bias": "none",
        "lora_bias": False,
        "modules_to_save": None,
        "init_lora_weights": True,
        "rank_pattern": dict(rank_pattern or {}),
        "alpha_pattern": dict(alpha_pattern or {}),
        "layers_to_transform": layers_to_transform,
        "layers_pattern": None,
    }
    # PEFT writes the config with sorted keys, which also reorders rank_pattern / alpha_pattern (first match
    # wins): validate what a reader of the file will see.
    config = json.loads(json.dumps(config, sort_keys=True))
    here = Path(out_dir) / CONFIG_NAME
    try:
        spec = _parse_config(config, here)
    except AdapterError as e:
        raise ValueError(f"save_peft_adapter: {e}") from e

    tensors: dict[str, torch.Tensor] = {}
    for (layer, module), (a, b) in sorted(modules.items(), key=lambda kv: (kv[0][0], MODULE_INDEX.get(kv[0][1], 99))):
        if module not in MODULE_INDEX or not _is_int(layer) or layer < 0:
            raise ValueError(
                f"save_peft_adapter: bad module key {(layer, module)!r}; "
                f"expected (layer >= 0, one of {TARGET_MODULES})"
            )
        name = f"model.layers.{layer}.{MODULE_PARENT[module]}.{module}"
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            raise ValueError(
                f"save_peft_adapter: {name}: expected A [r, in] and B [out, r] with the same r, "
                f"got A {_fmt_shape(a.shape)} and B {_fmt_shape(b.shape)}"
            )
        if not _is_targeted(spec, name):
            raise ValueError(f"save_peft_adapter: {name} is not targeted by target_modules={tm!r} / "
                             f"layers_to_transform={layers_to_transform!r}")
        want, _ = _pattern_value(spec.rank_pattern, name, r)
        if a.shape[0] != want:
            raise ValueError(
                f"save_peft_adapter: {name}: rank from r / rank_pattern is {want}, got {a.shape[0]}"
                + _overlap_hint(spec.rank_pattern, name)
            )
        tensors[f"{_PEFT_PREFIX}{name}.lora_A.weight"] = a.detach().to("cpu").contiguous().clone()
        tensors[f"{_PEFT_PREFIX}{name}.lora_B.weight"] = b.detach().to("cpu").contiguous().clone()

    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    def atomic(dest: Path, write) -> None:
        fd, tmp = tempfile.mkstemp(dir=out, prefix=f".{dest.name}.", suffix=".tmp")
        os.close(fd)
        try:
            write(tmp)
            os.replace(tmp, dest)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise

    atomic(out / SAFETENSORS_NAME, lambda p: save_file(tensors, p, metadata={"format": "pt"}))

    def write_json(p: str) -> None:
        with open(p, "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2, sort_keys=True)
            f.write("\n")

    atomic(out / CONFIG_NAME, write_json)
    return out
