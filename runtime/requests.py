"""Requests from what callers give: every prompt, sampling value, length and adapter name checked before anything
is queued, then made into the scheduler's ``Request`` (``runtime.scheduler``).

A check that fails raises at once (``ValueError`` naming the field, ``UnknownAdapterError`` for a name that is not
loaded), so a call of several prompts can be refused whole with nothing run (the README's "Errors" section).
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any, Sequence

from multilora.memory.kv_cache import PagedKVCache
from multilora.runtime.adapter_cache import AdapterCache
from multilora.runtime.sampling import SamplingParams, make_seed
from multilora.runtime.scheduler import Request, next_request_id
from multilora.runtime.tokenizer import Prompt, PromptTokenizer


def as_request_id(request_id: Any) -> int:
    """A request's id from what a caller holds: the id (an int, numpy's and torch's integers too), or an object with a
    ``request_id`` (the ``Request`` that ``Engine.add_request`` returns, an ``EngineLoop`` stream).

    Raises:
        TypeError: anything else (a str id, a bool, a float: each matched nothing before, silently).
    """
    rid = getattr(request_id, "request_id", request_id)
    if not isinstance(rid, (bool, str, bytes, float)):
        try:
            return operator.index(rid)
        except TypeError:
            pass
    raise TypeError(f"abort: request_id: expected an int (a Request's request_id) or the Request that add_request "
                    f"returned, got {type(request_id).__name__} {request_id!r}")


def per_row(value: Any, n: int, name: str, what: str) -> list:
    """``value`` as one entry per row: a list/tuple of ``n`` entries, or one value for all.
    Raises ValueError for a list of another length."""
    out = list(value) if isinstance(value, (list, tuple)) else [value] * n
    if len(out) != n:
        raise ValueError(f"{name}: expected {n} {'entry' if n == 1 else 'entries'} (one per {what}), got {len(out)}")
    return out


def check_flag(name: str, value: Any) -> None:
    """Raise ValueError unless ``value`` is a bool: a flag given as ``"false"`` or ``"no"`` would be true (for
    ``allow_pickle``, unpickling turned on by the string that was meant to refuse it)."""
    if not isinstance(value, bool):
        raise ValueError(f"{name}: expected a bool, got {type(value).__name__} {value!r}")


def check_adapter_arg(name: str, value: Any, *, none: bool = False) -> None:
    """Raise ValueError unless ``value`` is an adapter name (a str; or None where ``none``), so a wrong type is
    named as such rather than reported as an adapter that "is not loaded"."""
    if not (isinstance(value, str) or (none and value is None)):
        raise ValueError(f"{name}: expected an adapter name (str){' or None' if none else ''}, got "
                         f"{type(value).__name__} {value!r}"[:300])


def check_room(prompt_tokens: int, max_seq_len: int) -> None:
    """Raise ValueError when a prompt of ``prompt_tokens`` leaves no room to generate within ``max_seq_len``."""
    if prompt_tokens >= max_seq_len:
        raise ValueError(f"prompt: {prompt_tokens} tokens leave no room to generate within max_seq_len={max_seq_len} "
                         f"(a longer prompt needs a larger max_seq_len: Engine(max_seq_len=...), --max-seq-len)")


def check_submission(count: int, max_waiting_requests: int) -> None:
    """Raise ValueError when ``count`` requests to be queued together (a server request's list of prompts) are more
    than the waiting queue ever holds (``max_waiting_requests``): a permanent refusal, unlike the "retry later" of
    ``EngineOverloadedError``."""
    if count > max_waiting_requests:
        raise ValueError(f"prompt: a list of {count:,} prompts is more than the engine queues at once "
                         f"(max_waiting_requests={max_waiting_requests:,}): send at most {max_waiting_requests:,} "
                         f"prompts per request")


class RequestFactory:
    """Makes the engine's requests.

    Args:
        tokenizer: encodes prompts (and says whether stop strings can be matched).
        cache: the adapter cache (a name -> its current version's handle).
        kv: the KV cache (a request that could never fit it is refused).
        max_seq_len: most tokens per request.
    """

    def __init__(self, tokenizer: PromptTokenizer, cache: AdapterCache, kv: PagedKVCache, *, max_seq_len: int) -> None:
        self.tokenizer, self.cache, self.kv, self.max_seq_len = tokenizer, cache, kv, max_seq_len

    def generation(self, prompt: Prompt, adapter: str | None, sampling: SamplingParams | None) -> Request:
        """A generation request (``Engine.add_request``'s checks).

        Raises:
            ValueError: a bad prompt or sampling value, a prompt that leaves no room to generate within
                ``max_seq_len``, a prompt + ``max_tokens`` past ``max_seq_len`` when ``max_tokens_must_fit``
                (else it is capped there), or a request whose whole length (``min(prompt + max_tokens,
                max_seq_len)`` tokens) needs more KV blocks than the whole cache has.
            UnknownAdapterError (a KeyError): ``adapter`` is not loaded.
        """
        params = sampling or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling: expected SamplingParams, got {type(params).__name__}")
        params.check()  # again: a field may have been changed since construction
        if params.stop and not self.tokenizer.has_text:
            raise ValueError(f"sampling.stop: {self.tokenizer.source} has no tokenizer, so stop strings cannot be "
                             f"matched")
        ids = self.tokenizer.encode(prompt, self.max_seq_len)
        check_room(len(ids), self.max_seq_len)
        kv = self.kv
        if kv.blocks_for_tokens(len(ids) + 1) > kv.max_usable_blocks:  # the prompt alone: no max_tokens would do
            raise ValueError(
                f"prompt: {len(ids)} tokens and one generated need {kv.blocks_for_tokens(len(ids) + 1)} KV blocks "
                f"of {kv.block_size} tokens; the whole KV cache has {kv.max_usable_blocks}: shorten the prompt "
                f"or {kv.size_hint}")
        if params.max_tokens_must_fit and len(ids) + params.max_tokens > self.max_seq_len:
            raise ValueError(f"max_tokens: {len(ids)} prompt tokens + max_tokens={params.max_tokens} = "
                             f"{len(ids) + params.max_tokens} tokens exceed the model's context of max_seq_len="
                             f"{self.max_seq_len}: ask for at most {self.max_seq_len - len(ids)} "
                             f"token{'s' if self.max_seq_len - len(ids) != 1 else ''} or shorten the prompt")
        total = min(len(ids) + params.max_tokens, self.max_seq_len)
        if kv.blocks_for_tokens(total) > kv.max_usable_blocks:
            room = kv.max_usable_blocks * kv.block_size - len(ids)  # what the cache holds past the prompt (>= 1)
            if params.max_tokens_fit_kv:  # a default: capped at what the cache holds
                params = dataclasses.replace(params, max_tokens=room)
            else:
                raise ValueError(
                    f"{'max_tokens' if params.max_tokens_must_fit else 'request'}: {len(ids)} prompt tokens + "
                    f"max_tokens={params.max_tokens} (at most max_seq_len={self.max_seq_len}) = {total} tokens need "
                    f"{kv.blocks_for_tokens(total)} KV blocks of {kv.block_size} tokens; the whole KV cache has "
                    f"{kv.max_usable_blocks}: lower max_tokens, shorten the prompt or {kv.size_hint}")
        check_adapter_arg("adapters", adapter, none=True)
        handle = self.cache.get(adapter) if adapter is not None else None
        return Request(request_id=next_request_id(), prompt=prompt, prompt_ids=ids, adapter_name=adapter,
                       handle=handle, params=params, seed=make_seed(params),
                       adapter_tier=handle.tier if handle is not None else None)

    def logits_rows(self, token_ids: Sequence[Sequence[int]], adapters: Any) -> list[Request]:
        """One ``logits_only`` request per row of token ids (``Engine.logits``'s checks), each with its
        ``adapter_name`` and no ``handle`` yet: the caller looks the adapters up under the step lock, where it queues
        the rows (an unload between the two would drop the host copies the rows are to hold).

        Raises:
            ValueError: empty rows, ids out of range, a row longer than ``max_seq_len`` or than the KV cache holds,
                mismatched lengths.
        """
        vocab, kv = self.tokenizer.vocab_size, self.kv
        if getattr(token_ids, "ndim", None) == 2 and hasattr(token_ids, "tolist"):  # a 2-D tensor / array: its rows
            token_ids = list(token_ids)
        if isinstance(token_ids, (str, bytes)) or not isinstance(token_ids, Sequence):
            raise ValueError(f"token_ids: expected a list of rows of token ids (one row per prompt), got "
                             f"{type(token_ids).__name__}")
        rows = []
        for i, r in enumerate(token_ids):
            if hasattr(r, "tolist") and not isinstance(r, (str, bytes)):  # a 1-D torch tensor or numpy array
                r = r.tolist()
            if isinstance(r, (str, bytes)) or not isinstance(r, Sequence):
                raise ValueError(f"token_ids[{i}]: expected a list of token ids (ints in [0, {vocab})), got "
                                 f"{type(r).__name__}{' ' + repr(r[:40]) if isinstance(r, (str, bytes)) else ''}")
            rows.append(list(r))
        names = per_row(adapters, len(rows), "adapters", "row")
        for i, a in enumerate(names):
            check_adapter_arg(f"adapters[{i}]" if isinstance(adapters, (list, tuple)) else "adapters", a, none=True)
        for i, r in enumerate(rows):
            if not r or len(r) > self.max_seq_len:
                raise ValueError(f"token_ids[{i}]: expected 1..{self.max_seq_len} tokens, got {len(r)}")
            bad = next((j for j, t in enumerate(r) if isinstance(t, bool) or not isinstance(t, int)
                        or not 0 <= t < vocab), None)
            if bad is not None:
                raise ValueError(f"token_ids[{i}][{bad}]: expected an int in [0, {vocab}), got {r[bad]!r}")
            if kv.blocks_for_tokens(len(r)) > kv.max_usable_blocks:
                raise ValueError(f"token_ids[{i}]: {len(r)} tokens need {kv.blocks_for_tokens(len(r))} KV blocks; "
                                 f"the whole KV cache has {kv.max_usable_blocks}")
        return [Request(request_id=next_request_id(), prompt=r, prompt_ids=r, adapter_name=a, handle=None,
                        params=SamplingParams(max_tokens=1), seed=0, logits_only=True)
                for r, a in zip(rows, names)]
