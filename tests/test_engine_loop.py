"""The streaming engine (issue 14, "the engine, streaming and asynchronous"): ``EngineLoop`` steps on its own
thread, streams every request's tokens and text, serves threads and asyncio callers together, aborts; text
streaming never splits a character and holds back a stop string that spans tokens; concurrent ``generate()``
calls are batched; a bounded waiting queue refuses with ``EngineOverloadedError``.

The reference is ``Engine.generate`` of the same request alone (greedy or seeded: batch-invariant). The loop's tests
run twice: on an ``EngineLoop`` (thread) and on an ``EngineProcess`` (the same engine built in a child process, one per
module), which has the same streams, from the engine's per-step token ids."""

from __future__ import annotations

import asyncio
import functools
import shutil
import threading
import time

import numpy as np
import pytest

transformers = pytest.importorskip("transformers")

from multilora import Engine, SamplingParams  # noqa: E402
from multilora.runtime.engine import EngineOverloadedError  # noqa: E402
from multilora.runtime.config import EngineConfig  # noqa: E402
from multilora.runtime.engine_loop import EngineLoop  # noqa: E402
from multilora.runtime.engine_process import EngineProcess, load_engine  # noqa: E402
from multilora.runtime.tokenizer import TextStream  # noqa: E402
from testsupport import tiny_llama_dir, token_ids, tokenizer_dir, write_adapter  # noqa: E402
import engine_hooks as hooks  # noqa: E402

VOCAB = 49152
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


ADAPTERS = ("a", "b", "c")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """(the model directory, {adapter name: directory})."""
    d = tiny_llama_dir(tmp_path_factory, VOCAB, name="tiny-loop")
    for f in tokenizer_dir(tmp_path_factory).iterdir():
        shutil.copy(f, d)
    root = tmp_path_factory.mktemp("loop-adapters")
    return d, {name: root / name for name in ADAPTERS}


@pytest.fixture(scope="module")
def engine(files):
    d, adapters = files
    e = Engine(model=str(d), progress=False, max_batch_size=8)
    for i, name in enumerate(ADAPTERS):
        e.load_adapter(name, write_adapter(adapters[name], e.config, seed=i, rank=4 + 4 * i, modules=("q_proj", "v_proj")))
    return e


@pytest.fixture(scope="module")
def engine_process(engine, files):
    d, adapters = files  # written by ``engine``
    proc = EngineProcess.start(functools.partial(hooks.single_thread, load_engine, str(d),
                                                 EngineConfig(progress=False, max_batch_size=8),
                                                 {n: str(p) for n, p in adapters.items()}), timeout=120)
    yield proc
    proc.close()


@pytest.fixture(params=["thread", "process"])
def loop(request, engine):
    lp = EngineLoop(engine) if request.param == "thread" else request.getfixturevalue("engine_process")
    yield lp
    _apply(lp, engine, hooks.restore_steps)
    if request.param == "thread":
        lp.close()
    running, waiting, *_ = _apply(lp, engine, hooks.state)
    assert running == waiting == 0


def _apply(loop, engine, fn, *args):
    """``fn(engine, *args)`` on the engine the loop steps (``engine_hooks``)."""
    return loop.apply(fn, *args) if isinstance(loop, EngineProcess) else fn(engine, *args)


def _alone(engine, prompt, adapter=None, sampling=GREEDY):
    return engine.generate([prompt], adapters=[adapter], sampling=sampling)[0]


def _idle(engine, loop=None):
    running, waiting, free, total, refs = _apply(loop, engine, hooks.state)
    assert running == waiting == 0 and free == total
    assert all(r == 0 for r in refs.values()), refs


# ---------------------------------------------------------------------------------------------- text stream
class _Bytes:  # a tokenizer whose tokens are UTF-8 bytes: characters split across tokens
    def decode(self, ids):
        return bytes(ids).decode("utf-8", errors="replace")


@pytest.mark.parametrize("text,stop", [("héllo wörld 🙂 done", []), ("abc END def", ["END"]), ("xxENxEND", ["END"]),
                                       ("a😀b", ["😀b"]), ("no stop here", ["here!"])])
def test_text_stream_never_splits_a_character_nor_gives_out_a_stop_string(text, stop):
    """Byte by byte, as the engine would push it (until the text holds a stop string: the request then
    finishes with its text cut before it): no piece holds a split character, the pieces are always a prefix of
    the final text, and the final text is the pieces plus what ``close`` gives."""
    data = list(text.encode())
    ts = TextStream(_Bytes(), stop)
    joined = ""
    for i in range(1, len(data) + 1):
        if any(s in bytes(data[:i]).decode("utf-8", errors="replace") for s in stop):
            break  # check_stop finishes the request at this token
        piece = ts.push(data[:i])
        assert "\ufffd" not in piece
        joined += piece
    final = text[: min([text.find(s) for s in stop if s in text], default=len(text))]
    assert final.startswith(joined)
    assert joined + ts.close(final) == final


# ---------------------------------------------------------------------------------------------- the loop
def test_stream_equals_generate_token_for_token(engine, loop):
    prompt = token_ids(7, 1, VOCAB)
    want = _alone(engine, prompt, "b")
    deltas = list(loop.submit(prompt, "b", GREEDY))
    assert [t for d in deltas for t in d.token_ids] == want.token_ids
    assert "".join(d.text for d in deltas) == want.text
    assert deltas[-1].finished and deltas[-1].finish_reason == "length" and deltas[-1].output.token_ids == want.token_ids
    assert sum(1 for d in deltas if d.token_ids) >= 2  # streamed, not delivered at the end
    out = deltas[-1].output  # its times, in order, and its adapter's tier at submission (both loops pass them on)
    assert out.arrival_time <= out.admit_time <= out.first_token_time <= out.finish_time
    assert 0 <= out.time_in_queue <= out.first_token_time - out.arrival_time and out.preemptions == 0
    # (the thread's engine just ran ``_alone`` on it: resident; the process's own engine loaded it at start)
    assert out.adapter_tier == "gpu" if isinstance(loop, EngineLoop) else out.adapter_tier in ("gpu", "host")
    _idle(engine, loop)


def test_chat_stream_with_a_stop_string(engine, loop):
    msgs = [{"role": "user", "content": "Write a list."}]
    free = _alone(engine, msgs, None, SamplingParams(max_tokens=12, ignore_eos=True))
    stop = free.text[3:6] if len(free.text) > 6 else None
    if not stop or not stop.strip():
        pytest.skip("the tiny model's text has no usable stop string")
    sp = SamplingParams(max_tokens=12, ignore_eos=True, stop=[stop])
    want = _alone(engine, msgs, None, sp)
    deltas = list(loop.submit(msgs, None, sp))
    assert "".join(d.text for d in deltas) == want.text and deltas[-1].finish_reason == want.finish_reason == "stop"
    assert all(stop not in d.text for d in deltas)


def test_threads_are_batched_and_short_requests_come_back_first(engine, loop):
    """8 threads stream on different adapters at once: every result is its reference, they shared steps
    (fewer steps than run one after the other), and short requests finished before the long ones."""
    jobs = [(token_ids(5 + i, 10 + i, VOCAB), ("a", "b", "c", None)[i % 4], 2 if i % 2 else 24) for i in range(8)]
    want = [_alone(engine, p, a, SamplingParams(max_tokens=n, ignore_eos=True)).token_ids for p, a, n in jobs]
    got, finished_at = [None] * 8, [0.0] * 8
    steps0 = _apply(loop, engine, hooks.stats)["steps"]

    def run(i):
        p, a, n = jobs[i]
        ids = []
        for d in loop.submit(p, a, SamplingParams(max_tokens=n, ignore_eos=True)):
            ids += d.token_ids
        got[i], finished_at[i] = ids, time.perf_counter()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert got == want
    assert _apply(loop, engine, hooks.stats)["steps"] - steps0 < sum(n for _, _, n in jobs)  # batched, not serialised
    assert max(finished_at[1::2]) < max(finished_at[0::2])  # the 2-token requests were not held back by the 24s


def test_asyncio_streams_together(engine, loop):
    prompts = [token_ids(4 + i, 30 + i, VOCAB) for i in range(4)]
    want = [_alone(engine, p, "a").token_ids for p in prompts]

    async def one(p):
        ids = []
        async for d in loop.submit(p, "a", GREEDY):
            ids += d.token_ids
        return ids

    async def main():
        return await asyncio.gather(*(one(p) for p in prompts))

    assert asyncio.run(main()) == want


def test_an_async_consumer_that_fell_behind_gets_its_backlog_as_one_delta(engine, loop):
    """Deltas queued while an ``async for`` was not looking come as one: ids and text joined, the last one's end."""
    prompt = token_ids(9, 12, VOCAB)
    want = _alone(engine, prompt, "a", SamplingParams(max_tokens=6, ignore_eos=True))
    stream = loop.submit(prompt, "a", SamplingParams(max_tokens=6, ignore_eos=True))
    deadline = time.time() + 30
    while loop.num_streams and time.time() < deadline:  # the request finishes before anyone reads its stream
        time.sleep(0.01)

    async def read():
        return [d async for d in stream]

    (d,) = asyncio.run(read())
    assert d.token_ids == want.token_ids and d.text == want.text and d.finish_reason == "length"
    assert d.output.token_ids == want.token_ids


def _slow_steps(engine, loop, seconds=0.01):
    """Each step takes at least ``seconds``: a long request then runs for seconds, so aborts land mid-stream (the
    ``loop`` fixture restores the steps)."""
    _apply(loop, engine, hooks.slow_steps, seconds)


def test_abort_and_leaving_a_stream_free_the_request(engine, loop):
    _slow_steps(engine, loop)
    stats = (lambda: loop.stats()) if isinstance(loop, EngineProcess) else engine.stats
    aborted0 = stats()["requests_aborted"]
    long = SamplingParams(max_tokens=200, ignore_eos=True)
    s = loop.submit(token_ids(6, 50, VOCAB), "c", long)
    deltas = iter(s)
    first = next(deltas)
    assert not first.finished
    assert s.abort()
    rest = list(deltas)
    assert rest and rest[-1].finish_reason == "abort"
    it = iter(loop.submit(token_ids(6, 51, VOCAB), "a", long))  # a consumer that goes away mid-stream
    next(it)
    it.close()
    deadline = time.time() + 30
    while loop.num_streams and time.time() < deadline:
        time.sleep(0.01)
    # an id of numpy's (the child's abort once refused it, which failed every request the process ran) beside a
    # request that must finish untouched; a str id is a TypeError, not a silent miss
    victim = loop.submit(token_ids(6, 52, VOCAB), "b", long)
    other = loop.submit(token_ids(6, 53, VOCAB), "a", SamplingParams(max_tokens=20, ignore_eos=True))
    vi = iter(victim)  # (kept: a stream's iterator dropped mid-stream aborts its request)
    assert not next(vi).finished
    with pytest.raises(TypeError, match="abort: request_id: expected an int"):
        loop.abort(str(victim.request_id))
    assert loop.abort(np.int64(victim.request_id))
    assert list(vi)[-1].finish_reason == "abort" and other.result().finish_reason == "length"
    deadline = time.time() + 30
    while loop.num_streams and time.time() < deadline:
        time.sleep(0.01)
    _idle(engine, loop)
    assert not loop.abort(10**9)  # unknown id
    assert stats()["requests_aborted"] - aborted0 == 3  # (counted apart from requests_finished / _failed)


@pytest.mark.parametrize("kwargs,match", [
    ({"engine": None}, r"^engine: expected a multilora.Engine, got NoneType \(it has no has_unfinished, step, "),
    ({"engine": "x"}, r"^engine: expected a multilora.Engine, got str"),
    ({"poll_seconds": "1"}, r"^poll_seconds: expected a finite number > 0, got str '1'$"),
    ({"poll_seconds": 0}, r"^poll_seconds: expected a finite number > 0, got int 0$"),
    ({"poll_seconds": -1.0}, r"^poll_seconds: expected a finite number > 0, got float -1.0$"),
    ({"poll_seconds": float("inf")}, r"^poll_seconds: expected a finite number > 0, got float inf$"),
])
def test_a_loop_of_bad_arguments_is_refused_before_its_thread_starts(engine, kwargs, match):
    """``EngineLoop(None)`` started a thread that failed every pass with no pause (millions of log lines), and a
    ``poll_seconds`` of 0 or less spun a core while idle: both refused at construction."""
    threads = threading.active_count()
    with pytest.raises(ValueError, match=match):
        EngineLoop(**{"engine": engine, **kwargs})
    assert threading.active_count() == threads


def test_a_step_that_keeps_failing_backs_off_and_logs_sparingly(engine, monkeypatch, caplog):
    """A step that fails every time is retried with a growing wait (not in a spin), the traceback logged at the 1st,
    2nd, 4th, 8th... failure in a row only; once steps succeed again the loop serves at once."""
    monkeypatch.setattr(EngineLoop, "MAX_RETRY_SECONDS", 0.4)
    calls = []
    real_step, real_unfinished = engine.step, engine.has_unfinished

    def broken():
        calls.append(time.perf_counter())
        raise RuntimeError("a step that always fails")

    monkeypatch.setattr(engine, "has_unfinished", lambda: True)
    monkeypatch.setattr(engine, "step", broken)
    with caplog.at_level("ERROR", logger="multilora"):
        lp = EngineLoop(engine, poll_seconds=0.01)
        try:
            time.sleep(2.0)
            n = len(calls)
            # waits of 0.02, 0.04, ... capped at 0.4 s: about 9 tries in 2 s (a spin made millions)
            assert 4 <= n <= 20, n
            logged = [r for r in caplog.records if "a step failed" in r.getMessage()]
            # the 1st, 2nd, 4th, 8th, 16th of n (the last try's may not be logged yet)
            assert len(logged) in (n.bit_length(), (n - 1).bit_length()), (len(logged), n)
            monkeypatch.setattr(engine, "step", real_step)
            monkeypatch.setattr(engine, "has_unfinished", real_unfinished)
            assert lp.submit(token_ids(6, 54, VOCAB), None, GREEDY).result().finish_reason == "length"
        finally:
            lp.close()


def test_a_loop_step_that_raises_fails_its_streams_once_and_keeps_serving(engine, monkeypatch):
    """A step that raises outside the forward (a bug: the forward's own failures fail their batch in the engine) ends
    every streamed request with finish_reason "error", each counted once in ``requests_failed`` (not in
    ``requests_aborted``); the loop then serves the next request."""
    lp = EngineLoop(engine)
    try:
        before = engine.stats()
        real = engine.step
        calls = []

        def broken():
            calls.append(1)
            if len(calls) == 2:  # the second step: the request is running, its KV held
                raise RuntimeError("a bug in the step")
            return real()

        monkeypatch.setattr(engine, "step", broken)
        out = lp.submit(token_ids(6, 52, VOCAB), "a", SamplingParams(max_tokens=50, ignore_eos=True)).result()
        assert out.finish_reason == "error" and "the engine loop failed" in out.error
        after = engine.stats()
        assert after["requests_failed"] - before["requests_failed"] == 1
        assert after["requests_aborted"] == before["requests_aborted"]
        monkeypatch.undo()
        assert lp.submit(token_ids(6, 53, VOCAB), None, GREEDY).result().finish_reason == "length"
    finally:
        lp.close()
    _idle(engine)


def _waits_for_the_step_lock(engine, fn) -> bool:
    """Whether ``fn()`` in a thread waits while the step lock is held (it runs once the lock is released)."""
    done = threading.Event()
    with engine.step_lock:
        t = threading.Thread(target=lambda: (fn(), done.set()), daemon=True)
        t.start()
        waited = not done.wait(0.3)
    t.join(30)
    assert done.is_set(), "the call did not finish once the lock was free"
    return waited


def test_calls_that_change_what_a_step_reads_wait_for_the_step(engine):
    """``add_request`` (the waiting queue a step walks: "deque mutated during iteration" from another thread) and
    ``pin_adapter`` (making an adapter resident may compact the pool, moving the pages a running forward reads:
    silently wrong tokens) run between steps, under the step lock."""
    reqs = []
    assert _waits_for_the_step_lock(engine, lambda: reqs.append(engine.add_request(token_ids(5, 54, VOCAB), "a",
                                                                                     GREEDY)))
    assert _waits_for_the_step_lock(engine, lambda: engine.pin_adapter("b"))
    engine.pin_adapter("b", False)
    while engine.has_unfinished():
        engine.step()
    assert reqs[0].output_ids == _alone(engine, token_ids(5, 54, VOCAB), "a").token_ids
    _idle(engine)


def test_a_submit_racing_close_never_leaves_a_stream_open(engine):
    """A submit that waits for the step lock while the loop closes either is refused (closed) or registers first
    and is aborted by the close: its stream always ends (it used to be queued after close's snapshot, and nothing
    stepped it)."""
    for _ in range(3):
        lp = EngineLoop(engine)
        got: dict = {}

        def submit():
            try:
                got["stream"] = lp.submit(token_ids(6, 55, VOCAB), "a", SamplingParams(max_tokens=50, ignore_eos=True))
            except RuntimeError as e:
                got["refused"] = str(e)

        with engine.step_lock:  # both wait: whichever takes the lock first, the stream must end
            ts = [threading.Thread(target=submit), threading.Thread(target=lp.close)]
            ts[0].start()
            time.sleep(0.1)
            ts[1].start()
            time.sleep(0.1)
        for t in ts:
            t.join(30)
        if "stream" in got:
            out = {}
            t = threading.Thread(target=lambda: out.setdefault("o", got["stream"].result()), daemon=True)
            t.start()
            t.join(30)
            assert "o" in out, "a stream submitted while the loop closed never ended"
            assert out["o"].finish_reason == "abort"
        else:
            assert got["refused"] == "EngineLoop: closed"
    _idle(engine)


def test_a_dead_engine_is_a_dead_loop(engine, monkeypatch):
    """An engine that can no longer step (``Engine.dead``: a tensor-parallel worker died) makes its loop report not
    running, with the reason: the server then answers 503 ``engine_dead`` and /health fails, so an orchestrator
    restarts it instead of every request failing with a 500 forever. In an engine process the child leaves, its
    requests failed with the reason."""
    lp = EngineLoop(engine)
    try:
        assert lp.running and lp.error is None and engine.dead is None
        monkeypatch.setattr(engine, "tp", hooks._DeadGroup("worker 2 (pid 7) exited with code -9"))
        assert not lp.running and lp.error == engine.dead == "worker 2 (pid 7) exited with code -9"
        monkeypatch.undo()
        assert lp.running
    finally:
        lp.close()
    proc = EngineProcess.start(functools.partial(hooks.tiny_random_engine), timeout=120)
    try:
        s = proc.submit([5, 6, 7], "a", SamplingParams(max_tokens=10_000, ignore_eos=True))
        proc.apply(hooks.dies, "worker 2 (pid 7) exited with code -9")
        deadline = time.time() + 30
        while proc.running and time.time() < deadline:
            time.sleep(0.05)
        assert not proc.running and "stopped: worker 2 (pid 7) exited with code -9" in proc.error, proc.error
        out = s.result()
        assert out.finish_reason == "error" and "worker 2 (pid 7)" in out.error, out
    finally:
        proc.close()


def test_async_consumer_cancelled_aborts(engine, loop):
    _slow_steps(engine, loop)

    async def main():
        async def consume():
            async for _ in loop.submit(token_ids(6, 60, VOCAB), "b", SamplingParams(max_tokens=200, ignore_eos=True)):
                pass

        task = asyncio.create_task(consume())
        await asyncio.sleep(0.3)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    deadline = time.time() + 30
    while loop.num_streams and time.time() < deadline:
        time.sleep(0.01)
    _idle(engine, loop)


def test_concurrent_generate_calls_share_steps(engine):
    prompts = [token_ids(5, 70 + i, VOCAB) for i in range(4)]
    want = [_alone(engine, p, "b").token_ids for p in prompts]
    out, steps0 = [None] * 4, engine.stats()["steps"]
    threads = [threading.Thread(target=lambda i=i: out.__setitem__(i, _alone(engine, prompts[i], "b").token_ids))
               for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert out == want
    assert engine.stats()["steps"] - steps0 < 4 * 8  # fewer steps than four generate() calls one after another


def test_bounded_waiting_queue(engine):
    e = engine
    old = e.engine_config.max_waiting_requests
    e.engine_config.max_waiting_requests = 2
    try:
        reqs = [e.add_request(token_ids(4, 80 + i, VOCAB), None, GREEDY) for i in range(2)]
        with pytest.raises(EngineOverloadedError, match="2 requests are waiting"):
            e.add_request(token_ids(4, 90, VOCAB), None, GREEDY)
        with pytest.raises(EngineOverloadedError):
            e.generate([token_ids(4, 91, VOCAB)], sampling=GREEDY)
    finally:
        e.engine_config.max_waiting_requests = old
    for r in reqs:
        assert e.abort(r.request_id)
    _idle(e)


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA GPU (runs on the device machine)")
def test_an_engine_process_on_cuda_streams_what_the_engine_generates(engine, files):
    """The engine process started with 'spawn' builds its engine on CUDA (this process may hold CUDA too), and its
    greedy streams equal an in-process CUDA engine's ``generate`` (same files, same options)."""
    d, adapters = files  # the adapters: written by ``engine``
    options = dict(device="cuda", max_batch_size=8, progress=False)
    ref = Engine(model=str(d), **options)
    for name, path in adapters.items():
        ref.load_adapter(name, path)
    prompts = [(token_ids(5 + i, 200 + i, VOCAB), ("a", "b", "c", None)[i % 4]) for i in range(8)]
    sp = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    want = [ref.generate([p], adapters=[a], sampling=sp)[0].token_ids for p, a in prompts]
    proc = EngineProcess.start(functools.partial(load_engine, str(d), EngineConfig(**options),
                                                 {n: str(p) for n, p in adapters.items()}, warmup=True),
                               timeout=300)  # warmed up (serve's default): compiles and graph captures first
    try:
        assert proc.apply(hooks.device).startswith("cuda")
        streams = [proc.submit(p, a, sp) for p, a in prompts]
        assert [[t for delta in s for t in delta.token_ids] for s in streams] == want
    finally:
        proc.close()
    assert not proc._process.is_alive()


def test_load_engine_warms_up_on_the_first_adapter(engine, files, monkeypatch):
    """``load_engine(warmup=True)`` (``multilora serve --warmup``, the default) runs ``Engine.warmup`` once on a GPU
    engine, after the adapters are registered, on the first of them; without adapters on the base model only; off
    by default, and skipped on a CPU engine (nothing compiles there)."""
    d, adapters = files  # written by ``engine``
    calls = []
    monkeypatch.setattr(Engine, "warmup", lambda self, adapter=None: calls.append((adapter, self.list_adapters())))
    opts = EngineConfig(device="cpu", max_batch_size=4, progress=False)
    items = [(n, str(p)) for n, p in adapters.items()]
    init = Engine.__init__

    def as_if_on_a_gpu(self, *a, **k):  # warm-up is for GPU engines: this CPU engine reports cuda afterwards
        init(self, *a, **k)
        self.device = __import__("torch").device("cuda")

    monkeypatch.setattr(Engine, "__init__", as_if_on_a_gpu)
    load_engine(str(d), opts, items, warmup=True)
    load_engine(str(d), opts, [], warmup=True)
    load_engine(str(d), opts, items)
    assert calls == [(items[0][0], sorted(n for n, _ in items)), (None, [])]


def test_load_engine_skips_the_warmup_on_a_cpu(engine, files, monkeypatch):
    d, adapters = files  # written by ``engine``
    calls = []
    monkeypatch.setattr(Engine, "warmup", lambda self, adapter=None: calls.append(adapter))
    e = load_engine(str(d), EngineConfig(device="cpu", max_batch_size=4, progress=False), [], warmup=True)
    assert e.device.type == "cpu" and calls == []


def test_a_failed_warmup_does_not_keep_the_server_down(engine, files, monkeypatch, caplog):
    d, adapters = files  # written by ``engine``
    init = Engine.__init__

    def as_if_on_a_gpu(self, *a, **k):
        init(self, *a, **k)
        self.device = __import__("torch").device("cuda")

    def fail(self, adapter=None):
        raise RuntimeError("warmup: a warm-up request on the base model failed: boom")

    monkeypatch.setattr(Engine, "__init__", as_if_on_a_gpu)
    monkeypatch.setattr(Engine, "warmup", fail)
    with caplog.at_level("WARNING", logger="multilora"):
        e = load_engine(str(d), EngineConfig(device="cpu", max_batch_size=4, progress=False), [], warmup=True)
    assert e is not None and "warm-up failed (RuntimeError: warmup: a warm-up request" in caplog.text
    assert "serving anyway" in caplog.text


def test_result_is_kept_after_the_stream_is_consumed(engine, loop):
    ids = token_ids(5, 3, engine.config.vocab_size)
    s = loop.submit(ids, sampling=SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    first = s.result()
    assert first is not None and len(first.token_ids) == 4
    assert s.result() is first  # again: the same output, not an error
    s = loop.submit(ids, sampling=SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    deltas = list(s)
    assert s.result() is deltas[-1].output and s.result().token_ids == first.token_ids[:3]


def test_a_loop_never_closed_is_closed_at_exit():
    """A script that ends while a loop still steps a request: the loop is closed by its exit hook (its request
    aborted, the thread joined) before the interpreter finalises, where a daemon thread inside a torch op can abort
    the process. Checked from an exit hook registered before the loop's, so it runs after it (hooks run last in,
    first out)."""
    import os
    import subprocess
    import sys

    code = ("import atexit, engine_hooks\n"
            "from multilora import SamplingParams\n"
            "from multilora.runtime.engine_loop import EngineLoop\n"
            "e = engine_hooks.tiny_random_engine()\n"
            "engine_hooks.slow_steps(e, 0.05)\n"  # the request is still running when the script ends
            "atexit.register(lambda: print('unfinished at exit:', e.has_unfinished(), flush=True))\n"
            "loop = EngineLoop(e)\n"
            "s = loop.submit([5, 6, 7], sampling=SamplingParams(max_tokens=100000, ignore_eos=True))\n"
            "it = iter(s)\n"  # kept: a generator collected early would abort the request itself
            "next(it)\n")
    tests = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "unfinished at exit: False" in out.stdout, (out.stdout, out.stderr[-2000:])
