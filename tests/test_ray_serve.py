"""The Ray Serve app (issue 14, "replicas by adapter"), live on a local Ray cluster (2 CPUs): 2 replicas of the default
model (the embedded SmolLM2-135M GGUF, as the issue asks), a catalog of 5 adapters, driven by raw HTTP (httpx) through
Ray Serve's proxy. About 80 s on 2 cores: starting the replicas (a worker process, imports and a model load each) is
~30 s of it, the reference engine ~12 s, Ray's start and stop ~12 s.

References, all independent of the app: ``Engine.generate`` (greedy) on an engine in this process with the same
adapters, for every text and token count; ``multilora serve``'s own app (``create_app`` on that engine, through
``TestClient``) for every error body. Routing is checked with the headers every replica answer carries (which replica,
which adapters it has registered) and with each replica's ``stats()`` reached through a Ray handle."""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

for _mod in ("ray", "ray.serve", "httpx", "fastapi"):
    pytest.importorskip(_mod)

import httpx  # noqa: E402
import ray  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402
from ray import serve  # noqa: E402

from multilora import Engine, EngineConfig, SamplingParams  # noqa: E402
from multilora.runtime.cli import main as cli_main  # noqa: E402
from multilora.runtime.ray_serve import ADAPTERS_HEADER, REPLICA_HEADER, RayAppSpec, build_app  # noqa: E402
from multilora.runtime.server import create_app  # noqa: E402
from testsupport import one_thread, write_adapter  # noqa: E402,F401

KEY = "sk-ray"
AUTH = {"Authorization": f"Bearer {KEY}"}
APP = "multilora-test"
ROUTED = ("a0", "a1", "a2", "a3")  # requested with the API key
SPARE = "spare"  # in the catalog, only ever requested without the API key
PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Name a colour."}]
GREEDY = dict(max_tokens=5, temperature=0.0)


@pytest.fixture(scope="module")
def ref():
    return Engine(progress=False)  # the default model, as every replica runs it


@pytest.fixture(scope="module")
def catalog(ref, tmp_path_factory):
    root = tmp_path_factory.mktemp("ray-adapters")
    out = {}
    for i, name in enumerate((*ROUTED, SPARE)):
        out[name] = str(write_adapter(root / name, ref.config, seed=10 + i, rank=4, modules=("q_proj", "v_proj")))
        ref.load_adapter(name, out[name])
    return out


@pytest.fixture(scope="module")
def url(catalog):
    """The app on a local Ray cluster of 2 CPUs (one per replica; the ingress takes none); Serve and Ray are shut
    down after the module, which ends every process Ray started."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    assert not ray.is_initialized()
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)  # our own cluster
    try:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        sock.close()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        spec = RayAppSpec(config=EngineConfig(progress=False), adapters=catalog, api_key=KEY, replicas=2)
        serve.run(build_app(spec), name=APP, route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def http(url):
    with httpx.Client(base_url=url, headers=AUTH, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def serve_app(ref):
    """``multilora serve``'s app on the reference engine: the error bodies the Ray app must give too."""
    with TestClient(create_app(ref, served_model_name=ref.model_path.stem, api_key=KEY)) as c:
        yield c


_refs: dict[str, object] = {}


def _ref(ref, prompt, adapter):
    """``Engine.generate``'s greedy output (computed once per prompt and adapter)."""
    key = json.dumps([prompt, adapter])
    if key not in _refs:
        _refs[key] = ref.generate([prompt], adapters=[adapter], sampling=SamplingParams(**GREEDY))[0]
    return _refs[key]


def _replica_stats(adapter):
    """``stats()`` of the replica that holds ``adapter``. Ray routes the handle call by the multiplexed id, but only
    as a preference: while that replica is busy (a long stream) the call may go to the other one, so ask until the
    answer comes from a replica that lists the adapter (each adapter is registered on one replica)."""
    handle = serve.get_deployment_handle("MultiLoRAReplica", app_name=APP)
    for _ in range(60):
        s = handle.options(multiplexed_model_id=adapter).stats.remote().result(timeout_s=30)
        if adapter in s["adapters"]:
            return s
    raise AssertionError(f"no replica listed {adapter!r} in 60 answers (last: {s['replica']}: {s['adapters']})")


def test_requests_land_on_the_replica_that_holds_their_adapter(http, ref):
    seen: dict[str, set[str]] = {name: set() for name in ROUTED}
    held: dict[str, set[str]] = {}  # replica -> adapters it reported
    for _ in range(2):
        for name in ROUTED:
            r = http.post("/v1/completions", json={"model": name, "prompt": PROMPT, **GREEDY})
            assert r.status_code == 200, r.text
            want = _ref(ref, PROMPT, name)
            body = r.json()
            assert body["choices"][0]["text"] == want.text
            assert body["usage"]["completion_tokens"] == len(want.token_ids)
            replica, adapters = r.headers[REPLICA_HEADER], set(r.headers[ADAPTERS_HEADER].split(","))
            assert name in adapters, (name, replica, adapters)
            seen[name].add(replica)
            held[replica] = adapters
    assert all(len(replicas) == 1 for replicas in seen.values()), seen  # every request for X: X's one replica
    assert len(held) == 2, held  # new adapters go to the replica with fewer: both replicas serve
    assert not set.intersection(*held.values()), held  # each adapter registered once, not on every replica
    for name, (replica,) in seen.items():
        s = _replica_stats(name)
        assert s["replica"] == replica and name in s["adapters"]


def test_streamed_chat_equals_generate_and_stays_on_its_replica(http, ref):
    replica = http.post("/v1/completions", json={"model": "a1", "prompt": PROMPT, **GREEDY}).headers[REPLICA_HEADER]
    body = {"model": "a1", "messages": CHAT, "stream": True, "stream_options": {"include_usage": True}, **GREEDY}
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        assert r.headers[REPLICA_HEADER] == replica
        events = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    want = _ref(ref, CHAT, "a1")
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]) == want.text
    assert chunks[-1]["usage"]["completion_tokens"] == len(want.token_ids)
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == want.finish_reason


def test_base_model_models_and_health(url, http, ref, catalog):
    base = ref.model_path.stem
    cards = http.get("/v1/models").json()["data"]
    assert [m["id"] for m in cards] == [base, *ROUTED, SPARE]
    # every adapter's root is its catalog directory, whether this replica has loaded it yet or not
    assert {m["id"]: Path(m["root"]).resolve() for m in cards[1:]} == {n: Path(p).resolve() for n, p in catalog.items()}
    r = http.post("/v1/completions", json={"model": base, "prompt": PROMPT, **GREEDY})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == _ref(ref, PROMPT, None).text
    assert httpx.get(f"{url}/health").status_code == 200  # no key needed


@pytest.mark.parametrize("case", ["unknown model", "no key", "malformed JSON", "unsupported n"])
def test_errors_are_those_of_multilora_serve(url, serve_app, case):
    body, headers = {"model": "nope", "prompt": PROMPT}, AUTH
    if case == "no key":
        body, headers = {"model": SPARE, "prompt": PROMPT}, {}
    elif case == "unsupported n":
        body = {"model": "a0", "prompt": PROMPT, "n": 2}
    content = b'{"model": "a0", "prompt": ' if case == "malformed JSON" else json.dumps(body).encode()
    headers = {**headers, "Content-Type": "application/json"}
    got = httpx.post(f"{url}/v1/completions", content=content, headers=headers, timeout=60)
    want = serve_app.post("/v1/completions", content=content, headers=headers)
    assert want.status_code in (400, 401, 404)
    assert (got.status_code, got.json()) == (want.status_code, want.json())
    if case == "no key":  # refused before routing: no replica registered the adapter for it
        assert SPARE not in got.headers[ADAPTERS_HEADER].split(",")


def test_routes_the_ray_app_does_not_serve_say_why(http):
    for path in ("/metrics", "/v1/load_lora_adapter"):
        r = http.get(path) if path == "/metrics" else http.post(path, json={"lora_name": "x", "lora_path": "y"})
        assert r.status_code == 404 and "Ray app" in r.json()["error"]["message"]


def test_concurrent_requests_on_every_adapter_are_each_correct_and_routed(url, ref):
    jobs = [(name, f"{PROMPT} {i}") for name in ROUTED for i in range(2)]  # 8 at once, 2 per adapter
    refs = ref.generate([p for _, p in jobs], adapters=[a for a, _ in jobs], sampling=SamplingParams(**GREEDY))

    def post(job):
        body = {"model": job[0], "prompt": job[1], **GREEDY}
        return httpx.post(f"{url}/v1/completions", json=body, headers=AUTH, timeout=120)

    with ThreadPoolExecutor(len(jobs)) as pool:
        replies = list(pool.map(post, jobs))
    by_adapter: dict[str, set[str]] = {}
    for (name, prompt), r, want in zip(jobs, replies, refs):  # a mixed batch's rows equal each row alone
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == want.text, (name, prompt)
        by_adapter.setdefault(name, set()).add(r.headers[REPLICA_HEADER])
    assert all(len(replicas) == 1 for replicas in by_adapter.values()), by_adapter


def _idle(adapter):
    """Wait until the replica that holds ``adapter`` runs nothing and holds no KV block."""
    deadline = time.time() + 20  # the 400 tokens asked for would take far longer than this
    while time.time() < deadline:
        s = _replica_stats(adapter)
        if s["running"] == s["waiting"] == 0 and s["kv_blocks_free"] == s["kv_blocks_total"]:
            break
        time.sleep(0.1)
    assert s["running"] == s["waiting"] == 0 and s["kv_blocks_free"] == s["kv_blocks_total"], s


LONG = {"prompt": PROMPT, "max_tokens": 400, "temperature": 0.0, "ignore_eos": True}


def test_a_client_that_disconnects_mid_stream_frees_its_request(http):
    with http.stream("POST", "/v1/completions", json={"model": "a2", "stream": True, **LONG}) as r:
        lines = r.iter_lines()  # held: a dropped iterator is closed by the garbage collector, and httpx then
        assert next(line for line in lines if line.startswith("data: "))  # closes the response (a disconnect)
        s = _replica_stats("a2")
        assert s["replica"] == r.headers[REPLICA_HEADER] and s["running"] == 1, json.dumps(s)
    _idle("a2")


def test_a_client_that_gives_up_on_a_plain_request_frees_it(url):
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}/v1/completions", json={"model": "a3", **LONG}, headers=AUTH, timeout=2)
    _idle("a3")


@pytest.mark.parametrize("args, message", [
    (["--replicas", "0"], "argument --replicas: expected an integer >= 1, got 0"),
    (["--max-ongoing-requests", "0"], "argument --max-ongoing-requests: expected an integer >= 1, got 0"),
    (["--allow-runtime-adapters"], "--allow-runtime-adapters: not supported by serve-ray"),
    (["--adapter", "x=/nonexistent"], "--adapter: x=/nonexistent: no adapter_config.json there"),
    (["--max-batch-size", "0"], "--max-batch-size"),
    (["--tensor-parallel-size", "2"], "--tensor-parallel-size 2: not supported by serve-ray"),
])
def test_serve_ray_command_errors_exit_2_before_ray_starts(capsys, args, message):
    try:
        code = cli_main(["serve-ray", *args])
    except SystemExit as e:  # the parser's own checks (argparse exits with 2)
        code = e.code
    assert code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("args, want", [
    (["--replicas", "3"], {"local_ranks": 3, "gpu_memory_fraction": 0.9}),
    (["--replicas", "2", "--replica-gpus", "0.5"], {"local_ranks": 2, "gpu_memory_fraction": 0.45}),
    (["--replicas", "2", "--local-ranks", "4"], {"local_ranks": 4, "gpu_memory_fraction": 0.9}),
    (["--replicas", "2", "--address", "auto"], {"local_ranks": 1, "gpu_memory_fraction": 0.9}),  # other hosts too
    (["--replicas", "1", "--replica-gpus", "0.5"], {"local_ranks": 1, "gpu_memory_fraction": 0.9}),
])
def test_replicas_of_one_host_share_its_memory_plan(monkeypatch, args, want):
    """On its own local cluster every replica is on this host: each engine budgets its share, not the whole host
    (``local_ranks``) nor a whole GPU it has a fraction of (``gpu_memory_fraction``)."""
    import multilora.runtime.ray_serve as ray_serve

    seen = {}

    def spec(**kw):
        seen.update(kw)
        raise ValueError("RayAppSpec.replicas: stop here")  # before Ray starts

    monkeypatch.setattr(ray_serve, "RayAppSpec", spec)
    assert cli_main(["serve-ray", *args]) == 2
    cfg = seen["config"]
    assert {"local_ranks": cfg.local_ranks, "gpu_memory_fraction": cfg.gpu_memory_fraction} == pytest.approx(want)


def test_without_ray_the_command_says_what_to_install(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError, as when it is not installed
    assert cli_main(["serve-ray"]) == 2
    assert "ray is not installed (pip install 'multilora[ray]')" in capsys.readouterr().err
    with pytest.raises(ImportError, match=r"pip install 'multilora\[ray\]'"):
        build_app(RayAppSpec())
