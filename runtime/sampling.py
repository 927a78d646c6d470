"""Sampling parameters and the batched sampler (greedy, temperature, top-k, top-p, per-request seeds).

One call per step picks every request's next token on the device where the logits live, with no host sync:

    t = SamplingTensors.from_params([r.params for r in batch], seeds, [len(r.output_ids) for r in batch], device)
    next_ids = sample_batch(logits, t).tolist()   # the step's one sync

Randomness is a pure function of (seed, step, vocab index) (a counter-based hash, not a generator with state),
so a request's n-th token is the same whatever batch it runs in, at whatever row, on CPU or CUDA.
"""

from __future__ import annotations

import functools
import math
import numbers
import secrets
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

from multilora.kernels.backends import to_device


_FLOAT32_MAX = torch.finfo(torch.float32).max  # temperatures are float32 in the sampler


@dataclass
class SamplingParams:
    """How to pick each next token, and when to stop.

    Attributes:
        max_tokens: most tokens to generate (>= 1).
        temperature: 0 = greedy (argmax); > 0 divides the logits before softmax.
        top_p: nucleus sampling (Holtzman et al. 2019): keep the smallest set of tokens whose
            probability sums to at least top_p; 1.0 = off. In (0, 1].
        top_k: keep the k most likely tokens; 0 = off.
        seed: any int (reduced mod 2**64) seeds this request's noise (reproducible sampling whatever the
            batch); None = random.
        stop: strings that end generation (one string, a list, or None = none); the text is cut before the
            first occurrence.
        ignore_eos: keep going past the model's end-of-sequence token.
        max_tokens_must_fit: False (default): a request whose prompt + ``max_tokens`` exceeds the engine's
            ``max_seq_len`` generates up to ``max_seq_len`` (finish reason ``length``); True: it is refused at
            submission (ValueError naming ``max_tokens``), as the OpenAI API and vLLM's server refuse it (the
            server sets it when a client names ``max_tokens``).
        max_tokens_fit_kv: True: a prompt + ``max_tokens`` longer than the whole KV cache holds generates up to
            what it holds (finish reason ``length``) instead of being refused, as past ``max_seq_len`` (the server
            sets it for a ``max_tokens`` the client did not name: a default is capped, not refused). A prompt that
            leaves no room for one token is refused either way. Not with ``max_tokens_must_fit``.

    Every field is checked here, type and range, so the batched sampler never meets a value it cannot use.

    Raises:
        ValueError: a value of the wrong type or out of range (the message names the field).
    """

    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    max_tokens_must_fit: bool = False
    max_tokens_fit_kv: bool = False

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """Check every field (type and range) and normalise it (``stop`` to a list, numpy scalars to Python
        ones); run at construction and again when a request is submitted (the fields may have been changed since).

        Raises:
            ValueError: ``SamplingParams.<field>: expected ..., got ...``.
        """
        def fail(name: str, want: str) -> ValueError:
            return ValueError(f"SamplingParams.{name}: expected {want}, got {getattr(self, name)!r}")

        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        elif isinstance(self.stop, (list, tuple)):
            self.stop = list(self.stop)
        else:
            raise fail("stop", "a string, a list of strings or None")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise fail("max_tokens", "an int >= 1")
        if not _is_real(self.temperature) or not 0 <= self.temperature <= _FLOAT32_MAX:  # (the sampler's dtype)
            raise fail("temperature", "a finite number >= 0, at most float32's largest (3.4e38)")
        if not _is_real(self.top_p) or not 0 < self.top_p <= 1:
            raise fail("top_p", "a number in (0, 1]")
        if not _is_int(self.top_k) or not 0 <= self.top_k < 2**63:
            raise fail("top_k", "an int in [0, 2**63)")
        if self.seed is not None and not _is_int(self.seed):
            raise fail("seed", "an int or None")
        if not isinstance(self.ignore_eos, (bool, np.bool_)):
            raise fail("ignore_eos", "True or False")
        if not isinstance(self.max_tokens_must_fit, (bool, np.bool_)):
            raise fail("max_tokens_must_fit", "True or False")
        if not isinstance(self.max_tokens_fit_kv, (bool, np.bool_)):
            raise fail("max_tokens_fit_kv", "True or False")
        if self.max_tokens_fit_kv and self.max_tokens_must_fit:
            raise fail("max_tokens_fit_kv", "False with max_tokens_must_fit (a max_tokens that must fit is not capped)")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise fail("stop", "non-empty strings")
        # numpy scalars become Python ones: the sampler packs them with the others
        self.max_tokens, self.top_k, self.ignore_eos = int(self.max_tokens), int(self.top_k), bool(self.ignore_eos)
        self.max_tokens_must_fit, self.max_tokens_fit_kv = bool(self.max_tokens_must_fit), bool(self.max_tokens_fit_kv)
        self.temperature, self.top_p = float(self.temperature), float(self.top_p)
        if self.seed is not None:
            self.seed = int(self.seed)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _is_int(v: object) -> bool:
    """An integer (Python or numpy), not a bool."""
    return isinstance(v, numbers.Integral) and not isinstance(v, (bool, np.bool_))


def _is_real(v: object) -> bool:
    """A real number (Python or numpy), not a bool."""
    return isinstance(v, numbers.Real) and not isinstance(v, (bool, np.bool_))


def make_seed(params: SamplingParams) -> int:
    """The request's sampling seed: ``params.seed``, or a fresh random 63-bit int when it is None.

    Draw it once per request (at admission) and keep it: with ``SamplingTensors`` the token for
    (seed, step) is then fixed, whatever the batch.
    """
    return params.seed if params.seed is not None else secrets.randbits(63)


# ------------------------------------------------------------------------------------- SamplingTensors
def _int64(v: int, name: str, i: int) -> int:
    """``v`` reduced mod 2**64 into int64's range (a bijection, so distinct seeds mod 2**64 stay distinct)."""
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"{name}[{i}]: expected an int, got {v!r}")
    return (v + 2**63) % 2**64 - 2**63


@dataclass
class SamplingTensors:
    """A batch's sampling parameters as device tensors, row b for request b, plus host flags for fast paths.

    Attributes:
        temperature: float32 [B]; 0 = greedy row.
        top_p: float32 [B] in (0, 1]; 1 = off.
        top_k: int64 [B] >= 0; 0 = off (values above the vocab size keep everything).
        seed: int64 [B]; the request's seed reduced mod 2**64 into int64's range.
        step: int64 [B] >= 0; index of the token being generated (0 = the first generated token).
        all_greedy: host; every row is greedy (``sample_batch`` is one argmax).
        any_top_p: host; some non-greedy row has top_p < 1 (needs a sort over the vocab).
        any_top_k: host; some non-greedy row has top_k > 0.
        max_top_k: host; the largest top_k over non-greedy rows (0 when none).

    ``from_params`` moves one packed buffer (int64 [3, B] then float32 [2, B]) whose rows these tensors view.
    """

    temperature: torch.Tensor
    top_p: torch.Tensor
    top_k: torch.Tensor
    seed: torch.Tensor
    step: torch.Tensor
    all_greedy: bool
    any_top_p: bool
    any_top_k: bool
    max_top_k: int

    @staticmethod
    def from_params(params: Sequence[SamplingParams], seeds: Sequence[int], steps: Sequence[int],
                    device: torch.device | str) -> SamplingTensors:
        """Pack one ``SamplingParams``, seed and step per row onto ``device`` (no host sync on CUDA).

        Args:
            params: B requests' parameters.
            seeds: B ints (any size; reduced mod 2**64), e.g. ``make_seed(params)`` drawn once per request.
            steps: B ints >= 0: how many tokens each request has generated so far.
            device: where the logits will be.

        Raises:
            ValueError: lengths differ, B == 0, a non-SamplingParams, a non-int seed, or a bad step.
        """
        b = len(params)
        if b == 0:
            raise ValueError("params: expected at least one row, got 0")
        if len(seeds) != b or len(steps) != b:
            raise ValueError(f"seeds, steps: expected {b} entries each (one per row), got {len(seeds)} and {len(steps)}")
        for i, p in enumerate(params):
            if not isinstance(p, SamplingParams):
                raise ValueError(f"params[{i}]: expected SamplingParams, got {type(p).__name__}")
        steps = list(steps)
        if not all(type(s) is int and s >= 0 for s in steps):  # fast path for plain ints; else say which
            for i, s in enumerate(steps):
                if isinstance(s, bool) or not isinstance(s, int) or s < 0:
                    raise ValueError(f"steps[{i}]: expected an int >= 0, got {s!r}")
        seeds = list(seeds)
        if not all(type(s) is int and -(2**63) <= s < 2**63 for s in seeds):  # in range: reduction is the identity
            seeds = [_int64(s, "seeds", i) for i, s in enumerate(seeds)]
        # one host buffer, one copy: int64 [3, B] (top_k, seed, step), then float32 [2, B] (temperature, top_p)
        host = torch.empty(32 * b, dtype=torch.uint8)
        buf = host.numpy()
        buf[: 24 * b].view(np.int64)[:] = [p.top_k for p in params] + seeds + steps
        buf[24 * b :].view(np.float32)[:] = [p.temperature for p in params] + [p.top_p for p in params]
        dev = to_device(host, device)  # (pinned + non-blocking on CUDA: the host does not wait)
        ints, floats = dev[: 24 * b].view(torch.int64), dev[24 * b :].view(torch.float32)
        sampled = [p for p in params if not p.greedy]
        return SamplingTensors(
            temperature=floats[:b], top_p=floats[b:], top_k=ints[:b], seed=ints[b : 2 * b], step=ints[2 * b :],
            all_greedy=not sampled, any_top_p=any(p.top_p < 1 for p in sampled),
            any_top_k=any(p.top_k > 0 for p in sampled), max_top_k=max((p.top_k for p in sampled), default=0),
        )

    @property
    def batch_size(self) -> int:
        return self.temperature.shape[0]

    @property
    def device(self) -> torch.device:
        return self.temperature.device

# ------------------------------------------------------------------------------------------ the RNG
def _s64(c: int) -> int:
    """An unsigned 64-bit constant as the int64 with the same bits."""
    return c - 2**64 if c >= 2**63 else c


GOLDEN_GAMMA = _s64(0x9E3779B97F4A7C15)  # SplitMix64's increment: 2**64 / golden ratio, odd
MIX_1 = _s64(0xBF58476D1CE4E5B9)  # Stafford's "Mix13" multipliers, as in SplitMix64 (Vigna's splitmix64.c)
MIX_2 = _s64(0x94D049BB133111EB)


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's ``>>`` is arithmetic: mask off the copied sign bits)."""
    return (x >> s).bitwise_and_((1 << (64 - s)) - 1)


def _mix64(x: torch.Tensor) -> torch.Tensor:
    """SplitMix64's output function, in place on int64 ``x`` (multiplications wrap mod 2**64)."""
    x ^= _shr(x, 30)
    x *= MIX_1
    x ^= _shr(x, 27)
    x *= MIX_2
    x ^= _shr(x, 31)
    return x


def random_bits(seed: torch.Tensor, step: torch.Tensor, vocab: int) -> torch.Tensor:
    """64 random bits per (row, vocab index) as int64 [B, vocab]: a pure function of (seed, step, index).

    SplitMix64 (Steele, Lea and Flood, "Fast splittable pseudorandom number generators", OOPSLA 2014;
    constants from Vigna's splitmix64.c) used as a counter-based hash, twice:

        key[b]      = mix64(seed[b] + (step[b] + 1) * GAMMA)       # output step+1 of the stream seeded by seed
        bits[b, v]  = mix64(key[b] + (v + 1) * GAMMA)              # output v+1 of the stream seeded by key

    all mod 2**64, where mix64 is SplitMix64's bijective finalizer. Bit-identical on every device.

    Args:
        seed: int64 [B]; step: int64 [B] (same device); vocab: the number of columns.
    """
    key = _mix64(seed + (step + 1) * GOLDEN_GAMMA)  # [B]
    col = torch.arange(1, vocab + 1, dtype=torch.int64, device=seed.device) * GOLDEN_GAMMA  # [vocab]
    return _mix64(key[:, None] + col)  # [B, vocab]


def gumbel_noise(seed: torch.Tensor, step: torch.Tensor, vocab: int) -> torch.Tensor:
    """Standard Gumbel noise float32 [B, vocab] from ``random_bits``: g = -log(-log(u)).

    u = (top 53 bits + 0.5) / 2**53 lies strictly inside (0, 1), computed in float64 so the tails reach
    |g| ~ 37 (a 24-bit u would cut the upper tail at 17, which the max of 128k draws passes 0.4% of the time).
    """
    u = _shr(random_bits(seed, step, vocab), 11).double().add_(0.5).mul_(2.0**-53)  # [B, vocab] in (0, 1)
    return u.log_().neg_().log_().neg_().float()


# ---------------------------------------------------------------------------------------- the sampler
MIN_TEMPERATURE = 1e-6  # smaller temperatures act as this one, so that logits / temperature stays finite in float32
def _keep_threshold(scaled: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """Per row, the smallest scaled logit kept by top-k then top-p: float32 [B, 1] (-inf keeps all)."""
    vocab = scaled.shape[-1]
    k = torch.where(t.top_k > 0, t.top_k.clamp(max=vocab), vocab)  # [B], in [1, vocab]
    if not t.any_top_p:  # top-k only: the k-th largest value, from a topk as wide as the largest k
        top = torch.topk(scaled, min(t.max_top_k, vocab), dim=-1).values  # [B, max_k], descending
        kth = top.gather(1, (k.clamp(max=top.shape[-1]) - 1)[:, None])
        return torch.where((t.top_k > 0)[:, None], kth, float("-inf"))
    s = torch.sort(scaled, dim=-1, descending=True).values  # [B, vocab]
    pos = torch.arange(vocab, device=scaled.device)
    s.masked_fill_(pos >= k[:, None], float("-inf"))  # top-k, then the nucleus among what is left
    cum = torch.softmax(s, dim=-1).cumsum_(dim=-1)  # [B, vocab], non-decreasing
    n_p = (cum < t.top_p[:, None]).sum(dim=-1) + 1  # the first position where the sum reaches top_p, + 1
    n_p = torch.where(t.top_p < 1, n_p.clamp(max=vocab), vocab)  # top_p == 1: off (rounding must not cut tails)
    n = torch.minimum(n_p, k)  # [B] >= 1: the most likely token is always kept
    return s.gather(1, (n - 1)[:, None])


#: ``row_max`` reduces a row in two passes from this many entries on: torch's one-pass row reduction runs one
#: thread block per row, so a batch of a few rows over a 128,256-entry vocabulary keeps one SM busy (27 us on an
#: H200 at batch 1 for Llama-3's vocabulary, ``bench/results/session22/call2/prof_fp8_b1.log``).
ROW_MAX_SPLIT_MIN = 16384
#: The pieces' target length in the first pass (a divisor of the row length near it is taken).
ROW_MAX_PIECE = 1024
#: Off (False) only for A/Bs (``bench_generate.py`` provider ``multilora-fp8-onepassmax``).
ROW_MAX_TWO_PASS = True


@functools.lru_cache(maxsize=64)
def _row_max_piece(vocab: int) -> int:
    """The piece length for a row of ``vocab`` entries: the divisor of ``vocab`` in [ROW_MAX_PIECE / 4,
    ROW_MAX_PIECE * 4] nearest ROW_MAX_PIECE (on a log scale), or 0 where none is (one pass then)."""
    lo, hi = ROW_MAX_PIECE // 4, ROW_MAX_PIECE * 4
    divs = [d for d in range(lo, min(hi, vocab // 2) + 1) if vocab % d == 0]
    return min(divs, key=lambda d: abs(math.log(d / ROW_MAX_PIECE))) if divs else 0


def row_max(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x.max(dim=-1)`` of a 2-D floating tensor x [B, V]: (values [B] in x's dtype, int64 indices [B]), the
    index of the first maximum on ties (as ``torch.argmax``) and a NaN's value where a row has one. A few long rows
    (V >= ``ROW_MAX_SPLIT_MIN``, fewer than 256 rows) are reduced in two passes, over pieces of the row and then
    over the pieces' maxima, so the first pass spreads over many thread blocks; the result is the same as one
    pass (``tests/test_sampling.py::test_row_max_equals_torch_max``)."""
    B, V = x.shape
    piece = _row_max_piece(V) if ROW_MAX_TWO_PASS and V >= ROW_MAX_SPLIT_MIN and B < 256 else 0
    if not piece:
        return x.max(dim=-1)
    vals, idx = x.reshape(B, V // piece, piece).max(dim=-1)  # [B, n]: each piece's first maximum
    top, which = vals.max(dim=-1)  # [B]: the first piece holding the row's maximum (or a NaN)
    return top, which * piece + idx.gather(1, which[:, None]).squeeze(1)


def sample_batch(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """Each row's next token: greedy, or temperature + top-k + top-p + seeded Gumbel-max sampling.

    Semantics, per row b with l = logits[b]:

        temperature[b] == 0:  out[b] = argmax(l)
        otherwise:            z = l / max(temperature[b], MIN_TEMPERATURE)
                              keep the top_k[b] largest z (ties with the k-th kept; 0 = all), then of those
                              the fewest most likely whose softmax probabilities sum to >= top_p[b] (the most
                              likely always; ties with the last kept are kept too)
                              out[b] = argmax over kept v of z[v] + g[b, v],  g = gumbel_noise(seed, step)

    The Gumbel-max trick (Gumbel 1954; Maddison, Tarlow and Minka, "A* sampling", NeurIPS 2014) makes
    ``out[b]`` a draw from softmax(z) restricted to the kept tokens, and the noise g[b, v] depends only on
    (seed[b], step[b], v) (``random_bits``), so the token is the same whatever the batch's other rows, its
    row, or the device (CPU vs CUDA), up to float rounding of the logits and of the nucleus boundary.
    Runs entirely on ``logits.device`` with no ``.item()``/``.tolist()``: the caller syncs once, reading
    the result. Memory: a few [B, vocab] temporaries (int64 / float64 for the noise, float32 + int64 for
    the sort when some row uses top-p).

    Args:
        logits: float32 (or float16 / bfloat16, computed in float32) [B, vocab], finite or -inf with at
            least one finite value per row; on ``t``'s device. Not modified.
        t: the batch's ``SamplingTensors`` (batch size B).

    Returns:
        int64 [B] token ids on ``logits.device``.

    Raises:
        ValueError: logits not 2-D floating, batch size differs from ``t``, or another device.
    """
    if logits.dim() != 2 or not logits.is_floating_point() or logits.shape[1] == 0:
        raise ValueError(f"logits: expected a floating tensor [B, vocab], got {logits.dtype} {tuple(logits.shape)}")
    if logits.shape[0] != t.batch_size or logits.device != t.device:
        raise ValueError(f"logits: expected {t.batch_size} rows on {t.device} (as t), "
                         f"got {logits.shape[0]} on {logits.device}")
    logits = logits.float()
    greedy_ids = row_max(logits)[1]  # [B]: argmax
    if t.all_greedy:
        return greedy_ids
    greedy = t.temperature == 0  # [B]
    scaled = logits / torch.where(greedy, 1.0, t.temperature.clamp(min=MIN_TEMPERATURE))[:, None]  # [B, vocab]
    if t.any_top_p or t.any_top_k:
        scaled.masked_fill_(scaled < _keep_threshold(scaled, t), float("-inf"))
    scaled += gumbel_noise(t.seed, t.step, scaled.shape[-1])
    return torch.where(greedy, greedy_ids, scaled.argmax(dim=-1))
