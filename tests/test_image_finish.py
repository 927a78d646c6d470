"""Raw adapter images finished on the device (issue 13 item 4): ``read_image(..., raw=True)`` reads every tensor's
bytes straight into place, ``AdapterPool.load`` copies it into its extent and the pool finishes it there in place
(transposes lora_B through a scratch, fills a fused projection's other A regions, checks the values), right after
the copy or deferred to ``finish_pending`` (``multilora.kernels.image_finish``, ``triton_image_finish``).

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
from multilora.kernels.image_finish import (GATHER, IN_PLACE, TRANSPOSE, FinishOps, block_cols_for, finish_ops,
                                            finish_torch)
from multilora.memory.pool import AdapterPool, StreamOrder
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


def test_inplace_plan_launches_and_tiles(tmp_path):
    """The in-place plan: the copies in one launch, then a gather and a transpose launch per chunk of transposes
    whose sources fit the scratch together (packed from 0); every op's rows are covered exactly once per launch
    it takes part in; cached per (scratch, width); content keys equal for equal layouts."""
    d = _write(tmp_path / "a", torch.float32, "patterned")
    _, raw = read_image(d, CFG, _pool(torch.float32), name="x", raw=True)
    fin = raw.finish
    ops = fin.ops.tolist()
    tr = [i for i, o in enumerate(ops) if o[4] == 1]
    size = {i: ops[i][2] * ops[i][3] for i in range(len(ops))}
    assert all(ops[i][0] == ops[i][1] for i in tr)  # the raw reader puts lora_B where its transpose goes
    for scratch in (fin.largest_transpose, fin.largest_transpose + 100, 3 * fin.largest_transpose, fin.numel):
        plan = fin.inplace_plan(scratch, 16)
        kinds = [k for k, _, _ in plan.launches]
        assert kinds[0] == IN_PLACE and kinds[1:] == [GATHER, TRANSPOSE] * ((len(kinds) - 1) // 2)
        assert [l[1] for l in plan.launches] == [0] + [l[2] for l in plan.launches[:-1]]
        assert plan.launches[-1][2] == plan.tiles.shape[0] and plan.scratch_elems <= scratch
        seen_tr = []
        for kind, t0, t1 in plan.launches:
            t = plan.tiles[t0:t1]
            idx = sorted(set(t[:, 6].tolist()))
            if kind == IN_PLACE:
                assert idx == [i for i in range(len(ops)) if i not in tr]
            else:
                assert all(i in tr for i in idx)
            if kind == GATHER:
                seen_tr += idx
                assert sum(size[i] for i in idx) <= scratch and bool((t[:, 4] == 0).all())
                # the gathered sources sit back to back from 0 in the scratch, in op order
                starts = {int(r[6]): int(r[1]) for r in t}
                assert [starts[i] for i in idx] == [sum(size[j] for j in idx[:k]) for k in range(len(idx))]
            if kind == TRANSPOSE:
                assert bool((t[:, 4] == 1).all())
            for i in idx:  # rows of each op covered exactly once
                ti = t[t[:, 6] == i]
                span = ti[0, 2].item() if kind == TRANSPOSE else -(-(ti[0, 2] * ti[0, 3]).item() // 16)
                assert ti[:, 5].tolist() == list(range(0, span, plan.block_rows))
        assert sorted(seen_tr) == tr
    assert len(fin.inplace_plan(fin.largest_transpose, 16).launches) > 3  # several chunks at the smallest scratch
    assert len(fin.inplace_plan(fin.numel, 16).launches) == 3  # one chunk
    assert fin.inplace_plan(fin.numel, 16) is fin.inplace_plan(fin.numel, 16)  # cached
    # equal layouts (another object, e.g. another config's bytes) share device-side caches by content
    twin = finish_ops(fin.ops.tolist(), fin.groups.tolist(), list(fin.keys), fin.numel)
    assert twin is not fin and twin.content_key == fin.content_key
    moved = fin.ops.clone()
    moved[0, 3], moved[0, 2] = 2, moved[0, 2] // 2  # the same elements as 2 columns: another op
    assert finish_ops(moved.tolist(), fin.groups.tolist(), list(fin.keys), fin.numel).content_key != fin.content_key
    with pytest.raises(ValueError, match="does not fit a scratch"):
        fin.inplace_plan(fin.largest_transpose - 1, 16)
    with pytest.raises(ValueError, match="wider than block_cols=8"):
        fin.inplace_plan(fin.numel, 8)


def test_inplace_plan_refuses_layouts_that_cannot_run_in_place():
    # a transpose that reads elsewhere than it writes
    f = finish_ops([(0, 0, 4, 1, 0), (8, 4, 2, 3, 1), (4, 10, 2, 3, 0)], [(0, 16, 0)], ["a", "b", "c"], 16)
    with pytest.raises(ValueError, match="reads elsewhere than it writes"):
        f.inplace_plan(64, 16)
    # a copy reading elements a transpose moves
    f = finish_ops([(4, 0, 4, 1, 0), (4, 4, 2, 3, 1)], [(0, 10, 0)], ["a", "b"], 10)
    with pytest.raises(ValueError, match="op 0 copies from elements another op moves"):
        f.inplace_plan(64, 16)
    # a copy reading what another copy writes
    f = finish_ops([(0, 0, 4, 1, 0), (0, 4, 4, 1, 0), (4, 8, 4, 1, 0)], [(0, 12, 0)], ["a", "b", "c"], 12)
    with pytest.raises(ValueError, match="op 2 copies from elements another op moves"):
        f.inplace_plan(64, 16)
    # a shared A read from a region that is only checked in place: fine
    f = finish_ops([(0, 0, 4, 1, 0), (0, 4, 4, 1, 0), (8, 8, 2, 3, 1)], [(0, 14, 0)], ["a", "b", "c"], 14)
    assert len(f.inplace_plan(64, 16).launches) == 3


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


def _kernel_finish(raw, fin, dtype, device, scratch_elems, max_rank=16, at=192):
    """The raw image placed at ``at`` in a NaN-filled buffer and finished there in place by the kernel; the image
    and the first bad op (None if none)."""
    from multilora.kernels.triton_image_finish import NO_BAD_OP, finish_inplace

    plan = fin.inplace_plan(scratch_elems, block_cols_for(max_rank))
    buffer = torch.full((at + fin.numel + 64,), float("nan"), dtype=dtype, device=device)
    buffer[at : at + fin.numel] = raw.to(device)
    scratch = torch.full((scratch_elems,), float("nan"), dtype=dtype, device=device)
    flags = torch.full((5,), NO_BAD_OP, dtype=torch.int32, device=device)
    finish_inplace(buffer, at, plan, plan.tiles.to(device), scratch, flags, 3)
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
    for scratch in (fin.largest_transpose, 2 * fin.largest_transpose + 64, fin.numel):  # several chunks, then one
        got, bad = _kernel_finish(raw.data, fin, dtype, device, scratch, max_rank)
        assert bad is None and torch.equal(_bits(got), _bits(want.data)), scratch
    key = _poison(d, "layers.0.self_attn.v_proj.lora_B", 2, float("nan"))  # and a second, later one
    _poison(d, "layers.2.mlp.down_proj.lora_A", 0, float("-inf"))
    _, raw = read_image(d, CFG, pool, name="x", raw=True)
    ref = torch.empty_like(raw.data)
    first = finish_torch(raw.data, ref, fin)
    got, bad = _kernel_finish(raw.data, fin, dtype, device, fin.largest_transpose, max_rank)
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


class _Event:
    """A stand-in CUDA event whose completion the test controls."""

    def __init__(self, landed: bool) -> None:
        self.landed = landed

    def query(self) -> bool:
        return self.landed

    def synchronize(self) -> None:
        assert self.landed, "a host wait on work that never completes"


class _InterpOrder(StreamOrder):
    """Claims CUDA on a CPU pool, so the pool takes its device path and runs the finish kernel under
    TRITON_INTERPRET (copies are synchronous there); side-stream events land when the test says."""

    def __init__(self) -> None:
        super().__init__(torch.device("cpu"))
        self.cuda = True
        self.side: list[_Event] = []
        self.current: list[_Event] = []

    def on(self, stream):
        import contextlib

        return contextlib.nullcontext()

    def record(self, stream=None):
        ev = _Event(landed=stream is None)
        (self.side if stream is not None else self.current).append(ev)
        return ev

    def wait(self, event, stream=None):
        pass


def _deferred_case(tmp_path, dtype, device, *, order=None, side=None, pinned=False):
    """Raw images loaded with ``defer_finish``: unfinished (and unchecked) until ``finish_pending`` covers them or
    their copy lands; finished wherever a compaction moved them; ``unpack`` and ``nonfinite`` finish first; a
    poisoned one is reported with its tensor; the pool then holds the host-finished image's bits. The scratch is
    forced small (several chunks)."""
    import multilora.memory.pool as pool_mod

    d = _write(tmp_path / "a", dtype, "uniform")
    pool = AdapterPool(CFG, num_bytes=1 << 20, max_rank=16, dtype=dtype, device=device, order=order)
    _, want = read_image(d, CFG, pool, name="x")
    if pinned:
        from multilora.memory.host_arena import HostArena

        arena = HostArena(None, pinned=True, unit=pool.page_bytes, chunk_bytes=1 << 20)
        out = lambda: arena.alloc(want.nbytes).view(dtype)  # noqa: E731
    else:
        out = lambda: None  # noqa: E731
    raw = [read_image(d, CFG, pool, name=n, raw=True, out=out())[1] for n in ("a", "b", "c")]
    small = raw[0].finish.largest_transpose
    old = pool_mod.scratch_elems
    pool_mod.scratch_elems = lambda config, max_rank: small  # force several gather / transpose chunks
    try:
        first = pool.load(want)  # a finished image below the raw ones: freed later, so a compaction moves them
        sa = pool.load(raw[0], stream=side, defer_finish=True)
        sb = pool.load(raw[1], stream=side, defer_finish=True)
        assert pool.unfinished(sa) and pool.unfinished(sb) and pool.needs_check(sa) and not pool.check_ready(sa)
        if order is not None:  # copies not landed: nothing is finished unless a step needs it
            assert pool.finish_pending() == 0 and pool.unfinished(sa)
        pool.free(first)
        pool.compact()  # moves both unfinished images down (after their copies: the pool waits for them)
        assert pool.extent_of(sa)[0] == 0
        assert pool.finish_pending([sa]) >= 1 and not pool.unfinished(sa)
        assert pool.finish_pending() == (1 if pool.unfinished(sb) else 0) and not pool.unfinished(sb)
        assert len(raw[0].finish.inplace_plan(small, 16).launches) > 3
        assert pool.nonfinite(sa) is None and pool.nonfinite(sb) is None
        for slot in (sa, sb):
            assert torch.equal(_bits(pool.unpack(slot).data.cpu()), _bits(want.data))
        # unpack and nonfinite finish an unfinished slot first
        sc = pool.load(raw[2], stream=side, defer_finish=True)
        assert torch.equal(_bits(pool.unpack(sc).data.cpu()), _bits(want.data)) and not pool.unfinished(sc)
        assert pool.nonfinite(sc) is None
        key = _poison(d, "layers.1.mlp.up_proj.lora_B", 7, float("inf"))
        _, bad = read_image(d, CFG, pool, name="bad", raw=True, out=out())
        sd = pool.load(bad, stream=side, defer_finish=True)
        assert pool.nonfinite(sd) == key and pool.nonfinite(sa) is None
        # a freed unfinished slot is forgotten
        se = pool.load(bad, stream=side, defer_finish=True)
        pool.free(se)
        assert not pool.unfinished(se) and pool.finish_pending() == 0
        # finished at load (no deferral): the same bits
        sf = pool.load(raw[0], stream=side)
        assert not pool.unfinished(sf) and pool.nonfinite(sf) is None
        if device == "cuda":
            torch.cuda.current_stream().wait_stream(side)
        assert torch.equal(_bits(pool.unpack(sf).data.cpu()), _bits(want.data))
    finally:
        pool_mod.scratch_elems = old


@interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_deferred_finish_interpreted(dtype, tmp_path):
    order = _InterpOrder()
    _deferred_case(tmp_path, dtype, "cpu", order=order, side="side")


@interp
def test_events_are_queried_in_order_and_no_further(tmp_path):
    """``finish_pending`` and ``checks_answered`` query the events in the order their work was queued and stop at
    the first one still running (later ones on its stream are not done either): a step makes as few queries as it
    can (each may give the GIL away). Slots a step needs are finished whatever their copy's state."""
    d = _write(tmp_path / "a", torch.float32, "uniform")
    order = _InterpOrder()
    pool = AdapterPool(CFG, num_bytes=1 << 20, max_rank=16, dtype=torch.float32, device="cpu", order=order)
    raw = read_image(d, CFG, pool, name="a", raw=True)[1]
    slots = [pool.load(raw, stream="side", defer_finish=True) for _ in range(4)]
    copies = list(order.side)
    queried = []
    for i, ev in enumerate(copies):
        ev.query = (lambda i=i, ev=ev: queried.append(i) or ev.landed)
    copies[0].landed = True  # the first copy landed, the second not: the third and fourth are not asked
    assert pool.finish_pending() == 1 and queried == [0, 1] and not pool.unfinished(slots[0])
    queried.clear()
    assert pool.finish_pending([slots[3]]) == 1 and queried == [1] and not pool.unfinished(slots[3])
    for ev in copies:
        ev.landed = True
    assert pool.finish_pending() == 2
    assert len(pool._checks) == 4  # the four finishes' checks, in the order they were queued
    first = next(iter(pool._checks))
    pool._checks[first][0].landed = False  # the first check still running: none is answered
    assert pool.checks_answered() == set()
    pool._checks[first][0].landed = True
    assert pool.checks_answered() == set(slots)
    assert all(pool.nonfinite(s) is None for s in slots)


@requires_gpu
@pytest.mark.gpu
def test_cuda_pool_defers_the_finish_of_raw_images(tmp_path):
    """The pool's own path on CUDA: pinned sources, copies on a side stream, finishes on the current stream."""
    _deferred_case(tmp_path, torch.bfloat16, "cuda", side=torch.cuda.Stream(), pinned=True)


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


def test_adapter_finish_option(tmp_path, engine_dir):
    """``adapter_finish``: None by default (device on CUDA without tensor parallelism, host otherwise), "host" or
    "device" on request, anything else refused naming the argument; the CLI flag reaches the config; the memory plan
    counts the pool's scratch exactly when adapters are finished on the device; a CPU engine left at the default
    reads finished (host) images."""
    import argparse

    from multilora.runtime.config import EngineConfig, finish_on_device
    from multilora.runtime.sizing import memory_request
    from multilora.memory.pool import scratch_elems

    assert EngineConfig().adapter_finish is None and EngineConfig(adapter_finish="device").adapter_finish == "device"
    with pytest.raises(ValueError, match=r"Engine: adapter_finish must be None, 'host' or 'device', got 'gpu'"):
        EngineConfig(adapter_finish="gpu")
    with pytest.raises(ValueError, match=r"adapter_finish='device' is not available with tensor_parallel_size=2"):
        EngineConfig(adapter_finish="device", tensor_parallel_size=2)
    # the default's resolution, every case
    cases = {(None, "cuda", 1): True, (None, "cpu", 1): False, (None, "cuda", 2): False, (None, "mps", 1): False,
             ("host", "cuda", 1): False, ("host", "cpu", 1): False, ("device", "cuda", 1): True,
             ("device", "cpu", 1): True, ("host", "cuda", 2): False}
    for (finish, dev_type, tp), want in cases.items():
        assert finish_on_device(EngineConfig(adapter_finish=finish, tensor_parallel_size=tp), dev_type) is want, \
            (finish, dev_type, tp)
    p = argparse.ArgumentParser()
    EngineConfig.add_cli_flags(p)
    assert EngineConfig.from_cli(p.parse_args(["--adapter-finish", "device"])).adapter_finish == "device"
    assert EngineConfig.from_cli(p.parse_args(["--adapter-finish", "host"])).adapter_finish == "host"
    assert EngineConfig.from_cli(p.parse_args([])).adapter_finish is None
    with pytest.raises(SystemExit):
        p.parse_args(["--adapter-finish", "gpu"])
    host = memory_request(CFG, EngineConfig(), dtype=torch.bfloat16, max_seq_len=64)
    dev = memory_request(CFG, EngineConfig(adapter_finish="device"), dtype=torch.bfloat16, max_seq_len=64)
    scratch = scratch_elems(CFG, 64) * 2
    assert dev.activation_bytes - host.activation_bytes == scratch
    assert scratch_elems(CFG, 64) == min(32 << 20, CFG.num_layers * 64 * sum(CFG.module_shape(m)[1] for m in TARGET_MODULES))
    # the default follows the device the plan is for
    cuda_default = memory_request(CFG, EngineConfig(), dtype=torch.bfloat16, max_seq_len=64, device_type="cuda")
    assert cuda_default.activation_bytes == dev.activation_bytes
    cuda_host = memory_request(CFG, EngineConfig(adapter_finish="host"), dtype=torch.bfloat16, max_seq_len=64,
                               device_type="cuda")
    assert cuda_host.activation_bytes == host.activation_bytes
    cuda_tp = memory_request(CFG, EngineConfig(tensor_parallel_size=2), dtype=torch.bfloat16, max_seq_len=64,
                             device_type="cuda")
    assert cuda_tp.activation_bytes == host.activation_bytes
    e = Engine(model=str(engine_dir), progress=False, max_batch_size=2)
    assert e.engine_config.adapter_finish is None and e.device.type == "cpu" and e.raw_reloads is False
    e.close()


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


def test_cuda_plan_counts_the_finish_scratch_after_profiling(monkeypatch):
    """On CUDA the plan is made again with the measured reserve (``measure_and_size``); the profiling forward does not
    allocate the pool's finish scratch, so the second plan adds it (``MemoryRequest.scratch_bytes``) exactly when
    adapters are finished on the device: by default on CUDA, not with ``adapter_finish="host"``. (Run on the CPU: the
    allocator cap is stubbed and the machine is a recorded GPU snapshot.)"""
    from multilora.memory.accounting import MemorySnapshot
    from multilora.memory.pool import scratch_elems, slot_table_bytes
    from multilora.runtime import sizing
    from multilora.runtime.config import EngineConfig

    GiB = 1 << 30
    snap = MemorySnapshot(has_gpu=True, cuda_free_bytes=20 * GiB, cuda_total_bytes=24 * GiB,
                          meminfo_text=f"MemTotal: {64 * GiB // 1024} kB\nMemAvailable: {32 * GiB // 1024} kB\n")
    monkeypatch.setattr(sizing, "apply_torch_memory_fraction", lambda plan, device: None)
    measured = 123 << 20  # what the profiling forward would have measured

    def plan(finish):
        cfg = EngineConfig(adapter_finish=finish, memory_snapshot=snap, max_lora_rank=16)
        req = sizing.memory_request(CFG, cfg, dtype=torch.bfloat16, max_seq_len=64, device_type="cuda")
        sizes = sizing.measure_and_size(req, cfg, torch.device("cuda"), profile_reserve=lambda: measured)
        return req, sizes.plan.options.non_kv_reserve_bytes

    scratch = scratch_elems(CFG, 16) * 2
    (req_default, default), (req_host, host), (req_dev, dev) = plan(None), plan("host"), plan("device")
    assert req_default.scratch_bytes == req_dev.scratch_bytes == scratch > 0 and req_host.scratch_bytes == 0
    slot_table = slot_table_bytes(CFG, sizing.MAX_DEFAULT_SLOTS)  # the pool's, made after the plan too
    assert req_host.slot_table_bytes == req_dev.slot_table_bytes == slot_table > 0
    assert host == measured + req_host.sampling_bytes + slot_table
    assert default == dev == host + scratch


@requires_gpu
@pytest.mark.gpu
def test_cuda_engine_finishes_on_the_device_by_default(engine_dir, tmp_path, monkeypatch):
    """A CUDA engine left at ``adapter_finish=None`` reads adapters from disk raw and finishes them in the pool: the
    tokens are those of a host-finished engine (greedy, fp32), and its plan's reserve holds the finish scratch on
    top of the measured reserve (made fixed here: the profiling forward is stubbed, CUDA graphs off)."""
    from multilora.memory.pool import scratch_elems
    from multilora.runtime.runner import ModelRunner
    from testsupport import write_adapter

    monkeypatch.setattr(ModelRunner, "profile_reserve", lambda self, tokens, block_size: 64 << 20)

    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    runs, reserve = {}, {}
    for finish in (None, "host"):
        e = Engine(model=str(engine_dir), device="cuda", dtype=torch.float32, progress=False, max_batch_size=4,
                   max_seq_len=64, cuda_graphs=False, adapter_finish=finish)
        assert e.raw_reloads is (finish is None) and e.memory_plan is not None
        for i, n in enumerate(["a0", "a1"]):
            if not (tmp_path / n).exists():
                write_adapter(tmp_path / n, e.config, i, 4, ["q_proj", "v_proj", "down_proj"])
            e.load_adapter(n, tmp_path / n, preload=False)  # on the disk tier: the first use reads it
        runs[finish] = [o.token_ids for o in e.generate(prompts, adapters=["a0", "a1"], sampling=sp)]
        reserve[finish] = e.memory_plan.options.non_kv_reserve_bytes
        scratch = scratch_elems(e.config, e.engine_config.max_lora_rank) * 4
        e.close()
    assert runs[None] == runs["host"] and all(len(t) == 6 for t in runs[None])
    assert reserve[None] - reserve["host"] == scratch > 0
