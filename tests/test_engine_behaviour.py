"""Engine behaviour on a tiny random Llama (GQA, SmolLM2 tokenizer): continuous batching, stopping, sampling,
chat prompts, bad input, adapter load / unload / reload, pool residency and stats.

The reference for batched results is the same request run alone (greedy, or with its own seed): continuous
batching, mixed adapters and eviction must never change a request's tokens. The tiny model's wide init keeps
greedy top-2 gaps far above fp32 noise, so "equal tokens" is the right check.
"""

from __future__ import annotations

import json
import shutil

from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from multilora import Engine, SamplingParams  # noqa: E402
from multilora.runtime.adapter_cache import UnknownAdapterError  # noqa: E402
from multilora.runtime.adapters import AdapterError  # noqa: E402
from multilora.config import TARGET_MODULES  # noqa: E402
from testsupport import tokenizer_dir as _tokenizer_dir  # noqa: E402
from testsupport import write_adapter as _write_adapter  # noqa: E402
from testsupport import tiny_llama_dir, token_ids  # noqa: E402

VOCAB = 49152
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)

# name -> (seed, rank, target modules). "a2" is another version of "a" (reload tests).
ADAPTERS = {
    "a": (1, 4, ("q_proj", "v_proj", "down_proj")),
    "b": (2, 8, TARGET_MODULES),
    "c": (3, 16, ("q_proj", "k_proj", "v_proj", "o_proj")),
    "a2": (4, 4, ("q_proj", "v_proj", "down_proj")),
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(model dir, {adapter name: dir}) of a tiny random GQA Llama with the SmolLM2 tokenizer."""
    d = tiny_llama_dir(tmp_path_factory, VOCAB)
    for f in _tokenizer_dir(tmp_path_factory).iterdir():
        shutil.copy(f, d)
    probe = Engine(model=str(d), progress=False, max_batch_size=1)
    root = tmp_path_factory.mktemp("tiny-adapters")
    dirs = {n: _write_adapter(root / n, probe.config, *spec) for n, spec in ADAPTERS.items()}
    return d, dirs


def _engine(tiny, names=("a", "b", "c"), **kw):
    d, dirs = tiny
    kw.setdefault("max_batch_size", 4)
    e = Engine(model=str(d), progress=False, **kw)
    for n in names:
        e.load_adapter(n, dirs[n])
    return e


@pytest.fixture(scope="module")
def engine(tiny):
    """A shared engine; tests that change its adapters use their own engine instead."""
    return _engine(tiny)


def _alone(engine, prompt, adapter, sampling=GREEDY):
    return engine.generate([prompt], adapters=[adapter], sampling=sampling)[0]


def _ids(n, seed):
    return token_ids(n, seed, VOCAB)


def _assert_idle(engine):
    s = engine.stats()
    assert s["waiting"] == 0 and s["running"] == 0
    assert s["kv_blocks_free"] == s["kv_blocks_total"] == engine.kv.num_usable_blocks
    assert all(engine.cache.get(n).refcount == 0 for n in engine.list_adapters())


# ------------------------------------------------------------------------------ continuous batching
REQUESTS = [  # (prompt, adapter, max_tokens): different lengths, adapters and budgets
    (_ids(5, 1), "a", 3),
    (_ids(17, 2), None, 11),
    ("The quick brown fox", "b", 5),
    (_ids(2, 3), "c", 9),
    (_ids(9, 4), "a", 6),
]


def test_adapters_change_outputs(engine):
    outs = [_alone(engine, _ids(6, 9), a).token_ids for a in (None, "a", "b", "c")]
    assert len({tuple(o) for o in outs}) == 4, "an adapter leaves the greedy tokens unchanged"


@pytest.mark.parametrize("limits", [dict(max_batch_size=2), dict(max_batch_size=3, max_prefill_tokens=8),
                                    dict(max_batch_size=3, max_prefill_tokens=8, enable_chunked_prefill=False)])
def test_continuous_batching_equals_each_request_alone(tiny, limits):
    engine = _engine(tiny, **limits)
    sps = [SamplingParams(max_tokens=n, ignore_eos=True) for _, _, n in REQUESTS]
    alone = [_alone(engine, p, a, sp) for (p, a, _), sp in zip(REQUESTS, sps)]
    before = engine.stats()
    outs = engine.generate([p for p, _, _ in REQUESTS], adapters=[a for _, a, _ in REQUESTS], sampling=sps)
    after = engine.stats()
    for (p, a, n), o, ref in zip(REQUESTS, outs, alone):
        assert o.adapter == a and o.prompt == p
        assert len(o.token_ids) == n and o.finish_reason == "length"
        assert o.token_ids == ref.token_ids and o.text == ref.text
        assert o.prompt_token_ids == ref.prompt_token_ids
    steps = ("prefill_steps", "mixed_steps")  # chunked prefill: prompts join running decodes in mixed steps
    assert sum(after[k] - before[k] for k in steps) >= 3  # 5 requests through 2 places
    assert after["requests_finished"] - before["requests_finished"] == 5
    _assert_idle(engine)


def test_a_waiting_request_joins_when_one_finishes(tiny):
    engine = _engine(tiny, max_batch_size=2)
    reqs = [engine.add_request(p, a, SamplingParams(max_tokens=n, ignore_eos=True)) for p, a, n in REQUESTS]
    admitted_at, finished_at, step = {}, {}, 0
    while engine.has_unfinished():
        done = engine.step()
        step += 1
        running = engine.scheduler.running
        assert len(running) <= 2
        for r in running:
            admitted_at.setdefault(r.request_id, step)
        for r in done:
            finished_at[r.request_id] = step
    ids = [r.request_id for r in reqs]
    assert set(finished_at) == set(ids)
    # request 0 (3 tokens) finishes while request 1 (11 tokens) runs; request 2 joins before 1 finishes
    assert finished_at[ids[0]] < admitted_at[ids[2]] < finished_at[ids[1]]
    assert all(r.finish_reason == "length" and len(r.output_ids) == n for r, (_, _, n) in zip(reqs, REQUESTS))


# ------------------------------------------------------------------------------------ finish reasons
def test_finish_reason_length(engine):
    o = _alone(engine, _ids(4, 5), "b", SamplingParams(max_tokens=5, ignore_eos=True))
    assert o.finish_reason == "length" and len(o.token_ids) == 5 and o.error is None
    assert o.text == engine.tokenizer.decode(o.token_ids, skip_special_tokens=True)


def test_stop_strings_cut_the_text(engine):
    prompt = _ids(6, 6)
    full = _alone(engine, prompt, None, SamplingParams(max_tokens=16, ignore_eos=True))
    text = full.text
    stop = None
    for tok in full.token_ids[3:]:  # a word-like piece that first occurs after the start of the text
        piece = engine.tokenizer.decode([tok]).strip()
        if len(piece) >= 2 and piece.isascii() and piece.isalnum() and text.find(piece) > 0:
            stop = piece
            break
    assert stop is not None, f"no usable stop piece in {text!r}"
    cut = text.find(stop)
    o = _alone(engine, prompt, None, SamplingParams(max_tokens=16, ignore_eos=True, stop=["never-occurs-qq", stop]))
    assert o.finish_reason == "stop"
    assert o.text == text[:cut]
    assert len(o.token_ids) < 16 and o.token_ids == full.token_ids[: len(o.token_ids)]
    assert stop in engine.tokenizer.decode(o.token_ids)  # it stopped on the token that completed the stop string
    assert stop not in engine.tokenizer.decode(o.token_ids[:-1])
    single = _alone(engine, prompt, None, SamplingParams(max_tokens=16, ignore_eos=True, stop=stop))  # a str
    assert single.text == o.text and single.finish_reason == "stop"


def test_eos_ends_generation(tiny, tmp_path):
    """A copy of the tiny model whose config names, as end-of-sequence, the 4th token greedy decoding makes."""
    d, _ = tiny
    engine = Engine(model=str(d), progress=False, max_batch_size=2)
    prompt = _ids(7, 7)
    full = _alone(engine, prompt, None, SamplingParams(max_tokens=10, ignore_eos=True))
    k = next(i for i in range(3, 10) if full.token_ids[i] not in full.token_ids[:i])
    eos = full.token_ids[k]
    d2 = tmp_path / "tiny-eos"
    shutil.copytree(d, d2)
    cfg = json.loads((d2 / "config.json").read_text())
    cfg["eos_token_id"] = [2, eos]
    (d2 / "config.json").write_text(json.dumps(cfg))
    e2 = Engine(model=str(d2), progress=False, max_batch_size=2)
    o = _alone(e2, prompt, None, SamplingParams(max_tokens=10))
    assert o.finish_reason == "stop"
    assert o.token_ids == full.token_ids[:k]  # the eos token itself is not included
    assert o.text == e2.tokenizer.decode(full.token_ids[:k], skip_special_tokens=True)
    assert _alone(e2, prompt, None, SamplingParams(max_tokens=10, ignore_eos=True)).token_ids == full.token_ids


# ------------------------------------------------------------------------------------------ sampling
@pytest.mark.parametrize("field,value", [
    ("max_tokens", 0), ("max_tokens", -3), ("max_tokens", 2.5),
    ("temperature", -0.1), ("temperature", float("nan")),
    ("top_p", 0.0), ("top_p", 1.01), ("top_p", float("nan")),
    ("top_k", -1), ("top_k", 1.5),
    ("stop", [""]), ("stop", ["ok", 3]), ("max_tokens_must_fit", "yes"),
])
def test_sampling_params_validation_names_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch(engine):
    sp = SamplingParams(max_tokens=10, temperature=1.5, seed=1234, ignore_eos=True)
    prompt = _ids(5, 10)
    first = _alone(engine, prompt, "a", sp)
    assert _alone(engine, prompt, "a", sp).token_ids == first.token_ids
    others = [SamplingParams(max_tokens=4, temperature=1.5, seed=99, ignore_eos=True), GREEDY,
              SamplingParams(max_tokens=12, temperature=0.7, top_p=0.9, ignore_eos=True)]
    outs = engine.generate([_ids(11, 11), _ids(3, 12), prompt, "hello"], adapters=["b", None, "a", "c"],
                           sampling=[others[0], others[1], sp, others[2]])
    assert outs[2].token_ids == first.token_ids
    other_seed = _alone(engine, prompt, "a", SamplingParams(max_tokens=10, temperature=1.5, seed=4321, ignore_eos=True))
    assert other_seed.token_ids != first.token_ids


def test_top_k_1_and_tiny_top_p_equal_greedy(engine):
    prompt = _ids(8, 13)
    greedy = _alone(engine, prompt, "b", SamplingParams(max_tokens=10, ignore_eos=True))
    for sp in (SamplingParams(max_tokens=10, temperature=1.0, top_k=1, seed=5, ignore_eos=True),
               SamplingParams(max_tokens=10, temperature=1.0, top_p=1e-9, seed=5, ignore_eos=True)):
        assert _alone(engine, prompt, "b", sp).token_ids == greedy.token_ids


# ------------------------------------------------------------------------------------------ prompts
def test_chat_messages_apply_the_template(engine):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    tok = engine.tokenizer
    text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>assistant\n") and "Name a colour." in text
    want = tok(text, add_special_tokens=False)["input_ids"]
    assert engine.tokenize(msgs) == want
    o = _alone(engine, msgs, "a")
    assert o.prompt_token_ids == want and o.prompt == msgs
    assert o.token_ids == _alone(engine, want, "a").token_ids
    single = engine.generate(msgs, adapters="a", sampling=GREEDY)  # one conversation, not a list of them
    assert len(single) == 1 and single[0].token_ids == o.token_ids


def test_text_prompt_tokenizes_like_the_tokenizer(engine):
    o = _alone(engine, "Hello there, how are you?", None)
    assert o.prompt_token_ids == engine.tokenizer("Hello there, how are you?")["input_ids"]


# -------------------------------------------------------------------------------------- bad requests
@pytest.fixture(scope="module")
def reference_run(engine):
    prompts, adapters = [_ids(4, 20), "Bonjour", _ids(9, 21)], ["a", None, "c"]
    return prompts, adapters, [o.token_ids for o in engine.generate(prompts, adapters=adapters, sampling=GREEDY)]


def _still_serves(engine, reference_run):
    _assert_idle(engine)
    prompts, adapters, want = reference_run
    assert [o.token_ids for o in engine.generate(prompts, adapters=adapters, sampling=GREEDY)] == want


def test_unknown_adapter_names_the_index(engine, reference_run):
    with pytest.raises(UnknownAdapterError, match=r"prompts\[2\].*'nope'") as ei:
        engine.generate(["x", "y", "z"], adapters=["a", None, "nope"], sampling=GREEDY)
    assert isinstance(ei.value, KeyError)
    _still_serves(engine, reference_run)


@pytest.mark.parametrize("kwargs,match", [
    (dict(adapters=["a", None]), r"adapters: expected 3 entries.*got 2"),
    (dict(adapters=["a", None, None, "b"]), r"adapters: expected 3 entries.*got 4"),
    (dict(sampling=[GREEDY, GREEDY]), r"sampling: expected 3 entries.*got 2"),
])
def test_mismatched_lengths_are_rejected(engine, reference_run, kwargs, match):
    kwargs.setdefault("sampling", GREEDY)
    with pytest.raises(ValueError, match=match):
        engine.generate(["x", "y", "z"], **kwargs)
    _still_serves(engine, reference_run)


@pytest.mark.parametrize("bad", [3.5, [], [1, -2], [1, VOCAB], [{"content": "no role"}]])
def test_bad_prompt_names_the_index(engine, reference_run, bad):
    with pytest.raises(ValueError, match=r"prompts\[1\]"):
        engine.generate(["fine", bad, "also fine"], adapters=["a", None, "b"], sampling=GREEDY)
    _still_serves(engine, reference_run)


def test_prompt_longer_than_max_seq_len_is_rejected(tiny):
    engine = _engine(tiny, names=("a",), max_seq_len=16, max_batch_size=2)
    with pytest.raises(ValueError, match=r"prompts\[0\].*max_seq_len=16"):
        engine.generate([_ids(16, 30)], sampling=GREEDY)
    with pytest.raises(ValueError, match=r"prompts\[1\]"):
        engine.generate([_ids(3, 31), _ids(40, 31)], adapters=[None, "a"], sampling=GREEDY)
    with pytest.raises(ValueError, match=r"token_ids\[0\]"):
        engine.logits([_ids(17, 32)])
    _assert_idle(engine)
    edge = engine.generate([_ids(15, 33), _ids(10, 34)], adapters=["a", None],
                           sampling=SamplingParams(max_tokens=20, ignore_eos=True))
    assert [len(o.token_ids) for o in edge] == [1, 6]  # prompt + generated stops at max_seq_len
    assert all(o.finish_reason == "length" for o in edge)
    must_fit = SamplingParams(max_tokens=7, ignore_eos=True, max_tokens_must_fit=True)
    with pytest.raises(ValueError, match=r"prompts\[1\]: max_tokens: 10 prompt tokens \+ max_tokens=7 = 17 tokens "
                                         r"exceed .* max_seq_len=16: ask for at most 6 tokens"):
        engine.generate([_ids(3, 35), _ids(10, 34)], adapters=[None, "a"], sampling=must_fit)
    _assert_idle(engine)
    must_fit.max_tokens = 6  # exactly the context: served, and the same tokens as capped
    assert engine.generate([_ids(10, 34)], adapters=[None], sampling=must_fit)[0].token_ids == edge[1].token_ids
    assert engine.logits([_ids(16, 32)]).shape == (1, VOCAB)


# ------------------------------------------------------------------------------- adapter lifecycle
def test_unload_then_generate_fails_cleanly(tiny):
    engine = _engine(tiny)
    p = _ids(6, 40)
    want = {a: _alone(engine, p, a).token_ids for a in ("b", "c", None)}
    engine.unload_adapter("a")
    assert engine.list_adapters() == ["b", "c"]
    with pytest.raises(UnknownAdapterError, match="'a'"):
        engine.generate([p, p], adapters=["b", "a"], sampling=GREEDY)
    with pytest.raises(UnknownAdapterError):
        engine.logits([p], adapters=["a"])
    with pytest.raises(UnknownAdapterError):
        engine.unload_adapter("a")
    _assert_idle(engine)
    outs = engine.generate([p, p, p], adapters=["b", "c", None], sampling=GREEDY)
    assert [o.token_ids for o in outs] == [want["b"], want["c"], want[None]]


def test_reload_changes_outputs_for_new_requests(tiny):
    _, dirs = tiny
    engine = _engine(tiny, names=("a", "b"))
    p = _ids(7, 41)
    v1 = _alone(engine, p, "a").token_ids
    b = _alone(engine, p, "b").token_ids
    engine.load_adapter("v2", dirs["a2"])
    v2 = _alone(engine, p, "v2").token_ids
    assert v1 != v2
    engine.load_adapter("a", dirs["a2"])
    assert _alone(engine, p, "a").token_ids == v2
    assert _alone(engine, p, "b").token_ids == b
    assert engine.cache.get("a").path == Path(dirs["a2"])


def test_reload_keeps_the_running_request_on_its_version(tiny):
    _, dirs = tiny
    engine = _engine(tiny, names=("a",))
    p = _ids(7, 42)
    sp = SamplingParams(max_tokens=8, ignore_eos=True)
    v1 = _alone(engine, p, "a", sp).token_ids
    req = engine.add_request(p, "a", sp)
    engine.step()  # prefill: the request is running with version 1
    engine.load_adapter("a", dirs["a2"])
    while engine.has_unfinished():
        engine.step()
    assert req.output_ids == v1
    engine.load_adapter("v2", dirs["a2"])
    assert _alone(engine, p, "a", sp).token_ids == _alone(engine, p, "v2", sp).token_ids != v1
    assert engine.pool.slots_used == len(engine.cache.resident())  # the old version left the pool


def test_unload_keeps_the_running_request_on_its_weights(tiny):
    engine = _engine(tiny, names=("a", "b"))
    p = _ids(6, 46)
    sp = SamplingParams(max_tokens=8, ignore_eos=True)
    want = _alone(engine, p, "a", sp).token_ids
    req = engine.add_request(p, "a", sp)
    engine.step()
    engine.unload_adapter("a")
    while engine.has_unfinished():
        engine.step()
    assert req.finish_reason == "length" and req.output_ids == want
    assert "a" not in engine.cache.resident()
    assert engine.pool.slots_used == len(engine.cache.resident())  # version 1 left the pool when it finished


@pytest.mark.parametrize("name", ["", None, 3])
def test_load_adapter_bad_name(engine, tiny, name):
    with pytest.raises(ValueError, match="name"):
        engine.load_adapter(name, tiny[1]["a"])
    assert engine.list_adapters() == ["a", "b", "c"]


def test_unload_while_a_request_waits_does_not_wedge_the_engine(tiny):
    engine = _engine(tiny, names=("a", "b"))
    p = _ids(5, 43)
    want_b = _alone(engine, p, "b").token_ids
    req = engine.add_request(p, "a", GREEDY)
    engine.unload_adapter("a")
    for _ in range(50):  # the queued request must finish (with an error naming the adapter, or served)
        if not engine.has_unfinished():
            break
        engine.step()
    assert not engine.has_unfinished()
    assert req.finish_reason in ("error", "length")
    if req.finish_reason == "error":
        assert "'a'" in req.error
    assert _alone(engine, p, "b").token_ids == want_b


def test_reload_while_a_request_waits_serves_it(tiny):
    _, dirs = tiny
    engine = _engine(tiny, names=("a",))
    p = _ids(5, 44)
    v1 = _alone(engine, p, "a").token_ids
    engine.unload_adapter("a")  # so version 1 is not resident when the request is queued
    engine.load_adapter("a", dirs["a"])
    req = engine.add_request(p, "a", GREEDY)
    engine.load_adapter("a", dirs["a2"])  # reloading affects new requests only
    for _ in range(50):
        if not engine.has_unfinished():
            break
        engine.step()
    assert req.finish_reason == "length" and req.output_ids == v1


@pytest.mark.parametrize("breakage", ["missing-weights", "bad-json", "wrong-shape", "rank-too-big", "no-dir"])
def test_failed_load_leaves_previous_version_and_others(tiny, tmp_path, breakage):
    from safetensors.torch import load_file, save_file

    _, dirs = tiny
    engine = _engine(tiny, names=("a", "b"), max_lora_rank=8)
    p = _ids(6, 45)
    want = {a: _alone(engine, p, a).token_ids for a in ("a", "b", None)}
    pages, names = engine.pool.pages_used, engine.list_adapters()
    bad = tmp_path / "bad"
    shutil.copytree(dirs["a2"], bad)
    if breakage == "missing-weights":
        (bad / "adapter_model.safetensors").unlink()
    elif breakage == "bad-json":
        (bad / "adapter_config.json").write_text('{"r": 4, "lora_alpha": ')
    elif breakage == "wrong-shape":
        t = load_file(str(bad / "adapter_model.safetensors"))
        key = next(k for k in t if "lora_A" in k)
        t[key] = torch.zeros(t[key].shape[0], t[key].shape[1] + 1)
        save_file(t, str(bad / "adapter_model.safetensors"))
    elif breakage == "rank-too-big":
        shutil.rmtree(bad)
        bad = dirs["c"]  # rank 16 > max_lora_rank 8
    else:
        bad = tmp_path / "does-not-exist"
    with pytest.raises(AdapterError) as ei:
        engine.load_adapter("a", bad)
    assert str(bad) in str(ei.value)  # the message names the file or directory at fault
    if breakage == "rank-too-big":
        assert "max_lora_rank" in str(ei.value)
    assert engine.list_adapters() == names and engine.pool.pages_used == pages
    assert {a: _alone(engine, p, a).token_ids for a in ("a", "b", None)} == want
    with pytest.raises(AdapterError):
        engine.load_adapter("new", bad)
    assert "new" not in engine.list_adapters()


# ------------------------------------------------------------------------------------- pool residency
def test_pool_pages_return_after_requests_finish(tiny):
    engine = _engine(tiny)
    p = _ids(5, 50)
    engine.generate([p] * 4, adapters=["a", "b", "c", None], sampling=GREEDY)
    _assert_idle(engine)
    resident = engine.cache.resident()
    assert sorted(resident) == ["a", "b", "c"]
    expected = sum(engine.cache.get(n).pool_bytes for n in resident) // engine.pool.page_bytes
    cfg = engine.config  # each adapter: its rank x (d_in + d_out) per module it targets, in 64-element pages
    exact = sum(cfg.num_layers * sum(-(-r * sum(cfg.module_shape(m)) // 64) for m in modules)
                for n, (_, r, modules) in ADAPTERS.items() if n in resident)
    assert engine.pool.pages_used == expected == engine.stats()["pool_pages_used"] == exact
    assert engine.stats()["pool_bytes_used"] == exact * engine.pool.page_bytes
    for n in ("a", "b", "c"):
        engine.unload_adapter(n)
    assert engine.pool.pages_used == 0 and engine.pool.slots_used == 0
    assert engine.stats()["kv_blocks_free"] == engine.kv.num_usable_blocks


def test_more_adapters_than_the_pool_holds(tiny, engine):
    """A pool of one slot (and the bytes of one rank-16 adapter on every module): a, b and c take turns."""
    small = _engine(tiny, adapter_slots=1, max_lora_rank=16, max_batch_size=4)
    assert small.pool.max_slots == 1 and small.pool.num_pages == small.pool.max_adapter_pages
    batch = [("c", 5, 1), ("a", 7, 2), (None, 3, 3), ("b", 6, 4), ("c", 9, 5), ("a", 4, 6), ("b", 2, 7)]
    prompts = [_ids(n, s) for _, n, s in batch]
    adapters = [a for a, _, _ in batch]
    sps = [SamplingParams(max_tokens=3 + i, ignore_eos=True) for i in range(len(batch))]
    want = [_alone(engine, p, a, sp).token_ids for p, a, sp in zip(prompts, adapters, sps)]
    outs = small.generate(prompts, adapters=adapters, sampling=sps)
    assert [o.finish_reason for o in outs] == ["length"] * len(batch)
    assert [o.token_ids for o in outs] == want
    assert small.stats()["gpu_evictions"] > 0
    assert small.pool.pages_used <= small.pool.num_pages and small.pool.slots_used <= 1
    logits = small.logits(prompts, adapters=adapters)
    ref = engine.logits(prompts, adapters=adapters)
    assert float((logits - ref).norm() / ref.norm()) < 1e-5


def test_pinned_adapter_filling_the_pool_fails_others_cleanly(tiny):
    engine = _engine(tiny, names=("a", "b"), adapter_slots=1, max_lora_rank=8, max_batch_size=2)
    assert engine.pool.max_slots == 1
    engine.pin_adapter("a")
    p = _ids(4, 60)
    want_base = _alone(engine, p, None).token_ids
    _alone(engine, p, "a")  # now resident and pinned
    outs = engine.generate([p, p], adapters=["b", None], sampling=GREEDY)
    assert outs[0].finish_reason == "error" and "pool" in outs[0].error
    assert outs[1].finish_reason == "length" and outs[1].token_ids == want_base
    engine.pin_adapter("a", False)
    assert _alone(engine, p, "b").finish_reason == "length"
    _assert_idle(engine)


def test_pool_rows_an_adapter_does_not_write_are_never_read(tiny, engine):
    """The pool buffer is not initialised: poison it with NaN before loading; no output may change."""
    poisoned = _engine(tiny, names=())
    poisoned.pool.buffer.fill_(float("nan"))
    _, dirs = tiny
    for n in ("a", "b", "c"):  # a and c leave modules out: nothing of them is in the pool, and padding is never read
        poisoned.load_adapter(n, dirs[n])
    prompts, adapters = [_ids(5, 90), _ids(8, 91), _ids(3, 92), _ids(6, 93)], ["a", None, "c", "b"]
    want = [o.token_ids for o in engine.generate(prompts, adapters=adapters, sampling=GREEDY)]
    assert [o.token_ids for o in poisoned.generate(prompts, adapters=adapters, sampling=GREEDY)] == want
    lg = poisoned.logits(prompts, adapters=adapters)
    assert torch.isfinite(lg).all()
    ref = engine.logits(prompts, adapters=adapters)
    assert float((lg - ref).norm() / ref.norm()) < 1e-6


# ----------------------------------------------------------------------------------- no tokenizer
def test_model_without_tokenizer_serves_token_ids(tiny, engine, tmp_path):
    d, _ = tiny
    bare = tmp_path / "bare"
    bare.mkdir()
    for f in ("config.json", "model.safetensors"):
        shutil.copy(d / f, bare / f)
    e = Engine(model=str(bare), progress=False, max_batch_size=2)
    p = _ids(6, 80)
    o = _alone(e, p, None)
    assert o.token_ids == _alone(engine, p, None).token_ids and o.text == ""
    with pytest.raises(ValueError, match=r"prompts\[1\].*token ids"):
        e.generate([p, "text needs a tokenizer"], sampling=GREEDY)
    assert _alone(e, p, None).token_ids == o.token_ids


# ------------------------------------------------------------------------------------------------ stats
def test_stats_keys(engine):
    s = engine.stats()
    for k in ("steps", "prefill_steps", "decode_steps", "prompt_tokens", "generated_tokens", "requests_finished",
              "requests_failed", "adapters_loaded", "adapters_resident", "pool_pages_total", "pool_pages_used",
              "pool_page_bytes", "gpu_hits", "gpu_misses", "gpu_evictions", "host_hits", "host_misses", "host_evictions",
              "bytes_host_to_gpu", "bytes_disk_to_host", "prefetch_hits", "queue_wait_seconds_total", "kv_blocks_total",
              "kv_blocks_free", "kv_block_size", "preemptions", "recomputed_tokens", "mixed_steps", "prefill_chunks",
              "waiting", "running"):
        assert k in s, k
    assert s["adapters_loaded"] == 3
    assert s["steps"] == s["prefill_steps"] + s["decode_steps"] + s["mixed_steps"]
    assert s["prefill_chunks"] >= s["prefill_steps"]
    json.dumps(s)  # plain values (the CLI prints it)
    o = _alone(engine, _ids(3, 70), "a", SamplingParams(max_tokens=4, ignore_eos=True))
    s2 = engine.stats()
    assert s2["generated_tokens"] - s["generated_tokens"] == 4 == len(o.token_ids)
    assert s2["prompt_tokens"] - s["prompt_tokens"] == 3
    assert s2["requests_finished"] - s["requests_finished"] == 1
    assert engine.last_run["generated_tokens"] == 4 and engine.last_run["tokens_per_second"] > 0


def test_all_greedy_step_samples_as_sample_batch():
    """A step whose requests are all greedy skips the sampling tensors; its tokens are sample_batch's."""
    from types import SimpleNamespace

    from multilora.config import ModelConfig
    from multilora.runtime.postprocess import sample_tokens
    from multilora.runtime.sampling import SamplingTensors, sample_batch
    from multilora.runtime.weights import MODEL_SHAPES

    e = Engine(ModelConfig(**MODEL_SHAPES["tiny"]), device="cpu", progress=False, max_batch_size=4, max_seq_len=32)
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, e.config.vocab_size, generator=g)
    logits[1, 7] = logits[1, 9] = logits[1].max() + 1  # a tie: the first index wins in both
    for temps in ([0, 0, 0, 0], [0, 0.8, 0, 1.0]):
        batch = [SimpleNamespace(params=SamplingParams(temperature=t, seed=i), seed=100 + i, output_ids=[1] * i, pending=0)
                 for i, t in enumerate(temps)]
        want = sample_batch(logits, SamplingTensors.from_params([r.params for r in batch], [r.seed for r in batch],
                                                                [len(r.output_ids) for r in batch], "cpu")).tolist()
        assert sample_tokens(batch, logits) == want
    e.cache.close()
