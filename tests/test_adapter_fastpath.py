"""The disk -> host fast path: ``read_packed_adapter`` (``load_peft_adapter_into`` + ``AdapterPool.packer``).

What the engine's reload and ``load_adapter(preload=True)`` run must give the same pool image, bit for bit, as
``load_peft_adapter``'s float32 copies laid out by a plain reference packer written from the layout of
``multilora.memory.pool`` (zeros, then each module's A and B^T at its page-aligned offset), for every file dtype
into every pool dtype, with per-module ranks (``rank_pattern`` / ``alpha_pattern``) and partial pages; and it must
refuse exactly what ``load_peft_adapter`` refuses, with the same message, key and path.
"""

from __future__ import annotations

import json
import math
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

from multilora import Engine
from multilora.memory.pool import PAGE_ELEMS, AdapterPool, PackedAdapter
from multilora.runtime.adapters import (
    AdapterError,
    LoRAAdapter,
    LoRAModuleWeights,
    load_peft_adapter,
    load_peft_adapter_into,
    read_packed_adapter,
    save_peft_adapter,
)
from multilora.runtime.adapters.files import _LazyTensors, _read_weights
from multilora.runtime.adapters import image as image_mod
from multilora.runtime.adapters.image import read_header, read_image
from multilora.runtime.adapters.load import _all_finite
from multilora.config import MODULE_INDEX, MODULE_PARENT, TARGET_MODULES, ModelConfig
from multilora.runtime.weights import MODEL_SHAPES
from testsupport import one_thread  # noqa: F401 (autouse fixture)
from testsupport import write_adapter

# hidden 24, q 24, k/v 8, MLP 40: every module has its own (d_in, d_out)
CFG = ModelConfig(vocab_size=32, hidden_size=24, intermediate_size=40, num_layers=3, num_heads=3, num_kv_heads=1)
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
WTS = "adapter_model.safetensors"


def _reference_pack(pool: AdapterPool, adapter: LoRAAdapter) -> PackedAdapter:
    """The reference image, from the pool docstring's layout: for each (layer, module) in layer, then TARGET_MODULES
    order, A [r, d_in] then B^T [r, d_out] from a page boundary, zeros to the next one."""
    if adapter.max_rank > pool.max_rank:
        raise ValueError(
            f"adapter {adapter.name!r}: rank {adapter.max_rank} exceeds the pool's max_rank {pool.max_rank}"
        )
    keys = sorted(adapter.modules, key=lambda lm: (lm[0], MODULE_INDEX[lm[1]]))
    sizes = [-(-adapter.modules[k].rank * sum(pool.config.module_shape(k[1])) // PAGE_ELEMS) * PAGE_ELEMS for k in keys]
    data = torch.zeros(sum(sizes), dtype=pool.dtype)
    nl, nm = pool.config.num_layers, len(TARGET_MODULES)
    ranks = torch.zeros(nl, nm, dtype=torch.int32)
    scalings = torch.zeros(nl, nm, dtype=torch.float32)
    offsets = torch.zeros(nl, nm, dtype=torch.int64)
    pos = 0
    for (layer, module), size in zip(keys, sizes):
        w = adapter.modules[(layer, module)]
        d_in, d_out = pool.config.module_shape(module)
        r = w.rank
        data[pos : pos + r * d_in] = w.a.to(pool.dtype).reshape(-1)
        data[pos + r * d_in : pos + r * (d_in + d_out)] = w.b.t().to(pool.dtype).reshape(-1)
        mi = MODULE_INDEX[module]
        ranks[layer, mi] = r
        scalings[layer, mi] = float(w.scaling)
        offsets[layer, mi] = pos
        pos += size
    return PackedAdapter(data=data, ranks=ranks, scalings=scalings, offsets=offsets, max_rank=adapter.max_rank,
                         name=adapter.name)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def _assert_same_packed(got: PackedAdapter, want: PackedAdapter) -> None:
    assert got.data.dtype == want.data.dtype and got.data.shape == want.data.shape
    assert torch.equal(_bits(got.data), _bits(want.data))  # bit for bit: -0.0, subnormals, inf from overflow
    assert torch.equal(got.ranks, want.ranks)
    assert torch.equal(got.scalings, want.scalings)
    assert torch.equal(got.offsets, want.offsets)
    assert got.max_rank == want.max_rank and got.name == want.name


def _values(shape, dtype, g) -> torch.Tensor:
    """Values that stress conversions: a wide exponent range (subnormals of every dtype, values past
    float16's / bfloat16's range where the file dtype holds them), signed zeros, exact ties."""
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    x = x * torch.pow(2.0, torch.randint(-150, 40, shape, generator=g).double())
    x.view(-1)[::7] = 0.0
    x.view(-1)[3::11] = -0.0
    x.view(-1)[5::13] = 1.0 + 2.0**-8 + 2.0**-30  # rounds differently straight to bf16 than through float32
    fmax = torch.finfo(dtype).max
    return x.clamp(-fmax, fmax).to(dtype)


def _modules(ranks: dict[tuple[int, str], int], dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = {}
    for (layer, m), r in ranks.items():
        d_in, d_out = CFG.module_shape(m)
        out[(layer, m)] = (_values((r, d_in), dtype, g), _values((d_out, r), dtype, g))
    return out


def _write_patterned(path, dtype, seed=0):
    """An adapter with rank_pattern / alpha_pattern and layers_to_transform: ranks 5 (q, layer-wise), 3 (v),
    11 (down, alpha 7.5), on layers 0 and 2 only; layer 1 and k/o/gate/up untouched."""
    ranks = {}
    for layer in (0, 2):
        ranks[(layer, "q_proj")] = 5
        ranks[(layer, "v_proj")] = 3
        ranks[(layer, "down_proj")] = 11
    save_peft_adapter(path, _modules(ranks, dtype, seed), r=5, lora_alpha=10, target_modules=["q_proj", "v_proj",
                      "down_proj"], rank_pattern={"v_proj": 3, "down_proj": 11}, alpha_pattern={"down_proj": 7.5},
                      layers_to_transform=[0, 2])
    return path


def _write_uniform(path, dtype, r=8, seed=0):
    ranks = {(layer, m): r for layer in range(CFG.num_layers) for m in TARGET_MODULES}
    save_peft_adapter(path, _modules(ranks, dtype, seed), r=r, lora_alpha=2 * r, target_modules=list(TARGET_MODULES),
                      use_rslora=True)
    return path


def _pool(dtype, max_rank=16):
    return AdapterPool(CFG, num_bytes=1 << 20, max_rank=max_rank, dtype=dtype)


# ----------------------------------------------------------------------------------------- bit identity


@pytest.mark.parametrize("pool_dtype", DTYPES, ids=str)
@pytest.mark.parametrize("file_dtype", DTYPES + [torch.float64], ids=str)
@pytest.mark.parametrize("layout", ["uniform", "patterned"])
def test_fast_path_pages_are_bit_identical(layout, file_dtype, pool_dtype, tmp_path):
    d = (_write_uniform if layout == "uniform" else _write_patterned)(tmp_path / "a", file_dtype)
    # r * (d_in + d_out) is never a multiple of 64 here: every module ends in a partial page
    pool = _pool(pool_dtype)
    ref_adapter = load_peft_adapter(d, CFG, name="x")
    want = _reference_pack(pool, ref_adapter)
    adapter, got = read_packed_adapter(d, CFG, pool, name="x")
    _assert_same_packed(got, want)
    _assert_same_packed(read_image(d, CFG, pool, name="x")[1], want)  # the cache's reload, straight into the image
    out = torch.full_like(want.data, float("nan"))  # into a given buffer (an arena block): every element written
    assert read_image(d, CFG, pool, name="x", out=out)[1].data is out
    _assert_same_packed(PackedAdapter(out, want.ranks, want.scalings, want.offsets, want.max_rank, "x"), want)
    _assert_same_packed(pool.pack(ref_adapter), want)  # the public pack uses the packer too
    # the returned adapter: same modules, ranks and scalings, meta tensors of the file's shapes / dtype
    assert list(adapter.modules) == list(ref_adapter.modules)
    assert adapter.config == ref_adapter.config and adapter.name == "x" and adapter.path == ref_adapter.path
    assert adapter.target_summary() == ref_adapter.target_summary()
    for key, w in adapter.modules.items():
        ref = ref_adapter.modules[key]
        assert w.a.device.type == "meta" and w.b.device.type == "meta"
        assert w.a.shape == ref.a.shape and w.b.shape == ref.b.shape and w.scaling == ref.scaling
        assert w.a.dtype == w.b.dtype == file_dtype


@pytest.mark.skipif(not hasattr(__import__("os"), "posix_fadvise"), reason="posix_fadvise: Linux")
@pytest.mark.parametrize("raw", [False, True], ids=["host-finish", "raw"])
def test_read_ahead_advises_the_whole_weight_file_once_and_keeps_the_bits(raw, tmp_path, monkeypatch):
    """``image.READ_AHEAD`` (off by default): each ``read_image`` asks the OS for the whole weight file once,
    ``posix_fadvise(fd, 0, 0, WILLNEED)`` on the file it then reads; the image is the same bits as without the
    advice. A file system that refuses the advice (OSError) reads the same, and ``will_need`` says so."""
    import os

    from multilora.runtime.adapters.disk import OpenFile

    d = _write_uniform(tmp_path / "a", torch.float32)
    pool = _pool(torch.float32)
    want = read_image(d, CFG, pool, name="x", raw=raw)[1]
    calls, real = [], os.posix_fadvise

    def spy(fd, offset, length, advice):
        calls.append((os.readlink(f"/proc/self/fd/{fd}") if os.path.exists("/proc/self/fd") else None, offset,
                      length, advice))
        return real(fd, offset, length, advice)

    monkeypatch.setattr(os, "posix_fadvise", spy)
    _assert_same_packed(read_image(d, CFG, pool, name="x", raw=raw)[1], want)
    assert calls == []  # off by default
    monkeypatch.setattr(image_mod, "READ_AHEAD", True)
    _assert_same_packed(read_image(d, CFG, pool, name="x", raw=raw)[1], want)
    wpath = str((d / WTS).resolve()) if os.path.exists("/proc/self/fd") else None
    assert calls == [(wpath, 0, 0, os.POSIX_FADV_WILLNEED)]

    def refuse(*a):
        raise OSError(22, "Invalid argument")

    monkeypatch.setattr(os, "posix_fadvise", refuse)
    _assert_same_packed(read_image(d, CFG, pool, name="x", raw=raw)[1], want)
    with OpenFile(d / WTS) as f:
        assert f.will_need() is False


@pytest.mark.parametrize("raw", [False, True], ids=["host-finish", "raw"])
@pytest.mark.parametrize("threads", [2, 3, 64])
def test_split_reads_keep_the_bits_and_land_before_returning(raw, threads, tmp_path, monkeypatch):
    """``image.SPLIT_READ_THREADS`` (1 by default): the file's buffers cut into that many runs read at once (more
    runs than tensors: one per tensor at most) give the same image in both finishes, with the runs past the first
    read on the split pool's threads; a run that fails (a short read) fails the read with the file's message, after
    every other run has landed."""
    import threading

    from multilora.runtime.adapters.disk import OpenFile

    for layout, write in (("uniform", _write_uniform), ("uneven", _write_uneven)):
        d = write(tmp_path / f"{layout}-{threads}-{raw}", torch.float32)
        pool = _pool(torch.float32)
        want = read_image(d, CFG, pool, name="x", raw=raw)[1]
        monkeypatch.setattr(image_mod, "SPLIT_READ_THREADS", threads)
        monkeypatch.setattr(image_mod, "SPLIT_READ_MIN_BYTES", 0)
        seen, real = [], OpenFile.read_scatter

        def spy(self, bufs, offset):
            seen.append(threading.current_thread().name)
            return real(self, bufs, offset)

        monkeypatch.setattr(OpenFile, "read_scatter", spy)
        out = torch.full_like(want.data, float("nan"))
        _assert_same_packed(read_image(d, CFG, pool, name="x", out=out, raw=raw)[1], want)
        assert any(n.startswith("multilora-split-read") for n in seen) and threading.current_thread().name in seen
        monkeypatch.setattr(OpenFile, "read_scatter", real)
        monkeypatch.setattr(image_mod, "SPLIT_READ_THREADS", 1)
    calls = []

    def short(self, bufs, offset):  # the second run to read fails
        calls.append(offset)
        if len(calls) == 2:
            raise self.fault(f"a read of 1 bytes at byte {offset} came up 1 bytes short")
        return real(self, bufs, offset)

    monkeypatch.setattr(image_mod, "SPLIT_READ_THREADS", threads)
    monkeypatch.setattr(OpenFile, "read_scatter", short)
    with pytest.raises(AdapterError, match="came up 1 bytes short"):
        read_image(d, CFG, pool, name="x", raw=raw)


def _write_uneven(path, dtype, seed=0):
    """q and k on every layer, k at rank 8 on layer 1 only (rank_pattern by layer): layer 1's region is larger, so
    q's B^T regions are not evenly spaced (placed one by one) and k's rank-4 ones are (one strided copy)."""
    ranks = {}
    for layer in range(CFG.num_layers):
        ranks[(layer, "q_proj")] = 4
        ranks[(layer, "k_proj")] = 8 if layer == 1 else 4
    save_peft_adapter(path, _modules(ranks, dtype, seed), r=4, lora_alpha=8, target_modules=["q_proj", "k_proj"],
                      rank_pattern={"model.layers.1.self_attn.k_proj": 8})
    return path


@pytest.mark.parametrize("batch_bytes", [64 << 20, 0], ids=["batched", "groups"])
@pytest.mark.parametrize("layout", ["uniform", "patterned", "uneven"])
def test_scatter_paths_are_bit_identical(layout, batch_bytes, tmp_path, monkeypatch):
    """Both same-dtype scatter paths of ``read_image`` (every lora_B of the image in the scratch and one strided
    copy per module, ``_scatter_batched``; or groups of ``_SCATTER_BYTES``, ``_scatter_into``) give the reference's
    image, with B^T regions evenly spaced (one copy for all layers) and not (per-layer ranks: one copy each)."""
    import multilora.runtime.adapters.image as image

    monkeypatch.setattr(image, "_BATCH_B_BYTES", batch_bytes)
    write = {"uniform": _write_uniform, "patterned": _write_patterned, "uneven": _write_uneven}[layout]
    for dtype in (torch.bfloat16, torch.float32):
        d = write(tmp_path / f"{layout}-{dtype}".replace("torch.", ""), dtype)
        pool = _pool(dtype)
        want = _reference_pack(pool, load_peft_adapter(d, CFG, name="x"))
        out = torch.full_like(want.data, float("nan"))
        _assert_same_packed(read_image(d, CFG, pool, name="x", out=out)[1], want)
    if layout == "uneven":  # both kinds of batch were there
        f = image.OpenFile(d / WTS)
        try:
            cfg_path, cfg_bytes, cfg_stamp, wpath = image._config_and_weights(d)
            plan = image._plan_of(f, d, wpath, cfg_path, cfg_bytes, cfg_stamp, CFG, pool)
        finally:
            f.close()
        assert sorted((b.modules[0].name, b.modules[0].r, len(b.modules), b.stride is None) for b in plan.batches) == [
            ("k_proj", 4, 2, False), ("k_proj", 8, 1, False), ("q_proj", 4, 3, True)]
        assert plan.b_bytes == sum(m.b.nbytes for m in plan.modules)


def _write_phi3(d, dtype):
    """Phi-3's fused qkv_proj / gate_up_proj (one A shared by slices of different widths, B over the fused width),
    with per-layer ranks, on a 4-layer Phi-3 shape: returns (its config, ``d``)."""
    import json as _json

    from safetensors.torch import save_file as _save

    cfg = ModelConfig.from_hf_dict(dict(model_type="phi3", vocab_size=10, hidden_size=32, intermediate_size=24,
                                        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=1,
                                        max_position_embeddings=64))
    mods = {"qkv_proj": "self_attn", "o_proj": "self_attn", "gate_up_proj": "mlp", "down_proj": "mlp"}
    shape = {"qkv_proj": (32, 48), "o_proj": (32, 32), "gate_up_proj": (32, 48), "down_proj": (24, 32)}
    rp = {"model.layers.0.self_attn.qkv_proj": 6, "model.layers.2.mlp.down_proj": 3}
    g = torch.Generator().manual_seed(0)
    t = {}
    for layer in range(4):
        for m, parent in mods.items():
            r = rp.get(f"model.layers.{layer}.{parent}.{m}", 4)
            d_in, d_out = shape[m]
            k = f"base_model.model.model.layers.{layer}.{parent}.{m}.lora_"
            t[k + "A.weight"] = torch.randn(r, d_in, generator=g).to(dtype)
            t[k + "B.weight"] = torch.randn(d_out, r, generator=g).to(dtype)
    d.mkdir()
    _save(t, str(d / WTS), metadata={"format": "pt"})
    (d / "adapter_config.json").write_text(_json.dumps(dict(peft_type="LORA", r=4, lora_alpha=8,
                                                            target_modules=list(mods), rank_pattern=rp)))
    return cfg, d


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_scatter_paths_are_bit_identical_on_fused_projections(dtype, tmp_path, monkeypatch):
    """Phi-3's fused projections (``_write_phi3``): the batched path (fused modules placed one by one), the groups
    path and the per-tensor path give the general path's image bit for bit."""
    import multilora.runtime.adapters.image as image

    cfg, d = _write_phi3(tmp_path / "phi3", dtype)
    pool = AdapterPool(cfg, num_bytes=1 << 22, max_rank=16, dtype=dtype)
    want = read_packed_adapter(d, cfg, pool, name="x")[1]
    for batch, scatter in ((64 << 20, True), (0, True), (64 << 20, False)):
        monkeypatch.setattr(image, "_BATCH_B_BYTES", batch)
        monkeypatch.setattr(image, "_SCATTER", scatter)
        out = torch.full_like(want.data, float("nan"))
        _assert_same_packed(read_image(d, cfg, pool, name="x", out=out)[1], want)


def _plan(d, cfg, pool):
    f = image_mod.OpenFile(d / WTS)
    try:
        cfg_path, cfg_bytes, cfg_stamp, wpath = image_mod._config_and_weights(d)
        return image_mod._plan_of(f, d, wpath, cfg_path, cfg_bytes, cfg_stamp, cfg, pool)
    finally:
        f.close()


def _layout(layout: str, dtype, tmp_path):
    """An adapter of ``layout`` (uniform, patterned, uneven: on ``CFG``; phi3: ``_write_phi3``'s fused projections)
    in ``dtype``, with a pool for it: (config, directory, pool)."""
    if layout == "phi3":
        cfg, d = _write_phi3(tmp_path / f"phi3-{dtype}".replace("torch.", ""), dtype)
        return cfg, d, AdapterPool(cfg, num_bytes=1 << 22, max_rank=16, dtype=dtype)
    write = {"uniform": _write_uniform, "patterned": _write_patterned, "uneven": _write_uneven}[layout]
    return CFG, write(tmp_path / f"{layout}-{dtype}".replace("torch.", ""), dtype), _pool(dtype)


@pytest.mark.parametrize("pieces_of", ["one-tensor", "600-bytes", "half-the-file"])
@pytest.mark.parametrize("layout", ["uniform", "patterned", "uneven", "phi3"])
def test_pipelined_finish_keeps_the_bits(layout, pieces_of, tmp_path, monkeypatch):
    """``image.PIPELINE_PIECE_BYTES`` (the host finish of each piece on a finish thread while the next is read): the
    image is the reference's bit for bit, with every piece's finish on the finish threads, for pieces of one tensor
    each, of a few, and of many; evenly spaced and uneven B^T regions and fused projections (placed one by one);
    with and without the finite check (``verified``); and the plan's module regions tile the image, so the pieces'
    checks cover every element the serial path's whole-image check does."""
    import threading

    for dtype in (torch.bfloat16, torch.float32):
        cfg, d, pool = _layout(layout, dtype, tmp_path)
        want = read_packed_adapter(d, cfg, pool, name="x")[1]
        plan = _plan(d, cfg, pool)
        piece_bytes = {"one-tensor": 1, "600-bytes": 600, "half-the-file": plan.file_size // 2}[pieces_of]
        monkeypatch.setattr(image_mod, "PIPELINE_PIECE_BYTES", piece_bytes)
        monkeypatch.setattr(image_mod, "PIPELINE_COLD_ONLY", False)  # (the files are in the page cache)
        pieces = image_mod._pipeline(plan, piece_bytes)
        assert pieces is not None and len(pieces) > 1
        if piece_bytes == 1:
            assert len(pieces) == len(plan.reads)
        elif pieces_of == "half-the-file":
            assert len(pieces) <= 3
        assert sorted(id(m) for p in pieces for m in p.done) == sorted(map(id, plan.modules))  # each finished once
        spans = sorted(c for p in pieces for c in p.checks)
        assert spans[0][0] == 0 and spans[-1][1] == plan.numel and all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
        assert sum(hi - lo for lo, hi in spans) == plan.numel
        seen, real = [], image_mod._finish_piece

        def spy(*a):
            seen.append(threading.current_thread().name)
            return real(*a)

        monkeypatch.setattr(image_mod, "_finish_piece", spy)
        for verified in (False, True):
            seen.clear()
            out = torch.full_like(want.data, float("nan"))
            _assert_same_packed(image_mod._read(d, cfg, pool, "x", False, out, verified)[1], want)
            assert len(seen) == len(pieces) and all(n.startswith("multilora-read-finish") for n in seen)
        monkeypatch.setattr(image_mod, "_finish_piece", real)


@pytest.mark.parametrize("probe", ["all-cached", "none-cached", "part-cached", "cannot-tell", "all-cached-always"])
def test_pipelined_finish_only_for_reads_from_the_disk(probe, tmp_path, monkeypatch):
    """``PIPELINE_COLD_ONLY`` (default): the first run of the first piece is read with ``OpenFile.read_cached``
    (``RWF_NOWAIT``); all of it in the page cache -> the serial finish (no finish thread, ``cached_serial``
    counted); none or part of it, or a platform that cannot tell -> pipelined (``pipelined`` counted), the bytes
    the probe did read kept (a probe that stops inside a buffer too). With ``PIPELINE_COLD_ONLY`` off, a cached file
    is pipelined. The image is the reference's bit for bit every time, and the whole image is checked either way
    (a non-finite value in the last tensor is refused)."""
    from multilora.runtime.adapters.disk import OpenFile

    monkeypatch.setattr(image_mod, "PIPELINE_PIECE_BYTES", 1500)
    if probe == "all-cached-always":
        monkeypatch.setattr(image_mod, "PIPELINE_COLD_ONLY", False)
    d = _write_uniform(tmp_path / "a", torch.float32)
    pool = _pool(torch.float32)
    want = read_packed_adapter(d, CFG, pool, name="x")[1]
    real = OpenFile.read_cached
    probed = []

    def fake(self, bufs, offset):
        got = real(self, bufs, offset)
        assert got == sum(len(b) for b in bufs)  # (a file just written: in the page cache, or no RWF_NOWAIT)
        probed.append(got)
        claimed = {"none-cached": 0, "part-cached": len(bufs[0]) + 3, "cannot-tell": 0}.get(probe, got)
        skip = claimed  # the bytes past what is claimed read as garbage (NaN bit patterns): must be read again
        for b in bufs:
            k = min(skip, len(b))
            b[k:] = b"\xff" * (len(b) - k)
            skip -= k
        # (part-cached: as if the disk had to supply the bytes from inside the second buffer on)
        return None if probe == "cannot-tell" else claimed

    if hasattr(__import__("os"), "RWF_NOWAIT"):
        monkeypatch.setattr(OpenFile, "read_cached", fake)
    elif probe != "cannot-tell":
        pytest.skip("no RWF_NOWAIT: every probe cannot tell")
    finishes, real_finish = [], image_mod._finish_piece
    monkeypatch.setattr(image_mod, "_finish_piece", lambda *a: finishes.append(1) or real_finish(*a))
    before = image_mod.pipeline_counts()
    out = torch.full_like(want.data, float("nan"))
    _assert_same_packed(read_image(d, CFG, pool, name="x", out=out)[1], want)
    after = image_mod.pipeline_counts()
    serial = probe == "all-cached"
    assert (after["cached_serial"] - before["cached_serial"], after["pipelined"] - before["pipelined"]) == (
        (1, 0) if serial else (0, 1))
    assert (finishes == []) == serial and len(probed) == (1 if hasattr(__import__("os"), "RWF_NOWAIT") else 0)
    k = _key(CFG.num_layers - 1, "down_proj", "B")
    _patch(d, lambda t: t[k].view(-1).__setitem__(-1, float("inf")))
    err = _err(lambda: read_image(d, CFG, pool, name="x"))
    assert err.key == k and "expected finite values" in str(err)


def test_read_cached_reads_what_the_page_cache_holds(tmp_path, monkeypatch):
    """``OpenFile.read_cached``: a file just written is in the page cache, so all of it is read (the bytes right);
    where the platform has no ``RWF_NOWAIT``, or the file system refuses the flag, it answers None and reads
    nothing."""
    import errno
    import os

    from multilora.runtime.adapters.disk import OpenFile

    p = tmp_path / "f.bin"
    data = os.urandom(3 * 4096 + 5)
    p.write_bytes(data)
    a, b = bytearray(4096), bytearray(len(data) - 4096 - 7)
    with OpenFile(p) as f:
        got = f.read_cached([memoryview(a), memoryview(b)], 7)
        if hasattr(os, "RWF_NOWAIT"):
            assert got == len(a) + len(b) and bytes(a + b) == data[7:]
            real = os.preadv

            def refuse(fd, bufs, offset, flags=0):
                if flags:
                    raise OSError(errno.EOPNOTSUPP, "Operation not supported")
                return real(fd, bufs, offset)

            monkeypatch.setattr(os, "preadv", refuse)
            assert f.read_cached([memoryview(a)], 0) is None
        if hasattr(os, "RWF_NOWAIT"):  # a Python built without preadv2 refuses the flags
            def no_flags(fd, bufs, offset, flags=0):
                raise NotImplementedError("preadv2 is not available")

            monkeypatch.setattr(os, "preadv", no_flags)
            assert f.read_cached([memoryview(a)], 0) is None
        monkeypatch.delattr(os, "RWF_NOWAIT", raising=False)
        assert f.read_cached([memoryview(bytearray(8))], 0) is None


@pytest.mark.parametrize("route", ["pipelining-off", "cached-serial"])
@pytest.mark.parametrize("layout", ["uniform", "patterned", "uneven", "phi3"])
def test_parallel_finish_keeps_the_bits_and_checks_the_whole_image(layout, route, tmp_path, monkeypatch):
    """``image.PARALLEL_FINISH`` (off by default): a batched read's finish after the whole read (pipelining off, or
    a file in the page cache with ``PIPELINE_COLD_ONLY``) places lora_B^T in jobs on the finish threads and checks
    the whole image in parts there: the reference's image bit for bit, every placement on a finish thread, each
    module placed once; a non-finite value anywhere is refused naming its tensor, as the general path does."""
    import threading

    from multilora.runtime.adapters.disk import OpenFile

    monkeypatch.setattr(image_mod, "PARALLEL_FINISH", True)
    monkeypatch.setattr(image_mod, "PIPELINE_PIECE_BYTES", 0 if route == "pipelining-off" else 700)
    # the probe says "all in the page cache" (so also where the platform cannot tell): the cached-serial route
    monkeypatch.setattr(OpenFile, "read_cached", lambda self, bufs, offset: self.read_scatter(bufs, offset) or
                        sum(len(b) for b in bufs))
    for dtype in (torch.bfloat16, torch.float32):
        cfg, d, pool = _layout(layout, dtype, tmp_path)
        want = read_packed_adapter(d, cfg, pool, name="x")[1]
        placed, real = [], image_mod._place_run

        def spy(img, scratch, bt, i, j):
            placed.append((threading.current_thread().name, id(bt), i, j))
            return real(img, scratch, bt, i, j)

        monkeypatch.setattr(image_mod, "_place_run", spy)
        before = image_mod.pipeline_counts()
        out = torch.full_like(want.data, float("nan"))
        _assert_same_packed(image_mod._read(d, cfg, pool, "x", False, out, False)[1], want)
        assert placed and all(n.startswith("multilora-read-finish") for n, *_ in placed)
        plan = _plan(d, cfg, pool)
        covered = sorted((b, k) for _, b, i, j in placed for k in range(i, j))
        assert covered == sorted((id(bt), k) for bt in plan.batches for k in range(len(bt.modules)))
        if route == "cached-serial":
            assert image_mod.pipeline_counts()["cached_serial"] == before["cached_serial"] + 1
        monkeypatch.setattr(image_mod, "_place_run", real)
        if layout == "uniform" and dtype == torch.bfloat16:
            for k in (_key(0, "q_proj", "A"), _key(CFG.num_layers - 1, "down_proj", "B"), _key(1, "v_proj", "B")):
                e = tmp_path / f"bad-{route}-{k.split('.')[4]}-{k.split('.')[-2]}"
                _write_uniform(e, dtype)
                _patch(e, lambda t: t[k].view(-1).__setitem__(slice(2, None, 7), float("nan")))
                want_err = _err(lambda: load_peft_adapter(e, CFG))
                got = _err(lambda: image_mod._read(e, CFG, pool, None, False, None, False))
                assert (str(got), got.key) == (str(want_err), want_err.key) and got.key == k


def test_parallel_finish_raises_after_every_job_ended(tmp_path, monkeypatch):
    """A placement job that fails fails the read with its error, only after every other job has ended."""
    import threading
    import time

    monkeypatch.setattr(image_mod, "PARALLEL_FINISH", True)
    monkeypatch.setattr(image_mod, "PIPELINE_PIECE_BYTES", 0)
    d = _write_uniform(tmp_path / "a", torch.float32)
    pool = _pool(torch.float32)
    want = read_packed_adapter(d, CFG, pool, name="x")[1]
    real, running, started = image_mod._place_run, [0], []
    lock = threading.Lock()

    def slow(*a):
        with lock:
            running[0] += 1
            started.append(1)
            n = len(started)
        try:
            time.sleep(0.03)
            if n == 1:
                raise RuntimeError("placement broke")
            return real(*a)
        finally:
            with lock:
                running[0] -= 1

    monkeypatch.setattr(image_mod, "_place_run", slow)
    with pytest.raises(RuntimeError, match="placement broke"):
        image_mod._read(d, CFG, pool, "x", False, None, False)
    assert running[0] == 0 and len(started) > 1
    monkeypatch.setattr(image_mod, "_place_run", real)
    _assert_same_packed(read_image(d, CFG, pool, name="x")[1], want)


@pytest.mark.parametrize("where", ["A-first", "B-last", "middle-B"])
def test_pipelined_finish_names_the_non_finite_tensor(where, tmp_path, monkeypatch):
    """With the pipelined finish, a non-finite value is refused with the general path's message, tensor and count
    (the pieces' checks answer for the whole image; the serial path's trace names the tensor)."""
    from pathlib import Path

    monkeypatch.setattr(image_mod, "PIPELINE_PIECE_BYTES", 2000)
    d = _write_uniform(tmp_path / "a", torch.bfloat16, r=4)
    monkeypatch.setattr(image_mod, "PIPELINE_COLD_ONLY", False)  # (the test's files are in the page cache)
    k = {"A-first": _key(0, "q_proj", "A"), "B-last": _key(CFG.num_layers - 1, "down_proj", "B"),
         "middle-B": _key(1, "v_proj", "B")}[where]
    _patch(d, lambda t: t[k].view(-1).__setitem__(slice(1, None, 5), float("inf")))
    want = _err(lambda: load_peft_adapter(d, CFG))
    pool = _pool(torch.bfloat16)
    assert image_mod._pipeline(_plan(d, CFG, pool), 2000) is not None
    got = _err(lambda: image_mod._read(Path(d), CFG, pool, None, False, None, False))
    assert (str(got), got.key, got.path) == (str(want), want.key, want.path)
    assert image_mod._read(Path(d), CFG, pool, None, False, None, True)[1] is not None  # verified: not checked
    err = _err(lambda: read_image(d, CFG, pool, name="x"))
    assert err.key == k and "expected finite values" in str(err)


@pytest.mark.parametrize("fail", ["read", "finish"])
def test_pipelined_finish_fails_cleanly_after_every_finish_ended(fail, tmp_path, monkeypatch):
    """A read that fails mid-way (a short read) fails ``read_image`` with the file's message, and a finish that
    raises fails it with that error; either way only after every finish already handed to the finish threads has
    ended (the caller may then reuse the image and the scratch), and the next read is whole again."""
    import threading
    import time

    from multilora.runtime.adapters.disk import OpenFile

    monkeypatch.setattr(image_mod, "PIPELINE_PIECE_BYTES", 2000)
    d = _write_uniform(tmp_path / "a", torch.float32)
    monkeypatch.setattr(image_mod, "PIPELINE_COLD_ONLY", False)  # (the test's files are in the page cache)
    pool = _pool(torch.float32)
    want = read_packed_adapter(d, CFG, pool, name="x")[1]
    running, started, ended = [0], [], []
    real_finish, real_read = image_mod._finish_piece, OpenFile.read_scatter
    lock = threading.Lock()

    def slow_finish(*a):
        with lock:
            running[0] += 1
            started.append(1)
            n = len(started)
        time.sleep(0.05)
        try:
            if fail == "finish" and n == 2:
                raise RuntimeError("finish broke")
            return real_finish(*a)
        finally:
            with lock:
                running[0] -= 1
                ended.append(1)

    calls = []

    def short(self, bufs, offset):
        calls.append(offset)
        if fail == "read" and len(calls) == 4:
            raise self.fault(f"a read of 1 bytes at byte {offset} came up 1 bytes short")
        return real_read(self, bufs, offset)

    monkeypatch.setattr(image_mod, "_finish_piece", slow_finish)
    monkeypatch.setattr(OpenFile, "read_scatter", short)
    with pytest.raises(AdapterError if fail == "read" else RuntimeError,
                       match="came up 1 bytes short" if fail == "read" else "finish broke"):
        image_mod._read(d, CFG, pool, "x", False, None, False)
    assert running[0] == 0 and len(ended) >= (3 if fail == "read" else 2)
    monkeypatch.setattr(OpenFile, "read_scatter", real_read)
    monkeypatch.setattr(image_mod, "_finish_piece", real_finish)
    _assert_same_packed(read_image(d, CFG, pool, name="x")[1], want)


def test_pack_of_user_modules_is_bit_identical(tmp_path):
    """``pool.pack`` on LoRAAdapters built in memory: any floating dtype, non-contiguous tensors, every
    module rank (partial pages of every size), modules left out."""
    g = torch.Generator().manual_seed(3)
    for src_dtype in DTYPES:
        mods = {}
        for i, (layer, m) in enumerate((layer, m) for layer in range(CFG.num_layers) for m in TARGET_MODULES):
            if i % 5 == 2:
                continue  # untouched module: its region stays zero
            r = 1 + (i * 7) % 13
            d_in, d_out = CFG.module_shape(m)
            a = _values((d_in, r), src_dtype, g).t()  # non-contiguous A
            b = _values((r, d_out), src_dtype, g).t() if i % 2 else _values((d_out, r), src_dtype, g)
            mods[(layer, m)] = LoRAModuleWeights(a=a, b=b, scaling=0.25 * r)
        ad = LoRAAdapter(name="u", path="/nowhere", config={}, modules=mods)
        f32 = LoRAAdapter(name="u", path="/nowhere", config={}, modules={
            k: LoRAModuleWeights(a=w.a.float(), b=w.b.float(), scaling=w.scaling) for k, w in mods.items()})
        for pool_dtype in DTYPES:
            pool = _pool(pool_dtype)
            want = _reference_pack(pool, f32)
            _assert_same_packed(pool.pack(ad), want)
            _assert_same_packed(pool.pack(f32), want)


def test_empty_adapter_packs_an_empty_image():
    pool = _pool(torch.float32)
    got = pool.pack(LoRAAdapter(name=None, path="/nowhere", config={}, modules={}))
    _assert_same_packed(got, _reference_pack(pool, LoRAAdapter(name=None, path="/nowhere", config={}, modules={})))


def test_packer_rejects_misuse():
    pool = _pool(torch.float32)
    with pytest.raises(ValueError, match=r"adapter 'big': rank 17 exceeds the pool's max_rank 16"):
        pool.packer({(0, "q_proj"): 17}, name="big")
    with pytest.raises(ValueError, match=r"no \(5, 'q_proj'\) of rank 2"):
        pool.packer({(5, "q_proj"): 2}, name="x")
    pk = pool.packer({(0, "q_proj"): 4, (0, "k_proj"): 4, (0, "o_proj"): 4, (1, "v_proj"): 2}, name="p")
    a, b = torch.zeros(4, 24), torch.zeros(24, 4)
    pk.put(0, "q_proj", a, b, 1.0)
    with pytest.raises(ValueError, match="packed twice"):
        pk.put(0, "q_proj", a, b, 1.0)
    with pytest.raises(ValueError, match=r"expected A \[4, 24\] and B \[8, 4\]"):
        pk.put(0, "k_proj", torch.zeros(4, 24), torch.zeros(24, 4), 1.0)  # k_proj: d_in 24, d_out 8
    with pytest.raises(ValueError, match=r"\(r = 4 as declared\)"):
        pk.put(0, "o_proj", torch.zeros(5, 24), torch.zeros(24, 5), 1.0)
    with pytest.raises(ValueError, match="up_proj of layer 0 was not declared"):
        pk.put(0, "up_proj", torch.zeros(4, 24), torch.zeros(40, 4), 1.0)
    with pytest.raises(ValueError, match="3 declared module.* never packed, the first k_proj of layer 0"):
        pk.finish()


def test_pickle_file_takes_the_fast_path_too(tmp_path):
    d = _write_patterned(tmp_path / "a", torch.bfloat16)
    torch.save(load_file(str(d / WTS)), d / "adapter_model.bin")
    (d / WTS).unlink()
    pool = _pool(torch.bfloat16)
    want = _reference_pack(pool, load_peft_adapter(d, CFG, allow_pickle=True))
    _assert_same_packed(read_packed_adapter(d, CFG, pool, allow_pickle=True)[1], want)
    with pytest.raises(AdapterError, match="allow_pickle=True"):
        read_packed_adapter(d, CFG, pool)


def _rewrite_unaligned(d, pad=1):
    """Rewrite the safetensors file by hand with the data section starting at an odd byte (the format
    allows it; safetensors pads, other writers may not): no tensor can be viewed in place."""
    t = {k: v.clone() for k, v in load_file(str(d / WTS)).items()}
    names = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64"}
    header, data = {}, b""
    for k, x in t.items():
        raw = x.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        header[k] = {"dtype": names[x.dtype], "shape": list(x.shape), "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    h = json.dumps(header).encode()
    h += b" " * ((pad - 8 - len(h)) % 8)  # 8 + len(h) == pad (mod 8)
    (d / WTS).write_bytes(struct.pack("<Q", len(h)) + h + data)


@pytest.mark.parametrize("file_dtype", [torch.bfloat16, torch.float32], ids=str)
def test_lazy_tensors_equal_safetensors_also_unaligned(file_dtype, tmp_path):
    d = _write_patterned(tmp_path / "a", file_dtype)
    ref = {k: v.clone() for k, v in load_file(str(d / WTS)).items()}  # (load_file may map the file too)
    pool = _pool(torch.float32)
    want = _reference_pack(pool, load_peft_adapter(d, CFG))

    def check():
        _, tensors, keys, _ = _read_weights(d, False, lazy=True)
        assert isinstance(tensors, _LazyTensors) and sorted(keys) == sorted(ref)
        try:
            for k in keys:
                assert torch.equal(_bits(tensors[k]), _bits(ref[k])) and tensors[k].dtype == ref[k].dtype
        finally:
            tensors.close()
        _assert_same_packed(read_packed_adapter(d, CFG, pool)[1], want)

    check()
    for pad in (1, 2, 6):
        _rewrite_unaligned(d, pad)
        check()


# ----------------------------------------------------------------------------------------- same errors


def _err(fn) -> AdapterError:
    with pytest.raises(AdapterError) as ei:
        fn()
    return ei.value


def _assert_same_error(d, **kw):
    pool = _pool(torch.bfloat16)
    want = _err(lambda: load_peft_adapter(d, CFG, **kw))
    got = _err(lambda: read_packed_adapter(d, CFG, pool, **kw))
    assert (str(got), got.key, got.path) == (str(want), want.key, want.path)
    assert type(got) is type(want)
    fast = _err(lambda: read_image(d, CFG, pool, **kw))  # the cache's reload path
    assert (str(fast), fast.key, fast.path) == (str(want), want.key, want.path)
    _assert_same_header_check(d, pool, **kw)
    return got


def _assert_same_header_check(d, pool, **kw):
    """``read_header`` (``load_adapter(preload=False)``) refuses what ``load_peft_adapter(header_only=True)`` refuses,
    with the same error, and accepts what it accepts (value errors are found when the values are read)."""
    try:
        want = load_peft_adapter(d, CFG, header_only=True, **kw)
    except AdapterError as e:
        got = _err(lambda: read_header(d, CFG, pool, **kw))
        assert (str(got), got.key, got.path, type(got)) == (str(e), e.key, e.path, type(e))
    else:
        _assert_same_adapter(read_header(d, CFG, pool, **kw), want)


def _assert_same_adapter(got: LoRAAdapter, want: LoRAAdapter) -> None:
    assert (got.name, got.path, got.config, got.files) == (want.name, want.path, want.config, want.files)
    assert list(got.modules) == list(want.modules)
    for k, w in want.modules.items():
        g = got.modules[k]
        assert (g.a.shape, g.a.dtype, g.a.device, g.b.shape, g.b.dtype, g.b.device, g.scaling) == (
            w.a.shape, w.a.dtype, w.a.device, w.b.shape, w.b.dtype, w.b.device, w.scaling), k


@pytest.mark.parametrize("layout", ["uniform", "patterned"])
@pytest.mark.parametrize("file_dtype", [torch.bfloat16, torch.float32, torch.float64], ids=str)
def test_read_header_equals_the_header_only_load_and_parses_each_layout_once(layout, file_dtype, tmp_path,
                                                                             monkeypatch):
    """What ``load_adapter(preload=False)`` registers, through the copy plans cached by config and header bytes: the
    same adapter as ``load_peft_adapter(header_only=True)`` (name, path, config, the files' own stamps, modules'
    shapes, dtypes and scalings); a second directory of the same bytes is not parsed again; float64 files (no
    plan) and a rank above the pool's take the general path and give the same."""
    import multilora.runtime.adapters.image as image

    write = _write_uniform if layout == "uniform" else _write_patterned
    a, b = write(tmp_path / "a", file_dtype), write(tmp_path / "b", file_dtype, seed=1)  # same header, other values
    pool = _pool(torch.bfloat16)
    made = []
    make = image._make_plan
    monkeypatch.setattr(image, "_make_plan", lambda *args: made.append(1) or make(*args))
    image._plans.clear()
    for d, n in ((a, "x"), (b, "y"), (a, "z")):
        _assert_same_adapter(read_header(d, CFG, pool, name=n), load_peft_adapter(d, CFG, name=n, header_only=True))
    assert len(made) == (3 if file_dtype == torch.float64 else 1)  # float64: no plan to keep (the general path)
    if file_dtype != torch.float64:  # the reload uses the plan the registration made
        read_image(b, CFG, pool, name="y")
        assert len(made) == 1
    small = _pool(torch.bfloat16, max_rank=4)  # a rank above the pool's: the adapter alone, validated the same
    _assert_same_adapter(read_header(a, CFG, small, name="r"), load_peft_adapter(a, CFG, name="r", header_only=True))
    # the engine's load_adapter(preload=False) goes this way
    from multilora.runtime.adapters import read_adapter

    got, packed = read_adapter(b, CFG, pool, name="e", preload=False, max_rank=16)
    assert packed is None
    _assert_same_adapter(got, load_peft_adapter(b, CFG, name="e", header_only=True))


def test_read_header_of_a_pickle_takes_the_general_path(tmp_path):
    d = _write_uniform(tmp_path / "a", torch.float32, r=4)
    torch.save(load_file(str(d / WTS)), d / "adapter_model.bin")
    (d / WTS).unlink()
    pool = _pool(torch.float32)
    with pytest.raises(AdapterError, match="pickle"):
        read_header(d, CFG, pool)
    got = read_header(d, CFG, pool, allow_pickle=True)
    want = load_peft_adapter(d, CFG, allow_pickle=True, header_only=True)
    assert got.files == want.files and all(torch.equal(got.modules[k].a, w.a) for k, w in want.modules.items())


def _patch(d, fn):
    t = {k: v.clone() for k, v in load_file(str(d / WTS)).items()}  # not views of the file being rewritten
    fn(t)
    save_file(t, str(d / WTS), metadata={"format": "pt"})


def _key(layer, module, kind):
    return f"base_model.model.model.layers.{layer}.{MODULE_PARENT[module]}.{module}.lora_{kind}.weight"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("where", ["A-first", "B-last", "middle-B"])
def test_deferred_image_check_names_the_tensor(where, dtype, tmp_path):
    """Files in the pool dtype: ``read_image`` checks the whole image once at the end (not tensor by tensor); its
    own error, without the general path's re-read, names the same tensor and count as ``load_peft_adapter``."""
    from pathlib import Path

    from multilora.runtime.adapters.image import _read

    d = _write_uniform(tmp_path / "a", dtype, r=4)
    k = {"A-first": _key(0, "q_proj", "A"), "B-last": _key(CFG.num_layers - 1, "down_proj", "B"),
         "middle-B": _key(1, "v_proj", "B")}[where]
    _patch(d, lambda t: t[k].view(-1).__setitem__(slice(1, None, 5), float("nan")))
    want = _err(lambda: load_peft_adapter(d, CFG))
    pool = _pool(dtype)
    got = _err(lambda: _read(Path(d), CFG, pool, None, False, None, False))
    assert (str(got), got.key, got.path) == (str(want), want.key, want.path)
    assert got.key == k
    assert _read(Path(d), CFG, pool, None, False, None, True)[1] is not None  # verified: no check at all


@pytest.mark.parametrize("check_chunk", [None, 1000], ids=["default-chunk", "1000-element-chunks"])
@pytest.mark.parametrize("file_dtype", DTYPES + [torch.float64], ids=str)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("where", ["A-first", "B-last", "many"])
def test_non_finite_rejected_with_the_same_message(where, bad, file_dtype, check_chunk, tmp_path, monkeypatch):
    """(``check_chunk``: the whole-image check in the image's one default chunk, or in many chunks of 1000 elements
    with a ragged last one, ``image._CHECK_CHUNK``)"""
    if check_chunk is not None:
        monkeypatch.setattr(image_mod, "_CHECK_CHUNK", check_chunk)
    d = _write_uniform(tmp_path / "a", file_dtype, r=4)
    k = _key(0, "q_proj", "A") if where == "A-first" else _key(CFG.num_layers - 1, "down_proj", "B")

    def poison(t):
        x = t[k]
        if where == "many":
            x.view(-1)[::3] = bad
        else:
            x.view(-1)[-1] = bad  # the last element: the tail of any vectorised reduction
        t[_key(1, "o_proj", "B")][0, 0] = 1.0  # later / earlier modules stay finite

    _patch(d, poison)
    err = _assert_same_error(d)
    assert err.key == k and "expected finite values" in str(err)
    n = math.ceil(load_file(str(d / WTS))[k].numel() / 3) if where == "many" else 1
    assert f"got {n} non-finite (NaN/inf) of " in str(err)


def test_float64_overflowing_float32_is_still_refused(tmp_path):
    """A float64 value finite in the file but not in float32: refused before, refused now."""
    d = _write_uniform(tmp_path / "a", torch.float64, r=4)
    _patch(d, lambda t: t[_key(2, "up_proj", "A")].__setitem__((1, 2), 1e300))
    assert "got 1 non-finite" in str(_assert_same_error(d))


BREAKERS = {
    "nan-before-bad-shape": lambda t: (t[_key(0, "k_proj", "B")].__setitem__((0, 0), float("nan")),
                                       t.__setitem__(_key(2, "q_proj", "A"), torch.zeros(3, 24))),
    "bad-shape-before-nan": lambda t: (t.__setitem__(_key(0, "k_proj", "B"), torch.zeros(8, 3)),
                                       t[_key(2, "q_proj", "A")].__setitem__((0, 0), float("nan"))),
    "integer": lambda t: t.__setitem__(_key(1, "v_proj", "A"), torch.ones(4, 24, dtype=torch.int32)),
    "half-pair": lambda t: t.pop(_key(1, "gate_proj", "B")),
    "missing-module": lambda t: (t.pop(_key(2, "o_proj", "A")), t.pop(_key(2, "o_proj", "B"))),
    "extra-key": lambda t: t.__setitem__("base_model.model.model.norm.weight", torch.zeros(24)),
    "nan-in-a-valid-adapter-then-extra-key": lambda t: (t[_key(0, "q_proj", "A")].__setitem__((0, 0), float("nan")),
                                                        t.__setitem__(_key(5, "q_proj", "A"), torch.zeros(4, 24))),
}


@pytest.mark.parametrize("name", list(BREAKERS))
def test_broken_files_fail_the_same_way(name, tmp_path):
    d = _write_uniform(tmp_path / "a", torch.bfloat16, r=4)
    _patch(d, BREAKERS[name])
    _assert_same_error(d)


def test_broken_directories_fail_the_same_way(tmp_path):
    _assert_same_error(tmp_path / "nope")
    d = _write_uniform(tmp_path / "a", torch.bfloat16, r=4)
    (d / WTS).write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}")
    assert "cannot read the safetensors file" in str(_assert_same_error(d))
    d = _write_uniform(tmp_path / "b", torch.bfloat16, r=4)
    cfg = json.loads((d / "adapter_config.json").read_text())
    cfg["use_dora"] = True
    (d / "adapter_config.json").write_text(json.dumps(cfg))
    _assert_same_error(d)


def test_rank_above_the_pool_validates_values_first(tmp_path):
    """open_sink may decline (rank above the pool): values are still checked, so the error a caller raises
    afterwards for the rank comes after the value errors, as before."""
    d = _write_uniform(tmp_path / "a", torch.float32, r=8)
    pool = _pool(torch.float32, max_rank=4)
    adapter, packed = read_packed_adapter(d, CFG, pool)
    assert packed is None and adapter.max_rank == 8
    _patch(d, lambda t: t[_key(1, "up_proj", "B")].__setitem__((0, 0), float("inf")))
    with pytest.raises(AdapterError, match="non-finite"):
        read_packed_adapter(d, CFG, pool)


def test_sink_sees_modules_in_order_and_no_views_survive(tmp_path):
    d = _write_patterned(tmp_path / "a", torch.float16)
    seen = []

    class Sink:
        def put(self, layer, module, a, b, scaling):
            seen.append((layer, module, a.dtype, tuple(a.shape), tuple(b.shape), scaling))

    adapter, sink = load_peft_adapter_into(d, CFG, lambda r: (seen.append(r), Sink())[1])
    ref = load_peft_adapter(d, CFG)
    assert max(seen[0].values()) == ref.max_rank == 11
    assert list(seen[0]) == list(ref.modules) and all(r == ref.modules[k].rank for k, r in seen[0].items())
    assert [(layer, m) for layer, m, *_ in seen[1:]] == list(ref.modules)
    for (layer, m, dt, sa, sb, s) in seen[1:]:
        w = ref.modules[(layer, m)]
        assert dt == torch.float16 and sa == tuple(w.a.shape) and sb == tuple(w.b.shape) and s == w.scaling
    assert all(w.a.device.type == "meta" for w in adapter.modules.values())


# ----------------------------------------------------------------------------------------- finiteness check


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", DTYPES + [torch.float64], ids=str)
def test_all_finite_matches_isfinite(dtype, threads):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(0)
        for n in (1, 2, 7, 16, 31, 64, 257, 4099, 70_001):  # vector tails and multi-chunk reductions
            x = _values((n,), dtype, g)
            assert _all_finite(x)
            for pos in sorted({0, n // 3, n // 2, n - 1}):
                for bad in (float("nan"), float("inf"), -float("inf")):
                    y = x.clone()
                    y[pos] = bad
                    assert not _all_finite(y), (n, pos, bad)
                    assert not _all_finite(y.view(1, n).t())  # a strided view
        assert _all_finite(torch.empty(0, dtype=dtype))
    finally:
        torch.set_num_threads(before)


# ----------------------------------------------------------------------------------------- engine


ECFG = ModelConfig(**MODEL_SHAPES["tiny"])


@pytest.fixture(scope="module")
def engine():
    return Engine(ECFG, device="cpu", progress=False, max_batch_size=4, max_seq_len=32, max_lora_rank=8, adapter_slots=2)


def test_engine_preload_and_reload_use_the_fast_path(engine, tmp_path):
    d = write_adapter(tmp_path / "a", ECFG, seed=5, rank=8, modules=("q_proj", "down_proj"))
    adapter = engine.load_adapter("fast", d)
    assert all(w.a.device.type == "meta" for w in adapter.modules.values())
    assert "r=8" in adapter.target_summary()
    want = _reference_pack(engine.pool, load_peft_adapter(d, ECFG, name="fast"))
    handle = engine.cache.get("fast")
    _assert_same_packed(handle.host, want)
    _assert_same_packed(engine._reload_adapter(handle), want)


def test_engine_preload_errors_unchanged(engine, tmp_path):
    d = write_adapter(tmp_path / "big", ECFG, seed=6, rank=16, modules=("v_proj",))
    with pytest.raises(AdapterError, match="exceeds the engine's max_lora_rank 8"):
        engine.load_adapter("big", d)
    _patch(d, lambda t: t[next(k for k in t if "lora_B" in k)].__setitem__((0, 0), float("nan")))
    with pytest.raises(AdapterError, match="non-finite"):  # values are checked before the rank, as before
        engine.load_adapter("big", d)
    assert "big" not in engine.list_adapters()


def test_engine_preload_reads_through_the_copy_plan(engine, tmp_path, monkeypatch):
    """``load_adapter(preload=True)`` of a safetensors adapter reads through ``read_image`` (the cached copy plan,
    4-5x faster than the general path for a Llama-3-8B adapter): the general path is not called, and the host image
    is the reference's. A rank above the pool's still goes through the general path (its error order)."""
    import multilora.runtime.adapters.image as image

    d = write_adapter(tmp_path / "plan", ECFG, seed=7, rank=4, modules=("k_proj", "gate_proj"))
    calls = []
    general = image.read_packed_adapter
    monkeypatch.setattr(image, "read_packed_adapter", lambda *a, **k: calls.append(a) or general(*a, **k))
    engine.load_adapter("plan", d)
    assert calls == []
    want = _reference_pack(engine.pool, load_peft_adapter(d, ECFG, name="plan"))
    _assert_same_packed(engine.cache.get("plan").host, want)
    big = write_adapter(tmp_path / "big2", ECFG, seed=8, rank=16, modules=("v_proj",))
    with pytest.raises(AdapterError, match="exceeds the engine's max_lora_rank 8"):
        engine.load_adapter("big2", big)
    assert len(calls) == 1
