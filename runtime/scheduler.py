"""Requests and the continuous-batching scheduler.

A running request keeps how many of its positions have KV computed (``Request.computed``); a step computes a
**chunk** of each scheduled request, its tokens ``computed .. computed + chunk - 1`` (``Request.chunk``), and a
request whose chunk reaches its last token samples its next token from that step's logits (``Request.samples``;
the runner computes logits for those rows only). A decoding request's chunk is its one newest token.

Two ways to fill a step (``chunked``, ``EngineConfig.enable_chunked_prefill``, default on):

- **Unchunked**: each step is either a **prefill** step (newly admitted requests process their whole prompt, every
  running request waits) or a **decode** step (every running request adds one token).
- **Chunked prefill**: one step carries the decode token of EVERY running request that decodes, then chunks of
  prompts under the step's token budget ``max_num_batched_tokens`` (B_t): the prompt room is
  ``min(max_prefill_tokens, max(1, B_t - decode tokens))`` (``prompt_room``: decode tokens are never held back, and
  a prefill always progresses), filled first by the running requests still prefilling, oldest admitted first, then
  by the first chunks of newly admitted requests. A long prompt therefore never stops running requests: every
  decoding request gets a token at every step. A step whose rows all decode is a "decode" step (CUDA-graph
  replayed); one with both kinds is "mixed"; one of prompt chunks only is "prefill". A request is admitted with the
  KV blocks of its whole length (below), so a prefilling request never runs out of blocks mid-prompt. With
  ``recompute_after`` (longrope), a request longer than it takes a first chunk of ``recompute_after + 1`` tokens
  (the step's first prompt chunk, even over the room), so all its keys carry the long factors (``_chunk``).

Waiting requests are admitted in arrival order whenever there is room, so a finished request leaves and a waiting
one joins on the next step. ``Scheduler.schedule`` returns the step's work as a ``Schedule`` (kind, batch, the
sampling rows, and the requests that failed in this call: the engine reports them; the scheduler calls nothing
back); ``Scheduler.advance`` records the computed chunks after the step's forward.

Admission budgets: ``max_batch_size`` running requests, the prompt tokens of a step (unchunked:
``max_prefill_tokens`` tokens of whole prompts per prefill step, the first admitted whatever its length; chunked:
the prompt room left after decode tokens and running prefills, a new request being admitted with its first chunk),
free KV blocks (a request is admitted when the blocks for its tokens + 1 are free: its prefill and its first
decode step never run out; a ``logits_only`` request of ``Engine.logits`` never decodes and needs blocks for its
tokens only), and the adapter pool: every distinct adapter of the running batch is resident at once. The head of
the queue waits for KV blocks and for prompt room (nothing behind it is admitted until they are free). A request
whose adapter cannot be made resident now (the pool is full of adapters that running requests use or the user
pinned) is skipped and stays waiting: it is never served with other weights.

Preemption (recompute). Before a step every decoding request needs room for one more token. When blocks run
out, the most recently admitted running request (decoding or still prefilling) is preempted (again, until the
others fit): it returns its KV blocks and its adapter reference and goes back to the FRONT of the waiting queue
with its prompt, its generated tokens and its sampler state. When it is admitted again, its prefill computes
prompt + generated tokens from position 0 (whole, or in chunks; all of them count against the prompt budgets) and
the logits at the last position give its next token, exactly as the decode step would have. The oldest running
request is never preempted in favour of a newer one, and a request alone always fits (the engine rejects at
submission a request whose whole length could never fit in the cache), so a step always keeps at least one
request and nothing is lost. A chunked step that preempts admits nobody (the victim would come straight back).

No starvation. A request that has waited ``patience`` scheduling steps becomes *urgent*: from then on no
request behind it in the queue is admitted, so the running requests drain, free their pages and blocks,
and the urgent request is admitted as soon as its adapter fits. A request whose adapter can never fit
(larger than the pool minus pinned adapters) fails at once with an error. Bounds on the steps from a
request R's arrival to its (first) admission, where ``k`` is the number of requests ahead of it in the
queue when it arrives, ``B = max_batch_size`` and ``L = max_seq_len``:

- Without preemption (the KV cache never runs out), a request admitted at step t has finished by step t + F:
  unchunked F = ``L`` (every decode step advances every running request; a prefill step advances it too).
  Chunked, F = ``ceil(B * L / P1) + L`` with ``P1 = min(max_prefill_tokens, max(1, B_t - B))``, the least prompt
  room of a step: prompt room goes to running prefills in admission order, fewer than B requests are ahead of
  it, each with at most L positions, and every step gives them at least P1 of them; then it decodes a token at
  every step. So R is admitted at most ``(k + 1) * (patience + F + 1)`` steps after it arrives (each of the k
  requests ahead of it is admitted or fails first, within the same bound).
- With preemption, a preempted request may re-enter the queue ahead of R, so the bound counts tokens
  instead: R becomes urgent after ``patience`` steps; from then on only the set S of requests that are
  running or ahead of R can be admitted (a preempted request is already in S), and each member generates fewer
  than ``L`` tokens. Unchunked, every step (a prefill samples a token for each admitted request; a decode step
  keeps at least one request) generates at least one token for a member of S. Chunked, a step with a decoding
  request generates one; steps without one neither preempt (only a decoding request's growth does, and
  ``recompute_after`` takes only requests that decoded) nor hold anything back from the oldest prefilling
  request, which gets ``P0 = min(max_prefill_tokens, B_t)`` prompt tokens per step and so samples within
  ``c = ceil(L / P0)`` of them (unchunked c = 1). S holds at most the k requests ahead of R, the ``B`` running
  when R arrives and the ``B`` per step admitted while R was not yet urgent, so R is admitted within
  ``patience + (k + (patience + 1) * B) * L * c + 1`` steps. Once admitted, R is preempted only in favour of
  requests admitted before it, so it also finishes.

Adapter-aware admission (``adapter_aware``, ``EngineConfig.adapter_aware_admission``, default on). Admitting a
request whose adapter is on the disk tier would read its files inside the step (every running request waits for
the read); such a request, while it is not urgent and something runs, is passed over instead (counted in
``queue_defers_for_adapter_load``) and stays in its place: the engine's prefetch (``prefetch_candidates``: queue
order, reads already in flight not counted against the limit) brings its adapter to host memory, and meanwhile
requests behind it whose adapters are resident or in host memory are admitted. Being passed over counts as a
skipped step like waiting for pool room, so after ``patience`` steps the request is urgent. An urgent request
whose adapter the prefetch is still reading (``AdapterCache.reading``) is not admitted into a step that would wait
for that read (the step, and every running request with it, would stall on the disk: session 29's one-batch bench
at 2,048 adapters spent 14-25% of its step thread there); as for any urgent request nobody behind it is admitted,
the running requests keep stepping, and it is admitted in the first step after its read has landed (counted in
``queue_urgent_waits_for_adapter_read``; ``URGENT_READ_WAIT``, on since session 29: in session 30's one-batch bench
on an H200 host 49.6% and 53.6% of the no-adapter tokens/s against 52.1% with it off, within the runs' spread).
An urgent request with no read in flight is admitted as before (reading its files in the step), and so is one
whose read has not landed after ``patience`` more steps. So the bounds above
hold with ``patience`` doubled: ``(k + 1) * (2 * patience + F + 1)`` and
``2 * patience + (k + (2 * patience + 1) * B) * L * c + 1``. While the head of the queue is such a request, the
look-ahead (``prefetch_candidates``) stops at it: nobody behind it is admitted first, and reads for them would
compete with its read for the host tier (a small tier could evict its copy before the step that admits it). With
nothing running a request is admitted at once (reading its files): deferring would only idle the engine.

``tests/test_scheduler_chunked.py`` checks both chunked bounds on random traffic (and the rest of the chunked
contract: every prompt position computed once unless recomputed, no decode stall, blocks and adapter references
returned); ``tests/test_scheduler_fairness.py`` checks the first on an engine, chunked and not.
"""

from __future__ import annotations

import enum
import itertools
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from multilora.memory.kv_cache import PagedKVCache
from multilora.memory.pool import PoolFullError
from multilora.runtime.adapter_cache import AdapterCache, AdapterHandle
from multilora.runtime.sampling import SamplingParams

#: Whether an urgent request whose adapter the prefetch is still reading waits for the read outside the steps (up
#: to ``patience`` more steps; module docstring), instead of being admitted into a step that waits for it. False:
#: what ran before session 29 (the A/B switch of ``bench_adapter_throughput.py --urgent-read-wait off``).
URGENT_READ_WAIT = True


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
    seed: int  # the sampler's per-request seed: token n is drawn from noise(seed, n), whatever the batch
    arrival: float = field(default_factory=time.perf_counter)
    output_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    slot: int = -1
    finish_reason: str | None = None
    error: str | None = None
    text: str = ""
    first_token_time: float | None = None
    finish_time: float | None = None
    admit_time: float | None = None  # first admission
    adapter_tier: str | None = None  # its adapter's tier ("gpu", "host", "disk") when it was submitted
    time_in_queue: float = 0.0  # seconds waited in the queue before its first token, over all its admissions
    queued_time: float | None = None  # when it last started waiting (arrival, or its latest preemption)
    skipped_steps: int = 0  # schedule() calls this request has waited through
    preemptions: int = 0  # times it was preempted (its KV blocks taken back; recomputed on re-admission)
    kv_tokens: int = 0  # positions its KV blocks are known to hold (0: unknown, ask the cache); scheduler-kept
    admitted_tokens: int = -1  # num_tokens when last admitted: positions below it are its prefill (``prefilling``)
    logits_only: bool = False  # Engine.logits: one prefill, its last position's logits kept, nothing sampled
    logits: torch.Tensor | None = None  # float32 [vocab] on the CPU, set when a logits_only request finishes
    computed: int = 0  # positions whose KV this admission has computed (scheduler-kept; 0 while waiting)
    chunk: int = 0  # tokens the scheduled step computes: positions computed .. computed + chunk - 1
    max_computed: int = 0  # most positions ever computed (over preemptions): a position below it is recomputed
    #: tokens drawn on the device by a step launched ahead (``EngineConfig.async_scheduling``) and not yet read back:
    #: they follow ``output_ids``; their ids exist only on the device until the engine reads the step back
    pending: int = 0

    @property
    def num_tokens(self) -> int:
        """Its positions: prompt, generated, and any drawn but not yet read back (``pending``)."""
        return len(self.prompt_ids) + len(self.output_ids) + self.pending

    @property
    def kv_need(self) -> int:
        """Positions its KV blocks must hold when it is admitted: its tokens, + 1 for the first decode step
        (a logits_only request never decodes)."""
        return self.num_tokens + (0 if self.logits_only else 1)

    @property
    def samples(self) -> bool:
        """Whether the scheduled step's chunk reaches its last token (its logits give the next token)."""
        return self.chunk > 0 and self.computed + self.chunk == self.num_tokens

    @property
    def prefilling(self) -> bool:
        """Running and not yet past the tokens it was admitted with (its prompt, or prompt + generated after a
        preemption): its steps compute chunks of them. False once it decodes."""
        return self.computed < self.admitted_tokens

    def tokens(self, start: int, n: int) -> list[int]:
        """Its token ids ``start .. start + n - 1`` (prompt, then generated; 0 stands for a ``pending`` token, whose id
        the runner takes from the device)."""
        p = len(self.prompt_ids)
        if start + n <= p:
            return self.prompt_ids[start : start + n]
        out = (self.prompt_ids[start:] + self.output_ids[max(0, start - p) : start + n - p])[:n]
        return out + [0] * (n - len(out)) if len(out) < n else out

    @property
    def seq_id(self) -> int:
        """The KV cache's name for this request's blocks (the cache holds its block table)."""
        return self.request_id


_ids = itertools.count()


def next_request_id() -> int:
    return next(_ids)


@dataclass
class Schedule:
    """One step's work.

    ``batch``: the requests the step computes, each ``Request.chunk`` tokens from ``Request.computed`` on;
    ``sampling``: those of ``batch`` whose chunk reaches their last token (``Request.samples``), in batch order: the
    step's logits have one row for each of them, and only them. ``kind``: "prefill" (every row is a prompt chunk:
    without chunked prefill, the requests admitted now with their whole prompts), "decode" (every row is one token of
    a decoding request: the CUDA-graph path), "mixed" (both: chunked prefill only) or None (nothing to run).
    ``prefill_rows``: rows that are prompt chunks. ``failed``: requests that failed in this call (finished with reason
    "error" and a message: an adapter that can never fit, files that changed on disk, or, when nothing runs and
    nothing can be admitted, every waiting request)."""

    kind: str | None
    batch: list[Request]
    failed: list[Request]
    sampling: list[Request] = field(default_factory=list)
    prefill_rows: int = 0


class Scheduler:
    """FIFO continuous batching under KV-block, batch-size, step-token and adapter-pool budgets.

    Args:
        cache: the adapter cache (adapters are acquired at admission, released at finish or preemption).
        kv: the paged KV cache (blocks are allocated at admission, grown before each decode step, returned
            at finish or preemption); sequences are named by ``Request.seq_id``.
        max_batch_size: most running requests.
        max_prefill_tokens: most prompt tokens computed in one step (without chunking: admitted in one prefill step,
            at least one request always admitted when resources allow, whatever its length).
        chunked: chunked prefill (module docstring): steps carry decode tokens and prompt chunks together.
        max_num_batched_tokens: with ``chunked``, the step's token budget (decode tokens + prompt chunks; None =
            ``max_prefill_tokens``).
        adapter_aware: pass over (until it is urgent) a waiting request whose adapter is still on the disk tier
            while something runs: its prefetch brings it up, and requests behind it whose adapters are resident or
            in host memory are admitted meanwhile (module docstring, "Adapter-aware admission").
        patience: scheduling steps a request may wait before it becomes urgent (see module docstring).
        recompute_after: 0, or a length L: a running request whose KV was written when it had at most L tokens is
            recomputed (preempted without counting, then prefilled again whole, as after a preemption) at the
            step that would take it past L. Phi-3's ``longrope`` (``DecoderModel.rope_long_after``): its keys
            then take the long RoPE factors, as transformers' ``Phi3ForCausalLM.prepare_inputs_for_generation``
            drops its cache at that point and runs the whole sequence again.
    """

    def __init__(
        self,
        cache: AdapterCache,
        *,
        kv: PagedKVCache,
        max_batch_size: int,
        max_prefill_tokens: int,
        patience: int = 16,
        recompute_after: int = 0,
        chunked: bool = False,
        max_num_batched_tokens: int | None = None,
        adapter_aware: bool = False,
    ) -> None:
        self.cache = cache
        self.chunked = chunked
        self.adapter_aware = adapter_aware
        self.max_num_batched_tokens = max_num_batched_tokens or max_prefill_tokens
        self.recompute_after = recompute_after
        self.kv = kv
        self.max_batch_size = max_batch_size
        self.max_prefill_tokens = max_prefill_tokens
        self.patience = patience
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order (the last is preempted first)
        self._live: dict[int, Request] = {}  # unfinished requests by id
        self.wait_seconds_total = 0.0
        self.wait_seconds_max = 0.0
        self.admitted_total = 0
        self.adapter_waits = 0  # times a request was passed over because its adapter did not fit
        self.adapter_defers = 0  # times a request was passed over because its adapter was still on disk
        self.adapter_read_waits = 0  # steps an urgent request waited, outside the step, for its adapter's read
        self.preemptions = 0
        #: a unified memory's reclaim (``AdapterCache.yield_to_kv``): ``kv_reclaim(blocks)`` frees up to that many
        #: KV blocks from the adapter pool (idle adapters evicted); None: the KV cache has a fixed size
        self.kv_reclaim: Callable[[int], int] | None = None
        self.kv_reclaims = 0  # times KV blocks were taken back from the adapter pool
        self.max_seq_len: int | None = None  # caps a request's length in ``kv_reserve_blocks`` (the engine sets it)

    def add(self, req: Request) -> None:
        """Queue a request (at the back)."""
        if req.handle is not None:
            self.cache.enqueue(req.handle)
        req.queued_time = req.arrival
        self.waiting.append(req)
        self._live[req.request_id] = req

    def get(self, request_id: int) -> Request | None:
        """The unfinished request of that id (waiting or running), or None."""
        return self._live.get(request_id)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> Schedule:
        """Pick the next step (module docstring): without chunking, a prefill of the requests that can be admitted
        now, else a decode of the running requests after making room for one more token of each (preempting the
        newest if needed); with chunking, one step of decode tokens and prompt chunks. Sets ``Request.chunk`` of
        every running request (0: not in this step). When nothing runs and nothing can be admitted (the pool is
        full of pinned adapters), the waiting requests fail."""
        for req in self.running:
            req.chunk = 0
            n = len(req.prompt_ids) + len(req.output_ids) + req.pending
            if req.computed >= n:  # its step ran, its token was not taken (an interrupt): the last position
                req.computed = n - 1  # again gives the logits
        if not self.chunked:
            for req in [r for r in self.running if r.num_tokens == r.admitted_tokens]:
                self._preempt(req, count=False)  # its prefill step was interrupted: it has no token to decode from
        if self.recompute_after:
            L = self.recompute_after
            for req in [r for r in self.running if r.admitted_tokens <= L < r.num_tokens]:
                self._preempt(req, count=False)  # its next step passes L: recomputed whole (``recompute_after``)
        failed: list[Request] = []
        if self.chunked:
            sched = self._schedule_chunked(failed)
        else:
            admitted = self._admit(failed)
            for req in admitted:
                req.computed, req.chunk = 0, req.num_tokens
            if admitted:
                return Schedule("prefill", admitted, failed, list(admitted), len(admitted))
            sched = None
            if self.running:
                self._reserve_decode()
                for req in self.running:
                    req.computed, req.chunk = len(req.prompt_ids) + len(req.output_ids) + req.pending - 1, 1
                sched = Schedule("decode", list(self.running), failed, list(self.running))
        if sched is not None:
            return sched
        while self.waiting:
            req = self.waiting[0]
            self._fail(req, "request cannot be scheduled: its adapter does not fit in the adapter pool", failed)
        return Schedule(None, [], failed)

    def _schedule_chunked(self, failed: list[Request]) -> Schedule | None:
        """One chunked step: a token for every decoding request (room for it reserved first, preempting the newest
        while blocks run short), then the prompt room filled with chunks of the running prefills (admission order),
        then newly admitted requests' first chunks. None: nothing to run."""
        decoding = sum(r.computed >= r.admitted_tokens for r in self.running)  # (not r.prefilling: inlined, hot)
        preempted = False
        if decoding:
            before = self.preemptions
            self._reserve_decode()
            preempted = self.preemptions > before
            decoding = sum(r.computed >= r.admitted_tokens for r in self.running)
        room = self.prompt_room(decoding)
        first = True
        batch: list[Request] = []
        sampling: list[Request] = []
        for req in self.running:
            if req.computed >= req.admitted_tokens:  # decoding: its one newest token, sampled
                req.chunk = 1
                batch.append(req)
                sampling.append(req)
            elif room > 0:
                req.chunk = n = self._chunk(req, room, first)
                if n:
                    room -= n
                    first = False
                    batch.append(req)
                    if req.computed + n == len(req.prompt_ids) + len(req.output_ids) + req.pending:
                        sampling.append(req)
        if not preempted and room > 0:  # a request preempted now would be admitted again at once: wait a step
            for req in self._admit(failed, room=room, first=first):
                batch.append(req)
                if req.chunk == req.num_tokens:
                    sampling.append(req)
        if not batch:
            return None
        prefills = len(batch) - decoding
        kind = "prefill" if decoding == 0 else "decode" if prefills == 0 else "mixed"
        return Schedule(kind, batch, failed, sampling, prefills)

    def prompt_room(self, decoding: int) -> int:
        """Prompt tokens a chunked step may compute beside ``decoding`` decode tokens: the budget's rest, at most
        ``max_prefill_tokens``, at least 1 (prefills progress even when decode tokens fill the budget)."""
        return min(self.max_prefill_tokens, max(1, self.max_num_batched_tokens - decoding))

    def _chunk(self, req: Request, room: int, first: bool) -> int:
        """Tokens of ``req``'s prefill this step: up to ``room``. With ``recompute_after`` = L, a request longer than
        L takes its first chunk past L (L + 1 tokens, as the step's first prompt chunk, even over the room, or not
        yet): RoPE's long factors are chosen by the sequence's length after the step, and every key of a sequence
        longer than L must carry them (``DecoderModel._rope_rows``)."""
        left = req.num_tokens - req.computed
        n = min(left, room)
        L = self.recompute_after
        if L and req.computed == 0 and L < req.num_tokens and n <= L:
            n = min(left, L + 1) if first else 0
        return n

    def advance(self, batch: list[Request]) -> tuple[int, int]:
        """Record that a step computed each request's chunk (call after its forward, before sampling). Returns
        (prompt positions computed for the first time, positions computed again: after a preemption, a
        ``recompute_after`` recompute or an interrupted step)."""
        new = again = 0
        for req in batch:
            a, m = req.computed, req.max_computed
            b = a + req.chunk
            p = len(req.prompt_ids)
            if a < m:
                again += (b if b < m else m) - a
                a = m
            if a < p and a < b:
                new += (b if b < p else p) - a
            if b > m:
                req.max_computed = b
            req.computed, req.chunk = b, 0
        return new, again

    def _reserve_decode(self) -> None:
        """Give every running request room for its next token, oldest first; preempt the newest while
        blocks run short. The oldest alone always fits (checked at submission), so one always stays."""
        pending = deque(self.running)
        bs = self.kv.block_size
        while pending:
            req = pending.popleft()
            n = req.num_tokens
            if n <= req.kv_tokens:
                continue  # its blocks already hold position n - 1: ensure_capacity would change nothing
            while not self.kv.ensure_capacity(req.seq_id, n):
                if self._kv_room(self.kv.blocks_for_tokens(n) - req.kv_tokens // bs):
                    continue  # the adapter pool gave blocks back
                victim = pending.pop() if pending else req
                self._preempt(victim)
                if victim is req:
                    break
            else:  # it holds max(what it had, the blocks for n tokens) now
                req.kv_tokens = max(req.kv_tokens, -(-n // bs) * bs)
        assert self.running, "decode step without a running request"

    def _preempt(self, req: Request, *, count: bool = True) -> None:
        """Take a running request's blocks and adapter reference back; it waits at the front of the queue
        (``count=False``: a request whose prefill step was interrupted goes back without counting a preemption)."""
        self.kv.free_seq(req.seq_id)
        req.kv_tokens = req.computed = req.chunk = 0
        if req.handle is not None:
            self.cache.enqueue(req.handle)  # first: a retired version keeps its host copy for it
            self.cache.release(req.handle)
        self.running.remove(req)
        req.slot, req.status = -1, Status.WAITING
        req.queued_time = time.perf_counter()
        if count:
            req.preemptions += 1
            self.preemptions += 1
        self.waiting.appendleft(req)

    def _admit(self, failed: list[Request], *, room: int | None = None, first: bool = True) -> list[Request]:
        """Admit waiting requests in order while the budgets allow (module docstring): without chunking (``room``
        None) whole prompts under ``max_prefill_tokens``; with chunking, each admitted request's first chunk
        (``Request.chunk``) taken from ``room`` prompt tokens (``first``: no prompt chunk in the step yet). Every
        request is, at every point, either in ``waiting`` or in ``running`` with its resources, so an exception (an
        interrupt) in the middle leaves the scheduler consistent."""
        admitted: list[Request] = []
        tokens, i = 0, 0
        while i < len(self.waiting) and len(self.running) < self.max_batch_size and (room is None or room > 0):
            req = self.waiting[i]
            n = req.num_tokens  # a preempted request recomputes its generated tokens too
            if room is None:
                if admitted and tokens + n > self.max_prefill_tokens:
                    break
                chunk = n
            else:
                chunk = self._chunk(req, room, first and not admitted)
                if chunk == 0:
                    break  # the head waits for prompt room; nothing behind it is admitted
            if not self.kv.can_fit(req.kv_need) and not self._kv_room(self.kv.blocks_for_tokens(req.kv_need)):
                break  # the head waits for blocks; nothing behind it is admitted
            if req.handle is not None and req.slot < 0:  # (a slot kept from an interrupted admission is reused)
                if (self.adapter_aware and self.running and req.handle.tier == "disk"
                        and not req.handle.prefetch_failed and self.cache.can_prefetch_to_host(req.handle)):
                    if req.skipped_steps < self.patience:
                        self.adapter_defers += 1  # acquire would read its files in this step: let prefetch do it
                        i += 1
                        continue
                    if (URGENT_READ_WAIT and req.skipped_steps < 2 * self.patience
                            and self.cache.reading(req.handle)):
                        # urgent, and its read is in flight: acquire would wait for it inside this step, with every
                        # running request. Admit it in the first step after the read lands (at most ``patience``
                        # steps more: then as before); nobody behind it before
                        self.adapter_read_waits += 1
                        break
                if not self.cache.could_ever_fit(req.handle):
                    pool = self.cache.pool
                    n_pinned, pinned_bytes = self.cache.pinned(exclude=req.handle)
                    self._fail(req, f"adapter {req.adapter_name!r} needs {req.handle.pool_bytes} bytes and a slot: "
                                    f"more than the adapter pool holds besides pinned adapters ({pool.bytes_capacity} "
                                    f"bytes, {pool.max_slots} slot(s), {n_pinned} pinned adapter(s) holding "
                                    f"{pinned_bytes} bytes; "
                                    + ("unpin some (Engine.pin_adapter(name, False)) or " if n_pinned else "")
                                    + "raise adapter_pool_bytes or adapter_slots)", failed)
                    continue
                try:
                    req.slot = self.cache.acquire(req.handle)
                except PoolFullError:
                    self.adapter_waits += 1  # it waits for running requests to release pool bytes
                    i += 1
                    if req.skipped_steps >= self.patience:
                        break  # urgent: admit nobody behind it
                    continue
                except Exception as e:  # e.g. its files changed on disk: fail this request only
                    self._fail(req, f"{type(e).__name__}: {e}", failed)
                    continue
            req.kv_tokens = len(self.kv.allocate_seq(req.seq_id, req.kv_need)) * self.kv.block_size  # fits: checked above
            del self.waiting[i]
            req.status, req.admitted_tokens = Status.RUNNING, n
            req.computed, req.chunk = 0, chunk
            if room is not None:
                room -= chunk
            self.running.append(req)
            if req.handle is not None:
                self.cache.dequeue(req.handle)
            now = time.perf_counter()
            if req.admit_time is None:
                req.admit_time = now
            wait = now - (req.queued_time if req.queued_time is not None else req.arrival)
            if req.first_token_time is None:  # (a preemption before the first token sends it back to wait again)
                req.time_in_queue += wait
            self.wait_seconds_total += wait
            self.wait_seconds_max = max(self.wait_seconds_max, wait)
            self.admitted_total += 1
            admitted.append(req)
            tokens += n
        for req in self.waiting:
            req.skipped_steps += 1
        return admitted

    def kv_reserve_blocks(self) -> int:
        """KV blocks a unified memory's adapter pool must leave free (``multilora.memory.unified``): what the running
        requests still need to reach their whole length (prompt + ``max_tokens``, at most ``max_seq_len``), plus the
        whole length of the waiting requests that could join them (the first ``max_batch_size - running``). So the
        pool grows only into KV memory no request in sight will ask for, and admission and decode rarely have to
        take blocks back from it (``_kv_room``)."""
        kv, cap = self.kv, self.max_seq_len or (1 << 62)

        def whole(req: Request) -> int:
            return kv.blocks_for_tokens(min(len(req.prompt_ids) + req.params.max_tokens, cap))

        try:  # (``pin_adapter`` may ask from another thread while the engine's thread changes the queues)
            running = list(self.running)
            room = max(0, self.max_batch_size - len(running))
            waiting = [self.waiting[i] for i in range(min(room, len(self.waiting)))]
        except (IndexError, RuntimeError):
            return kv.num_usable_blocks  # unknown just now: lend the pool nothing
        return sum(max(0, whole(r) - r.kv_tokens // kv.block_size) for r in running) + sum(map(whole, waiting))

    def _kv_room(self, blocks: int) -> bool:
        """Whether ``blocks`` KV blocks are free, after asking a unified memory's adapter pool for the ones missing
        (and for the reserve of ``kv_reserve_blocks``, so the next requests do not ask again at once)."""
        free = self.kv.num_free_blocks
        if free >= blocks:
            return True
        if self.kv_reclaim is None:
            return False
        want = max(blocks, self.kv_reserve_blocks()) - free
        if self.kv_reclaim(want) > 0:
            self.kv_reclaims += 1
        return self.kv.num_free_blocks >= blocks

    def _fail(self, req: Request, message: str, failed: list[Request]) -> None:
        self.finish(req, "error", message)
        failed.append(req)

    def report(self) -> dict:
        """The scheduler's part of ``Engine.stats()``: queue waits, KV blocks (``kv_blocks_total`` excludes the
        reserved null block), preemptions, waiting and running requests, and the distinct adapter names of the
        running and of the waiting requests (``running_adapters``, ``waiting_adapters``: sorted; what an
        adapter-aware router reads). Key names are a contract."""
        running, waiting = list(self.running), list(self.waiting)  # snapshots: another thread may be stepping
        return {
            "queue_wait_seconds_total": self.wait_seconds_total, "queue_wait_seconds_max": self.wait_seconds_max,
            "queue_waits_for_adapter": self.adapter_waits, "queue_defers_for_adapter_load": self.adapter_defers,
            "queue_urgent_waits_for_adapter_read": self.adapter_read_waits, "kv_blocks_total": self.kv.num_usable_blocks,
            "kv_blocks_free": self.kv.num_free_blocks, "kv_block_size": self.kv.block_size,
            "preemptions": self.preemptions, "kv_reclaims_from_pool": self.kv_reclaims,
            "waiting": len(waiting), "running": len(running),
            "running_adapters": sorted({r.adapter_name for r in running if r.adapter_name is not None}),
            "waiting_adapters": sorted({r.adapter_name for r in waiting if r.adapter_name is not None}),
        }

    def waiting_handles(self) -> set[int]:
        """ids of the adapter handles of all waiting requests (prefetch never evicts these)."""
        return {id(r.handle) for r in self.waiting if r.handle is not None}

    def prefetch_candidates(self, limit: int) -> list[AdapterHandle]:
        """Distinct adapters of waiting requests that are not resident, in queue order, until ``limit`` of them need a
        move started (an adapter already on its way up, its disk read in flight, does not count against ``limit``:
        so the look-ahead reaches further down the queue while reads are slower than admissions), and at most
        ``8 * limit`` in all (the cache's per-step prefetch work stays bounded); with adapter-aware admission, none
        past an urgent request whose adapter is on the disk tier (module docstring)."""
        out: list[AdapterHandle] = []
        seen: set[int] = set()
        starting = 0
        for req in self.waiting:
            h = req.handle
            if h is None or h.slot is not None:
                continue
            if id(h) not in seen:
                seen.add(id(h))
                out.append(h)
                if getattr(h, "loading", None) is None and self.cache.can_prefetch_to_host(h):
                    starting += 1  # (an image no host tier holds is read on demand: no prefetch to start)
                if starting >= limit or len(out) >= 8 * limit:
                    break
            if (URGENT_READ_WAIT and self.adapter_aware and req.skipped_steps >= self.patience and h.tier == "disk"
                    and self.cache.can_prefetch_to_host(h)):
                break  # urgent, its adapter still to be read: nothing behind it is admitted first (module docstring)
        return out

    def finish(self, req: Request, reason: str, error: str | None = None) -> None:
        """Mark a request finished and return its KV blocks and adapter reference."""
        if req.status is Status.FINISHED:
            return
        was_waiting = req.status is Status.WAITING
        req.status, req.finish_reason, req.error = Status.FINISHED, reason, error
        self._live.pop(req.request_id, None)
        req.finish_time = time.perf_counter()
        if self.kv.has_seq(req.seq_id):
            self.kv.free_seq(req.seq_id)
        req.kv_tokens = 0
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
