"""``multilora serve``: an OpenAI-compatible HTTP server on the streaming engine (``runtime.engine_loop``).

    app = create_app(engine, served_model_name="smol", api_key="sk-...", allow_runtime_adapters=True)
    uvicorn.run(app, host="127.0.0.1", port=8000)        # what `multilora serve` runs

Routes (bodies as OpenAI's and vLLM's; the README's "Serve" section has examples): ``GET /health`` (and ``HEAD``),
``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions`` (``model`` = an adapter name or the base
model's served name; ``stream`` gives server-sent events ending in ``data: [DONE]``), ``POST /v1/load_lora_adapter``
and ``POST /v1/unload_lora_adapter`` (only with ``allow_runtime_adapters``; paths must resolve inside
``adapter_root`` when it is given), ``GET /metrics`` (``runtime.metrics``). Request bodies and their errors:
``runtime.protocol``.

One ``EngineLoop`` serves every request (started with the app, closed at its shutdown); or, when ``create_app`` is
given an ``EngineProcess`` (``multilora serve --engine-process``, ``runtime.engine_process``), the engine steps in
a child process and this process keeps HTTP, tokenization, detokenization and the metrics; the routes are the same. A request's engine requests
are aborted as soon as nobody waits for them: a client that disconnects (streaming or not), an error mid-stream;
their KV blocks and adapter references go back at once. Errors are ``{"error": {"message", "type", "param",
"code"}}``: 400 bad request (malformed JSON, a wrong type, an unsupported parameter, a bad prompt or sampling value:
the engine's message; a list of more prompts than the waiting queue holds), 401 missing or wrong API key (every route but ``/health``), 403 an adapter path outside the
adapter root, 404 unknown model or adapter (and runtime adapter routes when disabled), 429 the engine's waiting
queue is full (``EngineOverloadedError``; with ``Retry-After: 1``), 500 a request that failed in the engine, 503
shutting down or the engine stopped (an engine process that died: ``code="engine_dead"``, also on ``/health``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import time
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Iterable, Mapping

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException

from multilora.runtime.adapter_cache import UnknownAdapterError
from multilora.runtime.adapters.disk import PICKLE_NAME, SAFETENSORS_NAME, weights_path
from multilora.runtime.config import check_adapter_name, check_api_key
from multilora.runtime.engine import EngineOverloadedError
from multilora.runtime.engine_loop import EngineLoop, RequestDelta, RequestStream
from multilora.runtime.engine_process import EngineDeadError, EngineProcess
from multilora.runtime.metrics import ServerMetrics
from multilora.runtime.postprocess import RequestOutput
from multilora.runtime.protocol import (
    CHAT_UNSUPPORTED,
    COMPLETION_UNSUPPORTED,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    LoadLoRARequest,
    Responses,
    UnloadLoRARequest,
    bad_value,
    chat_prompt,
    check_supported,
    completion_prompts,
    renamed,
    sampling_params,
    usage,
    validation_error,
)
from multilora.runtime.sampling import SamplingParams

__all__ = ["api_key_error", "create_app"]

log = logging.getLogger("multilora.server")

COMPLETION_MAX_TOKENS = 16  # OpenAI's and vLLM's default for /v1/completions
#: the ``Retry-After`` header (seconds, RFC 9110 section 10.2.3) of a 429 "engine overloaded": the waiting queue is
#: full, and a step or two later (milliseconds to a second on a GPU) running requests have finished and made room
RETRY_AFTER_S = 1
_pumps: set[asyncio.Task] = set()  # the tasks reading engine streams (the event loop keeps only weak references)


def create_app(engine: Any, *, served_model_name: str, api_key: str | None = None,
               adapter_root: str | Path | None = None, allow_runtime_adapters: bool = False,
               listed_adapters: Callable[[], Iterable[str]] | None = None,
               adapter_paths: Callable[[], Mapping[str, str]] | None = None) -> FastAPI:
    """The ASGI app of ``multilora serve`` for ``engine`` (run it with uvicorn; see the module docstring).

    Args:
        engine: a ``multilora.Engine`` (stepped by an ``EngineLoop`` thread of this process) or an ``EngineProcess``
            (its engine steps in a child process); its loaded adapters are served under their names.
        served_model_name: the ``model`` name of the base model (no adapter).
        api_key: when given, every route but ``/health`` needs ``Authorization: Bearer <api_key>``; a non-empty
            string without whitespace at its ends (``config.check_api_key``; an empty key is refused, not taken as
            none).
        adapter_root: runtime-loaded adapter paths must resolve (``..`` and symlinks followed) inside this directory;
            a relative ``lora_path`` is taken relative to it.
        allow_runtime_adapters: enable ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``.
        listed_adapters: the adapter names ``/v1/models`` lists (default: the engine's loaded adapters). The Ray app
            (``runtime.ray_serve``) lists its whole catalog: a replica loads a catalog adapter when it is routed one.
        adapter_paths: adapter name -> directory, the ``root`` of an adapter's ``/v1/models`` card when the engine
            has not loaded it (default: none; a loaded adapter's root is ``engine.adapter_path(name)``).

    Raises:
        ValueError: ``api_key`` is empty, not a string, or has whitespace at an end (``check_api_key``);
            ``served_model_name`` is not a name an adapter could have (``check_adapter_name``: empty, a
            comma, whitespace at an end, a control character), or an adapter (loaded, or listed by
            ``listed_adapters``) has the base model's served name: requests
            naming it could reach only one of the two (``/v1/load_lora_adapter`` refuses such a name too).
    """
    check_api_key(api_key)
    check_adapter_name(served_model_name, "served_model_name")  # requests carry it in "model", as adapters' names
    if served_model_name in set((listed_adapters or engine.list_adapters)()):
        raise ValueError(f"served_model_name: {served_model_name!r} is also the name of an adapter; requests naming it "
                         f"would reach the base model only: give the adapter another name (--adapter NAME=PATH) or "
                         f"the base model another one (--served-model-name)")
    server = _Server(engine, served_model_name, adapter_root, allow_runtime_adapters,
                     listed_adapters or engine.list_adapters, adapter_paths or dict)
    app = FastAPI(title="multilora", lifespan=server.lifespan)
    app.state.server = server
    app.api_route("/health", methods=["GET", "HEAD"])(server.health)  # HEAD: probes that ask for no body
    app.get("/metrics")(server.metrics_text)
    app.get("/v1/models")(server.models)
    app.get("/v1/models/{model:path}")(server.model)
    app.post("/v1/completions")(server.completions)
    app.post("/v1/chat/completions")(server.chat_completions)
    app.post("/v1/load_lora_adapter")(server.load_lora_adapter)
    app.post("/v1/unload_lora_adapter")(server.unload_lora_adapter)
    _add_error_handlers(app)
    if api_key is not None:
        app.add_middleware(_APIKey, api_key=api_key)
    return app


class _Server:
    """The routes' state: the engine, its loop (while the app runs) and the metrics."""

    def __init__(self, engine: Any, served_model_name: str, adapter_root: str | Path | None,
                 allow_runtime_adapters: bool, listed_adapters: Callable[[], Iterable[str]],
                 adapter_paths: Callable[[], Mapping[str, str]]) -> None:
        self.engine, self.served_model_name, self.listed_adapters = engine, served_model_name, listed_adapters
        self.adapter_paths = adapter_paths
        self.adapter_root = Path(adapter_root).resolve() if adapter_root is not None else None
        self.allow_runtime_adapters = allow_runtime_adapters
        self._adapters_busy: set[str] = set()  # names a runtime load / unload is changing (the event loop's only)
        self.metrics = ServerMetrics(engine, served_model_name,
                                     running=lambda: self.loop is None or self.loop.running)
        self.loop: EngineLoop | EngineProcess | None = None
        self.closing = False
        self.created = int(time.time())
        self.loaded_at: dict[str, int] = {}  # a runtime-loaded adapter's card's "created": when it was (re)loaded

    @contextlib.asynccontextmanager
    async def lifespan(self, app: FastAPI) -> AsyncIterator[None]:
        # an EngineProcess steps its engine in its own process: it is its own loop
        self.loop = self.engine if isinstance(self.engine, EngineProcess) else EngineLoop(self.engine)
        log.info("serving %r (base model) and %d adapters", self.served_model_name, len(self.engine.list_adapters()))
        try:
            yield
        finally:
            self.closing = True
            await run_in_threadpool(self.loop.close)  # aborts what still runs
            log.info("engine loop closed")

    def _running_loop(self) -> EngineLoop | EngineProcess:
        if self.closing or self.loop is None:
            raise APIError(503, "the server is shutting down" if self.closing else "the server is not started",
                           code="unavailable")
        if not self.loop.running:  # the engine process died (or the loop's thread): say so until restarted
            raise APIError(503, f"the engine is not running: {getattr(self.loop, 'error', None) or 'its loop stopped'}"
                                f"; restart the server", code="engine_dead")
        return self.loop

    # ---------------------------------------------------------------------------------------- info
    async def health(self) -> Response:
        self._running_loop()
        return Response(status_code=200)

    async def metrics_text(self) -> Response:
        # off the event loop: with an engine process, Engine.stats() is a round trip to it
        return Response(await run_in_threadpool(self.metrics.render), media_type=CONTENT_TYPE_LATEST)

    def _card(self, name: str) -> dict:
        """``name``'s model card (the base model's, or an adapter's with the base as ``parent`` and ``root`` the
        directory it was, or from a catalog will be, loaded from)."""
        if name == self.served_model_name:
            root, parent = str(self.engine.model_path), None
        else:
            try:
                root = str(self.engine.adapter_path(name))
            except KeyError:  # not loaded here (a catalog adapter this replica has not been routed yet)
                root = self.adapter_paths().get(name)
            parent = self.served_model_name
        return {"id": name, "object": "model", "created": self.loaded_at.get(name, self.created),
                "owned_by": "multilora", "root": root, "parent": parent, "max_model_len": self.engine.max_seq_len}

    async def models(self) -> dict:
        return {"object": "list", "data": [self._card(n) for n in (self.served_model_name, *self.listed_adapters())]}

    async def model(self, model: str) -> dict:
        """``GET /v1/models/{model}`` (OpenAI's retrieve): one card of ``models``, or a 404 naming the model."""
        if model != self.served_model_name and model not in set(self.listed_adapters()):
            raise self._not_found(model)
        return self._card(model)

    # ---------------------------------------------------------------------------------- generation
    async def completions(self, body: CompletionRequest, request: Request) -> Any:
        check_supported(body, COMPLETION_UNSUPPORTED)
        prompts = completion_prompts(body.prompt)
        sampling = sampling_params(body, COMPLETION_MAX_TOKENS if body.max_tokens is None else body.max_tokens,
                                   asked=body.max_tokens is not None)  # (a default: capped at the context and the KV)
        return await self._generate(request, body.model, prompts, sampling, body.stream,
                                    Responses(chat=False, model=body.model, stream_options=body.stream_options),
                                    {"prompt": "prompt"})

    async def chat_completions(self, body: ChatCompletionRequest, request: Request) -> Any:
        check_supported(body, CHAT_UNSUPPORTED)
        prompt = chat_prompt(body.messages)
        asked = body.max_tokens if body.max_completion_tokens is None else body.max_completion_tokens
        params = {"prompt": "messages", **({"max_tokens": "max_completion_tokens"}
                                           if body.max_completion_tokens is not None else {})}
        sampling = sampling_params(body, self.engine.max_seq_len if asked is None else asked,  # None: to the end
                                   asked=asked is not None, params=params)
        return await self._generate(request, body.model, [prompt], sampling, body.stream,
                                    Responses(chat=True, model=body.model, stream_options=body.stream_options), params)

    async def _generate(self, request: Request, model: str, prompts: list, sampling: SamplingParams, stream: bool,
                        out: Responses, params: dict[str, str]) -> Any:
        loop = self._running_loop()
        adapter = self._adapter(model)
        streams = await run_in_threadpool(self._submit, loop, prompts, adapter, sampling, params)
        reqs = _Requests(streams, model, self.metrics)
        if stream:
            return _EventStream(self._events(reqs, out), reqs.close, media_type="text/event-stream")
        outputs = await _collect(request, reqs)
        if outputs is None:  # the client went away; its requests were aborted
            return Response(status_code=499)
        for o in outputs:
            if o.finish_reason in ("error", "abort"):
                raise _failure(o)
        return out.response(outputs)

    def _adapter(self, model: str) -> str | None:
        if model == self.served_model_name:
            return None
        if model in self.engine.list_adapters():
            return model
        raise self._not_found(model)

    def _not_found(self, model: str) -> APIError:
        return APIError(404, f"The model `{model}` does not exist: serving {self.served_model_name!r} and the adapters "
                             f"listed by GET /v1/models", code="model_not_found", param="model")

    def _submit(self, loop: EngineLoop | EngineProcess, prompts: list, adapter: str | None, sampling: SamplingParams,
                params: dict[str, str]) -> list[RequestStream]:
        """Queue one engine request per prompt (in a worker thread: submitting waits for the current step); on any
        refusal the ones already queued are withdrawn and the refusal becomes an ``APIError`` (its ``param`` the
        request's name for the engine's field: ``params``, e.g. ``prompt`` -> ``messages``)."""
        try:  # (all at once: each prompt of a list submitted alone waited for a step of its own)
            return loop.submit_many(prompts, adapter, sampling)
        except Exception as e:  # (submit_many withdrew the prompts of the call already queued)
            if isinstance(e, EngineDeadError):
                raise APIError(503, f"the engine is not running: {e}; restart the server", code="engine_dead") from None
            if isinstance(e, EngineOverloadedError):
                raise APIError(429, str(e), code="engine_overloaded",
                               headers={"Retry-After": str(RETRY_AFTER_S)}) from None
            if isinstance(e, UnknownAdapterError):  # unloaded since _adapter looked
                raise APIError(404, str(e.args[0]), code="model_not_found", param="model") from None
            if isinstance(e, ValueError):
                err = renamed(bad_value(e), params)
                i = getattr(e, "prompt_index", None)  # (None: the whole list, e.g. longer than the queue)
                if len(prompts) > 1 and i is not None and err.param in ("prompt", "max_tokens"):  # which prompt of
                    # the list; other fields are the whole request's
                    if err.message.startswith("prompt:"):
                        err.message = f"prompt[{i}]" + err.message[len("prompt"):]
                        err.param = f"prompt[{i}]"  # (as a type error's param names the item)
                    else:
                        err.message += f" (prompt[{i}])"
                raise err from None
            if self.closing:  # the loop closed meanwhile ("EngineLoop: closed")
                raise APIError(503, "the server is shutting down", code="unavailable") from None
            raise

    async def _events(self, reqs: "_Requests", out: Responses) -> AsyncIterator[str]:
        """The server-sent events of a streamed response: text chunks as they come, one chunk with each choice's
        finish reason, the usage chunk when asked, ``[DONE]``; a failed request ends the stream with an error event."""
        prompt_tokens = completion_tokens = 0
        try:
            if out.chat:
                yield _sse(out.chunk(0, "", role=True))
            async with contextlib.aclosing(reqs.deltas()) as deltas:
                async for i, d in deltas:
                    # a model without a tokenizer (random weights of a shape) has no text: a chunk per delta of
                    # ids still tells the client a token came (its text is "")
                    if d.text or (d.token_ids and self.engine.tokenizer is None):
                        yield out.text_event(i, d.text)
                    if d.finished:
                        if d.finish_reason in ("error", "abort"):
                            yield _sse(_failure(d.output).body())
                            break
                        prompt_tokens += len(d.output.prompt_token_ids)
                        completion_tokens += len(d.output.token_ids)
                        yield _sse(out.chunk(i, None, d.finish_reason))
                else:
                    if out.include_usage:
                        yield _sse(out.usage_chunk(usage(prompt_tokens, completion_tokens)))
        except Exception as e:  # a bug: tell the client rather than cut the stream
            log.exception("streaming a response failed")
            yield _sse(APIError(500, f"internal error: {type(e).__name__}: {e}").body())
        finally:
            reqs.close()
        yield "data: [DONE]\n\n"

    # ------------------------------------------------------------------------------------ adapters
    async def load_lora_adapter(self, body: LoadLoRARequest) -> PlainTextResponse:
        try:
            return await self._load_lora_adapter(body)
        except APIError as e:  # the operator's side of a refused load: the client alone saw why
            log.warning("load_lora_adapter %r from %r refused (%d): %s", body.lora_name, body.lora_path, e.status,
                        e.message)
            raise

    async def _load_lora_adapter(self, body: LoadLoRARequest) -> PlainTextResponse:
        self._check_runtime_adapters()
        self._running_loop()  # a dead engine (503 engine_dead) takes no adapters, as it takes no requests
        name = body.lora_name
        try:
            check_adapter_name(name, "lora_name:")
        except ValueError as e:
            raise APIError(400, str(e), code="invalid_value", param="lora_name") from None
        if name == self.served_model_name:
            raise APIError(400, f"lora_name: that is the base model's served name: choose another, got {name!r}",
                           code="invalid_value", param="lora_name")
        path = self._adapter_path(body.lora_path)
        if os.path.isdir(path) and (weights_path(path) or Path()).name == PICKLE_NAME:  # (isdir: never raises)
            raise APIError(400, f"lora_path: {path / PICKLE_NAME}: only a pickle weight file (no {SAFETENSORS_NAME}); "
                                f"adapters loaded at run time must be safetensors (a pickle can run code when loaded; "
                                f"--allow-pickle covers the --adapter directories given at start only)",
                           code="invalid_adapter", param="lora_path")
        with self._adapter_busy(name):  # the check and the load as one: a concurrent load of the name is a 409
            replaced = name in self.engine.list_adapters()
            if replaced and not body.load_inplace:
                raise APIError(400, f"The lora adapter '{name}' has already been loaded (load_inplace=true replaces "
                                    f"it).", code="invalid_value", param="lora_name")
            try:
                await run_in_threadpool(self.engine.load_adapter, name, path)
            except (ValueError, OSError) as e:  # AdapterError is a ValueError
                raise APIError(400, f"lora_path: {e}", code="invalid_adapter", param="lora_path") from None
            self.loaded_at[name] = int(time.time())
            log.info("%s adapter %r from %s", "replaced" if replaced else "added", name, path)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' {'replaced' if replaced else 'added'} successfully.")

    async def unload_lora_adapter(self, body: UnloadLoRARequest) -> PlainTextResponse:
        self._check_runtime_adapters()
        self._running_loop()
        with self._adapter_busy(body.lora_name):
            try:
                await run_in_threadpool(self.engine.unload_adapter, body.lora_name)
            except UnknownAdapterError:
                raise APIError(404, f"The lora adapter '{body.lora_name}' cannot be found.", code="model_not_found",
                               param="lora_name") from None
            self.loaded_at.pop(body.lora_name, None)
        log.info("unloaded adapter %r", body.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    @contextlib.contextmanager
    def _adapter_busy(self, name: str):
        """Mark ``name`` as being changed by this request for the ``with`` block: another load or unload of it
        meanwhile is refused with 409 (check-then-load as one step; without it two loads of one name both answered
        "added" and the later one's weights won). Runs on the event loop only: the check and the mark are atomic."""
        if name in self._adapters_busy:
            raise APIError(409, f"The lora adapter '{name}' is being loaded or unloaded by another request: retry "
                                f"when it is done.", code="adapter_busy", param="lora_name")
        self._adapters_busy.add(name)
        try:
            yield
        finally:
            self._adapters_busy.discard(name)

    def _check_runtime_adapters(self) -> None:
        if not self.allow_runtime_adapters:
            raise APIError(404, "runtime adapter loading is disabled: start `multilora serve` with "
                                "--allow-runtime-adapters", code="runtime_adapters_disabled")

    def _adapter_path(self, lora_path: str) -> Path:
        """The adapter directory to load; with an adapter root, it and every file in it must resolve inside it
        (403 otherwise: no ``..`` traversal, no symlink out)."""
        if not lora_path or "\x00" in lora_path:
            raise APIError(400, f"lora_path: expected the path of an adapter directory, got {lora_path!r}",
                           code="invalid_value", param="lora_path")
        root = self.adapter_root
        if root is None:
            return Path(lora_path)
        path = (root / lora_path).resolve()  # an absolute lora_path stays itself
        if path == root:
            raise APIError(400, f"lora_path {lora_path!r} is the adapter root itself; name an adapter directory in it",
                           code="invalid_value", param="lora_path")
        try:
            entries = [path, *(path.iterdir() if path.is_dir() else ())]
            outside = next((p for p in entries if not p.resolve().is_relative_to(root)), None)
        except OSError as e:
            raise APIError(400, f"lora_path {lora_path!r}: {e.strerror}", code="invalid_value",
                           param="lora_path") from None
        if outside is not None:
            what = "it" if outside == path else f"its entry {outside.name!r}"
            raise APIError(403, f"lora_path {lora_path!r}: {what} resolves outside the server's adapter root "
                                f"('..' and symlinks are followed)", code="path_outside_adapter_root",
                           param="lora_path")
        return path


class _Requests:
    """The engine requests of one HTTP request, counted in the metrics when each ends. ``deltas()`` merges their
    deltas as they come; ``close()`` aborts those not ended (a disconnect, an error, a shutdown)."""

    def __init__(self, streams: list[RequestStream], model: str, metrics: ServerMetrics) -> None:
        self.streams, self.model, self.metrics = streams, model, metrics
        self.left = set(range(len(streams)))

    async def deltas(self) -> AsyncIterator[tuple[int, RequestDelta]]:
        """(index of the stream, delta), in arrival order, until every stream has ended."""
        try:
            async with contextlib.aclosing(self._arrivals()) as arrivals:
                async for i, d in arrivals:
                    if d.finished:
                        self.left.discard(i)
                        self.metrics.observe(self.model, d.finish_reason, d.output)
                    yield i, d
                    if not self.left:
                        return
        finally:
            self.close()

    async def _arrivals(self) -> AsyncIterator[tuple[int, RequestDelta]]:
        """Every stream's deltas as they come: one stream is read directly (the common case: no pump task and queue
        between it and the response); several are pumped into one queue."""
        if len(self.streams) == 1:
            async for d in self.streams[0]:
                yield 0, d
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, stream: RequestStream) -> None:  # ends with the stream's last delta
            async for d in stream:
                queue.put_nowait((i, d))

        for i, s in enumerate(self.streams):  # each ends with its stream (an aborted one: at the engine's next step)
            task = asyncio.ensure_future(pump(i, s))
            _pumps.add(task)
            task.add_done_callback(_pumps.discard)
        while True:
            yield await queue.get()

    def close(self) -> None:
        """Abort the requests that have not ended; their KV blocks and adapter references go back. The aborts run on
        a worker thread (``Engine.abort`` waits for the current step), so this never blocks the event loop."""
        for i in sorted(self.left):
            asyncio.get_running_loop().run_in_executor(None, self.streams[i].abort)
            self.metrics.observe(self.model, "abort")
        self.left.clear()


async def _collect(request: Request, reqs: _Requests) -> list[RequestOutput] | None:
    """Every request's ``RequestOutput``, or None when the client disconnected first (the requests are then aborted)."""
    outputs: list[Any] = [None] * len(reqs.streams)

    async def consume() -> None:
        async with contextlib.aclosing(reqs.deltas()) as deltas:
            async for i, d in deltas:
                if d.finished:
                    outputs[i] = d.output

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    done, gone = asyncio.ensure_future(consume()), asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({done, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        done.cancel()
        reqs.close()
    if not done.done() or done.cancelled():
        return None
    done.result()
    return outputs


def _failure(out: RequestOutput) -> APIError:
    """The error of a request that ended with "error" (500) or "abort" (503: the server is shutting down)."""
    if out.finish_reason == "abort":
        return APIError(503, "the request was aborted: the server is shutting down", code="aborted")
    # (in the server's log too: an operator sees only the access line's 500 otherwise; the rest keep being served)
    log.warning("request %s failed in the engine (adapter %r): %s", out.request_id, out.adapter, out.error)
    return APIError(500, f"the request failed in the engine: {out.error}", code="engine_error")


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class _EventStream(StreamingResponse):
    """A streamed response whose requests are aborted when it ends however it ends (a disconnect cancels the send;
    the generator is then closed at once, not when it is garbage-collected)."""

    def __init__(self, content: AsyncIterator[str], on_close: Any, **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self._on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()
            self._on_close()


class _APIKey:
    """ASGI middleware: every HTTP route but ``/health`` needs ``Authorization: Bearer <key>`` (401 otherwise),
    checked before the body is read."""

    def __init__(self, app: Any, api_key: str) -> None:
        self.app, self.key = app, api_key

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] != "/health":
            err = api_key_error(Headers(scope=scope).get("authorization"), self.key)
            if err is not None:
                response = JSONResponse(err.body(), status_code=401, headers={"WWW-Authenticate": "Bearer"})
                return await response(scope, receive, send)
        await self.app(scope, receive, send)


def api_key_error(authorization: str | None, api_key: str) -> APIError | None:
    """The 401 for an ``Authorization`` header value that is not ``Bearer <api_key>`` (None: it is)."""
    scheme, _, token = (authorization or "").partition(" ")
    if not authorization:
        return APIError(401, "missing API key: send the header 'Authorization: Bearer <key>'", code="missing_api_key")
    if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), api_key.encode()):
        return APIError(401, "invalid API key", code="invalid_api_key")
    return None


def _add_error_handlers(app: FastAPI) -> None:
    def reply(e: APIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError) -> JSONResponse:
        return reply(e)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, e: RequestValidationError) -> JSONResponse:
        return reply(validation_error(e.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        if e.status_code == 400 and str(e.detail) == "There was an error parsing the body":  # FastAPI's words for a
            cause = e.__cause__  # body json.loads refused other than with a JSONDecodeError (its cause: why)
            why = ("not UTF-8 text (RFC 8259: JSON is UTF-8)" if isinstance(cause, UnicodeDecodeError) else
                   f"it could not be parsed ({type(cause).__name__})" if cause is not None else "it could not be parsed")
            return reply(APIError(400, f"malformed JSON body: {why}", code="invalid_json"))
        return reply(APIError(e.status_code, str(e.detail)))

    @app.exception_handler(Exception)
    async def internal(request: Request, e: Exception) -> JSONResponse:
        log.exception("%s %s failed", request.method, request.url.path)
        return reply(APIError(500, f"internal error: {type(e).__name__}: {e}"))
