"""A background loop that steps an engine while it has work, and streams every request's output as it comes.

    loop = EngineLoop(engine)                            # a daemon thread; loop.close() stops it
    stream = loop.submit("Hi", adapter="bot", sampling=SamplingParams(max_tokens=32))
    for delta in stream:                                 # any thread: new token ids and text, step by step
        print(delta.text, end="")
    out = loop.submit(prompt).result()                   # or wait for the whole RequestOutput
    async for delta in loop.submit(prompt): ...          # from an asyncio event loop, without blocking it

Requests from any number of threads and event loops are batched together by the engine's scheduler (the loop
steps once for all of them). A stream's consumer that stops early (breaks out, is cancelled, disconnects)
aborts its request: its KV blocks and adapter reference go back at once (``Engine.abort``). Submission errors
(bad prompt, unknown adapter, ``EngineOverloadedError``) are raised by ``submit`` in the caller's thread; a
request that fails later ends its stream with ``finish_reason="error"`` and the message.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import threading
import weakref
from collections import deque
from dataclasses import dataclass
from typing import Any, AsyncIterator, Iterator, Sequence

from multilora.runtime.postprocess import RequestOutput
from multilora.runtime.sampling import SamplingParams
from multilora.runtime.scheduler import Request, Status
from multilora.runtime.tokenizer import Prompt, TextStream

log = logging.getLogger("multilora")


@dataclass
class RequestDelta:
    """What one request produced since its previous delta.

    Attributes:
        request_id: the request's id (``RequestOutput.request_id``).
        token_ids: the ids generated since the previous delta (an end-of-sequence token is never included).
        text: the text since the previous delta; never a split character, never the start of a stop string
            (``runtime.tokenizer.TextStream``); all deltas' texts joined = the final ``RequestOutput.text``.
        finish_reason: None while the request runs; on its last delta "stop", "length", "abort" or "error".
        error: the error message of a failed request (last delta only).
        output: the whole ``RequestOutput`` (last delta only).
    """

    request_id: int
    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    error: str | None = None
    output: RequestOutput | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class RequestStream:
    """The deltas of one request, in order: iterate it (``for``, or ``async for`` inside an event loop), or call
    ``result()``. Leaving an iteration before the last delta aborts the request."""

    def __init__(self, loop: "EngineLoop", request_id: int) -> None:
        self.request_id = request_id
        self._loop = loop
        self._cond = threading.Condition()
        self._deltas: deque[RequestDelta] = deque()
        self._done = False  # the last delta has been taken by the consumer
        self._output: RequestOutput | None = None  # the last delta's, kept for result() once the stream is consumed
        self._async: tuple[asyncio.AbstractEventLoop, asyncio.Event] | None = None

    def _deliver(self, delta: RequestDelta) -> "tuple[asyncio.AbstractEventLoop, asyncio.Event] | None":
        """Queue a delta (the loop's thread); returns the asyncio waiter to wake, if an ``async for`` waits: the
        caller wakes all of one step's waiters with one ``call_soon_threadsafe`` per event loop (``_wake_all``)."""
        with self._cond:
            self._deltas.append(delta)
            self._cond.notify_all()
            return self._async

    def _take(self, delta: RequestDelta) -> RequestDelta:
        self._done = delta.finished
        if delta.finished:
            self._output = delta.output
        return delta

    def __iter__(self) -> Iterator[RequestDelta]:
        try:
            while not self._done:
                with self._cond:
                    while not self._deltas:
                        self._cond.wait()
                    delta = self._deltas.popleft()
                yield self._take(delta)
        finally:
            if not self._done:
                self.abort()

    async def __aiter__(self) -> AsyncIterator[RequestDelta]:
        event = asyncio.Event()
        with self._cond:
            self._async = (asyncio.get_running_loop(), event)
        try:
            while not self._done:
                with self._cond:  # a consumer that fell behind gets its backlog as one delta (fewer wake-ups)
                    delta = _merge(self._deltas) if self._deltas else None
                    self._deltas.clear()
                    if delta is None:
                        event.clear()  # under the lock: a delivery after this sets it again
                if delta is None:
                    await event.wait()
                    continue
                yield self._take(delta)
        finally:
            with self._cond:
                self._async = None
            if not self._done:
                self.abort()

    def result(self) -> RequestOutput:
        """Wait for the request to finish; its ``RequestOutput`` (again on later calls, and after the stream was
        iterated to its end)."""
        for _ in self:
            pass
        return self._output

    def abort(self) -> bool:
        """Withdraw the request now (``Engine.abort``); the stream then ends with ``finish_reason="abort"``."""
        return self._loop.abort(self.request_id)


def _close_at_exit(ref: "weakref.ref[EngineLoop]") -> None:
    loop = ref()
    if loop is not None:
        loop.close()


def _merge(deltas: "deque[RequestDelta]") -> RequestDelta:
    """Consecutive deltas of one request as one: their ids and texts joined, the last one's ending."""
    if len(deltas) == 1:
        return deltas[0]
    last = deltas[-1]
    return RequestDelta(last.request_id, [t for d in deltas for t in d.token_ids], "".join(d.text for d in deltas),
                        last.finish_reason, last.error, last.output)


def _wake_all(waiters: "list[tuple[asyncio.AbstractEventLoop, asyncio.Event]]") -> None:
    """Set the events of one publish, with one ``call_soon_threadsafe`` per event loop (not one per stream)."""
    by_loop: dict[asyncio.AbstractEventLoop, list[asyncio.Event]] = {}
    for loop, event in waiters:
        by_loop.setdefault(loop, []).append(event)
    for loop, events in by_loop.items():
        try:
            loop.call_soon_threadsafe(lambda events=events: [e.set() for e in events])
        except RuntimeError:  # the consumer's event loop has closed: nobody is waiting any more
            pass


@dataclass
class _Tracked:
    stream: RequestStream
    req: Request
    text: TextStream
    sent: int = 0  # token ids given out


class EngineLoop:
    """Steps ``engine`` on a background thread while it has unfinished requests and streams their outputs.

    Args:
        engine: a ``multilora.Engine``; other threads may keep using it (``generate`` batches with the loop).
        poll_seconds: how long the thread sleeps when idle before it looks again (a submission wakes it at once);
            a finite number > 0.

    Raises:
        ValueError: ``engine`` lacks what the loop calls (not an ``Engine``), or a bad ``poll_seconds``.

    A step that raises fails the streamed requests (their streams end with the error) and the loop goes on; when
    steps keep failing, it waits longer between tries (up to ``MAX_RETRY_SECONDS``) and logs the traceback at the
    1st, 2nd, 4th, 8th... failure in a row only.
    """

    #: The longest wait between tries when steps keep failing (seconds).
    MAX_RETRY_SECONDS = 5.0

    def __init__(self, engine: Any, *, poll_seconds: float = 0.05) -> None:
        missing = [a for a in ("has_unfinished", "step", "add_request", "abort", "fail", "step_lock", "postprocess")
                   if not hasattr(engine, a)]
        if missing:
            raise ValueError(f"engine: expected a multilora.Engine, got {type(engine).__name__} (it has no "
                             f"{', '.join(missing)})")
        if (isinstance(poll_seconds, bool) or not isinstance(poll_seconds, (int, float))
                or not 0 < poll_seconds < float("inf")):
            raise ValueError(f"poll_seconds: expected a finite number > 0, got {type(poll_seconds).__name__} "
                             f"{poll_seconds!r}")
        self.engine = engine
        self.poll_seconds = poll_seconds
        self._tracked: dict[int, _Tracked] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="multilora-engine-loop", daemon=True)
        self._thread.start()
        # A loop never closed would still be stepping when the interpreter exits: a daemon thread in the middle of a
        # torch op at finalisation aborts the process (SIGABRT, "terminate called without an active exception").
        # Closed at exit instead (a weak reference: the hook does not keep the loop alive).
        atexit.register(_close_at_exit, weakref.ref(self))

    def submit(self, prompt: Prompt, adapter: str | None = None, sampling: SamplingParams | None = None) -> RequestStream:
        """Queue a request (``Engine.add_request``'s arguments and errors) and return its stream.

        Raises:
            RuntimeError: the loop is closed. Otherwise as ``Engine.add_request``.
        """
        if self._closed:
            raise RuntimeError("EngineLoop: closed")
        with self.engine.step_lock:  # no step can run the request before its stream is registered
            if self._closed:  # (closed while this waited for the lock: nothing would ever step the request)
                raise RuntimeError("EngineLoop: closed")
            req = self.engine.add_request(prompt, adapter, sampling)
            stream = RequestStream(self, req.request_id)
            with self._lock:
                self._tracked[req.request_id] = _Tracked(stream, req, TextStream(self.engine.text, req.params.stop))
        self._wake.set()
        return stream

    def submit_many(self, prompts: Sequence[Prompt], adapter: str | None = None,
                    sampling: SamplingParams | None = None) -> list[RequestStream]:
        """``submit`` for each prompt, all under one hold of the step lock, so that they join the same step (one
        ``submit`` a prompt waits for the step in flight each time: a list of 16 prompts took 16 steps to queue).

        Raises:
            ValueError: more prompts than ``max_waiting_requests`` (``Engine.check_submission``; no ``prompt_index``).
            as ``submit``, for the first prompt refused, with ``prompt_index`` (its index in ``prompts``) set on the
            exception; the prompts before it are withdrawn first (nothing of the call runs).
        """
        streams: list[RequestStream] = []
        with self.engine.step_lock:
            if self._closed:  # (a closed loop says so first: 503, not a 400 for the list's length)
                raise RuntimeError("EngineLoop: closed")
            self.engine.check_submission(len(prompts))  # (a list the queue can never take: no prompt_index)
            try:
                for p in prompts:
                    streams.append(self.submit(p, adapter, sampling))
            except Exception as e:
                for stream in streams:
                    stream.abort()
                e.prompt_index = len(streams)
                raise
        return streams

    def abort(self, request_id: Any) -> bool:
        """Withdraw a request (``Engine.abort``: its id, or its ``Request`` or stream); its stream ends with
        ``finish_reason="abort"``. Raises TypeError for anything else (``requests.as_request_id``)."""
        found = self.engine.abort(request_id)
        self._wake.set()
        return found

    @property
    def num_streams(self) -> int:
        """Requests whose streams have not delivered their last delta yet."""
        with self._lock:
            return len(self._tracked)

    @property
    def running(self) -> bool:
        """The loop's thread is alive and its engine can run steps (False once closed, if the thread died, or if the
        engine is dead: ``Engine.dead``, a tensor-parallel worker gone)."""
        return self._thread.is_alive() and self.engine.dead is None

    @property
    def error(self) -> str | None:
        """Why the engine cannot run (``Engine.dead``), or None."""
        return self.engine.dead

    def close(self) -> None:
        """Abort what is still running and stop the thread (also at interpreter exit, for a loop never closed)."""
        if self._closed and not self._thread.is_alive():
            return
        with self.engine.step_lock:  # (a submit holding the lock registers first, and its request is aborted below;
            self._closed = True  # one waiting for it sees the flag and refuses)
            with self._lock:
                ids = list(self._tracked)
        for rid in ids:
            self.engine.abort(rid)
        self._wake.set()
        self._thread.join()
        self._publish()

    def _run(self) -> None:
        failures = 0  # in a row
        while not self._closed:
            try:
                if self.engine.has_unfinished():
                    self.engine.step()
                else:
                    self._wake.wait(self.poll_seconds)
                    self._wake.clear()
                self._publish()
                failures = 0
            except Exception:  # a bug: never leave streams waiting forever, keep serving new requests
                failures += 1
                if failures & (failures - 1) == 0:  # 1st, 2nd, 4th, ...: a failure that recurs must not flood the log
                    log.exception("engine loop: a step failed (%d in a row); failing its streamed requests", failures)
                with self._lock:
                    ids = list(self._tracked)
                for rid in ids:
                    try:
                        self.engine.fail(rid, "the engine loop failed (see the log)")
                    except Exception:  # noqa: BLE001 - logged with the step's failure; the others still fail
                        log.debug("engine loop: failing request %r failed", rid, exc_info=True)
                if failures > 1:  # back off: a step that fails every time must not spin a core
                    self._wake.wait(min(self.MAX_RETRY_SECONDS, self.poll_seconds * 2 ** min(failures - 1, 20)))
                    self._wake.clear()

    def _publish(self) -> None:
        """Deliver each tracked request's new ids and text; the last delta of the finished ones."""
        with self._lock:
            items = list(self._tracked.values())
        waiters = []
        for t in items:
            req = t.req
            waiter = None
            if req.status is Status.FINISHED:
                out = self.engine.postprocess.output(req)
                waiter = t.stream._deliver(RequestDelta(req.request_id, list(req.output_ids[t.sent :]),
                                                        t.text.close(out.text), out.finish_reason, out.error, out))
                with self._lock:
                    self._tracked.pop(req.request_id, None)
            elif len(req.output_ids) > t.sent:
                ids = list(req.output_ids)
                waiter = t.stream._deliver(RequestDelta(req.request_id, ids[t.sent :], t.text.push(ids)))
                t.sent = len(ids)
            if waiter is not None:
                waiters.append(waiter)
        if waiters:
            _wake_all(waiters)
