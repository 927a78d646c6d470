"""Prompts to token ids and generated ids back to text, over the model's Hugging Face tokenizer (or none).

A prompt is text (the tokenizer adds its special tokens), a list of chat messages (the model's chat template
with the generation prompt) or a list of token ids (used as given). A model without a tokenizer (random
weights, a GGUF or HF directory without tokenizer files) serves token ids only, and its outputs have no text.
"""

from __future__ import annotations

import numbers
from typing import Any, Iterable

#: How much text ``encode`` tokenizes at most before refusing a prompt far past ``max_len``, per token of ``max_len``:
#: a multiple of the longest token's UTF-8 bytes (``PromptTokenizer.max_token_bytes``). A text of more characters than
#: ``max_len x max_token_bytes x TEXT_BYTES_PER_TOKEN_FACTOR`` has that many characters tokenized first; if they alone
#: are more than twice ``max_len`` tokens, the prompt is refused without tokenizing the rest (a text's tokens are
#: never far fewer than those of its prefix), else the whole text is tokenized as any other. Since no token has more
#: than ``max_token_bytes`` bytes of vocabulary string, text of ordinary tokens gives the prefix at least
#: ``FACTOR x max_len`` tokens; text that tokenizes to far fewer (a run of unknown characters fused into one token,
#: added tokens that swallow whitespace) is tokenized whole and judged by its real count. Tokenizing 20 MB of text
#: took 11 s and 3 GB here.
TEXT_BYTES_PER_TOKEN_FACTOR = 4
#: The shorter prefix tokenized before that one, in characters per token of ``max_len`` (ordinary text is about 4
#: characters a token): a text past it is refused once it alone is more than ``2 x max_len + max_token_bytes``
#: tokens (the bound's margin: a token cut at the prefix's end gives at most one token a byte). Ordinary text far past
#: ``max_len`` is then refused after a few KB instead of up to the long prefix: tokenizing a 400 KB prompt whole held
#: ~60 MB of each server thread's malloc arena at its peak, and 496 such requests took 209 s instead of 16 s. Not for
#: a tokenizer with an added token that swallows the whitespace before it (``lstrip``): a run of whitespace of any
#: length then ends in one token, so a short prefix of it says nothing; such text is judged as before, by the long
#: prefix or whole.
SHORT_PREFIX_CHARS_PER_TOKEN = 16

#: The roles a chat message may have: OpenAI's (with the deprecated ``function``) and Llama 3.1's ``ipython`` (its chat
#: template's tool-output role); a ``developer`` message is rendered as a system message, as OpenAI treats it. Another
#: role (a typo such as ``"usr"``) is refused, naming the message and the role: chat templates render unknown roles in
#: ways that differ by model, some silently. The HTTP server's 400 uses it too.
CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function", "ipython"})

Prompt = Any  # str | list[dict] (chat messages) | list[int] (token ids)


def prompt_list(prompts: Any) -> list:
    """``generate``'s ``prompts`` as a list of prompts: a list as given; one string, one list of chat messages, one
    message dict or one 1-D integer tensor / array of token ids as a list of one prompt. Raises ValueError for
    anything else (None, a number, ...)."""
    if isinstance(prompts, dict):  # one chat message
        return [[prompts]]
    if _is_id_array(prompts):  # one prompt of token ids as a 1-D integer tensor or array
        return [prompts]
    if isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and prompts and isinstance(prompts[0], dict)):
        return [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise ValueError(f"prompts: expected a prompt or a list of prompts, got {type(prompts).__name__}")
    return list(prompts)


def _check_text(text: str, where: str) -> None:
    """Raise ValueError if ``text`` is not valid Unicode (a lone surrogate: the tokenizer cannot encode it)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{where}: not valid Unicode text ({e.reason} at index {e.start})") from None


def _is_id(t: Any) -> bool:
    """A token id: an int, or a numpy / torch integer scalar (``numbers.Integral``, or a 0-d integer tensor); not a
    bool."""
    if isinstance(t, bool):
        return False
    if isinstance(t, numbers.Integral):
        return True
    dtype = getattr(t, "dtype", None)
    return getattr(t, "ndim", None) == 0 and dtype is not None and _integer_dtype(dtype)


def _is_id_array(p: Any) -> bool:
    """A 1-D integer torch tensor or numpy array (taken as a list of token ids)."""
    dtype = getattr(p, "dtype", None)
    return (not isinstance(p, (str, list, tuple)) and getattr(p, "ndim", None) == 1 and dtype is not None
            and _integer_dtype(dtype) and hasattr(p, "tolist"))


def _integer_dtype(dtype: Any) -> bool:
    """Whether a torch or numpy dtype is an integer one (not bool)."""
    if getattr(dtype, "is_floating_point", None) is not None:  # torch.dtype
        return not dtype.is_floating_point and not dtype.is_complex and str(dtype) != "torch.bool"
    return getattr(dtype, "kind", "") in ("i", "u")  # numpy: signed / unsigned ints


class PromptTokenizer:
    """The engine's view of a tokenizer.

    Args:
        tokenizer: a ``transformers`` tokenizer, or None.
        vocab_size: the model's vocabulary (token ids must be in ``[0, vocab_size)``).
        eos_token_ids: the model config's end-of-sequence ids (the tokenizer's own is added).
        source: what the model was loaded from (named in errors).
    """

    def __init__(self, tokenizer: Any, *, vocab_size: int, eos_token_ids: Iterable[int], source: object) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.source = source
        self.eos_ids = set(eos_token_ids)
        if getattr(tokenizer, "eos_token_id", None) is not None:
            self.eos_ids.add(int(tokenizer.eos_token_id))
        self._max_token_bytes: int | None = None
        self._lstrip_tokens: bool | None = None

    @property
    def has_text(self) -> bool:
        return self.tokenizer is not None

    @property
    def max_token_bytes(self) -> int:
        """The UTF-8 length in bytes of the vocabulary's longest token string (special tokens included); 0 without a
        tokenizer or when it gives no vocabulary (``get_vocab``), which turns the length check of ``encode`` off."""
        if self._max_token_bytes is None:
            try:
                vocab = self.tokenizer.get_vocab() if self.tokenizer is not None else {}
                self._max_token_bytes = max((len(str(t).encode("utf-8", "replace")) for t in vocab), default=0)
            except Exception:  # noqa: BLE001 - a tokenizer without a readable vocabulary: no check, never an error
                self._max_token_bytes = 0
        return self._max_token_bytes

    @property
    def lstrip_tokens(self) -> bool:
        """Whether an added token swallows the whitespace before it (``AddedToken.lstrip``; True when that cannot be
        read: the short prefix of ``_check_length`` is then not used)."""
        if self._lstrip_tokens is None:
            try:
                added = getattr(self.tokenizer, "added_tokens_decoder", {}) or {}
                self._lstrip_tokens = any(getattr(t, "lstrip", False) for t in added.values())
            except Exception:  # noqa: BLE001 - unreadable: assume the worst, never an error
                self._lstrip_tokens = True
        return self._lstrip_tokens

    def _check_length(self, text: str, max_len: int | None) -> None:
        """Raise ValueError, without tokenizing the rest of a longer ``text``, if its first ``max_len x
        SHORT_PREFIX_CHARS_PER_TOKEN`` characters are alone more than ``2 x max_len + max_token_bytes`` tokens, or
        its first ``max_len x max_token_bytes x TEXT_BYTES_PER_TOKEN_FACTOR`` more than ``2 x max_len`` (a text
        within that many characters is tokenized whole)."""
        if not max_len or not self.max_token_bytes:
            return
        limit = max_len * self.max_token_bytes * TEXT_BYTES_PER_TOKEN_FACTOR
        short = max_len * SHORT_PREFIX_CHARS_PER_TOKEN
        stages = [(short, 2 * max_len + self.max_token_bytes)] if short < limit and not self.lstrip_tokens else []
        for k, most in stages + [(limit, 2 * max_len)]:
            if len(text) <= k:
                return  # tokenized whole, as any prompt: at most ``limit`` characters
            n = len(self.tokenizer(text[:k], add_special_tokens=False)["input_ids"])
            if n > most:
                raise ValueError(f"prompt: {len(text):,} characters of text are more than max_seq_len={max_len} "
                                 f"tokens can hold: the first {k:,} alone are {n:,} tokens (the rest was not "
                                 f"tokenized): shorten the prompt")

    def encode(self, prompt: Prompt, max_len: int | None = None) -> list[int]:
        """Token ids of a prompt (see the module docstring). ``max_len`` (the engine's ``max_seq_len``, or None):
        text far past it is refused once a prefix of it is (``SHORT_PREFIX_CHARS_PER_TOKEN``,
        ``TEXT_BYTES_PER_TOKEN_FACTOR``), without tokenizing the rest; the caller still checks the ids' length.

        Raises:
            ValueError: a prompt of another type, ids out of range, chat messages without string 'role' and
                'content' or with a role not in ``CHAT_ROLES``, chat messages the model's chat template refuses
                (its ``raise_exception``: e.g. Gemma's templates refuse a system role), text that is not valid
                Unicode (a lone surrogate), text for a model without a tokenizer, a prompt that tokenizes to
                nothing, or text (after the chat template) whose prefix of ``max_len x
                SHORT_PREFIX_CHARS_PER_TOKEN`` characters alone is more than ``2 x max_len + max_token_bytes``
                tokens (not with ``lstrip_tokens``), or whose prefix of ``max_len x TEXT_BYTES_PER_TOKEN_FACTOR x
                max_token_bytes`` characters more than ``2 x max_len``.
        """
        if _is_id_array(prompt):  # a 1-D integer torch tensor or numpy array of token ids
            prompt = prompt.tolist()
        listed = isinstance(prompt, (list, tuple))
        if self.tokenizer is None and not (listed and not any(isinstance(m, dict) for m in prompt)):
            raise ValueError(f"prompt: {self.source} has no tokenizer, so prompts must be lists of token ids")
        if isinstance(prompt, str):
            _check_text(prompt, "prompt")
            self._check_length(prompt, max_len)
            ids = self.tokenizer(prompt)["input_ids"]
        elif listed and prompt and all(isinstance(m, dict) for m in prompt):
            lacking = next((i for i, m in enumerate(prompt) if "role" not in m or "content" not in m), None)
            if lacking is not None:
                raise ValueError(f"prompt: chat message {lacking}: expected a dict with 'role' and 'content', got the "
                                 f"keys {sorted(map(str, prompt[lacking]))}")
            for i, m in enumerate(prompt):
                for key in ("role", "content"):
                    if not isinstance(m[key], str):
                        raise ValueError(f"prompt: chat message {i}: {key!r} must be a string, got "
                                         f"{type(m[key]).__name__}")
                    _check_text(m[key], f"prompt: chat message {i}: {key!r}")
                if m["role"] not in CHAT_ROLES:
                    raise ValueError(f"prompt: chat message {i}: 'role' must be one of {', '.join(sorted(CHAT_ROLES))}, "
                                     f"got {m['role']!r}")
            # OpenAI's developer messages take the place of system messages; the chat templates of the families we
            # serve know no "developer" role (SmolLM2's renders it as a turn and still adds its default system turn)
            messages = [{**m, "role": "system"} if m["role"] == "developer" else m for m in prompt]
            try:
                text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            except Exception as e:  # noqa: BLE001 - the template's own refusal (Gemma: "System role not supported")
                if not type(e).__module__.startswith("jinja2"):
                    raise
                raise ValueError(f"prompt: the chat template of {self.source} refused these messages: {e}") from None
            self._check_length(text, max_len)
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        elif listed and all(_is_id(t) for t in prompt):
            ids = [int(t) for t in prompt]  # numpy / torch integer scalars as Python ints
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"prompt: token ids must be in [0, {self.vocab_size}), got {bad[:5]}")
        elif listed and prompt and all(isinstance(t, str) for t in prompt):  # several prompts given as one
            raise ValueError(f"prompt: expected one prompt, got a list of {len(prompt)} strings (a batch: "
                             f"Engine.generate takes a list of prompts; add_request and submit take one each)")
        elif listed and prompt and not isinstance(prompt[0], dict):  # token ids with a stranger among them
            i, bad = next((i, t) for i, t in enumerate(prompt) if not _is_id(t))
            raise ValueError(f"prompt: token ids must be ints, got {type(bad).__name__} {bad!r} at index {i}")
        else:
            shape = getattr(prompt, "shape", None)
            what = (f"{type(prompt).__name__} of dtype {getattr(prompt, 'dtype', '?')} and shape {tuple(shape)}"
                    if shape is not None else type(prompt).__name__)  # (a tensor or array: which part is wrong)
            raise ValueError(
                f"prompt: expected a string, a list of chat messages ({{'role', 'content'}} dicts), a list of "
                f"token ids or a 1-D integer tensor / array of them, got {what}"
            )
        if not ids:
            raise ValueError("prompt: expected at least one token id, got an empty list" if listed else
                             "prompt: the text tokenizes to zero tokens")
        return list(ids)

    def decode(self, ids: list[int]) -> str:
        """The text of generated ids, special tokens removed ("" without a tokenizer)."""
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=True)


class TextStream:
    """A request's output text, streamed: ``push(ids)`` with the ids generated so far returns the text not yet
    given out. Text is held back while it ends in an incomplete character (the tokenizer decodes a partial UTF-8
    sequence to U+FFFD) or in the start of a stop string (a stop string may span tokens, and the final text is cut
    before it); ``close(final_text)`` gives the rest of the request's final text.

    Each push decodes only the ids since the previous one, with the ids of the push before as context (the text of
    ``ids[p:]`` minus that of ``ids[p:r]``, ``p <= r`` token offsets, the idea of vLLM's incremental detokenizer):
    a constant cost per token instead of decoding the whole output every time. Context matters to tokenizers whose
    decoding of a token depends on its neighbours (SentencePiece's leading space), which both decodes share.

    Args:
        tokenizer: decodes the ids (``PromptTokenizer.decode``; no tokenizer: no text).
        stop: the request's stop strings.
    """

    #: ids a trailing incomplete character may span before its U+FFFD is taken as final (invalid bytes never
    #: complete): a UTF-8 character has at most 4 bytes, a token at least one
    MAX_PENDING = 4

    def __init__(self, tokenizer: PromptTokenizer, stop: Iterable[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.sent = ""  # the text given out so far
        self._text = ""  # the text of ids[:_read], settled
        self._prefix = 0  # ids[_prefix:_read]: the context decoded with the new ids
        self._read = 0

    def push(self, ids: list[int]) -> str:
        """The new text of ``ids`` (all the ids generated so far)."""
        decode = self.tokenizer.decode
        window = decode(ids[self._prefix :])
        context = decode(ids[self._prefix : self._read]) if self._read > self._prefix else ""
        if window.startswith(context):
            new = window[len(context) :]
        else:  # the context decodes differently with the new ids after it (rare): decode it all
            new = decode(ids)[len(self._text) :]
        text = self._text + new
        if new.endswith("\ufffd") and len(ids) - self._read < self.MAX_PENDING:
            end = len(text)  # a multi-byte character whose bytes have not all arrived: wait for them
            while end and text[end - 1] == "\ufffd":
                end -= 1
        else:
            self._text, self._prefix, self._read = text, self._read, len(ids)
            end = len(text)
        for s in self.stop:  # keep back a tail that could be the beginning of a stop string
            k = next((k for k in range(min(len(s) - 1, end), 0, -1) if text.endswith(s[:k], 0, end)), 0)
            end -= k
        return self._take(text[:end])

    def close(self, final_text: str) -> str:
        """The rest of the request's final text (``RequestOutput.text``)."""
        return self._take(final_text)

    def _take(self, text: str) -> str:
        # Text already given out is never taken back; if an earlier piece decodes differently now (rare), only
        # what lies beyond the text given out is new.
        new = text[len(self.sent):]
        if new:
            self.sent = text
        return new
