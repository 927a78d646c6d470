"""Gemma 2 on the one decoder, against HF transformers and peft (fp32, CPU).

Tiny random models made with transformers' own ``Gemma2Config`` / ``Gemma2ForCausalLM``, saved with
``save_pretrained`` and loaded with ``Engine(model=dir)``: RMSNorm times ``1 + weight``, embeddings times
sqrt(hidden), GeGLU, the norms of the attention and MLP outputs, ``query_pre_attn_scalar`` (not ``head_dim``),
attention and final-logit soft-capping with caps small enough that tanh saturates, alternating sliding-window
layers with prompts longer than the window, ``head_dim`` independent of hidden / heads, tied and untied
embeddings. transformers initialises the norm weights to 0 (a scale of 1) and biases to 0, which would hide a
runtime that ignored them, so they are redrawn before saving. References: transformers' forward and greedy
``generate`` (its eager attention, the one that soft-caps), and peft's mixed-batch ``adapter_names=`` forward.

Also: the config fields and their defaults as transformers reads them, the refused configurations, GGUF files
written with the ``gguf`` library's writer (loaded by us and by transformers' GGUF loader), and the Triton ops and
attention (interpreter) against the torch ones.
"""

from __future__ import annotations

import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from testsupport import (  # noqa: E402,F401  (one_thread: autouse)
    LORA_PATHS, add_gguf_test_tokenizer, hf_greedy, hf_last_logits, lora_path, one_thread, peft_adapters, rel_err,
    saved_engine, token_rows)

from multilora import Engine, SamplingParams  # noqa: E402
from multilora.config import ModelConfig  # noqa: E402

VOCAB = 1000
REL_TOL = 1e-5  # fp32 vs fp32: observed <= 1e-6 (GEMM reduction order)
GEN_TOKENS = 16
WINDOW = 6

BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, max_position_embeddings=256, rms_norm_eps=1e-6, bos_token_id=1,
            eos_token_id=2, pad_token_id=0, initializer_range=0.2)  # a wide init: greedy top-2 gaps above fp32 noise

# name -> (config overrides, prompt lengths). Layers 0 and 2 slide (Gemma2Config's default layer_types); the
# prompts are longer than the window, and generating 16 tokens takes the short ones past it too.
CASES = {
    # head_dim 32 != hidden / heads (16), query_pre_attn_scalar 24 != head_dim; caps 2 and 3: saturated
    "gemma2": (dict(sliding_window=WINDOW, query_pre_attn_scalar=24, attn_logit_softcapping=2.0,
                    final_logit_softcapping=3.0), (14, 25, 1)),
    # untied lm_head, MQA, biases on q/k/v/o, no soft-capping (null in config.json), its own layer_types
    "gemma2-untied-mqa-bias-nocap": (dict(tie_word_embeddings=False, num_key_value_heads=1, head_dim=16,
                                          attention_bias=True, query_pre_attn_scalar=20, attn_logit_softcapping=None,
                                          final_logit_softcapping=None, sliding_window=4,
                                          layer_types=["full_attention", "sliding_attention", "sliding_attention"]),
                                     (9, 17, 3)),
}


def _make_model(name, **extra):
    overrides, _ = CASES[name]
    cfg = transformers.Gemma2Config(**{**BASE, **overrides, **extra})
    torch.manual_seed(0)
    model = transformers.Gemma2ForCausalLM(cfg).eval()
    assert model.config._attn_implementation == "eager"  # the one that soft-caps (Gemma 2 has no SDPA path)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():  # norm weights ~ N(0, 0.3^2) (scales 1 + w), biases ~ N(0, 0.5^2): not the init's zeros
        for pname, p in model.named_parameters():
            if pname.endswith("norm.weight"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
            elif pname.endswith(".bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return model


def _rows(name, seed=7):
    return token_rows(VOCAB, CASES[name][1], seed)


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    name = request.param
    model = _make_model(name)
    return name, model, saved_engine(model, tmp_path_factory, name), _rows(name)


def test_config_read_from_config_json(case):
    name, model, engine, _ = case
    hf, c = model.config, engine.config
    assert c.architecture == "gemma2" and c.hidden_act == "gelu_pytorch_tanh"
    assert c.norm_unit_offset and c.scale_embeddings and c.block_output_norms
    assert (c.num_heads, c.num_kv_heads, c.head_dim) == (hf.num_attention_heads, hf.num_key_value_heads, hf.head_dim)
    assert (engine.model.lm_head is engine.model.embed) == bool(hf.tie_word_embeddings)
    assert (c.attn_logit_softcapping, c.final_logit_softcapping) == (hf.attn_logit_softcapping,
                                                                     hf.final_logit_softcapping)
    attn = [layer.self_attn for layer in model.model.layers]
    assert [c.window(i) for i in range(c.num_layers)] == [a.sliding_window or 0 for a in attn]
    assert c.attn_scale == pytest.approx(attn[0].scaling, rel=1e-12) and c.attn_scale != c.head_dim ** -0.5
    assert c.qkv_bias == c.o_bias == bool(hf.attention_bias)
    assert engine.model.embed_scale == float(model.model.embed_tokens.embed_scale)


def test_logits_match_transformers(case):
    name, model, engine, rows = case
    ours = engine.logits(rows, adapters=None)
    assert ours.dtype == torch.float32 and ours.shape == (len(rows), VOCAB)
    for i, ref in enumerate(hf_last_logits(model, rows)):
        assert rel_err(ours[i], ref) < REL_TOL, (name, i, rel_err(ours[i], ref))


def test_greedy_generate_matches_transformers(case):
    """One batch of every prompt, 16 tokens each: decode steps through the sliding window and the soft-caps."""
    name, model, engine, rows = case
    outs = engine.generate(rows, adapters=None,
                           sampling=SamplingParams(max_tokens=GEN_TOKENS, temperature=0.0, ignore_eos=True))
    for r, out in zip(rows, outs):
        assert out.token_ids == hf_greedy(model, r, GEN_TOKENS), (name, len(r))


@pytest.mark.parametrize("what", ["norms", "embed_scale", "attn_softcap", "final_softcap", "window",
                                  "query_pre_attn_scalar"])
def test_family_knob_changes_the_reference(what):
    """Sanity: each Gemma 2 piece changes transformers' logits on these prompts, so the comparisons above would
    catch a runtime that ignored it: norm weights reset to 0 (scale 1); the embedding scale set to 1; either
    soft-cap off; the sliding window wider than the prompts; the attention scale ``head_dim ** -0.5``."""
    extra = dict(attn_softcap=dict(attn_logit_softcapping=None), final_softcap=dict(final_logit_softcapping=None),
                 window=dict(sliding_window=4096), query_pre_attn_scalar=dict(query_pre_attn_scalar=32)).get(what, {})
    model = _make_model("gemma2")
    other = _make_model("gemma2", **extra)
    other.load_state_dict(model.state_dict())
    with torch.no_grad():
        if what == "norms":
            for pname, p in other.named_parameters():
                if pname.endswith("norm.weight"):
                    p.zero_()
        elif what == "embed_scale":
            other.model.embed_tokens.embed_scale.fill_(1.0)
    row = [max(_rows("gemma2"), key=len)]
    a, b = hf_last_logits(model, row)[0], hf_last_logits(other, row)[0]
    assert rel_err(a, b) > 1e-2, f"{what} barely changes the reference ({rel_err(a, b):.2e})"


def test_soft_caps_saturate(monkeypatch):
    """The caps of the "gemma2" case are active: raw attention scores (recorded from transformers' own attention
    function) reach well past the attention cap, and the capped logits come within 10% of the final cap."""
    from transformers.models.gemma2 import modeling_gemma2

    raw = []
    eager = modeling_gemma2.eager_attention_forward

    def spy(module, query, key, value, attention_mask, scaling=None, softcap=None, **kw):
        keys = modeling_gemma2.repeat_kv(key, module.num_key_value_groups)
        raw.append(float((query @ keys.transpose(2, 3) * scaling).abs().max()))
        return eager(module, query, key, value, attention_mask, scaling=scaling, softcap=softcap, **kw)

    monkeypatch.setattr(modeling_gemma2, "eager_attention_forward", spy)
    model = _make_model("gemma2")
    logits = hf_last_logits(model, _rows("gemma2"))
    cfg = model.config
    assert len(raw) == 3 * cfg.num_hidden_layers and max(raw) > 2 * cfg.attn_logit_softcapping, raw
    assert max(float(x.abs().max()) for x in logits) > 0.9 * cfg.final_logit_softcapping


# ----------------------------------------------------------------------------------------- peft adapters
PEFT_ADAPTERS = {
    "qkv-r4": dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj"]),
    "all-r8-rslora": dict(r=8, lora_alpha=5, use_rslora=True,
                          target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    "mlp-o-r2-patterns": dict(r=2, lora_alpha=4, target_modules=["o_proj", "gate_proj", "up_proj", "down_proj"],
                              rank_pattern={"down_proj": 6, "layers.0.mlp.gate_proj": 3}, alpha_pattern={"up_proj": 3},
                              layers_to_transform=[0, 2]),
    "all-linear-r3": dict(r=3, lora_alpha=6, target_modules="all-linear", rank_pattern={"v_proj": 5}),
}
BATCH = [("qkv-r4", 9), (None, 4), ("all-r8-rslora", 19), ("mlp-o-r2-patterns", 7), (None, 12), ("qkv-r4", 1),
         ("all-linear-r3", 15)]


@pytest.fixture(scope="module")
def peft_setup(tmp_path_factory):
    base = _make_model("gemma2")
    d = tmp_path_factory.mktemp("peft-base-gemma2")
    base.save_pretrained(str(d))
    out = tmp_path_factory.mktemp("peft-adapters-gemma2")
    model = peft_adapters(base, PEFT_ADAPTERS, out, std=0.3, seed=11)
    engine = Engine(model=str(d), progress=False, max_batch_size=8)
    for n in PEFT_ADAPTERS:
        engine.load_adapter(n, out / n)
    return model, engine, out


def _batch_rows(seed=5):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for _, n in BATCH]


def test_peft_adapter_targets(peft_setup):
    """The adapters' modules and ranks as peft made them (rank_pattern by module name and by full path)."""
    from multilora.runtime.adapters import load_peft_adapter

    _, engine, out = peft_setup
    pat = load_peft_adapter(out / "mlp-o-r2-patterns", engine.config)
    assert sorted({i for i, _ in pat.modules}) == [0, 2]
    assert {m: w.rank for (i, m), w in pat.modules.items() if i == 0} == dict(o_proj=2, gate_proj=3, up_proj=2,
                                                                             down_proj=6)
    assert pat.modules[(2, "up_proj")].scaling == 1.5 and pat.modules[(2, "gate_proj")].rank == 2
    al = load_peft_adapter(out / "all-linear-r3", engine.config)
    assert len(al.modules) == 3 * 7 and al.modules[(1, "v_proj")].rank == 5


@LORA_PATHS
def test_peft_adapters_mixed_batch_logits(peft_setup, deferred, monkeypatch):
    model, engine, _ = peft_setup
    calls = lora_path(engine, deferred, monkeypatch)  # in place after / before the GEMM, or deferred
    rows = _batch_rows()
    ours = engine.logits(rows, adapters=[a for a, _ in BATCH])
    assert (calls["lora_delta"] > 0) == (deferred is not False), calls  # the path asked for ran
    for i, ((a, _), r) in enumerate(zip(BATCH, rows)):
        ref = hf_last_logits(model, [r], adapter_names=[a or "__base__"])[0]
        assert rel_err(ours[i], ref) < REL_TOL, (a, rel_err(ours[i], ref))
        if a is not None:  # the adapter visibly changes the output (an ignored adapter would fail)
            base = hf_last_logits(model, [r], adapter_names=["__base__"])[0]
            assert rel_err(ref, base) > 1e-2, a
    alone = engine.logits([rows[1], rows[4]], adapters=None)  # rows without an adapter: the base model
    assert rel_err(ours[1], alone[0]) < REL_TOL and rel_err(ours[4], alone[1]) < REL_TOL


@LORA_PATHS
def test_peft_adapters_greedy_generate(peft_setup, deferred, monkeypatch):
    model, engine, _ = peft_setup
    lora_path(engine, deferred, monkeypatch)  # in place after / before the GEMM, or deferred
    rows = _batch_rows(seed=6)
    outs = engine.generate(rows, adapters=[a for a, _ in BATCH],
                           sampling=SamplingParams(max_tokens=GEN_TOKENS, temperature=0.0, ignore_eos=True))
    for (a, _), r, out in zip(BATCH, rows, outs):
        assert out.token_ids == hf_greedy(model, r, GEN_TOKENS, adapter_names=[a or "__base__"]), a


def test_module_names_match_transformers():
    """The module list the PEFT target rules match against is the HF Gemma 2 model's own ``named_modules``."""
    from multilora.runtime.adapters.targets import _decoder_module_names

    model = _make_model("gemma2")
    ours = _decoder_module_names(ModelConfig.from_hf_dict(model.config.to_dict()))
    assert [n for n, _ in ours] == [n for n, _ in model.named_modules()]


# ------------------------------------------------------------------------------------- config.json reading
def _gemma2_dict(**kw):
    return dict(model_type="gemma2", vocab_size=10, hidden_size=32, intermediate_size=16, num_hidden_layers=4,
                num_attention_heads=2, num_key_value_heads=1, **kw)


def test_missing_fields_take_gemma2config_defaults():
    """A config.json that leaves fields out (``save_pretrained`` drops values equal to the defaults) is read with
    Gemma2Config's defaults, as transformers reads it: tied embeddings, caps 50 / 30, ``query_pre_attn_scalar``
    256, ``head_dim`` 256, window 4096 on the even layers, eps 1e-6."""
    c = ModelConfig.from_hf_dict(_gemma2_dict())
    hf = transformers.Gemma2Config(**{k: v for k, v in _gemma2_dict().items() if k != "model_type"})
    assert c.tie_word_embeddings is hf.tie_word_embeddings is True
    assert (c.attn_logit_softcapping, c.final_logit_softcapping) == (hf.attn_logit_softcapping,
                                                                     hf.final_logit_softcapping) == (50.0, 30.0)
    assert (c.query_pre_attn_scalar, c.head_dim, c.rms_norm_eps) == (hf.query_pre_attn_scalar, hf.head_dim,
                                                                     hf.rms_norm_eps)
    assert c.layer_types == hf.layer_types and [c.window(i) for i in range(4)] == [4096, 0, 4096, 0]
    assert c.hidden_act == hf.hidden_activation
    c = ModelConfig.from_hf_dict(_gemma2_dict(attn_logit_softcapping=None, final_logit_softcapping=None,
                                              sliding_window=None))
    assert c.attn_logit_softcapping is c.final_logit_softcapping is None and c.window(0) == 0


@pytest.mark.parametrize("cfg,match", [
    (_gemma2_dict(hidden_activation="gelu"), r"hidden_activation must be 'gelu_pytorch_tanh'"),
    (_gemma2_dict(use_bidirectional_attention=True), r"use_bidirectional_attention=true is not supported"),
    (_gemma2_dict(attn_logit_softcapping=-1.0), r"attn_logit_softcapping must be a positive number"),
    (_gemma2_dict(layer_types=["sliding_attention"]), r"layer_types must list 4 entries"),
])
def test_refused_configs_name_the_field(cfg, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf_dict(cfg)


# --------------------------------------------------------------------------------------------------- GGUF
# HF module path (inside model.layers.N) -> llama.cpp tensor name (gguf-py MODEL_TENSORS[GEMMA2])
_GGUF_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
               "post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
               "post_feedforward_layernorm": "post_ffw_norm"}


def _gguf_tensor_name(key):
    if key == "model.embed_tokens.weight":
        return "token_embd.weight"
    if key == "model.norm.weight":
        return "output_norm.weight"
    parts = key.split(".")  # model.layers.N.<module path>.weight
    return f"blk.{parts[2]}.{_GGUF_NAMES['.'.join(parts[3:-1])]}.{parts[-1]}"


def write_gguf(model, path):
    """``model`` (a HF ``Gemma2ForCausalLM``, tied) as llama.cpp's converter writes it: F32 tensors, every norm
    weight plus 1, the soft-caps and window as metadata, a tiny byte-level BPE tokenizer (the engine loads the
    tokenizer of a GGUF file with transformers)."""

    gguf = pytest.importorskip("gguf")
    c = model.config
    w = gguf.GGUFWriter(str(path), "gemma2")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_rope_freq_base(float(c.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_sliding_window(c.sliding_window)
    w.add_attn_logit_softcapping(c.attn_logit_softcapping)
    w.add_final_logit_softcapping(c.final_logit_softcapping)
    add_gguf_test_tokenizer(w, c)
    for key, t in model.state_dict().items():
        if key == "lm_head.weight":
            continue  # tied: llama.cpp writes no output.weight
        t = t.detach().float()
        w.add_tensor(_gguf_tensor_name(key), (t + 1 if key.endswith("norm.weight") else t).numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# name -> (config overrides of "gemma2", compare with transformers' GGUF loader). transformers reads neither the
# soft-caps nor a query_pre_attn_scalar from a GGUF file (it keeps Gemma2Config's 50 / 30 / 256): the comparison
# with it uses those values (so head_dim 256); the small caps and head_dim 32 are checked against the HF model.
GGUF_CASES = {
    "hf-defaults-head-dim-256": (dict(head_dim=256, num_attention_heads=2, num_key_value_heads=1,
                                      query_pre_attn_scalar=256, attn_logit_softcapping=50.0,
                                      final_logit_softcapping=30.0), True),
    "small-caps-head-dim-32": (dict(query_pre_attn_scalar=32), False),
}


@pytest.mark.parametrize("name", list(GGUF_CASES))
def test_gguf_logits_match_the_hf_model_and_transformers_gguf_loader(name, tmp_path):
    overrides, with_transformers = GGUF_CASES[name]
    model = _make_model("gemma2", **overrides)
    path = tmp_path / "model.gguf"
    write_gguf(model, path)
    engine = Engine(model=str(path), progress=False, max_batch_size=4)
    c = engine.config
    assert (c.architecture, c.head_dim, c.attn_scale) == ("gemma2", model.config.head_dim,
                                                          model.model.layers[0].self_attn.scaling)
    assert [c.window(i) for i in range(c.num_layers)] == [WINDOW, 0, WINDOW]
    ref_sd = model.state_dict()
    for k, v in engine.model.layers[1].items():  # the norms came back as HF holds them (1 subtracted)
        if k.endswith("norm"):
            hf_name = dict(in_norm="input_layernorm", post_norm="pre_feedforward_layernorm",
                           attn_out_norm="post_attention_layernorm", mlp_out_norm="post_feedforward_layernorm")[k]
            torch.testing.assert_close(v, ref_sd[f"model.layers.1.{hf_name}.weight"], rtol=0, atol=1e-7)
    rows = _rows("gemma2")
    ours = engine.logits(rows)
    theirs = None
    if with_transformers:
        theirs = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name,
                                                                   dtype=torch.float32).eval()
    with torch.no_grad():
        for i, r in enumerate(rows):
            ref = model(input_ids=torch.tensor([r])).logits[0, -1]
            assert rel_err(ours[i], ref) < REL_TOL, (name, i, rel_err(ours[i], ref))
            if theirs is not None:
                t = theirs(input_ids=torch.tensor([r])).logits[0, -1]
                assert rel_err(ours[i], t) < REL_TOL, (name, i, rel_err(ours[i], t))


@pytest.mark.parametrize("layers,scalar", [(26, 256.0), (42, 256.0), (46, 144.0)])
def test_gguf_attention_scale_follows_llama_cpp(layers, scalar, tmp_path):
    """No GGUF key holds ``query_pre_attn_scalar``: llama.cpp scales by ``head_dim ** -0.5``, except for the
    46-layer Gemma 2 27B (hidden 4608, 32 heads, head_dim 128), whose scale is ``(hidden / heads) ** -0.5`` (its
    HF config's 144). Files of those shapes' metadata (tensors left out) read the same here."""
    from multilora.runtime.weights import config_from_gguf

    g = pytest.importorskip("gguf")

    w = g.GGUFWriter(str(tmp_path / "m.gguf"), "gemma2")
    hidden, heads, head_dim = (4608, 32, 128) if layers == 46 else (2304, 8, 256)
    for add, v in ((w.add_block_count, layers), (w.add_embedding_length, hidden), (w.add_head_count, heads),
                   (w.add_head_count_kv, heads // 2), (w.add_key_length, head_dim), (w.add_feed_forward_length, 64),
                   (w.add_sliding_window, 4096)):
        add(v)
    w.add_tensor("token_embd.weight", torch.zeros(4, 8).numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    c = config_from_gguf(g.GGUFReader(str(tmp_path / "m.gguf")), vocab_size=4)
    assert c.query_pre_attn_scalar == scalar and c.head_dim == head_dim
    assert (c.attn_logit_softcapping, c.final_logit_softcapping) == (50.0, 30.0)  # llama.cpp's defaults
    assert [c.window(i) for i in range(4)] == [4096, 0, 4096, 0]


# ------------------------------------------------------------------------------- Triton ops (interpreter)
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                    reason="the Triton kernels need TRITON_INTERPRET=1 on a CPU")
def test_gemma2_forward_with_triton_kernels_equals_torch(tmp_path):
    """The whole tiny Gemma 2 with the Triton ops (1 + w norms, normed deltas, GELU_tanh) and the Triton attention
    (soft-capping, sliding window) equals the torch ops and attention: a prefill of a prompt longer than the
    window and a short one, then a decode step (fp32; the interpreter on a CPU)."""
    model = _make_model("gemma2")
    model.save_pretrained(str(tmp_path))
    e = Engine(model=str(tmp_path), device="cpu", progress=False, max_batch_size=2, max_seq_len=64, kv_block_size=4)
    steps = [([list(range(3, 17)), [3, 1]], [0, 0]), ([[2], [4]], [14, 2])]
    tables = [[1, 2, 3, 4], [5]]
    out = {}
    for backend in ("torch", "triton"):
        hs = []
        for ids, starts in steps:
            plan = e.runner.build_plan(ids, starts, tables, [-1] * len(ids), block_size=4)
            hs.append(e.model.forward(plan, e.kv, ops_backend=backend, attention_backend=backend))
        out[backend] = hs
    for a, b in zip(out["torch"], out["triton"]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------- Triton codegen (sm_90)
_COMPILE = r'''
import json, re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from multilora.kernels import triton_attention as ta, triton_fused as tf

def ptx(fn, ptrs, consts, floats, opts):
    names = fn.arg_names
    sig = {n: ptrs.get(n) or ("constexpr" if n in consts else "fp32" if n in floats else "i32") for n in names}
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(n),): v for n, v in consts.items()},
                    attrs={(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if n in ptrs})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts).asm["ptx"]

bf = "*bf16"
out = {}
ptrs = {p: bf for p in ("x_ptr", "d_ptr", "l_ptr", "w_ptr", "dw_ptr", "out_ptr")}
fp8 = {"q_ptr": "*fp8e4nv", "s_ptr": "*fp32"}  # quant=True: the next fp8 GEMM's per-token input, written beside
f8s = {"fp8_max", "min_scale"}
out["rms_norm"] = len(ptx(tf._rms_norm_kernel, ptrs | fp8, dict(HAS_DELTA=True, HAS_LORA=True, DELTA_NORM=True,
                                                             UNIT_OFFSET=True, BLOCK=4096, QUANT=True),
                          {"eps"} | f8s, {"num_warps": 8}))
out["gelu_tanh_mul"] = len(ptx(tf._glu_kernel, {"gu_ptr": bf, "l_ptr": bf, "out_ptr": bf} | fp8,
                               dict(GELU_TANH=True, HAS_LORA=True, BLOCK=1024), f8s, {"num_warps": 4}))
out["silu_mul/quant"] = len(ptx(tf._glu_kernel, {"gu_ptr": bf, "l_ptr": bf, "out_ptr": bf} | fp8,
                                dict(GELU_TANH=False, HAS_LORA=False, BLOCK=16384, QUANT=True), f8s, {"num_warps": 16}))
ptrs = {p: bf for p in ("qkv_ptr", "l_ptr", "q_ptr", "kc_ptr", "vc_ptr", "qn_ptr", "kn_ptr")}
ptrs |= {"cos_ptr": "*fp32", "sin_ptr": "*fp32", "pos_ptr": "*i64", "slot_ptr": "*i64"}
out["rope_kv/lora"] = len(ptx(tf._rope_kv_kernel, ptrs, dict(H=8, HKV=4, HEAD_DIM=256, HALF=128, BLOCK_H=8,
                                                             BLOCK_HKV=4, BLOCK_HALF=128, HAS_NORM=False,
                                                             HAS_LORA=True), {"eps"}, {"num_warps": 4}))
ptrs = {p: bf for p in ("out_ptr", "q_ptr", "k_ptr", "v_ptr")} | {"part_o_ptr": "*fp32", "part_lse_ptr": "*fp32"}
ptrs |= {p: "*i32" for p in ("bt_ptr", "seq_lens_ptr", "qsl_ptr", "tiles_ptr")}
for decode in (True,):  # Gemma 2 2B / 9B: head_dim 256, 2 query heads per KV head (prefill: the same code, slower)
    bm, bn, w, s = ta._GPU_CONFIGS[(decode, False, True)]
    consts = dict(G=2, G_TILE=2, GROUPS=1, BLOCK_Q=1 if decode else bm // 2, BLOCK_M=16 if decode else bm,
                  BLOCK_N=bn, HEAD_DIM=256, BLOCK_SIZE=16, DECODE=decode, NUM_SPLITS=4 if decode else 1,
                  SLIDING=True, IEEE=False)
    for cap in (False, True):
        code = ptx(ta._paged_attention_kernel, ptrs, {**consts, "SOFTCAP": cap}, {"qk_scale", "cap_scale"},
                   {"num_warps": w, "num_stages": s})
        out[f"attention/{'decode' if decode else 'prefill'}/softcap={cap}"] = len(re.findall(r"ex2\.approx", code))
print(json.dumps(out))
'''


def test_gemma2_kernels_compile_for_sm90():
    """The interpreter runs Python the compiler refuses (it once took a ``dict()`` in the attention kernel), so the
    Gemma 2 variants are compiled for an H100/H200 (sm_90; Triton's wheel carries ptxas) here: the fused norm with a
    normed delta, ``1 + w`` and the LoRA delta's add, GELU_tanh * up and RoPE + KV write with it, and the decode attention kernel with and without its ``SOFTCAP``
    branch at head_dim 256 (the branch adds the exponentials of its tanh; the prefill variant runs the same
    ``_attend_range`` code and takes longer to compile, so it is left to the GPU tests)."""
    import json
    import subprocess
    import sys

    pytest.importorskip("triton.backends.nvidia", reason="Triton's NVIDIA backend (ptxas) is not installed")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    p = subprocess.run([sys.executable, "-c", _COMPILE], capture_output=True, text=True, timeout=600, env=env)
    if p.returncode != 0 and "ptxas" in p.stderr:
        pytest.skip(f"no ptxas for sm_90 here: {p.stderr[-300:]}")
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["rms_norm"] > 0 and out["gelu_tanh_mul"] > 0 and out["rope_kv/lora"] > 0 and out["silu_mul/quant"] > 0
    assert out["attention/decode/softcap=True"] > out["attention/decode/softcap=False"] > 0, out
