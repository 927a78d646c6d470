"""PEFT's target rules: which ``(layer, module)`` of the base model an adapter targets, with which rank
and alpha (``target_modules``, ``exclude_modules``, ``layers_to_transform`` / ``layers_pattern``,
``rank_pattern`` / ``alpha_pattern``), and which ``(layer, module)`` a tensor key names."""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

from multilora.config import MODULE_PARENT, ModelConfig
from multilora.runtime.adapters.spec import AdapterError, _jd, _Spec

log = logging.getLogger("multilora")
#: the keys of what ``_say_once`` has warned of (``_resolve_targets``: (what, config path, ...), so that a reload of a
#: file does not say it again)
_SAID: set[tuple] = set()

#: Prefix PEFT puts in front of the base model's module names in ``adapter_model.safetensors``.
_PEFT_PREFIX = "base_model.model."
#: Non-projection modules a user may mean to target that this runtime cannot serve yet.
_NOT_YET = ("embed_tokens", "lm_head")


def _decoder_module_names(config: ModelConfig) -> list[tuple[str, tuple[int, str] | None]]:
    """Every module name of the HF ``*ForCausalLM`` of ``config``'s family (as ``named_modules`` lists them: Llama,
    Mistral and Qwen2 share the layout, Qwen3 adds ``self_attn.q_norm`` / ``k_norm``, Phi-3 has ``o_proj`` before
    its fused ``qkv_proj``, a fused ``gate_up_proj``, ``activation_fn`` and two residual dropouts, Gemma 2 adds
    ``pre_feedforward_layernorm`` / ``post_feedforward_layernorm``), each with its
    ``(layer, module)`` if it is a projection that may carry LoRA (``module`` one of ``config.lora_modules``:
    Phi-3's fused names stay fused here), else None."""
    names: list[tuple[str, tuple[int, str] | None]] = [
        ("", None), ("model", None), ("model.embed_tokens", None), ("model.layers", None),
    ]
    phi3 = config.fused_projections
    for layer in range(config.num_layers):
        p = f"model.layers.{layer}"
        names += [(p, None), (f"{p}.self_attn", None)]
        attn = [m for m in config.lora_modules if m in ("o_proj", "qkv_proj") or MODULE_PARENT.get(m) == "self_attn"]
        mlp = [m for m in config.lora_modules if m not in attn]
        names += [(config.hf_module_name(layer, m), (layer, m)) for m in attn]
        if config.qk_norm:
            names += [(f"{p}.self_attn.q_norm", None), (f"{p}.self_attn.k_norm", None)]
        names.append((f"{p}.mlp", None))
        names += [(config.hf_module_name(layer, m), (layer, m)) for m in mlp]
        names += [(f"{p}.mlp.{'activation_fn' if phi3 else 'act_fn'}", None), (f"{p}.input_layernorm", None),
                  (f"{p}.post_attention_layernorm", None)]
        if config.block_output_norms:
            names += [(f"{p}.pre_feedforward_layernorm", None), (f"{p}.post_feedforward_layernorm", None)]
        if phi3:
            names += [(f"{p}.resid_attn_dropout", None), (f"{p}.resid_mlp_dropout", None)]
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


@functools.lru_cache(maxsize=1 << 14)
def _key_regex(key: str) -> re.Pattern:
    """A ``rank_pattern`` / ``alpha_pattern`` key as PEFT matches it, compiled once (``re``'s own cache holds 512
    patterns: an adapter with a key per module of an 80-layer model would compile every key for every module)."""
    return re.compile(rf"(.*\.)?({key})$")


def _pattern_hits(pattern: Mapping[str, Any], name: str) -> list[str]:
    """Every ``rank_pattern`` / ``alpha_pattern`` key that matches module ``name``, in the file's order."""
    return [k for k in pattern if _key_regex(k).match(name)]


def _pattern_value(pattern: Mapping[str, Any], name: str, default: Any) -> tuple[Any, str | None]:
    """PEFT's ``rank_pattern`` / ``alpha_pattern`` lookup: the first key (dict order) that matches."""
    for k, v in pattern.items():
        if _key_regex(k).match(name):
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


def _say_once(key: tuple, msg: str, *args: Any) -> None:
    """Log ``msg % args`` as a warning the first time ``key`` comes (once per file and model, not at every reload
    of it; the keys are forgotten past 4,096)."""
    if key in _SAID:
        return
    if len(_SAID) > 4096:
        _SAID.clear()
    _SAID.add(key)
    log.warning(msg, *args)


def _resolve_targets(spec: _Spec, config: ModelConfig, cfg_path: Path) -> dict[tuple[int, str], _Target]:
    """The (layer, module) pairs the config targets on this model, with each one's r and alpha."""
    if spec.fan_in_fan_out:  # PEFT's LoraModel sets it to false for an nn.Linear target, with a warning
        _say_once(("fan_in_fan_out", str(cfg_path)), "%s: fan_in_fan_out is true, but the projections it targets are "
                  "nn.Linear (weights stored [out, in]): taken as false, as PEFT takes it", cfg_path)
    names = _decoder_module_names(config)
    if spec.all_linear:  # PEFT's "all-linear": every linear layer but the output head, in this family's names
        spec = dataclasses.replace(spec, target_modules=config.lora_modules)

    def reject(key: str, what: str, hits: list[str]) -> AdapterError:
        shown = ", ".join(hits[:4]) + (", ..." if len(hits) > 4 else "")
        later = [n for n in hits if n.rsplit(".", 1)[-1] in _NOT_YET]
        why = (
            "LoRA on embed_tokens / lm_head is not supported yet"
            if later
            else f"only the {config.architecture} projections ({', '.join(config.lora_modules)}) can carry LoRA here"
            if config.fused_projections
            else "only the seven Llama projections (q/k/v/o, gate/up/down) can carry LoRA here"
        )
        return AdapterError(
            f"{cfg_path}: target_modules: {what} matches {shown}, which is not one of "
            f"{', '.join(config.lora_modules)}: {why}",
            path=cfg_path,
            key=key,
        )

    tm = spec.target_modules
    unmatched: list[str] = []  # list entries naming no module of this model: PEFT skips them (a config written for
    # several families, q_proj beside query_key_value), and so does this, with a warning (or a typo?)
    if isinstance(tm, str):
        hits = [n for n, proj in names if proj is None and _is_targeted(spec, n)]
        if hits:
            raise reject("target_modules", f"the regex {tm!r}", hits)
    else:
        for entry in tm:
            all_hits = [(n, proj) for n, proj in names if _suffix_match(entry, n)]
            if not all_hits:
                unmatched.append(entry)
                continue
            bad = [n for n, proj in all_hits if proj is None and not _excluded(spec, n)]
            if bad:
                raise reject("target_modules", f"the entry {entry!r}", bad)
    expected = (f"expected one of {', '.join(config.lora_modules)} (or a suffix of a module name such as "
                "self_attn.q_proj)")
    no_match = (f"{', '.join(map(repr, unmatched))} {'matches' if len(unmatched) == 1 else 'match'} no module of this "
                f"{config.architecture} model")

    ltt = spec.layers_to_transform
    if ltt is not None:  # PEFT skips a layer the model does not have, and so does this; said, as it may be a typo
        outside = [i for i in ((ltt,) if isinstance(ltt, int) else ltt) if not 0 <= i < config.num_layers]
        if outside:
            _say_once(("layers", str(cfg_path), tuple(outside), config.num_layers),
                      "%s: layers_to_transform %s names layer(s) %s, which this %s model (layers 0 to %d) does not "
                      "have: ignored, as PEFT does (an adapter for another model, or a typo?)", cfg_path,
                      _jd(ltt if isinstance(ltt, int) else list(ltt)), ", ".join(map(str, outside)),
                      config.architecture, config.num_layers - 1)

    targets: dict[tuple[int, str], _Target] = {}
    alpha_clashes = []  # modules that alpha_pattern keys of different values match (a rank clash shows in shapes)
    alphas_differ = len(set(spec.alpha_pattern.values())) > 1  # (keys of one value cannot clash)
    for n, proj in names:
        if proj is None or not _is_targeted(spec, n):
            continue
        r, rkey = _pattern_value(spec.rank_pattern, n, spec.r)
        alpha, _ = _pattern_value(spec.alpha_pattern, n, spec.lora_alpha)
        src = f"rank_pattern[{rkey!r}]" if rkey is not None else "r"
        targets[proj] = _Target(name=n, r=r, alpha=alpha, r_source=src)
        if alphas_differ:
            hits = _pattern_hits(spec.alpha_pattern, n)
            if len({spec.alpha_pattern[k] for k in hits}) > 1:
                alpha_clashes.append((n, hits))
    if alpha_clashes:
        n, hits = alpha_clashes[0]
        _say_once(("alpha_pattern", str(cfg_path), tuple(hits)),
                  "%s: alpha_pattern keys %s all match %s%s with different alphas; the first in the file's order "
                  "(%s) is used, as PEFT's own reload does, but PEFT saves the config with sorted keys, so this may "
                  "not be the alpha the adapter was trained with (give the patterns disjoint keys)", cfg_path,
                  ", ".join(f"{k!r}: {spec.alpha_pattern[k]}" for k in hits), n,
                  f" (and {len(alpha_clashes) - 1} more module(s))" if len(alpha_clashes) > 1 else "", repr(hits[0]))
    if unmatched and targets:
        _say_once(("target_modules", str(cfg_path), tuple(unmatched), config.architecture),
                  "%s: target_modules: %s: ignored, as PEFT ignores it (%s; a typo?)", cfg_path, no_match, expected)
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
        if unmatched and set(unmatched) == set(tm):  # (no entry matched: name them all)
            why = f"{no_match}: {expected}"
        else:  # an entry matched, and the layer filter or exclude_modules removed what it matched
            why = "expected at least one Llama projection" + (f" ({no_match})" if unmatched else "")
        raise AdapterError(
            f"{cfg_path}: the adapter targets no module of this model ({config.num_layers} layers) with {detail}; "
            f"{why} (serving it would silently give base-model output)",
            path=cfg_path,
            key="target_modules",
        )
    return targets


def _overlap_hint(pattern: Mapping[str, Any], name: str) -> str:
    """A note for rank errors when several ``rank_pattern`` keys match one module: the first in file order
    wins, and PEFT writes ``adapter_config.json`` with sorted keys, so the order can differ from training."""
    hits = _pattern_hits(pattern, name)
    if len(hits) < 2:
        return ""
    return (
        f"; note: rank_pattern keys {hits} all match {name} and the first one in the file wins; PEFT saves "
        "the config with sorted keys, so overlapping patterns may resolve differently than during training"
    )


_KEY_RE = re.compile(
    r"^(?:base_model\.model\.)?model\.layers\.(?P<layer>\d+)\.(?P<parent>[^.]+)\.(?P<module>[^.]+)"
    r"\.(?P<kind>lora_A|lora_B)(?:\.(?P<adapter>[^.]+))?\.weight$"
)


def _parse_key(key: str, config: ModelConfig, wpath: Path, hint: Callable[[], str] | None = None
               ) -> tuple[int, str, str]:
    """``(layer, module, "A" | "B")`` of a tensor key (``module`` one of ``config.lora_modules``), or AdapterError
    saying why it does not map (a layer past the base model's: with ``hint()`` appended, the likely cause)."""

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
        if parts[-1] == "bias":  # PEFT's bias="all" / "lora_only" saves the base model's biases it trained
            raise fail("a trained bias of the base model (PEFT's bias=\"all\" / \"lora_only\"): serving it would "
                       "change the base model's biases, which is not supported; retrain with bias=\"none\"")
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
    if module not in config.lora_modules:
        raise fail(f"unknown module {module!r}; expected one of {', '.join(config.lora_modules)} "
                   f"(the projections of a {config.architecture} layer)")
    want = config.hf_module_name(layer, module).split(".")[-2]
    if parent != want:
        raise fail(f"{module} sits under {want!r} in a {config.architecture} layer, got {parent!r}")
    if layer >= config.num_layers:
        n = config.num_layers
        raise fail(f"layer {layer} out of range: the base model has {n} layers (0..{n - 1})" + (hint() if hint else ""))
    return layer, module, m["kind"][-1]


#: The name ``_decoder_module_names`` had while only Llama-family configs were served.
_llama_module_names = _decoder_module_names
