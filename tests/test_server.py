"""``multilora serve`` (issue 14, "the server"), live on localhost: uvicorn runs the app of ``create_app`` in a
background thread on a tiny random Llama with the SmolLM2 tokenizer, driven by the official ``openai`` client and by
raw HTTP (httpx); one test starts the real ``multilora serve`` command.

The reference is ``Engine.generate`` on the same engine (greedy, or seeded: batch-invariant): texts and, through
``usage``, token counts. Covered: completions and chat, streaming and not, adapter and base; 32 concurrent streams
on different adapters; a client that disconnects (streaming or not) frees its KV blocks and adapter reference; the
errors a client can cause (status and body), and the server keeps serving after each; runtime adapter loading inside
an adapter root; the metrics and their names."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

transformers = pytest.importorskip("transformers")
for _mod in ("fastapi", "uvicorn", "openai", "httpx", "prometheus_client"):
    pytest.importorskip(_mod)

import httpx  # noqa: E402
import openai  # noqa: E402
import uvicorn  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from multilora import Engine, SamplingParams  # noqa: E402
from multilora.runtime.cli import main as cli_main  # noqa: E402
from multilora.runtime.server import create_app  # noqa: E402
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


@pytest.fixture(scope="module")
def app(engine, adapter_root):
    return create_app(engine, served_model_name=BASE, api_key=KEY, adapter_root=adapter_root,
                      allow_runtime_adapters=True)


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


def _idle(engine):
    """Every request gone: no KV block held, no adapter referenced."""
    deadline = time.time() + 30
    while time.time() < deadline:
        s = engine.stats()
        if s["running"] == s["waiting"] == 0 and s["kv_blocks_free"] == s["kv_blocks_total"]:
            break
        time.sleep(0.02)
    s = engine.stats()
    assert s["running"] == s["waiting"] == 0 and s["kv_blocks_free"] == s["kv_blocks_total"]
    assert all(engine.cache.get(n).refcount == 0 for n in engine.list_adapters())


def _metrics(http):
    """{(name, labels as a frozenset of items): value} of GET /metrics, parsed by prometheus_client."""
    r = http.get("/metrics")
    assert r.status_code == 200
    return {(s.name, frozenset(s.labels.items())): s.value for fam in text_string_to_metric_families(r.text)
            for s in fam.samples}


def _one(metrics, name):
    (value,) = [v for (n, _), v in metrics.items() if n == name]
    return value


def _slow_steps(engine, monkeypatch, seconds):
    run = engine.runner.run

    def slow(kind, batch):
        time.sleep(seconds)
        return run(kind, batch)

    monkeypatch.setattr(engine.runner, "run", slow)


def _serves(http):
    r = http.post("/v1/completions", json={"model": BASE, "prompt": "Hi", "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1 or r.json()["choices"][0]["finish_reason"] == "stop"


# ------------------------------------------------------------------------------------------ the openai client
def test_models_list_the_base_and_every_adapter(client, engine):
    models = client.models.list().data
    assert [m.id for m in models] == [BASE, *sorted(engine.list_adapters())]
    assert models[0].parent is None and all(m.parent == BASE for m in models[1:])
    assert all(m.object == "model" and m.owned_by == "multilora" for m in models)


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


def test_32_concurrent_streams_on_different_adapters(url, engine, monkeypatch):
    """32 streaming clients at once (AsyncOpenAI), on 8 adapters and the base model, short and long: every text is
    its reference, they were batched (far fewer steps than tokens), and the short requests' first tokens came
    before any long request finished."""
    jobs = [(token_ids(4 + i % 5, 100 + i, VOCAB), (*ADAPTERS, BASE)[i % 9], 2 if i % 2 else 64) for i in range(32)]
    want = [_ref(engine, p, _adapter(m), max_tokens=n, temperature=0.0, ignore_eos=True).text for p, m, n in jobs]
    _slow_steps(engine, monkeypatch, 0.01)
    steps0 = engine.stats()["steps"]

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
    assert engine.stats()["steps"] - steps0 < sum(n for _, _, n in jobs) / 4  # batched, not one after another
    assert max(g[1] for g in got[1::2]) < min(g[2] for g in got[0::2])  # short ones' first tokens before any long end
    _idle(engine)


# ------------------------------------------------------------------------------------------ disconnects
def test_a_client_that_disconnects_mid_stream_frees_its_request(http, engine, monkeypatch):
    _slow_steps(engine, monkeypatch, 0.01)
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
        assert engine.cache.get("ad5").refcount == 1
    _idle(engine)  # closing the response mid-stream closed the connection
    m = _metrics(http)
    assert _one(m, "vllm:num_requests_running") == 0 and _one(m, "vllm:gpu_cache_usage_perc") == 0
    assert [dict(labels) for (n, labels) in m if n == "vllm:lora_requests_info"][0]["running_lora_adapters"] == ""
    assert m[("multilora_requests_total", frozenset({("adapter", "ad5"), ("finish_reason", "abort")}))] == aborted0 + 1
    _serves(http)


def test_a_client_that_gives_up_on_a_plain_request_frees_it(url, engine, monkeypatch):
    _slow_steps(engine, monkeypatch, 0.01)
    body = {"model": "ad6", "prompt": "Tell me a long story", "max_tokens": 200, "temperature": 0, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}/v1/completions", json=body, headers=AUTH, timeout=0.5)
    _idle(engine)


# ------------------------------------------------------------------------------------------ errors, raw HTTP
_LONG = token_ids(300, 3, VOCAB)  # more than max_seq_len = 256 (the tiny model's context)

ERRORS = [  # (route, body, status, param, code)
    ("completions", b'{"model": "tiny", "prompt": ', 400, None, "invalid_json"),
    ("completions", b"[1, 2]", 400, None, "invalid_type"),
    ("completions", {"model": BASE}, 400, "prompt", "invalid_type"),
    ("completions", {"model": "nope", "prompt": "Hi"}, 404, "model", "model_not_found"),
    ("completions", {"model": BASE, "prompt": _LONG}, 400, "prompt", "invalid_value"),
    ("chat/completions", {"model": BASE, "messages": [{"role": "user", "content": "x " * 400}]}, 400, "messages",
     "invalid_value"),
    ("completions", {"model": BASE, "prompt": "Hi", "temperature": -1}, 400, "temperature", "invalid_value"),
    ("completions", {"model": BASE, "prompt": "Hi", "top_p": 0}, 400, "top_p", "invalid_value"),
    ("completions", {"model": BASE, "prompt": "Hi", "max_tokens": 0}, 400, "max_tokens", "invalid_value"),
    ("completions", {"model": BASE, "prompt": "Hi", "top_k": -5}, 400, "top_k", "invalid_value"),
    ("completions", {"model": BASE, "prompt": "Hi", "stop": [""]}, 400, "stop", "invalid_value"),
    ("completions", {"model": BASE, "prompt": "Hi", "temperature": "hot"}, 400, "temperature", "invalid_type"),
    ("completions", {"model": BASE, "prompt": "Hi", "max_tokens": 1.5}, 400, "max_tokens", "invalid_type"),
    ("completions", {"model": BASE, "prompt": "Hi", "n": 2}, 400, "n", "unsupported_parameter"),
    ("completions", {"model": BASE, "prompt": "Hi", "best_of": 3}, 400, "best_of", "unsupported_parameter"),
    ("completions", {"model": BASE, "prompt": "Hi", "logprobs": 1}, 400, "logprobs", "unsupported_parameter"),
    ("completions", {"model": BASE, "prompt": "Hi", "echo": True}, 400, "echo", "unsupported_parameter"),
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
    ("chat/completions", {"model": BASE, "messages": CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]},
     400, "tools", "unsupported_parameter"),
    ("chat/completions", {"model": BASE, "messages": CHAT, "response_format": {"type": "json_object"}}, 400,
     "response_format", "unsupported_parameter"),
    ("chat/completions", {"model": BASE, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]}, 400, "messages[0].content",
     "unsupported_parameter"),
    ("chat/completions", {"model": BASE, "messages": [{"role": "user"}] * 0}, 400, "messages", "invalid_value"),
    ("chat/completions", {"model": BASE, "messages": [{"content": "hi"}]}, 400, "messages", "invalid_type"),
]


@pytest.mark.parametrize("route,body,status,param,code", ERRORS, ids=[f"{i}-{e[3] or e[4]}" for i, e in enumerate(ERRORS)])
def test_bad_requests_get_the_right_status_and_body_and_the_server_keeps_serving(http, route, body, status, param,
                                                                                  code):
    kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) else {"json": body}
    r = http.post(f"/v1/{route}", **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["type"] == {400: "invalid_request_error", 404: "not_found_error"}[status]
    assert (err["param"], err["code"]) == (param, code)
    if param and code == "unsupported_parameter":
        assert param.split("[")[0] in err["message"]
    _serves(http)


def test_off_values_of_unsupported_parameters_and_unknown_fields_are_accepted(http):
    r = http.post("/v1/completions", json={"model": BASE, "prompt": "Hi", "max_tokens": 2, "n": 1, "presence_penalty": 0,
                                           "logit_bias": {}, "echo": False, "user": "u", "some_new_field": 1})
    assert r.status_code == 200, r.text
    r = http.post("/v1/chat/completions", json={"model": BASE, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "Hi"}]}], "max_completion_tokens": 2, "tool_choice": "none",
        "response_format": {"type": "text"}})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 2


def test_api_key(url, http, client):
    for headers, code in (({}, "missing_api_key"), ({"Authorization": "Bearer wrong"}, "invalid_api_key"),
                          ({"Authorization": f"Basic {KEY}"}, "invalid_api_key")):
        for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions"), ("GET", "/metrics"),
                             ("POST", "/v1/load_lora_adapter")):
            r = httpx.request(method, f"{url}{path}", headers=headers, content=b"{not json")
            assert r.status_code == 401 and r.json()["error"]["code"] == code, (path, r.text)
            assert r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(f"{url}/health").status_code == 200  # no key needed
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).models.list()
    assert client.models.list().data


def test_overloaded_engine_is_429(http, client, engine):
    cfg = engine.engine_config
    old, cfg.max_waiting_requests = cfg.max_waiting_requests, 0  # every submission finds the queue full
    try:
        r = http.post("/v1/completions", json={"model": BASE, "prompt": "Hi"})
        assert r.status_code == 429 and r.json()["error"]["code"] == "engine_overloaded"
        assert "max_waiting_requests" in r.json()["error"]["message"]
        with pytest.raises(openai.RateLimitError):
            client.chat.completions.create(model=BASE, messages=CHAT)
    finally:
        cfg.max_waiting_requests = old
    _serves(http)
    _idle(engine)


def test_a_request_that_fails_in_the_engine(http, engine, monkeypatch):
    """A failed forward fails its requests: 500 with the engine's message, or mid-stream an error event, then
    ``[DONE]``; the next requests are served."""
    def boom(kind, batch):
        raise RuntimeError("boom in the forward")

    monkeypatch.setattr(engine.runner, "run", boom)
    r = http.post("/v1/completions", json={"model": "ad7", "prompt": "Hi"})
    assert r.status_code == 500 and "boom in the forward" in r.json()["error"]["message"]
    assert r.json()["error"]["code"] == "engine_error"
    r = http.post("/v1/chat/completions", json={"model": "ad7", "messages": CHAT, "stream": True})
    events = [line[len("data: "):] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and "boom in the forward" in json.loads(events[-2])["error"]["message"]
    monkeypatch.undo()
    _serves(http)
    _idle(engine)


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
def test_runtime_adapters_load_serve_and_unload(http, engine, adapter_root):
    path = write_adapter(adapter_root / "fresh", engine.config, seed=42, rank=6, modules=("o_proj", "up_proj"))
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "fresh", "lora_path": str(path)})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'fresh' added successfully."
    assert {"id": "fresh", "parent": BASE}.items() <= next(m for m in http.get("/v1/models").json()["data"]
                                                           if m["id"] == "fresh").items()
    want = _ref(engine, "Hello", "fresh", max_tokens=6, temperature=0.0)
    r = http.post("/v1/completions", json={"model": "fresh", "prompt": "Hello", "max_tokens": 6, "temperature": 0})
    assert r.json()["choices"][0]["text"] == want.text
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "fresh", "lora_path": "fresh"})  # relative to the root
    assert r.status_code == 400 and "already been loaded" in r.json()["error"]["message"]
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "fresh", "lora_path": "fresh", "load_inplace": True})
    assert r.status_code == 200
    r = http.post("/v1/unload_lora_adapter", json={"lora_name": "fresh"})
    assert r.status_code == 200 and "removed" in r.text
    assert http.post("/v1/completions", json={"model": "fresh", "prompt": "Hi"}).status_code == 404
    r = http.post("/v1/unload_lora_adapter", json={"lora_name": "fresh"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "lora_name"


def test_runtime_adapter_paths_must_stay_inside_the_adapter_root(http, engine, adapter_root, tmp_path):
    outside = write_adapter(tmp_path / "outside", engine.config, seed=1, rank=4, modules=("q_proj",))
    (adapter_root / "escape").symlink_to(outside, target_is_directory=True)  # a symlinked directory
    mixed = adapter_root / "mixed"  # a directory inside whose weights file links outside
    mixed.mkdir()
    shutil.copy(outside / "adapter_config.json", mixed)
    (mixed / "adapter_model.safetensors").symlink_to(outside / "adapter_model.safetensors")
    rel = os.path.relpath(outside, adapter_root)  # ../../.../outside
    for lora_path in (str(outside), rel, f"ad0/../{rel}", "escape", str(adapter_root / "escape"), "mixed"):
        r = http.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": lora_path})
        assert r.status_code == 403, (lora_path, r.text)
        assert r.json()["error"]["code"] == "path_outside_adapter_root" and r.json()["error"]["param"] == "lora_path"
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "missing"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_adapter"
    r = http.post("/v1/load_lora_adapter", json={"lora_name": BASE, "lora_path": "ad0"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_name"
    assert "x" not in engine.list_adapters()
    _serves(http)


def test_runtime_adapter_routes_are_refused_unless_allowed(engine):
    c = TestClient(create_app(engine, served_model_name=BASE))  # not started: these routes answer without the loop
    for route, body in (("load", {"lora_name": "x", "lora_path": "/tmp"}), ("unload", {"lora_name": "ad0"})):
        r = c.post(f"/v1/{route}_lora_adapter", json=body)
        assert r.status_code == 404 and "--allow-runtime-adapters" in r.json()["error"]["message"]
    assert "ad0" in engine.list_adapters()


def test_a_model_without_a_tokenizer_streams_a_chunk_per_token(tmp_path):
    """Random weights of a shape have no tokenizer (what bench/bench_serving.py serves): token-id prompts work, and a
    streamed response still has one (empty-text) chunk per token, so a client sees when each token came."""
    from multilora.config import ModelConfig
    from multilora.runtime.weights import MODEL_SHAPES

    e = Engine(ModelConfig(**MODEL_SHAPES["tiny"]), progress=False, max_batch_size=4)
    e.load_adapter("a", write_adapter(tmp_path / "a", e.config, seed=3, rank=4, modules=("q_proj", "v_proj")))
    ref = e.generate([[5, 6, 7]], adapters=["a"], sampling=SamplingParams(max_tokens=5, ignore_eos=True))[0]
    with serving(create_app(e, served_model_name="rand")) as u, httpx.Client(base_url=u, timeout=60) as c:
        body = {"model": "a", "prompt": [5, 6, 7], "max_tokens": 5, "temperature": 0, "ignore_eos": True}
        plain = c.post("/v1/completions", json=body).json()
        assert plain["usage"]["completion_tokens"] == len(ref.token_ids) == 5 and plain["choices"][0]["text"] == ""
        with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    chunks = [ev for ev in events if ev["choices"] and ev["choices"][0]["finish_reason"] is None]
    assert 1 <= len(chunks) <= 5 and all(ch["choices"][0]["text"] == "" for ch in chunks)
    assert events[-1]["choices"][0]["finish_reason"] == "length"


# ------------------------------------------------------------------------------------------ metrics
def test_metrics_parse_and_hold_the_gateway_api_names(http, engine):
    _serves(http)
    m = _metrics(http)
    names = {n for n, _ in m}
    for name in ("vllm:lora_requests_info", "vllm:num_requests_waiting", "vllm:num_requests_running",
                 "vllm:gpu_cache_usage_perc", "multilora_requests_total", "multilora_time_to_first_token_seconds_count",
                 "multilora_time_per_output_token_seconds_count", "multilora_e2e_request_latency_seconds_count",
                 "multilora_kv_blocks", "multilora_adapters", "multilora_adapter_bytes_moved_total",
                 "multilora_prompt_tokens_total", "multilora_generation_tokens_total"):
        assert name in names, name
    s = engine.stats()
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


# ------------------------------------------------------------------------------------------ the command
def test_the_multilora_serve_command(model_dir, adapter_root, engine, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "multilora.runtime.cli", "serve", "--model", str(model_dir), "--port", str(port),
           "--served-model-name", BASE, "--adapter", f"ad0={adapter_root / 'ad0'}", "--max-batch-size", "4",
           "--api-key", KEY]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    log = tmp_path / "serve.log"
    with open(log, "w") as err:
        proc = subprocess.Popen(cmd, stdout=err, stderr=subprocess.STDOUT, env=env, cwd=tmp_path)
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
        finally:
            proc.send_signal(signal.SIGINT)
            code = proc.wait(30)
    out = log.read_text()
    assert code == 0, out
    assert re.search(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ INFO multilora\.server: serving 'tiny'", out, re.M), out
    assert "Registering adapters" in out and "Loading" in out  # progress: adapters, model files


@pytest.mark.parametrize("args,message", [
    (["--adapter", "x=/no/such/dir"], "--adapter x=/no/such/dir: no such file or directory"),
    (["--adapter-root", "/no/such/dir"], "--adapter-root /no/such/dir: not a directory"),
    (["--served-model-name", "ad0", "--adapter", "ad0=."], "the base model's served name"),
    (["--max-waiting-requests", "0"], "--max-waiting-requests"),
])
def test_serve_command_errors_exit_2_before_the_model_loads(capsys, args, message):
    assert cli_main(["serve", "--model", "/no/such/model", *args]) == 2
    assert message in capsys.readouterr().err
