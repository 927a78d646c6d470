"""The engine takes its adapter-pool, KV-cache and host-tier sizes from the memory plan (issue 5), on the
CPU here (host memory is the device) and with recorded snapshots replayed, so the sizes are exact."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from multilora import Engine  # noqa: E402
from multilora.memory.accounting import MemoryPlanError, MemorySnapshot  # noqa: E402
from multilora.memory.kv_cache import PagedKVCache  # noqa: E402

GiB = 1 << 30
MiB = 1 << 20


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    torch.manual_seed(0)
    d = tmp_path_factory.mktemp("tiny-plan")
    transformers.LlamaForCausalLM(cfg).save_pretrained(str(d))
    return d


def _host_snapshot(mem_available: int) -> MemorySnapshot:
    meminfo = (f"MemTotal:       {16 * GiB // 1024} kB\nMemFree:        {mem_available // 1024} kB\n"
               f"MemAvailable:   {mem_available // 1024} kB\n")
    return MemorySnapshot(has_gpu=False, meminfo_text=meminfo)


def test_sizes_come_from_the_plan_of_this_machine(tiny_dir):
    e = Engine(model=tiny_dir, progress=False, max_seq_len=128, max_batch_size=4)
    plan = e.memory_plan
    assert plan is not None and plan.kind == "host"
    assert e.pool.bytes_total <= plan.adapter_pool_bytes
    assert e.pool.bytes_total > plan.adapter_pool_bytes - e.pool.page_bytes  # whole pages of the plan's share
    assert e.kv.nbytes <= plan.kv_bytes
    assert e.cache.host_budget == plan.host_tier_bytes


def test_replayed_snapshot_sets_exact_sizes(tiny_dir):
    snap = _host_snapshot(1 * GiB)
    e = Engine(model=tiny_dir, progress=False, max_seq_len=128, max_batch_size=4, memory_snapshot=snap)
    plan = e.memory_plan
    assert plan.usable_bytes == 1 * GiB and plan.usable_source == "mem_available"
    assert e.pool.num_pages == plan.adapter_pool_bytes // e.pool.page_bytes
    block = 16 * PagedKVCache.bytes_per_token(2, 2, 16, torch.float32)
    assert e.kv.block_bytes == block and e.kv.block_size == 16
    # the plan's KV bytes in whole blocks (the null block included), at most 4 sequences of 128 tokens + null
    assert e.kv.num_blocks == min(4 * 128 // 16 + 1, plan.kv_bytes // block)
    assert e.kv.nbytes <= plan.kv_bytes
    # less memory never gives a bigger pool
    small = Engine(model=tiny_dir, progress=False, max_seq_len=128, max_batch_size=4,
                   memory_snapshot=_host_snapshot(256 * MiB))
    assert small.pool.num_pages <= e.pool.num_pages


def test_caps_only_lower_sizes(tiny_dir):
    snap = _host_snapshot(1 * GiB)
    free = Engine(model=tiny_dir, progress=False, max_seq_len=128, memory_snapshot=snap)
    page, one = free.pool.page_bytes, free.pool.max_adapter_pages  # one = pages of the largest max-rank adapter
    capped = Engine(model=tiny_dir, progress=False, max_seq_len=128, memory_snapshot=snap,
                    adapter_pool_bytes=(one + 10) * page + 7,
                    kv_cache_bytes=2 * 128 * PagedKVCache.bytes_per_token(2, 2, 16, torch.float32))
    assert capped.pool.num_pages == one + 10 and capped.kv.num_blocks == 2 * 128 // 16  # the null block is one of them
    assert capped.kv.nbytes == 2 * 128 * PagedKVCache.bytes_per_token(2, 2, 16, torch.float32)
    huge = Engine(model=tiny_dir, progress=False, max_seq_len=128, memory_snapshot=snap, adapter_pool_bytes=1 << 50)
    assert huge.pool.num_pages == free.pool.num_pages  # a cap above the plan does not raise the size


def test_caps_below_the_minimum_are_refused_before_the_weights_load(tiny_dir, monkeypatch):
    """adapter_pool_bytes below one max-rank adapter and kv_cache_bytes below 2 blocks need only the model's config:
    refused before any weight loads (a fresh user waited 7-9 s for them on a 135M model), with the same errors an
    engine that loads gives (``sizing.pool_below_one_adapter``, ``memory_request``)."""
    import multilora.runtime.engine as engine_mod

    def loaded(*a, **k):
        raise AssertionError("the weights were loaded before the caps were checked")

    with pytest.raises(MemoryPlanError) as real_pool:
        Engine(model=tiny_dir, progress=False, adapter_pool_bytes=10)
    with pytest.raises(MemoryPlanError) as real_kv:  # (a cap too small: a plan that cannot be, as the pool's)
        Engine(model=tiny_dir, progress=False, kv_cache_bytes=0)
    monkeypatch.setattr(engine_mod, "load_model", loaded)
    with pytest.raises(MemoryPlanError) as early_pool:
        Engine(model=tiny_dir, progress=False, adapter_pool_bytes=10)
    assert str(early_pool.value) == str(real_pool.value) and "Raise adapter_pool_bytes to at least" in str(real_pool.value)
    with pytest.raises(MemoryPlanError) as early_kv:
        Engine(model=tiny_dir, progress=False, kv_cache_bytes=0)
    assert str(early_kv.value) == str(real_kv.value) and "kv_cache_bytes=0 holds 0 KV block(s)" in str(real_kv.value)
    e = real_kv.value  # the fields say what the message says
    assert e.fits_bytes == 0 and e.source == "user_cap" and f"to at least {e.needed_bytes} " in str(e)


def test_live_state_that_does_not_fit_raises_a_clear_error(tiny_dir):
    with pytest.raises(MemoryPlanError) as err:
        Engine(model=tiny_dir, progress=False, max_seq_len=512, memory_snapshot=_host_snapshot(4 * MiB))
    msg = str(err.value)
    assert "mem_available" in msg and "fit" in msg


def test_kv_blocks_follow_the_block_size_and_a_small_cap_is_honoured(tiny_dir):
    snap = _host_snapshot(1 * GiB)
    per_token = PagedKVCache.bytes_per_token(2, 2, 16, torch.float32)
    for bs in (1, 4, 16):
        e = Engine(model=tiny_dir, progress=False, max_seq_len=128, max_batch_size=3, kv_block_size=bs,
                   memory_snapshot=snap)
        assert e.kv.block_size == bs and e.kv.num_usable_blocks == 3 * 128 // bs  # the max_batch_size default cap
        assert e.stats()["kv_blocks_total"] == e.stats()["kv_blocks_free"] == e.kv.num_usable_blocks
    # a cap below one max_seq_len sequence: the engine starts, long requests are refused at submission
    e = Engine(model=tiny_dir, progress=False, max_seq_len=128, kv_block_size=4, memory_snapshot=snap,
               kv_cache_bytes=11 * 4 * per_token)
    assert e.kv.num_usable_blocks == 10
    with pytest.raises(ValueError, match="kv_cache_bytes=.*holds 1 KV block"):
        Engine(model=tiny_dir, progress=False, max_seq_len=128, kv_block_size=4, kv_cache_bytes=4 * per_token + 1)
    for bad in (0, 2.0, True):
        with pytest.raises(ValueError, match="kv_block_size must be an int >= 1"):
            Engine(model=tiny_dir, progress=False, max_seq_len=128, kv_block_size=bad)


# ------------------------------------------------------------------------------ multilora memory --model
_FAMILIES = {  # (config class, overrides): every family's weights, tied and untied heads, biases, q/k norms, fusion
    "llama-untied-bias": ("LlamaConfig", dict(tie_word_embeddings=False, attention_bias=True)),
    "llama-tied": ("LlamaConfig", dict(tie_word_embeddings=True)),
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=False)),
    "qwen3": ("Qwen3Config", dict(head_dim=24, tie_word_embeddings=True)),
    "gemma2": ("Gemma2Config", dict(head_dim=16)),
    "phi3": ("Phi3Config", dict(tie_word_embeddings=False, pad_token_id=0)),
}


@pytest.mark.parametrize("family", list(_FAMILIES))
def test_weight_bytes_from_the_config_are_the_models_parameters(family, tmp_path):
    """``sizing.weight_bytes`` (what ``multilora memory --model`` puts in the reserve, from config.json alone) is
    4 bytes per parameter of the transformers model of that config in float32 (tied heads counted once)."""
    from multilora.runtime.sizing import weight_bytes
    from multilora.runtime.weights import model_config

    cls, overrides = _FAMILIES[family]
    cfg = getattr(transformers, cls)(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                     **overrides)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    model.save_pretrained(str(tmp_path))  # (model_config reads config.json only, of a directory with weights)
    params = sum(p.numel() for p in model.parameters())  # (a tied head is one parameter)
    assert weight_bytes(model_config(tmp_path), torch.float32) == 4 * params


def test_untied_config_without_a_head_in_the_checkpoint_is_tied(tmp_path):
    """config.json says untied but the safetensors hold no ``lm_head.weight``: the engine scores with the embedding
    table, and the config it reads (``model_config``, ``multilora memory --model``) says tied, so the sizes count
    no head (``weight_bytes`` == ``DecoderModel.nbytes``) and the logits are the HF model's with its head tied."""
    from safetensors.torch import load_file, save_file

    from multilora.runtime.sizing import weight_bytes
    from multilora.runtime.weights import model_config

    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(str(tmp_path))
    f = tmp_path / "model.safetensors"
    tensors = load_file(str(f))
    del tensors["lm_head.weight"]
    save_file(tensors, str(f), metadata={"format": "pt"})
    assert model_config(tmp_path).tie_word_embeddings is True
    e = Engine(model=tmp_path, progress=False, max_seq_len=64, max_batch_size=2, memory_snapshot=_host_snapshot(GiB))
    assert e.model.lm_head is e.model.embed
    assert weight_bytes(model_config(tmp_path), torch.float32) == e.model.nbytes
    cfg.tie_word_embeddings = True
    hf = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path), config=cfg).eval()
    ids = [3, 17, 99, 5]
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0, -1]
    torch.testing.assert_close(e.logits([ids])[0].float(), want, rtol=1e-4, atol=1e-4)
    (tmp_path / "broken.safetensors").write_bytes(b"not a header")
    with pytest.raises(ValueError, match="broken.safetensors: not a readable safetensors file"):
        model_config(tmp_path)
    cfg.save_pretrained(str(tmp_path))  # (tied in config.json: the config is read without the headers, the load
    with pytest.raises(ValueError, match="broken.safetensors: not a readable safetensors file"):  # names the file)
        Engine(model=tmp_path, progress=False, max_seq_len=64, max_batch_size=2, memory_snapshot=_host_snapshot(GiB))


def test_weight_bytes_fp8_are_the_engines(tiny_dir):
    """fp8 projections (and the untied head, by default) as ``DecoderModel.nbytes`` counts them in an engine."""
    from multilora.runtime.sizing import weight_bytes

    for head in (None, False):
        e = Engine(model=tiny_dir, progress=False, max_seq_len=64, max_batch_size=2, weight_dtype="fp8",
                   fp8_lm_head=head, memory_snapshot=_host_snapshot(1 * GiB))
        assert weight_bytes(e.config, torch.float32, "fp8", head) == e.model.nbytes, head


def test_memory_model_counts_the_slot_table_and_names_what_to_change(tiny_dir, tmp_path, capsys):
    """The pool's device slot table (24 B per layer, module and slot: ``memory.pool.slot_table_bytes``) is in the
    reserve, so ``--adapter-slots`` of ten million (54 GB at Llama-3-8B's 32 layers) is refused, not planned; a
    reserve that does not fit names the flags its parts come from, and ``--json`` keeps the plan error's fields."""
    import json

    from multilora.memory.pool import slot_table_bytes
    from multilora.runtime.cli import main
    from multilora.runtime.config import EngineConfig
    from multilora.runtime.sizing import MAX_DEFAULT_SLOTS, memory_request
    from multilora.runtime.weights import model_config

    model = model_config(tiny_dir)
    for slots, want in ((None, MAX_DEFAULT_SLOTS), (10_000_000, 10_000_000)):
        req = memory_request(model, EngineConfig(adapter_slots=slots), dtype=torch.float32, max_seq_len=64)
        assert req.slot_table_bytes == slot_table_bytes(model, want) == 24 * 2 * 7 * want
        assert req.activation_bytes >= req.slot_table_bytes + req.sampling_bytes
    snap = tmp_path / "snap.json"
    snap.write_text(json.dumps(_host_snapshot(1 * GiB).to_dict()))
    base = ["memory", "--snapshot", str(snap), "--model", str(tiny_dir), "--max-seq-len", "64"]
    assert main([*base, "--adapter-slots", "1000"]) == 0
    capsys.readouterr()
    assert main([*base, "--adapter-slots", "10000000", "--json"]) == 2
    out, err = capsys.readouterr()
    e = json.loads(out)["error"]
    assert e["type"] == "MemoryPlanError" and {"needed_bytes", "fits_bytes", "source"} <= set(e), e
    assert f"the pool's slot table (--adapter-slots 10,000,000 slots) {slot_table_bytes(model, 10_000_000):,} B" in err
    assert main([*base, "--max-batch-size", "100000"]) == 2
    err = capsys.readouterr().err
    assert "the sampling workspace of --max-batch-size 100000 rows of 256 logits" in err, err
    assert "non_kv_reserve_bytes" not in err, err  # a field this command refuses with --model


def test_memory_model_says_what_leaves_budget_unused(tiny_dir, tmp_path, capsys):
    """Budget that neither the pool nor the KV cache takes is noted with its cause: the engine's own bound
    (max_batch_size sequences of max_seq_len), or the user's --kv-cache-bytes when that is what capped the KV."""
    import json

    from multilora.runtime.cli import main

    snap = tmp_path / "snap.json"
    snap.write_text(json.dumps(_host_snapshot(8 * GiB).to_dict()))
    base = ["memory", "--snapshot", str(snap), "--model", str(tiny_dir), "--max-seq-len", "64"]
    for flags, why in (([], "KV can use at most max_batch_size sequences of max_seq_len"),
                       (["--kv-cache-bytes", "64KiB"], "KV is capped by --kv-cache-bytes")):
        assert main([*base, *flags]) == 0
        (note,) = [ln for ln in capsys.readouterr().out.splitlines() if "goes to neither" in ln]
        assert f"({why}): --adapter-pool-fill gives it to the adapter pool" in note, note


def test_memory_model_gives_the_sizes_an_engine_takes(tiny_dir, tmp_path, capsys):
    """``multilora memory --model`` on a snapshot taken before loading (the weights' bytes join the reserve) gives
    the pool, KV and host tier an engine of that model takes on the same machine after loading (its snapshot with
    MemAvailable lowered by the weights' bytes: within the kB rounding of /proc/meminfo)."""
    import json

    from multilora.runtime.cli import main

    before = _host_snapshot(4 * GiB)
    snap = tmp_path / "snap.json"
    snap.write_text(json.dumps(before.to_dict()))
    flags = ["--max-batch-size", "3", "--max-seq-len", "96", "--max-lora-rank", "8", "--kv-block-size", "8"]
    assert main(["memory", "--snapshot", str(snap), "--model", str(tiny_dir), "--json", *flags]) == 0
    got = json.loads(capsys.readouterr().out)["engine"]
    assert got["max_seq_len"] == 96 and got["dtype"] == "float32" and got["kv_block_size"] == 8
    wb = got["weight_bytes"]
    after = _host_snapshot(4 * GiB - wb // 1024 * 1024)
    e = Engine(model=tiny_dir, progress=False, max_batch_size=3, max_seq_len=96, max_lora_rank=8, kv_block_size=8,
               memory_snapshot=after)
    s = e.stats()
    assert wb == e.model.nbytes
    assert abs(got["pool_bytes"] - s["pool_bytes_total"]) <= e.pool.page_bytes, (got, s["pool_bytes_total"])
    assert got["kv_blocks"] - 1 == s["kv_blocks_total"] == 3 * 96 // 8  # (KV capped: 3 sequences of 96 tokens)
    assert got["kv_tokens"] == 3 * 96
    assert abs(got["host_tier_bytes"] - s["host_tier_budget"]) <= 1024, (got, s["host_tier_budget"])
    assert got["adapter_slots"] == e.pool.max_slots
    assert got["kv_sequences"] == 3 and got["adapter_pool_fill"] is False
    # the text form says the same, and notes the budget neither side takes (with the flag that gives it to the pool)
    assert main(["memory", "--snapshot", str(snap), "--model", str(tiny_dir), *flags]) == 0
    out = capsys.readouterr().out
    assert f"= {got['pool_pages']:,} pages of" in out and f"{3 * 96} tokens, 3 whole sequences of max_seq_len" in out
    assert "= max_batch_size: the engine's cap" in out and "--adapter-pool-fill gives it to the adapter pool" in out
    assert main(["memory", "--snapshot", str(snap), "--model", str(tiny_dir), *flags, "--adapter-pool-fill"]) == 0
    out = capsys.readouterr().out
    assert "adapter_pool_fill):" in out and "gives it to the adapter pool" not in out
    # a KV cache that holds fewer sequences than the batch is noted
    assert main(["memory", "--snapshot", str(snap), "--model", str(tiny_dir), *flags[:6], "--kv-block-size", "100",
                 "--kv-bytes", str(3 * got["kv_block_bytes"] * 100 // 8)]) == 0
    out = capsys.readouterr().out
    assert "whole sequences of max_seq_len, fewer than max_batch_size 3" in out, out


def test_the_kv_bound_of_max_batch_size_is_named_so(tiny_dir):
    """An engine's KV held to max_batch_size sequences of max_seq_len is bound by ``max_batch_size`` in its plan,
    not by a ``user_cap`` the user never set; a smaller kv_cache_bytes is the user's cap."""
    kw = dict(model=tiny_dir, progress=False, max_batch_size=2, max_seq_len=64, kv_block_size=8,
              memory_snapshot=_host_snapshot(4 * GiB))
    e = Engine(**kw)
    plan = e.memory_plan
    assert plan.kv_source == "max_batch_size" and plan.options.max_kv_source == "max_batch_size"
    assert plan.kv_bytes == (2 * 64 // 8 + 1) * e.kv.block_bytes  # (2 sequences + the null block)
    assert "bound by max_batch_size" in plan.explain() and "(max_batch_size)" in plan.explain(), plan.explain()
    small = Engine(**kw, kv_cache_bytes=plan.kv_bytes // 2)
    assert small.memory_plan.kv_source == "user_cap" and small.memory_plan.kv_bytes == plan.kv_bytes // 2


def test_memory_model_unified_pool_and_fp8_head_are_an_engines(tiny_dir, tmp_path, capsys):
    """``--unified-pool`` gives the one buffer, its starting split, how far each side can grow and the slots an
    engine with ``unified_pool=True`` makes on the same snapshot (its ``stats()``, its pool and KV cache);
    ``--weight-dtype fp8 --no-fp8-lm-head`` the weight bytes of that engine."""
    import json

    from multilora.runtime.cli import main

    before = _host_snapshot(4 * GiB)
    snap = tmp_path / "snap.json"
    snap.write_text(json.dumps(before.to_dict()))
    flags = ["--max-batch-size", "3", "--max-seq-len", "96", "--max-lora-rank", "8", "--kv-block-size", "8"]
    assert main(["memory", "--snapshot", str(snap), "--model", str(tiny_dir), "--json", *flags, "--unified-pool"]) == 0
    got = json.loads(capsys.readouterr().out)["engine"]
    after = _host_snapshot(4 * GiB - got["weight_bytes"] // 1024 * 1024)
    e = Engine(model=tiny_dir, progress=False, max_batch_size=3, max_seq_len=96, max_lora_rank=8, kv_block_size=8,
               unified_pool=True, memory_snapshot=after)
    s, u = e.stats(), e.unified
    assert got["unified_pool"] is True and got["unified_bytes"] == s["unified_units"] * s["unified_unit_bytes"]
    assert got["pool_pages"] == e.pool.num_pages and got["pool_bytes"] == s["unified_pool_units"] * s["unified_unit_bytes"]
    assert got["kv_blocks"] - 1 == s["unified_kv_units"] == e.kv.num_free_blocks
    assert got["pool_max_bytes"] == (u.layout.max_floor - 1) * u.layout.unit_bytes > got["pool_bytes"]
    assert got["kv_max_blocks"] - 1 == e.kv.max_usable_blocks and got["adapter_slots"] == e.pool.max_slots
    assert main(["memory", "--snapshot", str(snap), "--model", str(tiny_dir), *flags, "--unified-pool"]) == 0
    out = capsys.readouterr().out
    assert ", unified_pool):" in out and f"one buffer of {s['unified_units']:,} units" in out, out
    # without the flag: no buffer, and each side's most is what it has
    assert main(["memory", "--snapshot", str(snap), "--model", str(tiny_dir), "--json", *flags]) == 0
    plain = json.loads(capsys.readouterr().out)["engine"]
    assert plain["unified_bytes"] is None and plain["pool_max_bytes"] == plain["pool_bytes"]
    assert plain["kv_max_blocks"] == plain["kv_blocks"] and plain["unified_pool"] is False
    # the fp8 head: off is the head at the model's dtype, as the engine stores it
    for head, flag in ((None, []), (False, ["--no-fp8-lm-head"]), (True, ["--fp8-lm-head"])):
        assert main(["memory", "--snapshot", str(snap), "--model", str(tiny_dir), "--json", *flags,
                     "--weight-dtype", "fp8", *flag]) == 0
        got = json.loads(capsys.readouterr().out)["engine"]
        e = Engine(model=tiny_dir, progress=False, max_seq_len=64, max_batch_size=2, weight_dtype="fp8",
                   fp8_lm_head=head, memory_snapshot=_host_snapshot(1 * GiB))
        assert got["weight_bytes"] == e.model.nbytes and got["fp8_lm_head"] is head, head
    assert main(["memory", "--fp8-lm-head"]) == 2
    assert "--fp8-lm-head: only with --model" in capsys.readouterr().err


def test_memory_model_flags_are_checked_by_name(tiny_dir, capsys, tmp_path):
    """Engine flags need --model; the plan's own minimum / reserve / total flags are refused with it (an engine
    computes them); values an engine refuses are refused by their flag, before anything is read."""
    import json

    from multilora.runtime.cli import main

    long_ctx = tmp_path / "long-context"  # (a config alone: its context admits a max_seq_len whose reserve is huge)
    long_ctx.mkdir()
    raw = json.loads((tiny_dir / "config.json").read_text())
    (long_ctx / "config.json").write_text(json.dumps({**raw, "max_position_embeddings": 100_000_000}))

    cases = [(["--max-batch-size", "4"], "--max-batch-size: only with --model"),
             (["--model", str(tiny_dir), "--total-bytes", "1G"], "--total-bytes: not with --model"),
             (["--model", str(tiny_dir), "--min-kv-bytes", "1M"], "--min-kv-bytes: not with --model"),
             (["--model", str(tiny_dir), "--adapter-pool-share", "1"], "--adapter-pool-share: must be a number in (0, 1)"),
             (["--model", str(tiny_dir), "--max-batch-size", "0"], "--max-batch-size: must be an int >= 1, got 0")]
    cases += [(["--model", str(tiny_dir), "--kv-bytes", "1"], "--kv-cache-bytes: 1 holds 0 KV block(s)"),
              (["--model", str(long_ctx), "--max-seq-len", "100000000"],
               "(the reserve of an engine of this model: its weights "),
              (["--model", str(tiny_dir), "--max-seq-len", "513"],
               "--max-seq-len: 513 is past the model's context of 512 tokens (max_position_embeddings=512")]
    for argv, want in cases:
        assert main(["memory", *argv]) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("multilora memory: ") and want in err, (argv, err)


def test_memory_device_with_a_snapshot_and_fp8_are_checked(tiny_dir, tmp_path, capsys, monkeypatch):
    """--device with --snapshot is refused (the plan is of the snapshot's device); --weight-dtype fp8 is checked as an
    engine checks it on the device measured (here a device said to lack fp8), and only noted for a snapshot."""
    import json

    import multilora.kernels.fp8 as fp8
    from multilora.runtime.cli import main

    snap = tmp_path / "snap.json"
    snap.write_text(json.dumps(_host_snapshot(4 * GiB).to_dict()))
    assert main(["memory", "--snapshot", str(snap), "--device", "cpu"]) == 2
    assert "--device: not with --snapshot" in capsys.readouterr().err
    assert main(["memory", "--snapshot", str(snap), "--model", str(tiny_dir), "--weight-dtype", "fp8"]) == 0
    assert "note: fp8 weights are sized, not checked" in capsys.readouterr().out
    assert main(["memory", "--device", "cpu", "--model", str(tiny_dir), "--weight-dtype", "fp8", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["engine"]["fp8_checked"] is True  # (the CPU runs fp8: _scaled_mm)
    monkeypatch.setattr(fp8, "fp8_supported", lambda device: (False, f"{device} has no fp8 tensor cores"))
    assert main(["memory", "--device", "cpu", "--model", str(tiny_dir), "--weight-dtype", "fp8"]) == 2
    assert "--weight-dtype: fp8 is not available here: cpu has no fp8 tensor cores" in capsys.readouterr().err


def test_memory_model_reads_a_config_alone(tiny_dir, tmp_path, capsys):
    """A HF directory with its config.json and no weights is planned (only the config is read)."""
    import json
    import shutil

    from multilora.runtime.cli import main

    shutil.copy(tiny_dir / "config.json", tmp_path / "config.json")
    snap = tmp_path / "snap.json"
    snap.write_text(json.dumps(_host_snapshot(4 * GiB).to_dict()))
    assert main(["memory", "--snapshot", str(snap), "--model", str(tmp_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["engine"]["layers"] == 2


def test_adapter_pool_fill_gives_the_kv_slack_to_the_pool(tiny_dir):
    """``adapter_pool_fill``: the KV cache gets its max_batch_size sequences of max_seq_len and no more, the pool the
    rest of the plan's budget (in whole pages); without it the pool keeps its share and the rest lies idle;
    ``kv_cache_bytes`` below the need stays a plain cap (its remainder idle, the pool unchanged)."""
    snap = _host_snapshot(1 * GiB)
    kw = dict(model=tiny_dir, progress=False, max_seq_len=64, max_batch_size=2, memory_snapshot=snap)
    off, on = Engine(**kw), Engine(**kw, adapter_pool_fill=True)
    block = 16 * PagedKVCache.bytes_per_token(2, 2, 16, torch.float32)
    assert off.kv.num_blocks == on.kv.num_blocks == 2 * 64 // 16 + 1  # (both capped by the need)
    plan = on.memory_plan
    assert plan.adapter_pool_source == "kv_need" and plan.kv_bytes == on.kv.num_blocks * block
    assert plan.adapter_pool_bytes + plan.kv_bytes == plan.budget_bytes == off.memory_plan.budget_bytes
    assert on.pool.bytes_total == plan.adapter_pool_bytes // on.pool.page_bytes * on.pool.page_bytes
    assert on.pool.bytes_total > 5 * off.pool.bytes_total  # share 0.1 of the budget before, ~all of it now
    capped = Engine(**kw, adapter_pool_fill=True, kv_cache_bytes=4 * block)
    assert capped.kv.num_blocks == 4 and capped.pool.bytes_total == on.pool.bytes_total


def test_memory_model_counts_the_device_finish_scratch_on_a_gpu(tiny_dir, tmp_path, capsys):
    """``multilora memory --model`` plans as the engine's default ``adapter_finish`` does on the snapshot's machine: on
    a GPU (device finish) the reserve holds the pool's finish scratch, on the CPU or with ``--adapter-finish host``
    it does not; a bad value names the flag."""
    import json

    from multilora.memory.pool import scratch_elems
    from multilora.runtime.cli import main
    from multilora.runtime.weights import model_config

    gpu = MemorySnapshot(has_gpu=True, cuda_free_bytes=20 * GiB, cuda_total_bytes=24 * GiB,
                         meminfo_text=f"MemTotal: {64 * GiB // 1024} kB\nMemFree: {32 * GiB // 1024} kB\n"
                                      f"MemAvailable: {32 * GiB // 1024} kB\n")
    flags = ["--max-batch-size", "2", "--max-seq-len", "64", "--max-lora-rank", "8"]

    def reserve(snapshot, *more):
        snap = tmp_path / "snap.json"
        snap.write_text(json.dumps(snapshot.to_dict()))
        assert main(["memory", "--snapshot", str(snap), "--model", str(tiny_dir), "--json", *flags, *more]) == 0
        got = json.loads(capsys.readouterr().out)["engine"]
        assert (got["adapter_finish"] == "device") == (got["finish_scratch_bytes"] > 0)
        assert main(["memory", "--snapshot", str(snap), "--model", str(tiny_dir), *flags, *more]) == 0
        said = "scratch that finishes adapters read from disk on the device" in capsys.readouterr().out
        assert said == (got["adapter_finish"] == "device")
        return got["activation_bytes"]

    elems = scratch_elems(model_config(tiny_dir, require_weights=False), 8)
    scratch = elems * 2  # (bfloat16 on a GPU)
    assert scratch > 0
    default, host, device = reserve(gpu), reserve(gpu, "--adapter-finish", "host"), reserve(gpu, "--adapter-finish",
                                                                                            "device")
    assert default == device == host + scratch
    cpu = _host_snapshot(4 * GiB)
    assert reserve(cpu) == reserve(cpu, "--adapter-finish", "host")
    assert reserve(cpu, "--adapter-finish", "device") == reserve(cpu) + elems * 4  # (float32 on the CPU)
    snap = tmp_path / "snap.json"
    snap.write_text(json.dumps(gpu.to_dict()))
    with pytest.raises(SystemExit) as e:
        main(["memory", "--snapshot", str(snap), "--model", str(tiny_dir), *flags, "--adapter-finish", "gpu"])
    assert e.value.code == 2
    assert "--adapter-finish: invalid choice: 'gpu' (choose from 'host', 'device')" in capsys.readouterr().err
