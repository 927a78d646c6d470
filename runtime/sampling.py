"""Sampling parameters and the sampler (greedy, temperature, top-k, top-p, per-request seeds)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class SamplingParams:
    """How to pick each next token, and when to stop.

    Attributes:
        max_tokens: most tokens to generate (>= 1).
        temperature: 0 = greedy (argmax); > 0 divides the logits before softmax.
        top_p: nucleus sampling (Holtzman et al. 2019): keep the smallest set of tokens whose
            probability sums to at least top_p; 1.0 = off. In (0, 1].
        top_k: keep the k most likely tokens; 0 = off.
        seed: seeds this request's own generator (reproducible sampling whatever the batch); None = random.
        stop: strings that end generation; the text is cut before the first occurrence.
        ignore_eos: keep going past the model's end-of-sequence token.

    Raises:
        ValueError: an out-of-range value (the message names the field).
    """

    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"SamplingParams.max_tokens: expected an int >= 1, got {self.max_tokens!r}")
        if not self.temperature >= 0:
            raise ValueError(f"SamplingParams.temperature: expected >= 0, got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams.top_p: expected a value in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"SamplingParams.top_k: expected an int >= 0, got {self.top_k!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"SamplingParams.stop: expected non-empty strings, got {self.stop!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def make_generator(params: SamplingParams) -> torch.Generator | None:
    if params.greedy:
        return None
    g = torch.Generator(device="cpu")
    if params.seed is not None:
        g.manual_seed(params.seed)
    else:
        g.seed()
    return g


def sample_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """Pick one token from float32 logits [vocab]."""
    if params.greedy:
        return int(torch.argmax(logits))
    logits = logits.float().cpu() / params.temperature
    if params.top_k > 0 and params.top_k < logits.numel():
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sp, si = torch.sort(probs, descending=True)
        keep = (sp.cumsum(0) - sp) < params.top_p  # the first token is always kept
        probs = torch.zeros_like(probs).scatter_(0, si[keep], sp[keep])
        probs = probs / probs.sum()
    return int(torch.multinomial(probs, 1, generator=generator))
