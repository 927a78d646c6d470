"""The adapter's weight file: safetensors (whole, header-only or lazily one tensor at a time) or, when the
caller allows it, a pickle read with ``torch.load(weights_only=True)``."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator, Mapping

import torch

from multilora.runtime.adapters.spec import AdapterError

SAFETENSORS_NAME = "adapter_model.safetensors"
PICKLE_NAME = "adapter_model.bin"


#: safetensors header dtype names (https://github.com/huggingface/safetensors, format spec) -> torch dtypes
_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "BOOL": torch.bool}

class _LazyTensors(Mapping):
    """``key -> tensor`` of an open safetensors file, each tensor read (``safe_open.get_tensor``) when first
    asked for, so the fast path validates, checks and packs one tensor while it is still in cache instead of
    holding every tensor of the file first. ``close()`` releases the safetensors handle."""

    def __init__(self, handle: Any, path: Path, keys: list[str]) -> None:
        self._f, self._path, self._keys = handle, path, keys
        self._keyset = set(keys)

    def __getitem__(self, key: str) -> torch.Tensor:
        if key not in self._keyset:
            raise KeyError(key)
        try:
            return self._f.get_tensor(key)
        except Exception as e:  # I/O errors surface here instead of in _read_weights
            raise AdapterError(f"{self._path}: cannot read the safetensors file: {e}", path=self._path) from e

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def close(self) -> None:
        self._f.__exit__(None, None, None)


def _read_weights(root: Path, allow_pickle: bool, header_only: bool = False,
                  lazy: bool = False) -> tuple[Path, Mapping[str, torch.Tensor], list[str]]:
    """Read the weight file: ``(path, key -> tensor, keys in file order)``. Keys are validated by the caller
    before tensors are used; safetensors keys are listed before any tensor is read. With ``header_only``
    a safetensors file gives ``meta``-device tensors of the header's shapes and dtypes (no data is read).
    With ``lazy`` a safetensors file gives a :class:`_LazyTensors` (the caller closes it); a pickle file is
    read whole either way."""
    st = root / SAFETENSORS_NAME
    pk = root / PICKLE_NAME
    if st.is_file():
        try:
            from safetensors import safe_open

            if lazy:
                f = safe_open(str(st), framework="pt", device="cpu")
                keys = list(f.keys())
                return st, _LazyTensors(f, st, keys), keys
            with safe_open(str(st), framework="pt", device="cpu") as f:
                keys = list(f.keys())
                if header_only:
                    out = {}
                    for k in keys:
                        sl = f.get_slice(k)
                        out[k] = torch.empty(sl.get_shape(), dtype=_ST_DTYPES.get(sl.get_dtype(), torch.uint8), device="meta")
                    return st, out, keys
                return st, {k: f.get_tensor(k) for k in keys}, keys
        except Exception as e:  # safetensors raises its own error types for corrupt headers
            raise AdapterError(f"{st}: cannot read the safetensors file: {e}", path=st) from e
    if pk.is_file():
        if not allow_pickle:
            raise AdapterError(
                f"{pk}: only a pickle weight file was found (no {SAFETENSORS_NAME}); a pickle can run arbitrary "
                "code when loaded, so it is refused by default. If you trust it, pass allow_pickle=True (it is "
                f"then read with torch.load(weights_only=True)), or convert it to {SAFETENSORS_NAME} "
                "(e.g. safetensors.torch.save_file(torch.load(path, weights_only=True), ...))",
                path=pk,
            )
        try:
            obj = torch.load(pk, weights_only=True, map_location="cpu")
        except Exception as e:
            raise AdapterError(f"{pk}: cannot load with torch.load(weights_only=True): {e}", path=pk) from e
        if not isinstance(obj, dict) or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in obj.items()
        ):
            raise AdapterError(
                f"{pk}: expected a dict of tensor name -> tensor, got {type(obj).__name__}"
                + (" with non-tensor values" if isinstance(obj, dict) else ""),
                path=pk,
            )
        return pk, dict(obj), list(obj)
    raise AdapterError(
        f"{root}: no adapter weights: expected {SAFETENSORS_NAME} (or {PICKLE_NAME}) in the directory, found neither",
        path=root,
    )
