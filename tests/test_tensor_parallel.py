"""Tensor parallelism on the CPU (issue 17): gloo, 2 and 4 processes, against the one-process engine.

- The sharding itself, without processes: every rank's shard of every weight and LoRA factor, put back
  together, is the full tensor (rows for column-parallel modules, columns for row-parallel ones, KV heads
  replicated when there are fewer than ranks, o's bias on rank 0 only, Phi-3's fused tensors part by part).
- Engines of 2 and 4 ranks (worker processes spawned by the engine) on a tiny random model (4 heads, 2 KV heads:
  4 ranks replicate each KV head twice) with adapters of different ranks and target modules: fp32 logits of a
  mixed batch equal the one-process engine's to 1e-5, greedy generations are identical, and stay so while a
  one-slot pool evicts and reloads adapters on every request and when an adapter is reloaded under its name.
- Failures: an adapter a worker cannot read fails its own requests only; a killed worker fails the step's
  requests with an error naming it, the engine refuses further work, and ``close()`` leaves no process behind.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest
import torch
from testsupport import rel_err, write_adapter

from multilora import Engine, SamplingParams
from multilora.config import ModelConfig
from multilora.runtime import model as model_mod
from multilora.runtime.parallel import TensorParallelError
from multilora.runtime.sharding import check_tp_size, shard_lora, shard_weights, tp_rank_config
from multilora.runtime.weights import random_weights

CFG = ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                  max_position_embeddings=1024)
KW = dict(device="cpu", progress=False, max_batch_size=4, max_seq_len=64, max_lora_rank=16)
ROWS = [[5, 9, 14, 3, 77, 301, 12], [8, 1, 400], [2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [42]]
ADAPTERS = {"a0": (8, ["q_proj", "v_proj", "o_proj"]), "a1": (4, ["k_proj", "gate_proj", "up_proj", "down_proj"]),
            "a2": (16, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])}
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


# ------------------------------------------------------------------------------------- sharding alone
@pytest.mark.parametrize("size", [2, 4])
def test_weight_shards_reassemble(size):
    c = ModelConfig(**{**CFG.__dict__, "qkv_bias": True, "o_bias": True})
    w = random_weights(c, dtype=torch.float32, device="cpu")
    shards = [shard_weights(w, c, r, size) for r in range(size)]
    rc = tp_rank_config(c, size)
    assert (rc.num_heads, rc.num_kv_heads, rc.intermediate_size, rc.head_dim) == (4 // size, max(2 // size, 1), 128 // size, 16)
    p = "model.layers.1."
    for m in ("q_proj", "gate_proj", "up_proj"):
        assert torch.equal(torch.cat([s[f"{p}{'self_attn' if m == 'q_proj' else 'mlp'}.{m}.weight"] for s in shards]),
                           w[f"{p}{'self_attn' if m == 'q_proj' else 'mlp'}.{m}.weight"])
    for m, parent in (("o_proj", "self_attn"), ("down_proj", "mlp")):
        key = f"{p}{parent}.{m}.weight"
        assert torch.equal(torch.cat([s[key] for s in shards], dim=1), w[key])
    k = f"{p}self_attn.k_proj.weight"
    if size == 2:  # one KV head each
        assert torch.equal(torch.cat([s[k] for s in shards]), w[k])
    else:  # 4 ranks, 2 KV heads: ranks 0-1 hold head 0, ranks 2-3 head 1 (the heads of their query heads)
        assert torch.equal(shards[0][k], w[k][:16]) and torch.equal(shards[1][k], w[k][:16])
        assert torch.equal(shards[2][k], w[k][16:]) and torch.equal(shards[3][k], w[k][16:])
    ob = f"{p}self_attn.o_proj.bias"
    assert torch.equal(shards[0][ob], w[ob]) and all((s[ob] == 0).all() for s in shards[1:])
    assert all(torch.equal(s["model.embed_tokens.weight"], w["model.embed_tokens.weight"]) for s in shards)


def test_phi3_fused_shards_are_the_parts_shards():
    c = ModelConfig(**{**CFG.__dict__, "fused_projections": True, "architecture": "phi3"})
    w = random_weights(c, dtype=torch.float32, device="cpu")
    plain = {k: v for k, v in random_weights(CFG, dtype=torch.float32, device="cpu").items()}
    key = "model.layers.0.self_attn.qkv_proj.weight"
    q, k, v = w[key].split([c.q_size, c.kv_size, c.kv_size])
    plain.update({"model.layers.0.self_attn.q_proj.weight": q, "model.layers.0.self_attn.k_proj.weight": k,
                  "model.layers.0.self_attn.v_proj.weight": v})
    s_fused = shard_weights(w, c, 1, 2)[key]
    s_plain = shard_weights(plain, CFG, 1, 2)
    assert torch.equal(s_fused, torch.cat([s_plain[f"model.layers.0.self_attn.{m}.weight"] for m in ("q_proj", "k_proj", "v_proj")]))


def test_lora_shards_sum_to_the_full_delta():
    """Column-parallel: each rank's B rows give its slice of the output; row-parallel: the ranks' partial
    (x_r A_r^T) B^T sum to x A^T B^T (the all-reduce of o / down adds them)."""
    g = torch.Generator().manual_seed(0)
    for module, (d_in, d_out) in (("q_proj", (64, 64)), ("o_proj", (64, 64)), ("down_proj", (128, 64)), ("up_proj", (64, 128))):
        a, b = torch.randn(8, d_in, generator=g), torch.randn(d_out, 8, generator=g)
        x = torch.randn(3, d_in, generator=g)
        full = x @ a.t() @ b.t()
        parts = [shard_lora(module, a, b, CFG, r, 2) for r in range(2)]
        if module in ("o_proj", "down_proj"):
            xs = x.chunk(2, dim=1)
            got = sum(xs[r] @ pa.t() @ pb.t() for r, (pa, pb) in enumerate(parts))
        else:
            got = torch.cat([x @ pa.t() @ pb.t() for pa, pb in parts], dim=1)
        assert rel_err(got, full) < 1e-6


def test_bad_sizes_refused_before_any_process_starts(tmp_path_factory):
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3 does not divide the model's num_heads 4, "
                                         r"intermediate_size 128, num_kv_heads 2 \(the size must divide it or be a "
                                         r"multiple of it\); the sizes that do: 1, 2, 4$"):
        check_tp_size(CFG, 3)
    with pytest.raises(ValueError, match="tensor_parallel_size=3"):
        Engine(CFG, tensor_parallel_size=3, **KW)
    with pytest.raises(ValueError, match=r"tensor_parallel_size must be an int >= 1, got 0"):
        Engine(CFG, tensor_parallel_size=0, **KW)
    import multiprocessing

    from testsupport import tiny_llama_dir

    d = tiny_llama_dir(tmp_path_factory, 64)  # a model directory: its config.json is read, no weights, no workers
    with pytest.raises(ValueError, match="tensor_parallel_size=3 does not divide"):
        Engine(str(d), tensor_parallel_size=3, **KW)
    assert multiprocessing.active_children() == []


# ----------------------------------------------------------------------------------------- engines
@pytest.fixture(scope="module")
def adapter_paths(tmp_path_factory):
    d = tmp_path_factory.mktemp("tp-adapters")
    return {n: write_adapter(d / n, CFG, seed=i, rank=r, modules=m) for i, (n, (r, m)) in enumerate(ADAPTERS.items())}


@pytest.fixture(scope="module")
def reference(adapter_paths):
    e = Engine(CFG, **KW)
    for n, p in adapter_paths.items():
        e.load_adapter(n, p)
    return e


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.parametrize("size,side", [(2, 0), (4, 0), (2, 1 << 20)], ids=["2", "4", "2-lora-deferred"])
def test_tp_engine_equals_one_process(size, side, adapter_paths, reference):
    """``side``: ``lora_side_stream_max_tokens`` (the GPU's decode path: q/k/v and gate/up LoRA added by the op after
    the projection; the row-parallel o and down keep theirs inside the all-reduce)."""
    with Engine(CFG, tensor_parallel_size=size, lora_side_stream_max_tokens=side, **KW) as e:
        assert e.model.lora_side_max_tokens == side
        pids = [p.pid for p in e.tp.procs]
        assert len(pids) == size - 1 and all(_alive(p) for p in pids)
        assert e.stats()["tensor_parallel_size"] == size
        for n, p in adapter_paths.items():
            e.load_adapter(n, p)
        for adapters in ([None] * 4, ["a0", None, "a1", "a2"], ["a2", "a2", "a0", None]):
            assert rel_err(e.logits(ROWS, adapters), reference.logits(ROWS, adapters)) < 1e-5
        mixed = ["a1", "a0", None, "a2"]
        got = [o.token_ids for o in e.generate(ROWS, adapters=mixed, sampling=GREEDY)]
        assert got == [o.token_ids for o in reference.generate(ROWS, adapters=mixed, sampling=GREEDY)]
        # a step of LORA_BEFORE_GEMM_MIN_TOKENS tokens: each rank writes its LoRA term first and its GEMM adds to it
        # (o / down: partial sums of both, reduced together); against each row alone on one process (the add after)
        long = [[(7 * i + 3 * j) % 500 + 2 for j in range(64)] for i in range(4)]
        assert sum(map(len, long)) >= model_mod.LORA_BEFORE_GEMM_MIN_TOKENS
        want = torch.stack([reference.logits([r], [a])[0] for r, a in zip(long, mixed)])
        assert rel_err(e.logits(long, mixed), want) < 1e-5
    time.sleep(0.5)
    assert not any(_alive(p) for p in pids), "close() left worker processes"


@pytest.mark.parametrize("family", [dict(qkv_bias=True, o_bias=True, qk_norm=True, head_dim=24, architecture="qwen3"),
                                    dict(fused_projections=True, architecture="phi3"),
                                    dict(architecture="gemma2", hidden_act="gelu_pytorch_tanh", norm_unit_offset=True,
                                         scale_embeddings=True, block_output_norms=True, query_pre_attn_scalar=12,
                                         attn_logit_softcapping=2.0, final_logit_softcapping=3.0, sliding_window=4,
                                         layer_types=["sliding_attention", "full_attention"], tie_word_embeddings=True)])
def test_tp_family_flags(family, tmp_path):
    """Biases (o's added by rank 0 only; random_weights draws them non-zero), per-head q/k norms with a head_dim of
    its own (q_size 96 != hidden 64), Phi-3's fused checkpoint tensors, Gemma 2 (its output norms after the
    all-reduce, soft-caps, a window): 2 ranks equal one process."""
    c = ModelConfig(**{**CFG.__dict__, "head_dim": 0, **family})
    if c.fused_projections:  # a PEFT adapter on the fused names: one A per fused module, B over the fused width
        path = _fused_adapter(tmp_path / "a", c)
    else:
        path = write_adapter(tmp_path / "a", c, seed=5, rank=8, modules=["q_proj", "k_proj", "o_proj", "up_proj", "down_proj"])
    ref = Engine(c, **KW)
    with Engine(c, tensor_parallel_size=2, **KW) as e:
        for eng in (ref, e):
            eng.load_adapter("a", path)
        want = ref.logits(ROWS, ["a", None, "a", None])
        got = e.logits(ROWS, ["a", None, "a", None])
        assert rel_err(got, want) < 1e-5


def _fused_adapter(out, c):
    import json

    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(6)
    t = {}
    for layer in range(c.num_layers):
        for parent, mod, d_out in (("self_attn", "qkv_proj", c.q_size + 2 * c.kv_size),
                                   ("mlp", "gate_up_proj", 2 * c.intermediate_size), ("self_attn", "o_proj", c.hidden_size)):
            d_in = c.q_size if mod == "o_proj" else c.hidden_size
            key = f"base_model.model.model.layers.{layer}.{parent}.{mod}"
            t[f"{key}.lora_A.weight"] = torch.randn(8, d_in, generator=g) * 0.15
            t[f"{key}.lora_B.weight"] = torch.randn(d_out, 8, generator=g) * 0.15
    out.mkdir()
    save_file(t, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8, "lora_alpha": 16,
                                                         "target_modules": ["qkv_proj", "gate_up_proj", "o_proj"]}))
    return out


def test_tp_eviction_reload_and_adapter_versions(adapter_paths, tmp_path):
    """A pool of one slot and no host tier: every request of another adapter evicts the resident one on every rank and
    rank 0 reads it again from disk (its shard); reloading a name under new weights serves the new version
    everywhere."""
    one = dict(KW, adapter_slots=1, max_batch_size=1, host_adapter_bytes=0)  # and no host tier: reloads from disk
    ref = Engine(CFG, **one)
    with Engine(CFG, tensor_parallel_size=2, **one) as e:
        for eng in (ref, e):
            for n, p in adapter_paths.items():
                eng.load_adapter(n, p)
        order = ["a0", "a1", "a2", "a0", None, "a2", "a1"]
        rows = [ROWS[i % len(ROWS)] for i in range(len(order))]
        assert [o.token_ids for o in e.generate(rows, adapters=order, sampling=GREEDY)] == \
               [o.token_ids for o in ref.generate(rows, adapters=order, sampling=GREEDY)]
        assert e.stats()["gpu_evictions"] >= 4 and e.stats()["bytes_disk_to_host"] > 0
        new = write_adapter(tmp_path / "a0-v2", CFG, seed=7, rank=4, modules=["v_proj", "down_proj"])
        for eng in (ref, e):
            eng.load_adapter("a0", new)
        assert rel_err(e.logits(ROWS[:2], ["a0", "a1"]), ref.logits(ROWS[:2], ["a0", "a1"])) < 1e-5


def test_tp_adapter_a_worker_cannot_read_fails_alone(adapter_paths, tmp_path):
    """The files change between rank 0's read and the workers' (at the next step): that adapter's requests fail
    with the worker's reason; the others are served."""
    bad = write_adapter(tmp_path / "bad", CFG, seed=9, rank=8, modules=["q_proj"])
    with Engine(CFG, tensor_parallel_size=2, **KW) as e:
        e.load_adapter("a0", adapter_paths["a0"])
        e.generate([ROWS[1]], adapters=["a0"], sampling=GREEDY)  # the workers have read a0
        e.load_adapter("bad", bad)
        w = bad / "adapter_model.safetensors"
        st = w.stat()
        os.utime(w, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
        outs = e.generate([ROWS[0], ROWS[1]], adapters=["bad", "a0"], sampling=GREEDY)
        assert outs[0].finish_reason == "error" and "tensor-parallel worker 1 cannot read it" in outs[0].error
        assert outs[1].finish_reason == "length" and len(outs[1].token_ids) == 8


def test_tp_killed_worker_is_reported_and_nothing_is_left(adapter_paths):
    """A worker killed while the engine is idle is seen at once (``Engine.dead``, from its exit code: what a
    server's /health reads, no request needed); the next requests fail naming it, a runtime adapter load queued
    for the workers included (it does not raise out of ``generate``); close() leaves nothing."""
    hook = sys.excepthook
    e = Engine(CFG, tensor_parallel_size=2, **KW)
    try:
        pid = e.tp.procs[0].pid
        e.generate([ROWS[0]], sampling=GREEDY)
        assert e.dead is None
        os.kill(pid, signal.SIGKILL)
        deadline = time.time() + 10
        while e.dead is None and time.time() < deadline:  # (the exit code shows once the kill has landed)
            time.sleep(0.05)
        assert e.dead is not None and f"worker 1 (pid {pid}) exited with code -9" in e.dead, e.dead
        name, path = next(iter(adapter_paths.items()))
        e.load_adapter(name, path)  # queued for the workers: the next step's sync meets the dead group
        out = e.generate([ROWS[0], ROWS[1]], adapters=[name, None], sampling=GREEDY)
        assert all(o.finish_reason == "error" for o in out)
        assert "worker 1" in out[0].error and "exited" in out[0].error, out[0].error
        with pytest.raises(TensorParallelError, match="worker 1"):
            e.tp.step("eager", ([[1]], [0], [[1]], [-1]))
        assert "worker 1" in e.dead  # (a serving loop reads it: not running, 503 engine_dead)
    finally:
        e.close()
    assert not _alive(pid)
    assert sys.excepthook is hook  # (torch's "[rank0]: " wrapper removed with the group: no stacked prefixes)
    again = Engine(CFG, tensor_parallel_size=2, **KW)  # the process group was torn down: a new engine starts
    try:
        assert again.generate([ROWS[1]], sampling=GREEDY)[0].finish_reason == "length"
    finally:
        again.close()


def test_tp_close_after_a_worker_died_stops_the_survivors_at_once():
    """The survivors of a dead group wait in a collective that never ends: close() terminates them at once instead
    of giving each the 10 s a stopped worker gets (8 ranks took over a minute, past an orchestrator's grace period)."""
    e = Engine(CFG, tensor_parallel_size=4, **KW)
    try:
        pids = [p.pid for p in e.tp.procs]
        os.kill(pids[1], signal.SIGKILL)
        time.sleep(0.5)
        assert all(o.finish_reason == "error" for o in e.generate([ROWS[0]], sampling=GREEDY))
        assert e.dead is not None
    finally:
        t0 = time.monotonic()
        e.close()
        took = time.monotonic() - t0
    assert not any(_alive(p) for p in pids)
    assert took < 9.0, f"close() took {took:.1f} s: it waited for workers that cannot stop"


def _worker_pid(engine):
    return engine.tp.procs[0].pid


def test_tp_engine_inside_serve_engine_process(reference):
    """``multilora serve --engine-process --tensor-parallel-size 2``: the engine process (rank 0) starts its own
    worker; streams equal the one-process engine; closing the engine process stops the worker too."""
    import functools

    from multilora.runtime.config import EngineConfig
    from multilora.runtime.engine_process import EngineProcess, load_engine

    cfg = EngineConfig(**{k: v for k, v in KW.items() if k != "progress"}, tensor_parallel_size=2)
    proc = EngineProcess.start(functools.partial(load_engine, CFG, cfg, []))
    try:
        worker = proc.apply(_worker_pid)
        got = [d for d in proc.submit(ROWS[2], None, GREEDY)]
        assert sum((d.token_ids for d in got), []) == reference.generate([ROWS[2]], sampling=GREEDY)[0].token_ids
    finally:
        proc.close()
    time.sleep(0.5)
    assert not _alive(worker)
