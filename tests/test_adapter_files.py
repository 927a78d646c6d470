"""Adapter files as a hostile but fair user leaves them (issue 15, items 1, 6, 7, 9).

- Plain reads, checked: a file that changes while it is read fails that load with "changed while it was
  being read"; a file modified within the last ``SETTLE_S`` is read once it has been left alone that long, and
  one that keeps changing is refused "is being written"; a header-only registration reads the header's bytes
  and nothing else.
- File-change detection (the disk tier): a change to ``adapter_config.json`` or the weight file is caught even
  with the size and mtime put back (inode / ctime), and named in the error; an unrelated file added to the
  directory changes nothing; the error says whether there was a host copy at all.
- float8 files: accepted alike with and without preload (cast exactly); F8_E8M0 and integer dtypes refused
  alike, naming the file's dtype.
- Odd paths: a symlink loop, a dangling symlink, a directory or FIFO where a file belongs: said as such.

(The two-process in-place rewrite is tests/test_adapter_rewrite.py; random malformed files are
tests/test_fuzz_adapter_files.py.)
"""

from __future__ import annotations

import json
import os
import struct
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

from multilora import Engine
from multilora.config import TARGET_MODULES, ModelConfig
from multilora.memory.pool import AdapterPool
from multilora.runtime.adapter_cache import files_fingerprint
from multilora.runtime.adapters import disk
from multilora.runtime.adapters import (AdapterError, CONFIG_NAME, SAFETENSORS_NAME, load_peft_adapter,
                                        load_peft_adapter_into, read_adapter)
from multilora.runtime.weights import MODEL_SHAPES
from testsupport import one_thread  # noqa: F401 (autouse fixture)
from testsupport import greedy, token_ids, write_adapter

CFG = ModelConfig(**MODEL_SHAPES["tiny"])
MODS = ("q_proj", "v_proj", "down_proj")


@pytest.fixture(scope="module")
def engine():
    return Engine(CFG, device="cpu", progress=False, max_batch_size=4, max_seq_len=32, max_lora_rank=8, adapter_slots=2)


def _ids(seed):
    return token_ids(5, seed, CFG.vocab_size)


def _pool():
    return AdapterPool(CFG, num_bytes=1 << 20, max_rank=8, dtype=torch.float32)


def _err(fn) -> str:
    with pytest.raises(AdapterError) as ei:
        fn()
    return str(ei.value)


def _all_loads(d):
    """The message of every load path the engine has for ``d`` (they must agree)."""
    return [_err(lambda: load_peft_adapter(d, CFG)), _err(lambda: load_peft_adapter(d, CFG, header_only=True)),
            _err(lambda: read_adapter(d, CFG, _pool(), preload=True)),
            _err(lambda: read_adapter(d, CFG, _pool(), preload=False))]


# ------------------------------------------------------------------------------------- plain, checked reads
def test_a_file_written_during_the_read_fails_that_load(tmp_path):
    d = write_adapter(tmp_path / "a", CFG, seed=1, rank=8, modules=MODS)
    other = (write_adapter(tmp_path / "b", CFG, seed=2, rank=8, modules=MODS) / SAFETENSORS_NAME).read_bytes()

    class RewritingSink:  # rewrites the file in place after the first module: the rest is the other version
        def put(self, layer, module, a, b, scaling):
            if layer == 0 and module == "q_proj":
                with open(d / SAFETENSORS_NAME, "r+b") as f:
                    f.write(other)

    msg = _err(lambda: load_peft_adapter_into(d, CFG, lambda r: RewritingSink()))
    assert f"{d / SAFETENSORS_NAME}: changed while it was being read" in msg, msg
    assert load_peft_adapter(d, CFG).modules  # once written it loads again


def test_header_only_registration_reads_only_the_header(tmp_path, monkeypatch):
    d = write_adapter(tmp_path / "a", CFG, seed=1, rank=8, modules=TARGET_MODULES)
    raw = (d / SAFETENSORS_NAME).read_bytes()
    header = 8 + struct.unpack("<Q", raw[:8])[0]
    seen = []
    real = os.preadv

    def counting(fd, bufs, offset):
        n = real(fd, bufs, offset)
        seen.append((offset, n))
        return n

    monkeypatch.setattr(os, "preadv", counting)
    read_adapter(d, CFG, _pool(), preload=False)
    config_bytes = (d / CONFIG_NAME).stat().st_size
    assert sum(n for _, n in seen) == config_bytes + header < len(raw) // 10, (seen, len(raw))
    assert not any(o >= header for o, _ in seen)


def _age(d, seconds):
    """Date every file of ``d`` ``seconds`` back."""
    t = time.time_ns() - int(seconds * 1e9)
    for p in d.iterdir():
        os.utime(p, ns=(t, t))


def test_a_freshly_written_file_is_read_once_it_settled(tmp_path, monkeypatch):
    d = write_adapter(tmp_path / "a", CFG, seed=1, rank=8, modules=MODS)
    slept, real_sleep = [], time.sleep
    monkeypatch.setattr(disk.time, "sleep", lambda s: (slept.append(s), real_sleep(s)))
    _age(d, 2 * disk.SETTLE_S)
    read_adapter(d, CFG, _pool())
    assert slept == []  # older than SETTLE_S: read at once
    _age(d, disk.SETTLE_S / 5)
    want = read_adapter(d, CFG, _pool())[1].data  # written just now: waits out the rest, then reads
    assert len(slept) == 1 and 0 < slept[0] <= disk.SETTLE_S, slept
    assert torch.equal(read_adapter(d, CFG, _pool())[1].data, want)


def test_a_file_that_keeps_changing_is_refused(tmp_path, monkeypatch):
    d = write_adapter(tmp_path / "a", CFG, seed=1, rank=8, modules=MODS)
    monkeypatch.setattr(disk, "SETTLE_MAX_S", 0.3)
    w = d / SAFETENSORS_NAME
    real_sleep = time.sleep

    def sleep_while_written(s):  # a writer that rewrites the file while the load waits for it to settle
        real_sleep(s)
        os.utime(w)

    monkeypatch.setattr(disk.time, "sleep", sleep_while_written)
    os.utime(w)
    msg = _err(lambda: read_adapter(d, CFG, _pool()))
    assert f"{w}: is being written (it changed " in msg and "load it again once it is complete" in msg, msg


@pytest.mark.parametrize("missing", [("preadv",), ("preadv", "pread")], ids=["pread", "lseek-read"])
def test_platforms_without_preadv_read_the_same(tmp_path, monkeypatch, missing):
    d = write_adapter(tmp_path / "a", CFG, seed=1, rank=8, modules=MODS)
    want = read_adapter(d, CFG, _pool())[1].data
    for name in missing:
        monkeypatch.delattr(os, name)
    assert torch.equal(read_adapter(d, CFG, _pool())[1].data, want)


def test_the_adapter_records_the_files_it_read(engine, tmp_path):
    d = write_adapter(tmp_path / "a", CFG, seed=1, rank=8, modules=MODS)
    for preload in (True, False):
        adapter = engine.load_adapter("rec", d, preload=preload)
        assert adapter.files == files_fingerprint(d) == engine.cache.get("rec").fingerprint
        assert [s.name for s in adapter.files] == [CONFIG_NAME, SAFETENSORS_NAME]
    engine.unload_adapter("rec")


# ------------------------------------------------------------------------------------- file-change detection
def _lazy_then_change(engine, tmp_path, change):
    """Register an adapter with preload=False, ``change(dir)``, then serve it with a base request beside it."""
    d = write_adapter(tmp_path / "a", CFG, seed=1, rank=8, modules=MODS)
    engine.load_adapter("lazy", d, preload=False)
    change(d)
    outs = engine.generate([_ids(1), _ids(2)], adapters=["lazy", None], sampling=greedy(3))
    assert outs[1].finish_reason == "length"
    return d, outs[0]


def _same_size_other_values(d, tmp_path):
    other = write_adapter(tmp_path / "other", CFG, seed=9, rank=8, modules=MODS) / SAFETENSORS_NAME
    data = other.read_bytes()
    assert len(data) == (d / SAFETENSORS_NAME).stat().st_size
    return data


def test_same_size_rewrite_with_mtime_put_back_is_caught(engine, tmp_path):
    def rewrite(d):
        w = d / SAFETENSORS_NAME
        st = os.stat(w)
        data = _same_size_other_values(d, tmp_path)
        with open(w, "r+b") as f:  # in place: same inode
            f.write(data)
        os.utime(w, ns=(st.st_atime_ns, st.st_mtime_ns))

    d, out = _lazy_then_change(engine, tmp_path, rewrite)
    assert out.finish_reason == "error", out
    assert f"{SAFETENSORS_NAME}: rewritten with the same size and mtime" in out.error, out.error
    assert "preload=False" in out.error and "evicted" not in out.error, out.error


def test_same_size_replace_by_rename_with_mtime_put_back_is_caught(engine, tmp_path):
    def replace(d):
        w = d / SAFETENSORS_NAME
        st = os.stat(w)
        tmp = d / ".new"
        tmp.write_bytes(_same_size_other_values(d, tmp_path))
        os.utime(tmp, ns=(st.st_atime_ns, st.st_mtime_ns))
        os.replace(tmp, w)

    _, out = _lazy_then_change(engine, tmp_path, replace)
    assert out.finish_reason == "error" and f"{SAFETENSORS_NAME}: replaced by another file" in out.error, out


def test_config_change_is_named(engine, tmp_path):
    def edit(d):
        p = d / CONFIG_NAME
        p.write_text(p.read_text().replace('"lora_alpha": 16', '"lora_alpha": 17'))

    _, out = _lazy_then_change(engine, tmp_path, edit)
    assert out.finish_reason == "error" and f"{CONFIG_NAME}: " in out.error and "mtime" in out.error, out


def test_an_unrelated_new_file_changes_nothing(engine, tmp_path):
    d, out = _lazy_then_change(engine, tmp_path, lambda d: (d / "README.md").write_text("notes\n"))
    assert out.finish_reason == "length", out.error
    engine.load_adapter("eager", d)
    assert out.token_ids == engine.generate([_ids(1)], adapters=["eager"], sampling=greedy(3))[0].token_ids


# ------------------------------------------------------------------------------------- float8 files
def _float8_adapter(tmp_path, dtype):
    d = write_adapter(tmp_path / str(dtype), CFG, seed=3, rank=8, modules=MODS)
    t = load_file(str(d / SAFETENSORS_NAME))
    save_file({k: (v * 8).to(dtype) for k, v in t.items()}, str(d / SAFETENSORS_NAME))
    exact = write_adapter(tmp_path / f"{dtype}-as-f32", CFG, seed=3, rank=8, modules=MODS)
    save_file({k: (v * 8).to(dtype).float() for k, v in t.items()}, str(exact / SAFETENSORS_NAME))
    return d, exact


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
def test_float8_files_are_accepted_alike_and_cast_exactly(engine, tmp_path, dtype):
    d, exact = _float8_adapter(tmp_path, dtype)
    adapter = engine.load_adapter("f8-lazy", d, preload=False)
    assert {w.a.dtype for w in adapter.modules.values()} == {dtype}
    engine.load_adapter("f8-eager", d)
    engine.load_adapter("f8-as-f32", exact)
    rows = [_ids(4), _ids(5)]
    want = engine.logits(rows, adapters=["f8-as-f32"] * 2)
    assert torch.equal(engine.logits(rows, adapters=["f8-eager"] * 2), want)
    assert torch.equal(engine.logits(rows, adapters=["f8-lazy"] * 2), want)
    assert not torch.equal(want, engine.logits(rows))
    ref = load_peft_adapter(exact, CFG)
    for k, w in load_peft_adapter(d, CFG).modules.items():
        assert torch.equal(w.a, ref.modules[k].a) and torch.equal(w.b, ref.modules[k].b)


@pytest.mark.parametrize("dtype,name", [(torch.float8_e8m0fnu, "F8_E8M0"), (torch.int32, "I32"), (torch.uint8, "U8")])
def test_other_dtypes_are_refused_alike_naming_the_dtype(tmp_path, dtype, name):
    d = write_adapter(tmp_path / "a", CFG, seed=3, rank=8, modules=MODS)
    t = load_file(str(d / SAFETENSORS_NAME))
    k = sorted(t)[0]
    t[k] = t[k].abs().to(dtype)
    save_file(t, str(d / SAFETENSORS_NAME))
    msgs = _all_loads(d)
    assert len(set(msgs)) == 1, msgs  # preload or not, header only or not: one message
    assert f"expected a floating-point dtype" in msgs[0] and f"got {name} ({dtype})" in msgs[0], msgs[0]
    assert k in msgs[0] and str(d / SAFETENSORS_NAME) in msgs[0]


# ------------------------------------------------------------------------------------- found by the fuzz suite
@pytest.mark.parametrize("field,value", [("lora_alpha", 1.4e39), ("lora_alpha", 10**400),
                                         ("alpha_pattern", {"q_proj": -1e39})], ids=["1.4e39", "400-digits", "pattern"])
def test_an_alpha_beyond_float32_is_refused_by_name(tmp_path, field, value):
    """Found by tests/test_fuzz_adapter_files.py: a lora_alpha finite in JSON but not in float32 reached the
    pool's float32 scaling table (RuntimeError from the packer); a 400-digit integer one raised OverflowError."""
    d = write_adapter(tmp_path / "a", CFG, seed=1, rank=8, modules=MODS)
    cfg = json.loads((d / CONFIG_NAME).read_text())
    cfg[field] = value
    (d / CONFIG_NAME).write_text(json.dumps(cfg))
    for msg in _all_loads(d):
        assert f"{d / CONFIG_NAME}: {field}: " in msg and "finite number (a float32" in msg, msg


# ------------------------------------------------------------------------------------- odd paths
def _valid(tmp_path, name="a"):
    return write_adapter(tmp_path / name, CFG, seed=1, rank=8, modules=MODS)


def test_a_directory_that_is_a_symlink_loop(tmp_path):
    loop = tmp_path / "loop"
    os.symlink(loop, loop)
    for msg in _all_loads(loop):
        assert f"{loop}: a symlink loop" in msg and "does not exist" not in msg, msg
    dangling = tmp_path / "dangling"
    os.symlink(tmp_path / "nowhere", dangling)
    for msg in _all_loads(dangling):
        assert f"{dangling}: a symlink to " in msg and "nowhere" in msg and "which does not exist" in msg, msg


@pytest.mark.parametrize("entry", [CONFIG_NAME, SAFETENSORS_NAME])
def test_a_directory_where_a_file_belongs(tmp_path, entry):
    d = _valid(tmp_path)
    (d / entry).unlink()
    (d / entry).mkdir()
    for msg in _all_loads(d):
        assert f"{d / entry}: expected a file, got a directory" in msg, msg


@pytest.mark.parametrize("entry", [CONFIG_NAME, SAFETENSORS_NAME])
def test_a_fifo_or_a_symlink_loop_where_a_file_belongs(tmp_path, entry):
    d = _valid(tmp_path)
    (d / entry).unlink()
    os.mkfifo(d / entry)  # opened without blocking, then refused
    for msg in _all_loads(d):
        assert f"{d / entry}: expected a file, got a named pipe (FIFO)" in msg, msg
    (d / entry).unlink()
    os.symlink(d / entry, d / entry)
    for msg in _all_loads(d):
        assert f"{d / entry}: a symlink loop" in msg, msg


def test_the_engine_reports_odd_paths_the_same(engine, tmp_path):
    d = _valid(tmp_path)
    (d / SAFETENSORS_NAME).unlink()
    (d / SAFETENSORS_NAME).mkdir()
    for preload in (True, False):
        with pytest.raises(AdapterError, match="expected a file, got a directory"):
            engine.load_adapter("odd", d, preload=preload)
    assert "odd" not in engine.list_adapters()
