"""The engine and its step loop in a child process; the server's process keeps HTTP, tokenization and detokenization.

    proc = EngineProcess.start(functools.partial(load_engine, "path/to/model", config, {"bot": "./bot"}))
    app = create_app(proc, served_model_name="smol")     # the server uses it as it uses an Engine + EngineLoop
    stream = proc.submit("Hi", adapter="bot", sampling=SamplingParams(max_tokens=32))
    for delta in stream: ...                             # the same RequestStream / RequestDelta as runtime.engine_loop
    proc.close()                                         # the child exits (it also exits when this process dies)

Why: in one process the engine's step thread and uvicorn's event loop share the GIL, so every stream's per-token work
(JSON, SSE chunks, detokenization) delays the launch of the next step. Here the child (the "engine core", after vLLM
V1's split, by idea) only schedules and steps; the parent (the "front end") does everything per request and per token.

The boundary (one ``multiprocessing`` pipe, pickled tuples):

- in: ``submit`` carries the prompt's token ids (tokenized and chat-templated here), the adapter name and the
  ``SamplingParams``; the child checks it (``Engine.add_request``) and replies with its request id or the error
  (``EngineOverloadedError``, ``UnknownAdapterError``, ``ValueError``), raised again in the caller's thread.
  ``abort`` is one message, no reply. Control calls (``load_adapter``, ``unload_adapter``, ``stats``, ``apply``) run
  on a worker thread of the child (a slow adapter read never holds up submissions) and reply with a value or error.
- out: ONE message per engine step for all requests: ``[(request id, new token ids), ...]`` and, for the requests
  that finished, their finish reason, error, final text and times. Text is made here (``TextStream``): the child
  never detokenizes per token (stop strings are matched in the engine, on text, as in-process). A ``RequestOutput``'s
  times are the engine process's ``time.perf_counter()`` (one system-wide monotonic clock on Linux and macOS).

Lifecycle: the child is started with the ``spawn`` method (CUDA cannot be forked) and ignores SIGINT and SIGTERM
(a Ctrl-C, a ``kill -- -PGID`` or a service manager's stop reaches the whole process group; the parent lets open
streams finish, then shuts the child down in order). It exits on ``close()``, and by itself when the pipe reaches
end-of-file: the parent exited, was killed, or crashed; ``close`` kills (SIGKILL) a child that did not exit in time. If the child dies, ``running`` turns False, every
unfinished stream ends with ``finish_reason="error"`` and a message naming the exit code or signal, and new
submissions raise ``EngineDeadError``. The child also leaves by itself when its engine can no longer step
(``Engine.dead``: a tensor-parallel worker died), telling the parent why first, so that the parent reports that reason.
An error while the child builds its engine (a bad model path, a memory plan
that does not fit, a bad adapter) is raised again by ``EngineProcess.start`` with the child's message.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import multiprocessing as mp
import os
import pickle
import signal
import sys
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from multilora.runtime.adapter_cache import UnknownAdapterError, loaded_names
from multilora.runtime.engine import EngineOverloadedError
from multilora.runtime.engine_loop import RequestDelta, RequestStream, _wake_all
from multilora.runtime.postprocess import RequestOutput
from multilora.runtime.requests import as_request_id, check_room, check_submission
from multilora.runtime.sampling import SamplingParams
from multilora.runtime.scheduler import Status
from multilora.runtime.tokenizer import Prompt, PromptTokenizer, TextStream
from multilora.runtime.weights import ModelLoadError

__all__ = ["EngineDeadError", "EngineProcess", "EngineProcessError"]

log = logging.getLogger("multilora")


class EngineProcessError(RuntimeError):
    """The engine process could not start, for a reason other than a bad argument (it crashed, or raised an
    unexpected error while building its engine)."""


class EngineDeadError(RuntimeError):
    """The engine process has exited: nothing can be submitted any more."""


# ------------------------------------------------------------------------------------------------ errors on the pipe
def _wire_error(e: BaseException) -> tuple[str, str]:
    """An exception as (kind, message) for the pipe: kinds the parent raises again with the same type."""
    if isinstance(e, EngineOverloadedError):
        return "overloaded", str(e)
    if isinstance(e, UnknownAdapterError):
        return "unknown_adapter", str(e.args[0]) if e.args else str(e)
    if isinstance(e, ModelLoadError):
        return "model_load", str(e)
    if isinstance(e, ValueError):
        return "value", str(e)
    if isinstance(e, OSError):
        return "os", str(e)
    return "other", f"{type(e).__name__}: {e}"


def _raise(kind: str, message: str) -> None:
    types: dict[str, type[Exception]] = {"overloaded": EngineOverloadedError, "unknown_adapter": UnknownAdapterError,
                                         "model_load": ModelLoadError, "value": ValueError, "os": OSError,
                                         "dead": EngineDeadError}
    raise types.get(kind, RuntimeError)(message)


# ------------------------------------------------------------------------------------------------ the child
@dataclass
class _ChildTracked:
    req: Any  # the engine's Request
    sent: int = 0  # token ids sent to the parent


class _EngineCore:
    """The child's side. The main thread owns the engine's requests: it takes the submissions and aborts that the
    reader thread queued, steps, and sends one message per step. Control calls run on a worker thread."""

    def __init__(self, conn: Any, engine: Any) -> None:
        self.conn, self.engine = conn, engine
        self.tracked: dict[int, _ChildTracked] = {}  # the main thread's only
        self.inbox: deque[tuple] = deque()
        self.send_lock = threading.Lock()  # the main thread and the call worker both send
        self.wake = threading.Event()
        self.closed = False
        self.calls = ThreadPoolExecutor(1, thread_name_prefix="multilora-engine-calls")

    def send(self, msg: tuple) -> None:
        with self.send_lock:
            self.conn.send(msg)

    # the reader thread ---------------------------------------------------------------------------------
    def read(self) -> None:
        while True:
            try:
                msg = self.conn.recv()
            except (EOFError, OSError):  # the parent is gone (exited, killed, crashed): never outlive it
                log.warning("engine process: the server's process went away; exiting")
                os._exit(0)
            if msg[0] == "call":
                self.calls.submit(self.call, *msg[1:])
                continue
            if msg[0] == "close":
                self.closed = True
            else:  # submit, abort: for the main thread, between steps
                self.inbox.append(msg)
            self.wake.set()
            if self.closed:
                return

    def call(self, call_id: int, method: str, args: tuple) -> None:
        engine = self.engine
        try:
            if method == "apply":  # fn(engine, *args): tests and diagnostics
                value = args[0](engine, *args[1:])
            elif method == "load_adapter":  # the LoRAAdapter holds meta tensors: the parent needs only success
                name, path, allow_pickle, preload = args
                engine.load_adapter(name, path, allow_pickle=allow_pickle, preload=preload)
                value = None
            elif method == "unload_adapter":
                value = engine.unload_adapter(*args)
            elif method == "stats":
                value = engine.stats()
            else:
                raise ValueError(f"engine process: unknown call {method!r}")
            self.send(("reply", call_id, True, value))
        except Exception as e:
            self.send(("reply", call_id, False, _wire_error(e)))

    # the main thread -----------------------------------------------------------------------------------
    def take_inbox(self) -> None:
        """Queue the submitted requests (each replied to before any step runs it) and withdraw the aborted ones."""
        engine = self.engine
        while self.inbox:
            msg = self.inbox.popleft()
            if msg[0] == "abort":
                try:
                    engine.abort(msg[1])
                except Exception:  # one bad message must not fail the step (and with it every tracked request)
                    log.exception("engine process: abort(%r) failed", msg[1])
                continue
            _, call_id, many, adapter, sampling = msg  # submit: one call's prompts, queued all at once or none
            reqs = []
            try:
                engine.check_submission(len(many))
            except ValueError as e:  # the whole list (no index)
                self.send(("reply", call_id, True, ("failed", None, _wire_error(e))))
                continue
            try:
                for ids in many:
                    reqs.append(engine.add_request(ids, adapter, sampling))
            except Exception as e:
                for req in reqs:
                    engine.abort(req.request_id)
                self.send(("reply", call_id, True, ("failed", len(reqs), _wire_error(e))))
                continue
            for req in reqs:
                self.tracked[req.request_id] = _ChildTracked(req)
            self.send(("reply", call_id, True, ("ok", [req.request_id for req in reqs])))

    def run(self, poll_seconds: float = 0.05) -> None:
        engine = self.engine
        while not self.closed:
            try:
                self.take_inbox()
                if engine.has_unfinished():
                    engine.step()
                else:
                    self.wake.wait(poll_seconds)
                    self.wake.clear()
                    self.take_inbox()
                self.publish()
            except Exception:  # a bug: never leave streams waiting forever, keep serving new requests
                log.exception("engine process: a step failed; failing its requests")
                for rid in list(self.tracked):
                    engine.fail(rid, "the engine loop failed (see the log)")
            if engine.dead:  # (a tensor-parallel worker died): no step can run again; the parent answers 503
                log.error("engine process: %s; exiting", engine.dead)
                for rid in list(self.tracked):
                    engine.fail(rid, engine.dead)
                self.publish()
                self.send(("dead", engine.dead))
                break
        for rid in list(self.tracked):  # closed: abort what is left, tell the parent, and leave
            engine.abort(rid)
        self.publish()
        self.send(("closed",))

    def publish(self) -> None:
        """One message for this step: every tracked request's new ids; the ends of the finished ones."""
        deltas, ends = [], []
        for rid, t in list(self.tracked.items()):
            req = t.req
            if req.status is Status.FINISHED:
                out = self.engine.postprocess.output(req)
                ends.append((rid, out.token_ids[t.sent :], out.finish_reason, out.error, out.text, out.arrival_time,
                             out.first_token_time, out.finish_time, out.admit_time, out.time_in_queue,
                             out.preemptions, out.adapter_tier))
                del self.tracked[rid]
            elif len(req.output_ids) > t.sent:
                n = len(req.output_ids)
                deltas.append((rid, req.output_ids[t.sent : n]))
                t.sent = n
        if deltas or ends:
            self.send(("step", deltas, ends))


def _child_main(conn: Any, factory: Callable[[], Any], log_level: int, log_format: str) -> None:
    """The engine process: build the engine (``factory()``), tell the parent, step until closed."""
    # Ctrl-C and a group-wide SIGTERM (``kill -- -PGID``, systemd's stop) reach us too: the parent lets its open streams
    # finish, then closes us in order; we leave by ourselves if it dies (the pipe's end)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format=log_format)
    started = threading.Event()

    def watch() -> None:  # until the engine is built: leave if the parent goes away (or asks us to)
        try:
            while not started.is_set():
                if conn.poll(0.2) and conn.recv()[0] == "close":
                    os._exit(0)
        except (EOFError, OSError):
            os._exit(0)

    watcher = threading.Thread(target=watch, name="multilora-engine-watch", daemon=True)
    watcher.start()
    try:
        engine = factory()
    except BaseException as e:  # noqa: BLE001: every failure is reported, then the process ends
        log.debug("engine process: building the engine failed", exc_info=True)
        started.set()
        watcher.join()
        conn.send(("failed", *_wire_error(e)))
        return
    started.set()
    watcher.join()
    try:
        tokenizer = pickle.dumps(engine.tokenizer)  # the parent tokenizes and detokenizes with the same tokenizer
    except Exception:  # noqa: BLE001: the parent then loads it from the model path
        tokenizer = None
    conn.send(("ready", {"pid": os.getpid(), "tokenizer": tokenizer, "has_tokenizer": engine.tokenizer is not None,
                         "vocab_size": engine.config.vocab_size, "eos_ids": sorted(engine.text.eos_ids),
                         "model_path": str(engine.model_path), "max_seq_len": engine.max_seq_len,
                         "max_waiting_requests": engine.engine_config.max_waiting_requests,
                         "adapters": {n: str(engine.adapter_path(n)) for n in engine.list_adapters()}}))
    core = _EngineCore(conn, engine)
    threading.Thread(target=core.read, name="multilora-engine-reader", daemon=True).start()
    try:
        core.run()
    finally:
        engine.close()  # a tensor-parallel engine's workers stop in order (a child process runs no atexit hooks)


# ------------------------------------------------------------------------------------------------ the parent
@dataclass
class _Tracked:
    stream: RequestStream
    text: TextStream
    prompt: Prompt
    adapter: str | None
    prompt_ids: list[int]
    ids: list[int] = field(default_factory=list)


@dataclass
class _Pending:
    future: Future
    submit: list | None = None  # (prompt, adapter, prompt ids, stop strings) of each prompt of a submission


class EngineProcess:
    """An engine stepping in a child process, with what the server needs of an ``Engine`` and its ``EngineLoop``.

    Made by ``EngineProcess.start``. Engine side: ``tokenizer``, ``model_path``, ``max_seq_len``, ``list_adapters``,
    ``adapter_path``, ``load_adapter``, ``unload_adapter``, ``stats`` (each a round trip to the child, except
    ``list_adapters`` and ``adapter_path``: the names and paths are kept here). Loop side: ``submit``, ``abort``,
    ``close``, ``running``, ``num_streams``. Thread-safe.

    Attributes:
        pid: the child's process id.
        error: why the child is no longer running (None while it runs, or after ``close``).
    """

    def __init__(self, conn: Any, process: Any, info: dict, start_seconds: float) -> None:
        self._conn, self._process = conn, process
        self.pid: int = info["pid"]
        self.model_path = Path(info["model_path"])
        self.max_seq_len: int = info["max_seq_len"]
        self.max_waiting_requests: int = info["max_waiting_requests"]  # (as the child started: it checks again)
        self.tokenizer = _tokenizer(info, self.model_path)
        self.text = PromptTokenizer(self.tokenizer, vocab_size=info["vocab_size"], eos_token_ids=info["eos_ids"],
                                    source=self.model_path)
        self._adapters: dict[str, str] = dict(info["adapters"])  # name -> the path it was loaded from, in load order
        self._tracked: dict[int, _Tracked] = {}
        self._pending: dict[int, _Pending] = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()  # tracked, pending, adapters
        self._send_lock = threading.Lock()
        self._closing = False
        self._closed = threading.Event()  # the reader has ended
        self.error: str | None = None
        self._reader = threading.Thread(target=self._read, name="multilora-engine-client", daemon=True)
        self._reader.start()
        atexit.register(self.close)
        log.info("engine process %d ready in %.1f s", self.pid, start_seconds)

    @classmethod
    def start(cls, factory: Callable[[], Any], *, timeout: float | None = None) -> "EngineProcess":
        """Start a child process that builds its engine with ``factory()`` (a picklable callable: a module-level
        function or a ``functools.partial`` of one) and steps it; return once the engine is built.

        Args:
            factory: returns a ``multilora.Engine`` (adapters loaded); runs in the child.
            timeout: seconds to wait for the engine (None: as long as it takes; a model load can take minutes).

        Raises:
            ModelLoadError, ValueError (MemoryPlanError, AdapterError: the child's message), UnknownAdapterError: as
                building the engine in this process would.
            EngineProcessError: the child died while starting (the exit code or signal is named), raised another
                error, or did not start within ``timeout``.
        """
        ctx = mp.get_context("spawn")
        ours, theirs = ctx.Pipe()
        root = logging.getLogger()
        fmt = (root.handlers[0].formatter._fmt if root.handlers and root.handlers[0].formatter
               and root.handlers[0].formatter._fmt else "%(asctime)s %(levelname)s %(name)s: %(message)s")
        level = logging.getLogger("multilora").getEffectiveLevel()
        # not a daemon: a daemonic process may not start processes, and a tensor-parallel engine starts its workers.
        # It still never outlives this interpreter: close() runs at exit (atexit, before multiprocessing joins its
        # children), and the child exits by itself when this end of the pipe closes (this process died)
        process = ctx.Process(target=_child_main, args=(theirs, factory, level, fmt.replace(
            "%(name)s", "%(name)s[engine]")), name="multilora-engine", daemon=False)
        t0 = time.perf_counter()
        process.start()
        theirs.close()  # only the child holds its end: its death is our end-of-file, ours is its
        try:
            if not ours.poll(timeout):
                raise EngineProcessError(f"the engine process did not start within {timeout:g} s")
            msg = ours.recv()
        except EOFError:
            process.join(10)
            ours.close()
            raise EngineProcessError(f"the engine process {_exit_status(process)} while starting (see its log "
                                     f"above)") from None
        except BaseException:  # KeyboardInterrupt, SIGTERM as SystemExit, the timeout: never leave the child behind
            _stop(process)
            ours.close()
            raise
        if msg[0] == "failed":
            process.join(30)
            ours.close()
            kind, message = msg[1], msg[2]
            if kind == "other":
                raise EngineProcessError(f"the engine process failed to start: {message}")
            _raise(kind, message)
        try:
            return cls(ours, process, msg[1], time.perf_counter() - t0)
        except BaseException:  # the tokenizer could not be had here: do not leave the child running
            _stop(process)
            ours.close()
            raise

    # ------------------------------------------------------------------------------------ the engine's side
    def list_adapters(self) -> list[str]:
        with self._lock:
            return list(self._adapters)

    def adapter_path(self, name: str) -> Path:
        """``Engine.adapter_path`` from this side's record of the loads (no round trip). Raises
        UnknownAdapterError (a KeyError) if it is not loaded."""
        with self._lock:
            if name not in self._adapters:
                raise UnknownAdapterError(f"adapter {name!r} is not loaded ({loaded_names(self._adapters)})")
            return Path(self._adapters[name])

    def load_adapter(self, name: str, path: str | os.PathLike, *, allow_pickle: bool = False,
                     preload: bool = True) -> None:
        """``Engine.load_adapter`` in the child (its errors raised again here; returns nothing)."""
        self._call("load_adapter", name, str(path), allow_pickle, preload)
        with self._lock:
            self._adapters[name] = str(Path(path))  # a reload keeps the name's place

    def unload_adapter(self, name: str) -> None:
        """``Engine.unload_adapter`` in the child (UnknownAdapterError when not loaded)."""
        self._call("unload_adapter", name)
        with self._lock:
            self._adapters.pop(name, None)

    def stats(self) -> dict[str, Any]:
        """``Engine.stats()`` of the child's engine."""
        return self._call("stats")

    def apply(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(engine, *args)`` run in the child (on its call thread, concurrently with steps); its result. For
        tests and diagnostics: ``fn`` and the result must be picklable."""
        return self._call("apply", fn, *args)

    # ------------------------------------------------------------------------------------ the loop's side
    def submit(self, prompt: Prompt, adapter: str | None = None, sampling: SamplingParams | None = None) -> RequestStream:
        """Tokenize here, queue in the child (``Engine.add_request``'s checks and errors) and return the stream.

        Raises:
            EngineDeadError: the child has exited. RuntimeError: closed. Otherwise as ``Engine.add_request``.
        """
        return self.submit_many([prompt], adapter, sampling)[0]

    def submit_many(self, prompts: Sequence[Prompt], adapter: str | None = None,
                    sampling: SamplingParams | None = None) -> list[RequestStream]:
        """``submit`` for each prompt, every one tokenized and checked here first, then all sent in one message that
        the child queues at one step boundary, all or none (one ``submit`` a prompt waits a step each time: a list of
        3,000 prompts took minutes to queue, and a client gone meanwhile could not stop it).

        Raises:
            ValueError: more prompts than ``max_waiting_requests`` (``Engine.check_submission``, in the child; no
                ``prompt_index``).
            as ``submit``, for the first prompt refused, with ``prompt_index`` (its index in ``prompts``) set on the
            exception; the ones before it are withdrawn (nothing of the call runs).
        """
        sampling = sampling or SamplingParams()
        if not isinstance(sampling, SamplingParams):
            raise ValueError(f"sampling: expected SamplingParams, got {type(sampling).__name__}")
        check_submission(len(prompts), self.max_waiting_requests)  # before tokenizing them all, as the loop does
        submit = []
        for i, prompt in enumerate(prompts):
            try:  # chat template, text checks: this process's work; the room before the ids are pickled to the child
                ids = self.text.encode(prompt, self.max_seq_len)
                check_room(len(ids), self.max_seq_len)
            except Exception as e:
                e.prompt_index = i
                raise
            submit.append((prompt, adapter, ids, sampling.stop))
        return self._request(("submit", [ids for _, _, ids, _ in submit], adapter, sampling), submit).result()

    def abort(self, request_id: Any) -> bool:
        """Withdraw a request (its id, or its stream); its stream then ends with ``finish_reason="abort"`` (after
        the child's next step). Returns False when no unfinished request of this process has that id. Raises
        TypeError for anything else (``requests.as_request_id``)."""
        request_id = as_request_id(request_id)  # a plain int down the pipe: the child's abort takes nothing else
        with self._lock:
            if request_id not in self._tracked or self.error is not None or self._closed.is_set():
                return False
        try:
            self._send(("abort", request_id))
        except OSError:
            return False
        return True

    @property
    def running(self) -> bool:
        """The child is alive and not closed."""
        return self.error is None and not self._closing and not self._closed.is_set()

    @property
    def num_streams(self) -> int:
        with self._lock:
            return len(self._tracked)

    def close(self, timeout: float = 30.0) -> None:
        """Abort what still runs, stop the child and wait for it (``timeout`` seconds, then it is killed)."""
        if self._closing:
            return
        self._closing = True
        atexit.unregister(self.close)
        try:
            self._send(("close",))
        except OSError:
            pass
        self._closed.wait(timeout)
        self._process.join(timeout)
        _stop(self._process)  # dead now: the reader sees the end of the pipe, if it has not ended yet
        self._reader.join(10)
        self._conn.close()
        self._fail_all("abort", "aborted: the server is shutting down")

    # ------------------------------------------------------------------------------------ the pipe
    def _call(self, method: str, *args: Any) -> Any:
        return self._request(("call", method, args)).result()

    def _request(self, msg: tuple, submit: tuple | None = None) -> Future:
        future: Future = Future()
        with self._lock:
            if self.error is not None:
                raise EngineDeadError(self.error)
            if self._closing or self._closed.is_set():
                raise RuntimeError("EngineProcess: closed")
            call_id = next(self._ids)
            self._pending[call_id] = _Pending(future, submit)
        try:
            self._send((msg[0], call_id, *msg[1:]))
        except OSError as e:
            with self._lock:
                self._pending.pop(call_id, None)
            raise EngineDeadError(f"the engine process cannot be reached: {e}") from None
        return future

    def _send(self, msg: tuple) -> None:
        with self._send_lock:  # never under _lock: a full pipe must not stop the reader from delivering
            self._conn.send(msg)

    def _read(self) -> None:
        """The reader thread: replies resolve their futures; a step's message becomes its streams' deltas."""
        try:
            while True:
                msg = self._conn.recv()
                kind = msg[0]
                if kind == "step":
                    self._deliver(msg[1], msg[2])
                elif kind == "reply":
                    self._reply(*msg[1:])
                elif kind == "dead":  # the child's engine cannot run (a tensor-parallel worker died): it leaves
                    self.error = f"the engine process (pid {self.pid}) stopped: {msg[1]}"
                    log.error("%s: failing its requests; /health now fails", self.error)
                elif kind == "closed":
                    return
        except (EOFError, OSError):
            if not self._closing and self.error is None:  # (after a "dead" message its reason stays the error)
                self._process.join(5)
                self.error = f"the engine process (pid {self.pid}) {_exit_status(self._process)}"
                log.error("%s: failing its requests; /health now fails", self.error)
        finally:
            self._closed.set()
            self._fail_all("error" if self.error else "abort", self.error or "aborted: the server is shutting down")

    def _reply(self, call_id: int, ok: bool, value: Any) -> None:
        index = 0  # (a submission's refused prompt)
        with self._lock:
            pending = self._pending.pop(call_id)
            if ok and pending.submit is not None:  # ("ok", ids) or ("failed", index, error); each stream registered
                if value[0] == "ok":  # before any delta of it can be read (this thread)
                    streams = []
                    for rid, (prompt, adapter, ids, stop) in zip(value[1], pending.submit):
                        streams.append(RequestStream(self, rid))
                        self._tracked[rid] = _Tracked(streams[-1], TextStream(self.text, stop), prompt, adapter, ids)
                    value = streams
                else:
                    ok, value, index = False, value[2], value[1]
        if ok:
            pending.future.set_result(value)
        else:
            try:
                _raise(*value)
            except Exception as e:
                if pending.submit is not None and index is not None:  # (None: the whole list refused)
                    e.prompt_index = index
                pending.future.set_exception(e)

    def _deliver(self, deltas: list, ends: list) -> None:
        waiters = []
        with self._lock:
            tracked = self._tracked
            for rid, new in deltas:
                t = tracked.get(rid)
                if t is None:
                    continue
                t.ids.extend(new)
                waiters.append(t.stream._deliver(RequestDelta(rid, new, t.text.push(t.ids))))
            for rid, new, reason, error, text, arrival, first, finish, admit, queued, preempted, tier in ends:
                t = tracked.pop(rid, None)
                if t is None:
                    continue
                t.ids.extend(new)
                out = RequestOutput(request_id=rid, prompt=t.prompt, adapter=t.adapter, text=text, token_ids=t.ids,
                                    prompt_token_ids=t.prompt_ids, finish_reason=reason, error=error,
                                    arrival_time=arrival, first_token_time=first, finish_time=finish,
                                    admit_time=admit, time_in_queue=queued, preemptions=preempted,
                                    adapter_tier=tier)
                waiters.append(t.stream._deliver(RequestDelta(rid, new, t.text.close(text), reason, error, out)))
        waiters = [w for w in waiters if w is not None]
        if waiters:
            _wake_all(waiters)

    def _fail_all(self, reason: str, message: str) -> None:
        """End every stream still open (the child is gone) and fail every call still waiting."""
        with self._lock:
            tracked, self._tracked = self._tracked, {}
            pending, self._pending = self._pending, {}
        waiters = []
        for rid, t in tracked.items():
            out = RequestOutput(request_id=rid, prompt=t.prompt, adapter=t.adapter, text=t.text.sent,
                                token_ids=t.ids, prompt_token_ids=t.prompt_ids, finish_reason=reason, error=message)
            waiters.append(t.stream._deliver(RequestDelta(rid, [], "", reason, message, out)))
        for p in pending.values():
            p.future.set_exception(EngineDeadError(message) if reason == "error" else RuntimeError("EngineProcess: closed"))
        waiters = [w for w in waiters if w is not None]
        if waiters:
            _wake_all(waiters)


def _tokenizer(info: dict, model_path: Path) -> Any:
    """The child's tokenizer, unpickled; or loaded here from the model path if it could not be pickled."""
    if info["tokenizer"] is not None:
        return pickle.loads(info["tokenizer"])
    if not info["has_tokenizer"]:
        return None
    from multilora.runtime.weights import load_tokenizer

    return load_tokenizer(model_path)


def _exit_status(process: Any) -> str:
    code = process.exitcode
    if code is None:
        return "stopped answering"
    if code < 0:
        try:
            return f"was killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _stop(process: Any) -> None:
    """Kill a child that is still alive (it ignores SIGTERM: ``_child_main``; SIGTERM's default action would have
    ended it without cleanup all the same)."""
    if process.is_alive():
        process.kill()
        process.join(10)


def load_engine(model: Any, config: Any, adapters: dict[str, str] | list[tuple[str, str]], *,
                progress: bool = False, warmup: bool = False, allow_pickle: bool = False) -> Any:
    """An ``Engine`` of ``model`` and ``config`` with ``adapters`` (name -> path) loaded: the factory of
    ``multilora serve --engine-process`` (the same as the in-process serve's); ``warmup``: then, on a CUDA device,
    ``Engine.warmup`` on the first adapter (``serve --warmup``); ``allow_pickle``: ``Engine.load_adapter``'s, for
    every adapter (``--allow-pickle``). Errors name the adapter: ``ValueError("--adapter NAME=PATH: ...")``."""
    from tqdm.auto import tqdm

    from multilora.runtime.engine import Engine

    items = list(adapters.items()) if isinstance(adapters, dict) else list(adapters)
    engine = Engine(model, config=config)
    t0 = time.perf_counter()
    for name, path in tqdm(items, desc="Registering adapters", unit="adapter", disable=not progress or not items,
                           file=sys.stderr):
        try:
            engine.load_adapter(name, path, allow_pickle=allow_pickle)
        except ValueError as e:
            raise ValueError(f"--adapter {name}={path}: {e}") from e
    if items:
        log.info("registered %d adapter%s in %.2f s", len(items), "" if len(items) == 1 else "s", time.perf_counter() - t0)
    if warmup and engine.device.type == "cuda":  # on a CPU nothing compiles (torch kernels, no graphs): no need
        try:
            engine.warmup(items[0][0] if items else None)
        except Exception as e:  # the warm-up is an optimisation: a failure of it does not keep the server down
            log.warning("warm-up failed (%s: %s); serving anyway: the first requests may wait for kernel compiles",
                        type(e).__name__, e)
    return engine
