"""Async scheduling (``EngineConfig.async_scheduling``): each step is launched before the step before is read back.

The step before's tokens stay on the device (``Request.pending``) and the next step takes them from there
(``runner.Feed``); stop conditions are checked one step late, and a request that stopped on an end-of-sequence
token or a stop string computes one more row whose token is dropped. The reference is the same engine reading
every step back before the next (``async_scheduling=False``): the outputs must be the same, token for token, with
chunked and unchunked prefill, preemption, the static decode path of the CUDA graphs (``enable_graphs(capture=
False)``), aborts, ``Engine.logits`` rows, end-of-sequence tokens, stop strings and ``max_seq_len``.
"""

from __future__ import annotations

import argparse

import pytest
import torch

from multilora import Engine, SamplingParams
from multilora.config import TARGET_MODULES, ModelConfig
from multilora.runtime.config import EngineConfig
from multilora.runtime.runner import Feed
from multilora.runtime.weights import MODEL_SHAPES
from testsupport import one_thread  # noqa: F401 (autouse fixture)
from testsupport import Interrupt, write_adapter

CFG = ModelConfig(**MODEL_SHAPES["tiny"])
MAX_SEQ_LEN = 48
KV_BLOCKS = 12 * 4 * CFG.num_layers * 2 * CFG.num_kv_heads * CFG.head_dim * 4  # 11 usable blocks of 4 tokens (+ the null block), fp32


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("async-adapters")
    return {f"a{i}": write_adapter(root / f"a{i}", CFG, seed=i, rank=4 + 2 * i, modules=TARGET_MODULES)
            for i in range(3)}


def _letters(ids, **_):
    """A stand-in detokenizer (the random model has no tokenizer): one letter per id, so stop strings have text."""
    return "".join(chr(65 + i % 26) for i in ids)


def _engine(adapters, async_, graphs=False, eos=(), **kw):
    kw = {"max_batch_size": 4, "max_seq_len": MAX_SEQ_LEN, "kv_block_size": 4, "max_lora_rank": 8,
          "adapter_slots": 3, **kw}
    e = Engine(CFG, device="cpu", progress=False, async_scheduling=async_, **kw)
    for name, path in adapters.items():
        e.load_adapter(name, path)
    if graphs:
        e.runner.enable_graphs(capture=False)
    e.text.__class__ = type("LetterTokenizer", (type(e.text),), {"has_text": True, "decode": staticmethod(_letters)})
    e.text.eos_ids = set(eos)
    return e


def _prompts(long=40):
    """Seven prompts; the last of ``long`` tokens (40: its row reaches ``max_seq_len``)."""
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, CFG.vocab_size, (n,), generator=g).tolist() for n in (9, 3, 14, 5, 7, 2, long)]


ADAPTER_OF = ["a0", None, "a1", "a2", "a0", None, "a1"]


def _params(stop=(), eos_row=None, budgets=(10, 2, 6, 12, 1, 8, 20)):
    """Greedy and seeded rows; the default budgets go from 1 token to past ``max_seq_len`` (the 40-token prompt's
    row)."""
    temperatures = (0.0, 0.0, 0.8, 0.0, 0.0, 1.0, 0.0)
    return [SamplingParams(max_tokens=n, temperature=t, seed=7, ignore_eos=i != eos_row,
                           stop=list(stop) if i == 3 else None) for i, (n, t) in enumerate(zip(budgets, temperatures))]


def _assert_idle(e):
    s = e.stats()
    assert s["waiting"] == s["running"] == 0
    assert s["kv_blocks_free"] == s["kv_blocks_total"]
    assert all(e.cache.get(n).refcount == 0 for n in e.list_adapters())
    assert e._ahead is None and not e.has_unfinished()


def _outputs(outs):
    return [(o.token_ids, o.finish_reason, o.text) for o in outs]


SCENARIOS = {
    "chunked": {},
    "small prefill budget": {"max_prefill_tokens": 8},
    "unchunked": {"enable_chunked_prefill": False},
    "preempting": {"max_batch_size": 6, "kv_cache_bytes": KV_BLOCKS},
    "preempting unchunked": {"max_batch_size": 6, "kv_cache_bytes": KV_BLOCKS, "enable_chunked_prefill": False},
    "static decode path": {"graphs": True},
    "static decode path, preempting": {"graphs": True, "max_batch_size": 6, "kv_cache_bytes": KV_BLOCKS},
}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_async_steps_give_the_tokens_of_steps_read_back_one_by_one(adapters, scenario):
    kw = SCENARIOS[scenario]
    preempting = "kv_cache_bytes" in kw  # the last row shorter: it fits in a cache small enough to preempt
    prompts = _prompts(long=16 if preempting else 40)
    budgets = (10, 12, 10, 12, 10, 12, 20) if preempting else (10, 2, 6, 12, 1, 8, 20)
    # the reference run without stops picks an end-of-sequence token and a stop string that really occur
    first = _engine(adapters, False, **kw).generate(prompts, adapters=ADAPTER_OF, sampling=_params(budgets=budgets))
    eos = first[0].token_ids[4]
    stop = _letters(first[3].token_ids[5:7])
    params = _params(stop=[stop], eos_row=0, budgets=budgets)
    runs = {}
    for async_ in (False, True):
        e = _engine(adapters, async_, eos=[eos], **kw)
        runs[async_] = (_outputs(e.generate(prompts, adapters=ADAPTER_OF, sampling=params)), e.stats())
        _assert_idle(e)
    (want, ref), (got, s) = runs[False], runs[True]
    assert got == want
    assert want[0][1] == "stop" and eos not in want[0][0]  # the end-of-sequence row stopped on it
    assert want[3][1] == "stop" and stop not in want[3][2]  # the stop-string row stopped on it
    if not preempting:
        assert want[6][1] == "length" and len(prompts[6]) + len(want[6][0]) == MAX_SEQ_LEN  # max_seq_len reached
    assert s["async_steps"] > 0 and ref["async_steps"] == ref["async_dropped_tokens"] == 0
    assert s["async_dropped_tokens"] >= 1  # a row computed past its stop (others were still running)
    for k in ("generated_tokens", "prompt_tokens", "requests_finished", "preemptions"):
        assert s[k] == ref[k], k
    if preempting:
        assert s["preemptions"] > 0
    if kw.get("graphs"):
        assert s["graph_steps"] > 0


def test_an_abort_while_a_token_is_pending_leaves_the_others_untouched(adapters):
    """The aborted request's drawn token is read back first (as a synchronous step would have given it), then it
    leaves; the others keep their tokens."""
    prompts, params = _prompts()[:4], [SamplingParams(max_tokens=10, ignore_eos=True, seed=3, temperature=t)
                                       for t in (0.0, 0.9, 0.0, 0.0)]
    e = _engine(adapters, True)
    reqs = [e.add_request(p, a, sp) for p, a, sp in zip(prompts, ADAPTER_OF, params)]
    victim = reqs[1]
    while len(victim.output_ids) < 3 or not victim.pending:
        e.step()
    n = len(victim.output_ids)
    assert e.abort(victim.request_id)
    assert victim.finish_reason == "abort" and len(victim.output_ids) == n + 1 and victim.pending == 0
    while e.has_unfinished():
        e.step()
    ref = _engine(adapters, False).generate(prompts, adapters=ADAPTER_OF[:4], sampling=params)
    assert victim.output_ids == ref[1].token_ids[: n + 1]
    assert [reqs[i].output_ids for i in (0, 2, 3)] == [ref[i].token_ids for i in (0, 2, 3)]
    _assert_idle(e)


def test_an_abort_after_the_last_token_was_drawn_finds_the_request_finished(adapters):
    """As without async scheduling: once the step that drew a request's last token has run, it finished by
    length, so there is nothing to abort, and nothing is left unfinished."""
    e = _engine(adapters, True)
    req = e.add_request(_prompts()[0], "a0", SamplingParams(max_tokens=3, ignore_eos=True))
    for _ in range(3):
        e.step()
    assert req.pending == 1 and e.has_unfinished()
    assert not e.abort(req.request_id)
    assert req.finish_reason == "length" and len(req.output_ids) == 3
    ref = _engine(adapters, False).generate([_prompts()[0]], adapters=["a0"],
                                            sampling=SamplingParams(max_tokens=3, ignore_eos=True))
    assert req.output_ids == ref[0].token_ids
    _assert_idle(e)


def test_logits_rows_between_async_steps(adapters):
    """``Engine.logits`` while generations run one step ahead: its rows are read back at once, the generations
    keep their tokens."""
    prompts, params = _prompts()[:3], [SamplingParams(max_tokens=9, ignore_eos=True)] * 3
    rows = [p[:6] for p in _prompts()[3:6]]
    e = _engine(adapters, True)
    reqs = [e.add_request(p, a, sp) for p, a, sp in zip(prompts, ADAPTER_OF, params)]
    for _ in range(3):
        e.step()
    assert e._ahead is not None
    got = e.logits(rows, adapters=["a2", None, "a0"])
    while e.has_unfinished():
        e.step()
    ref = _engine(adapters, False)
    torch.testing.assert_close(got, ref.logits(rows, adapters=["a2", None, "a0"]), rtol=1e-4, atol=1e-5)
    assert [r.output_ids for r in reqs] == [o.token_ids for o in ref.generate(prompts, adapters=ADAPTER_OF[:3],
                                                                                 sampling=params)]
    _assert_idle(e)


def test_non_finite_logits_fail_their_request_only(adapters, monkeypatch):
    """A row whose logits are not finite draws -1; the step ahead feeds token 0 in its place and the read-back
    fails the request, as the synchronous path does."""
    from multilora.runtime import runner as runner_mod

    prompts, params = _prompts()[:3], [SamplingParams(max_tokens=6, ignore_eos=True)] * 3
    logits_of = runner_mod.ModelRunner.run
    calls = {"n": 0}

    def poisoned(self, kind, batch, feed=None):
        out = logits_of(self, kind, batch, feed=feed)
        calls["n"] += 1
        if calls["n"] == 3:  # the third step: request 1's row becomes NaN
            rows = [r for r in batch if r.samples]
            out = out.clone()
            out[[i for i, r in enumerate(rows) if r is reqs[1]]] = float("nan")
        return out

    e = _engine(adapters, True)
    reqs = [e.add_request(p, a, sp) for p, a, sp in zip(prompts, ADAPTER_OF, params)]
    monkeypatch.setattr(runner_mod.ModelRunner, "run", poisoned)
    while e.has_unfinished():
        e.step()
    assert reqs[1].finish_reason == "error" and "not finite" in reqs[1].error
    monkeypatch.undo()
    ref = _engine(adapters, False).generate([prompts[0], prompts[2]], adapters=[ADAPTER_OF[0], ADAPTER_OF[2]],
                                            sampling=params[:2])
    assert [reqs[0].output_ids, reqs[2].output_ids] == [o.token_ids for o in ref]
    _assert_idle(e)


class _InterruptAfter(Interrupt):
    """Raises KeyboardInterrupt right after its ``at``-th call returned (the call's work done, its result lost)."""

    def __call__(self, *a, **k):
        self.calls += 1
        out = self.fn(*a, **k)
        if self.calls == self.at:
            raise KeyboardInterrupt
        return out


@pytest.mark.parametrize("where,at", [("forward", 2), ("forward", 4), ("draw", 2), ("draw", 4), ("after draw", 3),
                                      ("read back", 2), ("read back", 4), ("after read back", 3)])
def test_an_interrupt_keeps_every_request_on_its_tokens(adapters, monkeypatch, where, at):
    """An interrupt in a step's forward (a step ahead is read back, its tokens kept), in its draw or just after it
    (before the step is handed on: its tokens are lost), or in a read-back or just after it (the tokens not
    appended are lost, and those of the step launched after it dropped): the scheduler computes lost tokens again,
    and the requests, stepped on by their caller, still finish with their own tokens."""
    from multilora.runtime import engine as engine_mod

    prompts, params = _prompts()[:4], [SamplingParams(max_tokens=8, ignore_eos=True, seed=5, temperature=t)
                                       for t in (0.0, 0.9, 0.0, 1.0)]
    want = [o.token_ids for o in _engine(adapters, False).generate(prompts, adapters=ADAPTER_OF[:4], sampling=params)]
    e = _engine(adapters, True)
    if where == "forward":
        monkeypatch.setattr(e.runner, "run", Interrupt(e.runner.run, at))
    elif where == "draw":
        monkeypatch.setattr(engine_mod, "draw_tokens", Interrupt(engine_mod.draw_tokens, at))
    elif where == "after draw":  # the step's draw launched, the step not yet handed on
        monkeypatch.setattr(e, "_launch", _InterruptAfter(e._launch, at))
    elif where == "after read back":  # tokens appended, the interrupt before the step returns
        monkeypatch.setattr(e, "_read_back", _InterruptAfter(e._read_back, at))
    else:
        monkeypatch.setattr(e.postprocess, "take", Interrupt(e.postprocess.take, at))
    reqs = [e.add_request(p, a, sp) for p, a, sp in zip(prompts, ADAPTER_OF, params)]
    interrupted = 0
    while e.has_unfinished():
        try:
            e.step()
        except KeyboardInterrupt:
            interrupted += 1
            assert e._ahead is None and all(r.pending == 0 for r in reqs)
    assert interrupted == 1
    assert [r.output_ids for r in reqs] == want and all(r.finish_reason == "length" for r in reqs)
    assert e.stats()["async_steps"] > 0
    _assert_idle(e)


@pytest.mark.parametrize("q_lens,src,want", [
    (None, [0, 1, 2], [10, 11, 0]),  # a decode step in the same order (one clamp, the -1 becomes 0)
    (None, [2, -1, 0], [0, 101, 10]),  # rows reordered, one row from the host
    (None, [1, 0, -1], [11, 10, 102]),  # the first rows, swapped: not the one-kernel path
    ([3, 1, 2], [-1, 0, 1], [100, 101, 102, 10, 104, 11]),  # chunks: each pending token is its row's last
])
def test_feed_writes_the_drawn_ids_into_the_staged_tokens(q_lens, src, want):
    ids = torch.tensor([10, 11, -1])
    staged = torch.arange(100, 100 + len(want))
    Feed(ids, src).apply(staged, q_lens)
    assert staged.tolist() == want


def test_async_scheduling_option():
    assert EngineConfig().async_scheduling is None
    with pytest.raises(ValueError, match="async_scheduling"):
        EngineConfig(async_scheduling="yes")
    with pytest.raises(ValueError, match="async_scheduling.*tensor_parallel_size"):
        EngineConfig(async_scheduling=True, tensor_parallel_size=2)
    p = argparse.ArgumentParser()
    EngineConfig.add_cli_flags(p)
    assert p.parse_args([]).async_scheduling is None
    assert p.parse_args(["--async-scheduling"]).async_scheduling is True
    assert p.parse_args(["--no-async-scheduling"]).async_scheduling is False
    assert not Engine(CFG, device="cpu", progress=False, max_batch_size=2)._async  # default: off the GPU
