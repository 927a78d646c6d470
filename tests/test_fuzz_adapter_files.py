"""Fuzz: random malformed adapter directories and files (issue 15, "Also build": the adapter-file part).

Each example writes one broken adapter directory and loads it through every path the engine has
(``load_peft_adapter`` whole and header-only, ``read_adapter`` with and without preload, ``Engine.load_adapter``
with and without preload, and a request on a lazily registered adapter beside a base request). Every load
must succeed or raise :class:`AdapterError` (a ``ValueError``) whose message names the directory or the file
at fault: never another exception type, never a hang, never a crash; the base request is never affected.
After the fuzzing the engine still gives the reference outputs for a good adapter.

What is broken:

- ``adapter_config.json``: fields set to random JSON values of any type or removed; the whole file replaced by
  random bytes, a truncated prefix, a non-object, absurdly deep nesting, a 5000-digit integer.
- ``adapter_model.safetensors``: a header length anywhere in [0, 2^64); truncated at any byte; random bytes
  overwritten (header or data); header entries given random dtypes (odd ones: sub-byte, unknown, float8,
  integer), shapes and data offsets (beyond the data, overlapping, wrong-sized, gaps), extra, missing or
  duplicated keys, bad ``__metadata__``; tensors re-typed to every safetensors dtype.
- odd paths: a symlink loop, a dangling symlink, a file where the directory belongs, a directory, FIFO or
  symlink loop where a file belongs, missing or empty files, a pickle only (refused, or garbage).

Profiles (hypothesis settings profiles, picked by the environment variable ``MULTILORA_FUZZ``): the default,
``adapter-files-ci``, runs 100 examples per kind (a few seconds); ``MULTILORA_FUZZ=long`` picks
``adapter-files-long``, 20,000 per kind (a few minutes):

    MULTILORA_FUZZ=long python -m pytest tests/test_fuzz_adapter_files.py
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import tempfile
import time
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

from multilora import Engine
from multilora.config import ModelConfig
from multilora.memory.pool import AdapterPool
from multilora.runtime.adapters import (AdapterError, CONFIG_NAME, PICKLE_NAME, SAFETENSORS_NAME, load_peft_adapter,
                                        read_adapter)
from multilora.runtime.adapters.files import _ST_DTYPES
from multilora.runtime.weights import MODEL_SHAPES
from testsupport import one_thread  # noqa: F401 (autouse fixture)
from testsupport import greedy, token_ids, write_adapter

_COMMON = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large], print_blob=True)
settings.register_profile("adapter-files-ci", max_examples=100, **_COMMON)
settings.register_profile("adapter-files-long", max_examples=20_000, **_COMMON)
FUZZ = settings.get_profile("adapter-files-long" if os.environ.get("MULTILORA_FUZZ") == "long" else "adapter-files-ci")

CFG = ModelConfig(**MODEL_SHAPES["tiny"])
MODS = ("q_proj", "v_proj", "down_proj")
PROMPT = token_ids(4, 0, CFG.vocab_size)


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    """A valid adapter: (dir, config dict, safetensors bytes)."""
    d = write_adapter(tmp_path_factory.mktemp("fuzz-good") / "good", CFG, seed=1, rank=4, modules=MODS)
    return d, json.loads((d / CONFIG_NAME).read_text()), (d / SAFETENSORS_NAME).read_bytes()


@pytest.fixture(scope="module")
def engine(good):
    """The tiny engine, with the good adapter's reference outputs taken before any fuzzing."""
    e = Engine(CFG, device="cpu", progress=False, max_batch_size=4, max_seq_len=16, max_lora_rank=8, adapter_slots=2)
    e.load_adapter("good", good[0])
    e.reference = e.generate([PROMPT, PROMPT], adapters=["good", None], sampling=greedy(3))
    return e


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzz-cases")


def _fresh_dir(scratch: Path, good) -> Path:
    d = Path(tempfile.mkdtemp(dir=scratch)) / "adapter"
    shutil.copytree(good[0], d)
    return d


def _settled(d: Path) -> None:
    """Date the files of ``d`` a minute back, so that no load waits for them to settle (``disk.SETTLE_S``: not
    what is fuzzed here; tests/test_adapter_files.py covers it)."""
    past = time.time_ns() - 60 * 10**9
    for p in [d, *d.iterdir()] if d.is_dir() and not d.is_symlink() else []:
        if p.is_file() and not p.is_symlink():
            os.utime(p, ns=(past, past))


def _check(engine, d: Path, allow_pickle: bool = False) -> list[str | None]:
    """Every load path on ``d``: success, or AdapterError naming ``d`` (or a file in it); nothing else. Returns
    each path's error message (None: it loaded)."""
    _settled(d)
    pool = AdapterPool(CFG, num_bytes=1 << 20, max_rank=8, dtype=torch.float32)
    loads = [lambda: load_peft_adapter(d, CFG, allow_pickle=allow_pickle),
             lambda: load_peft_adapter(d, CFG, allow_pickle=allow_pickle, header_only=True),
             lambda: read_adapter(d, CFG, pool, allow_pickle=allow_pickle, preload=True, max_rank=8),
             lambda: read_adapter(d, CFG, pool, allow_pickle=allow_pickle, preload=False, max_rank=8),
             lambda: engine.load_adapter("fuzz", d, allow_pickle=allow_pickle, preload=True)]
    errors: list[str | None] = []
    for load in loads:
        try:
            load()
            errors.append(None)
        except AdapterError as e:
            _assert_names(e, d)
            errors.append(str(e))
    try:
        engine.load_adapter("fuzz", d, allow_pickle=allow_pickle, preload=False)
    except AdapterError as e:
        _assert_names(e, d)
        return errors + [str(e)]
    outs = engine.generate([PROMPT, PROMPT], adapters=["fuzz", None], sampling=greedy(1))
    assert outs[1].finish_reason == "length" and outs[1].token_ids == engine.reference[1].token_ids[:1], outs[1]
    if outs[0].finish_reason == "error":
        assert str(d) in outs[0].error, outs[0].error
    engine.unload_adapter("fuzz")
    return errors + [None]


def _assert_names(e: AdapterError, d: Path) -> None:
    assert isinstance(e, ValueError)
    assert str(d) in str(e), f"the message does not name {d}: {e}"
    assert e.path is not None and e.path.startswith(str(d)), (e.path, str(e))


# ------------------------------------------------------------------------------------- configs
_NAMES = st.sampled_from(["q_proj", "v_proj", "down_proj", "lm_head", "embed_tokens", "mlp", "", "q_proj.x"])
# regex-ish text without quantifiers (no catastrophic backtracking), often invalid: "(", "[", "\\"
_PATTERNS = st.text(alphabet="qvkodwnpmrj_.|()[]^$\\0123", max_size=12)
_SCALARS = (st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.sampled_from([10**400, -(10**400), 2**64])
            | st.floats() | st.floats(3e38, 4e38) | st.text(max_size=8)
            | _NAMES | _PATTERNS)
_JSON = st.recursive(_SCALARS, lambda c: st.lists(c, max_size=4) | st.dictionaries(_PATTERNS | _NAMES, c, max_size=3),
                     max_leaves=8)
_FIELDS = ["r", "lora_alpha", "target_modules", "exclude_modules", "rank_pattern", "alpha_pattern",
           "layers_to_transform", "layers_pattern", "use_rslora", "peft_type", "use_dora", "bias", "lora_bias",
           "fan_in_fan_out", "modules_to_save", "init_lora_weights", "layer_replication", "task_type"]


@st.composite
def _config_text(draw, base: dict) -> bytes:
    kind = draw(st.sampled_from(["fields", "fields", "fields", "bytes", "prefix", "non-object", "deep", "digits"]))
    text = json.dumps(base, indent=2)
    if kind == "fields":
        cfg = dict(base)
        for _ in range(draw(st.integers(1, 3))):
            field = draw(st.sampled_from(_FIELDS) | st.text(max_size=6))
            if draw(st.booleans()) and field in cfg:
                del cfg[field]
            else:
                cfg[field] = draw(_JSON)
        return json.dumps(cfg).encode()
    if kind == "bytes":
        return draw(st.binary(max_size=64))
    if kind == "prefix":
        return text.encode()[: draw(st.integers(0, len(text) - 1))]
    if kind == "non-object":
        return json.dumps(draw(_JSON.filter(lambda v: not isinstance(v, dict)))).encode()
    if kind == "deep":
        n = draw(st.sampled_from([1000, 100_000]))
        return ("[" * n + "]" * n).encode() if draw(st.booleans()) else ('{"r":' * n + "1" + "}" * n).encode()
    return text.replace('"r": 4', '"r": ' + "7" * 5000).encode()


# ------------------------------------------------------------------------------------- safetensors files
def _split(raw: bytes) -> tuple[dict, bytes]:
    n = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def _join(header: dict | str, data: bytes) -> bytes:
    h = (header if isinstance(header, str) else json.dumps(header)).encode()
    return struct.pack("<Q", len(h)) + h + data


def _retyped(raw: bytes, key_index: int, dtype: torch.dtype) -> bytes:
    """The file with one tensor converted to ``dtype`` (laid out again as safetensors does)."""
    header, data = _split(raw)
    meta = header.pop("__metadata__", None)
    names = {dt: n for n, dt in _ST_DTYPES.items()}
    out, blob = ({"__metadata__": meta} if meta else {}), b""
    for i, key in enumerate(sorted(header)):
        e = header[key]
        x = torch.frombuffer(bytearray(data[e["data_offsets"][0] : e["data_offsets"][1]]),
                             dtype=_ST_DTYPES[e["dtype"]]).reshape(e["shape"])
        if i == key_index:
            x = x.to(dtype)
        b = x.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        out[key] = {"dtype": names[x.dtype], "shape": list(x.shape), "data_offsets": [len(blob), len(blob) + len(b)]}
        blob += b
    return _join(out, blob)


@st.composite
def _weights_bytes(draw, raw: bytes) -> bytes:
    header, data = _split(raw)
    keys = sorted(k for k in header if k != "__metadata__")
    kind = draw(st.sampled_from(["length", "truncate", "overwrite", "entry", "entry", "entry", "drop", "extra", "rename",
                                 "duplicate", "metadata", "header-json", "append", "retype", "retype"]))
    if kind == "length":
        n = draw(st.integers(0, 2**64 - 1) | st.sampled_from([0, 1, 2, 7, len(raw) - 8, len(raw) - 7, len(raw), 2**63]))
        return struct.pack("<Q", n) + raw[8:]
    if kind == "truncate":
        return raw[: draw(st.integers(0, len(raw) - 1))]
    if kind == "overwrite":
        out = bytearray(raw)
        for _ in range(draw(st.integers(1, 8))):
            pos = draw(st.integers(0, min(len(raw) - 1, 8 + len(json.dumps(header)) + 16)) | st.integers(0, len(raw) - 1))
            out[pos] = draw(st.integers(0, 255))
        return bytes(out)
    if kind == "entry":
        key = draw(st.sampled_from(keys))
        e = dict(header[key])
        b, end = e["data_offsets"]
        field = draw(st.sampled_from(["dtype", "shape", "data_offsets", "offsets-shift", "overlap", "whole"]))
        if field == "dtype":
            e["dtype"] = draw(st.sampled_from(list(_ST_DTYPES) + ["F4", "F6_E2M3", "F6_E3M2", "f32", "", "U128"]) | _JSON)
        elif field == "shape":
            e["shape"] = draw(st.lists(st.integers(-3, 300), max_size=4) | _JSON)
        elif field == "data_offsets":
            e["data_offsets"] = draw(st.lists(st.integers(-5, len(data) + 100), max_size=3) | _JSON)
        elif field == "offsets-shift":
            d0, d1 = draw(st.integers(-64, 64)), draw(st.integers(-64, 64))
            e["data_offsets"] = [b + d0, end + d1]
        elif field == "overlap":
            e["data_offsets"] = header[draw(st.sampled_from(keys))]["data_offsets"]
        else:
            e = draw(_JSON)
        header = {**header, key: e}
        return _join(header, data)
    if kind == "drop":
        header = dict(header)
        del header[draw(st.sampled_from(keys))]
        return _join(header, data)
    if kind == "rename":  # a valid entry under another key: a near miss of PEFT's names, or any text
        key = draw(st.sampled_from(keys))
        new = draw(st.sampled_from([key.replace("layers.0", "layers.9"), key.replace("lora_A", "lora_C"),
                                    key.replace("q_proj", "qkv_proj"), key.replace(".weight", ".bias"),
                                    key.replace("base_model.model.", ""), key + "x"]) | st.text(max_size=40))
        return _join({(new if k == key else k): v for k, v in header.items()}, data)
    if kind == "extra":
        return _join({**header, draw(st.text(max_size=30)): draw(_JSON)}, data)
    if kind == "duplicate":
        key = draw(st.sampled_from(keys))
        text = json.dumps(header)
        return _join(text[:-1] + f", {json.dumps(key)}: {json.dumps(header[key])}" + "}", data)
    if kind == "metadata":
        return _join({**header, "__metadata__": draw(_JSON)}, data)
    if kind == "header-json":
        return _join(draw(st.text(max_size=40)), data)
    if kind == "append":
        return raw + draw(st.binary(min_size=1, max_size=16))
    dtype = draw(st.sampled_from(sorted(set(_ST_DTYPES.values()), key=str)))
    return _retyped(raw, draw(st.integers(0, len(keys) - 1)), dtype)


# ------------------------------------------------------------------------------------- odd paths
def _odd_path(d: Path, kind: str) -> Path:
    """Break ``d`` (a valid adapter directory) in one of the odd-path ways; returns the path to load."""
    cfg, wts = d / CONFIG_NAME, d / SAFETENSORS_NAME
    if kind == "dir-loop":
        shutil.rmtree(d)
        os.symlink(d, d)
    elif kind == "dir-dangling":
        shutil.rmtree(d)
        os.symlink(d.parent / "nowhere", d)
    elif kind == "dir-is-file":
        shutil.rmtree(d)
        d.write_text("{}")
    elif kind == "dir-via-symlink":  # a symlink to a valid directory: loads
        os.rename(d, d.parent / "real")
        os.symlink(d.parent / "real", d)
    elif kind.startswith(("cfg-", "wts-")):
        p = cfg if kind.startswith("cfg-") else wts
        what = kind[4:]
        p.unlink()
        if what == "dir":
            p.mkdir()
        elif what == "fifo":
            os.mkfifo(p)
        elif what == "loop":
            os.symlink(p, p)
        elif what == "dangling":
            os.symlink(d / "nowhere", p)
        elif what == "empty":
            p.write_bytes(b"")
    elif kind == "pickle-only":
        torch.save(load_file(str(wts)), d / PICKLE_NAME)
        wts.unlink()
    elif kind == "pickle-garbage":
        (d / PICKLE_NAME).write_bytes(b"\x80\x02garbage")
        wts.unlink()
    elif kind == "pickle-not-a-dict":
        torch.save([torch.zeros(2)], d / PICKLE_NAME)
        wts.unlink()
    return d


_NOT_A_FILE = {"dir": "expected a file, got a directory", "fifo": "expected a file, got a named pipe (FIFO)",
               "loop": "a symlink loop", "dangling": "which does not exist"}
_REFUSED = "allow_pickle=True"
#: what every load path says for each odd path: (without allow_pickle, with it); None: it loads
ODD = {"dir-loop": ("a symlink loop",) * 2, "dir-dangling": ("which does not exist",) * 2,
       "dir-is-file": ("got a file",) * 2, "dir-via-symlink": (None, None), "pickle-only": (_REFUSED, None),
       "pickle-garbage": (_REFUSED, "cannot load with torch.load"),
       "pickle-not-a-dict": (_REFUSED, "expected a dict of tensor name -> tensor, got list"),
       "cfg-empty": ("malformed JSON",) * 2, "cfg-missing": (f"{CONFIG_NAME}: missing",) * 2,
       "wts-empty": ("too short for the 8-byte header length",) * 2, "wts-missing": ("found neither",) * 2,
       **{f"{f}-{w}": (msg,) * 2 for f in ("cfg", "wts") for w, msg in _NOT_A_FILE.items()}}


# ------------------------------------------------------------------------------------- the tests
@pytest.mark.parametrize("name", [CONFIG_NAME, SAFETENSORS_NAME])
@FUZZ
@given(data=st.data())
def test_fuzz_file(engine, good, scratch, name, data):
    broken = _config_text(good[1]) if name == CONFIG_NAME else _weights_bytes(good[2])
    d = _fresh_dir(scratch, good)
    (d / name).write_bytes(data.draw(broken, label=name))
    _check(engine, d)


@pytest.mark.parametrize("kind", list(ODD))
@pytest.mark.parametrize("allow_pickle", [False, True])
def test_odd_paths(engine, good, scratch, kind, allow_pickle):
    errors = _check(engine, _odd_path(_fresh_dir(scratch, good), kind), allow_pickle=allow_pickle)
    want = ODD[kind][allow_pickle]
    assert all(e is None if want is None else e is not None and want in e for e in errors), (want, errors)


def test_the_engine_still_gives_reference_outputs_afterwards(engine, good):
    """Runs after the fuzzing (file order): the good adapter, reloaded and as first loaded, serves the same tokens
    as before it, and as a fresh engine."""
    engine.load_adapter("good-again", good[0], preload=False)
    outs = engine.generate([PROMPT] * 3, adapters=["good", None, "good-again"], sampling=greedy(3))
    want = engine.reference
    assert [o.token_ids for o in outs] == [want[0].token_ids, want[1].token_ids, want[0].token_ids]
    fresh = Engine(CFG, device="cpu", progress=False, max_batch_size=4, max_seq_len=16, max_lora_rank=8)
    fresh.load_adapter("good", good[0])
    assert fresh.generate([PROMPT], adapters=["good"], sampling=greedy(3))[0].token_ids == want[0].token_ids
    s = engine.stats()
    assert s["running"] == s["waiting"] == 0 and engine.kv.num_free_blocks == engine.kv.num_usable_blocks
