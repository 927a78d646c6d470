"""Helpers shared by the test modules (importable because pytest puts tests/ on sys.path)."""

from __future__ import annotations

import pytest
import torch

from multilora.runtime.adapters import save_peft_adapter
from multilora.runtime.weights import default_model_path


def tokenizer_dir(tmp_path_factory):
    """The SmolLM2 tokenizer saved once per test session (reading it from the GGUF takes ~5 s)."""
    import transformers

    d = tmp_path_factory.getbasetemp() / "smollm2-tokenizer"
    if not (d / "tokenizer_config.json").is_file():
        p = default_model_path()
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
