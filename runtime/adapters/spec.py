"""adapter_config.json: parsing it, validating it, and the table of PEFT features this runtime refuses.

:class:`AdapterError` (every loading error) and the message helpers live here too: every other module of
the package imports this one, and it imports none of them.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from multilora.config import TARGET_MODULES

CONFIG_NAME = "adapter_config.json"

#: ``target_modules`` shorthand PEFT expands to every linear layer but the output head.
_ALL_LINEAR = "all-linear"


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
    all_linear: bool = False  # target_modules "all-linear": every projection of the family (config.lora_modules)
    fan_in_fan_out: bool = False  # true: PEFT turns it off for nn.Linear (every served projection), with a warning


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


#: the largest float32: a lora_alpha beyond it makes a scaling the pool's float32 tables cannot hold
_F32_MAX = 3.4028234663852886e38


def _is_alpha(v: Any) -> bool:
    return _is_number(v) and abs(v) <= _F32_MAX  # (False for NaN and inf; no float() of a 400-digit int)


def _config_json(data: bytes, cfg_path: Path) -> dict:
    """``adapter_config.json``'s bytes as a dict. Raises AdapterError: not UTF-8, malformed (or absurdly deeply
    nested) JSON, not an object."""
    try:
        raw = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise AdapterError(f"{cfg_path}: cannot read the adapter config: {e}", path=cfg_path) from e
    except json.JSONDecodeError as e:
        raise AdapterError(
            f"{cfg_path}: malformed JSON at line {e.lineno} column {e.colno} (char {e.pos}): {e.msg}",
            path=cfg_path,
        ) from e
    except (ValueError, RecursionError) as e:  # e.g. an integer of over 4300 digits; nesting past the stack
        raise AdapterError(f"{cfg_path}: malformed JSON: {str(e) or 'nested too deeply to parse'}"[:300],
                           path=cfg_path) from e
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
        hint = (" (PEFT fills in its default for the model type when it builds the model, q_proj and v_proj for "
                "Llama and Qwen, and saves that list: write the modules the adapter was trained on)"
                if key == "target_modules" else "")
        raise AdapterError(
            f"{cfg_path}: {key}: expected a list of module names or a regex string, got {got}{hint}",
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
    fifo = raw.get("fan_in_fan_out")
    if fifo is not None and not isinstance(fifo, bool):
        raise fail("fan_in_fan_out", f"expected true or false, got {_jd(fifo)}")
    bias = raw.get("bias")  # "all" / "lora_only": plain LoRA unless the file holds a bias (_parse_key refuses it)
    if bias not in (None, "none", "all", "lora_only"):
        raise fail("bias", f'expected "none", "all" or "lora_only", got {_jd(bias)}')
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
    if not _is_alpha(alpha):
        raise fail("lora_alpha", f"expected a finite number (a float32: |lora_alpha| <= {_F32_MAX:.4g}), "
                   f"got {_jd(alpha)}")
    rslora = raw.get("use_rslora", False)
    if rslora is None:
        rslora = False
    if not isinstance(rslora, bool):
        raise fail("use_rslora", f"expected true or false, got {_jd(rslora)}")

    target = _str_or_list(raw, "target_modules", cfg_path, allow_none=False)
    assert target is not None
    all_linear = False
    if isinstance(target, str):
        all_linear = target.lower() == _ALL_LINEAR
        if all_linear:
            target = TARGET_MODULES
        else:
            _check_regex(target, cfg_path, "target_modules")
    exclude = _str_or_list(raw, "exclude_modules", cfg_path, allow_none=True)
    if isinstance(exclude, str):
        _check_regex(exclude, cfg_path, "exclude_modules")

    patterns: dict[str, dict] = {}
    for key, ok, what in (
        ("rank_pattern", lambda v: _is_int(v) and v > 0, "a positive integer rank"),
        ("alpha_pattern", _is_alpha, f"a finite number (a float32: |alpha| <= {_F32_MAX:.4g})"),
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
        all_linear=all_linear,
        fan_in_fan_out=bool(fifo),
    )


def _fmt_shape(shape: Any) -> str:
    return "[" + ", ".join(str(int(s)) for s in shape) + "]"
