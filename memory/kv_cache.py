"""KV cache of fixed capacity: one row of ``max_seq_len`` positions per running sequence.

Storage is allocated once: ``k`` and ``v`` are ``[num_layers, num_rows, max_seq_len, num_kv_heads,
head_dim]``. A sequence takes a free row when it is admitted and returns it when it finishes.
(A paged, block-table cache replaces this in the GPU-engine issue; the interface — allocate a sequence,
write keys/values at positions, read a batch's context — stays.)
"""

from __future__ import annotations

import threading

import torch


class KVCacheFullError(RuntimeError):
    """No free KV row."""


class KVCache:
    """Fixed-capacity KV storage.

    Args:
        num_layers, num_kv_heads, head_dim: the model's.
        num_rows: sequences that can be cached at once.
        max_seq_len: positions per row (prompt + generated tokens).
        dtype, device: of the storage.
    """

    def __init__(
        self,
        *,
        num_layers: int,
        num_rows: int,
        max_seq_len: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        if num_rows <= 0 or max_seq_len <= 0:
            raise ValueError(f"KVCache: num_rows and max_seq_len must be positive, got {num_rows}, {max_seq_len}")
        shape = (num_layers, num_rows, max_seq_len, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.num_rows = num_rows
        self.max_seq_len = max_seq_len
        self._free = list(range(num_rows - 1, -1, -1))
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    @property
    def rows_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        """Take a free row. Raises KVCacheFullError when none is free."""
        with self._lock:
            if not self._free:
                raise KVCacheFullError(f"KV cache full: all {self.num_rows} rows are in use")
            return self._free.pop()

    def free(self, row: int) -> None:
        with self._lock:
            if row in self._free or not 0 <= row < self.num_rows:
                raise ValueError(f"KVCache.free: row {row} is not allocated")
            self._free.append(row)

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """K and V bytes one token takes over all layers."""
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
