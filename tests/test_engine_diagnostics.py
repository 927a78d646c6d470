"""The engine's stall diagnostics. The Triton compile counter behind ``Engine.stats()``'s ``kernel_compiles`` /
``kernel_compile_seconds`` and the ``multilora_kernel_compiles`` metric (``multilora.kernels.backends``): it counts
compiles through Triton's JIT hooks, chains to hooks set before it, and (on a GPU) counts one per new kernel
specialisation and none for a cached one. And ``StepTimes``, the step-duration histogram behind ``step_seconds`` and
``multilora_step_duration_seconds``."""

from __future__ import annotations

import pytest
import torch

from multilora.kernels import backends

triton = pytest.importorskip("triton")
knobs = pytest.importorskip("triton.knobs")
HAS_CUDA = torch.cuda.is_available()


@pytest.fixture
def fresh(monkeypatch):
    """The counter not yet installed and no Triton hooks set (an engine built earlier in this process installed the
    counter's: chained to, they would count every compile a second time), Triton's hooks restored afterwards."""
    monkeypatch.setattr(backends, "_hooked", [])
    monkeypatch.setattr(backends, "_compiles", {"count": 0, "seconds": 0.0})
    monkeypatch.setattr(backends, "_compile_names", __import__("collections").deque(maxlen=64))
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", None)
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", None)


def test_counts_through_the_hooks_and_chains_earlier_ones(fresh):
    assert backends.kernel_compiles() == {"kernel_compiles": None, "kernel_compile_seconds": None}  # not counting
    seen = []
    knobs.runtime.jit_cache_hook = lambda **kw: seen.append(("before", kw["key"])) or False
    knobs.runtime.jit_post_compile_hook = lambda **kw: seen.append(("after", kw["key"]))
    assert backends.count_kernel_compiles() is True
    assert backends.count_kernel_compiles() is True  # idempotent: one set of hooks
    for key in ("k1", "k2"):  # what Triton's JITFunction._do_compile calls around one compile
        assert not knobs.runtime.jit_cache_hook(key=key)  # falsy: Triton goes on and compiles
        knobs.runtime.jit_post_compile_hook(key=key)
    got = backends.kernel_compiles()
    assert got["kernel_compiles"] == 2 and got["kernel_compile_seconds"] >= 0
    assert seen == [("before", "k1"), ("after", "k1"), ("before", "k2"), ("after", "k2")]


def test_names_the_latest_variants(fresh):
    """``recent_kernel_compiles``: Triton's own name of each variant (its ``repr``: kernel, options and argument
    types), oldest first, the last 64 kept; the engine's stats carry the last 8."""
    assert backends.recent_kernel_compiles() == []
    backends.count_kernel_compiles()
    for i in range(70):
        knobs.runtime.jit_cache_hook(key=i)
        knobs.runtime.jit_post_compile_hook(key=i, repr=f"_k[num_warps=4](T: i32, n: {i})")
    got = backends.recent_kernel_compiles()
    assert len(got) == 64 and got[0] == "_k[num_warps=4](T: i32, n: 6)" and got[-1].endswith("n: 69)")
    assert backends.recent_kernel_compiles(2) == ["_k[num_warps=4](T: i32, n: 68)", "_k[num_warps=4](T: i32, n: 69)"]
    assert backends.recent_kernel_compiles(0) == []


def test_an_earlier_cache_hook_can_still_skip_the_compile(fresh):
    knobs.runtime.jit_cache_hook = lambda **kw: True  # e.g. a precompiled-kernel cache: Triton skips the compile
    backends.count_kernel_compiles()
    assert knobs.runtime.jit_cache_hook(key="k") is True
    assert backends.kernel_compiles()["kernel_compiles"] == 0  # no post-compile call: nothing compiled


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (runs on the device machine)")
def test_one_count_per_new_specialisation_on_gpu(fresh):
    import triton.language as tl

    @triton.jit
    def _add_one(x_ptr, n_elems, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = offs < n_elems
        tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=m) + 1, mask=m)

    backends.count_kernel_compiles()
    x = torch.zeros(100, device="cuda")

    def launch(k: int) -> None:
        _add_one[(triton.cdiv(k, 64),)](x, k, BLOCK=64)

    counts = []
    for k in (37, 37, 48, 64, 37):  # 37 (new), 37 (cached), 48 (divisible by 16: new), 64 (same as 48), 37
        launch(k)
        counts.append(backends.kernel_compiles()["kernel_compiles"])
    torch.cuda.synchronize()
    assert counts == [1, 1, 2, 2, 2]
    assert backends.kernel_compiles()["kernel_compile_seconds"] > 0
    assert x[:37].eq(5).all() and x[37:48].eq(2).all() and x[48:64].eq(1).all()


def test_engine_stats_carry_the_counter():
    from multilora import Engine
    from multilora.config import ModelConfig

    cfg = ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2, num_kv_heads=1)
    s = Engine(cfg, device="cpu", dtype=torch.float32, progress=False).stats()
    assert {"kernel_compiles", "kernel_compile_seconds", "recent_kernel_compiles"} <= set(s)
    assert isinstance(s["recent_kernel_compiles"], list) and len(s["recent_kernel_compiles"]) <= 8
    if not backends._hooked:  # no CUDA engine started in this process: the count is off, not zero
        assert s["kernel_compiles"] is None and s["kernel_compile_seconds"] is None


def test_step_times_histogram():
    """``StepTimes``: cumulative counts per bucket bound, the sum, the slowest step's bucket (inf past the last)."""
    import math

    from multilora.runtime.engine import STEP_BUCKETS, StepTimes

    st = StepTimes()
    for secs in (0.0005, 0.003, 0.003, 0.2):
        st.observe("decode", secs)
    st.observe("mixed", 100.0)
    r = st.report()
    d = r["decode"]
    assert d["count"] == 4 and d["sum"] == pytest.approx(0.2065)
    cum = dict(d["buckets"])
    assert cum[0.001] == 1 and cum[0.002] == 1 and cum[0.004] == 3 and cum[0.128] == 3 and cum[0.256] == 4
    assert [le for le, _ in d["buckets"]] == list(STEP_BUCKETS) and d["max_bucket"] == 0.256
    assert r["mixed"]["count"] == 1 and r["mixed"]["buckets"][-1][1] == 0 and math.isinf(r["mixed"]["max_bucket"])


def test_step_times_keep_the_recent_steps():
    """``since(mark)``: the steps after a past ``observed``, oldest first, with kind and rows; a mark older than
    what is kept is refused rather than answered with a partial list."""
    from multilora.runtime.engine import StepTimes

    st = StepTimes(keep=3)
    st.observe("prefill", 0.01, 2)
    mark = st.observed
    st.observe("decode", 0.002, 2)
    st.observe("mixed", 0.03, 3)
    assert st.since(mark) == [("decode", 2, 0.002), ("mixed", 3, 0.03)]
    assert st.since(st.observed) == []
    assert st.phases_since(mark) == [None, None]
    st.observe("decode", 0.001, 1)
    st.observe("decode", 0.001, 1, {"run_s": 0.0005})
    assert st.phases_since(st.observed - 2) == [None, {"run_s": 0.0005}]
    with pytest.raises(ValueError, match="within the last 3 steps"):
        st.since(mark)
    with pytest.raises(ValueError, match="within the last 3 steps"):
        st.phases_since(mark)


def test_engine_steps_record_where_their_time_went(tmp_path):
    """``Engine.step`` passes each step's host phases to ``StepTimes`` (``phases_since``): read-back, scheduling,
    residency and launch seconds, each >= 0 and together at most the step's wall time, and the adapters its
    scheduling copied to the GPU pool: the first step of two requests on two new adapters copies both, later steps
    none, and a third adapter admitted later is counted in the step that admits it; an adapter prefetched for a
    waiting request counts as a prefetch of the step that queued it, and not again when the request is admitted."""
    from multilora import Engine, SamplingParams
    from multilora.config import ModelConfig
    from testsupport import write_adapter

    cfg = ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2, num_kv_heads=1)
    e = Engine(cfg, device="cpu", dtype=torch.float32, progress=False, max_batch_size=4)
    for i in range(3):
        e.load_adapter(f"a{i}", write_adapter(tmp_path / f"a{i}", cfg, seed=i, rank=2, modules=["q_proj", "v_proj"]))
    mark = e.step_times.observed
    sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    e.add_request([1, 2, 3], adapter="a0", sampling=sp)
    e.add_request([4, 5], adapter="a1", sampling=sp)
    e.step()
    e.add_request([6, 7, 8], adapter="a2", sampling=sp)
    while e.has_unfinished():
        e.step()
    steps, phases = e.step_times.since(mark), e.step_times.phases_since(mark)
    assert len(steps) == len(phases) >= 4
    keys = {"read_back_s", "schedule_s", "resident_s", "run_s", "adapter_misses", "adapter_prefetches",
            "pool_compactions", "host_arena_map_seconds", "host_arena_pin_seconds"}
    for (_, _, secs), p in zip(steps, phases):
        assert set(p) == keys and all(p[k] >= 0 for k in keys)
        assert p["read_back_s"] + p["schedule_s"] + p["resident_s"] + p["run_s"] <= secs
        assert p["host_arena_pin_seconds"] <= p["host_arena_map_seconds"]
    misses = [p["adapter_misses"] for p in phases]
    assert misses[0] == 2 and misses[1] == 1 and sum(misses) == 3, misses
    assert sum(p["adapter_prefetches"] for p in phases) == 0  # every request was admitted at once
    assert all(p["pool_compactions"] == 0 for p in phases)  # (three small adapters in a pool with room)
    # one row at a time: the second request waits, and the first step prefetches its adapter for it
    e = Engine(cfg, device="cpu", dtype=torch.float32, progress=False, max_batch_size=1)
    for i in range(2):
        e.load_adapter(f"a{i}", tmp_path / f"a{i}")
    mark = e.step_times.observed
    e.add_request([1, 2, 3], adapter="a0", sampling=sp)
    e.add_request([4, 5], adapter="a1", sampling=sp)
    while e.has_unfinished():
        e.step()
    phases = e.step_times.phases_since(mark)
    assert (phases[0]["adapter_misses"], phases[0]["adapter_prefetches"]) == (1, 1), phases[0]
    assert sum(p["adapter_misses"] for p in phases) == 1 and sum(p["adapter_prefetches"] for p in phases) == 1
    # a step during which the pool compacts, and the host arena maps a chunk, counts them; the steps around it do not
    real = e.scheduler.schedule
    calls = []

    def schedule():
        if len(calls) == 1:  # the second step
            e.pool.compact()
            e.cache.arena.register_seconds += 0.25  # (what a chunk's mapping adds when it ends)
        calls.append(1)
        return real()

    e.scheduler.schedule = schedule
    mark = e.step_times.observed
    e.add_request([1, 2, 3], adapter="a0", sampling=sp)
    while e.has_unfinished():
        e.step()
    phases = e.step_times.phases_since(mark)
    assert [p["pool_compactions"] for p in phases][:3] == [0, 1, 0], phases
    assert [p["host_arena_map_seconds"] for p in phases][:3] == [0.0, pytest.approx(0.25), 0.0], phases


def test_gil_switch_interval_is_set_while_the_engine_lives_and_restored_at_close(tmp_path_factory):
    """``EngineConfig.gil_switch_interval``: the engine sets ``sys.setswitchinterval`` (default 0.5 ms) once built, and
    ``close`` puts the interpreter's value back unless something changed it since; 0 or None leave it alone; a bad
    value names the argument; the CLI flag reaches the config."""
    import argparse
    import sys

    from multilora import Engine
    from multilora.runtime.config import EngineConfig
    from testsupport import tiny_llama_dir

    d = tiny_llama_dir(tmp_path_factory, vocab_size=64)
    before = sys.getswitchinterval()
    try:
        sys.setswitchinterval(0.004)
        e = Engine(model=str(d), progress=False, max_batch_size=2)
        assert EngineConfig().gil_switch_interval == 0.0005 and sys.getswitchinterval() == pytest.approx(0.0005)
        e.close()
        assert sys.getswitchinterval() == pytest.approx(0.004)
        e.close()  # idempotent
        assert sys.getswitchinterval() == pytest.approx(0.004)
        e = Engine(model=str(d), progress=False, max_batch_size=2, gil_switch_interval=0.002)
        sys.setswitchinterval(0.003)  # changed by someone else since: close leaves it
        e.close()
        assert sys.getswitchinterval() == pytest.approx(0.003)
        for off in (0, None):
            Engine(model=str(d), progress=False, max_batch_size=2, gil_switch_interval=off).close()
            assert sys.getswitchinterval() == pytest.approx(0.003)
        with pytest.raises(ValueError, match=r"Engine: gil_switch_interval must be None or a number of seconds in "
                                             r"\[0, 1\] \(0: leave Python's\), got -1"):
            EngineConfig(gil_switch_interval=-1)
        with pytest.raises(ValueError, match="gil_switch_interval"):
            Engine(model=str(d), progress=False, gil_switch_interval="fast")
        assert sys.getswitchinterval() == pytest.approx(0.003)  # a failed construction changed nothing
        p = argparse.ArgumentParser()
        EngineConfig.add_cli_flags(p)
        assert EngineConfig.from_cli(p.parse_args(["--gil-switch-interval", "0.001"])).gil_switch_interval == 0.001
    finally:
        sys.setswitchinterval(before)


def test_outputs_give_the_admission_time_and_the_adapters_tier_at_submission(tmp_path):
    """``RequestOutput.admit_time`` (first admission: between arrival and the first token) and ``adapter_tier``: "disk"
    for an adapter registered without its weights read, "gpu" once resident, None for the base model; a request
    that waits behind a full batch is admitted after the steps it waited through."""
    from multilora import Engine, SamplingParams
    from multilora.config import ModelConfig
    from testsupport import write_adapter

    cfg = ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2, num_kv_heads=1)
    e = Engine(cfg, device="cpu", dtype=torch.float32, progress=False, max_batch_size=1)
    e.load_adapter("a", write_adapter(tmp_path / "a", cfg, seed=0, rank=2, modules=["q_proj"]), preload=False)
    sp = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    first, second, base = e.generate([[1, 2], [3, 4], [5, 6]], adapters=["a", "a", None], sampling=sp)
    assert (first.adapter_tier, second.adapter_tier, base.adapter_tier) == ("disk", "disk", None)
    for o in (first, second, base):
        assert o.arrival_time <= o.admit_time <= o.first_token_time <= o.finish_time, o
    # one row at a time: each waits for the one before to finish
    assert first.finish_time <= second.admit_time and second.finish_time <= base.admit_time
    again = e.generate([[7, 8]], adapters=["a"], sampling=sp)[0]
    assert again.adapter_tier == "gpu"


def test_time_in_queue_counts_every_wait_before_the_first_token(monkeypatch):
    """``RequestOutput.time_in_queue`` sums the request's waits in the queue over its admissions until its first
    token: a request preempted while its prompt was still being computed (chunked prefill, a KV cache of a few
    blocks) waits again, and that wait is queue time, not prefill; ``preemptions`` counts it. Checked against the
    scheduler's own admission times, recorded here."""
    import time as _time

    from multilora import Engine, SamplingParams
    from multilora.config import ModelConfig

    cfg = ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2, num_kv_heads=1)
    block = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 16 * 4  # K and V of 16 fp32 tokens
    e = Engine(cfg, device="cpu", dtype=torch.float32, progress=False, max_batch_size=4, kv_cache_bytes=block * 9,
               max_num_batched_tokens=8, max_prefill_tokens=8, kv_block_size=16)
    waits: dict[int, list[tuple[float, float]]] = {}  # request id -> (queued since, admitted at) of each admission
    real_preempt, real_schedule = e.scheduler._preempt, e.scheduler.schedule

    def schedule():
        before = {r.request_id: (r.queued_time if r.queued_time is not None else r.arrival, r.first_token_time)
                  for r in e.scheduler.waiting}
        out = real_schedule()
        for r in e.scheduler.running:
            if r.request_id in before and r.status.name == "RUNNING" and r.admit_time is not None:
                since, first = before[r.request_id]
                if first is None and r not in [w for w in e.scheduler.waiting]:
                    waits.setdefault(r.request_id, []).append((since, _time.perf_counter()))
        return out

    preempted_early = []

    def preempt(req, **kw):
        preempted_early.append(req.first_token_time is None)
        return real_preempt(req, **kw)

    monkeypatch.setattr(e.scheduler, "schedule", schedule)
    monkeypatch.setattr(e.scheduler, "_preempt", preempt)
    sp = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)
    reqs = [e.add_request([i + 1] * 60, sampling=sp) for i in range(3)]
    while e.has_unfinished():
        _time.sleep(0.002)
        e.step()
    assert any(preempted_early), "the setting no longer preempts a request before its first token"
    for r in reqs:
        o = e.postprocess.output(r)
        assert o.preemptions == r.preemptions
        assert o.arrival_time <= o.admit_time <= o.first_token_time
        assert 0 <= o.time_in_queue <= o.first_token_time - o.arrival_time
        got = sum(admitted - since for since, admitted in waits.get(r.request_id, []))
        assert o.time_in_queue == pytest.approx(got, abs=0.003), (r.request_id, o.time_in_queue, got)
    early = [e.postprocess.output(r) for r in reqs if r.preemptions]
    assert any(o.time_in_queue > o.admit_time - o.arrival_time + 0.002 for o in early)  # waited again after a preemption


def test_generate_progress_bar_counts_requests_and_tokens(capsys):
    """``generate(progress=True)``: a bar on stderr of the finished requests, with the tokens generated so far (a
    batch whose requests all end in its last step still shows progress); nothing on stdout."""
    from multilora import Engine, SamplingParams
    from multilora.config import ModelConfig

    cfg = ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2, num_kv_heads=1)
    e = Engine(cfg, device="cpu", dtype=torch.float32, progress=False, max_batch_size=4)
    outs = e.generate([[1, 2], [3, 4, 5]], sampling=SamplingParams(max_tokens=5, ignore_eos=True), progress=True)
    out, err = capsys.readouterr()
    assert out == "" and sum(len(o.token_ids) for o in outs) == 10
    last = err.replace("\r", "\n").strip().splitlines()[-1]
    assert last.startswith("Generating: 100%") and "2/2" in last and last.rstrip("]").endswith("10 tokens"), err
    e.generate([[1, 2]], sampling=SamplingParams(max_tokens=2, ignore_eos=True))  # (off by default)
    assert capsys.readouterr() == ("", "")
