"""PEFT adapter loading and validation (runtime/adapters/).

The independent reference is peft itself: adapters are made with ``peft.get_peft_model`` on a tiny random
Llama, saved with ``save_pretrained``, and what ``load_peft_adapter`` returns is compared with the weights,
ranks and scalings peft's in-memory LoRA layers hold. Every bad-input case writes a valid adapter, breaks one
thing and checks the error names the file, the key, and what was expected and got.
"""

from __future__ import annotations

import json
import logging
import math
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict  # noqa: E402
from peft.tuners.lora import LoraLayer  # noqa: E402
from peft.tuners.tuners_utils import check_target_module_exists  # noqa: E402
from peft.utils.other import get_pattern_key  # noqa: E402

from multilora.runtime.adapters import (  # noqa: E402
    AdapterError,
    LoRAAdapter,
    LoRAModuleWeights,
    load_peft_adapter,
    save_peft_adapter,
)
from multilora.runtime.adapters.targets import _llama_module_names  # noqa: E402
from multilora.config import MODULE_PARENT, TARGET_MODULES, ModelConfig  # noqa: E402

NUM_LAYERS = 3
ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]


def _hf_config() -> transformers.LlamaConfig:
    return transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )


@pytest.fixture(scope="module")
def hf_config():
    return _hf_config()


@pytest.fixture(scope="module")
def mcfg(hf_config) -> ModelConfig:
    return ModelConfig.from_hf_dict(hf_config.to_dict())


def _base_model(hf_config, dtype=torch.float32):
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(hf_config).to(dtype).eval()


def _peft_adapter(hf_config, out_dir, dtype=torch.float32, **lora_kwargs):
    """Make a peft adapter with random nonzero A and B, save it, return {(layer, module): LoraLayer}."""
    # autocast_adapter_dtype=False keeps the adapter in the base model's dtype (peft upcasts to fp32 otherwise)
    model = get_peft_model(_base_model(hf_config, dtype), LoraConfig(**lora_kwargs), autocast_adapter_dtype=False)
    gen = torch.Generator().manual_seed(1)
    layers = {}
    for name, mod in model.named_modules():
        if isinstance(mod, LoraLayer) and "default" in mod.lora_A:
            with torch.no_grad():
                for w in (mod.lora_A["default"].weight, mod.lora_B["default"].weight):
                    w.copy_(torch.randn(w.shape, generator=gen).to(dtype))
            parts = name.split(".")
            layers[(int(parts[parts.index("layers") + 1]), parts[-1])] = mod
    model.save_pretrained(str(out_dir))
    return layers


def _check_against_peft(adapter: LoRAAdapter, layers: dict):
    assert set(adapter.modules) == set(layers)
    assert len(layers) > 0
    for key, mod in layers.items():
        w = adapter.modules[key]
        ref_a = mod.lora_A["default"].weight.detach().float()
        ref_b = mod.lora_B["default"].weight.detach().float()
        assert w.a.dtype == torch.float32 and w.b.dtype == torch.float32
        assert w.a.device.type == "cpu" and w.a.is_contiguous() and w.b.is_contiguous()
        assert torch.equal(w.a, ref_a), key
        assert torch.equal(w.b, ref_b), key
        assert w.rank == mod.r["default"], key
        assert w.scaling == mod.scaling["default"], (key, w.scaling, mod.scaling["default"])
    assert adapter.max_rank == max(m.r["default"] for m in layers.values())
    assert adapter.nbytes == sum(4 * (w.a.numel() + w.b.numel()) for w in adapter.modules.values())


# ----------------------------------------------------------------------------------------- peft reference

PEFT_CASES = {
    "r2-qv": dict(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"]),
    "r8-all-rslora": dict(r=8, lora_alpha=16, use_rslora=True, target_modules=TARGET_MODULES),
    "r16-regex-attention": dict(r=16, lora_alpha=8, target_modules=r"model\.layers\.\d+\.self_attn\.[qkvo]_proj"),
    "r8-mlp-only": dict(r=8, lora_alpha=32, target_modules=MLP),
    "attention-only-list": dict(r=4, lora_alpha=7, target_modules=ATTN),
    "patterns": dict(
        r=8,
        lora_alpha=16,
        target_modules=TARGET_MODULES,
        rank_pattern={"q_proj": 2, r"model\.layers\.1\.mlp\.down_proj": 16, r"layers\.2\.mlp\..*": 4},
        alpha_pattern={"k_proj": 3, r"layers\.0\..*v_proj": 5},
    ),
    "patterns-rslora": dict(
        r=16, lora_alpha=16, use_rslora=True, target_modules=["q_proj", "up_proj"], rank_pattern={"up_proj": 2},
        alpha_pattern={"q_proj": 64},
    ),
    "layers-list": dict(r=8, lora_alpha=8, target_modules=["q_proj", "down_proj"], layers_to_transform=[0, 2]),
    "layers-int-pattern": dict(
        r=2, lora_alpha=2, target_modules=["v_proj", "gate_proj"], layers_to_transform=1, layers_pattern="layers"
    ),
    "suffix-and-exclude": dict(
        r=8, lora_alpha=16, target_modules=["self_attn.q_proj", "mlp.up_proj"],
        exclude_modules=["model.layers.1.self_attn.q_proj"],
    ),
}


@pytest.mark.parametrize("case", list(PEFT_CASES))
def test_matches_peft(case, hf_config, mcfg, tmp_path):
    layers = _peft_adapter(hf_config, tmp_path, **PEFT_CASES[case])
    adapter = load_peft_adapter(tmp_path, mcfg, name=case)
    _check_against_peft(adapter, layers)
    assert adapter.name == case and adapter.path == str(tmp_path)
    assert adapter.config == json.loads((tmp_path / "adapter_config.json").read_text())


def test_overlapping_rank_patterns_reordered_by_peft_save_are_refused(hf_config, mcfg, tmp_path):
    # peft trains with the dict order {"q_proj": 2, "layers.2...": 4} (q_proj of layer 2 gets rank 2). peft up to
    # 0.21 saved adapter_config.json with sorted keys, so the file resolves layer 2's q_proj to rank 4 and peft itself
    # fails to reload it: we must refuse it too, naming the tensor and the overlap. peft 0.22 keeps the order: then
    # the file means what was trained, and the adapter loads as peft has it.
    layers = _peft_adapter(hf_config, tmp_path, r=8, lora_alpha=8, target_modules=["q_proj"],
                           rank_pattern={"q_proj": 2, r"layers\.2\..*": 4})
    order = list(json.loads((tmp_path / CFG).read_text())["rank_pattern"])
    assert sorted(order) == [r"layers\.2\..*", "q_proj"]
    if order == ["q_proj", r"layers\.2\..*"]:  # kept as trained (peft >= 0.22)
        PeftModel.from_pretrained(_base_model(hf_config), str(tmp_path))  # peft reloads it
        _check_against_peft(load_peft_adapter(tmp_path, mcfg), layers)
        assert all(layers[(i, "q_proj")].r["default"] == 2 for i in range(mcfg.num_layers))
        return
    with pytest.raises(RuntimeError, match="size mismatch"):
        PeftModel.from_pretrained(_base_model(hf_config), str(tmp_path))
    k = _key(2, "q_proj", "A")
    _raises(tmp_path, mcfg, "expected shape [4, 64]", "got [2, 64]", "the first one in the file wins",
            key=k, file=WTS)


def test_bf16_adapter_is_converted_to_float32(hf_config, mcfg, tmp_path):
    layers = _peft_adapter(hf_config, tmp_path, dtype=torch.bfloat16, r=4, lora_alpha=8, target_modules=["o_proj"])
    assert load_file(str(tmp_path / "adapter_model.safetensors"))[
        "base_model.model.model.layers.0.self_attn.o_proj.lora_A.weight"
    ].dtype == torch.bfloat16
    _check_against_peft(load_peft_adapter(tmp_path, mcfg), layers)


def test_module_names_match_hf(hf_config, mcfg):
    model = _base_model(hf_config)
    assert [n for n, _ in _llama_module_names(mcfg)] == [n for n, _ in model.named_modules()]


# Pure-function cross-check of target selection and rank/alpha patterns against peft's own matchers.
_ENTRIES = st.sampled_from(
    TARGET_MODULES + ("self_attn.q_proj", "mlp.down_proj", "model.layers.1.self_attn.k_proj", "layers.2.mlp.up_proj")
)
_PATTERN_KEYS = st.sampled_from(
    ["q_proj", "k_proj", "mlp.up_proj", r"layers\.1\..*", r".*_proj", r"model\.layers\.0\.self_attn\.v_proj", "proj"]
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    entries=st.lists(_ENTRIES, min_size=1, max_size=4, unique=True),
    ltt=st.one_of(st.none(), st.integers(0, NUM_LAYERS - 1), st.lists(st.integers(0, NUM_LAYERS), max_size=3)),
    rank_pattern=st.dictionaries(_PATTERN_KEYS, st.integers(1, 16), max_size=3),
    alpha_pattern=st.dictionaries(_PATTERN_KEYS, st.integers(1, 64), max_size=3),
    rslora=st.booleans(),
)
def test_targets_and_patterns_match_peft_rules(
    entries, ltt, rank_pattern, alpha_pattern, rslora, mcfg, tmp_path_factory
):
    # adapter_config.json holds the patterns in sorted key order (peft writes it so); first match wins.
    rank_pattern, alpha_pattern = dict(sorted(rank_pattern.items())), dict(sorted(alpha_pattern.items()))
    cfg = LoraConfig(r=8, lora_alpha=16, target_modules=entries, layers_to_transform=ltt,
                     rank_pattern=rank_pattern, alpha_pattern=alpha_pattern, use_rslora=rslora)
    expected = {}
    for layer in range(NUM_LAYERS):
        for m in TARGET_MODULES:
            name = mcfg.hf_module_name(layer, m)
            if check_target_module_exists(cfg, name):
                r = rank_pattern.get(get_pattern_key(rank_pattern.keys(), name), 8)
                a = alpha_pattern.get(get_pattern_key(alpha_pattern.keys(), name), 16)
                expected[(layer, m)] = (r, a / math.sqrt(r) if rslora else a / r)
    if not expected:
        return  # covered by test_targets_no_module
    gen = torch.Generator().manual_seed(0)
    mods = {}
    for (layer, m), (r, _) in expected.items():
        d_in, d_out = mcfg.module_shape(m)
        mods[(layer, m)] = (torch.randn(r, d_in, generator=gen), torch.randn(d_out, r, generator=gen))
    out = tmp_path_factory.mktemp("prop")
    save_peft_adapter(out, mods, r=8, lora_alpha=16, target_modules=entries, use_rslora=rslora,
                      rank_pattern=rank_pattern, alpha_pattern=alpha_pattern, layers_to_transform=ltt)
    adapter = load_peft_adapter(out, mcfg)
    assert {k: (w.rank, w.scaling) for k, w in adapter.modules.items()} == expected


# ----------------------------------------------------------------------------------------- save round trip


def _random_modules(mcfg, keys, rank_of, seed=0):
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for layer, m in keys:
        d_in, d_out = mcfg.module_shape(m)
        r = rank_of(layer, m)
        out[(layer, m)] = (torch.randn(r, d_in, generator=gen), torch.randn(d_out, r, generator=gen))
    return out


@pytest.mark.parametrize("regex", [False, True])
def test_save_round_trip_through_peft(regex, hf_config, mcfg, tmp_path):
    layers_sel = [0, 2]
    targets = ["q_proj", "k_proj", "down_proj"]
    rank_pattern = {"down_proj": 2} if not regex else {}
    keys = [(layer, m) for layer in layers_sel for m in targets] if not regex else [
        (layer, m) for layer in range(NUM_LAYERS) for m in targets
    ]
    mods = _random_modules(mcfg, keys, lambda layer, m: rank_pattern.get(m, 4))
    tm = targets if not regex else r".*\.(q_proj|k_proj|down_proj)"
    save_peft_adapter(
        tmp_path, mods, r=4, lora_alpha=12, target_modules=tm, rank_pattern=rank_pattern,
        alpha_pattern={"k_proj": 2}, layers_to_transform=None if regex else layers_sel,
        base_model_name_or_path="tiny-llama",
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = PeftModel.from_pretrained(_base_model(hf_config), str(tmp_path))
    assert not [w for w in caught if "missing" in str(w.message).lower() or "unexpected" in str(w.message).lower()]
    seen = set()
    for name, mod in model.named_modules():
        if isinstance(mod, LoraLayer) and "default" in mod.lora_A:
            parts = name.split(".")
            key = (int(parts[parts.index("layers") + 1]), parts[-1])
            seen.add(key)
            a, b = mods[key]
            assert torch.equal(mod.lora_A["default"].weight, a) and torch.equal(mod.lora_B["default"].weight, b)
            assert mod.scaling["default"] == (2 if key[1] == "k_proj" else 12) / a.shape[0]
    assert seen == set(keys)
    adapter = load_peft_adapter(tmp_path, mcfg)
    assert set(adapter.modules) == set(keys)
    for key, (a, b) in mods.items():
        assert torch.equal(adapter.modules[key].a, a) and torch.equal(adapter.modules[key].b, b)


def test_save_rejects_inconsistent_input(mcfg, tmp_path):
    mods = _random_modules(mcfg, [(0, "q_proj")], lambda *_: 4)
    with pytest.raises(ValueError, match="rank from r / rank_pattern is 8, got 4"):
        save_peft_adapter(tmp_path, mods, r=8, lora_alpha=8, target_modules=["q_proj"])
    with pytest.raises(ValueError, match="not targeted"):
        save_peft_adapter(tmp_path, mods, r=4, lora_alpha=8, target_modules=["v_proj"])
    a, b = mods[(0, "q_proj")]
    with pytest.raises(ValueError, match="same r"):
        save_peft_adapter(tmp_path, {(0, "q_proj"): (a, b[:, :2])}, r=4, lora_alpha=8, target_modules=["q_proj"])
    with pytest.raises(ValueError, match="bad module key"):
        save_peft_adapter(tmp_path, {(0, "lm_head"): (a, b)}, r=4, lora_alpha=8, target_modules=["q_proj"])
    assert not (tmp_path / "adapter_config.json").exists()


def test_summary_and_properties(mcfg, tmp_path):
    keys = [(layer, m) for layer in range(NUM_LAYERS) for m in ("q_proj", "v_proj")]
    save_peft_adapter(tmp_path, _random_modules(mcfg, keys, lambda *_: 8), r=8, lora_alpha=16,
                      target_modules=["q_proj", "v_proj"])
    ad = load_peft_adapter(tmp_path, mcfg, name="x")
    assert ad.target_summary() == f"r=8 alpha=16 on q_proj,v_proj x {NUM_LAYERS} layers"
    assert ad.max_rank == 8
    assert ad.nbytes == NUM_LAYERS * 4 * (8 * 64 + 64 * 8 + 8 * 64 + 32 * 8)
    assert list(ad.modules) == sorted(keys, key=lambda k: (k[0], TARGET_MODULES.index(k[1])))
    assert "tensor" not in repr(ad)  # repr stays short
    with pytest.raises(Exception):
        ad.modules[(0, "q_proj")].scaling = 1.0  # frozen

    keys2 = [(0, "q_proj"), (0, "down_proj")]
    save_peft_adapter(tmp_path / "b", _random_modules(mcfg, keys2, lambda _, m: 2 if m == "q_proj" else 16),
                      r=16, lora_alpha=16, use_rslora=True, target_modules=["q_proj", "down_proj"],
                      rank_pattern={"q_proj": 2}, alpha_pattern={"down_proj": 32}, layers_to_transform=0)
    summary = load_peft_adapter(tmp_path / "b", mcfg).target_summary()
    assert summary == "r=2..16 alpha=16..32 on q_proj,down_proj x 1 layer rslora"


def test_all_linear_shorthand(mcfg, tmp_path):
    keys = [(layer, m) for layer in range(NUM_LAYERS) for m in TARGET_MODULES]
    _write_valid(tmp_path, mcfg, keys=keys, targets=TARGET_MODULES)
    _patch_config(tmp_path, target_modules="all-linear")
    assert set(load_peft_adapter(tmp_path, mcfg).modules) == set(keys)


# ----------------------------------------------------------------------------------------- key forms

WKEY = "base_model.model.model.layers.{}.{}.{}.lora_{}.weight"


def _write_valid(path, mcfg, keys=None, targets=("q_proj", "v_proj", "down_proj"), r=4, **kw):
    keys = keys or [(layer, m) for layer in range(NUM_LAYERS) for m in targets]
    mods = _random_modules(mcfg, keys, lambda *_: r)
    save_peft_adapter(path, mods, r=r, lora_alpha=8, target_modules=list(targets), **kw)
    return mods


def _patch_config(path, **changes):
    p = path / "adapter_config.json"
    cfg = json.loads(p.read_text())
    cfg.update(changes)
    p.write_text(json.dumps(cfg))


def _patch_tensors(path, fn):
    p = str(path / "adapter_model.safetensors")
    t = load_file(p)
    fn(t)
    save_file(t, p, metadata={"format": "pt"})


def _key(layer, module, kind):
    return WKEY.format(layer, MODULE_PARENT[module], module, kind)


@pytest.mark.parametrize("form", ["default-segment", "no-prefix", "both"])
def test_accepts_other_key_forms(form, mcfg, tmp_path):
    mods = _write_valid(tmp_path, mcfg)

    def rename(t):
        for k in list(t):
            nk = k
            if form in ("default-segment", "both"):
                nk = nk.replace(".weight", ".default.weight")
            if form in ("no-prefix", "both"):
                nk = nk.removeprefix("base_model.model.")
            t[nk] = t.pop(k)

    _patch_tensors(tmp_path, rename)
    ad = load_peft_adapter(tmp_path, mcfg)
    for key, (a, b) in mods.items():
        assert torch.equal(ad.modules[key].a, a) and torch.equal(ad.modules[key].b, b)


# ----------------------------------------------------------------------------------------- bad inputs


def _raises(path, mcfg, *fragments, key=None, file=None, **kw) -> AdapterError:
    with pytest.raises(AdapterError) as ei:
        load_peft_adapter(path, mcfg, **kw)
    err = ei.value
    msg = str(err)
    for f in fragments:
        assert f in msg, (f, msg)
    if file is not None:
        assert err.path is not None and err.path.endswith(file), (err.path, file)
        assert file in msg
    if key is not None:
        assert err.key == key, (err.key, key)
        assert key in msg
    assert isinstance(err, ValueError)
    return err


CFG = "adapter_config.json"
WTS = "adapter_model.safetensors"


def test_bias_and_fan_in_fan_out_are_served_as_peft_serves_them_on_linear_projections(mcfg, tmp_path, caplog):
    """PEFT itself (checked here on a bias-free nn.Linear) takes ``fan_in_fan_out: true`` as false for an nn.Linear
    target, with a warning, and ``bias: "all"`` / ``"lora_only"`` saves and applies no bias when the model has none:
    such an adapter is plain LoRA. So it is here: the same weights and scalings as with ``bias: "none"``, one warning
    per file for fan_in_fan_out; a bias tensor in the file (a base-model bias PEFT trained) is refused, naming it."""
    import torch.nn as nn

    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.q_proj = nn.Linear(8, 8, bias=False)

        def forward(self, x):
            return self.q_proj(x)

    torch.manual_seed(0)
    x = torch.randn(3, 8)
    outs = []
    for kw in ({}, {"fan_in_fan_out": True, "bias": "all"}, {"bias": "lora_only"}):
        base = Tiny()
        torch.manual_seed(1)
        base.q_proj.weight.data.normal_()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = get_peft_model(base, LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"], **kw))
        assert not model.peft_config["default"].fan_in_fan_out
        if kw.get("fan_in_fan_out"):
            assert any("fan_in_fan_out" in str(w.message) for w in caught)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_" in name:
                    torch.manual_seed(len(name))
                    p.normal_()
            outs.append(model(x))
        saved = get_peft_model_state_dict(model)  # what save_pretrained writes: no bias, as the model has none
        assert saved and not [k for k in saved if k.endswith("bias")], list(saved)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])

    from multilora.runtime.adapters import targets

    _write_valid(tmp_path, mcfg)
    ref = load_peft_adapter(tmp_path, mcfg)
    _patch_config(tmp_path, fan_in_fan_out=True, bias="all")
    targets._SAID.clear()
    with caplog.at_level(logging.WARNING, logger="multilora"):
        got = load_peft_adapter(tmp_path, mcfg)
        load_peft_adapter(tmp_path, mcfg)  # a reload: not said again
    assert got.modules.keys() == ref.modules.keys()
    for k, m in ref.modules.items():
        assert torch.equal(got.modules[k].a, m.a) and torch.equal(got.modules[k].b, m.b)
        assert got.modules[k].scaling == m.scaling
    (msg,) = [r.getMessage() for r in caplog.records if "fan_in_fan_out" in r.getMessage()]
    assert "taken as false, as PEFT takes it" in msg and str(tmp_path) in msg, msg
    tensors = load_file(str(tmp_path / WTS))
    tensors["base_model.model.model.layers.0.self_attn.q_proj.bias"] = torch.zeros(mcfg.module_shape("q_proj")[1])
    save_file(tensors, str(tmp_path / WTS))
    _raises(tmp_path, mcfg, "q_proj.bias", "a trained bias of the base model", 'retrain with bias="none"', file=WTS)


@pytest.mark.parametrize(
    "field,value,fragments",
    [
        ("use_dora", True, ["DoRA", "expected false, got true"]),
        ("modules_to_save", ["lm_head"], ["modules_to_save", "lm_head"]),
        ("fan_in_fan_out", "yes", ["expected true or false", '"yes"']),
        ("fan_in_fan_out", 1, ["expected true or false", "got 1"]),
        ("bias", "everything", ['expected "none", "all" or "lora_only", got "everything"']),
        ("lora_bias", True, ["lora_B", "true"]),
        ("peft_type", "IA3", ['"LORA"', '"IA3"']),
        ("init_lora_weights", "pissa_niter_4", ["pissa_niter_4", "expected true"]),
        ("alora_invocation_tokens", [1, 2], ["activated LoRA", "[1, 2]"]),
        ("r", 0, ["positive integer", "got 0"]),
        ("r", -2, ["positive integer", "got -2"]),
        ("r", "4", ["positive integer", 'got "4"']),
        ("lora_alpha", None, ["finite number", "got null"]),
        ("rank_pattern", {"q_proj": 0}, ["q_proj", "positive integer", "got 0"]),
        ("target_modules", None, ["expected a list", "got null"]),
        ("target_modules", r"model\.layers\.(", ["not a valid regular expression"]),
    ],
)
def test_config_rejected(field, value, fragments, mcfg, tmp_path):
    _write_valid(tmp_path, mcfg)
    _patch_config(tmp_path, **{field: value})
    _raises(tmp_path, mcfg, *fragments, key=field, file=CFG)


@pytest.mark.parametrize(
    "targets,fragments",
    [
        (["q_proj", "embed_tokens"], ["'embed_tokens'", "model.embed_tokens", "not supported yet"]),
        (["lm_head"], ["'lm_head'", "not supported yet"]),
        (r".*(q_proj|lm_head)", ["lm_head", "not supported yet"]),
        (["c_attn"], ["'c_attn'", "matches no module", "q_proj"]),
        (["mlp"], ["'mlp'", "model.layers.0.mlp", "only the seven Llama projections"]),
    ],
)
def test_unsupported_targets(targets, fragments, mcfg, tmp_path):
    _write_valid(tmp_path, mcfg)
    _patch_config(tmp_path, target_modules=targets)
    _raises(tmp_path, mcfg, *fragments, key="target_modules", file=CFG)


def test_a_target_modules_entry_matching_no_module_is_ignored_with_a_warning(mcfg, tmp_path, caplog):
    """An entry of ``target_modules`` that names no module of this model (a config written for several families:
    ``query_key_value`` beside ``q_proj``) is skipped, as PEFT skips it (``get_peft_model`` targets the modules the
    other entries match, and says nothing), and the load says so once; the other entries' modules are targeted. Only
    when no entry matches anything is the adapter refused (``test_unsupported_targets``)."""
    from multilora.runtime.adapters import targets

    _write_valid(tmp_path, mcfg, keys=[(i, m) for i in range(NUM_LAYERS) for m in ("q_proj", "v_proj")])
    _patch_config(tmp_path, target_modules=["q_proj", "query_key_value", "v_proj", "c_attn"])
    targets._SAID.clear()
    with caplog.at_level(logging.WARNING, logger="multilora"):
        adapter = load_peft_adapter(tmp_path, mcfg, header_only=True)
        load_peft_adapter(tmp_path, mcfg, header_only=True)  # a reload: not said again
    assert {m for _, m in adapter.modules} == {"q_proj", "v_proj"}
    assert {layer for layer, _ in adapter.modules} == set(range(NUM_LAYERS))
    (msg,) = [r.getMessage() for r in caplog.records if "target_modules" in r.getMessage()]
    assert "'query_key_value', 'c_attn' match no module of this llama model: ignored, as PEFT ignores it" in msg, msg
    assert "expected one of q_proj" in msg and str(tmp_path) in msg, msg


def test_overlapping_alpha_patterns_of_different_values_are_said(mcfg, tmp_path, caplog):
    """Two ``alpha_pattern`` keys of different values that match one module: the first in the file's order gives
    its alpha (PEFT's reload does the same), and the load warns once that PEFT's sorted save may have changed which
    one that is (a rank clash shows in the tensors' shapes; an alpha clash would change outputs silently). Keys of
    one value, or keys matching different modules, say nothing."""
    from multilora.runtime.adapters import targets

    _write_valid(tmp_path, mcfg, keys=[(i, m) for i in range(NUM_LAYERS) for m in ("q_proj", "v_proj")])
    _patch_config(tmp_path, target_modules=["q_proj", "v_proj"],
                  alpha_pattern={"layers.1.self_attn.q_proj": 1, "q_proj": 100})
    targets._SAID.clear()
    with caplog.at_level(logging.WARNING, logger="multilora"):
        adapter = load_peft_adapter(tmp_path, mcfg, header_only=True)
        load_peft_adapter(tmp_path, mcfg, header_only=True)  # a reload: not said again
    assert adapter.modules[(1, "q_proj")].scaling == 1 / 4 and adapter.modules[(0, "q_proj")].scaling == 100 / 4
    assert adapter.modules[(1, "v_proj")].scaling == 8 / 4
    (msg,) = [r.getMessage() for r in caplog.records if "alpha_pattern" in r.getMessage()]
    assert ("alpha_pattern keys 'layers.1.self_attn.q_proj': 1, 'q_proj': 100 all match model.layers.1.self_attn."
            "q_proj with different alphas; the first in the file's order ('layers.1.self_attn.q_proj') is used") in msg
    assert str(tmp_path) in msg, msg
    for pattern in ({"layers.1.self_attn.q_proj": 100, "q_proj": 100}, {"q_proj": 1, "v_proj": 100}):
        _patch_config(tmp_path, alpha_pattern=pattern)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="multilora"):
            load_peft_adapter(tmp_path, mcfg, header_only=True)
        assert not [r for r in caplog.records if "alpha_pattern" in r.getMessage()], pattern


def test_an_adapter_filtered_to_nothing_is_not_blamed_on_its_unmatched_entry(mcfg, tmp_path):
    """When an entry matched but ``exclude_modules`` removed what it matched, the refusal does not present the
    unmatched entry as the cause (the projections it lists would suggest q_proj, which is there)."""
    _write_valid(tmp_path, mcfg)
    _patch_config(tmp_path, target_modules=["q_proj", "qq_proj"], exclude_modules=["q_proj"])
    _raises(tmp_path, mcfg, "targets no module", "expected at least one Llama projection ('qq_proj' matches no module",
            key="target_modules", file=CFG)


def test_layers_to_transform_outside_the_model_are_ignored_with_a_warning(mcfg, tmp_path, caplog):
    """A layer index the model does not have is skipped, as PEFT skips it, and the load says so (a typo, or an
    adapter for a deeper model); the layers it has are targeted."""
    _write_valid(tmp_path, mcfg, keys=[(0, m) for m in ("q_proj", "v_proj", "down_proj")])
    _patch_config(tmp_path, layers_to_transform=[0, 99])
    with caplog.at_level(logging.WARNING, logger="multilora"):
        adapter = load_peft_adapter(tmp_path, mcfg, header_only=True)
    assert {layer for layer, _ in adapter.modules} == {0}
    (msg,) = [r.getMessage() for r in caplog.records if "layers_to_transform" in r.getMessage()]
    assert "[0, 99]" in msg and "layer(s) 99" in msg and f"layers 0 to {NUM_LAYERS - 1}" in msg, msg
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="multilora"):  # read again (a reload): not said again
        load_peft_adapter(tmp_path, mcfg)
    assert not [r for r in caplog.records if "layers_to_transform" in r.getMessage()]


def test_targets_no_module(mcfg, tmp_path):
    _write_valid(tmp_path, mcfg)
    _patch_config(tmp_path, layers_to_transform=[7, 9])
    _raises(tmp_path, mcfg, "targets no module", "[7, 9]", f"{NUM_LAYERS} layers", key="target_modules", file=CFG)
    _patch_config(tmp_path, layers_to_transform=None, target_modules=r"model\.layers\.99\..*")
    _raises(tmp_path, mcfg, "targets no module", "layers\\\\.99", file=CFG)


def test_regex_with_layers_to_transform(mcfg, tmp_path):
    _write_valid(tmp_path, mcfg)
    _patch_config(tmp_path, target_modules=r".*q_proj", layers_to_transform=[0])
    _raises(tmp_path, mcfg, "regex string", "[0]", key="layers_to_transform", file=CFG)


def test_malformed_json(mcfg, tmp_path):
    _write_valid(tmp_path, mcfg)
    (tmp_path / CFG).write_text('{\n  "r": 4,\n  "lora_alpha": 8,\n  "target_modules": ["q_proj",]\n}')
    _raises(tmp_path, mcfg, "malformed JSON", "line 4 column", file=CFG)
    (tmp_path / CFG).write_text("[1, 2]")
    _raises(tmp_path, mcfg, "expected a JSON object", "got list", file=CFG)


def test_missing_files(mcfg, tmp_path):
    _raises(tmp_path / "nope", mcfg, "does not exist", file="nope")
    _write_valid(tmp_path / "a", mcfg)
    _raises(tmp_path / "a" / CFG, mcfg, "expected a directory", "got a file", file=CFG)
    (tmp_path / "a" / WTS).unlink()
    _raises(tmp_path / "a", mcfg, "no adapter weights", WTS, "found neither", file="a")
    _write_valid(tmp_path / "b", mcfg)
    (tmp_path / "b" / CFG).unlink()
    _raises(tmp_path / "b", mcfg, "missing", file=CFG)


def test_corrupt_safetensors(mcfg, tmp_path):
    _write_valid(tmp_path, mcfg)
    (tmp_path / WTS).write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}")
    _raises(tmp_path, mcfg, "cannot read the safetensors file", file=WTS)


def _shape(t):
    return "[" + ", ".join(map(str, t.shape)) + "]"


BAD_KEYS = [
    # (new key, extra tensor shape, fragments)
    (WKEY.format(0, "self_attn", "qkv_proj", "A"), "unknown module 'qkv_proj'"),
    (WKEY.format(NUM_LAYERS + 4, "self_attn", "q_proj", "A"), f"layer {NUM_LAYERS + 4} out of range"),
    (WKEY.format(0, "mlp", "q_proj", "A"), "sits under 'self_attn'"),
    ("base_model.model.model.embed_tokens.lora_embedding_A", "lora_embedding_A"),
    ("base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector", "lora_magnitude_vector"),
    ("base_model.model.model.layers.0.self_attn.q_proj.lora_B.bias", "lora_bias"),
    ("base_model.model.lm_head.lora_A.weight", "lm_head is not supported yet"),
    ("base_model.model.lm_head.modules_to_save.default.weight", "modules_to_save"),
    ("base_model.model.model.layers.0.self_attn.q_proj.lora_E", "lora_E"),
    ("base_model.model.model.norm.weight", "does not name a LoRA weight"),
    (WKEY.format(0, "self_attn", "q_proj", "A").replace(".weight", ".other.weight"), "adapter-name segment 'other'"),
    (WKEY.format(0, "self_attn", "k_proj", "A"), "not targeted"),
]


@pytest.mark.parametrize("bad_key,fragment", BAD_KEYS, ids=[b[1].split()[0] + str(i) for i, b in enumerate(BAD_KEYS)])
def test_bad_tensor_key(bad_key, fragment, mcfg, tmp_path):
    _write_valid(tmp_path, mcfg)
    _patch_tensors(tmp_path, lambda t: t.__setitem__(bad_key, torch.zeros(4, 64)))
    _raises(tmp_path, mcfg, fragment, key=bad_key, file=WTS)


def test_duplicate_key(mcfg, tmp_path):
    _write_valid(tmp_path, mcfg)
    k = _key(1, "v_proj", "A")
    dup = k.replace(".weight", ".default.weight")
    _patch_tensors(tmp_path, lambda t: t.__setitem__(dup, t[k].clone()))
    err = _raises(tmp_path, mcfg, "duplicate lora_A", file=WTS)
    assert err.key in (k, dup) and ({k, dup} - {err.key}).pop() in str(err)


@pytest.mark.parametrize(
    "layer,module,kind,new_shape,expected",
    [
        (0, "q_proj", "A", (4, 32), "[4, 64]"),  # wrong in_features
        (1, "v_proj", "B", (64, 4), "[32, 4]"),  # wrong out_features (v is kv-sized)
        (2, "down_proj", "A", (4, 64), "[4, 128]"),  # MLP in_features
        (0, "q_proj", "A", (2, 64), "[4, 64]"),  # rank disagrees with r
        (0, "q_proj", "A", (64,), "[4, 64]"),  # not 2-D
    ],
)
def test_bad_shape(layer, module, kind, new_shape, expected, mcfg, tmp_path):
    _write_valid(tmp_path, mcfg)
    k = _key(layer, module, kind)
    _patch_tensors(tmp_path, lambda t: t.__setitem__(k, torch.randn(new_shape)))
    _raises(tmp_path, mcfg, f"expected shape {expected}", "got [" + ", ".join(map(str, new_shape)) + "]",
            "r=4 from r", key=k, file=WTS)


def test_bad_shape_against_rank_pattern(mcfg, tmp_path):
    keys = [(layer, m) for layer in range(NUM_LAYERS) for m in ("q_proj", "v_proj")]
    mods = _random_modules(mcfg, keys, lambda _, m: 2 if m == "q_proj" else 4)
    save_peft_adapter(tmp_path, mods, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                      rank_pattern={"q_proj": 2})
    assert load_peft_adapter(tmp_path, mcfg).modules[(0, "q_proj")].rank == 2
    _patch_config(tmp_path, rank_pattern={"q_proj": 3})
    k = _key(0, "q_proj", "A")
    _raises(tmp_path, mcfg, "expected shape [3, 64]", "got [2, 64]", "rank_pattern['q_proj']", key=k, file=WTS)


@pytest.mark.parametrize("drop,keep", [("B", "A"), ("A", "B")])
def test_half_a_pair(drop, keep, mcfg, tmp_path):
    _write_valid(tmp_path, mcfg)
    _patch_tensors(tmp_path, lambda t: t.pop(_key(1, "down_proj", drop)))
    _raises(tmp_path, mcfg, f"no matching lora_{drop}", f"got only lora_{keep}",
            key=_key(1, "down_proj", keep), file=WTS)


def test_targeted_module_without_tensors(mcfg, tmp_path):
    _write_valid(tmp_path, mcfg)

    def drop(t):
        t.pop(_key(2, "v_proj", "A"))
        t.pop(_key(2, "v_proj", "B"))

    _patch_tensors(tmp_path, drop)
    _raises(tmp_path, mcfg, "no lora_A / lora_B tensors", "model.layers.2.self_attn.v_proj", file=WTS,
            key=_key(2, "v_proj", "A"))


def test_an_adapter_for_a_larger_or_wider_model_says_so(mcfg, tmp_path):
    """Tensors for layers past this model's, or whose in/out features are not this model's: the error names the
    likely cause with what the adapter's config names and what this base model is; a rank that disagrees with r does
    not (the features are this model's)."""
    other = (f"the adapter was probably made for another base model (adapter_config.json names base_model_name_or_path "
             f"'org/larger-model'; this base model is a {mcfg.architecture} of {NUM_LAYERS} layers, hidden size "
             f"{mcfg.hidden_size})")
    _write_valid(tmp_path, mcfg, base_model_name_or_path="org/larger-model")
    extra = WKEY.format(NUM_LAYERS, "self_attn", "q_proj", "A")
    _patch_tensors(tmp_path, lambda t: t.__setitem__(extra, torch.randn(4, mcfg.hidden_size)))
    _raises(tmp_path, mcfg, f"layer {NUM_LAYERS} out of range: the base model has {NUM_LAYERS} layers", other,
            key=extra, file=WTS)
    for shape, hinted in (((4, 2 * mcfg.hidden_size), True), ((2, mcfg.hidden_size), False)):
        _write_valid(tmp_path, mcfg, base_model_name_or_path="org/larger-model")
        k = _key(0, "q_proj", "A")
        _patch_tensors(tmp_path, lambda t: t.__setitem__(k, torch.randn(shape)))
        err = _raises(tmp_path, mcfg, "expected shape", key=k, file=WTS)
        assert (other in str(err)) is hinted, str(err)
    # a transposed A (a hand-made file): said so, not blamed on another model
    _write_valid(tmp_path, mcfg, base_model_name_or_path="org/larger-model")
    k = _key(0, "q_proj", "A")
    _patch_tensors(tmp_path, lambda t: t.__setitem__(k, t[k].T.contiguous()))
    err = _raises(tmp_path, mcfg, "expected shape", "it is transposed (PEFT stores lora_A as [r, in_features])",
                  key=k, file=WTS)
    assert "another base model" not in str(err)


def test_an_adapter_for_a_model_with_fewer_layers_says_so(mcfg, tmp_path):
    """Tensors only for the first layers while the config targets every layer of this model: the error names the
    likely cause (made for another base model, with its base_model_name_or_path); a gap in the middle does not."""
    _write_valid(tmp_path, mcfg, keys=[(0, m) for m in ("q_proj", "v_proj", "down_proj")],
                 base_model_name_or_path="org/smaller-model")
    err = _raises(tmp_path, mcfg, "no lora_A / lora_B tensors", "model.layers.1.self_attn.q_proj",
                  f"The file has tensors for layers 0-0 only and this base model has {NUM_LAYERS} layers: the file was "
                  f"written incompletely, or the adapter was probably made for another base model "
                  f"(adapter_config.json names base_model_name_or_path 'org/smaller-model'; this base model is a "
                  f"{mcfg.architecture} of {NUM_LAYERS} layers, hidden size {mcfg.hidden_size})", file=WTS)
    assert isinstance(err, AdapterError)
    _write_valid(tmp_path, mcfg)
    _patch_tensors(tmp_path, lambda t: [t.pop(_key(1, m, k)) for m in ("q_proj", "v_proj", "down_proj") for k in "AB"])
    with pytest.raises(AdapterError) as ei:
        load_peft_adapter(tmp_path, mcfg)
    assert "model.layers.1." in str(ei.value) and "another base model" not in str(ei.value)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite(bad, mcfg, tmp_path):
    _write_valid(tmp_path, mcfg)
    k = _key(1, "q_proj", "B")

    def poison(t):
        t[k][3, 1] = bad

    _patch_tensors(tmp_path, poison)
    _raises(tmp_path, mcfg, "expected finite values", "got 1 non-finite", key=k, file=WTS)


def test_integer_tensor(mcfg, tmp_path):
    _write_valid(tmp_path, mcfg)
    k = _key(0, "v_proj", "A")
    _patch_tensors(tmp_path, lambda t: t.__setitem__(k, torch.ones(4, 64, dtype=torch.int32)))
    _raises(tmp_path, mcfg, "floating-point", "torch.int32", key=k, file=WTS)


# ----------------------------------------------------------------------------------------- pickle


def _to_pickle(path):
    t = load_file(str(path / WTS))
    torch.save(t, path / "adapter_model.bin")
    (path / WTS).unlink()


def test_pickle_refused_by_default(mcfg, tmp_path):
    _write_valid(tmp_path, mcfg)
    _to_pickle(tmp_path)
    _raises(tmp_path, mcfg, "pickle", "arbitrary code", "allow_pickle=True", "convert", file="adapter_model.bin")


def test_pickle_opt_in(mcfg, tmp_path):
    mods = _write_valid(tmp_path, mcfg)
    _to_pickle(tmp_path)
    ad = load_peft_adapter(tmp_path, mcfg, allow_pickle=True)
    for key, (a, b) in mods.items():
        assert torch.equal(ad.modules[key].a, a) and torch.equal(ad.modules[key].b, b)


class _NotATensor:  # a pickled custom object: torch.load(weights_only=True) must refuse it
    pass


def test_pickle_with_code_is_refused_even_when_allowed(mcfg, tmp_path):
    _write_valid(tmp_path, mcfg)
    _to_pickle(tmp_path)
    torch.save({"x": _NotATensor()}, tmp_path / "adapter_model.bin")
    _raises(tmp_path, mcfg, "weights_only=True", file="adapter_model.bin", allow_pickle=True)


def test_safetensors_preferred_over_pickle(mcfg, tmp_path):
    mods = _write_valid(tmp_path, mcfg)
    torch.save({"garbage": torch.zeros(1)}, tmp_path / "adapter_model.bin")
    ad = load_peft_adapter(tmp_path, mcfg)
    assert torch.equal(ad.modules[(0, "q_proj")].a, mods[(0, "q_proj")][0])


def test_module_weights_rank():
    w = LoRAModuleWeights(a=torch.zeros(3, 5), b=torch.zeros(7, 3), scaling=0.5)
    assert w.rank == 3
