"""Phi-3 on the one decoder, against HF transformers and peft (fp32, CPU).

Tiny random models made with transformers' own ``Phi3Config`` / ``Phi3ForCausalLM``, saved with
``save_pretrained`` and loaded with ``Engine(model=dir)``: the checkpoint's fused ``qkv_proj`` / ``gate_up_proj``
weights, plain RoPE and ``longrope`` (short / long factors around ``original_max_position_embeddings``, the
attention factor), a sliding window, tied embeddings. transformers initialises norm weights to 1, which would
hide a runtime that ignored them, so every norm weight is redrawn before saving. References: transformers'
forward and greedy ``generate`` (which, for longrope, drops its cache and recomputes the sequence when it passes
the original length), and peft's mixed-batch ``adapter_names=`` forward for adapters on the fused names.
Also: the refused configurations and adapters, and the Triton ops (interpreter) against the torch ops.
"""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from testsupport import (  # noqa: E402,F401  (one_thread: autouse)
    hf_greedy, hf_last_logits, one_thread, peft_adapters, rel_err, saved_engine, token_rows)

from multilora import Engine, SamplingParams  # noqa: E402
from multilora.config import ModelConfig  # noqa: E402

VOCAB = 1000
REL_TOL = 1e-5  # fp32 vs fp32: observed <= 1e-6 (GEMM reduction order)
GEN_TOKENS = 10
ORIG = 16  # original_max_position_embeddings of the longrope cases
HEAD_DIM = 16  # hidden 64 / 4 heads: longrope factors have 8 entries

BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
            pad_token_id=0, initializer_range=0.2)  # a wide init: greedy top-2 gaps far above fp32 noise


def _longrope(seed=0, **extra):
    g = torch.Generator().manual_seed(seed)
    return dict(rope_type="longrope", rope_theta=10000.0, short_factor=(1 + torch.rand(8, generator=g)).tolist(),
                long_factor=(2 + 6 * torch.rand(8, generator=g)).tolist(), **extra)


# name -> (config overrides, prompt lengths). The longrope prompts sit below, at and above ORIG; with
# GEN_TOKENS new tokens the first two pass ORIG while generating.
CASES = {
    "phi3": (dict(), (9, 17, 1)),
    "phi3-tied-mha": (dict(tie_word_embeddings=True, num_key_value_heads=4), (10, 3)),
    "phi3-sliding": (dict(sliding_window=4), (12, 11, 5)),
    # factor from max_position_embeddings / original (64 / 16 = 4): attention factor sqrt(1 + ln 4 / ln 16)
    "phi3-longrope": (dict(max_position_embeddings=64, original_max_position_embeddings=ORIG,
                           rope_parameters=_longrope()), (10, 16, 20, 5)),
    # explicit attention_factor, GQA 4:1
    "phi3-longrope-af": (dict(max_position_embeddings=64, original_max_position_embeddings=ORIG,
                              num_key_value_heads=1, rope_parameters=_longrope(1, attention_factor=1.3)), (14, 23)),
}


def _make_model(name, **extra):
    overrides, _ = CASES[name]
    cfg = transformers.Phi3Config(**{**BASE, **overrides, **extra})
    torch.manual_seed(0)
    model = transformers.Phi3ForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():  # norm weights ~ 1 + N(0, 0.3^2): not the init's 1
        for pname, p in model.named_parameters():
            if pname.endswith("norm.weight"):
                p.copy_(1 + torch.randn(p.shape, generator=g) * 0.3)
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
    assert c.architecture == "phi3" and c.fused_projections
    assert (c.num_heads, c.num_kv_heads, c.head_dim) == (hf.num_attention_heads, hf.num_key_value_heads, HEAD_DIM)
    assert (engine.model.lm_head is engine.model.embed) == bool(hf.tie_word_embeddings)
    assert [c.window(i) for i in range(c.num_layers)] == [hf.sliding_window or 0] * c.num_layers
    rot = model.model.rotary_emb
    assert engine.model.rope_scale == pytest.approx(rot.attention_scaling, rel=1e-12)
    if "longrope" in name:
        assert c.rope_type == "longrope" and engine.model.rope_long_after == ORIG
        assert engine.scheduler.recompute_after == ORIG
        torch.testing.assert_close(engine.model.inv_freq.cpu(), rot.original_inv_freq.float(), rtol=1e-6, atol=0)
    else:
        assert c.rope_type == "default" and engine.model.rope_long_after == 0 and engine.model.rope_scale == 1.0


def test_logits_match_transformers(case):
    name, model, engine, rows = case
    ours = engine.logits(rows, adapters=None)
    assert ours.dtype == torch.float32 and ours.shape == (len(rows), VOCAB)
    for i, ref in enumerate(hf_last_logits(model, rows)):
        assert rel_err(ours[i], ref) < REL_TOL, (name, i, rel_err(ours[i], ref))


def test_greedy_generate_matches_transformers(case):
    """One batch of every prompt; for longrope the prompts of 10 and 16 tokens pass ORIG while generating (HF then
    recomputes the whole sequence with the long factors, and so does our scheduler)."""
    name, model, engine, rows = case
    outs = engine.generate(rows, adapters=None,
                           sampling=SamplingParams(max_tokens=GEN_TOKENS, temperature=0.0, ignore_eos=True))
    for r, out in zip(rows, outs):
        assert out.token_ids == hf_greedy(model, r, GEN_TOKENS), (name, len(r))


@pytest.mark.parametrize("what", ["norms", "long_factor", "short_factor", "attention_factor", "window"])
def test_family_knob_changes_the_reference(what):
    """Sanity: each piece changes transformers' logits, so the comparisons above would catch a runtime that
    ignored it: norm weights reset to 1; longrope's long factors (a prompt longer than ORIG) or short factors
    (a shorter one) swapped for the other set; the attention factor set to 1; the sliding window off."""
    name = {"norms": "phi3", "window": "phi3-sliding"}.get(what, "phi3-longrope")
    model = _make_model(name)
    rp = dict(CASES[name][0].get("rope_parameters") or {})
    extra = {}
    if what == "window":
        extra = dict(sliding_window=None)
    elif what in ("long_factor", "short_factor"):
        other = "short_factor" if what == "long_factor" else "long_factor"
        extra = dict(rope_parameters={**rp, what: rp[other]})
    elif what == "attention_factor":
        extra = dict(rope_parameters={**rp, "attention_factor": 1.0})
    other = _make_model(name, **extra)
    other.load_state_dict(model.state_dict())
    if what == "norms":
        with torch.no_grad():
            for pname, p in other.named_parameters():
                if pname.endswith("norm.weight"):
                    p.fill_(1.0)
    rows = _rows(name)  # lengths 10 (short factors) and 20 (long factors) among them
    row = [next(r for r in rows if len(r) == 10)] if what == "short_factor" else [max(rows, key=len)]
    a, b = hf_last_logits(model, row)[0], hf_last_logits(other, row)[0]
    assert rel_err(a, b) > 1e-3, f"{name}: {what} barely changes the reference ({rel_err(a, b):.2e})"


# ------------------------------------------------------------------------------------- longrope choice
def test_longrope_factor_choice_per_sequence_length(tmp_path):
    """Which RoPE table row each token reads (``DecoderModel._rope_rows``): the short-factor rows while its sequence
    has at most ORIG tokens after the step, the long-factor rows (``rope_long_offset`` further) beyond; decided per
    sequence in a mixed prefill and from the positions in a decode step. The tables equal transformers' cos / sin
    (short from ``original_inv_freq``, long from its ``long_inv_freq``), both times the attention factor."""
    model = _make_model("phi3-longrope")
    model.save_pretrained(str(tmp_path))
    e = Engine(model=str(tmp_path), progress=False, max_batch_size=4, max_seq_len=64, kv_block_size=4)
    m = e.model
    n = m.rope_long_offset
    assert e.kv.num_blocks > 45, e.kv.num_blocks
    assert n >= 64 and m.rope_cos.shape == (2 * n, HEAD_DIM)
    lens = [ORIG - 1, ORIG, ORIG + 1, 3]
    ids = [[5] * k for k in lens]
    plan = e.runner.build_plan(ids, [0] * 4, [list(range(1 + 5 * i, 6 + 5 * i)) for i in range(4)], [-1] * 4,
                               block_size=4)
    rows = m._rope_rows(plan).tolist()
    want = [p + (n if k > ORIG else 0) for k in lens for p in range(k)]
    assert rows == want
    # decode: one token per sequence at position p, its sequence then has p + 1 tokens
    starts = [ORIG - 2, ORIG - 1, ORIG, 40]
    plan = e.runner.build_plan([[5]] * 4, starts, [list(range(1 + 11 * i, 12 + 11 * i)) for i in range(4)],
                               [-1] * 4, block_size=4)
    assert m._rope_rows(plan).tolist() == [ORIG - 2, ORIG - 1, ORIG + n, 40 + n]
    # the tables against transformers' own frequencies
    rot = model.model.rotary_emb
    with torch.no_grad():
        cos_long, sin_long = rot(torch.zeros(1), torch.arange(30)[None])  # its sequence length 30 > ORIG: long
        cos_short, sin_short = rot(torch.zeros(1), torch.arange(ORIG)[None])  # ORIG: short
    for ours, ref in ((m.rope_cos[n:n + 30], cos_long), (m.rope_sin[n:n + 30], sin_long),
                      (m.rope_cos[:ORIG], cos_short), (m.rope_sin[:ORIG], sin_short)):
        torch.testing.assert_close(ours.cpu(), ref[0], rtol=1e-5, atol=1e-5)
    af = math.sqrt(1 + math.log(64 / ORIG) / math.log(ORIG))
    assert m.rope_scale == pytest.approx(af) and float(m.rope_cos[0, 0]) == pytest.approx(af)


@pytest.mark.parametrize("chunked", [True, False])
def test_longrope_recompute_when_a_sequence_passes_the_original_length(tmp_path, chunked):
    """A sequence admitted with at most ORIG tokens is recomputed (prefilled again whole, not counted as a
    preemption) at the step that takes it past ORIG, exactly once; one admitted longer never is. (Prefills: the
    rows whose chunk starts at position 0; chunked, the recompute runs beside the other request's decode.)"""
    model = _make_model("phi3-longrope")
    model.save_pretrained(str(tmp_path))
    e = Engine(model=str(tmp_path), progress=False, max_batch_size=4, enable_chunked_prefill=chunked)
    prefills = []
    sched = e.scheduler.schedule

    def spy():
        s = sched()
        rows = sorted(r.num_tokens for r in s.batch if r.computed == 0)
        if rows:
            assert all(r.chunk == r.num_tokens for r in s.batch if r.computed == 0)  # whole: within the budget
            prefills.append(rows)
        return s

    e.scheduler.schedule = spy
    e.generate([[7] * 12, [9] * 20], adapters=None, sampling=SamplingParams(max_tokens=8, ignore_eos=True))
    assert prefills == [[12, 20], [ORIG + 1]] and e.scheduler.preemptions == 0


def test_longrope_chunked_prefill_matches_transformers(tmp_path):
    """Chunks of 3 prompt tokens per step: a prompt longer than ORIG takes a first chunk of ORIG + 1 tokens (every
    key of it then carries the long factors, as transformers' one forward of the whole prompt), the others are cut
    in chunks; greedy generation still equals transformers'."""
    name = "phi3-longrope"
    model = _make_model(name)
    model.save_pretrained(str(tmp_path))
    e = Engine(model=str(tmp_path), progress=False, max_batch_size=4, max_num_batched_tokens=3)
    firsts = []
    sched = e.scheduler.schedule

    def spy():
        s = sched()
        firsts.extend((r.num_tokens, r.chunk) for r in s.batch if r.computed == 0)
        return s

    e.scheduler.schedule = spy
    rows = _rows(name)
    outs = e.generate(rows, adapters=None, sampling=SamplingParams(max_tokens=GEN_TOKENS, ignore_eos=True))
    for r, out in zip(rows, outs):
        assert out.token_ids == hf_greedy(model, r, GEN_TOKENS), (name, len(r))
    assert all(c == ORIG + 1 if n > ORIG else 1 <= c <= 3 for n, c in firsts), firsts  # (n, first chunk)
    assert any(n > ORIG for n, _ in firsts) and e.stats()["mixed_steps"] > 0


# ----------------------------------------------------------------- peft adapters on the fused projections
PEFT_ADAPTERS = {
    "qkv-r4": dict(r=4, lora_alpha=8, target_modules=["qkv_proj"]),
    "all-r8-rslora": dict(r=8, lora_alpha=5, use_rslora=True,
                          target_modules=["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]),
    "mlp-o-r2-patterns": dict(r=2, lora_alpha=4, target_modules=["gate_up_proj", "o_proj", "down_proj"],
                              rank_pattern={"gate_up_proj": 6}, alpha_pattern={"down_proj": 3},
                              layers_to_transform=[1]),
    "all-linear-r3": dict(r=3, lora_alpha=6, target_modules="all-linear", rank_pattern={"layers.0.self_attn.qkv_proj": 5}),
}


@pytest.fixture(scope="module", params=["phi3", "phi3-longrope"])
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
    return name, model, engine, out


BATCH = [("qkv-r4", 9), (None, 4), ("all-r8-rslora", 19), ("mlp-o-r2-patterns", 7), (None, 12), ("qkv-r4", 1),
         ("all-linear-r3", 15)]


def _batch_rows(seed=5):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for _, n in BATCH]


def test_fused_adapter_is_held_as_slices_sharing_a(peft_setup):
    """A ``qkv_proj`` adapter is q/k/v modules that each carry the file's A and their rows of its B; the
    all-linear one targets the four Phi-3 projections, with its rank_pattern."""
    from safetensors.torch import load_file

    from multilora.runtime.adapters import load_peft_adapter

    name, model, engine, out = peft_setup
    c = engine.config
    ad = load_peft_adapter(out / "qkv-r4", c)
    assert list(ad.modules) == [(i, m) for i in range(2) for m in ("q_proj", "k_proj", "v_proj")]
    t = load_file(str(out / "qkv-r4" / "adapter_model.safetensors"))
    key = "base_model.model.model.layers.1.self_attn.qkv_proj.lora_{}.weight"
    a, b = t[key.format("A")], t[key.format("B")]
    row = 0
    for m in ("q_proj", "k_proj", "v_proj"):
        w = ad.modules[(1, m)]
        n = c.module_shape(m)[1]
        assert torch.equal(w.a, a) and torch.equal(w.b, b[row:row + n]) and w.scaling == 2.0
        row += n
    assert row == b.shape[0]
    al = load_peft_adapter(out / "all-linear-r3", c)
    assert len(al.modules) == 2 * 7
    assert {m: w.rank for (i, m), w in al.modules.items() if i == 0} == dict(
        q_proj=5, k_proj=5, v_proj=5, o_proj=3, gate_proj=3, up_proj=3, down_proj=3)
    pat = load_peft_adapter(out / "mlp-o-r2-patterns", c)
    assert list(pat.modules) == [(1, m) for m in ("o_proj", "gate_proj", "up_proj", "down_proj")]
    assert pat.modules[(1, "gate_proj")].rank == 6 and pat.modules[(1, "down_proj")].scaling == 1.5


def test_fused_adapters_read_raw_finish_to_the_host_image(peft_setup):
    """The raw read of a fused-projection adapter (``read_image(..., raw=True)``: each slice's rows of the file's B
    into its region untransposed, the file's A into the first slice only) finishes, with torch and with the Triton
    kernel (interpreted on a CPU), to the host-finished image bit for bit: the other slices' A filled, B^T."""
    import os

    from multilora.kernels.image_finish import block_cols_for, finish_torch
    from multilora.runtime.adapters.image import read_image

    _, _, engine, out = peft_setup
    pool = engine.pool
    for n in PEFT_ADAPTERS:
        _, want = read_image(out / n, engine.config, pool, name=n)
        _, raw = read_image(out / n, engine.config, pool, name=n, raw=True)
        assert raw.finish is not None
        got = torch.empty_like(want.data)
        assert finish_torch(raw.data, got, raw.finish) == 0
        assert torch.equal(got.view(torch.int32), want.data.view(torch.int32)), n
        if os.environ.get("TRITON_INTERPRET") == "1" and not torch.cuda.is_available():
            from multilora.kernels.triton_image_finish import NO_BAD_OP, finish_inplace

            fin = raw.finish
            plan = fin.inplace_plan(fin.largest_transpose, block_cols_for(pool.max_rank))
            flags = torch.full((1,), NO_BAD_OP, dtype=torch.int32)
            k = raw.data.clone()  # the raw image where the pool would copy it, finished there
            finish_inplace(k, 0, plan, plan.tiles, torch.empty(fin.largest_transpose, dtype=pool.dtype), flags)
            assert int(flags[0]) == NO_BAD_OP and torch.equal(k.view(torch.int32), want.data.view(torch.int32)), n


def test_peft_adapters_mixed_batch_logits(peft_setup):
    name, model, engine, _ = peft_setup
    rows = _batch_rows()
    ours = engine.logits(rows, adapters=[a for a, _ in BATCH])
    for i, ((a, _), r) in enumerate(zip(BATCH, rows)):
        ref = hf_last_logits(model, [r], adapter_names=[a or "__base__"])[0]
        assert rel_err(ours[i], ref) < REL_TOL, (name, a, rel_err(ours[i], ref))
        if a is not None:  # the adapter visibly changes the output (an ignored adapter would fail)
            base = hf_last_logits(model, [r], adapter_names=["__base__"])[0]
            assert rel_err(ref, base) > 1e-2, (name, a)
    alone = engine.logits([rows[1], rows[4]], adapters=None)  # rows without an adapter: the base model
    assert rel_err(ours[1], alone[0]) < REL_TOL and rel_err(ours[4], alone[1]) < REL_TOL


def test_peft_adapters_greedy_generate(peft_setup):
    name, model, engine, _ = peft_setup
    rows = _batch_rows(seed=6)
    outs = engine.generate(rows, adapters=[a for a, _ in BATCH],
                           sampling=SamplingParams(max_tokens=GEN_TOKENS, temperature=0.0, ignore_eos=True))
    for (a, _), r, out in zip(BATCH, rows, outs):
        assert out.token_ids == hf_greedy(model, r, GEN_TOKENS, adapter_names=[a or "__base__"]), (name, a)


def test_module_names_match_transformers():
    """The module list the PEFT target rules match against is the HF Phi-3 model's own ``named_modules``."""
    from multilora.runtime.adapters.targets import _decoder_module_names

    model = _make_model("phi3")
    ours = _decoder_module_names(ModelConfig.from_hf_dict(model.config.to_dict()))
    assert [n for n, _ in ours] == [n for n, _ in model.named_modules()]


# ----------------------------------------------------------------------------------- refused, clearly
def _phi3_dict(**kw):
    return dict(model_type="phi3", vocab_size=10, hidden_size=32, intermediate_size=16, num_hidden_layers=2,
                num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64, **kw)


def test_rope_scaling_read_as_transformers_reads_it():
    lr = _longrope()
    lr.pop("rope_type")
    # transformers 4.x files: rope_scaling with the old name "su" (or "longrope"), top-level original length
    for t in ("su", "longrope"):
        c = ModelConfig.from_hf_dict(_phi3_dict(rope_scaling={"type": t, **lr}, original_max_position_embeddings=8))
        assert c.rope_type == "longrope" and c.rope_scaling["original_max_position_embeddings"] == 8
    # Phi-3 configs map "yarn" to longrope too (Phi3Config.convert_rope_params_to_dict)
    c = ModelConfig.from_hf_dict(_phi3_dict(rope_scaling={"type": "yarn", **lr}))
    assert c.rope_type == "longrope" and c.rope_scaling["original_max_position_embeddings"] == 64
    # transformers 5.x files: rope_parameters; plain Phi-3 (rope_type default) has no scaling
    hf = transformers.Phi3Config(**{k: v for k, v in _phi3_dict().items() if k != "model_type"}).to_dict()
    assert ModelConfig.from_hf_dict(hf).rope_scaling is None


@pytest.mark.parametrize("cfg,match", [
    (_phi3_dict(rope_scaling={"type": "dynamic", "factor": 2.0}), r"rope_scaling type 'dynamic' is not supported"),
    ({**_phi3_dict(rope_parameters={"rope_type": "yarn", "factor": 2.0}), "model_type": "llama"},
     r"rope_scaling type 'yarn' is not supported"),
    (_phi3_dict(partial_rotary_factor=0.75), r"partial_rotary_factor 0.75 is not supported"),
    (_phi3_dict(rope_parameters={"rope_type": "default", "partial_rotary_factor": 0.5}),
     r"partial_rotary_factor 0.5 is not supported"),
    (_phi3_dict(rope_scaling={"type": "longrope", "short_factor": [1.0] * 3, "long_factor": [1.0] * 8}),
     r"short_factor must list head_dim / 2 = 8 numbers"),
    (_phi3_dict(hidden_act="gelu"), r"hidden_act must be 'silu'"),
])
def test_refused_configs_name_the_field(cfg, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf_dict(cfg)


def test_adapter_on_unfused_names_is_refused_for_phi3(tmp_path):
    """Phi-3 has no q_proj / gate_proj module: an adapter naming them matches nothing and is refused, naming
    the Phi-3 projections; a key of a split module in a qkv_proj adapter is refused as unknown."""
    from multilora.runtime.adapters import AdapterError, load_peft_adapter
    from safetensors.torch import save_file

    c = ModelConfig.from_hf_dict(_phi3_dict())
    (tmp_path / "adapter_config.json").write_text(json.dumps(dict(peft_type="LORA", r=2, lora_alpha=2,
                                                                  target_modules=["q_proj", "v_proj"])))
    save_file({}, str(tmp_path / "adapter_model.safetensors"))
    with pytest.raises(AdapterError, match=r"targets no module.*'q_proj', 'v_proj' match no module of this phi3 "
                                           r"model: expected one of .*qkv_proj, gate_up_proj"):
        load_peft_adapter(tmp_path, c)
    (tmp_path / "adapter_config.json").write_text(json.dumps(dict(peft_type="LORA", r=2, lora_alpha=2,
                                                                  target_modules=["qkv_proj"])))
    save_file({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(2, 32)},
              str(tmp_path / "adapter_model.safetensors"))
    with pytest.raises(AdapterError, match=r"unknown module 'q_proj'; expected one of o_proj, qkv_proj"):
        load_peft_adapter(tmp_path, c)


def test_wrong_fused_b_shape_is_refused(tmp_path):
    from multilora.runtime.adapters import AdapterError, load_peft_adapter
    from safetensors.torch import save_file

    c = ModelConfig.from_hf_dict(_phi3_dict())
    (tmp_path / "adapter_config.json").write_text(json.dumps(dict(peft_type="LORA", r=2, lora_alpha=2,
                                                                  target_modules=["gate_up_proj"])))
    key = "base_model.model.model.layers.{}.mlp.gate_up_proj.lora_{}.weight"
    t = {key.format(i, "A"): torch.zeros(2, 32) for i in range(2)}
    t |= {key.format(i, "B"): torch.zeros(16, 2) for i in range(2)}  # [inter, r], not [2 * inter, r]
    save_file(t, str(tmp_path / "adapter_model.safetensors"))
    with pytest.raises(AdapterError, match=r"gate_up_proj.lora_B.weight'.*expected shape \[32, 2\]"):
        load_peft_adapter(tmp_path, c)


# ------------------------------------------------------------------------------- Triton ops (interpreter)
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                    reason="the Triton kernels need TRITON_INTERPRET=1 on a CPU")
def test_phi3_longrope_forward_with_triton_ops_equals_torch_ops(tmp_path):
    """The whole tiny longrope Phi-3 with the Triton ops (the RoPE kernel reading long-factor rows of the stacked
    table) equals the torch ops: a prefill of a short and a long prompt, then a decode step (fp32, interpreter)."""
    model = _make_model("phi3-longrope")
    model.save_pretrained(str(tmp_path))
    e = Engine(model=str(tmp_path), device="cpu", progress=False, max_batch_size=2, max_seq_len=64, kv_block_size=4)
    steps = [([list(range(3, 8)), list(range(3, 21))], [0, 0]), ([[2], [4]], [5, 18])]
    tables = [[1, 2], [3, 4, 5, 6, 7]]
    out = {}
    for backend in ("torch", "triton"):
        hs = []
        for ids, starts in steps:
            plan = e.runner.build_plan(ids, starts, tables, [-1] * len(ids), block_size=4)
            hs.append(e.model.forward(plan, e.kv, ops_backend=backend))
        out[backend] = hs
    for a, b in zip(out["torch"], out["triton"]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_fused_adapters_read_straight_into_the_image_bit_identical(peft_setup):
    """The cache's reload (``read_image``: lora_A read into the first slice's A, copied to the others, B's rows
    transposed per slice) gives the general path's image, bit for bit, for every fused adapter."""
    from multilora.runtime.adapters import read_packed_adapter
    from multilora.runtime.adapters.image import read_image

    _, _, engine, out = peft_setup
    for n in PEFT_ADAPTERS:
        _, want = read_packed_adapter(out / n, engine.config, engine.pool, name=n)
        _, got = read_image(out / n, engine.config, engine.pool, name=n)
        assert torch.equal(got.data.view(torch.uint8), want.data.view(torch.uint8)), n
        for f in ("ranks", "scalings", "offsets"):
            assert torch.equal(getattr(got, f), getattr(want, f)), (n, f)


def test_deferred_check_counts_a_fused_lora_b_whole(peft_setup, tmp_path):
    """A fused lora_B (qkv_proj) lies in the image as one B^T per slice: ``read_image``'s own whole-image check (no
    general-path re-read) reports a NaN in one slice with the count and size of the whole tensor, as the file and
    ``load_peft_adapter`` do (not of the slice)."""
    import os
    import shutil
    from pathlib import Path

    from safetensors.torch import load_file, save_file

    from multilora.runtime.adapters import AdapterError, load_peft_adapter
    from multilora.runtime.adapters.image import _read

    _, _, engine, out = peft_setup
    for n in PEFT_ADAPTERS:
        d = tmp_path / n
        shutil.copytree(out / n, d)
        w = d / "adapter_model.safetensors"
        t = {k: v.clone() for k, v in load_file(str(w)).items()}
        key = next((k for k in sorted(t) if "qkv_proj.lora_B" in k), None)
        if key is None:
            continue
        t[key][-1, 0] = float("nan")  # a row of the last slice (v)
        save_file(t, str(w), metadata={"format": "pt"})
        os.utime(w, (0, 0))
        with pytest.raises(AdapterError) as want:
            load_peft_adapter(d, engine.config)
        with pytest.raises(AdapterError) as got:
            _read(Path(d), engine.config, engine.pool, None, False, None, False)
        assert (str(got.value), got.value.key) == (str(want.value), want.value.key)
        assert f"1 non-finite (NaN/inf) of {t[key].numel()}" in str(got.value)
        break
    else:
        pytest.fail("no adapter of PEFT_ADAPTERS targets qkv_proj")


# ------------------------------------------------------------------------------------------------------ GGUF
# HF module path (inside model.layers.N) -> llama.cpp tensor name (gguf-py MODEL_TENSORS[PHI3]; its converter
# writes the fused projections as they are, gate_up_proj under ffn_up)
_GGUF_NAMES = {"self_attn.qkv_proj": "attn_qkv", "self_attn.o_proj": "attn_output", "mlp.gate_up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
_GGUF_TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}


def write_phi3_gguf(model, path):
    """``model`` (a HF ``Phi3ForCausalLM``) as llama.cpp's converter (``Phi3MiniModel``) writes it, in F32: its
    metadata keys, the fused tensors, and for longrope the factors as tensors, the original length and the
    attention factor the converter computes, sqrt(1 + ln(max / original) / ln(original))."""
    gguf = pytest.importorskip("gguf")
    from testsupport import add_gguf_test_tokenizer

    c = model.config
    w = gguf.GGUFWriter(str(path), "phi3")
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_dimension_count(c.hidden_size // c.num_attention_heads)
    w.add_rope_freq_base(float(c.rope_parameters["rope_theta"]))
    if c.sliding_window:
        w.add_sliding_window(c.sliding_window)
    rope = c.rope_parameters
    if rope.get("rope_type") == "longrope":
        orig = c.original_max_position_embeddings
        w.add_rope_scaling_orig_ctx_len(orig)
        scale = c.max_position_embeddings / orig
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(orig)) if scale > 1 else 1.0)
        w.add_tensor("rope_factors_long.weight", torch.tensor(rope["long_factor"], dtype=torch.float32).numpy())
        w.add_tensor("rope_factors_short.weight", torch.tensor(rope["short_factor"], dtype=torch.float32).numpy())
    add_gguf_test_tokenizer(w, c)
    w.add_pad_token_id(c.pad_token_id)  # (transformers' Phi3Config default, 32000, is past this vocabulary)
    for key, t in model.state_dict().items():
        if key == "lm_head.weight" and c.tie_word_embeddings:
            continue
        parts = key.split(".")
        name = _GGUF_TOP.get(key) or f"blk.{parts[2]}.{_GGUF_NAMES['.'.join(parts[3:-1])]}.{parts[-1]}"
        w.add_tensor(name, t.detach().float().numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# the cases whose attention factor is the converter's formula (phi3-longrope-af's explicit 1.3 would be lost by it)
GGUF_CASES = ["phi3", "phi3-tied-mha", "phi3-sliding", "phi3-longrope"]


@pytest.mark.parametrize("name", GGUF_CASES)
def test_gguf_matches_the_hf_model(name, tmp_path):
    """A Phi-3 GGUF file loads to the HF directory's config and weights and to the HF model's logits and greedy
    tokens; where transformers' own GGUF loader reads the file fully (no longrope factors, no sliding window: it
    reads neither key for phi3), its logits too."""
    from multilora.runtime.weights import load_model_files

    model = _make_model(name)
    path = tmp_path / "model.gguf"
    write_phi3_gguf(model, path)
    config, weights = load_model_files(path, dtype=torch.float32, progress=False)
    hf_config = ModelConfig.from_hf_dict(model.config.to_dict())
    for field in ("fused_projections", "num_heads", "num_kv_heads", "head_dim", "intermediate_size",
                  "sliding_window", "tie_word_embeddings", "rope_type"):
        assert getattr(config, field) == getattr(hf_config, field), field
    if config.rope_type == "longrope":
        for key in ("short_factor", "long_factor"):  # float32 in the file
            assert config.rope_scaling[key] == pytest.approx(hf_config.rope_scaling[key], rel=1e-6), key
        assert (config.rope_scaling["original_max_position_embeddings"]
                == hf_config.rope_scaling["original_max_position_embeddings"] == ORIG)
    ref = {k: v for k, v in model.state_dict().items() if not (k == "lm_head.weight" and config.tie_word_embeddings)}
    assert set(weights) == set(ref)
    for k, v in ref.items():
        assert torch.equal(weights[k], v), k

    engine = Engine(model=str(path), progress=False, max_batch_size=4)
    assert engine.model.rope_scale == pytest.approx(model.model.rotary_emb.attention_scaling, rel=1e-6)
    rows = _rows(name)
    ours = engine.logits(rows)
    for i, ref_logits in enumerate(hf_last_logits(model, rows)):
        assert rel_err(ours[i], ref_logits) < REL_TOL, (name, i, rel_err(ours[i], ref_logits))
    if name in ("phi3", "phi3-tied-mha"):
        theirs = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name,
                                                                   dtype=torch.float32).eval()
        for i, ref_logits in enumerate(hf_last_logits(theirs, rows)):
            assert rel_err(ours[i], ref_logits) < REL_TOL, (name, "transformers' GGUF loader", i)
    outs = engine.generate(rows[:2], sampling=SamplingParams(max_tokens=GEN_TOKENS, temperature=0.0, ignore_eos=True))
    for r, out in zip(rows[:2], outs):
        assert out.token_ids == hf_greedy(model, r, GEN_TOKENS), (name, len(r))


def _gguf_with(tmp_path, *, rot=None, factors=("rope_factors_long.weight", "rope_factors_short.weight"), n=8):
    gguf = pytest.importorskip("gguf")
    w = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "phi3")
    for add, v in ((w.add_block_count, 1), (w.add_embedding_length, 64), (w.add_head_count, 4),
                   (w.add_feed_forward_length, 96), (w.add_context_length, 64)):
        add(v)
    if rot is not None:
        w.add_rope_dimension_count(rot)
    w.add_tensor("token_embd.weight", torch.zeros(10, 64).numpy())
    for f in factors:
        w.add_tensor(f, torch.ones(n).numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return tmp_path / "m.gguf"


@pytest.mark.parametrize("kw, match", [
    (dict(rot=8), r"phi3.rope.dimension_count is 8, head_dim is 16: partial rotary"),
    (dict(factors=("rope_factors_long.weight",)), r"rope_factors_long.weight needs both rope_factors_short.weight "
                                                  r"and rope_factors_long.weight"),
    (dict(n=5), r"longrope tensor rope_factors_\w+.weight has 5 numbers, expected head_dim / 2 = 8"),
])
def test_gguf_refusals_name_the_key(tmp_path, kw, match):
    from multilora.runtime.weights import ModelLoadError, model_config

    with pytest.raises(ModelLoadError, match=match):
        model_config(str(_gguf_with(tmp_path, **kw)))
