"""Hardening of requests, sampling and interrupts (issue 15, items 2, 3, 4, 5, 8), and a fuzz suite that keeps it.

What a hostile but fair user found, each now a test that failed before the fix:

- 2: an interrupt (KeyboardInterrupt) or an exception at any point of a step leaves the engine consistent:
  ``generate()`` / ``logits()`` withdraw their own requests; requests submitted with ``add_request`` survive and
  finish with the tokens they would have had;
- 3: every ``SamplingParams`` field is checked (type and range), and a batched draw that still fails (a value
  changed after construction) fails only the request that caused it;
- 4: one chat message dict (not in a list) is one chat prompt;
- 5: a request whose logits are not finite (an adapter that overflows in compute) fails alone, naming its adapter;
- 8: bad values give a ValueError naming the field or the prompt index, never a raw TypeError.

The fuzz tests mix random malformed sampling values and prompts into good batches: each bad one is refused with a
ValueError of the documented form, nothing is run for a refused call, and the engine still gives the reference
outputs afterwards. ``MULTILORA_FUZZ=long`` runs more examples (a longer profile for on-demand runs).
"""

from __future__ import annotations

import math
import os
import shutil

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

transformers = pytest.importorskip("transformers")

from multilora import Engine, SamplingParams  # noqa: E402
from multilora.runtime import postprocess  # noqa: E402
from multilora.runtime.tokenizer import SHORT_PREFIX_CHARS_PER_TOKEN, TEXT_BYTES_PER_TOKEN_FACTOR  # noqa: E402
from testsupport import Interrupt  # noqa: E402
from multilora.runtime.adapters import save_peft_adapter  # noqa: E402
from testsupport import tiny_llama_dir, token_ids, tokenizer_dir, write_adapter  # noqa: E402

VOCAB = 49152
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
LONG = os.environ.get("MULTILORA_FUZZ") == "long"
FUZZ = settings(max_examples=300 if LONG else 25, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                                        HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(model dir, {adapter name: dir}): the tiny random GQA Llama with the SmolLM2 tokenizer, two adapters and
    one whose finite weights overflow float32 in compute ("hot": |A|, |B| = 1e30)."""
    d = tiny_llama_dir(tmp_path_factory, VOCAB, name="tiny-hardening")
    for f in tokenizer_dir(tmp_path_factory).iterdir():
        shutil.copy(f, d)
    probe = Engine(model=str(d), progress=False, max_batch_size=1)
    cfg = probe.config
    root = tmp_path_factory.mktemp("hardening-adapters")
    dirs = {"a": write_adapter(root / "a", cfg, seed=1, rank=4, modules=("q_proj", "v_proj")),
            "b": write_adapter(root / "b", cfg, seed=2, rank=8, modules=("gate_proj", "up_proj", "down_proj"))}
    hot = {(layer, "o_proj"): (torch.full((2, cfg.q_size), 1e30), torch.full((cfg.hidden_size, 2), 1e30))
           for layer in range(cfg.num_layers)}
    dirs["hot"] = save_peft_adapter(root / "hot", hot, r=2, lora_alpha=2, target_modules=["o_proj"])
    return d, dirs


def _engine(tiny, **kw):
    d, dirs = tiny
    e = Engine(model=str(d), progress=False, max_batch_size=kw.pop("max_batch_size", 4), **kw)
    for n, p in dirs.items():
        e.load_adapter(n, p)
    return e


@pytest.fixture(scope="module")
def engine(tiny):
    return _engine(tiny)


PROMPTS = [token_ids(5, 1, VOCAB), token_ids(9, 2, VOCAB), token_ids(3, 3, VOCAB)]
ADAPTERS = ["a", None, "b"]


@pytest.fixture(scope="module")
def reference(engine):
    """Each prompt's tokens run alone (the reference for every batch below)."""
    return [engine.generate([p], adapters=[a], sampling=GREEDY)[0].token_ids for p, a in zip(PROMPTS, ADAPTERS)]


def _idle(e: Engine) -> None:
    s = e.stats()
    assert s["waiting"] == s["running"] == 0, (s["waiting"], s["running"])
    assert s["kv_blocks_free"] == s["kv_blocks_total"]
    assert all(e.cache.get(n).refcount == 0 for n in e.list_adapters())


def _still_serves(e: Engine, reference) -> None:
    _idle(e)
    assert [o.token_ids for o in e.generate(PROMPTS, adapters=ADAPTERS, sampling=GREEDY)] == reference
    _idle(e)


# ---------------------------------------------------------------------------------- 3 and 8: sampling values
@pytest.mark.parametrize("field,value", [
    ("seed", "abc"), ("seed", 1.5), ("seed", True), ("top_k", 2**63), ("top_k", 2.0), ("top_k", -1),
    ("temperature", "1.0"), ("temperature", None), ("temperature", float("nan")), ("temperature", math.inf),
    ("temperature", -0.5), ("temperature", 1e308), ("top_p", "0.9"), ("top_p", float("nan")), ("top_p", 0), ("top_p", 1.5),
    ("max_tokens", 0), ("max_tokens", 2.0), ("max_tokens", None), ("stop", 3), ("stop", [""]), ("stop", [None]),
    ("ignore_eos", "yes"), ("ignore_eos", None), ("max_tokens_fit_kv", "yes"),
])
def test_every_sampling_field_is_checked(field, value):
    with pytest.raises(ValueError, match=rf"^SamplingParams\.{field}: expected .*, got "):
        SamplingParams(**{field: value})


def test_sampling_values_that_are_accepted():
    import numpy as np

    assert SamplingParams(stop=None).stop == [] and SamplingParams(stop="x").stop == ["x"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    p = SamplingParams(max_tokens=np.int64(3), temperature=np.float32(0.5), top_k=np.int32(4), seed=2**70,
                       ignore_eos=np.bool_(True))
    assert (type(p.max_tokens), type(p.temperature), type(p.top_k), type(p.ignore_eos)) == (int, float, int, bool)


def test_one_requests_draw_failing_fails_only_that_request(engine, reference, monkeypatch):
    """If the batched draw fails because of one request (here: the packing refuses seed 13, standing in for any
    value no check foresaw), each request is drawn alone and only that one fails; its neighbours, greedy and
    sampled, keep their reference tokens."""
    sampled = SamplingParams(max_tokens=6, temperature=0.8, seed=5, ignore_eos=True)
    want_sampled = engine.generate([PROMPTS[1]], sampling=sampled)[0].token_ids
    pack = postprocess.SamplingTensors.from_params

    def refuse_13(params, seeds, steps, device):
        if 13 in seeds:
            raise ValueError("seeds: 13 cannot be packed")
        return pack(params, seeds, steps, device)

    monkeypatch.setattr(postprocess.SamplingTensors, "from_params", staticmethod(refuse_13))
    unlucky = SamplingParams(max_tokens=6, temperature=0.8, seed=13, ignore_eos=True)
    outs = engine.generate(PROMPTS + [PROMPTS[1], PROMPTS[1]], adapters=ADAPTERS + [None, None],
                           sampling=[GREEDY, GREEDY, GREEDY, unlucky, sampled])
    assert [o.token_ids for o in outs[:3]] == reference and outs[4].token_ids == want_sampled
    assert outs[3].finish_reason == "error" and "13 cannot be packed" in outs[3].error
    monkeypatch.undo()
    _idle(engine)


@pytest.mark.parametrize("bad,field", [({"temperature": "hot"}, "temperature"), ({"top_p": "0.9"}, "top_p"),
                                       ({"stop": 7}, "stop"), ({"seed": 2.5}, "seed")])
def test_bad_sampling_values_name_the_field(engine, reference, bad, field):
    """Refused at construction, and again at submission when set afterwards (naming the prompt's index)."""
    with pytest.raises(ValueError, match=rf"^SamplingParams\.{field}: "):
        SamplingParams(**bad)
    with pytest.raises(ValueError, match=rf"^prompts\[1\]: SamplingParams\.{field}: "):
        engine.generate(PROMPTS[:2], sampling=[GREEDY, _Unchecked(bad)])
    _still_serves(engine, reference)


def _Unchecked(overrides):
    """SamplingParams whose fields were set after construction (the engine must check again)."""
    p = SamplingParams(max_tokens=4)
    for k, v in overrides.items():
        object.__setattr__(p, k, v)
    return p


# ---------------------------------------------------------------------------------------- 4 and 8: prompts
def test_one_message_dict_is_one_chat_prompt(engine):
    msg = {"role": "user", "content": "Hi"}
    one = engine.generate(msg, sampling=GREEDY)
    assert len(one) == 1 and one[0].token_ids == engine.generate([[msg]], sampling=GREEDY)[0].token_ids
    assert one[0].prompt_token_ids == engine.tokenize([msg])


@pytest.mark.parametrize("prompts,match", [
    (None, r"prompts: expected a prompt or a list of prompts, got NoneType"),
    (42, r"prompts: expected a prompt or a list of prompts, got int"),
    (["fine", [{"role": "user", "content": None}]], r"prompts\[1\]: .*chat message 0: 'content' must be a string, got NoneType"),
    (["fine", [{"role": "user", "content": 3}]], r"prompts\[1\]: .*'content' must be a string, got int"),
    (["fine", [{"role": 1, "content": "x"}]], r"prompts\[1\]: .*'role' must be a string"),
    (["fine", [{"role": "usr", "content": "x"}]], r"prompts\[1\]: .*chat message 0: 'role' must be one of assistant, "
                                                   r"developer, .*user, got 'usr'"),
    (["fine", []], r"prompts\[1\]: prompt: expected at least one token id, got an empty list"),
    (["fine", ""], r"prompts\[1\]: prompt: the text tokenizes to zero tokens"),
    (["fine", "bad \ud800 text"], r"prompts\[1\]: prompt: not valid Unicode text \(surrogates not allowed at index 4\)"),
    ([[{"role": "user", "content": "ok \udfff"}]], r"prompts\[0\]: .*'content': not valid Unicode"),
    (["fine", [5, "a"]], r"prompts\[1\]: prompt: token ids must be ints, got str 'a' at index 1$"),
    (["fine", [5.0, 6.0]], r"prompts\[1\]: prompt: token ids must be ints, got float 5.0 at index 0$"),
    ([[5, True]], r"prompts\[0\]: prompt: token ids must be ints, got bool True at index 1$"),
    ([torch.tensor([1.0, 2.0])], r"prompts\[0\]: prompt: expected a string, .* got Tensor of dtype torch.float32 "
                                 r"and shape \(2,\)$"),
    ([torch.tensor([[1, 2]])], r"prompts\[0\]: prompt: expected a string, .* got Tensor of dtype torch.int64 and "
                               r"shape \(1, 2\)$"),
    ([[{"role": "user"}]], r"prompts\[0\]: prompt: chat message 0: expected a dict with 'role' and 'content', got "
                           r"the keys \['role'\]$"),
])
def test_bad_prompts_are_value_errors_naming_the_index(engine, reference, prompts, match):
    with pytest.raises(ValueError, match=match):
        engine.generate(prompts, sampling=GREEDY)
    _still_serves(engine, reference)


def test_a_developer_message_is_a_system_message(engine):
    """OpenAI's developer role takes the system role's place: the same prompt tokens (the template does not add its
    default system turn beside it)."""
    user = {"role": "user", "content": "Hi"}
    want = engine.tokenize([{"role": "system", "content": "Be brief."}, user])
    assert engine.tokenize([{"role": "developer", "content": "Be brief."}, user]) == want
    assert engine.tokenize([user]) != want


def test_messages_the_chat_template_refuses_are_a_value_error(engine, reference, monkeypatch):
    """A chat template's own refusal (Gemma's templates raise "System role not supported") fails that prompt with a
    ValueError naming it (the HTTP server's 400), not a jinja2 error from inside the engine."""
    tok = engine.text.tokenizer
    monkeypatch.setattr(tok, "chat_template", "{% for m in messages %}{% if m['role'] == 'system' %}"
                        "{{ raise_exception('System role not supported') }}{% endif %}{{ m['content'] }}{% endfor %}")
    bad = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    with pytest.raises(ValueError, match=r"^prompts\[1\]: prompt: the chat template of .* refused these messages: "
                                         r"System role not supported$"):
        engine.generate(["fine", bad], sampling=GREEDY)
    assert engine.generate([bad[1:]], sampling=GREEDY)[0].finish_reason in ("length", "stop")
    monkeypatch.undo()
    _still_serves(engine, reference)



class _Recording:
    """A tokenizer that records the texts it is called on (and otherwise is the wrapped one)."""

    def __init__(self, tok):
        self.tok, self.texts = tok, []

    def __call__(self, text, **kw):
        self.texts.append(text)
        return self.tok(text, **kw)

    def __getattr__(self, name):
        return getattr(self.tok, name)


def test_text_far_past_max_seq_len_is_refused_before_it_is_tokenized(engine, reference, monkeypatch):
    """Text of more than max_seq_len x the longest token's bytes x TEXT_BYTES_PER_TOKEN_FACTOR characters is refused
    once that prefix alone is over 2 x max_seq_len tokens, the rest never tokenized (a 20 MB prompt took 11 s and
    3 GB to be refused); the densest text there is (the longest token's own text, repeated) is refused so, and the
    tokenizer itself, on the whole text, agrees that it is past max_seq_len."""
    text, tok = engine.text, engine.text.tokenizer
    vocab = tok.get_vocab()
    assert text.max_token_bytes == max(len(t.encode()) for t in vocab) > 0
    limit = engine.max_seq_len * text.max_token_bytes * TEXT_BYTES_PER_TOKEN_FACTOR
    longest = max((tok.decode([i]) for i in vocab.values() if i not in tok.all_special_ids), key=lambda t: len(t.encode()))
    dense = longest * (limit // len(longest) + 1)
    assert len(dense) > limit and len(tok(dense)["input_ids"]) >= engine.max_seq_len
    rec = _Recording(tok)
    monkeypatch.setattr(text, "tokenizer", rec)
    words = rf"prompt: {len(dense):,} characters of text are more than max_seq_len={engine.max_seq_len} tokens can hold"
    with pytest.raises(ValueError, match=rf"^prompts\[1\]: {words}: the first {limit:,} alone are [\d,]+ tokens \(the "
                                         rf"rest was not tokenized\): shorten the prompt$"):
        engine.generate(["fine", dense], sampling=GREEDY)
    with pytest.raises(ValueError, match=r"^prompts\[0\]: prompt: [\d,]+ characters of text are more than"):
        engine.generate([[{"role": "user", "content": dense}]], sampling=GREEDY)  # chat: the templated text
    assert all(len(t) <= limit for t in rec.texts), "more than the prefix was tokenized"
    short = engine.max_seq_len * SHORT_PREFIX_CHARS_PER_TOKEN
    assert short < limit
    under = "x" * short  # within the short prefix: tokenized whole, then refused by its token count
    with pytest.raises(ValueError, match=r"prompt: \d+ tokens leave no room to generate within max_seq_len"):
        engine.generate([under], sampling=GREEDY)
    assert under in rec.texts
    # ordinary text of more characters (here within the long prefix): refused once the short prefix alone is over
    # 2 x max_seq_len + max_token_bytes tokens, only that prefix tokenized (a 400 KB prompt tokenized whole held
    # ~60 MB of a server thread's malloc arena); the tokenizer agrees the whole text is past max_seq_len
    rec.texts.clear()
    ordinary = "x" * (limit - 1)
    assert len(tok(ordinary[:short], add_special_tokens=False)["input_ids"]) > 2 * engine.max_seq_len + text.max_token_bytes
    with pytest.raises(ValueError, match=rf"^prompts\[0\]: prompt: {limit - 1:,} characters of text are more than "
                                         rf"max_seq_len={engine.max_seq_len} tokens can hold: the first {short:,} alone"):
        engine.generate([ordinary], sampling=GREEDY)
    assert [len(t) for t in rec.texts] == [short]
    assert len(tok(ordinary)["input_ids"]) > engine.max_seq_len
    monkeypatch.undo()
    _still_serves(engine, reference)


def test_generate_runs_more_prompts_than_the_waiting_queue_holds(tiny, reference, monkeypatch):
    """A generate call of more prompts than max_waiting_requests queues them as room frees: every output equals the
    prompt run alone, nothing is left held; a bad prompt anywhere still refuses the whole call with nothing run; a
    full queue at the start is still EngineOverloadedError; an interrupt with prompts not yet queued lets every
    adapter hold go."""
    from multilora.runtime.engine import EngineOverloadedError

    e = _engine(tiny, max_waiting_requests=2)
    prompts, adapters = PROMPTS * 3, ADAPTERS * 3  # 9 prompts, a queue of 2
    outs = e.generate(prompts, adapters=adapters, sampling=GREEDY)
    assert [o.token_ids for o in outs] == reference * 3
    assert all(e.cache.get(n).queued == 0 for n in e.list_adapters())
    _idle(e)
    with pytest.raises(ValueError, match=r"^prompts\[7\]: "):  # checked before any runs
        e.generate(prompts[:7] + [[]], adapters=adapters[:8], sampling=GREEDY)
    assert e.stats()["requests_finished"] == 9 and all(e.cache.get(n).queued == 0 for n in e.list_adapters())
    _idle(e)
    held = [e.add_request(p, a, GREEDY) for p, a in zip(PROMPTS[:2], ADAPTERS[:2])]  # the queue is full
    with pytest.raises(EngineOverloadedError, match=r"2 requests are waiting \(max_waiting_requests=2\)"):
        e.generate(PROMPTS, adapters=ADAPTERS, sampling=GREEDY)
    for r in held:
        e.abort(r.request_id)
    e.step()
    _idle(e)
    monkeypatch.setattr(e, "step", Interrupt(e.step, at=2))  # the backlog is not yet queued at the interrupt
    with pytest.raises(KeyboardInterrupt):
        e.generate(prompts, adapters=adapters, sampling=GREEDY)
    monkeypatch.undo()
    assert all(e.cache.get(n).queued == 0 for n in e.list_adapters())
    _idle(e)
    assert [o.token_ids for o in e.generate(prompts, adapters=adapters, sampling=GREEDY)] == reference * 3
    # abort finds a prompt not yet queued (held by the call): it ends "abort", the others as run alone
    made, real_make, real_step = [], e.requests.generation, e.step
    monkeypatch.setattr(e.requests, "generation", lambda *a, **k: made.append(real_make(*a, **k)) or made[-1])

    def step():
        if not made[-1].finish_reason:  # the first step: the last prompt is still held
            s = e.stats()
            assert (s["waiting"], s["held"]) == (2, 7), s  # 9 prompts, a queue of 2
            assert e.abort(made[-1].request_id) is True
        return real_step()

    monkeypatch.setattr(e, "step", step)
    outs = e.generate(prompts, adapters=adapters, sampling=GREEDY)
    monkeypatch.undo()
    assert [o.finish_reason for o in outs][-1] == "abort" and [o.token_ids for o in outs[:-1]] == (reference * 3)[:-1]
    assert all(e.cache.get(n).queued == 0 for n in e.list_adapters()) and not e._held
    _idle(e)


def test_token_ids_of_numpy_and_torch_integers_are_token_ids(engine, reference):
    """numpy / torch integer scalars in a list, and 1-D integer arrays and tensors, are token ids: the same tokens as
    the plain ints."""
    import numpy as np

    p = PROMPTS[0]
    for given in ([np.int64(t) for t in p], [np.int32(t) for t in p], np.array(p, dtype=np.int64), torch.tensor(p),
                  [torch.tensor(t) for t in p], torch.tensor(p, dtype=torch.int32)):
        out = engine.generate([given], adapters=[ADAPTERS[0]], sampling=GREEDY)[0]
        assert out.token_ids == reference[0] and out.prompt_token_ids == p, type(given)
    assert engine.generate(torch.tensor(p), adapters=ADAPTERS[0], sampling=GREEDY)[0].token_ids == reference[0]
    _still_serves(engine, reference)


def test_pin_adapter_takes_a_bool_and_engine_model_a_path(engine, reference):
    for bad in ("False", 0, None):
        with pytest.raises(ValueError, match=rf"^pinned: expected a bool, got {type(bad).__name__} "):
            engine.pin_adapter("a", bad)
    assert not engine.cache.is_pinned(engine.cache.get("a"))
    with pytest.raises(ValueError, match=r"^model: expected a path \(str or os.PathLike.*got int 123$"):
        Engine(model=123)
    _still_serves(engine, reference)


def test_text_of_few_tokens_past_the_bound_is_judged_by_its_real_count():
    """A run of unknown characters fused into one token (a real Unigram tokenizer) stands for any amount of text:
    its prefix is few tokens, so the text is tokenized whole and accepted; text of ordinary tokens is refused."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    from multilora.runtime.tokenizer import PromptTokenizer

    vocab = {"<unk>": 0, "a": 1, "b": 2, "ab": 3, "abab": 4}
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.Unigram([(t, -1.0) for t in vocab], unk_id=0)),
                                  unk_token="<unk>")
    text = PromptTokenizer(tok, vocab_size=5, eos_token_ids=(), source="t")
    limit, short = 8 * text.max_token_bytes * TEXT_BYTES_PER_TOKEN_FACTOR, 8 * SHORT_PREFIX_CHARS_PER_TOKEN
    assert text.max_token_bytes == 5 and short < limit
    assert text.encode("z" * (10 * limit), max_len=8) == [0]  # one fused <unk>: neither prefix refuses
    with pytest.raises(ValueError, match=rf"the first {short:,} alone are {short:,} tokens"):  # (over 2 x 8 + 5)
        text.encode("a" * (10 * limit), max_len=8)
    assert len(text.encode("a" * short, max_len=8)) == short  # within the short prefix: the caller judges its length
    assert not text.lstrip_tokens
    # an added token that swallows the whitespace before it makes a run of any length one token: no short stage
    # then, text up to the long prefix is judged by its real count as before
    from tokenizers import AddedToken

    tok.add_tokens([AddedToken("<mask>", lstrip=True)])
    text = PromptTokenizer(tok, vocab_size=6, eos_token_ids=(), source="t")
    assert text.lstrip_tokens and text.max_token_bytes == 6
    limit = 8 * 6 * TEXT_BYTES_PER_TOKEN_FACTOR
    assert len(text.encode("a" * (limit - 1), max_len=8)) == limit - 1  # past the short prefix, within the long
    with pytest.raises(ValueError, match=rf"the first {limit:,} alone are {limit:,} tokens"):
        text.encode("a" * (10 * limit), max_len=8)


# ------------------------------------------------------------------------------------ 5: non-finite logits
def test_an_adapter_that_overflows_fails_alone_naming_itself(engine, reference):
    outs = engine.generate(PROMPTS + [PROMPTS[0]], adapters=ADAPTERS + ["hot"], sampling=GREEDY)
    assert [o.token_ids for o in outs[:3]] == reference
    hot = outs[3]
    assert hot.finish_reason == "error" and hot.token_ids == []
    assert "not finite" in hot.error and "'hot'" in hot.error
    assert f"(from {engine.cache.get('hot').path})" in hot.error  # its directory too (session 37: a fuzz case)
    _still_serves(engine, reference)


def test_sampled_rows_are_checked_too(engine):
    sampled = SamplingParams(max_tokens=4, temperature=0.7, seed=3, ignore_eos=True)
    outs = engine.generate([PROMPTS[0], PROMPTS[0]], adapters=["hot", None], sampling=[sampled, sampled])
    assert outs[0].finish_reason == "error" and "'hot'" in outs[0].error
    assert outs[1].finish_reason == "length" and len(outs[1].token_ids) == 4


# ------------------------------------------------------------------------------------------ 2: interrupts
@pytest.mark.parametrize("at", [1, 3], ids=["prefill", "decode"])
def test_interrupted_generate_withdraws_its_requests(tiny, reference, monkeypatch, at):
    e = _engine(tiny)
    monkeypatch.setattr(e.runner, "run", Interrupt(e.runner.run, at))
    before = e.stats()
    with pytest.raises(KeyboardInterrupt):
        e.generate(PROMPTS, adapters=ADAPTERS, sampling=GREEDY)
    monkeypatch.undo()
    after = e.stats()  # every withdrawn request counted once, as aborted (not finished, not failed)
    assert after["requests_aborted"] - before["requests_aborted"] == len(PROMPTS)
    assert (after["requests_finished"], after["requests_failed"]) == (before["requests_finished"],
                                                                      before["requests_failed"])


def test_an_interrupt_counts_only_the_unfinished_as_aborted(tiny, reference, monkeypatch):
    """A request of the interrupted call that finished before the interrupt keeps its finish (and its count in
    ``requests_finished``); only the others are withdrawn and counted aborted."""
    e = _engine(tiny)
    monkeypatch.setattr(e.runner, "run", Interrupt(e.runner.run, 3))  # a decode step: the first has finished
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    before = e.stats()
    reqs = []
    real_make = e.requests.generation  # (generate makes its requests there, then queues them)
    monkeypatch.setattr(e.requests, "generation", lambda *a, **k: reqs.append(real_make(*a, **k)) or reqs[-1])
    with pytest.raises(KeyboardInterrupt):
        e.generate(PROMPTS, adapters=ADAPTERS, sampling=[one, GREEDY, GREEDY])
    monkeypatch.undo()
    after = e.stats()
    assert [r.finish_reason for r in reqs] == ["length", "error", "error"]
    assert after["requests_finished"] - before["requests_finished"] == 1
    assert after["requests_aborted"] - before["requests_aborted"] == 2
    _still_serves(e, reference)
    _still_serves(e, reference)
    assert e.logits([PROMPTS[0]]).shape == (1, VOCAB)


@pytest.mark.parametrize("where,at", [("forward", 1), ("forward", 2), ("sample", 1), ("sample", 2), ("admit", 2)])
def test_requests_survive_an_interrupted_step(tiny, reference, monkeypatch, where, at):
    """Requests of add_request / step (nobody withdraws them) finish with their reference tokens after an
    interrupt in the forward, in the sampling or in the middle of admission."""
    e = _engine(tiny)
    if where == "forward":
        monkeypatch.setattr(e.runner, "run", Interrupt(e.runner.run, at))
    elif where == "sample":
        monkeypatch.setattr(postprocess, "sample_tokens", Interrupt(postprocess.sample_tokens, at))
    else:
        monkeypatch.setattr(e.kv, "allocate_seq", Interrupt(e.kv.allocate_seq, at))
    reqs = [e.add_request(p, a, GREEDY) for p, a in zip(PROMPTS, ADAPTERS)]
    interrupted = 0
    while e.has_unfinished():
        try:
            e.step()
        except KeyboardInterrupt:
            interrupted += 1
    assert interrupted == 1
    assert [r.output_ids for r in reqs] == reference and all(r.finish_reason == "length" for r in reqs)
    monkeypatch.undo()
    _still_serves(e, reference)


def test_an_exception_in_a_step_fails_that_batch_only(tiny, reference, monkeypatch):
    e = _engine(tiny)
    calls = {"n": 0}
    run = e.runner.run

    def flaky(kind, batch, **kw):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("a bad step")
        return run(kind, batch, **kw)

    monkeypatch.setattr(e.runner, "run", flaky)
    outs = e.generate(PROMPTS, adapters=ADAPTERS, sampling=GREEDY)
    assert {o.finish_reason for o in outs} == {"error"} and all("a bad step" in o.error for o in outs)
    monkeypatch.undo()
    _still_serves(e, reference)


# --------------------------------------------------------------------------------------------------- fuzz
ANY = st.one_of(st.none(), st.booleans(), st.integers(-5, 10), st.integers(2**62, 2**70), st.floats(allow_nan=True),
                st.text(max_size=3), st.lists(st.integers(0, 3), max_size=2), st.just([""]), st.just(["ok"]))
FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "ignore_eos")


@FUZZ
@given(values=st.dictionaries(st.sampled_from(FIELDS), ANY, min_size=1, max_size=3))
def test_fuzz_sampling_params_are_valid_or_refused_naming_a_field(values):
    try:
        p = SamplingParams(**values)
    except ValueError as e:
        assert any(str(e).startswith(f"SamplingParams.{f}: expected ") for f in values), str(e)
        return
    from multilora.runtime.sampling import SamplingTensors, sample_batch

    t = SamplingTensors.from_params([p, GREEDY], [p.seed or 0, 0], [0, 0], "cpu")  # a valid value packs ...
    tok = sample_batch(torch.randn(2, 11), t)  # ... and samples
    assert tok.shape == (2,) and 0 <= int(tok.min()) and int(tok.max()) < 11


BAD_PROMPTS = st.one_of(st.none(), st.integers(), st.just([]), st.just([-1]), st.just([VOCAB]), st.just([1.5]),
                        st.just(""), st.just("\ud800"), st.just([{"role": "user"}]),
                        st.just([{"role": "user", "content": None}]), st.just([{"role": "user", "content": 7}]))


@FUZZ
@given(bad=BAD_PROMPTS, pos=st.integers(0, 3), bad_sampling=st.booleans())
def test_fuzz_a_bad_prompt_or_value_refuses_the_call_and_runs_nothing(engine, reference, bad, pos, bad_sampling):
    prompts, adapters = list(PROMPTS), list(ADAPTERS)
    sampling = [GREEDY] * 3
    if bad_sampling:
        prompts.insert(pos, PROMPTS[0])
        sampling.insert(pos, _Unchecked({"temperature": "x"}))
    else:
        prompts.insert(pos, bad)
        sampling.insert(pos, GREEDY)
    adapters.insert(pos, None)
    before = engine.stats()["steps"]
    with pytest.raises(ValueError, match=rf"prompts\[{pos}\]: "):
        engine.generate(prompts, adapters=adapters, sampling=sampling)
    assert engine.stats()["steps"] == before  # refused up front: nothing ran
    _idle(engine)


def test_after_the_fuzzing_the_engine_still_gives_the_reference(engine, reference):
    _still_serves(engine, reference)


@pytest.mark.parametrize("rows, words", [
    (["hello"], "token_ids[0]: expected a list of token ids (ints in [0, 49152)), got str 'hello'"),
    ([[1, 10**7]], "token_ids[0][1]: expected an int in [0, 49152), got 10000000"),
    ([[1, 2], [3, -1]], "token_ids[1][1]: expected an int in [0, 49152), got -1"),
    ([[1, 1.5]], "token_ids[0][1]: expected an int in [0, 49152), got 1.5"),
    ([[True, 2]], "token_ids[0][0]: expected an int in [0, 49152), got True"),
    ([5], "token_ids[0]: expected a list of token ids (ints in [0, 49152)), got int"),
])
def test_logits_rows_name_the_bad_id_and_its_place(engine, reference, rows, words):
    with pytest.raises(ValueError) as ei:
        engine.logits(rows)
    assert str(ei.value) == words
    _still_serves(engine, reference)


def test_logits_name_the_row_of_an_unknown_adapter(engine, reference):
    from multilora.runtime.adapter_cache import UnknownAdapterError

    with pytest.raises(UnknownAdapterError, match=r"^adapters\[1\]: adapter 'nope' is not loaded"):
        engine.logits(PROMPTS[:2], adapters=["a", "nope"])
    _still_serves(engine, reference)


def test_logits_take_tensor_rows(engine):
    want = engine.logits([PROMPTS[0]])
    assert torch.equal(engine.logits([torch.tensor(PROMPTS[0])]), want)


@pytest.mark.parametrize("path", [None, "", 3])
def test_load_adapter_path_of_the_wrong_kind_names_path(engine, path):
    with pytest.raises(ValueError, match=r"load_adapter: path must be an adapter directory .*got " + repr(path)):
        engine.load_adapter("x", path)
    assert "x" not in engine.list_adapters()


# ---------------------------------------------------------------------------------- found by session 34's trial
def test_adapter_names_a_request_or_a_label_could_not_carry_are_refused(engine, tiny):
    """Empty, whitespace at an end, a comma (the gateway metric's comma-separated list) or a control character: a
    ValueError naming the name and why, and nothing loaded."""
    _, dirs = tiny
    for name, why in (("", "empty"), (" a", "whitespace at an end"), ("a,b", "a comma"), ("a\tb", "a control character"),
                      (3, "not a string")):
        with pytest.raises(ValueError, match=rf"^load_adapter: name must be a non-empty string without commas, control "
                                             rf"characters or whitespace at its ends, got .* \({why}\)$"):
            engine.load_adapter(name, dirs["a"])
    assert sorted(engine.list_adapters()) == ["a", "b", "hot"]
    engine.load_adapter("org/task-1 v2", dirs["a"])  # (slashes and inner spaces are fine)
    engine.unload_adapter("org/task-1 v2")


def test_adapter_names_are_checked_before_the_model_loads(tiny, capsys, monkeypatch):
    """``--adapter "a,b=DIR"`` (generate, serve, serve-ray) exits 2 naming it before any model loads; a
    ``RayAppSpec`` with such a name is refused when made, not at every request of the replicas."""
    import multilora.runtime.engine as engine_mod
    from multilora.runtime.cli import main
    from multilora.runtime.config import EngineConfig
    from multilora.runtime.ray_serve import RayAppSpec

    d, dirs = tiny
    monkeypatch.setattr(engine_mod, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    for cmd in (["generate", "--prompt", "-", "Hi"], ["serve"]):
        assert main([*cmd, "--model", str(d), "--adapter", f"a,b={dirs['a']}"]) == 2
        assert f"--adapter a,b={dirs['a']}: the name must be a non-empty string without commas" in \
            capsys.readouterr().err
    with pytest.raises(ValueError, match=r"^RayAppSpec.adapters: an adapter name must be .* got ' a' \(whitespace"):
        RayAppSpec(model=str(d), config=EngineConfig(progress=False), adapters={" a": str(dirs["a"])})
    with pytest.raises(ValueError, match=r"^RayAppSpec.served_model_name must be .* got 'a,b' \(a comma\)"):
        RayAppSpec(model=str(d), config=EngineConfig(progress=False), served_model_name="a,b")  # before Ray starts


def test_a_max_seq_len_past_the_models_context_is_refused_before_loading(tiny, monkeypatch, capsys):
    """``max_seq_len`` above ``max_position_embeddings`` (the tiny model's 256): a ValueError naming it and the
    context, before the weights load (the command line: exit 2 naming ``--max-seq-len``); the context itself is
    fine. ``Engine(config=<a dict>)`` is a TypeError saying what to pass."""
    import multilora.runtime.engine as engine_mod
    from multilora.runtime.cli import main

    d, _ = tiny
    loads = []
    real = engine_mod.load_model
    monkeypatch.setattr(engine_mod, "load_model", lambda *a, **k: loads.append(1) or real(*a, **k))
    with pytest.raises(ValueError, match=r"^Engine: max_seq_len=257 is past the model's context of 256 tokens "
                                         r"\(max_position_embeddings=256 in its config\); ask for at most 256$"):
        Engine(model=str(d), progress=False, max_seq_len=257)
    assert loads == []
    assert Engine(model=str(d), progress=False, max_seq_len=256, max_batch_size=1).max_seq_len == 256
    assert main(["generate", "--model", str(d), "--prompt", "-", "Hi", "--max-seq-len", "1000000000"]) == 2
    assert "--max-seq-len: 1000000000 is past the model's context" in capsys.readouterr().err
    with pytest.raises(TypeError, match=r"Engine: config must be an EngineConfig or None, got dict"):
        Engine(model=str(d), config={"max_batch_size": 2})
    with pytest.raises(TypeError, match=r"^Engine: unknown option\(s\) \['max_batch_sise', 'zzz'\]; did you mean "
                                        r"'max_batch_size' for 'max_batch_sise'\? \(the options are EngineConfig's"):
        Engine(model=str(d), max_batch_sise=2, zzz=1)


def test_max_tokens_fit_kv_caps_a_request_at_what_the_kv_cache_holds(tiny):
    """``SamplingParams(max_tokens_fit_kv=True)`` (the server's default max_tokens): a request longer than the whole
    KV cache runs to what it holds (finish reason "length"); without it the request is refused as before; a prompt
    with no room for one token is refused either way; the flag is refused beside ``max_tokens_must_fit``."""
    d, _ = tiny
    e = Engine(model=str(d), progress=False, max_batch_size=2, kv_block_size=4, kv_cache_bytes=None, max_seq_len=64)
    per_block = e.kv.block_bytes
    e = Engine(model=str(d), progress=False, max_batch_size=2, kv_block_size=4, kv_cache_bytes=7 * per_block,
               max_seq_len=64)
    assert e.kv.max_usable_blocks == 6  # 24 tokens
    capped = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, max_tokens_fit_kv=True)
    out = e.generate([token_ids(20, 5, VOCAB)], sampling=capped)[0]
    assert (out.finish_reason, len(out.token_ids)) == ("length", 4)
    with pytest.raises(ValueError, match=r"^prompts\[0\]: request: 20 prompt tokens \+ max_tokens=40"):
        e.generate([token_ids(20, 5, VOCAB)], sampling=SamplingParams(max_tokens=40))
    for sp in (capped, SamplingParams(max_tokens=1), SamplingParams(max_tokens=1, max_tokens_must_fit=True)):
        with pytest.raises(ValueError, match=r"^prompts\[0\]: prompt: 24 tokens and one generated need 7 KV blocks "
                                             r"of 4 tokens; the whole KV cache has 6: shorten the prompt"):
            e.generate([token_ids(24, 5, VOCAB)], sampling=sp)  # (the prompt alone: no max_tokens helps, so named)
    with pytest.raises(ValueError, match=r"^SamplingParams\.max_tokens_fit_kv: expected False with max_tokens_must_fit"):
        SamplingParams(max_tokens_fit_kv=True, max_tokens_must_fit=True)
    assert capped.max_tokens == 40  # (the request got a copy)


def test_pins_that_hold_every_slot_are_named(tiny):
    """Two slots, both pinned: pinning a third says the slots are what is short and how to unpin; a request on an
    unpinned adapter fails alone saying the same; after unpinning it runs. An unknown name lists at most ten of the
    loaded names."""
    from multilora.runtime.adapter_cache import PoolFullError

    d, dirs = tiny
    e = Engine(model=str(d), progress=False, max_batch_size=2, adapter_slots=2)
    for i in range(12):
        e.load_adapter(f"x{i:02d}", dirs["a"])
    e.pin_adapter("x00")
    e.pin_adapter("x01")
    with pytest.raises(PoolFullError, match=r"needs \d+ bytes of the adapter pool and a slot; .* 0 of 2 slot\(s\) free, "
                                            r"0 held by idle adapters, 0 by adapters in use and 2 by pinned ones "
                                            r"\(pin_adapter\(name, False\) unpins one\)"):
        e.pin_adapter("x02")
    out = e.generate([token_ids(4, 1, VOCAB)], adapters=["x03"], sampling=GREEDY)[0]
    assert out.finish_reason == "error" and "2 pinned adapter(s) holding" in out.error and \
        "unpin some (Engine.pin_adapter(name, False))" in out.error, out.error
    e.pin_adapter("x00", False)
    assert e.generate([token_ids(4, 1, VOCAB)], adapters=["x03"], sampling=GREEDY)[0].finish_reason == "length"
    with pytest.raises(KeyError, match=r"adapter 'nope' is not loaded \(loaded: x00, x01, .*, x09, \.\.\. and 2 more\)"):
        e.generate(["hi"], adapters=["nope"])


# ---------------------------------------------------------------------------------- found by session 41's trial
@pytest.mark.parametrize("call,match", [
    (lambda e, d: e.load_adapter("p", d, allow_pickle="false"), r"^allow_pickle: expected a bool, got str 'false'$"),
    (lambda e, d: e.load_adapter("p", d, preload="no"), r"^preload: expected a bool, got str 'no'$"),
    (lambda e, d: e.generate([PROMPTS[0]], progress="yes"), r"^progress: expected a bool, got str 'yes'$"),
    (lambda e, d: e.unload_adapter(None), r"^name: expected an adapter name \(str\), got NoneType None$"),
    (lambda e, d: e.pin_adapter(None), r"^name: expected an adapter name \(str\), got NoneType None$"),
    (lambda e, d: e.adapter_path(5), r"^name: expected an adapter name \(str\), got int 5$"),
    (lambda e, d: e.warmup(3), r"^adapter: expected an adapter name \(str\) or None, got int 3$"),
    (lambda e, d: e.logits([PROMPTS[0]], adapters=5), r"^adapters: expected an adapter name \(str\) or None, got int 5$"),
    (lambda e, d: e.logits(PROMPTS[:2], adapters=["a", b"b"]), r"^adapters\[1\]: expected an adapter name \(str\) or "
                                                                r"None, got bytes b'b'$"),
    (lambda e, d: e.logits(None), r"^token_ids: expected a list of rows of token ids \(one row per prompt\), got "
                                  r"NoneType$"),
    (lambda e, d: e.logits("hello"), r"^token_ids: expected a list of rows .*got str$"),
    (lambda e, d: e.add_request(["Hi", "Yo"]), r"^prompt: expected one prompt, got a list of 2 strings \(a batch: "
                                               r"Engine.generate takes a list of prompts"),
    (lambda e, d: e.generate([torch.tensor([504.0, 28.0])]), r"prompt: expected a string, .*or a 1-D integer tensor / "
                                                             r"array of them, got Tensor of dtype torch.float32 and "
                                                             r"shape \(2,\)"),
])
def test_wrong_types_are_named_not_taken_for_true_or_for_an_unloaded_name(engine, reference, tiny, call, match):
    """A flag given as a string is refused (``allow_pickle="false"`` turned unpickling on: a non-empty string is
    true); an adapter name of the wrong type is a ValueError naming the argument, not "adapter None is not loaded";
    a list of strings to ``add_request`` says it takes one prompt; a tensor of the wrong dtype says what it has."""
    _, dirs = tiny
    before = engine.list_adapters()
    with pytest.raises(ValueError, match=match):
        call(engine, dirs["a"])
    assert engine.list_adapters() == before and not engine.has_unfinished()
    _still_serves(engine, reference)


def test_logits_take_a_2d_tensor_of_rows(engine):
    rows = torch.tensor([PROMPTS[0][:3], PROMPTS[1][:3]])
    assert torch.equal(engine.logits(rows), engine.logits([r.tolist() for r in rows]))


def test_the_errors_a_caller_catches_are_importable_from_multilora():
    """The README's exceptions come from ``multilora`` itself (a trial had to read the source for an ``except``),
    the very classes the engine raises."""
    import multilora
    from multilora.memory.pool import PoolFullError
    from multilora.runtime.adapter_cache import UnknownAdapterError
    from multilora.runtime.adapters.spec import AdapterError
    from multilora.runtime.engine import EngineOverloadedError
    from multilora.runtime.engine_process import EngineDeadError
    from multilora.runtime.weights import ModelLoadError

    for cls in (AdapterError, UnknownAdapterError, EngineOverloadedError, ModelLoadError, PoolFullError,
                EngineDeadError):
        assert getattr(multilora, cls.__name__) is cls and cls.__name__ in multilora.__all__
    with pytest.raises(AttributeError, match="has no attribute 'Nope'"):
        multilora.Nope
