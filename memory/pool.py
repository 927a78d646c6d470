"""The paged adapter weight pool: one buffer of device memory, cut into pages, indexed by slot.

Layout (the contract between this pool and the kernels in ``multilora.kernels``)
---------------------------------------------------------------------------------
The pool is ONE tensor ``buffer`` of shape ``[num_pages, page_elems]`` (dtype = model dtype), allocated
once. A *page* holds ``page_rows`` (R) consecutive **rank-rows** of one adapter, for EVERY layer and
every target module, so a rank-r adapter owns ``ceil(r_max / R)`` pages (``r_max`` = its largest rank
over modules) and any free page can serve any adapter: churn never fragments the pool.

Inside a page, for layer ``l`` and module ``m`` (in ``TARGET_MODULES`` order, layers outermost)::

    [ A rows: R x d_in(m) ][ B^T rows: R x d_out(m) ]      (row-major)

so with ``S(m) = d_in(m) + d_out(m)`` and ``W = sum_m S(m)``::

    offset_a(l, m) = R * (l * W + sum_{m' < m} S(m'))
    offset_b(l, m) = offset_a(l, m) + R * d_in(m)
    page_elems     = R * num_layers * W

Element addresses (int64: ``num_pages * page_elems`` exceeds 2^31 on large pools)::

    A[slot](l, m)[j, k]   = buffer.flat[page_table[slot, j // R] * page_elems + offset_a(l, m) + (j % R) * d_in  + k]
    B[slot](l, m)[n, j]   = buffer.flat[page_table[slot, j // R] * page_elems + offset_b(l, m) + (j % R) * d_out + n]

where ``A`` is PEFT's ``lora_A.weight`` [r, d_in] and ``B`` is ``lora_B.weight`` [d_out, r] (stored
transposed, so the expand kernel reads rows of B^T contiguously). Rank-rows ``j >= rank(l, m)`` of an
adapter's last page are never read; pages never hold scaled weights: the per-(layer, module, slot)
``scalings`` are applied by the kernels.

Worked example (SmolLM2-135M: 30 layers, hidden 576, q 576, k/v 192, MLP 1536; R = 8):
``S = [1152, 768, 768, 1152, 2112, 2112, 2112]``, ``W = 10176``, ``page_elems = 8 * 30 * 10176 =
2,442,240`` (9.8 MB in fp32). An adapter with r = 16 owns 2 pages, say ``page_table[slot] = [5, 2, -1, ...]``.
Its k_proj A row j = 11 of layer 1 lives on page ``page_table[slot, 1] = 2`` at
``offset_a(1, k_proj) = 8 * (1 * 10176 + 1152) = 90,624``, row ``11 % 8 = 3``: elements
``2 * 2,442,240 + 90,624 + 3 * 576 + [0, 576)``.

Metadata tensors (on the pool's device):

- ``page_table``: int32 ``[max_slots, max_pages_per_slot]``, ``-1`` = unused entry.
- ``ranks``: int32 ``[num_layers, 7, max_slots]``; 0 = the slot's adapter does not touch (l, m).
- ``scalings``: float32 ``[num_layers, 7, max_slots]`` (lora_alpha / r, or / sqrt(r) for rsLoRA).

The pool is the only owner of device memory for adapter weights: ``load`` copies into pages and keeps
no reference to the source tensors.
"""

from __future__ import annotations

import math
import threading
from contextlib import nullcontext as _nullcontext
from dataclasses import dataclass
from typing import Mapping, Protocol

import torch

from multilora.config import MODULE_INDEX, TARGET_MODULES, ModelConfig
from multilora.kernels.lora import LoRAModuleView


class PoolFullError(RuntimeError):
    """Not enough free pages or slots in the adapter pool for an adapter."""


class ModuleWeights(Protocol):
    """One (layer, module) of an adapter as ``pack`` reads it (``runtime.adapters.LoRAModuleWeights``)."""

    a: torch.Tensor  # [r, d_in], PEFT's lora_A.weight
    b: torch.Tensor  # [d_out, r], PEFT's lora_B.weight
    scaling: float


class AdapterWeights(Protocol):
    """An adapter as ``pack`` / ``pages_needed`` read it (``runtime.adapters.LoRAAdapter``)."""

    name: str | None
    modules: Mapping[tuple[int, str], ModuleWeights]

    @property
    def max_rank(self) -> int: ...


def host_footprint(nbytes: int, pinned: bool) -> int:
    """Bytes of host memory an allocation of ``nbytes`` really holds.

    Pinned tensors (``pin_memory=True``) come from torch's caching host allocator, which rounds every block up
    to the next power of two (``PowerOf2Ceil`` in ``aten/src/ATen/core/CachingHostAllocator.h``, torch 2.4-2.11
    default), so an 84 MB Llama-3-8B rank-16 page image pins 128 MiB. Pageable memory is counted as asked.
    """
    if not pinned or nbytes <= 0:
        return max(nbytes, 0)
    return 1 << (nbytes - 1).bit_length()


@dataclass
class PackedAdapter:
    """An adapter laid out as the pool's pages, ready to copy in (the host tier's format).

    ``pages``: ``[num_pages, page_elems]`` in the pool dtype, on the CPU (pinned when the pool is on
    CUDA, so host -> GPU copies can be asynchronous); ``ranks`` int32 / ``scalings`` float32
    ``[num_layers, 7]``. Loading it is one contiguous copy per page plus the metadata.
    """

    pages: torch.Tensor
    ranks: torch.Tensor
    scalings: torch.Tensor
    max_rank: int
    name: str | None = None

    @property
    def num_pages(self) -> int:
        return int(self.pages.shape[0])

    @property
    def nbytes(self) -> int:
        return self.pages.numel() * self.pages.element_size()

    @property
    def footprint(self) -> int:
        """Host bytes the image holds (``host_footprint``: ``nbytes`` rounded up to a power of two when pinned):
        what the host tier's byte budget counts."""
        return host_footprint(self.nbytes, self.pages.is_pinned())


class PagePacker:
    """Builds one adapter's page image (a :class:`PackedAdapter`) module by module, copying straight from the
    source tensors: one copy for A and one for B^T over a module's full pages (plus one each for a partial
    last page). Sources may have any floating dtype; each value is rounded once, to the pool dtype.

    The image is allocated uninitialised (pinned when the pool is on CUDA) and every element is written
    once: the rows a module has, zeros for its rank-rows ``>= r``, and zeros for the modules never ``put``
    (in ``finish``), so the result equals ``torch.zeros`` + copies bit for bit without a zero-fill pass.
    The copies are torch ops (they release the GIL). Not thread-safe; one packer per adapter (packers of
    one pool may run in parallel threads).
    """

    def __init__(self, pool: "AdapterPool", max_rank: int, name: str | None) -> None:
        self.pool = pool
        self.name = name
        self.max_rank = max_rank
        npg = pool.pages_for_rank(max_rank, pool.page_rows)
        self.pages = torch.empty(npg, pool.page_elems, dtype=pool.dtype, pin_memory=pool.device.type == "cuda")
        nl, nm = pool.config.num_layers, len(TARGET_MODULES)
        self.ranks = torch.zeros(nl, nm, dtype=torch.int32)
        self.scalings = torch.zeros(nl, nm, dtype=torch.float32)
        self._written: set[tuple[int, str]] = set()

    def put(self, layer: int, module: str, a: torch.Tensor, b: torch.Tensor, scaling: float) -> None:
        """Write (layer, module)'s ``a`` [r, d_in] (PEFT's lora_A) and ``b`` [d_out, r] (lora_B; stored
        transposed) into the image. The tensors are copied; they are not kept.

        Raises:
            ValueError: shapes that do not fit the module, a rank above the packer's, or a module put twice.
        """
        pool = self.pool
        oa, ob, d_in, d_out = pool._layout[(layer, module)]
        r = int(a.shape[0])
        if a.shape != (r, d_in) or b.shape != (d_out, r) or not 0 < r <= self.max_rank:
            raise ValueError(
                f"adapter {self.name!r}: {module} of layer {layer}: expected A [r, {d_in}] and B [{d_out}, r] with "
                f"0 < r <= {self.max_rank}, got A {list(a.shape)} and B {list(b.shape)}"
            )
        if (layer, module) in self._written:
            raise ValueError(f"adapter {self.name!r}: {module} of layer {layer} packed twice")
        self._written.add((layer, module))
        R = pool.page_rows
        pages = self.pages
        pe = pages.shape[1]
        # B is stored transposed: its copies are strided (element by element); narrowing the dtype first (one
        # contiguous pass) makes them cheaper, widening happens in them (measured, bench/bench_adapter_load.py)
        if pages.element_size() < b.element_size():
            b = b.to(pages.dtype)
        bt = b.t()  # [r, d_out]
        full = r // R  # page p holds rank-rows p*R .. p*R + R - 1: pages [0, full) are full, one copy for all
        if full:  # (as_strided: the same views as slicing + view, in one call; this runs ~10^3 times per adapter)
            s0, s1 = b.stride()
            pages.as_strided((full, R, d_in), (pe, d_in, 1), oa).copy_(a[: full * R].reshape(full, R, d_in))
            pages.as_strided((full, R, d_out), (pe, d_out, 1), ob).copy_(
                b.as_strided((full, R, d_out), (R * s1, s1, s0), b.storage_offset()))
        rows = r - full * R
        if rows:  # the last, partial page: its rows, then zeros for rank-rows >= r
            page = pages[full]
            page[oa : oa + rows * d_in].view(rows, d_in).copy_(a[full * R :])
            page[ob : ob + rows * d_out].view(rows, d_out).copy_(bt[full * R :])
            page[oa + rows * d_in : oa + R * d_in].zero_()
            page[ob + rows * d_out : ob + R * d_out].zero_()
            full += 1
        if full < pages.shape[0]:  # pages past this module's rank (another module has a larger one): zeros
            pages[full:, oa : oa + R * d_in].zero_()
            pages[full:, ob : ob + R * d_out].zero_()
        mi = MODULE_INDEX[module]
        self.ranks[layer, mi] = r
        self.scalings[layer, mi] = float(scaling)

    def finish(self) -> PackedAdapter:
        """Zero the regions of the modules never ``put`` (rank 0, never read) and return the image."""
        pool = self.pool
        R = pool.page_rows
        start = None  # coalesce runs of untouched modules: they are contiguous in the layout
        end = 0
        for layer in range(pool.config.num_layers):
            for module in TARGET_MODULES:
                lo = pool.offset_a(layer, module)
                hi = lo + R * sum(pool.config.module_shape(module))
                if (layer, module) in self._written:
                    if start is not None:
                        self.pages[:, start:end].zero_()
                        start = None
                    continue
                if start is None:
                    start = lo
                end = hi
        if start is not None:
            self.pages[:, start:end].zero_()
        return PackedAdapter(pages=self.pages, ranks=self.ranks, scalings=self.scalings,
                             max_rank=int(self.ranks.max()), name=self.name)


class AdapterPool:
    """A fixed pool of ``num_pages`` pages for adapter weights (layout in the module docstring).

    Args:
        config: the base model's configuration (layers, module shapes).
        num_pages: pages in the pool; the pool takes ``num_pages * page_bytes`` bytes, allocated now.
        page_rows: rank-rows per page (R). A rank-r adapter wastes less than one page.
        max_rank: the largest rank an adapter may have (sets ``max_pages_per_slot``).
        max_slots: most adapters resident at once (default: ``num_pages``).
        dtype, device: of the buffer (the model's).

    Raises:
        ValueError: a non-positive size.

    Thread safety: ``load``/``free`` hold an internal lock; readers of the metadata tensors must not
    race with ``free`` of a slot they use (the adapter cache guarantees this with refcounts).
    """

    def __init__(
        self,
        config: ModelConfig,
        *,
        num_pages: int,
        page_rows: int = 8,
        max_rank: int = 256,
        max_slots: int | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        for arg, val in (("num_pages", num_pages), ("page_rows", page_rows), ("max_rank", max_rank)):
            if not isinstance(val, int) or val <= 0:
                raise ValueError(f"AdapterPool: {arg} must be a positive int, got {val!r}")
        self.config = config
        self.page_rows = page_rows
        self.max_rank = max_rank
        self.num_pages = num_pages
        self.max_slots = max_slots if max_slots is not None else num_pages
        if self.max_slots <= 0:
            raise ValueError(f"AdapterPool: max_slots must be positive, got {self.max_slots}")
        self.max_pages_per_slot = math.ceil(max_rank / page_rows)
        self.dtype = dtype
        self.device = torch.device(device)

        sizes = [sum(config.module_shape(m)) for m in TARGET_MODULES]
        self._layer_width = sum(sizes)
        prefix = [0]
        for s in sizes[:-1]:
            prefix.append(prefix[-1] + s)
        self._module_prefix = prefix
        self.page_elems = page_rows * config.num_layers * self._layer_width
        #: (layer, module) -> (offset_a, offset_b, d_in, d_out), for the packer's per-module hot path
        self._layout = {(layer, m): (self.offset_a(layer, m), self.offset_b(layer, m), *config.module_shape(m))
                        for layer in range(config.num_layers) for m in TARGET_MODULES}

        # Uninitialised on purpose (no pages touched until used): ``load`` writes every row a kernel may
        # read (rank-rows >= r of a written module are zero-filled up to the page boundary; modules an
        # adapter does not touch have rank 0 and are never read).
        self.buffer = torch.empty(num_pages, self.page_elems, dtype=dtype, device=self.device)
        nl, nm = config.num_layers, len(TARGET_MODULES)
        self.page_table = torch.full(
            (self.max_slots, self.max_pages_per_slot), -1, dtype=torch.int32, device=self.device
        )
        self.ranks = torch.zeros(nl, nm, self.max_slots, dtype=torch.int32, device=self.device)
        self.scalings = torch.zeros(nl, nm, self.max_slots, dtype=torch.float32, device=self.device)

        self._free_pages: list[int] = list(range(num_pages - 1, -1, -1))  # pop() gives low pages first
        self._free_slots: list[int] = list(range(self.max_slots - 1, -1, -1))
        self._slot_pages: dict[int, list[int]] = {}
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ accounting
    @property
    def page_bytes(self) -> int:
        """Bytes of one page (``page_elems * element size``)."""
        return self.page_elems * self.buffer.element_size()

    @property
    def bytes_total(self) -> int:
        return self.num_pages * self.page_bytes

    @property
    def pages_used(self) -> int:
        return self.num_pages - len(self._free_pages)

    @property
    def pages_free(self) -> int:
        return len(self._free_pages)

    @property
    def slots_used(self) -> int:
        return len(self._slot_pages)

    def pages_of(self, slot: int) -> list[int]:
        """The page table of a resident slot (a copy), in rank-row order."""
        return list(self._slot_pages[slot])

    def resident_slots(self) -> list[int]:
        return sorted(self._slot_pages)

    @staticmethod
    def pages_for_rank(rank: int, page_rows: int) -> int:
        return max(1, math.ceil(rank / page_rows))

    def pages_needed(self, adapter: "AdapterWeights") -> int:
        """Pages an adapter takes: ``ceil(max rank over its modules / page_rows)``, at least 1."""
        return self.pages_for_rank(adapter.max_rank, self.page_rows)

    def can_fit(self, adapter: "AdapterWeights") -> bool:
        return bool(self._free_slots) and self.pages_needed(adapter) <= len(self._free_pages)

    # ------------------------------------------------------------------ layout
    def offset_a(self, layer: int, module: str) -> int:
        """Element offset of (layer, module)'s A rows inside a page."""
        return self.page_rows * (layer * self._layer_width + self._module_prefix[MODULE_INDEX[module]])

    def offset_b(self, layer: int, module: str) -> int:
        """Element offset of (layer, module)'s B^T rows inside a page."""
        return self.offset_a(layer, module) + self.page_rows * self.config.module_shape(module)[0]

    def module_view(self, layer: int, module: str) -> LoRAModuleView:
        d_in, d_out = self.config.module_shape(module)
        mi = MODULE_INDEX[module]
        return LoRAModuleView(
            buffer=self.buffer,
            page_table=self.page_table,
            ranks=self.ranks[layer, mi],
            scalings=self.scalings[layer, mi],
            offset_a=self.offset_a(layer, module),
            offset_b=self.offset_b(layer, module),
            d_in=d_in,
            d_out=d_out,
            page_rows=self.page_rows,
            page_elems=self.page_elems,
            layer=layer,
            module=module,
        )

    # ------------------------------------------------------------------ load / free
    def pack(self, adapter: "AdapterWeights") -> PackedAdapter:
        """Lay an adapter out as pool pages on the host (see ``PackedAdapter``).

        Rank-rows ``r <= j < pages * R`` of every module the adapter touches are zero; regions of modules
        it does not touch are zero and never read (rank 0).

        Raises:
            ValueError: its rank exceeds ``max_rank``.
        """
        packer = self.packer(adapter.max_rank, name=adapter.name)
        for (layer, module), w in adapter.modules.items():
            packer.put(layer, module, w.a, w.b, w.scaling)
        return packer.finish()

    def packer(self, max_rank: int, *, name: str | None = None) -> "PagePacker":
        """A :class:`PagePacker` for an adapter whose largest rank is ``max_rank`` (what ``pack`` uses;
        ``load_peft_adapter_into`` streams a file's modules into one).

        Raises:
            ValueError: ``max_rank`` exceeds the pool's ``max_rank``.
        """
        if max_rank > self.max_rank:
            raise ValueError(f"adapter {name!r}: rank {max_rank} exceeds the pool's max_rank {self.max_rank}")
        return PagePacker(self, max_rank, name)

    def load(self, adapter: "AdapterWeights | PackedAdapter", *, stream: "torch.cuda.Stream | None" = None) -> int:
        """Copy an adapter into free pages; return its slot.

        Args:
            adapter: a ``LoRAAdapter`` (packed first) or a ``PackedAdapter``.
            stream: a CUDA stream for the page copies (asynchronous from pinned memory); the caller must
                make the consuming stream wait for it (``torch.cuda.Event``) before reading the slot.

        Raises:
            ValueError: the adapter's rank exceeds ``max_rank`` or its page size differs from the pool's.
            PoolFullError: not enough free pages or slots (nothing is changed).
        """
        packed = adapter if isinstance(adapter, PackedAdapter) else self.pack(adapter)
        if packed.pages.shape[1] != self.page_elems:
            raise ValueError(f"adapter {packed.name!r}: packed for another pool layout ({packed.pages.shape[1]} != {self.page_elems} elements per page)")
        need = packed.num_pages
        with self._lock:
            if not self._free_slots or need > len(self._free_pages):
                raise PoolFullError(
                    f"adapter pool full: adapter {packed.name!r} needs {need} page(s) and a slot; "
                    f"{len(self._free_pages)} page(s) and {len(self._free_slots)} slot(s) free"
                )
            slot = self._free_slots.pop()
            pages = [self._free_pages.pop() for _ in range(need)]
            self._slot_pages[slot] = pages
        try:
            self._write(slot, pages, packed, stream)
        except BaseException:
            self.free(slot)
            raise
        return slot

    def _write(self, slot: int, pages: list[int], packed: PackedAdapter, stream: "torch.cuda.Stream | None") -> None:
        ctx = torch.cuda.stream(stream) if stream is not None else _nullcontext()
        with ctx:
            for i, p in enumerate(pages):  # one contiguous copy per page, straight into the pool
                self.buffer[p].copy_(packed.pages[i], non_blocking=stream is not None)
        row = torch.full((self.max_pages_per_slot,), -1, dtype=torch.int32)
        row[: len(pages)] = torch.tensor(pages, dtype=torch.int32)
        self.ranks[:, :, slot] = packed.ranks.to(self.device)
        self.scalings[:, :, slot] = packed.scalings.to(self.device)
        self.page_table[slot] = row.to(self.device)

    def unpack(self, slot: int, name: str | None = None) -> PackedAdapter:
        """Copy a resident slot's pages and metadata back to the host (the inverse of ``load``)."""
        pages = self._slot_pages[slot]
        idx = torch.tensor(pages, dtype=torch.long, device=self.device)
        host = torch.empty(len(pages), self.page_elems, dtype=self.dtype, pin_memory=self.device.type == "cuda")
        host.copy_(self.buffer.index_select(0, idx))
        # copies, not views: on a CPU pool .cpu() would alias the metadata that free() / the next load rewrite
        ranks = self.ranks[:, :, slot].to("cpu", copy=True)
        scalings = self.scalings[:, :, slot].to("cpu", copy=True)
        return PackedAdapter(pages=host, ranks=ranks, scalings=scalings, max_rank=int(ranks.max()), name=name)

    def free(self, slot: int) -> None:
        """Return a slot's pages to the free list. Raises KeyError if the slot is not resident."""
        with self._lock:
            pages = self._slot_pages.pop(slot)
            self.page_table[slot] = -1
            self.ranks[:, :, slot] = 0
            self.scalings[:, :, slot] = 0.0
            self._free_pages.extend(reversed(pages))
            self._free_slots.append(slot)
