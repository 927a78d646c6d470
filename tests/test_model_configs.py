"""The decoder on Llama-family configs other than SmolLM2's, against HF transformers (fp32, CPU).

Each case is a tiny random model made with ``transformers`` (``save_pretrained``, safetensors) plus the
SmolLM2 tokenizer saved beside it, loaded with ``Engine(model=dir)``. The reference is transformers' own
forward and greedy ``generate`` on the same weights: GQA and MQA, untied and tied embeddings, an explicit
``head_dim`` (q width != hidden), RoPE theta, Llama 3.1 ``llama3`` and ``linear`` RoPE scaling over
sequences longer than the original context, and Mistral's sliding window over sequences longer than the
window. Where a config knob is the point of a case, a sanity check shows the knob changes the reference
(so a runtime that ignored it would fail). A peft adapter on the tiny Llama checks LoRA on a GQA model.
"""

from __future__ import annotations

import shutil

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from testsupport import hf_greedy, peft_adapters, rel_err  # noqa: E402

from multilora import Engine, SamplingParams  # noqa: E402
from multilora.runtime.weights import default_model_path  # noqa: E402

VOCAB = 49152  # the SmolLM2 tokenizer's size
REL_TOL = 1e-4  # fp32 vs fp32: observed ~4e-7 (reduction order); the bound is 1e-4
GEN_TOKENS = 8

BASE = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
    # a wide init spreads the logits, so greedy top-2 gaps are far above fp32 noise (no near-ties)
    initializer_range=0.2,
)
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 32}

# name -> (model class name, config class name, config overrides, prompt lengths)
CASES = {
    "llama-gqa-untied": ("LlamaForCausalLM", "LlamaConfig", dict(tie_word_embeddings=False, rope_theta=10000.0), (9, 17, 1)),
    "llama-mqa-head-dim": ("LlamaForCausalLM", "LlamaConfig",
                           dict(num_attention_heads=6, num_key_value_heads=1, head_dim=24, hidden_size=96), (7, 13)),
    "llama31-rope-llama3": ("LlamaForCausalLM", "LlamaConfig",
                            dict(rope_theta=500000.0, rope_scaling=LLAMA3_SCALING), (48, 40, 33)),
    "llama-rope-linear": ("LlamaForCausalLM", "LlamaConfig",
                          dict(rope_theta=10000.0, rope_scaling={"rope_type": "linear", "factor": 4.0}), (40, 21)),
    "mistral-sliding-window": ("MistralForCausalLM", "MistralConfig", dict(sliding_window=4), (12, 11, 5)),
    "llama-tied": ("LlamaForCausalLM", "LlamaConfig", dict(tie_word_embeddings=True, num_key_value_heads=4), (10, 3)),
}


def _tokenizer_dir(tmp_path_factory) -> object:
    """The SmolLM2 tokenizer saved once per test session (reading it from the GGUF takes ~5 s)."""
    d = tmp_path_factory.getbasetemp() / "smollm2-tokenizer"
    if not (d / "tokenizer_config.json").is_file():
        p = default_model_path()
        tok = transformers.AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
        assert len(tok) == VOCAB
        tok.save_pretrained(str(d))
    return d


def _make_model(name, tmp_path_factory, **extra):
    cls_name, cfg_name, overrides, _ = CASES[name]
    cfg = getattr(transformers, cfg_name)(**{**BASE, **overrides, **extra})
    torch.manual_seed(0)
    model = getattr(transformers, cls_name)(cfg).eval()
    return model


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return _tokenizer_dir(tmp_path_factory)


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory, tok_dir):
    name = request.param
    model = _make_model(name, tmp_path_factory)
    d = tmp_path_factory.mktemp(name)
    model.save_pretrained(str(d))
    for f in tok_dir.iterdir():
        shutil.copy(f, d)
    assert list(d.glob("*.safetensors"))
    engine = Engine(model=str(d), progress=False, max_batch_size=4)
    g = torch.Generator().manual_seed(7)
    rows = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in CASES[name][3]]
    return name, model, engine, rows


def _hf_last_logits(model, rows):
    with torch.no_grad():
        return [model(input_ids=torch.tensor([r])).logits[0, -1].float() for r in rows]


def test_config_read_from_config_json(case):
    name, model, engine, _ = case
    hf, c = model.config, engine.config
    assert (c.vocab_size, c.hidden_size, c.num_layers) == (hf.vocab_size, hf.hidden_size, hf.num_hidden_layers)
    assert (c.num_heads, c.num_kv_heads, c.head_dim) == (hf.num_attention_heads, hf.num_key_value_heads, hf.head_dim)
    assert c.tie_word_embeddings == bool(hf.tie_word_embeddings)
    if name == "mistral-sliding-window":
        assert c.sliding_window == 4
    if name == "llama-tied":
        assert engine.model.lm_head is engine.model.embed
    if name == "llama-gqa-untied":
        assert engine.model.lm_head is not engine.model.embed


def test_logits_match_transformers(case):
    name, model, engine, rows = case
    ours = engine.logits(rows, adapters=None)
    assert ours.dtype == torch.float32 and ours.shape == (len(rows), VOCAB)
    for i, ref in enumerate(_hf_last_logits(model, rows)):
        assert rel_err(ours[i], ref) < REL_TOL, (name, i, rel_err(ours[i], ref))


def test_greedy_generate_matches_transformers(case):
    name, model, engine, rows = case
    outs = engine.generate(rows, adapters=None,
                           sampling=SamplingParams(max_tokens=GEN_TOKENS, temperature=0.0, ignore_eos=True))
    for r, out in zip(rows, outs):
        ref_ids = hf_greedy(model, r, GEN_TOKENS)
        assert len(ref_ids) == GEN_TOKENS
        assert out.token_ids == ref_ids, (name, len(r))
        assert out.finish_reason == "length" and out.prompt_token_ids == r


@pytest.mark.parametrize("name,knob", [
    ("llama31-rope-llama3", dict(rope_scaling=None)),
    ("llama-rope-linear", dict(rope_scaling=None)),
    ("mistral-sliding-window", dict(sliding_window=None)),
    ("llama-gqa-untied", dict(rope_theta=500000.0)),
])
def test_config_knob_changes_the_reference(name, knob, tmp_path_factory):
    """Sanity: with these prompt lengths the knob under test changes transformers' logits, so the
    comparisons above would catch a runtime that ignored it."""
    with_knob = _make_model(name, tmp_path_factory)
    without = _make_model(name, tmp_path_factory, **knob)
    without.load_state_dict(with_knob.state_dict())
    g = torch.Generator().manual_seed(7)
    row = torch.randint(3, VOCAB, (max(CASES[name][3]),), generator=g).tolist()
    a, b = _hf_last_logits(with_knob, [row])[0], _hf_last_logits(without, [row])[0]
    assert rel_err(a, b) > 1e-3, f"{name}: {knob} barely changes the reference ({rel_err(a, b):.2e})"


@pytest.mark.parametrize("case", ["llama31-rope-llama3", "llama-rope-linear"], indirect=True)
def test_transformers_4_style_config_json(case, tmp_path):
    """Checkpoints written by transformers 4.x keep ``rope_theta`` / ``rope_scaling`` at the top level of
    config.json (Llama 3.1's own file does); the engine reads them the same way."""
    import json

    name, model, engine, rows = case

    src = engine.model_path
    d = tmp_path / "v4"
    shutil.copytree(src, d)
    cfg = json.loads((d / "config.json").read_text())
    rope = cfg.pop("rope_parameters")
    cfg["rope_theta"] = rope.pop("rope_theta")
    cfg["rope_scaling"] = rope
    (d / "config.json").write_text(json.dumps(cfg))
    e = Engine(model=str(d), progress=False)
    assert e.config.rope_scaling["rope_type"] == rope["rope_type"] and e.config.rope_theta == cfg["rope_theta"]
    ours = e.logits(rows)
    for i, ref in enumerate(_hf_last_logits(model, rows)):
        assert rel_err(ours[i], ref) < REL_TOL, (name, i)


# ------------------------------------------------------------------------------ peft on a GQA Llama
PEFT_ADAPTERS = {
    "qv-r4": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    "all-r3-rslora": dict(r=3, lora_alpha=5, use_rslora=True,
                          target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    "mlp-layer1-r16": dict(r=16, lora_alpha=16, target_modules=["gate_proj", "down_proj"], layers_to_transform=[1],
                           rank_pattern={"down_proj": 5}),
}


@pytest.fixture(scope="module")
def peft_setup(tmp_path_factory, tok_dir):
    base = _make_model("llama-gqa-untied", tmp_path_factory)
    d = tmp_path_factory.mktemp("peft-base")
    base.save_pretrained(str(d))
    for f in tok_dir.iterdir():
        shutil.copy(f, d)
    names = list(PEFT_ADAPTERS)
    out = tmp_path_factory.mktemp("peft-adapters")
    model = peft_adapters(base, PEFT_ADAPTERS, out, std=0.3, seed=11)
    engine = Engine(model=str(d), progress=False, max_batch_size=8)
    for n in names:
        engine.load_adapter(n, out / n)
    return model, engine


def test_peft_adapters_mixed_batch_logits(peft_setup):
    model, engine = peft_setup
    g = torch.Generator().manual_seed(5)
    batch = [("qv-r4", 9), (None, 4), ("all-r3-rslora", 15), ("mlp-layer1-r16", 7), (None, 12), ("qv-r4", 1)]
    rows = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for _, n in batch]
    ours = engine.logits(rows, adapters=[a for a, _ in batch])
    with torch.no_grad():
        for i, ((a, _), r) in enumerate(zip(batch, rows)):
            ref = model(input_ids=torch.tensor([r]), adapter_names=[a or "__base__"]).logits[0, -1]
            assert rel_err(ours[i], ref) < REL_TOL, (a, rel_err(ours[i], ref))
            if a is not None:  # the adapter visibly changes the output (an ignored adapter would fail)
                base = model(input_ids=torch.tensor([r]), adapter_names=["__base__"]).logits[0, -1]
                assert rel_err(ref, base) > 1e-2, a
