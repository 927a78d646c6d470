"""Raw adapter images finished on the device (issue 13 item 4): ``read_image(..., raw=True)`` reads every tensor's
bytes straight into place and ``AdapterPool.load`` transposes lora_B, fills a fused projection's other A regions
and checks the values after the copy (``multilora.kernels.image_finish``, ``triton_image_finish``).

The reference is the host-finished image of the same files (``read_image`` without ``raw``, itself bit-identical
to a plain reference packer in ``test_adapter_fastpath.py``): every path must give its bits exactly. The Triton
kernel runs under TRITON_INTERPRET=1 on the CPU (fp32, fp16) and on the GPU in the GPU suite (bf16 too).
"""

from __future__ import annotations

import json
import os
import struct

import pytest
import torch
from conftest import requires_gpu

from multilora import Engine, SamplingParams
from multilora.config import TARGET_MODULES, ModelConfig
from multilora.kernels.image_finish import FinishOps, block_cols_for, finish_ops, finish_torch
from multilora.memory.pool import AdapterPool
from multilora.runtime.adapters import AdapterError, save_peft_adapter
from multilora.runtime.adapters.image import read_image
from testsupport import one_thread  # noqa: F401 (autouse fixture)

CFG = ModelConfig(vocab_size=32, hidden_size=24, intermediate_size=40, num_layers=3, num_heads=3, num_kv_heads=1)
interp = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" or torch.cuda.is_available(),
                            reason="CPU cases need TRITON_INTERPRET=1 (the GPU suite runs the gpu-marked ones)")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def _write(path, dtype, kind="uniform", seed=0, r=8):
    """An adapter in one file dtype: ``uniform`` (every module at r, rsLoRA) or ``patterned`` (rank_pattern,
    alpha_pattern, layers 0 and 2 only: ranks 5, 3 and 11 and partial pages everywhere)."""
    g = torch.Generator().manual_seed(seed)
    if kind == "uniform":
        ranks = {(layer, m): r for layer in range(CFG.num_layers) for m in TARGET_MODULES}
        kw = dict(r=r, lora_alpha=2 * r, target_modules=list(TARGET_MODULES), use_rslora=True)
    else:
        ranks = {(layer, m): rr for layer in (0, 2) for m, rr in (("q_proj", 5), ("v_proj", 3), ("down_proj", 11))}
        kw = dict(r=5, lora_alpha=10, target_modules=["q_proj", "v_proj", "down_proj"],
                  rank_pattern={"v_proj": 3, "down_proj": 11}, alpha_pattern={"down_proj": 7.5}, layers_to_transform=[0, 2])
    mods = {}
    for (layer, m), rr in ranks.items():
        d_in, d_out = CFG.module_shape(m)
        x = torch.randn(rr * (d_in + d_out), generator=g, dtype=torch.float64)
        x = (x * torch.pow(2.0, torch.randint(-30, 10, x.shape, generator=g).double())).to(dtype)
        x[::7] = -0.0
        mods[(layer, m)] = (x[: rr * d_in].view(rr, d_in), x[rr * d_in :].view(d_out, rr))
    save_peft_adapter(path, mods, **kw)
    return path


def _pool(dtype, max_rank=16, device="cpu"):
    return AdapterPool(CFG, num_bytes=1 << 20, max_rank=max_rank, dtype=dtype, device=device)


def _poison(path, key_part: str, index: int, value: float) -> str:
    """Overwrite one element of the first tensor whose key contains ``key_part`` in place; its key."""
    f = path / "adapter_model.safetensors"
    raw = bytearray(f.read_bytes())
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8 : 8 + n])
    key = sorted(k for k in header if key_part in k)[0]
    e = header[key]
    dt = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}[e["dtype"]]
    size = torch.empty((), dtype=dt).element_size()
    at = 8 + n + e["data_offsets"][0] + index * size
    raw[at : at + size] = torch.tensor([value], dtype=dt).view(torch.uint8).numpy().tobytes()
    f.write_bytes(bytes(raw))
    return key


# ------------------------------------------------------------------------------------------------ reads


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("kind", ["uniform", "patterned"])
def test_raw_read_finished_by_torch_is_the_host_finished_image(kind, dtype, tmp_path):
    d = _write(tmp_path / "a", dtype, kind)
    pool = _pool(dtype)
    _, want = read_image(d, CFG, pool, name="x")
    _, raw = read_image(d, CFG, pool, name="x", raw=True)
    assert want.finish is None and want.checked
    assert raw.finish is not None and not raw.checked and raw.data.shape == want.data.shape
    assert not torch.equal(_bits(raw.data), _bits(want.data))  # lora_B really is left untransposed
    for field in ("ranks", "scalings", "offsets"):
        assert torch.equal(getattr(raw, field), getattr(want, field))
    out = torch.full_like(want.data, float("nan"))
    assert finish_torch(raw.data, out, raw.finish) == 0
    assert torch.equal(_bits(out), _bits(want.data))
    # verified files: a raw image that needs no check
    assert read_image(d, CFG, pool, name="x", raw=True, verified=True)[1].checked


def test_raw_read_of_another_dtype_is_finished_on_the_host(tmp_path):
    """A file not in the pool dtype is converted on the host: ``raw`` gives a finished image."""
    d = _write(tmp_path / "a", torch.float32)
    pool = _pool(torch.bfloat16)
    _, got = read_image(d, CFG, pool, name="x", raw=True)
    assert got.finish is None and got.checked
    assert torch.equal(_bits(got.data), _bits(read_image(d, CFG, pool, name="x")[1].data))


@pytest.mark.parametrize("kind", ["uniform", "patterned"])
def test_pool_load_of_a_raw_image(kind, tmp_path):
    """``AdapterPool.load`` finishes a raw image (CPU pool: torch ops): the pool holds the host-finished image,
    whose ``unpack`` returns it, and the load's check answers once."""
    d = _write(tmp_path / "a", torch.float32, kind)
    pool = _pool(torch.float32)
    _, want = read_image(d, CFG, pool, name="x")
    _, raw = read_image(d, CFG, pool, name="x", raw=True)
    other = pool.load(want)  # a finished image beside it
    slot = pool.load(raw)
    assert pool.needs_check(slot) and not pool.needs_check(other)
    assert pool.nonfinite(slot) is None and not pool.needs_check(slot)
    assert torch.equal(pool.unpack(slot).data, want.data) and torch.equal(pool.unpack(other).data, want.data)
    assert torch.equal(pool.offsets_a[..., slot] - pool.offsets_a[..., other],
                       (pool.offsets_a[..., slot] > 0) * (pool.extent_of(slot)[0] - pool.extent_of(other)[0]) * 64)
    raw.checked = True  # a raw image known finite: no check pending
    pool.free(slot)
    assert not pool.needs_check(pool.load(raw))


def test_nonfinite_raw_image_names_its_tensor(tmp_path):
    d = _write(tmp_path / "a", torch.float16, "patterned")
    key = _poison(d, "layers.2.mlp.down_proj.lora_B", 5, float("inf"))
    pool = _pool(torch.float16)
    _, raw = read_image(d, CFG, pool, name="x", raw=True)  # read raw: no check on the host
    with pytest.raises(AdapterError, match="non-finite"):
        read_image(d, CFG, pool, name="x")  # the host path refuses it
    slot = pool.load(raw)
    assert pool.nonfinite(slot) == key
    assert pool.nonfinite(slot) is None  # answered once


# ------------------------------------------------------------------------------------------- plans and ops


def test_plan_cuts_whole_groups_into_staging_chunks(tmp_path):
    d = _write(tmp_path / "a", torch.float32, "patterned")
    _, raw = read_image(d, CFG, _pool(torch.float32), name="x", raw=True)
    fin = raw.finish
    groups = fin.groups.tolist()
    assert groups[0][0] == 0 and groups[-1][1] == fin.numel
    assert all(a[1] == b[0] for a, b in zip(groups, groups[1:]))
    for staging in (fin.largest_group, fin.largest_group + 100, 3 * fin.largest_group, fin.numel):
        plan = fin.plan(staging, 16)
        assert plan.chunks[0][0] == 0 and plan.chunks[-1][1] == fin.numel
        starts = {g[0] for g in groups} | {fin.numel}
        for (s, e, t0, t1), nxt in zip(plan.chunks, plan.chunks[1:] + ((fin.numel, None, plan.tiles.shape[0], None),)):
            assert s in starts and e in starts and e - s <= staging and nxt[0] == e and nxt[2] == t1
            assert bool((plan.tiles[t0:t1, 0] >= s).all()) and bool((plan.tiles[t0:t1, 1] + 0 < e).all())
        # the tiles of each op cover its rows exactly once
        for i, (src, dst, rows, cols, tr) in enumerate(fin.ops.tolist()):
            t = plan.tiles[plan.tiles[:, 6] == i]
            span = rows if tr else -(-(rows * cols) // 16)
            assert t[:, 5].tolist() == list(range(0, span, plan.block_rows))
    assert fin.plan(fin.largest_group, 16) is fin.plan(fin.largest_group, 16)  # cached
    # equal layouts (another object, e.g. another config's bytes) share device-side caches by content
    twin = finish_ops(fin.ops.tolist(), fin.groups.tolist(), list(fin.keys), fin.numel)
    assert twin is not fin and twin.content_key == fin.content_key
    other = finish_ops(fin.ops.tolist(), fin.groups.tolist(), list(fin.keys), fin.numel + 0)
    assert other.content_key == fin.content_key
    moved = fin.ops.clone()
    moved[0, 3], moved[0, 2] = 2, moved[0, 2] // 2  # the same elements as 2 columns: another op
    assert finish_ops(moved.tolist(), fin.groups.tolist(), list(fin.keys), fin.numel).content_key != fin.content_key
    with pytest.raises(ValueError, match="does not fit a staging buffer"):
        fin.plan(fin.largest_group - 1, 16)
    with pytest.raises(ValueError, match="wider than block_cols=8"):
        fin.plan(fin.numel, 8)


def test_finish_ops_refuse_a_bad_layout():
    with pytest.raises(ValueError, match=r"tile \[0, 10\) exactly"):
        finish_ops([(0, 0, 4, 1, 0), (4, 5, 5, 1, 0)], [(0, 10, 0)], ["a", "b"], 10)
    with pytest.raises(ValueError, match="leaves its group"):
        finish_ops([(0, 0, 4, 1, 0), (6, 4, 2, 3, 1)], [(0, 4, 0), (4, 10, 1)], ["a", "b"], 10)
    with pytest.raises(ValueError, match="keys must name every op"):
        FinishOps(ops=torch.zeros(2, 5, dtype=torch.int64), groups=torch.zeros(1, 3, dtype=torch.int64), keys=("a",),
                  numel=0)
    assert block_cols_for(1) == 16 and block_cols_for(16) == 16 and block_cols_for(17) == 32 and block_cols_for(64) == 64


# ------------------------------------------------------------------------------------------- the kernel


def _kernel_finish(raw, fin, dtype, device, staging_elems, max_rank=16, at=192):
    from multilora.kernels.triton_image_finish import NO_BAD_OP, finish_image

    plan = fin.plan(staging_elems, block_cols_for(max_rank))
    buffer = torch.full((at + fin.numel + 64,), float("nan"), dtype=dtype, device=device)
    staging = torch.empty(staging_elems, dtype=dtype, device=device)
    flags = torch.full((5,), NO_BAD_OP, dtype=torch.int32, device=device)
    finish_image(raw.to(device), buffer, at, plan, plan.tiles.to(device), staging, flags, 3)
    bad = int(flags[3])
    assert (flags[[0, 1, 2, 4]] == NO_BAD_OP).all()
    assert torch.isnan(buffer[:at].float()).all() and torch.isnan(buffer[at + fin.numel :].float()).all()
    return buffer[at : at + fin.numel].cpu(), None if bad == NO_BAD_OP else bad


def _kernel_case(tmp_path, dtype, device, kind, max_rank):
    d = _write(tmp_path / "a", dtype, kind, r=min(max_rank, 8))
    pool = _pool(dtype, max_rank=max_rank)
    _, want = read_image(d, CFG, pool, name="x")
    _, raw = read_image(d, CFG, pool, name="x", raw=True)
    fin = raw.finish
    for staging in (fin.largest_group, 2 * fin.largest_group + 64, fin.numel):  # several chunks, then one
        got, bad = _kernel_finish(raw.data, fin, dtype, device, staging, max_rank)
        assert bad is None and torch.equal(_bits(got), _bits(want.data)), staging
    key = _poison(d, "layers.0.self_attn.v_proj.lora_B", 2, float("nan"))  # and a second, later one
    _poison(d, "layers.2.mlp.down_proj.lora_A", 0, float("-inf"))
    _, raw = read_image(d, CFG, pool, name="x", raw=True)
    ref = torch.empty_like(raw.data)
    first = finish_torch(raw.data, ref, fin)
    got, bad = _kernel_finish(raw.data, fin, dtype, device, fin.largest_group, max_rank)
    assert fin.keys[first - 1] == key and bad == first - 1 and torch.equal(_bits(got), _bits(ref))


@interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("kind,max_rank", [("uniform", 16), ("patterned", 32)])
def test_kernel_is_bit_identical_to_torch_interpreted(kind, max_rank, dtype, tmp_path):
    _kernel_case(tmp_path, dtype, "cpu", kind, max_rank)


@requires_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("kind,max_rank", [("uniform", 16), ("patterned", 64)])
def test_kernel_is_bit_identical_to_torch_gpu(kind, max_rank, dtype, tmp_path):
    _kernel_case(tmp_path, dtype, "cuda", kind, max_rank)


@requires_gpu
@pytest.mark.gpu
def test_cuda_pool_loads_raw_images_on_a_side_stream(tmp_path):
    """The pool's own path on CUDA: pinned source, side stream, staging smaller than the image (several chunks),
    the check read after the event; a poisoned image is reported with its tensor."""
    from multilora.memory.host_arena import HostArena

    dtype = torch.bfloat16
    d = _write(tmp_path / "a", dtype, "uniform")
    pool = _pool(dtype, device="cuda")
    _, want = read_image(d, CFG, pool, name="x")
    arena = HostArena(None, pinned=True, unit=pool.page_bytes, chunk_bytes=1 << 20)
    block = arena.alloc(want.nbytes)
    _, raw = read_image(d, CFG, pool, name="x", raw=True, out=block.view(dtype))
    import multilora.memory.pool as pool_mod

    side = torch.cuda.Stream()
    old = pool_mod.staging_elems
    pool_mod.staging_elems = lambda config, max_rank: raw.finish.largest_group  # force several chunks
    try:
        slot = pool.load(raw, stream=side)
    finally:
        pool_mod.staging_elems = old
    assert len(raw.finish.plan(raw.finish.largest_group, 16).chunks) > 1
    assert pool.nonfinite(slot) is None
    torch.cuda.current_stream().wait_stream(side)
    assert torch.equal(_bits(pool.unpack(slot).data), _bits(want.data))
    key = _poison(d, "layers.1.mlp.up_proj.lora_B", 7, float("inf"))
    _, raw2 = read_image(d, CFG, pool, name="y", raw=True, out=arena.alloc(want.nbytes).view(dtype))
    slot2 = pool.load(raw2, stream=side)
    assert pool.nonfinite(slot2) == key and pool.nonfinite(slot) is None


# ------------------------------------------------------------------------------------------- the engine


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory):
    from testsupport import tiny_llama_dir

    return tiny_llama_dir(tmp_path_factory, vocab_size=64)


def test_engine_with_raw_reloads_serves_the_same_tokens_and_fails_only_a_poisoned_adapter(engine_dir, tmp_path):
    """``adapter_finish="device"`` on a CPU engine (the pool finishes with torch ops): adapters registered on disk are read raw
    and generate exactly the tokens of the host-finished path; a poisoned adapter fails its own request, with its
    tensor named, and nobody else's; a later request for it fails at once."""
    from testsupport import write_adapter

    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]
    sp = SamplingParams(max_tokens=6, ignore_eos=True)
    names = ["a0", "a1", "bad"]
    runs = {}
    for raw in (False, True):
        e = Engine(model=str(engine_dir), progress=False, max_batch_size=8, adapter_finish="device" if raw else "host")
        assert e.raw_reloads is raw
        for i, n in enumerate(names):
            if not (tmp_path / n).exists():
                write_adapter(tmp_path / n, e.config, i, 4, ["q_proj", "v_proj", "down_proj"])
            e.load_adapter(n, tmp_path / n, preload=False)  # on the disk tier: the first use reads it
        if not raw:
            bad_key = _poison(tmp_path / "bad", "layers.1.mlp.down_proj.lora_B", 3, float("nan"))
            e.load_adapter("bad", tmp_path / "bad", preload=False)  # (its files changed: registered again)
        runs[raw] = e.generate(prompts, adapters=names, sampling=sp)
        s = e.stats()
        assert s["adapter_load_failures"] >= 1
        again = e.generate([prompts[2]], adapters=["bad"], sampling=sp)[0]
        assert again.finish_reason == "error" and "non-finite" in again.error
    ref, got = runs[False], runs[True]
    assert [o.token_ids for o in got[:2]] == [o.token_ids for o in ref[:2]]
    assert all(o.finish_reason == "length" for o in got[:2])
    assert ref[2].finish_reason == got[2].finish_reason == "error"
    assert bad_key in got[2].error and "non-finite" in got[2].error and "check after the copy" in got[2].error


def test_kernel_compiles_for_sm90():
    """The kernel compiles for an H100/H200 (sm_90) on any machine (Triton's wheel carries ptxas): the interpreter
    accepts code the compiler refuses (a value of two shapes across an ``if``'s branches; session 12 lost a GPU
    call to that), so this runs the real compiler on every dtype and tile width the pools use."""
    import subprocess
    import sys

    pytest.importorskip("triton")
    pytest.importorskip("triton.backends.nvidia", reason="Triton's NVIDIA backend (ptxas) is not installed")
    code = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from multilora.kernels import triton_image_finish as tk
from multilora.kernels.image_finish import NUM_WARPS, TILE_ELEMS
tk.NUM_WARPS, tk.TILE_ELEMS = NUM_WARPS, TILE_ELEMS
fn = tk._finish_kernel
names = fn.arg_names
for dt in ("bf16", "fp16", "fp32"):
    for bc in (16, 32, 64, 128):
        consts = {"BR": tk.TILE_ELEMS // bc, "BC": bc}
        ptrs = {"src_ptr": "*" + dt, "dst_ptr": "*" + dt, "tiles_ptr": "*i64", "flag_ptr": "*i32"}
        sig = {n: ptrs.get(n) or ("constexpr" if n in consts else "i64") for n in names}
        attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if n in ptrs}
        src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(n),): v for n, v in consts.items()}, attrs=attrs)
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": tk.NUM_WARPS, "num_stages": 2})
        assert "atom.global" in k.asm["ptx"] and "st.global" in k.asm["ptx"], (dt, bc)
print("ok")
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env)
    if p.returncode != 0 and "ptxas" in p.stderr:
        pytest.skip(f"no ptxas for sm_90 here: {p.stderr[-300:]}")
    assert p.returncode == 0 and p.stdout.strip().endswith("ok"), p.stderr[-3000:]


def test_a_check_still_in_flight_never_stalls_admission(engine_dir, tmp_path):
    """A load whose device check has not landed yet (forced here: ``check_ready`` False for its first reads) is
    admitted without a host wait; the poisoned adapter's request fails alone, by its non-finite logits, and the
    check read at a later step fails the adapter for good with its tensor named."""
    from testsupport import write_adapter

    e = Engine(model=str(engine_dir), progress=False, max_batch_size=8, adapter_finish="device")
    write_adapter(tmp_path / "good", e.config, 1, 4, ["q_proj", "v_proj"])
    write_adapter(tmp_path / "bad", e.config, 2, 4, ["q_proj", "v_proj"])
    key = _poison(tmp_path / "bad", "layers.0.self_attn.q_proj.lora_A", 1, float("inf"))
    e.load_adapter("good", tmp_path / "good", preload=False)
    e.load_adapter("bad", tmp_path / "bad", preload=False)
    pool, real = e.pool, e.pool.check_ready
    asked, landed = [], [False]

    def late(slot):  # "not landed yet" for every question until the test says so
        asked.append(slot)
        return real(slot) if landed[0] else False

    pool.check_ready = late
    sp = SamplingParams(max_tokens=4, ignore_eos=True)
    out = e.generate([[5, 6, 7], [8, 9, 10]], adapters=["good", "bad"], sampling=sp)
    assert len(set(asked)) == 2, "both loads' checks were asked for, and not waited for"
    assert out[0].finish_reason == "length" and len(out[0].token_ids) == 4
    assert out[1].finish_reason == "error" and "not finite" in out[1].error and "'bad'" in out[1].error
    h = e.cache.get("bad")
    assert h.failed is None and not e.cache.get("good").values_checked  # nothing read yet
    landed[0] = True
    e.cache.wait_ready([])  # every step's wait_ready reads the checks that have landed
    assert h.failed is not None and key in h.failed and e.cache.get("good").values_checked
    later = e.generate([[11, 12]], adapters=["bad"], sampling=sp)[0]
    assert later.finish_reason == "error" and key in later.error


def test_adapter_finish_option(tmp_path):
    """``adapter_finish``: "host" by default, "device" on request, anything else refused naming the argument; the
    CLI flag reaches the config; the memory plan counts the staging buffers only for "device"."""
    import argparse

    from multilora.runtime.config import EngineConfig
    from multilora.runtime.sizing import memory_request
    from multilora.memory.pool import staging_elems

    assert EngineConfig().adapter_finish == "host" and EngineConfig(adapter_finish="device").adapter_finish == "device"
    with pytest.raises(ValueError, match=r"Engine: adapter_finish must be 'host' or 'device', got 'gpu'"):
        EngineConfig(adapter_finish="gpu")
    with pytest.raises(ValueError, match=r"adapter_finish='device' is not available with tensor_parallel_size=2"):
        EngineConfig(adapter_finish="device", tensor_parallel_size=2)
    p = argparse.ArgumentParser()
    EngineConfig.add_cli_flags(p)
    assert EngineConfig.from_cli(p.parse_args(["--adapter-finish", "device"])).adapter_finish == "device"
    with pytest.raises(SystemExit):
        p.parse_args(["--adapter-finish", "gpu"])
    host = memory_request(CFG, EngineConfig(), dtype=torch.bfloat16, max_seq_len=64)
    dev = memory_request(CFG, EngineConfig(adapter_finish="device"), dtype=torch.bfloat16, max_seq_len=64)
    assert dev.activation_bytes - host.activation_bytes == 2 * staging_elems(CFG, 64) * 2


def test_adapter_io_threads_option(engine_dir):
    """``adapter_io_threads`` sizes the cache's reader pool; a bad value names the argument."""
    from multilora.runtime.config import EngineConfig

    e = Engine(model=str(engine_dir), progress=False, max_batch_size=2, adapter_io_threads=2)
    assert e.cache.io_threads == 2 and e.cache._io._max_workers == 2
    with pytest.raises(ValueError, match=r"Engine: adapter_io_threads must be an int >= 1, got 0"):
        EngineConfig(adapter_io_threads=0)


def test_a_check_failing_while_its_request_runs(engine_dir, tmp_path):
    """The GPU's usual order: a check lands after admission and is read while a request still holds the adapter.
    The adapter stays in the pool while held (in use), then leaves every tier at its release: its bad values are
    never copied back to the host tier."""
    from testsupport import write_adapter

    e = Engine(model=str(engine_dir), progress=False, max_batch_size=8, adapter_finish="device",
               host_adapter_bytes=1 << 30)
    write_adapter(tmp_path / "bad", e.config, 2, 4, ["q_proj", "v_proj"])
    key = _poison(tmp_path / "bad", "layers.1.self_attn.v_proj.lora_B", 0, float("nan"))
    e.load_adapter("bad", tmp_path / "bad", preload=False)
    pool, real = e.pool, e.pool.check_ready
    landed = [False]
    pool.check_ready = lambda slot: real(slot) if landed[0] else False
    cache, h = e.cache, e.cache.get("bad")
    slot = cache.acquire(h)  # what admission does: read, copied, finished; the check not landed yet
    assert h.refcount == 1 and pool.needs_check(slot) and h.failed is None
    landed[0] = True
    cache.wait_ready([])  # every step reads the checks that have landed
    assert h.failed is not None and key in h.failed
    assert h.slot == slot and h.host is None  # held: it stays in the pool; its host copy is gone
    with pytest.raises(AdapterError, match="non-finite"):
        cache.acquire(h)
    cache.release(h)
    assert h.slot is None and h.host is None and h.tier == "disk" and not h.values_checked
    assert e.stats()["bytes_gpu_to_host"] == 0
    out = e.generate([[5, 6]], adapters=["bad"], sampling=SamplingParams(max_tokens=2))[0]
    assert out.finish_reason == "error" and key in out.error
