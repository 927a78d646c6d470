"""``multilora serve-ray``: N engine replicas under Ray Serve, each request routed to a replica that holds its adapter.

    spec = RayAppSpec(model=None, config=EngineConfig(), adapters={"bot": "./bot", "fr": "./fr"}, replicas=2)
    serve.run(build_app(spec), route_prefix="/")         # what `multilora serve-ray --replicas 2 ...` runs

Two deployments. The ingress (one replica, no CPU of its own) reads a request's ``model``; when it names a catalog
adapter, it calls the replicas with ``multiplexed_model_id=model``, so Ray Serve's model multiplexing sends it to a
replica that has that adapter (any replica when none has it yet). Each replica is one ``Engine`` with the app of
``multilora serve`` (``runtime.server.create_app``) in-process: the ingress forwards the HTTP request (method, path,
headers, body) and streams back what that app answers, so bodies, errors, streaming and the API key are exactly
``multilora serve``'s. A replica registers an adapter (``Engine.load_adapter``) in the loader that Ray Serve calls
on a request for an adapter it does not have (``serve.multiplexed``); past ``adapters_per_replica`` Ray unloads the
least recently used one (``Engine.unload_adapter``: its running requests finish with it). Under that, the engine's
own tiers (GPU pool, host copies, files) decide what is resident. Every answer from a replica names it in the
header ``x-multilora-replica`` and lists its registered adapters in ``x-multilora-adapters``.

Routes: those of ``multilora serve`` but ``/metrics`` and the runtime adapter routes (404 with the reason: a replica's
metrics are its own, and an adapter loaded at run time would reach one replica only). ``/v1/models`` lists the base
model and the whole catalog. Ray is imported only here, and only when an app is built or run.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator

from multilora.runtime.config import EngineConfig, check_adapter_name, check_api_key

__all__ = ["RayAppSpec", "build_app"]

log = logging.getLogger("multilora.ray_serve")

REPLICA_HEADER = "x-multilora-replica"
ADAPTERS_HEADER = "x-multilora-adapters"
GENERATE_PATHS = ("/v1/completions", "/v1/chat/completions")
NOT_SERVED = {
    "/metrics": "GET /metrics is not served by the Ray app: each replica's metrics are its own (scrape Ray Serve's "
                "metrics, or run one `multilora serve` per pod behind the Gateway API inference extension)",
    "/v1/load_lora_adapter": "runtime adapter loading is not supported by the Ray app: it would reach one replica "
                             "only; its adapters are the catalog given with --adapter NAME=PATH",
    "/v1/unload_lora_adapter": "runtime adapter unloading is not supported by the Ray app: its adapters are the "
                               "catalog given with --adapter NAME=PATH",
}


@dataclass(frozen=True)
class RayAppSpec:
    """What the Ray app runs (every replica the same).

    Attributes:
        model: as ``Engine(model)``: None (the embedded SmolLM2), a HF directory or a ``.gguf`` file; it must be
            readable at the same path on every node.
        config: the engine options of every replica.
        adapters: the catalog, adapter name -> PEFT adapter directory (readable on every node); a replica registers
            one when it is first routed a request for it.
        served_model_name: the base model's ``model`` name (default: ``model`` as given, else the file's stem).
        api_key: when given, every route but ``/health`` needs ``Authorization: Bearer <api_key>``.
        replicas: engine replicas (each a Ray actor with its own model copy).
        adapters_per_replica: adapters registered on one replica at once (Ray's ``max_num_models_per_replica``);
            the engine's tiers are under it.
        replica_cpus / replica_gpus: Ray resources of each replica (``ray_actor_options``).
        max_ongoing_requests: HTTP requests one replica takes at once (the engine queues what its batch cannot
            hold); the ingress takes ``replicas`` times this.
    """

    model: str | None = None
    config: EngineConfig = field(default_factory=EngineConfig)
    adapters: dict[str, str] = field(default_factory=dict)
    served_model_name: str | None = None
    api_key: str | None = None
    replicas: int = 1
    adapters_per_replica: int = 16
    replica_cpus: float = 1.0
    replica_gpus: float = 0.0
    max_ongoing_requests: int = 64

    def __post_init__(self) -> None:
        for name in ("replicas", "adapters_per_replica", "max_ongoing_requests"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"RayAppSpec.{name}: expected an int >= 1, got {v!r}")
        for name in ("replica_cpus", "replica_gpus"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v < 0:
                raise ValueError(f"RayAppSpec.{name}: expected a number >= 0, got {v!r}")
        check_api_key(self.api_key, "RayAppSpec.api_key")
        if not isinstance(self.config, EngineConfig):
            raise ValueError(f"RayAppSpec.config: expected an EngineConfig, got {type(self.config).__name__}")
        if self.base_name is not None:  # the replicas' create_app checks it too: here it fails before Ray starts
            check_adapter_name(self.base_name, "RayAppSpec.served_model_name" if self.served_model_name else
                               "RayAppSpec's served name (by default model as given: set served_model_name)")
        for name, path in self.adapters.items():
            check_adapter_name(name, "RayAppSpec.adapters: an adapter name")
            if name == self.base_name:
                raise ValueError(f"RayAppSpec.adapters: {name!r} is the base model's served name")
            if not (Path(path) / "adapter_config.json").is_file():
                raise ValueError(f"RayAppSpec.adapters: {name}={path}: no adapter_config.json there")

    @property
    def base_name(self) -> str | None:
        """The served name when it is known before the model loads (None: the model file's stem, on the replica)."""
        return self.served_model_name or self.model


def build_app(spec: RayAppSpec) -> Any:
    """The Ray Serve application of ``spec`` (a ``ray.serve.Application``: ``serve.run(build_app(spec))``).

    Raises:
        ImportError: Ray Serve is not installed (``pip install 'multilora[ray]'``).
    """
    try:
        from ray import serve
    except ImportError as e:
        raise ImportError(f"build_app needs Ray Serve, but {e.name} is not installed: pip install 'multilora[ray]'",
                          name=e.name) from e

    replica = serve.deployment(_Replica, name="MultiLoRAReplica").options(
        num_replicas=spec.replicas, max_ongoing_requests=spec.max_ongoing_requests,
        ray_actor_options={"num_cpus": spec.replica_cpus, "num_gpus": spec.replica_gpus})
    ingress = serve.deployment(_Ingress, name="MultiLoRAIngress").options(
        num_replicas=1, max_ongoing_requests=spec.replicas * spec.max_ongoing_requests,
        ray_actor_options={"num_cpus": 0})
    return ingress.bind(replica.bind(spec), spec)


class _Ingress:
    """Reads the ``model`` of a generation request and forwards the HTTP request to a replica that has it."""

    def __init__(self, replicas: Any, spec: RayAppSpec) -> None:
        self.replicas, self.catalog, self.api_key = replicas, frozenset(spec.adapters), spec.api_key

    async def __call__(self, request: Any) -> Any:
        from starlette.responses import JSONResponse, Response, StreamingResponse

        from multilora.runtime.protocol import APIError
        from multilora.runtime.server import api_key_error

        path = request.url.path
        if path in NOT_SERVED:
            return JSONResponse(APIError(404, NOT_SERVED[path], code="not_served").body(), status_code=404)
        body = await request.body()
        adapter = _requested_model(body) if request.method == "POST" and path in GENERATE_PATHS else None
        if self.api_key is not None and api_key_error(request.headers.get("authorization"), self.api_key):
            adapter = None  # not routed by adapter: no replica loads one for a request its app refuses (401)
        options: dict[str, Any] = {"stream": True}
        if adapter in self.catalog:  # anything else (the base model, an unknown name): any replica answers it
            options["multiplexed_model_id"] = adapter
        scope = {"method": request.method, "path": path, "query_string": request.url.query.encode(),
                 "headers": list(request.headers.raw), "client": tuple(request.client or ("127.0.0.1", 0))}
        replies = self.replicas.options(**options).forward.remote(scope, body)
        try:
            start = await replies.__anext__()
        except BaseException:
            replies.cancel()
            raise
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in start["headers"] if k != b"content-length"}
        if headers.get("content-type", "").startswith("text/event-stream"):
            return StreamingResponse(_relay(replies), status_code=start["status"], headers=headers)
        try:
            content = b"".join([chunk async for chunk in replies])
        finally:
            replies.cancel()  # a no-op when done; else (the client went away) the replica's app aborts its requests
        return Response(content, status_code=start["status"], headers=headers)


async def _relay(replies: Any) -> AsyncIterator[bytes]:
    """A replica's streamed body; a client that disconnects cancels it (the replica's app then aborts)."""
    try:
        async for chunk in replies:
            yield chunk
    finally:
        replies.cancel()


def _requested_model(body: bytes) -> str | None:
    """The ``model`` of a JSON request body, or None (malformed bodies are the replica's app's to refuse)."""
    try:
        obj = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    model = obj.get("model") if isinstance(obj, dict) else None
    return model if isinstance(model, str) and model else None


class _Replica:
    """One engine and the app of ``multilora serve`` on it; Ray Serve calls ``forward`` (see the module docstring)."""

    async def __init__(self, spec: RayAppSpec) -> None:
        from ray import serve

        from multilora.runtime.engine import Engine
        from multilora.runtime.server import create_app

        self.spec = spec
        self.engine = await asyncio.to_thread(Engine, spec.model, config=spec.config)
        self.app = create_app(self.engine, served_model_name=spec.base_name or self.engine.model_path.stem,
                              api_key=spec.api_key, listed_adapters=lambda: list(spec.adapters),
                              adapter_paths=lambda: spec.adapters)
        self.name = serve.get_replica_context().replica_id.unique_id
        self._lifespan = contextlib.AsyncExitStack()
        await self._lifespan.enter_async_context(self.app.router.lifespan_context(self.app))  # the EngineLoop

        async def register(name: str) -> _Registered:  # Ray Serve's loader: an adapter this replica lacks
            await asyncio.to_thread(self.engine.load_adapter, name, spec.adapters[name])
            return _Registered(self.engine, name)

        self._hold = serve.multiplexed(max_num_models_per_replica=spec.adapters_per_replica)(register)
        log.info("replica %s: %s ready", self.name, self.engine.model_path.name)

    async def forward(self, scope: dict, body: bytes) -> AsyncIterator[Any]:
        """The app's answer to one HTTP request: ``{"status", "headers"}``, then the body's chunks as they come."""
        from ray import serve

        from multilora.runtime.protocol import APIError

        adapter = serve.get_multiplexed_model_id()
        if adapter:
            try:
                await self._hold(adapter)
            except Exception as e:  # a catalog entry that fails to load: this request fails, the replica serves on
                log.exception("replica %s: adapter %r failed to load", self.name, adapter)
                err = APIError(500, f"adapter {adapter!r} could not be loaded: {e}", code="adapter_load_failed")
                yield {"status": 500, "headers": [(b"content-type", b"application/json"), *self._headers()]}
                yield json.dumps(err.body()).encode()
                return
        async for item in _exchange(self.app, scope, body):
            if isinstance(item, dict):
                item = {**item, "headers": [*item["headers"], *self._headers()]}
            yield item

    def _headers(self) -> list[tuple[bytes, bytes]]:
        return [(REPLICA_HEADER.encode(), self.name.encode()),
                (ADAPTERS_HEADER.encode(), ",".join(sorted(self.engine.list_adapters())).encode())]

    async def stats(self) -> dict:
        """This replica's name, registered adapters and ``Engine.stats()`` (through a handle: with
        ``.options(multiplexed_model_id=NAME)`` it is the stats of a replica that holds NAME)."""
        return {"replica": self.name, "adapters": sorted(self.engine.list_adapters()), **self.engine.stats()}

    async def check_health(self) -> None:
        """Ray Serve's health check: the engine loop's thread must be alive."""
        loop = self.app.state.server.loop
        if loop is None or not loop.running:
            raise RuntimeError("the engine loop is not running")

    async def __del__(self) -> None:  # Ray Serve calls (and awaits) it when the replica shuts down
        await self._lifespan.aclose()


class _Registered:
    """An adapter registered on a replica by Ray Serve's loader; Ray calls ``__del__`` when it evicts it."""

    def __init__(self, engine: Any, name: str) -> None:
        self.engine, self.name, self.registered = engine, name, True

    def __del__(self) -> None:  # Ray's eviction, then maybe the garbage collector: unload once
        if self.registered:
            self.registered = False
            with contextlib.suppress(KeyError):  # UnknownAdapterError: already gone
                self.engine.unload_adapter(self.name)


async def _exchange(app: Any, scope: dict, body: bytes) -> AsyncIterator[Any]:
    """Run one HTTP request through the ASGI ``app`` in this process: yield ``{"status", "headers"}``, then the body
    chunks. The request body is ``body``; when the caller stops iterating (the client went away), the app receives
    ``http.disconnect``, which makes ``multilora serve``'s app abort the request's engine requests."""
    messages: asyncio.Queue = asyncio.Queue()
    gone = asyncio.Event()
    body_sent = False

    async def receive() -> dict:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        messages.put_nowait(message)

    asgi_scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "scheme": "http",
                  "root_path": "", "raw_path": scope["path"].encode(), "server": ("127.0.0.1", 0), **scope}
    task = asyncio.ensure_future(app(asgi_scope, receive, send))
    task.add_done_callback(lambda _: messages.put_nowait(None))
    try:
        while True:
            message = await messages.get()
            if message is None:  # the app returned (or raised) without finishing its response
                task.result()
                raise RuntimeError("the app ended without a complete response")
            if message["type"] == "http.response.start":
                yield {"status": message["status"], "headers": list(message.get("headers", []))}
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield message["body"]
                if not message.get("more_body", False):
                    return
    finally:
        gone.set()  # a no-op for a finished app; else it sees the disconnect and cleans up by itself
