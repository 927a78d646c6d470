"""After a step's forward: sample each request's next token, check its stop conditions, and build outputs.

A step's logits (float32 ``[B, vocab]`` on the device, row ``i`` for ``batch[i]``) are sampled in one batched
draw (``multilora.runtime.sampling``); the only host sync of a step is reading the new ids back. A request
ends with "stop" at an end-of-sequence token (unless ``ignore_eos``; the token is not kept) or when its text
contains a stop string (the text is cut before it), and with "length" at ``max_tokens`` or ``max_seq_len``
tokens. One request's failure fails that request only, with reason "error" and a message: logits that are not
finite (an adapter whose weights overflow in compute), a draw that fails (each request is then drawn alone), a
stop check that raises. A ``logits_only`` request (``Engine.logits``) keeps its row of logits and finishes
without sampling.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable

import torch

from multilora.runtime.sampling import SamplingTensors, row_max, sample_batch
from multilora.runtime.scheduler import Request, Status
from multilora.runtime.tokenizer import Prompt, PromptTokenizer

log = logging.getLogger("multilora")


@dataclass
class RequestOutput:
    """The result of one request.

    Attributes:
        prompt: what was given (text, chat messages or token ids).
        adapter: the adapter name, or None for the base model.
        text: the completion (special tokens removed, cut before a stop string).
        token_ids: generated token ids (the end-of-sequence token, when hit, is not included).
        prompt_token_ids: the prompt after tokenization (and chat templating).
        finish_reason: "stop" (end-of-sequence or a stop string), "length" (max_tokens or the
            engine's max_seq_len), "abort" (``Engine.abort``), or "error" (see ``error``; other requests are
            unaffected).
        arrival_time, first_token_time, finish_time: ``time.perf_counter()`` seconds when the request was
            submitted, got its first token (None if it got none) and finished: TTFT, TPOT and end-to-end time.
        admit_time: ``time.perf_counter()`` seconds of its first admission into a step (None if never admitted).
        time_in_queue: seconds it waited in the queue before its first token (for its adapter, KV room or its turn),
            summed over its admissions: a request preempted before its first token waits again. So TTFT =
            ``time_in_queue`` + its prefill (``first_token_time - arrival_time - time_in_queue``: the steps that
            computed its prompt, in chunks beside other requests).
        preemptions: times it was preempted (its KV taken back, its prompt and tokens recomputed later).
        adapter_tier: its adapter's tier when it was submitted: "gpu" (resident), "host", "disk", or None (the base
            model): whether its adapter had to be read or copied first.
    """

    request_id: int
    prompt: Prompt
    adapter: str | None
    text: str
    token_ids: list[int]
    prompt_token_ids: list[int]
    finish_reason: str
    error: str | None = None
    arrival_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    admit_time: float | None = None
    time_in_queue: float | None = None
    preemptions: int = 0
    adapter_tier: str | None = None


def draw_tokens(batch: list[Request], logits: torch.Tensor) -> torch.Tensor:
    """One batched draw on the logits' device, without a host sync (``multilora.runtime.sampling``): int64 [B], the
    next token of each request, or -1 for a row whose logits are not finite (a NaN, an inf, or every entry -inf: no
    token can be drawn). The row maxima that tell this are the greedy path's own reduction. Request ``r`` draws its
    token number ``len(r.output_ids) + r.pending`` (its tokens not yet read back come before it).

    Raises:
        ValueError: a row's sampling parameters cannot be packed (``SamplingTensors.from_params``).
    """
    params = [r.params for r in batch]
    with torch.inference_mode():
        top, ids = row_max(logits.float())  # the greedy tokens (first of ties, as argmax) and each row's max
        if not all(p.greedy for p in params):
            t = SamplingTensors.from_params(params, [r.seed for r in batch],
                                            [len(r.output_ids) + r.pending for r in batch], logits.device)
            ids = sample_batch(logits, t)
        return torch.where(torch.isfinite(top), ids, -1)


def sample_tokens(batch: list[Request], logits: torch.Tensor) -> list[int | None]:
    """``draw_tokens`` read back to the host (the step's only host sync): each request's next token, or None for a
    row whose logits are not finite."""
    return [t if t >= 0 else None for t in draw_tokens(batch, logits).tolist()]


class Postprocessor:
    """Turns a step's logits into tokens, finished requests and outputs.

    Args:
        tokenizer: decodes generated ids (stop strings, output text); its ``eos_ids`` end requests.
        max_seq_len: the engine's most tokens per request.
        counters: the engine's counters (``generated_tokens``, ``requests_finished``, ``requests_failed`` are
            updated here).
        finish: ``finish(request, reason, error)`` returns a request's KV blocks and adapter (the scheduler's).
    """

    def __init__(self, tokenizer: PromptTokenizer, *, max_seq_len: int, counters: dict[str, int],
                 finish: Callable[[Request, str, str | None], None]) -> None:
        self.tokenizer = tokenizer
        self.max_seq_len = max_seq_len
        self.counters = counters
        self._finish = finish

    def __call__(self, batch: list[Request], logits: torch.Tensor) -> list[Request]:
        """Sample, append and check each request of ``batch`` (row ``i`` of ``logits`` for ``batch[i]``: the step's
        ``Schedule.sampling``); return the requests that finished."""
        finished = []
        if not batch:  # a chunked step whose prompt chunks all stop short of their last token
            return finished
        scored = [i for i, r in enumerate(batch) if r.logits_only]
        if scored:  # Engine.logits: keep the rows, sample nothing
            rows = logits[scored].float().cpu()
            for k, i in enumerate(scored):
                batch[i].logits = rows[k]
                self.finish(batch[i], "length")
                finished.append(batch[i])
            keep = [i for i, r in enumerate(batch) if not r.logits_only]
            if not keep:
                return finished
            batch, logits = [batch[i] for i in keep], logits[keep]
        return finished + self.take(batch, self._sample(batch, logits))

    def take(self, batch: list[Request], tokens: list[int | None | Exception]) -> list[Request]:
        """Append each request's drawn token (``tokens[i]`` for ``batch[i]``: an id, None for logits that were not
        finite, or the exception its draw raised) and check its stop conditions; return the requests that finished.
        A request that finished meanwhile (an abort, or a stop found one step behind: ``EngineConfig.
        async_scheduling``) is passed over: its token is dropped."""
        finished = []
        now = time.perf_counter()
        for req, tok in zip(batch, tokens):
            if req.status is Status.FINISHED:
                continue
            try:
                if isinstance(tok, Exception):
                    raise tok
                if tok is None:
                    path = getattr(req.handle, "path", None)  # (the adapter's directory: whose weights to look at)
                    who = (f"adapter {req.adapter_name!r}" + (f" (from {path})" if path is not None else "")
                           if req.adapter_name else "the base model")
                    raise FloatingPointError(f"the logits of this request are not finite (NaN or inf) with {who}: its "
                                             f"weights overflow in compute, so no token can be drawn")
                if req.first_token_time is None:
                    req.first_token_time = now
                reason = self.check_stop(req, tok)
            except Exception as e:  # one request's failure never affects the others
                if not isinstance(e, FloatingPointError):
                    log.exception("request %d failed", req.request_id)
                reason, req.error = "error", f"{type(e).__name__}: {e}"
            if reason is not None:
                self.finish(req, reason, req.error)
                finished.append(req)
        return finished

    @staticmethod
    def _sample(batch: list[Request], logits: torch.Tensor) -> list[int | None | Exception]:
        """``sample_tokens`` for the batch; if the batched draw fails, each request is drawn alone, so one
        request's parameters can fail that request only."""
        try:
            return sample_tokens(batch, logits)
        except Exception:
            log.exception("batched sampling failed; sampling each request alone")
        out: list[int | None | Exception] = []
        for i, req in enumerate(batch):
            try:
                out.extend(sample_tokens([req], logits[i : i + 1]))
            except Exception as e:
                out.append(e)
        return out

    def finish(self, req: Request, reason: str, error: str | None = None) -> None:
        """End a request (its resources go back) and count it."""
        self._finish(req, reason, error)
        self.counters["requests_finished" if reason != "error" else "requests_failed"] += 1

    def check_stop(self, req: Request, tok: int) -> str | None:
        """Append ``tok`` to the request unless it ends it; the finish reason, or None to continue."""
        p = req.params
        if tok in self.tokenizer.eos_ids and not p.ignore_eos:
            req.text = self.tokenizer.decode(req.output_ids)
            return "stop"
        req.output_ids.append(tok)
        self.counters["generated_tokens"] += 1
        if p.stop:
            text = self.tokenizer.decode(req.output_ids)
            cut = min((i for i in (text.find(s) for s in p.stop) if i >= 0), default=-1)
            if cut >= 0:
                req.text = text[:cut]
                return "stop"
        if len(req.output_ids) >= p.max_tokens or len(req.prompt_ids) + len(req.output_ids) >= self.max_seq_len:
            req.text = self.tokenizer.decode(req.output_ids)
            return "length"
        return None

    def output(self, r: Request) -> RequestOutput:
        """The caller's view of a finished request."""
        if r.finish_reason in ("error", "abort") and not r.text:
            r.text = self.tokenizer.decode(r.output_ids)
        return RequestOutput(request_id=r.request_id, prompt=r.prompt, adapter=r.adapter_name, text=r.text,
                             token_ids=list(r.output_ids), prompt_token_ids=list(r.prompt_ids),
                             finish_reason=r.finish_reason or "error", error=r.error, arrival_time=r.arrival,
                             first_token_time=r.first_token_time, finish_time=r.finish_time,
                             admit_time=r.admit_time, time_in_queue=r.time_in_queue if r.admit_time is not None
                             else None, preemptions=r.preemptions, adapter_tier=r.adapter_tier)
