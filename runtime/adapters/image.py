"""disk -> host, the fast way: a safetensors adapter read straight into its pool image (the adapter cache's reload).

What :func:`read_image` does, per (layer, module) in the image's order (layers, then ``TARGET_MODULES``):

- lora_A ``[r, d_in]`` is row-major in the file exactly as the image's A region is, so when the file dtype is the
  pool dtype its bytes are read (one ``preadv``) **straight into the image**: no scratch buffer, no copy;
- lora_B ``[d_out, r]`` is read into a per-thread scratch buffer and copied transposed into the image's B^T
  region (one vectorised ``copy_``, converting the dtype in the same pass when the file's differs);
- the padding up to the page boundary is zeroed;

then the values are checked finite with ONE ``aminmax`` over the whole image (NaN propagates, +-inf are the
extremes; the padding is zeros), instead of one reduction per tensor. A tensor whose file dtype differs from the
pool dtype (float32 / bfloat16 / float16, all exact in float32) is read into scratch, checked there in the file
dtype (as :func:`~multilora.runtime.adapters.load.read_packed_adapter` checks it) and converted once by the copy.
Other files (a pickle, float64 or float8 tensors) take :func:`read_packed_adapter`, the general path, with the
same ``out``. The header, keys, shapes and dtypes are validated from the header alone first, by the same code as
every other load (:func:`~multilora.runtime.adapters.load._build_modules` on ``meta`` tensors), so a file is
refused with the same messages; a non-finite value is reported naming the tensor, as there. The file is read
with plain reads (never memory-mapped) and refused "changed while it was being read" if its stamp moved.

The image is bit-identical to ``read_packed_adapter``'s (``tests/test_adapter_tiers.py``). Measured against a
plain sequential read of the same files in ``bench/bench_adapter_load.py``.
"""

from __future__ import annotations

import math
import os
import threading
from pathlib import Path

import numpy as np
import torch

from multilora.config import MODULE_INDEX, ModelConfig
from multilora.memory.pool import AdapterPool, PackedAdapter
from multilora.runtime.adapters.disk import OpenFile, weights_path
from multilora.runtime.adapters.files import SAFETENSORS_NAME, _Entry, _parse_header
from multilora.runtime.adapters.load import (_EXACT_IN_F32, LoRAAdapter, _build_modules, _match_keys, _read_spec,
                                             read_packed_adapter)
from multilora.runtime.adapters.spec import AdapterError

_scratch = threading.local()


def _scratch_bytes(nbytes: int) -> torch.Tensor:
    """A per-thread ``uint8`` scratch buffer of at least ``nbytes``, grown to powers of two from 64 KiB and never
    shrunk: one lora_B (Llama-3-8B's largest at r = 64 is 1.8 MB), per I/O thread."""
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.numel() < nbytes:
        buf = _scratch.buf = torch.empty(max(1 << (max(nbytes, 1) - 1).bit_length(), 1 << 16), dtype=torch.uint8)
    return buf[:nbytes]


def _read(f: OpenFile, e: _Entry, into: torch.Tensor) -> None:
    """The entry's bytes into the contiguous tensor ``into`` (exactly ``e.end - e.begin`` bytes)."""
    if e.end > e.begin:
        f.read_into(memoryview(into.view(torch.uint8).numpy()), e.begin)


def _nonfinite(wpath: Path, key: str, x: torch.Tensor, numel: int | None = None) -> AdapterError:
    bad = int((~torch.isfinite(x)).sum())
    return AdapterError(f"{wpath}: tensor {key!r}: expected finite values, got {bad} non-finite (NaN/inf) of "
                        f"{numel if numel is not None else x.numel()}", path=wpath, key=key)


def _finite(x: torch.Tensor) -> bool:
    if x.numel() == 0:
        return True
    lo, hi = torch.aminmax(x)
    return math.isfinite(float(lo)) and math.isfinite(float(hi))


#: same-size integer dtypes: a transposed copy between bit patterns (numpy's strided copy loop is 1.3-4x faster than
#: torch's for the small ranks of LoRA, measured on the CPU in /tmp; both release the GIL)
_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _transpose_into(bt: torch.Tensor, b: torch.Tensor) -> None:
    """``bt [r, d_out] = b [d_out, r]^T``: as bit patterns with numpy when the dtypes match, else torch's
    converting ``copy_`` (the dtype rounded once)."""
    if b.dtype == bt.dtype:
        bits = _BITS[b.element_size()]
        np.copyto(bt.view(bits).numpy(), b.view(bits).numpy().T)
    else:
        bt.copy_(b.t())


def read_image(path: str | os.PathLike, config: ModelConfig, pool: AdapterPool, *, name: str | None = None,
               allow_pickle: bool = False, out: torch.Tensor | None = None) -> tuple[LoRAAdapter, PackedAdapter | None]:
    """disk -> host: read, validate and lay out an adapter as its ``pool`` image, the fast way (module docstring).

    Args:
        out: the image's destination, a 1-D CPU tensor of the pool dtype and exactly the image's size (the adapter
            cache passes a block of the pinned host arena); default a fresh tensor.
        path, config, pool, name, allow_pickle: as for
            :func:`~multilora.runtime.adapters.load.read_packed_adapter`.

    Returns:
        ``(adapter, packed)`` as :func:`read_packed_adapter`: ``packed`` is None when the adapter's rank exceeds
        ``pool.max_rank``, else its ``data`` is ``out`` (or the fresh tensor) holding the image.

    Raises:
        AdapterError: as :func:`read_packed_adapter` (the files, the header, keys, shapes, dtypes, non-finite
            values, a file that changed while it was read). ValueError: an ``out`` of the wrong size or dtype.
    """
    root, cfg_path, raw, spec, targets, cfg_stamp = _read_spec(path, config)
    wpath = weights_path(root)
    if wpath is None or wpath.name != SAFETENSORS_NAME:  # no file (its error) or a pickle: the general path
        return read_packed_adapter(path, config, pool, name=name, allow_pickle=allow_pickle, out=out)
    try:
        f = OpenFile(wpath)
        try:
            try:
                result = _read_open(f, root, wpath, raw, spec, targets, cfg_path, cfg_stamp, config, pool, name, out)
                f.check_unchanged()
            except AdapterError:
                f.check_unchanged()  # a file written while it was read explains any error on its values better
                raise
        finally:
            f.close()
    except AdapterError as fast:
        # the error path is rare: the general path names the same problem the way every other load does (it
        # checks each module's values before the next one's shape, where this one checks every shape first)
        read_packed_adapter(path, config, pool, name=name, allow_pickle=allow_pickle)
        raise fast
    if result is None:  # float64 / float8 tensors: rounded through float32 by the general path
        return read_packed_adapter(path, config, pool, name=name, allow_pickle=allow_pickle, out=out)
    return result


def _read_open(f, root, wpath, raw, spec, targets, cfg_path, cfg_stamp, config, pool, name, out):
    entries = _parse_header(f)
    keys = sorted(entries)
    metas = {k: torch.empty(e.shape, dtype=e.dtype, device="meta") for k, e in entries.items()}
    modules, _ = _build_modules(wpath, metas, keys, targets, config, spec, cfg_path)  # keys, shapes, dtypes
    adapter = LoRAAdapter(name=name, path=str(root), config=raw, modules=modules, files=(cfg_stamp, f.stamp))
    if any(e.dtype not in _EXACT_IN_F32 for e in entries.values()):
        return None
    if adapter.max_rank > pool.max_rank:
        return adapter, None
    found = _match_keys(wpath, keys, targets, config, cfg_path)
    order = {m: MODULE_INDEX[config.lora_slices(m)[0]] for m in config.lora_modules}  # as _build_modules
    targeted = sorted(targets, key=lambda lm: (lm[0], order[lm[1]]))
    ranks = {(layer, part): targets[(layer, module)].r for layer, module in targeted
             for part in config.lora_slices(module)}
    packer = pool.packer(ranks, name=name, out=out)
    dtype = pool.dtype
    direct: list[tuple[str, list[torch.Tensor]]] = []  # (key, its regions in the image) checked at the end
    for layer, module in targeted:
        scaling = float(modules[(layer, config.lora_slices(module)[0])].scaling)
        parts = config.lora_slices(module)
        regions = [packer.regions(layer, part, scaling) for part in parts]
        key_a, key_b = found[(layer, module)]["A"], found[(layer, module)]["B"]
        ea, eb = entries[key_a], entries[key_b]
        a0 = regions[0][0]
        if ea.dtype == dtype:  # straight into the image
            _read(f, ea, a0)
            direct.append((key_a, [a0]))
        else:
            a = _scratch_bytes(ea.end - ea.begin).view(ea.dtype).view(ea.shape)
            _read(f, ea, a)
            if not _finite(a):
                raise _nonfinite(wpath, key_a, a)
            a0.copy_(a)
        for a_other, _ in regions[1:]:  # a fused projection's slices share A
            a_other.copy_(a0)
        b = _scratch_bytes(eb.end - eb.begin).view(eb.dtype).view(eb.shape)  # [d_out, r]
        _read(f, eb, b)
        if eb.dtype != dtype and not _finite(b):
            raise _nonfinite(wpath, key_b, b)
        row = 0
        for part, (_, bt) in zip(parts, regions):
            rows = config.module_shape(part)[1]
            _transpose_into(bt, b[row : row + rows])
            row += rows
        if eb.dtype == dtype:
            direct.append((key_b, [bt for _, bt in regions]))
    converted = any(e.dtype != dtype for e in entries.values())  # a narrowing conversion may overflow to inf
    if converted or not _finite(packer.data):  # else one pass over the whole image (its padding is zeros)
        for key, views in direct:
            if not all(_finite(v) for v in views):
                x = views[0] if len(views) == 1 else torch.cat([v.t() for v in views])
                raise _nonfinite(wpath, key, x, math.prod(entries[key].shape))
        if not converted:
            raise AssertionError("a non-finite value outside every checked region")  # the padding is zeros
    return adapter, packer.finish()
