"""The engine's switch ``runtime.model.LORA_FUSED_GLU_MIN_TOKENS`` (off by default): steps that add gate/up's LoRA
inside the activation (``kernels.experimental.expand_glu``) give the logits of the default path.

On the CPU the engine runs the Triton LoRA kernels under the interpreter (``lora_backend="triton"``), fp32; the
default path (gate/up's LoRA in place, then the activation) is the reference, itself checked against peft elsewhere
(``test_engine_peft.py``). Rows without an adapter, an adapter that does not target up_proj, ranks up to the pool's
16, and the places where the switch must not apply (a pool of max rank > 16, the torch LoRA backend) are covered.
"""

from __future__ import annotations

import pytest
import torch

from multilora import Engine
from multilora.config import ModelConfig
from multilora.runtime import model as model_mod
from multilora.runtime.weights import MODEL_SHAPES
from testsupport import one_thread  # noqa: F401 (autouse fixture)
from testsupport import write_adapter

CFG = ModelConfig(**MODEL_SHAPES["tiny"])
ADAPTERS = {"all-r16": (16, ("q_proj", "v_proj", "gate_proj", "up_proj", "down_proj")),
            "gate-r4": (4, ("gate_proj",)),  # up_proj not targeted: its term is 0
            "attn-r8": (8, ("q_proj", "k_proj", "v_proj", "o_proj"))}  # no gate/up at all


def _engine(tmp_path, max_lora_rank=16, lora_backend="triton"):
    e = Engine(CFG, device="cpu", progress=False, max_batch_size=6, max_seq_len=48, kv_block_size=4,
               max_lora_rank=max_lora_rank, adapter_slots=4, lora_backend=lora_backend)
    for i, (name, (rank, modules)) in enumerate(ADAPTERS.items()):
        e.load_adapter(name, write_adapter(tmp_path / name, CFG, seed=i, rank=rank, modules=modules))
    return e


def _calls(monkeypatch):
    """Counts the engine's calls of ``expand_glu`` (imported by the forward when it takes the fused path)."""
    from multilora.kernels.experimental import expand_glu as mod

    calls = []
    real = mod.expand_glu

    def spy(*args, **kwargs):
        calls.append(args[0].shape[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(mod, "expand_glu", spy)
    return calls


ROWS_ADAPTERS = ["all-r16", None, "gate-r4", "attn-r8", "all-r16"]


def _rows():
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, CFG.vocab_size, (n,), generator=g).tolist() for n in (9, 4, 12, 6, 3)]


def test_fused_glu_steps_give_the_default_logits(tmp_path, monkeypatch):
    engine = _engine(tmp_path)
    want = engine.logits(_rows(), adapters=ROWS_ADAPTERS)
    calls = _calls(monkeypatch)
    monkeypatch.setattr(model_mod, "LORA_FUSED_GLU_MIN_TOKENS", 1)
    got = engine.logits(_rows(), adapters=ROWS_ADAPTERS)
    assert calls and len(calls) % CFG.num_layers == 0, calls  # every layer of the steps took the fused path
    rel = ((got - want).norm(dim=-1) / want.norm(dim=-1)).max().item()
    assert rel < 1e-5, rel  # fp32: only the activation's formula (x / (1 + e^-x) against F.silu) and order differ
    base = engine.logits([_rows()[1]], adapters=[None])[0]  # the row without an adapter is the base model's
    assert ((got[1] - base).norm() / base.norm()).item() < 1e-5


@pytest.mark.parametrize("case", ["rank-64-pool", "torch-backend", "below-the-threshold"])
def test_fused_glu_is_not_taken_where_it_does_not_apply(tmp_path, monkeypatch, case):
    engine = _engine(tmp_path, max_lora_rank=64 if case == "rank-64-pool" else 16,
                     lora_backend="torch" if case == "torch-backend" else "triton")
    calls = _calls(monkeypatch)
    monkeypatch.setattr(model_mod, "LORA_FUSED_GLU_MIN_TOKENS", 1 << 30 if case == "below-the-threshold" else 1)
    engine.logits(_rows(), adapters=ROWS_ADAPTERS)
    assert calls == []
