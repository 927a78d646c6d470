"""``OpenFile.read_scatter``: the scatter read behind the adapter cache's disk -> host path. It must fill every
buffer with exactly the file's consecutive bytes whatever ``preadv`` returns (short reads ending inside or
between buffers, more buffers than one call takes), and fail like ``read_into`` at the end of the file; and
``read_image``'s scatter path must give the same image as its tensor-by-tensor path, bit for bit."""

from __future__ import annotations

import os
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from multilora.runtime.adapters import AdapterError, disk
from multilora.runtime.adapters.disk import OpenFile

needs_preadv = pytest.mark.skipif(not hasattr(os, "preadv"), reason="the scatter path needs os.preadv")


def _file(tmp_path, n: int, seed: int = 0):
    data = random.Random(seed).randbytes(n)
    p = tmp_path / "w.bin"
    p.write_bytes(data)
    os.utime(p, (0, 0))  # old: no settle wait
    return p, data


@needs_preadv
@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(0, 300), min_size=1, max_size=40), offset=st.integers(0, 50),
       caps=st.lists(st.integers(1, 400), min_size=1, max_size=8), iov_max=st.integers(1, 5))
def test_scatter_fills_every_buffer_through_short_reads(tmp_path_factory, sizes, offset, caps, iov_max):
    path, data = _file(tmp_path_factory.mktemp("f"), offset + sum(sizes) + 7)
    real, calls = os.preadv, []

    def short_preadv(fd, bufs, pos):  # at most caps[i] bytes per call, cycling: reads that stop anywhere
        assert len(bufs) <= iov_max
        cap = caps[len(calls) % len(caps)]
        calls.append(len(bufs))
        left, out = cap, []
        for b in bufs:
            if left <= 0:
                break
            out.append(b[: min(len(b), left)])
            left -= len(out[-1])
        return real(fd, out, pos)

    bufs = [bytearray(n) for n in sizes]
    saved = (disk._IOV_MAX, os.preadv)
    disk._IOV_MAX, os.preadv = iov_max, short_preadv
    try:
        with OpenFile(path) as f:
            f.read_scatter([memoryview(b) for b in bufs], offset)
    finally:
        disk._IOV_MAX, os.preadv = saved
    assert b"".join(bufs) == data[offset : offset + sum(sizes)]


@needs_preadv
def test_scatter_past_the_end_fails_like_read_into(tmp_path):
    path, data = _file(tmp_path, 100)
    with OpenFile(path) as f:
        with pytest.raises(AdapterError, match="short"):
            f.read_scatter([memoryview(bytearray(60)), memoryview(bytearray(60))], 0)
        with pytest.raises(AdapterError, match="short"):
            f.read_into(memoryview(bytearray(120)), 0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("scratch_bytes", [64, 1 << 20])  # a lora_B group per read / all of them in one
def test_scatter_image_equals_per_tensor_image(dtype, scratch_bytes, tmp_path, monkeypatch):
    from test_adapter_fastpath import CFG, _pool, _write_patterned

    from multilora.runtime.adapters import image
    from multilora.runtime.adapters.image import read_image

    d = _write_patterned(tmp_path / "a", dtype)
    pool = _pool(dtype)
    monkeypatch.setattr(image, "_SCATTER", False)
    want = read_image(d, CFG, pool, name="x")[1]
    monkeypatch.setattr(image, "_SCATTER", True)
    monkeypatch.setattr(image, "_SCATTER_BYTES", scratch_bytes)
    monkeypatch.setattr(image, "_BATCH_B_BYTES", 0)  # the groups path (the batched one ignores _SCATTER_BYTES)
    for verified in (False, True):
        out = torch.full_like(want.data, float("nan"))  # every element written
        got = read_image(d, CFG, pool, name="x", out=out, verified=verified)[1]
        assert torch.equal(got.data.view(torch.uint8), want.data.view(torch.uint8))

