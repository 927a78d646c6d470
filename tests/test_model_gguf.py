"""GGUF files of tiny Qwen2 and Qwen3 models, written here with the ``gguf`` library's ``GGUFWriter`` in llama.cpp's
names (``blk.N.attn_q.bias``, ``blk.N.attn_q_norm.weight``, ...; F32 tensors, so nothing is quantised), loaded by
multilora and by transformers' own GGUF loader: the same last-position logits (fp32, CPU), and both equal to the
HF model the file was written from.

llama.cpp keeps HF's q/k row order for qwen2 / qwen3 (their RoPE is the rotate-half "NEOX" kind), so nothing
is un-permuted. transformers 5's qwen3 GGUF reader does not read ``attention.key_length`` (its ``head_dim``
stays Qwen3Config's default, 128): the comparison with transformers uses head_dim 128; a Qwen3 with another
head_dim is checked against the HF model it came from.

The file carries a tiny byte-level BPE tokenizer (256 byte symbols, one merge, filler tokens) because the
engine loads the tokenizer of a GGUF file with transformers.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

from testsupport import (  # noqa: E402,F401  (one_thread: autouse, one intra-op thread)
    add_gguf_test_tokenizer, one_thread, rel_err)

from multilora import Engine, SamplingParams  # noqa: E402
from multilora.runtime.weights import ModelLoadError, load_model_files  # noqa: E402

VOCAB = 1000
REL_TOL = 1e-5  # fp32 against fp32: observed <= 1e-6
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, initializer_range=0.2,
            bos_token_id=1, eos_token_id=2)
CASES = {
    "qwen2-untied": ("Qwen2ForCausalLM", "Qwen2Config", dict(tie_word_embeddings=False)),
    "qwen2-tied": ("Qwen2ForCausalLM", "Qwen2Config", dict(tie_word_embeddings=True)),
    "qwen3-head-dim-128": ("Qwen3ForCausalLM", "Qwen3Config", dict(head_dim=128, num_key_value_heads=1)),
    "qwen3-head-dim-24": ("Qwen3ForCausalLM", "Qwen3Config", dict(head_dim=24)),
}
# HF module path (inside model.layers.N) -> llama.cpp tensor name
_GGUF_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
               "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}


def _make_model(name):
    cls_name, cfg_name, overrides = CASES[name]
    torch.manual_seed(0)
    model = getattr(transformers, cls_name)(getattr(transformers, cfg_name)(**{**BASE, **overrides})).eval()
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():  # not the init's zero biases and unit norms
        for pname, p in model.named_parameters():
            if pname.endswith(".bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            elif pname.endswith(("q_norm.weight", "k_norm.weight")):
                p.copy_(1 + torch.randn(p.shape, generator=g) * 0.3)
    return model


def _gguf_tensor_name(key: str) -> str | None:
    if key == "model.embed_tokens.weight":
        return "token_embd.weight"
    if key == "model.norm.weight":
        return "output_norm.weight"
    if key == "lm_head.weight":
        return "output.weight"
    parts = key.split(".")  # model.layers.N.<module path>.<weight|bias>
    return f"blk.{parts[2]}.{_GGUF_NAMES['.'.join(parts[3:-1])]}.{parts[-1]}"


def write_gguf(model, path, arch: str) -> None:
    """``model`` (a HF Qwen2/Qwen3 ``*ForCausalLM``) as a llama.cpp-style GGUF file of F32 tensors."""

    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(float(c.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    add_gguf_test_tokenizer(w, c)
    for key, t in model.state_dict().items():
        if key == "lm_head.weight" and c.tie_word_embeddings:
            continue  # tied: llama.cpp writes no output.weight
        w.add_tensor(_gguf_tensor_name(key), t.detach().float().numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    name = request.param
    model = _make_model(name)
    d = tmp_path_factory.mktemp(f"gguf-{name}")
    write_gguf(model, d / "model.gguf", model.config.model_type)
    return name, model, d / "model.gguf"


def test_gguf_loads_the_same_config_and_weights(case):
    name, model, path = case
    config, weights = load_model_files(path, dtype=torch.float32, progress=False)
    hf = model.config
    assert config.architecture == hf.model_type
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads  # Qwen2Config has none
    assert (config.head_dim, config.num_kv_heads) == (head_dim, hf.num_key_value_heads)
    assert (config.qkv_bias, config.qk_norm) == (hf.model_type == "qwen2", hf.model_type == "qwen3")
    assert config.tie_word_embeddings == bool(hf.tie_word_embeddings)
    ref = {k: v for k, v in model.state_dict().items() if not (k == "lm_head.weight" and hf.tie_word_embeddings)}
    assert set(weights) == set(ref)
    for k, v in ref.items():
        assert torch.equal(weights[k], v), k  # F32 in, F32 out, rows in HF order (no un-permutation)


def test_gguf_logits_match_the_hf_model_and_transformers_gguf_loader(case):
    name, model, path = case
    engine = Engine(model=str(path), progress=False, max_batch_size=4)
    g = torch.Generator().manual_seed(7)
    rows = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (9, 14, 1)]
    ours = engine.logits(rows)
    theirs = None
    if name != "qwen3-head-dim-24":  # transformers' qwen3 GGUF reader assumes head_dim 128 (module docstring)
        theirs = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                                   dtype=torch.float32).eval()
    with torch.no_grad():
        for i, r in enumerate(rows):
            ref = model(input_ids=torch.tensor([r])).logits[0, -1]
            assert rel_err(ours[i], ref) < REL_TOL, (name, i, rel_err(ours[i], ref))
            if theirs is not None:
                assert rel_err(ours[i], theirs(input_ids=torch.tensor([r])).logits[0, -1]) < REL_TOL, (name, i)
    out = engine.generate([rows[0]], sampling=SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))[0]
    with torch.no_grad():
        ref_ids = model.generate(torch.tensor([rows[0]]), max_new_tokens=6, min_new_tokens=6, do_sample=False,
                                 pad_token_id=0)[0, len(rows[0]):].tolist()
    assert out.token_ids == ref_ids


def _one_table_gguf(path, architecture: str, table: torch.Tensor) -> None:
    """A GGUF file of ``architecture`` with one block and the embedding table alone."""
    w = gguf.GGUFWriter(str(path), architecture)
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", table.numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_gguf_architecture_not_served_is_refused(tmp_path):
    _one_table_gguf(tmp_path / "m.gguf", "gemma3", torch.zeros(8, 4))
    with pytest.raises(ModelLoadError,
                       match=r"general.architecture 'gemma3' is not served.*llama, qwen2, qwen3, gemma2"):
        load_model_files(tmp_path / "m.gguf", dtype=torch.float32, progress=False)


def test_truncated_or_foreign_gguf_is_named(tmp_path):
    """A GGUF file cut short (its tensors past the end) or a file that is not GGUF: ModelLoadError naming the file,
    its size and what the gguf library said, not numpy's reshape error bare."""
    from multilora.runtime.weights import model_config

    _one_table_gguf(tmp_path / "m.gguf", "llama", torch.ones(64, 32))
    data = (tmp_path / "m.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[: len(data) - 4096])
    (tmp_path / "text.gguf").write_bytes(b"not a model\n")
    for name in ("cut.gguf", "text.gguf"):
        size = (tmp_path / name).stat().st_size
        with pytest.raises(ModelLoadError, match=rf"{name}: not a readable GGUF file: corrupt, truncated or not GGUF "
                                                 rf"\({size:,} B; the gguf library says \w+Error: "):
            model_config(tmp_path / name)
