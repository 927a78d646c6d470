"""The Qwen2 / Qwen2.5 and Qwen3 (dense) families on the one decoder, against HF transformers and peft (fp32, CPU).

Each case is a tiny random model made with transformers' own ``Qwen2Config`` / ``Qwen2ForCausalLM`` and
``Qwen3Config`` / ``Qwen3ForCausalLM``, saved with ``save_pretrained`` (safetensors) and loaded with
``Engine(model=dir)``. transformers initialises biases to 0 and norm weights to 1, which would hide a runtime
that ignored them, so every bias and q/k norm weight is redrawn before saving (and a sanity test shows each
knob changes the reference). The reference is transformers' own forward and greedy ``generate``, and peft's
mixed-batch ``adapter_names=`` forward for LoRA adapters on projections whose base has a bias.

Also here: the error for a ``model_type`` multilora does not serve, how ``use_sliding_window`` /
``max_window_layers`` / ``layer_types`` are read, the HF module names the adapter target rules match, and
Qwen3's q/k norm through the Triton RoPE kernel (interpreter) against the torch op.
"""

from __future__ import annotations

import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from testsupport import (  # noqa: E402,F401  (one_thread: autouse)
    LORA_PATHS, hf_greedy, hf_last_logits, lora_path, one_thread, peft_adapters, rel_err, saved_engine, token_rows)

from multilora import Engine, SamplingParams  # noqa: E402
from multilora.config import SERVED_MODEL_TYPES, ModelConfig  # noqa: E402

VOCAB = 1000
REL_TOL = 1e-5  # fp32 vs fp32: observed <= 1e-6 (GEMM reduction order)
GEN_TOKENS = 8

BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
            initializer_range=0.2)  # a wide init: greedy top-2 gaps far above fp32 noise

# name -> (model class, config class, config overrides, prompt lengths)
CASES = {
    "qwen2-untied": ("Qwen2ForCausalLM", "Qwen2Config", dict(tie_word_embeddings=False, rope_theta=1e6), (9, 17, 1)),
    "qwen2-tied": ("Qwen2ForCausalLM", "Qwen2Config", dict(tie_word_embeddings=True), (10, 3)),
    # layer 0 full attention, layer 1 a 4-token window (HF: layers >= max_window_layers slide)
    "qwen2-sliding": ("Qwen2ForCausalLM", "Qwen2Config",
                      dict(use_sliding_window=True, sliding_window=4, max_window_layers=1), (12, 11, 5)),
    # head_dim 24 != hidden / heads (16): q is 96 wide, o maps 96 -> 64
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", dict(head_dim=24, tie_word_embeddings=False), (9, 17, 1)),
    "qwen3-tied-mqa-bias": ("Qwen3ForCausalLM", "Qwen3Config",
                            dict(head_dim=32, num_key_value_heads=1, attention_bias=True, tie_word_embeddings=True),
                            (7, 13)),
    "llama-attention-bias": ("LlamaForCausalLM", "LlamaConfig", dict(attention_bias=True), (8, 5)),
}


def _make_model(name, **extra):
    cls_name, cfg_name, overrides, _ = CASES[name]
    cfg = getattr(transformers, cfg_name)(**{**BASE, **overrides, **extra})
    torch.manual_seed(0)
    model = getattr(transformers, cls_name)(cfg).eval()
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():  # biases ~ N(0, 0.5^2), q/k norm weights ~ 1 + N(0, 0.3^2): not the init's 0 and 1
        for pname, p in model.named_parameters():
            if pname.endswith(".bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            elif pname.endswith(("q_norm.weight", "k_norm.weight")):
                p.copy_(1 + torch.randn(p.shape, generator=g) * 0.3)
    return model


def _rows(name, seed=7):
    return token_rows(VOCAB, CASES[name][3], seed)


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    name = request.param
    model = _make_model(name)
    return name, model, saved_engine(model, tmp_path_factory, name), _rows(name)


def test_config_read_from_config_json(case):
    name, model, engine, _ = case
    hf, c = model.config, engine.config
    assert c.architecture == hf.model_type
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads  # Qwen2Config has none
    assert (c.num_heads, c.num_kv_heads, c.head_dim) == (hf.num_attention_heads, hf.num_key_value_heads, head_dim)
    assert c.tie_word_embeddings == bool(hf.tie_word_embeddings)
    assert (engine.model.lm_head is engine.model.embed) == bool(hf.tie_word_embeddings)
    attn = model.model.layers[0].self_attn
    assert c.qkv_bias == (attn.q_proj.bias is not None) and c.o_bias == (attn.o_proj.bias is not None)
    assert c.qk_norm == hasattr(attn, "q_norm")
    windows = [c.window(i) for i in range(c.num_layers)]
    assert windows == [getattr(layer.self_attn, "sliding_window", None) or 0 for layer in model.model.layers]
    if name == "qwen2-sliding":
        assert windows == [0, 4]


def test_logits_match_transformers(case):
    name, model, engine, rows = case
    ours = engine.logits(rows, adapters=None)
    assert ours.dtype == torch.float32 and ours.shape == (len(rows), VOCAB)
    for i, ref in enumerate(hf_last_logits(model, rows)):
        assert rel_err(ours[i], ref) < REL_TOL, (name, i, rel_err(ours[i], ref))


def test_greedy_generate_matches_transformers(case):
    name, model, engine, rows = case
    outs = engine.generate(rows, adapters=None,
                           sampling=SamplingParams(max_tokens=GEN_TOKENS, temperature=0.0, ignore_eos=True))
    for r, out in zip(rows, outs):
        assert out.token_ids == hf_greedy(model, r, GEN_TOKENS), (name, len(r))


@pytest.mark.parametrize("name,what", [
    ("qwen2-untied", "bias"), ("qwen3", "qk_norm"), ("qwen3-tied-mqa-bias", "bias"),
    ("llama-attention-bias", "bias"), ("qwen2-sliding", "window"),
])
def test_family_knob_changes_the_reference(name, what):
    """Sanity: each family difference changes transformers' logits on these prompts, so the comparisons above
    would catch a runtime that ignored it: biases zeroed; q/k norm weights reset to 1 (a runtime that skipped
    the q/k norm altogether differs even more); the sliding window switched off."""
    model = _make_model(name)
    other = _make_model(name, **({"use_sliding_window": False} if what == "window" else {}))
    other.load_state_dict(model.state_dict())
    with torch.no_grad():
        for pname, p in other.named_parameters():
            if what == "bias" and pname.endswith(".bias"):
                p.zero_()
            elif what == "qk_norm" and pname.endswith(("q_norm.weight", "k_norm.weight")):
                p.fill_(1.0)
    row = [max(_rows(name), key=len)]
    a, b = hf_last_logits(model, row)[0], hf_last_logits(other, row)[0]
    assert rel_err(a, b) > 1e-3, f"{name}: {what} barely changes the reference ({rel_err(a, b):.2e})"


# --------------------------------------------------------------------- peft adapters on biased q/k/v
PEFT_ADAPTERS = {
    "qkv-r4": dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj"]),
    "all-r8-rslora": dict(r=8, lora_alpha=5, use_rslora=True,
                          target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    "kv-o-r2-patterns": dict(r=2, lora_alpha=4, target_modules=["k_proj", "v_proj", "o_proj", "down_proj"],
                             rank_pattern={"down_proj": 6}, layers_to_transform=[1]),
}


@pytest.fixture(scope="module", params=["qwen2-untied", "qwen3-tied-mqa-bias"])
def peft_setup(request, tmp_path_factory):
    name = request.param
    base = _make_model(name)
    d = tmp_path_factory.mktemp(f"peft-base-{name}")
    base.save_pretrained(str(d))
    names = list(PEFT_ADAPTERS)
    out = tmp_path_factory.mktemp(f"peft-adapters-{name}")
    model = peft_adapters(base, PEFT_ADAPTERS, out, std=0.3, seed=11)
    engine = Engine(model=str(d), progress=False, max_batch_size=8)
    for n in names:
        engine.load_adapter(n, out / n)
    return name, model, engine


BATCH = [("qkv-r4", 9), (None, 4), ("all-r8-rslora", 15), ("kv-o-r2-patterns", 7), (None, 12), ("qkv-r4", 1)]


def _batch_rows(seed=5):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for _, n in BATCH]


@LORA_PATHS
def test_peft_adapters_mixed_batch_logits(peft_setup, deferred, monkeypatch):
    name, model, engine = peft_setup
    calls = lora_path(engine, deferred, monkeypatch)
    rows = _batch_rows()
    ours = engine.logits(rows, adapters=[a for a, _ in BATCH])
    # the path asked for ran: no written LoRA term in place; "first": written, and added after only where a bias is
    assert (calls["lora_delta"] > 0) == (deferred is not False), calls
    if deferred == "first":
        biased = any(n.endswith("_bias") for n in engine.model.layers[0])
        assert (calls["lora_apply"] > 0) == biased, (calls, biased)
    for i, ((a, _), r) in enumerate(zip(BATCH, rows)):
        ref = hf_last_logits(model, [r], adapter_names=[a or "__base__"])[0]
        assert rel_err(ours[i], ref) < REL_TOL, (name, a, rel_err(ours[i], ref))
        if a is not None:  # the adapter visibly changes the output (an ignored adapter would fail)
            base = hf_last_logits(model, [r], adapter_names=["__base__"])[0]
            assert rel_err(ref, base) > 1e-2, (name, a)
    alone = engine.logits([rows[1], rows[4]], adapters=None)  # rows without an adapter: the base model
    assert rel_err(ours[1], alone[0]) < REL_TOL and rel_err(ours[4], alone[1]) < REL_TOL


@LORA_PATHS
def test_peft_adapters_greedy_generate(peft_setup, deferred, monkeypatch):
    name, model, engine = peft_setup
    lora_path(engine, deferred, monkeypatch)
    rows = _batch_rows(seed=6)
    outs = engine.generate(rows, adapters=[a for a, _ in BATCH],
                           sampling=SamplingParams(max_tokens=GEN_TOKENS, temperature=0.0, ignore_eos=True))
    for (a, _), r, out in zip(BATCH, rows, outs):
        assert out.token_ids == hf_greedy(model, r, GEN_TOKENS, adapter_names=[a or "__base__"]), (name, a)


# ------------------------------------------------------------------------------- config reading and errors
@pytest.mark.parametrize("model_type,arch", [("gemma", "GemmaForCausalLM"), ("qwen2_moe", "Qwen2MoeForCausalLM"),
                                             ("phi3small", "Phi3SmallForCausalLM"), ("qwen3_moe", None)])
def test_unsupported_model_type_is_refused_naming_it_and_the_served_list(model_type, arch):
    cfg = dict(model_type=model_type, vocab_size=10, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
               num_attention_heads=2)
    if arch:
        cfg["architectures"] = [arch]
    with pytest.raises(ValueError) as e:
        ModelConfig.from_hf_dict(cfg)
    msg = str(e.value)
    assert f"model_type {model_type!r}" in msg and "not served" in msg
    assert all(t in msg for t in SERVED_MODEL_TYPES) and (arch is None or arch in msg)


def test_unsupported_model_dir_is_refused_by_the_engine(tmp_path):
    cfg = transformers.GemmaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    transformers.GemmaForCausalLM(cfg).save_pretrained(str(tmp_path))  # Gemma 1: not served (Gemma 2 is)
    with pytest.raises(ValueError, match=r"model_type 'gemma' .*not served.*qwen3"):
        Engine(model=str(tmp_path), progress=False)


def _qwen_dict(**kw):
    return dict(model_type="qwen2", vocab_size=10, hidden_size=8, intermediate_size=16, num_hidden_layers=4,
                num_attention_heads=2, num_key_value_heads=2, **kw)


def test_qwen_sliding_window_read_as_transformers_reads_it():
    # shipped Qwen2.5 configs: a window size with use_sliding_window false -> full attention everywhere
    c = ModelConfig.from_hf_dict(_qwen_dict(use_sliding_window=False, sliding_window=32768, max_window_layers=2))
    assert c.sliding_window is None and [c.window(i) for i in range(4)] == [0] * 4
    # on, no layer_types (transformers 4.x files): layers >= max_window_layers slide
    c = ModelConfig.from_hf_dict(_qwen_dict(use_sliding_window=True, sliding_window=16, max_window_layers=2))
    assert [c.window(i) for i in range(4)] == [0, 0, 16, 16]
    # layer_types wins over max_window_layers, as in transformers
    types = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
    c = ModelConfig.from_hf_dict(_qwen_dict(use_sliding_window=True, sliding_window=16, max_window_layers=0,
                                            layer_types=types))
    assert [c.window(i) for i in range(4)] == [16, 0, 16, 0]
    hf = transformers.Qwen2Config(**{k: v for k, v in _qwen_dict().items() if k != "model_type"},
                                  use_sliding_window=True, sliding_window=16, max_window_layers=3)
    c = ModelConfig.from_hf_dict(hf.to_dict())
    assert [c.window(i) for i in range(4)] == [16 if t == "sliding_attention" else 0 for t in hf.layer_types]
    # Mistral keeps one window for every layer
    c = ModelConfig.from_hf_dict({**_qwen_dict(), "model_type": "mistral", "sliding_window": 8})
    assert [c.window(i) for i in range(4)] == [8] * 4
    with pytest.raises(ValueError, match="layer_types must list 4 entries"):
        ModelConfig.from_hf_dict(_qwen_dict(use_sliding_window=True, sliding_window=16, layer_types=["x"]))


def test_family_flags_from_config_json():
    q2 = ModelConfig.from_hf_dict(_qwen_dict())
    assert (q2.qkv_bias, q2.o_bias, q2.qk_norm) == (True, False, False)
    q3 = ModelConfig.from_hf_dict({**_qwen_dict(), "model_type": "qwen3", "head_dim": 12})
    assert (q3.qkv_bias, q3.o_bias, q3.qk_norm, q3.head_dim, q3.q_size) == (False, False, True, 12, 24)
    q3b = ModelConfig.from_hf_dict({**_qwen_dict(), "model_type": "qwen3", "attention_bias": True})
    assert (q3b.qkv_bias, q3b.o_bias) == (True, True)
    with pytest.raises(ValueError, match="mlp_bias"):
        ModelConfig.from_hf_dict({**_qwen_dict(), "model_type": "llama", "mlp_bias": True})
    with pytest.raises(ValueError, match="not served"):
        ModelConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=1, num_heads=1, num_kv_heads=1,
                    architecture="gemma")


@pytest.mark.parametrize("name", ["qwen2-untied", "qwen3"])
def test_module_names_match_transformers(name):
    """The module list the PEFT target rules match against is the HF model's own ``named_modules``."""
    from multilora.runtime.adapters.targets import _decoder_module_names

    model = _make_model(name)
    ours = _decoder_module_names(ModelConfig.from_hf_dict(model.config.to_dict()))
    assert [n for n, _ in ours] == [n for n, _ in model.named_modules()]


def test_lora_on_qwen3_q_norm_is_refused(tmp_path):
    """Qwen3's q_norm is a module of the model (so a target entry names it) but not a projection: refused."""
    import json

    from multilora.runtime.adapters import AdapterError, load_peft_adapter, save_peft_adapter

    cfg = ModelConfig.from_hf_dict({**_qwen_dict(), "model_type": "qwen3"})
    save_peft_adapter(tmp_path, {(i, "q_proj"): (torch.zeros(2, 8), torch.zeros(8, 2)) for i in range(4)}, r=2,
                      lora_alpha=2, target_modules=["q_proj"])
    assert (0, "q_proj") in load_peft_adapter(tmp_path, cfg).modules
    f = tmp_path / "adapter_config.json"
    f.write_text(json.dumps({**json.loads(f.read_text()), "target_modules": ["q_proj", "q_norm"]}))
    with pytest.raises(AdapterError, match="q_norm"):
        load_peft_adapter(tmp_path, cfg)


# ------------------------------------------------------------------------------- Triton ops (interpreter)
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                    reason="the Triton kernels need TRITON_INTERPRET=1 on a CPU")
def test_qwen3_forward_with_triton_ops_equals_torch_ops(tmp_path):
    """The whole tiny Qwen3 (q/k norm fused into the Triton RoPE kernel, biases) with the Triton ops equals the
    torch ops: a prefill of two prompts, then a decode step (fp32; the interpreter on a CPU)."""
    model = _make_model("qwen3-tied-mqa-bias")
    model.save_pretrained(str(tmp_path))
    e = Engine(model=str(tmp_path), device="cpu", progress=False, max_batch_size=2, max_seq_len=64, kv_block_size=4)
    steps = [([[5, 7, 9, 11, 13], [3, 1]], [0, 0]), ([[2], [4]], [5, 2])]
    tables = [[1, 2], [3]]
    out = {}
    for backend in ("torch", "triton"):
        hs = []
        for ids, starts in steps:
            plan = e.runner.build_plan(ids, starts, tables, [-1] * len(ids), block_size=4)
            hs.append(e.model.forward(plan, e.kv, ops_backend=backend))
        out[backend] = hs
    for a, b in zip(out["torch"], out["triton"]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
