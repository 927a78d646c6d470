"""The adapter's weight file: safetensors (whole, header-only or lazily one tensor at a time) or, when the
caller allows it, a pickle read with ``torch.load(weights_only=True)``.

Both are read with plain reads (:class:`~multilora.runtime.adapters.disk.OpenFile`), never memory-mapped, so a
file rewritten in place while it is read fails that read with an :class:`AdapterError` instead of killing the
process. The safetensors format (https://github.com/huggingface/safetensors): an unsigned little-endian 64-bit
header length ``n``, ``n`` bytes of JSON ``{key: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__":
{str: str}}``, then the data section; offsets count from its start, and the tensors tile it exactly, in
offset order, with ``end - begin == prod(shape) * itemsize``. Everything else is refused, naming the file and
the tensor.
"""

from __future__ import annotations

import io
import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping

import torch

from multilora.runtime.adapters.disk import PICKLE_NAME, SAFETENSORS_NAME, FileStamp, OpenFile, weights_path
from multilora.runtime.adapters.spec import AdapterError, _is_int, _jd

#: safetensors header dtype names (the format's table) -> torch dtypes. F4 / F6 (packed sub-byte) are not read.
_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "BOOL": torch.bool, "C64": torch.complex64}
_ST_DTYPES.update({name: getattr(torch, attr) for name, attr in (
    ("U64", "uint64"), ("U32", "uint32"), ("U16", "uint16"), ("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2"),
    ("F8_E4M3FNUZ", "float8_e4m3fnuz"), ("F8_E5M2FNUZ", "float8_e5m2fnuz"), ("F8_E8M0", "float8_e8m0fnu"))
    if hasattr(torch, attr)})
_ST_NAMES = {dt: name for name, dt in _ST_DTYPES.items()}

#: the largest header read (safetensors refuses larger ones too)
_MAX_HEADER = 100_000_000


def dtype_name(dt: torch.dtype) -> str:
    """A dtype for messages: its safetensors name and its torch name, e.g. ``"F8_E4M3 (torch.float8_e4m3fn)"``."""
    return f"{_ST_NAMES[dt]} ({dt})" if dt in _ST_NAMES else str(dt)


@dataclass(frozen=True)
class _Entry:
    """One tensor of a safetensors header: dtype, shape, and its bytes ``[begin, end)`` as file offsets."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict:
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        raise ValueError(f"duplicate key {next(k for k in keys if keys.count(k) > 1)!r}")
    return dict(pairs)


def _parse_entry(f: OpenFile, key: str, e: Any, data_start: int) -> _Entry:
    """One header entry checked against the format and the file's size."""
    def bad(why: str) -> AdapterError:
        return f.fault(f"cannot read the safetensors file: tensor {key!r}: {why}", key=key)

    if not isinstance(e, dict):
        raise bad(f"expected an object with dtype, shape and data_offsets, got {_jd(e)[:80]}")
    dtype, shape, offs = e.get("dtype"), e.get("shape"), e.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in _ST_DTYPES:
        raise bad(f"dtype {_jd(dtype)[:40]} is not one this runtime reads (known: {', '.join(_ST_DTYPES)})")
    if not (isinstance(shape, list) and all(_is_int(s) and s >= 0 for s in shape)):
        raise bad(f"expected a shape of non-negative integers, got {_jd(shape)[:80]}")
    if not (isinstance(offs, list) and len(offs) == 2 and all(_is_int(o) for o in offs) and 0 <= offs[0] <= offs[1]):
        raise bad(f"expected data_offsets [begin, end] with 0 <= begin <= end, got {_jd(offs)[:80]}")
    nbytes = math.prod(shape) * torch.empty(0, dtype=_ST_DTYPES[dtype]).element_size()
    if offs[1] - offs[0] != nbytes:
        raise bad(f"data_offsets {offs} hold {offs[1] - offs[0]} bytes, but shape {shape} of {dtype} needs {nbytes}")
    if data_start + offs[1] > f.size:
        raise bad(f"data_offsets {offs} run past the end of the file ({f.size - data_start} bytes of data)")
    return _Entry(_ST_DTYPES[dtype], tuple(shape), data_start + offs[0], data_start + offs[1])


def _parse_header(f: OpenFile, header: bytes | None = None) -> dict[str, _Entry]:
    """The tensors of a safetensors file by key, from its header alone (8 + n bytes read; none when the caller
    passes the ``header`` it read: the n bytes after the length, which must be what the file holds)."""
    def bad(why: str) -> AdapterError:
        return f.fault(f"cannot read the safetensors file: {why}")

    if f.size < 8:
        raise bad(f"{f.size} bytes, too short for the 8-byte header length")
    (n,) = struct.unpack("<Q", f.read(0, 8)) if header is None else (len(header),)
    if n > f.size - 8 or n > _MAX_HEADER:
        raise bad(f"the header length {n} runs past the end of the file ({f.size} bytes)" if n > f.size - 8
                  else f"the header length {n} exceeds {_MAX_HEADER} bytes")
    try:
        raw = json.loads((f.read(8, n) if header is None else header).decode("utf-8"), object_pairs_hook=_unique_keys)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise bad(f"the {n}-byte header is not valid JSON: {e}"[:300]) from e
    if not isinstance(raw, dict):
        raise bad(f"expected the header to be a JSON object, got {type(raw).__name__}")
    meta = raw.pop("__metadata__", None)
    if meta is not None and not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
        raise bad(f"expected __metadata__ to be an object of strings, got {_jd(meta)[:80]}")
    entries = {key: _parse_entry(f, key, e, 8 + n) for key, e in raw.items()}
    pos, prev = 8 + n, None  # the tensors tile the data section exactly, in offset order
    for key, e in sorted(entries.items(), key=lambda kv: (kv[1].begin, kv[1].end)):
        if e.begin != pos:
            how = f"overlaps tensor {prev!r}" if e.begin < pos else f"leaves {e.begin - pos} bytes unused before it"
            raise bad(f"tensor {key!r}: data_offsets start at {e.begin - 8 - n}, which {how}")
        pos, prev = e.end, key
    if pos != f.size:
        raise bad(f"the tensors end at data byte {pos - 8 - n}, but the file has {f.size - 8 - n} bytes of data")
    return entries


class _LazyTensors(Mapping):
    """``key -> tensor`` of an open safetensors file, each tensor read (one plain read into a CPU tensor of the
    file's dtype and shape) when asked for, so the fast path validates, checks and packs one tensor while it
    is still in cache instead of holding every tensor of the file first. Keys are sorted, as safetensors lists
    them. ``check_unchanged()`` raises AdapterError if the file changed since it was opened; ``close()``
    closes it.

    With ``scratch`` the tensors are read into two buffers used in turn, so a tensor stays valid only until
    the next-but-one is read (a lora_A / lora_B pair until the next pair): no fresh memory, no page faults, the
    buffer still in cache (what mmap's page-cache mappings gave). Without it every tensor is a fresh one that
    the caller owns."""

    def __init__(self, f: OpenFile, entries: dict[str, _Entry], scratch: bool = False) -> None:
        self._f, self._entries = f, entries
        self.stamp: FileStamp = f.stamp
        self._scratch = [torch.empty(0, dtype=torch.uint8)] * 2 if scratch else None
        self._turn = 0

    def _buffer(self, nbytes: int) -> torch.Tensor:
        if self._scratch is None:
            return torch.empty(nbytes, dtype=torch.uint8)
        self._turn ^= 1
        if self._scratch[self._turn].numel() < nbytes:
            self._scratch[self._turn] = torch.empty(nbytes, dtype=torch.uint8)
        return self._scratch[self._turn][:nbytes]

    def __getitem__(self, key: str) -> torch.Tensor:
        e = self._entries[key]
        buf = self._buffer(e.end - e.begin)
        if e.end > e.begin:
            self._f.read_into(memoryview(buf.numpy()), e.begin)
        return buf.view(e.dtype).reshape(e.shape)

    def meta(self, key: str) -> torch.Tensor:
        """A ``meta`` tensor of the key's shape and dtype (nothing read)."""
        e = self._entries[key]
        return torch.empty(e.shape, dtype=e.dtype, device="meta")

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._entries))

    def __len__(self) -> int:
        return len(self._entries)

    def check_unchanged(self) -> None:
        self._f.check_unchanged()

    def close(self) -> None:
        self._f.close()


def _open_safetensors(path: Path, scratch: bool) -> _LazyTensors:
    f = OpenFile(path)
    try:
        return _LazyTensors(f, _parse_header(f), scratch)
    except BaseException:
        f.close()
        raise


def _read_pickle(pk: Path) -> tuple[dict[str, torch.Tensor], FileStamp]:
    """A pickle weight file, read whole and checked unchanged, then loaded: ``(key -> tensor, stamp)``."""
    with OpenFile(pk) as f:
        data = f.read(0, f.size)
        f.check_unchanged()
    try:
        obj = torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
    except Exception as e:
        raise AdapterError(f"{pk}: cannot load with torch.load(weights_only=True): {e}", path=pk) from e
    if not isinstance(obj, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in obj.items()):
        raise AdapterError(
            f"{pk}: expected a dict of tensor name -> tensor, got {type(obj).__name__}"
            + (" with non-tensor values" if isinstance(obj, dict) else ""),
            path=pk,
        )
    return dict(obj), f.stamp


def require_weights_path(root: Path, allow_pickle: bool = True) -> Path:
    """``weights_path(root)``; AdapterError naming the directory when it holds neither weight file, or naming the
    file when it is only a pickle and not ``allow_pickle``."""
    wpath = weights_path(root)
    if wpath is None:
        raise AdapterError(
            f"{root}: no adapter weights: expected {SAFETENSORS_NAME} (or {PICKLE_NAME}) in the directory, found neither",
            path=root,
        )
    if wpath.name == PICKLE_NAME and not allow_pickle:
        raise AdapterError(
            f"{wpath}: only a pickle weight file was found (no {SAFETENSORS_NAME}); a pickle can run arbitrary "
            "code when loaded, so it is refused by default. If you trust it, pass allow_pickle=True (on the command "
            "line: pass --allow-pickle; it is then read with torch.load(weights_only=True)), or convert it to "
            f"{SAFETENSORS_NAME} (e.g. safetensors.torch.save_file(torch.load(path, weights_only=True), ...))",
            path=wpath,
        )
    return wpath


def _read_weights(root: Path, allow_pickle: bool, header_only: bool = False,
                  lazy: bool = False) -> tuple[Path, Mapping[str, torch.Tensor], list[str], FileStamp]:
    """Read the weight file: ``(path, key -> tensor, keys, stamp)``; ``stamp`` is the file's as it was read.
    Keys are validated by the caller before tensors are used; safetensors keys are listed (sorted) before any
    tensor is read. With ``header_only`` a safetensors file gives ``meta``-device tensors of the header's shapes
    and dtypes (only the header's bytes are read). With ``lazy`` a safetensors file gives a
    :class:`_LazyTensors` reading into two scratch buffers (each tensor valid until the next-but-one is read;
    the caller checks it unchanged and closes it); a pickle file is read whole either way.

    Raises AdapterError: no weight file; a pickle without ``allow_pickle``; an entry that is no readable file;
    a malformed file; a file that changed while it was read. The message names the file."""
    wpath = require_weights_path(root, allow_pickle)
    if wpath.name == PICKLE_NAME:
        tensors, stamp = _read_pickle(wpath)
        return wpath, tensors, list(tensors), stamp
    lazy_tensors = _open_safetensors(wpath, scratch=lazy)
    keys = list(lazy_tensors)
    if lazy:
        return wpath, lazy_tensors, keys, lazy_tensors.stamp
    try:
        out = {k: (lazy_tensors.meta(k) if header_only else lazy_tensors[k]) for k in keys}
        lazy_tensors.check_unchanged()
    finally:
        lazy_tensors.close()
    return wpath, out, keys, lazy_tensors.stamp
