"""``load_adapter(preload=False)``: header-only registration on the disk tier (issue 4: thousands of adapters).

The lazy adapter must behave exactly like a preloaded one once used (bit-identical logits), cost no host
memory until then, reject shape errors at registration like a full load, and fail only its own requests
when its values turn out to be bad (non-finite) at first use.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from multilora import Engine, SamplingParams
from multilora.runtime.adapters import AdapterError
from multilora.config import ModelConfig, TARGET_MODULES
from multilora.runtime.weights import MODEL_SHAPES
from testsupport import one_thread  # noqa: F401 (autouse fixture)
from testsupport import write_adapter
from testsupport import token_ids

CFG = ModelConfig(**MODEL_SHAPES["tiny"])


@pytest.fixture(scope="module")
def engine():
    return Engine(CFG, device="cpu", progress=False, max_batch_size=4, max_seq_len=32, max_lora_rank=8, adapter_slots=2)


def _ids(n, seed):
    return token_ids(n, seed, CFG.vocab_size)


def test_lazy_adapter_registers_on_disk_and_matches_preloaded(engine, tmp_path):
    d = write_adapter(tmp_path / "a", CFG, seed=1, rank=8, modules=TARGET_MODULES)
    engine.load_adapter("eager", d)
    host_before = engine.stats()["host_tier_bytes"]
    engine.load_adapter("lazy", d, preload=False)
    st = engine.stats()
    assert st["host_tier_bytes"] == host_before  # nothing read or packed yet
    assert {h.name: h.tier for h in engine.cache.handles()}["lazy"] == "disk"
    rows = [_ids(7, 0), _ids(5, 1)]
    want = engine.logits(rows, adapters=["eager", "eager"])
    got = engine.logits(rows, adapters=["lazy", "lazy"])
    assert torch.equal(got, want)
    assert engine.stats()["bytes_disk_to_host"] > 0
    base = engine.logits(rows)
    assert not torch.equal(got, base)  # the adapter is really applied


def test_lazy_load_still_validates_shapes(engine, tmp_path):
    d = write_adapter(tmp_path / "bad", CFG, seed=2, rank=4, modules=("q_proj",))
    w = load_file(str(d / "adapter_model.safetensors"))
    key = next(k for k in w if "lora_A" in k)
    w[key] = torch.zeros(3, w[key].shape[1])  # rank 3 where the config says 4
    save_file(w, str(d / "adapter_model.safetensors"))
    with pytest.raises(AdapterError, match=r"expected shape \[4, "):
        engine.load_adapter("bad-shape", d, preload=False)
    assert "bad-shape" not in engine.list_adapters()


def test_lazy_adapter_with_nan_fails_only_its_requests(engine, tmp_path):
    good = write_adapter(tmp_path / "good", CFG, seed=3, rank=4, modules=("v_proj",))
    bad = write_adapter(tmp_path / "nan", CFG, seed=4, rank=4, modules=("v_proj",))
    w = load_file(str(bad / "adapter_model.safetensors"))
    key = next(k for k in w if "lora_B" in k)
    w[key][0, 0] = float("nan")
    save_file(w, str(bad / "adapter_model.safetensors"))
    engine.load_adapter("good", good, preload=False)
    engine.load_adapter("nan", bad, preload=False)  # header is fine: accepted
    outs = engine.generate([_ids(4, 5), _ids(4, 6), _ids(4, 7)], adapters=["nan", "good", None],
                           sampling=SamplingParams(max_tokens=3, ignore_eos=True))
    assert outs[0].finish_reason == "error" and "non-finite" in outs[0].error
    assert "adapter 'nan'" in outs[0].error  # the request's adapter, not only the file (first read at first use)
    assert [o.finish_reason for o in outs[1:]] == ["length", "length"]
    assert len(outs[1].token_ids) == 3


def test_lazy_adapter_given_a_relative_path_is_read_after_a_chdir(engine, tmp_path, monkeypatch):
    """The first read of a ``preload=False`` adapter (and every read after an eviction) happens later, from the
    path ``load_adapter`` kept: a relative one is made absolute at the call, so a later ``os.chdir`` moves nothing."""
    write_adapter(tmp_path / "rel", CFG, seed=8, rank=4, modules=("q_proj",))
    engine.load_adapter("rel-eager", tmp_path / "rel")
    monkeypatch.chdir(tmp_path)
    engine.load_adapter("rel-lazy", "rel", preload=False)
    assert engine.adapter_path("rel-lazy") == tmp_path / "rel"
    monkeypatch.chdir("/")
    rows = [_ids(6, 9)]
    assert torch.equal(engine.logits(rows, adapters=["rel-lazy"]), engine.logits(rows, adapters=["rel-eager"]))
