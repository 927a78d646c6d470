"""The OpenAI-compatible request and response bodies of ``multilora serve`` (``runtime.server``).

Requests are pydantic models in strict mode (a string where a number belongs is a 400 naming the field, never a
coercion). Fields we implement are declared; parameters we know and do not implement are listed in
``COMPLETION_UNSUPPORTED`` / ``CHAT_UNSUPPORTED`` with the values that mean "off" (any other value is a 400 naming
it); other unknown fields are ignored with a warning, as vLLM does. Responses are plain dicts in OpenAI's shapes
(``text_completion``, ``chat.completion``, ``chat.completion.chunk``); errors are
``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import json
import logging
import re
import time
import uuid
from typing import Any

from pydantic import BaseModel, ConfigDict, field_validator

from multilora.runtime.sampling import SamplingParams
from multilora.runtime.tokenizer import CHAT_ROLES

log = logging.getLogger("multilora.server")

#: The OpenAI error ``type`` of each status we answer with (OpenAI's API answers an unknown model, 404
#: ``model_not_found``, with ``invalid_request_error``, as it does every 4xx but 401, 403 and 429).
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "invalid_request_error", 405: "invalid_request_error",
               409: "invalid_request_error", 429: "rate_limit_error", 500: "server_error",
               503: "service_unavailable_error"}


class APIError(Exception):
    """An error answered as ``{"error": {...}}`` with an HTTP status."""

    def __init__(self, status: int, message: str, *, code: str | None = None, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param
        self.headers = headers  # extra response headers (e.g. Retry-After of a 429)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": ERROR_TYPES.get(self.status, "server_error"),
                          "param": self.param, "code": self.code}}


# ------------------------------------------------------------------------------------------------- requests
class _Body(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)


def _null_is_false(value: Any) -> Any:
    """``null`` for a boolean that OpenAI's API types nullable (``stream``, ``stream_options.include_usage``, ...):
    its default, false."""
    return False if value is None else value


class StreamOptions(_Body):
    include_usage: bool = False  # a last chunk with the usage (OpenAI)
    continuous_usage_stats: bool = False  # vLLM's usage in every chunk: not supported (400 when true)

    _nullable = field_validator("include_usage", "continuous_usage_stats", mode="before")(_null_is_false)


class _Generate(_Body):
    """The fields both generation routes share."""

    model: str
    max_tokens: int | None = None
    temperature: float | None = None  # default 1.0, as OpenAI
    top_p: float | None = None
    top_k: int | None = None  # vLLM's extension; -1 or 0 = off
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # vLLM's extension
    user: str | None = None  # accepted, unused

    _nullable = field_validator("stream", "ignore_eos", mode="before")(_null_is_false)


class CompletionRequest(_Generate):
    prompt: str | list[int] | list[str] | list[list[int]]


class ContentPart(_Body):
    type: str
    text: str | None = None


class ChatMessage(_Body):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ChatCompletionRequest(_Generate):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens (wins when both are given)


class LoadLoRARequest(_Body):
    lora_name: str
    lora_path: str
    load_inplace: bool = False  # vLLM: replace an adapter of that name instead of refusing

    _nullable = field_validator("load_inplace", mode="before")(_null_is_false)


class UnloadLoRARequest(_Body):
    lora_name: str


#: Known parameters we do not implement: name -> the values accepted because they mean "off" (null always is;
#: ``tool_choice="auto"`` too, which some clients always send: with no tools it calls none).
_UNSUPPORTED = {
    "n": (1,), "best_of": (1,), "presence_penalty": (0,), "frequency_penalty": (0,), "logit_bias": ({},),
    "repetition_penalty": (1,), "length_penalty": (1,), "min_p": (0,), "min_tokens": (0,), "use_beam_search": (False,),
    "stop_token_ids": ([],), "bad_words": ([],), "allowed_token_ids": ([],), "include_stop_str_in_output": (False,),
    "skip_special_tokens": (True,), "prompt_logprobs": (), "truncate_prompt_tokens": (), "echo": (False,),
    "response_format": ({"type": "text"},), "guided_json": (), "guided_regex": (), "guided_choice": (),
    "guided_grammar": (), "structured_outputs": (), "logits_processors": (), "return_tokens_as_token_ids": (False,),
}
COMPLETION_UNSUPPORTED = {**_UNSUPPORTED, "logprobs": (), "suffix": ("",)}
CHAT_UNSUPPORTED = {
    **_UNSUPPORTED, "logprobs": (False,), "top_logprobs": (0,), "tools": ([],), "tool_choice": ("none", "auto"),
    "functions": ([],), "function_call": ("none",), "modalities": (["text"],), "audio": (), "prediction": (),
    "add_generation_prompt": (True,), "continue_final_message": (False,), "chat_template": (),
    "chat_template_kwargs": ({},), "documents": (), "reasoning_effort": (), "web_search_options": (),
}


def _same(value: Any, off: Any) -> bool:
    """``value == off`` without Python's ``True == 1`` and ``0 == False``: a bool matches only a bool (``"n": true``
    is not ``n=1``); 1.0 still matches 1."""
    return isinstance(value, bool) == isinstance(off, bool) and value == off


def _json(value: Any, limit: int = 200) -> str:
    """``value`` as JSON (at most ``limit`` characters, then "...")."""
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def check_supported(body: _Generate, unsupported: dict[str, tuple]) -> None:
    """Raise a 400 naming the first known-unsupported parameter set to a value other than "off"; log the unknown
    fields that are ignored."""
    extra = body.model_extra or {}
    for name, off in unsupported.items():
        value = extra.get(name)
        if value is not None and not any(_same(value, o) for o in off):
            # (JSON spellings, as the client wrote them: true, null, {"type": "text"}; not Python's reprs)
            only = f" (only {' or '.join(_json(o) for o in off)} is accepted)" if off else ""
            raise APIError(400, f"{name}={_json(value)} is not supported by multilora{only}",
                           code="unsupported_parameter", param=name)
    if body.stream_options is not None and not body.stream:
        raise APIError(400, "stream_options: only allowed when stream is true", code="invalid_value",
                       param="stream_options")
    if body.stream_options is not None and body.stream_options.continuous_usage_stats:
        raise APIError(400, "stream_options.continuous_usage_stats=True is not supported by multilora (the usage comes "
                            "in the last chunk with include_usage)", code="unsupported_parameter", param="stream_options")
    ignored = sorted(set(extra) - set(unsupported))
    if ignored:
        log.warning("ignoring unknown request fields %s", ignored)


def sampling_params(body: _Generate, max_tokens: int, *, asked: bool = False,
                    params: dict[str, str] | None = None) -> SamplingParams:
    """The request's ``SamplingParams`` (OpenAI's defaults: temperature 1, top_p 1; ``max_tokens`` when the request
    names none). ``asked``: the client named ``max_tokens``, so a prompt + ``max_tokens`` past the context or the KV
    cache is a 400 (``max_tokens_must_fit``), as from OpenAI and vLLM; a default is capped at both instead
    (``max_tokens_fit_kv``). Raises a 400 with the engine's message, naming the field as the request named it
    (``params``: the engine's field -> the request's, ``renamed``). The HTTP ranges come first: ``top_k`` -1 or 0 is
    off (vLLM's), below -1 is refused; ``seed`` must be an int64 (vLLM's and OpenAI's type), not reduced mod 2**64 as
    the engine's ``SamplingParams.seed`` is, so 2**64 is refused rather than being seed 0."""
    if isinstance(body.top_k, int) and body.top_k < -1:
        raise APIError(400, f"top_k: expected -1 or 0 (off) or a positive int, got {body.top_k}", code="invalid_value",
                       param="top_k")
    if isinstance(body.seed, int) and not -2**63 <= body.seed < 2**63:
        raise APIError(400, f"seed: expected an int in [-2**63, 2**63) (int64), got {body.seed}", code="invalid_value",
                       param="seed")
    try:
        return SamplingParams(max_tokens=max_tokens, temperature=1.0 if body.temperature is None else body.temperature,
                              top_p=1.0 if body.top_p is None else body.top_p,
                              top_k=0 if body.top_k in (None, -1) else body.top_k, seed=body.seed, stop=body.stop,
                              ignore_eos=body.ignore_eos, max_tokens_must_fit=asked, max_tokens_fit_kv=not asked)
    except ValueError as e:
        raise renamed(bad_value(e), params or {}) from None


def renamed(err: APIError, params: dict[str, str]) -> APIError:
    """``err`` (a 400 naming an engine field) in the request's words: ``param`` and the message's leading
    ``field:`` mapped by ``params`` (``prompt`` -> ``messages``), and ``max_tokens=`` in the message likewise when
    the request named it ``max_completion_tokens``."""
    new = params.get(err.param) if err.param else None
    if new is None:
        return err
    if err.message.startswith(f"{err.param}:"):
        err.message = new + err.message[len(err.param):]
    if err.param == "max_tokens":
        err.message = err.message.replace("max_tokens=", f"{new}=")
    err.param = new
    return err


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "dict", "list", "none"})


def _union_tag(k: Any) -> bool:
    """Whether a pydantic error ``loc`` element names a union branch ("str", "list[int]", "ContentPart"), not a field
    (the request models' fields are lower-case words) or an index."""
    return isinstance(k, str) and ("[" in k or k in _TYPE_TAGS or k[:1].isupper())


def validation_error(errors: list[dict]) -> APIError:
    """A 400 naming the fields pydantic refused (``messages[0].content: Input should be ...``), ``param`` the first
    field's path as the message spells it (``messages[0].role``, as the value checks name theirs)."""
    first = errors[0]
    if first["type"] == "json_invalid":
        return APIError(400, f"malformed JSON body: {first.get('ctx', {}).get('error', first['msg'])}",
                        code="invalid_json")
    if tuple(first["loc"]) == ("body",) and first["type"] == "missing":  # no body at all (curl -d '')
        return APIError(400, "body: expected a JSON object, got an empty body", code="invalid_json")

    def where(loc: tuple) -> str:
        out = ""
        for k in loc[1:] if loc and loc[0] == "body" else loc:
            out += f"[{k}]" if isinstance(k, int) else (f".{k}" if out else str(k))
        return out or "body"

    def got(x: dict) -> str:  # the value sent, short ("missing" fields have none to show)
        if x.get("type") == "missing" or "input" not in x:
            return ""
        value = x["input"]
        if isinstance(value, bytes):  # a body sent without a JSON content type: show it as the text it is
            value = value.decode("utf-8", "replace")
        try:
            text = json.dumps(value)
        except (TypeError, ValueError):
            text = repr(value)
        return f", got {text[:60] + '...' if len(text) > 60 else text}"

    # A union field (prompt, stop, content) fails once per branch, each error's loc carrying the branch's tag after
    # the field ("prompt", "list[int]", 0). The branch meant is the one the value's shape matched: of the branches
    # that failed below the field, the one with the fewest errors (on a tie, the one that failed deepest, then the
    # first), so ["a"] * 1000 + [5] is read as list[str] with one bad item, not list[int] with 1,000, and [[1, "a"]]
    # as list[list[int]]. Branches that all failed at the field itself
    # become one "expected A or B" line. One pass over the errors (a 100k-item prompt gives ~200k of them).
    def path(loc: tuple) -> tuple:
        return tuple(k for k in loc if not _union_tag(k))

    def branch(loc: tuple) -> tuple[tuple, Any, bool]:  # (the field, the first union tag or None, failed below it)
        i = next((i for i, k in enumerate(loc) if _union_tag(k)), None)
        return (tuple(loc), None, True) if i is None else (tuple(loc[:i]), loc[i], len(loc) > i + 1)

    counts: dict[tuple, dict[Any, list[int]]] = {}  # field -> tag -> [errors, errors below the field, deepest]
    for x in errors:
        site, tag, deep = branch(x["loc"])
        if tag is not None:
            c = counts.setdefault(site, {}).setdefault(tag, [0, 0, 0])
            c[0] += 1
            c[1] += deep
            c[2] = max(c[2], len(x["loc"]))
    chosen = {site: min((t for t in tags if tags[t][1]), key=lambda t: (tags[t][0], -tags[t][2]), default=None)
              for site, tags in counts.items()}  # None: every branch failed at the field itself
    parts: list[str] = []
    kept: list[dict] = []
    said: set[tuple] = set()
    for x in errors:
        if len(parts) >= 4:
            break
        site, tag, _ = branch(x["loc"])
        if tag is not None and chosen[site] is None:  # the value fits no branch's shape: name them all, once
            if site not in said:
                said.add(site)
                tags = list(counts[site])
                parts.append(f"{where(site)}: expected {', '.join(map(str, tags[:-1]))} or {tags[-1]}{got(x)}")
                kept.append(x)
        elif tag is None or tag == chosen[site]:
            parts.append(f"{where(path(x['loc']))}: {x['msg']}{got(x)}")
            kept.append(x)
    message = "; ".join(parts)
    first = kept[0]
    loc = path(first["loc"])
    if tuple(loc) == ("body",) and isinstance(first.get("input"), (bytes, str)):
        # FastAPI parses the body as JSON only when the request says it is (curl -d sends form encoding)
        message = "body: expected a JSON object; send the header Content-Type: application/json" + got(first)
    return APIError(400, message, code="invalid_type", param=where(loc) if len(loc) > 1 else None)


def bad_value(e: ValueError) -> APIError:
    """A 400 for an engine ``ValueError``: its message, ``SamplingParams.`` dropped, the field as ``param``."""
    message = str(e).replace("SamplingParams.", "")
    field = re.match(r"(\w+):", message)
    return APIError(400, message, code="invalid_value", param=field.group(1) if field else None)


def completion_prompts(prompt: Any) -> list:
    """A completion request's prompt as a list of engine prompts: one text or token-id list, or a list of them."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        return [prompt]
    if not prompt:
        raise APIError(400, "prompt: expected a prompt, got an empty list", code="invalid_value", param="prompt")
    return list(prompt)


def chat_prompt(messages: list[ChatMessage]) -> list[dict]:
    """The engine's chat prompt (``{"role", "content"}`` dicts; the engine applies the chat template). Text content
    parts are joined by newlines; other parts, and tool calls, are a 400 naming them."""
    if not messages:
        raise APIError(400, "messages: expected at least one message", code="invalid_value", param="messages")
    out = []
    for i, m in enumerate(messages):
        if m.role not in CHAT_ROLES:
            raise APIError(400, f"messages[{i}].role: expected one of {', '.join(sorted(CHAT_ROLES))}, got {m.role!r}",
                           code="invalid_value", param=f"messages[{i}].role")
        for key in ("tool_calls", "function_call", "audio"):
            if (m.model_extra or {}).get(key):
                raise APIError(400, f"messages[{i}].{key} is not supported by multilora", code="unsupported_parameter",
                               param=f"messages[{i}].{key}")
        content = m.content
        if content is None and m.role != "assistant":  # (an assistant turn's content may be null, as OpenAI allows)
            raise APIError(400, f"messages[{i}].content: expected a string or a list of text parts for a {m.role!r} "
                                f"message, got none", code="invalid_value", param=f"messages[{i}].content")
        if isinstance(content, list):
            if not content and m.role != "assistant":  # OpenAI's schema: at least one part
                raise APIError(400, f"messages[{i}].content: expected a string or at least one text part for a "
                                    f"{m.role!r} message, got an empty list", code="invalid_value",
                               param=f"messages[{i}].content")
            for j, part in enumerate(content):
                if part.type != "text":
                    raise APIError(400, f"messages[{i}].content[{j}]: only text parts are supported, got type "
                                        f"{part.type!r}", code="unsupported_parameter", param=f"messages[{i}].content")
                if part.text is None:
                    raise APIError(400, f"messages[{i}].content[{j}].text: expected the text of a text part, got none",
                                   code="invalid_value", param=f"messages[{i}].content[{j}].text")
            content = "\n".join(part.text for part in content)
        out.append({"role": m.role, "content": content or ""})
    return out


# ------------------------------------------------------------------------------------------------ responses
def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class Responses:
    """Builds one request's response body or stream chunks, in OpenAI's shapes.

    Args:
        chat: ``chat.completion`` (``message`` / ``delta``) instead of ``text_completion`` (``text``).
        model: the request's ``model``, echoed.
        stream_options: the request's; with ``include_usage`` every chunk carries ``"usage": null`` and a last
            chunk the usage.
    """

    def __init__(self, *, chat: bool, model: str, stream_options: StreamOptions | None = None) -> None:
        self.chat, self.model = chat, model
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.include_usage = stream_options is not None and stream_options.include_usage
        self._event_parts: dict[int, tuple[str, str]] = {}  # text_event's (prefix, suffix) per choice index

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def response(self, outputs: list) -> dict:
        """The whole response of finished ``RequestOutput``s (one choice each)."""
        if self.chat:
            choices = [{"index": i, "message": {"role": "assistant", "content": o.text}, "logprobs": None,
                        "finish_reason": o.finish_reason} for i, o in enumerate(outputs)]
        else:
            choices = [{"index": i, "text": o.text, "logprobs": None, "finish_reason": o.finish_reason}
                       for i, o in enumerate(outputs)]
        return {**self._head("chat.completion" if self.chat else "text_completion"), "choices": choices,
                "usage": usage(sum(len(o.prompt_token_ids) for o in outputs), sum(len(o.token_ids) for o in outputs))}

    def chunk(self, index: int, text: str | None, finish_reason: str | None = None, *, role: bool = False) -> dict:
        """One stream chunk: new ``text`` of choice ``index`` (chat: ``role`` opens the message; ``text=None`` is an
        empty delta, for the chunk that carries the finish reason)."""
        if self.chat:
            delta = ({"role": "assistant"} if role else {}) | ({} if text is None else {"content": text})
            choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        else:
            choice = {"index": index, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        out = {**self._head("chat.completion.chunk" if self.chat else "text_completion"), "choices": [choice]}
        if self.include_usage:
            out["usage"] = None
        return out

    def text_event(self, index: int, text: str) -> str:
        """The server-sent event of ``chunk(index, text)`` (``data: {...}\\n\\n``), from a JSON prefix and suffix made
        once per choice: one ``json.dumps`` of the text per token instead of building and encoding the whole dict
        (the stream's hottest line). ``json.loads`` of it equals ``chunk(index, text)``."""
        parts = self._event_parts.get(index)
        if parts is None:
            mark = json.dumps("\x00")  # the text's JSON string, split around; unless a field (the model) holds it too
            whole = json.dumps(self.chunk(index, "\x00"), ensure_ascii=False)
            head, _, tail = whole.partition(mark)
            parts = self._event_parts[index] = ("data: " + head, tail + "\n\n") if whole.count(mark) == 1 else ()
        if not parts:
            return f"data: {json.dumps(self.chunk(index, text), ensure_ascii=False)}\n\n"
        return parts[0] + json.dumps(text, ensure_ascii=False) + parts[1]

    def usage_chunk(self, total: dict) -> dict:
        """The last chunk with ``stream_options.include_usage``: no choices, the request's usage."""
        return {**self._head("chat.completion.chunk" if self.chat else "text_completion"), "choices": [],
                "usage": total}
