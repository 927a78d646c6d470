"""Requests and the continuous-batching scheduler.

Each engine step is either a **prefill** step (newly admitted requests process their whole prompt) or a
**decode** step (every running request adds one token). Waiting requests are admitted in arrival order
whenever there is room, so a finished request leaves and a waiting one joins on the next step.

Admission budgets: ``max_batch_size`` running requests, free KV rows, ``max_prefill_tokens`` prompt
tokens per prefill step, and the adapter pool (every distinct adapter of the running batch is resident
at once). A request whose adapter cannot be made resident now (the pool is full of adapters that running
requests use) is skipped and stays waiting: it is never served with other weights; it is admitted as soon
as running requests release enough pages.
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
    """

    def __init__(
        self,
        cache: AdapterCache,
        *,
        allocate_kv: Callable[[], int | None],
        free_kv: Callable[[int], None],
        max_batch_size: int,
        max_prefill_tokens: int,
    ) -> None:
        self.cache = cache
        self._allocate_kv = allocate_kv
        self._free_kv = free_kv
        self.max_batch_size = max_batch_size
        self.max_prefill_tokens = max_prefill_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add(self, req: Request) -> None:
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
                try:
                    slot = self.cache.acquire(req.handle)
                except PoolFullError:
                    skipped.append(self.waiting.popleft())  # wait for running requests to release pages
                    continue
            row = self._allocate_kv()
            if row is None:
                if req.handle is not None:
                    self.cache.release(req.handle)
                break
            self.waiting.popleft()
            req.slot, req.kv_row, req.status = slot, row, Status.RUNNING
            admitted.append(req)
            tokens += len(req.prompt_ids)
        self.waiting.extendleft(reversed(skipped))  # keep arrival order
        self.running.extend(admitted)
        return admitted

    def finish(self, req: Request, reason: str, error: str | None = None) -> None:
        """Mark a request finished and return its KV row and adapter reference."""
        if req.status is Status.FINISHED:
            return
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
        elif req in self.waiting:
            self.waiting.remove(req)
