"""The batched sampler (runtime/sampling.py) against independent references.

- The hash RNG against a plain-Python SplitMix64 (checked itself against the published test vector).
- Greedy rows against a Python argmax loop.
- Frequencies over many (seed, step) pairs against softmax(logits / T) truncated by top-k / top-p,
  computed in float64 Python loops; tokens outside the truncated support never appear.
- Batch invariance: a request's token is the same alone, at any row, next to rows of any parameters.
- Hypothesis: the token always lies in the allowed set (a float64 reference with a little top-p slack).
- On a GPU (``-m gpu``): CPU and CUDA agree token for token; sampling makes no host sync; graph replay.
"""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from multilora.runtime.sampling import (SamplingParams, SamplingTensors, make_seed, random_bits, row_max,
                                        sample_batch)

HAS_CUDA = torch.cuda.is_available()
gpu = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (runs on the device machine)")]
GREEDY = SamplingParams(temperature=0.0)



# ---------------------------------------------------------------- single-row helpers (tests only; no product caller)
def make_generator(params):
    """A per-request CPU generator for ``sample_token`` (None when greedy), seeded by ``params.seed``."""
    if params.greedy:
        return None
    g = torch.Generator(device="cpu")
    if params.seed is not None:
        g.manual_seed(params.seed)
    else:
        g.seed()
    return g


def sample_token(logits, params, generator=None, *, seed=None, step=0):
    """One row of ``sample_batch`` for float logits [vocab]: noise from (seed, step), the seed given, drawn from
    ``generator`` (one draw per call) or ``make_seed(params)``."""
    if logits.dim() != 1:
        raise ValueError(f"logits: expected [vocab], got {tuple(logits.shape)}")
    if params.greedy:
        return int(torch.argmax(logits))
    if seed is None:
        seed = int(torch.randint(0, 2**63 - 1, (1,), generator=generator)) if generator is not None else make_seed(params)
    t = SamplingTensors.from_params([params], [seed], [step], logits.device)
    return int(sample_batch(logits[None], t)[0])


def copy_into(static, other):
    """Overwrite a fixed batch's tensors in place (and its host flags) with ``other``'s: what a CUDA graph captured
    around ``sample_batch(logits, static)`` needs to replay with new values (capture it with ``any_top_p``, the
    general path). Raises ValueError for another batch size or device."""
    if other.batch_size != static.batch_size or other.device != static.device:
        raise ValueError(f"other: expected batch size {static.batch_size} on {static.device}, "
                         f"got {other.batch_size} on {other.device}")
    for name in ("temperature", "top_p", "top_k", "seed", "step"):
        getattr(static, name).copy_(getattr(other, name), non_blocking=True)
    static.all_greedy, static.any_top_p = other.all_greedy, other.any_top_p
    static.any_top_k, static.max_top_k = other.any_top_k, other.max_top_k


def _sample(rows, params, seeds, steps, device="cpu"):
    """Tokens for logits rows (lists or a tensor) with one params / seed / step per row, as a list."""
    logits = torch.as_tensor(rows, dtype=torch.float32).to(device)
    return sample_batch(logits, SamplingTensors.from_params(params, seeds, steps, device)).tolist()


# ------------------------------------------------------------------------------------------ the RNG
U64 = 2**64
GAMMA = 0x9E3779B97F4A7C15


def _py_mix64(z: int) -> int:
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9 % U64
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB % U64
    return z ^ (z >> 31)


def _py_bits(seed: int, step: int, v: int) -> int:
    """bits(seed, step, v) as documented: output v+1 of the stream seeded by output step+1 of seed's stream."""
    key = _py_mix64((seed + (step + 1) * GAMMA) % U64)
    return _py_mix64((key + (v + 1) * GAMMA) % U64)


def test_python_splitmix64_matches_the_published_vector():
    """Rosetta Code's SplitMix64 task: the stream seeded with 1234567 starts with these outputs."""
    want = [6457827717110365317, 3203168211198807973, 9817491932198370423, 4593380528125082431,
            16408922859458223821]
    assert [_py_mix64((1234567 + n * GAMMA) % U64) for n in range(1, 6)] == want


SEEDS = [0, 1, -1, 2**63 - 1, -(2**63), 123456789, 42]
STEPS = [0, 5, 2**40, 7, 0, 3, 1]


def _check_bits(device):
    bits = random_bits(torch.tensor(SEEDS, device=device), torch.tensor(STEPS, device=device), 77).cpu()
    for i, (seed, step) in enumerate(zip(SEEDS, STEPS)):
        assert [b % U64 for b in bits[i].tolist()] == [_py_bits(seed % U64, step, v) for v in range(77)]


def test_random_bits_match_python_splitmix64():
    _check_bits("cpu")


# ------------------------------------------------------------------------------------------ greedy
def test_greedy_rows_are_the_argmax_next_to_sampled_rows():
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(9, 333, generator=g) * 3).tolist()
    params = [GREEDY, SamplingParams(temperature=1.0, top_p=0.5), GREEDY, SamplingParams(temperature=2.0),
              GREEDY, SamplingParams(temperature=0.5, top_k=3), GREEDY, GREEDY, SamplingParams(temperature=1.0)]
    got = _sample(logits, params, list(range(9)), [4] * 9)
    for row, p, tok in zip(logits, params, got):
        if p.greedy:
            assert tok == max(range(len(row)), key=lambda v: (row[v], -v))  # first of the largest


def test_all_greedy_batch_is_the_argmax():
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(1))
    got = _sample(logits, [GREEDY] * 5, [0] * 5, [0] * 5)
    assert got == [max(range(50), key=lambda v: float(r[v])) for r in logits]


# ------------------------------------------------------------------------------------- distribution
LOGITS6 = [2.0, 1.0, 0.5, 0.0, -1.0, -3.0]
CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52}  # 99.9% quantiles of chi-square(df)


def _ref_probs(logits: list[float], temperature: float, top_k: int, top_p: float) -> list[float]:
    """softmax(logits / T) over the top_k largest, then over the shortest prefix reaching top_p (float64)."""
    order = sorted(range(len(logits)), key=lambda v: -logits[v])
    if top_k:
        order = order[:top_k]
    w = [math.exp(logits[v] / temperature) for v in order]
    total = sum(w)
    w = [x / total for x in w]
    kept, total = [], 0.0
    for v, x in zip(order, w):
        kept.append((v, x))
        total += x
        if total >= top_p:
            break
    probs = [0.0] * len(logits)
    for v, x in kept:
        probs[v] = x / total
    return probs


@pytest.mark.parametrize("temperature,top_k,top_p", [
    (1.0, 0, 1.0), (0.5, 0, 1.0), (2.0, 0, 1.0), (2.0, 3, 1.0), (1.0, 0, 0.8), (1.0, 4, 0.7), (1.5, 5, 0.9),
])
def test_frequencies_match_the_truncated_softmax(temperature, top_k, top_p):
    n = 20_000
    want = _ref_probs(LOGITS6, temperature, top_k, top_p)
    p = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    toks = _sample([LOGITS6] * n, [p] * n, [i // 100 for i in range(n)], [i % 100 for i in range(n)])
    counts = [toks.count(v) for v in range(len(LOGITS6))]
    support = [v for v in range(len(LOGITS6)) if want[v] > 0]
    assert all(counts[v] == 0 for v in range(len(LOGITS6)) if want[v] == 0), counts
    for v in support:  # each frequency within 5 binomial standard deviations
        assert abs(counts[v] / n - want[v]) <= 5 * math.sqrt(want[v] * (1 - want[v]) / n), (v, counts, want)
    if len(support) > 1:
        chi2 = sum((counts[v] - n * want[v]) ** 2 / (n * want[v]) for v in support)
        assert chi2 < CHI2_999[len(support) - 1], (chi2, counts, want)


def test_frequencies_on_a_large_vocab_put_the_mass_where_the_softmax_does():
    """Vocab 50k with 8 hot tokens: the hot mass and each hot token's share match the float64 softmax."""
    vocab, n = 50_000, 400
    logits = [0.0] * vocab
    hot = [7, 100, 4321, 9999, 20000, 33333, 40000, 49999]
    for i, v in enumerate(hot):
        logits[v] = 9.0 + 0.25 * i
    want = _ref_probs(logits, 1.0, 0, 1.0)
    toks = _sample(torch.tensor(logits).expand(n, vocab), [SamplingParams(temperature=1.0)] * n, list(range(n)), [3] * n)
    for v in hot:
        assert abs(toks.count(v) / n - want[v]) <= 5 * math.sqrt(want[v] * (1 - want[v]) / n)
    p_cold = 1 - sum(want[v] for v in hot)
    cold = sum(t not in hot for t in toks)
    assert abs(cold / n - p_cold) <= 5 * math.sqrt(p_cold * (1 - p_cold) / n)


# ---------------------------------------------------------------------------------- batch invariance
VOCAB = 300
TARGETS = {
    "temperature": SamplingParams(temperature=1.3),
    "top_k": SamplingParams(temperature=1.0, top_k=20),
    "top_p": SamplingParams(temperature=0.9, top_p=0.8),
    "top_k+top_p": SamplingParams(temperature=1.1, top_k=40, top_p=0.9),
}
CONTEXTS = {  # the other rows of the batch: they pick different paths through sample_batch
    "greedy": [GREEDY, GREEDY, GREEDY],
    "wide top_k": [SamplingParams(temperature=0.7, top_k=200), GREEDY],
    "top_p": [SamplingParams(temperature=2.0, top_p=0.5), SamplingParams(temperature=0.3)],
    "mixed": [SamplingParams(temperature=0.5, top_k=1000), GREEDY, SamplingParams(temperature=1.0, top_p=0.99),
              SamplingParams(temperature=3.0, top_k=5, top_p=0.3), SamplingParams(temperature=1.0)],
}


@pytest.mark.parametrize("target", TARGETS)
def test_a_requests_token_is_the_same_in_any_batch_at_any_row(target):
    g = torch.Generator().manual_seed(2)
    row = (torch.randn(VOCAB, generator=g) * 2).tolist()
    p = TARGETS[target]
    cases = [(seed, step) for seed in (0, 11, 2**62 + 5) for step in (0, 1, 9, 1000)]
    alone = {c: _sample([row], [p], [c[0]], [c[1]])[0] for c in cases}
    for others in CONTEXTS.values():
        for pos in range(len(others) + 1):
            other_rows = (torch.randn(len(others), VOCAB, generator=g) * 2).tolist()
            rows = other_rows[:pos] + [row] + other_rows[pos:]
            params = others[:pos] + [p] + others[pos:]
            for (seed, step), want in alone.items():
                seeds = [random.Random(seed + i).randrange(2**63) for i in range(len(rows))]
                steps = [step + i for i in range(len(rows))]
                seeds[pos], steps[pos] = seed, step
                assert _sample(rows, params, seeds, steps)[pos] == want, (target, others, pos, seed, step)
    assert len(set(alone.values())) > 1  # the noise matters: not always the argmax


# ------------------------------------------------------------------------------------- reproducibility
def test_same_seed_and_step_reproduce_and_other_seeds_or_steps_differ():
    row = (torch.randn(VOCAB, generator=torch.Generator().manual_seed(3)) * 2).tolist()
    p = SamplingParams(temperature=1.0, top_p=0.95)

    def seq(seed):
        return _sample([row] * 64, [p] * 64, [seed] * 64, list(range(64)))

    assert seq(7) == seq(7)
    assert seq(7) != seq(8)
    assert len(set(seq(7))) > 10  # the steps of one request draw different tokens
    assert seq(5) == seq(5 + 2**64) == seq(5 - 2**64)  # seeds are taken mod 2**64


def test_sample_token_is_one_row_of_sample_batch():
    row = torch.randn(VOCAB, generator=torch.Generator().manual_seed(4)) * 2
    p = SamplingParams(temperature=1.0, top_k=50)
    for seed, step in [(0, 0), (1, 5), (99, 1234)]:
        assert sample_token(row, p, seed=seed, step=step) == _sample(row[None], [p], [seed], [step])[0]
    assert sample_token(row, GREEDY) == int(row.argmax())
    with_gen = [[sample_token(row, p, gen) for _ in range(20)] for gen in (make_generator(p), make_generator(p))]
    assert len(set(with_gen[0])) > 1
    seeded = SamplingParams(temperature=1.0, top_k=50, seed=3)
    gens = (make_generator(seeded), make_generator(seeded))
    assert [sample_token(row, seeded, gens[0]) for _ in range(20)] == [sample_token(row, seeded, gens[1]) for _ in range(20)]


def test_make_seed():
    assert make_seed(SamplingParams(seed=17)) == 17
    seeds = {make_seed(SamplingParams()) for _ in range(10)}
    assert len(seeds) == 10 and all(0 <= s < 2**63 for s in seeds)


def test_copy_into_refills_a_fixed_batch():
    rows = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(5))
    static = SamplingTensors.from_params([SamplingParams(temperature=1.0, top_p=0.9)] * 3, [0] * 3, [0] * 3, "cpu")
    ids = [t.data_ptr() for t in (static.temperature, static.seed)]
    params = [GREEDY, SamplingParams(temperature=0.8, top_k=7), SamplingParams(temperature=1.2)]
    new = SamplingTensors.from_params(params, [1, 2, 3], [4, 5, 6], "cpu")
    copy_into(static, new)
    assert [t.data_ptr() for t in (static.temperature, static.seed)] == ids
    assert static.step.tolist() == [4, 5, 6] and (static.any_top_p, static.max_top_k) == (False, 7)
    assert sample_batch(rows, static).tolist() == sample_batch(rows, new).tolist()
    with pytest.raises(ValueError, match="batch size 3"):
        copy_into(static, SamplingTensors.from_params([GREEDY], [0], [0], "cpu"))


def test_from_params_values_match_the_per_field_construction():
    """The packed single-buffer tensors hold what one torch.tensor per field gives (seeds reduced mod 2**64)."""
    rng = random.Random(3)
    for b in (1, 2, 7, 64):
        params = [SamplingParams(temperature=rng.choice([0, 0.7, 1, 1.3e-7, 2.5]), top_p=rng.choice([1.0, 0.9, 0.123]),
                                 top_k=rng.choice([0, 1, 50, 10**6])) for _ in range(b)]
        seeds = [rng.choice([0, -1, 2**63 - 1, -(2**63), 2**63, 2**64 + 5, -(2**70), rng.getrandbits(63)]) for _ in range(b)]
        steps = [rng.randrange(0, 10**9) for _ in range(b)]
        t = SamplingTensors.from_params(params, seeds, steps, "cpu")
        assert torch.equal(t.temperature, torch.tensor([p.temperature for p in params], dtype=torch.float32))
        assert torch.equal(t.top_p, torch.tensor([p.top_p for p in params], dtype=torch.float32))
        assert t.top_k.tolist() == [p.top_k for p in params] and t.step.tolist() == steps
        assert t.seed.tolist() == [(s + 2**63) % 2**64 - 2**63 for s in seeds]
        assert {x.dtype for x in (t.temperature, t.top_p)} == {torch.float32}
        assert {x.dtype for x in (t.top_k, t.seed, t.step)} == {torch.int64}
        assert all(x.shape == (b,) for x in (t.temperature, t.top_p, t.top_k, t.seed, t.step))


# ------------------------------------------------------------------------------------------ errors
@pytest.mark.parametrize("kwargs,match", [
    (dict(params=[]), "params: expected at least one row"),
    (dict(seeds=[1]), "seeds, steps: expected 2 entries"),
    (dict(steps=[0, -1]), r"steps\[1\]: expected an int >= 0"),
    (dict(steps=[0, 1.0]), r"steps\[1\]"),
    (dict(seeds=[1, "x"]), r"seeds\[1\]: expected an int"),
    (dict(seeds=[True, 1]), r"seeds\[0\]: expected an int"),
    (dict(steps=[False, 0]), r"steps\[0\]"),
    (dict(params=[GREEDY, {"temperature": 1.0}]), r"params\[1\]: expected SamplingParams"),
])
def test_from_params_rejects_bad_input(kwargs, match):
    args = dict(params=[GREEDY, GREEDY], seeds=[1, 2], steps=[0, 0], device="cpu") | kwargs
    with pytest.raises(ValueError, match=match):
        SamplingTensors.from_params(**args)


def test_sample_batch_rejects_bad_logits():
    t = SamplingTensors.from_params([SamplingParams(temperature=1.0)] * 2, [1, 2], [0, 0], "cpu")
    for bad, match in [(torch.zeros(2, 5, dtype=torch.int64), "floating"), (torch.zeros(10), r"\[B, vocab\]"),
                       (torch.zeros(3, 5), "expected 2 rows"), (torch.zeros(2, 5, device="meta"), "on cpu")]:
        with pytest.raises(ValueError, match=match):
            sample_batch(bad, t)


# ------------------------------------------------------------------------------------------ property
def _allowed(logits: list[float], p: SamplingParams, slack: float = 1e-4) -> set[int]:
    """Tokens the sampler may return: a float64 reference on float32-scaled logits, ties kept, top_p + slack."""
    n = len(logits)
    logits = [float(np.float32(x)) for x in logits]  # what the sampler sees
    if p.greedy:
        return {v for v in range(n) if logits[v] == max(logits)}
    z = [float(np.float32(x) / np.float32(p.temperature)) for x in logits]
    cand = sorted((v for v in range(n) if z[v] > -math.inf), key=lambda v: -z[v])
    if 0 < p.top_k < len(cand):
        cand = [v for v in cand if z[v] >= z[cand[p.top_k - 1]]]
    if p.top_p + slack < 1:
        m = z[cand[0]]
        w = [math.exp(z[v] - m) for v in cand]
        total, acc = sum(w), 0.0
        for i, x in enumerate(w):
            acc += x / total
            if acc >= p.top_p + slack:
                cand = [v for v in cand if z[v] >= z[cand[i]]]
                break
    return set(cand)


@st.composite
def _case(draw):
    n = draw(st.integers(1, 40))
    logits = draw(st.lists(st.one_of(st.floats(-30, 30), st.just(-math.inf)), min_size=n, max_size=n))
    if all(x == -math.inf for x in logits):
        logits[draw(st.integers(0, n - 1))] = draw(st.floats(-30, 30))
    p = SamplingParams(temperature=draw(st.one_of(st.just(0.0), st.floats(1e-3, 5.0))),
                       top_p=draw(st.one_of(st.just(1.0), st.floats(1e-6, 1.0))),
                       top_k=draw(st.one_of(st.just(0), st.integers(1, 50))))
    return logits, p, draw(st.integers(-(2**70), 2**70)), draw(st.integers(0, 2**40))


@settings(max_examples=300, deadline=None)
@given(case=_case(), other=_case())
def test_the_token_is_always_in_the_allowed_set(case, other):
    logits, p, seed, step = case
    assert sample_token(torch.tensor(logits), p, seed=seed, step=step) in _allowed(logits, p)
    # the same row next to another (its own vocab, padded with -inf): the other row's paths are taken too
    width = max(len(logits), len(other[0]))
    pad = [logits + [-math.inf] * (width - len(logits)), other[0] + [-math.inf] * (width - len(other[0]))]
    got = _sample(pad, [p, other[1]], [seed, other[2]], [step, other[3]])
    assert got[0] in _allowed(logits, p) and got[1] in _allowed(other[0], other[1])


# ------------------------------------------------------------------------------------------ GPU
def _mixed_batch(b: int, vocab: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(b, vocab, generator=g) * 4
    kinds = [GREEDY, SamplingParams(temperature=0.8), SamplingParams(temperature=1.0, top_k=50),
             SamplingParams(temperature=0.7, top_p=0.9), SamplingParams(temperature=1.2, top_k=100, top_p=0.95)]
    params = [kinds[i % len(kinds)] for i in range(b)]
    return logits, params, [1000 + i for i in range(b)], [i * 3 for i in range(b)]


@pytest.mark.parametrize("b,vocab", [(1, 7), (37, 32000), (64, 128256)])
@pytest.mark.parametrize("mark", [pytest.param(None, marks=gpu)])
def test_cpu_and_cuda_agree(b, vocab, mark):
    _check_bits("cuda")
    logits, params, seeds, steps = _mixed_batch(b, vocab, b)
    assert _sample(logits, params, seeds, steps, "cuda") == _sample(logits, params, seeds, steps, "cpu")


@pytest.mark.parametrize("mark", [pytest.param(None, marks=gpu)])
def test_cuda_sampling_makes_no_host_sync(mark):
    logits, params, seeds, steps = _mixed_batch(256, 128256, 0)
    logits = logits.cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for ps in (params, [GREEDY] * 256, [SamplingParams(temperature=1.0, top_k=40)] * 256):
            out = sample_batch(logits, SamplingTensors.from_params(ps, seeds, steps, "cuda"))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert out.shape == (256,) and out.dtype == torch.int64 and out.is_cuda


@pytest.mark.parametrize("mark", [pytest.param(None, marks=gpu)])
def test_cuda_graph_replays_with_new_values(mark):
    logits, params, seeds, steps = _mixed_batch(16, 32000, 1)
    static_logits = logits.cuda()
    static = SamplingTensors.from_params(params, seeds, steps, "cuda")  # has top-p rows: the general path
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        sample_batch(static_logits, static)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = sample_batch(static_logits, static)
    for seed in range(3):
        new_logits, new_params, _, _ = _mixed_batch(16, 32000, 10 + seed)
        new_params = new_params[::-1]
        new = SamplingTensors.from_params(new_params, [seed + i for i in range(16)], [seed] * 16, "cuda")
        static_logits.copy_(new_logits)
        copy_into(static, new)
        graph.replay()
        assert static_out.tolist() == sample_batch(new_logits.cuda(), new).tolist()


def _check_row_max(x: torch.Tensor) -> None:
    want_v, want_i = x.max(dim=-1)  # torch's one-pass reduction: the reference
    got_v, got_i = row_max(x)
    assert got_v.dtype == want_v.dtype and got_i.dtype == torch.int64
    nan = torch.isnan(want_v)
    assert torch.equal(torch.isnan(got_v), nan)
    assert torch.equal(got_v[~nan], want_v[~nan]) and torch.equal(got_i[~nan], want_i[~nan])
    assert torch.isnan(x[nan.nonzero().flatten(), got_i[nan]]).all()  # a NaN row points at one of its NaNs


@pytest.mark.parametrize("b,vocab", [(1, 128256), (3, 49152), (5, 32000), (2, 16411), (300, 32768), (4, 100)])
def test_row_max_equals_torch_max(b, vocab):
    g = torch.Generator().manual_seed(vocab + b)
    x = torch.randn(b, vocab, generator=g)
    _check_row_max(x)
    # ties across pieces and inside one: the first index wins, as in argmax
    x[:, vocab // 3] = x[:, vocab - 1] = x[:, vocab - 2] = 50.0
    _check_row_max(x)
    x = torch.randint(-3, 3, (b, vocab), generator=g).float()  # many ties everywhere
    _check_row_max(x)
    x[0, :] = float("-inf")
    x[-1, vocab // 2] = float("inf")
    x[-1, vocab // 5] = float("nan")
    _check_row_max(x)
    _check_row_max(x.half())
    if b > 1:
        _check_row_max(x[:, : vocab - vocab % 2])  # a non-contiguous view


def test_row_max_pieces_divide_the_row():
    from multilora.runtime.sampling import ROW_MAX_PIECE, _row_max_piece
    for v in (128256, 49152, 32000, 151936, 262144, 256000, 102400):
        p = _row_max_piece(v)
        assert p and v % p == 0 and ROW_MAX_PIECE // 4 <= p <= ROW_MAX_PIECE * 4, (v, p)
    assert _row_max_piece(16411) == 0  # a prime: one pass


@pytest.mark.parametrize("mark", [pytest.param(None, marks=gpu)])
def test_row_max_on_cuda_equals_cpu(mark):
    g = torch.Generator().manual_seed(5)
    for b, vocab in ((1, 128256), (8, 151936), (64, 128256)):
        x = torch.randint(-20, 20, (b, vocab), generator=g).float()  # ties
        v, i = row_max(x.cuda())
        assert torch.equal(v.cpu(), x.max(dim=-1).values) and torch.equal(i.cpu(), x.argmax(dim=-1))
