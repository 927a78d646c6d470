"""Requests and the continuous-batching scheduler.

Each engine step is either a **prefill** step (newly admitted requests process their whole prompt) or a
**decode** step (every running request adds one token). Waiting requests are admitted in arrival order
whenever there is room, so a finished request leaves and a waiting one joins on the next step.

Admission budgets: ``max_batch_size`` running requests, free KV rows, ``max_prefill_tokens`` prompt
tokens per prefill step, and the adapter pool: every distinct adapter of the running batch is resident
at once. A request whose adapter cannot be made resident now (the pool is full of adapters that running
requests use or the user pinned) is skipped and stays waiting: it is never served with other weights.

No starvation. A request that has waited ``patience`` scheduling steps becomes *urgent*: from then on no request
behind it in the queue is admitted, so the running requests drain, free their pages and KV rows, and the
urgent request is admitted as soon as its adapter fits. Every running request finishes within
``max_seq_len`` decode steps, so a request is admitted at most
``(k + 1) * (patience + max_seq_len + 1)`` steps after it arrives, where ``k`` is the number of requests
ahead of it in the queue (each of those becomes admitted or fails first, within the same bound). A request
whose adapter can never fit (larger than the pool minus pinned adapters) fails at once with an error.
"""

from __future__ import annotations

import enum
import itertools
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from multilora.memory.pool import PoolFullError
from multilora.runtime.adapter_cache import AdapterCache, AdapterHandle
from multilora.runtime.sampling import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """One generation request and its state."""

    request_id: int
    prompt: Any  # str, chat messages, or token ids (what the caller gave)
    prompt_ids: list[int]
    adapter_name: str | None
    handle: AdapterHandle | None
    params: SamplingParams
    generator: torch.Generator | None
    arrival: float = field(default_factory=time.perf_counter)
    output_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    kv_row: int | None = None
    slot: int = -1
    finish_reason: str | None = None
    error: str | None = None
    text: str = ""
    first_token_time: float | None = None
    finish_time: float | None = None
    admit_time: float | None = None
    skipped_steps: int = 0  # schedule() calls this request has waited through

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)


_ids = itertools.count()


def next_request_id() -> int:
    return next(_ids)


class Scheduler:
    """FIFO continuous batching under KV, batch-size, prefill-token and adapter-pool budgets.

    Args:
        cache: the adapter cache (adapters are acquired at admission, released at finish).
        allocate_kv, free_kv: take / return a KV row (``allocate_kv`` returns None when none is free).
        max_batch_size: most running requests.
        max_prefill_tokens: most prompt tokens admitted in one prefill step (at least one request is
            always admitted when resources allow, whatever its length).
        patience: scheduling steps a request may wait before it becomes urgent (see module docstring).
        on_error: ``on_error(request, message)`` is called for a request that fails at admission.
    """

    def __init__(
        self,
        cache: AdapterCache,
        *,
        allocate_kv: Callable[[], int | None],
        free_kv: Callable[[int], None],
        max_batch_size: int,
        max_prefill_tokens: int,
        patience: int = 16,
        on_error: Callable[["Request", str], None] | None = None,
    ) -> None:
        self.cache = cache
        self._allocate_kv = allocate_kv
        self._free_kv = free_kv
        self.max_batch_size = max_batch_size
        self.max_prefill_tokens = max_prefill_tokens
        self.patience = patience
        self._on_error = on_error
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.wait_seconds_total = 0.0
        self.wait_seconds_max = 0.0
        self.admitted_total = 0
        self.adapter_waits = 0  # times a request was passed over because its adapter did not fit

    def add(self, req: Request) -> None:
        if req.handle is not None:
            self.cache.enqueue(req.handle)
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> tuple[str, list[Request]] | None:
        """Pick the next step: ("prefill", admitted) if any request can be admitted, else ("decode", running)."""
        admitted = self._admit()
        if admitted:
            return "prefill", admitted
        if self.running:
            return "decode", list(self.running)
        return None

    def _admit(self) -> list[Request]:
        admitted: list[Request] = []
        tokens = 0
        skipped: list[Request] = []
        while self.waiting and len(self.running) + len(admitted) < self.max_batch_size:
            req = self.waiting[0]
            if admitted and tokens + len(req.prompt_ids) > self.max_prefill_tokens:
                break
            slot = -1
            if req.handle is not None:
                if not self.cache.could_ever_fit(req.handle):
                    self.waiting.popleft()
                    self._fail(req, f"adapter {req.adapter_name!r} needs {req.handle.num_pages} page(s): more than the "
                                    f"adapter pool holds besides pinned adapters ({self.cache.pool.num_pages} pages)")
                    continue
                try:
                    slot = self.cache.acquire(req.handle)
                except PoolFullError:
                    self.adapter_waits += 1
                    skipped.append(self.waiting.popleft())  # wait for running requests to release pages
                    if skipped[-1].skipped_steps >= self.patience:
                        break  # urgent: admit nobody behind it
                    continue
                except Exception as e:  # e.g. its files changed on disk: fail this request only
                    self.waiting.popleft()
                    self._fail(req, f"{type(e).__name__}: {e}")
                    continue
            row = self._allocate_kv()
            if row is None:
                if req.handle is not None:
                    self.cache.release(req.handle)
                break
            self.waiting.popleft()
            if req.handle is not None:
                self.cache.dequeue(req.handle)
            req.slot, req.kv_row, req.status = slot, row, Status.RUNNING
            req.admit_time = time.perf_counter()
            wait = req.admit_time - req.arrival
            self.wait_seconds_total += wait
            self.wait_seconds_max = max(self.wait_seconds_max, wait)
            self.admitted_total += 1
            admitted.append(req)
            tokens += len(req.prompt_ids)
        self.waiting.extendleft(reversed(skipped))  # keep arrival order
        for req in self.waiting:
            req.skipped_steps += 1
        self.running.extend(admitted)
        return admitted

    def _fail(self, req: Request, message: str) -> None:
        self.finish(req, "error", message)
        if self._on_error is not None:
            self._on_error(req, message)

    def waiting_handles(self) -> set[int]:
        """ids of the adapter handles of all waiting requests (prefetch never evicts these)."""
        return {id(r.handle) for r in self.waiting if r.handle is not None}

    def prefetch_candidates(self, limit: int) -> list[AdapterHandle]:
        """Distinct adapters of the first waiting requests that are not resident, in queue order."""
        out: list[AdapterHandle] = []
        for req in self.waiting:
            h = req.handle
            if h is not None and h.slot is None and h not in out:
                out.append(h)
                if len(out) >= limit:
                    break
        return out

    def finish(self, req: Request, reason: str, error: str | None = None) -> None:
        """Mark a request finished and return its KV row and adapter reference."""
        if req.status is Status.FINISHED:
            return
        was_waiting = req.status is Status.WAITING
        req.status, req.finish_reason, req.error = Status.FINISHED, reason, error
        req.finish_time = time.perf_counter()
        if req.kv_row is not None:
            self._free_kv(req.kv_row)
            req.kv_row = None
        if req.handle is not None and req.slot >= 0:
            self.cache.release(req.handle)
            req.slot = -1
        if req in self.running:
            self.running.remove(req)
        elif was_waiting:  # in the queue, or already taken out of it by _admit
            if req in self.waiting:
                self.waiting.remove(req)
            if req.handle is not None:
                self.cache.dequeue(req.handle)
